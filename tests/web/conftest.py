"""
The web tests' fixtures: the session's web server (nanochat/serving.py's app on a tiny trained model).

The server runs in this process. The fixtures of every test (a fresh base dir, the tiny models) are
tests/conftest.py's, what the tests share that is not a fixture tests/helpers.py's. This directory is a package
(its __init__.py), so that its conftest does not take the name `conftest` of the one above.
"""

import contextlib
import threading
import time

import pytest

from web.served import HELLO, before_worker_steps, engine_reply, free_port, wait_no_batch


@pytest.fixture(scope="session")
def chat_web_base(tiny_models):
    """
    The session's tiny base model of context 512 tokens (so that a reply can be long enough to be cut short by a
    client that leaves): its base dir, read-only.
    """
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
        self.url = url
        self.app = app
        self.pool = pool
        self.engine = pool.workers[0].engine
        self.tokenizer = pool.tokenizer
        self.http = httpx.Client(timeout=60, verify=False)

    def stats(self):
        return self.http.get(self.url + "/stats").json()


@contextlib.contextmanager
def serve(model, tokenizer, compile_decode=False):
    """
    The app of nanochat.serving (both APIs) with one CPU worker on `model` and chat_web's default settings, served
    by uvicorn in a thread on a free port: the ChatWebServer, stopped on exit. compile_decode: its engine decodes
    with the compiled step (chat_web --compile_decode).
    """
    import uvicorn

    from nanochat.engine import Engine
    from nanochat.openai_api import mount
    from nanochat.batching import Worker, WorkerPool
    from nanochat.serving import Settings, create_app
    pool = WorkerPool([Worker(0, Engine(model, tokenizer, compile_decode=compile_decode))])
    app = create_app(pool, Settings(temperature=0.8, top_k=50, max_tokens=512, max_tokens_limit=4096, max_messages=500,
                                    max_message_chars=8000, max_conversation_chars=32000, model_name="nanochat",
                                    api_key=""))
    mount(app)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not uv.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    served = ChatWebServer(f"http://127.0.0.1:{port}", app, pool)
    yield served
    served.http.close()
    uv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="session")
def chat_web_server(chat_web_base):
    """
    The session's tiny base model served (serve): started once per session, for every test module that talks to
    the web server (one model build, one server).
    """
    from nanochat.checkpoint_manager import load_model
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(chat_web_base))
        model, tokenizer, _ = load_model("base", "cpu", phase="eval")
    with serve(model, tokenizer) as served:
        yield served


@pytest.fixture
def compiled_server(chat_web_server):
    """The session's model served by a second server, whose engine decodes with the compiled step, in fp32."""
    with serve(chat_web_server.engine.model, chat_web_server.tokenizer, compile_decode=True) as served:
        served.pool.workers[0].autocast = contextlib.nullcontext
        yield served


@pytest.fixture(scope="session")
def calculator_server(small_tokenizer_dir):
    """
    A model that always uses the calculator, served (serve): helpers.tool_model on "2*9", which writes "T", calls
    the tool, reads its answer 18, writes "!" and ends. (written: the tokens it writes up to the call's end)
    """
    from helpers import tool_model
    from nanochat.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_directory(str(small_tokenizer_dir))
    model, written = tool_model(tokenizer, "2*9")
    with serve(model, tokenizer) as served:
        served.written = written
        yield served


@pytest.fixture(scope="session")
def long_seed(chat_web_server):
    """
    A seed whose reply to HELLO (temperature 2, whole vocabulary) runs at least 300 of its 500 tokens, and that
    length: most replies of this tiny model end much sooner, and a client that leaves must have something to cut.
    """
    for seed in range(200):
        _, n = engine_reply(chat_web_server, HELLO, 500, 2.0, 0, seed)
        if n >= 300:
            return seed, n
    pytest.fail("no seed below 200 gives a reply of 300 tokens")


@pytest.fixture
def fp32(chat_web_server, monkeypatch):
    """
    The session's server with its worker in fp32 (its autocast off; engine_reply, which enters the worker's autocast,
    in fp32 too), its steps paced by 2 ms (so that requests sent one after the other meet in the batch), and
    /stats's largest batch of the test in `peak`.
    """
    wait_no_batch(chat_web_server)
    monkeypatch.setattr(chat_web_server.pool.workers[0], "autocast", contextlib.nullcontext)
    before_worker_steps(monkeypatch, lambda: time.sleep(0.002))
    chat_web_server.peak = 0
    done = threading.Event()

    def watch():
        while not done.is_set():
            chat_web_server.peak = max(chat_web_server.peak, chat_web_server.stats()["batch_rows"][0])
            time.sleep(0.005)
    watcher = threading.Thread(target=watch)
    watcher.start()
    yield chat_web_server
    done.set()
    watcher.join()
    wait_no_batch(chat_web_server)  # before the autocast comes back: the worker's next batch starts in bf16
