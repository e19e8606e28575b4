"""
What the hardware can do: the dtype to compute in (autocast_dtype) and the peak FLOP/s that MFU (model FLOPs
utilisation) is measured against (get_peak_flops).
"""

import json
import os
import time
from contextlib import nullcontext

import torch
from filelock import FileLock

from nanochat.common import UserError, get_base_dir
from nanochat.files import atomic_write


def autocast_dtype(device_type):
    """
    The dtype matmuls run in, by device. bf16 autocast on CUDA GPUs that do bf16 natively (SM80+: A100,
    H100); fp32 on CPU and MPS, where a CPU without native bf16 would emulate it far slower (bench/RESULTS.md).
    $NANOCHAT_DTYPE=bfloat16|float32 overrides. Weights and optimizer state always stay fp32.
    """
    override = os.environ.get("NANOCHAT_DTYPE")
    if override:
        if override not in ("bfloat16", "float32"):
            raise UserError(f"NANOCHAT_DTYPE={override!r}: use bfloat16 or float32")
        return getattr(torch, override)
    if device_type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def autocast_context(device_type):
    """(the compute dtype, a context manager that runs the matmuls inside it in that dtype): bf16 autocast, or
    nothing for fp32. Reusable: enter it around every forward (and the backward follows the forward's dtypes)."""
    dtype = autocast_dtype(device_type)
    return dtype, (torch.amp.autocast(device_type=device_type, dtype=dtype) if dtype != torch.float32 else nullcontext())


PEAK_BF16_FLOPS = {  # dense bf16 tensor-core datasheet peaks, per GPU
    "H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "B200": 2250e12,
    "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12, "RTX 4090": 165e12,
}


def measure_matmul_flops(device, dtype, n=1024, repeats=5):
    """Best observed FLOP/s of an n x n x n matmul on `device` in `dtype` (a few warm-ups, then timed runs)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def get_peak_flops(device, dtype):
    """
    The denominator of MFU (model FLOPs utilisation = achieved model FLOP/s / peak FLOP/s), per device.
    Returns (flops, how it was got).

    - Known CUDA GPUs in bf16: the datasheet dense bf16 peak (an H100 SXM: 989 TFLOP/s).
    - $NANOCHAT_PEAK_FLOPS (a number, e.g. 1.5e11): use that, for machines where you know better.
    - Anything else (CPU, MPS, unknown GPUs): measured, as the best FLOP/s of several matmuls in the dtype we
      compute in (1024^3 and 2048^3: the large one is what a well-fed BLAS reaches; on a CPU also one thread's
      best times the number of threads, which a program busy on another core does not lower). A measurement can only
      come out too LOW (another program busy at that moment, a CPU still clocking up), never too high, so
      the best value ever measured on this machine (same CPU/GPU model, thread count and dtype) is kept in
      <base_dir>/peak_flops.json and a lower reading never replaces it: a loaded moment at start-up cannot
      inflate the MFU of the run.
    """
    device = torch.device(device)
    if device.type == "cuda" and dtype == torch.bfloat16:
        name = torch.cuda.get_device_name(device)
        for key, flops in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0])):
            if key in name:
                return flops, f"{name} datasheet bf16 peak"
    override = os.environ.get("NANOCHAT_PEAK_FLOPS")
    if override:
        try:
            flops = float(override)
        except ValueError:
            flops = 0.0
        if not (0 < flops < float("inf")):
            raise UserError(f"NANOCHAT_PEAK_FLOPS={override!r}: need a positive number of FLOP/s, e.g. 1.5e11")
        return flops, "NANOCHAT_PEAK_FLOPS"
    dtype_name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = f"{cpu_model_name()}, {torch.get_num_threads()} threads" if device.type == "cpu" else device.type
    measured = max(measure_matmul_flops(device, dtype, n=1024, repeats=8),
                   measure_matmul_flops(device, dtype, n=2048, repeats=3))
    if device.type == "cpu" and torch.get_num_threads() > 1:
        # A program busy on one core at this moment would halve a measurement with every thread; one thread
        # finds a free core, and a large matmul scales linearly with threads. Take the larger of the two.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            measured = max(measured, threads * measure_matmul_flops(device, dtype, n=1024, repeats=8))
        finally:
            torch.set_num_threads(threads)
    path = os.path.join(get_base_dir(), "peak_flops.json")
    key = f"{hardware} | {dtype_name}"
    with FileLock(path + ".lock"):
        try:
            with open(path, encoding="utf-8") as f:
                known = json.load(f)
        except (OSError, ValueError):
            known = {}
        best = max(measured, float(known.get(key, 0.0)))
        if best > known.get(key, 0.0):
            known[key] = best
            with atomic_write(path, "w") as f:
                json.dump(known, f, indent=2)
    return best, (f"measured: best {dtype_name} matmul on {hardware} (this run {measured:.3e}; "
                  f"the best of every run on this machine is kept in {path})")


def cpu_model_name():
    """The CPU's marketing name (for reports and the MFU peak's cache key)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()

