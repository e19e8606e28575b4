"""
Tests of nanochat/execution.py's execute_code: programs as reported, and every escape stopped.

Programs run, fail, time out and run out of memory as reported, and every escape the guard is meant to stop
(spawning, signals, deletes, sockets, the environment, stdin, stray grandchildren) fails without damage. Each
execute_code call starts a Python (~0.1 s).
"""

import contextlib
import io
import os
import resource
import socket
import textwrap
import time

import pytest

from helpers import start_script
from nanochat.execution import ExecutionResult, execute_code


def test_success_and_stdout():
    result = execute_code("import sys\nprint('hello', 6 * 7)\nprint('warn', file=sys.stderr)")
    assert result == ExecutionResult(success=True, stdout="hello 42\n", stderr="warn\n", error=None,
                                     timeout=False, memory_exceeded=False)


def test_exception_fails_with_its_message_and_a_traceback_of_the_program_only():
    result = execute_code("def f(x):\n    return 1 / x\n\nf(0)\n")
    assert not result.success and not result.timeout and not result.memory_exceeded
    assert result.error == "ZeroDivisionError: division by zero"
    assert "return 1 / x" in result.stderr  # the program's source lines are shown
    assert "execution.py" not in result.stderr  # and none of the guard's frames


def test_syntax_error():
    result = execute_code("def f(:\n    pass\n")
    assert not result.success
    assert result.error.startswith("SyntaxError")


def test_sys_exit_codes():
    assert execute_code("import sys\nprint('bye')\nsys.exit(0)\nprint('never')").stdout == "bye\n"
    assert execute_code("import sys; sys.exit(0)").success
    result = execute_code("import sys; sys.exit(3)")
    assert not result.success and result.error == "exit status 3"


def test_infinite_loop_is_killed_at_the_timeout():
    start = time.time()
    result = execute_code("print('started')\nwhile True:\n    pass\n", timeout=1.0)
    elapsed = time.time() - start
    assert result.timeout and not result.success
    assert result.error == "timed out after 1 s"
    assert result.stdout == "started\n"  # what it printed before it was killed is kept
    assert 1.0 <= elapsed < 4.0


@pytest.mark.parametrize("code", [
    "x = bytearray(4 * 1024**3)",                            # one huge allocation
    "chunks = []\nwhile True:\n    chunks.append(bytearray(10**6))",  # a slow leak
])
def test_memory_cap(code):
    limits_before = resource.getrlimit(resource.RLIMIT_AS)
    start = time.time()
    result = execute_code(code, timeout=10.0, maximum_memory_bytes=128 * 1024 * 1024)
    assert result.memory_exceeded and not result.success and not result.timeout
    assert "MemoryError" in result.error and "MemoryError" in result.stderr
    assert time.time() - start < 5.0
    # the parent is unharmed: its own limit is untouched and it can allocate and run more programs
    assert resource.getrlimit(resource.RLIMIT_AS) == limits_before
    assert len(bytearray(160 * 1024 * 1024)) == 160 * 1024 * 1024
    assert execute_code("print(len(bytearray(10**6)))").stdout == "1000000\n"


def test_memory_cap_cannot_be_raised_by_the_program():
    result = execute_code("import resource\nresource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2)")
    assert not result.success and result.error.startswith("ValueError")


def test_output_is_capped():
    start = time.time()
    result = execute_code("while True:\n    print('x' * 1000)", timeout=10.0, max_output_bytes=100_000)
    assert not result.success and not result.timeout
    assert result.error == "output exceeded the limit of 100000 bytes"
    assert 50_000 < len(result.stdout) <= 100_000
    assert time.time() - start < 5.0  # stopped by the limit, not by the timeout


def test_tricky_source_runs_unchanged():
    code = textwrap.dedent(r'''
        name = "wor'ld"
        other = 'say "hi"'
        print(f"{name!r} {{braces}} {other} {len(name):>5}")
        print("{0} and {1}".format("a", "b"), "%s %%d" % "pct")
        print("tab\there", r"raw\n\x41", "\\", '\'', "\"")
        print("""triple "quoted" inside""")
        print("unicode: héllo ✓ 日本語 🙂", "\N{GREEK SMALL LETTER ALPHA}", "\u00e9")
        d = {"k": {"nested": [1, 2, {3}]}}
        print(d, {**d, "x": None})
        # a comment with { and } and \ and ' and "
        print(len("""
        multi
        line"""))
    ''') + 'print("""has \'\'\' inside""", \'\'\'and """ this\'\'\')\n'
    expected = io.StringIO()  # what the same code prints when run right here
    with contextlib.redirect_stdout(expected):
        exec(code, {"__name__": "__main__"})
    result = execute_code(code)
    assert result.success, result.stderr
    assert result.stdout == expected.getvalue()
    assert "日本語 🙂" in result.stdout and "{braces}" in result.stdout and r"raw\n\x41" in result.stdout


def test_program_does_not_see_the_guard():
    code = textwrap.dedent("""
        print(sorted(globals()))
        import __main__, sys
        print(__name__, __main__.__dict__ is globals(), sys.argv[0].endswith("program.py"))
    """)
    result = execute_code(code)
    assert result.success, result.stderr
    names, rest = result.stdout.splitlines()
    assert set(eval(names)) <= {"__builtins__", "__doc__", "__loader__", "__name__", "__package__", "__spec__"}
    assert rest == "__main__ True True"
    # module-level names of execution.py are not reachable as globals
    for name in ("execute_code", "DISABLED", "MEMORY_EXIT_CODE", "_run_program", "_set_limits"):
        result = execute_code(f"print({name})")
        assert not result.success and result.error == f"NameError: name '{name}' is not defined"


def test_humaneval_style_program():
    prompt = 'def add(a, b):\n    """Return the sum of a and b."""\n'
    test = ("\ndef check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n"
            "    assert candidate('a', 'b') == 'ab'\n")
    right, wrong = "    return a + b\n", "    return a - b\n"
    assert execute_code(prompt + right + test + "\ncheck(add)\n").success
    result = execute_code(prompt + wrong + test + "\ncheck(add)\n")
    assert not result.success and result.error == "AssertionError"


# ---------------------------------------------------------------------------------------------
# escapes: each must fail, and the thing it aimed at must be intact


@pytest.fixture
def victim():
    """A process that the program will try to kill, in a group of its own (a failed killpg hits only it)."""
    proc = start_script("-c", "import time; time.sleep(60)", start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def assert_refused(result):
    assert not result.success and not result.timeout
    assert result.error.startswith("PermissionError") and "disabled" in result.error, result.stderr


@pytest.mark.parametrize("code", [
    "import os; os.system('touch {marker}')",
    "import os; os.popen('touch {marker}').read()",
    "import subprocess; subprocess.run(['touch', '{marker}'])",
    "import subprocess; subprocess.check_output('touch {marker}', shell=True)",
    "import subprocess; subprocess.Popen(['touch', '{marker}']).wait()",
    "import os; os.posix_spawn('/usr/bin/touch', ['touch', '{marker}'], {{}})",
    "import os; os.execv('/usr/bin/touch', ['touch', '{marker}'])",
    "import os\nif os.fork() == 0:\n    open('{marker}', 'w').close()",
    "import multiprocessing as mp\np = mp.Process(target=open, args=('{marker}', 'w'))\np.start(); p.join()",
    "import multiprocessing as mp\nmp.set_start_method('spawn')\np = mp.Process(target=print)\np.start(); p.join()",
])
def test_spawning_processes_is_refused(tmp_path, code):
    marker = tmp_path / "marker"
    result = execute_code(code.format(marker=marker))
    assert_refused(result)
    assert not marker.exists()


@pytest.mark.parametrize("code", [
    "import os, signal; os.kill({pid}, signal.SIGKILL)",
    "import os, signal; os.killpg(os.getpgid({pid}), signal.SIGKILL)",
    "import os, signal; os.kill(os.getppid(), signal.SIGKILL)",  # the test process itself
])
def test_killing_other_processes_is_refused(victim, code):
    result = execute_code(code.format(pid=victim.pid))
    assert_refused(result)
    time.sleep(0.1)
    assert victim.poll() is None  # still running (and so are we)


@pytest.mark.parametrize("code", [
    "import shutil; shutil.rmtree('{canary_dir}')",
    "import shutil; shutil.move('{canary_dir}', '{elsewhere}')",
    "import os; os.remove('{canary_file}')",
    "import os; os.unlink('{canary_file}')",
    "import pathlib; pathlib.Path('{canary_file}').unlink()",
    "import os; os.rmdir('{empty_dir}')",
    "import os; os.removedirs('{empty_dir}')",
    "import os; os.rename('{canary_file}', '{elsewhere}')",
    "import os; os.replace('{other_file}', '{canary_file}')",
    "import os; os.truncate('{canary_file}', 0)",
])
def test_deleting_files_outside_the_sandbox_is_refused(tmp_path, code):
    canary_dir = tmp_path / "canary"
    canary_dir.mkdir()
    canary_file = canary_dir / "precious.txt"
    canary_file.write_text("precious")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    other_file = tmp_path / "other.txt"
    other_file.write_text("other")
    result = execute_code(code.format(canary_dir=canary_dir, canary_file=canary_file, empty_dir=empty_dir,
                                      other_file=other_file, elsewhere=tmp_path / "elsewhere"))
    assert_refused(result)
    assert canary_file.read_text() == "precious" and empty_dir.is_dir() and other_file.read_text() == "other"
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("code", [
    "import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)",
    "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\ns.connect(('127.0.0.1', {port}))",
    "import _socket\ns = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\ns.connect(('127.0.0.1', {port}))",
    "import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=1)",
])
def test_network_is_refused(code):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        result = execute_code(code.format(port=server.getsockname()[1]))
        # a completed connection would wait in the listen backlog even though nobody accepted it yet
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):
            server.accept()
    assert not result.success and not result.timeout
    assert "PermissionError" in result.stderr and "disabled" in result.stderr


def test_working_directory_is_fresh_empty_and_removed():
    code = "import os\nprint(os.getcwd())\nprint(os.listdir('.'))\nopen('scratch.txt', 'w').write('x')"
    first = execute_code(code)
    second = execute_code(code)
    assert first.success and second.success, first.stderr
    cwd1, listing1 = first.stdout.splitlines()
    cwd2, listing2 = second.stdout.splitlines()
    assert listing1 == listing2 == "[]"  # the scratch file of the first run is not in the second's directory
    assert cwd1 != cwd2
    assert os.path.realpath(cwd1) != os.path.realpath(os.getcwd())
    assert not os.path.exists(cwd1) and not os.path.exists(cwd2)


def test_environment_is_scrubbed(monkeypatch):
    secrets = {"NANOCHAT_SECRET": "hunter2", "WANDB_API_KEY": "wandb-secret-123", "OPENAI_API_KEY": "sk-secret-456",
               "LD_PRELOAD": "/nonexistent/evil.so", "PYTHONPATH": "/nonexistent/evil"}
    for key, value in secrets.items():
        monkeypatch.setenv(key, value)
    result = execute_code("import os, sys\nprint(dict(os.environ))\nprint(sys.path)")
    assert result.success, result.stderr
    environ = eval(result.stdout.splitlines()[0])
    assert set(environ) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_CTYPE"}
    for value in secrets.values():
        assert value not in result.stdout
    assert environ["HOME"] != os.environ.get("HOME")


def test_stdin_is_closed():
    start = time.time()
    result = execute_code("name = input('name? ')\nprint('hello', name)", timeout=10.0)
    assert not result.success and not result.timeout
    assert result.error.startswith("EOFError")
    assert time.time() - start < 5.0  # failed at once, did not wait for the timeout


def _is_gone(pid):
    """True once pid has exited (a zombie waiting for its new parent to reap it counts as gone)."""
    if os.path.isdir("/proc"):  # Linux: the process state is the field after the ")" closing its name
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True
    try:  # macOS: no /proc, ask the kernel (its launchd reaps orphans at once)
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("then", ["exit", "hang"])
def test_grandchild_does_not_outlive_the_call(then):
    # ctypes forks behind the Python-level guard on purpose: the process-group kill is the backstop
    hang = then == "hang"
    code = textwrap.dedent(f"""
        import ctypes, os, time
        pid = ctypes.CDLL(None).fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        print(pid, flush=True)
        if {hang}:
            while True:
                pass
    """)
    result = execute_code(code, timeout=1.5)
    assert result.timeout == hang, result.stderr
    grandchild = int(result.stdout.split()[0])
    deadline = time.time() + 5
    while not _is_gone(grandchild) and time.time() < deadline:
        time.sleep(0.05)
    assert _is_gone(grandchild)
