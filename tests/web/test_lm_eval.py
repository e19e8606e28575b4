"""
EleutherAI's lm-evaluation-harness scores the tiny base model as nanochat does, on both paths of docs/serving.md.

The real harness (`python -m lm_eval`, a dev dependency) scores the session's tiny base model through both paths
docs/serving.md shows: the OpenAI-compatible server (scripts.chat_web, its `--model local-completions` command) and
`--model hf` on the exported directory (with its setting for each kind of task). Every log-likelihood
the harness logs (--log_samples) must equal our own scoring of the same text within 1e-3: the tokenizer's ids after
one <|bos|>, the model's fp32 forward pass, the sum of the log-probabilities of the continuation's tokens (of the
whole document, for rolling perplexity).

The tasks are local (tests/fixtures/lm_eval: a multiple-choice task and a rolling-perplexity task, read with
--include_path; no Hub, HF_*_OFFLINE=1), with rows added here where the model's greedy next token is <|bos|>: a
document, and a multiple-choice answer, that end where the model would end them. The server used to lose a token's
log-probability there (it returned no completion token, and the harness drops the last token it gets).
"""

import glob
import json
import os
import shutil
import signal
import subprocess

import pytest
import torch

from helpers import REPO_ROOT, run_script, start_script
from web.served import document_ends, free_port, wait_serving

pytest.importorskip("lm_eval", reason="needs lm-evaluation-harness: pip install -e '.[dev]'")

TASKS = os.path.join(REPO_ROOT, "tests", "fixtures", "lm_eval")
TOLERANCE = 1e-3  # nats, per request
# The commands of docs/serving.md, as written there (a model of context 2048; the tiny model's is 512)
SERVER_ARGS = ("model=nanochat,base_url=http://127.0.0.1:8000/v1/completions,tokenizer_backend=remote,"
               "max_length=2047,num_concurrent=1")
SERVER_COMMAND = (f"lm_eval --model local-completions --tasks arc_easy,hellaswag,wikitext --model_args \\\n"
                  f"  {SERVER_ARGS}")
HF_CHOICE_COMMAND = ("lm_eval --model hf --model_args pretrained=nanochat-d20-base,dtype=float32 "
                     "--tasks arc_easy,hellaswag")
HF_ROLLING_COMMAND = ("lm_eval --model hf --model_args pretrained=nanochat-d20-base,dtype=float32,add_bos_token=False "
                      "--tasks wikitext")


@pytest.fixture(scope="module")
def ours(chat_web_base):
    """
    (model, tokenizer) of the tiny base model the server serves, as our code loads it: fp32 weights, and no
    autocast here, so an fp32 forward pass.
    """
    from nanochat.checkpoint_manager import load_model
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(chat_web_base))
        model, tokenizer, _ = load_model("base", "cpu", phase="eval")
    return model, tokenizer


def our_loglikelihood(ours, context, continuation):
    """
    log P(continuation | <|bos|> context), as nanochat scores text. The continuation's tokens are those of context +
    continuation after the context's, which is how the harness splits them when the context ends in no whitespace
    (it moves that to the continuation) and its tokens start those of the whole: both checked.
    """
    model, tokenizer = ours
    context_ids = tokenizer.encode(context)
    ids = tokenizer.encode(context + continuation, prepend="<|bos|>")
    assert context == context.rstrip() and ids[1:len(context_ids) + 1] == context_ids, (context, continuation)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids]))[0], dim=-1)
    return sum(logprobs[j - 1, ids[j]].item() for j in range(len(context_ids) + 1, len(ids)))


@pytest.fixture(scope="module")
def tasks(ours, chat_web_base, tmp_path_factory):
    """
    The fixture tasks, copied, with rows that end where the model expects <|bos|> next: two documents, and a
    question whose first choice is the last tokens of a third. Returns the directory (lm_eval's working directory:
    the tasks' data_files are relative).
    """
    model, tokenizer = ours
    out = tmp_path_factory.mktemp("lm_eval") / "tasks"
    shutil.copytree(TASKS, out)
    ends = document_ends(model, tokenizer, os.path.join(chat_web_base, "base_data", "pydocs"), 3)
    with open(out / "docs.jsonl", "a") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text, _ in ends[:2])
    text, ids = ends[2]
    # the context: the document up to a few tokens before its end, cut where the harness would not move anything
    next(k for k in range(len(ids) - 2, 0, -1) if (context := tokenizer.decode(ids[:k])) == context.rstrip()
         and tokenizer.encode(context) == ids[:k])
    row = {"context": context, "choices": [text[len(context):], " and so on.\n"], "answer": 0}
    with open(out / "choice.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    return out


def run_lm_eval(command, tasks, out, **env):
    """
    Run a command of lm_eval from docs/serving.md (its text, with `python -m lm_eval` for `lm_eval`) on the fixture
    tasks, offline, with per-sample logs in `out`. Returns {task: [(context, continuation, the harness's
    log-likelihood)]}.
    """
    args = command.replace("\\\n", " ").split()[1:]
    args += ["--include_path", str(tasks), "--log_samples", "--output_path", str(out)]
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": out / "hf_home", **env}
    result = run_script("-m", "lm_eval", *args, cwd=tasks, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = {}
    for task in ("nanochat_choice", "nanochat_docs"):
        (path,) = glob.glob(str(out / "*" / f"samples_{task}_*.jsonl"))
        logged[task] = []
        for sample in map(json.loads, open(path)):
            for request, response in zip(sample["arguments"].values(), sample["resps"]):
                parts = list(request.values())  # (context, continuation), or (document,) for rolling perplexity
                context, continuation = ("", *parts) if len(parts) == 1 else parts
                value = response[0][0] if isinstance(response[0], list) else response[0]  # (ll, is_greedy) or ll
                logged[task].append((context, continuation, float(value)))
    assert len(logged["nanochat_choice"]) == 3 * 4 + 2 and len(logged["nanochat_docs"]) == 3 + 2
    return logged


def differences(ours, logged):
    """{task: the largest |harness - ours| over its requests}"""
    return {task: max(abs(value - our_loglikelihood(ours, context, continuation))
                      for context, continuation, value in rows)
            for task, rows in logged.items()}


@pytest.mark.slow
def test_lm_eval_through_the_server_scores_as_nanochat(ours, tasks, chat_web_base, tmp_path):
    serving = open(os.path.join(REPO_ROOT, "docs", "serving.md"), encoding="utf-8").read()
    assert SERVER_COMMAND in serving
    port = free_port()
    server = start_script("-m", "scripts.chat_web", "--source=base", "--device_type=cpu", f"--port={port}",
                          env={"NANOCHAT_BASE_DIR": chat_web_base, "NANOCHAT_DTYPE": "float32"},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_serving(server, f"http://127.0.0.1:{port}")
        command = SERVER_COMMAND.replace(":8000/", f":{port}/").replace("max_length=2047", "max_length=511")
        command = command.replace("arc_easy,hellaswag,wikitext", "nanochat_choice,nanochat_docs")
        logged = run_lm_eval(command, tasks, tmp_path / "out")
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.communicate()
    worst = differences(ours, logged)
    assert max(worst.values()) <= TOLERANCE, worst


@pytest.fixture(scope="module")
def exported(chat_web_base, tmp_path_factory):
    """The tiny base model exported in fp32, as docs/serving.md exports it."""
    out = tmp_path_factory.mktemp("export") / "hf"
    result = run_script("-m", "scripts.export_model", "--source=base", f"--out={out}", "--dtype=float32",
                        env={"NANOCHAT_BASE_DIR": chat_web_base})
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("command, right, wrong", [
    # the exported tokenizer puts <|bos|> first: right for a context, but a rolling window also starts with the
    # harness's prefix token, so a document is read after two <|bos|> and the second one is scored
    (HF_CHOICE_COMMAND, "nanochat_choice", "nanochat_docs"),
    # without it, the rolling window's prefix token is the one <|bos|>, and the contexts have none
    (HF_ROLLING_COMMAND, "nanochat_docs", "nanochat_choice"),
], ids=["multiple choice", "rolling perplexity"])
def test_lm_eval_on_the_export_scores_as_nanochat_with_the_docs_setting(ours, tasks, exported, tmp_path, command,
                                                                        right, wrong):
    serving = open(os.path.join(REPO_ROOT, "docs", "serving.md"), encoding="utf-8").read()
    assert command in serving
    command = command.replace("pretrained=nanochat-d20-base", f"pretrained={exported}")
    command = command.replace("arc_easy,hellaswag", "nanochat_choice,nanochat_docs")
    command = command.replace("wikitext", "nanochat_choice,nanochat_docs")
    worst = differences(ours, run_lm_eval(command + " --device cpu", tasks, tmp_path / "out"))
    assert worst[right] <= TOLERANCE and worst[wrong] > TOLERANCE, worst
