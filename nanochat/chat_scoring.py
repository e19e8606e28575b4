"""
Scoring a chat model on a task's problems, and the progress of a long scoring, shared by scripts/chat_eval.py (the
evaluation stage), scripts/chat_sft.py (its periodic multiple-choice accuracy) and scripts/chat_rl.py (pass@k). How each kind of task is scored, and why, is in
scripts/chat_eval.py's docstring.
"""

import time

import torch

from nanochat.common import Interrupted, duration, print0


def letter_token(tokenizer, letter):
    """The token id of an answer label ("A", "3"): labels are single characters, hence single tokens."""
    ids = tokenizer.encode(letter)
    if len(ids) != 1:
        raise ValueError(f"answer label {letter!r} is {len(ids)} tokens: a categorical answer must be one token")
    return ids[0]


@torch.inference_mode()
def score_categorical(model, tokenizer, task, indices, batch_size, device, progress=None, stop=None):
    """
    Problems `indices` of a categorical task, `batch_size` prompts per forward. Returns one (passed, letter
    chosen) per problem. stop: asked before every batch; when it says so, Interrupted (on this rank: a caller with
    collectives agrees with the other ranks, nanochat.common.interruptible). `model(ids)` must return logits (B, T, vocab), as GPT does. A prompt longer than the model's training
    context is still read whole (GPT's rotary table reaches 10x further): the answer is one forward, and
    cutting the prompt would cut the question. A prompt beyond even that fails (letter None).
    """
    pad = tokenizer.encode_special("<|assistant_end|>")  # any id does: nothing real comes after it
    limit = getattr(model, "rotary_len", None) or float("inf")  # the model cannot read further (positions)
    outcomes = []
    for start in range(0, len(indices), batch_size):
        if stop is not None and stop():
            raise Interrupted
        conversations = [task[i] for i in indices[start:start + batch_size]]
        prompts = [tokenizer.render_for_completion(c) for c in conversations]  # each ends with <|assistant_start|>
        batch = [(False, None)] * len(prompts)  # a prompt too long to read at all fails (letter None)
        rows = [k for k, p in enumerate(prompts) if len(p) <= limit]
        if rows:
            ids = torch.full((len(rows), max(len(prompts[k]) for k in rows)), pad, dtype=torch.long, device=device)
            for row, k in enumerate(rows):
                ids[row, :len(prompts[k])] = torch.tensor(prompts[k], dtype=torch.long)
            last = torch.tensor([len(prompts[k]) - 1 for k in rows], device=device)  # each row's last real position
            logits = model(ids)[torch.arange(len(rows), device=device), last]  # (rows, vocab)
            for row, k in enumerate(rows):
                letters = conversations[k]["letters"]
                allowed = torch.tensor([letter_token(tokenizer, letter) for letter in letters], device=device)
                choice = letters[int(logits[row, allowed].argmax())]
                batch[k] = (bool(task.evaluate(conversations[k], choice)), choice)
        outcomes += batch
        if progress:
            progress.update([passed for passed, _ in batch])
    return outcomes


def score_generative(engine, tokenizer, task, indices, num_samples, max_new_tokens, temperature, top_k, seed,
                     progress=None, stop=None):
    """
    Problems `indices` of a generative task: `num_samples` answers each, a problem passes if any does.
    Returns one (passed, answers) per problem; answers is None when the prompt fills the model's context
    (nothing can be generated: the problem fails). stop: as for score_categorical, asked before every problem.
    """
    outcomes = []
    for i in indices:
        if stop is not None and stop():
            raise Interrupted
        conversation = task[i]
        prompt = tokenizer.render_for_completion(conversation)
        room = engine.context_len - len(prompt)
        if room < 1:
            outcomes.append((False, None))
        else:
            samples, _ = engine.generate_batch(prompt, num_samples=num_samples, max_tokens=min(max_new_tokens, room),
                                               temperature=temperature, top_k=top_k, seed=seed + i)
            answers = [tokenizer.decode(sample[len(prompt):]) for sample in samples]
            outcomes.append((any(task.evaluate(conversation, answer) for answer in answers), answers))
        if progress:
            progress.update([outcomes[-1][0]])
    return outcomes


class Progress:
    """
    A task's progress, printed after its first batch (how long the whole will take) and then every `every`
    seconds while it runs:
        GSM8K 120/1319 (9%) | 3.2 problems/s | ~6m left | acc so far 12.5%
    Under torchrun rank 0 prints its own share of the problems (every rank has about as many).
    """

    clock = time.time  # seconds; a test replaces it

    def __init__(self, name, total, every, enabled=True, share=""):
        self.name, self.total, self.every, self.enabled, self.share = name, total, every, enabled, share
        self.done = self.passed = 0
        self.start = self.last = self.clock()

    def update(self, outcomes):
        """Count the outcomes (True = passed) of the problems just scored; print the line if it is due."""
        self.done += len(outcomes)
        self.passed += sum(outcomes)
        now = self.clock()
        first = self.done == len(outcomes)
        if not self.enabled or self.done >= self.total or (now - self.last < self.every and not first):
            return
        self.last = now
        rate = self.done / max(now - self.start, 1e-9)
        print0(f"{self.name} {self.done}/{self.total}{self.share} ({self.done / self.total:.0%}) | {rate:.1f} problems/s | "
               f"~{duration((self.total - self.done) / rate)} left | acc so far {self.passed / self.done:.1%}")
