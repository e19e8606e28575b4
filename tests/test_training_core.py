"""
The training core the way a careless user meets it: each failure made to happen for real, its one-line answer.

Two runs on one checkpoint directory, a fresh run into a used tag, a swapped tokenizer, changed data settings on
resume, kills, NaNs, a full disk, resumes on another number of processes (N ranks equal one rank with
accumulation), and bad values of every kind. Each test checks the one-line answer and that nothing was lost.
"""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import (REPO_ROOT, TINY, TINY_SIZES, base_train, metrics, one_line_error, refusal_in_process, run_script,
                     speedrun_env, start_script, train_losses, wait_for_steps, weights, with_defaults)

from nanochat.output import UserError


def refused_in_process(module, args, *fragments):
    """
    `python -m <module> <args>` refuses its arguments before any work with a one-line UserError containing every
    fragment (checked inside this process: see conftest.refusal_in_process).
    """
    message = str(refusal_in_process(module, *args))
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# ---------------------------------------------------------------------------------------------
# Checkpoint directories


@pytest.mark.slow
def test_second_run_on_the_same_tag_is_refused_and_the_first_keeps_its_checkpoints(trained_tokenizer, isolated_env):
    args = with_defaults(TINY, ["--num_iterations=100000", "--eval_every=-1", "--save_every=2"])
    first = start_script("-m", "scripts.base_train", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ckpt = isolated_env / "base_checkpoints" / "d1"
    wait_for_steps(ckpt / "metrics.jsonl", 3, first)
    second = base_train("--num_iterations=4", "--overwrite")  # not even --overwrite may touch a directory in use
    line = one_line_error(second, f"{ckpt} is in use by another run", f"pid {first.pid}")
    assert "--model_tag" in line
    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 75, err
    meta = json.loads(max(ckpt.glob("meta_*.json")).read_text())
    assert meta["step"] >= 3 and meta["tokenizer"]["fingerprint"] and meta["data_settings"]["device_batch_size"] == 2
    for step in range(2, meta["step"], 2):  # every checkpoint the first run saved is there and complete
        assert (ckpt / f"model_{step:06d}.pt").exists() and (ckpt / f"meta_{step:06d}.json").exists()


@pytest.mark.slow
def test_fresh_run_into_a_used_tag_is_refused_unless_overwrite(tiny_model):
    isolated_env = tiny_model("base")  # an earlier run's checkpoints of steps 5 and 10 in base_checkpoints/d1
    ckpt = isolated_env / "base_checkpoints" / "d1"
    assert sorted(int(p.name[5:11]) for p in ckpt.glob("meta_*.json")) == [5, 10]
    again = base_train(*TINY_SIZES, "--num_iterations=10")
    one_line_error(again, "already holds checkpoints of an earlier run (steps 5, 10)", "--resume_from_step=10",
                   "--overwrite")
    # resuming from step 5 would mix in the earlier run's step 10 later: refused too
    one_line_error(base_train(*TINY_SIZES, "--num_iterations=12", "--resume_from_step=5"),
                   "holds checkpoints after step 5 (steps 10)")
    (ckpt / "model_000010.pt.tmp123").write_bytes(b"half a save")  # a save that was killed
    result = base_train("--num_iterations=3", "--overwrite")
    assert result.returncode == 0, result.stderr
    assert sorted(int(p.name[5:11]) for p in ckpt.glob("meta_*.json")) == [3]  # nothing of the earlier run left
    assert not list(ckpt.glob("*.tmp*"))
    assert [m["step"] for m in metrics(isolated_env) if "step_loss" in m] == [1, 2, 3]


def test_model_tag_must_be_a_name(trained_tokenizer, isolated_env):
    for tag in ("../escape", "/tmp/x", ".hidden", "a/b"):
        refused_in_process("scripts.base_train", with_defaults(TINY, ["--num_iterations=2", f"--model_tag={tag}"]),
                           "is not a plain name")
    assert not (isolated_env / "escape").exists() and not (isolated_env / "base_checkpoints").exists()


@pytest.mark.slow
def test_tokenizer_swap_and_data_setting_changes_are_refused(tiny_model):
    isolated_env = tiny_model("base")  # a checkpoint of step 10, sizes TINY_SIZES
    trained_tokenizer = isolated_env / "tokenizer"
    saved = json.loads((isolated_env / "base_checkpoints" / "d1" / "meta_000010.json").read_text())
    # a data setting that changes what every following step reads
    one_line_error(base_train(*TINY_SIZES, "--num_iterations=12", "--resume_from_step=10", "--data_seed=7"),
                   "was trained with data_seed=0, this run has data_seed=7", "--data_seed=0")
    one_line_error(base_train(*with_defaults(TINY_SIZES, ["--device_batch_size=2"]), "--num_iterations=12",
                              "--resume_from_step=10"),
                   "was trained with device_batch_size=4")
    # another tokenizer of the same vocabulary size: other merges, other ids
    from nanochat import dataset
    from nanochat.tokenizer import Tokenizer
    # other text, other merges
    other_texts = [doc[::-1] for docs in dataset.parquets_iter_batched("val") for doc in docs]
    other = Tokenizer.train_from_iterator(iter(other_texts), 512)
    shutil.rmtree(trained_tokenizer)
    other.save(str(trained_tokenizer))
    assert other.fingerprint() != saved["tokenizer"]["fingerprint"] and other.get_vocab_size() == 512
    line = one_line_error(base_train(*TINY_SIZES, "--num_iterations=12", "--resume_from_step=10"),
                          saved["tokenizer"]["fingerprint"], other.fingerprint())
    assert "was trained with tokenizer" in line
    loss = run_script("-m", "scripts.base_loss", "--device_batch_size=2", "--split_tokens=128")
    one_line_error(loss, "was trained with tokenizer", other.fingerprint())


@pytest.mark.slow
def test_unreadable_latest_checkpoint_falls_back_to_the_previous_one(tiny_model):
    isolated_env = tiny_model("base")  # checkpoints of steps 5 and 10
    path = isolated_env / "base_checkpoints" / "d1" / "model_000010.pt"
    path.write_bytes(path.read_bytes()[:1000])  # truncated, say by a full disk outside our control
    from nanochat.checkpoint_manager import load_model
    model, tokenizer, meta = load_model("base", "cpu", phase="eval")
    assert meta["step"] == 5
    loss = run_script("-m", "scripts.base_loss", "--device_batch_size=2", "--split_tokens=128")
    assert loss.returncode == 0, loss.stderr
    assert "WARNING: the latest checkpoint (step 10)" in loss.stdout and "step 5" in loss.stdout


def test_disk_full_save_leaves_no_partial_file(tmp_path, monkeypatch):
    from nanochat import checkpoint_manager
    from nanochat.checkpoint_manager import optimizer_shard
    from nanochat.gpt import GPT, GPTConfig
    model = GPT(GPTConfig(sequence_len=16, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, n_embd=32))
    model.init_weights()
    optimizers = model.setup_optimizers()
    real_save = torch.save
    calls = []

    def save_until_the_disk_is_full(obj, f):
        calls.append(1)
        if len(calls) == 2:  # the optimizer file fits, the model file does not
            f.write(b"x" * 5000)  # some bytes made it to disk before the error
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f)

    monkeypatch.setattr(checkpoint_manager.torch, "save", save_until_the_disk_is_full)
    ckpt = tmp_path / "ckpt"  # not tmp_path itself: it holds this test's base dir (the compute dtype's cache file)
    ckpt.mkdir()
    with pytest.raises(UserError, match=f"no space left on {ckpt}"):
        checkpoint_manager.save_checkpoint(str(ckpt), 7, model.state_dict(), optimizer_shard(optimizers, model), {})
    assert os.listdir(ckpt) == []  # neither the partial model file nor the optimizer file of the failed step


@pytest.mark.slow
def test_non_finite_loss_stops_without_saving_anything_newer(trained_tokenizer, isolated_env):
    result = base_train("--num_iterations=20", "--save_every=1", "--matrix_lr=1e38")
    line = one_line_error(result, "is not finite, training diverged", "--matrix_lr")
    failed_step = int(line.split("step ")[1].split(":")[0])
    ckpt = isolated_env / "base_checkpoints" / "d1"
    steps = sorted(int(p.name[5:11]) for p in ckpt.glob("meta_*.json"))
    assert steps and steps[-1] < failed_step
    for step in steps:  # every checkpoint that exists holds finite weights
        assert all(torch.isfinite(v).all() for v in weights(isolated_env, step).values())


def test_report_figures_have_sensible_precision_and_never_show_inf():
    from nanochat.output import format_value
    assert format_value(87.6195) == "87.6" and format_value(1.741234) == "1.7412" and format_value(12345.6) == "12,346"
    assert format_value(float("inf")) == "n/a" and format_value(float("-inf")) == "n/a"
    assert format_value(float("nan")) == "n/a"
    assert format_value(None) == "n/a" and format_value(3) == 3 and format_value("d4") == "d4"  # None: no grad norm


# ---------------------------------------------------------------------------------------------
# Resume on any world size (the optimizer state is re-sharded; the data of a step does not depend on it)


LOOKUP_BOUNDS = {"transformer.wte.weight": (1e-5, 1e-3), "value_embeds": (1e-3, 0.05)}  # (RMS relative, max abs)


def assert_same_training(a, b):
    """
    The weights of two fp32 runs whose steps added the same gradients up in another order. The matrices and lm_head
    agree to fp32 rounding (measured: max 2.2e-7). The embedding agrees as a whole (the RMS of the difference
    below 1e-5 of its RMS; measured: 9.1e-7 at most), but AdamW divides each entry's step by that entry's own
    gradient scale, which turns a last-bit difference of a small gradient into a larger one of a few entries
    (measured: 1.8e-4 at most, on an AMD EPYC with AVX-512, where the bound used before, 1e-4 relative + 1e-5,
    allowed 1.6e-4 for that entry). The value embeddings, lookup tables too, more so: their gradients come through
    a gate, are smaller, and their lr is high at this width (0.5): measured RMS 1.2e-4 of theirs, 0.011 at most.
    """
    for k in a:
        difference = a[k] - b[k]
        if k in LOOKUP_BOUNDS or k.startswith("value_embeds."):
            rms_bound, max_bound = LOOKUP_BOUNDS.get(k, LOOKUP_BOUNDS["value_embeds"])
            assert difference.pow(2).mean().sqrt() < rms_bound * a[k].pow(2).mean().sqrt(), k
            assert difference.abs().max() < max_bound, k
        else:
            assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5), (k, difference.abs().max().item())


@pytest.mark.slow
def test_resume_on_another_number_of_processes_reproduces_the_uninterrupted_run(trained_tokenizer, isolated_env,
                                                                                 monkeypatch):
    # fp32: 6 micro-steps on one rank, 3 on each of 2 or 2 on each of 3 add the same gradients up in other orders,
    # equal to fp32 rounding; bf16 would grow those last bits (the bit-exact split in bf16: test_base_train)
    monkeypatch.setenv("NANOCHAT_DTYPE", "float32")
    # Without Muon's cautious weight decay: it decays an entry only where update and weight agree in sign, a step
    # function, so a rounding-level difference of an update near 0 flips it for that entry (lr x decay x weight,
    # ~1e-3, not 1e-7). With it, equal placements are still exact (test_base_train, recipe2026 and defaults).
    # 6 data slots: 1, 2 or 3 ranks
    args = ["--total_batch_size=384", "--num_iterations=6", "--save_every=3", "--matrix_weight_decay=0"]
    full = base_train(*args, "--model_tag=full")
    assert full.returncode == 0, full.stderr
    assert "gradient accumulation steps: 6" in full.stdout
    full_losses = train_losses(isolated_env, "full")
    ckpts = isolated_env / "base_checkpoints"

    # 2 ranks x 3 micro-steps == 1 rank x 6 micro-steps: the 6 data slots of a step went to the ranks instead of
    # to the micro-steps; same losses, same weights
    two = run_script("-m", "scripts.base_train", *with_defaults(TINY, args + ["--model_tag=two_then_one"]), nproc=2)
    assert two.returncode == 0, two.stderr
    assert "gradient accumulation steps: 3" in two.stdout
    rows = [m for m in metrics(isolated_env, "two_then_one") if "step_loss" in m]
    for m in rows:  # the logged loss is the mean over ranks, and the ranks saw different data
        assert m["step_loss"] == pytest.approx(sum(m["rank_losses"]) / 2, abs=1e-6)
    assert all(m["rank_losses"][0] != m["rank_losses"][1] for m in rows[1:])  # (step 1: both exactly ln(vocab))
    assert [m["step_loss"] for m in rows] == pytest.approx(full_losses, rel=1e-5)
    assert_same_training(weights(isolated_env, 6, "full"), weights(isolated_env, 6, "two_then_one"))
    assert os.path.exists(ckpts / "two_then_one" / "optim_000006_rank1.pt")  # every rank's optimizer shard

    # 2 ranks for 3 steps, then 1 rank
    for f in ckpts.glob("two_then_one/*000006*"):
        f.unlink()
    one = base_train(*args, "--model_tag=two_then_one", "--resume_from_step=3")
    assert one.returncode == 0, one.stderr
    assert "Resuming a run of 2 process(es) on 1" in one.stdout
    assert train_losses(isolated_env, "two_then_one") == pytest.approx(full_losses, rel=1e-5)
    assert_same_training(weights(isolated_env, 6, "full"), weights(isolated_env, 6, "two_then_one"))

    # 1 rank for 3 steps (the full run's step-3 checkpoint), then 3 ranks
    shutil.copytree(ckpts / "full", ckpts / "one_then_three", ignore=shutil.ignore_patterns("*000006*", ".lock"))
    three = run_script("-m", "scripts.base_train",
                       *with_defaults(TINY, args + ["--model_tag=one_then_three", "--resume_from_step=3"]), nproc=3)
    assert three.returncode == 0, three.stderr
    assert "Resuming a run of 1 process(es) on 3" in three.stdout
    assert train_losses(isolated_env, "one_then_three") == pytest.approx(full_losses, rel=1e-5)
    assert_same_training(weights(isolated_env, 6, "full"), weights(isolated_env, 6, "one_then_three"))


# ---------------------------------------------------------------------------------------------
# Bad values: refused before any work, with one line


@pytest.mark.parametrize("args, fragment", [
    (["--depth=0"], "--depth must be > 0"),
    (["--max_seq_len=-5"], "--max_seq_len must be > 0"),
    (["--device_batch_size=0"], "--device_batch_size must be > 0"),
    (["--total_batch_size=-128"], "--total_batch_size must be > 0"),
    (["--num_iterations=0"], "--num_iterations must be > 0, or -1"),
    (["--eval_tokens=0"], "--eval_tokens must be > 0, or -1"),
    (["--matrix_lr=-0.1"], "--matrix_lr must be >= 0"),
    (["--embedding_lr=inf"], "--embedding_lr expects a finite number"),
    (["--warmdown_ratio=1.5"], "--warmdown_ratio must be between 0 and 1"),
    (["--warmup_ratio=0.5", "--warmdown_ratio=0.6"], "warmup and the warmdown would overlap"),
    (["--compile=yes"], "--compile must be one of auto, true, false"),
    (["--depth=2", "--depth=3"], "--depth is given twice"),
    (["--resume_from_step=-3"], "--resume_from_step must be"),
])
def test_bad_values_are_refused_with_one_line(trained_tokenizer, isolated_env, args, fragment):
    refused_in_process("scripts.base_train", with_defaults(TINY, args), fragment)
    assert not (isolated_env / "base_checkpoints").exists()  # refused before any work


def test_bad_mid_train_values_are_refused_with_one_line(trained_tokenizer, isolated_env):
    for args, fragment in ((["--max_conversations=0"], "--max_conversations must be > 0, or -1"),
                           (["--init_lr_frac=0"], "--init_lr_frac must be > 0"),
                           (["--num_iterations=0"], "--num_iterations must be > 0, or -1")):
        refused_in_process("scripts.mid_train", args, fragment)
    # and as the user sees it: one line on stderr, exit status 1
    one_line_error(run_script("-m", "scripts.mid_train", "--mixture=fineweb", timeout=120),
                   "--mixture must be one of real, offline")
    assert not (isolated_env / "mid_checkpoints").exists()


@pytest.mark.slow
def test_environment_problems_get_one_line(trained_tokenizer, isolated_env, tmp_path):
    train = ["-m", "scripts.base_train", *with_defaults(TINY, ["--num_iterations=2"])]
    # NANOCHAT_BASE_DIR is a file / not writable
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    result = run_script(*train, env={"NANOCHAT_BASE_DIR": not_a_dir})
    one_line_error(result, "is a file, not a directory")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    if os.access(read_only, os.W_OK):  # root writes anywhere: use a directory the kernel refuses writes to
        read_only = next((d for d in ("/sys/kernel", "/proc/sys") if os.path.isdir(d) and not _writable(d)), None)
    if read_only is not None:
        result = run_script(*train, env={"NANOCHAT_BASE_DIR": read_only})
        one_line_error(result, "is not writable")
    # --run without a wandb login
    no_login = {"HOME": tmp_path, "NETRC": tmp_path / "no_netrc", "WANDB_MODE": None, "WANDB_API_KEY": None}
    result = run_script(*train, "--run=my-run", env=no_login)
    one_line_error(result, "wandb has no login", "wandb login", "WANDB_MODE=offline")
    # a garbage tokenizer.json, then a garbage token_bytes.pt
    meta = trained_tokenizer / "tokenizer.json"
    good = meta.read_bytes()
    meta.write_text("{ this is not json")
    one_line_error(run_script(*train), "tokenizer.json", "python -m scripts.tok_train")
    meta.write_bytes(good)
    (trained_tokenizer / "token_bytes.pt").write_bytes(b"garbage")
    one_line_error(run_script(*train), "token_bytes.pt is unreadable")
    # --help into a pipe that closes early
    shell = f"{sys.executable} -m scripts.base_train --help | head -2"
    result = subprocess.run(["bash", "-c", f"set -o pipefail; {shell}"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "" and len(result.stdout.splitlines()) == 2


def _writable(directory):
    import tempfile
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def test_unreachable_host_fails_fast_with_the_command_to_retry(isolated_env):
    from nanochat.downloads import download_file_with_lock
    t0 = time.time()
    with pytest.raises(UserError) as e:
        download_file_with_lock("http://127.0.0.1:9/shard.parquet", "x/shard.parquet",
                                retry_command="python -m nanochat.dataset -n 8")
    assert time.time() - t0 < 5
    assert "cannot reach 127.0.0.1:9" in str(e.value) and "`python -m nanochat.dataset -n 8`" in str(e.value)


def test_damaged_middle_of_a_shard_is_caught_and_the_rebuild_replaces_it(pydocs_corpus):
    from nanochat import dataset
    path = sorted(p for p in os.listdir(pydocs_corpus) if p.startswith("shard_"))[0]
    path = os.path.join(pydocs_corpus, path)
    data = bytearray(open(path, "rb").read())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(64)  # the footer is intact: only a full check sees it
    open(path, "wb").write(bytes(data))
    dataset.check_shard(path)  # the cheap footer check passes
    dataset._verified.clear()
    with pytest.raises(UserError) as e:
        dataset.read_row_group(path, 0)
    assert path in str(e.value) and "NANOCHAT_DATASET=pydocs python -m nanochat.dataset" in str(e.value)
    rebuild = run_script("-m", "nanochat.dataset")
    assert rebuild.returncode == 0, rebuild.stderr
    assert "damaged; rebuilding" in rebuild.stderr
    dataset._verified.clear()
    assert len(dataset.read_row_group(path, 0)) > 0  # the advice worked


# ---------------------------------------------------------------------------------------------
# An interrupted stage stops the speedrun


@pytest.mark.slow
def test_interrupted_stage_exits_non_zero_and_speedrun_stops(pydocs_corpus, isolated_env, tmp_path):
    # (the corpus is there already: `python -m nanochat.dataset` checks it and goes on)
    proc = start_script(os.path.join(REPO_ROOT, "speedrun.sh"), cwd=tmp_path, env=speedrun_env(BASE_STEPS="100000"),
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    for line in proc.stdout:  # wait until base training is in its loop, then Ctrl-C the whole pipeline
        lines.append(line)
        if line.startswith("step 00002/"):
            os.killpg(proc.pid, signal.SIGINT)
            break
    lines += proc.stdout.readlines()
    proc.wait(timeout=300)
    out = "".join(lines)
    assert proc.returncode != 0, out[-3000:]
    assert "got SIGINT" in out and "Run the same command again to continue" in out
    assert "speedrun: done" not in out and not (isolated_env / "mid_checkpoints").exists()  # mid_train never started
    assert not (tmp_path / "report.md").exists()
