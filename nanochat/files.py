"""
Writing files all or nothing, and hashing them. Everything nanochat writes that another process, or a later
run, reads back (checkpoints, tokenizer files, shard checksums, the MFU peak cache, metrics) goes through
atomic_write, so a crash or a full disk never leaves a half-written file under a real name.
"""

import contextlib
import errno
import hashlib
import os

from nanochat.common import UserError


@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """
    Write `path` all or nothing: yields a file object for a temporary file beside it (`<path>.tmp<pid>`),
    renamed over `path` when the block ends without an error. os.replace is atomic on one filesystem, so
    `path` always holds either its old content or the complete new one: a crash or a kill mid-write leaves
    at most the temporary file, which this removes on any error (a kill -9 leaves it for the next writer
    of the directory to clean up). A full disk or a read-only directory becomes a one-line UserError.

        with atomic_write(path) as f:
            torch.save(obj, f)
    """
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise UserError(f"no space left on {os.path.dirname(os.path.abspath(path))} while writing "
                            f"{os.path.basename(path)} (nothing partial was kept): free some space and run again") from None
        if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise UserError(f"cannot write {path}: {e.strerror}") from None
        raise


def file_sha256(path):
    """The sha256 of a file's bytes, as a hex string."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
