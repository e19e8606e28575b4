"""
Downloads into the base directory: one download however many processes ask, retried, checked, never half a file.

  download_file_with_lock   every file a script fetches over the network (the hub corpora's shards, the CORE
                            bundle, task data); why the lock and the second look under it: its docstring

Importing this module touches no RNG, no process group and no handler of the importing program's loggers; it logs
(a large file's progress, a retry) to "nanochat.downloads", which a script's setup_default_logging() prints;
requests is imported at the first download.
"""

import hashlib
import logging
import os
import time
import urllib.parse

from filelock import FileLock

from nanochat.files import DiskFull, get_base_dir, out_of_space
from nanochat.output import UserError, format_bytes

logger = logging.getLogger(__name__)  # "nanochat.downloads", a child of the "nanochat" logger


def download_file_with_lock(url, filename, postprocess_fn=None, expected_sha256=None,
                            retries=5, timeout=30, backoff=2.0, retry_command=None):
    """
    Download `url` to `<base_dir>/<filename>` once, however many processes ask at the same time; returns the path.
    Why a lock: torchrun starts N copies of the script at once; without one all N download the file, and each,
    taking the others' temporary files for a dead downloader's, deletes them mid-download. So: (1) the file exists
    -> return it, no lock; (2) take an inter-process file lock (`<path>.lock`), the others wait; (3) check again
    under the lock (double-checked locking: whoever held it may have just downloaded it; without this check every
    process that waited would download the file again, in turn: N downloads, not one); (4) stream into
    `<path>.tmp<pid>`, check the optional sha256, run the optional postprocess_fn(tmp), os.replace it to the final
    name, which never holds partial bytes. After a kill -9 the OS frees the lock; the next downloader removes the
    temporary file. An unreachable host: UserError at once (naming `retry_command`); a full disk: DiskFull at once
    (another attempt would only fill it again); transient failures (5xx, 429, a dropped connection, a read timeout):
    `retries` attempts in all, exponential backoff; other 4xx: final.
    """
    import requests  # imported here: only code paths that download need it

    file_path = os.path.join(get_base_dir(), filename)
    if os.path.exists(file_path):
        return file_path
    os.makedirs(os.path.dirname(file_path), exist_ok=True)
    with FileLock(file_path + ".lock"):
        if os.path.exists(file_path):
            return file_path
        # We hold the lock, so any temp file left here belongs to a downloader that died: remove it.
        prefix = os.path.basename(file_path) + ".tmp"
        for stale in os.listdir(os.path.dirname(file_path)):
            if stale.startswith(prefix):
                os.remove(os.path.join(os.path.dirname(file_path), stale))
        tmp_path = f"{file_path}.tmp{os.getpid()}"
        again = f"; then run `{retry_command}` again" if retry_command else "; then run the same command again"
        for attempt in range(1, retries + 1):
            size = []  # the Content-Length, once the response has one: what a full disk needed
            try:
                digest = _stream_to_file(url, tmp_path, timeout, size)
                if expected_sha256 is not None and digest != expected_sha256:
                    raise IOError(f"sha256 mismatch for {url}: expected {expected_sha256}, got {digest}")
                if postprocess_fn is not None:
                    postprocess_fn(tmp_path)
                os.replace(tmp_path, file_path)
                return file_path
            except (requests.RequestException, IOError) as e:
                full = out_of_space(e)
                if full is not None:
                    if os.path.exists(tmp_path):  # removed first: the free space reported is the next attempt's
                        os.remove(tmp_path)
                    needed = f"about {format_bytes(size[0])}" if size and size[0] else None
                    raise DiskFull(full, f"{os.path.basename(file_path)} from {url}", os.path.dirname(file_path),
                                   needed, "free space" + again) from None
                reason = _unreachable_reason(e)
                if reason is not None:
                    host = urllib.parse.urlsplit(url).netloc
                    raise UserError(f"cannot reach {host} to download {url} ({reason}): check the network "
                                    f"connection (or the mirror URL){again}") from None
                status = getattr(getattr(e, "response", None), "status_code", None)
                permanent = status is not None and 400 <= status < 500 and status != 429
                if permanent or attempt == retries:
                    raise UserError(f"could not download {url} -> {file_path} after {attempt} attempt(s): "
                                    f"{e}{again}") from None
                wait = backoff ** attempt
                logger.warning(f"download of {url} failed ({e}); retry {attempt}/{retries - 1} in {wait:.0f}s")
                time.sleep(wait)
            finally:
                if os.path.exists(tmp_path):
                    os.remove(tmp_path)


def _stream_to_file(url, path, timeout, size):
    """
    GET `url` into `path`, logging the progress of files above 10 MB; the sha256 of the bytes. Appends the
    Content-Length (0: none) to the list `size`. Raises on HTTP errors and on a connection closed before
    Content-Length bytes.
    """
    import requests
    with requests.get(url, stream=True, timeout=(5, timeout)) as response:  # (connect, read) timeouts
        response.raise_for_status()
        total = int(response.headers.get("Content-Length") or 0)
        size.append(total)
        done = 0
        next_report = total // 10
        sha = hashlib.sha256()
        t0 = time.time()
        with open(path, "wb") as f:
            for chunk in response.iter_content(chunk_size=1 << 20):
                f.write(chunk)
                sha.update(chunk)
                done += len(chunk)
                if total > 10 * 2**20 and done >= next_report:  # every 10% of a large file
                    logger.info(f"{os.path.basename(url)}: {done / 2**20:.1f} MB of {total / 2**20:.1f} MB "
                                f"({100 * done / total:.0f}%, {done / 2**20 / max(time.time() - t0, 1e-9):.1f} MB/s)")
                    next_report += total // 10
        if total and done != total:
            raise IOError(f"connection closed after {done} of {total} bytes")
    return sha.hexdigest()


def _unreachable_reason(e):
    """The short reason ("Connection refused") when no connection could be established at all; None otherwise."""
    import requests
    from urllib3.exceptions import ConnectTimeoutError, NewConnectionError
    reason = getattr(e.args[0], "reason", None) if isinstance(e, requests.ConnectionError) and e.args else None
    if isinstance(e, requests.exceptions.ConnectTimeout) or isinstance(reason, (NewConnectionError,
                                                                                  ConnectTimeoutError)):
        return str(reason if reason is not None else e).split(": ", 1)[-1]
