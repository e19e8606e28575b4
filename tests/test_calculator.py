"""
The calculator tool's tests (nanochat/execution.py, use_calculator), and the Engine forcing its output.

What it evaluates and refuses (at once, whatever the expression asks for), and the Engine forcing its output into a
generation, on bigram models that call it.
"""

import time

import pytest

from helpers import engine_stream, tool_model
from nanochat.execution import use_calculator
from nanochat.engine import Engine
from nanochat.tokenizer import Tokenizer


def test_calculator_output_is_forced_mid_generation(small_tokenizer_dir):
    tokenizer = Tokenizer.from_directory(str(small_tokenizer_dir))
    sp = tokenizer.encode_special
    model, written = tool_model(tokenizer, "6*7")
    engine = Engine(model, tokenizer)
    prompt = tokenizer.render_for_completion({"messages": [{"role": "user", "content": "what is 6 times 7?"}]})
    forced = [sp("<|output_start|>"), *tokenizer.encode("42"), sp("<|output_end|>")]
    bang = tokenizer.encode("!")[0]
    expected = written + forced + [bang, sp("<|assistant_end|>")]
    expected_masks = [1] * len(written) + [0] * len(forced) + [1, 1]
    (tokens,), (masks,) = engine_stream(engine, prompt, max_tokens=40, temperature=0)
    assert tokens == expected and masks == expected_masks
    results, result_masks = engine.generate_batch(prompt, num_samples=2, max_tokens=40, temperature=1.0)
    assert results == [prompt + expected[:-1]] * 2
    assert result_masks == [[0] * len(prompt) + expected_masks[:-1]] * 2
    # max_tokens, or the context, running out in the middle of the tool's output just ends the sample there
    cut = len(written) + 2
    assert engine.generate_batch(prompt, max_tokens=cut, temperature=0)[0] == [prompt + expected[:cut]]
    short = Engine(model, tokenizer, context_len=len(prompt) + cut)
    assert short.generate_batch(prompt, max_tokens=None, temperature=0)[0] == [prompt + expected[:cut]]


def test_refused_expression_forces_nothing(small_tokenizer_dir):
    tokenizer = Tokenizer.from_directory(str(small_tokenizer_dir))
    sp = tokenizer.encode_special
    model, written = tool_model(tokenizer, "6*")  # a syntax error: no result
    engine = Engine(model, tokenizer)
    (tokens,), (masks,) = engine_stream(engine, [sp("<|assistant_start|>")], max_tokens=40, temperature=0)
    assert tokens == written + [tokenizer.encode("!")[0], sp("<|assistant_end|>")]
    assert masks == [1] * len(tokens)


def test_each_sample_keeps_its_own_tool_state(small_tokenizer_dir):
    tokenizer = Tokenizer.from_directory(str(small_tokenizer_dir))
    sp = tokenizer.encode_special
    model, written = tool_model(tokenizer, "3**4", branch=True)
    engine = Engine(model, tokenizer)
    prompt = [sp("<|bos|>"), sp("<|assistant_start|>")]
    forced = [sp("<|output_start|>"), *tokenizer.encode("81"), sp("<|output_end|>")]
    with_tool = written + forced + [tokenizer.encode("!")[0], sp("<|assistant_end|>")]
    with_tool_masks = [1] * len(written) + [0] * len(forced) + [1, 1]
    without_tool = [tokenizer.encode("x")[0], sp("<|assistant_end|>")]
    for seed in range(20):  # find a seed where the coin flips go both ways among 6 samples
        streams, masks = engine_stream(engine, prompt, num_samples=6, max_tokens=50, temperature=1.0, seed=seed)
        if 0 < sum(s[0] == without_tool[0] for s in streams) < 6:
            break
    else:
        pytest.fail("no seed gave both branches")
    steps = len(with_tool)
    for stream, mask in zip(streams, masks):
        assert len(stream) == steps  # every column has a token for every sample
        if stream[0] == without_tool[0]:
            # after its end, a sample's entries are padding: its end token again, mask 0
            assert stream == without_tool + [sp("<|assistant_end|>")] * (steps - 2)
            assert mask == [1, 1] + [0] * (steps - 2)
        else:
            assert stream == with_tool and mask == with_tool_masks


# -----------------------------------------------------------------------------
# the calculator


@pytest.mark.parametrize("expr, result", [
    ("2+3*4", "14"), ("10/4", "2.5"), ("7//2", "3"), ("7 % 3", "1"), ("2**10", "1024"), ("-(3 - 5)", "2"),
    ("(1.5 + 2) * 2", "7.0"), ("1,200 * 3", "3600"), (" 12 + 12 ", "24"), ("2**-1", "0.5"),
    ("'strawberry'.count('r')", "3"), ("len('hello')", "5"), ("'Hello'.upper()", "HELLO"),
    ("'  pad '.strip()", "pad"), ("'a-b-c'.replace('-', '+')", "a+b+c"), ("'ab' * 3", "ababab"),
    ("'a,b'.count(',')", "1"), ("'abc'.startswith('a')", "True"),
])
def test_calculator_evaluates(expr, result):
    assert use_calculator(expr) == result


@pytest.mark.parametrize("expr", [
    "__import__('os').system('echo pwned')", "__import__('os')", "open('/etc/passwd').read()",
    "().__class__.__bases__[0].__subclasses__()", "'a'.__class__", "'a'.upper.__self__", "'a'.__len__()",
    "(lambda: 1)()", "[x for x in range(10)]", "globals()", "x", "eval('1+1')", "exec('x=1')",
    "getattr('a', 'upper')()", "'{}'.format(1)", "'%s' % 'a'", "'%*d' % (10**9, 1)", "'a'.join(['b'])",
    "'a'.center(10**9)", "1 if True else 2", "True + 1", "1 < 2", "(1, 2)", "{'a': 1}", "'abc'[0]",
    "'a'.count(sep='a')", "len(*'a')",
    "9**9**9", "10**100000", "2**4001", "(2**4000) * (2**4000)", "'a' * 10**9", "10**9 * 'a'",
    "'a'.replace('', 'b' * 900) * 2", "'ab'.replace('', 'x' * 999)", "1e308 * 10", "(-8) ** 0.5",
    "1/0", "5 % 0", "", "1 +", "-" * 2000 + "1", "(" * 300 + "1" + ")" * 300,
])
def test_calculator_refuses(expr):
    start = time.perf_counter()
    assert use_calculator(expr) is None
    assert time.perf_counter() - start < 0.5  # refused at once, not after computing something huge


def test_calculator_limits():
    assert use_calculator("1 + 1", time_limit=-1) is None  # the deadline is checked at every node
    assert use_calculator("1 + 1") == "2"
    assert use_calculator("-" * 900 + "1") in (None, "1")  # deep nesting: an answer or None, never a crash
    assert use_calculator("2**3999") == str(2**3999)  # the limits are about size, not a blanket refusal
