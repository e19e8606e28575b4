"""
Reads checkpoints of karpathy/nanochat's own code (commit 088726a, late 2025), as its released models are.

The layout, in one directory:
  model_<step:06d>.pt    torch.save of the model's state dict: our key names, maybe with an "_orig_mod." prefix
                         (saved from a torch.compile'd model); wte and lm_head padded to a multiple of 64 rows
                         (the rows past vocab_size are never trained: lm_head's stay 0, whose logit 15*tanh(0) = 0
                         would beat most real tokens, so they are cut off); the embedding may be bf16
  meta_<step:06d>.json   {"model_config": {sequence_len, vocab_size (unpadded), n_layer, n_head, n_kv_head,
                         n_embd}, "user_config": {...}, ...}
  tokenizer.pkl          a pickled tiktoken.Encoding (name, pat_str, mergeable_ranks, special_tokens)
  token_bytes.pt         an int32 tensor: per token id, the UTF-8 length of the token decoded on its own (its
                         tok_train's rule, decoded_token_bytes), 0 for special tokens. That is not ours (the raw
                         bytes, Tokenizer.compute_token_bytes) for a token holding part of a character (every byte
                         >= 0x80, merges that cut a character): it decodes to U+FFFD, 3 bytes each. Read only to
                         check that it belongs to tokenizer.pkl (either rule passes); the import writes ours
The tokenizer may instead sit in a tokenizer/ subdirectory, or in ../../tokenizer/ (that code's base dir layout:
<base>/chatsft_checkpoints/d32 beside <base>/tokenizer).

Its architecture is ours (same forward pass, same names), so the weights load as they are once the padding is cut.
Later versions of that code (2026: value embeddings, per-layer scalars, sliding windows) add settings and weights
that this reader, which knows the 2025 layout only, refuses, naming them: our GPT has the three as options
(gpt.GPTConfig; window_pattern follows HEAD's rule), but their checkpoints are not mapped onto it.
"""

import json
import os
import pickle
import re

import torch

from nanochat.hf_format import MODEL_CONFIG_KEYS, check_weight_names
from nanochat.output import UserError, error_line
from nanochat.tokenizer import Tokenizer


def find_steps(directory):
    """(steps with both model_<step>.pt and meta_<step>.json, steps with either) in `directory`, each sorted."""
    found = {"model": set(), "meta": set()}
    for name in os.listdir(directory):
        m = re.fullmatch(r"(model)_(\d+)\.pt|(meta)_(\d+)\.json", name)
        if m:
            found[m.group(1) or m.group(3)].add(int(m.group(2) or m.group(4)))
    return sorted(found["model"] & found["meta"]), sorted(found["model"] | found["meta"])


class _EncodingState:
    """Stands in for tiktoken.Encoding while unpickling: it receives the pickled state and runs nothing."""

    def __setstate__(self, state):
        self.state = state


class _TokenizerUnpickler(pickle.Unpickler):
    """Unpickles a tiktoken Encoding and nothing else: any other class or function in the file is refused."""

    def find_class(self, module, name):
        if (module, name) == ("tiktoken.core", "Encoding"):
            return _EncodingState
        raise UserError(f"{self.path} asks to load {module}.{name}: a tokenizer.pkl holds only a tiktoken Encoding, "
                        f"so it was refused (pickle files can run code)")


def read_tokenizer_pkl(path):
    """Our Tokenizer from a pickled tiktoken Encoding, with nanochat's 9 special tokens after the merges."""
    with open(path, "rb") as f:
        unpickler = _TokenizerUnpickler(f)
        unpickler.path = path
        try:
            obj = unpickler.load()
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"{path} is unreadable ({type(e).__name__}: {e})") from None
    state = getattr(obj, "state", None)
    if not isinstance(state, dict) or not {"pat_str", "mergeable_ranks", "special_tokens"} <= set(state):
        kind = f"the registered encoding {state!r}" if isinstance(state, str) else type(obj).__name__
        raise UserError(f"{path} holds {kind}, not a tiktoken Encoding with its merges")
    ranks = state["mergeable_ranks"]
    special = state["special_tokens"]
    if not isinstance(ranks, dict) or not all(isinstance(k, bytes) and isinstance(v, int) for k, v in ranks.items()):
        raise UserError(f"{path}: mergeable_ranks is not a {{bytes: int}} dict")
    try:
        tokenizer = Tokenizer(ranks, pattern=state["pat_str"])
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None
    if special != tokenizer.get_special_tokens():
        raise UserError(f"{path} has special tokens {special}, nanochat needs {tokenizer.get_special_tokens()}")
    return tokenizer


def decoded_token_bytes(tokenizer):
    """
    int32 tensor [vocab_size]: token_bytes.pt as karpathy/nanochat's scripts/tok_train.py computes it, the length in
    UTF-8 of each token decoded on its own (a partial character becomes one or more U+FFFD), 0 for special tokens.
    """
    ordinary = len(tokenizer.mergeable_ranks)  # the special tokens' ids follow
    sizes = [len(tokenizer.decode([i]).encode("utf-8")) for i in range(ordinary)]
    return torch.tensor(sizes + [0] * len(tokenizer.get_special_tokens()), dtype=torch.int32)


def find_tokenizer(directory):
    """The directory holding tokenizer.pkl: `directory`, its tokenizer/, or ../../tokenizer/. UserError if none."""
    places = [directory,
              os.path.join(directory, "tokenizer"),
              os.path.join(directory, os.pardir, os.pardir, "tokenizer")]
    for place in places:
        if os.path.exists(os.path.join(place, "tokenizer.pkl")):
            return os.path.normpath(place)
    raise UserError(f"no tokenizer.pkl for the checkpoint in {directory} "
                    f"(looked in {', '.join(os.path.normpath(p) for p in places)}): "
                    f"put the model's tokenizer.pkl and token_bytes.pt beside it")


def read_checkpoint(directory, step=-1):
    """
    (model_config, state dict with our names, unpadded and fp32, tokenizer, the checkpoint's meta, step) of the
    checkpoint of `step` (-1: the last) in `directory`.
    """
    complete, any_step = find_steps(directory)
    if step < 0:
        if not complete:
            have = f"model/meta files of step(s) {any_step} but not both of any" if any_step else "no model_<step>.pt"
            raise UserError(f"{directory} has {have}: not a complete karpathy/nanochat checkpoint")
        step = complete[-1]
    for name in (f"meta_{step:06d}.json", f"model_{step:06d}.pt"):
        if not os.path.exists(os.path.join(directory, name)):
            raise UserError(f"{directory} has no {name}"
                            + (f" (steps here: {', '.join(map(str, complete))})" if complete else ""))
    meta_path = os.path.join(directory, f"meta_{step:06d}.json")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        model_config = dict(meta["model_config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{meta_path} is not a checkpoint's meta file (no model_config: {type(e).__name__})") from None
    for key, value in model_config.items():
        if key not in MODEL_CONFIG_KEYS:
            raise UserError(f"{meta_path} has the setting {key}={value!r}, which nanochat's GPT does not have "
                            f"(a newer version of that code?): cannot import it")
    missing = [k for k in MODEL_CONFIG_KEYS if k not in model_config]
    if missing:
        raise UserError(f"{meta_path}: model_config lacks {', '.join(missing)}")
    tokenizer_dir = find_tokenizer(directory)
    tokenizer = read_tokenizer_pkl(os.path.join(tokenizer_dir, "tokenizer.pkl"))
    token_bytes_path = os.path.join(tokenizer_dir, "token_bytes.pt")
    if os.path.exists(token_bytes_path):  # written with the tokenizer: a mismatch means files of two tokenizers
        try:
            token_bytes = torch.load(token_bytes_path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise UserError(f"{token_bytes_path} is unreadable ({type(e).__name__})") from None
        try:
            token_bytes = torch.as_tensor(token_bytes).cpu().long()
        except (TypeError, ValueError, RuntimeError):
            raise UserError(f"{token_bytes_path} holds {type(token_bytes).__name__}, "
                            f"not a tensor of bytes per token") from None
        rules = (decoded_token_bytes(tokenizer), tokenizer.compute_token_bytes())  # its tok_train's, ours
        if not any(torch.equal(token_bytes, rule.long()) for rule in rules):
            raise UserError(f"{token_bytes_path} does not match {tokenizer_dir}/tokenizer.pkl: "
                            f"files of two different tokenizers")
    if tokenizer.get_vocab_size() != model_config["vocab_size"]:
        raise UserError(f"the tokenizer in {tokenizer_dir} has {tokenizer.get_vocab_size():,} tokens, the model "
                        f"{model_config['vocab_size']:,} (meta_{step:06d}.json): they do not belong together")
    model_path = os.path.join(directory, f"model_{step:06d}.pt")
    try:
        state = torch.load(model_path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise UserError(f"{model_path} is unreadable ({error_line(e)})") from None
    if not isinstance(state, dict):
        raise UserError(f"{model_path} does not hold a state dict")
    state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
    check_weight_names(state, model_config["n_layer"], hf=False, where=model_path)
    vocab_size = model_config["vocab_size"]
    for name in ("transformer.wte.weight", "lm_head.weight"):
        if state[name].size(0) < vocab_size:
            raise UserError(f"{model_path}: {name} has {state[name].size(0)} rows, fewer than vocab_size {vocab_size}")
        state[name] = state[name][:vocab_size]  # the padding rows (see the module docstring)
    state = {k: v.float().contiguous() for k, v in state.items()}
    return model_config, state, tokenizer, meta, step
