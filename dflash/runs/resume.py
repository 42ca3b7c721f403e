"""The resume/fresh rule, torch-free: which checkpoint `--resume` takes, what may change between it and the resumed
run, what happens to the data position, and what a decided intent moves aside. `dflash-train`, `dflash-torchrun`,
the demo, the trainer's resume (`incompatible`, `restore_position`) and preflight's run-dir check all ask it, so
the gate's verdict is what the trainer then does (tests/test_resume_rule.py).

    incompatible(path, meta, cfg, target_layers)   # "--resume: step_00000004 (step 4) is incompatible ..." | None
    data_restart(meta["dataset"], dataset)         # "dataset changed since the checkpoint: 64 -> 80 samples" | None

`--resume latest` takes the newest checkpoint that verifies (dflash.runs.verify) and says which newer ones it
skipped and why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from dflash.config import default_target_layer_ids
from dflash.models.smollm2 import is_embedded, local_folder
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


# ---------------------------------------------------------------- what a resume may change, and the data position
#
# The one resume rule: preflight's run-dir check prints its verdict, the trainer applies the same one.
# - the settings that fix the drafter's weights or what they read (MODEL_FIELDS, and drafter.target_layer_ids
#   as resolved over the target's layers) may not change: `incompatible` says so in one line, preflight fails
#   with it and the trainer raises it before it loads the checkpoint's weights;
# - the lr schedule may change only with --allow-schedule-change (`resume_schedule_change`);
# - the data position (`data_restart`): the dataset fingerprint is the truth. The same shards moved to another
#   folder keep the sampler's position; other data (other shards, another holdout) restarts the checkpoint's
#   epoch from its first batch, said in one line, never refused for it (other data of another size can still
#   move the lr schedule: the rule above);
# - every other setting may change.

MODEL_FIELDS = (("drafter", "block_size"), ("drafter", "num_layers"), ("target", "path"))


def _default_layer_ids(target_layers: int | None, n: int) -> list[int] | None:
    """The target layers an empty drafter.target_layer_ids resolves to, or None when unknown (or when they cannot
    be spread over the target: preflight's config check says so)."""
    if target_layers is None:
        return None
    try:
        return default_target_layer_ids(target_layers, n)
    except ValueError:
        return None


def _same_target(old, new: str) -> bool:
    """Whether two target.path values name one target: the same words, or the same folder however it is spelled
    (relative or absolute, through a link), found as target.path is (dflash.models.smollm2.local_folder)."""
    if old == new:
        return True
    if not isinstance(old, str) or is_embedded(old) or is_embedded(new):
        return False
    return local_folder(old).resolve() == local_folder(new).resolve()


def model_changes(saved: dict, cfg: RunConfig, target_layers: int | None) -> list[str]:
    """The settings of MODEL_FIELDS and drafter.target_layer_ids that differ between a checkpoint's config (`saved`,
    its meta.json "config") and `cfg`, e.g. ["drafter.block_size 4 -> 8"]. Layer ids compare as resolved over the
    target's `target_layers` layers ([] and the same ids spelled out agree); with the layers unknown (None), a change
    between [] and a list is not named."""
    now = cfg.model_dump()
    out = []
    for section, key in MODEL_FIELDS:
        old = (saved.get(section) or {}).get(key)
        same = _same_target(old, now[section][key]) if (section, key) == ("target", "path") else old == now[section][key]
        if not same:
            out.append(f"{section}.{key} {old!r} -> {now[section][key]!r}")
    old_ids = (saved.get("drafter") or {}).get("target_layer_ids")
    new_ids = cfg.drafter.target_layer_ids
    if old_ids != new_ids:
        n = cfg.drafter.num_layers
        resolved_old = old_ids or _default_layer_ids(target_layers, n)
        resolved_new = new_ids or _default_layer_ids(target_layers, n)
        if resolved_old is not None and resolved_new is not None and resolved_old != resolved_new:
            out.append(f"drafter.target_layer_ids {old_ids!r} -> {new_ids!r}")
    return out


def incompatible(path: str | Path, meta: dict, cfg: RunConfig, target_layers: int | None) -> str | None:
    """Why checkpoint `path` (its meta.json `meta`) cannot be resumed under `cfg` (`model_changes`), in one line, or
    None: "--resume: step_00000004 (step 4) is incompatible with this config: drafter.block_size 4 -> 8"."""
    bad = model_changes(meta.get("config") or {}, cfg, target_layers)
    if not bad:
        return None
    step = meta.get("step") if meta.get("step") is not None else checkpoint_step(path)
    return f"--resume: {Path(path).name} (step {step}) is incompatible with this config: {', '.join(bad)}"


def incompatible_fix(where: str) -> str:
    """What to do about `incompatible`'s refusal; `where`: the run config's file."""
    return f"use --fresh, or restore those settings in {where}"


def data_restart(saved: dict | None, dataset) -> str | None:
    """Why the sampler's position inside the checkpoint's epoch means nothing under `dataset` (the samples the run
    trains on: dflash.data.plan.training_dataset), in one line, or None when the position is kept.

    `saved`: the checkpoint's meta.json "dataset" ({path, samples, fingerprint}). Only the fingerprint decides;
    the path is named beside a change, never one on its own.
    """
    old = saved or {}
    if old.get("fingerprint") == dataset.fingerprint:
        return None
    was = f"{old['samples']:,}" if isinstance(old.get("samples"), int) else "?"
    if old.get("samples") != dataset.num_samples:
        changes = [f"{was} -> {dataset.num_samples:,} samples"]
    elif old.get("fingerprint"):
        changes = [f"same {dataset.num_samples:,} samples but other shards (fingerprint {old['fingerprint']} -> "
                   f"{dataset.fingerprint})"]
    else:
        changes = ["the checkpoint records no dataset fingerprint"]
    if old.get("path") and old.get("path") != str(dataset.path):
        changes.append(f"path {old['path']} -> {dataset.path}")
    return f"dataset changed since the checkpoint: {'; '.join(changes)}"


def resume_data_restart(path: str | Path, cfg: RunConfig) -> str | None:
    """`data_restart` of checkpoint `path` under `cfg`, on the samples the trainer would train on. Raises
    DflashError when the dataset cannot be read (the gate's dataset check says why)."""
    from dflash.data.plan import training_dataset  # numpy + pyarrow: only when a resume is decided
    from dflash.data.shards import ShardDataset

    meta, _ = meta_or_problem(Path(path))
    return data_restart((meta or {}).get("dataset"), training_dataset(cfg, ShardDataset(cfg.data.path)))


def restore_position(sampler, dataset, state: dict, meta: dict, log=print) -> int:
    """Move the sampler to a checkpoint's consumed position; returns its step.

    If the data changed since the checkpoint (`data_restart`: another fingerprint), the position inside the
    epoch means nothing any more: the epoch restarts from its first batch, and that is said.
    """
    why = data_restart(meta.get("dataset"), dataset)
    if why is None:
        sampler.load_state_dict(state["sampler"])
    else:
        sampler.load_state_dict({"epoch": state["sampler"]["epoch"], "index": 0})
        log(f"{why}; epoch {state['sampler']['epoch']} restarts from its first batch")
    return int(state["step"])
