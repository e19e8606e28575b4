"""
What every script needs first: compute_init (nanochat/processes.py), errors, logging and print0 (output.py), the
base directory (files.py), downloads (downloads.py), ranks agreeing (ranks.py).
"""

import hashlib
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import run_script, start_script
from nanochat import output
from nanochat.downloads import download_file_with_lock
from nanochat.files import get_base_dir
from nanochat.output import ColoredFormatter, UserError, print0
from nanochat.processes import compute_init, get_dist_info
from nanochat.ranks import any_rank, gather_from_ranks, per_rank, sum_over_ranks


# ---------------------------------------------------------------------------------------------
# compute_init / distributed environment


def test_compute_init_plain_process(capsys):
    assert compute_init("cpu") == (False, 0, 0, 1, torch.device("cpu"))
    out = capsys.readouterr().out
    assert "rank  local_rank  world_size  device  host" in out  # the topology table
    assert "ddp=False" in out


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_compute_init_keeps_freed_memory_on_a_cpu():
    # glibc maps a block above its largest threshold (32 MiB) on its own and unmaps it when freed, and trims the
    # heap's free top: each such tensor comes back as fresh pages. After compute_init("cpu") the same tensor comes
    # from the heap and its memory stays there when freed (docs/hardware.md, "Freed memory on a CPU").
    code = """
import ctypes, torch
from nanochat.processes import compute_init
class MallInfo(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int)
                for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo.restype = MallInfo
def tensor_made_and_freed():
    t = torch.ones(16 * 2**20)  # 64 MiB
    mapped = libc.mallinfo().hblkhd
    del t
    return mapped // 2**20, libc.mallinfo().arena // 2**20  # MiB in blocks of their own; MiB of heap after freeing it
print("freed", *tensor_made_and_freed())
compute_init("cpu")
print("freed", *tensor_made_and_freed())
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    (mapped_before, _), (mapped_after, heap_after) = [map(int, line.split()[1:]) for line in result.stdout.splitlines()
                                                      if line.startswith("freed")]
    assert mapped_before >= 64 and mapped_after < 64 and heap_after >= 64, result.stdout


def test_compute_init_two_processes_over_gloo(tmp_path):
    result = run_script("tests/dist_common_worker.py", tmp_path / "out", nproc=2)
    assert result.returncode == 0, result.stderr
    infos = [json.load(open(tmp_path / f"out.rank{r}.json")) for r in range(2)]
    for r, info in enumerate(infos):
        assert (info["ddp"], info["rank"], info["local_rank"], info["world_size"]) == (True, r, r, 2)
        assert info["device"] == "cpu" and info["backend"] == "gloo"
        assert info["rank_sum"] == 1.0  # 0 + 1: the all_reduce went through
        assert info["same_init"]
    # rank 0 printed one topology table with a row per rank; nobody else printed it
    assert result.stdout.count("rank  local_rank  world_size  device") == 1
    assert result.stdout.count(" cpu ") >= 2


def test_two_nodes_rank_differs_from_local_rank_and_share_rank_0s_compute_dtype(tmp_path):
    """
    Two 'machines' (two torchrun launchers, one process each): on node 1, RANK=1 but LOCAL_RANK=0. The compute
    dtype is one decision for the run, rank 0's: node 1, told otherwise by its own NANOCHAT_DTYPE, computes in rank
    0's dtype too (machines that decided apart could compute in different dtypes).
    """
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [start_script("-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={n}", "--nproc_per_node=1",
                          "--master_addr=127.0.0.1", f"--master_port={port}", "tests/dist_common_worker.py",
                          tmp_path / "out",
                          env={"NANOCHAT_DTYPE": ("bfloat16", "float32")[n]},
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    infos = [json.load(open(tmp_path / f"out.rank{r}.json")) for r in range(2)]
    assert [(i["rank"], i["local_rank"], i["world_size"]) for i in infos] == [(0, 0, 2), (1, 0, 2)]
    assert [i["compute_dtype"] for i in infos] == [["torch.bfloat16", "NANOCHAT_DTYPE=bfloat16"]] * 2


def test_incomplete_torchrun_env_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="LOCAL_RANK not set"):
        get_dist_info()
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(UserError, match="inconsistent"):
        get_dist_info()


def test_incomplete_env_in_a_script_prints_one_line(tmp_path):
    result = run_script("-c", "from nanochat.processes import compute_init; compute_init('cpu')",
                        env={"RANK": "0", "LOCAL_RANK": None})
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: distributed launch is incomplete"), result.stderr


def test_out_of_memory_in_a_script_prints_one_line_that_says_what_to_lower():
    # torch's OutOfMemoryError (a GPU's; raised here as the allocator raises it): a size to change, not a traceback
    code = ("from nanochat.output import setup_default_logging; import torch; setup_default_logging(); raise "
            "torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "79.19 GiB of which 1.03 GiB is free.\\nIncluding non-PyTorch memory...')")
    result = run_script("-c", code, env={"RANK": "1", "WORLD_SIZE": "8"})
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "[rank 1] error: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB): lower --device_batch_size",
    ], result.stderr


def test_torchrun_on_mps_is_refused(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    for var, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(var, value)
    with pytest.raises(UserError, match="torchrun is not supported on MPS"):
        compute_init("mps")


def test_unavailable_device_is_refused():
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA device"):
            compute_init("cuda")
    with pytest.raises(UserError, match="unknown device_type"):
        compute_init("tpu")


# ---------------------------------------------------------------------------------------------
# logging and output


def test_importing_nanochat_leaves_root_logger_alone():
    code = (
        "import logging\n"
        "root = logging.getLogger(); before = (list(root.handlers), root.level)\n"
        "import nanochat.output, nanochat.files, nanochat.downloads, nanochat.processes, nanochat.ranks\n"
        "import nanochat.interrupt, nanochat.configurator, nanochat.gpt, nanochat.checkpoint_manager, nanochat.report\n"
        "assert (list(root.handlers), root.level) == before, 'import changed the root logger'\n"
        "assert [type(h) for h in logging.getLogger('nanochat').handlers] == [logging.NullHandler]\n"
        "nanochat.output.setup_default_logging()\n"
        "assert (list(root.handlers), root.level) == before, 'setup_default_logging changed the root logger'\n"
        "assert logging.getLogger('nanochat').handlers\n"
    )
    result = run_script("-c", code)
    assert result.returncode == 0, result.stderr


def test_colored_formatter_highlights_figures():
    record = logging.LogRecord("nanochat.dataset", logging.INFO, __file__, 1,
                               "Downloaded Shard 3 (95.2 MB), %d%% done, 1,024 docs", (45,), None)
    colored = ColoredFormatter(color=True).format(record)
    assert "\033[1mShard 3\033[0m" in colored
    assert "\033[1m95.2 MB\033[0m" in colored and "\033[1m45%\033[0m" in colored
    assert "\033[1m1,024 docs\033[0m" in colored
    assert "\033[32m\033[1mINFO" in colored  # INFO in green bold
    plain = ColoredFormatter(color=False).format(record)
    assert "\033" not in plain and plain.endswith("INFO - Downloaded Shard 3 (95.2 MB), 45% done, 1,024 docs")
    # the record itself is untouched, so other handlers still see plain text
    assert record.getMessage() == "Downloaded Shard 3 (95.2 MB), 45% done, 1,024 docs"


def test_no_color_and_non_tty_disable_colors(monkeypatch):
    class FakeTTY:
        def isatty(self):
            return True
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert output._use_color(FakeTTY())
    monkeypatch.setenv("NO_COLOR", "")
    assert not output._use_color(FakeTTY())
    monkeypatch.delenv("NO_COLOR")
    assert not output._use_color(open(os.devnull, "w"))


def test_print0_only_on_rank_zero(monkeypatch, capsys):
    print0("hello")
    monkeypatch.setenv("RANK", "1")
    print0("from rank 1")
    assert capsys.readouterr().out == "hello\n"


def test_base_dir_from_env_created_on_demand(isolated_env):
    assert not isolated_env.exists()
    assert get_base_dir() == str(isolated_env) and isolated_env.is_dir()


# ---------------------------------------------------------------------------------------------
# download_file_with_lock (against a local HTTP server; no internet)


def _payload(n=300_000):
    return bytes((i * 7919) % 251 for i in range(n))


def test_concurrent_callers_download_once(file_server):
    data = _payload()
    open(os.path.join(file_server.root, "f.bin"), "wb").write(data)
    file_server.slow_paths["/f.bin"] = 0.05  # slow enough that all callers arrive while it downloads
    code = ("from nanochat.downloads import download_file_with_lock; "
            f"print(download_file_with_lock('{file_server.url}/f.bin', 'dl/f.bin'))")
    procs = [start_script("-c", code, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outputs]
    paths = [out.strip().splitlines()[-1] for out, _ in outputs]
    assert len(set(paths)) == 1 and open(paths[0], "rb").read() == data
    assert file_server.requests["/f.bin"] == 1


def test_download_killed_with_sigkill_leaves_nothing_then_completes(file_server, isolated_env):
    data = _payload(2_000_000)
    open(os.path.join(file_server.root, "big.bin"), "wb").write(data)
    file_server.slow_paths["/big.bin"] = 0.05
    final = isolated_env / "dl" / "big.bin"
    code = ("from nanochat.downloads import download_file_with_lock; "
            f"download_file_with_lock('{file_server.url}/big.bin', 'dl/big.bin')")
    proc = start_script("-c", code)
    deadline = time.time() + 60
    while time.time() < deadline:  # wait until it is midway: a temp file with some bytes in it
        tmps = list((isolated_env / "dl").glob("big.bin.tmp*")) if (isolated_env / "dl").exists() else []
        if tmps and tmps[0].stat().st_size > 200_000:
            break
        time.sleep(0.05)
    else:
        pytest.fail("download never started")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not final.exists()
    file_server.slow_paths.clear()
    path = download_file_with_lock(f"{file_server.url}/big.bin", "dl/big.bin")
    assert path == str(final) and final.read_bytes() == data
    assert not list((isolated_env / "dl").glob("big.bin.tmp*"))  # the dead process's temp file is gone


def test_download_retries_then_checks_sha256(file_server):
    data = _payload(1000)
    open(os.path.join(file_server.root, "r.bin"), "wb").write(data)
    file_server.fail_first["/r.bin"] = 2
    path = download_file_with_lock(f"{file_server.url}/r.bin", "r.bin", backoff=0.01,
                                   expected_sha256=hashlib.sha256(data).hexdigest())
    assert open(path, "rb").read() == data and file_server.requests["/r.bin"] == 3
    with pytest.raises(UserError, match="sha256 mismatch"):
        download_file_with_lock(f"{file_server.url}/r.bin", "r2.bin", backoff=0.01, retries=2, expected_sha256="0" * 64)
    assert not os.path.exists(os.path.join(get_base_dir(), "r2.bin"))


def test_download_missing_file_fails_fast(file_server):
    with pytest.raises(UserError, match="could not download"):
        download_file_with_lock(f"{file_server.url}/nope.bin", "nope.bin", backoff=0.01)
    assert file_server.requests["/nope.bin"] == 1  # a 404 is not retried


def test_postprocess_runs_before_the_file_appears(file_server):
    open(os.path.join(file_server.root, "p.txt"), "w").write("abc")
    seen = []

    def post(path):
        seen.append((path, open(path).read(), os.path.exists(os.path.join(get_base_dir(), "p.txt"))))

    path = download_file_with_lock(f"{file_server.url}/p.txt", "p.txt", postprocess_fn=post)
    assert seen and seen[0][1] == "abc" and seen[0][2] is False and seen[0][0] != path


def test_rank_agreement_in_one_process():
    assert any_rank(False, True) == (False, True)
    assert per_rank(2.5) == [2.5] and sum_over_ranks(1, 2.5) == (1.0, 2.5) and gather_from_ranks({"a": 1}) == [{"a": 1}]
