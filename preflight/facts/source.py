"""The code a run executes: every source file of the package against git HEAD (or the installed RECORD), and
the compile cache artifact that carries the run's compiled kernels (its manifest only: no section is read)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import numpy as np

from dflash.errors import DflashError
from dflash.runs import compile_artifact
from preflight.facts.environment import PROJECT_DIST
from preflight.profiles import REPO_ROOT, Profile

# The code a training run executes: a debugging hack left in any module of the package changes what a run trains.
MODEL_SOURCE_PACKAGE = "dflash"


MODEL_SOURCE_PATHSPEC = f"{MODEL_SOURCE_PACKAGE}/*.py"  # git pathspec: every .py file under dflash/


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
    path: str  # the compile cache artifact: train.compile_cache, or its default beside the profile's cache dir
    exists: bool
    manifest: dict | None = None  # the artifact's manifest (dflash.runs.compile_artifact)
    error: str | None = None  # why the artifact cannot be used: truncated, foreign, unreadable
    size_bytes: int | None = None
    env_override: str | None = None  # TORCHINDUCTOR_CACHE_DIR when it points away from the profile's cache dir
    run: dict | None = None  # this run's side of the match (compile_artifact.run_facts); None: see run_error
    run_error: str | None = None  # why the run's shape classes are unknown (target or data unreadable)
    others: int = 0  # other artifacts in the same folder (made for other runs)


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


def compile_cache(profile: Profile, env: dict[str, str], config=None, data=None) -> CompileCache:
    """The run's compile cache artifact (its header only) and this run's side of the match: the target's
    architecture (data.target, the fingerprint the dataset facts took) and the shape classes of `data`'s lengths."""
    from dflash.data.plan import shape_classes, training_lengths

    cache_dir = profile.compile_cache_path
    override = env.get("TORCHINDUCTOR_CACHE_DIR")
    if override and os.path.realpath(os.path.expanduser(override)) == os.path.realpath(cache_dir):
        override = None
    if config is None:
        return CompileCache(str(cache_dir), cache_dir.is_dir(), env_override=override, run_error="no run config")
    path = compile_artifact.artifact_path(config, cache_dir)
    header, problem = compile_artifact.read_header(path)
    cc = CompileCache(str(path), path.exists(), env_override=override, error=problem,
                      manifest=header["manifest"] if header else None, size_bytes=header["size"] if header else None)
    if cc.exists and cc.size_bytes is None:
        with contextlib.suppress(OSError):
            cc.size_bytes = path.stat().st_size
    if path.parent.is_dir():
        cc.others = sum(1 for p in path.parent.glob(f"*{compile_artifact.SUFFIX}") if p.name != path.name)
    if header is None:  # nothing to compare (the shape classes of 1.1M samples take 1-2.5 s on two busy cores)
        return cc
    lengths = [s.lengths for s in sorted(data.shards, key=lambda s: s.first_row)] if data and not data.error else []
    if data is None or data.error or not data.shards or any(x is None for x in lengths):
        cc.run_error = f"the dataset {config.data.path} was not read" + (f" ({data.error})" if data and data.error else "")
    elif data.target is None:
        cc.run_error = data.target_error or f"the target {config.target.path} was not read"
    else:
        try:
            train = training_lengths(config, np.concatenate(lengths))
            cc.run = compile_artifact.run_facts(config, data.target, shape_classes(config, train))
        except (ValueError, DflashError) as e:  # no batch of this data fits the run's batching
            cc.run_error = f"no shape classes: {' '.join(str(e).split())[:160]}"
    return cc
