r"""
Pretrain the base model: next-token prediction on the pretraining corpus.

    # one GPU, a CPU, or a Mac: a few minutes, shows the whole flow. It needs a corpus and a tokenizer: the offline
    # pydocs corpus and a small tokenizer (without NANOCHAT_DATASET=pydocs: FineWeb-Edu shards and the DCLM CORE bundle)
    NANOCHAT_DATASET=pydocs python -m nanochat.dataset
    NANOCHAT_DATASET=pydocs python -m scripts.tok_train --vocab_size=4096
    NANOCHAT_DATASET=pydocs python -m scripts.base_train --depth=4 --max_seq_len=512 --device_batch_size=1 \
        --total_batch_size=512 --num_iterations=20
    # one 8-GPU node (one process per GPU)
    torchrun --standalone --nproc_per_node=8 -m scripts.base_train --depth=20

Every process of a torchrun launch runs all of it; rank 0 (the "master process") alone prints, logs to wandb
and writes the report. What happens around the training loop (start or resume, save, stop, finish) is the
same in every training stage: nanochat/stage.py. The script, in its numbered blocks: 1 config, 2 compute, 3
tokenizer and model, 4 training horizon, 5 batch arithmetic, 6 checkpoint directory, optimizers and data, 7 the
training loop (steps of micro-steps: docs/training_loop.md), 8 summary and report.
"""

import math
import sys
import time

import psutil
import torch

from nanochat import attention_kernels
from nanochat.checkpoint_manager import check_model_tag
from nanochat.configurator import check_config, configure
from nanochat.core_eval import default_bundle_kind, evaluate_core, prepare_bundle
from nanochat.dataloader import grad_accum_steps_for, tokenizing_distributed_data_loader
from nanochat.dataset import dataset_name
from nanochat.engine import generate_naive
from nanochat.fp8 import fp8_supported
from nanochat.gpt import GPT, config_from_depth
from nanochat.hardware import autocast_context, compile_model, device_time, get_peak_flops
from nanochat.interrupt import Interrupted
from nanochat.losses import evaluate_bpb, smoothed_loss
from nanochat.optim import (EMBEDDING_WEIGHT_DECAY_BY_DEPTH, MATRIX_WEIGHT_DECAY_BY_DEPTH, decay_by_depth,
                            lr_multiplier, muon_momentum, step_optimizers)
from nanochat.output import UserError, format_value, print0
from nanochat.processes import autodetect_device_type
from nanochat.ranks import per_rank
from nanochat.stage import Stage, stage_settings
from nanochat.tokenizer import get_token_bytes, get_tokenizer

# -----------------------------------------------------------------------------
# 1. Config: every variable here can be overridden as --key=value (python -m scripts.base_train --help), and so can
# the settings every training stage takes: the wandb run, the device, --model_tag, saves, resume, rerun, dry run
# (nanochat/stage.py). Why these defaults, as measured: bench/RESULTS.md, "Moved from base_train's config block" and
# the sections it names.
# model (gpt.GPTConfig). With qk_scale != 1, layer_scalars, value_embeds or windows it exports with remote code only
# (docs/export.md)
depth = 20  # the one size dial: width 64*depth, heads 128 wide; odd depths: others (7 -> 4 of 112: config_from_depth)
max_seq_len = 2048  # tokens per row (context length)
rope_base = 10000.0  # rotary base (HEAD: 100000; no gain measured at 512 tokens of context)
qk_scale = 1.2  # scale of q and k after their RMSNorm (1 = the 2025 model)
layer_scalars = False  # learned per-layer scales of the residual stream and the re-added embedding (measured worse)
value_embeds = True  # every other layer's values get a gated token embedding (adds vocab x width per such layer)
# window_pattern: karpathy/nanochat HEAD's SSSL is not measured here yet
window_pattern = "L"  # attention windows per layer, tiled, last L: L the whole context, S its last quarter (HEAD: SSSL)
init_recipe = "2026"  # initial weights: 2025 (lm_head zero) | 2026 (karpathy/nanochat HEAD's scales): GPT.init_weights
# training horizon: the first of these that is > 0 decides the number of optimizer steps
num_iterations = -1  # explicit number of steps
target_flops = -1.0  # total training FLOPs to spend (steps = target_flops / (6N+attn) / total_batch_size)
target_param_data_ratio = 20.0  # Chinchilla-style tokens:params ratio (20 = compute-optimal), if neither above is set
# batch
device_batch_size = 32  # rows per forward/backward per rank (lower it if you run out of memory)
total_batch_size = 524288  # tokens per optimizer step, all ranks and micro-steps together
# optimization (nanochat/optim.py)
embedding_lr = 0.2  # AdamW lr of the token embedding (the value embeddings get half)
unembedding_lr = 0.004  # AdamW lr of lm_head
matrix_lr = 0.02  # Muon lr of the transformer matrices
scalar_lr = 0.5  # AdamW lr of the layer scalars (x0; resid gets 1/100 of it), with --layer_scalars
# weight decay -1 = by depth, linear between the depths named: the embeddings' and lm_head's 0.20 up to d8, 0 from
# d12; the block matrices' 0.80 to d6, 0.40 at d8, 0.22 at d12, 0.08 from d20 (nanochat/optim.py)
weight_decay = -1.0  # AdamW weight decay of the embeddings and lm_head; -1 = by depth: 0.20 up to d8, 0 from d12
matrix_weight_decay = -1.0  # Muon's cautious weight decay of the block matrices; -1 = by depth: 0.80 (d6) to 0.08 (d20)
grad_clip = 1.0  # clip the global gradient norm to this (0 = off)
warmup_ratio = 0.0  # fraction of steps of linear lr warmup
warmdown_ratio = 0.65  # fraction of steps of linear lr decay at the end
final_lr_frac = 0.05  # lr multiplier at the very end of the warmdown
muon_momentum_peak = 0.97  # Muon's momentum after its warm-up from 0.85 over the first 300 steps
muon_momentum_final = 0.90  # Muon's momentum at the end, reached linearly over the warmdown (= peak: constant)
# evaluation and output (every <= 0 turns a periodic action off; the final eval and checkpoint always happen)
eval_every = 250  # steps between val bits-per-byte evaluations
eval_tokens = -1  # val tokens per evaluation, all ranks together (-1 = 20 x total_batch_size)
core_metric_every = 2000  # steps between CORE evaluations, and one at the end (<= 0: never)
core_metric_max_per_task = 500  # examples per CORE task (-1 = all)
core_bundle = ""  # CORE tasks: dclm (DCLM's 22, downloaded) | offline (pydocs); empty: offline for pydocs, else dclm
sample_every = 2000  # steps between printed samples
compile = "auto"  # torch.compile the model: auto (= on for CUDA, off for CPU/MPS) | true | false
attention = "auto"  # the attention kernel: auto (dense where this CPU measured it faster in bf16, else sdpa) | sdpa |
#                    dense (training steps' scores in blocked matmuls: a CPU in bf16) | flex (FlexAttention: a window
#                    costs what it sees; CUDA) | eager (the softmax written out) (nanochat/attention_kernels.py)
fp8 = False  # the blocks' matmuls in float8 while training (nanochat/fp8.py); not yet measured on a GPU, so off
data_seed = 0  # seeds the per-epoch shuffle of the training data order
init_seed = 42  # seeds the initial weights (the same on every rank)
bos_aligned = True  # start every row at a document start: best-fit packing, no token dropped
config = configure(globals(), shared=stage_settings())
# What each value means, checked before any work (a bad value must not train for hours)
check_config(config,
             positive=["depth", "max_seq_len", "device_batch_size", "total_batch_size", "target_param_data_ratio"],
             positive_or_unset=["num_iterations", "target_flops", "eval_tokens", "core_metric_max_per_task"],
             non_negative=["embedding_lr", "unembedding_lr", "matrix_lr", "scalar_lr", "grad_clip"],
             fractions=["warmup_ratio", "warmdown_ratio", "final_lr_frac", "muon_momentum_peak", "muon_momentum_final"],
             choices={"compile": ("auto", "true", "false"),
                      "core_bundle": ("", "dclm", "offline"), "init_recipe": GPT.INIT_RECIPES,
                      "attention": attention_kernels.CHOICES})
for key, value in (("weight_decay", weight_decay), ("matrix_weight_decay", matrix_weight_decay)):
    if not (value >= 0 or value == -1):
        raise UserError(f"--{key} must be >= 0, or -1 for 'by depth', got {value!r}")
weight_decay = decay_by_depth(EMBEDDING_WEIGHT_DECAY_BY_DEPTH, depth) if weight_decay == -1 else weight_decay
matrix_weight_decay = (decay_by_depth(MATRIX_WEIGHT_DECAY_BY_DEPTH, depth) if matrix_weight_decay == -1
                       else matrix_weight_decay)
if not (rope_base > 1 and qk_scale > 0):
    raise UserError(f"--rope_base must be > 1 and --qk_scale > 0, got {rope_base!r} and {qk_scale!r}")
if not window_pattern or set(window_pattern) - set("SL"):
    raise UserError(f"--window_pattern is a string of S (short window) and L (whole context), e.g. SSSL; "
                    f"got {window_pattern!r}")
model_tag = check_model_tag(config["model_tag"] or f"d{depth}")  # the run's checkpoint directory
# before the stage starts anything (a process group, a wandb run): torch has FlexAttention's backward for GPUs only
if attention == "flex" and (device_kind := config["device_type"] or autodetect_device_type()) != "cuda":
    raise UserError(f"--attention=flex trains on CUDA only (torch {torch.__version__} has no FlexAttention backward on "
                    f"{device_kind}); use --attention=sdpa")

# -----------------------------------------------------------------------------
# 2. The stage and the compute. The stage's settings are checked; this run is made from its settings, the tokenizer
# and the corpus's shards: made already from them (--rerun=auto), it says so and exits 0 here (nanochat/stage.py,
# nanochat/rerun.py). Then one process per device (torchrun sets RANK / LOCAL_RANK / WORLD_SIZE), the banner, and
# wandb on rank 0
stage = Stage("base", config, model_tag=model_tag)  # checkpoints, saves, stop, end
device_type, ddp, ddp_rank, ddp_world_size, device = stage.start_compute()
master_process = ddp_rank == 0  # prints, logs to wandb, writes the report
compute_dtype, autocast_ctx = autocast_context(device_type)  # decided by what the device does: nanochat/hardware.py
# The CORE tasks are fetched now, not when the first CORE evaluation is due hours into the run
core_bundle_dir = prepare_bundle(core_bundle or default_bundle_kind()) if core_metric_every > 0 else None

# -----------------------------------------------------------------------------
# 3. Tokenizer and model
tokenizer = get_tokenizer()
token_bytes = get_token_bytes(device=device)
vocab_size = tokenizer.get_vocab_size()
model_config = config_from_depth(depth, vocab_size=vocab_size, sequence_len=max_seq_len, rope_base=rope_base,
                                 qk_scale=qk_scale, layer_scalars=layer_scalars, value_embeds=value_embeds,
                                 window_pattern=window_pattern)
print0(f"Model: depth {depth} -> n_embd {model_config.n_embd}, {model_config.n_head} heads of "
       f"{model_config.n_embd // model_config.n_head}, vocab {vocab_size:,}, context {max_seq_len}")
with torch.device("meta"):  # build without allocating, then materialise on the device and initialise once
    model = GPT(model_config)
model.to_empty(device=device)
# identical on every rank and in every run: drawn from a generator of its own, seeded
model.init_weights(seed=init_seed, recipe=init_recipe)
orig_model = model  # the uncompiled model: for saving, sampling, and evaluation at other shapes
if fp8:  # on any device (a CPU emulates it: that tests the arithmetic); where it is native, fp8_supported says
    model.fp8 = True
    print0(f"fp8: the blocks' matmuls in float8 while training, evaluation in {compute_dtype}; "
           f"this device: {fp8_supported(device_type)[1]}")
model, use_compile = compile_model(orig_model, compile, device_type)
num_params = orig_model.num_params()
# the tokens:params ratio counts the parameters that compute: value-embedding tables are lookups (at depth 20 they would
# be 10x the embedding), as nanochat HEAD counts them
scaling_params = orig_model.num_params(value_embeds=False)
flops_per_token = orig_model.estimate_flops()
print0(f"Parameters: {num_params:,}" + (f" ({scaling_params:,} without the value embeddings)" if value_embeds else "")
       + f" | FLOPs per token (6N + attention): {flops_per_token:.3e} | torch.compile: {use_compile}")

# -----------------------------------------------------------------------------
# 4. Training horizon: how many optimizer steps
if num_iterations > 0:
    horizon = f"num_iterations={num_iterations}"
elif target_flops > 0:
    num_iterations = round(target_flops / (flops_per_token * total_batch_size))
    horizon = f"target_flops={target_flops:.3e}"
else:
    # Chinchilla: compute-optimal training sees ~20 tokens per parameter
    num_iterations = int(target_param_data_ratio * scaling_params) // total_batch_size
    horizon = f"target_param_data_ratio={target_param_data_ratio}"
if num_iterations < 1:
    raise UserError(f"{horizon} gives {num_iterations} steps at total_batch_size={total_batch_size:,}: "
                    f"set --num_iterations or a larger target")
total_tokens = total_batch_size * num_iterations
print0(f"Training horizon from {horizon}: {num_iterations:,} steps")
print0(f"Training tokens: {total_tokens:,} | tokens:params ratio {total_tokens / scaling_params:.2f} | "
       f"total training FLOPs {flops_per_token * total_tokens:.3e}")

# -----------------------------------------------------------------------------
# 5. Batch arithmetic. One micro-step = one forward/backward of device_batch_size rows on every rank at once.
# Micro-steps are repeated (gradient accumulation) until total_batch_size tokens have been seen, then the
# optimizer takes one step.
tokens_per_fwdbwd = device_batch_size * max_seq_len  # one rank, one micro-step
world_tokens_per_fwdbwd = tokens_per_fwdbwd * ddp_world_size  # all ranks, one micro-step
# micro-steps per step, printed (or a one-line error naming settings that work)
grad_accum_steps = grad_accum_steps_for(total_batch_size, device_batch_size, max_seq_len, ddp_world_size, show=True)

# -----------------------------------------------------------------------------
# 6. The checkpoint directory, optimizers, data. This run owns base_checkpoints/<model_tag> from here on (a second
# run on it is refused; a fresh run never writes into a directory holding an earlier run's steps). A resumed run
# (--resume_from_step) continues that checkpoint: its weights, every rank's optimizer state and data position.
stage.start(model=orig_model, tokenizer=tokenizer, attention=attention)  # its kernel: --attention
optimizers = orig_model.setup_optimizers(unembedding_lr=unembedding_lr, embedding_lr=embedding_lr,
                                         matrix_lr=matrix_lr, weight_decay=weight_decay,
                                         matrix_weight_decay=matrix_weight_decay, scalar_lr=scalar_lr)  # [AdamW, Muon]
# What decides which data step N reads: resuming with a different value would not continue the same run. The
# world size is not among them: the loader's data slots make a step's data the same on any number of ranks.
data_settings = dict(corpus=dataset_name(), device_batch_size=device_batch_size, max_seq_len=max_seq_len,
                     total_batch_size=total_batch_size, data_seed=data_seed, bos_aligned=bos_aligned)
train_loader = tokenizing_distributed_data_loader(device_batch_size, max_seq_len, "train", device, tokenizer=tokenizer,
                                                  total_batch_size=total_batch_size, seed=data_seed,
                                                  bos_aligned=bos_aligned)
# The loop's variables, restored with the optimizer state and the loader's position when resumed (nanochat/stage.py)
loop = stage.resume(optimizers, train_loader, data_settings,
                    smooth_train_loss=0.0,  # EMA of the global train loss
                    total_training_time=0.0,  # seconds, excluding the first (compile) steps
                    min_val_bpb=float("inf"))
build_val_loader = lambda: tokenizing_distributed_data_loader(device_batch_size, max_seq_len, "val", device,
                                                              tokenizer=tokenizer)
eval_tokens = eval_tokens if eval_tokens > 0 else 20 * total_batch_size
eval_steps = max(1, eval_tokens // world_tokens_per_fwdbwd)
x, y = next(train_loader)  # the first micro-batch; from now on the next one is fetched right after each backward

# -----------------------------------------------------------------------------
# 7. The training loop. Outer loop: one optimizer step per iteration. Inner loop: grad_accum_steps
# micro-steps of forward + backward whose gradients add up in .grad. The same loop bare: docs/training_loop.md.
peak_flops, peak_source = get_peak_flops(device, compute_dtype)
print0(f"Peak FLOP/s for MFU: {peak_flops:.3e} per device ({peak_source})")
print0("Step lines: loss (EMA) = smoothed over ~10 steps | lrm = the lr schedule's multiplier (warmup, 1, warmdown) | "
       "grad norm before clipping to grad_clip | mfu = model FLOP/s / peak FLOP/s (docs/training_loop.md)")
start_step = stage.start_step
val_bpb = None
core_metric = {}
debiased_loss = None  # the logged train loss (EMA) of the last step
mfus = []
first_step_time = None
sample_prompts = ["The capital of France is", "The chemical symbol of gold is",
                  "If yesterday was Friday, then tomorrow will be", "The opposite of hot is",
                  "The planets of the solar system are:", "My favorite color is", "If 5*x + 3 = 13, then x is"]
step = start_step
stop_now = False  # SIGTERM / Ctrl-C: finish the step (cut an evaluation short), save, exit 75
while True:
    last_step = step == num_iterations or stop_now
    flops_so_far = flops_per_token * total_batch_size * step

    # The final checkpoint comes first, so a crash in the final evaluations loses nothing. Every rank saves its
    # optimizer shard and its data position; rank 0 the weights (nanochat/stage.py)
    if stage.should_save(step, last_step):  # the last step, every save_every steps, every save_every_minutes
        stage.save(step, optimizers, loop, data_state=train_loader.state_dict(), val_bpb=val_bpb,
                   num_iterations=num_iterations)

    # The evaluations and samples. A stop request cuts them short (Interrupted, raised on every rank together; the
    # samples are rank 0's alone): what they measured so far is not reported, and the stage stops.
    with stage.phase(f"Step {step:05d} | evaluations"):
        # Validation bits per byte (loss per byte of text, comparable across tokenizers)
        if last_step or (eval_every > 0 and step % eval_every == 0):
            model.eval()
            with autocast_ctx:
                val_bpb = evaluate_bpb(model, build_val_loader(), eval_steps, token_bytes, stop=stage.stop)
            loop.min_val_bpb = min(loop.min_val_bpb, val_bpb)
            print0(f"Step {step:05d} | validation bpb: {val_bpb:.4f}")
            stage.log(step, val_bpb=val_bpb, total_training_flops=flops_so_far,
                      total_training_time=loop.total_training_time)

        # CORE: accuracy on in-context-learning tasks (nanochat/core_eval.py), on the uncompiled model (other shapes).
        # Not at step 0: an untrained model scores chance (CORE ~0), and on a CPU the evaluation outlasts a short run.
        if core_metric_every > 0 and (last_step or (step > 0 and step % core_metric_every == 0)):
            orig_model.eval()
            with autocast_ctx:
                core = evaluate_core(orig_model, tokenizer, device, core_bundle_dir,
                                     max_per_task=core_metric_max_per_task, stop=stage.stop)
            core_metric = {f"{core['name']} metric": core["score"]}
            print0(f"Step {step:05d} | {core['name']} metric: {core['score']:.4f}")
            stage.log(step, core_metric=core["score"], total_training_flops=flops_so_far)

        # Samples: look at what the model writes, a check no loss number gives (rank 0, uncompiled model)
        if master_process and (last_step or (sample_every > 0 and step > 0 and step % sample_every == 0)):
            orig_model.eval()
            for prompt in sample_prompts:
                if stage.stop():
                    raise Interrupted
                with autocast_ctx:
                    ids = list(generate_naive(orig_model,
                                              tokenizer.encode(prompt, prepend=tokenizer.get_bos_token_id()),
                                              max_tokens=16, temperature=0))
                print0(f"  sample: {prompt!r} -> {tokenizer.decode(ids)!r}")
    model.train()  # and orig_model: model is it, or (compiled) holds it

    if last_step:
        break

    # ---- one optimizer step ----
    t0 = device_time(device)
    step_loss = torch.zeros((), device=device)  # this rank's mean loss over its micro-steps, for logging
    # No gradient leaves this rank during the micro-steps: the model is not wrapped in DistributedDataParallel (which
    # all_reduces during every backward, hence its no_sync() for accumulation), so each backward adds into this rank's
    # own .grad only; the ranks exchange gradients once per step, in step_optimizers below (nanochat/optim.py)
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
    lrm = lr_multiplier(step, num_iterations, warmup_ratio, warmdown_ratio, final_lr_frac)  # warmup, 1, warmdown
    # Muon's momentum: 0.85 -> peak over the first 300 steps, then -> final over the warmdown (why: nanochat/optim.py)
    momentum = muon_momentum(step, end=muon_momentum_peak, final=muon_momentum_final, num_iterations=num_iterations,
                             warmdown_ratio=warmdown_ratio)
    # Clip (the norm it returns is the one BEFORE clipping), this step's lr and momentum, the update, then the
    # gradients zeroed for the next step (not between micro-steps: there they must add up). Under torchrun the
    # ranks' gradients are averaged in there: in the clipping, which needs the norm of the averaged gradient, or
    # else in opt.step() (reduce_scatter; nanochat/optim.py)
    grad_norm = step_optimizers(optimizers, lrm, momentum, grad_clip)
    rank_losses = per_rank(step_loss.item())  # every rank's loss, on every rank (losses are not summed: logged)
    stop_now, = stage.stop_after_step()  # a signal to any rank stops all of them after this step
    dt = device_time(device) - t0
    step += 1

    # ---- logging ----
    train_loss = sum(rank_losses) / ddp_world_size  # global loss: the mean over ranks
    loop.smooth_train_loss, debiased_loss = smoothed_loss(loop.smooth_train_loss, train_loss, step)
    tok_per_sec = total_batch_size / dt  # tokens of ALL micro-steps of ALL ranks per second of step time
    mfu = 100 * flops_per_token * tok_per_sec / (peak_flops * ddp_world_size)
    if step - start_step > 10:  # the first steps include compilation and warm-up: keep them out of the time
        loop.total_training_time += dt
        mfus.append(mfu)
    if first_step_time is None:  # start-up (imports included), data, compile and the first step
        first_step_time = time.time() - psutil.Process().create_time()
    # The step line; what each field means: docs/training_loop.md, "The step line"
    print0(f"step {step:05d}/{num_iterations:05d} ({100 * step / num_iterations:.2f}%) "
           f"| loss (EMA): {debiased_loss:.6f} "
           f"| step loss (mean of {ddp_world_size} rank(s)): {train_loss:.6f} "
           f"| lrm: {lrm:.2f} "
           f"| muon momentum: {momentum:.3f} "
           f"| grad norm (before clip): {format_value(grad_norm)} "
           f"| dt: {dt * 1000:.2f}ms "
           f"| tok/sec: {tok_per_sec:,.0f} "
           f"| mfu %: {mfu:.1f} "
           f"| total time: {loop.total_training_time / 60:.2f}m")
    stage.log(step, loss=debiased_loss, step_loss=train_loss, rank_losses=rank_losses, lrm=lrm, muon_momentum=momentum,
              grad_norm=grad_norm, dt=dt, tok_per_sec=tok_per_sec, mfu=mfu,
              total_training_flops=flops_per_token * total_batch_size * step,
              total_training_time=loop.total_training_time)

# -----------------------------------------------------------------------------
# 8. Summary, report, and the end of the stage
if device_type == "cuda":
    peak_memory = f"{torch.cuda.max_memory_allocated() / 2**20:,.0f} MiB (CUDA, allocated)"
else:
    import resource
    peak_memory = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:,.0f} MiB (process RSS)"
stopped_early = stage.stopped_early()  # the final evaluations too: a resume from the last step runs them
min_val_text = f"{loop.min_val_bpb:.4f}" if math.isfinite(loop.min_val_bpb) else "n/a (no evaluation ran)"
print0(f"Peak memory: {peak_memory}")
print0(f"Total training time: {loop.total_training_time / 60:.2f}m | min val bpb: {min_val_text}")
stage.report("Base model training", step, [
    config,
    {"Number of parameters": f"{num_params:,}", "FLOPs per token": f"{flops_per_token:e}",
     "Training horizon": horizon, "Calculated number of iterations": num_iterations,
     "Number of training tokens": f"{total_tokens:,}", "Tokens : Params ratio": f"{total_tokens / scaling_params:.2f}",
     "Tokens / micro-batch / rank": tokens_per_fwdbwd, "Tokens / micro-batch": world_tokens_per_fwdbwd,
     "Gradient accumulation steps": grad_accum_steps, "DDP": ddp, "Device": str(device),
     "Compute dtype": str(compute_dtype), "torch.compile": use_compile,
     "Total training FLOPs": f"{flops_per_token * total_tokens:e}"},
    {"Minimum validation bpb": loop.min_val_bpb,
     "Final validation bpb": "n/a (its evaluation was stopped)" if stopped_early else val_bpb,
     **core_metric,
     "Final train loss (EMA)": debiased_loss if debiased_loss is not None else "n/a (no step in this run)",
     "Average MFU (%)": f"{sum(mfus) / len(mfus):.1f}" if mfus else "n/a (under 11 steps)",
     "Peak FLOP/s used for MFU": f"{peak_flops:.3e} ({peak_source})",
     "Total training time (min)": loop.total_training_time / 60, "Time to first step (s)": first_step_time,
     "BOS-aligned rows, tokens without their document's start / dropped":
         (f"{100 * train_loader.leftover_fraction():.2f}% / {100 * train_loader.dropped_fraction():.2f}%"
          if bos_aligned else "n/a (packed stream)"),
     "Peak memory": peak_memory},
])
sys.exit(stage.finish(step, "python -m scripts.base_loss (bpb on train/val and samples), "
                            "then python -m scripts.mid_train"))
