"""
Supervised finetuning (SFT): train the midtrained model on whole conversations, one conversation per row.

That is the way it will be used in a chat (midtraining packed conversations into a token stream; here every row
starts at the start of a conversation and is padded to the longest row of its batch).

    python -m scripts.chat_sft --mixture=offline                  # anywhere, no downloads (the offline tasks)
    torchrun --standalone --nproc_per_node=8 -m scripts.chat_sft  # the real mixture (ARC, GSM8K, SmolTalk, ...)
    python -m scripts.chat_sft --mixture=custom --conversations=docs/examples/conversations.jsonl  # your own alone

Your own conversations (--conversations=FILE), as in scripts/mid_train.py: the first max(1, n // 20) of the file's n
conversations are validation, the rest training; --mixture=custom trains on them alone, with real or offline they
are one more task of that mixture.

Written like scripts/mid_train.py: every rank runs all of it and saves its own optimizer shard; rank 0 prints, and
saves the weights and the meta file; what happens around the training loop (start or resume, save, stop, finish)
is nanochat/stage.py's.

Batches. A micro-batch is `device_batch_size` conversations of this rank (rank r takes conversations r, r+W,
r+2W, ... of the shuffled mixture), each rendered with its training mask (only what the assistant writes is
trained on: its text, its tool calls and <|assistant_end|>; user turns and tool outputs are not), cut to
max_seq_len + 1 tokens, and padded to the longest row of the micro-batch with ignored targets (-1). A step is
`examples_per_step` conversations of all ranks together. The loss is the mean over every supervised token of
the step (nanochat/losses.py), so a long answer weighs more than a short one, as in midtraining.
"""

import sys

import torch
import torch.distributed as dist

from nanochat.configurator import check_config, configure
from nanochat.conversation_loader import ConversationLoader, chat_train_loader
from nanochat.hardware import autocast_context, compile_model, device_time
from nanochat.interrupt import interruptible
from nanochat.losses import count_step_targets, evaluate_bpb, logged_step_loss, step_losses, supervised_loss
from nanochat.optim import lr_multiplier, muon_momentum, scale_initial_lrs, step_optimizers
from nanochat.output import UserError, format_value, print0
from nanochat.ranks import gather_from_ranks
from nanochat.scoring import score_categorical
from nanochat.stage import Stage, stage_settings
from nanochat.tokenizer import get_token_bytes
from tasks.registry import check_conversations, conversations_split, stage_mixture, stage_tasks

# -----------------------------------------------------------------------------
# 1. Config (override as --key=value; --help lists them), after the settings every training stage takes: the wandb
# run, the device, --model_tag (the source's model), saves, resume, rerun, dry run (nanochat/stage.py)
source = "mid"  # which model to finetune: mid | base
step = -1  # which checkpoint step of the source model (-1 = the last)
num_iterations = -1  # optimizer steps; -1 = one epoch of the training mixture
max_seq_len = 2048  # tokens per row: longer conversations are cut (and counted)
device_batch_size = 4  # conversations per forward/backward per rank
examples_per_step = 32  # conversations per optimizer step, all ranks and micro-steps together
unembedding_lr = 0.004  # AdamW lr of lm_head
embedding_lr = 0.2  # AdamW lr of the token embedding (the value embeddings get half)
matrix_lr = 0.02  # Muon lr of the transformer matrices
init_lr_frac = 0.02  # every lr is multiplied by this: finetuning starts low
warmup_ratio = 0.0  # fraction of the run of linear lr warmup
warmdown_ratio = 1.0  # fraction of the run of linear lr decay at the end (1 = from the first step on)
final_lr_frac = 0.0  # lr multiplier at the very end of the warmdown
weight_decay = 0.0  # AdamW weight decay
grad_clip = 1.0  # clip the global gradient norm to this (0 = off)
eval_every = 100  # steps between validation evaluations (<= 0: only at the start and the end)
eval_tokens = -1  # validation rows x tokens per evaluation, all ranks together (-1 = 20 steps of rows x max_seq_len)
eval_metrics_every = 200  # steps between multiple-choice evaluations (<= 0: only at the end)
eval_metrics_max_problems = 256  # problems per multiple-choice task in those evaluations (-1 = all)
compile = "auto"  # torch.compile (rows of any length): auto (= on for CUDA, off for CPU/MPS) | true | false
# mixture: which tasks, how much of each: tasks/registry.py. conversations: custom's data; with real or offline one
# more task of that mixture
mixture = "real"  # real (ARC, GSM8K, SmolTalk...; downloads) | offline (the offline tasks) | custom (--conversations)
conversations = ""  # JSONL of your own conversations (tasks/customjson.py)
identity_file = ""  # JSONL of identity conversations for the real mixture ("" = generate the built-in ones)
max_conversations = -1  # use only the first N conversations of the training mixture (-1 = all); for quick runs
config = configure(globals(), shared=stage_settings())
check_config(config, positive=["max_seq_len", "device_batch_size", "examples_per_step", "init_lr_frac"],
             positive_or_unset=["num_iterations", "eval_tokens", "max_conversations", "eval_metrics_max_problems"],
             non_negative=["embedding_lr", "unembedding_lr", "matrix_lr", "weight_decay", "grad_clip"],
             fractions=["warmup_ratio", "warmdown_ratio", "final_lr_frac"],
             choices={"compile": ("auto", "true", "false"), "mixture": ("real", "offline", "custom"),
                      "source": ("mid", "base")})
check_conversations(mixture, conversations)  # custom without a file, a missing file, under 2 conversations: refused now

# -----------------------------------------------------------------------------
# 2. The stage and the compute, as in scripts/mid_train.py: made already from the same settings, model and files
# (--rerun=auto), it says so and exits 0 here
stage = Stage("sft", config, source=source, source_step=step,
              files=dict(conversations=conversations, identity_file=identity_file))
device_type, ddp, ddp_rank, ddp_world_size, device = stage.start_compute()
compute_dtype, autocast_ctx = autocast_context(device_type)  # decided by what the device does: nanochat/hardware.py

# -----------------------------------------------------------------------------
# 3. The model: the midtrained (or base) model for a fresh run, keeping its tag; this stage's own checkpoint for
# --resume_from_step. From here on this run owns chatsft_checkpoints/<model_tag>.
orig_model, tokenizer = stage.start()  # uncompiled: saving, evaluation
model, use_compile = compile_model(orig_model, compile, device_type, dynamic=True)  # rows change length every batch
if max_seq_len > orig_model.rotary_len:
    raise UserError(f"--max_seq_len={max_seq_len} is beyond the model's rotary table ({orig_model.rotary_len} "
                    f"positions): use at most {orig_model.rotary_len}")
token_bytes = get_token_bytes(device, tokenizer.directory)
print0(f"torch.compile: {use_compile}")

# -----------------------------------------------------------------------------
# 4. Batch arithmetic: x, y = next(train_loader) is (device_batch_size, longest row) on EACH rank
if examples_per_step % (device_batch_size * ddp_world_size) != 0:
    per_micro = device_batch_size * ddp_world_size
    raise UserError(f"examples_per_step {examples_per_step} is not a multiple of device_batch_size x world_size = "
                    f"{device_batch_size} x {ddp_world_size} = {per_micro}; try --examples_per_step="
                    f"{max(per_micro, examples_per_step // per_micro * per_micro)}")
grad_accum_steps = examples_per_step // (device_batch_size * ddp_world_size)
print0(f"Conversations / micro-batch / rank: {device_batch_size} (rows padded to the longest, at most {max_seq_len} "
       f"tokens)")
print0(f"Conversations / micro-batch (all {ddp_world_size} ranks): {device_batch_size * ddp_world_size}")
print0(f"Examples per step {examples_per_step} => gradient accumulation steps: {grad_accum_steps}")

# -----------------------------------------------------------------------------
# 5. Data: a deterministic shuffled mixture of conversations, and the multiple-choice tasks whose accuracy is followed:
# which tasks, how much of each, in tasks/registry.py ("sft/real/train", "sft/offline/train" (examples midtraining
# did not read), "sft/custom/train", "sft/real/metrics", ...; `python -m tasks.registry` lists them). No silent
# fallback from one mixture to the other.
train_dataset = stage_mixture("sft", mixture, "train", identity_file=identity_file, conversations=conversations)
val_dataset = stage_mixture("sft", mixture, "val", conversations=conversations)
# {name: task}; custom: none (free-text conversations have no choices to score), so no accuracy is followed
metric_tasks = dict(stage_tasks("sft", mixture, "metrics", conversations=conversations))
own_split = conversations_split(conversations) if conversations else None  # your file's (validation, training) counts
# One whole conversation per row, padded to the longest of the micro-batch (nanochat/conversation_loader.py).
# Printed: the mixture's counts, and how your file splits.
loader_args = dict(packed=False, rank=ddp_rank, world_size=ddp_world_size)
train_loader = chat_train_loader(train_dataset, val_dataset, tokenizer, device_batch_size, max_seq_len, device,
                                 mixture=mixture, conversations=conversations, own_split=own_split,
                                 size=max_conversations, **loader_args)
# What decides which conversations step N reads (the world size too: rank r reads r, r+W, r+2W, ...)
data_settings = dict(mixture=mixture, conversations=conversations, max_conversations=max_conversations,
                     device_batch_size=device_batch_size, examples_per_step=examples_per_step, max_seq_len=max_seq_len,
                     world_size=ddp_world_size)
eval_steps = max(1, (eval_tokens if eval_tokens > 0 else 20 * examples_per_step * max_seq_len)
                 // (device_batch_size * max_seq_len * ddp_world_size))

# -----------------------------------------------------------------------------
# 6. Optimizers: Muon for the block matrices; AdamW for the embedding, the head, the value-embedding tables and the
# layer scalars where the model has them (GPT.setup_optimizers); at a fraction of the pretraining learning rates.
# A resumed run gets back every rank's optimizer state and data position, and the loop's variables
# (nanochat/stage.py).
optimizers = orig_model.setup_optimizers(unembedding_lr=unembedding_lr, embedding_lr=embedding_lr,
                                         matrix_lr=matrix_lr, weight_decay=weight_decay)
scale_initial_lrs(optimizers, init_lr_frac)
loop = stage.resume(optimizers, train_loader, data_settings,
                    smooth_train_loss=0.0,  # EMA of the global train loss
                    ema_updates=stage.start_step,  # the step losses averaged into it (a checkpoint without: every step)
                    steps_without_targets=0,  # steps with no supervised target on any rank: no update (the loop)
                    total_training_time=0.0,  # seconds, excluding the first steps
                    first_val_bpb=None,
                    epoch_done=False)  # some rank has read its whole share of the mixture


def evaluate_metrics():
    """
    Multiple-choice accuracy (no sampling) on the first eval_metrics_max_problems problems of each task,
    the problems shared among the ranks: the same scores as one process. A stop request: Interrupted, every rank.
    """
    out = {}
    for name, task in metric_tasks.items():
        count = len(task) if eval_metrics_max_problems < 0 else min(eval_metrics_max_problems, len(task))
        with interruptible(), autocast_ctx:
            outcomes = score_categorical(orig_model, tokenizer, task, list(range(ddp_rank, count, ddp_world_size)), 8,
                                         device, stop=stage.stop)
        counts = torch.tensor([sum(passed for passed, _ in outcomes), len(outcomes)], dtype=torch.float64,
                              device=device)
        if ddp:
            dist.all_reduce(counts)
        out[name] = counts[0].item() / max(counts[1].item(), 1)
    return out


# -----------------------------------------------------------------------------
# 7. The training loop: the same two-level loop as base_train and mid_train. A step's micro-batches are fetched
# before it runs (its targets are counted before the first backward); `next_data_state` is where they start.
step_start = train_loader.progress(stage.start_step, num_iterations)  # how far the run is where a step's data begins
next_data_state, step_batches = train_loader.next_step(grad_accum_steps)
x, y = step_batches[0]
print(f"[rank {ddp_rank}] x, y = next(train_loader): x {tuple(x.shape)} {x.dtype}, y {tuple(y.shape)} {y.dtype}, "
      f"{100 * (y == -1).float().mean().item():.0f}% of targets -1 (padding, user turns, tool outputs)", flush=True)
start_step = stage.start_step
val_bpb = None
metrics = {}
step = start_step
stop_now = False  # SIGTERM / Ctrl-C: finish the step (cut an evaluation short), save, exit 75
while True:
    # All ranks stop together (see mid_train): after num_iterations steps, after one epoch, or when asked to
    last_step = (step >= num_iterations if num_iterations > 0 else loop.epoch_done) or stop_now

    # The final checkpoint comes first, so a crash in the final evaluations loses nothing.
    if stage.should_save(step, last_step):  # the last step, every save_every steps, every save_every_minutes
        stage.save(step, optimizers, loop, data_state=next_data_state, val_bpb=val_bpb)

    # The evaluations. A stop request cuts them short (Interrupted, on every rank together): what they measured so
    # far is not reported, and the stage stops.
    with stage.phase(f"Step {step:05d} | evaluations"):
        if last_step or (eval_every > 0 and step % eval_every == 0) or step == start_step:
            model.eval()
            val_loader = ConversationLoader(val_dataset, tokenizer, device_batch_size, max_seq_len, device,
                                            **loader_args)
            with autocast_ctx:
                val_bpb = evaluate_bpb(model, val_loader, eval_steps, token_bytes, stop=stage.stop)
            loop.first_val_bpb = val_bpb if loop.first_val_bpb is None else loop.first_val_bpb
            before = f" (the {source} model, before SFT)" if step == 0 else ""
            print0(f"Step {step:05d} | validation bpb: {val_bpb:.4f}{before}")
            stage.log(step, val_bpb=val_bpb)

        if metric_tasks and (last_step or (eval_metrics_every > 0 and step > 0 and step % eval_metrics_every == 0)):
            orig_model.eval()
            metrics = evaluate_metrics()
            print0(f"Step {step:05d} | " + " | ".join(f"{name} accuracy: {acc:.4f}" for name, acc in metrics.items()))
            stage.log(step, **{f"acc_{name}": acc for name, acc in metrics.items()})
    model.train()  # and orig_model: model is it, or (compiled) holds it

    if last_step:
        break

    # ---- one optimizer step ----
    t0 = device_time(device)
    # The loss is the mean over ALL supervised targets of the step: count them first (one all_reduce), then
    # each micro-step backpropagates its loss sum scaled by world_size / that count (nanochat/losses.py).
    rank_targets, step_targets = count_step_targets(step_batches, ddp_rank, ddp_world_size)
    step_loss_sum = torch.zeros((), device=device)
    for x, y in step_batches:
        with autocast_ctx:
            loss, loss_sum = supervised_loss(model, x, y, step_targets, ddp_world_size)
        step_loss_sum += loss_sum
        loss.backward()
    # The schedule follows how far the run is where this step's data began: in steps, or for a run of one epoch, as
    # the dataset index of this rank's next conversation against the whole mixture's size (rank r reads r, r + W,
    # ...: the ratio is the fraction of the epoch read; ConversationLoader.progress). A file that fits in one step
    # still trains at lr 1
    done, total = step_start
    step_start = train_loader.progress(step + 1, num_iterations)
    next_data_state, step_batches = train_loader.next_step(grad_accum_steps)  # fetched while the device works
    lrm = lr_multiplier(done, total, warmup_ratio, warmdown_ratio, final_lr_frac)
    momentum = muon_momentum(step)  # new optimizers, zero momentum buffers: 0.85 -> 0.95 over 300 steps, as mid_train
    # clip, update, zero the gradients (see base_train); the mean over every supervised target of the step.
    # A step without a supervised target on any rank (every row masked: at a short max_seq_len a conversation can be
    # cut before its first answer) has nothing to learn: no update, for AdamW's and Muon's momentum would move the
    # weights on its zero gradient; only its gradients are zeroed. The count is of all ranks: every rank skips alike.
    # The step still counts and the lr schedule moves on: it consumed its data.
    if step_targets > 0:
        grad_norm = step_optimizers(optimizers, lrm, momentum, grad_clip)
    else:
        orig_model.zero_grad(set_to_none=True)
        grad_norm = None
    train_loss, rank_losses = step_losses(step_loss_sum, rank_targets)
    stop_now, loop.epoch_done = stage.stop_after_step(loop.epoch_done or train_loader.epoch_done)
    dt = device_time(device) - t0
    step += 1

    # ---- logging ----
    debiased_loss, train_loss, losses = logged_step_loss(loop, train_loss, step_targets, ddp_world_size)
    if step - start_step > 10:
        loop.total_training_time += dt
    progress = step_start[0] / step_start[1]  # after this step
    print0(f"step {step:05d} ({100 * progress:.2f}%) | {losses} | lrm: {lrm:.2f} | muon momentum: {momentum:.3f} | "
           f"grad norm (before clip): {format_value(grad_norm)} | dt: {dt * 1000:.2f}ms | total time: "
           f"{loop.total_training_time / 60:.2f}m")
    stage.log(step, loss=debiased_loss, step_loss=train_loss, rank_losses=rank_losses, targets=step_targets, lrm=lrm,
              muon_momentum=momentum, grad_norm=grad_norm, dt=dt, total_training_time=loop.total_training_time)

# -----------------------------------------------------------------------------
# 8. What the ranks read, report, and the end of the stage
per_rank_stats = gather_from_ranks(train_loader.stats)
read = sum(s["read"] for s in per_rank_stats)
cut = sum(s["cut"] for s in per_rank_stats)
print0(f"Read {read:,} training conversations on {ddp_world_size} rank(s); {cut} were longer than max_seq_len + 1 "
       f"tokens and cut")
if loop.steps_without_targets:
    print0(f"Steps without targets (skipped): {loop.steps_without_targets} of {step}, every row masked (a longer "
           f"--max_seq_len keeps more answers)")
stopped_early = stage.stopped_early()  # a stop cut the training or the final evaluations short
final_bpb = None if stopped_early else val_bpb  # a final validation cut short measured nothing
print0(f"Validation bpb: {format_value(loop.first_val_bpb)} (before SFT) -> {format_value(final_bpb)} (after "
       f"{step} steps)")
stage.report("Chat SFT", step, [
    config,
    {"Mixture": mixture, "Training conversations": train_loader.size, "Conversations cut at max_seq_len": cut,
     "Gradient accumulation steps": grad_accum_steps, "torch.compile": use_compile,
     "Steps without targets (skipped)": loop.steps_without_targets,
     "Validation bpb before SFT": loop.first_val_bpb, "Final validation bpb": final_bpb,
     **{f"{name} accuracy": acc for name, acc in ({} if stopped_early else metrics).items()},
     "Total training time (min)": loop.total_training_time / 60},
])
if mixture == "custom":  # chat_eval scores none of your conversations, and RL needs problems it can reward
    next_steps = "talk to it: python -m scripts.chat_cli"
else:
    eval_args = " -a offline" if mixture == "offline" else ""
    rl_args = " --mixture=offline" if mixture == "offline" else ""
    next_steps = (f"python -m scripts.chat_eval -i sft{eval_args}, then python -m scripts.chat_rl{rl_args} "
                  f"(or talk to it: python -m scripts.chat_cli)")
sys.exit(stage.finish(step, next_steps))
