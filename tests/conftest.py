"""
The fixtures of the tests (tests/helpers.py: what they share that is not a fixture). Tests never touch the network or the user's ~/.cache: every test gets its own
NANOCHAT_BASE_DIR, and downloads are served by a local HTTP server on 127.0.0.1.
"""

import os
import threading
import time

import pytest

from helpers import CORES, REPO_ROOT, TASK_FIXTURES, TASK_REPOS, TINY_MODELS, FileServer, build_once, run_script, start_script  # noqa: F401


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


@pytest.fixture
def file_server(tmp_path):
    root = tmp_path / "served"
    root.mkdir()
    server = FileServer(root)
    yield server
    server.close()


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
def chat_web_base(tiny_models):
    """The session's tiny base model of context 512 tokens (so that a reply can be long enough to be cut short by a
    client that leaves): its base dir, read-only."""
    return tiny_models("base512")


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


def wait_serving(process, url, timeout=60):
    """Wait until the chat_web started as `process` (start_script, its output piped) answers {url}/health; fail if it
    ends first or takes longer than `timeout` seconds."""
    import httpx
    deadline = time.time() + timeout
    while True:
        assert process.poll() is None, process.stdout.read()
        assert time.time() < deadline, "the server did not start"
        try:
            if httpx.get(url + "/health", timeout=2, verify=False).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


def document_ends(model, tokenizer, pydocs_dir, count, max_tokens=120):
    """
    `count` texts after which `model`'s greedy next token is <|bos|>, the token that starts a document: where a base
    model ends the one it reads. Each is the start of a document of the pydocs validation shard (one per document),
    cut after whole tokens that encode gives back unchanged, at most `max_tokens` long. [(text, its ids)], the ids
    without <|bos|>.
    """
    import pyarrow.parquet as pq
    import torch
    bos = tokenizer.get_bos_token_id()
    shard = sorted(n for n in os.listdir(pydocs_dir) if n.startswith("shard_"))[-1]
    found = []
    for doc in pq.read_table(os.path.join(pydocs_dir, shard), columns=["text"]).column("text").to_pylist():
        ids = tokenizer.encode(doc, prepend=bos)[:max_tokens + 1]
        with torch.no_grad():
            greedy = model(torch.tensor([ids], device=model.lm_head.weight.device))[0].argmax(dim=-1).tolist()
        for end in range(2, len(ids) + 1):  # greedy[end - 1]: the token the model expects after ids[:end]
            text = tokenizer.decode(ids[1:end])
            if greedy[end - 1] == bos and tokenizer.encode(text) == ids[1:end]:
                found.append((text, ids[1:end]))
                break
        if len(found) == count:
            return found
    pytest.fail(f"fewer than {count} pydocs documents have a place where the model expects <|bos|> next")


def engine_reply(served, messages, max_tokens, temperature, top_k, seed):
    """What the engine itself generates for this request, computed as the worker computes it (in its compute dtype,
    in this process: the same threads): (text, number of tokens)."""
    prompt = served.tokenizer.render_for_completion({"messages": messages})
    budget = min(max_tokens, served.engine.context_len - len(prompt))
    with served.pool.workers[0].autocast():
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
