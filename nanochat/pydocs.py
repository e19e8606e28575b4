"""
The pydocs corpus's documents: the running Python's own documentation, collected offline.

The same Python gives the same documents. pydocs_entries() gives the records (also the source of the offline chat
tasks and of core_bundle), pydocs_documents() the shuffled corpus documents that nanochat.dataset writes as shards.
What is collected, and what is skipped and why: docs/data.md.
"""

import ast
import functools
import inspect
import logging
import os
import random
import sys
import tokenize

logger = logging.getLogger("nanochat.pydocs")

# Records, in this order (sorted at every level): 1. the standard library's .py files, parsed with `ast`, never
# imported (module code runs on import); 2. C modules without a Python twin, read in a fresh `python -I`; 3. the
# pydoc_data topics. Duplicated texts are kept once. Details, and what is skipped: docs/data.md.

_PYDOCS_SKIP_DIRS = {"site-packages", "lib-dynload", "__pycache__", "test", "tests", "idle_test", "idlelib",
                     "turtledemo", "pydoc_data", "__phello__", "encodings"}
_PYDOCS_SKIP_FILES = {"this.py", "antigravity.py", "__hello__.py"}
# C twins whose pure-Python source lives under a name the generic rule (_x -> x, _pyx, _py_x) misses
_C_TWINS = {"_elementtree": ["xml.etree.ElementTree"]}
PYDOCS_SEED = 1337      # fixed shuffle: same corpus bytes on every build


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
    records = []
    seen = set()
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
            if isinstance(node, ast.ClassDef):
                kind = "class"
            else:
                kind = "method" if in_class else "function"
            if _usable(doc):
                records.append(_record(name, kind, module, _source_signature(node, lines), doc))
            if isinstance(node, ast.ClassDef):
                visit(node.body, name, True)

    visit(tree.body, module, False)
    return records


def _c_module_docs():
    """
    Runs in a fresh interpreter (_c_records sends it as source, so it imports all it uses): prints, as JSON, a raw
    record of each C module and its public classes, functions and class methods, `key` = id() of the object.
    """
    import importlib, inspect, json, os, re, sys, warnings

    def skip(name):
        # _test*/xx*: CPython's own test modules; readline may write terminal escapes on import; _tkinter
        # and _curses_panel belong to skipped or display-bound packages
        return (name.startswith(("_test", "xx", "_xx", "_ctypes_test"))
                or name in ("readline", "_tkinter", "_curses_panel"))

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
    Records of the C modules, without what the Python sources already document (`source_names`, `seen_docs`, which
    it extends); read in a fresh `python -I`, not in this possibly patched process (docs/data.md).
    """
    import json
    import subprocess
    code = inspect.getsource(_c_module_docs) + "\n_c_module_docs()\n"
    proc = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"reading the C modules' docstrings failed:\n{proc.stderr}")
    records = []
    seen_keys = set()
    for r in json.loads(proc.stdout):
        module = r["module"]
        key = r.pop("key")
        rest = r["name"][len(module):]
        twins = [module[1:], "_py" + module[1:], "_py" + module] if module.startswith("_") else []
        twins += _C_TWINS.get(module, [])
        if (key in seen_keys or not _usable(r["docstring"]) or _same_text(r["docstring"]) in seen_docs
                or any(t + rest in source_names for t in twins)):
            continue
        seen_keys.add(key)
        seen_docs.add(_same_text(r["docstring"]))
        records.append(r)
    return records


def _topic_records():
    """
    One record per pydoc topic text. Some keys share a text ("else" and "if"): one record, named by the
    key its title quotes (`The "if" statement`), else by the first key.
    """
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
    """
    Collected once per Python installation and kept in <base_dir>/pydocs_entries.json under a key naming the Python
    build and this file's text: parsing the standard library takes ~4 s of one core, which each rank of every chat
    stage paid at its start (the offline tasks read the records). Under a file lock: the ranks of a torchrun start
    together.
    """
    import json

    from filelock import FileLock

    from nanochat.files import file_sha256, get_base_dir, write_json
    path = os.path.join(get_base_dir(), "pydocs_entries.json")
    key = f"{sys.version} {_stdlib_dir()} {file_sha256(__file__)}"
    with FileLock(path + ".lock"):
        try:
            with open(path, encoding="utf-8") as f:
                kept = json.load(f)
            if kept["key"] == key:
                return tuple(kept["records"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        records = _collect_entries()
        write_json(path, {"key": key, "records": records})
    return tuple(records)


def _collect_entries():
    source = []
    for module, path in _stdlib_sources():
        source.extend(_source_records(module, path))
    c = _c_records({r["name"] for r in source}, {_same_text(r["docstring"]) for r in source})
    return source + c + _topic_records()


def pydocs_entries():
    """
    The documentation of the running Python as a list of records, one per documented thing, whose order and content
    depend only on the Python installation:
      {"name": "json.dumps", "kind": "function", "module": "json",
       "signature": "(obj, *, skipkeys=False, ...)", "docstring": "Serialize ``obj`` to a JSON ..."}
    kind is module | class | function | method | topic. `signature` follows the name on its definition line
    (parameters and return annotation; bases for a class; "" for modules, topics and C functions without one).
    Names are fully qualified; a topic's is its help() key (`assert`). Docstrings are dedented (inspect.cleandoc).
    Collected once per Python installation (kept in <base_dir>, see _pydocs_entries_cached); a fresh list of fresh
    dicts each call.
    """
    return [dict(r) for r in _pydocs_entries_cached()]


def pydocs_document(record):
    """
    The corpus document of one record: a header line the way the docs write it, a blank line, the
    docstring. `module json`, `class json.JSONEncoder`, `json.dumps(obj, *, skipkeys=False, ...)`;
    a topic is its text alone (it starts with its own title).
    """
    kind = record["kind"]
    name = record["name"]
    if kind == "topic":
        return record["docstring"]
    if kind == "module":
        header = f"module {name}"
    elif kind == "class":
        header = f"class {name}{record['signature']}"
    else:
        header = f"{name}{record['signature']}"
    return f"{header}\n\n{record['docstring']}"


def pydocs_documents():
    """All pydocs documents, shuffled with a fixed seed (so shards and validation set mix all modules)."""
    docs = [pydocs_document(r) for r in pydocs_entries()]
    random.Random(PYDOCS_SEED).shuffle(docs)
    return docs
