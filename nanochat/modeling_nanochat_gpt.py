"""
nanochat's GPT as a transformers model (remote code), for models with parts transformers' own NanoChat lacks.

The parts: qk_scale, layer scalars, value embeddings, sliding windows. `scripts/export_model.py --layout=remote`
writes this file beside the weights, with the text of nanochat/gpt.py's architecture part in place of the import line
marked below, and config.json's auto_map points at its two classes:

    AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)

So the exported file imports nothing of nanochat (it travels alone) and computes what nanochat computes, by the same
code: the parameters (build_parameters, under nanochat's names: the weights are saved as nanochat holds them), the
blocks and the transformer around them (hidden_states), the soft-capped head. Only the cache is transformers': keys
and values go into the Cache it is given (a DynamicCache by default). Here in the repository the line imports
nanochat.gpt, so the tests run this file as it will be exported.

Batches: rows of one length. A padded attention_mask (zeros) is refused: positions and the attention are causal
over every token, as nanochat's are. Tested with transformers 5.24.
"""

# what nanochat/gpt.py's architecture part uses (an export writes its text in place of the nanochat.gpt line below)
from collections import namedtuple  # noqa: F401
from dataclasses import asdict, dataclass, fields  # noqa: F401  (fields: NanoChatGPTConfig too)
from functools import partial  # noqa: F401

import torch
import torch.nn as nn  # noqa: F401
import torch.nn.functional as F  # noqa: F401
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

# nanochat.gpt's architecture: an export writes its text here (nanochat/hf_format.py, modeling_source)
from nanochat.gpt import GPTConfig, SOFTCAP, attention, build_parameters, hidden_states, rotary, softcapped, weights_of

# the output field that carries the cache: "cache" in recent transformers releases, "past_key_values" before
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class NanoChatGPTConfig(PretrainedConfig):
    """GPTConfig's fields, with its defaults (whatever fields it has), plus the RMSNorm eps and the logit soft cap."""

    model_type = "nanochat_gpt"
    attribute_map = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                     "num_key_value_heads": "n_kv_head", "max_position_embeddings": "sequence_len"}

    def __init__(self, rms_norm_eps=None, final_logit_softcapping=SOFTCAP, tie_word_embeddings=False, use_cache=True,
                 **kwargs):
        for field in fields(GPTConfig):
            setattr(self, field.name, kwargs.pop(field.name, field.default))
        if rms_norm_eps is not None or final_logit_softcapping != SOFTCAP or tie_word_embeddings:
            raise ValueError(f"nanochat's GPT computes rms_norm_eps=None (F.rms_norm's default), "
                             f"final_logit_softcapping={SOFTCAP} and an untied head; got {rms_norm_eps}, "
                             f"{final_logit_softcapping}, {tie_word_embeddings}")
        self.rms_norm_eps = None
        self.final_logit_softcapping = SOFTCAP
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=False, **kwargs)


class NanoChatGPTForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = NanoChatGPTConfig
    _no_split_modules = ["Block"]

    def __init__(self, config):
        super().__init__(config)
        build_parameters(self, config)
        self.post_init()

    def _init_weights(self, module):
        """For a model made from a config alone (loading replaces all of it): the layer scalars as the identity."""
        super()._init_weights(module)
        if module is self and self.config.layer_scalars:
            with torch.no_grad():
                self.resid_lambdas.fill_(1.0)
                self.x0_lambdas.fill_(0.0)

    def get_input_embeddings(self):
        return self.transformer.wte

    def set_input_embeddings(self, value):
        self.transformer.wte = value

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                use_cache=None, labels=None, logits_to_keep=0, inputs_embeds=None, **kwargs):
        """
        input_ids (B, T): the new tokens (those after the cache's). Returns CausalLMOutputWithPast: logits (B, T or
        logits_to_keep, vocab) in fp32, the cache, and with labels (B, T) (-100 = ignore) the next-token loss.
        """
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("nanochat's GPT takes input_ids (its value embeddings look tokens up): not inputs_embeds")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("nanochat's GPT attends causally over every token: padded batches (an attention_mask with "
                             "zeros) are not supported; run prompts of different lengths one at a time")
        cache = cache if cache is not None else past_key_values  # its name before transformers renamed it `cache`
        if cache is None and (self.config.use_cache if use_cache is None else use_cache):
            cache = DynamicCache(config=self.config)
        cfg = self.config
        T = input_ids.size(1)
        if position_ids is None:
            t0 = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(t0, t0 + T, device=input_ids.device)[None]
        dtype = self.transformer.wte.weight.dtype
        cos_sin = [table.to(dtype) for table in rotary(position_ids, cfg.n_embd // cfg.n_head, cfg.rope_base)]
        if cache is None:
            attend = lambda i, q, k, v, window: attention(q, k, v, window=window)
        else:
            attend = lambda i, q, k, v, window: attention(q, *cache.update(k, v, i), window=window)
        x = hidden_states(weights_of(self), input_ids, cos_sin, attend, cfg)
        if isinstance(logits_to_keep, int):
            x = x[:, -logits_to_keep:] if logits_to_keep else x
        else:
            x = x[:, logits_to_keep]
        logits = softcapped(self.lm_head(x))
        loss = None if labels is None else self.loss_function(logits, labels, cfg.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})
