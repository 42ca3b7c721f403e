"""Checkpoints: atomic, self-describing, explicit about resume.

Layout: <output_dir>/checkpoints/step_<8-digit step>/
    drafter/            HF-style folder (config.json + model.safetensors), loadable on its own
    optimizer.pt        AdamW state
    trainer_state.pt    scheduler, RNG states, sampler position, step
    meta.json           step, resolved config, dataset fingerprint, lock hash, git commit
A save is written to step_X.tmp and renamed when complete, so a crash mid-save leaves the
previous checkpoint loadable; only the newest keep_last are kept.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

from dflash.config import RunConfig
from dflash.errors import DflashError

STEP_PREFIX = "step_"


class CheckpointError(DflashError):
    """A checkpoint that cannot be found or read; the message is one line."""


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Finished checkpoints, oldest first (unfinished *.tmp saves are ignored)."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)
            and p.name[len(STEP_PREFIX):].isdigit() and (p / "meta.json").exists()]
    return sorted(done, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def resolve_resume(output_dir: str | Path, resume: str) -> Path:
    """`latest` or a checkpoint folder -> the folder to load."""
    if resume == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise CheckpointError(f"--resume latest: no checkpoint in {checkpoints_dir(output_dir)}; use --fresh")
        return found[-1]
    path = Path(resume)
    if not (path / "meta.json").exists():
        raise CheckpointError(f"--resume {resume}: not a checkpoint folder (no meta.json); use --resume latest")
    return path


def save_checkpoint(output_dir: str | Path, step: int, drafter, optimizer, trainer_state: dict,
                    cfg: RunConfig, dataset_meta: dict, keep_last: int, provenance: dict | None = None) -> Path:
    """Write checkpoint `step` atomically and keep the newest keep_last.

    ``provenance``: what wrote it, e.g. ``preflight.gate.provenance(cfg.profile)``
    (``{"lock_sha256": ..., "git_commit": ...}``), recorded in meta.json as given.
    """
    root = checkpoints_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{STEP_PREFIX}{step:08d}"
    tmp = root / f"{final.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    drafter.save_pretrained(tmp / "drafter")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(trainer_state, tmp / "trainer_state.pt")
    meta = {
        "step": step,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": cfg.model_dump(),
        "dataset": dataset_meta,
        **(provenance or {}),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    _fsync_tree(tmp)  # the bytes are on disk before the rename makes the checkpoint visible
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_dir(root)
    for old in list_checkpoints(output_dir)[:-keep_last]:
        if old != final:  # never the one just written
            shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
        elif path.is_dir():
            _fsync_dir(path)
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some filesystems cannot open a directory; the file syncs above still hold
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_meta(path: Path) -> dict:
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable meta.json ({e}); pick another checkpoint or use --fresh") from None


def load_checkpoint(path: Path, drafter, optimizer, device) -> tuple[dict, dict]:
    """Load weights + optimizer into the given objects; return (trainer_state, meta)."""
    from safetensors.torch import load_file

    meta = load_meta(path)
    try:
        state = load_file(str(path / "drafter" / "model.safetensors"), device=str(device))
        missing, unexpected = drafter.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise CheckpointError(f"{path}: drafter weights do not match this drafter "
                                  f"(missing {missing[:3]}, unexpected {unexpected[:3]}); use --fresh")
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
        trainer_state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
    except (OSError, RuntimeError) as e:
        raise CheckpointError(f"{path}: cannot load ({str(e).splitlines()[0]}); pick another checkpoint") from None
    return trainer_state, meta
