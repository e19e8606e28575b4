"""
bench/ladder.py: the compute multiplier (CM) against hand-computed cases, its seed-noise interval and verdict, the
summary fit, the rung plan and the one-line refusals of a bad ladder, and one tiny ladder end to end.

The hand-computed cases follow the issue's formula: for a baseline segment (f0, b0) -> (f1, b1) around b*,
w = (ln b0 - ln b*) / (ln b0 - ln b1) and ln F = (1 - w) ln f0 + w ln f1. The end-to-end test trains two experiments
of the same recipe on different seeds (a record per rung, a rerun that trains nothing), and their comparison says
"within noise" and draws its picture.
"""

import json
import math
import os
import sys

import pytest

from helpers import CORES, HEAD_COMMIT, REPO_ROOT, head_checkout, run_script

sys.path.insert(0, os.path.join(REPO_ROOT, "bench"))  # bench/ is no package
import ladder  # noqa: E402

CURVE = [(1e9, 2.0), (4e9, 1.5), (1.6e10, 1.2)]


# ---------------------------------------------------------------------------------------------
# The CM arithmetic


def test_flops_at_interpolates_in_log_log_space():
    # b* = 1.8 on the first segment: w = ln(2 / 1.8) / ln(2 / 1.5) = 0.366239, F = 1e9 * 4 ** w
    assert ladder.flops_at(CURVE, 1.8) == (pytest.approx(1.661491419e9, rel=1e-9), False)
    # at a measured point: that point's FLOPs
    assert ladder.flops_at(CURVE, 1.5)[0] == pytest.approx(4e9, rel=1e-12)


def test_flops_at_extrapolates_past_either_end_and_says_so():
    # below the last point: the last segment extended, w = ln(1.5 / 1.1) / ln(1.5 / 1.2) = 1.389935, F = 4e9 * 4 ** w
    assert ladder.flops_at(CURVE, 1.1) == (pytest.approx(2.74716007e10, rel=1e-8), True)
    # above the first: the first segment extended backwards, w = ln(2 / 2.2) / ln(2 / 1.5) = -0.331304
    assert ladder.flops_at(CURVE, 2.2) == (pytest.approx(6.31735385e8, rel=1e-8), True)


def test_flops_at_is_the_first_crossing_and_refuses_what_it_cannot_read():
    bumpy = [(1e9, 2.0), (2e9, 1.5), (4e9, 1.7), (8e9, 1.4)]
    found, extrapolated = ladder.flops_at(bumpy, 1.6)
    assert 1e9 < found < 2e9 and not extrapolated  # the first time the curve gets there, not the later crossing
    assert ladder.flops_at([(1e9, 2.0)], 1.9) is None  # one point: no segment
    assert ladder.flops_at([(1e9, 1.5), (2e9, 1.6)], 1.4) is None  # a rising edge: nothing to extend along


def test_identical_curves_give_cm_1_and_a_shift_in_flops_gives_its_factor():
    assert ladder.cm_of(CURVE, 1.6e10, 1.2)[0] == pytest.approx(1.0, abs=1e-12)
    # the variant reaches each bpb with 3x fewer FLOPs: at its final point the baseline needs 3x its compute
    shifted = [(f / 3, b) for f, b in CURVE]
    assert ladder.cm_of(CURVE, *shifted[-1]) == (pytest.approx(3.0, rel=1e-12), False)
    assert ladder.cm_of(CURVE, *shifted[1]) == (pytest.approx(3.0, rel=1e-12), False)
    # needing 2x more: CM 0.5
    assert ladder.cm_of(CURVE, 2 * 4e9, 1.5) == (pytest.approx(0.5, rel=1e-12), False)


def power_law_ladder(depths=(1, 2, 3), seeds=(42, 43), shift=1.0, noise=0.0, points=4):
    """
    Records of a ladder whose every curve lies on bpb = 3 x (shift x FLOPs) ** -0.05 (a straight line in log-log:
    a variant with shift k reaches any bpb with k times less compute, CM k), seed s's bpb times (1 + noise x (-1)^s).
    """
    records = []
    for d in depths:
        final = 1e9 * 8 ** d
        for seed in seeds:
            wobble = 1 + noise * (-1) ** seed
            pts = [[k, final * k / points, 3 * (shift * final * k / points) ** -0.05 * wobble]
                   for k in range(1, points + 1)]
            records.append(dict(depth=d, seed=seed, points=pts, flops=final, val_bpb=pts[-1][2]))
    return records


def test_a_depths_cm_is_the_shift_interpolated_or_extrapolated_and_marked():
    base = power_law_ladder()
    worse = ladder.depth_cm([r for r in base if r["depth"] == 2],
                            [r for r in power_law_ladder(shift=0.5) if r["depth"] == 2])
    assert worse["cm"] == pytest.approx(0.5, rel=1e-9) and worse["extrapolated"] is False
    better = ladder.depth_cm([r for r in base if r["depth"] == 2],
                             [r for r in power_law_ladder(shift=2.0) if r["depth"] == 2])
    # its final bpb is below anything the baseline's depth-2 run reached: the edge extended, still exact on a line
    assert better["cm"] == pytest.approx(2.0, rel=1e-9) and better["extrapolated"] is True
    assert better["pairs_extrapolated"] == 4 and len(better["pair_cms"]) == 4


def test_seed_interval_by_hand():
    # ln CM of the variant's seeds 0.1, 0.3 (mean 0.2) and of the baseline's one seed 0.2: pooled variance
    # ((0.1 - 0.2)^2 + (0.3 - 0.2)^2) / 1 = 0.02, standard error sqrt(0.02) * sqrt(1/2 + 1/1) = 0.173205,
    # Student's t(0.975, 1 df) = 12.706: ln CM = 0.2 -/+ 2.200744
    lo, hi = ladder.seed_interval(math.exp(0.2), [math.exp(0.1), math.exp(0.3)], [math.exp(0.2)])
    assert (lo, hi) == (pytest.approx(0.1352347, rel=1e-6), pytest.approx(11.0313780, rel=1e-6))
    assert ladder.verdict([lo, hi]) == "within noise"
    assert ladder.seed_interval(1.2, [1.2], [1.2]) is None  # one seed each: nothing says how far a seed moves it
    assert ladder.verdict(None) == "noise unknown (one seed each)"
    assert ladder.verdict([1.01, 1.3]) == "better" and ladder.verdict([0.7, 0.99]) == "worse"


def test_the_same_recipe_on_other_seeds_is_within_noise_and_a_real_gain_is_not():
    base = power_law_ladder(seeds=(42, 43), noise=0.002)
    same = power_law_ladder(seeds=(44, 45), noise=0.002)
    gain = power_law_ladder(seeds=(44, 45), shift=2.0, noise=0.002)
    loss = power_law_ladder(seeds=(44, 45), shift=0.5, noise=0.002)
    for d in (1, 2, 3):
        at = lambda records: [r for r in records if r["depth"] == d]  # noqa: E731
        assert ladder.depth_cm(at(base), at(same))["verdict"] == "within noise"
        row = ladder.depth_cm(at(base), at(gain))
        assert row["verdict"] == "better" and row["interval"][0] < 2.0 < row["interval"][1]
        assert ladder.depth_cm(at(base), at(loss))["verdict"] == "worse"


def test_summary_cm_fits_one_slope_across_the_ladder():
    base = power_law_ladder()
    assert ladder.fit_cm([(r["flops"], r["val_bpb"]) for r in base],
                         [(r["flops"], r["val_bpb"]) for r in power_law_ladder(shift=2.0)]) == pytest.approx(2.0)
    summary = ladder.summary_cm(power_law_ladder(noise=0.002), power_law_ladder(seeds=(44, 45), shift=2.0,
                                                                                  noise=0.002), [1, 2, 3])
    assert summary["cm"] == pytest.approx(2.0, rel=1e-6) and summary["verdict"] == "better"
    assert summary["interval"][0] < 2.0 < summary["interval"][1]
    assert ladder.summary_cm(base, base, [2])["verdict"] == "needs two depths"


# ---------------------------------------------------------------------------------------------
# The rungs: steps, FLOPs, time left, refusals


def test_the_cpu_ladder_is_four_rungs_inside_one_epoch_of_pydocs():
    st = dict(ladder.CPU, depths=[1, 2, 3, 4])
    rungs = [ladder.plan_rung(d, st) for d in st["depths"]]
    ladder.check_rungs(rungs, st, "ours")
    # 0.08 tokens per scaling parameter: depth 1: round(0.08 x (12 x 64^2 + 64 x 8192) / 2048) = 22 steps
    assert [r["steps"] for r in rungs] == [22, 56, 113, 205]
    assert rungs[-1]["tokens"] == 419840 and rungs[-1]["save_every"] == 52
    assert ladder.scaling_params(12, 32768) == 12 * 12 * 768 ** 2 + 768 * 32768  # HEAD's d12: 110M
    gpu = [ladder.plan_rung(d, dict(ladder.GPU)) for d in (12, 20, 28)]
    assert [r["device_batch_size"] for r in gpu] == [32, 16, 8]


def test_flops_per_token_is_6_linear_plus_attention_by_window():
    import torch

    from nanochat.gpt import GPT, config_from_depth
    config = config_from_depth(3, vocab_size=512, sequence_len=1024, window_pattern="SL")
    with torch.device("meta"):
        model = GPT(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # layers S, L, L (the last is always L); an S window at T = 1024 is 256; 12 x heads x head_dim = 12 x 192
    expected = 6 * linear + 12 * 192 * (256 + 1024 + 1024)
    assert ladder.flops_per_token(linear, config.to_dict(), 1024) == expected == model.estimate_flops()
    # 088726a's config has no window_pattern: every layer sees the whole context
    assert ladder.flops_per_token(100, dict(n_layer=2, n_head=2, n_embd=128), 64) == 600 + 2 * 12 * 128 * 64


def test_time_left_fits_start_up_and_seconds_per_flop():
    assert ladder.time_left([], [1.0]) is None
    assert ladder.time_left([(1.0, 10.0), (3.0, 20.0)], [5.0, 1.0]) == pytest.approx(30.0 + 10.0)  # 5 + 5 F
    assert ladder.time_left([(2.0, 10.0)], [2.0, 2.0]) == pytest.approx(20.0)  # the same size again
    assert ladder.time_left([(2.0, 10.0)], [4.0]) is None  # one size says nothing about another


@pytest.mark.parametrize("args, message", [
    (["--depths=5", "--codebase=088"], "depth 5 does not fit karpathy/nanochat 088726a's model"),
    (["--depths=1", "--ratio=0.01"], "depth 1 trains 3 step(s)"),
    (["--depths=1", "--tokens_per_step=3000"], "--tokens_per_step=3000 is not a multiple"),
    (["--depths=0"], "at least one depth, each >= 1"),
    (["--variant=--save_every=3"], "--save_every is set by the ladder"),
    (["--codebase=head", "--variant=ve"], "an anchor trains with its own"),
])
def test_a_bad_ladder_is_one_line_before_anything_runs(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        ladder.main(["run", "x", f"--work={tmp_path}", *args])
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "ladders").exists()


def test_a_dataset_too_small_for_the_largest_rung_is_refused():
    rungs = [ladder.plan_rung(d, dict(ladder.CPU)) for d in (1, 4)]
    with pytest.raises(SystemExit, match=r"depth 4: 419,840 tokens\) needs more than the ~400,000 training tokens"):
        ladder.check_dataset(rungs, dict(name="pydocs", train_tokens=400000), dict(ladder.CPU))
    ladder.check_dataset(rungs, dict(name="pydocs", train_tokens=630000), dict(ladder.CPU))


def write_experiment(work, name, records, **identity):
    path = work / "ladders" / name
    path.mkdir(parents=True)
    ident = dict(dict(code="ours", commit="abc", overrides=[], ratio=0.1, seq_len=512, tokens_per_step=2048,
                      dataset="pydocs", shards=[["shard_00000.parquet", 1]], eval_set=dict(docs=10)), **identity)
    (path / "experiment.json").write_text(json.dumps(dict(name=name, identity=ident)))
    (path / "curve.jsonl").write_text("".join(json.dumps(dict(r, commit="abc")) + "\n" for r in records))


def test_compare_refuses_two_datasets_and_draws_the_picture(tmp_path, capsys):
    write_experiment(tmp_path, "a", power_law_ladder(noise=0.002))
    write_experiment(tmp_path, "b", power_law_ladder(seeds=(44, 45), shift=2.0, noise=0.002))
    write_experiment(tmp_path, "c", power_law_ladder(), dataset="climbmix")
    with pytest.raises(SystemExit, match="different datasets"):
        ladder.main(["compare", "a", "c", f"--work={tmp_path}"])
    ladder.main(["compare", "a", "b", f"--work={tmp_path}"])
    out = capsys.readouterr().out
    assert out.count("| better |") == 3 and "summary CM across depths 1, 2, 3" in out and "2.000" in out
    png = tmp_path / "ladders" / "b" / "compare_vs_a.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "ladders" / "b" / "compare_vs_a.json").read_text())
    assert [row["verdict"] for row in saved["depths"]] == ["better"] * 3


# ---------------------------------------------------------------------------------------------
# One tiny ladder, for real


def ladder_cli(*args, env=None, code=0):
    """bench/ladder.py, forked as every script run is (its own runs too); its output if it exits `code`."""
    result = run_script(os.path.join(REPO_ROOT, "bench", "ladder.py"), *args, timeout=900,
                        env=dict(OMP_NUM_THREADS=CORES, **(env or {})))
    assert result.returncode == code, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


@pytest.mark.slow
def test_a_tiny_ladder_end_to_end(tmp_path):
    # one depth: the rung plan of several is test_the_cpu_ladder_is_four_rungs_inside_one_epoch_of_pydocs's
    tiny = [f"--work={tmp_path}", "--depths=1", "--ratio=0.01", "--seq_len=64", "--tokens_per_step=256",
            "--evals=2", "--eval_tokens=2048", "--vocab_size=512"]
    out = ladder_cli("run", "a", "--seeds=2", "--core_per_task=0", *tiny)
    assert "[2/2] seed 43, depth 1: val bpb" in out and "left ~" in out
    records = [json.loads(line) for line in (tmp_path / "ladders" / "a" / "curve.jsonl").read_text().splitlines()]
    assert sorted((r["depth"], r["seed"]) for r in records) == [(1, 42), (1, 43)]
    for r in records:
        # round(0.01 x 81,920 / 256) = 3 steps, checkpoints at 2 and 3
        assert [p[0] for p in r["points"]] == [2, 3]
        assert r["flops"] == r["flops_per_token"] * r["tokens"] == r["points"][-1][1]
        assert r["points"][0][2] > r["val_bpb"] > 0 and r["core"] is None
        tag = tmp_path / "pydocs-v512" / "ours" / "base_checkpoints" / f"L-a-d1-s{r['seed']}"
        assert sorted(n for n in os.listdir(tag) if n.startswith("model_")) == [f"model_{r['steps']:06d}.pt"]
    assert len({r["val_bpb"] for r in records}) == 2  # the seeds differ

    again = ladder_cli("run", "a", "--seeds=2", "--core_per_task=0", *tiny)  # trains nothing, prepares nothing
    assert again.count("done before, skipped") == 2 and "every rung done" in again
    assert len((tmp_path / "ladders" / "a" / "curve.jsonl").read_text().splitlines()) == 2
    other = ladder_cli("run", "a", "--seeds=2", "--core_per_task=0", *tiny[:-1], "--vocab_size=1024", code=1)
    assert "experiment a was made otherwise (vocab_size: 512 -> 1024)" in other

    b = ladder_cli("run", "b", "--first_seed=2", "--core_per_task=2", *tiny)  # the same recipe on seed 44, with CORE
    assert "seed 44, depth 1: val bpb" in b and "CORE" in b
    compared = ladder_cli("compare", "a", "b", f"--work={tmp_path}")
    rows = [line for line in compared.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 1 and rows[0].endswith("| within noise |"), compared
    assert (tmp_path / "ladders" / "b" / "compare_vs_a.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_an_anchor_rung_is_trained_and_scored_as_ours(tmp_path):
    head = head_checkout(tmp_path / "head")
    # HEAD's torch.compile is off (TORCHDYNAMO_DISABLE): a minute of compiling here, and the test is the plumbing.
    # Its python: the tests' stand-in (tests/forkbin), so that its runs fork as ours do
    python = os.path.join(REPO_ROOT, "tests", "forkbin", "python")
    out = ladder_cli("run", "h", "--codebase=head", f"--refhead={head}", f"--ref_python={python}",
                     f"--work={tmp_path}", "--depths=1", "--ratio=0.02", "--seq_len=64", "--tokens_per_step=256",
                     "--evals=2", "--eval_tokens=2048", "--vocab_size=512", env={"TORCHDYNAMO_DISABLE": "1"})
    assert "[1/1] seed 42, depth 1: val bpb" in out
    record, = [json.loads(line) for line in (tmp_path / "ladders" / "h" / "curve.jsonl").read_text().splitlines()]
    # HEAD's checkpoints, saved every 3 of its 6 steps and scored by the same quality_eval; its Linear class counted
    assert [p[0] for p in record["points"]] == [3, 6] and record["commit"] == f"{HEAD_COMMIT} (COMMIT file)"
    assert record["linear_params"] > ladder.scaling_params(1, 512) and record["core"] is None
    assert "--save-every=3" in record["train_command"] and "--model-tag=L-h-d1-s42" in record["train_command"]
