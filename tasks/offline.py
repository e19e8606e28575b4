"""
The offline chat mixture: synthetic tasks that need no download, so midtraining and chat evaluation run
anywhere (a laptop, CI, a machine without internet), and a small model is measured on things it can learn.

    python -m scripts.mid_train --mixture=offline      uses offline_mixture("train") and offline_mixture("test")
    python -m tasks.offline                            prints the mixture's composition and a few examples

Sizes are chosen for a CPU-sized midtraining (speedrun.sh's CPU path: a depth-4 model reads 60 x 4,096 =
246k tokens) to see most of every task: 3,644 training conversations (~350k tokens with a 4,096-token pydocs
tokenizer) and 1,281 test conversations (~154k tokens) for CPython 3.11 (offline_tasks below).
Every task and its split are deterministic and documented in its module; train and test never share a
word (spelling), a problem (arithmetic), a documentation entry (pydocs) or a conversation (identity).
"""

import argparse

from nanochat.common import UserError
from tasks.arithmetic import Arithmetic
from tasks.common import TaskMixture, print_examples
from tasks.identity import Identity
from tasks.pydocs_chat import PydocsChat, PydocsMC
from tasks.spellingbee import SimpleSpelling, SpellingBee


def offline_tasks(split, draw=0):
    """
    The tasks of the offline mixture for `split` ("train" or "test"), in a fixed order. `draw` picks which examples
    of the train split: 0 is midtraining's; 1 is SFT's, as many, nearly all others (the generators' seed 1, the
    pydocs entries between midtraining's; a few generated examples repeat, the template space being finite), so that
    SFT, like the real pipeline's, reads examples midtraining did not (on the same ones again it only overfits:
    measured in bench/RESULTS.md, "The CPU speedrun's chat stages"). The test split is the same for every draw.
    """
    if draw not in (0, 1):
        raise UserError(f"offline_tasks: draw must be 0 (midtraining's examples) or 1 (SFT's), got {draw!r}")
    if split == "train":
        identity = Identity(split="train", size=200, seed=draw)
        return [
            SpellingBee(split="train", size=700, seed=draw),  # count letters, with a python tool call
            SimpleSpelling(split="train", size=500, seed=draw),  # spell a word letter by letter
            Arithmetic(split="train", size=800, seed=draw),  # word problems with calculator calls, "#### answer"
            PydocsChat(split="train", step=9, start=4 * draw),  # ~800 of the 7,188 training entries, all modules
            PydocsMC(split="train", step=16, start=8 * draw),  # ~450 multiple-choice questions (1 trained token)
            identity, identity,  # who am I; listed twice = oversampled 2x
        ]
    if split == "test":
        return [
            SpellingBee(split="test", size=100),
            SimpleSpelling(split="test", size=60),
            Arithmetic(split="test", size=120),
            PydocsChat(split="test", step=5),  # ~160 of the 799 test entries
            PydocsMC(split="test"),  # all 791: a small model answers them at chance, and 99 of them moved Offline
            # ChatCORE by +-0.007 between two models of one pipeline, as much as a stage's gain (bench/RESULTS.md)
            Identity(split="test", size=50),
        ]
    raise UserError(f"offline_tasks: split must be train or test, got {split!r}")


def offline_mixture(split, seed=42, draw=0):
    """TaskMixture of offline_tasks(split, draw), shuffled with `seed`."""
    return TaskMixture(offline_tasks(split, draw), seed=seed)


def offline_rl_mixture(split, seed=42):
    """
    The problems of RL on the offline tasks (chat_rl --mixture=offline): those of the offline tasks whose answers a
    program checks and that a speedrun-sized model gets right at times, so that its sampled answers differ in reward:
    SpellingBee, Arithmetic, Identity. SimpleSpelling and PydocsChat it never gets right at that size (every answer
    rewarded 0: nothing to learn, only sampling to pay for) and PydocsMC is scored by its logits, not an answer. The
    train split draws examples other than midtraining's and SFT's (seed 2); the test split is offline_tasks("test")'s.
    On arithmetic alone, RL drifted the other tasks and lowered the speedrun's Offline ChatCORE (bench/RESULTS.md).
    """
    if split == "train":
        tasks = [SpellingBee(split="train", size=700, seed=2), Arithmetic(split="train", size=800, seed=2),
                 Identity(split="train", size=200, seed=2)]
    elif split == "test":
        tasks = [task for task in offline_tasks("test") if isinstance(task, (SpellingBee, Arithmetic, Identity))]
    else:
        raise UserError(f"offline_rl_mixture: split must be train or test, got {split!r}")
    return TaskMixture(tasks, seed=seed)


def main(argv=None):
    from nanochat.common import setup_default_logging
    setup_default_logging()
    parser = argparse.ArgumentParser(description="Show the offline mixture: its tasks, sizes, and a few examples.")
    parser.add_argument("--split", default="train", choices=["train", "test"])
    parser.add_argument("-n", type=int, default=4, help="number of mixture examples to print")
    args = parser.parse_args(argv)
    tasks = offline_tasks(args.split)
    for task in tasks:
        print(f"{type(task).__name__:>15}: {len(task):,}")
    mixture = TaskMixture(tasks)
    print(f"{'total':>15}: {len(mixture):,} {args.split} conversations\n")
    print_examples(mixture, args.n)


if __name__ == "__main__":
    main()
