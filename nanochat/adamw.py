"""
AdamW for the embedding and lm_head (AdamW, one process), and DistAdamW, its sharded version for
data-parallel training (torchrun). GPT.setup_optimizers picks one. See nanochat/muon.py for why the model
uses two optimizers (Muon for the matrices in the transformer blocks, AdamW for wte and lm_head).

Both apply the same function, adamw_update_, to the same numbers: AdamW to whole tensors, DistAdamW to
each rank's slice of rows of the rank-averaged gradient. So one process with gradient accumulation and N
ranks train bit-identical weights (when the averaged gradients are bit-identical: tests/test_base_train.py),
in bf16 too, where a last-bit difference of a weight would grow. torch.optim.AdamW computes the same formulas
with other kernels (fused, foreach) whose rounding differs in the last bit; results agree with it to fp32
rounding (tests/test_optim.py).

The AdamW update, per parameter, at step t (1, 2, ...), with lr, betas (b1, b2), eps and weight decay wd:
    p        <- p * (1 - lr * wd)                       decoupled weight decay (the "W" in AdamW)
    exp_avg    <- b1 * exp_avg    + (1 - b1) * g        momentum (first moment)
    exp_avg_sq <- b2 * exp_avg_sq + (1 - b2) * g * g    second moment, per entry
    p        <- p - lr / (1 - b1^t) * exp_avg / (sqrt(exp_avg_sq / (1 - b2^t)) + eps)
The (1 - b^t) factors are the bias corrections: both averages start at zero and would be too small for
the first ~1/(1-b) steps without them. eps is added after the square root of the bias-corrected second
moment, as torch does.
"""

import math

import torch
import torch.distributed as dist

from nanochat.common import is_distributed
from nanochat.optim import ShardedGradients, all_gather_single, pad_rows, reduce_scatter_single, rows_of


def adamw_update_(p, g, exp_avg, exp_avg_sq, t, lr, betas, eps, weight_decay):
    """One AdamW step (the formulas above), in place on p, exp_avg and exp_avg_sq: step t (1, 2, ...) with
    gradient g. Elementwise: a slice of rows gets exactly the numbers the whole tensor would."""
    beta1, beta2 = betas
    p.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** t
    bias_correction2 = 1 - beta2 ** t
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def _adamw_state(like):
    return {"step": 0, "exp_avg": torch.zeros_like(like), "exp_avg_sq": torch.zeros_like(like)}


class AdamW(torch.optim.Optimizer):
    """
    AdamW in one process: adamw_update_ on every parameter that has a gradient. param_groups, lr, betas, eps
    and weight_decay as for torch.optim.AdamW; each group's lr is read at every step. State per parameter:
    the step count and the two moments (fp32, the parameter's shape).
    """

    def __init__(self, param_groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(param_groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(_adamw_state(p))
                state["step"] += 1
                adamw_update_(p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], group["lr"],
                              group["betas"], group["eps"], group["weight_decay"])

    def owned_state(self, name_of):
        """Every parameter's state (one process holds it all), whole, from row 0; see nanochat.optim."""
        rows = lambda t: t.view(1) if t.ndim == 0 else t  # noqa: E731
        return {name_of[p]: {"row_start": 0, "step": state["step"], "exp_avg": rows(state["exp_avg"]),
                             "exp_avg_sq": rows(state["exp_avg_sq"])}
                for group in self.param_groups for p in group["params"] if (state := self.state.get(p))}

    def load_owned_state(self, name_of, full_state):
        for group in self.param_groups:
            for p in group["params"]:
                full = full_state(name_of[p])
                if full is not None:
                    self.state[p] = {"step": int(full["step"]),
                                     **{k: full[k].view_as(p).to(p.device, p.dtype).clone() for k in ("exp_avg", "exp_avg_sq")}}


class DistAdamW(ShardedGradients, torch.optim.Optimizer):
    """
    AdamW for data-parallel training (torchrun), ZeRO-2 style (what that means: nanochat/optim.py). The
    part of the optimizer a rank owns is a slice of rows of EVERY parameter: each parameter is cut along dim 0
    into W equal slices of ceil(rows / W) rows (W = world size); rank r owns slice r and keeps exp_avg /
    exp_avg_sq (and the step count) for that slice only.

    How a step works, per parameter:
      1. reduce_scatter the gradient along dim 0: rank r receives slice r of the gradient, averaged over all
         ranks (the data-parallel gradient);
      2. AdamW on the owned slice of the parameter, with the owned slice of the state;
      3. all_gather the updated slices, so every rank has the full updated parameter.
    All reduce_scatters are issued asynchronously first, then each parameter waits for its own gradient
    slice, updates, and issues its all_gather asynchronously, so communication overlaps computation.
    Averaging is SUM followed by a division by W of the owned slice (ReduceOp.AVG does not exist for gloo
    in older torch releases; this way NCCL and gloo run the same code).

    Shapes that do not divide: if rows is not a multiple of W (say 10 rows on 3 ranks, or a 1-D parameter
    with fewer entries than ranks), the gradient and the parameter are zero-padded to W * ceil(rows / W)
    rows for the collectives (a copy, only for such parameters), and the padding rows are dropped again.
    Padding rows have zero gradient and zero value, so their update is exactly zero. A rank whose slice
    is all padding still keeps (zero) state for it. 0-d parameters are treated as 1-D of length 1.
    wte and lm_head (vocab_size rows) take the copy-free path only where vocab_size divides by W (65,536 on 1, 2,
    4 or 8 ranks); nothing requires it, another vocabulary pays one padded copy per step.

    param_groups: as for torch.optim.AdamW (an iterable of tensors or of dicts with per-group lr, betas,
    eps, weight_decay). Each group's lr is read at every step, so the training script may set
    `group["lr"] = group["initial_lr"] * lrm` before each step. Requirements: torch.distributed is
    initialised, every rank has the same parameters in the same order, calls step() together, and has a
    gradient for every parameter.

    Checkpoints: owned_state / load_owned_state, through nanochat.optim.optimizer_shard and
    load_optimizer_shards, which work across world sizes (and with torch.optim.AdamW in one process).
    """

    def __init__(self, param_groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        if not is_distributed():
            raise RuntimeError("DistAdamW needs an initialised process group (torchrun + compute_init); "
                               "use torch.optim.AdamW in a single process")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(param_groups, defaults)

    def _launch_reduce_scatters(self):
        world_size = dist.get_world_size()
        pending = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    raise RuntimeError("DistAdamW: a parameter has no gradient; every rank needs a gradient for "
                                       "every parameter, since all ranks take part in every collective")
                grad = p.grad.view(1) if p.ndim == 0 else p.grad
                rows_per_rank = -(-grad.size(0) // world_size)  # ceil
                grad = pad_rows(grad, rows_per_rank * world_size)
                grad_slice = grad.new_empty((rows_per_rank, *grad.shape[1:]))
                work = reduce_scatter_single(grad_slice, grad, op=dist.ReduceOp.SUM, async_op=True)
                # the padded gradient stays referenced until its collective is done
                pending.append(dict(group=group, p=p, rows_per_rank=rows_per_rank, padded=grad, grad=grad_slice, work=work))
        return pending

    def _owned_rows(self, entry):
        """(parameter, first row, averaged gradient rows) of the rows of `entry` this rank owns (not the padding)."""
        start = dist.get_rank() * entry["rows_per_rank"]
        keep = min(entry["rows_per_rank"], rows_of(entry["p"]).size(0) - start)
        return (entry["p"], start, rows_of(self._averaged(entry)[:keep])) if keep > 0 else None

    @torch.no_grad()
    def step(self):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        # 1. The reduce_scatters of every parameter (issued asynchronously, unless already issued for clipping).
        pending = self._take_pending()

        # 2. Per parameter: wait for its gradient slice, AdamW on the owned slice, issue the all_gather.
        gathers = []
        for entry in pending:
            group, p, rows_per_rank = entry["group"], entry["p"], entry["rows_per_rank"]
            g = self._averaged(entry)
            p_rows = p.view(1) if p.ndim == 0 else p
            full = pad_rows(p_rows, rows_per_rank * world_size)  # p itself on the copy-free path
            p_slice = full[rank * rows_per_rank:(rank + 1) * rows_per_rank]

            state = self.state[p]
            if not state:
                state.update(_adamw_state(p_slice))
            state["step"] += 1
            adamw_update_(p_slice, g, state["exp_avg"], state["exp_avg_sq"], state["step"], group["lr"],
                          group["betas"], group["eps"], group["weight_decay"])

            # p_slice is a view into `full`: gathering into `full` leaves our slice in place
            gathers.append((p_rows, full, all_gather_single(full, p_slice, async_op=True)))

        # 3. Wait for every all_gather; padded parameters copy their real rows back.
        for p_rows, full, work in gathers:
            work.wait()
            if full is not p_rows:
                p_rows.copy_(full[:p_rows.size(0)])

    def owned_state(self, name_of):
        """This rank's slice of every parameter's state, without the padding rows (nanochat.optim)."""
        rank, world_size = dist.get_rank(), dist.get_world_size()
        out = {}
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                rows = 1 if p.ndim == 0 else p.size(0)
                rows_per_rank = -(-rows // world_size)
                start = rank * rows_per_rank
                keep = max(0, min(rows_per_rank, rows - start))  # the rest of the slice is padding
                out[name_of[p]] = {"row_start": start, "step": state["step"],
                                   "exp_avg": state["exp_avg"][:keep], "exp_avg_sq": state["exp_avg_sq"][:keep]}
        return out

    def load_owned_state(self, name_of, full_state):
        """Take this rank's slice of each parameter's full state (nanochat.optim.load_optimizer_shards)."""
        rank, world_size = dist.get_rank(), dist.get_world_size()
        for group in self.param_groups:
            for p in group["params"]:
                full = full_state(name_of[p])
                if full is None:
                    continue
                rows_per_rank = -(-full["exp_avg"].size(0) // world_size)
                state = {"step": int(full["step"])}
                for key in ("exp_avg", "exp_avg_sq"):
                    padded = pad_rows(full[key], rows_per_rank * world_size)
                    state[key] = padded[rank * rows_per_rank:(rank + 1) * rows_per_rank].to(p.device, p.dtype).clone()
                self.state[p] = state
