"""
Reinforcement learning on math word problems: the finetuned model samples several answers per problem (with
the calculator tool), each answer is rewarded 1 if its final "#### <number>" is right, and a policy-gradient
step makes the better-than-average answers more likely. Fully on-policy: every step samples with the current
weights, trains once on those samples, and throws them away.

    python -m scripts.chat_rl --mixture=offline                 # anywhere: the offline arithmetic problems
    torchrun --standalone --nproc_per_node=8 -m scripts.chat_rl  # GSM8K (downloaded once)

Reads top to bottom like the other training scripts: 1 config, 2 compute, 3 the model (the SFT model, or the
RL checkpoint being resumed), 4 batch arithmetic, 5 optimizers, 6 resume, 7 data, 8 the loop (evaluate, save,
then: sample, reward, advantages, the policy-gradient micro-steps, the optimizer step), 9 report.

Ranks: the prompts of a step are dealt to the ranks (rank r takes prompts r, r+W, ... of the step), each rank
samples and trains on its own, and the optimizers average the gradients as always. Which prompts a step uses
and the sampling seeds depend only on the step, so a resumed run continues exactly.
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
                             compute_cleanup, compute_init, get_base_dir, init_wandb, print0, print_banner)
from nanochat.configurator import check_config, configure
from nanochat.engine import Engine
from nanochat.loss_eval import count_step_targets, group_advantages, policy_gradient_loss
from nanochat.report import get_report
from nanochat.schedules import muon_momentum
from nanochat.sharding import clip_grad_norm_, load_optimizer_shards, optimizer_shard
from nanochat.tokenizer import get_tokenizer

# -----------------------------------------------------------------------------
# 1. Config (override as --key=value; --help lists them)
run = "dummy"  # wandb run name ("dummy" = no wandb)
device_type = ""  # cuda | cpu | mps; empty = autodetect
source = "sft"  # which model to start from: sft | mid
model_tag = ""  # which model of that stage (needed only if there are several); also names chatrl_checkpoints/<tag>
step = -1  # which checkpoint step of the source model (-1 = the last)
mixture = "real"  # real (GSM8K; downloads) | offline (the offline arithmetic word problems, no downloads)
num_iterations = -1  # optimizer steps; -1 = one pass over the training problems
prompts_per_step = 16  # problems per optimizer step, all ranks together
num_samples = 16  # answers sampled per problem (the advantage compares them)
max_new_tokens = 256  # longest sampled answer
temperature = 1.0  # sampling temperature (> 0: the answers must differ to compare them)
top_k = 50  # sample from the k most likely tokens (0 = the whole vocabulary)
device_batch_size = 8  # sampled answers per forward/backward of the policy-gradient pass, per rank
unembedding_lr = 0.004  # AdamW lr of lm_head
embedding_lr = 0.2  # AdamW lr of the token embedding
matrix_lr = 0.02  # Muon lr of the transformer matrices
init_lr_frac = 0.05  # every lr is multiplied by this, then decays linearly to 0 over the run
weight_decay = 0.0  # AdamW weight decay
grad_clip = 1.0  # clip the global gradient norm to this (0 = off)
eval_every = 60  # steps between pass@k evaluations on the test problems (<= 0: only at the start and the end)
eval_examples = 400  # test problems per evaluation
save_every = 60  # steps between checkpoints (<= 0: only the final one)
resume_from_step = -1  # resume from this step's checkpoint in chatrl_checkpoints/<model_tag> (-1 = start from the source)
overwrite = False  # a fresh run into a model_tag that holds RL checkpoints deletes them (default: refuse)
seed = 0  # sampling seeds: step s, problem i use a seed derived from (seed, s, i)
dry_run = False  # run everything but write no checkpoint and no report
config = configure(globals())
check_config(config, positive=["prompts_per_step", "num_samples", "max_new_tokens", "device_batch_size", "init_lr_frac",
                               "eval_examples", "temperature"],
             positive_or_unset=["num_iterations"], non_negative=["embedding_lr", "unembedding_lr", "matrix_lr", "weight_decay",
                                                                "grad_clip", "top_k"],
             choices={"device_type": ("", "cuda", "cpu", "mps"), "mixture": ("real", "offline"), "source": ("sft", "mid")})
if resume_from_step < -1:
    raise UserError(f"--resume_from_step must be a checkpoint's step, or -1 to start from the {source} model, got {resume_from_step}")
if model_tag:
    check_model_tag(model_tag)

# -----------------------------------------------------------------------------
# 2. Compute (CPU, MPS or CUDA; under torchrun gloo or NCCL)
print_banner()
device_type = device_type or autodetect_device_type()
ddp, ddp_rank, ddp_local_rank, ddp_world_size, device = compute_init(device_type)
master_process = ddp_rank == 0
compute_dtype = autocast_dtype(device_type)
autocast_ctx = torch.amp.autocast(device_type=device_type, dtype=compute_dtype) if compute_dtype != torch.float32 else nullcontext()
synchronize = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
wandb_run = init_wandb(run, master_process, config, project="nanochat-rl")

# -----------------------------------------------------------------------------
# 3. The model: the SFT model for a fresh run, this stage's checkpoint for a resumed one
if resume_from_step < 0:
    model, tokenizer, source_meta = load_model(source, device, phase="train", model_tag=model_tag or None, step=step)
    model_tag = source_meta["model_tag"]
    parent = dict(source=source, model_tag=model_tag, step=source_meta["step"])
else:
    model_tag = model_tag or find_model_tag(os.path.join(get_base_dir(), "chatrl_checkpoints"), "python -m scripts.chat_rl")
    tokenizer = get_tokenizer()
checkpoint_dir = checkpoint_dir_for("rl", model_tag)
if not dry_run:  # this run owns chatrl_checkpoints/<model_tag> until it ends (see claim_checkpoint_dir)
    claim_checkpoint_dir(checkpoint_dir, resume_from_step, overwrite)
start_step, loop_state = 0, {}
if resume_from_step >= 0:
    model_state, optim_shards, meta = load_checkpoint(checkpoint_dir, resume_from_step, device, load_optimizer=True)
    where = f"checkpoint of step {resume_from_step} in {checkpoint_dir}"
    check_tokenizer(meta, tokenizer, where)
    model = model_from_state(model_state, meta, device, where)
    parent, start_step, loop_state = meta["parent"], resume_from_step, meta["loop_state"]
    del model_state
engine = Engine(model, tokenizer)  # samples with the current weights: fully on-policy

# -----------------------------------------------------------------------------
# 4. Batch arithmetic
if prompts_per_step % ddp_world_size != 0:
    raise UserError(f"prompts_per_step {prompts_per_step} is not a multiple of the world size {ddp_world_size}; try "
                    f"--prompts_per_step={max(ddp_world_size, prompts_per_step // ddp_world_size * ddp_world_size)}")
prompts_per_rank = prompts_per_step // ddp_world_size
print0(f"Problems / step: {prompts_per_step} ({prompts_per_rank} per rank) x {num_samples} sampled answers = "
       f"{prompts_per_step * num_samples} answers; policy-gradient micro-batches of {device_batch_size} answers")

# -----------------------------------------------------------------------------
# 5. Optimizers, at a fraction of the pretraining learning rates
optimizers = model.setup_optimizers(unembedding_lr=unembedding_lr, embedding_lr=embedding_lr, matrix_lr=matrix_lr,
                                    weight_decay=weight_decay)
adamw_optimizer, muon_optimizer = optimizers
for opt in optimizers:
    for group in opt.param_groups:
        group["lr"] = group["initial_lr"] = group["lr"] * init_lr_frac

# -----------------------------------------------------------------------------
# 6. Resume
data_settings = dict(mixture=mixture, prompts_per_step=prompts_per_step, num_samples=num_samples, seed=seed)
if resume_from_step >= 0:
    check_data_settings(meta["data_settings"], data_settings, where)
    load_optimizer_shards(optimizers, model, optim_shards, where)
    del optim_shards
    print0(f"Resumed from step {start_step} of {checkpoint_dir}")

# -----------------------------------------------------------------------------
# 7. Data: the problems, and their reward (task.reward: 1.0 for the right final answer, else 0.0)
if mixture == "real":
    from tasks.gsm8k import GSM8K
    train_task, test_task = GSM8K(subset="main", split="train"), GSM8K(subset="main", split="test")
else:
    from tasks.arithmetic import Arithmetic
    train_task, test_task = Arithmetic(split="train"), Arithmetic(split="test")
if num_iterations < 0:
    num_iterations = max(1, len(train_task) // prompts_per_step)
print0(f"Mixture {mixture}: {len(train_task):,} training problems, {len(test_task):,} test problems; {num_iterations} steps")
end_token = tokenizer.encode_special("<|assistant_end|>")


def sample(prompt, n, sample_seed):
    """n answers to `prompt`: for each, its tokens (the end token included when it ended) and their masks
    (1 = sampled, 0 = forced in by the calculator tool)."""
    tokens, masks, done = [[] for _ in range(n)], [[] for _ in range(n)], [False] * n
    room = min(max_new_tokens, engine.context_len - len(prompt))
    if room < 1:
        return tokens, masks
    for column, column_masks in engine.generate(prompt, num_samples=n, max_tokens=room, temperature=temperature,
                                                top_k=top_k, seed=sample_seed):
        for i, (token, mask) in enumerate(zip(column, column_masks)):
            if not done[i]:
                tokens[i].append(token)
                masks[i].append(mask)
                done[i] = token in engine.end_tokens
    return tokens, masks


def answer_text(tokens):
    return tokenizer.decode([t for t in tokens if t not in engine.end_tokens])


@torch.no_grad()
def evaluate_pass_at_k():
    """pass@k for k = 1..num_samples on the first eval_examples test problems (shared among ranks): the fraction
    of problems where at least one of the first k answers is right."""
    model.eval()
    passes = torch.zeros(num_samples, dtype=torch.float64, device=device)
    count = min(eval_examples, len(test_task))
    for i in range(ddp_rank, count, ddp_world_size):
        conversation = test_task[i]
        with autocast_ctx:
            tokens, _ = sample(tokenizer.render_for_completion(conversation), num_samples, seed * 1_000_003 + i)
        right = [bool(test_task.evaluate(conversation, answer_text(t))) for t in tokens]
        for k in range(num_samples):
            passes[k] += any(right[:k + 1])
    if ddp:
        dist.all_reduce(passes)
    model.train()
    return {k + 1: passes[k].item() / count for k in range(num_samples)}


stop_request = StopRequest(ddp_rank)  # SIGTERM / Ctrl-C: finish the step, save, exit (see StopRequest)
metrics_path, log_metrics = open_metrics(checkpoint_dir, start_step, enabled=master_process and not dry_run)
last_saved_step = start_step if resume_from_step >= 0 else None


def save(step):
    global last_saved_step
    if not all(torch.isfinite(p).all() for p in model.parameters()):  # never save a diverged model
        raise UserError(f"step {step}: the weights are not finite; nothing saved (the last checkpoint is step {last_saved_step})")
    save_checkpoint(checkpoint_dir, step, model.state_dict(), optimizer_shard(optimizers, model), dict(
        model_config=model.config.to_dict(), user_config=config, parent=parent, pass_at_k=pass_at_k,
        tokenizer=dict(fingerprint=tokenizer.fingerprint(), vocab_size=tokenizer.get_vocab_size()),
        data_settings=data_settings, loop_state=dict(mean_rewards=mean_rewards, first_pass_at_k=first_pass_at_k,
                                                     num_iterations=num_iterations),
    ), rank=ddp_rank)
    last_saved_step = step


# -----------------------------------------------------------------------------
# 8. The training loop
mean_rewards = loop_state.get("mean_rewards", [])  # mean reward of every step so far
pass_at_k, first_pass_at_k = {}, loop_state.get("first_pass_at_k")  # pass@k before any RL step
step, stop_now = start_step, False
while True:
    last_step = step >= num_iterations or stop_now

    if not dry_run and (last_step or (save_every > 0 and step > start_step and step % save_every == 0)):
        save(step)

    if last_step or step == start_step or (eval_every > 0 and step % eval_every == 0):
        pass_at_k = evaluate_pass_at_k()
        first_pass_at_k = first_pass_at_k or pass_at_k
        print0(f"Step {step:05d} | " + ", ".join(f"pass@{k}: {v:.4f}" for k, v in pass_at_k.items()))
        wandb_run.log({"step": step, **{f"pass@{k}": v for k, v in pass_at_k.items()}})
        log_metrics(step=step, **{f"pass@{k}": v for k, v in pass_at_k.items()})

    if last_step:
        break

    synchronize()
    t0 = time.time()
    # ---- sample: this rank's problems of the step, num_samples answers each, rewarded ----
    rows, rewards_seen, lengths = [], [], []
    for j in range(ddp_rank, prompts_per_step, ddp_world_size):
        index = (step * prompts_per_step + j) % len(train_task)
        conversation = train_task[index]
        prompt = tokenizer.render_for_completion(conversation)
        with autocast_ctx:
            answers, masks = sample(prompt, num_samples, seed * 1_000_003 + step * prompts_per_step + j + 10**9)
        rewards = [train_task.reward(conversation, answer_text(tokens)) for tokens in answers]
        advantages = group_advantages(rewards)
        for tokens, mask, advantage in zip(answers, masks, advantages):
            rows.append((prompt + tokens, [0] * len(prompt) + mask, advantage))
        rewards_seen += rewards
        lengths += [len(tokens) for tokens in answers]
    # ---- the policy-gradient micro-steps over this rank's answers ----
    batches = []
    for start in range(0, len(rows), device_batch_size):
        chunk = rows[start:start + device_batch_size]
        width = max(len(ids) for ids, _, _ in chunk) - 1
        x = torch.full((len(chunk), width), end_token, dtype=torch.long)
        y = torch.full((len(chunk), width), -1, dtype=torch.long)
        for r, (ids, mask, _) in enumerate(chunk):
            ids_t = torch.tensor(ids, dtype=torch.long)
            x[r, :len(ids) - 1] = ids_t[:-1]
            y[r, :len(ids) - 1] = torch.where(torch.tensor(mask[1:], dtype=torch.bool), ids_t[1:], -1)  # sampled tokens only
        batches.append((x.to(device, torch.int32), y.to(device), torch.stack([a for _, _, a in chunk])))
    # The loss is normalised by the sampled tokens of the whole step (all ranks): counted first, one all_reduce
    rank_tokens, step_tokens = count_step_targets([(x, y) for x, y, _ in batches], ddp_rank, ddp_world_size)
    for x, y, advantages in batches:
        with autocast_ctx:
            loss, _ = policy_gradient_loss(model, x, y, advantages, step_tokens, ddp_world_size)
        loss.backward()
    grad_norm = clip_grad_norm_(optimizers, grad_clip) if grad_clip > 0 else None
    lrm = max(0.0, 1.0 - step / num_iterations)  # linear decay to 0 over the run
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lrm
    momentum = muon_momentum(step)  # new optimizers, zero momentum buffers: the same warm-up as pretraining
    for group in muon_optimizer.param_groups:
        group["momentum"] = momentum
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)
    # One all_reduce at the end of the step: rewards and lengths summed over ranks, and the stop flag
    shared = torch.tensor([sum(rewards_seen), len(rewards_seen), sum(lengths), float(stop_request.requested)],
                          dtype=torch.float64, device=device)
    if ddp:
        dist.all_reduce(shared)
    mean_reward, mean_length = shared[0].item() / shared[1].item(), shared[2].item() / shared[1].item()
    stop_now = shared[3].item() > 0
    synchronize()
    dt = time.time() - t0
    step += 1
    mean_rewards.append(mean_reward)

    grad_norm_value = grad_norm.item() if grad_norm is not None else None
    check_finite(step, mean_reward, grad_norm_value, last_saved_step, ["matrix_lr", "embedding_lr", "unembedding_lr", "init_lr_frac"])
    grad_text = f"{grad_norm_value:.4f}" if grad_norm_value is not None else "n/a (no clipping)"
    print0(f"step {step:05d}/{num_iterations:05d} | mean reward: {mean_reward:.4f} | mean answer length: {mean_length:.1f} "
           f"| sampled tokens: {step_tokens:,.0f} | lrm: {lrm:.2f} | grad norm (before clip): {grad_text} | dt: {dt:.2f}s")
    wandb_run.log({"step": step, "train/reward": mean_reward, "train/answer_length": mean_length, "train/lrm": lrm,
                   "train/grad_norm": grad_norm_value, "train/dt": dt})
    log_metrics(step=step, reward=mean_reward, answer_length=mean_length, lrm=lrm, grad_norm=grad_norm_value, dt=dt)

# -----------------------------------------------------------------------------
# 9. Report
stopped_early = stop_now and step < num_iterations
if not dry_run:
    get_report().log(section="Chat RL", data=[
        config,
        {"Number of iterations": step, "Stopped early": stopped_early, "Mixture": mixture, "World size": ddp_world_size,
         "Mean reward, first steps": sum(mean_rewards[:5]) / max(len(mean_rewards[:5]), 1),
         "Mean reward, last steps": sum(mean_rewards[-5:]) / max(len(mean_rewards[-5:]), 1),
         **{f"pass@{k} before RL": v for k, v in (first_pass_at_k or {}).items()},
         **{f"pass@{k}": v for k, v in pass_at_k.items()}, "Metrics file": metrics_path},
    ])
wandb_run.finish()
compute_cleanup()
if stopped_early:
    print0(f"Stopped at step {step} on request. Continue with the same command plus --resume_from_step={step} "
           f"(exit code {EXIT_STOPPED_EARLY}: not finished)")
    sys.exit(EXIT_STOPPED_EARLY)
eval_args = " -a offline" if mixture == "offline" else ""
print0(f"Next: python -m scripts.chat_eval -i rl{eval_args}, or talk to it: python -m scripts.chat_cli --source=rl")
