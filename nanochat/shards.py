"""
The on-disk format both corpora share (nanochat/dataset.py reads it, nanochat/pydocs.py writes it): parquet
shards `shard_00000.parquet`, ... with one string column `text` (a document per row), written in row groups
of ROW_GROUP_SIZE documents, and beside them SHA256SUMS, the sha256 of every shard recorded when it was written.
"""

import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
from filelock import FileLock

from nanochat.files import atomic_write

SHARD_RE = re.compile(r"^shard_(\d{5})\.parquet$")
ROW_GROUP_SIZE = 1024  # documents per row group: the unit the dataloader reads and strides over


def shard_name(index):
    return f"shard_{index:05d}.parquet"


def check_shard(path):
    """
    Raise IOError unless `path` is a readable parquet file with a string `text` column. Reads only the
    footer (a few KB), so checking every shard is cheap. A truncated file fails here: the footer, and the
    `PAR1` magic bytes that end every parquet file, are at its end.
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
