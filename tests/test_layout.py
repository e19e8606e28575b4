"""
The shape of the code base, kept where a reader can live with it: a small package (at most 26 modules in nanochat/),
no file over 450 lines, test modules that share through tests/helpers.py rather than import each other, and imports
inside nanochat/ that form no circle and no chain longer than 6 modules (every import counted, also those inside a
function: a circle through a late import is still a circle).
"""

import ast
import os

from helpers import REPO_ROOT

MAX_MODULES, MAX_LINES, MAX_CHAIN = 26, 450, 6


def python_files(*folders):
    for folder in folders:
        for root, _, names in os.walk(os.path.join(REPO_ROOT, folder)):
            yield from (os.path.join(root, n) for n in sorted(names) if n.endswith(".py"))


def imported_modules(path):
    """Every module name `path` imports, anywhere in it (`from a.b import c` gives a.b and a.b.c)."""
    names = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def package_imports():
    """{module of nanochat/: the modules of nanochat/ it imports}."""
    modules = {os.path.basename(p)[:-3] for p in python_files("nanochat") if not p.endswith("__init__.py")}
    return {m: {n.split(".")[1] for n in imported_modules(os.path.join(REPO_ROOT, "nanochat", m + ".py"))
                if n.startswith("nanochat.") and n.split(".")[1] in modules} - {m} for m in modules}


def test_the_package_has_at_most_26_modules():
    graph = package_imports()
    assert len(graph) <= MAX_MODULES, sorted(graph)


def test_no_file_is_longer_than_450_lines():
    long = {os.path.relpath(p, REPO_ROOT): n for p in python_files("nanochat", "scripts", "tasks", "tests", "bench")
            if (n := len(open(p, encoding="utf-8").read().splitlines())) > MAX_LINES}
    assert not long, long


def test_no_test_module_imports_another():
    test_modules = {os.path.basename(p)[:-3] for p in python_files("tests") if os.path.basename(p).startswith("test_")}
    offenders = {os.path.relpath(p, REPO_ROOT): sorted(n for n in imported_modules(p) if n.split(".")[-1] in test_modules
                                                        or n.split(".")[0] in test_modules)
                 for p in python_files("tests")}
    assert not {p: names for p, names in offenders.items() if names}, offenders


def test_imports_inside_the_package_form_no_circle_and_short_chains():
    graph = package_imports()

    def longest_chain(module, path=()):
        assert module not in path, f"import circle: {' -> '.join(path + (module,))}"
        return max((longest_chain(m, path + (module,)) for m in graph[module]), key=len, default=path + (module,))

    chain = max((longest_chain(m) for m in graph), key=len)
    assert len(chain) <= MAX_CHAIN, " -> ".join(chain)
