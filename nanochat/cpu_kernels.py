"""
The CPU kernels: the norms of training steps as one autograd Function, and torch's own matmuls in place of oneDNN's.

Training steps on a CPU run `norm` in place of gpt.py's: GPT._final_hidden gives it to gpt.hidden_states (uncompiled
only: torch.compile fuses the separate ops itself, and its tracing failed on the Function's writes into slices). It
computes what gpt.norm computes in fewer passes over memory; evaluation, decoding and the exported model run gpt.py's
ops. Why: docs/model.md ("Training on a CPU: the norms as one Function"). A bf16 decoding step of one or two rows
multiplies its matrices with oneDNN off (onednn_off) where probes.native_bf16_gemv measured that faster
(docs/hardware.md, "Decoding one row on a CPU"). The CPU's attention kernel in training steps, "dense", is one of
nanochat/attention_kernels.py's.
"""

import threading
from contextlib import contextmanager

import torch


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
        # F.rms_norm's default eps: the machine epsilon of the dtype it reduces in (fp32 and bf16: gpt.RMS_EPS)
        r = r.square_().div_(x.size(-1)).add_(torch.finfo(acc).eps).rsqrt_()
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


_onednn_off = {"lock": threading.Lock(), "inside": 0, "was": True}  # how many threads are inside; the setting before


@contextmanager
def onednn_off():
    """
    torch's own CPU kernels for the matmuls inside, not oneDNN (its default for bf16); the setting restored when the
    last thread inside leaves. The setting is the process's, not the thread's: two threads that each saved and
    restored it (a server's worker decoding while another thread does) could leave it off for good.
    """
    with _onednn_off["lock"]:
        if _onednn_off["inside"] == 0:
            _onednn_off["was"] = torch.backends.mkldnn.enabled
            torch.backends.mkldnn.enabled = False
        _onednn_off["inside"] += 1
    try:
        yield
    finally:
        with _onednn_off["lock"]:
            _onednn_off["inside"] -= 1
            if _onednn_off["inside"] == 0:
                torch.backends.mkldnn.enabled = _onednn_off["was"]
