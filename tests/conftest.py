"""
Shared test fixtures. Tests never touch the network or the user's ~/.cache: every test gets its own
NANOCHAT_BASE_DIR, and downloads are served by a local HTTP server on 127.0.0.1.
"""

import http.server
import os
import sys
import threading
import time

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def run_torchrun(nproc, args, env=None, timeout=300, cwd=REPO_ROOT):
    """Run `torchrun --standalone --nproc_per_node=nproc <args>` (CPU, gloo) and return the CompletedProcess."""
    import subprocess
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] + list(args)
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


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


@pytest.fixture(scope="session")
def pydocs_dir(tmp_path_factory):
    """
    The pydocs corpus (nanochat.pydocs.build_pydocs), built once per test session (~5-7 s on 2 cores) into
    a shared temporary base dir. Returns that corpus directory (`<shared base>/base_data/pydocs`).
    Treat it as read-only; tests get a private copy through `pydocs_corpus`.
    """
    from nanochat.pydocs import build_pydocs
    base = tmp_path_factory.mktemp("pydocs_base")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base))
        return build_pydocs()


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
    texts = []
    for name in sorted(n for n in os.listdir(pydocs_dir) if n.startswith("shard_"))[:-1]:  # the last shard is validation
        texts += pq.read_table(os.path.join(pydocs_dir, name), columns=["text"]).column("text").to_pylist()
    out = tmp_path_factory.mktemp("tokenizer") / "tokenizer"
    Tokenizer.train_from_iterator(iter(texts[:2000]), 512).save(str(out))
    return out


@pytest.fixture
def trained_tokenizer(pydocs_corpus, small_tokenizer_dir, isolated_env):
    """pydocs corpus + the session's small tokenizer in this test's base dir: ready for base_train."""
    import shutil
    shutil.copytree(small_tokenizer_dir, isolated_env / "tokenizer")
    return isolated_env / "tokenizer"


def build_checkpoints(base, pydocs_dir, tokenizer_dir, *stages):
    """
    Make `base` a base dir holding a copy of the pydocs corpus and of the tokenizer, then run each stage there,
    one process after the other: `stages` are argument lists such as ["scripts.base_train", "--depth=1", ...]
    (1 thread, wandb offline, no inherited torchrun variables). The way test modules make their tiny
    checkpoints, once per module or session; tests copy the result. Returns `base`.
    """
    import shutil
    import subprocess
    shutil.copytree(pydocs_dir, base / "base_data" / "pydocs")
    shutil.copytree(tokenizer_dir, base / "tokenizer")
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(base), NANOCHAT_DATASET="pydocs", OMP_NUM_THREADS="1", WANDB_MODE="offline")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    for args in stages:
        result = subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{args[0]} failed: {result.stderr[-3000:]}"
    return base


# A tiny base model's training run, for build_checkpoints: depth 1, no periodic evaluation, sampling or CORE
TINY_BASE = ["scripts.base_train", "--depth=1", "--eval_every=-1", "--sample_every=-1", "--core_metric_every=-1"]


@pytest.fixture(scope="session")
def tiny_chat_base(pydocs_dir, small_tokenizer_dir, tmp_path_factory):
    """
    A base dir holding the pydocs corpus, the small tokenizer, a depth-1 base model (context 128, 10 steps) and
    its midtrained model (offline mixture, 10 steps): built once per session for the chat-stage tests, which
    copy it (`chat_base`). The models are tiny and barely trained: for testing the machinery, not quality.
    """
    common = ["--max_seq_len=128", "--device_batch_size=2", "--total_batch_size=256", "--num_iterations=10", "--eval_tokens=256"]
    return build_checkpoints(tmp_path_factory.mktemp("chat_base"), pydocs_dir, small_tokenizer_dir,
                             [*TINY_BASE, *common], ["scripts.mid_train", "--mixture=offline", "--eval_every=-1", *common])


@pytest.fixture
def chat_base(tiny_chat_base, isolated_env, monkeypatch):
    """This test's own copy of tiny_chat_base as its NANOCHAT_BASE_DIR (with NANOCHAT_DATASET=pydocs)."""
    import shutil
    shutil.copytree(tiny_chat_base, isolated_env, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".lock"))
    monkeypatch.setenv("NANOCHAT_DATASET", "pydocs")
    return isolated_env


# -----------------------------------------------------------------------------
# The web server (scripts/chat_web.py), shared by the test modules that talk to it

HELLO = [{"role": "user", "content": "Hello! What is a list comprehension?"}]


def free_port():
    """A TCP port free on 127.0.0.1 right now."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def chat_web_base(tmp_path_factory, small_tokenizer_dir, pydocs_dir):
    """A base dir holding the session's tokenizer and a depth-1 model trained for 10 steps, for the web
    server's tests. Its context is 512 tokens, so that a reply can be long enough to be cut short by a client
    that leaves."""
    return build_checkpoints(tmp_path_factory.mktemp("chat_web_base"), pydocs_dir, small_tokenizer_dir,
                             [*TINY_BASE, "--max_seq_len=512", "--device_batch_size=1", "--total_batch_size=512",
                              "--num_iterations=10", "--eval_tokens=512"])


class ChatWebServer:
    """
    The running server: its URL, its app, its worker pool and the one worker's engine and tokenizer, and `http`,
    an httpx client kept open for the tests' plain requests. httpx.get() makes a client per call, and a client's
    start-up is mostly loading the CA bundle, for TLS this plain-HTTP server never uses: hence verify=False in
    every client the tests make.
    """

    def __init__(self, url, app, pool):
        import httpx
        self.url, self.app, self.pool = url, app, pool
        self.engine, self.tokenizer = pool.workers[0].engine, pool.tokenizer
        self.http = httpx.Client(timeout=60, verify=False)

    def stats(self):
        return self.http.get(self.url + "/stats").json()


@pytest.fixture(scope="session")
def chat_web_server(chat_web_base):
    """scripts.chat_web's app with one CPU worker, served by uvicorn in a thread on a free port: started once
    per session, for every test module that talks to the web server (one model build, one server)."""
    import uvicorn

    import scripts.chat_web as chat_web
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(chat_web_base))
        pool = chat_web.WorkerPool(chat_web.load_workers("base", "cpu"))
    chat_web.app.state.pool = pool
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(chat_web.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not uv.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    served = ChatWebServer(f"http://127.0.0.1:{port}", chat_web.app, pool)
    yield served
    served.http.close()
    uv.should_exit = True
    thread.join(timeout=10)


def engine_reply(served, messages, max_tokens, temperature, top_k, seed):
    """What the engine itself generates for this request: (text, number of tokens)."""
    prompt = served.tokenizer.render_for_completion({"messages": messages})
    budget = min(max_tokens, served.engine.context_len - len(prompt))
    results, _ = served.engine.generate_batch(prompt, max_tokens=budget, temperature=temperature, top_k=top_k, seed=seed)
    return served.tokenizer.decode(results[0][len(prompt):]), len(results[0]) - len(prompt)


def wait_idle(served, timeout=10):
    """Wait until the server has no request generating or queued; returns its /stats."""
    deadline = time.time() + timeout
    while (stats := served.stats())["busy"] or stats["queue"]:
        assert time.time() < deadline, stats
        time.sleep(0.01)
    return stats


@pytest.fixture(scope="session")
def long_seed(chat_web_server):
    """A seed whose reply to HELLO (temperature 2, whole vocabulary) runs at least 300 of its 500 tokens, and that
    length: most replies of this tiny model end much sooner, and a client that leaves must have something to cut."""
    for seed in range(200):
        _, n = engine_reply(chat_web_server, HELLO, 500, 2.0, 0, seed)
        if n >= 300:
            return seed, n
    pytest.fail("no seed below 200 gives a reply of 300 tokens")
