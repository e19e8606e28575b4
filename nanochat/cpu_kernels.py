"""
The CPU training kernels: the norms as one autograd Function, and attention's scores in batched matmuls by blocks.

Training steps on a CPU run these in place of gpt.py's own ops: GPT._final_hidden gives them to gpt.hidden_states as its
`norm` (uncompiled only: torch.compile fuses the separate ops itself, and its tracing failed on the Function's writes
into slices) and its `attend` (in bf16 where Stage.start's probe found it faster, compiled or not: a compiled step
traces dense_attention). Each computes what gpt.py's ops compute, in fewer passes over memory (the norms) or in larger
matmuls (attention); evaluation, decoding and the exported model run gpt.py's ops. Why: docs/model.md ("Training on a
CPU: the norms as one Function"), docs/hardware.md ("Attention in training on a CPU").
"""

import torch

RMS_EPS = torch.finfo(torch.float32).eps  # the eps F.rms_norm(x, shape) uses for fp32 and bf16 inputs alike
# dense_attention by blocks of DENSE_ROWS queries (2x below 8 heads in all), each against the key pieces it sees: the
# square's upper blocks are never made; pieces joined by cat, whose gradient is a split (a slice's is zero-padded)
DENSE_ROWS = 128


def norm(x, scale=1.0, cos=None, sin=None):
    """gpt.norm(x, scale, cos, sin) with its gradient written out: the RMSNorm Function."""
    return RMSNorm.apply(x, scale, cos, sin)


class RMSNorm(torch.autograd.Function):
    """
    scale * norm(x); given cos, sin: scale * norm(apply_rotary_emb(x, cos, sin)) (a rotation keeps the rms). With
    r = 1 / rms(x) and a = the gradient turned back by the rotation: dx = scale * (r a - r^3 mean(a x) x).
    """

    @staticmethod
    def forward(ctx, x, scale, cos=None, sin=None):
        acc = torch.promote_types(x.dtype, torch.float32)  # the reduction in fp32 (fp64 for fp64)
        r = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=acc)
        r = r.square_().div_(x.size(-1)).add_(RMS_EPS).rsqrt_()
        ctx.save_for_backward(x, r, cos, sin)
        ctx.scale = scale
        # each factor in x's dtype before it multiplies: a bf16 tensor times an fp32 one is far slower
        return (x if cos is None else _rotate(x, cos, sin)) * (r * scale).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, r, cos, sin = ctx.saved_tensors
        a = grad if cos is None else _rotate(grad, cos, sin, -1)
        k = (a * x).mean(dim=-1, keepdim=True, dtype=r.dtype).mul_(r ** 3 * ctx.scale)
        return (a * (r * ctx.scale).to(a.dtype)).sub_(x * k.to(x.dtype)), None, None, None


def _rotate(x, cos, sin, sign=1):
    """apply_rotary_emb(x, cos, sign * sin) into a new tensor, in four ops (sign -1: the rotation turned back)."""
    d = x.size(-1) // 2
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(x[..., :d], cos, out=y[..., :d]).addcmul_(x[..., d:], sin, value=sign)
    torch.mul(x[..., d:], cos, out=y[..., d:]).addcmul_(x[..., :d], sin, value=-sign)
    return y


def dense_attention(q, k, v, window=None):
    """
    gpt.attention(q, k, v, window=window) of a training step: q, k, v (B, H, T, D), as many key heads as query heads,
    causal, a query seeing its own key and the `window` before it (None: all). The scores in batched matmuls, by
    blocks of DENSE_ROWS queries, each against the key pieces it sees; -inf where masked, then the softmax: SDPA's math.
    """
    B, H, T, D = q.shape
    window = window if window is not None and window < T - 1 else None  # a window that covers everything is none
    back = torch.arange(T, device=q.device)[:, None] - torch.arange(T, device=q.device)  # how far back each key is
    mask = (back >= 0) if window is None else (back >= 0) & (back <= window)
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    rows = DENSE_ROWS * (1 if B * H >= 8 else 2)
    q, k, v = (t.reshape(B * H, T, D).split(rows, 1) for t in (q, k, v))
    outs = []
    for j, q_block in enumerate(q):
        i = j * rows  # the block's first query
        first = 0 if window is None else max(0, i - window) // rows  # the first key piece it sees
        keys, values = (torch.cat(t[first:j + 1], 1) for t in (k, v))
        scores = torch.baddbmm(bias[i:i + rows, first * rows:i + rows], q_block, keys.mT, alpha=D ** -0.5)
        outs.append(torch.bmm(scores.softmax(-1), values))
    return torch.cat(outs, 1).view(B, H, T, D)
