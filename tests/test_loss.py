"""
The supervised loss of the conversation stages (nanochat/losses.py): normalised by the supervised targets of
the whole step, so the gradient is the mean over every supervised token whatever the split into micro-batches
and ranks. Hand-computed on a toy model whose per-token losses are known exactly.
"""

import os

import pytest
import torch

from helpers import REPO_ROOT, run_script, step_micro_batches, ToyModel
from nanochat.losses import count_step_targets, supervised_loss


def one_process(batches):
    model = ToyModel()
    per_rank, total = count_step_targets(batches, 0, 1)
    logged = 0.0
    for x, y in batches:
        loss, loss_sum = supervised_loss(model, x, y, total, 1)
        loss.backward()
        logged += loss_sum.item()
    return model.w.grad.item(), per_rank, total, logged


def test_hand_computed_loss_and_gradient_with_uneven_masks():
    a, b, c = step_micro_batches()
    grad, per_rank, total, logged = one_process([a, b])
    assert per_rank == [4.0] and total == 4.0
    assert grad == pytest.approx(5.0)  # (1 + 2 + 3 + 14) / 4, not (2 + 14) / 2 = 8
    assert logged / total == pytest.approx(5.0)  # the logged step loss: the mean over the 4 targets (w = 1)


def test_a_fully_masked_micro_batch_changes_nothing():
    a, b, c = step_micro_batches()
    assert one_process([a, b, c])[0] == pytest.approx(one_process([a, b])[0])
    assert one_process([c, a, b])[0] == pytest.approx(5.0)
    grad, _, total, _ = one_process([c])  # a step without any target: zero loss, zero gradient, no division by 0
    assert total == 0 and grad == 0.0


def test_three_ranks_equal_one_rank_with_accumulation(tmp_path):
    """1 rank x accumulation 3 == 3 ranks x accumulation 1 (rank r gets micro-batch r, C being fully masked)."""
    grad, _, total, logged = one_process(step_micro_batches())
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.path.join(REPO_ROOT, "tests"), os.environ.get("PYTHONPATH")]))}
    result = run_script("tests/dist_loss_worker.py", tmp_path, nproc=3, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    for r, res in enumerate(ranks):
        assert res["per_rank"] == [3.0, 1.0, 0.0] and res["total"] == total == 4.0
        assert res["grads"][0].item() == pytest.approx(grad)  # every rank holds the same averaged gradient: 5
    assert sum(res["loss_sum"] for res in ranks) / total == pytest.approx(logged / total)
