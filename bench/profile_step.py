"""
Where a training step's time goes, by the PyTorch profiler: the step of scripts/base_train.py (its model with its
default parts and the settings below, its optimizers and weight decay by depth, clipping, the micro-steps under
autocast in the compute dtype of nanochat/hardware.py, torch.compile as its --compile), on random tokens (the values
do not change the time). After `warmup` steps, one step is timed `repeats` times without the profiler (the median is
the step time, with its tok/s and MFU against hardware.get_peak_flops) and once with it. Then:
- on a CPU: per region (forward, backward, clipping, AdamW, Muon) its wall time and the ops that take it (self
  time), and the share of the step per kind of op;
- on a GPU: per region its CPU wall time and its kernels' GPU time, the share of the profiled step's wall time per
  kind of kernel (bench/kernel_kinds.py: matmul, attention, the softcapped loss, clipping, AdamW, Muon, copies and
  casts, elementwise) and of the GPU's idle time (the step's wall time less the union of its kernels' intervals:
  launches and Python it waited for), the kernels launched per step, and the top kernels by GPU time.

    python bench/profile_step.py --depth=4 --device_batch_size=1 --total_batch_size=512   # the seed command
    python bench/profile_step.py --depth=4 --device_batch_size=8 --total_batch_size=4096  # the CPU speedrun
    python bench/profile_step.py --depth=8 --device_batch_size=8 --total_batch_size=8192
    NANOCHAT_DTYPE=float32 python bench/profile_step.py ...    # the same in the other dtype
    python bench/profile_step.py --depth=8 ... --compile=true  # compiled: its fused kernels are no aten ops, so the
                                                               # time outside aten ops gets a line of its own
    # one GPU: base_train's depth-24 step of 16 rows (compiled, as base_train on CUDA), one micro-step a step as
    # bench/train_speed.py and bench/head_speed.py time it, its chrome trace kept
    python bench/profile_step.py --depth=24 --max_seq_len=2048 --vocab_size=65536 --device_batch_size=16 \\
        --total_batch_size=32768 --trace=$OUT/profile_d24.json.gz
    ... --total_batch_size=524288                             # base_train's default step on one GPU: 16 micro-steps
    ... --attention=flex --window_pattern=SSSL --fp8=True     # base_train's levers, passed to the model as it does
"""

import collections
import contextlib
import gzip
import io
import json
import os
import statistics
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ab import machine_line  # bench/ab.py
from kernel_kinds import gpu_report  # bench/kernel_kinds.py
from nanochat import attention_kernels
from nanochat.configurator import check_config, configure
from nanochat.dataloader import grad_accum_steps_for
from nanochat.gpt import GPT, config_from_depth
from nanochat.hardware import autocast_context, compile_model, compute_dtype_line, get_peak_flops
from nanochat.optim import (EMBEDDING_WEIGHT_DECAY_BY_DEPTH, MATRIX_WEIGHT_DECAY_BY_DEPTH, clip_grad_norm_,
                            decay_by_depth)
from nanochat.output import UserError, print0
from nanochat.processes import compute_init

device_type = ""  # cuda | cpu; empty: cuda where there is one, else cpu
depth = 4  # model depth
max_seq_len = 512  # T
vocab_size = 4096  # the CPU speedrun's vocabulary (base_train on a GPU: 65536)
device_batch_size = 1  # B
total_batch_size = 512  # tokens per optimizer step
warmup = 2  # untimed steps first (the first one compiles)
repeats = 3  # timed steps without the profiler
top = 8  # ops (CPU) or kinds of kernels (GPU) listed per region
top_kernels = 15  # GPU: the kernels listed by GPU time
compile = "auto"  # torch.compile the model, as base_train --compile: auto (= on for CUDA) | true | false
attention = "auto"  # the attention kernel, as base_train --attention: auto | sdpa | dense | flex (CUDA) | eager
fp8 = False  # the blocks' matmuls in float8, as base_train --fp8
window_pattern = "L"  # attention windows per layer, as base_train --window_pattern (HEAD: SSSL)
trace = ""  # write the profiled step's chrome trace here (a name ending in .gz: gzipped), e.g. $OUT/profile.json.gz
config = configure(globals())
compile = compile.lower()  # --compile=True as well as true
config["compile"] = compile
check_config(config, positive=["depth", "max_seq_len", "vocab_size", "device_batch_size", "total_batch_size",
                               "repeats"],
             non_negative=["warmup", "top", "top_kernels"],
             choices={"device_type": ("", "cuda", "cpu"), "compile": ("auto", "true", "false"),
                      "attention": attention_kernels.CHOICES})
if not window_pattern or set(window_pattern) - set("SL"):
    raise UserError(f"--window_pattern is a string of S (short window) and L (whole context), e.g. SSSL; "
                    f"got {window_pattern!r}")
device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
if attention == "flex" and device_type != "cuda":  # as base_train: torch has FlexAttention's backward for GPUs only
    raise UserError(f"--attention=flex trains on CUDA only (torch {torch.__version__} has no FlexAttention backward on "
                    f"{device_type}); use --attention=sdpa or eager")

# What each op is, for the CPU's shares (anything else: elementwise and the rest); a GPU's kernels: kernel_kinds.py
KINDS = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm"),
         "attention": ("aten::_scaled_dot_product", "aten::_softmax", "aten::_softmax_backward_data"),
         "softcapped loss over the vocabulary": ("aten::tanh", "aten::exp", "aten::log", "aten::_log_softmax",
                                                 "aten::nll_loss", "aten::scatter_add_", "aten::gather",
                                                 "aten::addcmul", "aten::tanh_backward",
                                                 "aten::_log_softmax_backward_data"),
         "dtype casts": ("aten::_to_copy", "aten::copy_")}
REGIONS = ("forward", "backward", "clipping", "AdamW", "Muon")  # record_function's names in step(); they do not nest

# the process set up as base_train's is (on Linux a CPU's freed memory kept: docs/hardware.md)
_, _, _, _, device = compute_init(device_type)
dtype, autocast = autocast_context(device_type)
cuda = device_type == "cuda"
print0(f"{compute_dtype_line(device_type)}\n{machine_line()}; {torch.get_num_threads()} torch threads" +
       (f"; GPU {torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}" if cuda else ""))
torch.manual_seed(0)
# base_train's model: its default parts (qk_scale 1.2, value embeddings), the window pattern given
model_config = config_from_depth(depth, vocab_size=vocab_size, sequence_len=max_seq_len, qk_scale=1.2,
                                 value_embeds=True, window_pattern=window_pattern)
with torch.device("meta"):
    model = GPT(model_config)
model.to_empty(device=device)
model.init_weights(recipe="2026")  # base_train's default recipe
model.fp8 = fp8
model.attention_kernel, why = attention_kernels.choose_kernel(attention, model.config, device_type, dtype)  # as Stage
print0(why)
with contextlib.redirect_stdout(io.StringIO()):  # setup_optimizers prints its summary
    adamw, muon = model.setup_optimizers(weight_decay=decay_by_depth(EMBEDDING_WEIGHT_DECAY_BY_DEPTH, depth),
                                         matrix_weight_decay=decay_by_depth(MATRIX_WEIGHT_DECAY_BY_DEPTH, depth))
train_model, compiled = compile_model(model, compile, device_type)
accum = grad_accum_steps_for(total_batch_size, device_batch_size, max_seq_len, 1)
x = torch.randint(0, vocab_size, (device_batch_size, max_seq_len), device=device)
y = torch.randint(0, vocab_size, (device_batch_size, max_seq_len), device=device)
flops_per_token = model.estimate_flops()
peak_flops, peak_source = get_peak_flops(device, dtype)
print0(f"model: depth {depth}, attention {attention}, windows {window_pattern}, fp8 {fp8}, torch.compile {compiled}")


def step():
    with record_function("step"):
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
        loss.item()  # waits for the GPU's work


for _ in range(warmup):
    step()
times = []
for _ in range(repeats):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
    step()
step_s = statistics.median(times)
mfu = flops_per_token * total_batch_size / step_s / peak_flops
print0(f"\ndepth {depth}, B {device_batch_size} x T {max_seq_len}, {accum} micro-step(s), vocab {vocab_size}: step "
       f"{1000 * step_s:.0f} ms (median of {repeats}: {', '.join(f'{1000 * t:.0f}' for t in times)}), "
       f"{total_batch_size / step_s:,.0f} tok/s, MFU {100 * mfu:.1f}% of {peak_flops:.3e} FLOP/s ({peak_source})")
if trace:
    prof.export_chrome_trace(trace)
    print0(f"the profiled step's chrome trace: {trace} (chrome://tracing, ui.perfetto.dev)")

if not cuda:
    # Attribute every op to the region it started in (regions do not nest)
    events = prof.events()
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
                kind = next((k for k, prefixes in KINDS.items() if e.name.startswith(prefixes)),
                            "elementwise and the rest")
                by_kind[kind] += e.self_cpu_time_total / 1000
                break
    print0(f"the profiled step took {sum(wall.values()):.0f} ms in its regions")
    for name in REGIONS:
        ops = by_region[name]
        print0(f"  {name}: {wall[name]:.0f} ms ({100 * wall[name] / sum(wall.values()):.0f}%)  " +
               ", ".join(f"{op.removeprefix('aten::')} {ms:.0f}" for op, ms in ops.most_common(top)))
    total = sum(by_kind.values())
    print0("  by kind of op (self time): " + ", ".join(f"{kind} {100 * ms / total:.0f}%"
                                                      for kind, ms in by_kind.most_common()))
    if compiled:
        outside = sum(wall.values()) - total
        print0(f"  compiled: {outside:.0f} ms ({100 * outside / sum(wall.values()):.0f}% of the regions) outside aten "
               f"ops (the fused kernels, Python); the shares above are of the {total:.0f} ms in aten ops")
else:
    # The GPU's side, from the chrome trace: each kernel's interval, and the region its launch was queued from
    with tempfile.TemporaryDirectory() as tmp:
        path = trace or os.path.join(tmp, "trace.json")
        if not trace:
            prof.export_chrome_trace(path)
        with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
            lines = gpu_report(json.load(f), REGIONS, accum, top, top_kernels)
    for line in lines:
        print0(line)
