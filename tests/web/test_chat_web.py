"""
Tests of the chat web server (scripts/chat_web.py, nanochat/serving.py) and its page (nanochat/ui.html).

Against a real uvicorn server on 127.0.0.1 serving a tiny trained checkpoint: validation (400 naming the field),
streaming (the text is exactly what the engine generates for the same seed, then the done event), 16 concurrent
requests on one worker (decoded in batches), a client that leaves stops its generation, a failing generation leaves
the server serving, the command line, and the page in a real browser (headless Chromium driven by Playwright).
"""

import json
import os
import shutil
import signal
import subprocess
import threading
import time

import httpx
import pytest

from helpers import run_script, start_script
from web.served import HELLO, before_worker_steps, engine_reply, free_port, told_text, wait_idle, wait_serving

CHROMIUM = "/usr/bin/chromium"  # Debian's `chromium` package (Playwright's own browser download needs the network)


@pytest.fixture
def server(chat_web_server):
    """The session's server (web/conftest.py), under the short name these tests use."""
    return chat_web_server


def post_chat(url, body, timeout=120):
    """POST /chat/completions. Returns (200, [events]) for a stream, or (status, JSON body) for a refusal."""
    with httpx.Client(timeout=timeout, verify=False) as client:  # verify=False: see web/conftest.py's ChatWebServer
        with client.stream("POST", url + "/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                return response.status_code, response.json()
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return 200, [json.loads(line[len("data: "):]) for line in lines]


def reply_text(events):
    """
    The text of a complete stream, after checking its shape: text events (or the calculator's), then exactly one
    done event.
    """
    assert events[-1] == {"done": True}, events[-3:]
    pieces = events[:-1]
    kinds = {"token", "tool_call", "tool_call_end", "tool_output", "tool_output_end"}
    assert all(len(e) == 2 and "gpu" in e and set(e) - {"gpu"} <= kinds for e in pieces), pieces
    assert all(e["token"] for e in pieces if "token" in e), pieces
    return told_text(pieces)


# -----------------------------------------------------------------------------
# The API

def alternating(n, text="hi"):
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i in range(n)]


BAD_REQUESTS = {
    "no messages": ({"messages": []}, "messages:"),
    "messages missing": ({"temperature": 1}, "messages:"),
    "messages not a list": ({"messages": "hi"}, "messages:"),
    "a message not an object": ({"messages": ["hi"]}, "messages[0]:"),
    "unknown role": ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role:"),
    "starts with assistant": ({"messages": [{"role": "assistant", "content": "x"}]}, "messages[0].role:"),
    "two users in a row": ({"messages": [HELLO[0], HELLO[0]]}, "messages[1].role:"),
    "ends with assistant": ({"messages": alternating(2)}, "messages[1].role:"),
    "content not a string": ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content:"),
    "content missing": ({"messages": [{"role": "user"}]}, "messages[0].content:"),
    "message too long": ({"messages": [{"role": "user", "content": "x" * 8001}]}, "messages[0].content:"),
    "conversation too long": ({"messages": alternating(5, "y" * 7000)}, "messages:"),
    "too many messages": ({"messages": alternating(501)}, "messages:"),
    "too many tokens for the context": (
        {"messages": alternating(41, "one two three four five six seven eight nine ten " * 3)}, "messages:"),
    "temperature too high": ({"messages": HELLO, "temperature": 2.5}, "temperature:"),
    "temperature negative": ({"messages": HELLO, "temperature": -0.1}, "temperature:"),
    "temperature not a number": ({"messages": HELLO, "temperature": "hot"}, "temperature:"),
    "top_k negative": ({"messages": HELLO, "top_k": -1}, "top_k:"),
    "top_k beyond the vocabulary": ({"messages": HELLO, "top_k": 513}, "top_k:"),
    "top_k a bool": ({"messages": HELLO, "top_k": True}, "top_k:"),
    "max_tokens zero": ({"messages": HELLO, "max_tokens": 0}, "max_tokens:"),
    "max_tokens too large": ({"messages": HELLO, "max_tokens": 4097}, "max_tokens:"),
    "max_tokens fractional": ({"messages": HELLO, "max_tokens": 1.5}, "max_tokens:"),
    "seed negative": ({"messages": HELLO, "seed": -1}, "seed:"),
    "seed too large": ({"messages": HELLO, "seed": 2**63}, "seed:"),
    "max_tokens a string": ({"messages": HELLO, "max_tokens": "5"}, "max_tokens:"),
    "body a list": ([HELLO[0]], "body:"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_a_bad_request_gets_400_naming_the_field(server, name):
    body, field = BAD_REQUESTS[name]
    served_before = server.stats()["requests_served"]
    status, answer = post_chat(server.url, body)
    assert status == 400, (status, answer)
    assert answer["detail"].startswith(field), answer
    assert "Traceback" not in answer["detail"]
    assert server.stats()["requests_served"] == served_before  # refused before any generation


@pytest.mark.parametrize("raw, field", [
    (b'{"messages": [', "body:"), (b"", "body:"), (b"not json", "body:"), (b'"text"', "body:"),
    (b'{"messages": [{"role": "user", "content": "hi"}],}', "body:"),
    (b"[" * 100_000, "body:"),  # nested too deep for the parser
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature:"),
])
def test_malformed_json_gets_400(server, raw, field):
    response = server.http.post(server.url + "/chat/completions", content=raw,
                                headers={"Content-Type": "application/json"}, timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["detail"].startswith(field)


def test_fields_it_does_not_know_are_ignored(server):
    status, events = post_chat(server.url, {"messages": HELLO, "max_tokens": 2, "colour": "blue", "stream": False})
    assert status == 200 and events[-1] == {"done": True}


def test_the_reply_streams_what_the_engine_generates_then_done(server):
    conversation = [HELLO[0], {"role": "assistant", "content": "A short way to build a list."},
                    {"role": "user", "content": "Show me one ✨"}]
    for messages in (HELLO, conversation):
        # a seed whose reply has a few tokens (the tiny model often ends its turn at once)
        seed = next(s for s in range(200) if engine_reply(server, messages, 40, 1.0, 50, s)[1] >= 5)
        expected, n_tokens = engine_reply(server, messages, max_tokens=40, temperature=1.0, top_k=50, seed=seed)
        status, events = post_chat(server.url, {"messages": messages, "temperature": 1.0, "top_k": 50, "max_tokens": 40,
                                                "seed": seed})
        assert status == 200
        assert reply_text(events) == expected  # exactly the engine's tokens, streamed in order, end token left out
        assert 1 <= len(events) - 1 <= n_tokens  # streamed piece by piece (pieces may hold several tokens, never more)
    # defaults (no temperature/top_k/max_tokens/seed) work too; a random seed per request
    status, events = post_chat(server.url, {"messages": HELLO})
    assert status == 200 and events[-1] == {"done": True}


def test_health_stats_and_the_page(server):
    assert server.http.get(server.url + "/health").json() == {"status": "ok", "workers": 1}
    stats = server.stats()
    for key in ("workers", "busy", "queue", "requests_served", "tokens_generated", "tokens_per_second"):
        assert key in stats, stats
    assert stats["workers"] == 1 and stats["context_len"] == 512
    page = server.http.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert 'fetch("chat/completions"' in html  # relative: works behind a path prefix
    assert 'fetch("/' not in html and "fetch('/" not in html and "fetch(`/" not in html
    for external in ('src="http', "src='http", 'href="http', "href='http", "@import", "//cdn"):
        assert external not in html, external  # self-contained: nothing to fetch from elsewhere


def test_sixteen_concurrent_requests_on_one_worker_all_complete(fp32):
    # in fp32 (web/conftest.py's fp32): a reply decoded in a batch equals the engine's alone; bf16 rounds differently
    # per batch size (a step's matrix kernels depend on its rows)
    server = fp32
    requests = [{"messages": [{"role": "user", "content": f"Question number {i}?"}], "temperature": 1.0, "top_k": 0,
                 "max_tokens": 24, "seed": 100 + i} for i in range(16)]
    expected = [engine_reply(server, r["messages"], 24, 1.0, 0, r["seed"])[0] for r in requests]
    before = wait_idle(server)
    results = [None] * 16
    peak = {"queue": 0, "busy": 0}
    done = threading.Event()

    def watch():  # /stats stays responsive while the worker generates, and shows the queue
        while not done.is_set():
            stats = server.stats()
            peak["queue"] = max(peak["queue"], stats["queue"])
            peak["busy"] = max(peak["busy"], stats["busy"])
            time.sleep(0.005)

    def client(i):
        results[i] = post_chat(server.url, requests[i])

    watcher = threading.Thread(target=watch)
    watcher.start()
    clients = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(timeout=120)
    done.set()
    watcher.join()
    for i, (status, events) in enumerate(results):
        assert status == 200
        assert reply_text(events) == expected[i], i  # each client got its own reply, whole
    after = wait_idle(server)
    assert after["requests_served"] - before["requests_served"] == 16
    # one worker: up to max_batch replies decoded together, the others waited in the queue
    assert peak["busy"] == 1 and peak["queue"] >= 1 and 2 <= server.peak <= server.pool.max_batch, (peak, server.peak)


def test_a_client_that_leaves_frees_its_worker_and_stops_its_generation(server, long_seed):
    seed, full = long_seed
    body = {"messages": HELLO, "temperature": 2.0, "top_k": 0, "max_tokens": 500, "seed": seed}
    before = wait_idle(server)
    with httpx.Client(timeout=30, verify=False) as client:
        with client.stream("POST", server.url + "/chat/completions", json=body) as response:
            assert response.status_code == 200
            first = next(line for line in response.iter_lines() if line.startswith("data: "))
            assert "gpu" in json.loads(first[6:])  # a piece of the reply
        # leaving the block closes the connection after one event
    left = time.time()
    after = wait_idle(server, timeout=5)
    assert time.time() - left < 2.0  # freed at once, not when the reply would have ended
    assert after["requests_cancelled"] == before["requests_cancelled"] + 1
    generated = after["tokens_generated"] - before["tokens_generated"]
    assert generated < full // 2, (generated, full)  # the rest of the reply was never computed
    # and the next request is served
    status, events = post_chat(server.url, {"messages": HELLO, "max_tokens": 8, "seed": 1})
    assert status == 200 and events[-1] == {"done": True}


def test_a_client_that_leaves_while_queued_gives_up_its_place(server, monkeypatch):
    # one row per worker, held by a first request, paced: after its first token its next step waits for `gate`
    gate = threading.Event()
    monkeypatch.setattr(server.pool, "max_batch", 1)
    before = wait_idle(server)
    # a reply that needs the gate
    seed = next(s for s in range(200) if engine_reply(server, HELLO, 8, 1.0, 0, s)[1] >= 3)
    body = {"messages": HELLO, "temperature": 1.0, "top_k": 0, "max_tokens": 8, "seed": seed}
    before_worker_steps(monkeypatch, lambda: gate.wait(timeout=30))
    with httpx.Client(timeout=30, verify=False) as first, httpx.Client(timeout=30, verify=False) as second:
        with first.stream("POST", server.url + "/chat/completions", json=body) as held:
            lines = held.iter_lines()  # kept: dropping the iterator would close the connection
            next(lines)  # the worker is generating for `first`, and waits at the gate
            with second.stream("POST", server.url + "/chat/completions", json=body):
                deadline = time.time() + 10
                while server.stats()["queue"] < 1:
                    assert time.time() < deadline, server.stats()
                    time.sleep(0.005)
            # `second` left while waiting: its place in the queue is gone, and no worker ever ran it
            deadline = time.time() + 10
            while server.stats()["queue"]:
                assert time.time() < deadline, server.stats()
                time.sleep(0.005)
            assert server.stats()["busy"] == 1
            gate.set()
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
            assert rest[-1] == {"done": True}  # `first` is answered in full
    after = wait_idle(server)
    assert after["requests_served"] == before["requests_served"] + 1
    assert after["requests_cancelled"] == before["requests_cancelled"]


def test_a_failing_generation_sends_an_error_event_and_the_server_goes_on(server, long_seed, monkeypatch):
    calls = []

    def fail_the_third():  # fault injection: the first token and two real steps, then the device "fails"
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")

    before = wait_idle(server)
    seed, _ = long_seed
    before_worker_steps(monkeypatch, fail_the_third)
    status, events = post_chat(server.url, {"messages": HELLO, "temperature": 2.0, "top_k": 0, "max_tokens": 50,
                                            "seed": seed})
    assert status == 200
    assert events[-1] == {"done": True}
    assert "injected failure" in events[-2]["error"], events[-2:]
    assert all("gpu" in e for e in events[:-2])  # pieces of the reply before the error
    monkeypatch.undo()
    status, events = post_chat(server.url, {"messages": HELLO, "max_tokens": 8})
    assert status == 200 and events[-1] == {"done": True}
    after = wait_idle(server)
    assert after["requests_failed"] == before["requests_failed"] + 1
    assert after["requests_served"] == before["requests_served"] + 1


# -----------------------------------------------------------------------------
# The command line

@pytest.mark.slow
def test_the_command_line_serves_and_warns_when_listening_beyond_loopback(chat_web_base):
    env = {"NANOCHAT_BASE_DIR": chat_web_base}
    port = free_port()
    process = start_script("-m", "scripts.chat_web", "--source=base", "--device_type=cpu", "--host=0.0.0.0",
                           f"--port={port}", "--api_key=s3cret", "--model_name=tiny", env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_serving(process, f"http://127.0.0.1:{port}")
        status, events = post_chat(f"http://127.0.0.1:{port}", {"messages": HELLO, "max_tokens": 5})
        assert status == 200 and events[-1] == {"done": True}
        # --api_key and --model_name reach the OpenAI-compatible API
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": "Bearer s3cret"},
                           timeout=10, verify=False)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10, verify=False).status_code == 401
        # the same port again: refused at once, in one line
        again = run_script("-m", "scripts.chat_web", "--source=base", "--device_type=cpu", "--host=0.0.0.0",
                           f"--port={port}", env=env, timeout=60)
        assert again.returncode == 1
        assert again.stderr.strip().startswith("error: cannot listen on 0.0.0.0:") and "--port" in again.stderr
    finally:
        process.send_signal(signal.SIGINT)
        try:
            out, _ = process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            out, _ = process.communicate()
    assert "WARNING: listening on 0.0.0.0" in out and "no authentication" in out, out
    assert "decode step eager" in out, out  # --compile_decode=auto on a CPU: the eager step, which measured faster


def test_a_missing_checkpoint_is_one_line_naming_the_stage(tmp_path):
    result = run_script("-m", "scripts.chat_web", "--device_type=cpu", f"--port={free_port()}",
                        env={"NANOCHAT_BASE_DIR": tmp_path / "empty"}, timeout=60)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert (len(lines) == 1 and lines[0].startswith("error: ")
            and "python -m scripts.chat_sft" in lines[0]), result.stderr


# -----------------------------------------------------------------------------
# The page, in a real browser

def events_of(response_body):
    return [json.loads(line[6:]) for line in response_body.splitlines() if line.startswith("data: ")]


def playwright():
    """Playwright's sync API, with Debian's Chromium to drive: else the test is skipped, saying what to install."""
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="needs the playwright pip package: pip install playwright")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"needs Chromium at {CHROMIUM}: apt-get install chromium (the Debian package; Playwright's own "
                    f"browser download is not used) and pip install playwright")
    return sync_api


def launch(p):
    """
    Headless Chromium, without the background connections a closed network refuses; a skip, with the first line of
    its error, where this machine's Chromium does not start (an installed browser is tried, not assumed to work).
    """
    from playwright.sync_api import Error
    try:
        return p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
            "--disable-component-update", "--no-first-run", "--disable-extensions"])
    except Error as e:
        pytest.skip(f"Chromium at {CHROMIUM} does not start: {str(e).strip().splitlines()[0]}")


def test_the_page_in_a_browser(server, tmp_path, monkeypatch):
    sync_api = playwright()
    with sync_api.sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page(viewport={"width": 960, "height": 720})
            page_errors, sent = [], []
            page.on("pageerror", lambda e: page_errors.append(str(e)))
            page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/chat/completions") else None)
            page.goto(server.url + "/")
            assert page.title() == "nanochat"
            page.click("summary")
            page.fill("#max-tokens", "300")

            def ask(text):
                """Type `text`, press Enter, wait for the reply to end; returns the stream as the server sent it."""
                with page.expect_response(lambda r: r.url.endswith("/chat/completions")) as response:
                    page.fill("#input", text)
                    page.press("#input", "Enter")
                page.wait_for_selector("#send:text('Send')")
                return events_of(response.value.text())

            def replies():
                return [b.text_content() for b in page.query_selector_all(".message.assistant .bubble")]

            # 1. a message: the reply shows while it is generated. The worker is paced for this one reply: after its
            # 5th token its next step waits for `gate`, so the page can be looked at mid-reply. (The seed, given to
            # the request by the server, makes the reply long.)
            from nanochat import engine, serving
            hello = [{"role": "user", "content": "Hello there"}]
            seed = next(s for s in range(200) if engine_reply(server, hello, 300, 0.8, 50, s)[1] >= 10)
            real_check = serving.check_sampling
            gate = threading.Event()
            calls = []

            def held_at_the_fifth():
                calls.append(1)
                if len(calls) == 5:
                    gate.wait(timeout=30)

            def seeded_check(*args, **kwargs):
                return dict(real_check(*args, **kwargs), seed=seed)
            real_step = before_worker_steps(monkeypatch, held_at_the_fifth)
            monkeypatch.setattr(serving, "check_sampling", seeded_check)
            with page.expect_response(lambda r: r.url.endswith("/chat/completions")) as response:
                page.fill("#input", "Hello there")
                page.press("#input", "Enter")
            page.wait_for_function("document.querySelector('.message.assistant.streaming .bubble')"
                                   "?.textContent.length > 0")
            partial = replies()[0]
            assert page.text_content("#send") == "Stop"  # still generating, and the first pieces are on the page
            gate.set()
            page.wait_for_selector("#send:text('Send')")
            monkeypatch.setattr(engine, "decode_step", real_step)
            monkeypatch.setattr(serving, "check_sampling", real_check)
            events = events_of(response.value.text())
            assert replies() == [reply_text(events)]
            assert replies()[0].startswith(partial) and len(replies()[0]) > len(partial)
            assert sent[-1] == {"messages": hello, "max_tokens": 300}
            first_reply = replies()[0]

            # 2. the conversation is kept: the second request carries the first exchange
            events = ask("Tell me more")
            assert sent[-1]["messages"] == [{"role": "user", "content": "Hello there"},
                                            {"role": "assistant", "content": first_reply},
                                            {"role": "user", "content": "Tell me more"}]
            assert replies() == [first_reply, reply_text(events)]

            # 3. regenerate: the last reply is asked again, without itself, and replaced
            with page.expect_response(lambda r: r.url.endswith("/chat/completions")) as response:
                page.click("#regenerate")
            page.wait_for_selector("#send:text('Send')")
            assert sent[-1]["messages"] == sent[-2]["messages"]
            assert replies() == [first_reply, reply_text(events_of(response.value.text()))]
            assert len(page.query_selector_all(".message")) == 4
            page.click("summary")  # fold the settings away for the picture
            page.screenshot(path=str(tmp_path / "chat_web.png"))
            if os.environ.get("NANOCHAT_SCREENSHOT"):  # the README's picture: NANOCHAT_SCREENSHOT=docs/chat_web.png
                shutil.copy(tmp_path / "chat_web.png", os.environ["NANOCHAT_SCREENSHOT"])
            assert (tmp_path / "chat_web.png").stat().st_size > 10_000

            # 4. readable on a phone: nothing wider than the screen
            page.set_viewport_size({"width": 390, "height": 800})
            assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
            page.set_viewport_size({"width": 960, "height": 720})

            # 5. a new conversation starts empty
            page.click("#new-chat")
            assert page.query_selector_all(".message") == []
            events = ask("Hi again")
            assert sent[-1]["messages"] == [{"role": "user", "content": "Hi again"}]
            assert replies() == [reply_text(events)]

            # 6. a refused request (a message over the server's 8,000 characters) shows the server's error in the page,
            # and the message goes back into the input box
            long_message = "word " * 1700
            page.fill("#input", long_message)
            page.press("#input", "Enter")
            error = page.wait_for_selector(".error")
            assert "messages[2].content" in error.text_content() and "8,000" in error.text_content()
            assert page.input_value("#input") == long_message.strip()
            assert len(page.query_selector_all(".message")) == 2

            # 7. an error event during the stream shows too
            real_check = server.engine.check_arguments

            def failing_check(*args, **kwargs):  # the worker's first look at the request
                raise RuntimeError("injected failure")
            monkeypatch.setattr(server.engine, "check_arguments", failing_check)
            page.fill("#input", "One more")
            page.press("#input", "Enter")
            page.wait_for_selector(".error:has-text('injected failure')")
            page.wait_for_selector("#send:text('Send')")
            monkeypatch.setattr(server.engine, "check_arguments", real_check)
            assert len(page.query_selector_all(".message")) == 2
            assert page_errors == []
        finally:
            browser.close()


# -----------------------------------------------------------------------------
# The calculator's use, as blocks of their own (a model that always calls it: web/conftest.py's calculator_server)

ASK = [{"role": "user", "content": "What is 2 times 9?"}]


def test_a_calculator_call_streams_as_blocks_of_its_own(calculator_server):
    status, events = post_chat(calculator_server.url, {"messages": ASK, "temperature": 0})
    assert status == 200 and events[-1] == {"done": True}, events
    kinds = []
    for event in events[:-1]:
        kind = next(k for k in event if k != "gpu")
        if not kinds or kinds[-1] != kind or event[kind] == "":  # an empty event opens a block
            kinds.append(kind)
    assert kinds == ["token", "tool_call", "tool_call_end", "tool_output", "tool_output_end", "token"], events
    text = {kind: "".join(e.get(kind, "") for e in events) for kind in ("token", "tool_call", "tool_output")}
    assert text == {"token": "T!", "tool_call": "2*9", "tool_output": "18"}
    assert "<|" not in json.dumps(events)
    tokenizer = calculator_server.tokenizer
    sp = tokenizer.encode_special
    tokens = [*calculator_server.written, sp("<|output_start|>"), *tokenizer.encode("18"), sp("<|output_end|>"),
              *tokenizer.encode("!")]
    assert reply_text(events) == tokenizer.decode(tokens)  # every token told once
    # the OpenAI API keeps plain text: the reply as the tokenizer decodes it, the tool's special tokens written out
    import openai
    client = openai.OpenAI(base_url=calculator_server.url + "/v1", api_key="none")
    reply = client.chat.completions.create(model="nanochat", messages=ASK, temperature=0, max_tokens=40)
    assert reply.choices[0].message.content == tokenizer.decode(tokens)


def test_a_reply_with_a_call_goes_back_as_its_parts(calculator_server):
    from nanochat.serving import check_chat
    parts = [{"type": "text", "text": "T"}, {"type": "python", "text": "2*9"}, {"type": "python_output", "text": "18"},
             {"type": "text", "text": "!"}]
    messages = [*ASK, {"role": "assistant", "content": parts}, {"role": "user", "content": "And 3 times 3?"}]
    tokenizer = calculator_server.tokenizer
    prompt, _ = check_chat({"messages": messages}, calculator_server.app.state.settings, calculator_server.pool)
    assert prompt == tokenizer.render_for_completion({"messages": messages})
    assert tokenizer.encode_special("<|python_start|>") in prompt  # the model reads its call as it wrote it
    status, events = post_chat(calculator_server.url, {"messages": messages, "temperature": 0})
    assert status == 200 and events[-1] == {"done": True}
    for bad, field in (([{"type": "image", "text": "x"}], "messages[1].content[0]"), (7, "messages[1].content")):
        status, body = post_chat(calculator_server.url, {"messages": [*messages[:1], {"role": "assistant",
                                                                                      "content": bad}, messages[2]]})
        assert status == 400 and body["detail"].startswith(field), body
    status, body = post_chat(calculator_server.url, {"messages": [{"role": "user", "content": parts}]})
    assert status == 400 and body["detail"].startswith("messages[0].content: must be a string"), body


def test_the_page_shows_a_calculator_call_as_a_block(calculator_server, tmp_path):
    sync_api = playwright()
    with sync_api.sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page(viewport={"width": 960, "height": 720})
            page_errors = []
            sent = []
            page.on("pageerror", lambda e: page_errors.append(str(e)))
            page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/chat/completions") else None)
            page.goto(calculator_server.url + "/")
            for question in ("What is 2 times 9?", "And again?"):
                page.fill("#input", question)
                page.press("#input", "Enter")
                page.wait_for_selector("#send:text('Send')")
            replies = page.query_selector_all(".message.assistant .bubble")
            assert len(replies) == 2
            for bubble in replies:
                assert bubble.query_selector(".tool .tool-call").text_content() == "2*9"
                assert bubble.query_selector(".tool .tool-output").text_content() == "18"
                assert [s.text_content() for s in bubble.query_selector_all(":scope > span")] == ["T", "!"]
            assert "<|" not in page.text_content("#log")
            # the second request carries the first reply as its parts
            assert sent[-1]["messages"][1] == {"role": "assistant", "content": [
                {"type": "text", "text": "T"}, {"type": "python", "text": "2*9"},
                {"type": "python_output", "text": "18"}, {"type": "text", "text": "!"}]}
            shot = tmp_path / "calculator_block.png"
            page.screenshot(path=str(shot))
            print(f"screenshot: {shot}")
            assert shot.stat().st_size > 5_000 and page_errors == []
        finally:
            browser.close()
