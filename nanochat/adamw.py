"""
AdamW for the embedding and lm_head, and DistAdamW, its sharded version for data-parallel training.

In a single process nanochat uses torch.optim.AdamW directly (GPT.setup_optimizers picks it): nothing
to add. Under torchrun it uses DistAdamW below, which computes exactly the same AdamW update
(same formulas as torch.optim.AdamW, results equal to fp32 rounding) on the rank-averaged gradient,
but shards the optimizer state and the update work across ranks. See nanochat/muon.py for why the
model uses two optimizers (Muon for the matrices in the transformer blocks, AdamW for wte and lm_head).

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

from nanochat.common import UserError

# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single (the old names still
# work but warn); older torch (>= 2.8 is supported) only has the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _pad_rows(t, rows):
    """t itself if it already has `rows` rows and is contiguous, else a contiguous copy zero-padded along dim 0 to `rows`."""
    if t.size(0) == rows and t.is_contiguous():
        return t
    padded = t.new_zeros((rows, *t.shape[1:]))
    padded[:t.size(0)] = t
    return padded


class ShardedGradients:
    """
    What DistAdamW and DistMuon share: averaging gradients across ranks with reduce_scatter, each rank
    receiving the averaged gradient of the part it owns. Split in phases, so that gradient clipping can
    look at the averaged gradient between averaging and updating (nanochat.gpt.clip_grad_norm_):

        opt.reduce_gradients()            issue the async reduce_scatters (step() does it if you do not)
        opt.owned_grad_sq_norm()          sum of squares of this rank's averaged pieces; summed over
                                          ranks it is the squared norm of the averaged gradient
        opt.scale_gradients(scale)        multiply this rank's averaged pieces (the clip factor)
        opt.step()                        update the owned parts, all_gather the weights

    A subclass implements _launch_reduce_scatters() -> list of dicts with at least "grad" (the owned piece
    being received) and "work" (the async handle).
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

    def owned_grad_sq_norm(self):
        self.reduce_gradients()
        total = torch.zeros((), dtype=torch.float32, device=self._pending[0]["grad"].device)
        for entry in self._pending:
            total += self._averaged(entry).float().square().sum()
        return total

    def scale_gradients(self, scale):
        self.reduce_gradients()
        for entry in self._pending:
            self._averaged(entry).mul_(scale)

    # Each rank holds only its share of the optimizer state, so every rank saves its own file, which is only
    # valid on the same rank of a run with the same number of ranks: record both, and check them on load.
    def state_dict(self):
        state_dict = super().state_dict()
        state_dict["shard"] = {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
        return state_dict

    def load_state_dict(self, state_dict):
        here = {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
        saved = state_dict.get("shard")
        if saved != here:
            where = f"rank {saved['rank']} of {saved['world_size']}" if saved else "a process that did not record its rank"
            raise UserError(f"{type(self).__name__} state was saved by {where} but is loaded on rank {here['rank']} of "
                            f"{here['world_size']}: each rank holds only its own share of the optimizer state, "
                            f"so resume with the same number of processes, each rank loading its own file")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "shard"})

    def _take_pending(self):
        self.reduce_gradients()
        pending, self._pending = self._pending, None
        return pending


class DistAdamW(ShardedGradients, torch.optim.Optimizer):
    """
    AdamW for data-parallel training (torchrun), ZeRO-2 style: the optimizer work is divided among the
    ranks, the model is not.

    What is sharded: the optimizer state and the update computation. Every parameter is cut along dim 0
    into W equal slices of ceil(rows / W) rows (W = world size); rank r owns slice r and keeps
    exp_avg / exp_avg_sq (and the step count) for that slice only, so each rank holds ~1/W of the AdamW
    state (which is twice the size of the parameters) and does ~1/W of the update arithmetic.
    What is not sharded: the weights and the gradients. Every rank loads the whole model and holds every
    parameter in full, runs forward/backward on its own data and holds a full (local) gradient; after
    step() every rank holds the same full, updated parameters.
    Why "ZeRO-2 style": besides the sharded state, each slice of the rank-averaged gradient ends up only on
    its owner (a reduce_scatter), not on every rank as with DDP's all_reduce. The traffic is the same as
    DDP's: reduce_scatter + all_gather move as many bytes as one all_reduce.

    How a step works, per parameter:
      1. reduce_scatter the gradient along dim 0: rank r receives slice r of the gradient, averaged over
         all ranks (the data-parallel gradient);
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
    The big parameters (wte, lm_head: vocab_size rows, a multiple of 8) take the copy-free path.

    param_groups: as for torch.optim.AdamW (an iterable of tensors or of dicts with per-group lr, betas,
    eps, weight_decay). Each group's lr is read at every step, so the training script may set
    `group["lr"] = group["initial_lr"] * lrm` before each step. Requirements: torch.distributed is
    initialised, every rank has the same parameters in the same order, calls step() together, and has a
    gradient for every parameter.

    state_dict() holds this rank's slices only (plus the rank and world size it was taken at): save one
    file per rank and load it back on the same rank with the same world size; anything else raises
    UserError.
    """

    def __init__(self, param_groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        if not (dist.is_available() and dist.is_initialized()):
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
                grad = _pad_rows(grad, rows_per_rank * world_size)
                grad_slice = grad.new_empty((rows_per_rank, *grad.shape[1:]))
                work = _reduce_scatter_single(grad_slice, grad, op=dist.ReduceOp.SUM, async_op=True)
                # the padded gradient stays referenced until its collective is done
                pending.append(dict(group=group, p=p, rows_per_rank=rows_per_rank, padded=grad, grad=grad_slice, work=work))
        return pending

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
            full = _pad_rows(p_rows, rows_per_rank * world_size)  # p itself on the copy-free path
            p_slice = full[rank * rows_per_rank:(rank + 1) * rows_per_rank]

            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p_slice)
                state["exp_avg_sq"] = torch.zeros_like(p_slice)
            state["step"] += 1
            t = state["step"]
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]

            p_slice.mul_(1 - lr * wd)
            exp_avg.lerp_(g, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            bias_correction1 = 1 - beta1 ** t
            bias_correction2 = 1 - beta2 ** t
            denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
            p_slice.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)

            # p_slice is a view into `full`: gathering into `full` leaves our slice in place
            gathers.append((p_rows, full, _all_gather_single(full, p_slice, async_op=True)))

        # 3. Wait for every all_gather; padded parameters copy their real rows back.
        for p_rows, full, work in gathers:
            work.wait()
            if full is not p_rows:
                p_rows.copy_(full[:p_rows.size(0)])

