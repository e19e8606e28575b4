"""
Tests of the OpenAI-compatible API (nanochat/openai_api.py) with OpenAI's own Python client.

Against the session's real uvicorn server on 127.0.0.1 (web/conftest.py's chat_web_server: a tiny trained model,
one CPU worker): the model list, a whole reply and a streamed one (the engine's tokens, usage counts, stop strings,
whole characters only), bad requests (400 naming the field), an unknown model (404), the API key (401), a client
that leaves, a failing generation, and /v1/completions as lm-evaluation-harness's `local-completions` calls it
(token-id prompts, echo, logprobs equal to the model's own forward pass after one <|bos|>, the token that ends a
document reported).
"""

import pytest
import torch

from web.served import HELLO, before_worker_steps, document_ends, engine_reply, wait_idle

openai = pytest.importorskip("openai", reason="needs the openai pip package: pip install openai")


@pytest.fixture(scope="module")
def client(chat_web_server):
    """OpenAI's client, pointed at the server. No retries: a test must see the first answer."""
    return openai.OpenAI(base_url=chat_web_server.url + "/v1", api_key="any key works", max_retries=0, timeout=60)


def reply_seed(server, messages, min_tokens):
    """
    A seed whose reply (temperature 1, top_k 50) has at least `min_tokens` tokens: the tiny model often ends
    its turn at once.
    """
    return next(s for s in range(300) if engine_reply(server, messages, 60, 1.0, 50, s)[1] >= min_tokens)


def chat(client, messages=HELLO, **kwargs):
    return client.chat.completions.create(model="nanochat", messages=messages, **kwargs)


# -----------------------------------------------------------------------------
# Chat

def test_the_model_is_listed_and_retrieved(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["nanochat"] and models[0].object == "model" and models[0].owned_by == "nanochat"
    assert client.models.retrieve("nanochat").id == "nanochat"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_a_whole_reply_is_the_engines_with_its_usage(chat_web_server, client):
    with_system = [{"role": "system", "content": "You are terse."}, *HELLO]
    for messages in (HELLO, with_system):
        seed = reply_seed(chat_web_server, messages, 5)
        expected, n_tokens = engine_reply(chat_web_server, messages, 60, 1.0, 50, seed)
        answer = chat(client, messages, temperature=1.0, max_tokens=60, seed=seed, extra_body={"top_k": 50})
        assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-") and answer.model == "nanochat"
        (choice,) = answer.choices
        assert choice.message.role == "assistant" and choice.message.content == expected
        assert choice.finish_reason == ("length" if n_tokens == 60 else "stop")
        # the system message is rendered as nanochat renders it: merged into the first user message
        prompt = chat_web_server.tokenizer.render_for_completion({"messages": messages})
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(prompt), n_tokens)
        assert answer.usage.total_tokens == len(prompt) + n_tokens
    # max_completion_tokens (the newer name) cuts the reply: finish_reason "length"
    seed = reply_seed(chat_web_server, HELLO, 10)
    answer = chat(client, temperature=1.0, max_completion_tokens=3, seed=seed, extra_body={"top_k": 50})
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 3
    # content as a list of text parts, and a developer message (the newer name of system)
    parts = [{"role": "developer", "content": "You are terse."},
             {"role": "user", "content": [{"type": "text", "text": "Hello!"}, {"type": "text", "text": "Hi?"}]}]
    as_rendered = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!\nHi?"}]
    answer = chat(client, parts, temperature=0, max_tokens=20)
    assert answer.usage.prompt_tokens == len(chat_web_server.tokenizer.render_for_completion({"messages": as_rendered}))
    assert answer.choices[0].message.content == engine_reply(chat_web_server, as_rendered, 20, 0, 0, 0)[0]


def streamed(client, **kwargs):
    """A streamed reply: (its chunks, the text pieces)."""
    chunks = list(chat(client, stream=True, **kwargs))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    return chunks, pieces


def test_the_streamed_reply_is_the_whole_reply(chat_web_server, client):
    # a question whose greedy reply is not empty (the tiny model's greedy reply often is)
    messages = next(m for i in range(100)
                    if engine_reply(chat_web_server, m := [{"role": "user", "content": f"Question {i}?"}],
                                    40, 0, 0, 0)[1] >= 5)
    kwargs = dict(messages=messages, temperature=0, max_tokens=40, seed=7)
    whole = chat(client, **kwargs)
    chunks, pieces = streamed(client, stream_options={"include_usage": True}, **kwargs)
    assert "".join(pieces) == whole.choices[0].message.content and whole.choices[0].message.content
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason  # the last choice chunk
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage  # include_usage: one more chunk, last
    assert all(c.usage is None for c in chunks[:-1])
    # pieces hold whole characters: a reply whose tokens split multi-byte characters streams the same text as
    # the engine decodes at once (a split character would show as U+FFFD)
    messages = [{"role": "user", "content": "Écris « ✨ » et 中文, s'il te plaît"}]
    seed = next(s for s in range(300)
                if any(ord(ch) > 127 for ch in engine_reply(chat_web_server, messages, 60, 2.0, 0, s)[0]))
    expected = engine_reply(chat_web_server, messages, 60, 2.0, 0, seed)[0]
    _, pieces = streamed(client, messages=messages, temperature=2.0, max_tokens=60, seed=seed, extra_body={"top_k": 0})
    assert "".join(pieces) == expected


def test_a_stop_string_ends_the_reply_before_it(chat_web_server, client):
    seed = reply_seed(chat_web_server, HELLO, 20)
    kwargs = dict(temperature=1.0, max_tokens=60, seed=seed, extra_body={"top_k": 50})
    full = chat(client, **kwargs).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 3]
    answer = chat(client, stop=["never in this reply \u2603", stop], **kwargs)
    assert answer.choices[0].message.content == full[:full.index(stop)] and answer.choices[0].finish_reason == "stop"
    _, pieces = streamed(client, stop=stop, **kwargs)
    assert "".join(pieces) == full[:full.index(stop)]


BAD_CHATS = {  # the openai client's arguments, and the field the 400 names
    "no messages": (dict(messages=[]), "messages"),
    "a message not an object": (dict(messages=["hi"]), "messages[0]"),
    "an unknown role": (dict(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]), "messages[0].role"),
    "system after the first message": (dict(messages=[*HELLO, {"role": "system", "content": "x"}]), "messages[1].role"),
    "two users in a row": (dict(messages=[HELLO[0], HELLO[0]]), "messages[1].role"),
    "ends with the assistant": (dict(messages=[HELLO[0], {"role": "assistant", "content": "x"}]), "messages[1].role"),
    "an image": (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]),
                 "messages[0].content[0]"),
    "content not text": (dict(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    "a message too long": (dict(messages=[{"role": "user", "content": "x" * 8001}]), "messages[0].content"),
    "longer than the context": (dict(messages=[{"role": "user", "content": "one two three four five " * 300}]),
                                "messages"),
    "temperature too high": (dict(temperature=2.5), "temperature"),
    "temperature a string": (dict(extra_body={"temperature": "hot"}), "temperature"),
    "top_p below 1": (dict(top_p=0.9), "top_p"),
    "top_p zero": (dict(top_p=0), "top_p"),
    "top_k beyond the vocabulary": (dict(extra_body={"top_k": 10**6}), "top_k"),
    "two choices": (dict(n=2), "n"),
    "max_tokens zero": (dict(max_tokens=0), "max_tokens"),
    "max_completion_tokens too large": (dict(max_completion_tokens=10**6), "max_completion_tokens"),
    "a negative seed": (dict(seed=-1), "seed"),
    "tools": (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools"),
    "logprobs": (dict(logprobs=True), "logprobs"),
    "a penalty": (dict(presence_penalty=1.0), "presence_penalty"),
    "too many stop strings": (dict(extra_body={"stop": ["a"] * 17}), "stop"),
    "a stop string too long": (dict(stop=["x" * 101]), "stop[0]"),
    "stream not a bool": (dict(extra_body={"stream": "yes"}), "stream"),
    "include_usage not a bool": (dict(stream=True, stream_options={"include_usage": "yes"}),
                                 "stream_options.include_usage"),
    "a tool call in a message": (dict(messages=[HELLO[0], {"role": "assistant", "content": "x", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, HELLO[0]]),
                                 "messages[1].tool_calls"),
}


@pytest.mark.parametrize("name", list(BAD_CHATS))
def test_a_bad_chat_request_is_a_400_naming_the_field(chat_web_server, client, name):
    kwargs, field = BAD_CHATS[name]
    served = chat_web_server.stats()["requests_served"]
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, **{"messages": HELLO, **kwargs})
    assert refused.value.param == field and refused.value.body["message"].startswith(f"{field}: "), refused.value.body
    assert chat_web_server.stats()["requests_served"] == served  # refused before anything was generated


@pytest.mark.parametrize("raw", [b'{"messages": [', b"", b"[1, 2]", b'"text"', b"[" * 100_000])
def test_a_body_that_is_not_a_json_object_is_a_400(chat_web_server, raw):
    response = chat_web_server.http.post(chat_web_server.url + "/v1/chat/completions", content=raw)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "body" and response.json()["error"]["type"] == "invalid_request_error"


def test_fields_it_does_not_know_are_ignored(client):
    answer = chat(client, max_tokens=2, user="someone", extra_body={"colour": "blue", "top_k": -1})
    assert answer.choices[0].message.role == "assistant"  # top_k -1: the whole vocabulary, as vLLM's


def test_another_model_or_path_is_a_404(chat_web_server, client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert missing.value.code == "model_not_found" and "nanochat" in missing.value.message
    response = chat_web_server.http.post(chat_web_server.url + "/v1/embeddings", json={"input": "x"})
    assert response.status_code == 404 and "/v1/chat/completions" in response.json()["error"]["message"]


def test_with_an_api_key_only_that_key_is_accepted(chat_web_server, client, monkeypatch):
    monkeypatch.setattr(chat_web_server.app.state.settings, "api_key", "secret-key")
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    with pytest.raises(openai.AuthenticationError):
        chat(client, max_tokens=2)
    response = chat_web_server.http.get(chat_web_server.url + "/v1/models")  # no Authorization header at all
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    keyed = client.with_options(api_key="secret-key")
    assert keyed.models.list().data[0].id == "nanochat"
    assert chat(keyed, max_tokens=2).choices[0].message.role == "assistant"


def test_a_client_that_leaves_a_stream_frees_its_worker(chat_web_server, client, long_seed):
    seed, full = long_seed
    before = wait_idle(chat_web_server)
    with chat(client, stream=True, temperature=2.0, max_tokens=500, seed=seed, extra_body={"top_k": 0}) as stream:
        next(c for c in stream if c.choices and c.choices[0].delta.content)  # the reply is being generated
    after = wait_idle(chat_web_server, timeout=5)
    assert after["requests_cancelled"] == before["requests_cancelled"] + 1
    assert after["tokens_generated"] - before["tokens_generated"] < full // 2  # the rest was never computed


def test_a_failing_generation_is_an_error_and_the_server_goes_on(chat_web_server, client, monkeypatch):
    calls = []

    def fail_every_second():  # fault injection: the first token and one real step, then the device "fails"
        calls.append(1)
        if len(calls) % 2 == 0:
            raise RuntimeError("injected failure")

    seed = reply_seed(chat_web_server, HELLO, 5)
    kwargs = dict(temperature=1.0, max_tokens=20, seed=seed, extra_body={"top_k": 50})
    before_worker_steps(monkeypatch, fail_every_second)
    with pytest.raises(openai.APIError, match="injected failure"):  # streamed: an error event, which the client raises
        list(chat(client, stream=True, **kwargs))
    with pytest.raises(openai.InternalServerError, match="injected failure"):
        chat(client, **kwargs)
    monkeypatch.undo()
    assert chat(client, **kwargs).choices[0].message.content
    assert wait_idle(chat_web_server)["busy"] == 0


# -----------------------------------------------------------------------------
# Completions, as lm-evaluation-harness's local-completions calls them

def model_logprobs(server, ids):
    """
    The model's log-probabilities of each token of ids after the ones before it, from its own forward pass in the
    worker's compute dtype.
    """
    model = server.engine.model
    with torch.no_grad(), server.pool.workers[0].autocast():
        logprobs = torch.log_softmax(model(torch.tensor([ids]))[0], dim=-1)
    return logprobs, [logprobs[j - 1, ids[j]].item() for j in range(1, len(ids))]


def test_loglikelihood_requests_get_the_models_own_logprobs(chat_web_server):
    tokenizer = chat_web_server.tokenizer
    context = tokenizer.encode("def add(a, b):\n    return", prepend="<|bos|>")
    continuation = tokenizer.encode(" a + b")
    ids = context + continuation
    # the request lm-eval sends for a loglikelihood (tokenized_requests=True: a batch of token-id prompts)
    payload = {"model": "nanochat", "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
               "echo": True}
    response = chat_web_server.http.post(chat_web_server.url + "/v1/completions", json=payload)
    assert response.status_code == 200, response.text
    answer = response.json()
    (choice,) = answer["choices"]
    report = choice["logprobs"]
    logprobs, expected = model_logprobs(chat_web_server, ids)
    generated = logprobs[-1].argmax().item()  # temperature 0: the most likely next token
    assert report["tokens"] == [tokenizer.id_to_token(t) for t in ids + [generated]]
    assert report["token_logprobs"][0] is None and report["top_logprobs"][0] is None  # nothing predicts the first token
    assert report["token_logprobs"][1:-1] == pytest.approx(expected, abs=1e-5)
    assert report["token_logprobs"][-1] == pytest.approx(logprobs[-1, generated].item(), abs=1e-5)
    # what lm-eval reads (parse_logprobs): the continuation's log-likelihood, and whether it is the greedy one
    ctxlen = len(context)
    assert sum(report["token_logprobs"][ctxlen:-1]) == pytest.approx(sum(expected[ctxlen - 1:]), abs=1e-4)
    greedy = all(lp == max(top.values())
                 for lp, top in zip(report["token_logprobs"][ctxlen:-1], report["top_logprobs"][ctxlen:-1]))
    assert greedy == all(logprobs[j - 1].argmax().item() == ids[j] for j in range(ctxlen, len(ids)))
    for j in range(1, len(ids)):  # top_logprobs[j] holds the top-1 and the token itself
        top = report["top_logprobs"][j]
        assert max(top.values()) == pytest.approx(logprobs[j - 1].max().item(), abs=1e-5)
        assert tokenizer.id_to_token(ids[j]) in top
    if generated in chat_web_server.engine.end_tokens:  # the end of the document is a token, but not text
        assert choice["text"] == tokenizer.decode(ids) and choice["finish_reason"] == "stop"
    else:
        assert choice["text"] == tokenizer.decode(ids + [generated]) and choice["finish_reason"] == "length"
    assert report["text_offset"][0] == 0 and report["text_offset"] == sorted(report["text_offset"])
    assert answer["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}
    # the same prompt without its <|bos|>, as lm-eval's remote tokenizer sends a context: the model reads one all the
    # same, which is neither echoed nor counted, and the first token sent gets its log-probability after it
    payload["prompt"] = [ids[1:]]
    bare = chat_web_server.http.post(chat_web_server.url + "/v1/completions", json=payload).json()
    assert bare["choices"][0]["logprobs"]["tokens"] == report["tokens"][1:]
    assert bare["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(report["token_logprobs"][1:], abs=1e-5)
    assert bare["choices"][0]["text"] == choice["text"][len("<|bos|>"):]
    assert bare["usage"]["prompt_tokens"] == len(ids) - 1


def test_a_completion_that_ends_the_document_reports_its_end_token(chat_web_server, chat_web_base):
    """
    Where the model's greedy next token is <|bos|> (the end of the document), the one token lm-eval asks for is
    that <|bos|>: token_logprobs has one entry per prompt token and one more, as the harness reads it
    (token_logprobs[ctxlen:-1]), and the text stays without it.
    """
    tokenizer = chat_web_server.tokenizer
    http = chat_web_server.http
    url = chat_web_server.url
    ends = document_ends(chat_web_server.engine.model, tokenizer, chat_web_base / "base_data" / "pydocs", 3)
    ended = 0
    for text, ids in ends:
        payload = {"prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": True}
        answer = http.post(url + "/v1/completions", json=payload).json()
        (choice,) = answer["choices"]
        report = choice["logprobs"]
        assert len(report["tokens"]) == len(report["token_logprobs"]) == len(report["top_logprobs"]) == len(ids) + 1
        assert answer["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}
        if choice["finish_reason"] == "stop":  # this server's dtype may tip a near tie the other way: most end here
            ended += 1
            assert report["tokens"][-1] == "<|bos|>" and choice["text"] == text
            assert report["token_logprobs"][-1] == max(report["top_logprobs"][-1].values())  # the greedy token
            assert report["text_offset"][-1] == len(text)
            alone = http.post(url + "/v1/completions", json={**payload, "echo": False}).json()
            assert alone["choices"][0]["text"] == "" and alone["choices"][0]["logprobs"]["tokens"] == ["<|bos|>"]
    assert ended >= 2
    # a prompt must leave room for the <|bos|> the model reads first and for one token: 510 tokens sent are 512 read
    room = http.post(url + "/v1/completions", json={"prompt": [5] * 510, "max_tokens": 1, "logprobs": 0, "echo": True})
    assert room.status_code == 200 and len(room.json()["choices"][0]["logprobs"]["tokens"]) == 511


def test_text_prompts_are_read_after_bos_and_continued(chat_web_server, client):
    tokenizer = chat_web_server.tokenizer
    engine = chat_web_server.engine
    texts = ["import os\n", "The quick brown"]
    answer = client.completions.create(model="nanochat", prompt=texts, max_tokens=8, temperature=0, echo=True,
                                       logprobs=2)
    assert [c.index for c in answer.choices] == [0, 1]
    generated = 0
    for text, choice in zip(texts, answer.choices):
        prompt = tokenizer.encode(text, prepend="<|bos|>")
        with chat_web_server.pool.workers[0].autocast():  # as the worker computes it
            # with its end token
            reply = [column[0] for column, _ in engine.generate(prompt, max_tokens=8, temperature=0)]
        generated += len(reply)
        text_tokens = [t for t in reply if t not in engine.end_tokens]
        assert choice.text == text + tokenizer.decode(text_tokens)  # the echo is what was sent: no <|bos|>
        assert choice.finish_reason == ("stop" if len(text_tokens) < len(reply) else "length")
        assert choice.logprobs.tokens == [tokenizer.id_to_token(t) for t in prompt[1:] + reply]
        # the first token sent too: <|bos|> is before it
        assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)
    prompt_tokens = sum(len(tokenizer.encode(t)) for t in texts)
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, generated)
    # without echo: the continuation only; max_tokens 0 with echo: scoring only
    plain = client.completions.create(model="nanochat", prompt=texts[1], max_tokens=8, temperature=0)
    assert texts[1] + plain.choices[0].text == answer.choices[1].text and plain.choices[0].logprobs is None
    scored = client.completions.create(model="nanochat", prompt=texts[1], max_tokens=0, echo=True, logprobs=0)
    ids = tokenizer.encode(texts[1], prepend="<|bos|>")
    assert scored.choices[0].text == texts[1] and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs == pytest.approx(model_logprobs(chat_web_server, ids)[1], abs=1e-5)


BAD_COMPLETIONS = {
    "no prompt": (dict(prompt=[]), "prompt"),
    "a token outside the vocabulary": (dict(prompt=[1, 2, 10**6]), "prompt"),
    "an empty token list in a batch": (dict(prompt=[[1, 2], []]), "prompt[1]"),
    "a prompt longer than the context": (dict(prompt=[5] * 600, max_tokens=0), "prompt"),
    "a prompt that fills the context": (dict(prompt=[5] * 512, max_tokens=1), "prompt"),
    "a prompt that fills it with the <|bos|> read first": (dict(prompt=[5] * 511, max_tokens=1), "prompt"),
    "too many prompts": (dict(prompt=["x"] * 65), "prompt"),
    "a prompt neither text nor token ids": (dict(prompt=[[1], 2.5]), "prompt[1]"),
    "max_tokens negative": (dict(prompt="x", max_tokens=-1), "max_tokens"),
    "too many logprobs": (dict(prompt="x", logprobs=21), "logprobs"),
    "streaming": (dict(prompt="x", stream=True), "stream"),
    "best_of": (dict(prompt="x", best_of=3), "best_of"),
    "a suffix": (dict(prompt="x", suffix="y"), "suffix"),
}


@pytest.mark.parametrize("name", list(BAD_COMPLETIONS))
def test_a_bad_completions_request_is_a_400_naming_the_field(client, name):
    kwargs, field = BAD_COMPLETIONS[name]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="nanochat", **kwargs)
    assert refused.value.param == field and refused.value.body["message"].startswith(f"{field}: "), refused.value.body


def test_the_tokenizer_endpoints_serve_lm_evals_remote_tokenizer(chat_web_server):
    url = chat_web_server.url
    tokenizer = chat_web_server.tokenizer
    http = chat_web_server.http
    info = http.get(url + "/tokenizer_info").json()
    assert info["bos_token"] == "<|bos|>" and "eos_token" in info and info["model_max_length"] == 512
    # the harness finds the BOS id by tokenizing the BOS string (RemoteTokenizer.bos_token_id), without special tokens
    tokenize = lambda body: http.post(url + "/tokenize", json=body).json()["tokens"]
    assert tokenize({"prompt": "<|bos|>", "add_special_tokens": False}) == [tokenizer.get_bos_token_id()]
    text = "def f(x):\n    return x ✨"
    assert tokenize({"prompt": text, "add_special_tokens": False}) == tokenizer.encode(text)
    assert tokenize({"prompt": text}) == tokenizer.encode(text, prepend="<|bos|>")
    detokenized = http.post(url + "/detokenize", json={"tokens": tokenizer.encode(text)}).json()
    assert detokenized == {"prompt": text}
    refused = http.post(url + "/detokenize", json={"tokens": [10**6]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"
    refused = http.post(url + "/tokenize", json={"add_special_tokens": False})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
