"""The import rules that keep the layers apart, checked on the source (every import, lazy ones included).

- The trainer (dflash/) reaches preflight only through its public gate, ``preflight.gate``.
- Library modules never import a command module: commands format what libraries decide.
- The on-disk contracts and the run config load without torch, so preflight stays light.
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
CLI_MODULES = {"dflash.cli", "preflight.cli", "preflight.estimate_cli", "preflight.lock_cli", "preflight.env_cli",
               "preflight.diff_cli"}
GATE = "preflight.gate"
TORCH_FREE = ("dflash.rundir", "dflash.compile_manifest", "dflash.config", "dflash.errors", "dflash.data", "dflash.snapshot",
              "preflight.diff")


@cache
def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path) -> set[str]:
    """Every module `name` imports anywhere in its file; `from a import b` counts as a.b when that is a module."""
    known = modules()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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


def test_the_walk_sees_lazy_and_package_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from preflight import gate, profiles\n    import dflash.cli\n")
    assert {"preflight.gate", "preflight.profiles", "dflash.cli"} <= imported("dflash.m", src)


def test_the_trainer_uses_only_the_public_gate_of_preflight():
    bad = {name: sorted(m for m in imported(name, path) if m.split(".")[0] == "preflight" and m not in
                        ("preflight", GATE))
           for name, path in modules().items() if name.split(".")[0] == "dflash"}
    bad = {k: v for k, v in bad.items() if v}
    assert bad == {}, f"dflash modules importing preflight internals (use {GATE}): {bad}"


def test_no_library_module_imports_a_command_module():
    bad = {name: sorted(imported(name, path) & CLI_MODULES)
           for name, path in modules().items() if name not in CLI_MODULES}
    bad = {k: v for k, v in bad.items() if v}
    assert bad == {}, f"library modules importing command modules: {bad}"


@pytest.mark.parametrize("module", TORCH_FREE)
def test_contract_modules_load_without_torch(module):
    code = f"import sys, {module}; bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"{module} imports {out.stdout.strip()}"
