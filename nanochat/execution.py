"""
What the model writes, run safely: calculator expressions in this process, programs in a child process.

    use_calculator("12*3 + 4")         # "40"; None for anything it does not evaluate (the Engine's calculator tool)
    result = execute_code("print(1 + 1)")
    result.success, result.stdout      # True, "2\n"

The calculator: when a sample writes <|python_start|> expression <|python_end|>, the Engine forces <|output_start|>
result <|output_end|> into it. Arithmetic and a few string methods, walked node by node over Python's parse tree,
never eval: nothing a model writes may run code, read files or exhaust the machine (every intermediate result is
bounded in size, every expression in time).

execute_code (HumanEval's tests, and any generated program): a guard against accidents by model-written code, NOT a
security boundary (code that sets out to escape can): a child `python -I` in its own session and temporary
directory, with a scrubbed environment, stdin /dev/null, a wall-clock timeout after which its whole process group is
killed, memory and output caps (RLIMIT_AS/DATA, RLIMIT_FSIZE; macOS does not enforce the memory cap), and the
functions in DISABLED raising PermissionError. This file is also the child (the `__main__` block at the bottom).
POSIX only. Each protection, and what it does not stop: docs/execution.md.
"""

import ast
import dataclasses
import math
import operator
import os
import signal
import subprocess
import sys
import tempfile
import time

# -----------------------------------------------------------------------------
# The calculator: an expression, in this process

MAX_EXPRESSION_CHARS = 1000  # longer expressions are refused before parsing
MAX_STRING_CHARS = 1000  # longest string any step may produce ("ab" * 10**9 is refused before it is built)
MAX_INT_BITS = 4000  # largest integer any step may produce (~1200 digits; 9**9**9 is refused before it is computed)
CALCULATOR_TIME_LIMIT = 0.1  # seconds per expression, checked at every node of the expression
# str methods the calculator calls: only replace can return a string longer than its inputs (checked before)
STRING_METHODS = {"count", "upper", "lower", "strip", "lstrip", "rstrip", "replace", "startswith", "endswith",
                  "find", "title", "capitalize", "swapcase"}
ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


class _Refused(Exception):
    """An expression the calculator does not evaluate."""


def _is_number(value):
    return type(value) in (int, float)  # not bool: True + True is not arithmetic anyone means


def _checked(value):
    """A value within the calculator's limits, or _Refused."""
    if type(value) is int and value.bit_length() > MAX_INT_BITS:
        raise _Refused("integer too large")
    if type(value) is float and not math.isfinite(value):
        raise _Refused("not a finite number")
    if type(value) is str and len(value) > MAX_STRING_CHARS:
        raise _Refused("string too long")
    if type(value) not in (int, float, str, bool):
        raise _Refused(f"{type(value).__name__} values are not supported")
    return value


def _binary(op, a, b):
    """a <op> b for numbers (and str + str, str * int), with the size of the result bounded *before* computing it."""
    if _is_number(a) and _is_number(b):
        if op is ast.Mult and type(a) is int and type(b) is int and a.bit_length() + b.bit_length() > MAX_INT_BITS:
            raise _Refused("product too large")
        if op is ast.Pow and type(b) is int and abs(a) > 1:  # |a| <= 1: the power stays small whatever b is
            # |a| >= 2**(bit_length - 1), so a**b has at least (bit_length - 1) * b bits
            if abs(b) > MAX_INT_BITS or (type(a) is int and (a.bit_length() - 1) * b > MAX_INT_BITS):
                raise _Refused("power too large")
        return _checked(ARITHMETIC[op](a, b))
    if op is ast.Add and type(a) is str and type(b) is str:
        return _checked(a + b)
    if op is ast.Mult and {type(a), type(b)} == {str, int}:
        text, count = (a, b) if type(a) is str else (b, a)
        if len(text) * count > MAX_STRING_CHARS:
            raise _Refused("string too long")
        return text * count
    # everything else, notably str % ...: printf-style formatting ("%*d" % (10**9, 1)) is not arithmetic
    raise _Refused(f"unsupported operands for {op.__name__}: {type(a).__name__}, {type(b).__name__}")


def _call_method(text, name, args):
    if name == "replace":
        if len(args) not in (2, 3) or type(args[0]) is not str or type(args[1]) is not str:
            raise _Refused("replace(old, new[, count]) takes two strings")
        old, new = args[0], args[1]
        hits = len(text) + 1 if old == "" else text.count(old)
        if len(args) == 3 and type(args[2]) is int and args[2] >= 0:
            hits = min(hits, args[2])
        if len(text) + hits * (len(new) - len(old)) > MAX_STRING_CHARS:
            raise _Refused("string too long")
    return _checked(getattr(text, name)(*args))


def _evaluate(node, deadline):
    """Evaluate one node of the parsed expression; anything not listed here is refused."""
    if time.monotonic() > deadline:
        raise _Refused("time limit")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, str):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand, deadline)
        if not _is_number(value):
            raise _Refused("unary + and - apply to numbers")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC:
        return _binary(type(node.op), _evaluate(node.left, deadline), _evaluate(node.right, deadline))
    if isinstance(node, ast.Call) and not node.keywords:
        func = node.func
        if isinstance(func, ast.Name) and func.id == "len" and len(node.args) == 1:
            value = _evaluate(node.args[0], deadline)
            if type(value) is str:
                return len(value)
        elif isinstance(func, ast.Attribute) and func.attr in STRING_METHODS:
            text = _evaluate(func.value, deadline)
            if type(text) is str:
                return _call_method(text, func.attr, [_evaluate(arg, deadline) for arg in node.args])
    raise _Refused(f"not allowed: {type(node).__name__}")


def use_calculator(expr, time_limit=CALCULATOR_TIME_LIMIT):
    """
    The calculator tool: the result of `expr` as Python would print it (str(value)), or None when the
    expression is not one the calculator evaluates, fails (1/0), or exceeds a limit.

    What it evaluates, by walking the parsed expression itself (never eval/exec): int, float and str
    literals; + - * / // % ** and unary + -, on numbers (plus str + str and str * int); parentheses;
    len(str); and the string methods in STRING_METHODS called on a string ('strawberry'.count('r')).
    Nothing else: no names, attribute access other than those methods, subscripts, comprehensions,
    lambdas, keyword arguments. Every intermediate value is bounded (MAX_INT_BITS, MAX_STRING_CHARS) before
    it is computed, so 9**9**9 or 'a' * 10**9 are refused at once, and the walk stops after `time_limit`
    seconds. Commas are removed from expressions without quotes, as thousands separators ("1,200*3").
    """
    if not isinstance(expr, str) or len(expr) > MAX_EXPRESSION_CHARS:
        return None
    expr = expr.strip()
    if "'" not in expr and '"' not in expr:
        expr = expr.replace(",", "")
    try:
        tree = ast.parse(expr, mode="eval")
        return str(_evaluate(tree.body, time.monotonic() + time_limit))
    except Exception:  # refused, a syntax error, 1/0, an overflow, nesting too deep for the parser: no result
        return None


# -----------------------------------------------------------------------------
# Programs, in a child process

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
        stdout_path = os.path.join(root, "stdout")
        stderr_path = os.path.join(root, "stderr")
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
