"""
Tests of tasks/registry.py, the one declaration of the chat tasks and their mixtures.

A task registered there (its module, one entry and a use in each mixture it joins) is all that the stages' mixtures,
chat_eval (its tasks, ChatCORE), the report card, tasks.prefetch and the tests' file server need; nothing else names
a task; a wrong name or place is a UserError, never a silent fallback. `python -m tasks.registry show NAME` prints a
task's or a mixture's sizes, composition and examples.
"""

import json
import os
import re

import pytest

from helpers import REPO_ROOT, run_script
from nanochat.output import UserError
from nanochat.tokenizer import get_tokenizer
from tasks import registry
from tasks.common import Task, hf_download
from tasks.registry import ChatTask, use

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


def own_mixtures(monkeypatch):
    """This test's copies of TASKS and of every mixture's list: what it registers or changes goes with it."""
    monkeypatch.setattr(registry, "TASKS", list(registry.TASKS))
    mixtures = {name: (reader, list(entries)) for name, (reader, entries) in registry.MIXTURES.items()}
    monkeypatch.setattr(registry, "MIXTURES", mixtures)


@pytest.fixture
def echo(hub, monkeypatch):
    """Echo's files on the test hub, its one entry in the registry and its uses in three mixtures (this test's)."""
    root = os.path.join(hub.root, "datasets", ECHO_REPO, "resolve", "main")
    os.makedirs(root)
    for split, numbers in (("train", [1, 2, 3]), ("test", [40, 50])):
        with open(os.path.join(root, f"{split}.json"), "w") as f:
            json.dump(numbers, f)
    own_mixtures(monkeypatch)
    registry.register(ChatTask("Echo", Echo, hub=(ECHO_REPO,), chatcore=0.0, card="Echo"), places={
        "mid/real/train": use("Echo", "train", copies=2),
        "rl/offline/train": use("Echo", "train"),
        "offline/test": use("Echo", "test")})
    return hub


def test_a_new_task_is_its_module_and_one_registry_entry(echo, capsys, monkeypatch, tmp_path):
    from nanochat import core_eval
    from nanochat.report import Report, report_card
    from scripts.chat_eval import load_tasks, scores
    from tasks import prefetch

    # chat_eval: -a Echo, -a offline, and ChatCORE, which now needs Echo's score too
    assert [t.numbers for t in load_tasks("ARC-Easy,Echo").values() if isinstance(t, Echo)] == [[40, 50]]
    assert list(load_tasks("offline"))[-1] == "Echo"
    six = {name: {"accuracy": 0.5, "chance": 0.0}
           for name in ("ARC-Easy", "ARC-Challenge", "MMLU", "GSM8K", "HumanEval", "SpellingBee")}
    assert scores(six, offline=False) == {}
    seven = {**six, "Echo": {"accuracy": 1.0, "chance": 0.0}}
    assert scores(seven, offline=False) == {"ChatCORE": pytest.approx((3 * 1 / 3 + 3 * 0.5 + 1) / 7)}
    unknown = r"unknown task 'Ech': use ARC-Easy, .*SpellingBee, Echo or SimpleSpelling, .*Identity, several"
    with pytest.raises(UserError, match=unknown):
        load_tasks("Ech")

    # the stages' mixtures: midtraining's real one lists it twice (one Task); RL's offline one trains and validates
    # on it
    mid = registry.stage_mixture("mid", "real", "train")
    assert mid.tasks[-1] is mid.tasks[-2] and isinstance(mid.tasks[-1], Echo) and len(mid) == sum(map(len, mid.tasks))
    assert [type(t).__name__ for t in registry.stage_mixture("rl", "offline", "train").tasks][-1] == "Echo"
    assert [type(t).__name__ for t in registry.stage_mixture("rl", "offline", "val").tasks][-1] == "Echo"
    assert "Echo" not in [type(t).__name__ for t in registry.stage_mixture("mid", "offline", "val").tasks]  # untrained

    # the report card: chat_eval's section names its label, which comes after ChatCORE's other tasks, before the scores
    section = Report(str(tmp_path)).log("Chat evaluation sft", [{"Echo": 0.5, "GSM8K": 0.1, "ChatCORE": 0.2}],
                                        card_labels=dict(registry.report_card_labels()))
    card = report_card({"chat-evaluation-sft": json.loads(open(section).read())})
    assert card[2:] == ["| GSM8K | - | - | 0.1000 | - |", "| Echo | - | - | 0.5000 | - |",
                        "| ChatCORE | - | - | 0.2000 | - |"]

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
    own_mixtures(monkeypatch)
    with pytest.raises(UserError, match=r"unknown chat task 'Nope': tasks/registry.py has ARC-Easy, "):
        registry.find("Nope")
    with pytest.raises(UserError, match="registered twice"):
        registry.register(ChatTask("GSM8K", Echo))
    with pytest.raises(UserError, match="unknown mixture 'mid/real/test'"):
        registry.register(ChatTask("Echo", Echo), places={"mid/real/test": use("Echo", "test")})
    with pytest.raises(UserError, match="Echo.*copies must be >= 1 in offline/test"):
        registry.register(ChatTask("Echo", Echo), places={"offline/test": use("Echo", "test", copies=0)})
    assert "Echo" not in [task.name for task in registry.TASKS]  # a refused task is not half registered
    # a mixture's list is checked whenever it is read (and every declared one at import)
    registry.MIXTURES["offline/test"][1].append(use("Nope", "test"))
    with pytest.raises(UserError, match="mixture offline/test lists unknown chat task 'Nope': tasks/registry.py has "):
        registry.stage_mixture("mid", "offline", "val")
    registry.MIXTURES["rl/offline/train"][1][0] = use("SpellingBee", "train", copies=0)
    with pytest.raises(UserError, match="mixture rl/offline/train: SpellingBee listed 0 times, copies must be >= 1"):
        registry.stage_mixture("rl", "offline", "train")
    with pytest.raises(UserError, match="unknown mixture 'mid/real/metrics'"):
        registry.stage_mixture("mid", "real", "metrics")
    with pytest.raises(UserError, match="mixture must be one of real, offline, custom, got 'synthetic'"):
        registry.stage_mixture("sft", "synthetic", "train")
    with pytest.raises(UserError, match="HumanEval split must be one of test, got 'train'"):
        registry.find("HumanEval").build(split="train")


def test_only_the_registry_names_the_tasks():
    """
    What reads the registry builds no task of its own: it imports no task module (tasks.<name>), only the registry
    (and tasks.common's helpers). The report card's labels come from chat_eval's report section.
    """
    readers = ["scripts/mid_train.py", "scripts/chat_sft.py", "scripts/chat_rl.py", "scripts/chat_eval.py",
               "tasks/prefetch.py", "tests/helpers.py", "tests/conftest.py"]
    for path in readers:
        with open(os.path.join(REPO_ROOT, path)) as f:
            # `from tasks import x` gives "tasks"
            imported = set(re.findall(r"^\s*(?:from|import) (tasks\S*)", f.read(), re.MULTILINE))
        assert imported <= {"tasks.registry", "tasks.common"}, (path, imported)


def show(*args):
    """`python -m tasks.registry show ...`: its stdout, after checking that it ran."""
    result = run_script("-m", "tasks.registry", "show", *args, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_show_a_mixture_or_a_task(trained_tokenizer, hub):
    """
    `show MIXTURE`: what each use reads and its size, the total, then the first examples as a stage reads them,
    rendered with the training mask; `show TASK`: its facts, the mixtures that use it, the size of one split and its
    examples (as JSON without a tokenizer). Offline: nothing is downloaded.
    """
    out = show("mid/offline/train", "-n", "2")
    lines = out.splitlines()
    assert lines[0] == "mid/offline/train - scripts/mid_train.py --mixture=offline:"
    assert "  Identity train, size=200 (x2): 200 examples" in lines
    expected = registry.stage_mixture("mid", "offline", "train")
    assert f"  total: {len(expected):,} examples" in lines
    assert out.count("-" * 80) == 2 and "[[" in out and "<|assistant_end|>" in out  # rendered, trained tokens marked
    tokenizer = get_tokenizer()
    ids, mask = tokenizer.render_conversation(expected[0])  # the stage's first conversation comes first
    examples = out.split(f"  total: {len(expected):,} examples\n\n")[1]
    assert examples.startswith(tokenizer.visualize_tokenization(ids, mask))

    os.remove(trained_tokenizer / "tokenizer.json")  # no tokenizer: the examples are printed as JSON
    out = show("Arithmetic", "-n", "1")
    lines = out.splitlines()
    assert lines[:6] == ["Arithmetic: no download",
                         "  mid/offline/train: Arithmetic train, size=800",
                         "  sft/offline/train: Arithmetic train, size=800, seed=1",
                         "  rl/offline/train: Arithmetic train, size=800, seed=2",
                         "  offline/test: Arithmetic test, size=120",
                         f"Arithmetic test: {len(registry.find('Arithmetic').build(split='test')):,} examples"]
    assert "no trained tokenizer" in out and '"type": "python_output"' in out and out.count("-" * 80) == 1
    assert hub.requests == {}

    result = run_script("-m", "tasks.registry", "show", "Nope", timeout=120)
    assert result.returncode == 1 and result.stderr.startswith("error: 'Nope' is neither a chat task (ARC-Easy, ")
