"""
Batched decoding for the server: workers that step many replies at once, and the pool that gives requests a row.

A Worker is one Engine on one device with a thread of its own that decodes a batch of replies (an engine.Batch, a
row each), one step for all of them at a time. A request joins the running batch of a worker (the one with the
fewest rows) with its own prompt, sampling settings (temperature, top_k), seed (a torch.Generator of its own: its
sampled tokens do not depend on the rows beside it), max_tokens and stop, and leaves it when its reply ends. Between
two steps the worker takes the new requests, ends the rows whose request stopped, and prefills the waiting prompts,
oldest first, up to prefill_chunk tokens in all (several short prompts in one step, a long one a chunk per step:
the rows decoding wait at most one chunk's prefill per step; engine.Batch says how rows join and leave its cache).
A lone request is decoded exactly as Engine.generate decodes it; a row in a batch gets the same tokens up to float
rounding (equal in fp32). Tokens go to the event loop as soon as they are sampled.

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

from nanochat.engine import Batch, Row
from nanochat.hardware import autocast_context
from nanochat.output import UserError

logger = logging.getLogger("nanochat.batching")


class Reply:
    """
    One request's reply, from the event loop to a worker: its prompt and sampling settings, the threading.Event
    `stop` (set by the event loop: the row ends before the next step), and the asyncio queue its tokens go to.
    """

    def __init__(self, prompt, sampling, stop, loop, tokens):
        self.prompt = prompt
        self.sampling = sampling
        self.stop = stop
        self.loop = loop
        self.tokens = tokens

    def send(self, item):
        """A token id, None (the end) or an exception, to the request's queue, from the worker's thread."""
        try:
            self.loop.call_soon_threadsafe(self.tokens.put_nowait, item)
        except RuntimeError:  # the event loop is closed (the server stopped): nobody waits for it
            pass


class Worker:
    """
    One Engine on one device, with one thread of its own that decodes a batch of replies (engine.Batch) step by step,
    prefilling `prefill_chunk` tokens of the waiting prompts before each step (the module docstring).
    """

    def __init__(self, index, engine, prefill_chunk=256):
        self.index = index
        self.engine = engine
        self.prefill_chunk = prefill_chunk
        self.device = engine.model.lm_head.weight.device
        self.inbox = queue.Queue()  # new replies and functions to run, from the event loop
        self.tokens_generated = 0  # written by the worker's thread only
        self.batch_rows = 0  # running rows of the batch, written by the worker's thread only: /stats
        self.held_rows = 0  # rows held by requests (Job), and their tokens: the event loop's, WorkerPool's limits
        self.held_tokens = 0
        self.thread = threading.Thread(target=self._serve, name=f"nanochat-worker{index}", daemon=True)
        self.thread.start()

    def autocast(self):
        """
        A fresh autocast context in the compute dtype (nanochat/hardware.py), entered in this worker's thread around
        its work: autocast state is per thread, and one context object must not be entered twice at once.
        """
        return autocast_context(self.device.type)[1]

    def start(self, prompt, sampling, stop):
        """
        Start generating the reply to `prompt` in this worker's batch. Returns an asyncio.Queue that receives each
        token id of the reply as soon as it is sampled, the token that ends the turn included (one of
        engine.end_tokens: the caller decides whether to show it), then None at the end (the end of the turn,
        max_tokens), or the exception that ended it. Setting the threading.Event `stop` ends the row before the next
        step. The thread never waits for the event loop.
        """
        self.engine.check_arguments(prompt, **sampling)  # UserError now, in the caller
        tokens = asyncio.Queue()
        self.inbox.put(Reply(prompt, sampling, stop, asyncio.get_running_loop(), tokens))
        return tokens

    def submit(self, fn, *args):
        """Run fn(*args) in this worker's thread, between two steps; returns a concurrent.futures.Future."""
        future = Future()
        self.inbox.put((fn, args, future))
        return future

    def _call(self, item):
        fn, args, future = item
        try:
            future.set_result(fn(*args))
        except Exception as e:
            future.set_exception(e)

    def _serve(self):
        """The thread: wait for work, then step a batch until no row is left."""
        if self.device.type == "cuda":  # the thread's current device is the worker's GPU: nothing lands on GPU 0
            torch.cuda.set_device(self.device)
        while True:
            item = self.inbox.get()
            if not isinstance(item, Reply):
                self._call(item)
                continue
            replies = {}  # Row -> Reply, for the rows whose reply is not over
            try:
                with self.autocast(), torch.inference_mode():
                    self._run(item, replies)
            except Exception as e:  # every reply of the batch ends with the exception; the worker goes on
                logger.exception(f"worker {self.index}: the batch failed")
                for reply in replies.values():
                    reply.send(e)
            self.batch_rows = 0

    def _join(self, reply, batch, replies):
        """A new reply's row into the batch; its generator made here, in the worker's thread, on its device."""
        sampling = reply.sampling
        rng = torch.Generator(device=self.device).manual_seed(sampling["seed"])
        row = Row(sampling["temperature"], sampling["top_k"], sampling["max_tokens"], rng)
        batch.add(reply.prompt, [row])
        replies[row] = reply

    def _run(self, first, replies):
        """Step a batch while it has rows or prompts to prefill, taking new replies from the inbox between steps."""
        batch = Batch(self.engine, self.engine.context_len)
        try:
            self._join(first, batch, replies)
            while batch.running or batch.waiting:
                while not self.inbox.empty():
                    item = self.inbox.get_nowait()
                    if isinstance(item, Reply):
                        self._join(item, batch, replies)
                    else:
                        self._call(item)
                for row, reply in list(replies.items()):
                    if reply.stop.is_set():  # the request ended or its client left
                        batch.stop(row)
                        reply.send(None)
                        del replies[row]
                self._send(batch.prefill(self.prefill_chunk), replies)  # first tokens out before the step
                self._send(batch.step(), replies)
                self.batch_rows = len(batch.running)
        finally:
            batch.close()

    def _send(self, rows, replies):
        """Each row's new token to its reply, then the end to those that ended."""
        for row in rows:
            self.tokens_generated += 1
            replies[row].send(row.last)
            if row.ended:
                replies.pop(row).send(None)


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
