"""
Evaluate a chat model on chat tasks, and compute ChatCORE.

    python -m scripts.chat_eval -i sft                            # the ChatCORE tasks (downloaded once)
    python -m scripts.chat_eval -i mid -a GSM8K --max_problems=200
    python -m scripts.chat_eval -i mid -a offline                 # the offline tasks' test splits: no download
    torchrun --standalone --nproc_per_node=8 -m scripts.chat_eval -i sft

-i picks the model (--source: mid | sft | rl) and -a the tasks (--task_name): a ChatCORE task (ARC-Easy,
ARC-Challenge, MMLU, GSM8K, HumanEval, SpellingBee), an offline task (SimpleSpelling, Arithmetic, PydocsChat,
PydocsMC, Identity), several separated by commas, `all` (the ChatCORE tasks) or `offline` (the offline tasks'
test split, as sized in tasks/registry.py). Which tasks are which, and their baselines: tasks/registry.py. Every
other setting is --key=value; --help lists them.

How a problem is scored (a task's accuracy = problems passed / problems):
- categorical tasks (ARC, MMLU, PydocsMC: the answer is one of a few letters): no sampling. The prompts of a
  batch go through the model in one forward, right-padded to the longest (a causal model never looks ahead,
  so padding changes nothing before it), and the answer is the allowed letter with the largest logit at the
  prompt's last position, <|assistant_start|>: the letter the model would most likely write first. Only the
  allowed letters compete, so this measures what the model knows, not whether it keeps to the format.
- generative tasks (GSM8K, HumanEval, SpellingBee and the other offline tasks): the Engine samples
  `num_samples` answers (with the calculator tool) of at most `max_new_tokens` tokens or what is left of
  the context, and the task's evaluate() checks each one (HumanEval runs the code). The problem passes if
  any sample passes: pass@k with k = num_samples. Problem i is sampled with seed + i.

ChatCORE is the mean over the ChatCORE tasks of the centered accuracy, (accuracy - baseline) / (1 - baseline),
where the baseline is what guessing scores (tasks/registry.py): 0.25 for ARC-Easy, ARC-Challenge and MMLU (four
choices), 0 for GSM8K, HumanEval and SpellingBee. 0 is chance, 1 is perfect. "Offline ChatCORE" is the same
mean over the offline tasks (baseline 1/number of choices for multiple choice, 0 for generative), to follow
a small model trained on the offline mixture; it is a different score and never reported as ChatCORE.
ChatCORE is computed when all its tasks ran (-a all), Offline ChatCORE with -a offline.

Greedy answers (temperature 0, the default) of `batch_size` problems are decoded together (one decoding step for
all of them); sampled ones one problem at a time, so that problem i's samples depend on seed + i only.

Under torchrun, rank r evaluates the batches r, r + W, r + 2W, ... of `batch_size` consecutive problems (W
processes) and the counts are summed over the ranks: the same batches as one process, so the same scores. The
report section "Chat evaluation <source>" holds the last run's results, and the labels of the report card's task rows
(the registry's): evaluate everything you want reported in one run.
"""

import sys
import time

import torch
import torch.distributed as dist

from nanochat.output import UserError, duration, print0
from nanochat.scoring import Progress, score_categorical, score_generative
from tasks.registry import build_tasks, build_use, chatcore_baselines, find, report_card_labels, uses

# -----------------------------------------------------------------------------
# Config (override as --key=value; -i and -a are short for --source and --task_name; --help lists them)
source = "sft"  # which stage's model: mid | sft | rl (-i)
task_name = "all"  # a task, tasks separated by commas, all (the ChatCORE tasks) or offline (-a)
model_tag = ""  # which model of that stage (needed only if there are several)
step = -1  # which checkpoint step (-1 = the last)
device_type = ""  # cuda | cpu | mps; empty = autodetect
max_problems = -1  # evaluate only the first N problems of each task (-1 = all)
batch_size = 8  # problems per forward per rank (categorical), or decoded together (generative, greedy)
num_samples = 1  # generative tasks: answers sampled per problem; a problem passes if any does (pass@k)
temperature = 0.0  # generative tasks: sampling temperature (0 = greedy)
top_k = 50  # generative tasks: sample from the k most likely tokens (0 = the whole vocabulary)
max_new_tokens = 512  # generative tasks: longest answer (fewer when the prompt leaves less room in the context)
seed = 42  # generative tasks: problem i is sampled with seed + i, whatever the number of ranks
progress_every = 5.0  # seconds between progress lines of a task (0 = after every batch or problem)
rerun = "no"  # auto (bash speedrun.sh): skipped if its report section was made from the same settings and inputs

SHORT_FLAGS = {"-i": "source", "-a": "task_name"}


def expand_short_flags(argv):
    """`-i mid` -> `--source=mid`, `-a GSM8K` -> `--task_name=GSM8K`: the configurator takes only --key=value."""
    out = []
    i = 0
    while i < len(argv):
        if argv[i] in SHORT_FLAGS:
            if i + 1 == len(argv) or argv[i + 1].startswith("-"):
                raise UserError(f"{argv[i]} needs a value after it, e.g. -i mid -a GSM8K")
            out.append(f"--{SHORT_FLAGS[argv[i]]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


# -----------------------------------------------------------------------------
# The tasks


def load_tasks(task_name):
    """
    {name: task} for --task_name (see the module docstring); UserError for a name that is not a task. A task named
    alone is its ChatCORE test split when it is in ChatCORE (SpellingBee: 500 problems), else its offline one.
    """
    if task_name == "offline":
        return dict(build_tasks("offline/test"))
    chatcore = chatcore_baselines()
    offline = {entry.task: entry for entry in uses("offline/test")}
    names = list(chatcore) if task_name == "all" else [n.strip() for n in task_name.split(",") if n.strip()]
    unknown = [name for name in names if name not in chatcore and name not in offline]
    if unknown or not names:
        raise UserError(f"unknown task {', '.join(map(repr, unknown)) or repr(task_name)}: use "
                        f"{', '.join(chatcore)} or {', '.join(n for n in offline if n not in chatcore)}, "
                        f"several separated by commas, all or offline")
    # every name is checked before anything is downloaded
    return {name: find(name).build(split="test") if name in chatcore else build_use(offline[name])
            for name in names}


# -----------------------------------------------------------------------------
# Progress and scores


def centered(accuracy, baseline):
    """Accuracy rescaled so that guessing (baseline) is 0 and perfect is 1."""
    return (accuracy - baseline) / (1.0 - baseline)


def mean_centered(accuracies, baselines):
    """ChatCORE-style score: the mean centered accuracy over the tasks of `baselines` (all must be in `accuracies`)."""
    return sum(centered(accuracies[name], baseline) for name, baseline in baselines.items()) / len(baselines)


def scores(results, offline):
    """
    {score name: value}: ChatCORE when all its tasks ran, Offline ChatCORE when the offline tasks ran
    (`offline`: this was `-a offline`), else nothing. `results`: {task: {"accuracy", "chance", ...}}.
    ChatCORE uses its fixed baselines, Offline ChatCORE the chance accuracy measured on each task.
    """
    accuracies = {name: r["accuracy"] for name, r in results.items()}
    if offline:
        return {"Offline ChatCORE": mean_centered(accuracies, {name: r["chance"] for name, r in results.items()})}
    chatcore = chatcore_baselines()
    if set(chatcore) <= set(results):
        return {"ChatCORE": mean_centered(accuracies, chatcore)}
    return {}


# -----------------------------------------------------------------------------
# The script


def main(argv=None):
    from nanochat.checkpoint_manager import load_model
    from nanochat.output import setup_default_logging
    from nanochat.processes import autodetect_device_type, compute_cleanup, compute_init
    from nanochat.configurator import check_config, configure
    from nanochat.engine import Engine
    from nanochat.hardware import autocast_context, compute_dtype_line
    from nanochat.report import get_report
    from nanochat.rerun import RERUN_CHOICES, checkpoint_input, skip_if_done

    setup_default_logging()  # from here on a UserError prints one line, not a traceback
    config = configure(globals(), expand_short_flags(sys.argv[1:] if argv is None else argv))
    check_config(config, positive=["batch_size", "num_samples", "max_new_tokens"], positive_or_unset=["max_problems"],
                 non_negative=["temperature", "top_k", "progress_every"],
                 choices={"source": ("mid", "sft", "rl"), "device_type": ("", "cuda", "cpu", "mps"),
                          "rerun": RERUN_CHOICES})
    # What the evaluation is made from: these settings and the checkpoint it reads; made already from them
    # (--rerun=auto), it says so and exits 0 here (nanochat/rerun.py)
    made_from = skip_if_done(f"Chat evaluation {source}", "chat_eval", config,
                             checkpoint_input(source, model_tag, step))

    device_kind = device_type or autodetect_device_type()
    ddp, rank, _, world_size, device = compute_init(device_kind)
    _, autocast = autocast_context(device_kind)
    print0(compute_dtype_line(device_kind))
    tasks = load_tasks(task_name)  # before the model: a missing download fails fast
    offline = task_name == "offline"
    model, tokenizer, meta = load_model(source, device, phase="eval", model_tag=model_tag or None, step=step)
    engine = Engine(model, tokenizer)
    if num_samples > 1 and temperature == 0:
        print0(f"note: --num_samples={num_samples} with --temperature=0: every sample is the same greedy answer")
    print0(f"Evaluating {source} model {meta['model_tag']} step {meta['step']} on {', '.join(tasks)} "
           f"({world_size} rank(s), context {engine.context_len} tokens)")

    results = {}
    for name, task in tasks.items():
        count = len(task) if max_problems < 0 else min(max_problems, len(task))
        # this rank's share: batches r, r + W, ... of batch_size consecutive problems, so a batch holds the same
        # problems whatever the number of ranks (greedy answers decoded together depend on which go together)
        indices = [i for i in range(count) if i // batch_size % world_size == rank]
        progress = Progress(name, len(indices), progress_every, enabled=rank == 0, share=" on rank 0" if ddp else "")
        t0 = time.time()
        with autocast:
            if task.eval_type == "categorical":
                outcomes = score_categorical(model, tokenizer, task, indices, batch_size, device, progress)
                chance = sum(1.0 / len(task[i]["letters"]) for i in indices)  # guessing's expected number passed
            else:
                outcomes = score_generative(engine, tokenizer, task, indices, num_samples, max_new_tokens, temperature,
                                            top_k, seed, progress, batch_size=batch_size)
                chance = 0.0
        counts = torch.tensor([sum(passed for passed, _ in outcomes), len(outcomes), chance,
                               sum(detail is None for _, detail in outcomes)], dtype=torch.float64, device=device)
        if ddp:
            dist.all_reduce(counts)  # sums over the ranks: every problem was scored by exactly one rank
        passed = int(counts[0])
        total = int(counts[1])
        too_long = int(counts[3])
        chance = counts[2].item() / max(total, 1)
        accuracy = passed / max(total, 1)
        baseline = chance if offline else chatcore_baselines().get(name, chance)
        results[name] = {"type": task.eval_type, "passed": passed, "total": total, "accuracy": accuracy,
                         "chance": chance, "baseline": baseline}
        note = f"; {too_long} prompt(s) filled the context and failed" if too_long else ""
        print0(f"{name}: {accuracy:.2%} ({passed}/{total}) in {duration(time.time() - t0)}{note}")

    table = ["| task | type | problems | passed | accuracy | baseline | centered |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        table.append(f"| {name} | {r['type']} | {r['total']} | {r['passed']} | {r['accuracy']:.4f} "
                     f"| {r['baseline']:.4f} | {centered(r['accuracy'], r['baseline']):.4f} |")
    final = scores(results, offline)
    print0("\n" + "\n".join(table))
    for score_name, value in final.items():
        print0(f"{score_name}: {value:.4f}")
    if not final:
        print0("(ChatCORE needs all of its tasks, -a all; Offline ChatCORE the offline tasks, -a offline)")

    # the report card names its task rows with the registry's labels (the library does not import the registry)
    get_report().log(section=f"Chat evaluation {source}", made_from=made_from, data=[
        {"model": f"{source} {meta['model_tag']} step {meta['step']}", "tasks": task_name, "max problems": max_problems,
         "num samples": num_samples, "temperature": temperature, "top k": top_k, "max new tokens": max_new_tokens,
         "world size": world_size},
        {name: r["accuracy"] for name, r in results.items()},
        final,
        "", *table,
    ], card_labels=dict(report_card_labels()))
    compute_cleanup()


if __name__ == "__main__":
    main()
