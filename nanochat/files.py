"""
The base directory, and files written all or nothing: a full disk (or quota) is one line, DiskFull.

  get_base_dir   where nanochat keeps everything (data, tokenizer, checkpoints, reports): every path starts there
  atomic_write   `with atomic_write(path) as f:` for every file that another process or a later run reads
  out_of_space   whether an exception, or one in its chain, is a write refused for lack of space (SPACE_ERRNOS)
  DiskFull       the one-line UserError to raise then, once what the failed write left is removed
  file_sha256    a file's sha256: a shard's checksum, checked when it is read again; what a cache was made from
  read_json      a JSON file kept for later (the report's states, a corpus's manifest, the probes' answers), or None
  write_json     writes one, through atomic_write

Importing this module touches no RNG, no process group and no handler of the importing program's loggers; the base
directory is created and checked at the first get_base_dir(), not at import.
"""

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile

from nanochat.output import UserError, format_bytes

_checked_base_dirs = set()


def get_base_dir():
    """
    Where nanochat writes everything (data, tokenizer, checkpoints, reports): $NANOCHAT_BASE_DIR, else
    ~/.cache/nanochat. Created on demand, checked once to be writable (at start-up, not at the first save).
    """
    base_dir = os.environ.get("NANOCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanochat")
    if base_dir not in _checked_base_dirs:
        hint = "set NANOCHAT_BASE_DIR to a writable directory"
        if os.path.exists(base_dir) and not os.path.isdir(base_dir):
            raise UserError(f"NANOCHAT_BASE_DIR {base_dir} is a file, not a directory: {hint}")
        try:
            os.makedirs(base_dir, exist_ok=True)
            with tempfile.TemporaryFile(dir=base_dir):
                pass
        except OSError as e:
            raise UserError(f"NANOCHAT_BASE_DIR {base_dir} cannot be created, or is not writable ({e.strerror}): "
                            f"{hint}") from None
        _checked_base_dirs.add(base_dir)
    return base_dir


SPACE_ERRNOS = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded"}


def out_of_space(e):
    """
    "no space left" (ENOSPC) or "disk quota exceeded" (EDQUOT) if the exception `e`, or one it was raised from or
    while handling, is a write refused for lack of space; None for anything else. The chain matters: torch.save
    reports the OSError of its file's write as a RuntimeError raised while handling it.
    """
    for _ in range(10):  # a chain is short; the bound guards against a cycle
        if e is None:
            return None
        if isinstance(e, DiskFull):
            return e.reason
        if isinstance(e, OSError) and e.errno in SPACE_ERRNOS:
            return SPACE_ERRNOS[e.errno]
        e = e.__cause__ or e.__context__
    return None


class DiskFull(UserError):
    """
    A write refused for lack of space or quota, in one line: what was being written, in which directory, how much
    it needs (`needed`: a phrase such as "about 1.2 GB", or None when unknown), how much is free there, and what to
    do (`again`). Raise it after removing what the failed write left: the free space it reports is then what the
    next attempt has.
    """

    def __init__(self, reason, what, directory, needed=None, again="free space, then run the same command again"):
        self.reason = reason  # SPACE_ERRNOS's words: what out_of_space() of this exception says
        try:
            free = format_bytes(shutil.disk_usage(directory).free)
        except OSError:
            free = "an unknown amount"
        need = f"it needs {needed}, " if needed else ""
        super().__init__(f"{reason} on {directory} while writing {what} ({need}{free} free there; nothing partial "
                         f"was kept): {again}")


@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """
    `with atomic_write(path) as f:` writes `path` all or nothing, via `<path>.tmp<pid>` renamed over it at the end
    (os.replace is atomic): `path` holds its old or its complete new content, never part. A full disk (or quota) is
    a one-line DiskFull, a read-only directory a one-line UserError; the temporary file is removed either way.
    Everything another process or a later run reads is written this way.
    """
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        reason = out_of_space(e)
        if reason is not None:
            raise DiskFull(reason, os.path.basename(path), os.path.dirname(os.path.abspath(path))) from None
        if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise UserError(f"cannot write {path}: {e.strerror}") from None
        raise


def read_json(path):
    """The JSON file at `path`, or None if there is none (or it is not JSON)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(path, obj, **options):
    """Write `obj` to `path` as JSON (json.dump's `options`: indent, ...), all or nothing (atomic_write)."""
    with atomic_write(path, "w") as f:
        json.dump(obj, f, **options)


def file_sha256(path):
    """The sha256 of a file's bytes, as a hex string."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
