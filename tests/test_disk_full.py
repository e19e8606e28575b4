"""
A full disk is one line and loses nothing: checkpoints, corpus shards and downloads written where space runs out.

Each write runs out of space for real where this machine lets a test mount a small tmpfs (as root; skipped
elsewhere), and always through an injected failure (tests/write_fault.py: a file that takes N bytes, then fails its
next write with ENOSPC, as a full disk does, inside torch.save or json.dump). Each checks the one line (where, how
much it needs, how much is free, what to do), that no temporary file is left, that what was there before is intact,
and that the same command, once there is space, continues. A save killed half-way (SIGKILL inside it) damages nothing
either.
"""

import builtins
import errno
import os
import re
import shutil
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from helpers import REPO_ROOT, TINY, run_in_process, run_script, weights, with_defaults
from nanochat import corpus_build, dataset, downloads, files
from nanochat.checkpoint_manager import complete_steps, load_checkpoint, optimizer_shard, save_checkpoint
from nanochat.downloads import download_file_with_lock
from nanochat.files import DiskFull
from nanochat.gpt import GPT, GPTConfig
from write_fault import FaultyFile

WRAPPER = os.path.join(REPO_ROOT, "tests", "write_fault.py")


@pytest.fixture
def small_fs(tmp_path):
    """
    mount(size): a directory that is a tmpfs of `size` bytes, unmounted after the test; resize(path, size) gives it
    another size (space freed). The test is skipped where mounting is not allowed (not root, a container without
    the capability).
    """
    mounted = []

    def mount(size):
        path = tmp_path / f"fs{len(mounted)}"
        path.mkdir()
        if shutil.which("mount") is None:
            pytest.skip("no mount command")
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=True)


def resize(path, size):
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


def model_and_optimizers(seed):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(sequence_len=16, vocab_size=128, n_layer=2, n_head=2, n_kv_head=1, n_embd=64))
    model.init_weights()
    return model, model.setup_optimizers()


def save(directory, step, model, optimizers):
    meta = dict(model_config=model.config.to_dict(), user_config=dict(depth=2))
    save_checkpoint(str(directory), step, model.state_dict(), optimizer_shard(optimizers, model), meta)


STEP_1_FILES = ["meta_000001.json", "model_000001.pt", "optim_000001_rank0.pt"]


def assert_disk_full_line(message, directory, *fragments):
    """The one line of a full disk: where, how much it needs, how much is free there, and the fragments."""
    assert "\n" not in message, message
    assert message.startswith(f"no space left on {directory} while writing "), message
    assert re.search(r"it needs (about|up to) \d+(\.\d)? [KMG]?B", message), message
    assert re.search(r"\d+(\.\d)? [KMG]?B free there; nothing partial was kept", message), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def assert_step_1_intact(directory, model):
    assert sorted(os.listdir(directory)) == STEP_1_FILES  # nothing of the failed step, no temporary file
    assert complete_steps(str(directory)) == [1]
    state, _, meta = load_checkpoint(str(directory), 1, "cpu", load_optimizer=True)
    assert meta["step"] == 1
    for k, v in model.state_dict().items():
        assert torch.equal(state[k], v), k


def faulty_open(pattern, budget, fault="ENOSPC"):
    """An open() whose first file opened for writing whose name matches `pattern` fails like a full disk."""
    armed = [True]

    def open_(file, mode="r", *args, **kwargs):
        f = builtins.open(file, mode, *args, **kwargs)
        if armed[0] and "w" in mode and re.search(pattern, os.path.basename(file)):
            armed[0] = False
            return FaultyFile(f, budget, fault)
        return f
    return open_


# ---------------------------------------------------------------------------------------------
# Checkpoints


def test_checkpoint_on_a_full_filesystem(small_fs, tmp_path):
    first, first_opts = model_and_optimizers(0)
    second, second_opts = model_and_optimizers(1)
    save(tmp_path / "measure", 1, first, first_opts)
    size = sum(p.stat().st_size for p in (tmp_path / "measure").iterdir())
    fs = small_fs(int(size * 1.5))  # room for one checkpoint, not two
    ckpt = fs / "d2"
    save(ckpt, 1, first, first_opts)
    with pytest.raises(DiskFull) as failed:
        save(ckpt, 2, second, second_opts)
    assert_disk_full_line(str(failed.value), ckpt, "the checkpoint of step 2", "resume from step 1, which is intact",
                          "--resume_from_step=1")
    assert_step_1_intact(ckpt, first)
    resize(fs, size * 3)  # space freed: the same save now succeeds
    save(ckpt, 2, second, second_opts)
    assert complete_steps(str(ckpt)) == [1, 2]


@pytest.mark.parametrize("fault", ["ENOSPC", "EDQUOT"])
@pytest.mark.parametrize("where", ["optim_000002", "model_000002", "meta_000002"])
def test_checkpoint_write_that_runs_out_of_space(tmp_path, monkeypatch, where, fault):
    model, optimizers = model_and_optimizers(0)
    ckpt = tmp_path / "ckpt"  # not tmp_path itself: it holds this test's base dir
    save(ckpt, 1, model, optimizers)
    monkeypatch.setattr(files, "open", faulty_open(where, 100, fault), raising=False)  # atomic_write's open
    other, other_opts = model_and_optimizers(1)
    with pytest.raises(DiskFull) as failed:
        save(ckpt, 2, other, other_opts)
    reason = "no space left" if fault == "ENOSPC" else "disk quota exceeded"
    message = str(failed.value)
    assert_disk_full_line(message.replace(reason, "no space left", 1), ckpt, "the checkpoint of step 2",
                          "--resume_from_step=1")
    assert message.startswith(reason)
    assert_step_1_intact(ckpt, model)


def test_first_checkpoint_that_runs_out_of_space(tmp_path, monkeypatch):
    model, optimizers = model_and_optimizers(0)
    monkeypatch.setattr(files, "open", faulty_open("model_", 100), raising=False)
    with pytest.raises(DiskFull) as failed:
        save(tmp_path / "ckpt", 1, model, optimizers)
    assert_disk_full_line(str(failed.value), tmp_path / "ckpt", "free space, then run the same command again")
    assert os.listdir(tmp_path / "ckpt") == []


def base_train(*args, wrapper=(), nproc=1, env=None):
    """base_train on the tiny model, started as `python <wrapper...> scripts.base_train` when a wrapper is given."""
    args = with_defaults(TINY, ["--eval_every=-1", "--save_every=2", *args])
    if wrapper:
        return run_script(WRAPPER, *wrapper, "scripts.base_train", *args, nproc=nproc, env=env, timeout=300)
    return run_script("-m", "scripts.base_train", *args, nproc=nproc, env=env, timeout=300)


def training_ends_on_a_full_disk(result, ckpt, ranks=1):
    """The run ended with the one line of a full disk on each rank, and the checkpoint of step 2 is untouched."""
    assert result.returncode != 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "error: " in line]
    assert len(lines) == ranks, result.stderr[-3000:]
    # no rank's traceback: no frame of this checkout's code (torchrun's own frames, under .venv, may be there)
    roots = "|".join(re.escape(root) for root in {REPO_ROOT, os.path.realpath(REPO_ROOT)})
    ours = f"({roots})/(nanochat|scripts)/"
    assert not re.search(r'File "' + ours, result.stderr), result.stderr[-3000:]
    for line in lines:
        assert_disk_full_line(line.split("error: ", 1)[1], ckpt, "the checkpoint of step 4",
                              "resume from step 2, which is intact", "--resume_from_step=2")
    if ranks == 1:
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr[-3000:]
    assert complete_steps(str(ckpt)) == [2]
    assert not [n for n in os.listdir(ckpt) if ".tmp" in n or "000004" in n], os.listdir(ckpt)


@pytest.mark.slow
def test_training_stage_on_a_full_disk_ends_in_one_line_and_resumes(trained_tokenizer, isolated_env):
    ckpt = isolated_env / "base_checkpoints" / "d1"
    full = base_train("--num_iterations=6", wrapper=("model_000004", "65536", "ENOSPC"))
    training_ends_on_a_full_disk(full, ckpt)
    before = weights(isolated_env, 2)
    assert all(torch.isfinite(v).all() for v in before.values())
    resumed = base_train("--num_iterations=6", "--resume_from_step=2")  # space freed: the same run continues
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed from step 2" in resumed.stdout
    assert complete_steps(str(ckpt)) == [2, 4, 6]
    assert all(torch.equal(before[k], v) for k, v in weights(isolated_env, 2).items())


@pytest.mark.slow
def test_training_on_a_full_filesystem_resumes_to_the_same_weights(small_fs, trained_tokenizer, isolated_env,
                                                                   monkeypatch):
    monkeypatch.setenv("NANOCHAT_DTYPE", "float32")  # a resume is exact in fp32
    whole = base_train("--num_iterations=6", "--model_tag=whole")  # uninterrupted; its checkpoints' size
    assert whole.returncode == 0, whole.stderr[-3000:]
    size = sum(p.stat().st_size for p in (isolated_env / "base_checkpoints" / "whole").glob("*_000002*"))
    ckpt = isolated_env / "base_checkpoints" / "d1"
    fs = small_fs(int(size * 1.6))
    os.symlink(fs, ckpt)  # the run's checkpoint directory is the small filesystem: room for one checkpoint
    training_ends_on_a_full_disk(base_train("--num_iterations=6"), ckpt)
    resize(fs, size * 4)  # space freed
    resumed = base_train("--num_iterations=6", "--resume_from_step=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert complete_steps(str(ckpt)) == [2, 4, 6]
    final = weights(isolated_env, 6)
    assert all(torch.equal(final[k], v) for k, v in weights(isolated_env, 6, tag="whole").items())


@pytest.mark.slow
def test_training_stage_on_a_full_disk_under_torchrun_ends_every_rank(trained_tokenizer, isolated_env):
    ckpt = isolated_env / "base_checkpoints" / "d1"
    # rank 1's optimizer shard does not fit: rank 0, whose files did, must not wait for it (nor write the marker)
    full = base_train("--num_iterations=6", wrapper=("optim_000004", "4096", "ENOSPC"), nproc=2,
                      env=dict(WRITE_FAULT_RANK=1))
    training_ends_on_a_full_disk(full, ckpt, ranks=2)
    assert "[rank 0] error: no space left" in full.stderr and "[rank 1] error: no space left" in full.stderr
    resumed = base_train("--num_iterations=6", "--resume_from_step=2", nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert complete_steps(str(ckpt)) == [2, 4, 6]


@pytest.mark.slow
def test_a_save_killed_half_way_keeps_the_previous_checkpoint(trained_tokenizer, isolated_env):
    ckpt = isolated_env / "base_checkpoints" / "d1"
    killed = base_train("--num_iterations=6", wrapper=("model_000004", "65536", "SIGKILL"))
    assert killed.returncode == -9, killed.stderr[-3000:]  # killed inside the write of the model file of step 4
    assert complete_steps(str(ckpt)) == [2]
    assert [n for n in os.listdir(ckpt) if ".tmp" in n], "the kill came after the save, not inside it"
    before = weights(isolated_env, 2)
    resumed = base_train("--num_iterations=6", "--resume_from_step=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Removed the files of step(s) 4" in resumed.stdout  # its optimizer file, complete but without a meta file
    assert complete_steps(str(ckpt)) == [2, 4, 6]
    assert not [n for n in os.listdir(ckpt) if ".tmp" in n]  # the killed save's temporary file is gone
    assert all(torch.equal(before[k], v) for k, v in weights(isolated_env, 2).items())


# ---------------------------------------------------------------------------------------------
# Corpus shards and downloads


def own_text(tmp_path, name, docs):
    src = tmp_path / name
    src.mkdir()
    for i in range(docs):
        (src / f"doc{i:04d}.txt").write_text(f"Document {i} of {name}: " + os.urandom(300).hex())
    return src


def assert_corpus_intact(final, manifest):
    assert corpus_build.read_manifest(str(final)) == manifest
    assert corpus_build._intact(str(final), manifest)
    assert not [n for n in os.listdir(final.parent) if ".tmp" in n or ".old" in n], os.listdir(final.parent)


def test_corpus_build_on_a_full_filesystem(small_fs, tmp_path):
    fs = small_fs(1_000_000)
    final = fs / "mine"
    old, _ = corpus_build.build_own_corpus(str(final), "mine", [str(own_text(tmp_path, "a", 100))])
    with pytest.raises(DiskFull) as failed:  # 2.5 MB of hex digits, ~1.3 MB compressed: more than is left
        corpus_build.build_own_corpus(str(final), "mine", [str(own_text(tmp_path, "b", 4000))])
    assert_disk_full_line(str(failed.value), fs, "the corpus mine", "(the text, before compression)",
                          "python -m nanochat.dataset --from=")
    assert_corpus_intact(final, old)
    resize(fs, 20_000_000)
    new, built = corpus_build.build_own_corpus(str(final), "mine", [str(own_text(tmp_path, "c", 2000))])
    assert built and new["documents"] == 2000
    assert_corpus_intact(final, new)


def test_corpus_shard_write_that_runs_out_of_space(tmp_path, monkeypatch):
    final = tmp_path / "corpora" / "mine"
    old, _ = corpus_build.build_own_corpus(str(final), "mine", [str(own_text(tmp_path, "a", 100))])
    real_write_table = pq.write_table
    written = []

    def write_table(table, where, **kwargs):  # the first shard fits, the second does not
        written.append(where)
        if len(written) == 2:
            real_write_table(table.slice(0, 1), where, **kwargs)  # some bytes made it to disk
            raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")
        real_write_table(table, where, **kwargs)

    monkeypatch.setattr(corpus_build.pq, "write_table", write_table)
    monkeypatch.setattr(corpus_build, "OWN_SHARD_DOCS", 50)
    with pytest.raises(DiskFull) as failed:
        corpus_build.build_own_corpus(str(final), "mine", [str(own_text(tmp_path, "b", 200))])
    assert_disk_full_line(str(failed.value), final.parent, "the corpus mine")
    assert_corpus_intact(final, old)
    monkeypatch.setattr(corpus_build.pq, "write_table", real_write_table)
    new, built = corpus_build.build_own_corpus(str(final), "mine", [str(tmp_path / "b")])
    assert built and new["documents"] == 200
    assert_corpus_intact(final, new)


def test_download_that_runs_out_of_space_fails_at_once(file_server, isolated_env, monkeypatch):
    data = os.urandom(2_000_000)
    with open(os.path.join(file_server.root, "big.bin"), "wb") as f:
        f.write(data)
    monkeypatch.setattr(downloads, "open", faulty_open(r"big\.bin\.tmp", 500_000), raising=False)
    with pytest.raises(DiskFull) as failed:
        download_file_with_lock(f"{file_server.url}/big.bin", "dl/big.bin", backoff=0.01)
    assert_disk_full_line(str(failed.value), isolated_env / "dl", "big.bin", "it needs about 1.9 MB")
    assert file_server.requests["/big.bin"] == 1  # not retried: another attempt would fill the disk again
    assert os.listdir(isolated_env / "dl") == ["big.bin.lock"]
    monkeypatch.delattr(downloads, "open")  # space freed
    path = download_file_with_lock(f"{file_server.url}/big.bin", "dl/big.bin")
    assert open(path, "rb").read() == data


def test_shard_downloads_that_run_out_of_space_stop_in_one_line(file_server, monkeypatch):
    for s in range(4):
        pq.write_table(pa.table({"text": [f"doc {j} of shard {s} " + "x" * 1000 for j in range(20)]}),
                       os.path.join(file_server.root, dataset.shard_name(s)))
    monkeypatch.setenv("NANOCHAT_DATA_URL", file_server.url)
    monkeypatch.setenv("NANOCHAT_DATA_SHARDS", "4")
    monkeypatch.delenv("NANOCHAT_DATASET", raising=False)
    monkeypatch.setattr(downloads, "open", faulty_open(r"shard_00001\.parquet\.tmp", 1000), raising=False)
    with pytest.raises(DiskFull) as failed:
        dataset.download_shards(3, workers=1)
    assert_disk_full_line(str(failed.value), dataset.data_dir(), "shard_00001.parquet",
                          "python -m nanochat.dataset -n 3")
    names = os.listdir(dataset.data_dir())
    assert "shard_00000.parquet" in names and "shard_00001.parquet" not in names, names
    assert not [n for n in names if ".tmp" in n], names
    monkeypatch.delattr(downloads, "open")  # space freed
    dataset.download_shards(3, workers=1)  # what is missing, nothing twice
    assert file_server.requests == {f"/{dataset.shard_name(s)}": 2 if s == 1 else 1 for s in range(4)}
    assert dataset.list_parquet_files("train") == [os.path.join(dataset.data_dir(), dataset.shard_name(s))
                                                   for s in range(3)]


def test_export_on_a_full_filesystem(small_fs, tiny_models, monkeypatch):
    """export_model into a filesystem too small for the weights: one line, nothing left there; with space, it works."""
    fs = small_fs(64 * 1024)
    out = fs / "export"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tiny_models("mid")))
    with pytest.raises(DiskFull) as failed:
        run_in_process("scripts.export_model", "--source=mid", f"--out={out}", "--dtype=float32",
                       monkeypatch=monkeypatch)
    message = str(failed.value)
    assert "\n" not in message and message.startswith(f"no space left on {fs} while writing --out={out}"), message
    assert "free there; nothing partial was kept): nothing was changed there" in message
    assert os.listdir(fs) == []  # no half-written directory, no temporary one
    resize(fs, 64 * 1024 * 1024)
    run_in_process("scripts.export_model", "--source=mid", f"--out={out}", "--dtype=float32", monkeypatch=monkeypatch)
    assert (out / "model.safetensors").is_file()
