"""
Rerun = resume (nanochat/rerun.py, speedrun.sh): `bash speedrun.sh` run again after any interruption finishes the
pipeline, doing no finished work twice. The cpu profile's smoke, in fp32, is interrupted inside every training stage
and an evaluation, by SIGTERM, SIGINT (the whole pipeline, as Ctrl-C) and SIGKILL, each time run again: the stages
done before are skipped, the interrupted one resumes from its last checkpoint, and the final weights of every stage
equal those of a run never interrupted, with every report section once. Then a run after a complete one skips
everything, and a changed setting runs its stage and the ones after it again. The same interruptions, in other
places, under torchrun on 2 CPU processes (the gpu profile's smoke, NPROC=2), against a run never interrupted.
"""

import json
import os
import shutil
import signal
import subprocess

import pytest
import torch

from helpers import REPO_ROOT, run_script, speedrun_env, start_script

# Steps of every training stage, all different (so that a step line says which stage printed it); a periodic save
# after every step (SAVE_MINUTES), so that a SIGKILL finds a checkpoint to resume from
SIZES = dict(BASE_STEPS="6", MID_STEPS="5", SFT_STEPS="4", RL_STEPS="3", NANOCHAT_DTYPE="float32")
STAGES = ["Tokenizer training", "Tokenizer evaluation", "Base model training", "Base model loss",
          "Base model evaluation", "Midtraining", "Chat evaluation mid", "Chat SFT", "Chat evaluation sft", "Chat RL",
          "Chat evaluation rl"]
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


@pytest.mark.slow
def test_the_cpu_pipeline_interrupted_everywhere_and_rerun(pydocs_corpus, isolated_env, tmp_path):
    # the pipeline never interrupted, in a base dir of its own (the same corpus)
    reference = tmp_path / "reference"
    shutil.copytree(isolated_env / "base_data", reference / "base_data")
    (tmp_path / "ref_cwd").mkdir()
    code, out = speedrun(tmp_path / "ref_cwd", speedrun_env(NANOCHAT_BASE_DIR=str(reference), **SIZES))
    assert code == 0, out[-3000:]

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

    # FRESH=1 starts over, naming what it deletes
    code, out = speedrun(tmp_path, dict(env, FRESH="1"))
    assert code == 0 and f"deleting {isolated_env / 'report'}" in out and "done at" not in out, out[-3000:]
    assert len(json.loads((isolated_env / "report" / "runs.json").read_text())) == 1


@pytest.mark.slow
def test_the_gpu_pipeline_on_two_processes_interrupted_everywhere_and_rerun(pydocs_corpus, isolated_env, tmp_path):
    # every stage through torchrun on 2 CPU processes (gloo); many steps per training stage, so that a signal sent
    # when a step line comes through torchrun's pipe still lands inside the stage
    sizes = dict(VOCAB="512", DEPTH="1", SEQ="128", ROWS="4", BASE_STEPS="30", MID_STEPS="40", SFT_STEPS="20",
                 RL_STEPS="3", EVAL_STEPS="1", CORE_EXAMPLES="4", CHAT_PROBLEMS="4", RL_SAMPLES="2",
                 MAX_NEW_TOKENS="32", NANOCHAT_DTYPE="float32", NPROC="2")
    offline = dict.fromkeys(("NANOCHAT_DATA_URL", "NANOCHAT_EVAL_BUNDLE_URL", "NANOCHAT_HF_URL"), "http://127.0.0.1:9")
    reference = tmp_path / "reference"
    shutil.copytree(isolated_env / "base_data", reference / "base_data")
    (tmp_path / "ref_cwd").mkdir()
    code, out = speedrun(tmp_path / "ref_cwd", speedrun_env("gpu", NANOCHAT_BASE_DIR=str(reference), **sizes,
                                                           **offline))
    assert code == 0, out[-3000:]

    env = speedrun_env("gpu", SAVE_MINUTES="0.0001", **sizes, **offline)
    # Ctrl-C (SIGINT to torchrun, both ranks and the shell) in base training
    code, out = interrupted(tmp_path, env, "step 00002/00030", signal.SIGINT)
    assert code != 0 and "got SIGINT" in out, out[-3000:]
    # SIGTERM to midtraining's torchrun, which passes it to both ranks: they save and stop
    code, out = interrupted(tmp_path, env, "step 00002 (", signal.SIGTERM, stage="mid_train")
    assert code != 0 and "Base model training: resuming from step" in out and "got SIGTERM" in out, out[-3000:]
    # SIGKILL to everything in SFT (midtraining resumes first, its step lines going on after the step it stopped at)
    code, out = interrupted(tmp_path, env, "step 00002 (", signal.SIGKILL)
    assert code != 0 and "Midtraining: resuming from step" in out, out[-3000:]
    # SIGKILL to everything in RL, then SIGTERM to everything in the last evaluation
    code, out = interrupted(tmp_path, env, "step 00002/00003", signal.SIGKILL)
    assert code != 0 and "Chat SFT: resuming from step" in out, out[-3000:]
    code, out = interrupted(tmp_path, env, "Evaluating rl model", signal.SIGTERM)
    assert code != 0 and "Chat SFT: done at" in out, out[-3000:]
    code, out = speedrun(tmp_path, env)
    assert code == 0 and "speedrun: done" in out and "Chat RL: done at" in out, out[-3000:]
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


def test_report_sections_say_which_run_made_them(isolated_env):
    from nanochat.report import get_report, run_label, start
    from nanochat.rerun import done_before, made_before
    assert "run 1" in start() and run_label() == "1 (first run)"
    get_report().log("Chat evaluation sft", [{"accuracy": 0.5}], made_from="f" * 16)
    assert made_before("Chat evaluation sft")[0] == "f" * 16
    assert "rerun" in start() and run_label() == "2 (rerun)"
    assert done_before("Chat evaluation sft", "f" * 16) and not done_before("Chat evaluation sft", "e" * 16)
    assert not done_before("Chat evaluation sft", "f" * 16, outputs=[str(isolated_env / "missing")])
    assert not done_before("Chat evaluation mid", "f" * 16)
    text = (isolated_env / "report" / "chat-evaluation-sft.md").read_text()
    assert "- Run: 1 (first run)" in text and "- Made from: ffffffffffffffff" in text
    # a training stage stopped early wrote its section: not done
    get_report().log("Chat SFT", [{"Stopped early": True}], made_from="f" * 16)
    assert made_before("Chat SFT") is None


def test_a_training_stage_plans_from_its_checkpoints_and_its_section(isolated_env):
    from nanochat.report import get_report
    from nanochat.rerun import training_plan
    directory = isolated_env / "mid_checkpoints" / "d1"
    assert training_plan("mid", "Midtraining", str(directory), "a" * 16) == ("fresh", None)
    directory.mkdir(parents=True)
    for step, made in ((2, "a" * 16), (4, "a" * 16)):
        (directory / f"meta_{step:06d}.json").write_text(json.dumps({"made_from": made}))
    assert training_plan("mid", "Midtraining", str(directory), "a" * 16) == ("resume", 4)
    assert training_plan("mid", "Midtraining", str(directory), "b" * 16) == ("replace", [2, 4])
    get_report().log("Midtraining", [{"Stopped early": False}], made_from="a" * 16)
    assert training_plan("mid", "Midtraining", str(directory), "a" * 16) == ("done", 4)
    # the last checkpoint made otherwise (a later run of other settings): not done, replaced
    (directory / "meta_000006.json").write_text(json.dumps({"made_from": "b" * 16}))
    assert training_plan("mid", "Midtraining", str(directory), "a" * 16)[0] == "replace"


def test_forget_names_what_it_deletes_and_keeps_the_data(isolated_env, capsys):
    from nanochat.rerun import forget
    for folder in ("report", "tokenizer", "base_checkpoints/d1", "base_data/pydocs"):
        (isolated_env / folder).mkdir(parents=True)
    gone = forget()
    out = capsys.readouterr().out
    assert sorted(os.path.basename(p) for p in gone) == ["base_checkpoints", "report", "tokenizer"]
    assert all(f"deleting {p}" in out for p in gone) and (isolated_env / "base_data" / "pydocs").is_dir()


def test_rerun_and_save_every_minutes_are_checked(isolated_env):
    from nanochat.common import UserError
    from nanochat.stage import check_stage_settings
    config = dict(resume_from_step=-1, warmup_ratio=0.0, warmdown_ratio=0.2, model_tag="")
    check_stage_settings(dict(config, rerun="auto", save_every_minutes=0.5))
    with pytest.raises(UserError, match="--rerun must be one of no, auto"):
        check_stage_settings(dict(config, rerun="yes"))
    for bad in (0, -2, -0.5):
        with pytest.raises(UserError, match="--save_every_minutes must be > 0, or -1"):
            check_stage_settings(dict(config, save_every_minutes=bad))
