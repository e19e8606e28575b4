"""
Run a script whose stdout signals it from INSIDE the write of a marked line, deterministically.

The signal comes in the write of the first line containing a marker (not a race with a signal from outside):

    python tests/signal_in_write.py MARKER SIGTERM scripts.base_train --depth=1 ...
    python tests/signal_in_write.py --next MARKER SIGINT scripts.chat_cli ...   # inside the write after MARKER's

The raw writer under sys.stdout is Python code: os.kill makes the signal pending, and Python runs the script's handler
at the next bytecode, which is here, inside BufferedWriter.write (its lock held). A handler that prints re-enters that
buffer and dies with "RuntimeError: reentrant call inside <_io.BufferedWriter name='<stdout>'>"; one that only records
the request lets the stage stop by its protocol. Not a test module: the tests run it as a script.
"""

import io
import os
import runpy
import signal
import sys
import time


class SignallingWriter(io.RawIOBase):
    """
    Writes to file descriptor `fd`; the first write containing `marker` (with `next`: the write after it) first
    sends `sig` to this process.
    """

    def __init__(self, fd, marker, sig, next=False):
        self.fd = fd
        self.marker = marker.encode()
        self.sig = sig
        self.next = next
        self.seen = False
        self.sent = False

    def writable(self):
        return True

    def write(self, data):
        now = self.seen if self.next else self.marker in bytes(data)
        self.seen = self.seen or self.marker in bytes(data)
        if now and not self.sent:
            self.sent = True
            sent = time.time()
            os.kill(os.getpid(), self.sig)  # pending now; the handler runs at this function's next bytecode
            print(f"(signal_in_write: sent {self.sig.name} inside the write of {self.marker.decode()!r} at {sent:.3f})",
                  file=sys.stderr)
        return os.write(self.fd, data)


if __name__ == "__main__":
    next_write = sys.argv[1] == "--next"
    marker, sig, module, *args = sys.argv[1 + next_write:]
    writer = SignallingWriter(os.dup(1), marker, signal.Signals[sig], next_write)
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(writer), line_buffering=True, encoding="utf-8")
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
