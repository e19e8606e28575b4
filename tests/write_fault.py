"""
Run a script whose write of a chosen file fails part-way, deterministically: a full disk, a quota, or a kill.

    python tests/write_fault.py model_000004 4096 ENOSPC scripts.base_train --depth=1 ...
    WRITE_FAULT_RANK=1 torchrun --nproc_per_node=2 tests/write_fault.py optim_000004 4096 ENOSPC scripts.base_train ...

The first file this process opens for writing whose name contains PATTERN (a regular expression, searched in the
file's name: atomic_write's temporary `model_000004.pt.tmp<pid>` matches "model_000004") takes BYTES bytes, then its
next write fails as the disk would: OSError ENOSPC or EDQUOT (raised inside the write, where torch.save and json.dump
meet it), or SIGKILL (the process dies inside the save). Every other file is written as usual. WRITE_FAULT_RANK=r:
only on the process whose $RANK is r. A test without a small filesystem of its own (tests/test_disk_full.py mounts a
tmpfs where it may) gets the same failure this way. Not a test module: the tests run it as a script.
"""

import builtins
import errno
import os
import re
import runpy
import signal
import sys


class FaultyFile:
    """A file opened for writing that holds `budget` bytes, then fails its next write with `fault`."""

    def __init__(self, f, budget, fault):
        self.f = f
        self.budget = budget
        self.fault = fault

    def write(self, data):
        data = bytes(data) if not isinstance(data, str) else data
        if len(data) <= self.budget:
            self.budget -= len(data)
            return self.f.write(data)
        self.f.write(data[:self.budget])
        self.f.flush()
        self.budget = 0
        if self.fault == "SIGKILL":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(getattr(errno, self.fault), os.strerror(getattr(errno, self.fault)))

    def __getattr__(self, name):  # flush, close, fileno, tell, name, ...: the real file's
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


if __name__ == "__main__":
    pattern, budget, fault, module, *args = sys.argv[1:]
    assert fault in ("ENOSPC", "EDQUOT", "SIGKILL"), fault
    real_open = builtins.open
    armed = [os.environ.get("WRITE_FAULT_RANK", os.environ.get("RANK", "0")) == os.environ.get("RANK", "0")]

    def faulty_open(file, mode="r", *a, **kw):
        f = real_open(file, mode, *a, **kw)
        writing = any(c in mode for c in "wax") and isinstance(file, (str, os.PathLike))
        if not (armed[0] and writing and re.search(pattern, os.path.basename(file))):
            return f
        armed[0] = False
        return FaultyFile(f, int(budget), fault)

    builtins.open = faulty_open
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
