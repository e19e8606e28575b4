r"""
GSM8K (openai/gsm8k): 8.5K grade-school math word problems whose worked solutions use a calculator.

Generative: the model writes a solution ending in "#### <number>", and evaluate() checks that number.

Files, fetched once each from the Hugging Face hub (tasks.common.hf_download) and read with pyarrow:
    openai/gsm8k  main/train-00000-of-00001.parquet   7,473 problems
                  main/test-00000-of-00001.parquet    1,319 problems
(subset "socratic": the same problems with sub-questions in the solutions, same file names under socratic/.)
Columns: question (str), answer (str).

The calculator annotations become tool calls. A published answer looks like

    Tom gives away 48/2 = <<48/2=24>>24 marbles.\n ... \n#### 48

and `<<expr=result>>` marks a calculator use. parse_answer() turns the answer into assistant parts:

    text "Tom gives away 48/2 = "   python "48/2"   python_output "24"   text "24 marbles.\n ... \n#### 48"

so the model learns to call the python tool (mask 1: it writes the call) and to read the tool's output
(mask 0: the tool writes it, see nanochat.tokenizer). The rules, in full:
- every `<<...>>` (shortest match) is an annotation; the text between annotations is kept verbatim as text
  parts (empty ones are dropped, so two annotations in a row give python, output, python, output);
- an annotation is split at its LAST "=": python = what is before it, python_output = what is after it,
  both stripped of surrounding spaces and otherwise kept as written;
- an annotation without "=" (not a calculation) is dropped; the text around it is joined;
- the final "#### <number>" line stays in the last text part: it is how the model states its answer.
Note the result also appears in the text right after the annotation ("...<<48/2=24>>24 marbles"): that
is how the solutions are written, and the model learns to copy the tool's output into its sentence.
"""

import re


from tasks.common import Task, hf_parquet, extract_answer, check_choice

REPO = "openai/gsm8k"
SUBSETS = ("main", "socratic")
SPLITS = ("train", "test")

ANNOTATION_RE = re.compile(r"<<(.*?)>>", re.DOTALL)
# "#### 1,234.5": an optional "$", then the number; commas (thousands separators) are removed afterwards


def parse_answer(answer):
    """The assistant parts of a GSM8K answer text (rules in the module docstring)."""
    parts = []

    def add_text(text):
        if not text:
            return
        if parts and parts[-1]["type"] == "text":  # text on both sides of a dropped annotation
            parts[-1]["text"] += text
        else:
            parts.append({"type": "text", "text": text})

    pos = 0
    for match in ANNOTATION_RE.finditer(answer):
        add_text(answer[pos:match.start()])
        expression, equals, result = match.group(1).rpartition("=")
        if equals:
            parts.append({"type": "python", "text": expression.strip()})
            parts.append({"type": "python_output", "text": result.strip()})
        pos = match.end()
    add_text(answer[pos:])
    return parts


def _same_number(a, b):
    """"72" == "72.0" == "72.": compared as numbers when both parse, else as strings."""
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


class GSM8K(Task):
    """GSM8K(subset="main"|"socratic", split="train"|"test", start=0, stop=None, step=1)."""

    eval_type = "generative"

    def __init__(self, subset="main", split="train", **kwargs):
        check_choice("GSM8K subset", subset, SUBSETS)
        check_choice("GSM8K split", split, SPLITS)
        table = hf_parquet(REPO, f"{subset}/{split}-00000-of-00001.parquet", ("question", "answer"))
        # Plain lists: 7.5K short strings, cheap to hold, and indexing them is fast.
        self.questions = table.column("question").to_pylist()
        self.answers = table.column("answer").to_pylist()
        super().__init__(**kwargs)

    def num_examples(self):
        return len(self.questions)

    def get_example(self, index):
        return {"messages": [
            {"role": "user", "content": self.questions[index]},
            {"role": "assistant", "content": parse_answer(self.answers[index])},
        ]}

    def evaluate(self, conversation, assistant_response):
        """
        True when the number after "####" in `assistant_response` (the text the model generated, tool
        outputs included or not) equals the reference's, commas ignored. No "####" in the response: False.
        """
        reference = conversation["messages"][-1]["content"]
        if isinstance(reference, list):
            reference = "".join(part["text"] for part in reference if part["type"] == "text")
        ref_number = extract_answer(reference)
        if ref_number is None:
            raise ValueError("the reference answer has no '#### <number>' line")
        predicted = extract_answer(assistant_response)
        return predicted is not None and _same_number(predicted, ref_number)
