"""
Chat with a trained model in the browser: the chat page and a streaming API, served by FastAPI + uvicorn.

    python -m scripts.chat_web                             # the SFT model on http://127.0.0.1:8000
    python -m scripts.chat_web --source=mid --port=8080    # another stage's model (base | mid | sft | rl), another port
    python -m scripts.chat_web --num_gpus=8                # 8 workers, one per GPU, each decoding a batch
    python -m scripts.chat_web --max_batch=16 --max_queue=8   # 16 replies decode together; 8 may wait; then 429
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
      429 {"detail": "the server is busy: ..."}: --max_queue requests wait already (retry later).
    GET /health   {"status": "ok", "workers": N}
    GET /stats    workers, busy, queue, rows in each worker's batch, tokens in flight, requests served (and
                  cancelled, failed, refused), tokens generated, tokens/s
    GET /         the chat page (nanochat/ui.html: one file, no external resources, relative URLs)
    /v1/models, /v1/chat/completions, /v1/completions: an OpenAI-compatible API (nanochat/openai_api.py), for
                  OpenAI's client libraries, chat UIs and lm-evaluation-harness, on the same workers

How requests are served: one worker (an Engine with a thread of its own) per GPU with --num_gpus=N, else one on
the CPU or the Mac's GPU (MPS). Each worker decodes a batch: a request joins the running batch of the worker with
the fewest rows, each with its own prompt, sampling settings and seed, and leaves it when its reply ends; past
--max_batch rows (or --max_tokens_in_flight tokens) it waits in a queue of at most --max_queue requests. A client
that goes away (a closed tab, the page's Stop button) leaves the batch at once (nanochat/serving.py).

The conversation: messages alternate user / assistant, starting and ending with user (the message to reply
to). The whole conversation is the prompt, so it must fit in the model's context (the length it was trained
on) with room for at least one token; the reply stops at max_tokens, at the end of the context, or when the
model ends its turn. Sampling uses a fresh random seed per request unless the request gives one ("seed":
the same request with the same seed gets the same reply, e.g. for tests).
"""

import socket

import uvicorn

from nanochat.batching import Worker, WorkerPool, worker_devices
from nanochat.checkpoint_manager import load_model
from nanochat.configurator import check_config, configure
from nanochat.engine import Engine
from nanochat.hardware import compute_dtype_line
from nanochat.openai_api import mount as mount_openai_api
from nanochat.output import UserError, print0
from nanochat.processes import autodetect_device_type, compute_init
from nanochat.serving import Settings, create_app

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
max_batch = 8  # most replies a worker decodes together (its batch); more wait in the queue
max_queue = 64  # most requests waiting for a place in a batch; beyond: 429 "the server is busy"
max_tokens_in_flight = 32768  # most prompt + max_tokens tokens a worker's batch holds (its KV cache); beyond: wait
prefill_chunk = 256  # a prompt arriving while others decode is prefilled this many tokens per step
compile_decode = "auto"  # the decode step under torch.compile, one CUDA graph a step: auto (= on for CUDA, where
#                         it saves the launches that bound a small batch's step; off for CPU and MPS, where the eager
#                         step measured faster: bench/RESULTS.md) | true | false. Each batch size (rows rounded up to
#                         a power of two) compiles at its first step
config = configure(globals())
check_config(config, positive=["num_gpus", "max_tokens", "max_messages", "max_message_chars",
                               "max_conversation_chars", "max_tokens_limit", "max_batch", "max_tokens_in_flight",
                               "prefill_chunk"],
             non_negative=["top_k", "max_queue"], choices={"source": ("base", "mid", "sft", "rl"),
                                              "device_type": ("", "cuda", "cpu", "mps"),
                                              "compile_decode": ("auto", "true", "false")})
if not 0 <= temperature <= 2:
    raise UserError(f"--temperature must be between 0 and 2, got {temperature}")
if max_tokens > max_tokens_limit:
    raise UserError(f"--max_tokens={max_tokens} exceeds --max_tokens_limit={max_tokens_limit}")
if not 0 < port < 65536:
    raise UserError(f"--port must be between 1 and 65535, got {port}")
if not model_name:
    raise UserError("--model_name must not be empty")

# Fail now, before loading any model, if the port is taken (uvicorn would only say so after)
family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
with socket.socket(family, socket.SOCK_STREAM) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a port in TIME_WAIT is free
    try:
        s.bind((host, port))
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}): pick another port with --port=...") from None

# -----------------------------------------------------------------------------
# Compute, the workers (one model per device), the app

device_type = device_type or autodetect_device_type()
compute_init(device_type)
print0(compute_dtype_line(device_type))
workers = []
compiled = compile_decode == "true" or (compile_decode == "auto" and device_type == "cuda")
for index, device in enumerate(worker_devices(device_type, num_gpus)):  # one model per device: replies in parallel
    model, tokenizer, _ = load_model(source, device, phase="eval", model_tag=model_tag or None, step=step)
    workers.append(Worker(index, Engine(model, tokenizer, compile_decode=compiled), prefill_chunk=prefill_chunk))
pool = WorkerPool(workers, max_batch=max_batch, max_queue=max_queue, max_tokens_in_flight=max_tokens_in_flight)
app = create_app(pool, Settings(temperature=temperature, top_k=top_k, max_tokens=max_tokens,
                                max_tokens_limit=max_tokens_limit, max_messages=max_messages,
                                max_message_chars=max_message_chars, max_conversation_chars=max_conversation_chars,
                                model_name=model_name, api_key=api_key))  # /, /health, /stats, /chat/completions
mount_openai_api(app)  # /v1/models, /v1/chat/completions, /v1/completions on the same workers

# -----------------------------------------------------------------------------
# Serve

if host not in ("127.0.0.1", "localhost", "::1"):
    print0(f"WARNING: listening on {host}:{port}, beyond this machine: anyone who can reach it can use the model "
           f"(there is no authentication). Use the default --host=127.0.0.1 to keep it private.")
shown = "127.0.0.1" if host == "0.0.0.0" else host
print0(f"{len(pool.workers)} worker(s) on {', '.join(pool.stats()['devices'])}; context {pool.context_len} tokens; "
       f"decode step {'compiled' if compiled else 'eager'}. Chat at http://{shown}:{port}/")
uvicorn.run(app, host=host, port=port, timeout_graceful_shutdown=5)  # Ctrl-C: open streams get 5 s to end
