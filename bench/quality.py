"""
Quality benchmark: which recipe trains the best model per token, our variants or karpathy/nanochat's anchors.

Our base_train, in named variants, side by side with the two anchors (issue 24), karpathy/nanochat at 088726a
(Dec 2025, the reference we started from) and at its newest commit (HEAD, 2026), all trained on the same pydocs text
with the same number of tokens, several seeds each, and all scored by one bits-per-byte computation
(bench/quality_eval.py).

    python bench/quality.py --dry                   # plumbing check: tiny sizes, ~10 min on 2 cores
    python bench/quality.py                         # depth 6, T 512, 16,384 tokens/step, 2M tokens, 2 seeds: hours
    python bench/quality.py --variants=baseline,warmdown65 --anchors=   # our variants only
    python bench/quality.py --variants=2025,ve,bos,pick_bos --anchors=  # the ablations: 2026's parts on 2025's recipe
    python bench/quality.py --variant=lr2:--matrix_lr=0.04,--embedding_lr=0.3 --seeds=3 --out=/tmp/q.json
    python bench/quality.py --first_seed=1 --seeds=1 --anchors=088 --out=/tmp/q1.json  # seed 43 alone (~20 min a run)
    python bench/quality.py --device_type=cuda --eval_device=cuda --jobs=3 --depth=8   # on one GPU (H100: ~3 min)

Prints a table (variant, val bpb mean +- half the range over seeds and each seed's, training tokens/s, parameters,
wall time per run, compute dtype) with the machine, and writes every run's numbers to --out (JSON, after each run).
--jobs=N trains N runs at a time (on a GPU; on a 2-core CPU they would slow each other down); a failed run is reported,
the others go on, and the exit is non-zero. --work holds one base dir per codebase (a rerun reuses corpus, tokenizers).

How each codebase is trained and scored, and how to set up the anchors' checkouts and environment: bench/RESULTS.md,
"bench/quality.py: how each codebase is trained and scored".
"""

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from ab import machine_line  # bench/ab.py

EVAL_SCRIPT = os.path.join(HERE, "quality_eval.py")
FULL = dict(depth=6, seq_len=512, tokens_per_step=16384, tokens=2_000_000, eval_tokens=65536, seeds=2)
DRY = dict(depth=2, seq_len=128, tokens_per_step=4096, tokens=16384, eval_tokens=8192, seeds=2)
EVAL_FLOOR = 65536  # tokens of validation text at least (real mode): fewer and seed noise swamps recipe effects

# Named variants of our recipe: overrides of scripts.base_train (more with --variant=name:--key=v,--key2=w). An ablation
# is one part of the 2026 recipe alone on the 2025 recipe (our defaults until issue 24): the same whatever the defaults.
RECIPE_2025 = {"embedding_lr": "0.2", "unembedding_lr": "0.004", "warmdown_ratio": "0.2", "final_lr_frac": "0",
               "muon_momentum_peak": "0.95", "muon_momentum_final": "0.95", "matrix_weight_decay": "0",
               "weight_decay": "0", "qk_scale": "1.0", "value_embeds": "False", "layer_scalars": "False",
               "rope_base": "10000", "init_recipe": "2025", "bos_aligned": "False"}
PARTS_2026 = {  # name: the settings of one part, as karpathy/nanochat HEAD has it
    "warmdown65": {"warmdown_ratio": "0.65", "final_lr_frac": "0.05"},  # the shape of HEAD's LR schedule
    "lr2026": {"embedding_lr": "0.3", "unembedding_lr": "0.008"},  # HEAD's AdamW learning rates
    "momentum2026": {"muon_momentum_peak": "0.97", "muon_momentum_final": "0.90"},  # HEAD's Muon momentum shape
    "cautious_wd": {"matrix_weight_decay": "0.4"},  # Muon's cautious weight decay at HEAD's d8 optimum
    "bos": {"bos_aligned": "True"},  # every row starts at a document (best-fit packing)
    "rope100k": {"rope_base": "100000"},
    "qk12": {"qk_scale": "1.2"},
    "init2026": {"init_recipe": "2026"},
    "scalars": {"layer_scalars": "True"},
    "ve": {"value_embeds": "True"},
}


def on_2025(*parts):
    """The 2025 recipe with these parts of the 2026 one, as --key=value overrides."""
    settings = dict(RECIPE_2025)
    for part in parts:
        settings.update(PARTS_2026[part])
    return [f"--{k}={v}" for k, v in settings.items()]


SCHEDULE_2026 = ("warmdown65", "lr2026", "momentum2026", "cautious_wd")
VARIANTS = {
    "baseline": [],  # our defaults as they are
    # our defaults with 088726a's schedule (better at d6-d8 over ~3 epochs)
    "sched2025": ["--warmdown_ratio=0.2", "--final_lr_frac=0", "--muon_momentum_peak=0.95",
                  "--muon_momentum_final=0.95"],
    "2025": on_2025(),  # the recipe before issue 24
    **{name: on_2025(name) for name in PARTS_2026},
    "recipe2026": on_2025(*SCHEDULE_2026),  # the optimizer and schedule parts together
    "recipe_ve": on_2025(*SCHEDULE_2026, "ve"),
    "pick": on_2025(*SCHEDULE_2026, "ve", "qk12", "init2026"),
    # = our defaults of 279d942 (before the lrs and decays of the acceptance size)
    "pick_bos": on_2025(*SCHEDULE_2026, "ve", "qk12", "init2026", "bos"),
    "plain2026": on_2025(*SCHEDULE_2026, "init2026", "bos"),  # the defaults without the parts the plain export lacks
    "all2026": on_2025(*PARTS_2026),  # every part we have
}
# What the benchmark sets itself: a variant overriding these would not be the same experiment
CONTROLLED = {"device_type", "depth", "max_seq_len", "device_batch_size", "total_batch_size", "num_iterations",
              "target_flops", "target_param_data_ratio", "eval_every", "eval_tokens", "core_metric_every",
              "sample_every", "save_every", "model_tag", "overwrite", "run", "init_seed", "dry_run", "resume_from_step"}

ANCHORS = {  # name: (label, data directory under their base dir, a string only their base_train.py holds, commit)
    "088": ("karpathy/nanochat 088726a", "base_data", "configurator.py", "088726a"),
    "head": ("karpathy/nanochat HEAD", "base_data_climbmix", "--window-pattern", None),
}
DEFAULT_PATHS = {"088": "/tmp/nanochat-088726a", "head": "/tmp/nanochat-head"}

# Run in their environment as `python -c LAUNCHER <seed offset> <module> <args...>`, cwd = their checkout (their code
# first on sys.path): their compute_init's torch.manual_seed(42) (and torch.cuda.manual_seed(42)) become 42 + offset.
LAUNCHER = r"""
import runpy, sys, torch
offset = int(sys.argv[1])
module = sys.argv[2]
set_seed = torch.manual_seed
set_cuda_seed = torch.cuda.manual_seed
torch.manual_seed = lambda seed: set_seed(seed + offset)
# on CUDA they draw the init from the GPU's generator
torch.cuda.manual_seed = lambda seed: set_cuda_seed(seed + offset)
sys.argv = [module] + sys.argv[3:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def fail(message):
    sys.exit(f"error: {message}")


class Codebase:
    """Where one codebase's code, interpreter and base dir are, and the environment its processes get."""

    def __init__(self, name, label, root, python, base, dtype="", dataset="pydocs"):
        self.name = name
        self.label = label
        self.root = root
        self.python = python
        self.base = base
        self.dtype = dtype
        self.dataset = dataset  # our corpus (NANOCHAT_DATASET); an anchor reads its shards through links

    def env(self, dtype=None):
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "NANOCHAT_DATASET", "NANOCHAT_DTYPE", "NANOCHAT_BASE_DIR")}
        env.update(NANOCHAT_BASE_DIR=self.base, WANDB_MODE="disabled")
        if self.name == "ours":
            env.update(PYTHONPATH=ROOT, NANOCHAT_DATASET=self.dataset)
        dtype = self.dtype if dtype is None else dtype
        if dtype:
            env["NANOCHAT_DTYPE"] = dtype
        return env

    def run(self, args, log, what, dtype=None, shown=None):
        """
        Run `python args...` in the checkout, all output into `log`; (wall seconds, output). A failure exits with
        the log's tail.
        """
        os.makedirs(os.path.dirname(log), exist_ok=True)
        t0 = time.time()
        with open(log, "w", encoding="utf-8") as f:
            f.write(f"$ cd {self.root} && NANOCHAT_BASE_DIR={self.base} {self.python} {shown or shlex.join(args)}\n")
            f.flush()
            rc = subprocess.run([self.python, *args], cwd=self.root, env=self.env(dtype), stdout=f,
                                stderr=subprocess.STDOUT).returncode
        wall = time.time() - t0
        with open(log, encoding="utf-8", errors="replace") as f:
            out = f.read()
        if rc != 0:
            tail = "\n".join(out.splitlines()[-25:])
            fail(f"{self.label}: {what} failed (exit {rc}); log {log}, its tail:\n{tail}")
        return wall, out

    def check(self, log, val_shard, docs_for_tokens=0):
        """quality_eval.py --check in this codebase: the val shard its data code reads (and documents needed)."""
        args = ([EVAL_SCRIPT, "--check", f"--val_shard={val_shard}"]
                + ([f"--docs_for_tokens={docs_for_tokens}"] if docs_for_tokens else []))
        _, out = self.run(args, log, "the environment check (imports, its val shard)")
        return json.loads(out.strip().splitlines()[-1])


def parse_variants(names, custom):
    """[(name, overrides)] of the named built-ins (comma-separated) and of each --variant=name:--k=v,--k2=w."""
    chosen = []
    for name in filter(None, names.split(",")):
        if name not in VARIANTS:
            fail(f"--variants: no variant {name!r}; built in: {', '.join(VARIANTS)} "
                 "(or add one: --variant=name:--key=value)")
        chosen.append((name, VARIANTS[name]))
    for spec in custom:
        name, _, rest = spec.partition(":")
        overrides = [o for o in re.split(r",(?=--)", rest) if o]  # a comma before "--" separates; others are in values
        if (not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name)
                or any(not re.fullmatch(r"--\w+=.*", o) for o in overrides)):
            fail(f"--variant={spec!r}: write name:--key=value,--key2=value2 (name: letters, digits, '.', '_', '-')")
        chosen.append((name, overrides))
    if len({n for n, _ in chosen}) != len(chosen):
        fail("two variants have the same name")
    return chosen


def prepare_ours(ours, vocab_size, work, variants, shards=8):
    """Our corpus and tokenizer (reused when there), our base_train's settings; whether it has --init_seed."""
    if ours.dataset != "pydocs" or not os.path.isdir(os.path.join(ours.base, "base_data", "pydocs")):  # built once
        ours.run(["-m", "nanochat.dataset"] + ([] if ours.dataset == "pydocs" else ["-n", str(shards)]),
                 f"{work}/logs/ours_dataset.log", f"getting the {ours.dataset} corpus")
    ensure_tokenizer(ours, ["-m", "scripts.tok_train", f"--vocab_size={vocab_size}"], work)
    _, help_text = ours.run(["-m", "scripts.base_train", "--help"], f"{work}/logs/ours_help.log", "base_train --help")
    keys = set(re.findall(r"^\s+--(\w+)\s", help_text, re.M))
    for name, overrides in variants:
        for o in overrides:
            key = o[2:].split("=", 1)[0]
            if key not in keys:
                fail(f"variant {name}: our scripts.base_train has no setting --{key} "
                     "(python -m scripts.base_train --help)")
            if key in CONTROLLED:
                fail(f"variant {name}: --{key} is set by the benchmark "
                     "(use --depth/--seq_len/--tokens_per_step/--tokens/--seeds)")
    return "init_seed" in keys


def ensure_tokenizer(cb, args, work):
    """Train cb's tokenizer unless this exact command already did (a stamp file beside it)."""
    stamp = os.path.join(cb.base, "quality_tokenizer.json")
    if os.path.exists(stamp) and os.path.isdir(os.path.join(cb.base, "tokenizer")):
        with open(stamp) as f:
            if json.load(f) == args:
                return
    cb.run(args, f"{work}/logs/{cb.name}_tok_train.log", "tokenizer training")
    with open(stamp, "w") as f:
        json.dump(args, f)


def prepare_anchor(name, root, python, work, our_shards, vocab_size, dtype):
    """The anchor's checkout and environment checked, our shards linked where its code reads, its tokenizer."""
    label, data_dir, marker, commit = ANCHORS[name]
    flag = "--ref088" if name == "088" else "--refhead"
    clone = (f"git clone https://github.com/karpathy/nanochat {root}"
             + (f" && git -C {root} checkout {commit}" if commit else ""))
    train_script = os.path.join(root, "scripts", "base_train.py")
    if not os.path.exists(train_script):
        fail(f"{flag}={root}: no karpathy/nanochat checkout there; make it: {clone}")
    if marker not in open(train_script, encoding="utf-8").read():
        fail(f"{flag}={root} is not {label} (its scripts/base_train.py lacks {marker!r}); make it: {clone}")
    git = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    found = git.stdout.strip() if git.returncode == 0 and os.path.exists(os.path.join(root, ".git")) else None
    if commit and found and not commit.startswith(found[:7]):
        fail(f"{flag}={root} is at {found}, not {commit}: git -C {root} checkout {commit}")
    if not os.access(python, os.X_OK):
        fail(f"--ref_python={python}: no such interpreter; make the anchors' environment: "
             "python3 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install torch numpy rustbpe tiktoken tokenizers "
             "pyarrow wandb psutil requests filelock jinja2 pyyaml regex kernels")
    cb = Codebase(name, f"{label} ({found or 'not a git checkout: commit unknown'})", root, python,
                  os.path.join(work, name), dtype if name == "head" else "")
    # our shards under the names their code lists: the last sorted one, our validation shard, is their val split
    data = os.path.join(cb.base, data_dir)
    os.makedirs(data, exist_ok=True)
    for entry in os.listdir(data):
        if os.path.islink(os.path.join(data, entry)):
            os.unlink(os.path.join(data, entry))
    for shard in our_shards:
        os.symlink(shard, os.path.join(data, os.path.basename(shard)))
    # what their scripts import, imported from their checkout: a missing package is named now, not after a run
    imports = ("import torch, pyarrow, rustbpe, tiktoken, wandb, psutil, "
               "nanochat.tokenizer, nanochat.gpt, nanochat.dataloader")
    tried = subprocess.run([python, "-c", imports], cwd=root, env=cb.env(), capture_output=True, text=True)
    if tried.returncode != 0:
        last = (tried.stderr.strip().splitlines() or ["?"])[-1]
        module = re.search(r"No module named '([\w.]+)'", last)
        packages = "torch numpy rustbpe tiktoken pyarrow wandb psutil filelock regex"
        fail(f"{label}'s code does not import in {python} ({last}): {python} -m pip install "
             f"{module[1].split('.')[0] if module else packages}")
    found_env = cb.check(f"{work}/logs/{name}_check.log", our_shards[-1])
    if not found_env["nanochat"].startswith(os.path.realpath(root) + os.sep):
        fail(f"{python} imports the nanochat at {found_env['nanochat']}, not {root}'s: "
             "use an environment without ours installed")
    if found_env["val_shard"] != os.path.realpath(our_shards[-1]):
        fail(f"{label} reads {found_env['val_shard']} as its validation shard, not ours ({our_shards[-1]}): "
             f"remove other parquet files from {data}")
    vocab = f"--vocab_size={vocab_size}" if name == "088" else f"--vocab-size={vocab_size}"
    ensure_tokenizer(cb, ["-m", "scripts.tok_train", vocab], work)
    return cb


def train_args(cb, tag, overrides, seed, has_seed, s):
    """
    The training command (after the interpreter) of one run into checkpoint directory `tag`, and how the log shows
    it. Optional in `s` (bench/ladder.py's rungs): save_every (checkpoints along the way, to score), rerun (ours:
    --rerun=auto, a rerun resumes or skips, instead of starting over), core_per_task (ours: CORE at the end).
    """
    depth = s["depth"]
    T = s["seq_len"]
    B = s["device_batch_size"]
    tps = s["tokens_per_step"]
    n = s["steps"]
    save_every = s.get("save_every", -1)
    if cb.name == "ours":
        core = s.get("core_per_task", 0)
        args = (["-m", "scripts.base_train", f"--device_type={s['device_type']}", f"--depth={depth}",
                 f"--max_seq_len={T}", f"--device_batch_size={B}", f"--total_batch_size={tps}",
                 f"--num_iterations={n}", "--eval_every=-1", f"--eval_tokens={B * T}",
                 (f"--core_metric_every={n}" if core else "--core_metric_every=-1"),
                 "--sample_every=-1", "--run=dummy", f"--model_tag={tag}",
                 ("--rerun=auto" if s.get("rerun") else "--overwrite=True")]
                + ([f"--core_metric_max_per_task={core}"] if core else [])
                + ([f"--save_every={save_every}"] if save_every > 0 else [])
                + ([f"--init_seed={42 + seed}"] if has_seed else [])
                + overrides)
        return args, None
    if cb.name == "088":  # its configurator: --key=value; eval_every=n evaluates one batch at steps 0 and n
        rest = [f"--device_type={s['device_type']}", f"--depth={depth}", f"--max_seq_len={T}",
                f"--device_batch_size={B}", f"--total_batch_size={tps}", f"--num_iterations={n}",
                f"--eval_every={n}", f"--eval_tokens={B * T}", "--core_metric_every=-1", f"--sample_every={n}",
                "--run=dummy", f"--model_tag={tag}"]
        rest += [f"--save_every={save_every}"] if save_every > 0 else []
    else:  # HEAD: argparse with dashes; as runs/runcpu.sh, with evaluation and samples off
        rest = [f"--device-type={s['device_type']}", f"--depth={depth}", "--head-dim=64", "--window-pattern=L",
                f"--max-seq-len={T}", f"--device-batch-size={B}", f"--total-batch-size={tps}",
                f"--num-iterations={n}", "--eval-every=-1", f"--eval-tokens={B * T}", "--core-metric-every=-1",
                "--sample-every=-1", "--run=dummy", f"--model-tag={tag}"]
        rest += [f"--save-every={save_every}"] if save_every > 0 else []
    return (["-c", LAUNCHER, str(seed), "scripts.base_train", *rest],
            f"-c LAUNCHER {seed} scripts.base_train {shlex.join(rest)}")


def parse_log(cb, out, device_type):
    """(median tokens/s over the steps after the first few, compute dtype) from a training log."""
    rates = [int(r.replace(",", "")) for r in re.findall(r"tok/sec: ([\d,]+)", out)]
    steady = rates[min(5, len(rates) // 2):]  # the first steps hold compilation and warm-up
    tok_s = statistics.median(steady) if steady else None
    if cb.name == "ours":
        m = re.search(r"^Compute dtype: (\w+)", out, re.M)
    elif cb.name == "head":
        m = re.search(r"^COMPUTE_DTYPE: torch\.(\w+)", out, re.M)
    else:
        m = None
    if m:
        return tok_s, m[1]
    if cb.name != "088":
        return tok_s, "?"
    # 088726a prints none: it autocasts to bf16 on CUDA and nowhere else
    return tok_s, "bfloat16 (autocast)" if device_type == "cuda" else "float32"


def one_run(cb, variant, overrides, seed, has_seed, s, eval_set, work):
    tag = f"q-{variant}-s{seed}" if cb.name == "ours" else f"s{seed}"
    args, shown = train_args(cb, tag, overrides, seed, has_seed, s)
    print(f"  {variant} seed {seed}: training ({cb.label}) ...", flush=True)
    wall, out = cb.run(args, f"{work}/logs/{cb.name}_{variant}_s{seed}_train.log",
                       f"base_train ({variant}, seed {seed})", shown=shown)
    tok_s, dtype = parse_log(cb, out, s["device_type"])
    _, ev = cb.run([EVAL_SCRIPT, f"--model_tag={tag}", f"--val_shard={eval_set['val_shard']}",
                    f"--docs={eval_set['docs']}", f"--seq_len={s['seq_len']}", f"--device={s['eval_device']}"],
                   f"{work}/logs/{cb.name}_{variant}_s{seed}_eval.log", f"evaluation ({variant}, seed {seed})",
                   dtype="float32")
    result = json.loads(ev.strip().splitlines()[-1])
    print(f"  {variant} seed {seed}: val bpb {result['bpb']:.4f}, {tok_s or 0:,.0f} tok/s, train wall {wall:.0f} s "
          f"({result['targets']:,} target tokens evaluated)", flush=True)
    return dict(codebase=cb.name, code=cb.label, variant=variant, overrides=overrides,
                seed=42 + seed if cb.name != "ours" or has_seed else None,
                train_command=f"{cb.python} {shown or shlex.join(args)}", train_wall_s=wall, tok_per_s=tok_s,
                compute_dtype=dtype, **{f"eval_{k}": v for k, v in result.items()})


def summarize(runs):
    """One row per (codebase, variant): bpb mean, half range, per seed; medians of tokens/s; mean wall."""
    rows = {}
    for r in runs:
        rows.setdefault((r["codebase"], r["variant"]), []).append(r)
    out = []
    for (codebase, variant), rs in rows.items():
        bpbs = [r["eval_bpb"] for r in rs]
        rates = [r["tok_per_s"] for r in rs if r["tok_per_s"]]
        out.append(dict(codebase=codebase, variant=variant, code=rs[0]["code"], bpb_mean=statistics.mean(bpbs),
                        bpb_half_range=(max(bpbs) - min(bpbs)) / 2 if len(bpbs) > 1 else None, bpb_per_seed=bpbs,
                        seeds=[r["seed"] for r in rs], tok_per_s=statistics.median(rates) if rates else None,
                        params=rs[0]["eval_params"], train_wall_s=statistics.mean(r["train_wall_s"] for r in rs),
                        compute_dtype=rs[0]["compute_dtype"]))
    return out


def print_table(summary, seed_note):
    print("\n| variant | code | val bpb (mean ± half range) | per seed | tok/s | params | train wall / run "
          "| compute dtype |")
    print("|---|---|---|---|---|---|---|---|")
    for row in summary:
        spread = f" ± {row['bpb_half_range']:.4f}" if row["bpb_half_range"] is not None else " (1 seed)"
        print(f"| {row['variant']} | {row['code']} | {row['bpb_mean']:.4f}{spread} | "
              f"{', '.join(f'{b:.4f}' for b in row['bpb_per_seed'])} | "
              f"{row['tok_per_s'] or 0:,.0f} | {row['params']:,} | {row['train_wall_s']:.0f} s | "
              f"{row['compute_dtype']} |")
    if seed_note:
        print(f"\n{seed_note}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, help=f"model depth (default {FULL['depth']}; --dry {DRY['depth']})")
    parser.add_argument("--seq_len", type=int,
                        help=f"sequence length (default {FULL['seq_len']}; --dry {DRY['seq_len']})")
    parser.add_argument("--tokens_per_step", type=int,
                        help=f"tokens per optimizer step (default {FULL['tokens_per_step']:,})")
    parser.add_argument("--tokens", type=int,
                        help=f"training tokens per run (default {FULL['tokens']:,}; steps = tokens // tokens_per_step)")
    parser.add_argument("--seeds", type=int, help=f"runs per variant, seeds 42, 43, ... (default {FULL['seeds']})")
    parser.add_argument("--first_seed", type=int, default=0,
                        help="start at seed 42 + this: runs seeds the last invocation did not "
                        "(--first_seed=1 --seeds=1 is the second seed alone)")
    parser.add_argument("--eval_tokens", type=int,
                        help=f"validation tokens scored, by our tokenizer (default and minimum {EVAL_FLOOR:,}; "
                        f"--dry {DRY['eval_tokens']:,})")
    parser.add_argument("--device_batch_size", type=int, default=32, help="rows per forward/backward (every codebase)")
    parser.add_argument("--vocab_size", type=int, default=8192, help="vocabulary of every tokenizer")
    parser.add_argument("--variants", default="baseline",
                        help=f"our named variants, comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument("--variant", action="append", default=[],
                        help="a custom variant: name:--key=value,--key2=value2 (repeatable)")
    parser.add_argument("--anchors", default="088,head", help="which anchors to run: 088, head (empty: none)")
    parser.add_argument("--ref088", default=DEFAULT_PATHS["088"], help="checkout of karpathy/nanochat at 088726a")
    parser.add_argument("--refhead", default=DEFAULT_PATHS["head"],
                        help="checkout of karpathy/nanochat's newest commit")
    parser.add_argument("--ref_python", default="/tmp/refvenv/bin/python", help="python of the anchors' environment")
    parser.add_argument("--device_type", default="cpu", choices=["cpu", "cuda"], help="where every codebase trains")
    parser.add_argument("--eval_device", default="cpu", choices=["cpu", "cuda"],
                        help="where the fp32 scoring runs (the same for all)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at a time (tokens/s then compare within one invocation)")
    parser.add_argument("--dtype", default="", choices=["", "float32", "bfloat16"],
                        help="NANOCHAT_DTYPE of ours and HEAD (empty: each decides)")
    parser.add_argument("--work", default="/tmp/nanochat_quality",
                        help="work directory: corpus, tokenizers, checkpoints, logs")
    parser.add_argument("--out", default="", help="JSON of every run (default <work>/quality.json)")
    parser.add_argument("--dry", action="store_true",
                        help="tiny sizes: checks the plumbing, says nothing about quality")
    args = parser.parse_args()

    sizes = DRY if args.dry else FULL
    s = {k: getattr(args, k) if getattr(args, k) is not None else sizes[k] for k in FULL}
    s.update(device_type=args.device_type, eval_device=args.eval_device)
    if args.jobs < 1 or args.first_seed < 0:
        fail(f"--jobs={args.jobs} must be >= 1 and --first_seed={args.first_seed} >= 0")
    if not args.dry and s["eval_tokens"] < EVAL_FLOOR:
        fail(f"--eval_tokens={s['eval_tokens']}: at least {EVAL_FLOOR:,} (only --dry may score fewer)")
    s["device_batch_size"] = B = min(args.device_batch_size, s["tokens_per_step"] // s["seq_len"])
    if B < 1 or s["tokens_per_step"] % (B * s["seq_len"]):
        fail(f"--tokens_per_step={s['tokens_per_step']} must be a multiple of device_batch_size x seq_len = "
             f"{max(B, 1)} x {s['seq_len']}")
    s["steps"] = s["tokens"] // s["tokens_per_step"]
    if s["steps"] < 1:
        fail(f"--tokens={s['tokens']} is less than one step of {s['tokens_per_step']} tokens")
    anchors = [a for a in args.anchors.split(",") if a]
    if any(a not in ANCHORS for a in anchors):
        fail(f"--anchors={args.anchors}: choose among {', '.join(ANCHORS)}")
    variants = parse_variants(args.variants, args.variant)
    work = os.path.abspath(args.work)
    out_path = args.out or os.path.join(work, "quality.json")
    print(f"{'DRY RUN (plumbing check, not a quality result): ' if args.dry else ''}"
          f"depth {s['depth']}, seq {s['seq_len']}, {s['tokens_per_step']:,} tokens/step x {s['steps']} steps = "
          f"{s['steps'] * s['tokens_per_step']:,} tokens, {s['seeds']} seed(s) from {42 + args.first_seed}, "
          f"device batch {B}, training on {args.device_type}, {args.jobs} run(s) at a time; work dir {work}\n"
          f"{machine_line()}")

    # prerequisites first, each a clear message: nothing trains for an hour and then finds a path missing
    ours = Codebase("ours", "ours", ROOT, sys.executable, os.path.join(work, "ours"), args.dtype)
    has_seed = prepare_ours(ours, args.vocab_size, work, variants)
    seed_note = None if has_seed else ("our scripts.base_train has no --init_seed setting (its init is "
                                       "GPT.init_weights' fixed seed 42): our variants cannot vary the seed and run "
                                       "once each")
    if seed_note:
        print(f"note: {seed_note}")
    shard_dir = os.path.join(ours.base, "base_data", "pydocs")
    our_shards = sorted(os.path.join(shard_dir, f) for f in os.listdir(shard_dir)
                        if re.fullmatch(r"shard_\d{5}\.parquet", f))
    ours_check = ours.check(f"{work}/logs/ours_check.log", our_shards[-1], s["eval_tokens"])
    if ours_check["val_shard"] != os.path.realpath(our_shards[-1]):
        fail(f"our data code reads {ours_check['val_shard']} as the validation shard, not {our_shards[-1]}")
    if not ours_check["shard_tokens_enough"]:
        fail(f"the validation shard holds only {ours_check['tokens']:,} tokens by our tokenizer: lower --eval_tokens")
    eval_set = dict(val_shard=our_shards[-1], docs=ours_check["docs"], our_tokens=ours_check["tokens"])
    print(f"eval set: the first {eval_set['docs']} documents of {eval_set['val_shard']} ({eval_set['our_tokens']:,} "
          f"tokens by our tokenizer)")
    codebases = [ours] + [prepare_anchor(a, os.path.abspath(args.ref088 if a == "088" else args.refhead),
                                         os.path.abspath(args.ref_python), work, our_shards, args.vocab_size,
                                         args.dtype)
                          for a in anchors]

    # seeds outermost: every codebase's runs spread over the same stretch of time (the machine's load varies)
    plan = [(cb, variant, overrides, seed) for seed in range(args.first_seed, args.first_seed + s["seeds"])
            for cb in codebases for variant, overrides in (variants if cb.name == "ours" else [(cb.name, [])])
            if cb.name != "ours" or seed == 0 or has_seed]
    done = {}
    failed = []
    t0 = time.time()
    stopping = threading.Event()

    def run_planned(i):
        cb, variant, overrides, seed = plan[i]
        if stopping.is_set():
            return i, None
        try:
            return i, one_run(cb, variant, overrides, seed, has_seed, s, eval_set, work)
        except SystemExit as e:  # fail(): one run's failure is reported; the other runs go on
            print(f"  {variant} seed {seed}: FAILED: {e}", flush=True)
            failed.append(f"{variant} seed {42 + seed}: {str(e).splitlines()[0]}")
            return i, None

    pool = ThreadPoolExecutor(max_workers=args.jobs)  # each run is a subprocess: the threads only wait for them
    try:
        for future in as_completed([pool.submit(run_planned, i) for i in range(len(plan))]):
            i, run = future.result()
            if run is not None:
                done[i] = run
                runs = [done[j] for j in sorted(done)]  # in plan order, however they finished
                with open(out_path, "w") as f:  # after every run: a stopped benchmark keeps what it measured
                    json.dump(dict(settings=s, dry=args.dry, machine=machine_line(), eval_set=eval_set,
                                   seed_note=seed_note, runs=runs, summary=summarize(runs)), f, indent=1)
    except KeyboardInterrupt:  # Ctrl-C reached the running trainings too (one process group): start no more
        stopping.set()
        pool.shutdown(wait=True, cancel_futures=True)
        fail(f"interrupted: {len(done)} of {len(plan)} runs finished, in {out_path}")
    pool.shutdown()
    runs = [done[j] for j in sorted(done)]

    print(f"\n{'DRY RUN, plumbing check only: ' if args.dry else ''}{machine_line()}")
    print(f"depth {s['depth']}, seq {s['seq_len']}, {s['tokens_per_step']:,} tokens/step x {s['steps']} steps; "
          f"val bpb over the first {eval_set['docs']} documents of the pydocs validation shard "
          f"({eval_set['our_tokens']:,} tokens by our tokenizer); total {(time.time() - t0) / 60:.1f} min")
    print_table(summarize(runs), seed_note)
    print(f"\nwrote {out_path}")
    if failed:
        fail(f"{len(failed)} of {len(plan)} runs failed (their logs are under {work}/logs):\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
