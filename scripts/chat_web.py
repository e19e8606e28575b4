"""
Chat with a trained model in the browser: the chat page and a streaming API, served by FastAPI + uvicorn.

    python -m scripts.chat_web                             # the SFT model on http://127.0.0.1:8000
    python -m scripts.chat_web --source=mid --port=8080    # another stage's model (base | mid | sft | rl), another port
    python -m scripts.chat_web --num_gpus=8                # 8 workers, one per GPU: 8 replies generate at once
    python -m scripts.chat_web --host=0.0.0.0              # reachable from other machines (no authentication!)

The API (nanochat's; the page uses nothing else, so other clients can do what it does):

    POST /chat/completions  {"messages": [{"role": "user", "content": "Hi"}, ...],
                             "temperature": 0.8, "top_k": 50, "max_tokens": 512, "seed": 7}   all but messages optional
      200, text/event-stream: the reply as it is generated, one server-sent event per piece of text, then the end:
            data: {"token": "Hel", "gpu": 0}
            data: {"token": "lo!", "gpu": 0}
            data: {"done": true}
          ("gpu": the worker that generated it.) A failure during generation sends data: {"error": "..."}
          before the done event; the server goes on serving.
      400 {"detail": "<field>: what is wrong"}: a bad request, refused before anything is generated.
    GET /health   {"status": "ok", "workers": N}
    GET /stats    workers, busy, queue, requests served (and cancelled, failed), tokens generated, tokens/s
    GET /         the chat page (nanochat/ui.html: one file, no external resources, relative URLs)
    /v1/models, /v1/chat/completions, /v1/completions: an OpenAI-compatible API (nanochat/openai_api.py), for
                  OpenAI's client libraries, chat UIs and lm-evaluation-harness, on the same workers

How requests are served. A worker is one Engine on one device, with one thread of its own: one per GPU with
--num_gpus=N, else one on the CPU or the Mac's GPU (MPS). A request waits in a queue until a worker is free.
Its reply is then generated in the worker's thread, one blocking model step per token, and each token is
handed to the event loop as soon as it is sampled: the loop stays free to accept requests, answer /stats and
stream every reply, and the thread computes the next token while the loop sends the last one. Between two
tokens the server checks that the client is still there: a client that goes away (a closed tab, the page's
Stop button) frees its worker at once, and its generation stops at the next step.

The conversation: messages alternate user / assistant, starting and ending with user (the message to reply
to). The whole conversation is the prompt, so it must fit in the model's context (the length it was trained
on) with room for at least one token; the reply stops at max_tokens, at the end of the context, or when the
model ends its turn. Sampling uses a fresh random seed per request unless the request gives one ("seed":
the same request with the same seed gets the same reply, e.g. for tests).
"""

import asyncio
import json
import logging
import os
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

import nanochat
from nanochat.checkpoint_manager import load_model
from nanochat.common import UserError, autodetect_device_type, compute_init, print0
from nanochat.configurator import check_config, configure
from nanochat.engine import Engine, TextStreamer
from nanochat.hardware import autocast_context, compute_dtype_line
from nanochat.openai_api import Settings, mount

# -----------------------------------------------------------------------------
# Config (override as --key=value; --help lists them)
source = "sft"  # which stage's model: base | mid | sft | rl
model_tag = ""  # which model of that stage (needed only if there are several)
step = -1  # which checkpoint step (-1 = the last)
device_type = ""  # cuda | cpu | mps; empty = autodetect
num_gpus = 1  # CUDA: one worker per GPU, on GPUs 0..num_gpus-1 (CPU and MPS: always one worker)
host = "127.0.0.1"  # address to listen on: 127.0.0.1 = this machine only; 0.0.0.0 = every network interface
port = 8000  # port to listen on
temperature = 0.8  # sampling temperature of a request that sets none (0 = greedy)
top_k = 50  # top-k of a request that sets none (0 = the whole vocabulary)
max_tokens = 512  # longest reply of a request that sets none (the end of the context stops it too)
max_messages = 500  # most messages a request may hold
max_message_chars = 8000  # longest message, in characters
max_conversation_chars = 32000  # longest conversation (all messages together), in characters
max_tokens_limit = 4096  # the largest max_tokens a request may ask for
model_name = "nanochat"  # the model's name in the OpenAI-compatible API (GET /v1/models, the requests' "model")
api_key = ""  # if set, the OpenAI-compatible API (/v1/...) requires "Authorization: Bearer <api_key>"; empty = any key
if __name__ == "__main__":  # only when run as a script: the tests import this module and set up workers themselves
    config = configure(globals())
    check_config(config, positive=["num_gpus", "max_tokens", "max_messages", "max_message_chars",
                                   "max_conversation_chars", "max_tokens_limit"],
                 non_negative=["top_k"], choices={"source": ("base", "mid", "sft", "rl"),
                                                  "device_type": ("", "cuda", "cpu", "mps")})
    if not 0 <= temperature <= 2:
        raise UserError(f"--temperature must be between 0 and 2, got {temperature}")
    if max_tokens > max_tokens_limit:
        raise UserError(f"--max_tokens={max_tokens} exceeds --max_tokens_limit={max_tokens_limit}")
    if not 0 < port < 65536:
        raise UserError(f"--port must be between 1 and 65535, got {port}")
    if not model_name:
        raise UserError("--model_name must not be empty")

logger = logging.getLogger("nanochat.chat_web")
UI_PATH = os.path.join(os.path.dirname(os.path.abspath(nanochat.__file__)), "ui.html")  # shipped as package data


# -----------------------------------------------------------------------------
# Workers: one engine per device, each stepping in its own thread


class Worker:
    """
    One Engine on one device, with one thread of its own (`self.thread`) that runs its generations, one after
    the other: a generation that was told to stop finishes its current step before the next one starts.
    """

    def __init__(self, index, engine):
        self.index, self.engine = index, engine
        device = engine.model.lm_head.weight.device
        self.device_type = device.type
        # on CUDA the thread's current device is the worker's GPU, so nothing lands on GPU 0 by default
        setup = (torch.cuda.set_device, (device,)) if device.type == "cuda" else (None, ())
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"nanochat-worker{index}",
                                         initializer=setup[0], initargs=setup[1])
        self.tokens_generated = 0  # written by self.thread only

    def autocast(self):
        """A fresh autocast context in the compute dtype (nanochat/hardware.py), entered in this worker's thread around
        a whole generation: autocast state is per thread, and one context object must not be entered twice at once."""
        return autocast_context(self.device_type)[1]

    def start(self, prompt, sampling, stop):
        """
        Start generating the reply to `prompt` in this worker's thread. Returns an asyncio.Queue that receives
        each token id of the reply as soon as it is sampled, the token that ends the turn included (one of
        engine.end_tokens: the caller decides whether to show it), then None at the end (the end of the turn,
        max_tokens, the end of the context), or the exception that ended it. Setting the threading.Event `stop`
        ends the generation before its next step. The thread never waits for the event loop: it computes
        the next token while the loop sends the last one.
        """
        loop = asyncio.get_running_loop()
        tokens = asyncio.Queue()
        generation = self.engine.generate(prompt, **sampling)  # checks the arguments now, in the caller

        def run():
            outcome = None
            try:
                with self.autocast():  # per thread, so entered here, around the whole generation
                    while not stop.is_set():
                        step = next(generation, None)
                        if step is None:
                            break
                        self.tokens_generated += 1
                        token = step[0][0]
                        loop.call_soon_threadsafe(tokens.put_nowait, token)
                        if token in self.engine.end_tokens:
                            break
            except Exception as e:
                outcome = e
            finally:
                generation.close()
            loop.call_soon_threadsafe(tokens.put_nowait, outcome)

        self.thread.submit(run)
        return tokens


class WorkerPool:
    """The free workers (a queue that requests wait on) and the counters /stats reports."""

    def __init__(self, workers):
        self.workers = workers
        self.tokenizer = workers[0].engine.tokenizer
        self.context_len = workers[0].engine.context_len
        self.vocab_size = workers[0].engine.vocab_size
        self.free = asyncio.Queue()  # bound to the event loop at its first use, not here
        for worker in workers:
            self.free.put_nowait(worker)
        self.waiting = 0  # requests waiting for a worker
        self.served = self.cancelled = self.failed = 0  # finished requests, by how they ended
        self.generating_seconds = 0.0  # time requests held a worker, all together
        self.started = time.time()

    async def acquire(self):
        self.waiting += 1
        try:
            return await self.free.get()
        finally:
            self.waiting -= 1

    def release(self, worker, outcome, seconds):
        """Give `worker` back and count its request: outcome is "served", "cancelled" or "failed"."""
        self.free.put_nowait(worker)
        setattr(self, outcome, getattr(self, outcome) + 1)
        self.generating_seconds += seconds

    def stats(self):
        tokens = sum(w.tokens_generated for w in self.workers)
        return {
            "workers": len(self.workers),
            "devices": [str(w.engine.model.lm_head.weight.device) for w in self.workers],
            "busy": len(self.workers) - self.free.qsize(),
            "queue": self.waiting,
            "requests_served": self.served,
            "requests_cancelled": self.cancelled,  # the client left before the reply was complete
            "requests_failed": self.failed,
            "tokens_generated": tokens,  # model steps run, including those of replies cut short
            "tokens_per_second": round(tokens / self.generating_seconds, 1) if self.generating_seconds else 0.0,
            "context_len": self.context_len,
            "uptime_seconds": round(time.time() - self.started, 1),
        }


def load_workers(source, device_type, num_gpus=1, model_tag="", step=-1):
    """One Worker per device: cuda:0..num_gpus-1 for CUDA, else one on `device_type` (cpu / mps)."""
    if device_type == "cuda":
        if num_gpus > torch.cuda.device_count():
            raise UserError(f"--num_gpus={num_gpus} but {torch.cuda.device_count()} CUDA device(s) are visible")
        devices = [torch.device("cuda", i) for i in range(num_gpus)]
    else:
        if num_gpus != 1:
            raise UserError(f"--num_gpus={num_gpus} applies to CUDA; on {device_type} one worker serves (leave --num_gpus out)")
        devices = [torch.device(device_type)]
    workers = []
    for index, device in enumerate(devices):
        model, tokenizer, _ = load_model(source, device, phase="eval", model_tag=model_tag or None, step=step)
        workers.append(Worker(index, Engine(model, tokenizer)))
    return workers


# -----------------------------------------------------------------------------
# Requests and their validation


class Message(BaseModel):
    model_config = ConfigDict(strict=True)  # no silent conversions: 5 is not a string, "0.5" is not a number
    role: str
    content: str


class ChatRequest(BaseModel):
    model_config = ConfigDict(strict=True)
    messages: list[Message]
    temperature: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    seed: int | None = None


def bad_request(field, problem):
    return HTTPException(status_code=400, detail=f"{field}: {problem}")


def check_request(body, pool):
    """
    The prompt and sampling settings of a valid request; HTTPException 400 naming the field otherwise. Checks
    the limits first (cheap), the tokens last: tokenizing is the only work a bad request can cause.
    """
    messages = body.messages
    if not messages:
        raise bad_request("messages", "empty: send at least one user message")
    if len(messages) > max_messages:
        raise bad_request("messages", f"{len(messages)} messages, at most {max_messages} are accepted")
    for i, message in enumerate(messages):
        expected = "user" if i % 2 == 0 else "assistant"
        if message.role not in ("user", "assistant"):
            raise bad_request(f"messages[{i}].role", f"{message.role!r} is not a role: use 'user' or 'assistant'")
        if message.role != expected:
            raise bad_request(f"messages[{i}].role", f"is {message.role!r}, expected {expected!r}: roles alternate "
                                                     f"user/assistant, starting and ending with user")
        if len(message.content) > max_message_chars:
            raise bad_request(f"messages[{i}].content", f"{len(message.content):,} characters, at most "
                                                        f"{max_message_chars:,} are accepted")
    if messages[-1].role != "user":
        raise bad_request(f"messages[{len(messages) - 1}].role", "the conversation must end with a user message (the one to reply to)")
    total = sum(len(m.content) for m in messages)
    if total > max_conversation_chars:
        raise bad_request("messages", f"the conversation is {total:,} characters, at most {max_conversation_chars:,} are accepted")
    t = temperature if body.temperature is None else body.temperature
    if not 0 <= t <= 2:  # written this way round so that NaN fails too
        raise bad_request("temperature", f"must be between 0 and 2 (0 = greedy), got {t}")
    k = min(top_k, pool.vocab_size) if body.top_k is None else body.top_k
    if not 0 <= k <= pool.vocab_size:
        raise bad_request("top_k", f"must be between 0 and {pool.vocab_size} (the vocabulary; 0 = all of it), got {k}")
    n = max_tokens if body.max_tokens is None else body.max_tokens
    if not 1 <= n <= max_tokens_limit:
        raise bad_request("max_tokens", f"must be between 1 and {max_tokens_limit}, got {n}")
    seed = random.randrange(2**31) if body.seed is None else body.seed
    if not 0 <= seed < 2**63:
        raise bad_request("seed", f"must be between 0 and 2**63 - 1, got {seed}")
    conversation = {"messages": [{"role": m.role, "content": m.content} for m in messages]}
    prompt = pool.tokenizer.render_for_completion(conversation)
    room = pool.context_len - len(prompt)
    if room < 1:
        raise bad_request("messages", f"the conversation is {len(prompt):,} tokens and the model's context holds "
                                      f"{pool.context_len:,}: start a new conversation, or send fewer or shorter messages")
    return prompt, dict(temperature=float(t), top_k=k, max_tokens=min(n, room), seed=seed)


def describe_validation_error(errors):
    """FastAPI's validation errors (a list of dicts) as one line that names the fields."""
    parts = []
    for error in errors[:3]:
        if error["type"] == "json_invalid":
            return f"body: not valid JSON ({error.get('ctx', {}).get('error', error['msg'])})"
        loc = [p for p in error["loc"] if p != "body"]
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "body"
        if error["type"] == "missing" and field == "body":
            problem = 'missing: send a JSON object like {"messages": [{"role": "user", "content": "Hi"}]}'
        else:
            problem = error["msg"]
        parts.append(f"{field}: {problem}")
    return "; ".join(parts)


# -----------------------------------------------------------------------------
# The app

app = FastAPI(title="nanochat", docs_url=None, redoc_url=None)  # no /docs: those pages load from a CDN
mount(app, Settings(model_name=model_name, api_key=api_key, temperature=temperature, top_k=top_k, max_tokens=max_tokens,
                    max_tokens_limit=max_tokens_limit, max_messages=max_messages, max_message_chars=max_message_chars,
                    max_conversation_chars=max_conversation_chars))


@app.exception_handler(RequestValidationError)
async def validation_error(request, exc):
    # FastAPI answers 422 with the raw error list; ours is 400 with one readable line, like every other bad request
    return JSONResponse(status_code=400, content={"detail": describe_validation_error(exc.errors())})


@app.get("/")
async def page():
    with open(UI_PATH, encoding="utf-8") as f:
        return HTMLResponse(f.read())


@app.get("/health")
async def health(request: Request):
    return {"status": "ok", "workers": len(request.app.state.pool.workers)}


@app.get("/stats")
async def stats(request: Request):
    return request.app.state.pool.stats()


@app.post("/chat/completions")
async def chat_completions(body: ChatRequest, request: Request):
    pool = request.app.state.pool
    prompt, sampling = check_request(body, pool)
    return StreamingResponse(stream_reply(request, pool, prompt, sampling), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # no proxy buffering


def sse(payload):
    """One server-sent event."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def stream_reply(request, pool, prompt, sampling):
    """
    The events of one reply. Wait for a free worker, start the generation in its thread (Worker.start), and
    send each token as text as soon as it is complete (TextStreamer holds back half a UTF-8 character).
    Between two tokens, check that the client is still there. If it is not, or if the server cancels this
    generator at one of its awaits (it does when the client leaves), `finally` stops the generation (within
    one step) and hands the worker back.
    """
    worker = await pool.acquire()
    outcome, sent, t0, stop = "cancelled", 0, time.perf_counter(), threading.Event()
    try:
        tokens = worker.start(prompt, sampling, stop)
        streamer = TextStreamer(pool.tokenizer)
        while (token := await tokens.get()) is not None:
            if isinstance(token, Exception):
                raise token
            if token in worker.engine.end_tokens:  # the end of the turn is not text
                continue
            sent += 1
            text = streamer.put(token)
            if text:
                yield sse({"token": text, "gpu": worker.index})
            if await request.is_disconnected():
                return  # outcome stays "cancelled"
        text = streamer.end()
        if text:
            yield sse({"token": text, "gpu": worker.index})
        outcome = "served"
        yield sse({"done": True})
    except Exception as e:  # not CancelledError (a BaseException): a client that left is no error
        outcome = "failed"
        logger.exception(f"generation failed on worker {worker.index} after {sent} tokens")
        yield sse({"error": f"generation failed: {type(e).__name__}: {e}"})
        yield sse({"done": True})
    finally:
        stop.set()  # the worker's thread ends the generation before its next step
        seconds = time.perf_counter() - t0
        pool.release(worker, outcome, seconds)
        logger.info(f"worker {worker.index}: {outcome}, {sent} tokens in {seconds:.2f}s")


# -----------------------------------------------------------------------------
# Run

def check_port_free(host, port):
    """Fail now, before loading any model, if the port is taken (uvicorn would only say so after)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a port in TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port} ({e.strerror}): pick another port with --port=...") from None


if __name__ == "__main__":
    import uvicorn

    check_port_free(host, port)
    device_type = device_type or autodetect_device_type()
    compute_init(device_type)
    print0(compute_dtype_line(device_type))
    app.state.pool = WorkerPool(load_workers(source, device_type, num_gpus, model_tag, step))
    if host not in ("127.0.0.1", "localhost", "::1"):
        print0(f"WARNING: listening on {host}:{port}, beyond this machine: anyone who can reach it can use the model "
               f"(there is no authentication). Use the default --host=127.0.0.1 to keep it private.")
    shown = "127.0.0.1" if host == "0.0.0.0" else host
    print0(f"{len(app.state.pool.workers)} worker(s) on {', '.join(app.state.pool.stats()['devices'])}; "
           f"context {app.state.pool.context_len} tokens. Chat at http://{shown}:{port}/")
    uvicorn.run(app, host=host, port=port, timeout_graceful_shutdown=5)  # Ctrl-C: open streams get 5 s to end
