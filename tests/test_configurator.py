"""
The configurator's tests (nanochat/configurator.py): `--key=value` parsed and checked, config files, --help.
"""

import copy
import logging
import os
import sys

import pytest

from helpers import REPO_ROOT, run_in_process, run_script
from nanochat.configurator import configure, format_help, parse_args
from nanochat.output import UserError

KEYS = dict(depth=20, lr=0.02, run="dummy", compile=True, total_batch_size=524288)

SCRIPT = '''"""A toy stage script."""
from nanochat.configurator import configure
depth = 20  # model depth
matrix_lr = 0.02  # Muon learning rate
run = "dummy"  # wandb run name
compile = True
config = configure(globals())
print("RESULT", depth, matrix_lr, run, compile, sorted(config))
'''


def run_toy(tmp_path, *args, nproc=1):
    path = tmp_path / "toy_train.py"
    path.write_text(SCRIPT)
    return run_script(path, *args, nproc=nproc)


def test_values_are_parsed_against_the_default_type():
    out = parse_args(["--depth=12", "--lr=1", "--run=a=b", "--compile=false", "--total_batch_size=1e3"], KEYS)
    assert out == dict(depth=12, lr=1.0, run="a=b", compile=False, total_batch_size=1000)
    assert type(out["lr"]) is float
    for raw, expected in (("true", True), ("1", True), ("0", False), ("False", False)):
        assert parse_args([f"--compile={raw}"], KEYS) == dict(compile=expected)
    assert parse_args(["--compile"], KEYS) == dict(compile=True)


def test_dashes_equal_underscores():
    assert parse_args(["--total-batch-size=8"], KEYS) == dict(total_batch_size=8)


@pytest.mark.parametrize("arg, message", [
    ("--dept=3", "unknown config key 'dept' (did you mean --depth?)"),
    ("--depth=0.5", "--depth expects an int, got '0.5'"),
    ("--depth=abc", "--depth expects an int"),
    ("--lr=fast", "--lr expects a float"),
    ("--compile=maybe", "--compile expects a bool"),
    ("--depth", "has no value"),
    ("nonexistent.py", "config file 'nonexistent.py' not found"),
])
def test_bad_input_is_a_user_error(arg, message):
    with pytest.raises(UserError) as e:
        parse_args([arg], KEYS)
    assert message in str(e.value)


def test_config_file_then_overrides(tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text("depth = 6\nlr = 3  # ints are fine for floats\nrun = 'from-file'\n")
    assert parse_args([str(cfg), "--depth=8"], KEYS) == dict(depth=8, lr=3.0, run="from-file")
    bad = tmp_path / "bad.py"
    bad.write_text("depht = 6\n")
    with pytest.raises(UserError, match="unknown key 'depht'"):
        parse_args([str(bad)], KEYS)
    wrong_type = tmp_path / "wrong.py"
    wrong_type.write_text("depth = 'six'\n")
    with pytest.raises(UserError, match="expected int"):
        parse_args([str(wrong_type)], KEYS)


def test_configure_updates_scope_and_returns_config():
    scope = dict(KEYS, __name__="x", _private=1, some_module=os)
    config = configure(scope, ["--depth=4"])
    assert scope["depth"] == 4 and config == dict(KEYS, depth=4)


def test_script_help_lists_every_key(tmp_path):
    result = run_toy(tmp_path, "--help")
    assert result.returncode == 0
    out = result.stdout
    assert "A toy stage script." in out
    for line in ("--depth      int    20", "--matrix_lr  float  0.02", "--run        str    'dummy'",
                 "--compile    bool   True"):
        assert line in out, out
    assert "model depth" in out and "Muon learning rate" in out
    assert "RESULT" not in out  # --help exits before the script runs


def test_script_overrides_and_prints_them(tmp_path):
    result = run_toy(tmp_path, "--depth=4", "--matrix-lr=0.05", "--run=my=run")
    assert result.returncode == 0, result.stderr
    assert "Overriding: depth = 4 (default 20)" in result.stdout
    assert "RESULT 4 0.05 my=run True ['compile', 'depth', 'matrix_lr', 'run']" in result.stdout


def test_under_torchrun_a_double_dash_ends_its_options(tmp_path):
    """
    speedrun.sh's torchrun lines put `--` after the module: torchrun itself stops at --run=..., an ambiguous
    abbreviation of its --run-path / --run_path; with the `--` the script gets its arguments, the `--` skipped.
    """
    assert parse_args(["--", "--depth=3"], KEYS) == dict(depth=3)
    without = run_toy(tmp_path, "--run=x", nproc=2)
    assert without.returncode != 0 and "ambiguous option: --run=x" in without.stderr
    result = run_toy(tmp_path, "--", "--depth=4", "--run=x", nproc=2)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("RESULT 4 0.02 x True") == 2  # both ranks


def test_script_unknown_key_is_one_line_error(tmp_path):
    result = run_toy(tmp_path, "--detph=4")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: unknown config key 'detph' (did you mean --depth?); run with --help to list every key"]


def test_only_settings_are_keys_and_each_is_given_once():
    scope = {"depth": 4, "lr": 0.1, "EXIT_CODE": 75, "_private": 1, "name": "x", "helper": len}
    assert configure(scope, []) == {"depth": 4, "lr": 0.1, "name": "x"}  # no constants, privates or functions
    with pytest.raises(UserError, match="--depth is given twice"):
        configure(dict(scope), ["--depth=2", "--depth=3"])
    with pytest.raises(UserError, match="finite"):
        configure(dict(scope), ["--lr=nan"])


def test_help_shows_a_comment_continued_below_whole(tmp_path):
    """
    A comment continues on the indented `#` lines right below its key (--help shows it whole); a `# ` line with one
    space opens the next section and belongs to no key.
    """
    script = tmp_path / "toy.py"
    script.write_text('rerun = "no"  # auto: skip if done,\n'
                      '#                replace what other settings made\n'
                      'depth = 4  # model depth\n'
                      '# batch\n'
                      'lr = 0.1\n')
    listed = {line.split()[0]: line for line in format_help(dict(rerun="no", depth=4, lr=0.1), str(script))
              .splitlines() if line.startswith("  --")}
    assert listed["--rerun"].endswith("  auto: skip if done, replace what other settings made")
    assert listed["--depth"].endswith("  model depth")
    assert listed["--lr"].endswith("0.1")


@pytest.mark.parametrize("module, key", [("scripts.base_train", "rerun"), ("scripts.mid_train", "rerun"),
                                         ("scripts.chat_sft", "rerun"), ("scripts.chat_rl", "rerun"),
                                         ("scripts.base_train", "attention")])
def test_scripts_help_shows_continued_comments_whole(module, key, monkeypatch, capsys):
    """
    The training scripts' --help line for a setting whose comment runs onto the next `#` lines ends with every
    line's text, read from the script's source (it stopped at the end of the first line).
    """
    source = open(os.path.join(REPO_ROOT, *module.split(".")) + ".py", encoding="utf-8").read().splitlines()
    at = next(i for i, line in enumerate(source) if line.startswith(f"{key} = "))
    continued = []
    while source[at + 1 + len(continued)].startswith("#  "):
        continued.append(source[at + 1 + len(continued)].lstrip("#").strip())
    assert continued, source[at + 1]  # the case this test is about: a comment continued below
    expected = " ".join([source[at].split("#", 1)[1].strip(), *continued])
    logger = logging.getLogger("nanochat")
    for obj, name in ((sys, "excepthook"), (logger, "handlers"), (logger, "propagate"), (logger, "level")):
        monkeypatch.setattr(obj, name, copy.copy(getattr(obj, name)))  # configure() sets up a script's logging
    with pytest.raises(SystemExit) as done:
        run_in_process(module, "--help", monkeypatch=monkeypatch)
    assert done.value.code == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(f"  --{key} "))
    assert line.endswith(expected), (line, expected)
