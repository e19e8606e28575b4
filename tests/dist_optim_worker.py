"""
The distributed optimizers against one process, for tests/test_optim.py; runs under torchrun on CPU (gloo):

    python -m torch.distributed.run --standalone --nproc_per_node=W tests/dist_optim_worker.py OUT_DIR

Every rank writes OUT_DIR/rank{r}.pt with the results of two scenarios; the test process asserts on them.

1. "main": DistMuon + DistAdamW for 5 steps on gradients that differ per rank, with lr and momentum
   changed between steps, next to Muon + AdamW (nanochat's one-process optimizers) in this same process fed
   the rank-averaged gradients (every rank can compute every rank's gradients: they come from seeded generators).
   Saved: both final parameter sets, which Muon matrices this rank holds momentum for, and this rank's
   optimizer state next to the reference's.
2. "resume": 2 steps, optimizer_shard() -> torch.save (one file per rank) -> fresh optimizers ->
   load_optimizer_shards(every rank's file) -> 2 more steps, next to 4 uninterrupted steps; the same
   resumed in one process (Muon + AdamW), and from one process's checkpoint into W ranks. A missing
   rank file must raise UserError.
Newton-Schulz runs in the compute dtype ($NANOCHAT_DTYPE: the test runs the worker in fp32 and in bf16).
"""

import os
import sys

import torch
import torch.distributed as dist

from nanochat.adamw import AdamW, DistAdamW
from nanochat.checkpoint_manager import load_optimizer_shards, optimizer_shard
from nanochat.hardware import autocast_dtype
from nanochat.muon import DistMuon, Muon
from nanochat.output import UserError

# Muon matrices. Shape groups of 5, 2, 1 and 3 matrices: 5 and 1 divide by neither 2 nor 3, 2 does not
# divide by 3, 3 does not divide by 2, so the padded last block is exercised for both world sizes.
# (24, 8) is tall: its lr is scaled by sqrt(3).
MUON_SHAPES = [(16, 8)] * 3 + [(8, 32), (24, 8)] + [(16, 8)] * 2 + [(12, 12)] * 3 + [(8, 32)]
# AdamW parameters, two groups with different lr / weight decay: 10 rows (not divisible by 3), 7 rows
# (divisible by neither), 12 rows (divisible by both); a 1-D parameter with 1 entry (fewer than the
# ranks), a 1-D one with 5 entries, a 0-d scalar.
ADAMW_SHAPES = [[(10, 6), (7, 6), (12, 4)], [(1,), (5,), ()]]
ADAMW_GROUPS = [dict(lr=0.01, weight_decay=0.1), dict(lr=0.05, weight_decay=0.0)]
BETAS = (0.8, 0.95)
EPS = 1e-8
MUON_LR = 0.02


def lr_multiplier(step):
    return [1.0, 0.5, 2.0, 0.25, 1.0][step]


def muon_momentum(step):
    return 0.85 + 0.025 * step


def make_params():
    """The same initial parameters on every rank (fixed seed)."""
    gen = torch.Generator().manual_seed(1234)
    muon = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in MUON_SHAPES]
    adamw = [[torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes] for shapes in ADAMW_SHAPES]
    return muon, adamw


def clone_params(muon, adamw):
    return ([torch.nn.Parameter(p.detach().clone()) for p in muon],
            [[torch.nn.Parameter(p.detach().clone()) for p in ps] for ps in adamw])


def local_grad(shape, step, rank, index):
    """
    This rank's gradient of parameter `index` at `step`. Multiples of 1/64 of moderate size: sums of
    them are exact in fp32 in any order, so the all-rank average is bit-identical however the collective
    adds them up, and the comparison with the single-process reference can be tight.
    """
    gen = torch.Generator().manual_seed(100_000 * step + 1000 * rank + index)
    return torch.round(torch.randn(shape, generator=gen) * 64) / 64


def set_grads(params, step, ranks, world_size):
    """p.grad = average over `ranks` of local_grad (ranks = [rank] for the distributed optimizers)."""
    for index, p in enumerate(params):
        total = sum(local_grad(p.shape, step, r, index) for r in ranks)
        p.grad = total / world_size if len(ranks) > 1 else total


def build(muon, adamw, distributed):
    groups = [dict(params=ps, initial_lr=g["lr"], **g) for ps, g in zip(adamw, ADAMW_GROUPS)]
    if distributed:
        return DistMuon(muon, lr=MUON_LR, ns_dtype=autocast_dtype("cpu")), DistAdamW(groups, betas=BETAS, eps=EPS)
    return Muon(muon, lr=MUON_LR, ns_dtype=autocast_dtype("cpu")), AdamW(groups, betas=BETAS, eps=EPS)


def run_steps(opt_muon, opt_adamw, muon, adamw, steps, ranks, world_size):
    flat_adamw = [p for ps in adamw for p in ps]
    for group in opt_muon.param_groups:
        group.setdefault("initial_lr", group["lr"])
    for step in steps:
        for group in opt_muon.param_groups + opt_adamw.param_groups:
            group["lr"] = group["initial_lr"] * lr_multiplier(step)
        for group in opt_muon.param_groups:
            group["momentum"] = muon_momentum(step)
        set_grads(muon, step, ranks, world_size)
        set_grads(flat_adamw, 10 + step, ranks, world_size)
        opt_muon.step()
        opt_adamw.step()


def as_module(muon, adamw):
    """The parameters as a module, so that they have names (optimizer checkpoints key the state by name)."""
    module = torch.nn.Module()
    module.muon = torch.nn.ParameterList(muon)
    module.adamw = torch.nn.ParameterList([p for ps in adamw for p in ps])
    return module


def snapshot(muon, adamw):
    return [p.detach().clone() for p in muon] + [p.detach().clone() for ps in adamw for p in ps]


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    all_ranks = list(range(world_size))
    result = {"world_size": world_size, "compute_dtype": str(autocast_dtype("cpu")).removeprefix("torch.")}

    # 1. distributed vs single-process reference, 5 steps
    muon, adamw = make_params()
    result["initial"] = snapshot(muon, adamw)
    ref_muon, ref_adamw = clone_params(muon, adamw)
    dist_muon_opt, dist_adamw_opt = build(muon, adamw, distributed=True)
    ref_muon_opt, ref_adamw_opt = build(ref_muon, ref_adamw, distributed=False)
    run_steps(dist_muon_opt, dist_adamw_opt, muon, adamw, range(5), [rank], world_size)
    run_steps(ref_muon_opt, ref_adamw_opt, ref_muon, ref_adamw, range(5), all_ranks, world_size)
    result["dist"] = snapshot(muon, adamw)
    result["ref"] = snapshot(ref_muon, ref_adamw)
    # the optimizer state this rank holds, next to the reference's (Muon's update does not depend on the
    # scale of the gradient, so only the state shows that the gradient was averaged rather than summed)
    position = {}  # index of each matrix within its shape group, in the order given
    result["muon_position"] = []
    for p in muon:
        position[p.shape] = position.get(p.shape, -1) + 1
        result["muon_position"].append(position[p.shape])
    result["muon_buffers"] = [dist_muon_opt.state[p]["momentum_buffer"].clone() if p in dist_muon_opt.state else None
                              for p in muon]
    result["ref_muon_buffers"] = [ref_muon_opt.state[p]["momentum_buffer"].clone() for p in ref_muon]
    flat_adamw = [p for ps in adamw for p in ps]
    flat_ref_adamw = [p for ps in ref_adamw for p in ps]
    result["adamw_state"] = [{k: v.clone() for k, v in dist_adamw_opt.state[p].items() if isinstance(v, torch.Tensor)}
                             for p in flat_adamw]
    result["ref_adamw_state"] = [{k: ref_adamw_opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")}
                                 for p in flat_ref_adamw]

    # 2. checkpoint round trips (nanochat.checkpoint_manager): 2 steps + save + load + 2 steps == 4 uninterrupted steps,
    #    resuming on the same world size, in one process (Muon + AdamW), and from one process into W ranks
    muon, adamw = make_params()
    opt_m, opt_a = build(muon, adamw, distributed=True)
    run_steps(opt_m, opt_a, muon, adamw, range(2), [rank], world_size)
    torch.save(optimizer_shard([opt_m, opt_a], as_module(muon, adamw)), os.path.join(out_dir, f"shard_rank{rank}.pt"))
    dist.barrier()  # every rank has written its file
    shards = [torch.load(os.path.join(out_dir, f"shard_rank{r}.pt"), mmap=True) for r in all_ranks]

    muon, adamw = clone_params(muon, adamw)  # "load the model checkpoint": same values, new tensors
    single_muon, single_adamw = clone_params(muon, adamw)
    opt_m, opt_a = build(muon, adamw, distributed=True)
    load_optimizer_shards([opt_m, opt_a], as_module(muon, adamw), shards)
    run_steps(opt_m, opt_a, muon, adamw, range(2, 4), [rank], world_size)
    result["resumed"] = snapshot(muon, adamw)

    opt_m, opt_a = build(single_muon, single_adamw, distributed=False)
    load_optimizer_shards([opt_m, opt_a], as_module(single_muon, single_adamw), shards)
    run_steps(opt_m, opt_a, single_muon, single_adamw, range(2, 4), all_ranks, world_size)
    result["resumed_in_one_process"] = snapshot(single_muon, single_adamw)

    muon, adamw = make_params()  # one process for 2 steps, then W ranks
    opt_m, opt_a = build(muon, adamw, distributed=False)
    run_steps(opt_m, opt_a, muon, adamw, range(2), all_ranks, world_size)
    one_process_shard = optimizer_shard([opt_m, opt_a], as_module(muon, adamw))
    muon, adamw = clone_params(muon, adamw)
    opt_m, opt_a = build(muon, adamw, distributed=True)
    load_optimizer_shards([opt_m, opt_a], as_module(muon, adamw), [one_process_shard])
    run_steps(opt_m, opt_a, muon, adamw, range(2, 4), [rank], world_size)
    result["resumed_from_one_process"] = snapshot(muon, adamw)

    muon, adamw = make_params()
    opt_m, opt_a = build(muon, adamw, distributed=True)
    run_steps(opt_m, opt_a, muon, adamw, range(4), [rank], world_size)
    result["uninterrupted"] = snapshot(muon, adamw)

    # a missing rank file is an error, never silently zero state
    muon, adamw = clone_params(muon, adamw)
    opt_m, opt_a = build(muon, adamw, distributed=True)
    try:
        load_optimizer_shards([opt_m, opt_a], as_module(muon, adamw), shards[:-1])
        result["missing_shard_error"] = None
    except UserError as e:
        result["missing_shard_error"] = str(e)

    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
