"""
PydocsChat and PydocsMC: synthetic chat tasks built offline from the documentation of the running Python.

No download: the records are nanochat.pydocs.pydocs_entries(), what the pydocs pretraining corpus is made of. A
model pretrained on pydocs has read these docstrings; these tasks teach it to answer questions about them.

    PydocsChat  user:      What does json.dumps do?
                assistant: `json.dumps(obj, *, skipkeys=False, ...)` is a function of the `json` module.
                           <the docstring, trimmed: whole paragraphs up to ~600 characters>
    PydocsMC    user:      render_mc("Which of these names does this documentation describe?\\n\\n<the
                           documentation, the name masked as ____>", A-D, 4 names of the same kind)
                assistant: the letter, e.g. "C"

Split by entry: entry i of pydocs_entries() is a test entry when i % 10 == 0, a training entry otherwise, so
test documentation is never answered in training. PydocsChat has one example per entry of its split (all
kinds: module, class, function, method, topic); PydocsMC one per entry except topics (their names are help()
keys, not Python names). Slice with start/stop/step (step=7 gives every 7th entry, across all modules). The
question phrasing (PydocsChat) and the distractors and answer position (PydocsMC) are drawn from
random.Random(f"{name}-{seed}-{split}-{index}"): deterministic. Distractors are names of the same kind from
the same split with a different last component ("popitem" never competes with another "popitem", whose
masked documentation would fit as well). The entries, and so the examples, depend only on the Python
installation (7,987 entries for CPython 3.11: 7,188 train, 799 test).
"""

import functools
import random
import re

from tasks.common import Task, render_mc, check_choice

SPLITS = ("train", "test")
TEST_EVERY = 10  # entry i of pydocs_entries() is a test entry when i % TEST_EVERY == 0
ANSWER_CHARS = 600  # PydocsChat: the docstring is trimmed to whole paragraphs within this many characters
MC_DOC_CHARS = 400  # PydocsMC: the documentation shown in the question is trimmed to this
SIGNATURE_CHARS = 150  # longer signatures are cut after a parameter: "(a, b, ...)"
SUMMARY_CHARS = 120  # evaluate(): the response must contain the docstring's first sentence, up to this
MC_LETTERS = ("A", "B", "C", "D")
MASK = "____"


@functools.lru_cache(maxsize=2)
def entries(split):
    """The pydocs records of `split` (a tuple; do not modify the dicts). Slow only the first time in a process."""
    check_choice("split", split, SPLITS)
    from nanochat.pydocs import pydocs_entries
    return tuple(r for i, r in enumerate(pydocs_entries()) if (i % TEST_EVERY == 0) == (split == "test"))


def trim_signature(signature, limit=SIGNATURE_CHARS):
    """A signature of at most ~limit characters: cut after the last whole parameter that fits, then ", ...)"."""
    if len(signature) <= limit:
        return signature
    cut = signature.rfind(", ", 0, limit)
    return (signature[:cut] if cut > 0 else signature[:limit]) + ", ...)"


def trim_doc(text, limit):
    """
    The first paragraphs of `text` that fit in `limit` characters (paragraphs are separated by blank lines).
    If the first paragraph alone is longer, it is cut after its last sentence that fits ("... end."), or,
    without one, after the last whole word, followed by " ...".
    """
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    if not paragraphs:
        return ""
    out = paragraphs[0]
    if len(out) > limit:
        ends = [m.end() for m in re.finditer(r"[.!?](?=\s)", out[:limit + 1])]
        if ends and ends[-1] >= limit // 3:
            return out[:ends[-1]]
        cut = out.rfind(" ", 0, limit)
        return out[:cut if cut > 0 else limit].rstrip() + " ..."
    for p in paragraphs[1:]:
        if len(out) + 2 + len(p) > limit:
            break
        out += "\n\n" + p
    return out


def _is_title(paragraph, name):
    """A docstring's title paragraph: the entry's name alone ("curses"), or a line underlined ("ast\\n~~~")."""
    lines = paragraph.split("\n")
    return (len(lines) == 1 and paragraph.strip().lower() == name.rsplit(".", 1)[-1].lower()) or \
        (len(lines) == 2 and re.fullmatch(r"[=~\-^*#]{3,}", lines[1].strip()) is not None)


def summary(text, name="", limit=SUMMARY_CHARS):
    """
    The first sentence of a docstring (after a title paragraph, if it has one and more), whitespace
    collapsed, cut to `limit` characters at a word.
    """
    paragraphs = trim_doc(text, 10**9).split("\n\n")
    if len(paragraphs) > 1 and _is_title(paragraphs[0], name):
        paragraphs = paragraphs[1:]
    first = " ".join(paragraphs[0].split())
    match = re.search(r"[.!?](?=\s|$)", first)
    sentence = first[:match.end()] if match else first
    if len(sentence) > limit:
        sentence = sentence[:sentence.rfind(" ", 0, limit)] if " " in sentence[:limit] else sentence[:limit]
    return sentence


def _normalized(text):
    return " ".join(text.split()).lower()


class _PydocsTask(Task):
    """What both tasks share: the split's entries (optionally filtered), a seed, a random.Random per example."""

    name = "pydocs"

    def __init__(self, split="train", seed=0, **kwargs):
        self.split = split
        self.seed = seed
        self.entries = [r for r in entries(split) if self._keep(r)]
        super().__init__(**kwargs)

    def _keep(self, record):
        return True

    def num_examples(self):
        return len(self.entries)

    def _rng(self, index):
        return random.Random(f"{self.name}-{self.seed}-{self.split}-{index}")


QUESTIONS = {
    "function": ["What does {name} do?", "How do I use {name}?", "What is {name} in Python?", "Can you explain {name}?",
                 "What does the documentation say about {name}?", "Tell me about {name}.", "what is {name} for"],
    "class": ["What is the {name} class?", "What is {name} used for?", "Can you explain the class {name}?",
              "Tell me about {name}.", "What does the documentation say about {name}?"],
    "module": ["What is the {name} module for?", "What does the {name} module do?", "Tell me about the {name} module.",
               "What is {name} in the Python standard library?", "why would I import {name}"],
    "topic": ["What does the Python documentation say about {name}?",
              "Explain the '{name}' topic of the Python reference.",
              "Show me help('{name}').", "Can you explain '{name}' in Python?"],
}
QUESTIONS["method"] = QUESTIONS["function"]


def describe(record):
    """The first line of a PydocsChat answer: what the entry is and where it lives."""
    kind = record["kind"]
    name = record["name"]
    module = record["module"]
    signature = trim_signature(record["signature"])
    if kind == "function":
        return f"`{name}{signature}` is a function of the `{module}` module."
    if kind == "method":
        return f"`{name}{signature}` is a method of the class `{name.rsplit('.', 1)[0]}`."
    if kind == "class":
        bases = f", derived from `{signature[1:-1]}`" if signature.startswith("(") and signature != "()" else ""
        return f"`{name}` is a class of the `{module}` module{bases}."
    if kind == "module":
        return f"`{name}` is a module of the Python standard library."
    return f"From the Python language reference, help('{name}'):"


class PydocsChat(_PydocsTask):
    """
    PydocsChat(split="train"|"test", seed=0, start=0, stop=None, step=1): one example per pydocs entry of the
    split (7,188 train / 799 test for CPython 3.11): the user asks about the entry by its qualified name,
    the assistant answers with describe(entry) and the trimmed docstring. Synthetic; generative.
    The conversation carries "name" and "summary" (the docstring's first sentence) as extra keys.
    """

    name = "pydocschat"
    eval_type = "generative"

    def get_example(self, index):
        record = self.entries[index]
        rng = self._rng(index)
        question = rng.choice(QUESTIONS[record["kind"]]).format(name=record["name"])
        answer = describe(record) + "\n\n" + trim_doc(record["docstring"], ANSWER_CHARS)
        return {
            "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
            "name": record["name"], "summary": summary(record["docstring"], record["name"]),
        }

    def evaluate(self, conversation, assistant_response):
        """True when the response contains the docstring's first sentence (case and whitespace ignored)."""
        return _normalized(conversation["summary"]) in _normalized(assistant_response)


def masked_documentation(record, limit=MC_DOC_CHARS):
    """The entry's corpus header and trimmed docstring with its name (qualified and last part) replaced by ____."""
    name = record["name"]
    kind = record["kind"]
    signature = trim_signature(record["signature"])
    if kind == "module":
        header = f"module {MASK}"
    elif kind == "class":
        header = f"class {MASK}{signature}"
    else:
        header = f"{MASK}{signature}"
    text = f"{header}\n\n{trim_doc(record['docstring'], limit)}"
    # The qualified name first (not inside a longer dotted name), then its last part anywhere (`obj.dumps`,
    # and in the signature: `class Random(_random.Random)`)
    text = re.sub(rf"(?<![\w.]){re.escape(name)}(?!\w)", MASK, text)
    return re.sub(rf"(?<!\w){re.escape(name.rsplit('.', 1)[-1])}(?!\w)", MASK, text)


class PydocsMC(_PydocsTask):
    """
    PydocsMC(split="train"|"test", seed=0, start=0, stop=None, step=1): one multiple-choice question per
    non-topic pydocs entry of the split (7,118 train / 791 test for CPython 3.11): which of 4 names of the same
    kind does this (masked) documentation describe? The assistant answers the letter. Synthetic; categorical.
    The conversation carries "letters" (A-D) and "name" as extra keys.
    """

    name = "pydocsmc"
    eval_type = "categorical"

    def __init__(self, split="train", seed=0, **kwargs):
        super().__init__(split=split, seed=seed, **kwargs)
        self.names_by_kind = {}
        for r in self.entries:
            self.names_by_kind.setdefault(r["kind"], []).append(r["name"])

    def _keep(self, record):
        return record["kind"] != "topic"

    def get_example(self, index):
        record = self.entries[index]
        rng = self._rng(index)
        name = record["name"]
        last = name.rsplit(".", 1)[-1]
        candidates = [n for n in self.names_by_kind[record["kind"]] if n.rsplit(".", 1)[-1] != last]
        choices = rng.sample(candidates, len(MC_LETTERS) - 1)
        answer = rng.randrange(len(MC_LETTERS))
        choices.insert(answer, name)
        question = "Which of these names does this documentation describe?\n\n" + masked_documentation(record)
        return {
            "messages": [{"role": "user", "content": render_mc(question, MC_LETTERS, choices)},
                         {"role": "assistant", "content": MC_LETTERS[answer]}],
            "letters": list(MC_LETTERS),  # an evaluator picks the most likely of these
            "name": name,
        }

    def evaluate(self, conversation, assistant_response):
        """True when the response (a letter; surrounding spaces ignored) is the reference letter."""
        return assistant_response.strip() == conversation["messages"][-1]["content"]
