"""
A validation stopped on one rank only, for tests/test_loss.py; runs under torchrun (CPU, gloo), 2 ranks.

evaluate_bpb over a loader that, like the pretraining one, has an `epoch` (so every batch ends in an any_rank), with
a stop request that rank 1 sees from its 3rd batch and rank 0 never sees (as when the signal reached rank 1 alone
and its note in the store has not reached rank 0 yet). Every rank must raise Interrupted at the same batch; each
writes what it raised, and how many batches it read, to OUT_DIR/rank{r}.txt. A rank left waiting hangs the run.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import ToyModel  # noqa: E402

from nanochat.interrupt import Interrupted
from nanochat.losses import evaluate_bpb


class Loader:
    """Batches of one row (x, y) forever, counting them; epoch 0 throughout (its split is never read through)."""

    def __init__(self):
        self.epoch = 0
        self.read = 0

    def __iter__(self):
        while True:
            self.read += 1
            yield torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long)


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = Loader()
    stop = (lambda: loader.read >= 2) if rank == 1 else (lambda: False)
    try:
        evaluate_bpb(ToyModel(), loader, 1000, torch.ones(8, dtype=torch.long), stop=stop)
        outcome = "finished"
    except Interrupted:
        outcome = "interrupted"
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{outcome} {loader.read}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
