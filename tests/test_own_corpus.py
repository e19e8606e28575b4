"""
A corpus of your own (`python -m nanochat.dataset --from=PATH --name=NAME`: nanochat/corpus_build.py), from real
text none of this project's code wrote: the Vim tutor in English and Chinese as Debian ships it
(tests/fixtures/own_text/SOURCE). Built, read back and selected like the other corpora; every bad input of issue 38
is one line and loses nothing; running the command again changes nothing; changed files rebuild it.
"""

import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import REPO_ROOT, one_line_error, run_script
from nanochat import corpus_build, dataset
from nanochat.common import UserError

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
            f.write(json.dumps({"body": f"第{i}行：" + "今天天气很好，我们去公园散步。" * 20, "id": i}, ensure_ascii=False) + "\n")
    (tmp_path / "src" / "notes.md").write_text("# Notes\n\n" + "Markdown text. " * 40)
    manifest = build(f"--from={tmp_path / 'src'}", "--name=mixed", "--field=body")
    assert manifest["documents"] == 40 + 40 + 1 and manifest["field"] == "body"


def test_running_it_again_changes_nothing_and_changed_files_rebuild(texts, capsys, monkeypatch):
    first = build(f"--from={texts}", "--name=tutor", "--split=paragraph")
    before = shard_bytes("tutor")
    again = build(f"--from={texts}", "--name=tutor", "--split=paragraph")
    assert again == first and shard_bytes("tutor") == before
    assert "unchanged" in capsys.readouterr().err
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
    dataset.main([])
    assert "unchanged" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["empty", "binary", "gb18030", "no-text-files", "missing", "jsonl-field",
                                  "parquet-column", "too-little", "built-in-name", "bad-name", "name-alone"])
def test_bad_input_is_one_line_and_loses_nothing(case, texts, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    zh = (texts / "zh" / "vimtutor.txt").read_text(encoding="utf-8")
    args, fragments = [f"--from={bad}", "--name=mine"], []
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


def test_skip_bad_builds_from_the_rest(texts):
    (texts / "zh" / "gbk.txt").write_bytes((texts / "zh" / "vimtutor.txt").read_text(encoding="utf-8").encode("gb18030"))
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
