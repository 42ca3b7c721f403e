"""The run dir's exclusive lock, torch-free: one trainer per run dir (an flock on ``<output_dir>/.lock``)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from dflash.runs.rundir import LOCK_NAME, RunDirBusyError


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
