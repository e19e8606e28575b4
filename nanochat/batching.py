"""
Batched decoding for the server: workers that step many replies at once, and the pool that gives requests a row.

A Worker is one Engine on one device with a thread of its own that decodes a batch of replies, one step for all
of them at a time. A request joins the running batch of a worker (the one with the fewest rows) with its own prompt
length, sampling settings (temperature, top_k), seed (a torch.Generator of its own: its sampled tokens do not depend
on the rows beside it), max_tokens and stop, and leaves it when its reply ends. Between two steps the worker takes
the new requests, drops the rows that ended, and prefills the waiting prompts, oldest first, up to prefill_chunk
tokens in all (several short prompts in one step, a long one a chunk per step: the rows decoding wait at most one
chunk's prefill per step); a complete prompt's keys and values join the batch, rows right-aligned at the longest
(engine.regroup), each at its own position, its padding masked out. A lone request is decoded exactly as
Engine.generate decodes it; a row in a batch gets the same tokens up to float rounding (equal in fp32). Tokens go
to the event loop as soon as they are sampled.

Limits (WorkerPool, chat_web's settings): a worker holds at most max_batch rows, and max_tokens_in_flight tokens of
prompt + max_tokens (its KV cache); a request that finds no room waits in a queue, oldest first, and is refused
(WorkerPool.refusal) when max_queue requests wait already, or when it needs more tokens than a batch ever holds.
The HTTP side (nanochat/serving.py) asks before a stream starts and answers 429 / 400.
"""

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future

import torch

from nanochat.engine import KVCache, Sample, decode_step, regroup, sample_next_token
from nanochat.hardware import autocast_context
from nanochat.output import UserError

logger = logging.getLogger("nanochat.batching")


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
    each step it takes the new requests, drops the rows whose request ended or left, and prefills the waiting
    prompts, oldest first, within a budget of `prefill_chunk` tokens: the rest of the oldest, then the next ones while
    tokens are left, so several short prompts go in one step and a long one takes a chunk per step (prompts that
    arrive while others decode stall them by at most one chunk per step). A prompt joins the batch (engine.regroup)
    once all of it is in. When no row is decoding (nobody to stall), the oldest prompt is prefilled whole, as
    Engine.generate does.
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
    else waits; `max_queue` requests may wait (refusal: beyond them, or for a need that never fits).
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

    def refusal(self, need):
        """
        Why a request of `need` tokens is refused at once, or None: "never" (it needs more tokens than a batch ever
        holds), "busy" (`max_queue` requests wait already, and it would wait too). With the message to answer.
        """
        if need > self.max_tokens_in_flight:
            return "never", (f"the prompt and max_tokens need {need:,} tokens, more than the server ever holds for a "
                             f"request ({self.max_tokens_in_flight:,}): lower max_tokens or shorten the prompt")
        if len(self.waiting) >= self.max_queue and (self.waiting or self._room(need) is None):  # it would wait
            self.refused += 1
            return "busy", f"the server is busy: {len(self.waiting)} requests are waiting already; retry later"
        return None

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
