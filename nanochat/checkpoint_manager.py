"""
Saving and loading checkpoints.

A checkpoint of step N in a directory like $NANOCHAT_BASE_DIR/base_checkpoints/d20/ is:
  model_{N:06d}.pt            the weights (written by rank 0: every rank holds the same full weights)
  optim_{N:06d}_rank{r}.pt    the optimizer state of rank r, one file per rank: DistMuon / DistAdamW shard
                              the optimizer state, so each rank owns a different part of it
  meta_{N:06d}.json           step, model config, training config, world size, dataloader and loop state;
                              written LAST, by rank 0, after every rank has finished its files. It is the
                              completion marker: a step without its meta file is incomplete and ignored.
Every file is written to a temporary name and renamed into place, so a crash never leaves a half-written
file under a real name, and a crash before the meta file never leaves a checkpoint that looks complete.
"""

import glob
import json
import os
import re

import torch
import torch.distributed as dist

from nanochat.common import UserError, get_base_dir, print0

SOURCES = {"base": "base_checkpoints", "mid": "mid_checkpoints", "sft": "chatsft_checkpoints", "rl": "chatrl_checkpoints"}


def _atomic_torch_save(obj, path):
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_json_save(obj, path):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def save_checkpoint(checkpoint_dir, step, model_state, optimizer_states, meta, rank=0):
    """
    Save step `step`. Under torchrun EVERY rank must call this (each writes its own optimizer shard, and
    the completion marker waits for all of them). `optimizer_states`: this rank's list of optimizer
    state_dicts, or None to save no optimizer state. `model_state` and `meta` are used on rank 0 only.
    """
    os.makedirs(checkpoint_dir, exist_ok=True)
    distributed = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if distributed else 1
    if optimizer_states is not None:
        _atomic_torch_save(optimizer_states, os.path.join(checkpoint_dir, f"optim_{step:06d}_rank{rank}.pt"))
    if rank == 0:
        _atomic_torch_save(model_state, os.path.join(checkpoint_dir, f"model_{step:06d}.pt"))
    if distributed:
        dist.barrier()  # every rank's files are in place before the marker says "complete"
    if rank == 0:
        meta = dict(meta, step=step, world_size=world_size, has_optimizer=optimizer_states is not None)
        _atomic_json_save(meta, os.path.join(checkpoint_dir, f"meta_{step:06d}.json"))
        print0(f"Saved checkpoint of step {step} to {checkpoint_dir}")


def _torch_load(path, device):
    if not os.path.exists(path):
        raise UserError(f"checkpoint file missing: {path}")
    try:
        return torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # truncated / corrupt: pickle, zip and EOF errors all land here
        raise UserError(f"checkpoint file {path} is unreadable (truncated or corrupt: {type(e).__name__}: {e}); "
                        f"delete that step's files or pick another step") from None


def load_checkpoint(checkpoint_dir, step, device, load_optimizer=False, rank=0):
    """Returns (model_state, optimizer_states or None, meta). Errors name the missing or broken file."""
    meta_path = os.path.join(checkpoint_dir, f"meta_{step:06d}.json")
    if not os.path.exists(meta_path):
        raise UserError(f"no complete checkpoint of step {step} in {checkpoint_dir} ({os.path.basename(meta_path)} missing)")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"checkpoint file {meta_path} is unreadable: {e}") from None
    model_state = _torch_load(os.path.join(checkpoint_dir, f"model_{step:06d}.pt"), device)
    optimizer_states = None
    if load_optimizer:
        if not meta.get("has_optimizer", False):
            raise UserError(f"checkpoint of step {step} in {checkpoint_dir} was saved without optimizer state")
        optimizer_states = _torch_load(os.path.join(checkpoint_dir, f"optim_{step:06d}_rank{rank}.pt"), device)
    return model_state, optimizer_states, meta


def find_last_step(checkpoint_dir):
    """The largest step with a complete checkpoint (its meta file exists). Incomplete saves are ignored."""
    steps = [int(m.group(1)) for f in glob.glob(os.path.join(checkpoint_dir, "meta_*.json"))
             if (m := re.fullmatch(r"meta_(\d+)\.json", os.path.basename(f)))]
    if not steps:
        raise UserError(f"no complete checkpoint in {checkpoint_dir}")
    return max(steps)


def find_model_tag(checkpoints_dir):
    """The single model tag under `checkpoints_dir`. Never guesses between several: asks for --model_tag."""
    if not os.path.isdir(checkpoints_dir):
        raise UserError(f"no checkpoints directory {checkpoints_dir}: run the stage that writes it first")
    tags = sorted(d for d in os.listdir(checkpoints_dir) if os.path.isdir(os.path.join(checkpoints_dir, d)))
    if not tags:
        raise UserError(f"no model in {checkpoints_dir}: run the stage that writes it first")
    if len(tags) > 1:
        raise UserError(f"several models in {checkpoints_dir}: {', '.join(tags)}; choose one with --model_tag=...")
    return tags[0]


def build_model(checkpoint_dir, step, device, phase):
    """Rebuild the GPT of a checkpoint on `device` (phase "train" or "eval"). Returns (model, meta)."""
    from nanochat.gpt import GPT, GPTConfig
    if phase not in ("train", "eval"):
        raise ValueError(f"phase must be 'train' or 'eval', got {phase!r}")
    model_state, _, meta = load_checkpoint(checkpoint_dir, step, device)
    # torch.compile wraps the model: its state dict keys carry an "_orig_mod." prefix; accept both
    model_state = {k.removeprefix("_orig_mod."): v for k, v in model_state.items()}
    config = GPTConfig(**meta["model_config"])
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_rotary()  # rotary tables are not in the checkpoint
    try:
        model.load_state_dict(model_state, strict=True, assign=True)
    except RuntimeError as e:
        raise UserError(f"checkpoint of step {step} in {checkpoint_dir} does not match its model config: {e}") from None
    model.train() if phase == "train" else model.eval()
    return model, meta


def load_model(source, device, phase, model_tag=None, step=None):
    """
    Load a model saved by a training stage: source "base" | "mid" | "sft" | "rl". model_tag defaults to
    the only tag present (an error lists them if there are several); step defaults to the last complete
    one. Returns (model, tokenizer, meta).
    """
    if source not in SOURCES:
        raise UserError(f"unknown checkpoint source {source!r}: use one of {', '.join(SOURCES)}")
    checkpoints_dir = os.path.join(get_base_dir(), SOURCES[source])
    model_tag = model_tag or find_model_tag(checkpoints_dir)
    checkpoint_dir = os.path.join(checkpoints_dir, model_tag)
    step = find_last_step(checkpoint_dir) if step is None or step < 0 else step
    print0(f"Loading {source} model {model_tag} step {step} from {checkpoint_dir}")
    model, meta = build_model(checkpoint_dir, step, device, phase)
    meta = dict(meta, model_tag=model_tag, checkpoint_dir=checkpoint_dir)
    from nanochat.tokenizer import get_tokenizer
    tokenizer = get_tokenizer()
    if tokenizer.get_vocab_size() != model.config.vocab_size:
        raise UserError(f"tokenizer vocab {tokenizer.get_vocab_size()} != model vocab {model.config.vocab_size}: "
                        f"the tokenizer in {get_base_dir()}/tokenizer is not the one this model was trained with")
    return model, tokenizer, meta
