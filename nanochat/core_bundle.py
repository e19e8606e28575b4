"""
The offline evaluation bundle: CORE-style tasks from the pydocs records, in the DCLM bundle's exact format.

For runs without network, and for models trained on pydocs, which have never read DCLM's web text. core_eval reads
and scores it with the same code; prepare_bundle("offline") builds it into <base_dir>/eval_bundle_pydocs_v<N>/, the
same bytes for the same Python. Its score, "pydocs-CORE", is not comparable with CORE. Every task (TASKS) asks for
text the corpus contains verbatim, so the score rises as the model learns the corpus. Items use entries with a header
of at most MAX_HEADER characters and a first docstring line of 12-100 characters and 3+ words, verbatim; the options
of an item are distinct; at most ITEMS_PER_TASK per task (the first its builder yields), drawn by
random.Random(f"pydocs-core-{label}"). The tasks, with examples: docs/evaluation.md.
"""

import collections
import csv
import json
import os
import random
import re
from itertools import islice

from nanochat.pydocs import pydocs_document, pydocs_entries

BUNDLE_VERSION = 1  # bump when the tasks change: the directory name changes, so old builds are not reused
BUNDLE_DIR = f"eval_bundle_pydocs_v{BUNDLE_VERSION}"
SCORE_NAME = "pydocs-CORE"
ITEMS_PER_TASK = 400
OPTIONS = 4  # choices / context options per multiple choice and schema item
MAX_HEADER = 100  # characters
DEFAULTS = ("None", "True", "False", "0")  # pydocs_default's choices: the four most common default values


def _docs():
    """[(record, header, first docstring line or None)] of every non-topic record, in pydocs_entries() order."""
    out = []
    for r in pydocs_entries():
        if r["kind"] == "topic":
            continue
        doc = pydocs_document(r)
        header = doc[:len(doc) - len(r["docstring"]) - 2]  # the document is header + "\n\n" + docstring
        line = r["docstring"].split("\n", 1)[0]
        usable = line == line.strip() and 12 <= len(line) <= 100 and len(line.split()) >= 3 and "  " not in line
        out.append((r, header, line if usable else None))
    return out


def _pick(rng, pool, n, exclude_lines):
    """n entries of `pool` whose first lines differ from each other and from `exclude_lines` (64 draws), or None."""
    picked = []
    lines = set(exclude_lines)
    for _ in range(64):
        d = rng.choice(pool)
        if d[2] not in lines:
            picked.append(d)
            lines.add(d[2])
            if len(picked) == n:
                return picked
    return None


def _options(rng, gold, others):
    """Shuffle gold in among the others: (options, index of gold)."""
    options = [gold] + others
    rng.shuffle(options)
    return options, options.index(gold)


def _matched_items(rng, usable, pool_of, make_item):
    """
    The items: each usable entry, in random order, with OPTIONS - 1 others from pool_of(entry) whose first lines all
    differ (entries for which no such others are found are skipped).
    """
    for d in rng.sample(usable, len(usable)):
        others = _pick(rng, pool_of(d), OPTIONS - 1, {d[2]})
        if others:
            yield make_item(d, others)


def _same_kind_items(docs, rng, make_item):
    """_matched_items of the usable entries (a first line and a short header), the others of the same kind."""
    usable = [d for d in docs if d[2] and len(d[1]) <= MAX_HEADER]
    by_kind = collections.defaultdict(list)
    for d in usable:
        by_kind[d[0]["kind"]].append(d)
    return _matched_items(rng, usable, lambda d: by_kind[d[0]["kind"]], make_item)


def _summary(docs, rng):
    def item(d, others):
        choices, gold = _options(rng, d[2], [o[2] for o in others])
        return {"query": d[1], "choices": choices, "gold": gold}
    return _same_kind_items(docs, rng, item)


def _schema_item(rng, d, others):
    """Which of these headers does d's first line follow?"""
    options, gold = _options(rng, d[1], [o[1] for o in others])
    return {"context_options": options, "continuation": d[2], "gold": gold}


def _header(docs, rng):
    return _same_kind_items(docs, rng, lambda d, others: _schema_item(rng, d, others))


def _owner(docs, rng):
    def short_name(d):
        return d[0]["name"].rsplit(".", 1)[-1]
    groups = collections.defaultdict(list)
    for d in docs:
        if d[2] and len(d[1]) <= MAX_HEADER and d[0]["kind"] in ("function", "method"):
            groups[short_name(d)].append(d)
    usable = [d for group in groups.values() if len({g[2] for g in group}) >= OPTIONS for d in group]
    return _matched_items(rng, usable, lambda d: groups[short_name(d)], lambda d, others: _schema_item(rng, d, others))


def _default(docs, rng):
    # `name=value` written without spaces: a plain parameter (annotated ones read `name: int = 0`)
    pattern = re.compile(r"[(, ]([A-Za-z_]\w*)=(" + "|".join(DEFAULTS) + r")(?=[,)])")
    by_value = collections.defaultdict(list)
    for r, header, _ in docs:
        if r["kind"] in ("function", "method"):
            sites = [m for m in pattern.finditer(header) if m.start() >= len(r["name"]) and m.end(1) <= MAX_HEADER]
            if sites:
                m = rng.choice(sites)
                by_value[m.group(2)].append((header[:m.end(1)], m.group(2)))
    for value in DEFAULTS:  # the same number of items per answer
        for query, gold in rng.sample(by_value[value], min(ITEMS_PER_TASK // len(DEFAULTS), len(by_value[value]))):
            choices = rng.sample(DEFAULTS, len(DEFAULTS))
            yield {"query": query, "choices": choices, "gold": choices.index(gold)}


def _next_word(docs, rng):
    for r, header, line in rng.sample(docs, len(docs)):
        if not line or len(header) > MAX_HEADER:
            continue
        words = line.split(" ")
        targets = [j for j in range(2, len(words)) if re.fullmatch(r"[A-Za-z]{2,}", words[j])]
        if targets:
            j = rng.choice(targets)
            yield {"context": f"{header}\n\n{' '.join(words[:j])}", "continuation": words[j]}


def _next_param(docs, rng):
    for r, header, _ in rng.sample(docs, len(docs)):
        if r["kind"] not in ("function", "method"):
            continue
        sites = [m for m in re.finditer(r", ([A-Za-z_]\w*)(?=[=,):])", header)
                 if m.start() > len(r["name"]) and m.start() + 1 <= MAX_HEADER]
        if sites:
            m = rng.choice(sites)
            yield {"context": header[:m.start() + 1], "continuation": m.group(1)}


# label, icl_task_type, shots, continuation delimiter, builder, options (0 = language modeling), description
TASKS = [
    ("pydocs_summary", "multiple_choice", 0, "\n\n", _summary, OPTIONS,
     "which first docstring line follows this header? (4 entries of the same kind)"),
    ("pydocs_default", "multiple_choice", 3, "=", _default, len(DEFAULTS),
     "the default value of this parameter: None, True, False or 0 (balanced answers)"),
    ("pydocs_header", "schema", 0, "\n\n", _header, OPTIONS,
     "which of 4 headers of the same kind does this first docstring line follow?"),
    ("pydocs_owner", "schema", 0, "\n\n", _owner, OPTIONS,
     "which of 4 functions/methods of the same short name does this first docstring line document?"),
    ("pydocs_next_word", "language_modeling", 0, " ", _next_word, 0,
     "the next word of a docstring's first line, after its header"),
    ("pydocs_next_param", "language_modeling", 2, " ", _next_param, 0,
     "the next parameter name of a signature, after a comma"),
]


def write_offline_bundle(directory):
    """Write the bundle's files into the (empty) `directory` and return it (see core_eval.prepare_bundle)."""
    docs = _docs()
    os.makedirs(os.path.join(directory, "eval_data", "pydocs"))
    yaml_lines = ["# CORE-style tasks built offline from the pydocs records by nanochat/core_bundle.py,",
                  "# in the format of DCLM's eval_bundle. The score is pydocs-CORE, not comparable with CORE.",
                  f"score_name: {SCORE_NAME}", "icl_tasks:"]
    meta_rows = []
    for label, kind, shots, delimiter, build, options, description in TASKS:
        items = list(islice(build(docs, random.Random(f"pydocs-core-{label}")), ITEMS_PER_TASK))
        uri = f"pydocs/{label.removeprefix('pydocs_')}.jsonl"
        with open(os.path.join(directory, "eval_data", uri), "w", encoding="utf-8", newline="\n") as f:
            f.writelines(json.dumps(item, ensure_ascii=False) + "\n" for item in items)
        yaml_lines += [f"# {description} ({len(items)} items)", f"- label: {label}", f"  dataset_uri: {uri}",
                       f"  num_fewshot: [{shots}]", f"  icl_task_type: {kind}",
                       f"  continuation_delimiter: {json.dumps(delimiter)}"]
        meta_rows.append([label, "pydocs", kind, shots, 100 / options if options else 0.0])
    with open(os.path.join(directory, "core.yaml"), "w", encoding="utf-8", newline="\n") as f:
        f.write("\n".join(yaml_lines) + "\n")
    with open(os.path.join(directory, "eval_meta_data.csv"), "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["Eval Task", "Task Category", "Task Type", "#shots", "Random baseline"])
        writer.writerows(meta_rows)
    return directory
