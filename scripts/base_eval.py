"""
Evaluate a checkpoint on CORE: DCLM's 22 tasks, or offline the tasks built from pydocs (pydocs-CORE).

The metric and both bundles: nanochat/core_eval.py, nanochat/core_bundle.py.

    python -m scripts.base_eval                                    # the last base checkpoint, default bundle
    python -m scripts.base_eval --max_per_task=100 --bundle=offline
    torchrun --standalone --nproc_per_node=8 -m scripts.base_eval  # examples sharded over the ranks

The default bundle is the selected corpus's ($NANOCHAT_DATASET; nanochat/dataset.py, CORPORA): `offline` for
pydocs, `dclm` for the others.
Prints a table per task (accuracy, centered accuracy) and the score, and writes the report section
"Base model evaluation" (key "CORE metric" for the dclm bundle, "pydocs-CORE metric" for the offline one).
"""

from nanochat.checkpoint_manager import load_model
from nanochat.configurator import check_config, configure
from nanochat.core_eval import default_bundle_kind, evaluate_core, prepare_bundle
from nanochat.hardware import autocast_context, compute_dtype_line
from nanochat.output import print0, print_banner
from nanochat.processes import autodetect_device_type, compute_cleanup, compute_init
from nanochat.report import get_report
from nanochat.rerun import RERUN_CHOICES, checkpoint_input, skip_if_done

device_type = ""  # cuda | cpu | mps; empty = autodetect
source = "base"  # which checkpoints: base | mid | sft | rl
model_tag = ""  # which model under the source's checkpoint directory (needed only if there are several)
step = -1  # which step (-1 = the last complete checkpoint)
bundle = ""  # dclm | offline; empty = the corpus's own (offline for pydocs, dclm for the others)
max_per_task = -1  # examples per task, the first N of each task's fixed shuffle (-1 = all)
# device_batch_tokens: rows of similar length go together; their logits take tokens x vocab x 4 bytes
device_batch_tokens = 8192  # padded tokens per forward per rank
rerun = "no"  # auto (bash speedrun.sh): skipped if its report section was made from the same settings and inputs
config = configure(globals())
check_config(config, positive=["device_batch_tokens"], positive_or_unset=["max_per_task"],
             choices={"device_type": ("", "cuda", "cpu", "mps"), "source": ("base", "mid", "sft", "rl"),
                      "bundle": ("", "dclm", "offline"), "rerun": RERUN_CHOICES})
# What the evaluation is made from: these settings and the checkpoint it reads; made already from them (--rerun=auto),
# it says so and exits 0 here (nanochat/rerun.py)
made_from = skip_if_done("Base model evaluation", "base_eval", config, checkpoint_input(source, model_tag, step))

print_banner()
device_type = device_type or autodetect_device_type()
ddp, ddp_rank, _, ddp_world_size, device = compute_init(device_type)
_, autocast_ctx = autocast_context(device_type)  # decided by what the device does: nanochat/hardware.py
print0(compute_dtype_line(device_type))

bundle = bundle or default_bundle_kind()
bundle_dir = prepare_bundle(bundle)  # before loading the model: a missing network fails fast
model, tokenizer, meta = load_model(source, device, phase="eval", model_tag=model_tag or None, step=step)
with autocast_ctx:
    results = evaluate_core(model, tokenizer, device, bundle_dir, max_per_task=max_per_task,
                            batch_tokens=device_batch_tokens)

table = ["| task | type | shots | examples | accuracy | centered |", "|---|---|---|---|---|---|"]
for label, r in results["tasks"].items():
    table.append(f"| {label} | {r['type']} | {r['shots']} | {r['examples']} | {r['accuracy']:.4f} | "
                 f"{r['centered']:.4f} |")
get_report().log(section="Base model evaluation", made_from=made_from, data=[
    {"model": f"{source} {meta['model_tag']} step {meta['step']}",
     "bundle": bundle,
     "max per task": max_per_task,
     f"{results['name']} metric": results["score"]},
    "", *table,
])
compute_cleanup()
