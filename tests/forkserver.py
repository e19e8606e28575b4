"""
The tests' fork server: a script run starts as a fork of a process that has imported torch, not as a new interpreter.

Why: on a 2-core box a new `python -m scripts.<stage>` spends ~4 s of CPU importing torch and its company before the
script does anything, and the suite starts hundreds of them: that import was most of the suite's time.

What a run gets (helpers.script_popen, for run_script and start_script): a process of its own (its pid, exit status,
signals, a session of its own when asked, file descriptors 0-2 as the test gave them), running the script as
`python -m <module>`, `python <file.py>` or `python -c <code>` would, with the test's arguments, environment (threads
from OMP_NUM_THREADS included) and working directory. It is forked from a server that has done nothing but import
(PRELOAD), so no test's state, monkeypatch or cache reaches it; its own imports of nanochat, tasks and scripts happen
in it, under its environment. What it does not get: an interpreter start-up. A torchrun launch (nproc > 1) is forked
too, and its ranks are started by torchrun as always, through the stand-in below. Runs that still start an
interpreter: every run with NANOCHAT_TEST_FORK=0.

A shell script a test runs (speedrun.sh: the pipeline tests start ~15 pythons a run) finds `python` and `torchrun` in
tests/forkbin first on its PATH (stand_in_env), and torchrun starts its ranks with that `python`: a stand-in, run
by the real interpreter without its site packages (~20 ms), that has the server fork the run (client()) and stays
in the run's place until it ends: its pid is what the shell or torchrun waits for and what a test finds by its
command line; a signal sent to it goes on to the run, and its exit status is the run's (a death by a signal, by the
same signal). A SIGKILL, which no process can pass on, ends the run too: the run watches its stand-in and kills
itself when it is gone. Anything else (`python3 -m venv`, no server) is executed by the real interpreter.

One server per test process, started at its first run and ended with it. Protocol: a Unix SEQPACKET socket, one
connection per run: the test sends the request (JSON) with the run's three file descriptors (SCM_RIGHTS); the server
forks, answers the child's pid, then, when the child ends, its wait status.
"""

import atexit
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading

# What a script run imports before it does anything, costly and the same for all: loaded once, in the server.
# torch._dynamo: what torch.optim's optimizers and nn.Module.to_empty import on first use (~2 s of CPU), so every run
# that builds a model or an optimizer (its config reads a few TORCH_COMPILE_* variables at import: a run that needs
# one set runs with NANOCHAT_TEST_FORK=0). Not pyarrow: its import starts jemalloc's background thread, and a fork of
# a process with a second thread can inherit a lock that thread held, which no one in the child will release (a run
# that hangs)
PRELOAD = ("torch", "torch.distributed", "torch.nn.functional", "torch.utils.data", "torch._dynamo", "numpy",
           "tiktoken", "psutil", "filelock", "requests")


# ---------------------------------------------------------------------------------------------
# The server (python tests/forkserver.py SOCKET)


def serve(path):
    for name in PRELOAD:
        importlib.import_module(name)
    own_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]  # not the runs' (run())
    import torch
    default_threads = torch.get_num_threads()  # the server runs with no OMP_NUM_THREADS: a new interpreter's default
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    parent = os.getppid()
    print("ready", flush=True)
    waiting = {}  # pid -> the connection its status goes to
    while os.getppid() == parent:  # the test process is gone: so is its server
        if select.select([listener], [], [], 0.02)[0]:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in waiting.values():
                    other.close()
                conn.close()
                run(json.loads(message), fds, default_threads, own_path)  # never returns
            for fd in fds:
                os.close(fd)
            conn.send(str(pid).encode())
            waiting[pid] = conn
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid)
            try:
                conn.send(str(status).encode())
            except OSError:  # the test stopped listening
                pass
            conn.close()


def run(request, fds, default_threads, server_pythonpath):
    """The child: becomes the requested `python ...` run, then exits as an interpreter does."""
    if request["new_session"]:
        os.setsid()
    if request.get("stand_in"):
        threading.Thread(target=die_with, args=(request["stand_in"],), daemon=True).start()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # an interpreter's (the server ignores Ctrl-C)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    # the pythons this run starts itself ([sys.executable, ...]: chat_web_check's server, bench/ladder.py's runs)
    # fork too, through the stand-in torchrun's ranks take (stand_in_env)
    sys.executable = os.environ.get("PYTHON_EXEC", sys.executable)
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or default_threads))
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    sys.stdout = stream(1, unbuffered, line_buffering=False, errors="strict")
    sys.stderr = stream(2, unbuffered, line_buffering=True, errors="backslashreplace")
    kind, target, *args = request["argv"]
    first = {"-m": os.getcwd(), "-c": ""}.get(kind, os.path.dirname(os.path.abspath(kind)))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *[p for p in sys.path[1:] if p not in server_pythonpath]]
    code = 0
    try:
        if kind == "-m":
            sys.argv = [target, *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "-c":
            sys.argv = ["-c", *args]
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = [kind, target, *args]
            runpy.run_path(kind, run_name="__main__")
    except SystemExit as e:
        code = exit_code(e.code)
    except KeyboardInterrupt:  # as an interpreter does: the traceback, then death by SIGINT
        sys.excepthook(*sys.exc_info())
        finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    finish()
    os._exit(code)


def die_with(pid):
    """A run forked for a stand-in (client()): SIGKILL to this run once the stand-in is gone (killed: -9 reached it)."""
    gone = os.pidfd_open(pid)
    select.select([gone], [], [])
    os.kill(os.getpid(), signal.SIGKILL)


def stream(fd, unbuffered, line_buffering, errors):
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding="utf-8", errors=errors,
                            line_buffering=line_buffering, write_through=unbuffered)


def exit_code(code):
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def finish():
    """An interpreter's exit: wait for the threads that are not daemons, run atexit, flush."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------
# The test's side


class Server:
    """This test process's server, started on first use."""

    def __init__(self, repo_root):
        self.dir = tempfile.mkdtemp(prefix="nanochat_forkserver_")
        self.path = os.path.join(self.dir, "socket")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo_root, os.environ.get("PYTHONPATH")])))
        env.pop("OMP_NUM_THREADS", None)
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.path], env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the tests' fork server did not start (tests/forkserver.py)")
        atexit.register(self.close)

    def start(self, argv, env, cwd, new_session, fds):
        """Starts a run; returns (its pid, the connection its wait status comes on)."""
        return start(self.path, dict(argv=list(argv), env=dict(env), cwd=os.path.abspath(cwd),
                                     new_session=bool(new_session)), fds)

    def close(self):
        self.proc.kill()
        self.proc.wait()
        for name in os.listdir(self.dir):
            os.remove(os.path.join(self.dir, name))
        os.rmdir(self.dir)


_server = None


def server():
    """This test process's server (started at the first call)."""
    global _server
    if _server is None:
        _server = Server(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return _server


def start(path, request, fds):
    """Has the server at `path` fork `request` with the file descriptors `fds`: (the run's pid, the status's socket)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(path)
    socket.send_fds(conn, [json.dumps(request).encode()], fds)
    return int(conn.recv(64)), conn


def stand_in_env(path):
    """
    An environment with `path` (its PATH) in which `python` and `torchrun` are stand-ins (tests/forkbin), and
    torchrun starts its ranks through the `python` one (PYTHON_EXEC, which torch.distributed.run runs instead of
    sys.executable).
    """
    forkbin = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkbin")
    return dict(PATH=forkbin + os.pathsep + path, PYTHON_EXEC=os.path.join(forkbin, "python"),
                NANOCHAT_FORK_PYTHON=sys.executable, NANOCHAT_FORK_CLIENT=os.path.abspath(__file__),
                NANOCHAT_FORKSERVER=server().path)


def client(args):
    """
    `python <args>` in a shell script (tests/forkbin/python): the run forked by the server, this process standing in
    for it until it ends, passing on the signals a process can catch, then exiting as it did.
    """
    real = os.environ["NANOCHAT_FORK_PYTHON"]
    path = os.environ.get("NANOCHAT_FORKSERVER", "")
    if args[:1] == ["-u"]:  # how torchrun starts a rank: unbuffered
        args = args[1:]
        os.environ["PYTHONUNBUFFERED"] = "1"
    if not forkable(args) or not os.path.exists(path):
        os.execv(real, [real, *args])
    pending, child = [], []

    def forward(signum, frame):
        if child:
            os.kill(child[0], signum)
        else:
            pending.append(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, forward)
    request = dict(argv=args, env=dict(os.environ), cwd=os.getcwd(), new_session=False, stand_in=os.getpid())
    pid, conn = start(path, request, [0, 1, 2])
    child.append(pid)
    for signum in pending:
        os.kill(pid, signum)
    status = int(conn.recv(64))
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    sys.exit(os.waitstatus_to_exitcode(status))


def forkable(args):
    """A python run the server can fork: `-m module`, `-c code` or `file.py`, then the script's arguments."""
    return bool(args) and (args[0] in ("-m", "-c") and len(args) > 1 or args[0].endswith(".py"))


class ForkedPopen(subprocess.Popen):
    """
    subprocess.Popen whose child is forked by the server (args: what follows `python`): the same pipes, wait(),
    poll(), signals and communicate(); its wait status comes from the server, its parent.
    """

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                       shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):
        new_session = rest[-2]
        devnull = None
        if p2cread == -1:
            devnull = p2cread = os.open(os.devnull, os.O_RDONLY)
        fds = [p2cread, 1 if c2pwrite == -1 else c2pwrite, 2 if errwrite == -1 else errwrite]
        try:
            self.pid, self._status = server().start(args, env if env is not None else os.environ, cwd or os.getcwd(),
                                                  new_session, fds)
        finally:
            if devnull is not None:
                os.close(devnull)
                p2cread = -1
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _try_wait(self, wait_flags):
        self._status.setblocking(not wait_flags & os.WNOHANG)
        try:
            message = self._status.recv(64)
        except BlockingIOError:
            return 0, 0
        self._status.close()
        if not message:  # the server died
            raise RuntimeError("the tests' fork server ended before its child (tests/forkserver.py)")
        return self.pid, int(message)

    def _internal_poll(self, _deadstate=None, **_):
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    pid, status = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(status)
            finally:
                self._waitpid_lock.release()
        return self.returncode


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        client(sys.argv[2:])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the test run ends the tests, then the server
    serve(sys.argv[1])
