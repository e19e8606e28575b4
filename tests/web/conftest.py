"""
The web tests' fixtures: the session's web server (nanochat/serving.py's app on a tiny trained model, in this
process) and what the tests of it share. The fixtures of every test (a fresh base dir, the tiny models, running a
script) are tests/conftest.py's. A test module imports helpers from here as `web.conftest`: this directory is a
package (its __init__.py), so that its conftest does not take the name `conftest` of the one above.
"""

import os
import threading
import time

import pytest


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
    """The app of nanochat.serving with one CPU worker and chat_web's default settings, served by uvicorn in a thread
    on a free port: started once per session, for every test module that talks to the web server (one model build,
    one server)."""
    import uvicorn

    from nanochat.serving import Settings, WorkerPool, create_app, load_workers
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(chat_web_base))
        pool = WorkerPool(load_workers("base", "cpu"))
    app = create_app(pool, Settings(temperature=0.8, top_k=50, max_tokens=512, max_tokens_limit=4096, max_messages=500,
                                    max_message_chars=8000, max_conversation_chars=32000, model_name="nanochat", api_key=""))
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
