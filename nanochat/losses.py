"""
The losses: the training loss over the vocabulary on a CPU (softcapped_cross_entropy), the supervised loss of the
conversation stages (normalised over a whole step), the policy-gradient loss of RL, and bits per byte, the
validation metric. Why each is computed the way it is (and the derivation of the CPU loss's backward): docs/losses.md.

Invariants: the supervised and policy-gradient losses give the gradient of the mean over every counted token of
the step, however the step is split into micro-batches and ranks; bpb = sum of the target tokens' losses (nats) /
(ln 2 * their UTF-8 bytes), special and ignored targets in neither sum, all ranks' data on every rank.
"""

import math

import torch
import torch.distributed as dist

from nanochat.common import Interrupted, interruptible, is_distributed, per_rank


class _SoftcappedCrossEntropy(torch.autograd.Function):
    """u (rows, vocab) = z / cap, targets (rows,) with -1 = ignored -> per-row loss (rows,), 0 where ignored."""

    @staticmethod
    def forward(ctx, u, targets, cap):
        logits = torch.tanh(u.float()).mul_(cap)  # fp32 even when u is bf16
        e = torch.exp(logits)
        row_sum = e.sum(dim=-1)
        valid = targets >= 0
        index = targets.clamp(min=0)[:, None]  # ignored rows read column 0, then count 0
        loss = (row_sum.log() - logits.gather(1, index).squeeze(1)) * valid
        ctx.save_for_backward(logits, e, row_sum, index, valid)
        ctx.cap, ctx.u_dtype, ctx.used = cap, u.dtype, False
        return loss

    @staticmethod
    def backward(ctx, grad):
        if ctx.used:  # the backward overwrites e, so a second one (retain_graph=True) would be wrong
            raise RuntimeError("softcapped_cross_entropy: backward through the same loss twice is not supported")
        ctx.used = True
        logits, e, row_sum, index, valid = ctx.saved_tensors
        weight = (grad * valid / row_sum)[:, None]  # per row: upstream gradient, 0 if ignored, softmax's 1/sum
        g = e.mul_(weight)  # grad * softmax, in e's memory
        g.scatter_add_(1, index, -grad[:, None] * valid[:, None])  # - grad * onehot(target)
        g.mul_(torch.addcmul(torch.tensor(ctx.cap, dtype=logits.dtype), logits, logits, value=-1 / ctx.cap))
        return g.to(ctx.u_dtype), None, None


def softcapped_cross_entropy(x, weight, targets, cap):
    """Per-row cross-entropy (rows,) of cap * tanh(x @ weight^T / cap) against targets (rows,), 0 where -1."""
    keep = (targets >= 0).nonzero().squeeze(1)
    if keep.numel() < targets.numel():
        # the head only where there is a target: in chat data (the assistant's tokens) about half of the rows
        loss = softcapped_cross_entropy(x.index_select(0, keep), weight, targets.index_select(0, keep), cap)
        return loss.new_zeros(targets.shape).index_copy(0, keep, loss)
    u = torch.addmm(x.new_zeros(()), x, weight.t(), beta=0, alpha=1 / cap)  # z / cap in the matmul itself
    return _SoftcappedCrossEntropy.apply(u, targets, cap)


@torch.no_grad()
def evaluate_bpb(model, batches, steps, token_bytes, stop=None):
    """
    model(x, y, loss_reduction="none") -> per-token loss; `batches` yields (x, y); `steps` batches per rank;
    token_bytes: (vocab,) tensor of bytes per token id, on the model's device. Returns a float.
    stop: asked before every batch (a stage's StopRequest); when it says so, Interrupted on every rank.
    """
    device = token_bytes.device
    acc_dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    total_nats = torch.zeros((), dtype=acc_dtype, device=device)
    total_bytes = torch.zeros((), dtype=torch.int64, device=device)
    batch_iter = iter(batches)
    with interruptible():
        for _ in range(steps):
            if stop is not None and stop():
                raise Interrupted
            x, y = next(batch_iter)
            loss = model(x, y, loss_reduction="none").view(-1)
            y = y.view(-1)
            valid = y >= 0
            num_bytes = torch.where(valid, token_bytes[torch.where(valid, y, 0)], 0)
            total_nats += (loss * (num_bytes > 0)).sum().to(acc_dtype)
            total_bytes += num_bytes.sum()
    if is_distributed():
        dist.all_reduce(total_nats)
        dist.all_reduce(total_bytes)
    total_bytes = total_bytes.item()
    if total_bytes == 0:
        return float("inf")
    return total_nats.item() / (math.log(2) * total_bytes)


def count_step_targets(batches, ddp_rank, ddp_world_size):
    """
    The supervised targets (y != -1) of a step: returns (per_rank, total), per_rank[r] the targets of rank r's
    micro-batches `batches` (a list of (x, y)), total their sum over all ranks. One all_reduce (of world_size
    numbers) when distributed; every rank gets the same answer.
    """
    y0 = batches[0][1]
    counts = torch.zeros(ddp_world_size, dtype=torch.float32, device=y0.device)
    counts[ddp_rank] = sum((y != -1).sum() for _, y in batches).float()
    if ddp_world_size > 1:
        dist.all_reduce(counts)
    per_rank = counts.tolist()
    return per_rank, sum(per_rank)


def supervised_loss(model, x, y, step_targets, ddp_world_size):
    """
    This micro-batch's part of the step loss, ready for .backward(): the sum of its per-token losses (ignored
    targets count 0) times world_size / step_targets (the step's supervised targets over all micro-steps and
    ranks, from count_step_targets). Also returns the detached loss sum, for logging. A step without any
    supervised target (step_targets == 0) gives zero loss and zero gradient.
    """
    loss_sum = model(x, y, loss_reduction="sum")
    return loss_sum * (ddp_world_size / max(step_targets, 1)), loss_sum.detach()


def smoothed_loss(ema, loss, step, beta=0.9):
    """
    (the new EMA of a logged loss, its debiased value) after step `step` (>= 1): ema = beta * ema + (1 - beta) * loss,
    started at 0; dividing by 1 - beta**step removes the pull toward that 0 of the first steps (Adam's bias correction).
    """
    ema = beta * ema + (1 - beta) * loss
    return ema, ema / (1 - beta ** step)


def step_losses(loss_sum, rank_targets):
    """
    The loss of a supervised step, for logging, on every rank (one all_reduce): (the mean over every supervised
    target of the step, all ranks together; [the mean over each rank's own]), from this rank's summed token losses
    `loss_sum` (the supervised_loss sums of its micro-steps) and every rank's targets (count_step_targets).
    """
    rank_sums = per_rank(loss_sum.item())
    return sum(rank_sums) / max(sum(rank_targets), 1), [s / max(n, 1) for s, n in zip(rank_sums, rank_targets)]


def group_advantages(rewards):
    """Each reward minus the mean reward of its group (the answers to one prompt): a tensor like `rewards`."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    return rewards - rewards.mean()


def policy_gradient_loss(model, x, y, advantages, step_tokens, ddp_world_size):
    """
    This micro-batch's part of the step's policy-gradient loss, ready for .backward(): rows x (B, T) with
    targets y (-1 where the token was not sampled: prompt, forced tool output, padding) and one advantage per
    row; -sum over sampled tokens of advantage * log p(token), times world_size / step_tokens (the sampled
    tokens of the whole step, all micro-steps and ranks). Also returns the detached sum of log p, for logging.
    """
    logp = -model(x, y, loss_reduction="none").view(y.shape)  # log p of each target token, 0 where y == -1
    objective = (advantages.to(logp.device).view(-1, 1) * logp).sum()
    return -objective * (ddp_world_size / max(step_tokens, 1)), logp.detach().sum()
