"""
Pretrain the base model: next-token prediction on the pretraining corpus.

    # one GPU, a CPU, or a Mac: a few minutes, shows the whole flow
    python -m scripts.base_train --depth=4 --max_seq_len=512 --device_batch_size=1 --total_batch_size=512 --num_iterations=20
    # one 8-GPU node (one process per GPU)
    torchrun --standalone --nproc_per_node=8 -m scripts.base_train --depth=20

The file reads top to bottom: 1 config, 2 compute, 3 model, 4 training horizon, 5 batch arithmetic,
6 optimizers and data, 7 resume, 8 the training loop (evaluate / sample / save, then the two-level
step + micro-step loop, then logging), 9 report. Every process of a torchrun launch runs all of it;
rank 0 (the "master process") alone prints, logs to wandb and writes the report.
"""

import json
import os
import signal
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from nanochat.checkpoint_manager import load_checkpoint, save_checkpoint
from nanochat.common import (UserError, autocast_dtype, autodetect_device_type, compute_cleanup, compute_init,
                             get_base_dir, get_peak_flops, grad_accum_steps_for, init_wandb, print0, print_banner)
from nanochat.configurator import configure
from nanochat.dataloader import tokenizing_distributed_data_loader
from nanochat.gpt import GPT, clip_grad_norm_, config_from_depth
from nanochat.loss_eval import evaluate_bpb
from nanochat.report import get_report
from nanochat.schedules import lr_multiplier, muon_momentum
from nanochat.tokenizer import get_token_bytes, get_tokenizer

t_script_start = time.time()

# -----------------------------------------------------------------------------
# 1. Config: every variable here can be overridden as --key=value (python -m scripts.base_train --help)
run = "dummy"  # wandb run name ("dummy" = no wandb)
device_type = ""  # cuda | cpu | mps; empty = autodetect
# model
depth = 20  # the one size dial: width 64*depth, heads of 128
max_seq_len = 2048  # tokens per row (context length)
# training horizon: the first of these that is > 0 decides the number of optimizer steps
num_iterations = -1  # explicit number of steps
target_flops = -1.0  # total training FLOPs to spend (steps = target_flops / (6N+attn) / total_batch_size)
target_param_data_ratio = 20  # Chinchilla-style tokens:params ratio (20 = compute-optimal)
# batch
device_batch_size = 32  # rows per forward/backward per rank (lower it if you run out of memory)
total_batch_size = 524288  # tokens per optimizer step, all ranks and micro-steps together
# optimization
embedding_lr = 0.2  # AdamW lr of the token embedding
unembedding_lr = 0.004  # AdamW lr of lm_head
matrix_lr = 0.02  # Muon lr of the transformer matrices
weight_decay = 0.0  # AdamW weight decay (embedding, lm_head)
grad_clip = 1.0  # clip the global gradient norm to this (0 = off)
warmup_ratio = 0.0  # fraction of steps of linear lr warmup
warmdown_ratio = 0.2  # fraction of steps of linear lr decay at the end
final_lr_frac = 0.0  # lr multiplier at the very end of the warmdown
# evaluation and output (every <= 0 turns a periodic action off; the final eval and checkpoint always happen)
eval_every = 250  # steps between val bits-per-byte evaluations
eval_tokens = -1  # val tokens per evaluation, all ranks together (-1 = 20 x total_batch_size)
core_metric_every = 2000  # steps between CORE evaluations
core_metric_max_per_task = 500  # examples per CORE task
sample_every = 2000  # steps between printed samples
save_every = -1  # steps between checkpoints
resume_from_step = -1  # resume from this step's checkpoint of model_tag (-1 = start fresh)
model_tag = ""  # checkpoint directory name under base_checkpoints/ (default d<depth>)
compile = "auto"  # torch.compile the model: auto (= on for CUDA, off for CPU/MPS) | true | false
data_seed = 0  # seeds the per-epoch shuffle of the training data order
bos_aligned = False  # start every row at a document start (crops documents; reports the tokens dropped)
config = configure(globals())

# -----------------------------------------------------------------------------
# 2. Compute: one process per device; torchrun sets RANK / LOCAL_RANK / WORLD_SIZE
print_banner()
device_type = device_type or autodetect_device_type()
ddp, ddp_rank, ddp_local_rank, ddp_world_size, device = compute_init(device_type)
master_process = ddp_rank == 0  # prints, logs to wandb, writes the report
compute_dtype = autocast_dtype(device_type)  # bf16 on modern GPUs, fp32 on CPU/MPS
autocast_ctx = torch.amp.autocast(device_type=device_type, dtype=compute_dtype) if compute_dtype != torch.float32 else nullcontext()
synchronize = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
wandb_run = init_wandb(run, master_process, config)
print0(f"Compute dtype: {str(compute_dtype).removeprefix('torch.')} (weights and optimizer state stay fp32)")

# -----------------------------------------------------------------------------
# 3. Tokenizer and model
tokenizer = get_tokenizer()
token_bytes = get_token_bytes(device=device)
vocab_size = tokenizer.get_vocab_size()
model_config = config_from_depth(depth, vocab_size=vocab_size, sequence_len=max_seq_len)
print0(f"Model: depth {depth} -> n_embd {model_config.n_embd}, {model_config.n_head} heads of "
       f"{model_config.n_embd // model_config.n_head}, vocab {vocab_size:,}, context {max_seq_len}")
with torch.device("meta"):  # build without allocating, then materialise on the device and initialise once
    model = GPT(model_config)
model.to_empty(device=device)
model.init_weights()  # identical on every rank: compute_init seeded every rank the same
orig_model = model  # the uncompiled model: for saving, sampling, and evaluation at other shapes
if compile not in ("auto", "true", "false"):
    raise UserError(f"--compile must be auto, true or false, got {compile!r}")
use_compile = compile == "true" or (compile == "auto" and device_type == "cuda")
if use_compile:
    model = torch.compile(model, dynamic=False)
num_params = orig_model.num_params()
flops_per_token = orig_model.estimate_flops()
print0(f"Parameters: {num_params:,} | FLOPs per token (6N + attention): {flops_per_token:.3e} | torch.compile: {use_compile}")

# -----------------------------------------------------------------------------
# 4. Training horizon: how many optimizer steps
if num_iterations > 0:
    horizon = f"num_iterations={num_iterations}"
elif target_flops > 0:
    num_iterations = round(target_flops / (flops_per_token * total_batch_size))
    horizon = f"target_flops={target_flops:.3e}"
elif target_param_data_ratio > 0:
    # Chinchilla: compute-optimal training sees ~20 tokens per parameter
    num_iterations = (target_param_data_ratio * num_params) // total_batch_size
    horizon = f"target_param_data_ratio={target_param_data_ratio}"
else:
    raise UserError("no training horizon: set one of --num_iterations, --target_flops, --target_param_data_ratio to a value > 0")
if num_iterations < 1:
    raise UserError(f"{horizon} gives {num_iterations} steps at total_batch_size={total_batch_size:,}: set --num_iterations or a larger target")
total_tokens = total_batch_size * num_iterations
print0(f"Training horizon from {horizon}: {num_iterations:,} steps")
print0(f"Training tokens: {total_tokens:,} | tokens:params ratio {total_tokens / num_params:.2f} | "
       f"total training FLOPs {flops_per_token * total_tokens:.3e}")

# -----------------------------------------------------------------------------
# 5. Batch arithmetic. One micro-step = one forward/backward of device_batch_size rows on every rank at once.
# Micro-steps are repeated (gradient accumulation) until total_batch_size tokens have been seen, then the
# optimizer takes one step.
tokens_per_fwdbwd = device_batch_size * max_seq_len  # one rank, one micro-step
world_tokens_per_fwdbwd = tokens_per_fwdbwd * ddp_world_size  # all ranks, one micro-step
grad_accum_steps = grad_accum_steps_for(total_batch_size, device_batch_size, max_seq_len, ddp_world_size)  # or a clear error
print0(f"Tokens / micro-batch / rank: {device_batch_size} x {max_seq_len} = {tokens_per_fwdbwd:,}")
print0(f"Tokens / micro-batch (all {ddp_world_size} ranks): {world_tokens_per_fwdbwd:,}")
print0(f"Total batch size {total_batch_size:,} => gradient accumulation steps: {grad_accum_steps}")

# -----------------------------------------------------------------------------
# 6. Optimizers and data
optimizers = orig_model.setup_optimizers(unembedding_lr=unembedding_lr, embedding_lr=embedding_lr,
                                         matrix_lr=matrix_lr, weight_decay=weight_decay)
adamw_optimizer, muon_optimizer = optimizers
model_tag = model_tag or f"d{depth}"
checkpoint_dir = os.path.join(get_base_dir(), "base_checkpoints", model_tag)

# 7. Resume: weights, this rank's optimizer shard, the data position and the loop state of step N
start_step, loop_state, loader_state = 0, {}, None
if resume_from_step >= 0:
    model_state, optim_states, meta = load_checkpoint(checkpoint_dir, resume_from_step, device,
                                                      load_optimizer=True, rank=ddp_rank)
    if meta["world_size"] != ddp_world_size:
        raise UserError(f"checkpoint of step {resume_from_step} was written by {meta['world_size']} process(es), this run has "
                        f"{ddp_world_size}: optimizer state is sharded per rank, resume with the same --nproc_per_node")
    if meta["model_config"] != model_config.to_dict():
        raise UserError(f"checkpoint model config {meta['model_config']} differs from this run's {model_config.to_dict()}")
    orig_model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in model_state.items()})
    for opt, state in zip(optimizers, optim_states):
        opt.load_state_dict(state)
    start_step, loop_state, loader_state = resume_from_step, meta["loop_state"], meta["dataloader_state"]
    del model_state, optim_states
    print0(f"Resumed from step {start_step} of {checkpoint_dir}")

train_loader = tokenizing_distributed_data_loader(device_batch_size, max_seq_len, "train", device, tokenizer=tokenizer,
                                                  total_batch_size=total_batch_size, seed=data_seed,
                                                  resume_state=loader_state, bos_aligned=bos_aligned)
build_val_loader = lambda: tokenizing_distributed_data_loader(device_batch_size, max_seq_len, "val", device, tokenizer=tokenizer)
eval_tokens = eval_tokens if eval_tokens > 0 else 20 * total_batch_size
eval_steps = max(1, eval_tokens // world_tokens_per_fwdbwd)
x, y = next(train_loader)  # the first micro-batch; from now on the next one is fetched right after each backward

# Stop cleanly on SIGTERM / Ctrl-C: finish the current step, save a checkpoint, exit. A second signal kills.
# The signal may reach the ranks at different moments, so a rank only records it (stop_signal); the ranks
# agree on stopping through the all_reduce at the end of each step (stop_now), and all stop at the same step.
stop_signal, stop_now = False, False


def request_stop(signum, frame):
    global stop_signal
    print(f"[rank {ddp_rank}] got {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
          f"(send it again to quit at once)", flush=True)
    stop_signal = True
    signal.signal(signum, signal.SIG_DFL)


signal.signal(signal.SIGTERM, request_stop)
signal.signal(signal.SIGINT, request_stop)

# metrics of every step, one JSON line each, for the report's training curves (rank 0 only)
metrics_path = os.path.join(get_base_dir(), "report", "base-train-metrics.jsonl")
if master_process:
    os.makedirs(os.path.dirname(metrics_path), exist_ok=True)
    kept = []
    if start_step > 0 and os.path.exists(metrics_path):  # a resumed run continues the curve of its first run
        with open(metrics_path) as f:  # train rows up to the resumed step; evaluations before it (it re-evaluates)
            rows = [(line, json.loads(line)) for line in f]
        kept = [line for line, r in rows if r["step"] < start_step or (r["step"] == start_step and "val_bpb" not in r)]
    with open(metrics_path, "w") as f:
        f.writelines(kept)


def log_metrics(**metrics):
    if master_process:
        with open(metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")


def save(step):
    # every rank saves its optimizer shard; rank 0 the weights; the data position of all ranks goes in the meta
    loader_states = [None] * ddp_world_size
    if ddp:
        dist.all_gather_object(loader_states, train_loader.state_dict())
    else:
        loader_states = [train_loader.state_dict()]
    merged = dict(loader_states[0], slots={k: v for s in loader_states for k, v in s["slots"].items()})
    save_checkpoint(checkpoint_dir, step, orig_model.state_dict(), [opt.state_dict() for opt in optimizers], dict(
        model_config=model_config.to_dict(), user_config=config, val_bpb=val_bpb, dataloader_state=merged,
        device_batch_size=device_batch_size, max_seq_len=max_seq_len, total_batch_size=total_batch_size,
        loop_state=dict(smooth_train_loss=smooth_train_loss, total_training_time=total_training_time,
                        min_val_bpb=min_val_bpb, num_iterations=num_iterations),
    ), rank=ddp_rank)


# -----------------------------------------------------------------------------
# 8. The training loop. Outer loop: one optimizer step per iteration. Inner loop: grad_accum_steps
# micro-steps of forward + backward whose gradients add up in .grad.
peak_flops, peak_source = get_peak_flops(device, compute_dtype)
print0(f"Peak FLOP/s for MFU: {peak_flops:.3e} per device ({peak_source})")
smooth_train_loss = loop_state.get("smooth_train_loss", 0.0)  # EMA of the global train loss
total_training_time = loop_state.get("total_training_time", 0.0)  # seconds, excluding the first (compile) steps
min_val_bpb = loop_state.get("min_val_bpb", float("inf"))
val_bpb = None
ema_beta = 0.9
mfus, step_dt, first_step_time = [], 0.0, None
sample_prompts = ["The capital of France is", "The chemical symbol of gold is", "If yesterday was Friday, then tomorrow will be",
                  "The opposite of hot is", "The planets of the solar system are:", "My favorite color is", "If 5*x + 3 = 13, then x is"]
step = start_step
while True:
    last_step = step == num_iterations or stop_now
    flops_so_far = flops_per_token * total_batch_size * step

    # The final checkpoint comes first, so a crash in the final evaluations loses nothing.
    if last_step or (save_every > 0 and step > start_step and step % save_every == 0):
        save(step)

    # Validation bits per byte (loss per byte of text, comparable across tokenizers)
    if last_step or (eval_every > 0 and step % eval_every == 0):
        model.eval()
        with autocast_ctx:
            val_bpb = evaluate_bpb(model, build_val_loader(), eval_steps, token_bytes)
        model.train()
        min_val_bpb = min(min_val_bpb, val_bpb)
        print0(f"Step {step:05d} | validation bpb: {val_bpb:.4f}")
        wandb_run.log({"step": step, "total_training_flops": flops_so_far, "total_training_time": total_training_time, "val/bpb": val_bpb})
        log_metrics(step=step, val_bpb=val_bpb)

    if last_step or (core_metric_every > 0 and step % core_metric_every == 0):
        print0(f"Step {step:05d} | CORE metric: skipped (the CORE evaluation arrives with the evaluation stage)")

    # Samples: look at what the model writes, a check no loss number gives (rank 0, uncompiled model)
    if master_process and (last_step or (sample_every > 0 and step > 0 and step % sample_every == 0)):
        orig_model.eval()
        for prompt in sample_prompts:
            with autocast_ctx:
                ids = list(orig_model.generate(tokenizer.encode(prompt, prepend=tokenizer.get_bos_token_id()), max_tokens=16, temperature=0))
            print0(f"  sample: {prompt!r} -> {tokenizer.decode(ids)!r}")
        orig_model.train()

    if last_step:
        break

    # ---- one optimizer step ----
    synchronize()
    t0 = time.time()
    step_loss = torch.zeros((), device=device)  # this rank's mean loss over its micro-steps, for logging
    for micro_step in range(grad_accum_steps):
        with autocast_ctx:
            loss = model(x, y)
        step_loss += loss.detach() / grad_accum_steps
        # .backward() ADDS into .grad, so grad_accum_steps backwards sum their gradients; dividing each loss
        # by grad_accum_steps turns that sum into the mean over the whole batch: the same gradient as one
        # forward/backward of all total_batch_size tokens at once.
        loss = loss / grad_accum_steps
        loss.backward()
        x, y = next(train_loader)  # fetch the next micro-batch while the device is still busy
    # Clip the gradient norm of the whole model, computed on the gradient averaged over all ranks, so every
    # rank scales by the same factor (with DistAdamW/DistMuon the averaging happens inside the optimizers).
    grad_norm = clip_grad_norm_(optimizers, grad_clip) if grad_clip > 0 else None
    lrm = lr_multiplier(step, num_iterations, warmup_ratio, warmdown_ratio, final_lr_frac)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lrm
    momentum = muon_momentum(step)
    for group in muon_optimizer.param_groups:
        group["momentum"] = momentum
    for opt in optimizers:
        opt.step()  # under torchrun this is where gradients are averaged across ranks (reduce_scatter)
    model.zero_grad(set_to_none=True)
    # The loss of this step over all ranks: slot r of the vector carries rank r's loss; one all_reduce gives
    # every rank every loss. The stop flag rides along, so all ranks stop at the same step.
    shared = torch.zeros(ddp_world_size + 1, device=device)
    shared[ddp_rank] = step_loss
    shared[-1] = float(stop_signal)
    if ddp:
        dist.all_reduce(shared)
    rank_losses = shared[:-1].tolist()
    stop_now = shared[-1].item() > 0
    synchronize()
    dt = time.time() - t0
    step += 1

    # ---- logging ----
    train_loss = sum(rank_losses) / ddp_world_size  # global loss: the mean over ranks
    smooth_train_loss = ema_beta * smooth_train_loss + (1 - ema_beta) * train_loss
    debiased_loss = smooth_train_loss / (1 - ema_beta ** step)  # the EMA starts at 0: undo that bias
    tok_per_sec = total_batch_size / dt  # tokens of ALL micro-steps of ALL ranks per second of step time
    mfu = 100 * flops_per_token * tok_per_sec / (peak_flops * ddp_world_size)
    if step - start_step > 10:  # the first steps include compilation and warm-up: keep them out of the time
        total_training_time += dt
        mfus.append(mfu)
    if first_step_time is None:
        first_step_time = time.time() - t_script_start  # start-up, data, compile and the first step
    grad_norm_value = grad_norm.item() if grad_norm is not None else float("nan")
    print0(f"step {step:05d}/{num_iterations:05d} ({100 * step / num_iterations:.2f}%) | loss: {debiased_loss:.6f} "
           f"(step {train_loss:.6f}, mean of {ddp_world_size} rank(s)) | lrm: {lrm:.2f} | muon momentum: {momentum:.3f} | grad norm: {grad_norm_value:.4f} | "
           f"dt: {dt * 1000:.2f}ms | tok/sec: {tok_per_sec:,.0f} | mfu: {mfu:.2f} | total time: {total_training_time / 60:.2f}m")
    wandb_run.log({"step": step, "total_training_flops": flops_per_token * total_batch_size * step,
                   "total_training_time": total_training_time, "train/loss": debiased_loss, "train/step_loss": train_loss,
                   "train/lrm": lrm, "train/grad_norm": grad_norm_value, "train/dt": dt, "train/tok_per_sec": tok_per_sec, "train/mfu": mfu})
    log_metrics(step=step, loss=debiased_loss, step_loss=train_loss, rank_losses=rank_losses, lrm=lrm,
                grad_norm=grad_norm_value, dt=dt, tok_per_sec=tok_per_sec, mfu=mfu)

# -----------------------------------------------------------------------------
# 9. Summary and report
if device_type == "cuda":
    peak_memory = f"{torch.cuda.max_memory_allocated() / 2**20:,.0f} MiB (CUDA, allocated)"
else:
    import resource
    peak_memory = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:,.0f} MiB (process RSS)"
stopped_early = step < num_iterations
print0(f"Peak memory: {peak_memory}")
print0(f"Total training time: {total_training_time / 60:.2f}m | min val bpb: {min_val_bpb:.4f}")
if stopped_early:
    print0(f"Stopped at step {step} on request; continue with --resume_from_step={step} (same other options)")
else:
    print0("Next: python -m scripts.base_loss (bpb on train/val and samples), then python -m scripts.mid_train")
get_report().log(section="Base model training", data=[
    config,
    {"Number of parameters": f"{num_params:,}", "FLOPs per token": f"{flops_per_token:e}",
     "Training horizon": horizon, "Calculated number of iterations": num_iterations,
     "Number of training tokens": f"{total_tokens:,}", "Tokens : Params ratio": f"{total_tokens / num_params:.2f}",
     "Tokens / micro-batch / rank": tokens_per_fwdbwd, "Tokens / micro-batch": world_tokens_per_fwdbwd,
     "Gradient accumulation steps": grad_accum_steps, "World size": ddp_world_size,
     "DDP": ddp, "Device": str(device), "Compute dtype": str(compute_dtype), "torch.compile": use_compile,
     "Total training FLOPs": f"{flops_per_token * total_tokens:e}"},
    {"Steps run": step, "Stopped early": stopped_early, "Minimum validation bpb": min_val_bpb, "Final validation bpb": val_bpb,
     "Final train loss (EMA)": smooth_train_loss / (1 - ema_beta ** max(step, 1)),
     "Average MFU (%)": sum(mfus) / len(mfus) if mfus else float("nan"), "Peak FLOP/s used for MFU": f"{peak_flops:.3e} ({peak_source})",
     "Total training time (min)": total_training_time / 60, "Time to first step (s)": first_step_time,
     "BOS-aligned rows, tokens dropped": f"{100 * train_loader.dropped_fraction():.2f}%" if bos_aligned else "n/a (packed stream)",
     "Peak memory": peak_memory},
])
wandb_run.finish()
compute_cleanup()
