"""
bench/engine.py's plumbing on CPU, at a tiny size: every batch size's line, the bandwidth, the machine; with the
compiled step; and karpathy/nanochat HEAD's Engine beside ours in one table (HEAD's code from the clone that
NANOCHAT_HEAD_REPO names: helpers.head_checkout; skipped without it).
"""

import os
import re
import shutil

import pytest

from helpers import HEAD_COMMIT, REPO_ROOT, head_checkout, run_script

TINY = ["--depth=1", "--vocab_size=512", "--sequence_len=256", "--prompt_tokens=8", "--long_prompt_tokens=32",
        "--new_tokens=6", "--threads=1", "--repeats=1", "--naive=False", "--bandwidth_mib=16",
        "--bandwidth_repeats=2"]


def bench_engine(small_tokenizer_dir, tmp_path, *extra, batch_sizes=(1, 3)):
    shutil.copytree(small_tokenizer_dir, tmp_path / "tokenizer")
    result = run_script(os.path.join(REPO_ROOT, "bench", "engine.py"), *TINY,
                        f"--batch_sizes={','.join(map(str, batch_sizes))}", *extra, timeout=600,
                        env={"NANOCHAT_BASE_DIR": tmp_path, "OMP_NUM_THREADS": None})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize("compiled", [False, True])
def test_the_decode_evaluation_prints_its_figures_per_batch_size(small_tokenizer_dir, tmp_path, compiled):
    # compiled: one batch size, as each compiles a step of its own (the compiled step's arithmetic:
    # tests/test_compiled_decode.py)
    batch_sizes = (1,) if compiled else (1, 3)
    out = bench_engine(small_tokenizer_dir, tmp_path, f"--compile_decode={compiled}", batch_sizes=batch_sizes)
    bandwidth = re.search(r"memory bandwidth \(best sum of a 16 MiB tensor\): ([\d.]+) GB/s", out)
    assert bandwidth and float(bandwidth[1]) > 0, out
    assert f"decode step {'compiled' if compiled else 'eager'}" in out
    for B in batch_sizes:
        line = re.search(rf"engine B={B}: decode ([\d,]+) tok/s .*TPOT ([\d.]+) ms, reads ([\d.]+) GB/s = (\d+)% of "
                         rf"the bandwidth, peak RSS (\d+) MiB, TTFT ([\d.]+) ms", out)
        assert line, out
        assert float(line[2]) > 0 and float(line[6]) > 0 and int(line[5]) > 0
        assert (f"[compile] B={B}: the first 4 steps (compiling a shape not seen yet) took" in out) == compiled
    assert "native bf16 flags:" in out and "| 1 thread | " in out


def test_heads_engine_beside_ours_in_one_table(small_tokenizer_dir, tmp_path):
    """HEAD's own GPT and Engine (bench/head_engine.py, in a process of its own) at the same sizes, one table."""
    head = head_checkout(tmp_path / "head")
    out = bench_engine(small_tokenizer_dir, tmp_path / "base", f"--head={head}")
    for B in (1, 3):  # HEAD's own lines, as its process printed them
        assert re.search(rf"^HEAD engine B={B}: decode [\d,]+ tok/s, TPOT [\d.]+ ms, TTFT [\d.]+ ms, peak memory \d+ "
                         rf"MiB$", out, re.M), out
    header = re.search(r"^\| engine, 1 thread \| B=1: TPOT / tok/s / TTFT / peak RSS \| B=3: .* \|$", out, re.M)
    assert header, out
    cell = r" ([\d.]+) ms / ([\d,]+) / ([\d.]+) ms / (\d+) MiB \|"
    ours = re.search(r"^\| ours \(eager step, (\w+)\) \|" + cell * 2 + "$", out, re.M)
    theirs = re.search(rf"^\| HEAD {HEAD_COMMIT} \((\w+), window pattern SSSL, SDPA fallback\) \|" + cell * 2 + "$",
                       out, re.M)
    assert ours and theirs, out
    assert ours[1] == theirs[1]  # one compute dtype for both
    assert all(float(m[i].replace(",", "")) > 0 for m in (ours, theirs) for i in range(2, 10))
    assert f"HEAD = karpathy/nanochat {HEAD_COMMIT}: its own GPT" in out
