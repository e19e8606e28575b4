"""
Long phases that a stop request cuts short: Interrupted, and interruptible() so that the ranks stop together.

  Interrupted     raise it in a long phase (an evaluation, sampling) when its `stop()` says so: the incomplete
                  result is not reported (a stage catches it, saves a checkpoint and stops)
  check_stop      `check_stop(stop)` between a phase's batches: Interrupted if `stop()` says so
  interruptible   `with interruptible():` around a rank's own share of a phase whose collectives follow: every rank
                  raises Interrupted there, or none does

The stop requests themselves (Ctrl-C, SIGTERM, a time limit) and what a stage does then: nanochat/stage.py.
Importing this module touches no RNG, no process group and no logger.
"""

import contextlib

from nanochat.ranks import any_rank


class Interrupted(Exception):
    """
    A long phase (an evaluation, sampling) stopped on a stop request (its `stop()`: a stage's StopRequest); its
    incomplete result is not reported. With collectives, raised on every rank at one point (interruptible).
    """


def check_stop(stop):
    """Raise Interrupted if the phase's `stop` (a callable, or None: never) says so."""
    if stop is not None and stop():
        raise Interrupted


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
