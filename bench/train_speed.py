"""
Training speed per GPU at the sizes of a real run: scripts.base_train itself, as a dry run.

A few dozen steps of one micro-step each (issue 37; total batch = the micro-batch: the step's arithmetic is the
micro-step's, the update once per micro-step is the only difference from a full run), on the pydocs corpus with a
65,536-token tokenizer (the tokens do not change the speed). Depth 20 with the speedrun's 32 rows, depth 24 with
karpathy/nanochat's 16 rows (its runs/speedrun.sh), 2048 tokens a row, torch.compile as base_train decides (on for
CUDA).

    python bench/train_speed.py                                  # depths 20 and 24 on the GPU
    python bench/train_speed.py --depths=20 --steps=40
    python bench/train_speed.py --depths=24 --rows=16 --extra="--fp8=True --window_pattern=SSSL"
    python bench/train_speed.py --depths=2 --rows=2 --max_seq_len=128 --device_type=cpu --steps=4   # plumbing, CPU

Prints per depth: tokens/s and MFU (medians over the steps after the first `skip`, as base_train computes them against
the measured bf16 peak), the first step's time (torch.compile and warm-up), peak memory, and the device.
"""

import os
import re
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

depths = "20,24"  # comma-separated depths
rows = "32,16"  # rows per micro-step for each depth (one value: the same for all)
max_seq_len = 2048  # tokens per row
vocab_size = 65536  # the speedrun's vocabulary
steps = 30  # steps per depth
skip = 5  # first steps left out of the medians (compile, allocator warm-up)
device_type = "cuda"
extra = ""  # more base_train settings for every run, space-separated (e.g. "--fp8=True --window_pattern=SSSL")
base_dir = os.path.join(tempfile.gettempdir(), "nanochat_train_speed")  # corpus and tokenizer (built if missing)
config = configure(globals())

env = dict(os.environ, NANOCHAT_BASE_DIR=base_dir, NANOCHAT_DATASET="pydocs",
           PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
if not os.path.exists(os.path.join(base_dir, "tokenizer", "tokenizer.tiktoken")):
    for argv in (["-m", "nanochat.dataset"], ["-m", "scripts.tok_train", f"--vocab_size={vocab_size}"]):
        result = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"{' '.join(argv)} failed:\n{result.stderr[-3000:]}")
device = torch.cuda.get_device_name() if device_type == "cuda" else "CPU"
depth_list = [int(d) for d in depths.split(",")]
row_list = [int(r) for r in rows.split(",")] * (len(depth_list) if "," not in rows else 1)
table = []
for depth, B in zip(depth_list, row_list):
    argv = ["-m", "scripts.base_train", f"--depth={depth}", f"--max_seq_len={max_seq_len}", f"--device_batch_size={B}",
            f"--total_batch_size={B * max_seq_len}", f"--num_iterations={steps}", "--eval_every=-1",
            f"--eval_tokens={B * max_seq_len}", "--core_metric_every=-1", "--sample_every=-1", "--dry_run=True",
            "--run=dummy", f"--model_tag=speed{depth}", f"--device_type={device_type}", *extra.split()]
    t0 = time.time()
    first_step = None
    out = []
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    for line in proc.stdout:  # the time to the first step line: start-up, data, torch.compile and the step itself
        out.append(line)
        if first_step is None and line.startswith("step 00001/"):
            first_step = time.time() - t0
    stdout = "".join(out)
    stderr = proc.stderr.read()
    if proc.wait() != 0:
        print(f"depth {depth}: base_train failed:\n{stderr[-3000:]}", flush=True)
        table.append((depth, B, None))
        continue
    lines = re.findall(r"\| dt: ([\d.,]+)ms \| tok/sec: ([\d,]+) \| mfu %: ([\d.]+)", stdout)
    # medians of the steps after the first `skip`, or of the last step when the run had no more (a plumbing run)
    dts, toks, mfus = ([float(x.replace(",", "")) for x in column][skip:] or [float(column[-1].replace(",", ""))]
                       for column in zip(*lines))
    table.append((depth, B, dict(tok_s=statistics.median(toks), mfu=statistics.median(mfus),
                                 first_step_s=first_step, step_ms=statistics.median(dts),
                                 memory=re.search(r"^Peak memory: (.*)$", stdout, re.M)[1],
                                 dtype=re.search(r"^Compute dtype: (\w+)", stdout, re.M)[1],
                                 compile=re.search(r"torch.compile: (\w+)", stdout)[1],
                                 params=re.search(r"^Parameters: ([\d,]+)", stdout, re.M)[1])))
    print(f"depth {depth}: {table[-1][2]}", flush=True)

print(f"\n{device}, torch {torch.__version__}; scripts.base_train, {steps} steps of one micro-step of "
      f"B x {max_seq_len} tokens, medians after the first {skip} (or the last step, if no more)")
print("| depth | parameters | rows | tok/s | MFU | step | start to step 1 (compile) | peak memory | dtype, compile |")
print("|---|---|---|---|---|---|---|---|---|")
for depth, B, r in table:
    if r is None:
        print(f"| {depth} | | {B} | failed | | | | | |")
    else:
        print(f"| {depth} | {r['params']} | {B} | {r['tok_s']:,.0f} | {r['mfu']:.1f}% | {r['step_ms']:.0f} ms | "
              f"{r['first_step_s']:.1f} s | {r['memory']} | {r['dtype']}, {r['compile']} |")
