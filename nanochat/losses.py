"""
The losses: the training loss, the supervised and policy-gradient losses, and bits per byte.

The training loss over the vocabulary on a CPU (softcapped_cross_entropy), the supervised loss of the conversation
stages (normalised over a whole step), the policy-gradient loss of RL, and bits per byte, the validation metric.
Why each is computed the way it is (and the derivation of the CPU loss's backward): docs/losses.md.

Invariants: the supervised and policy-gradient losses give the gradient of the mean over every counted token of
the step, however the step is split into micro-batches and ranks; bpb = sum of the target tokens' losses (nats) /
(ln 2 * their UTF-8 bytes), special and ignored targets in neither sum, all ranks' data on every rank.
"""

import math

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from nanochat.interrupt import Interrupted, interruptible
from nanochat.ranks import any_rank, is_distributed, per_rank


class _SoftcappedCrossEntropy(torch.autograd.Function):
    """
    x (rows, C), the head's weight (vocab, C), targets (rows,), every one >= 0 -> per-row loss (rows,) in fp32 of
    cap * tanh(x @ weight^T / cap). With want_grad the forward also finds d loss / d (z / cap) for every logit,
    a piece of rows at a time while the piece is in cache, and keeps it in the matmul's output; the backward is then
    two matmuls (docs/losses.md).
    """

    PIECE = 2**16  # logits per piece: ~256 KiB per fp32 temporary (three of them), within a core's L2 cache

    @staticmethod
    def forward(ctx, x, weight, targets, cap, want_grad):
        w = weight.to(x.dtype)  # what autocast does for a matmul: the head in the compute dtype
        # 2z / cap in the matmul itself: cap * tanh(z / cap) = cap * (2 sigmoid(2z / cap) - 1), and a CPU runs
        # torch's sigmoid ~5x as fast as its tanh (docs/losses.md)
        u = torch.addmm(x.new_zeros(()), x, w.t(), beta=0, alpha=2 / cap)
        loss = torch.empty(u.size(0), dtype=torch.float32, device=u.device)
        cap_tensor = torch.tensor(cap, dtype=torch.float32, device=u.device)
        rows = max(1, _SoftcappedCrossEntropy.PIECE // u.size(1))
        for r in range(0, u.size(0), rows):
            piece, index = u[r:r + rows], targets[r:r + rows, None]
            logits = torch.sigmoid(piece.float()).mul_(2 * cap).sub_(cap)  # fp32 even when u is bf16
            e = torch.exp(logits)
            row_sum = e.sum(dim=-1)
            loss[r:r + rows] = row_sum.log() - logits.gather(1, index).squeeze(1)
            if want_grad:  # d loss / d (z / cap) = (softmax - onehot(target)) * (cap^2 - L^2) / cap, over u's memory
                p = e.mul_((1 / row_sum)[:, None])
                p.scatter_add_(1, index, p.new_full(index.shape, -1.0))
                piece.copy_(p.mul_(torch.addcmul(cap_tensor, logits, logits, value=-1 / cap)))
        if want_grad:
            ctx.save_for_backward(x, w, u)
            ctx.cap = cap
            ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        x, w, g = ctx.saved_tensors
        upstream = grad_loss.float()
        # a sum or a mean: one factor, which goes into the matmuls' alpha
        if upstream.numel() and bool((upstream == upstream[0]).all()):
            scaled, alpha = g, upstream[0].item() / ctx.cap
        else:  # a weight per row (RL's advantages)
            scaled, alpha = (g * upstream[:, None]).to(g.dtype), 1 / ctx.cap
        grad_x = torch.addmm(g.new_zeros(()), scaled, w, beta=0, alpha=alpha) if ctx.needs_input_grad[0] else None
        grad_w = (torch.addmm(g.new_zeros(()), scaled.t(), x, beta=0, alpha=alpha).to(ctx.weight_dtype)
                  if ctx.needs_input_grad[1] else None)
        return grad_x, grad_w, None, None, None


def softcapped_cross_entropy(x, weight, targets, cap):
    """Per-row cross-entropy (rows,) of cap * tanh(x @ weight^T / cap) against targets (rows,), 0 where -1."""
    keep = (targets >= 0).nonzero().squeeze(1)
    if keep.numel() < targets.numel():
        # the head only where there is a target: in chat data (the assistant's tokens) about half of the rows
        loss = softcapped_cross_entropy(x.index_select(0, keep), weight, targets.index_select(0, keep), cap)
        return loss.new_zeros(targets.shape).index_copy(0, keep, loss)
    if torch.is_autocast_enabled(x.device.type):  # the head's matmul in the compute dtype, as autocast would run it
        x = x.to(torch.get_autocast_dtype(x.device.type))
    want_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return _SoftcappedCrossEntropy.apply(x, weight, targets, cap, want_grad)


LOGITS_CHUNK_ELEMENTS = 2**27  # above this many logits (512 MiB in fp32) the loss is computed in chunks of rows


def next_token_loss(per_token_loss, x, targets, vocab_size, reduction="mean"):
    """
    GPT.forward's loss: x (B, T, C) the final hidden states, targets (B, T) (-1 = ignore), per_token_loss(x rows,
    their targets) -> (rows,) the model's loss per row. Above LOGITS_CHUNK_ELEMENTS logits in checkpointed chunks of
    rows (all the logits at once would be training's biggest tensors: docs/model.md). reduction "mean" over the
    counted targets (all masked, possible in chat data, gives 0, not 0/0), "sum", or "none" ((B*T,), 0 where ignored).
    """
    flat_x = x.view(-1, x.size(-1))
    flat_targets = targets.reshape(-1)
    rows = max(1, LOGITS_CHUNK_ELEMENTS // vocab_size)
    if flat_x.size(0) <= rows:
        per_token = per_token_loss(flat_x, flat_targets)
    else:
        loss_of = ((lambda xc, tc: checkpoint(per_token_loss, xc, tc, use_reentrant=False)) if torch.is_grad_enabled()
                   else per_token_loss)
        per_token = torch.cat([loss_of(xc, tc) for xc, tc in zip(flat_x.split(rows), flat_targets.split(rows))])
    if reduction == "none":
        return per_token
    return per_token.sum() if reduction == "sum" else per_token.sum() / (flat_targets != -1).sum().clamp(min=1)


@torch.no_grad()
def evaluate_bpb(model, batches, steps, token_bytes, stop=None):
    """
    model(x, y, loss_reduction="none") -> per-token loss; `batches` yields (x, y); `steps` batches per rank;
    token_bytes: (vocab,) tensor of bytes per token id, on the model's device. Returns a float.
    stop: asked before every batch (a stage's StopRequest); when it says so, Interrupted on every rank.
    A split smaller than `steps` batches (a corpus of your own) is counted once, not again and again: when `batches`
    is the pretraining loader, the evaluation ends when it has started reading its split again on every rank.
    Every rank makes the same collectives whenever it stops: a rank's Interrupted is held to the end of its batches
    (interrupt.interruptible: one any_rank there); with the pretraining loader, whose batches each end in an any_rank,
    the stop joins that one, so that every rank leaves at the same batch (a rank that left alone would meet the
    others' next batch with interruptible's any_rank, and leave them waiting in the one after for ever).
    """
    device = token_bytes.device
    acc_dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    total_nats = torch.zeros((), dtype=acc_dtype, device=device)
    total_bytes = torch.zeros((), dtype=torch.int64, device=device)
    batch_iter = iter(batches)
    pooled = hasattr(batches, "epoch")  # the pretraining loader: whether every rank read its split once, per batch
    with interruptible():
        for _ in range(steps):
            stopped = stop is not None and stop()
            if stopped and not pooled:
                raise Interrupted
            if not stopped:
                x, y = next(batch_iter)
                loss = model(x, y, loss_reduction="none").view(-1)
                y = y.view(-1)
                valid = y >= 0
                num_bytes = torch.where(valid, token_bytes[torch.where(valid, y, 0)], 0)
                total_nats += (loss * (num_bytes > 0)).sum().to(acc_dtype)
                total_bytes += num_bytes.sum()
            if pooled:
                first_pass, stopped = any_rank(batches.epoch == 0, stopped)
                if stopped:
                    raise Interrupted
                if not first_pass:
                    break
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
    supervised target (step_targets == 0) gives zero loss and zero gradient; mid_train and chat_sft skip its update.
    """
    loss_sum = model(x, y, loss_reduction="sum")
    return loss_sum * (ddp_world_size / max(step_targets, 1)), loss_sum.detach()


def smoothed_loss(ema, loss, updates, beta=0.9):
    """
    (the new EMA of a logged loss, its debiased value) after its `updates`-th update (>= 1): ema = beta * ema +
    (1 - beta) * loss, started at 0; dividing by 1 - beta**updates removes the pull toward that 0 of the first
    updates (Adam's bias correction). `updates` counts the losses averaged in, not the steps: a step with no loss to
    average (a step of mid_train or chat_sft without a supervised target) leaves the EMA and the count as they are.
    """
    ema = beta * ema + (1 - beta) * loss
    return ema, ema / (1 - beta ** updates)


def logged_step_loss(loop, train_loss, step_targets, world_size):
    """
    What a supervised step of mid_train or chat_sft logs: (its EMA loss debiased, its loss, the step line's loss
    text). A step without a supervised target on any rank has no loss: it stays out of the EMA (loop.ema_updates
    counts the losses averaged in), is counted in loop.steps_without_targets, and logs None for both losses.
    """
    if step_targets == 0:
        loop.steps_without_targets += 1
        return None, None, "no targets: update skipped"
    loop.ema_updates += 1
    loop.smooth_train_loss, debiased = smoothed_loss(loop.smooth_train_loss, train_loss, loop.ema_updates)
    text = (f"loss (EMA): {debiased:.6f} | step loss ({step_targets:,.0f} targets, {world_size} rank(s)): "
            f"{train_loss:.6f}")
    return debiased, train_loss, text


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
