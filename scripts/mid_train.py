"""
Midtraining: teach the base model to chat. Same next-token objective as pretraining, on conversations
rendered in the chat format (special tokens <|user_start|>, <|assistant_start|>, ...), including multiple-
choice questions and calculator tool use (<|python_start|> ... <|python_end|>, <|output_start|> ...).

    python -m scripts.mid_train --mixture=offline            # anywhere, no downloads (synthetic tasks)
    torchrun --standalone --nproc_per_node=8 -m scripts.mid_train   # the real mixture (SmolTalk, MMLU, GSM8K, ...)

Reads top to bottom like scripts/base_train.py, and written the same way: 1 config, 2 compute, 3 the model
(the base model, or the midtraining checkpoint being resumed), 4 batch arithmetic, 5 optimizers, 6 the
checkpoint directory and resume, 7 data (the task mixture and mid_data_generator), 8 the training loop, 9 report.
Every rank runs all of it; rank 0 prints and saves.

Data and ranks: rank r reads conversations r, r + W, r + 2W, ... of the mixture (W = world size), so unlike
pretraining the data of a step depends on the world size: 2 ranks x 1 micro-step do NOT see the same
conversations as 1 rank x 2 micro-steps. A resumed run must therefore use the same number of processes.
"""

import os
import sys
import time
from collections import deque
from contextlib import nullcontext

import torch
import torch.distributed as dist

from nanochat.checkpoint_manager import (check_data_settings, check_model_tag, check_tokenizer, checkpoint_dir_for,
                                         claim_checkpoint_dir, find_model_tag, load_checkpoint, load_model, model_from_state,
                                         open_metrics, save_checkpoint)
from nanochat.common import (EXIT_STOPPED_EARLY, StopRequest, UserError, autocast_dtype, autodetect_device_type, check_finite,
                             compute_cleanup, compute_init, gather_from_ranks, get_base_dir, get_peak_flops,
                             grad_accum_steps_for, init_wandb, print0, print_banner)
from nanochat.configurator import check_config, configure
from nanochat.loss_eval import count_step_targets, evaluate_bpb, supervised_loss
from nanochat.report import get_report
from nanochat.schedules import mid_lr_multiplier, muon_momentum
from nanochat.sharding import clip_grad_norm_, load_optimizer_shards, optimizer_shard
from nanochat.tokenizer import get_token_bytes, get_tokenizer

# -----------------------------------------------------------------------------
# 1. Config (override as --key=value; --help lists them)
run = "dummy"  # wandb run name ("dummy" = no wandb)
device_type = ""  # cuda | cpu | mps; empty = autodetect
model_tag = ""  # which base model under base_checkpoints/ (needed only if there are several); also names mid_checkpoints/<tag>
step = -1  # which base checkpoint step (-1 = the last)
num_iterations = -1  # optimizer steps; -1 = one epoch of the training mixture
max_seq_len = 2048  # tokens per row
device_batch_size = 32  # rows per forward/backward per rank
total_batch_size = 524288  # tokens per optimizer step, all ranks together
unembedding_lr = 0.004  # AdamW lr of lm_head
embedding_lr = 0.2  # AdamW lr of the token embedding
matrix_lr = 0.02  # Muon lr of the transformer matrices
init_lr_frac = 1.0  # every lr is multiplied by this (fine-tuning often starts lower)
weight_decay = 0.0  # AdamW weight decay
grad_clip = 1.0  # clip the global gradient norm to this (0 = off)
eval_every = 150  # steps between validation evaluations (<= 0: only at the start and the end)
eval_tokens = -1  # validation tokens per evaluation, all ranks together (-1 = 20 x total_batch_size)
save_every = -1  # steps between checkpoints (<= 0: only the final one)
resume_from_step = -1  # resume from this step's checkpoint in mid_checkpoints/<model_tag> (-1 = start from the base model)
overwrite = False  # a fresh run into a model_tag that holds midtraining checkpoints deletes them (default: refuse)
compile = "auto"  # torch.compile the model: auto (= on for CUDA, off for CPU/MPS) | true | false
mixture = "real"  # real (SmolTalk, MMLU, GSM8K, identity, spelling; downloads) | offline (synthetic, no downloads)
identity_file = ""  # JSONL of identity conversations for the real mixture ("" = generate the built-in ones)
max_conversations = -1  # use only the first N conversations of the training mixture (-1 = all); for quick runs
train_on_all_tokens = False  # False: loss only on the tokens the chat mask marks (assistant); True: every token
dry_run = False  # run everything but write no checkpoint and no report
config = configure(globals())
check_config(config, positive=["max_seq_len", "device_batch_size", "total_batch_size", "init_lr_frac"],
             positive_or_unset=["num_iterations", "eval_tokens", "max_conversations"],
             non_negative=["embedding_lr", "unembedding_lr", "matrix_lr", "weight_decay", "grad_clip"],
             choices={"device_type": ("", "cuda", "cpu", "mps"), "compile": ("auto", "true", "false"),
                      "mixture": ("real", "offline")})
if resume_from_step < -1:
    raise UserError(f"--resume_from_step must be a checkpoint's step, or -1 to start from the base model, got {resume_from_step}")
if model_tag:
    check_model_tag(model_tag)

# -----------------------------------------------------------------------------
# 2. Compute
print_banner()
device_type = device_type or autodetect_device_type()
ddp, ddp_rank, ddp_local_rank, ddp_world_size, device = compute_init(device_type)
master_process = ddp_rank == 0  # only rank 0 prints, logs to wandb, writes the checkpoint's model and meta
compute_dtype = autocast_dtype(device_type)
autocast_ctx = torch.amp.autocast(device_type=device_type, dtype=compute_dtype) if compute_dtype != torch.float32 else nullcontext()
synchronize = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
wandb_run = init_wandb(run, master_process, config, project="nanochat-mid")

# -----------------------------------------------------------------------------
# 3. The model: every rank loads the full model (the Dist optimizers shard only optimizer state). A fresh run
# starts from the base model; a resumed run from its own checkpoint of step resume_from_step.
if resume_from_step < 0:
    model, tokenizer, base_meta = load_model("base", device, phase="train", model_tag=model_tag or None, step=step)
    model_tag = base_meta["model_tag"]  # the midtrained model keeps the tag of its base model
    base_model = dict(model_tag=model_tag, step=base_meta["step"], device_batch_size=base_meta["user_config"]["device_batch_size"])
else:
    model_tag = model_tag or find_model_tag(os.path.join(get_base_dir(), "mid_checkpoints"), "python -m scripts.mid_train")
    tokenizer = get_tokenizer()
checkpoint_dir = checkpoint_dir_for("mid", model_tag)
if not dry_run:  # this run owns mid_checkpoints/<model_tag> until it ends (see claim_checkpoint_dir)
    claim_checkpoint_dir(checkpoint_dir, resume_from_step, overwrite)
start_step, loop_state, data_state, optim_shards = 0, {}, None, None
if resume_from_step >= 0:
    model_state, optim_shards, meta = load_checkpoint(checkpoint_dir, resume_from_step, device, load_optimizer=True)
    where = f"checkpoint of step {resume_from_step} in {checkpoint_dir}"
    check_tokenizer(meta, tokenizer, where)
    model = model_from_state(model_state, meta, device, where)
    base_model, start_step, loop_state, data_state = meta["base_model"], resume_from_step, meta["loop_state"], meta["data_state"]
    del model_state
orig_model = model  # the uncompiled model: for saving and evaluation
use_compile = compile == "true" or (compile == "auto" and device_type == "cuda")
if use_compile:
    model = torch.compile(model, dynamic=False)
if device_batch_size > base_model["device_batch_size"]:
    print0(f"WARNING: device_batch_size {device_batch_size} is larger than the base run's {base_model['device_batch_size']}: "
           f"this may run out of memory; lower it with --device_batch_size")
if max_seq_len > orig_model.rotary_len:
    raise UserError(f"--max_seq_len={max_seq_len} is beyond the model's rotary table ({orig_model.rotary_len} positions, "
                    f"10x the base model's context of {orig_model.config.sequence_len}): use at most {orig_model.rotary_len}")
flops_per_token = orig_model.estimate_flops()
token_bytes = get_token_bytes(device=device)
print0(f"torch.compile: {use_compile}")

# -----------------------------------------------------------------------------
# 4. Batch arithmetic: x, y = next(train_loader) is (device_batch_size, max_seq_len) on EACH rank
tokens_per_fwdbwd = device_batch_size * max_seq_len  # one rank, one micro-step
world_tokens_per_fwdbwd = tokens_per_fwdbwd * ddp_world_size  # all ranks, one micro-step
grad_accum_steps = grad_accum_steps_for(total_batch_size, device_batch_size, max_seq_len, ddp_world_size)  # or a clear error
print0(f"Tokens / micro-batch / rank: {device_batch_size} x {max_seq_len} = {tokens_per_fwdbwd:,}")
print0(f"Tokens / micro-batch (all {ddp_world_size} ranks): {world_tokens_per_fwdbwd:,}")
print0(f"Total batch size {total_batch_size:,} => gradient accumulation steps: {grad_accum_steps}")

# -----------------------------------------------------------------------------
# 5. Optimizers: Muon for the block matrices, AdamW for embedding and head (see GPT.setup_optimizers)
optimizers = orig_model.setup_optimizers(unembedding_lr=unembedding_lr, embedding_lr=embedding_lr,
                                         matrix_lr=matrix_lr, weight_decay=weight_decay)
adamw_optimizer, muon_optimizer = optimizers
for opt in optimizers:
    for group in opt.param_groups:
        group["lr"] = group["initial_lr"] = group["lr"] * init_lr_frac

# -----------------------------------------------------------------------------
# 6. Resume: the optimizer state of every rank that saved, checks that the data would continue the same way
# What decides which conversations step N reads (here the world size too: rank r reads r, r+W, r+2W, ...)
data_settings = dict(mixture=mixture, max_conversations=max_conversations, device_batch_size=device_batch_size,
                     max_seq_len=max_seq_len, total_batch_size=total_batch_size, world_size=ddp_world_size,
                     train_on_all_tokens=train_on_all_tokens)
if resume_from_step >= 0:
    check_data_settings(meta["data_settings"], data_settings, where)
    load_optimizer_shards(optimizers, orig_model, optim_shards, where)
    del optim_shards
    print0(f"Resumed from step {start_step} of {checkpoint_dir}")

# -----------------------------------------------------------------------------
# 7. Data: a deterministic shuffled mixture of chat tasks. No silent fallback from one mixture to the other.
if mixture == "real":
    from tasks.common import TaskMixture
    from tasks.customjson import CustomJSON
    from tasks.gsm8k import GSM8K
    from tasks.identity import write_identity_jsonl
    from tasks.mmlu import MMLU
    from tasks.smoltalk import SmolTalk
    from tasks.spellingbee import SimpleSpelling, SpellingBee
    identity_path = identity_file or write_identity_jsonl(os.path.join(get_base_dir(), "identity_conversations.jsonl"))
    train_dataset = TaskMixture([
        SmolTalk(split="train"),  # general conversations
        MMLU(subset="auxiliary_train", split="train"),  # multiple choice
        GSM8K(subset="main", split="train"),  # math with calculator tool calls
        CustomJSON(identity_path), CustomJSON(identity_path),  # who am I; listed twice = oversampled 2x
        SimpleSpelling(split="train"), SpellingBee(split="train"),  # spelling and letter counting
    ])
    val_dataset = TaskMixture([SmolTalk(split="test"), MMLU(subset="all", split="test", stop=5200), GSM8K(subset="main", split="test", stop=420)])
else:
    from tasks.offline import offline_mixture
    train_dataset, val_dataset = offline_mixture("train"), offline_mixture("test")
train_size = len(train_dataset) if max_conversations < 0 else min(max_conversations, len(train_dataset))
print0(f"Mixture {mixture}: {train_size:,} training conversations (of {len(train_dataset):,}), {len(val_dataset):,} validation")

# State shared between the generator and the loop (the generator runs inside next(train_loader))
epoch_done = False  # set when this rank's train generator wraps around (one epoch done); used if num_iterations is -1
approx_progress = 0.0  # fraction of the epoch this rank has read
train_stats = {"read": 0, "split": 0, "first": []}  # what this rank read: count, conversations split across rows, first indices
train_position = None  # [conversation, token offset] where the NEXT train batch will start (for resume)


def mid_data_generator(split, resume_position=None):
    """
    Rows of (device_batch_size, max_seq_len) tokens for THIS rank, forever. Conversations are rendered to
    tokens + mask and appended to a token buffer; a micro-batch is the next B*T+1 tokens (inputs = the first
    B*T, targets = shifted by one; the last token stays in the buffer for the next micro-batch). A conversation
    longer than a row simply continues in the next row: nothing is cropped (such conversations are counted).
    Rank r reads conversations r, r + world_size, r + 2*world_size, ...: ranks never read the same one.

    Resuming: what is left in the buffer after a batch is always the tail of ONE conversation (the buffer is
    refilled one conversation at a time, only until it holds a batch), so where the next batch starts is just
    [conversation index, token offset into it] (train_position; a checkpoint saves the position of the first
    batch of the next step). Starting from that position re-renders that conversation, skips the offset, and
    reproduces the same batches from there on.
    """
    global epoch_done, approx_progress, train_position
    dataset = train_dataset if split == "train" else val_dataset
    dataset_size = train_size if split == "train" else len(dataset)
    needed = device_batch_size * max_seq_len + 1
    ids_buffer, mask_buffer = deque(), deque()
    segments = deque()  # [conversation index, its tokens still in the buffer, offset of the first of them], in order
    # On CUDA, rows are staged in page-locked memory so the copy to the GPU runs asynchronously; the event makes
    # sure the previous copy out of the staging buffer has finished before we overwrite it.
    scratch = torch.empty(needed, dtype=torch.int64, pin_memory=(device_type == "cuda"))
    mask_scratch = torch.empty(needed, dtype=torch.bool, pin_memory=(device_type == "cuda"))
    copy_done = None
    cursor, skip = (ddp_rank, 0) if resume_position is None else resume_position  # cursor advances by ddp_world_size
    stats = train_stats if split == "train" else {"read": 0, "split": 0, "first": []}
    while True:
        while len(ids_buffer) < needed:
            ids, mask = tokenizer.render_conversation(dataset[cursor], max_tokens=10**9)
            segments.append([cursor, len(ids) - skip, skip])
            if skip:  # resuming inside this conversation: it was already read and counted
                ids, mask, skip = ids[skip:], mask[skip:], 0
            else:
                stats["read"] += 1
                stats["split"] += len(ids) > max_seq_len + 1
                if len(stats["first"]) < 8:
                    stats["first"].append(cursor)
            ids_buffer.extend(ids)
            mask_buffer.extend(mask)
            cursor += ddp_world_size
            if cursor >= dataset_size:
                cursor -= dataset_size  # wrap around: the next epoch
                if split == "train":
                    epoch_done = True  # one epoch done: with num_iterations = -1 the training loop stops after this step
        if copy_done is not None:
            copy_done.synchronize()
        ids = [ids_buffer.popleft() for _ in range(needed - 1)] + [ids_buffer[0]]  # the last one stays for the next batch
        mask = [mask_buffer.popleft() for _ in range(needed - 1)] + [mask_buffer[0]]
        consumed = needed - 1
        while consumed:  # move the segment bookkeeping past the consumed tokens
            take = min(consumed, segments[0][1])
            segments[0][1] -= take
            segments[0][2] += take
            consumed -= take
            if segments[0][1] == 0:
                segments.popleft()
        if split == "train":  # the leftover (at least the kept last token) is the tail of segments[0]
            train_position = [segments[0][0], segments[0][2]]
        scratch.copy_(torch.tensor(ids, dtype=torch.int64))
        mask_scratch.copy_(torch.tensor(mask, dtype=torch.bool))
        inputs = scratch[:-1].view(device_batch_size, max_seq_len).to(device=device, dtype=torch.int32, non_blocking=True)
        targets = scratch[1:].view(device_batch_size, max_seq_len).to(device=device, dtype=torch.int64, non_blocking=True)
        if not train_on_all_tokens:
            # the loss counts only the tokens the model must learn to produce: the assistant's (mask 1)
            target_mask = mask_scratch[1:].view(device_batch_size, max_seq_len).to(device=device, non_blocking=True)
            targets = torch.where(target_mask, targets, -1)
        if device_type == "cuda":
            copy_done = torch.cuda.Event()
            copy_done.record()
        if split == "train":
            approx_progress = cursor / dataset_size
        yield inputs, targets


if data_state is not None:  # continue exactly where the checkpoint's run was
    train_stats, epoch_done = data_state["stats"][ddp_rank], data_state["epoch_done"]
train_position = data_state["positions"][ddp_rank] if data_state else [ddp_rank, 0]
train_loader = mid_data_generator("train", resume_position=train_position)
eval_steps = max(1, (eval_tokens if eval_tokens > 0 else 20 * total_batch_size) // world_tokens_per_fwdbwd)
peak_flops, peak_source = get_peak_flops(device, compute_dtype)
print0(f"Peak FLOP/s for MFU: {peak_flops:.3e} per device ({peak_source})")
# Stop cleanly on SIGTERM / Ctrl-C: finish the current step, save a checkpoint, exit (see StopRequest).
stop_request = StopRequest(ddp_rank)
# The metrics of every step (report curves); they live with the checkpoints and continue on resume
metrics_path, log_metrics = open_metrics(checkpoint_dir, start_step, enabled=master_process and not dry_run)
last_saved_step = start_step if resume_from_step >= 0 else None


def save(step):
    # every rank saves its optimizer shard; rank 0 the weights; the data position of every rank goes in the meta
    global last_saved_step
    if not all(torch.isfinite(p).all() for p in orig_model.parameters()):  # never save a diverged model
        raise UserError(f"step {step}: the weights are not finite; nothing saved (the last checkpoint is step {last_saved_step})")
    # where the prefetched batches of the next step start, and what had been read before them
    data_state = dict(positions=gather_from_ranks(next_step_position), stats=gather_from_ranks(next_step_stats),
                      epoch_done=any_epoch_done)
    save_checkpoint(checkpoint_dir, step, orig_model.state_dict(), optimizer_shard(optimizers, orig_model), dict(
        model_config=orig_model.config.to_dict(), user_config=config, val_bpb=val_bpb, base_model=base_model,
        tokenizer=dict(fingerprint=tokenizer.fingerprint(), vocab_size=tokenizer.get_vocab_size()),
        data_settings=data_settings, data_state=data_state,
        loop_state=dict(smooth_train_loss=smooth_train_loss, total_training_time=total_training_time,
                        first_val_bpb=first_val_bpb, min_val_bpb=min_val_bpb, num_iterations=num_iterations),
    ), rank=ddp_rank)
    last_saved_step = step


# -----------------------------------------------------------------------------
# 8. The training loop: the same two-level loop as base_train (steps, and micro-steps inside a step)


def fetch_step():
    """
    The grad_accum_steps micro-batches of the next step, fetched before the step runs: the step's loss is
    normalised by its number of supervised targets, which must be known before the first backward. Also
    returns where these batches start and what had been read before them (a checkpoint saves both).
    """
    position, stats = list(train_position), dict(train_stats, first=list(train_stats["first"]))
    return [next(train_loader) for _ in range(grad_accum_steps)], position, stats


step_batches, next_step_position, next_step_stats = fetch_step()
x, y = step_batches[0]
# Every rank says what it got: (device_batch_size, max_seq_len) of ITS OWN conversations, not x world_size
masked = 100 * (y == -1).float().mean().item()
print(f"[rank {ddp_rank}] x, y = next(train_loader): x {tuple(x.shape)} {x.dtype}, y {tuple(y.shape)} {y.dtype}, "
      f"{masked:.0f}% of targets -1 (not trained on: user turns, tool outputs)", flush=True)
smooth_train_loss = loop_state.get("smooth_train_loss", 0.0)  # EMA of the global train loss
total_training_time = loop_state.get("total_training_time", 0.0)  # seconds, excluding the first (compile) steps
first_val_bpb, min_val_bpb = loop_state.get("first_val_bpb"), loop_state.get("min_val_bpb", float("inf"))
val_bpb, ema_beta, mfus = None, 0.9, []
step, stop_now, any_epoch_done = start_step, False, epoch_done
while True:
    # Every rank must agree on stopping, or the others would wait forever in the next collective: a rank with
    # fewer conversations wraps around first. The flags come from the end-of-step all_reduce below: stop as
    # soon as ANY rank has finished its epoch (num_iterations = -1), or was asked to stop.
    last_step = (step >= num_iterations if num_iterations > 0 else any_epoch_done) or stop_now

    # The final checkpoint comes first, so a crash in the final evaluation loses nothing.
    if not dry_run and (last_step or (save_every > 0 and step > start_step and step % save_every == 0)):
        save(step)

    # Validation: bits per byte of the assistant tokens of held-out conversations (step 0 = the base model)
    if last_step or step == start_step or (eval_every > 0 and step % eval_every == 0):
        model.eval()
        with autocast_ctx:
            val_bpb = evaluate_bpb(model, mid_data_generator("val"), eval_steps, token_bytes)
        model.train()
        first_val_bpb = val_bpb if first_val_bpb is None else first_val_bpb
        min_val_bpb = min(min_val_bpb, val_bpb)
        print0(f"Step {step:05d} | validation bpb: {val_bpb:.4f}{' (the base model, before midtraining)' if step == 0 else ''}")
        wandb_run.log({"step": step, "total_training_time": total_training_time, "val/bpb": val_bpb})
        log_metrics(step=step, val_bpb=val_bpb)

    if last_step:
        break

    # ---- one optimizer step ----
    synchronize()
    t0 = time.time()
    # The loss of the step is the mean over ALL its supervised targets (all micro-steps, all ranks): count them
    # first (one all_reduce), then each micro-step backpropagates its loss sum scaled by world_size / that count
    # (why, and why not a mean per micro-batch: nanochat/loss_eval.py).
    rank_targets, step_targets = count_step_targets(step_batches, ddp_rank, ddp_world_size)
    step_loss_sum = torch.zeros((), device=device)  # this rank's summed token losses, for logging
    for micro_step in range(grad_accum_steps):
        x, y = step_batches[micro_step]
        with autocast_ctx:
            loss, loss_sum = supervised_loss(model, x, y, step_targets, ddp_world_size)
        step_loss_sum += loss_sum
        loss.backward()  # .backward() adds into .grad: the micro-steps' parts add up to the step's gradient
    step_batches, next_step_position, next_step_stats = fetch_step()  # the next step's data, while the device works
    # Gradients are averaged across ranks in clip_grad_norm_ (clipping on) or in opt.step() (off): see base_train
    grad_norm = clip_grad_norm_(optimizers, grad_clip) if grad_clip > 0 else None
    progress = step / num_iterations if num_iterations > 0 else approx_progress
    lrm = mid_lr_multiplier(progress)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lrm
    # The optimizers are new (midtraining does not load the base run's optimizer state): Muon's momentum buffers
    # start at zero, so its momentum gets the same 0.85 -> 0.95 warm-up over 300 steps as in pretraining.
    momentum = muon_momentum(step)
    for group in muon_optimizer.param_groups:
        group["momentum"] = momentum
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)
    # One all_reduce at the end of the step: every rank's loss (slot r = rank r), the stop flag, the epoch flag
    shared = torch.zeros(ddp_world_size + 2, device=device)
    shared[ddp_rank] = step_loss_sum
    shared[-2] = float(stop_request.requested)
    shared[-1] = float(epoch_done)
    if ddp:
        dist.all_reduce(shared)
    rank_loss_sums = shared[:-2].tolist()
    stop_now, any_epoch_done = shared[-2].item() > 0, shared[-1].item() > 0
    synchronize()
    dt = time.time() - t0
    step += 1

    # ---- logging ----
    train_loss = sum(rank_loss_sums) / max(step_targets, 1)  # global loss: the mean over every supervised target of the step
    rank_losses = [loss_sum / max(n, 1) for loss_sum, n in zip(rank_loss_sums, rank_targets)]
    grad_norm_value = grad_norm.item() if grad_norm is not None else None
    check_finite(step, train_loss, grad_norm_value, last_saved_step, ["matrix_lr", "embedding_lr", "unembedding_lr", "init_lr_frac"])
    smooth_train_loss = ema_beta * smooth_train_loss + (1 - ema_beta) * train_loss
    debiased_loss = smooth_train_loss / (1 - ema_beta ** step)  # the EMA starts at 0: undo that bias
    tok_per_sec = total_batch_size / dt
    mfu = 100 * flops_per_token * tok_per_sec / (peak_flops * ddp_world_size)
    if step - start_step > 10:  # the first steps include compilation and warm-up: keep them out of the time
        total_training_time += dt
        mfus.append(mfu)
    grad_text = f"{grad_norm_value:.4f}" if grad_norm_value is not None else "n/a (no clipping)"
    progress_done = step / num_iterations if num_iterations > 0 else approx_progress  # after this step (progress above: before it, for the lr)
    print0(f"step {step:05d} ({100 * progress_done:.2f}%) | loss (EMA): {debiased_loss:.6f} | step loss ({step_targets:,.0f} "
           f"targets, {ddp_world_size} rank(s)): {train_loss:.6f} | lrm: {lrm:.2f} | muon momentum: {momentum:.3f} | grad norm (before clip): {grad_text} "
           f"| dt: {dt * 1000:.2f}ms | tok/sec: {tok_per_sec:,.0f} | mfu %: {mfu:.1f} | total time: {total_training_time / 60:.2f}m")
    wandb_run.log({"step": step, "total_training_flops": flops_per_token * total_batch_size * step,
                   "total_training_time": total_training_time, "train/loss": debiased_loss, "train/step_loss": train_loss,
                   "train/lrm": lrm, "train/muon_momentum": momentum, "train/grad_norm": grad_norm_value, "train/dt": dt,
                   "train/tok_per_sec": tok_per_sec, "train/mfu": mfu})
    log_metrics(step=step, loss=debiased_loss, step_loss=train_loss, rank_losses=rank_losses, targets=step_targets, lrm=lrm,
                grad_norm=grad_norm_value, dt=dt, tok_per_sec=tok_per_sec, mfu=mfu)

# -----------------------------------------------------------------------------
# 9. What each rank read (gathered so rank 0 can show it), report
per_rank = gather_from_ranks(train_stats)
for r, stats in enumerate(per_rank):
    print0(f"rank {r}: read {stats['read']:,} training conversations (first: {stats['first']}), "
           f"{stats['split']} longer than a row, continued across rows")
print0(f"Validation bpb: {first_val_bpb:.4f} (base model) -> {val_bpb:.4f} (after {step} steps of midtraining)")
stopped_early = stop_now and not (step >= num_iterations if num_iterations > 0 else any_epoch_done)
if not dry_run:
    get_report().log(section="Midtraining", data=[
        config,
        {"Number of iterations": step, "Stopped early": stopped_early, "Mixture": mixture, "Training conversations": train_size,
         "Gradient accumulation steps": grad_accum_steps, "World size": ddp_world_size, "torch.compile": use_compile,
         "Validation bpb of the base model": first_val_bpb, "Minimum validation bpb": min_val_bpb,
         "Final validation bpb": val_bpb, "Total training time (min)": total_training_time / 60,
         "Average MFU (%)": f"{sum(mfus) / len(mfus):.1f}" if mfus else "n/a (under 11 steps)",
         "Conversations longer than a row (continued, not cropped)": sum(s["split"] for s in per_rank),
         "Metrics file": metrics_path},
    ])
wandb_run.finish()
compute_cleanup()
if stopped_early:
    print0(f"Stopped at step {step} on request. Continue with the same command plus --resume_from_step={step} "
           f"(exit code {EXIT_STOPPED_EARLY}: not finished)")
    sys.exit(EXIT_STOPPED_EARLY)
eval_args, sft_args = (" -a offline", " --mixture=offline") if mixture == "offline" else ("", "")
print0(f"Next: python -m scripts.chat_eval -i mid{eval_args}, then python -m scripts.chat_sft{sft_args} (or talk to it: python -m scripts.chat_cli --source=mid)")
