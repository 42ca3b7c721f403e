"""The committed, host-free profile locks (requirements format with hashes): parse, judge, export.

`judge_lock` and `check_all` decide what is wrong with a lock; `write_locks` regenerates them
with uv. The `dflash-lock` command (``dflash.commands.lock``) only formats what these return, and
preflight's `profile` check calls `judge_lock` directly.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import InvalidMarker, Marker, default_environment
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from dflash.errors import DflashError
from preflight.profiles import ENVS_DIR, REPO_ROOT, Profile, ProfileError, load_profile, profile_names

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;\\]+)")
_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://")

# Packages whose drift breaks the GPU stack (fail, not warn). fla-core (the `fla` package, also installed by
# flash-linear-attention) and causal-conv1d: transformers binds a hybrid target's Gated DeltaNet to them at import;
# torchao: target.precision = "fp8" runs the target's linears through its float8 kernels.
GPU_STACK_PREFIXES = ("nvidia-", "cuda-")
GPU_STACK_NAMES = {"torch", "triton", "flash-attn", "flashinfer-python", "flashinfer", "sglang", "xformers",
                   "sglang-kernel", "flash-attn-4", "torchvision", "torchaudio", "fla-core", "flash-linear-attention",
                   "causal-conv1d", "torchao"}


def is_gpu_stack(name: str) -> bool:
    n = canonicalize_name(name)
    return n in GPU_STACK_NAMES or n.startswith(GPU_STACK_PREFIXES) or n.startswith("flashinfer")


def same_version(locked: str, installed: str) -> bool:
    """Whether an installed version is the locked one: `torch==2.10.0` accepts 2.10.0+cu128, as pip does."""
    try:
        lv, iv = Version(locked), Version(installed)
    except InvalidVersion:
        return locked == installed
    if lv.local is None:
        return lv.public == iv.public
    return lv == iv


@dataclass
class Pin:
    name: str  # canonical
    version: str
    line: int
    hashes: list[str] = field(default_factory=list)
    marker: str = ""

    def applies(self, env: dict) -> bool:
        if not self.marker:
            return True
        try:
            return Marker(self.marker).evaluate(env)
        except InvalidMarker:
            return True


# Interpreters a lock must be unambiguous for: a pin is "twice" when two lines for one
# package both apply to one of these (uv forks by Python version with disjoint markers).
_CHECK_PYTHONS = ("3.11.9", "3.12.8", "3.13.1")


def _check_envs() -> list[dict]:
    envs = []
    for full in _CHECK_PYTHONS:
        env = dict(default_environment())
        env.update(python_full_version=full, python_version=".".join(full.split(".")[:2]),
                   sys_platform="linux", platform_machine="x86_64", platform_system="Linux",
                   implementation_name="cpython", platform_python_implementation="CPython")
        envs.append(env)
    return envs


@dataclass
class LockFile:
    pins: dict[str, Pin]  # the pin that applies to this interpreter
    all_pins: list[Pin]
    duplicates: list[tuple[str, int, int]]  # (name, first line, second line)
    urls: list[tuple[int, str]]  # (line number, text)
    unhashed: list[str]
    unparsed: list[tuple[int, str]]

    def version(self, name: str) -> str | None:
        """Locked version for this interpreter."""
        pin = self.pins.get(canonicalize_name(name))
        return pin.version if pin else None


def _logical_lines(text: str):
    """Yield (first line number, joined logical line) for requirement lines (continuations joined)."""
    buf, start = "", 0
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf:
            start = no
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        yield start, buf
        buf = ""
    if buf:
        yield start, buf


def parse_lock(text: str) -> LockFile:
    all_pins: list[Pin] = []
    urls, unhashed, unparsed = [], [], []
    for no, raw in enumerate(text.splitlines(), 1):
        if _URL.search(raw):
            urls.append((no, raw.strip()))
    for no, line in _logical_lines(text):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        body = stripped.split(" #", 1)[0].strip()
        if body.startswith("-"):
            if not _URL.search(body):
                unparsed.append((no, body))
            continue
        m = _PIN.match(body)
        if not m:
            unparsed.append((no, body))
            continue
        name, version = canonicalize_name(m.group(1)), m.group(3)
        hashes = re.findall(r"--hash=(\S+)", body)
        marker = body.split(";", 1)[1].split("--hash")[0].strip() if ";" in body.split("--hash")[0] else ""
        if not hashes:
            unhashed.append(name)
        all_pins.append(Pin(name, version, no, hashes, marker))
    here = default_environment()
    pins: dict[str, Pin] = {}
    for pin in all_pins:
        if pin.name not in pins or (pin.applies(here) and not pins[pin.name].applies(here)):
            pins[pin.name] = pin
    return LockFile(pins, all_pins, _duplicates(all_pins), urls, unhashed, unparsed)


def _duplicates(all_pins: list[Pin]) -> list[tuple[str, int, int]]:
    by_name: dict[str, list[Pin]] = {}
    for pin in all_pins:
        by_name.setdefault(pin.name, []).append(pin)
    dups = []
    envs = _check_envs()
    for name, pins in by_name.items():
        for i, a in enumerate(pins):
            for b in pins[i + 1:]:
                if any(a.applies(e) and b.applies(e) for e in envs):
                    dups.append((name, a.line, b.line))
    return dups


# NVIDIA CUDA-toolkit library wheels published without a -cuXX suffix for CUDA 13 and later;
# their version's major is the CUDA major they belong to.
UNSUFFIXED_TOOLKIT = {
    "nvidia-cuda-runtime", "nvidia-cublas", "nvidia-cuda-nvrtc", "nvidia-cuda-cupti", "nvidia-nvjitlink",
    "nvidia-nvtx", "nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-cccl",
}
_SUFFIX = re.compile(r"-cu(\d+)$")


def wheel_cuda_major(name: str, version: str) -> int | None:
    """The CUDA major a nvidia-*/cuda-* wheel belongs to, or None when it is not tied to one."""
    name = canonicalize_name(name)
    m = _SUFFIX.search(name)
    if m and name.startswith(("nvidia-", "cuda-")):
        return int(m.group(1))
    if name in UNSUFFIXED_TOOLKIT:
        return int(version.split(".")[0])
    return None


def cuda_wheel_problems(lock: LockFile, cuda: str, allowed: tuple[str, ...] | list[str] = ()) -> list[str]:
    """CUDA wheels in a lock that disagree with the profile's CUDA major.minor."""
    major, minor = (int(x) for x in cuda.split("."))
    allowed = {canonicalize_name(a) for a in allowed}
    problems = []
    for name, pin in sorted(lock.pins.items()):
        wheel_major = wheel_cuda_major(name, pin.version)
        if wheel_major is not None and wheel_major != major and name not in allowed:
            problems.append(f"{name}=={pin.version} is a CUDA {wheel_major} wheel; profile is CUDA {cuda}")
    runtime = lock.pins.get("nvidia-cuda-runtime") or lock.pins.get(f"nvidia-cuda-runtime-cu{major}")
    if runtime is None:
        problems.append(f"no CUDA {major} runtime wheel (nvidia-cuda-runtime) locked; profile is CUDA {cuda}")
    else:
        got = tuple(int(x) for x in runtime.version.split(".")[:2])
        if got != (major, minor):
            problems.append(
                f"{runtime.name}=={runtime.version} is a CUDA {got[0]}.{got[1]} runtime; profile is CUDA {cuda}"
            )
    return problems


# ---------------------------------------------------------------- judging a lock


@dataclass
class Problem:
    profile: str
    kind: str  # stale | url | cuda | torch | duplicate | missing | unhashed | unparsed | export
    message: str


def judge_lock(profile: Profile, text: str, fresh: str | None) -> list[Problem]:
    """Every problem of one committed lock; `fresh` is the export it must equal (None = skip that)."""
    name, lock = profile.name, parse_lock(text)
    out: list[Problem] = []
    for no, line in lock.urls:
        out.append(Problem(name, "url", f"line {no} holds a URL ({line[:60]}); locks must name no host"))
    for pkg, first, second in lock.duplicates:
        out.append(Problem(name, "duplicate", f"{pkg} is pinned twice (lines {first} and {second})"))
    for pkg in lock.unhashed:
        out.append(Problem(name, "unhashed", f"{pkg} has no --hash"))
    for no, line in lock.unparsed:
        out.append(Problem(name, "unparsed", f"line {no} is not `name==version --hash=...`: {line[:60]}"))
    torch = lock.version("torch")
    if torch is None:
        out.append(Problem(name, "torch", f"no torch pin; manifest says torch {profile.torch}"))
    elif torch.split("+")[0] != profile.torch:
        out.append(Problem(name, "torch", f"torch=={torch} locked; manifest says {profile.torch}"))
    for msg in cuda_wheel_problems(lock, profile.cuda, profile.foreign_cuda_allowed):
        out.append(Problem(name, "cuda", msg))
    if fresh is not None and fresh != text:
        out.append(Problem(name, "stale", f"envs/{name}.lock differs from a fresh export ({_first_diff(text, fresh)});"
                           " run `uv run dflash-lock write` and review the diff"))
    return out


def _first_diff(a: str, b: str) -> str:
    la, lb = a.splitlines(), b.splitlines()
    for i, (x, y) in enumerate(zip(la, lb), 1):
        if x != y:
            return f"first at line {i}: {x.strip()[:50]!r} vs {y.strip()[:50]!r}"
    return f"{len(la)} vs {len(lb)} lines"


STACK_ORDER = ("torch", "triton", "nvidia-cuda-runtime", "nvidia-cuda-runtime-cu12", "nvidia-cudnn-cu12",
               "nvidia-cudnn-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu13")


def diff_locks(a: LockFile, b: LockFile) -> list[tuple[str, str | None, str | None]]:
    """(package, version in a, version in b) for every difference; GPU stack first, torch first of all."""
    names = sorted(set(a.pins) | set(b.pins))
    rows = [(n, a.version(n), b.version(n)) for n in names if a.version(n) != b.version(n)]

    def key(row):
        n = row[0]
        if n in STACK_ORDER:
            return (0, STACK_ORDER.index(n), n)
        return (1 if is_gpu_stack(n) else 2, 0, n)

    return sorted(rows, key=key)


# ---------------------------------------------------------------- exporting with uv

HEADER = "# Profile {name}: hash-pinned export of groups {groups}. Generated by `dflash-lock write`; do not edit.\n"


class LockToolError(DflashError):
    """uv missing or failing; the message is one line."""


def _uv() -> str:
    uv = os.environ.get("UV") or shutil.which("uv")
    if not uv:
        raise LockToolError("uv not found on PATH; install it with `pip install uv`")
    return uv


def _run_uv(args: list[str], root: Path) -> str:
    try:
        proc = subprocess.run([_uv(), *args], cwd=root, capture_output=True, text=True)
    except OSError as e:
        raise LockToolError(f"cannot run uv ({e.strerror}: {e.filename}); install it with `pip install uv`") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise LockToolError(f"`uv {' '.join(args)}` failed: {last}")
    return proc.stdout


def export_profile(profile: Profile, root: Path = REPO_ROOT, frozen: bool = False) -> str:
    """The lock text a profile should have, from uv.lock (which must match pyproject.toml)."""
    args = ["export", "--frozen" if frozen else "--locked", "--no-default-groups", "--no-emit-project",
            "--no-header", "--format", "requirements.txt"]
    for g in profile.groups:
        args += ["--group", g]
    body = _run_uv(args, root)
    return HEADER.format(name=profile.name, groups=", ".join(profile.groups)) + body


def check_all(envs_dir: Path = ENVS_DIR, root: Path = REPO_ROOT, fresh: bool = True) -> list[Problem]:
    """Every problem of every committed lock; `fresh` also compares each with a new export (needs uv)."""
    problems: list[Problem] = []
    names = profile_names(envs_dir)
    if not names:
        return [Problem("-", "missing", f"no profile manifests (*.toml) in {envs_dir.name}/")]
    for name in names:
        try:
            profile = load_profile(name, envs_dir)
        except ProfileError as e:
            problems.append(Problem(name, "missing", str(e)))
            continue
        path = envs_dir / f"{name}.lock"
        if not path.exists():
            problems.append(Problem(name, "missing", f"envs/{name}.lock missing; run `uv run dflash-lock write`"))
            continue
        expected = None
        if fresh:
            try:
                expected = export_profile(profile, root)
            except LockToolError as e:
                problems.append(Problem(name, "export", f"{e}; run `uv run dflash-lock write`"))
        problems += judge_lock(profile, path.read_text(encoding="utf-8", errors="replace"), expected)
    return problems


def write_locks(envs_dir: Path = ENVS_DIR, root: Path = REPO_ROOT) -> list[tuple[str, LockFile]]:
    """Re-resolve (uv lock, honoring exclude-newer) and re-export every envs/<profile>.lock atomically.

    Returns (profile name, parsed new lock) per profile. Raises LockToolError or ProfileError.
    """
    _run_uv(["lock"], root)
    written = []
    for name in profile_names(envs_dir):
        text = export_profile(load_profile(name, envs_dir), root, frozen=True)
        path = envs_dir / f"{name}.lock"
        tmp = path.with_suffix(".lock.tmp")
        tmp.write_text(text)
        tmp.replace(path)
        written.append((name, parse_lock(text)))
    return written
