#!/usr/bin/env bash
# The GPU check: speedrun.sh's gpu profile as a smoke (NANOCHAT_PROFILE=gpu NANOCHAT_SMOKE=1) on this machine's GPUs,
# offline, in a few minutes (at most 6 on one H100): the pydocs corpus, a small tokenizer, every stage through
# torchrun with torch.compile, chat_web answering through OpenAI's client, the report; then one line per stage.
#
#     bash bench/gpu_check.sh        # from anywhere; with $OUT set, the log (smoke.log) and report.md land there
#
# Made for a GPU machine without network, whose python3 has torch and most of what nanochat needs but neither
# this project installed (python -m from the repo root needs no install) nor the packages below. They come as
# wheels in .whl/ at the repo root (git-ignored), installed into /tmp/site (no index, no dependencies resolved) and
# put first on PYTHONPATH. To download them, on a machine with network, from the repo root (~7.5 MB; three are
# compiled for CPython 3.12: rustbpe, pydantic-core, jiter; for another Python change --python-version):
#
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#         --platform manylinux1_x86_64 -d .whl \
#         rustbpe==0.1.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 click==8.5.1 h11==0.16.0 \
#         pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 \
#         typing-extensions==4.16.0 opentelemetry-api==1.45.2 openai==3.57.0 jiter==0.19.0 distro==1.9.0 \
#         sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 anyio==4.16.0 idna==3.20
#
# That is the closure of nanochat's web and tokenizer packages and of openai (each wheel's Requires-Dist) at the
# versions the tests run with; anyio, h11, idna and typing-extensions too, though the machine may have them,
# because these versions need newer ones than it may have. wandb is not needed: the smoke runs with --run=dummy.
# Sizes (DEPTH, BASE_STEPS, ...), NPROC and COMPILE=false pass through to speedrun.sh; GPU_CHECK_TIMEOUT (default
# 480 s) stops a run that hangs or overruns, and still prints what finished.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO_DIR=$(pwd)
# A base dir of its own, fresh each run (a training stage refuses a checkpoint directory holding an earlier run's)
export NANOCHAT_BASE_DIR=/tmp/nanochat_gpu_check
RUN_DIR="${OUT:-/tmp/nanochat_gpu_check_out}"  # where speedrun.sh copies report.md; the log goes there too
LOG="$RUN_DIR/smoke.log"
rm -rf "$NANOCHAT_BASE_DIR"
mkdir -p "$NANOCHAT_BASE_DIR" "$RUN_DIR"

# The carried wheels (if any) on PYTHONPATH, `python` and `torchrun` this python3 (bench/gpu_env.sh)
shopt -s nullglob
source bench/gpu_env.sh
gpu_env_setup .whl/*.whl
shopt -u nullglob

# What this machine has, and what the run needs, before minutes are spent on it
python3 - <<'EOF' 2>&1 | tee "$LOG"
import importlib, os, shutil, sys, sysconfig
import torch
gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"gpu_check: Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"{len(gpus)} GPU(s): {', '.join(gpus) or 'none'}")
compiler = shutil.which("cc") or shutil.which("gcc")
python_h = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
print(f"gpu_check: C compiler {compiler or 'none'}, Python.h {'found' if python_h else 'missing'} (Triton builds its "
      f"launcher with them: torch.compile fails without; COMPILE=false runs the rest)")
missing = []
for name in ("numpy", "tiktoken", "pyarrow", "filelock", "requests", "psutil", "matplotlib", "yaml", "jinja2",
             "rustbpe", "fastapi", "uvicorn", "pydantic", "openai", "nanochat.processes", "scripts", "tasks.registry"):
    try:
        importlib.import_module(name)
    except Exception as e:
        missing.append(f"{name} ({type(e).__name__}: {e})")
if missing:
    sys.exit(f"error: cannot import {'; '.join(missing)}: put the wheels of bench/gpu_check.sh's list in .whl/")
EOF

status=0
(cd "$RUN_DIR" && timeout --kill-after=30 "${GPU_CHECK_TIMEOUT:-480}" env NANOCHAT_PROFILE=gpu NANOCHAT_SMOKE=1 \
    NANOCHAT_SKIP_SETUP=1 bash "$REPO_DIR/speedrun.sh") 2>&1 | tee -a "$LOG" || status=$?

# The summary, also after a failure: the stages that finished (their report sections)
echo "gpu_check: speedrun.sh exited with status $status after $((SECONDS / 60))m $((SECONDS % 60))s (log: $LOG)"
python3 -c "from nanochat.report import report_dir, stage_lines; print('\n'.join(stage_lines(report_dir())))"
exit "$status"
