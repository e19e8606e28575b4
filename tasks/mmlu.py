"""
MMLU (cais/mmlu): four-choice questions on 57 subjects, from elementary mathematics to law.

Categorical: the user turn is the question rendered by tasks.common.render_mc, the assistant answers one letter
A-D.

Files, fetched once each from the Hugging Face hub (tasks.common.hf_download) and read with pyarrow:
    cais/mmlu  all/test-00000-of-00001.parquet                 14,042 questions (the benchmark)
               all/validation-00000-of-00001.parquet            1,531
               all/dev-00000-of-00001.parquet                     285 (5 per subject, for few-shot prompts)
               auxiliary_train/train-00000-of-00001.parquet    99,842 (ARC, OBQA, RACE, ... in MMLU form: training data)
Columns: question (str), subject (str), choices (list of 4 str), answer (int 0-3, the index of the right choice).
auxiliary_train is published differently: ONE column `train`, a struct holding those four fields; it is
flattened on load, and either layout is accepted for every file.
"""



from nanochat.output import UserError
from tasks.common import Task, hf_parquet, render_mc, check_choice

REPO = "cais/mmlu"
SPLITS = {"all": ("test", "validation", "dev"), "auxiliary_train": ("train",)}
LETTERS = ("A", "B", "C", "D")
COLUMNS = ("question", "subject", "choices", "answer")


class MMLU(Task):
    """MMLU(subset="all"|"auxiliary_train", split=..., start=0, stop=None, step=1); splits in SPLITS."""

    eval_type = "categorical"

    def __init__(self, subset="all", split="test", **kwargs):
        check_choice("MMLU subset", subset, SPLITS)
        if split not in SPLITS[subset]:
            raise UserError(f"MMLU subset {subset!r} has split(s) {', '.join(SPLITS[subset])}, got {split!r}")
        table = hf_parquet(REPO, f"{subset}/{split}-00000-of-00001.parquet", COLUMNS)  # either layout
        # Kept as Arrow arrays (compact) and converted one row at a time in get_example.
        self.table = table.select(list(COLUMNS))
        super().__init__(**kwargs)

    def num_examples(self):
        return self.table.num_rows

    def get_example(self, index):
        row = {name: self.table.column(name)[index].as_py() for name in COLUMNS}
        choices = row["choices"]
        if len(choices) != len(LETTERS) or not 0 <= row["answer"] < len(choices):
            raise ValueError(f"MMLU row {index}: expected 4 choices and an answer in 0-3, "
                             f"got {len(choices)} and {row['answer']}")
        return {
            "messages": [
                {"role": "user", "content": render_mc(row["question"], LETTERS, choices)},
                {"role": "assistant", "content": LETTERS[row["answer"]]},
            ],
            "letters": list(LETTERS),  # an evaluator picks the most likely of these
            "subject": row["subject"],  # to report accuracy per subject
        }

    def evaluate(self, conversation, assistant_response):
        """True when the response (a letter; surrounding spaces ignored) is the reference letter."""
        return assistant_response.strip() == conversation["messages"][-1]["content"]
