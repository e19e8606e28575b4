"""
What the web server's tests share (tests/web); not a test module: they import from here.

A free port, waiting for a started chat_web, the engine's own reply to compare a served one with, texts after which
a model ends its document, the server's decoding steps paced, held or failed.
"""

import os
import threading
import time

import pytest
import torch

HELLO = [{"role": "user", "content": "Hello! What is a list comprehension?"}]


def free_port():
    """A TCP port free on 127.0.0.1 right now."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(process, url, timeout=60):
    """
    Wait until the chat_web started as `process` (start_script, its output piped) answers {url}/health; fail if it
    ends first or takes longer than `timeout` seconds.
    """
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
    """
    What the engine itself generates for this request, computed as the worker computes it (in its compute dtype,
    in this process: the same threads): (text, number of tokens).
    """
    prompt = served.tokenizer.render_for_completion({"messages": messages})
    budget = min(max_tokens, served.engine.context_len - len(prompt))
    with served.pool.workers[0].autocast():
        results, _ = served.engine.generate_batch(prompt, max_tokens=budget, temperature=temperature, top_k=top_k,
                                                  seed=seed)
    return served.tokenizer.decode(results[0][len(prompt):]), len(results[0]) - len(prompt)


def before_worker_steps(monkeypatch, before):
    """
    engine.decode_step with before() run first (a pause, a gate, an injected failure) in the server's worker threads
    only: the engine's own replies that the tests compute meanwhile, in their own thread, run as they are. Returns
    the step it wraps.
    """
    from nanochat import engine
    real_step = engine.decode_step

    def step(*args, **kwargs):
        if threading.current_thread().name.startswith("nanochat-worker"):
            before()
        return real_step(*args, **kwargs)
    monkeypatch.setattr(engine, "decode_step", step)
    return real_step


def wait_idle(served, timeout=10):
    """Wait until the server has no request generating or queued; returns its /stats."""
    deadline = time.time() + timeout
    while (stats := served.stats())["busy"] or stats["queue"]:
        assert time.time() < deadline, stats
        time.sleep(0.01)
    return stats


def wait_no_batch(served, timeout=10):
    """Wait until no request holds a row or waits, and the worker's thread has left its batch."""
    deadline = time.time() + timeout
    while (stats := wait_idle(served, timeout))["batch_rows"] != [0]:
        assert time.time() < deadline, stats
        time.sleep(0.01)
    return stats


# the special tokens of the calculator's use, as nanochat's API streams them (serving.reply_pieces with blocks)
TOOL_EDGES = {("tool_call", ""): "<|python_start|>", ("tool_call_end", True): "<|python_end|>",
              ("tool_output", ""): "<|output_start|>", ("tool_output_end", True): "<|output_end|>"}


def told_text(events):
    """
    The text of nanochat's API's events (not the done event) as the tokenizer decodes the reply's tokens: the text
    pieces, the calculator's call and output, and its special tokens written back where their edge events are.
    """
    text = []
    for event in events:
        (kind, value), = [(k, v) for k, v in event.items() if k != "gpu"]
        text.append(TOOL_EDGES.get((kind, value), value))
    return "".join(text)
