"""Length buckets: ``BucketBatchSampler`` groups samples of similar length so that every batch holds at most
``max_batch_size`` sequences and at most ``token_budget`` padded tokens; deterministic given (seed, epoch), resumable
mid-epoch. ``EpochSampler`` is what it shares with the packing sampler (dflash.data.packing): the checks of the
lengths, the position in the walk over epochs and its resume. Torch-free: the plan (dflash.data.plan) counts a run's
batches with them.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from dflash.data.identity import DatasetError
from dflash.data.shards import check_max_length


class EpochSampler:
    """An endless walk over epochs of batches, ``batches_per_epoch`` of them in every epoch, resumable mid-epoch.

    A subclass lists an epoch's batches in ``epoch_batches(epoch)`` (the same on every call, process and rank) and
    sets ``batches_per_epoch``; this class checks the lengths and keeps the position.
    """

    batches_per_epoch: int

    def __init__(self, lengths: np.ndarray, token_budget: int, seed: int):
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.size == 0:
            raise DatasetError("no samples to batch")
        empty = np.flatnonzero(lengths < 1)
        if empty.size:
            raise DatasetError(f"sample {int(empty[0])} is empty (0 tokens); drop empty samples from the dataset")
        check_max_length(lengths, token_budget, field="data.token_budget")
        self.lengths, self.token_budget, self.seed = lengths, token_budget, seed
        self.epoch, self.index = 0, 0
        self._cache: tuple[int, list[list[int]]] | None = None

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        raise NotImplementedError

    @property
    def fill(self) -> float:
        """Share of the token budget an epoch's batches hold in real tokens: tokens / (batches x token_budget)."""
        return float(self.lengths.sum()) / (self.batches_per_epoch * self.token_budget)

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


class BucketBatchSampler(EpochSampler):
    """Length-bucketed batches under a token budget, deterministic per (seed, epoch), resumable.

    Samples are bucketed by length with quantile edges. Inside a bucket, each sample belongs to
    the class of the largest batch size its length allows, ``min(max_batch_size, token_budget //
    length)``; a batch is ``size`` samples of one (bucket, class) group, so every batch meets
    ``len(batch) <= max_batch_size`` and ``max_len * len(batch) <= token_budget`` whatever the
    shuffle, and the number of batches per epoch is the same in every epoch.
    Each epoch: shuffle within groups, cut into batches, shuffle the batch order.
    """

    def __init__(self, lengths: np.ndarray, token_budget: int, max_batch_size: int, num_buckets: int, seed: int,
                 pack_remainders: bool = False):
        if token_budget < 1 or max_batch_size < 1 or num_buckets < 1:
            raise ValueError("token_budget, max_batch_size and num_buckets must be >= 1")
        super().__init__(lengths, token_budget, seed)
        lengths = self.lengths
        self.max_batch_size, self.num_buckets = max_batch_size, num_buckets
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
        self._packed: list[np.ndarray] = []  # pack_remainders: the groups' remainders, packed once across groups
        if pack_remainders:
            self._groups, rest = _split_remainders(self._groups, lengths)
            self._packed = _pack(rest, lengths, token_budget, max_batch_size)
        sizes = []
        for idx, b in self._groups:
            full, rest = divmod(idx.size, b)
            sizes += [b] * full + ([rest] if rest else [])
        sizes += [p.size for p in self._packed]
        self._batch_sizes = np.asarray(sizes)
        self.batches_per_epoch = int(self._batch_sizes.size)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All batches of ``epoch`` in order; the same on every call, process and rank."""
        rng = np.random.default_rng([self.seed, epoch])
        batches: list[list[int]] = []
        for idx, b in self._groups:
            if idx.size == 0:  # every sample of it went to the packed batches
                continue
            perm = rng.permutation(idx)
            batches += np.split(perm, range(b, perm.size, b)) if perm.size > b else [perm]
        batches += self._packed
        order = rng.permutation(len(batches))
        return [batches[j].tolist() for j in order]

    def bucket_table(self) -> list[dict]:
        """One row per bucket: token range, samples, batches per epoch, share of all tokens."""
        total = float(self.lengths.sum())
        rows = []
        for bkt in range(int(self._bucket.max()) + 1):
            member = self._bucket == bkt
            lens = self.lengths[member]
            batches = sum(-(-idx.size // b) for (idx, b), g in zip(self._groups, self._group_bucket) if g == bkt)
            batches += sum(int(np.any(self._bucket[p] == bkt)) for p in self._packed) if self._packed else 0
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
            f"{self.batches_per_epoch:,} batches per epoch"
            f"{f' ({len(self._packed):,} of them packed from the buckets remainders)' if self._packed else ''}; "
            f"sequences per batch "
            f"min {sizes.min()} / max {sizes.max()} / avg {sizes.mean():.1f} "
            f"(token_budget {self.token_budget:,}, max_batch_size {self.max_batch_size})"
        )
        return "\n".join(lines)


def _split_remainders(groups, lengths: np.ndarray) -> tuple[list, np.ndarray]:
    """Each group less its remainder (idx.size % batch size samples, its longest: the same ones every epoch, so the
    packed batches and the count per epoch never change), and the remainders pooled."""
    kept, rest = [], []
    for idx, b in groups:
        r = idx.size % b
        by_length = idx[np.argsort(lengths[idx], kind="stable")]
        kept.append((np.sort(by_length[: idx.size - r]), b))
        rest.append(by_length[idx.size - r:])
    return kept, np.concatenate(rest) if rest else np.zeros(0, dtype=np.int64)


def _pack(indices: np.ndarray, lengths: np.ndarray, token_budget: int, max_batch_size: int) -> list[np.ndarray]:
    """Batches of `indices` under the same rule as every batch (at most max_batch_size rows, rows x longest row <=
    token_budget), longest first: each batch starts at the longest sample left and takes the next ones while they fit.
    """
    order = indices[np.argsort(-lengths[indices], kind="stable")]
    out, start = [], 0
    while start < order.size:
        cap = min(max_batch_size, token_budget // int(lengths[order[start]]))
        out.append(np.sort(order[start:start + cap]))
        start += cap
    return out


def shard_batches(batches: list[list[int]], rank: int, world: int) -> list[list[int]]:
    """This rank's batches: every ``world``-th batch from ``rank``, the tail dropped so all ranks get as many."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, world={world})")
    usable = len(batches) // world * world
    return batches[rank:usable:world]
