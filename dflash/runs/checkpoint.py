"""Checkpoints: atomic, self-describing, and never unpickled.

The folder layout and its names belong to ``dflash.runs.rundir``; this module writes and reads the
tensors. A save is written to ``step_X.tmp`` and renamed when complete, so a crash mid-save
leaves the previous checkpoint loadable; only the newest keep_last are kept, and the one
``checkpoints/best`` points to (``dflash.runs.rundir.set_best``). The final export is written the
same way: to ``drafter.tmp``, renamed to ``drafter`` when complete (``write_export``).

The trainer state is plain JSON (step, sampler position, ...) plus its tensors (RNG states) in
safetensors, and the optimizer state is loaded with ``weights_only=True``: loading a checkpoint
runs no code from it. A checkpoint of an older version (a pickled ``trainer_state.pt``) is
refused with a one-line CheckpointError, as is a missing or corrupt file. meta.json records the
size and sha256 of every other file of the checkpoint, so a resume can tell a damaged checkpoint
from an intact one before loading it (``dflash.runs.verify.checkpoint_problem``).

    path = save_checkpoint(out, step, drafter, optimizer, {"step": step, "sampler": {...}, "rng_cpu": t},
                           cfg, dataset_meta, keep_last, provenance=preflight.gate.provenance(cfg.profile))
    state, meta = load_checkpoint(path, drafter, optimizer, device)
    state = load_trainer_state(path)       # the state alone (split-run drafter ranks)
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.config import RunConfig
from dflash.filehash import sha256_file
from dflash.runs.rundir import (
    DRAFTER_DIR,
    DRAFTER_TMP,
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
    list_checkpoints,
)
from dflash.runs.verify import is_legacy, legacy_message, read_meta, resume_fix

FORMAT = 2  # meta.json "format": 2 = JSON + safetensors trainer state (1 was a pickled trainer_state.pt)


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


SAVE_DELAY_ENV = "DFLASH_SAVE_DELAY_S"  # tests only: seconds a save sleeps before its meta.json (a kill lands mid-write)


@dataclass
class Snapshot:
    """What one checkpoint holds, ready to be written: the step, the drafter (it writes its HF folder), and the
    weights, optimizer state and trainer state, either host copies (``HostCopies``) or the live tensors."""
    step: int
    drafter: object
    weights: dict | None  # host copies of drafter.state_dict(); None: the drafter's live parameters
    optimizer_state: dict
    trainer_state: dict


class HostCopies:
    """Host buffers a snapshot copies into, kept from one save to the next (pinned on CUDA: pinning memory is slow,
    copying into pinned memory is not). One snapshot at a time: a save waits for the previous one's write first.

    ``reserve`` pins the buffers of a drafter's and optimizer's CUDA state ahead, on a thread, while training goes
    on: pinned at the first save instead, they stalled it ~13 s for a 27B-class drafter's 19.5 GB on an H200 host.
    torch's pinned allocator rounds each buffer up to a power of two: the host memory held can reach about twice the
    checkpoint's size."""

    def __init__(self):
        self._buffers: dict = {}
        self._reserving: threading.Thread | None = None
        self.reserve_s: float | None = None  # how long the reservation took (None: none made)

    def copy(self, key, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            self._buffers[key] = buf
        buf.copy_(t, non_blocking=t.is_cuda)  # CUDA: queued; `snapshot` synchronizes once after all of them
        return buf

    def tree(self, key, value):
        """A copy of nested dicts/lists whose tensors are host copies and other values deep copies."""
        if isinstance(value, torch.Tensor):
            return self.copy(key, value)
        if isinstance(value, dict):
            return {k: self.tree((key, k), v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.tree((key, i), v) for i, v in enumerate(value))
        return copy.deepcopy(value)

    def reserve(self, drafter, optimizer) -> None:
        """Start pinning host buffers for every CUDA tensor the next snapshot of (drafter, optimizer) copies; a
        no-op off CUDA and once made. ``ready`` (called by ``snapshot``) waits for it."""
        if self._reserving is not None or self.reserve_s is not None:
            return
        specs = [(("weights", k), v) for k, v in drafter.state_dict().items()]
        specs += _tensors("optimizer", optimizer.state_dict())
        specs = [(key, t.shape, t.dtype) for key, t in specs if t.is_cuda]
        if specs:
            self._reserving = threading.Thread(target=self._pin, args=(specs,), name="dflash-host-reserve", daemon=True)
            self._reserving.start()

    def ready(self) -> float:
        """Wait for a reservation in flight; the seconds waited."""
        t0 = time.perf_counter()
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        return time.perf_counter() - t0

    def _pin(self, specs: list) -> None:
        """Each buffer as its own pinned tensor (torch's pinned allocator, the one the first save would otherwise call
        on the training thread): a buffer's storage is its tensor's alone, so a save writes the bytes a save on the
        training thread writes."""
        t0 = time.perf_counter()
        buffers = {}
        try:
            for key, shape, dtype in specs:
                buffers[key] = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)
        except RuntimeError:  # host memory that cannot be pinned now: the first snapshot pins per tensor, as before
            return
        self._buffers.update(buffers)
        self.reserve_s = round(time.perf_counter() - t0, 3)


def _tensors(key, value) -> list[tuple]:
    """(key, tensor) for every tensor of nested dicts/lists, keyed as ``HostCopies.tree`` keys them."""
    if isinstance(value, torch.Tensor):
        return [(key, value)]
    if isinstance(value, dict):
        return [kt for k, v in value.items() for kt in _tensors((key, k), v)]
    if isinstance(value, (list, tuple)):
        return [kt for i, v in enumerate(value) for kt in _tensors((key, i), v)]
    return []


def snapshot(step: int, drafter, optimizer, trainer_state: dict, host: HostCopies | None = None,
             full_state=None) -> Snapshot:
    """The state of checkpoint `step`. With `host`, copies that training may run on from (on CUDA: non-blocking
    copies into pinned buffers, then one synchronize, the only wait); without, the live tensors, to be written
    before the next step changes them. `full_state(keep) -> (weights, optimizer state)`: how a sharded drafter's
    full state is gathered, each tensor through `keep` (a host copy) as soon as it is whole; it is always copied."""
    if host is None and full_state is None:
        return Snapshot(step, drafter, None, optimizer.state_dict(), trainer_state)
    host = host or HostCopies()
    host.ready()
    if full_state is None:
        weights = {k: host.copy(("weights", k), v) for k, v in drafter.state_dict().items()}
        optimizer_state = host.tree("optimizer", optimizer.state_dict())
    else:
        weights, optimizer_state = full_state(host.copy)
    state = host.tree("trainer", trainer_state)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return Snapshot(step, drafter, weights, optimizer_state, state)


def save_checkpoint(output_dir: str | Path, step: int, drafter, optimizer, trainer_state: dict,
                    cfg: RunConfig, dataset_meta: dict, keep_last: int, provenance: dict | None = None) -> Path:
    """Write checkpoint `step` atomically and keep the newest keep_last (on this thread: ``CheckpointWriter`` writes
    on a background one).

    ``provenance``: what wrote it, e.g. ``preflight.gate.provenance(cfg.profile)``
    (``{"lock_sha256": ..., "git_commit": ...}``), recorded in meta.json as given.
    """
    return write_checkpoint(output_dir, snapshot(step, drafter, optimizer, trainer_state), cfg, dataset_meta,
                            keep_last, provenance)


class SaveCancelled(Exception):
    """A background save given up for a newer one (a stop's checkpoint supersedes a periodic save still writing)."""


HASH_BESIDE_BYTES = 1 << 20  # a write at least this large is hashed on another thread while it is written


class _HashingFile:
    """A file that hashes what is written through it (sha256, the recorded digest) as it is written, so a large file
    is not read back to be hashed, and that gives up between writes once `cancel` is set. A large write is hashed on
    `pool`'s thread while this one writes it (both release the GIL), and both finish before `write` returns: the
    caller may reuse its buffer."""

    def __init__(self, f, cancel: threading.Event | None, pool: ThreadPoolExecutor):
        self.f, self.cancel, self.pool, self.sha = f, cancel, pool, hashlib.sha256()

    def write(self, data) -> int:
        if self.cancel is not None and self.cancel.is_set():
            raise SaveCancelled("superseded by a newer save")
        if memoryview(data).nbytes < HASH_BESIDE_BYTES:
            self.sha.update(data)
            return self.f.write(data)
        hashed = self.pool.submit(self.sha.update, data)
        try:
            return self.f.write(data)
        finally:
            hashed.result()

    def flush(self) -> None:
        self.f.flush()


def write_checkpoint(output_dir: str | Path, snap: Snapshot, cfg: RunConfig, dataset_meta: dict, keep_last: int,
                     provenance: dict | None = None, cancel: threading.Event | None = None,
                     phases: dict | None = None) -> Path:
    """Write a snapshot as checkpoint `snap.step`: files to step_N.tmp, each hashed as soon as it is written (threads,
    while the next one is written; the optimizer state, the largest, while it is written), meta.json last, fsync,
    rename to step_N, then prune to keep_last. A failure removes step_N.tmp and raises (an OSError of the disk as the
    disk gave it); so does `cancel` set before the last file (SaveCancelled). `phases` receives the seconds of each
    part (weights_s, optimizer_s, hash_wait_s, fsync_s, rename_s): where a save's time goes."""
    step = snap.step
    final = checkpoint_path(output_dir, step)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{final.name}{TMP_SUFFIX}"
    _remove(tmp)
    tmp.mkdir()
    hashing = ThreadPoolExecutor(2, thread_name_prefix="dflash-sha256")
    hashes: dict[Path, Future | str] = {}
    phases = {} if phases is None else phases
    clock = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        phases[name] = round(now - clock[0], 3)
        clock[0] = now

    def written(*paths: Path) -> None:
        for path in paths:
            hashes[path] = hashing.submit(sha256_file, path)

    def cancelled() -> None:
        if cancel is not None and cancel.is_set():
            raise SaveCancelled("superseded by a newer save")

    try:
        drafter_dir = tmp / DRAFTER_DIR
        if snap.weights is None:
            snap.drafter.save_pretrained(drafter_dir)
        else:
            snap.drafter.save_pretrained(drafter_dir, state=snap.weights)
        written(*sorted(p for p in drafter_dir.rglob("*") if p.is_file()))
        lap("weights_s")
        cancelled()
        with open(tmp / OPTIMIZER_NAME, "wb") as f:  # a file of ours: a failed write keeps its OSError (errno)
            through = _HashingFile(f, cancel, hashing)
            try:
                torch.save(snap.optimizer_state, through)
            except RuntimeError as e:  # torch's zip writer ends the file on the way out, masking the cancel
                if isinstance(e.__context__, SaveCancelled):
                    raise e.__context__ from None
                raise
        hashes[tmp / OPTIMIZER_NAME] = through.sha.hexdigest()
        lap("optimizer_s")
        save_trainer_state(tmp, snap.trainer_state)
        written(tmp / STATE_TENSORS, tmp / STATE_JSON)
        delay = float(os.environ.get(SAVE_DELAY_ENV) or 0)
        if delay > 0:
            time.sleep(delay)
        cancelled()
        meta = {
            "format": FORMAT,
            "step": step,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": cfg.model_dump(),
            "dataset": dataset_meta,
            **(provenance or {}),
            FILES_KEY: _recorded(tmp, hashes),  # size + sha256 of every file: a resume verifies them (dflash.runs.rundir)
        }
        lap("hash_wait_s")
        (tmp / META_NAME).write_text(json.dumps(meta, indent=2))  # last: a folder with meta.json is finished
        _fsync_tree(tmp)  # the bytes are on disk before the rename makes the checkpoint visible
        lap("fsync_s")
        _remove(final)
        tmp.rename(final)
    except BaseException as e:  # a full disk, a kill's KeyboardInterrupt...: no partial step_N.tmp stays behind
        hashing.shutdown(wait=True, cancel_futures=True)  # no hash thread still reading what is removed
        shutil.rmtree(tmp, ignore_errors=True)
        _raise_the_disks(e, tmp)
    finally:
        hashing.shutdown(wait=True)
    _fsync_dir(root)
    lap("rename_s")
    best = best_checkpoint(output_dir)
    # real folders only (list_checkpoints never lists a symlink), up to the one just written
    for old in [c for c in list_checkpoints(output_dir) if checkpoint_step(c) <= step][:-keep_last]:
        if old != final and old != best:  # never the one just written, never checkpoints/best's
            shutil.rmtree(old, ignore_errors=True)
    return final


def write_export(output_dir: str | Path, write) -> Path:
    """Write <output_dir>/drafter whole or not at all: `write(folder)` fills drafter.tmp, which is fsynced and then
    renamed over the previous export. A failure removes drafter.tmp, keeps the previous export and raises (an OSError
    of the disk as the disk gave it)."""
    final = Path(output_dir) / DRAFTER_DIR
    tmp = final.with_name(DRAFTER_TMP)
    _remove(tmp)
    try:
        write(tmp)
        _fsync_tree(tmp)  # the bytes are on disk before the rename makes the export visible
        _remove(final)
        tmp.rename(final)
    except BaseException as e:  # a full disk, a kill's KeyboardInterrupt...: no partial export stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        _raise_the_disks(e, tmp)
    _fsync_dir(final.parent)
    return final


def _raise_the_disks(e: BaseException, where: Path):
    """Raise `e`, or the disk's OSError behind it when torch or safetensors wrapped one (``SafetensorError: ... No space
    left on device (os error 28)``): what `dflash.runs.rundir.io_failure` turns into one line."""
    cause = io_cause(e) if isinstance(e, Exception) else None
    if cause is not None and cause is not e:
        raise OSError(cause.errno, cause.strerror, cause.filename or str(where)) from e
    raise e


def _recorded(folder: Path, hashes: dict[Path, Future | str]) -> dict[str, dict]:
    """meta.json's record of every file but meta.json (as ``dflash.runs.verify.record_files`` makes it), from the hashes taken
    as the files were written; a file written some other way is hashed here. Raises OSError."""
    out = {}
    for p in sorted(p for p in folder.rglob("*") if p.is_file() and p != folder / META_NAME):
        digest = hashes.get(p) or sha256_file(p)
        digest = digest if isinstance(digest, str) else digest.result()
        out[p.relative_to(folder).as_posix()] = {"bytes": p.stat().st_size, "sha256": digest}
    return out


DISK_PROBE_BYTES = 256 << 20  # written and fsynced once, to time this disk before the first save


def state_bytes(drafter, optimizer) -> int:
    """The bytes a checkpoint of (drafter, optimizer) writes: every tensor of their state dicts."""
    tensors = [t for _k, t in _tensors("weights", drafter.state_dict())]
    tensors += [t for _k, t in _tensors("optimizer", optimizer.state_dict())]
    return sum(t.numel() * t.element_size() for t in tensors)


def disk_write_rate(folder: str | Path, nbytes: int = DISK_PROBE_BYTES) -> float | None:
    """Bytes a second this disk takes, written and fsynced (a probe file, removed); None when it cannot be written."""
    path = Path(folder) / ".disk-probe.tmp"
    block = os.urandom(1 << 20)
    try:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(max(1, nbytes >> 20)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        return nbytes / max(time.perf_counter() - t0, 1e-6)
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


class CheckpointWriter:
    """Saves checkpoints one at a time, in the background (``background=True``) or on the caller's thread.

    In the background the caller is blocked only for the snapshot (``snapshot`` with host copies) and, when the
    previous save is still being written, for the rest of that one: at most one save is in flight. The writer thread
    writes, hashes, renames, prunes and runs ``then(path)`` (moving checkpoints/best). Its error is raised on the
    caller's thread by the next ``check`` or ``wait``, as the synchronous save would have raised it.

        writer = CheckpointWriter(out, background=True)
        times = writer.save(step, drafter, optimizer, state, cfg, dataset_meta, keep_last, provenance)
        writer.check()        # each step: a failed background save raises here
        writer.wait()         # before reading checkpoints, at the end of a run
    """

    def __init__(self, output_dir: str | Path, background: bool):
        self.out = Path(output_dir)
        self.background = background
        self.host = HostCopies() if background else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._written: list[dict] = []  # {"save_step", "save_write_s"} of background saves finished, not yet taken
        self._pin_reported = False
        self._cancel: threading.Event | None = None  # the save in flight gives up when set (``supersede``)
        self._then_in_flight = False
        self.phases: dict = {}  # where the last finished save's time went (write_checkpoint's phases)

    def save(self, step: int, drafter, optimizer, trainer_state: dict, cfg: RunConfig, dataset_meta: dict,
             keep_last: int, provenance: dict | None = None, then=None, full_state=None) -> dict:
        """Save checkpoint `step`; returns the caller's timings: save_wait_s (waiting for the previous save),
        save_stall_s (all the time this call blocked) and, when written here, save_write_s. `full_state`: see
        ``snapshot``."""
        t0 = time.perf_counter()
        waited = self.wait()
        pinning = self.host.ready() if self.host is not None else 0.0  # a reservation still pinning: its rest
        snap = snapshot(step, drafter, optimizer, trainer_state, self.host, full_state)
        times = {"save_wait_s": round(waited, 3), **({"save_pin_wait_s": round(pinning, 3)} if pinning > 0.01 else {})}
        if self.host is not None and self.host.reserve_s is not None and not self._pin_reported:
            times["save_pin_s"] = self.host.reserve_s  # the first save's row: how long pinning its buffers took
            self._pin_reported = True
        times["save_snapshot_s"] = round(time.perf_counter() - t0 - waited - pinning, 3)
        if not self.background:
            self.phases = {}
            path = write_checkpoint(self.out, snap, cfg, dataset_meta, keep_last, provenance, phases=self.phases)
            if then is not None:
                then(path)
            times["save_write_s"] = round(time.perf_counter() - t0 - waited, 3)
        else:
            self._cancel, self._then_in_flight = threading.Event(), then is not None
            self._thread = threading.Thread(target=self._write, name=f"dflash-checkpoint-{step}",
                                            args=(snap, cfg, dataset_meta, keep_last, provenance, then, self._cancel))
            self._thread.start()  # not a daemon: an exiting interpreter waits for the rename
        times["save_stall_s"] = round(time.perf_counter() - t0, 3)
        return times

    def reserve(self, drafter, optimizer) -> None:
        """Pin the host buffers of the first background save now, on a thread (call once the optimizer has state)."""
        if self.host is not None:
            self.host.reserve(drafter, optimizer)

    def supersede(self) -> bool:
        """Give up the save in flight, if any, for the one about to be made (a stop's: it holds a newer step, and
        waiting for the older one to be written would spend a scheduler's grace). A save that moves checkpoints/best
        is finished instead. The older checkpoints stay. Returns whether one was given up."""
        if not self.busy() or self._then_in_flight or self._cancel is None:
            return False
        self._cancel.set()
        return True

    def _write(self, snap: Snapshot, cfg, dataset_meta, keep_last, provenance, then, cancel) -> None:
        t0 = time.perf_counter()
        phases: dict = {}
        try:
            path = write_checkpoint(self.out, snap, cfg, dataset_meta, keep_last, provenance, cancel, phases)
            if then is not None:
                then(path)
        except SaveCancelled:
            self._written.append({"save_step": snap.step, "save_superseded": True})
            return
        except BaseException as e:  # raised on the training thread by check() / wait()
            self._error = e
            return
        self.phases = phases
        self._written.append({"save_step": snap.step, "save_write_s": round(time.perf_counter() - t0, 3)})

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        """Raise the error of a background save that has failed (a no-op while one is being written)."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> float:
        """Wait for the save in flight; raise its error. Returns the seconds waited."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return time.perf_counter() - t0

    def written(self) -> list[dict]:
        """The timings of background saves finished since the last call."""
        out, self._written = self._written, []
        return out


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
    state, meta = load_weights(path, drafter, device)
    load_optimizer(path, optimizer, device)
    return state, meta


def load_weights(path: Path, drafter, device) -> tuple[dict, dict]:
    """The drafter's weights (before any sharding: a checkpoint holds the full state); returns (trainer_state,
    meta). Raises CheckpointError."""
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
    return trainer_state, meta


def load_optimizer(path: Path, optimizer, device, load=None) -> None:
    """The optimizer's full state into `optimizer`, through `load(state)` (optimizer.load_state_dict when None; a
    sharded drafter's places each moment on its shard). Raises CheckpointError."""
    import pickle

    opt_path = Path(path) / OPTIMIZER_NAME
    try:
        opt_state = torch.load(opt_path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise _missing(opt_path, Path(path)) from None
    except pickle.UnpicklingError:  # weights_only refused it: not a plain tensor file
        raise _corrupt(opt_path, "not a tensors-only torch file", Path(path)) from None
    except (OSError, RuntimeError, ValueError, EOFError) as e:
        raise _corrupt(opt_path, _one_line(e), Path(path)) from None
    try:
        (load or optimizer.load_state_dict)(opt_state)
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise CheckpointError(f"{opt_path} does not fit this drafter's optimizer ({_one_line(e)}); "
                              "use --fresh") from None
    for group in optimizer.param_groups:  # load_state_dict restores a saved group's flags: a CPU checkpoint written
        group["fused"] = True             # before AdamW was fused everywhere says False (dflash.train.step.build_optimizer)
