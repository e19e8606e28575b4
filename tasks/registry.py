"""
The chat tasks and their mixtures, each declared once.

What the chat stages train on, what chat_eval scores, what the report card shows and what tasks.prefetch downloads
are all read from here.

    python -m tasks.registry              every mixture's tasks, in order (nothing is built or downloaded)
    python -m tasks.registry show NAME    a task or a mixture: its size(s), composition and a few rendered examples

A task (ChatTask, in TASKS) holds what is its own:
- its name: the one chat_eval's -a takes, its accuracy's key in the report, its key in SFT's accuracy metrics;
- how to build a split: build(split=..., **kwargs), a Task (tasks/common.py);
- hub: the Hugging Face dataset repos it downloads (tasks.prefetch fetches what real runs read; the tests' hub
  serves their fixtures, tests/fixtures/tasks/<repo>, where there are some);
- chatcore: the accuracy of guessing, for a task in ChatCORE (scored on build(split="test")); card: its label on the
  report card (chat_eval writes the labels into its report section). ChatCORE, chat_eval -a all and the report card
  list their tasks in the order of TASKS;
- settings: the script settings build() takes (e.g. identity_file).

A mixture (MIXTURES: {name: (who reads it, [use(...), ...])}) is an ordered list of uses. use(task, split, copies,
**kwargs) reads the task's build(split=split, **kwargs) (size, seed, stop, step: the task's own arguments), listed
`copies` times (2: its examples twice, oversampled). The list's order is part of TaskMixture's shuffle. The offline
tasks' test split ("offline/test") is Offline ChatCORE (chat_eval -a offline) and the validation of the offline
stages, each on the tasks it trains on.

Your own conversations (--conversations=FILE of mid_train and chat_sft, a CustomJSON file: tasks/customjson.py) are
the task Conversations: the whole of a custom mixture (--mixture=custom: the file alone, e.g. for a model in another
language), and one more task, the last, of a real or offline mixture when the file is given. Its rule, the same in
every mixture: the first max(1, n // 20) of the file's n conversations are validation, the rest training.

Adding a task: write its module (a Task subclass, see tasks/common.py), add its ChatTask to TASKS and a use of it to
each mixture it joins; a new mixture is one more list. Nothing else needs to change: the scripts, the report card,
prefetch and the tests' file server all read these (tests/test_task_registry.py registers a task at runtime, puts it
in mixtures and checks that each of them sees it).
"""

import argparse
import json
import os
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from nanochat.files import get_base_dir
from nanochat.output import UserError
from tasks import arc, gsm8k, humaneval, mmlu, smoltalk
from tasks.arc import ARC
from tasks.arithmetic import Arithmetic
from tasks.common import TaskMixture, check_choice
from tasks.customjson import CustomJSON
from tasks.gsm8k import GSM8K
from tasks.humaneval import HumanEval
from tasks.identity import Identity, write_identity_jsonl
from tasks.mmlu import MMLU
from tasks.pydocs_chat import PydocsChat, PydocsMC
from tasks.smoltalk import SmolTalk
from tasks.spellingbee import SimpleSpelling, SpellingBee


@dataclass
class ChatTask:
    name: str
    build: object  # build(split=..., **kwargs) -> Task
    hub: tuple = ()  # Hugging Face dataset repos it downloads
    chatcore: float | None = None  # in ChatCORE: the accuracy of guessing
    card: str | None = None  # its label on the report card (None: not on it)
    settings: tuple = ()  # the script settings build() takes (e.g. identity_file)


def _mmlu(split, **kwargs):
    # MMLU's training questions are its auxiliary_train subset; its other splits are those of all subjects
    return MMLU(subset="auxiliary_train" if split == "train" else "all", split=split, **kwargs)


def _humaneval(split, **kwargs):
    check_choice("HumanEval split", split, ("test",))  # its only split: never read as training data by mistake
    return HumanEval(**kwargs)


def identity_jsonl(identity_file=""):
    """
    The identity conversations a real run reads: `identity_file` (--identity_file), else the built-in ones, written
    to the base dir (by every run that reads them; tasks.prefetch writes them up front).
    """
    return identity_file or write_identity_jsonl(os.path.join(get_base_dir(), "identity_conversations.jsonl"))


def _identity(split, identity_file="", **kwargs):
    # split "jsonl": the conversations of identity_jsonl() (real runs); "train"/"test": generated ones (offline)
    if split == "jsonl":
        return CustomJSON(identity_jsonl(identity_file), **kwargs)
    return Identity(split=split, **kwargs)


def conversations_split(conversations):
    """
    (validation, training): how many conversations of the file `conversations` (--conversations) each part gets, by
    the fixed rule: the first max(1, n // 20) are validation, the rest training. UserError for a missing file or one
    of fewer than 2 conversations (one of each part). Counts non-blank lines (CustomJSON checks them when built).
    """
    if not os.path.isfile(conversations):
        raise UserError(f"--conversations={conversations}: no such file")
    with open(conversations, encoding="utf-8") as f:
        n = sum(1 for line in f if line.strip())
    if n < 2:
        raise UserError(f"--conversations={conversations} holds {n} conversation(s), it needs at least 2: the first "
                        f"max(1, n // 20) are held out for validation, the rest are trained on")
    held_out = max(1, n // 20)
    return held_out, n - held_out


def check_conversations(kind, conversations=""):
    """
    The scripts' check of --mixture and --conversations, at start-up: custom needs a file; a given file must hold at
    least 2 conversations (conversations_split). UserError otherwise.
    """
    if kind == "custom" and not conversations:
        raise UserError("--mixture=custom trains on your own conversations alone: give their file with "
                        "--conversations=PATH (JSONL, one JSON array of messages per line: tasks/customjson.py)")
    if conversations:
        conversations_split(conversations)


def _conversations(split, conversations=""):
    # split "val": the first max(1, n // 20) conversations of the file; "train": the rest (conversations_split)
    check_choice("Conversations split", split, ("train", "val"))
    held_out, _ = conversations_split(conversations)
    return CustomJSON(conversations, stop=held_out) if split == "val" else CustomJSON(conversations, start=held_out)


TASKS = [
    # ChatCORE's six, in the order of its reports
    ChatTask("ARC-Easy", partial(ARC, subset="ARC-Easy"), hub=(arc.REPO,), chatcore=0.25, card="ARC-E"),
    ChatTask("ARC-Challenge", partial(ARC, subset="ARC-Challenge"), hub=(arc.REPO,), chatcore=0.25, card="ARC-C"),
    ChatTask("MMLU", _mmlu, hub=(mmlu.REPO,), chatcore=0.25, card="MMLU"),
    ChatTask("GSM8K", partial(GSM8K, subset="main"), hub=(gsm8k.REPO,), chatcore=0.0, card="GSM8K"),
    ChatTask("HumanEval", _humaneval, hub=(humaneval.REPO,), chatcore=0.0, card="HumanEval"),
    ChatTask("SpellingBee", SpellingBee, chatcore=0.0, card="SpellingBee"),
    # The other tasks of the real mixtures
    ChatTask("SmolTalk", SmolTalk, hub=(smoltalk.REPO,)),
    ChatTask("Identity", _identity, settings=("identity_file",)),
    ChatTask("SimpleSpelling", SimpleSpelling),
    # The offline tasks (why these: the offline mixtures below)
    ChatTask("Arithmetic", Arithmetic),
    ChatTask("PydocsChat", PydocsChat),
    ChatTask("PydocsMC", PydocsMC),
    # Your own conversations (--conversations=FILE): a custom mixture's only task; added to a real or offline mixture
    # by stage_tasks, since it is there only when a file is given
    ChatTask("Conversations", _conversations, settings=("conversations",)),
]


class Use(NamedTuple):
    task: str  # the name of a task of TASKS
    split: str
    copies: int  # how many times it is listed (2: its examples twice, oversampled)
    kwargs: dict  # the task's own arguments: size, seed, stop, step


def use(task, split, copies=1, **kwargs):
    """One entry of a mixture: task `task` read as its build(split=split, **kwargs), listed `copies` times."""
    return Use(task, split, copies, kwargs)


# Every mixture: {name: (who reads it, [use(...), ...] in order)}
MIXTURES = {
    "mid/real/train": ("scripts/mid_train.py --mixture=real", [
        use("SmolTalk", "train"),  # general conversations
        use("MMLU", "train"),  # multiple choice
        use("GSM8K", "train"),  # 8K math problems with calculator tool calls
        use("Identity", "jsonl", copies=2),  # who am I; listed twice = oversampled 2x
        use("SimpleSpelling", "train"),  # spell a word letter by letter
        use("SpellingBee", "train"),  # count letters, with a python tool call
    ]),
    "mid/real/val": ("its validation bpb", [
        use("SmolTalk", "test"),
        use("MMLU", "test", stop=5200),
        use("GSM8K", "test", stop=420),
    ]),
    "sft/real/train": ("scripts/chat_sft.py --mixture=real", [
        use("ARC-Easy", "train"),  # 2.3K multiple-choice science questions
        use("ARC-Challenge", "train"),  # 1.1K harder ones
        use("GSM8K", "train"),
        use("SmolTalk", "train", stop=10_000),
        use("Identity", "jsonl"),
        use("SimpleSpelling", "train", size=300),
        use("SpellingBee", "train", size=300),
    ]),
    "sft/real/val": ("its validation bpb", [
        use("SmolTalk", "test"),
    ]),
    "sft/real/metrics": ("its multiple-choice accuracy during training", [
        use("MMLU", "test"),
        use("ARC-Easy", "test"),
    ]),
    "rl/real/train": ("scripts/chat_rl.py --mixture=real", [
        use("GSM8K", "train"),
    ]),
    "rl/real/val": ("its pass@k", [
        use("GSM8K", "test"),
    ]),
    # The offline mixtures: synthetic tasks that need no download, so midtraining and chat evaluation run anywhere (a
    # laptop, CI, a machine without internet), and a small model is measured on things it can learn. Every task and
    # its split are deterministic and documented in its module; train and test never share a word (spelling), a
    # problem (arithmetic), a documentation entry (pydocs) or a conversation (identity). The sizes let a CPU-sized
    # midtraining (speedrun.sh's CPU path: a depth-4 model reads 60 x 4,096 = 246k tokens) see most of every task:
    # 3,644 training conversations (~350k tokens with a 4,096-token pydocs tokenizer) and 1,281 test conversations
    # (~154k tokens) for CPython 3.11.
    # SFT reads other examples of the same train splits than midtraining (the generators' seed 1, the pydocs entries
    # between midtraining's; a few generated examples repeat, the template space being finite): on the same ones
    # again it only overfits (bench/RESULTS.md, "The CPU speedrun's chat stages"). RL reads others again (seed 2), of
    # the tasks whose answers a program checks and that a speedrun-sized model gets right at times, so that its
    # sampled answers differ in reward: SpellingBee, Arithmetic, Identity. SimpleSpelling and PydocsChat it never gets
    # right at that size (every answer rewarded 0: nothing to learn, only sampling to pay for), and PydocsMC is scored
    # by its logits, not an answer. On arithmetic alone, RL drifted the other tasks and lowered the speedrun's Offline
    # ChatCORE (bench/RESULTS.md).
    "mid/offline/train": ("scripts/mid_train.py --mixture=offline", [
        use("SpellingBee", "train", size=700),
        use("SimpleSpelling", "train", size=500),
        use("Arithmetic", "train", size=800),  # word problems with calculator calls, "#### answer"
        use("PydocsChat", "train", step=9),  # ~800 of the 7,188 training entries, all modules
        use("PydocsMC", "train", step=16),  # ~450 multiple-choice questions (1 trained token)
        use("Identity", "train", copies=2, size=200),
    ]),
    "sft/offline/train": ("scripts/chat_sft.py --mixture=offline: other examples of midtraining's tasks", [
        use("SpellingBee", "train", size=700, seed=1),
        use("SimpleSpelling", "train", size=500, seed=1),
        use("Arithmetic", "train", size=800, seed=1),
        use("PydocsChat", "train", step=9, start=4),  # the entries between midtraining's
        use("PydocsMC", "train", step=16, start=8),
        use("Identity", "train", copies=2, size=200, seed=1),
    ]),
    "sft/offline/metrics": ("its multiple-choice accuracy during training", [
        use("PydocsMC", "test", step=8),
    ]),
    "rl/offline/train": ("scripts/chat_rl.py --mixture=offline: other examples again", [
        use("SpellingBee", "train", size=700, seed=2),
        use("Arithmetic", "train", size=800, seed=2),
        use("Identity", "train", size=200, seed=2),
    ]),
    "offline/test": ("chat_eval -a offline, Offline ChatCORE; the offline stages' validation", [
        use("SpellingBee", "test", size=100),
        use("SimpleSpelling", "test", size=60),
        use("Arithmetic", "test", size=120),
        use("PydocsChat", "test", step=5),  # ~160 of the 799 test entries
        # all 791: a small model answers them at chance, and 99 of them moved Offline ChatCORE by +-0.007 between two
        # models of one pipeline, as much as a stage's gain (bench/RESULTS.md)
        use("PydocsMC", "test"),
        use("Identity", "test", size=50),
    ]),
    # Your own conversations: the whole of a custom mixture; with real or offline, one more task (stage_tasks)
    "mid/custom/train": (
        "scripts/mid_train.py --mixture=custom --conversations=FILE; with real or offline: added to theirs",
        [use("Conversations", "train")]),
    "mid/custom/val": ("its validation bpb (the first max(1, n // 20) conversations of FILE)", [
        use("Conversations", "val"),
    ]),
    "sft/custom/train": (
        "scripts/chat_sft.py --mixture=custom --conversations=FILE; with real or offline: added to theirs",
        [use("Conversations", "train")]),
    "sft/custom/val": ("its validation bpb", [
        use("Conversations", "val"),
    ]),
    "sft/custom/metrics": ("none: free-text conversations have no choices to score", []),
}


def find(name):
    """The registered task called `name`; UserError naming the registered ones otherwise."""
    for task in TASKS:
        if task.name == name:
            return task
    raise UserError(f"unknown chat task {name!r}: tasks/registry.py has {', '.join(t.name for t in TASKS)}")


def uses(mixture):
    """
    The uses of `mixture`, in order. UserError for an unknown mixture, a use that names no registered task, or one
    listed fewer than once.
    """
    if mixture not in MIXTURES:
        raise UserError(f"unknown mixture {mixture!r} (known: {', '.join(MIXTURES)})")
    _, entries = MIXTURES[mixture]
    names = [task.name for task in TASKS]
    for entry in entries:
        if entry.task not in names:
            raise UserError(f"mixture {mixture} lists unknown chat task {entry.task!r}: tasks/registry.py has "
                            f"{', '.join(names)}")
        if entry.copies < 1:
            raise UserError(f"mixture {mixture}: {entry.task} listed {entry.copies} times, copies must be >= 1")
    return entries


def check(task, tasks):
    """UserError unless `task` can join `tasks`: a name none of them has."""
    if any(other.name == task.name for other in tasks):
        raise UserError(f"chat task {task.name!r} is registered twice")


def register(task, places=None):
    """
    Add a task at runtime (TASKS itself is where a task of this repository is declared), and its uses to the end of
    mixtures: places {mixture: use(task.name, ...)}.
    """
    check(task, TASKS)
    for mixture, entry in (places or {}).items():
        if mixture not in MIXTURES:
            raise UserError(f"chat task {task.name!r}: unknown mixture {mixture!r} (known: {', '.join(MIXTURES)})")
        if entry.copies < 1:
            raise UserError(f"chat task {task.name!r}: copies must be >= 1 in {mixture}")
    TASKS.append(task)
    for mixture, entry in (places or {}).items():
        MIXTURES[mixture][1].append(entry)


for _i, _task in enumerate(TASKS):
    check(_task, TASKS[:_i])
for _mixture in MIXTURES:
    uses(_mixture)  # a misspelt task fails here, not in the middle of a stage


def build_use(entry, **settings):
    """The Task one use reads (one Task, however many copies); `settings`: the script's, e.g. identity_file."""
    task = find(entry.task)
    taken = {k: v for k, v in settings.items() if k in task.settings}
    return task.build(split=entry.split, **taken, **entry.kwargs)


def build_tasks(mixture, **settings):
    """[(name, Task)] of `mixture` in its order, a use with copies=2 listed twice (the same Task: built once)."""
    out = []
    for entry in uses(mixture):
        out += [(entry.task, build_use(entry, **settings))] * entry.copies
    return out


def stage_tasks(stage, kind, part, conversations="", **settings):
    """
    [(name, Task)] that `stage` (mid | sft | rl) reads for `part` (train | val | metrics) of the `kind` (real |
    offline | custom) mixture: its own mixture, except that an offline stage validates on the offline test split of
    the tasks it trains on. `conversations` (--conversations, a file): the custom mixture's only task; with real or
    offline, one more task, last (its uses in "<stage>/custom/<part>").
    """
    check_choice("stage", stage, ("mid", "sft", "rl"))
    check_choice("part", part, ("train", "val", "metrics"))
    check_choice("mixture", kind, ("real", "offline", "custom") if stage != "rl" else ("real", "offline"))
    check_conversations(kind, conversations)
    if kind == "custom":
        return build_tasks(f"{stage}/custom/{part}", conversations=conversations)
    if kind == "offline" and part == "val":
        trained = {entry.task for entry in uses(f"{stage}/offline/train")}
        tasks = [(name, task) for name, task in build_tasks("offline/test", **settings) if name in trained]
    else:
        tasks = build_tasks(f"{stage}/{kind}/{part}", **settings)
    if conversations:
        tasks += build_tasks(f"{stage}/custom/{part}", conversations=conversations)
    return tasks


def stage_mixture(stage, kind, part, **settings):
    """
    What a stage reads (stage_tasks): one task as it is (nothing to mix: SFT's real validation, RL's GSM8K, a custom
    mixture), or a TaskMixture of them (seed 42, the same every run).
    """
    tasks = [task for _, task in stage_tasks(stage, kind, part, **settings)]
    return tasks[0] if len(tasks) == 1 else TaskMixture(tasks)


def chatcore_baselines():
    """{name: accuracy of guessing} of the ChatCORE tasks, in the order of TASKS."""
    return {task.name: task.chatcore for task in TASKS if task.chatcore is not None}


def report_card_labels():
    """[(name, label)] of the tasks on the report card, in the order of TASKS."""
    return [(task.name, task.card) for task in TASKS if task.card]


def hub_repos():
    """The Hugging Face dataset repos the tasks download, each once, in the order of TASKS."""
    return list(dict.fromkeys(repo for task in TASKS for repo in task.hub))


def real_run_splits():
    """
    [(task, [split, ...])] of every task that downloads: the splits a real run reads (its uses in the real mixtures,
    the ChatCORE test split), what tasks.prefetch fetches.
    """
    out = []
    for task in (task for task in TASKS if task.hub):
        splits = [entry.split for mixture, (_, entries) in MIXTURES.items() if "/real/" in mixture
                  for entry in entries if entry.task == task.name]
        splits += ["test"] if task.chatcore is not None else []
        out.append((task, list(dict.fromkeys(splits))))  # each split once, in the order of the mixtures
    return out


# -----------------------------------------------------------------------------
# python -m tasks.registry [show NAME]


def describe(entry):
    """One use as `python -m tasks.registry` lists it: "Identity train, size=200 (x2)"."""
    args = "".join(f", {k}={v!r}" for k, v in entry.kwargs.items())
    copies = f" (x{entry.copies})" if entry.copies > 1 else ""
    return f"{entry.task} {entry.split}{args}{copies}"


def print_examples(task, n):
    """The first `n` examples of `task`: tokens with the training mask if a tokenizer is trained, else the JSON."""
    from nanochat.tokenizer import get_tokenizer
    if not n or not len(task):
        return
    try:
        tokenizer = get_tokenizer()
    except UserError:
        tokenizer = None
        print("(no trained tokenizer: printing the conversations as JSON)")
    for i in range(min(n, len(task))):
        conversation = task[i]
        if tokenizer is None:
            print(json.dumps(conversation, indent=2, ensure_ascii=False))
        else:
            ids, mask = tokenizer.render_conversation(conversation)
            print(tokenizer.visualize_tokenization(ids, mask))
        print("-" * 80)


def show(name, n, split, **settings):
    """
    `show NAME`: a mixture's uses, each with its size, and their total; or a task's facts, the mixtures that use it
    and the size of one split. Then the first `n` examples, of the mixture as a stage reads it, or of the split.
    """
    if name in MIXTURES:
        reader, _ = MIXTURES[name]
        print(f"{name} - {reader}:")
        tasks = []
        for entry in uses(name):
            task = build_use(entry, **settings)
            print(f"  {describe(entry)}: {len(task):,} examples")
            tasks += [task] * entry.copies
        shown = tasks[0] if len(tasks) == 1 else TaskMixture(tasks)  # as stage_mixture reads it
        print(f"  total: {len(shown):,} examples\n")
    elif name in (task.name for task in TASKS):
        task = find(name)
        facts = [f"downloads {', '.join(task.hub)}" if task.hub else "no download"]
        facts += [f"in ChatCORE (guessing scores {task.chatcore})"] if task.chatcore is not None else []
        facts += [f"on the report card as {task.card}"] if task.card else []
        print(f"{task.name}: {'; '.join(facts)}")
        for mixture, (_, entries) in MIXTURES.items():
            for entry in entries:
                if entry.task == name:
                    print(f"  {mixture}: {describe(entry)}")
        shown = task.build(split=split, **{k: v for k, v in settings.items() if k in task.settings})
        print(f"{task.name} {split}: {len(shown):,} examples\n")
    else:
        raise UserError(f"{name!r} is neither a chat task ({', '.join(t.name for t in TASKS)}) nor a mixture "
                        f"({', '.join(MIXTURES)})")
    print_examples(shown, n)


def main(argv=None):
    from nanochat.output import setup_default_logging
    setup_default_logging()  # a UserError prints one line
    parser = argparse.ArgumentParser(
        prog="python -m tasks.registry",
        description="Every mixture's tasks, in order; or `show NAME`: a task's or a mixture's size(s), composition "
                    "and a few rendered examples.")
    parser.add_argument("command", nargs="?", choices=["show"])
    parser.add_argument("name", nargs="?", help="a task (e.g. GSM8K) or a mixture (e.g. mid/offline/train)")
    parser.add_argument("-n", type=int, default=3, help="number of examples to print")
    parser.add_argument("--split", default="test", help="the split of a task to show (Conversations: train or val)")
    parser.add_argument("--conversations", default="", help="your conversations (JSONL), for the custom mixtures")
    parser.add_argument("--identity_file", default="", help="the identity conversations of the real mixtures")
    args = parser.parse_args(argv)
    if args.command is None:
        for name, (reader, entries) in MIXTURES.items():
            print(f"{name} - {reader}:")
            for entry in entries:
                print(f"  {describe(entry)}")
        baselines = ", ".join(f"{name} (guessing: {baseline})" for name, baseline in chatcore_baselines().items())
        print(f"ChatCORE (chat_eval -a all; the test split): {baselines}")
        print("report card: " + ", ".join(f"{name} as {label}" for name, label in report_card_labels()))
    elif args.name is None:
        parser.error("show needs a NAME: a task or a mixture")
    else:
        show(args.name, args.n, args.split, conversations=args.conversations, identity_file=args.identity_file)


if __name__ == "__main__":
    main()
