"""The resume/fresh rule, torch-free: which checkpoint `--resume` takes, what it refuses, and what a decided intent
moves aside. `dflash-train`, `dflash-torchrun`, the demo and preflight's run-dir facts all ask it.

`--resume latest` takes the newest checkpoint that verifies (dflash.runs.verify) and says which newer ones it
skipped and why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from dflash.runs.metrics import trim_metrics
from dflash.runs.rundir import (
    ABANDONED_STEM,
    DRAFTER_DIR,
    HELDOUT_NAME,
    META_NAME,
    METRICS_NAME,
    REPLACED_STEM,
    REPORT_DIR,
    STATE_JSON,
    TENSORBOARD_DIR,
    CheckpointError,
    RunDirError,
    aside_path,
    checkpoint_step,
    checkpoints_dir,
    linked_checkpoints,
    list_checkpoints,
)
from dflash.runs.verify import checkpoint_problem, meta_or_problem, read_meta, verify_checkpoint

if TYPE_CHECKING:
    from dflash.config import RunConfig


def resolve_resume(output_dir: str | Path, resume: str, deep: bool = True, log=print) -> Path:
    """`latest` or a checkpoint folder -> the verified folder to load. Raises RunDirError or CheckpointError.

    `latest` is the newest checkpoint that verifies (`checkpoint_problem`); newer ones that do not are
    named in one line through `log`, with the reason. A folder given by path must verify itself.
    """
    if resume != "latest":
        path = Path(resume)
        if not (path / META_NAME).exists():
            raise RunDirError(f"--resume {resume}: not a checkpoint folder (no {META_NAME}); use --resume latest")
        return verify_checkpoint(path, deep)
    found = list_checkpoints(output_dir)
    links = linked_checkpoints(output_dir)
    if links:
        log(f"--resume latest: ignored {', '.join(p.name for p in links)} in {checkpoints_dir(output_dir)}: "
            "symlinks, not checkpoints this run wrote (only real folders there are resumed)")
    if not found:
        raise RunDirError(f"--resume latest: no checkpoint in {checkpoints_dir(output_dir)}; use --fresh")
    skipped: list[str] = []
    for path in reversed(found):
        problem = checkpoint_problem(path, deep)
        if problem is None:
            if skipped:
                log(f"--resume latest: skipped {'; '.join(skipped)}; resuming {path.name} (step {checkpoint_step(path)})")
            return path
        skipped.append(f"{path.name} ({problem})")
    raise CheckpointError(f"--resume latest: no checkpoint in {checkpoints_dir(output_dir)} verifies: "
                          f"{'; '.join(skipped)}; start over with --fresh")


def prepare_output_dir(cfg: RunConfig, resume: str | None, fresh: bool, log=print,
                       allow_schedule_change: bool = False, apply: bool = True) -> Path | None:
    """Enforce the explicit resume/fresh rule before anything is loaded. Returns the checkpoint to resume, or None.

    - checkpoints in the run dir and neither --resume nor --fresh: RunDirError (nobody guesses);
    - --resume: the checkpoint must verify, sizes and sha256 (`resolve_resume`: `latest` skips damaged
      newer ones and says so; CheckpointError when none verifies); a resume that would change the lr
      schedule (dflash.data.plan.schedule_change) is refused unless allow_schedule_change, and the change is printed.
    Nothing in the run dir moves before every refusal above has been decided; with apply=False nothing
    moves at all (the caller runs the gate first, then `make_room`).
    """
    out = Path(cfg.output_dir)
    existing = list_checkpoints(out)
    if resume and fresh:
        raise RunDirError("--resume and --fresh exclude each other; pick one")
    if existing and not resume and not fresh:
        newest = existing[-1]
        raise RunDirError(f"{cfg.output_dir} already holds checkpoints (newest {newest.name}, step "
                          f"{checkpoint_step(newest)}); say --resume latest to continue it or --fresh to start over")
    path = None
    if resume:
        path = resolve_resume(out, resume, deep=True, log=log)
        step = _step_of(path)
        change = resume_schedule_change(path, cfg)
        if change and not allow_schedule_change:
            raise RunDirError(f"--resume {path.name} (step {step}) would change the lr schedule: {change}; "
                              "pass --allow-schedule-change to accept it, or restore the checkpoint's settings")
        if change:
            log(f"--allow-schedule-change: resuming {path.name} (step {step}) with a new lr schedule: {change}")
    if apply:
        make_room(cfg, path, fresh, log)
    return path


def resume_record(path: str | Path) -> tuple[dict | None, dict | None]:
    """(meta.json, trainer state JSON) of a checkpoint, each None when unreadable: what the schedule rule reads."""
    meta, _ = meta_or_problem(Path(path))
    try:
        state = json.loads((Path(path) / STATE_JSON).read_text())
    except (OSError, ValueError):
        state = None
    return meta, state if isinstance(state, dict) else None


def resume_schedule_change(path: str | Path, cfg: RunConfig) -> str | None:
    """How resuming checkpoint `path` under `cfg` changes the lr schedule (dflash.data.plan.schedule_change)."""
    from dflash.data.plan import schedule_change  # numpy + pyarrow: only when a resume is decided

    return schedule_change(*resume_record(path), cfg)


def _step_of(path: Path) -> int:
    step = checkpoint_step(path)
    if step is None:  # a checkpoint folder given by path under another name: its meta says the step
        step = int(read_meta(path).get("step") or 0)
    return step


def make_room(cfg: RunConfig, resume_from: Path | None, fresh: bool, log=print) -> None:
    """What the decided resume/fresh intent moves, once the run may start (nothing is deleted):

    - resuming: newer checkpoints move aside so `latest` stays this run's, and metrics rows after its
      step move to metrics.abandoned-*.jsonl;
    - --fresh: the old checkpoints, metrics, final drafter, held-out ids, report and tensorboard events move to
      replaced-*/ (a new run's curves never mix with the old one's).
    """
    out = Path(cfg.output_dir)
    if resume_from is not None:
        step = _step_of(resume_from)
        newer = [c for c in list_checkpoints(out) if checkpoint_step(c) > step]
        if newer and resume_from.parent == checkpoints_dir(out):
            aside = aside_path(out, ABANDONED_STEM)
            aside.mkdir()
            for c in newer:
                c.rename(aside / c.name)
            log(f"--resume {resume_from.name}: {len(newer)} newer checkpoint(s) moved to {aside}, so `latest` "
                "stays this run's (nothing deleted)")
        trim_metrics(out, step, log)
    elif fresh:
        leftovers = [p for p in (checkpoints_dir(out), out / METRICS_NAME, out / DRAFTER_DIR, out / HELDOUT_NAME,
                                 out / REPORT_DIR, out / TENSORBOARD_DIR) if p.exists()]
        if leftovers:
            aside = aside_path(out, REPLACED_STEM)
            aside.mkdir()
            for p in leftovers:
                p.rename(aside / p.name)
            log(f"--fresh: previous {', '.join(p.name for p in leftovers)} moved to {aside} (nothing deleted)")
