"""
Muon, the optimizer of the transformer blocks' matrices: Muon in one process, DistMuon sharded across ranks.

A step orthogonalises each matrix's Nesterov momentum with a Newton-Schulz iteration and moves the matrix along it,
p <- p - lr * sqrt(max(1, rows/cols)) * NS(momentum direction), and with weight_decay > 0 a "cautious" decay of the
same lr: only the entries where the update moves the weight toward zero (update * p >= 0) shrink by lr * wd * p.
Why Muon, how the iteration works, and the sharding: docs/optimizers.md.
"""

import math

import torch
import torch.distributed as dist

from nanochat.optim import ShardedGradients
from nanochat.ranks import is_distributed


def zeropower_via_newtonschulz5(G, steps=5, dtype=torch.float32):
    """
    Approximately orthogonalise G (a matrix, or a batch of them in a 3-D tensor): for G = U S V^T, returns
    U S' V^T with every singular value s >= 0.0016 ||G||_F mapped into [0.68, 1.21] (none above 1.21), the smaller
    ones kept small (tests/test_optim.py; the measured band: bench/RESULTS.md). `steps` quintic Newton-Schulz
    iterations computed in `dtype` (the caller's compute dtype); the result has G's shape and dtype. An all-zero G
    gives zeros. ValueError for a tensor that is neither 2-D nor 3-D.
    """
    if G.ndim not in (2, 3):
        raise ValueError(f"zeropower_via_newtonschulz5 needs a matrix (or a batch of them), got shape {tuple(G.shape)}")
    a, b, c = 3.4445, -4.7750, 2.0315  # p(s) = a s + b s^3 + c s^5: steep at 0, oscillating around 1
    X = G.to(dtype)
    transposed = G.size(-2) > G.size(-1)
    if transposed:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # the 1e-7 only keeps an all-zero G at zero
    # addmm / baddbmm fuse the scaled additions into the products: fewer launches for small matrices on a GPU
    addmm = torch.addmm if X.ndim == 2 else torch.baddbmm
    for _ in range(steps):
        A = X @ X.mT
        B = addmm(A, A, A, beta=b, alpha=c)  # b * A + c * A @ A
        X = addmm(X, B, X, beta=a)  # a * X + B @ X
    if transposed:
        X = X.mT
    return X.to(G.dtype)


def _check_matrices(params, who):
    """Muon is defined for 2-D matrices only: say which parameter is not one, instead of failing later."""
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{who} takes an iterable of tensors (parameters), got {type(p).__name__} at position {i}")
        if p.ndim != 2:
            raise ValueError(f"{who} only optimizes 2-D matrices, but parameter {i} has shape {tuple(p.shape)}; "
                             f"give embeddings, vectors and scalars to AdamW")


def _lr_scale(p):
    """sqrt(max(1, rows/cols)): the step scale that makes one lr fit every shape (docs/optimizers.md)."""
    return math.sqrt(max(1.0, p.size(-2) / p.size(-1)))


def _apply_update(p, update, group):
    """
    p -= lr * update, lr = the group's lr x _lr_scale(p); plus the cautious weight decay lr * wd * p on the entries
    where update and p have the same sign (where the step already pulls the weight toward zero).
    """
    lr = group["lr"] * _lr_scale(p)
    wd = group.get("weight_decay", 0.0)
    if wd:
        p.sub_(p * (update * p >= 0), alpha=lr * wd)
    p.add_(update, alpha=-lr)


def _momentum_direction(state, p, grad, group):
    """
    The direction Muon orthogonalises, for the matrix p with gradient grad: its momentum buffer (in `state`, made at
    the first step) buf <- momentum * buf + (1 - momentum) * grad in place, then (1 - momentum) * grad + momentum *
    buf if the group's nesterov (a look one step ahead), else buf. grad is not touched.
    """
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(p)
    buffer = state["momentum_buffer"]
    buffer.lerp_(grad, 1 - group["momentum"])
    return grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer


def _batches(params):
    """
    The groups of matrices Muon orthogonalises in one call: on a CPU with several threads all those of one shape,
    stacked (large batched matmuls keep the threads busy; many small ones make them wait on each other); otherwise
    one at a time (one direction in memory at a time). Same results either way (tests/test_optim.py; timings:
    bench/RESULTS.md).
    """
    if not params or params[0].device.type != "cpu" or torch.get_num_threads() == 1:
        return [[p] for p in params]
    return _by_shape(params)


def _by_shape(params):
    """The matrices grouped by shape, in first-seen order (which is the same on every rank)."""
    groups = {}
    for p in params:
        groups.setdefault(tuple(p.shape), []).append(p)
    return list(groups.values())


def _momentum_state(opt, params, name_of):
    """The checkpoint entries (nanochat.checkpoint_manager) of the momentum buffers of `params`: whole matrices."""
    return {name_of[p]: {"row_start": 0, "step": None, "momentum_buffer": opt.state[p]["momentum_buffer"]}
            for p in params if "momentum_buffer" in opt.state.get(p, {})}


def _load_momentum_state(opt, params, name_of, full_state):
    for p in params:
        full = full_state(name_of[p])
        if full is not None:
            opt.state[p] = {"momentum_buffer": full["momentum_buffer"].to(p.device, p.dtype).clone()}


class Muon(torch.optim.Optimizer):
    """
    Muon in one process (the step in the module docstring). params: 2-D tensors (or param-group dicts); anything
    else raises ValueError. lr and momentum are read from each param group at every step (the schedules set them);
    ns_dtype is the dtype Newton-Schulz computes in. State per matrix: one momentum buffer (the matrix's shape and
    dtype). Parameters without a gradient are skipped.
    """

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, ns_dtype=torch.float32,
                 weight_decay=0.0):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, ns_dtype=ns_dtype,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        for group in self.param_groups:
            _check_matrices(group["params"], "Muon")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for batch in _batches([p for p in group["params"] if p.grad is not None]):
                directions = [_momentum_direction(self.state[p], p, p.grad, group) for p in batch]
                if len(batch) == 1:
                    updates = [zeropower_via_newtonschulz5(directions[0], group["ns_steps"], group["ns_dtype"])]
                else:  # stacked straight into the compute dtype, and the updates applied in it: no fp32 round trips
                    stacked = torch.empty((len(batch), *batch[0].shape), dtype=group["ns_dtype"],
                                          device=batch[0].device)
                    for i, direction in enumerate(directions):
                        stacked[i].copy_(direction)
                    updates = zeropower_via_newtonschulz5(stacked, group["ns_steps"], group["ns_dtype"]).unbind(0)
                for p, update in zip(batch, updates):
                    _apply_update(p, update, group)
        return loss

    def owned_state(self, name_of):
        """Every matrix's momentum buffer (one process holds them all); see nanochat.checkpoint_manager."""
        return _momentum_state(self, [p for group in self.param_groups for p in group["params"]], name_of)

    def load_owned_state(self, name_of, full_state):
        _load_momentum_state(self, [p for group in self.param_groups for p in group["params"]], name_of, full_state)


class DistMuon(ShardedGradients, Muon):
    """
    Muon sharded across ranks, ZeRO-2 style (docs/optimizers.md): each WHOLE matrix (Newton-Schulz needs all of it) has
    one owner rank, which alone keeps its momentum buffer and computes its update. Matrices are grouped by shape, one
    param group each, walked in blocks of W (world size): rank r owns matrix k*W + r of its group. The gradients: per
    block, reduce_scatter them (the owner gets its matrix's, averaged over the ranks; a short last block is padded with
    a zero matrix) in optim.clip_grad_norm_ when clipping is on (the default), else in step(); then step(): update the
    owned matrix, all_gather the block; afterwards every rank holds the same full matrices. params: an iterable of 2-D
    tensors (not dicts: groups are made by shape); lr and momentum are read from every group at each step. Requirements:
    an initialised process group; every rank has the same parameters in the same order, a gradient for each, and calls
    step() together. Checkpoints: owned_state / load_owned_state through nanochat.checkpoint_manager, across world
    sizes.
    """

    def __init__(self, params, **settings):
        """`settings`: Muon's (lr, momentum, nesterov, ns_steps, ns_dtype, weight_decay)."""
        if not is_distributed():
            raise RuntimeError("DistMuon needs an initialised process group (torchrun + compute_init); "
                               "use Muon in a single process")
        params = list(params)
        _check_matrices(params, "DistMuon")
        super().__init__([{"params": ps} for ps in _by_shape(params)], **settings)
        # one zero matrix per shape, padding the last block; outside the param groups, so not in state_dict()
        self._zero_buffers = {}

    def _zero_buffer(self, p):
        key = (tuple(p.shape), p.dtype, p.device)
        if key not in self._zero_buffers:
            self._zero_buffers[key] = torch.zeros_like(p)
        return self._zero_buffers[key]

    def _launch_reduce_scatters(self):
        world_size = dist.get_world_size()
        blocks = []
        for group in self.param_groups:
            params = group["params"]
            zero = self._zero_buffer(params[0])
            for base in range(0, len(params), world_size):
                block = params[base:base + world_size]
                for p in block:
                    if p.grad is None:
                        raise RuntimeError("DistMuon: a parameter has no gradient; every rank needs a gradient for "
                                           "every parameter, since all ranks take part in every collective")
                grads = [p.grad for p in block] + [zero] * (world_size - len(block))
                owned_grad = torch.empty_like(zero)
                work = dist.reduce_scatter(owned_grad, grads, op=dist.ReduceOp.SUM, async_op=True)
                blocks.append(dict(group=group, block=block, grad=owned_grad, work=work))
        return blocks

    def _owned_rows(self, entry):
        """(matrix, 0, its averaged gradient) of the matrix of block `entry` this rank owns, if any."""
        rank = dist.get_rank()
        return (entry["block"][rank], 0, self._averaged(entry)) if rank < len(entry["block"]) else None

    @torch.no_grad()
    def step(self):
        rank = dist.get_rank()
        world_size = dist.get_world_size()
        blocks = self._take_pending()  # one reduce_scatter per block, issued now unless clipping issued them

        # Block by block: wait for its gradients, update the matrix this rank owns, issue the all_gather.
        gathers = []
        for entry in blocks:
            group, block = entry["group"], entry["block"]
            owned_grad = self._averaged(entry)  # waits for this block's reduce_scatter
            if rank < len(block):
                p = block[rank]
                # one matrix at a time: the block's others belong to other ranks
                direction = _momentum_direction(self.state[p], p, owned_grad, group)
                update = zeropower_via_newtonschulz5(direction, group["ns_steps"], group["ns_dtype"])
                _apply_update(p, update, group)
                source = p
            else:
                source = self._zero_buffer(block[0])  # this rank owns nothing in the padded last block
            outputs = list(block) + [torch.empty_like(source) for _ in range(world_size - len(block))]
            gathers.append(dist.all_gather(outputs, source, async_op=True))

        for work in gathers:  # then every rank holds every updated matrix
            work.wait()

    def _owned(self):
        """The matrices this rank owns: position j of its shape group, j % world_size == rank."""
        rank = dist.get_rank()
        world_size = dist.get_world_size()
        return [p for group in self.param_groups for j, p in enumerate(group["params"]) if j % world_size == rank]

    def owned_state(self, name_of):
        """The momentum buffers of the matrices this rank owns (whole matrices); see nanochat.checkpoint_manager."""
        return _momentum_state(self, self._owned(), name_of)

    def load_owned_state(self, name_of, full_state):
        _load_momentum_state(self, self._owned(), name_of, full_state)
