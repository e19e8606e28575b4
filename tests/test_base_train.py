"""
scripts/base_train end to end on CPU, on a tiny model: checkpoints, errors, the 2-rank == 1-rank-with-
accumulation property, exact resume, SIGTERM. Plus the schedules and evaluate_bpb.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO_ROOT, run_torchrun
from nanochat.loss_eval import evaluate_bpb
from nanochat.schedules import lr_multiplier, muon_momentum

TINY = ["--depth=1", "--max_seq_len=32", "--device_batch_size=2", "--total_batch_size=128", "--eval_tokens=128",
        "--sample_every=-1", "--core_metric_every=-1", "--eval_every=3"]


def with_defaults(defaults, args):
    """defaults + args, an arg replacing the default of the same key (a key given twice is an error)."""
    given = {a.split("=", 1)[0] for a in args}
    return [a for a in defaults if a.split("=", 1)[0] not in given] + list(args)


def base_train(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "scripts.base_train", *with_defaults(TINY, args)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


def metrics(base_dir, tag="d1"):
    with open(base_dir / "base_checkpoints" / tag / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def train_losses(base_dir, tag="d1"):
    return [m["step_loss"] for m in metrics(base_dir, tag) if "step_loss" in m]


def weights(base_dir, step, tag="d1"):
    return torch.load(base_dir / "base_checkpoints" / tag / f"model_{step:06d}.pt", map_location="cpu")


def assert_same_weights(a, b, rtol, atol):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=rtol, atol=atol), (k, (a[k] - b[k]).abs().max().item())


def test_trains_and_writes_a_checkpoint(trained_tokenizer, isolated_env, tmp_path, monkeypatch):
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


def test_help_and_one_line_errors(trained_tokenizer):
    result = subprocess.run([sys.executable, "-m", "scripts.base_train", "--help"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0
    for key in ("--depth", "--device_batch_size", "--total_batch_size", "--resume_from_step", "--compile"):
        assert key in result.stdout
    bad_key = base_train("--dpeth=2")
    assert bad_key.returncode == 1
    assert bad_key.stderr.strip().splitlines() == [
        "error: unknown config key 'dpeth' (did you mean --depth?); run with --help to list every key"]
    bad_batch = base_train("--total_batch_size=100", "--num_iterations=2")
    assert bad_batch.returncode == 1
    lines = bad_batch.stderr.strip().splitlines()
    assert len(lines) == 1, bad_batch.stderr
    assert "total_batch_size 100 is not a multiple of device_batch_size x max_seq_len x world_size = 2 x 32 x 1 = 64" in lines[0]
    assert "--total_batch_size=64 or --total_batch_size=128" in lines[0]


# The two properties below hold in both compute dtypes (nanochat/hardware.py). 2 ranks == 1 rank with accumulation,
# within: fp32, the losses to rel 1e-5 and every weight to rtol 1e-4 / atol 1e-5 (only the order of the gradient sums
# differs). bf16, the losses to rel 1e-4 and the RMS of each weight's difference to 6e-4 (measured: <= 2.6e-4; one
# Muon step moves a weight of this model by an RMS of ~2.5e-3): a last-bit difference of an fp32 weight can round
# it to another bf16 number in the next forward, a 2^-8 difference of a product, which Newton-Schulz in bf16 and
# Adam's per-entry scaling (an entry of a rare token's embedding moves by ~lr whatever its gradient's size) carry
# into the weights; so elementwise bounds would have to be as loose as ~0.02.
DDP_TOLERANCE = {"float32": dict(loss_rel=1e-5, rtol=1e-4, atol=1e-5), "bfloat16": dict(loss_rel=1e-4, rms=6e-4)}


@pytest.fixture(params=["float32", "bfloat16"])
def compute_dtype(request, monkeypatch):
    """Runs a test once per compute dtype (the scripts read $NANOCHAT_DTYPE); the start-up line must say it."""
    monkeypatch.setenv("NANOCHAT_DTYPE", request.param)
    if request.param == "bfloat16":  # a CPU without native bf16 would spend minutes measuring its bf16 peak
        monkeypatch.setenv("NANOCHAT_PEAK_FLOPS", "1e11")
    return request.param


def test_two_ranks_equal_one_rank_with_accumulation(trained_tokenizer, isolated_env, tmp_path, compute_dtype):
    tolerance = DDP_TOLERANCE[compute_dtype]
    single = base_train("--num_iterations=5", "--model_tag=single")
    assert single.returncode == 0, single.stderr
    assert f"Compute dtype: {compute_dtype} (NANOCHAT_DTYPE={compute_dtype}" in single.stdout
    single_losses = train_losses(isolated_env, "single")
    result = run_torchrun(2, ["-m", "scripts.base_train", *with_defaults(TINY, ["--num_iterations=5", "--model_tag=ddp"])])
    assert result.returncode == 0, result.stderr
    assert "gradient accumulation steps: 1" in result.stdout
    rows = [m for m in metrics(isolated_env, "ddp") if "step_loss" in m]
    for m in rows:  # the logged loss is the mean over ranks, and the ranks saw different data
        assert m["step_loss"] == pytest.approx(sum(m["rank_losses"]) / 2, abs=1e-6)
    assert all(m["rank_losses"][0] != m["rank_losses"][1] for m in rows[1:])  # (step 1: both exactly ln(vocab))
    # slot 0 / slot 1 of each step went to rank 0 / rank 1 instead of micro-steps 0 / 1: same losses, same weights
    assert [m["step_loss"] for m in rows] == pytest.approx(single_losses, rel=tolerance["loss_rel"])
    single_weights, ddp_weights = weights(isolated_env, 5, "single"), weights(isolated_env, 5, "ddp")
    if compute_dtype == "float32":
        assert_same_weights(single_weights, ddp_weights, rtol=tolerance["rtol"], atol=tolerance["atol"])
    else:
        for k, w in single_weights.items():
            assert (w - ddp_weights[k]).pow(2).mean().sqrt() < tolerance["rms"], k
    assert os.path.exists(isolated_env / "base_checkpoints" / "ddp" / "optim_000005_rank1.pt")


def test_resume_reproduces_the_uninterrupted_run(trained_tokenizer, isolated_env, compute_dtype):
    """Exact in either dtype: the resumed run does the same operations on the same numbers."""
    full = base_train("--num_iterations=6", "--model_tag=full")
    assert full.returncode == 0, full.stderr
    full_losses = train_losses(isolated_env, "full")
    first = base_train("--num_iterations=6", "--model_tag=resumed", "--save_every=3")
    assert first.returncode == 0, first.stderr
    # throw away what the first run did after step 3, as if it had died there
    ckpt = isolated_env / "base_checkpoints" / "resumed"
    for name in os.listdir(ckpt):
        if "000006" in name:
            os.remove(ckpt / name)
    second = base_train("--num_iterations=6", "--model_tag=resumed", "--resume_from_step=3")
    assert second.returncode == 0, second.stderr
    assert "Resumed from step 3" in second.stdout
    assert train_losses(isolated_env, "resumed") == pytest.approx(full_losses, rel=1e-6)
    assert_same_weights(weights(isolated_env, 6, "full"), weights(isolated_env, 6, "resumed"), rtol=1e-6, atol=0)


def test_sigterm_leaves_a_complete_resumable_checkpoint(trained_tokenizer, isolated_env):
    proc = subprocess.Popen([sys.executable, "-m", "scripts.base_train", *with_defaults(TINY, ["--num_iterations=100000", "--eval_every=-1"])],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    path = isolated_env / "base_checkpoints" / "d1" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (path.exists() and len(path.read_text().splitlines()) >= 3):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err  # EXIT_STOPPED_EARLY: not finished, so a pipeline stops here
    assert "got SIGTERM" in out + err and "--resume_from_step=" in out
    meta_files = [f for f in os.listdir(isolated_env / "base_checkpoints" / "d1") if f.startswith("meta_")]
    assert len(meta_files) == 1
    step = json.load(open(isolated_env / "base_checkpoints" / "d1" / meta_files[0]))["step"]
    assert 3 <= step < 100000
    resumed = base_train(f"--resume_from_step={step}", f"--num_iterations={step + 2}", "--eval_every=-1")
    assert resumed.returncode == 0, resumed.stderr
    assert f"step {step + 2:05d}/{step + 2:05d}" in resumed.stdout


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


def test_muon_momentum_schedule():
    assert muon_momentum(0) == pytest.approx(0.85)
    assert muon_momentum(150) == pytest.approx(0.90)
    assert muon_momentum(300) == pytest.approx(0.95)
    assert muon_momentum(10_000) == pytest.approx(0.95)


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


def test_readme_quick_start_runs_in_minutes(trained_tokenizer, isolated_env):
    """The Mac/CPU quick start of the README and of base_train's docstring, exactly as written there."""
    readme = open(os.path.join(REPO_ROOT, "README.md")).read()
    command = "python -m scripts.base_train --depth=4 --max_seq_len=512 --device_batch_size=1 --total_batch_size=512 --num_iterations=20"
    assert command in readme and command in open(os.path.join(REPO_ROOT, "scripts", "base_train.py")).read()
    t0 = time.time()
    result = subprocess.run([sys.executable, "-m", *command.split()[2:]], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=600, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert result.returncode == 0, result.stderr
    assert time.time() - t0 < 180
    assert "step 00020/00020" in result.stdout and "validation bpb" in result.stdout
    losses = train_losses(isolated_env, "d4")
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5  # it learns


def test_base_loss_and_report(trained_tokenizer, isolated_env, tmp_path):
    from nanochat.report import reset
    reset()
    assert base_train("--num_iterations=4").returncode == 0
    result = subprocess.run([sys.executable, "-m", "scripts.base_loss", "--device_batch_size=2", "--split_tokens=128"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "train bpb:" in result.stdout and "val bpb:" in result.stdout
    section = (isolated_env / "report" / "base-model-loss.md").read_text()
    assert "- val bpb: " in section and "Samples (greedy)" in section
    out = tmp_path / "cwd"
    out.mkdir()
    result = subprocess.run([sys.executable, "-m", "nanochat.report", "generate"], cwd=out, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    report = (out / "report.md").read_text()
    assert "# nanochat training report" in report and "Git commit" in report
    assert "| Base val bpb (min) |" in report and "| Base val bpb |" in report and "| Total wall time |" in report
    assert report.index("## Base model training") < report.index("## Base model loss")
    for png in ("report_base-model-training_loss.png", "report_base-model-training_val_bpb.png",
                "report_base-model-training_tok_per_sec.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png in report
