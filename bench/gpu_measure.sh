#!/usr/bin/env bash
# Issue 52's GPU measurements in one prepared command, for any machine with a CUDA GPU (it needs no network): ours
# against karpathy/nanochat HEAD in one run, where our step's time goes, our decoding beside HEAD's, and each lever
# alone against the same baseline. Each part runs under its own time limit (PART_TIMEOUT) and writes its log to $OUT
# (or /tmp/nanochat_gpu_measure_out), with machine.txt (GPU, driver, torch, both commits); a part that fails or
# overruns is reported and the next one starts, so a session of limited GPU time can run a few parts a command.
#
#     bash bench/gpu_prepare.sh                      # with the package index: .whl/ and .head/ (copy both to the GPU
#                                                    # machine's checkout, if it is another one)
#     bash bench/gpu_measure.sh head profile         # on the GPU: the parts named, in that order
#
# Parts, most wanted first (the first GPU command: head profile; the next: d20 decode decode_compiled; then
# one lever a command):
#   head       item 1: bench/head_speed.py at depth 24 x 16 rows (HEAD's speedrun micro-batch): ours, HEAD with its
#              runs/speedrun.sh flags (--fp8, SSSL; no FA3 offline: its SDPA fallback, the table says) and HEAD plain
#   profile    item 2: bench/profile_step.py, our depth-24 step compiled: top kernels, shares, launches, idle gaps
#   d20        item 1's second bar: ours at depth 20 x 32 rows, bf16 MFU against the peak the run measures
#   decode     item 3: bench/engine.py at depth 20, 1 / 8 / 32 / 128 sequences: ours and HEAD's Engine (its SSSL
#              model), time per token, bandwidth used, time to first token, peak memory
#   decode_compiled  the same, ours with the decode step compiled (Engine(compile_decode=True): a CUDA graph a step)
#   levers     item 2, one change each against plain at depth 24 x 16 rows: --fp8=True
#   windows    item 2: SSSL windows with SDPA (masked, dense) and with FlexAttention (--attention=flex)
#   attention  the attention kernels alone at depth 20's and 24's shapes (SDPA's backends, FlexAttention)
#   quality    bench/quality.py at depth 8: val bpb at equal tokens, window pattern L against SSSL
# PART_TIMEOUT (seconds, default 540) limits each part. Where the figures go: bench/RESULTS.md, "Issue 52". Exit
# status: 0 when every part passed, 1 when one failed or overran, 2 for an unknown part or a machine without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT_DIR="${OUT:-/tmp/nanochat_gpu_measure_out}"
mkdir -p "$OUT_DIR"

need_head() {
    if [ ! -f .head/COMMIT ]; then
        echo "error: no HEAD checkout in .head: bash bench/gpu_prepare.sh makes it (network or NANOCHAT_HEAD_REPO)"
        return 2
    fi
}
part_head() {
    need_head || return 2
    python3 bench/head_speed.py --head=.head --depths=24 --rows=16 --runs=ours,speedrun,plain --engine=False
}
part_profile() {
    python3 bench/profile_step.py --device_type=cuda --depth=24 --max_seq_len=2048 --vocab_size=65536 \
        --device_batch_size=16 --total_batch_size=32768 --trace="$OUT_DIR/profile_d24.json.gz"
}
part_d20() {
    python3 bench/head_speed.py --depths=20 --rows=32 --runs=ours --engine=False
}
part_decode() {  # ours (the eager step), then HEAD's Engine in a process of its own
    need_head || return 2
    python3 bench/engine.py --device_type=cuda --depth=20 --vocab_size=65536 --batch_sizes=1,8,32,128 --threads=0 \
        --naive=False --repeats=3 --head=.head
}
part_decode_compiled() {  # ours with the step compiled, a CUDA graph a step (apart: a failed compile keeps decode's)
    python3 bench/engine.py --device_type=cuda --depth=20 --vocab_size=65536 --batch_sizes=1,8,32,128 --threads=0 \
        --naive=False --repeats=3 --compile_decode=True
}
lever() {  # lever LABEL EXTRA: bench/train_speed.py at depth 24 x 16 rows with EXTRA (HEAD's corpus and tokenizer)
    echo "== depth 24, 16 rows, $1"
    python3 bench/train_speed.py --depths=24 --rows=16 --steps=20 --extra="$2" \
        --base_dir=/tmp/nanochat_head_speed/ours_v65536
}
part_levers() {
    local status=0
    lever plain "" || status=$?
    lever fp8 "--fp8=True" || status=$?
    return "$status"
}
part_windows() {
    local status=0
    lever "SSSL, SDPA" "--window_pattern=SSSL" || status=$?
    lever "SSSL, FlexAttention" "--window_pattern=SSSL --attention=flex" || status=$?
    return "$status"
}
part_attention() {
    python3 bench/attention.py && python3 bench/attention.py --heads=12 --rows=16
}
part_quality() {
    python3 bench/quality.py --device_type=cuda --eval_device=cuda --jobs=3 --depth=8 --anchors= --variants=baseline \
        --variant=sssl:--window_pattern=SSSL --work=/tmp/nanochat_gpu_quality --out="$OUT_DIR/quality.json"
}

all_parts=(head profile d20 decode decode_compiled levers windows attention quality)
parts=("$@")
[ "${#parts[@]}" -eq 0 ] && parts=("${all_parts[@]}")
for part in "${parts[@]}"; do
    if ! declare -F "part_$part" >/dev/null; then
        echo "error: unknown part '$part'; the parts: ${all_parts[*]}"
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

{  # what the figures are from: the machine, its driver, torch, both codebases' commits
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
    python3 -c "import torch; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, \
cuDNN {torch.backends.cudnn.version()}')"
    echo "ours: ${NANOCHAT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo 'unknown (set NANOCHAT_COMMIT)')}"
    echo "HEAD: $(cat .head/COMMIT 2>/dev/null || echo 'no .head')"
    lscpu | grep -m1 "Model name"
} | tee "$OUT_DIR/machine.txt"
export -f need_head lever
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
