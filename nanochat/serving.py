"""
Serve a model over HTTP: the workers that generate, the checks every request passes, and the FastAPI app.

The app (create_app) serves nanochat's own API and the OpenAI-compatible one (nanochat/openai_api.py) on the same
workers.

A Worker is one Engine on one device with a thread of its own that decodes a batch of replies, one step for all
of them at a time. A request joins the running batch of a worker (the one with the fewest rows) with its own prompt
length, sampling settings (temperature, top_k), seed (a torch.Generator of its own: its sampled tokens do not depend
on the rows beside it), max_tokens and stop strings, and leaves it when its reply ends. Between two steps the worker
takes the new requests, drops the rows that ended, and prefills one chunk of the oldest new prompt (--prefill_chunk
tokens: a long prompt stalls the others by one chunk per step); a complete prompt's keys and values join the batch,
rows right-aligned at the longest (engine.regroup), each at its own position, its padding masked out. A lone
request is decoded exactly as Engine.generate decodes it; a row in a batch gets the same tokens up to float
rounding (equal in fp32). Tokens go to the event loop as soon as they are sampled: the loop stays free to accept
requests, answer /stats and stream every reply. Between two tokens the server checks that the client is still
there (reply_pieces): one that left takes its row out of the batch before the next step.

Limits (WorkerPool, chat_web's settings): a worker holds at most max_batch rows, and max_tokens_in_flight tokens of
prompt + max_tokens (its KV cache); a request that finds no room waits in a queue, oldest first, and is answered
429 (one line) when max_queue requests wait already, 400 if it needs more tokens than a batch ever holds. Both
checked when the request arrives (Job), before a stream starts.

Both APIs check a request with the same functions (read_body, checked_field, check_chat, check_sampling) before
anything is generated: a bad one raises APIError 400, its message starting with the field at fault
("messages[2].role: ...": field_error).
"""

import asyncio
import json
import logging
import os
import queue
import random
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

import nanochat
from nanochat.common import UserError
from nanochat.engine import KVCache, Sample, TextStreamer, decode_step, regroup, sample_next_token
from nanochat.hardware import autocast_context

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
# Workers: one engine per device, each stepping in its own thread


class Row:
    """
    One reply in a worker's batch: its prompt, sampling settings, generator of its own (its tokens depend on its
    seed, never on the rows beside it), the tool's state (engine.Sample), and the asyncio queue its tokens go to.
    """

    def __init__(self, prompt, sampling, stop, loop, tokens):
        self.prompt = prompt
        self.temperature = sampling["temperature"]
        self.top_k = sampling["top_k"]
        self.max_tokens = sampling["max_tokens"]
        self.seed = sampling["seed"]
        self.stop = stop  # set by the event loop: the row leaves the batch before the next step
        self.loop = loop
        self.tokens = tokens
        self.sample = Sample()
        self.rng = None  # made in the worker's thread, on its device
        self.cache = None  # the prompt's own cache while it is prefilled
        self.prefilled = 0  # prompt tokens in self.cache
        self.generated = 0
        self.last = None  # the newest token, fed at the next step
        self.ended = False

    def send(self, item):
        """A token id, None (the end) or an exception, to the request's queue, from the worker's thread."""
        try:
            self.loop.call_soon_threadsafe(self.tokens.put_nowait, item)
        except RuntimeError:  # the event loop is closed (the server stopped): nobody waits for it
            pass


class Worker:
    """
    One Engine on one device, with one thread of its own that decodes a batch of replies (Row) step by step. Before
    each step it takes the new requests, drops the rows whose request ended or left, and prefills one chunk
    (`prefill_chunk` tokens) of the oldest waiting prompt: a prompt that arrives while others decode stalls them by
    one chunk per step, and joins the batch (engine.regroup) once all of it is in. A prompt that finds the batch
    empty is prefilled whole, as Engine.generate does.
    """

    def __init__(self, index, engine, prefill_chunk=256):
        self.index = index
        self.engine = engine
        self.prefill_chunk = prefill_chunk
        device = engine.model.lm_head.weight.device
        self.device = device
        self.device_type = device.type
        self.inbox = queue.Queue()  # new rows and functions to run, from the event loop
        self.tokens_generated = 0  # written by the worker's thread only
        self.batch_rows = 0  # rows in the running batch, written by the worker's thread only: /stats
        self.held_rows = 0  # rows held by requests (Job), and their tokens: the event loop's, WorkerPool's limits
        self.held_tokens = 0
        self._rows = []  # the running batch, in the order of the cache's rows: the worker's thread's
        self.thread = threading.Thread(target=self._serve, name=f"nanochat-worker{index}", daemon=True)
        self.thread.start()

    def autocast(self):
        """
        A fresh autocast context in the compute dtype (nanochat/hardware.py), entered in this worker's thread around
        its work: autocast state is per thread, and one context object must not be entered twice at once.
        """
        return autocast_context(self.device_type)[1]

    def start(self, prompt, sampling, stop):
        """
        Start generating the reply to `prompt` in this worker's batch. Returns an asyncio.Queue that receives each
        token id of the reply as soon as it is sampled, the token that ends the turn included (one of
        engine.end_tokens: the caller decides whether to show it), then None at the end (the end of the turn,
        max_tokens), or the exception that ended it. Setting the threading.Event `stop` takes the row out of the
        batch before the next step. The thread never waits for the event loop.
        """
        self.engine.generate(prompt, **sampling).close()  # checks the arguments now, in the caller
        tokens = asyncio.Queue()
        self.inbox.put(Row(prompt, sampling, stop, asyncio.get_running_loop(), tokens))
        return tokens

    def submit(self, fn, *args):
        """Run fn(*args) in this worker's thread, between two steps; returns a concurrent.futures.Future."""
        future = Future()
        self.inbox.put((fn, args, future))
        return future

    def _take(self, item, pending):
        if isinstance(item, Row):
            pending.append(item)
            return
        fn, args, future = item
        try:
            future.set_result(fn(*args))
        except Exception as e:
            future.set_exception(e)

    def _serve(self):
        """The thread: wait for work, then step the batch until no row is left."""
        if self.device_type == "cuda":  # the thread's current device is the worker's GPU: nothing lands on GPU 0
            torch.cuda.set_device(self.device)
        while True:
            pending = []  # rows waiting for their prefill, oldest first
            self._take(self.inbox.get(), pending)
            try:
                with self.autocast(), torch.inference_mode():
                    self._run(pending)
            except Exception as e:  # every row of the batch ends with the exception; the worker goes on
                logger.exception(f"worker {self.index}: the batch failed")
                for row in self._rows + pending:
                    if not row.ended:
                        row.send(e)
            self._rows = []
            self.batch_rows = 0

    def _run(self, pending):
        """Step the batch while it has rows or prompts to prefill, taking new ones from the inbox between steps."""
        engine = self.engine
        model = engine.model
        cfg = model.config
        dtype, cache_dtype = engine.dtypes()
        cache = None
        padding = []  # each row's padding columns in the cache (prompts right-aligned at the longest)
        weights = {}  # rows -> engine._decode_weights(rows), asked once per batch size (it reads a file per call)
        rows = self._rows = []
        while rows or pending:
            while not self.inbox.empty():
                self._take(self.inbox.get_nowait(), pending)
            for row in pending + rows:
                if row.stop.is_set() and not row.ended:  # the request ended or its client left
                    row.ended = True
                    row.send(None)
            pending[:] = [row for row in pending if not row.ended]
            # prefill: `prefill_chunk` tokens of the waiting prompts, oldest first; a prompt that finds no row
            # decoding (nobody to stall) all at once, as Engine.generate does
            joining = []
            budget = self.prefill_chunk
            decoding = any(not row.ended for row in rows)
            while pending and budget > 0:
                row = pending[0]
                if row.cache is None:
                    row.rng = torch.Generator(device=self.device).manual_seed(row.seed)
                    row.cache = KVCache(1, cfg.n_kv_head, len(row.prompt), cfg.n_embd // cfg.n_head, cfg.n_layer,
                                        self.device, dtype)
                whole = not decoding and not joining
                end = len(row.prompt) if whole else min(len(row.prompt), row.prefilled + budget)
                chunk = torch.tensor([row.prompt[row.prefilled:end]], dtype=torch.long, device=self.device)
                logits = model.prefill(chunk, row.cache)
                budget -= end - row.prefilled
                row.prefilled = end
                if end < len(row.prompt):
                    break
                pending.pop(0)
                self._sample([row], logits)
                if not row.ended:
                    joining.append(row)
            # rows that ended leave, new ones join: a new cache (it moves each row once, a step reads them all)
            keep = [i for i, row in enumerate(rows) if not row.ended]
            if joining or len(keep) < len(rows):
                cache, padding = regroup(cache, padding, keep, [row.cache for row in joining], engine.context_len,
                                         cache_dtype)
                for row in joining:
                    row.cache = None
                rows[:] = [rows[i] for i in keep] + joining
                self.batch_rows = len(rows)
            if not rows:
                continue
            # one step of every row: each at its own position, its padding masked out (none: the plain step)
            positions = key_mask = None
            if any(padding):
                shift = torch.tensor(padding, device=self.device)
                positions = cache.pos - shift
                columns = torch.arange(cache.pos + 1, device=self.device)
                key_mask = columns[None, None, None, :] >= shift[:, None, None, None]
            newest = torch.tensor([row.last for row in rows], dtype=torch.long, device=self.device)
            if len(rows) not in weights:
                weights[len(rows)] = engine._decode_weights(len(rows))
            logits = decode_step(model, newest, cache, weights[len(rows)], positions, key_mask)
            self._sample(rows, logits)

    def _sample(self, rows, logits):
        """
        Each row's next token from its logits (a row of `logits`), by its own generator (drawn at every step, as in
        Engine.generate, also where the tool forces the token): rows of the same temperature and top_k in one call.
        Each token goes to its request; a row ends at the end of its turn or at max_tokens.
        """
        groups = {}
        for i, row in enumerate(rows):
            groups.setdefault((row.temperature, row.top_k), []).append(i)
        sampled = [None] * len(rows)
        for (temperature, top_k), members in groups.items():
            group_logits = logits if len(members) == len(rows) else logits[members]
            rngs = [rows[i].rng for i in members]
            tokens = sample_next_token(group_logits, rngs[0] if len(rngs) == 1 else rngs, temperature, top_k).tolist()
            for i, token in zip(members, tokens):
                sampled[i] = token
        for row, token in zip(rows, sampled):
            token, _ = self.engine.next_token(row.sample, token)
            row.generated += 1
            self.tokens_generated += 1
            row.last = token
            row.send(token)
            if row.sample.end_token is not None or row.generated >= row.max_tokens:
                row.ended = True
                row.send(None)


class WorkerPool:
    """
    The workers, the requests waiting for a row in one of their batches (oldest first), the limits, and the counters
    /stats reports. A request holds a row of a worker from Job's entry to its exit, and `need` tokens of the
    worker's budget (its prompt + max_tokens: the most cache it may fill). It gets one at once if a worker has fewer
    than `max_batch` rows and room for `need` within `max_tokens_in_flight` tokens (the one with the fewest rows),
    else waits; `max_queue` requests may wait (check: 429 beyond, 400 for a need that never fits).
    """

    def __init__(self, workers, max_batch=8, max_queue=64, max_tokens_in_flight=32768):
        self.workers = workers
        self.tokenizer = workers[0].engine.tokenizer
        self.context_len = workers[0].engine.context_len
        self.vocab_size = workers[0].engine.vocab_size
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_tokens_in_flight = max_tokens_in_flight
        self.waiting = deque()  # (need, future of the worker), oldest first
        self.served = self.cancelled = self.failed = self.refused = 0  # finished requests, by how they ended
        self.generating_seconds = 0.0  # time requests held a row, all together
        self.started = time.time()

    def check(self, need):
        """APIError 400 for a request of `need` tokens that can never run, 429 while the queue is full."""
        if need > self.max_tokens_in_flight:
            raise APIError(400, f"the prompt and max_tokens need {need:,} tokens, more than the server ever holds for "
                                f"a request ({self.max_tokens_in_flight:,}): lower max_tokens or shorten the prompt",
                           code="context_length_exceeded")
        if len(self.waiting) >= self.max_queue and (self.waiting or self._room(need) is None):  # it would wait
            self.refused += 1
            raise APIError(429, f"the server is busy: {len(self.waiting)} requests are waiting already; retry later",
                           code="rate_limit_exceeded", kind="rate_limit_error")

    def _room(self, need):
        """The worker with the fewest rows that has room for a request of `need` tokens, or None."""
        fits = [w for w in self.workers
                if w.held_rows < self.max_batch and w.held_tokens + need <= self.max_tokens_in_flight]
        return min(fits, key=lambda w: w.held_rows, default=None)

    def _hold(self, worker, need):
        worker.held_rows += 1
        worker.held_tokens += need
        return worker

    async def acquire(self, need):
        """A worker with a row for a request of `need` tokens: at once if one has room and none waits, else in turn."""
        worker = None if self.waiting else self._room(need)
        if worker is not None:
            return self._hold(worker, need)
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((need, future))
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # given a row just as it left
                self.release(future.result(), need, "cancelled", 0.0)
            else:
                self.waiting = deque(w for w in self.waiting if w[1] is not future)
            raise

    def release(self, worker, need, outcome, seconds):
        """Give back a row of `worker` and count its request: outcome is "served", "cancelled" or "failed"."""
        worker.held_rows -= 1
        worker.held_tokens -= need
        setattr(self, outcome, getattr(self, outcome) + 1)
        self.generating_seconds += seconds
        while self.waiting:  # the oldest waiting requests that now fit, in turn
            first_need, future = self.waiting[0]
            if future.done():
                self.waiting.popleft()
                continue
            room = self._room(first_need)
            if room is None:
                break
            self.waiting.popleft()
            future.set_result(self._hold(room, first_need))

    def stats(self):
        tokens = sum(w.tokens_generated for w in self.workers)
        return {
            "workers": len(self.workers),
            "devices": [str(w.engine.model.lm_head.weight.device) for w in self.workers],
            "busy": sum(w.held_rows > 0 for w in self.workers),  # workers with a request
            "queue": len(self.waiting),  # requests waiting for a row
            "batch_rows": [w.batch_rows for w in self.workers],  # rows decoding in each worker's batch now
            "held_rows": [w.held_rows for w in self.workers],  # requests holding a row of each worker
            "tokens_in_flight": [w.held_tokens for w in self.workers],  # their prompts + max_tokens
            "max_batch": self.max_batch,
            "max_queue": self.max_queue,
            "max_tokens_in_flight": self.max_tokens_in_flight,
            "requests_served": self.served,
            "requests_cancelled": self.cancelled,  # the client left before the reply was complete
            "requests_failed": self.failed,
            "requests_refused": self.refused,  # 429: the queue was full
            "tokens_generated": tokens,  # model steps run, including those of replies cut short
            "tokens_per_second": round(tokens / self.generating_seconds, 1) if self.generating_seconds else 0.0,
            "context_len": self.context_len,
            "uptime_seconds": round(time.time() - self.started, 1),
        }


def worker_devices(device_type, num_gpus=1):
    """The devices of the workers, one model each: cuda:0..num_gpus-1 for CUDA, else `device_type` (cpu / mps)."""
    if device_type == "cuda":
        if num_gpus > torch.cuda.device_count():
            raise UserError(f"--num_gpus={num_gpus} but {torch.cuda.device_count()} CUDA device(s) are visible")
        return [torch.device("cuda", i) for i in range(num_gpus)]
    if num_gpus != 1:
        raise UserError(f"--num_gpus={num_gpus} applies to CUDA; "
                        f"on {device_type} one worker serves (leave --num_gpus out)")
    return [torch.device(device_type)]


# -----------------------------------------------------------------------------
# Generating a reply on a worker


class Job:
    """
    One request's row in a worker's batch. Job(pool, need) checks the pool's limits at once (WorkerPool.check:
    APIError 429 / 400, before any response starts); `async with job` waits for a row, and on exit stops the
    generation (before the next step) and gives the row back, counting the request as served (set job.outcome),
    cancelled (the client left: the default) or failed (an exception).
    """

    def __init__(self, pool, need):
        pool.check(need)
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
