"""
fp8 matmuls: the linear layers' three matmuls (forward, grad of the input, grad of the weight) in float8.

base_train --fp8 turns it on (off by default until a GPU measures its training speed). fp8_supported says where it runs
natively, not that it pays; --fp8=True runs it anywhere (a CPU emulates torch._scaled_mm: for testing the arithmetic).
Why one scale per tensor, e4m3 forward and e5m2 gradients: docs/hardware.md ("fp8").
"""

import torch
import torch.nn.functional as F

FP8_MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (8.9), Hopper (9.0) and later
FP8_AMAX_FLOOR = 1e-12  # an all-zero tensor's scale stays finite (and its cast stays zero)


def fp8_supported(device_type):
    """(whether this device multiplies fp8 in hardware, why). A CPU runs torch._scaled_mm too (torch 2.13), emulated:
    at 1024^3 on 2 cores of an AMD EPYC with avx512_bf16, best 18 ms against 5.2 ms for bf16 and 12.3 ms for fp32."""
    if device_type == "cuda":
        capability = torch.cuda.get_device_capability()
        if capability >= FP8_MIN_CAPABILITY:
            return True, f"a CUDA GPU with fp8 tensor cores (compute capability {capability[0]}.{capability[1]})"
        return False, f"a CUDA GPU without fp8 tensor cores (compute capability {capability[0]}.{capability[1]} < 8.9)"
    if device_type == "cpu":
        return False, ("torch._scaled_mm is emulated on a CPU (3.5x slower than a bf16 matmul, slower than fp32's, "
                       "at 1024^3 on an AMD EPYC with avx512_bf16): fp8 there only tests the arithmetic")
    return False, f"no fp8 matmul on {device_type}"


def fp8_fits(w):
    """Whether fp8_linear takes the weight `w` (out, in): both dims multiples of 16, as torch._scaled_mm needs."""
    return w.dim() == 2 and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0


def fp8_linear(x, w):
    """
    F.linear(x, w) (no bias) with both operands cast to float8_e4m3fn, each with one scale for the whole tensor
    (fp8's max / the tensor's amax), through torch._scaled_mm; y in x's dtype. The backward casts grad_y to
    float8_e5m2 (gradients need range more than precision) and multiplies it with the same e4m3 casts; w's grad
    comes in w's dtype. x (..., in); w (out, in) with fp8_fits(w), else ValueError. Any number of rows. Under
    autocast, x is first cast to autocast's dtype, as F.linear would be.
    """
    if not fp8_fits(w):
        raise ValueError(f"fp8_linear needs a weight whose dims are multiples of 16, not {tuple(w.shape)}: "
                         f"check fp8_fits(w) and use F.linear for the others")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"fp8_linear: x's last dim {x.shape[-1]} is not w's in-features {w.shape[1]}")
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    y = _FP8Linear.apply(x.reshape(-1, x.shape[-1]), w)
    return y.reshape(*x.shape[:-1], w.shape[0])


def _to_fp8(t, dtype):
    """(t scaled into `dtype`'s range, saturated and cast, row-major; the inverse scale torch._scaled_mm takes)."""
    fp8_max = torch.finfo(dtype).max
    scale = fp8_max / t.detach().float().abs().amax().clamp(min=FP8_AMAX_FLOOR)
    # the clamp: a rounding past fp8_max would cast to NaN (e4m3fn has no inf)
    return (t.float() * scale).clamp(-fp8_max, fp8_max).to(dtype).contiguous(), scale.reciprocal()


def _pad_rows(t):
    """t with zero rows added up to a multiple of 16 (the backward's grad_y.T @ x multiplies along the rows): zero
    rows change neither a tensor's amax nor the products."""
    return F.pad(t, (0, 0, 0, -t.shape[0] % 16)) if t.shape[0] % 16 else t


def _column_major(t):
    return t.t().contiguous().t()


class _FP8Linear(torch.autograd.Function):
    """
    y = x @ w.T, grad_x = grad_y @ w, grad_w = grad_y.T @ x, each as one torch._scaled_mm (first operand row-major,
    second column-major). Saved for the backward: the fp8 casts of x and w and their scales, not x and w: an
    activation kept at 1 byte per element instead of 2 (bf16), and the backward multiplies exactly what the forward
    did, without casting again.
    """

    @staticmethod
    def forward(ctx, x, w):
        rows = x.shape[0]
        x8, x_inv = _to_fp8(_pad_rows(x), torch.float8_e4m3fn)
        w8, w_inv = _to_fp8(w, torch.float8_e4m3fn)
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        ctx.rows, ctx.x_dtype, ctx.w_dtype = rows, x.dtype, w.dtype
        # w8 is (out, in) row-major, so w8.t() is already column-major: no copy. Fast accumulation in the forward
        # only, as the standard recipe does; the gradients' products accumulate in full precision.
        y = torch._scaled_mm(x8, w8.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=x.dtype, use_fast_accum=True)
        return y[:rows]

    @staticmethod
    def backward(ctx, grad_y):
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        g8, g_inv = _to_fp8(_pad_rows(grad_y), torch.float8_e5m2)
        grad_x = torch._scaled_mm(g8, _column_major(w8), scale_a=g_inv, scale_b=w_inv, out_dtype=ctx.x_dtype)
        grad_w = torch._scaled_mm(g8.t().contiguous(), _column_major(x8), scale_a=g_inv, scale_b=x_inv,
                                  out_dtype=ctx.w_dtype)
        return grad_x[:ctx.rows], grad_w
