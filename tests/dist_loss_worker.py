"""
The chat loss's gradient on N ranks, for tests/test_loss.py; runs under torchrun (CPU, gloo).

Rank r takes micro-batch r of the same step the test computes in one process, runs count_step_targets +
supervised_loss, averages the gradient over ranks as the optimizers do (sum / world size), and writes its gradient
and logged numbers to OUT_DIR/rank{r}.pt.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import ToyModel, step_micro_batches  # noqa: E402

from nanochat.losses import count_step_targets, supervised_loss


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    model = ToyModel()
    batches = [step_micro_batches()[rank]]  # one micro-step per rank
    per_rank, total = count_step_targets(batches, rank, world_size)
    loss_sum_total = 0.0
    for x, y in batches:
        loss, loss_sum = supervised_loss(model, x, y, total, world_size)
        loss.backward()
        loss_sum_total += loss_sum.item()
    for p in model.parameters():  # what DistAdamW / DistMuon do: reduce_scatter(SUM), then / world_size
        dist.all_reduce(p.grad)
        p.grad /= world_size
    torch.save({"grads": [p.grad for p in model.parameters()], "per_rank": per_rank, "total": total,
                "loss_sum": loss_sum_total}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
