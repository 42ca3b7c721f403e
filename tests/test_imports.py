"""The import rules that keep the layers apart, checked on the source (every import, lazy ones included).

- The folders are floors: a module imports only from a lower floor or from its own package (LAYERS), so the
  package graph has no circle, and no module imports from a circle either (no module-level cycle).
- Only the command modules (dflash/commands/) import preflight; the library hears of it from them.
- The on-disk contracts, the plan and the memory model never import torch or transformers, not even lazily, so
  preflight and the estimator stay light (TORCH_FREE, walked through every project module they reach). A module
  started as its own process (`[python, "-m", "dflash.x"]`) counts for the floors and circles, but its imports load
  in that process, not in the one that starts it: the walk for torch does not follow it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("dflash", "preflight")
COMMANDS = "dflash.commands"
# floor of each package: imports go to a lower floor (or stay inside the package)
LAYERS = {"dflash.errors": 0, "dflash.filehash": 0, "dflash.config": 1, "dflash.models": 2, "dflash.memory": 3,
          "dflash.data": 4, "dflash.runs": 5, "dflash.eval": 6, "dflash.train": 7, "preflight": 7,
          "dflash.commands": 8, "dflash": 9}
TORCH_FREE = ("dflash.config", "dflash.errors", "dflash.filehash", "dflash.runs.rundir", "dflash.runs.verify",
              "dflash.runs.lock", "dflash.runs.metrics", "dflash.runs.resume", "dflash.runs.compile_artifact",
              "dflash.runs.records", "dflash.data.identity", "dflash.data.shards", "dflash.data.buckets", "dflash.data.packing",
              "dflash.data.plan", "dflash.models.custom_code", "dflash.models.weights", "dflash.models.fla_kept", "dflash.memory.shape",
              "dflash.memory.parts", "dflash.memory.fit", "dflash.memory.pace", "preflight.diff", "preflight.probe",
              "preflight.facts.overhead",
              "preflight.gate", "preflight.checks.registry", "preflight.facts.gather", "dflash.eval.results")
HEAVY = ("torch", "transformers", "triton")


@cache
def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path) -> set[str]:
    """Every module `name` imports anywhere in its file; `from a import b` counts as a.b when that is a module.

    A string that is exactly a project module's dotted name counts too (outside docstrings): a `python -m` target or an
    importlib name reaches that module as surely as an import statement does.
    """
    known = modules()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                and node.value in known and id(node) not in docstrings:
            out.add(node.value)
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known)
    return out


def process_targets(path: Path) -> set[str]:
    """Project modules the file starts as processes: a string right after "-m" in a list or tuple literal."""
    known = modules()
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.List, ast.Tuple)):
            items = node.elts
            for flag, target in zip(items, items[1:]):
                if (isinstance(flag, ast.Constant) and flag.value == "-m" and isinstance(target, ast.Constant)
                        and target.value in known):
                    out.add(target.value)
    return out


def package_of(module: str) -> str:
    """The floor a module lives on: its LAYERS entry (the longest prefix that names one)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    raise AssertionError(f"{module}: on no floor; add its package to LAYERS")


@cache
def graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports (lazy imports included, packages' __init__ left out)."""
    known = modules()
    return {name: {m for m in imported(name, path) if m in known and m != name and m not in PACKAGES
                   and not known[m].name == "__init__.py"}
            for name, path in known.items()}


def test_the_walk_sees_lazy_and_package_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('"""dflash.data.plan"""\ndef f():\n    from preflight import gate, profiles\n    import dflash.commands.train\n'
                   '    return ["python", "-m", "dflash.commands.torchrun"]\n')
    found = imported("dflash.m", src)
    assert {"preflight.gate", "preflight.profiles", "dflash.commands.train", "dflash.commands.torchrun"} <= found
    assert "dflash.data.plan" not in found  # a docstring names, it does not import


def test_a_module_started_as_a_process_is_not_an_import_of_its_torch(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('import subprocess, sys\ndef f():\n    subprocess.run([sys.executable, "-m", "preflight.probe_gpu"])\n'
                   '    return "dflash.data.plan"\n')
    assert {"preflight.probe_gpu", "dflash.data.plan"} <= imported("preflight.m", src)  # floors and circles see both
    assert process_targets(src) == {"preflight.probe_gpu"}  # the torch walk follows only the in-process one
    assert "preflight.probe_gpu" in process_targets(modules()["preflight.probe"])


def test_only_the_command_modules_import_preflight():
    bad = {name: sorted(m for m in imported(name, path) if m.split(".")[0] == "preflight")
           for name, path in modules().items() if name.split(".")[0] == "dflash" and not name.startswith(COMMANDS)}
    assert {k: v for k, v in bad.items() if v} == {}, "only dflash/commands/ may import preflight"


def test_every_import_goes_down_a_floor_or_stays_in_its_package():
    bad = []
    for name, targets in graph().items():
        mine = package_of(name)
        for t in targets:
            theirs = package_of(t)
            if theirs != mine and LAYERS[theirs] >= LAYERS[mine]:
                bad.append(f"{name} -> {t} ({mine} floor {LAYERS[mine]} -> {theirs} floor {LAYERS[theirs]})")
    assert bad == [], "imports that go up or sideways:\n" + "\n".join(sorted(bad))


def test_no_import_circle_between_modules():
    g = graph()
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert circles == [], f"import circles: {circles}"


def reach(module: str) -> set[str]:
    """The project modules loaded in the process that imports `module` (not those it starts as processes)."""
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            started = process_targets(modules()[m]) - {i for i in imported(m, modules()[m]) if _imported_in_code(m, i)}
            todo.extend(graph()[m] - started)
    return seen


def _imported_in_code(module: str, target: str) -> bool:
    """`module` imports `target` with an import statement (not only names it as a string)."""
    tree = ast.parse(modules()[module].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == target for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module == target or any(
                f"{node.module}.{a.name}" == target for a in node.names)):
            return True
    return False


@pytest.mark.parametrize("module", TORCH_FREE)
def test_torch_free_modules_reach_no_torch_even_lazily(module):
    bad = sorted(f"{m} imports {h}" for m in reach(module) for h in HEAVY
                 if any(i == h or i.startswith(h + ".") for i in imported(m, modules()[m])))
    assert bad == [], f"{module} reaches torch-class imports: {bad}"


@pytest.mark.parametrize("module", ("dflash.runs.rundir", "dflash.data.plan", "dflash.memory.fit", "preflight.gate"))
def test_contract_modules_load_without_torch(module):
    code = f"import sys, {module}; bad = [m for m in {HEAVY!r} if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"{module} imports {out.stdout.strip()}"
