"""Checkpoints: atomic, self-describing, and never unpickled.

The folder layout and its names belong to ``dflash.runs.rundir``; this module writes and reads the
tensors. A save is written to ``step_X.tmp`` and renamed when complete, so a crash mid-save
leaves the previous checkpoint loadable; only the newest keep_last are kept, and the one
``checkpoints/best`` points to (``dflash.runs.rundir.set_best``).

The trainer state is plain JSON (step, sampler position, ...) plus its tensors (RNG states) in
safetensors, and the optimizer state is loaded with ``weights_only=True``: loading a checkpoint
runs no code from it. A checkpoint of an older version (a pickled ``trainer_state.pt``) is
refused with a one-line CheckpointError, as is a missing or corrupt file. meta.json records the
size and sha256 of every other file of the checkpoint, so a resume can tell a damaged checkpoint
from an intact one before loading it (``dflash.rundir.checkpoint_problem``).

    path = save_checkpoint(out, step, drafter, optimizer, {"step": step, "sampler": {...}, "rng_cpu": t},
                           cfg, dataset_meta, keep_last, provenance=preflight.gate.provenance(cfg.profile))
    state, meta = load_checkpoint(path, drafter, optimizer, device)
    state = load_trainer_state(path)       # the state alone (split-run drafter ranks)
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

from dflash.config import RunConfig
from dflash.runs.rundir import (
    DRAFTER_DIR,
    FILES_KEY,
    META_NAME,
    OPTIMIZER_NAME,
    STATE_JSON,
    STATE_TENSORS,
    TMP_SUFFIX,
    WEIGHTS_NAME,
    CheckpointError,
    best_checkpoint,
    checkpoint_path,
    checkpoint_step,
    io_cause,
    is_legacy,
    legacy_message,
    list_checkpoints,
    read_meta,
    record_files,
    resume_fix,
)

FORMAT = 2  # meta.json "format": 2 = JSON + safetensors trainer state (1 was a pickled trainer_state.pt)
load_meta = read_meta  # the older name


def save_trainer_state(folder: str | Path, state: dict) -> None:
    """Write a trainer state: its top-level tensors to trainer_state.safetensors, the rest to trainer_state.json.

    Values other than tensors must be JSON (numbers, strings, lists, dicts, None).
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
    plain = {k: v for k, v in state.items() if k not in tensors}
    try:
        text = json.dumps(plain, indent=2, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"trainer state must be tensors plus JSON values: {e}") from None
    save_file(tensors, str(folder / STATE_TENSORS))
    (folder / STATE_JSON).write_text(text + "\n")


def _missing(file: Path, checkpoint: Path) -> CheckpointError:
    return CheckpointError(f"{file} is missing (an incomplete checkpoint); {resume_fix(checkpoint)}")


def _corrupt(file: Path, why: str, checkpoint: Path) -> CheckpointError:
    return CheckpointError(f"{file} is corrupt ({why}); {resume_fix(checkpoint)}")


def load_trainer_state(path: str | Path) -> dict:
    """The trainer state of a checkpoint folder (JSON values plus CPU tensors). Raises CheckpointError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if is_legacy(path):
        raise CheckpointError(legacy_message(path))
    try:
        state = json.loads((path / STATE_JSON).read_text())
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        raise _missing(path / STATE_JSON, path) from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _corrupt(path / STATE_JSON, _one_line(e), path) from None
    try:
        tensors = load_file(str(path / STATE_TENSORS), device="cpu")
    except FileNotFoundError:
        raise _missing(path / STATE_TENSORS, path) from None
    except (OSError, SafetensorError, RuntimeError, ValueError) as e:
        raise _corrupt(path / STATE_TENSORS, _one_line(e), path) from None
    clash = sorted(set(state) & set(tensors))
    if clash:
        raise _corrupt(path / STATE_TENSORS, f"keys {clash} also in {STATE_JSON}", path)
    state.update(tensors)
    return state


def save_checkpoint(output_dir: str | Path, step: int, drafter, optimizer, trainer_state: dict,
                    cfg: RunConfig, dataset_meta: dict, keep_last: int, provenance: dict | None = None) -> Path:
    """Write checkpoint `step` atomically and keep the newest keep_last.

    ``provenance``: what wrote it, e.g. ``preflight.gate.provenance(cfg.profile)``
    (``{"lock_sha256": ..., "git_commit": ...}``), recorded in meta.json as given.
    """
    final = checkpoint_path(output_dir, step)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{final.name}{TMP_SUFFIX}"
    _remove(tmp)
    tmp.mkdir()
    try:
        drafter.save_pretrained(tmp / DRAFTER_DIR)
        with open(tmp / OPTIMIZER_NAME, "wb") as f:  # a file of ours: a failed write keeps its OSError (errno)
            torch.save(optimizer.state_dict(), f)
        save_trainer_state(tmp, trainer_state)
        meta = {
            "format": FORMAT,
            "step": step,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": cfg.model_dump(),
            "dataset": dataset_meta,
            **(provenance or {}),
            FILES_KEY: record_files(tmp),  # size + sha256 of every file: a resume verifies them (dflash.runs.rundir)
        }
        (tmp / META_NAME).write_text(json.dumps(meta, indent=2))  # last: a folder with meta.json is finished
        _fsync_tree(tmp)  # the bytes are on disk before the rename makes the checkpoint visible
        _remove(final)
        tmp.rename(final)
    except BaseException as e:  # a full disk, a kill's KeyboardInterrupt...: no partial step_N.tmp stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        cause = io_cause(e) if isinstance(e, Exception) else None
        if cause is not None and cause is not e:  # torch and safetensors wrap the disk's error: raise that
            raise OSError(cause.errno, cause.strerror, cause.filename or str(tmp)) from e
        raise
    _fsync_dir(root)
    best = best_checkpoint(output_dir)
    # real folders only (list_checkpoints never lists a symlink), up to the one just written
    for old in [c for c in list_checkpoints(output_dir) if checkpoint_step(c) <= step][:-keep_last]:
        if old != final and old != best:  # never the one just written, never checkpoints/best's
            shutil.rmtree(old, ignore_errors=True)
    return final


def _remove(path: Path) -> None:
    """Clear a checkpoint name for a save: a symlink (to another run's checkpoint, say) loses only the link."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


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


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0][:160] if lines else type(err).__name__


def load_checkpoint(path: Path, drafter, optimizer, device) -> tuple[dict, dict]:
    """Load weights + optimizer into the given objects; return (trainer_state, meta). Raises CheckpointError."""
    import pickle

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if is_legacy(path):
        raise CheckpointError(legacy_message(path))
    meta = read_meta(path)
    trainer_state = load_trainer_state(path)
    weights = path / DRAFTER_DIR / WEIGHTS_NAME
    try:
        state = load_file(str(weights), device=str(device))
    except FileNotFoundError:
        raise _missing(weights, path) from None
    except (OSError, SafetensorError, RuntimeError, ValueError) as e:
        raise _corrupt(weights, _one_line(e), path) from None
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{weights}: drafter weights do not match this drafter "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]}); use --fresh")
    opt_path = path / OPTIMIZER_NAME
    try:
        opt_state = torch.load(opt_path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise _missing(opt_path, path) from None
    except pickle.UnpicklingError:  # weights_only refused it: not a plain tensor file
        raise _corrupt(opt_path, "not a tensors-only torch file", path) from None
    except (OSError, RuntimeError, ValueError, EOFError) as e:
        raise _corrupt(opt_path, _one_line(e), path) from None
    try:
        optimizer.load_state_dict(opt_state)
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise CheckpointError(f"{opt_path} does not fit this drafter's optimizer ({_one_line(e)}); "
                              "use --fresh") from None
    for group in optimizer.param_groups:  # load_state_dict restores a saved group's flags: a CPU checkpoint written
        group["fused"] = True             # before AdamW was fused everywhere says False (dflash.train.step.build_optimizer)
    return trainer_state, meta
