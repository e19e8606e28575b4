"""
Optimizer step time, in ms per step: Muon and AdamW in one process, then DistMuon and DistAdamW on N ranks.

For the parameters of GPTs of a few depths; the distributed part under torchrun. The optimizers are the ones
GPT.setup_optimizers picks: Muon/DistMuon for the matrices of the transformer blocks, AdamW/DistAdamW
(nanochat/adamw.py) for the rest (wte and lm_head; the value embeddings and layer scalars when the model has them).
The default vocab is 8192 (not 65536) to keep the embedding CPU-sized.

    python bench/optim.py                         # one process, then relaunches itself with torchrun, 2 ranks
    python bench/optim.py --depths=4,8 --steps=20 --nproc=2
    python bench/optim.py --mode=single           # only the single-process part
    torchrun --standalone --nproc_per_node=2 bench/optim.py   # only the distributed part (CPU: gloo, GPU: nccl)

Gradients are random (the step time does not depend on their values). Each optimizer is timed on its own:
warm-up steps, then `steps` timed steps, median reported. In the distributed part the ranks are lined up
with a barrier before each timed step, and the time of rank 0 is reported; on CPU torchrun gives each
rank one thread (OMP_NUM_THREADS=1), while the single process uses every core.
"""

import contextlib
import io
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from nanochat.configurator import configure
from nanochat.gpt import GPT, config_from_depth
from nanochat.output import print0
from nanochat.processes import autodetect_device_type, compute_cleanup, compute_init, get_dist_info

depths = "4,8"  # comma-separated model depths
vocab_size = 8192  # vocabulary size of the benchmarked model (the real one has 65536)
steps = 10  # timed steps per optimizer
warmup = 2  # untimed steps first
nproc = 2  # ranks for the distributed part
mode = "all"  # all = single-process part, then the distributed part under torchrun; single; dist
device_type = ""  # cuda | cpu; empty = autodetect
config = configure(globals())


def machine():
    if torch.cuda.is_available() and device.type == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def build(depth):
    """A GPT of this depth on `device`, random gradients on every parameter, and its [adamw, muon]."""
    with torch.device("meta"):
        model = GPT(config_from_depth(depth, vocab_size=vocab_size, sequence_len=256))
    model.to_empty(device=device)
    model.init_weights()
    gen = torch.Generator(device=device).manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, device=device) * 1e-3
    with contextlib.redirect_stdout(io.StringIO()):  # setup_optimizers prints its summary
        adamw, muon = model.setup_optimizers()
    return model, adamw, muon


def time_steps(opt):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(warmup + steps):
        if ddp:
            dist.barrier()
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def count(opt):
    return sum(p.numel() for g in opt.param_groups for p in g["params"])


if mode == "dist" and not get_dist_info()[0]:
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc_per_node={nproc}", __file__] + sys.argv[1:])

ddp, rank, _, world_size, device = compute_init(device_type or autodetect_device_type())
label = f"{world_size} ranks ({dist.get_backend()})" if ddp else "1 process"
print0(f"\n== optimizer step time, {label}: {machine()}")
print0(f"{'depth':>5} {'n_embd':>6} {'matrices':>8} {'Muon params':>12} {'AdamW params':>12} "
       f"{'Muon ms':>9} {'AdamW ms':>9} {'total ms':>9}")
for depth in [int(d) for d in depths.split(",")]:
    model, adamw, muon = build(depth)
    muon_ms = time_steps(muon)
    adamw_ms = time_steps(adamw)
    n_matrices = sum(len(g["params"]) for g in muon.param_groups)
    print0(f"{depth:>5} {model.config.n_embd:>6} {n_matrices:>8} {count(muon):>12,} {count(adamw):>12,} "
           f"{muon_ms:>9.1f} {adamw_ms:>9.1f} {muon_ms + adamw_ms:>9.1f}")
    print0(f"      ({type(muon).__name__} + {type(adamw).__name__})")
compute_cleanup()

if mode == "all" and not ddp:
    # the distributed part: the same script, under torchrun
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__]
    subprocess.run(cmd + [a for a in sys.argv[1:] if not a.startswith("--mode")], check=True)
