"""
Common utilities shared by every nanochat script. Read top to bottom:

1. Logging and output: ColoredFormatter, setup_default_logging, print0, print_banner, UserError.
2. Files: get_base_dir, download_file_with_lock.
3. Devices and distributed training: is_ddp, get_dist_info, autodetect_device_type, compute_init,
   compute_cleanup, autocast_dtype.
4. Experiment tracking: DummyWandb, init_wandb.

Importing this module has no side effects on the program that imports it: it does not touch the root
logger, does not seed RNGs and does not start process groups. Scripts opt in by calling
setup_default_logging() (the configurator does it) and compute_init().
"""

import contextlib
import difflib
import errno
import hashlib
import json
import logging
import math
import os
import re
import signal
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
# 1. Logging and output


class UserError(Exception):
    """
    An error caused by the user's input (a config value, missing data, a missing checkpoint, the launch
    environment), as opposed to a bug. Scripts print it as one line, `error: <message>`, and exit with
    status 1: no traceback, because the message already says what is wrong and what to do.
    """


def _user_error_hook(exc_type, exc, tb, _previous=sys.excepthook):
    if issubclass(exc_type, UserError):
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
        print(f"{prefix}error: {exc}", file=sys.stderr, flush=True)
        return
    _previous(exc_type, exc, tb)


def _use_color(stream):
    """Colors only for a human at a terminal; https://no-color.org says NO_COLOR (any value) turns them off."""
    return "NO_COLOR" not in os.environ and hasattr(stream, "isatty") and stream.isatty()


class ColoredFormatter(logging.Formatter):
    """
    Log format `2025-12-25 10:00:01 - nanochat.dataset - INFO - Downloaded Shard 3 (95.2 MB)`.
    At a terminal the level name is colored (DEBUG cyan, INFO green, WARNING yellow, ERROR red,
    CRITICAL magenta) and INFO messages get the figures a training log is scanned for in bold:
    sizes and counts like `15.5 GB`, `200 MB`, `45%`, `1,024 docs`, and data shard names like `Shard 12`.
    Without a terminal (a log file, a pipe, CI) or with NO_COLOR set, the same text comes out plain.
    """

    COLORS = {"DEBUG": "\033[36m", "INFO": "\033[32m", "WARNING": "\033[33m", "ERROR": "\033[31m", "CRITICAL": "\033[35m"}
    BOLD, RESET = "\033[1m", "\033[0m"
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
        record.msg, record.args = message, None
        return super().format(record)


def setup_default_logging(level=logging.INFO):
    """
    Called once by a script (the configurator calls it): logs of the "nanochat" logger and its children
    go to stderr through ColoredFormatter, and a UserError ends the program with a one-line message.
    Only the "nanochat" logger is configured, never the root logger, so a program that imports nanochat
    as a library keeps its own logging setup. Idempotent.
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


def print0(s="", **kwargs):
    """
    print() on rank 0 only. Under torchrun every process runs the same script, so a plain print would
    show each line world_size times (and make world_size processes write to the same log on a shared
    filesystem). Works before and after compute_init: the rank comes from the RANK variable torchrun sets.
    """
    if int(os.environ.get("RANK", 0)) == 0:
        print(s, flush=True, **kwargs)


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
# 2. Files


# Exit codes of the training stages (speedrun.sh stops at anything non-zero):
EXIT_OK = 0
EXIT_USER_ERROR = 1  # a UserError: bad input, missing data; the one-line message says what to do
EXIT_STOPPED_EARLY = 75  # stopped before the planned last step (SIGTERM / Ctrl-C): a checkpoint was saved,
#                          resume with --resume_from_step (75 = EX_TEMPFAIL of sysexits.h: "try again later")

_checked_base_dirs = set()


def get_base_dir():
    """
    The directory for everything nanochat writes: data shards, tokenizer, checkpoints, reports.
    $NANOCHAT_BASE_DIR if set, else ~/.cache/nanochat. Created on demand, and checked once per process to be
    a writable directory (UserError otherwise: better at start-up than when the first checkpoint is saved).
    """
    base_dir = os.environ.get("NANOCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanochat")
    if base_dir not in _checked_base_dirs:
        hint = "set NANOCHAT_BASE_DIR to a writable directory"
        try:
            os.makedirs(base_dir, exist_ok=True)
        except FileExistsError:
            raise UserError(f"NANOCHAT_BASE_DIR {base_dir} is a file, not a directory: {hint}") from None
        except OSError as e:
            raise UserError(f"cannot create NANOCHAT_BASE_DIR {base_dir} ({e.strerror}): {hint}") from None
        try:
            with tempfile.TemporaryFile(dir=base_dir):
                pass
        except OSError as e:
            raise UserError(f"NANOCHAT_BASE_DIR {base_dir} is not writable ({e.strerror}): {hint}") from None
        _checked_base_dirs.add(base_dir)
    return base_dir


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


def download_file_with_lock(url, filename, postprocess_fn=None, expected_sha256=None,
                            retries=5, timeout=30, backoff=2.0, retry_command=None):
    """
    Download `url` to `<base_dir>/<filename>` once, however many processes ask at the same time, and
    return the local path.

    Why a lock: `torchrun --nproc_per_node=8` starts 8 copies of the script at once. Without a lock all 8
    see "file missing", all 8 download, and all 8 write the same file, interleaving bytes. With it:

    1. Fast path, no lock: the file exists -> return it (the common case once downloaded).
    2. Take an inter-process file lock (`<path>.lock`). One process gets it, the others wait.
    3. Check again under the lock (double-checked locking): whoever held the lock before us may have just
       finished the download, and we must not download it a second time.
    4. Stream to a temporary file in the same directory, verify the optional sha256, run the optional
       `postprocess_fn(tmp_path)`, and only then `os.replace` it to the final name. The rename is atomic
       on one filesystem, so the final path either does not exist or holds complete bytes: a process
       killed with -9 mid-download leaves only a `.tmp` file (removed by the next downloader, who holds
       the lock) and the OS releases its lock with the process, so the next call simply downloads again.

    Failures: a host that cannot be reached at all (name not resolved, connection refused, no route,
    connect timeout of 5 s) fails at once with a UserError, because waiting will not fix a missing network
    and a user should not sit through half a minute of retries to learn that; the message names
    `retry_command` (the command to run again) when the caller gives one. Transient failures (HTTP 5xx/429,
    a connection dropped mid-transfer, a read timeout of `timeout` s) are retried `retries` times with
    exponential backoff. HTTP 4xx is permanent: no retries. Files above 10 MB log their progress.
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
        for attempt in range(1, retries + 1):
            try:
                _stream_to_file(requests, url, tmp_path, timeout)
                if expected_sha256 is not None and file_sha256(tmp_path) != expected_sha256:
                    raise IOError(f"sha256 mismatch for {url}: expected {expected_sha256}, got {file_sha256(tmp_path)}")
                if postprocess_fn is not None:
                    postprocess_fn(tmp_path)
                os.replace(tmp_path, file_path)
                return file_path
            except (requests.RequestException, IOError) as e:
                again = f"; then run `{retry_command}` again" if retry_command else "; then run the same command again"
                if _unreachable(e):
                    host = urllib.parse.urlsplit(url).netloc
                    raise UserError(f"cannot reach {host} to download {url} ({_short_reason(e)}): check the network "
                                    f"connection (or the mirror URL){again}") from None
                status = getattr(getattr(e, "response", None), "status_code", None)
                permanent = status is not None and 400 <= status < 500 and status != 429
                if permanent or attempt == retries:
                    raise UserError(f"could not download {url} -> {file_path} after {attempt} attempt(s): {e}{again}") from None
                wait = backoff ** attempt
                logger.warning(f"download of {url} failed ({e}); retry {attempt}/{retries - 1} in {wait:.0f}s")
                time.sleep(wait)
            finally:
                if os.path.exists(tmp_path):
                    os.remove(tmp_path)


def _unreachable(e):
    """True if the connection could not even be established: DNS failure, refused, no route, connect timeout."""
    import requests
    from urllib3.exceptions import ConnectTimeoutError, NewConnectionError
    if isinstance(e, requests.exceptions.ConnectTimeout):
        return True
    reason = getattr(e.args[0], "reason", None) if isinstance(e, requests.ConnectionError) and e.args else None
    return isinstance(reason, (NewConnectionError, ConnectTimeoutError))


def _short_reason(e):
    reason = getattr(e.args[0], "reason", e) if e.args else e
    text = str(reason)
    return text.split(": ", 1)[-1] if ": " in text else text


def _stream_to_file(requests, url, path, timeout):
    # (connect, read) timeouts: connecting takes well under a second on a working network
    with requests.get(url, stream=True, timeout=(5, timeout)) as response:
        response.raise_for_status()
        total = int(response.headers.get("Content-Length") or 0)
        report_every = max(total // 10, 1)
        done, next_report = 0, report_every
        t0 = time.time()
        with open(path, "wb") as f:
            for chunk in response.iter_content(chunk_size=1 << 20):
                f.write(chunk)
                done += len(chunk)
                if total > 10 * 2**20 and done >= next_report:
                    logger.info(f"{os.path.basename(url)}: {done / 2**20:.1f} MB of {total / 2**20:.1f} MB "
                                f"({100 * done / total:.0f}%, {done / 2**20 / max(time.time() - t0, 1e-9):.1f} MB/s)")
                    next_report += report_every
        if total and done != total:
            raise IOError(f"connection closed after {done} of {total} bytes")


# -----------------------------------------------------------------------------
# 3. Devices and distributed training
#
# One process per device: `torchrun --nproc_per_node=N` starts N copies of the script (separate processes
# sidestep Python's GIL, so each can drive its GPU at full speed) and tells each who it is through
# environment variables:
#   RANK        global index of this process, 0..WORLD_SIZE-1 (rank 0 prints, logs and saves)
#   LOCAL_RANK  index of this process on its own machine, 0..nproc_per_node-1: it selects the GPU,
#               because GPUs are numbered per machine. On one machine RANK == LOCAL_RANK; on the 2nd of
#               two 8-GPU machines RANK = 8 + LOCAL_RANK.
#   WORLD_SIZE  number of processes in total = machines x nproc_per_node = number of GPUs in use.


def is_ddp():
    """
    True when launched by torchrun (or another launcher that sets the env:// variables), i.e. when any
    of RANK / LOCAL_RANK / WORLD_SIZE is set. A plain `python -m scripts.X` sets none of them.
    Deciding on any one of the three (not only RANK) means a half-set environment is caught by
    get_dist_info() with a clear error instead of silently running single-process.
    """
    return any(v in os.environ for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


def get_dist_info():
    """
    Returns (ddp, rank, local_rank, world_size). Outside torchrun: (False, 0, 0, 1).
    Under torchrun all three variables must be set and consistent (0 <= rank < world_size,
    0 <= local_rank <= rank); anything else raises UserError saying which variable is wrong.
    """
    if not is_ddp():
        return False, 0, 0, 1
    missing = [v for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE") if v not in os.environ]
    if missing:
        raise UserError(f"distributed launch is incomplete: {', '.join(missing)} not set (found "
                        f"{', '.join(f'{v}={os.environ[v]}' for v in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE') if v in os.environ)}); "
                        f"launch with `torchrun --nproc_per_node=N -m scripts.X`, or unset them to run one process")
    try:
        rank, local_rank, world_size = (int(os.environ[v]) for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    except ValueError:
        raise UserError(f"RANK/LOCAL_RANK/WORLD_SIZE must be integers, got {os.environ['RANK']!r}/"
                        f"{os.environ['LOCAL_RANK']!r}/{os.environ['WORLD_SIZE']!r}") from None
    if not (world_size >= 1 and 0 <= rank < world_size and 0 <= local_rank <= rank):
        raise UserError(f"inconsistent distributed environment: RANK={rank} LOCAL_RANK={local_rank} WORLD_SIZE={world_size} "
                        f"(need 0 <= LOCAL_RANK <= RANK < WORLD_SIZE)")
    return True, rank, local_rank, world_size


def autodetect_device_type():
    """
    The best device PyTorch can see, in order cuda > mps > cpu. PyTorch answers "is X available" per
    backend; choosing among them is ours. AMD GPUs with a ROCm build of PyTorch report as "cuda" (HIP is
    exposed through the torch.cuda API), so they are picked up here unchanged. TPUs need torch_xla and are
    not supported.
    """
    if torch.cuda.is_available():
        device_type = "cuda"
    elif hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
        device_type = "mps"
    else:
        device_type = "cpu"
    print0(f"Autodetected device type: {device_type}")
    return device_type


def compute_init(device_type="cuda"):
    """
    Set up the process for computing; call once at the top of every script.
    Returns (ddp, ddp_rank, ddp_local_rank, ddp_world_size, device):
      ddp            True under torchrun; guards every collective (all_reduce, barrier) in the scripts
      ddp_rank       global rank; rank 0 is the "master process" that prints, logs to wandb and saves
      ddp_local_rank rank within this machine; selects the GPU (cuda:<local_rank>)
      ddp_world_size number of processes; divides the work (batch arithmetic, data striding)
      device         the torch.device this process computes on
    Plain `python -m scripts.X` (e.g. on a Mac): (False, 0, 0, 1, mps or cpu).
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
    if ddp and device_type == "mps":
        # There is no multi-process backend for MPS, and a Mac has one GPU anyway. Refusing here replaces
        # a later, obscure crash at the first collective.
        raise UserError("torchrun is not supported on MPS (a Mac has one GPU and no MPS process-group backend); "
                        "run the script with plain `python -m scripts.X` instead")

    # Same seed on every rank: every rank builds bit-identical initial weights, so no broadcast is needed.
    # Data is not made different by seeds: each rank reads different rows of the data because the
    # loaders shard by rank explicitly.
    torch.manual_seed(42)
    if device_type == "cuda":
        torch.cuda.manual_seed(42)
        # fp32 matmuls may use TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation): several
        # times faster on Ampere/Hopper, precision loss irrelevant for training. bf16 autocast covers
        # most matmuls anyway; this affects the ones that still run in fp32.
        torch.set_float32_matmul_precision("high")

    if device_type == "cuda":
        # grow allocations in place instead of keeping fixed-size blocks: less fragmentation when nearly all
        # of the GPU's memory is in use (read at the first CUDA allocation, which has not happened yet)
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if ddp and device_type == "cuda":
        if ddp_local_rank >= torch.cuda.device_count():
            raise UserError(f"LOCAL_RANK={ddp_local_rank} but only {torch.cuda.device_count()} CUDA device(s) are visible: "
                            f"--nproc_per_node must not exceed the GPUs of one machine")
        device = torch.device("cuda", ddp_local_rank)
        # set_device first: otherwise every process creates its CUDA context (and NCCL its buffers) on
        # GPU 0. device_id binds the NCCL communicator to this GPU eagerly instead of guessing later.
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=device)
    elif ddp:
        device = torch.device("cpu")
        # gloo runs the same collectives on CPU, so every distributed code path runs (and is tested)
        # without GPUs: `torchrun --nproc_per_node=2 -m scripts.base_train --device_type=cpu`.
        dist.init_process_group(backend="gloo")
    else:
        device = torch.device(device_type)
    # No barrier is needed here: init_process_group returns only when every rank has joined the rendezvous,
    # and _print_topology's all_gather_object is itself a collective that every rank must reach.
    _print_topology(ddp, ddp_rank, ddp_local_rank, ddp_world_size, device)
    return ddp, ddp_rank, ddp_local_rank, ddp_world_size, device


def gather_from_ranks(obj):
    """
    [obj of rank 0, obj of rank 1, ...], on every rank (dist.all_gather_object: any picklable object); [obj]
    in a single process. For small things each rank holds on its own: its data position, what it read.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _print_topology(ddp, rank, local_rank, world_size, device):
    rows = gather_from_ranks((rank, local_rank, world_size, str(device), socket.gethostname()))
    header = ("rank", "local_rank", "world_size", "device", "host")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    print0(f"Compute: ddp={ddp}, {world_size} process(es), one per device; rank 0 is the master process")
    print0(fmt.format(*header))
    for r in rows:
        print0(fmt.format(*r))


def compute_cleanup():
    """End of a script: tear down the process group so every rank exits cleanly (no NCCL/gloo warnings)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def autocast_dtype(device_type):
    """
    The dtype matmuls run in, by device. bf16 autocast on CUDA GPUs that do bf16 natively (SM80+: A100,
    H100); fp32 on CPU and MPS, because a CPU without native bf16 emulates it about 100x slower.
    $NANOCHAT_DTYPE=bfloat16|float32 overrides. Weights and optimizer state always stay fp32.
    """
    override = os.environ.get("NANOCHAT_DTYPE")
    if override:
        if override not in ("bfloat16", "float32"):
            raise UserError(f"NANOCHAT_DTYPE={override!r}: use bfloat16 or float32")
        return getattr(torch, override)
    if device_type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def grad_accum_steps_for(total_batch_size, device_batch_size, max_seq_len, world_size):
    """
    Micro-steps per optimizer step: total_batch_size / (device_batch_size x max_seq_len x world_size), which
    must be a whole number. If not, a UserError names the values and suggests ones that work.
    """
    per_micro = device_batch_size * max_seq_len * world_size  # tokens of one micro-step on all ranks together
    if total_batch_size % per_micro == 0 and total_batch_size > 0:
        return total_batch_size // per_micro
    lower = total_batch_size // per_micro * per_micro
    options = [f"--total_batch_size={v}" for v in (lower, lower + per_micro) if v > 0]
    rows = [b for b in range(device_batch_size, 0, -1) if total_batch_size % (b * max_seq_len * world_size) == 0][:3]
    options += [f"--device_batch_size={b}" for b in rows]
    raise UserError(f"total_batch_size {total_batch_size:,} is not a multiple of device_batch_size x max_seq_len x "
                    f"world_size = {device_batch_size} x {max_seq_len} x {world_size} = {per_micro:,}; "
                    f"try {' or '.join(options)}")


PEAK_BF16_FLOPS = {  # dense bf16 tensor-core datasheet peaks, per GPU
    "H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "B200": 2250e12,
    "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12, "RTX 4090": 165e12,
}


def measure_matmul_flops(device, dtype, n=1024, repeats=5):
    """Best observed FLOP/s of an n x n x n matmul on `device` in `dtype` (a few warm-ups, then timed runs)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def get_peak_flops(device, dtype):
    """
    The denominator of MFU (model FLOPs utilisation = achieved model FLOP/s / peak FLOP/s), per device.
    Returns (flops, how it was got).

    - Known CUDA GPUs in bf16: the datasheet dense bf16 peak (an H100 SXM: 989 TFLOP/s).
    - $NANOCHAT_PEAK_FLOPS (a number, e.g. 1.5e11): use that, for machines where you know better.
    - Anything else (CPU, MPS, unknown GPUs): measured, as the best FLOP/s of several matmuls in the dtype we
      compute in (1024^3 and 2048^3: the large one is what a well-fed BLAS reaches; on a CPU also one thread's
      best times the number of threads, which a program busy on another core does not lower). A measurement can only
      come out too LOW (another program busy at that moment, a CPU still clocking up), never too high, so
      the best value ever measured on this machine (same CPU/GPU model, thread count and dtype) is kept in
      <base_dir>/peak_flops.json and a lower reading never replaces it: a loaded moment at start-up cannot
      inflate the MFU of the run.
    """
    device = torch.device(device)
    if device.type == "cuda" and dtype == torch.bfloat16:
        name = torch.cuda.get_device_name(device)
        for key, flops in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0])):
            if key in name:
                return flops, f"{name} datasheet bf16 peak"
    override = os.environ.get("NANOCHAT_PEAK_FLOPS")
    if override:
        try:
            flops = float(override)
        except ValueError:
            flops = 0.0
        if not (0 < flops < float("inf")):
            raise UserError(f"NANOCHAT_PEAK_FLOPS={override!r}: need a positive number of FLOP/s, e.g. 1.5e11")
        return flops, "NANOCHAT_PEAK_FLOPS"
    dtype_name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = f"{cpu_model_name()}, {torch.get_num_threads()} threads" if device.type == "cpu" else device.type
    measured = max(measure_matmul_flops(device, dtype, n=1024, repeats=8),
                   measure_matmul_flops(device, dtype, n=2048, repeats=3))
    if device.type == "cpu" and torch.get_num_threads() > 1:
        # A program busy on one core at this moment would halve a measurement with every thread; one thread
        # finds a free core, and a large matmul scales linearly with threads. Take the larger of the two.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            measured = max(measured, threads * measure_matmul_flops(device, dtype, n=1024, repeats=8))
        finally:
            torch.set_num_threads(threads)
    path = os.path.join(get_base_dir(), "peak_flops.json")
    key = f"{hardware} | {dtype_name}"
    with FileLock(path + ".lock"):
        try:
            with open(path, encoding="utf-8") as f:
                known = json.load(f)
        except (OSError, ValueError):
            known = {}
        best = max(measured, float(known.get(key, 0.0)))
        if best > known.get(key, 0.0):
            known[key] = best
            with atomic_write(path, "w") as f:
                json.dump(known, f, indent=2)
    return best, (f"measured: best {dtype_name} matmul on {hardware} (this run {measured:.3e}; "
                  f"the best of every run on this machine is kept in {path})")


def cpu_model_name():
    """The CPU's marketing name (for reports and the MFU peak's cache key)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


class StopRequest:
    """
    Stop a training stage cleanly on SIGTERM (a scheduler's "your time is up", `kill`) or SIGINT (Ctrl-C):
    finish the current step, save a checkpoint, exit with EXIT_STOPPED_EARLY. A second signal kills at once.

        stop_request = StopRequest(ddp_rank)
        ... at the end of each step: share float(stop_request.requested) with the other ranks ...

    The signal may reach the ranks at different moments (or only one of them), so a rank only records it;
    the training loop shares the flag with the other ranks through its end-of-step all_reduce, and all ranks
    stop after the same step. Stopping on one rank alone would leave the others waiting forever in the next
    collective.
    """

    def __init__(self, rank):
        self.rank, self.requested = rank, False
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        print(f"[rank {self.rank}] got {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
              f"(send it again to quit at once)", flush=True)
        self.requested = True
        signal.signal(signum, signal.SIG_DFL)


def check_finite(step, loss, grad_norm, last_saved_step, lr_keys):
    """
    Stop at the first non-finite loss or gradient norm: the weights are about to be (or already are)
    NaN, and every later step and checkpoint would be garbage. Raised before the next save, so no
    checkpoint newer than the last finite one is written.
    """
    if math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm)):
        return
    what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}"
    saved = f"the last checkpoint is step {last_saved_step}" if last_saved_step is not None else "no checkpoint was saved"
    raise UserError(f"step {step}: {what} is not finite, training diverged ({saved}; nothing newer is saved). The likely "
                    f"knob is the learning rate: lower {', '.join('--' + k for k in lr_keys)} (or raise --warmup_ratio), "
                    f"then resume from the last checkpoint or start again")


# -----------------------------------------------------------------------------
# 4. Experiment tracking


class DummyWandb:
    """Stands in for a wandb run when tracking is off (run name "dummy", or a rank other than 0)."""

    def log(self, *args, **kwargs):
        pass

    def finish(self):
        pass


def init_wandb(run, master_process, config, project="nanochat"):
    """
    A real wandb run on the master process unless `run == "dummy"`; DummyWandb otherwise. Checked at
    start-up, before any training: a run name without a way to log (no `wandb login`, no WANDB_API_KEY, and
    WANDB_MODE not offline/disabled) is a UserError now, not a prompt or a crash hours later.
    """
    if run == "dummy" or not master_process:
        return DummyWandb()
    import wandb
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode not in ("offline", "disabled", "dryrun") and not _wandb_has_login():
        raise UserError(f"--run={run} logs to wandb, but wandb has no login on this machine: run `wandb login` "
                        f"(or set WANDB_API_KEY), set WANDB_MODE=offline to log locally, or leave --run out")
    return wandb.init(project=project, name=run, config=config)


def _wandb_has_login():
    """An API key in the environment or in ~/.netrc (where `wandb login` writes it)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    try:
        hosts = netrc.netrc(os.environ.get("NETRC")).hosts
    except (OSError, netrc.NetrcParseError):
        return False
    base_url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    return urllib.parse.urlsplit(base_url).hostname in hosts


def closest(name, candidates, n=3):
    """Helper for error messages: the candidates that look most like a mistyped `name`."""
    return difflib.get_close_matches(name, list(candidates), n=n, cutoff=0.5)
