"""
Tests of nanochat/engine.py: exactness of cached decoding against naive generation on a (briefly) trained
model, sampling, context limits, the calculator tool and its safety, and streaming text.
"""

import copy
import os

import pyarrow.parquet as pq
import pytest
import torch

from helpers import bigram_model, build_once, engine_stream
from nanochat.output import UserError
import nanochat.engine as engine_module
from nanochat.engine import (Batch, Engine, KVCache, Row, TextStreamer, decode_step, decode_weights,
                             generate_naive, sample_next_token)
from nanochat.gpt import GPT, GPTConfig
from nanochat.tokenizer import Tokenizer

SEQ_LEN = 64


def pydocs_texts(pydocs_dir, shard):
    names = sorted(name for name in os.listdir(pydocs_dir) if name.endswith(".parquet"))  # the last one is validation
    return pq.read_table(os.path.join(pydocs_dir, names[shard]), columns=["text"]).column("text").to_pylist()


@pytest.fixture(scope="module")
def tiny(small_tokenizer_dir, pydocs_dir, tmp_path_factory):
    """
    A depth-2 GPT (4 query heads sharing 2 kv heads, so grouped-query attention is covered) trained for 100
    AdamW steps (~5 s, once per test session: conftest.build_once) on pydocs documents (each after a <|bos|>)
    with the session's 512-token tokenizer: enough that greedy continuations are varied text-like token
    sequences, not one token repeated, so "engine == naive" means something. It also learned to end
    documents, i.e. to emit <|bos|>. Returns (model, tokenizer, held-out prompts as token lists).
    """
    tokenizer = Tokenizer.from_directory(str(small_tokenizer_dir))
    bos = tokenizer.get_bos_token_id()
    cfg = GPTConfig(sequence_len=SEQ_LEN, vocab_size=tokenizer.get_vocab_size(), n_layer=2, n_head=4, n_kv_head=2,
                    n_embd=128)

    def train(path):
        documents = tokenizer.encode(pydocs_texts(pydocs_dir, 0)[:600], prepend=bos)
        data = torch.tensor([t for ids in documents for t in ids])
        torch.manual_seed(0)
        model = GPT(cfg)
        model.init_weights()
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, betas=(0.9, 0.95))
        gen = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(100):
            starts = torch.randint(0, len(data) - SEQ_LEN - 1, (16,), generator=gen).tolist()
            batch = torch.stack([data[s:s + SEQ_LEN + 1] for s in starts])
            loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        torch.save({"model": model.state_dict(), "losses": losses}, path)

    trained = torch.load(build_once(tmp_path_factory, "engine_tiny.pt", train))
    losses = trained["losses"]
    assert losses[-1] < losses[0] - 1.5, losses  # it did learn something
    model = GPT(cfg)
    model.init_weights()  # also fills the rotary tables, which are buffers the state dict does not hold
    model.load_state_dict(trained["model"])
    model.eval()
    held_out = tokenizer.encode(pydocs_texts(pydocs_dir, -1)[:20], prepend=bos)  # validation shard
    prompts = [ids for ids in held_out if len(ids) > SEQ_LEN]
    return model, tokenizer, prompts


def naive_until_end(model, engine, prompt, max_tokens, **kwargs):
    """engine.generate_naive (no cache), cut after the first token that ends a sample, as the engine stops there."""
    out = []
    for token in generate_naive(model, prompt, max_tokens, **kwargs):
        out.append(token)
        if token in engine.end_tokens:
            break
    return out


@pytest.mark.parametrize("prompt_len", [1, 6, 23, 50])
def test_greedy_matches_naive_generation(tiny, prompt_len):
    model, tokenizer, prompts = tiny
    engine = Engine(model, tokenizer)
    generated = []
    # every prompt starts with <|bos|>: for length 1, also try single tokens from inside the documents
    if prompt_len > 1:
        candidates = [p[:prompt_len] for p in prompts[:3]]
    else:
        candidates = [prompts[0][:1]] + [p[1:2] for p in prompts[:3]]
    for prompt in candidates:
        max_tokens = min(30, SEQ_LEN - prompt_len)
        expected = naive_until_end(model, engine, prompt, max_tokens, temperature=0)
        (tokens,), (masks,) = engine_stream(engine, prompt, max_tokens=max_tokens, temperature=0)
        assert tokens == expected
        assert masks == [1] * len(tokens)
        generated += tokens
    assert len(set(generated)) >= 10, generated  # varied output: the comparison is not trivial


def test_an_engine_follows_weight_updates(tiny):
    """
    The engine keeps its decode weights between calls (a server, RL sampling) and remakes them after any in-place
    change: after an update it generates what the updated model does, not what the old one did.
    """
    model, tokenizer, prompts = tiny
    model = copy.deepcopy(model)
    engine = Engine(model, tokenizer)
    prompt = prompts[1][:10]
    before, _ = engine_stream(engine, prompt, max_tokens=20, temperature=0)
    assert engine.weights() is engine.weights()  # unchanged weights: made once
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)  # an "optimizer step"
    after, _ = engine_stream(engine, prompt, max_tokens=20, temperature=0)
    assert after[0] == naive_until_end(model, engine, prompt, 20, temperature=0) and after != before


def test_greedy_with_several_samples_matches_naive(tiny):
    model, tokenizer, prompts = tiny
    engine = Engine(model, tokenizer)
    prompt = prompts[3][:12]
    expected = naive_until_end(model, engine, prompt, 40, temperature=0)
    streams, masks = engine_stream(engine, prompt, num_samples=4, max_tokens=40, temperature=0)
    assert streams == [expected] * 4
    results, result_masks = engine.generate_batch(prompt, num_samples=4, max_tokens=40, temperature=0)
    body = expected[:-1] if expected[-1] in engine.end_tokens else expected
    assert results == [prompt + body] * 4
    assert result_masks == [[0] * len(prompt) + [1] * len(body)] * 4


def test_the_compiled_step_decodes_what_naive_generation_does(tiny):
    """
    Engine(compile_decode=True) (engine.static_step under torch.compile, inductor's default mode on a CPU): greedy,
    the tokens of naive generation, for one prompt with two samples and for prompts of different lengths decoded
    together (padding masked out, each row at its own position); the step's logits: tests/test_compiled_decode.py.
    """
    model, tokenizer, prompts = tiny
    engine = Engine(model, tokenizer, compile_decode=True)
    prompt = prompts[3][:12]
    expected = naive_until_end(model, engine, prompt, 40, temperature=0)
    streams, _ = engine_stream(engine, prompt, num_samples=2, max_tokens=40, temperature=0)
    assert streams == [expected] * 2 and len(set(expected)) >= 3, expected
    kept = engine.static_caches[(2, 128, torch.float32)].k  # 12 + 40 - 1 positions, rounded up to 128
    chosen = [prompts[0][:7], prompts[1][:19]]
    columns = [column for column, _ in engine.generate_many(chosen, max_tokens=25, temperature=0)]
    for row, one in enumerate(chosen):
        wanted = naive_until_end(model, engine, one, 25, temperature=0)
        assert [column[row] for column in columns][:len(wanted)] == wanted, row
    again, _ = engine_stream(engine, prompt, num_samples=2, max_tokens=40, temperature=0)  # the kept cache, reused
    # 2 rows of 128 columns in all three calls: the same cache tensors (a CUDA graph's addresses) every time
    assert again == streams and list(engine.static_caches) == [(2, 128, torch.float32)]
    assert engine.static_caches[(2, 128, torch.float32)].k is kept
    # two generations of one shape at once (interleaved steps): each its own cache, each naive generation's tokens
    pairs = list(zip(engine.generate(prompt, 2, max_tokens=40, temperature=0),
                     engine.generate(prompt, 2, max_tokens=40, temperature=0)))
    assert [a[0][0] for a, _ in pairs] == [b[0][0] for _, b in pairs] == expected[:len(pairs)]
    with pytest.raises(UserError, match="compile_decode must be True or False"):
        Engine(model, tokenizer, compile_decode="yes")


def test_greedy_up_to_the_context_limit(tiny):
    model, tokenizer, prompts = tiny
    engine = Engine(model, tokenizer)
    full = 0
    for prompt in prompts[:6]:
        prompt = prompt[:40]
        expected = naive_until_end(model, engine, prompt, SEQ_LEN - 40, temperature=0)
        streams, _ = engine_stream(engine, prompt, num_samples=2, max_tokens=None, temperature=0)
        assert streams == [expected] * 2
        (tokens,), _ = engine_stream(engine, prompt, max_tokens=SEQ_LEN - 40, temperature=0)
        assert tokens == expected
        full += len(prompt) + len(tokens) == SEQ_LEN
    assert full >= 1  # at least one generation really ran into the context limit


def test_generation_past_the_training_length_when_asked(tiny):
    model, tokenizer, prompts = tiny
    engine = Engine(model, tokenizer, context_len=3 * SEQ_LEN)
    prompt = prompts[0][:SEQ_LEN]  # a prompt as long as the training length, then 100 more tokens
    expected = naive_until_end(model, engine, prompt, 100, temperature=0)
    (tokens,), _ = engine_stream(engine, prompt, max_tokens=100, temperature=0)
    assert tokens == expected
    with pytest.raises(UserError):
        Engine(model, tokenizer, context_len=model.rotary_len + 1)


def test_prompts_of_different_lengths_decode_together_as_each_alone(tiny):
    # generate_many puts the prompts right-aligned in one cache (padding masked out, each row at its own positions):
    # greedy, each prompt's samples are what it gets alone, and naive generation gets
    model, tokenizer, prompts = tiny
    engine = Engine(model, tokenizer)
    chosen = [prompts[0][:7], prompts[1][:19], prompts[2][:12]]
    columns = [column for column, _ in engine.generate_many(chosen, num_samples=2, max_tokens=25, temperature=0)]
    for p, prompt in enumerate(chosen):
        expected = naive_until_end(model, engine, prompt, 25, temperature=0)
        for row in (2 * p, 2 * p + 1):
            stream = [column[row] for column in columns][:len(expected)]
            assert stream == expected, (p, row)
    # sampled (temperature 1): as many samples as asked, each a proper stream; the seed decides
    sampled = lambda: [column for column, _ in engine.generate_many(chosen, num_samples=2, max_tokens=25,
                                                                   temperature=1.0, seed=3)]
    again = sampled()
    assert again == sampled()
    assert all(len(column) == 6 for column in again)
    with pytest.raises(UserError, match="exceeds the context"):
        engine.generate_many([prompts[0][:10], prompts[1][:SEQ_LEN - 5]], max_tokens=10)
    with pytest.raises(UserError, match="non-empty list of prompts"):
        engine.generate_many([])


def test_decode_step_at_each_rows_own_position_equals_full_forward(tiny):
    # two prompts of 9 and 14 tokens, right-aligned in one cache: the shorter's first 5 columns are padding
    model, _, prompts = tiny
    cfg = model.config
    short, long = prompts[0][:30], prompts[1][:35]
    with torch.no_grad():
        full = [model(torch.tensor([row]))[0] for row in (short, long)]
        cache = KVCache(2, cfg.n_kv_head, 40, cfg.n_embd // cfg.n_head, cfg.n_layer, "cpu", torch.float32)
        for row, (ids, length) in enumerate(((short, 9), (long, 14))):
            one = KVCache(1, cfg.n_kv_head, length, cfg.n_embd // cfg.n_head, cfg.n_layer, "cpu", torch.float32)
            model.prefill(torch.tensor([ids[:length]]), one)
            cache.place(one, slice(row, row + 1), 14)
        cache.k[:, 0, :, :5] = cache.v[:, 0, :, :5] = 0  # the padding, as the Engine leaves it: masked out, and zeros
        cache.advance(14)
        padding = torch.tensor([5, 0])
        key_mask = torch.arange(40)[None, None, None, :] >= padding[:, None, None, None]
        weights = decode_weights(model)
        for t in range(14, 35):
            step = torch.tensor([short[t - 5] if t - 5 < len(short) else 0, long[t]])
            logits = decode_step(model, step, cache, weights, cache.pos - padding, key_mask)
            if t - 5 < len(short):
                torch.testing.assert_close(logits[0], full[0][t - 5], rtol=0, atol=1e-5)
            torch.testing.assert_close(logits[1], full[1][t], rtol=0, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_step_equals_full_forward(tiny, batch):
    model, _, prompts = tiny
    cfg = model.config
    idx = torch.tensor([p[:40] for p in prompts[:batch]])
    with torch.no_grad():
        full = model(idx)  # (B, 40, vocab)
        # capacity 4: the cache has to grow (4 -> 8 -> 16 -> 32 -> 40) while decoding
        cache = KVCache(batch, cfg.n_kv_head, 40, cfg.n_embd // cfg.n_head, cfg.n_layer, "cpu", torch.float32,
                        capacity=4)
        last = model.prefill(idx[:, :3], cache)
        torch.testing.assert_close(last, full[:, 2], rtol=0, atol=1e-5)
        weights = decode_weights(model)
        for t in range(3, 40):
            logits = decode_step(model, idx[:, t], cache, weights)
            torch.testing.assert_close(logits, full[:, t], rtol=0, atol=1e-5)
    assert cache.pos == 40 and cache.capacity == 40
    with pytest.raises(ValueError, match="KV cache full"):
        decode_step(model, idx[:, 0], cache, weights)


def test_decoding_in_bf16_uses_bf16_weight_copies(tiny):
    """
    Under bf16 autocast (the compute dtype of a CPU with native bf16) the engine's decode weights are bf16 copies, made
    once, and made again in fp32 when it runs without autocast; the bf16 step's logits stay within bf16 rounding of the
    fp32 forward's, and greedy decoding still runs to the end.
    """
    model, tokenizer, prompts = tiny
    engine = Engine(model, tokenizer)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (tokens,), _ = engine_stream(engine, prompts[0][:10], max_tokens=20, temperature=0)
        weights = engine.weights()
        # the lookup tables stay as they are
        matrices = [w for layer in weights.layers for w in layer[:5] if w is not None]
        assert weights.lm_head.dtype == torch.bfloat16 and all(w.dtype == torch.bfloat16 for w in matrices)
        assert engine.weights().lm_head is weights.lm_head
    assert len(tokens) > 0 and engine.weights().lm_head.dtype == torch.float32
    bf16_steps_match_the_forward(model, prompts[1], decode_weights(model, torch.bfloat16))


def bf16_steps_match_the_forward(model, ids, weights):
    """
    decode_step in bf16 with `weights` over ids[10:20] after a prefill of ids[:10]: every step's logits within bf16
    rounding of the fp32 forward's.
    """
    cfg = model.config
    idx = torch.tensor([ids[:20]])
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(1, cfg.n_kv_head, 20, cfg.n_embd // cfg.n_head, cfg.n_layer, "cpu", torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.prefill(idx[:, :10], cache)
            for t in range(10, 20):
                logits = decode_step(model, idx[:, t], cache, weights)
                assert (logits - full[:, t]).abs().max() < 0.03 * full[:, t].abs().max()  # measured: < 0.005


@pytest.mark.parametrize("native", [False, True])
def test_one_sample_bf16_decoding_multiplies_with_the_kernels_the_probe_chose(tiny, monkeypatch, native):
    """
    One row in bf16 on a CPU: where probes.native_bf16_gemv says torch's own kernels are faster (both answers driven
    here), the engine's copies are row-major and every matrix of the step is multiplied with oneDNN off (seen from
    inside each product), then on again; otherwise column-major copies through oneDNN. Either way the logits stay within
    bf16 rounding of the fp32 forward's.
    """
    model, tokenizer, prompts = tiny
    monkeypatch.setattr(engine_module, "native_bf16_gemv", lambda rows: native and rows <= 2)
    engine = Engine(model, tokenizer)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (tokens,), _ = engine_stream(engine, prompts[0][:10], max_tokens=20, temperature=0)
        weights = engine.weights(1)
    assert len(tokens) > 0 and weights.lm_head.dtype == torch.bfloat16
    assert weights.lm_head.is_contiguous() == native and weights.layers[0].qkv.is_contiguous() == native
    assert engine.weights(3).lm_head.is_contiguous() is False  # more rows: oneDNN's layout, made again
    seen = []

    def spy(x, w):
        seen.append(torch.backends.mkldnn.enabled)
        return torch.nn.functional.linear(x, w)

    spied = weights._replace(layers=[layer._replace(linear=spy) for layer in weights.layers])
    bf16_steps_match_the_forward(model, prompts[1], spied)
    assert len(seen) == 10 * 4 * model.config.n_layer and set(seen) == {not native}
    assert torch.backends.mkldnn.enabled


def test_rows_that_join_and_leave_a_batch_decode_as_each_alone(tiny):
    """
    engine.Batch driven as the server's worker drives it: a row decodes; a second one joins it mid-way, its prompt
    prefilled 2 tokens a step, with more tokens to go than the cache has columns left; the first ends and leaves
    (the second stays in its columns), then the cache is full and made anew (the row right-aligned again). Greedy,
    each row gets naive generation's tokens.
    """
    model, tokenizer, prompts = tiny
    engine = Engine(model, tokenizer)
    first, second = prompts[2][:10], prompts[3][:5]
    expected = [naive_until_end(model, engine, first, 8, temperature=0),
                naive_until_end(model, engine, second, 20, temperature=0)]
    assert [len(tokens) for tokens in expected] == [8, 20]  # neither ends early: both run to max_tokens
    rng = torch.Generator()
    rows = [Row(0, None, 8, rng), Row(0, None, 20, rng)]
    got = {row: [] for row in rows}
    positions = []  # the cache's column after each step, and its rows
    with torch.inference_mode():
        batch = Batch(engine, max_len=24)  # the first row fills 17 columns, the second 24 from column 15 on
        batch.add(first, rows[:1])
        for step in range(40):
            if step == 4:
                batch.add(second, rows[1:])
            for row in batch.prefill(2):  # row.last: its newest token, read before the next call
                got[row].append(row.last)
            for row in batch.step():
                got[row].append(row.last)
            if batch.cache is not None:
                positions.append((batch.cache.pos, len(batch.rows)))
            if not (batch.running or batch.waiting):
                break
        batch.close()
    assert [got[row] for row in rows] == expected
    assert rows[0].ended and rows[1].ended and rows[0].end_token is None  # max_tokens ended them
    # the second row alone in a cache still as long as before (the first left it), then made anew: shorter
    shrunk = [i for i in range(1, len(positions)) if positions[i][0] < positions[i - 1][0]]
    assert len(shrunk) == 1 and positions[shrunk[0] - 1] == (24, 1), positions


def test_a_prefilled_prompt_is_placed_right_aligned_in_its_rows(tiny):
    model, _, prompts = tiny
    cfg = model.config
    head_dim = cfg.n_embd // cfg.n_head
    prompt = torch.tensor([prompts[0][:9]])
    one = KVCache(1, cfg.n_kv_head, 9, head_dim, cfg.n_layer, "cpu", torch.float32)
    with torch.no_grad():
        model.prefill(prompt, one)
    many = KVCache(4, cfg.n_kv_head, 20, head_dim, cfg.n_layer, "cpu", torch.float32, capacity=2)
    many.place(one, slice(1, 4), 12)  # rows 1-3, columns 3-11 (a longer prompt would fill 0-11)
    assert many.capacity >= 12
    for row in range(1, 4):
        assert torch.equal(many.k[:, row, :, 3:12], one.k[:, 0, :, :9])
        assert torch.equal(many.v[:, row, :, 3:12], one.v[:, 0, :, :9])


# -----------------------------------------------------------------------------
# sampling


def test_sampling_depends_only_on_the_seed(tiny):
    model, tokenizer, prompts = tiny
    engine = Engine(model, tokenizer)
    prompt = prompts[1][:8]
    rng_state = torch.get_rng_state()
    a = engine.generate_batch(prompt, num_samples=4, max_tokens=30, temperature=1.0, seed=1)
    torch.manual_seed(123)  # the global RNG must not matter
    b = engine.generate_batch(prompt, num_samples=4, max_tokens=30, temperature=1.0, seed=1)
    torch.set_rng_state(rng_state)
    c = engine.generate_batch(prompt, num_samples=4, max_tokens=30, temperature=1.0, seed=2)
    assert torch.equal(torch.get_rng_state(), rng_state)  # generation left the global RNG alone
    assert a == b
    assert a[0] != c[0]
    assert len({tuple(r) for r in a[0]}) > 1  # the samples of one call differ from each other


def test_sampling_matches_naive_sampling(tiny):
    # both pick tokens with the same function and the same seed: one sample follows generate_naive exactly
    model, tokenizer, prompts = tiny
    engine = Engine(model, tokenizer)
    prompt = prompts[2][:15]
    for kwargs in (dict(temperature=0.9, seed=5), dict(temperature=1.3, top_k=20, seed=6)):
        expected = naive_until_end(model, engine, prompt, 40, **kwargs)
        (tokens,), _ = engine_stream(engine, prompt, max_tokens=40, **kwargs)
        assert tokens == expected


def test_top_k(tiny):
    model, tokenizer, prompts = tiny
    engine = Engine(model, tokenizer)
    prompt = prompts[4][:10]
    greedy = engine.generate_batch(prompt, max_tokens=25, temperature=0)
    assert engine.generate_batch(prompt, num_samples=2, max_tokens=25, temperature=1.5, top_k=1)[0] == greedy[0] * 2
    everything = engine.generate_batch(prompt, max_tokens=25, top_k=None, seed=3)
    assert engine.generate_batch(prompt, max_tokens=25, top_k=0, seed=3) == everything
    (tokens,), _ = engine_stream(engine, prompt, max_tokens=25, temperature=2.0, top_k=3, seed=4)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1:-1]
    top3 = logits.topk(3, dim=-1).indices
    assert all(t in top3[i].tolist() for i, t in enumerate(tokens))


def test_sampler_draws_from_the_softmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.0, 1.0, 2.0, -1e4, 3.0, 2.0]])  # token 3's probability underflows to exactly 0
    n = 100_000
    for temperature, top_k in ((1.0, None), (0.5, None), (2.0, 3)):
        draws = sample_next_token(logits.expand(n, -1), gen, temperature, top_k)
        freq = torch.bincount(draws, minlength=6).double() / n
        expected = torch.softmax(logits[0].double() / temperature, dim=-1)
        if top_k:
            expected[expected < expected.topk(top_k).values[-1]] = 0
            expected /= expected.sum()
        assert freq[3] == 0
        assert (freq - expected).abs().max() < 0.01, (freq, expected)  # 6 standard deviations


@pytest.mark.parametrize("kwargs, message", [
    (dict(tokens=[]), "empty"),
    (dict(tokens=[1, 2, 10**6]), "vocabulary"),
    (dict(tokens=[1, -1]), "vocabulary"),
    (dict(tokens=["a"]), "integer token ids"),
    (dict(num_samples=0), "num_samples"),
    (dict(num_samples=2.0), "num_samples"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(seed=None), "seed"),
    (dict(max_tokens=SEQ_LEN), "exceeds the context"),
    (dict(tokens=[1] * SEQ_LEN, max_tokens=None), "no room"),
])
def test_bad_arguments_raise_user_error(tiny, kwargs, message):
    model, tokenizer, _ = tiny
    engine = Engine(model, tokenizer)
    args = dict(tokens=[tokenizer.get_bos_token_id(), 5], num_samples=1, max_tokens=4, temperature=1.0)
    args.update(kwargs)
    with pytest.raises(UserError, match=message):
        engine.generate(**args)  # raised at the call, before the first step
    with pytest.raises(UserError, match=message):
        engine.generate_batch(**args)


def test_context_edges_and_early_stop(tiny):
    model, tokenizer, prompts = tiny
    engine = Engine(model, tokenizer)
    assert engine.context_len == SEQ_LEN
    prompt = prompts[0][:SEQ_LEN - 1]
    assert len(list(engine.generate(prompt, max_tokens=None, temperature=0))) == 1  # exactly one fits
    assert list(engine.generate(prompt, max_tokens=0)) == []
    gen = engine.generate(prompts[0][:5], num_samples=2, max_tokens=50, temperature=0)
    first = [next(gen) for _ in range(3)]
    gen.close()  # a caller stops whenever it likes
    again = engine.generate(prompts[0][:5], num_samples=2, max_tokens=3, temperature=0)
    assert [c for c, _ in first] == [c for c, _ in again]


# -----------------------------------------------------------------------------
# end tokens, on a model whose next token depends only on the current one (helpers.bigram_model)


def test_stops_at_assistant_end_and_bos(small_tokenizer_dir):
    tokenizer = Tokenizer.from_directory(str(small_tokenizer_dir))
    sp = tokenizer.encode_special
    a, b = tokenizer.encode("ab")[:1] + tokenizer.encode("cd")[:1]
    for end in ("<|assistant_end|>", "<|bos|>"):
        model = bigram_model(tokenizer, {sp("<|assistant_start|>"): [a], a: [b], b: [sp(end)], sp(end): [a]})
        engine = Engine(model, tokenizer)
        prompt = [sp("<|bos|>"), sp("<|assistant_start|>")]
        for temperature in (0, 1.0):
            (tokens,), (masks,) = engine_stream(engine, prompt, max_tokens=20, temperature=temperature)
            assert tokens == [a, b, sp(end)] and masks == [1, 1, 1]
            expected = ([prompt + [a, b]], [[0, 0, 1, 1]])
            assert engine.generate_batch(prompt, max_tokens=20, temperature=temperature) == expected


# -----------------------------------------------------------------------------
# streaming text


def test_text_streamer_never_splits_a_character(small_tokenizer_dir):
    tokenizer = Tokenizer.from_directory(str(small_tokenizer_dir))
    text = "naïve café — 中文 and 🙂 emoji, ok"
    ids = tokenizer.encode(text, prepend="<|bos|>")
    streamer = TextStreamer(tokenizer)
    pieces = [streamer.put(t) for t in ids]
    assert streamer.end() == ""
    assert "".join(pieces) == "<|bos|>" + text
    assert all("\ufffd" not in p for p in pieces)
    # the small tokenizer splits multi-byte characters across tokens, so some tokens completed nothing yet
    assert "" in pieces and any(ord(ch) > 0xFFFF for p in pieces for ch in p)
    # decoding token by token, the naive way, would have shown replacement characters
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


def test_text_streamer_matches_decode_on_invalid_bytes(small_tokenizer_dir):
    tokenizer = Tokenizer.from_directory(str(small_tokenizer_dir))
    lead, cont = 0xE4, 0xB8  # token ids 0..255 are the single bytes: two bytes of a 3-byte character
    for ids in ([lead, cont, ord("a")], [ord("a"), lead], [cont, cont, ord("b")], [lead, tokenizer.get_bos_token_id()]):
        streamer = TextStreamer(tokenizer)
        assert "".join(streamer.put(t) for t in ids) + streamer.end() == tokenizer.decode(ids)
