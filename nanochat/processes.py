"""
One process per device: compute_init at the top of a script, compute_cleanup at its end, torchrun's environment.

  compute_init             at the top of every script that computes: its output (setup_default_logging), the seeds,
                           the device, the process group under torchrun; returns (ddp, rank, local_rank, world_size,
                           device), and rank 0 prints the table of ranks
  compute_cleanup          at the end of such a script: every rank done, then the process group torn down
  autodetect_device_type   the device when --device_type is left empty: cuda > mps > cpu
  get_dist_info            (ddp, rank, local_rank, world_size) from torchrun's environment variables, checked, and
                           nothing set up: for code that needs its rank before or without compute_init

Importing this module touches no RNG, no process group and no handler of the importing program's loggers:
compute_init() does (it seeds the RNGs, sets up the process group and runs setup_default_logging). What the ranks
agree through then: nanochat/ranks.py; the launches and the values they give: docs/processes.md.
"""

import ctypes
import os
import socket
import sys

import torch
import torch.distributed as dist

from nanochat.output import UserError, print0, setup_default_logging
from nanochat.ranks import gather_from_ranks, is_distributed

# One process per device: `torchrun --nproc_per_node=N` starts N copies of the script (processes sidestep Python's
# GIL, so each drives its GPU at full speed) and tells each who it is in environment variables: LOCAL_RANK, its index
# on its own machine, 0..nproc_per_node-1, which selects the GPU (GPUs are numbered per machine); RANK, the global
# index 0..WORLD_SIZE-1: RANK = node_rank x nproc_per_node + LOCAL_RANK, node_rank being the machine's index
# (torchrun --node_rank), so on one machine RANK == LOCAL_RANK, on the 2nd of two 8-GPU machines RANK = 8 +
# LOCAL_RANK; WORLD_SIZE = machines x nproc_per_node = GPUs in use. Rank 0 prints, logs, and writes a checkpoint's
# weights and meta file; every rank writes its own optimizer shard (nanochat/checkpoint_manager.py).


def get_dist_info():
    """
    (ddp, rank, local_rank, world_size); outside torchrun (False, 0, 0, 1). Launched by torchrun (or any launcher
    setting the env:// variables) when any of RANK / LOCAL_RANK / WORLD_SIZE is set, not only RANK: all three must
    then be set and consistent (0 <= local_rank <= rank < world_size), or a UserError says which is not.
    """
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    if not any(v in os.environ for v in names):
        return False, 0, 0, 1
    found = ", ".join(f"{v}={os.environ[v]}" for v in names if v in os.environ)
    if any(v not in os.environ for v in names):
        missing = ", ".join(v for v in names if v not in os.environ)
        raise UserError(f"distributed launch is incomplete: {missing} not set (found {found}); launch with "
                        f"`torchrun --nproc_per_node=N -m scripts.X`, or unset them to run one process")
    try:
        rank, local_rank, world_size = (int(os.environ[v]) for v in names)
    except ValueError:
        raise UserError(f"RANK, LOCAL_RANK and WORLD_SIZE must be integers, got {found}") from None
    if not (world_size >= 1 and 0 <= rank < world_size and 0 <= local_rank <= rank):
        raise UserError(f"inconsistent distributed environment: RANK={rank} LOCAL_RANK={local_rank} "
                        f"WORLD_SIZE={world_size} (need 0 <= LOCAL_RANK <= RANK < WORLD_SIZE)")
    return True, rank, local_rank, world_size


def autodetect_device_type():
    """
    The best device PyTorch can see, cuda > mps > cpu (PyTorch answers "is X available" per backend; choosing is
    ours). AMD GPUs with a ROCm build of PyTorch report as "cuda" (HIP behind the torch.cuda API): the same path.
    TPUs need torch_xla and are not supported.
    """
    mps = hasattr(torch.backends, "mps") and torch.backends.mps.is_available()
    if torch.cuda.is_available():
        device_type = "cuda"
    else:
        device_type = "mps" if mps else "cpu"
    print0(f"Autodetected device type: {device_type}")
    return device_type


def compute_init(device_type="cuda"):
    """
    Set up the process for computing, once, at the top of every script (also its output: setup_default_logging).
    Returns (ddp, ddp_rank, ddp_local_rank, ddp_world_size, device); plain `python -m scripts.X`: (False, 0, 0, 1, ..):
      ddp            True under torchrun: there are other ranks to agree with (collectives, sharded optimizers)
      ddp_rank       global rank; rank 0 is the "master process" that prints, logs to wandb and writes a
                     checkpoint's weights and meta file (every rank writes its own optimizer shard)
      ddp_local_rank rank within this machine; selects the GPU (cuda:<local_rank>)
      ddp_world_size number of processes; divides the work (batch arithmetic, data striding)
      device         the torch.device this process computes on
    """
    setup_default_logging()
    if device_type not in ("cuda", "mps", "cpu"):
        raise UserError(f"unknown device_type {device_type!r}: use cuda, mps, cpu, or '' to autodetect")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise UserError("device_type=cuda but PyTorch sees no CUDA device (CPU-only torch build, or no GPU/driver); "
                        "use --device_type=cpu or leave it empty to autodetect")
    if device_type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise UserError("device_type=mps but MPS is not available (needs Apple Silicon and macOS 12.3+)")

    ddp, ddp_rank, ddp_local_rank, ddp_world_size = get_dist_info()
    if ddp and device_type == "mps":  # refused here, instead of an obscure crash at the first collective
        raise UserError("torchrun is not supported on MPS (a Mac has one GPU and no MPS process-group backend); "
                        "run the script with plain `python -m scripts.X` instead")

    # One seed on every rank, for whatever draws from the global RNG (the initial weights have a generator of their
    # own: GPT.init_weights). Ranks read different data because the loaders shard by rank, not by seed.
    torch.manual_seed(42)
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None) if device_type == "cpu" and sys.platform == "linux" else None
    if mallopt:
        # glibc: freed memory kept for the next step's tensors, not given back to come back as pages the kernel maps
        # and zeroes one fault at a time (docs/hardware.md, "Freed memory on a CPU")
        mallopt(-4, 0)  # M_MMAP_MAX: no block gets a mapping of its own
        mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD 2 GiB: the heap is not trimmed
    if device_type == "cuda":
        torch.cuda.manual_seed(42)
        # TF32 tensor cores for the fp32 matmuls bf16 autocast leaves (10-bit mantissa inputs, fp32 sums): much
        # faster on Ampere/Hopper, a precision loss irrelevant for training
        torch.set_float32_matmul_precision("high")
        # grow allocations in place: less fragmentation near full memory (read at the first CUDA allocation)
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if ddp and device_type == "cuda":
        if ddp_local_rank >= torch.cuda.device_count():  # more processes than this machine has GPUs
            raise UserError(f"LOCAL_RANK={ddp_local_rank} but only {torch.cuda.device_count()} CUDA device(s) are "
                            f"visible: --nproc_per_node must not exceed the GPUs of one machine")
        device = torch.device("cuda", ddp_local_rank)
        # set_device first, or every process creates its CUDA context (and NCCL its buffers) on GPU 0; device_id
        # binds the NCCL communicator to this GPU now instead of guessing later
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=device)
    elif ddp:  # gloo runs the same collectives on CPU: every distributed code path runs (and is tested) without GPUs
        device = torch.device("cpu")
        dist.init_process_group(backend="gloo")
    else:
        device = torch.device(device_type)
    # No barrier needed: _print_topology's all_gather is itself a collective every rank must reach
    _print_topology(ddp, ddp_rank, ddp_local_rank, ddp_world_size, device)
    return ddp, ddp_rank, ddp_local_rank, ddp_world_size, device


def _print_topology(ddp, rank, local_rank, world_size, device):
    rows = gather_from_ranks((rank, local_rank, world_size, str(device), socket.gethostname()))
    header = ("rank", "local_rank", "world_size", "device", "host")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    print0(f"Compute: ddp={ddp}, {world_size} process(es), one per device; rank 0 is the master process")
    print0("\n".join(fmt.format(*r) for r in [header, *rows]))


def compute_cleanup():
    """End of a script: tear down the process group, so every rank exits cleanly."""
    if is_distributed():
        # every rank done with its last collective before any tears its end down (gloo's connections, NCCL's
        # communicator): a rank that left early would leave another's running collective without a peer (fail or hang)
        dist.barrier()
        dist.destroy_process_group()
