"""
HumanEval (openai/openai_humaneval): 164 hand-written Python programming problems, scored by running code.

The user turn is the start of a program (imports, sometimes helper functions, then the signature and docstring of
the function to write); the assistant writes the function; unit tests decide. Generative.

File, fetched once from the Hugging Face hub (tasks.common.hf_download) and read with pyarrow:
    openai/openai_humaneval  openai_humaneval/test-00000-of-00001.parquet    164 problems (the only split)
Columns (all str): task_id ("HumanEval/0"), prompt (the program's start, ending inside the function after its
docstring), canonical_solution (the body that completes `prompt`), test (defines `check(candidate)`, which
asserts), entry_point (the function's name).

How evaluate() runs a response (see also nanochat/execution.py for what guards the run):
1. The code: the first ``` fenced block of the response if it has one (its language tag dropped), else the
   whole response.
2. The program: the prompt, then the code, then the tests, then `check(<entry_point>)`. If the code defines
   the function itself (a line starting `def <entry_point>(`), it is a whole function and follows the
   prompt after a blank line: it replaces the prompt's docstring-only definition, and the prompt still
   supplies the imports and helpers. Otherwise the code is the body that continues the prompt.
3. It passes when the program runs to the end (exit status 0) within the time limit.
"""

import re

from nanochat.execution import execute_code
from tasks.common import Task, hf_parquet

REPO = "openai/openai_humaneval"
PATH = "openai_humaneval/test-00000-of-00001.parquet"
COLUMNS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
TIMEOUT = 5.0  # seconds per program: interpreter start-up plus the tests (the canonical solutions take < 1 s)

# ```python\n...``` (an unclosed fence runs to the end)
FENCE_RE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(response):
    """The code of a response: its first ``` fenced block, without the fence lines, or the response itself."""
    match = FENCE_RE.search(response)
    return match.group(1) if match else response


def build_program(prompt, code, test, entry_point):
    """The program evaluate() runs (rules in the module docstring)."""
    if re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        solution = prompt.rstrip() + "\n\n\n" + code  # a whole function: it redefines the prompt's stub
    else:
        solution = prompt + code  # the body, continuing the prompt (which ends with a newline)
    return f"{solution.rstrip()}\n\n\n{test.strip()}\n\n\ncheck({entry_point})\n"


class HumanEval(Task):
    """HumanEval(start=0, stop=None, step=1): the 164 problems of the test split (the only one)."""

    eval_type = "generative"

    def __init__(self, **kwargs):
        table = hf_parquet(REPO, PATH, COLUMNS)
        self.rows = table.to_pylist()  # 164 rows of short strings
        super().__init__(**kwargs)

    def num_examples(self):
        return len(self.rows)

    def get_example(self, index):
        row = self.rows[index]
        return {
            "messages": [
                {"role": "user", "content": row["prompt"]},
                # the reference answer is the whole function: the form evaluate() accepts most robustly
                {"role": "assistant", "content": row["prompt"] + row["canonical_solution"]},
            ],
            "task_id": row["task_id"], "prompt": row["prompt"], "test": row["test"], "entry_point": row["entry_point"],
        }

    def evaluate(self, conversation, assistant_response):
        """True when the response's code passes the problem's tests (run with nanochat.execution.execute_code)."""
        program = build_program(conversation["prompt"], extract_code(assistant_response), conversation["test"],
                                conversation["entry_point"])
        return execute_code(program, timeout=TIMEOUT).success
