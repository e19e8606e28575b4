"""
bench/gpu_measure.sh, the prepared command a GPU machine runs (issue 52): what it can be checked for without a
GPU. Every benchmark command in its parts names a script that exists and settings that script takes (a setting
renamed here would otherwise be found on the GPU, in minutes that are counted), base_train's settings passed through
--extra included; an unknown part and a machine without a GPU are refused with one line, exit status 2.
"""

import os
import re
import shlex
import subprocess
import sys

import pytest

from helpers import REPO_ROOT, run_script

SCRIPT = os.path.join(REPO_ROOT, "bench", "gpu_measure.sh")


def commands():
    """Each `python3 bench/<name>.py ...` line of the script's parts (continuations joined), split as bash would."""
    text = open(SCRIPT).read().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        m = re.search(r"python3 (bench/\w+\.py)(.*?)(?:&&|\|\||$)", line)
        if m and not line.lstrip().startswith("#"):
            found.append((m[1], shlex.split(m[2].replace('"$OUT_DIR', '"/tmp/out').replace("$2", "--fp8=True"))))
    return found


def settings_of(argv):
    """The --key=value settings a script's --help lists."""
    result = run_script(*argv, "--help", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return set(re.findall(r"--(\w+)", result.stdout))


def test_every_part_runs_a_script_that_takes_its_settings():
    found = commands()
    assert {script for script, _ in found} >= {"bench/head_speed.py", "bench/profile_step.py", "bench/engine.py",
                                                "bench/train_speed.py", "bench/attention.py", "bench/quality.py"}
    known = {}
    for script, args in found:
        assert os.path.exists(os.path.join(REPO_ROOT, script)), script
        if script not in known:
            known[script] = settings_of([script])
        for arg in args:
            key = arg.split("=", 1)[0].removeprefix("--")
            assert arg.startswith("--") and key in known[script], (script, arg)
    base_train = settings_of(["-m", "scripts.base_train"])
    extras = re.findall(r'^\s*lever "[^"]*" "([^"]*)"', open(SCRIPT).read(), re.M)
    assert "--attention=flex" in " ".join(extras)
    for extra in extras:
        for arg in extra.split():
            assert arg.split("=", 1)[0].removeprefix("--") in base_train, arg


@pytest.mark.parametrize("part, message", [("bogus", "error: unknown part 'bogus'; the parts: head profile"),
                                           ("attention", "error: these are GPU measurements")])
def test_an_unknown_part_or_no_gpu_is_refused_with_one_line(part, message, tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    result = subprocess.run(["bash", SCRIPT, part], capture_output=True, text=True, timeout=120, env=env)
    if part == "attention" and "no GPU" not in result.stdout:
        pytest.skip("this machine has a GPU")
    assert result.returncode == 2
    errors = [line for line in result.stdout.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith(message), result.stdout
