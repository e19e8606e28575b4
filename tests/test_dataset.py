"""
The pretraining corpora (nanochat/dataset.py, corpus_build.py): building, downloading, reading.

The pydocs corpus (offline, deterministic, atomic); the hub corpora's download path against a local server (fixed
validation shard, skip what is there, replace what is damaged), and a new hub corpus as one entry; the reading API
(listing, row groups, rank striding).
"""

import hashlib
import os
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import nanochat.downloads
import nanochat.files
from helpers import run_script
from nanochat import corpus_build, dataset, pydocs
from nanochat.corpus_build import ROW_GROUP_SIZE
from nanochat.output import UserError



def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _write_shard(path, docs, row_group_size):
    pq.write_table(pa.table({"text": pa.array(docs, type=pa.string())}), path, row_group_size=row_group_size)


def _fixture_docs(shard):
    return [f"Document {j} of shard {shard}: the quick brown fox jumps over the lazy dog." for j in range(10)]


@pytest.fixture(params=["fineweb-edu", "climbmix"])
def tiny_hub(request, file_server, monkeypatch):
    """
    A 3-shard hub corpus on the local server (10 docs per shard, row groups of 4), selected via env: FineWeb-Edu
    (the default: NANOCHAT_DATASET unset) or ClimbMix. Both take the same path, into base_data/<corpus>.
    """
    for s in range(3):
        _write_shard(os.path.join(file_server.root, dataset.shard_name(s)), _fixture_docs(s), row_group_size=4)
    monkeypatch.setenv("NANOCHAT_DATA_URL", file_server.url)
    monkeypatch.setenv("NANOCHAT_DATA_SHARDS", "3")
    if request.param == "fineweb-edu":
        monkeypatch.delenv("NANOCHAT_DATASET", raising=False)
    else:
        monkeypatch.setenv("NANOCHAT_DATASET", request.param)
    file_server.corpus = request.param
    return file_server


def _local(s):
    return os.path.join(nanochat.files.get_base_dir(), "base_data", dataset.dataset_name(), dataset.shard_name(s))


# -----------------------------------------------------------------------------
# pydocs


def test_pydocs_builds_offline_to_identical_bytes(pydocs_dir, tmp_path):
    # Second build in a fresh process: other hash seed, no network (proxies to a dead port), other base dir.
    env = dict(NANOCHAT_BASE_DIR=tmp_path / "other_base", NANOCHAT_DATASET="pydocs", PYTHONHASHSEED="12345",
               HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9",
               NANOCHAT_DATA_URL="http://127.0.0.1:9")
    proc = run_script("-m", "nanochat.dataset", env=env)
    assert proc.returncode == 0, proc.stderr
    other = tmp_path / "other_base" / "base_data" / "pydocs"
    names = sorted(os.listdir(pydocs_dir))  # the shards and their SHA256SUMS
    assert names == sorted(os.listdir(other)) and "SHA256SUMS" in names
    names.remove("SHA256SUMS")
    assert len(names) >= 3 and all(dataset.SHARD_RE.match(n) for n in names)
    for name in names:
        assert _sha(os.path.join(pydocs_dir, name)) == _sha(other / name), name
    docs = sum(pq.ParquetFile(os.path.join(pydocs_dir, n)).metadata.num_rows for n in names)
    assert f"{docs:,} docs" in proc.stdout and "chars" in proc.stdout and str(other) in proc.stdout


def test_pydocs_layout_and_content(pydocs_corpus):
    train = dataset.list_parquet_files("train")
    val = dataset.list_parquet_files("val")
    shards = sorted(n for n in os.listdir(pydocs_corpus) if n.startswith("shard_"))
    assert val == [os.path.join(pydocs_corpus, shards[-1])]  # the last shard, fixed
    assert train == [os.path.join(pydocs_corpus, s) for s in shards[:-1]] and len(train) >= 2
    assert dataset.data_dir() == pydocs_corpus
    for path in train + val:
        meta = pq.ParquetFile(path).metadata
        sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        assert all(n == ROW_GROUP_SIZE for n in sizes[:-1]) and 0 < sizes[-1] <= ROW_GROUP_SIZE
    assert pq.ParquetFile(val[0]).metadata.num_rows == corpus_build.PYDOCS_VAL_DOCS

    train_docs = [d for p in train for d in pq.read_table(p).column("text").to_pylist()]
    val_docs = pq.read_table(val[0]).column("text").to_pylist()
    entries = pydocs.pydocs_entries()
    # one document per record, nothing lost, nothing added
    assert sorted(train_docs + val_docs) == sorted(pydocs.pydocs_document(e) for e in entries)
    assert len(train_docs) + len(val_docs) > 5000
    assert sum(map(len, train_docs + val_docs)) > 1_000_000
    assert all(isinstance(d, str) and d.strip() for d in train_docs + val_docs)
    # real English prose, in both splits (the shuffle mixes modules into the validation shard)
    for docs in (train_docs, val_docs):
        assert sum(" the " in d for d in docs) > 0.3 * len(docs)
        assert sum("Return" in d for d in docs) > 0.1 * len(docs)
        assert len({d.split("\n")[0].split(".")[0] for d in docs}) > 50  # many different modules/topics

    by_name = {(e["name"], e["kind"]): e for e in entries}
    dumps = by_name[("json.dumps", "function")]
    assert dumps["module"] == "json" and dumps["signature"].startswith("(obj, *, skipkeys=False")
    assert "JSON" in dumps["docstring"]
    assert pydocs.pydocs_document(dumps).startswith("json.dumps(obj, *, skipkeys=False")
    assert "0o777" in by_name[("os.makedirs", "function")]["signature"]  # defaults as written, not 511
    assert "number of items" in by_name[("builtins.len", "function")]["docstring"]  # a C builtin
    assert by_name[("assert", "topic")]["docstring"].startswith('The "assert" statement')
    assert by_name[("collections.OrderedDict", "class")]["signature"] == "(dict)"
    assert ("json", "module") in by_name and ("collections.OrderedDict.popitem", "method") in by_name
    assert {e["kind"] for e in entries} == {"module", "class", "function", "method", "topic"}
    # excluded: test packages, idlelib, turtledemo, private names, pure-Python twins duplicated in C
    excluded = {"test", "tests", "idle_test", "idlelib", "turtledemo", "lib2to3.tests", "this", "antigravity"}
    assert not [e["name"] for e in entries if set(e["module"].split(".")) & excluded or e["module"] in excluded]
    assert not [e["name"] for e in entries if e["kind"] != "topic" and any(
        p.startswith("_") and not p.endswith("__") for p in e["name"][len(e["module"]):].split("."))]
    assert ("heapq.heappush", "function") in by_name and ("_heapq.heappush", "function") not in by_name


def test_pydocs_entries_are_fresh_copies(pydocs_dir):
    a = pydocs.pydocs_entries()
    a[0]["name"] = "mutated"
    assert pydocs.pydocs_entries()[0]["name"] != "mutated"


def test_pydocs_entries_are_kept_per_base_dir_and_a_damaged_copy_is_collected_again(tmp_path, monkeypatch):
    import json
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    kept_path = tmp_path / "pydocs_entries.json"

    def entries():
        pydocs._pydocs_entries_cached.cache_clear()
        return pydocs.pydocs_entries()
    found = entries()  # collected: the standard library parsed (the same every time: the identical-bytes test)
    kept = json.loads(kept_path.read_text())
    assert kept["records"] == found and len(found) > 5000
    # from here, a collection is counted, not done again (~4 s of CPU each)
    collections = []
    monkeypatch.setattr(pydocs, "_collect_entries", lambda: collections.append(1) or list(found))
    kept_path.write_text(json.dumps(dict(kept, records=found[:1])))
    assert entries() == found[:1] and collections == []  # read back, not collected again (the point: ~4 s a process)
    for damage in ("{not json", json.dumps(dict(kept, key="another python, or another pydocs.py"))):
        kept_path.write_text(damage)
        assert entries() == found
        assert json.loads(kept_path.read_text())["records"] == found  # collected again, and kept again
    assert len(collections) == 2
    pydocs._pydocs_entries_cached.cache_clear()


def _small_pydocs(monkeypatch, n=3000):
    docs = [f"Small document number {i}: Return the value." for i in range(n)]
    monkeypatch.setattr(corpus_build, "pydocs_documents", lambda: list(docs))
    return docs


def test_pydocs_built_on_demand_once_under_concurrency(monkeypatch):
    monkeypatch.setenv("NANOCHAT_DATASET", "pydocs")
    docs = _small_pydocs(monkeypatch)
    calls = []
    real_write = corpus_build._write_pydocs

    def counting_write(directory):
        calls.append(directory)
        return real_write(directory)

    monkeypatch.setattr(corpus_build, "_write_pydocs", counting_write)
    results = []
    errors = []

    def reader():
        try:
            results.append(dataset.list_parquet_files("train"))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(calls) == 1
    assert all(r == results[0] for r in results)
    val = dataset.list_parquet_files("val")
    # 3000 docs: val = last 1024, train = 1976 in one shard of 2 row groups
    assert [os.path.basename(p) for p in results[0]] == ["shard_00000.parquet"]
    assert [os.path.basename(p) for p in val] == ["shard_00001.parquet"]
    assert [len(b) for b in dataset.parquets_iter_batched("train")] == [1024, 1976 - 1024]
    assert [d for b in dataset.parquets_iter_batched("val") for d in b] == docs[-1024:]


def test_pydocs_interrupted_build_never_looks_complete(monkeypatch):
    monkeypatch.setenv("NANOCHAT_DATASET", "pydocs")
    _small_pydocs(monkeypatch)
    final = os.path.join(nanochat.files.get_base_dir(), "base_data", "pydocs")
    real_write = corpus_build._write_pydocs

    def crashing_write(directory):
        os.makedirs(directory)
        with open(os.path.join(directory, "shard_00000.parquet"), "wb") as f:
            f.write(b"half a shard")
        raise RuntimeError("killed midway")

    monkeypatch.setattr(corpus_build, "_write_pydocs", crashing_write)
    with pytest.raises(RuntimeError):
        dataset.list_parquet_files("train")
    assert not os.path.exists(final)
    # a builder killed with -9 leaves its temp dir behind: the next build ignores it and cleans it up
    stale = final + ".tmp99999"
    os.makedirs(stale)
    with open(os.path.join(stale, "shard_00000.parquet"), "wb") as f:
        f.write(b"half a shard")
    monkeypatch.setattr(corpus_build, "_write_pydocs", real_write)
    assert dataset.list_parquet_files("val") == [os.path.join(final, "shard_00001.parquet")]
    assert not os.path.exists(stale)
    assert sorted(os.listdir(os.path.dirname(final))) == ["pydocs", "pydocs.lock"]


# -----------------------------------------------------------------------------
# The hub corpora's download path (FineWeb-Edu, ClimbMix; against the local file server)


def test_download_cli_fetches_train_and_fixed_val_then_nothing(tiny_hub):
    proc = run_script("-m", "nanochat.dataset", "-n", "2", "-w", "2", timeout=120)
    assert proc.returncode == 0, proc.stderr
    for s in range(3):
        assert _sha(_local(s)) == _sha(os.path.join(tiny_hub.root, dataset.shard_name(s)))
    assert tiny_hub.requests == {f"/{dataset.shard_name(s)}": 1 for s in range(3)}
    for s in range(3):
        assert f"Downloaded Shard {s} (" in proc.stderr
    assert "3/3 done" in proc.stderr
    assert os.path.dirname(_local(0)) in proc.stdout and "30 docs" in proc.stdout
    # second run: everything is there and valid, nothing is requested
    dataset.main(["-n", "2"])
    dataset.main(["-n", "-1"])  # -1 = all training shards = 2 here
    assert tiny_hub.requests == {f"/{dataset.shard_name(s)}": 1 for s in range(3)}
    assert dataset.list_parquet_files("train") == [_local(0), _local(1)]
    assert dataset.list_parquet_files("val") == [_local(2)]


def test_val_shard_is_the_last_shard_not_the_last_downloaded(tiny_hub):
    assert dataset.download_shards(1, workers=2) == [0, 2]
    assert not os.path.exists(_local(1))
    assert dataset.list_parquet_files("train") == [_local(0)]
    assert dataset.list_parquet_files("val") == [_local(2)]
    assert dataset.download_shards(2, workers=2) == [1]  # more training shards: val set unchanged
    assert dataset.list_parquet_files("val") == [_local(2)]
    assert dataset.list_parquet_files("train") == [_local(0), _local(1)]
    assert dataset.download_shards(0) == []  # -n 0: just the val shard, already there


def test_damaged_local_shard_is_reported_and_replaced(tiny_hub):
    dataset.main(["-n", "2"])
    with open(_local(1), "r+b") as f:
        f.truncate(os.path.getsize(_local(1)) // 2)
    with pytest.raises(UserError) as e:
        dataset.list_parquet_files("train")
    assert "shard_00001.parquet" in str(e.value) and "python -m nanochat.dataset -n 8" in str(e.value)
    assert dataset.download_shards(2) == [1]
    assert _sha(_local(1)) == _sha(os.path.join(tiny_hub.root, dataset.shard_name(1)))
    assert tiny_hub.requests[f"/{dataset.shard_name(1)}"] == 2
    assert tiny_hub.requests[f"/{dataset.shard_name(0)}"] == 1
    assert dataset.list_parquet_files("train") == [_local(0), _local(1)]


def test_damaged_download_is_rejected_before_it_lands(tiny_hub, monkeypatch):
    monkeypatch.setattr(nanochat.downloads.time, "sleep", lambda s: None)  # no retry backoff in tests
    with open(os.path.join(tiny_hub.root, dataset.shard_name(1)), "wb") as f:
        f.write(b"<html>not a parquet file</html>")
    with pytest.raises(UserError) as e:
        dataset.download_shards(2, workers=3)
    assert "shard_00001.parquet" in str(e.value)
    assert tiny_hub.requests[f"/{dataset.shard_name(1)}"] >= 2  # validated, then retried
    assert not os.path.exists(_local(1))  # never renamed into place
    assert os.path.exists(_local(0)) and os.path.exists(_local(2))  # the other shards completed
    assert not [n for n in os.listdir(os.path.dirname(_local(0))) if ".tmp" in n]


def test_missing_data_and_bad_input_errors(tiny_hub, monkeypatch):
    for split in ("train", "val"):
        with pytest.raises(UserError, match=r"python -m nanochat\.dataset -n 8"):
            dataset.list_parquet_files(split)
    with pytest.raises(UserError, match="-n"):
        dataset.main([])  # a hub corpus needs an explicit shard count
    with pytest.raises(UserError, match="0..2"):
        dataset.download_shards(3)
    with pytest.raises(ValueError):
        dataset.list_parquet_files("test")
    monkeypatch.delenv("NANOCHAT_DATA_SHARDS")  # the real corpora: their own URLs and shard counts
    hub = {name: corpus for name, corpus in dataset.CORPORA.items() if corpus.kind == "hub"}
    assert sorted(hub) == ["climbmix", "fineweb-edu"]
    for name, corpus in hub.items():
        monkeypatch.setenv("NANOCHAT_DATASET", name)
        assert dataset.hub_num_shards() == corpus.shards
        assert dataset.hub_url() == tiny_hub.url  # NANOCHAT_DATA_URL wins
        assert dataset.fetch_command().endswith("python -m nanochat.dataset -n 8")
    monkeypatch.setenv("NANOCHAT_DATASET", "pydocs")
    with pytest.raises(UserError, match="not downloaded"):
        dataset.download_shards(1)
    monkeypatch.setenv("NANOCHAT_DATASET", "pydoc")
    with pytest.raises(UserError, match="did you mean pydocs"):
        dataset.data_dir()
    monkeypatch.setenv("NANOCHAT_DATASET", "pydocs")
    assert dataset.fetch_command() == "NANOCHAT_DATASET=pydocs python -m nanochat.dataset"
    assert tiny_hub.requests == {}


def test_a_new_hub_corpus_is_one_entry(file_server, monkeypatch):
    """An entry in CORPORA is all a hub corpus needs: selected, downloaded, read, named in --help and errors."""
    for s in range(3):
        _write_shard(os.path.join(file_server.root, dataset.shard_name(s)), _fixture_docs(s), row_group_size=4)
    entry = dataset.Corpus("hub", "python -m nanochat.dataset -n 8", "dclm", url=file_server.url, shards=3)
    monkeypatch.setitem(dataset.CORPORA, "tiny-web", entry)
    monkeypatch.setenv("NANOCHAT_DATASET", "tiny-web")
    with pytest.raises(UserError, match="NANOCHAT_DATASET=tiny-web python -m nanochat.dataset -n 8"):
        dataset.list_parquet_files("val")
    assert "tiny-web" in dataset._parser().format_help()
    dataset.main(["-n", "-1"])
    assert dataset.list_parquet_files("train") == [_local(0), _local(1)]
    assert [d for b in dataset.parquets_iter_batched("val") for d in b] == _fixture_docs(2)
    from nanochat.core_eval import default_bundle_kind
    assert default_bundle_kind() == "dclm"


def test_missing_data_cli_prints_one_line_error(tiny_hub):
    proc = run_script("-m", "nanochat.dataset", timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1 and "-n 8" in proc.stderr


# -----------------------------------------------------------------------------
# Reading API


def test_row_groups_and_rank_striding(tiny_hub):
    directory = os.path.dirname(_local(0))
    os.makedirs(directory)
    for s in range(3):
        _write_shard(_local(s), _fixture_docs(s), row_group_size=4)
    # litter that is not a shard: lock files and a temp file of an interrupted download
    open(_local(1) + ".lock", "w").close()
    open(_local(1) + ".tmp123", "w").close()

    groups = dataset.list_row_groups("train")
    assert groups == [(_local(s), i) for s in (0, 1) for i in range(3)]  # 10 docs / 4 per group = 3 groups
    assert dataset.list_row_groups("val") == [(_local(2), i) for i in range(3)]
    assert dataset.read_row_group(_local(1), 2) == _fixture_docs(1)[8:10]
    assert dataset.read_row_group(_local(0), 0) == _fixture_docs(0)[:4]

    everything = [d for b in dataset.parquets_iter_batched("train") for d in b]
    assert everything == _fixture_docs(0) + _fixture_docs(1)  # one pass, global order
    for world in (2, 3, 4):
        seen = []
        for rank in range(world):
            batches = list(dataset.parquets_iter_batched("train", start=rank, step=world))
            assert batches == [dataset.read_row_group(*g) for g in groups[rank::world]]
            seen += [d for b in batches for d in b]
        assert sorted(seen) == sorted(everything)  # disjoint and complete
    assert list(dataset.parquets_iter_batched("train", start=6)) == []
    assert [d for b in dataset.parquets_iter_batched("val") for d in b] == _fixture_docs(2)
    with pytest.raises(ValueError):
        next(dataset.parquets_iter_batched("train", step=0))
