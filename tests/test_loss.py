"""
Tests of the losses (nanochat/losses.py).

The supervised loss of the conversation stages: normalised by the supervised targets of the whole step, so the
gradient is the mean over every supervised token whatever the split into micro-batches and ranks; hand-computed on a
toy model whose per-token losses are known exactly. The training loss over the vocabulary on a CPU: against
F.cross_entropy of the softcapped logits in float64.
"""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from helpers import REPO_ROOT, run_script, step_micro_batches, ToyModel
from nanochat.gpt import SOFTCAP
from nanochat.losses import (count_step_targets, logged_step_loss, smoothed_loss, softcapped_cross_entropy,
                             supervised_loss)


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


def test_the_smoothed_loss_skips_steps_without_targets():
    """
    The chat stages' EMA of losses 4 and 2 with a step without targets between them, by hand: the empty step has no
    loss to average in and is no update, so the EMA after it is the EMA of 4 and 2, debiased by 2 updates. Averaged
    in as a loss of 0, it would pull the EMA down with nothing learned.
    """
    loop = SimpleNamespace(smooth_train_loss=0.0, ema_updates=0, steps_without_targets=0)
    debiased, loss, text = logged_step_loss(loop, 4.0, 10, 1)
    assert loop.smooth_train_loss == pytest.approx(0.4) and debiased == pytest.approx(4.0)  # the loss itself
    assert loss == 4.0 and text.startswith("loss (EMA): 4.000000 | step loss (10 targets, 1 rank(s))")
    assert logged_step_loss(loop, 0.0, 0, 1) == (None, None, "no targets: update skipped")
    assert loop.smooth_train_loss == pytest.approx(0.4) and loop.steps_without_targets == 1
    debiased, _, _ = logged_step_loss(loop, 2.0, 10, 1)  # the third step, the second update
    assert loop.ema_updates == 2 and debiased == pytest.approx(0.56 / 0.19)  # 2.947
    ema, debiased = smoothed_loss(0.4, 0.0, 2)  # the empty step averaged in: what the loop avoids
    assert debiased == pytest.approx(0.36 / 0.19)  # 1.895: down from 4 on no data


def test_a_validation_stopped_on_one_rank_stops_every_rank_at_the_same_batch(tmp_path):
    """
    With a loader that has an epoch (every batch ends in an any_rank), rank 1 sees a stop request from its 3rd batch
    and rank 0 never: both raise Interrupted after the same batch, none waits for ever (tests/dist_eval_worker.py).
    """
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.path.join(REPO_ROOT, "tests"),
                                                       os.environ.get("PYTHONPATH")]))}
    result = run_script("tests/dist_eval_worker.py", tmp_path, nproc=2, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["interrupted 3", "interrupted 2"]


def test_three_ranks_equal_one_rank_with_accumulation(tmp_path):
    """1 rank x accumulation 3 == 3 ranks x accumulation 1 (rank r gets micro-batch r, C being fully masked)."""
    grad, _, total, logged = one_process(step_micro_batches())
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.path.join(REPO_ROOT, "tests"),
                                                       os.environ.get("PYTHONPATH")]))}
    result = run_script("tests/dist_loss_worker.py", tmp_path, nproc=3, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    for r, res in enumerate(ranks):
        assert res["per_rank"] == [3.0, 1.0, 0.0] and res["total"] == total == 4.0
        assert res["grads"][0].item() == pytest.approx(grad)  # every rank holds the same averaged gradient: 5
    assert sum(res["loss_sum"] for res in ranks) / total == pytest.approx(logged / total)


@pytest.mark.parametrize("dtype, loss_tol, grad_tol", [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 0.05, 0.02)])
def test_cpu_loss_equals_the_softcapped_cross_entropy(dtype, loss_tol, grad_tol):
    """
    nanochat/losses.py (the CPU's training loss) against F.cross_entropy(15 tanh(z / 15)) in float64: the
    per-row losses, 0 at ignored rows, and the gradients of x and the head for an uneven upstream gradient. Under
    bf16 autocast the head's matmul is bf16 (errors of ~1% allowed), the rest fp32.
    """
    torch.manual_seed(0)
    x = torch.randn(48, 32, requires_grad=True)
    head = (torch.randn(300, 32) * 0.6).requires_grad_()  # logits of up to ~15: the softcap bends them
    targets = torch.randint(0, 300, (48,))
    targets[5:11] = -1
    upstream = torch.linspace(0.1, 2.0, 48)
    x64 = x.detach().double().requires_grad_()
    head64 = head.detach().double().requires_grad_()
    z = x64 @ head64.t()
    expected = F.cross_entropy(SOFTCAP * torch.tanh(z / SOFTCAP), targets, ignore_index=-1, reduction="none")
    (expected * upstream.double()).sum().backward()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = softcapped_cross_entropy(x, head, targets, SOFTCAP)
    assert loss.dtype == torch.float32 and torch.all(loss[5:11] == 0)
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=loss_tol, atol=loss_tol)
    (loss * upstream).sum().backward()
    for got, want in ((x.grad, x64.grad), (head.grad, head64.grad)):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < grad_tol
    first = x.grad.clone()
    x.grad = None
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = softcapped_cross_entropy(x, head, targets, SOFTCAP)
    (loss * upstream).sum().backward(retain_graph=True)  # the backward leaves what it kept as it was: a second one
    (loss * upstream).sum().backward()                  # adds the same gradient again
    torch.testing.assert_close(x.grad, 2 * first)


def test_cpu_loss_applies_the_head_to_the_rows_with_a_target_only():
    """
    The rows with a target give the same losses and gradients whether the ignored rows are there or not; the
    ignored rows hold NaN, which the head run on every row would spread to their losses (NaN * 0 is NaN) and to the
    head's gradient. With every row ignored, the loss and the gradients are zeros.
    """
    torch.manual_seed(0)
    kept = torch.arange(40) % 3 != 0
    x = torch.randn(40, 32).masked_fill(~kept[:, None], float("nan")).requires_grad_()
    head = (torch.randn(300, 32) * 0.6).requires_grad_()
    targets = torch.randint(0, 300, (40,))
    loss = softcapped_cross_entropy(x, head, torch.where(kept, targets, -1), SOFTCAP)
    loss.sum().backward()
    x_alone = x.detach()[kept].requires_grad_()
    head_alone = head.detach().clone().requires_grad_()
    alone = softcapped_cross_entropy(x_alone, head_alone, targets[kept], SOFTCAP)
    alone.sum().backward()
    torch.testing.assert_close(loss[kept], alone, rtol=1e-6, atol=1e-6)
    assert torch.all(loss[~kept] == 0) and torch.all(x.grad[~kept] == 0)
    torch.testing.assert_close(x.grad[kept], x_alone.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(head.grad, head_alone.grad, rtol=1e-5, atol=1e-6)
    x.grad = None
    head.grad = None
    nothing = softcapped_cross_entropy(x, head, torch.full((40,), -1), SOFTCAP)  # NaN rows too: none is read
    nothing.sum().backward()
    assert torch.all(nothing == 0) and torch.all(x.grad == 0) and torch.all(head.grad == 0)
