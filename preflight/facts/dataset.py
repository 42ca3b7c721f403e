"""The run's dataset: its shards (rows, lengths, value ranges), the manifest beside them, and the target
fingerprint to compare it with."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash.config import ConfigError, RunConfig

if TYPE_CHECKING:
    from dflash.data.identity import ValueStats


@dataclass
class Shard:
    name: str
    rows: int = 0
    tokens: int = 0
    max_len: int = 0
    max_row: int = -1
    first_row: int = 0  # global index of this shard's first sample
    over: list[tuple[int, int]] = field(default_factory=list)  # (row, length) of the longest samples over the limit
    over_count: int = 0
    mask_mismatch: tuple[int, int, int] | None = None  # (row, input_ids len, loss_mask len)
    size_bytes: int = 0
    error: str | None = None
    values: ValueStats | None = None  # token id / loss_mask ranges, learnable positions (None: not read)
    sha256: str | None = None  # of the file, read only with --verify-data
    lengths: Any = None  # every sample's token count (numpy int64), for the run snapshot's length percentiles


@dataclass
class Dataset:
    path: str
    limit: int  # longest sample that can fit a batch (tokens)
    shards: list[Shard] = field(default_factory=list)
    error: str | None = None  # the folder itself
    manifest: dict | None = None  # manifest.json beside the shards (dflash.data), None when absent
    manifest_error: str | None = None  # why it could not be read
    target: dict | None = None  # the run's target fingerprint (dflash.data.identity.target_fingerprint)
    target_error: str | None = None  # why it could not be taken
    deep: bool = False  # shard sha256 computed (--verify-data)

    @property
    def samples(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def fingerprint(self) -> str:
        """The trainer's identity of these shards (dflash.data.identity.dataset_fingerprint), as checkpoints record it."""
        from dflash.data.identity import dataset_fingerprint

        return dataset_fingerprint((s.name, s.size_bytes, s.rows) for s in self.shards)


def scan_shard(path: Path, limit: int, first_row: int, keep: int = 3) -> Shard:
    """Rows, lengths, samples over `limit`, and the value ranges (dflash.data.identity.value_stats) of one shard,
    read through the trainer's own reader (dflash.data.shards.open_shard): what it refuses is this shard's error."""
    import numpy as np

    from dflash.data.identity import value_stats
    from dflash.data.shards import ShardError, open_shard

    shard = Shard(path.name, first_row=first_row, size_bytes=path.stat().st_size)
    try:
        opened = open_shard(path)
    except ShardError as e:
        shard.error = e.problem
        return shard
    try:
        ids = opened.lengths
        shard.mask_mismatch = opened.mask_mismatch()
        if shard.mask_mismatch is None:
            shard.values = value_stats(opened.column("input_ids"), opened.column("loss_mask"))
    finally:
        opened.close()
    shard.rows = int(ids.size)
    shard.tokens = int(ids.sum())
    shard.lengths = ids
    if ids.size:
        shard.max_row = int(ids.argmax())
        shard.max_len = int(ids[shard.max_row])
        over = np.nonzero(ids > limit)[0]
        shard.over_count = int(over.size)
        if over.size:
            worst = over[np.argsort(-ids[over], kind="stable")[:keep]]
            shard.over = [(int(r), int(ids[r])) for r in worst]
    return shard


def dataset(cfg: RunConfig, deep: bool = False) -> Dataset:
    """The shards of data.path (the trainer's rule for which files are shards), their manifest, the run's target
    fingerprint to compare it with, and with ``deep`` (--verify-data) every shard's sha256."""
    from dflash.data.identity import read_manifest, shard_files, target_fingerprint
    from dflash.filehash import sha256_files

    limit = cfg.data.token_budget if cfg.data.max_length is None else min(cfg.data.token_budget, cfg.data.max_length)
    ds = Dataset(cfg.data.path, limit, deep=deep)
    root = Path(cfg.data.path)
    paths = shard_files(root)
    if not paths and not root.is_dir():
        ds.error = f"{root} is not a folder of *.arrow shards" if root.exists() else f"{root} does not exist"
        return ds
    first = 0
    for path in paths:
        shard = scan_shard(path, limit, first)
        first += shard.rows
        ds.shards.append(shard)
    if not ds.shards:
        ds.error = f"no *.arrow shards in {root}"
        return ds
    if root.is_dir():
        ds.manifest, ds.manifest_error = read_manifest(root)
    try:
        ds.target = target_fingerprint(cfg.target.path)
    except (ConfigError, OSError) as e:
        ds.target_error = e.one_line() if isinstance(e, ConfigError) else f"{cfg.target.path}: {e.strerror}"
    if deep:
        hashes = sha256_files(paths)
        for shard, path in zip(ds.shards, paths):
            digest = hashes[path]
            if isinstance(digest, OSError):
                shard.error = shard.error or f"unreadable ({digest.strerror})"
            else:
                shard.sha256 = digest
    return ds
