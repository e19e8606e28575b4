"""
The shape of the code base, as rules about concerns rather than sizes: a module splits when it holds two jobs, never
to fit a number, so nothing here counts modules, lines or the length of an import chain.

- No import circle among the project's modules (every import counted, also one inside a function: a circle through
  a late import is still a circle).
- The library stands on its own: nanochat/ never imports tasks/ or scripts/; no script imports another script; no
  test module imports another (tests/helpers.py and conftest.py are for sharing).
- Attention is chosen in one module: the probe that decides "auto" is asked by nanochat/attention_kernels.py alone,
  and the training stage (nanochat/stage.py) imports no kernel module (gpt, cpu_kernels) nor the probes.
- No module stands apart in its folder: a library module is used by the library or a script (imported, or copied as
  a file: the exported modeling file); a module of tasks/ by another one of tasks/ (the registry), unless it is a
  command of its own (`python -m tasks.prefetch`).
- Each module's first docstring line names its one job, and the README's layout table has exactly one row per
  module of nanochat/, with that line.
- Lines of at most 120 characters, one statement per line, no unused or undefined name: ruff (settings in
  pyproject.toml), which the README's test command also runs before the tests.
"""

import ast
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from helpers import REPO_ROOT

FOLDERS = ("nanochat", "scripts", "tasks", "tests", "bench")
PROJECT_PACKAGES = ("nanochat", "scripts", "tasks")


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


def project_modules():
    """{"nanochat.gpt": its path, ...} for the modules of nanochat/, scripts/ and tasks/ (no __init__)."""
    modules = {}
    for path in python_files(*PROJECT_PACKAGES):
        name = os.path.relpath(path, REPO_ROOT)[:-3].replace(os.sep, ".")
        if not name.endswith("__init__"):
            modules[name] = path
    return modules


def import_graph():
    """{module: the project modules it imports} over project_modules()."""
    modules = project_modules()
    return {name: {m for m in imported_modules(path) if m in modules} - {name} for name, path in modules.items()}


def module_docstring(path):
    return ast.get_docstring(ast.parse(open(path, encoding="utf-8").read()), clean=True) or ""


def test_no_import_circle():
    graph = import_graph()
    done = set()

    def visit(module, path):
        assert module not in path, f"import circle: {' -> '.join(path + (module,))}"
        if module not in done:
            for imported in sorted(graph[module]):
                visit(imported, path + (module,))
            done.add(module)

    for module in sorted(graph):
        visit(module, ())


def test_the_library_never_imports_tasks_or_scripts():
    offenders = {name: sorted(m for m in imported if m.startswith(("tasks.", "scripts.")))
                 for name, imported in import_graph().items() if name.startswith("nanochat.")}
    assert not {name: found for name, found in offenders.items() if found}, offenders


def test_no_script_imports_another_script():
    offenders = {name: sorted(m for m in imported if m.startswith("scripts."))
                 for name, imported in import_graph().items() if name.startswith("scripts.")}
    assert not {name: found for name, found in offenders.items() if found}, offenders


def test_no_test_module_imports_another():
    test_modules = {os.path.basename(p)[:-3] for p in python_files("tests") if os.path.basename(p).startswith("test_")}
    offenders = {}
    for path in python_files("tests"):
        names = [n for n in imported_modules(path)
                 if n.split(".")[-1] in test_modules or n.split(".")[0] in test_modules]
        if names:
            offenders[os.path.relpath(path, REPO_ROOT)] = sorted(names)
    assert not offenders, offenders


def test_attention_is_chosen_in_one_module():
    graph = import_graph()
    askers = sorted(name for name, path in project_modules().items()
                    if "dense_attention_pays(" in open(path, encoding="utf-8").read() and name != "nanochat.probes")
    assert askers == ["nanochat.attention_kernels"], askers
    kernels = graph["nanochat.stage"] & {"nanochat.gpt", "nanochat.cpu_kernels", "nanochat.probes"}
    assert not kernels, kernels


def test_no_module_stands_apart_in_its_folder():
    graph = import_graph()
    used_by = {name: {user for user, imported in graph.items() if name in imported} for name in graph}
    texts = {n: open(p, encoding="utf-8").read() for n, p in project_modules().items()}
    apart = []
    for name, users in used_by.items():
        # a file the library copies rather than imports (the exported modeling file) is named in another's code
        named = any(name.split(".")[-1] + ".py" in text for n, text in texts.items()
                    if n != name and n.startswith(("nanochat.", "scripts.")))
        used = any(u.startswith(("nanochat.", "scripts.")) for u in users) or named
        if name.startswith("nanochat.") and not used:
            apart.append(name)
        folder_mates = {u for u in users if u.startswith("tasks.")}
        if name.startswith("tasks.") and not folder_mates and "__main__" not in texts[name]:
            apart.append(name)
    assert not apart, f"imported by nothing of their folder (nor, for nanochat/, by a script): {apart}"


def test_nothing_outside_engine_py_uses_its_private_names():
    """
    A request's way (HTTP -> worker -> engine) never climbs back into the engine's parts: nothing outside
    nanochat/engine.py imports one of its `_names` or reads an attribute so named (its module's functions and classes,
    its classes' methods and attributes).
    """
    engine_path = os.path.join(REPO_ROOT, "nanochat", "engine.py")
    private = set()
    for node in ast.walk(ast.parse(open(engine_path, encoding="utf-8").read())):
        defined = isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)  # self._x = ...
        name = node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else node.attr if defined else ""
        if name.startswith("_") and not name.startswith("__"):
            private.add(name)
    assert "_static_step" in private  # what this test looks for
    offenders = []
    for path in python_files(*FOLDERS):
        if path == engine_path:
            continue
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Attribute) and node.attr in private:
                offenders.append(f"{os.path.relpath(path, REPO_ROOT)}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module == "nanochat.engine":
                offenders += [f"{os.path.relpath(path, REPO_ROOT)}:{node.lineno} import {alias.name}"
                              for alias in node.names if alias.name.startswith("_")]
    assert not offenders, offenders


def test_every_module_says_its_job_in_its_first_docstring_line():
    missing = [os.path.relpath(p, REPO_ROOT) for p in project_modules().values() if not module_docstring(p).strip()]
    assert not missing, f"no module docstring: {missing}"


def readme_layout_rows():
    """{module file name: the job its row gives} of the README's layout table (| `module.py` | job | names |)."""
    readme = open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8").read()
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.fullmatch(r"\| `(\w+\.py)` \| ([^|]+) \|.*\|", line.strip())
        if match:
            assert match.group(1) not in rows, f"two rows for {match.group(1)} in the README's layout table"
            rows[match.group(1)] = match.group(2)
    return rows


def test_the_readme_layout_table_has_one_row_per_module_with_its_job():
    rows = readme_layout_rows()
    modules = {os.path.basename(p): p for name, p in project_modules().items() if name.startswith("nanochat.")}
    assert sorted(rows) == sorted(modules), "README's layout table and nanochat/'s modules differ"
    for name, path in modules.items():
        first_line = module_docstring(path).splitlines()[0]
        assert rows[name] == first_line, f"{name}: README says {rows[name]!r}, its docstring {first_line!r}"


def test_ruff_finds_nothing():
    """Lines of at most 120 characters, one statement per line, pyflakes' names (pyproject.toml: [tool.ruff])."""
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *FOLDERS], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
