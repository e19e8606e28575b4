"""
Training speed against karpathy/nanochat in one run: our scripts.base_train and a reference checkout's own.

Both at the same depth, sequence length and batch, on the same pydocs shards with tokenizers of the same vocabulary,
`rounds` times in turn (bench/ab.py: why interleaved). tokens/s: each log's median over the steps after the first
five (as bench/quality.py reads them), then the median over the rounds. Each codebase picks its own compute dtype,
as a user's run would (088726a: fp32 on a CPU).

    python bench/vs_reference.py              # the seeds' Mac command: depth 4, 1 x 512 tokens a step
    python bench/vs_reference.py --depth=8 --device_batch_size=8 --tokens_per_step=8192
    python bench/vs_reference.py --anchor=head --ref=/tmp/nanochat-head
    python bench/vs_reference.py --decode     # the Engine's decoding instead, 1 and 8 samples

--decode: each codebase's Engine.generate on its own GPT of `depth` with random weights (the speed does not depend
on them), a prompt of `prompt_tokens`, `new_tokens` sampled at temperature 1, in the dtype its chat scripts use
(ours: nanochat/hardware.py's compute dtype; 088726a: fp32 off CUDA); tokens/s = samples x tokens after the first /
the time from the first token to the last (the steady rate), the median of 3 in each round.

The reference checkout and its environment are made as for bench/quality.py's anchors (bench/RESULTS.md,
"bench/quality.py: how each codebase is trained and scored"); the corpus, tokenizers and logs live under --work.
"""

import argparse
import json
import os
import re
import statistics
import sys

from quality import ANCHORS, DEFAULT_PATHS, ROOT, Codebase, ensure_tokenizer, parse_log, prepare_anchor, train_args

from ab import machine_line  # bench/ab.py


DECODE = r"""
import contextlib, json, sys, time, torch
from nanochat.engine import Engine
from nanochat.gpt import GPT, GPTConfig
from nanochat.tokenizer import get_tokenizer
depth = int(sys.argv[1])
batch_sizes = sys.argv[2].split(",")
new_tokens = int(sys.argv[3])
prompt_tokens = int(sys.argv[4])
tok = get_tokenizer()
width = 64 * depth
heads = max(1, -(-width // 128))
with torch.device("meta"):
    model = GPT(GPTConfig(sequence_len=2048, vocab_size=tok.get_vocab_size(), n_layer=depth, n_head=heads,
                          n_kv_head=heads, n_embd=width))
model.to_empty(device="cpu")
model.init_weights()
torch.manual_seed(0)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.02)
model.eval()
try:
    from nanochat.hardware import autocast_context  # ours: the chat scripts' compute dtype
    dtype, ctx = autocast_context("cpu")
except ImportError:  # 088726a: fp32 off CUDA, as its chat_cli
    dtype = "torch.float32"
    ctx = contextlib.nullcontext()
engine = Engine(model, tok)
prompt = [tok.get_bos_token_id()] + list(range(100, 100 + prompt_tokens - 1))
rates = {}
for b in batch_sizes:
    runs = []
    for _ in range(3):
        times = []
        with ctx:
            for _column in engine.generate(prompt, num_samples=int(b), max_tokens=new_tokens, temperature=1.0, seed=0):
                times.append(time.perf_counter())
        runs.append(int(b) * (len(times) - 1) / (times[-1] - times[0]))
    rates[b] = sorted(runs)[1]
print(json.dumps({"dtype": str(dtype), "rates": rates}))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--anchor", default="088", choices=list(ANCHORS), help="which karpathy/nanochat")
    parser.add_argument("--ref", default="", help="its checkout (default: bench/quality.py's path for the anchor)")
    parser.add_argument("--ref_python", default="/tmp/refvenv/bin/python", help="python of the reference's environment")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--device_batch_size", type=int, default=1)
    parser.add_argument("--tokens_per_step", type=int, default=512)
    parser.add_argument("--vocab_size", type=int, default=8192, help="vocabulary of both tokenizers")
    parser.add_argument("--steps", type=int, default=30, help="steps per run (the first five are left out)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode", action="store_true", help="time the Engine's decoding instead of training")
    parser.add_argument("--batch_sizes", default="1,8", help="--decode: samples of one prompt decoded together")
    parser.add_argument("--new_tokens", type=int, default=128, help="--decode: tokens sampled per sample")
    parser.add_argument("--prompt_tokens", type=int, default=32, help="--decode: prompt length")
    parser.add_argument("--work", default="/tmp/nanochat_vs_reference", help="corpus, tokenizers, checkpoints, logs")
    args = parser.parse_args()
    work = os.path.abspath(args.work)
    s = dict(depth=args.depth, seq_len=args.seq_len, device_batch_size=args.device_batch_size,
             tokens_per_step=args.tokens_per_step, steps=args.steps, device_type="cpu")
    print(f"depth {args.depth}, {args.device_batch_size} x {args.seq_len} tokens a micro-step, "
          f"{args.tokens_per_step:,} a step, vocab {args.vocab_size:,}, {args.steps} steps, {args.rounds} rounds\n"
          f"{machine_line()}", flush=True)

    ours = Codebase("ours", "ours", ROOT, sys.executable, os.path.join(work, "ours"))
    ours.run(["-m", "nanochat.dataset"], f"{work}/logs/ours_dataset.log", "building the pydocs corpus")
    ensure_tokenizer(ours, ["-m", "scripts.tok_train", f"--vocab_size={args.vocab_size}"], work)
    shard_dir = os.path.join(ours.base, "base_data", "pydocs")
    shards = sorted(os.path.join(shard_dir, f) for f in os.listdir(shard_dir)
                    if re.fullmatch(r"shard_\d{5}\.parquet", f))
    ref = prepare_anchor(args.anchor, os.path.abspath(args.ref or DEFAULT_PATHS[args.anchor]),
                         os.path.abspath(args.ref_python), work, shards, args.vocab_size, "")

    if args.decode:
        return decode(args, work, ours, ref)
    rates = {cb.name: [] for cb in (ours, ref)}
    dtypes = {}
    for r in range(args.rounds):
        for cb in (ref, ours) if r % 2 else (ours, ref):
            train, shown = train_args(cb, "q-speed-s0" if cb.name == "ours" else "s0", [], 0, False, s)
            _, out = cb.run(train, f"{work}/logs/{cb.name}_round{r}.log", f"base_train (round {r + 1})", shown=shown)
            tok_s, dtypes[cb.name] = parse_log(cb, out, "cpu")
            rates[cb.name].append(tok_s)
            print(f"  round {r + 1}: {cb.label}: {tok_s:,.0f} tok/s ({dtypes[cb.name]})", flush=True)
    report(args, rates, dtypes, ours, ref, "training tok/s")


def decode(args, work, ours, ref):
    rates = {(cb.name, b): [] for cb in (ours, ref) for b in args.batch_sizes.split(",")}
    dtypes = {}
    for r in range(args.rounds):
        for cb in (ref, ours) if r % 2 else (ours, ref):
            argv = ["-c", DECODE, str(args.depth), args.batch_sizes, str(args.new_tokens), str(args.prompt_tokens)]
            _, out = cb.run(argv, f"{work}/logs/{cb.name}_decode_round{r}.log", f"decoding (round {r + 1})",
                            shown="-c DECODE ...")
            result = json.loads(out.strip().splitlines()[-1])
            dtypes[cb.name] = result["dtype"]
            for b, rate in result["rates"].items():
                rates[(cb.name, b)].append(rate)
            print(f"  round {r + 1}: {cb.label}: {result['rates']} tok/s ({result['dtype']})", flush=True)
    for b in args.batch_sizes.split(","):
        print(f"\n{b} sample(s):")
        report(args, {cb.name: rates[(cb.name, b)] for cb in (ours, ref)}, dtypes, ours, ref, "decode tok/s")


def report(args, rates, dtypes, ours, ref, what):
    median = {name: statistics.median(v) for name, v in rates.items()}
    print(f"| codebase | compute dtype | {what} (median of {args.rounds}) | rounds |\n|---|---|---|---|")
    for cb in (ours, ref):
        print(f"| {cb.label} | {dtypes[cb.name]} | {median[cb.name]:,.0f} | "
              f"{', '.join(f'{v:,.0f}' for v in rates[cb.name])} |")
    print(f"ours / {ref.label}: {median['ours'] / median[ref.name]:.2f}x\n{machine_line()}")


if __name__ == "__main__":
    main()
