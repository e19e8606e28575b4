"""
Scoring a chat model on a task's problems: categorical, generative, and the progress line of a long scoring.

Used by scripts/chat_eval.py, chat_sft.py (multiple-choice accuracy) and chat_rl.py (pass@k); how each kind of task is
scored, and why: scripts/chat_eval.py's docstring (and docs/evaluation.md). A task says what a right answer is
(evaluate, reward); this runs the model (GPT.last_logits, the Engine) on its problems.
"""

import time

import torch

from nanochat.interrupt import check_stop
from nanochat.output import duration, print0


def letter_token(tokenizer, letter):
    """The token id of an answer label ("A", "3"): labels are single characters, hence single tokens."""
    ids = tokenizer.encode(letter)
    if len(ids) != 1:
        raise ValueError(f"answer label {letter!r} is {len(ids)} tokens: a categorical answer must be one token")
    return ids[0]


@torch.inference_mode()
def score_categorical(model, tokenizer, task, indices, batch_size, device, progress=None, stop=None):
    """
    Problems `indices` of a categorical task, `batch_size` prompts per forward of `model` (model.last_logits(ids, last)
    -> the logits (B, vocab) at position last[b] of each row: GPT.last_logits); the answer is the allowed letter with
    the largest logit. Returns one (passed, letter chosen) per problem.
    A prompt longer than the training context is read whole; one longer than model.rotary_len fails (letter None).
    stop: asked before every batch: Interrupted on this rank (callers with collectives: interrupt.interruptible).
    """
    pad = tokenizer.encode_special("<|assistant_end|>")  # any id does: nothing real comes after it
    limit = getattr(model, "rotary_len", None) or float("inf")
    # Batches of prompts of similar length: a batch is padded to its longest prompt, and in the task's own order a
    # third of PydocsMC's tokens were padding. Sorted within windows of 16 batches (nearly all of the gain), so a
    # big task (MMLU: 14k questions) starts at once and stops within a window's rendering; outcomes keep the order.
    outcomes = []
    window = 16 * batch_size
    for first in range(0, len(indices), window):
        conversations = [task[i] for i in indices[first:first + window]]
        prompts = [tokenizer.render_for_completion(c) for c in conversations]  # each ends with <|assistant_start|>
        order = sorted(range(len(prompts)), key=lambda k: len(prompts[k]))
        scored = [(False, None)] * len(prompts)  # a prompt longer than the rotary table keeps (False, None)
        for start in range(0, len(order), batch_size):
            check_stop(stop)
            batch = order[start:start + batch_size]
            rows = [k for k in batch if len(prompts[k]) <= limit]
            if rows:
                ids = torch.full((len(rows), max(len(prompts[k]) for k in rows)), pad, dtype=torch.long, device=device)
                for row, k in enumerate(rows):
                    ids[row, :len(prompts[k])] = torch.tensor(prompts[k], dtype=torch.long)
                last = torch.tensor([len(prompts[k]) - 1 for k in rows], device=device)  # each row's last position
                logits = model.last_logits(ids, last)  # (rows, vocab)
                for row, k in enumerate(rows):
                    letters = conversations[k]["letters"]
                    allowed = torch.tensor([letter_token(tokenizer, letter) for letter in letters], device=device)
                    choice = letters[int(logits[row, allowed].argmax())]
                    scored[k] = (bool(task.evaluate(conversations[k], choice)), choice)
            if progress:
                progress.update([scored[k][0] for k in batch])
        outcomes += scored
    return outcomes


def score_generative(engine, tokenizer, task, indices, num_samples, max_new_tokens, temperature, top_k, seed,
                     progress=None, stop=None, batch_size=1):
    """
    Problems `indices` of a generative task: `num_samples` answers each (sample seed: seed + problem index), a
    problem passes if any does. Returns one (passed, answers) per problem; answers is None when the prompt fills the
    context (the problem fails). stop: as for score_categorical, asked before every problem (every decoded token of
    a batch).
    Greedy (temperature 0) answers need no seed, so `batch_size` problems of `indices` at a time are decoded together
    (Engine.generate_many, one decoding step for all of them: several times faster than one after another). Their
    answers are those of one problem at a time up to rounding, exactly when the same problems go together (how
    chat_eval splits them among ranks). Sampled answers stay one problem at a time: problem i's samples depend on
    seed + i only, never on what else is evaluated.
    """
    if temperature == 0 and batch_size > 1:
        return _score_greedy_batches(engine, tokenizer, task, indices, num_samples, max_new_tokens, batch_size,
                                     progress, stop)
    outcomes = []
    for i in indices:
        check_stop(stop)
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


def _score_greedy_batches(engine, tokenizer, task, indices, num_samples, max_new_tokens, batch_size, progress, stop):
    """
    score_generative at temperature 0, `batch_size` problems decoded together. A prompt with less room than
    max_new_tokens left in the context is decoded alone, so every problem gets min(max_new_tokens, its room) tokens,
    as one at a time; every greedy sample is the same answer, so one is decoded and counted num_samples times.
    """
    outcomes = []
    for start in range(0, len(indices), batch_size):
        conversations = [task[i] for i in indices[start:start + batch_size]]
        prompts = [tokenizer.render_for_completion(c) for c in conversations]
        rooms = [engine.context_len - len(p) for p in prompts]
        groups = [[k for k, room in enumerate(rooms) if room >= max_new_tokens]]  # decoded together
        groups += [[k] for k, room in enumerate(rooms) if 0 < room < max_new_tokens]  # decoded alone
        answers = [None] * len(prompts)  # a prompt that fills the context keeps None: the problem fails
        for group in (g for g in groups if g):
            tokens = [[] for _ in group]
            steps = min(max_new_tokens, min(rooms[k] for k in group))
            for column, _ in engine.generate_many([prompts[k] for k in group], max_tokens=steps, temperature=0.0):
                check_stop(stop)
                for row, token in enumerate(column):
                    if not tokens[row] or tokens[row][-1] not in engine.end_tokens:
                        tokens[row].append(token)
            for row, k in enumerate(group):
                answers[k] = [tokenizer.decode([t for t in tokens[row] if t not in engine.end_tokens])] * num_samples
        batch = [(False, None) if a is None else (any(task.evaluate(c, answer) for answer in a), a)
                 for c, a in zip(conversations, answers)]
        outcomes += batch
        if progress:
            progress.update([passed for passed, _ in batch])
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
        self.name = name
        self.total = total
        self.every = every
        self.enabled = enabled
        self.share = share
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
        print0(f"{self.name} {self.done}/{self.total}{self.share} ({self.done / self.total:.0%}) | "
               f"{rate:.1f} problems/s | ~{duration((self.total - self.done) / rate)} left | "
               f"acc so far {self.passed / self.done:.1%}")
