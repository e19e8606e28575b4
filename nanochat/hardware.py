"""
What the hardware decides: the compute dtype, the peak FLOP/s behind MFU, whether to torch.compile, when its
queued work is done (device_time: the clock of a training step), and whose kernels decode one row in bf16 on a CPU
(native_bf16_gemv).

compute_dtype is decided once per process (rank 0's decision under torchrun) and followed by training, Muon, the
evaluations and the Engine; weights and optimizer state stay fp32. The rules and why: docs/hardware.md.
"""

import functools
import json
import os
import platform
import subprocess
import threading
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from filelock import FileLock

from nanochat.common import UserError, atomic_write, get_base_dir, is_distributed

# CPU flags of native bf16 matmuls: x86 AVX512-BF16, AMX-BF16; Arm's BF16 (macOS: FEAT_BF16). docs/hardware.md
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
# bf16 only where the probe finds its matmul clearly faster than fp32's: emulated bf16 reads below 1x; native, 1.6x
# and up (an AMX VM's worst moments: its training still ran 1.5x as fast in bf16; docs/hardware.md)
BF16_MIN_SPEEDUP = 1.3
PROBE_VERSION = 2  # in the probe's cache key: version 1 timed single calls in turns, which read that AMX VM as 1.5x


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
    (dtype, why) on this machine: decide_compute_dtype with $NANOCHAT_DTYPE, the CPU's flags and bf16_probe. Decided
    once per process; with a process group, rank 0's decision sent to every rank, so the first call is a collective:
    every script makes it on every rank right after compute_init (a training stage in stage.start_compute, which
    prints compute_dtype_line; the other scripts in their autocast_context or compute_dtype_line call).
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
    """(the compute dtype, a context manager that runs the matmuls inside it in that dtype): bf16 autocast, or
    nothing for fp32. Reusable: enter it around every forward (and the backward follows the forward's dtypes)."""
    dtype = autocast_dtype(device_type)
    return dtype, (torch.amp.autocast(device_type=device_type, dtype=dtype) if dtype != torch.float32 else nullcontext())


def cpu_bf16_flags():
    """The native-bf16 flags of CPU_BF16_FLAGS this CPU reports (Linux: /proc/cpuinfo; macOS: sysctl); () if none."""
    if platform.system() == "Darwin":
        return ("bf16",) if _sysctl("hw.optional.arm.FEAT_BF16") == "1" else ()
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


def _sysctl(name):
    try:
        return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def bf16_probe(n=1024, rounds=5, calls=3):
    """
    (bf16 FLOP/s, fp32 FLOP/s) of an n^3 matmul on the CPU: the dtypes in turns (best_in_turns: each turn one untimed
    call, then the mean of `calls` timed ones; the best of `rounds`). Measured once per CPU model, thread count, torch
    version and PROBE_VERSION, then read from <base_dir>/compute_dtype.json. Why so: docs/hardware.md.
    """
    def measure():
        operands = {dtype: _random_matrices("cpu", dtype, n) for dtype in (torch.bfloat16, torch.float32)}
        # warm: an AMX unit left idle by the fp32 turn runs its first call slowly
        best = best_in_turns({dtype: functools.partial(torch.matmul, a, b) for dtype, (a, b) in operands.items()},
                             rounds, calls, warm=True)
        return {str(dtype).removeprefix("torch."): 2 * n ** 3 / seconds for dtype, seconds in best.items()}

    key = f"{cpu_model_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, probe {PROBE_VERSION}"
    entry, _ = kept_per_machine("compute_dtype.json", key, lambda known: known or measure())
    return entry["bfloat16"], entry["float32"]


def kept_per_machine(filename, key, update):
    """
    (update(the entry kept under `key` in <base_dir>/<filename>, or None), the file's path), keeping the new entry;
    under a file lock, since the ranks of a torchrun start together.
    """
    path = os.path.join(get_base_dir(), filename)
    with FileLock(path + ".lock"):
        try:
            with open(path, encoding="utf-8") as f:
                known = json.load(f)
        except (OSError, ValueError):
            known = {}
        entry = update(known.get(key))
        if entry != known.get(key):
            known[key] = entry
            with atomic_write(path, "w") as f:
                json.dump(known, f, indent=2)
    return entry, path


def best_in_turns(variants, rounds, calls, warm=False):
    """{name: seconds per call} of the callables in `variants`, in turns (another program taking the CPU for a moment
    slows the turns around it, not one variant): each round, each one untimed call if `warm`, then the mean of
    `calls` timed ones; the best of `rounds` rounds. Every probe of the project compares its variants so."""
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds):
        for name, call in variants.items():
            if warm:
                call()
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls)
    return best


PEAK_BF16_FLOPS = {  # dense bf16 tensor-core datasheet peaks, per GPU; the longest name that matches wins
    "H100": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12,  # "H100" alone: the SXM part
    "H200": 989e12, "H800": 989e12, "GH200": 989e12, "B200": 2250e12,
    "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12, "RTX 4090": 165e12,
}


def _random_matrices(device, dtype, n):
    """Two random n x n matrices from a private generator: measuring never moves the global RNG (docs/hardware.md)."""
    rng = torch.Generator(device=device).manual_seed(0)
    return tuple(torch.randn(n, n, device=device, dtype=dtype, generator=rng) for _ in range(2))


def measure_matmul_flops(device, dtype, n=1024, repeats=5):
    """Best observed FLOP/s of an n^3 matmul on `device` in `dtype` (a warm-up, then the best of `repeats` calls)."""
    a, b = _random_matrices(device, dtype, n)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    a @ b
    sync()  # then every timed call starts on an idle device and ends when its product is done
    return 2 * n ** 3 / best_in_turns({"matmul": lambda: (a @ b, sync())}, repeats, 1, warm=False)["matmul"]


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
    else:
        hardware = f"{cpu_model_name()}, {torch.get_num_threads()} threads" if device.type == "cpu" else device.type
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
    best, path = kept_per_machine("peak_flops.json", f"{hardware} | {dtype_name}", lambda known: max(measured, known or 0.0))
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
    brand = _sysctl("machdep.cpu.brand_string") if platform.system() == "Darwin" else ""  # "Apple M2 Pro"
    return brand or platform.processor() or platform.machine()


def compile_model(model, setting, device_type, dynamic=False):
    """
    (the model to call, whether it is compiled), per the stages' `compile` setting: "auto" compiles on CUDA only,
    "true" / "false" force it; dynamic=True for rows whose length changes between batches. Save and evaluate the
    uncompiled model. Why: docs/hardware.md.
    """
    use = setting == "true" or (setting == "auto" and device_type == "cuda")
    return (torch.compile(model, dynamic=dynamic) if use else model), use


def device_time(device):
    """time.time() once the work queued on `device` is done: CUDA runs kernels asynchronously, so a step timed
    without waiting for them would measure how fast they were queued."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()


# ---------------------------------------------------------------------------------------------
# Decoding one or two rows in bf16 on a CPU: whose kernels multiply the matrices

# torch sends every bf16 matmul on a CPU to oneDNN, whose cost per call, not the arithmetic, is most of a
# matrix-vector product in a decoding step: on a Zen 4 (avx512_bf16) a one-sample step ran 1.3-1.8x as fast with
# oneDNN off (torch's own kernels, the matrices row-major), two rows 1.2x, four 0.95x. Other CPUs may differ, so a
# probe decides (docs/hardware.md, "Decoding one row on a CPU").
NATIVE_GEMV_MAX_ROWS = 2  # more rows than this: oneDNN, unprobed
NATIVE_GEMV_MIN_SPEEDUP = 1.2  # torch's own kernels only when clearly faster (this VM's runs vary by ~10%)


def native_bf16_gemv(rows):
    """
    Whether a bf16 decoding step of `rows` rows on this CPU runs faster with oneDNN off (onednn_off). Measured
    (_gemv_probe) once per CPU model, thread count and torch version, kept in <base_dir>/decode_matmuls.json, so
    every run on a machine decodes through the same kernels (their results differ in the last bit).
    """
    if rows > NATIVE_GEMV_MAX_ROWS:
        return False
    key = f"{cpu_model_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    speedups, _ = kept_per_machine("decode_matmuls.json", key, lambda known: known or _gemv_probe())
    return speedups[str(rows)] >= NATIVE_GEMV_MIN_SPEEDUP


def _gemv_probe(width=512, vocab=8192, layers=2, rounds=5, calls=5):
    """
    {rows: oneDNN's time / torch's own kernels' time} for 1..NATIVE_GEMV_MAX_ROWS rows, over a chain shaped like a
    decoding step (per layer: norm, q/k/v matrix, output projection, norm, MLP; then the head) in bf16, each kernel
    family with its own layout (oneDNN column-major as decode_weights stores it, torch's own row-major), in turns
    (best_in_turns, a warm-up call each turn). Random matrices from a private generator (the global RNG stays).
    """
    rng = torch.Generator().manual_seed(0)
    shapes = [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)] * layers + [(vocab, width)]
    row_major = [(torch.randn(shape, generator=rng) * shape[1] ** -0.5).to(torch.bfloat16) for shape in shapes]
    column_major = [w.t().contiguous().t() for w in row_major]

    def step(x, ws):
        for i in range(layers):
            qkv, proj, fc, down = ws[4 * i:4 * i + 4]
            x = x + F.linear(F.linear(F.rms_norm(x, (width,)), qkv)[..., :width], proj)
            x = x + F.linear(F.relu(F.linear(F.rms_norm(x, (width,)), fc)).square(), down)
        return F.linear(F.rms_norm(x, (width,)), ws[-1])

    def native(x):  # torch's own kernels over the row-major weights
        with onednn_off():
            return step(x, row_major)

    speedups = {}
    with torch.inference_mode(), torch.autocast("cpu", enabled=False):  # the step's own ops, as decode_step runs them
        for rows in range(1, NATIVE_GEMV_MAX_ROWS + 1):
            x = torch.randn(rows, 1, width, generator=rng).to(torch.bfloat16)
            best = best_in_turns({"oneDNN": lambda: step(x, column_major), "native": lambda: native(x)}, rounds, calls,
                                 warm=True)
            speedups[str(rows)] = round(best["oneDNN"] / best["native"], 3)
    return speedups


_onednn_off = {"lock": threading.Lock(), "inside": 0, "was": True}  # how many threads are inside; the setting before


@contextmanager
def onednn_off():
    """
    torch's own CPU kernels for the matmuls inside, not oneDNN (its default for bf16); the setting restored when the
    last thread inside leaves. The setting is the process's, not the thread's: two threads that each saved and
    restored it (a server's worker decoding while another thread does) could leave it off for good.
    """
    with _onednn_off["lock"]:
        if _onednn_off["inside"] == 0:
            _onednn_off["was"] = torch.backends.mkldnn.enabled
            torch.backends.mkldnn.enabled = False
        _onednn_off["inside"] += 1
    try:
        yield
    finally:
        with _onednn_off["lock"]:
            _onednn_off["inside"] -= 1
            if _onednn_off["inside"] == 0:
                torch.backends.mkldnn.enabled = _onednn_off["was"]
