"""
Tests of the optimizers: Newton-Schulz, Muon, and DistMuon / DistAdamW against one process.

Newton-Schulz orthogonalisation, Muon against a hand-written step, and DistMuon / DistAdamW on 2 and 3 gloo
processes against Muon / AdamW (nanochat.adamw) in one process (the worker script tests/dist_optim_worker.py does the
distributed part; these tests assert on what it saved). Newton-Schulz runs in the dtype its caller gives
(GPT.setup_optimizers: the compute dtype); the tests that hold in fp32 and bf16 run in both, with the tolerance each
allows (bf16 keeps 8 bits of mantissa: ~3 significant digits).
"""

import math

import numpy as np
import pytest
import torch

from helpers import build_once, run_script
from nanochat.muon import DistMuon, Muon, _batches, zeropower_via_newtonschulz5
from nanochat.optim import clip_grad_norm_, lr_multiplier, scale_initial_lrs, set_learning_rates

# The band stated in zeropower_via_newtonschulz5's docstring: singular values s >= 0.0016 * ||G||_F
# come out in [0.68, 1.21] (bf16: [0.67, 1.21]); none comes out above 1.21.
BAND_LO = {"float32": 0.68, "bfloat16": 0.67}
BAND_HI = 1.21
BAND_THRESHOLD = 0.0016
# U^T X V off its diagonal, relative (X = U S' V^T up to rounding): fp32 ~1e-6, bf16 ~1e-2
OFF_DIAGONAL = {"float32": 1e-4, "bfloat16": 3e-2}
DTYPES = ["float32", "bfloat16"]


@pytest.fixture(params=DTYPES)
def dtype(request):
    """Each test using it runs once per dtype of Newton-Schulz."""
    return request.param


def exact_polar(G):
    U, S, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U, S, Vh


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (96, 200), (300, 40), (128, 128)])
def test_newton_schulz_band_and_direction(shape, dtype):
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    G = torch.randn(shape, generator=gen) * 3.0
    X = zeropower_via_newtonschulz5(G, dtype=getattr(torch, dtype))
    assert X.shape == G.shape and X.dtype == torch.float32
    U, S, Vh = exact_polar(G)
    out = torch.linalg.svdvals(X.double())
    assert out.max() <= BAND_HI
    if shape[0] != shape[1]:
        # non-square Gaussian matrices have no tiny singular values: all must land in the band
        assert (S / G.double().norm()).min() >= BAND_THRESHOLD
        assert out.min() >= BAND_LO[dtype], f"smallest singular value {out.min():.4f} below the band"
    # same singular vectors as G: U^T X V is diagonal, i.e. X = U S' V^T
    D = U.mT @ X.double() @ Vh.mT
    off_diagonal = D - torch.diag_embed(torch.diagonal(D))
    assert off_diagonal.norm() / D.norm() < OFF_DIAGONAL[dtype]
    # close to the exact polar factor U V^T
    P = U @ Vh
    cosine = (X.double() * P).sum() / (X.double().norm() * P.norm())
    assert cosine > 0.97


def test_newton_schulz_zero_and_rank_checks(dtype):
    assert torch.equal(zeropower_via_newtonschulz5(torch.zeros(4, 6), dtype=getattr(torch, dtype)), torch.zeros(4, 6))
    with pytest.raises(ValueError):
        zeropower_via_newtonschulz5(torch.ones(5))


def muon_steps(initial, grads, threads, dtype, steps=2):
    """Muon's parameters after `steps` steps from `initial` with the same gradients each step, with `threads`."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        params = [torch.nn.Parameter(w.clone()) for w in initial]
        batches = [len(batch) for batch in _batches(params)]
        opt = Muon(params, lr=0.05, ns_dtype=getattr(torch, dtype))
        for _ in range(steps):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    finally:
        torch.set_num_threads(before)
    return params, batches


def test_muon_with_several_threads_stacks_each_shape_with_the_same_result(dtype):
    """
    With several threads Muon orthogonalises the matrices of one shape in one batched call (nanochat.muon._batches),
    with one thread one at a time: the same steps either way.
    """
    gen = torch.Generator().manual_seed(3)
    shapes = [(16, 8), (8, 32), (16, 8), (24, 8), (16, 8), (8, 32)]
    initial = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    one, one_batches = muon_steps(initial, grads, threads=1, dtype=dtype)
    several, several_batches = muon_steps(initial, grads, threads=2, dtype=dtype)
    assert one_batches == [1] * 6 and several_batches == [3, 2, 1]
    for a, b, w in zip(one, several, initial):
        assert not torch.equal(a, w)
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def reference_newton_schulz(M, steps=5):
    """Independent float64 numpy version of the quintic iteration."""
    X = M.astype(np.float64)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (np.linalg.norm(X) + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
    return X.T if tall else X


@pytest.mark.parametrize("nesterov, weight_decay", [(True, 0.0), (False, 0.0), (True, 0.4)])
def test_muon_matches_hand_written_steps(nesterov, weight_decay):
    gen = torch.Generator().manual_seed(7)
    tall = torch.randn(24, 8, generator=gen)   # lr scaled by sqrt(24 / 8)
    wide = torch.randn(8, 20, generator=gen)   # lr not scaled
    params = [torch.nn.Parameter(tall.clone()), torch.nn.Parameter(wide.clone())]
    opt = Muon(params, lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=weight_decay)
    expected = [tall.numpy().astype(np.float64), wide.numpy().astype(np.float64)]
    buffers = [np.zeros_like(e) for e in expected]
    for step, (lr, momentum) in enumerate([(0.05, 0.9), (0.02, 0.8), (0.03, 0.95)]):
        opt.param_groups[0]["lr"] = lr
        opt.param_groups[0]["momentum"] = momentum
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(grads):
            g = g.numpy().astype(np.float64)
            buffers[i] = momentum * buffers[i] + (1 - momentum) * g
            direction = (1 - momentum) * g + momentum * buffers[i] if nesterov else buffers[i]
            rows, cols = g.shape
            update = reference_newton_schulz(direction)
            scaled_lr = lr * math.sqrt(max(1.0, rows / cols))
            # cautious weight decay: only where the update moves the weight toward zero (same signs)
            decay = weight_decay * expected[i] * (update * expected[i] >= 0)
            expected[i] = expected[i] - scaled_lr * (update + decay)
        for p, g, e in zip(params, grads, expected):
            assert torch.equal(p.grad, g), "step() must not modify the gradient"
            np.testing.assert_allclose(p.detach().numpy(), e, rtol=1e-5, atol=1e-5, err_msg=f"step {step}")


def test_muon_rejects_non_matrices():
    with pytest.raises(ValueError, match="2-D"):
        Muon([torch.nn.Parameter(torch.zeros(3, 3)), torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="2-D"):
        Muon([torch.nn.Parameter(torch.zeros(2, 3, 4))])


def test_dist_optimizers_need_a_process_group():
    from nanochat.adamw import DistAdamW
    with pytest.raises(RuntimeError, match="process group"):
        DistMuon([torch.nn.Parameter(torch.zeros(3, 3))])
    with pytest.raises(RuntimeError, match="process group"):
        DistAdamW([torch.nn.Parameter(torch.zeros(3, 3))])


# Distributed vs one process, per compute dtype: (rtol, atol) of the weights after 5 steps. Each rank orthogonalises
# its matrices one call at a time, Muon stacks those of a shape. On the CPUs measured the two agree bit for bit in
# both dtypes; a bf16 kernel may round a batched product differently from a single one, by one bf16 step (2^-8) of
# an update of lr 0.02 per step: ~1e-3 after 5 steps.
DIST_TOLERANCE = {"float32": (1e-6, 1e-6), "bfloat16": (1e-3, 1e-3)}


@pytest.fixture(scope="module", params=[(2, "float32"), (3, "float32"), (2, "bfloat16"), (3, "bfloat16")],
                ids=["2ranks-fp32", "3ranks-fp32", "2ranks-bf16", "3ranks-bf16"])
def dist_results(request, tmp_path_factory):
    """
    Run the worker once per world size, compute dtype and test session (conftest.build_once); every test below
    checks a different part of its output.
    """
    world_size, dtype = request.param

    def build(out_dir):
        out_dir.mkdir()
        result = run_script("tests/dist_optim_worker.py", out_dir, nproc=world_size, env={"NANOCHAT_DTYPE": dtype},
                            timeout=120)
        assert result.returncode == 0, f"worker failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    out_dir = build_once(tmp_path_factory, f"dist_optim_{world_size}_{dtype}", build)
    return world_size, dtype, [torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)]


def test_dist_matches_single_process(dist_results):
    world_size, dtype, ranks = dist_results
    rtol, atol = DIST_TOLERANCE[dtype]
    for rank, res in enumerate(ranks):
        assert res["world_size"] == world_size and res["compute_dtype"] == dtype
        for i, (d, ref, init) in enumerate(zip(res["dist"], res["ref"], res["initial"])):
            assert d.shape == ref.shape
            torch.testing.assert_close(d, ref, rtol=rtol, atol=atol, msg=lambda m: f"rank {rank} param {i}: {m}")
            assert not torch.equal(ref, init), f"param {i} did not move"
        # every rank ends with the same weights, bit for bit
        for i, (d, d0) in enumerate(zip(res["dist"], ranks[0]["dist"])):
            assert torch.equal(d, d0), f"rank {rank} param {i} differs from rank 0"


def test_dist_state_is_sharded(dist_results):
    """
    Each rank holds momentum only for the matrices it owns, and AdamW state for its slice only; that
    state equals the corresponding part of the single-process optimizer's state (in either dtype: the state
    follows the gradients, which the worker makes up, not the weights).
    """
    world_size, _, ranks = dist_results
    owners_per_matrix = [0] * len(ranks[0]["muon_position"])
    for rank, res in enumerate(ranks):
        for i, (pos, buf, ref_buf) in enumerate(zip(res["muon_position"], res["muon_buffers"],
                                                    res["ref_muon_buffers"])):
            owned = pos % world_size == rank
            assert (buf is not None) == owned, f"rank {rank}, matrix {i} (position {pos} in its shape group)"
            if owned:
                owners_per_matrix[i] += 1
                torch.testing.assert_close(buf, ref_buf, rtol=1e-6, atol=1e-7,
                                           msg=lambda m: f"rank {rank} matrix {i}: {m}")
        for i, (state, ref_state) in enumerate(zip(res["adamw_state"], res["ref_adamw_state"])):
            assert set(state) == {"exp_avg", "exp_avg_sq"}, f"rank {rank}, AdamW param {i}: {set(state)}"
            for key, ref in ref_state.items():
                ref = ref.reshape(-1, *ref.shape[1:])  # a 0-d parameter counts as 1 row
                rows = math.ceil(ref.shape[0] / world_size)
                assert state[key].shape == (rows, *ref.shape[1:]), f"rank {rank}, AdamW param {i}, {key}"
                padded = torch.cat([ref, ref.new_zeros((rows * world_size - ref.shape[0], *ref.shape[1:]))])
                torch.testing.assert_close(state[key], padded[rank * rows:(rank + 1) * rows], rtol=1e-6, atol=1e-7,
                                           msg=lambda m: f"rank {rank}, AdamW param {i}, {key}: {m}")
    assert owners_per_matrix == [1] * len(owners_per_matrix), "every matrix must have exactly one owner"


def test_optimizer_checkpoint_resumes_on_any_world_size(dist_results):
    world_size, dtype, ranks = dist_results
    rtol, atol = DIST_TOLERANCE[dtype]
    straight = ranks[0]["uninterrupted"]
    for rank, res in enumerate(ranks):
        for i, (resumed, ref) in enumerate(zip(res["resumed"], res["uninterrupted"])):  # same world size: bit for bit
            torch.testing.assert_close(resumed, ref, rtol=0, atol=0, msg=lambda m: f"rank {rank} param {i}: {m}")
        for key in ("resumed_in_one_process", "resumed_from_one_process"):  # W ranks -> 1 process, 1 -> W ranks
            for i, (resumed, ref) in enumerate(zip(res[key], straight)):
                torch.testing.assert_close(resumed, ref, rtol=rtol, atol=atol,
                                           msg=lambda m: f"{key}, rank {rank} param {i}: {m}")
        assert res["missing_shard_error"] is not None and "incomplete" in res["missing_shard_error"]


def test_one_schedule_with_each_stages_defaults():
    # SFT and RL (warmdown_ratio=1): a linear decay from 1 at the first step to 0 at the end
    assert [lr_multiplier(s, 4, 0.0, 1.0) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    # midtraining of one epoch: the progress is conversations read out of the epoch's, decay over the last 20%
    assert lr_multiplier(500, 1000) == 1.0 and lr_multiplier(900, 1000) == pytest.approx(0.5)
    assert lr_multiplier(1000, 1000, final_lr_frac=0.1) == pytest.approx(0.1)
    model = torch.nn.Linear(2, 2)
    adam = torch.optim.AdamW(model.parameters(), lr=0.2)
    from nanochat.muon import Muon
    muon = Muon([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.02, momentum=0.95)
    for opt in (adam, muon):
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    scale_initial_lrs([adam, muon], 0.5)
    set_learning_rates([adam, muon], 0.5, 0.9)
    assert adam.param_groups[0]["lr"] == pytest.approx(0.05) and muon.param_groups[0]["lr"] == pytest.approx(0.005)
    assert muon.param_groups[0]["momentum"] == 0.9 and "momentum" not in adam.param_groups[0]


@pytest.mark.parametrize("shape, fused", [((37, 64), True), ((37, 192), True), ((37, 100), False), ((37,), False)])
def test_adamw_update_of_a_slice_of_rows_is_the_whole_tensors(shape, fused):
    """
    adamw_update_ on each rank's rows (DistAdamW) gives bit for bit what it gives on the whole tensor (AdamW), with
    torch's fused kernel where nanochat.adamw.fused_exactly says so and op by op elsewhere; either agrees with
    torch.optim.AdamW to fp32 rounding.
    """
    from nanochat.adamw import adamw_update_, fused_exactly
    gen = torch.Generator().manual_seed(0)
    p, g, m = (torch.randn(shape, generator=gen) for _ in range(3))
    v = torch.rand(shape, generator=gen) * 0.01
    assert fused_exactly(p) == fused
    settings = dict(t=3, lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1)
    whole = [t.clone() for t in (p, m, v)]
    adamw_update_(whole[0], g, whole[1], whole[2], **settings)
    for world_size in (2, 3, 7):
        rows = -(-shape[0] // world_size)
        sliced = [t.clone() for t in (p, m, v)]
        for start in range(0, shape[0], rows):
            part = slice(start, start + rows)
            adamw_update_(sliced[0][part], g[part], sliced[1][part], sliced[2][part], **settings)
        assert all(torch.equal(a, b) for a, b in zip(sliced, whole)), world_size
    reference = torch.nn.Parameter(p.clone())
    torch_adamw = torch.optim.AdamW([reference], lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1)
    torch_adamw.state[reference] = {"step": torch.tensor(2.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    reference.grad = g.clone()
    torch_adamw.step()
    torch.testing.assert_close(whole[0], reference.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["clipped", "within max_norm: untouched, bit for bit"])
def test_clip_grad_norm_is_torchs_in_one_process(max_norm):
    """
    clip_grad_norm_ (one process) returns torch's norm and leaves torch's gradients: scaled by max_norm / (norm +
    1e-6) above max_norm, bit for bit as they were within it (the CPU skips the multiplication by 1).
    """
    g = torch.Generator().manual_seed(0)
    matrices = [torch.nn.Parameter(torch.randn(rows, 16, generator=g)) for rows in (16, 32)]
    table = torch.nn.Parameter(torch.randn(64, 16, generator=g))
    vector = torch.nn.Parameter(torch.randn(16, generator=g))
    params = matrices + [table, vector]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    grads = [p.grad.clone() for p in params]
    norm = clip_grad_norm_([torch.optim.AdamW([table, vector]), Muon(matrices)], max_norm)
    reference = [torch.nn.Parameter(torch.zeros(t.shape)) for t in grads]
    for r, grad in zip(reference, grads):
        r.grad = grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(reference, max_norm)
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    scale = min(1.0, max_norm / (expected.item() + 1e-6))
    for p, grad, r in zip(params, grads, reference):
        if max_norm > 1e5:
            assert torch.equal(p.grad, grad)
        else:
            torch.testing.assert_close(p.grad, grad * scale, rtol=1e-6, atol=0)
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)
