"""
CustomJSON: conversations of your own, from a JSONL file.

Use it for data no public dataset has, e.g. the model's identity ("who are you?", "who made you?") or anything a
project wants its chat model to know.

File format: one conversation per line, each a JSON array of messages:

    [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am nanochat, ..."}]

An optional system message may come first; then user and assistant alternate, starting with user and ending
with assistant (the turn the model is trained on). Contents are strings; an assistant content may also be a
list of parts {"type": "text"|"python"|"python_output", "text": str} (see nanochat.tokenizer). Blank lines
are skipped. The whole file is checked when the task is built, and a bad line raises UserError naming the
file and the line number, so a typo fails at start-up and not hours into training.

Generative, with no automatic evaluation (evaluate() raises NotImplementedError).

Training on a file of your own: docs/examples/conversations.jsonl is one (12 short conversations about the command
line, in English and Chinese). `--conversations=FILE` of mid_train and chat_sft reads such a file; the first
max(1, n // 20) of its n conversations are held out for validation (tasks/registry.py):

    python -m tasks.registry show mid/custom/train --conversations=docs/examples/conversations.jsonl  # check it
    python -m scripts.mid_train --mixture=custom --conversations=docs/examples/conversations.jsonl    # the file alone
    python -m scripts.chat_sft --mixture=custom --conversations=docs/examples/conversations.jsonl
    python -m scripts.mid_train --mixture=offline --conversations=FILE    # the offline tasks plus the file
"""

import json
import os

from nanochat.output import UserError
from tasks.common import Task

PART_TYPES = ("text", "python", "python_output")


def _check_conversation(messages):
    """Why `messages` is not a valid conversation, or None if it is."""
    if not isinstance(messages, list) or not messages:
        return "expected a non-empty JSON array of messages"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not {"role", "content"} <= set(message):
            return f"message {i} must be an object with 'role' and 'content'"
    first = 1 if messages[0]["role"] == "system" else 0
    if first and not isinstance(messages[0]["content"], str):
        return "the system message's content must be a string"
    turns = messages[first:]
    if not turns:
        return "a system message alone is not a conversation"
    for i, message in enumerate(turns, start=first):
        expected = "user" if (i - first) % 2 == 0 else "assistant"
        if message["role"] != expected:
            return (f"message {i} has role {message['role']!r}, expected {expected!r} (an optional system "
                    f"message, then user and assistant alternating)")
        content = message["content"]
        if isinstance(content, str):
            continue
        if expected == "user" or not isinstance(content, list):
            parts = " or a list of parts" if expected == "assistant" else ""
            return f"message {i} ({expected}) content must be a string{parts}"
        for j, part in enumerate(content):
            if (not isinstance(part, dict) or part.get("type") not in PART_TYPES
                    or not isinstance(part.get("text"), str)):
                return f"message {i} part {j} must be {{'type': one of {', '.join(PART_TYPES)}, 'text': str}}"
    if turns[-1]["role"] != "assistant":
        return "the last message must be the assistant's (there is nothing to train on after a user message)"
    return None


class CustomJSON(Task):
    """CustomJSON(filepath, start=0, stop=None, step=1): the conversations of a JSONL file (format above)."""

    eval_type = "generative"

    def __init__(self, filepath, **kwargs):
        if not os.path.exists(filepath):
            raise UserError(f"CustomJSON: no file {filepath}")
        self.filepath = filepath
        self.conversations = []
        with open(filepath, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    messages = json.loads(line)
                except json.JSONDecodeError as e:
                    problem = f"not valid JSON ({e.msg} at column {e.colno})"
                    raise UserError(f"{filepath}, line {lineno}: {problem}") from None
                problem = _check_conversation(messages)
                if problem:
                    raise UserError(f"{filepath}, line {lineno}: {problem}")
                self.conversations.append(messages)
        if not self.conversations:
            raise UserError(f"{filepath} holds no conversations (one JSON array of messages per line)")
        super().__init__(**kwargs)

    def num_examples(self):
        return len(self.conversations)

    def get_example(self, index):
        return {"messages": [dict(m) for m in self.conversations[index]]}  # copies: callers may modify them

    def evaluate(self, conversation, assistant_response):
        raise NotImplementedError("CustomJSON has no automatic evaluation: use it for training")
