"""
The attention kernels, one registry: SDPA, the dense CPU kernel, the softmax written out, FlexAttention, and "auto".

Each computes gpt.attention's softmax(q k^T / sqrt(D) + mask) v over the full context (training, evaluation without a
cache: q, k and v of the same T), its mask gpt.visible, the window rule of gpt.py's architecture part (causal, a
layer's sliding window). GPT.attention_kernel holds the one a model runs, f(q, k, v, window=): SDPA by default; a
training stage sets it at its start (Stage.start asks choose_kernel: base_train --attention, "auto" in the other
stages). Decoding with a KV cache keeps SDPA.

- "sdpa": gpt.attention itself, torch's scaled_dot_product_attention.
- "dense": training steps on a CPU in bf16, the scores in batched matmuls by blocks of queries (dense_attention), where
  SDPA's flash kernel runs small blocks with bookkeeping between them; every other call SDPA (dense_in_training).
- "eager": matmul, softmax in fp32, matmul: every number a reader can check by hand, at the cost of the (T, T)
  scores in memory.
- "flex": torch's FlexAttention, compiled: the mask is a rule (mask_mod) turned into a block mask once per shape, and
  the kernel skips the blocks of keys that causality or a window hides: a window's layer costs what it sees. On a GPU
  it is the one kernel without a download that computes sliding windows at their cost (SDPA with a mask runs dense).
- "auto": "dense" where probes.dense_attention_pays measured it faster on this machine (a CPU computing in bf16
  without GQA; the answer kept per machine), else "sdpa".

Rules. "eager" and "flex" compute what transformers' attn_implementation of the same name computes, the same ops in
the same order ("eager": matmul, add 0 or float's min, softmax(dtype=float32), matmul; "flex": the same block mask,
the same compiled call): our model run with one gives an exported model's logits under that implementation to the bit
(fp32; tests/test_export_remote.py). Between kernels the rounding differs (fp32: within 1e-5 of SDPA's,
tests/test_attention.py; dense in bf16: SDPA's own error, tests/test_dense_attention.py). Why dense, and when it pays:
docs/hardware.md ("Attention in training on a CPU").
"""

from functools import lru_cache

import torch
import torch.nn.functional as F

from nanochat.gpt import attention, visible
from nanochat.probes import dense_attention_pays

# dense_attention by blocks of DENSE_ROWS queries (2x below 8 heads in all), each against the key pieces it sees: the
# square's upper blocks are never made; pieces joined by cat, whose gradient is a split (a slice's is zero-padded)
DENSE_ROWS = 128


def dense_attention(q, k, v, window=None):
    """
    gpt.attention(q, k, v, window=window) of a training step: q, k, v (B, H, T, D), as many key heads as query heads.
    The scores in batched matmuls, by blocks of DENSE_ROWS queries, each against the key pieces it sees; -inf where
    gpt.visible hides a key, then the softmax: SDPA's math.
    """
    B, H, T, D = q.shape
    positions = torch.arange(T, device=q.device)
    mask = visible(positions[:, None], positions, window)
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


def dense_in_training(q, k, v, window=None):
    """
    The "dense" kernel: dense_attention in a training step (autograd on) computing in bf16 without GQA, what the probe
    measures; gpt.attention (SDPA) in every other call, so that evaluation, sampling and fp32 keep SDPA's numbers.
    """
    if torch.is_grad_enabled() and q.dtype == torch.bfloat16 and q.size(1) == k.size(1):
        return dense_attention(q, k, v, window)
    return attention(q, k, v, window=window)


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
    """FlexAttention's BlockMask of gpt.visible for T queries over T keys (blocks of 128); window None, int, tensor."""
    from torch.nn.attention.flex_attention import create_block_mask
    return create_block_mask(lambda b, h, q_idx, kv_idx: visible(q_idx, kv_idx, window), None, None, T, T,
                             device=device)


@lru_cache(maxsize=64)
def cached_block_mask(T, window, device):
    """
    block_mask for the compiled kernel called outside a compiled model, made once per (T, window, device), not per
    layer. Its window is a tensor (no window: T, which hides nothing that causality does not), which the kernel reads:
    one kernel serves every window of a model, where an int, a constant of the kernel, compiles one per window.
    Inside a compiled model the int stays: the mask is traced with the model (the CPU kernel takes no tensor there).
    """
    return block_mask(T, torch.tensor(T if window is None else window, device=device), device)


@lru_cache(maxsize=1)
def compiled_flex():
    """flex_attention compiled once (uncompiled it runs a slow reference of the arithmetic, and warns)."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention)


def flex_attention(q, k, v, window=None):
    """q (B, H, T, D), k and v (B, Hkv, T, D) -> (B, H, T, D) by FlexAttention (GQA native)."""
    from torch.nn.attention.flex_attention import flex_attention as flex
    if torch.compiler.is_compiling():  # inside a compiled model: traced with it (the mask's cost folds into the graph)
        if q.device.type == "cpu":  # torch 2.13's CPU template misreads strided views of computed tensors (tested)
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        kernel, mask = flex, block_mask(q.size(2), window, q.device)
    else:
        kernel, mask = compiled_flex(), cached_block_mask(q.size(2), window, q.device)
    return kernel(q, k, v, block_mask=mask, enable_gqa=True, scale=q.size(-1) ** -0.5)


KERNELS = {"sdpa": attention, "dense": dense_in_training, "eager": eager_attention, "flex": flex_attention}
CHOICES = ("auto", *KERNELS)  # base_train --attention


def choose_kernel(name, config, device_type, compute_dtype):
    """
    (the kernel of CHOICES' `name` for a model of `config` training on `device_type` in `compute_dtype`, the start-up
    line saying which): "auto" asks the probe (probes.dense_attention_pays, timing SDPA and dense_attention).
    """
    if name != "auto":
        return KERNELS[name], f"Attention in training steps: {name} (base_train --attention)"
    dense, why = dense_attention_pays(config, device_type, compute_dtype, attention, dense_attention)
    return KERNELS["dense" if dense else "sdpa"], why
