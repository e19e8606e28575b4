#!/usr/bin/env bash
# The whole nanochat pipeline, from nothing to a report: bash speedrun.sh
#
# Two profiles, picked automatically (override with NANOCHAT_PROFILE=gpu|cpu):
#   gpu  one node with CUDA GPUs (made for 8xH100): ClimbMix, vocab 65536, a depth-20 model, CORE, the real chat
#        mixture, SFT, RL on GSM8K, chat evaluations; every download at the start
#   cpu  any machine (made for 2 CPU cores: 6-11 min for everything on the 2-core VMs of bench/RESULTS.md, e.g.
#        6m13s alone and 6m09s-6m49s in 6 runs at issue 36, 6m56s-11m10s on an Intel AMX VM at issue 24, 10m41s
#        beside other jobs at issue 53): the embedded pydocs corpus, a small tokenizer and a depth-4 model, the
#        offline tasks for midtraining, SFT, RL and the evaluations; no download.
#        NANOCHAT_DATASET=NAME pretrains on a corpus of your own instead (built first with `python -m
#        nanochat.dataset --from=PATH --name=NAME`: README, "Train on your own text")
# Options (environment): WANDB_RUN=<name> logs to wandb (needs `wandb login`); NANOCHAT_BASE_DIR (default
# ~/.cache/nanochat) is where data, tokenizer, checkpoints and the report go (the finished report.md and its
# curves are also copied into the directory you run this script from); NPROC = processes per node
# (default: every GPU); NANOCHAT_SKIP_SETUP=1 uses the current python instead of creating .venv;
# NANOCHAT_SMOKE=1 shrinks a profile: the cpu one to seconds (what the tests run), the gpu one to a few minutes and
# no download (every stage through torchrun, then chat_web answers one request; bench/gpu_check.sh runs it on a
# GPU machine without network). SEED=<n> (default 0) seeds the run: base_train's data order (--data_seed=n) and
# initial weights (--init_seed=42+n), chat_rl's sampling (--seed=n); the chat stages' data order is fixed. How much
# the report card moves between seeds: bench/RESULTS.md ("The CPU speedrun's spread over seeds"). The report's step
# ends the run with one line per stage: its time and headline number.
#
# Every stage must finish: `set -e` stops the pipeline at the first stage that exits non-zero, including a
# training stage stopped early by Ctrl-C / SIGTERM (it saves a checkpoint and exits 75), or one killed (kill -9, an
# out-of-memory kill, a preemption: training stages also save every 10 minutes of wall time). Run the same command
# again: it picks up where it stopped (below, "A rerun"). FRESH=1 bash speedrun.sh starts over.
set -euo pipefail
RUN_DIR="$(pwd)"  # where the finished report is copied
cd "$(dirname "$0")"
REPO_DIR="$(pwd)"

export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
WANDB_RUN="${WANDB_RUN:-dummy}"
SEED="${SEED:-0}"
SEEDS="--data_seed=$SEED --init_seed=$((42 + SEED))"  # base_train's; chat_rl takes --seed=$SEED
if [ -z "${NANOCHAT_PROFILE:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then NANOCHAT_PROFILE=gpu; else NANOCHAT_PROFILE=cpu; fi
fi
echo "speedrun: profile $NANOCHAT_PROFILE, base dir $NANOCHAT_BASE_DIR"

# --- environment: a venv with the project installed ---
if [ -z "${NANOCHAT_SKIP_SETUP:-}" ]; then
    [ -d .venv ] || python3 -m venv .venv
    if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
        if [ "$NANOCHAT_PROFILE" = cpu ] && [ "$(uname -s)" = Linux ]; then
            # PyPI's Linux wheel of torch bundles CUDA (~5 GB installed); the CPU-only build is ~0.7 GB. Take it from
            # NANOCHAT_TORCH_INDEX (default: PyTorch's CPU index), or from the configured package index where that
            # index cannot be reached (asked once, briefly: pip retries an unreachable index for ~2 minutes)
            TORCH_INDEX="${NANOCHAT_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
            if python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=15)" \
                "$TORCH_INDEX" >/dev/null 2>&1; then
                .venv/bin/pip install torch==2.13.0 --index-url "$TORCH_INDEX"
            else
                echo "speedrun: PyTorch's CPU index ($TORCH_INDEX) cannot be reached: torch from the configured index"
                .venv/bin/pip install torch==2.13.0
            fi
        elif [ "$NANOCHAT_PROFILE" = cpu ]; then
            .venv/bin/pip install torch==2.13.0  # macOS: PyPI's wheel is the CPU/MPS build
        else
            .venv/bin/pip install torch
        fi
    fi
    .venv/bin/pip install -e .
    source .venv/bin/activate
fi
# A rerun picks up where the last run stopped: every stage gets --rerun=auto, so a stage done from the same settings
# and inputs is skipped (one line says when it was made), an interrupted training stage resumes from its last
# checkpoint, and a stage whose settings or inputs changed runs again, and so do the ones after it
# (nanochat/rerun.py). FRESH=1 starts over: the report, tokenizer and checkpoints are deleted (each named).
RERUN="--rerun=auto"
# Training stages also save every SAVE_MINUTES of wall time (each save replacing the one before): a kill -9 loses at
# most that much of a stage's work
SAVES="--save_every_minutes=${SAVE_MINUTES:-10}"
if [ -n "${FRESH:-}" ]; then
    python -m nanochat.rerun forget
    python -m nanochat.report reset
else
    python -m nanochat.report start
fi

SECONDS=0
stage() { echo "speedrun: $1 (at $((SECONDS / 60))m $((SECONDS % 60))s)"; }
if [ "$NANOCHAT_PROFILE" = gpu ]; then
    # One process per GPU. NPROC=2 on a machine without one runs the same torchrun launches as 2 CPU processes (gloo,
    # torch.compile off by its "auto" rule): how the tests run this profile's smoke (tests/test_rerun.py)
    if [ -z "${NPROC:-}" ]; then
        NPROC=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
        if [ "$NPROC" -lt 1 ]; then
            echo "error: the gpu profile finds no GPU (nvidia-smi -L lists none): set NPROC=<processes>, or NANOCHAT_PROFILE=cpu" >&2
            exit 1
        fi
    fi
    export OMP_NUM_THREADS=1  # one process per GPU: no thread oversubscription of the CPU
    # `--` after the module ends torchrun's own options: without it torchrun stops at --run=..., an ambiguous
    # abbreviation of its --run-path / --run_path (the scripts skip the `--`: nanochat/configurator.py)
    RUN="torchrun --standalone --nproc_per_node=$NPROC"
    if [ -n "${NANOCHAT_SMOKE:-}" ]; then
        # The smoke: the stages below as they are, each through torchrun on every GPU, with torch.compile where a
        # GPU run compiles, at sizes that take minutes, and offline (a GPU node is often cut off from the network):
        # the pydocs corpus, a small tokenizer, a depth-4 model, the offline tasks and CORE bundle; then chat_web
        # answers one request through OpenAI's client. It checks that everything runs, not what the model learns.
        # Each size can be set from the environment, as the cpu profile's (the tests shrink them further).
        export NANOCHAT_DATASET=pydocs
        MIXTURE=offline BUNDLE=offline TASKS=offline RL_TASKS=offline
        : "${VOCAB:=4096}" "${DEPTH:=4}" "${SEQ:=512}" "${ROWS:=16}" "${BASE_STEPS:=50}" "${MID_STEPS:=20}" "${SFT_STEPS:=10}"
        : "${RL_STEPS:=2}" "${EVAL_STEPS:=4}" "${CORE_EXAMPLES:=20}" "${CHAT_PROBLEMS:=16}" "${RL_SAMPLES:=4}" "${MAX_NEW_TOKENS:=64}"
        # --compile: auto = on for CUDA. base_train compiles as a GPU run does; the chat stages do not by default: on an
        # H100 SFT's first compiled step (rows of every length: dynamic shapes) took 79 s of a 10-step smoke
        # (bench/RESULTS.md, "The gpu smoke on one H100"). CHAT_COMPILE=auto compiles them too; COMPILE=false nothing.
        : "${COMPILE:=auto}" "${CHAT_COMPILE:=false}"
        [ "$COMPILE" = false ] && CHAT_COMPILE=false
        # One micro-step per step on any number of processes; EVAL_STEPS micro-steps per validation
        BATCH="--max_seq_len=$SEQ --device_batch_size=$ROWS --total_batch_size=$((ROWS * SEQ * NPROC))"
        EVAL_TOKENS=$((EVAL_STEPS * ROWS * SEQ * NPROC))
        BASE_SIZES="$BATCH --eval_tokens=$EVAL_TOKENS --compile=$COMPILE --num_iterations=$BASE_STEPS --eval_every=$BASE_STEPS
            --core_metric_every=$BASE_STEPS --core_metric_max_per_task=$CORE_EXAMPLES"
        LOSS_SIZES="--device_batch_size=$ROWS --split_tokens=$EVAL_TOKENS"
        CORE_SIZES="--max_per_task=$CORE_EXAMPLES"
        MID_SIZES="$BATCH --eval_tokens=$EVAL_TOKENS --compile=$CHAT_COMPILE --num_iterations=$MID_STEPS --eval_every=$MID_STEPS"
        CHAT_EVAL_SIZES="--max_problems=$CHAT_PROBLEMS --max_new_tokens=$MAX_NEW_TOKENS --batch_size=32"
        SFT_SIZES="--max_seq_len=$SEQ --device_batch_size=$ROWS --examples_per_step=$((ROWS * NPROC)) --eval_tokens=$EVAL_TOKENS
            --compile=$CHAT_COMPILE --num_iterations=$SFT_STEPS --eval_every=$SFT_STEPS --eval_metrics_max_problems=$CHAT_PROBLEMS"
        RL_SIZES="--compile=$CHAT_COMPILE --num_iterations=$RL_STEPS --prompts_per_step=$((4 * NPROC)) --num_samples=$RL_SAMPLES
            --max_new_tokens=$MAX_NEW_TOKENS --eval_every=-1 --save_every=-1 --eval_examples=$CHAT_PROBLEMS"
        stage "corpus and tokenizer"
        python -m nanochat.dataset
        python -m scripts.tok_train $RERUN --vocab_size=$VOCAB
        python -m scripts.tok_eval $RERUN --download_reference=false  # offline: no wait for GPT-2's and GPT-4's files
    else
        # ClimbMix rather than FineWeb-Edu: the largest single gain karpathy/nanochat measured (GPT-2 grade 27% sooner,
        # its LEADERBOARD.md); its shards are FineWeb-Edu's size (~250M chars). NANOCHAT_DATASET=fineweb-edu still works.
        export NANOCHAT_DATASET="${NANOCHAT_DATASET:-climbmix}"
        MIXTURE=real BUNDLE=dclm TASKS=all RL_TASKS=GSM8K DEPTH=20
        # Rows per GPU in base_train's and mid_train's micro-steps (a step keeps its size: fewer rows, more
        # micro-steps). Depth 20 with 32 rows filled 78.5 of an H100's 80 GB at a 33,875-token vocabulary
        # (bench/RESULTS.md, issue 37); 65,536 tokens add ~0.5B parameters of lookup tables (head, token and value
        # embeddings), ~8 GB with their gradients and AdamW state: 32 rows only on GPUs of 100 GB or more (estimated
        # from that run, not measured). ROWS=<n> bash speedrun.sh sets it.
        GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1 | tr -d ' ' || true)
        if [ -z "${ROWS:-}" ]; then
            if [ "${GPU_MIB:-0}" -ge 100000 ] 2>/dev/null; then ROWS=32; else ROWS=16; fi
        fi
        echo "speedrun: $ROWS rows per GPU per micro-step (GPU memory: ${GPU_MIB:-unknown} MiB)"
        BASE_SIZES="--device_batch_size=$ROWS" MID_SIZES="--device_batch_size=$ROWS"
        LOSS_SIZES="" CORE_SIZES="" CHAT_EVAL_SIZES="" SFT_SIZES="" RL_SIZES=""  # the defaults
        # Every download first: 8 shards (~2B chars) for the tokenizer now, the ~240 a d20 model needs in the
        # background; the chat tasks, the CORE bundle and the identity conversations now.
        stage "downloads"
        python -m nanochat.dataset -n 8
        python -m nanochat.dataset -n 240 -w 8 &
        DATASET_DOWNLOAD_PID=$!
        python -m tasks.prefetch
        stage "tokenizer"
        python -m scripts.tok_train $RERUN --max_chars=2000000000 --vocab_size=65536
        python -m scripts.tok_eval $RERUN
        echo "waiting for the dataset download to finish..."
        wait $DATASET_DOWNLOAD_PID
    fi
    # Pretraining: depth 20 (~1.4B parameters, of which ~560M compute and the rest are value-embedding lookup tables;
    # base_train prints both), 20 tokens per computing parameter (the smoke: its sizes above); then its loss and CORE
    stage "base model"
    $RUN -m scripts.base_train -- $RERUN $SAVES --depth=$DEPTH $SEEDS --run="$WANDB_RUN" $BASE_SIZES
    $RUN -m scripts.base_loss -- $RERUN $LOSS_SIZES
    $RUN -m scripts.base_eval -- $RERUN --bundle=$BUNDLE $CORE_SIZES
    # Midtraining (SmolTalk, MMLU, GSM8K, spelling, identity), SFT, RL on GSM8K; each chat stage evaluated
    stage "midtraining"
    $RUN -m scripts.mid_train -- $RERUN $SAVES --mixture=$MIXTURE --run="$WANDB_RUN" $MID_SIZES
    $RUN -m scripts.chat_eval -- $RERUN -i mid -a $TASKS $CHAT_EVAL_SIZES
    stage "SFT"
    $RUN -m scripts.chat_sft -- $RERUN $SAVES --mixture=$MIXTURE --run="$WANDB_RUN" $SFT_SIZES
    $RUN -m scripts.chat_eval -- $RERUN -i sft -a $TASKS $CHAT_EVAL_SIZES
    stage "RL"
    $RUN -m scripts.chat_rl -- $RERUN $SAVES --mixture=$MIXTURE --seed=$SEED --run="$WANDB_RUN" $RL_SIZES
    $RUN -m scripts.chat_eval -- $RERUN -i rl -a $RL_TASKS $CHAT_EVAL_SIZES
    CHAT_SOURCE=rl
else
    export NANOCHAT_DATASET="${NANOCHAT_DATASET:-pydocs}"  # or a corpus of your own, by its name
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc 2>/dev/null || sysctl -n hw.ncpu)}"  # one process, every core
    # Sizes; each can be set from the environment (e.g. BASE_STEPS=240 bash speedrun.sh). Measured stage times of
    # the defaults on a 2-core VM: bench/RESULTS.md ("CPU speedrun").
    if [ -n "${NANOCHAT_SMOKE:-}" ]; then
        : "${VOCAB:=512}" "${DEPTH:=1}" "${SEQ:=128}" "${BASE_STEPS:=4}" "${MID_STEPS:=4}" "${SFT_STEPS:=2}" "${RL_STEPS:=1}"
        : "${EVAL_TOKENS:=1024}" "${CORE_EXAMPLES:=8}" "${EVAL_PROBLEMS:=4}" "${CHAT_PROBLEMS:=4}" "${RL_SAMPLES:=2}"
        : "${MAX_NEW_TOKENS:=64}"
    else
        : "${VOCAB:=4096}" "${DEPTH:=4}" "${SEQ:=512}" "${BASE_STEPS:=200}" "${MID_STEPS:=120}" "${SFT_STEPS:=60}" "${RL_STEPS:=10}"
        : "${EVAL_TOKENS:=16384}" "${CORE_EXAMPLES:=100}" "${EVAL_PROBLEMS:=60}" "${CHAT_PROBLEMS:=-1}" "${RL_SAMPLES:=8}"
        # Answers of up to 128 tokens: the offline tasks' reference answers need up to 100 (arithmetic; counting
        # letters 96), tool outputs included; at 64, 89% of the arithmetic answers were cut before their "#### <n>"
        # and counted wrong (bench/RESULTS.md, "The CPU speedrun's chat stages").
        : "${MAX_NEW_TOKENS:=128}"
    fi
    BATCH="--max_seq_len=$SEQ --device_batch_size=8 --total_batch_size=$((8 * SEQ)) --eval_tokens=$EVAL_TOKENS"
    # Every test problem of the offline tasks (CHAT_PROBLEMS=-1: ~590), greedy answers of 32 problems decoded together
    CHAT_EVAL="python -m scripts.chat_eval $RERUN --max_problems=$CHAT_PROBLEMS --max_new_tokens=$MAX_NEW_TOKENS --batch_size=32"
    stage "corpus and tokenizer"
    python -m nanochat.dataset
    python -m scripts.tok_train $RERUN --vocab_size=$VOCAB
    python -m scripts.tok_eval $RERUN
    stage "base model"
    # --weight_decay=0: at this batch (4,096 tokens) a table's rows decay 4x as often per epoch as at the 16,384 the
    # depth default was measured at; 0.2 and 0.05 both scored lower here (bench/RESULTS.md, "AdamW's weight decay")
    python -m scripts.base_train $RERUN $SAVES --depth=$DEPTH $SEEDS $BATCH --num_iterations=$BASE_STEPS --weight_decay=0 \
        --eval_every=$(( BASE_STEPS / 3 > 0 ? BASE_STEPS / 3 : 1 )) --sample_every=$((BASE_STEPS / 2)) \
        --core_metric_every=-1 --run="$WANDB_RUN"
    python -m scripts.base_loss $RERUN --device_batch_size=8 --split_tokens=$EVAL_TOKENS
    python -m scripts.base_eval $RERUN --bundle=offline --max_per_task=$CORE_EXAMPLES
    stage "midtraining"
    python -m scripts.mid_train $RERUN $SAVES --mixture=offline $BATCH --num_iterations=$MID_STEPS \
        --eval_every=$(( MID_STEPS / 2 > 0 ? MID_STEPS / 2 : 1 )) --run="$WANDB_RUN"
    $CHAT_EVAL -i mid -a offline
    stage "SFT"
    # SFT reads other examples of the offline tasks than midtraining did, at 0.3 of the lrs (chat_sft's 0.02 is for a
    # d20 model on the real mixture; here it moved nothing: measured in bench/RESULTS.md)
    python -m scripts.chat_sft $RERUN $SAVES --mixture=offline --max_seq_len=$SEQ --device_batch_size=8 --examples_per_step=16 --init_lr_frac=0.3 \
        --num_iterations=$SFT_STEPS --eval_every=$(( SFT_STEPS / 2 > 0 ? SFT_STEPS / 2 : 1 )) --eval_tokens=$EVAL_TOKENS \
        --eval_metrics_every=-1 --eval_metrics_max_problems=$EVAL_PROBLEMS --run="$WANDB_RUN"
    $CHAT_EVAL -i sft -a offline
    stage "RL"
    # RL on the offline spelling, arithmetic and identity problems, 16 a step, at 0.2 of the lrs: with 4 a step (or
    # arithmetic alone) its updates were mostly noise and its score fell below SFT's; 10 steps of 16 gained as much
    # as 20 (bench/RESULTS.md, "The CPU speedrun on an Intel AMX VM")
    python -m scripts.chat_rl $RERUN $SAVES --mixture=offline --seed=$SEED --num_iterations=$RL_STEPS --prompts_per_step=16 --num_samples=$RL_SAMPLES --init_lr_frac=0.2 \
        --max_new_tokens=$MAX_NEW_TOKENS --eval_every=-1 --save_every=-1 --eval_examples=$EVAL_PROBLEMS --run="$WANDB_RUN"
    $CHAT_EVAL -i rl -a offline
    CHAT_SOURCE=rl
fi

if [ "$NANOCHAT_PROFILE" = gpu ] && [ -n "${NANOCHAT_SMOKE:-}" ]; then
    stage "chat_web"
    # the web server answers one chat completion through OpenAI's own client, then stops (a report section of its own)
    python -m scripts.chat_web_check --source=$CHAT_SOURCE
fi

stage "report"
# `report generate` copies report.md and its curves into its working directory: the one this script was run from
# (PYTHONPATH: this checkout's nanochat, whatever that directory holds)
(cd "$RUN_DIR" && PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" python -m nanochat.report generate)
echo "speedrun: done in $((SECONDS / 60))m $((SECONDS % 60))s; report: $RUN_DIR/report.md"
echo "Talk to your model:"
echo "    python -m scripts.chat_cli --source=$CHAT_SOURCE          # in the terminal"
echo "    python -m scripts.chat_web --source=$CHAT_SOURCE          # in the browser: http://127.0.0.1:8000"
