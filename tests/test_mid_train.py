"""
Midtraining (scripts/mid_train) end to end on CPU from the session's tiny base model; the CPU speedrun's
smoke: tests/test_rerun.py.

The offline mixture, per-rank batches, disjoint conversations across ranks, ranks with unequal data stopping
together, the held-out loss going down, SIGTERM and an exact resume (on the same number of processes only), steps
without targets (no update).
"""

import json
import os
import re

import pytest
import torch

from helpers import (assert_same_weights, check_steps_without_targets, run_script, run_signalled,
                     with_defaults)

pytestmark = pytest.mark.slow  # every test here runs mid_train or the pipeline

MID = ["-m", "scripts.mid_train", "--mixture=offline", "--max_seq_len=64", "--device_batch_size=2", "--eval_tokens=512",
       "--total_batch_size=256", "--eval_every=-1"]


@pytest.fixture
def base_model(tiny_model):
    """This test's copy of the session's tiny base model (depth 1, context 64), with the pydocs corpus."""
    return tiny_model("base")


def mid(*args, nproc=1, timeout=300):
    return run_script(*MID, *args, nproc=nproc, timeout=timeout)


def step_losses(checkpoint_dir):
    rows = [json.loads(line) for line in (checkpoint_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step_loss"] for r in rows if "step_loss" in r]


def test_mid_train_writes_a_checkpoint_and_lowers_the_held_out_loss(base_model):
    result = mid("--num_iterations=30")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Tokens / micro-batch / rank: 2 x 64 = 128" in out and "gradient accumulation steps: 2" in out
    m = re.search(r"\[rank 0\] x, y = next\(train_loader\): x \(2, 64\) torch.int32, y \(2, 64\) torch.int64, "
                  r"(\d+)% of targets -1", out)
    assert m and int(m.group(1)) > 0, out  # masked targets are -1 (this first batch may even be all prompt)
    ckpt = base_model / "mid_checkpoints" / "d1"
    assert {"model_000030.pt", "optim_000030_rank0.pt", "meta_000030.json"} <= set(os.listdir(ckpt))
    m = re.search(r"Validation bpb: ([\d.]+) \(base model\) -> ([\d.]+) \(after 30 steps", out)
    before = float(m.group(1))
    after = float(m.group(2))
    assert after < before, (before, after)  # held-out offline-task conversations: better after midtraining
    section = (base_model / "report" / "midtraining.md").read_text()
    assert "- Validation bpb of the base model: " in section and "- Final validation bpb: " in section


def test_two_ranks_read_disjoint_conversations_and_stop_together(base_model):
    # 7 conversations: rank 0 reads 0, 2, 4, 6 and rank 1 reads 1, 3, 5, so rank 1 runs out first; if the ranks did
    # not agree on epoch_done (any_rank, in stage.stop_after_step) rank 0 would go on alone and wait forever in its
    # next collective (timeout here).
    result = mid("--max_conversations=7", nproc=2, timeout=240)
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr
    for r in range(2):
        assert re.search(rf"\[rank {r}\] x, y = next\(train_loader\): x \(2, 64\) torch.int32, "
                         r"y \(2, 64\) torch.int64", out)
    meta_path = next((base_model / "mid_checkpoints" / "d1").glob("meta_*.json"))
    meta = json.loads(meta_path.read_text())
    # what each rank read, as the end of the run reports it (gathered on rank 0)
    data = {int(m.group(1)): {"read": int(m.group(2)), "first": json.loads(m.group(3))}
            for m in re.finditer(r"rank (\d): read (\d+) training conversations \(first: (\[[\d, ]*\])\)",
                                 result.stdout)}
    assert sorted(data) == [0, 1], result.stdout
    for r, share in ((0, [0, 2, 4, 6]), (1, [1, 3, 5])):
        expected = share + [c - 7 for c in (8, 10, 12)] if r == 0 else share + [0, 2, 4, 6]  # after the wrap-around
        assert data[r]["first"] == expected[:len(data[r]["first"])] and data[r]["first"], (r, data[r])
    # one rank finished its share of the epoch (and set last_step); both ranks stopped at the same step
    assert data[0]["read"] >= 4 or data[1]["read"] >= 3
    assert "gradient accumulation steps: 1" in result.stdout
    assert os.path.exists(meta_path.parent / f"optim_{meta['step']:06d}_rank1.pt")  # every rank's optimizer shard


def test_sigterm_then_resume_equals_the_uninterrupted_run(base_model):
    ckpt = base_model / "mid_checkpoints" / "d1"
    steps = 8
    # the SIGTERM from inside the write of step 3's line (helpers.run_signalled: deterministic, where a handler that
    # printed crashed)
    result, _ = run_signalled("step 00003 (", "SIGTERM", *MID, f"--num_iterations={steps}")
    out = result.stdout + result.stderr
    assert result.returncode == 75 and "Traceback" not in out, out[-3000:]
    assert "got SIGTERM" in result.stderr and "--resume_from_step=4" in result.stdout
    stopped = json.loads(max(ckpt.glob("meta_*.json")).read_text())["step"]
    assert stopped == 4  # step 3's line is printed after its stop check: step 4 runs, is saved, the stage stops
    resumed = mid(f"--num_iterations={steps}", f"--resume_from_step={stopped}")
    assert resumed.returncode == 0, resumed.stderr
    interrupted_losses = step_losses(ckpt)
    interrupted_weights = torch.load(ckpt / f"model_{steps:06d}.pt")
    # the save of the run stopped early was only a place to resume from: the final save replaced it
    assert sorted(int(m.stem[-6:]) for m in ckpt.glob("meta_*.json")) == [steps]
    # a world size other than the checkpoint's changes which conversations each rank reads: refused
    two = mid(f"--num_iterations={steps}", f"--resume_from_step={steps}", nproc=2)
    assert two.returncode != 0 and "was trained with world_size=1, this run has world_size=2" in two.stderr
    full = mid(f"--num_iterations={steps}", "--overwrite")
    assert full.returncode == 0, full.stderr
    full_losses = step_losses(ckpt)
    assert len(full_losses) == steps and interrupted_losses == pytest.approx(full_losses, rel=1e-6)
    assert_same_weights(interrupted_weights, torch.load(ckpt / f"model_{steps:06d}.pt"), rtol=1e-6, atol=0)


def test_steps_without_targets_change_nothing(base_model):
    """
    Rows of 32 tokens, one per step: many hold only user turns (0 targets). Such a step updates nothing (the weights
    and every optimizer state stay bit for bit, also after steps that learned, where AdamW's momentum would move
    them), its loss stays out of the EMA and the metrics, and the run counts it (chat_sft: test_chat_finetune).
    """
    ckpt = base_model / "mid_checkpoints" / "d1"
    args = ["--max_seq_len=32", "--device_batch_size=1", "--total_batch_size=32", "--num_iterations=14",
            "--save_every=1"]
    result = run_script(*with_defaults(MID, args))
    assert result.returncode == 0, result.stderr[-3000:]
    _, skipped, _ = check_steps_without_targets(result, ckpt, 14)
    section = (base_model / "report" / "midtraining.md").read_text()
    assert f"- Steps without targets (skipped): {len(skipped)}\n" in section
