"""
The pretraining corpora: where the text comes from, how it lies on disk, and how it is read back.

Two corpora share one on-disk format, so the tokenizer and the dataloader never know which one they read:
parquet shards `shard_00000.parquet`, `shard_00001.parquet`, ... with a single `text` column (one document
per row), in `<base_dir>/base_data/<corpus>/`. The LAST shard is the validation shard; all others are
training shards. $NANOCHAT_DATASET picks the corpus, read at every call (not at import):

  fineweb-edu (default)  FineWeb-Edu 100B, shuffled: 1823 shards of ~250M characters of educational web
                         text, downloaded from the Hugging Face hub by `python -m nanochat.dataset -n N`.
                         The real thing, for GPU runs.
  pydocs                 The running Python's own documentation (~2.5M characters), built offline in seconds
                         from the standard library: the corpus for CPU runs, tests and laptops. Built by
                         `NANOCHAT_DATASET=pydocs python -m nanochat.dataset`, or on demand by
                         list_parquet_files() (see build_pydocs).

Reading API (used by the tokenizer trainer and the dataloader):
  list_parquet_files(split)   sorted shard paths of "train" or "val"
  list_row_groups(split)      [(path, row_group_index), ...] in one fixed global order
  read_row_group(path, i)     the documents (list[str]) of one row group
  parquets_iter_batched(split, start, step)
                              one pass over row groups start, start+step, ... (rank striding)

Why row groups: a parquet file is split into row groups that can be read independently, so a row group
(~1024 documents) is the unit of reading. Rank r of a world of size W reads row groups r, r+W, r+2W, ...
of the global order: every rank reads different documents, nobody reads a whole shard it does not need.
"""

import argparse
import ast
import functools
import inspect
import logging
import os
import random
import re
import shutil
import sys
import time
import tokenize
from concurrent.futures import ThreadPoolExecutor, as_completed

import pyarrow as pa
import pyarrow.parquet as pq
from filelock import FileLock

from nanochat.common import UserError, closest, download_file_with_lock, get_base_dir, setup_default_logging

logger = logging.getLogger("nanochat.dataset")  # not __name__: that is "__main__" under `python -m`

CORPORA = ("fineweb-edu", "pydocs")
DEFAULT_CORPUS = "fineweb-edu"
SHARD_RE = re.compile(r"^shard_(\d{5})\.parquet$")
ROW_GROUP_SIZE = 1024  # documents per row group: the unit the dataloader reads and strides over

# FineWeb-Edu 100B, shuffled: the documents were shuffled before sharding, so any prefix of the shards is a
# uniform sample of the whole dataset, and downloading the first N shards is as good as any N.
FINEWEB_URL = "https://huggingface.co/datasets/karpathy/fineweb-edu-100b-shuffle/resolve/main"
FINEWEB_SHARDS = 1823  # shard_00000 .. shard_01822; the last one is the validation shard


def shard_name(index):
    return f"shard_{index:05d}.parquet"


def dataset_name():
    """The selected corpus: $NANOCHAT_DATASET, `fineweb-edu` when unset. Anything else is a UserError."""
    name = os.environ.get("NANOCHAT_DATASET") or DEFAULT_CORPUS
    if name not in CORPORA:
        hint = closest(name, CORPORA)
        raise UserError(f"NANOCHAT_DATASET={name!r} is not a corpus; use one of {', '.join(CORPORA)}"
                        + (f" (did you mean {hint[0]}?)" if hint else ""))
    return name


def data_dir():
    """The directory of the selected corpus: <base_dir>/base_data/<corpus>."""
    return os.path.join(get_base_dir(), "base_data", dataset_name())


def fetch_command():
    """The exact command that gets the selected corpus; error messages quote it."""
    if dataset_name() == "pydocs":
        return "NANOCHAT_DATASET=pydocs python -m nanochat.dataset"
    return "python -m nanochat.dataset -n 8"


# -----------------------------------------------------------------------------
# Reading (both corpora)


def check_shard(path):
    """
    Raise IOError unless `path` is a readable parquet file with a string `text` column. Reads only the
    footer (a few KB), so checking every shard is cheap. A truncated file fails here: the footer, and the
    `PAR1` magic bytes that end every parquet file, are at its end.
    """
    try:
        schema = pq.ParquetFile(path).schema_arrow
    except Exception as e:  # pyarrow raises ArrowInvalid (a ValueError) or OSError, depending on the damage
        raise IOError(f"{path} is not a valid parquet file: {e}") from e
    text_type = schema.field("text").type if "text" in schema.names else None
    if text_type is None or not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type)):
        raise IOError(f"{path} has no string column `text` (columns: {', '.join(schema.names)})")


def _local_shards(directory):
    """{index: path} of the shard files present in `directory` (temp files and locks are not shards)."""
    if not os.path.isdir(directory):
        return {}
    found = {}
    for name in os.listdir(directory):
        m = SHARD_RE.match(name)
        if m:
            found[int(m.group(1))] = os.path.join(directory, name)
    return found


def list_parquet_files(split):
    """
    Sorted paths of the shards of `split`: "train" = every shard present except the validation shard,
    "val" = [the validation shard]. The validation shard is fixed: the last shard of the dataset
    (shard_01822 for FineWeb-Edu), not the last one downloaded, so downloading more training shards never
    changes the validation set. For pydocs the corpus is built first if it is not on disk (build_pydocs).

    Raises UserError naming the command that fixes it when data is missing or a shard is damaged.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    name = dataset_name()
    if name == "pydocs":
        directory = build_pydocs()
        shards = _local_shards(directory)
        if not shards:
            raise UserError(f"the pydocs corpus at {directory} has no shards; delete that directory and run "
                            f"`{fetch_command()}`")
        val_index = max(shards)  # built all at once, atomically: the last shard present is the last shard
    else:
        directory = data_dir()
        shards = _local_shards(directory)
        val_index = fineweb_num_shards() - 1
    if split == "val":
        wanted = [val_index] if val_index in shards else []
    else:
        wanted = sorted(i for i in shards if i < val_index)
    if not wanted:
        what = f"the validation shard {shard_name(val_index)}" if split == "val" else "no training shards"
        raise UserError(f"{name} data missing: {what} in {directory}; get it with `{fetch_command()}`")
    paths = [shards[i] for i in wanted]
    for path in paths:
        try:
            check_shard(path)
        except IOError as e:
            raise UserError(f"{e}. Run `{fetch_command()}` again: it replaces damaged shards") from None
    return paths


def list_row_groups(split):
    """[(path, row_group_index), ...] of `split`: shards in sorted order, row groups in file order."""
    out = []
    for path in list_parquet_files(split):
        out.extend((path, i) for i in range(pq.ParquetFile(path).num_row_groups))
    return out


def read_row_group(path, index):
    """The documents (list[str]) in row group `index` of the shard at `path`."""
    return pq.ParquetFile(path).read_row_group(index, columns=["text"]).column("text").to_pylist()


def parquets_iter_batched(split, start=0, step=1):
    """
    One pass over the row groups of `split`, yielding each row group's documents (list[str]). Only row
    groups start, start + step, start + 2*step, ... of the global order (list_row_groups) are read: with
    start=rank and step=world_size every rank gets its own disjoint share and together they cover all.
    """
    if start < 0 or step < 1:
        raise ValueError(f"need start >= 0 and step >= 1, got start={start}, step={step}")
    current_path, current_file = None, None
    for path, index in list_row_groups(split)[start::step]:
        if path != current_path:  # open each shard once, not once per row group
            current_path, current_file = path, pq.ParquetFile(path)
        yield current_file.read_row_group(index, columns=["text"]).column("text").to_pylist()


# -----------------------------------------------------------------------------
# FineWeb-Edu: download


def fineweb_num_shards():
    """Number of shards of the dataset: 1823, or $NANOCHAT_FINEWEB_SHARDS (tests serve a tiny dataset)."""
    raw = os.environ.get("NANOCHAT_FINEWEB_SHARDS")
    if not raw:
        return FINEWEB_SHARDS
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 2:
        raise UserError(f"NANOCHAT_FINEWEB_SHARDS={raw!r}: need an integer >= 2 (training shards + 1 validation shard)")
    return n


def fineweb_url():
    """Base URL the shards are downloaded from: the hub, or $NANOCHAT_DATA_URL (a mirror, or a test server)."""
    return (os.environ.get("NANOCHAT_DATA_URL") or FINEWEB_URL).rstrip("/")


def download_fineweb(num_train_shards, workers=4):
    """
    Download training shards 0 .. num_train_shards-1 (-1 = all) and the validation shard into data_dir(),
    `workers` at a time. Shards already present and valid are skipped; a present shard that is not a valid
    parquet file is deleted and downloaded again. Each download goes through download_file_with_lock
    (retries, timeouts, temp file then rename, one downloader per file across processes) and is checked
    with check_shard before the rename, so a shard on disk is always complete.
    Returns the list of shard indices that were downloaded by this call.
    """
    total = fineweb_num_shards()
    val_index = total - 1
    if num_train_shards == -1:
        num_train_shards = val_index
    if not 0 <= num_train_shards <= val_index:
        raise UserError(f"-n {num_train_shards}: the dataset has {val_index} training shards (plus the validation "
                        f"shard); use 0..{val_index}, or -1 for all")
    if workers < 1:
        raise UserError(f"-w {workers}: need at least 1 worker")
    directory = os.path.join(get_base_dir(), "base_data", "fineweb-edu")
    wanted = list(range(num_train_shards)) + [val_index]
    present = _local_shards(directory)
    for i in wanted:
        if i in present:
            try:
                check_shard(present[i])
            except IOError as e:
                logger.warning(f"Shard {i} is damaged ({e}); deleting it and downloading it again")
                os.remove(present[i])
    todo = [i for i in wanted if not os.path.exists(os.path.join(directory, shard_name(i)))]
    logger.info(f"FineWeb-Edu: {num_train_shards} training shards + validation Shard {val_index} wanted, "
                f"{len(wanted) - len(todo)} already in {directory}, downloading {len(todo)} from {fineweb_url()} "
                f"with {min(workers, max(len(todo), 1))} worker(s)")

    def fetch(i):
        path = download_file_with_lock(f"{fineweb_url()}/{shard_name(i)}",
                                       os.path.join("base_data", "fineweb-edu", shard_name(i)),
                                       postprocess_fn=check_shard)
        return os.path.getsize(path)

    done, failed = [], []
    # Threads, not processes: a download waits on the network and the parquet check runs in pyarrow's C++,
    # both without holding the GIL.
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(todo)))) as pool:
        futures = {pool.submit(fetch, i): i for i in todo}
        for future in as_completed(futures):
            i = futures[future]
            try:
                size = future.result()
            except UserError as e:
                failed.append(i)
                logger.error(f"Shard {i} failed: {e}")
                continue
            done.append(i)
            logger.info(f"Downloaded Shard {i} ({size / 2**20:.1f} MB), {len(done) + len(failed)}/{len(todo)} done")
    if failed:
        names = ", ".join(shard_name(i) for i in sorted(failed))
        raise UserError(f"{len(failed)} of {len(todo)} shard download(s) failed ({names}); "
                        f"run the same command again: shards already downloaded are kept")
    return sorted(done)


# -----------------------------------------------------------------------------
# pydocs: the Python documentation as a corpus
#
# One record per documented thing, in this order (sorted at every level, so the same Python gives the
# same list):
#   1. every standard-library .py file, parsed with `ast` (never imported: importing runs module code,
#      and `antigravity` opens a browser, `this` prints, tkinter wants a display): the module docstring
#      (kind "module"), then every class, function and method with a docstring (kinds "class",
#      "function", "method"), in source order. Names starting with a single "_" are private and skipped
#      (dunders like __init__ are kept); private *modules* (_pydecimal, _collections_abc, ...) are kept,
#      because they hold the real documentation of public modules.
#   2. C modules without Python source (sys.builtin_module_names and lib-dynload), imported in a fresh
#      `python -I` (their import is side-effect free; the few that are not, or that test CPython itself,
#      are skipped): their public classes, functions and the classes' public methods. An entry is
#      dropped when the Python sources already document the same name through a pure-Python twin
#      (`_heapq.heappush` vs `heapq.heappush`, `_decimal.X` vs `_pydecimal.X`, `_io.X` vs `_pyio.X`) or
#      when its docstring already appeared (up to whitespace): the corpus does not learn a text twice.
#   3. every entry of pydoc_data.topics: the language reference topics `help("assert")` shows (kind
#      "topic"), e.g. the `assert` statement, operator precedence, sequence types. Aliases sharing a
#      text ("else", "if") give one record.
# Skipped source: test packages (test, tests, idle_test), idlelib, turtledemo, site-packages, the joke
# modules this/antigravity, generated tables (encodings.* codecs, _sysconfigdata*), pydoc_data itself.

_PYDOCS_SKIP_DIRS = {"site-packages", "lib-dynload", "__pycache__", "test", "tests", "idle_test", "idlelib",
                     "turtledemo", "pydoc_data", "__phello__", "encodings"}
_PYDOCS_SKIP_FILES = {"this.py", "antigravity.py", "__hello__.py"}
# C twins whose pure-Python source lives under a name the generic rule (_x -> x, _pyx, _py_x) misses
_C_TWINS = {"_elementtree": ["xml.etree.ElementTree"]}
PYDOCS_SEED = 1337      # fixed shuffle: same corpus bytes on every build
PYDOCS_VAL_DOCS = 1024  # documents in the validation shard: one row group
PYDOCS_SHARD_DOCS = 2 * ROW_GROUP_SIZE  # documents per training shard: two row groups


def _is_public(name):
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))


def _record(name, kind, module, signature, docstring):
    return {"name": name, "kind": kind, "module": module, "signature": signature, "docstring": docstring}


def _usable(text):
    """A docstring worth a record: not empty, and valid UTF-8 (parquet strings must be)."""
    if not text or not text.strip():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate in a string literal
        return False
    return True


def _stdlib_dir():
    return os.path.dirname(os.__file__)  # the real stdlib, also inside a venv


def _stdlib_sources():
    """[(module_name, path), ...] of the standard library's .py files, sorted by module name."""
    root = _stdlib_dir()
    out = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _PYDOCS_SKIP_DIRS and not d.startswith("config-")]
        rel = os.path.relpath(directory, root)
        package = [] if rel == "." else rel.split(os.sep)
        for f in files:
            if not f.endswith(".py") or f in _PYDOCS_SKIP_FILES or f.startswith("_sysconfigdata"):
                continue
            stem = f[:-3]
            parts = package if stem == "__init__" else package + [stem]
            if not parts:
                continue
            out.append((".".join(parts), os.path.join(directory, f)))
    # encodings/__init__ documents the codec machinery; the codec modules next to it are generated tables
    init = os.path.join(root, "encodings", "__init__.py")
    if os.path.exists(init):
        out.append(("encodings", init))
    return sorted(out)


def _defs(body):
    """The class/def statements of a module or class body, also inside module-level if/try/with blocks."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node
        elif isinstance(node, (ast.If, ast.Try, getattr(ast, "TryStar", ast.Try), ast.With)):
            for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                yield from _defs(block)
            for handler in getattr(node, "handlers", []):
                yield from _defs(handler.body)


def _as_written(expr, lines):
    """A one-line default value as the source writes it: ast.unparse would rewrite `mode=0o777` to `mode=511`."""
    if expr is None or expr.lineno != expr.end_lineno:
        return expr
    return ast.Name(id=lines[expr.lineno - 1][expr.col_offset:expr.end_col_offset].decode("utf-8", "replace"))


def _source_signature(node, lines):
    """What follows the name on a def/class line: `(a, b=1) -> int`, `(Base, metaclass=M)`, or ``."""
    if isinstance(node, ast.ClassDef):
        bases = [ast.unparse(b) for b in node.bases] + [ast.unparse(k) for k in node.keywords]
        return f"({', '.join(bases)})" if bases else ""
    node.args.defaults = [_as_written(d, lines) for d in node.args.defaults]
    node.args.kw_defaults = [_as_written(d, lines) for d in node.args.kw_defaults]
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"({ast.unparse(node.args)}){returns}"


def _source_records(module, path):
    try:
        with tokenize.open(path) as f:  # decoded as its coding cookie says, newlines normalized to \n
            source = f.read()
        tree = ast.parse(source, filename=path)
    except (SyntaxError, ValueError):  # not valid for this Python (e.g. lib2to3 fixtures); nothing to learn
        logger.debug(f"pydocs: skipping {path}: does not parse")
        return []
    lines = [line.encode("utf-8") for line in source.split("\n")]  # ast column offsets count UTF-8 bytes
    records, seen = [], set()
    doc = ast.get_docstring(tree)
    if _usable(doc):
        records.append(_record(module, "module", module, "", doc))

    def visit(body, prefix, in_class):
        for node in _defs(body):
            if not _is_public(node.name):
                continue
            name = f"{prefix}.{node.name}"
            if name in seen:  # platform alternatives (`if os.name == "nt": def f...`), property setters
                continue
            seen.add(name)
            doc = ast.get_docstring(node)
            kind = "class" if isinstance(node, ast.ClassDef) else "method" if in_class else "function"
            if _usable(doc):
                records.append(_record(name, kind, module, _source_signature(node, lines), doc))
            if isinstance(node, ast.ClassDef):
                visit(node.body, name, True)

    visit(tree.body, module, False)
    return records


def _c_module_docs():
    """
    Runs in a fresh interpreter (see _c_records; it is sent there as source, so it imports all it uses):
    prints, as JSON, one raw record per public class, function and class method of the C modules, plus
    each module's own docstring, with `key` = id() of the object so one object reached twice is kept once.
    """
    import importlib, inspect, json, os, re, sys, warnings

    def skip(name):
        # _test*/xx*: CPython's own test modules; readline may write terminal escapes on import; _tkinter
        # and _curses_panel belong to skipped or display-bound packages
        return name.startswith(("_test", "xx", "_xx", "_ctypes_test")) or \
            name in ("readline", "_tkinter", "_curses_panel")

    def signature(obj):
        if isinstance(obj, type):
            bases = [b.__name__ for b in obj.__bases__ if b is not object]
            return f"({', '.join(bases)})" if bases else ""
        try:
            sig = str(inspect.signature(obj))
        except Exception:  # no text signature, or defaults that do not evaluate (inspect evals them)
            return ""
        return "" if re.search(r"0x[0-9a-fA-F]{4,}", sig) else sig  # never an address: it changes every run

    def record(name, kind, module, obj):
        doc = obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else ""
        sig = signature(obj) if kind != "module" else ""
        return {"name": name, "kind": kind, "module": module, "signature": sig,
                "docstring": inspect.cleandoc(doc), "key": id(obj)}

    dynload = os.path.join(os.path.dirname(os.__file__), "lib-dynload")
    names = set(sys.builtin_module_names)
    if os.path.isdir(dynload):
        names |= {f.split(".")[0] for f in os.listdir(dynload) if f.endswith((".so", ".pyd"))}
    out = []
    for module in sorted(n for n in names if not skip(n)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # PEP 594 deprecations (audioop, nis, ...)
                mod = importlib.import_module(module)
        except Exception:  # not built on this system, or needs something absent: nothing to document
            continue
        if (getattr(mod, "__file__", None) or "").endswith(".py"):
            continue  # a Python module shadowing the name: its source, if any, was parsed already
        out.append(record(module, "module", module, mod))
        for attr in sorted(dir(mod)):
            obj = getattr(mod, attr, None)
            if attr.startswith("_") or not (isinstance(obj, type) or inspect.isroutine(obj)):
                continue
            out.append(record(f"{module}.{attr}", "class" if isinstance(obj, type) else "function", module, obj))
            if isinstance(obj, type):
                for member, value in sorted(vars(obj).items()):
                    if not member.startswith("_") and inspect.isroutine(value):
                        out.append(record(f"{module}.{attr}.{member}", "method", module, value))
    print(json.dumps(out))


def _same_text(doc):
    """Docstrings compared for duplicates ignore whitespace: a C copy of a Python docstring is rewrapped."""
    return " ".join(doc.split())


def _c_records(source_names, seen_docs):
    """
    Records of the C modules, without what the Python sources already document (see the notes above).
    They are read in a fresh `python -I` rather than here: this process may have replaced attributes of
    C modules (setup_default_logging sets sys.excepthook, a test may patch time.sleep), which would change
    the corpus, and importing ~80 extension modules here would leave them loaded for the whole run.
    """
    import json
    import subprocess
    code = inspect.getsource(_c_module_docs) + "\n_c_module_docs()\n"
    proc = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"reading the C modules' docstrings failed:\n{proc.stderr}")
    records, seen_keys = [], set()
    for r in json.loads(proc.stdout):
        module, key = r["module"], r.pop("key")
        rest = r["name"][len(module):]
        twins = [module[1:], "_py" + module[1:], "_py" + module] if module.startswith("_") else []
        twins += _C_TWINS.get(module, [])
        if key in seen_keys or not _usable(r["docstring"]) or _same_text(r["docstring"]) in seen_docs \
                or any(t + rest in source_names for t in twins):
            continue
        seen_keys.add(key)
        seen_docs.add(_same_text(r["docstring"]))
        records.append(r)
    return records


def _topic_records():
    """One record per pydoc topic text. Some keys share a text ("else" and "if"): one record, named by the
    key its title quotes (`The "if" statement`), else by the first key."""
    from pydoc_data.topics import topics
    keys_by_text = {}
    for key, text in sorted(topics.items()):
        keys_by_text.setdefault(text.strip(), []).append(key)
    records = []
    for text, keys in keys_by_text.items():
        title = text.split("\n", 1)[0]
        name = next((k for k in keys if f'"{k}"' in title), keys[0])
        if _usable(text):
            records.append(_record(name, "topic", "", "", text))
    return sorted(records, key=lambda r: r["name"])


@functools.lru_cache(maxsize=1)
def _pydocs_entries_cached():
    source = []
    for module, path in _stdlib_sources():
        source.extend(_source_records(module, path))
    c = _c_records({r["name"] for r in source}, {_same_text(r["docstring"]) for r in source})
    return tuple(source + c + _topic_records())


def pydocs_entries():
    """
    The documentation of the running Python as a deterministic list of records (the order and content
    depend only on the Python installation), one per documented thing:
      {"name": "json.dumps", "kind": "function", "module": "json",
       "signature": "(obj, *, skipkeys=False, ...)", "docstring": "Serialize ``obj`` to a JSON ..."}
    kind is module | class | function | method | topic. `signature` is what follows the name on its
    definition line: parameters and return annotation for functions and methods, bases for classes,
    "" for modules and topics (and for C functions without a text signature). Names are fully qualified
    (`builtins.len`, `collections.OrderedDict.popitem`); a topic's name is its help() key (`assert`).
    Docstrings are dedented (inspect.cleandoc). The corpus has one document per record (pydocs_document).
    Collected once per process (~3 s); a fresh list of fresh dicts is returned each call.
    """
    return [dict(r) for r in _pydocs_entries_cached()]


def pydocs_document(record):
    """
    The corpus document of one record: a header line the way the docs write it, a blank line, the
    docstring. `module json`, `class json.JSONEncoder`, `json.dumps(obj, *, skipkeys=False, ...)`;
    a topic is its text alone (it starts with its own title).
    """
    kind, name, sig = record["kind"], record["name"], record["signature"]
    if kind == "topic":
        return record["docstring"]
    header = f"module {name}" if kind == "module" else f"class {name}{sig}" if kind == "class" else f"{name}{sig}"
    return f"{header}\n\n{record['docstring']}"


def pydocs_documents():
    """All pydocs documents, shuffled with a fixed seed (so shards and validation set mix all modules)."""
    docs = [pydocs_document(r) for r in pydocs_entries()]
    random.Random(PYDOCS_SEED).shuffle(docs)
    return docs


def _write_pydocs(directory):
    """Write the shards into `directory`: training shards of 2 row groups, then one validation shard."""
    docs = pydocs_documents()
    if len(docs) < 2 * PYDOCS_VAL_DOCS:
        raise RuntimeError(f"pydocs found only {len(docs)} documents in {_stdlib_dir()}: is the standard library there?")
    train, val = docs[:-PYDOCS_VAL_DOCS], docs[-PYDOCS_VAL_DOCS:]
    shards = [train[i:i + PYDOCS_SHARD_DOCS] for i in range(0, len(train), PYDOCS_SHARD_DOCS)] + [val]
    os.makedirs(directory)
    for index, shard in enumerate(shards):
        table = pa.table({"text": pa.array(shard, type=pa.string())})
        # Same bytes on every build: no timestamps in parquet metadata, a fixed compression codec, and
        # pyarrow writes row groups and pages deterministically. row_group_size sets the reading unit.
        pq.write_table(table, os.path.join(directory, shard_name(index)), row_group_size=ROW_GROUP_SIZE,
                       compression="zstd")
    return len(docs), sum(len(d) for d in docs), len(shards)


def build_pydocs():
    """
    Make sure the pydocs corpus exists in <base_dir>/base_data/pydocs and return that directory; build
    it if missing (~5 s). list_parquet_files() calls it, so pydocs never needs a separate step; this
    is the one place a read builds data, because the build is offline, quick and deterministic.

    Safe under torchrun and against crashes: builders take a file lock (N ranks -> one build, the others
    wait and then find it done) and write into a temporary directory that is renamed to the final name
    only when complete. A build killed midway leaves a `pydocs.tmp<pid>` directory, never a corpus; the
    next build deletes it. To rebuild (e.g. after a Python upgrade changed the docs), delete the directory.
    """
    final = os.path.join(get_base_dir(), "base_data", "pydocs")
    if os.path.isdir(final):
        return final
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    with FileLock(final + ".lock"):
        if os.path.isdir(final):  # built by whoever held the lock before us
            return final
        for name in os.listdir(parent):  # we hold the lock: a temp dir here is from a builder that died
            if name.startswith("pydocs.tmp"):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        tmp = f"{final}.tmp{os.getpid()}"
        logger.info(f"Building the pydocs corpus from the docs of Python {sys.version.split()[0]} in {final}")
        t0 = time.time()
        try:
            docs, chars, shards = _write_pydocs(tmp)
            os.rename(tmp, final)
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
        logger.info(f"Built pydocs: {docs:,} docs, {chars / 1e6:.2f}M chars, {shards} shards "
                    f"in {time.time() - t0:.1f}s")
    return final


# -----------------------------------------------------------------------------
# Command line


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m nanochat.dataset",
        description="Get the pretraining corpus selected by $NANOCHAT_DATASET (fineweb-edu | pydocs) into "
                    "<base_dir>/base_data/<corpus>. fineweb-edu: download the first N training shards and the "
                    "fixed validation shard. pydocs: build it from this Python's documentation (-n and -w unused).")
    parser.add_argument("-n", "--num-files", type=int, default=None,
                        help="fineweb-edu: number of training shards to download, -1 = all 1822 (~250M chars each)")
    parser.add_argument("-w", "--num-workers", type=int, default=4, help="parallel downloads (default 4)")
    args = parser.parse_args(argv)
    setup_default_logging()
    name = dataset_name()
    t0 = time.time()
    if name == "pydocs":
        if args.num_files is not None:
            logger.warning("-n is ignored for pydocs: the corpus is built whole")
        if os.path.isdir(data_dir()):
            logger.info(f"pydocs is already built in {data_dir()} (delete that directory to rebuild it)")
        build_pydocs()
    else:
        if args.num_files is None:
            raise UserError("say how many training shards to download: -n 8 is enough to train the tokenizer, "
                            f"-n -1 downloads all {fineweb_num_shards() - 1} (plus the validation shard)")
        downloaded = download_fineweb(args.num_files, args.num_workers)
        print(f"Downloaded {len(downloaded)} shard(s) in {time.time() - t0:.1f}s: "
              f"{', '.join(shard_name(i) for i in downloaded) or 'none, all were present'}")
    # Summary of what is on disk now
    directory = data_dir()
    val = list_parquet_files("val")
    try:
        train = list_parquet_files("train")
    except UserError:  # `-n 0` downloads only the validation shard
        train = []
    docs = chars = row_groups = 0
    for path in train + val:
        pf = pq.ParquetFile(path)
        docs += pf.metadata.num_rows
        row_groups += pf.num_row_groups
        if name == "pydocs":  # counting FineWeb characters would read every shard; pydocs is small
            chars += sum(len(t) for t in pf.read(columns=["text"]).column("text").to_pylist())
    size = sum(os.path.getsize(p) for p in train + val)
    chars_text = f", {chars:,} chars" if name == "pydocs" else ""
    print(f"{name}: {len(train)} train shard(s) + 1 val shard ({os.path.basename(val[0])}), "
          f"{row_groups} row groups, {docs:,} docs{chars_text}, {size / 2**20:.1f} MB in {directory}")


if __name__ == "__main__":
    main()
