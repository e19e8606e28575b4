"""
Tests of tasks/registry.py, the one declaration of the chat tasks: a task registered there (and its module) is all
that the stages' mixtures, chat_eval (its tasks, ChatCORE), the report card, tasks.prefetch and the tests' file
server need; nothing else names a task; a wrong name or place is a UserError, never a silent fallback.
"""

import json
import os
import re

import pytest

from helpers import REPO_ROOT
from nanochat.common import UserError
from tasks import registry
from tasks.common import Task, hf_download
from tasks.registry import ChatTask, at

ECHO_REPO = "nanochat-tests/echo"


class Echo(Task):
    """A new task's module: "say 7" -> "7", the numbers of a split read from a file of the hub (like the real tasks)."""

    def __init__(self, split="train", **kwargs):
        with open(hf_download(ECHO_REPO, f"{split}.json")) as f:
            self.numbers = json.load(f)
        super().__init__(**kwargs)

    def num_examples(self):
        return len(self.numbers)

    def get_example(self, index):
        n = self.numbers[index]
        return {"messages": [{"role": "user", "content": f"say {n}"}, {"role": "assistant", "content": str(n)}]}

    def evaluate(self, conversation, assistant_response):
        return assistant_response.strip() == conversation["messages"][-1]["content"]


@pytest.fixture
def echo(hub, monkeypatch):
    """Echo's files on the test hub, and its one entry in the registry (for this test only)."""
    root = os.path.join(hub.root, "datasets", ECHO_REPO, "resolve", "main")
    os.makedirs(root)
    for split, numbers in (("train", [1, 2, 3]), ("test", [40, 50])):
        with open(os.path.join(root, f"{split}.json"), "w") as f:
            json.dump(numbers, f)
    monkeypatch.setattr(registry, "TASKS", list(registry.TASKS))
    registry.register(ChatTask("Echo", Echo, hub=(ECHO_REPO,), chatcore=0.0, card="Echo", places={
        "mid/real/train": at(7, "train", copies=2), "rl/offline/train": at(3, "train"), "offline/test": at(6, "test")}))
    return hub


def test_a_new_task_is_its_module_and_one_registry_entry(echo, capsys, monkeypatch):
    from nanochat import core_eval
    from nanochat.report import report_card
    from scripts.chat_eval import load_tasks, scores
    from tasks import prefetch

    # chat_eval: -a Echo, -a offline, and ChatCORE, which now needs Echo's score too
    assert [t.numbers for t in load_tasks("ARC-Easy,Echo").values() if isinstance(t, Echo)] == [[40, 50]]
    assert list(load_tasks("offline"))[-1] == "Echo"
    six = {name: {"accuracy": 0.5, "chance": 0.0} for name in ("ARC-Easy", "ARC-Challenge", "MMLU", "GSM8K", "HumanEval",
                                                              "SpellingBee")}
    assert scores(six, offline=False) == {}
    assert scores({**six, "Echo": {"accuracy": 1.0, "chance": 0.0}}, offline=False) == {"ChatCORE": pytest.approx((3 * 1 / 3 + 3 * 0.5 + 1) / 7)}
    with pytest.raises(UserError, match=r"unknown task 'Ech': use ARC-Easy, .*SpellingBee, Echo or SimpleSpelling, .*Identity, several"):
        load_tasks("Ech")

    # the stages' mixtures: midtraining's real one lists it twice (one Task), RL's offline one trains and validates on it
    mid = registry.stage_mixture("mid", "real", "train")
    assert mid.tasks[-1] is mid.tasks[-2] and isinstance(mid.tasks[-1], Echo) and len(mid) == sum(map(len, mid.tasks))
    assert [type(t).__name__ for t in registry.stage_mixture("rl", "offline", "train").tasks][-1] == "Echo"
    assert [type(t).__name__ for t in registry.stage_mixture("rl", "offline", "val").tasks][-1] == "Echo"
    assert "Echo" not in [type(t).__name__ for t in registry.stage_mixture("mid", "offline", "val").tasks]  # not trained on

    # the report card: its label, after ChatCORE's other tasks, before the scores
    card = report_card({"chat-evaluation-sft": {"Echo": "0.5000", "GSM8K": "0.1000", "ChatCORE": "0.2000"}})
    assert card[2:] == ["| GSM8K | - | - | 0.1000 | - |", "| Echo | - | - | 0.5000 | - |", "| ChatCORE | - | - | 0.2000 | - |"]

    # prefetch downloads the splits a real run reads (the CORE bundle left out: no network in tests)
    monkeypatch.setattr(core_eval, "prepare_bundle", lambda name: "(not fetched)")
    monkeypatch.setattr(prefetch, "setup_default_logging", lambda: None)  # the test's logging stays as it is
    capsys.readouterr()
    prefetch.main()
    assert "Echo train, test: 3, 2 examples" in capsys.readouterr().out.splitlines()
    assert echo.requests[f"/datasets/{ECHO_REPO}/resolve/main/train.json"] == 1

    # the tests' file server (conftest.py's hub) serves the repos of hub_repos()
    assert registry.hub_repos()[-1] == ECHO_REPO


def test_wrong_names_and_places_are_user_errors(monkeypatch):
    monkeypatch.setattr(registry, "TASKS", list(registry.TASKS))
    with pytest.raises(UserError, match=r"unknown chat task 'Nope': tasks/registry.py has ARC-Easy, "):
        registry.find("Nope")
    with pytest.raises(UserError, match="registered twice"):
        registry.register(ChatTask("GSM8K", Echo))
    with pytest.raises(UserError, match="slot 0 of offline/test is taken by 'SpellingBee'"):
        registry.register(ChatTask("Echo", Echo, places={"offline/test": at(0, "test")}))
    with pytest.raises(UserError, match="unknown mixture 'mid/real/test'"):
        registry.register(ChatTask("Echo", Echo, places={"mid/real/test": at(9, "test")}))
    with pytest.raises(UserError, match="unknown mixture 'mid/real/metrics'"):
        registry.stage_mixture("mid", "real", "metrics")
    with pytest.raises(UserError, match="mixture must be one of real, offline, custom, got 'synthetic'"):
        registry.stage_mixture("sft", "synthetic", "train")
    with pytest.raises(UserError, match="HumanEval split must be one of test, got 'train'"):
        registry.find("HumanEval").build(split="train")


def test_only_the_registry_names_the_tasks():
    """What reads the registry builds no task of its own: it imports no task module (tasks.<name>), only the registry
    (and tasks.common's helpers, tasks.scoring's scorers)."""
    readers = ["scripts/mid_train.py", "scripts/chat_sft.py", "scripts/chat_rl.py", "scripts/chat_eval.py",
               "nanochat/report.py", "tasks/prefetch.py", "tasks/offline.py", "tests/helpers.py", "tests/conftest.py"]
    for path in readers:
        with open(os.path.join(REPO_ROOT, path)) as f:
            imported = set(re.findall(r"^\s*(?:from|import) (tasks\S*)", f.read(), re.MULTILINE))  # `from tasks import x`: tasks
        assert imported <= {"tasks.registry", "tasks.common", "tasks.scoring"}, (path, imported)
