"""The run dir: its layout, its checkpoints, and the explicit resume/fresh rule. Torch-free.

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
        running.json                pid and host of the process training now (removed when it returns;
                                    left behind by a crash or a kill, with the error when there was one)
        .lock                       the run dir's exclusive lock (`lock_run_dir`): flock'ed by the one trainer
                                    using the dir, with its pid, host and start time; removed when it returns
        report/                     dflash-report's HTML and PNGs
        tensorboard/                --report-to tensorboard's event files
        checkpoints.abandoned-*/, replaced-*/, metrics.abandoned-*.jsonl   moved aside, never deleted

This module is the only place that knows these names: the trainer (``dflash.runs.checkpoint``,
``dflash.train.trainer``), ``dflash-train``'s resume/fresh rule and preflight's `run-dir` facts all use
it, so a checkpoint the trainer would refuse is one preflight refuses too.

Verifying a checkpoint (`checkpoint_problem`): every file a resume loads is there, and each file
recorded in meta.json has its recorded size (a stat: instant); ``deep`` also compares each file's
sha256 with the recorded one (reads every byte: ~1 s per GB here, see bench/README.md). A resume
reads every byte anyway, so `--resume` verifies deep; preflight checks sizes unless asked for
``--verify-data``. `--resume latest` takes the newest checkpoint that verifies and says which newer
ones it skipped and why.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dflash.data.jsonl import JsonLineError, decode_json, text_lines
from dflash.errors import DflashError, UsageError
from dflash.filehash import sha256_files

if TYPE_CHECKING:
    from dflash.config import RunConfig

CONFIG_NAME = "config.json"
PREFLIGHT_NAME = "preflight.json"
METRICS_NAME = "metrics.jsonl"
DRAFTER_DIR = "drafter"
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
LOCK_NAME = ".lock"  # flock'ed by the trainer using the run dir (`lock_run_dir`)
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
    it is). Unfinished saves (``checkpoints/*.tmp``, left by a crash mid-save) and what a resume or --fresh moved
    aside (never deleted by us)."""
    out = Path(output_dir)
    found = [(p, "an unfinished save") for p in sorted(checkpoints_dir(out).glob(f"{STEP_PREFIX}*{TMP_SUFFIX}"))]
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


# ---------------------------------------------------------------- the resume/fresh rule


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
            aside = _aside(out, ABANDONED_STEM)
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
            aside = _aside(out, REPLACED_STEM)
            aside.mkdir()
            for p in leftovers:
                p.rename(aside / p.name)
            log(f"--fresh: previous {', '.join(p.name for p in leftovers)} moved to {aside} (nothing deleted)")


# ---------------------------------------------------------------- metrics.jsonl

MAX_STEP = 1 << 53  # a step beyond this is not one a run logged (floats stop counting exactly)
GPU_MAP_KEYS = ("nvml_used_gib",)  # {GPU name: GiB}
LIST_KEYS = ("acc_slot", "heldout_acc_slot")  # per-slot numbers


@dataclass
class Metrics:
    """The rows of a metrics.jsonl that a reader can trust, and what was left out of it."""

    rows: list[dict] = field(default_factory=list)
    torn: int = 0  # a last line cut by a kill (no line end, not JSON)
    bad: int = 0  # rows skipped: not JSON, not an object, no integer step, a malformed known key
    first_bad: str | None = None  # "line L, reason"

    def note(self, path: str | Path) -> str | None:
        """'skipped N bad metrics rows in FILE (first: line L, reason)', or None when every row was good."""
        if not self.bad:
            return None
        return f"skipped {self.bad} bad metrics row(s) in {path} (first: {self.first_bad})"


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def metrics_row_problem(row: object) -> str | None:
    """Why a decoded metrics row cannot be used (one short reason), or None. Values of other keys may be anything;
    readers take the finite numbers among them."""
    if not isinstance(row, dict):
        return f"a {type(row).__name__}, not a JSON object"
    step = row.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        return f"step {_shown(step)} is not an integer in 0..2^53"
    for key in GPU_MAP_KEYS:
        v = row.get(key)
        if v is not None and not (isinstance(v, dict) and all(_number(x) for x in v.values())):
            return f"{key} {_shown(v)} is not {{GPU: GiB}} with finite numbers"
    for key in LIST_KEYS:
        v = row.get(key)
        if v is not None and not (isinstance(v, list) and all(_number(x) for x in v)):
            return f"{key} {_shown(v)} is not a list of finite numbers"
    return None


def _shown(v) -> str:
    text = json.dumps(v) if not isinstance(v, float) else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def read_metrics(output_dir: str | Path) -> Metrics:
    """Every good row of a run's metrics.jsonl (lines end at "\\n" only); the rest counted, never raised."""
    out = Metrics()
    path = Path(output_dir) / METRICS_NAME
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return out
    lines = list(text_lines(text))
    for lineno, line in lines:
        if not line.strip():
            continue
        try:
            row = decode_json(line)
        except JsonLineError as e:
            if lineno == len(lines) and not text.endswith("\n"):
                out.torn += 1  # a line cut by a kill
                continue
            row, why = None, f"not JSON ({e})"
        else:
            why = metrics_row_problem(row)
        if why is None:
            out.rows.append(row)
            continue
        out.bad += 1
        out.first_bad = out.first_bad or f"line {lineno}, {why}"
    return out


def trim_metrics(out: Path, step: int, log=print) -> None:
    """Rows logged after the resumed step (the interrupted run's) move to metrics.abandoned-*.jsonl,
    so metrics.jsonl holds each step once after the resume."""
    path = Path(out) / METRICS_NAME
    if not path.is_file():
        return
    keep, later = [], []
    pieces = path.read_bytes().decode("utf-8", errors="replace").split("\n")  # lines end at "\\n" only
    for line in [p + "\n" for p in pieces[:-1]] + [pieces[-1]] * bool(pieces[-1]):
        try:
            row = decode_json(line)
        except JsonLineError:
            row = None  # a torn last line of a killed run, a bad row: keep it where it was logged
        row_step = row["step"] if metrics_row_problem(row) is None else 0
        (later if row_step > step else keep).append(line)
    if not later:
        return
    aside = Path(out) / f"{_aside(Path(out), METRICS_ABANDONED_STEM).name}.jsonl"
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


class RunLock:
    """The run dir's exclusive lock, held by this process (`lock_run_dir`): an flock on ``<output_dir>/.lock``.

    The kernel releases it when the process dies, however it dies; `release` (or leaving a ``with`` block) also
    removes the file, so a lock file whose flock is free is a killed or crashed trainer's leftover.
    """

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd
        _HELD.append(self)

    def fileno(self) -> int:
        return self.fd

    def release(self) -> None:
        if self.fd < 0:
            return
        import fcntl

        try:
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                self.path.unlink()  # before the unlock: whoever locks the old file next sees it is gone and retries
        except OSError:  # gone already, or a read-only disk: the flock still goes with the close
            pass
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1
        if self in _HELD:
            _HELD.remove(self)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


_HELD: list[RunLock] = []  # the locks this process holds (release_held_locks before an os._exit)


def release_held_locks() -> None:
    """Release every run-dir lock this process holds: for exits that skip atexit (os._exit of a rank)."""
    for lock in list(_HELD):
        lock.release()


def _lock_owner(fd: int) -> dict:
    try:
        owner = json.loads(os.pread(fd, 4096, 0).decode(errors="replace"))
    except ValueError:
        return {}
    return owner if isinstance(owner, dict) else {}


def lock_run_dir(output_dir: str | Path, log=print) -> RunLock:
    """Take the run dir's exclusive lock before anything in it is judged or moved; hold it while training.

    Raises RunDirBusyError (one line naming the live process: pid, host, since when) when another process holds
    it. A lock file left by a process that died (the kernel freed its flock) is taken over, and `log` says so.
    Creates output_dir. Under torchrun only the process that prepares the run dir (rank 0) takes it.
    """
    import fcntl
    import socket

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _lock_owner(fd)
                who = (f"pid {owner.get('pid')} on {owner.get('host')} since {owner.get('time')}" if owner.get("pid")
                       else "a process that is still starting")
                raise RunDirBusyError(f"{out} is in use by another trainer ({who}); wait for it to finish or stop it, "
                                      "or set another output_dir") from None
            try:
                current = os.stat(path).st_ino
            except FileNotFoundError:
                current = None
            if current != os.fstat(fd).st_ino:  # released and removed by its holder while we opened it: again
                os.close(fd)
                continue
            stale = _lock_owner(fd)
            if stale.get("pid"):
                log(f"{path}: took over the lock of pid {stale.get('pid')} on {stale.get('host')} (since "
                    f"{stale.get('time')}), which no longer holds it (killed or crashed)")
            owner = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        return RunLock(path, fd)


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
