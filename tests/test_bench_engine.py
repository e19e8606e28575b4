"""bench/engine.py's plumbing on CPU, at a tiny size: every batch size's line, the bandwidth, the machine."""

import os
import re
import shutil
import subprocess
import sys

from helpers import REPO_ROOT


def test_the_decode_evaluation_prints_its_figures_per_batch_size(small_tokenizer_dir, tmp_path):
    shutil.copytree(small_tokenizer_dir, tmp_path / "tokenizer")
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(tmp_path))
    args = ["--depth=1", "--vocab_size=512", "--sequence_len=256", "--prompt_tokens=8", "--long_prompt_tokens=32",
            "--new_tokens=6", "--batch_sizes=1,3", "--threads=1", "--repeats=1", "--naive=False", "--bandwidth_mib=16",
            "--bandwidth_repeats=2"]
    result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", "engine.py"), *args], cwd=REPO_ROOT,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    bandwidth = re.search(r"memory bandwidth \(best sum of a 16 MiB tensor\): ([\d.]+) GB/s", out)
    assert bandwidth and float(bandwidth[1]) > 0, out
    for B in (1, 3):
        line = re.search(rf"engine B={B}: decode ([\d,]+) tok/s .*TPOT ([\d.]+) ms, reads ([\d.]+) GB/s = (\d+)% of "
                         rf"the bandwidth, peak RSS (\d+) MiB, TTFT ([\d.]+) ms", out)
        assert line, out
        assert float(line[2]) > 0 and float(line[6]) > 0 and int(line[5]) > 0
    assert "native bf16 flags:" in out and "| 1 thread | " in out
