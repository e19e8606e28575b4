"""
Where a training step's time goes, by the PyTorch profiler: the step of scripts/base_train.py (its model, optimizers,
clipping, the micro-steps under autocast in the compute dtype of nanochat/hardware.py), on random tokens (the
values do not change the time). After `warmup` steps, one step is timed `repeats` times without the profiler (the
median is the step time) and once with it; prints per region (forward, backward, clipping, AdamW, Muon) its wall
time and the ops that take it (self time), and the share of the step per kind of op.

    python bench/profile_step.py --depth=4 --device_batch_size=1 --total_batch_size=512   # the seed command
    python bench/profile_step.py --depth=4 --device_batch_size=8 --total_batch_size=4096  # the CPU speedrun
    python bench/profile_step.py --depth=8 --device_batch_size=8 --total_batch_size=8192
    NANOCHAT_DTYPE=float32 python bench/profile_step.py ...    # the same in the other dtype
    python bench/profile_step.py --depth=8 ... --compile=True  # compiled: its fused kernels are no aten ops, so the
                                                               # time outside aten ops gets a line of its own
"""

import collections
import contextlib
import io
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ab import machine_line  # bench/ab.py
from nanochat.common import compute_init, print0
from nanochat.configurator import configure
from nanochat.cpu_kernels import dense_attention
from nanochat.gpt import GPT, attention, config_from_depth
from nanochat.hardware import autocast_context, compute_dtype_line
from nanochat.optim import clip_grad_norm_
from nanochat.probes import dense_attention_pays

depth = 4  # model depth
max_seq_len = 512  # T
vocab_size = 4096  # the CPU speedrun's vocabulary
device_batch_size = 1  # B
total_batch_size = 512  # tokens per optimizer step
warmup = 2  # untimed steps first
repeats = 3  # timed steps without the profiler
top = 8  # ops listed per region
compile = False  # torch.compile the model, as base_train --compile=true (a warmup step compiles)
config = configure(globals())

# What each op is, for the shares (anything else: elementwise and the rest)
KINDS = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
         "attention": ("aten::_scaled_dot_product", "aten::_softmax", "aten::_softmax_backward_data"),
         "softcapped loss over the vocabulary": ("aten::tanh", "aten::exp", "aten::log", "aten::_log_softmax",
                                                 "aten::nll_loss", "aten::scatter_add_", "aten::gather",
                                                 "aten::addcmul", "aten::tanh_backward",
                                                 "aten::_log_softmax_backward_data"),
         "dtype casts": ("aten::_to_copy", "aten::copy_")}

compute_init("cpu")  # the process set up as base_train's is (on Linux its freed memory kept: docs/hardware.md)
dtype, autocast = autocast_context("cpu")
print0(f"{compute_dtype_line('cpu')}\n{machine_line()}; {torch.get_num_threads()} torch threads")
torch.manual_seed(0)
model = GPT(config_from_depth(depth, vocab_size=vocab_size, sequence_len=max_seq_len))
model.init_weights()
# the attention scripts.base_train's steps use
model.dense_attention, why = dense_attention_pays(model.config, "cpu", dtype, attention, dense_attention)
print0(why)
with contextlib.redirect_stdout(io.StringIO()):  # setup_optimizers prints its summary
    adamw, muon = model.setup_optimizers()
train_model = torch.compile(model) if compile else model
accum = total_batch_size // (device_batch_size * max_seq_len)
x = torch.randint(0, vocab_size, (device_batch_size, max_seq_len))
y = torch.randint(0, vocab_size, (device_batch_size, max_seq_len))


def step():
    for _ in range(accum):
        with record_function("forward"), autocast:
            loss = train_model(x, y)
        with record_function("backward"):
            (loss / accum).backward()
    with record_function("clipping"):
        clip_grad_norm_([adamw, muon], 1.0)
    with record_function("AdamW"):
        adamw.step()
    with record_function("Muon"):
        muon.step()
    model.zero_grad(set_to_none=True)
    loss.item()


for _ in range(warmup):
    step()
times = []
for _ in range(repeats):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    step()

# Attribute every op to the region it started in (regions do not nest)
events = prof.events()
REGIONS = ("forward", "backward", "clipping", "AdamW", "Muon")
regions = [(e.name, e.time_range.start, e.time_range.end) for e in events if e.name in REGIONS]
wall = collections.Counter()  # ms per region
by_region = collections.defaultdict(collections.Counter)  # {region: ms per op}
by_kind = collections.Counter()  # ms per kind of op
for name, start, end in regions:
    wall[name] += (end - start) / 1000
for e in events:
    if not e.name.startswith("aten::"):
        continue
    for name, start, end in regions:
        if start <= e.time_range.start < end:
            by_region[name][e.name] += e.self_cpu_time_total / 1000
            kind = next((k for k, prefixes in KINDS.items() if e.name.startswith(prefixes)), "elementwise and the rest")
            by_kind[kind] += e.self_cpu_time_total / 1000
            break
step_ms = 1000 * statistics.median(times)
print0(f"\ndepth {depth}, B {device_batch_size} x T {max_seq_len}, {accum} micro-step(s), vocab {vocab_size}: step "
       f"{step_ms:.0f} ms (median of {repeats}: {', '.join(f'{1000 * t:.0f}' for t in times)}), "
       f"{total_batch_size / statistics.median(times):,.0f} tok/s; the profiled step took {sum(wall.values()):.0f} ms "
       f"in its regions")
for name in REGIONS:
    ops = by_region[name]
    print0(f"  {name}: {wall[name]:.0f} ms ({100 * wall[name] / sum(wall.values()):.0f}%)  " +
           ", ".join(f"{op.removeprefix('aten::')} {ms:.0f}" for op, ms in ops.most_common(top)))
total = sum(by_kind.values())
print0("  by kind of op (self time): " + ", ".join(f"{kind} {100 * ms / total:.0f}%"
                                                  for kind, ms in by_kind.most_common()))
if compile:
    outside = sum(wall.values()) - total
    print0(f"  compiled: {outside:.0f} ms ({100 * outside / sum(wall.values()):.0f}% of the regions) outside aten ops "
           f"(the fused kernels, Python); the shares above are of the {total:.0f} ms in aten ops")
