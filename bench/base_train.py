"""
Training-step benchmark on this machine: the pieces of scripts/base_train.py's loop (same model, optimizers,
data loader, clipping, schedules), timed separately.

    python bench/base_train.py                       # depth 4, T 512, vocab 8192, B=1 and B=8, CPU
    python bench/base_train.py --device_batch_sizes=8 --steps=5

Prints per batch size: tokens/s, MFU against the fp32 matmul peak measured in the same run, time from process
start to the start and the end of the first step (start-up: imports, tokenizer, model, data, peak measurement), and the share of step time spent outside forward/backward (optimizer,
clipping, data, logging). Uses the pydocs corpus and a tokenizer of `vocab_size` in $NANOCHAT_BASE_DIR
(default: a private bench directory), building them if missing.
"""

import time

T_PROCESS_START = time.time()

import os
import tempfile

import torch

os.environ.setdefault("NANOCHAT_BASE_DIR", os.path.join(tempfile.gettempdir(), "nanochat_bench"))
os.environ["NANOCHAT_DATASET"] = "pydocs"

from nanochat.common import compute_init, print0
from nanochat.hardware import autocast_dtype, get_peak_flops
from nanochat.configurator import configure
from nanochat.dataloader import tokenizing_distributed_data_loader
from nanochat.dataset import parquets_iter_batched
from nanochat.gpt import GPT, config_from_depth
from nanochat.sharding import clip_grad_norm_
from nanochat.schedules import lr_multiplier, muon_momentum
from nanochat.tokenizer import Tokenizer, get_tokenizer_dir

depth = 4  # model depth
max_seq_len = 512  # T
vocab_size = 8192  # tokenizer vocabulary
device_batch_sizes = "1,8"  # comma-separated B values to measure
total_batch_size = 4096  # tokens per optimizer step (as in the CPU speedrun)
steps = 4  # timed steps per B (after one warm-up step)
device_type = "cpu"
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
peak_flops, peak_source = get_peak_flops(device, dtype)
print0(f"device {device}, dtype {dtype}, threads {torch.get_num_threads()}, peak {peak_flops / 1e9:.1f} GFLOP/s ({peak_source})")

sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
rows = []
for B in [int(b) for b in device_batch_sizes.split(",")]:
    torch.manual_seed(0)
    model = GPT(config_from_depth(depth, vocab_size=vocab_size, sequence_len=max_seq_len)).to(device)
    model.init_weights()
    optimizers = model.setup_optimizers()
    flops_per_token = model.estimate_flops()
    accum = total_batch_size // (B * max_seq_len)
    loader = tokenizing_distributed_data_loader(B, max_seq_len, "train", device, tokenizer=tokenizer, total_batch_size=total_batch_size)
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
            t_fwdbwd, t_data = t_fwdbwd + tb - ta, t_data + time.perf_counter() - tb
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
    print0(f"B={B}: {tok_s:,.0f} tok/s, MFU {mfu:.1f}%, step {dt * 1000:.0f} ms, outside fwd/bwd {100 * (dt - fwdbwd) / dt:.1f}% "
           f"(data {100 * data / dt:.1f}%), loss {loss_value:.3f}")

print0("\n| B | accumulation | tok/s | MFU | step | outside fwd/bwd | of which data | process start -> first step starts / ends |")
print0("|---|---|---|---|---|---|---|---|")
for B, accum, tok_s, mfu, dt, outside, data, first in rows:
    print0(f"| {B} | {accum} | {tok_s:,.0f} | {mfu:.1f}% | {dt * 1000:.0f} ms | {outside:.1f}% | {data:.1f}% | "
           f"{f'{first[0]:.1f} s / {first[1]:.1f} s' if first is not None else '-'} |")
