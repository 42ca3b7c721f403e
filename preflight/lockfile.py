"""Parse and judge the committed, host-free profile locks (requirements format with hashes)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from packaging.utils import canonicalize_name

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;\\]+)")
_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://")

# Packages whose drift breaks the GPU stack (fail, not warn).
GPU_STACK_PREFIXES = ("nvidia-", "cuda-")
GPU_STACK_NAMES = {"torch", "triton", "flash-attn", "flashinfer-python", "flashinfer", "sglang", "xformers",
                   "sglang-kernel", "flash-attn-4", "torchvision", "torchaudio"}


def is_gpu_stack(name: str) -> bool:
    n = canonicalize_name(name)
    return n in GPU_STACK_NAMES or n.startswith(GPU_STACK_PREFIXES) or n.startswith("flashinfer")


@dataclass
class Pin:
    name: str  # canonical
    version: str
    line: int
    hashes: list[str] = field(default_factory=list)


@dataclass
class LockFile:
    pins: dict[str, Pin]
    duplicates: list[tuple[str, int, int]]  # (name, first line, second line)
    urls: list[tuple[int, str]]  # (line number, text)
    unhashed: list[str]
    unparsed: list[tuple[int, str]]

    def version(self, name: str) -> str | None:
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
    pins: dict[str, Pin] = {}
    dups, urls, unhashed, unparsed = [], [], [], []
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
        if not hashes:
            unhashed.append(name)
        if name in pins:
            dups.append((name, pins[name].line, no))
            continue
        pins[name] = Pin(name, version, no, hashes)
    return LockFile(pins, dups, urls, unhashed, unparsed)


def cuda_wheel_problems(lock: LockFile, cuda: str) -> list[str]:
    """CUDA runtime wheels that disagree with the profile's CUDA major.minor."""
    major, minor = (int(x) for x in cuda.split("."))
    problems = []
    runtime = None
    for name, pin in sorted(lock.pins.items()):
        if not name.startswith(("nvidia-", "cuda-")):
            continue
        m = re.search(r"-cu(\d+)$", name)
        if m and int(m.group(1)) != major:
            problems.append(f"{name}=={pin.version} is a CUDA {m.group(1)} wheel; profile is CUDA {cuda}")
        if name in ("nvidia-cuda-runtime", f"nvidia-cuda-runtime-cu{major}") or name.startswith("nvidia-cuda-runtime"):
            runtime = pin
    if runtime is None:
        problems.append(f"no nvidia-cuda-runtime wheel locked; profile is CUDA {cuda}")
    else:
        parts = runtime.version.split(".")
        if (int(parts[0]), int(parts[1])) != (major, minor):
            problems.append(
                f"{runtime.name}=={runtime.version} is CUDA {parts[0]}.{parts[1]}; profile is CUDA {cuda}"
            )
    return problems
