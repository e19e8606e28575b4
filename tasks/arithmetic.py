"""
Arithmetic: synthetic GSM8K-style word problems with calculator calls, generated offline from templates.

No download. A small model can actually learn these, so they measure whether midtraining taught the chat format
and the tool:

    user:      Maya buys 3 notebooks for $4 each and a lamp for $12. How much does Maya spend in total?
    assistant: text "The notebooks cost 3 x $4 = "  python "3*4"  python_output "12"
               text "$12.\\nWith the lamp, Maya spends $12 + $12 = "  python "12+12"  python_output "24"
               text "$24.\\n#### 24"

Every calculation is a calculator call: a python part (the expression; the model writes it, mask 1)
immediately followed by a python_output part (what Python prints for it, str(eval(expression)); the tool
writes it, mask 0), then the text repeats the result, the way GSM8K solutions are written. Divisions are
exact and written `//`, so every output is an integer. The solution ends with the line `#### <answer>`.

Templates (TEMPLATES): shopping (total cost; money left), sharing (equal shares; keep some, share the rest),
rates (work per hour; distance at two speeds; weekly savings; filling a tank), 2-3 calculations each, small
integers.

Split: a problem belongs to the test split when the sha256 of its calculations (the python expressions,
which contain every number of the problem) falls in bucket 0 of 10, else to train. So the two splits never
share a problem, whatever the seeds and sizes. Example `index` of a split is generated from
random.Random(f"arithmetic-{seed}-{split}-{index}-{attempt}"), attempt = 0, 1, ... until the problem
belongs to the split: deterministic, and any index can be produced on its own. Within a split a problem
can repeat (the template space is finite).
"""

import hashlib
import random

from nanochat.output import UserError
from tasks.common import Task, assistant_text, extract_answer, check_choice

SPLITS = ("train", "test")
TEST_BUCKETS = 10  # a problem is a test problem when sha256(its calculations) % TEST_BUCKETS == 0
DEFAULT_SIZE = {"train": 5000, "test": 500}

NAMES = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kira", "Leo",
         "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf", "Zoe"]
ITEMS = [("apple", "apples"), ("notebook", "notebooks"), ("pencil", "pencils"), ("ticket", "tickets"),
         ("candle", "candles"), ("mug", "mugs"), ("plant", "plants"), ("book", "books"), ("sticker", "stickers"),
         ("muffin", "muffins")]
EXTRAS = ["backpack", "lamp", "scarf", "board game", "raincoat", "calculator", "kite", "puzzle"]
MACHINES = [("machine", "bottles"), ("printer", "pages"), ("robot", "boxes"), ("bakery oven", "loaves")]


class Solution:
    """Builds the assistant parts: text, and calculator calls whose output is what Python computes."""

    def __init__(self):
        self.parts = []
        self.calculations = []

    def text(self, text):
        if self.parts and self.parts[-1]["type"] == "text":
            self.parts[-1]["text"] += text
        else:
            self.parts.append({"type": "text", "text": text})

    def calc(self, expression):
        # Our own expressions of integer literals and + - * // only: eval is exactly the tool's answer.
        value = eval(expression, {"__builtins__": {}})
        self.parts.append({"type": "python", "text": expression})
        self.parts.append({"type": "python_output", "text": str(value)})
        self.calculations.append(expression)
        return value


# Each template: (rng, solution) -> (question, answer). It draws its numbers, writes the question, and
# writes the solution into `solution`.

def shopping_total(rng, s):
    name = rng.choice(NAMES)
    _, many = rng.choice(ITEMS)
    extra = rng.choice(EXTRAS)
    a = rng.randint(2, 9)
    p = rng.randint(2, 12)
    q = rng.randint(5, 40)
    question = (f"{name} buys {a} {many} for ${p} each and a {extra} for ${q}. "
                f"How much does {name} spend in total?")
    s.text(f"The {many} cost {a} x ${p} = ")
    x = s.calc(f"{a}*{p}")
    s.text(f"${x}.\nWith the {extra}, {name} spends ${x} + ${q} = ")
    y = s.calc(f"{x}+{q}")
    s.text(f"${y}.\n")
    return question, y


def shopping_change(rng, s):
    name = rng.choice(NAMES)
    (_, many), (_, many2) = rng.sample(ITEMS, 2)
    a = rng.randint(2, 6)
    p = rng.randint(2, 9)
    b = rng.randint(2, 6)
    r = rng.randint(2, 9)
    m = (a * p + b * r) // 10 * 10 + 10 * rng.randint(1, 5)  # a round amount, more than the total
    question = (f"{name} has ${m}. {name} buys {a} {many} at ${p} each and {b} {many2} at ${r} each. "
                f"How much money does {name} have left?")
    s.text(f"The {many} cost {a} x ${p} = ")
    x = s.calc(f"{a}*{p}")
    s.text(f"${x}.\nThe {many2} cost {b} x ${r} = ")
    y = s.calc(f"{b}*{r}")
    s.text(f"${y}.\n{name} has ${m} - ${x} - ${y} = ")
    z = s.calc(f"{m}-{x}-{y}")
    s.text(f"${z} left.\n")
    return question, z


def sharing_equal(rng, s):
    name = rng.choice(NAMES)
    _, many = rng.choice(ITEMS)
    k = rng.randint(2, 6)
    each = rng.randint(2, 12)
    total = k * each
    a = rng.choice([d for d in range(2, total) if total % d == 0])  # total = k * each has a divisor in 2..total-1
    b = total // a
    question = (f"{name} has {a} boxes of {many} with {b} {many} in each box. {name} shares them equally "
                f"among {k} friends. How many {many} does each friend get?")
    s.text(f"{name} has {a} x {b} = ")
    t = s.calc(f"{a}*{b}")
    s.text(f"{t} {many}.\nEach friend gets {t} / {k} = ")
    y = s.calc(f"{t}//{k}")
    s.text(f"{y} {many}.\n")
    return question, y


def sharing_keep(rng, s):
    name = rng.choice(NAMES)
    a = rng.randint(2, 5)
    b = rng.randint(4, 12)
    k = rng.randint(2, 5)
    t = a * b
    each = rng.randint(1, (t - 1) // k)
    c = t - k * each  # kept: at least 1, and the rest divides evenly
    question = (f"{name} bakes {a} trays of {b} cookies. {name} keeps {c} cookies and shares the rest "
                f"equally among {k} neighbors. How many cookies does each neighbor get?")
    s.text(f"{name} bakes {a} x {b} = ")
    t = s.calc(f"{a}*{b}")
    s.text(f"{t} cookies.\nAfter keeping {c}, {t} - {c} = ")
    rest = s.calc(f"{t}-{c}")
    s.text(f"{rest} are left to share.\nEach neighbor gets {rest} / {k} = ")
    y = s.calc(f"{rest}//{k}")
    s.text(f"{y} cookies.\n")
    return question, y


def rate_work(rng, s):
    machine, things = rng.choice(MACHINES)
    r = rng.randint(3, 20)
    h = rng.randint(2, 8)
    g = rng.randint(2, 8)
    question = (f"A {machine} makes {r} {things} per hour. It runs for {h} hours on Monday and {g} hours on "
                f"Tuesday. How many {things} does it make in total?")
    s.text(f"It runs for {h} + {g} = ")
    hours = s.calc(f"{h}+{g}")
    s.text(f"{hours} hours.\nAt {r} {things} per hour, it makes {r} x {hours} = ")
    y = s.calc(f"{r}*{hours}")
    s.text(f"{y} {things}.\n")
    return question, y


def rate_speed(rng, s):
    name = rng.choice(NAMES)
    v = rng.randint(8, 20)
    h = rng.randint(2, 5)
    w = rng.randint(3, 6)
    g = rng.randint(1, 3)
    question = (f"{name} cycles at {v} km per hour for {h} hours, then walks at {w} km per hour for {g} hours. "
                f"How many kilometers does {name} travel in all?")
    s.text(f"Cycling: {v} x {h} = ")
    x = s.calc(f"{v}*{h}")
    s.text(f"{x} km.\nWalking: {w} x {g} = ")
    y = s.calc(f"{w}*{g}")
    s.text(f"{y} km.\nIn all: {x} + {y} = ")
    z = s.calc(f"{x}+{y}")
    s.text(f"{z} km.\n")
    return question, z


def rate_savings(rng, s):
    name = rng.choice(NAMES)
    extra = rng.choice(EXTRAS)
    w = rng.randint(5, 25)
    n = rng.randint(3, 12)
    c = rng.randint(5, w * n - 1)
    question = (f"{name} saves ${w} every week. After {n} weeks, {name} spends ${c} on a {extra}. "
                f"How much money does {name} have now?")
    s.text(f"In {n} weeks {name} saves {n} x ${w} = ")
    x = s.calc(f"{n}*{w}")
    s.text(f"${x}.\nAfter the {extra}: ${x} - ${c} = ")
    y = s.calc(f"{x}-{c}")
    s.text(f"${y}.\n")
    return question, y


def rate_fill(rng, s):
    r = rng.randint(2, 12)
    minutes = rng.randint(3, 15)
    start = rng.randint(5, 60)
    capacity = start + r * minutes
    question = (f"A tank holds {capacity} liters and already has {start} liters in it. A pump adds {r} liters "
                f"per minute. How many minutes does it take to fill the tank?")
    s.text(f"The tank needs {capacity} - {start} = ")
    need = s.calc(f"{capacity}-{start}")
    s.text(f"{need} more liters.\nAt {r} liters per minute, that takes {need} / {r} = ")
    y = s.calc(f"{need}//{r}")
    s.text(f"{y} minutes.\n")
    return question, y


TEMPLATES = [shopping_total, shopping_change, sharing_equal, sharing_keep,
             rate_work, rate_speed, rate_savings, rate_fill]


def problem_split(calculations):
    """"test" or "train": the split a problem with these calculations (python expressions) belongs to."""
    digest = hashlib.sha256("|".join(calculations).encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_BUCKETS == 0 else "train"


class Arithmetic(Task):
    """
    Arithmetic(split="train"|"test", size=None, seed=0, start=0, stop=None, step=1): `size` synthetic word
    problems (default 5,000 train / 500 test) solved with calculator calls, ending in `#### <answer>`.
    Generative. The conversation carries "answer" (int) as an extra key.
    """

    eval_type = "generative"

    def __init__(self, split="train", size=None, seed=0, **kwargs):
        check_choice("Arithmetic split", split, SPLITS)
        size = DEFAULT_SIZE[split] if size is None else size
        if size < 0:
            raise UserError(f"Arithmetic: size must be >= 0, got {size}")
        self.split = split
        self.size = size
        self.seed = seed
        super().__init__(**kwargs)

    def num_examples(self):
        return self.size

    def get_example(self, index):
        for attempt in range(1000):  # ~10% of problems are test problems: a few attempts are enough
            rng = random.Random(f"arithmetic-{self.seed}-{self.split}-{index}-{attempt}")
            solution = Solution()
            question, answer = rng.choice(TEMPLATES)(rng, solution)
            if problem_split(solution.calculations) == self.split:
                break
        else:
            raise RuntimeError(f"no {self.split} problem found for index {index}")  # cannot happen
        solution.text(f"#### {answer}")
        return {"messages": [{"role": "user", "content": question},
                             {"role": "assistant", "content": solution.parts}],
                "answer": answer}

    def evaluate(self, conversation, assistant_response):
        """True when the response's `#### N` (commas removed) equals the reference answer as a number."""
        reference = extract_answer(assistant_text(conversation["messages"][-1]))
        predicted = extract_answer(assistant_response)
        if predicted is None:
            return False
        try:
            return float(predicted) == float(reference)
        except ValueError:
            return False
