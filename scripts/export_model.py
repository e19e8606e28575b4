"""
Export a checkpoint as a Hugging Face model directory:

    python -m scripts.export_model --source=sft --out=nanochat-d20              # bf16 weights
    python -m scripts.export_model --source=sft --out=nanochat-d20 --dtype=float32
    python -m scripts.export_model --source=sft --out=nanochat-d20-mlx --layout=mlx  # for mlx-lm

Writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json, chat_template.jinja,
generation_config.json and README.md (the model card: size, training, report card scores as recorded here).
The directory is written under a temporary name and renamed when complete: an interrupted export leaves no
half-written --out. The layouts (--layout; the default "auto" picks hf or remote by the model):
  - hf: transformers' (>= 5.0) own NanoChat model, no custom code; vLLM runs it through its Transformers backend
    (docs/export.md says how each part maps). For the 2025 architecture, with any rope_base.
  - mlx: the same with nanochat's weight names, which mlx-lm's nanochat model expects (and transformers cannot load).
  - remote: for models with qk_scale, layer scalars, value embeddings or sliding windows, which neither of those
    models has: our own modeling file (nanochat/modeling_nanochat_gpt.py, with nanochat/gpt.py's architecture written
    into it) beside the weights, for transformers with trust_remote_code=True, and vLLM through its Transformers
    backend (`vllm serve DIR --trust-remote-code --model-impl transformers`; docs/export.md). mlx-lm cannot run it.
"""

import json
import os

import torch

from nanochat.checkpoint_manager import SOURCES, checkpoint_dir_for, load_model, read_meta
from nanochat.configurator import check_config, configure
from nanochat.hf_format import (CHAT_TEMPLATE, MODELING_FILE, check_free, generation_config, hf_config, model_card,
                                modeling_source, remote_config, rename_weights, save_safetensors,
                                settings_without_equivalent, staged_directory, tokenizer_config, tokenizer_json)
from nanochat.output import UserError, print0


source = "sft"  # which checkpoints: base | mid | sft | rl
model_tag = ""  # which model under the source's checkpoint directory (needed only if there are several)
step = -1  # which step (-1 = the last complete checkpoint)
out = ""  # the directory to write (required)
dtype = "bfloat16"  # weights: bfloat16 (half the size) | float32 (exactly the checkpoint's values)
layout = "auto"  # hf: transformers' NanoChat (vLLM) | mlx: mlx-lm | remote: our modeling file | auto: remote if needed
overwrite = False  # replace a non-empty --out (default: refuse)
config = configure(globals())
check_config(config, choices={"source": tuple(SOURCES), "dtype": ("bfloat16", "float32"),
                              "layout": ("auto", "hf", "mlx", "remote")})
if not out:
    raise UserError("--out=DIR is required: the directory to write the model to")
check_free(os.path.abspath(out), overwrite, "--out")  # before loading anything


def lineage(meta, source):
    """
    [(stage, model_tag, step, meta or None)]: this checkpoint, then the one it was trained from, back to its base
    model, as far as their meta files are on this machine (midtraining records `base_model`, SFT and RL `parent`).
    """
    chain = [(source, meta.get("model_tag"), meta.get("step"), meta)]
    while chain[-1][3] is not None and len(chain) < 8:  # base, mid, sft, rl: 8 bounds a cycle of edited meta files
        m = chain[-1][3]
        if isinstance(m.get("base_model"), dict):
            parent = ("base", m["base_model"].get("model_tag"), m["base_model"].get("step"))
        elif isinstance(m.get("parent"), dict):
            parent = (m["parent"].get("source"), m["parent"].get("model_tag"), m["parent"].get("step"))
        else:
            break
        try:
            parent_meta = read_meta(checkpoint_dir_for(parent[0], parent[1]), parent[2])
        except (UserError, TypeError):
            parent_meta = None
        chain.append((*parent, parent_meta))
    return chain


model, tokenizer, meta = load_model(source, "cpu", phase="eval", model_tag=model_tag or None, step=step)
model_config = model.config.to_dict()
if layout == "auto":
    layout = "remote" if settings_without_equivalent(model_config) else "hf"
if layout == "remote":
    config_json = remote_config(model_config, tokenizer, dtype)
else:
    config_json = hf_config(model_config, tokenizer, dtype, layout)
files = {
    "config.json": config_json,
    "generation_config.json": generation_config(tokenizer),
    "tokenizer.json": tokenizer_json(tokenizer),
    "tokenizer_config.json": tokenizer_config(model_config["sequence_len"]),
    "chat_template.jinja": CHAT_TEMPLATE,
    "README.md": model_card(meta, lineage(meta, source), model, tokenizer, dtype, layout),
}
state = {name: t.to(getattr(torch, dtype)) for name, t in model.state_dict().items()}
if layout == "hf":
    state = rename_weights(state, model_config["n_layer"], to_hf=True, where=f"{source} model {meta['model_tag']}")

with staged_directory(out, overwrite, "--out") as tmp:
    for name, content in files.items():
        if not isinstance(content, str):  # JSON, indented for reading, except tokenizer.json's 100k's of entries
            content = json.dumps(content, indent=None if name == "tokenizer.json" else 2, ensure_ascii=False) + "\n"
        with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
            f.write(content)
    save_safetensors(state, os.path.join(tmp, "model.safetensors"))
    if layout == "remote":  # our modeling file, with gpt.py's architecture written into it
        with open(os.path.join(tmp, MODELING_FILE), "w", encoding="utf-8") as f:
            f.write(modeling_source())

out = os.path.abspath(out)
print0(f"Exported {source} model {meta['model_tag']} step {meta['step']} ({model.num_params():,} parameters, {dtype}, "
       f"{layout} layout) to {out}")
if layout == "hf":
    print0(f"Next: transformers: AutoModelForCausalLM.from_pretrained({out!r}) and "
           f"AutoTokenizer.from_pretrained({out!r}); vLLM: vllm serve {out}")
elif layout == "remote":
    print0(f"Next: transformers: AutoModelForCausalLM.from_pretrained({out!r}, trust_remote_code=True) and "
           f"AutoTokenizer.from_pretrained({out!r}, trust_remote_code=True); "
           f"vLLM: vllm serve {out} --trust-remote-code --model-impl transformers (mlx-lm cannot run this layout)")
else:
    print0(f"Next: mlx_lm.generate --model {out} --prompt \"Hello\"")
