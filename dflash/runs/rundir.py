"""The run dir: its layout, names and listing, markers and the best link (the resume/fresh rule: dflash.runs.resume;
verification: dflash.runs.verify; the lock: dflash.runs.lock; metrics.jsonl: dflash.runs.metrics). Torch-free.

    <output_dir>/
        config.json                 the resolved run config, written when a run starts
        preflight.json              the gate's report for this run
        snapshot.json, outcome.json what the run started with and how it went (dflash.runs.records; dflash-diff)
        previous/<time>-<gate>/     an earlier run's snapshot.json and outcome.json, moved aside
        metrics.jsonl               one JSON row per logged step
        drafter/                    the final drafter (HF folder, bf16, target's tokenizer), written when the run finishes
        checkpoints/step_<8 digits>/
            meta.json               step, resolved config, dataset identity, provenance (written last)
            drafter/                HF folder (config.json + model.safetensors + dflash.py), loadable on its own
            optimizer.pt            AdamW state (tensors only: loaded with weights_only=True)
            trainer_state.json      step, sampler position, ... (plain JSON)
            trainer_state.safetensors   the trainer state's tensors (RNG states)
        checkpoints/step_<8 digits>.tmp/      a save in progress (never listed)
        checkpoints/best            symlink to the step_* folder with the best held-out acceptance (replaced
                                    atomically; keep_last never prunes its target); one leading out of
                                    checkpoints/ is never followed
        (only real step_* folders count: a symlink named step_* is never listed, resumed or pruned through,
        and a folder whose meta.json names another step than its name does not verify)
        heldout.json                the held-out sample ids ([eval] holdout) the run never trains on
        fla_choices.json            what fla's autotuning chose in the first step, where it tuned (a hybrid target
                                    on a GPU): `python -m dflash.train.fla_choices` keeps it for its GPU model
        running.json                pid and host of the process training now (removed when it returns;
                                    left behind by a crash or a kill, with the error when there was one)
        .lock                       the run dir's exclusive lock (`dflash.runs.lock.lock_run_dir`): flock'ed by the one trainer
                                    using the dir, with its pid, host and start time; removed when it returns
        report/                     dflash-report's HTML and PNGs
        tensorboard/                --report-to tensorboard's event files
        checkpoints.abandoned-*/, replaced-*/, metrics.abandoned-*.jsonl   moved aside, never deleted

This module is the only place that knows these names, and lists the run dir's checkpoints; it also owns the run
dir's markers (stopped.json, running.json), the best link, the moved-aside names and the one-line disk errors. The
other jobs live beside it, one module each: verifying a checkpoint (dflash.runs.verify), the lock
(dflash.runs.lock), metrics.jsonl (dflash.runs.metrics) and the resume/fresh rule (dflash.runs.resume). The trainer
(``dflash.runs.checkpoint``, ``dflash.train.trainer``), ``dflash-train`` and preflight's `run-dir` facts all use
them, so a checkpoint the trainer would refuse is one preflight refuses too.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from dflash.data.jsonl import JsonLineError, decode_json
from dflash.errors import DflashError, UsageError

CONFIG_NAME = "config.json"
PREFLIGHT_NAME = "preflight.json"
METRICS_NAME = "metrics.jsonl"
DRAFTER_DIR = "drafter"
DRAFTER_TMP = "drafter.tmp"  # the final export while it is written; renamed to DRAFTER_DIR when complete
STOPPED_NAME = "stopped.json"
# dflash-train's exit code when a signal stopped the run after a checkpoint (sysexits EX_TEMPFAIL: try again
# later): a scheduler resubmits with --resume latest; 0 means the run finished, 1 a failure, 2 bad input.
EXIT_STOPPED = 75
MIN_FREE_BYTES = 1 << 20  # below this a run cannot even write its report and config: the output dir is full
CHECKPOINTS_DIR = "checkpoints"
BEST_NAME = "best"  # inside CHECKPOINTS_DIR: a relative symlink to a step_* folder
HELDOUT_NAME = "heldout.json"
RUNNING_NAME = "running.json"
RANKS_NAME = "ranks.json"  # the split launcher's rank plan (which GPU holds which role)
LOCK_NAME = ".lock"  # flock'ed by the trainer using the run dir (dflash.runs.lock.lock_run_dir)
FLA_CHOICES_NAME = "fla_choices.json"  # what fla tuned in the first step (dflash.models.fla_tuning.keep_tuned)
REPORT_DIR = "report"
TENSORBOARD_DIR = "tensorboard"  # --report-to tensorboard's event files
STEP_PREFIX = "step_"
TMP_SUFFIX = ".tmp"
# What make_room moves aside (never deletes), each with a time stamp: <stem>-YYYYmmdd-HHMMSS[.n]
ABANDONED_STEM = "checkpoints.abandoned"  # checkpoints newer than the one a resume took
REPLACED_STEM = "replaced"  # what a --fresh start replaced
METRICS_ABANDONED_STEM = "metrics.abandoned"  # metrics rows after the resumed step (a .jsonl file)

# Inside one checkpoint folder.
META_NAME = "meta.json"
WEIGHTS_NAME = "model.safetensors"  # inside DRAFTER_DIR
OPTIMIZER_NAME = "optimizer.pt"
STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
LEGACY_STATE = "trainer_state.pt"  # the pickled state of older versions: never loaded
CHECKPOINT_FILES = (META_NAME, f"{DRAFTER_DIR}/{WEIGHTS_NAME}", OPTIMIZER_NAME, STATE_JSON, STATE_TENSORS)
FILES_KEY = "files"  # meta.json: {path inside the checkpoint: {"bytes": size, "sha256": hex}}, all but meta.json


class RunDirError(UsageError):
    """--resume/--fresh that do not fit the run dir; the message is one line naming the fix (exit 2)."""


class RunDirBusyError(UsageError):
    """Another live trainer holds the run dir's lock; the message is one line naming it (exit 2)."""


class RunIOError(DflashError):
    """The run dir's disk failed a write mid-run (full, read-only, I/O error); one line naming the path and the fix."""


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

    Only real folders directly inside ``checkpoints/`` count: a symlink there (to another run's checkpoint, say) is
    never listed, so it is never resumed, counted by keep_last, or deleted through. Saves in progress (``*.tmp``)
    and any other folder are ignored.
    """
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if checkpoint_step(p) is not None and not p.is_symlink() and p.is_dir()
            and (p / META_NAME).exists()]
    return sorted(done, key=checkpoint_step)


def linked_checkpoints(output_dir: str | Path) -> list[Path]:
    """``step_*`` names in ``checkpoints/`` that are symlinks: never this run's checkpoints (`list_checkpoints`)."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if checkpoint_step(p) is not None and p.is_symlink()), key=checkpoint_step)


def write_problem(output_dir: str | Path) -> str | None:
    """Why a run cannot write its output dir (None when it can): its nearest existing folder is not a
    folder, is on a read-only file system, or is not writable by this user; or no space is left there."""
    path = Path(output_dir)
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            return f"no existing parent of {path}"
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} exists and is not a directory"
    for folder in (probe, checkpoints_dir(path)):
        if not folder.is_dir():
            continue
        try:
            st = os.statvfs(folder)
        except OSError as e:
            return f"cannot inspect {folder} ({e.strerror})"
        if st.f_flag & os.ST_RDONLY:
            return f"{folder} is on a read-only file system"
        if not os.access(folder, os.W_OK | os.X_OK):
            return f"{folder} is not writable by this user"
        free = st.f_bavail * st.f_frsize
        if free < MIN_FREE_BYTES:
            return f"no space left on the file system of {folder} ({free:,} bytes free)"
    return None


def leftovers(output_dir: str | Path) -> list[tuple[str, int, str]]:
    """What in the run dir could be deleted to free space, largest first: (name relative to the run dir, bytes, what
    it is). Unfinished saves (``checkpoints/*.tmp``, left by a crash mid-save), an unfinished export (``drafter.tmp``)
    and what a resume or --fresh moved aside (never deleted by us)."""
    out = Path(output_dir)
    found = [(p, "an unfinished save") for p in sorted(checkpoints_dir(out).glob(f"{STEP_PREFIX}*{TMP_SUFFIX}"))]
    found += [(p, "an unfinished export") for p in [out / DRAFTER_TMP] if p.exists()]
    for stem, what in ((ABANDONED_STEM, "moved aside by a resume"), (REPLACED_STEM, "moved aside by --fresh"),
                       (METRICS_ABANDONED_STEM, "metrics rows moved aside by a resume")):
        found += [(p, what) for p in sorted(out.glob(f"{stem}-*"))]
    sized = [(p.relative_to(out).as_posix(), _bytes_under(p), what) for p, what in found if not p.is_symlink()]
    return sorted(sized, key=lambda t: -t[1])


def describe_leftovers(found: list[tuple[str, int, str]], where: str | Path, limit: int = 3) -> str:
    """`leftovers` (names relative to the run dir) in a few words, largest first; ``""`` when there are none. What
    a full disk's fix names, here and in preflight's disk check."""
    if not found:
        return ""
    found = sorted(found, key=lambda t: -t[1])
    listed = ", ".join(f"{name} {size_text(n)} ({what})" for name, n, what in found[:limit])
    more = f" and {len(found) - limit} more" if len(found) > limit else ""
    return f"{size_text(sum(n for _, n, _ in found))} reclaimable in {where}: {listed}{more}"


def size_text(n: int | float) -> str:
    """GiB, or MiB below one GiB (a tiny run's checkpoints read as 0.0 GiB otherwise)."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _bytes_under(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


# The errors a run's writes meet when its disk fails it, and what to do about each.
IO_FIXES = {
    "ENOSPC": "free space on that file system (df -h) or move output_dir to a larger disk",
    "EDQUOT": "your disk quota there is used up: free some of it or move output_dir",
    "EFBIG": "a file size limit was reached (ulimit -f, or the file system's maximum): raise it or move output_dir",
    "EROFS": "the file system turned read-only (often after disk errors): check the disk (dmesg) and remount it",
    "EIO": "the disk reported an I/O error: check it (dmesg, smartctl) before writing there again",
    "EACCES": "check who may write there (ls -ld) or set output_dir to a folder you own",
    "EPERM": "check who may write there (ls -ld) or set output_dir to a folder you own",
}


def io_cause(err: BaseException) -> OSError | None:
    """The OSError behind a failed write: `err` itself, one in its chain (torch.save wraps it in a RuntimeError), or
    the ``(os error N)`` safetensors names in its message; None when it was not the disk."""
    import errno as errnos
    import re

    seen = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen
        found = re.search(r"\(os error (\d+)\)", str(seen))
        if found and int(found.group(1)) in errnos.errorcode:
            n = int(found.group(1))
            return OSError(n, os.strerror(n))
        seen = seen.__cause__ or seen.__context__
    return None


def io_failure(err: OSError, output_dir: str | Path, where: str | Path | None = None) -> str | None:
    """One line for an OSError of the disk mid-run: the path, the error, the fix, the checkpoint to resume from;
    None for an OSError that is not one of IO_FIXES' (the caller lets it through)."""
    import errno as errnos

    name = errnos.errorcode.get(err.errno or 0, "")
    if name not in IO_FIXES:
        return None
    path = err.filename or where or output_dir
    try:
        kept = list_checkpoints(output_dir)
    except OSError:
        kept = []
    resume = (f"the last checkpoint {kept[-1].name} is intact: resume with --resume latest" if kept
              else "no checkpoint was written yet: start again with --fresh")
    fix = IO_FIXES[name]
    if name in ("ENOSPC", "EDQUOT"):
        try:
            spare = describe_leftovers(leftovers(output_dir), output_dir)
        except OSError:
            spare = ""
        fix += f" ({spare}, yours to delete)" if spare else ""
    return f"{path}: {err.strerror or os.strerror(err.errno)} ({name}); {fix}; then {resume}"


@contextlib.contextmanager
def io_errors_in_one_line(output_dir: str | Path):
    """Turn a disk's failure inside the block (a full, read-only or failing disk) into one RunIOError line."""
    try:
        yield
    except OSError as e:
        line = io_failure(e, output_dir)
        if line is None:
            raise
        raise RunIOError(line) from None


# ---------------------------------------------------------------- a run stopped by a signal


def write_stopped(output_dir: str | Path, signame: str, step: int, checkpoint: str | Path | None) -> Path:
    """Mark the run dir as stopped by a signal (the trainer, at a signal stop); `clear_stopped` unmarks it."""
    path = Path(output_dir) / STOPPED_NAME
    tmp = path.with_name(f".{STOPPED_NAME}.tmp")
    tmp.write_text(json.dumps({"signal": signame, "step": step, "checkpoint": str(checkpoint) if checkpoint else None,
                               "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "exit_code": EXIT_STOPPED}) + "\n")
    tmp.replace(path)
    return path


def read_json_object(path: str | Path) -> dict | None:
    """A JSON object file of a run dir, or None when it is missing, unreadable, not JSON or not an object."""
    try:
        data = decode_json(Path(path).read_bytes())
    except (OSError, JsonLineError):
        return None
    return data if isinstance(data, dict) else None


def read_stopped(output_dir: str | Path) -> dict | None:
    """The stop marker of the last run, or None when it finished, failed, or has not run."""
    return read_json_object(Path(output_dir) / STOPPED_NAME)


def clear_stopped(output_dir: str | Path) -> None:
    (Path(output_dir) / STOPPED_NAME).unlink(missing_ok=True)


def aside_path(out: Path, stem: str) -> Path:
    """A new, unused folder name under the run dir for things moved out of the way."""
    base = out / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        path, n = base.with_name(f"{base.name}.{n}"), n + 1
    return path


# ---------------------------------------------------------------- the best checkpoint


def best_or_problem(output_dir: str | Path) -> tuple[Path | None, str | None]:
    """(the finished checkpoint `checkpoints/best` points to, None), or (None, why it points nowhere usable); (None,
    None) without a pointer. It must name a real ``step_*`` folder directly inside this run's ``checkpoints/``:
    a pointer leading anywhere else (another run's checkpoint, a symlink chain) is never followed."""
    root = checkpoints_dir(output_dir)
    link = root / BEST_NAME
    try:
        target = os.readlink(link)
    except OSError:
        return None, None
    path = root / Path(target).name
    if os.path.realpath(link) != os.path.realpath(path) or path.is_symlink():
        return None, f"{link} points outside {root} (to {target})"
    if checkpoint_step(path) is None or not (path / META_NAME).is_file():
        return None, f"{link} points to {target}, not a finished checkpoint"
    return path, None


def best_checkpoint(output_dir: str | Path) -> Path | None:
    """The finished checkpoint `checkpoints/best` points to inside this run dir, or None (`best_or_problem`)."""
    return best_or_problem(output_dir)[0]


def set_best(output_dir: str | Path, checkpoint: str | Path) -> Path:
    """Point `checkpoints/best` at a checkpoint folder of this run, atomically: a new relative symlink is
    renamed over the old one, so a kill at any instant leaves the old pointer or the new one, never none."""
    root = checkpoints_dir(output_dir)
    name = Path(checkpoint).name
    if checkpoint_step(name) is None or not (root / name / META_NAME).is_file():
        raise CheckpointError(f"{checkpoint}: not a finished checkpoint of {root}; best points at step_* folders only")
    for stale in root.glob(f".{BEST_NAME}.*{TMP_SUFFIX}"):  # this process's, or one a kill left mid-update
        stale.unlink(missing_ok=True)
    tmp = root / f".{BEST_NAME}.{os.getpid()}{TMP_SUFFIX}"
    os.symlink(name, tmp)
    os.replace(tmp, root / BEST_NAME)
    try:
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # a filesystem that cannot sync a directory: the rename is atomic all the same
        pass
    return root / BEST_NAME


# ---------------------------------------------------------------- a run in progress


def write_running(output_dir: str | Path, **extra) -> Path:
    """Mark the run dir as being trained by this process (dflash-report tells running from crashed by it)."""
    import socket

    path = Path(output_dir) / RUNNING_NAME
    tmp = path.with_name(f".{RUNNING_NAME}.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                               "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **extra}) + "\n")
    tmp.replace(path)
    return path


def read_running(output_dir: str | Path) -> dict | None:
    return read_json_object(Path(output_dir) / RUNNING_NAME)


def clear_running(output_dir: str | Path) -> None:
    (Path(output_dir) / RUNNING_NAME).unlink(missing_ok=True)
