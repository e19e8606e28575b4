"""
Sliding-window attention (GPTConfig.window_pattern, issue 37 item 3): gpt.attention's masks against attention
written out in float64, position by position; the per-layer windows; a windowed model's cached paths (prefill, a
chunk after a prefix, one token at a time, the Engine's right-aligned rows of different lengths) against the full
forward and naive generation, at lengths where the window binds. The other kernels of full-context attention
(nanochat/attention_kernels.py: "eager", "flex") against the same, in training (eager: gradients), compiled, in bf16.
"""

import pytest
import torch

from nanochat.attention_kernels import KERNELS
from nanochat.engine import Engine, KVCache, decode_step, decode_weights, generate_naive
from nanochat.gpt import GPT, GPTConfig, attention, check_shapes, layer_windows
from nanochat.tokenizer import Tokenizer

from helpers import written_out


CASES = {  # name: (Tq, Tk, window, padding of each row (a key_mask) or None)
    "training, window 3": (12, 12, 3, None),
    "training, window 0 (itself only)": (12, 12, 0, None),
    "training, no window": (12, 12, None, None),
    "training, window covering everything": (12, 12, 11, None),
    "chunk after a prefix, window 4": (5, 14, 4, None),
    "one token, window 4": (1, 14, 4, None),
    "one token, padded rows, window 6": (1, 14, 6, [0, 9]),
    "chunk, padded rows, window 2": (4, 14, 2, [0, 3]),
}


@pytest.mark.parametrize("name", CASES)
def test_attention_with_a_window_equals_attention_written_out(name):
    Tq, Tk, window, padding = CASES[name]
    torch.manual_seed(0)
    q = torch.randn(2, 4, Tq, 8)
    k = torch.randn(2, 2, Tk, 8)
    v = torch.randn(2, 2, Tk, 8)
    key_mask = None
    if padding is not None:
        key_mask = torch.arange(Tk)[None, None, None, :] >= torch.tensor(padding)[:, None, None, None]
    got = attention(q, k, v, key_mask, window)
    torch.testing.assert_close(got.double(), written_out(q, k, v, window, key_mask), rtol=0, atol=1e-5)
    if window is not None and window < Tk - 1:  # the window binds here: attention without it differs
        assert (got - attention(q, k, v, key_mask)).abs().max() > 1e-3


def test_layer_windows_tile_the_pattern_and_end_long():
    config = GPTConfig(sequence_len=2048, n_layer=6, window_pattern="SSSL")
    assert layer_windows(config) == [512, 512, 512, None, 512, None]  # tiled; the last layer always sees everything
    assert layer_windows(GPTConfig(sequence_len=200, n_layer=3, window_pattern="S")) == [128, 128, None]  # 50 -> 128
    assert layer_windows(GPTConfig(n_layer=4)) == [None] * 4  # the default, "L": no windows
    for bad in ("", "SXL", "ssl"):
        with pytest.raises(ValueError, match="window_pattern"):
            check_shapes(GPTConfig(window_pattern=bad))


def windowed_model(window_pattern="SL", T=160):
    """A model whose S layers see 128 earlier tokens (the shortest window) and whose sequences are longer."""
    torch.manual_seed(0)
    config = GPTConfig(sequence_len=T, vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                       window_pattern=window_pattern)
    model = GPT(config)
    model.init_weights()
    for name, p in model.named_parameters():  # the zero-initialised projections and head get weight
        if name.endswith("c_proj.weight") or name == "lm_head.weight":
            torch.nn.init.normal_(p, std=0.3)
    return model.eval()


def test_flops_count_the_window():
    windowed = windowed_model("SL", T=1024)
    full = windowed_model("L", T=1024)
    # layer 0 sees 256 of 1024 positions: its attention term 12 * n_embd * 256 instead of 12 * n_embd * 1024
    assert full.estimate_flops() - windowed.estimate_flops() == 12 * 32 * (1024 - 256)


def test_windowed_model_cached_paths_equal_its_full_forward():
    model = windowed_model()
    full_model = windowed_model("L")
    idx = torch.randint(0, 256, (2, 160))
    with torch.no_grad():
        full = model(idx)
        assert (full - full_model(idx))[:, 140:].abs().max() > 1e-3  # the window binds at these positions
        cache = KVCache(batch_size=2, n_kv_head=2, max_len=160, head_dim=8, n_layer=2, device="cpu",
                        dtype=torch.float32)
        pieces = [model(idx[:, :100], kv_cache=cache), model(idx[:, 100:140], kv_cache=cache)]  # a prefill, a chunk
        torch.testing.assert_close(torch.cat(pieces, dim=1), full[:, :140], rtol=0, atol=1e-5)
        weights = decode_weights(model)
        for t in range(140, 160):  # one token at a time, past the window of 128
            torch.testing.assert_close(decode_step(model, idx[:, t], cache, weights), full[:, t], rtol=0, atol=1e-5)


def test_engine_decodes_a_windowed_model_as_naive_generation(small_tokenizer_dir):
    """
    Prompts of 150 and 131 tokens decoded together (right-aligned, the shorter one padded) for 20 greedy tokens, through
    the window of 128: each equals naive generation of its prompt alone.
    """
    tokenizer = Tokenizer.from_directory(str(small_tokenizer_dir))
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=192, vocab_size=tokenizer.get_vocab_size(), n_layer=2, n_head=4, n_kv_head=2,
                          n_embd=32, window_pattern="SL"))
    model.init_weights()
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight") or name == "lm_head.weight":
            torch.nn.init.normal_(p, std=0.3)
    model.eval()
    engine = Engine(model, tokenizer)
    prompts = [torch.randint(300, 500, (n,)).tolist() for n in (150, 131)]
    columns = [column for column, _ in engine.generate_many(prompts, max_tokens=20, temperature=0)]
    for p, prompt in enumerate(prompts):
        expected = []
        for token in generate_naive(model, prompt, max_tokens=20, temperature=0.0):
            expected.append(token)
            if token in engine.end_tokens:
                break
        assert [column[p] for column in columns][:len(expected)] == expected


@pytest.mark.parametrize("name", ["eager", "flex"])
def test_attention_kernels_equal_attention_written_out(name):
    """
    T = 160 (two of FlexAttention's blocks of 128, the second partial): a window of 128 binds in the second. flex:
    one compiled kernel serves every window (attention_kernels.cached_block_mask), none compiled again.
    """
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    q = torch.randn(2, 4, 160, 8)
    k = torch.randn(2, 2, 160, 8)
    v = torch.randn(2, 2, 160, 8)
    for window in (None, 0, 3, 128):
        got = KERNELS[name](q, k, v, window=window)
        expected = written_out(q, k, v, window)
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5, msg=f"window {window}")
        torch.testing.assert_close(got, attention(q, k, v, window=window), rtol=0, atol=1e-5, msg=f"window {window}")
    assert counters["stats"]["unique_graphs"] == (1 if name == "flex" else 0)


def test_a_model_through_each_kernel_gives_sdpas_logits_and_eager_its_gradients():
    """
    fp32: logits within 1e-5 of SDPA's (rounding: measured 2.4e-7 here), eager's gradients within 1e-6 (measured
    2.8e-9). bf16 under autocast: each kernel as far from the fp32 logits as SDPA is (measured here: largest 0.097
    eager, 0.116 flex, 0.121 SDPA; mean 0.0116 each), asserted within 2x SDPA's largest and 1.5x its mean.
    FlexAttention has no backward on a CPU (base_train refuses it there).
    """
    model = windowed_model("SL")
    idx = torch.randint(0, 256, (2, 160))
    targets = torch.randint(0, 256, (2, 160))
    gradients = {}
    for name in ("sdpa", "eager"):
        model.attention_kernel = KERNELS[name]
        model.zero_grad()
        model(idx, targets).backward()
        gradients[name] = [p.grad.clone() for p in model.parameters()]
    for ours, sdpas in zip(gradients["eager"], gradients["sdpa"]):
        torch.testing.assert_close(ours, sdpas, rtol=0, atol=1e-6)
    errors = {}
    with torch.no_grad():
        model.attention_kernel = KERNELS["sdpa"]
        exact = model(idx)
        for name in ("sdpa", "eager", "flex"):
            model.attention_kernel = KERNELS[name]
            torch.testing.assert_close(model(idx), exact, rtol=0, atol=1e-5)
            with torch.autocast("cpu", torch.bfloat16):
                errors[name] = (model(idx) - exact).abs()
    for name in ("eager", "flex"):
        assert errors[name].max() <= 2 * errors["sdpa"].max(), (name, errors[name].max(), errors["sdpa"].max())
        assert errors[name].mean() <= 1.5 * errors["sdpa"].mean(), (name, errors[name].mean(), errors["sdpa"].mean())


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own import
def test_flex_attention_inside_a_compiled_model_equals_it_uncompiled():
    """
    Inside torch.compile the block mask is traced with the model; torch 2.13's CPU kernel read the transposed q, k, v
    of the block wrongly there (4.2 off) until they were made contiguous (attention_kernels.flex_attention).
    """
    model = windowed_model("SL")
    model.attention_kernel = KERNELS["flex"]
    idx = torch.randint(0, 256, (2, 160))
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model)(idx), model(idx), rtol=0, atol=1e-5)
