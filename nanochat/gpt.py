"""
The GPT model: a decoder-only transformer (rotary, QK norm, GQA, ReLU², untied head, soft-capped logits).

Training: forward(idx, targets) -> loss; decoding: prefill, decode_weights and decode_step (the Engine's loop);
size: config_from_depth. The architecture and its choices, initialisation, memory and FLOPs: docs/model.md.
"""

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from nanochat.common import UserError, is_distributed, print0
from nanochat.hardware import autocast_dtype
from nanochat.losses import softcapped_cross_entropy


@dataclass
class GPTConfig:
    sequence_len: int = 2048  # longest sequence trained on (rotary tables cover 10x this for generation)
    vocab_size: int = 65536
    n_layer: int = 20
    n_head: int = 10  # query heads
    n_kv_head: int = 10  # key/value heads (GQA when < n_head; must divide n_head)
    n_embd: int = 1280
    # The 2026 recipe's parts (karpathy/nanochat HEAD; measured in bench/RESULTS.md). The defaults are the 2025
    # architecture, which transformers' NanoChatForCausalLM holds; qk_scale, layer_scalars and value_embeds make a
    # checkpoint that exports only with its own modeling file (export_model --layout=remote: nanochat/hf_remote.py).
    rope_base: float = 10000.0  # rotary base: 10k (2025) or 100k (2026): slower-turning low channels
    qk_scale: float = 1.0  # q and k multiplied by this after their RMSNorm (2026: 1.2, attention logits x1.44)
    layer_scalars: bool = False  # before block i: x = resid_lambdas[i] * x + x0_lambdas[i] * x0 (x0: the normed embedding)
    value_embeds: bool = False  # every other layer (the last included) adds a gated token embedding to its values

    def to_dict(self):
        return asdict(self)


def config_from_depth(depth, vocab_size=65536, sequence_len=2048, **parts):
    """
    The GPTConfig of a model `depth` layers deep: width 64 * depth, heads ceil(width / 128) (128 wide where the
    width divides; else heads = depth, 64 wide), kv heads = heads. Depth 20: 1280 wide, 10 heads (docs/model.md).
    `parts`: the other GPTConfig fields (rope_base, qk_scale, layer_scalars, value_embeds).
    """
    if not isinstance(depth, int) or depth < 1:
        raise UserError(f"depth must be a positive integer, got {depth!r}")
    n_embd = 64 * depth
    n_head = max(1, math.ceil(n_embd / 128))
    if n_embd % n_head != 0:
        n_head = depth
    return GPTConfig(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=depth,
                     n_head=n_head, n_kv_head=n_head, n_embd=n_embd, **parts)


def has_value_embeds(config, layer_idx):
    """Whether layer `layer_idx` adds a value embedding: alternating layers, counted so that the last one does."""
    return config.value_embeds and layer_idx % 2 == (config.n_layer - 1) % 2


def norm(x):
    """Parameter-free RMSNorm over the last dimension."""
    return F.rms_norm(x, (x.size(-1),))


VE_GATE_CHANNELS = 12  # the value-embedding gate reads this many channels of the block's input (as HEAD does)


def value_gate(w_gate, x):
    """(..., n_kv_head, 1): 3 * sigmoid(w_gate @ x[..., :12]); starts near 1.5 (w_gate ~ U(0, 0.02)), can reach 0 or 3."""
    return 3 * torch.sigmoid(F.linear(x[..., :VE_GATE_CHANNELS], w_gate)).unsqueeze(-1)


def apply_rotary_emb(x, cos, sin):
    """x (B, T, H, D) with channel pairs (i, i + D/2) rotated by the angles given as cos, sin (B or 1, T, 1, D/2)."""
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=3)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        if config.n_embd % config.n_head != 0 or config.n_head % config.n_kv_head != 0:
            raise ValueError(f"n_embd {config.n_embd} must divide by n_head {config.n_head}, which must divide by n_kv_head {config.n_kv_head}")
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.qk_scale = config.qk_scale
        # value embedding gate: per kv head, from the first VE_GATE_CHANNELS channels of the block's input, in (0, 3)
        self.ve_gate = nn.Linear(VE_GATE_CHANNELS, self.n_kv_head, bias=False) if has_value_embeds(config, layer_idx) else None

    def forward(self, x, cos_sin, kv_cache, ve=None):
        B, T, _ = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:  # the token's own value embedding, mixed in per head (ResFormer-style)
            v = v + value_gate(self.ve_gate.weight, x) * ve.view(B, T, self.n_kv_head, self.head_dim)
        cos, sin = cos_sin
        q, k = norm(apply_rotary_emb(q, cos, sin)), norm(apply_rotary_emb(k, cos, sin))
        if self.qk_scale != 1.0:
            q, k = q * self.qk_scale, k * self.qk_scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        if kv_cache is not None:
            k, v = kv_cache.insert_kv(self.layer_idx, k, v)
        Tq, Tk = q.size(2), k.size(2)
        gqa = self.n_head != self.n_kv_head
        if Tq == Tk:
            # training, or the first (prefill) call with a cache: plain causal attention
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        elif Tq == 1:
            # one new token attends to everything cached before it
            y = F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=gqa)
        else:
            # a chunk of new tokens after a cached prefix: all of the prefix, causal within the chunk
            mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x, cos_sin, kv_cache, ve=None):
        x = x + self.attn(norm(x), cos_sin, kv_cache, ve)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    """
    Build, then initialise explicitly (created on the meta device, materialised where it will live, initialised once):

        with torch.device("meta"):
            model = GPT(config)
        model.to_empty(device=device)
        model.init_weights()
    """

    SOFTCAP = 15.0
    LOGITS_CHUNK_ELEMENTS = 2**27  # above this many logits (512 MiB in fp32) the loss is computed in chunks

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        head_dim = config.n_embd // config.n_head
        if config.layer_scalars:
            self.resid_lambdas = nn.Parameter(torch.empty(config.n_layer))
            self.x0_lambdas = nn.Parameter(torch.empty(config.n_layer))
        if config.value_embeds and config.n_embd < VE_GATE_CHANNELS:
            raise ValueError(f"value embeddings need n_embd >= {VE_GATE_CHANNELS}, got {config.n_embd}")
        # empty without value embeddings (an empty ModuleDict has no state_dict keys: the checkpoint format is unchanged)
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(config.vocab_size, config.n_kv_head * head_dim)
                                           for i in range(config.n_layer) if has_value_embeds(config, i)})
        if head_dim % 2 != 0:
            raise ValueError(f"head dim {head_dim} must be even for rotary embeddings")
        self.rotary_len = config.sequence_len * 10
        self.register_buffer("cos", torch.empty(1, self.rotary_len, 1, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(1, self.rotary_len, 1, head_dim // 2), persistent=False)

    INIT_RECIPES = ("2025", "2026")

    @torch.no_grad()
    def init_weights(self, seed=42, recipe="2025"):
        """
        The initial weights, from a generator of their own seeded with `seed` (the same on every rank and in every run,
        whatever drew from the global RNG before), then the rotary tables. Both c_proj zero, so every block starts as
        the identity (why: docs/model.md). recipe "2025": wte N(0, 1); c_q, c_k, c_v, c_fc uniform with std
        1/sqrt(fan_in) * min(1, sqrt(fan_out/fan_in)); lm_head zero, so the initial loss is exactly ln(vocab_size).
        recipe "2026" (karpathy/nanochat HEAD): wte N(0, 0.8); c_q, c_k, c_v uniform with std 1/sqrt(n_embd), c_fc 0.4x
        that; lm_head N(0, 0.001). Either way value embeddings as c_v, their gates U(0, 0.02), and the layer scalars
        resid 1.15 -> 1.05, x0 0.20 -> 0.05 over the depth (HEAD's values: a little extra residual, a little embedding).
        """
        if recipe not in self.INIT_RECIPES:
            raise ValueError(f"init recipe must be one of {self.INIT_RECIPES}, got {recipe!r}")
        rng = torch.Generator(device=self.lm_head.weight.device).manual_seed(seed)
        uniform = lambda w, std: nn.init.uniform_(w, -math.sqrt(3.0) * std, math.sqrt(3.0) * std, generator=rng)  # std a/sqrt(3)
        n_embd, L = self.config.n_embd, self.config.n_layer
        nn.init.normal_(self.transformer.wte.weight, mean=0.0, std=1.0 if recipe == "2025" else 0.8, generator=rng)
        for block in self.transformer.h:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                fan_out, fan_in = lin.weight.shape
                if recipe == "2025":
                    uniform(lin.weight, 1.0 / math.sqrt(fan_in) * min(1.0, math.sqrt(fan_out / fan_in)))
                else:
                    uniform(lin.weight, (0.4 if lin is block.mlp.c_fc else 1.0) / math.sqrt(n_embd))
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
        head_dim = self.config.n_embd // self.config.n_head
        device = self.lm_head.weight.device
        inv_freq = 1.0 / (self.config.rope_base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
        t = torch.arange(self.rotary_len, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)
        self.cos.copy_(freqs.cos()[None, :, None, :])
        self.sin.copy_(freqs.sin()[None, :, None, :])

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean"):
        """
        idx (B, T) token ids. With targets (B, T) (-1 = ignore): returns the cross-entropy loss,
        `loss_reduction` "mean" (over non-ignored targets; 0, not NaN, if every target is ignored),
        "sum", or "none" (per position, shape (B*T,), 0 at ignored targets). Without targets: returns
        logits (B, T, vocab) in fp32. With a kv_cache, idx holds only the new tokens.
        """
        x = self._final_hidden(idx, kv_cache)
        if targets is None:
            return self._softcapped_logits(x)
        flat_x, flat_targets = x.view(-1, x.size(-1)), targets.reshape(-1)
        if flat_x.size(0) * self.config.vocab_size <= self.LOGITS_CHUNK_ELEMENTS:
            per_token = self._per_token_loss(flat_x, flat_targets)
        else:
            # checkpointed chunks of rows: all the logits at once would be training's biggest tensors (docs/model.md)
            rows = max(1, self.LOGITS_CHUNK_ELEMENTS // self.config.vocab_size)
            loss_of = (lambda xc, tc: checkpoint(self._per_token_loss, xc, tc, use_reentrant=False)) \
                if torch.is_grad_enabled() else self._per_token_loss
            per_token = torch.cat([loss_of(xc, tc) for xc, tc in zip(flat_x.split(rows), flat_targets.split(rows))])
        if loss_reduction == "none":
            return per_token  # (B*T,), 0 at ignored targets
        if loss_reduction == "sum":
            return per_token.sum()
        # "mean" over the targets that count; all masked (possible in chat data) gives 0, not 0/0 = NaN
        return per_token.sum() / (flat_targets != -1).sum().clamp(min=1)

    def last_logits(self, idx, last):
        """
        Logits (B, vocab) in fp32 at one position of each row, last[b] of row b: forward(idx)[arange(B), last]
        with the head applied to B positions instead of B*T (the head was half of categorical scoring's time).
        """
        x = self._final_hidden(idx)
        return self._softcapped_logits(x[torch.arange(idx.size(0), device=idx.device), last])

    def _final_hidden(self, idx, kv_cache=None):
        """The transformer without its head: idx (B, T) -> the final normed hidden states (B, T, n_embd)."""
        B, T = idx.size()
        t0 = kv_cache.get_pos() if kv_cache is not None else 0
        if t0 + T > self.rotary_len:
            raise ValueError(f"sequence of {t0 + T} tokens exceeds the rotary table ({self.rotary_len})")
        x = self.transformer.wte(idx)
        # under autocast the residual stream (and the rotary tables) in the compute dtype too: docs/model.md
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        x = x.to(dtype)
        cos_sin = self.cos[:, t0:t0 + T].to(dtype), self.sin[:, t0:t0 + T].to(dtype)
        x = x0 = norm(x)
        for i, block in enumerate(self.transformer.h):
            if self.config.layer_scalars:
                x = self.resid_lambdas[i].to(dtype) * x + self.x0_lambdas[i].to(dtype) * x0
            ve = self.value_embeds[str(i)](idx).to(dtype) if block.attn.ve_gate is not None else None
            x = block(x, cos_sin, kv_cache, ve)
        return norm(x)

    def _softcapped_logits(self, x):
        logits = self.lm_head(x).float()
        return self.SOFTCAP * torch.tanh(logits / self.SOFTCAP)

    def _per_token_loss(self, x, targets):
        if x.device.type == "cpu":  # the same loss in fewer passes over the logits (nanochat/losses.py says why)
            return softcapped_cross_entropy(x, self.lm_head.weight, targets, self.SOFTCAP)
        return F.cross_entropy(self._softcapped_logits(x), targets, ignore_index=-1, reduction="none")

    # ------------------------------------------------------------------------------------------
    # accounting

    def num_params(self, value_embeds=True):
        """Number of parameters (the rotary buffers are not parameters); value_embeds=False leaves their tables out."""
        tables = [] if value_embeds else [t.weight for t in self.value_embeds.values()]
        return sum(p.numel() for p in self.parameters()) - sum(w.numel() for w in tables)

    def estimate_flops(self):
        """
        Training FLOPs per token, forward + backward, at T = sequence_len: 6 * (parameters except the lookup tables, wte
        and value embeddings) + 12 * n_layer * n_head * head_dim * T for attention (the full T x T square). Derivation:
        docs/model.md.
        """
        cfg = self.config
        lookups = [self.transformer.wte.weight] + [t.weight for t in self.value_embeds.values()]
        n_matmul = self.num_params() - sum(w.numel() for w in lookups)
        head_dim = cfg.n_embd // cfg.n_head
        return 6 * n_matmul + 12 * cfg.n_layer * cfg.n_head * head_dim * cfg.sequence_len

    # ------------------------------------------------------------------------------------------
    # optimizers

    def setup_optimizers(self, unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.0, matrix_weight_decay=0.0,
                         scalar_lr=0.5):
        """
        [adamw, muon], each parameter in exactly one (why two: docs/optimizers.md). Muon: every matrix of the blocks,
        nearly all the compute. AdamW: wte and lm_head (a lookup table and a classifier whose rows see very different
        gradient scales), betas (0.8, 0.95), eps 1e-10, lrs scaled by (n_embd / 768) ** -0.5 (tuned at width 768),
        weight_decay on both; with the 2026 parts also the value embeddings (half wte's lr, as HEAD) and the layer
        scalars (x0: scalar_lr, betas (0.96, 0.95); resid: scalar_lr / 100, a multiplier of the whole stream; no decay).
        Muon's cautious matrix_weight_decay (nanochat/muon.py). With a process group, DistAdamW / DistMuon (gradients
        averaged inside step()). Every group gets "initial_lr": the loop sets lr = initial_lr * the schedule's
        multiplier. Prints the groups.
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
            adam_groups.append(("value embeddings", [t.weight for t in self.value_embeds.values()], embedding_lr * lr_scale / 2,
                                f"{embedding_lr} x (n_embd/768)^-0.5 / 2", {}))
        if self.config.layer_scalars:
            adam_groups.append(("resid_lambdas", [self.resid_lambdas], scalar_lr / 100, f"{scalar_lr} / 100", dict(weight_decay=0.0)))
            adam_groups.append(("x0_lambdas", [self.x0_lambdas], scalar_lr, f"{scalar_lr}", dict(betas=(0.96, 0.95), weight_decay=0.0)))
        n_assigned = len(matrix_params) + sum(len(g[1]) for g in adam_groups)
        if n_assigned != len(list(self.parameters())) or any(p.dim() != 2 for p in matrix_params):
            raise RuntimeError("setup_optimizers: parameter groups do not partition the model's parameters")

        distributed = is_distributed()
        adamw_kwargs = dict(betas=(0.8, 0.95), eps=1e-10, weight_decay=weight_decay)
        adamw = (DistAdamW if distributed else AdamW)([dict(params=ps, lr=lr, **extra) for _, ps, lr, _, extra in adam_groups],
                                                      **adamw_kwargs)
        # Newton-Schulz computes in the compute dtype, decided once for the run (nanochat/hardware.py)
        muon = (DistMuon if distributed else Muon)(matrix_params, lr=matrix_lr, momentum=0.95, weight_decay=matrix_weight_decay,
                                                   ns_dtype=autocast_dtype(self.lm_head.weight.device.type))
        optimizers = [adamw, muon]
        for opt in optimizers:
            for group in opt.param_groups:
                group["initial_lr"] = group["lr"]

        n = lambda ps: sum(p.numel() for p in ps)
        print0(f"Optimizers ({'distributed, ZeRO-2 style' if distributed else 'single process'}):")
        for (name, ps, lr, how, extra), group in zip(adam_groups, adamw.param_groups):
            print0(f"  AdamW  {name:<7} {n(ps):,} params, lr {lr:.6f} (= {how}), betas {group['betas']}, "
                   f"weight decay {group['weight_decay']}")
        print0(f"  Muon   {len(matrix_params)} block matrices, {n(matrix_params):,} params, lr {matrix_lr}, "
               f"cautious weight decay {matrix_weight_decay}")
        return optimizers

    # ------------------------------------------------------------------------------------------
    # decoding: one new token per row, with a KV cache (the Engine's inner loop)

    @torch.no_grad()
    def prefill(self, idx, kv_cache):
        """
        Run the prompt idx (B, T) into kv_cache; the logits of its last position, (B, vocab) fp32. The same as
        forward(idx, kv_cache=kv_cache)[:, -1] without the head at the other positions.
        """
        return self._softcapped_logits(self._final_hidden(idx, kv_cache)[:, -1])

    @torch.no_grad()
    def decode_weights(self, dtype=None):
        """
        The tensors decode_step reads: ([(c_q, c_k, c_v, attn.c_proj, c_fc, mlp.c_proj, ve_gate, value embedding) per
        layer, the last two None in layers without one], lm_head), each matrix (out, in) as nn.Linear keeps it. On CUDA
        the parameters themselves; on CPU copies in `dtype` (default the weights') stored column-major, which streams
        faster (docs/model.md); value embedding tables are looked up, not multiplied: kept as they are. Copies are
        stale once the weights change.
        """
        if self.lm_head.weight.device.type == "cpu":
            prep = lambda w: w.detach().to(dtype or w.dtype).t().contiguous().t()
        else:
            prep = lambda w: w
        layers = []
        for i, block in enumerate(self.transformer.h):
            lins = (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)
            ve = (prep(block.attn.ve_gate.weight), self.value_embeds[str(i)].weight) if block.attn.ve_gate is not None else (None, None)
            layers.append(tuple(prep(lin.weight) for lin in lins) + ve)
        return layers, prep(self.lm_head.weight)

    @torch.no_grad()
    def decode_step(self, idx, kv_cache, weights, positions=None, key_mask=None):
        """
        One decoding step, forward(idx[:, None], kv_cache)[:, -1] for one token without nn.Module calls: idx (B,) the
        newest token of each row, kv_cache everything before it, `weights` from decode_weights(); returns the logits
        (B, vocab) fp32 and advances the cache one position. Right-aligned rows of different prompt lengths: `positions`
        (B,) each row's own position, `key_mask` (B, 1, 1, >= pos + 1) bool, False on the padding before its prompt.
        """
        B, pos = idx.size(0), kv_cache.pos
        if pos + 1 > self.rotary_len:
            raise ValueError(f"sequence of {pos + 1} tokens exceeds the rotary table ({self.rotary_len})")
        kv_cache.reserve(pos + 1)
        cfg = self.config
        H, Hkv = cfg.n_head, cfg.n_kv_head
        D = cfg.n_embd // H
        x = F.embedding(idx, self.transformer.wte.weight)
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        x = x0 = norm(x.to(dtype))  # (B, n_embd)
        if positions is None:  # every row at the cache's position
            cos, sin = self.cos[:, pos:pos + 1].to(dtype), self.sin[:, pos:pos + 1].to(dtype)
        else:  # (B, 1, 1, D/2): each row at its own position
            cos, sin = self.cos[0, positions][:, None].to(dtype), self.sin[0, positions][:, None].to(dtype)
        mask = None if key_mask is None else key_mask[..., :pos + 1]
        layers, lm_head = weights
        for i, (w_q, w_k, w_v, w_o, w_fc, w_proj, w_gate, ve_table) in enumerate(layers):
            if cfg.layer_scalars:
                x = self.resid_lambdas[i].to(dtype) * x + self.x0_lambdas[i].to(dtype) * x0
            h = norm(x)
            q = norm(apply_rotary_emb(F.linear(h, w_q).view(B, 1, H, D), cos, sin))
            k = norm(apply_rotary_emb(F.linear(h, w_k).view(B, 1, Hkv, D), cos, sin))
            if cfg.qk_scale != 1.0:
                q, k = q * cfg.qk_scale, k * cfg.qk_scale
            v = F.linear(h, w_v).view(B, Hkv, D)
            if ve_table is not None:
                v = v + value_gate(w_gate, h) * F.embedding(idx, ve_table).to(dtype).view(B, Hkv, D)
            k_cache, v_cache = kv_cache.k_layers[i], kv_cache.v_layers[i]  # (B, Hkv, capacity, D)
            k_cache[:, :, pos] = k.view(B, Hkv, D)
            v_cache[:, :, pos] = v
            y = F.scaled_dot_product_attention(q.view(B, H, 1, D), k_cache[:, :, :pos + 1], v_cache[:, :, :pos + 1],
                                               attn_mask=mask, enable_gqa=H != Hkv)
            x = x + F.linear(y.view(B, H * D), w_o)
            x = x + F.linear(F.relu(F.linear(norm(x), w_fc)).square(), w_proj)
        kv_cache.advance()
        logits = F.linear(norm(x), lm_head).float()
        return self.SOFTCAP * torch.tanh(logits / self.SOFTCAP)

    # ------------------------------------------------------------------------------------------
    # sampling

    @torch.no_grad()
    def generate(self, tokens, max_tokens, temperature=1.0, top_k=None, seed=42):
        """
        Naive sampling that re-runs the whole sequence each step (no KV cache): yields one token id (int) at a time,
        `max_tokens` of them. The quick samples of training, and the Engine's reference (same sample_next_token).
        """
        from nanochat.engine import sample_next_token  # the Engine's sampler (engine.py does not import this module)
        device = self.lm_head.weight.device
        rng = torch.Generator(device=device).manual_seed(seed)
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        for _ in range(max_tokens):
            logits = self.forward(ids)[:, -1, :]
            next_id = sample_next_token(logits, rng, temperature, top_k)
            ids = torch.cat((ids, next_id[:, None]), dim=1)
            yield next_id.item()
