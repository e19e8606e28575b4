"""
Shared test fixtures. Tests never touch the network or the user's ~/.cache: every test gets its own
NANOCHAT_BASE_DIR, and downloads are served by a local HTTP server on 127.0.0.1.
"""

import contextlib
import http.server
import os
import signal
import sys
import threading
import time

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The cores of one test process: all of them, or its share under pytest-xdist. A test that runs a script on "every
# core", as a user would, gives it this many threads; more would only make the processes wait for each other.
CORES = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def pytest_configure(config):
    """This process computes on its share of the cores (the scripts it runs: one thread each, see script_env)."""
    import torch
    torch.set_num_threads(min(torch.get_num_threads(), CORES))


def pytest_collection_modifyitems(config, items):
    """The slow tests first (a stable sort): with several test processes, the long runs start at once and the short
    tests fill in around them, instead of one long run starting last while the other processes sit idle."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


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


class FileServer:
    """
    Serves files from `root` on 127.0.0.1:<port>. Counts requests per path. Knobs, settable per test:
      slow_paths: {path: seconds_per_64KB_chunk}  stream those files slowly (to kill a download midway)
      fail_first: {path: n}                        answer HTTP 500 to the first n requests of that path
    """

    def __init__(self, root):
        self.root = str(root)
        self.requests = {}
        self.slow_paths = {}
        self.fail_first = {}
        self.lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                path = self.path.split("?")[0]
                with server.lock:
                    server.requests[path] = server.requests.get(path, 0) + 1
                    count = server.requests[path]
                if count <= server.fail_first.get(path, 0):
                    self.send_error(500, "injected failure")
                    return
                local = os.path.join(server.root, path.lstrip("/"))
                if not os.path.isfile(local):
                    self.send_error(404)
                    return
                with open(local, "rb") as f:
                    data = f.read()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                delay = server.slow_paths.get(path)
                try:
                    for i in range(0, len(data), 65536):
                        self.wfile.write(data[i:i + 65536])
                        if delay:
                            self.wfile.flush()
                            time.sleep(delay)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def file_server(tmp_path):
    root = tmp_path / "served"
    root.mkdir()
    server = FileServer(root)
    yield server
    server.close()


# ---------------------------------------------------------------------------------------------
# Running a script: the one way the tests start a process


def script_command(args, nproc=1):
    """The argv of `args`: a .sh file runs under bash; anything else (-m module, a .py file, -c code) under this
    python, or under `torchrun --standalone --nproc_per_node=nproc` (CPU, gloo) when nproc > 1."""
    args = [str(a) for a in args]
    if args[0].endswith(".sh"):
        assert nproc == 1, "a shell script is not launched by torchrun"
        return ["bash", *args]
    if nproc == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


def script_env(env=None):
    """This test's environment (its NANOCHAT_BASE_DIR, offline wandb, ...) with one thread per process and this
    checkout first on PYTHONPATH (whatever the working directory), updated by `env` (a None value removes that
    variable)."""
    full = dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    for key, value in (env or {}).items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = str(value)
    return full


@contextlib.contextmanager
def computed_as_in_scripts():
    """
    Inside it, this process computes as the scripts it starts do: one thread (script_env) and the compute dtype
    (nanochat/hardware.py: bf16 autocast on a CPU with native bf16, else nothing). A test that predicts a script's
    numbers computes them in here: in bf16 a matmul's rounding depends on the thread count, in fp32 it does not.
    """
    import torch

    from nanochat.hardware import autocast_context
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with autocast_context("cpu")[1]:
            yield
    finally:
        torch.set_num_threads(threads)


def run_script(*args, nproc=1, env=None, timeout=300, cwd=REPO_ROOT, text=True, **kwargs):
    """Run a script the way a user does (see script_command), from the repo root, in script_env(env); stdout and
    stderr captured (as text, or bytes with text=False). Returns the CompletedProcess."""
    import subprocess
    return subprocess.run(script_command(args, nproc), cwd=cwd, env=script_env(env), capture_output=True, text=text,
                          timeout=timeout, **kwargs)


def start_script(*args, nproc=1, env=None, cwd=REPO_ROOT, **popen_kwargs):
    """run_script's Popen: the script started and left running (for signals, servers, interactive input)."""
    import subprocess
    return subprocess.Popen(script_command(args, nproc), cwd=cwd, env=script_env(env), **popen_kwargs)


def refusal_in_process(module, *args):
    """
    Run `python -m <module> <args>` inside this process, as far as its argument checks: returns the UserError it
    raises before doing any work (fails if it raises none, or gets to compute_init). A test of a refused value
    needs no process of its own, which costs 2-3 s of imports; subprocess tests prove that such an error is one
    line on stderr and exit status 1. The script's changes to the logging setup and sys.excepthook are undone.
    """
    import logging
    import runpy

    from nanochat import common
    logger = logging.getLogger("nanochat")
    saved = sys.argv, sys.excepthook, list(logger.handlers), logger.propagate, logger.level

    def no_work(*_, **__):
        raise AssertionError(f"{module} {' '.join(args)} started working instead of refusing its arguments")

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(common, "compute_init", no_work)
            sys.argv = [module, *args]
            runpy.run_module(module, run_name="__main__")
    except common.UserError as e:
        return e
    finally:
        sys.argv, sys.excepthook, logger.handlers[:], logger.propagate = saved[:4]
        logger.setLevel(saved[4])
    pytest.fail(f"{module} {' '.join(args)} refused nothing")


def stop_at(proc, marker, sig=signal.SIGTERM, to=None, timeout=300):
    """
    Read the output of `proc` (started with stdout=PIPE, stderr=STDOUT, text=True) until a line containing `marker`,
    send `sig` (to the process whose pid `to()` gives then, default proc itself), and wait for proc to end. Returns
    (all its output, seconds from the signal to its end). Fails if it ends before the marker or outlives `timeout`.
    """
    lines, deadline = [], time.time() + timeout
    for line in proc.stdout:
        lines.append(line)
        if marker in line:
            break
        assert time.time() < deadline, "".join(lines[-50:])
    else:
        pytest.fail(f"the process ended before {marker!r}: {''.join(lines[-50:])}")
    os.kill(to() if to else proc.pid, sig)
    signalled = time.time()
    lines += proc.stdout.readlines()
    proc.wait(timeout=timeout)
    return "".join(lines), time.time() - signalled


def wait_for_steps(path, n, proc, timeout=120):
    """Wait until the metrics file `path` of the training run `proc` logs `n` steps; fail if the run ends first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and sum('"step_loss"' in line for line in path.read_text().splitlines()) >= n:
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended early: {proc.communicate()[1][-2000:]}")
        time.sleep(0.1)
    pytest.fail("the run did not reach its steps in time")


def speedrun_env(**overrides):
    """The environment (for run_script's env) of speedrun.sh's cpu profile shrunk to seconds (NANOCHAT_SMOKE=1),
    with this python and no venv set-up; `overrides` such as BASE_STEPS=... on top."""
    return dict(NANOCHAT_PROFILE="cpu", NANOCHAT_SMOKE="1", NANOCHAT_SKIP_SETUP="1",
                PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], **overrides)


# The real task loaders' files (tests/fixtures/tasks/<owner>/<dataset>/...), in the published formats
TASK_FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "tasks")
TASK_REPOS = ("HuggingFaceTB/smol-smoltalk", "cais/mmlu", "openai/gsm8k", "allenai/ai2_arc", "openai/openai_humaneval")


@pytest.fixture
def hub(file_server, monkeypatch):
    """The task fixtures served at "{url}/datasets/{repo}/resolve/main/{path}", like the Hugging Face hub
    (NANOCHAT_HF_URL points at it). Its `requests` count what the loaders downloaded."""
    import shutil
    for repo in TASK_REPOS:
        shutil.copytree(os.path.join(TASK_FIXTURES, repo), os.path.join(file_server.root, "datasets", repo, "resolve", "main"))
    monkeypatch.setenv("NANOCHAT_HF_URL", file_server.url)
    return file_server


# ---------------------------------------------------------------------------------------------
# What the tests build once per session: the pydocs corpus, a small tokenizer, tiny trained models


def build_once(tmp_path_factory, name, build):
    """
    The directory `name` of this test session, made by build(path) (path does not exist yet) the first time a test
    asks for it. Under pytest-xdist the session's workers share it: the first one builds it under a file lock, the
    others wait and reuse it. A new session (a new base temp) always builds anew. Treat it as read-only.
    """
    import shutil

    from filelock import FileLock
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's base temp, one level above each worker's
    target, done = root / "built" / name, root / "built" / f"{name}.done"
    target.parent.mkdir(exist_ok=True)
    with FileLock(str(root / "built" / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(target, ignore_errors=True)  # what a failed attempt left
            build(target)
            done.touch()
    return target


@pytest.fixture(scope="session")
def pydocs_dir(tmp_path_factory):
    """
    The pydocs corpus (nanochat.pydocs.build_pydocs), built once per test session (~5-7 s on 2 cores) into
    a shared temporary base dir. Returns that corpus directory (`<shared base>/base_data/pydocs`).
    Treat it as read-only; tests get a private copy through `pydocs_corpus`.
    """
    from nanochat.dataset import build_pydocs

    def build(base):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("NANOCHAT_BASE_DIR", str(base))
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
    monkeypatch.setenv("NANOCHAT_DATASET", "pydocs")
    return str(target)


@pytest.fixture(scope="session")
def small_tokenizer_dir(pydocs_dir, tmp_path_factory):
    """A 512-token tokenizer trained once per session on the pydocs training shards (the real tok_train path's
    Tokenizer, not a stub). Returns its directory; tests get a private copy through `trained_tokenizer`."""
    import pyarrow.parquet as pq

    from nanochat.tokenizer import Tokenizer

    def build(out):
        texts = []
        for name in sorted(n for n in os.listdir(pydocs_dir) if n.startswith("shard_"))[:-1]:  # the last shard is validation
            texts += pq.read_table(os.path.join(pydocs_dir, name), columns=["text"]).column("text").to_pylist()
        Tokenizer.train_from_iterator(iter(texts[:2000]), 512).save(str(out))
    return build_once(tmp_path_factory, "tokenizer", build)


@pytest.fixture
def trained_tokenizer(pydocs_corpus, small_tokenizer_dir, isolated_env):
    """pydocs corpus + the session's small tokenizer in this test's base dir: ready for base_train."""
    import shutil
    shutil.copytree(small_tokenizer_dir, isolated_env / "tokenizer")
    return isolated_env / "tokenizer"




# The tiny models of the suite: {name: (the model it starts from, its stage's arguments)}. Depth 1, barely
# trained (~5 s each on 2 cores): for testing the machinery, not quality. A model's base dir holds the pydocs
# corpus, the small tokenizer, its checkpoints and those of the model it starts from.
TINY_SIZES = ["--max_seq_len=64", "--device_batch_size=4", "--total_batch_size=256", "--eval_tokens=256"]
TINY_BASE = ["-m", "scripts.base_train", "--depth=1", "--eval_every=-1", "--sample_every=-1", "--core_metric_every=-1"]
TINY_MODELS = {
    "base": (None, [*TINY_BASE, *TINY_SIZES, "--num_iterations=10", "--save_every=5"]),  # context 64; steps 5 and 10
    "mid": ("base", ["-m", "scripts.mid_train", "--mixture=offline", *TINY_SIZES, "--num_iterations=10", "--eval_every=-1"]),
    # context 512: long enough for a reply to be cut short (chat_web)
    "base512": (None, [*TINY_BASE, "--max_seq_len=512", "--device_batch_size=1", "--total_batch_size=512",
                       "--eval_tokens=512", "--num_iterations=10"]),
    # its midtrained model: RL's arithmetic prompts (~60-100 tokens) leave it room to sample answers
    "mid512": ("base512", ["-m", "scripts.mid_train", "--mixture=offline", "--max_seq_len=128", "--device_batch_size=2",
                           "--total_batch_size=256", "--eval_tokens=256", "--num_iterations=10", "--eval_every=-1"]),
}


@pytest.fixture(scope="session")
def tiny_models(pydocs_dir, small_tokenizer_dir, tmp_path_factory):
    """tiny_models(name): the base dir of TINY_MODELS[name], trained once per session (see build_once). Read-only:
    a test that writes gets its own copy through `tiny_model`."""
    import shutil

    def base_dir(name):
        parent, stage = TINY_MODELS[name]

        def build(target):
            if parent:
                shutil.copytree(base_dir(parent), target, ignore=shutil.ignore_patterns(".lock"))
            else:
                shutil.copytree(pydocs_dir, target / "base_data" / "pydocs")
                shutil.copytree(small_tokenizer_dir, target / "tokenizer")
            env = {"NANOCHAT_BASE_DIR": target, "NANOCHAT_DATASET": "pydocs", "WANDB_MODE": "offline",
                   **dict.fromkeys(("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))}
            result = run_script(*stage, env=env, timeout=600)
            assert result.returncode == 0, f"tiny model {name}: {result.stderr[-3000:]}"
        return build_once(tmp_path_factory, f"model_{name}", build)
    return base_dir


@pytest.fixture
def tiny_model(tiny_models, isolated_env, monkeypatch):
    """tiny_model(name): this test's own copy of the session's tiny model `name` (corpus, tokenizer, checkpoints) as
    its NANOCHAT_BASE_DIR, with NANOCHAT_DATASET=pydocs. Returns the base dir."""
    import shutil

    def use(name):
        shutil.copytree(tiny_models(name), isolated_env, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".lock"))
        monkeypatch.setenv("NANOCHAT_DATASET", "pydocs")
        return isolated_env
    return use
