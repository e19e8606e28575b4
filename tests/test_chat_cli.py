"""
Tests of scripts/chat_cli.py, run as a user runs it (a subprocess) on a tiny trained checkpoint.

`-p` answers once with exactly the engine's reply, the interactive chat keeps the conversation (the second reply is
the engine's reply to both exchanges), `clear` starts over, the context overflows gracefully, Ctrl-C at the prompt
and Ctrl-D behave, and a missing checkpoint is one line naming the stage to run.
"""

import re
import signal
import subprocess
import threading
import time

import pytest

import os

from helpers import REPO_ROOT, computed_as_in_scripts, run_script, start_script

SAMPLING = ["--temperature=1.0", "--top_k=50"]


@pytest.fixture(scope="module")
def checkpoint_base(tiny_models):
    """The session's tiny base model (depth 1, 10 steps, context 64 tokens): its base dir, read-only."""
    return tiny_models("base")


@pytest.fixture(scope="module")
def engine(checkpoint_base):
    """The same checkpoint, loaded here, to compute the replies the CLI must print."""
    import torch

    from nanochat.checkpoint_manager import load_model
    from nanochat.engine import Engine
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(checkpoint_base))
        model, tokenizer, _ = load_model("base", torch.device("cpu"), phase="eval")
    return Engine(model, tokenizer)


def expected_turn(engine, messages, max_tokens, seed, temperature=1.0, top_k=50):
    """The reply to `messages` and the context it fills (prompt + reply + end token), as the CLI computes them."""
    prompt = engine.tokenizer.render_for_completion({"messages": messages})
    budget = min(max_tokens, engine.context_len - len(prompt))
    ids, n = [], 0
    with computed_as_in_scripts():
        for column, _ in engine.generate(prompt, max_tokens=budget, temperature=temperature, top_k=top_k, seed=seed):
            n += 1
            if column[0] in engine.end_tokens:
                break
            ids.append(column[0])
    return engine.tokenizer.decode(ids), len(prompt) + n


def chat_cli(base, *args, stdin=b"", timeout=120):
    # bytes, decoded here: text mode would turn a "\r" the model wrote into "\n"
    result = run_script("-m", "scripts.chat_cli", *args, env={"NANOCHAT_BASE_DIR": base}, input=stdin, text=False,
                        timeout=timeout)
    return result.returncode, result.stdout.decode("utf-8"), result.stderr.decode("utf-8")


def seed_with_text(engine, messages, max_tokens):
    """A seed whose reply has some text (the tiny model often ends its turn at once, which would prove little)."""
    return next(s for s in range(200) if expected_turn(engine, messages, max_tokens, s)[0].strip())


@pytest.mark.slow
def test_p_answers_once_with_the_engines_reply_and_exits(checkpoint_base, engine):
    seed = seed_with_text(engine, [{"role": "user", "content": "Hello"}], 20)
    expected, _ = expected_turn(engine, [{"role": "user", "content": "Hello"}], 20, seed)
    code, out, err = chat_cli(checkpoint_base, "--source=base", "--device_type=cpu", "-p", "Hello", "--max_tokens=20",
                              f"--seed={seed}", *SAMPLING)
    assert code == 0, err
    assert out == expected + "\n"  # stdout carries the reply and nothing else
    assert "Loaded base model d1" in err  # the status lines went to stderr
    # --prompt=... is the same thing
    code, out2, _ = chat_cli(checkpoint_base, "--source=base", "--device_type=cpu", "--prompt=Hello", "--max_tokens=20",
                             f"--seed={seed}", *SAMPLING)
    assert code == 0 and out2 == out


def parse_turns(out):
    """[(reply, context tokens used)] of an interactive session's stdout."""
    return [(m.group(1), int(m.group(2)))
            for m in re.finditer(r"Assistant: (.*?)\n\[context: (\d+)/64 tokens[^\]]*\]", out, re.S)]


@pytest.mark.slow
def test_interactive_chat_keeps_the_conversation_clears_and_quits(checkpoint_base, engine):
    long_message = "tell me everything about " * 40
    follow_ups = [f"And then what happened on day {i}?" for i in range(6)]
    stdin = "\n".join(["Hello", "How are you?", "clear", "Hello", long_message, *follow_ups,
                       "quit", "never read"]) + "\n"
    hello = [{"role": "user", "content": "Hello"}]
    seed = seed_with_text(engine, hello, 10)  # every reply uses it
    code, out, err = chat_cli(checkpoint_base, "--source=base", "--device_type=cpu", "--max_tokens=10",
                              f"--seed={seed}", *SAMPLING, stdin=stdin.encode())
    assert code == 0, err
    assert "context 64 tokens" in out  # the banner
    turns = parse_turns(out)
    assert len(turns) == 3 + len(follow_ups), out
    first = expected_turn(engine, hello, 10, seed)
    second = expected_turn(engine,
                           hello + [{"role": "assistant", "content": first[0]},
                                    {"role": "user", "content": "How are you?"}],
                           10, seed)
    assert turns[0] == first
    assert turns[1] == second  # the model was given the first exchange too
    assert second[1] > first[1]
    assert "(new conversation)" in out
    assert turns[2] == first  # after `clear`, the same first turn again
    assert "(your message is too long" in out  # refused, and the chat goes on
    # the follow-ups fill the 64-token context: the oldest exchanges are dropped, with a note, and it goes on
    assert "dropped the oldest" in out
    assert all(used <= 64 for _, used in turns)
    assert "never read" not in out  # `quit` quit


@pytest.mark.slow
def test_ctrl_c_at_the_prompt_stays_and_ctrl_d_exits(checkpoint_base):
    def as_from_a_shell():
        # SIGINT as a shell leaves it (default, unblocked): a disposition is inherited through exec, and in the full
        # suite something run earlier in this worker leaves SIGINT ignored or blocked (60 of them went unanswered)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    process = start_script("-m", "scripts.chat_cli", "--source=base", "--device_type=cpu", "--max_tokens=5",
                           env={"NANOCHAT_BASE_DIR": checkpoint_base}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, preexec_fn=as_from_a_shell)
    chunks = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: process.stdout.read1(4096), b"")), daemon=True)
    reader.start()

    def wait_for(text, timeout=60):
        deadline = time.time() + timeout
        while text not in b"".join(chunks):
            assert process.poll() is None and time.time() < deadline, b"".join(chunks)
            time.sleep(0.05)

    try:
        wait_for(b"User: ")
        process.send_signal(signal.SIGINT)
        wait_for(b"(Ctrl-C stops a reply")
        process.stdin.write(b"Hello\n")
        process.stdin.close()  # Ctrl-D
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    reader.join(timeout=10)
    out = b"".join(chunks).decode("utf-8")
    assert out.count("Assistant: ") == 1 and "[context: " in out


@pytest.mark.slow
def test_ctrl_c_inside_a_reply_stops_it_and_the_chat_goes_on(checkpoint_base, engine):
    # the SIGINT arrives inside the write of the reply's first piece (tests/signal_in_write.py: deterministic); a
    # KeyboardInterrupt raised there would have left the print half done, or escaped the reply
    hello = [{"role": "user", "content": "Hello"}]
    seed = next(s for s in range(200) if len(expected_turn(engine, hello, 20, s)[0].split()) >= 3)  # a reply of words
    text, _ = expected_turn(engine, hello, 20, seed)
    result = run_script(os.path.join(REPO_ROOT, "tests", "signal_in_write.py"), "--next", "Assistant: ", "SIGINT",
                        "scripts.chat_cli", "--source=base", "--device_type=cpu", "--max_tokens=20", f"--seed={seed}",
                        *SAMPLING, env={"NANOCHAT_BASE_DIR": checkpoint_base}, input="Hello\nHello\n")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "sent SIGINT inside the write" in result.stderr
    turns = result.stdout.split("Assistant: ")[1:]
    assert len(turns) == 2 and " [stopped]" in turns[0] and "[context: " in turns[0], result.stdout
    stopped = turns[0].split(" [stopped]")[0]
    assert stopped and text.startswith(stopped) and stopped != text, (stopped, text)  # the reply's first piece only
    assert " [stopped]" not in turns[1]  # the next reply runs as usual: the reply's handler is gone with it


@pytest.mark.parametrize("source, stage", [("sft", "python -m scripts.chat_sft"),
                                           ("base", "python -m scripts.base_train")])
def test_a_missing_checkpoint_is_one_line_naming_the_stage(tmp_path, source, stage):
    code, out, err = chat_cli(tmp_path / "empty", f"--source={source}", "--device_type=cpu", "-p", "hi")
    assert code == 1
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and stage in lines[0], err


def test_help_and_a_p_without_its_prompt(tmp_path):
    code, out, _ = chat_cli(tmp_path, "--help")
    assert code == 0 and "--prompt" in out and '-p "' in out and "--max_tokens" in out
    code, _, err = chat_cli(tmp_path, "--device_type=cpu", "-p")
    assert (code == 1
            and err.strip().splitlines() == ['error: -p needs the prompt after it, e.g. -p "Why is the sky blue?"'])
