"""
The README.md (model card) of an exported model: what it is, how it was trained and how it scored, from what this
machine recorded: the checkpoint's meta file and those of the checkpoints it was trained from, and the run report
($NANOCHAT_BASE_DIR/report/). Whatever is not recorded says "not recorded"; nothing is estimated.
"""

import os

from nanochat.checkpoint_manager import checkpoint_dir_for, read_meta
from nanochat.common import UserError, get_base_dir
from nanochat.report import parse_section, read_sections, report_card

NOT_RECORDED = "not recorded"


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


def trained_on(stage, meta):
    """One line: how much this stage trained on, from its meta file's step count and batch settings."""
    if meta is None:
        return f"{NOT_RECORDED} (its checkpoint is not on this machine)"
    if "imported_from" in meta:
        origin = meta["imported_from"]
        name = os.path.basename(str(origin.get("path")))  # not the full path: a model card gets published
        return f"imported from a {origin.get('format')} directory ({name}); its training is {NOT_RECORDED} here"
    config, step = meta.get("user_config") or {}, meta.get("step")
    units = {"base": ("total_batch_size", "tokens"), "mid": ("total_batch_size", "tokens"),
             "sft": ("examples_per_step", "conversations"), "rl": ("prompts_per_step", "problems")}
    key, unit = units.get(stage, (None, None))
    if not isinstance(step, int) or key not in config:
        return NOT_RECORDED
    return f"{step:,} steps x {config[key]:,} {unit} = {step * config[key]:,} {unit}"


def evaluation_lines():
    """The run report's card (nanochat.report.report_card) and the model each evaluation section names, or []."""
    directory = os.path.join(get_base_dir(), "report")
    if not os.path.isdir(directory):
        return []
    parsed = {name: parse_section(text) for name, text in read_sections(directory).items()}
    card = report_card(parsed)
    if not card:
        return []
    evaluated = [f"- {name}: {section['model']}" for name, section in sorted(parsed.items())
                 if "evaluation" in name and "model" in section]
    return ["From the run report (`$NANOCHAT_BASE_DIR/report/`): the latest evaluation of each stage logged there.", "",
            *card, "", "The evaluated models:", *evaluated]


def model_card(meta, source, model, tokenizer, dtype, layout):
    """The README.md text. meta: load_model's meta of the exported checkpoint."""
    c = model.config
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
        *[f"| {stage} | {tag} step {step} | {trained_on(stage, m)} |" for stage, tag, step, m in lineage(meta, source)],
        "",
        "## Evaluation",
        "",
        *(evaluation_lines() or [f"{NOT_RECORDED} (no report card in this machine's run report)"]),
        "",
    ]
    if layout == "mlx":
        lines += ["## Use", "", "This directory keeps nanochat's weight names, which mlx-lm's `nanochat` model reads:",
                  "", "    mlx_lm.generate --model path/to/this/directory --prompt \"Hello\"", "",
                  "transformers cannot load it (it expects `model.layers.*` names): export with `--layout=hf` for that.", ""]
    else:
        lines += ["## Use", "", "transformers >= 5.0 loads it with no custom code:", "", "```python",
                  "from transformers import AutoModelForCausalLM, AutoTokenizer",
                  "path = \"path/to/this/directory\"",
                  "tokenizer = AutoTokenizer.from_pretrained(path)",
                  "model = AutoModelForCausalLM.from_pretrained(path)",
                  "messages = [{\"role\": \"user\", \"content\": \"Why is the sky blue?\"}]",
                  "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\", return_dict=True)",
                  "output = model.generate(**inputs, max_new_tokens=128)",
                  "print(tokenizer.decode(output[0, inputs[\"input_ids\"].shape[1]:], skip_special_tokens=True))",
                  "```", ""]
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
