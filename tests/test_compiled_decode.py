"""
engine.static_step under the real torch.compile (CPU, inductor's default mode) against engine.decode_step.

The compiled step attends over the whole preallocated cache under a mask instead of a slice of it, so its sums run
over other lengths and in another order: in fp32 its logits match decode_step's within atol 1e-5 (measured here: at
most ~3e-6, logits of magnitude up to 15). Both are run step by step from the same prefilled cache, past the short
window of a sliding-window layer, with GQA, and with right-aligned rows of different lengths (key_mask, each row at
its own position). The Engine's greedy tokens with it equal naive generation's: tests/test_engine.py.
"""

import torch

from nanochat.engine import KVCache, decode_step, decode_weights, static_step
from nanochat.gpt import GPT, GPTConfig, layer_windows


def windowed_model():
    """
    Depth 3 (window pattern SL: layers S, L, L), 4 query heads over 2 kv heads, random weights with the output
    projections and the head given weight (init_weights zeroes them); its short window is 128 positions.
    """
    torch.manual_seed(0)
    cfg = GPTConfig(sequence_len=64, vocab_size=256, n_layer=3, n_head=4, n_kv_head=2, n_embd=64, window_pattern="SL")
    model = GPT(cfg)
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight") or name == "lm_head.weight":
                p.normal_(std=p.size(1) ** -0.5)
    return model.eval()


def test_the_compiled_step_gives_the_plain_steps_logits_past_a_window_and_with_padding():
    model = windowed_model()
    cfg = model.config
    window = layer_windows(cfg)[0]
    assert window == 128 and layer_windows(cfg)[1:] == [None, None]
    head_dim = cfg.n_embd // cfg.n_head
    capacity = 192
    lengths = (12, 5)  # two prompts, right-aligned: row 1 has 7 padding columns
    padding = torch.tensor([0, 7])
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, capacity), generator=gen)
    key_mask = torch.arange(capacity)[None, None, None, :] >= padding[:, None, None, None]
    compiled = torch.compile(static_step, dynamic=False, fullgraph=True)
    with torch.inference_mode():
        plain = KVCache(2, cfg.n_kv_head, capacity, head_dim, cfg.n_layer, "cpu", torch.float32)
        static = KVCache(2, cfg.n_kv_head, capacity, head_dim, cfg.n_layer, "cpu", torch.float32)
        static.k.zero_()
        static.v.zero_()
        for cache in (plain, static):
            cache.k[:, 1, :, :7] = 0
            cache.v[:, 1, :, :7] = 0
            for row, length in enumerate(lengths):
                one = KVCache(1, cfg.n_kv_head, length, head_dim, cfg.n_layer, "cpu", torch.float32)
                model.prefill(ids[row:row + 1, :length], one)
                cache.place(one, slice(row, row + 1), 12)
            cache.advance(12)
        weights = decode_weights(model)
        worst = 0.0
        checked = []
        for column in range(12, capacity - 1):
            token = ids[:, column]
            expected = decode_step(model, token, plain, weights, plain.pos - padding, key_mask)
            where = torch.tensor([static.pos])
            got = compiled(weights, token, where, where - padding, static.k_layers, static.v_layers, model.cos,
                           model.sin, key_mask, cfg, torch.float32)
            static.advance()
            worst = max(worst, (got - expected).abs().max().item())
            checked.append(column)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        # the keys the compiled step wrote are the plain step's, column for column
        torch.testing.assert_close(static.k[:, :, :, :static.pos], plain.k[:, :, :, :plain.pos], rtol=0, atol=1e-5)
    assert checked[-1] > window + 12 and expected.abs().max() > 1, (checked[-1], expected.abs().max())
    assert worst > 0  # other sums: not the same code run twice


def test_one_row_without_padding():
    """The plain case (every row at the cache's position, no key_mask): one row, a few steps."""
    model = windowed_model()
    cfg = model.config
    head_dim = cfg.n_embd // cfg.n_head
    ids = torch.randint(0, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(static_step, dynamic=False, fullgraph=True)
    with torch.inference_mode():
        plain = KVCache(1, cfg.n_kv_head, 32, head_dim, cfg.n_layer, "cpu", torch.float32)
        static = KVCache(1, cfg.n_kv_head, 32, head_dim, cfg.n_layer, "cpu", torch.float32)
        static.k.zero_()
        static.v.zero_()
        model.prefill(ids[:, :4], plain)
        model.prefill(ids[:, :4], static)
        weights = decode_weights(model)
        for t in range(4, 24):
            expected = decode_step(model, ids[:, t], plain, weights)
            where = torch.tensor([static.pos])
            got = compiled(weights, ids[:, t], where, where.expand(1), static.k_layers, static.v_layers, model.cos,
                           model.sin, None, cfg, torch.float32)
            static.advance()
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
