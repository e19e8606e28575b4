"""
Midtraining: teach the base model to chat. Same next-token objective as pretraining, on conversations
rendered in the chat format (special tokens <|user_start|>, <|assistant_start|>, ...), including multiple-
choice questions and calculator tool use (<|python_start|> ... <|python_end|>, <|output_start|> ...).

    python -m scripts.mid_train --mixture=offline            # anywhere, no downloads (synthetic tasks)
    torchrun --standalone --nproc_per_node=8 -m scripts.mid_train   # the real mixture (SmolTalk, MMLU, GSM8K, ...)

Reads top to bottom: config, compute, base model, batch arithmetic, optimizers, data (the task mixture and
mid_data_generator), the training loop, report. Every rank runs all of it; rank 0 prints and saves.
"""

import json
import os
import time
from collections import deque
from contextlib import nullcontext

import torch
import torch.distributed as dist

from nanochat.checkpoint_manager import load_model, save_checkpoint
from nanochat.common import (UserError, autocast_dtype, autodetect_device_type, compute_cleanup, compute_init,
                             get_base_dir, get_peak_flops, grad_accum_steps_for, init_wandb, print0, print_banner)
from nanochat.configurator import configure
from nanochat.gpt import clip_grad_norm_
from nanochat.loss_eval import evaluate_bpb
from nanochat.report import get_report
from nanochat.schedules import mid_lr_multiplier, muon_momentum
from nanochat.tokenizer import get_token_bytes

# -----------------------------------------------------------------------------
# Config (override as --key=value; --help lists them)
run = "dummy"  # wandb run name ("dummy" = no wandb)
device_type = ""  # cuda | cpu | mps; empty = autodetect
model_tag = ""  # which base model under base_checkpoints/ (needed only if there are several)
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
eval_every = 150  # steps between validation evaluations (<= 0: only at the end)
eval_tokens = -1  # validation tokens per evaluation, all ranks together (-1 = 20 x total_batch_size)
mixture = "real"  # real (SmolTalk, MMLU, GSM8K, identity, spelling; downloads) | offline (synthetic, no downloads)
identity_file = ""  # JSONL of identity conversations for the real mixture ("" = generate the built-in ones)
max_conversations = -1  # use only the first N conversations of the training mixture (-1 = all); for quick runs
train_on_all_tokens = False  # False: loss only on the tokens the chat mask marks (assistant); True: every token
dry_run = False  # run everything but write no checkpoint and no report
config = configure(globals())

# -----------------------------------------------------------------------------
# Compute
print_banner()
device_type = device_type or autodetect_device_type()
ddp, ddp_rank, ddp_local_rank, ddp_world_size, device = compute_init(device_type)
master_process = ddp_rank == 0  # only rank 0 prints, logs to wandb, writes the checkpoint's model and meta
compute_dtype = autocast_dtype(device_type)
autocast_ctx = torch.amp.autocast(device_type=device_type, dtype=compute_dtype) if compute_dtype != torch.float32 else nullcontext()
synchronize = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
wandb_run = init_wandb(run, master_process, config, project="nanochat-mid")

# -----------------------------------------------------------------------------
# The base model: every rank loads the full model (the Dist optimizers shard only optimizer state)
model, tokenizer, meta = load_model("base", device, phase="train", model_tag=model_tag or None, step=step)
orig_model = model
model = torch.compile(model, dynamic=False) if device_type == "cuda" else model
base_device_batch_size = meta.get("device_batch_size")
if base_device_batch_size is not None and device_batch_size > base_device_batch_size:
    print0(f"WARNING: device_batch_size {device_batch_size} is larger than the base run's {base_device_batch_size}: "
           f"this may run out of memory; lower it with --device_batch_size")
flops_per_token = orig_model.estimate_flops()
token_bytes = get_token_bytes(device=device)

# -----------------------------------------------------------------------------
# Batch arithmetic: x, y = next(train_loader) is (device_batch_size, max_seq_len) on EACH rank
tokens_per_fwdbwd = device_batch_size * max_seq_len  # one rank, one micro-step
world_tokens_per_fwdbwd = tokens_per_fwdbwd * ddp_world_size  # all ranks, one micro-step
grad_accum_steps = grad_accum_steps_for(total_batch_size, device_batch_size, max_seq_len, ddp_world_size)  # or a clear error
print0(f"Tokens / micro-batch / rank: {device_batch_size} x {max_seq_len} = {tokens_per_fwdbwd:,}")
print0(f"Tokens / micro-batch (all {ddp_world_size} ranks): {world_tokens_per_fwdbwd:,}")
print0(f"Total batch size {total_batch_size:,} => gradient accumulation steps: {grad_accum_steps}")

# -----------------------------------------------------------------------------
# Optimizers: Muon for the block matrices, AdamW for embedding and head (see GPT.setup_optimizers)
optimizers = orig_model.setup_optimizers(unembedding_lr=unembedding_lr, embedding_lr=embedding_lr,
                                         matrix_lr=matrix_lr, weight_decay=weight_decay)
adamw_optimizer, muon_optimizer = optimizers
for opt in optimizers:
    for group in opt.param_groups:
        group["lr"] = group["initial_lr"] = group["lr"] * init_lr_frac

# -----------------------------------------------------------------------------
# Data: a deterministic shuffled mixture of chat tasks. No silent fallback from one mixture to the other.
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
elif mixture == "offline":
    from tasks.offline import offline_mixture
    train_dataset, val_dataset = offline_mixture("train"), offline_mixture("test")
else:
    raise UserError(f"--mixture must be real or offline, got {mixture!r}")
train_size = len(train_dataset) if max_conversations < 0 else min(max_conversations, len(train_dataset))
print0(f"Mixture {mixture}: {train_size:,} training conversations (of {len(train_dataset):,}), {len(val_dataset):,} validation")

# State shared between the generator and the loop (the generator runs inside next(train_loader))
last_step = False  # set when the train generator wraps around (one epoch done) if num_iterations is -1
approx_progress = 0.0  # fraction of the epoch this rank has read
train_stats = {"read": 0, "split": 0, "first": []}  # what this rank read: count, conversations split across rows, first indices


def mid_data_generator(split):
    """
    Rows of (device_batch_size, max_seq_len) tokens for THIS rank, forever. Conversations are rendered to
    tokens + mask and appended to a token buffer; a micro-batch is the next B*T+1 tokens (inputs = the first
    B*T, targets = shifted by one; the last token stays in the buffer for the next micro-batch). A conversation
    longer than a row simply continues in the next row: nothing is cropped (such conversations are counted).
    Rank r reads conversations r, r + world_size, r + 2*world_size, ...: ranks never read the same one.
    """
    global last_step, approx_progress
    dataset = train_dataset if split == "train" else val_dataset
    dataset_size = train_size if split == "train" else len(dataset)
    needed = device_batch_size * max_seq_len + 1
    ids_buffer, mask_buffer = deque(), deque()
    # On CUDA, rows are staged in page-locked memory so the copy to the GPU runs asynchronously; the event makes
    # sure the previous copy out of the staging buffer has finished before we overwrite it.
    scratch = torch.empty(needed, dtype=torch.int64, pin_memory=(device_type == "cuda"))
    mask_scratch = torch.empty(needed, dtype=torch.bool, pin_memory=(device_type == "cuda"))
    copy_done = None
    cursor = ddp_rank  # advances by ddp_world_size: each rank reads its own conversations
    stats = train_stats if split == "train" else {"read": 0, "split": 0, "first": []}
    while True:
        while len(ids_buffer) < needed:
            ids, mask = tokenizer.render_conversation(dataset[cursor], max_tokens=10**9)
            stats["read"] += 1
            stats["split"] += len(ids) > max_seq_len + 1
            if len(stats["first"]) < 8:
                stats["first"].append(cursor)
            ids_buffer.extend(ids)
            mask_buffer.extend(mask)
            cursor += ddp_world_size
            if cursor >= dataset_size:
                cursor -= dataset_size  # wrap around: the next epoch
                if split == "train" and num_iterations < 0:
                    last_step = True  # one epoch done: the training loop stops after this step
        if copy_done is not None:
            copy_done.synchronize()
        ids = [ids_buffer.popleft() for _ in range(needed - 1)] + [ids_buffer[0]]  # the last one stays for the next batch
        mask = [mask_buffer.popleft() for _ in range(needed - 1)] + [mask_buffer[0]]
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


train_loader = mid_data_generator("train")
eval_steps = max(1, (eval_tokens if eval_tokens > 0 else 20 * total_batch_size) // world_tokens_per_fwdbwd)
peak_flops, peak_source = get_peak_flops(device, compute_dtype)
checkpoint_dir = os.path.join(get_base_dir(), "mid_checkpoints", meta["model_tag"])  # same tag as the base model
metrics_path = os.path.join(get_base_dir(), "report", "mid-train-metrics.jsonl")
if master_process and not dry_run:
    os.makedirs(os.path.dirname(metrics_path), exist_ok=True)
    open(metrics_path, "w").close()


def log_metrics(**metrics):
    if master_process and not dry_run:
        with open(metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")


# -----------------------------------------------------------------------------
# Training loop
x, y = next(train_loader)  # prefetch the first micro-batch
# Every rank says what it got: (device_batch_size, max_seq_len) of ITS OWN conversations, not x world_size
masked = 100 * (y == -1).float().mean().item()
print(f"[rank {ddp_rank}] x, y = next(train_loader): x {tuple(x.shape)} {x.dtype}, y {tuple(y.shape)} {y.dtype}, "
      f"{masked:.0f}% of targets -1 (not trained on: user turns, tool outputs)", flush=True)
step = 0
smooth_train_loss, ema_beta, total_training_time = 0.0, 0.9, 0.0
val_bpb, first_val_bpb, min_val_bpb = None, None, float("inf")
while True:
    # Every rank must agree on stopping, or the others would wait forever in the next collective: a rank with
    # fewer conversations wraps around first. MAX over ranks: stop as soon as any rank has finished its epoch.
    if num_iterations > 0:
        last_step = step >= num_iterations
    if ddp:
        last_step_tensor = torch.tensor(last_step, dtype=torch.int32, device=device)
        dist.all_reduce(last_step_tensor, op=dist.ReduceOp.MAX)
        last_step = bool(last_step_tensor.item())

    # Validation: bits per byte of the assistant tokens of held-out conversations (step 0 = the base model)
    if last_step or step == 0 or (eval_every > 0 and step % eval_every == 0):
        model.eval()
        with autocast_ctx:
            val_bpb = evaluate_bpb(model, mid_data_generator("val"), eval_steps, token_bytes)
        model.train()
        first_val_bpb = val_bpb if first_val_bpb is None else first_val_bpb
        min_val_bpb = min(min_val_bpb, val_bpb)
        print0(f"Step {step:05d} | validation bpb: {val_bpb:.4f}{' (the base model, before midtraining)' if step == 0 else ''}")
        wandb_run.log({"step": step, "val/bpb": val_bpb})
        log_metrics(step=step, val_bpb=val_bpb)

    if last_step:
        break

    # One optimizer step: grad_accum_steps micro-steps, gradients averaged across ranks inside the optimizers
    synchronize()
    t0 = time.time()
    step_loss = torch.zeros((), device=device)
    for micro_step in range(grad_accum_steps):
        with autocast_ctx:
            loss = model(x, y)
        step_loss += loss.detach() / grad_accum_steps
        loss = loss / grad_accum_steps  # .backward() sums gradients over micro-steps: this makes it the mean
        loss.backward()
        x, y = next(train_loader)
    grad_norm = clip_grad_norm_(optimizers, grad_clip) if grad_clip > 0 else None
    progress = step / num_iterations if num_iterations > 0 else approx_progress
    lrm = mid_lr_multiplier(progress)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lrm
    for group in muon_optimizer.param_groups:
        group["momentum"] = muon_momentum(step)
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)
    if ddp:  # the logged loss is the mean over ranks, not rank 0's alone
        dist.all_reduce(step_loss, op=dist.ReduceOp.SUM)
        step_loss /= ddp_world_size
    train_loss = step_loss.item()
    synchronize()
    dt = time.time() - t0
    step += 1

    smooth_train_loss = ema_beta * smooth_train_loss + (1 - ema_beta) * train_loss
    debiased = smooth_train_loss / (1 - ema_beta ** step)
    tok_per_sec = total_batch_size / dt
    mfu = 100 * flops_per_token * tok_per_sec / (peak_flops * ddp_world_size)
    if step > 10:
        total_training_time += dt
    print0(f"step {step:05d} ({100 * progress:.2f}%) | loss: {debiased:.6f} (step {train_loss:.6f}, mean of {ddp_world_size} rank(s)) "
           f"| lrm: {lrm:.2f} | grad norm: {grad_norm.item() if grad_norm is not None else float('nan'):.4f} | dt: {dt * 1000:.2f}ms "
           f"| tok/sec: {tok_per_sec:,.0f} | mfu: {mfu:.2f} | total time: {total_training_time / 60:.2f}m")
    wandb_run.log({"step": step, "train/loss": debiased, "train/lrm": lrm, "train/dt": dt, "train/tok_per_sec": tok_per_sec, "train/mfu": mfu})
    log_metrics(step=step, loss=debiased, step_loss=train_loss, lrm=lrm, dt=dt, tok_per_sec=tok_per_sec, mfu=mfu)

# -----------------------------------------------------------------------------
# What each rank read (gathered so rank 0 can show it), checkpoint, report
per_rank = [None] * ddp_world_size
if ddp:
    dist.all_gather_object(per_rank, train_stats)
else:
    per_rank = [train_stats]
for r, stats in enumerate(per_rank):
    print0(f"rank {r}: read {stats['read']:,} training conversations (first: {stats['first']}), "
           f"{stats['split']} longer than a row, continued across rows")
print0(f"Validation bpb: {first_val_bpb:.4f} (base model) -> {val_bpb:.4f} (after {step} steps of midtraining)")
if not dry_run:
    save_checkpoint(checkpoint_dir, step, orig_model.state_dict(), [opt.state_dict() for opt in optimizers], dict(
        model_config=orig_model.config.to_dict(), user_config=config, val_bpb=val_bpb, base_meta_step=meta["step"],
        device_batch_size=device_batch_size, max_seq_len=max_seq_len, per_rank_data=per_rank,
    ), rank=ddp_rank)
    get_report().log(section="Midtraining", data=[
        config,
        {"Number of iterations": step, "Mixture": mixture, "Training conversations": train_size,
         "Gradient accumulation steps": grad_accum_steps, "World size": ddp_world_size,
         "Validation bpb of the base model": first_val_bpb, "Minimum validation bpb": min_val_bpb,
         "Final validation bpb": val_bpb, "Total training time (min)": total_training_time / 60,
         "Conversations longer than a row (continued, not cropped)": sum(s["split"] for s in per_rank)},
    ])
    print0("Next: chat evaluation and supervised finetuning (scripts.chat_eval / scripts.chat_sft, later stages)")
wandb_run.finish()
compute_cleanup()
