"""
The run report: one markdown file that says what ran, on what, and what came out.

    python -m nanochat.report reset      # start a new report: header with environment facts
    python -m nanochat.report start      # the same the first time; then a rerun: earlier sections stay
    ... every stage appends its own section (get_report().log(section, data)) ...
    python -m nanochat.report generate   # assemble report.md (+ training curves), copy it to the cwd

Everything lives in $NANOCHAT_BASE_DIR/report/: header.md, runs.json (when each run of the pipeline started), one
<section>.md per stage, and the generated report.md and PNG curves. A section is written once per stage and replaced
when the stage runs again, so a pipeline interrupted and rerun ends with the sections of an uninterrupted one; each
says which run made it and, where the stage fingerprints its work (nanochat/rerun.py), what it was made from.
The per-step metrics of a training run live with its checkpoints (<checkpoint dir>/metrics.jsonl); its report section
names that file, and `generate` plots it.
"""

import datetime
import glob
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys

from nanochat.files import atomic_write, get_base_dir
from nanochat.output import format_value
from nanochat.probes import cpu_model_name

# stage sections in pipeline order; sections not listed here come after them, alphabetically
SECTION_ORDER = ["tokenizer-training", "tokenizer-evaluation", "base-model-training", "base-model-loss",
                 "base-model-evaluation", "midtraining", "chat-evaluation-mid", "chat-sft", "chat-evaluation-sft",
                 "chat-rl", "chat-evaluation-rl"]
# (section, key in that section, label in the summary table)
SUMMARY_METRICS = [
    ("tokenizer-evaluation", "Val bytes/token", "Tokenizer bytes/token (val)"),
    ("base-model-training", "Number of parameters", "Parameters"),
    ("base-model-training", "Minimum validation bpb", "Base val bpb (min)"),
    ("base-model-training", "Average MFU (%)", "Base MFU %"),
    ("base-model-training", "Total training time (min)", "Base training time (min)"),
    ("base-model-loss", "val bpb", "Base val bpb"),
    ("base-model-evaluation", "CORE metric", "CORE"),
    ("base-model-evaluation", "pydocs-CORE metric", "pydocs-CORE (offline, not CORE)"),
    ("midtraining", "Validation bpb of the base model", "Chat val bpb, base model"),
    ("midtraining", "Final validation bpb", "Chat val bpb, after midtraining"),
]
# The report card under the summary: each stage's headline evaluations side by side, one column per stage, "-"
# where a stage was not evaluated. The base column holds the base model's CORE-style score(s) (see _base_scores);
# the chat stages' columns hold keys of their "Chat evaluation <stage>" sections: the accuracies of the tasks that
# the section's CARD_LABELS line puts on the card ({task: label} in JSON, in the card's order: scripts/chat_eval.py
# writes it from tasks/registry.py, which the library never imports), then these scores:
REPORT_CARD_STAGES = ("mid", "sft", "rl")
CARD_LABELS = "report card labels"
REPORT_CARD_SCORES = [("ChatCORE", "ChatCORE"), ("Offline ChatCORE", "Offline ChatCORE")]  # (key in the section, label)
GPU_HOUR_USD = float(os.environ.get("NANOCHAT_GPU_HOUR_USD", "3.0"))  # rough on-demand price of one H100-class GPU hour


def _slug(section):
    return re.sub(r"[^a-z0-9]+", "-", section.lower()).strip("-")


def report_dir():
    path = os.path.join(get_base_dir(), "report")
    os.makedirs(path, exist_ok=True)
    return path


def section_path(section):
    """The file of the section titled `section` (it may not exist yet)."""
    return os.path.join(report_dir(), f"{_slug(section)}.md")


def runs():
    """When each run of the pipeline started ([] before `start`): the first run, then every rerun."""
    try:
        with open(os.path.join(report_dir(), "runs.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return []


def run_label():
    """Which run of the pipeline this is, as a section's "Run" line says it: "1 (first run)", "2 (rerun)", ..."""
    n = max(1, len(runs()))
    return f"{n} ({'first run' if n == 1 else 'rerun'})"


class Report:
    def __init__(self, directory):
        self.dir = directory

    def log(self, section, data, made_from=None):
        """
        Write one section: `data` is a list of dicts (key -> value) or strings, written in order, after the run of the
        pipeline that wrote it and `made_from` (the stage's fingerprint, nanochat/rerun.py) when given.
        """
        path = os.path.join(self.dir, f"{_slug(section)}.md")
        lines = [f"## {section}", f"timestamp: {datetime.datetime.now():%Y-%m-%d %H:%M:%S}", ""]
        lines.append(f"- Run: {run_label()}")
        if made_from:
            lines.append(f"- Made from: {made_from}")
        for item in data:
            if isinstance(item, str):
                lines.append(item)
                continue
            for k, v in item.items():
                lines.append(f"- {k}: {format_value(v)}")
        with atomic_write(path, "w") as f:
            f.write("\n".join(lines) + "\n\n")
        return path


class DummyReport:
    def log(self, *args, **kwargs):
        pass


def get_report():
    """The report on rank 0, a no-op elsewhere (only one process writes the report)."""
    if int(os.environ.get("RANK", 0)) == 0:
        return Report(report_dir())
    return DummyReport()


# -----------------------------------------------------------------------------
# header: environment facts


def _run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=_repo_root()).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _repo_root():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _code_size():
    """Characters, lines and files of the project's own code (what a reader has to read)."""
    root = _repo_root()
    chars = lines = files = 0
    for pattern in ("nanochat/*.py", "scripts/*.py", "tasks/*.py", "*.sh"):
        for path in glob.glob(os.path.join(root, pattern)):
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            chars += len(text)
            lines += text.count("\n")
            files += 1
    return chars, lines, files


def header_text():
    import psutil
    import torch
    commit = _run(["git", "rev-parse", "--short", "HEAD"]) or "unknown"
    dirty = bool(_run(["git", "status", "--porcelain", "--untracked-files=no"]))
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    chars, lines, files = _code_size()
    out = [
        "# nanochat training report", "",
        f"Generated: {datetime.datetime.now():%Y-%m-%d %H:%M:%S}", "",
        "## Environment", "",
        f"- Git commit: {commit}{' (dirty: uncommitted changes)' if dirty else ''}",
        f"- Host: {socket.gethostname()} ({platform.system()} {platform.release()})",
        f"- CPU: {cpu_model_name()}, {psutil.cpu_count(logical=False)} cores / {psutil.cpu_count()} threads",
        f"- Memory: {psutil.virtual_memory().total / 2**30:.1f} GiB",
        f"- GPUs: {len(gpus)} x {gpus[0]}" if gpus else "- GPUs: none",
        f"- GPU count: {len(gpus)}",
        f"- Python: {platform.python_version()}, PyTorch: {torch.__version__}",
        f"- Code: {chars:,} characters, {lines:,} lines, {files} files (~{chars // 4:,} tokens)",
        "",
    ]
    return "\n".join(out) + "\n"


# -----------------------------------------------------------------------------
# generate


def parse_section(text):
    """{key: value} of the `- key: value` lines of a section."""
    return dict(m.groups() for m in re.finditer(r"^- ([^:\n]+): (.*)$", text, re.MULTILINE))


def _timestamps(texts):
    stamps = []
    for text in texts:
        for m in re.finditer(r"^(?:timestamp|Generated|Started): (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)$", text,
                             re.MULTILINE):
            stamps.append(datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
    return stamps


# The curves of a training stage: (key in its metrics file, label)
CURVES = [("loss", "train loss (EMA)"), ("val_bpb", "validation bits per byte"), ("tok_per_sec", "tokens / second")]


def plot_curves(directory, sections):
    """
    Training curves (loss, val bpb, tokens/s per step) of each training stage, as PNG files in `directory`.
    A stage's section names its metrics file (`- Metrics file: <path>`, the run's checkpoint directory keeps
    it). Returns the names of the PNG files.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []
    for stage, text in sections.items():
        path = parse_section(text).get("Metrics file")
        if not path or not os.path.exists(path):
            continue
        rows = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut short by a kill
                    pass
        series = {key: [(r["step"], r[key]) for r in rows if r.get(key) is not None] for key, _ in CURVES}
        for key, label in CURVES:
            if not series[key]:
                continue
            fig, ax = plt.subplots(figsize=(6, 3.5))
            steps, values = zip(*series[key])
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None)
            ax.set_xlabel("step")
            ax.set_ylabel(label)
            ax.set_title(f"{stage}: {label}")
            ax.grid(alpha=0.3)
            fig.tight_layout()
            name = f"report_{stage}_{key}.png"
            fig.savefig(os.path.join(directory, name), dpi=100)
            plt.close(fig)
            written.append(name)
    return written


def _base_scores(section):
    """
    The base model's score keys of the base-model-evaluation section: "CORE metric" and, for the offline CORE-style
    score, any key ending in "score" or "CORE metric" (e.g. "pydocs-CORE metric").
    """
    return [k for k in section if k == "CORE metric" or k.endswith("score") or k.endswith("CORE metric")]


def report_card(parsed):
    """
    The report card as markdown lines ([] when nothing has been evaluated): rows are metrics, columns the base model
    and the chat stages (REPORT_CARD_STAGES), "-" where a stage lacks the metric. A metric no stage has is left out.
    `parsed`: {section slug: {key: value}}.
    """
    labels = {}  # {task: label} of the chat evaluation sections' CARD_LABELS lines, in their order
    for stage in REPORT_CARD_STAGES:
        labels.update(json.loads(parsed.get(f"chat-evaluation-{stage}", {}).get(CARD_LABELS, "{}")))
    base = parsed.get("base-model-evaluation", {})
    rows = [(key.removesuffix(" metric"), [base[key]] + ["-"] * len(REPORT_CARD_STAGES)) for key in _base_scores(base)]
    for key, label in list(labels.items()) + REPORT_CARD_SCORES:
        values = [parsed.get(f"chat-evaluation-{stage}", {}).get(key, "-") for stage in REPORT_CARD_STAGES]
        if any(v != "-" for v in values):
            rows.append((label, ["-"] + values))
    if not rows:
        return []
    header = ["metric", "base", *REPORT_CARD_STAGES]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + [f"| {label} | {' | '.join(values)} |" for label, values in rows]


def read_sections(directory):
    """{section slug: its markdown} of every stage section in `directory` (not header.md, not report.md)."""
    sections = {}
    for path in glob.glob(os.path.join(directory, "*.md")):
        name = os.path.basename(path)[:-3]
        if name not in ("header", "report"):
            with open(path, encoding="utf-8") as f:
                sections[name] = f.read()
    return sections


def generate(copy_to=None):
    """Assemble report.md from the header and the sections; returns its path. Copies report + PNGs to `copy_to`."""
    directory = report_dir()
    header_path = os.path.join(directory, "header.md")
    header = open(header_path, encoding="utf-8").read() if os.path.exists(header_path) else header_text()
    sections = read_sections(directory)
    order = [s for s in SECTION_ORDER if s in sections] + sorted(s for s in sections if s not in SECTION_ORDER)

    parsed = {name: parse_section(text) for name, text in sections.items()}
    rows = [(label, parsed[s][k]) for s, k, label in SUMMARY_METRICS if s in parsed and k in parsed[s]]
    stamps = _timestamps([header] + list(sections.values()))
    wall = (max(stamps) - min(stamps)).total_seconds() if len(stamps) >= 2 else 0.0
    gpu_count = int(m.group(1)) if (m := re.search(r"^- GPU count: (\d+)$", header, re.MULTILINE)) else 0

    out = [header.rstrip(), "", "## Summary", ""]
    out += ["| metric | value |", "| --- | --- |"] + [f"| {label} | {value} |" for label, value in rows]
    out.append(f"| Total wall time | {wall / 3600:.2f} h ({wall / 60:.1f} min) |")
    if gpu_count:
        out.append(f"| Estimated cost | ${wall / 3600 * gpu_count * GPU_HOUR_USD:,.2f} "
                   f"({gpu_count} GPUs x ${GPU_HOUR_USD:.2f}/GPU-hour, NANOCHAT_GPU_HOUR_USD) |")
    out.append("")
    card = report_card(parsed)
    if card:
        out += ["### Report card", ""] + card + [""]
    images = plot_curves(directory, {name: sections[name] for name in order})
    if images:
        out += ["## Training curves", ""] + [f"![{name}]({name})" for name in images] + [""]
    for name in order:
        out.append(sections[name].rstrip())
        out.append("")
    report_path = os.path.join(directory, "report.md")
    with atomic_write(report_path, "w") as f:
        f.write("\n".join(out) + "\n")
    if copy_to:
        for name in ["report.md"] + images:
            shutil.copy(os.path.join(directory, name), os.path.join(copy_to, name))
    return report_path


# The headline number of a stage's section in stage_lines: the first of these keys the section has
HEADLINES = ["ChatCORE", "Offline ChatCORE", "Mean reward, last steps", "Final validation bpb", "val bpb",
             "CORE metric", "pydocs-CORE metric", "Val bytes/token", "trained_vocab_size", "Reply tokens"]


def stage_lines(directory):
    """
    One line per stage section of `directory`, in the order they were written: its title, its wall time (from the
    previous section, or the start of the run of the pipeline that wrote it, to its own timestamp: the stage's
    start-up and imports included, in whole seconds) and its headline number (HEADLINES). What `generate` prints, so
    that a run ends with a summary.
    """
    header_path = os.path.join(directory, "header.md")
    start = _timestamps([open(header_path, encoding="utf-8").read()]) if os.path.exists(header_path) else []
    run_starts = [datetime.datetime.strptime(s, "%Y-%m-%d %H:%M:%S") for s in runs()]
    written = sorted((_timestamps([text])[0], text) for text in read_sections(directory).values()
                     if _timestamps([text]))
    lines = []
    previous = start[0] if start else None
    for stamp, text in written:
        run = re.search(r"^- Run: (\d+)", text, re.MULTILINE)
        if run and int(run.group(1)) <= len(run_starts):  # a rerun's first stage: timed from the rerun's start
            previous = max(previous or stamp, run_starts[int(run.group(1)) - 1])
        title = text.split("\n", 1)[0].removeprefix("## ")
        took = f"{(stamp - previous).total_seconds():5.0f} s" if previous else "    ? s"
        parsed = parse_section(text)
        key = next((k for k in HEADLINES if k in parsed), None)
        rerun = f"  (run {run.group(1)})" if run and run.group(1) != "1" else ""
        lines.append(f"  {title:<24} {took}" + (f"  {key}: {parsed[key]}" if key else "") + rerun)
        previous = stamp
    return lines


def reset():
    """Start a new report: remove the previous sections and outputs; write the header; this is run 1."""
    directory = report_dir()
    for path in glob.glob(os.path.join(directory, "*")):
        if os.path.isfile(path):
            os.remove(path)
    with atomic_write(os.path.join(directory, "header.md"), "w") as f:
        f.write(header_text().replace("Generated: ", "Started: ", 1))
    _add_run()
    return directory


def start():
    """A run of the pipeline starts: reset() the first time; after that a rerun, which keeps the earlier sections."""
    if not os.path.exists(os.path.join(report_dir(), "header.md")):
        reset()
        return f"Report started: {report_dir()}/header.md (run 1)"
    _add_run()
    return (f"Report: run {len(runs())} of this pipeline (a rerun) in {report_dir()}: the sections of earlier runs "
            f"stay, a stage that runs again replaces its own")


def _add_run():
    with atomic_write(os.path.join(report_dir(), "runs.json"), "w") as f:
        json.dump(runs() + [f"{datetime.datetime.now():%Y-%m-%d %H:%M:%S}"], f)


def main(argv):
    if len(argv) != 1 or argv[0] not in ("reset", "start", "generate"):
        print("usage: python -m nanochat.report reset|start|generate", file=sys.stderr)
        return 2
    if argv[0] == "reset":
        print(f"Report reset: {reset()}/header.md")
    elif argv[0] == "start":
        print(start())
    else:
        path = generate(copy_to=os.getcwd())
        print(f"Report written to {path} and copied to {os.path.join(os.getcwd(), 'report.md')}")
        print("Stages (wall time from the end of the one before; headline number):")
        print("\n".join(stage_lines(report_dir())))
    return 0


# -----------------------------------------------------------------------------
# The model card: the README.md of an exported model. What it is, how it was trained and how it scored, from what
# this machine recorded (the checkpoint's meta file and those it was trained from, the run report); whatever is
# not recorded says "not recorded", nothing is estimated.

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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
