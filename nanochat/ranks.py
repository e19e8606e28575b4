"""
Ranks agreeing: the collectives by which the processes of a torchrun launch agree, the same calls in one process.

  is_distributed      whether there are other ranks (compute_init set up a process group): asked before a
                      collective of one's own (the sharded optimizers, a checkpoint's shards, rank 0's decisions)
  any_rank            flags True on every rank if True on any: a stop request, data that ran out on one rank
  sum_over_ranks      numbers summed over the ranks (rewards, token counts), on every rank
  per_rank            one number of each rank, on every rank (each rank's loss)
  gather_from_ranks   small picklable things of each rank, on every rank (the table of ranks, each loader's state)

Every rank makes the same calls in the same order: a rank that skipped one would leave the others waiting in it. In
one process (plain `python`, or before compute_init) each returns what this process has, without communicating.
Importing this module touches no RNG, no process group and no logger.
"""

import torch
import torch.distributed as dist


def is_distributed():
    """True under torchrun once compute_init has set up the process group: there are other ranks."""
    return dist.is_available() and dist.is_initialized()


def gather_from_ranks(obj):
    """[obj of rank 0, obj of rank 1, ...] on every rank, for small picklable things; [obj] in one process."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def any_rank(*flags):
    """
    Each flag True on every rank if it is True on ANY rank (one all_reduce): a rank that stopped alone (a signal
    that reached it only, its data ran out first) would leave the others waiting in their next collective.
    """
    return tuple(v > 0 for v in _reduced([float(bool(f)) for f in flags], dist.ReduceOp.MAX))


def per_rank(value):
    """[value of rank 0, value of rank 1, ...] on every rank, for one number (a rank's loss, its token count)."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)
    return _reduced([float(value) if r == rank else 0.0 for r in range(world_size)])


def sum_over_ranks(*values):
    """The sum over all ranks of each number, on every rank (one all_reduce)."""
    return tuple(_reduced([float(v) for v in values]))


def _reduced(values, op=dist.ReduceOp.SUM):
    """The floats `values` reduced over the ranks, in float64 (as they are in one process)."""
    t = torch.tensor(values, dtype=torch.float64)
    if is_distributed():  # NCCL moves CUDA tensors only; gloo CPU tensors
        t = t.to(torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, op=op)
    return t.tolist()
