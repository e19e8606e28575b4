import math

import pytest
import torch
import torch.nn.functional as F

from nanochat import cpu_kernels, losses
from nanochat.cpu_kernels import RMSNorm
from nanochat.engine import KVCache, decode_step, decode_weights, generate_naive
from nanochat.gpt import GPT, SOFTCAP, GPTConfig, apply_rotary_emb, config_from_depth, rotary


def make_model(**overrides):
    cfg = dict(sequence_len=32, vocab_size=256, n_layer=2, n_head=4, n_kv_head=4, n_embd=64)
    cfg.update(overrides)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    model.init_weights()
    return model


def test_config_from_depth():
    cfg = config_from_depth(20)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_kv_head) == (20, 1280, 10, 10)
    cfg = config_from_depth(4, vocab_size=8192, sequence_len=512)
    assert (cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.sequence_len) == (256, 2, 8192, 512)
    cfg = config_from_depth(5)  # 320 wide: 320/128 is fractional -> 5 heads of 64
    assert cfg.n_embd % cfg.n_head == 0 and cfg.n_embd // cfg.n_head == 64


def test_initial_loss_is_ln_vocab():
    model = make_model(vocab_size=512)
    idx = torch.randint(0, 512, (4, 32))
    loss = model(idx, idx)
    assert abs(loss.item() - math.log(512)) / math.log(512) < 0.05


def test_loss_reductions_and_all_masked_targets():
    model = make_model()
    # make the head non-zero so per-token losses differ
    torch.nn.init.normal_(model.lm_head.weight, std=0.5)
    idx = torch.randint(0, 256, (2, 16))
    targets = idx.clone()
    targets[0, :5] = -1
    per_token = model(idx, targets, loss_reduction="none")
    assert per_token.shape == (32,)
    assert torch.all(per_token.view(2, 16)[0, :5] == 0)
    valid = targets.view(-1) != -1
    assert torch.allclose(model(idx, targets), per_token[valid].mean(), rtol=1e-5)
    assert torch.allclose(model(idx, targets, loss_reduction="sum"), per_token.sum(), rtol=1e-5)
    all_masked = torch.full_like(idx, -1)
    loss = model(idx, all_masked)
    assert torch.isfinite(loss) and loss.item() == 0.0


def test_logits_softcapped():
    model = make_model()
    torch.nn.init.normal_(model.lm_head.weight, std=100.0)
    logits = model(torch.randint(0, 256, (1, 8)))
    assert logits.dtype == torch.float32
    assert logits.abs().max() <= SOFTCAP


def randomize_zero_init(model):
    """The output projections and head start at zero; give them weight so comparisons are not trivial."""
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight") or name == "lm_head.weight":
            torch.nn.init.normal_(p, std=0.1)


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = make_model(n_head=4, n_kv_head=2)
    randomize_zero_init(gqa)
    mha = make_model(n_head=4, n_kv_head=4)
    head_dim = 64 // 4
    sd = {}
    for name, tensor in gqa.state_dict().items():
        if name.endswith("attn.c_k.weight") or name.endswith("attn.c_v.weight"):
            # kv head j serves query heads 2j and 2j+1: duplicate each kv head's rows
            tensor = tensor.view(2, head_dim, 64).repeat_interleave(2, dim=0).reshape(4 * head_dim, 64)
        sd[name] = tensor
    mha.load_state_dict(sd)
    idx = torch.randint(0, 256, (2, 16))
    assert gqa.transformer.h[0].attn.c_k.weight.shape == (2 * head_dim, 64)
    assert torch.allclose(gqa(idx), mha(idx), atol=1e-5)


def test_kv_cache_matches_full_forward():
    model = make_model(n_head=4, n_kv_head=2)
    randomize_zero_init(model)
    model.eval()
    idx = torch.randint(0, 256, (2, 20))
    full = model(idx)
    cache = KVCache(batch_size=2, n_kv_head=2, max_len=32, head_dim=16, n_layer=2, device="cpu", dtype=torch.float32)
    pieces = [model(idx[:, :8], kv_cache=cache)]  # prefill
    pieces += [model(idx[:, t:t + 1], kv_cache=cache) for t in range(8, 12)]  # one token at a time
    pieces.append(model(idx[:, 12:20], kv_cache=cache))  # a chunk after a cached prefix
    assert cache.pos == 20
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-5)


def test_last_logits_are_the_forwards_at_those_positions():
    model = make_model()
    randomize_zero_init(model)
    model.eval()
    idx = torch.randint(0, 256, (3, 20))
    last = torch.tensor([19, 0, 7])
    with torch.no_grad():
        assert torch.allclose(model.last_logits(idx, last), model(idx)[torch.arange(3), last], atol=1e-5)


def test_generate_greedy_matches_argmax():
    model = make_model()
    torch.nn.init.normal_(model.lm_head.weight, std=0.5)
    prompt = [1, 2, 3]
    out = list(generate_naive(model, prompt, max_tokens=5, temperature=0.0))
    ids = list(prompt)
    for _ in range(5):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert out == ids[3:]


def test_estimate_flops_hand_count():
    model = make_model(sequence_len=32, vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    d, kv, L, V, T = 64, 2 * 16, 2, 256, 32
    per_layer = d * d + 2 * kv * d + d * d + 4 * d * d + 4 * d * d  # q, k+v, proj, fc, mlp proj
    n_matmul = L * per_layer + V * d  # blocks + lm_head (the embedding is a lookup)
    assert model.num_params() == n_matmul + V * d
    attention = 12 * L * 4 * 16 * T
    assert model.estimate_flops() == 6 * n_matmul + attention


def test_parameter_groups_partition_the_parameters():
    model = make_model()
    adamw, muon = model.setup_optimizers()
    seen = [id(p) for opt in (adamw, muon) for g in opt.param_groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())
    assert len(seen) == len(set(seen))
    adam_ids = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert adam_ids == {id(model.lm_head.weight), id(model.transformer.wte.weight)}
    for opt in (adamw, muon):
        for g in opt.param_groups:
            assert g["initial_lr"] == g["lr"]


def test_small_model_overfits_one_batch():
    model = make_model(vocab_size=64, n_embd=64, n_layer=2)
    idx = torch.randint(0, 64, (4, 32))
    x, y = idx[:, :-1], idx[:, 1:]
    optimizers = model.setup_optimizers(unembedding_lr=0.02, embedding_lr=0.2, matrix_lr=0.05)
    first = None
    for _ in range(60):
        loss = model(x, y)
        first = first if first is not None else loss.item()
        loss.backward()
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
    assert first == pytest.approx(math.log(64), rel=0.05)
    assert loss.item() < 0.5, loss.item()


def test_chunked_loss_equals_whole_batch_loss(monkeypatch):
    model = make_model()
    randomize_zero_init(model)
    idx = torch.randint(0, 256, (4, 32))
    targets = idx.clone()
    targets[1, 3:9] = -1
    whole = model(idx, targets)
    whole.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    monkeypatch.setattr(losses, "LOGITS_CHUNK_ELEMENTS", 256 * 40)  # 40 rows per chunk: uneven split of 128 rows
    chunked = model(idx, targets)
    chunked.backward()
    assert torch.allclose(whole, chunked, rtol=1e-6)
    for n, p in model.named_parameters():
        assert torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-7), n
    with torch.no_grad():
        assert torch.allclose(model(idx, targets, loss_reduction="none"), torch.cat([
            model(idx[i:i + 1], targets[i:i + 1], loss_reduction="none") for i in range(4)]), atol=1e-6)


CPU_FUNCTIONS = {  # name: (cpu_kernels' Function for training on a CPU, the separate ops it stands for)
    "norm": (lambda x, c, s: RMSNorm.apply(x, 1.0),
             lambda x, c, s: F.rms_norm(x, (x.size(-1),))),
    "qk norm, scale 1.2": (lambda x, c, s: RMSNorm.apply(x, 1.2, c, s),
                           lambda x, c, s: 1.2 * F.rms_norm(apply_rotary_emb(x, c, s), (8,))),
    "qk norm, scale 1": (lambda x, c, s: RMSNorm.apply(x, 1.0, c, s),
                         lambda x, c, s: F.rms_norm(apply_rotary_emb(x, c, s), (8,))),
}


@pytest.mark.parametrize("name", CPU_FUNCTIONS)
def test_cpu_training_functions_equal_the_separate_ops(name):
    """
    cpu_kernels' autograd Function for training on a CPU (fewer passes over memory) against the expressions it stands
    for: torch's gradcheck in float64; in fp32 output and gradient equal to float64's within fp32 rounding, in bf16
    within the separate ops' own bf16 error; on a strided slice, as block() gives them q and k.
    """
    fused, separate = CPU_FUNCTIONS[name]
    torch.manual_seed(0)
    B, T, H, D = 2, 16, 3, 8
    cos, sin = rotary(torch.arange(T)[None], D, 10000.0)
    x64 = torch.randn(B, T, H, D, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: fused(x, cos.double(), sin.double()), (x64,))
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 0.05)):
        qkv = torch.randn(B, T, H + 2, D, dtype=dtype) * 3
        grad = torch.randn(B, T, H, D, dtype=dtype)
        results = []
        for fn, dt in ((separate, torch.float64), (separate, dtype), (fused, dtype)):
            x = qkv.detach().to(dt).requires_grad_()
            y = fn(x[:, :, :H], cos.to(dt), sin.to(dt))
            y.backward(grad.to(dt))
            results.append((y.double(), x.grad.double()))
        (want_y, want_g), (sep_y, sep_g), (got_y, got_g) = results
        scale = want_y.abs().max() + want_g.abs().max()
        assert (got_y - want_y).abs().max() < tol * scale and (got_g - want_g).abs().max() < tol * scale
        assert (got_y - want_y).abs().max() <= 2 * (sep_y - want_y).abs().max() + tol * scale / 10
        assert (got_g - want_g).abs().max() <= 2 * (sep_g - want_g).abs().max() + tol * scale / 10


def test_training_on_a_cpu_through_the_functions_equals_the_separate_ops(monkeypatch):
    """
    A model of the 2026 parts (qk_scale 1.2) trained on a CPU in fp32 goes through cpu_kernels' Function; with the
    separate ops put back in its place, the loss equals it within 1e-6 and every gradient within fp32 rounding.
    Evaluation (no gradient) runs the separate ops themselves: the same logits exactly.
    """
    import nanochat.gpt as gpt
    model = make_model(**PARTS_2026)
    with torch.no_grad():  # not the initialisation's zero projections: every path carries a gradient
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    idx = torch.randint(0, 256, (2, 32))
    targets = torch.randint(0, 256, (2, 32))
    calls = []
    monkeypatch.setattr(RMSNorm, "apply", lambda *a, f=RMSNorm.apply: calls.append("norm") or f(*a))
    fused = model(idx, targets)
    fused.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert len(calls) == 2 * 3 + 2  # per layer the block's two norms and its qk norm; x0 and the final norm
    with torch.no_grad():
        logits = model(idx)
    model.zero_grad()
    monkeypatch.setattr(cpu_kernels, "norm", gpt.norm)  # the architecture's own ops in the Function's place
    separate = model(idx, targets)
    separate.backward()
    assert abs(fused.item() - separate.item()) < 1e-6
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    with torch.no_grad():
        assert torch.equal(model(idx), logits)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own import
def test_torch_compile_on_a_cpu_trains_as_eager():
    """
    --compile=true on a CPU: torch.compile runs the separate ops (it fuses them itself; the Function's writes into
    slices broke its tracing), and one training step gives eager's loss and gradients within fp32 rounding. The
    model and its sizes are base_train's defaults at tests/test_profile_step.py's compiled step (depth 2, context 64,
    vocabulary 512, windows SSSL): a kernel is kept by its source, sizes included, so the kernels the two share are
    compiled once in a test session (bench/RESULTS.md, "The same compile paid again").
    """
    torch.manual_seed(0)
    model = GPT(config_from_depth(2, vocab_size=512, sequence_len=64, qk_scale=1.2, value_embeds=True,
                                  window_pattern="SSSL"))
    model.init_weights(recipe="2026")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    idx = torch.randint(0, 512, (2, 64))
    targets = torch.randint(0, 512, (2, 64))
    eager = model(idx, targets)
    eager.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, dynamic=False)(idx, targets)
    compiled.backward()
    assert abs(eager.item() - compiled.item()) < 1e-5
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)


# ------------------------------------------------------------------------------------------
# the 2026 recipe's model parts (GPTConfig rope_base, qk_scale, layer_scalars, value_embeds; init_weights recipe)

PARTS_2026 = dict(rope_base=100000.0, qk_scale=1.2, layer_scalars=True, value_embeds=True)


def make_2026_model(n_layer=3):
    model = make_model(n_layer=n_layer, n_head=4, n_kv_head=2, **PARTS_2026)
    model.init_weights(recipe="2026")
    randomize_zero_init(model)
    return model


def test_value_embeddings_on_alternating_layers_ending_with_the_last():
    for n_layer, layers in [(6, {"1", "3", "5"}), (5, {"0", "2", "4"}), (1, {"0"})]:
        model = make_model(n_layer=n_layer, value_embeds=True)
        assert set(model.value_embeds) == layers
        assert {str(i) for i, b in enumerate(model.transformer.h) if b.attn.ve_gate is not None} == layers
        assert model.value_embeds[min(layers)].weight.shape == (256, 64)  # vocab x (kv heads x head dim)


def test_2026_model_kv_cache_and_decode_step_match_the_full_forward():
    model = make_2026_model()
    model.eval()
    idx = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(batch_size=2, n_kv_head=2, max_len=32, head_dim=16, n_layer=3, device="cpu",
                        dtype=torch.float32)
        pieces = [model(idx[:, :8], kv_cache=cache), model(idx[:, 8:12], kv_cache=cache)]  # prefill, a chunk
        torch.testing.assert_close(torch.cat(pieces, dim=1), full[:, :12], rtol=0, atol=1e-5)
        weights = decode_weights(model)
        for t in range(12, 20):
            torch.testing.assert_close(decode_step(model, idx[:, t], cache, weights), full[:, t], rtol=0, atol=1e-5)


def test_2026_parts_change_the_function_and_reach_every_parameter():
    model = make_2026_model()
    idx = torch.randint(0, 256, (2, 16))
    loss = model(idx, idx)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    # each part alone changes the logits of the same weights (so none of them is silently ignored)
    sd = model.state_dict()
    reference = model(idx)
    for part, off in [("rope_base", 10000.0), ("qk_scale", 1.0)]:
        other = make_model(n_layer=3, n_head=4, n_kv_head=2, **{**PARTS_2026, part: off})
        other.load_state_dict(sd)
        assert (other(idx) - reference).abs().max() > 1e-3, part
    with torch.no_grad():
        model.resid_lambdas.fill_(1.0)
        model.x0_lambdas.zero_()
        for table in model.value_embeds.values():
            table.weight.zero_()
    # scalars 1 and 0, value embeddings zero: the model without those parts, to rounding
    plain = make_model(n_layer=3, n_head=4, n_kv_head=2, rope_base=100000.0, qk_scale=1.2)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if k in plain.state_dict()})
    torch.testing.assert_close(model(idx), plain(idx), rtol=0, atol=1e-5)


def test_2026_init_and_parameter_groups():
    model = make_2026_model(n_layer=4)
    model.init_weights(recipe="2026")
    assert model.transformer.wte.weight.std().item() == pytest.approx(0.8, rel=0.05)
    assert model.lm_head.weight.std().item() == pytest.approx(0.001, rel=0.05)
    fc_bound = 0.4 * math.sqrt(3) / math.sqrt(64)
    assert model.transformer.h[0].mlp.c_fc.weight.abs().max() <= fc_bound
    assert model.transformer.h[0].mlp.c_fc.weight.abs().max() > 0.95 * fc_bound
    torch.testing.assert_close(model.resid_lambdas, torch.tensor([1.15, 1.15 - 0.1 / 3, 1.15 - 0.2 / 3, 1.05]))
    torch.testing.assert_close(model.x0_lambdas, torch.tensor([0.20, 0.15, 0.10, 0.05]))
    adamw, muon = model.setup_optimizers(embedding_lr=0.2, scalar_lr=0.5)
    seen = [id(p) for opt in (adamw, muon) for g in opt.param_groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())
    lr_of = {id(p): g for g in adamw.param_groups for p in g["params"]}
    scale = (64 / 768) ** -0.5
    assert lr_of[id(model.value_embeds["1"].weight)]["lr"] == pytest.approx(0.2 * scale / 2)
    assert lr_of[id(model.resid_lambdas)]["lr"] == pytest.approx(0.005)
    assert lr_of[id(model.x0_lambdas)]["lr"] == 0.5 and lr_of[id(model.x0_lambdas)]["betas"] == (0.96, 0.95)
    assert {id(p) for g in muon.param_groups for p in g["params"]} >= {id(model.transformer.h[1].attn.ve_gate.weight)}
    # FLOPs and the Chinchilla count leave the lookup tables out: the plain model's plus the gates and scalars
    plain = make_model(n_layer=4, n_head=4, n_kv_head=2)
    extra = sum(b.attn.ve_gate.weight.numel() for b in model.transformer.h if b.attn.ve_gate is not None) + 2 * 4
    assert model.estimate_flops() == plain.estimate_flops() + 6 * extra
    assert model.num_params(value_embeds=False) == plain.num_params() + extra


def test_rotary_tables_follow_the_configured_base():
    for base in (10000.0, 100000.0):
        model = make_model(rope_base=base)
        head_dim = 16
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        torch.testing.assert_close(model.cos[0, 7, 0], torch.cos(7 * inv_freq))


# -----------------------------------------------------------------------------
# The architecture written once: what the export carries is gpt.py's own code


def off_its_default(field):
    """A value of a GPTConfig field other than its default (a field of a new kind: teach this test a value for it)."""
    if field.type is bool:
        return not field.default
    if field.type is float:
        return field.default * 1.2
    if field.name == "window_pattern":
        return "S"  # every layer but the last with a short window (128 tokens at the test's context of 160)
    raise AssertionError(f"GPTConfig.{field.name} ({field.type}): add a value other than its default here")


def test_the_architecture_part_alone_computes_gpts_logits_with_every_field_off_its_default():
    # gpt.py's architecture part, run on its own with only the imports the exported modeling file has, on the weights
    # of a GPT whose every non-size field is off its default: exactly GPT's logits. So the export (which carries this
    # text, not a copy written by hand) computes what training computes, for every field GPTConfig has.
    from dataclasses import fields

    from nanochat.hf_format import MODEL_CONFIG_KEYS, architecture_source, modeling_source
    parts = {f.name: off_its_default(f) for f in fields(GPTConfig) if f.name not in MODEL_CONFIG_KEYS}
    # long enough for the window to bind
    model = make_model(n_layer=3, n_head=4, n_kv_head=2, sequence_len=160, **parts)
    model.init_weights(recipe="2026")
    randomize_zero_init(model)
    architecture = {}
    imports = ("import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
               "from collections import namedtuple\nfrom dataclasses import asdict, dataclass, fields\n"
               "from functools import partial\n")
    exec(compile(imports + architecture_source(), "the architecture part", "exec"), architecture)
    config = architecture["GPTConfig"](**model.config.to_dict())
    alone = torch.nn.Module()
    architecture["build_parameters"](alone, config)
    alone.load_state_dict(model.state_dict())  # the same names, every one of them
    idx = torch.randint(0, 256, (2, 160))
    with torch.no_grad():
        cos_sin = architecture["rotary"](torch.arange(160)[None], 16, config.rope_base)
        attend = lambda i, q, k, v, window: architecture["attention"](q, k, v, window=window)
        x = architecture["hidden_states"](architecture["weights_of"](alone), idx, cos_sin, attend, config)
        torch.testing.assert_close(architecture["softcapped"](alone.lm_head(x)), model(idx), rtol=0, atol=0)
    exported = modeling_source()  # the modeling file as exported: that text in place of its import, nothing of nanochat
    assert architecture_source() in exported
    assert not [line for line in exported.splitlines() if line.startswith(("from nanochat", "import nanochat"))]
