"""
SpellingBee and SimpleSpelling: synthetic letter tasks (count letters, spell a word), generated offline.

No download. A model sees text as tokens, not letters, so "how many r's are in strawberry?" is hard for it; these
tasks teach it to spell a word out and to count letters with the python tool.

    SpellingBee
      user:       How many times does the letter 'r' appear in 'strawberry'?
      assistant:  text "Spelled out, 'strawberry' is s-t-r-a-w-b-e-r-r-y. Let me count the 'r's with Python."
                  python "'strawberry'.count('r')"   python_output "3"
                  text "The letter 'r' appears 3 times in 'strawberry'.\\n\\n#### 3"
    SimpleSpelling
      user:       How do you spell strawberry?
      assistant:  "strawberry is spelled s-t-r-a-w-b-e-r-r-y"

The words come from the embedded documentation corpus (nanochat.pydocs.pydocs_entries(), docstrings):
lowercase words of 3-12 letters, written as whole words (runs of [A-Za-z0-9_] that are all lowercase
letters), that appear in at least 3 different docstrings. Two filters keep English words and drop code:
- a word that is also a code identifier (it appears in an entry's name or signature: `isatty`,
  `skipkeys`) is kept only if at least 10 docstrings use it, which keeps English words that are also
  names (`file`, `count`) and drops rare identifiers;
- a word used as code in more than half of its occurrences is dropped. An occurrence counts as code right
  after "." or a backtick, or right before "(", "=", "[", a backtick or ".x" (`getnframes()`, `sys.argv`,
  `os.environ`), or before "'t" (the "didn" of "didn't" is half a contraction, not a word).
Sorted and unique, so the list depends only on the Python installation (3,252 words for CPython 3.11).

Split by word: word i of the sorted list is a test word when i % 10 == 0, a training word otherwise, so the
test words are never seen in training. Example `index` of a split is generated from
random.Random(f"{name}-{seed}-{split}-{index}"): deterministic, and any index can be produced on its own.
Both tasks are generative; evaluate() checks the final `#### N` number / the spelling.
"""

import collections
import functools
import random
import re

from nanochat.output import UserError
from tasks.common import Task, assistant_text, extract_answer, check_choice

SPLITS = ("train", "test")
TEST_EVERY = 10  # word i of the sorted word list is a test word when i % TEST_EVERY == 0
MIN_DOCS = 3  # a word must appear in this many docstrings...
MIN_DOCS_IF_IDENTIFIER = 10  # ...and in this many if it is also a code identifier
MAX_CODE_FRACTION = 0.5  # a word used as code in more than this fraction of its occurrences is dropped
DEFAULT_SIZE = {"train": 20000, "test": 500}  # examples per split (generated: any number is possible)
LETTERS = "abcdefghijklmnopqrstuvwxyz"

SPELLING_RE = re.compile(r"\b[a-z](?:-[a-z])+\b")  # "s-t-r-a-w": one letter, then "-letter" repeated


def spell(word):
    """"straw" -> "s-t-r-a-w"."""
    return "-".join(word)


def _code_use(text, start, end):
    """Whether the word text[start:end] is used as code there (see the module docstring), not as prose."""
    before = text[start - 1] if start > 0 else " "
    after = text[end:end + 2]
    return (before in ".`" or after[:1] in ("(", "=", "[", "`") or after == "'t"
            or (after[:1] == "." and after[1:].isalnum()))


@functools.lru_cache(maxsize=1)
def _all_words():
    from nanochat.pydocs import pydocs_entries
    docs_per_word = collections.Counter()  # in how many docstrings a word appears
    uses = collections.Counter()  # all its occurrences
    code_uses = collections.Counter()  # those as code
    identifiers = set()
    for record in pydocs_entries():
        text = record["docstring"]
        in_doc = set()
        for m in re.finditer(r"[A-Za-z0-9_]+", text):
            w = m.group()
            if 3 <= len(w) <= 12 and w.isascii() and w.isalpha() and w.islower():
                in_doc.add(w)
                uses[w] += 1
                code_uses[w] += _code_use(text, m.start(), m.end())
        docs_per_word.update(in_doc)
        if record["kind"] != "topic":  # a topic's name is a help() key, not an identifier
            identifiers.update(re.findall(r"[A-Za-z0-9_]+", record["name"] + " " + record["signature"]))
    return tuple(sorted(w for w, n in docs_per_word.items()
                        if n >= (MIN_DOCS_IF_IDENTIFIER if w in identifiers else MIN_DOCS)
                        and code_uses[w] <= MAX_CODE_FRACTION * uses[w]))


def words(split):
    """The words of `split` ("train" or "test"), sorted; disjoint between the splits (see the module docstring)."""
    _check_split(split)
    return [w for i, w in enumerate(_all_words()) if (i % TEST_EVERY == 0) == (split == "test")]


def _check_split(split):
    check_choice("split", split, SPLITS)


class _WordTask(Task):
    """What both tasks share: a split's word list, a size, a seed, one random.Random per example."""

    name = "words"

    def __init__(self, split="train", size=None, seed=0, **kwargs):
        _check_split(split)
        size = DEFAULT_SIZE[split] if size is None else size
        if size < 0:
            raise UserError(f"{type(self).__name__}: size must be >= 0, got {size}")
        self.split = split
        self.size = size
        self.seed = seed
        self.words = words(split)
        super().__init__(**kwargs)

    def num_examples(self):
        return self.size

    def _rng(self, index):
        return random.Random(f"{self.name}-{self.seed}-{self.split}-{index}")


# How the user asks. {letter} is lowercase, {LETTER} uppercase; the code always uses lowercase.
COUNT_QUESTIONS = [
    "How many {letter} are in the word {word}?",
    "How many times does the letter '{letter}' appear in '{word}'?",
    "How many {letter}'s are there in {word}?",
    "Count the letter {letter} in the word \"{word}\".",
    "In the word {word}, how many times does {letter} occur?",
    "how many {letter} in {word}",
    "What is the number of '{letter}' characters in \"{word}\"?",
    "Can you count how many {letter}s the word {word} has?",
    "How often does the letter {LETTER} appear in {word}?",
    "How many {LETTER}'s in {word}?",
]
COUNT_INTROS = [
    "Spelled out, '{word}' is {spelled}. Let me count the '{letter}'s with Python.",
    "Let me spell '{word}' first: {spelled}. Now I count the letter '{letter}' with Python to be sure.",
    "The word '{word}' is spelled {spelled}. I'll count the '{letter}'s with Python.",
]


class SpellingBee(_WordTask):
    """
    SpellingBee(split="train"|"test", size=None, seed=0, start=0, stop=None, step=1): count a letter in a
    word. `size` examples (default 20,000 train / 500 test). Synthetic (see the module docstring).
    The conversation carries "word", "letter" and "answer" (the count) as extra keys.
    """

    name = "spellingbee"
    eval_type = "generative"

    def get_example(self, index):
        rng = self._rng(index)
        word = rng.choice(self.words)
        # Mostly a letter of the word (weighted by how often it occurs), sometimes any letter (count may be 0)
        letter = rng.choice(word) if rng.random() < 0.7 else rng.choice(LETTERS)
        count = word.count(letter)
        fields = dict(word=word, letter=letter, LETTER=letter.upper(), spelled=spell(word))
        question = rng.choice(COUNT_QUESTIONS).format(**fields)
        times = "time" if count == 1 else "times"
        return {
            "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": [
                    {"type": "text", "text": rng.choice(COUNT_INTROS).format(**fields) + "\n\n"},
                    {"type": "python", "text": f"'{word}'.count('{letter}')"},
                    {"type": "python_output", "text": str(count)},
                    {"type": "text",
                     "text": f"\n\nThe letter '{letter}' appears {count} {times} in '{word}'.\n\n#### {count}"},
                ]},
            ],
            "word": word, "letter": letter, "answer": count,
        }

    def evaluate(self, conversation, assistant_response):
        """True when the response's `#### N` is the reference count."""
        reference = extract_answer(assistant_text(conversation["messages"][-1]))
        return extract_answer(assistant_response) == reference


SPELL_QUESTIONS = [
    "Spell the word: {word}",
    "How do you spell {word}?",
    "Spell '{word}' letter by letter.",
    "Can you spell \"{word}\" for me?",
    "What are the letters of {word}, in order?",
    "spell {word}",
]
SPELL_ANSWERS = [
    "{word} is spelled {spelled}",
    "{spelled}",
    "Letter by letter, {word} is {spelled}",
]


class SimpleSpelling(_WordTask):
    """
    SimpleSpelling(split="train"|"test", size=None, seed=0, start=0, stop=None, step=1): spell a word letter
    by letter ("s-t-r-a-w"). `size` examples (default 20,000 train / 500 test). Synthetic (see the module
    docstring). The conversation carries "word" as an extra key.
    """

    name = "simplespelling"
    eval_type = "generative"

    def get_example(self, index):
        rng = self._rng(index)
        word = rng.choice(self.words)
        fields = dict(word=word, spelled=spell(word))
        return {
            "messages": [
                {"role": "user", "content": rng.choice(SPELL_QUESTIONS).format(**fields)},
                {"role": "assistant", "content": rng.choice(SPELL_ANSWERS).format(**fields)},
            ],
            "word": word,
        }

    def evaluate(self, conversation, assistant_response):
        """True when the last "x-y-z" spelling in the response is the reference's."""
        reference = SPELLING_RE.findall(assistant_text(conversation["messages"][-1]))[-1]
        found = SPELLING_RE.findall(assistant_response)
        return bool(found) and found[-1] == reference
