"""
Training speed per GPU, ours against karpathy/nanochat HEAD: each codebase's own scripts.base_train.

Both at the same depth, sequence length and micro-batch (issue 37), in one run of this script, on the same machine,
one after the other. Per depth (default 20 with 32 rows and 24 with 16 rows, 2048 tokens a row), up to three rows:
- ours: scripts.base_train as bench/train_speed.py runs it (a dry run, one micro-step a step);
- HEAD, runs/speedrun.sh settings: --fp8 and its default --window-pattern=SSSL;
- HEAD, plain: --window-pattern=L, no fp8;
then our Engine's decoding tokens/s at 1, 8 and 32 samples (bench/engine.py, random weights, the first depth).

    python bench/head_speed.py --head=/path/to/karpathy-nanochat                  # the GPU, depths 20 and 24
    python bench/head_speed.py --head=/path/to/karpathy-nanochat --runs=ours,plain --engine=False
    python bench/head_speed.py --head=/tmp/head92d63d4 --depths=2 --rows=2 --max_seq_len=128 --device_type=cpu \
        --steps=4 --vocab_size=4096                                                # plumbing, CPU (~3 minutes)

Without --head, HEAD is skipped (a message says how to get it: git clone https://github.com/karpathy/nanochat, then
git checkout 92d63d4, the commit this was written against). Prints one markdown table: tokens/s, MFU and step time
(medians over the steps after the first `skip`, as each script prints them), the time from the start of the process
to its first step line (start-up, data, torch.compile, the step), and the peak memory each script reports; below it,
per row, what each script said about itself (parameters, vocabulary, compute dtype, compile, attention, fp8, the peak
its MFU is against). Both codebases compute MFU their own way: ours against the measured bf16 peak, HEAD against a
datasheet table (989 TFLOP/s for an H100) and with its own FLOPs per token; tokens/s is the like-for-like column.

How HEAD is fed, from its code (92d63d4): its corpus is <NANOCHAT_BASE_DIR>/base_data_climbmix/*.parquet, sorted, the
last file the validation split, documents in a `text` column: our pydocs shards (python -m nanochat.dataset with
NANOCHAT_DATASET=pydocs) have that layout, so they are copied there under their own names. Its tokenizer is its own
scripts.tok_train's (tokenizer.pkl and token_bytes.pt in <base>/tokenizer), run in its checkout, asked for the same
vocabulary as ours. pydocs holds too little text for 65,536 tokens: rustbpe runs out of pairs and both codebases end
at the same smaller size (bench/RESULTS.md: issue 37 items 2-4), which the notes show. (HEAD's speedrun trains 32,768.)
HEAD's base_train always torch.compiles, has no dry run and saves the model and optimizer at the end: its two
checkpoint files are made links to /dev/null beforehand (after the last step line: nothing measured is changed), the
rest is deleted after. Its Flash Attention 3 comes from the `kernels` package, downloaded from the Hugging Face hub at
run time: offline or without that package it falls back to SDPA, and says so; the table's settings say which it used.
Its --fp8 is CUDA only (on CPU it prints that it ignores it). Its base_train imports wandb at module level (and
calls it only without --run=dummy): if `import wandb` fails, a stub module stands in and the notes say so.

On a GPU machine without network (these wheels: Python 3.12): bench/gpu_check.sh's wheels in .whl/ plus these in
.whl/head/ (a folder of their own: gpu_check.sh installs .whl/*.whl only), which `import wandb` needs beyond those and
the image's packages (20.8 MB; protobuf too, since wandb imports only with majors 5 to 7 and the image's is unknown):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl/head wandb==0.31.0 platformdirs==4.14.8 protobuf==7.36.2

and HEAD's code in the repo, ignored (/.head/ in .gitignore) and copied there with .whl (bench/gpu_prepare.sh makes
both; from NANOCHAT_HEAD_REPO, a clone of karpathy/nanochat, if set): mkdir .head &&
git -C /path/to/karpathy-nanochat archive 92d63d4 nanochat scripts | tar -x -C .head && echo 92d63d4 > .head/COMMIT
(0.3 MB; COMMIT names the commit in the table). Then there (or `bash bench/gpu_measure.sh head`):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl .whl/head/*.whl && PYTHONPATH=/tmp/site python3 bench/head_speed.py --head=.head

Six training runs (each with its torch.compile) and the decoding may not fit one 10-minute command (not yet timed
on a GPU): --runs and --depths split them. Logs of every run: <base_dir>/logs.
"""

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from nanochat.configurator import configure  # noqa: E402

head = ""  # a checkout of karpathy/nanochat (92d63d4); empty: ours only
depths = "20,24"  # comma-separated depths
rows = "32,16"  # rows per micro-step for each depth (one value: the same for all)
max_seq_len = 2048  # tokens per row
vocab_size = 65536  # the vocabulary asked of both tokenizers (pydocs allows fewer: see the notes)
steps = 30  # steps per run
skip = 5  # first steps left out of the medians (compile, allocator warm-up)
device_type = "cuda"  # cuda | cpu
runs = "ours,speedrun,plain"  # which rows: ours, HEAD with runs/speedrun.sh's settings, HEAD plain
engine = True  # also our Engine's decode tokens/s (bench/engine.py)
engine_depth = -1  # the Engine's model depth (-1: the first of `depths`)
engine_batch_sizes = "1,8,32"  # numbers of samples decoded at once
base_dir = os.path.join(tempfile.gettempdir(), "nanochat_head_speed")  # corpora, tokenizers, logs (built if missing)
config = configure(globals())

HEAD_GET = ("git clone https://github.com/karpathy/nanochat /tmp/karpathy-nanochat && "
            "git -C /tmp/karpathy-nanochat checkout 92d63d4, then --head=/tmp/karpathy-nanochat")
run_list = [r for r in runs.split(",") if r]
if set(run_list) - {"ours", "speedrun", "plain"}:
    sys.exit(f"--runs takes ours, speedrun and plain, got {runs!r}")
if device_type == "cuda" and not torch.cuda.is_available():
    sys.exit("no CUDA device here: --device_type=cpu runs the plumbing on the CPU")
depth_list = [int(d) for d in depths.split(",")]
row_list = [int(r) for r in rows.split(",")] * (len(depth_list) if "," not in rows else 1)
os.makedirs(os.path.join(base_dir, "logs"), exist_ok=True)
ours_dir = os.path.join(base_dir, f"ours_v{vocab_size}")  # per vocabulary: a CPU test's never stands in for the GPU's
head_dir = os.path.join(base_dir, f"head_v{vocab_size}")


def pythonpath(*first):
    """PYTHONPATH with `first` in front and our root out of it (HEAD's `nanochat` and `scripts` must win)."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != ROOT]
    return os.pathsep.join([*first, *rest])


def setup(argv, cwd, env, what):
    result = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{what}: {' '.join(argv)} failed:\n{result.stdout[-1500:]}{result.stderr[-3000:]}")


def timed_run(argv, cwd, env, first_line, log):
    """
    Run a training script: (exit code, its stdout, seconds from the start to its first step line). Its stdout is
    kept in `log`, its stderr in `log`.err: a file, so that a chatty compile cannot fill a pipe and stall it.
    """
    t0 = time.time()
    first_step = None
    out = []
    with open(log + ".err", "w") as err:
        proc = subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=err,
                                text=True)
        for line in proc.stdout:  # the first step line's time: start-up, data, torch.compile and the step itself
            out.append(line)
            if first_step is None and line.startswith(first_line):
                first_step = time.time() - t0
        code = proc.wait()
    stdout = "".join(out)
    with open(log, "w") as f:
        f.write(stdout)
    return code, stdout, first_step


def medians(step_lines):
    """Per column, the median over the step lines after the first `skip` (the last line if there are no more)."""
    kept = step_lines[min(skip, len(step_lines) - 1):]
    return [statistics.median(float(x.replace(",", "")) for x in column) for column in zip(*kept)]


def find(pattern, text, default="?"):
    m = re.search(pattern, text, re.M)
    return m[1] if m else default


def failed(label, depth, B, log, code):
    print(f"{label}, depth {depth}: exited {code}; see {log} and {log}.err", flush=True)
    return dict(label=label, depth=depth, B=B, failed=True, notes=[f"exited {code}: {log}"])


# -----------------------------------------------------------------------------
# Ours: bench/train_speed.py's run of scripts.base_train, with its step lines parsed the same way

ours_env = dict(os.environ, NANOCHAT_BASE_DIR=ours_dir, NANOCHAT_DATASET="pydocs",
                PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))


def ours_setup():
    """The pydocs corpus and our tokenizer in ours_dir (HEAD's corpus is copied from this one)."""
    # tokenizer.json is written last: when it is there, the tokenizer is whole
    if not os.path.exists(os.path.join(ours_dir, "tokenizer", "tokenizer.json")):
        setup(["-m", "nanochat.dataset"], ROOT, ours_env, "ours")
        setup(["-m", "scripts.tok_train", f"--vocab_size={vocab_size}"], ROOT, ours_env, "ours")


def run_ours(depth, B):
    label = "ours, bench/train_speed.py settings"
    argv = ["-m", "scripts.base_train", f"--depth={depth}", f"--max_seq_len={max_seq_len}", f"--device_batch_size={B}",
            f"--total_batch_size={B * max_seq_len}", f"--num_iterations={steps}", "--eval_every=-1",
            f"--eval_tokens={B * max_seq_len}", "--core_metric_every=-1", "--sample_every=-1", "--dry_run=True",
            "--run=dummy", f"--model_tag=speed{depth}", f"--device_type={device_type}"]
    log = os.path.join(base_dir, "logs", f"ours_d{depth}.log")
    code, out, first_step = timed_run(argv, ROOT, ours_env, "step 00001/", log)
    lines = re.findall(r"\| dt: ([\d.,]+)ms \| tok/sec: ([\d,]+) \| mfu %: ([\d.]+)", out)
    if code != 0 or not lines:
        return failed(label, depth, B, log, code)
    step_ms, tok_s, mfu = medians(lines)
    said = {key: find(pattern, out) for key, pattern in (
        ("parameters", r"^Parameters: ([0-9,]+)"), ("vocab", r"vocab ([0-9,]+), context"),
        ("compute dtype", r"^Compute dtype: (\w+)"), ("torch.compile", r"torch.compile: (\w+)"))}
    peak = re.search(r"^Peak FLOP/s for MFU: (\S+) per device \((\w+)", out, re.M)
    return dict(label=label, depth=depth, B=B, tok_s=tok_s, mfu=f"{mfu:.1f}%", step_ms=step_ms, first_s=first_step,
                memory=find(r"^Peak memory: (.*)$", out), n_steps=len(lines),
                notes=[f"{key} {value}" for key, value in said.items()]
                + [f"MFU against {peak[1]} FLOP/s ({peak[2]})" if peak else "MFU against ?"])


# -----------------------------------------------------------------------------
# HEAD: its scripts.base_train in its checkout, with a base dir of its own

# unbuffered: HEAD's print0 does not flush, and a pipe would hold its first step line back (from the
# start-to-step-1 time)
head_env = dict(os.environ, NANOCHAT_BASE_DIR=head_dir, PYTHONPATH=pythonpath(os.path.abspath(head or ".")),
                PYTHONUNBUFFERED="1")
head_env.pop("NANOCHAT_DATASET", None)
wandb_note = "wandb: the real one"


def head_setup():
    """HEAD's corpus (our pydocs shards under its names), its tokenizer (its own tok_train), and wandb or a stub."""
    global wandb_note
    data = os.path.join(head_dir, "base_data_climbmix")
    if not os.path.exists(os.path.join(head_dir, "tokenizer", "token_bytes.pt")):  # tok_train writes it last
        shutil.rmtree(data, ignore_errors=True)
        os.makedirs(data)
        source = os.path.join(ours_dir, "base_data", "pydocs")
        for name in sorted(os.listdir(source)):  # shard_00000.parquet ...: HEAD's own naming, the last one its val
            if re.fullmatch(r"shard_\d{5}\.parquet", name):
                shutil.copy(os.path.join(source, name), data)
        setup(["-m", "scripts.tok_train", f"--vocab-size={vocab_size}"], head, head_env, "HEAD")
    check = subprocess.run([sys.executable, "-c", "import wandb"], cwd=head, env=head_env, capture_output=True,
                           text=True)
    if check.returncode != 0:
        # HEAD calls wandb only for a run not named "dummy" (wandb.init); the stub raises if that ever changes
        stub = os.path.join(base_dir, "wandb_stub", "wandb")
        os.makedirs(stub, exist_ok=True)
        with open(os.path.join(stub, "__init__.py"), "w") as f:
            f.write('"""Stand-in written by bench/head_speed.py: the real wandb did not import."""\n\n\n'
                    'def init(*args, **kwargs):\n    raise RuntimeError("wandb stub of bench/head_speed.py: '
                    'run HEAD with --run=dummy, or install wandb")\n')
        head_env["PYTHONPATH"] = pythonpath(os.path.abspath(head), os.path.dirname(stub))
        reason = (check.stderr.strip().splitlines() or ["?"])[-1]
        wandb_note = f"wandb: a STUB module (`import wandb` failed: {reason}; HEAD calls it only without --run=dummy)"
        print(wandb_note, flush=True)


def run_head(depth, B, variant):
    label = {"speedrun": "HEAD, runs/speedrun.sh settings", "plain": "HEAD, plain"}[variant]
    tag = f"speed{depth}_{variant}"
    checkpoints = os.path.join(head_dir, "base_checkpoints", tag)
    shutil.rmtree(checkpoints, ignore_errors=True)
    os.makedirs(checkpoints)
    for name in (f"model_{steps:06d}.pt", f"optim_{steps:06d}_rank0.pt"):  # the save at the end writes nothing
        os.symlink(os.devnull, os.path.join(checkpoints, name))
    argv = ["-m", "scripts.base_train", f"--depth={depth}", f"--max-seq-len={max_seq_len}", f"--device-batch-size={B}",
            f"--total-batch-size={B * max_seq_len}", f"--num-iterations={steps}", "--eval-every=-1",
            "--core-metric-every=-1", "--sample-every=-1", "--run=dummy", f"--model-tag={tag}",
            f"--device-type={device_type}"] + (["--fp8"] if variant == "speedrun" else ["--window-pattern=L"])
    log = os.path.join(base_dir, "logs", f"head_{variant}_d{depth}.log")
    code, out, first_step = timed_run(argv, head, head_env, "step 00000/", log)
    shutil.rmtree(checkpoints, ignore_errors=True)
    lines = re.findall(r"\| dt: ([\d.,]+)ms \| tok/sec: ([\d,]+) \| bf16_mfu: ([\d.]+)", out)
    if code != 0 or not lines:
        settings = {"speedrun": ": --fp8, SSSL", "plain": ": window L, no fp8"}[variant]
        return failed(label + settings, depth, B, log, code)
    step_ms, tok_s, mfu = medians(lines)
    # what HEAD printed about its attention and fp8, for the settings cell
    if "Using Flash Attention 3" in out:
        attention = "FA3"
    elif "only supports bf16" in out:
        attention = "SDPA fallback (FA3 needs bf16)"
    elif "using PyTorch SDPA fallback" in out:
        attention = "SDPA fallback, no FA3"
    else:
        attention = "attention not reported"
    if variant == "speedrun":
        converted = find(r"converted (\d+/\d+) linear", out)
        if "ignoring --fp8" in out:
            fp8 = "--fp8 ignored (HEAD: not CUDA)"
        elif "FP8 training enabled" in out:
            fp8 = f"--fp8 ({converted} linears)"
        else:
            fp8 = "--fp8 (not reported)"
        label += f": {fp8}, SSSL, {attention}"
    else:
        label += f": window L, no fp8, {attention}"
    peak = find(r"Peak FLOPS \(BF16\): (\S+)", out, "inf (CPU)")
    memory_mib = float(find(r"^Peak memory usage: ([\d.]+)MiB", out, "0"))
    return dict(label=label, depth=depth, B=B, tok_s=tok_s, step_ms=step_ms, first_s=first_step, n_steps=len(lines),
                mfu="n/a (CPU)" if device_type == "cpu" else f"{mfu:.1f}%",
                memory=f"{memory_mib:,.0f} MiB (CUDA, allocated)" if device_type == "cuda" else "n/a (HEAD: CUDA only)",
                notes=[f"{key} {find(pattern, out)}" for key, pattern in (
                    ("parameters", r"^total\s*: ([0-9,]+)"), ("vocab", r"^Vocab size: ([0-9,]+)"),
                    ("compute dtype", r"^COMPUTE_DTYPE: torch\.(\w+)"))]
                + ["torch.compile always", f"MFU against {peak} FLOP/s (HEAD's datasheet table)"])


# -----------------------------------------------------------------------------
# The runs, then the table

device = torch.cuda.get_device_name() if device_type == "cuda" else "CPU"
if head and not os.path.exists(os.path.join(head, "scripts", "base_train.py")):
    sys.exit(f"--head={head} has no scripts/base_train.py: not a karpathy/nanochat checkout; get one: {HEAD_GET}")
head_runs = [r for r in run_list if r != "ours"]
if head_runs and not head:
    print(f"HEAD skipped: no --head=PATH given. Get it: {HEAD_GET}", flush=True)
    head_runs = []
if "ours" in run_list or head_runs:  # HEAD's corpus is copied from ours
    ours_setup()
if head_runs:
    head_setup()
# HEAD's commit: its own repository's, or the COMMIT file next to an extracted archive (inside our tree, git would
# answer with our commit)
if head and os.path.isdir(os.path.join(head, ".git")):
    head_commit = subprocess.run(["git", "-C", head, "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip()
elif head and os.path.exists(os.path.join(head, "COMMIT")):
    head_commit = open(os.path.join(head, "COMMIT")).read().strip()
else:
    head_commit = ""
table = []
for depth, B in zip(depth_list, row_list):
    if "ours" in run_list:
        table.append(run_ours(depth, B))
        print(f"{table[-1]['label']}, depth {depth}: {table[-1].get('tok_s', 0):,.0f} tok/s", flush=True)
    for variant in head_runs:
        table.append(run_head(depth, B, variant))
        print(f"{table[-1]['label']}, depth {depth}: {table[-1].get('tok_s', 0):,.0f} tok/s", flush=True)

decode = None
if engine:
    # bench/engine.py in a base dir of its own: it trains a tokenizer when the vocabulary differs from the one it asks
    # for (pydocs' does), and must not replace ours in ours_dir
    e_depth = depth_list[0] if engine_depth == -1 else engine_depth
    e_env = dict(os.environ, NANOCHAT_BASE_DIR=os.path.join(base_dir, "engine"),
                 PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    e_argv = [os.path.join(HERE, "engine.py"), f"--device_type={device_type}", f"--depth={e_depth}",
              f"--vocab_size={vocab_size}", f"--batch_sizes={engine_batch_sizes}", "--threads=0", "--naive=False"]
    result = subprocess.run([sys.executable, *e_argv], cwd=ROOT, env=e_env, capture_output=True, text=True)
    with open(os.path.join(base_dir, "logs", "engine.log"), "w") as f:
        f.write(result.stdout + result.stderr)
    rates = re.findall(r"^\[.*?\] engine B=(\d+): decode ([\d,]+) tok/s.*TTFT ([\d.]+) ms", result.stdout, re.M)
    if result.returncode != 0 or not rates:
        print(f"bench/engine.py failed:\n{result.stderr[-3000:]}", flush=True)
    decode = (e_depth, rates, result.returncode)

print(f"\n{device}, torch {torch.__version__}; each codebase's scripts.base_train, {steps} steps of one micro-step of "
      f"rows x {max_seq_len} tokens, medians after the first {skip} steps (or the last step, if no more)"
      + (f"; HEAD = karpathy/nanochat {head_commit or head}" if head_runs else ""))
print("| codebase, settings | depth | rows | tok/s | MFU | step | start to step 1 | peak memory |")
print("|---|---|---|---|---|---|---|---|")
for r in table:
    if r.get("failed"):
        print(f"| {r['label']} | {r['depth']} | {r['B']} | failed | | | | |")
    else:
        first = f"{r['first_s']:.1f} s" if r["first_s"] is not None else "?"
        print(f"| {r['label']} | {r['depth']} | {r['B']} | {r['tok_s']:,.0f} | {r['mfu']} | {r['step_ms']:,.0f} ms | "
              f"{first} | {r['memory']} |")
for r in table:
    print(f"- {r['label']}, depth {r['depth']}: {'; '.join(r['notes'])}")
if head_runs:
    print(f"- HEAD: {wandb_note}; its end-of-run checkpoint went to /dev/null (after the last step line); "
          "no FA3 = HEAD gets it from the Hugging Face hub through the `kernels` package, missing or offline here")
if decode:
    e_depth, rates, code = decode
    print(f"\nOur Engine's decoding (bench/engine.py --depth={e_depth} --vocab_size={vocab_size} --naive=False: random "
          f"weights, a 32-token prompt, 256 new tokens, medians of 3; "
          f"log: {os.path.join(base_dir, 'logs', 'engine.log')})")
    if rates:
        print("| samples | decode tok/s (all samples) | time to first token |")
        print("|---|---|---|")
        for B, rate, ttft in rates:
            print(f"| {B} | {rate} | {ttft} ms |")
    else:
        print(f"bench/engine.py exited {code} without decode lines")
