"""
The update of a training step: ZeRO-2 sharding, gradient clipping, the learning-rate and momentum schedules.

step_optimizers runs it: what Muon and AdamW share, ZeRO-2 sharding across ranks and gradient clipping; the
schedules of the learning rate and of Muon's momentum; the weight decay by depth.

Under torchrun every rank holds the whole model and computes a full gradient on its own micro-batches; only the
optimizer is sharded (its state and the update's arithmetic): reduce_scatter the gradients (each rank receives the
rank-averaged gradient of the part it owns), update the owned part, all_gather the updated parts. Gradients are
averaged in clip_grad_norm_ when clipping is on, else in optimizer.step(); losses are never summed across ranks.
So gradients cross ranks once per step, not at each micro-step (nothing to skip: no no_sync()), and the model has no
DistributedDataParallel wrapper: DDP would all_reduce every gradient in the backward (as many bytes as the
reduce_scatter and the all_gather together) to give every rank the whole averaged gradient, of which each rank here
updates only its own part. How and why: docs/optimizers.md. The optimizer state's checkpoint format:
nanochat/checkpoint_manager.py.
"""

import torch
import torch.distributed as dist

# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single (the old names still
# work but warn); older torch (>= 2.8 is supported) only has the old names.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def zero_pad_rows(t, rows):
    """
    t itself if it already has `rows` rows and is contiguous, else a contiguous copy zero-padded along dim 0 to `rows`:
    DistAdamW shards every parameter by rows, and its collectives want the same number of rows on every rank.
    """
    if t.size(0) == rows and t.is_contiguous():
        return t
    padded = t.new_zeros((rows, *t.shape[1:]))
    padded[:t.size(0)] = t
    return padded


class ShardedGradients:
    """
    The gradient-averaging half of DistAdamW and DistMuon, in phases, so that clipping sees the averaged gradient
    before the update: reduce_gradients() (issue the async reduce_scatters; step() does it if not done yet),
    owned_gradient_rows(), scale_gradients(scale), then step() (update the owned parts, all_gather the weights).
    A subclass implements _launch_reduce_scatters() -> [{"grad": the owned piece, "work": its async handle, ...}],
    _owned_rows(entry) -> (parameter, first row, averaged rows) or None, and owned_state / load_owned_state.
    """

    _pending = None

    def reduce_gradients(self):
        # the step's one exchange of gradients between ranks, after all its micro-steps' backwards (the top says why)
        if self._pending is None:
            self._pending = self._launch_reduce_scatters()

    def _averaged(self, entry):
        """The owned gradient piece of `entry`, once its reduce_scatter finished, turned from sum to mean (once)."""
        if not entry.get("averaged"):
            entry["work"].wait()
            entry["grad"].div_(dist.get_world_size())  # SUM -> average (ReduceOp.AVG is missing on older gloo)
            entry["averaged"] = True
        return entry["grad"]

    def owned_gradient_rows(self):
        """(parameter, first row, its rows of the averaged gradient) for every piece this rank owns."""
        self.reduce_gradients()
        pieces = [self._owned_rows(entry) for entry in self._pending]
        return [piece for piece in pieces if piece is not None]

    def scale_gradients(self, scale):
        """Multiply this rank's averaged gradient pieces by `scale` (the clip factor)."""
        self.reduce_gradients()
        for entry in self._pending:
            self._averaged(entry).mul_(scale)

    def _take_pending(self):
        self.reduce_gradients()
        pending, self._pending = self._pending, None
        return pending


def rows_of(t):
    """t as rows: a matrix as it is, a vector as rows of one entry, a scalar as one row."""
    return t.reshape(t.size(0) if t.ndim else 1, -1)


def clip_grad_norm_(optimizers, max_norm):
    """
    Clip the model's gradient to norm `max_norm` as torch's clip_grad_norm_ does (scale by min(1, max_norm /
    (norm + 1e-6))); returns the norm before clipping, a 0-d fp32 tensor, the same on every rank. The norm is the
    rank-averaged gradient's (Dist optimizers: their reduce_scatters start here), and the same to the last bit for
    one process and N ranks: each row's sum of squares gets its own slot, one all_reduce (docs/optimizers.md).
    """
    params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    first_row, total = {}, 0
    for p in params:  # the same parameters in the same order on every rank
        first_row[p] = total
        total += rows_of(p).size(0)
    row_sq = torch.zeros(total, dtype=torch.float32, device=params[0].device)
    distributed = all(hasattr(opt, "owned_gradient_rows") for opt in optimizers)
    if distributed:
        for opt in optimizers:
            opt.reduce_gradients()  # issue every optimizer's reduce_scatters before waiting on any of them
        pieces = [piece for opt in optimizers for piece in opt.owned_gradient_rows()]
    else:
        pieces = [(p, 0, rows_of(p.grad)) for p in params if p.grad is not None]
    for p, row, grad_rows in pieces:
        start = first_row[p] + row
        # each row's norm, squared: one pass over the gradient, with no full-size square in between
        row_sq[start:start + grad_rows.size(0)] = torch.linalg.vector_norm(grad_rows, dim=1,
                                                                           dtype=torch.float32).square_()
    if distributed:
        dist.all_reduce(row_sq)
    norm = row_sq.sum().sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    if distributed:
        for opt in optimizers:
            opt.scale_gradients(scale)
    # x 1 (the norm within max_norm) changes nothing: a CPU skips that pass over the gradient (a GPU would wait for
    # .item())
    elif params[0].device.type != "cpu" or scale.item() < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


# -----------------------------------------------------------------------------
# Schedules: one for every stage, each with its own defaults (warmup_ratio, warmdown_ratio, final_lr_frac).


def lr_multiplier(step, num_iterations, warmup_ratio=0.0, warmdown_ratio=0.2, final_lr_frac=0.0):
    """
    The learning-rate multiplier at `step` of `num_iterations` (or any other unit of progress, e.g. conversations
    read of an epoch's): linear warmup over the first round(warmup_ratio * num_iterations) steps (step 0 gets
    1/warmup; early gradients are noisy), 1 in the middle, then a linear warmdown over the last
    round(warmdown_ratio * num_iterations) steps to final_lr_frac at step == num_iterations (lowers the final loss).
    """
    warmup = round(warmup_ratio * num_iterations)
    warmdown = round(warmdown_ratio * num_iterations)
    if step < warmup:
        return (step + 1) / warmup
    if step <= num_iterations - warmdown:
        return 1.0
    progress = (num_iterations - step) / warmdown  # 1 at the start of the warmdown, 0 at the end
    return progress + (1 - progress) * final_lr_frac


def muon_momentum(step, warmup_steps=300, start=0.85, end=0.95, final=None, num_iterations=0, warmdown_ratio=0.0):
    """
    Muon's momentum at `step`: linear from `start` 0.85 to `end` 0.95 over the first `warmup_steps` 300, then `end`;
    with `final` (and num_iterations, warmdown_ratio), linear from `end` to `final` over the lr's warmdown.
    Why: a momentum of 0.95 averages the gradient over ~1/(1-0.95) = 20 steps, smooth but slow to react, which hurts
    while the weights still change fast at the start; 0.85 (~7 steps) reacts faster early, later the smoothing helps
    (and as the lr decays, a shorter memory lets the last steps settle). Every stage ramps it, not only pretraining:
    each stage builds new optimizers, whose momentum buffers start at zero.
    """
    frac = min(step / warmup_steps, 1.0)
    momentum = (1 - frac) * start + frac * end
    warmdown = round(warmdown_ratio * num_iterations)
    if final is not None and warmdown > 0 and step > num_iterations - warmdown:
        p = min((step - (num_iterations - warmdown)) / warmdown, 1.0)  # 0 at the warmdown's start, 1 at the end
        momentum = (1 - p) * momentum + p * final
    return momentum


# Weight decay by depth, (depth, decay) points, for base_train's "-1 = by depth". Both were measured here on pydocs at
# 16,384 tokens a step, where 2M tokens are ~3 epochs and a small model learns the repeated text by heart unless
# decayed (bench/RESULTS.md, "Quality at the acceptance size" and "AdamW's weight decay"). Fewer parameters on fewer
# tokens want more decay, as in karpathy/nanochat's own scaling of it by the horizon.
# Muon's cautious decay of the block matrices: d6 0.80, the best measured here (at 0.40 it memorized: "Quality at
# the acceptance size"); d8, d12, d20 what karpathy/nanochat measured best (its dev/LOG.md, fresh data at large
# batches).
MATRIX_WEIGHT_DECAY_BY_DEPTH = ((6, 0.80), (8, 0.40), (12, 0.22), (20, 0.08))
# AdamW's decay of the lookup tables and lm_head (in effect of wte and the value embeddings: lm_head's lr is 50x
# smaller): 0.20, the best measured here at d4 and d6 (the sweep: bench/RESULTS.md, "AdamW's weight decay"), kept
# to d8, the largest CPU size; none from d12, the GPU sizes that read fresh data once (karpathy/nanochat: 0.001-0.01,
# no sweep).
EMBEDDING_WEIGHT_DECAY_BY_DEPTH = ((8, 0.20), (12, 0.0))


def decay_by_depth(points, depth):
    """The decay `points` give at `depth`: linear between them, the nearest one outside."""
    if depth <= points[0][0]:
        return points[0][1]
    for (d0, w0), (d1, w1) in zip(points, points[1:]):
        if depth <= d1:
            return w0 + (w1 - w0) * (depth - d0) / (d1 - d0)
    return points[-1][1]


def scale_initial_lrs(optimizers, init_lr_frac):
    """Every group's lr and initial_lr times `init_lr_frac` (finetuning stages start below pretraining's rates)."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] = group["lr"] * init_lr_frac


def set_learning_rates(optimizers, multiplier, muon_momentum_now):
    """This step's learning rate of every group (initial_lr x multiplier), and Muon's momentum."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * multiplier
            if "momentum" in group:  # Muon's groups (AdamW's have betas instead)
                group["momentum"] = muon_momentum_now


def step_optimizers(optimizers, lrm, momentum, grad_clip):
    """
    The update of a training step, after its backward passes: the gradient clipped to global norm `grad_clip`
    (0 = no clipping), every group's lr set to initial_lr x `lrm` and Muon's momentum to `momentum`, every
    optimizer stepped (the ranks' gradients are averaged in the first of clip_grad_norm_ and opt.step(): see the
    top of this file), the gradients zeroed. Returns the norm before clipping (a float; None without clipping).
    """
    grad_norm = clip_grad_norm_(optimizers, grad_clip) if grad_clip > 0 else None
    set_learning_rates(optimizers, lrm, momentum)
    for opt in optimizers:
        opt.step()
    for opt in optimizers:  # the optimizers partition the parameters: this zeroes every gradient of the model
        opt.zero_grad(set_to_none=True)
    return grad_norm.item() if grad_norm is not None else None
