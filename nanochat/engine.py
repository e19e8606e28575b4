"""
The inference engine: sampling from a trained GPT with a KV cache, several samples per prompt, the calculator tool.

Engine.generate(prompt, num_samples, max_tokens, ...) yields one (token_column, token_masks) per step: each sample's
next token, and 1 if the model sampled it, 0 if the tool forced it or the sample had ended (at <|assistant_end|> or
<|bos|>, yielded with mask 1; then its end token again). Prompt + generated tokens never exceed Engine.context_len
(UserError at the call), nothing runs ahead of the caller's iteration, and the result depends only on the arguments
and `seed`. How it works, with examples: docs/engine.md.
"""

import codecs
import math
import operator
from collections import deque
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from nanochat.cpu_kernels import onednn_off
from nanochat.execution import use_calculator
from nanochat.gpt import attention, hidden_states, layer_windows, softcapped, visible, weights_of
from nanochat.output import UserError
from nanochat.probes import fp32_cache_pays, native_bf16_gemv

# -----------------------------------------------------------------------------
# The KV cache


class KVCache:
    """
    Keys and values of the past positions, k and v of shape (n_layer, B, n_kv_head, capacity, head_dim); positions
    < pos are filled. At most `max_len` positions (ValueError past it); `capacity` are allocated (default max_len),
    doubled (up to max_len) when an insert needs more. GPT.forward calls insert_kv(layer, k, v) in every layer (pos
    advances after the last); decode_step writes one position per layer via k_layers / v_layers, then advance().
    """

    def __init__(self, batch_size, n_kv_head, max_len, head_dim, n_layer, device, dtype, capacity=None):
        self.batch_size = batch_size
        self.n_kv_head = n_kv_head
        self.head_dim = head_dim
        self.n_layer = n_layer
        self.max_len = max_len
        self.pos = 0
        self.k = self.v = None
        self._allocate(max_len if capacity is None else max(1, min(capacity, max_len)), device, dtype)

    def _allocate(self, capacity, device, dtype):
        shape = (self.n_layer, self.batch_size, self.n_kv_head, capacity, self.head_dim)
        k = torch.empty(shape, device=device, dtype=dtype)  # only positions < pos are ever read
        v = torch.empty(shape, device=device, dtype=dtype)
        if self.k is not None:
            k[:, :, :, :self.pos] = self.k[:, :, :, :self.pos]
            v[:, :, :, :self.pos] = self.v[:, :, :, :self.pos]
        self.k = k
        self.v = v
        self.capacity = capacity
        self._layer_views()

    def _layer_views(self):
        """The per-layer views k_layers, v_layers (B, n_kv_head, capacity, head_dim): made once, not at every step."""
        self.k_layers = [self.k[i] for i in range(self.n_layer)]
        self.v_layers = [self.v[i] for i in range(self.n_layer)]

    def reserve(self, t1):
        """Make room for positions up to t1 (exclusive): grow if needed; ValueError past max_len."""
        if t1 > self.max_len:
            raise ValueError(f"KV cache full: {t1} positions > max_len {self.max_len}")
        if t1 > self.capacity:
            self._allocate(min(self.max_len, max(t1, 2 * self.capacity)), self.k.device, self.k.dtype)

    def get_pos(self):  # the number of positions filled
        return self.pos

    def advance(self, n=1):
        self.pos += n

    def insert_kv(self, layer_idx, k, v):
        """Store k, v (B, n_kv_head, T, head_dim) at the next T positions; return all keys/values so far."""
        t0, t1 = self.pos, self.pos + k.size(2)
        if layer_idx == 0:
            self.reserve(t1)
        self.k_layers[layer_idx][:, :, t0:t1] = k
        self.v_layers[layer_idx][:, :, t0:t1] = v
        if layer_idx == self.n_layer - 1:
            self.pos = t1
        return self.k_layers[layer_idx][:, :, :t1], self.v_layers[layer_idx][:, :, :t1]

    def keep_rows(self, rows):
        """Keep only the rows `rows` (a tensor of row indices, in their new order): the others are dropped."""
        self.k = self.k[:, rows]
        self.v = self.v[:, rows]
        self.batch_size = self.k.size(1)
        self._layer_views()

    def place(self, other, rows, end):
        """
        Copy the filled positions of the batch-1 cache `other` into `rows` (a slice) of this cache, right-aligned to
        end at column `end`; pos is not moved. ValueError if the shapes do not match or `other` does not fit.
        """
        shape = (self.n_layer, self.n_kv_head, self.head_dim)
        if other.batch_size != 1 or (other.n_layer, other.n_kv_head, other.head_dim) != shape or other.pos > end:
            raise ValueError("place: the caches' shapes do not match")
        self.reserve(end)
        self.k[:, rows, :, end - other.pos:end] = other.k[:, :, :, :other.pos]
        self.v[:, rows, :, end - other.pos:end] = other.v[:, :, :, :other.pos]


def regroup(cache, padding, keep, joining, max_len, dtype):
    """
    Rows of different lengths in one cache, for a server whose requests join and leave a running batch: a new
    KVCache of `max_len` positions in `dtype` with rows `keep` (indices) of `cache` (None: no rows yet), then the
    batch-1 caches of the list `joining`, all right-aligned at the longest (pos = its length), the padding columns
    before each row zeros (masked-out keys still multiply their values by a zero weight: 0 x NaN). `padding`: each
    row's padding columns in `cache`.
    Returns (the new cache, its rows' padding); (None, []) when no row is left. Rows move, their values do not
    change: a row decodes the same tokens in any batch, up to float rounding.
    """
    lengths = [cache.pos - padding[i] for i in keep] + [other.pos for other in joining]
    if not lengths:
        return None, []
    ref = cache if keep else joining[0]
    pos = max(lengths)
    out = KVCache(len(lengths), ref.n_kv_head, max_len, ref.head_dim, ref.n_layer, ref.k.device, dtype,
                  capacity=pos + 256)
    out.k[:, :, :, :pos] = 0
    out.v[:, :, :, :pos] = 0
    if keep:  # the kept rows' filled columns in one copy (the padding inside them is zeros already)
        span = max(lengths[:len(keep)])
        rows = torch.tensor(keep, device=ref.k.device)
        out.k[:, :len(keep), :, pos - span:pos] = cache.k[:, rows, :, cache.pos - span:cache.pos]
        out.v[:, :len(keep), :, pos - span:pos] = cache.v[:, rows, :, cache.pos - span:cache.pos]
    for j, other in enumerate(joining):
        out.place(other, slice(len(keep) + j, len(keep) + j + 1), pos)
    out.advance(pos)
    return out, [pos - n for n in lengths]


# -----------------------------------------------------------------------------
# One decoding step: gpt.py's blocks, their keys and values written into the cache; the next token's sampling;
# naive generation (no cache), the reference


@torch.no_grad()
def decode_weights(model, dtype=None, row_major=False):
    """
    The gpt.Weights decode_step reads. On CUDA the parameters themselves, or copies in `dtype` where it is not
    theirs (a bf16 step then reads each matrix once in bf16, instead of reading it in fp32 and writing and reading a
    bf16 cast of it, autocast's, at every step); on CPU copies of the matrices in `dtype` (default the weights') stored
    column-major, which streams faster through oneDNN and MKL (docs/model.md), or with row_major, for torch's own
    kernels (probes.native_bf16_gemv: one or two rows in bf16); the lookup tables (wte, value embeddings) are looked
    up, not multiplied: kept as they are. Copies are stale once the weights change.
    """
    if model.lm_head.weight.device.type == "cpu":
        if row_major:
            return weights_of(model, lambda w: w.detach().to(dtype or w.dtype, copy=True))
        return weights_of(model, lambda w: w.detach().to(dtype or w.dtype).t().contiguous().t())
    if dtype is not None and dtype != model.lm_head.weight.dtype:
        return weights_of(model, lambda w: w.detach().to(dtype))
    return weights_of(model)


@torch.no_grad()
def decode_step(model, idx, kv_cache, weights, positions=None, key_mask=None):
    """
    model(idx[:, None], kv_cache=kv_cache)[:, -1] for one new token per row, gpt.hidden_states without nn.Module calls:
    idx (B,) the newest token of each row, kv_cache everything before it (attention runs in the cache's dtype: fp32
    under bf16 where probes.fp32_cache_pays), `weights` from decode_weights(); returns the logits (B, vocab) fp32 and
    advances the cache one position. Right-aligned rows of different prompt lengths: `positions` (B,) each row's own
    position, `key_mask` (B, 1, 1, >= pos + 1) bool, False on the padding before its prompt.
    """
    pos = kv_cache.pos
    if pos + 1 > model.rotary_len:
        raise ValueError(f"sequence of {pos + 1} tokens exceeds the rotary table ({model.rotary_len})")
    kv_cache.reserve(pos + 1)
    dtype = weights.wte.dtype
    if torch.is_autocast_enabled(idx.device.type):
        dtype = torch.get_autocast_dtype(idx.device.type)
    if positions is None:  # every row at the cache's position
        cos = model.cos[:, pos:pos + 1].to(dtype)
        sin = model.sin[:, pos:pos + 1].to(dtype)
    else:  # (B, 1, 1, D/2): each row at its own position
        cos = model.cos[0, positions][:, None].to(dtype)
        sin = model.sin[0, positions][:, None].to(dtype)
    mask = None if key_mask is None else key_mask[..., :pos + 1]

    def attend(i, q, k, v, window):  # this position's keys and values into the cache, then attend over all of it
        k_cache = kv_cache.k_layers[i]  # (B, Hkv, capacity, D)
        v_cache = kv_cache.v_layers[i]
        k_cache[:, :, pos] = k[:, :, 0]
        v_cache[:, :, pos] = v[:, :, 0]
        y = attention(q.to(k_cache.dtype), k_cache[:, :, :pos + 1], v_cache[:, :, :pos + 1], mask, window)
        return y.to(q.dtype)

    # matrices already copies in the compute dtype (decode_weights on a CPU): autocast would only add its check to
    # each of the step's ~300 ops, so it is off for the step. Row-major copies on a CPU are multiplied by torch's own
    # kernels, with oneDNN off (decode_weights(row_major=True), where probes.native_bf16_gemv measured it faster)
    copies = torch.is_autocast_enabled(idx.device.type) and weights.lm_head.dtype == dtype
    native = idx.device.type == "cpu" and weights.lm_head.is_contiguous()
    autocast_off = torch.autocast(idx.device.type, enabled=False) if copies else nullcontext()
    with autocast_off, onednn_off() if native else nullcontext():
        x = hidden_states(weights, idx[:, None], (cos, sin), attend, model.config)
        logits = softcapped(F.linear(x[:, -1], weights.lm_head))
    kv_cache.advance()
    return logits


def static_step(weights, idx, column, positions, k_layers, v_layers, cos_table, sin_table, key_mask, config, dtype):
    """
    decode_step's arithmetic with every shape fixed and nothing in Python decided by a tensor's value, for
    torch.compile (Engine(compile_decode=True); on CUDA its mode "reduce-overhead" replays the step as one CUDA graph
    instead of launching its hundreds of small kernels one by one). idx (B,) each row's newest token; column (1,) long
    the cache column its keys and values go to (one for every row: rows are right-aligned); positions (B,) long each
    row's own position (rotary); k_layers, v_layers the cache's per-layer tensors (KVCache.k_layers, v_layers: each
    (B, n_kv_head, capacity, head_dim)), written at `column` (one tensor per layer, not the (n_layer, ...) whole:
    torch.compile then writes the column in place; a write into a slice of the whole copied all of it at every
    layer);
    cos_table, sin_table the model's (1, rotary_len, 1, head_dim / 2) fp32 tables; key_mask (B, 1, 1, capacity) bool,
    False on a row's padding, or None; `dtype` the compute dtype, which `weights` (matrices already copies in it)
    are in. Attention reads every column of the cache, masked to those at or before `column` (and within the layer's
    window): a masked key still multiplies its value by a zero weight, so the columns never written must hold finite
    values (zeros). Returns the logits (B, vocab) fp32; the caller advances the cache.
    """
    capacity = k_layers[0].size(2)
    cos = cos_table[0, positions][:, None].to(dtype)  # (B, 1, 1, D/2)
    sin = sin_table[0, positions][:, None].to(dtype)
    columns = torch.arange(capacity, device=idx.device)
    seen = {}  # window -> (B or 1, 1, 1, capacity) bool, made once per step for all the layers sharing it
    for window in set(layer_windows(config)):
        mask = visible(column, columns, window)[None, None, None, :]
        seen[window] = mask if key_mask is None else mask & key_mask

    def attend(i, q, k, v, window):
        k_layer = k_layers[i]
        v_layer = v_layers[i]
        k_layer.index_copy_(2, column, k.to(k_layer.dtype))
        v_layer.index_copy_(2, column, v.to(v_layer.dtype))
        y = F.scaled_dot_product_attention(q.to(k_layer.dtype), k_layer, v_layer, attn_mask=seen[window],
                                           enable_gqa=q.size(1) != k_layer.size(1))
        return y.to(q.dtype)

    x = hidden_states(weights, idx[:, None], (cos, sin), attend, config)
    return softcapped(F.linear(x[:, -1], weights.lm_head))


def sample_next_token(logits, rng, temperature=1.0, top_k=None):
    """
    Logits (B, vocab) -> the next token of each row, (B,) long. temperature 0: the argmax (greedy; rng unused).
    Otherwise one draw per row from softmax(logits / temperature), over the top_k largest logits only when top_k is
    a positive int (None or 0: the whole vocabulary), by inverse transform sampling (docs/model.md). All randomness
    comes from `rng` (a torch.Generator on the logits' device, or a list of them, one per row); the global RNG is not
    touched.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    indices = None
    if top_k and top_k < logits.size(-1):
        logits, indices = torch.topk(logits, top_k, dim=-1)
    cdf = torch.softmax(logits / temperature, dim=-1).cumsum(dim=-1)
    total = cdf[:, -1:]  # 1 up to rounding
    if isinstance(rng, torch.Generator):
        u = torch.rand(total.shape, generator=rng, device=total.device, dtype=total.dtype)
    else:  # one generator per row: a row's draws do not depend on the rows beside it
        u = torch.cat([torch.rand((1, 1), generator=g, device=total.device, dtype=total.dtype) for g in rng])
    u = u * total
    # u < total: rounding could land u on it, past every token (a zero-probability token is never chosen)
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    choice = torch.searchsorted(cdf, u, right=True)  # the first token whose cumulative probability exceeds u
    return (choice if indices is None else indices.gather(-1, choice)).squeeze(-1)


@torch.no_grad()
def generate_naive(model, tokens, max_tokens, temperature=1.0, top_k=None, seed=42):
    """
    Naive sampling, the whole sequence through model.forward again each step (no KV cache): yields `max_tokens`
    token ids (int), one at a time. The quick samples of base training, and the Engine's reference (the same
    sample_next_token, the same seed: the same tokens up to float rounding).
    """
    device = model.lm_head.weight.device
    rng = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    for _ in range(max_tokens):
        next_id = sample_next_token(model(ids)[:, -1, :], rng, temperature, top_k)
        ids = torch.cat((ids, next_id[:, None]), dim=1)
        yield next_id.item()


# -----------------------------------------------------------------------------
# Streaming text


class TextStreamer:
    """
    Token ids in, text out as they arrive, never cutting a UTF-8 character in half (tokens hold bytes: docs/engine.md).
    The pieces joined equal tokenizer.decode(all ids); special tokens come out as their names.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def put(self, token_id):
        """Add one token; return the text it completes (possibly "")."""
        return self._decoder.decode(self.tokenizer.enc.decode_single_token_bytes(int(token_id)))

    def end(self):
        """The stream is over: return what is left (U+FFFD for an incomplete trailing character) and reset."""
        return self._decoder.decode(b"", final=True)


# -----------------------------------------------------------------------------
# The engine


class Sample:
    """
    One sample's state: tokens the tool still has to force in, the python expression being written (None outside
    <|python_start|> ... <|python_end|>), and the token that ended it (None while it runs).
    """

    def __init__(self):
        self.forced = deque()
        self.expression = None
        self.end_token = None


def _check_int(name, value, minimum, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"{name} must be an integer >= {minimum}{' or None' if allow_none else ''}, got {value!r}")


class Engine:
    """
    Generation from `model` (a GPT) with `tokenizer` (see the module docstring). Public attributes: `context_len`
    (the longest prompt + generation), `end_tokens` (the ids of <|assistant_end|> and <|bos|>), `vocab_size`,
    `model`, `tokenizer`.
    """

    def __init__(self, model, tokenizer, context_len=None, compile_decode=False):
        """
        `context_len`: the longest sequence (prompt + generated) a generation may reach; default
        model.config.sequence_len, the training length. At most model.rotary_len. `compile_decode`: decode with
        static_step under torch.compile (mode "reduce-overhead" on CUDA: each step one CUDA graph), over a cache of
        fixed shape kept between calls (docs/engine.md, "The compiled step"); the first step of each new batch size
        and cache size compiles.
        """
        self.model = model
        self.tokenizer = tokenizer
        self.context_len = model.config.sequence_len if context_len is None else context_len
        fits = isinstance(self.context_len, int) and 2 <= self.context_len <= model.rotary_len
        if isinstance(context_len, bool) or not fits:
            raise UserError(f"context_len must be an integer in [2, {model.rotary_len}] (the model's rotary table), "
                            f"got {context_len!r}")
        self.vocab_size = model.config.vocab_size
        special = tokenizer.encode_special
        self.end_tokens = (special("<|assistant_end|>"), special("<|bos|>"))
        self.python_start = special("<|python_start|>")
        self.python_end = special("<|python_end|>")
        self.output_start = special("<|output_start|>")
        self.output_end = special("<|output_end|>")
        self._weights = {}  # row_major -> (key, weights): both layouts kept, as a server's batch grows and shrinks
        if not isinstance(compile_decode, bool):
            raise UserError(f"compile_decode must be True or False, got {compile_decode!r}")
        self.compile_decode = compile_decode
        self._static_caches = {}  # (rows, capacity, dtype) -> KVCache: the compiled step's caches, kept between calls
        if compile_decode:  # static shapes (dynamic=False): a new batch size or capacity compiles anew, once
            cuda = model.lm_head.weight.device.type == "cuda"
            self._static_step = torch.compile(static_step, mode="reduce-overhead" if cuda else None, dynamic=False,
                                              fullgraph=True)

    def _decode_weights(self, rows=None, static=False):
        """
        decode_weights(model) in the dtype in use, for decoding `rows` rows (row-major copies where
        probes.native_bf16_gemv says so), made again only when the dtype, the layout or a parameter changed since the
        last call (its identity, or its version counter, which torch bumps at every in-place change). static: for
        static_step, the matrices copied in the compute dtype on any device (its CUDA graph then reads bf16, not fp32
        weights cast at every step), every tensor marked as a static address (a CUDA graph reads it where it is
        instead of copying it in at each replay).
        """
        head = self.model.lm_head.weight
        dtype = head.dtype
        if torch.is_autocast_enabled(head.device.type):
            dtype = torch.get_autocast_dtype(head.device.type)
        bf16_cpu = head.device.type == "cpu" and dtype == torch.bfloat16
        layout = "static" if static else rows is not None and bf16_cpu and native_bf16_gemv(rows)
        key = (dtype, *((id(p), p._version) for p in self.model.parameters()))
        if self._weights.get(layout, (None,))[0] != key:
            if static:
                weights = weights_of(self.model, lambda w: w.detach().to(dtype, copy=True))
                tensors = [weights.wte, weights.lm_head, weights.resid_lambdas, weights.x0_lambdas,
                           *(t for layer in weights.layers for t in layer[:6])]
                for t in tensors:
                    if t is not None:
                        torch._dynamo.mark_static_address(t, guard=False)
            else:
                weights = decode_weights(self.model, dtype, layout)
            self._weights[layout] = (key, weights)
        return self._weights[layout][1]

    def _static_cache(self, rows, capacity, dtype):
        """
        An empty KVCache of `rows` rows and `capacity` positions for the compiled step: the one a past generation of
        that shape left (a CUDA graph replays on the addresses it was recorded with), else a new one, zeros (finite:
        static_step reads every column). A generation holds it alone until it ends (_keep_static_cache): two at once
        get two caches.
        """
        cache = self._static_caches.pop((rows, capacity, dtype), None)
        if cache is None:
            cfg = self.model.config
            cache = KVCache(rows, cfg.n_kv_head, capacity, cfg.n_embd // cfg.n_head, cfg.n_layer,
                            self.model.lm_head.weight.device, dtype)
            cache.k.zero_()
            cache.v.zero_()
            for t in cache.k_layers + cache.v_layers:
                torch._dynamo.mark_static_address(t, guard=False)
        cache.pos = 0
        return cache

    def _keep_static_cache(self, cache):
        """Keep a generation's cache for the next of its shape; at most 4 shapes, the least recently used dropped."""
        self._static_caches[(cache.batch_size, cache.capacity, cache.k.dtype)] = cache
        if len(self._static_caches) > 4:
            self._static_caches.pop(next(iter(self._static_caches)))

    def dtypes(self):
        """
        (the compute dtype, the KV cache's dtype) of a generation started now, in this thread: autocast's dtype or
        the weights', and fp32 for the cache of a bf16 decode on a CPU where probes.fp32_cache_pays.
        """
        device = self.model.lm_head.weight.device
        autocast = torch.is_autocast_enabled(device.type)
        dtype = torch.get_autocast_dtype(device.type) if autocast else self.model.lm_head.weight.dtype
        if device.type == "cpu" and dtype == torch.bfloat16 and fp32_cache_pays():
            return dtype, torch.float32
        return dtype, dtype

    def _check_arguments(self, tokens, num_samples, max_tokens, temperature, top_k, seed):
        """The prompt as a list of ints, and the number of steps to run; UserError for a bad argument."""
        try:
            tokens = [operator.index(t) for t in tokens]
        except TypeError:
            raise UserError("tokens must be a sequence of integer token ids "
                            "(e.g. tokenizer.encode(text, prepend='<|bos|>'))") from None
        if not tokens:
            raise UserError("the prompt is empty: give at least one token (e.g. <|bos|>)")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the model's vocabulary [0, {self.vocab_size})")
        _check_int("num_samples", num_samples, 1)
        _check_int("max_tokens", max_tokens, 0, allow_none=True)
        _check_int("top_k", top_k, 0, allow_none=True)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise UserError(f"seed must be an integer, got {seed!r}")
        number = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
        if not number or not math.isfinite(temperature) or temperature < 0:
            raise UserError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
        room = self.context_len - len(tokens)
        if max_tokens is None:
            if room < 1:
                raise UserError(f"the prompt ({len(tokens)} tokens) leaves no room in the context of "
                                f"{self.context_len} tokens: shorten it")
            return tokens, room
        if max_tokens > room:
            raise UserError(f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) = {len(tokens) + max_tokens} "
                            f"exceeds the context of {self.context_len} tokens (Engine.context_len): lower max_tokens, "
                            f"shorten the prompt, or pass max_tokens=None to generate until the context is full")
        return tokens, max_tokens

    def generate(self, tokens, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seed=42):
        """
        Sample `num_samples` continuations of the prompt `tokens` (token ids) together. Yields, per step,
        (token_column, token_masks): lists of num_samples token ids and masks (module docstring). At most
        `max_tokens` steps (None: until the context is full); returns early when every sample has ended. Arguments
        are checked at the call (UserError), before the first step is asked for.
        """
        tokens, steps = self._check_arguments(tokens, num_samples, max_tokens, temperature, top_k, seed)
        return self._generate([tokens], num_samples, steps, temperature, top_k, seed)

    def generate_many(self, prompts, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seed=42):
        """
        generate() for several prompts (of any lengths) decoded together: entry p * num_samples + s of a column is
        sample s of prompts[p]. `max_tokens` applies to every prompt and must fit after the longest (None: until the
        longest prompt fills the context). The samples depend on the seed and on which prompts go together.
        """
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or not prompts:
            raise UserError("prompts must be a non-empty list of prompts (lists of token ids)")
        checked = [self._check_arguments(p, num_samples, max_tokens, temperature, top_k, seed) for p in prompts]
        return self._generate([tokens for tokens, _ in checked], num_samples, min(steps for _, steps in checked),
                              temperature, top_k, seed)

    @torch.inference_mode()
    def _generate(self, prompts, num_samples, steps, temperature, top_k, seed):
        if steps == 0:
            return
        model = self.model
        cfg = model.config
        device = model.lm_head.weight.device
        dtype, cache_dtype = self.dtypes()
        head_dim = cfg.n_embd // cfg.n_head
        rng = torch.Generator(device=device).manual_seed(seed)
        longest = max(len(tokens) for tokens in prompts)
        rows = len(prompts) * num_samples

        # Each prompt once at batch 1, then copied into its samples' rows, right-aligned (docs/engine.md). The last
        # token sampled is never fed back, hence the - 1.
        compiled = self.compile_decode
        if compiled:  # the capacity rounded up to 128 positions: fewer shapes to compile, at most 127 columns more
            cache = self._static_cache(rows, -(-(longest + steps - 1) // 128) * 128, cache_dtype)
        else:
            cache = KVCache(rows, cfg.n_kv_head, longest + steps - 1, head_dim, cfg.n_layer, device, cache_dtype,
                            capacity=longest + 256)
        logits = []
        for p, tokens in enumerate(prompts):
            prompt_cache = KVCache(1, cfg.n_kv_head, len(tokens), head_dim, cfg.n_layer, device, dtype)
            prompt = torch.tensor([tokens], dtype=torch.long, device=device)
            logits.append(model.prefill(prompt, prompt_cache))  # (1, vocab)
            rows_of_p = slice(p * num_samples, (p + 1) * num_samples)
            cache.place(prompt_cache, rows_of_p, longest)
            # masked-out padding still multiplies its value by a zero weight: zeros, not uninitialised memory (0 x NaN)
            cache.k[:, rows_of_p, :, :longest - len(tokens)] = cache.v[:, rows_of_p, :, :longest - len(tokens)] = 0
        cache.advance(longest)
        # every sample starts from its prompt's prediction
        logits = torch.cat(logits).repeat_interleave(num_samples, dim=0)
        padding = torch.tensor([longest - len(tokens) for tokens in prompts], device=device)
        padding = padding.repeat_interleave(num_samples)
        if padding.any():  # prompts of different lengths: each row at its own position, its padding masked out
            key_mask = torch.arange(cache.max_len, device=device)[None, None, None, :] >= padding[:, None, None, None]
        else:  # one prompt, or prompts of one length: the plain step
            padding = key_mask = None

        # Decode. The cache's rows are the samples still running (`in_cache`, sample numbers); when a quarter of them
        # have ended, the rest move to a smaller cache, so ended samples stop costing compute (docs/engine.md).
        samples = [Sample() for _ in range(rows)]
        in_cache = list(range(rows))
        weights = None
        try:
            for step in range(steps):
                sampled = dict(zip(in_cache, sample_next_token(logits, rng, temperature, top_k).tolist()))
                column = []
                masks = []
                for i, sample in enumerate(samples):
                    token, mask = self.next_token(sample, sampled.get(i))
                    column.append(token)
                    masks.append(mask)
                yield column, masks
                running = [k for k, i in enumerate(in_cache) if samples[i].end_token is None]  # positions in the cache
                if step == steps - 1 or not running:
                    return
                if len(running) <= 0.75 * len(in_cache) and not compiled:  # compiled: one shape, no recompiling
                    keep = torch.tensor(running, device=device)
                    cache.keep_rows(keep)
                    padding = None if padding is None else padding[keep]
                    key_mask = None if key_mask is None else key_mask[keep]
                    in_cache = [in_cache[k] for k in running]
                if weights is None:  # made after the first token is out, so they do not delay it
                    weights = self._decode_weights(len(in_cache), static=compiled)
                positions = None if padding is None else cache.pos - padding
                newest = torch.tensor([column[i] for i in in_cache], dtype=torch.long, device=device)
                if compiled:
                    where = torch.tensor([cache.pos], device=device)
                    positions = where.expand(len(in_cache)) if positions is None else positions
                    if device.type == "cuda":  # a new step: the last one's graph outputs (its logits) are used up
                        torch.compiler.cudagraph_mark_step_begin()
                    with torch.autocast(device.type, enabled=False):  # the weights are copies in the compute dtype
                        logits = self._static_step(weights, newest, where, positions, cache.k_layers, cache.v_layers,
                                                   model.cos, model.sin, key_mask, cfg, dtype)
                    cache.advance()
                else:
                    logits = decode_step(model, newest, cache, weights, positions, key_mask)
        finally:  # the cache free again for the next generation of its shape (none shares it meanwhile)
            if compiled:
                self._keep_static_cache(cache)

    def next_token(self, sample, sampled):
        """The token sample `sample` gets this step, and its mask; runs the tool when an expression closes."""
        if sample.end_token is not None:
            return sample.end_token, 0  # padding: the sample has ended
        if sample.forced:
            token = sample.forced.popleft()
            mask = 0
        else:
            token = sampled
            mask = 1
        if token in self.end_tokens:
            sample.end_token = token
        elif token == self.python_start:
            sample.expression = []
        elif token == self.python_end and sample.expression is not None:
            result = use_calculator(self.tokenizer.decode(sample.expression))
            sample.expression = None
            if result is not None:
                sample.forced.extend([self.output_start, *self.tokenizer.encode(result), self.output_end])
        elif sample.expression is not None:
            sample.expression.append(token)
        return token, mask

    def generate_batch(self, tokens, num_samples=1, **kwargs):
        """
        Run generate() to the end. Returns (results, masks): per sample, the prompt followed by its tokens up to but
        not including the token that ended it, and the matching masks (0 for the prompt, then 1 sampled / 0 forced).
        kwargs: max_tokens, temperature, top_k, seed.
        """
        steps = self.generate(tokens, num_samples, **kwargs)  # checks the arguments
        results = [[int(t) for t in tokens] for _ in range(num_samples)]
        masks = [[0] * len(tokens) for _ in range(num_samples)]
        ended = [False] * num_samples
        for column, column_masks in steps:
            for i, (token, mask) in enumerate(zip(column, column_masks)):
                if ended[i]:
                    continue
                if token in self.end_tokens:
                    ended[i] = True
                else:
                    results[i].append(token)
                    masks[i].append(mask)
        return results, masks
