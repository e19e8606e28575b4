"""
Attention by other kernels than SDPA: the softmax written out ("eager") or FlexAttention ("flex").

Both compute gpt.attention's softmax(q k^T / sqrt(D) + mask) v over the full context (causal, a layer's sliding
window).

- "eager": matmul, softmax in fp32, matmul: every number a reader can check by hand, at the cost of the (T, T)
  scores in memory.
- "flex": torch's FlexAttention, compiled: the mask is a rule (mask_mod) turned into a block mask once per shape, and
  the kernel skips the blocks of keys that causality or a window hides: a window's layer costs what it sees. On a GPU
  it is the one kernel without a download that computes sliding windows at their cost (SDPA with a mask runs dense).

Rules. Each kernel computes what transformers' attn_implementation of the same name computes, the same ops in the same
order ("eager": matmul, add 0 or float's min, softmax(dtype=float32), matmul; "flex": the same block mask, the same
compiled call): our model run with one gives an exported model's logits under that implementation to the bit (fp32;
tests/test_export_remote.py). Between kernels the rounding differs (fp32: within 1e-5 of SDPA's,
tests/test_attention.py). Full-context calls only: q, k and v of the same T (training, evaluation without a cache);
decoding keeps SDPA. GPT.attention_kernel picks one ("sdpa" by default; base_train --attention).
"""

from functools import lru_cache

import torch
import torch.nn.functional as F

KERNELS = ("sdpa", "eager", "flex")


def visible(q_idx, kv_idx, window):
    """Whether the query at q_idx sees the key at kv_idx: causal, and at most `window` back (None: no limit)."""
    seen = kv_idx <= q_idx
    return seen if window is None else seen & (q_idx - kv_idx <= window)


def eager_attention(q, k, v, window=None):
    """q (B, H, T, D), k and v (B, Hkv, T, D) -> (B, H, T, D) in plain matmuls (GQA: key heads repeated)."""
    T = q.size(2)
    groups = q.size(1) // k.size(1)
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * q.size(-1) ** -0.5
    positions = torch.arange(T, device=q.device)
    mask = visible(positions[:, None], positions[None, :], window)
    scores = scores + torch.where(mask, 0.0, torch.finfo(scores.dtype).min).to(scores.dtype)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def block_mask(T, window, device):
    """FlexAttention's BlockMask of visible() for T queries over T keys (blocks of 128)."""
    from torch.nn.attention.flex_attention import create_block_mask
    return create_block_mask(lambda b, h, q_idx, kv_idx: visible(q_idx, kv_idx, window), None, None, T, T,
                             device=device)


cached_block_mask = lru_cache(maxsize=64)(block_mask)  # one per (T, window, device): made once, not per layer


@lru_cache(maxsize=1)
def compiled_flex():
    """flex_attention compiled once (uncompiled it runs a slow reference of the arithmetic, and warns)."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention)


def flex_attention(q, k, v, window=None):
    """q (B, H, T, D), k and v (B, Hkv, T, D) -> (B, H, T, D) by FlexAttention (GQA native)."""
    from torch.nn.attention.flex_attention import flex_attention as flex
    T = q.size(2)
    if torch.compiler.is_compiling():  # inside a compiled model: traced with it (the mask's cost folds into the graph)
        if q.device.type == "cpu":  # torch 2.13's CPU template misreads strided views of computed tensors (tested)
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return flex(q, k, v, block_mask=block_mask(T, window, q.device), enable_gqa=True, scale=q.size(-1) ** -0.5)
    return compiled_flex()(q, k, v, block_mask=cached_block_mask(T, window, q.device), enable_gqa=True,
                           scale=q.size(-1) ** -0.5)


def kernel(name):
    """The attention function `name` (KERNELS but "sdpa", which is gpt.attention itself): f(q, k, v, window)."""
    return {"eager": eager_attention, "flex": flex_attention}[name]
