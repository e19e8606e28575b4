"""
Old code against new on one machine, interleaved: what bench/base_train.py --compare and bench/engine.py --compare
share. On a machine other jobs use too, a figure taken now and one taken ten minutes later measure the load as much
as the code; so every round runs every tree once, in turn, and the medians over the rounds are compared.

A tree is a checkout of the code to measure, e.g. a worktree of an older commit:
    git worktree add /tmp/base-08257cc 08257cc
    python bench/base_train.py --compare=/tmp/base-08257cc    # that tree against this one
A command runs in a tree with the tree first on PYTHONPATH and as its working directory, so `import nanochat` and
`python -m scripts...` are that tree's code.
"""

import os
import platform
import re
import statistics
import subprocess
import sys
import time

import torch

from nanochat.hardware import cpu_bf16_flags
from nanochat.probes import cpu_model_name

THIS_TREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def machine_line():
    """The CPU model and its native-bf16 flags, cores, torch, and the load average (every figure names them)."""
    flags = ", ".join(cpu_bf16_flags()) or "none"
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"CPU {cpu_model_name()} ({platform.machine()}), native bf16 flags: {flags}; {os.cpu_count()} cores; "
            f"torch {torch.__version__}; load average (1/5/15 min) {load}")


def trees_to_compare(compare):
    """[the trees named by --compare (comma-separated), this tree], each an absolute path that must exist."""
    trees = [os.path.abspath(t) for t in compare.split(",") if t] + [THIS_TREE]
    for tree in trees:
        if not os.path.isdir(os.path.join(tree, "nanochat")):
            sys.exit(f"error: {tree} is not a nanochat checkout (make one: git worktree add /tmp/base-08257cc 08257cc)")
    return trees


def run_in_tree(tree, argv, env, first_line=None, timeout=3600):
    """
    Run argv with `tree` first on PYTHONPATH and as the working directory. Returns (stdout, seconds from the start
    to the first stdout line matching the regex `first_line`, or None). A failure exits with its stderr's tail.
    """
    env = dict(os.environ, **env, PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])))
    t0 = time.time()
    proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    first = None
    for line in proc.stdout:
        lines.append(line)
        if first is None and first_line and re.search(first_line, line):
            first = time.time() - t0
    stderr = proc.stderr.read()
    if proc.wait(timeout=timeout) != 0:
        sys.exit(f"error: {' '.join(argv)} failed in {tree}:\n{stderr[-3000:]}")
    return "".join(lines), first


def interleaved(trees, repeats, measure):
    """{tree: [measure(tree) of each round]}: round r runs measure on every tree, in turn (the order alternates)."""
    results = {tree: [] for tree in trees}
    for r in range(repeats):
        for tree in (trees if r % 2 == 0 else trees[::-1]):
            results[tree].append(measure(tree))
            print(f"  round {r + 1}/{repeats}, {label(tree)}: {results[tree][-1]}", flush=True)
    return results


def label(tree):
    """A tree's name in tables: its git commit (short) and path."""
    git = lambda *args: subprocess.run(["git", "-C", tree, *args], capture_output=True, text=True).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except OSError:
        commit = "?"
        dirty = ""
    return f"{commit}{'+changes' if dirty else ''} ({tree})"


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None
