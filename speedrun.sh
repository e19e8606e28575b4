#!/usr/bin/env bash
# The whole nanochat pipeline, from nothing to a report: bash speedrun.sh
#
# Two profiles, picked automatically (override with NANOCHAT_PROFILE=gpu|cpu):
#   gpu  one node with CUDA GPUs (made for 8xH100, ~4h): FineWeb-Edu, vocab 65536, a depth-20 model
#   cpu  any machine (made for 2 CPU cores, ~20 min): the embedded pydocs corpus, a small tokenizer and model
# Optional: WANDB_RUN=<name> logs to wandb (needs `wandb login`); NANOCHAT_BASE_DIR (default ~/.cache/nanochat)
# is where data, tokenizer, checkpoints and the report go; NPROC = processes per node (default: all GPUs).
set -euo pipefail
cd "$(dirname "$0")"

export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # torchrun: one process per device, no thread oversubscription
WANDB_RUN="${WANDB_RUN:-dummy}"
if [ -z "${NANOCHAT_PROFILE:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then NANOCHAT_PROFILE=gpu; else NANOCHAT_PROFILE=cpu; fi
fi
echo "speedrun: profile $NANOCHAT_PROFILE, base dir $NANOCHAT_BASE_DIR"

# --- environment: a venv with the project installed ---
[ -d .venv ] || python3 -m venv .venv
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    if [ "$NANOCHAT_PROFILE" = cpu ]; then .venv/bin/pip install torch==2.13.0; else .venv/bin/pip install torch; fi
fi
.venv/bin/pip install -e .
source .venv/bin/activate
python -m nanochat.report reset

SECONDS=0
if [ "$NANOCHAT_PROFILE" = gpu ]; then
    NPROC="${NPROC:-$(nvidia-smi -L | wc -l)}"
    export OMP_NUM_THREADS=1
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
else
    export NANOCHAT_DATASET=pydocs
    export OMP_NUM_THREADS="$(nproc 2>/dev/null || sysctl -n hw.ncpu)"  # one process using every core
    python -m nanochat.dataset
    python -m scripts.tok_train --vocab_size=4096
    python -m scripts.tok_eval
    python -m scripts.base_train --depth=4 --max_seq_len=512 --device_batch_size=8 --total_batch_size=8192 \
        --num_iterations=400 --eval_every=100 --eval_tokens=65536 --sample_every=200 --core_metric_every=-1 \
        --warmup_ratio=0.02 --run="$WANDB_RUN"
    python -m scripts.base_loss --device_batch_size=8 --split_tokens=65536
fi

python -m nanochat.report generate
echo "speedrun: done in $((SECONDS / 60))m $((SECONDS % 60))s; report: $(pwd)/report.md"
