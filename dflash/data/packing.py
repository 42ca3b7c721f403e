"""Packed batches (data.packing): ``PackedBatchSampler`` lays samples end to end, as many as fit ``token_budget``
tokens in all and at most ``max_batch_size`` of them; the packs are made once from the lengths and are the same
batches in every epoch, in an order shuffled per (seed, epoch); resumable mid-epoch. Torch-free, like the bucketed
sampler (dflash.data.buckets) whose interface it has: the plan (dflash.data.plan) picks one of the two.
"""

from __future__ import annotations

import bisect

import numpy as np

from dflash.data.buckets import EpochSampler

_BIN_BITS = 32  # a bin's free space and its number in one int: free << _BIN_BITS | bin, sorted by free space


class PackedBatchSampler(EpochSampler):
    """Packs under a token budget: sum of lengths <= token_budget, len(pack) <= max_batch_size.

    The packs are best-fit decreasing over the lengths alone (the seed plays no part, so every process and rank
    makes the same ones): longest sample first, each into the fullest pack it still fits, a new pack when none
    does. Each pack lists its samples in ascending order; each epoch shuffles the packs' order only.
    """

    def __init__(self, lengths: np.ndarray, token_budget: int, max_batch_size: int, seed: int):
        if token_budget < 1 or max_batch_size < 1:
            raise ValueError("token_budget and max_batch_size must be >= 1")
        super().__init__(lengths, token_budget, seed)
        self.max_batch_size = max_batch_size
        self._packs = best_fit_decreasing(self.lengths, token_budget, max_batch_size)
        self.batches_per_epoch = len(self._packs)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All batches of ``epoch`` in order; the same on every call, process and rank."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self._packs))
        return [list(self._packs[j]) for j in order.tolist()]  # copies: a caller's edit never reaches the packs

    def summary(self) -> str:
        """Batch statistics, as lines to print at the start of a run."""
        sizes = np.array([len(p) for p in self._packs])
        tokens = np.array([int(self.lengths[p].sum()) for p in self._packs])
        return (f"{self.lengths.size:,} samples, {int(self.lengths.sum()):,} tokens; {self.batches_per_epoch:,} packed "
                f"batches per epoch (data.packing), {self.fill:.1%} of the token budget used\n"
                f"sequences per batch min {sizes.min()} / max {sizes.max()} / avg {sizes.mean():.1f}; "
                f"tokens per batch min {tokens.min():,} / max {tokens.max():,} "
                f"(token_budget {self.token_budget:,}, max_batch_size {self.max_batch_size})")


def best_fit_decreasing(lengths: np.ndarray, token_budget: int, max_batch_size: int) -> list[list[int]]:
    """Sample ids in packs, each summing to at most token_budget tokens and holding at most max_batch_size ids.

    Longest first (ties by id), each sample goes into the open pack with the least free space that still holds it.
    The open packs sit in one ascending list of their free space, so a sample finds its pack by bisection; a pack
    leaves the list when it is full (max_batch_size samples, or less room than the shortest sample).
    """
    order = np.argsort(-lengths, kind="stable")
    shortest = int(lengths.min())
    low = (1 << _BIN_BITS) - 1
    open_packs: list[int] = []  # free << _BIN_BITS | pack, ascending
    free: list[int] = []
    packs: list[list[int]] = []
    for i, n in zip(order.tolist(), lengths[order].tolist()):
        at = bisect.bisect_left(open_packs, n << _BIN_BITS)
        if at == len(open_packs):
            b = len(packs)
            packs.append([i])
            free.append(token_budget - n)
        else:
            b = open_packs.pop(at) & low
            packs[b].append(i)
            free[b] -= n
        if free[b] >= shortest and len(packs[b]) < max_batch_size:
            bisect.insort(open_packs, free[b] << _BIN_BITS | b)
    return [sorted(p) for p in packs]
