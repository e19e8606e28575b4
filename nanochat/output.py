"""
What a script shows its user: one-line errors (UserError), the "nanochat" logger, print0, numbers for people.

  UserError               raise it for a mistake in the user's input (a setting, missing data or checkpoint, the
                          launch), with what to do: a script prints `error: <message>` and exits 1; anything else is
                          a bug and keeps its traceback
  setup_default_logging   a script's first act (configure() and compute_init() call it): "nanochat" and its children
                          log to stderr; a UserError (also a GPU's out of memory, and Ctrl-C) ends the program in one
                          line, on every rank that raised it
  ColoredFormatter        how those log lines look (colors at a terminal only)
  print0                  print() on rank 0 only: what a script says about the whole run (why: above print0)
  duration, format_value  a duration (45s, 6m, 1h05m) and a number (1.2346, 87.6, 12,345) for people: log lines and
                          the report
  format_bytes            a size for people (120.5 MB): a download, a checkpoint, what a full disk needed
  error_line              an exception as one line ("ValueError: its message's first line"), for an error quoting it
  print_banner            the nanochat banner, which scripts print at start-up

Importing this module touches no RNG, no process group and no handler of the importing program's loggers: it only
adds a NullHandler to the "nanochat" logger. configure() and compute_init() (scripts) run setup_default_logging():
then "nanochat" prints to stderr, not via the root logger, and a UserError ends the program in one line.
"""

import logging
import os
import re
import sys

logging.getLogger("nanochat").addHandler(logging.NullHandler())  # library etiquette: silent until configured


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


def setup_default_logging():
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
    nano.setLevel(logging.INFO)
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


def format_bytes(n):
    """A size for people: 512 B, 3.4 KB, 120.5 MB, 1.8 GB (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def error_line(e):
    """`Type: the first line of its message` of the exception `e`: what a one-line error says of the one it caught."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


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
