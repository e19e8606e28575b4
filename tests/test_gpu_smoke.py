"""
speedrun.sh's gpu profile shrunk to a smoke (NANOCHAT_PROFILE=gpu NANOCHAT_SMOKE=1), run on this machine's CPU.

NPROC=2 makes every torchrun launch of that profile start 2 CPU processes (gloo), so its plumbing runs here as on a
GPU node: the offline corpus, tasks and CORE bundle, every stage through torchrun, chat_web answering through
OpenAI's client, the report and its one line per stage. What only a GPU run (bench/gpu_check.sh) checks: CUDA, NCCL
and torch.compile, which compile="auto" leaves off on a CPU (compiling would take minutes a stage on 2 cores).
"""

import os
import re

import pytest

from helpers import REPO_ROOT, run_script, speedrun_env

# Smaller than the smoke's GPU sizes, so that 11 stages of 2 processes fit in about 2 minutes on 2 cores
CPU_SIZES = dict(VOCAB=512, DEPTH=1, SEQ=128, ROWS=4, BASE_STEPS=2, MID_STEPS=2, SFT_STEPS=2, RL_STEPS=1, EVAL_STEPS=1,
                 CORE_EXAMPLES=4, CHAT_PROBLEMS=4, RL_SAMPLES=2, MAX_NEW_TOKENS=32)
# Every address a stage downloads from, pointed at a closed port: a stage that tried to download would fail
NO_NETWORK = dict.fromkeys(("NANOCHAT_DATA_URL", "NANOCHAT_EVAL_BUNDLE_URL", "NANOCHAT_HF_URL"), "http://127.0.0.1:9")
STAGES = ["Tokenizer training", "Tokenizer evaluation", "Base model training", "Base model loss",
          "Base model evaluation", "Midtraining", "Chat evaluation mid", "Chat SFT", "Chat evaluation sft", "Chat RL",
          "Chat evaluation rl", "Chat web"]


@pytest.mark.slow
def test_gpu_speedrun_smoke_on_two_cpu_processes(pydocs_corpus, isolated_env, tmp_path):
    pytest.importorskip("openai", reason="chat_web_check needs the openai pip package: pip install openai")
    env = speedrun_env("gpu", NPROC="2", **{k: str(v) for k, v in CPU_SIZES.items()}, **NO_NETWORK)
    result = run_script(os.path.join(REPO_ROOT, "speedrun.sh"), cwd=tmp_path, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "speedrun: profile gpu" in out and "speedrun: done" in out
    # every training stage and evaluation ran on 2 ranks, without compiling (a CPU), from the pydocs corpus
    sections = {path.name: path.read_text() for path in (isolated_env / "report").glob("*.md")}
    assert ("- DDP: True" in sections["base-model-training.md"]
            and "- torch.compile: False" in sections["base-model-training.md"])
    for name in ("midtraining.md", "chat-sft.md", "chat-rl.md"):
        assert re.search(r"^- (World size|Gradient accumulation steps): ", sections[name], re.MULTILINE), name
    for stage in ("mid", "sft", "rl"):
        assert ("- world size: 2" in sections[f"chat-evaluation-{stage}.md"]
                and "- tasks: offline" in sections[f"chat-evaluation-{stage}.md"])
    assert ("- bundle: offline" in sections["base-model-evaluation.md"]
            and "- dataset: pydocs" in sections["tokenizer-training.md"])
    assert "- World size: 2" in sections["chat-sft.md"] and "- World size: 2" in sections["chat-rl.md"]
    # chat_web answered through OpenAI's client and was stopped cleanly
    assert "chat_web_check: the rl model answered through OpenAI's client" in out and "stopped cleanly" in out
    assert "## Chat web" in (tmp_path / "report.md").read_text()
    # the summary: one line per stage, in the order they ran, with its wall time and headline number
    summary = out.split("Stages (wall time from the end of the one before; headline number):\n", 1)[1].splitlines()
    lines = summary[:len(STAGES)]
    assert [line.split("  ")[1].strip() for line in lines] == STAGES, summary
    assert all(re.search(r" \d+ s", line) for line in lines), lines
    for stage, key in (("Base model training", "Final validation bpb"), ("Base model evaluation", "pydocs-CORE metric"),
                       ("Chat evaluation rl", "Offline ChatCORE"), ("Chat RL", "Mean reward, last steps"),
                       ("Chat web", "Reply tokens")):
        assert f"{key}: " in lines[STAGES.index(stage)], lines


def test_stage_lines_time_each_section_from_the_one_before(isolated_env):
    """
    The run's summary (report.stage_lines): sections in the order they were written, whatever their names, each
    timed from the one before (the first from the report's start), with the first HEADLINES key it holds.
    """
    from nanochat import report
    directory = report.report_dir()
    with open(os.path.join(directory, "header.md"), "w") as f:
        f.write("# nanochat training report\n\nStarted: 2025-01-01 10:00:00\n")
    for slug, title, stamp, lines in [("chat-rl", "Chat RL", "10:02:30",
                                       ["- pass@1: 0.1", "- Mean reward, last steps: 0.2500"]),
                                      ("base-model-training", "Base model training", "10:01:05",
                                       ["- CORE metric: 0.2", "- Final validation bpb: 1.2345"]),
                                      ("tokenizer-training", "Tokenizer training", "10:00:07", ["- vocab_size: 512"])]:
        with open(os.path.join(directory, f"{slug}.md"), "w") as f:
            f.write(f"## {title}\ntimestamp: 2025-01-01 {stamp}\n\n" + "\n".join(lines) + "\n")
    assert report.stage_lines(directory) == [
        "  Tokenizer training           7 s",
        "  Base model training         58 s  Final validation bpb: 1.2345",
        "  Chat RL                     85 s  Mean reward, last steps: 0.2500",
    ]
