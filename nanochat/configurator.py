"""
`--key=value` overrides for the config variables a script declares at its top.

A script declares its settings as plain module-level variables, then calls configure(globals()):

    depth = 20                # model depth (the one size dial)
    device_batch_size = 32    # rows per forward/backward per rank
    config = configure(globals())

    $ python -m scripts.base_train --depth=12 --device-batch-size=4

Every int / float / bool / str global that does not start with "_", is not an ALL_CAPS constant and is
defined before the call is a config key. Settings that several scripts share are declared once, the same way, at
the top level of a library module, and taken with configure(globals(), shared=...): the training scripts take
nanochat/stage.py's, `configure(globals(), shared=stage_settings())`. They come first, are parsed as the script's own
and --help lists them with the module's comments; a script that declares one of them too is an error (declare it
once; a script's own default is a value: stage_settings(save_every=60)). Rules:
- only declared keys are accepted; a typo gets an error naming the closest valid keys;
- values are parsed and checked against the type of the default: an int is fine for a float, bools take
  true/false/1/0/yes/no/on/off, strings are taken as they are, and values may themselves contain "=";
- `-` and `_` are interchangeable in key names;
- a key given twice on the command line is an error (which one was meant?); a `--key` after a config file
  overrides the file's value;
- floats must be finite (nan and inf are refused);
- `--help` lists every key with its type, default and comment (whole: a comment continued on the indented `#`
  lines below it), and exits 0;
- an argument without `--` is a python file of assignments (`depth = 12`), applied in command-line order;
- `--` alone is skipped: under torchrun it ends torchrun's own options (`torchrun ... -m scripts.base_train --
  --run=d20`; without it torchrun reads `--run=d20` as an ambiguous abbreviation of its --run-path), and a
  Python whose argparse passes it on to the script must not fail on it.
What a value MEANS is checked by the script right after configure(), with check_config(): positive sizes,
fractions in [0, 1], choices, ... so that a bad value is refused before any work starts.
Errors are UserError: the script prints one line and exits with status 1.
"""

import difflib
import math
import os
import re
import sys

from nanochat.output import UserError, print0, setup_default_logging

SIMPLE_TYPES = (bool, int, float, str)


def _config_keys(scope):
    # ALL_CAPS names are constants (a script's own, or imported ones), never settings
    return {k: v for k, v in scope.items() if not k.startswith("_") and not k.isupper() and type(v) in SIMPLE_TYPES}


def parse_value(key, raw, default):
    """Turn the command-line string `raw` into the type of `default`, or raise UserError."""
    kind = type(default)
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise UserError(f"--{key} expects a bool (true/false, 1/0, yes/no, on/off), got {raw!r}")
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            # accept "1e6"-style input when it is a whole number, reject 0.5
            try:
                as_float = float(raw)
            except ValueError:
                as_float = None
            if as_float is not None and as_float.is_integer():
                return int(as_float)
            raise UserError(f"--{key} expects an int, got {raw!r}") from None
    if kind is float:
        try:
            value = float(raw)
        except ValueError:
            raise UserError(f"--{key} expects a float, got {raw!r}") from None
        if not math.isfinite(value):
            raise UserError(f"--{key} expects a finite number, got {raw!r}")
        return value
    return raw  # str: as-is


def _check_python_value(key, value, default, source):
    """Values from a config file are python objects already: check the type instead of parsing."""
    kind = type(default)
    if kind is float and type(value) is int:
        return float(value)
    if type(value) is not kind:
        raise UserError(f"{source}: {key} = {value!r} has type {type(value).__name__}, expected {kind.__name__}")
    return value


def _comments(path):
    """
    The `# comments` of the script's `key = value` lines, shown by --help. A comment continues on the `#` lines
    right below it whose text is indented (`#` then two spaces or more, aligned under the text above), so a long
    comment is shown whole; a `# ` line with one space opens a section of the script and is not part of it.
    """
    comments, current = {}, None
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                more = re.match(r"^#\s{2,}(\S.*)$", line.rstrip())
                if current is not None and more:
                    comments[current] += " " + more.group(1).strip()
                    continue
                current = None
                m = re.match(r"^([A-Za-z]\w*)\s*=.*?#\s*(.*)$", line)
                if m and m.group(1) not in comments:
                    current = m.group(1)
                    comments[current] = m.group(2).strip()
    return comments


def format_help(keys, script_path=None, doc=None, comments=None):
    """The --help text: `doc`, the usage, then every key of `keys` with its type, default and comment (`comments`;
    default: those of the script at `script_path`)."""
    comments = _comments(script_path) if comments is None else comments
    name = os.path.splitext(os.path.basename(script_path))[0] if script_path else "script"
    lines = []
    if doc:
        lines += [doc.strip(), ""]
    lines.append(f"usage: python -m scripts.{name} [config_file.py] [--key=value ...]")
    lines.append("       (under torchrun: torchrun --standalone --nproc_per_node=N -m scripts.%s [--key=value ...])"
                 % name)
    lines.append("")
    lines.append("config keys (type, default):")
    width = max(len(k) for k in keys) if keys else 0
    for k, v in keys.items():
        comment = comments.get(k, "")
        lines.append(f"  --{k:<{width}}  {type(v).__name__:<5}  {v!r:<14}  {comment}".rstrip())
    return "\n".join(lines)


def parse_args(argv, keys, script_path=None, doc=None, comments=None):
    """
    Parse `argv` against `keys` (name -> default). Returns {key: new value} for the overridden keys,
    in the order given. `--help` prints the key listing (rank 0; format_help) and exits 0.
    """
    overrides, given = {}, set()
    for arg in argv:
        if arg == "--":
            continue
        if arg in ("-h", "--help"):
            _print_help(format_help(keys, script_path, doc, comments))
        if not arg.startswith("--"):
            # a config file of python assignments
            if not os.path.isfile(arg):
                raise UserError(f"config file {arg!r} not found "
                                "(arguments are --key=value, or a path to a .py config file)")
            file_scope = {}
            with open(arg, encoding="utf-8") as f:
                try:
                    exec(compile(f.read(), arg, "exec"), {}, file_scope)
                except Exception as e:
                    raise UserError(f"config file {arg}: {type(e).__name__}: {e}") from None
            for k, v in file_scope.items():
                if k.startswith("_"):
                    continue
                if k not in keys:
                    raise UserError(f"config file {arg}: unknown key {k!r}" + _suggest(k, keys))
                overrides[k] = _check_python_value(k, v, keys[k], f"config file {arg}")
            continue
        body = arg[2:]
        if "=" not in body:
            key = body.replace("-", "_")
            if key in keys and type(keys[key]) is bool:
                _once(key, given)
                overrides[key] = True  # `--flag` alone turns a bool on
                continue
            raise UserError(f"argument {arg!r} has no value: use --{key}=VALUE"
                            + ("" if key in keys else _suggest(key, keys)))
        key, raw = body.split("=", 1)  # split once: values may contain '='
        key = key.replace("-", "_")
        if key not in keys:
            raise UserError(f"unknown config key {key!r}" + _suggest(key, keys))
        _once(key, given)
        overrides[key] = parse_value(key, raw, keys[key])
    return overrides


def _once(key, given):
    if key in given:
        raise UserError(f"--{key} is given twice on the command line: keep one")
    given.add(key)


def _print_help(text):
    """Print the help (rank 0) and exit 0, quietly also when the reader went away (`--help | head`)."""
    try:
        print0(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader closed the pipe: point stdout at /dev/null so the flush at exit does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(0)


def _suggest(key, keys):
    near = closest(key, keys)
    hint = f" (did you mean {', '.join('--' + k for k in near)}?)" if near else ""
    return hint + "; run with --help to list every key"


def configure(scope, argv=None, shared=None):
    """
    Apply command-line overrides to the config variables of `scope` (a script's globals()) in place, and
    return the full config as a dict (for wandb, the report and checkpoint metadata). `shared`: the scope of a
    module whose settings the script takes too (its globals(), some defaults replaced), first, into `scope` as well.
    """
    setup_default_logging()
    argv = sys.argv[1:] if argv is None else argv
    taken = _config_keys(shared or {})
    own = _config_keys(scope)
    twice = [k for k in own if k in taken]
    if twice:  # a second declaration would silently win over the shared one
        raise ValueError(f"{', '.join(twice)}: declared by {scope.get('__file__')} and taken from "
                         f"{shared.get('__file__')}; declare each setting once")
    keys = {**taken, **own}
    comments = _comments(scope.get("__file__"))  # each key's comment from the file that declares it
    if taken:
        comments.update({k: c for k, c in _comments(shared.get("__file__")).items() if k in taken})
    overrides = parse_args(argv, keys, scope.get("__file__"), scope.get("__doc__"), comments)
    for k, v in overrides.items():
        print0(f"Overriding: {k} = {v!r} (default {keys[k]!r})")
    scope.update(taken)
    scope.update(overrides)
    return {k: scope[k] for k in keys}


def check_config(config, positive=(), positive_or_unset=(), non_negative=(), fractions=(), choices=None):
    """
    Check what the values of `config` (configure()'s dict) mean, and raise a one-line UserError at the first
    bad one. Call it right after configure(), so nothing runs with a bad value:
      positive           > 0 (sizes, counts)
      positive_or_unset  > 0, or exactly -1 meaning "not set" (the script's comment says what happens then);
                         0 and other negatives are refused rather than silently meaning something
      non_negative       >= 0 (learning rates, weight decay, clipping; floats are finite already)
      fractions          in [0, 1]
      choices            {key: allowed values}
    """
    for key in positive:
        if not config[key] > 0:
            raise UserError(f"--{key} must be > 0, got {config[key]!r}")
    for key in positive_or_unset:
        if not (config[key] > 0 or config[key] == -1):
            raise UserError(f"--{key} must be > 0, or -1 for 'not set', got {config[key]!r}")
    for key in non_negative:
        if not config[key] >= 0:
            raise UserError(f"--{key} must be >= 0, got {config[key]!r}")
    for key in fractions:
        if not 0 <= config[key] <= 1:
            raise UserError(f"--{key} must be between 0 and 1, got {config[key]!r}")
    for key, allowed in (choices or {}).items():
        if config[key] not in allowed:
            shown = ", ".join(repr(a) if a == "" else str(a) for a in allowed)
            raise UserError(f"--{key} must be one of {shown}, got {config[key]!r}")


def closest(name, candidates):
    """For error messages: the (at most 3) candidates that look most like a mistyped `name`."""
    return difflib.get_close_matches(name, list(candidates), cutoff=0.5)
