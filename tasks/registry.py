"""
The chat tasks, each declared once (TASKS below): what the chat stages train on, what chat_eval scores, what the
report card shows and what tasks.prefetch downloads are all read from here.

    python -m tasks.registry            prints every mixture's tasks, in order (nothing is built or downloaded)

An entry (ChatTask) says, for one task:
- its name: the one chat_eval's -a takes, its accuracy's key in the report, its key in SFT's accuracy metrics;
- how to build a split: build(split=..., **kwargs), a Task (tasks/common.py);
- hub: the Hugging Face dataset repos it downloads (tasks.prefetch fetches what real runs read; the tests' hub
  serves their fixtures, tests/fixtures/tasks/<repo>, where there are some);
- chatcore: the accuracy of guessing, for a task in ChatCORE (scored on build(split="test")); card: its label on the
  report card. ChatCORE, chat_eval -a all and the report card list their tasks in the order of TASKS;
- places: {mixture: at(slot, split, copies, **kwargs)}, where it goes in each mixture (MIXTURES below) and how much of
  it: slot is its position in that mixture's list of tasks (the list's order is part of TaskMixture's shuffle),
  build(split=split, **kwargs) what is read (size, seed, stop, step: the task's own arguments), copies how many
  times it is listed (2: its examples twice, oversampled). The offline tasks' test split ("offline/test") is Offline
  ChatCORE (chat_eval -a offline) and the validation of the offline stages, each on the tasks it trains on.

Your own conversations (--conversations=FILE of mid_train and chat_sft, a CustomJSON file: tasks/customjson.py) are
the task Conversations: the whole of a custom mixture (--mixture=custom: the file alone, e.g. for a model in another
language), and one more task, the last, of a real or offline mixture when the file is given. Its rule, the same in
every mixture: the first max(1, n // 20) of the file's n conversations are validation, the rest training.

Adding a task: write its module (a Task subclass, see tasks/common.py), and add its ChatTask to TASKS. Nothing else
needs to change: the scripts, the report card, prefetch and the tests' file server all read this list
(tests/test_task_registry.py registers a task at runtime and checks that each of them sees it).
"""

import os
from dataclasses import dataclass, field
from functools import partial

from nanochat.common import UserError, get_base_dir
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

# Every mixture a task can have a place in: {name: who reads it}
MIXTURES = {
    "mid/real/train": "scripts/mid_train.py --mixture=real",
    "mid/real/val": "its validation bpb",
    "sft/real/train": "scripts/chat_sft.py --mixture=real",
    "sft/real/val": "its validation bpb",
    "sft/real/metrics": "its multiple-choice accuracy during training",
    "rl/real/train": "scripts/chat_rl.py --mixture=real",
    "rl/real/val": "its pass@k",
    "mid/offline/train": "scripts/mid_train.py --mixture=offline",
    "sft/offline/train": "scripts/chat_sft.py --mixture=offline: other examples of midtraining's tasks",
    "sft/offline/metrics": "its multiple-choice accuracy during training",
    "rl/offline/train": "scripts/chat_rl.py --mixture=offline: other examples again",
    "offline/test": "chat_eval -a offline, Offline ChatCORE; the offline stages' validation",
    "mid/custom/train": "scripts/mid_train.py --mixture=custom --conversations=FILE; with real or offline: added to theirs",
    "mid/custom/val": "its validation bpb (the first max(1, n // 20) conversations of FILE)",
    "sft/custom/train": "scripts/chat_sft.py --mixture=custom --conversations=FILE; with real or offline: added to theirs",
    "sft/custom/val": "its validation bpb",
    "sft/custom/metrics": "none: free-text conversations have no choices to score",
}


def at(slot, split, copies=1, **kwargs):
    """A place in a mixture (see the module docstring): slot, build(split=split, **kwargs), listed `copies` times."""
    return slot, split, copies, kwargs


@dataclass
class ChatTask:
    name: str
    build: object  # build(split=..., **kwargs) -> Task
    places: dict = field(default_factory=dict)  # {mixture: at(...)}
    hub: tuple = ()  # Hugging Face dataset repos it downloads
    chatcore: float | None = None  # in ChatCORE: the accuracy of guessing
    card: str | None = None  # its label on the report card (None: not on it)
    settings: tuple = ()  # the script settings build() takes (e.g. identity_file)

    def build_at(self, mixture, **settings):
        """This task as placed in `mixture` (one Task, however many copies); `settings`: the script's, e.g. identity_file."""
        _, split, _, kwargs = self.places[mixture]
        return self.build(split=split, **{k: v for k, v in settings.items() if k in self.settings}, **kwargs)


def _mmlu(split, **kwargs):
    # MMLU's training questions are its auxiliary_train subset; its other splits are those of all subjects
    return MMLU(subset="auxiliary_train" if split == "train" else "all", split=split, **kwargs)


def _humaneval(split, **kwargs):
    check_choice("HumanEval split", split, ("test",))  # its only split: never read as training data by mistake
    return HumanEval(**kwargs)


def identity_jsonl(identity_file=""):
    """The identity conversations a real run reads: `identity_file` (--identity_file), else the built-in ones, written
    to the base dir (by every run that reads them; tasks.prefetch writes them up front)."""
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
    """The scripts' check of --mixture and --conversations, at start-up: custom needs a file; a given file must hold at
    least 2 conversations (conversations_split). UserError otherwise."""
    if kind == "custom" and not conversations:
        raise UserError("--mixture=custom trains on your own conversations alone: give their file with "
                        "--conversations=PATH (JSONL, one JSON array of messages per line: tasks/customjson.py)")
    if conversations:
        conversations_split(conversations)


def _conversations(split, conversations=""):
    # split "val": the first max(1, n // 20) conversations of the file; "train": the rest (conversations_split)
    held_out, _ = conversations_split(conversations)
    return CustomJSON(conversations, stop=held_out) if split == "val" else CustomJSON(conversations, start=held_out)


TASKS = [
    # ChatCORE's six, in the order of its reports
    ChatTask("ARC-Easy", partial(ARC, subset="ARC-Easy"), hub=(arc.REPO,), chatcore=0.25, card="ARC-E", places={
        "sft/real/train": at(0, "train"),  # 2.3K multiple-choice science questions
        "sft/real/metrics": at(1, "test")}),
    ChatTask("ARC-Challenge", partial(ARC, subset="ARC-Challenge"), hub=(arc.REPO,), chatcore=0.25, card="ARC-C", places={
        "sft/real/train": at(1, "train")}),  # 1.1K harder ones
    ChatTask("MMLU", _mmlu, hub=(mmlu.REPO,), chatcore=0.25, card="MMLU", places={
        "mid/real/train": at(1, "train"),  # multiple choice
        "mid/real/val": at(1, "test", stop=5200),
        "sft/real/metrics": at(0, "test")}),
    ChatTask("GSM8K", partial(GSM8K, subset="main"), hub=(gsm8k.REPO,), chatcore=0.0, card="GSM8K", places={
        "mid/real/train": at(2, "train"),  # 8K math problems with calculator tool calls
        "mid/real/val": at(2, "test", stop=420),
        "sft/real/train": at(2, "train"),
        "rl/real/train": at(0, "train"),
        "rl/real/val": at(0, "test")}),
    ChatTask("HumanEval", _humaneval, hub=(humaneval.REPO,), chatcore=0.0, card="HumanEval"),
    ChatTask("SpellingBee", SpellingBee, chatcore=0.0, card="SpellingBee", places={
        "mid/real/train": at(6, "train"),  # count letters, with a python tool call
        "sft/real/train": at(6, "train", size=300),
        "mid/offline/train": at(0, "train", size=700),
        "sft/offline/train": at(0, "train", size=700, seed=1),
        "rl/offline/train": at(0, "train", size=700, seed=2),
        "offline/test": at(0, "test", size=100)}),
    # The other tasks of the real mixtures
    ChatTask("SmolTalk", SmolTalk, hub=(smoltalk.REPO,), places={
        "mid/real/train": at(0, "train"),  # general conversations
        "mid/real/val": at(0, "test"),
        "sft/real/train": at(3, "train", stop=10_000),
        "sft/real/val": at(0, "test")}),
    ChatTask("Identity", _identity, settings=("identity_file",), places={
        "mid/real/train": at(3, "jsonl", copies=2),  # who am I; listed twice = oversampled 2x
        "sft/real/train": at(4, "jsonl"),
        "mid/offline/train": at(5, "train", copies=2, size=200),
        "sft/offline/train": at(5, "train", copies=2, size=200, seed=1),
        "rl/offline/train": at(2, "train", size=200, seed=2),
        "offline/test": at(5, "test", size=50)}),
    ChatTask("SimpleSpelling", SimpleSpelling, places={
        "mid/real/train": at(5, "train"),  # spell a word letter by letter
        "sft/real/train": at(5, "train", size=300),
        "mid/offline/train": at(1, "train", size=500),
        "sft/offline/train": at(1, "train", size=500, seed=1),
        "offline/test": at(1, "test", size=60)}),
    # The offline tasks (why these sizes, and which examples each stage reads: tasks/offline.py)
    ChatTask("Arithmetic", Arithmetic, places={
        "mid/offline/train": at(2, "train", size=800),  # word problems with calculator calls, "#### answer"
        "sft/offline/train": at(2, "train", size=800, seed=1),
        "rl/offline/train": at(1, "train", size=800, seed=2),
        "offline/test": at(2, "test", size=120)}),
    ChatTask("PydocsChat", PydocsChat, places={
        "mid/offline/train": at(3, "train", step=9),  # ~800 of the 7,188 training entries, all modules
        "sft/offline/train": at(3, "train", step=9, start=4),  # the entries between midtraining's
        "offline/test": at(3, "test", step=5)}),  # ~160 of the 799 test entries
    ChatTask("PydocsMC", PydocsMC, places={
        "mid/offline/train": at(4, "train", step=16),  # ~450 multiple-choice questions (1 trained token)
        "sft/offline/train": at(4, "train", step=16, start=8),
        "sft/offline/metrics": at(0, "test", step=8),
        # all 791: a small model answers them at chance, and 99 of them moved Offline ChatCORE by +-0.007 between two
        # models of one pipeline, as much as a stage's gain (bench/RESULTS.md)
        "offline/test": at(4, "test")}),
    # Your own conversations (--conversations=FILE): a custom mixture's only task; added to a real or offline mixture
    # by stage_tasks, since it is there only when a file is given
    ChatTask("Conversations", _conversations, settings=("conversations",), places={
        "mid/custom/train": at(0, "train"),
        "mid/custom/val": at(0, "val"),
        "sft/custom/train": at(0, "train"),
        "sft/custom/val": at(0, "val")}),
]


def check(task, tasks):
    """UserError unless `task` can join `tasks`: a new name, known mixtures, and no slot another task holds."""
    if any(other.name == task.name for other in tasks):
        raise UserError(f"chat task {task.name!r} is registered twice")
    for mixture, (slot, _, copies, _) in task.places.items():
        if mixture not in MIXTURES:
            raise UserError(f"chat task {task.name!r}: unknown mixture {mixture!r} (known: {', '.join(MIXTURES)})")
        if copies < 1:
            raise UserError(f"chat task {task.name!r}: copies must be >= 1 in {mixture}")
        for other in tasks:
            if other.places.get(mixture, (None,))[0] == slot:
                raise UserError(f"chat task {task.name!r}: slot {slot} of {mixture} is taken by {other.name!r}")


for _i, _task in enumerate(TASKS):
    check(_task, TASKS[:_i])


def register(task):
    """Add a task at runtime (TASKS itself is where a task of this repository is declared)."""
    check(task, TASKS)
    TASKS.append(task)


def find(name):
    """The registered task called `name`; UserError naming the registered ones otherwise."""
    for task in TASKS:
        if task.name == name:
            return task
    raise UserError(f"unknown chat task {name!r}: tasks/registry.py has {', '.join(t.name for t in TASKS)}")


def placed(mixture):
    """The tasks that have a place in `mixture`, in slot order."""
    if mixture not in MIXTURES:
        raise UserError(f"unknown mixture {mixture!r} (known: {', '.join(MIXTURES)})")
    return sorted((task for task in TASKS if mixture in task.places), key=lambda task: task.places[mixture][0])


def build_tasks(mixture, **settings):
    """[(name, Task)] of `mixture` in slot order, a task with copies=2 listed twice (the same Task: built once)."""
    out = []
    for task in placed(mixture):
        built = task.build_at(mixture, **settings)
        out += [(task.name, built)] * task.places[mixture][2]
    return out


def stage_tasks(stage, kind, part, conversations="", **settings):
    """
    [(name, Task)] that `stage` (mid | sft | rl) reads for `part` (train | val | metrics) of the `kind` (real |
    offline | custom) mixture: its own mixture, except that an offline stage validates on the offline test split of
    the tasks it trains on. `conversations` (--conversations, a file): the custom mixture's only task; with real or
    offline, one more task, last (its place in "<stage>/custom/<part>").
    """
    check_choice("stage", stage, ("mid", "sft", "rl"))
    check_choice("part", part, ("train", "val", "metrics"))
    check_choice("mixture", kind, ("real", "offline", "custom") if stage != "rl" else ("real", "offline"))
    check_conversations(kind, conversations)
    if kind == "custom":
        return build_tasks(f"{stage}/custom/{part}", conversations=conversations)
    if kind == "offline" and part == "val":
        trained = {task.name for task in placed(f"{stage}/offline/train")}
        tasks = [(name, task) for name, task in build_tasks("offline/test", **settings) if name in trained]
    else:
        tasks = build_tasks(f"{stage}/{kind}/{part}", **settings)
    if conversations:
        tasks += build_tasks(f"{stage}/custom/{part}", conversations=conversations)
    return tasks


def stage_mixture(stage, kind, part, **settings):
    """What a stage reads (stage_tasks): one task as it is (nothing to mix: SFT's real validation, RL's GSM8K, a custom
    mixture), or a TaskMixture of them (seed 42, the same every run)."""
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
    """[(task, [split, ...])] of every task that downloads: the splits a real run reads (its real mixtures' places,
    the ChatCORE test split), what tasks.prefetch fetches."""
    out = []
    for task in (task for task in TASKS if task.hub):
        splits = [split for mixture, (_, split, _, _) in task.places.items() if "/real/" in mixture]
        splits += ["test"] if task.chatcore is not None else []
        out.append((task, list(dict.fromkeys(splits))))  # each split once, in the order of its places
    return out


def main():
    for name, reader in MIXTURES.items():
        print(f"{name} - {reader}:")
        for task in placed(name):
            _, split, copies, kwargs = task.places[name]
            args = "".join(f", {k}={v!r}" for k, v in kwargs.items())
            print(f"  {task.name} {split}{args}{f' (x{copies})' if copies > 1 else ''}")
    print("ChatCORE (chat_eval -a all; the test split): " + ", ".join(f"{name} (guessing: {baseline})"
                                                              for name, baseline in chatcore_baselines().items()))
    print("report card: " + ", ".join(f"{name} as {label}" for name, label in report_card_labels()))


if __name__ == "__main__":
    main()
