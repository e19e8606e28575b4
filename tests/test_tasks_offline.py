"""
Tests of the offline chat tasks, their mixtures, and what every task shares (tasks/common.py).

Task slicing, TaskMixture, render_mc; the offline tasks (SpellingBee, SimpleSpelling, Arithmetic, PydocsChat,
PydocsMC, Identity) and the offline mixtures of tasks/registry.py: deterministic, train and test disjoint, every
example renders through the real tokenizer with the mask on exactly the assistant's text and tool calls (tool outputs
masked), evaluate() accepts the reference and rejects a wrong answer, calculator outputs are what Python computes,
and the identity JSONL round-trips through CustomJSON.
"""

import json
import os
import re

import pytest

from helpers import run_script
from nanochat.output import UserError
from nanochat.pydocs import pydocs_entries
from nanochat.tokenizer import get_tokenizer
from tasks.arithmetic import Arithmetic, assistant_text, extract_answer
from tasks.common import Task, TaskMixture, render_mc
from tasks.customjson import CustomJSON
from tasks.identity import Identity, identity_conversations, write_identity_jsonl
from tasks.pydocs_chat import PydocsChat, PydocsMC, entries, masked_documentation, summary, trim_doc
from tasks.registry import build_tasks, stage_mixture, stage_tasks
from tasks.spellingbee import SimpleSpelling, SpellingBee, _code_use, spell, words


# -----------------------------------------------------------------------------
# tasks/common.py

class Numbers(Task):
    """A toy task: example i is a one-exchange conversation about the number i."""

    def __init__(self, n, tag="n", **kwargs):
        self.n = n
        self.tag = tag
        super().__init__(**kwargs)

    def num_examples(self):
        return self.n

    def get_example(self, index):
        return {"messages": [{"role": "user", "content": f"{self.tag}{index}"},
                             {"role": "assistant", "content": str(index)}]}


def ids_of(task_or_mixture):
    return [task_or_mixture[i]["messages"][0]["content"] for i in range(len(task_or_mixture))]


def test_task_slicing():
    assert ids_of(Numbers(5)) == ["n0", "n1", "n2", "n3", "n4"]
    assert ids_of(Numbers(10, start=2, stop=8, step=3)) == ["n2", "n5"]
    assert ids_of(Numbers(10, start=7)) == ["n7", "n8", "n9"]
    assert ids_of(Numbers(10, step=4)) == ["n0", "n4", "n8"]
    assert len(Numbers(10, stop=100)) == 10  # stop past the end is clamped to the dataset
    assert len(Numbers(10, start=12)) == 0
    task = Numbers(10, start=1, stop=9, step=2)
    assert len(task) == len(range(1, 9, 2)) == 4
    assert task[3]["messages"][1]["content"] == "7"
    for bad in (4, -1, 100):
        with pytest.raises(IndexError):
            task[bad]
    for kwargs in (dict(start=-1), dict(step=0), dict(start=5, stop=2)):
        with pytest.raises(ValueError):
            Numbers(10, **kwargs)


def test_task_mixture():
    a = Numbers(30, tag="a")
    b = Numbers(10, tag="b")
    order = ids_of(TaskMixture([a, b], seed=7))
    assert order == ids_of(TaskMixture([a, b], seed=7))  # deterministic
    assert order != ids_of(TaskMixture([a, b], seed=8))  # the seed matters
    assert sorted(order) == sorted(ids_of(a) + ids_of(b))  # every example exactly once
    assert order[:10] != ids_of(a)[:10]  # shuffled, not concatenated
    doubled = ids_of(TaskMixture([a, b, b], seed=7))
    assert len(doubled) == 50
    assert sum(x.startswith("b") for x in doubled) == 20 and all(doubled.count(x) == 2 for x in ids_of(b))
    assert sorted(set(doubled)) == sorted(ids_of(a) + ids_of(b))
    mixture = TaskMixture([a, b])
    for bad in (-1, 40):
        with pytest.raises(IndexError):
            mixture[bad]
    # task_of: which task scores example i (chat_rl rewards a mixture's answers with it); a Task scores its own
    for i in range(40):
        assert mixture.task_of(i) is (a if mixture[i]["messages"][0]["content"].startswith("a") else b)
    assert a.task_of(3) is a


def test_render_mc():
    text = render_mc("What is the capital of France?", ["A", "B", "C"], ["Paris", "Rome", "Oslo"])
    assert text == ("Multiple Choice question: What is the capital of France?\n- Paris (A)\n- Rome (B)\n- Oslo (C)\n"
                    "\nRespond only with the letter of the correct answer.")


# -----------------------------------------------------------------------------
# Offline tasks: one small train and test instance of each

SMALL = {
    "SpellingBee": lambda split, **kw: SpellingBee(split=split, size=80, **kw),
    "SimpleSpelling": lambda split, **kw: SimpleSpelling(split=split, size=80, **kw),
    "Arithmetic": lambda split, **kw: Arithmetic(split=split, size=80, **kw),
    "PydocsChat": lambda split, **kw: PydocsChat(split=split, step=90 if split == "train" else 10, **kw),
    "PydocsMC": lambda split, **kw: PydocsMC(split=split, step=90 if split == "train" else 10, **kw),
    "Identity": lambda split, **kw: Identity(split=split, size=80, **kw),
}


def dump(example):
    return json.dumps(example, sort_keys=True)


def expected_render(conversation):
    """
    (trained text, untrained text) that decoding the masked / unmasked tokens must give, built from the
    conversation by the chat format's rules, independently of the tokenizer's code.
    """
    trained = ""
    untrained = "<|bos|>"
    for message in conversation["messages"]:
        if message["role"] == "user":
            untrained += f"<|user_start|>{message['content']}<|user_end|>"
            continue
        untrained += "<|assistant_start|>"
        content = message["content"]
        for part in [{"type": "text", "text": content}] if isinstance(content, str) else content:
            if part["type"] == "text":
                trained += part["text"]
            elif part["type"] == "python":
                trained += f"<|python_start|>{part['text']}<|python_end|>"
            else:
                untrained += f"<|output_start|>{part['text']}<|output_end|>"
        trained += "<|assistant_end|>"
    return trained, untrained


def wrong_response(name, conversation):
    """A plausible but wrong answer to `conversation`."""
    reference = assistant_text(conversation["messages"][-1])
    if name in ("SpellingBee", "Arithmetic"):
        return reference.replace(f"#### {extract_answer(reference)}", f"#### {int(extract_answer(reference)) + 1}")
    if name == "SimpleSpelling":
        word = conversation["word"]
        return reference.replace(spell(word), spell(word[1:] + word[0] if len(set(word)) > 1 else word + "x"))
    if name == "PydocsChat":
        return reference.split("\n\n")[0] + "\n\nIt does something else entirely."
    if name == "PydocsMC":
        return "A" if reference != "A" else "B"
    return "I am ChatGPT, a large model made by OpenAI. I can browse the web and I am always right."


@pytest.mark.parametrize("name", sorted(SMALL))
def test_offline_task(name, trained_tokenizer):
    make = SMALL[name]
    train = make("train")
    test = make("test")
    assert len(train) > 20 and len(test) > 20
    assert train.eval_type == ("categorical" if name == "PydocsMC" else "generative")
    # deterministic: a second instance gives the same examples; a different seed other ones (seeded tasks)
    assert [dump(x) for x in train] == [dump(x) for x in make("train")]
    assert [dump(x) for x in train] != [dump(x) for x in make("train", seed=1)]
    # train and test share no question (Identity: no conversation; its questions are few and recur)
    key = (lambda x: dump(x["messages"])) if name == "Identity" else (lambda x: x["messages"][0]["content"])
    assert not {key(x) for x in train} & {key(x) for x in test}
    tokenizer = get_tokenizer()
    for task in (train, test):
        for conversation in task:
            ids, mask = tokenizer.render_conversation(conversation, max_tokens=10**6)
            trained, untrained = expected_render(conversation)
            assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == trained
            assert tokenizer.decode([i for i, m in zip(ids, mask) if not m]) == untrained
            reference = assistant_text(conversation["messages"][-1])
            assert task.evaluate(conversation, reference) is True, (name, conversation)
            assert task.evaluate(conversation, wrong_response(name, conversation)) is False, (name, conversation)
            assert task.reward(conversation, reference) == 1.0


def test_tool_output_is_masked_on_a_concrete_example(trained_tokenizer):
    tokenizer = get_tokenizer()
    example = next(x for x in SpellingBee("train", size=200) if x["answer"] >= 2)
    ids, mask = tokenizer.render_conversation(example)
    word = example["word"]
    letter = example["letter"]
    count = example["answer"]
    masked_out = tokenizer.decode([i for i, m in zip(ids, mask) if not m])
    masked_in = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert f"<|output_start|>{count}<|output_end|>" in masked_out
    assert "<|output_start|>" not in masked_in and "<|output_end|>" not in masked_in
    assert f"<|python_start|>'{word}'.count('{letter}')<|python_end|>" in masked_in
    assert masked_in.endswith(f"#### {count}<|assistant_end|>")
    assert masked_out.startswith("<|bos|><|user_start|>") and word in masked_out.split("<|user_end|>")[0]


def test_spelling_words_and_answers():
    train_words = words("train")
    test_words = words("test")
    assert len(train_words) > 1000 and len(test_words) > 100
    assert not set(train_words) & set(test_words)
    for w in train_words + test_words:
        assert re.fullmatch(r"[a-z]{3,12}", w)
    assert train_words == sorted(set(train_words))
    every = set(train_words + test_words)
    assert {"file", "count", "number", "value"} <= every  # English words that are also names stay
    assert not {"didn", "isn", "doesn", "getnframes", "argv"} & every  # contraction halves and code go
    text = "Call getnframes() on sys.argv or os.environ; didn't `len` set x=1 and the value."
    code = {m.group(): _code_use(text, m.start(), m.end()) for m in re.finditer(r"[A-Za-z]+", text)}
    assert [w for w, c in code.items() if c] == ["getnframes", "sys", "argv", "os", "environ", "didn", "len", "x"]
    for x in SpellingBee("test", size=100):
        assert x["word"] in test_words
        assert x["answer"] == x["word"].count(x["letter"])
        python, output = x["messages"][1]["content"][1:3]
        assert eval(python["text"]) == int(output["text"]) == x["answer"]
    for x in SimpleSpelling("train", size=100):
        assert x["word"] in train_words and spell(x["word"]) in x["messages"][1]["content"]
    with pytest.raises(UserError):
        SpellingBee("val")


def test_arithmetic_calculations_and_split():
    train = Arithmetic("train", size=1500)
    test = Arithmetic("test", size=300)

    def calculations(x):
        return tuple(p["text"] for p in x["messages"][1]["content"] if p["type"] == "python")

    assert not {calculations(x) for x in train} & {calculations(x) for x in test}  # no problem in both
    assert len({x["messages"][0]["content"] for x in train}) > 1000  # varied
    for x in list(train)[:300] + list(test):
        parts = x["messages"][1]["content"]
        assert 2 <= len(calculations(x)) <= 3
        for k, part in enumerate(parts):
            if part["type"] == "python":  # every call is answered right away with what Python computes
                assert parts[k + 1]["type"] == "python_output"
                assert str(eval(part["text"])) == parts[k + 1]["text"]
            if part["type"] == "python_output":
                assert parts[k - 1]["type"] == "python"
                assert parts[k + 1]["text"].startswith(("$" + part["text"], part["text"]))  # the text repeats it
        assert parts[-1]["text"].endswith(f"#### {x['answer']}") and x["answer"] >= 0
        assert int(parts[-2]["text"]) == x["answer"]  # the last calculation is the answer
    ex = train[0]
    assert train.evaluate(ex, f"so the answer is\n#### {ex['answer']}") is True
    assert extract_answer("it costs $1,234.\n#### $1,234") == "1234"
    assert train.evaluate(ex, "no final answer line") is False
    with pytest.raises(UserError):
        Arithmetic("dev")


def test_pydocs_split_and_mc():
    train_names = {r["name"] for r in entries("train")}
    test_names = {r["name"] for r in entries("test")}
    assert not train_names & test_names
    assert len(PydocsChat("train")) + len(PydocsChat("test")) == len(pydocs_entries())
    mc = PydocsMC("test", step=5)
    answers = []
    for x in mc:
        choices = re.findall(r"^- (.*) \(([A-D])\)$", x["messages"][0]["content"], re.MULTILINE)
        assert [letter for _, letter in choices] == ["A", "B", "C", "D"] == x["letters"]
        names = [n for n, _ in choices]
        assert len(set(names)) == 4 and set(names) <= test_names  # distractors from the same split
        answer = x["messages"][1]["content"]
        assert names["ABCD".index(answer)] == x["name"]
        answers.append(answer)
        short = x["name"].rsplit(".", 1)[-1]
        question = x["messages"][0]["content"].split("\n- ")[0]
        assert not re.search(rf"(?<!\w){re.escape(short)}(?!\w)", question)  # the name is masked
    assert set(answers) == {"A", "B", "C", "D"}
    record = {"name": "json.dumps", "kind": "function", "module": "json", "signature": "(obj, *, indent=None)",
              "docstring": "Serialize obj. json.dumps is like dumps with a string.\n\nMore details here."}
    assert masked_documentation(record) == ("____(obj, *, indent=None)\n\nSerialize obj. ____ is like ____ with a "
                                            "string.\n\nMore details here.")
    long_paragraph = "First sentence here. " + "word " * 200
    assert trim_doc(long_paragraph, 50) == "First sentence here."
    assert trim_doc("word " * 30, 22) == "word word word word ..."
    assert trim_doc("One.\n\nTwo two.\n\n" + "x" * 50, 20) == "One.\n\nTwo two."
    # PydocsChat.evaluate looks for the first sentence, after a title paragraph
    assert summary("ast\n~~~\n\nThe ast module helps.  It does more.", "ast") == "The ast module helps."
    assert summary("curses\n\nThe main package for curses.", "curses") == "The main package for curses."
    assert summary("Return the\n   sum. Then more.", "builtins.sum") == "Return the sum."
    assert summary("days", "datetime.timedelta.days") == "days"  # a docstring that is only a title stays


def test_identity_jsonl_roundtrip(tmp_path):
    conversations = identity_conversations(60, seed=3)
    assert len(conversations) == 60 and len({json.dumps(c) for c in conversations}) == 60
    assert conversations == identity_conversations(60, seed=3)
    assert conversations != identity_conversations(60, seed=4)
    text = " ".join(m["content"] for c in conversations for m in c if m["role"] == "assistant")
    assert "the nanochat project, an open-source harness that trains a small ChatGPT-like model from scratch" in text
    path = tmp_path / "sub" / "identity.jsonl"
    assert write_identity_jsonl(str(path), n=60, seed=3) == str(path)
    assert os.listdir(path.parent) == ["identity.jsonl"]  # the temporary file was renamed away
    task = CustomJSON(str(path))
    assert [task[i]["messages"] for i in range(len(task))] == conversations
    train = Identity("train", size=300)
    test = Identity("test", size=40)
    assert not {dump(x["messages"]) for x in train} & {dump(x["messages"]) for x in test}
    assert {x["intent"] for x in train} >= {"who", "maker", "internet", "limits", "chatgpt", "greeting"}


def messages_key(conversation):
    """A conversation's messages as one comparable string."""
    return json.dumps(conversation["messages"], sort_keys=True)


def test_offline_mixtures():
    """
    The offline mixtures of tasks/registry.py as the stages read them: midtraining's sizes, every multiple-choice
    test question, six tasks, deterministic; a part no stage has is a UserError.
    """
    train = stage_mixture("mid", "offline", "train")
    test = dict(build_tasks("offline/test"))
    assert 2000 <= len(train) <= 8000 and 1000 <= sum(map(len, test.values())) <= 1500
    assert len(test["PydocsMC"]) == len(PydocsMC("test"))  # every multiple-choice test question
    assert len(train) == sum(len(t) for t in train.tasks)
    again = stage_mixture("mid", "offline", "train")
    assert [dump(train[i]) for i in range(0, len(train), 37)] == [dump(again[i]) for i in range(0, len(train), 37)]
    assert set(test) == {"SpellingBee", "SimpleSpelling", "Arithmetic", "PydocsChat", "PydocsMC", "Identity"}
    with pytest.raises(UserError, match="unknown mixture 'mid/offline/metrics'"):
        stage_mixture("mid", "offline", "metrics")


def test_offline_rl_mixture():
    """
    RL's offline problems: the checkable tasks a small model solves at times; train problems that midtraining, SFT
    and the test split do not hold (a few generated ones repeat); each scored by its own task, which accepts the
    reference answer and rejects another.
    """
    train = stage_mixture("rl", "offline", "train")
    test = stage_mixture("rl", "offline", "val")
    rl_tasks = {"SpellingBee", "Arithmetic", "Identity"}
    assert {type(t).__name__ for t in train.tasks} == {type(t).__name__ for t in test.tasks} == rl_tasks
    offline_test = [task for _, task in build_tasks("offline/test")]
    assert ([(type(t).__name__, len(t)) for t in test.tasks]
            == [(type(t).__name__, len(t)) for t in offline_test if type(t).__name__ in rl_tasks])
    earlier = {messages_key(task[i]) for stage in ("mid", "sft") for _, task in stage_tasks(stage, "offline", "train")
               for i in range(len(task))}
    tested = {messages_key(task[i]) for task in offline_test for i in range(len(task))}
    drawn = [messages_key(train[i]) for i in range(len(train))]
    assert sum(d in earlier for d in drawn) <= 0.1 * len(drawn) and not set(drawn) & tested
    for mixture in (train, test):
        for i in range(0, len(mixture), 17):
            conversation = mixture[i]
            task = mixture.task_of(i)
            reference = assistant_text(conversation["messages"][-1])
            assert task.reward(conversation, reference) == 1.0, (type(task).__name__, reference)
            assert task.reward(conversation, "I do not know.") == 0.0
    with pytest.raises(UserError, match="unknown mixture 'rl/offline/metrics'"):
        stage_mixture("rl", "offline", "metrics")


def test_sft_reads_other_training_examples():
    """
    chat_sft's offline mixture: the same tasks and sizes as midtraining's, mostly other examples (the generators'
    template space is finite, so a few repeat), none of the test split's; both validate on the same test examples.
    """
    mid = [task for _, task in stage_tasks("mid", "offline", "train")]
    sft = [task for _, task in stage_tasks("sft", "offline", "train")]
    test = [task for _, task in build_tasks("offline/test")]
    assert [(type(t).__name__, len(t)) for t in sft] == [(type(t).__name__, len(t)) for t in mid]
    for a, b, t in zip(mid, sft, test):
        seen, drawn, tested = ({messages_key(task[i]) for i in range(len(task))} for task in (a, b, t))
        assert len(seen & drawn) <= 0.1 * len(drawn), type(a).__name__
        assert not drawn & tested, type(a).__name__
    mid_val = stage_mixture("mid", "offline", "val")
    sft_val = stage_mixture("sft", "offline", "val")
    assert [dump(sft_val[i]) for i in range(len(sft_val))] == [dump(mid_val[i]) for i in range(len(mid_val))]


def test_generation_is_the_same_in_another_process():
    """String seeds, not hash(): a fresh interpreter with another PYTHONHASHSEED generates the same examples."""
    code = ("import json; from tasks.arithmetic import Arithmetic; from tasks.identity import Identity; "
            "print(json.dumps([Arithmetic('test', size=5)[4], Identity('train', size=5)[4]], sort_keys=True))")
    out = run_script("-c", code, timeout=60, env={"PYTHONHASHSEED": "123"})
    assert out.returncode == 0, out.stderr
    here = [Arithmetic("test", size=5)[4], Identity("train", size=5)[4]]
    assert out.stdout.strip() == json.dumps(here, sort_keys=True)

