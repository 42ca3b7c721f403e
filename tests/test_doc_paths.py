"""Every module path a docstring, comment, doc or bench script names must exist: a moved module leaves no stale pointer behind.

Two kinds of names are read: dotted ones (`dflash.data.plan.schedule_change`, imported and then looked up attribute by
attribute) and file paths (`dflash/models/hf_drafter.py`, which must be a file of the repository). Dotted names are
read from docstrings and comments only (tokenize), so code such as a local variable named `dflash` is not a name.
"""
from __future__ import annotations

import importlib
import io
import re
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOTTED = re.compile(r"(?<![\w.])((?:dflash|preflight)(?:\.[a-z_][a-z_0-9]*)+)")
FILE = re.compile(r"(?<![\w/.-])((?:dflash|preflight|bench|tests|configs|envs|docs|\.ci)/[\w/.-]*\w\.(?:py|toml|md|sh|json))")
PLACEHOLDER = re.compile(r"/[A-Z]+\.")  # configs/RUN.toml, envs/NAME.toml: a name the reader fills in
FILE_NAME = re.compile(r"\.(?:py|json|jsonl|md|toml|html)$")  # preflight.json, dflash.py: a file, not a module


def _sources() -> list[Path]:
    py = [p for d in ("dflash", "preflight", "bench") for p in sorted((ROOT / d).rglob("*.py"))]
    docs = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "bench").glob("*.sh")), ROOT / ".ci" / "run"]
    return py + [p for p in docs if p.is_file()]


def _prose(path: Path) -> str:
    """Docstrings and comments of a Python file; all of a Markdown file or a script."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return text
    kept = [tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline)
            if tok.type in (tokenize.COMMENT, tokenize.STRING)]
    return "\n".join(kept)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _names(pattern: re.Pattern) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in _sources():
        for match in pattern.finditer(_prose(path)):
            found.setdefault(match.group(1).rstrip("."), []).append(str(path.relative_to(ROOT)))
    return found


def test_every_dotted_module_path_in_docstrings_and_docs_imports():
    stale = {name: where for name, where in _names(DOTTED).items() if not FILE_NAME.search(name) and not _resolves(name)}
    assert not stale, "names that no longer import (rename them to where the code now lives): " + "; ".join(
        f"{name} in {', '.join(sorted(set(where)))}" for name, where in sorted(stale.items()))


def test_every_file_path_in_docstrings_and_docs_exists():
    stale = {name: where for name, where in _names(FILE).items()
             if not (ROOT / name).exists() and not PLACEHOLDER.search(name)}
    assert not stale, "paths that no longer exist: " + "; ".join(
        f"{name} in {', '.join(sorted(set(where)))}" for name, where in sorted(stale.items()))


MD_NAME = re.compile(r"(?<![\w/.:-])((?:\.\./|[\w-]+/)*[\w.-]*\w\.md)\b")


def test_every_document_a_file_names_is_shipped():
    """A page, comment or log that names a Markdown document names one the repository has (issue #52: a design
    document cited 18 times was never shipped). A name resolves beside the file that names it, or from the root."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    missing: dict[str, set[str]] = {}
    for rel in filter(None, files.split("\0")):
        path = ROOT / rel
        if not path.is_file() or path.suffix in (".png", ".arrow", ".lock") or path.stat().st_size > 2_000_000:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for name in MD_NAME.findall(text):
            if not ((path.parent / name).is_file() or (ROOT / name).is_file()):
                missing.setdefault(name, set()).add(rel)
    assert not missing, "documents named but not in the repository: " + "; ".join(
        f"{name} in {', '.join(sorted(where))}" for name, where in sorted(missing.items()))
