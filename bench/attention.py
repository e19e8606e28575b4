"""
Attention's speed by kernel, for picking the fastest PyTorch offers without a download (issue 37 item 3): SDPA's
backends one at a time (flash, cuDNN, memory-efficient, math) and FlexAttention (compiled), each on causal attention
over the whole context and with a sliding window (gpt.layer_windows' S: a quarter of the context), forward + backward
at a model's shapes (default: depth 20's 10 heads of 128, 2048 tokens, 32 rows as the speedrun's micro-batch).

    python bench/attention.py                                        # on the GPU, depth 20's shapes
    python bench/attention.py --heads=12 --rows=16                   # depth 24's
    python bench/attention.py --device_type=cpu --rows=2 --seq=256 --repeats=2   # plumbing, on a CPU

Prints one row per (kernel, window): milliseconds for forward + backward, TFLOP/s (causal FLOPs: the half of the
T x T square a query sees, or T x window), and the largest difference from the math backend's output in the same
dtype (a kernel that computes something else shows here). A kernel that refuses the inputs (flash and cuDNN take no
mask, so no window) says so instead of a time. What gpt.attention runs: SDPA with is_causal (the backend SDPA
picks) without a window, SDPA with a boolean mask with one.
"""

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanochat.configurator import configure
from nanochat.gpt import visible

heads = 10  # query heads (depth 20: 10 of 128)
kv_heads = 10  # key/value heads
head_dim = 128
rows = 32  # sequences per call (the speedrun's micro-batch at depth 20)
seq = 2048  # tokens per sequence
window = -1  # the sliding window; -1: gpt.layer_windows' S for this seq (a quarter, rounded up to 128)
repeats = 10  # timed calls per kernel, after 3 warm-up calls
device_type = "cuda"
dtype = "bfloat16"
config = configure(globals())

device = torch.device(device_type)
dt = getattr(torch, dtype)
window = window if window >= 0 else -(-seq // 512) * 128
sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
gen = torch.Generator(device=device).manual_seed(0)
q = torch.randn(rows, heads, seq, head_dim, device=device, dtype=dt, generator=gen).requires_grad_()
k = torch.randn(rows, kv_heads, seq, head_dim, device=device, dtype=dt, generator=gen).requires_grad_()
v = torch.randn(rows, kv_heads, seq, head_dim, device=device, dtype=dt, generator=gen).requires_grad_()
grad = torch.randn(rows, heads, seq, head_dim, device=device, dtype=dt, generator=gen)
gqa = heads != kv_heads
positions = torch.arange(seq, device=device)
masks = {"causal": None, f"window {window}": visible(positions[:, None], positions, window)}  # gpt.py's window rule


def sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(mask):
        with sdpa_kernel(getattr(SDPBackend, backend)):
            if mask is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return run


def flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    compiled = torch.compile(flex_attention)
    block_masks = {}

    def run(mask):
        key = None if mask is None else window
        if key not in block_masks:  # the block mask is made once per pattern, as a training run would
            mod = lambda b, h, qi, ki: visible(qi, ki, key)
            block_masks[key] = create_block_mask(mod, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device=device_type)
        return compiled(q, k, v, block_mask=block_masks[key], enable_gqa=gqa)
    return run


def sdpa_default(mask):
    """What gpt.attention runs: SDPA with is_causal (the backend SDPA picks), or with the window's boolean mask."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


kernels = {"SDPA default": sdpa_default, "SDPA flash": sdpa("FLASH_ATTENTION"), "SDPA cuDNN": sdpa("CUDNN_ATTENTION"),
           "SDPA efficient": sdpa("EFFICIENT_ATTENTION"), "SDPA math": sdpa("MATH"), "FlexAttention (compiled)": flex()}
name = torch.cuda.get_device_name() if device_type == "cuda" else "CPU"
print(f"{name}, torch {torch.__version__}, {dtype}: {rows} x {heads} heads ({kv_heads} kv) x {seq} x {head_dim}, "
      f"forward + backward, median of {repeats}")
print("| kernel | attention | ms | TFLOP/s | max diff from math |")
print("|---|---|---|---|---|")
for mask_name, mask in masks.items():
    reference = sdpa("MATH")(mask).detach()
    # keys per query, summed
    seen = seq * (seq + 1) / 2 if mask is None else sum(min(i, window) + 1 for i in range(seq))
    flops = 4 * rows * heads * head_dim * seen * 3.5  # 2 matmuls forward; backward ~2.5x the forward (5 matmuls)
    for kernel_name, run in kernels.items():
        try:
            out = run(mask)
            out.backward(grad)
            times = []
            for i in range(3 + repeats):
                sync()
                t0 = time.perf_counter()
                run(mask).backward(grad)
                sync()
                times.append(time.perf_counter() - t0)
            ms = sorted(times[3:])[repeats // 2] * 1e3
            diff = (out.detach().float() - reference.float()).abs().max().item()
            print(f"| {kernel_name} | {mask_name} | {ms:.2f} | {flops / ms / 1e9:.3g} | {diff:.2e} |", flush=True)
        except Exception as e:  # a backend that does not take these inputs (a mask, this dtype, this device)
            reason = f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
            print(f"| {kernel_name} | {mask_name} | refused: {reason} | | |", flush=True)
        q.grad = k.grad = v.grad = None
