"""
The offline chat mixture: synthetic tasks that need no download, so midtraining and chat evaluation run
anywhere (a laptop, CI, a machine without internet), and a small model is measured on things it can learn.
Its tasks, their sizes and their order are declared in tasks/registry.py (the places "mid/offline/train",
"sft/offline/train", "rl/offline/train" and "offline/test"); this module says why, and shows them.

    python -m scripts.mid_train --mixture=offline      uses offline_mixture("train") and offline_mixture("test")
    python -m tasks.offline                            prints the mixture's composition and a few examples

Sizes are chosen for a CPU-sized midtraining (speedrun.sh's CPU path: a depth-4 model reads 60 x 4,096 =
246k tokens) to see most of every task: 3,644 training conversations (~350k tokens with a 4,096-token pydocs
tokenizer) and 1,281 test conversations (~154k tokens) for CPython 3.11 (offline_tasks below).
Every task and its split are deterministic and documented in its module; train and test never share a
word (spelling), a problem (arithmetic), a documentation entry (pydocs) or a conversation (identity).

SFT reads other examples of the same train splits than midtraining (offline_tasks' `draw`), and RL others again,
of the tasks whose answers a program checks and that a speedrun-sized model gets right at times, so that its sampled
answers differ in reward: SpellingBee, Arithmetic, Identity. SimpleSpelling and PydocsChat it never gets right at that
size (every answer rewarded 0: nothing to learn, only sampling to pay for) and PydocsMC is scored by its logits, not
an answer. On arithmetic alone, RL drifted the other tasks and lowered the speedrun's Offline ChatCORE
(bench/RESULTS.md).
"""

import argparse

from nanochat.common import UserError
from tasks.common import TaskMixture, print_examples
from tasks.registry import build_tasks, stage_tasks


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
    if split not in ("train", "test"):
        raise UserError(f"offline_tasks: split must be train or test, got {split!r}")
    return [task for _, task in build_tasks(f"{('mid', 'sft')[draw]}/offline/train" if split == "train" else "offline/test")]


def offline_mixture(split, seed=42, draw=0):
    """TaskMixture of offline_tasks(split, draw), shuffled with `seed`."""
    return TaskMixture(offline_tasks(split, draw), seed=seed)


def offline_rl_mixture(split, seed=42):
    """The problems of RL on the offline tasks (chat_rl --mixture=offline; which, and why: the module docstring). The
    train split draws examples other than midtraining's and SFT's (seed 2); the test split is offline_tasks("test")'s."""
    if split not in ("train", "test"):
        raise UserError(f"offline_rl_mixture: split must be train or test, got {split!r}")
    return TaskMixture([task for _, task in stage_tasks("rl", "offline", "train" if split == "train" else "val")], seed=seed)


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
