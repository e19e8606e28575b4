"""
scripts/base_train end to end on CPU, on a tiny model: checkpoints and an exact resume, errors, SIGTERM, two ranks
equal to one in bf16 and numbers that do not depend on which run measured the hardware (the N-rank ==
1-rank-with-accumulation property in fp32: test_training_core's resume on another number of processes). Plus the
schedules and evaluate_bpb.
"""

import json
import math
import os
import re
import resource
import shutil
import subprocess
import time

import pytest
import torch

from helpers import (CORES, REPO_ROOT, TINY, assert_same_weights, base_train, metrics, run_script, run_signalled,
                     start_script, stop_at, train_losses, weights, with_defaults)
from nanochat.losses import evaluate_bpb
from nanochat.optim import (EMBEDDING_WEIGHT_DECAY_BY_DEPTH, MATRIX_WEIGHT_DECAY_BY_DEPTH, decay_by_depth,
                            lr_multiplier, muon_momentum)

@pytest.mark.slow
def test_trains_writes_a_checkpoint_and_resumes_exactly(trained_tokenizer, isolated_env, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))  # a real wandb run, offline (WANDB_MODE=offline in conftest)
    result = base_train("--num_iterations=6", "--run=ci-test")
    assert result.returncode == 0, result.stderr
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(f.suffix == ".wandb" for f in runs[0].iterdir())
    out = result.stdout
    assert "Tokens / micro-batch / rank: 2 x 32 = 64" in out
    assert "Total batch size 128 => gradient accumulation steps: 2" in out
    assert "rank  local_rank  world_size  device  host" in out
    assert "validation bpb" in out and "step 00006/00006" in out
    ckpt = isolated_env / "base_checkpoints" / "d1"
    assert {"model_000006.pt", "optim_000006_rank0.pt", "meta_000006.json"} <= set(os.listdir(ckpt))
    meta = json.load(open(ckpt / "meta_000006.json"))
    assert meta["step"] == 6 and meta["user_config"]["num_iterations"] == 6 and meta["val_bpb"] > 0
    rows = [m for m in metrics(isolated_env) if "dt" in m]
    for m in rows:  # tokens/s counts every micro-step's tokens: total_batch_size per step, not one micro-batch
        assert m["tok_per_sec"] * m["dt"] == pytest.approx(128)
    losses = train_losses(isolated_env)
    assert losses[0] == pytest.approx(math.log(512), rel=0.05)  # uniform predictions at init
    assert (isolated_env / "report" / "base-model-training.md").exists()

    # the same run again, saving at step 3 and resumed from there as if it had died after that save: the losses and
    # the weights of the uninterrupted run above (which saved nothing before its end)
    first = base_train("--num_iterations=6", "--model_tag=resumed", "--save_every=3")
    assert first.returncode == 0, first.stderr
    resumed = isolated_env / "base_checkpoints" / "resumed"
    for name in os.listdir(resumed):  # what the first run did after step 3, thrown away
        if "000006" in name:
            os.remove(resumed / name)
    second = base_train("--num_iterations=6", "--model_tag=resumed", "--resume_from_step=3")
    assert second.returncode == 0, second.stderr
    assert "Resumed from step 3" in second.stdout
    assert train_losses(isolated_env, "resumed") == pytest.approx(losses, rel=1e-6)
    assert_same_weights(weights(isolated_env, 6), weights(isolated_env, 6, "resumed"), rtol=1e-6, atol=0)


def test_help_and_one_line_errors(trained_tokenizer):
    result = run_script("-m", "scripts.base_train", "--help")
    assert result.returncode == 0
    for key in ("--depth", "--device_batch_size", "--total_batch_size", "--resume_from_step", "--compile"):
        assert key in result.stdout
    listed = {line.split()[0]: line for line in result.stdout.splitlines() if line.startswith("  --")}
    assert all(len(line.split()) > 3 for line in listed.values())  # every setting: type, default and its description
    assert "-1 = by depth" in listed["--weight_decay"] and "-1 = by depth" in listed["--matrix_weight_decay"]
    bad_settings = [
        ("--matrix_weight_decay=-2", "--matrix_weight_decay must be >= 0, or -1 for 'by depth', got -2.0"),
        ("--weight_decay=-0.5", "--weight_decay must be >= 0, or -1 for 'by depth', got -0.5"),
        ("--qk_scale=0", "--rope_base must be > 1 and --qk_scale > 0"),
        ("--init_recipe=2024", "--init_recipe must be one of"),
        ("--window_pattern=SXL", "--window_pattern is a string of S (short window) and L"),
        ("--attention=flex", "--attention=flex trains on CUDA only"),
    ]
    for bad, message in bad_settings:
        result = base_train(bad)
        assert result.returncode == 1, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr
    # refused before the stage starts a process group or a wandb run (which printed 13 lines of its own here)
    flex = base_train("--attention=flex", "--run=flex_on_cpu")
    assert flex.returncode == 1 and len(flex.stderr.strip().splitlines()) == 1, flex.stderr
    assert "wandb" not in flex.stdout.lower() + flex.stderr.lower(), flex.stdout + flex.stderr
    bad_key = base_train("--dpeth=2")
    assert bad_key.returncode == 1
    assert bad_key.stderr.strip().splitlines() == [
        "error: unknown config key 'dpeth' (did you mean --depth?); run with --help to list every key"]
    bad_batch = base_train("--total_batch_size=100", "--num_iterations=2")
    assert bad_batch.returncode == 1
    lines = bad_batch.stderr.strip().splitlines()
    assert len(lines) == 1, bad_batch.stderr
    assert ("total_batch_size 100 is not a multiple of device_batch_size x max_seq_len x world_size = 2 x 32 x 1 = 64"
            in lines[0])
    assert "--total_batch_size=64 or --total_batch_size=128" in lines[0]


# One rank with two micro-steps and two ranks with one each train the same weights to the last bit, in bf16 as in
# fp32: halving a loss halves every gradient exactly, two gradients add up the same in either order, and both
# placements run the same optimizer arithmetic (nanochat/adamw.py) and add up the clipping norm the same way
# (nanochat/optim.py clip_grad_norm_). In bf16 a last-bit difference of a weight rounds a product to another
# bf16 number and grows from step to step, so the property is tested here, in bf16. (Other splits, 3 ranks or
# 4 micro-steps, add the gradients in another order: equal to rounding, test_training_core, in fp32.) A resume
# does the same operations on the same numbers: exact too.
# The second case: every part of the 2026 recipe (layer scalars and value embeddings are AdamW parameters of their
# own, sharded across ranks like the rest; rows of 1 to 2 values padded for the collectives).
RECIPE_2026 = ["--rope_base=100000", "--qk_scale=1.2", "--layer_scalars=True", "--value_embeds=True",
               "--init_recipe=2026", "--matrix_weight_decay=0.4", "--warmdown_ratio=0.65", "--final_lr_frac=0.05",
               "--muon_momentum_peak=0.97", "--muon_momentum_final=0.90"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [[], RECIPE_2026], ids=["defaults", "recipe2026"])
def test_bf16_two_ranks_equal_one_rank_and_resume_is_exact(trained_tokenizer, isolated_env, monkeypatch, recipe):
    monkeypatch.setenv("NANOCHAT_DTYPE", "bfloat16")
    recipe = [*recipe, "--grad_clip=0.5"]  # below these runs' gradient norms (~0.6-1.0): clipping takes part
    kernel = "eager" if "--value_embeds=True" in recipe else ""  # the 2026 case also through the written-out softmax
    recipe += [f"--attention={kernel}"] if kernel else []
    single = base_train(*recipe, "--num_iterations=6", "--model_tag=single", "--save_every=3")
    assert single.returncode == 0, single.stderr
    assert "Compute dtype: bfloat16 (NANOCHAT_DTYPE=bfloat16" in single.stdout
    # dense or SDPA as this CPU measured; --attention's kernel without a measurement
    assert f"Attention in training steps: {kernel}" in single.stdout
    assert "gradient accumulation steps: 2" in single.stdout
    single_losses = train_losses(isolated_env, "single")
    assert max(m["grad_norm"] for m in metrics(isolated_env, "single") if "grad_norm" in m) > 0.5  # clipping took part
    ddp_args = with_defaults(TINY, [*recipe, "--num_iterations=6", "--model_tag=ddp"])
    ddp = run_script("-m", "scripts.base_train", *ddp_args, nproc=2)
    assert ddp.returncode == 0, ddp.stderr
    assert "gradient accumulation steps: 1" in ddp.stdout
    # the logged loss: one rank's mean of its micro-steps in fp32, or the mean of the ranks' in float64 (last bit)
    assert train_losses(isolated_env, "ddp") == pytest.approx(single_losses, rel=1e-6)
    single_weights = weights(isolated_env, 6, "single")
    assert_same_weights(single_weights, weights(isolated_env, 6, "ddp"), rtol=0, atol=0)
    # resumed from the single run's step 3, as if it had died after that save
    resumed = isolated_env / "base_checkpoints" / "resumed"
    shutil.copytree(isolated_env / "base_checkpoints" / "single", resumed,
                    ignore=shutil.ignore_patterns("*000006*", ".lock"))
    again = base_train(*recipe, "--num_iterations=6", "--model_tag=resumed", "--resume_from_step=3")
    assert again.returncode == 0, again.stderr
    assert train_losses(isolated_env, "resumed") == single_losses
    assert_same_weights(single_weights, weights(isolated_env, 6, "resumed"), rtol=0, atol=0)


@pytest.mark.slow
def test_the_numbers_do_not_depend_on_which_run_measured_the_hardware(trained_tokenizer, isolated_env, monkeypatch):
    # The compute dtype as this machine decides it (no NANOCHAT_DTYPE): on a CPU with native bf16 a matmul probe,
    # measured by the first run in a base dir and read by the later ones, by rank 0 alone under torchrun; and the peak
    # FLOP/s, measured by every run. A run that measured, one that read the cache, and two ranks of which one measured
    # train the same weights.
    monkeypatch.delenv("NANOCHAT_DTYPE", raising=False)
    monkeypatch.delenv("NANOCHAT_PEAK_FLOPS", raising=False)
    probe_cache = isolated_env / "compute_dtype.json"
    runs = {}
    for tag, nproc in (("measured", 1), ("cached", 1), ("two_ranks", 2)):
        if tag != "cached":
            probe_cache.unlink(missing_ok=True)
        args = with_defaults(TINY, ["--num_iterations=4", f"--model_tag={tag}"])
        result = run_script("-m", "scripts.base_train", *args, nproc=nproc)
        assert result.returncode == 0, result.stderr
        runs[tag] = (next(line for line in result.stdout.splitlines() if line.startswith("Compute dtype:")),
                     train_losses(isolated_env, tag), weights(isolated_env, 4, tag))
    dtype_line, losses, measured_weights = runs["measured"]
    for tag in ("cached", "two_ranks"):
        assert runs[tag][0].split(";")[0].split(" (")[0] == dtype_line.split(" (")[0], tag  # the same dtype
        assert runs[tag][1] == pytest.approx(losses, rel=1e-6), tag  # the logged mean's last bit: see above
        assert_same_weights(measured_weights, runs[tag][2], rtol=0, atol=0)


# The stops below come from INSIDE a write of the step line (helpers.run_signalled): deterministic, and where a
# handler that printed crashed ("RuntimeError: reentrant call inside <_io.BufferedWriter name='<stdout>'>", exit 1)


@pytest.mark.slow
def test_sigterm_leaves_a_complete_resumable_checkpoint(trained_tokenizer, isolated_env):
    result, _ = run_signalled("step 00003/", "SIGTERM", "-m", "scripts.base_train",
                              *with_defaults(TINY, ["--num_iterations=100000", "--eval_every=-1"]))
    out = result.stdout + result.stderr
    assert result.returncode == 75 and "Traceback" not in out, out[-3000:]  # EXIT_STOPPED_EARLY: a pipeline stops here
    # step 3's line is printed after its stop check: the step after it runs, then the stage saves it and stops
    assert "got SIGTERM" in result.stderr and "--resume_from_step=4" in result.stdout
    meta_files = [f for f in os.listdir(isolated_env / "base_checkpoints" / "d1") if f.startswith("meta_")]
    assert meta_files == ["meta_000004.json"]
    resumed = base_train("--resume_from_step=4", "--num_iterations=6", "--eval_every=-1")
    assert resumed.returncode == 0, resumed.stderr
    assert "step 00006/00006" in resumed.stdout


@pytest.mark.slow
def test_a_stop_request_cuts_the_final_evaluations_short_and_a_resume_runs_them(trained_tokenizer, isolated_env):
    # the last step is saved, then comes a validation of ~1.5 million batches: hours; the SIGTERM stops it at once
    args = with_defaults(TINY, ["--num_iterations=3", "--eval_every=-1", "--eval_tokens=100000000"])
    result, seconds = run_signalled("step 00003/00003", "SIGTERM", "-m", "scripts.base_train", *args)
    out = result.stdout + result.stderr
    assert result.returncode == 75 and "Traceback" not in out, out[-3000:]  # not finished: its evaluations did not run
    assert seconds < 20 and "Step 00003 | evaluations stopped: a stop was requested" in out, out[-3000:]
    assert "--resume_from_step=3" in out and "validation bpb:" not in out
    assert (isolated_env / "base_checkpoints" / "d1" / "meta_000003.json").exists()  # saved before, kept
    report = (isolated_env / "report" / "base-model-training.md").read_text()
    assert "n/a (its evaluation was stopped)" in report
    # the small validation of TINY
    resumed = base_train("--num_iterations=3", "--eval_every=-1", "--resume_from_step=3")
    assert resumed.returncode == 0, resumed.stderr
    assert "Step 00003 | validation bpb:" in resumed.stdout


@pytest.mark.slow
def test_a_stop_request_to_one_rank_stops_every_rank_within_seconds(trained_tokenizer, isolated_env):
    # torchrun, 2 ranks; the SIGTERM reaches rank 1 only, in the middle of a validation of hours: rank 0 learns it
    # through the process group's store (it takes part in no collective until the end of its share)
    import psutil
    args = with_defaults(TINY, ["--num_iterations=3", "--eval_every=-1", "--eval_tokens=100000000"])
    proc = start_script("-m", "scripts.base_train", *args, nproc=2, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True)

    def rank1():
        workers = psutil.Process(proc.pid).children(recursive=True)
        return next(p.pid for p in workers
                    if "scripts.base_train" in " ".join(p.cmdline()) and p.environ().get("RANK") == "1")
    out, seconds = stop_at(proc, "step 00003/00003", to=rank1)
    assert proc.returncode != 0 and seconds < 20, out[-3000:]
    assert "[rank 1] got SIGTERM" in out and "[rank 0] got" not in out
    assert "Step 00003 | evaluations stopped: a stop was requested" in out and "--resume_from_step=3" in out
    assert re.search(r"exitcode\s*:\s*75", out), out[-3000:]  # torchrun's summary of the ranks' exit codes


def test_lr_schedule_endpoints_and_boundaries():
    n = 100
    assert lr_multiplier(0, n, warmup_ratio=0.1) == pytest.approx(0.1)  # warmup: (step + 1) / 10
    assert lr_multiplier(9, n, warmup_ratio=0.1) == 1.0
    assert lr_multiplier(10, n, warmup_ratio=0.1) == 1.0
    assert lr_multiplier(80, n, warmdown_ratio=0.2) == 1.0  # last step of the constant part
    assert lr_multiplier(81, n, warmdown_ratio=0.2) == pytest.approx(19 / 20)
    assert lr_multiplier(90, n, warmdown_ratio=0.2, final_lr_frac=0.1) == pytest.approx(0.5 * 1 + 0.5 * 0.1)
    assert lr_multiplier(100, n, warmdown_ratio=0.2, final_lr_frac=0.1) == pytest.approx(0.1)
    assert lr_multiplier(100, n, warmdown_ratio=0.2) == 0.0
    assert lr_multiplier(50, n, warmup_ratio=0.0, warmdown_ratio=0.0) == 1.0


def test_weight_decay_by_depth():
    # Muon: ours at d6, karpathy/nanochat's measured optima at d8, d12, d20; linear between, flat outside
    assert [round(decay_by_depth(MATRIX_WEIGHT_DECAY_BY_DEPTH, d), 4) for d in (1, 4, 6, 7, 8, 10, 12, 16, 20, 32)] == \
        [0.8, 0.8, 0.8, 0.6, 0.4, 0.31, 0.22, 0.15, 0.08, 0.08]
    # AdamW: ours up to d8, none from d12
    assert [round(decay_by_depth(EMBEDDING_WEIGHT_DECAY_BY_DEPTH, d), 4) for d in (4, 6, 8, 10, 12, 20)] == \
        [0.2, 0.2, 0.2, 0.1, 0.0, 0.0]


def test_muon_momentum_schedule():
    assert muon_momentum(0) == pytest.approx(0.85)
    assert muon_momentum(150) == pytest.approx(0.90)
    assert muon_momentum(300) == pytest.approx(0.95)
    assert muon_momentum(10_000) == pytest.approx(0.95)
    # karpathy/nanochat's 2026 shape: up to 0.97, then down to 0.90 over the lr's warmdown (the last 50 of 100 steps)
    schedule = dict(end=0.97, final=0.90, num_iterations=100, warmdown_ratio=0.5, warmup_steps=40)
    momenta = [round(muon_momentum(s, **schedule), 4) for s in (0, 20, 40, 50, 75, 100)]
    assert momenta == [0.85, 0.91, 0.97, 0.97, 0.935, 0.9]


def test_evaluate_bpb_hand_computed():
    class Toy(torch.nn.Module):
        """Per-token loss = the target id (so the sums are easy to do by hand)."""
        def forward(self, x, y, loss_reduction="none"):
            return torch.where(y >= 0, y, 0).float().view(-1)
    token_bytes = torch.tensor([0, 1, 2, 3])  # token 0 is a special token: 0 bytes
    y = torch.tensor([[1, 2, 0, -1], [3, 3, 1, 2]])
    batches = iter([(y, y)])
    # counted targets: 1,2,3,3,1,2 (0 and -1 excluded); nats = 12, bytes = 12
    assert evaluate_bpb(Toy(), batches, 1, token_bytes) == pytest.approx(12 / (math.log(2) * 12))


def readme_quick_start():
    """The README's quick start: the lines of its code block after "A quick look at the whole pretraining flow"."""
    readme = open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8").read()
    block = readme.split("A quick look at the whole pretraining flow", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return block.strip().splitlines()


@pytest.mark.slow
def test_readme_quick_start_runs_in_minutes(isolated_env):
    """
    The Mac/CPU quick start of the README, its three commands exactly as written there (the pydocs corpus, a
    4,096-token tokenizer, 20 steps of a depth-4 model), in a fresh base dir; base_train's docstring gives the same
    base_train command. Its "minutes" are bounded in CPU time on this test process's share of the cores
    (helpers.CORES), which the machine's other load (other test processes, other users of a shared CI box) does not
    stretch the way it stretches the wall time: under 3 minutes of it.
    """
    lines = readme_quick_start()
    assert [line.split(" -m ")[1].split()[0] for line in lines] == ["nanochat.dataset", "scripts.tok_train",
                                                                  "scripts.base_train"]
    train_command = lines[-1].removeprefix("NANOCHAT_DATASET=pydocs ")
    docstring = open(os.path.join(REPO_ROOT, "scripts", "base_train.py"), encoding="utf-8").read()
    assert train_command in re.sub(r" *\\\n *", " ", docstring)  # a command split over lines by backslashes
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    for line in lines:
        variable, python, *args = line.split()
        assert variable == "NANOCHAT_DATASET=pydocs" and python == "python", line
        # a new interpreter, as the user's (not a fork of the tests' server), measuring the peak FLOP/s as the
        # user's does: its imports and that measurement count, and its CPU time is this process's child's
        # (RUSAGE_CHILDREN)
        result = run_script(*args, timeout=600, env={"NANOCHAT_DATASET": "pydocs", "OMP_NUM_THREADS": CORES,
                                                     "NANOCHAT_TEST_FORK": "0", "NANOCHAT_PEAK_FLOPS": None})
        assert result.returncode == 0, f"{line}\n{result.stderr}"
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.time() - t0
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert cpu < 180 * CORES, f"{cpu:.0f} s of CPU on {CORES} thread(s) ({wall:.0f} s wall)"
    assert "Model: depth 4 -> n_embd 256, 2 heads of 128, vocab 4,096, context 512" in result.stdout
    assert "step 00020/00020" in result.stdout and "validation bpb" in result.stdout
    losses = train_losses(isolated_env, "d4")
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5  # it learns


@pytest.mark.slow
def test_base_loss_and_report(trained_tokenizer, isolated_env, tmp_path):
    from nanochat.report import reset
    reset()
    assert base_train("--num_iterations=4").returncode == 0
    result = run_script("-m", "scripts.base_loss", "--device_batch_size=2", "--split_tokens=128")
    assert result.returncode == 0, result.stderr
    assert "train bpb:" in result.stdout and "val bpb:" in result.stdout
    section = (isolated_env / "report" / "base-model-loss.md").read_text()
    assert "- val bpb: " in section and "Samples (greedy)" in section
    out = tmp_path / "cwd"
    out.mkdir()
    result = run_script("-m", "nanochat.report", "generate", cwd=out)
    assert result.returncode == 0, result.stderr
    report = (out / "report.md").read_text()
    assert "# nanochat training report" in report and "Git commit" in report
    assert "| Base val bpb (min) |" in report and "| Base val bpb |" in report and "| Total wall time |" in report
    assert report.index("## Base model training") < report.index("## Base model loss")
    for png in ("report_base-model-training_loss.png", "report_base-model-training_val_bpb.png",
                "report_base-model-training_tok_per_sec.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png in report
