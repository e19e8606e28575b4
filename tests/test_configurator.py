"""
The configurator's tests (nanochat/configurator.py): `--key=value` parsed and checked, config files, settings taken
from a module (the training stages' from nanochat/stage.py), --help, complete in every script.
"""

import ast
import glob
import io
import os
import runpy
import tokenize

import pytest

from helpers import REPO_ROOT, as_script, run_script
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


def test_settings_taken_from_a_module_come_first_with_its_comments(tmp_path):
    """
    configure(scope, shared=...): the shared module's settings are parsed as the script's own, come first, go into the
    script's scope, and --help shows the comments of the file that declares each; declared twice is an error.
    """
    shared_file = tmp_path / "shared.py"
    shared_file.write_text('run = "dummy"  # wandb run name\n'
                           'save_every = -1  # steps between checkpoints,\n'
                           '#                 whole\n'
                           'depth = 1  # not this one: the script\'s own depth is not taken\n')
    script_file = tmp_path / "script.py"
    script_file.write_text('depth = 4  # model depth\n')
    shared = dict(run="dummy", save_every=60, __file__=str(shared_file), EXIT_CODE=75, helper=len)
    scope = dict(depth=4, __file__=str(script_file))
    config = configure(scope, ["--run=x"], shared=shared)
    assert list(config.items()) == [("run", "x"), ("save_every", 60), ("depth", 4)]  # a value replaced a default
    assert scope["run"] == "x" and scope["save_every"] == 60
    with pytest.raises(SystemExit):
        configure(dict(depth=4, __file__=str(script_file)), ["--help"], shared=shared)
    with pytest.raises(UserError, match=r"unknown config key 'save_evry' \(did you mean --save_every\?\)"):
        configure(dict(depth=4), ["--save_evry=3"], shared=shared)
    with pytest.raises(UserError, match="--save_every expects an int"):
        configure(dict(depth=4), ["--save_every=often"], shared=shared)
    with pytest.raises(ValueError, match="depth: declared by .* and taken from .*; declare each setting once"):
        configure(dict(depth=4), [], shared=dict(shared, depth=1))


def test_help_of_taken_settings(tmp_path, capsys):
    shared_file = tmp_path / "shared.py"
    shared_file.write_text('save_every = -1  # steps between checkpoints,\n'
                           '#                 whole\n')
    script_file = tmp_path / "script.py"
    script_file.write_text('depth = 4  # model depth\n'
                           'save_every = 3  # a line of the script that is not the setting\n')
    with pytest.raises(SystemExit):
        configure(dict(depth=4, __file__=str(script_file)), ["--help"],
                  shared=dict(save_every=60, __file__=str(shared_file)))
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  --")]
    assert listed == ["  --save_every  int    60              steps between checkpoints, whole",
                      "  --depth       int    4               model depth"]


def declared_settings(path):
    """
    {name: (default, comment)} of the settings the file at `path` declares, read with ast and tokenize (not as the
    configurator reads them): its top-level `name = value  # comment` lines (a comment continued on the `#` lines
    indented below it) before the configure() call, whose value is an int, float, bool or str and whose name is
    neither private nor ALL_CAPS; and the settings it takes (configure(..., shared=stage_settings(key=value, ...)):
    nanochat/stage.py's, with those values), first.
    """
    source = open(path, encoding="utf-8").read()
    tree = ast.parse(source)
    call = next((node for node in ast.walk(tree) if isinstance(node, ast.Call)
                 and getattr(node.func, "id", None) == "configure"), None)
    comments = {token.start[0]: token.string for token in tokenize.generate_tokens(io.StringIO(source).readline)
                if token.type == tokenize.COMMENT}
    lines = source.splitlines()
    settings = {}
    shared = next((k.value for k in (call.keywords if call else []) if k.arg == "shared"), None)
    if shared is not None:
        assert shared.func.id == "stage_settings", ast.dump(shared)
        taken = declared_settings(os.path.join(REPO_ROOT, "nanochat", "stage.py"))
        for keyword in shared.keywords:
            taken[keyword.arg] = (ast.literal_eval(keyword.value), taken[keyword.arg][1])
        settings.update(taken)
    for node in tree.body:
        if call is not None and node.lineno >= call.lineno:
            break
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        name = node.targets[0].id
        if name.startswith("_") or name.isupper() or any(isinstance(n, ast.Name) for n in ast.walk(node.value)):
            continue
        value = eval(compile(ast.Expression(node.value), path, "eval"), {})
        if type(value) not in (bool, int, float, str):
            continue
        comment = comments.get(node.lineno, "#")[1:].strip()
        below = node.lineno  # 1-based: lines[below] is the line below the setting
        while below < len(lines) and lines[below].startswith("#  ") and below + 1 in comments:
            comment += " " + lines[below][1:].strip()
            below += 1
        settings[name] = (value, comment)
    return settings


SCRIPTS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO_ROOT, "scripts", "*.py"))
                 if not p.endswith("__init__.py"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_scripts_help_lists_each_of_its_settings_with_its_whole_comment(script, capsys):
    """
    `--help` of every script lists exactly the settings it declares and those it takes, in that order (taken first),
    each with its type, its default (a stage's own: chat_rl saves every 60 steps) and its whole comment.
    """
    settings = declared_settings(os.path.join(REPO_ROOT, "scripts", f"{script}.py"))
    assert settings, script
    with as_script(f"scripts.{script}", "--help"), pytest.raises(SystemExit) as done:
        runpy.run_module(f"scripts.{script}", run_name="__main__")
    assert done.value.code == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  --")]
    assert [line.split()[0] for line in listed] == [f"--{name}" for name in settings]
    for line, (name, (default, comment)) in zip(listed, settings.items()):
        kind, shown = line.split()[1], line.split(None, 2)[2]
        assert kind == type(default).__name__ and shown.startswith(repr(default)), (line, default)
        assert line.endswith(f"  {comment}" if comment else repr(default)), (line, comment)
    if script in ("base_train", "mid_train", "chat_sft", "chat_rl"):  # the stage's settings first, whole
        assert list(settings)[:3] == ["run", "device_type", "model_tag"] and "save_every_minutes" in settings
        assert settings["rerun"][1].endswith("(nanochat/rerun.py); no: a directory with checkpoints is refused")
        assert settings["save_every"][0] == (60 if script == "chat_rl" else -1)
