"""
nanochat's GPT as a transformers model (remote code), for models with parts transformers' own NanoChat lacks.

The parts: qk_scale, layer scalars, value embeddings, sliding windows. `scripts/export_model.py --layout=remote`
writes this file beside the weights, with the text of nanochat/gpt.py's architecture part in place of the import
marked below, and config.json's auto_map points at its three classes:

    AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)  # logits
    AutoModel.from_pretrained(directory, trust_remote_code=True)  # hidden states: what serving engines wrap

So the exported file imports nothing of nanochat (it travels alone) and computes what nanochat computes, by the same
code: the parameters (build_parameters, under nanochat's names), the blocks and the transformer around them
(hidden_states), the soft-capped head. What is transformers' is what a backend replaces: the attention runs through
transformers' attention interface (config._attn_implementation: "sdpa" by default, "eager", "flex_attention", or a
serving engine's own, which keeps its own KV cache), with transformers' masks (sliding windows as config.sliding_window
on the layers config.layer_types names), and keys and values go into transformers' Cache (a DynamicCache by default,
whose sliding layers keep only the window). The layout follows transformers' convention, which vLLM's Transformers
backend relies on (docs/export.md): NanoChatGPTModel (AutoModel) is the transformer, NanoChatGPTForCausalLM is `model`
+ `lm_head`; the weights keep nanochat's names (transformers and vLLM add the `model.` prefix as they load).

Batches: rows of one length. A padded attention_mask (zeros) is refused: positions are counted over every token, as
nanochat's are. Tested with transformers 5.24 (vLLM 0.32: 5.19).
"""

# what nanochat/gpt.py's architecture part uses (an export writes its text in place of the nanochat.gpt line below)
from collections import namedtuple  # noqa: F401
from dataclasses import asdict, dataclass, fields  # noqa: F401  (fields: NanoChatGPTConfig too)
from functools import partial  # noqa: F401

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# nanochat.gpt's architecture: an export writes its text here (nanochat/hf_format.py, modeling_source)
from nanochat.gpt import (GPTConfig, SOFTCAP, build_parameters, hidden_states, layer_windows, rotary, softcapped,
                          weights_of)

# the output field that carries the cache: "cache" in recent transformers releases, "past_key_values" before
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class NanoChatGPTConfig(PretrainedConfig):
    """
    GPTConfig's fields, with its defaults (whatever fields it has), plus the RMSNorm eps and the logit soft cap; and,
    derived from them (so never set), what transformers and serving engines read: head_dim, layer_types
    ("sliding_attention" or "full_attention" per layer) and sliding_window (the tokens a windowed query sees, itself
    included: nanochat's window + 1).
    """

    model_type = "nanochat_gpt"
    attribute_map = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                     "num_key_value_heads": "n_kv_head", "max_position_embeddings": "sequence_len"}

    def __init__(self, rms_norm_eps=None, final_logit_softcapping=SOFTCAP, tie_word_embeddings=False, use_cache=True,
                 **kwargs):
        for field in fields(GPTConfig):
            setattr(self, field.name, kwargs.pop(field.name, field.default))
        if rms_norm_eps is not None or final_logit_softcapping != SOFTCAP or tie_word_embeddings:
            raise ValueError(f"nanochat's GPT computes rms_norm_eps=None (F.rms_norm's default), "
                             f"final_logit_softcapping={SOFTCAP} and an untied head; got {rms_norm_eps}, "
                             f"{final_logit_softcapping}, {tie_word_embeddings}")
        self.rms_norm_eps = None
        self.final_logit_softcapping = SOFTCAP
        self.use_cache = use_cache
        windows = layer_windows(self)
        derived = dict(head_dim=self.n_embd // self.n_head,
                       layer_types=["full_attention" if w is None else "sliding_attention" for w in windows],
                       sliding_window=next((w + 1 for w in windows if w is not None), None))
        for name, value in derived.items():  # a saved config holds them: they must still follow from the fields
            if kwargs.get(name, value) != value:
                raise ValueError(f"{name} follows from the GPT's fields ({value!r} here), got {kwargs[name]!r}")
            kwargs.pop(name, None)
            setattr(self, name, value)
        super().__init__(tie_word_embeddings=False, **kwargs)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """
    attn_implementation "eager": softmax(q k^T * scaling + mask) v in plain matmuls, for query (B, H, Tq, D), key and
    value (B, Hkv, Tk, D) and transformers' eager mask (added: 0 where a query sees a key, a large negative where
    not). Returns the output (B, Tq, H, D) and the attention weights, as transformers' attention functions do.
    """
    groups = query.size(1) // key.size(1)  # GQA: each key/value head serves this many query heads
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class NanoChatGPTAttention(nn.Module):
    """
    Layer layer_idx's attention, computed by transformers' attention interface: no parameters (the block's own compute
    q, k and v), one call of the function config._attn_implementation names. A serving engine that runs the model
    through this interface (vLLM's transformers backend) finds that call here, attaches its own attention to this
    module, and sizes its KV cache from the config (heads, head_dim, layer_types, sliding_window).
    """

    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = True
        self.scaling = config.head_dim ** -0.5  # q and k are already normed and scaled by qk_scale: the usual scale
        self.num_key_value_groups = config.n_head // config.n_kv_head
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if sliding else None  # read by flash attention, which masks none

    def forward(self, query, key, value, attention_mask, cache=None, **kwargs):
        """query (B, H, T, D), key and value (B, Hkv, T, D) of the new tokens -> (B, T, H, D)."""
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                    eager_attention_forward)
        output, _ = attention_interface(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling,
                                        sliding_window=self.sliding_window, **kwargs)
        return output.reshape(query.size(0), query.size(2), query.size(1), query.size(3))  # vLLM's: (T, H * D)


class Matrix(nn.Module):
    """
    A block's weight (out, in), held in place of build_parameters' nn.Linear (same name, same parameter): the blocks
    read their weights (hidden_states multiplies by them, q, k and v stacked into one matrix), and serving engines
    replace every nn.Linear with layers of their own whose weights may be out of reach (vLLM on a CPU repacks them
    and empties `.weight`). A Matrix they load as it is.
    """

    def __init__(self, weight):
        super().__init__()
        self.weight = weight


class NanoChatGPTPreTrainedModel(PreTrainedModel):
    """What transformers and its backends read of the model classes: the weights' prefix, the attention it takes."""

    config_class = NanoChatGPTConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_flash_attn = True
    _supports_attention_backend = True  # attention only through the interface: vLLM's check before running it

    def _init_weights(self, module):
        """For a model made from a config alone (loading replaces all of it): the layer scalars as the identity."""
        super()._init_weights(module)
        if isinstance(module, NanoChatGPTModel) and self.config.layer_scalars:
            with torch.no_grad():
                module.resid_lambdas.fill_(1.0)
                module.x0_lambdas.fill_(0.0)


class NanoChatGPTModel(NanoChatGPTPreTrainedModel):
    """
    The transformer without its head (transformers' AutoModel): token ids -> the final normed hidden states. Its
    parameters are build_parameters' but the head; `attention` holds each layer's NanoChatGPTAttention.
    """

    def __init__(self, config):
        super().__init__(config)
        build_parameters(self, config)
        del self.lm_head  # the causal LM's (transformers' convention: the head beside the base model)
        for block in self.transformer.h:
            for part in (block.attn, block.mlp):
                for name, child in list(part.named_children()):
                    setattr(part, name, Matrix(child.weight))
        self.attention = nn.ModuleList([NanoChatGPTAttention(config, i) for i in range(config.n_layer)])
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.wte

    def set_input_embeddings(self, value):
        self.transformer.wte = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, return_dict=None, output_attentions=None,
                output_hidden_states=None, **kwargs):
        """
        input_ids (B, T): the new tokens (those after the cache's). Returns BaseModelOutputWithPast: the final normed
        hidden states (B, T, n_embd) and the cache. kwargs go to the attention function.
        """
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("nanochat's GPT takes input_ids (its value embeddings look tokens up): not inputs_embeds")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("nanochat's GPT attends causally over every token: padded batches (an attention_mask with "
                             "zeros) are not supported; run prompts of different lengths one at a time")
        cfg = self.config
        cache = cache if cache is not None else past_key_values  # its name before transformers renamed it `cache`
        if cache is None and (cfg.use_cache if use_cache is None else use_cache):
            cache = DynamicCache(config=cfg)
        B, T = input_ids.shape
        if position_ids is None:
            t0 = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(t0, t0 + T, device=input_ids.device)[None]
        dtype = self.transformer.wte.weight.dtype
        # the masks of the two kinds of layer (None where the attention function needs none: causal, no padding)
        shape = torch.empty(B, T, 0, dtype=dtype, device=input_ids.device)  # what the mask makers read of the input
        masks = {"full_attention": create_causal_mask(cfg, shape, attention_mask, cache, position_ids)}
        if "sliding_attention" in cfg.layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(cfg, shape, attention_mask, cache,
                                                                           position_ids)
        cos_sin = [table.to(dtype) for table in rotary(position_ids, cfg.head_dim, cfg.rope_base)]

        def attend(i, q, k, v, window):
            """Layer i's attention (its window is in its mask); block() takes (B, H, T, D)."""
            out = self.attention[i](q, k, v, masks[cfg.layer_types[i]], cache=cache, position_ids=position_ids,
                                    **kwargs)
            return out.transpose(1, 2)

        x = hidden_states(weights_of(self), input_ids, cos_sin, attend, cfg)
        return BaseModelOutputWithPast(last_hidden_state=x, **{CACHE_FIELD: cache})


class NanoChatGPTForCausalLM(NanoChatGPTPreTrainedModel, GenerationMixin):
    """NanoChatGPTModel (`model`) and the soft-capped head (`lm_head`): next-token logits."""

    def __init__(self, config):
        super().__init__(config)
        self.model = NanoChatGPTModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)  # as build_parameters makes it
        self.post_init()

    def get_input_embeddings(self):
        return self.model.transformer.wte

    def set_input_embeddings(self, value):
        self.model.transformer.wte = value

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                use_cache=None, labels=None, logits_to_keep=0, inputs_embeds=None, **kwargs):
        """
        input_ids (B, T): the new tokens (those after the cache's). Returns CausalLMOutputWithPast: logits (B, T or
        logits_to_keep, vocab) in fp32, the cache, and with labels (B, T) (-100 = ignore) the next-token loss.
        """
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        x = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            x = x[:, -logits_to_keep:] if logits_to_keep else x
        else:
            x = x[:, logits_to_keep]
        logits = softcapped(self.lm_head(x))
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: getattr(out, CACHE_FIELD)})
