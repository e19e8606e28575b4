"""
Building a corpus on this machine, in the hub corpora's shard format: pydocs, and yours from your files.

pydocs is built from this Python's documentation, yours by `python -m nanochat.dataset --from=PATH --name=NAME`.
nanochat/dataset.py selects and reads corpora; here they are written. How and why: docs/data.md.

The shard format: shard_NNNNN.parquet files with one string column `text` (a document per row), in row groups of
ROW_GROUP_SIZE documents, and SHA256SUMS beside them; the last shard is the validation shard. A corpus built here is
built whole or not at all (_build_in_place).

Your files, by name:
  .txt .text .md .markdown .rst   plain text: one document per file, or with split="paragraph" one per paragraph
                                   (text between blank lines; for one long file such as a book)
  .jsonl                          JSON Lines: one document per line, the string in its `field` ("text")
  .parquet                        one document per row of its string column `field` ("text")
A directory is walked in sorted order (names starting with "." skipped); files of other kinds met in a walk are
skipped and counted. A file named on the command line is read as plain text whatever its suffix. Text must be UTF-8
(a leading byte-order mark is dropped, \\r\\n becomes \\n). Every problem is a UserError in one line naming the file
and the place: no such path, no text file found, an empty or binary file (a NUL byte), bytes that are not UTF-8
(line, column, and the iconv command that converts them), a JSON line without that field, a parquet file without
that column. skip_bad=True skips such files with a warning instead.
"""

import hashlib
import json
import logging
import os
import random
import re
import shutil
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
from filelock import FileLock

from nanochat.files import DiskFull, atomic_write, file_sha256, get_base_dir, out_of_space, read_json, write_json
from nanochat.output import UserError, format_bytes
from nanochat.pydocs import pydocs_documents

logger = logging.getLogger("nanochat.corpus_build")  # not __name__: that is "__main__" under `python -m`

# -----------------------------------------------------------------------------
# The shard format both corpora share

SHARD_RE = re.compile(r"^shard_(\d{5})\.parquet$")
ROW_GROUP_SIZE = 1024  # documents per row group: the unit the dataloader reads and strides over
PYDOCS_VAL_DOCS = 1024  # documents in pydocs's validation shard: one row group
PYDOCS_SHARD_DOCS = 2 * ROW_GROUP_SIZE  # documents per pydocs training shard: two row groups
OWN_SHARD_DOCS = 8 * ROW_GROUP_SIZE  # documents per training shard of a corpus of your own
OWN_VAL_EVERY = 20  # a corpus of your own holds out 1 document in 20 (at least one) as its validation shard
OWN_VAL_MIN_CHARS = 1_000  # ... and refuses to be built when those hold fewer characters
MANIFEST = "CORPUS.json"  # in a corpus of your own: how it was built (sources, settings, fingerprint, counts)


def shard_name(index):
    return f"shard_{index:05d}.parquet"


def check_shard(path):
    """
    Raise IOError unless `path` is a readable parquet file with a string `text` column. Reads only the footer
    (a few KB, at the file's end: a truncated file fails here).
    """
    try:
        schema = pq.ParquetFile(path).schema_arrow
    except Exception as e:  # pyarrow raises ArrowInvalid (a ValueError) or OSError, depending on the damage
        raise IOError(f"{path} is not a valid parquet file: {e}") from e
    text_type = schema.field("text").type if "text" in schema.names else None
    if text_type is None or not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type)):
        raise IOError(f"{path} has no string column `text` (columns: {', '.join(schema.names)})")


CHECKSUMS = "SHA256SUMS"  # beside the shards: "<sha256>  <shard name>" per line, written when a shard is written


def read_checksums(directory):
    """{shard name: sha256} recorded in <directory>/SHA256SUMS ({} if none)."""
    try:
        with open(os.path.join(directory, CHECKSUMS), encoding="utf-8") as f:
            return {name: digest for digest, name in (line.split() for line in f if line.strip())}
    except (OSError, ValueError):
        return {}


def write_checksums(directory, digests):
    """Write <directory>/SHA256SUMS listing {shard name: sha256} (the format of the `sha256sum` tool)."""
    with atomic_write(os.path.join(directory, CHECKSUMS), "w") as f:
        f.writelines(f"{digest}  {name}\n" for name, digest in sorted(digests.items()))


def record_checksums(directory, digests):
    """Add {shard name: sha256} to <directory>/SHA256SUMS, under a lock (parallel downloads record at once)."""
    with FileLock(os.path.join(directory, CHECKSUMS + ".lock")):
        write_checksums(directory, dict(read_checksums(directory), **digests))


# -----------------------------------------------------------------------------
# Writing: pydocs, and yours


def _write_shards(directory, train, val, shard_docs):
    """
    Write the documents `train` in shards of `shard_docs`, then `val`, the last shard, as shard_00000.parquet, ...
    into the new `directory`, and SHA256SUMS. Returns the number of shards.
    """
    shards = [train[i:i + shard_docs] for i in range(0, len(train), shard_docs)] + [val]
    os.makedirs(directory)
    for index, shard in enumerate(shards):
        table = pa.table({"text": pa.array(shard, type=pa.string())})
        # the same bytes on every build: no timestamps in parquet metadata, a fixed codec
        pq.write_table(table, os.path.join(directory, shard_name(index)), row_group_size=ROW_GROUP_SIZE,
                       compression="zstd")
    names = [shard_name(i) for i in range(len(shards))]
    write_checksums(directory, {name: file_sha256(os.path.join(directory, name)) for name in names})
    return len(shards)


def _write_pydocs(directory):
    """Write the shards into `directory`: training shards of 2 row groups, then one validation shard."""
    docs = pydocs_documents()
    if len(docs) < 2 * PYDOCS_VAL_DOCS:
        raise RuntimeError(f"pydocs found only {len(docs)} documents: is Python's standard library there?")
    shards = _write_shards(directory, docs[:-PYDOCS_VAL_DOCS], docs[-PYDOCS_VAL_DOCS:], PYDOCS_SHARD_DOCS)
    return len(docs), sum(len(d) for d in docs), shards


def _build_in_place(final, write, is_done, text_bytes, again):
    """
    Build the corpus directory `final` whole or not at all: under a file lock (torchrun's ranks, two commands at
    once: one builds, the others wait and find it done), write(tmp) into `<final>.tmp<pid>`, then rename it to
    `final`, replacing an older one (moved aside first, then deleted). is_done() is asked again under the lock.
    A killed build leaves a `.tmp<pid>` or `.old<pid>` directory, never a half corpus; the next build deletes it.
    A full disk removes the `.tmp<pid>` directory, keeps the older corpus, and is one line (DiskFull) saying how much
    the text takes uncompressed (text_bytes(): the shards take less) and what to do (`again`).
    """
    parent, base = os.path.split(final)
    os.makedirs(parent, exist_ok=True)
    with FileLock(final + ".lock"):
        if is_done():  # built by whoever held the lock before us
            return None
        for name in os.listdir(parent):  # we hold the lock: such a directory is a dead builder's
            if name.startswith((base + ".tmp", base + ".old")):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        tmp = f"{final}.tmp{os.getpid()}"
        old = f"{final}.old{os.getpid()}"
        try:
            result = write(tmp)
            if os.path.isdir(final):
                os.rename(final, old)
            os.rename(tmp, final)
        except BaseException as e:
            if os.path.isdir(old) and not os.path.exists(final):  # the older corpus back where it was
                os.rename(old, final)
            full = out_of_space(e)
            if full is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # first: the free space reported is the next attempt's
            raise DiskFull(full, f"the corpus {base}", parent, f"up to {format_bytes(text_bytes())} (the text, before "
                           f"compression)", again) from None
        finally:
            for leftover in (tmp, old):
                if os.path.exists(leftover):
                    shutil.rmtree(leftover, ignore_errors=True)
    return result


def build_pydocs():
    """
    <base_dir>/base_data/pydocs, built first if missing (list_parquet_files calls it), deterministically (the same
    bytes every time) and atomically (_build_in_place). To rebuild, delete the directory (docs/data.md).
    """
    final = os.path.join(get_base_dir(), "base_data", "pydocs")
    if os.path.isdir(final):
        return final
    t0 = time.time()
    logger.info(f"Building the pydocs corpus from the docs of Python {sys.version.split()[0]} in {final}")
    built = _build_in_place(final, _write_pydocs, lambda: os.path.isdir(final),
                            lambda: sum(len(d.encode()) for d in pydocs_documents()),
                            "free space, then run the same command again")
    if built:
        docs, chars, shards = built
        logger.info(f"Built pydocs: {docs:,} docs, {chars / 1e6:.2f}M chars, {shards} shards in "
                    f"{time.time() - t0:.1f}s")
    return final


def read_manifest(directory):
    """The manifest (a dict) of the corpus of your own in `directory`, or None if there is none."""
    return read_json(os.path.join(directory, MANIFEST))


def _intact(directory, manifest):
    """Whether `directory` holds every shard `manifest` counts, each with the sha256 recorded when it was written."""
    recorded = read_checksums(directory)
    return all(os.path.exists(path := os.path.join(directory, shard_name(i)))
               and file_sha256(path) == recorded.get(shard_name(i)) for i in range(manifest["shards"]))


def build_own_corpus(final, name, sources, field="text", split="file", skip_bad=False):
    """
    Build the corpus `name` in the directory `final` from your files (read below), in the hub corpora's format.
    The rule: the documents, in reading order, shuffled with a fixed seed; the last 1 in OWN_VAL_EVERY (at least
    1) are the validation shard, the others training shards of OWN_SHARD_DOCS. The same documents give the same
    corpus (nothing is written again); changed ones rebuild the whole corpus. Returns (manifest, built now?).
    """
    sources = [os.path.abspath(os.path.expanduser(p)) for p in sources]  # --from=~/notes: no shell expands that ~
    docs = read_documents(sources, field=field, split=split, skip_bad=skip_bad)
    random.Random(0).shuffle(docs)  # so that every shard, and the validation shard, mixes all the files
    num_val = max(1, len(docs) // OWN_VAL_EVERY)
    train, val = docs[:-num_val], docs[-num_val:]
    if not train or sum(len(d) for d in val) < OWN_VAL_MIN_CHARS:
        advice = ", or split it with --split=paragraph (a document per paragraph)" if split == "file" else ""
        raise UserError(f"too little text for a validation shard: {len(docs):,} document(s) of {sum(map(len, docs)):,} "
                        f"characters; 1 in {OWN_VAL_EVERY} (at least one, and never all) are held out, and need "
                        f"{OWN_VAL_MIN_CHARS:,} characters: add text{advice}")
    digest = hashlib.sha256()
    utf8_bytes = 0
    for d in docs:  # the documents, in order, are the corpus: the fingerprint says whether they changed
        data = d.encode()
        digest.update(f"{len(d)}:".encode() + data)
        utf8_bytes += len(data)
    command = "python -m nanochat.dataset " + " ".join(f"--from={p}" for p in sources) + f" --name={name}"
    command += f" --field={field}" if field != "text" else ""
    command += f" --split={split}" if split != "file" else ""
    command += " --skip_bad" if skip_bad else ""
    manifest = dict(name=name, sources=sources, field=field, split=split, skip_bad=skip_bad,
                    fingerprint=digest.hexdigest(), documents=len(docs), characters=sum(map(len, docs)),
                    utf8_bytes=utf8_bytes, val_documents=num_val,
                    shards=(len(train) + OWN_SHARD_DOCS - 1) // OWN_SHARD_DOCS + 1, command=command)

    def unchanged():
        old = read_manifest(final)
        return old is not None and old["fingerprint"] == manifest["fingerprint"] and _intact(final, old)

    def write(tmp):
        _write_shards(tmp, train, val, OWN_SHARD_DOCS)
        write_json(os.path.join(tmp, MANIFEST), manifest, indent=1, ensure_ascii=False)
        return True

    if os.path.isdir(final) and read_manifest(final) is None and os.listdir(final):
        raise UserError(f"{final} exists and was not built by this command: move it away or choose another --name")
    built = _build_in_place(final, write, unchanged, lambda: utf8_bytes,
                            f"free space, then run `{command}` again") is not None
    return manifest, built


# -----------------------------------------------------------------------------
# Reading your files

TEXT_SUFFIXES = (".txt", ".text", ".md", ".markdown", ".rst")
SPLITS = ("file", "paragraph")
PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")  # a blank line (maybe with spaces) separates paragraphs


def _kind(path):
    """How a file is read, by its name: "jsonl", "parquet", "text", or None (not a kind read here)."""
    name = path.lower()
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text" if name.endswith(TEXT_SUFFIXES) else None


def source_files(paths):
    """[(path, kind)] of every file the paths name, in a fixed order (each path's files sorted), each once."""
    found = []
    other = {}
    for path in paths:
        if not os.path.exists(path):
            raise UserError(f"--from={path}: no such file or directory")
        if os.path.isfile(path):
            found.append((path, _kind(path) or "text"))
            continue
        before = len(found)
        for root, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(n for n in names if not n.startswith(".")):
                kind = _kind(name)
                if kind:
                    found.append((os.path.join(root, name), kind))
                else:
                    suffix = os.path.splitext(name)[1].lower() or "(no suffix)"
                    other[suffix] = other.get(suffix, 0) + 1
        if len(found) == before:
            raise UserError(f"--from={path}: no text files in it ({', '.join(TEXT_SUFFIXES)}, .jsonl, .parquet)"
                            + (f"; it holds {_count_text(other)}" if other else ""))
    if other:
        logger.info(f"Skipped {sum(other.values())} files of other kinds: {_count_text(other)}")
    unique = {}  # a file named twice (or reached through a link too) is read once, under the first name found
    for path, kind in found:
        unique.setdefault(os.path.realpath(path), (path, kind))
    return list(unique.values())


def _count_text(counts):
    return ", ".join(f"{n} {suffix}" for suffix, n in sorted(counts.items(), key=lambda kv: -kv[1])[:6])


def decode_text(path, data):
    """The UTF-8 text of `data` (the bytes of `path`), or UserError saying where it is not text."""
    if not data.strip():
        raise UserError(f"{path} is empty" + ("" if not data else " (only white space)"))
    nul = data.find(b"\0")
    if nul >= 0:
        raise UserError(f"{path} is binary, not text (a NUL byte at byte {nul:,})")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise UserError(f"{path} is not UTF-8: byte 0x{data[e.start]:02x} at line {line}, column {column} (byte "
                        f"{e.start:,}); convert it, e.g. `iconv -f GB18030 -t UTF-8 {path} > {path}.utf8` for "
                        f"Chinese in GBK/GB2312") from None
    return text.removeprefix("\ufeff").replace("\r\n", "\n")


def _jsonl_documents(path, text, field):
    docs = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise UserError(f"{path} line {number} is not JSON ({e})") from None
        if not isinstance(record, dict) or field not in record:
            fields = f"its fields: {', '.join(record)}" if isinstance(record, dict) else "it is not an object"
            raise UserError(f"{path} line {number} has no field {field!r} ({fields}); name the field with --field=")
        if not isinstance(record[field], str):
            raise UserError(f"{path} line {number}: field {field!r} is {type(record[field]).__name__}, not a string")
        docs.append(record[field])
    return docs


def _parquet_documents(path, field):
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises ArrowInvalid (a ValueError) or OSError, depending on the damage
        raise UserError(f"{path} is not a readable parquet file ({e})") from None
    if field not in table.column_names:
        raise UserError(f"{path} has no column {field!r} (its columns: {', '.join(table.column_names)}); name the "
                        f"column with --field=")
    column = table.column(field)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise UserError(f"{path}: column {field!r} holds {column.type}, not strings")
    return [d for d in column.to_pylist() if d]


def file_documents(path, kind, field="text", split="file"):
    """The documents of one file (list[str], none empty); UserError if it holds none or is not readable text."""
    if kind == "parquet":
        docs = _parquet_documents(path, field)
    else:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:  # unreadable (permissions, a broken link): the file's problem, skippable like the others
            raise UserError(f"{path} cannot be read ({e.strerror})") from None
        text = decode_text(path, data)
        if kind == "jsonl":
            docs = _jsonl_documents(path, text, field)
        elif split == "paragraph":
            docs = [p.strip("\n") for p in PARAGRAPH_BREAK.split(text)]
        else:
            docs = [text]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise UserError(f"{path} holds no text" + (f" in field {field!r}" if kind != "text" else ""))
    return docs


def read_documents(paths, field="text", split="file", skip_bad=False):
    """
    Every document of the files `paths` name (source_files), in a fixed order. skip_bad: a file with a problem is
    skipped with a warning instead of ending the build. UserError when nothing is left.
    """
    if split not in SPLITS:
        raise UserError(f"--split={split}: use one of {', '.join(SPLITS)}")
    docs = []
    skipped = []
    for path, kind in source_files(paths):
        try:
            docs.extend(file_documents(path, kind, field, split))
        except UserError as e:
            if not skip_bad:
                raise UserError(f"{e}. Fix or remove it, or add --skip_bad to skip such files") from None
            skipped.append(path)
            logger.warning(f"skipped: {e}")
    if skipped:
        logger.warning(f"Skipped {len(skipped)} file(s) that are not usable text (--skip_bad)")
    if not docs:
        raise UserError(f"no text left in {', '.join(paths)} after skipping {len(skipped)} unusable file(s)")
    return docs
