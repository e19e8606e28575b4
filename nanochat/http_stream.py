"""
The HTTP side of download_file_with_lock (nanochat/common.py): stream one response to a file, and tell a
network that cannot be reached at all from a transient failure worth retrying.
"""

import hashlib
import logging
import os
import time

import requests

logger = logging.getLogger("nanochat.common")  # its records belong to the download that uses it


def stream_to_file(url, path, timeout):
    """
    GET `url` into `path` (raises on HTTP errors and on a connection closed before Content-Length bytes),
    logging the progress of files above 10 MB. Returns the sha256 of the bytes, hashed as they arrive.
    """
    # (connect, read) timeouts: connecting takes well under a second on a working network
    with requests.get(url, stream=True, timeout=(5, timeout)) as response:
        response.raise_for_status()
        total = int(response.headers.get("Content-Length") or 0)
        report_every = max(total // 10, 1)
        done, next_report, sha = 0, report_every, hashlib.sha256()
        t0 = time.time()
        with open(path, "wb") as f:
            for chunk in response.iter_content(chunk_size=1 << 20):
                f.write(chunk)
                sha.update(chunk)
                done += len(chunk)
                if total > 10 * 2**20 and done >= next_report:
                    logger.info(f"{os.path.basename(url)}: {done / 2**20:.1f} MB of {total / 2**20:.1f} MB "
                                f"({100 * done / total:.0f}%, {done / 2**20 / max(time.time() - t0, 1e-9):.1f} MB/s)")
                    next_report += report_every
        if total and done != total:
            raise IOError(f"connection closed after {done} of {total} bytes")
    return sha.hexdigest()


def unreachable_reason(e):
    """
    For a failure where the connection could not even be established (name not resolved, refused, no route,
    connect timeout): the short reason, e.g. "Connection refused". None for anything else (retry those).
    """
    from urllib3.exceptions import ConnectTimeoutError, NewConnectionError
    reason = getattr(e.args[0], "reason", None) if isinstance(e, requests.ConnectionError) and e.args else None
    if not (isinstance(e, requests.exceptions.ConnectTimeout) or isinstance(reason, (NewConnectionError, ConnectTimeoutError))):
        return None
    text = str(reason if reason is not None else e)
    return text.split(": ", 1)[-1] if ": " in text else text
