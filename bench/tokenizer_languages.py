"""
Tokenizer compression by language and vocab size: bytes and characters per token on held-out text.

Trains our BPE tokenizer on each language's text exactly as scripts/tok_train.py does (Tokenizer.train_from_iterator,
documents of at most doc_cap characters, at most max_chars in all) at every vocab size, then measures UTF-8 bytes and
characters per token on held-out text of that language, next to GPT-2's and GPT-4's tokenizers when tiktoken has
their files cached (never downloaded here).

    python bench/tokenizer_languages.py                                      # en and zh, vocab 4096, 8192, 32768
    python bench/tokenizer_languages.py --langs=ja:/data/ja,en:/data/en --vocab-sizes=8192,65536

A language is a directory of UTF-8 *.txt files, paragraphs separated by blank lines. Held out: every
val_every-th paragraph of each file (the 20th, 40th, ... counting from the file's start), so validation samples
every document evenly; the held-out paragraphs of a file, joined by blank lines, are encoded as one text. Training:
each file's other paragraphs, cut at paragraph boundaries into documents of at most doc_cap characters (tok_train
crops its documents to doc_cap; cropping whole book chapters would lose most of the text), a longer paragraph
cropped to doc_cap.

The default corpora are Debian documentation in English and Simplified Chinese (Debian 12 "bookworm" packages):
  - debian-reference-en 2.100, debian-reference-zh-cn 2.100: the HTML chapters (pr01, ch01..ch12, apa), converted
    with Python's html.parser to one paragraph per block (navigation and table of contents dropped), e.g.
    /tmp/corpora/{en,zh}/ch01.txt;
  - manpages-zh 1.6.4.0-1: the 274 zh_CN man pages whose English page (same name and section) is installed on the
    machine (coreutils, manpages, systemd, manpages-dev, ...), both rendered with
    `groff -k -Tutf8 -mandoc -rLL=3000n -rHY=0 -P-c -P-b -P-u` (no line wrapping), dedented, header and footer
    dropped: /tmp/corpora/{en,zh}/man-<name>.<section>.txt.
  The same file names in both (parallel texts, roughly paragraph for paragraph). Their sizes: bench/RESULTS.md,
  "Issue 38: compression by language and vocabulary".
"""

import glob
import hashlib
import os
import tempfile
import time

import tiktoken

from nanochat.configurator import configure
from nanochat.output import UserError, print0
from nanochat.tokenizer import Tokenizer

langs = "en:/tmp/corpora/en,zh:/tmp/corpora/zh"  # comma-separated name:directory of *.txt files
vocab_sizes = "4096,8192,32768"  # comma-separated vocab sizes to train (special tokens included)
val_every = 20  # hold out every val_every-th paragraph of each file
doc_cap = 10_000  # training documents of at most this many characters (tok_train's default)
max_chars = 2_000_000_000  # train on at most this many characters per language (tok_train's default)
config = configure(globals())

try:
    LANGS = [(name.strip(), path.strip()) for name, path in (item.split(":", 1) for item in langs.split(","))]
    VOCAB_SIZES = [int(v) for v in vocab_sizes.split(",")]
except ValueError:
    raise UserError(f"--langs is name:dir,name:dir,... and --vocab-sizes is n,n,... (got {langs!r}, {vocab_sizes!r})")
if val_every < 2 or doc_cap < 1 or max_chars < 1:
    raise UserError(f"need val_every >= 2, doc_cap >= 1, max_chars >= 1 (got {val_every}, {doc_cap}, {max_chars})")

# -----------------------------------------------------------------------------
# Text: train and validation parts of each language


def split_language(directory):
    """(train texts, val texts) of the *.txt files in `directory`: each file's every val_every-th paragraph is val."""
    paths = sorted(glob.glob(os.path.join(directory, "*.txt")))
    if not paths:
        raise UserError(f"no *.txt files in {directory}")
    train = []
    val = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            paras = f.read().split("\n\n")
        train.append("\n\n".join(p for i, p in enumerate(paras) if i % val_every != val_every - 1))
        held_out = [p for i, p in enumerate(paras) if i % val_every == val_every - 1]
        if held_out:
            val.append("\n\n".join(held_out))
    return train, val


def documents(texts, seen):
    """Training documents: each text cut at paragraph boundaries into pieces of <= doc_cap chars, until max_chars."""
    for text in texts:
        doc = ""
        for para in text.split("\n\n"):
            para = para[:doc_cap]
            if doc and len(doc) + 2 + len(para) > doc_cap:
                yield from emit(doc, seen)
                doc = para
            else:
                doc = doc + "\n\n" + para if doc else para
            if seen["chars"] >= max_chars:
                return
        if doc:
            yield from emit(doc, seen)


def emit(doc, seen):
    doc = doc[:max_chars - seen["chars"]]
    seen["chars"] += len(doc)
    if doc:
        yield doc


# -----------------------------------------------------------------------------
# GPT-2 / GPT-4 from tiktoken's cache only (scripts/tok_eval.py downloads them; this bench never touches the network)

REFERENCE = {
    "GPT-2": ("gpt2", ["https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
                       "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json"]),
    "GPT-4": ("cl100k_base", ["https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"]),
}


def cached_reference(encoding_name, urls):
    """The tiktoken Encoding if all its files are in tiktoken's cache (same rule as tiktoken.load), else None."""
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get(
        "DATA_GYM_CACHE_DIR", os.path.join(tempfile.gettempdir(), "data-gym-cache")))
    if not cache_dir or not all(os.path.exists(os.path.join(cache_dir, hashlib.sha1(u.encode()).hexdigest()))
                                for u in urls):
        return None
    return tiktoken.get_encoding(encoding_name)


references = {label: cached_reference(*spec) for label, spec in REFERENCE.items()}

# -----------------------------------------------------------------------------
# Train and measure

header = ["language", "vocab", "train chars", "train s", "val bytes", "val chars", "val tokens", "bytes/token",
          "chars/token"] + [f"{label} bytes/token" for label in references]
rows = []
for lang, directory in LANGS:
    train_texts, val_texts = split_language(directory)
    val_bytes = sum(len(t.encode("utf-8")) for t in val_texts)
    val_chars = sum(len(t) for t in val_texts)
    if val_bytes == 0:
        raise UserError(f"{directory}: nothing held out (every file has < {val_every} paragraphs): lower --val-every")
    ref_cols = []
    for label, encoding in references.items():
        if encoding is None:
            ref_cols.append("n/a (not cached)")
        else:
            n = sum(len(ids) for ids in encoding.encode_ordinary_batch(val_texts))
            ref_cols.append(f"{val_bytes / n:.2f}")
    print0(f"{lang}: {directory}, {len(train_texts)} files, "
           f"{sum(len(t) for t in train_texts):,} train / {val_chars:,} val chars")
    for vocab_size in VOCAB_SIZES:
        seen = {"chars": 0}
        t0 = time.perf_counter()
        tokenizer = Tokenizer.train_from_iterator(documents(train_texts, seen), vocab_size)
        train_s = time.perf_counter() - t0
        ids = tokenizer.encode(val_texts)
        assert all(tokenizer.decode(x) == t for x, t in zip(ids, val_texts)), "round trip failed"
        n_tokens = sum(len(x) for x in ids)
        real = tokenizer.get_vocab_size()
        rows.append([lang, f"{real:,}" + ("" if real == vocab_size else f" (of {vocab_size:,})"), f"{seen['chars']:,}",
                     f"{train_s:.1f}", f"{val_bytes:,}", f"{val_chars:,}", f"{n_tokens:,}",
                     f"{val_bytes / n_tokens:.2f}", f"{val_chars / n_tokens:.2f}"] + ref_cols)

widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(header, widths)) + " |",
         "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
lines += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
print0(f"Held-out compression (higher = fewer tokens); val: every {val_every}th paragraph; train: doc_cap={doc_cap:,}")
print0("\n".join(lines))
