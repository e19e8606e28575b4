"""
Load test of the chat web server (scripts/chat_web.py): N concurrent clients, each sending requests in turn.

The server runs as its own process with a depth-4 model on the CPU. The weights are random (initialised, saved as a
checkpoint, never trained): how fast tokens come out does not depend on what they say. Every reply has the same
length (max_tokens; a random model's uniform predictions almost never end a turn), so the runs compare.

    python bench/chat_web_load.py                                   # 1, 4 and 16 clients, 4 requests each, 64 tokens
    python bench/chat_web_load.py --clients=32 --requests_per_client=2 --max_tokens=32
    python bench/chat_web_load.py --clients=16 --rounds=3           # both APIs, 3 alternating rounds each
    python bench/chat_web_load.py --clients= --baseline_repo=../main  # 8 at once vs one by one; a lone request vs main

First, with OpenAI's own client: `concurrent` requests one after another, then all at once (one thread each):
the server decodes them in one batch, so all at once should take a fraction of the time. With --baseline_repo (a
checkout of another version, e.g. the main branch), the same model served by that version's chat_web too: a lone
request's latency on each, in turns. Then the load test, both streaming APIs of the same server in the same
run: nanochat's own POST /chat/completions and the OpenAI-compatible POST /v1/chat/completions (stream: true),
alternating between them `rounds` times per client count so that a change in the machine's load hits both alike.
Prints per API and client count: requests/s, time to first token (request sent -> first piece of text received)
p50/p95, latency of a whole reply p50/p95, tokens/s for all clients together, and how many requests were dropped
(an HTTP error, an error event, or a stream that ended without its done event / [DONE]): it must be 0. One worker
serves them all, decoding up to its --max_batch replies together: throughput should grow with the number of
clients. Uses the pydocs corpus and a tokenizer of `vocab_size` in $NANOCHAT_BASE_DIR (default: the bench
directory of bench/base_train.py), building them if missing.
"""

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("NANOCHAT_BASE_DIR", os.path.join(tempfile.gettempdir(), "nanochat_bench"))
os.environ["NANOCHAT_DATASET"] = "pydocs"

import httpx
import torch

from nanochat.checkpoint_manager import checkpoint_dir_for, save_checkpoint
from nanochat.configurator import configure
from nanochat.dataset import parquets_iter_batched
from nanochat.engine import Engine
from nanochat.files import get_base_dir
from nanochat.gpt import GPT, config_from_depth
from nanochat.output import print0
from nanochat.tokenizer import Tokenizer, get_tokenizer_dir

depth = 4  # model depth
max_seq_len = 512  # the model's context
vocab_size = 8192  # tokenizer vocabulary
clients = "1,4,16"  # comma-separated numbers of concurrent clients to measure
requests_per_client = 4  # requests each client sends, one after the other
max_tokens = 64  # tokens per reply
threads = 1  # torch threads of the server (and of the baseline); 0 = torch's default, one per core
apis = "nanochat,openai"  # which streaming APIs to measure: nanochat (/chat/completions), openai (/v1/chat/completions)
rounds = 1  # measurements per API and client count, alternating between the APIs
concurrent = 8  # with OpenAI's client: this many requests at once against the same one after another (0 = skip)
baseline_repo = ""  # another checkout (e.g. the main branch's) whose chat_web serves the same model: a lone request
concurrent_rounds = 3  # the comparison of `concurrent` requests this many times: the median ratio
lone_repeats = 11  # a lone request's latency: the median of this many, on each server in turns
config = configure(globals())
if threads > 0:
    torch.set_num_threads(threads)

# 1. A tokenizer and a random-weight checkpoint the server can load
repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
tok_dir = get_tokenizer_dir()
tokenizer = Tokenizer.from_directory(tok_dir) if os.path.exists(os.path.join(tok_dir, "tokenizer.json")) else None
if tokenizer is None or tokenizer.get_vocab_size() != vocab_size:
    tokenizer = Tokenizer.train_from_iterator((doc for batch in parquets_iter_batched("train") for doc in batch),
                                              vocab_size)
    tokenizer.save(tok_dir)
model_tag = f"chat_web_load_d{depth}"
torch.manual_seed(0)
model_config = config_from_depth(depth, vocab_size=vocab_size, sequence_len=max_seq_len)
model = GPT(model_config)
model.init_weights()
save_checkpoint(checkpoint_dir_for("base", model_tag), 0, model.state_dict(), None, dict(
    model_config=model_config.to_dict(), tokenizer=dict(fingerprint=tokenizer.fingerprint(), vocab_size=vocab_size)))
print0(f"model: depth {depth}, {model.num_params():,} params, context {max_seq_len}, vocab {vocab_size} "
       "(random weights)")
# the baseline: the same replies generated by the Engine directly, in this process, without the server
model.eval()
engine = Engine(model, tokenizer)
rates = []
for i in range(4):
    prompt = tokenizer.render_for_completion(
        {"messages": [{"role": "user", "content": f"Question {i}: what is a list comprehension?"}]})
    t0 = time.perf_counter()
    results, _ = engine.generate_batch(prompt, max_tokens=max_tokens, temperature=1.0, top_k=0, seed=i)
    rates.append((len(results[0]) - len(prompt)) / (time.perf_counter() - t0))
print0(f"Engine alone, no server: {statistics.median(rates[1:]):.0f} tokens/s (median of 3 replies after a warm-up)")
del model, engine

# 2. The server, as its own process (as users run it), on a free port; the baseline's too if asked
def start_server(repo, log_name):
    """chat_web of the checkout `repo` on a free port: (its process, its URL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(os.path.join(get_base_dir(), log_name), "w")  # a file: a full pipe would block the server
    process = subprocess.Popen([sys.executable, "-m", "scripts.chat_web", "--source=base", f"--model_tag={model_tag}",
                                "--device_type=cpu", f"--port={port}"], cwd=repo,
                               env=dict(os.environ, NANOCHAT_BASE_DIR=get_base_dir(), PYTHONPATH=repo,
                                        **({"OMP_NUM_THREADS": str(threads)} if threads > 0 else {})),
                               stdout=log, stderr=subprocess.STDOUT)
    return process, f"http://127.0.0.1:{port}"


server, url = start_server(repo_root, "chat_web_load.log")
baseline, baseline_url = start_server(baseline_repo, "chat_web_load_baseline.log") if baseline_repo else (None, None)


def wait_for_server(process, address, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            sys.exit(f"the server at {address} exited: see its log in {get_base_dir()}")
        try:
            if httpx.get(address + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    sys.exit("the server did not start")


# 3. Clients
def request(api, i):
    """The path and body of request i to `api`: the same conversation and sampling for both APIs."""
    messages = [{"role": "user", "content": f"Question {i}: what is a list comprehension?"}]
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 1.0, "top_k": 0, "seed": i}
    if api == "nanochat":
        return "/chat/completions", body
    return "/v1/chat/completions", {"model": "nanochat", "stream": True, **body}


def read_event(api, data):
    """One event's (text, done, error). nanochat: {"token"} ... {"done": true}; OpenAI: chunks, then [DONE]."""
    if api == "openai":
        if data == "[DONE]":
            return None, True, None
        event = json.loads(data)
        return ((event["choices"][0]["delta"].get("content") if event.get("choices") else None), False,
                event.get("error"))
    event = json.loads(data)
    return event.get("token"), event.get("done", False), event.get("error")


async def one_request(client, api, i):
    """Send request i; return (time to first token, latency, text events, ok)."""
    path, body = request(api, i)
    t0 = time.perf_counter()
    first = None
    events = 0
    done = False
    error = None
    try:
        async with client.stream("POST", url + path, json=body) as response:
            if response.status_code != 200:
                return None, time.perf_counter() - t0, 0, False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                text, end, problem = read_event(api, line[6:])
                if text:
                    events += 1
                    first = first or time.perf_counter() - t0
                done = done or end
                error = error or problem
    except httpx.HTTPError:
        return None, time.perf_counter() - t0, events, False
    return first, time.perf_counter() - t0, events, done and error is None


async def run_clients(api, n):
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n)) as client:
        async def one_client(c):
            return [await one_request(client, api, c * 1000 + r) for r in range(requests_per_client)]
        return [r for rs in await asyncio.gather(*(one_client(c) for c in range(n))) for r in rs]


def percentile(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def openai_reply(client, i):
    """Request i with OpenAI's client (streamed, as chat UIs ask): (seconds, completion tokens)."""
    t0 = time.perf_counter()
    _, body = request("openai", i)
    chunks = list(client.chat.completions.create(
        model="nanochat", messages=body["messages"], max_tokens=max_tokens, temperature=1.0, seed=i, stream=True,
        stream_options={"include_usage": True}, extra_body={"top_k": 0}))
    return time.perf_counter() - t0, chunks[-1].usage.completion_tokens


def compare_concurrency():
    """`concurrent` requests one after another, then all at once (a thread each), with OpenAI's client."""
    import openai
    from concurrent.futures import ThreadPoolExecutor
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    openai_reply(client, 0)  # warm-up
    ratios = []
    for _ in range(concurrent_rounds):
        t0 = time.perf_counter()
        one_by_one = [openai_reply(client, i) for i in range(concurrent)]
        sequential = time.perf_counter() - t0
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrent) as pool:
            together = list(pool.map(lambda i: openai_reply(client, i), range(concurrent)))
        parallel = time.perf_counter() - t0
        ratios.append(parallel / sequential)
        tokens = sum(n for _, n in one_by_one)
        tokens_together = sum(n for _, n in together)  # the same requests: the same counts but where rounding differs
        print0(f"OpenAI client, {concurrent} requests of {max_tokens} tokens: one after another {sequential:.2f} s "
               f"({tokens} tokens, {tokens / sequential:.0f} tokens/s), all at once {parallel:.2f} s "
               f"({tokens_together} tokens, {tokens_together / parallel:.0f} tokens/s): {parallel / sequential:.2f}x "
               f"the time")
    print0(f"{concurrent} requests at once take {statistics.median(ratios):.2f}x the time of one after another "
           f"(median of {concurrent_rounds})")


def compare_lone():
    """A lone request on this server and on the baseline's, in turns, with OpenAI's client."""
    import openai
    clients = {name: openai.OpenAI(base_url=address + "/v1", api_key="none", max_retries=0, timeout=600)
               for name, address in (("this", url), ("baseline", baseline_url))}
    for client in clients.values():  # warm-up
        openai_reply(client, 0)
    lone = {"this": [], "baseline": []}
    for r in range(lone_repeats):  # in turns: a change in the machine's load hits both alike
        for name in ("this", "baseline") if r % 2 == 0 else ("baseline", "this"):
            lone[name].append(openai_reply(clients[name], 1000 + r)[0])
    this = statistics.median(lone["this"])
    before = statistics.median(lone["baseline"])
    print0(f"a lone request of {max_tokens} tokens (median of {lone_repeats}, in turns): this server {this:.3f} s, "
           f"{baseline_repo}'s {before:.3f} s: {this / before:.3f}x")


try:
    wait_for_server(server, url)
    if baseline is not None:
        wait_for_server(baseline, baseline_url)
    if concurrent:
        compare_concurrency()
    if baseline is not None:
        compare_lone()
    for api in apis.split(","):
        asyncio.run(run_clients(api, 1))  # warm-up
    print0(f"{requests_per_client} requests per client, {max_tokens} tokens per reply, one CPU worker with "
           f"{threads or 'default'} torch thread(s) ({os.cpu_count()} cores, shared with the clients)")
    print0("| API | clients | requests | dropped | requests/s | time to first token p50 / p95 | latency p50 / p95 "
           "| tokens/s |")
    print0("|---|---|---|---|---|---|---|---|")
    totals = {}  # (api, clients) -> [tokens, seconds] over all rounds
    for n in [int(c) for c in clients.split(",") if c]:
        for round_ in range(rounds):
            # ABBA: no API always goes first
            for api in apis.split(",") if round_ % 2 == 0 else reversed(apis.split(",")):
                before = httpx.get(url + "/stats").json()
                t0 = time.perf_counter()
                results = asyncio.run(run_clients(api, n))
                wall = time.perf_counter() - t0
                after = httpx.get(url + "/stats").json()
                ttft = [r[0] for r in results if r[0] is not None]
                latency = [r[1] for r in results]
                dropped = sum(not r[3] for r in results)
                tokens = after["tokens_generated"] - before["tokens_generated"]
                total = totals.setdefault((api, n), [0, 0.0])
                total[0] = total[0] + tokens
                total[1] = total[1] + wall
                print0(f"| {api} | {n} | {len(results)} | {dropped} | {len(results) / wall:.2f} | "
                       f"{1000 * percentile(ttft, 50):.0f} / {1000 * percentile(ttft, 95):.0f} ms | "
                       f"{percentile(latency, 50):.2f} / {percentile(latency, 95):.2f} s | {tokens / wall:.0f} |")
    print0("tokens/s over all rounds: " + ", ".join(f"{api} at {n} clients {tokens / seconds:.0f}"
                                                    for (api, n), (tokens, seconds) in totals.items()))
    for n in [int(c) for c in clients.split(",") if c]:
        if ("nanochat", n) in totals and ("openai", n) in totals:
            ratio = ((totals["openai", n][0] / totals["openai", n][1])
                     / (totals["nanochat", n][0] / totals["nanochat", n][1]))
            print0(f"{n} clients: the OpenAI API's tokens/s are {ratio:.3f}x nanochat's")
finally:
    for process in (server, baseline):
        if process is not None:
            process.terminate()
            process.wait(timeout=30)
