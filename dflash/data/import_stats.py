"""The mask statistics of imported shards: the lines `dflash-data stats` adds for data `dflash-data import` wrote.

    from dflash.data.import_stats import stats_lines
    for line in stats_lines(ShardDataset("data/chats").shards):
        print(line)   # masked fraction, assistant tokens and assistant turns per row
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _per_row(flat: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Sum of `flat` within each row (rows given by offsets)."""
    total = np.concatenate([[0], np.cumsum(flat, dtype=np.int64)])
    return total[offsets[1:]] - total[offsets[:-1]]


def mask_rows(shard: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, masked tokens, assistant turns) per row of one shard. Turns come from the optional ``turns``
    column (written by import), else they are the masked spans (runs of 1s) of the row."""
    from dflash.data.shards import open_shard

    opened = open_shard(shard)
    lengths, masked, spans = [], [], []
    for chunk in (b.loss_mask for b in opened.batches):
        offsets = (chunk.offsets.to_numpy() - chunk.offsets[0].as_py()).astype(np.int64)
        m = chunk.flatten().to_numpy(zero_copy_only=False).astype(bool)
        prev = np.concatenate([[False], m[:-1]])
        prev[offsets[:-1][offsets[:-1] < m.size]] = False  # a span never continues across two rows
        lengths.append(np.diff(offsets))
        masked.append(_per_row(m, offsets))
        spans.append(_per_row(m & ~prev, offsets))
    turns = _cat(spans)
    if "turns" in opened.schema.names:
        turns = opened.column("turns").to_numpy().astype(np.int64)
    opened.close()
    return _cat(lengths), _cat(masked), turns


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def stats_lines(shards: list[Path]) -> list[str]:
    """The mask lines of `dflash-data stats`: masked fraction, assistant tokens and turns per row."""
    rows = [mask_rows(s) for s in shards]
    lengths, masked, turns = (np.concatenate([r[i] for r in rows]) for i in range(3))
    if lengths.size == 0:
        return []

    def describe(values: np.ndarray, fmt: str) -> str:
        return f"mean {values.mean():{fmt}}, median {np.median(values):,g}, max {values.max():,}"

    return [
        f"masked (learned) tokens: {masked.sum() / max(lengths.sum(), 1):.1%} ({int(masked.sum()):,} of "
        f"{int(lengths.sum()):,})",
        f"assistant tokens per row: {describe(masked, ',.0f')}",
        f"assistant turns per row: {describe(turns, '.1f')}",
    ]
