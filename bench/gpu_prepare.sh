#!/usr/bin/env bash
# Everything a GPU machine without network needs for bench/gpu_check.sh and bench/gpu_measure.sh, made on a machine
# with the package index (the GPU machine itself, if it has network): the wheels of bench/gpu_check.sh's list in
# .whl/, those HEAD's base_train needs beyond them in .whl/head/ (bench/head_speed.py's docstring says why), and
# karpathy/nanochat HEAD's code at the commit the benchmarks were written against in .head/ (its nanochat/, scripts/
# and runs/, COMMIT naming it). All three are git-ignored: copy them into the GPU machine's checkout of this repo
# (.whl .head, ~29 MB).
#
#     bash bench/gpu_prepare.sh                                                  # HEAD's code cloned from GitHub
#     NANOCHAT_HEAD_REPO=/path/to/karpathy-nanochat bash bench/gpu_prepare.sh    # from a clone (or bare repo) of yours
#
# NANOCHAT_HEAD_REPO is also where the tests that run HEAD's code find it (tests/helpers.head_checkout). The wheels
# are for CPython 3.12; PYTHON_VERSION=3.11 (etc.) for the GPU machine's other python3. Running it again replaces the
# three folders.
set -euo pipefail
cd "$(dirname "$0")/.."
COMMIT=92d63d4
PY="${PYTHON_VERSION:-3.12}"
download() {  # download DIR WHEEL...: binary wheels for the GPU machine's platform and Python, no dependencies
    local dir="$1"
    shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$dir" "$@"
}
# HEAD's code first: a wrong NANOCHAT_HEAD_REPO stops the script before it replaces anything
REPO="${NANOCHAT_HEAD_REPO:-}"
if [ -z "$REPO" ]; then
    REPO=$(mktemp -d)/karpathy-nanochat
    git clone -q https://github.com/karpathy/nanochat "$REPO"
elif ! git -C "$REPO" cat-file -e "$COMMIT" 2>/dev/null; then
    echo "error: NANOCHAT_HEAD_REPO=$REPO is not a git clone of karpathy/nanochat holding $COMMIT (git fetch in it," \
        "or unset it to clone from GitHub)" >&2
    exit 1
fi
rm -rf .whl .head
download .whl rustbpe==0.1.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 click==8.5.1 h11==0.16.0 \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 \
    typing-extensions==4.16.0 opentelemetry-api==1.45.2 openai==3.57.0 jiter==0.19.0 distro==1.9.0 \
    sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 anyio==4.16.0 idna==3.20
download .whl/head wandb==0.31.0 platformdirs==4.14.8 protobuf==7.36.2
mkdir .head
git -C "$REPO" archive "$COMMIT" nanochat scripts runs | tar -x -C .head
echo "$COMMIT" > .head/COMMIT
echo "gpu_prepare: .whl $(ls .whl/*.whl | wc -l) wheels, .whl/head $(ls .whl/head/*.whl | wc -l), .head at $COMMIT;" \
    "$(du -sh .whl .head | awk '{print $1}' | paste -sd+) (copy .whl and .head to the GPU machine)"
