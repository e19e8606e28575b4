"""Run under torchrun by tests/test_common.py: compute_init, check the ranks, exchange them over the process group."""

import json
import sys

import torch
import torch.distributed as dist

from nanochat.hardware import compute_dtype
from nanochat.processes import compute_cleanup, compute_init

ddp, rank, local_rank, world_size, device = compute_init("cpu")
# every rank contributes its rank: the sum proves the gloo process group really connects them
t = torch.tensor([float(rank)])
dist.all_reduce(t)
# same seed on every rank -> the same "initial weights" everywhere
w = torch.randn(4)
gathered = [torch.zeros(4) for _ in range(world_size)]
dist.all_gather(gathered, w)
same_init = all(torch.equal(g, gathered[0]) for g in gathered)
with open(f"{sys.argv[1]}.rank{rank}.json", "w") as f:
    json.dump(dict(ddp=ddp, rank=rank, local_rank=local_rank, world_size=world_size, device=str(device),
                   backend=dist.get_backend(), rank_sum=t.item(), same_init=same_init,
                   compute_dtype=[str(compute_dtype("cpu")[0]), compute_dtype("cpu")[1]]), f)
compute_cleanup()
