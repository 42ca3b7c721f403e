"""What a Python environment holds, read from its files (no import of what it holds): the distributions on a set of
paths and the environment a bin dir belongs to. Shared by the facts preflight gathers and by dflash-env."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from packaging.utils import canonicalize_name


def _header(path: Path) -> tuple[str | None, str | None]:
    """Name and Version from a METADATA/PKG-INFO header (stops at the first blank line: no email parser)."""
    name = version = None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break
                if line.startswith("Name:"):
                    name = line[5:].strip()
                elif line.startswith("Version:"):
                    version = line[8:].strip()
    except OSError:
        pass
    return name, version


def installed_distributions(paths: list[str] | None = None) -> dict[str, list[str]]:
    """Canonical name -> versions of every distribution on sys.path (two versions = installed twice)."""
    out: dict[str, list[str]] = {}
    seen: set[str] = set()
    for entry in sys.path if paths is None else paths:
        real = os.path.realpath(entry or ".")
        if real in seen or not os.path.isdir(real):
            continue
        seen.add(real)
        try:
            names = os.listdir(real)
        except OSError:
            continue
        for d in names:
            if d.endswith(".dist-info"):
                meta = Path(real, d, "METADATA")
            elif d.endswith(".egg-info"):
                meta = Path(real, d, "PKG-INFO") if os.path.isdir(os.path.join(real, d)) else Path(real, d)
            else:
                continue
            name, version = _header(meta)
            if name and version:
                out.setdefault(canonicalize_name(name), []).append(version)
    return out


def python_env_root(bin_dir: Path) -> str | None:
    """The Python environment (venv or conda) whose bin dir this is, or None."""
    root = bin_dir.parent
    if bin_dir.name in ("bin", "Scripts") and ((root / "pyvenv.cfg").is_file() or (root / "conda-meta").is_dir()):
        return str(root)
    return None
