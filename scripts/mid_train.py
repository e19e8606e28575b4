"""
Midtraining: teach the base model to chat, on a mixture of conversations packed into rows.

The same next-token objective as pretraining, on conversations rendered in the chat format (special tokens
<|user_start|>, <|assistant_start|>, ...), including multiple-choice questions and calculator tool use
(<|python_start|> ... <|python_end|>, <|output_start|> ...).

    python -m scripts.mid_train --mixture=offline            # anywhere, no downloads (synthetic tasks)
    torchrun --standalone --nproc_per_node=8 -m scripts.mid_train   # the real mixture (SmolTalk, MMLU, GSM8K, ...)
    python -m scripts.mid_train --mixture=custom --conversations=docs/examples/conversations.jsonl  # your own alone

Your own conversations (--conversations=FILE, one JSON array of messages per line: tasks/customjson.py): the first
max(1, n // 20) of the file's n conversations are validation, the rest training; --mixture=custom trains on them
alone (e.g. a model in another language), with real or offline they are one more task of that mixture.

Written like scripts/base_train.py: every rank runs all of it and saves its own optimizer shard; rank 0 prints, and
saves the weights and the meta file; what happens around the training loop (start or resume, save, stop, finish)
is nanochat/stage.py's.

Data and ranks: rank r reads conversations r, r + W, r + 2W, ... of the mixture (W = world size), so unlike
pretraining the data of a step depends on the world size: 2 ranks x 1 micro-step do NOT see the same
conversations as 1 rank x 2 micro-steps. A resumed run must therefore use the same number of processes.
"""

import sys

import torch

from nanochat.configurator import check_config, configure
from nanochat.conversation_loader import ConversationLoader, chat_train_loader
from nanochat.dataloader import grad_accum_steps_for
from nanochat.hardware import autocast_context, compile_model, device_time, get_peak_flops
from nanochat.losses import count_step_targets, evaluate_bpb, logged_step_loss, step_losses, supervised_loss
from nanochat.optim import lr_multiplier, muon_momentum, scale_initial_lrs, step_optimizers
from nanochat.output import UserError, format_value, print0
from nanochat.ranks import gather_from_ranks
from nanochat.stage import Stage, stage_settings
from nanochat.tokenizer import get_token_bytes
from tasks.registry import check_conversations, conversations_split, stage_mixture

# -----------------------------------------------------------------------------
# 1. Config (override as --key=value; --help lists them), after the settings every training stage takes: the wandb
# run, the device, --model_tag (the base model), saves, resume, rerun, dry run (nanochat/stage.py)
step = -1  # which base checkpoint step (-1 = the last)
num_iterations = -1  # optimizer steps; -1 = one epoch of the training mixture
max_seq_len = 2048  # tokens per row
device_batch_size = 32  # rows per forward/backward per rank
total_batch_size = 524288  # tokens per optimizer step, all ranks together
unembedding_lr = 0.004  # AdamW lr of lm_head
embedding_lr = 0.2  # AdamW lr of the token embedding (the value embeddings get half)
matrix_lr = 0.02  # Muon lr of the transformer matrices
init_lr_frac = 1.0  # every lr is multiplied by this (fine-tuning often starts lower)
warmup_ratio = 0.0  # fraction of the run of linear lr warmup
warmdown_ratio = 0.2  # fraction of the run of linear lr decay at the end
final_lr_frac = 0.0  # lr multiplier at the very end of the warmdown
weight_decay = 0.0  # AdamW weight decay
grad_clip = 1.0  # clip the global gradient norm to this (0 = off)
eval_every = 150  # steps between validation evaluations (<= 0: only at the start and the end)
eval_tokens = -1  # validation tokens per evaluation, all ranks together (-1 = 20 x total_batch_size)
compile = "auto"  # torch.compile the model: auto (= on for CUDA, off for CPU/MPS) | true | false
# mixture: which tasks, how much of each: tasks/registry.py. conversations: custom's data; with real or offline one
# more task of that mixture
mixture = "real"  # real (SmolTalk, MMLU, GSM8K...; downloads) | offline (synthetic) | custom (--conversations alone)
conversations = ""  # JSONL of your own conversations (tasks/customjson.py)
identity_file = ""  # JSONL of identity conversations for the real mixture ("" = generate the built-in ones)
max_conversations = -1  # use only the first N conversations of the training mixture (-1 = all); for quick runs
train_on_all_tokens = False  # False: loss only on the tokens the chat mask marks (assistant); True: every token
config = configure(globals(), shared=stage_settings())
check_config(config, positive=["max_seq_len", "device_batch_size", "total_batch_size", "init_lr_frac"],
             positive_or_unset=["num_iterations", "eval_tokens", "max_conversations"],
             non_negative=["embedding_lr", "unembedding_lr", "matrix_lr", "weight_decay", "grad_clip"],
             fractions=["warmup_ratio", "warmdown_ratio", "final_lr_frac"],
             choices={"compile": ("auto", "true", "false"), "mixture": ("real", "offline", "custom")})
check_conversations(mixture, conversations)  # custom without a file, a missing file, under 2 conversations: refused now

# -----------------------------------------------------------------------------
# 2. The stage and the compute. The stage's settings are checked; this run is made from its settings, the base model
# it starts from and the files it reads: made already from them (--rerun=auto), it says so and exits 0 here
# (nanochat/stage.py, nanochat/rerun.py). Then one process per device (torchrun sets RANK / LOCAL_RANK /
# WORLD_SIZE), the banner, and wandb on rank 0
stage = Stage("mid", config, source="base", source_step=step,
              files=dict(conversations=conversations, identity_file=identity_file))
device_type, ddp, ddp_rank, ddp_world_size, device = stage.start_compute()
compute_dtype, autocast_ctx = autocast_context(device_type)  # decided by what the device does: nanochat/hardware.py

# -----------------------------------------------------------------------------
# 3. The model: every rank loads the full model (the Dist optimizers shard only their own work: the optimizer state,
# the update's arithmetic and the averaging of the gradients, nanochat/optim.py). A fresh run starts from the base
# model and keeps its tag; --resume_from_step continues this stage's own checkpoint. From here on this run owns
# mid_checkpoints/<model_tag>.
orig_model, tokenizer = stage.start()  # uncompiled: saving, evaluation
model, use_compile = compile_model(orig_model, compile, device_type)
if stage.parent and device_batch_size > (stage.parent["device_batch_size"] or device_batch_size):
    print0(f"WARNING: device_batch_size {device_batch_size} is larger than the base run's "
           f"{stage.parent['device_batch_size']}: this may run out of memory; lower it with --device_batch_size")
if max_seq_len > orig_model.rotary_len:
    raise UserError(f"--max_seq_len={max_seq_len} is beyond the model's rotary table ({orig_model.rotary_len} "
                    f"positions, 10x the base model's context of {orig_model.config.sequence_len}): use at most "
                    f"{orig_model.rotary_len}")
flops_per_token = orig_model.estimate_flops()
token_bytes = get_token_bytes(device, tokenizer.directory)
print0(f"torch.compile: {use_compile}")

# -----------------------------------------------------------------------------
# 4. Batch arithmetic: x, y = next(train_loader) is (device_batch_size, max_seq_len) on EACH rank; the micro-steps
# of a step, printed (or a one-line error naming settings that work)
grad_accum_steps = grad_accum_steps_for(total_batch_size, device_batch_size, max_seq_len, ddp_world_size, show=True)

# -----------------------------------------------------------------------------
# 5. Data: a deterministic shuffled mixture of chat tasks: which tasks, how much of each, in tasks/registry.py
# ("mid/real/train", "mid/offline/train", "mid/custom/train"; `python -m tasks.registry` lists them). No silent
# fallback from one mixture to the other.
train_dataset = stage_mixture("mid", mixture, "train", identity_file=identity_file, conversations=conversations)
val_dataset = stage_mixture("mid", mixture, "val", conversations=conversations)
own_split = conversations_split(conversations) if conversations else None  # your file's (validation, training) counts
# Conversations packed into rows: a conversation longer than a row continues in the next one
# (nanochat/conversation_loader.py). Printed: the mixture's counts, and how your file splits.
loader_args = dict(packed=True, rank=ddp_rank, world_size=ddp_world_size, train_on_all_tokens=train_on_all_tokens)
train_loader = chat_train_loader(train_dataset, val_dataset, tokenizer, device_batch_size, max_seq_len, device,
                                 mixture=mixture, conversations=conversations, own_split=own_split,
                                 size=max_conversations, **loader_args)
# What decides which conversations step N reads (here the world size too: rank r reads r, r+W, r+2W, ...)
data_settings = dict(mixture=mixture, conversations=conversations, max_conversations=max_conversations,
                     device_batch_size=device_batch_size, max_seq_len=max_seq_len, total_batch_size=total_batch_size,
                     world_size=ddp_world_size, train_on_all_tokens=train_on_all_tokens)
eval_tokens = eval_tokens if eval_tokens > 0 else 20 * total_batch_size  # as in base_train
eval_steps = max(1, eval_tokens // (device_batch_size * max_seq_len * ddp_world_size))

# -----------------------------------------------------------------------------
# 6. Optimizers: Muon for the block matrices; AdamW for the embedding, the head, the value-embedding tables and the
# layer scalars where the model has them (GPT.setup_optimizers). A resumed run gets back every rank's optimizer
# state and data position, and the loop's variables (nanochat/stage.py).
optimizers = orig_model.setup_optimizers(unembedding_lr=unembedding_lr, embedding_lr=embedding_lr,
                                         matrix_lr=matrix_lr, weight_decay=weight_decay)
scale_initial_lrs(optimizers, init_lr_frac)
loop = stage.resume(optimizers, train_loader, data_settings,
                    smooth_train_loss=0.0,  # EMA of the global train loss
                    ema_updates=stage.start_step,  # the step losses averaged into it (a checkpoint without: every step)
                    steps_without_targets=0,  # steps with no supervised target on any rank: no update (the loop)
                    total_training_time=0.0,  # seconds, excluding the first (compile) steps
                    first_val_bpb=None, min_val_bpb=float("inf"),
                    epoch_done=False)  # some rank has read its whole share of the mixture
peak_flops, peak_source = get_peak_flops(device, compute_dtype)
print0(f"Peak FLOP/s for MFU: {peak_flops:.3e} per device ({peak_source})")

# -----------------------------------------------------------------------------
# 7. The training loop: the same two-level loop as base_train (steps, and micro-steps inside a step). A step's
# micro-batches are fetched before it runs: its loss is normalised by its number of supervised targets, which
# must be known before the first backward. `next_data_state` is where they start (a checkpoint saves it).
step_start = train_loader.progress(stage.start_step, num_iterations)  # how far the run is where a step's data begins
next_data_state, step_batches = train_loader.next_step(grad_accum_steps)
x, y = step_batches[0]
# Every rank says what it got: (device_batch_size, max_seq_len) of ITS OWN conversations, not x world_size
masked = 100 * (y == -1).float().mean().item()
print(f"[rank {ddp_rank}] x, y = next(train_loader): x {tuple(x.shape)} {x.dtype}, y {tuple(y.shape)} {y.dtype}, "
      f"{masked:.0f}% of targets -1 (not trained on: user turns, tool outputs)", flush=True)
start_step = stage.start_step
val_bpb = None
mfus = []
step = start_step
stop_now = False  # SIGTERM / Ctrl-C: finish the step (cut an evaluation short), save, exit 75
while True:
    # After num_iterations steps, or (num_iterations = -1) as soon as ANY rank has read its share of the epoch
    # (a rank with fewer conversations wraps around first), or when asked to stop: every rank decides on the
    # same flags (stage.stop_after_step below), or the others would wait forever in their next collective.
    last_step = (step >= num_iterations if num_iterations > 0 else loop.epoch_done) or stop_now

    # The final checkpoint comes first, so a crash in the final evaluation loses nothing.
    if stage.should_save(step, last_step):  # the last step, every save_every steps, every save_every_minutes
        stage.save(step, optimizers, loop, data_state=next_data_state, val_bpb=val_bpb)

    # Validation: bits per byte of the assistant tokens of held-out conversations (step 0 = the base model). A stop
    # request cuts it short (Interrupted, on every rank together): not reported, and the stage stops.
    if last_step or step == start_step or (eval_every > 0 and step % eval_every == 0):
        model.eval()
        val_loader = ConversationLoader(val_dataset, tokenizer, device_batch_size, max_seq_len, device, **loader_args)
        with stage.phase(f"Step {step:05d} | validation"), autocast_ctx:
            val_bpb = evaluate_bpb(model, val_loader, eval_steps, token_bytes, stop=stage.stop)
            loop.first_val_bpb = val_bpb if loop.first_val_bpb is None else loop.first_val_bpb
            loop.min_val_bpb = min(loop.min_val_bpb, val_bpb)
            before = " (the base model, before midtraining)" if step == 0 else ""
            print0(f"Step {step:05d} | validation bpb: {val_bpb:.4f}{before}")
            stage.log(step, val_bpb=val_bpb, total_training_time=loop.total_training_time)
        model.train()

    if last_step:
        break

    # ---- one optimizer step ----
    t0 = device_time(device)
    # The loss of the step is the mean over ALL its supervised targets (all micro-steps, all ranks): count them
    # first (one all_reduce), then each micro-step backpropagates its loss sum scaled by world_size / that count
    # (why, and why not a mean per micro-batch: nanochat/losses.py).
    rank_targets, step_targets = count_step_targets(step_batches, ddp_rank, ddp_world_size)
    step_loss_sum = torch.zeros((), device=device)  # this rank's summed token losses, for logging
    for x, y in step_batches:
        with autocast_ctx:
            loss, loss_sum = supervised_loss(model, x, y, step_targets, ddp_world_size)
        step_loss_sum += loss_sum
        loss.backward()  # .backward() adds into .grad: the micro-steps' parts add up to the step's gradient
    # The schedule follows how far the run is where this step's data began: in steps, or for a run of one epoch, as
    # the dataset index of this rank's next conversation against the whole mixture's size (rank r reads r, r + W,
    # ...: the ratio is the fraction of the epoch read; ConversationLoader.progress). A file that fits in one step
    # still trains at lr 1
    done, total = step_start
    step_start = train_loader.progress(step + 1, num_iterations)
    next_data_state, step_batches = train_loader.next_step(grad_accum_steps)  # fetched while the device works
    lrm = lr_multiplier(done, total, warmup_ratio, warmdown_ratio, final_lr_frac)
    # The optimizers are new (midtraining does not load the base run's optimizer state): Muon's momentum buffers
    # start at zero, so its momentum warms up again, 0.85 -> 0.95 over the first 300 steps, then stays 0.95
    # (pretraining's defaults: 0.85 -> 0.97, then to 0.90 over its warmdown)
    momentum = muon_momentum(step)
    # clip, update, then zero the gradients for the next step (never between micro-steps: there they add up); the
    # ranks' gradients are averaged in there (see base_train). A step without a supervised target on any rank (every
    # row masked: user turns alone) has nothing to learn: no update, for AdamW's and Muon's momentum would move the
    # weights on its zero gradient; only its gradients are zeroed. The count is of all ranks: every rank skips alike.
    # The step still counts and the lr schedule moves on: it consumed its data.
    if step_targets > 0:
        grad_norm = step_optimizers(optimizers, lrm, momentum, grad_clip)
    else:
        orig_model.zero_grad(set_to_none=True)
        grad_norm = None
    # the mean over every supervised target of the step
    train_loss, rank_losses = step_losses(step_loss_sum, rank_targets)
    stop_now, loop.epoch_done = stage.stop_after_step(loop.epoch_done or train_loader.epoch_done)
    dt = device_time(device) - t0
    tok_per_sec = total_batch_size / dt  # rows are packed: every step trains on total_batch_size tokens
    step += 1

    # ---- logging ----
    debiased_loss, train_loss, losses = logged_step_loss(loop, train_loss, step_targets, ddp_world_size)
    mfu = 100 * flops_per_token * tok_per_sec / (peak_flops * ddp_world_size)
    if step - start_step > 10:  # the first steps include compilation and warm-up: keep them out of the time
        loop.total_training_time += dt
        mfus.append(mfu)
    progress = step_start[0] / step_start[1]  # after this step
    print0(f"step {step:05d} ({100 * progress:.2f}%) | {losses} | lrm: {lrm:.2f} | muon momentum: {momentum:.3f} | "
           f"grad norm (before clip): {format_value(grad_norm)} | dt: {dt * 1000:.2f}ms | "
           f"tok/sec: {tok_per_sec:,.0f} | mfu %: {mfu:.1f} | total time: {loop.total_training_time / 60:.2f}m")
    stage.log(step, loss=debiased_loss, step_loss=train_loss, rank_losses=rank_losses, targets=step_targets, lrm=lrm,
              muon_momentum=momentum, grad_norm=grad_norm, dt=dt, tok_per_sec=tok_per_sec, mfu=mfu,
              total_training_flops=flops_per_token * total_batch_size * step,
              total_training_time=loop.total_training_time)

# -----------------------------------------------------------------------------
# 8. What each rank read (gathered so rank 0 can show it), report, and the end of the stage
final_bpb = None if stage.stopped_early() else val_bpb  # a final validation cut short by a stop measured nothing
print0(f"Validation bpb: {format_value(loop.first_val_bpb)} (base model) -> {format_value(final_bpb)} (after {step} "
       f"steps of midtraining)")
per_rank_stats = gather_from_ranks(train_loader.stats)
for r, stats in enumerate(per_rank_stats):
    print0(f"rank {r}: read {stats['read']:,} training conversations (first: {stats['first']}), "
           f"{stats['split']} longer than a row, continued across rows")
if loop.steps_without_targets:
    print0(f"Steps without targets (skipped): {loop.steps_without_targets} of {step}, every row masked")
stage.report("Midtraining", step, [
    config,
    {"Mixture": mixture, "Training conversations": train_loader.size,
     "Conversations longer than a row (continued, not cropped)": sum(s["split"] for s in per_rank_stats),
     "Gradient accumulation steps": grad_accum_steps, "torch.compile": use_compile,
     "Steps without targets (skipped)": loop.steps_without_targets,
     "Validation bpb of the base model": loop.first_val_bpb, "Minimum validation bpb": loop.min_val_bpb,
     "Final validation bpb": final_bpb, "Total training time (min)": loop.total_training_time / 60,
     "Average MFU (%)": f"{sum(mfus) / len(mfus):.1f}" if mfus else "n/a (under 11 steps)"},
])
sft_args = f" --mixture={mixture}" if mixture != "real" else ""
sft_args += f" --conversations={conversations}" if conversations else ""
if mixture == "custom":  # chat_eval scores the registry's tasks, none of your conversations
    next_steps = f"python -m scripts.chat_sft{sft_args} (or talk to it: python -m scripts.chat_cli --source=mid)"
else:
    eval_args = " -a offline" if mixture == "offline" else ""
    next_steps = (f"python -m scripts.chat_eval -i mid{eval_args}, then python -m scripts.chat_sft{sft_args} "
                  f"(or talk to it: python -m scripts.chat_cli --source=mid)")
sys.exit(stage.finish(step, next_steps))
