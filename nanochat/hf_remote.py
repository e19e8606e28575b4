"""
The remote-code layout of export_model and import_model: for models with parts transformers' NanoChat cannot hold
(qk_scale, layer scalars, value embeddings; hf_format.settings_without_equivalent), a Hugging Face directory whose
config.json names our own modeling file, nanochat/modeling_nanochat_gpt.py, copied beside the weights. transformers
loads it with trust_remote_code=True. The weights keep nanochat's names; config.json holds GPTConfig's fields as
they are, plus the RMSNorm epsilon (null: F.rms_norm's default) and the soft cap.

Like hf_format, no transformers import: the modeling file is copied as text, never imported here.
"""

import os

import torch

from nanochat.common import UserError
from nanochat.hf_format import MODEL_CONFIG_KEYS, RMS_NORM_EPS, SOFTCAP, generation_config

MODELING_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "modeling_nanochat_gpt.py")
MODELING_FILE = "modeling_nanochat_gpt.py"  # its name in the exported directory
MODEL_TYPE = "nanochat_gpt"
CONFIG_CLASS, MODEL_CLASS = "NanoChatGPTConfig", "NanoChatGPTForCausalLM"
# the GPTConfig fields the modeling file computes with: a field added to GPTConfig must be added there, then here
GPT_KEYS = MODEL_CONFIG_KEYS + ("rope_base", "qk_scale", "layer_scalars", "value_embeds")


def remote_config(model_config, tokenizer, dtype):
    """config.json of the remote-code layout for our model_config (GPTConfig.to_dict())."""
    unknown = [f"{k}={v!r}" for k, v in model_config.items() if k not in GPT_KEYS]
    if unknown:
        raise UserError(f"the model's setting {', '.join(unknown)} is not computed by {MODELING_FILE} (it knows "
                        f"{', '.join(GPT_KEYS)}): this model cannot be exported")
    stem = MODELING_FILE.removesuffix(".py")
    return {
        "architectures": [MODEL_CLASS],
        "model_type": MODEL_TYPE,
        "auto_map": {"AutoConfig": f"{stem}.{CONFIG_CLASS}", "AutoModelForCausalLM": f"{stem}.{MODEL_CLASS}"},
        **model_config,
        "rms_norm_eps": None,  # F.rms_norm's default, as GPT's norm
        "final_logit_softcapping": SOFTCAP,
        "tie_word_embeddings": False,
        "use_cache": True,
        **generation_config(tokenizer),
        "pad_token_id": None,  # as in the plain layout: the pad id lives in generation_config.json
        "dtype": dtype,
    }


def model_config_from_remote(config, where):
    """Our model_config from a remote-code layout's config.json dict; what our GPT cannot reproduce is a UserError."""
    missing = [key for key in GPT_KEYS if key not in config]
    if missing:
        raise UserError(f"{where} lacks {', '.join(missing)}: not a config.json of export_model --layout=remote")
    kinds = {**dict.fromkeys(MODEL_CONFIG_KEYS, int), "rope_base": (int, float), "qk_scale": (int, float),
             "layer_scalars": bool, "value_embeds": bool}
    wrong = [f"{key}={config[key]!r}" for key, kind in kinds.items() if not isinstance(config[key], kind)]
    if wrong:
        raise UserError(f"{where} has {', '.join(wrong)}: not a nanochat GPT's setting, cannot import it")
    checks = [("final_logit_softcapping", config.get("final_logit_softcapping"), SOFTCAP),
              ("tie_word_embeddings", config.get("tie_word_embeddings", False), False)]
    for key, value, ours in checks:
        if value != ours:
            raise UserError(f"{where} has {key}={value!r}; nanochat's GPT computes {key}={ours!r}: cannot import it")
    eps = config.get("rms_norm_eps")
    if eps is not None and not (isinstance(eps, (int, float)) and 0 <= eps <= 1e-5):
        raise UserError(f"{where} has rms_norm_eps={eps!r}; nanochat's RMSNorm uses {RMS_NORM_EPS:.3g}: cannot import it")
    return {key: config[key] for key in GPT_KEYS}


def gpt_weight_names(model_config):
    """The names in the state dict of a GPT of model_config (built on the meta device: no memory, no init)."""
    from nanochat.gpt import GPT, GPTConfig
    try:
        with torch.device("meta"):
            return list(GPT(GPTConfig(**model_config)).state_dict())
    except ValueError as e:  # shapes that do not fit together
        raise UserError(f"the model config {model_config} is not a nanochat GPT's: {e}") from None
