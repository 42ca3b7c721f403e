"""Batches: ``BucketBatchSampler`` groups samples of similar length so that every batch holds at most
``max_batch_size`` sequences and at most ``token_budget`` padded tokens (deterministic given (seed, epoch), resumes
mid-epoch); ``collate`` turns a batch into padded tensors; ``prefetch`` reads ahead on a thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence

import numpy as np

from dflash.data.shards import ShardDataset

# ---------------------------------------------------------------------------------------------
# Batching






def collate(dataset: ShardDataset, indices: Sequence[int], pad_id: int, packed: bool = False) -> dict:
    """Right-padded tensors for one batch (packed: `collate_packed`'s one row).

    Returns ``input_ids [B,S] int64`` (padded with ``pad_id``), ``loss_mask [B,S] int8`` (0 on
    padding), ``attention_mask [B,S] int64`` (1 on real tokens), ``lengths [B] int64`` and
    ``eligible_anchors [B] int64``: positions a with loss_mask[a] and loss_mask[a+1] per row, counted
    here so the step knows its anchor layout without reading the GPU (a field kept on the host, see `to_device`).
    """
    import torch

    if packed:
        return collate_packed(dataset, indices)
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


def collate_packed(dataset: ShardDataset, indices: Sequence[int]) -> dict:
    """One row holding the batch's samples end to end, in the given order, no padding (data.packing).

    Returns ``input_ids [1,T] int64``, ``loss_mask [1,T] int8``, ``position_ids [1,T] int64`` (each token's offset in
    its sample: RoPE reads it), ``cu_seqlens [n+1] int32`` (the samples' starts, then T: the kernels' boundaries),
    ``lengths [n] int64`` and ``eligible_anchors [1] int64``: positions a with loss_mask[a] and loss_mask[a+1] and
    a + 1 in a's sample, counted here as `collate` does.
    """
    import torch

    rows = [dataset.get(i) for i in indices]
    lengths = np.fromiter((ids.size for ids, _ in rows), dtype=np.int64, count=len(rows))
    input_ids = np.concatenate([ids for ids, _ in rows]).astype(np.int64)[None]
    loss_mask = np.concatenate([mask for _, mask in rows]).astype(np.int8)[None]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    position_ids = (np.arange(cu[-1]) - np.repeat(cu[:-1], lengths))[None]
    eligible = loss_mask[:, :-1] & loss_mask[:, 1:] & (position_ids[:, 1:] != 0)
    return {
        "input_ids": torch.from_numpy(input_ids),
        "loss_mask": torch.from_numpy(loss_mask),
        "position_ids": torch.from_numpy(position_ids),
        "cu_seqlens": torch.from_numpy(cu.astype(np.int32)),
        "lengths": torch.from_numpy(lengths),
        "eligible_anchors": torch.from_numpy(eligible.sum(axis=1, dtype=np.int64)),
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
