# Sourced by bench/gpu_check.sh and bench/gpu_measure.sh, from the repo root: gpu_env_setup makes a GPU machine's
# python3 able to run this repo without network or pip index: the packages nanochat needs beyond its image come as
# wheels copied in .whl/ (the list and the download command: bench/gpu_check.sh), installed into an empty /tmp/site
# (one version of each package, no dependencies resolved) put first on PYTHONPATH. Its
# arguments: the wheel files (none: nothing installed; a function, so that it never sees its caller's arguments).
# Then `python` and `torchrun` on PATH are this python3, whatever else is there (speedrun.sh and the benchmarks call
# them by those names).
gpu_env_setup() {
    if [ "$#" -gt 0 ]; then
        rm -rf /tmp/site
        if python3 -m pip --version >/dev/null 2>&1; then
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@"
        else  # no pip: a wheel is a zip of what it installs
            for wheel in "$@"; do python3 -m zipfile -e "$wheel" /tmp/site; done
        fi
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    # scripts, not links: a venv's python must be started by its own path to find its packages
    PYTHON3=$(command -v python3)
    rm -rf /tmp/gpu_check_bin && mkdir /tmp/gpu_check_bin  # never write through a link an earlier version left
    printf '#!/bin/sh\nexec %s "$@"\n' "$PYTHON3" > /tmp/gpu_check_bin/python
    printf '#!/bin/sh\nexec %s -m torch.distributed.run "$@"\n' "$PYTHON3" > /tmp/gpu_check_bin/torchrun
    chmod +x /tmp/gpu_check_bin/python /tmp/gpu_check_bin/torchrun
    export PATH="/tmp/gpu_check_bin:$PATH"
}
