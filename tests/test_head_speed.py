"""
bench/head_speed.py's plumbing on CPU, at a tiny size.

Our scripts.base_train and karpathy/nanochat HEAD's (from the clone that NANOCHAT_HEAD_REPO names:
helpers.head_checkout; skipped without it) at a tiny size, with the table and the notes it prints. HEAD's
torch.compile is turned off (TORCHDYNAMO_DISABLE): its compile takes a minute here and the test is about the plumbing,
not the speed.
"""

import os
import re

import pytest

from helpers import CORES, HEAD_COMMIT, REPO_ROOT, head_checkout, run_script



def head_speed(*args, env=None):
    return run_script(os.path.join(REPO_ROOT, "bench", "head_speed.py"), *args, timeout=600,
                      env=dict(OMP_NUM_THREADS=CORES, **(env or {})))


def test_without_a_checkout_head_is_skipped_with_how_to_get_it(tmp_path):
    result = head_speed("--runs=speedrun,plain", "--engine=False", "--device_type=cpu", f"--base_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert "HEAD skipped: no --head=PATH given" in result.stdout
    assert "git clone https://github.com/karpathy/nanochat" in result.stdout


@pytest.mark.slow
def test_ours_and_head_in_one_table(tmp_path):
    head = head_checkout(tmp_path / "head")
    base = tmp_path / "bench"
    result = head_speed(f"--head={head}", "--depths=1", "--rows=1", "--max_seq_len=64", "--device_type=cpu",
                        "--steps=2", "--vocab_size=512", "--runs=ours,speedrun", "--engine=False", f"--base_dir={base}",
                        env={"TORCHDYNAMO_DISABLE": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    rows = re.findall(r"^\| (ours|HEAD)[^|]*\| 1 \| 1 \| ([\d,]+) \|", out, re.M)
    assert [r[0] for r in rows] == ["ours", "HEAD"] and all(int(r[1].replace(",", "")) > 0 for r in rows), out
    assert "--fp8 ignored (HEAD: not CUDA), SSSL, SDPA fallback, no FA3" in out  # as HEAD printed it
    assert f"HEAD = karpathy/nanochat {HEAD_COMMIT}" in out, out
    vocabs = re.findall(r"; vocab ([\d,]+);", out)
    assert len(vocabs) == 2 and vocabs[0] == vocabs[1], out  # both tokenizers from the same text and request
    assert "wandb: the real one" in out or "wandb: a STUB" in out
    # HEAD's corpus is our pydocs shards under its names; its tokenizer is a file its own tok_train wrote
    head_base = base / "head_v512"
    assert sorted(os.listdir(head_base / "base_data_climbmix")) == sorted(
        n for n in os.listdir(base / "ours_v512" / "base_data" / "pydocs") if n.endswith(".parquet"))
    assert {"tokenizer.pkl", "token_bytes.pt"} <= set(os.listdir(head_base / "tokenizer"))
    assert os.listdir(head_base / "base_checkpoints") == []  # its end-of-run save went to /dev/null, the rest deleted
