"""
Tests of chat evaluation: scripts/chat_eval.py (categorical scoring, pass@k, ChatCORE, progress, torchrun
sharding, the report section), tasks/humaneval.py, the multiple-choice prompt format at the token level, and
the report card of nanochat/report.py.

Scoring is checked on rigged models whose answers are known by hand: a module whose logits count the tokens
it has read, and a GPT whose weights make it a bigram table. The script runs end to end on a tiny midtrained
checkpoint (the session's tiny midtrained model), offline and with the real tasks served from local fixtures.
"""

import json
import os
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

from helpers import run_script
from nanochat.engine import Engine
from nanochat.gpt import GPT, GPTConfig
from nanochat.output import UserError
from nanochat.scoring import Progress, score_categorical, score_generative
from nanochat.tokenizer import Tokenizer
from scripts.chat_eval import expand_short_flags, load_tasks, mean_centered, scores
from tasks.common import Task, render_mc
from tasks.humaneval import HumanEval, build_program, extract_code
from tasks.registry import chatcore_baselines, report_card_labels


@pytest.fixture(scope="module")
def tok(small_tokenizer_dir):
    return Tokenizer.from_directory(str(small_tokenizer_dir))


class FakeTask(Task):
    """Rows (user text, letters or None, reference answer): categorical when letters are given, else generative."""

    def __init__(self, rows, eval_type):
        self.rows = rows
        self.eval_type = eval_type
        super().__init__()

    def num_examples(self):
        return len(self.rows)

    def get_example(self, index):
        user, letters, answer = self.rows[index]
        conversation = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
        if letters is not None:
            conversation["letters"] = list(letters)
        return conversation

    def evaluate(self, conversation, assistant_response):
        return assistant_response.strip() == conversation["messages"][-1]["content"]


# -----------------------------------------------------------------------------
# The multiple-choice format: the letter in the prompt is the token of the bare answer

def test_mc_prompt_letters_are_the_answer_tokens(tok):
    """
    For every label a task can use (A-Z; ARC also uses 1-9), rendered as the assistant's whole answer, its token
    ids appear in the rendered prompt exactly where that label is written, right after its choice.
    """
    labels = [chr(c) for c in range(ord("A"), ord("Z") + 1)] + [str(d) for d in range(1, 10)]
    # choice texts that end in ways that could stick to what follows: spaces, punctuation, a newline, nothing
    texts = ["Paris", "the Sun ", "f(x", "it's", "42", "...", "été", "", "two\nlines", "end.", "(", "Oslo,"]
    choices = [texts[i % len(texts)] for i in range(len(labels))]
    question = "Which of these is right?"
    for start in range(0, len(labels), 5):  # questions of 5 labels, as tasks have a few choices each
        letters = labels[start:start + 5]
        shown = choices[start:start + 5]
        for answer in letters:
            conversation = {"messages": [{"role": "user", "content": render_mc(question, letters, shown)},
                                         {"role": "assistant", "content": answer}]}
            ids, mask = tok.render_conversation(conversation)
            answer_ids = [t for t, m in zip(ids, mask) if m][:-1]  # the trained tokens, without <|assistant_end|>
            prompt = ids[:mask.index(1)]
            where = shown[letters.index(answer)] + " ("
            found = [j for j in range(len(prompt)) if prompt[j:j + len(answer_ids)] == answer_ids
                     and tok.decode(prompt[:j]).endswith(where)
                     and tok.decode(prompt[j + len(answer_ids):]).startswith(")")]
            assert len(found) == 1, (answer, where, [tok.decode([t]) for t in prompt])


# -----------------------------------------------------------------------------
# HumanEval

def test_humaneval_loads_the_published_file_and_runs_the_tests(hub):
    task = HumanEval()
    served = "/datasets/openai/openai_humaneval/resolve/main/openai_humaneval/test-00000-of-00001.parquet"
    assert len(task) == 3 and hub.requests == {served: 1}
    HumanEval()  # downloaded once
    assert sum(hub.requests.values()) == 1
    first = task[0]
    helper = task[1]
    assert first["entry_point"] == "add_digits" and first["messages"][0]["content"] == first["prompt"]
    assert first["messages"][0]["content"].startswith("def add_digits(n: int) -> int:")
    # every canonical solution, as the reference assistant answer (the whole function), passes
    for i in range(len(task)):
        conversation = task[i]
        assert task.evaluate(conversation, conversation["messages"][-1]["content"]), conversation["task_id"]
    body = "    return sum(int(d) for d in str(n))\n"
    assert task.evaluate(first, body)  # the body alone continues the prompt
    fenced = "Here it is:\n```python\ndef add_digits(n):\n    return sum(map(int, str(n)))\n```\nDone."
    assert task.evaluate(first, fenced)
    assert task.evaluate(first, "```\n" + body + "```")  # a fenced body
    assert not task.evaluate(first, "    return n % 10\n")  # wrong: 123 -> 3
    assert not task.evaluate(first, "def add_digits(n):\n    return 6\n")  # passes one assert, not the others
    assert not task.evaluate(first, "I do not know.")  # not code
    # the prompt's helper and import stay available when the response rewrites the whole function
    assert task.evaluate(helper, "def count_even(numbers):\n    return len([x for x in numbers if is_even(x)])\n")
    assert not task.evaluate(helper, "def count_even(numbers):\n    return len(numbers)\n")


def test_humaneval_program_building():
    assert extract_code("```python\nx = 1\n```\ntext") == "x = 1\n"
    assert extract_code("no fence") == "no fence"
    assert extract_code("```py\nunclosed") == "unclosed"
    prompt = 'def f(x):\n    """doc"""\n'
    assert build_program(prompt, "    return x\n", "def check(c):\n    assert c(1) == 1", "f") == \
        'def f(x):\n    """doc"""\n    return x\n\n\ndef check(c):\n    assert c(1) == 1\n\n\ncheck(f)\n'
    whole = build_program(prompt, "def f(x):\n    return x\n", "def check(c):\n    pass", "f")
    assert whole.startswith('def f(x):\n    """doc"""\n\n\ndef f(x):\n    return x\n')  # redefines the stub
    assert "def f(x):" in build_program(prompt, "def fx(x):\n    return x\n", "", "f")  # not the signature: a body


# -----------------------------------------------------------------------------
# Categorical scoring

class TokenCounter(torch.nn.Module):
    """
    logits[b, t, v] = how many times token v occurs in ids[b, :t+1]: causal, and a letter's logit at the last
    position is how often the prompt wrote it.
    """

    def __init__(self, vocab_size):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, ids):
        return F.one_hot(ids, self.vocab_size).float().cumsum(dim=1)

    def last_logits(self, ids, last):
        return self(ids)[torch.arange(ids.size(0)), last]


def test_categorical_picks_the_most_likely_allowed_letter(tok):
    # lines hold one letter each, so each is its own token (as in the prompts of render_mc)
    task = FakeTask([
        ("A\nB\nB", "ABCD", "B"),  # B twice: chosen, right
        ("C\nC\nC\nA", "ABC", "A"),  # C three times: chosen, wrong
        ("x\nx\nx\nx\nx\nx\nB", "AB", "B"),  # "x" has the largest logit but is not a letter of the question
        ("3\n3\n2", "123", "3"),  # digit labels, as in some ARC questions
        ("D\nD\nE\nE\nE", "ABCD", "D"),  # E is the most frequent, but not a choice here
    ], "categorical")
    model = TokenCounter(tok.get_vocab_size())
    for batch_size in (1, 2, 8):
        outcomes = score_categorical(model, tok, task, list(range(5)), batch_size, torch.device("cpu"))
        assert outcomes == [(True, "B"), (False, "C"), (True, "B"), (True, "3"), (True, "D")], batch_size
    assert score_categorical(model, tok, task, [1, 3], 2, torch.device("cpu")) == [(False, "C"), (True, "3")]


def random_gpt(tok, seed=0):
    """
    A depth-1 GPT with random weights everywhere (init_weights zeroes the output projections and the head,
    which would make every position predict the same uniform distribution).
    """
    torch.manual_seed(seed)
    config = GPTConfig(sequence_len=64, vocab_size=tok.get_vocab_size(), n_layer=1, n_head=2, n_kv_head=2, n_embd=32)
    model = GPT(config)
    model.init_weights()
    block = model.transformer.h[0]
    with torch.no_grad():
        for w in (block.attn.c_proj.weight, block.mlp.c_proj.weight, model.lm_head.weight):
            w.normal_(0, 0.5)
    return model.eval()


def test_batched_categorical_equals_one_prompt_at_a_time(tok):
    """
    Rows of different lengths padded into one forward give each prompt the answer of its own forward, in the
    order asked (scoring sorts the prompts by length within windows of 16 batches: batch size 1 and 2 make several).
    """
    words = ["cat", "dog", "tree", "house", "blue", "seven", "river", "open", "list", "number", "small", "stone"]
    rows = []
    for i in range(40):
        n = 2 + i % 4
        question = " ".join(words[(i * 5 + k) % len(words)] for k in range(1 + (i * 7) % 9))  # 1 to 9 words
        choices = [words[(i + k) % len(words)] for k in range(n)]
        rows.append((render_mc(question, "ABCDE"[:n], choices), "ABCDE"[:n], "A"))
    task = FakeTask(rows, "categorical")
    model = random_gpt(tok)
    expected = []
    with torch.no_grad():
        for i in range(len(task)):
            conversation = task[i]
            logits = model(torch.tensor([tok.render_for_completion(conversation)]))[0, -1]
            letter_ids = [tok.encode(letter)[0] for letter in conversation["letters"]]
            expected.append(conversation["letters"][int(logits[letter_ids].argmax())])
    assert len({len(tok.render_for_completion(task[i])) for i in range(len(task))}) > 4  # padding really happens
    assert len(set(expected)) > 1  # the answers depend on the prompt
    for batch_size in (1, 2, 5, 40):
        scored = score_categorical(model, tok, task, list(range(len(task))), batch_size, torch.device("cpu"))
        chosen = [c for _, c in scored]
        assert chosen == expected, batch_size


# -----------------------------------------------------------------------------
# Generative scoring: pass@k

def bigram_gpt(tok, first_logits):
    """
    A GPT that is a bigram table: its blocks write nothing into the residual stream (output projections 0), so
    its next-token logits depend only on the current token, through wte (one "state" dimension per token
    group) and lm_head (the logits of each state). After <|assistant_start|> it writes one of the tokens of
    `first_logits` ({token: logit}), after those it ends the turn; it ends the turn after anything else too.
    """
    torch.manual_seed(0)
    config = GPTConfig(sequence_len=64, vocab_size=tok.get_vocab_size(), n_layer=1, n_head=2, n_kv_head=2, n_embd=16)
    model = GPT(config)
    model.init_weights()  # output projections and lm_head are zero
    end = tok.encode_special("<|assistant_end|>")
    with torch.no_grad():
        wte = model.transformer.wte.weight
        head = model.lm_head.weight
        wte.zero_()
        wte[:, 0] = 1.0  # state 0: anything else
        wte[tok.encode_special("<|assistant_start|>")] = F.one_hot(torch.tensor(1), 16).float()  # state 1
        for token in first_logits:
            wte[token] = F.one_hot(torch.tensor(2), 16).float()  # state 2: the answer was written
        scale = 4.0  # the final hidden state of a one-hot embedding is sqrt(n_embd) = 4 at its dimension
        head[end, 0] = head[end, 2] = 10.0 / scale
        for token, logit in first_logits.items():
            head[token, 1] = logit / scale
    return model.eval()


def test_generative_pass_at_k(tok):
    one = tok.encode("1")[0]
    two = tok.encode("2")[0]
    model = bigram_gpt(tok, {one: 10.5, two: 10.0})  # after <|assistant_start|>: "1" a bit more likely than "2"
    engine = Engine(model, tok)
    task = FakeTask([(f"question {i}", None, answer) for i, answer in enumerate("12312")], "generative")
    indices = list(range(len(task)))

    def run(**kwargs):
        settings = dict(num_samples=1, max_new_tokens=8, temperature=0.0, top_k=2, seed=42) | kwargs
        return score_generative(engine, tok, task, indices, **settings)

    greedy = run()  # always "1": the problems whose answer is 1 pass
    assert [p for p, _ in greedy] == [True, False, False, True, False]
    assert all(answers == ["1"] for _, answers in greedy)
    pass16 = run(num_samples=16, temperature=1.0)  # "1" and "2" both sampled: only the "3" problem fails
    assert [p for p, _ in pass16] == [True, True, False, True, True]
    assert all(set(answers) == {"1", "2"} for _, answers in pass16)
    pass1 = run(temperature=1.0)  # one sample: passes exactly when that sample is the answer
    assert all(p == (answers[0] == answer) for (p, answers), answer in zip(pass1, "12312"))
    assert pass1 == run(temperature=1.0)  # problem i is sampled with seed + i: the same samples every time
    # and whatever else is evaluated with it: alone, problem i gets the same samples
    assert pass1 == [score_generative(engine, tok, task, [i], 1, 8, 1.0, 2, 42)[0] for i in indices]
    # a prompt that fills the context cannot be answered: the problem fails without generating
    long_task = FakeTask([("word " * 80, None, "1")], "generative")
    assert score_generative(engine, tok, long_task, [0], 1, 8, 0.0, 2, 42) == [(False, None)]


def test_greedy_batches_equal_one_problem_at_a_time(tok):
    """
    Greedy answers decoded together (chat_eval's batch_size) are the answers of one problem at a time (fp32):
    prompts of different lengths, one that leaves less room than max_new_tokens (decoded alone, with what room
    it has), one that fills the context (fails without generating).
    """
    model = random_gpt(tok, seed=1)
    engine = Engine(model, tok)
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    rows = [(" ".join(words[(i * 3 + k) % len(words)] for k in range(1 + (i * 5) % 7)), None, "x") for i in range(10)]
    rows[8] = ("word " * 80, None, "x")  # fills the context
    def room(text):
        return engine.context_len - len(tok.render_for_completion(FakeTask([(text, None, "x")], "generative")[0]))

    rows[6] = (next(t for t in ("a" * n for n in range(200, 0, -1)) if 3 <= room(t) <= 8), None, "x")  # room < 12
    task = FakeTask(rows, "generative")
    indices = list(range(len(task)))
    rooms = [engine.context_len - len(tok.render_for_completion(task[i])) for i in indices]
    assert rooms[8] < 1 < rooms[6] < 12 < min(r for i, r in enumerate(rooms) if i not in (6, 8))
    alone = score_generative(engine, tok, task, indices, 2, 12, 0.0, 0, 42)  # one problem after another
    assert alone[8] == (False, None) and alone[6][1] is not None
    assert len({answers[0] for _, answers in alone if answers}) > 3  # the answers differ from problem to problem
    for batch_size in (3, 8, 16):
        together = score_generative(engine, tok, task, indices, 2, 12, 0.0, 0, 42, batch_size=batch_size)
        assert together == alone, batch_size


# -----------------------------------------------------------------------------
# ChatCORE, progress, arguments

def test_chatcore_arithmetic():
    accuracy = {"ARC-Easy": 0.5, "ARC-Challenge": 0.25, "MMLU": 0.625, "GSM8K": 0.1, "HumanEval": 0.0,
                "SpellingBee": 0.4}
    results = {name: {"accuracy": a, "chance": 0.0} for name, a in accuracy.items()}
    # centered: (0.5 - 0.25) / 0.75 = 1/3, 0, (0.625 - 0.25) / 0.75 = 1/2, 0.1, 0, 0.4; their mean:
    expected = (1 / 3 + 0 + 0.5 + 0.1 + 0 + 0.4) / 6
    assert scores(results, offline=False) == {"ChatCORE": pytest.approx(expected)}
    assert scores({k: v for k, v in results.items() if k != "MMLU"}, offline=False) == {}  # needs all six
    assert mean_centered({"a": 1.0, "b": 0.25}, {"a": 0.25, "b": 0.25}) == pytest.approx(0.5)
    offline = {"PydocsMC": {"accuracy": 0.5, "chance": 0.25}, "Arithmetic": {"accuracy": 0.2, "chance": 0.0}}
    assert scores(offline, offline=True) == {"Offline ChatCORE": pytest.approx((1 / 3 + 0.2) / 2)}
    assert set(chatcore_baselines()) == {"ARC-Easy", "ARC-Challenge", "MMLU", "GSM8K", "HumanEval", "SpellingBee"}


def test_progress_line(capsys):
    progress = Progress("GSM8K", 1319, every=5)
    progress.start = progress.last = 100.0
    progress.clock = iter([110.0, 120.0]).__next__
    progress.update([True] * 15 + [False] * 105)  # t=110: 120 done in 10 s
    progress.update([False] * 1199)  # t=120: all done, no line (the task's result line follows)
    line = capsys.readouterr().out.strip()
    assert line == "GSM8K 120/1319 (9%) | 12.0 problems/s | ~2m left | acc so far 12.5%"


def test_arguments():
    expanded = expand_short_flags(["-i", "mid", "--max_problems=3", "-a", "ARC-Easy,GSM8K"])
    assert expanded == ["--source=mid", "--max_problems=3", "--task_name=ARC-Easy,GSM8K"]
    with pytest.raises(UserError, match="-a needs a value"):
        expand_short_flags(["-i", "mid", "-a"])
    with pytest.raises(UserError, match=r"unknown task 'Nope': use ARC-Easy, .*, PydocsMC, .*all or offline"):
        load_tasks("ARC-Easy,Nope")
    with pytest.raises(UserError, match="unknown task ' , '"):
        load_tasks(" , ")
    offline = load_tasks("offline")
    assert list(offline) == ["SpellingBee", "SimpleSpelling", "Arithmetic", "PydocsChat", "PydocsMC", "Identity"]
    assert len(offline["SpellingBee"]) == 100 and len(load_tasks("SpellingBee")["SpellingBee"]) == 500


# -----------------------------------------------------------------------------
# The report card

def test_report_card(isolated_env):
    """
    The card's task rows are those chat_eval's sections name, with their labels, in the registry's order. The labels
    travel in the section's state, not in its markdown: no JSON in any section's markdown.
    """
    from nanochat import report
    directory = report.report_dir()
    log = report.Report(directory).log
    labels = dict(report_card_labels())  # what chat_eval gives

    # nothing evaluated: no card, and generate still works
    text = open(report.generate()).read()
    assert "Report card" not in text and "| metric | value |" in text
    log("Base model evaluation", [{"model": "base d1 step 30", "pydocs-CORE metric": 0.1234}])
    log("Chat evaluation mid", [{"GSM8K": 0.05, "ARC-Easy": 0.3, "ChatCORE": 0.0712, "tasks": "all"}, "", "| a |"],
        card_labels=labels)
    log("Chat evaluation sft", [{"ARC-Easy": 0.4, "PydocsMC": 0.5, "Offline ChatCORE": 0.2}], card_labels=labels)
    text = open(report.generate()).read()
    card = text[text.index("### Report card"):].split("\n\n")[1]
    assert card.splitlines() == [
        "| metric | base | mid | sft | rl |",
        "| --- | --- | --- | --- | --- |",
        "| pydocs-CORE | 0.1234 | - | - | - |",
        "| ARC-E | - | 0.3000 | 0.4000 | - |",
        "| GSM8K | - | 0.0500 | - | - |",
        "| ChatCORE | - | 0.0712 | - | - |",
        "| Offline ChatCORE | - | - | 0.2000 | - |",
    ]
    assert text.index("## Summary") < text.index("### Report card") < text.index("## Base model evaluation")
    sections = {name: open(os.path.join(directory, name)).read() for name in os.listdir(directory)
                if name.endswith(".md") and name != "report.md"}
    assert len(sections) == 3 and not any(re.search("[{}]", md) for md in sections.values()), sections
    assert "- GSM8K: 0.0500\n- ARC-Easy: 0.3000\n" in text and "- tasks: all\n\n| a |\n" in text
    log("Base model evaluation", [{"CORE metric": 0.22}])
    assert "| CORE | 0.2200 | - | - | - |" in open(report.generate()).read()


# -----------------------------------------------------------------------------
# The script end to end, on a tiny midtrained model

@pytest.fixture
def mid_model(tiny_model):
    """This test's copy of the session's tiny midtrained model (depth 1, context 64)."""
    return tiny_model("mid")


def chat_eval(*args, nproc=1, timeout=300):
    return run_script("-m", "scripts.chat_eval", *args, nproc=nproc, timeout=timeout)


def task_lines(out):
    """{task: "12.50% (1/8)"} from the script's result lines."""
    return dict(re.findall(r"^(\w[\w-]*): ([\d.]+% \(\d+/\d+\)) in ", out, re.MULTILINE))


def card_rows(base_dir):
    """The labels of the report card's rows that the mid model's chat evaluation section fills (nanochat.report)."""
    from nanochat.report import report_card
    state = json.loads((base_dir / "report" / "chat-evaluation-mid.json").read_text())
    card = report_card({"chat-evaluation-mid": state})
    return [row.split(" | ")[0].removeprefix("| ") for row in card[2:]]


@pytest.mark.slow
def test_offline_end_to_end_and_two_ranks_score_the_same(mid_model):
    args = ["-i", "mid", "-a", "offline", "--max_problems=5", "--max_new_tokens=24", "--batch_size=2"]
    result = chat_eval(*args, "--progress_every=0")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    lines = task_lines(out)
    assert list(lines) == ["SpellingBee", "SimpleSpelling", "Arithmetic", "PydocsChat", "PydocsMC", "Identity"]
    assert all(line.endswith("/5)") for line in lines.values()), lines
    progress = r"^PydocsMC 2/5 \(40%\) \| [\d.]+ problems/s \| ~\d+s left \| acc so far [\d.]+%$"
    assert re.search(progress, out, re.MULTILINE), out
    assert re.search(r"^Offline ChatCORE: -?[\d.]+$", out, re.MULTILINE)
    assert not re.search(r"^ChatCORE", out, re.MULTILINE)
    section = (mid_model / "report" / "chat-evaluation-mid.md").read_text()
    assert section.startswith("## Chat evaluation mid\n")
    for name in lines:
        assert re.search(rf"^- {name}: [\d.]+$", section, re.MULTILINE), section
    assert re.search(r"^- Offline ChatCORE: -?[\d.]+$", section, re.MULTILINE) and "- ChatCORE:" not in section
    assert "| PydocsMC | categorical | 5 |" in section and "| 0.2500 |" in section  # 4 choices: chance is 1/4
    assert card_rows(mid_model) == ["SpellingBee", "Offline ChatCORE"]  # the offline task on the card, and the score
    assert "{" not in section  # the card's labels travel in the section's state, not in its markdown

    two = chat_eval(*args, nproc=2)
    assert two.returncode == 0, two.stderr
    assert task_lines(two.stdout) == lines  # rank r took problems r, r + 2, ...: the counts add up to one process's
    score = lambda text: re.search(r"^Offline ChatCORE: (.*)$", text, re.MULTILINE).group(1)
    assert score(two.stdout) == score(out)
    assert "(2 rank(s)" in two.stdout


@pytest.mark.slow
def test_chatcore_tasks_from_the_hub(mid_model, hub):
    result = chat_eval("-i", "mid", "--max_problems=2", "--max_new_tokens=16")  # -a all is the default
    assert result.returncode == 0, result.stderr
    lines = task_lines(result.stdout)
    assert list(lines) == list(chatcore_baselines())
    assert lines["ARC-Challenge"].endswith("/1)") and lines["HumanEval"].endswith("/2)")  # the fixtures have 1 and 3
    assert re.search(r"^ChatCORE: -?[\d.]+$", result.stdout, re.MULTILINE)
    section = (mid_model / "report" / "chat-evaluation-mid.md").read_text()
    assert re.search(r"^- ChatCORE: -?[\d.]+$", section, re.MULTILINE) and "Offline ChatCORE" not in section
    assert "| MMLU | categorical | 2 |" in section and "| HumanEval | generative | 2 |" in section
    assert card_rows(mid_model) == ["ARC-E", "ARC-C", "MMLU", "GSM8K", "HumanEval", "SpellingBee", "ChatCORE"]


def test_missing_model_or_data_is_one_line_naming_the_command(isolated_env, small_tokenizer_dir, hub, tmp_path):
    shutil.copytree(small_tokenizer_dir, isolated_env / "tokenizer")
    result = chat_eval("-i", "sft", "-a", "ARC-Easy")
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().count("\n") == 0 and result.stderr.startswith("error: ")
    assert "run `python -m scripts.chat_sft` first" in result.stderr
    shutil.rmtree(os.path.join(hub.root, "datasets", "openai", "gsm8k"))  # a hub without the file
    result = chat_eval("-i", "mid", "-a", "GSM8K")
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "could not download" in result.stderr and "openai/gsm8k" in result.stderr


def test_bad_source_and_help(capsys, monkeypatch):
    import scripts.chat_eval
    from scripts.chat_eval import main
    # main() sets the module's config: undo it after
    monkeypatch.setattr(scripts.chat_eval, "source", scripts.chat_eval.source)
    with pytest.raises(UserError, match="--source must be one of mid, sft, rl, got 'base'"):
        main(["-i", "base"])
    with pytest.raises(SystemExit) as exit_info:
        main(["-i", "mid", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "--task_name" in out and "-i picks the model" in out
