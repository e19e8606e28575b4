"""
The GPT model: a decoder-only transformer (rotary, QK norm, GQA, ReLU², untied head, soft-capped logits).

The architecture is written once, in the part between the two ARCHITECTURE lines (torch only): the config, the
parameters, one block's arithmetic (block) and the transformer around it (hidden_states). Training (GPT.forward),
decoding (engine.decode_step) and the transformers export (modeling_nanochat_gpt.py, written with this part's text in
it) all run it; they differ only in where keys and values go and which kernel attends (`attend`: GPT.attention_kernel,
nanochat/attention_kernels.py, whose kernels all apply this part's window rule, `visible`), and training on a CPU in
the kernel of its norms (`norm`: nanochat/cpu_kernels.py). Then GPT: init, loss, FLOPs, optimizers, the prompt's
prefill (the rest of decoding: engine.py). The choices, initialisation, memory and FLOPs: docs/model.md.
"""

import math
from collections import namedtuple
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat import cpu_kernels
from nanochat.fp8 import fp8_fits, fp8_linear
from nanochat.hardware import autocast_dtype
from nanochat.losses import next_token_loss, softcapped_cross_entropy
from nanochat.output import UserError, print0
from nanochat.ranks import is_distributed

# ============================= ARCHITECTURE (export_model copies from here to its end) =============================
# It uses torch, nn, F, namedtuple, dataclass, asdict and partial alone (what the exported file imports)


@dataclass
class GPTConfig:
    sequence_len: int = 2048  # longest sequence trained on (rotary tables cover 10x this for generation)
    vocab_size: int = 65536
    n_layer: int = 20
    n_head: int = 10  # query heads
    n_kv_head: int = 10  # key/value heads (GQA when < n_head; must divide n_head)
    n_embd: int = 1280
    # The 2026 recipe's parts (karpathy/nanochat HEAD; measured in bench/RESULTS.md). The defaults are the 2025
    # architecture, which transformers' NanoChatForCausalLM holds; a field added here at a non-default value exports
    # with our own modeling file (export_model --layout=remote), which runs this part of this file.
    rope_base: float = 10000.0  # rotary base: 10k (2025) or 100k (2026): slower-turning low channels
    qk_scale: float = 1.0  # q and k multiplied by this after their RMSNorm (2026: 1.2, attention logits x1.44)
    # before block i: x = resid_lambdas[i] * x + x0_lambdas[i] * x0 (x0: the normed embedding)
    layer_scalars: bool = False
    value_embeds: bool = False  # every other layer (the last included) adds a gated token embedding to its values
    # per layer, tiled, the last layer L: L sees the whole context, S its last quarter (HEAD: SSSL)
    window_pattern: str = "L"

    def to_dict(self):
        return asdict(self)


SOFTCAP = 15.0  # logits = SOFTCAP * tanh(logits / SOFTCAP): in (-15, 15), smooth (docs/model.md)
VE_GATE_CHANNELS = 12  # the value-embedding gate reads this many channels of the block's input (as HEAD does)


def check_shapes(config):
    """ValueError unless the config's sizes fit together."""
    if config.n_embd % config.n_head or config.n_head % config.n_kv_head or (config.n_embd // config.n_head) % 2:
        raise ValueError(f"n_embd {config.n_embd} must divide into n_head {config.n_head} heads of even width (rotary "
                         f"pairs), and n_head by n_kv_head {config.n_kv_head}")
    if config.value_embeds and config.n_embd < VE_GATE_CHANNELS:
        raise ValueError(f"value embeddings need n_embd >= {VE_GATE_CHANNELS}, got {config.n_embd}")
    if not config.window_pattern or set(config.window_pattern) - set("SL"):
        raise ValueError(f"window_pattern is a string of S (short window) and L (long), e.g. SSSL; "
                         f"got {config.window_pattern!r}")


def layer_windows(config):
    """
    Per layer, how many earlier tokens its attention sees (a query at i sees keys i - w .. i), None for all of them:
    window_pattern tiled over the layers, the last one L. An S layer's w is ceil(sequence_len / 512) * 128, i.e.
    sequence_len / 4 rounded up to a multiple of 128 (512 at 2048, 256 at 513 to 1024, never under 128). That is
    karpathy/nanochat HEAD's S window at every sequence_len: its -(-T // 4 // 128) * 128 floors by 4 then by 128,
    which is one floor by 512 (its comment's "2048 -> 768" is not what it computes). Where HEAD differs: its L layers
    get a window of sequence_len, so past the training length (a long generation) they see the last sequence_len + 1
    keys; an L layer here (None) sees every key.
    """
    short = -(-config.sequence_len // 512) * 128
    pattern = [config.window_pattern[i % len(config.window_pattern)] for i in range(config.n_layer - 1)] + ["L"]
    return [short if c == "S" else None for c in pattern]


def has_value_embeds(config, layer_idx):
    """Whether layer `layer_idx` adds a value embedding: alternating layers, counted so that the last one does."""
    return config.value_embeds and layer_idx % 2 == (config.n_layer - 1) % 2


class Block(nn.Module):
    """
    One layer's parameters, each matrix (out, in) (their arithmetic: block()): attn.c_q, c_k, c_v, c_proj (and
    ve_gate, in a layer with a value embedding), mlp.c_fc, c_proj (4 x n_embd wide).
    """

    def __init__(self, config, layer_idx):
        super().__init__()
        C = config.n_embd
        KV = config.n_kv_head * (config.n_embd // config.n_head)  # the keys' (and the values') width
        linear = lambda fan_in, fan_out: nn.Linear(fan_in, fan_out, bias=False)
        self.attn = nn.Module()
        self.attn.c_q = linear(C, C)
        self.attn.c_k = linear(C, KV)
        self.attn.c_v = linear(C, KV)
        self.attn.c_proj = linear(C, C)
        self.attn.ve_gate = linear(VE_GATE_CHANNELS, config.n_kv_head) if has_value_embeds(config, layer_idx) else None
        self.mlp = nn.Module()
        self.mlp.c_fc = linear(C, 4 * C)
        self.mlp.c_proj = linear(4 * C, C)


def build_parameters(model, config):
    """
    Every parameter of a GPT of `config`, as attributes of `model` (our GPT, or the exported transformers model)
    under the checkpoints' names: transformer.wte, transformer.h.<i>..., lm_head, the layer scalars, value_embeds.<i>.
    """
    check_shapes(config)
    table = lambda rows, cols: nn.Embedding(rows, cols, _weight=torch.empty(rows, cols))  # undrawn: docs/model.md
    model.transformer = nn.ModuleDict(dict(wte=table(config.vocab_size, config.n_embd),
                                           h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)])))
    model.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
    if config.layer_scalars:  # the identity until initialised: x = 1 * x + 0 * x0
        model.resid_lambdas = nn.Parameter(torch.ones(config.n_layer))
        model.x0_lambdas = nn.Parameter(torch.zeros(config.n_layer))
    kv_width = config.n_kv_head * (config.n_embd // config.n_head)
    model.value_embeds = nn.ModuleDict({str(i): table(config.vocab_size, kv_width)
                                        for i in range(config.n_layer) if has_value_embeds(config, i)})


# The tensors hidden_states() and the head read: the parameters (weights_of), or copies. Per layer its matrices (out,
# in) as nn.Linear keeps them, c_q, c_k and c_v stacked by torch.cat into qkv (one matmul instead of three; the
# gradient flows through the cat to each); ve_gate and ve_table None in a layer without a value embedding; `linear`
# how the block's activations meet its four matrices (F.linear; in fp8 when training with --fp8, GPT._final_hidden).
LayerWeights = namedtuple("LayerWeights", "qkv attn_proj c_fc mlp_proj ve_gate ve_table linear", defaults=(F.linear,))
Weights = namedtuple("Weights", "wte layers lm_head resid_lambdas x0_lambdas")  # layers: [LayerWeights]


def weights_of(model, prep=lambda w: w, linear=F.linear):
    """
    The Weights of a model made by build_parameters; `prep` maps each matrix (default: the parameter itself).
    lm_head None for a model without its head (the exported base model: transformers' AutoModel, hidden states out).
    """
    layers = []
    for i, block in enumerate(model.transformer.h):
        attn, mlp = block.attn, block.mlp
        ve_gate = ve_table = None
        if attn.ve_gate is not None:
            ve_gate = prep(attn.ve_gate.weight)
            ve_table = model.value_embeds[str(i)].weight
        qkv = prep(torch.cat([attn.c_q.weight, attn.c_k.weight, attn.c_v.weight]))
        layers.append(LayerWeights(qkv, prep(attn.c_proj.weight), prep(mlp.c_fc.weight), prep(mlp.c_proj.weight),
                                   ve_gate, ve_table, linear))
    head = getattr(model, "lm_head", None)
    return Weights(model.transformer.wte.weight, layers, None if head is None else prep(head.weight),
                   getattr(model, "resid_lambdas", None), getattr(model, "x0_lambdas", None))


def norm(x, scale=1.0, cos=None, sin=None):
    """
    scale * the parameter-free RMSNorm of x over its last dimension (F.rms_norm's default eps: float32's machine
    epsilon); given cos, sin, of apply_rotary_emb(x, cos, sin): the QK norm after rotary.
    """
    y = F.rms_norm(x if cos is None else apply_rotary_emb(x, cos, sin), (x.size(-1),))
    return y * scale if scale != 1.0 else y


def rotary(positions, head_dim, base):
    """
    cos, sin (..., T, 1, head_dim/2) fp32 at `positions` (..., T): channel pair i turns base^(-2i/head_dim) rad a
    position.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = positions.float()[..., None] * inv_freq
    return angles.cos()[..., None, :], angles.sin()[..., None, :]


def apply_rotary_emb(x, cos, sin):
    """x (B, T, H, D) with channel pairs (i, i + D/2) rotated by the angles given as cos, sin (B or 1, T, 1, D/2)."""
    x1, x2 = x.chunk(2, dim=3)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=3)


def value_gate(w_gate, x):
    """
    (..., n_kv_head, 1): 3 * sigmoid(w_gate @ x[..., :VE_GATE_CHANNELS]); starts near 1.5 (w_gate ~ U(0, 0.02)), can
    reach 0 or 3.
    """
    return 3 * torch.sigmoid(F.linear(x[..., :VE_GATE_CHANNELS], w_gate)).unsqueeze(-1)


def visible(q_idx, kv_idx, window):
    """
    The window rule, which every attention kernel applies: whether the query at position q_idx sees the key at
    kv_idx (tensors that broadcast): causal, and at most `window` positions back (a layer's layer_windows(), an int or
    a 0-d tensor; None: no limit).
    """
    seen = kv_idx <= q_idx
    return seen if window is None else seen & (q_idx - kv_idx <= window)


def attention(q, k, v, key_mask=None, window=None):
    """
    q (B, H, Tq, D) attends over k, v (B, Hkv, Tk, D), whose first Tk - Tq positions are a cached prefix: causal
    when there is none (training, a prefill), all of it for one new token, all of the prefix and causal within a
    chunk of new tokens. key_mask (B, 1, 1, Tk) bool: False on keys a row must not see (padding before its prompt).
    window (layer_windows): a query sees only its own key and the `window` before it (visible; None: no limit).
    """
    Tq, Tk, gqa = q.size(2), k.size(2), q.size(1) != k.size(1)
    window = window if window is not None and window < Tk - 1 else None  # a window that covers everything is none
    if Tq == Tk and key_mask is None and window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if Tq == 1:  # one new token: the keys it sees are the last window + 1
        if window is not None:
            k, v = k[:, :, -window - 1:], v[:, :, -window - 1:]
            key_mask = None if key_mask is None else key_mask[..., -window - 1:]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, enable_gqa=gqa)
    query_pos = torch.arange(Tk - Tq, Tk, device=q.device)[:, None]
    mask = visible(query_pos, torch.arange(Tk, device=q.device), window)  # (Tq, Tk)
    if key_mask is not None:
        mask = mask & key_mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def block(x, w, ve, cos_sin, attend, config, norm=norm):
    """
    One transformer block: x (B, T, n_embd) -> x + attention(norm(x)), then + MLP(norm(.)). `w`: the layer's
    LayerWeights; `ve` (B, T, kv width) its value embedding or None; `attend(q, k, v)` (B, heads, T, D) -> (B, H, T, D):
    where the keys and values go (nowhere, a KV cache, transformers' cache), then attention() with the layer's window;
    `norm`: norm() or what computes it (hidden_states).
    """
    B, T, _ = x.size()
    H, Hkv, D = config.n_head, config.n_kv_head, config.n_embd // config.n_head
    h = norm(x)
    qkv = w.linear(h, w.qkv).view(B, T, H + 2 * Hkv, D)  # the H query heads, then Hkv key heads, then Hkv value heads
    qk, v = qkv[:, :, :H + Hkv], qkv[:, :, H + Hkv:]
    if ve is not None:  # the token's own value embedding, mixed in per head (ResFormer-style)
        v = v + value_gate(w.ve_gate, h) * ve.view(B, T, Hkv, D)
    qk = norm(qk, config.qk_scale, *cos_sin)  # QK norm after rotary, every head of q and k at once (per head)
    q, k = qk[:, :, :H], qk[:, :, H:]
    y = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (B, H, T, D)
    x = x + w.linear(y.transpose(1, 2).reshape(B, T, H * D), w.attn_proj)
    return x + w.linear(F.relu(w.linear(norm(x), w.c_fc)).square(), w.mlp_proj)  # ReLU² MLP


def hidden_states(w, idx, cos_sin, attend, config, norm=norm):
    """
    The transformer without its head: token ids idx (B, T) -> the final normed hidden states (B, T, n_embd), computed
    in cos_sin's dtype (the compute dtype: under autocast the residual stream too, docs/model.md). `w`: Weights;
    `attend(layer, q, k, v, window)`: see block() (window: layer_windows(), for attention()); `norm(x, scale, cos,
    sin)`: how activations are normed, norm() (training on a CPU: cpu_kernels.norm, GPT._final_hidden).
    """
    dtype = cos_sin[0].dtype
    x = x0 = norm(F.embedding(idx, w.wte).to(dtype))
    for i, (layer, window) in enumerate(zip(w.layers, layer_windows(config))):
        if config.layer_scalars:
            x = w.resid_lambdas[i].to(dtype) * x + w.x0_lambdas[i].to(dtype) * x0
        ve = F.embedding(idx, layer.ve_table).to(dtype) if layer.ve_table is not None else None
        x = block(x, layer, ve, cos_sin, partial(attend, i, window=window), config, norm)
    return norm(x)


def softcapped(logits):
    """The head's logits, soft-capped, in fp32."""
    return SOFTCAP * torch.tanh(logits.float() / SOFTCAP)

# ================================================ ARCHITECTURE END ================================================

# norm()'s eps: F.rms_norm's default for fp32 and bf16 inputs alike, float32's machine epsilon (hf_format writes it
# into a transformers config; cpu_kernels' RMSNorm adds the same)
RMS_EPS = torch.finfo(torch.float32).eps


def config_from_depth(depth, vocab_size=65536, sequence_len=2048, **parts):
    """
    The GPTConfig of a model `depth` layers deep: width 64 * depth, heads ceil(width / 128) (128 wide at even
    depths; the odd ones: docs/model.md), kv heads = heads. `parts`: the other GPTConfig fields (rope_base, ...,
    window_pattern).
    """
    if not isinstance(depth, int) or depth < 1:
        raise UserError(f"depth must be a positive integer, got {depth!r}")
    n_embd = 64 * depth
    n_head = max(1, math.ceil(n_embd / 128))
    if n_embd % n_head != 0:
        n_head = depth
    return GPTConfig(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=depth,
                     n_head=n_head, n_kv_head=n_head, n_embd=n_embd, **parts)


class GPT(nn.Module):
    """
    Built on the meta device, materialised where it will live, initialised once: `with torch.device("meta"): model =
    GPT(config)`, then `model.to_empty(device=device)` and `model.init_weights()`.

    model.train() / model.eval() change nothing in this model's arithmetic: no part reads `self.training` (there is
    no dropout, no batch norm), so a forward gives the same numbers in either mode. What separates training from
    evaluation is whether autograd records: the training loops run the model with gradients on; the evaluations
    (losses.evaluate_bpb, core_eval, scoring), the samples and generation (engine) run under torch.no_grad() or
    torch.inference_mode(). _final_hidden asks torch.is_grad_enabled() for the one choice that depends on it: with
    gradients, the training steps' kernels (cpu_kernels' norm on a CPU, fp8; the "dense" attention kernel asks too).
    The stages still call train() / eval() (checkpoint_manager.build_model's phase, around base_train's evaluations):
    PyTorch's convention, kept so that a part added later that does read `self.training` (dropout) behaves.
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.fp8 = False  # training steps multiply the blocks' matrices in float8 (base_train --fp8; nanochat/fp8.py)
        # full-context attention (training, evaluation): f(q, k, v, window=) of attention_kernels.KERNELS, set at a
        # training stage's start (Stage.start: base_train --attention, "auto"); SDPA, attention() itself, by default
        self.attention_kernel = attention
        build_parameters(self, config)
        head_dim = config.n_embd // config.n_head
        self.rotary_len = config.sequence_len * 10
        for table in ("cos", "sin"):
            self.register_buffer(table, torch.empty(1, self.rotary_len, 1, head_dim // 2), persistent=False)

    INIT_RECIPES = ("2025", "2026")

    @torch.no_grad()
    def init_weights(self, seed=42, recipe="2025"):
        """
        The initial weights, from a generator of their own seeded with `seed` (the same on every rank and in every run,
        whatever drew from the global RNG before), then the rotary tables. Both c_proj zero: every block starts as the
        identity. recipe "2025" or "2026" (karpathy/nanochat HEAD's); the distributions and why: docs/model.md.
        """
        if recipe not in self.INIT_RECIPES:
            raise ValueError(f"init recipe must be one of {self.INIT_RECIPES}, got {recipe!r}")
        rng = torch.Generator(device=self.lm_head.weight.device).manual_seed(seed)
        # U(-a, a) has std a / sqrt(3)
        uniform = lambda w, std: nn.init.uniform_(w, -math.sqrt(3.0) * std, math.sqrt(3.0) * std, generator=rng)
        n_embd = self.config.n_embd
        L = self.config.n_layer
        nn.init.normal_(self.transformer.wte.weight, mean=0.0, std=1.0 if recipe == "2025" else 0.8, generator=rng)
        for block in self.transformer.h:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                fan_out, fan_in = lin.weight.shape
                if recipe == "2025":
                    std = 1.0 / math.sqrt(fan_in) * min(1.0, math.sqrt(fan_out / fan_in))
                else:
                    std = (0.4 if lin is block.mlp.c_fc else 1.0) / math.sqrt(n_embd)
                uniform(lin.weight, std)
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)
            if block.attn.ve_gate is not None:
                nn.init.uniform_(block.attn.ve_gate.weight, 0.0, 0.02, generator=rng)
        if recipe == "2025":
            nn.init.zeros_(self.lm_head.weight)
        else:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001, generator=rng)
        for table in self.value_embeds.values():
            uniform(table.weight, 1.0 / math.sqrt(n_embd))
        if self.config.layer_scalars:
            depth_frac = torch.arange(L, dtype=torch.float32) / max(L - 1, 1)
            self.resid_lambdas.copy_(1.15 - 0.10 * depth_frac)
            self.x0_lambdas.copy_(0.20 - 0.15 * depth_frac)
        self.init_rotary()

    @torch.no_grad()
    def init_rotary(self):
        """(Re)compute the rotary tables (base config.rope_base); call after to_empty() when loading a checkpoint."""
        positions = torch.arange(self.rotary_len, device=self.lm_head.weight.device)[None]
        cos, sin = rotary(positions, self.config.n_embd // self.config.n_head, self.config.rope_base)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean"):
        """
        idx (B, T) token ids. With targets (B, T) (-1 = ignore): the cross-entropy loss, `loss_reduction` "mean" (over
        counted targets; 0, not NaN, if none counts), "sum", or "none" ((B*T,), 0 at ignored targets). Without
        targets: logits (B, T, vocab) in fp32. With a kv_cache, idx holds only the new tokens.
        """
        x = self._final_hidden(idx, kv_cache)
        if targets is None:
            return softcapped(self.lm_head(x))
        return next_token_loss(self._per_token_loss, x, targets, self.config.vocab_size, loss_reduction)

    def last_logits(self, idx, last):
        """
        Logits (B, vocab) in fp32 at one position of each row, last[b] of row b: forward(idx)[arange(B), last] with
        the head applied to B positions instead of B*T (the head was half of categorical scoring's time).
        """
        x = self._final_hidden(idx)
        return softcapped(self.lm_head(x[torch.arange(idx.size(0), device=idx.device), last]))

    def compute_dtype(self):
        """
        The dtype the model computes in now: this thread's autocast dtype under autocast (the residual stream and the
        rotary tables too, docs/model.md), else its weights'.
        """
        device_type = self.lm_head.weight.device.type
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return self.lm_head.weight.dtype

    def _final_hidden(self, idx, kv_cache=None):
        """The transformer without its head: idx (B, T) -> the final normed hidden states (B, T, n_embd)."""
        T = idx.size(1)
        t0 = kv_cache.pos if kv_cache is not None else 0
        if t0 + T > self.rotary_len:
            raise ValueError(f"sequence of {t0 + T} tokens exceeds the rotary table ({self.rotary_len})")
        dtype = self.compute_dtype()
        cos_sin = self.cos[:, t0:t0 + T].to(dtype), self.sin[:, t0:t0 + T].to(dtype)
        training = torch.is_grad_enabled()  # autograd on = a training step (not self.training: the class says why)
        if kv_cache is None:  # the full context (training, evaluation): nothing kept, the model's kernel attends
            attend = lambda i, q, k, v, window: self.attention_kernel(q, k, v, window=window)
        else:  # the new keys and values into the cache, then attention over all of it
            attend = lambda i, q, k, v, window: attention(q, *kv_cache.insert_kv(i, k, v), window=window)
        linear = F.linear  # evaluation never in fp8; training with self.fp8, the matrices torch._scaled_mm takes
        if self.fp8 and training:
            linear = lambda x, w: fp8_linear(x, w) if fp8_fits(w) else F.linear(x, w)
        # training on a CPU, uncompiled: the norms as one Function (nothing fuses torch's separate ops there;
        # torch.compile does, and its tracing failed on the Function's writes into slices)
        cpu_training = training and idx.device.type == "cpu" and not torch.compiler.is_compiling()
        return hidden_states(weights_of(self, linear=linear), idx, cos_sin, attend, self.config,
                             cpu_kernels.norm if cpu_training else norm)

    def _per_token_loss(self, x, targets):
        if x.device.type == "cpu":  # the same loss in fewer passes over the logits (nanochat/losses.py says why)
            return softcapped_cross_entropy(x, self.lm_head.weight, targets, SOFTCAP)
        return F.cross_entropy(softcapped(self.lm_head(x)), targets, ignore_index=-1, reduction="none")

    def num_params(self, value_embeds=True):
        """Number of parameters (the rotary buffers are not parameters); value_embeds=False leaves their tables out."""
        tables = [] if value_embeds else [t.weight for t in self.value_embeds.values()]
        return sum(p.numel() for p in self.parameters()) - sum(w.numel() for w in tables)

    def estimate_flops(self):
        """
        Training FLOPs per token, forward + backward, at T = sequence_len: 6 * (parameters except the lookup tables) +
        12 * n_head * head_dim * T per layer for attention (the full T x T square; a window w: T x min(w, T)).
        docs/model.md.
        """
        cfg = self.config
        n_matmul = self.num_params(value_embeds=False) - self.transformer.wte.weight.numel()
        T = cfg.sequence_len
        return 6 * n_matmul + sum(12 * cfg.n_embd * (T if w is None else min(w, T)) for w in layer_windows(cfg))

    def setup_optimizers(self, unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.0,
                         matrix_weight_decay=0.0, scalar_lr=0.5):
        """
        [adamw, muon], each parameter in exactly one (why two: docs/optimizers.md). Muon: every matrix of the blocks,
        nearly all the compute. AdamW: wte and lm_head (a lookup table and a classifier whose rows see very different
        gradient scales), betas (0.8, 0.95), eps 1e-10, lrs scaled by (n_embd / 768) ** -0.5 (tuned at width 768),
        weight_decay on both; with the 2026 parts also the value embeddings (half wte's lr, as HEAD) and the layer
        scalars (x0: scalar_lr, betas (0.96, 0.95); resid: scalar_lr / 100, a multiplier of the whole stream; no decay).
        Muon's cautious matrix_weight_decay (nanochat/muon.py). With a process group, DistAdamW / DistMuon (the ranks'
        gradients averaged in optim.clip_grad_norm_ when clipping is on, the default, else in step()). Every group gets
        "initial_lr": the loop sets lr = initial_lr * the schedule's multiplier. Prints the groups.
        """
        from nanochat.adamw import AdamW, DistAdamW
        from nanochat.muon import DistMuon, Muon
        matrix_params = [p for p in self.transformer.h.parameters()]
        lr_scale = (self.config.n_embd / 768) ** -0.5
        adam_groups = [  # (name, params, lr, what the printout says about the lr, overrides of the defaults)
            ("lm_head", [self.lm_head.weight], unembedding_lr * lr_scale, f"{unembedding_lr} x (n_embd/768)^-0.5", {}),
            ("wte", [self.transformer.wte.weight], embedding_lr * lr_scale, f"{embedding_lr} x (n_embd/768)^-0.5", {}),
        ]
        if self.config.value_embeds:
            tables = [t.weight for t in self.value_embeds.values()]
            adam_groups.append(("value embeddings", tables, embedding_lr * lr_scale / 2,
                                f"{embedding_lr} x (n_embd/768)^-0.5 / 2", {}))
        if self.config.layer_scalars:
            adam_groups.append(("resid_lambdas", [self.resid_lambdas], scalar_lr / 100, f"{scalar_lr} / 100",
                                dict(weight_decay=0.0)))
            adam_groups.append(("x0_lambdas", [self.x0_lambdas], scalar_lr, f"{scalar_lr}",
                                dict(betas=(0.96, 0.95), weight_decay=0.0)))
        n_assigned = len(matrix_params) + sum(len(g[1]) for g in adam_groups)
        if n_assigned != len(list(self.parameters())) or any(p.dim() != 2 for p in matrix_params):
            raise RuntimeError("setup_optimizers: parameter groups do not partition the model's parameters")
        distributed = is_distributed()
        param_groups = [dict(params=ps, lr=lr, **extra) for _, ps, lr, _, extra in adam_groups]
        adamw = (DistAdamW if distributed else AdamW)(param_groups, betas=(0.8, 0.95), eps=1e-10,
                                                      weight_decay=weight_decay)
        # Newton-Schulz computes in the compute dtype, decided once for the run (nanochat/hardware.py)
        muon = (DistMuon if distributed else Muon)(matrix_params, lr=matrix_lr, momentum=0.95,
                                                   weight_decay=matrix_weight_decay,
                                                   ns_dtype=autocast_dtype(self.lm_head.weight.device.type))
        optimizers = [adamw, muon]
        for group in (group for opt in optimizers for group in opt.param_groups):
            group["initial_lr"] = group["lr"]

        n = lambda ps: sum(p.numel() for p in ps)
        print0(f"Optimizers ({'distributed, ZeRO-2 style' if distributed else 'single process'}):")
        for (name, ps, lr, how, extra), group in zip(adam_groups, adamw.param_groups):
            print0(f"  AdamW  {name:<7} {n(ps):,} params, lr {lr:.6f} (= {how}), betas {group['betas']}, "
                   f"weight decay {group['weight_decay']}")
        print0(f"  Muon   {len(matrix_params)} block matrices, {n(matrix_params):,} params, lr {matrix_lr}, "
               f"cautious weight decay {matrix_weight_decay}")
        return optimizers

    # ------------ decoding with a KV cache: the prompt here; then one token at a time, engine.decode_step ------------

    @torch.no_grad()
    def prefill(self, idx, kv_cache):
        """
        Run the prompt idx (B, T) into kv_cache; the logits (B, vocab) fp32 of its last position: forward(idx,
        kv_cache=kv_cache)[:, -1] without the head at the other positions.
        """
        return softcapped(self.lm_head(self._final_hidden(idx, kv_cache)[:, -1]))
