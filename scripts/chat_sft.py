"""
Supervised finetuning (SFT): train the midtrained model on whole conversations, one conversation per row, the
way it will be used in a chat (midtraining packed conversations into a token stream; here every row starts at
the start of a conversation and is padded to the longest row of its batch).

    python -m scripts.chat_sft --mixture=offline                  # anywhere, no downloads (the offline tasks)
    torchrun --standalone --nproc_per_node=8 -m scripts.chat_sft  # the real mixture (ARC, GSM8K, SmolTalk, ...)

Reads top to bottom like scripts/mid_train.py, and written the same way: 1 config, 2 compute, 3 the model
(the midtrained model, or the SFT checkpoint being resumed), 4 batch arithmetic, 5 optimizers, 6 resume,
7 data, 8 the training loop, 9 report. Every rank runs all of it; rank 0 prints and saves.

Batches. A micro-batch is `device_batch_size` conversations of this rank (rank r takes conversations r, r+W,
r+2W, ... of the shuffled mixture), each rendered with its training mask (only what the assistant writes is
trained on: its text, its tool calls and <|assistant_end|>; user turns and tool outputs are not), cut to
max_seq_len + 1 tokens, and padded to the longest row of the micro-batch with ignored targets (-1). A step is
`examples_per_step` conversations of all ranks together. The loss is the mean over every supervised token of
the step (nanochat/loss_eval.py), so a long answer weighs more than a short one, as in midtraining.
"""

import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from nanochat.checkpoint_manager import (check_data_settings, check_model_tag, check_tokenizer, checkpoint_dir_for,
                                         claim_checkpoint_dir, find_model_tag, load_checkpoint, load_model, model_from_state,
                                         open_metrics, save_checkpoint)
from nanochat.common import (EXIT_STOPPED_EARLY, StopRequest, UserError, autocast_dtype, autodetect_device_type, check_finite,
                             compute_cleanup, compute_init, gather_from_ranks, get_base_dir, get_peak_flops, init_wandb,
                             print0, print_banner)
from nanochat.configurator import check_config, configure
from nanochat.loss_eval import count_step_targets, evaluate_bpb, supervised_loss
from nanochat.report import get_report
from nanochat.schedules import muon_momentum
from nanochat.sharding import clip_grad_norm_, load_optimizer_shards, optimizer_shard
from nanochat.tokenizer import get_token_bytes, get_tokenizer

# -----------------------------------------------------------------------------
# 1. Config (override as --key=value; --help lists them)
run = "dummy"  # wandb run name ("dummy" = no wandb)
device_type = ""  # cuda | cpu | mps; empty = autodetect
source = "mid"  # which model to finetune: mid | base
model_tag = ""  # which model of that stage (needed only if there are several); also names chatsft_checkpoints/<tag>
step = -1  # which checkpoint step of the source model (-1 = the last)
num_iterations = -1  # optimizer steps; -1 = one epoch of the training mixture
max_seq_len = 2048  # tokens per row: longer conversations are cut (and counted)
device_batch_size = 4  # conversations per forward/backward per rank
examples_per_step = 32  # conversations per optimizer step, all ranks and micro-steps together
unembedding_lr = 0.004  # AdamW lr of lm_head
embedding_lr = 0.2  # AdamW lr of the token embedding
matrix_lr = 0.02  # Muon lr of the transformer matrices
init_lr_frac = 0.02  # every lr is multiplied by this: finetuning starts low, then decays linearly to 0
weight_decay = 0.0  # AdamW weight decay
grad_clip = 1.0  # clip the global gradient norm to this (0 = off)
eval_every = 100  # steps between validation evaluations (<= 0: only at the start and the end)
eval_tokens = -1  # validation rows x tokens per evaluation, all ranks together (-1 = 20 steps of rows x max_seq_len)
eval_metrics_every = 200  # steps between multiple-choice evaluations (<= 0: only at the end)
eval_metrics_max_problems = 256  # problems per multiple-choice task in those evaluations (-1 = all)
save_every = -1  # steps between checkpoints (<= 0: only the final one)
resume_from_step = -1  # resume from this step's checkpoint in chatsft_checkpoints/<model_tag> (-1 = start from the source)
overwrite = False  # a fresh run into a model_tag that holds SFT checkpoints deletes them (default: refuse)
compile = "auto"  # torch.compile the model: auto (= off: rows have a different length every micro-batch) | true | false
mixture = "real"  # real (ARC, GSM8K, SmolTalk, identity, spelling; downloads) | offline (the offline tasks, no downloads)
identity_file = ""  # JSONL of identity conversations for the real mixture ("" = generate the built-in ones)
max_conversations = -1  # use only the first N conversations of the training mixture (-1 = all); for quick runs
dry_run = False  # run everything but write no checkpoint and no report
config = configure(globals())
check_config(config, positive=["max_seq_len", "device_batch_size", "examples_per_step", "init_lr_frac"],
             positive_or_unset=["num_iterations", "eval_tokens", "max_conversations", "eval_metrics_max_problems"],
             non_negative=["embedding_lr", "unembedding_lr", "matrix_lr", "weight_decay", "grad_clip"],
             choices={"device_type": ("", "cuda", "cpu", "mps"), "compile": ("auto", "true", "false"),
                      "mixture": ("real", "offline"), "source": ("mid", "base")})
if resume_from_step < -1:
    raise UserError(f"--resume_from_step must be a checkpoint's step, or -1 to start from the {source} model, got {resume_from_step}")
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
wandb_run = init_wandb(run, master_process, config, project="nanochat-sft")

# -----------------------------------------------------------------------------
# 3. The model: the midtrained (or base) model for a fresh run, this stage's checkpoint for a resumed one
if resume_from_step < 0:
    model, tokenizer, source_meta = load_model(source, device, phase="train", model_tag=model_tag or None, step=step)
    model_tag = source_meta["model_tag"]  # the finetuned model keeps the tag of the model it started from
    parent = dict(source=source, model_tag=model_tag, step=source_meta["step"])
else:
    model_tag = model_tag or find_model_tag(os.path.join(get_base_dir(), "chatsft_checkpoints"), "python -m scripts.chat_sft")
    tokenizer = get_tokenizer()
checkpoint_dir = checkpoint_dir_for("sft", model_tag)
if not dry_run:  # this run owns chatsft_checkpoints/<model_tag> until it ends (see claim_checkpoint_dir)
    claim_checkpoint_dir(checkpoint_dir, resume_from_step, overwrite)
start_step, loop_state, data_state = 0, {}, None
if resume_from_step >= 0:
    model_state, optim_shards, meta = load_checkpoint(checkpoint_dir, resume_from_step, device, load_optimizer=True)
    where = f"checkpoint of step {resume_from_step} in {checkpoint_dir}"
    check_tokenizer(meta, tokenizer, where)
    model = model_from_state(model_state, meta, device, where)
    parent, start_step, loop_state, data_state = meta["parent"], resume_from_step, meta["loop_state"], meta["data_state"]
    del model_state
orig_model = model  # the uncompiled model: for saving and evaluation
if compile == "true":  # every micro-batch has its own row length: compile for dynamic shapes
    model = torch.compile(model, dynamic=True)
if max_seq_len > orig_model.rotary_len:
    raise UserError(f"--max_seq_len={max_seq_len} is beyond the model's rotary table ({orig_model.rotary_len} positions): "
                    f"use at most {orig_model.rotary_len}")
token_bytes = get_token_bytes(device=device)

# -----------------------------------------------------------------------------
# 4. Batch arithmetic: x, y = next(train_loader) is (device_batch_size, longest row) on EACH rank
if examples_per_step % (device_batch_size * ddp_world_size) != 0:
    per_micro = device_batch_size * ddp_world_size
    raise UserError(f"examples_per_step {examples_per_step} is not a multiple of device_batch_size x world_size = "
                    f"{device_batch_size} x {ddp_world_size} = {per_micro}; try --examples_per_step="
                    f"{max(per_micro, examples_per_step // per_micro * per_micro)}")
grad_accum_steps = examples_per_step // (device_batch_size * ddp_world_size)
print0(f"Conversations / micro-batch / rank: {device_batch_size} (rows padded to the longest, at most {max_seq_len} tokens)")
print0(f"Conversations / micro-batch (all {ddp_world_size} ranks): {device_batch_size * ddp_world_size}")
print0(f"Examples per step {examples_per_step} => gradient accumulation steps: {grad_accum_steps}")

# -----------------------------------------------------------------------------
# 5. Optimizers: Muon for the block matrices, AdamW for embedding and head (see GPT.setup_optimizers), at a
# fraction of the pretraining learning rates
optimizers = orig_model.setup_optimizers(unembedding_lr=unembedding_lr, embedding_lr=embedding_lr,
                                         matrix_lr=matrix_lr, weight_decay=weight_decay)
adamw_optimizer, muon_optimizer = optimizers
for opt in optimizers:
    for group in opt.param_groups:
        group["lr"] = group["initial_lr"] = group["lr"] * init_lr_frac

# -----------------------------------------------------------------------------
# 6. Resume: the optimizer state of every rank that saved, checks that the data would continue the same way
# What decides which conversations step N reads (the world size too: rank r reads r, r+W, r+2W, ...)
data_settings = dict(mixture=mixture, max_conversations=max_conversations, device_batch_size=device_batch_size,
                     examples_per_step=examples_per_step, max_seq_len=max_seq_len, world_size=ddp_world_size)
if resume_from_step >= 0:
    check_data_settings(meta["data_settings"], data_settings, where)
    load_optimizer_shards(optimizers, orig_model, optim_shards, where)
    del optim_shards
    print0(f"Resumed from step {start_step} of {checkpoint_dir}")

# -----------------------------------------------------------------------------
# 7. Data: a deterministic shuffled mixture of conversations. No silent fallback from one mixture to the other.
if mixture == "real":
    from tasks.arc import ARC
    from tasks.common import TaskMixture
    from tasks.customjson import CustomJSON
    from tasks.gsm8k import GSM8K
    from tasks.identity import write_identity_jsonl
    from tasks.mmlu import MMLU
    from tasks.smoltalk import SmolTalk
    from tasks.spellingbee import SimpleSpelling, SpellingBee
    identity_path = identity_file or write_identity_jsonl(os.path.join(get_base_dir(), "identity_conversations.jsonl"))
    train_dataset = TaskMixture([
        ARC(subset="ARC-Easy", split="train"),  # 2.3K multiple-choice science questions
        ARC(subset="ARC-Challenge", split="train"),  # 1.1K harder ones
        GSM8K(subset="main", split="train"),  # 8K math problems with calculator tool calls
        SmolTalk(split="train", stop=10_000),  # 10K general conversations
        CustomJSON(identity_path),  # who am I
        SimpleSpelling(split="train", size=300), SpellingBee(split="train", size=300),  # spelling and letter counting
    ])
    val_dataset = SmolTalk(split="test")
    metric_tasks = {"MMLU": MMLU(subset="all", split="test"), "ARC-Easy": ARC(subset="ARC-Easy", split="test")}
else:
    from tasks.offline import offline_mixture
    from tasks.pydocs_chat import PydocsMC
    train_dataset, val_dataset = offline_mixture("train"), offline_mixture("test")
    metric_tasks = {"PydocsMC": PydocsMC(split="test", step=8)}
train_size = len(train_dataset) if max_conversations < 0 else min(max_conversations, len(train_dataset))
print0(f"Mixture {mixture}: {train_size:,} training conversations (of {len(train_dataset):,}), {len(val_dataset):,} validation")

epoch_done = False  # set when this rank's train generator wraps around (one epoch done); used if num_iterations is -1
train_stats = {"read": 0, "cut": 0}  # what this rank read: conversations, and how many were cut at max_seq_len + 1
train_cursor = ddp_rank  # the next training conversation of this rank (for resume)


def sft_data_generator(split, cursor):
    """
    Micro-batches of `device_batch_size` whole conversations of THIS rank, forever: rank r reads conversations
    r, r + world_size, ... Each row is one conversation (rendered with its mask, at most max_seq_len + 1
    tokens), padded with <|assistant_end|> to the longest row; targets are the next tokens where the mask is
    1 and -1 elsewhere (the padding, user turns, tool outputs). Where the next batch starts is `train_cursor`.
    """
    global epoch_done, train_cursor
    dataset = train_dataset if split == "train" else val_dataset
    dataset_size = train_size if split == "train" else len(dataset)
    pad = tokenizer.encode_special("<|assistant_end|>")
    while True:
        rows = []
        for _ in range(device_batch_size):
            ids, mask = tokenizer.render_conversation(dataset[cursor], max_tokens=10**9)
            if split == "train":
                train_stats["read"] += 1
                train_stats["cut"] += len(ids) > max_seq_len + 1
            rows.append((ids[:max_seq_len + 1], mask[:max_seq_len + 1]))
            cursor += ddp_world_size
            if cursor >= dataset_size:
                cursor -= dataset_size  # wrap around: the next epoch
                if split == "train":
                    epoch_done = True
        width = max(len(ids) for ids, _ in rows) - 1
        inputs = torch.full((device_batch_size, width), pad, dtype=torch.long)
        targets = torch.full((device_batch_size, width), -1, dtype=torch.long)
        for r, (ids, mask) in enumerate(rows):
            row = torch.tensor(ids, dtype=torch.long)
            inputs[r, :len(ids) - 1] = row[:-1]
            targets[r, :len(ids) - 1] = torch.where(torch.tensor(mask[1:], dtype=torch.bool), row[1:], -1)
        if split == "train":
            train_cursor = cursor
        yield inputs.to(device, torch.int32), targets.to(device)


if data_state is not None:  # continue exactly where the checkpoint's run was
    train_stats, epoch_done, train_cursor = data_state["stats"][ddp_rank], data_state["epoch_done"], data_state["cursors"][ddp_rank]
train_loader = sft_data_generator("train", train_cursor)
eval_steps = max(1, (eval_tokens if eval_tokens > 0 else 20 * examples_per_step * max_seq_len)
                 // (device_batch_size * max_seq_len * ddp_world_size))
peak_flops, peak_source = get_peak_flops(device, compute_dtype)
stop_request = StopRequest(ddp_rank)  # SIGTERM / Ctrl-C: finish the step, save, exit (see StopRequest)
metrics_path, log_metrics = open_metrics(checkpoint_dir, start_step, enabled=master_process and not dry_run)
last_saved_step = start_step if resume_from_step >= 0 else None


def fetch_step():
    """The step's micro-batches, fetched before it runs (its targets are counted before the first backward);
    also where they start and what had been read before them (a checkpoint saves both)."""
    cursor, stats = train_cursor, dict(train_stats)
    return [next(train_loader) for _ in range(grad_accum_steps)], cursor, stats


def evaluate_metrics():
    """Multiple-choice accuracy (no sampling) on the first eval_metrics_max_problems problems of each task,
    the problems shared among the ranks: the same scores as one process."""
    from scripts.chat_eval import score_categorical
    out = {}
    orig_model.eval()
    for name, task in metric_tasks.items():
        count = len(task) if eval_metrics_max_problems < 0 else min(eval_metrics_max_problems, len(task))
        with autocast_ctx:
            outcomes = score_categorical(orig_model, tokenizer, task, list(range(ddp_rank, count, ddp_world_size)), 8, device)
        counts = torch.tensor([sum(passed for passed, _ in outcomes), len(outcomes)], dtype=torch.float64, device=device)
        if ddp:
            dist.all_reduce(counts)
        out[name] = counts[0].item() / max(counts[1].item(), 1)
    orig_model.train()
    return out


def save(step):
    # every rank saves its optimizer shard; rank 0 the weights; the data position of every rank goes in the meta
    global last_saved_step
    if not all(torch.isfinite(p).all() for p in orig_model.parameters()):  # never save a diverged model
        raise UserError(f"step {step}: the weights are not finite; nothing saved (the last checkpoint is step {last_saved_step})")
    data_state = dict(cursors=gather_from_ranks(next_step_cursor), stats=gather_from_ranks(next_step_stats),
                      epoch_done=any_epoch_done)
    save_checkpoint(checkpoint_dir, step, orig_model.state_dict(), optimizer_shard(optimizers, orig_model), dict(
        model_config=orig_model.config.to_dict(), user_config=config, val_bpb=val_bpb, parent=parent,
        tokenizer=dict(fingerprint=tokenizer.fingerprint(), vocab_size=tokenizer.get_vocab_size()),
        data_settings=data_settings, data_state=data_state,
        loop_state=dict(smooth_train_loss=smooth_train_loss, total_training_time=total_training_time,
                        first_val_bpb=first_val_bpb, num_iterations=num_iterations),
    ), rank=ddp_rank)
    last_saved_step = step


# -----------------------------------------------------------------------------
# 8. The training loop: the same two-level loop as base_train and mid_train
step_batches, next_step_cursor, next_step_stats = fetch_step()
x, y = step_batches[0]
print(f"[rank {ddp_rank}] x, y = next(train_loader): x {tuple(x.shape)} {x.dtype}, y {tuple(y.shape)} {y.dtype}, "
      f"{100 * (y == -1).float().mean().item():.0f}% of targets -1 (padding, user turns, tool outputs)", flush=True)
smooth_train_loss = loop_state.get("smooth_train_loss", 0.0)  # EMA of the global train loss
total_training_time = loop_state.get("total_training_time", 0.0)  # seconds, excluding the first steps
first_val_bpb = loop_state.get("first_val_bpb")
val_bpb, metrics, ema_beta = None, {}, 0.9
step, stop_now, any_epoch_done = start_step, False, epoch_done
while True:
    # All ranks stop together (see mid_train): after num_iterations steps, after one epoch, or when asked to
    last_step = (step >= num_iterations if num_iterations > 0 else any_epoch_done) or stop_now

    # The final checkpoint comes first, so a crash in the final evaluations loses nothing.
    if not dry_run and (last_step or (save_every > 0 and step > start_step and step % save_every == 0)):
        save(step)

    if last_step or (eval_every > 0 and step % eval_every == 0) or step == start_step:
        model.eval()
        with autocast_ctx:
            val_bpb = evaluate_bpb(model, sft_data_generator("val", ddp_rank), eval_steps, token_bytes)
        model.train()
        first_val_bpb = val_bpb if first_val_bpb is None else first_val_bpb
        print0(f"Step {step:05d} | validation bpb: {val_bpb:.4f}{f' (the {source} model, before SFT)' if step == 0 else ''}")
        wandb_run.log({"step": step, "val/bpb": val_bpb})
        log_metrics(step=step, val_bpb=val_bpb)

    if last_step or (eval_metrics_every > 0 and step > 0 and step % eval_metrics_every == 0):
        metrics = evaluate_metrics()
        print0(f"Step {step:05d} | " + " | ".join(f"{name} accuracy: {acc:.4f}" for name, acc in metrics.items()))
        wandb_run.log({"step": step, **{f"val/{name}": acc for name, acc in metrics.items()}})
        log_metrics(step=step, **{f"acc_{name}": acc for name, acc in metrics.items()})

    if last_step:
        break

    # ---- one optimizer step ----
    synchronize()
    t0 = time.time()
    # The loss is the mean over ALL supervised targets of the step: count them first (one all_reduce), then
    # each micro-step backpropagates its loss sum scaled by world_size / that count (nanochat/loss_eval.py).
    rank_targets, step_targets = count_step_targets(step_batches, ddp_rank, ddp_world_size)
    step_loss_sum = torch.zeros((), device=device)
    for micro_step in range(grad_accum_steps):
        x, y = step_batches[micro_step]
        with autocast_ctx:
            loss, loss_sum = supervised_loss(model, x, y, step_targets, ddp_world_size)
        step_loss_sum += loss_sum
        loss.backward()
    step_batches, next_step_cursor, next_step_stats = fetch_step()  # the next step's data, while the device works
    # Gradients are averaged across ranks in clip_grad_norm_ (clipping on) or in opt.step() (off): see base_train
    grad_norm = clip_grad_norm_(optimizers, grad_clip) if grad_clip > 0 else None
    progress = step / num_iterations if num_iterations > 0 else train_cursor / train_size
    lrm = max(0.0, 1.0 - progress)  # linear decay to 0 over the run
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lrm
    momentum = muon_momentum(step)  # new optimizers, zero momentum buffers: the same warm-up as pretraining
    for group in muon_optimizer.param_groups:
        group["momentum"] = momentum
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)
    # One all_reduce at the end of the step: every rank's loss sum (slot r = rank r), the stop flag, the epoch flag
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
    train_loss = sum(rank_loss_sums) / max(step_targets, 1)  # the mean over every supervised target of the step
    rank_losses = [loss_sum / max(n, 1) for loss_sum, n in zip(rank_loss_sums, rank_targets)]
    grad_norm_value = grad_norm.item() if grad_norm is not None else None
    check_finite(step, train_loss, grad_norm_value, last_saved_step, ["matrix_lr", "embedding_lr", "unembedding_lr", "init_lr_frac"])
    smooth_train_loss = ema_beta * smooth_train_loss + (1 - ema_beta) * train_loss
    debiased_loss = smooth_train_loss / (1 - ema_beta ** step)  # the EMA starts at 0: undo that bias
    if step - start_step > 10:
        total_training_time += dt
    grad_text = f"{grad_norm_value:.4f}" if grad_norm_value is not None else "n/a (no clipping)"
    progress_done = step / num_iterations if num_iterations > 0 else train_cursor / train_size  # after this step (progress above: before it, for the lr)
    print0(f"step {step:05d} ({100 * progress_done:.2f}%) | loss (EMA): {debiased_loss:.6f} | step loss ({step_targets:,.0f} "
           f"targets, {ddp_world_size} rank(s)): {train_loss:.6f} | lrm: {lrm:.2f} | muon momentum: {momentum:.3f} "
           f"| grad norm (before clip): {grad_text} | dt: {dt * 1000:.2f}ms | total time: {total_training_time / 60:.2f}m")
    wandb_run.log({"step": step, "total_training_time": total_training_time, "train/loss": debiased_loss,
                   "train/step_loss": train_loss, "train/lrm": lrm, "train/muon_momentum": momentum,
                   "train/grad_norm": grad_norm_value, "train/dt": dt})
    log_metrics(step=step, loss=debiased_loss, step_loss=train_loss, rank_losses=rank_losses, targets=step_targets, lrm=lrm,
                grad_norm=grad_norm_value, dt=dt)

# -----------------------------------------------------------------------------
# 9. Report
per_rank = gather_from_ranks(train_stats)
read, cut = sum(s["read"] for s in per_rank), sum(s["cut"] for s in per_rank)
print0(f"Read {read:,} training conversations on {ddp_world_size} rank(s); {cut} were longer than max_seq_len + 1 "
       f"tokens and cut")
print0(f"Validation bpb: {first_val_bpb:.4f} (before SFT) -> {val_bpb:.4f} (after {step} steps)")
stopped_early = stop_now and not (step >= num_iterations if num_iterations > 0 else any_epoch_done)
if not dry_run:
    get_report().log(section="Chat SFT", data=[
        config,
        {"Number of iterations": step, "Stopped early": stopped_early, "Mixture": mixture, "Training conversations": train_size,
         "Gradient accumulation steps": grad_accum_steps, "World size": ddp_world_size,
         "Validation bpb before SFT": first_val_bpb, "Final validation bpb": val_bpb,
         **{f"{name} accuracy": acc for name, acc in metrics.items()},
         "Conversations cut at max_seq_len": cut, "Total training time (min)": total_training_time / 60,
         "Metrics file": metrics_path},
    ])
wandb_run.finish()
compute_cleanup()
if stopped_early:
    print0(f"Stopped at step {step} on request. Continue with the same command plus --resume_from_step={step} "
           f"(exit code {EXIT_STOPPED_EARLY}: not finished)")
    sys.exit(EXIT_STOPPED_EARLY)
eval_args, rl_args = (" -a offline", " --mixture=offline") if mixture == "offline" else ("", "")
print0(f"Next: python -m scripts.chat_eval -i sft{eval_args}, then python -m scripts.chat_rl{rl_args} (or talk to it: python -m scripts.chat_cli)")
