"""
The inference engine: sampling from a trained GPT with a KV cache, several samples per prompt, the calculator tool.

Engine.generate(prompt, num_samples, max_tokens, ...) yields one (token_column, token_masks) per step: each sample's
next token, and 1 if the model sampled it, 0 if the tool forced it or the sample had ended (at <|assistant_end|> or
<|bos|>, yielded with mask 1; then its end token again). Prompt + generated tokens never exceed Engine.context_len
(UserError at the call), nothing runs ahead of the caller's iteration, and the result depends only on the arguments
and `seed`. Every decoding runs one loop, a Batch of rows (Engine.generate's samples, a server's replies: its
workers in nanochat/batching.py). How it works, with examples: docs/engine.md.
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


def model_cache(model, rows, max_len, dtype, capacity=None):
    """An empty KVCache of `rows` rows and at most `max_len` positions for the layers and heads of `model`."""
    cfg = model.config
    return KVCache(rows, cfg.n_kv_head, max_len, cfg.n_embd // cfg.n_head, cfg.n_layer, model.lm_head.weight.device,
                   dtype, capacity)


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
    cpu = model.lm_head.weight.device.type == "cpu"
    if cpu and not row_major:
        return weights_of(model, lambda w: w.detach().to(dtype or w.dtype).t().contiguous().t())
    if cpu or dtype not in (None, model.lm_head.weight.dtype):
        return weights_of(model, lambda w: w.detach().to(dtype or w.dtype, copy=True))
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
    dtype = model.compute_dtype()
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
        # every row at the cache's position, or each at its own
        where = slice(pos, pos + 1) if positions is None else positions
        logits = _logits(weights, idx, model.cos, model.sin, where, attend, model.config, dtype)
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

    return _logits(weights, idx, cos_table, sin_table, positions, attend, config, dtype)


def _logits(weights, idx, cos_table, sin_table, positions, attend, config, dtype):
    """
    What decode_step and static_step share: the newest tokens idx (B,) through the blocks at `positions` ((B,) long,
    each row's own, or a slice of one position for every row), keys and values where `attend` puts them, in `dtype`;
    the logits (B, vocab) fp32.
    """
    cos = cos_table[0, positions][:, None].to(dtype)  # (B or 1, 1, 1, D/2)
    sin = sin_table[0, positions][:, None].to(dtype)
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
# The decoding core: rows decoded together, prefilled, stepped, joining and leaving


class Row:
    """
    One sequence of a Batch: its sampling, generator (may be shared), at most `max_tokens` tokens, the calculator's
    state (tokens to force in; the expression being written, None outside <|python_start|> ... <|python_end|>). Its
    newest token `last`, `mask` 1 if sampled (0 forced), `generated` so far; `ended`, with the `end_token` that ended
    its turn (<|assistant_end|> or <|bos|>; None when max_tokens or Batch.stop did).
    """

    def __init__(self, temperature, top_k, max_tokens, rng):
        self.temperature = temperature
        self.top_k = top_k
        self.max_tokens = max_tokens
        self.rng = rng
        self.forced = deque()
        self.expression = None
        self.last = None
        self.mask = None
        self.generated = 0
        self.end_token = None
        self.ended = False


class Batch:
    """
    Rows decoded together, a token each per step: the one decoding loop, run by Engine.generate, the server's workers
    (nanochat/batching.py) and the benchmarks, under torch.inference_mode and the autocast it was made in. `max_len`:
    the most positions a row fills (prompt + max_tokens - 1; a server's: the context). add(prompt, rows) queues rows
    that continue a prompt; prefill(budget) runs the waiting prompts, oldest first, `budget` tokens in all (None: no
    limit; whole when no row decodes, nobody to stall), and a finished one's rows sample their first token; step()
    gives every running row its next. Both return the rows that got a token (row.last, until the next call).
    - Before a step, when rows join or no column is left, a new cache: the running rows, then the joining ones,
      right-aligned at the longest, the padding zeroed and masked out (the key mask, made here only). Ended rows
      leave when they are a quarter of the cache's, the others kept in their columns (moved, their attention's sums
      would change in the last bit). The compiled step's caches have a few fixed shapes, kept by the engine: rows
      rounded up to a power of two (the extra ones see only their own keys), max_len up to 128; ended rows stay.
    - Rows of one temperature and top_k sample in one call, rows that share a generator in one draw, every row of the
      cache at every step (a generation's draws do not depend on when its rows leave).
    A row gets the same tokens whatever else is in the batch, up to float rounding (docs/engine.md).
    """

    def __init__(self, engine, max_len):
        self.engine = engine
        self.max_len = max_len
        self.device = engine.model.lm_head.weight.device
        self.dtype = engine.model.compute_dtype()  # this thread's, now
        # the cache in fp32 for a bf16 decode on a CPU where probes.fp32_cache_pays measured it faster
        fp32_cache = self.device.type == "cpu" and self.dtype == torch.bfloat16 and fp32_cache_pays()
        self.cache_dtype = torch.float32 if fp32_cache else self.dtype
        self.waiting = []  # (prompt, its rows, its cache: filled up to its pos), oldest first
        self.joining = []  # the same, prefilled: the rows join at the next step
        self.rows = []  # the cache's rows, in its order
        self.cache = None
        self.padding = None  # (cache rows,) long: each row's padding columns
        self.key_mask = None  # (cache rows, 1, 1, cache.max_len) bool, False on the padding; None: no padding
        self.weights = None

    @property
    def running(self):
        """The rows that have not ended, in the cache or joining it."""
        return [row for row in self.rows + [r for _, rows, _ in self.joining for r in rows] if not row.ended]

    def add(self, prompt, rows):
        """Rows (Row) that continue `prompt` (token ids): they wait for its prefill, into a cache of its own."""
        self.waiting.append((prompt, rows, model_cache(self.engine.model, 1, len(prompt), self.dtype)))

    def stop(self, row):
        """End `row` now: it gets no more tokens (a server's client that left)."""
        row.ended = True

    @torch.inference_mode()
    def prefill(self, budget=None):
        """The waiting prompts, oldest first, up to `budget` tokens (class docstring); the rows that got a token."""
        self.waiting = [w for w in self.waiting if not all(row.ended for row in w[1])]  # stopped while waiting
        decoding = any(not row.ended for row in self.rows)
        done, logits = [], []
        while self.waiting and (budget is None or budget > 0):
            prompt, rows, cache = self.waiting[0]
            whole = budget is None or not (decoding or done)
            end = len(prompt) if whole else min(len(prompt), cache.pos + budget)
            budget = None if budget is None else budget - (end - cache.pos)
            last = self.engine.model.prefill(torch.tensor([prompt[cache.pos:end]], device=self.device), cache)
            if end < len(prompt):
                break
            done.append(self.waiting.pop(0))
            logits.append(last.expand(len(rows), -1))  # each row starts from its prompt's prediction
        self.joining += done
        return self._take([row for _, rows, _ in done for row in rows], torch.cat(logits)) if done else []

    @torch.inference_mode()
    def step(self):
        """One token for every running row (the rows arranged first: class docstring); the rows that got one."""
        if self.joining or (self.cache is not None and self.cache.pos >= self.cache.max_len):
            self._remake()
        keep = [i for i, row in enumerate(self.rows) if not row.ended]
        if not keep:
            return []
        if 4 * (len(self.rows) - len(keep)) >= len(self.rows) and not self.engine.compile_decode:
            index = torch.tensor(keep, device=self.device)
            self.cache.keep_rows(index)
            self.padding = self.padding[index]
            self.key_mask = None if self.key_mask is None else self.key_mask[index]
            self.rows = [self.rows[i] for i in keep]
        if self.weights is None:  # after the first tokens are out, so they do not delay them
            self.weights = self.engine.weights(len(self.rows), static=self.engine.compile_decode)
        return self._take(self.rows, self._forward())

    def close(self):
        """The batch is over: the compiled step's cache goes back to the engine, for the next batch of its shape."""
        self.engine._keep_static_cache(self.cache)
        self.cache = None

    def _remake(self):
        """A new cache: the running rows, then the joining ones, right-aligned at the longest (class docstring)."""
        engine = self.engine
        old = self.cache
        keep = [i for i, row in enumerate(self.rows) if not row.ended]
        joining, self.joining = self.joining, []
        padding = [] if old is None else self.padding.tolist()
        lengths = [old.pos - padding[i] for i in keep] + [c.pos for _, joined, c in joining for _ in joined]
        rows = [self.rows[i] for i in keep] + [row for _, joined, _ in joining for row in joined]
        self.rows, self.cache, self.weights = rows, None, None
        if not rows:
            engine._keep_static_cache(old)
            return
        pos = max(lengths)
        if engine.compile_decode:  # one of a few shapes, kept between batches (a CUDA graph's addresses)
            size = 1 << (len(rows) - 1).bit_length()
            cache = engine._static_cache(size, -(-self.max_len // 128) * 128, self.cache_dtype)
        else:
            size = len(rows)
            cache = model_cache(engine.model, size, self.max_len, self.cache_dtype, capacity=pos + 256)
        cache.k[:, :, :, :pos] = 0
        cache.v[:, :, :, :pos] = 0
        if keep:  # the kept rows' filled columns in one copy (the padding inside them is zeros already)
            span = max(lengths[:len(keep)])
            index = torch.tensor(keep, device=self.device)
            cache.k[:, :len(keep), :, pos - span:pos] = old.k[:, index, :, old.pos - span:old.pos]
            cache.v[:, :len(keep), :, pos - span:pos] = old.v[:, index, :, old.pos - span:old.pos]
        first = len(keep)
        for _, joined, prompt_cache in joining:
            cache.place(prompt_cache, slice(first, first + len(joined)), pos)
            first += len(joined)
        cache.advance(pos)
        # the rows past the batch's (compiled) start at this column: they attend to their own keys only
        self.padding = torch.tensor([pos - n for n in lengths] + [pos] * (size - len(rows)), device=self.device)
        self.key_mask = None
        if self.padding.any() or engine.compile_decode:  # compiled: always a mask, one variant less to compile
            columns = torch.arange(cache.max_len, device=self.device)
            self.key_mask = columns[None, None, None, :] >= self.padding[:, None, None, None]
        self.cache = cache
        engine._keep_static_cache(old)  # after the copy: a compiled batch may get the same shape again

    def _forward(self):
        """The step: the logits (rows, vocab) of every row's newest token, which goes into the cache."""
        model = self.engine.model
        cache = self.cache
        newest = [row.last for row in self.rows] + [0] * (cache.batch_size - len(self.rows))
        idx = torch.tensor(newest, dtype=torch.long, device=self.device)
        positions = None if self.key_mask is None else cache.pos - self.padding  # each row's own, if not all alike
        if not self.engine.compile_decode:
            return decode_step(model, idx, cache, self.weights, positions, self.key_mask)
        where = torch.tensor([cache.pos], device=self.device)
        if self.device.type == "cuda":  # a new step: the last one's graph outputs (its logits) are used up
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(self.device.type, enabled=False):  # the weights are copies in the compute dtype
            logits = self.engine._static_step(self.weights, idx, where, positions, cache.k_layers, cache.v_layers,
                                              model.cos, model.sin, self.key_mask, model.config, self.dtype)
        cache.advance()
        return logits[:len(self.rows)]

    def _sample(self, rows, logits):
        """Each row's sampled token, from its row of `logits`: rows of one temperature and top_k in one call."""
        groups = {}
        for i, row in enumerate(rows):
            groups.setdefault((row.temperature, row.top_k), []).append(i)
        tokens = [None] * len(rows)
        for (temperature, top_k), members in groups.items():
            rngs = [rows[i].rng for i in members]
            rng = rngs[0] if all(g is rngs[0] for g in rngs) else rngs  # one shared generator: one draw
            group = logits if len(members) == len(rows) else logits[members]
            for i, token in zip(members, sample_next_token(group, rng, temperature, top_k).tolist()):
                tokens[i] = token
        return tokens

    def _take(self, rows, logits):
        """Every running row of `rows` takes its next token: forced by the tool, else sampled from `logits`."""
        engine = self.engine
        took = []
        for row, sampled in zip(rows, self._sample(rows, logits)):
            if row.ended:
                continue
            row.mask = 0 if row.forced else 1
            token = row.forced.popleft() if row.forced else sampled
            row.last = token
            row.generated += 1
            if token in engine.end_tokens:
                row.end_token = token
            elif token == engine.python_start:
                row.expression = []
            elif token == engine.python_end and row.expression is not None:
                result = use_calculator(engine.tokenizer.decode(row.expression))
                row.expression = None
                if result is not None:
                    row.forced.extend([engine.output_start, *engine.tokenizer.encode(result), engine.output_end])
            elif row.expression is not None:
                row.expression.append(token)
            row.ended = row.end_token is not None or row.generated >= row.max_tokens
            took.append(row)
        return took


# -----------------------------------------------------------------------------
# The engine


def _check_int(name, value, minimum, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"{name} must be an integer >= {minimum}{' or None' if allow_none else ''}, got {value!r}")


class Engine:
    """
    Generation from `model` (a GPT) with `tokenizer` (see the module docstring). Public attributes: `context_len`
    (the longest prompt + generation), `end_tokens` (the ids of <|assistant_end|> and <|bos|>), `vocab_size`,
    `model`, `tokenizer`, `compile_decode`, `static_caches`.
    """

    def __init__(self, model, tokenizer, context_len=None, compile_decode=False):
        """
        `context_len`: the longest sequence (prompt + generated) a generation may reach; default
        model.config.sequence_len, the training length. At most model.rotary_len. `compile_decode`: decode with
        static_step under torch.compile (mode "reduce-overhead" on CUDA: each step one CUDA graph), over caches of
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
        self._weights = {}  # layout -> (key, weights): both layouts kept, as a server's batch grows and shrinks
        if not isinstance(compile_decode, bool):
            raise UserError(f"compile_decode must be True or False, got {compile_decode!r}")
        self.compile_decode = compile_decode
        self.static_caches = {}  # (rows, capacity, dtype) -> KVCache: the compiled step's caches, kept between calls
        if compile_decode:  # static shapes (dynamic=False): a new batch size or capacity compiles anew, once
            cuda = model.lm_head.weight.device.type == "cuda"
            self._static_step = torch.compile(static_step, mode="reduce-overhead" if cuda else None, dynamic=False,
                                              fullgraph=True)

    def weights(self, rows=None, static=False):
        """
        decode_weights(model) in the dtype in use, for decoding `rows` rows (row-major copies where
        probes.native_bf16_gemv says so), made again only when the dtype, the layout or a parameter changed since the
        last call (its identity, or its version counter, which torch bumps at every in-place change). static: for
        static_step, the matrices copied in the compute dtype on any device (its CUDA graph then reads bf16, not fp32
        weights cast at every step), every tensor marked as a static address (a CUDA graph reads it where it is
        instead of copying it in at each replay).
        """
        dtype = self.model.compute_dtype()
        bf16_cpu = self.model.lm_head.weight.device.type == "cpu" and dtype == torch.bfloat16
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
        An empty KVCache of `rows` rows and `capacity` positions for the compiled step: the one a past batch of that
        shape left (a CUDA graph replays on the addresses it was recorded with), else a new one, zeros (finite:
        static_step reads every column). A batch holds it alone until it lets it go (_keep_static_cache): two at
        once get two caches.
        """
        cache = self.static_caches.pop((rows, capacity, dtype), None)
        if cache is None:
            cache = model_cache(self.model, rows, capacity, dtype)
            cache.k.zero_()
            cache.v.zero_()
            for t in cache.k_layers + cache.v_layers:
                torch._dynamo.mark_static_address(t, guard=False)
        cache.pos = 0
        return cache

    def _keep_static_cache(self, cache):
        """Keep a batch's cache (None: none) for the next of its shape; at most 4 shapes, the least recent dropped."""
        if cache is None or not self.compile_decode:
            return
        self.static_caches[(cache.batch_size, cache.capacity, cache.k.dtype)] = cache
        if len(self.static_caches) > 4:
            self.static_caches.pop(next(iter(self.static_caches)))

    def check_arguments(self, tokens, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seed=42):
        """generate()'s arguments checked: the prompt as a list of ints, and the number of steps to run; UserError."""
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
        tokens, steps = self.check_arguments(tokens, num_samples, max_tokens, temperature, top_k, seed)
        return self._generate([tokens], num_samples, steps, temperature, top_k, seed)

    def generate_many(self, prompts, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seed=42):
        """
        generate() for several prompts (of any lengths) decoded together: entry p * num_samples + s of a column is
        sample s of prompts[p]. `max_tokens` applies to every prompt and must fit after the longest (None: until the
        longest prompt fills the context). The samples depend on the seed and on which prompts go together.
        """
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or not prompts:
            raise UserError("prompts must be a non-empty list of prompts (lists of token ids)")
        checked = [self.check_arguments(p, num_samples, max_tokens, temperature, top_k, seed) for p in prompts]
        return self._generate([tokens for tokens, _ in checked], num_samples, min(steps for _, steps in checked),
                              temperature, top_k, seed)

    @torch.inference_mode()
    def _generate(self, prompts, num_samples, steps, temperature, top_k, seed):
        """One Batch: the prompts' samples as its rows, one generator drawing for all of them (docs/engine.md)."""
        if steps == 0:
            return
        rng = torch.Generator(device=self.model.lm_head.weight.device).manual_seed(seed)
        batch = Batch(self, max(len(tokens) for tokens in prompts) + steps - 1)  # the last token is never fed back
        rows = []
        for tokens in prompts:
            samples = [Row(temperature, top_k, steps, rng) for _ in range(num_samples)]
            batch.add(tokens, samples)
            rows += samples
        try:
            took = set(batch.prefill())
            while True:  # a row that ended pads the column with its end token, mask 0
                yield ([row.last if row in took else row.end_token for row in rows],
                       [row.mask if row in took else 0 for row in rows])
                if not batch.running:
                    return
                took = set(batch.step())
        finally:  # the compiled step's cache free again for the next generation of its shape
            batch.close()

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
