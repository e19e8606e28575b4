"""
The pretraining corpora: which one is selected, getting it onto disk as parquet shards, and reading it back.

Three kinds, each an entry of CORPORA: a hub corpus (fineweb-edu, climbmix) is downloaded shard by shard from the
Hugging Face hub; a generated one (pydocs, from this Python's documentation) is built here whole; a corpus of your
own is built from your files (`python -m nanochat.dataset --from=PATH --name=NAME`). The building, and the shard
format: nanochat/corpus_build.py.

$NANOCHAT_DATASET picks the corpus (read at every call). All lie in <base_dir>/base_data/<corpus>/ as
shard_NNNNN.parquet files with one `text` column, in row groups of ~1024 documents; the LAST shard of the dataset
is the validation shard. Reading: list_parquet_files(split), list_row_groups(split) (one global order),
read_row_group(path, i), parquets_iter_batched(split, start, step); how the ranks share them: nanochat/dataloader.py.
Errors are UserErrors naming the command that fixes them. More: docs/data.md.
"""

import argparse
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import pyarrow.parquet as pq

from nanochat.configurator import closest
from nanochat.corpus_build import (SHARD_RE, SPLITS, build_own_corpus, build_pydocs, check_shard, read_checksums,
                                   read_manifest, record_checksums, shard_name)
from nanochat.downloads import download_file_with_lock
from nanochat.files import DiskFull, file_sha256, get_base_dir
from nanochat.output import UserError, setup_default_logging

logger = logging.getLogger("nanochat.dataset")  # not __name__: that is "__main__" under `python -m`


@dataclass(frozen=True)
class Corpus:
    """How a corpus gets onto disk, and what a model trained on it is evaluated on."""

    kind: str  # "hub": downloaded shard by shard; "generated": built here whole; "own": built from your files
    command: str  # the command that gets it (after NANOCHAT_DATASET=<name>, unless it is the default); errors quote it
    bundle: str  # the CORE bundle a model trained on it is evaluated on by default (nanochat/core_eval.py)
    url: str = ""  # hub: the base URL of its shards
    shards: int = 0  # hub: how many there are; the last is the validation shard
    build: Callable[[], str] | None = None  # generated: builds it whole if missing, returns its directory


# The built-in corpora; any other name is a corpus of your own (OWN_CORPUS). A new hub corpus is one entry here. Each
# hub corpus was shuffled before sharding, so its first N shards are a uniform sample of the whole.
CORPORA = {
    # FineWeb-Edu 100B: educational web text (shard_00000 .. shard_01822)
    "fineweb-edu": Corpus("hub", "python -m nanochat.dataset -n 8", "dclm", shards=1823,
                          url="https://huggingface.co/datasets/karpathy/fineweb-edu-100b-shuffle/resolve/main"),
    # ClimbMix 400B: NVIDIA's clustered web mixture (shard_00000 .. shard_06542), karpathy/nanochat's corpus since
    # March 2026, where it was the largest single gain (docs/data.md)
    "climbmix": Corpus("hub", "python -m nanochat.dataset -n 8", "dclm", shards=6543,
                       url="https://huggingface.co/datasets/karpathy/climbmix-400b-shuffle/resolve/main"),
    # this Python's documentation, built offline (nanochat/corpus_build.py); a model trained on it has read none of
    # DCLM's web text, so it is scored on the offline bundle built from the same documentation
    "pydocs": Corpus("generated", "python -m nanochat.dataset", "offline", build=build_pydocs),
}
OWN_CORPUS = Corpus("own", "python -m nanochat.dataset", "dclm")  # built again from the files it was built from
DEFAULT_CORPUS = "fineweb-edu"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # the name of a corpus of your own: a directory's


# -----------------------------------------------------------------------------
# The corpora


def own_manifest(name):
    """The manifest of the corpus of your own called `name` (a dict), or None if there is none."""
    if not NAME_RE.match(name) or name in CORPORA:
        return None
    return read_manifest(os.path.join(get_base_dir(), "base_data", name))


def own_corpora():
    """Names of the corpora of your own built in this base dir."""
    parent = os.path.join(get_base_dir(), "base_data")
    return sorted(n for n in (os.listdir(parent) if os.path.isdir(parent) else []) if own_manifest(n) is not None)


def dataset_name():
    """The selected corpus: $NANOCHAT_DATASET, `fineweb-edu` when unset. Anything else is a UserError."""
    name = os.environ.get("NANOCHAT_DATASET") or DEFAULT_CORPUS
    if name not in CORPORA and own_manifest(name) is None:
        known = tuple(CORPORA) + tuple(own_corpora())
        hint = closest(name, known)
        raise UserError(f"NANOCHAT_DATASET={name!r} is not a corpus; use one of {', '.join(known)}"
                        + (f" (did you mean {hint[0]}?)" if hint else "")
                        + f", or build it from your files: `python -m nanochat.dataset --from=DIR --name={name}`")
    return name


def corpus_of(name):
    """The entry of the corpus `name`: CORPORA's, or OWN_CORPUS for a corpus of your own."""
    return CORPORA.get(name, OWN_CORPUS)


def data_dir():
    """The directory of the selected corpus: <base_dir>/base_data/<corpus>."""
    return os.path.join(get_base_dir(), "base_data", dataset_name())


def fetch_command():
    """The exact command that gets the selected corpus; error messages quote it."""
    name = dataset_name()
    command = corpus_of(name).command
    return command if name == DEFAULT_CORPUS else f"NANOCHAT_DATASET={name} {command}"


# -----------------------------------------------------------------------------
# Reading


_verified = set()  # shards whose full content this process has checked


def verify_shard(path):
    """
    Check a shard's whole content, once per process: against the sha256 recorded in SHA256SUMS, or, if none was,
    by decoding every row group (then its sha256 is recorded). UserError naming the file and the command that fixes it.
    """
    if path in _verified:
        return
    directory, name = os.path.split(path)
    expected = read_checksums(directory).get(name)
    if expected is not None:
        if file_sha256(path) != expected:
            raise UserError(f"{path} is damaged (its sha256 differs from the one recorded when it was written); "
                            f"run `{fetch_command()}`: it replaces damaged shards")
    else:
        try:
            pf = pq.ParquetFile(path)
            for i in range(pf.num_row_groups):
                pf.read_row_group(i, columns=["text"])
        except Exception as e:
            raise UserError(f"{path} is unreadable ({type(e).__name__}: {e}); run `{fetch_command()}`: it replaces "
                            f"damaged shards") from None
        record_checksums(directory, {name: file_sha256(path)})
    _verified.add(path)


def _local_shards(directory):
    """{index: path} of the shard files present in `directory` (temp files and locks are not shards)."""
    if not os.path.isdir(directory):
        return {}
    found = {}
    for name in os.listdir(directory):
        m = SHARD_RE.match(name)
        if m:
            found[int(m.group(1))] = os.path.join(directory, name)
    return found


def list_parquet_files(split):
    """
    Sorted paths of the shards of `split`: "train" = every shard present except the validation shard, "val" = [the
    validation shard], the dataset's last (shard_01822 of FineWeb-Edu, whatever was downloaded). A generated corpus
    is built first if missing. UserError naming the command that fixes it when data is missing or a shard is damaged.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    name = dataset_name()
    corpus = corpus_of(name)
    directory = corpus.build() if corpus.kind == "generated" else data_dir()
    shards = _local_shards(directory)
    if corpus.kind == "generated":
        if not shards:
            raise UserError(f"the {name} corpus at {directory} has no shards; delete that directory and run "
                            f"`{fetch_command()}`")
        val_index = max(shards)  # built all at once, atomically: the last shard present is the last shard
    elif corpus.kind == "own":
        val_index = own_manifest(name)["shards"] - 1  # also built whole; the manifest says how many
        missing = [shard_name(i) for i in range(val_index) if i not in shards]
        if missing:
            raise UserError(f"{name} is incomplete: {', '.join(missing[:3])} missing in {directory}; build it again "
                            f"with `{fetch_command()}`")
    else:
        val_index = hub_num_shards() - 1
    if split == "val":
        wanted = [val_index] if val_index in shards else []
    else:
        wanted = sorted(i for i in shards if i < val_index)
    if not wanted:
        what = f"the validation shard {shard_name(val_index)}" if split == "val" else "no training shards"
        raise UserError(f"{name} data missing: {what} in {directory}; get it with `{fetch_command()}`")
    paths = [shards[i] for i in wanted]
    for path in paths:
        try:
            check_shard(path)
        except IOError as e:
            raise UserError(f"{e}. Run `{fetch_command()}` again: it replaces damaged shards") from None
    return paths


def list_row_groups(split):
    """[(path, row_group_index), ...] of `split`: shards in sorted order, row groups in file order."""
    out = []
    for path in list_parquet_files(split):
        out.extend((path, i) for i in range(pq.ParquetFile(path).num_row_groups))
    return out


def read_row_group(path, index):
    """The documents (list[str]) in row group `index` of the shard at `path` (verified on first use)."""
    verify_shard(path)
    try:
        return pq.ParquetFile(path).read_row_group(index, columns=["text"]).column("text").to_pylist()
    except Exception as e:  # damaged after it was verified (the disk, another program)
        raise UserError(f"{path} row group {index} is unreadable ({type(e).__name__}: {e}); run `{fetch_command()}`: "
                        f"it replaces damaged shards") from None


def parquets_iter_batched(split, start=0, step=1):
    """
    One pass over the row groups start, start + step, ... of `split`'s global order (list_row_groups), yielding each
    one's documents (list[str]). start=i, step=n for i in 0..n-1: n disjoint shares that together cover all.
    """
    if start < 0 or step < 1:
        raise ValueError(f"need start >= 0 and step >= 1, got start={start}, step={step}")
    for path, index in list_row_groups(split)[start::step]:
        yield read_row_group(path, index)


def hub_num_shards():
    """Number of shards of the selected hub corpus (its entry), or $NANOCHAT_DATA_SHARDS (tests serve a tiny one)."""
    raw = os.environ.get("NANOCHAT_DATA_SHARDS")
    if not raw:
        return corpus_of(dataset_name()).shards
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 2:
        raise UserError(f"NANOCHAT_DATA_SHARDS={raw!r}: need an integer >= 2 (training shards + 1 validation shard)")
    return n


def hub_url():
    """Base URL the shards are downloaded from: the hub, or $NANOCHAT_DATA_URL (a mirror, or a test server)."""
    return (os.environ.get("NANOCHAT_DATA_URL") or corpus_of(dataset_name()).url).rstrip("/")


def download_shards(num_train_shards, workers=4):
    """
    Download training shards 0 .. num_train_shards-1 (-1 = all) and the validation shard of the selected hub corpus
    into <base_dir>/base_data/<corpus>, `workers` at a time; returns the sorted indices this call downloaded. Valid
    shards present are kept, damaged ones replaced; a shard on disk is always complete (checked before its rename).
    UserError if any download failed (the others are kept); a full disk stops the downloads not yet started and is
    one line (DiskFull).
    """
    name = dataset_name()
    if corpus_of(name).kind != "hub":
        raise UserError(f"NANOCHAT_DATASET={name} is not downloaded: it is built (`{fetch_command()}`)")
    total = hub_num_shards()
    val_index = total - 1
    if num_train_shards == -1:
        num_train_shards = val_index
    if not 0 <= num_train_shards <= val_index:
        raise UserError(f"-n {num_train_shards}: the dataset has {val_index} training shards (plus the validation "
                        f"shard); use 0..{val_index}, or -1 for all")
    if workers < 1:
        raise UserError(f"-w {workers}: need at least 1 worker")
    directory = data_dir()
    wanted = list(range(num_train_shards)) + [val_index]
    present = _local_shards(directory)
    recorded = read_checksums(directory)
    for i in wanted:
        if i in present:
            try:
                check_shard(present[i])
                if shard_name(i) in recorded and file_sha256(present[i]) != recorded[shard_name(i)]:
                    raise IOError(f"{present[i]} does not match the sha256 recorded when it was downloaded")
            except IOError as e:
                logger.warning(f"Shard {i} is damaged ({e}); deleting it and downloading it again")
                os.remove(present[i])
    todo = [i for i in wanted if not os.path.exists(os.path.join(directory, shard_name(i)))]
    logger.info(f"{name}: {num_train_shards} training shards + validation Shard {val_index} wanted, "
                f"{len(wanted) - len(todo)} already in {directory}, downloading {len(todo)} from {hub_url()} "
                f"with {min(workers, max(len(todo), 1))} worker(s)")

    def fetch(i):
        path = download_file_with_lock(f"{hub_url()}/{shard_name(i)}", os.path.join("base_data", name, shard_name(i)),
                                       postprocess_fn=check_shard,
                                       retry_command=f"python -m nanochat.dataset -n {num_train_shards}")
        record_checksums(directory, {shard_name(i): file_sha256(path)})  # so later damage is caught (verify_shard)
        return os.path.getsize(path)

    done = []
    failed = []
    full = None  # the first DiskFull: every later download would fail the same way
    # threads suffice: downloads wait on the network, the parquet check runs in C++, neither holds the GIL
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(todo)))) as pool:
        futures = {pool.submit(fetch, i): i for i in todo}
        for future in as_completed(futures):
            i = futures[future]
            if future.cancelled():  # not started: the disk filled up first
                continue
            try:
                size = future.result()
            except DiskFull as e:
                full = full or e
                for waiting in futures:
                    waiting.cancel()  # those not started yet; the running ones end on their own
                continue
            except UserError as e:
                failed.append(i)
                logger.error(f"Shard {i} failed: {e}")
                continue
            done.append(i)
            logger.info(f"Downloaded Shard {i} ({size / 2**20:.1f} MB), {len(done) + len(failed)}/{len(todo)} done")
    if full is not None:  # one line, not one per download it stopped; the shards downloaded are kept
        raise full
    if failed:
        names = ", ".join(shard_name(i) for i in sorted(failed))
        raise UserError(f"{len(failed)} of {len(todo)} shard download(s) failed ({names}); "
                        f"run the same command again: shards already downloaded are kept")
    return sorted(done)


# -----------------------------------------------------------------------------
# Command line: one function per kind of corpus, main() dispatches on the selected corpus's kind


def download_hub_corpus(num_files, workers):
    """`-n N`: download the first N training shards and the validation shard of the selected hub corpus."""
    if num_files is None:
        raise UserError("say how many training shards to download: -n 8 is enough to train the tokenizer, "
                        f"-n -1 downloads all {hub_num_shards() - 1} (plus the validation shard)")
    t0 = time.time()
    downloaded = download_shards(num_files, workers)
    print(f"Downloaded {len(downloaded)} shard(s) in {time.time() - t0:.1f}s: "
          f"{', '.join(shard_name(i) for i in downloaded) or 'none, all were present'}")


def build_generated_corpus(name, corpus, num_files):
    """Build the generated corpus `name` if missing; one damaged shard rebuilds all of it (it is built whole)."""
    if num_files is not None:
        logger.warning(f"-n is ignored for {name}: the corpus is built whole")
    directory = data_dir()
    if os.path.isdir(directory):
        damaged = []
        for path in sorted(_local_shards(directory).values()):
            try:
                check_shard(path)
                verify_shard(path)
            except (IOError, UserError) as e:
                damaged.append(os.path.basename(path))
                logger.warning(f"{e}")
        if damaged:  # built deterministically: the same bytes again
            logger.warning(f"{name}: {', '.join(damaged)} damaged; rebuilding the corpus in {directory}")
            shutil.rmtree(directory)
        else:
            logger.info(f"{name} is already built in {directory} and its shards are intact (delete that directory "
                        f"to rebuild it)")
    corpus.build()


def build_own(name, sources, field, split, skip_bad):
    """`--from=PATH --name=NAME`: build (or find unchanged) the corpus of your own `name`; log what happened."""
    if name in CORPORA:
        raise UserError(f"--name={name} is a built-in corpus; choose another name for yours")
    if not NAME_RE.match(name):
        raise UserError(f"--name={name!r}: use letters, digits, '.', '_' and '-' (it names a directory), "
                        f"e.g. --name=my-notes")
    t0 = time.time()
    directory = os.path.join(get_base_dir(), "base_data", name)
    manifest, built = build_own_corpus(directory, name, sources, field=field, split=split, skip_bad=skip_bad)
    logger.info(f"{name}: {'built' if built else 'unchanged (the same documents), nothing written'} in "
                f"{time.time() - t0:.1f}s: {manifest['documents']:,} docs, {manifest['characters']:,} chars "
                f"({manifest['utf8_bytes']:,} UTF-8 bytes), {manifest['shards'] - 1} train shard(s) + 1 val shard "
                f"of {manifest['val_documents']:,} docs")


def rebuild_own(name):
    """No --from, NANOCHAT_DATASET=NAME: build your corpus again from the files it was built from (its manifest)."""
    manifest = own_manifest(name)
    gone = [p for p in manifest["sources"] if not os.path.exists(p)]
    if gone:
        raise UserError(f"{name} was built from {', '.join(gone)}, which is gone: build it from where your files "
                        f"are now, `python -m nanochat.dataset --from=PATH --name={name}`")
    build_own(name, manifest["sources"], manifest["field"], manifest["split"], manifest["skip_bad"])


def print_summary(name, corpus):
    """What is on disk now: shards, row groups, documents, characters where they are known cheaply, megabytes."""
    val = list_parquet_files("val")
    try:
        train = list_parquet_files("train")
    except UserError:  # `-n 0` downloads only the validation shard
        train = []
    docs = 0
    chars = 0
    row_groups = 0
    for path in train + val:
        pf = pq.ParquetFile(path)
        docs += pf.metadata.num_rows
        row_groups += pf.num_row_groups
        if corpus.kind == "generated":  # small; counting a hub corpus's characters would read every shard
            chars += sum(len(t) for t in pf.read(columns=["text"]).column("text").to_pylist())
    if corpus.kind == "own":
        chars = own_manifest(name)["characters"]
    size = sum(os.path.getsize(p) for p in train + val)
    chars_text = f", {chars:,} chars" if chars else ""
    print(f"{name}: {len(train)} train shard(s) + 1 val shard ({os.path.basename(val[0])}), "
          f"{row_groups} row groups, {docs:,} docs{chars_text}, {size / 2**20:.1f} MB in {data_dir()}")
    if corpus.kind == "own":
        print(f"Next: NANOCHAT_DATASET={name} python -m scripts.tok_train, then the other stages with "
              f"NANOCHAT_DATASET={name} (README, \"Train on your own text\")")


def _parser():
    hub = [name for name, corpus in CORPORA.items() if corpus.kind == "hub"]
    parser = argparse.ArgumentParser(
        prog="python -m nanochat.dataset",
        description=f"Get the pretraining corpus selected by $NANOCHAT_DATASET ({' | '.join(CORPORA)} | yours) "
                    f"into <base_dir>/base_data/<corpus>. {', '.join(hub)}: download the first N training shards "
                    "and the fixed validation shard. pydocs: build it from this Python's documentation. Yours: build "
                    "it from your files with --from and --name (then NANOCHAT_DATASET=NAME selects it); without "
                    "them, build it again from the files it was built from (nothing changes when they did not).")
    all_shards = ", ".join(str(CORPORA[name].shards - 1) for name in hub)
    parser.add_argument("-n", "--num-files", type=int, default=None,
                        help=f"{', '.join(hub)}: number of training shards to download, -1 = all ({all_shards})")
    parser.add_argument("-w", "--num-workers", type=int, default=4, help="parallel downloads (default 4)")
    parser.add_argument("--from", dest="sources", action="append", default=[], metavar="PATH",
                        help="your text: a file or a directory (walked), repeatable; .txt .md .rst (one document per "
                             "file), .jsonl (one per line), .parquet (one per row)")
    parser.add_argument("--name", default="", help="the name of the corpus built from --from (a directory name)")
    parser.add_argument("--field", default="text",
                        help="the field of a .jsonl line, the column of a .parquet file (default text)")
    parser.add_argument("--split", default="file", choices=SPLITS,
                        help="a text file is one document (file, the default) or one per paragraph (paragraph)")
    parser.add_argument("--skip_bad", "--skip-bad", action="store_true",
                        help="skip files that are empty, binary or not UTF-8 (default: stop at the first, naming it)")
    return parser


def main(argv=None):
    args = _parser().parse_args(argv)
    setup_default_logging()
    if args.sources or args.name:  # yours, from your files; then it is the selected corpus
        if not (args.sources and args.name):
            raise UserError("--from=PATH and --name=NAME go together: the files to build your corpus from, and its "
                            "name")
        if args.num_files is not None:
            raise UserError("-n is for the hub corpora; a corpus of your own is built whole from --from")
        build_own(args.name, args.sources, args.field, args.split, args.skip_bad)
        os.environ["NANOCHAT_DATASET"] = args.name
    name = dataset_name()
    corpus = corpus_of(name)
    if corpus.kind == "hub":
        download_hub_corpus(args.num_files, args.num_workers)
    elif corpus.kind == "generated":
        build_generated_corpus(name, corpus, args.num_files)
    elif not args.sources:  # yours, selected by $NANOCHAT_DATASET
        rebuild_own(name)
    print_summary(name, corpus)


if __name__ == "__main__":
    main()
