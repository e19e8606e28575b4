"""
Serve a model over HTTP: the checks every request passes, a request's row in a batch, and the FastAPI app.

The app (create_app) serves nanochat's own API; scripts/chat_web.py mounts the OpenAI-compatible one on it
(nanochat/openai_api.py's mount), on the same workers.

Requests are decoded in batches (nanochat/batching.py: a worker per device, a row of its batch per request). Job
holds a request's row: the pool's limits are asked when the request arrives, before a stream starts (429 while its
queue is full, 400 for a request that can never fit). Tokens reach the event loop as soon as they are sampled: the
loop stays free to accept requests, answer /stats and stream every reply. Between two tokens the server checks that
the client is still there (reply_pieces): one that left takes its row out of the batch before the next step.

Both APIs check a request with the same functions (read_body, checked_field, check_chat, check_sampling) before
anything is generated: a bad one raises APIError 400, its message starting with the field at fault
("messages[2].role: ...": field_error). They are written out, not pydantic models: most limits come from the
server's settings and model (a model could not hold them), and each message says what to send; pydantic models were
no shorter, their messages vaguer, and union fields needed glue to name the field at fault.
"""

import json
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

import nanochat
from nanochat.engine import TextStreamer

logger = logging.getLogger("nanochat.serving")
UI_PATH = os.path.join(os.path.dirname(os.path.abspath(nanochat.__file__)), "ui.html")  # shipped as package data
PART_TYPES = ("text", "python", "python_output")  # the parts of an assistant message (tokenizer.render_conversation)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # a stream's headers: no proxy buffering


@dataclass
class Settings:
    """The server's settings (chat_web's command line), in app.state.settings: read by both APIs."""
    temperature: float  # a request's defaults, where it sets none
    top_k: int
    max_tokens: int
    max_tokens_limit: int  # the largest max_tokens a request may ask for
    max_messages: int  # most messages a request may hold
    max_message_chars: int  # longest message, in characters
    max_conversation_chars: int  # longest conversation (all messages together), or text prompt, in characters
    model_name: str  # the OpenAI API's model, in /v1/models; a request naming another gets 404
    api_key: str  # if not empty, the OpenAI API requires "Authorization: Bearer <api_key>"


# -----------------------------------------------------------------------------
# Generating a reply on a worker


class Job:
    """
    One request's row in a worker's batch. Job(pool, need) checks the pool's limits at once (WorkerPool.refusal:
    APIError 429 / 400, before any response starts); `async with job` waits for a row, and on exit stops the
    generation (before the next step) and gives the row back, counting the request as served (set job.outcome),
    cancelled (the client left: the default) or failed (an exception).
    """

    def __init__(self, pool, need):
        refused = pool.refusal(need)
        if refused is not None:
            why, message = refused
            if why == "never":
                raise APIError(400, message, code="context_length_exceeded")
            raise APIError(429, message, code="rate_limit_exceeded", kind="rate_limit_error")
        self.pool = pool
        self.need = need
        self.outcome = "cancelled"
        self.stop = threading.Event()

    async def __aenter__(self):
        self.worker = await self.pool.acquire(self.need)
        self.t0 = time.perf_counter()
        return self

    async def __aexit__(self, kind, error, traceback):
        self.stop.set()
        if kind is not None and issubclass(kind, Exception):  # not CancelledError: a client that left is no error
            self.outcome = "failed"
        seconds = time.perf_counter() - self.t0
        self.pool.release(self.worker, self.need, self.outcome, seconds)
        logger.info(f"worker {self.worker.index}: {self.outcome} after {seconds:.2f}s")

    def start(self, prompt, sampling):
        """
        Start a generation on the job's row (Worker.start), stopping the job's last one; returns its queue of token
        ids.
        """
        self.stop.set()
        self.stop = threading.Event()
        return self.worker.start(prompt, sampling, self.stop)


class ReplyText:
    """
    Token ids in, text out: whole characters only (engine.TextStreamer), and nothing from the first of `stops` on.
    Text that may be the start of a stop string is held back until the next tokens show whether it is one.
    """

    def __init__(self, tokenizer, stops):
        self.streamer = TextStreamer(tokenizer)
        self.stops = stops
        self.held = ""
        self.stopped = False

    def put(self, token):
        return self._release(self.streamer.put(token))

    def end(self):
        return self._release(self.streamer.end(), final=True)

    def _release(self, text, final=False):
        self.held += text
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            return self.held[:min(hits)]
        keep = 0 if final else max((k for s in self.stops for k in range(1, min(len(s), len(self.held) + 1))
                                    if self.held.endswith(s[:k])), default=0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out


@dataclass
class Reply:
    tokens: list = field(default_factory=list)  # the token ids generated (not the end-of-turn token)
    end_token: int = None  # the token that ended the turn (<|assistant_end|> or <|bos|>), if one did
    finish_reason: str = None  # "stop" or "length"; None while generating, and if the client left
    cut: bool = False  # a stop string ended it


async def reply_pieces(job, request, prompt, sampling, stops, reply, blocks=False):
    """
    The text of one reply, piece by piece as it is generated on the job's worker, filling `reply`: (kind, text)
    pairs; the text ends before the first of the strings `stops`. Between two tokens, checks that the client is
    still there; if not, ends with reply.finish_reason None (the caller then stops too, and Job's exit stops the
    generation). Without `blocks` every piece is ("token", text), the tool's special tokens written out in it as the
    tokenizer decodes them. With `blocks` the calculator's call and what it answered are pieces of their own: the
    tool's four special tokens become ("tool_call", "") (a call opens), ("tool_call_end", True), ("tool_output", "")
    and ("tool_output_end", True); the text between them comes as ("tool_call", text) / ("tool_output", text), the
    rest as ("token", text). Every token is then in the pieces once, so the reply's text can be told back exactly.
    """
    engine = job.worker.engine
    edges = {engine.python_start: ("tool_call", "", "tool_call"), engine.python_end: ("tool_call_end", True, "token"),
             engine.output_start: ("tool_output", "", "tool_output"),
             engine.output_end: ("tool_output_end", True, "token")} if blocks else {}
    kind = "token"
    tokens = job.start(prompt, sampling)
    text = ReplyText(job.pool.tokenizer, stops)
    while (token := await tokens.get()) is not None:
        if isinstance(token, Exception):
            raise token
        if token in engine.end_tokens:  # the model ended its turn: not text, and the last token
            reply.end_token = token
            continue
        reply.tokens.append(token)
        if token in edges:  # what the streamer holds belongs to the piece before the block's edge
            piece = text.end()
            if piece:
                yield kind, piece
            text = ReplyText(job.pool.tokenizer, stops)
            edge, value, kind = edges[token]
            yield edge, value
            continue
        piece = text.put(token)
        if piece:
            yield kind, piece
        if text.stopped:
            job.stop.set()
            break
        if await request.is_disconnected():
            return
    piece = "" if text.stopped else text.end()
    if piece:
        yield kind, piece
    reply.cut = text.stopped
    # neither the end of the turn nor a stop string: max_tokens (which the end of the context caps) ended it
    reply.finish_reason = "stop" if text.stopped or reply.end_token is not None else "length"


def sse(payload):
    """One server-sent event."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# -----------------------------------------------------------------------------
# Requests and their checks, for both APIs


class APIError(Exception):
    """A request answered with an error, raised anywhere in it: HTTP `status` and a message (OpenAI's error fields)."""

    def __init__(self, status, message, param=None, code=None, kind="invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind


def field_error(param, problem, code=None):
    """The APIError (400) to raise for a bad field `param`: its message starts with the field's name, then `problem`."""
    return APIError(400, f"{param}: {problem}", param=param, code=code)


KINDS = {"int": ((int,), "an integer"), "number": ((int, float), "a number"), "bool": ((bool,), "true or false"),
         "str": ((str,), "a string"), "list": ((list,), "a list"), "dict": ((dict,), "an object")}


def checked_field(body, name, kind, default=None):
    """body[name], checked to be of `kind` (see KINDS; a bool is not a number); null or absent gives `default`."""
    value = body.get(name)
    if value is None:
        return default
    types, description = KINDS[kind]
    if not isinstance(value, types) or (isinstance(value, bool) and kind != "bool"):
        raise field_error(name, f"must be {description}, got {json.dumps(value)[:60]}")
    return value


async def read_body(request):
    """The request's JSON object (whatever its Content-Type says), or 400 naming the body."""
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else None
    except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep for the parser
        raise field_error("body", f"not valid JSON ({type(e).__name__}: {e})"[:300]) from None
    if not isinstance(body, dict):
        raise field_error("body",
                          ("must be" if raw.strip() else "missing: send") + ' a JSON object like {"messages": [...]}')
    return body


def check_sampling(body, settings, vocab_size, tokens_field="max_tokens", min_tokens=1):
    """
    A request's sampling settings as Engine.generate's arguments: temperature (0-2), top_k (0 = the whole
    vocabulary), max_tokens (from the field `tokens_field`, at least `min_tokens`), seed. The server's defaults
    where the request sets none, and a fresh random seed.
    """
    temperature = checked_field(body, "temperature", "number", settings.temperature)
    if not 0 <= temperature <= 2:  # written this way round so that NaN fails too
        raise field_error("temperature", f"must be between 0 and 2 (0 = greedy), got {temperature}")
    top_k = checked_field(body, "top_k", "int", min(settings.top_k, vocab_size))
    if not 0 <= top_k <= vocab_size:
        raise field_error("top_k", f"must be between 0 and {vocab_size} (the vocabulary; 0 = all of it), got {top_k}")
    max_tokens = checked_field(body, tokens_field, "int", settings.max_tokens)
    if not min_tokens <= max_tokens <= settings.max_tokens_limit:
        raise field_error(tokens_field,
                          f"must be between {min_tokens} and {settings.max_tokens_limit}, got {max_tokens}")
    seed = checked_field(body, "seed", "int")
    if seed is not None and not 0 <= seed < 2**63:
        raise field_error("seed", f"must be between 0 and 2**63 - 1, got {seed}")
    return dict(temperature=float(temperature), top_k=top_k, max_tokens=max_tokens,
                seed=random.randrange(2**31) if seed is None else seed)


def checked_parts(parts, where):
    """
    An assistant message given as parts, as nanochat's conversations hold a reply that used the calculator (and the
    chat page sends one back): [{"type": "text" | "python" | "python_output", "text": str}], rendered with the
    tool's special tokens (tokenizer.render_conversation), so the model reads its earlier call as it wrote it.
    """
    checked = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in PART_TYPES or not isinstance(part.get("text"), str):
            raise field_error(f"{where}[{j}]", 'must be like {"type": "text" | "python" | "python_output", '
                                               '"text": "..."}')
        checked.append({"type": part["type"], "text": part["text"]})
    return checked


def chars(content):
    """The characters of a message's content: a string, or the parts' texts."""
    return len(content) if isinstance(content, str) else sum(len(part["text"]) for part in content)


def check_chat(body, settings, pool, system=False, tokens_field="max_tokens"):
    """
    The prompt tokens and sampling settings (check_sampling) of a chat request. body["messages"]: roles alternate
    user / assistant, starting and ending with user (the message to reply to), after a first system message if
    `system`; contents are strings, or an assistant's a list of parts (checked_parts). The prompt
    (tokenizer.render_for_completion) leaves room in the model's context for a token at least, and max_tokens is cut
    to that room. Limits are checked first, tokens last.
    """
    messages = checked_field(body, "messages", "list")
    if not messages:
        raise field_error("messages", "missing or empty: send at least one user message")
    if len(messages) > settings.max_messages:
        raise field_error("messages", f"{len(messages)} messages, at most {settings.max_messages} are accepted")
    roles = ("system", "user", "assistant") if system else ("user", "assistant")
    conversation = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise field_error(where, 'must be an object like {"role": "user", "content": "Hi"}')
        role = message.get("role")
        content = message.get("content")
        if role not in roles:
            raise field_error(f"{where}.role", f"{role!r} is not a role here: use {', '.join(roles)}")
        if role == "assistant" and isinstance(content, list):  # a reply that used the calculator (the chat page)
            content = checked_parts(content, f"{where}.content")
        elif not isinstance(content, str):
            raise field_error(f"{where}.content", "must be a string" + (
                " or a list of parts (text, python, python_output)" if role == "assistant" else ""))
        if chars(content) > settings.max_message_chars:
            raise field_error(f"{where}.content",
                              f"{chars(content):,} characters, at most {settings.max_message_chars:,} are accepted")
        conversation.append({"role": role, "content": content})
    first = int(conversation[0]["role"] == "system")
    for i in range(first, len(conversation)):
        expected = "user" if (i - first) % 2 == 0 else "assistant"
        if conversation[i]["role"] != expected:
            raise field_error(f"messages[{i}].role",
                              f"is {conversation[i]['role']!r}, expected {expected!r}: roles alternate user/"
                              f"assistant, starting with user{' after a first system message' if first else ''}")
    if conversation[-1]["role"] != "user":
        raise field_error(f"messages[{len(messages) - 1}].role",
                          "the conversation must end with a user message (the one to reply to)")
    total = sum(chars(m["content"]) for m in conversation)
    if total > settings.max_conversation_chars:
        raise field_error("messages",
                          f"the conversation is {total:,} characters, "
                          f"at most {settings.max_conversation_chars:,} are accepted")
    sampling = check_sampling(body, settings, pool.vocab_size, tokens_field)
    prompt = pool.tokenizer.render_for_completion({"messages": conversation})
    if len(prompt) >= pool.context_len:
        raise field_error("messages",
                          f"the conversation is {len(prompt):,} tokens "
                          f"and the model's context holds {pool.context_len:,} "
                          f"(with room for the reply): start a new conversation, or send fewer or shorter messages",
                          code="context_length_exceeded")
    sampling["max_tokens"] = min(sampling["max_tokens"], pool.context_len - len(prompt))
    return prompt, sampling


# -----------------------------------------------------------------------------
# The app


def create_app(pool, settings):
    """
    The FastAPI app that serves `pool`'s workers under `settings` (both kept in app.state): the chat page (/),
    /health, /stats and nanochat's /chat/completions. nanochat.openai_api.mount(app) adds the OpenAI-compatible API
    (it builds on this module, which therefore does not import it).
    """
    app = FastAPI(title="nanochat", docs_url=None, redoc_url=None)  # no /docs: those pages load from a CDN
    app.state.pool = pool
    app.state.settings = settings

    @app.get("/")
    async def page():
        with open(UI_PATH, encoding="utf-8") as f:
            return HTMLResponse(f.read())

    @app.get("/health")
    async def health():
        return {"status": "ok", "workers": len(pool.workers)}

    @app.get("/stats")
    async def stats():
        return pool.stats()

    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        try:
            prompt, sampling = check_chat(await read_body(request), settings, pool)
            job = Job(pool, len(prompt) + sampling["max_tokens"])  # 429 / 400 now, before the stream starts
        except APIError as e:  # nanochat's shape: {"detail": "<field>: what is wrong"}
            return JSONResponse(status_code=e.status, content={"detail": e.message})
        return StreamingResponse(stream_reply(request, job, prompt, sampling), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    return app


async def stream_reply(request, job, prompt, sampling):
    """
    The server-sent events of one reply of /chat/completions: {"token": text, "gpu": worker index} per piece of text
    as it is generated, the calculator's use as blocks of their own (reply_pieces with blocks: {"tool_call": ""}
    opens a call, {"tool_call": text} continues it, {"tool_call_end": true} ends it; {"tool_output": ...} and
    {"tool_output_end": true} the same for what the tool answered), then {"done": true}; a failing generation sends
    {"error": "..."} before the done event. A client that leaves ends it (reply_pieces) and takes its row out of the
    batch (Job).
    """
    reply = Reply()
    try:
        async with job:
            async for kind, piece in reply_pieces(job, request, prompt, sampling, [], reply, blocks=True):
                yield sse({kind: piece, "gpu": job.worker.index})
            if reply.finish_reason is None:
                return  # the client left
            job.outcome = "served"
        yield sse({"done": True})
    except Exception as e:  # not CancelledError (a BaseException): a client that left is no error
        logger.exception(f"generation failed after {len(reply.tokens)} tokens")
        yield sse({"error": f"generation failed: {type(e).__name__}: {e}"})
        yield sse({"done": True})
