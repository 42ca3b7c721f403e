"""Training data: memory-mapped Arrow shards and length-bucketed, token-budgeted batches.

Shard format: a folder of Arrow IPC *file* format shards ``*.arrow`` (read in name order),
uncompressed, with two columns:

- ``input_ids: list<int32>``: the tokenized prompt + completion;
- ``loss_mask: list<int8>``: 1 on completion tokens (the ones to learn), 0 elsewhere.

``ShardDataset`` memory-maps every shard and keeps only the list offsets' lengths in RAM,
so opening a million samples costs about as much as reading their offsets.
``BucketBatchSampler`` groups samples of similar length so that every batch holds at most
``max_batch_size`` sequences and at most ``token_budget`` padded tokens; it is deterministic
given (seed, epoch) and resumes mid-epoch. ``collate`` turns a batch into padded tensors.

Identity (this module is its one owner): ``dataset_fingerprint`` (cheap: shard names, sizes, rows)
for checkpoints, and the dataset manifest ``manifest.json`` that ``dflash-data prepare``/``merge``/
``manifest`` write beside the shards::

    {"target": {"vocab_size", "model_type", "num_layers", "hidden", "tokenizer_sha256"} | null,
     "shards": {"shard-00000.arrow": {"bytes": int, "sha256": hex, "samples": int, "tokens": int, ...}},
     ... what wrote it: "settings" (prepare), "merged_from" (merge)}

``target_fingerprint`` says what data built for a target must match (its vocabulary and tokenizer
files); ``value_stats`` reads a shard's token id range, loss_mask range and learnable positions
vectorised (bench/README.md: seconds per billion tokens), which preflight's `dataset` check judges.

This module imports torch only inside ``collate``, so preflight can open a dataset in a
light process.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import pyarrow as pa

from dflash.errors import DflashError
from dflash.filehash import sha256_files

COLUMNS = ("input_ids", "loss_mask")
SHARD_GLOB = "*.arrow"
MANIFEST_NAME = "manifest.json"
# A tokenizer is whichever of these files its folder holds; their bytes are its identity.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "merges.txt", "vocab.txt")
# Reading an uncompressed shard from a memory map allocates (almost) nothing; more than this
# means Arrow decompressed or copied the shard into RAM.
_MAX_READ_ALLOC = 1 << 20  # bytes


class DatasetError(DflashError):
    """A dataset that cannot be used as is; the message is one line naming the file and the fix."""


# ---------------------------------------------------------------------------------------------
# Identity: which shards a data path names, and the fingerprint checkpoints and preflight compare


def shard_files(path: str | Path) -> list[Path]:
    """The shards a data path names, in read order: the path itself if it is one ``*.arrow`` file, else the
    folder's ``*.arrow`` files sorted by name (hidden ones, such as a write in progress, skipped); [] if none."""
    path = Path(path)
    if path.is_file() and path.suffix == ".arrow":
        return [path]
    if not path.is_dir():
        return []
    return sorted(p for p in path.glob(SHARD_GLOB) if not p.name.startswith(".") and p.is_file())


def dataset_fingerprint(shards: Iterable[tuple[str, int, int]]) -> str:
    """Cheap identity of a dataset from (shard name, size in bytes, rows) in read order: 16 hex digits.

    Recorded in every checkpoint's meta.json (``dataset.fingerprint``) and computed by preflight's
    `dataset` facts, so a resume can tell whether the data changed under it.
    """
    described = "\n".join(f"{name}:{size}:{rows}" for name, size, rows in shards)
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def tokenizer_sha256(folder: str | Path) -> str | None:
    """sha256 over the names and contents of the tokenizer files in a model folder; None when it holds none."""
    folder = Path(folder)
    found = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if not found:
        return None
    hashes = sha256_files(found)
    h = hashlib.sha256()
    for path in found:
        digest = hashes[path]
        if isinstance(digest, OSError):
            raise digest
        h.update(f"{path.name}\0{digest}\n".encode())
    return h.hexdigest()


def target_fingerprint(target: str) -> dict:
    """What data built for `target` (a model folder, or "smollm2") must match: its vocabulary and tokenizer.

    ``{"vocab_size", "model_type", "num_layers", "hidden", "tokenizer_sha256"}`` from the target's
    config.json (``dflash.memory.load_target_shape``) and tokenizer files; ``tokenizer_sha256`` is None
    when there are none (the embedded smollm2 before its first conversion). Raises ConfigError.
    """
    from dflash import smollm2
    from dflash.memory import load_target_shape, resolve_target_dir

    shape = load_target_shape(target)
    folder = smollm2.cached_folder() if target == smollm2.NAME else resolve_target_dir(target)
    tok = tokenizer_sha256(folder) if folder.is_dir() and (target != smollm2.NAME or smollm2.is_converted()) else None
    return {"vocab_size": shape.vocab, "model_type": shape.model_type, "num_layers": shape.num_layers,
            "hidden": shape.hidden, "tokenizer_sha256": tok}


def compare_targets(recorded: dict, current: dict) -> tuple[list[str], list[str]]:
    """(mismatches, notes) between the target a dataset was built for and the run's target.

    A mismatch makes the token ids mean other tokens or crash the embedding (another vocabulary size,
    other tokenizer files); a note is a difference the ids survive (completions of another model
    with the same tokenizer). Tokenizers are compared when both sides have tokenizer files.
    """
    bad, notes = [], []
    if recorded.get("vocab_size") != current.get("vocab_size"):
        bad.append(f"vocab_size {recorded.get('vocab_size')} -> {current.get('vocab_size')}")
    a, b = recorded.get("tokenizer_sha256"), current.get("tokenizer_sha256")
    if a and b and a != b:
        bad.append(f"tokenizer files differ (sha256 {a[:12]} -> {b[:12]})")
    model = [f"{k} {recorded.get(k)} -> {current.get(k)}" for k in ("model_type", "num_layers", "hidden")
             if recorded.get(k) != current.get(k)]
    if model and not bad:
        notes.append(f"completions of another model with the same tokenizer ({', '.join(model)})")
    return bad, notes


# ---------------------------------------------------------------------------------------------
# The manifest


def read_manifest(folder: str | Path) -> tuple[dict | None, str | None]:
    """(manifest.json of a dataset folder, None); (None, None) when there is none; (None, why) when unreadable."""
    path = Path(folder) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"{MANIFEST_NAME} unreadable ({_one_line(e)})"
    if not isinstance(manifest, dict):
        return None, f"{MANIFEST_NAME} unreadable (not a JSON object)"
    return manifest, None


def write_manifest(folder: str | Path, manifest: dict) -> None:
    """Write manifest.json atomically (temp file + rename)."""
    folder = Path(folder)
    tmp = folder / f".{MANIFEST_NAME}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, folder / MANIFEST_NAME)


def shard_records(paths: Iterable[str | Path]) -> dict[str, dict]:
    """{shard name: {"bytes": size, "sha256": hex}}, hashed in parallel threads. Raises OSError."""
    paths = [Path(p) for p in paths]
    hashes = sha256_files(paths)
    out = {}
    for p in paths:
        if isinstance(hashes[p], OSError):
            raise hashes[p]
        out[p.name] = {"bytes": p.stat().st_size, "sha256": hashes[p]}
    return out


# ---------------------------------------------------------------------------------------------
# Values: what the trainer will index with, vectorised


@dataclass
class ValueStats:
    """Token id and loss_mask ranges of a shard and how many positions it can learn from (None: no tokens)."""

    min_id: int | None = None
    max_id: int | None = None
    mask_min: int | None = None
    mask_max: int | None = None
    anchors: int = 0  # positions a with loss_mask[a] and loss_mask[a+1] in one sample: where blocks can start

    def merge(self, other: ValueStats) -> ValueStats:
        def pick(f, a, b):
            return b if a is None else a if b is None else f(a, b)

        return ValueStats(pick(min, self.min_id, other.min_id), pick(max, self.max_id, other.max_id),
                          pick(min, self.mask_min, other.mask_min), pick(max, self.mask_max, other.mask_max),
                          self.anchors + other.anchors)


def value_stats(input_ids, loss_mask) -> ValueStats:
    """Ranges and learnable positions of two list<int> columns (Array or ChunkedArray), without a Python loop
    over rows: pyarrow min/max over the flattened values, one numpy pass over loss_mask for the anchors."""
    import pyarrow.compute as pc

    ids_chunks = input_ids.chunks if isinstance(input_ids, pa.ChunkedArray) else [input_ids]
    mask_chunks = loss_mask.chunks if isinstance(loss_mask, pa.ChunkedArray) else [loss_mask]
    out = ValueStats()
    for ids, mask in zip(ids_chunks, mask_chunks):
        flat_ids, flat_mask = ids.flatten(), mask.flatten()
        if len(flat_ids) == 0:
            continue
        ids_mm, mask_mm = pc.min_max(flat_ids), pc.min_max(flat_mask)
        part = ValueStats(ids_mm["min"].as_py(), ids_mm["max"].as_py(), mask_mm["min"].as_py(), mask_mm["max"].as_py())
        m = flat_mask.to_numpy(zero_copy_only=False)
        if m.size > 1:
            part.anchors = int(np.count_nonzero(m[:-1] & m[1:]))
            starts = np.unique(mask.offsets.to_numpy() - mask.offsets[0].as_py())  # each sample's first position
            starts = starts[(starts > 0) & (starts < m.size)]
            part.anchors -= int(np.count_nonzero(m[starts - 1] & m[starts]))  # pairs across two samples
        out = out.merge(part)
    return out


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


def write_shard_arrays(path: str | Path, offsets: np.ndarray, input_ids: np.ndarray, loss_mask: np.ndarray) -> None:
    """Write one shard atomically from flat arrays: row i is ``input_ids[offsets[i]:offsets[i+1]]``.

    The fast path for large synthetic or converted datasets (no per-row Python).
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


class _Part:
    """One record batch of one shard: zero-copy numpy views of both columns' offsets and values."""

    __slots__ = ("ids", "mask", "mask_offsets", "offsets")

    def __init__(self, offsets: np.ndarray, ids: np.ndarray, mask_offsets: np.ndarray, mask: np.ndarray):
        self.offsets, self.ids, self.mask_offsets, self.mask = offsets, ids, mask_offsets, mask


class ShardDataset:
    """A folder of memory-mapped Arrow shards; only per-sample lengths live in RAM.

    ``get(i)`` returns ``(input_ids int64, loss_mask int8)`` numpy arrays (copies, safe to keep).
    Pickling reopens the folder, so the dataset can be sent to DataLoader worker processes.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.shards = self._list_shards(self.path)
        self._maps: list[pa.MemoryMappedFile] = []
        self._parts: list[_Part] = []
        part_lengths: list[np.ndarray] = []
        described: list[tuple[str, int, int]] = []
        for shard in self.shards:
            rows = self._open_shard(shard, part_lengths)
            described.append((shard.name, shard.stat().st_size, rows))
        self.lengths = (np.concatenate(part_lengths) if part_lengths else np.zeros(0, np.int64)).astype(np.int32)
        if self.lengths.size == 0:
            raise DatasetError(f"{self.path}: the shards hold no samples; write some with dflash.data.write_shard")
        # global index of each part's first row, for get(i)
        self._starts = np.cumsum([0] + [p.offsets.size - 1 for p in self._parts])
        self.fingerprint = dataset_fingerprint(described)

    @staticmethod
    def _list_shards(path: Path) -> list[Path]:
        shards = shard_files(path)
        if not shards and not path.is_dir():
            raise DatasetError(f"{path}: no such dataset folder; set data.path to a folder of *.arrow shards")
        if not shards:
            raise DatasetError(f"{path}: no *.arrow shards in this folder; write them with dflash.data.write_shard")
        return shards

    def _open_shard(self, shard: Path, part_lengths: list[np.ndarray]) -> int:
        fix = "regenerate this shard (write_shard writes atomically)"
        before = pa.total_allocated_bytes()
        try:
            mm = pa.memory_map(str(shard), "r")
            reader = pa.ipc.open_file(mm)
            schema = reader.schema
        except (pa.ArrowException, OSError) as e:
            raise DatasetError(f"{shard}: not a readable Arrow IPC file ({_one_line(e)}); {fix}") from None
        for col in COLUMNS:
            idx = schema.get_field_index(col)
            if idx < 0:
                raise DatasetError(
                    f"{shard}: missing column '{col}' (has: {', '.join(schema.names) or 'none'}); "
                    "shards need input_ids: list<int32> and loss_mask: list<int8>"
                )
            if not _is_int_list(schema.field(col).type):
                raise DatasetError(
                    f"{shard}: column '{col}' is {schema.field(col).type}, expected a list of integers "
                    f"(input_ids: list<int32>, loss_mask: list<int8>); rewrite the shard with write_shard"
                )
        rows = 0
        for b in range(reader.num_record_batches):
            try:
                batch = reader.get_batch(b)
                batch.validate()
            except (pa.ArrowException, OSError) as e:
                raise DatasetError(f"{shard}: record batch {b} is corrupt ({_one_line(e)}); {fix}") from None
            ids_col, mask_col = batch.column("input_ids"), batch.column("loss_mask")
            if ids_col.null_count or mask_col.null_count:
                raise DatasetError(f"{shard}: null rows in input_ids or loss_mask; drop them and rewrite the shard")
            offsets = ids_col.offsets.to_numpy()
            lengths = np.diff(offsets)
            mask_offsets = mask_col.offsets.to_numpy()
            if (
                np.any(lengths < 0)
                or np.any(np.diff(mask_offsets) < 0)
                or offsets[-1] > len(ids_col.values)
                or mask_offsets[-1] > len(mask_col.values)
            ):
                raise DatasetError(f"{shard}: record batch {b} has invalid list offsets; {fix}")
            bad = np.flatnonzero(lengths != np.diff(mask_offsets))
            if bad.size:
                r = rows + int(bad[0])
                raise DatasetError(
                    f"{shard}: row {r} has {lengths[bad[0]]} input_ids but "
                    f"{mask_offsets[bad[0] + 1] - mask_offsets[bad[0]]} loss_mask values; they must match"
                )
            ids = ids_col.values.to_numpy(zero_copy_only=True)
            mask = mask_col.values.to_numpy(zero_copy_only=True)
            self._parts.append(_Part(offsets, ids, mask_offsets, mask))
            part_lengths.append(lengths)
            rows += lengths.size
        copied = pa.total_allocated_bytes() - before
        if copied > _MAX_READ_ALLOC:
            raise DatasetError(
                f"{shard}: reading it copies {copied / 2**20:.0f} MiB into RAM (compressed IPC?); "
                "rewrite it uncompressed with write_shard so it can be memory-mapped"
            )
        self._maps.append(mm)
        return rows

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
        return {"path": str(self.path)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

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


# ---------------------------------------------------------------------------------------------
# Batching


class BucketBatchSampler:
    """Length-bucketed batches under a token budget, deterministic per (seed, epoch), resumable.

    Samples are bucketed by length with quantile edges. Inside a bucket, each sample belongs to
    the class of the largest batch size its length allows, ``min(max_batch_size, token_budget //
    length)``; a batch is ``size`` samples of one (bucket, class) group, so every batch meets
    ``len(batch) <= max_batch_size`` and ``max_len * len(batch) <= token_budget`` whatever the
    shuffle, and the number of batches per epoch is the same in every epoch.
    Each epoch: shuffle within groups, cut into batches, shuffle the batch order.
    """

    def __init__(self, lengths: np.ndarray, token_budget: int, max_batch_size: int, num_buckets: int, seed: int):
        lengths = np.asarray(lengths, dtype=np.int64)
        if token_budget < 1 or max_batch_size < 1 or num_buckets < 1:
            raise ValueError("token_budget, max_batch_size and num_buckets must be >= 1")
        if lengths.size == 0:
            raise DatasetError("no samples to batch")
        empty = np.flatnonzero(lengths < 1)
        if empty.size:
            raise DatasetError(f"sample {int(empty[0])} is empty (0 tokens); drop empty samples from the dataset")
        check_max_length(lengths, token_budget, field="data.token_budget")
        self.lengths = lengths
        self.token_budget, self.max_batch_size, self.num_buckets, self.seed = (
            token_budget, max_batch_size, num_buckets, seed,
        )
        edges = np.unique(np.quantile(lengths, np.linspace(0.0, 1.0, num_buckets + 1)))
        bucket = np.searchsorted(edges[1:-1], lengths, side="right")
        _, bucket = np.unique(bucket, return_inverse=True)  # drop empty buckets
        size = np.minimum(max_batch_size, token_budget // lengths)
        key = bucket * (max_batch_size + 1) + size
        order = np.argsort(key, kind="stable")
        keys, starts = np.unique(key[order], return_index=True)
        ends = np.append(starts[1:], order.size)
        # one group per (bucket, batch size): its sample indices (ascending) and its batch size
        self._groups = [(order[s:e], int(k % (max_batch_size + 1))) for k, s, e in zip(keys, starts, ends)]
        self._group_bucket = (keys // (max_batch_size + 1)).astype(np.int64)
        self._bucket = bucket
        sizes = []
        for idx, b in self._groups:
            full, rest = divmod(idx.size, b)
            sizes += [b] * full + ([rest] if rest else [])
        self._batch_sizes = np.asarray(sizes)
        self.batches_per_epoch = int(self._batch_sizes.size)
        self.epoch, self.index = 0, 0
        self._cache: tuple[int, list[list[int]]] | None = None

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All batches of ``epoch`` in order; the same on every call, process and rank."""
        rng = np.random.default_rng([self.seed, epoch])
        batches: list[list[int]] = []
        for idx, b in self._groups:
            perm = rng.permutation(idx)
            batches += np.split(perm, range(b, perm.size, b)) if perm.size > b else [perm]
        order = rng.permutation(len(batches))
        return [batches[j].tolist() for j in order]

    def _batches(self, epoch: int) -> list[list[int]]:
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, self.epoch_batches(epoch))
        return self._cache[1]

    def __iter__(self) -> Iterator[tuple[int, int, list[int]]]:
        """Yield (epoch, batch_index, indices) from the current position, across epochs, forever."""
        while True:
            batches = self._batches(self.epoch)
            while self.index < len(batches):
                k = self.index
                self.index += 1  # consumed as soon as it is handed out
                yield self.epoch, k, batches[k]
            self.epoch, self.index = self.epoch + 1, 0

    def __len__(self) -> int:
        return self.batches_per_epoch

    def state_dict(self) -> dict:
        """Position: the next batch handed out is batch ``index`` of ``epoch``."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "batches_per_epoch": self.batches_per_epoch}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``'s position (an index past this epoch's end moves to the next epoch)."""
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or index < 0:
            raise ValueError(f"invalid sampler state {state!r}: epoch and index must be >= 0")
        if index >= self.batches_per_epoch:
            epoch, index = epoch + 1, 0
        self.epoch, self.index = epoch, index

    def bucket_table(self) -> list[dict]:
        """One row per bucket: token range, samples, batches per epoch, share of all tokens."""
        total = float(self.lengths.sum())
        rows = []
        for bkt in range(int(self._bucket.max()) + 1):
            member = self._bucket == bkt
            lens = self.lengths[member]
            batches = sum(-(-idx.size // b) for (idx, b), g in zip(self._groups, self._group_bucket) if g == bkt)
            rows.append(
                {
                    "bucket": bkt,
                    "lo": int(lens.min()),
                    "hi": int(lens.max()),
                    "samples": int(lens.size),
                    "batches": int(batches),
                    "token_share": float(lens.sum() / total),
                }
            )
        return rows

    def summary(self) -> str:
        """The bucket table and batch statistics, as lines to print at the start of a run."""
        sizes = self._batch_sizes
        lines = [f"{'bucket':>6}  {'tokens':>13}  {'samples':>10}  {'batches':>8}  {'seq/batch':>9}  {'share':>6}"]
        for r in self.bucket_table():
            lines.append(
                f"{r['bucket']:>6}  {r['lo']:>6}-{r['hi']:<6}  {r['samples']:>10,}  {r['batches']:>8,}  "
                f"{r['samples'] / r['batches']:>9.1f}  {r['token_share']:>6.1%}"
            )
        lines.append(
            f"{self.lengths.size:,} samples, {int(self.lengths.sum()):,} tokens; "
            f"{self.batches_per_epoch:,} batches per epoch; sequences per batch "
            f"min {sizes.min()} / max {sizes.max()} / avg {sizes.mean():.1f} "
            f"(token_budget {self.token_budget:,}, max_batch_size {self.max_batch_size})"
        )
        return "\n".join(lines)


def shard_batches(batches: list[list[int]], rank: int, world: int) -> list[list[int]]:
    """This rank's batches: every ``world``-th batch from ``rank``, the tail dropped so all ranks get as many."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, world={world})")
    usable = len(batches) // world * world
    return batches[rank:usable:world]


def collate(dataset: ShardDataset, indices: Sequence[int], pad_id: int) -> dict:
    """Right-padded tensors for one batch.

    Returns ``input_ids [B,S] int64`` (padded with ``pad_id``), ``loss_mask [B,S] int8`` (0 on
    padding), ``attention_mask [B,S] int64`` (1 on real tokens), ``lengths [B] int64`` and
    ``eligible_anchors [B] int64``: positions a with loss_mask[a] and loss_mask[a+1] per row, counted
    here so the step knows its anchor layout without reading the GPU (a field kept on the host, see `to_device`).
    """
    import torch

    rows = [dataset.get(i) for i in indices]
    lengths = np.fromiter((ids.size for ids, _ in rows), dtype=np.int64, count=len(rows))
    seq = int(lengths.max()) if rows else 0
    input_ids = np.full((len(rows), seq), pad_id, dtype=np.int64)
    loss_mask = np.zeros((len(rows), seq), dtype=np.int8)
    for r, (ids, mask) in enumerate(rows):
        input_ids[r, : ids.size] = ids
        loss_mask[r, : ids.size] = mask
    attention_mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    eligible = (loss_mask[:, :-1] & loss_mask[:, 1:]).sum(axis=1, dtype=np.int64)
    return {
        "input_ids": torch.from_numpy(input_ids),
        "loss_mask": torch.from_numpy(loss_mask),
        "attention_mask": torch.from_numpy(attention_mask),
        "lengths": torch.from_numpy(lengths),
        "eligible_anchors": torch.from_numpy(eligible),
    }


HOST_FIELDS = ("eligible_anchors",)  # batch fields the step reads on the host: they stay there


def to_device(batch: dict, device) -> dict:
    """The batch on the step's device (non-blocking copies: pinned batches overlap the GPU's work), host fields kept."""
    return {key: v if key in HOST_FIELDS else v.to(device, non_blocking=True) for key, v in batch.items()}


PREFETCH_DEPTH = 4  # batches read and collated ahead of the training step


def prefetch(items: Iterator, depth: int = PREFETCH_DEPTH) -> Iterator:
    """``items`` in order, produced by a background thread up to ``depth`` ahead.

    Disk reads and collation (pyarrow and numpy release the GIL) then overlap the consumer's
    step instead of adding to it. An exception in the producer is raised in the consumer;
    closing or dropping the returned generator stops the thread and waits for it.
    """
    if depth <= 0:
        yield from items
        return
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(entry) -> bool:
        while not stop.is_set():
            try:
                slots.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((done, None))
        except BaseException as e:  # handed to the consumer
            put((done, e))

    worker = threading.Thread(target=produce, name="dflash-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            item, error = slots.get()
            if item is done:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        stop.set()
        # Wait for the item being read to finish: a thread still inside torch or pyarrow when the
        # interpreter exits aborts the process ("terminate called without an active exception").
        worker.join(timeout=30.0)
