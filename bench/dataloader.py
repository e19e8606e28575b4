"""
Data loader throughput on this machine: how fast tokenizing_distributed_data_loader produces micro-batches.

Parquet read + tokenization on threads + batching, to compare with what the trainer consumes (bench/base_train.py).
The loader must not be what limits training: target >= 10x the trainer's tokens/s.

    python bench/dataloader.py                  # pydocs, vocab 8192, B=8, T=512, the CPU speedrun's batch
    python bench/dataloader.py --bos_aligned=true

Uses the pydocs corpus and the tokenizer in $NANOCHAT_BASE_DIR (default: the bench directory of
bench/base_train.py, which builds them; run that first).
"""

import os
import tempfile
import time

os.environ.setdefault("NANOCHAT_BASE_DIR", os.path.join(tempfile.gettempdir(), "nanochat_bench"))
os.environ["NANOCHAT_DATASET"] = "pydocs"

from nanochat.configurator import configure
from nanochat.dataloader import tokenizing_distributed_data_loader
from nanochat.output import print0
from nanochat.tokenizer import get_tokenizer

device_batch_size = 8  # B
max_seq_len = 512  # T
total_batch_size = 8192  # tokens per optimizer step: sets the number of data slots
tokens = 2_000_000  # how many tokens to pull through the loader
bos_aligned = False  # measure the best-fit BOS-aligned rows instead of the plain stream
tokenizer_threads = 4  # threads tiktoken encodes with
config = configure(globals())

tokenizer = get_tokenizer()
t0 = time.perf_counter()
loader = tokenizing_distributed_data_loader(device_batch_size, max_seq_len, "train", "cpu", tokenizer=tokenizer,
                                            total_batch_size=total_batch_size, bos_aligned=bos_aligned,
                                            tokenizer_threads=tokenizer_threads)
next(loader)
t_first = time.perf_counter() - t0
n_batches = tokens // (device_batch_size * max_seq_len)
t0 = time.perf_counter()
for _ in range(n_batches):
    next(loader)
dt = time.perf_counter() - t0
tok_s = n_batches * device_batch_size * max_seq_len / dt
print0(f"vocab {tokenizer.get_vocab_size()}, B={device_batch_size}, T={max_seq_len}, slots {loader.num_slots}, "
       f"bos_aligned={bos_aligned}, threads={tokenizer_threads}")
print0(f"first batch after {t_first * 1000:.0f} ms; then {n_batches} batches in {dt:.2f} s: {tok_s:,.0f} tokens/s "
       f"({1000 * dt / n_batches:.2f} ms per batch), epoch {loader.epoch}"
       + (f", {100 * loader.leftover_fraction():.1f}% of tokens trained without their document's start, "
          f"{100 * loader.dropped_fraction():.1f}% dropped" if bos_aligned else ""))
