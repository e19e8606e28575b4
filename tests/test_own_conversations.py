"""
Conversations of your own (--conversations=FILE of mid_train and chat_sft, a CustomJSON file).

--mixture=custom midtrains and finetunes on the file alone, validating on its first max(1, n // 20) conversations;
with real or offline the file is one more task of that mixture; a custom mixture without a file, a missing file or
a file of fewer than 2 conversations is one line at start-up.
"""

import json
import os

import pytest

from helpers import REPO_ROOT, one_line_error, refusal_in_process, run_script
from tasks.registry import stage_mixture, stage_tasks

EXAMPLE = "docs/examples/conversations.jsonl"  # as a user types it, from the repository root (the scripts' cwd)
SIZES = ["--max_seq_len=64", "--device_batch_size=2", "--eval_every=-1"]
MID = ["-m", "scripts.mid_train", "--mixture=custom", f"--conversations={EXAMPLE}", *SIZES, "--total_batch_size=256",
       "--eval_tokens=256"]
SFT = ["-m", "scripts.chat_sft", "--mixture=custom", f"--conversations={EXAMPLE}", *SIZES, "--examples_per_step=4",
       "--eval_tokens=256"]


def write_conversations(path, n):
    """A CustomJSON file of n conversations, "question i" -> "answer i"."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps([{"role": "user", "content": f"question {i}"},
                                {"role": "assistant", "content": f"answer {i}"}]) + "\n")
    return str(path)


@pytest.mark.slow
def test_custom_mixture_midtrains_then_finetunes_on_the_file_alone(tiny_model):
    base = tiny_model("base")
    mid = run_script(*MID, "--num_iterations=3")
    assert mid.returncode == 0, mid.stderr[-3000:]
    # 12 conversations: the first max(1, 12 // 20) = 1 is validation, the other 11 are trained on
    assert "Mixture custom: 11 training conversations (of 11), 1 validation" in mid.stdout
    assert f"Your conversations ({EXAMPLE}): 11 training, 1 validation" in mid.stdout
    assert (base / "mid_checkpoints" / "d1" / "model_000003.pt").exists()
    assert f"Next: python -m scripts.chat_sft --mixture=custom --conversations={EXAMPLE}" in mid.stdout

    sft = run_script(*SFT, "--num_iterations=2")  # from that midtrained model (--source=mid, the default)
    assert sft.returncode == 0, sft.stderr[-3000:]
    assert "Mixture custom: 11 training conversations (of 11), 1 validation" in sft.stdout
    assert "validation bpb" in sft.stdout and "accuracy" not in sft.stdout  # no multiple-choice tasks to follow
    meta = json.loads((base / "chatsft_checkpoints" / "d1" / "meta_000002.json").read_text())
    assert meta["parent"]["source"] == "mid" and meta["data_settings"]["conversations"] == EXAMPLE


def test_each_refusal_is_one_line_at_start_up(tmp_path):
    one = write_conversations(tmp_path / "one.jsonl", 1)
    missing = str(tmp_path / "missing.jsonl")
    refusals = [(["--mixture=custom"], "--mixture=custom", "--conversations=PATH"),
                (["--mixture=offline", f"--conversations={missing}"], f"--conversations={missing}: no such file"),
                (["--mixture=custom", f"--conversations={one}"], f"--conversations={one} holds 1 conversation(s)",
                 "at least 2")]
    for args, *fragments in refusals:
        # as a user sees it: exit 1, one line, no traceback (before any model is loaded: no base model here)
        result = run_script("-m", "scripts.mid_train", *args)
        one_line_error(result, *fragments)
        assert "Traceback" not in result.stderr
        # chat_sft refuses the same settings with the same check (inside this process: no interpreter start-up)
        message = str(refusal_in_process("scripts.chat_sft", *args))
        assert "\n" not in message and all(fragment in message for fragment in fragments), message


def test_the_held_out_part_is_the_first_twentieth_of_the_file(tmp_path):
    path = write_conversations(tmp_path / "mine.jsonl", 45)
    val = stage_mixture("mid", "custom", "val", conversations=path)
    train = stage_mixture("sft", "custom", "train", conversations=path)
    questions = lambda task: [task[i]["messages"][0]["content"] for i in range(len(task))]
    assert questions(val) == ["question 0", "question 1"]  # max(1, 45 // 20) = 2
    assert questions(train) == [f"question {i}" for i in range(2, 45)]
    assert stage_tasks("sft", "custom", "metrics", conversations=path) == []  # free text: no accuracy to follow


def test_offline_mixture_plus_the_file(pydocs_corpus):
    path = os.path.join(REPO_ROOT, EXAMPLE)
    for stage in ("mid", "sft"):
        for part, own in (("train", 11), ("val", 1)):
            offline = stage_tasks(stage, "offline", part)
            both = stage_tasks(stage, "offline", part, conversations=path)
            assert [name for name, _ in both] == [name for name, _ in offline] + ["Conversations"], (stage, part)
            mixed = stage_mixture(stage, "offline", part, conversations=path)
            assert len(mixed) == sum(len(t) for _, t in offline) + own
