"""
Muon: the optimizer for the hidden weight matrices of the transformer. DistMuon: the same, sharded
across ranks.

AdamW vs Muon, for a newcomer
-----------------------------
AdamW (nanochat/adamw.py) treats every number of a parameter on its own: it keeps two running averages
per entry (exp_avg, the momentum, and exp_avg_sq, the mean squared gradient) and moves each entry by
roughly lr * sign-ish(gradient). It works on any tensor, which is why nanochat uses it for the token
embedding `wte` (a lookup table: each step only the rows of the tokens in the batch get gradient, and
per-entry adaptive step sizes suit that) and for the `lm_head` unembedding (a very wide output layer that
is sensitive to the step size, trained with a small lr).

Muon ("MomentUm Orthogonalized by Newton-schulz") treats a weight matrix as a linear map. It keeps
one momentum buffer per matrix (half of AdamW's state) and, instead of stepping along the momentum M,
steps along the orthogonalised momentum: M = U S V^T (SVD) is replaced by U V^T, i.e. all singular values
are set to 1. The update then changes the map by the same amount in every direction it touches, instead
of being dominated by the few largest directions of the gradient, which is what plain SGD/Adam updates
of transformer matrices tend to be (they are close to low rank). In practice this trains the hidden
matrices of a transformer faster per token than AdamW, at the cost of a few matrix multiplications per
step (the Newton-Schulz iteration below, instead of an SVD, which would be far too slow on a GPU).
Muon is only defined for 2-D matrices, hence the split: Muon for every matrix inside the transformer
blocks (attention q/k/v/proj, MLP fc/proj), AdamW for the embedding and lm_head.

Momentum warm-up: the training script sets `group["momentum"]` every step, from 0.85 to 0.95 over
the first 300 steps (nanochat.optim.muon_momentum). Momentum 0.95 averages the gradients of roughly
the last 1/(1-0.95) = 20 steps. Early in training the weights, and so the gradients, change fast, and a
20-step average still points where the gradient was many steps ago. A shorter memory at the start
(0.85, ~7 steps) follows the changing gradient; once training has settled, the longer average of 0.95
gives a smoother, less noisy direction.

No weight decay here: nanochat trains the matrices without it.
"""

import math

import torch
import torch.distributed as dist

from nanochat.common import is_distributed
from nanochat.hardware import autocast_dtype
from nanochat.optim import ShardedGradients


def zeropower_via_newtonschulz5(G, steps=5):
    """
    Approximately orthogonalise the matrix G (2-D), or each matrix of a batch G (3-D):
    if G = U S V^T is its (reduced) SVD, return approximately U V^T, the nearest semi-orthogonal matrix
    (the "polar factor" of G). "zeropower" because U V^T = U S^0 V^T.

    How: first divide G by its Frobenius norm. The Frobenius norm is >= the spectral norm (the largest
    singular value), so afterwards every singular value lies in (0, 1]. Then apply, `steps` times,
        X <- a X + b (X X^T) X + c (X X^T)^2 X,   (a, b, c) = (3.4445, -4.7750, 2.0315).
    That is an odd polynomial in X, so it keeps U and V and maps every singular value s to
    p(s) = a s + b s^3 + c s^5. The coefficients make p as steep as possible at 0 (a = 3.4 multiplies small
    singular values by 3.4 per step) while still pulling everything in (0, 1] towards ~1, so 5 steps
    suffice. Why quintic: a cubic iteration (s -> 1.5 s - 0.5 s^3, the classic Newton-Schulz) grows small
    singular values only by 1.5 per step and would need many more steps; a quintic gets much steeper slope
    per matrix multiplication. The price: the iteration does not converge to exactly 1, it oscillates
    around it.

    What it actually produces (5 steps, fp32; measured by iterating p on a fine grid of s and confirmed on
    random matrices, tests/test_optim.py checks it): every singular value s of G with s >= 0.0016 * ||G||_F
    comes out in [0.68, 1.21], and no singular value comes out above 1.21 (the exact extremes are 0.6818
    and 1.2024). Singular values below 0.0016 * ||G||_F are multiplied by at most a^5 ~ 490 and come out
    smaller than that threshold's image, 0.718: a direction with almost no gradient stays small, which is
    harmless. So the result is
    U S' V^T with S' in about 0.7..1.2, not exactly U V^T: close enough for an update direction (cosine
    with the exact U V^T ~0.98 on random Gaussian matrices, square ones included). The bf16 iteration on
    a GPU stays in the same band (measured on an H100: bench/RESULTS.md).

    The iteration works on the wide side: a tall matrix (rows > cols) is transposed first, so X X^T is
    the smaller (cols x cols) Gram matrix, and transposed back at the end.

    Precision: the dtype the model's matmuls run in (hardware.compute_dtype; $NANOCHAT_DTYPE overrides it):
    bf16 on CUDA and on a CPU that does bf16 natively (the iteration tolerates the rounding, see above, and it is
    faster than TF32 / fp32), fp32 on MPS and on a CPU without native bf16, which would emulate it far slower.
    Returns a tensor of G's shape and dtype.
    """
    if G.ndim not in (2, 3):
        raise ValueError(f"zeropower_via_newtonschulz5 needs a matrix (or a batch of them), got shape {tuple(G.shape)}")
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.to(autocast_dtype(G.device.type))
    transposed = G.size(-2) > G.size(-1)
    if transposed:
        X = X.mT
    # The 1e-7 only guards against division by zero for an all-zero G (the result is then zero).
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    # addmm(C, M1, M2, beta, alpha) = beta * C + alpha * M1 @ M2 in one kernel (baddbmm: batched). The
    # iteration is launch-bound for small matrices on a GPU, and fusing the scaled additions into the
    # products is faster than separate ops (bench/RESULTS.md).
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
    """
    Per-matrix lr multiplier sqrt(max(1, rows/cols)). The orthogonalised update has all singular values
    ~1, so its entries have RMS ~ 1/sqrt(max(rows, cols)): for a tall matrix (rows > cols, e.g. the MLP
    up-projection, whose weight is (4*n_embd, n_embd)) the entries would be sqrt(rows/cols) times smaller
    than for a square one. This factor undoes that, so one lr fits every shape.
    """
    return math.sqrt(max(1.0, p.size(-2) / p.size(-1)))


def _momentum_direction(grad, momentum_buffer, momentum, nesterov):
    """
    The direction Muon orthogonalises, for one matrix (does not touch grad; updates momentum_buffer in place):
      buf    <- momentum * buf + (1 - momentum) * grad          (buf.lerp_(grad, 1 - momentum))
      update <- (1 - momentum) * grad + momentum * buf           if nesterov (look one step ahead)
                buf                                              otherwise
    """
    momentum_buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer


def _batches(params):
    """
    The matrices Muon orthogonalises together, in one call. On a CPU with several threads, all those of one shape,
    stacked: the same products (tests/test_optim.py), but a few large batched matmuls keep the threads busy where a
    loop of small ones makes them wait on each other at every op, which collapses as soon as another program wants
    a core (2 threads on a busy 2-core VM: 8x faster). With one thread the loop is a few % faster; on CUDA it is
    what always ran, one matrix at a time, with one direction in memory at a time (measured: bench/RESULTS.md).
    """
    if not params or params[0].device.type != "cpu" or torch.get_num_threads() == 1:
        return [[p] for p in params]
    by_shape = {}
    for p in params:
        by_shape.setdefault(tuple(p.shape), []).append(p)
    return list(by_shape.values())


def _momentum_state(opt, params, name_of):
    """Checkpoint entries (nanochat.optim) of the momentum buffers of `params`: whole matrices, from row 0."""
    return {name_of[p]: {"row_start": 0, "step": None, "momentum_buffer": opt.state[p]["momentum_buffer"]}
            for p in params if "momentum_buffer" in opt.state.get(p, {})}


def _load_momentum_state(opt, params, name_of, full_state):
    for p in params:
        full = full_state(name_of[p])
        if full is not None:
            opt.state[p] = {"momentum_buffer": full["momentum_buffer"].to(p.device, p.dtype).clone()}


class Muon(torch.optim.Optimizer):
    """
    Single-process Muon for 2-D matrices: Nesterov momentum, then orthogonalisation, then
    p <- p - lr * sqrt(max(1, rows/cols)) * update (see the module docstring for why, and _lr_scale for
    the factor). State per matrix: one momentum buffer (fp32, the parameter's shape). No weight decay.

    params: an iterable of 2-D tensors (or of param-group dicts, as for any torch optimizer); anything
    that is not 2-D raises ValueError. lr and momentum are read from each param group at every step, so
    the training script may set `group["lr"]` (lr schedule) and `group["momentum"]` (0.85 -> 0.95
    warm-up) before each step. Parameters without a gradient are skipped.
    """

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps)
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
                directions = []
                for p in batch:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    directions.append(_momentum_direction(p.grad, state["momentum_buffer"], group["momentum"], group["nesterov"]))
                if len(batch) == 1:
                    updates = [zeropower_via_newtonschulz5(directions[0], steps=group["ns_steps"])]
                else:
                    updates = zeropower_via_newtonschulz5(torch.stack(directions), steps=group["ns_steps"]).unbind(0)
                for p, update in zip(batch, updates):
                    p.add_(update, alpha=-group["lr"] * _lr_scale(p))
        return loss

    def owned_state(self, name_of):
        """Every matrix's momentum buffer (one process holds them all); see nanochat.optim."""
        return _momentum_state(self, [p for group in self.param_groups for p in group["params"]], name_of)

    def load_owned_state(self, name_of, full_state):
        _load_momentum_state(self, [p for group in self.param_groups for p in group["params"]], name_of, full_state)


class DistMuon(ShardedGradients, torch.optim.Optimizer):
    """
    Muon for data-parallel training (torchrun), ZeRO-2 style (what that means: nanochat/optim.py). The part
    of the optimizer a rank owns is a set of WHOLE matrices (Newton-Schulz needs the whole matrix): each
    matrix has one owner rank, which alone keeps its momentum buffer and computes its update.

    How a step works. Matrices are grouped by shape (one param group per shape, so the collectives below
    move equal-sized tensors), and each group is walked in blocks of W: block k holds params
    [k*W, (k+1)*W), and rank r owns param k*W + r.
      1. reduce_scatter per block: rank r receives the gradient of the matrix it owns, averaged over all
         ranks (the data-parallel gradient: the average over every rank's micro-batch).
      2. the owner updates its momentum buffer, orthogonalises, and updates its own copy of the weight.
      3. all_gather per block: every rank receives every updated matrix of the block, into its weights.
    A last block with fewer than W matrices is padded with a zero matrix, so every rank always takes part
    in every collective (ranks without a matrix to own in that block contribute and receive padding).
    Overlap: all reduce_scatters are issued asynchronously first; then, block by block, we wait for that
    block's gradients, compute, and issue its all_gather asynchronously, so communication of later blocks
    runs while earlier blocks compute. We wait for all all_gathers at the end.
    Averaging is done as SUM followed by a division by W on the owner (ReduceOp.AVG does not exist for
    gloo in older torch releases; this way NCCL and gloo run the same code).

    Requirements: torch.distributed is initialised; every rank builds the same parameters in the same
    order (same model code, same seed) and calls step() together; every parameter has a gradient on every
    rank. params is an iterable of 2-D tensors (not param-group dicts: the groups are made by shape).
    lr and momentum are read from the groups at every step: set them on every group.

    Checkpoints: owned_state / load_owned_state, through nanochat.optim.optimizer_shard and
    load_optimizer_shards, which work across world sizes (and with Muon in one process).
    """

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5):
        if not is_distributed():
            raise RuntimeError("DistMuon needs an initialised process group (torchrun + compute_init); use Muon in a single process")
        params = list(params)
        _check_matrices(params, "DistMuon")
        by_shape = {}  # shape -> params, in first-seen order, which is the same on every rank
        for p in params:
            by_shape.setdefault(tuple(p.shape), []).append(p)
        param_groups = [{"params": ps} for ps in by_shape.values()]
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps)
        super().__init__(param_groups, defaults)
        # one zero matrix per shape, for padding the last block; kept out of the param groups so that
        # it does not end up in state_dict()
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
        rank, world_size = dist.get_rank(), dist.get_world_size()
        # 1. One reduce_scatter per block of world_size same-shape matrices (issued asynchronously, unless
        #    already issued for gradient clipping).
        blocks = self._take_pending()

        # 2. Block by block: wait for its gradients, update the matrix this rank owns, issue the all_gather.
        gathers = []
        for entry in blocks:
            group, block = entry["group"], entry["block"]
            owned_grad = self._averaged(entry)  # waits for this block's reduce_scatter
            if rank < len(block):
                p = block[rank]
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                # One matrix at a time: the block's other matrices belong to other ranks (on a CPU, torchrun gives
                # each rank one thread, where Muon would not stack either: _batches).
                direction = _momentum_direction(owned_grad, state["momentum_buffer"], group["momentum"], group["nesterov"])
                update = zeropower_via_newtonschulz5(direction, steps=group["ns_steps"])
                p.add_(update, alpha=-group["lr"] * _lr_scale(p))
                source = p
            else:
                source = self._zero_buffer(block[0])  # this rank owns nothing in the padded last block
            outputs = list(block) + [torch.empty_like(source) for _ in range(world_size - len(block))]
            gathers.append(dist.all_gather(outputs, source, async_op=True))

        # 3. Every rank now (after the waits) holds every updated matrix.
        for work in gathers:
            work.wait()

    def _owned(self):
        """The matrices this rank owns: position j of its shape group, j % world_size == rank."""
        rank, world_size = dist.get_rank(), dist.get_world_size()
        return [p for group in self.param_groups for j, p in enumerate(group["params"]) if j % world_size == rank]

    def owned_state(self, name_of):
        """The momentum buffers of the matrices this rank owns (whole matrices); see nanochat.optim."""
        return _momentum_state(self, self._owned(), name_of)

    def load_owned_state(self, name_of, full_state):
        _load_momentum_state(self, self._owned(), name_of, full_state)
