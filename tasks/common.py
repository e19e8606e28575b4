"""
What every chat task shares: Task, TaskMixture, the multiple-choice prompt and the hub's files.

Task (a sliceable view over a dataset of conversations), TaskMixture (a deterministic shuffled mix of tasks),
render_mc (the multiple-choice prompt format), and hf_download (fetching a published dataset file from the Hugging
Face hub).

A conversation is {"messages": [{"role": "user"|"assistant"|"system", "content": str | [parts]}]}, rendered to
tokens by nanochat.tokenizer.Tokenizer.render_conversation.
"""

import os
import random
import re

from nanochat.downloads import download_file_with_lock
from nanochat.output import UserError


class Task:
    """
    A dataset of conversations, seen through a slice: Task(start=0, stop=None, step=1) exposes examples
    start, start+step, ... < stop of the underlying dataset. Subclasses load their data, then call
    super().__init__(start=..., stop=..., step=...), and implement num_examples(), get_example(index) and,
    for evaluation, evaluate(conversation, assistant_response).

    eval_type: "categorical" (the answer is one of a few letters: score by comparing the model's choice) or
    "generative" (the model writes an answer that evaluate() checks).
    """

    eval_type = "generative"

    def __init__(self, start=0, stop=None, step=1):
        if start < 0 or step < 1 or (stop is not None and stop < start):
            raise ValueError(f"bad slice: start={start}, stop={stop}, step={step}")
        self.start = start
        self.stop = stop
        self.step = step

    def num_examples(self):
        """Size of the underlying dataset (before slicing)."""
        raise NotImplementedError

    def get_example(self, index):
        """The conversation of underlying example `index`."""
        raise NotImplementedError

    def evaluate(self, conversation, assistant_response):
        raise NotImplementedError(f"{type(self).__name__} has no evaluation")

    def reward(self, conversation, assistant_response):
        """Reward for reinforcement learning: by default 1.0 for a correct answer, else 0.0."""
        return float(self.evaluate(conversation, assistant_response))

    def task_of(self, i):
        """The task that scores answers to example i (evaluate, reward): this one (a mixture's: the one it is of)."""
        return self

    def _range(self):
        stop = self.num_examples() if self.stop is None else min(self.stop, self.num_examples())
        return range(self.start, stop, self.step)

    def __len__(self):
        return len(self._range())

    def __getitem__(self, i):
        r = self._range()
        if not 0 <= i < len(r):
            raise IndexError(f"{type(self).__name__} index {i} out of range (len {len(r)})")
        return self.get_example(r[i])


class TaskMixture:
    """
    All examples of all tasks, in one deterministic shuffled order (random.Random(seed)). Listing a task
    twice makes its examples appear twice (oversampling). Each epoch of training sees every example once.
    """

    def __init__(self, tasks, seed=42):
        self.tasks = list(tasks)
        self.index = [(t, i) for t, task in enumerate(self.tasks) for i in range(len(task))]
        random.Random(seed).shuffle(self.index)

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        if not 0 <= i < len(self.index):  # no negative indices: as Task, so a cursor bug fails loudly
            raise IndexError(f"TaskMixture index {i} out of range (len {len(self.index)})")
        t, j = self.index[i]
        return self.tasks[t][j]

    def task_of(self, i):
        """The task example i comes from: it scores answers to it (evaluate, reward)."""
        return self.tasks[self.index[i][0]]


def check_choice(what, value, allowed):
    """UserError unless `value` is one of `allowed`, e.g. check_choice("GSM8K split", split, ("train", "test"))."""
    if value not in allowed:
        raise UserError(f"{what} must be one of {', '.join(allowed)}, got {value!r}")


def render_mc(question, letters, choices):
    """
    The multiple-choice prompt; the assistant answers with the letter alone ("B").

        Multiple Choice question: What is the capital of France?
        - Rome (A)
        - Paris (B)

        Respond only with the letter of the correct answer.

    Two choices, both for a small model:
    - Each choice comes first and its letter right after it: the model finds the letter next to the content
      it just read, instead of having to remember which letter came before which choice.
    - The letter in the prompt is the very token the answer is. A token holds the space before a word: with
      "- Paris = B" the prompt holds " B" while the answer is "B", two different tokens the model would have
      to learn as one answer. In "(B)" the letter is its own piece under the tokenizer's split pattern (" ("
      is a piece of punctuation, then "B" a word with nothing in front of it, then ")"), whatever the
      choice's text, so it is encoded exactly as the bare answer. tests/test_chat_eval.py checks this at
      the token level for every letter A-Z and the digit labels some ARC questions use.
    """
    lines = [f"Multiple Choice question: {question}"]
    lines += [f"- {choice} ({letter})" for letter, choice in zip(letters, choices)]
    lines.append("\nRespond only with the letter of the correct answer.")
    return "\n".join(lines)


def hf_url():
    """Base URL of the Hugging Face hub; $NANOCHAT_HF_URL points tests at a local server."""
    return os.environ.get("NANOCHAT_HF_URL", "https://huggingface.co").rstrip("/")


def hf_download(repo, path):
    """Fetch file `path` of dataset `repo` once (locked, atomic), as published; returns the local path."""
    url = f"{hf_url()}/datasets/{repo}/resolve/main/{path}"
    return download_file_with_lock(url, os.path.join("tasks", repo, path))


def hf_parquet(repo, path, columns):
    """
    A published parquet file of dataset `repo` (downloaded once) as a pyarrow Table with at least `columns`
    (only those are read). A file whose single column is a struct (MMLU's auxiliary_train stores its rows in
    one `train` struct) is flattened to its fields first. An unreadable file or missing columns: UserError
    naming the file.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    local = hf_download(repo, path)
    try:
        names = pq.ParquetFile(local).schema_arrow.names
        if len(names) == 1 and names[0] not in columns:  # one struct column: read it all, then flatten
            table = pq.read_table(local).flatten()
            table = table.rename_columns([n.removeprefix(names[0] + ".") for n in table.column_names])
        else:
            table = pq.read_table(local, columns=[c for c in columns if c in names])
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{local} is not a readable parquet file ({e}); delete it to download it again") from e
    missing = set(columns) - set(table.column_names)
    if missing:
        raise UserError(f"{local} lacks column(s) {sorted(missing)} (has {table.column_names}): "
                        f"not the published {repo} file")
    return table.select(list(columns))


# "#### 72" ends a GSM8K-style solution: the final answer (commas and a $ allowed)
FINAL_ANSWER_RE = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")


def extract_answer(text):
    """The number after the first "####" in `text`, commas removed ("#### 1,200" -> "1200"); None if absent."""
    match = FINAL_ANSWER_RE.search(text)
    return match.group(1).replace(",", "") if match else None


def assistant_text(message):
    """The text of an assistant message: its string, or its text parts joined (tool calls and outputs left out)."""
    content = message["content"]
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part["type"] == "text")

