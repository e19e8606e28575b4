"""
The CORE metric of the DCLM paper: a base model's centered accuracy on 22 in-context-learning tasks.

The paper: https://arxiv.org/abs/2406.11794. In a run:

    bundle_dir = prepare_bundle()       # at start-up: a run must not find out at step 2000 that it is offline
    results = evaluate_core(model, tokenizer, device, bundle_dir, max_per_task=500)   # ["score"], ["name"]

The bundle's format, how each example is scored (as nanochat's reference implementation does, so the numbers
compare), and how rows are batched: docs/evaluation.md.
"""

import csv
import json
import os
import random
import shutil
import time
import zipfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from filelock import FileLock

from nanochat.downloads import download_file_with_lock
from nanochat.files import get_base_dir
from nanochat.interrupt import check_stop, interruptible
from nanochat.output import UserError, duration, print0
from nanochat.ranks import is_distributed

EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
BUNDLE_KINDS = ("dclm", "offline")
DCLM_DIR = "eval_bundle"  # <base_dir>/eval_bundle: the unzipped DCLM bundle
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
SHUFFLE_SEED = 1337  # the order of each task's examples (max_per_task keeps the first N of it)
FEWSHOT_SEED = 1234  # example i draws its few-shot examples with random.Random(FEWSHOT_SEED + i)
# padded tokens per forward; all their fp32 logits are held at once: 2 GiB at vocab 65,536 (docs/evaluation.md)
DEFAULT_BATCH_TOKENS = 8192
PAD_SLACK = 0.1  # a batch holds rows at least 90% as long as its longest (see pack_rows)
EXAMPLES_PER_CHUNK = 2048  # examples rendered and tokenized at a time per rank: bounds host memory on big tasks

# -----------------------------------------------------------------------------
# 1. The bundle


def bundle_url():
    """Where the DCLM bundle is downloaded from: $NANOCHAT_EVAL_BUNDLE_URL if set (tests serve a fixture)."""
    return os.environ.get("NANOCHAT_EVAL_BUNDLE_URL") or EVAL_BUNDLE_URL


def default_bundle_kind():
    """The selected corpus's bundle (nanochat/dataset.py, CORPORA): `offline` for pydocs, `dclm` for the others."""
    from nanochat.dataset import corpus_of, dataset_name
    return corpus_of(dataset_name()).bundle


def prepare_bundle(kind=""):
    """
    The directory of the bundle of `kind`, made if missing ("dclm": bundle_url() unzipped to <base_dir>/eval_bundle/;
    "offline": nanochat/core_bundle.py's, <base_dir>/eval_bundle_pydocs_v<N>/; "": default_bundle_kind()). It is
    complete and validated once it exists (one rename, under an inter-process lock). UserError when it cannot be had.
    """
    kind = kind or default_bundle_kind()
    if kind not in BUNDLE_KINDS:
        raise UserError(f"unknown eval bundle {kind!r}: use one of {', '.join(BUNDLE_KINDS)}")
    if kind == "offline":
        from nanochat.core_bundle import BUNDLE_DIR, write_offline_bundle
        return _materialize(os.path.join(get_base_dir(), BUNDLE_DIR), write_offline_bundle)
    final = os.path.join(get_base_dir(), DCLM_DIR)
    if os.path.isdir(final):  # only a complete bundle is ever renamed to this name
        return final
    url = bundle_url()
    try:
        zip_path = download_file_with_lock(url, "eval_bundle.zip")
    except UserError as e:
        raise UserError(f"{e}. Without network, evaluate on the offline bundle instead "
                        f"(base_eval --bundle=offline)") from None

    def unzip(tmp):
        try:
            with zipfile.ZipFile(zip_path) as zf:
                zf.extractall(tmp)  # extractall drops absolute paths and `..` from member names
        except zipfile.BadZipFile as e:
            os.remove(zip_path)  # so that the next call downloads it again
            raise UserError(f"{zip_path} (from {url}) is not a zip file ({e}); removed it, run again to "
                            f"re-download") from None
        # the DCLM zip holds one top folder, eval_bundle/; accept the files at the top level too
        if os.path.exists(os.path.join(tmp, "core.yaml")):
            return tmp
        roots = [d for d in sorted(os.listdir(tmp)) if os.path.exists(os.path.join(tmp, d, "core.yaml"))]
        if len(roots) != 1:
            os.remove(zip_path)
            raise UserError(f"{url} does not hold an eval bundle (no single folder with core.yaml); removed {zip_path}")
        return os.path.join(tmp, roots[0])

    return _materialize(final, unzip)


def _materialize(final, fill):
    """
    Create directory `final` atomically and return it: under a file lock, `fill(tmp)` writes the bundle into a fresh
    temporary directory and returns the folder in it that holds core.yaml, which is validated and renamed to `final`.
    """
    if os.path.isdir(final):
        return final
    parent, name = os.path.split(final)
    os.makedirs(parent, exist_ok=True)
    with FileLock(final + ".lock"):
        if os.path.isdir(final):  # made by whoever held the lock before us
            return final
        for stale in os.listdir(parent):  # we hold the lock: a temp dir here is from a process that died
            if stale.startswith(name + ".tmp"):
                shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
        tmp = f"{final}.tmp{os.getpid()}"
        os.makedirs(tmp)
        try:
            root = fill(tmp)
            load_bundle(root)  # raises UserError if a task file or a baseline is missing
            os.rename(root, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_bundle(bundle_dir):
    """
    Read core.yaml and eval_meta_data.csv of a bundle directory. Returns
    {"name": the score's display name ("CORE"; a bundle may set its own with a top-level `score_name:`),
     "tasks": [{"label", "type", "num_fewshot", "delimiter", "path", "baseline" (a fraction)}, ...]}
    in core.yaml's order. Anything missing or malformed is a UserError naming it.
    """
    import yaml  # only the evaluation needs it
    config_path = os.path.join(bundle_dir, "core.yaml")
    meta_path = os.path.join(bundle_dir, "eval_meta_data.csv")
    hint = f"delete {bundle_dir} and run again to rebuild it"
    for path in (config_path, meta_path):
        if not os.path.exists(path):
            raise UserError(f"eval bundle {bundle_dir} has no {os.path.basename(path)}: {hint}")
    with open(config_path, encoding="utf-8") as f:
        config = yaml.safe_load(f)
    with open(meta_path, encoding="utf-8", newline="") as f:
        baselines = {row.get("Eval Task"): row.get("Random baseline") for row in csv.DictReader(f)}
    if not isinstance(config, dict) or not config.get("icl_tasks"):
        raise UserError(f"{config_path} has no icl_tasks list: {hint}")
    tasks = []
    for entry in config["icl_tasks"]:
        missing = [k for k in ("label", "icl_task_type", "dataset_uri", "num_fewshot") if k not in entry]
        if missing:
            raise UserError(f"{config_path}: task entry {entry} lacks {', '.join(missing)}: {hint}")
        label = entry["label"]
        kind = entry["icl_task_type"]
        path = os.path.join(bundle_dir, "eval_data", entry["dataset_uri"])
        shots = entry["num_fewshot"]
        if kind not in TASK_TYPES:
            raise UserError(f"task {label} in {config_path} has icl_task_type {kind!r}; supported: "
                            f"{', '.join(TASK_TYPES)}")
        if not os.path.exists(path):
            raise UserError(f"task {label}: {path} is missing: {hint}")
        try:
            baseline = float(baselines[label])
        except (KeyError, TypeError, ValueError):
            raise UserError(f"task {label} has no 'Random baseline' in {meta_path}: {hint}") from None
        tasks.append({"label": label, "type": kind, "num_fewshot": int(shots[0] if isinstance(shots, list) else shots),
                      "delimiter": entry.get("continuation_delimiter", " "), "path": path,
                      "baseline": baseline / 100})
    return {"name": str(config.get("score_name", "CORE")), "tasks": tasks}


def load_task_data(path):
    """The examples of one task file: one JSON object per non-empty line."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# -----------------------------------------------------------------------------
# 2. Prompts


def fewshot_indices(n, index, k):
    """
    The k few-shot examples of example `index` among n: random.Random(FEWSHOT_SEED + index).sample of the other
    n - 1 indices, exactly as sampling the list without `index` would draw (sample() uses only length and indexing).
    """
    picks = random.Random(FEWSHOT_SEED + index).sample(range(n - 1), k)
    return [p if p < index else p + 1 for p in picks]


def render_prompts(task_type, item, delimiter, fewshot):
    """
    The prompts of one example as strings, the few-shot examples (solved) in front, each followed by a blank line:
    multiple_choice one per choice, query + delimiter + choice; schema one per context, context_option + delimiter +
    continuation; language_modeling [without, with] the continuation, context (stripped) + delimiter (+ continuation),
    `without` stripped as a whole.
    """
    if task_type == "multiple_choice":
        shots = "".join(f"{ex['query']}{delimiter}{ex['choices'][ex['gold']]}\n\n" for ex in fewshot)
        return [f"{shots}{item['query']}{delimiter}{choice}" for choice in item["choices"]]
    if task_type == "schema":
        shots = "".join(f"{ex['context_options'][ex['gold']]}{delimiter}{ex['continuation']}\n\n" for ex in fewshot)
        return [f"{shots}{option}{delimiter}{item['continuation']}" for option in item["context_options"]]
    if task_type == "language_modeling":
        shots = "".join(f"{ex['context'].strip()}{delimiter}{ex['continuation']}\n\n" for ex in fewshot)
        prompt = f"{shots}{item['context'].strip()}{delimiter}"
        return [prompt.strip(), prompt + item["continuation"]]
    raise ValueError(f"unknown task type {task_type!r}")


def _common_length(sequences, from_end=False):
    """Length of the common prefix (or suffix) of token lists."""
    n = min(len(s) for s in sequences)
    for i in range(n):
        j = -1 - i if from_end else i
        if any(s[j] != sequences[0][j] for s in sequences):
            return i
    return n


def continuation_rows(task_type, token_lists):
    """
    [(tokens, start, end), ...]: the sequences to forward and the span tokens[start:end] whose loss decides each.
    multiple_choice: every prompt after the common prefix; schema: every prompt's common suffix; language_modeling:
    the `with` prompt after where it first differs from `without`. Spans are never empty and never include position 0.
    """
    if task_type == "language_modeling":
        without, full = token_lists
        start = min(_common_length([without, full]), len(full) - 1)
        return [(full, start, len(full))]
    shortest = min(len(t) for t in token_lists)
    if task_type == "multiple_choice":
        start = min(_common_length(token_lists), shortest - 1)
        return [(t, start, len(t)) for t in token_lists]
    suffix = min(max(_common_length(token_lists, from_end=True), 1), shortest - 1)
    return [(t, len(t) - suffix, len(t)) for t in token_lists]


# -----------------------------------------------------------------------------
# 3. Scoring


def crop_rows(rows, max_seq_len):
    """Rows cut from the left to `max_seq_len` tokens, their spans moved along (cut only if a span alone is longer)."""
    cropped = []
    for tokens, start, end in rows:
        cut = max(0, len(tokens) - max_seq_len)
        cropped.append((tokens[cut:], max(1, start - cut), end - cut))
    return cropped


def pack_rows(rows, batch_tokens):
    """
    Batches of row indices, every row in exactly one: longest rows first; a batch holds at most `batch_tokens` padded
    tokens (a longer row goes alone) and only rows at least 1 - PAD_SLACK as long as its first.
    """
    batches = []
    current = []
    for i in sorted(range(len(rows)), key=lambda i: -len(rows[i][0])):
        longest = len(rows[current[0]][0]) if current else 0  # sorted: a batch's padded length is its first row's
        if current and ((len(current) + 1) * longest > batch_tokens or len(rows[i][0]) < (1 - PAD_SLACK) * longest):
            batches.append(current)
            current = []
        current.append(i)
    return batches + [current] if current else batches


@torch.no_grad()
def score_rows(model, rows, batches, device, pad_id, stop=None):
    """
    rows: [(tokens, start, end), ...]; batches: lists of row indices, one forward each (rows right-padded with
    `pad_id`, which a causal model never sees). Returns, in the order of `rows`, [(mean loss over tokens[start:end],
    whether the greedy argmax predicted every one of them), ...]. stop: asked before every forward; Interrupted.
    """
    results = [None] * len(rows)
    for batch in batches:
        check_stop(stop)
        for i, outcome in zip(batch, _forward_rows(model, [rows[i] for i in batch], device, pad_id)):
            results[i] = outcome
    return results


def _forward_rows(model, rows, device, pad_id):
    """One forward over `rows` (padded to the longest); the per-row (mean loss, all argmax correct)."""
    T = max(len(tokens) for tokens, _, _ in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    row_index = []
    positions = []
    for r, (tokens, start, end) in enumerate(rows):
        ids[r, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        row_index += [r] * (end - start)
        positions += range(start - 1, end - 1)
    ids = ids.to(device)
    row_index = torch.tensor(row_index, device=device)
    positions = torch.tensor(positions, device=device)
    logits = model(ids)  # (B, T, vocab)
    picked = logits[row_index, positions].float()  # only the positions that predict a scored token
    targets = ids[row_index, positions + 1]
    losses = F.cross_entropy(picked, targets, reduction="none")
    wrong = (picked.argmax(dim=-1) != targets).float()
    counts = torch.zeros(len(rows), device=device).index_add_(0, row_index, torch.ones_like(losses))
    mean_loss = torch.zeros(len(rows), device=device).index_add_(0, row_index, losses) / counts
    n_wrong = torch.zeros(len(rows), device=device).index_add_(0, row_index, wrong)
    return list(zip(mean_loss.tolist(), (n_wrong == 0).tolist()))


# -----------------------------------------------------------------------------
# 4. Tasks and the score


def evaluate_task(model, tokenizer, task, data, device, num_fewshot, batch_tokens=DEFAULT_BATCH_TOKENS,
                  max_seq_len=None, stop=None):
    """
    Evaluate one task on `data` (already shuffled and cropped) with `num_fewshot` shots (at most len(data) - 1);
    rank r of W takes examples r, r + W, ... batch_tokens > 0: forwards of up to that many padded tokens (pack_rows);
    <= 0: one forward per example, the slow reference way. Returns (correct, total), summed over all ranks, and this
    rank's outcomes [{"index", "correct", "pred" (chosen option; None for language modeling), "losses"}, ...].
    """
    distributed = is_distributed()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    indices = list(range(rank, len(data), world))
    outcomes = []
    with interruptible():  # a stop: Interrupted on every rank, here
        for c in range(0, len(indices), EXAMPLES_PER_CHUNK):
            outcomes += _evaluate_examples(model, tokenizer, task, data, indices[c:c + EXAMPLES_PER_CHUNK], device,
                                           num_fewshot, batch_tokens, max_seq_len, stop)
    totals = torch.tensor([sum(o["correct"] for o in outcomes), len(outcomes)], dtype=torch.long, device=device)
    if distributed:
        dist.all_reduce(totals)
    correct, total = totals.tolist()
    return correct, total, outcomes


def _evaluate_examples(model, tokenizer, task, data, indices, device, num_fewshot, batch_tokens, max_seq_len,
                       stop=None):
    """Render, tokenize and score the examples data[i] for i in `indices`: their outcomes (see evaluate_task)."""
    kind = task["type"]
    prompts = []
    counts = []
    for i in indices:
        fewshot = [data[j] for j in fewshot_indices(len(data), i, num_fewshot)] if num_fewshot > 0 else []
        example_prompts = render_prompts(kind, data[i], task["delimiter"], fewshot)
        prompts += example_prompts
        counts.append(len(example_prompts))
    token_lists = tokenizer.encode(prompts, prepend=tokenizer.get_bos_token_id()) if prompts else []
    rows = []
    row_ranges = []
    offset = 0
    for n in counts:
        example_rows = continuation_rows(kind, token_lists[offset:offset + n])
        row_ranges.append((len(rows), len(rows) + len(example_rows)))
        rows += example_rows
        offset += n
    if max_seq_len:
        rows = crop_rows(rows, max_seq_len)
    batches = pack_rows(rows, batch_tokens) if batch_tokens > 0 else [list(range(a, b)) for a, b in row_ranges]
    scores = score_rows(model, rows, batches, device, tokenizer.get_bos_token_id(), stop)
    outcomes = []
    for i, (a, b) in zip(indices, row_ranges):
        losses = [loss for loss, _ in scores[a:b]]
        if kind == "language_modeling":
            pred = None
            correct = scores[a][1]
        else:
            pred = losses.index(min(losses))  # ties go to the first option
            correct = pred == data[i]["gold"]
        outcomes.append({"index": i, "correct": bool(correct), "pred": pred, "losses": losses})
    return outcomes


def evaluate_core(model, tokenizer, device, bundle_dir, max_per_task=-1, batch_tokens=DEFAULT_BATCH_TOKENS,
                  verbose=True, stop=None):
    """
    `model` (model(ids) -> logits (B, T, vocab); the uncompiled one: shapes vary) on every task of the bundle in
    `bundle_dir`, under the caller's autocast; under torchrun every rank calls it and all get the same result.
    max_per_task > 0: the first N examples of each task's fixed shuffle. Rows are cropped from the left to the
    model's context (model.config.sequence_len, if it has one). verbose: a line per task with the time left (rank
    0); stop: asked before every forward, Interrupted on every rank at the end of the task. Returns {"name": "CORE"
    (offline: "pydocs-CORE"), "score": mean centered accuracy, "tasks": {label: {"type", "shots", "examples",
    "correct", "accuracy", "baseline", "centered", "seconds"}}, "bundle_dir", "max_per_task"}. Few-shot counts above
    len(examples) - 1 are clamped.
    """
    bundle = load_bundle(bundle_dir)
    max_seq_len = getattr(getattr(model, "config", None), "sequence_len", None)
    name = bundle["name"]
    tasks = bundle["tasks"]
    results = {}
    datasets = []
    for task in tasks:
        data = load_task_data(task["path"])
        random.Random(SHUFFLE_SEED).shuffle(data)
        if max_per_task > 0:
            data = data[:max_per_task]
        if not data:
            raise UserError(f"task {task['label']} has no examples ({task['path']})")
        datasets.append(data)
    total_examples = sum(len(data) for data in datasets)
    examples_done = 0
    started = time.time()
    if verbose:  # what it covers, up front; after each task, the time left at the rate so far
        print0(f"{name}: {len(tasks)} tasks, {total_examples:,} examples from {bundle_dir}"
               + (f" (at most {max_per_task} each)" if max_per_task > 0 else ""))
        print0(f"{'task':<32} {'type':<17} {'shots':>5} {'examples':>8} {'accuracy':>8} {'centered':>8} {'time':>7}")
    for task, data in zip(tasks, datasets):
        t0 = time.time()
        shots = min(task["num_fewshot"], len(data) - 1)
        if shots < task["num_fewshot"]:
            print0(f"note: {task['label']} asks for {task['num_fewshot']} few-shot examples but has only {len(data)} "
                   f"examples{' after max_per_task' if max_per_task > 0 else ''}: using {shots}")
        correct, total, _ = evaluate_task(model, tokenizer, task, data, device, shots, batch_tokens, max_seq_len, stop)
        accuracy = correct / total
        centered = (accuracy - task["baseline"]) / (1.0 - task["baseline"])
        results[task["label"]] = {"type": task["type"], "shots": shots, "examples": total, "correct": correct,
                                  "accuracy": accuracy, "baseline": task["baseline"], "centered": centered,
                                  "seconds": time.time() - t0}
        examples_done += len(data)
        if verbose:
            left = (total_examples - examples_done) * (time.time() - started) / examples_done
            left_text = f"  (~{duration(left)} left)" if examples_done < total_examples else ""
            print0(f"{task['label']:<32} {task['type']:<17} {shots:>5} {total:>8} {accuracy:>8.4f} {centered:>8.4f} "
                   f"{time.time() - t0:>6.1f}s{left_text}")
    score = sum(r["centered"] for r in results.values()) / len(results)
    if verbose:
        print0(f"{name} metric: {score:.4f}")
    return {"name": name, "score": score, "tasks": results, "bundle_dir": bundle_dir, "max_per_task": max_per_task}
