"""Parse and judge the committed, host-free profile locks (requirements format with hashes)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from packaging.markers import InvalidMarker, Marker, default_environment
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
