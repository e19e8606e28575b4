"""
Bits per byte of a trained base model, computed the same way in every nanochat codebase.

On the first documents of a validation shard: bench/quality.py runs it once per trained model, in that codebase's
own environment.

    cd <checkout> && NANOCHAT_BASE_DIR=<base> NANOCHAT_DTYPE=float32 <its python> /path/to/bench/quality_eval.py \
        --model_tag=s0 --val_shard=<base_data>/shard_00004.parquet --docs=990 --seq_len=512
    cd <checkout> && NANOCHAT_BASE_DIR=<base> <its python> /path/to/bench/quality_eval.py --check \
        --docs_for_tokens=65536 --val_shard=<shard>
    ... quality_eval.py --model_tag=s0 --steps=40,80,120 ...   # several checkpoints of one run (bench/ladder.py)

Runs in any of: this repository, karpathy/nanochat 088726a, karpathy/nanochat HEAD. It imports only torch,
pyarrow and the checkout's own modules (the checkout is the working directory, put first on sys.path), and
loads the model with that codebase's own loader: `nanochat.checkpoint_manager.load_model("base", device,
phase="eval", model_tag=...)`, the same call in all three, each returning (model, tokenizer, meta).

The number (why not each codebase's own val bpb: karpathy/nanochat's token_bytes.pt counts a token holding part
of a UTF-8 character as the 3 bytes of U+FFFD, and the three loaders pack rows differently):
- documents: the first `docs` documents of `val_shard`, read here with pyarrow (the same text for every model);
- each document alone: [BOS] + the model's tokenizer's ids, cut into windows of seq_len + 1 tokens that overlap
  by one (window k predicts targets k*seq_len+1 .. (k+1)*seq_len from the seq_len tokens before them, within the
  document), so every token after BOS is a target exactly once and no model sees another document;
- nats: the summed cross-entropy of the model's logits (fp32 weights and matmuls: on CUDA with TF32 off) over
  every non-BOS target, in float64;
- bpb = nats / ln 2 / bytes, bytes = sum of len(doc.encode("utf-8")) over the documents.
Prints one JSON line per checkpoint scored (--steps: each of them, in order; else the last), with the number of
parameters of every nn.Linear (a subclass included: HEAD's Linear), what bench/ladder.py counts FLOPs from.
--check prints, without a model, the validation shard the codebase's own data code
reads (bench/quality.py compares it with ours) and, with --docs_for_tokens=K, the number of first documents
that hold >= K target tokens by this codebase's tokenizer.
"""

import argparse
import inspect
import json
import math
import os
import sys
import time

sys.path.insert(0, os.getcwd())  # the checkout's `nanochat`, not a script directory's or an installed one

import pyarrow.parquet as pq
import torch
import torch.nn.functional as F


def val_shard_of_codebase():
    """The validation shard the codebase's own data code reads (ours: list_parquet_files("val"); theirs: the last)."""
    from nanochat import dataset
    if "split" in inspect.signature(dataset.list_parquet_files).parameters:  # ours
        return dataset.list_parquet_files("val")[0]
    return dataset.list_parquet_files()[-1]  # 088726a and HEAD: the last sorted parquet file is the val split


def documents(path, n=None):
    texts = pq.read_table(path, columns=["text"]).column("text").to_pylist()
    return texts if n is None else texts[:n]


def windows(ids, seq_len):
    """(inputs, targets) of one document's token ids (BOS first): windows of seq_len + 1 overlapping by one."""
    return [(ids[s:s + seq_len], ids[s + 1:s + seq_len + 1]) for s in range(0, len(ids) - 1, seq_len)]


def batches(rows, batch_tokens):
    """rows sorted longest first, grouped so that rows x the longest row's length stays within batch_tokens."""
    rows = sorted(rows, key=lambda r: -len(r[0]))  # similar lengths together: little padding
    chunk = []
    for row in rows:
        if chunk and (len(chunk) + 1) * len(chunk[0][0]) > batch_tokens:
            yield chunk
            chunk = []
        chunk.append(row)
    if chunk:
        yield chunk


@torch.no_grad()
def summed_nats(model, rows, bos, batch_tokens, device):
    """Sum of the cross-entropy over every non-BOS target of rows [(inputs, targets)]; (nats, targets counted)."""
    nats = 0.0
    counted = 0
    for chunk in batches(rows, batch_tokens):  # many short documents share one forward pass
        width = len(chunk[0][0])
        # right padding: causal, earlier positions unaffected
        x = torch.full((len(chunk), width), bos, dtype=torch.long)
        y = torch.full((len(chunk), width), -1, dtype=torch.long)
        for j, (inp, tgt) in enumerate(chunk):
            x[j, :len(inp)] = torch.tensor(inp)
            y[j, :len(tgt)] = torch.tensor(tgt)
        y[y == bos] = -1
        x = x.to(device)
        y = y.to(device)
        logits = model(x).float()
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1, reduction="none")
        nats += loss.double().sum().item()
        counted += int((y != -1).sum())
    return nats, counted


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--val_shard", required=True, help="parquet file with a `text` column: the documents")
    parser.add_argument("--docs", type=int, default=0, help="evaluate the first this many documents (0: all)")
    parser.add_argument("--seq_len", type=int, default=512, help="tokens of context per window")
    parser.add_argument("--model_tag", default="", help="base_checkpoints/<model_tag> under $NANOCHAT_BASE_DIR")
    parser.add_argument("--steps", default="",
                        help="comma-separated checkpoint steps to score, one JSON line each (default: the last)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where to run the model (fp32 either way)")
    parser.add_argument("--batch_tokens", type=int, default=4096,
                        help="token positions per forward pass (padding included)")
    parser.add_argument("--check", action="store_true",
                        help="no model: print the codebase's val shard (and --docs_for_tokens)")
    parser.add_argument("--docs_for_tokens", type=int, default=0,
                        help="with --check: documents needed for this many targets")
    args = parser.parse_args()

    if args.check:
        import nanochat
        out = dict(nanochat=os.path.realpath(nanochat.__file__), val_shard=os.path.realpath(val_shard_of_codebase()))
        if args.docs_for_tokens > 0:
            from nanochat.tokenizer import get_tokenizer
            tokenizer = get_tokenizer()
            total = 0
            texts = documents(args.val_shard)
            for n, text in enumerate(texts, 1):
                total += len(tokenizer.encode(text))
                if total >= args.docs_for_tokens:
                    break
            out.update(docs=n, tokens=total, shard_tokens_enough=total >= args.docs_for_tokens)
        print(json.dumps(out))
        return

    from nanochat.checkpoint_manager import load_model
    device = torch.device(args.device)
    texts = documents(args.val_shard, args.docs or None)
    num_bytes = sum(len(text.encode("utf-8")) for text in texts)
    rows = None  # tokenized once: every checkpoint of a run has the same tokenizer
    for step in [int(s) for s in args.steps.split(",") if s] or [None]:
        t0 = time.time()
        torch.manual_seed(0)
        model, tokenizer, meta = load_model("base", device, phase="eval", model_tag=args.model_tag, step=step)
        torch.set_float32_matmul_precision("highest")  # fp32 means fp32 on a GPU too (no TF32), whatever the loader set
        torch.backends.cudnn.allow_tf32 = False
        for p in model.parameters():  # fp32 weights whatever the training dtype; buffers stay as the code made them
            p.data = p.data.float()  # (088726a asserts its rotary tables are bf16)
        bos = tokenizer.get_bos_token_id()
        if rows is None:
            rows = [w for text in texts for w in windows(tokenizer.encode(text, prepend=bos), args.seq_len)]
        nats, targets = summed_nats(model, rows, bos, args.batch_tokens, device)
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        print(json.dumps(dict(bpb=nats / math.log(2) / num_bytes, nats=nats, targets=targets, bytes=num_bytes,
                              docs=len(texts), windows=len(rows), params=sum(p.numel() for p in model.parameters()),
                              linear_params=linear, vocab_size=tokenizer.get_vocab_size(),
                              model_config=meta.get("model_config"), step=meta.get("step", step),
                              seconds=time.time() - t0)), flush=True)


if __name__ == "__main__":
    main()
