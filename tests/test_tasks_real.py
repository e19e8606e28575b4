"""
Tests of the real-data tasks (SmolTalk, MMLU, GSM8K, ARC, CustomJSON) without the internet.

Tiny parquet files in the published schemas (tests/fixtures/tasks/<repo>/<path>, written by make_fixtures.py there)
are served by the local `file_server` at the hub's URL layout, with NANOCHAT_HF_URL pointing at it. Checked: each
file is downloaded once, every example renders through the real tokenizer with the mask on assistant tokens only,
GSM8K's calculator annotations become exactly the expected tool-call parts, evaluate() of MMLU/ARC/GSM8K, slicing,
the errors (bad names, corrupt or missing files, malformed CustomJSON lines), and `python -m tasks.registry show` of
the real tasks.
"""

import json
import logging
import os
import shutil
import sys

import pyarrow.parquet as pq
import pytest

from helpers import TASK_FIXTURES, run_script
from nanochat.output import UserError
from nanochat.tokenizer import Tokenizer
from tasks import arc, gsm8k, mmlu, smoltalk
from tasks.arc import ARC
from tasks.common import render_mc
from tasks.customjson import CustomJSON
from tasks.gsm8k import GSM8K, extract_answer, parse_answer
from tasks.mmlu import MMLU
from tasks.smoltalk import SmolTalk

FIXTURES = TASK_FIXTURES
REPOS = (smoltalk.REPO, mmlu.REPO, gsm8k.REPO, arc.REPO)
IDENTITY = os.path.join(FIXTURES, "identity_conversations.jsonl")


def served(repo, path):
    return f"/datasets/{repo}/resolve/main/{path}"


def fixture_rows(repo, path):
    return pq.read_table(os.path.join(FIXTURES, repo, path)).num_rows


def trained_text(conversation):
    """What the mask must select, built from the conversation independently of the tokenizer."""
    out = []
    for message in conversation["messages"]:
        if message["role"] != "assistant":
            continue
        content = message["content"]
        for part in [{"type": "text", "text": content}] if isinstance(content, str) else content:
            if part["type"] == "text":
                out.append(part["text"])
            elif part["type"] == "python":
                out.append(f"<|python_start|>{part['text']}<|python_end|>")
        out.append("<|assistant_end|>")
    return "".join(out)


def check_rendering(tok, conversation):
    """Renders, mask 1 exactly on the assistant's text, tool calls and <|assistant_end|>."""
    ids, mask = tok.render_conversation(conversation, max_tokens=100_000)
    assert len(ids) == len(mask) and set(mask) <= {0, 1}
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == trained_text(conversation)
    untrained = tok.decode([i for i, m in zip(ids, mask) if not m])
    for message in conversation["messages"]:
        if message["role"] in ("system", "user"):
            assert message["content"] in untrained
    return ids, mask


# -----------------------------------------------------------------------------
# Every loader: one download per file, the right size, renders with the right mask

LOADERS = [
    ("smoltalk-train", lambda: SmolTalk(split="train"), REPOS[0], "data/train-00000-of-00001.parquet"),
    ("smoltalk-test", lambda: SmolTalk(split="test"), REPOS[0], "data/test-00000-of-00001.parquet"),
    ("mmlu-all-test", lambda: MMLU(subset="all", split="test"), REPOS[1], "all/test-00000-of-00001.parquet"),
    ("mmlu-all-validation", lambda: MMLU(subset="all", split="validation"), REPOS[1],
     "all/validation-00000-of-00001.parquet"),
    ("mmlu-all-dev", lambda: MMLU(subset="all", split="dev"), REPOS[1], "all/dev-00000-of-00001.parquet"),
    ("mmlu-aux-train", lambda: MMLU(subset="auxiliary_train", split="train"), REPOS[1],
     "auxiliary_train/train-00000-of-00001.parquet"),
    ("gsm8k-train", lambda: GSM8K(subset="main", split="train"), REPOS[2], "main/train-00000-of-00001.parquet"),
    ("gsm8k-test", lambda: GSM8K(subset="main", split="test"), REPOS[2], "main/test-00000-of-00001.parquet"),
    ("arc-easy-train", lambda: ARC(subset="ARC-Easy", split="train"), REPOS[3],
     "ARC-Easy/train-00000-of-00001.parquet"),
    ("arc-easy-test", lambda: ARC(subset="ARC-Easy", split="test"), REPOS[3], "ARC-Easy/test-00000-of-00001.parquet"),
    ("arc-challenge-validation", lambda: ARC(subset="ARC-Challenge", split="validation"), REPOS[3],
     "ARC-Challenge/validation-00000-of-00001.parquet"),
]


def test_loaders_download_once_and_render(hub, trained_tokenizer, isolated_env):
    tok = Tokenizer.from_directory(str(trained_tokenizer))
    for name, make, repo, path in LOADERS:
        before = sum(hub.requests.values())
        task = make()
        assert hub.requests[served(repo, path)] == 1, name
        assert sum(hub.requests.values()) == before + 1, name  # that file and nothing else
        assert os.path.exists(isolated_env / "tasks" / repo / path), name
        assert len(task) == task.num_examples() == fixture_rows(repo, path), name
        again = make()  # a second construction reads the local copy
        assert sum(hub.requests.values()) == before + 1, name
        for i in range(len(task)):
            conversation = task[i]
            assert conversation == again[i]
            assert conversation["messages"][-1]["role"] == "assistant"
            check_rendering(tok, conversation)
            if task.eval_type == "categorical":
                answer = conversation["messages"][-1]["content"]
                assert answer in conversation["letters"] and f"({answer})\n" in conversation["messages"][0]["content"]
        with pytest.raises(IndexError):
            task[len(task)]


# -----------------------------------------------------------------------------
# GSM8K: calculator annotations -> tool calls, evaluation

def test_gsm8k_parse_answer_tricky_cases():
    # two annotations in a row, one at the end of a line (nothing after it), commas in the text's numbers
    answer = ("Each week the shop earns 1,200*3 = $<<1200*3=3600>><<3600-600=3000>>3,000 after rent.\n"
              "In 2 weeks it keeps 3000*2=<<3000*2=6000>>\nThat is $6,000.\n#### 6,000")
    assert parse_answer(answer) == [
        {"type": "text", "text": "Each week the shop earns 1,200*3 = $"},
        {"type": "python", "text": "1200*3"}, {"type": "python_output", "text": "3600"},
        {"type": "python", "text": "3600-600"}, {"type": "python_output", "text": "3000"},
        {"type": "text", "text": "3,000 after rent.\nIn 2 weeks it keeps 3000*2="},
        {"type": "python", "text": "3000*2"}, {"type": "python_output", "text": "6000"},
        {"type": "text", "text": "\nThat is $6,000.\n#### 6,000"},
    ]
    # an annotation first, spaces inside it, a decimal without a leading 0
    assert parse_answer("<< 12 * .5 = 6 >>6 pages.\n#### 6") == [
        {"type": "python", "text": "12 * .5"}, {"type": "python_output", "text": "6"},
        {"type": "text", "text": "6 pages.\n#### 6"},
    ]
    # no annotation: one text part; an annotation without "=" is dropped and the text around it joined
    assert parse_answer("It is 5.\n#### 5") == [{"type": "text", "text": "It is 5.\n#### 5"}]
    assert parse_answer("a <<note>>b\n#### 1") == [{"type": "text", "text": "a b\n#### 1"}]
    # the result is what follows the LAST "=" (an expression holding "==" keeps it)
    assert parse_answer("<<1==1=True>>") == [{"type": "python", "text": "1==1"},
                                             {"type": "python_output", "text": "True"}]


def test_gsm8k_extract_answer():
    assert extract_answer("so...\n#### 6,000") == "6000"
    assert extract_answer("#### $1,234.50 dollars") == "1234.50"
    assert extract_answer("####-3") == "-3"
    assert extract_answer("#### 7\n#### 8") == "7"  # the first one counts
    assert extract_answer("The answer is 72.") is None
    assert extract_answer("#### seventy") is None


def test_gsm8k_example_parts_mask_and_evaluate(hub, trained_tokenizer):
    tok = Tokenizer.from_directory(str(trained_tokenizer))
    task = GSM8K(subset="main", split="train")
    published = pq.read_table(os.path.join(FIXTURES, "openai/gsm8k/main/train-00000-of-00001.parquet"))
    answer_text = published.column("answer")[1].as_py()
    conversation = task[1]
    assert conversation["messages"][0]["role"] == "user"
    assert conversation["messages"][1]["content"] == parse_answer(answer_text)
    assert [p["type"] for p in conversation["messages"][1]["content"]] == [
        "text", "python", "python_output", "python", "python_output", "text", "python", "python_output", "text"]

    ids, mask = check_rendering(tok, conversation)
    special = tok.get_special_tokens()
    # every tool call is trained, every tool output is not, and the outputs hold exactly the results
    outputs = []
    calls = []
    for k, token in enumerate(ids):
        if token == special["<|output_start|>"]:
            end = ids.index(special["<|output_end|>"], k)
            assert mask[k:end + 1] == [0] * (end + 1 - k)
            outputs.append(tok.decode(ids[k + 1:end]))
        if token == special["<|python_start|>"]:
            end = ids.index(special["<|python_end|>"], k)
            assert mask[k:end + 1] == [1] * (end + 1 - k)
            calls.append(tok.decode(ids[k + 1:end]))
    assert calls == ["1200*3", "3600-600", "3000*2"]
    assert outputs == ["3600", "3000", "6000"]

    assert task.eval_type == "generative"
    assert task.evaluate(conversation, answer_text)  # the reference itself
    for response in ("... so it keeps\n#### 6000", "#### 6,000", "#### $6,000.", "#### 6000.0"):
        assert task.evaluate(conversation, response), response
        assert task.reward(conversation, response) == 1.0
    for response in ("#### 600", "#### 6001", "It keeps 6000 dollars.", ""):
        assert not task.evaluate(conversation, response), response
        assert task.reward(conversation, response) == 0.0
    # a different problem's reference is checked against its own number
    assert task.evaluate(task[0], "#### 48") and not task.evaluate(task[0], "#### 6000")


# -----------------------------------------------------------------------------
# MMLU and ARC: multiple choice

def test_mmlu_examples_and_evaluate(hub):
    task = MMLU(subset="all", split="test")
    assert task.eval_type == "categorical"
    conversation = task[0]
    assert conversation["messages"] == [
        {"role": "user", "content": render_mc("What is 7 * 8?", ["A", "B", "C", "D"], ["54", "56", "58", "64"])},
        {"role": "assistant", "content": "B"},
    ]
    assert conversation["letters"] == ["A", "B", "C", "D"] and conversation["subject"] == "elementary_mathematics"
    assert task.evaluate(conversation, "B") and task.evaluate(conversation, " B\n")
    assert not task.evaluate(conversation, "C") and not task.evaluate(conversation, "b")
    assert task.reward(conversation, "B") == 1.0 and task.reward(conversation, "A") == 0.0
    assert [task[i]["messages"][1]["content"] for i in range(len(task))] == ["B", "C", "D"]
    # auxiliary_train's struct layout is flattened into the same examples
    aux = MMLU(subset="auxiliary_train", split="train")
    question = render_mc("The capital of France is", "ABCD", ["Paris", "Lyon", "Nice", "Lille"])
    assert aux[1]["messages"][0]["content"] == question
    assert [aux[i]["messages"][1]["content"] for i in range(len(aux))] == ["B", "A", "C"]


def test_mmlu_accepts_the_struct_layout_for_any_file(hub):
    # serve the struct-layout auxiliary_train file at all/dev: it must load like a flat file
    root = os.path.join(hub.root, "datasets", "cais/mmlu", "resolve", "main")
    shutil.copy(os.path.join(root, "auxiliary_train/train-00000-of-00001.parquet"),
                os.path.join(root, "all/dev-00000-of-00001.parquet"))
    dev = MMLU(subset="all", split="dev")
    aux = MMLU(subset="auxiliary_train", split="train")
    assert [dev[i] for i in range(len(dev))] == [aux[i] for i in range(len(aux))]


def test_arc_labels_as_published(hub):
    easy = ARC(subset="ARC-Easy", split="test")
    assert easy.eval_type == "categorical"
    numeric = easy[0]  # published with labels 1-4
    assert numeric["letters"] == ["1", "2", "3", "4"]
    assert numeric["messages"][0]["content"] == render_mc("Which of these is a source of light?", ["1", "2", "3", "4"],
                                                          ["the Sun", "the Moon", "a mirror", "a rock"])
    assert numeric["messages"][1]["content"] == "1"
    assert easy.evaluate(numeric, "1") and not easy.evaluate(numeric, "A") and not easy.evaluate(numeric, "2")
    assert easy[1]["letters"] == ["A", "B", "C", "D"] and easy.evaluate(easy[1], "B")
    three = ARC(subset="ARC-Easy", split="train")[1]
    assert three["letters"] == ["A", "B", "C"] and three["messages"][1]["content"] == "B"
    five = ARC(subset="ARC-Challenge", split="validation")[0]
    assert five["letters"] == ["A", "B", "C", "D", "E"] and "- clouds (E)" in five["messages"][0]["content"]


# -----------------------------------------------------------------------------
# SmolTalk and CustomJSON: conversations as given

def test_smoltalk_conversations_as_published(hub):
    task = SmolTalk(split="train")
    table = pq.read_table(os.path.join(FIXTURES, REPOS[0], "data/train-00000-of-00001.parquet"))
    published = table.column("messages").to_pylist()
    assert ([task[i]["messages"] for i in range(len(task))]
            == [[{"role": m["role"], "content": m["content"]} for m in conv] for conv in published])
    assert task[0]["messages"][0]["role"] == "system"  # kept: the tokenizer merges it into the first user turn
    assert task.eval_type == "generative"
    with pytest.raises(NotImplementedError):
        task.evaluate(task[0], "anything")


def test_customjson_loads_and_renders(trained_tokenizer):
    tok = Tokenizer.from_directory(str(trained_tokenizer))
    task = CustomJSON(IDENTITY)
    with open(IDENTITY, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    assert len(task) == len(lines) == 2
    for i in range(len(task)):
        assert task[i]["messages"] == lines[i]
        check_rendering(tok, task[i])
    task[0]["messages"][0]["content"] = "changed"  # examples are copies
    assert task[0]["messages"][0]["content"] == "Who are you?"


GOOD = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize("bad_line, expected", [
    ('[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}', "not valid JSON"),
    ('{"role": "user", "content": "hi"}', "non-empty JSON array"),
    ("[]", "non-empty JSON array"),
    (json.dumps([{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]),
     "message 0 has role 'assistant', expected 'user'"),
    (json.dumps([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]),
     "message 1 has role 'user', expected 'assistant'"),
    (json.dumps(GOOD + [{"role": "user", "content": "bye"}]), "last message must be the assistant's"),
    (json.dumps(GOOD + [{"role": "system", "content": "late"}, GOOD[1]]), "message 2 has role 'system'"),
    (json.dumps([{"role": "user"}, GOOD[1]]), "message 0 must be an object with 'role' and 'content'"),
    (json.dumps([{"role": "user", "content": ["x"]}, GOOD[1]]), "message 0 (user) content must be a string"),
    (json.dumps([GOOD[0], {"role": "assistant", "content": [{"type": "code", "text": "1"}]}]), "message 1 part 0"),
    (json.dumps([{"role": "system", "content": "s"}]), "system message alone"),
])
def test_customjson_bad_line_names_file_and_line(tmp_path, bad_line, expected):
    path = tmp_path / "convs.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + bad_line + "\n" + json.dumps(GOOD) + "\n", encoding="utf-8")
    with pytest.raises(UserError) as e:
        CustomJSON(str(path))
    assert f"{path}, line 3: " in str(e.value) and expected in str(e.value)


def test_customjson_accepts_system_and_parts_and_rejects_empty_or_missing(tmp_path):
    path = tmp_path / "ok.jsonl"
    parts = [{"type": "text", "text": "It is "}, {"type": "python", "text": "2+2"},
             {"type": "python_output", "text": "4"}]
    conversation = [{"role": "system", "content": "s"}, GOOD[0], {"role": "assistant", "content": parts}]
    path.write_text(json.dumps(conversation) + "\n")
    assert len(CustomJSON(str(path))) == 1
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(UserError, match="no conversations"):
        CustomJSON(str(tmp_path / "empty.jsonl"))
    with pytest.raises(UserError, match="no file"):
        CustomJSON(str(tmp_path / "missing.jsonl"))


# -----------------------------------------------------------------------------
# Slicing, bad arguments, bad files

def test_slicing(hub):
    full = MMLU(subset="all", split="test")
    answers = [full[i]["messages"][1]["content"] for i in range(len(full))]
    for kwargs, expected in [({"start": 1}, answers[1:]), ({"stop": 2}, answers[:2]), ({"step": 2}, answers[::2]),
                             ({"start": 1, "stop": 100}, answers[1:]), ({"start": 3}, [])]:
        view = MMLU(subset="all", split="test", **kwargs)
        assert [view[i]["messages"][1]["content"] for i in range(len(view))] == expected, kwargs
        with pytest.raises(IndexError):
            view[len(view)]
    gsm = GSM8K(subset="main", split="train", start=1, stop=3)
    assert len(gsm) == 2 and gsm[0] == GSM8K(subset="main", split="train")[1]


def test_bad_names_fail_before_any_download(hub):
    for make, message in [
        (lambda: MMLU(subset="physics", split="test"),
         "MMLU subset must be one of all, auxiliary_train, got 'physics'"),
        (lambda: MMLU(subset="auxiliary_train", split="test"), "has split(s) train, got 'test'"),
        (lambda: GSM8K(subset="main", split="validation"), "GSM8K split must be one of train, test"),
        (lambda: ARC(subset="ARC-Hard", split="test"), "ARC subset must be one of ARC-Easy, ARC-Challenge"),
        (lambda: SmolTalk(split="validation"), "SmolTalk split must be one of train, test"),
    ]:
        with pytest.raises(UserError) as e:
            make()
        assert message in str(e.value)
    assert hub.requests == {}


def test_missing_corrupt_or_foreign_files_are_errors(hub):
    root = os.path.join(hub.root, "datasets", REPOS[2], "resolve", "main")
    os.remove(os.path.join(root, "main/test-00000-of-00001.parquet"))
    with pytest.raises(UserError, match="could not download"):  # 404: no retries, no fallback
        GSM8K(subset="main", split="test")
    with open(os.path.join(root, "main/train-00000-of-00001.parquet"), "wb") as f:
        f.write(b"<html>not a parquet file</html>")
    with pytest.raises(UserError, match="not a readable parquet file"):
        GSM8K(subset="main", split="train")
    # a parquet file of another dataset at the right path: the columns say so
    shutil.copy(os.path.join(FIXTURES, REPOS[0], "data/test-00000-of-00001.parquet"),
                os.path.join(root, "main/test-00000-of-00001.parquet"))
    with pytest.raises(UserError, match="lacks column"):
        GSM8K(subset="main", split="test")


# -----------------------------------------------------------------------------
# `python -m tasks.registry show NAME` prints a few rendered examples

@pytest.fixture
def restore_logging(monkeypatch):
    """main() calls setup_default_logging(), which configures the "nanochat" logger and sys.excepthook."""
    nano = logging.getLogger("nanochat")
    handlers = list(nano.handlers)
    propagate = nano.propagate
    level = nano.level
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    yield
    nano.handlers[:] = handlers
    nano.propagate = propagate
    nano.setLevel(level)


def test_show_prints_rendered_examples(hub, trained_tokenizer, restore_logging, capsys):
    from tasks.registry import main
    for argv, marker in [
        (["show", "GSM8K", "-n", "2"], "<|python_start|>"),
        (["show", "MMLU"], "[[B|<|assistant_end|>]]"),
        (["show", "ARC-Challenge", "--split=train"], "[[C|<|assistant_end|>]]"),
        (["show", "SmolTalk"], "<|user_start|>"),
        (["show", "sft/custom/train", f"--conversations={IDENTITY}"], "  Conversations train: 1 examples"),
    ]:
        main(argv)
        out = capsys.readouterr().out
        assert marker in out and "<|assistant_end|>" in out, argv
        assert "[[" in out, argv  # the trained tokens are marked (no colours: not a terminal)
    assert out.startswith("sft/custom/train - scripts/chat_sft.py --mixture=custom --conversations=FILE")


def test_show_without_tokenizer_prints_json(hub):
    # (hub sets NANOCHAT_HF_URL; the isolated base dir has no tokenizer)
    result = run_script("-m", "tasks.registry", "show", "GSM8K", "-n", "1", timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("GSM8K: downloads openai/gsm8k; in ChatCORE (guessing scores 0.0); on the report "
                                    "card as GSM8K\n  mid/real/train: GSM8K train\n")
    assert "no trained tokenizer" in result.stdout and '"type": "python_output"' in result.stdout
