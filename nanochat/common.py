"""
What every script needs first: output, files, downloads, processes and devices, ranks agreeing, stopping.

Output (UserError, logging, print0, format_value); the base directory and files written all or nothing (a full disk:
DiskFull, one line); the locked download; compute_init for plain and torchrun launches; the collectives by which
ranks agree; Interrupted phases.
Importing this module touches no RNG, no process group and no handler of the importing program's loggers: it only
adds a NullHandler to the "nanochat" logger. configure() and compute_init() (scripts) run setup_default_logging():
then "nanochat" prints to stderr, not via the root logger, and a UserError ends the program in one line.
"""

import contextlib
import ctypes
import errno
import hashlib
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import urllib.parse

import torch
import torch.distributed as dist
from filelock import FileLock

logger = logging.getLogger(__name__)  # "nanochat.common", a child of the "nanochat" logger
logging.getLogger("nanochat").addHandler(logging.NullHandler())  # library etiquette: silent until configured

# -----------------------------------------------------------------------------
# Output

class UserError(Exception):
    """
    A mistake in the user's input (a setting, missing data or checkpoint, the launch), not a bug: scripts print
    it as one line, `error: <message>`, and exit 1. The message says what to do.
    """


def _user_error_hook(exc_type, exc, tb, _previous=sys.excepthook):
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    if exc_type.__name__ == "OutOfMemoryError":  # torch's (a GPU's memory): a size to lower, not a bug to report
        exc_type = UserError
        exc = UserError(f"out of memory ({'. '.join(str(exc).split('. ')[:2])}): lower --device_batch_size")
    if issubclass(exc_type, (UserError, KeyboardInterrupt)):  # Ctrl-C: a script without a stop protocol (evals, chat)
        text = f"error: {exc}" if issubclass(exc_type, UserError) else "interrupted (Ctrl-C)"
        print(f"{prefix}{text}", file=sys.stderr, flush=True)
        return
    _previous(exc_type, exc, tb)


def _use_color(stream):  # for a human at a terminal only; https://no-color.org: NO_COLOR (any value) turns them off
    return "NO_COLOR" not in os.environ and hasattr(stream, "isatty") and stream.isatty()


class ColoredFormatter(logging.Formatter):
    """
    `2025-12-25 10:00:01 - nanochat.dataset - INFO - Downloaded Shard 3 (95.2 MB)`; at a terminal the level is
    colored and INFO messages show sizes, percentages and shard numbers in bold (plain with NO_COLOR or no terminal).
    """

    COLORS = {"DEBUG": "\033[36m", "INFO": "\033[32m", "WARNING": "\033[33m", "ERROR": "\033[31m",
              "CRITICAL": "\033[35m"}
    BOLD = "\033[1m"
    RESET = "\033[0m"
    FIGURE = re.compile(r"(\d[\d,]*\.?\d*\s*(?:GB|MB|KB|%|docs))")
    SHARD = re.compile(r"(Shard \d+)")

    def __init__(self, color=True):
        super().__init__("%(asctime)s - %(name)s - %(levelname)s - %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
        self.color = color

    def format(self, record):
        if not self.color:
            return super().format(record)
        # work on a copy: other handlers of the same record must still see the plain text
        record = logging.makeLogRecord(record.__dict__)
        color = self.COLORS.get(record.levelname, "")
        record.levelname = f"{color}{self.BOLD}{record.levelname}{self.RESET}"
        message = record.getMessage()
        if record.levelno == logging.INFO:
            message = self.FIGURE.sub(lambda m: f"{self.BOLD}{m.group(1)}{self.RESET}", message)
            message = self.SHARD.sub(lambda m: f"{color}{self.BOLD}{m.group(1)}{self.RESET}", message)
        record.msg = message
        record.args = None
        return super().format(record)


def setup_default_logging(level=logging.INFO):
    """
    For scripts (configure() and compute_init() call it; idempotent): "nanochat" and its children log to stderr
    through ColoredFormatter, a UserError ends the program in one line. The root logger is never touched.
    """
    nano = logging.getLogger("nanochat")
    if not any(getattr(h, "_nanochat", False) for h in nano.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(ColoredFormatter(color=_use_color(sys.stderr)))
        handler._nanochat = True
        nano.addHandler(handler)
        nano.propagate = False  # our handler prints it; do not print it a second time via a root handler
    nano.setLevel(level)
    sys.excepthook = _user_error_hook


# Where stdout goes on a cluster: to files, not a terminal. torchrun's ranks write to its own stdout, one merged
# stream per machine (with --log-dir and --redirects or --tee: one file per rank); a scheduler (Slurm's srun, a
# Kubernetes job) writes what the processes print into log files on the shared network filesystem, one per rank
# (srun --output=log-%t) or one merged stream (the default), lines prefixed by their rank on request (srun --label).
# If every rank printed, each log line would be written N times to that filesystem (NFS, Lustre, Ceph), which every
# job of the cluster shares: N processes appending small writes, one per line (flush=True puts each line in the log
# at once, so a crash loses none), contention on file servers that other jobs wait on too, and in the merged stream
# N interleaved copies of every line. Rank 0 alone prints because the ranks run the same step: its line stands for
# all. Of a step line's numbers, the loss and the grad norm are over all ranks (the mean of the ranks' losses, the norm
# of the averaged gradient); dt, tok/s and MFU are rank 0's own timing (the ranks wait for each other in every step's
# collectives, so theirs is close to it) and the peak memory is rank 0's alone. What differs per rank is printed on
# purpose, prefixed "[rank r]" (each rank's first batch; a UserError, by _user_error_hook).
def print0(s="", **kwargs):
    """print() on rank 0 only, at any time (it reads $RANK): under torchrun every rank runs the script."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(s, flush=True, **kwargs)


def duration(seconds):
    """A duration for people: 45s, 6m, 1h05m."""
    if seconds < 3600:
        return f"{seconds:.0f}s" if seconds < 60 else f"{seconds / 60:.0f}m"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def format_value(v):
    """A number for people, in a log line or the report: 1.2346 (losses, bpb), 87.6, 12,345; anything else as it is."""
    if v is None or (isinstance(v, float) and (v != v or abs(v) == float("inf"))):
        return "n/a"  # None: e.g. no grad norm without clipping; never report a non-finite number as a result
    if not isinstance(v, float):
        return v
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.4f}"


def print_banner():
    """The nanochat banner; scripts print it at start-up so logs of different runs are easy to tell apart."""
    banner = r"""
                                          __          __
   ____   ____ _ ____   ____   _____ / /_   ____ _ / /_
  / __ \ / __ `// __ \ / __ \ / ___// __ \ / __ `// __/
 / / / // /_/ // / / // /_/ // /__ / / / // /_/ // /_
/_/ /_/ \__,_//_/ /_/ \____/ \___//_/ /_/ \__,_/ \__/
"""
    print0(banner)


# -----------------------------------------------------------------------------
# Files

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


def format_bytes(n):
    """A size for people: 512 B, 3.4 KB, 120.5 MB, 1.8 GB (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


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


def file_sha256(path):
    """The sha256 of a file's bytes, as a hex string."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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


# -----------------------------------------------------------------------------
# Processes and devices
#
# One process per device: `torchrun --nproc_per_node=N` starts N copies of the script (processes sidestep Python's
# GIL, so each drives its GPU at full speed) and tells each who it is in environment variables: LOCAL_RANK, its index
# on its own machine, 0..nproc_per_node-1, which selects the GPU (GPUs are numbered per machine); RANK, the global
# index 0..WORLD_SIZE-1: RANK = node_rank x nproc_per_node + LOCAL_RANK, node_rank being the machine's index
# (torchrun --node_rank), so on one machine RANK == LOCAL_RANK, on the 2nd of two 8-GPU machines RANK = 8 +
# LOCAL_RANK; WORLD_SIZE = machines x nproc_per_node = GPUs in use. Rank 0 prints, logs, and writes a checkpoint's
# weights and meta file; every rank writes its own optimizer shard (nanochat/checkpoint_manager.py).


def get_dist_info():
    """
    (ddp, rank, local_rank, world_size); outside torchrun (False, 0, 0, 1). Launched by torchrun (or any launcher
    setting the env:// variables) when any of RANK / LOCAL_RANK / WORLD_SIZE is set, not only RANK: all three must
    then be set and consistent (0 <= local_rank <= rank < world_size), or a UserError says which is not.
    """
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    if not any(v in os.environ for v in names):
        return False, 0, 0, 1
    found = ", ".join(f"{v}={os.environ[v]}" for v in names if v in os.environ)
    if any(v not in os.environ for v in names):
        missing = ", ".join(v for v in names if v not in os.environ)
        raise UserError(f"distributed launch is incomplete: {missing} not set (found {found}); launch with "
                        f"`torchrun --nproc_per_node=N -m scripts.X`, or unset them to run one process")
    try:
        rank, local_rank, world_size = (int(os.environ[v]) for v in names)
    except ValueError:
        raise UserError(f"RANK, LOCAL_RANK and WORLD_SIZE must be integers, got {found}") from None
    if not (world_size >= 1 and 0 <= rank < world_size and 0 <= local_rank <= rank):
        raise UserError(f"inconsistent distributed environment: RANK={rank} LOCAL_RANK={local_rank} "
                        f"WORLD_SIZE={world_size} (need 0 <= LOCAL_RANK <= RANK < WORLD_SIZE)")
    return True, rank, local_rank, world_size


def autodetect_device_type():
    """
    The best device PyTorch can see, cuda > mps > cpu (PyTorch answers "is X available" per backend; choosing is
    ours). AMD GPUs with a ROCm build of PyTorch report as "cuda" (HIP behind the torch.cuda API): the same path.
    TPUs need torch_xla and are not supported.
    """
    mps = hasattr(torch.backends, "mps") and torch.backends.mps.is_available()
    if torch.cuda.is_available():
        device_type = "cuda"
    else:
        device_type = "mps" if mps else "cpu"
    print0(f"Autodetected device type: {device_type}")
    return device_type


def compute_init(device_type="cuda"):
    """
    Set up the process for computing, once, at the top of every script (also its output: setup_default_logging).
    Returns (ddp, ddp_rank, ddp_local_rank, ddp_world_size, device); plain `python -m scripts.X`: (False, 0, 0, 1, ..):
      ddp            True under torchrun: there are other ranks to agree with (collectives, sharded optimizers)
      ddp_rank       global rank; rank 0 is the "master process" that prints, logs to wandb and writes a
                     checkpoint's weights and meta file (every rank writes its own optimizer shard)
      ddp_local_rank rank within this machine; selects the GPU (cuda:<local_rank>)
      ddp_world_size number of processes; divides the work (batch arithmetic, data striding)
      device         the torch.device this process computes on
    """
    setup_default_logging()
    if device_type not in ("cuda", "mps", "cpu"):
        raise UserError(f"unknown device_type {device_type!r}: use cuda, mps, cpu, or '' to autodetect")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise UserError("device_type=cuda but PyTorch sees no CUDA device (CPU-only torch build, or no GPU/driver); "
                        "use --device_type=cpu or leave it empty to autodetect")
    if device_type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise UserError("device_type=mps but MPS is not available (needs Apple Silicon and macOS 12.3+)")

    ddp, ddp_rank, ddp_local_rank, ddp_world_size = get_dist_info()
    if ddp and device_type == "mps":  # refused here, instead of an obscure crash at the first collective
        raise UserError("torchrun is not supported on MPS (a Mac has one GPU and no MPS process-group backend); "
                        "run the script with plain `python -m scripts.X` instead")

    # One seed on every rank, for whatever draws from the global RNG (the initial weights have a generator of their
    # own: GPT.init_weights). Ranks read different data because the loaders shard by rank, not by seed.
    torch.manual_seed(42)
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None) if device_type == "cpu" and sys.platform == "linux" else None
    if mallopt:
        # glibc: freed memory kept for the next step's tensors, not given back to come back as pages the kernel maps
        # and zeroes one fault at a time (docs/hardware.md, "Freed memory on a CPU")
        mallopt(-4, 0)  # M_MMAP_MAX: no block gets a mapping of its own
        mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD 2 GiB: the heap is not trimmed
    if device_type == "cuda":
        torch.cuda.manual_seed(42)
        # TF32 tensor cores for the fp32 matmuls bf16 autocast leaves (10-bit mantissa inputs, fp32 sums): much
        # faster on Ampere/Hopper, a precision loss irrelevant for training
        torch.set_float32_matmul_precision("high")
        # grow allocations in place: less fragmentation near full memory (read at the first CUDA allocation)
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if ddp and device_type == "cuda":
        if ddp_local_rank >= torch.cuda.device_count():  # more processes than this machine has GPUs
            raise UserError(f"LOCAL_RANK={ddp_local_rank} but only {torch.cuda.device_count()} CUDA device(s) are "
                            f"visible: --nproc_per_node must not exceed the GPUs of one machine")
        device = torch.device("cuda", ddp_local_rank)
        # set_device first, or every process creates its CUDA context (and NCCL its buffers) on GPU 0; device_id
        # binds the NCCL communicator to this GPU now instead of guessing later
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=device)
    elif ddp:  # gloo runs the same collectives on CPU: every distributed code path runs (and is tested) without GPUs
        device = torch.device("cpu")
        dist.init_process_group(backend="gloo")
    else:
        device = torch.device(device_type)
    # No barrier needed: _print_topology's all_gather is itself a collective every rank must reach
    _print_topology(ddp, ddp_rank, ddp_local_rank, ddp_world_size, device)
    return ddp, ddp_rank, ddp_local_rank, ddp_world_size, device


def _print_topology(ddp, rank, local_rank, world_size, device):
    rows = gather_from_ranks((rank, local_rank, world_size, str(device), socket.gethostname()))
    header = ("rank", "local_rank", "world_size", "device", "host")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    print0(f"Compute: ddp={ddp}, {world_size} process(es), one per device; rank 0 is the master process")
    print0("\n".join(fmt.format(*r) for r in [header, *rows]))


def is_distributed():
    """True under torchrun once compute_init has set up the process group: there are other ranks."""
    return dist.is_available() and dist.is_initialized()


def compute_cleanup():
    """End of a script: tear down the process group, so every rank exits cleanly."""
    if is_distributed():
        # every rank done with its last collective before any tears its end down (gloo's connections, NCCL's
        # communicator): a rank that left early would leave another's running collective without a peer (fail or hang)
        dist.barrier()
        dist.destroy_process_group()


# -----------------------------------------------------------------------------
# Ranks agreeing with each other (the same calls work in one process)

def gather_from_ranks(obj):
    """[obj of rank 0, obj of rank 1, ...] on every rank, for small picklable things; [obj] in one process."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def any_rank(*flags):
    """
    Each flag True on every rank if it is True on ANY rank (one all_reduce): a rank that stopped alone (a signal
    that reached it only, its data ran out first) would leave the others waiting in their next collective.
    """
    return tuple(v > 0 for v in _reduced([float(bool(f)) for f in flags], dist.ReduceOp.MAX))


def per_rank(value):
    """[value of rank 0, value of rank 1, ...] on every rank, for one number (a rank's loss, its token count)."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)
    return _reduced([float(value) if r == rank else 0.0 for r in range(world_size)])


def sum_over_ranks(*values):
    """The sum over all ranks of each number, on every rank (one all_reduce)."""
    return tuple(_reduced([float(v) for v in values]))


def _reduced(values, op=dist.ReduceOp.SUM):
    """The floats `values` reduced over the ranks, in float64 (as they are in one process)."""
    t = torch.tensor(values, dtype=torch.float64)
    if is_distributed():  # NCCL moves CUDA tensors only; gloo CPU tensors
        t = t.to(torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, op=op)
    return t.tolist()


# -----------------------------------------------------------------------------
# Long phases that a stop request cuts short


class Interrupted(Exception):
    """
    A long phase (an evaluation, sampling) stopped on a stop request (its `stop()`: a stage's StopRequest); its
    incomplete result is not reported. With collectives, raised on every rank at one point (interruptible).
    """


@contextlib.contextmanager
def interruptible():
    """
    `with interruptible(): <a rank's own share, which may raise Interrupted>`, then the phase's collectives: the
    Interrupted is held to the end of the block, where the ranks learn whether any was interrupted (one all_reduce)
    and all raise it together, or all go on. No rank is left waiting in a collective that the others skipped.
    """
    stopped = False
    try:
        yield
    except Interrupted:
        stopped = True
    if any_rank(stopped)[0]:
        raise Interrupted
