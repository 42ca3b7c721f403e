"""The search paths a run inherits: PATH (other Python environments, CUDA toolkits on it), LD_LIBRARY_PATH and
the dynamic linker's cache (which CUDA major each CUDA library there is for)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from preflight.pyenv import python_env_root

CUDA_LIBS = ("libcudart", "libcublas", "libnccl")  # LD_LIBRARY_PATH libraries tied to a CUDA major


@dataclass
class PathEntry:
    path: str
    exists: bool
    python_env: str | None = None  # root of the venv/conda env whose bin dir this is
    is_self: bool = False  # this interpreter's environment
    commands: list[str] = field(default_factory=list)  # another env's executables no earlier PATH entry has: run from here
    cuda_toolkit: str | None = None  # CUDA version of the toolkit whose bin dir this is (holds nvcc); "?" when unknown


@dataclass
class LibDir:
    path: str
    exists: bool
    libs: dict[str, int | None] = field(default_factory=dict)  # file name -> CUDA major (None = unknown)


def _executables(d: Path) -> set[str]:
    try:
        with os.scandir(d) as it:
            return {e.name for e in it if e.is_file() and os.access(e.path, os.X_OK)}
    except OSError:
        return set()


_TOOLKIT_VERSION = re.compile(r"(?:CUDA Version|release) (\d+\.\d+(?:\.\d+)?)")


def toolkit_cuda(bin_dir: Path) -> str:
    """The CUDA version of the nvcc in a PATH dir: the toolkit's version.json / version.txt beside the (resolved)
    nvcc, else what `nvcc --version` says (wrapper scripts), else the folder's name; "?" when nothing says."""
    nvcc = (bin_dir / "nvcc").resolve()
    root = nvcc.parent.parent
    try:
        return str(json.loads((root / "version.json").read_text())["cuda"]["version"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    for text in (lambda: (root / "version.txt").read_text(),
                 lambda: subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=10).stdout):
        try:
            m = _TOOLKIT_VERSION.search(text())
        except (OSError, subprocess.SubprocessError):
            continue
        if m:
            return m.group(1)
    hint = re.search(r"cuda[-_]?(\d+\.\d+)", str(root), re.I)
    return hint.group(1) if hint else "?"


def path_entries(path_value: str, prefix: str) -> list[PathEntry]:
    """PATH in order. For another Python environment's bin dir, the executables that run from it (no earlier entry
    has them); for a CUDA toolkit's bin dir (nvcc), its version."""
    me = os.path.realpath(prefix)
    out = []
    earlier: set[str] = set()
    for raw in path_value.split(os.pathsep):
        if not raw:
            continue
        p = Path(raw)
        is_dir = p.is_dir()
        root = python_env_root(p) if is_dir else None
        entry = PathEntry(raw, is_dir, root, bool(root) and os.path.realpath(root) == me)
        names = _executables(p) if is_dir else set()
        if root and not entry.is_self:
            entry.commands = sorted(names - earlier)
        if "nvcc" in names:
            entry.cuda_toolkit = toolkit_cuda(p)
        earlier |= names
        out.append(entry)
    return out


_SONAME = re.compile(r"^(libcudart|libcublas|libnccl)\.so(?:\.(\d+))?")


_PATH_CUDA = re.compile(r"(?:cuda[-_]?|cu)(\d{2})(?:\.\d+)?(?![\d])", re.I)


def _lib_majors(path: str, names) -> dict[str, int | None]:
    """libcudart/libcublas/libnccl file name -> CUDA major; libnccl (and unversioned names) take the dir's major."""
    libs: dict[str, int | None] = {}
    for name in names:
        m = _SONAME.match(name)
        if not m:
            continue
        lib, major = m.group(1), m.group(2)
        if lib == "libnccl" or major is None:  # libnccl.so.2 is NCCL's own major: take the dir's CUDA
            libs[name] = None
        else:
            libs[name] = int(major)
    if libs:
        known = {v for v in libs.values() if v is not None}
        hint = _PATH_CUDA.search(path)
        fallback = known.pop() if len(known) == 1 else (int(hint.group(1)) if hint else None)
        libs = {k: (v if v is not None else fallback) for k, v in libs.items()}
    return libs


def scan_lib_dir(path: str) -> LibDir:
    p = Path(path)
    if not p.is_dir():
        return LibDir(path, False)
    try:
        names = sorted(os.listdir(p))
    except OSError:
        return LibDir(path, True)
    return LibDir(path, True, _lib_majors(path, names))


_LDCONFIG_LINE = re.compile(r"^\s*(\S+) \(([^)]*)\) => (\S+)\s*$")


def parse_ldconfig(text: str) -> list[LibDir]:
    """CUDA libraries in the dynamic linker's cache (`ldconfig -p`), grouped by folder; 64-bit entries only."""
    by_dir: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = _LDCONFIG_LINE.match(line)
        if m and _SONAME.match(m.group(1)) and "64" in m.group(2):
            by_dir.setdefault(os.path.dirname(m.group(3)), []).append(m.group(1))
    return [LibDir(d, True, _lib_majors(d, sorted(names))) for d, names in sorted(by_dir.items())]


def ld_cache() -> list[LibDir] | None:
    """The CUDA libraries `ldconfig -p` lists, or None when there is no ldconfig to ask."""
    exe = shutil.which("ldconfig") or next((p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None)
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-p"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_ldconfig(out.stdout) if out.returncode == 0 else None
