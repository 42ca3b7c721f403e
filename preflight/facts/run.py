"""The run's own places: its output dir and finished checkpoints (judged by dflash.runs.rundir's rules), the disk
under it, and the target's shape the memory model needs."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from dflash.config import ConfigError, RunConfig, resolve_target_dir
from dflash.errors import DflashError
from dflash.memory.shape import TargetShape, load_target_shape
from dflash.models import smollm2
from dflash.models.custom_code import folder_problem
from dflash.runs import rundir
from dflash.runs.resume import resume_data_restart, resume_schedule_change
from dflash.runs.verify import checkpoint_problem, meta_or_problem


@dataclass
class Checkpoint:
    step: int
    path: str
    meta: dict | None = None
    error: str | None = None  # why a resume would refuse it (dflash.runs.verify.checkpoint_problem)
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
    # why resuming it restarts the epoch from its first batch (dflash.runs.resume.data_restart), None when the
    # position is kept; data_known False when the dataset could not be read (the dataset check says why)
    data_restart: str | None = None
    data_known: bool = False

    @property
    def newest(self) -> Checkpoint | None:
        return self.checkpoints[-1] if self.checkpoints else None


@dataclass
class Disk:
    path: str
    free_bytes: int | None = None
    error: str | None = None
    output_dir: str = ""
    # what in the run dir could be deleted to free space: (name in it, bytes, what it is) (dflash.runs.rundir.leftovers)
    leftovers: list[tuple[str, int, str]] = field(default_factory=list)


def dir_size(path: Path, max_entries: int = 50_000) -> int:
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


def run_dir(output_dir: str, deep: bool = False, config: RunConfig | None = None) -> RunDir:
    """The run dir and its finished checkpoints, judged by dflash.runs.rundir's rules (the ones `--resume` applies).

    Every checkpoint's files are checked against the sizes meta.json recorded; with ``deep`` (--verify-data)
    also their sha256, newest first until one verifies (the one `--resume latest` would load). With the run's
    config, also how resuming that checkpoint changes the lr schedule and whether it keeps the data position:
    the trainer's own rules (dflash.runs.resume), asked here.
    """
    path = Path(output_dir)
    problem = rundir.write_problem(path)
    rd = RunDir(str(path), path.is_dir(), problem is None, problem, deep=deep)
    for d in rundir.list_checkpoints(path):
        ck = Checkpoint(rundir.checkpoint_step(d), str(d))
        ck.meta, ck.error = meta_or_problem(d)
        if ck.error is None:
            ck.error = checkpoint_problem(d, meta=ck.meta)
        rd.checkpoints.append(ck)
    if deep:
        for ck in reversed(rd.checkpoints):
            if ck.error is None:
                ck.error = checkpoint_problem(ck.path, deep=True, meta=ck.meta)
                if ck.error is None:
                    break
    if rd.checkpoints:
        rd.checkpoints[-1].size_bytes = dir_size(Path(rd.checkpoints[-1].path))
    usable = [c for c in rd.checkpoints if c.meta is not None and not c.error]
    if config is not None and usable:
        rd.schedule_change = resume_schedule_change(usable[-1].path, config)
        try:
            rd.data_restart, rd.data_known = resume_data_restart(usable[-1].path, config), True
        except (DflashError, OSError):  # a dataset that cannot be read: the gate's dataset check says why
            pass
    return rd


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


def target_custom_code(cfg: RunConfig) -> str | None:
    """Why the target folder would be refused for needing its own code (dflash.models.custom_code's rule, judged
    against the installed transformers' files, torch-free), or None."""
    if smollm2.is_embedded(cfg.target.path):
        return None
    return folder_problem(resolve_target_dir(cfg.target.path))
