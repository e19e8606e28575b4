"""
Run a piece of Python code, typically written by the model, in a separate restricted process and report
what happened. The HumanEval evaluation uses it: it runs prompt + completion + tests + `check(entry_point)`
and counts `success`.

    result = execute_code("print(1 + 1)")
    result.success, result.stdout      # True, "2\\n"

Be clear about what this is: a guard against *accidents* by model-written code (an infinite loop, a huge
allocation, a stray `shutil.rmtree` or `os.system("rm ...")`), not a security boundary against an
adversary. Code that sets out to escape can: through ctypes, by reloading a module, through a disabled
class's base class, with `open(path, "w")` on any file this user may write, by reading any file this user
may read, by calling os.setsid() in a grandchild. To run untrusted code, run it in a container or a VM.

The protections, strongest first:

1. A separate process, `python -I -B -X utf8 -u`: a crash, a segfault or a `sys.exit` in the code cannot
   take the caller down. -I (isolated mode) ignores the PYTHON* environment variables and leaves the
   user site-packages and the script's directory off sys.path; -B writes no .pyc files; -X utf8 makes
   stdout UTF-8 whatever the locale; -u writes output as it is printed, so whatever a program printed
   before it was killed is kept.
2. A wall-clock timeout: after `timeout` seconds (interpreter start included) the child's whole process
   group is killed with SIGKILL; it runs in a new session, so the group is the child and whatever it
   started. The group is killed after a normal exit too, so no background grandchild outlives the call.
3. Resource limits, set in the child as both soft and hard limit so the code cannot raise them again:
   RLIMIT_AS and RLIMIT_DATA cap memory at `maximum_memory_bytes` (an allocation past it raises
   MemoryError, reported as memory_exceeded); RLIMIT_FSIZE caps every file the child writes, its stdout
   and stderr included, at `max_output_bytes`, so a print loop fills neither the disk nor the caller's
   memory; RLIMIT_CORE = 0, no core dumps. macOS does not enforce RLIMIT_AS (setrlimit refuses it or
   ignores it): there the memory cap is skipped rather than the run refused, and memory_exceeded only
   reports a MemoryError the code ran into by itself.
4. A fresh temporary working directory, also the child's HOME and TMPDIR, removed afterwards: files the
   code writes with relative paths land there and vanish.
5. A scrubbed environment: PATH, HOME, TMPDIR and LANG only. No API keys, no NANOCHAT_* or WANDB_*, no
   LD_PRELOAD.
6. stdin is /dev/null: `input()` raises EOFError at once instead of hanging until the timeout.
7. Destructive functions disabled at the Python level (the list is DISABLED below; calling one raises
   PermissionError): creating processes (os.system, os.fork, os.exec*, os.spawn*, subprocess, and the
   C-level fork_exec under subprocess and multiprocessing), signalling other processes (os.kill,
   os.killpg), deleting, moving and overwriting files (os.remove, os.unlink, os.rmdir, os.rename,
   os.replace, shutil.rmtree, ...) and network sockets. This is the layer that is easy to bypass; it
   stops the accidental call, which is what model-written code makes.

The code reaches the child as a file, never formatted into a template, so quotes, backslashes and braces
run unchanged. It runs after the guard, in a fresh `__main__` module: it does not see the guard's names.

This file is also the child: the parent runs `python -I ... execution.py program.py <memory> <output>`,
and the `if __name__ == "__main__"` block at the bottom sets the limits, disables the functions and
executes the program. POSIX only (Linux, macOS): it relies on process groups and the resource module.
"""

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile

MEMORY_EXIT_CODE = 113  # the child's exit status when the code died of MemoryError (any unlikely number works)

# module -> names that raise PermissionError in the child (names a platform lacks are skipped)
DISABLED = {
    # creating processes
    "os": ["system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp",
           "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe",
           "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
           # signalling other processes
           "kill", "killpg",
           # deleting, moving and overwriting files
           "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace", "truncate"],
    "subprocess": ["Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"],
    "_posixsubprocess": ["fork_exec"],  # what subprocess and multiprocessing call underneath
    "signal": ["pidfd_send_signal"],
    "shutil": ["rmtree", "move"],
    # network
    "socket": ["socket", "socketpair", "fromfd", "create_connection", "create_server"],
    "_socket": ["socket", "socketpair"],
}


@dataclasses.dataclass
class ExecutionResult:
    """What happened when execute_code ran a program."""
    success: bool                   # the program ran to the end (exit status 0) within the limits
    stdout: str                     # what it printed, at most max_output_bytes of it
    stderr: str                     # the traceback of a failure goes here
    error: str | None = None        # one line saying why it failed, e.g. "ZeroDivisionError: division by zero"
    timeout: bool = False           # it was killed after `timeout` seconds
    memory_exceeded: bool = False   # it died of MemoryError


def execute_code(code, timeout=5.0, maximum_memory_bytes=256 * 1024 * 1024, max_output_bytes=1024 * 1024):
    """
    Run the Python program `code` (a string) in a restricted child process (see the module docstring)
    and return an ExecutionResult. Never raises for anything the program does. maximum_memory_bytes=None
    runs it without a memory cap.
    """
    with tempfile.TemporaryDirectory(prefix="nanochat_exec_", ignore_cleanup_errors=True) as root:
        program = os.path.join(root, "program.py")
        stdout_path, stderr_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
        workdir = os.path.join(root, "work")  # the child's cwd, empty: the files above stay out of its way
        os.mkdir(workdir)
        with open(program, "w", encoding="utf-8") as f:
            f.write(code)
        env = {"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        command = [sys.executable, "-I", "-B", "-X", "utf8", "-u", os.path.abspath(__file__),
                   program, str(maximum_memory_bytes or 0), str(max_output_bytes)]
        # output goes to files rather than pipes: no pipe buffer to drain, and a grandchild that keeps a
        # pipe open cannot make us wait for it
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=workdir,
                                    env=env, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            # on a timeout this kills the child; in every case it kills what the child left running
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # the group is already gone
                pass
            proc.wait()
        outputs = []
        for path in (stdout_path, stderr_path):
            with open(path, "rb") as f:
                outputs.append(f.read(max_output_bytes))
        output_full = any(len(data) >= max_output_bytes for data in outputs)
        stdout, stderr = (data.decode("utf-8", errors="replace") for data in outputs)

    returncode = proc.returncode
    memory_exceeded = not timed_out and returncode == MEMORY_EXIT_CODE
    if timed_out:
        error = f"timed out after {timeout:g} s"
    elif memory_exceeded:
        error = f"MemoryError: memory limit of {maximum_memory_bytes / 2**20:g} MiB exceeded"
    elif returncode == 0:
        error = None
    elif output_full:
        error = f"output exceeded the limit of {max_output_bytes} bytes"
    elif returncode < 0:
        error = f"killed by signal {signal.Signals(-returncode).name}"
    else:  # the last line of a traceback says what went wrong ("ValueError: ..."), as does sys.exit("message")
        lines = [line for line in stderr.splitlines() if line.strip()]
        error = lines[-1].strip() if lines else f"exit status {returncode}"
    return ExecutionResult(success=returncode == 0 and not timed_out, stdout=stdout, stderr=stderr, error=error,
                           timeout=timed_out, memory_exceeded=memory_exceeded)


# -----------------------------------------------------------------------------
# The child: everything below runs in the sandboxed process, before the program.

def _set_limits(maximum_memory_bytes, max_output_bytes):
    import resource
    limits = [(resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, max_output_bytes)]
    if maximum_memory_bytes:
        limits += [(resource.RLIMIT_AS, maximum_memory_bytes), (resource.RLIMIT_DATA, maximum_memory_bytes)]
    for which, value in limits:
        _, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)  # an unprivileged process can only lower its hard limit
        try:
            resource.setrlimit(which, (value, value))  # soft and hard: the program cannot raise it back
        except (ValueError, OSError):
            pass  # macOS refuses RLIMIT_AS: run without that limit rather than not at all


def _refusal(module_name, name, original):
    """A stand-in for `original` that raises PermissionError when called (for a class: when instantiated)."""
    message = f"{module_name}.{name} is disabled while running generated code (nanochat/execution.py)"

    def refuse(*args, **kwargs):
        raise PermissionError(message)

    if isinstance(original, type):
        # a subclass, not a function: modules that subclass it at import (ssl subclasses socket.socket)
        # still import; refusing in __new__ means no half-built object whose __del__ would complain
        return type(original.__name__, (original,), {"__new__": refuse, "__module__": original.__module__,
                                                     "__qualname__": original.__qualname__})
    return refuse


def _disable_destructive_functions():
    for module_name, names in DISABLED.items():
        try:
            module = __import__(module_name)
        except ImportError:
            continue
        for name in names:
            original = getattr(module, name, None)
            if original is not None:
                setattr(module, name, _refusal(module_name, name, original))


def _run_program(program):
    import traceback
    import types
    with open(program, "rb") as f:
        source = f.read()
    # a fresh __main__ module: the program's globals hold none of the names defined in this file
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    sys.argv = [program]
    try:
        exec(compile(source, program, "exec"), main.__dict__)
    except SystemExit:
        raise  # sys.exit(n) in the program: exit with n, as it asked
    except BaseException as e:
        # the traceback without this function's frame: it starts in the program
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.exit(MEMORY_EXIT_CODE if isinstance(e, MemoryError) else 1)


if __name__ == "__main__":
    _set_limits(int(sys.argv[2]), int(sys.argv[3]))
    _disable_destructive_functions()
    _run_program(sys.argv[1])
