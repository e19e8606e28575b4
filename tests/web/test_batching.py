"""
Tests of the server's batching (nanochat/batching.py's Worker and WorkerPool): requests that arrive while others
decode join the worker's running batch and leave it when done.

Against the session's real uvicorn server (web/conftest.py), with OpenAI's own client in threads and in asyncio and
with plain HTTP: a request joining mid-decode of another, mixed prompt lengths (a prompt prefilled in chunks beside
running rows) and sampling settings, streams and stop strings, a client that leaves the batch, and the limits (a
full queue answered with a one-line 429, a request that never fits with a 400). Each reply is compared with the
engine's own reply to the same request alone (Engine.generate, one sample): in fp32 (the worker's autocast off for
these tests: web/conftest.py's fp32) greedy and seeded replies are equal token for token, whatever else shares the
batch.
"""

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from web.served import HELLO, before_worker_steps, engine_reply, told_text, wait_no_batch

openai = pytest.importorskip("openai", reason="needs the openai pip package: pip install openai")


@pytest.fixture(scope="module")
def client(chat_web_server):
    """OpenAI's client, pointed at the server. No retries: a test must see the first answer."""
    return openai.OpenAI(base_url=chat_web_server.url + "/v1", api_key="any key works", max_retries=0, timeout=60)


def chat(client, messages, temperature, top_k, max_tokens, seed, **kwargs):
    return client.chat.completions.create(model="nanochat", messages=messages, temperature=temperature,
                                          max_tokens=max_tokens, seed=seed, extra_body={"top_k": top_k}, **kwargs)


def expect(served, request):
    """The engine's own reply to `request` (messages, temperature, top_k, max_tokens, seed), alone: (text, tokens)."""
    messages, temperature, top_k, max_tokens, seed = request
    return engine_reply(served, messages, max_tokens, temperature, top_k, seed)


def long_reply_seed(served, messages, min_tokens):
    """A seed whose reply (temperature 2, the whole vocabulary, 400 tokens at most) has at least `min_tokens`."""
    return next(s for s in range(300) if engine_reply(served, messages, 400, 2.0, 0, s)[1] >= min_tokens)


# Requests of different prompt lengths and settings: (messages, temperature, top_k, max_tokens, seed)
REQUESTS = [
    (HELLO, 0, 0, 40, 0),
    ([{"role": "user", "content": "Why?"}], 1.0, 50, 30, 3),
    ([{"role": "user", "content": "Tell me about Python lists. " * 12}], 0.7, 20, 25, 11),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
      {"role": "user", "content": "Write a haiku about the sea."}], 1.0, 0, 3, 5),
    ([{"role": "user", "content": "Count: one two three four five six seven eight nine ten " * 8}], 0, 0, 50, 1),
    ([{"role": "user", "content": "What is 2 + 2?"}], 1.5, 0, 45, 123),
]


def test_a_request_that_joins_mid_decode_gets_its_unbatched_reply(fp32, monkeypatch):
    """
    A long stream decodes; two others join it in turn, one greedy and one sampled of a long prompt; all three get
    their own replies. The long prompt is prefilled 16 tokens per step (prefill_chunk) between the stream's steps.
    """
    # 10 ms a step: the long reply outlasts the others' requests, even on a busy CPU
    before_worker_steps(monkeypatch, lambda: time.sleep(0.008))
    long_seed = long_reply_seed(fp32, HELLO, 150)
    expected_long = engine_reply(fp32, HELLO, 400, 2.0, 0, long_seed)
    joiners = [REQUESTS[0], REQUESTS[2]]
    expected = [expect(fp32, r) for r in joiners]
    model = fp32.engine.model
    real_prefill = model.prefill
    chunks = []

    def recorded_prefill(idx, kv_cache):  # the worker's prefills, by their number of tokens
        if threading.current_thread().name.startswith("nanochat-worker"):
            chunks.append(idx.size(1))
        return real_prefill(idx, kv_cache)
    monkeypatch.setattr(model, "prefill", recorded_prefill)
    monkeypatch.setattr(fp32.pool.workers[0], "prefill_chunk", 16)
    body = {"messages": HELLO, "temperature": 2.0, "top_k": 0, "max_tokens": 400, "seed": long_seed}
    client = openai.OpenAI(base_url=fp32.url + "/v1", api_key="k", max_retries=0, timeout=60)
    with httpx.Client(timeout=60, verify=False) as http:
        with http.stream("POST", fp32.url + "/chat/completions", json=body) as response:
            lines = response.iter_lines()
            pieces = []
            for line in lines:  # the long reply is under way: 10 pieces of it are out
                if line.startswith("data: "):
                    pieces.append(json.loads(line[6:]))
                    if len(pieces) == 10:
                        break
            assert chunks == [len(fp32.tokenizer.render_for_completion({"messages": HELLO}))]  # alone: all at once
            answers = [chat(client, *r) for r in joiners]  # one after the other, while the long one decodes
            deadline = time.time() + 2
            while fp32.stats()["batch_rows"] != [1]:  # they left (at the step after their last); the long one goes on
                assert time.time() < deadline, fp32.stats()
                time.sleep(0.001)
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert events[-1] == {"done": True}
    assert told_text(pieces + events[:-1]) == expected_long[0]
    for answer, (text, n_tokens), request in zip(answers, expected, joiners):
        assert answer.choices[0].message.content == text
        assert answer.usage.completion_tokens == n_tokens
        assert answer.choices[0].finish_reason == ("length" if n_tokens == request[3] else "stop")
    assert fp32.peak == 2
    lengths = [len(fp32.tokenizer.render_for_completion({"messages": r[0]})) for r in joiners]
    assert lengths[1] > 3 * 16
    assert chunks[1:] == [n for length in lengths for n in [16] * (length // 16) + [length % 16] if n]


def test_mixed_lengths_and_settings_in_one_batch_with_the_async_client(fp32, monkeypatch):
    """Six requests at once: the long prompts are prefilled 16 tokens per step beside the rows that decode."""
    monkeypatch.setattr(fp32.pool.workers[0], "prefill_chunk", 16)
    lengths = [len(fp32.tokenizer.render_for_completion({"messages": r[0]})) for r in REQUESTS]
    assert max(lengths) > 5 * 16 and min(lengths) < 16
    expected = [expect(fp32, r) for r in REQUESTS]

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=fp32.url + "/v1", api_key="k", max_retries=0, timeout=60) as client:
            return await asyncio.gather(*[
                client.chat.completions.create(model="nanochat", messages=m, temperature=t, max_tokens=n, seed=s,
                                               extra_body={"top_k": k})
                for m, t, k, n, s in REQUESTS])
    answers = asyncio.run(all_at_once())
    for answer, (text, n_tokens), length in zip(answers, expected, lengths):
        assert answer.choices[0].message.content == text
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (length, n_tokens)
    assert fp32.peak >= 3


def test_streams_and_stop_strings_in_one_batch_with_clients_in_threads(fp32, client):
    """Eight streamed requests from eight threads, half of them with a stop string from the middle of their reply."""
    requests = [REQUESTS[i % len(REQUESTS)][:4] + (100 + i,) for i in range(8)]
    requests = [(m, 1.0 if t == 0 else t, k, 40, s) for m, t, k, n, s in requests]  # sampled: long enough to cut
    expected = []
    for i, r in enumerate(requests):
        text, _ = expect(fp32, r)
        stop = text[len(text) // 2:len(text) // 2 + 3] if i % 2 and len(text) >= 12 else None
        expected.append((stop, text[:text.index(stop)] if stop else text))

    def stream(i):
        chunks = list(chat(client, *requests[i], stream=True, stop=expected[i][0]))
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].choices[0]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(stream, range(8)))
    for (text, last), (stop, want) in zip(results, expected):
        assert text == want
        if stop:
            assert last.finish_reason == "stop"
    assert sum(1 for stop, _ in expected if stop) >= 2  # stop strings were tried
    assert fp32.peak >= 4


def test_a_client_that_leaves_leaves_the_batch_at_once(fp32, monkeypatch):
    """Two streams decode together; one client goes: its row leaves at once, the other reply goes on, unchanged."""
    # 250 steps take 2.5 s at least: the second request meets the first
    before_worker_steps(monkeypatch, lambda: time.sleep(0.008))
    seed = long_reply_seed(fp32, HELLO, 250)
    expected = engine_reply(fp32, HELLO, 400, 2.0, 0, seed)[0]
    body = {"messages": HELLO, "temperature": 2.0, "top_k": 0, "max_tokens": 400, "seed": seed}
    before = fp32.stats()
    with httpx.Client(timeout=60, verify=False) as stays, httpx.Client(timeout=60, verify=False) as goes:
        with stays.stream("POST", fp32.url + "/chat/completions", json=body) as kept:
            lines = kept.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            with goes.stream("POST", fp32.url + "/chat/completions", json=body) as left:
                next(line for line in left.iter_lines() if line.startswith("data: "))
                deadline = time.time() + 2  # its first token is sent just before it joins the cache
                while fp32.stats()["batch_rows"] != [2]:
                    assert time.time() < deadline, fp32.stats()
                    time.sleep(0.001)
            # the connection is closed: the row leaves within a few steps, the other still decodes
            deadline = time.time() + 2
            while fp32.stats()["batch_rows"] != [1]:
                assert time.time() < deadline, fp32.stats()
                time.sleep(0.005)
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert events[-1] == {"done": True}
    after = wait_no_batch(fp32)
    assert after["requests_cancelled"] == before["requests_cancelled"] + 1
    assert after["requests_served"] == before["requests_served"] + 1
    # the stream that stayed: its first event was read above, the rest here, all of it the engine's reply alone
    assert told_text([first, *events[:-1]]) == expected


def test_the_compiled_step_serves_the_eager_steps_replies(fp32, compiled_server):
    """
    A server whose engine decodes with the compiled step (chat_web --compile_decode=true), in fp32: three greedy
    requests of different lengths that start together, then one that joins them mid-decode; each gets the eager
    engine's reply, token for token. The worker is held between steps (Worker.submit) so that they meet as planned:
    four rows, one shape to compile.
    """
    requests = [(m, 0, 0, n, 0) for m, _, _, n, _ in REQUESTS[:3]] + [(HELLO, 0, 0, 10, 0)]
    expected = [expect(fp32, r) for r in requests]
    assert min(n for _, n in expected[:3]) >= 10, expected  # long enough to still decode when the last one comes
    worker = compiled_server.pool.workers[0]
    client = openai.OpenAI(base_url=compiled_server.url + "/v1", api_key="k", max_retries=0, timeout=300)
    gates = [threading.Event(), threading.Event()]

    def wait_for(condition):
        deadline = time.time() + 60
        while not condition():
            assert time.time() < deadline
            time.sleep(0.005)
    with ThreadPoolExecutor(len(requests)) as threads:
        worker.submit(gates[0].wait, 60)
        answers = [threads.submit(chat, client, *r) for r in requests[:3]]
        wait_for(lambda: worker.inbox.qsize() == 3)  # the three wait for the worker together
        gates[0].set()
        wait_for(lambda: worker.tokens_generated >= 3)  # their first tokens are out
        worker.submit(gates[1].wait, 60)
        wait_for(lambda: worker.inbox.empty())  # the worker waits between two steps
        answers.append(threads.submit(chat, client, *requests[3]))
        wait_for(lambda: worker.inbox.qsize() == 1)
        assert compiled_server.stats()["batch_rows"][0] >= 1  # it joins a batch that decodes
        gates[1].set()
        for answer, (text, n_tokens) in zip(answers, expected):
            assert (answer.result().choices[0].message.content, answer.result().usage.completion_tokens) == \
                (text, n_tokens)
    assert list(compiled_server.engine.static_caches) == [(4, 512, torch.float32)]  # one shape: 4 rows, the context


def test_a_full_queue_is_answered_with_one_line_429_and_what_never_fits_with_400(chat_web_server, client, monkeypatch):
    server = chat_web_server
    wait_no_batch(server)
    gate = threading.Event()
    before_worker_steps(monkeypatch, lambda: gate.wait(timeout=30))  # the running request holds its row till then
    monkeypatch.setattr(server.pool, "max_batch", 1)
    monkeypatch.setattr(server.pool, "max_queue", 1)
    body = {"messages": HELLO, "temperature": 0, "max_tokens": 5}
    with ThreadPoolExecutor(2) as threads:
        running = threads.submit(server.http.post, server.url + "/chat/completions", json=body)
        deadline = time.time() + 10
        while server.stats()["held_rows"] != [1]:
            assert time.time() < deadline, server.stats()
            time.sleep(0.005)
        waiting = threads.submit(chat, client, HELLO, 0, 0, 5, 0)
        while server.stats()["queue"] != 1:
            assert time.time() < deadline, server.stats()
            time.sleep(0.005)
        refused = server.http.post(server.url + "/chat/completions", json=body)
        assert refused.status_code == 429
        detail = refused.json()["detail"]
        assert "busy" in detail and "\n" not in detail
        with pytest.raises(openai.RateLimitError) as raised:
            chat(client, HELLO, 0, 0, 5, 0)
        error = raised.value.body
        assert error["code"] == "rate_limit_exceeded" and "busy" in error["message"] and "\n" not in error["message"]
        with pytest.raises(openai.RateLimitError):
            chat(client, HELLO, 0, 0, 5, 0, stream=True)  # a stream is refused before it starts
        assert server.stats()["requests_refused"] >= 3
        gate.set()
        assert running.result().status_code == 200
        assert waiting.result().choices[0].finish_reason in ("stop", "length")
    # a request that needs more tokens than the server holds for one: 400 on both APIs, whatever the load
    monkeypatch.setattr(server.pool, "max_tokens_in_flight", 100)
    refused = server.http.post(server.url + "/chat/completions", json={**body, "max_tokens": 200})
    assert refused.status_code == 400 and "100" in refused.json()["detail"]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        chat(client, HELLO, 0, 0, 200, 0)
    assert chat(client, HELLO, 0, 0, 5, 0).choices[0].message.content is not None  # a small one still runs
    wait_no_batch(server)
