"""
Rerun = resume: what each stage's outputs were made from, so that a pipeline run again redoes only what changed.

A stage's outputs (a training stage's checkpoints, every stage's report section) carry the fingerprint of what made
them: the stage, its settings (those that change what it computes: not the wandb run's name, how often it saves or
whether it may resume) and the identities of its inputs (the checkpoint it starts from or evaluates, the tokenizer,
the corpus, a file of conversations). Checkpoints keep it in their meta file, report sections in their state
(nanochat/report.py: <section>.json; their markdown is for people). With --rerun=auto (what speedrun.sh passes) a
stage asks here, before any work, and:
  - its report section is there with the same fingerprint (and a training stage's last checkpoint with it): the
    stage is done; it says so in one line, with when it was made, and exits 0;
  - a training stage whose checkpoints have the same fingerprint but no section yet was interrupted: it resumes
    from its last complete checkpoint (exactly, as --resume_from_step does);
  - checkpoints made otherwise are named, deleted, and the stage runs afresh; a section made otherwise is replaced.
A stage downstream fingerprints the checkpoint it reads, so a stage that runs again makes every stage after it run
again too. Invariant: two runs with the same fingerprint compute the same thing.

    python -m nanochat.rerun forget      delete what a pipeline made (FRESH=1 bash speedrun.sh)
"""

import hashlib
import json
import os
import re
import shutil
import sys

from nanochat.checkpoint_manager import SOURCES, checkpoint_dir_for, complete_steps, find_checkpoint_dir, read_meta
from nanochat.dataset import dataset_name, list_parquet_files
from nanochat.files import get_base_dir
from nanochat.output import UserError, print0
from nanochat.report import read_state, run_label, values
from nanochat.tokenizer import get_tokenizer

# Settings that do not change what a stage computes: where it logs, how often it saves, whether and how it resumes
UNFINGERPRINTED = ("run", "rerun", "resume_from_step", "overwrite", "dry_run", "save_every", "save_every_minutes")
RERUN_CHOICES = ("no", "auto")
# Each training stage's section of the run report: whether the stage finished is read there
TRAINING_SECTIONS = {"base": "Base model training", "mid": "Midtraining", "sft": "Chat SFT", "rl": "Chat RL"}


def fingerprint(stage, config, inputs):
    """16 hex digits hashing `stage`, the settings of `config` that change what it computes, and `inputs`."""
    settings = {k: v for k, v in config.items() if k not in UNFINGERPRINTED}
    if settings.get("attention") == "auto":  # base_train's default, named "sdpa" until "auto" came: the same work,
        settings["attention"] = "sdpa"  # so a run finished before is still done, not trained again
    made = json.dumps({"stage": stage, "settings": settings, "inputs": inputs}, sort_keys=True, default=str)
    return hashlib.sha256(made.encode("utf-8")).hexdigest()[:16]


def checkpoint_input(source, model_tag="", step=-1):
    """
    The identity of the model a stage reads: stage `source`'s model `model_tag` (its only one if empty) at `step`
    (-1: its last complete one), with the fingerprint that made it (a checkpoint saved before fingerprints: a hash
    of its meta file). No such model: an identity without a step (the stage's own loading says what is missing, after
    the checks that come first, such as a task's download).
    """
    try:
        model_tag, checkpoint_dir = find_checkpoint_dir(source, model_tag or None)
    except UserError:
        return dict(source=source, model_tag=model_tag, step=None, made_from=None)
    steps = complete_steps(checkpoint_dir)
    step = steps[-1] if step < 0 and steps else step
    if step < 0 or step not in steps:
        return dict(source=source, model_tag=model_tag, step=None, made_from=None)
    meta = read_meta(checkpoint_dir, step)
    made_from = meta.get("made_from") or hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]
    return dict(source=source, model_tag=model_tag, step=step, made_from=made_from)


def tokenizer_input():
    """The identity of the tokenizer in the base dir: its fingerprint (what checkpoints record)."""
    return get_tokenizer().fingerprint()


def corpus_input():
    """The identity of the selected corpus: its name and every shard's name and size."""
    shards = list_parquet_files("train") + list_parquet_files("val")
    return dict(name=dataset_name(), shards=[(os.path.basename(p), os.path.getsize(p)) for p in shards])


def file_input(path):
    """The identity of a file a stage reads (a --conversations file): its path and a hash of its bytes."""
    if not path or not os.path.isfile(path):
        return path
    with open(path, "rb") as f:
        return dict(path=path, sha256=hashlib.sha256(f.read()).hexdigest()[:16])


def made_before(section):
    """
    (fingerprint, timestamp, run) of the report section titled `section`, from its state, or None if it is not there
    or says its stage stopped early (a training stage interrupted after its last save writes its section too).
    """
    state = read_state(section)
    if state is None or values(state).get("Stopped early") is True:
        return None
    return state["made_from"], state["timestamp"], run_label(state["run"])


def done_before(section, made_from, outputs=()):
    """
    True if the report section `section` was made from `made_from` and the files `outputs` are there: prints one
    line saying the stage is done (when, by which run of the pipeline) and skipped.
    """
    before = made_before(section)
    if before is None or before[0] != made_from or not all(os.path.exists(p) for p in outputs):
        return False
    _, stamp, run = before
    print0(f"{section}: done at {stamp} by run {run} with the same settings and inputs: skipped "
           f"(--rerun=no runs it again; FRESH=1 bash speedrun.sh starts over)")
    return True


def skip_if_done(section, stage, config, inputs, outputs=()):
    """
    The check of the evaluations and of the tokenizer, before any work: returns the fingerprint of `stage`'s settings
    `config` and its `inputs`, for its report section `section`; with --rerun=auto, if that section was made from it
    (and the files `outputs` are there), one line says the stage is done and it exits 0. (A training stage's check
    is Stage's.)
    """
    made_from = fingerprint(stage, config, inputs)
    if config["rerun"] == "auto" and done_before(section, made_from, outputs):
        sys.exit(0)
    return made_from


def training_done(stage, model_tag, made_from):
    """
    A training stage's check with --rerun=auto (and neither --resume_from_step nor --overwrite), before any work
    (Stage does it): True if its report section and its last checkpoint in <stage dir>/<model_tag> were made from
    `made_from`; one line says so. (What it does otherwise with its checkpoints, resume or replace, Stage decides:
    training_plan.)
    """
    section = TRAINING_SECTIONS[stage]
    what, step = training_plan(section, checkpoint_dir_for(stage, model_tag), made_from)
    if what != "done":
        return False
    _, stamp, run = made_before(section)
    print0(f"{section}: done at {stamp} by run {run}, step {step}, with the same settings and inputs: skipped "
           f"(--rerun=no runs it again; FRESH=1 bash speedrun.sh starts over)")
    return True


def training_plan(section, checkpoint_dir, made_from):
    """
    What a training stage with --rerun=auto does with `checkpoint_dir` (made_from: its fingerprint): ("done", step)
    if its report section and its last complete checkpoint were made from it; ("resume", step) from the last complete
    checkpoint made from it; ("replace", steps) if it holds checkpoints made otherwise; ("fresh", None) if none.
    """
    steps = complete_steps(checkpoint_dir) if os.path.isdir(checkpoint_dir) else []
    ours = [s for s in steps if read_meta(checkpoint_dir, s).get("made_from") == made_from]
    before = made_before(section)
    if ours and ours[-1] == steps[-1]:
        if before is not None and before[0] == made_from:
            return "done", ours[-1]
        return "resume", ours[-1]
    if steps or _any_checkpoint_file(checkpoint_dir):
        return "replace", steps
    return "fresh", None


def _any_checkpoint_file(checkpoint_dir):
    pattern = re.compile(r"(model|meta|optim)_\d+.*")
    return os.path.isdir(checkpoint_dir) and any(pattern.fullmatch(n) for n in os.listdir(checkpoint_dir))


def forget():
    """
    Delete what a pipeline made in the base dir, naming each path: the report, the tokenizer and every stage's
    checkpoints. Kept: the corpora, the evaluation bundles and task files, the per-machine measurements.
    """
    base = get_base_dir()
    paths = [os.path.join(base, name) for name in ["report", "tokenizer", *SOURCES.values()]]
    gone = [p for p in paths if os.path.exists(p)]
    for path in gone:
        print(f"deleting {path}")
        shutil.rmtree(path)
    if not gone:
        print(f"nothing to delete in {base}")
    return gone


def main(argv):
    if argv != ["forget"]:
        print("usage: python -m nanochat.rerun forget   (delete the report, the tokenizer and every checkpoint of "
              "$NANOCHAT_BASE_DIR; the corpora, bundles and task files stay)", file=sys.stderr)
        return 2
    forget()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
