"""
AdamW for the lookup tables, the head and the layer scalars: AdamW in one process, DistAdamW sharded across ranks.

GPT.setup_optimizers gives it every parameter that is not a matrix of the blocks (those go to Muon): the token
embedding, the value-embedding tables, lm_head, and the layer scalars where the model has them.

Both apply adamw_update_ to the same numbers (whole tensors, or each rank's rows of the rank-averaged gradient), so
one process with gradient accumulation and N ranks train bit-identical weights, in bf16 too; torch.optim.AdamW
agrees to fp32 rounding. Why two optimizers, the formulas, and the sharding: docs/optimizers.md.
"""

import math

import torch
import torch.distributed as dist

from nanochat.optim import ShardedGradients, all_gather_single, reduce_scatter_single, rows_of, zero_pad_rows
from nanochat.ranks import is_distributed


def adamw_update_(p, g, exp_avg, exp_avg_sq, t, lr, betas, eps, weight_decay):
    """
    One AdamW step t (1, 2, ...) with gradient g, in place on p, exp_avg and exp_avg_sq: decoupled weight decay
    p *= 1 - lr * wd, the two moments, then p -= lr / (1 - b1^t) * exp_avg / (sqrt(exp_avg_sq / (1 - b2^t)) + eps).
    Elementwise: a slice of rows gets exactly the numbers the whole tensor would.
    """
    beta1, beta2 = betas
    if fused_exactly(p):  # the same update in one pass over memory instead of eight
        step = torch.tensor(float(t))
        torch._fused_adamw_([p], [g], [exp_avg], [exp_avg_sq], [], [step], lr=lr, beta1=beta1, beta2=beta2,
                            weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        return
    p.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** t
    bias_correction2 = 1 - beta2 ** t
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def fused_exactly(p):
    """
    Whether adamw_update_ runs torch's fused AdamW kernel (torch.optim.AdamW(fused=True)'s) on p: fp32 matrices on a
    CPU whose rows are whole multiples of 64 numbers (every embedding and head). The kernel computes 16 numbers at a
    time and the last numel % 16 one by one, which rounds differently; a slice of whole such rows (a rank's share)
    then has no such tail, and gets exactly the numbers of the whole tensor (tests/test_optim.py). Other shapes (the
    layer scalars) go op by op.
    """
    return p.device.type == "cpu" and p.dtype == torch.float32 and p.ndim == 2 and p.size(1) % 64 == 0


def _adamw_step(state, p, g, group):
    """
    One step of `group`'s AdamW on p (a parameter, or this rank's rows of one) with gradient g: `state` (the step
    count and the two moments, of p's shape) made at the first step, the step counted, then adamw_update_.
    """
    if not state:
        state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
    state["step"] += 1
    adamw_update_(p, g, state["exp_avg"], state["exp_avg_sq"], state["step"], group["lr"], group["betas"], group["eps"],
                  group["weight_decay"])


class AdamW(torch.optim.Optimizer):
    """
    AdamW in one process: adamw_update_ on every parameter that has a gradient. param_groups, lr, betas, eps and
    weight_decay as for torch.optim.AdamW; each group's lr is read at every step. State per parameter: the step
    count and the two moments (the parameter's shape and dtype).
    """

    def __init__(self, param_groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(param_groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    _adamw_step(self.state[p], p, p.grad, group)

    def owned_state(self, name_of):
        """Every parameter's state (one process holds it all), whole, from row 0; see nanochat.checkpoint_manager."""
        rows = lambda t: t.view(1) if t.ndim == 0 else t
        return {name_of[p]: {"row_start": 0, "step": state["step"], "exp_avg": rows(state["exp_avg"]),
                             "exp_avg_sq": rows(state["exp_avg_sq"])}
                for group in self.param_groups for p in group["params"] if (state := self.state.get(p))}

    def load_owned_state(self, name_of, full_state):
        for group in self.param_groups:
            for p in group["params"]:
                full = full_state(name_of[p])
                if full is not None:
                    moments = {k: full[k].view_as(p).to(p.device, p.dtype).clone() for k in ("exp_avg", "exp_avg_sq")}
                    self.state[p] = {"step": int(full["step"]), **moments}


class DistAdamW(ShardedGradients, AdamW):
    """
    AdamW sharded across ranks, ZeRO-2 style (docs/optimizers.md). Every parameter is cut along dim 0 into W slices
    of ceil(rows / W) rows (W = world size; a 0-d parameter is one row); rank r owns slice r and keeps the state
    (step count, exp_avg, exp_avg_sq) of that slice only, padding rows included. The gradients: reduce_scatter each
    one (rank r gets slice r, averaged over the ranks) in optim.clip_grad_norm_ when clipping is on (the default),
    else in step(); then step(): adamw_update_ on the owned slice, all_gather the slices; afterwards every rank holds
    the same full parameters. Rows that do not divide by W are zero-padded for
    the collectives (one copy of such a parameter per step; the padding's update is exactly zero).
    param_groups and lr as for AdamW. Requirements: an initialised process group; every rank has the same
    parameters in the same order, a gradient for each, and calls step() together. Checkpoints: owned_state /
    load_owned_state through nanochat.checkpoint_manager, across world sizes.
    """

    def __init__(self, param_groups, **settings):
        """`settings`: AdamW's (lr, betas, eps, weight_decay)."""
        if not is_distributed():
            raise RuntimeError("DistAdamW needs an initialised process group (torchrun + compute_init); "
                               "use nanochat.adamw.AdamW in a single process")
        super().__init__(param_groups, **settings)

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
                grad = zero_pad_rows(grad, rows_per_rank * world_size)
                grad_slice = grad.new_empty((rows_per_rank, *grad.shape[1:]))
                work = reduce_scatter_single(grad_slice, grad, op=dist.ReduceOp.SUM, async_op=True)
                # the padded gradient stays referenced until its collective is done
                pending.append(dict(group=group, p=p, rows_per_rank=rows_per_rank, padded=grad, grad=grad_slice,
                                    work=work))
        return pending

    def _owned_rows(self, entry):
        """(parameter, first row, averaged gradient rows) of the rows of `entry` this rank owns (not the padding)."""
        start = dist.get_rank() * entry["rows_per_rank"]
        keep = min(entry["rows_per_rank"], rows_of(entry["p"]).size(0) - start)
        return (entry["p"], start, rows_of(self._averaged(entry)[:keep])) if keep > 0 else None

    @torch.no_grad()
    def step(self):
        rank = dist.get_rank()
        world_size = dist.get_world_size()
        pending = self._take_pending()  # the reduce_scatters, issued now unless clipping issued them

        # Per parameter: wait for its gradient slice, update the owned slice, issue the all_gather.
        gathers = []
        for entry in pending:
            group, p, rows_per_rank = entry["group"], entry["p"], entry["rows_per_rank"]
            g = self._averaged(entry)
            p_rows = p.view(1) if p.ndim == 0 else p
            full = zero_pad_rows(p_rows, rows_per_rank * world_size)  # p itself on the copy-free path
            p_slice = full[rank * rows_per_rank:(rank + 1) * rows_per_rank]
            _adamw_step(self.state[p], p_slice, g, group)

            # p_slice is a view into `full`: gathering into `full` leaves our slice in place
            gathers.append((p_rows, full, all_gather_single(full, p_slice, async_op=True)))

        # Wait for every all_gather; padded parameters copy their real rows back.
        for p_rows, full, work in gathers:
            work.wait()
            if full is not p_rows:
                p_rows.copy_(full[:p_rows.size(0)])

    def owned_state(self, name_of):
        """This rank's slice of every parameter's state, without the padding rows (nanochat.checkpoint_manager)."""
        rank = dist.get_rank()
        world_size = dist.get_world_size()
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
        """Take this rank's slice of each parameter's full state (nanochat.checkpoint_manager.load_optimizer_shards)."""
        rank = dist.get_rank()
        world_size = dist.get_world_size()
        for group in self.param_groups:
            for p in group["params"]:
                full = full_state(name_of[p])
                if full is None:
                    continue
                rows_per_rank = -(-full["exp_avg"].size(0) // world_size)
                state = {"step": int(full["step"])}
                for key in ("exp_avg", "exp_avg_sq"):
                    padded = zero_pad_rows(full[key], rows_per_rank * world_size)
                    state[key] = padded[rank * rows_per_rank:(rank + 1) * rows_per_rank].to(p.device, p.dtype).clone()
                self.state[p] = state
