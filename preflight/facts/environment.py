"""The installed environment, read without importing it: the torch build (from ``torch/version.py``)
and every GPU-stack and target-code distribution's files against the hashes its RECORD lists."""

from __future__ import annotations

import base64
import contextlib
import csv
import hashlib
import os
import re
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.utils import canonicalize_name

PROJECT_DIST = "dflash"  # the project itself: never drift


# Installed distributions whose files are checked against their RECORD hashes: besides the GPU stack
# (lockfile.is_gpu_stack: torch, triton, nvidia-*, ...), the packages whose code runs the target and drafter.
RECORD_VERIFIED = ("transformers", "tokenizers", "safetensors")


# Native libraries are compared with RECORD by size only: hashing them reads gigabytes (the CUDA wheels) at
# every launch, while an edit, the incident's class of change, lands in Python sources, which are hashed.
NATIVE_FILE = re.compile(r"\.(?:so(?:\.\d+)*|a|o|bc|cubin|fatbin)$")


@dataclass
class TorchBuild:
    version: str  # with local label, e.g. "2.10.0+cu128"
    cuda: str | None  # CUDA the build targets, None for a CPU build
    source: str  # the file it was read from


@dataclass
class EnvIdentity:
    prefix: str  # this interpreter's environment (sys.prefix): the one the environment checks judge
    profile_env: str  # where the profile's environment lives (`dflash-env path`)
    default: bool  # that is uv's project environment (.venv), the one `uv run` builds and uses

    @property
    def matches(self) -> bool:
        return os.path.realpath(self.prefix) == os.path.realpath(self.profile_env)


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
class SyncRecord:
    """This environment's distributions against what the last checked `dflash-env sync` recorded (its
    dflash-verified.json: per locked distribution the version and the sha256 of its RECORD)."""

    path: str  # the record file
    present: bool  # False: none of this format (an environment not built by this dflash-env version)
    compared: int = 0  # installed distributions whose RECORD was hashed against the record
    rebuilt: list[dict] = field(default_factory=list)  # {name, version}: the recorded version, another RECORD
    seconds: float = 0.0


@dataclass
class Records:
    checks: list[RecordCheck] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the verification


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


RACY_NS = 2_000_000_000  # a file changed this recently is hashed again next time (a coarse clock could hide a write)
HASHED_FOLDER = "records"  # under $DFLASH_CACHE: the files a check found matching their RECORD, by their stat


def _stamp(path: str) -> list[int] | None:
    """What changes when a file is edited in place or replaced: inode, size, mtime and ctime (the last set by the
    kernel on any write or metadata change; no tool sets it back)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _hashed_file(folder: Path | None, names: list[str]) -> Path:
    """One file per environment and set of distributions checked (the gate checks the same set every time)."""
    import sys

    from dflash.models.smollm2 import cache_root

    key = hashlib.sha256("\n".join([os.path.realpath(sys.prefix), *sorted(names)]).encode()).hexdigest()[:16]
    return (folder or cache_root() / HASHED_FOLDER) / f"{key}.json"


def _read_hashed(path: Path) -> dict:
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_hashed(path: Path, hashed: dict) -> None:
    """Atomically; a cache that cannot be written only costs the next check its hashing."""
    import json

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(hashed, separators=(",", ":")))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):  # a read-only mount or a file where the folder should be: no cache
            tmp.unlink(missing_ok=True)


def verify_records(names: list[str], workers: int | None = None, hashed_in: Path | None = None,
                   remember: bool = True) -> Records:
    """Check the installed files of distributions `names` against their RECORD: sha256 for every file but
    .pyc caches and native libraries (those by size), read in parallel batches (hashlib releases the GIL).
    A file an earlier check found matching, unchanged since (the same inode, size, mtime and ctime), is not read
    again: those are kept per environment under $DFLASH_CACHE/records/ (`hashed_in`: another folder)."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    store = _hashed_file(hashed_in, names) if remember else None
    before = _read_hashed(store) if store else {}
    after: dict = {}
    checks, jobs = [], []
    for name in sorted(names):
        check, entries = _record_entries(name)
        checks.append(check)
        jobs += [(check, e) for e in entries]

    def verdict(e: _RecordEntry) -> str | None:
        if e.native:
            return _verify_entry(e)
        stamp = _stamp(e.path)
        if stamp is not None and before.get(e.path) == [*stamp, e.digest]:
            after[e.path] = before[e.path]
            return None
        found = _verify_entry(e)
        if (found is None and stamp is not None and _stamp(e.path) == stamp  # unchanged while it was read
                and time.time_ns() - stamp[3] > RACY_NS):  # and not changed so recently that a write could share its tick
            after[e.path] = [*stamp, e.digest]
        return found

    batches = [jobs[i:i + 512] for i in range(0, len(jobs), 512)]
    with ThreadPoolExecutor(workers or min(8, os.cpu_count() or 1)) as pool:
        for batch, verdicts in zip(batches, pool.map(lambda b: [verdict(e) for _, e in b], batches)):
            for (check, e), verdict_ in zip(batch, verdicts):
                if e.native:
                    check.sized += 1
                else:
                    check.hashed += 1
                if verdict_ == "missing":
                    check.missing.append(e.rel)
                elif verdict_ == "modified":
                    check.modified.append(e.rel)
    if store and after != before:
        _write_hashed(store, after)
    return Records(checks, time.perf_counter() - t0)


def sync_record(env: str | Path) -> SyncRecord:
    """Each installed distribution the environment's sync record lists, at the version it recorded, whose RECORD
    hashes otherwise: another build of a locked version put in after the sync (a version change is version drift,
    judged against the lock). Hashes only the RECORD files (a few ms), never the files they list."""
    from preflight.envs import VERIFIED_FILE, installed_record_digests, read_verified
    from preflight.lockfile import same_version

    t0 = time.perf_counter()
    env = Path(env)
    verified = read_verified(env)
    out = SyncRecord(str(env / VERIFIED_FILE), verified is not None)
    if verified is None:
        return out
    for name, (version, digest) in sorted(installed_record_digests(env, list(verified)).items()):
        mine = verified[name] if isinstance(verified[name], dict) else {}
        if not isinstance(mine.get("version"), str) or version is None or not same_version(mine["version"], version):
            continue
        out.compared += 1
        if digest != mine.get("record_sha256"):
            out.rebuilt.append({"name": name, "version": version})
    out.seconds = time.perf_counter() - t0
    return out
