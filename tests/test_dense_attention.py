"""
Dense attention in training steps on a CPU (issue 36): attention_kernels.dense_attention computes the scores in
batched matmuls, in blocks of queries, each against only the keys they see. In float64 it is the attention written
out, forward and backward; in bf16 its error, forward and backward, is SDPA's own size; a model given the "dense" kernel
takes it only in training steps computing in bf16 (never in fp32, never in evaluation); and "auto", at the start of a
stage, decides it by a probe kept per machine (attention_kernels.choose_kernel, probes.dense_attention_pays).
"""

import json

import pytest
import torch
import torch.nn.functional as F

import nanochat.attention_kernels as attention_kernels
import nanochat.probes as probes
from nanochat.attention_kernels import KERNELS, choose_kernel, dense_attention
from nanochat.gpt import GPT, GPTConfig, attention

from helpers import written_out


@pytest.mark.parametrize("T, window", [(12, None), (12, 3), (12, 0), (13, 5)],
                         ids=["causal", "window 3", "window 0", "window 5"])
@pytest.mark.parametrize("rows", [128, 2, 1], ids=["one block", "blocks of 2 rows", "blocks of 1 row"])
@pytest.mark.parametrize("B, H", [(2, 4), (1, 3)], ids=["8 heads in all", "3 heads: blocks twice as tall"])
def test_dense_attention_equals_attention_written_out(T, window, rows, B, H, monkeypatch):
    """Forward and backward: by blocks of queries, each against the key pieces it sees, the written-out attention."""
    torch.manual_seed(0)
    q, k, v, dy = (torch.randn(B, H, T, 8, dtype=torch.float64) for _ in range(4))
    monkeypatch.setattr(F, "scaled_dot_product_attention", None)  # the dense path calls no SDPA: it would fail here
    monkeypatch.setattr(attention_kernels, "DENSE_ROWS", rows)
    results = []
    for fn in (lambda *t: dense_attention(*t, window), lambda *t: written_out(*t, window)):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        y = fn(*inputs)
        results.append((y, *torch.autograd.grad(y, inputs, dy)))
    for name, a, b in zip(("output", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)


# Measured (5 seeds; 2 x 4 heads; T x D 128 x 64, 512 x 128, 256 x 64 with a window of 64): the relative error
# against float64 of the output, dq, dk, dv, at worst 0.59% dense and 0.59% for SDPA's flash kernel. Dense by blocks
# (3 seeds, 2-32 heads of 512 x 128): at worst 0.62% (dk: the blocks' gradients added in bf16), SDPA's 0.59%.
BF16_REL_ERROR = 0.008


@pytest.mark.parametrize("T, window", [(128, None), (160, 32), (512, None)])
def test_dense_attention_in_bf16_is_as_accurate_as_sdpa_forward_and_backward(T, window):
    g = torch.Generator().manual_seed(0)
    q, k, v, dy = (torch.randn(2, 4, T, 64, generator=g, dtype=torch.float64) for _ in range(4))
    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    y = attention(*ref_inputs, window=window)
    reference = (y, *torch.autograd.grad(y, ref_inputs, dy))
    inputs = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    y = dense_attention(*inputs, window)
    got = (y, *torch.autograd.grad(y, inputs, dy.to(torch.bfloat16)))
    for name, a, b in zip(("output", "dq", "dk", "dv"), got, reference):
        assert a.dtype == torch.bfloat16
        assert ((a.double() - b).norm() / b.norm()).item() < BF16_REL_ERROR, name


def tiny_model(dense, **config):
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=64, vocab_size=128, n_layer=2, n_head=2, n_kv_head=2, n_embd=64, **config))
    model.init_weights()
    for name, p in model.named_parameters():  # the zero-initialised projections and head get weight
        if name.endswith("c_proj.weight") or name == "lm_head.weight":
            torch.nn.init.normal_(p, std=0.1)
    model.attention_kernel = KERNELS["dense" if dense else "sdpa"]
    return model


def loss_and_grads(model, x, y, autocast):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x, y)
    return loss.item(), torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("window_pattern", ["L", "SL"])
def test_a_model_takes_the_dense_path_in_bf16_training_steps_only(window_pattern, monkeypatch):
    x = torch.randint(0, 128, (2, 64))
    y = torch.randint(0, 128, (2, 64))
    plain = tiny_model(False, window_pattern=window_pattern)
    dense = tiny_model(True, window_pattern=window_pattern)
    # fp32: the same operations, bit for bit, whichever of the two kernels
    plain_loss, plain_grads = loss_and_grads(plain, x, y, autocast=False)
    dense_loss, dense_grads = loss_and_grads(dense, x, y, autocast=False)
    assert dense_loss == plain_loss and all(torch.equal(a, b) for a, b in zip(dense_grads, plain_grads))
    # bf16 training: equal within bf16's rounding, and computed without SDPA
    plain_loss, plain_grads = loss_and_grads(plain, x, y, autocast=True)
    sdpa = F.scaled_dot_product_attention
    calls = []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    dense_loss, dense_grads = loss_and_grads(dense, x, y, autocast=True)
    assert calls == []
    assert dense_loss == pytest.approx(plain_loss, rel=2e-3)
    for a, b in zip(dense_grads, plain_grads):
        assert (a - b).norm() <= 0.03 * b.norm() + 1e-6
    # evaluation (no gradient) goes through SDPA as before
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        dense(x)
    assert len(calls) == 2


def pays(config, device_type="cpu", compute_dtype=torch.bfloat16):
    """probes.dense_attention_pays with the kernels choose_kernel gives it."""
    return probes.dense_attention_pays(config, device_type, compute_dtype, attention, dense_attention)


def test_the_probe_decides_once_per_machine_and_shape(isolated_env, monkeypatch):
    config = GPTConfig(sequence_len=64, n_layer=1, n_head=2, n_kv_head=2, n_embd=64)
    dense, why = pays(config, compute_dtype=torch.float32)
    assert not dense and "SDPA" in why and not (isolated_env / "attention_kernels.json").exists()  # fp32: no probe
    assert pays(config, "cuda")[0] is False  # a GPU: SDPA
    assert pays(GPTConfig(sequence_len=64, n_layer=1, n_head=2, n_kv_head=1, n_embd=64))[0] is False  # GQA
    too_long = GPTConfig(sequence_len=probes.DENSE_ATTENTION_MAX_LEN + 1, n_layer=1, n_head=2, n_kv_head=2, n_embd=64)
    assert pays(too_long) == (False, "Attention in training steps: SDPA (dense is not measured above 2048 positions)")
    assert not (isolated_env / "attention_kernels.json").exists()
    dense, why = pays(config)  # measured here, the answer kept
    kept = json.loads((isolated_env / "attention_kernels.json").read_text())
    (key, speedup), = kept.items()
    assert "64 positions x 32 channels" in key and dense == (speedup >= probes.DENSE_ATTENTION_MIN_SPEEDUP)
    assert f"{speedup:.2f}x" in why
    monkeypatch.setattr(probes, "_attention_probe", lambda *args: pytest.fail("measured again"))
    for kept_speedup, expected in ((1.1, False), (1.6, True)):  # read back, and the threshold applied to it
        (isolated_env / "attention_kernels.json").write_text(json.dumps({key: kept_speedup}))
        dense, why = pays(config)
        label = "dense bf16 matmuls" if expected else "SDPA"
        assert dense is expected and why.startswith(f"Attention in training steps: {label}")
        # "auto" takes the kernel the kept answer names, with its line
        assert choose_kernel("auto", config, "cpu", torch.bfloat16) == (KERNELS["dense" if dense else "sdpa"], why)


def test_a_named_kernel_is_taken_without_a_probe(isolated_env):
    config = GPTConfig(sequence_len=64, n_layer=1, n_head=2, n_kv_head=2, n_embd=64)
    for name in KERNELS:
        kernel, why = choose_kernel(name, config, "cpu", torch.bfloat16)
        assert kernel is KERNELS[name] and why == f"Attention in training steps: {name} (base_train --attention)"
    assert not (isolated_env / "attention_kernels.json").exists()


def test_the_probe_times_the_kernels_it_is_given():
    """The probe imports no model code: it times the two callables its caller gives it, SDPA's side first."""
    seen = []

    def counted(name, kernel):
        return lambda *inputs: seen.append(name) or kernel(*inputs)
    speedup = probes._attention_probe(16, 8, counted("SDPA", attention), counted("dense", dense_attention), rounds=2,
                                      calls=1)
    assert seen == ["SDPA", "dense"] * 2 and speedup > 0
