"""
Check that the web server serves a trained model to OpenAI's own Python client.

The last stage of speedrun.sh's gpu smoke (NANOCHAT_PROFILE=gpu NANOCHAT_SMOKE=1).

    python -m scripts.chat_web_check --source=rl     # needs `openai` (a dev dependency: pip install openai)

Starts `python -m scripts.chat_web` (one worker, on a free port of 127.0.0.1; its output goes where this script's
goes), waits until it lists its model at /v1/models, asks /v1/chat/completions for one greedy reply, checks that the
reply has text, then stops the server as Ctrl-C does and checks that it exits 0. Writes a "Chat web" section of the
report (the reply, its tokens, the times) and prints one line. Anything else is a one-line error (exit 1).
"""

import signal
import socket
import subprocess
import sys
import time

from nanochat.configurator import check_config, configure
from nanochat.output import UserError
from nanochat.report import get_report

source = "sft"  # which stage's model chat_web serves: base | mid | sft | rl
device_type = ""  # chat_web's --device_type: cuda | cpu | mps; empty = autodetect
question = "What is a list comprehension?"  # the user's message
max_tokens = 32  # longest reply
start_timeout = 300.0  # seconds for the server to load the model and answer /v1/models
config = configure(globals())
check_config(config, positive=["max_tokens", "start_timeout"],
             choices={"source": ("base", "mid", "sft", "rl"), "device_type": ("", "cuda", "cpu", "mps")})
try:
    import openai
except ImportError:
    raise UserError("chat_web_check talks to the server through OpenAI's client: pip install openai") from None

with socket.socket() as s:  # a port free now; chat_web refuses in one line if another process takes it first
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
command = [sys.executable, "-m", "scripts.chat_web", f"--source={source}", f"--port={port}", "--num_gpus=1"]
command += [f"--device_type={device_type}"] if device_type else []
t0 = time.time()
server = subprocess.Popen(command)
try:
    # No retries: the first answer is the one checked. Until the server listens, the client cannot connect.
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    while True:
        if server.poll() is not None:
            raise UserError(f"chat_web exited with status {server.returncode} before serving (its output is above)")
        if time.time() - t0 > start_timeout:
            raise UserError(f"chat_web did not serve within {start_timeout:.0f} s (--start_timeout)")
        try:
            served = [m.id for m in client.models.list().data]
            break
        except openai.APIConnectionError:
            time.sleep(0.5)
    serving_s = time.time() - t0
    t1 = time.time()
    reply = client.chat.completions.create(model=served[0], messages=[{"role": "user", "content": question}],
                                           max_tokens=max_tokens, temperature=0)
    answer_s = time.time() - t1
    text = reply.choices[0].message.content or ""
    tokens = reply.usage.completion_tokens
    if not text.strip():
        raise UserError(f"chat_web answered with no text "
                        f"({tokens} tokens, finish_reason {reply.choices[0].finish_reason})")
finally:
    if server.poll() is None:  # as Ctrl-C stops it: uvicorn ends its connections and exits 0
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
if server.returncode != 0:
    raise UserError(f"chat_web exited with status {server.returncode} after Ctrl-C (SIGINT), not 0")

get_report().log("Chat web", [{"Source": source, "Model served": served[0], "Question": question,
                               "Reply": repr(text), "Reply tokens": tokens,
                               "Finish reason": reply.choices[0].finish_reason,
                               "Seconds to serve (start, model loaded)": serving_s, "Seconds to answer": answer_s}])
print(f"chat_web_check: the {source} model answered through OpenAI's client ({tokens} tokens in {answer_s:.1f} s, "
      f"served {serving_s:.1f} s after its start; stopped cleanly): {text!r}")
