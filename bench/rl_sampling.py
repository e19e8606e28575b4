"""
RL's sampling against the Engine's decoding: answer tokens/s on one trained chat model.

chat_rl samples `num_samples` answers to each problem of a step; one problem after another, a step decoded as many
steps as its longest answer for every problem, most of its rows long ended, and its answer tokens came out far
slower than the Engine decodes. This measures, on one trained chat model:

- "one problem at a time": Engine.generate per problem, num_samples rows each (how chat_rl sampled before);
- "problems together": Engine.generate_many over the step's problems, `sample_batch_size` answers at a time (how
  chat_rl samples now);
- "decode ceiling": engine.decode_step at num_samples rows for `ceiling_steps` steps, every row running (what
  bench/engine.py measures): the rate at which the Engine decodes rows that have not ended.

For each: answer tokens per second (the tokens chat_rl keeps: each answer up to and including its end token), the
decoding steps run, and the time; then the machine line. Under autocast in the compute dtype, as chat_rl runs.

    python bench/rl_sampling.py --source=mid                       # the mid model of $NANOCHAT_BASE_DIR
    python bench/rl_sampling.py --source=sft --problems=16 --num_samples=16 --threads=2
"""

import statistics
import time

import torch

from ab import machine_line  # bench/ab.py
from nanochat.checkpoint_manager import load_model
from nanochat.configurator import check_config, configure
from nanochat.engine import Engine, decode_step, decode_weights
from nanochat.hardware import autocast_context, compute_dtype_line
from nanochat.output import print0

source = "mid"  # the chat model to sample from: mid | sft | rl
model_tag = ""  # which model of that stage (needed only if there are several)
mixture = "offline"  # offline (the arithmetic word problems) | real (GSM8K, downloaded once)
problems = 16  # problems of one step (chat_rl's prompts_per_step on one rank)
num_samples = 16  # answers per problem
max_new_tokens = 256  # longest answer
temperature = 1.0
top_k = 50
sample_batch_size = 256  # answers decoded together in "problems together" (chat_rl's setting)
ceiling_steps = 64  # decoding steps of the ceiling measurement
threads = 2  # torch threads (0 = leave torch's default)
repeats = 3  # runs of each measurement (different seeds); the median is reported
config = configure(globals())
check_config(config,
             positive=["problems", "num_samples", "max_new_tokens", "sample_batch_size", "ceiling_steps", "repeats"],
             non_negative=["temperature", "top_k", "threads"],
             choices={"mixture": ("offline", "real"), "source": ("mid", "sft", "rl")})
if threads:
    torch.set_num_threads(threads)

model, tokenizer, meta = load_model(source, torch.device("cpu"), phase="eval", model_tag=model_tag or None)
engine = Engine(model, tokenizer)
if mixture == "real":
    from tasks.gsm8k import GSM8K
    task = GSM8K(subset="main", split="train")
else:
    from tasks.arithmetic import Arithmetic
    task = Arithmetic(split="train")
prompts = [tokenizer.render_for_completion(task[i]) for i in range(problems)]
_, autocast = autocast_context("cpu")
print0(f"{source} model {meta['model_tag']} step {meta['step']}: depth {model.config.n_layer}, "
       f"vocab {model.config.vocab_size:,}, context {engine.context_len}; {problems} problems x {num_samples} "
       f"answers of up to {max_new_tokens} tokens, temperature {temperature}, top_k {top_k}; "
       f"{torch.get_num_threads()} threads")
print0(compute_dtype_line("cpu"))


def kept_tokens(columns, rows):
    """Answer tokens as chat_rl keeps them (up to and including each answer's end token), and the steps decoded."""
    ended = [False] * rows
    kept = 0
    steps = 0
    for column, _ in columns:
        steps += 1
        for i, token in enumerate(column):
            if not ended[i]:
                kept += 1
                ended[i] = token in engine.end_tokens
    return kept, steps


def one_at_a_time(seed):
    kept = steps = 0
    for p, prompt in enumerate(prompts):
        room = min(max_new_tokens, engine.context_len - len(prompt))
        k, s = kept_tokens(engine.generate(prompt, num_samples=num_samples, max_tokens=room, temperature=temperature,
                                           top_k=top_k, seed=seed + p), num_samples)
        kept += k
        steps += s
    return kept, steps


def together(seed):
    kept = steps = 0
    per_call = max(1, sample_batch_size // num_samples)
    for first in range(0, len(prompts), per_call):
        chunk = prompts[first:first + per_call]
        room = min(max_new_tokens, engine.context_len - max(len(p) for p in chunk))
        k, s = kept_tokens(engine.generate_many(chunk, num_samples=num_samples, max_tokens=room,
                                                temperature=temperature, top_k=top_k, seed=seed + first),
                           len(chunk) * num_samples)
        kept += k
        steps += s
    return kept, steps


def ceiling(seed):
    """Every one of num_samples rows decoding ceiling_steps steps after the first prompt: rows x steps tokens."""
    from nanochat.engine import KVCache
    cfg = model.config
    prompt = prompts[0]
    cache = KVCache(num_samples, cfg.n_kv_head, len(prompt) + ceiling_steps, cfg.n_embd // cfg.n_head, cfg.n_layer,
                    "cpu", torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32)
    with torch.inference_mode():
        model.prefill(torch.tensor([prompt] * num_samples), cache)
        weights = decode_weights(model, cache.k.dtype)
        token = torch.full((num_samples,), prompt[-1])
        for _ in range(ceiling_steps):
            token = decode_step(model, token, cache, weights).argmax(dim=-1)
    return num_samples * ceiling_steps, ceiling_steps


rows = []
with autocast:
    for name, run in (("one problem at a time", one_at_a_time), ("problems together", together),
                      ("decode ceiling", ceiling)):
        results = []
        for r in range(repeats):
            t0 = time.perf_counter()
            kept, steps = run(1000 * r)
            results.append((kept, steps, time.perf_counter() - t0))
        seconds = statistics.median(t for _, _, t in results)
        kept, steps, _ = min(results, key=lambda x: abs(x[2] - seconds))
        rows.append((name, kept / seconds, steps, kept, seconds))
        print0(f"{name}: {kept / seconds:,.0f} answer tokens/s ({kept:,} tokens, {steps:,} decoding steps, "
               f"{seconds:.2f}s)")
base, new, top = (rate for _, rate, *_ in rows)
print0(f"problems together / one at a time: {new / base:.2f}x; against the decode ceiling: "
       f"one at a time {base / top:.2f}, together {new / top:.2f}")
print0(machine_line())
