#!/usr/bin/env bash
# Issue 37's GPU measurements in one prepared command, for a lent GPU machine (offline, a few minutes of device time):
# the figures that decide the defaults (attention kernel, fp8, sliding windows) and compare us with karpathy/nanochat
# HEAD. Each part runs under its own time limit and writes its log to $OUT (or /tmp/nanochat_gpu_measure_out); a part
# that fails or overruns is reported and the next one starts.
#
#     bash bench/gpu_measure.sh head options         # the parts named, in that order
#     bash bench/gpu_measure.sh                      # every part: head options attention quality
#
# Parts, most wanted first (each fits one 10-minute command of the device tool; not yet timed on a GPU):
#   head       bench/head_speed.py --depths=24: our base_train, HEAD's with its speedrun's settings (fp8, SSSL) and
#              plain, then our Engine's decoding at 1 / 8 / 32 samples: issue 37's bar (our tokens/s >= HEAD's).
#              Needs HEAD's code in .head and its extra wheels in .whl/head (git-ignored: the device tool's `carry`
#              takes .whl and .head; how to make them: bench/head_speed.py's docstring)
#   options    bench/train_speed.py at depth 24 x 16 rows: plain, --fp8=True, --window_pattern=SSSL (the defaults)
#   attention  bench/attention.py at depth 20's and depth 24's shapes (SDPA's backends, FlexAttention)
#   quality    bench/quality.py on the GPU at depth 8: val bpb at equal tokens, window pattern L against SSSL
# PART_TIMEOUT (seconds, default 540) limits each part. The wheels of .whl/ (and .whl/head/) are installed as for
# bench/gpu_check.sh. Where the figures go: bench/RESULTS.md, "Issue 37 items 2-4 on a CPU". Exit status: 0 when
# every part passed, 1 when one failed or overran, 2 for an unknown part or a machine without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT_DIR="${OUT:-/tmp/nanochat_gpu_measure_out}"
mkdir -p "$OUT_DIR"

part_attention() {
    python3 bench/attention.py && python3 bench/attention.py --heads=12 --rows=16
}
part_head() {
    if [ ! -d .head/scripts ]; then
        echo "error: no HEAD checkout in .head: make it as bench/head_speed.py's docstring says, and carry .head"
        return 2
    fi
    python3 bench/head_speed.py --head=.head --depths=24 --runs=ours,speedrun,plain
}
part_options() {
    local status=0
    for extra in "" "--fp8=True" "--window_pattern=SSSL"; do
        echo "== depth 24, 16 rows, ${extra:-plain}"
        # the corpus and tokenizer head_speed made (or makes them there): one tokenizer training on the machine
        python3 bench/train_speed.py --depths=24 --rows=16 --steps=20 --extra="$extra" \
            --base_dir=/tmp/nanochat_head_speed/ours_v65536 || status=$?
    done
    return "$status"
}
part_quality() {
    python3 bench/quality.py --device_type=cuda --eval_device=cuda --jobs=3 --depth=8 --anchors= --variants=baseline \
        --variant=sssl:--window_pattern=SSSL --work=/tmp/nanochat_gpu_quality --out="$OUT_DIR/quality.json"
}

parts=("$@")
[ "${#parts[@]}" -eq 0 ] && parts=(head options attention quality)
for part in "${parts[@]}"; do
    if ! declare -F "part_$part" >/dev/null; then
        echo "error: unknown part '$part'; the parts: attention head options quality"
        exit 2
    fi
done

shopt -s nullglob
source bench/gpu_env.sh
gpu_env_setup .whl/*.whl .whl/head/*.whl
shopt -u nullglob
if ! python3 -c "import torch, sys; print(f'gpu_measure: torch {torch.__version__}, ' + (torch.cuda.get_device_name() \
        if torch.cuda.is_available() else 'no GPU')); sys.exit(not torch.cuda.is_available())"; then
    echo "error: these are GPU measurements; each benchmark's docstring has its plumbing run for a CPU"
    exit 2
fi

summary=()
failed=0
for part in "${parts[@]}"; do
    start=$SECONDS
    echo "gpu_measure: $part ..."
    export -f "part_$part"
    timeout --kill-after=20 "${PART_TIMEOUT:-540}" bash -c "part_$part" 2>&1 | tee "$OUT_DIR/measure_$part.log"
    status=${PIPESTATUS[0]}
    [ "$status" -eq 0 ] || failed=1
    summary+=("$part: status $status in $((SECONDS - start)) s (log: $OUT_DIR/measure_$part.log)")
done
printf 'gpu_measure: %s\n' "${summary[@]}"
exit "$failed"
