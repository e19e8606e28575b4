"""
nanochat's GPT as a transformers model (remote code): `scripts/export_model.py --layout=remote` copies this file,
unchanged, beside the weights of a model that uses parts transformers' own NanoChat lacks (qk_scale, layer scalars,
value embeddings), and config.json's auto_map points at its two classes:

    AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)

It imports nothing of nanochat (it travels alone): the forward of nanochat/gpt.py is written again here, with the
same parameter names (the weights are saved as nanochat holds them) and the same arithmetic: parameter-free RMSNorm
(F.rms_norm; eps None = its default, float32's machine epsilon), rotary with nanochat's pairing, direction and
base, QK norm after rotary then q, k times qk_scale, GQA, ReLU^2 MLP, untied head, logits soft-capped in fp32.
Generation keeps keys and values in the transformers Cache it is given (a DynamicCache by default).

Batches: rows of one length. A padded attention_mask (zeros) is refused: positions and the attention are causal
over every token, as nanochat's are. Tested with transformers 5.24.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

VE_GATE_CHANNELS = 12  # the value-embedding gate reads this many channels of the block's input
# the output field that carries the cache: "cache" in recent transformers releases, "past_key_values" before
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class NanoChatGPTConfig(PretrainedConfig):
    """nanochat's GPTConfig fields (sequence_len ... value_embeds), plus the RMSNorm epsilon and the logit soft cap."""

    model_type = "nanochat_gpt"
    attribute_map = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                     "num_key_value_heads": "n_kv_head", "max_position_embeddings": "sequence_len"}

    def __init__(self, sequence_len=2048, vocab_size=65536, n_layer=20, n_head=10, n_kv_head=10, n_embd=1280,
                 rope_base=10000.0, qk_scale=1.0, layer_scalars=False, value_embeds=False, rms_norm_eps=None,
                 final_logit_softcapping=15.0, tie_word_embeddings=False, use_cache=True, **kwargs):
        self.sequence_len, self.vocab_size, self.n_layer = sequence_len, vocab_size, n_layer
        self.n_head, self.n_kv_head, self.n_embd = n_head, n_kv_head, n_embd
        self.rope_base, self.qk_scale = rope_base, qk_scale
        self.layer_scalars, self.value_embeds = layer_scalars, value_embeds
        self.rms_norm_eps, self.final_logit_softcapping = rms_norm_eps, final_logit_softcapping
        self.use_cache = use_cache
        if tie_word_embeddings:
            raise ValueError("nanochat's GPT has an untied head: tie_word_embeddings must be false")
        super().__init__(tie_word_embeddings=False, **kwargs)


def norm(x, eps):
    """Parameter-free RMSNorm over the last dimension (eps None: F.rms_norm's default, as nanochat's)."""
    return F.rms_norm(x, (x.size(-1),), eps=eps)


def has_value_embeds(config, layer_idx):
    """Alternating layers, counted so that the last one has one."""
    return config.value_embeds and layer_idx % 2 == (config.n_layer - 1) % 2


def rotary(positions, head_dim, base, dtype):
    """cos, sin (B or 1, T, 1, head_dim/2) at `positions` (B or 1, T): nanochat's rotary tables at these rows."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    return freqs.cos()[:, :, None].to(dtype), freqs.sin()[:, :, None].to(dtype)


def apply_rotary_emb(x, cos, sin):
    """x (B, T, H, D): channel pairs (i, i + D/2) rotated, in nanochat's direction."""
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=3)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx, self.qk_scale, self.eps = layer_idx, config.qk_scale, config.rms_norm_eps
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.ve_gate = nn.Linear(VE_GATE_CHANNELS, self.n_kv_head, bias=False) if has_value_embeds(config, layer_idx) else None

    def forward(self, x, cos_sin, cache, ve):
        B, T, _ = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:  # the token's value embedding, gated per kv head by 3 * sigmoid(.) of the input's first channels
            gate = 3 * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS])).unsqueeze(-1)
            v = v + gate * ve.view(B, T, self.n_kv_head, self.head_dim)
        cos, sin = cos_sin
        q, k = norm(apply_rotary_emb(q, cos, sin), self.eps), norm(apply_rotary_emb(k, cos, sin), self.eps)
        if self.qk_scale != 1.0:
            q, k = q * self.qk_scale, k * self.qk_scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        Tq, Tk = q.size(2), k.size(2)
        gqa = self.n_head != self.n_kv_head
        if Tq == Tk:  # no cached prefix: causal
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        elif Tq == 1:  # one new token sees everything before it
            y = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        else:  # new tokens after a cached prefix: all of the prefix, causal among themselves
            mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


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
        self.eps = config.rms_norm_eps
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x, cos_sin, cache, ve):
        x = x + self.attn(norm(x, self.eps), cos_sin, cache, ve)
        return x + self.mlp(norm(x, self.eps))


class NanoChatGPTForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = NanoChatGPTConfig
    _no_split_modules = ["Block"]

    def __init__(self, config):
        super().__init__(config)
        if config.n_embd % config.n_head or config.n_head % config.n_kv_head or (config.n_embd // config.n_head) % 2:
            raise ValueError(f"n_embd {config.n_embd} must divide into n_head {config.n_head} heads of even width, "
                             f"n_head into n_kv_head {config.n_kv_head} groups")
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.layer_scalars:  # before block i: x = resid_lambdas[i] * x + x0_lambdas[i] * (the normed embedding)
            self.resid_lambdas = nn.Parameter(torch.ones(config.n_layer))
            self.x0_lambdas = nn.Parameter(torch.zeros(config.n_layer))
        if config.value_embeds:
            kv_width = config.n_kv_head * (config.n_embd // config.n_head)
            self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(config.vocab_size, kv_width)
                                               for i in range(config.n_layer) if has_value_embeds(config, i)})
        self.post_init()

    def _init_weights(self, module):
        """For a model made from a config alone (loading replaces all of it): the layer scalars as the identity."""
        super()._init_weights(module)
        if module is self and self.config.layer_scalars:
            with torch.no_grad():
                self.resid_lambdas.fill_(1.0)
                self.x0_lambdas.fill_(0.0)

    def get_input_embeddings(self):
        return self.transformer.wte

    def set_input_embeddings(self, value):
        self.transformer.wte = value

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                use_cache=None, labels=None, logits_to_keep=0, inputs_embeds=None, **kwargs):
        """
        input_ids (B, T): the new tokens (those after the cache's). Returns CausalLMOutputWithPast: logits (B, T or
        logits_to_keep, vocab) in fp32, the cache, and with labels (B, T) (-100 = ignore) the next-token loss.
        """
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("nanochat's GPT takes input_ids (its value embeddings look tokens up): not inputs_embeds")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("nanochat's GPT attends causally over every token: padded batches (an attention_mask with "
                             "zeros) are not supported; run prompts of different lengths one at a time")
        cache = cache if cache is not None else past_key_values  # its name before transformers renamed it `cache`
        if cache is None and (self.config.use_cache if use_cache is None else use_cache):
            cache = DynamicCache(config=self.config)
        cfg, T = self.config, input_ids.size(1)
        if position_ids is None:
            t0 = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(t0, t0 + T, device=input_ids.device)[None]
        x = self.transformer.wte(input_ids)
        cos_sin = rotary(position_ids, cfg.n_embd // cfg.n_head, cfg.rope_base, x.dtype)
        x = x0 = norm(x, cfg.rms_norm_eps)
        for i, block in enumerate(self.transformer.h):
            if cfg.layer_scalars:
                x = self.resid_lambdas[i].to(x.dtype) * x + self.x0_lambdas[i].to(x.dtype) * x0
            ve = self.value_embeds[str(i)](input_ids).to(x.dtype) if block.attn.ve_gate is not None else None
            x = block(x, cos_sin, cache, ve)
        x = norm(x, cfg.rms_norm_eps)
        if isinstance(logits_to_keep, int):
            x = x[:, -logits_to_keep:] if logits_to_keep else x
        else:
            x = x[:, logits_to_keep]
        softcap = cfg.final_logit_softcapping
        logits = softcap * torch.tanh(self.lm_head(x).float() / softcap)
        loss = None if labels is None else self.loss_function(logits, labels, cfg.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})
