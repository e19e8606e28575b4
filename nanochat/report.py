"""
The run report: each stage's state as data, and the markdown it renders: what ran, on what, what came out.

    python -m nanochat.report reset      # start a new report: header with environment facts
    python -m nanochat.report start      # the same the first time; then a rerun: earlier sections stay
    ... every stage writes its own section (get_report().log(section, data)) ...
    python -m nanochat.report generate   # render report.md (+ training curves), copy it to the cwd

Everything lives in $NANOCHAT_BASE_DIR/report/: header.json (when the report started, the environment), runs.json
(when each run of the pipeline started) and one <section>.json per stage, its state: its title, when it was written,
which run of the pipeline wrote it, what it was made from (its fingerprint, nanochat/rerun.py), its data in order
(key: value entries, the stage's headline numbers among them, and lines of text) and, for a chat evaluation, the
labels of the report card's task rows. Code reads only these (rerun, the summary, the report card, the model card);
the <section>.md beside each is its markdown for people, and report.md is rendered from the JSON. A section is
written once per stage and replaced when the stage runs again, so a pipeline interrupted and rerun ends with the
sections of an uninterrupted one. The per-step metrics of a training run live with its checkpoints
(<checkpoint dir>/metrics.jsonl); its section names that file, and `generate` plots it.
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

from nanochat.files import atomic_write, get_base_dir, read_json, write_json
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
# where a stage was not evaluated. The base column holds the base model's CORE-style score(s) (report_card says which);
# the chat stages' columns hold keys of their "Chat evaluation <stage>" sections: the accuracies of the tasks that
# the section's card labels put on the card ({task: label}, in the card's order: scripts/chat_eval.py gives them from
# tasks/registry.py, which the library never imports), then these scores:
REPORT_CARD_STAGES = ("mid", "sft", "rl")
REPORT_CARD_SCORES = [("ChatCORE", "ChatCORE"), ("Offline ChatCORE", "Offline ChatCORE")]  # (key in the section, label)
GPU_HOUR_USD = float(os.environ.get("NANOCHAT_GPU_HOUR_USD", "3.0"))  # rough on-demand price of one H100-class GPU hour
STAMP = "%Y-%m-%d %H:%M:%S"  # how the report writes a time


def _slug(section):
    return re.sub(r"[^a-z0-9]+", "-", section.lower()).strip("-")


def _now():
    return f"{datetime.datetime.now():{STAMP}}"


def _time(stamp):
    return datetime.datetime.strptime(stamp, STAMP)


def report_dir():
    path = os.path.join(get_base_dir(), "report")
    os.makedirs(path, exist_ok=True)
    return path


def runs():
    """When each run of the pipeline started ([] before `start`): the first run, then every rerun."""
    return read_json(os.path.join(report_dir(), "runs.json")) or []


def run_label(run):
    """Which run of the pipeline `run` (1, 2, ...) is, as a section's "Run" line says: "1 (first run)", "2 (rerun)"."""
    return f"{run} ({'first run' if run == 1 else 'rerun'})"


def read_state(section):
    """The state of the section titled `section` (what Report.log wrote), or None if it is not there."""
    return read_json(os.path.join(report_dir(), f"{_slug(section)}.json"))


def values(state):
    """{key: value} of the entries of a section's state (a key given twice: its later value, as its markdown reads)."""
    return {k: v for item in state["data"] if isinstance(item, dict) for k, v in item.items()}


def render(state):
    """A section's markdown: title, when it was written, the run that wrote it, what it was made from, its data."""
    lines = [f"## {state['section']}", f"timestamp: {state['timestamp']}", "", f"- Run: {run_label(state['run'])}"]
    if state["made_from"]:
        lines.append(f"- Made from: {state['made_from']}")
    for item in state["data"]:
        lines += [item] if isinstance(item, str) else [f"- {k}: {format_value(v)}" for k, v in item.items()]
    return "\n".join(lines) + "\n\n"


class Report:
    def __init__(self, directory):
        self.dir = directory

    def log(self, section, data, made_from=None, card_labels=None):
        """
        Write one section: its state (<slug>.json) and its markdown (<slug>.md). `data` is a list of dicts
        (key -> value) or strings, in order; `made_from` the stage's fingerprint (nanochat/rerun.py) when it has one;
        `card_labels` {task: label} of the report card's task rows (a chat evaluation's). Returns the state's path.
        """
        path = os.path.join(self.dir, _slug(section))
        state = dict(section=section, timestamp=_now(), run=max(1, len(runs())), made_from=made_from, data=data,
                     card_labels=card_labels)
        text = json.dumps(state, default=str)  # a value JSON cannot hold (a torch dtype): the text the markdown shows
        with atomic_write(path + ".md", "w") as f:  # rendered from the JSON, as report.md is: the same text
            f.write(render(json.loads(text)))
        with atomic_write(path + ".json", "w") as f:  # last: a section without its state was never written
            f.write(text)
        return path + ".json"


class DummyReport:
    def log(self, *args, **kwargs):
        pass


def get_report():
    """The report on rank 0, a no-op elsewhere (only one process writes the report)."""
    if int(os.environ.get("RANK", 0)) == 0:
        return Report(report_dir())
    return DummyReport()


def states(directory):
    """{section slug: its state} of every stage section in `directory`."""
    found = {os.path.basename(p)[:-5]: read_json(p) for p in glob.glob(os.path.join(directory, "*.json"))}
    return {name: state for name, state in found.items() if name not in ("header", "runs") and state}


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


def environment():
    """The header's facts: {name: value}."""
    import psutil
    import torch
    commit = _run(["git", "rev-parse", "--short", "HEAD"]) or "unknown"
    dirty = bool(_run(["git", "status", "--porcelain", "--untracked-files=no"]))
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    chars, lines, files = _code_size()
    return {
        "Git commit": f"{commit}{' (dirty: uncommitted changes)' if dirty else ''}",
        "Host": f"{socket.gethostname()} ({platform.system()} {platform.release()})",
        "CPU": f"{cpu_model_name()}, {psutil.cpu_count(logical=False)} cores / {psutil.cpu_count()} threads",
        "Memory": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "GPUs": f"{len(gpus)} x {gpus[0]}" if gpus else "none",
        "GPU count": len(gpus),
        "Python": f"{platform.python_version()}, PyTorch: {torch.__version__}",
        "Code": f"{chars:,} characters, {lines:,} lines, {files} files (~{chars // 4:,} tokens)",
    }


def header(directory):
    """The header's state: when the report started and its environment (made now, "Generated", if never reset)."""
    return read_json(os.path.join(directory, "header.json")) or dict(Generated=_now(), environment=environment())


# -----------------------------------------------------------------------------
# generate


# The curves of a training stage: (key in its metrics file, label)
CURVES = [("loss", "train loss (EMA)"), ("val_bpb", "validation bits per byte"), ("tok_per_sec", "tokens / second")]


def plot_curves(directory, sections):
    """
    Training curves (loss, val bpb, tokens/s per step) of each training stage, as PNG files in `directory`.
    A stage's section names its metrics file (its "Metrics file" entry, the run's checkpoint directory keeps
    it). `sections`: {slug: state}. Returns the names of the PNG files.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []
    for stage, state in sections.items():
        path = values(state).get("Metrics file")
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
            steps, points = zip(*series[key])
            ax.plot(steps, points, marker="o" if len(steps) < 30 else None)
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


def report_card(sections):
    """
    The report card as markdown lines ([] when nothing has been evaluated): rows are metrics, columns the base model
    and the chat stages (REPORT_CARD_STAGES), "-" where a stage lacks the metric. A metric no stage has is left out.
    `sections`: {section slug: its state}.
    """
    labels = {}  # {task: label} of the chat evaluation sections' card labels, in their order
    for stage in REPORT_CARD_STAGES:
        labels.update(sections.get(f"chat-evaluation-{stage}", {}).get("card_labels") or {})
    found = {name: values(state) for name, state in sections.items()}
    base = found.get("base-model-evaluation", {})
    # the base model's scores: "CORE metric" and the offline CORE-style ones (e.g. "pydocs-CORE metric", "... score")
    rows = [(key.removesuffix(" metric"), [base[key]] + ["-"] * len(REPORT_CARD_STAGES))
            for key in base if key.endswith(("CORE metric", "score"))]
    for key, label in list(labels.items()) + REPORT_CARD_SCORES:
        cells = [found.get(f"chat-evaluation-{stage}", {}).get(key, "-") for stage in REPORT_CARD_STAGES]
        if any(v != "-" for v in cells):
            rows.append((label, ["-"] + cells))
    if not rows:
        return []
    header_row = ["metric", "base", *REPORT_CARD_STAGES]
    lines = ["| " + " | ".join(header_row) + " |", "|" + " --- |" * len(header_row)]
    return lines + [f"| {label} | {' | '.join(str(format_value(v)) for v in cells)} |" for label, cells in rows]


def generate(copy_to=None):
    """Render report.md from the header and the sections; returns its path. Copies report + PNGs to `copy_to`."""
    directory = report_dir()
    head = header(directory)
    sections = states(directory)
    order = [s for s in SECTION_ORDER if s in sections] + sorted(s for s in sections if s not in SECTION_ORDER)

    found = {name: values(state) for name, state in sections.items()}
    rows = [(label, format_value(found[s][k])) for s, k, label in SUMMARY_METRICS if s in found and k in found[s]]
    word = "Started" if "Started" in head else "Generated"
    start = head[word]
    stamps = [_time(start)] + [_time(state["timestamp"]) for state in sections.values()]
    wall = (max(stamps) - min(stamps)).total_seconds()
    gpu_count = head["environment"]["GPU count"]

    out = ["# nanochat training report", "", f"{word}: {start}", "", "## Environment", ""]
    out += [f"- {k}: {v}" for k, v in head["environment"].items()]
    out += ["", "## Summary", ""]
    out += ["| metric | value |", "| --- | --- |"] + [f"| {label} | {value} |" for label, value in rows]
    out.append(f"| Total wall time | {wall / 3600:.2f} h ({wall / 60:.1f} min) |")
    if gpu_count:
        out.append(f"| Estimated cost | ${wall / 3600 * gpu_count * GPU_HOUR_USD:,.2f} "
                   f"({gpu_count} GPUs x ${GPU_HOUR_USD:.2f}/GPU-hour, NANOCHAT_GPU_HOUR_USD) |")
    out.append("")
    card = report_card(sections)
    if card:
        out += ["### Report card", ""] + card + [""]
    images = plot_curves(directory, {name: sections[name] for name in order})
    if images:
        out += ["## Training curves", ""] + [f"![{name}]({name})" for name in images] + [""]
    for name in order:
        out.append(render(sections[name]).rstrip())
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
    head = read_json(os.path.join(directory, "header.json"))
    previous = _time(head["Started"]) if head else None
    run_starts = [_time(s) for s in runs()]
    lines = []
    for state in sorted(states(directory).values(), key=lambda s: s["timestamp"]):
        stamp, run = _time(state["timestamp"]), state["run"]
        if run <= len(run_starts):  # a rerun's first stage: timed from the rerun's start
            previous = max(previous or stamp, run_starts[run - 1])
        took = f"{(stamp - previous).total_seconds():5.0f} s" if previous else "    ? s"
        found = values(state)
        key = next((k for k in HEADLINES if k in found), None)
        headline = f"  {key}: {format_value(found[key])}" if key else ""
        lines.append(f"  {state['section']:<24} {took}{headline}" + (f"  (run {run})" if run != 1 else ""))
        previous = stamp
    return lines


def reset():
    """Start a new report: remove the previous sections and outputs; write the header; this is run 1."""
    directory = report_dir()
    for path in glob.glob(os.path.join(directory, "*")):
        if os.path.isfile(path):
            os.remove(path)
    write_json(os.path.join(directory, "header.json"), dict(Started=_now(), environment=environment()))
    _add_run()
    return directory


def start():
    """A run of the pipeline starts: reset() the first time; after that a rerun, which keeps the earlier sections."""
    if not os.path.exists(os.path.join(report_dir(), "header.json")):
        reset()
        return f"Report started: {report_dir()}/header.json (run 1)"
    _add_run()
    return (f"Report: run {len(runs())} of this pipeline (a rerun) in {report_dir()}: the sections of earlier runs "
            f"stay, a stage that runs again replaces its own")


def _add_run():
    write_json(os.path.join(report_dir(), "runs.json"), runs() + [_now()])


def main(argv):
    if len(argv) != 1 or argv[0] not in ("reset", "start", "generate"):
        print("usage: python -m nanochat.report reset|start|generate", file=sys.stderr)
        return 2
    if argv[0] == "reset":
        print(f"Report reset: {reset()}/header.json")
    elif argv[0] == "start":
        print(start())
    else:
        path = generate(copy_to=os.getcwd())
        print(f"Report written to {path} and copied to {os.path.join(os.getcwd(), 'report.md')}")
        print("Stages (wall time from the end of the one before; headline number):")
        print("\n".join(stage_lines(report_dir())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
