"""
Training-step benchmark on this machine, two ways.

1. In this process: the pieces of scripts/base_train.py's loop (same model, optimizers, data loader, clipping,
   schedules), timed separately.

    python bench/base_train.py                       # depth 4, T 512, vocab 8192, B=1 and B=8, CPU
    python bench/base_train.py --device_batch_sizes=8 --steps=5

   Prints per batch size: tokens/s, MFU against the matmul peak of the compute dtype measured in the same run,
   time from process start to the start and the end of the first step (start-up: imports, tokenizer, model, data,
   peak measurement), and the share of step time spent outside forward/backward (optimizer, clipping, data,
   logging).

2. Old code against new (--compare=TREE, a checkout of the old code, e.g. `git worktree add /tmp/old 08257cc`):
   `python -m scripts.base_train` itself, with the same sizes, in that tree and in this one, in turn,
   `repeats` rounds (bench/ab.py: why interleaved). Each tree decides its own compute dtype, as a user's run would.

    python bench/base_train.py --compare=/tmp/old --device_batch_sizes=1 --total_batch_size=512 --vocab_size=4096
    python bench/base_train.py --compare=/tmp/old --depth=8 --device_batch_sizes=8 --total_batch_size=8192

   Prints per tree: the compute dtype line, the attention kernel of its training steps, tokens/s and MFU (medians
   over the steps after the first, then over the rounds), the time from process start to the end of the first step,
   and peak memory (RSS), with the CPU model, its bf16 flags and the load; then new / old.

Uses the pydocs corpus and a tokenizer of `vocab_size` in $NANOCHAT_BASE_DIR (default: a private bench
directory), building them if missing.
"""

import time

T_PROCESS_START = time.time()

import os
import tempfile

import torch

os.environ.setdefault("NANOCHAT_BASE_DIR", os.path.join(tempfile.gettempdir(), "nanochat_bench"))
os.environ["NANOCHAT_DATASET"] = "pydocs"

from nanochat.attention_kernels import choose_kernel
from nanochat.configurator import configure
from nanochat.dataloader import tokenizing_distributed_data_loader
from nanochat.dataset import parquets_iter_batched
from nanochat.gpt import GPT, config_from_depth
from nanochat.hardware import autocast_dtype, get_peak_flops
from nanochat.optim import clip_grad_norm_, lr_multiplier, muon_momentum
from nanochat.output import print0
from nanochat.processes import compute_init
from nanochat.tokenizer import Tokenizer, get_tokenizer_dir

depth = 4  # model depth
max_seq_len = 512  # T
vocab_size = 8192  # tokenizer vocabulary
device_batch_sizes = "1,8"  # comma-separated B values to measure
total_batch_size = 4096  # tokens per optimizer step (as in the CPU speedrun)
steps = 4  # timed steps per B (after one warm-up step)
device_type = "cpu"
compare = ""  # comma-separated checkouts of other code to run scripts.base_train in, against this one (mode 2)
repeats = 3  # mode 2: rounds, each running every tree once
threads = 0  # mode 2: OMP_NUM_THREADS of the runs (0 = leave it)
config = configure(globals())

ddp, rank, local_rank, world_size, device = compute_init(device_type)
dtype = autocast_dtype(device_type)
tok_dir = get_tokenizer_dir()
if os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
    tokenizer = Tokenizer.from_directory(tok_dir)
if not os.path.exists(os.path.join(tok_dir, "tokenizer.json")) or tokenizer.get_vocab_size() != vocab_size:
    texts = (doc for batch in parquets_iter_batched("train") for doc in batch)
    tokenizer = Tokenizer.train_from_iterator(texts, vocab_size)
    tokenizer.save(tok_dir)


def compare_trees():
    """Mode 2: scripts.base_train in every tree, interleaved; the summary table, then exit."""
    import re
    import sys

    from ab import interleaved, label, machine_line, median, run_in_tree, trees_to_compare  # bench/ab.py

    trees = trees_to_compare(compare)
    env = {"NANOCHAT_BASE_DIR": os.environ["NANOCHAT_BASE_DIR"], "NANOCHAT_DATASET": "pydocs", "NANOCHAT_DTYPE":
           os.environ.get("NANOCHAT_DTYPE", ""), **({"OMP_NUM_THREADS": str(threads)} if threads > 0 else {})}
    number = lambda text: float(text.replace(",", ""))
    for B in [int(b) for b in device_batch_sizes.split(",")]:
        argv = [sys.executable, "-m", "scripts.base_train", f"--depth={depth}", f"--max_seq_len={max_seq_len}",
                f"--device_batch_size={B}", f"--total_batch_size={total_batch_size}", f"--num_iterations={steps + 1}",
                "--eval_every=-1", f"--eval_tokens={B * max_seq_len}", "--core_metric_every=-1", "--sample_every=-1",
                "--dry_run=True", "--run=dummy", "--model_tag=bench", f"--device_type={device_type}"]
        print0(f"\n{' '.join(argv[1:])}  ({steps} timed steps after the first, {repeats} rounds)\n{machine_line()}")

        def measure(tree):
            out, first_step_end = run_in_tree(tree, argv, env, first_line=r"^step 0*1/")
            steps_seen = [dict(dt=number(m[0]) / 1000, mfu=number(m[1])) for m in
                          re.findall(r"\| dt: ([\d.,]+)ms \| tok/sec: [\d,]+ \| mfu %: ([\d.]+)", out)][1:]
            dt = median(st["dt"] for st in steps_seen)
            # the attention kernel each tree's probe chose (a close call in bf16 on a CPU: it can differ per tree)
            attention = re.search(r"^Attention in training steps: ([\w-]+)", out, re.M)
            return dict(dtype=re.search(r"^Compute dtype: .*$", out, re.M)[0], tok_s=total_batch_size / dt,
                        attention=attention[1] if attention else "?",
                        mfu=median(st["mfu"] for st in steps_seen), first_step=first_step_end,
                        memory=re.search(r"^Peak memory: ([\d,]+) MiB", out, re.M)[1])

        results = interleaved(trees, repeats, measure)
        print0("\n| code | compute dtype | attention in training (rounds) | tok/s (rounds) | MFU | "
               "process start -> end of step 1 | peak RSS |")
        print0("|---|---|---|---|---|---|---|")
        for tree, rows in results.items():
            print0(f"| {label(tree)} | {rows[0]['dtype'].removeprefix('Compute dtype: ')} | "
                   f"{', '.join(sorted({r['attention'] for r in rows}))} | "
                   f"{median(r['tok_s'] for r in rows):,.0f} ({', '.join(format(r['tok_s'], ',.0f') for r in rows)}) | "
                   f"{median(r['mfu'] for r in rows):.1f}% | {median(r['first_step'] for r in rows):.1f} s | "
                   f"{median(number(r['memory']) for r in rows):,.0f} MiB |")
        old, new = results[trees[0]], results[trees[-1]]
        print0(f"B={B}: new / old tokens/s {median(r['tok_s'] for r in new) / median(r['tok_s'] for r in old):.2f}x; "
               f"{machine_line()}")
    sys.exit(0)


if compare:
    compare_trees()  # mode 2, then exit
peak_flops, peak_source = get_peak_flops(device, dtype)
print0(f"device {device}, dtype {dtype}, threads {torch.get_num_threads()}, peak {peak_flops / 1e9:.1f} GFLOP/s "
       f"({peak_source})")

sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
rows = []
for B in [int(b) for b in device_batch_sizes.split(",")]:
    torch.manual_seed(0)
    model = GPT(config_from_depth(depth, vocab_size=vocab_size, sequence_len=max_seq_len)).to(device)
    model.init_weights()
    # as scripts.base_train decides it (its default --attention=auto)
    model.attention_kernel, why = choose_kernel("auto", model.config, device.type, dtype)
    print0(why)
    optimizers = model.setup_optimizers()
    flops_per_token = model.estimate_flops()
    accum = total_batch_size // (B * max_seq_len)
    loader = tokenizing_distributed_data_loader(B, max_seq_len, "train", device, tokenizer=tokenizer,
                                                total_batch_size=total_batch_size)
    x, y = next(loader)
    timings = []  # per step: (total, forward+backward, data)
    first_step_start = first_step_end = None
    for step in range(steps + 1):
        sync()
        t0 = time.perf_counter()
        first_step_start = first_step_start or time.time()
        t_fwdbwd = t_data = 0.0
        for _ in range(accum):
            ta = time.perf_counter()
            loss = model(x, y)
            (loss / accum).backward()
            sync()
            tb = time.perf_counter()
            x, y = next(loader)
            t_fwdbwd = t_fwdbwd + tb - ta
            t_data = t_data + time.perf_counter() - tb
        clip_grad_norm_(optimizers, 1.0)
        lrm = lr_multiplier(step, 100)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * lrm
        for group in optimizers[1].param_groups:
            group["momentum"] = muon_momentum(step)
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        loss_value = loss.item()  # the logging sync of the real loop
        sync()
        timings.append((time.perf_counter() - t0, t_fwdbwd, t_data))
        if first_step_end is None:
            first_step_end = time.time()
    steady = timings[1:]
    dt = sum(t[0] for t in steady) / len(steady)
    fwdbwd = sum(t[1] for t in steady) / len(steady)
    data = sum(t[2] for t in steady) / len(steady)
    tok_s = total_batch_size / dt
    mfu = 100 * flops_per_token * tok_s / peak_flops
    first = (first_step_start - T_PROCESS_START, first_step_end - T_PROCESS_START) if not rows else None
    rows.append((B, accum, tok_s, mfu, dt, 100 * (dt - fwdbwd) / dt, 100 * data / dt, first))
    print0(f"B={B}: {tok_s:,.0f} tok/s, MFU {mfu:.1f}%, step {dt * 1000:.0f} ms, "
           f"outside fwd/bwd {100 * (dt - fwdbwd) / dt:.1f}% (data {100 * data / dt:.1f}%), loss {loss_value:.3f}")

print0("\n| B | accumulation | tok/s | MFU | step | outside fwd/bwd | of which data "
       "| process start -> first step starts / ends |")
print0("|---|---|---|---|---|---|---|---|")
for B, accum, tok_s, mfu, dt, outside, data, first in rows:
    print0(f"| {B} | {accum} | {tok_s:,.0f} | {mfu:.1f}% | {dt * 1000:.0f} ms | {outside:.1f}% | {data:.1f}% | "
           f"{f'{first[0]:.1f} s / {first[1]:.1f} s' if first is not None else '-'} |")
