"""
What a profiled training step's GPU kernels compute and when the GPU waits: bench/profile_step.py's reading of a trace.

A kernel's kind comes from its name (KERNEL_KINDS: cuBLAS, FlashAttention and ATen name their kernels after what they
do; a kernel torch.compile wrote is named after the ops it fuses, "triton_<kind>_fused_<ops>_<n>"), except in the
optimizer's regions, where every kernel counts as that region's work (Muon's Newton-Schulz matmuls apart).
The trace is torch.profiler's chrome trace (export_chrome_trace, read back as a dict): the CPU regions of
record_function ("user_annotation", and on the GPU's timeline "gpu_user_annotation"), the launches ("cuda_runtime" /
"cuda_driver") and the kernels, memcpys and memsets the GPU ran ("kernel", "gpu_memcpy", "gpu_memset"), a launch tied
to its kernel by "correlation".
"""

import collections
import re
import statistics

# (kind, regex searched in the kernel's name, any case): the first rule that matches names the kind, so the order
# matters: cuDNN's attention kernels say "wgmma" and the memory-efficient one "cutlass" (attention before matmul);
# the loss's softmax is a log_softmax (before the eager attention's plain softmax).
KERNEL_KINDS = (
    ("attention", r"flash|fmha|flex_attention|attention|sdpa"),
    ("softcapped loss over the vocabulary", r"tanh|log_?softmax|nll_loss|cross_entropy"),
    ("attention", r"softmax"),
    ("matmul", r"gemm|gemv|cutlass|nvjet|xmma|cublas|wgmma|scaled_mm|^triton_tem_fused_(addmm|bmm|mm)_"),
    ("copies and casts", r"copy_kernel|memcpy|memset|catarray|^triton_[a-z]+_fused_((_to_copy|cat|clone|copy)_)+\d+$"),
    ("elementwise and reductions", r"elementwise|reduce|norm|foreach|multi_tensor|^triton_"),
)
OTHER = "other"  # a name no rule matches
OPTIMIZER_REGIONS = ("clipping", "AdamW", "Muon")  # the regions whose kernels are the optimizer's work
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # what the GPU runs (a trace's "cat", any case)
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")  # the CPU's calls that queue it


def kernel_kind(name):
    """The kind of GPU work a kernel named `name` does, by the first rule of KERNEL_KINDS that matches, else OTHER."""
    return next((kind for kind, rule in KERNEL_KINDS if re.search(rule, name, re.IGNORECASE)), OTHER)


def kind_in_step(name, region):
    """kernel_kind, except that a kernel launched in an optimizer's region is that region's work."""
    kind = kernel_kind(name)
    if region == "Muon" and kind == "matmul":
        return "Muon: Newton-Schulz matmuls"
    if region == "clipping":
        return "clipping (the gradients' norm)"
    if region in OPTIMIZER_REGIONS:
        return f"{region}: the rest"
    return kind


def union_and_gaps(intervals, start, end):
    """
    (the time in [start, end] covered by at least one of the (start, end) `intervals`, [the gaps between them: what
    is left of [start, end], in order]).
    """
    busy = 0.0
    gaps = []
    t = start  # everything before t is accounted for
    for a, b in sorted(intervals):
        a = max(a, start)
        b = min(b, end)
        if b <= t:
            continue
        if a > t:
            gaps.append(a - t)
        busy += b - max(a, t)
        t = b
    if end > t:
        gaps.append(end - t)
    return busy, gaps


def read_step(trace, regions, step="step"):
    """
    The step recorded as record_function(`step`) in a chrome trace (dict), in microseconds:
    (step's (start, end), {region: CPU wall time, summed over its occurrences},
     [(name, start, end, region) for each kernel, memcpy and memset the GPU ran in the step (cut to the step);
      region: the one its launch was in, else (no launch in the trace) the GPU's copy of a region it started in,
      else ""]).
    """
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e.get("cat", "").lower() == "user_annotation" and e["name"] == step]
    if len(steps) != 1:
        raise ValueError(f"the trace holds {len(steps)} record_function regions named {step!r}, not one")
    start = float(steps[0]["ts"])
    end = start + float(steps[0]["dur"])
    spans = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
             if e.get("cat", "").lower() == "user_annotation" and e["name"] in regions]
    wall = {name: 0.0 for name in regions}
    for name, a, b in spans:
        wall[name] += b - a
    # where a kernel's launch is missing from the trace: the GPU's copy of the regions (kineto draws each
    # record_function region again on the GPU's timeline, over the kernels launched inside it)
    gpu_spans = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                 if e.get("cat", "").lower() == "gpu_user_annotation" and e["name"] in regions]
    launched = {}  # correlation id -> when the CPU queued it
    for e in events:
        if e.get("cat", "").lower() in LAUNCH_CATEGORIES and "correlation" in e.get("args", {}):
            launched[e["args"]["correlation"]] = float(e["ts"])
    kernels = []
    for e in events:
        if e.get("cat", "").lower() not in GPU_CATEGORIES:
            continue
        a = max(float(e["ts"]), start)  # what the step holds of it
        b = min(float(e["ts"]) + float(e["dur"]), end)
        if b <= a:
            continue
        at = launched.get(e.get("args", {}).get("correlation"))
        if at is None:
            region = next((name for name, s, t in gpu_spans if s <= a < t), "")
        else:
            region = next((name for name, s, t in spans if s <= at < t), "")
        kernels.append((e["name"], a, b, region))
    return (start, end), wall, kernels


def gpu_report(trace, regions, micro_steps, top=8, top_kernels=15):
    """
    The lines bench/profile_step.py prints for a step on a GPU, from its chrome trace (read_step): the GPU's busy and
    idle time in the step and its kernels; per region its CPU wall time and its kernels' GPU time by kind (`top`
    kinds); the share of the step's wall time per kind and idle; the `top_kernels` kernels by GPU time.
    """
    (start, end), cpu_wall, kernels = read_step(trace, regions)
    step_us = end - start
    busy, gaps = union_and_gaps([(a, b) for _, a, b, _ in kernels], start, end)
    idle = step_us - busy
    long_gaps = [g for g in gaps if g >= 10]
    median_kernel = statistics.median([b - a for _, a, b, _ in kernels] or [0])
    lines = [f"the profiled step took {step_us / 1000:.0f} ms: the GPU busy {busy / 1000:.0f} ms "
             f"({100 * busy / step_us:.0f}%), idle {idle / 1000:.1f} ms ({100 * idle / step_us:.0f}%) in {len(gaps)} "
             f"gaps ({len(long_gaps)} of 10 us or more: {sum(long_gaps) / 1000:.1f} ms; the longest "
             f"{max(gaps, default=0) / 1000:.2f} ms); {len(kernels):,} kernels launched "
             f"({len(kernels) / micro_steps:,.0f} per micro-step, the optimizers' included), median "
             f"{median_kernel:.1f} us"]
    by_kind = collections.Counter()  # us per kind of kernel
    by_region = collections.defaultdict(collections.Counter)  # {region: us per kind}
    by_kernel = collections.Counter()  # us per (kind, name): a name in an optimizer's region is that region's work
    calls = collections.Counter()
    for name, a, b, region in kernels:
        kind = kind_in_step(name, region)
        by_kind[kind] += b - a
        by_region[region or "outside the regions"][kind] += b - a
        by_kernel[kind, name] += b - a
        calls[kind, name] += 1
    for name in tuple(regions) + ("outside the regions",):
        kinds = by_region[name]
        gpu = sum(kinds.values())
        region_wall = f"CPU {cpu_wall[name] / 1000:.0f} ms, " if name in cpu_wall else ""
        lines.append(f"  {name}: {region_wall}GPU {gpu / 1000:.1f} ms  " +
                     ", ".join(f"{kind} {100 * us / gpu:.0f}%" for kind, us in kinds.most_common(top)))
    shares = sorted(list(by_kind.items()) + [("GPU idle", idle)], key=lambda kv: -kv[1])
    lines.append("  share of the profiled step's wall time: " +
                 ", ".join(f"{kind} {100 * us / step_us:.1f}%" for kind, us in shares))
    overlap = sum(by_kind.values()) - busy  # kernels on several streams at once: counted in each kind
    if overlap > 0.005 * step_us:
        lines.append(f"  (kernels overlapped for {overlap / 1000:.1f} ms: the shares add up to "
                     f"{100 + 100 * overlap / step_us:.0f}%)")
    optimizers = sum(sum(by_region[name].values()) for name in OPTIMIZER_REGIONS)
    lines.append(f"  the optimizers' regions ({', '.join(OPTIMIZER_REGIONS)}) together: {optimizers / 1000:.1f} ms "
                 f"of GPU time ({100 * optimizers / step_us:.1f}% of the step)")
    lines.append(f"  top {top_kernels} kernels by GPU time (ms, share of the step, calls, kind, name):")
    for (kind, name), us in by_kernel.most_common(top_kernels):
        lines.append(f"    {us / 1000:8.2f} {100 * us / step_us:5.1f}% {calls[kind, name]:6d}  {kind}  {name[:160]}")
    return lines
