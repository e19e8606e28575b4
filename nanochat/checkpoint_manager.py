"""
Checkpoints: saving and loading them (load_model, load_for_resume), their optimizer state, a run's directory.

A checkpoint of step N in a directory like $NANOCHAT_BASE_DIR/base_checkpoints/d20/ is:
  model_{N:06d}.pt            the weights (written by rank 0: every rank holds the same full weights)
  optim_{N:06d}_rank{r}.pt    the optimizer state rank r held, one file per rank (DistMuon / DistAdamW shard
                              the optimizer state), in a form any world size can load (optimizer_shard)
  meta_{N:06d}.json           step, model config, training config, world size, tokenizer fingerprint, data
                              settings, dataloader and loop state; written LAST, by rank 0, after every rank
                              has finished its files. It is the completion marker: a step without its meta
                              file is incomplete and ignored.
Every file is written through files.atomic_write (a temporary name, then a rename), so a crash never leaves
a half-written file under a real name, and a crash before the meta file never leaves a checkpoint that looks
complete. A write that fails (a full disk) fails the save on every rank, in one line, and removes its files; the
earlier checkpoints stay as they were, and the next run removes what a save cut off by a kill left. The directory
also holds the run's `metrics.jsonl` (one line per step, for the report's curves;
nanochat/stage.py writes it), `.lock` (see claim_checkpoint_dir), and an imported model's own `tokenizer/`
(nanochat/tokenizer.py: checkpoint_tokenizer).

What a checkpoint must record to be trusted (checked on load):
  - the tokenizer's fingerprint: token ids only mean something with the tokenizer they were trained with;
  - the data stream settings (for a resume): what data step N+1 reads depends on them.
"""

import glob
import json
import os
import re
import socket

import torch
import torch.distributed as dist

from nanochat.files import DiskFull, atomic_write, get_base_dir, out_of_space, write_json
from nanochat.optim import rows_of
from nanochat.output import UserError, error_line, format_bytes, print0
from nanochat.ranks import gather_from_ranks, is_distributed

SOURCES = {"base": "base_checkpoints", "mid": "mid_checkpoints", "sft": "chatsft_checkpoints",
           "rl": "chatrl_checkpoints"}
STAGE_COMMANDS = {"base": "python -m scripts.base_train", "mid": "python -m scripts.mid_train",
                  "sft": "python -m scripts.chat_sft", "rl": "python -m scripts.chat_rl"}
CHECKPOINT_FILE = re.compile(r"^(?:model_(\d+)\.pt|optim_(\d+)_rank\d+\.pt|meta_(\d+)\.json)$")
TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


class CheckpointUnreadable(UserError):
    """A checkpoint file is missing or cannot be read (truncated, corrupt): load_model then tries the previous step."""


# -----------------------------------------------------------------------------
# Where checkpoints live


def source_dir(source):
    """<base_dir>/<the directory of stage `source`'s models> (SOURCES)."""
    if source not in SOURCES:
        raise UserError(f"unknown checkpoint source {source!r}: use one of {', '.join(SOURCES)}")
    return os.path.join(get_base_dir(), SOURCES[source])


def checkpoint_dir_for(source, model_tag):
    """<base_dir>/<source's directory>/<model_tag>, after checking that the tag is a plain name."""
    return os.path.join(source_dir(source), check_model_tag(model_tag))


def check_model_tag(model_tag):
    """
    A model tag is a directory NAME under the checkpoint root: letters, digits, '.', '_', '-', not starting
    with '.' or '-'. Anything with a path separator or '..' could write outside the checkpoint root.
    """
    if not TAG.match(model_tag or ""):
        raise UserError(f"--model_tag={model_tag!r} is not a plain name: use letters, digits, '.', '_' and '-' "
                        f"(no '/', no leading '.'), e.g. --model_tag=d20-long")
    return model_tag


# -----------------------------------------------------------------------------
# The run's claim on its directory


def claim_checkpoint_dir(checkpoint_dir, resume_from_step=-1, overwrite=False):
    """
    Call on every rank at the start of a training stage, before any work. Rank 0 takes an exclusive lock
    on `checkpoint_dir` for the life of the process (released by the OS when the process ends, however it
    ends), so two runs can never write into one directory; a second run fails at once naming the holder.
    Then it checks what the directory holds against what this run is about to do:
      - a fresh run (resume_from_step < 0) refuses a directory that already holds checkpoints;
      - a resume from step N refuses a directory that holds steps after N (they would be the earlier run's
        future, and "the latest step" would later pick one of them as if it were this run's);
    `overwrite` deletes those checkpoints instead of refusing. What saves that were cut off left (killed, or failed
    where a rank could not clean up) is removed: temporary files, and the files of a step without its meta file
    (never loadable). Every rank raises the same UserError if rank 0 refuses.
    """
    error = None
    rank = dist.get_rank() if is_distributed() else 0
    if rank == 0:
        try:
            _claim(checkpoint_dir, resume_from_step, overwrite)
        except UserError as e:
            error = str(e)
    if is_distributed():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise UserError(error)


_held_locks = {}  # checkpoint_dir -> open file holding the lock (kept open: closing it would release it)


def _claim(checkpoint_dir, resume_from_step, overwrite):
    import fcntl
    os.makedirs(checkpoint_dir, exist_ok=True)
    path = os.path.join(checkpoint_dir, ".lock")
    if checkpoint_dir not in _held_locks:
        f = open(path, "a+", encoding="utf-8")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise UserError(f"{checkpoint_dir} is in use by another run ({holder}): wait for it to finish, or "
                            f"write to another directory with --model_tag=...") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        _held_locks[checkpoint_dir] = f
    files = os.listdir(checkpoint_dir)
    for name in files:  # we hold the lock: any temporary file here is from a save that was killed
        if ".tmp" in name:
            os.remove(os.path.join(checkpoint_dir, name))
    steps = sorted({int(next(g for g in m.groups() if g)) for name in files if (m := CHECKPOINT_FILE.match(name))})
    complete = complete_steps(checkpoint_dir)
    cut_off = [s for s in steps if s not in complete]
    for step in cut_off:
        delete_checkpoint(checkpoint_dir, step)
    if cut_off:
        print0(f"Removed the files of step(s) {', '.join(map(str, cut_off))} in {checkpoint_dir}: a save cut off "
               f"before its meta file, never loadable")
    stale = [s for s in complete if s > resume_from_step]
    if not stale:
        return
    if overwrite:  # the files of later steps are those of complete ones now: the others were removed above
        for step in stale:
            delete_checkpoint(checkpoint_dir, step)
        if resume_from_step < 0 and os.path.exists(os.path.join(checkpoint_dir, "metrics.jsonl")):
            os.remove(os.path.join(checkpoint_dir, "metrics.jsonl"))
        print0(f"--overwrite: deleted the checkpoints of step(s) {', '.join(map(str, stale))} in {checkpoint_dir}")
        return
    shown = ", ".join(map(str, complete[-5:]))
    if resume_from_step < 0:
        raise UserError(f"{checkpoint_dir} already holds checkpoints of an earlier run (steps {shown}): resume with "
                        f"--resume_from_step={complete[-1]}, pick another --model_tag, or add --overwrite to delete "
                        f"them first")
    raise UserError(f"{checkpoint_dir} holds checkpoints after step {resume_from_step} (steps "
                    f"{', '.join(map(str, stale))}) that this resumed run would mix with its own: resume from the "
                    f"latest (--resume_from_step={complete[-1]}) or add --overwrite to delete the later ones")


# -----------------------------------------------------------------------------
# Saving and loading


def save_checkpoint(checkpoint_dir, step, model_state, optimizer_shard, meta, rank=0):
    """
    Save step `step`. Under torchrun EVERY rank must call this (each writes its own optimizer file, and
    the completion marker waits for all of them). `optimizer_shard`: this rank's optimizer state (what
    optimizer_shard() returns), or None to save none. `model_state` and `meta` are used on rank 0.
    A write that fails on any rank fails the save on every rank, so none is left waiting for another: each removes
    the files it wrote of this step, and all raise the same error; a full disk (or quota) is one line (DiskFull)
    saying where, how much the checkpoint needs and how much is free, and how to resume. Earlier steps are untouched.
    """
    os.makedirs(checkpoint_dir, exist_ok=True)
    world_size = dist.get_world_size() if is_distributed() else 1
    files = []  # (name, what is saved in it): this rank's files
    if optimizer_shard is not None:
        files.append((f"optim_{step:06d}_rank{rank}.pt", optimizer_shard))
    if rank == 0:
        files.append((f"model_{step:06d}.pt", model_state))
    written = []

    def write_files():
        for name, obj in files:
            written.append(os.path.join(checkpoint_dir, name))
            with atomic_write(written[-1]) as f:
                torch.save(obj, f)

    def write_marker():
        if rank == 0:
            full_meta = dict(meta, step=step, world_size=world_size, has_optimizer=optimizer_shard is not None)
            written.append(os.path.join(checkpoint_dir, f"meta_{step:06d}.json"))
            write_json(written[-1], full_meta, indent=2)

    try:
        # the agreement after the files is also the barrier: every rank's files are in place before the marker
        # says "complete"
        needed = _save_on_every_rank(write_files, written, checkpoint_dir, step,
                                     sum(saved_bytes(obj) for _, obj in files))
        _save_on_every_rank(write_marker, written, checkpoint_dir, step, needed)
    except BaseException:
        for path in written:
            if os.path.exists(path):
                os.remove(path)
        raise
    print0(f"Saved checkpoint of step {step} to {checkpoint_dir}")


def saved_bytes(obj):
    """About the bytes torch.save writes for `obj`: the storages of its tensors, each once (a view saves all of its)."""
    storages = {}

    def walk(x):
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk(obj)
    return sum(storages.values())


def _save_on_every_rank(write, written, checkpoint_dir, step, needed):
    """
    One phase of a save: write() on every rank, then one all_gather of what happened (and of each rank's bytes,
    `needed`); returns the checkpoint's bytes on all ranks. If write() failed on any rank, every rank removes the
    files of this step it wrote (`written`), waits for the others to have done so (the free space reported is then
    the next attempt's), and raises: a full disk anywhere a DiskFull, the same line on every rank; another error its
    own exception on the rank it happened on, a UserError naming that rank on the others.
    """
    error = None
    try:
        write()
    except BaseException as e:  # held until every rank knows: raising now would leave the others in the gather
        error = e
    outcome = None if error is None else (out_of_space(error), f"{type(error).__name__}: {error}")
    outcomes = gather_from_ranks((needed, outcome))
    needed = sum(n for n, _ in outcomes)
    failed = [(r, o) for r, (_, o) in enumerate(outcomes) if o is not None]
    if not failed:
        return needed
    for path in written:
        if os.path.exists(path):
            os.remove(path)
    if is_distributed():
        dist.barrier()
    full = next((reason for _, (reason, _) in failed if reason is not None), None)
    if full is not None:
        earlier = [s for s in complete_steps(checkpoint_dir) if s < step]
        if earlier:
            again = (f"free space, then resume from step {earlier[-1]}, which is intact: --resume_from_step="
                     f"{earlier[-1]} (with --rerun=auto, as speedrun.sh runs the stages, the same command resumes by "
                     f"itself)")
        else:
            again = "free space, then run the same command again"
        raise DiskFull(full, f"the checkpoint of step {step}", checkpoint_dir, f"about {format_bytes(needed)}",
                       again) from None
    if error is not None:
        raise error
    rank, (_, text) = failed[0]
    raise UserError(f"the checkpoint of step {step} was not saved: rank {rank} failed to write its part ({text}); "
                    f"nothing of step {step} was kept")


def _torch_load(path, device):
    if not os.path.exists(path):
        raise CheckpointUnreadable(f"checkpoint file missing: {path}")
    try:
        # mmap: tensors are read from the file as they are used, not all at once (the optimizer files of
        # every rank are opened by every rank when resuming on a different world size)
        return torch.load(path, map_location=device, weights_only=True, mmap=True)
    except Exception as e:  # truncated / corrupt: pickle, zip and EOF errors all land here
        raise CheckpointUnreadable(f"checkpoint file {path} is unreadable (truncated or corrupt: {error_line(e)}); "
                                   f"delete that step's files or pick another step") from None


def read_meta(checkpoint_dir, step):
    meta_path = os.path.join(checkpoint_dir, f"meta_{step:06d}.json")
    if not os.path.exists(meta_path):
        raise UserError(f"no complete checkpoint of step {step} in {checkpoint_dir} ({os.path.basename(meta_path)} "
                        f"missing)")
    try:
        with open(meta_path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointUnreadable(f"checkpoint file {meta_path} is unreadable: {e}") from None


def load_checkpoint(checkpoint_dir, step, device, load_optimizer=False):
    """
    Returns (model_state, optimizer_shards or None, meta). optimizer_shards: what every rank of the saving
    run saved (a list, one entry per saving rank), for load_optimizer_shards.
    Errors name the missing or broken file.
    """
    meta = read_meta(checkpoint_dir, step)
    model_state = _torch_load(os.path.join(checkpoint_dir, f"model_{step:06d}.pt"), device)
    optimizer_shards = None
    if load_optimizer:
        if not meta.get("has_optimizer", False):
            raise UserError(f"checkpoint of step {step} in {checkpoint_dir} was saved without optimizer state")
        optimizer_shards = [_torch_load(os.path.join(checkpoint_dir, f"optim_{step:06d}_rank{r}.pt"), "cpu")
                            for r in range(meta["world_size"])]
    return model_state, optimizer_shards, meta


def complete_steps(checkpoint_dir):
    """The steps with a complete checkpoint (their meta file exists), in increasing order."""
    return sorted(int(m.group(1)) for f in glob.glob(os.path.join(checkpoint_dir, "meta_*.json"))
                  if (m := re.fullmatch(r"meta_(\d+)\.json", os.path.basename(f))))


def delete_checkpoint(checkpoint_dir, step):
    """Delete the checkpoint of `step`: its meta file first, so that it is never taken for a complete one midway."""
    names = sorted(os.listdir(checkpoint_dir), key=lambda name: not name.startswith("meta_"))
    for name in names:
        m = CHECKPOINT_FILE.match(name)
        if m and int(next(g for g in m.groups() if g)) == step:
            os.remove(os.path.join(checkpoint_dir, name))


def find_checkpoint_dir(source, model_tag=None):
    """(model_tag, checkpoint_dir) of stage `source`'s model `model_tag`, or of its only model if no tag is given."""
    model_tag = model_tag or find_model_tag(source_dir(source), STAGE_COMMANDS[source])
    return model_tag, checkpoint_dir_for(source, model_tag)


def find_model_tag(checkpoints_dir, stage_command=None):
    """The single model tag under `checkpoints_dir`. Never guesses between several: asks for --model_tag."""
    hint = f": run `{stage_command}` first" if stage_command else ": run the stage that writes it first"
    if not os.path.isdir(checkpoints_dir):
        raise UserError(f"no checkpoints directory {checkpoints_dir}{hint}")
    # only names a tag can have: not the hidden temporary directory of an import being written (or killed)
    tags = sorted(d for d in os.listdir(checkpoints_dir)
                  if TAG.match(d) and os.path.isdir(os.path.join(checkpoints_dir, d)))
    if not tags:
        raise UserError(f"no model in {checkpoints_dir}{hint}")
    if len(tags) > 1:
        raise UserError(f"several models in {checkpoints_dir}: {', '.join(tags)}; choose one with --model_tag=...")
    return tags[0]


def build_model(checkpoint_dir, step, device, phase):
    """Rebuild the GPT of a checkpoint on `device` (phase "train" or "eval"). Returns (model, meta)."""
    if phase not in ("train", "eval"):
        raise ValueError(f"phase must be 'train' or 'eval', got {phase!r}")
    model_state, _, meta = load_checkpoint(checkpoint_dir, step, device)
    model = model_from_state(model_state, meta, device, where=f"checkpoint of step {step} in {checkpoint_dir}")
    model.train() if phase == "train" else model.eval()
    return model, meta


def model_from_state(model_state, meta, device, where):
    """A GPT of the checkpoint's config (meta["model_config"]) holding `model_state`, on `device`."""
    from nanochat.gpt import GPT, GPTConfig
    # torch.compile wraps the model: its state dict keys carry an "_orig_mod." prefix; accept both
    model_state = {k.removeprefix("_orig_mod."): v for k, v in model_state.items()}
    with torch.device("meta"):
        model = GPT(GPTConfig(**meta["model_config"]))
    model.to_empty(device=device)
    model.init_rotary()  # rotary tables are not in the checkpoint
    try:
        model.load_state_dict(model_state, strict=True, assign=True)
    except RuntimeError as e:
        raise UserError(f"{where} does not match its model config: {e}") from None
    return model


def check_tokenizer(meta, tokenizer, where):
    """The tokenizer of this run must be the one the checkpoint was trained with (same fingerprint)."""
    from nanochat.tokenizer import get_tokenizer_dir
    saved = meta.get("tokenizer") or {}
    here = tokenizer.fingerprint()
    if saved.get("fingerprint") not in (None, here) or meta["model_config"]["vocab_size"] != tokenizer.get_vocab_size():
        raise UserError(f"{where} was trained with tokenizer {saved.get('fingerprint', '?')} (vocab "
                        f"{meta['model_config']['vocab_size']:,}), but the tokenizer in "
                        f"{tokenizer.directory or get_tokenizer_dir()} is {here} "
                        f"(vocab {tokenizer.get_vocab_size():,}): token ids would mean other text; put that run's "
                        f"tokenizer back, or train a new model with this one")


def check_data_settings(saved, now, where):
    """
    Resuming must continue the same data stream: every setting in `saved` (what the checkpoint's run read its
    data with) must equal `now`. The first difference is a UserError naming the setting.
    """
    for key, value in saved.items():
        if key in now and now[key] != value:
            raise UserError(f"{where} was trained with {key}={value!r}, this run has {key}={now[key]!r}: that changes "
                            f"which data every following step reads, so it would not continue the same run; resume "
                            f"with --{key}={value} (or start a new run with another --model_tag)")


def load_model(source, device, phase, model_tag=None, step=None):
    """
    Load a model saved by a training stage: source "base" | "mid" | "sft" | "rl". model_tag defaults to
    the only tag present (an error lists them if there are several); step defaults to the last complete
    one, or, if its files are unreadable, the one before it (with a warning). Checks that the tokenizer
    the model was trained with is the one it gets (nanochat.tokenizer.checkpoint_tokenizer). Returns (model, tokenizer,
    meta).
    """
    from nanochat.tokenizer import checkpoint_tokenizer
    model_tag, checkpoint_dir = find_checkpoint_dir(source, model_tag)
    if step is not None and step >= 0:
        candidates = [step]
    else:
        candidates = complete_steps(checkpoint_dir)[::-1]
        if not candidates:
            raise UserError(f"no complete checkpoint in {checkpoint_dir}: run `{STAGE_COMMANDS[source]}` first")
    for i, candidate in enumerate(candidates):
        try:
            model, meta = build_model(checkpoint_dir, candidate, device, phase)
            break
        except CheckpointUnreadable as e:
            if i == len(candidates) - 1:
                raise
            print0(f"WARNING: the latest checkpoint (step {candidate}) of {checkpoint_dir} cannot be loaded ({e}); "
                   f"using the previous complete one, step {candidates[i + 1]}")
    print0(f"Loaded {source} model {model_tag} step {meta['step']} from {checkpoint_dir}")
    meta = dict(meta, model_tag=model_tag, checkpoint_dir=checkpoint_dir)
    tokenizer = checkpoint_tokenizer(checkpoint_dir)
    check_tokenizer(meta, tokenizer, f"{source} model {model_tag} step {meta['step']}")
    return model, tokenizer, meta


def load_for_resume(checkpoint_dir, step, device, model=None, tokenizer=None):
    """
    What a stage resumed from its own checkpoint of `step` needs: (model, tokenizer, optimizer_shards, meta), the
    shards for load_optimizer_shards. The weights go into `model` if one is given (base_train builds it from its
    settings: a UserError names each field of its config that differs from the checkpoint's), else into a GPT of
    the checkpoint's config. `tokenizer` (default: the checkpoint's) must be the one the model was trained with.
    """
    from nanochat.tokenizer import checkpoint_tokenizer
    where = f"checkpoint of step {step} in {checkpoint_dir}"
    state, optimizer_shards, meta = load_checkpoint(checkpoint_dir, step, device, load_optimizer=True)
    tokenizer = tokenizer or checkpoint_tokenizer(checkpoint_dir)
    check_tokenizer(meta, tokenizer, where)
    if model is None:
        return model_from_state(state, meta, device, where), tokenizer, optimizer_shards, meta
    # older checkpoints: the fields added since at their defaults
    saved = {**type(model.config)().to_dict(), **meta["model_config"]}
    if saved != model.config.to_dict():
        differ = ", ".join(f"{k} {saved[k]!r} (this run {v!r})"
                           for k, v in model.config.to_dict().items() if saved[k] != v)
        raise UserError(f"{where} has a different model: {differ}; resume with the settings of that run")
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in state.items()})
    return model, tokenizer, optimizer_shards, meta


# -----------------------------------------------------------------------------
# Optimizer checkpoints that any world size can load. Per optimizer: {parameter name: {"row_start": r, "step": t
# or None, key: tensor}}, each tensor rows [r, r + len) of that parameter's full state (a 0-d parameter is one
# row); a rank that holds nothing of a parameter saves no entry for it (docs/optimizers.md). Each of nanochat's
# optimizers (adamw.py, muon.py) gives its part with owned_state(name_of) and takes it with load_owned_state.


def optimizer_shard(optimizers, model):
    """This rank's optimizer state in the world-size-free form above: one dict per optimizer, in order."""
    name_of = {p: n for n, p in model.named_parameters()}
    return [opt.owned_state(name_of) for opt in optimizers]


def load_optimizer_shards(optimizers, model, shards, where="checkpoint"):
    """
    Load into `optimizers` the state that optimizer_shard() saved on any number of ranks (`shards`: every saving
    rank's list, ideally loaded with mmap); each optimizer takes the part this rank owns. UserError if a piece is
    missing or the parameters do not match (`where` names the checkpoint in the message).
    """
    name_of = {p: n for n, p in model.named_parameters()}
    if any(len(s) != len(optimizers) for s in shards):
        raise UserError(f"{where}: saved state of {len(shards[0])} optimizer(s), this run has {len(optimizers)}")
    for i, opt in enumerate(optimizers):
        pieces = {}  # name -> list of saved entries
        for shard in shards:
            for name, entry in shard[i].items():
                pieces.setdefault(name, []).append(entry)
        params = {name_of[p]: p for group in opt.param_groups for p in group["params"]}
        unknown = sorted(set(pieces) - set(params))
        if unknown:
            raise UserError(f"{where}: optimizer state for parameters this model's optimizer does not have: "
                            f"{', '.join(unknown[:3])}")

        def full_state(name):
            """The full state of parameter `name` ({"step", key: full tensor}), or None if it has none yet."""
            entries = pieces.get(name)
            if not entries:
                return None
            rows = rows_of(params[name]).size(0)
            keys = [k for k in entries[0] if k not in ("row_start", "step")]
            full = {"step": entries[0]["step"]}
            covered = torch.zeros(rows, dtype=torch.bool)
            for key in keys:
                ref = entries[0][key]
                full[key] = torch.zeros((rows, *ref.shape[1:]), dtype=ref.dtype)
            for entry in entries:
                start = entry["row_start"]
                n = entry[keys[0]].size(0) if keys else 0
                for key in keys:
                    full[key][start:start + n] = entry[key]
                covered[start:start + n] = True
            if not covered.all():
                raise UserError(f"{where}: optimizer state of {name} is incomplete ({int((~covered).sum())} of "
                                f"{rows} rows missing): a rank's optimizer file is missing or from another run")
            return full

        opt.load_owned_state(name_of, full_state)
