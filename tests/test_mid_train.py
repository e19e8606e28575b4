"""
scripts/mid_train end to end on CPU from a tiny base checkpoint: the offline mixture, per-rank batches, disjoint
conversations across ranks, ranks with unequal data stopping together, and the held-out loss going down.
Also the reduced CPU speedrun, end to end.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, TINY_BASE, build_checkpoints, run_torchrun

MID = ["-m", "scripts.mid_train", "--mixture=offline", "--max_seq_len=64", "--device_batch_size=2", "--eval_tokens=512"]


@pytest.fixture(scope="module")
def base_checkpoint_dir(tmp_path_factory, small_tokenizer_dir, pydocs_dir):
    """A tiny base model (depth 1) trained once per module; tests copy it into their own base dir."""
    return build_checkpoints(tmp_path_factory.mktemp("mid_base"), pydocs_dir, small_tokenizer_dir,
                             [*TINY_BASE, "--max_seq_len=64", "--device_batch_size=4", "--total_batch_size=256",
                              "--num_iterations=30", "--eval_tokens=256"])


@pytest.fixture
def base_model(base_checkpoint_dir, pydocs_corpus, isolated_env):
    shutil.copytree(base_checkpoint_dir / "tokenizer", isolated_env / "tokenizer")
    shutil.copytree(base_checkpoint_dir / "base_checkpoints", isolated_env / "base_checkpoints")
    return isolated_env


def mid(*args, timeout=300):
    return subprocess.run([sys.executable, *MID, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_mid_train_writes_a_checkpoint_and_lowers_the_held_out_loss(base_model):
    result = mid("--total_batch_size=256", "--num_iterations=30", "--eval_every=-1")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Tokens / micro-batch / rank: 2 x 64 = 128" in out and "gradient accumulation steps: 2" in out
    m = re.search(r"\[rank 0\] x, y = next\(train_loader\): x \(2, 64\) torch.int32, y \(2, 64\) torch.int64, (\d+)% of targets -1", out)
    assert m and int(m.group(1)) > 0, out  # masked targets are -1 (this first batch may even be all prompt)
    ckpt = base_model / "mid_checkpoints" / "d1"
    assert {"model_000030.pt", "optim_000030_rank0.pt", "meta_000030.json"} <= set(os.listdir(ckpt))
    m = re.search(r"Validation bpb: ([\d.]+) \(base model\) -> ([\d.]+) \(after 30 steps", out)
    before, after = float(m.group(1)), float(m.group(2))
    assert after < before, (before, after)  # held-out offline-task conversations: better after midtraining
    section = (base_model / "report" / "midtraining.md").read_text()
    assert "- Validation bpb of the base model: " in section and "- Final validation bpb: " in section


def test_two_ranks_read_disjoint_conversations_and_stop_together(base_model):
    # 7 conversations: rank 0 reads 0, 2, 4, 6 and rank 1 reads 1, 3, 5, so rank 1 runs out first; without the
    # last_step all_reduce rank 0 would go on alone and wait forever in its next collective (timeout here).
    result = run_torchrun(2, [*MID, "--total_batch_size=256", "--max_conversations=7", "--eval_every=-1"], timeout=240)
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr
    for r in range(2):
        assert re.search(rf"\[rank {r}\] x, y = next\(train_loader\): x \(2, 64\) torch.int32, y \(2, 64\) torch.int64", out)
    meta_path = next((base_model / "mid_checkpoints" / "d1").glob("meta_*.json"))
    meta = json.loads(meta_path.read_text())
    # what each rank read, as the end of the run reports it (gathered on rank 0)
    data = {int(m.group(1)): {"read": int(m.group(2)), "first": json.loads(m.group(3))}
            for m in re.finditer(r"rank (\d): read (\d+) training conversations \(first: (\[[\d, ]*\])\)", result.stdout)}
    assert sorted(data) == [0, 1], result.stdout
    for r, share in ((0, [0, 2, 4, 6]), (1, [1, 3, 5])):
        expected = share + [c - 7 for c in (8, 10, 12)] if r == 0 else share + [0, 2, 4, 6]  # after the wrap-around
        assert data[r]["first"] == expected[:len(data[r]["first"])] and data[r]["first"], (r, data[r])
    # one rank finished its share of the epoch (and set last_step); both ranks stopped at the same step
    assert data[0]["read"] >= 4 or data[1]["read"] >= 3
    assert "gradient accumulation steps: 1" in result.stdout
    assert os.path.exists(meta_path.parent / f"optim_{meta['step']:06d}_rank1.pt")  # every rank's optimizer shard


def test_cpu_speedrun_smoke(isolated_env, tmp_path):
    """The cpu profile of speedrun.sh end to end, shrunk to seconds (NANOCHAT_SMOKE=1)."""
    env = dict(os.environ, NANOCHAT_PROFILE="cpu", NANOCHAT_SMOKE="1", NANOCHAT_SKIP_SETUP="1", OMP_NUM_THREADS="2",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    result = subprocess.run(["bash", os.path.join(REPO_ROOT, "speedrun.sh")], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = (isolated_env / "report" / "report.md").read_text()
    for section in ("## Tokenizer training", "## Tokenizer evaluation", "## Base model training", "## Base model loss",
                    "## Base model evaluation", "## Midtraining", "## Chat evaluation mid", "## Chat SFT",
                    "## Chat evaluation sft", "## Chat RL", "## Chat evaluation rl", "### Report card",
                    "| Tokenizer bytes/token (val) |", "| Chat val bpb, base model |", "| Chat val bpb, after midtraining |",
                    "| pydocs-CORE |", "| Offline ChatCORE |"):
        assert section in report, section
    assert "python -m scripts.chat_cli --source=rl" in result.stdout and "python -m scripts.chat_web --source=rl" in result.stdout
    assert os.path.exists(os.path.join(REPO_ROOT, "report.md"))  # speedrun copies the report to the repo root
