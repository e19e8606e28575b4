"""
CORE evaluation throughput on this machine: evaluate_core's batched rows against one forward per example.

Examples/s of nanochat.core_eval.evaluate_core with rows of similar length batched together (several values of
batch_tokens) against one forward per example (the reference's way, batch_tokens=0), on the offline pydocs bundle.
Same model, same examples, so the outcomes must be identical; the bench checks it.

    python bench/core_eval.py                                  # depth 4, vocab 8192, 50 examples per task, CPU
    python bench/core_eval.py --max_per_task=400 --batch_tokens=4096,16384

Random weights (the cost of a forward does not depend on them). Uses the pydocs corpus and a tokenizer of
`vocab_size` in $NANOCHAT_BASE_DIR (default: the private bench directory of bench/base_train.py), building
them if missing.
"""

import os
import platform
import tempfile
import time

import torch

os.environ.setdefault("NANOCHAT_BASE_DIR", os.path.join(tempfile.gettempdir(), "nanochat_bench"))
os.environ["NANOCHAT_DATASET"] = "pydocs"

from nanochat.configurator import configure
from nanochat.core_eval import evaluate_core, prepare_bundle
from nanochat.dataset import parquets_iter_batched
from nanochat.gpt import GPT, config_from_depth
from nanochat.output import print0
from nanochat.processes import compute_init
from nanochat.tokenizer import Tokenizer, get_tokenizer_dir

depth = 4  # model depth
max_seq_len = 512  # the model's context (longer prompts are cropped)
vocab_size = 8192  # tokenizer vocabulary
max_per_task = 50  # examples per task of the offline bundle (6 tasks)
batch_tokens = "2048,8192,32768"  # comma-separated batch_tokens values to measure against one example per forward
repeats = 2  # timed runs per setting (the best is reported)
device_type = "cpu"
config = configure(globals())

ddp, rank, local_rank, world_size, device = compute_init(device_type)
tok_dir = get_tokenizer_dir()
tokenizer = Tokenizer.from_directory(tok_dir) if os.path.exists(os.path.join(tok_dir, "tokenizer.json")) else None
if tokenizer is None or tokenizer.get_vocab_size() != vocab_size:
    texts = (doc for batch in parquets_iter_batched("train") for doc in batch)
    tokenizer = Tokenizer.train_from_iterator(texts, vocab_size)
    tokenizer.save(tok_dir)
t0 = time.time()
bundle_dir = prepare_bundle("offline")
print0(f"offline bundle ready in {time.time() - t0:.1f} s: {bundle_dir}")

torch.manual_seed(0)
model = GPT(config_from_depth(depth, vocab_size=vocab_size, sequence_len=max_seq_len)).to(device)
model.init_weights()
with torch.no_grad():  # init_weights zeroes the head: every option would tie
    model.lm_head.weight.normal_(0, 1.0)
model.eval()
print0(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
       f"depth {depth}, vocab {vocab_size}, {model.num_params():,} params, {max_per_task} examples per task")

sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
counted = {"forwards": 0, "tokens": 0}  # padded tokens through the model, per run


def count(module, args, output):
    counted["forwards"] += 1
    counted["tokens"] += args[0].numel()


model.register_forward_hook(count)
settings = [0] + [int(b) for b in batch_tokens.split(",")]
best = {}
stats = {}
outcomes = {}
for _ in range(repeats):  # settings interleaved, best of `repeats`: drifting load on a shared machine hits all alike
    for setting in settings:
        counted.update(forwards=0, tokens=0)
        sync()
        t0 = time.perf_counter()
        results = evaluate_core(model, tokenizer, device, bundle_dir, max_per_task=max_per_task, batch_tokens=setting,
                                verbose=False)
        sync()
        best[setting] = min(best.get(setting, float("inf")), time.perf_counter() - t0)
        stats[setting] = (counted["forwards"], counted["tokens"], sum(r["examples"] for r in results["tasks"].values()))
        outcomes[setting] = {label: r["correct"] for label, r in results["tasks"].items()}
for setting in settings:
    forwards, tokens, examples = stats[setting]
    name = "one example per forward" if setting == 0 else f"batched, batch_tokens={setting}"
    print0(f"{name:<32} {examples} examples in {best[setting]:6.2f} s: {examples / best[setting]:7.1f} examples/s, "
           f"{forwards} forwards, {tokens:,} padded tokens ({tokens / best[setting]:,.0f} tokens/s)"
           f"{'' if outcomes[setting] == outcomes[0] else '  OUTCOMES DIFFER: ' + str(outcomes[setting])}")
print0(f"correct per task (same in every setting): {outcomes[0]}")
