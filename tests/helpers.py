"""
What the tests share that is not a fixture (tests/conftest.py holds the fixtures).

How a test starts a script, the local file server, what a session builds once, the tiny models' settings, and small
helpers of several test files. A test module imports from here, never from another test module.
"""

import contextlib
import http.server
import json
import math
import os
import re
import signal
import sys
import threading
import time

import pytest
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The cores of one test process: all of them, or its share under pytest-xdist. A test that runs a script on "every
# core", as a user would, gives it this many threads; more would only make the processes wait for each other.
CORES = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


class FileServer:
    """
    Serves files from `root` on 127.0.0.1:<port>. Counts requests per path. Knobs, settable per test:
      slow_paths: {path: seconds_per_64KB_chunk}  stream those files slowly (to kill a download midway)
      fail_first: {path: n}                        answer HTTP 500 to the first n requests of that path
    """

    def __init__(self, root):
        self.root = str(root)
        self.requests = {}
        self.slow_paths = {}
        self.fail_first = {}
        self.lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                path = self.path.split("?")[0]
                with server.lock:
                    server.requests[path] = server.requests.get(path, 0) + 1
                    count = server.requests[path]
                if count <= server.fail_first.get(path, 0):
                    self.send_error(500, "injected failure")
                    return
                local = os.path.join(server.root, path.lstrip("/"))
                if not os.path.isfile(local):
                    self.send_error(404)
                    return
                with open(local, "rb") as f:
                    data = f.read()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                delay = server.slow_paths.get(path)
                try:
                    for i in range(0, len(data), 65536):
                        self.wfile.write(data[i:i + 65536])
                        if delay:
                            self.wfile.flush()
                            time.sleep(delay)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


# ---------------------------------------------------------------------------------------------
# Running a script: the one way the tests start a process


def script_command(args, nproc=1):
    """
    The argv of `args`: a .sh file runs under bash; anything else (-m module, a .py file, -c code) under this
    python, or under `torchrun --standalone --nproc_per_node=nproc` (CPU, gloo) when nproc > 1.
    """
    args = [str(a) for a in args]
    if args[0].endswith(".sh"):
        assert nproc == 1, "a shell script is not launched by torchrun"
        return ["bash", *args]
    if nproc == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


def script_env(env=None):
    """
    This test's environment (its NANOCHAT_BASE_DIR, offline wandb, ...) with one thread per process and this
    checkout first on PYTHONPATH (whatever the working directory), updated by `env` (a None value removes that
    variable).
    """
    full = dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    for key, value in (env or {}).items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = str(value)
    return full


@contextlib.contextmanager
def computed_as_in_scripts():
    """
    Inside it, this process computes as the scripts it starts do: one thread (script_env) and the compute dtype
    (nanochat/hardware.py: bf16 autocast on a CPU with native bf16, else nothing). A test that predicts a script's
    numbers computes them in here: in bf16 a matmul's rounding depends on the thread count, in fp32 it does not.
    """
    from nanochat.hardware import autocast_context
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with autocast_context("cpu")[1]:
            yield
    finally:
        torch.set_num_threads(threads)


def run_script(*args, nproc=1, env=None, timeout=300, cwd=REPO_ROOT, text=True, input=None):
    """
    Run a script the way a user does (see script_command), from the repo root, in script_env(env), `input` on its
    stdin; stdout and stderr captured (as text, or bytes with text=False). Returns the CompletedProcess.
    """
    import subprocess
    with script_popen(args, nproc, env, cwd, stdin=None if input is None else subprocess.PIPE,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text) as proc:
        try:
            stdout, stderr = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def start_script(*args, nproc=1, env=None, cwd=REPO_ROOT, **popen_kwargs):
    """run_script's Popen: the script started and left running (for signals, servers, interactive input)."""
    return script_popen(args, nproc, env, cwd, **popen_kwargs)


def script_popen(args, nproc, env, cwd, **popen_kwargs):
    """
    The Popen of a script run, as script_command says, but forked from this test process's fork server
    (tests/forkserver.py: no ~4 s of imports per process) unless NANOCHAT_TEST_FORK=0 (the test's environment or
    `env`): a python script, torchrun and the ranks it starts, each `python` and `torchrun` of a shell script.
    """
    import subprocess

    import forkserver
    command = script_command(args, nproc)
    env = script_env(env)
    if env.get("NANOCHAT_TEST_FORK", "1") == "0":
        return subprocess.Popen(command, cwd=cwd, env=env, **popen_kwargs)
    env.update(forkserver.stand_in_env(env["PATH"]))
    if command[0] == sys.executable and forkserver.forkable(command[1:]):
        return forkserver.ForkedPopen(command[1:], cwd=cwd, env=env, **popen_kwargs)
    return subprocess.Popen(command, cwd=cwd, env=env, **popen_kwargs)


@contextlib.contextmanager
def as_script(module, *args):
    """
    `with as_script(module, *args): runpy.run_module(module, run_name="__main__")`: sys.argv as for `python -m <module>
    <args>`; after, the script's changes to the logging set-up and sys.excepthook are undone.
    """
    import logging
    logger = logging.getLogger("nanochat")
    saved = sys.argv, sys.excepthook, list(logger.handlers), logger.propagate, logger.level
    sys.argv = [module, *args]
    try:
        yield
    finally:
        sys.argv, sys.excepthook, logger.handlers[:], logger.propagate = saved[:4]
        logger.setLevel(saved[4])


def refusal_in_process(module, *args):
    """
    Run `python -m <module> <args>` inside this process, as far as its argument checks: returns the UserError it
    raises before doing any work (fails if it raises none, or gets to compute_init or the training stages'
    Stage.start_compute). A test of a refused value needs no process of its own, which costs 2-3 s of imports;
    subprocess tests prove that such an error is one line on stderr and exit status 1.
    """
    import runpy

    from nanochat import output, processes, stage

    def no_work(*_, **__):
        raise AssertionError(f"{module} {' '.join(args)} started working instead of refusing its arguments")

    try:
        with pytest.MonkeyPatch.context() as mp, as_script(module, *args):
            mp.setattr(processes, "compute_init", no_work)
            mp.setattr(stage.Stage, "start_compute", no_work)
            runpy.run_module(module, run_name="__main__")
    except output.UserError as e:
        return e
    pytest.fail(f"{module} {' '.join(args)} refused nothing")


def given_to_stage(module, *args):
    """
    (stage name, config): what the training script `module`, run with `args` in this process, gives its Stage (it
    runs no further).
    """
    import runpy

    from nanochat import stage

    class Given(Exception):
        pass

    def given(name, config, **_):
        raise Given(name, config)

    with pytest.MonkeyPatch.context() as mp, as_script(module, *args), pytest.raises(Given) as stopped:
        mp.setattr(stage, "Stage", given)
        runpy.run_module(module, run_name="__main__")
    return stopped.value.args


def stage_config(**overrides):
    """A training script's config as Stage takes it: the stage's settings (their defaults, on a CPU), the schedule's
    ratios, and `overrides`."""
    from nanochat.configurator import configure
    from nanochat.stage import stage_settings
    config = configure(dict(warmup_ratio=0.0, warmdown_ratio=0.2), [], shared=stage_settings())
    return {**config, "device_type": "cpu", **overrides}


def one_line_error(result, *fragments):
    """
    The script failed the way a UserError ends it: exit 1, exactly one line on stderr, `error: ...`, containing
    every fragment. Returns that line.
    """
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def run_in_process(module, *args, monkeypatch):
    """
    Run `python -m <module> <args>` in this process (no interpreter start-up): its UserError propagates to the
    test.
    """
    import runpy
    monkeypatch.setattr(sys, "argv", [module, *args])
    runpy.run_module(module, run_name="__main__")


def run_signalled(marker, sig, *args, next_write=False, **kwargs):
    """
    run_script("-m", *args) with `sig` sent to the script from INSIDE the write of its first stdout line holding
    `marker` (tests/signal_in_write.py: deterministic, and the moment a handler that printed would crash; with
    next_write, the write after it). args[0] is "-m". Returns (the CompletedProcess, seconds from the signal to the
    end). Fails if the marker never came.
    """
    assert args[0] == "-m", args
    wrapper = os.path.join(REPO_ROOT, "tests", "signal_in_write.py")
    result = run_script(wrapper, *(["--next"] if next_write else []), marker,
                        sig if isinstance(sig, str) else signal.Signals(sig).name, *args[1:], **kwargs)
    ended = time.time()
    sent = re.search(r"\(signal_in_write: sent \w+ inside the write of .* at ([\d.]+)\)", result.stderr)
    assert sent, f"{marker!r} never came: {(result.stdout + result.stderr)[-3000:]}"
    return result, ended - float(sent.group(1))


def stop_at(proc, marker, sig=signal.SIGTERM, to=None, timeout=300):
    """
    Read the output of `proc` (started with stdout=PIPE, stderr=STDOUT, text=True) until a line containing `marker`,
    send `sig` (to the process whose pid `to()` gives then, default proc itself), and wait for proc to end. Returns
    (all its output, seconds from the signal to its end). Fails if it ends before the marker or outlives `timeout`.
    """
    lines = []
    deadline = time.time() + timeout
    for line in proc.stdout:
        lines.append(line)
        if marker in line:
            break
        assert time.time() < deadline, "".join(lines[-50:])
    else:
        pytest.fail(f"the process ended before {marker!r}: {''.join(lines[-50:])}")
    os.kill(to() if to else proc.pid, sig)
    signalled = time.time()
    lines += proc.stdout.readlines()
    proc.wait(timeout=timeout)
    return "".join(lines), time.time() - signalled


def wait_for_steps(path, n, proc, timeout=120):
    """Wait until the metrics file `path` of the training run `proc` logs `n` steps; fail if the run ends first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and sum('"step_loss"' in line for line in path.read_text().splitlines()) >= n:
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended early: {proc.communicate()[1][-2000:]}")
        time.sleep(0.1)
    pytest.fail("the run did not reach its steps in time")


def speedrun_env(profile="cpu", **overrides):
    """
    The environment (for run_script's env) of a speedrun.sh profile shrunk by NANOCHAT_SMOKE=1 (the cpu one to
    seconds), with this python (and its torchrun) and no venv set-up; `overrides` such as BASE_STEPS=... on top.
    """
    return dict(NANOCHAT_PROFILE=profile, NANOCHAT_SMOKE="1", NANOCHAT_SKIP_SETUP="1",
                PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], **overrides)


# The files of the hub repos of tasks/registry.py (tasks/<owner>/<dataset>/...), in the published formats
TASK_FIXTURES = os.path.join(REPO_ROOT, "tests", "fixtures", "tasks")


# ---------------------------------------------------------------------------------------------
# What the tests build once per session (the fixtures in conftest.py use it)


def build_once(tmp_path_factory, name, build):
    """
    The directory `name` of this test session, made by build(path) (path does not exist yet) the first time a test
    asks for it. Under pytest-xdist the session's workers share it: the first one builds it under a file lock, the
    others wait and reuse it. A new session (a new base temp) always builds anew. Treat it as read-only.
    """
    import shutil

    from filelock import FileLock
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's base temp, one level above each worker's
    target = root / "built" / name
    done = root / "built" / f"{name}.done"
    target.parent.mkdir(exist_ok=True)
    with FileLock(str(root / "built" / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(target, ignore_errors=True)  # what a failed attempt left
            build(target)
            done.touch()
    return target


# The tiny models of the suite: {name: (the model it starts from, its stage's arguments)}. Depth 1, barely
# trained (~5 s each on 2 cores): for testing the machinery, not quality. A model's base dir holds the pydocs
# corpus, the small tokenizer, its checkpoints and those of the model it starts from.
TINY_SIZES = ["--max_seq_len=64", "--device_batch_size=4", "--total_batch_size=256", "--eval_tokens=256"]
TINY_BASE = ["-m", "scripts.base_train", "--depth=1", "--eval_every=-1", "--sample_every=-1", "--core_metric_every=-1"]
# base_train's defaults before issue 24. The *2025 models and base512's line keep it: transformers' own NanoChat
# (test_interop, test_lm_eval) holds only that architecture, and the web and RL tests rely on what base512 happens
# to learn in 10 steps (to end documents and answers). "base" and "mid" have today's defaults.
RECIPE_2025 = ["--embedding_lr=0.2", "--unembedding_lr=0.004", "--warmdown_ratio=0.2", "--final_lr_frac=0",
               "--muon_momentum_peak=0.95", "--muon_momentum_final=0.95", "--matrix_weight_decay=0", "--qk_scale=1.0",
               "--value_embeds=False", "--init_recipe=2025", "--bos_aligned=False"]
TINY_MODELS = {
    "base": (None, [*TINY_BASE, *TINY_SIZES, "--num_iterations=10", "--save_every=5"]),  # context 64; steps 5 and 10
    "mid": ("base", ["-m", "scripts.mid_train", "--mixture=offline", *TINY_SIZES, "--num_iterations=10",
                     "--eval_every=-1"]),
    "base2025": (None, [*TINY_BASE, *RECIPE_2025, *TINY_SIZES, "--num_iterations=10"]),
    "mid2025": ("base2025", ["-m", "scripts.mid_train", "--mixture=offline", *TINY_SIZES, "--num_iterations=10",
                             "--eval_every=-1"]),
    # context 512: long enough for a reply to be cut short (chat_web)
    "base512": (None, [*TINY_BASE, *RECIPE_2025, "--max_seq_len=512", "--device_batch_size=1", "--total_batch_size=512",
                       "--eval_tokens=512", "--num_iterations=10"]),
    # its midtrained model: RL's arithmetic prompts (~60-100 tokens) leave it room to sample answers
    "mid512": ("base512", ["-m", "scripts.mid_train", "--mixture=offline", "--max_seq_len=128", "--device_batch_size=2",
                           "--total_batch_size=256", "--eval_tokens=256", "--num_iterations=10", "--eval_every=-1"]),
}


# ---------------------------------------------------------------------------------------------
# base_train on a tiny model (test_base_train, test_training_core, test_mid_train)

TINY = ["--depth=1", "--max_seq_len=32", "--device_batch_size=2", "--total_batch_size=128", "--eval_tokens=128",
        "--sample_every=-1", "--core_metric_every=-1", "--eval_every=3"]


def with_defaults(defaults, args):
    """defaults + args, an arg replacing the default of the same key (a key given twice is an error)."""
    given = {a.split("=", 1)[0] for a in args}
    return [a for a in defaults if a.split("=", 1)[0] not in given] + list(args)


def base_train(*args, timeout=300):
    return run_script("-m", "scripts.base_train", *with_defaults(TINY, args), timeout=timeout)


def metrics(base_dir, tag="d1"):
    with open(base_dir / "base_checkpoints" / tag / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def train_losses(base_dir, tag="d1"):
    return [m["step_loss"] for m in metrics(base_dir, tag) if "step_loss" in m]


def weights(base_dir, step, tag="d1"):
    return torch.load(base_dir / "base_checkpoints" / tag / f"model_{step:06d}.pt", map_location="cpu")


def assert_same_weights(a, b, rtol, atol):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=rtol, atol=atol), (k, (a[k] - b[k]).abs().max().item())


def same_state(a, b):
    """Two saved states (weights, an optimizer shard: nested dicts and lists of tensors and numbers) bit for bit."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


def check_steps_without_targets(result, ckpt, steps):
    """
    A mid_train or chat_sft run of `steps` steps with --save_every=1, some of them without targets: each such step
    printed so, logged no loss and changed no weight or optimizer state (bit for bit, also after steps that learned,
    where AdamW's momentum would move them); the EMA is that of the steps that learned alone. Returns (the metrics'
    step rows, the skipped steps, the rows of the steps that learned).
    """
    from nanochat.losses import smoothed_loss
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "targets" in r]
    skipped = [r["step"] for r in rows if r["targets"] == 0]
    learned = [r for r in rows if r["targets"] > 0]
    assert len(rows) == steps and learned and skipped and skipped[-1] > learned[0]["step"], rows
    for s in skipped:
        assert re.search(rf"step {s:05d} \([\d.]+%\) \| no targets: update skipped \|", result.stdout)
        assert rows[s - 1]["loss"] is None and rows[s - 1]["step_loss"] is None
        if s > 1:
            for kind in ("model_{:06d}.pt", "optim_{:06d}_rank0.pt"):
                before = torch.load(ckpt / kind.format(s - 1))
                assert same_state(torch.load(ckpt / kind.format(s)), before), (s, kind)
    ema = 0.0
    for n, r in enumerate(learned, 1):  # debiased by the number of steps that learned
        ema, debiased = smoothed_loss(ema, r["step_loss"], n)
        assert r["loss"] == pytest.approx(debiased, rel=1e-12), (n, r)
    assert f"Steps without targets (skipped): {len(skipped)} of {steps}," in result.stdout
    return rows, skipped, learned


# ---------------------------------------------------------------------------------------------
# A toy model whose per-token losses are known exactly (test_loss, test_chat_finetune, dist_loss_worker.py)


class ToyModel(torch.nn.Module):
    """
    One parameter w; the loss of a supervised target t is w * t (so its gradient is t), of an ignored target
    (-1) 0: every number below can be done by hand. Same interface as GPT's forward(x, y, loss_reduction).
    """

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, x, y, loss_reduction="mean"):
        per_token = torch.where(y >= 0, self.w * y.float(), torch.zeros((), dtype=torch.float32))
        if loss_reduction == "none":
            return per_token.view(-1)
        if loss_reduction == "sum":
            return per_token.sum()
        return per_token.sum() / (y >= 0).sum().clamp(min=1)


def step_micro_batches():
    """
    The micro-batches of one step, deliberately uneven: A has 3 targets (1, 2, 3), B has 1 (14), C none.
    Mean over the step's 4 targets: (1 + 2 + 3 + 14) / 4 = 5, so the gradient is 5. Averaging per-micro-batch
    means instead would give (2 + 14) / 2 = 8 for A, B, and (2 + 14 + 0) / 3 = 5.33 once C is added.
    """
    x = torch.zeros(1, 4, dtype=torch.long)
    a = torch.tensor([[1, 2, 3, -1]])
    b = torch.tensor([[-1, -1, 14, -1]])
    c = torch.tensor([[-1, -1, -1, -1]])
    return [(x, a), (x, b), (x, c)]


# ---------------------------------------------------------------------------------------------
# Generation on hand-made models (test_engine, test_calculator)


def engine_stream(engine, prompt, num_samples=1, **kwargs):
    """Each sample's raw token stream from Engine.generate, and its masks."""
    columns = list(engine.generate(prompt, num_samples, **kwargs))
    return ([[c[0][i] for c in columns] for i in range(num_samples)],
            [[c[1][i] for c in columns] for i in range(num_samples)])


# -----------------------------------------------------------------------------
# exactness


def bigram_model(tokenizer, transitions, n_embd=128, sequence_len=64):
    """
    A real GPT with hand-set weights that follows `transitions` {token: [next token(s)]}: its blocks add
    nothing (output projections are zero at init) so the head sees only the current token's embedding; the
    embeddings of the tokens in `transitions` are orthogonal one-hot vectors, and the head gives each listed
    next token a logit of +100 and every other token -100 (softcapped to about +-15). One next token:
    chosen with probability 1 - 1e-10 even at temperature 1; two: a fair coin between them.
    """
    from nanochat.gpt import GPT, GPTConfig
    cfg = GPTConfig(sequence_len=sequence_len, vocab_size=tokenizer.get_vocab_size(), n_layer=1, n_head=2, n_kv_head=2,
                    n_embd=n_embd)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.init_weights()
    with torch.no_grad():
        for j, (token, nexts) in enumerate(transitions.items()):
            model.transformer.wte.weight[token] = 0.0
            model.transformer.wte.weight[token, j] = 1.0  # normed: sqrt(n_embd) * e_j
            model.lm_head.weight[:, j] = -100.0 / n_embd ** 0.5
            for nxt in nexts:
                model.lm_head.weight[nxt, j] = 100.0 / n_embd ** 0.5
    model.eval()
    return model


def tool_model(tokenizer, expression, branch=False):
    """
    A bigram model that writes "T", then calls the tool on `expression`, then "!" and ends:
    assistant_start -> "T" -> python_start -> expression tokens -> python_end; output_end -> "!" -> assistant_end.
    With branch: assistant_start -> "T" or "x" (a coin flip), and "x" -> assistant_end (no tool call).
    The expression's tokens must all differ (a bigram model cannot tell two occurrences of a token apart).
    """
    sp = tokenizer.encode_special
    t = tokenizer.encode("T")[0]
    x = tokenizer.encode("x")[0]
    bang = tokenizer.encode("!")[0]
    chain = [sp("<|assistant_start|>"), t, sp("<|python_start|>"), *tokenizer.encode(expression), sp("<|python_end|>")]
    assert len(set(chain)) == len(chain)
    transitions = {a: [b] for a, b in zip(chain, chain[1:])}
    transitions[sp("<|python_end|>")] = [bang]  # taken only if the tool gives no output
    transitions[sp("<|output_end|>")] = [bang]
    transitions[bang] = [sp("<|assistant_end|>")]
    if branch:
        transitions[sp("<|assistant_start|>")] = [t, x]
        transitions[x] = [sp("<|assistant_end|>")]
    return bigram_model(tokenizer, transitions), chain[1:]


def written_out(q, k, v, window=None, key_mask=None):
    """
    Attention in float64, one query and key at a time: query i of Tq is at position Tk - Tq + i and sees key j
    when j <= its position, its position - j <= window (if any), and key_mask allows j.
    """
    B, H, Tq, D = q.shape
    Tk = k.size(2)
    rep = H // k.size(1)
    k = k.double().repeat_interleave(rep, dim=1)
    v = v.double().repeat_interleave(rep, dim=1)
    out = torch.zeros(B, H, Tq, D, dtype=torch.float64)
    for b in range(B):
        for i in range(Tq):
            pos = Tk - Tq + i
            seen = [j for j in range(Tk) if j <= pos and (window is None or pos - j <= window)
                    and (key_mask is None or bool(key_mask[b, 0, 0, j]))]
            scores = torch.einsum("hd,hjd->hj", q[b, :, i].double(), k[b, :, seen]) / math.sqrt(D)  # (H, len(seen))
            out[b, :, i] = torch.einsum("hj,hjd->hd", torch.softmax(scores, dim=-1), v[b, :, seen])
    return out


def save_random_model(config, tokenizer, model_tag, recipe="2026", step=7):
    """
    A base checkpoint (in the current NANOCHAT_BASE_DIR) of an untrained GPT of `config`, initialised by `recipe`
    with seed 0, its output projections and head random (N(0, 0.1)) so that every part counts in its logits.
    """
    from nanochat.checkpoint_manager import checkpoint_dir_for, save_checkpoint
    from nanochat.gpt import GPT
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights(recipe=recipe)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight") or name == "lm_head.weight":
                p.normal_(0, 0.1)
    meta = dict(model_config=config.to_dict(),
                tokenizer=dict(fingerprint=tokenizer.fingerprint(), vocab_size=tokenizer.get_vocab_size()))
    save_checkpoint(checkpoint_dir_for("base", model_tag), step, model.state_dict(), None, meta)


HEAD_REPO_VARIABLE = "NANOCHAT_HEAD_REPO"  # a git clone (or bare repo) of karpathy/nanochat, as bench/gpu_prepare.sh
HEAD_COMMIT = "92d63d4"  # the commit the benchmarks beside HEAD were written against


def head_checkout(directory):
    """
    karpathy/nanochat HEAD_COMMIT's nanochat/ and scripts/ extracted into `directory` with a COMMIT file, as
    bench/gpu_prepare.sh makes .head (the benchmarks' tables name the commit from it), from the git repo that
    $NANOCHAT_HEAD_REPO names (a test never clones: it runs without network). A skip, with a one-line reason naming the
    variable, where it is unset or its repo lacks the commit.
    """
    import subprocess
    repo = os.environ.get(HEAD_REPO_VARIABLE, "")
    if not repo:
        pytest.skip(f"{HEAD_REPO_VARIABLE} is not set (a git clone of karpathy/nanochat holding {HEAD_COMMIT})")
    if subprocess.run(["git", "-C", repo, "cat-file", "-e", HEAD_COMMIT], capture_output=True).returncode:
        pytest.skip(f"{HEAD_REPO_VARIABLE}={repo} is not a git repo holding karpathy/nanochat's {HEAD_COMMIT}")
    os.makedirs(directory)
    archive = subprocess.run(["git", "-C", repo, "archive", HEAD_COMMIT, "nanochat", "scripts"],
                             capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive.stdout, check=True)
    with open(os.path.join(directory, "COMMIT"), "w") as f:
        f.write(HEAD_COMMIT + "\n")
    return directory
