"""
The per-machine measurements: kept answers, the timing loop, the probes of bf16 matmuls, decoding and attention.

A probe times what its caller gives it (or torch's own ops), in turns (best_in_turns), once per machine: its answer
is kept in a file of <base_dir> under a key naming the machine (machine_key), so that every run on a machine decides
the same kernels and computes the same numbers. Its inputs come from a private generator: measuring never moves the
global RNG, whose state decides a run's numbers. Each rule and why: docs/hardware.md; the measurements behind the
thresholds: bench/RESULTS.md.
"""

import functools
import os
import platform
import subprocess
import time

import torch
import torch.nn.functional as F
from filelock import FileLock

from nanochat.cpu_kernels import onednn_off
from nanochat.files import get_base_dir, read_json, write_json

# -----------------------------------------------------------------------------
# The machine, its kept answers, and the timing loop


def cpu_model_name():
    """The CPU's marketing name (for reports and the kept answers' keys)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    brand = sysctl("machdep.cpu.brand_string") if platform.system() == "Darwin" else ""  # "Apple M2 Pro"
    return brand or platform.processor() or platform.machine()


def sysctl(name):
    """macOS's `sysctl -n name`, "" where it fails."""
    try:
        return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_key():
    """The machine in a kept answer's key: the CPU model, torch's thread count and torch's version."""
    return f"{cpu_model_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def kept_per_machine(filename, key, update):
    """
    (update(the entry kept under `key` in <base_dir>/<filename>, or None), the file's path), keeping the new entry;
    under a file lock, since the ranks of a torchrun start together.
    """
    path = os.path.join(get_base_dir(), filename)
    with FileLock(path + ".lock"):
        known = read_json(path) or {}
        entry = update(known.get(key))
        if entry != known.get(key):
            known[key] = entry
            write_json(path, known, indent=2)
    return entry, path


def best_in_turns(variants, rounds, calls, warm=False):
    """
    {name: seconds per call} of the callables in `variants`, in turns (another program taking the CPU for a moment
    slows the turns around it, not one variant): each round, each one untimed call if `warm`, then the mean of
    `calls` timed ones; the best of `rounds` rounds. Every probe of the project compares its variants so.
    """
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


# -----------------------------------------------------------------------------
# Matmul FLOP/s: the bf16 probe of the compute dtype, the measured peak behind MFU

PROBE_VERSION = 2  # in the bf16 probe's key: an answer of an earlier version of the probe is measured again


def bf16_probe(n=1024, rounds=5, calls=3):
    """
    (bf16 FLOP/s, fp32 FLOP/s) of an n^3 matmul on the CPU: the dtypes in turns (best_in_turns: each turn one untimed
    call, then the mean of `calls` timed ones; the best of `rounds`). Measured once per machine and PROBE_VERSION,
    then read from <base_dir>/compute_dtype.json (hardware.compute_dtype decides by it).
    """
    def measure():
        operands = {dtype: random_matrices("cpu", dtype, n) for dtype in (torch.bfloat16, torch.float32)}
        # warm: an AMX unit left idle by the fp32 turn runs its first call slowly
        best = best_in_turns({dtype: functools.partial(torch.matmul, a, b) for dtype, (a, b) in operands.items()},
                             rounds, calls, warm=True)
        return {str(dtype).removeprefix("torch."): 2 * n ** 3 / seconds for dtype, seconds in best.items()}

    key = f"{machine_key()}, probe {PROBE_VERSION}"
    entry, _ = kept_per_machine("compute_dtype.json", key, lambda known: known or measure())
    return entry["bfloat16"], entry["float32"]


def random_matrices(device, dtype, n):
    """Two random n x n matrices from a private generator."""
    rng = torch.Generator(device=device).manual_seed(0)
    return tuple(torch.randn(n, n, device=device, dtype=dtype, generator=rng) for _ in range(2))


def measure_matmul_flops(device, dtype, n, repeats):
    """Best observed FLOP/s of an n^3 matmul on `device` in `dtype` (a warm-up, then the best of `repeats` calls)."""
    a, b = random_matrices(device, dtype, n)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    a @ b
    sync()  # then every timed call starts on an idle device and ends when its product is done
    return 2 * n ** 3 / best_in_turns({"matmul": lambda: (a @ b, sync())}, repeats, 1)["matmul"]


# -----------------------------------------------------------------------------
# Decoding one or two rows in bf16 on a CPU: whose kernels multiply the matrices, and the KV cache's dtype

# torch sends every bf16 matmul on a CPU to oneDNN, whose cost per call, not the arithmetic, is most of a
# matrix-vector product in a decoding step; torch's own kernels (oneDNN off, the matrices row-major) can be faster
# there. CPUs differ, so a probe decides (docs/hardware.md, "Decoding one row on a CPU").
NATIVE_GEMV_MAX_ROWS = 2  # more rows than this: oneDNN, unprobed
NATIVE_GEMV_MIN_SPEEDUP = 1.2  # torch's own kernels only when clearly faster (this VM's runs vary by ~10%)


def native_bf16_gemv(rows):
    """
    Whether a bf16 decoding step of `rows` rows on this CPU runs faster with oneDNN off (onednn_off). Measured
    (_gemv_probe) once per machine, kept in <base_dir>/decode_matmuls.json, so every run on a machine decodes through
    the same kernels (their results differ in the last bit).
    """
    if rows > NATIVE_GEMV_MAX_ROWS:
        return False
    speedups, _ = kept_per_machine("decode_matmuls.json", machine_key(), lambda known: known or _gemv_probe())
    return speedups[str(rows)] >= NATIVE_GEMV_MIN_SPEEDUP


def _gemv_probe(width=512, vocab=8192, layers=2, rounds=5, calls=5):
    """
    {rows: oneDNN's time / torch's own kernels' time} for 1..NATIVE_GEMV_MAX_ROWS rows, over a chain shaped like a
    decoding step (per layer: norm, q/k/v matrix, output projection, norm, MLP; then the head) in bf16, each kernel
    family with its own layout (oneDNN column-major as engine.decode_weights stores it, torch's own row-major), in
    turns (best_in_turns, a warm-up call each turn).
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
            variants = {"oneDNN": lambda: step(x, column_major), "native": lambda: native(x)}
            best = best_in_turns(variants, rounds, calls, warm=True)
            speedups[str(rows)] = round(best["oneDNN"] / best["native"], 3)
    return speedups


def fp32_cache_pays():
    """
    Whether a bf16 decode on this CPU keeps its KV cache in fp32 (exact copies of the bf16 keys and values, twice the
    memory): where SDPA of one query over 8 rows x 4 heads x 256 positions ran >= 1.2x as fast on fp32 as on bf16
    (docs/engine.md). Measured once per machine (the dtypes in turns, the best of 5 means of 5 calls), kept in
    <base_dir>/decode_attention.json.
    """
    def probe():
        rng = torch.Generator().manual_seed(0)
        inputs = [torch.randn(8, 4, n, 128, generator=rng) for n in (1, 256, 256)]
        best = best_in_turns({dtype: functools.partial(F.scaled_dot_product_attention, *[t.to(dtype) for t in inputs])
                              for dtype in (torch.bfloat16, torch.float32)}, rounds=5, calls=5)
        return round(best[torch.bfloat16] / best[torch.float32], 3)
    with torch.autocast("cpu", enabled=False):  # the probe's dtypes as given; 1.2x: clearly faster, as native_bf16_gemv
        return kept_per_machine("decode_attention.json", machine_key(), lambda known: known or probe())[0] >= 1.2


# -----------------------------------------------------------------------------
# Attention in training steps on a CPU in bf16: SDPA's flash kernel, or the dense kernel (attention_kernels'
# dense_attention: the scores in batched matmuls, by blocks of queries), decided per machine and shape
# (docs/hardware.md, "Attention in training on a CPU"), for attention_kernels.choose_kernel's "auto"

DENSE_ATTENTION_MIN_SPEEDUP = 1.2  # only where clearly faster (this VM's timings vary by ~10%)
DENSE_ATTENTION_MAX_LEN = 2048  # longer: not measured (slower there already; the scores' memory grows as T^2)


def dense_attention_pays(config, device_type, compute_dtype, attention, dense_attention):
    """
    (whether training steps of a model of `config` on `device_type` computing in `compute_dtype` take the dense
    attention, the start-up line saying why): on a CPU in bf16, no GQA, <= DENSE_ATTENTION_MAX_LEN positions, where
    _attention_probe measured `dense_attention(q, k, v)` at least DENSE_ATTENTION_MIN_SPEEDUP as fast as
    `attention(q, k, v)` (causal, SDPA). Measured once per machine and shape, kept in <base_dir>/attention_kernels.json.
    """
    T, D = config.sequence_len, config.n_embd // config.n_head
    if device_type != "cpu" or compute_dtype != torch.bfloat16 or config.n_kv_head != config.n_head:
        return False, "Attention in training steps: SDPA (dense is measured on a CPU in bf16 without GQA)"
    if T > DENSE_ATTENTION_MAX_LEN:
        return False, (f"Attention in training steps: SDPA (dense is not measured above {DENSE_ATTENTION_MAX_LEN} "
                       f"positions)")
    # "8 rounds, blocks": an answer of an earlier probe (4 rounds, the whole square of scores) is measured again
    key = f"{machine_key()}, {T} positions x {D} channels, 8 rounds, blocks"
    speedup, path = kept_per_machine("attention_kernels.json", key,
                                     lambda known: known or _attention_probe(T, D, attention, dense_attention))
    dense = speedup >= DENSE_ATTENTION_MIN_SPEEDUP
    return dense, (f"Attention in training steps: {'dense bf16 matmuls' if dense else 'SDPA'} (dense ran "
                   f"{speedup:.2f}x as fast as SDPA at {T} positions here, needs {DENSE_ATTENTION_MIN_SPEEDUP}x; "
                   f"kept in {path})")


def _attention_probe(T, D, attention, dense_attention, heads=8, rounds=8, calls=2):
    """
    attention's time / dense_attention's, forward and backward of `heads` causal heads of T x D in bf16, in turns
    (best_in_turns; the first round warms up; 8 rounds: a reading near the threshold would keep the slower kernel on
    the machine for good, bench/RESULTS.md, "The probes' timing loop").
    """
    rng = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, heads, T, D, generator=rng).to(torch.bfloat16).requires_grad_() for _ in range(4))

    def forward_backward(kernel):
        return lambda: torch.autograd.grad(kernel(q, k, v), (q, k, v), grad)

    variants = {"SDPA": forward_backward(attention), "dense": forward_backward(dense_attention)}
    best = best_in_turns(variants, rounds, calls)
    return round(best["SDPA"] / best["dense"], 3)
