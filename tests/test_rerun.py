"""
Rerun = resume (nanochat/rerun.py, speedrun.sh): `bash speedrun.sh` run again after any interruption finishes the
pipeline, doing no finished work twice. The cpu profile's smoke, in fp32, is interrupted inside every training stage
and an evaluation, by SIGTERM, SIGINT (the whole pipeline, as Ctrl-C) and SIGKILL, each time run again: the stages
done before are skipped, the interrupted one resumes from its last checkpoint, and the final weights of every stage
equal those of a run never interrupted, with every report section once. Then a run after a complete one skips
everything, and a changed setting runs its stage and the ones after it again. The same interruptions, in other
places, under torchrun on 2 CPU processes (the gpu profile's smoke, NPROC=2), against a run never interrupted.

Each run never interrupted is also that profile's smoke, checked for what it makes: the cpu profile on a corpus of
your own (NANOCHAT_DATASET=tutor: the Vim tutors, tests/fixtures/own_text) run from another directory, its report
copied there; the gpu profile with every stage through torchrun on 2 CPU processes (gloo), as on a GPU node but
without torch.compile (its "auto" leaves it off on a CPU), chat_web answering through OpenAI's client, and the
report's one line per stage. What only a GPU run (bench/gpu_check.sh) checks: CUDA, NCCL and torch.compile.
"""

import json
import os
import re
import shutil
import signal
import subprocess

import pytest
import torch

from helpers import REPO_ROOT, run_script, speedrun_env, stage_config, start_script

# Steps of every training stage, all different (so that a step line says which stage printed it); a periodic save
# after every step (SAVE_MINUTES), so that a SIGKILL finds a checkpoint to resume from
SIZES = dict(BASE_STEPS="6", MID_STEPS="5", SFT_STEPS="4", RL_STEPS="3", NANOCHAT_DTYPE="float32",
             NANOCHAT_DATASET="tutor")
STAGES = ["Tokenizer training", "Tokenizer evaluation", "Base model training", "Base model loss",
          "Base model evaluation", "Midtraining", "Chat evaluation mid", "Chat SFT", "Chat evaluation sft", "Chat RL",
          "Chat evaluation rl"]
# Every address a stage downloads from, pointed at a closed port: a stage that tried to download would fail
NO_NETWORK = dict.fromkeys(("NANOCHAT_DATA_URL", "NANOCHAT_EVAL_BUNDLE_URL", "NANOCHAT_HF_URL"), "http://127.0.0.1:9")
TRAINING = {"base": "base_checkpoints", "mid": "mid_checkpoints", "sft": "chatsft_checkpoints",
            "rl": "chatrl_checkpoints"}


def speedrun(cwd, env):
    """The whole pipeline to its end: (exit code, output)."""
    result = run_script(os.path.join(REPO_ROOT, "speedrun.sh"), cwd=cwd, env=env, timeout=900)
    return result.returncode, result.stdout + result.stderr


def interrupted(cwd, env, marker, sig, stage=None):
    """
    The pipeline, interrupted by `sig` once a line of its output contains `marker`: sent to the process of scripts.
    `stage` (the first one found), or to the whole process group (the shell and every process it started) if None.
    Returns (exit code, output).
    """
    import psutil
    proc = start_script(os.path.join(REPO_ROOT, "speedrun.sh"), cwd=cwd, env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if marker in line:
            if stage is None:
                os.killpg(proc.pid, sig)
            else:
                children = psutil.Process(proc.pid).children(recursive=True)
                os.kill(next(p.pid for p in children if f"scripts.{stage}" in " ".join(p.cmdline())), sig)
            break
    else:
        proc.wait()
        pytest.fail(f"the pipeline ended before {marker!r}:\n{''.join(lines[-40:])}")
    lines += proc.stdout.readlines()
    proc.wait(timeout=300)
    return proc.returncode, "".join(lines)


def reference_base(isolated_env, tmp_path):
    """
    A base dir of its own for the run never interrupted: the test's corpora, and the standard library's records that
    the pydocs corpus was built from (pydocs_entries.json: without them its offline tasks and CORE bundle would parse
    the standard library again, ~7 s of a core, as a user's base dir never does after its first build).
    """
    reference = tmp_path / "reference"
    shutil.copytree(isolated_env / "base_data", reference / "base_data")
    shutil.copy(isolated_env / "pydocs_entries.json", reference)
    return reference


def final_weights(base_dir):
    """{stage: the model state of its last complete checkpoint}."""
    weights = {}
    for stage, folder in TRAINING.items():
        directory = base_dir / folder / "d1"
        last = max(int(name[5:-5]) for name in os.listdir(directory) if name.startswith("meta_"))
        weights[stage] = torch.load(directory / f"model_{last:06d}.pt", map_location="cpu")
    return weights


def assert_same_weights(a, b):
    for stage in TRAINING:
        assert a[stage].keys() == b[stage].keys(), stage
        for name in a[stage]:
            assert torch.equal(a[stage][name], b[stage][name]), f"{stage}: {name} differs"


def assert_the_cpu_smoke(base_dir, cwd, out, repo_report_before):
    """What the cpu profile's smoke made, on the corpus of your own: every section, the report card, the report."""
    report = (base_dir / "report" / "report.md").read_text()
    assert "- dataset: tutor" in report and "| tutor val " in report  # the tokenizer learned and was measured on it
    for section in ("## Tokenizer training", "## Tokenizer evaluation", "## Base model training", "## Base model loss",
                    "## Base model evaluation", "## Midtraining", "## Chat evaluation mid", "## Chat SFT",
                    "## Chat evaluation sft", "## Chat RL", "## Chat evaluation rl", "### Report card",
                    "| Tokenizer bytes/token (val) |", "| Chat val bpb, base model |",
                    "| Chat val bpb, after midtraining |", "| pydocs-CORE |", "| Offline ChatCORE |"):
        assert section in report, section
    assert "python -m scripts.chat_cli --source=rl" in out and "python -m scripts.chat_web --source=rl" in out
    # this run's report, copied into the directory speedrun.sh was run from (a fresh one), with its curves
    assert (cwd / "report.md").read_text() == report and f"report: {cwd}/report.md" in out
    assert (cwd / "report_base-model-training_loss.png").exists()
    # the checkout untouched
    repo_report = os.path.join(REPO_ROOT, "report.md")
    assert (os.stat(repo_report).st_mtime_ns if os.path.exists(repo_report) else None) == repo_report_before


def assert_the_gpu_smoke(base_dir, cwd, out):
    """What the gpu profile's smoke made on 2 CPU processes: every stage on 2 ranks, chat_web, one line a stage."""
    assert "speedrun: profile gpu" in out and "speedrun: done" in out
    # every training stage and evaluation ran on 2 ranks, without compiling (a CPU), from the pydocs corpus
    sections = {path.name: path.read_text() for path in (base_dir / "report").glob("*.md")}
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
    assert "## Chat web" in (cwd / "report.md").read_text()
    # the summary: one line per stage, in the order they ran, with its wall time and headline number
    stages = STAGES + ["Chat web"]
    summary = out.split("Stages (wall time from the end of the one before; headline number):\n", 1)[1].splitlines()
    lines = summary[:len(stages)]
    assert [line.split("  ")[1].strip() for line in lines] == stages, summary
    assert all(re.search(r" \d+ s", line) for line in lines), lines
    for stage, key in (("Base model training", "Final validation bpb"), ("Base model evaluation", "pydocs-CORE metric"),
                       ("Chat evaluation rl", "Offline ChatCORE"), ("Chat RL", "Mean reward, last steps"),
                       ("Chat web", "Reply tokens")):
        assert f"{key}: " in lines[stages.index(stage)], lines


@pytest.mark.slow
def test_the_cpu_pipeline_interrupted_everywhere_and_rerun(pydocs_corpus, isolated_env, tmp_path):
    # a corpus of your own, which `python -m nanochat.dataset` checks against its files (the offline tasks and CORE
    # bundle still come from the pydocs records)
    built = run_script("-m", "nanochat.dataset", f"--from={os.path.join(REPO_ROOT, 'tests', 'fixtures', 'own_text')}",
                       "--name=tutor", "--split=paragraph")
    assert built.returncode == 0, built.stderr[-2000:]
    # the pipeline never interrupted, in a base dir of its own (the same corpora), run from a directory of its own
    reference = reference_base(isolated_env, tmp_path)
    (tmp_path / "ref_cwd").mkdir()
    repo_report = os.path.join(REPO_ROOT, "report.md")
    repo_report_before = os.stat(repo_report).st_mtime_ns if os.path.exists(repo_report) else None
    code, out = speedrun(tmp_path / "ref_cwd", speedrun_env(NANOCHAT_BASE_DIR=str(reference), **SIZES))
    assert code == 0, out[-3000:]
    assert_the_cpu_smoke(reference, tmp_path / "ref_cwd", out, repo_report_before)

    env = speedrun_env(SAVE_MINUTES="0.0001", **SIZES)
    # SIGTERM to base_train in its loop: it saves, exits 75, the pipeline stops there
    code, out = interrupted(tmp_path, env, "step 00003/00006", signal.SIGTERM, stage="base_train")
    assert code != 0 and "got SIGTERM" in out and "Run the same command again to continue" in out, out[-3000:]
    # SIGKILL to the whole pipeline in midtraining: the base stages are done, base training resumed to its end
    code, out = interrupted(tmp_path, env, "step 00003 (", signal.SIGKILL)
    assert code != 0 and "Base model training: resuming from step" in out, out[-3000:]
    assert "Tokenizer training: done at" in out and "by run 1 (first run)" in out
    # Ctrl-C (SIGINT to the whole pipeline) in SFT
    code, out = interrupted(tmp_path, env, "step 00002 (", signal.SIGINT)
    assert code != 0 and "Midtraining: resuming from step" in out and "got SIGINT" in out, out[-3000:]
    assert "Base model training: done at" in out and "Base model evaluation: done at" in out
    # SIGKILL in RL
    code, out = interrupted(tmp_path, env, "step 00002/00003", signal.SIGKILL)
    assert code != 0 and "Chat SFT: resuming from step" in out, out[-3000:]
    # SIGTERM to the last evaluation, which saves nothing: it runs again
    code, out = interrupted(tmp_path, env, "Evaluating rl model", signal.SIGTERM, stage="chat_eval")
    assert code != 0 and "Chat RL: resuming from step" in out, out[-3000:]
    code, out = speedrun(tmp_path, env)
    assert code == 0 and "speedrun: done" in out, out[-3000:]
    assert "Chat RL: done at" in out and "Chat evaluation rl: done at" not in out
    assert_same_weights(final_weights(isolated_env), final_weights(reference))
    report = (tmp_path / "report.md").read_text()
    assert [report.count(f"\n## {stage}\n") for stage in STAGES] == [1] * len(STAGES), report[-3000:]
    assert len(json.loads((isolated_env / "report" / "runs.json").read_text())) == 6
    assert "- Run: 6 (rerun)" in (isolated_env / "report" / "chat-evaluation-rl.md").read_text()
    assert "- Run: 1 (first run)" in (isolated_env / "report" / "tokenizer-training.md").read_text()
    # periodic saves replace each other: the interrupted stages keep their last checkpoint and nothing older
    steps = sorted(int(n[5:-5]) for n in os.listdir(isolated_env / "base_checkpoints" / "d1") if n.startswith("meta_"))
    assert steps == [6], steps

    # again after a complete run: every stage skipped
    code, out = speedrun(tmp_path, env)
    assert code == 0 and [f"{stage}: done at" in out for stage in STAGES] == [True] * len(STAGES), out[-3000:]

    # a changed setting: midtraining and every stage after it run again, the earlier ones are skipped
    code, out = speedrun(tmp_path, dict(env, MID_STEPS="4"))
    assert code == 0, out[-3000:]
    assert all(f"{stage}: done at" in out for stage in STAGES[:5]), out[-3000:]
    assert not any(f"{stage}: done at" in out for stage in STAGES[5:]), out[-3000:]
    assert "Midtraining: " in out and "made from other settings or inputs: they are replaced" in out
    assert "deleted the checkpoints of step(s) 5" in out  # named before they go

    # FRESH=1 starts over, naming what it deletes: the tokenizer is trained again (stopped once it is)
    code, out = interrupted(tmp_path, dict(env, FRESH="1"), "speedrun: base model", signal.SIGTERM)
    assert f"deleting {isolated_env / 'report'}" in out and "done at" not in out, out[-3000:]
    assert len(json.loads((isolated_env / "report" / "runs.json").read_text())) == 1


@pytest.mark.slow
def test_the_gpu_pipeline_on_two_processes_interrupted_everywhere_and_rerun(pydocs_corpus, isolated_env, tmp_path):
    # every stage through torchrun on 2 CPU processes (gloo); many steps per training stage, so that a signal sent
    # when a step line comes through torchrun's pipe still lands inside the stage
    sizes = dict(VOCAB="512", DEPTH="1", SEQ="128", ROWS="4", BASE_STEPS="30", MID_STEPS="40", SFT_STEPS="20",
                 RL_STEPS="3", EVAL_STEPS="1", CORE_EXAMPLES="4", CHAT_PROBLEMS="4", RL_SAMPLES="2",
                 MAX_NEW_TOKENS="32", NANOCHAT_DTYPE="float32", NPROC="2")
    reference = reference_base(isolated_env, tmp_path)
    (tmp_path / "ref_cwd").mkdir()
    code, out = speedrun(tmp_path / "ref_cwd", speedrun_env("gpu", NANOCHAT_BASE_DIR=str(reference), **sizes,
                                                           **NO_NETWORK))
    assert code == 0, out[-3000:]
    assert_the_gpu_smoke(reference, tmp_path / "ref_cwd", out)

    env = speedrun_env("gpu", SAVE_MINUTES="0.0001", **sizes, **NO_NETWORK)
    # Ctrl-C (SIGINT to torchrun, both ranks and the shell) in base training
    code, out = interrupted(tmp_path, env, "step 00002/00030", signal.SIGINT)
    assert code != 0 and "got SIGINT" in out, out[-3000:]
    # SIGTERM to midtraining's torchrun, which passes it to both ranks: they save and stop
    code, out = interrupted(tmp_path, env, "step 00002 (", signal.SIGTERM, stage="mid_train")
    assert code != 0 and "Base model training: resuming from step" in out and "got SIGTERM" in out, out[-3000:]
    # SIGKILL to everything in SFT (midtraining resumes first, its step lines going on after the step it stopped at);
    # RL and the evaluations interrupted: the cpu pipeline's test, the same code on one process
    code, out = interrupted(tmp_path, env, "step 00002 (", signal.SIGKILL)
    assert code != 0 and "Midtraining: resuming from step" in out, out[-3000:]
    code, out = speedrun(tmp_path, env)
    assert code == 0 and "speedrun: done" in out and "Chat SFT: resuming from step" in out, out[-3000:]
    assert_same_weights(final_weights(isolated_env), final_weights(reference))
    report = (tmp_path / "report.md").read_text()
    assert [report.count(f"\n## {stage}\n") for stage in STAGES] == [1] * len(STAGES), report[-3000:]


# ---------------------------------------------------------------------------------------------
# The parts, fast


def test_the_fingerprint_follows_what_changes_the_work_and_nothing_else():
    from nanochat.rerun import fingerprint
    config = dict(depth=4, lr=0.02, run="dummy", rerun="auto", save_every=-1, save_every_minutes=10.0,
                  resume_from_step=-1, overwrite=False, dry_run=False)
    inputs = dict(tokenizer="abc", corpus=dict(name="pydocs", shards=[["shard_00000.parquet", 10]]))
    made = fingerprint("base", config, inputs)
    assert len(made) == 16
    for key, value in (("run", "mine"), ("rerun", "no"), ("save_every", 5), ("save_every_minutes", 1.0),
                       ("resume_from_step", 3)):
        assert fingerprint("base", dict(config, **{key: value}), inputs) == made, key
    assert fingerprint("base", dict(config, lr=0.03), inputs) != made
    assert fingerprint("mid", config, inputs) != made
    assert fingerprint("base", config, dict(inputs, tokenizer="abd")) != made
    # base_train's default attention, "auto", was called "sdpa" before: a run made then is still done
    by_attention = {a: fingerprint("base", dict(config, attention=a), inputs) for a in ("auto", "sdpa", "eager")}
    assert by_attention["auto"] == by_attention["sdpa"] != by_attention["eager"]


def test_report_sections_say_which_run_made_them(isolated_env):
    from nanochat.report import get_report, read_state, start
    from nanochat.rerun import done_before, made_before
    assert "run 1" in start()
    get_report().log("Chat evaluation sft", [{"accuracy": 0.5}], made_from="f" * 16)
    assert made_before("Chat evaluation sft") == ("f" * 16, read_state("Chat evaluation sft")["timestamp"],
                                                  "1 (first run)")
    assert "rerun" in start()
    assert done_before("Chat evaluation sft", "f" * 16) and not done_before("Chat evaluation sft", "e" * 16)
    assert not done_before("Chat evaluation sft", "f" * 16, outputs=[str(isolated_env / "missing")])
    assert not done_before("Chat evaluation mid", "f" * 16)
    text = (isolated_env / "report" / "chat-evaluation-sft.md").read_text()
    assert "- Run: 1 (first run)" in text and "- Made from: ffffffffffffffff" in text
    get_report().log("Chat evaluation mid", [{"accuracy": 0.5}], made_from="f" * 16)
    assert made_before("Chat evaluation mid")[2] == "2 (rerun)"
    # a training stage stopped early wrote its section: not done
    get_report().log("Chat SFT", [{"Stopped early": True}], made_from="f" * 16)
    assert made_before("Chat SFT") is None


def test_rerun_reads_the_state_not_the_markdown(isolated_env):
    """A section's state (its JSON) says what rerun decides; its markdown, for people, is never read back."""
    from nanochat.report import get_report, start
    from nanochat.rerun import done_before, made_before
    start()
    get_report().log("Midtraining", [{"Stopped early": False}], made_from="a" * 16)
    report = isolated_env / "report"
    (report / "midtraining.md").write_text("## Midtraining\n\n- Stopped early: True\n- Made from: bbbbbbbbbbbbbbbb\n")
    assert made_before("Midtraining")[0] == "a" * 16 and not done_before("Midtraining", "b" * 16)
    (report / "midtraining.md").unlink()
    assert done_before("Midtraining", "a" * 16)
    (report / "chat-sft.md").write_text("## Chat SFT\n\n- Made from: aaaaaaaaaaaaaaaa\n")  # no state: never written
    assert made_before("Chat SFT") is None


def test_a_training_stage_plans_from_its_checkpoints_and_its_section(isolated_env):
    from nanochat.report import get_report
    from nanochat.rerun import training_plan
    directory = isolated_env / "mid_checkpoints" / "d1"
    assert training_plan("Midtraining", str(directory), "a" * 16) == ("fresh", None)
    directory.mkdir(parents=True)
    for step, made in ((2, "a" * 16), (4, "a" * 16)):
        (directory / f"meta_{step:06d}.json").write_text(json.dumps({"made_from": made}))
    assert training_plan("Midtraining", str(directory), "a" * 16) == ("resume", 4)
    assert training_plan("Midtraining", str(directory), "b" * 16) == ("replace", [2, 4])
    get_report().log("Midtraining", [{"Stopped early": False}], made_from="a" * 16)
    assert training_plan("Midtraining", str(directory), "a" * 16) == ("done", 4)
    # the last checkpoint made otherwise (a later run of other settings): not done, replaced
    (directory / "meta_000006.json").write_text(json.dumps({"made_from": "b" * 16}))
    assert training_plan("Midtraining", str(directory), "a" * 16)[0] == "replace"


def test_forget_names_what_it_deletes_and_keeps_the_data(isolated_env, capsys):
    from nanochat.rerun import forget
    for folder in ("report", "tokenizer", "base_checkpoints/d1", "base_data/pydocs"):
        (isolated_env / folder).mkdir(parents=True)
    gone = forget()
    out = capsys.readouterr().out
    assert sorted(os.path.basename(p) for p in gone) == ["base_checkpoints", "report", "tokenizer"]
    assert all(f"deleting {p}" in out for p in gone) and (isolated_env / "base_data" / "pydocs").is_dir()


def test_an_evaluation_made_already_is_skipped_with_one_line(isolated_env, capsys):
    """skip_if_done, each evaluation's check and the tokenizer's: the fingerprint for its section, or exit 0 if done."""
    from nanochat.report import get_report
    from nanochat.rerun import fingerprint, skip_if_done
    config, inputs = dict(max_problems=5, rerun="auto"), {"source": "sft"}
    made_from = skip_if_done("Chat evaluation sft", "chat_eval", config, inputs)
    assert made_from == fingerprint("chat_eval", config, inputs)
    get_report().log("Chat evaluation sft", [{"accuracy": 0.5}], made_from=made_from)
    assert skip_if_done("Chat evaluation sft", "chat_eval", dict(config, rerun="no"), inputs) == made_from
    assert skip_if_done("Chat evaluation sft", "chat_eval", dict(config, max_problems=6), inputs) != made_from
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        skip_if_done("Chat evaluation sft", "chat_eval", config, inputs)
    assert done.value.code == 0 and "Chat evaluation sft: done at " in capsys.readouterr().out
    # a file it makes is gone (the tokenizer's): made again
    missing = [str(isolated_env / "missing")]
    assert skip_if_done("Chat evaluation sft", "chat_eval", config, inputs, missing) == made_from


def test_rerun_and_save_every_minutes_are_checked(isolated_env):
    from nanochat.output import UserError
    from nanochat.stage import check_stage_settings
    config = stage_config()
    check_stage_settings(dict(config, rerun="auto", save_every_minutes=0.5))
    with pytest.raises(UserError, match="--rerun must be one of no, auto"):
        check_stage_settings(dict(config, rerun="yes"))
    for bad in (0, -2, -0.5):
        with pytest.raises(UserError, match="--save_every_minutes must be > 0, or -1"):
            check_stage_settings(dict(config, save_every_minutes=bad))


def test_stage_lines_time_each_section_from_the_one_before(isolated_env):
    """
    The run's summary (report.stage_lines): sections in the order they were written, whatever their names, each
    timed from the one before (the first from the report's start), with the first HEADLINES key it holds.
    """
    from nanochat import report
    directory = report.report_dir()
    with open(os.path.join(directory, "header.json"), "w") as f:
        json.dump({"Started": "2025-01-01 10:00:00", "environment": {"GPU count": 0}}, f)
    for slug, title, stamp, data in [("chat-rl", "Chat RL", "10:02:30",
                                      [{"pass@1": 0.1, "Mean reward, last steps": 0.25}]),
                                     ("base-model-training", "Base model training", "10:01:05",
                                      [{"CORE metric": 0.2}, "text", {"Final validation bpb": 1.23454}]),
                                     ("tokenizer-training", "Tokenizer training", "10:00:07", [{"vocab_size": 512}])]:
        with open(os.path.join(directory, f"{slug}.json"), "w") as f:
            json.dump(dict(section=title, timestamp=f"2025-01-01 {stamp}", run=1, made_from=None, data=data), f)
    assert report.stage_lines(directory) == [
        "  Tokenizer training           7 s",
        "  Base model training         58 s  Final validation bpb: 1.2345",
        "  Chat RL                     85 s  Mean reward, last steps: 0.2500",
    ]
