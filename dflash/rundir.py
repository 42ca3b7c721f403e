"""The run dir: its layout, its checkpoints, and the explicit resume/fresh rule. Torch-free.

    <output_dir>/
        config.json                 the resolved run config, written when a run starts
        preflight.json              the gate's report for this run
        metrics.jsonl               one JSON row per logged step
        drafter/                    the final drafter (HF folder), written when the run finishes
        checkpoints/step_<8 digits>/
            meta.json               step, resolved config, dataset identity, provenance (written last)
            drafter/                HF folder (config.json + model.safetensors), loadable on its own
            optimizer.pt            AdamW state (tensors only: loaded with weights_only=True)
            trainer_state.json      step, sampler position, ... (plain JSON)
            trainer_state.safetensors   the trainer state's tensors (RNG states)
        checkpoints/step_<8 digits>.tmp/      a save in progress (never listed)
        checkpoints.abandoned-*/, replaced-*/, metrics.abandoned-*.jsonl   moved aside, never deleted

This module is the only place that knows these names: the trainer (``dflash.checkpoint``,
``dflash.train``), ``dflash-train``'s resume/fresh rule and preflight's `run-dir` facts all use
it, so a checkpoint the trainer would refuse is one preflight refuses too.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dflash.errors import DflashError, UsageError

if TYPE_CHECKING:
    from dflash.config import RunConfig

CONFIG_NAME = "config.json"
PREFLIGHT_NAME = "preflight.json"
METRICS_NAME = "metrics.jsonl"
DRAFTER_DIR = "drafter"
CHECKPOINTS_DIR = "checkpoints"
STEP_PREFIX = "step_"
TMP_SUFFIX = ".tmp"

# Inside one checkpoint folder.
META_NAME = "meta.json"
WEIGHTS_NAME = "model.safetensors"  # inside DRAFTER_DIR
OPTIMIZER_NAME = "optimizer.pt"
STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
LEGACY_STATE = "trainer_state.pt"  # the pickled state of older versions: never loaded
CHECKPOINT_FILES = (META_NAME, f"{DRAFTER_DIR}/{WEIGHTS_NAME}", OPTIMIZER_NAME, STATE_JSON, STATE_TENSORS)


class RunDirError(UsageError):
    """--resume/--fresh that do not fit the run dir; the message is one line naming the fix (exit 2)."""


class CheckpointError(DflashError):
    """A checkpoint that cannot be found or loaded; the message is one line naming the file and the fix."""


# ---------------------------------------------------------------- paths and listing


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR


def checkpoint_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def checkpoint_path(output_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(output_dir) / checkpoint_name(step)


def checkpoint_step(path: str | Path) -> int | None:
    """The step a checkpoint folder's name says (``step_00000690`` -> 690); None for any other name."""
    name = Path(path).name
    digits = name[len(STEP_PREFIX):]
    if name.startswith(STEP_PREFIX) and len(digits) == 8 and digits.isdigit():
        return int(digits)
    return None


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Finished checkpoints, oldest first: ``step_<8 digits>`` folders holding meta.json (written last).

    Saves in progress (``*.tmp``) and any other folder are ignored.
    """
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if checkpoint_step(p) is not None and p.is_dir() and (p / META_NAME).exists()]
    return sorted(done, key=checkpoint_step)


def resolve_resume(output_dir: str | Path, resume: str) -> Path:
    """`latest` or a checkpoint folder -> the folder to load. Raises RunDirError."""
    if resume == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise RunDirError(f"--resume latest: no checkpoint in {checkpoints_dir(output_dir)}; use --fresh")
        return found[-1]
    path = Path(resume)
    if not (path / META_NAME).exists():
        raise RunDirError(f"--resume {resume}: not a checkpoint folder (no {META_NAME}); use --resume latest")
    return path


# ---------------------------------------------------------------- reading and verifying one checkpoint


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


def checkpoint_problem(path: str | Path) -> str | None:
    """Why a finished checkpoint cannot be resumed, judged by its files (None when every file is there)."""
    path = Path(path)
    if is_legacy(path):
        return LEGACY_REASON
    missing = [name for name in CHECKPOINT_FILES if not (path / name).is_file()]
    if missing:
        return f"{', '.join(missing)} missing (an incomplete checkpoint)"
    return None


def verify_checkpoint(path: str | Path) -> Path:
    """Raise CheckpointError unless the checkpoint has every file a resume loads; returns the path."""
    if is_legacy(path):
        raise CheckpointError(legacy_message(path))
    problem = checkpoint_problem(path)
    if problem:
        raise CheckpointError(f"{path}: {problem}; {resume_fix(path)}")
    read_meta(path)
    return Path(path)


# ---------------------------------------------------------------- the resume/fresh rule


def prepare_output_dir(cfg: RunConfig, resume: str | None, fresh: bool, log=print) -> Path | None:
    """Enforce the explicit resume/fresh rule before anything is loaded. Returns the checkpoint to resume, or None.

    - checkpoints in the run dir and neither --resume nor --fresh: RunDirError (nobody guesses);
    - --resume: the checkpoint must verify (CheckpointError otherwise); newer checkpoints move aside
      so `latest` stays this run's, and metrics rows after its step move to metrics.abandoned-*.jsonl;
    - --fresh: the old checkpoints, metrics and final drafter move to replaced-*/ (nothing is deleted).
    """
    out = Path(cfg.output_dir)
    existing = list_checkpoints(out)
    if resume and fresh:
        raise RunDirError("--resume and --fresh exclude each other; pick one")
    if existing and not resume and not fresh:
        newest = existing[-1]
        raise RunDirError(f"{cfg.output_dir} already holds checkpoints (newest {newest.name}, step "
                          f"{checkpoint_step(newest)}); say --resume latest to continue it or --fresh to start over")
    if resume:
        path = verify_checkpoint(resolve_resume(out, resume))
        step = checkpoint_step(path)
        if step is None:  # a checkpoint folder given by path under another name: its meta says the step
            step = int(read_meta(path).get("step") or 0)
        newer = [c for c in existing if checkpoint_step(c) > step]
        if newer and path.parent == checkpoints_dir(out):
            aside = _aside(out, "checkpoints.abandoned")
            aside.mkdir()
            for c in newer:
                c.rename(aside / c.name)
            log(f"--resume {path.name}: {len(newer)} newer checkpoint(s) moved to {aside}, so `latest` "
                "stays this run's (nothing deleted)")
        trim_metrics(out, step, log)
        return path
    if fresh:
        leftovers = [p for p in (checkpoints_dir(out), out / METRICS_NAME, out / DRAFTER_DIR) if p.exists()]
        if leftovers:
            aside = _aside(out, "replaced")
            aside.mkdir()
            for p in leftovers:
                p.rename(aside / p.name)
            log(f"--fresh: previous {', '.join(p.name for p in leftovers)} moved to {aside} (nothing deleted)")
    return None


def trim_metrics(out: Path, step: int, log=print) -> None:
    """Rows logged after the resumed step (the interrupted run's) move to metrics.abandoned-*.jsonl,
    so metrics.jsonl holds each step once after the resume."""
    path = Path(out) / METRICS_NAME
    if not path.is_file():
        return
    keep, later = [], []
    for line in path.read_text().splitlines(keepends=True):
        try:
            row_step = int(json.loads(line).get("step", 0))
        except (ValueError, AttributeError):
            row_step = 0  # a torn last line of a killed run: keep it where it was logged
        (later if row_step > step else keep).append(line)
    if not later:
        return
    aside = Path(out) / f"{_aside(Path(out), 'metrics.abandoned').name}.jsonl"
    aside.write_text("".join(later))
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(keep))
    tmp.replace(path)
    log(f"--resume: {len(later)} metrics row(s) after step {step} moved to {aside.name}")


def _aside(out: Path, stem: str) -> Path:
    """A new, unused folder name under the run dir for things moved out of the way."""
    base = out / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        path, n = base.with_name(f"{base.name}.{n}"), n + 1
    return path
