"""
Converts models to and from the Hugging Face `NanoChat` format (transformers >= 5.0), for export and import.

For export_model and import_model: config.json (transformers' NanoChat, or our own modeling file: the remote
layout), the weights' names, tokenizer.json and the chat template, the model card (README.md, from the run report's
state), safetensors files read and written without the `safetensors` package, and directories written all or
nothing. Pure data mapping, no transformers import: exporting needs none of the Hugging Face libraries. How each
part maps, and the two differences that remain in the tokenizer: docs/export.md.
"""

import contextlib
import errno
import json
import math
import os
import shutil
import tempfile
from dataclasses import fields

import torch

from nanochat.files import DiskFull, get_base_dir, out_of_space
from nanochat.gpt import GPT, RMS_EPS, SOFTCAP, GPTConfig
from nanochat.output import UserError
from nanochat.report import report_card, states, values
from nanochat.tokenizer import SPECIAL_TOKENS, Tokenizer

GPT_FIELDS = {field.name: field for field in fields(GPTConfig)}  # rope_base's default: HF's default rope_theta too
# GPTConfig's fields for transformers' NanoChat: the sizes it holds as they are (those of 2025), the rotary base it
# holds as rope_theta, and the rest (the 2026 parts, and any field added since), which it holds only at GPTConfig's
# defaults: a model with another value of one exports with our own modeling file, the remote layout below.
MODEL_CONFIG_KEYS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")
HF_ONLY_AT_DEFAULT = {name: f.default for name, f in GPT_FIELDS.items()
                      if name not in MODEL_CONFIG_KEYS + ("rope_base",)}

# -----------------------------------------------------------------------------
# Weights


LAYER_WEIGHTS = [("attn.c_q", "self_attn.q_proj"), ("attn.c_k", "self_attn.k_proj"), ("attn.c_v", "self_attn.v_proj"),
                 ("attn.c_proj", "self_attn.o_proj"), ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")]  # (ours, HF)


def weight_names(n_layer):
    """[(our name, HF name)] of every weight of an n_layer model."""
    return ([("transformer.wte.weight", "model.embed_tokens.weight")]
            + [(f"transformer.h.{i}.{ours}.weight", f"model.layers.{i}.{hf}.weight")
               for i in range(n_layer) for ours, hf in LAYER_WEIGHTS]
            + [("lm_head.weight", "lm_head.weight")])


def check_weight_names(names, n_layer, hf, where, expected=None):
    """
    Every weight of an n_layer model (HF names if `hf`, else ours), or of `expected`, must be in `names`, and nothing
    else.
    """
    expected = expected or [pair[1 if hf else 0] for pair in weight_names(n_layer)]
    missing = [name for name in expected if name not in names]
    unknown = sorted(set(names) - set(expected))
    if missing or unknown:
        listed = missing or unknown
        what = (f"lacks {', '.join(listed[:3])}" if missing
                else f"has weights a nanochat model does not: {', '.join(listed[:3])}")
        raise UserError(f"{where} {what}" + (f" (and {len(listed) - 3} more)" if len(listed) > 3 else ""))


def rename_weights(state, n_layer, to_hf, where):
    """Our state dict -> HF names (to_hf=True), or HF's -> ours; checked with check_weight_names first."""
    check_weight_names(state, n_layer, hf=not to_hf, where=where)
    mapping = dict(weight_names(n_layer)) if to_hf else {hf: ours for ours, hf in weight_names(n_layer)}
    return {mapping[name]: tensor for name, tensor in state.items()}


# -----------------------------------------------------------------------------
# config.json


def hf_config(model_config, tokenizer, dtype, layout="hf"):
    """
    config.json for our model_config (GPTConfig.to_dict()). A setting this format cannot hold is a UserError
    naming it. layout "mlx": mlx-lm's nanochat model reads the rotary base from a top-level rope_theta.
    """
    lacking = settings_without_equivalent(model_config)
    # GPTConfig's fields are computed by our own modeling file (the remote layout); anything else by nothing
    if lacking:
        fix = ("export it with --layout=remote (transformers, trust_remote_code=True)"
               if lacking.keys() <= HF_ONLY_AT_DEFAULT.keys() else "this model cannot be exported")
        raise UserError(f"the model's setting {', '.join(f'{k}={v!r}' for k, v in lacking.items())} "
                        f"has no equivalent in the Hugging Face NanoChat format (nor mlx-lm's): {fix}")
    c = model_config
    config = {
        "architectures": ["NanoChatForCausalLM"], "model_type": "nanochat",
        "vocab_size": c["vocab_size"], "hidden_size": c["n_embd"], "intermediate_size": 4 * c["n_embd"],
        "num_hidden_layers": c["n_layer"], "num_attention_heads": c["n_head"], "num_key_value_heads": c["n_kv_head"],
        "max_position_embeddings": c["sequence_len"],
        "hidden_act": "relu2", "attention_dropout": 0.0, "attention_bias": False, "rms_norm_eps": RMS_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(c["rope_base"])},
        "final_logit_softcapping": SOFTCAP, "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True,
        **generation_config(tokenizer),  # our Engine stops on either of its eos ids
        # no pad id: HF makes it the embedding's padding_idx, whose row a finetune would then never update
        "pad_token_id": None,
        "dtype": dtype,
    }
    if layout == "mlx":
        config["rope_theta"] = float(c["rope_base"])
    return config


def settings_without_equivalent(model_config):
    """{setting: value} of model_config that the NanoChat format (transformers' and mlx-lm's) cannot hold."""
    return {k: v for k, v in model_config.items()
            if k not in MODEL_CONFIG_KEYS + ("rope_base",)
            and not (k in HF_ONLY_AT_DEFAULT and HF_ONLY_AT_DEFAULT[k] == v)}


def model_config_from_hf(config, where):
    """Our model_config from an HF config.json dict; a setting our GPT cannot reproduce is a UserError naming it."""
    if config.get("model_type") != "nanochat":
        raise UserError(f"{where} is a {config.get('model_type')!r} model, not 'nanochat': "
                        f"only NanoChat models can be imported")
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        model_config = dict(sequence_len=int(config.get("max_position_embeddings", 2048)),
                            vocab_size=int(config["vocab_size"]),
                            n_layer=int(config["num_hidden_layers"]), n_head=heads,
                            n_kv_head=int(config.get("num_key_value_heads") or heads), n_embd=hidden)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{where} lacks a usable {e}: not a NanoChat config") from None
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", GPT_FIELDS["rope_base"].default))
    checks = [  # (key, value in the file, what our GPT computes)
        ("hidden_act", config.get("hidden_act", "relu2"), "relu2"),
        ("intermediate_size", config.get("intermediate_size", 8192), 4 * hidden),
        ("attention_bias", config.get("attention_bias", False), False),
        ("tie_word_embeddings", config.get("tie_word_embeddings", False), False),
        ("final_logit_softcapping", config.get("final_logit_softcapping", SOFTCAP), SOFTCAP),
        ("rope_parameters.rope_type", rope.get("rope_type", "default"), "default"),
        ("head_dim", config.get("head_dim", hidden // heads), hidden // heads),
    ]
    check_computes(where, checks, config.get("rms_norm_eps", 1e-6))
    if not (isinstance(theta, (int, float)) and theta > 0):
        raise UserError(f"{where} has rope_theta={theta!r}: not a rotary base, cannot import it")
    return dict(model_config, rope_base=float(theta))


def check_computes(where, checks, eps):
    """
    UserError unless every (key, value in the file, what our GPT computes) of `checks` agrees, and the file's
    rms_norm_eps `eps` is one our RMSNorm matches: F.rms_norm adds 1.2e-7, and an epsilon up to 1e-5 changes
    unit-scale activations by < 1e-5 relative.
    """
    for key, value, ours in checks:
        if value != ours:
            raise UserError(f"{where} has {key}={value!r}; nanochat's GPT computes {key}={ours!r}: cannot import it")
    if not (isinstance(eps, (int, float)) and 0 <= eps <= 1e-5):
        raise UserError(f"{where} has rms_norm_eps={eps!r}; nanochat's RMSNorm uses {RMS_EPS:.3g}: cannot import it")


# -----------------------------------------------------------------------------
# The remote-code layout: config.json names our own modeling file (modeling_source), which transformers runs with
# trust_remote_code=True; nanochat's weight names, GPTConfig's fields as they are (docs/export.md)

MODELING_FILE = "modeling_nanochat_gpt.py"  # its name in nanochat/ and in an exported directory
REMOTE_MODEL_TYPE = "nanochat_gpt"
REMOTE_CLASSES = ("NanoChatGPTConfig", "NanoChatGPTModel", "NanoChatGPTForCausalLM")  # AutoConfig, AutoModel, ...


def package_file(name):
    """The text of the file `name` of the nanochat package (gpt.py, the modeling file, the chat template)."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), name), encoding="utf-8") as f:
        return f.read()


def architecture_source():
    """The text of gpt.py's architecture part: its "# ==== ARCHITECTURE (" line to its "ARCHITECTURE END" line."""
    gpt = package_file("gpt.py").splitlines(keepends=True)
    marks = [[i for i, line in enumerate(gpt) if line.startswith("# ====") and mark in line]
             for mark in ("ARCHITECTURE (", "ARCHITECTURE END")]
    if [len(found) for found in marks] != [1, 1]:
        raise RuntimeError("gpt.py's ARCHITECTURE lines are not there once each")
    return "".join(gpt[marks[0][0]:marks[1][0] + 1])


def modeling_source():
    """
    The modeling file as an export holds it: nanochat/modeling_nanochat_gpt.py with its one `from nanochat.gpt
    import` statement (its lines up to the one that ends it with ")") replaced by architecture_source(): the
    architecture is written once, and the exported file runs without nanochat.
    """
    modeling = package_file(MODELING_FILE).splitlines(keepends=True)
    imports = [i for i, line in enumerate(modeling) if line.startswith("from nanochat.gpt import ")]
    if len(imports) != 1:
        raise RuntimeError(f"{MODELING_FILE} must import nanochat.gpt in one statement")
    end = imports[0]
    if "(" in modeling[end]:  # a parenthesised import: to its closing line
        while ")" not in modeling[end]:
            end += 1
    return "".join(modeling[:imports[0]]) + architecture_source() + "".join(modeling[end + 1:])


def remote_config(model_config, tokenizer, dtype):
    """config.json of the remote-code layout for our model_config (GPTConfig.to_dict())."""
    stem = MODELING_FILE.removesuffix(".py")
    return {
        "architectures": [REMOTE_CLASSES[2]], "model_type": REMOTE_MODEL_TYPE,
        # AutoModel before AutoModelForCausalLM: vLLM takes the first AutoModel* entry to check the backend flags
        "auto_map": {"AutoConfig": f"{stem}.{REMOTE_CLASSES[0]}", "AutoModel": f"{stem}.{REMOTE_CLASSES[1]}",
                     "AutoModelForCausalLM": f"{stem}.{REMOTE_CLASSES[2]}"},
        **model_config,
        "rms_norm_eps": None,  # F.rms_norm's default, as GPT's norm
        "final_logit_softcapping": SOFTCAP, "tie_word_embeddings": False, "use_cache": True,
        **generation_config(tokenizer),
        "pad_token_id": None,  # as in the plain layout: the pad id lives in generation_config.json
        "dtype": dtype,
    }


def model_config_from_remote(config, where):
    """
    Our model_config from a remote-code layout's config.json (a field it lacks: GPTConfig's default); what our GPT
    cannot reproduce is a UserError.
    """
    missing = [key for key in MODEL_CONFIG_KEYS if key not in config]
    if missing:
        raise UserError(f"{where} lacks {', '.join(missing)}: not a config.json of export_model --layout=remote")
    model_config = {name: config.get(name, f.default) for name, f in GPT_FIELDS.items()}
    kinds = {int: int, float: (int, float), bool: bool, str: str}  # JSON writes 100000.0 as it likes
    wrong = [f"{k}={v!r}" for k, v in model_config.items()
             if isinstance(v, bool) != (GPT_FIELDS[k].type is bool) or not isinstance(v, kinds[GPT_FIELDS[k].type])]
    if wrong:
        raise UserError(f"{where} has {', '.join(wrong)}: not a nanochat GPT's setting, cannot import it")
    eps = config.get("rms_norm_eps")  # None: F.rms_norm's default, which is ours
    check_computes(where, [("final_logit_softcapping", config.get("final_logit_softcapping"), SOFTCAP),
                           ("tie_word_embeddings", config.get("tie_word_embeddings", False), False)],
                   RMS_EPS if eps is None else eps)
    return model_config


def gpt_weight_names(model_config):
    """The names in the state dict of a GPT of model_config (built on the meta device: no memory, no init)."""
    try:
        with torch.device("meta"):
            return list(GPT(GPTConfig(**model_config)).state_dict())
    except ValueError as e:  # shapes that do not fit together
        raise UserError(f"the model config {model_config} is not a nanochat GPT's: {e}") from None


# -----------------------------------------------------------------------------
# tokenizer.json, tokenizer_config.json, generation_config.json (the chat template: chat_template.jinja)


def bytes_to_unicode():
    """GPT-2's byte-level alphabet: byte -> a printable character (the byte itself when printable, else 256 + n)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def bpe_merges(mergeable_ranks):
    """
    The merge list of a rank-based (tiktoken) BPE: every split of a token into two tokens, ordered by the rank of
    the token they make (splits of one token by the ranks of their halves). Applying merges in this order picks, at
    each step, the adjacent pair that makes the lowest-ranked token, which is tiktoken's rule.
    """
    merges = []
    for token in sorted(mergeable_ranks, key=mergeable_ranks.get):
        splits = [(token[:i], token[i:]) for i in range(1, len(token))
                  if token[:i] in mergeable_ranks and token[i:] in mergeable_ranks]
        merges += sorted(splits, key=lambda pair: (mergeable_ranks[pair[0]], mergeable_ranks[pair[1]]))
    return merges


def tokenizer_json(tokenizer):
    """The `tokenizers` library's tokenizer.json (a dict) equivalent to `tokenizer` (how: docs/export.md)."""
    alphabet = bytes_to_unicode()
    text = lambda token: "".join(alphabet[b] for b in token)
    bos = "<|bos|>"
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for name, i in tokenizer.get_special_tokens().items()],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": tokenizer.pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [tokenizer.get_bos_token_id()], "tokens": [bos]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {text(token): rank for token, rank in tokenizer.mergeable_ranks.items()},
                  "merges": [[text(a), text(b)] for a, b in bpe_merges(tokenizer.mergeable_ranks)]},
    }


def tokenizer_from_json(data, where):
    """Our Tokenizer from a tokenizer.json dict of a byte-level, rank-ordered BPE (what tokenizer_json writes)."""
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise UserError(f"{where} is not a byte-level BPE tokenizer.json (no BPE model with a vocab)")
    inverse = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {}
    for text, rank in model["vocab"].items():
        if any(c not in inverse for c in text):
            raise UserError(f"{where}: token {text!r} is not in the byte-level alphabet: not a byte-level BPE")
        ranks[bytes(inverse[c] for c in text)] = rank
    steps = (data.get("pre_tokenizer") or {}).get("pretokenizers") or []
    split = steps[0] if steps else {}
    pattern = (split.get("pattern") or {}).get("Regex") if split.get("type") == "Split" else None
    if pattern is None or len(steps) != 2 or steps[1].get("type") != "ByteLevel":
        raise UserError(f"{where}: the pre-tokenizer is not a Split regex followed by ByteLevel, as nanochat's is")
    n = len(ranks)
    added = {t.get("content"): t.get("id") for t in data.get("added_tokens") or []}
    expected = {name: n + i for i, name in enumerate(SPECIAL_TOKENS)}
    if added != expected:
        raise UserError(f"{where}: the added tokens are {added}, nanochat needs exactly {expected}")
    # tiktoken merges by rank: the merge list must make tokens in increasing rank order to mean the same
    last = -1
    for merge in model.get("merges") or []:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        made = model["vocab"].get(left + right)
        if made is None or made < last:
            raise UserError(f"{where}: the merge {left!r} + {right!r} is "
                            f"{'not in the vocabulary' if made is None else 'out of rank order'}: "
                            f"not a rank-ordered (tiktoken-style) BPE")
        last = made
    try:
        return Tokenizer(ranks, pattern=pattern)
    except ValueError as e:
        raise UserError(f"{where}: {e}") from None


def tokenizer_config(sequence_len):
    """tokenizer_config.json: the generic fast tokenizer class (no custom code) and the special tokens' roles."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|assistant_end|>",
        "pad_token": "<|bos|>",  # batched generation needs one; attention masks hide it
        "add_bos_token": True,  # informative: transformers takes <|bos|> from tokenizer.json's post-processor
        "clean_up_tokenization_spaces": False, "model_max_length": sequence_len,
        "model_input_names": ["input_ids", "attention_mask"],
    }


def generation_config(tokenizer):
    """generation_config.json: stop where our Engine stops (<|assistant_end|> or <|bos|>)."""
    special = tokenizer.get_special_tokens()
    return {"bos_token_id": special["<|bos|>"], "eos_token_id": [special["<|assistant_end|>"], special["<|bos|>"]],
            "pad_token_id": special["<|bos|>"]}


# The chat template: Tokenizer.render_conversation in Jinja, with add_generation_prompt render_for_completion
# (docs/export.md)
CHAT_TEMPLATE = package_file("chat_template.jinja")


# -----------------------------------------------------------------------------
# README.md, the model card: what an exported model is, how it was trained and how it scored, from what this machine
# recorded (the checkpoint's meta file and those it was trained from, the run report's state); whatever is not
# recorded says "not recorded", nothing is estimated.

NOT_RECORDED = "not recorded"


def trained_on(stage, meta):
    """One line: how much this stage trained on, from its meta file's step count and batch settings."""
    if meta is None:
        return f"{NOT_RECORDED} (its checkpoint is not on this machine)"
    if "imported_from" in meta:
        origin = meta["imported_from"]
        name = os.path.basename(str(origin.get("path")))  # not the full path: a model card gets published
        return f"imported from a {origin.get('format')} directory ({name}); its training is {NOT_RECORDED} here"
    config = meta.get("user_config") or {}
    step = meta.get("step")
    units = {"base": ("total_batch_size", "tokens"), "mid": ("total_batch_size", "tokens"),
             "sft": ("examples_per_step", "conversations"), "rl": ("prompts_per_step", "problems")}
    key, unit = units.get(stage, (None, None))
    if not isinstance(step, int) or key not in config:
        return NOT_RECORDED
    return f"{step:,} steps x {config[key]:,} {unit} = {step * config[key]:,} {unit}"


def evaluation_lines():
    """The run report's card (nanochat.report.report_card) and the model each evaluation section names, or []."""
    sections = states(os.path.join(get_base_dir(), "report"))
    card = report_card(sections)
    if not card:
        return []
    found = {name: values(state) for name, state in sorted(sections.items())}
    evaluated = [f"- {name}: {section['model']}" for name, section in found.items()
                 if "evaluation" in name and "model" in section]
    return ["From the run report (`$NANOCHAT_BASE_DIR/report/`): the latest evaluation of each stage logged there.", "",
            *card, "", "The evaluated models:", *evaluated]


def model_card(meta, lineage, model, tokenizer, dtype, layout):
    """
    The README.md text. meta: load_model's meta of the exported checkpoint; lineage: lineage() of it (this checkpoint
    first, then the models it was trained from).
    """
    c = model.config
    source = lineage[0][0]
    name = f"nanochat {source} {meta.get('model_tag')} step {meta.get('step')}"
    lines = [
        f"# {name}",
        "",
        "A small chat model trained from scratch with nanochat, exported by `python -m scripts.export_model`.",
        "",
        "## Model",
        "",
        "| parameters | layers | width | query heads | key/value heads | context | vocabulary | weights |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {model.num_params():,} | {c.n_layer} | {c.n_embd} | {c.n_head} | {c.n_kv_head} | {c.sequence_len} | "
        f"{c.vocab_size:,} | {dtype} |",
        "",
        "## Training",
        "",
        "| stage | model | trained on |",
        "| --- | --- | --- |",
        *[f"| {stage} | {tag} step {step} | {trained_on(stage, m)} |" for stage, tag, step, m in lineage],
        "",
        "## Evaluation",
        "",
        *(evaluation_lines() or [f"{NOT_RECORDED} (no report card in this machine's run report)"]),
        "",
    ]
    trust = ", trust_remote_code=True" if layout == "remote" else ""  # the tokenizer too: it reads config.json's class
    code = ["```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "path = \"path/to/this/directory\"",
            f"tokenizer = AutoTokenizer.from_pretrained(path{trust})",
            f"model = AutoModelForCausalLM.from_pretrained(path{trust})",
            "messages = [{\"role\": \"user\", \"content\": \"Why is the sky blue?\"}]",
            "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\", "
            "return_dict=True)",
            "output = model.generate(**inputs, max_new_tokens=128)",
            "print(tokenizer.decode(output[0, inputs[\"input_ids\"].shape[1]:], skip_special_tokens=True))",
            "```",
            ""]
    if layout == "mlx":
        lines += ["## Use", "",
                  "This directory keeps nanochat's weight names, which mlx-lm's `nanochat` model reads:", "",
                  "    mlx_lm.generate --model path/to/this/directory --prompt \"Hello\"", "",
                  "transformers cannot load it (it expects `model.layers.*` names): "
                  "export with `--layout=hf` for that.", ""]
    elif layout == "remote":
        lines += ["## Use", "",
                  "This model has parts transformers' NanoChat model lacks (q/k scale, layer scalars, value",
                  "embeddings or sliding windows), so its code comes with it: `modeling_nanochat_gpt.py` here, which",
                  "transformers runs with `trust_remote_code=True` (it is code: read it first), and so does vLLM's",
                  "Transformers backend: `vllm serve path/to/this/directory --trust-remote-code --model-impl",
                  "transformers`. mlx-lm cannot run this model.", "", *code]
    else:
        lines += ["## Use", "", "transformers >= 5.0 loads it with no custom code:", "", *code]
    lines += [
        "## Differences from nanochat's own chat",
        "",
        "- nanochat's Engine runs the calculator tool (`<|python_start|>...<|python_end|>`) and writes its result into",
        "  the reply; other tools do not, so answers that use the tool differ.",
        "- The tokenizer here turns special-token strings typed in text (e.g. `<|bos|>`) into special tokens;",
        "  nanochat encodes them as plain text.",
        f"- Vocabulary: {tokenizer.get_vocab_size():,} tokens, <|bos|> = {tokenizer.get_bos_token_id()} starts every "
        "sequence (the tokenizer adds it); generation stops at <|assistant_end|> or <|bos|>.",
        "",
    ]
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# safetensors: an 8-byte little-endian header length, a JSON header {name: {"dtype", "shape", "data_offsets"}}, the
# tensors' raw bytes; a large model in several files listed by model.safetensors.index.json (docs/export.md). Then
# directories written all or nothing (staged_directory).

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER = 100 * 2**20  # a header is JSON text about the tensors: more than this is not a safetensors file


def save_safetensors(tensors, path):
    """Write {name: tensor} to `path` (tensors stored as they are: cast them first)."""
    header, offset = {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}  # older readers insist on it
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # tensor data starts 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for t in tensors.values():
            if t.numel():
                f.write(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data)


def load_safetensors(path):
    """{name: tensor} of one safetensors file. Anything malformed is a UserError naming the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or not 2 <= n <= min(MAX_HEADER, size - 8):
            raise UserError(f"{path} is not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise UserError(f"{path} is not a safetensors file (its header is not JSON)") from None
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = DTYPES.get(info.get("dtype")) if isinstance(info, dict) else None
            if dtype is None:
                raise UserError(f"{path}: tensor {name} has dtype "
                                f"{info.get('dtype') if isinstance(info, dict) else info!r}; "
                                f"readable: {', '.join(DTYPES)}")
            shape = info["shape"]
            begin, end = info["data_offsets"]
            count = math.prod(shape)
            if end - begin != count * dtype.itemsize or not 0 <= begin <= end <= size - 8 - n:
                raise UserError(f"{path}: tensor {name} does not fit the file (truncated?)")
            f.seek(8 + n + begin)
            buffer = bytearray(end - begin)
            if f.readinto(buffer) != len(buffer):
                raise UserError(f"{path}: tensor {name} is cut short (truncated file)")
            tensors[name] = (torch.frombuffer(buffer, dtype=dtype).reshape(shape) if count
                             else torch.empty(shape, dtype=dtype))
    return tensors


def load_safetensors_dir(directory):
    """The weights of a directory: model.safetensors, or the files model.safetensors.index.json lists."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UserError(f"{index} is not a safetensors index (no weight_map)") from None
        missing = [name for name in files if not os.path.exists(os.path.join(directory, name))]
        if missing:
            raise UserError(f"{directory} lacks {', '.join(missing[:3])}, listed in model.safetensors.index.json")
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        tensors.update(load_safetensors(os.path.join(directory, name)))
    return tensors


def check_free(target, overwrite, flag):
    """`target` may be written: absent, an empty directory, or (with overwrite) any directory. Else a UserError."""
    if os.path.exists(target) and not os.path.isdir(target):
        raise UserError(f"{flag}={target} is a file, not a directory")
    if os.path.isdir(target) and os.listdir(target) and not overwrite:
        raise UserError(f"{flag}={target} is not empty: choose another directory, or add --overwrite to replace it")


@contextlib.contextmanager
def staged_directory(target, overwrite, flag):
    """
    Yields a new temporary directory beside `target` to fill; when the block ends without an error it takes target's
    place by renames: readers never see a half-written directory (when replacing one, there is an instant with none).
    On any error it is removed and target is left as it was. A full disk or a read-only place is a UserError.
    """
    target = os.path.abspath(target)
    check_free(target, overwrite, flag)
    parent = os.path.dirname(target)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp", dir=parent)
    except OSError as e:
        raise UserError(f"cannot write {flag}={target}: {e.strerror}") from None
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        old = None
        if os.path.isdir(target) and os.listdir(target):  # --overwrite: move the old one aside, delete it last
            old = f"{tmp}.old"
            os.rename(target, old)
        try:
            os.rename(tmp, target)  # also replaces an empty directory
        except BaseException:
            if old:
                os.rename(old, target)
            raise
        if old:
            shutil.rmtree(old)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if out_of_space(e):  # also through safetensors' or torch's own error, raised while handling the OSError
            raise DiskFull(out_of_space(e), f"{flag}={target}", parent,
                           again="nothing was changed there; free space, then run the same command again") from None
        if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise UserError(f"cannot write {flag}={target} ({e.strerror}); nothing was changed there") from None
        raise
