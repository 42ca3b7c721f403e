"""Gather the facts preflight judges: distributions, torch build, env, PATH, libraries, git, disk, GPUs.

Gathering (I/O) is kept apart from judging (``preflight.checks``): ``gather`` fills one
``Context`` dataclass, and every check is a pure function of it, so tests build a Context
by hand and assert verdicts. Nothing here imports torch or creates a CUDA context: the torch
version is read from the file ``torch/version.py`` of the installed distribution, GPUs through
NVML (``preflight.nvml``).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import cached_property
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.utils import canonicalize_name

from dflash.config import ConfigError, RunConfig
from dflash.memory.shape import TargetShape, load_target_shape
from dflash.runs import rundir
from dflash.runs.compile_manifest import ManifestError, read_manifest
from preflight.envs import locate
from preflight.lockfile import LockFile, parse_lock
from preflight.nvml import GpuInfo, NvmlSnapshot, NvmlUnavailable
from preflight.profiles import ENVS_DIR, REPO_ROOT, Profile, ProfileError, load_profile, lock_path
from preflight.pyenv import installed_distributions, python_env_root

if TYPE_CHECKING:
    from dflash.data.identity import ValueStats

# The code a training run executes: a debugging hack left in any module of the package changes what a run trains.
MODEL_SOURCE_PACKAGE = "dflash"
MODEL_SOURCE_PATHSPEC = f"{MODEL_SOURCE_PACKAGE}/*.py"  # git pathspec: every .py file under dflash/
PROJECT_DIST = "dflash"  # the project itself: never drift
# Installed distributions whose files are checked against their RECORD hashes: besides the GPU stack
# (lockfile.is_gpu_stack: torch, triton, nvidia-*, ...), the packages whose code runs the target and drafter.
RECORD_VERIFIED = ("transformers", "tokenizers", "safetensors")
# Native libraries are compared with RECORD by size only: hashing them reads gigabytes (the CUDA wheels) at
# every launch, while an edit, the incident's class of change, lands in Python sources, which are hashed.
NATIVE_FILE = re.compile(r"\.(?:so(?:\.\d+)*|a|o|bc|cubin|fatbin)$")
CUDA_LIBS = ("libcudart", "libcublas", "libnccl")  # LD_LIBRARY_PATH libraries tied to a CUDA major


@dataclass
class TorchBuild:
    version: str  # with local label, e.g. "2.10.0+cu128"
    cuda: str | None  # CUDA the build targets, None for a CPU build
    source: str  # the file it was read from


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


@dataclass
class EnvIdentity:
    prefix: str  # this interpreter's environment (sys.prefix): the one the environment checks judge
    profile_env: str  # where the profile's environment lives (`dflash-env path`)
    default: bool  # that is uv's project environment (.venv), the one `uv run` builds and uses

    @property
    def matches(self) -> bool:
        return os.path.realpath(self.prefix) == os.path.realpath(self.profile_env)


@dataclass
class GpuFacts:
    snapshot: NvmlSnapshot | None = None
    error: str | None = None  # why NVML gave nothing
    cuda_visible_devices: str | None = None
    queried: bool = True  # False when the run is on CPU and NVML was not asked


@dataclass
class RecordCheck:
    """One installed distribution's files against the sha256 hashes and sizes its RECORD lists."""

    name: str
    version: str
    hashed: int = 0  # files whose hash was compared
    sized: int = 0  # native libraries compared by size
    modified: list[str] = field(default_factory=list)  # content differs from RECORD
    missing: list[str] = field(default_factory=list)  # listed in RECORD, gone from disk
    error: str | None = None  # why nothing could be verified (no RECORD, no hashes in it)
    record_sha256: str | None = None  # of the RECORD file itself: one digest of the whole installed build


@dataclass
class Records:
    checks: list[RecordCheck] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the verification


@dataclass
class ModelSource:
    mode: str  # "git" | "record" | "none"
    commit: str | None = None  # git HEAD, or "dflash==<version>" for RECORD mode
    files: list[str] = field(default_factory=list)  # every source file of the package that was looked at
    modified: list[str] = field(default_factory=list)
    states: dict[str, str] = field(default_factory=dict)  # modified file -> "modified" | "untracked" | "deleted" | ...
    diff_stat: str = ""
    absent: list[str] = field(default_factory=list)  # not present (and not tracked): nothing to verify yet
    verified: list[str] = field(default_factory=list)
    error: str | None = None
    sha256: dict[str, str] = field(default_factory=dict)  # modified file -> sha256 of its content now ("" when gone)


@dataclass
class CompileCache:
    path: str
    exists: bool
    manifest: dict | None = None
    error: str | None = None  # manifest unreadable
    size_bytes: int | None = None
    env_override: str | None = None  # TORCHINDUCTOR_CACHE_DIR when it points elsewhere


@dataclass
class Checkpoint:
    step: int
    path: str
    meta: dict | None = None
    error: str | None = None  # why a resume would refuse it (dflash.runs.rundir.checkpoint_problem)
    size_bytes: int = 0


@dataclass
class RunDir:
    path: str
    exists: bool
    writable: bool
    problem: str | None = None  # why it is not usable (dflash.runs.rundir.write_problem)
    checkpoints: list[Checkpoint] = field(default_factory=list)  # finished saves, oldest first
    deep: bool = False  # sha256 compared too (--verify-data), not only sizes
    # how resuming the newest usable checkpoint changes the lr schedule (dflash.data.plan.schedule_change), or None
    schedule_change: str | None = None

    @property
    def newest(self) -> Checkpoint | None:
        return self.checkpoints[-1] if self.checkpoints else None


@dataclass
class Shard:
    name: str
    rows: int = 0
    tokens: int = 0
    max_len: int = 0
    max_row: int = -1
    first_row: int = 0  # global index of this shard's first sample
    over: list[tuple[int, int]] = field(default_factory=list)  # (row, length) of the longest samples over the limit
    over_count: int = 0
    mask_mismatch: tuple[int, int, int] | None = None  # (row, input_ids len, loss_mask len)
    size_bytes: int = 0
    error: str | None = None
    values: ValueStats | None = None  # token id / loss_mask ranges, learnable positions (None: not read)
    sha256: str | None = None  # of the file, read only with --verify-data
    lengths: Any = None  # every sample's token count (numpy int64), for the run snapshot's length percentiles


@dataclass
class Dataset:
    path: str
    limit: int  # longest sample that can fit a batch (tokens)
    shards: list[Shard] = field(default_factory=list)
    error: str | None = None  # the folder itself
    manifest: dict | None = None  # manifest.json beside the shards (dflash.data), None when absent
    manifest_error: str | None = None  # why it could not be read
    target: dict | None = None  # the run's target fingerprint (dflash.data.identity.target_fingerprint)
    target_error: str | None = None  # why it could not be taken
    deep: bool = False  # shard sha256 computed (--verify-data)

    @property
    def samples(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def fingerprint(self) -> str:
        """The trainer's identity of these shards (dflash.data.identity.dataset_fingerprint), as checkpoints record it."""
        from dflash.data.identity import dataset_fingerprint

        return dataset_fingerprint((s.name, s.size_bytes, s.rows) for s in self.shards)


@dataclass
class Disk:
    path: str
    free_bytes: int | None = None
    error: str | None = None
    output_dir: str = ""
    # what in the run dir could be deleted to free space: (name in it, bytes, what it is) (dflash.runs.rundir.leftovers)
    leftovers: list[tuple[str, int, str]] = field(default_factory=list)


@dataclass
class Context:
    """Everything the checks judge. Every field has a default so tests can state only what matters."""

    profile_name: str
    profile: Profile | None = None
    profile_error: str | None = None
    lock_file: str = ""
    lock_text: str | None = None  # None: the lock file is missing
    config: RunConfig | None = None
    config_path: str | None = None
    resume_intent: str | None = None  # "resume" | "fresh" | None
    distributions: dict[str, list[str]] = field(default_factory=dict)  # canonical name -> installed versions
    torch: TorchBuild | None = None
    env: dict[str, str] = field(default_factory=dict)
    path_entries: list[PathEntry] = field(default_factory=list)
    ld_dirs: list[LibDir] = field(default_factory=list)
    env_identity: EnvIdentity | None = None  # None: not gathered (tests), nothing judged about it
    records: Records | None = None  # RECORD verification of the GPU stack and target code; None: not gathered
    ld_cache: list[LibDir] | None = None  # CUDA libraries in `ldconfig -p`, by folder; None: not asked or no ldconfig
    gpus: GpuFacts = field(default_factory=lambda: GpuFacts(error="NVML not queried"))
    model_source: ModelSource = field(default_factory=lambda: ModelSource(mode="none"))
    compile_cache: CompileCache | None = None
    target_shape: TargetShape | None = None  # the target's sizes (dflash.memory.shape.load_target_shape), when readable
    target_error: str | None = None  # why they are not: the file, the problem and the fix
    run_dir: RunDir | None = None
    dataset: Dataset | None = None
    disk: Disk | None = None
    host: dict = field(default_factory=dict)
    own_gpus: dict[str, list[str]] | None = None  # a torchrun rank checks only its GPU: {cuda index: [role]}

    @cached_property
    def lock(self) -> LockFile | None:
        return parse_lock(self.lock_text) if self.lock_text is not None else None


# ---------------------------------------------------------------- environment






_VERSION_LINE = re.compile(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", re.M)
_CUDA_LINE = re.compile(r"^cuda(?:\s*:\s*[^=]+)?\s*=\s*(None|['\"]([^'\"]*)['\"])", re.M)


def parse_torch_version_py(text: str) -> tuple[str, str | None] | None:
    """(version, cuda) from torch/version.py's text, or None when it does not say."""
    v = _VERSION_LINE.search(text)
    if not v:
        return None
    c = _CUDA_LINE.search(text)
    return v.group(1), (c.group(2) if c and c.group(2) else None)


def torch_build() -> TorchBuild | None:
    """The installed torch build, read from its files without importing it."""
    try:
        dist = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        return None
    path = Path(dist.locate_file("torch/version.py"))
    try:
        parsed = parse_torch_version_py(path.read_text())
    except OSError:
        parsed = None
    if parsed is None:  # no version module: the metadata version has the local label, not the CUDA version
        local = dist.version.partition("+")[2]
        m = re.fullmatch(r"cu(\d+)(\d)", local)
        return TorchBuild(dist.version, f"{m.group(1)}.{m.group(2)}" if m else None, "metadata")
    return TorchBuild(parsed[0], parsed[1], str(path))


def record_verified(name: str) -> bool:
    """Whether env-drift checks this distribution's files against its RECORD (GPU stack and target code)."""
    from preflight.lockfile import is_gpu_stack

    return is_gpu_stack(name) or canonicalize_name(name) in RECORD_VERIFIED


@dataclass
class _RecordEntry:
    path: str  # absolute
    rel: str  # as RECORD lists it
    algo: str
    digest: str  # urlsafe base64, no padding
    size: int | None
    native: bool


def _record_entries(name: str) -> tuple[RecordCheck, list[_RecordEntry]]:
    """The RECORD entries of installed distribution `name` to verify (csv read directly: torch lists ~12K files)."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return RecordCheck(name, "?", error="not installed"), []
    check = RecordCheck(name, dist.version)
    text = dist.read_text("RECORD")
    if text is None:
        check.error = "no RECORD: installed by a tool that keeps none, nothing to verify against"
        return check, []
    check.record_sha256 = hashlib.sha256(text.encode()).hexdigest()
    base = str(dist.locate_file(""))
    out = []
    for row in csv.reader(text.splitlines()):
        if len(row) < 2 or "=" not in row[1] or row[0].endswith(".pyc"):  # RECORD lists itself without a hash
            continue
        algo, _, digest = row[1].partition("=")
        size = int(row[2]) if len(row) > 2 and row[2].isdigit() else None
        out.append(_RecordEntry(os.path.normpath(os.path.join(base, row[0])), row[0], algo, digest, size,
                                bool(NATIVE_FILE.search(row[0]))))
    if not out:
        check.error = "RECORD lists no hashes"
    return check, out


def _verify_entry(e: _RecordEntry) -> str | None:
    """None when the file matches its RECORD entry, else "modified" or "missing"."""
    try:
        if e.native:
            return None if e.size is None or os.stat(e.path).st_size == e.size else "modified"
        with open(e.path, "rb") as f:
            digest = hashlib.file_digest(f, e.algo).digest()
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError):
        return "modified"  # unreadable, or a hash algorithm this Python lacks
    return None if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == e.digest else "modified"


def verify_records(names: list[str], workers: int | None = None) -> Records:
    """Check the installed files of distributions `names` against their RECORD: sha256 for every file but
    .pyc caches and native libraries (those by size), read in parallel batches (hashlib releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    checks, jobs = [], []
    for name in sorted(names):
        check, entries = _record_entries(name)
        checks.append(check)
        jobs += [(check, e) for e in entries]
    batches = [jobs[i:i + 512] for i in range(0, len(jobs), 512)]
    with ThreadPoolExecutor(workers or min(8, os.cpu_count() or 1)) as pool:
        for batch, verdicts in zip(batches, pool.map(lambda b: [_verify_entry(e) for _, e in b], batches)):
            for (check, e), verdict in zip(batch, verdicts):
                if e.native:
                    check.sized += 1
                else:
                    check.hashed += 1
                if verdict == "missing":
                    check.missing.append(e.rel)
                elif verdict == "modified":
                    check.modified.append(e.rel)
    return Records(checks, time.perf_counter() - t0)




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


# ---------------------------------------------------------------- model source


def _git(root: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[0] if out.stderr.strip() else f"git {args[0]} failed")
    return out.stdout


def _is_git_checkout(root: Path) -> bool:
    if shutil.which("git") is None:
        return False
    try:
        top = _git(root, "rev-parse", "--show-toplevel").strip()
    except (RuntimeError, OSError, subprocess.SubprocessError):
        return False
    return os.path.realpath(top) == os.path.realpath(root)


def model_source_git(root: Path, pathspec: str = MODEL_SOURCE_PATHSPEC) -> ModelSource:
    """Every file of the package (tracked or not) against git HEAD: modified, deleted, untracked, ... by path."""
    try:
        head = _git(root, "rev-parse", "HEAD").strip()
        porcelain = _git(root, "status", "--porcelain", "--untracked-files=all", "--", pathspec)
        stat = _git(root, "diff", "--stat", "HEAD", "--", pathspec).rstrip()
        tracked = set(_git(root, "ls-files", "--", pathspec).split())
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return ModelSource(mode="git", error=f"git failed: {e}")
    codes = {"??": "untracked", "D": "deleted", "A": "added", "R": "renamed", "M": "modified", "T": "type changed"}
    states: dict[str, str] = {}
    for line in porcelain.splitlines():
        if not line.strip():
            continue
        xy, path = line[:2], line[3:].strip()
        states[path] = codes.get(xy) or next((codes[c] for c in xy if c in codes), "modified")
    modified = sorted(states)
    files = sorted(tracked | {p for p, st in states.items() if st == "untracked"})
    verified = [f for f in files if f in tracked and f not in states]
    return ModelSource(mode="git", commit=head, files=files, modified=modified, states=states, diff_stat=stat,
                       verified=verified, sha256={m: _file_sha256(root / m) for m in modified})


def _file_sha256(path: Path) -> str:
    """sha256 of a file's content, "" when it is gone or unreadable (a deleted file of the package)."""
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return ""


def _matches_record(path: Path, entry) -> bool | None:
    """Whether a file's content has the hash its RECORD entry lists (None: the file cannot be read)."""
    try:
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, entry.hash.mode).digest()
    except (OSError, ValueError):
        return None
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == entry.hash.value


def model_source_record(package: str = MODEL_SOURCE_PACKAGE, dist_name: str = PROJECT_DIST) -> ModelSource:
    """Every installed `package/**.py` file against the distribution's RECORD sha256 hashes."""
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        return ModelSource(mode="none", error=f"not a git checkout and distribution {dist_name!r} is not installed")
    src = ModelSource(mode="record", commit=f"{dist_name}=={dist.version}")
    for entry in dist.files or []:
        rel = str(entry).replace(os.sep, "/")
        if not (rel.startswith(f"{package}/") and rel.endswith(".py")):
            continue
        src.files.append(rel)
        if entry.hash is None:
            src.absent.append(rel)  # listed without a hash: nothing to verify against
            continue
        ok = _matches_record(Path(dist.locate_file(entry)), entry)
        (src.verified if ok else src.modified).append(rel)  # unreadable or gone counts as modified
    src.states = {m: "differs from RECORD" for m in src.modified}
    src.sha256 = {m: _file_sha256(Path(dist.locate_file(m))) for m in src.modified}
    return src


def model_source(root: Path = REPO_ROOT) -> ModelSource:
    """Against git HEAD in a checkout; else (or in a checkout without commits) against the RECORD hashes."""
    if _is_git_checkout(root):
        src = model_source_git(root)
        if src.error is None:
            return src
        record = model_source_record()
        if record.verified or record.modified:
            return record
        return src
    return model_source_record()


def git_commit(root: Path = REPO_ROOT) -> str | None:
    """HEAD of the git checkout whose top is `root` (a worktree too); None outside one, or without git."""
    if shutil.which("git") is None:
        return None
    try:
        top, head = _git(root, "rev-parse", "--show-toplevel", "HEAD").split()
    except (RuntimeError, OSError, subprocess.SubprocessError, ValueError):
        return None
    return head if os.path.realpath(top) == os.path.realpath(root) else None


# ---------------------------------------------------------------- run


def _dir_size(path: Path, max_entries: int = 50_000) -> int:
    total, seen, stack = 0, 0, [path]
    while stack and seen < max_entries:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    seen += 1
                    if e.is_dir(follow_symlinks=False):
                        stack.append(Path(e.path))
                    elif e.is_file(follow_symlinks=False):
                        total += e.stat(follow_symlinks=False).st_size
        except OSError:
            continue
    return total


def compile_cache(profile: Profile, env: dict[str, str]) -> CompileCache:
    path = profile.compile_cache_path
    override = env.get("TORCHINDUCTOR_CACHE_DIR")
    if override and os.path.realpath(os.path.expanduser(override)) == os.path.realpath(path):
        override = None
    cc = CompileCache(str(path), path.is_dir(), env_override=override)
    if not cc.exists:
        return cc
    cc.size_bytes = _dir_size(path)
    try:
        cc.manifest = read_manifest(path)
    except ManifestError as e:
        cc.error = str(e)
    return cc


def run_dir(output_dir: str, deep: bool = False, config: RunConfig | None = None) -> RunDir:
    """The run dir and its finished checkpoints, judged by dflash.runs.rundir's rules (the ones `--resume` applies).

    Every checkpoint's files are checked against the sizes meta.json recorded; with ``deep`` (--verify-data)
    also their sha256, newest first until one verifies (the one `--resume latest` would load). With the run's
    config, also how resuming that checkpoint changes the lr schedule: the trainer's own rule, asked here.
    """
    path = Path(output_dir)
    problem = rundir.write_problem(path)
    rd = RunDir(str(path), path.is_dir(), problem is None, problem, deep=deep)
    for d in rundir.list_checkpoints(path):
        ck = Checkpoint(rundir.checkpoint_step(d), str(d))
        ck.meta, ck.error = rundir.meta_or_problem(d)
        if ck.error is None:
            ck.error = rundir.checkpoint_problem(d, meta=ck.meta)
        rd.checkpoints.append(ck)
    if deep:
        for ck in reversed(rd.checkpoints):
            if ck.error is None:
                ck.error = rundir.checkpoint_problem(ck.path, deep=True, meta=ck.meta)
                if ck.error is None:
                    break
    if rd.checkpoints:
        rd.checkpoints[-1].size_bytes = _dir_size(Path(rd.checkpoints[-1].path))
    usable = [c for c in rd.checkpoints if c.meta is not None and not c.error]
    if config is not None and usable:
        rd.schedule_change = rundir.resume_schedule_change(usable[-1].path, config)
    return rd


def _list_lengths(column):
    import numpy as np
    import pyarrow.compute as pc

    return np.asarray(pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False), dtype=np.int64)


def scan_shard(path: Path, limit: int, first_row: int, keep: int = 3) -> Shard:
    """Rows, lengths, samples over `limit`, and the value ranges (dflash.data.identity.value_stats) of one shard."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from dflash.data.identity import COLUMNS, value_stats

    shard = Shard(path.name, first_row=first_row, size_bytes=path.stat().st_size)
    try:
        with pa.memory_map(str(path)) as source:
            table = ipc.open_file(source).read_all()
            names = table.schema.names
            missing = [c for c in COLUMNS if c not in names]
            if missing:
                shard.error = f"no column {' or '.join(missing)} (columns: {', '.join(names) or 'none'})"
                return shard
            for col in COLUMNS:
                t = table.schema.field(col).type
                if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_integer(t.value_type):
                    shard.error = f"column {col} is {t}, expected a list of integers"
                    return shard
            ids = _list_lengths(table.column("input_ids"))
            mask = _list_lengths(table.column("loss_mask"))
            if np.array_equal(ids, mask):
                shard.values = value_stats(table.column("input_ids"), table.column("loss_mask"))
    except (pa.ArrowException, OSError, ValueError) as e:
        shard.error = f"not a readable Arrow IPC file: {str(e).splitlines()[0][:160]}"
        return shard
    shard.rows = int(ids.size)
    shard.tokens = int(ids.sum())
    shard.lengths = ids
    if ids.size:
        shard.max_row = int(ids.argmax())
        shard.max_len = int(ids[shard.max_row])
        over = np.nonzero(ids > limit)[0]
        shard.over_count = int(over.size)
        if over.size:
            worst = over[np.argsort(-ids[over], kind="stable")[:keep]]
            shard.over = [(int(r), int(ids[r])) for r in worst]
        bad = np.nonzero(ids != mask)[0]
        if bad.size:
            r = int(bad[0])
            shard.mask_mismatch = (r, int(ids[r]), int(mask[r]))
    return shard


def dataset(cfg: RunConfig, deep: bool = False) -> Dataset:
    """The shards of data.path (the trainer's rule for which files are shards), their manifest, the run's target
    fingerprint to compare it with, and with ``deep`` (--verify-data) every shard's sha256."""
    from dflash.data.identity import read_manifest, shard_files, target_fingerprint
    from dflash.filehash import sha256_files

    limit = cfg.data.token_budget if cfg.data.max_length is None else min(cfg.data.token_budget, cfg.data.max_length)
    ds = Dataset(cfg.data.path, limit, deep=deep)
    root = Path(cfg.data.path)
    paths = shard_files(root)
    if not paths and not root.is_dir():
        ds.error = f"{root} is not a folder of *.arrow shards" if root.exists() else f"{root} does not exist"
        return ds
    first = 0
    for path in paths:
        shard = scan_shard(path, limit, first)
        first += shard.rows
        ds.shards.append(shard)
    if not ds.shards:
        ds.error = f"no *.arrow shards in {root}"
        return ds
    if root.is_dir():
        ds.manifest, ds.manifest_error = read_manifest(root)
    try:
        ds.target = target_fingerprint(cfg.target.path)
    except (ConfigError, OSError) as e:
        ds.target_error = e.one_line() if isinstance(e, ConfigError) else f"{cfg.target.path}: {e.strerror}"
    if deep:
        hashes = sha256_files(paths)
        for shard, path in zip(ds.shards, paths):
            digest = hashes[path]
            if isinstance(digest, OSError):
                shard.error = shard.error or f"unreadable ({digest.strerror})"
            else:
                shard.sha256 = digest
    return ds


def disk(output_dir: str) -> Disk:
    probe = Path(output_dir)
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        found = rundir.leftovers(output_dir) if Path(output_dir).is_dir() else []
    except OSError:
        found = []
    try:
        return Disk(str(probe), shutil.disk_usage(probe).free, output_dir=str(output_dir), leftovers=found)
    except OSError as e:
        return Disk(str(probe), error=str(e), output_dir=str(output_dir), leftovers=found)


def target_shape(cfg: RunConfig) -> tuple[TargetShape | None, str | None]:
    """(shape, None) or (None, why): read once here, through the memory model's one reader, so checks do no I/O."""
    try:
        return load_target_shape(cfg.target.path), None
    except ConfigError as e:
        return None, e.one_line()


# ---------------------------------------------------------------- all together


def gpu_facts(provider: GpuInfo | None, env: dict[str, str]) -> GpuFacts:
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if provider is None:
        return GpuFacts(error="NVML not queried (device = cpu)", cuda_visible_devices=cvd, queried=False)
    try:
        return GpuFacts(snapshot=provider.snapshot(), cuda_visible_devices=cvd)
    except NvmlUnavailable as e:
        return GpuFacts(error=str(e), cuda_visible_devices=cvd)


def host_info(gpus: GpuFacts, root: Path = REPO_ROOT) -> dict:
    snap = gpus.snapshot
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "prefix": sys.prefix,
        "cpus": os.cpu_count(),
        "pid": os.getpid(),
        "git_commit": git_commit(root),
        "nvidia_driver": snap.driver_version if snap else None,
        "cuda_driver": snap.cuda_driver_version if snap else None,
        "gpus": len(snap.gpus) if snap else 0,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def gather(
    profile_name: str,
    config: RunConfig | None = None,
    resume_intent: str | None = None,
    gpu_info: GpuInfo | None = None,
    config_path: str | None = None,
    envs_dir: Path = ENVS_DIR,
    root: Path = REPO_ROOT,
    environ: dict[str, str] | None = None,
    verify_data: bool = False,
) -> Context:
    """Collect every fact. ``gpu_info`` None = do not query NVML (use it when device = cpu).

    ``verify_data``: also hash every shard and the checkpoint a resume loads (reads every byte).
    """
    env = dict(os.environ if environ is None else environ)
    ctx = Context(profile_name=profile_name, config=config, config_path=config_path, resume_intent=resume_intent, env=env)
    try:
        ctx.profile = load_profile(profile_name, envs_dir)
        where = locate(profile_name, envs_dir)
        ctx.env_identity = EnvIdentity(sys.prefix, str(where.path), where.default)
    except ProfileError as e:
        ctx.profile_error = str(e)
    lock = lock_path(profile_name, envs_dir)
    ctx.lock_file = f"{envs_dir.name}/{lock.name}"
    try:
        ctx.lock_text = lock.read_text(encoding="utf-8", errors="replace")  # stray bytes fail the profile check
    except OSError:
        ctx.lock_text = None
    ctx.distributions = installed_distributions()
    ctx.records = verify_records([n for n in ctx.distributions if record_verified(n)])
    ctx.torch = torch_build()
    ctx.path_entries = path_entries(env.get("PATH", ""), sys.prefix)
    ctx.ld_dirs = [scan_lib_dir(p) for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    ctx.ld_cache = ld_cache()
    ctx.gpus = gpu_facts(gpu_info, env)
    ctx.model_source = model_source(root)
    if ctx.profile is not None:
        ctx.compile_cache = compile_cache(ctx.profile, env)
    if config is not None:
        ctx.target_shape, ctx.target_error = target_shape(config)
        resuming = resume_intent == "resume"
        ctx.run_dir = run_dir(config.output_dir, deep=verify_data and resuming, config=config if resuming else None)
        ctx.dataset = dataset(config, deep=verify_data)
        ctx.disk = disk(config.output_dir)
    ctx.host = host_info(ctx.gpus, root)
    return ctx
