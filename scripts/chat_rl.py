"""
Reinforcement learning on problems whose answers a program checks.

The finetuned model samples several answers per problem (with the calculator tool), each answer is rewarded 1 if it
is right (GSM8K: its final "#### <number>"), and a policy-gradient step makes the better-than-average answers more
likely. Fully on-policy: every step samples with the current weights, trains once on those samples, and throws them
away.

    python -m scripts.chat_rl --mixture=offline                  # anywhere: spelling, arithmetic, identity problems
    torchrun --standalone --nproc_per_node=8 -m scripts.chat_rl  # GSM8K math word problems (downloaded once)

Written like the other training scripts (what happens around the loop is nanochat/stage.py's); one step of
the loop samples, rewards, computes the advantages, runs the policy-gradient micro-steps, then the optimizer.

Ranks: the prompts of a step are dealt to the ranks (rank r takes prompts r, r+W, ... of the step), each rank
samples and trains on its own, and the optimizers average the gradients as always. A rank decodes the answers to
all its problems of the step together (up to sample_batch_size answers at a time: Engine.generate_many), far faster
than one problem after another. Which prompts a step uses and the sampling seeds depend only on the step and the
rank, so a resumed run on the same number of processes continues exactly.
"""

import sys

import torch
import torch.distributed as dist

from nanochat.configurator import check_config, configure
from nanochat.conversation_loader import padded_batch
from nanochat.engine import Engine
from nanochat.hardware import autocast_context, compile_model, device_time
from nanochat.interrupt import Interrupted, interruptible
from nanochat.losses import count_step_targets, group_advantages, policy_gradient_loss
from nanochat.optim import lr_multiplier, muon_momentum, scale_initial_lrs, step_optimizers
from nanochat.output import UserError, format_value, print0
from nanochat.ranks import sum_over_ranks
from nanochat.scoring import Progress
from nanochat.stage import Stage, stage_settings
from tasks.registry import stage_mixture

# -----------------------------------------------------------------------------
# 1. Config (override as --key=value; --help lists them), after the settings every training stage takes: the wandb
# run, the device, --model_tag (the source's model), saves, resume, rerun, dry run (nanochat/stage.py)
source = "sft"  # which model to start from: sft | mid
step = -1  # which checkpoint step of the source model (-1 = the last)
mixture = "real"  # real (GSM8K; downloads) | offline (spelling, arithmetic, identity; no downloads): tasks/registry.py
num_iterations = -1  # optimizer steps; -1 = one pass over the training problems
prompts_per_step = 16  # problems per optimizer step, all ranks together
num_samples = 16  # answers sampled per problem (the advantage compares them)
max_new_tokens = 256  # longest sampled answer
temperature = 1.0  # sampling temperature (> 0: the answers must differ to compare them)
top_k = 50  # sample from the k most likely tokens (0 = the whole vocabulary)
device_batch_size = 8  # sampled answers per forward/backward of the policy-gradient pass, per rank
# sample_batch_size takes whole problems: a multiple of num_samples, or one problem
sample_batch_size = 256  # answers decoded together, per rank; bounds the KV cache
unembedding_lr = 0.004  # AdamW lr of lm_head
embedding_lr = 0.2  # AdamW lr of the token embedding
matrix_lr = 0.02  # Muon lr of the transformer matrices
init_lr_frac = 0.05  # every lr is multiplied by this: finetuning starts low
warmup_ratio = 0.0  # fraction of the run of linear lr warmup
warmdown_ratio = 1.0  # fraction of the run of linear lr decay at the end (1 = from the first step to final_lr_frac)
final_lr_frac = 0.0  # lr multiplier at the very end of the warmdown
weight_decay = 0.0  # AdamW weight decay
grad_clip = 1.0  # clip the global gradient norm to this (0 = off)
eval_every = 60  # steps between pass@k evaluations on the test problems (<= 0: only at the start and the end)
eval_examples = 400  # test problems per evaluation
seed = 0  # sampling seeds: step s, problem i use a seed derived from (seed, s, i)
# compile: the policy-gradient pass sees rows of any length (dynamic shapes)
compile = "auto"  # torch.compile the policy-gradient pass: auto (= on for CUDA, off for CPU/MPS) | true | false
config = configure(globals(), shared=stage_settings(save_every=60))
check_config(config,
             positive=["prompts_per_step", "num_samples", "max_new_tokens", "device_batch_size", "sample_batch_size",
                       "init_lr_frac", "eval_examples", "temperature"],
             positive_or_unset=["num_iterations"],
             non_negative=["embedding_lr", "unembedding_lr", "matrix_lr", "weight_decay", "grad_clip", "top_k"],
             fractions=["warmup_ratio", "warmdown_ratio", "final_lr_frac"],
             choices={"mixture": ("real", "offline"), "source": ("sft", "mid"), "compile": ("auto", "true", "false")})

# -----------------------------------------------------------------------------
# 2. The stage and the compute (CPU, MPS or CUDA; under torchrun gloo or NCCL), as in scripts/mid_train.py: made
# already from the same settings and model (--rerun=auto), it says so and exits 0 here
stage = Stage("rl", config, source=source, source_step=step)
device_type, ddp, ddp_rank, ddp_world_size, device = stage.start_compute()
master_process = ddp_rank == 0  # prints the pass@k progress
compute_dtype, autocast_ctx = autocast_context(device_type)  # decided by what the device does: nanochat/hardware.py

# -----------------------------------------------------------------------------
# 3. The model: the SFT model for a fresh run, keeping its tag; this stage's own checkpoint for --resume_from_step.
# From here on this run owns chatrl_checkpoints/<model_tag>.
orig_model, tokenizer = stage.start()  # uncompiled: sampling, saving
engine = Engine(orig_model, tokenizer)  # samples with the current weights: fully on-policy
model, use_compile = compile_model(orig_model, compile, device_type, dynamic=True)  # the policy-gradient forward

# -----------------------------------------------------------------------------
# 4. Batch arithmetic
if prompts_per_step % ddp_world_size != 0:
    raise UserError(f"prompts_per_step {prompts_per_step} is not a multiple of the world size {ddp_world_size}; try "
                    f"--prompts_per_step={max(ddp_world_size, prompts_per_step // ddp_world_size * ddp_world_size)}")
prompts_per_rank = prompts_per_step // ddp_world_size
problems_together = max(1, sample_batch_size // num_samples)  # problems whose answers are decoded together
print0(f"Problems / step: {prompts_per_step} ({prompts_per_rank} per rank) x {num_samples} sampled answers = "
       f"{prompts_per_step * num_samples} answers, "
       f"decoded {min(problems_together, prompts_per_rank) * num_samples} at a time; "
       f"policy-gradient micro-batches of {device_batch_size} answers")

# -----------------------------------------------------------------------------
# 5. Optimizers, at a fraction of the pretraining learning rates
optimizers = orig_model.setup_optimizers(unembedding_lr=unembedding_lr, embedding_lr=embedding_lr, matrix_lr=matrix_lr,
                                         weight_decay=weight_decay)
scale_initial_lrs(optimizers, init_lr_frac)

# -----------------------------------------------------------------------------
# 6. Data: the problems, and their reward (task.reward: 1.0 for the right final answer, else 0.0). Which problems:
# tasks/registry.py ("rl/real/train": GSM8K; "rl/offline/train": spelling, arithmetic and identity, and why these
# beside it); the test problems are "rl/real/val", or the offline test split of those tasks.
train_task = stage_mixture("rl", mixture, "train")
test_task = stage_mixture("rl", mixture, "val")
if num_iterations < 0:
    num_iterations = max(1, len(train_task) // prompts_per_step)
print0(f"Mixture {mixture}: {len(train_task):,} training problems, {len(test_task):,} test problems; "
       f"{num_iterations} steps")
end_token = tokenizer.encode_special("<|assistant_end|>")
# The samples of a step depend on the seed, the step, and which problems a rank decodes together: a resumed run
# checks these, gets back every rank's optimizer state and the loop's variables (no data position: see the loop)
data_settings = dict(mixture=mixture, prompts_per_step=prompts_per_step, num_samples=num_samples, seed=seed,
                     sample_batch_size=sample_batch_size, world_size=ddp_world_size)
loop = stage.resume(optimizers, None, data_settings,
                    mean_rewards=[],  # mean reward of every step so far
                    first_pass_at_k=None)  # pass@k before any RL step


def sample(prompts, sample_seed):
    """
    num_samples answers to each of `prompts`, decoded together (Engine.generate_many: one decoding step advances
    every answer of every problem; one problem after another, most steps would decode a few long answers while the
    others have ended). For each prompt, its answers: (tokens, the end token included when it ended; masks: 1 =
    sampled, 0 = forced in by the calculator tool). A prompt that fills the context gets empty answers. A stop request
    ends it between two tokens (Interrupted).
    """
    answers = [[([], []) for _ in range(num_samples)] for _ in prompts]
    fitting = [p for p, prompt in enumerate(prompts) if len(prompt) < engine.context_len]
    for first in range(0, len(fitting), problems_together):
        chunk = fitting[first:first + problems_together]
        room = min(max_new_tokens, engine.context_len - max(len(prompts[p]) for p in chunk))
        rows = [answers[p][s] for p in chunk for s in range(num_samples)]
        done = [False] * len(rows)
        decoding = engine.generate_many([prompts[p] for p in chunk], num_samples=num_samples, max_tokens=room,
                                        temperature=temperature, top_k=top_k, seed=sample_seed + first)
        for column, column_masks in decoding:
            if stage.stop():
                raise Interrupted
            for i, (token, mask) in enumerate(zip(column, column_masks)):
                if not done[i]:
                    rows[i][0].append(token)
                    rows[i][1].append(mask)
                    done[i] = token in engine.end_tokens
    return answers


def answer_text(tokens):
    return tokenizer.decode([t for t in tokens if t not in engine.end_tokens])


@torch.no_grad()
def evaluate_pass_at_k():
    """
    pass@k for k = 1..num_samples on the first eval_examples test problems (shared among ranks): the fraction of
    problems where at least one of the first k answers is right. A stop request: Interrupted, on every rank.
    """
    orig_model.eval()
    passes = torch.zeros(num_samples, dtype=torch.float64, device=device)
    count = min(eval_examples, len(test_task))
    mine = list(range(ddp_rank, count, ddp_world_size))
    print0(f"pass@k: {count} test problems x {num_samples} answers of up to {max_new_tokens} tokens"
           f"{f' on {ddp_world_size} ranks' if ddp else ''}, {problems_together} problems decoded together")
    progress = Progress("pass@k", len(mine), every=10, enabled=master_process, share=" on rank 0" if ddp else "")
    try:
        with interruptible():
            for first in range(0, len(mine), problems_together):
                chunk = mine[first:first + problems_together]
                conversations = [test_task[i] for i in chunk]
                with autocast_ctx:
                    prompts = [tokenizer.render_for_completion(c) for c in conversations]
                    answers = sample(prompts, seed * 1_000_003 + mine[first])
                solved = []
                for i, conversation, problem_answers in zip(chunk, conversations, answers):
                    task = test_task.task_of(i)
                    right = [bool(task.evaluate(conversation, answer_text(tokens))) for tokens, _ in problem_answers]
                    for k in range(num_samples):
                        passes[k] += any(right[:k + 1])
                    solved.append(any(right))
                progress.update(solved)
    finally:
        orig_model.train()
    if ddp:
        dist.all_reduce(passes)
    return {k + 1: passes[k].item() / count for k in range(num_samples)}


# -----------------------------------------------------------------------------
# 7. The training loop. Which problems a step samples, and with which seeds, depends only on the step (and the rank):
# a resumed run continues exactly without any data position to save.
start_step = stage.start_step
pass_at_k = {}
step = start_step
stop_now = False  # SIGTERM / Ctrl-C: finish the step (cut sampling or pass@k short), save, exit 75
while True:
    last_step = step >= num_iterations or stop_now

    if stage.should_save(step, last_step):  # the last step, every save_every steps, every save_every_minutes
        stage.save(step, optimizers, loop, pass_at_k=pass_at_k, num_iterations=num_iterations)

    # pass@k. A stop request cuts it short (Interrupted, on every rank together): not reported, and the stage stops.
    if last_step or step == start_step or (eval_every > 0 and step % eval_every == 0):
        pass_at_k = {}  # stays empty if it is cut short
        with stage.phase(f"Step {step:05d} | pass@k"):
            pass_at_k = evaluate_pass_at_k()
            loop.first_pass_at_k = loop.first_pass_at_k or pass_at_k
            print0(f"Step {step:05d} | " + ", ".join(f"pass@{k}: {v:.4f}" for k, v in pass_at_k.items()))
            stage.log(step, **{f"pass@{k}": v for k, v in pass_at_k.items()})

    if last_step:
        break

    t0 = device_time(device)
    # ---- sample: this rank's problems of the step, num_samples answers each, rewarded. A stop request ends the
    # sampling (every rank together): the step is dropped, and the stage saves the weights of the steps before it.
    mine = list(range(ddp_rank, prompts_per_step, ddp_world_size))
    problems = [(step * prompts_per_step + j) % len(train_task) for j in mine]
    conversations = [train_task[i] for i in problems]
    prompts = [tokenizer.render_for_completion(conversation) for conversation in conversations]
    try:
        with interruptible(), autocast_ctx:
            answers = sample(prompts, seed * 1_000_003 + 10**9 + (step * ddp_world_size + ddp_rank) * prompts_per_step)
    except Interrupted:
        stop_now = True
        print0(f"step {step + 1:05d}/{num_iterations:05d} | stopped while sampling: a stop was requested; "
               f"this step is dropped")
        continue
    rows = []
    rewards_seen = []
    lengths = []
    for i, conversation, prompt, problem_answers in zip(problems, conversations, prompts, answers):
        task = train_task.task_of(i)  # a mixture's problem is scored by the task it comes from
        rewards = [task.reward(conversation, answer_text(tokens)) for tokens, _ in problem_answers]
        advantages = group_advantages(rewards)
        for (tokens, mask), advantage in zip(problem_answers, advantages):
            rows.append((prompt + tokens, [0] * len(prompt) + mask, advantage))
        rewards_seen += rewards
        lengths += [len(tokens) for tokens, _ in problem_answers]
    # ---- the policy-gradient micro-steps over this rank's answers ----
    # (x, y, advantages): y is -1 except on the tokens the model sampled (not the prompt, not tool outputs)
    batches = []
    for start in range(0, len(rows), device_batch_size):
        chunk = rows[start:start + device_batch_size]
        x, y = padded_batch([(ids, mask) for ids, mask, _ in chunk], end_token, device)
        batches.append((x, y, torch.stack([a for _, _, a in chunk])))
    # The loss is normalised by the sampled tokens of the whole step (all ranks): counted first, one all_reduce
    _, step_tokens = count_step_targets([(x, y) for x, y, _ in batches], ddp_rank, ddp_world_size)
    # A micro-batch whose advantages are all 0 (every answer to its problem got the same reward: one the model
    # always or never solves) adds exactly 0 to the gradient: its forward and backward are skipped, which changes
    # nothing (a fifth of the CPU speedrun's answers). If a rank skipped them all, its gradients are zeros, as computed.
    learned = 0  # answers of this rank that were trained on
    for x, y, advantages in batches:
        if not advantages.any():
            continue
        learned += x.size(0)
        with autocast_ctx:
            loss, _ = policy_gradient_loss(model, x, y, advantages, step_tokens, ddp_world_size)
        loss.backward()
    if learned == 0:
        for p in orig_model.parameters():
            p.grad = torch.zeros_like(p)
    lrm = lr_multiplier(step, num_iterations, warmup_ratio, warmdown_ratio, final_lr_frac)
    momentum = muon_momentum(step)  # new optimizers, zero momentum buffers: 0.85 -> 0.95 over 300 steps, as mid_train
    # clip, update, zero the gradients: see base_train
    grad_norm = step_optimizers(optimizers, lrm, momentum, grad_clip)
    reward_sum, answers, length_sum, learned = sum_over_ranks(sum(rewards_seen), len(rewards_seen), sum(lengths),
                                                              learned)
    mean_reward = reward_sum / answers
    mean_length = length_sum / answers
    stop_now, = stage.stop_after_step()  # a signal to any rank stops all of them after this step
    dt = device_time(device) - t0
    step += 1
    loop.mean_rewards.append(mean_reward)

    print0(f"step {step:05d}/{num_iterations:05d} | mean reward: {mean_reward:.4f} "
           f"| mean answer length: {mean_length:.1f} | sampled tokens: {step_tokens:,.0f} "
           f"| answers learned from: {learned:.0f}/{answers:.0f} | lrm: {lrm:.2f} | muon momentum: {momentum:.3f} "
           f"| grad norm (before clip): {format_value(grad_norm)} | dt: {dt:.2f}s")
    stage.log(step, reward=mean_reward, answer_length=mean_length, targets=step_tokens, lrm=lrm, muon_momentum=momentum,
              grad_norm=grad_norm, dt=dt)

# -----------------------------------------------------------------------------
# 8. Report, and the end of the stage
stage.report("Chat RL", step, [
    config,
    {"Mixture": mixture, "torch.compile": use_compile,
     "Mean reward, first steps": sum(loop.mean_rewards[:5]) / max(len(loop.mean_rewards[:5]), 1),
     "Mean reward, last steps": sum(loop.mean_rewards[-5:]) / max(len(loop.mean_rewards[-5:]), 1),
     **{f"pass@{k} before RL": v for k, v in (loop.first_pass_at_k or {}).items()},
     **{f"pass@{k}": v for k, v in pass_at_k.items()}},
])
eval_args = " -a offline" if mixture == "offline" else ""
sys.exit(stage.finish(step, f"python -m scripts.chat_eval -i rl{eval_args}, "
                            f"or talk to it: python -m scripts.chat_cli --source=rl"))
