"""
The fixtures of the tests (tests/helpers.py: what they share that is not a fixture).

Tests never touch the network or the user's ~/.cache: every test gets its own NANOCHAT_BASE_DIR, and downloads are
served by a local HTTP server on 127.0.0.1.
"""

import os

import pytest

from helpers import CORES, TASK_FIXTURES, TINY_MODELS, FileServer, build_once, run_script


def pytest_configure(config):
    """
    This process computes on its share of the cores (the scripts it runs: one thread each, see script_env). Every
    process of the session, and every run it starts:
    - gets MFU against a fixed peak FLOP/s (NANOCHAT_PEAK_FLOPS): on a CPU each training run measures it otherwise,
      ~4 s of CPU here. The measurement's tests remove it (test_hardware.py, test_base_train.py: the run that
      measures the hardware, and the README's quick start, run as a user runs it);
    - compiles in its own process (TORCHINDUCTOR_COMPILE_THREADS=1): torch.compile's default on 2 cores starts, in
      every process that compiles, a pool of new interpreters (each importing torch) to compile in parallel on a
      core the other test process keeps busy anyway (bench/RESULTS.md). The compiled code is the same.
    """
    import torch
    torch.set_num_threads(min(torch.get_num_threads(), CORES))
    os.environ["NANOCHAT_PEAK_FLOPS"] = "1e11"
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"


def pytest_collection_modifyitems(config, items):
    """
    The slow tests first in each test process's share. pytest-xdist's worksteal hands each of its N processes a
    contiguous Nth of the items, and cannot steal from a process down to its last two: sorted slow-first alone, the
    first process got every long run, and the suite ended on it while the other sat idle. So the slow tests are dealt
    out in turn, each share starting with its own, the short tests filling the shares to xdist's sizes. Order kept
    within each group; the same order in every process, as xdist requires.
    """
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    slow = [item for item in items if item.get_closest_marker("slow")]
    fast = [item for item in items if not item.get_closest_marker("slow")]
    sizes = [(k + 1) * len(items) // n - k * len(items) // n for k in range(n)]  # xdist's split
    shares = [slow[k::n] for k in range(n)]
    if any(len(share) > size for share, size in zip(shares, sizes)):  # more slow tests than a share holds
        items[:] = slow + fast
        return
    items[:] = []
    for share, size in zip(shares, sizes):
        items += share + fast[:size - len(share)]
        fast = fast[size - len(share):]


@pytest.fixture(autouse=True)
def isolated_env(tmp_path, monkeypatch):
    """Fresh base dir per test, offline wandb, no inherited torchrun variables, no colors."""
    base = tmp_path / "nanochat_base"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("NO_COLOR", "1")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    return base


@pytest.fixture
def file_server(tmp_path):
    root = tmp_path / "served"
    root.mkdir()
    server = FileServer(root)
    yield server
    server.close()


@pytest.fixture
def hub(file_server, monkeypatch):
    """
    The task fixtures of every hub repo of tasks/registry.py, served at "{url}/datasets/{repo}/resolve/main/{path}"
    like the Hugging Face hub (NANOCHAT_HF_URL points at it). Its `requests` count what the loaders downloaded.
    """
    import shutil

    from tasks.registry import hub_repos
    for repo in hub_repos():
        fixtures = os.path.join(TASK_FIXTURES, repo)
        if os.path.isdir(fixtures):  # a repo without fixtures is not served: its downloads fail
            shutil.copytree(fixtures, os.path.join(file_server.root, "datasets", repo, "resolve", "main"))
    monkeypatch.setenv("NANOCHAT_HF_URL", file_server.url)
    return file_server


# ---------------------------------------------------------------------------------------------
# What the tests build once per session: the pydocs corpus, a small tokenizer, tiny trained models


@pytest.fixture(scope="session")
def pydocs_dir(tmp_path_factory):
    """
    The pydocs corpus (nanochat.corpus_build.build_pydocs), built once per test session (~5-7 s on 2 cores) into
    a shared temporary base dir. Returns that corpus directory (`<shared base>/base_data/pydocs`).
    Treat it as read-only; tests get a private copy through `pydocs_corpus`.
    """
    from nanochat import pydocs
    from nanochat.dataset import build_pydocs

    def build(base):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("NANOCHAT_BASE_DIR", str(base))
            pydocs._pydocs_entries_cached.cache_clear()  # so that the records are kept in this base dir too
            assert build_pydocs() == str(base / "base_data" / "pydocs")
    return str(build_once(tmp_path_factory, "pydocs_base", build) / "base_data" / "pydocs")


@pytest.fixture
def pydocs_corpus(pydocs_dir, isolated_env, monkeypatch):
    """
    Select the pydocs corpus for this test: copies the session's build into this test's NANOCHAT_BASE_DIR
    (`base_data/pydocs`, ~1 MB, milliseconds) and sets NANOCHAT_DATASET=pydocs, so list_parquet_files, the
    tokenizer and the dataloader (and subprocesses such as run_torchrun, which inherit the environment)
    read it with no build and no download. A copy, not a symlink: a test may damage its shards freely.
    Returns the corpus directory.
    """
    import shutil
    target = isolated_env / "base_data" / "pydocs"
    shutil.copytree(pydocs_dir, target)
    copy_pydocs_entries(pydocs_dir, isolated_env)
    monkeypatch.setenv("NANOCHAT_DATASET", "pydocs")
    return str(target)


def copy_pydocs_entries(pydocs_dir, base):
    """
    The records the corpus build collected (<base_dir>/pydocs_entries.json, nanochat/pydocs.py) into `base` too,
    as a user's base dir holds them after its first build: without them each rank of each chat stage a test runs
    would parse the standard library again (~4 s of a core).
    """
    import shutil
    shutil.copy(os.path.join(os.path.dirname(os.path.dirname(pydocs_dir)), "pydocs_entries.json"), base)


@pytest.fixture(scope="session")
def small_tokenizer_dir(pydocs_dir, tmp_path_factory):
    """
    A 512-token tokenizer trained once per session on the pydocs training shards (the real tok_train path's
    Tokenizer, not a stub). Returns its directory; tests get a private copy through `trained_tokenizer`.
    """
    import pyarrow.parquet as pq

    from nanochat.tokenizer import Tokenizer

    def build(out):
        texts = []
        # the last shard is validation
        for name in sorted(n for n in os.listdir(pydocs_dir) if n.startswith("shard_"))[:-1]:
            texts += pq.read_table(os.path.join(pydocs_dir, name), columns=["text"]).column("text").to_pylist()
        Tokenizer.train_from_iterator(iter(texts[:2000]), 512).save(str(out))
    return build_once(tmp_path_factory, "tokenizer", build)


@pytest.fixture
def trained_tokenizer(pydocs_corpus, small_tokenizer_dir, isolated_env):
    """pydocs corpus + the session's small tokenizer in this test's base dir: ready for base_train."""
    import shutil
    shutil.copytree(small_tokenizer_dir, isolated_env / "tokenizer")
    return isolated_env / "tokenizer"




@pytest.fixture(scope="session")
def tiny_models(pydocs_dir, small_tokenizer_dir, tmp_path_factory):
    """
    tiny_models(name): the base dir of TINY_MODELS[name], trained once per session (see build_once). Read-only:
    a test that writes gets its own copy through `tiny_model`.
    """
    import shutil

    def base_dir(name):
        parent, stage = TINY_MODELS[name]

        def build(target):
            if parent:
                shutil.copytree(base_dir(parent), target, ignore=shutil.ignore_patterns(".lock"))
            else:
                shutil.copytree(pydocs_dir, target / "base_data" / "pydocs")
                shutil.copytree(small_tokenizer_dir, target / "tokenizer")
                copy_pydocs_entries(pydocs_dir, target)
            env = {"NANOCHAT_BASE_DIR": target, "NANOCHAT_DATASET": "pydocs", "WANDB_MODE": "offline",
                   **dict.fromkeys(("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                    "MASTER_PORT"))}
            result = run_script(*stage, env=env, timeout=600)
            assert result.returncode == 0, f"tiny model {name}: {result.stderr[-3000:]}"
        return build_once(tmp_path_factory, f"model_{name}", build)
    return base_dir


@pytest.fixture
def tiny_model(tiny_models, isolated_env, monkeypatch):
    """
    tiny_model(name): this test's own copy of the session's tiny model `name` (corpus, tokenizer, checkpoints) as
    its NANOCHAT_BASE_DIR, with NANOCHAT_DATASET=pydocs. Returns the base dir.
    """
    import shutil

    def use(name):
        shutil.copytree(tiny_models(name), isolated_env, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".lock"))
        monkeypatch.setenv("NANOCHAT_DATASET", "pydocs")
        return isolated_env
    return use
