#!/usr/bin/env bash
# The whole nanochat pipeline, from nothing to a report: bash speedrun.sh
#
# Two profiles, picked automatically (override with NANOCHAT_PROFILE=gpu|cpu):
#   gpu  one node with CUDA GPUs (made for 8xH100): FineWeb-Edu, vocab 65536, a depth-20 model, the real chat mixture
#   cpu  any machine (made for 2 CPU cores, ~20 min): the embedded pydocs corpus, a small tokenizer and model,
#        the offline (synthetic) chat tasks
# Options (environment): WANDB_RUN=<name> logs to wandb (needs `wandb login`); NANOCHAT_BASE_DIR (default
# ~/.cache/nanochat) is where data, tokenizer, checkpoints and the report go; NPROC = processes per node
# (default: every GPU); NANOCHAT_SKIP_SETUP=1 uses the current python instead of creating .venv;
# NANOCHAT_SMOKE=1 shrinks the cpu profile to seconds (what the tests run).
#
# Every stage must finish: `set -e` stops the pipeline at the first stage that exits non-zero, including a
# training stage stopped early by Ctrl-C / SIGTERM (it saves a checkpoint and exits 75; resume it with the
# command it prints, then run the remaining stages by hand).
set -euo pipefail
cd "$(dirname "$0")"

export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
WANDB_RUN="${WANDB_RUN:-dummy}"
if [ -z "${NANOCHAT_PROFILE:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then NANOCHAT_PROFILE=gpu; else NANOCHAT_PROFILE=cpu; fi
fi
echo "speedrun: profile $NANOCHAT_PROFILE, base dir $NANOCHAT_BASE_DIR"

# --- environment: a venv with the project installed ---
if [ -z "${NANOCHAT_SKIP_SETUP:-}" ]; then
    [ -d .venv ] || python3 -m venv .venv
    if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
        if [ "$NANOCHAT_PROFILE" = cpu ]; then .venv/bin/pip install torch==2.13.0; else .venv/bin/pip install torch; fi
    fi
    .venv/bin/pip install -e .
    source .venv/bin/activate
fi
python -m nanochat.report reset

SECONDS=0
if [ "$NANOCHAT_PROFILE" = gpu ]; then
    NPROC="${NPROC:-$(nvidia-smi -L | wc -l)}"
    export OMP_NUM_THREADS=1  # one process per GPU: no thread oversubscription of the CPU
    export NANOCHAT_DATASET=fineweb-edu
    # Data: 8 shards (~2B chars) for the tokenizer now, the ~240 a d20 model needs in the background.
    python -m nanochat.dataset -n 8
    python -m nanochat.dataset -n 240 -w 8 &
    DATASET_DOWNLOAD_PID=$!
    python -m scripts.tok_train --max_chars=2000000000 --vocab_size=65536
    python -m scripts.tok_eval
    echo "waiting for the dataset download to finish..."
    wait $DATASET_DOWNLOAD_PID
    # Pretraining: depth 20 (~560M parameters), Chinchilla-optimal 20 tokens per parameter
    torchrun --standalone --nproc_per_node="$NPROC" -m scripts.base_train --depth=20 --run="$WANDB_RUN"
    torchrun --standalone --nproc_per_node="$NPROC" -m scripts.base_loss
    # Midtraining: the real chat mixture (SmolTalk, MMLU, GSM8K, spelling, identity conversations)
    torchrun --standalone --nproc_per_node="$NPROC" -m scripts.mid_train --mixture=real --run="$WANDB_RUN"
else
    export NANOCHAT_DATASET=pydocs
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc 2>/dev/null || sysctl -n hw.ncpu)}"  # one process, every core
    # Sizes; each can be set from the environment (e.g. BASE_STEPS=240 bash speedrun.sh)
    if [ -n "${NANOCHAT_SMOKE:-}" ]; then
        : "${VOCAB:=512}" "${DEPTH:=1}" "${SEQ:=64}" "${BASE_STEPS:=4}" "${MID_STEPS:=4}" "${EVAL_TOKENS:=1024}"
    else
        # depth 4 (~5M parameters) at ~1,000 tokens/s: 120 steps of 4096 tokens (~8 min), then 60 of midtraining
        : "${VOCAB:=4096}" "${DEPTH:=4}" "${SEQ:=512}" "${BASE_STEPS:=120}" "${MID_STEPS:=60}" "${EVAL_TOKENS:=16384}"
    fi
    BASE_EVAL=$(( BASE_STEPS / 3 > 0 ? BASE_STEPS / 3 : 1 ))
    python -m nanochat.dataset
    python -m scripts.tok_train --vocab_size=$VOCAB
    python -m scripts.tok_eval
    python -m scripts.base_train --depth=$DEPTH --max_seq_len=$SEQ --device_batch_size=8 --total_batch_size=$((8 * SEQ)) \
        --num_iterations=$BASE_STEPS --eval_every=$BASE_EVAL --eval_tokens=$EVAL_TOKENS --sample_every=$((BASE_STEPS / 2)) \
        --core_metric_every=-1 --run="$WANDB_RUN"
    python -m scripts.base_loss --device_batch_size=8 --split_tokens=$EVAL_TOKENS
    python -m scripts.mid_train --mixture=offline --max_seq_len=$SEQ --device_batch_size=8 --total_batch_size=$((8 * SEQ)) \
        --num_iterations=$MID_STEPS --eval_every=$((MID_STEPS / 2)) --eval_tokens=$EVAL_TOKENS --run="$WANDB_RUN"
fi

python -m nanochat.report generate
echo "speedrun: done in $((SECONDS / 60))m $((SECONDS % 60))s; report: $(pwd)/report.md"
