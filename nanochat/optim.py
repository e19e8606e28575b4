"""
What the optimizers share: ZeRO-2-style sharding (ShardedGradients, the base of DistAdamW in nanochat/adamw.py and
DistMuon in nanochat/muon.py), gradient clipping on the rank-averaged gradient (clip_grad_norm_), optimizer
checkpoints that any number of processes can resume from, and the learning-rate and momentum schedules.

ZeRO-2 style, for a newcomer
----------------------------
Under torchrun every rank (one process per GPU) holds the WHOLE model: all weights, in full, and after each
backward pass a full gradient computed on its own micro-batches. What is divided among the ranks is the
optimizer: its state (AdamW's two moments, Muon's momentum buffers) and the arithmetic of the update.
  1. reduce_scatter: the gradients of all ranks are summed, and each rank receives only the part it owns
     (divided by the world size: the average over ranks, i.e. the data-parallel gradient);
  2. each rank updates only the part it owns, with the optimizer state of only that part;
  3. all_gather: every rank receives every updated part, so all ranks again hold identical full weights.
So each rank stores ~1/W of the optimizer state and does ~1/W of the update work. The traffic is the same as
plain data parallelism (DDP's all_reduce of the gradients): a reduce_scatter plus an all_gather move as many
bytes as one all_reduce. "ZeRO-1" would shard only the state; "ZeRO-2" also leaves each rank only its own
part of the averaged gradient; "ZeRO-3" would shard the weights too (nanochat does not: every rank holds
them all). How a part is defined differs: DistAdamW cuts every parameter into W slices of rows; DistMuon
gives each whole matrix one owner rank, because Newton-Schulz needs the whole matrix.

Where the gradients are averaged across ranks: in the first of
  - clip_grad_norm_(optimizers, max_norm), when clipping is on: it starts the reduce_scatters, because the norm
    that counts is the norm of the averaged gradient;
  - optimizer.step(), when clipping is off.
Losses are never summed across ranks for the update; only gradients are averaged.

Checkpoints of the optimizer (optimizer_shard / load_optimizer_shards)
------------------------------------------------------------------------
Each rank saves what it holds, in a form that does not depend on the world size: for every parameter (by
its name in the model) the rows of the state tensors it holds and where they start. Loading reads the files
of every rank that saved, puts each parameter's state back together, and gives each optimizer of the new run
(any world size, or a single process with torch's AdamW and Muon) the part it owns. So a run trained on 8 GPUs
can continue on 4, or on one, with the same optimizer state.
"""

import torch
import torch.distributed as dist

from nanochat.common import UserError

# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single (the old names still
# work but warn); older torch (>= 2.8 is supported) only has the old names.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def pad_rows(t, rows):
    """t itself if it already has `rows` rows and is contiguous, else a contiguous copy zero-padded along dim 0 to `rows`."""
    if t.size(0) == rows and t.is_contiguous():
        return t
    padded = t.new_zeros((rows, *t.shape[1:]))
    padded[:t.size(0)] = t
    return padded


class ShardedGradients:
    """
    The part of DistAdamW and DistMuon that averages gradients across ranks (step 1 above). Split in phases,
    so that gradient clipping can look at the averaged gradient between averaging and updating:

        opt.reduce_gradients()            issue the async reduce_scatters (step() does it if you do not)
        opt.owned_gradient_rows()         the rows of the averaged gradient this rank owns (clipping
                                          adds up their squares)
        opt.scale_gradients(scale)        multiply this rank's averaged pieces (the clip factor)
        opt.step()                        update the owned parts, all_gather the weights

    A subclass implements _launch_reduce_scatters() -> list of dicts with at least "grad" (the owned piece
    being received) and "work" (the async handle), _owned_rows(entry) -> (parameter, first row, averaged rows)
    or None, plus owned_state(name_of) and load_owned_state(...) for checkpoints (see optimizer_shard /
    load_optimizer_shards below).
    """

    _pending = None

    def reduce_gradients(self):
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
    Clip the gradient of the whole model to norm `max_norm`; returns the norm before clipping (a 0-d tensor).
    Every rank then scales the gradient it will use by the same factor, min(1, max_norm / (norm + 1e-6)), as
    torch's clip_grad_norm_ does.

    The norm that matters is the norm of the gradient the optimizers will use: the average over all ranks. In
    one process that is every parameter's .grad. Under torchrun each rank's .grad holds only its own data's
    gradient, so the Dist optimizers first average the gradients (their reduce_scatters, started here), after
    which each rank holds the averaged gradient of its own share of the rows (nanochat/optim.py).

    How the squares are added up is the same for any number of ranks: every row of every parameter gets its own
    slot in one vector, each rank fills the slots of the rows it holds (one process: all of them), one all_reduce
    completes it (a slot is filled by one rank only: adding the others' zeros is exact), and the vector is summed.
    So one process and N ranks get the same norm to the last bit, and the same clipped gradient: the training
    does not depend on how it was placed (tests/test_base_train.py). A norm added up from each rank's partial sum
    would differ in its last bit, enough for bf16 to make the runs drift apart.
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
        row_sq[start:start + grad_rows.size(0)] = grad_rows.float().square().sum(dim=1)
    if distributed:
        dist.all_reduce(row_sq)
    norm = row_sq.sum().sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    if distributed:
        for opt in optimizers:
            opt.scale_gradients(scale)
    else:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


# -----------------------------------------------------------------------------
# Optimizer checkpoints that any world size can load
#
# The saved form, per optimizer: {parameter name: {"row_start": r, "step": t or None, key: tensor, ...}}
# where each tensor holds rows [r, r + len) of the full state tensor of that parameter (a 0-d parameter
# counts as one row). A rank that holds nothing of a parameter saves no entry for it. torch.optim.AdamW and
# Muon (one process) hold everything, from row 0; DistMuon holds whole matrices (those it owns); DistAdamW
# holds one slice of rows of every parameter.


def _rows_view(t):
    return t.view(1) if t.ndim == 0 else t


def _torch_adamw_owned_state(opt, name_of):
    out = {}
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p)
            if state:
                out[name_of[p]] = {"row_start": 0, "step": float(state["step"]),
                                   "exp_avg": _rows_view(state["exp_avg"]), "exp_avg_sq": _rows_view(state["exp_avg_sq"])}
    return out


def _torch_adamw_load_owned_state(opt, name_of, full_state):
    for group in opt.param_groups:
        for p in group["params"]:
            full = full_state(name_of[p])
            if full is None:
                continue
            # torch keeps the step count as a tensor: on the parameter's device for the fused and capturable
            # implementations, on the CPU otherwise (what its own first step would create)
            on_device = group.get("fused") or group.get("capturable")
            step = torch.tensor(full["step"], dtype=torch.float32, device=p.device if on_device else "cpu")
            opt.state[p] = {"step": step, "exp_avg": full["exp_avg"].view_as(p).to(p.device, p.dtype).clone(),
                            "exp_avg_sq": full["exp_avg_sq"].view_as(p).to(p.device, p.dtype).clone()}


def optimizer_shard(optimizers, model):
    """This rank's optimizer state in the world-size-free form above: one dict per optimizer, in order."""
    name_of = {p: n for n, p in model.named_parameters()}
    shard = []
    for opt in optimizers:
        if isinstance(opt, torch.optim.AdamW):
            shard.append(_torch_adamw_owned_state(opt, name_of))
        else:
            shard.append(opt.owned_state(name_of))
    return shard


def load_optimizer_shards(optimizers, model, shards, where="checkpoint"):
    """
    Load optimizer state saved by optimizer_shard() on any number of ranks: `shards` is the list of what every
    saving rank saved (loaded with mmap, so only the rows actually used are read). Each parameter's state is
    put back together from its pieces (one parameter at a time, to keep memory low) and each optimizer takes
    the part this rank owns. Raises UserError if a piece is missing or the parameters do not match.
    """
    name_of = {p: n for n, p in model.named_parameters()}
    if any(len(s) != len(optimizers) for s in shards):
        raise UserError(f"{where}: saved state of {len(shards[0])} optimizer(s), this run has {len(optimizers)}")
    for i, opt in enumerate(optimizers):
        pieces = {}  # name -> list of saved entries
        for shard in shards:
            for name, entry in shard[i].items():
                pieces.setdefault(name, []).append(entry)
        params = {name_of[p]: p for group in opt.param_groups for p in group["params"]}
        unknown = sorted(set(pieces) - set(params))
        if unknown:
            raise UserError(f"{where}: optimizer state for parameters this model's optimizer does not have: {', '.join(unknown[:3])}")

        def full_state(name):
            """The full state of parameter `name` ({"step", key: full tensor}), or None if it has none yet."""
            entries = pieces.get(name)
            if not entries:
                return None
            rows = _rows_view(params[name]).size(0)
            keys = [k for k in entries[0] if k not in ("row_start", "step")]
            full, covered = {"step": entries[0]["step"]}, torch.zeros(rows, dtype=torch.bool)
            for key in keys:
                ref = entries[0][key]
                full[key] = torch.zeros((rows, *ref.shape[1:]), dtype=ref.dtype)
            for entry in entries:
                start = entry["row_start"]
                n = entry[keys[0]].size(0) if keys else 0
                for key in keys:
                    full[key][start:start + n] = entry[key]
                covered[start:start + n] = True
            if not covered.all():
                raise UserError(f"{where}: optimizer state of {name} is incomplete ({int((~covered).sum())} of {rows} rows "
                                f"missing): a rank's optimizer file is missing or from another run")
            return full

        if isinstance(opt, torch.optim.AdamW):
            _torch_adamw_load_owned_state(opt, name_of, full_state)
        else:
            opt.load_owned_state(name_of, full_state)


# -----------------------------------------------------------------------------
# Schedules. Every stage uses the same schedule with its own defaults for its settings (warmup_ratio,
# warmdown_ratio, final_lr_frac): pretraining and midtraining decay over their last 20%, SFT and RL over the whole
# run (warmdown_ratio=1: a linear decay from the first step to final_lr_frac).


def lr_multiplier(step, num_iterations, warmup_ratio=0.0, warmdown_ratio=0.2, final_lr_frac=0.0):
    """
    Warmup, constant, warmdown ("trapezoid"), where the run is `num_iterations` steps long and `step` of them
    are done. A run of one epoch of data, whose number of steps is not known in advance, passes how far it is
    in another unit: conversations read so far out of the epoch's conversations.
    - warmup: the first round(warmup_ratio * num_iterations) steps ramp linearly up to 1 (step 0 gets
      1/warmup); early gradients are large and noisy, and Adam's moment estimates are not settled yet.
    - constant at 1 in the middle: most of the progress happens at the full learning rate.
    - warmdown: the last round(warmdown_ratio * num_iterations) steps decay linearly to final_lr_frac,
      reached at step == num_iterations. Annealing the noise away at the end lowers the final loss.
    """
    warmup = round(warmup_ratio * num_iterations)
    warmdown = round(warmdown_ratio * num_iterations)
    if step < warmup:
        return (step + 1) / warmup
    if step <= num_iterations - warmdown:
        return 1.0
    progress = (num_iterations - step) / warmdown  # 1 at the start of the warmdown, 0 at the end
    return progress + (1 - progress) * final_lr_frac


def muon_momentum(step, warmup_steps=300, start=0.85, end=0.95):
    """
    Muon's momentum ramps from 0.85 to 0.95 over the first 300 steps. A high momentum averages the
    gradient over ~1/(1-0.95) = 20 steps: smooth, but slow to react, which hurts while the weights are
    still changing fast at the start. 0.85 (~7 steps) reacts faster early; later the extra smoothing helps.
    Every stage builds new optimizers (their momentum buffers start at zero), so every stage ramps it.
    """
    frac = min(step / warmup_steps, 1.0)
    return (1 - frac) * start + frac * end


def scale_initial_lrs(optimizers, init_lr_frac):
    """Finetuning stages start from a fraction of the pretraining learning rates: every group's lr times it."""
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
