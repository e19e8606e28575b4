"""
Evaluate a base model checkpoint: bits per byte on the train and val splits, plus a few samples.

    python -m scripts.base_loss
    torchrun --standalone --nproc_per_node=8 -m scripts.base_loss
"""

from nanochat.checkpoint_manager import load_model
from nanochat.configurator import check_config, configure
from nanochat.dataloader import tokenizing_distributed_data_loader
from nanochat.engine import generate_naive
from nanochat.hardware import autocast_context, compute_dtype_line
from nanochat.losses import evaluate_bpb
from nanochat.output import print0
from nanochat.processes import autodetect_device_type, compute_cleanup, compute_init
from nanochat.report import get_report
from nanochat.rerun import RERUN_CHOICES, checkpoint_input, skip_if_done
from nanochat.tokenizer import get_token_bytes

device_type = ""  # cuda | cpu | mps; empty = autodetect
model_tag = ""  # which model under base_checkpoints/ (needed only if there are several)
step = -1  # which step (-1 = the last complete checkpoint)
device_batch_size = 32  # rows per forward per rank
split_tokens = 20 * 524288  # tokens evaluated per split, all ranks together
rerun = "no"  # auto (bash speedrun.sh): skipped if its report section was made from the same settings and inputs
config = configure(globals())
check_config(config, positive=["device_batch_size", "split_tokens"],
             choices={"device_type": ("", "cuda", "cpu", "mps"), "rerun": RERUN_CHOICES})
# What the evaluation is made from: these settings and the checkpoint it reads; made already from them (--rerun=auto),
# it says so and exits 0 here (nanochat/rerun.py)
made_from = skip_if_done("Base model loss", "base_loss", config, checkpoint_input("base", model_tag, step))

device_type = device_type or autodetect_device_type()
ddp, ddp_rank, _, ddp_world_size, device = compute_init(device_type)
_, autocast_ctx = autocast_context(device_type)  # decided by what the device does: nanochat/hardware.py
print0(compute_dtype_line(device_type))

model, tokenizer, meta = load_model("base", device, phase="eval", model_tag=model_tag or None, step=step)
sequence_len = model.config.sequence_len
token_bytes = get_token_bytes(device=device, directory=tokenizer.directory)  # the model's own tokenizer's
tokens_per_step = device_batch_size * sequence_len * ddp_world_size
steps = max(1, split_tokens // tokens_per_step)
print0(f"Evaluating {steps} batches of {device_batch_size} x {sequence_len} tokens per rank "
       f"x {ddp_world_size} rank(s) per split "
       f"(fewer where a split is smaller: each is counted at most once)")

bpb_results = {}
for split in ("train", "val"):
    loader = tokenizing_distributed_data_loader(device_batch_size, sequence_len, split, device, tokenizer=tokenizer)
    with autocast_ctx:
        bpb_results[split] = evaluate_bpb(model, loader, steps, token_bytes)
    print0(f"{split} bpb: {bpb_results[split]:.4f}")

samples = []
if ddp_rank == 0:
    prompts = ["The capital of France is", "The chemical symbol of gold is",
               "If yesterday was Friday, then tomorrow will be", "The opposite of hot is",
               "The planets of the solar system are:", "My favorite color is", "If 5*x + 3 = 13, then x is"]
    for prompt in prompts:
        with autocast_ctx:
            ids = list(generate_naive(model, tokenizer.encode(prompt, prepend=tokenizer.get_bos_token_id()),
                                      max_tokens=16, temperature=0))
        samples.append(prompt + tokenizer.decode(ids))
        print0(f"  {samples[-1]!r}")

get_report().log(section="Base model loss", made_from=made_from, data=[
    {"model": f"{meta.get('user_config', {}).get('model_tag') or ''} step {meta['step']}".strip(),
     "train bpb": bpb_results["train"], "val bpb": bpb_results["val"], "tokens per split": steps * tokens_per_step},
    "Samples (greedy):", *[f"- {s!r}" for s in samples],
])
compute_cleanup()
