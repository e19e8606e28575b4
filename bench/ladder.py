"""
Quality as a curve: a depth ladder per experiment, and the compute multiplier (CM) between two of them (issue 62).

An experiment is a name, a codebase (ours, with --key=value settings, or a karpathy/nanochat anchor trained as
bench/quality.py trains it), depths, tokens per scaling parameter, a dataset and seeds. Each (depth, seed) is a rung:
one base_train run whose checkpoints along the way are scored by bench/quality_eval.py (the same bits per byte for
every codebase), giving its training curve of (FLOPs, val bpb). `compare` reads two experiments' curves and says, per
depth, how much compute the baseline needs to reach the variant's final bpb, over the variant's compute.

    python bench/ladder.py run base --seeds=3                                # our defaults on the CPU ladder
    python bench/ladder.py run sched2025 --variant=sched2025 --seeds=3       # a named variant of bench/quality.py
    python bench/ladder.py run no_ve --variant=--value_embeds=False --seeds=2
    python bench/ladder.py run a088 --codebase=088 --ref088=/tmp/nanochat-088726a --seeds=3
    python bench/ladder.py compare base no_ve                                # table, JSON and PNG
    python bench/ladder.py run gpu-base --gpu                                # HEAD's ladder on a GPU
    python bench/ladder.py run base --help                                   # every setting and its default

The CPU ladder (default): depths 1-4 at 0.08 tokens per scaling parameter, sequence 512, 2,048 tokens a step,
4 checkpoints scored per rung over the first documents of pydocs' validation shard holding 65,536 tokens, vocab
8,192, CORE over 25 examples per task. Its largest rung (depth 4, 420k tokens) stays inside one epoch of pydocs
(~0.56M training tokens): a curve over repeated text measures memorization, and the CM assumes fresh text. Its time
per seed: docs/ladder.md.
The GPU ladder (--gpu): karpathy/nanochat HEAD's, depths 12, 14, 16, 20 and 24 at 12 tokens per scaling parameter,
sequence 2,048, 524,288 tokens a step, on ClimbMix (its shards must be on disk: the tool says how many).

The rules, for every codebase alike:
- scaling parameters of depth d (width w = 64 d, vocab V): the blocks' matrices and lm_head, 12 d w^2 + w V, as
  karpathy/nanochat HEAD counts them for its tokens:params ratio; a rung trains round(ratio x that / tokens a step)
  steps, so every codebase sees the same tokens at one depth;
- FLOPs per token, from the trained model's shape: 6 x the parameters of every nn.Linear (lm_head included) +
  the sum over layers of 12 x heads x head_dim x min(window, T); a checkpoint of step s has spent that x s x tokens
  a step;
- the CM of a variant's rung against the baseline's rung of the same depth: b* = the variant's final bpb; F_base =
  the FLOPs at which the baseline's curve first reaches b*, interpolated piecewise-linearly in (log FLOPs, log bpb)
  (w = (ln b0 - ln b*) / (ln b0 - ln b1), ln F = (1 - w) ln f0 + w ln f1); past either end of the curve its edge
  segment is extended and the CM marked extrapolated ("~"); CM = F_base / F_variant (> 1: the variant needs less
  compute for the same quality);
- the noise, from the seeds: the CM of each variant seed against the baseline's seed-mean curve (mean log bpb),
  and of the variant's seed-mean final against each baseline seed's curve; their spreads in ln CM, pooled (one seed
  noise for both recipes), give the standard error of the point CM (seed means against seed means) and, with
  Student's t at m + n - 2 degrees of freedom, its 95% interval. Verdict per depth: better if the interval lies
  above 1, worse if below, else within noise (one seed on each side: noise unknown). The CM of every seed pair is
  shown too;
- the summary CM across the ladder: log bpb = a + s log F + delta x [variant] fitted by least squares on every
  rung's final point at the common depths (one slope, two intercepts), CM = exp(delta / s); its interval and
  verdict as above, with the fit in place of the interpolation.

A rerun of the same command skips finished rungs (their records in <work>/ladders/<name>/curve.jsonl) and, for
ours, resumes an interrupted one from its last checkpoint (base_train --rerun=auto); an anchor's interrupted rung
starts again. Worked example and the GPU set-up: docs/ladder.md.
"""

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import quality  # bench/quality.py: how each codebase is prepared and trained
from ab import machine_line  # bench/ab.py

ROOT = quality.ROOT
CPU = dict(depths="1,2,3,4", ratio=0.08, seq_len=512, tokens_per_step=2048, device_batch_size=4, evals=4,
           eval_tokens=65536, core_per_task=25, vocab_size=8192, dataset="pydocs", shards=8, device_type="cpu",
           eval_device="cpu")
GPU = dict(depths="12,14,16,20,24", ratio=12.0, seq_len=2048, tokens_per_step=524288, device_batch_size=32, evals=8,
           eval_tokens=2097152, core_per_task=500, vocab_size=32768, dataset="climbmix", shards=500,
           device_type="cuda", eval_device="cuda")
# Settings of ours the ladder sets for every rung, beyond what bench/quality.py sets
LADDER_CONTROLLED = {"save_every", "rerun", "core_metric_max_per_task"}
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
CHECKPOINT_FILE = re.compile(r"(model|meta|optim)_(\d{6})[._]")


def fail(message):
    sys.exit(f"error: {message}")


# -----------------------------------------------------------------------------
# What a rung is: its steps, its FLOPs


def scaling_params(depth, vocab_size):
    """The blocks' matrices and lm_head of a model `depth` deep (width 64 x depth): 12 d w^2 + w V."""
    width = 64 * depth
    return 12 * depth * width * width + width * vocab_size


def device_batch_for(depth, cap):
    """Rows per micro-step: `cap`, halved from depth 20 and quartered from 28 (as HEAD's miniseries.sh: memory)."""
    return max(1, cap // 4 if depth >= 28 else cap // 2 if depth >= 20 else cap)


def plan_rung(depth, st):
    """A rung's sizes: steps, tokens, how often it saves a checkpoint to score, rows per micro-step."""
    scaling = scaling_params(depth, st["vocab_size"])
    steps = max(1, round(st["ratio"] * scaling / st["tokens_per_step"]))
    B = min(device_batch_for(depth, st["device_batch_size"]), st["tokens_per_step"] // st["seq_len"])
    return dict(depth=depth, scaling_params=scaling, steps=steps, tokens=steps * st["tokens_per_step"],
                save_every=math.ceil(steps / st["evals"]), device_batch_size=B)


def check_rungs(rungs, st, codebase):
    """One-line errors for a ladder that cannot run as asked, before anything trains."""
    for r in rungs:
        d = r["depth"]
        B = r["device_batch_size"]
        if B < 1 or st["tokens_per_step"] % (B * st["seq_len"]):
            fail(f"--tokens_per_step={st['tokens_per_step']} is not a multiple of a micro-step of depth {d}: "
                 f"{max(B, 1)} rows x {st['seq_len']} tokens")
        if r["steps"] < st["evals"]:
            fail(f"depth {d} trains {r['steps']} step(s) ({st['ratio']} tokens per scaling parameter x "
                 f"{r['scaling_params']:,} / {st['tokens_per_step']:,} tokens a step), fewer than the --evals="
                 f"{st['evals']} points of its curve: raise --ratio, lower --tokens_per_step or --evals, or drop it")
        width = 64 * d
        heads = max(1, -(-width // 128))
        if codebase == "088" and width % heads:  # 088726a: heads of ceil(width / 128), asserted to divide the width
            fail(f"depth {d} does not fit karpathy/nanochat 088726a's model: width {width} does not split into "
                 f"{heads} heads (its heads are ceil(width / 128)); even depths always fit")


def check_dataset(rungs, data, st):
    """The largest rung must fit in one epoch of the dataset's training text: a one-line error otherwise."""
    largest = max(rungs, key=lambda r: r["tokens"])
    print(f"dataset {data['name']}: ~{data['train_tokens']:,} training tokens by our tokenizer; the largest rung "
          f"(depth {largest['depth']}) trains on {largest['tokens']:,}", flush=True)
    if largest["tokens"] > data["train_tokens"]:
        fail(f"the largest rung (depth {largest['depth']}: {largest['tokens']:,} tokens) needs more than the "
             f"~{data['train_tokens']:,} training tokens of {data['name']} (by our tokenizer): repeated text would "
             f"make its curve one of memorization. Lower --ratio or the depths, or give a larger --dataset"
             + (f" / more --shards (now {st['shards']})" if data["name"] != "pydocs" else ""))


def flops_per_token(linear_params, config, seq_len):
    """6 x every Linear's parameters + sum over layers of 12 x heads x head_dim x min(window, T)."""
    from nanochat.gpt import layer_windows  # ours: HEAD's windows at every T (its docstring); 088726a has none
    shape = types.SimpleNamespace(n_layer=config["n_layer"], sequence_len=seq_len,
                                  window_pattern=config.get("window_pattern") or "L")
    head_dim = config["n_embd"] // config["n_head"]
    return 6 * linear_params + sum(12 * config["n_head"] * head_dim * (seq_len if w is None else min(w, seq_len))
                                   for w in layer_windows(shape))


# -----------------------------------------------------------------------------
# The compute multiplier and its noise


def flops_at(points, target):
    """
    (FLOPs where the curve [(FLOPs, bpb), ...] first reaches bpb `target`, extrapolated?), piecewise-linear in
    (log FLOPs, log bpb); past either end along the edge segment, if it descends. None where it cannot say.
    """
    def solve(p0, p1):
        (f0, b0), (f1, b1) = p0, p1
        w = (math.log(b0) - math.log(target)) / (math.log(b0) - math.log(b1))
        return math.exp((1 - w) * math.log(f0) + w * math.log(f1))

    if len(points) < 2:
        return None
    for p0, p1 in zip(points, points[1:]):
        if p1[1] <= target <= p0[1] and p0[1] != p1[1]:
            return solve(p0, p1), False
    edge = points[:2] if target > points[0][1] else points[-2:]
    if not edge[1][1] < edge[0][1]:  # a flat or rising edge has no slope to extend along
        return None
    return solve(*edge), True


def cm_of(base_points, var_flops, var_bpb):
    """(CM, extrapolated) of a variant's final (FLOPs, bpb) against a baseline's curve, or None."""
    found = flops_at(base_points, var_bpb)
    return None if found is None else (found[0] / var_flops, found[1])


def curve(record):
    return [(p[1], p[2]) for p in record["points"]]


def mean_curve(records):
    """The seed-mean curve (mean log bpb at each FLOPs) of records with the same FLOPs grid."""
    grids = {tuple(p[1] for p in r["points"]) for r in records}
    if len(grids) != 1:
        raise ValueError("the seeds of one depth were scored at different FLOPs")
    return [(f, math.exp(sum(math.log(r["points"][i][2]) for r in records) / len(records)))
            for i, f in enumerate(grids.pop())]


# Student's t at 97.5% for 1..30 degrees of freedom (beyond: the normal's 1.96): a 95% interval from few seeds
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def seed_interval(point, by_variant_seed, by_baseline_seed):
    """
    The 95% interval of a CM from its seed noise: `by_variant_seed` holds the CM of each variant seed alone against
    the baseline's seeds together, `by_baseline_seed` that of the variant's seeds together against each baseline
    seed alone. Their spreads, pooled (one seed noise, in ln CM, for both recipes), give the standard error of
    ln `point`: s x sqrt(1/m + 1/n), and Student's t with m + n - 2 degrees of freedom the interval. None with one
    seed on each side: nothing says how far a seed moves the CM.
    """
    groups = [[math.log(c) for c in g] for g in (by_variant_seed, by_baseline_seed)]
    df = sum(len(g) - 1 for g in groups if g)
    if df < 1 or not all(groups):
        return None
    ss = sum((x - sum(g) / len(g)) ** 2 for g in groups for x in g)
    half = T975[df - 1] if df <= len(T975) else 1.96
    half *= math.sqrt(ss / df) * math.sqrt(1 / len(groups[0]) + 1 / len(groups[1]))
    return [point * math.exp(-half), point * math.exp(half)]


def verdict(interval):
    """better / worse / within noise: where the 95% interval lies against CM = 1."""
    if interval is None:
        return "noise unknown (one seed each)"
    if interval[0] > 1:
        return "better"
    if interval[1] < 1:
        return "worse"
    return "within noise"


def geo_mean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values))


def depth_cm(base, var):
    """The CM at one depth, its 95% interval and verdict; base, var: the two experiments' records (one per seed)."""
    F = var[0]["flops"]
    base_curve = mean_curve(base)
    var_bpb = geo_mean([r["val_bpb"] for r in var])
    point = cm_of(base_curve, F, var_bpb)
    by_var = [c[0] for v in var if (c := cm_of(base_curve, F, v["val_bpb"]))]
    by_base = [c[0] for b in base if (c := cm_of(curve(b), F, var_bpb))]
    pairs = [c for b in base for v in var if (c := cm_of(curve(b), F, v["val_bpb"]))]
    interval = seed_interval(point[0], by_var, by_base) if point else None
    return dict(depth=base[0]["depth"], variant_flops=F, base_bpb=[r["val_bpb"] for r in base],
                variant_bpb=[r["val_bpb"] for r in var], cm=point[0] if point else None,
                extrapolated=point[1] if point else None, interval=interval, pair_cms=[c[0] for c in pairs],
                pairs_extrapolated=sum(c[1] for c in pairs),
                verdict=verdict(interval) if point else "n/a: the baseline's curve does not reach it")


def fit_cm(base_finals, var_finals):
    """
    The CM of a common-slope fit log bpb = a + s log F + delta [variant] over final points [(FLOPs, bpb)]:
    exp(delta / s). None without two distinct FLOPs or with a slope that does not fall.
    """
    import numpy as np
    rows = [(math.log(f), math.log(b), g) for g, finals in ((0, base_finals), (1, var_finals)) for f, b in finals]
    if not base_finals or not var_finals or len({round(x, 9) for x, _, _ in rows}) < 2:
        return None
    X = np.array([[1.0, x, g] for x, _, g in rows])
    y = np.array([v for _, v, _ in rows])
    (_, slope, delta), *_ = np.linalg.lstsq(X, y, rcond=None)
    return math.exp(delta / slope) if slope < 0 else None


def summary_cm(base, var, depths):
    """The summary CM across the ladder (every seed's finals at `depths`), its 95% interval, verdict, pair range."""
    def finals(records, seed=None):
        return [(r["flops"], r["val_bpb"]) for r in records if r["depth"] in depths and seed in (None, r["seed"])]

    base_seeds = sorted({r["seed"] for r in base})
    var_seeds = sorted({r["seed"] for r in var})
    point = fit_cm(finals(base), finals(var))
    if point is None:
        return dict(cm=None, interval=None, pair_range=None,
                    verdict="needs two depths" if len(depths) < 2 else "no fit: bpb does not fall with FLOPs")
    by_var = [c for j in var_seeds if (c := fit_cm(finals(base), finals(var, j)))]
    by_base = [c for i in base_seeds if (c := fit_cm(finals(base, i), finals(var)))]
    pairs = [c for i in base_seeds for j in var_seeds if (c := fit_cm(finals(base, i), finals(var, j)))]
    interval = seed_interval(point, by_var, by_base)
    return dict(cm=point, interval=interval, pair_range=[min(pairs), max(pairs)] if pairs else None,
                verdict=verdict(interval))


# -----------------------------------------------------------------------------
# An experiment on disk: experiment.json (what it is) and curve.jsonl (one record per finished rung)


def experiment_dir(work, name):
    if not NAME.fullmatch(name):
        fail(f"experiment name {name!r}: letters, digits, '.', '_', '-' (at most 64)")
    return os.path.join(work, "ladders", name)


def load_experiment(work, name):
    path = experiment_dir(work, name)
    if not os.path.exists(os.path.join(path, "experiment.json")):
        known = sorted(os.listdir(os.path.join(work, "ladders"))) if os.path.isdir(os.path.join(work, "ladders")) \
            else []
        fail(f"no experiment {name!r} in {work}/ladders (there: {', '.join(known) or 'none'}); "
             f"run it: python bench/ladder.py run {name}")
    with open(os.path.join(path, "experiment.json")) as f:
        experiment = json.load(f)
    return experiment, read_records(path)


def read_records(path):
    """The rung records of an experiment directory (a line cut short by a kill is left out)."""
    records = []
    if os.path.exists(os.path.join(path, "curve.jsonl")):
        with open(os.path.join(path, "curve.jsonl")) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return records


def git_commit(root):
    """
    The checkout's commit, '+dirty' when its tracked files differ from it; outside git, what its COMMIT file says
    (an extracted checkout: bench/gpu_prepare.sh, tests/helpers.py head_checkout), else 'unknown'.
    """
    head = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    if head.returncode or not os.path.exists(os.path.join(root, ".git")):
        if os.path.exists(os.path.join(root, "COMMIT")):
            with open(os.path.join(root, "COMMIT")) as f:
                return f.read().strip() + " (COMMIT file)"
        return "unknown"
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")


def time_left(done, remaining):
    """
    Seconds left: wall = a + b x FLOPs fitted on the rungs done in this invocation [(FLOPs, wall)] (a: a rung's
    start-up, b: seconds per FLOP), over `remaining` rungs' FLOPs; None before two sizes are done (unless only that
    size remains).
    """
    if not done:
        return None
    xs = [f for f, _ in done]
    ys = [w for _, w in done]
    if len(set(xs)) < 2:  # one size: it says nothing of how time grows with FLOPs, only what it takes again
        if set(remaining) - set(xs):
            return None
        return len(remaining) * sum(ys) / len(ys)
    mx = sum(xs) / len(xs)
    my = sum(ys) / len(ys)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs))
    a = max(0.0, my - b * mx)
    return sum(a + b * f for f in remaining)


def minutes(seconds):
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def dataset_tokens(shards, chars_per_token):
    """About how many training tokens the dataset's train shards (all but the last) hold."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    train = shards[:-1]
    counted = train if len(train) <= 8 else train[:2]  # big hub shards are alike: two of them say enough
    chars = sum(pc.sum(pc.utf8_length(pq.read_table(p, columns=["text"]).column("text"))).as_py() for p in counted)
    return chars * len(train) / max(1, len(counted)) / chars_per_token


def eval_docs_chars(val_shard, docs):
    import pyarrow.parquet as pq
    texts = pq.read_table(val_shard, columns=["text"]).column("text").to_pylist()[:docs]
    return sum(len(t) for t in texts)


# -----------------------------------------------------------------------------
# run


def settings_from(args):
    """The experiment's settings: the preset (CPU, or --gpu) with what the command line gave."""
    preset = GPU if args.gpu else CPU
    st = {k: getattr(args, k) if getattr(args, k, None) is not None else v for k, v in preset.items()}
    try:
        st["depths"] = sorted({int(d) for d in str(st["depths"]).split(",") if d.strip()})
    except ValueError:
        fail(f"--depths={st['depths']}: comma-separated positive integers, e.g. 1,2,3,4")
    if not st["depths"] or min(st["depths"]) < 1:
        fail(f"--depths={args.depths}: at least one depth, each >= 1")
    for key in ("ratio", "seq_len", "tokens_per_step", "device_batch_size", "evals", "eval_tokens", "vocab_size",
                "shards"):
        if not st[key] > 0:
            fail(f"--{key}={st[key]} must be > 0")
    if args.seeds < 1 or args.first_seed < 0:
        fail(f"--seeds={args.seeds} must be >= 1 and --first_seed={args.first_seed} >= 0")
    return st


def variant_overrides(spec):
    """--variant: a named variant of bench/quality.py, or --key=value,--key2=value2."""
    if not spec:
        return []
    if spec in quality.VARIANTS:
        return list(quality.VARIANTS[spec])
    overrides = [o for o in re.split(r",(?=--)", spec) if o]
    if not all(re.fullmatch(r"--\w+=.*", o) for o in overrides):
        fail(f"--variant={spec!r}: a name ({', '.join(quality.VARIANTS)}) or --key=value,--key2=value2")
    for o in overrides:
        if o[2:].split("=", 1)[0] in LADDER_CONTROLLED:
            fail(f"--variant: {o.split('=', 1)[0]} is set by the ladder for every rung")
    return overrides


def prepare(args, st, overrides):
    """
    The codebase that trains (ours, or an anchor beside ours), our corpus and tokenizer (the eval set is counted in
    our tokens, as bench/quality.py counts it) and the eval set: (codebase, has_seed, eval_set, data, shards).
    """
    prep = os.path.join(os.path.abspath(args.work), f"{st['dataset']}-v{st['vocab_size']}")
    ours = quality.Codebase("ours", f"ours ({git_commit(ROOT)})", ROOT, sys.executable, os.path.join(prep, "ours"),
                            args.dtype, st["dataset"])
    has_seed = quality.prepare_ours(ours, st["vocab_size"], prep, [("variant", overrides)], st["shards"])
    shard_dir = os.path.join(ours.base, "base_data", st["dataset"])
    shards = sorted(os.path.join(shard_dir, f) for f in os.listdir(shard_dir)
                    if re.fullmatch(r"shard_\d{5}\.parquet", f))
    if len(shards) < 2:
        fail(f"{shard_dir} holds {len(shards)} shard(s): a train shard and the validation shard at least")
    check = ours.check(f"{prep}/logs/ours_check.log", shards[-1], st["eval_tokens"])
    if not check["shard_tokens_enough"]:
        fail(f"the validation shard holds only {check['tokens']:,} tokens by our tokenizer: lower --eval_tokens")
    eval_set = dict(val_shard=os.path.basename(shards[-1]), val_bytes=os.path.getsize(shards[-1]), docs=check["docs"],
                    our_tokens=check["tokens"], seq_len=st["seq_len"])
    chars_per_token = eval_docs_chars(shards[-1], check["docs"]) / check["tokens"]
    data = dict(name=st["dataset"], shards=[(os.path.basename(p), os.path.getsize(p)) for p in shards],
                train_tokens=round(dataset_tokens(shards, chars_per_token)))
    if args.codebase == "ours":
        return ours, has_seed, eval_set, data, shards
    root = os.path.abspath(args.ref088 if args.codebase == "088" else args.refhead)
    cb = quality.prepare_anchor(args.codebase, root, os.path.abspath(args.ref_python), prep, shards,
                                st["vocab_size"], args.dtype)
    return cb, True, eval_set, data, shards


def same_experiment(before, now, name, path, commit=True):
    """
    A one-line error if experiment `name` was made otherwise than `now` says (a dirty tree aside; with commit=False,
    when nothing is left to train, another commit is only noted).
    """
    changed = [k for k in now if before.get(k) != now[k]
               and not (k == "commit" and before[k].removesuffix("+dirty") == now[k].removesuffix("+dirty"))]
    if not commit and "commit" in changed:
        changed.remove("commit")
        print(f"note: experiment {name} was made at commit {before['commit']}; this checkout is {now['commit']}")
    if changed:
        what = "; ".join(f"{k}: {before.get(k)!r} -> {now[k]!r}" for k in changed)
        fail(f"experiment {name} was made otherwise ({what}): name a new experiment, or delete {path}")


def run(args):
    st = settings_from(args)
    work = os.path.abspath(args.work)
    path = experiment_dir(work, args.name)
    if args.codebase != "ours" and args.variant:
        fail("--variant sets our base_train's settings: an anchor trains with its own (bench/quality.py)")
    overrides = variant_overrides(args.variant)
    rungs = [plan_rung(d, st) for d in st["depths"]]
    check_rungs(rungs, st, args.codebase)
    print(f"experiment {args.name} ({path}): {args.codebase}{' ' + ' '.join(overrides) if overrides else ''}; "
          f"depths {', '.join(map(str, st['depths']))} at {st['ratio']} tokens per scaling parameter, sequence "
          f"{st['seq_len']}, {st['tokens_per_step']:,} tokens a step, {st['evals']} points a rung, dataset "
          f"{st['dataset']}; seeds {42 + args.first_seed}..{42 + args.first_seed + args.seeds - 1}; "
          f"on {st['device_type']}\n{machine_line()}", flush=True)

    # What the experiment is: what this command says (checked now), then the data it prepares (checked after)
    root = ROOT if args.codebase == "ours" else os.path.abspath(args.ref088 if args.codebase == "088" else args.refhead)
    code = "ours" if args.codebase == "ours" else quality.ANCHORS[args.codebase][0]
    identity = dict(codebase=args.codebase, code=code, commit=git_commit(root), overrides=overrides,
                    ratio=st["ratio"], seq_len=st["seq_len"], tokens_per_step=st["tokens_per_step"],
                    device_batch_size=st["device_batch_size"],
                    vocab_size=st["vocab_size"], evals=st["evals"], core_per_task=st["core_per_task"],
                    device_type=st["device_type"], dtype=args.dtype, dataset=st["dataset"])
    meta_path = os.path.join(path, "experiment.json")
    before = None
    done = {(r["depth"], r["seed"]) for r in read_records(path)}
    plan = [(seed, r) for seed in range(args.first_seed, args.first_seed + args.seeds) for r in rungs]
    todo = [(seed, r) for seed, r in plan if (r["depth"], 42 + seed) not in done]
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            before = json.load(f)["identity"]
        same_experiment(before, identity, args.name, path, commit=bool(todo))
    print(f"{len(plan)} rung(s), {len(plan) - len(todo)} done before; records: {path}/curve.jsonl", flush=True)
    if not todo:  # nothing to train: nothing to prepare either
        for k, (seed, r) in enumerate(plan, 1):
            print(f"[{k}/{len(plan)}] seed {42 + seed}, depth {r['depth']}: done before, skipped")
        print(f"experiment {args.name}: every rung done; compare it: python bench/ladder.py compare <baseline> "
              f"{args.name}")
        return

    cb, has_seed, eval_set, data, shards = prepare(args, st, overrides)
    check_dataset(rungs, data, st)
    if not has_seed:
        fail("our scripts.base_train has no --init_seed: its seeds could not differ")
    # as JSON reads it back (lists, not tuples), so that a rerun compares like with like
    identity = json.loads(json.dumps(dict(identity, shards=data["shards"], eval_set=eval_set)))
    os.makedirs(os.path.join(path, "logs"), exist_ok=True)
    if before is not None:
        same_experiment(before, identity, args.name, path)
    else:
        with open(meta_path, "w") as f:
            json.dump(dict(name=args.name, identity=identity, settings=st, created=time.strftime("%Y-%m-%d %H:%M"),
                           machine=machine_line()), f, indent=1)

    est_flops = {r["depth"]: r["tokens"] * (6 * r["scaling_params"]) for r in rungs}  # for the time left only
    exp = dict(name=args.name, st=st, overrides=overrides, has_seed=has_seed, eval_set=eval_set, val_shard=shards[-1],
               path=path)
    timed = []
    t_start = time.time()
    try:
        for k, (seed, r) in enumerate(plan, 1):
            where = f"[{k}/{len(plan)}] seed {42 + seed}, depth {r['depth']}"
            if (r["depth"], 42 + seed) in done:
                print(f"{where}: done before, skipped", flush=True)
                continue
            print(f"{where}: {r['steps']:,} steps, {r['tokens']:,} tokens (its log: {path}/logs/d{r['depth']}_s"
                  f"{42 + seed}_train.log) ...", flush=True)
            t0 = time.time()
            record = run_rung(cb, exp, seed, r)
            wall = time.time() - t0
            timed.append((est_flops[r["depth"]], wall))
            left = time_left(timed, [est_flops[q["depth"]] for s, q in todo[len(timed):]])
            print(f"{where}: val bpb {record['val_bpb']:.4f} at {record['flops']:.3e} FLOPs"
                  + (f", CORE {record['core']:.4f}" if record["core"] is not None else "")
                  + f"; {minutes(wall)} (training {minutes(record['train_wall_s'])}); elapsed "
                  f"{minutes(time.time() - t_start)}, "
                  + (f"left ~{minutes(left)}" if left is not None else "time left: after a rung of another size"),
                  flush=True)
    except KeyboardInterrupt:
        fail(f"interrupted: the finished rungs are in {path}/curve.jsonl; the same command goes on from there"
             + (" (the rung in progress resumes from its last checkpoint)" if args.codebase == "ours" else ""))
    print(f"experiment {args.name}: {len(plan)} rung(s) in {path}/curve.jsonl; compare it: python bench/ladder.py "
          f"compare <baseline> {args.name}")


def run_rung(cb, exp, seed, r):
    """
    Train one rung, score its checkpoints, append its record to curve.jsonl, then delete its checkpoints but the
    last (the record first: a kill in between leaves a finished rung, never one without its earlier points).
    """
    st = exp["st"]
    path = exp["path"]
    tag = f"L-{exp['name']}-d{r['depth']}-s{42 + seed}"
    checkpoints = os.path.join(cb.base, "base_checkpoints", tag)
    if cb.name != "ours" and os.path.isdir(checkpoints):  # an anchor cannot resume: its rung starts again
        shutil.rmtree(checkpoints)
    s = dict(depth=r["depth"], seq_len=st["seq_len"], device_batch_size=r["device_batch_size"],
             tokens_per_step=st["tokens_per_step"], steps=r["steps"], device_type=st["device_type"],
             save_every=r["save_every"], rerun=True, core_per_task=st["core_per_task"])
    train, shown = quality.train_args(cb, tag, exp["overrides"], seed, exp["has_seed"], s)
    log = os.path.join(path, "logs", f"d{r['depth']}_s{42 + seed}")
    wall, out = cb.run(train, f"{log}_train.log", f"base_train (depth {r['depth']}, seed {42 + seed})", shown=shown)
    tok_s, dtype = quality.parse_log(cb, out, st["device_type"])
    steps = sorted({int(m[2]) for name in os.listdir(checkpoints) if (m := CHECKPOINT_FILE.match(name))
                    and m[1] == "model"})
    if not steps or steps[-1] != r["steps"]:
        fail(f"{checkpoints} holds steps {steps}, not the rung's last ({r['steps']}): see {log}_train.log")
    t0 = time.time()
    _, ev = cb.run([quality.EVAL_SCRIPT, f"--model_tag={tag}", f"--val_shard={exp['val_shard']}",
                    f"--docs={exp['eval_set']['docs']}", f"--seq_len={st['seq_len']}", f"--device={st['eval_device']}",
                    f"--steps={','.join(map(str, steps))}"],
                   f"{log}_eval.log", f"scoring (depth {r['depth']}, seed {42 + seed})", dtype="float32")
    scored = [json.loads(line) for line in ev.splitlines() if line.startswith('{"bpb"')]
    last = scored[-1]
    fpt = flops_per_token(last["linear_params"], last["model_config"], st["seq_len"])
    points = [[p["step"], fpt * st["tokens_per_step"] * p["step"], p["bpb"]] for p in scored]
    core = None
    metrics = os.path.join(checkpoints, "metrics.jsonl")
    if cb.name == "ours" and st["core_per_task"] and os.path.exists(metrics):
        with open(metrics) as f:
            core = next((m["core_metric"] for m in reversed([json.loads(x) for x in f]) if "core_metric" in m), None)
    record = dict(depth=r["depth"], seed=42 + seed, codebase=cb.name, code=cb.label, commit=git_commit(cb.root),
                  overrides=exp["overrides"], steps=r["steps"], tokens=r["tokens"],
                  tokens_per_step=st["tokens_per_step"], scaling_params=r["scaling_params"], params=last["params"],
                  linear_params=last["linear_params"],
                  flops_per_token=fpt, flops=points[-1][1], ratio=st["ratio"], val_bpb=last["bpb"], core=core,
                  core_per_task=st["core_per_task"] if core is not None else None, points=points,
                  train_wall_s=wall, score_wall_s=time.time() - t0, tok_per_s=tok_s, compute_dtype=dtype,
                  model_config=last["model_config"], train_command=f"{cb.python} {shown or ' '.join(train)}")
    with open(os.path.join(path, "curve.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    for name in sorted(os.listdir(checkpoints), key=lambda n: not n.startswith("meta_")):  # meta first: never half
        m = CHECKPOINT_FILE.match(name)
        if m and int(m[2]) != r["steps"]:
            os.remove(os.path.join(checkpoints, name))
    return record


# -----------------------------------------------------------------------------
# compare


def compare(args):
    work = os.path.abspath(args.work)
    (base_exp, base), (var_exp, var) = load_experiment(work, args.baseline), load_experiment(work, args.variant)
    for key, what in (("dataset", "datasets"), ("shards", "dataset shards"), ("eval_set", "eval sets")):
        if base_exp["identity"][key] != var_exp["identity"][key]:
            fail(f"{args.baseline} and {args.variant} were scored on different {what} "
                 f"({base_exp['identity'][key]!r} against {var_exp['identity'][key]!r}): their bpb do not compare")
    depths = sorted({r["depth"] for r in base} & {r["depth"] for r in var})
    if not depths:
        fail(f"no depth finished in both {args.baseline} ({sorted({r['depth'] for r in base})}) and "
             f"{args.variant} ({sorted({r['depth'] for r in var})})")
    try:
        rows = [depth_cm([r for r in base if r["depth"] == d], [r for r in var if r["depth"] == d]) for d in depths]
    except ValueError as e:  # seeds of one depth scored at different steps: not one experiment's rungs
        fail(f"{args.baseline}: {e}")
    summary = summary_cm(base, var, depths)
    commits = {r["commit"] for r in base + var}
    print(f"baseline {args.baseline}: {describe(base_exp, base)}\nvariant  {args.variant}: {describe(var_exp, var)}")
    print(f"val bpb over the first {base_exp['identity']['eval_set']['docs']} documents of "
          f"{base_exp['identity']['dataset']}'s validation shard; CM > 1: the variant reaches its final bpb with "
          f"less compute than the baseline needs for it\n")
    print("| depth | FLOPs (variant) | val bpb baseline (seeds) | val bpb variant (seeds) | CM | 95% interval | "
          "CM of each seed pair | verdict |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        cm = "n/a" if row["cm"] is None else f"{row['cm']:.3f}{'~' if row['extrapolated'] else ''}"
        pairs = (f"{min(row['pair_cms']):.3f} to {max(row['pair_cms']):.3f} ({len(row['pair_cms'])}"
                 + (f", {row['pairs_extrapolated']}~" if row["pairs_extrapolated"] else "") + ")"
                 if row["pair_cms"] else "n/a")
        print(f"| {row['depth']} | {row['variant_flops']:.2e} | {spread(row['base_bpb'])} | "
              f"{spread(row['variant_bpb'])} | {cm} | {span(row['interval'])} | {pairs} | {row['verdict']} |")
    if summary["cm"] is None:
        print(f"\nsummary CM: {summary['verdict']} (depths finished in both: {depths})")
    else:
        pairs = (f"; seed pairs {summary['pair_range'][0]:.3f} to {summary['pair_range'][1]:.3f}"
                 if summary["pair_range"] else "")
        print(f"\nsummary CM across depths {', '.join(map(str, depths))} (one slope fitted to log bpb against log "
              f"FLOPs of the final points): {summary['cm']:.3f}, 95% interval {span(summary['interval'])}{pairs}: "
              f"{summary['verdict']}")
    print("~ extrapolated: the variant's final bpb lies outside the baseline's curve, whose edge segment was extended")
    if len(commits) > 1:
        print(f"note: the rungs come from {len(commits)} commits ({', '.join(sorted(commits))})")
    out = args.out or os.path.join(experiment_dir(work, args.variant), f"compare_vs_{args.baseline}.json")
    with open(out, "w") as f:
        json.dump(dict(baseline=args.baseline, variant=args.variant, depths=rows, summary=summary), f, indent=1)
    png = args.png or out.removesuffix(".json") + ".png"
    draw(args.baseline, base, args.variant, var, rows, summary, png)
    print(f"wrote {out} and {png}")


def span(interval):
    return f"{interval[0]:.3f} to {interval[1]:.3f}" if interval else "n/a (one seed each)"


def spread(values):
    mean = sum(values) / len(values)
    return f"{mean:.4f}" + (f" ± {(max(values) - min(values)) / 2:.4f}" if len(values) > 1 else "") + \
        f" ({len(values)})"


def describe(experiment, records):
    ident = experiment["identity"]
    seeds = sorted({r["seed"] for r in records})
    return (f"{ident['code']} {ident['commit']}{' ' + ' '.join(ident['overrides']) if ident['overrides'] else ''}, "
            f"{ident['ratio']} tokens/scaling param, seq {ident['seq_len']}, {ident['tokens_per_step']:,} tokens/step; "
            f"{len(records)} rung(s), seeds {', '.join(map(str, seeds)) or 'none'}")


def draw(base_name, base, var_name, var, rows, summary, png):
    """Left: both experiments' curves in log-log (finals joined); right: CM against FLOPs, the CM = 1 line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5), dpi=120)
    for name, records, color in ((base_name, base, "tab:blue"), (var_name, var, "tab:green")):
        for r in records:
            left.plot([p[1] for p in r["points"]], [p[2] for p in r["points"]], color=color, alpha=0.3, lw=1)
        finals = {}
        for r in records:
            finals.setdefault(r["depth"], []).append(r)
        xs = [rs[0]["flops"] for d, rs in sorted(finals.items())]
        ys = [math.exp(sum(math.log(r["val_bpb"]) for r in rs) / len(rs)) for d, rs in sorted(finals.items())]
        left.plot(xs, ys, color=color, marker="o", lw=2, label=name)
        for d, x, y in zip(sorted(finals), xs, ys):
            left.annotate(f"d{d}", (x, y), xytext=(4, 4), textcoords="offset points", fontsize=8, color=color)
    left.set(xscale="log", yscale="log", xlabel="training FLOPs", ylabel="val bpb",
             title="curves per rung and seed (final points: seed mean)")
    bpbs = [p[2] for r in base + var for p in r["points"]]
    ticks = [min(bpbs) * (max(bpbs) / min(bpbs)) ** (k / 4) for k in range(5)]  # bpb spans far less than a decade
    left.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
    left.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.3f"))
    left.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.legend()
    shown = [row for row in rows if row["cm"] is not None]
    right.axhline(1.0, color="gray", ls="--", lw=1, label="CM = 1")
    if summary["cm"] is not None:
        right.axhline(summary["cm"], color="tab:green", lw=1, alpha=0.6, label=f"summary CM {summary['cm']:.3f}")
        if summary["interval"]:
            right.axhspan(*summary["interval"], color="tab:green", alpha=0.1)
    for row in shown:
        x = row["variant_flops"]
        if row["interval"]:
            right.vlines(x, *row["interval"], color="tab:green", lw=1)
        right.plot([x], [row["cm"]], marker="o", color="tab:green",
                   markerfacecolor="white" if row["extrapolated"] else "tab:green")
        right.annotate(f"d{row['depth']}{'~' if row['extrapolated'] else ''}: {row['verdict']}", (x, row["cm"]),
                       xytext=(5, -12), textcoords="offset points", fontsize=8)
    right.set(xscale="log", xlabel="training FLOPs (variant)", ylabel="compute multiplier",
              title=f"CM of {var_name} against {base_name} (bars: 95% intervals; open: extrapolated)")
    right.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # labels of 2x10^9, 3x10^9, ... overlap
    right.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


# -----------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--work", default="/tmp/nanochat_ladder",
                        help="work directory: ladders/<name>/ (records, logs, comparisons), corpora, tokenizers, "
                        "checkpoints")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", parents=[common], help="run (or go on with) an experiment's ladder",
                       description="Run an experiment's ladder; a rerun skips the finished rungs.")
    r.add_argument("name", help="the experiment's name (its directory: <work>/ladders/<name>)")
    r.add_argument("--codebase", default="ours", choices=["ours", "088", "head"],
                   help="ours, or karpathy/nanochat at 088726a or HEAD (trained as bench/quality.py trains them)")
    r.add_argument("--variant", default="", help="ours: a named variant of bench/quality.py "
                   f"({', '.join(quality.VARIANTS)}) or --key=value,--key2=value2 of scripts.base_train")
    r.add_argument("--gpu", action="store_true", help="the GPU preset: HEAD's ladder (values in brackets below)")
    r.add_argument("--depths", help=f"comma-separated depths (default {CPU['depths']} [{GPU['depths']}])")
    r.add_argument("--ratio", type=float,
                   help=f"training tokens per scaling parameter (default {CPU['ratio']} [{GPU['ratio']}])")
    r.add_argument("--seeds", type=int, default=1, help="seeds per depth: 42, 43, ... (default 1)")
    r.add_argument("--first_seed", type=int, default=0, help="start at seed 42 + this (more seeds later)")
    r.add_argument("--dataset", help=f"our corpus (NANOCHAT_DATASET; default {CPU['dataset']} [{GPU['dataset']}])")
    r.add_argument("--shards", type=int, help=f"train shards of a hub corpus to fetch (default [{GPU['shards']}])")
    r.add_argument("--seq_len", type=int, help=f"sequence length (default {CPU['seq_len']} [{GPU['seq_len']}])")
    r.add_argument("--tokens_per_step", type=int,
                   help=f"tokens per optimizer step (default {CPU['tokens_per_step']:,} [{GPU['tokens_per_step']:,}])")
    r.add_argument("--device_batch_size", type=int, help="rows per micro-step, halved from depth 20, quartered "
                   f"from 28 (default {CPU['device_batch_size']} [{GPU['device_batch_size']}])")
    r.add_argument("--evals", type=int, help=f"checkpoints scored per rung (default {CPU['evals']} [{GPU['evals']}])")
    r.add_argument("--eval_tokens", type=int, help="validation tokens scored per checkpoint, by our tokenizer "
                   f"(default {CPU['eval_tokens']:,} [{GPU['eval_tokens']:,}])")
    r.add_argument("--core_per_task", type=int, help="ours: CORE examples per task at each rung's end, 0: none "
                   f"(default {CPU['core_per_task']} [{GPU['core_per_task']}])")
    r.add_argument("--vocab_size", type=int, help=f"vocabulary (default {CPU['vocab_size']} [{GPU['vocab_size']}])")
    r.add_argument("--device_type", choices=["cpu", "cuda"], help="where it trains (default cpu [cuda])")
    r.add_argument("--eval_device", choices=["cpu", "cuda"], help="where it scores, fp32 (default cpu [cuda])")
    r.add_argument("--dtype", default="", choices=["", "float32", "bfloat16"],
                   help="NANOCHAT_DTYPE of ours and HEAD (empty: each decides)")
    r.add_argument("--ref088", default=quality.DEFAULT_PATHS["088"], help="checkout of karpathy/nanochat at 088726a")
    r.add_argument("--refhead", default=quality.DEFAULT_PATHS["head"], help="checkout of karpathy/nanochat HEAD")
    r.add_argument("--ref_python", default="/tmp/refvenv/bin/python", help="python of the anchors' environment")
    c = sub.add_parser("compare", parents=[common],
                       help="the compute multiplier of a variant experiment against a baseline",
                       description="CM per depth with its noise and verdict, a summary CM, a PNG.")
    c.add_argument("baseline", help="the baseline experiment's name")
    c.add_argument("variant", help="the variant experiment's name")
    c.add_argument("--out", default="", help="JSON (default <work>/ladders/<variant>/compare_vs_<baseline>.json)")
    c.add_argument("--png", default="", help="picture (default beside the JSON)")
    args = parser.parse_args(argv)
    run(args) if args.command == "run" else compare(args)


if __name__ == "__main__":
    main()
