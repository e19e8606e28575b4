"""
ARC, the AI2 Reasoning Challenge (allenai/ai2_arc): grade-school science multiple-choice questions.

Two subsets: ARC-Easy and ARC-Challenge (the questions simple retrieval and co-occurrence methods got wrong).
Categorical: the user turn is the question rendered by tasks.common.render_mc with the dataset's own labels as
letters, the assistant answers one label.

Files, fetched once each from the Hugging Face hub (tasks.common.hf_download) and read with pyarrow:
    allenai/ai2_arc  ARC-Easy/{train,validation,test}-00000-of-00001.parquet        2,251 / 570 / 2,376
                     ARC-Challenge/{train,validation,test}-00000-of-00001.parquet   1,119 / 299 / 1,172
Columns: id (str), question (str), choices {text: [str], label: [str]}, answerKey (str, one of the labels).
Labels are usually A-D, but some questions have 3 or 5 choices and a few use 1-4 instead of letters:
they are used as published, so the answer is always one of the labels shown in the prompt.
"""



from tasks.common import Task, hf_parquet, render_mc, check_choice

REPO = "allenai/ai2_arc"
SUBSETS = ("ARC-Easy", "ARC-Challenge")
SPLITS = ("train", "validation", "test")
COLUMNS = ("id", "question", "choices", "answerKey")


class ARC(Task):
    """ARC(subset="ARC-Easy"|"ARC-Challenge", split="train"|"validation"|"test", start=0, stop=None, step=1)."""

    eval_type = "categorical"

    def __init__(self, subset="ARC-Easy", split="test", **kwargs):
        check_choice("ARC subset", subset, SUBSETS)
        check_choice("ARC split", split, SPLITS)
        table = hf_parquet(REPO, f"{subset}/{split}-00000-of-00001.parquet", COLUMNS)
        self.rows = table.select(list(COLUMNS)).to_pylist()  # a few thousand short rows: plain Python is fine
        super().__init__(**kwargs)

    def num_examples(self):
        return len(self.rows)

    def get_example(self, index):
        row = self.rows[index]
        letters = row["choices"]["label"]
        texts = row["choices"]["text"]
        if len(letters) != len(texts) or row["answerKey"] not in letters:
            raise ValueError(f"ARC question {row['id']}: labels {letters} do not match {len(texts)} choices "
                             f"and answer {row['answerKey']!r}")
        return {
            "messages": [
                {"role": "user", "content": render_mc(row["question"], letters, texts)},
                {"role": "assistant", "content": row["answerKey"]},
            ],
            "letters": list(letters),  # an evaluator picks the most likely of these
        }

    def evaluate(self, conversation, assistant_response):
        """True when the response (a label; surrounding spaces ignored) is the reference label."""
        return assistant_response.strip() == conversation["messages"][-1]["content"]
