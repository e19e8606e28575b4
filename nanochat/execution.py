"""
Run a piece of Python code, typically written by the model, in a separate restricted process and report what happened.

    result = execute_code("print(1 + 1)")
    result.success, result.stdout      # True, "2\n"

A guard against accidents by model-written code, NOT a security boundary (code that sets out to escape can): a child
`python -I` in its own session and temporary directory, with a scrubbed environment, stdin /dev/null, a wall-clock
timeout after which its whole process group is killed, memory and output caps (RLIMIT_AS/DATA, RLIMIT_FSIZE; macOS
does not enforce the memory cap), and the functions in DISABLED raising PermissionError. This file is also the
child (the `__main__` block at the bottom). POSIX only. Each protection, and what it does not stop: docs/execution.md.
"""

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile

MEMORY_EXIT_CODE = 113  # the child's exit status when the code died of MemoryError (any unlikely number works)

# module -> names that raise PermissionError in the child: creating processes, signalling them, deleting/moving
# files, sockets (names a platform lacks are skipped)
DISABLED = {
    "os": ["system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp",
           "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe",
           "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
           "kill", "killpg",
           "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace", "truncate"],
    "subprocess": ["Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"],
    "_posixsubprocess": ["fork_exec"],  # what subprocess and multiprocessing call underneath
    "signal": ["pidfd_send_signal"],
    "shutil": ["rmtree", "move"],
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
    Run the Python program `code` (a string) in a restricted child process (module docstring) and return an
    ExecutionResult. Never raises for anything the program does. maximum_memory_bytes=None: no memory cap.
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
        # files, not pipes: no buffer to drain, and a grandchild holding a pipe open cannot make us wait
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
