"""
Train the BPE tokenizer on the training split of the selected corpus ($NANOCHAT_DATASET), and save it.

It goes to $NANOCHAT_BASE_DIR/tokenizer/ (merges, token_bytes.pt for bits per byte, metadata).

    python -m scripts.tok_train                                  # FineWeb-Edu, 65,536 tokens, up to 2B chars
    NANOCHAT_DATASET=pydocs python -m scripts.tok_train --vocab-size=8192   # offline, CPU-sized

Documents are cropped to doc_cap characters (so a handful of huge documents cannot dominate the pair
counts) and training stops after max_chars characters in total.
"""

import os
import time

from nanochat.configurator import check_config, configure
from nanochat.dataset import dataset_name, parquets_iter_batched
from nanochat.output import UserError, print0
from nanochat.report import get_report
from nanochat.rerun import RERUN_CHOICES, corpus_input, skip_if_done
from nanochat.tokenizer import SPECIAL_TOKENS, Tokenizer, get_tokenizer_dir

max_chars = 2_000_000_000  # train on at most this many characters of the train split
doc_cap = 10_000  # crop every document to its first doc_cap characters
vocab_size = 65536  # tokens in total: 256 bytes + merges + the special tokens
rerun = "no"  # auto (bash speedrun.sh): skip if this tokenizer was trained with the same settings on the same corpus
config = configure(globals())

if max_chars < 1 or doc_cap < 1:
    raise UserError(f"max_chars and doc_cap must be >= 1 (got max_chars={max_chars}, doc_cap={doc_cap})")
check_config(config, choices={"rerun": RERUN_CHOICES})
# What the tokenizer is made from: these settings and the corpus's shards; made already from them, and there
# (--rerun=auto), it says so and exits 0 here (nanochat/rerun.py)
made_from = skip_if_done("Tokenizer training", "tok_train", config, corpus_input(),
                         [os.path.join(get_tokenizer_dir(), "tokenizer.json")])
corpus = dataset_name()
print0(f"Training a tokenizer of {vocab_size:,} tokens ({len(SPECIAL_TOKENS)} special) on the train split of "
       f"{corpus}: at most {max_chars:,} chars, documents cropped to {doc_cap:,} chars")

# -----------------------------------------------------------------------------
# The text: documents of the train split, in order, cropped, until max_chars

seen = {"chars": 0, "docs": 0, "cropped_docs": 0, "cropped_chars": 0}  # filled in as rustbpe consumes the iterator


def text_iterator():
    for batch in parquets_iter_batched("train"):
        for doc in batch:
            if len(doc) > doc_cap:  # counted: a corpus of whole books would otherwise train on their first pages only
                seen["cropped_docs"] += 1
                seen["cropped_chars"] += len(doc) - doc_cap
            doc = doc[:min(doc_cap, max_chars - seen["chars"])]
            seen["chars"] += len(doc)
            seen["docs"] += 1
            yield doc
            if seen["chars"] >= max_chars:
                return


# -----------------------------------------------------------------------------
# Train and save

t0 = time.time()
tokenizer = Tokenizer.train_from_iterator(text_iterator(), vocab_size)
train_time = time.time() - t0
if seen["chars"] == 0:
    raise UserError(f"the train split of {corpus} has no text")
chars_per_s = seen["chars"] / train_time
tokenizer_dir = get_tokenizer_dir()
tokenizer.save(tokenizer_dir)

print0(f"Trained on {seen['docs']:,} documents, {seen['chars']:,} chars in {train_time:.2f}s "
       f"({chars_per_s:,.0f} chars/s)")
if seen["cropped_docs"]:
    share = seen["cropped_chars"] / (seen["cropped_chars"] + seen["chars"])
    print0(f"{seen['cropped_docs']:,} documents were longer than doc_cap={doc_cap:,}: {seen['cropped_chars']:,} chars "
           f"({100 * share:.0f}% of the text read) not trained on"
           + ("; for a corpus of long files, build it with --split=paragraph (python -m nanochat.dataset) or raise "
              "--doc_cap" if share > 0.1 else ""))
print0(f"Vocab size: {tokenizer.get_vocab_size():,} ({tokenizer.get_vocab_size() - 256 - len(SPECIAL_TOKENS):,} merges "
       f"+ 256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
print0(f"Saved to {tokenizer_dir}")

# Sanity: an exact round trip, and what the tokenization looks like (token boundaries)
sample = "The tokenizer splits 1234567 into pairs of digits; it's byte-level, so 한국어 and emoji 🙂 work too.\n"
ids = tokenizer.encode(sample)
if tokenizer.decode(ids) != sample:
    raise RuntimeError("the trained tokenizer does not round-trip its sample text")
print0(f"Sample: {len(sample.encode('utf-8'))} bytes -> {len(ids)} tokens "
       f"({len(sample.encode('utf-8')) / len(ids):.2f} bytes/token):")
print0(tokenizer.visualize_tokenization(ids))

token_bytes = tokenizer.compute_token_bytes()
regular = token_bytes[token_bytes > 0].float()
print0(f"Token lengths in bytes (special tokens excluded): min {int(regular.min())}, max {int(regular.max())}, "
       f"mean {regular.mean():.2f}")

get_report().log(section="Tokenizer training", made_from=made_from, data=[
    config,
    {
        "dataset": corpus,
        "train_docs": seen["docs"],
        "train_chars": seen["chars"],
        "train_time_s": train_time,
        "chars_per_s": round(chars_per_s),
        "trained_vocab_size": tokenizer.get_vocab_size(),
        "num_special_tokens": len(SPECIAL_TOKENS),
        "token_bytes_min": int(regular.min()),
        "token_bytes_max": int(regular.max()),
        "token_bytes_mean": float(regular.mean()),
    },
])
print0("Next: `python -m scripts.tok_eval` (compression vs GPT-2/GPT-4), then `python -m scripts.base_train`")
