"""File content hashes for the on-disk contracts (checkpoint files, dataset shards). Torch-free.

A plain streaming sha256 of each file, so a recorded hash can be checked by hand with
``sha256sum``. Several files are hashed in parallel threads (hashlib releases the GIL on large
updates); one file is one thread, so a run of files takes about as long as its largest one.
Measured speed: bench/README.md ("Integrity checks").
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHUNK = 8 << 20  # bytes read per update: large enough that hashing, not Python, sets the pace


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in CHUNK pieces. Raises OSError."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def sha256_files(paths: Iterable[str | Path], workers: int | None = None) -> dict[Path, str | OSError]:
    """{path: hex sha256, or the OSError that stopped reading it}, hashed in parallel threads."""
    paths = [Path(p) for p in paths]
    if not paths:
        return {}
    workers = workers or min(len(paths), os.cpu_count() or 1, 16)

    def one(p: Path) -> str | OSError:
        try:
            return sha256_file(p)
        except OSError as e:
            return e

    if workers == 1:
        return {p: one(p) for p in paths}
    with ThreadPoolExecutor(workers, thread_name_prefix="dflash-sha256") as pool:
        return dict(zip(paths, pool.map(one, paths)))
