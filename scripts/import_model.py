"""
Import a model trained elsewhere as a checkpoint of ours. It keeps its own tokenizer.

    python -m scripts.import_model --path=nanochat-d20 --source=sft            # a Hugging Face NanoChat directory
    python -m scripts.import_model --path=d32 --source=sft --model_tag=d32     # a karpathy/nanochat checkpoint

--path holds either
  - a Hugging Face NanoChat directory: config.json, model.safetensors (or an index and its shards), tokenizer.json;
    what transformers' save_pretrained (with the tokenizer saved beside it) or scripts/export_model.py writes,
    any --layout (remote: our own modeling file's config and weight names); or
  - a checkpoint of karpathy/nanochat's code of late 2025: model_<step>.pt + meta_<step>.json, with tokenizer.pkl
    and token_bytes.pt beside them, as its released models are laid out (nanochat/reference_format.py).
It lands in $NANOCHAT_BASE_DIR/<source's checkpoints>/<model_tag>/ as a normal checkpoint (weights and meta, no
optimizer state) plus tokenizer/, the model's tokenizer in our format, which load_model uses for this model. Then
every stage that loads a model works on it (chat_cli, chat_web, chat_eval, base_eval, base_loss, export_model).
The directory is built under a temporary name and renamed when complete.
"""

import fcntl
import json
import os

from nanochat.checkpoint_manager import SOURCES, check_model_tag, checkpoint_dir_for, model_from_state, save_checkpoint
from nanochat.configurator import check_config, configure
from nanochat.hf_format import (REMOTE_MODEL_TYPE, check_weight_names, gpt_weight_names, load_safetensors_dir,
                                model_config_from_hf, model_config_from_remote, rename_weights, staged_directory,
                                tokenizer_from_json)
from nanochat.output import UserError, print0
from nanochat.reference_format import find_steps, read_checkpoint
from nanochat.tokenizer import TOKENIZER_SUBDIR

path = ""  # the directory to import (required)
source = ""  # where it lands (required): base | mid | sft | rl
model_tag = ""  # its name there (default: the name of --path's directory)
step = -1  # which step of a karpathy/nanochat directory that holds several (-1 = the last)
overwrite = False  # replace a model already under that source and tag (default: refuse)
config = configure(globals())
if not source:
    raise UserError(f"--source is required: the stage whose checkpoints the model joins ({', '.join(SOURCES)})")
check_config(config, choices={"source": tuple(SOURCES)})
if not path:
    raise UserError("--path=DIR is required: "
                    "a Hugging Face NanoChat directory or a karpathy/nanochat checkpoint directory")
if not os.path.isdir(path):
    raise UserError(f"--path={path} is not a directory")
path = os.path.abspath(path)
model_tag = check_model_tag(model_tag or os.path.basename(path))
target = checkpoint_dir_for(source, model_tag)
if os.path.isdir(target) and os.listdir(target):
    if not overwrite:
        raise UserError(f"{target} already holds a model: choose another --model_tag, or add --overwrite to replace it")
    if os.path.exists(os.path.join(target, ".lock")):  # a training run holds this lock while it writes there
        with open(os.path.join(target, ".lock"), "a+") as lock:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise UserError(f"{target} is in use by a running stage: "
                                f"wait for it to end, or choose another --model_tag") from None


def read_hf_directory(directory):
    """(model_config, state dict with our names in fp32, tokenizer, where it came from) of a Hugging Face directory."""
    config_path = os.path.join(directory, "config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            hf_config = json.load(f)
    except ValueError as e:
        raise UserError(f"{config_path} is not JSON ({e})") from None
    remote = hf_config.get("model_type") == REMOTE_MODEL_TYPE  # export_model --layout=remote: our fields, our names
    model_config = (model_config_from_remote if remote else model_config_from_hf)(hf_config, config_path)
    if not any(os.path.exists(os.path.join(directory, name))
               for name in ("model.safetensors", "model.safetensors.index.json")):
        other = [name for name in ("pytorch_model.bin", "model.pt") if os.path.exists(os.path.join(directory, name))]
        hint = (f" ({other[0]} is there: only safetensors weights are read; save with safe_serialization=True)"
                if other else "")
        raise UserError(f"{directory} has config.json but no model.safetensors{hint}")
    tokenizer_path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(tokenizer_path):
        raise UserError(f"{directory} has no tokenizer.json: save the model's tokenizer beside its weights "
                        f"(tokenizer.save_pretrained(dir), or the tokenizer files of an export_model directory)")
    try:
        with open(tokenizer_path, encoding="utf-8") as f:
            tokenizer = tokenizer_from_json(json.load(f), tokenizer_path)
    except ValueError as e:
        raise UserError(f"{tokenizer_path} is not JSON ({e})") from None
    tensors = load_safetensors_dir(directory)
    if "transformer.wte.weight" in tensors:  # export_model --layout=mlx or remote: our own names
        check_weight_names(tensors, model_config["n_layer"], hf=False, where=directory,
                           expected=gpt_weight_names(model_config))
    else:
        tensors = rename_weights(tensors, model_config["n_layer"], to_hf=False, where=directory)
    if tokenizer.get_vocab_size() != model_config["vocab_size"]:
        raise UserError(f"{tokenizer_path} has {tokenizer.get_vocab_size():,} tokens but config.json's vocab_size is "
                        f"{model_config['vocab_size']:,}: they do not belong together")
    state = {name: t.float().contiguous() for name, t in tensors.items()}
    return model_config, state, tokenizer, dict(format="Hugging Face NanoChat" + (" (remote code)" if remote else ""),
                                                path=directory)


if os.path.exists(os.path.join(path, "config.json")):
    model_config, state, tokenizer, imported_from = read_hf_directory(path)
    new_step = 0
    user_config = {}
elif find_steps(path)[1]:
    model_config, state, tokenizer, reference_meta, new_step = read_checkpoint(path, step)
    imported_from = dict(format="karpathy/nanochat checkpoint", path=path, step=new_step, meta=reference_meta)
    user_config = reference_meta.get("user_config") or {}  # that run's settings, as our stages record theirs
else:
    raise UserError(f"{path} is neither a Hugging Face NanoChat directory "
                    f"(config.json, model.safetensors, tokenizer.json) "
                    f"nor a karpathy/nanochat checkpoint directory (model_<step>.pt, meta_<step>.json, tokenizer.pkl)")

# build the model: shapes that do not fit the config are refused here, before anything is written
model = model_from_state(state, {"model_config": model_config}, "cpu", where=path)
meta = dict(model_config=model_config, user_config=user_config, imported_from=imported_from,
            tokenizer=dict(fingerprint=tokenizer.fingerprint(), vocab_size=tokenizer.get_vocab_size()))
with staged_directory(target, overwrite=True, flag="--model_tag") as tmp:
    tokenizer.save(os.path.join(tmp, TOKENIZER_SUBDIR))
    save_checkpoint(tmp, new_step, model.state_dict(), None, meta)
print0(f"Imported {imported_from['format']} {path} "
       f"({model.num_params():,} parameters, vocab {tokenizer.get_vocab_size():,}) "
       f"as {source} model {model_tag} step {new_step} in {target}")
print0(f"Next: python -m scripts.chat_cli --source={source} --model_tag={model_tag}, or "
       f"python -m scripts.export_model --source={source} --model_tag={model_tag} --out=DIR")
