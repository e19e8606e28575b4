"""
A corpus of your own (`python -m nanochat.dataset --from=PATH --name=NAME`: nanochat/corpus_build.py).

Built from real text none of this project's code wrote: the Vim tutor in English and Chinese as Debian ships it
(tests/fixtures/own_text/SOURCE). Built, read back and selected like the other corpora; every bad input of issue 38
is one line and loses nothing; running the command again changes nothing; changed files rebuild it.
"""

import json
import os
import re
import shlex
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from helpers import REPO_ROOT, one_line_error, run_script, with_defaults
from nanochat import corpus_build, dataset
from nanochat.output import UserError

OWN_TEXT = os.path.join(REPO_ROOT, "tests", "fixtures", "own_text")


def paragraphs(path):
    with open(path, encoding="utf-8") as f:
        return [p.strip("\n") for p in corpus_build.PARAGRAPH_BREAK.split(f.read()) if p.strip()]


def build(*args):
    """`python -m nanochat.dataset <args>` in this process; returns the corpus's manifest."""
    dataset.main(list(args))
    name = next(a.split("=", 1)[1] for a in args if a.startswith("--name="))
    return dataset.own_manifest(name)


def shard_bytes(name):
    directory = os.path.join(os.environ["NANOCHAT_BASE_DIR"], "base_data", name)
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))}


def written_at(name):
    """{file: (inode, mtime)} of the corpus's directory: equal before and after = nothing was written."""
    directory = os.path.join(os.environ["NANOCHAT_BASE_DIR"], "base_data", name)
    return {n: (os.stat(os.path.join(directory, n)).st_ino, os.stat(os.path.join(directory, n)).st_mtime_ns)
            for n in sorted(os.listdir(directory))}


@pytest.fixture
def texts(tmp_path):
    """A copy of the two tutors that a test may change."""
    return shutil.copytree(OWN_TEXT, tmp_path / "texts")


def test_built_read_back_and_selected(texts, monkeypatch, capsys):
    manifest = build(f"--from={texts}", "--name=tutor", "--split=paragraph")
    out = capsys.readouterr().out
    expected = paragraphs(texts / "en" / "vimtutor.txt") + paragraphs(texts / "zh" / "vimtutor.txt")
    assert manifest["documents"] == len(expected) and manifest["characters"] == sum(map(len, expected))
    assert manifest["utf8_bytes"] == sum(len(p.encode()) for p in expected) > manifest["characters"]  # Chinese: 3 bytes
    assert f"{len(expected):,} docs" in out and "NANOCHAT_DATASET=tutor python -m scripts.tok_train" in out
    monkeypatch.setenv("NANOCHAT_DATASET", "tutor")
    train = [d for batch in dataset.parquets_iter_batched("train") for d in batch]
    val = [d for batch in dataset.parquets_iter_batched("val") for d in batch]
    # every paragraph once, the text unchanged; 1 in 20 held out, from both languages (shuffled with a fixed seed)
    assert sorted(train + val) == sorted(expected)
    assert len(val) == len(expected) // corpus_build.OWN_VAL_EVERY
    assert any("光标" in d for d in val) and any("cursor" in d for d in val)
    assert dataset.fetch_command() == "NANOCHAT_DATASET=tutor python -m nanochat.dataset"
    # the shards are in the hub corpora's format: footer check, recorded sha256, row groups of ROW_GROUP_SIZE
    for path in dataset.list_parquet_files("train") + dataset.list_parquet_files("val"):
        dataset.check_shard(path)
        dataset.verify_shard(path)


def test_one_document_per_file_line_or_row(tmp_path):
    rows = [f"Row {i}: " + "the quick brown fox jumps over the lazy dog. " * 8 for i in range(40)]
    (tmp_path / "src").mkdir()
    pq.write_table(pa.table({"body": rows}), tmp_path / "src" / "rows.parquet")
    with open(tmp_path / "src" / "lines.jsonl", "w", encoding="utf-8") as f:
        for i in range(40):
            record = {"body": f"第{i}行：" + "今天天气很好，我们去公园散步。" * 20, "id": i}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    (tmp_path / "src" / "notes.md").write_text("# Notes\n\n" + "Markdown text. " * 40)
    manifest = build(f"--from={tmp_path / 'src'}", "--name=mixed", "--field=body")
    assert manifest["documents"] == 40 + 40 + 1 and manifest["field"] == "body"


def test_running_it_again_changes_nothing_and_changed_files_rebuild(texts, monkeypatch):
    first = build(f"--from={texts}", "--name=tutor", "--split=paragraph")
    before = shard_bytes("tutor")
    stamps = written_at("tutor")
    again = build(f"--from={texts}", "--name=tutor", "--split=paragraph")
    assert again == first and written_at("tutor") == stamps
    # a damaged shard: the same command repairs it
    directory = os.path.join(os.environ["NANOCHAT_BASE_DIR"], "base_data", "tutor")
    with open(os.path.join(directory, "shard_00000.parquet"), "r+b") as f:
        f.seek(100)
        f.write(b"damage")
    build(f"--from={texts}", "--name=tutor", "--split=paragraph")
    assert shard_bytes("tutor") == before
    # a changed file: the whole corpus rebuilt from the new text, no shard of the old one left beside it
    with open(texts / "zh" / "vimtutor.txt", "a", encoding="utf-8") as f:
        f.write("\n\n新加的一段：本教程到此结束。\n")
    changed = build(f"--from={texts}", "--name=tutor", "--split=paragraph")
    assert changed["documents"] == first["documents"] + 1 and changed["fingerprint"] != first["fingerprint"]
    names = sorted(os.listdir(os.path.dirname(directory)))
    assert names == ["tutor", "tutor.lock"], names
    assert sorted(os.listdir(directory)) == [corpus_build.MANIFEST, "SHA256SUMS"] + [
        dataset.shard_name(i) for i in range(changed["shards"])]
    # without --from, $NANOCHAT_DATASET's corpus is built again from the files it was built from
    monkeypatch.setenv("NANOCHAT_DATASET", "tutor")
    stamps = written_at("tutor")
    dataset.main([])
    assert written_at("tutor") == stamps


@pytest.mark.parametrize("case", ["empty", "binary", "gb18030", "no-text-files", "missing", "broken-link",
                                  "jsonl-field", "parquet-column", "too-little", "built-in-name", "bad-name",
                                  "name-alone"])
def test_bad_input_is_one_line_and_loses_nothing(case, texts, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    zh = (texts / "zh" / "vimtutor.txt").read_text(encoding="utf-8")
    args = [f"--from={bad}", "--name=mine"]
    fragments = []
    if case == "empty":
        (bad / "empty.txt").write_text("\n \n")
        fragments = ["empty.txt is empty", "--skip_bad"]
    elif case == "binary":
        (bad / "a.txt").write_bytes(b"text\0\1\2")
        fragments = ["a.txt is binary", "NUL byte at byte 4"]
    elif case == "gb18030":  # the same Chinese text, in the encoding many Chinese files still use
        (bad / "gbk.txt").write_bytes(zh.encode("gb18030"))
        line = next(i for i, text in enumerate(zh.split("\n"), 1) if not text.isascii())
        fragments = ["gbk.txt is not UTF-8", f"at line {line}, column", "iconv -f GB18030 -t UTF-8"]
    elif case == "no-text-files":
        (bad / "picture.png").write_bytes(b"\x89PNG")
        fragments = ["no text files in it", "1 .png"]
    elif case == "missing":
        args[0] = f"--from={tmp_path / 'nowhere'}"
        fragments = ["nowhere: no such file or directory"]
    elif case == "broken-link":  # a file that is listed but cannot be read
        os.symlink(tmp_path / "gone.txt", bad / "link.txt")
        fragments = ["link.txt cannot be read (No such file or directory)", "--skip_bad"]
    elif case == "jsonl-field":
        (bad / "a.jsonl").write_text('{"text": "ok"}\n{"content": "no text field"}\n')
        fragments = ["a.jsonl line 2 has no field 'text'", "its fields: content", "--field="]
    elif case == "parquet-column":
        pq.write_table(pa.table({"body": ["x"]}), bad / "a.parquet")
        fragments = ["a.parquet has no column 'text'", "its columns: body"]
    elif case == "too-little":
        (bad / "short.txt").write_text(zh)
        fragments = ["too little text for a validation shard", "1 document(s)", "--split=paragraph"]
    elif case == "built-in-name":
        args = [f"--from={texts}", "--name=pydocs"]
        fragments = ["--name=pydocs is a built-in corpus"]
    elif case == "bad-name":
        args = [f"--from={texts}", "--name=../up"]
        fragments = ["--name='../up'", "names a directory"]
    elif case == "name-alone":
        args = ["--name=mine"]
        fragments = ["--from=PATH and --name=NAME go together"]
    with pytest.raises(UserError) as e:
        dataset.main(args)
    assert "\n" not in str(e.value)
    for fragment in fragments:
        assert fragment in str(e.value), (fragment, str(e.value))
    assert not os.path.exists(os.path.join(os.environ["NANOCHAT_BASE_DIR"], "base_data", "mine"))


def test_a_home_relative_path(texts, monkeypatch):
    monkeypatch.setenv("HOME", str(texts.parent))  # --from=~/...: the shell leaves a ~ after "=" as it is
    manifest = build("--from=~/texts", "--name=tutor", "--split=paragraph")
    assert manifest["sources"] == [str(texts)]


def test_skip_bad_builds_from_the_rest(texts):
    zh = (texts / "zh" / "vimtutor.txt").read_text(encoding="utf-8")
    (texts / "zh" / "gbk.txt").write_bytes(zh.encode("gb18030"))
    (texts / "empty.md").write_text("")
    manifest = build(f"--from={texts}", "--name=tutor", "--split=paragraph", "--skip_bad")
    with_utf8_only = build(f"--from={OWN_TEXT}", "--name=clean", "--split=paragraph")
    assert manifest["documents"] == with_utf8_only["documents"] and manifest["skip_bad"]


def test_errors_from_the_command_line_and_the_stages(texts):
    # the command: exit 1, one line, no traceback
    one_line_error(run_script("-m", "nanochat.dataset", "--from=/nonexistent/dir", "--name=mine"), "no such file")
    # a stage with a name that is not a corpus: what exists, and how to build it
    result = run_script("-m", "scripts.tok_train", "--vocab_size=512", env={"NANOCHAT_DATASET": "tutr"})
    one_line_error(result, "NANOCHAT_DATASET='tutr' is not a corpus", "--from=DIR --name=tutr")
    # a shard deleted behind its back: the stage names the command that rebuilds it
    build(f"--from={texts}", "--name=tutor", "--split=paragraph")
    os.remove(os.path.join(os.environ["NANOCHAT_BASE_DIR"], "base_data", "tutor", "shard_00000.parquet"))
    result = run_script("-m", "scripts.tok_train", "--vocab_size=512", env={"NANOCHAT_DATASET": "tutor"})
    one_line_error(result, "tutor is incomplete", "NANOCHAT_DATASET=tutor python -m nanochat.dataset")


# -----------------------------------------------------------------------------
# Issue 38's "done when": the README's commands, from the tutors to chat_cli


README_MARK = "<!-- own-text commands: tests/test_own_corpus.py runs these lines (at smaller sizes) -->"
# Test sizes over the README's CPU ones (each replaces the README's value of the same key)
SMALLER = {
    "scripts.tok_eval": ["--download_reference=false"],  # no network here
    "scripts.base_train": ["--depth=1", "--max_seq_len=64", "--device_batch_size=4", "--total_batch_size=256",
                           "--eval_tokens=256", "--num_iterations=6", "--eval_every=3", "--sample_every=6"],
    "scripts.base_loss": ["--device_batch_size=4"],
    # one epoch of the file (-1), which fits in one step: that step must train at lr 1, not at the schedule's end
    "scripts.mid_train": ["--max_seq_len=64", "--device_batch_size=4", "--total_batch_size=2048", "--eval_tokens=256",
                          "--num_iterations=-1"],
    "scripts.chat_sft": ["--max_seq_len=256", "--device_batch_size=2", "--examples_per_step=4", "--eval_tokens=512",
                         "--num_iterations=3"],
    "scripts.chat_cli": ["--max_tokens=24", "--seed=1"],
}


def readme_commands():
    """The README's lines under README_MARK: [(env name, value)] for `export` lines, else [argv after python]."""
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        block = f.read().split(README_MARK)[1].split("```bash\n")[1].split("```")[0]
    out = []
    for line in block.strip().splitlines():
        words = shlex.split(line)
        if words[0] == "export":
            out.append(tuple(words[1].split("=", 1)))
        else:
            assert words[:2] == ["python", "-m"], line
            out.append(words[1:])
    return out


@pytest.mark.slow
def test_the_readme_from_your_files_to_chat(tmp_path):
    env = {}
    outputs = {}
    for command in readme_commands():
        if isinstance(command, tuple):
            env[command[0]] = command[1]
            continue
        module = command[1]
        args = command[2:]
        args = with_defaults(args, SMALLER.get(module, []))
        result = run_script("-m", module, *args, env=env, timeout=300)
        assert result.returncode == 0, (module, result.stdout[-3000:], result.stderr[-3000:])
        outputs[module] = result.stdout + result.stderr
    assert env == {"NANOCHAT_DATASET": "tutor"}
    assert "tutor: 1 train shard(s) + 1 val shard" in outputs["nanochat.dataset"]
    # tok_eval measures the tokenizer on this corpus's own validation text
    assert re.search(r"\| tutor val +\| [\d,]+ +\| [\d,]+ +\| \d", outputs["scripts.tok_eval"])
    assert re.search(r"val bpb: \d", outputs["scripts.base_loss"])
    assert "Mixture custom: " in outputs["scripts.mid_train"]
    mid = outputs["scripts.mid_train"]
    assert re.search(r"step 00001 \(100.00%\) .*\| lrm: 1.00 \|", mid), mid[-3000:]
    assert "step 00002" not in outputs["scripts.mid_train"]
    own_line = "Your conversations (docs/examples/conversations.jsonl): 11 training, 1 validation"
    assert own_line in outputs["scripts.chat_sft"]
    answer = run_script("-m", "scripts.chat_cli", "-p", "怎样移动光标？", *SMALLER["scripts.chat_cli"], env=env)
    assert answer.returncode == 0 and answer.stdout.strip(), answer.stderr[-2000:]
    answer.stdout.encode("utf-8")  # printable text (a lone surrogate would raise here)


@pytest.mark.slow
def test_pretraining_on_it_resumes_exactly(texts, monkeypatch):
    """
    The loader's position in a corpus of your own is saved and restored like any other: resumed at step 3 of 6,
    the run ends with the uninterrupted run's weights (fp32: exact up to its rounding).
    """
    build(f"--from={texts}", "--name=tutor", "--split=paragraph")
    env = {"NANOCHAT_DATASET": "tutor", "NANOCHAT_DTYPE": "float32"}
    assert run_script("-m", "scripts.tok_train", "--vocab_size=512", env=env).returncode == 0
    args = with_defaults(SMALLER["scripts.base_train"],
                         ["--eval_every=-1", "--sample_every=-1", "--core_metric_every=-1", "--save_every=3"])
    full = run_script("-m", "scripts.base_train", *args, "--model_tag=full", env=env)
    assert full.returncode == 0, full.stderr[-2000:]
    checkpoints = os.path.join(os.environ["NANOCHAT_BASE_DIR"], "base_checkpoints")
    os.makedirs(os.path.join(checkpoints, "resumed"))
    for name in os.listdir(os.path.join(checkpoints, "full")):
        if "000003" in name:  # the step-3 checkpoint alone: model, meta, optimizer
            shutil.copy(os.path.join(checkpoints, "full", name), os.path.join(checkpoints, "resumed", name))
    resumed = run_script("-m", "scripts.base_train", *args, "--model_tag=resumed", "--resume_from_step=3", env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = (torch.load(os.path.join(checkpoints, tag, "model_000006.pt")) for tag in ("full", "resumed"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-6, atol=0) for k in a)


def test_tok_train_says_how_much_of_long_documents_it_did_not_see(texts):
    # one document per file (the default): each tutor is one document, longer than doc_cap
    build(f"--from={texts}", "--name=whole")
    result = run_script("-m", "scripts.tok_train", "--vocab_size=512", "--doc_cap=5000",
                        env={"NANOCHAT_DATASET": "whole"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"1 documents were longer than doc_cap=5,000: [\d,]+ chars \(\d+% of the text read\) not trained "
                     r"on; for a corpus of long files, build it with --split=paragraph", result.stdout), result.stdout
