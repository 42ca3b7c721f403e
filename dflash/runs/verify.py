"""Verifying one checkpoint folder, torch-free: is every file a resume loads there, with the size (and with ``deep``
the sha256) meta.json recorded? The names are dflash.runs.rundir's.

Verifying a checkpoint (`checkpoint_problem`): every file a resume loads is there, and each file
recorded in meta.json has its recorded size (a stat: instant); ``deep`` also compares each file's
sha256 with the recorded one (reads every byte: ~1 s per GB here, see bench/README.md). A resume
reads every byte anyway, so `--resume` verifies deep; preflight checks sizes unless asked for
``--verify-data``.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash.filehash import sha256_files
from dflash.runs.rundir import (
    CHECKPOINT_FILES,
    FILES_KEY,
    LEGACY_STATE,
    META_NAME,
    STATE_JSON,
    CheckpointError,
    checkpoint_step,
    list_checkpoints,
)


def resume_fix(path: str | Path) -> str:
    """What to do about a checkpoint that cannot be loaded: the previous one, if there is one, else --fresh."""
    path = Path(path)
    step = checkpoint_step(path)
    earlier = [p for p in list_checkpoints(path.parent.parent) if step is not None and checkpoint_step(p) < step]
    if earlier:
        return f"resume the previous one with --resume {earlier[-1]}, or start over with --fresh"
    return "start over with --fresh"


def meta_or_problem(path: str | Path) -> tuple[dict | None, str | None]:
    """(meta.json of a checkpoint, None), or (None, a short reason it cannot be read)."""
    try:
        meta = json.loads((Path(path) / META_NAME).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"{META_NAME} unreadable: {' '.join(str(e).split())}"
    if not isinstance(meta, dict):
        return None, f"{META_NAME} unreadable: not a JSON object"
    return meta, None


def read_meta(path: str | Path) -> dict:
    """meta.json of a checkpoint folder. Raises CheckpointError."""
    meta, problem = meta_or_problem(path)
    if problem:
        raise CheckpointError(f"{path}: {problem}; {resume_fix(path)}")
    return meta


def is_legacy(path: str | Path) -> bool:
    """Written by a version that pickled its trainer state (trainer_state.pt), which this one never unpickles."""
    path = Path(path)
    return (path / LEGACY_STATE).exists() and not (path / STATE_JSON).exists()


LEGACY_REASON = f"written by an older dflash version ({LEGACY_STATE}, a pickle this version does not load)"


def legacy_message(path: str | Path) -> str:
    return f"{path}: {LEGACY_REASON}; start over with --fresh"


def record_files(folder: str | Path) -> dict[str, dict]:
    """{path inside the folder: {"bytes": size, "sha256": hex}} of every file but meta.json: what a save records.

    Files are hashed in parallel threads (bench/README.md has the speed). Raises OSError.
    """
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p != folder / META_NAME)
    hashes = sha256_files(files)
    out = {}
    for p in files:
        digest = hashes[p]
        if isinstance(digest, OSError):
            raise digest
        out[p.relative_to(folder).as_posix()] = {"bytes": p.stat().st_size, "sha256": digest}
    return out


def checkpoint_problem(path: str | Path, deep: bool = False, meta: dict | None = None) -> str | None:
    """Why a finished checkpoint cannot be resumed (None when it verifies): an older version's pickle, a
    missing file, an unreadable meta.json, a file whose size differs from meta.json's record, and with
    ``deep`` one whose sha256 differs. A checkpoint saved before sizes were recorded is judged by its files.
    """
    path = Path(path)
    if is_legacy(path):
        return LEGACY_REASON
    missing = [name for name in CHECKPOINT_FILES if not (path / name).is_file()]
    if missing:
        return f"{', '.join(missing)} missing (an incomplete checkpoint)"
    if meta is None:
        meta, problem = meta_or_problem(path)
        if problem:
            return problem
    named = checkpoint_step(path)
    if named is not None and meta.get("step") != named:  # a folder copied or renamed from another checkpoint
        return f"{META_NAME} says step {meta.get('step')}, the folder name says step {named} (copied or renamed)"
    files = meta.get(FILES_KEY)
    if not isinstance(files, dict):
        return None
    for rel, rec in sorted(files.items()):
        try:
            size = (path / rel).stat().st_size
        except FileNotFoundError:
            return f"{rel} missing (recorded in {META_NAME})"
        except OSError as e:
            return f"{rel} unreadable ({e.strerror})"
        if not isinstance(rec, dict) or size != rec.get("bytes"):
            want = rec.get("bytes") if isinstance(rec, dict) else None
            return f"{rel} is {size:,} bytes, {META_NAME} recorded {want if want is None else format(want, ',')} " \
                   "(truncated or rewritten since the save)"
    if deep:
        hashes = sha256_files(path / rel for rel in sorted(files))
        for rel in sorted(files):
            digest = hashes[path / rel]
            if isinstance(digest, OSError):
                return f"{rel} unreadable ({digest.strerror})"
            if digest != files[rel].get("sha256"):
                return f"{rel} content differs from its sha256 in {META_NAME} (damaged since the save)"
    return None


def verify_checkpoint(path: str | Path, deep: bool = True) -> Path:
    """Raise CheckpointError unless the checkpoint verifies (`checkpoint_problem`); returns the path."""
    if is_legacy(path):
        raise CheckpointError(legacy_message(path))
    problem = checkpoint_problem(path, deep)
    if problem:
        raise CheckpointError(f"{path}: {problem}; {resume_fix(path)}")
    return Path(path)
