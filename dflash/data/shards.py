"""Arrow shards on disk: writing them, and ``ShardDataset``, which memory-maps every shard and keeps only the
list offsets' lengths in RAM (opening a million samples costs about as much as reading their offsets). Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from itertools import chain
from pathlib import Path

import numpy as np
import pyarrow as pa

from dflash.data.identity import (
    _MAX_READ_ALLOC,
    COLUMNS,
    DatasetError,
    _one_line,
    dataset_fingerprint,
    read_manifest,
    shard_files,
    whole_problem,
)

# ---------------------------------------------------------------------------------------------
# Writing


def write_shard(path: str | Path, input_ids: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]]) -> None:
    """Write one shard atomically (temp file + rename): row i is (input_ids[i], loss_masks[i])."""
    if len(input_ids) != len(loss_masks):
        raise DatasetError(f"{path}: {len(input_ids)} input_ids rows but {len(loss_masks)} loss_mask rows")
    lengths = np.fromiter(map(len, input_ids), dtype=np.int64, count=len(input_ids))
    mask_lengths = np.fromiter(map(len, loss_masks), dtype=np.int64, count=len(loss_masks))
    bad = np.flatnonzero(lengths != mask_lengths)
    if bad.size:
        i = int(bad[0])
        raise DatasetError(
            f"{path}: row {i} has {lengths[i]} input_ids but {mask_lengths[i]} loss_mask values; they must match"
        )
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    ids = np.fromiter(chain.from_iterable(input_ids), dtype=np.int64, count=total)
    mask = np.fromiter(chain.from_iterable(loss_masks), dtype=np.int64, count=total)
    write_shard_arrays(path, offsets, ids, mask)


def write_shard_arrays(path: str | Path, offsets: np.ndarray, input_ids: np.ndarray, loss_mask: np.ndarray,
                       extra: dict[str, pa.Array] | None = None) -> None:
    """Write one shard atomically from flat arrays: row i is ``input_ids[offsets[i]:offsets[i+1]]``.

    The fast path for large synthetic or converted datasets (no per-row Python). ``extra``: optional
    per-row columns after the two read ones (readers select columns by name and ignore the others).
    """
    path = Path(path)
    offsets = np.asarray(offsets)
    input_ids = np.asarray(input_ids)
    loss_mask = np.asarray(loss_mask)
    if offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
        raise DatasetError(f"{path}: offsets must start at 0 and never decrease")
    total = int(offsets[-1])
    if input_ids.shape != (total,) or loss_mask.shape != (total,):
        raise DatasetError(
            f"{path}: offsets end at {total} but got {input_ids.size} input_ids and {loss_mask.size} loss_mask values"
        )
    if total >= 2**31:
        raise DatasetError(f"{path}: {total:,} tokens do not fit one list<int32> shard; split into more shards")
    if total and (input_ids.min() < 0 or input_ids.max() >= 2**31):
        raise DatasetError(f"{path}: token ids must be in [0, 2^31)")
    if total and not np.all((loss_mask == 0) | (loss_mask == 1)):
        raise DatasetError(f"{path}: loss_mask values must be 0 or 1")
    offsets32 = pa.array(offsets.astype(np.int32, copy=False), type=pa.int32())
    table = pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(offsets32, pa.array(input_ids.astype(np.int32, copy=False))),
            "loss_mask": pa.ListArray.from_arrays(offsets32, pa.array(loss_mask.astype(np.int8, copy=False))),
            **(extra or {}),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


# ---------------------------------------------------------------------------------------------
# Reading


def _is_int_list(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)


REGENERATE = "regenerate this shard (write_shard writes atomically)"


class ShardError(DatasetError):
    """A shard ``open_shard`` refuses. ``problem`` says what is wrong without the path (preflight lists it under
    the shard's name); the message is the path, the problem and the fix."""

    def __init__(self, path: Path, problem: str, fix: str = REGENERATE):
        super().__init__(f"{path}: {problem}; {fix}")
        self.problem, self.fix = problem, fix


class ShardBatch:
    """One validated record batch of a shard: both columns, and zero-copy numpy views of their offsets and values."""

    __slots__ = ("ids", "input_ids", "loss_mask", "mask", "mask_offsets", "offsets", "record")

    def __init__(self, record: pa.RecordBatch):
        self.record = record  # every column, the extra ones (e.g. ``turns``) too
        self.input_ids, self.loss_mask = record.column("input_ids"), record.column("loss_mask")
        self.offsets, self.mask_offsets = self.input_ids.offsets.to_numpy(), self.loss_mask.offsets.to_numpy()
        self.ids = self.input_ids.values.to_numpy(zero_copy_only=True)
        self.mask = self.loss_mask.values.to_numpy(zero_copy_only=True)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def mask_lengths(self) -> np.ndarray:
        return np.diff(self.mask_offsets)


class OpenShard:
    """A memory-mapped shard whose schema and record batches ``open_shard`` validated."""

    def __init__(self, path: Path, mapped: pa.MemoryMappedFile, schema: pa.Schema, batches: list[ShardBatch]):
        self.path, self.mapped, self.schema, self.batches = path, mapped, schema, batches

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of every sample (int64), in row order."""
        return np.concatenate([b.lengths for b in self.batches] or [np.zeros(0, np.int64)]).astype(np.int64)

    @property
    def mask_lengths(self) -> np.ndarray:
        return np.concatenate([b.mask_lengths for b in self.batches] or [np.zeros(0, np.int64)]).astype(np.int64)

    def column(self, name: str) -> pa.ChunkedArray:
        """One column over every batch, zero-copy (``input_ids``, ``loss_mask`` or an extra one)."""
        return pa.chunked_array([b.record.column(name) for b in self.batches], self.schema.field(name).type)

    def mask_mismatch(self) -> tuple[int, int, int] | None:
        """(row, input_ids length, loss_mask length) of the first sample whose two lengths differ, else None."""
        ids, mask = self.lengths, self.mask_lengths
        bad = np.flatnonzero(ids != mask)
        return (int(bad[0]), int(ids[bad[0]]), int(mask[bad[0]])) if bad.size else None

    def close(self) -> None:
        self.mapped.close()


def open_shard(path: str | Path) -> OpenShard:
    """The one reader of the shard format (``dflash.data.identity``'s docstring): memory-map `path`, check both
    columns are lists of integers, validate every record batch (no nulls, sane offsets) and refuse a shard whose
    reading copies it into RAM (compressed). Raises ShardError. The trainer's dataset and preflight's scan both
    read through it, so what one accepts the other accepts."""
    path = Path(path)
    before = pa.total_allocated_bytes()
    try:
        mapped = pa.memory_map(str(path), "r")
        reader = pa.ipc.open_file(mapped)
        schema = reader.schema
    except (pa.ArrowException, OSError) as e:
        raise ShardError(path, f"not a readable Arrow IPC file ({_one_line(e)})") from None
    for col in COLUMNS:
        idx = schema.get_field_index(col)
        if idx < 0:
            raise ShardError(path, f"missing column '{col}' (has: {', '.join(schema.names) or 'none'})",
                             "shards need input_ids: list<int32> and loss_mask: list<int8>")
        if not _is_int_list(schema.field(col).type):
            raise ShardError(path, f"column '{col}' is {schema.field(col).type}, expected a list of integers "
                             "(input_ids: list<int32>, loss_mask: list<int8>)", "rewrite the shard with write_shard")
    batches = []
    for b in range(reader.num_record_batches):
        try:
            record = reader.get_batch(b)
            record.validate()
        except (pa.ArrowException, OSError) as e:
            raise ShardError(path, f"record batch {b} is corrupt ({_one_line(e)})") from None
        if record.column("input_ids").null_count or record.column("loss_mask").null_count:
            raise ShardError(path, "null rows in input_ids or loss_mask", "drop them and rewrite the shard")
        batch = ShardBatch(record)
        if (np.any(batch.lengths < 0) or np.any(batch.mask_lengths < 0) or batch.offsets[-1] > len(batch.ids)
                or batch.mask_offsets[-1] > len(batch.mask)):
            raise ShardError(path, f"record batch {b} has invalid list offsets")
        batches.append(batch)
    copied = pa.total_allocated_bytes() - before
    if copied > _MAX_READ_ALLOC:
        raise ShardError(path, f"reading it copies {copied / 2**20:.0f} MiB into RAM (compressed IPC?)",
                         "rewrite it uncompressed with write_shard so it can be memory-mapped")
    return OpenShard(path, mapped, schema, batches)


class ShardDataset:
    """A folder of memory-mapped Arrow shards; only per-sample lengths live in RAM.

    ``get(i)`` returns ``(input_ids int64, loss_mask int8)`` numpy arrays (copies, safe to keep).
    Pickling reopens the folder, so the dataset can be sent to DataLoader worker processes.
    A folder whose manifest.json says it is not whole (``dflash.data.identity.whole_problem``: a writer killed
    half-way, counts that disagree with the shards) is refused, unless ``whole=False`` (the commands that repair it).
    """

    def __init__(self, path: str | Path, whole: bool = True):
        self.path, self.whole = Path(path), whole
        self.shards = self._list_shards(self.path)
        self._maps: list[pa.MemoryMappedFile] = []
        self._parts: list[ShardBatch] = []
        part_lengths: list[np.ndarray] = []
        described: list[tuple[str, int, int]] = []
        self.counts: dict[str, tuple[int, int]] = {}  # shard name -> (samples, tokens), from the shards themselves
        for shard in self.shards:
            rows, tokens = self._open_shard(shard, part_lengths)
            described.append((shard.name, shard.stat().st_size, rows))
            self.counts[shard.name] = (rows, tokens)
        self.lengths = (np.concatenate(part_lengths) if part_lengths else np.zeros(0, np.int64)).astype(np.int32)
        if self.lengths.size == 0:
            raise DatasetError(f"{self.path}: the shards hold no samples; write some with dflash.data.shards.write_shard")
        if whole and self.path.is_dir():
            self._check_whole()
        # global index of each part's first row, for get(i)
        self._starts = np.cumsum([0] + [p.offsets.size - 1 for p in self._parts])
        self.fingerprint = dataset_fingerprint(described)

    def _check_whole(self) -> None:
        """Refuse a folder its manifest says is not whole: the rule preflight's `dataset` check applies."""
        manifest, unreadable = read_manifest(self.path)
        if unreadable:
            raise DatasetError(f"{self.path}: {unreadable}; restore it, or rewrite it with dflash-data manifest")
        problem = whole_problem(self.path, manifest, self.counts) if manifest is not None else None
        if problem:
            raise DatasetError("; ".join(problem))

    @staticmethod
    def _list_shards(path: Path) -> list[Path]:
        shards = shard_files(path)
        if not shards and not path.is_dir():
            raise DatasetError(f"{path}: no such dataset folder; set data.path to a folder of *.arrow shards")
        if not shards:
            raise DatasetError(f"{path}: no *.arrow shards in this folder; write them with dflash-data import "
                               "(conversations) or dflash-data prepare (prompts)")
        return shards

    def _open_shard(self, shard: Path, part_lengths: list[np.ndarray]) -> tuple[int, int]:
        opened = open_shard(shard)
        mismatch = opened.mask_mismatch()
        if mismatch is not None:
            row, ids, mask = mismatch
            raise DatasetError(f"{shard}: row {row} has {ids} input_ids but {mask} loss_mask values; they must match")
        self._parts += opened.batches
        part_lengths += [b.lengths for b in opened.batches]
        self._maps.append(opened.mapped)
        return (sum(b.lengths.size for b in opened.batches),
                sum(int(b.offsets[-1] - b.offsets[0]) for b in opened.batches))

    def __len__(self) -> int:
        return int(self.lengths.size)

    @property
    def num_samples(self) -> int:
        return int(self.lengths.size)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        n = self.lengths.size
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for a dataset of {n} samples")
        i = int(i) % n
        p = int(np.searchsorted(self._starts, i, side="right")) - 1
        part, row = self._parts[p], i - int(self._starts[p])
        ids = part.ids[int(part.offsets[row]) : int(part.offsets[row + 1])]
        mask = part.mask[int(part.mask_offsets[row]) : int(part.mask_offsets[row + 1])]
        return ids.astype(np.int64), mask.astype(np.int8)

    def __getstate__(self) -> dict:
        return {"path": str(self.path), "whole": self.whole}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state.get("whole", True))

    def __repr__(self) -> str:
        return f"ShardDataset({str(self.path)!r}, shards={len(self.shards)}, samples={self.num_samples:,})"


def check_max_length(lengths: np.ndarray, max_length: int, field: str = "data.max_length") -> None:
    """Raise DatasetError naming the first sample longer than ``max_length`` tokens."""
    too_long = np.flatnonzero(np.asarray(lengths) > max_length)
    if too_long.size:
        i = int(too_long[0])
        others = f" (and {too_long.size - 1:,} more)" if too_long.size > 1 else ""
        raise DatasetError(
            f"sample {i} has {int(lengths[i]):,} tokens > {field} {max_length:,}{others}; "
            f"drop or truncate such samples, or raise {field}"
        )
