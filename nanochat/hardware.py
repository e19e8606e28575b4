"""
What the hardware decides: the compute dtype, the peak FLOP/s behind MFU, torch.compile, a training step's clock.

compute_dtype is decided once per process (rank 0's decision under torchrun) and followed by training, Muon, the
evaluations and the Engine; weights and optimizer state stay fp32. The measurements it decides by:
nanochat/probes.py. The rules and why: docs/hardware.md.
"""

import functools
import os
import platform
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from nanochat.output import UserError
from nanochat.probes import bf16_probe, cpu_model_name, kept_per_machine, measure_matmul_flops, sysctl
from nanochat.ranks import is_distributed

# CPU flags of native bf16 matmuls: x86 AVX512-BF16, AMX-BF16; Arm's BF16 (macOS: FEAT_BF16). docs/hardware.md
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
# bf16 only where the probe finds its matmul clearly faster than fp32's: below every native CPU's reading, far above
# emulation's (docs/hardware.md; bench/RESULTS.md, "The CPU speedrun on an Intel AMX VM")
BF16_MIN_SPEEDUP = 1.3


def decide_compute_dtype(device_type, override, cpu_flags, probe):
    """
    (dtype, why): the dtype the matmuls run in, from inputs given so that tests can drive every answer. `override`
    ($NANOCHAT_DTYPE, "" if unset; else bfloat16 or float32, or UserError) wins; CUDA: bf16 from compute capability
    8.0; MPS: fp32; CPU: bf16 if `cpu_flags` (cpu_bf16_flags()) is not empty and `probe`() -> (bf16 FLOP/s, fp32
    FLOP/s) shows at least BF16_MIN_SPEEDUP; the probe is called only then.
    """
    if override:
        if override not in ("bfloat16", "float32"):
            raise UserError(f"NANOCHAT_DTYPE={override!r}: use bfloat16 or float32")
        return getattr(torch, override), f"NANOCHAT_DTYPE={override}"
    if device_type == "cuda":
        major, minor = torch.cuda.get_device_capability()
        if major >= 8:
            return torch.bfloat16, f"a CUDA GPU with native bf16 (compute capability {major}.{minor})"
        return torch.float32, f"a CUDA GPU without native bf16 (compute capability {major}.{minor} < 8.0)"
    if device_type != "cpu":
        return torch.float32, f"fp32 on {device_type}"
    if not cpu_flags:
        return torch.float32, f"this CPU has no native bf16: none of the flags {', '.join(CPU_BF16_FLAGS)}"
    bf16_flops, fp32_flops = probe()
    speedup = bf16_flops / fp32_flops
    verdict = f"a bf16 matmul ran {speedup:.1f}x as fast as fp32's"
    if speedup >= BF16_MIN_SPEEDUP:
        return torch.bfloat16, f"native bf16 on this CPU ({', '.join(cpu_flags)}); {verdict}"
    return torch.float32, f"this CPU reports {', '.join(cpu_flags)}, but {verdict} (bf16 needs {BF16_MIN_SPEEDUP}x)"


def compute_dtype(device_type):
    """
    (dtype, why) on this machine: decide_compute_dtype with $NANOCHAT_DTYPE, the CPU's flags and probes.bf16_probe.
    Decided once per process; with a process group, rank 0's decision sent to every rank, so the first call is a
    collective: every script makes it on every rank right after compute_init (a training stage in
    stage.start_compute, which prints compute_dtype_line; the other scripts in their autocast_context or
    compute_dtype_line call).
    """
    return _decided(device_type, os.environ.get("NANOCHAT_DTYPE", ""))


@functools.lru_cache(maxsize=None)
def _decided(device_type, override):
    distributed = is_distributed()
    decision = [None]
    if not distributed or dist.get_rank() == 0:
        flags = cpu_bf16_flags() if device_type == "cpu" and not override else ()
        decision = [decide_compute_dtype(device_type, override, flags, bf16_probe)]
    if distributed:
        dist.broadcast_object_list(decision, src=0)  # a CUDA process group sends it through the current device
    return decision[0]


def autocast_dtype(device_type):
    """The dtype matmuls run in on this device (compute_dtype, without the reason)."""
    return compute_dtype(device_type)[0]


def compute_dtype_line(device_type):
    """The start-up line every stage prints: which dtype, and why."""
    dtype, why = compute_dtype(device_type)
    return f"Compute dtype: {str(dtype).removeprefix('torch.')} ({why}; weights and optimizer state stay fp32)"


def autocast_context(device_type):
    """
    (the compute dtype, a context manager that runs the matmuls inside it in that dtype): bf16 autocast, or nothing
    for fp32. Reusable: enter it around every forward (and the backward follows the forward's dtypes).
    """
    dtype = autocast_dtype(device_type)
    if dtype == torch.float32:
        return dtype, nullcontext()
    return dtype, torch.amp.autocast(device_type=device_type, dtype=dtype)


def cpu_bf16_flags():
    """The native-bf16 flags of CPU_BF16_FLAGS this CPU reports (Linux: /proc/cpuinfo; macOS: sysctl); () if none."""
    if platform.system() == "Darwin":
        return ("bf16",) if sysctl("hw.optional.arm.FEAT_BF16") == "1" else ()
    try:
        with open("/proc/cpuinfo") as f:
            return bf16_flags_in(f.read())
    except OSError:
        return ()


def bf16_flags_in(cpuinfo):
    """The flags of CPU_BF16_FLAGS on the "flags" (x86) or "Features" (Arm) lines of a /proc/cpuinfo text."""
    found = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            found.update(line.split(":", 1)[1].split())
    return tuple(flag for flag in CPU_BF16_FLAGS if flag in found)


PEAK_BF16_FLOPS = {  # dense bf16 tensor-core datasheet peaks, per GPU; the longest name that matches wins
    "H100": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12,  # "H100" alone: the SXM part
    "H200": 989e12, "H800": 989e12, "GH200": 989e12, "B200": 2250e12,
    "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12, "RTX 4090": 165e12,
}


def get_peak_flops(device, dtype):
    """
    (peak FLOP/s, how it was got) of `device` computing in `dtype`, the denominator of MFU: $NANOCHAT_PEAK_FLOPS if
    set (UserError unless a positive number); a known CUDA GPU's datasheet bf16 peak (PEAK_BF16_FLOPS); else the best
    matmul FLOP/s ever measured on this machine, kept in <base_dir>/peak_flops.json (why: docs/hardware.md).
    """
    device = torch.device(device)
    override = os.environ.get("NANOCHAT_PEAK_FLOPS")
    if override:
        try:
            flops = float(override)
        except ValueError:
            flops = 0.0
        if not (0 < flops < float("inf")):
            raise UserError(f"NANOCHAT_PEAK_FLOPS={override!r}: need a positive number of FLOP/s, e.g. 1.5e11")
        return flops, "NANOCHAT_PEAK_FLOPS"
    if device.type == "cuda" and dtype == torch.bfloat16:
        name = torch.cuda.get_device_name(device)
        for key, flops in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0])):
            if key in name:
                return flops, f"{name} datasheet bf16 peak"
    dtype_name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    elif device.type == "cpu":
        hardware = f"{cpu_model_name()}, {torch.get_num_threads()} threads"
    else:
        hardware = device.type
    measured = max(measure_matmul_flops(device, dtype, n=1024, repeats=8),
                   measure_matmul_flops(device, dtype, n=2048, repeats=3))
    if device.type == "cpu" and torch.get_num_threads() > 1:
        # a program busy on one core would halve a measurement with every thread; one thread finds a free core
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            measured = max(measured, threads * measure_matmul_flops(device, dtype, n=1024, repeats=8))
        finally:
            torch.set_num_threads(threads)
    best, path = kept_per_machine("peak_flops.json", f"{hardware} | {dtype_name}",
                                  lambda known: max(measured, known or 0.0))
    return best, (f"measured: best {dtype_name} matmul on {hardware} (this run {measured:.3e}; "
                  f"the best of every run on this machine is kept in {path})")


def compile_model(model, setting, device_type, dynamic=False):
    """
    (the model to call, whether it is compiled), per the stages' `compile` setting: "auto" compiles on CUDA only,
    "true" / "false" force it; dynamic=True for rows whose length changes between batches. Save and evaluate the
    uncompiled model. Why: docs/hardware.md.
    """
    use = setting == "true" or (setting == "auto" and device_type == "cuda")
    return (torch.compile(model, dynamic=dynamic) if use else model), use


def device_time(device):
    """
    time.time() once the work queued on `device` is done: CUDA runs kernels asynchronously, so a step timed without
    waiting for them would measure how fast they were queued.
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()
