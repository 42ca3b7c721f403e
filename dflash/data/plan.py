"""The plan of a run, torch-free: which samples it trains on, its batches, its total steps and lr schedule, and what a
resume changes about them. The one owner of the schedule rule: the trainer, the target ranks, the run dir and
preflight's run-dir check all ask it, so the gate's warning and the trainer's refusal cannot disagree.

    dataset, sampler, total = schedule(cfg, drafter_ranks=1)   # every rank of every layout walks this sequence
    batch_sampler(cfg, lengths)                                # data.packing's packs, else length buckets
    warm_batches(sampler), shape_classes(cfg, train_lengths)   # the batches that stand for each shape class
    schedule_change(checkpoint, cfg)                           # "total steps 30 -> 3 (train.max_steps 30 -> 3)" | None
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from dflash.config import RunConfig
from dflash.data.buckets import BucketBatchSampler
from dflash.data.packing import PackedBatchSampler
from dflash.data.shards import ShardDataset
from dflash.errors import DflashError

HOLDOUT_SALT = 0x401D  # mixed into the seed: the held-out choice differs from the batch shuffles of the same seed


class HeldOutError(DflashError):
    """[eval] that cannot work with this data; one line."""

    exit_code = 2


def holdout_ids(num_samples: int, n: int, seed: int) -> np.ndarray:
    """The n sample ids (sorted) of a dataset of num_samples that [eval] holdout takes out of training."""
    if n >= num_samples:
        raise HeldOutError(f"eval.holdout {n} takes every one of the {num_samples} samples of data.path out of "
                           "training; hold out fewer, or give a separate dataset as eval.path")
    return np.sort(np.random.default_rng([seed, HOLDOUT_SALT]).permutation(num_samples)[:n])


class SubsetDataset:
    """Some samples of a dataset, renumbered 0..n-1 (the sampler, collate and the feature cache see only them)."""

    def __init__(self, base, ids: np.ndarray, label: str):
        self.base, self.ids = base, np.asarray(ids, dtype=np.int64)
        self.path = base.path
        self.lengths = base.lengths[self.ids]
        digest = hashlib.sha256(self.ids.tobytes()).hexdigest()[:12]
        self.fingerprint = f"{base.fingerprint}:{label}:{digest}"  # a resume sees a changed holdout as changed data

    @property
    def num_samples(self) -> int:
        return int(self.ids.size)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))

    def __len__(self) -> int:
        return self.num_samples

    def get(self, i: int):
        return self.base.get(int(self.ids[i]))


def training_ids(cfg, num_samples: int) -> np.ndarray | None:
    """The sample ids a run trains on, less [eval] holdout's; None: all of them."""
    n = cfg.eval.holdout
    if not n:
        return None
    held = holdout_ids(num_samples, n, cfg.train.seed)
    return np.setdiff1d(np.arange(num_samples), held, assume_unique=True)


def training_dataset(cfg, dataset):
    """The samples a run trains on: all of data.path, less [eval] holdout's."""
    keep = training_ids(cfg, dataset.num_samples)
    return dataset if keep is None else SubsetDataset(dataset, keep, f"train-without-{cfg.eval.holdout}")


def heldout_dataset(cfg):
    """The held-out samples of a run with [eval] (None without): eval.path, or data.path's holdout ids."""

    if cfg.eval.path:
        return ShardDataset(cfg.eval.path)
    if cfg.eval.holdout:
        base = ShardDataset(cfg.data.path)
        return SubsetDataset(base, holdout_ids(base.num_samples, cfg.eval.holdout, cfg.train.seed), "heldout")
    return None


class RunError(DflashError):
    """A run that cannot start as configured; the message is one line."""


def cosine_lr(step: int, total: int, warmup_ratio: float) -> float:
    """LR multiplier: linear warmup over warmup_ratio of the steps, then cosine to 0."""
    warmup = max(1, int(round(total * warmup_ratio)))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def total_steps(cfg: RunConfig, batches_per_epoch: int, batches_per_step: int) -> int:
    """Optimizer steps of the run: train.max_steps, else whole steps in `epochs` passes over the data."""
    steps = cfg.train.max_steps or cfg.train.epochs * batches_per_epoch // batches_per_step
    if steps < 1:
        raise RunError(f"{cfg.data.path}: {batches_per_epoch} batches per epoch x {cfg.train.epochs} epochs make no "
                       f"step of {batches_per_step} batches; add data or epochs, or set train.max_steps")
    return steps


def batch_sampler(cfg: RunConfig, lengths: np.ndarray) -> BucketBatchSampler | PackedBatchSampler:
    """The batches cfg's [data] makes of samples of these lengths: packs with data.packing, else length buckets."""
    d = cfg.data
    if d.packing:
        return PackedBatchSampler(lengths, d.token_budget, d.max_batch_size, cfg.train.seed)
    return BucketBatchSampler(lengths, d.token_budget, d.max_batch_size, d.num_buckets, cfg.train.seed,
                              d.pack_remainders)


def schedule(cfg: RunConfig, drafter_ranks: int):
    """(dataset, sampler, total optimizer steps) of a run whose steps take grad_accum x drafter_ranks batches.

    Every rank of every layout builds its batch sequence here, so all walk the same one.
    """

    dataset = training_dataset(cfg, ShardDataset(cfg.data.path))  # less [eval] holdout's samples
    sampler = batch_sampler(cfg, dataset.lengths)
    return dataset, sampler, total_steps(cfg, sampler.batches_per_epoch, cfg.train.grad_accum * drafter_ranks)


def warm_batches(sampler) -> list[tuple[str, list[int]]]:
    """The batches `--warm-cache` runs, [(shape class, indices)]: each class of batch the plan makes, at both ends.

    Every compiled piece (the target's layers by layer type, the drafter's projections and MLP, flex attention per
    mask kind) reads the sizes that change from batch to batch (rows, length, anchors, tiles) as dynamic sizes or
    tensors, so a graph serves a whole class, not one shape. What still splits a class: dynamo specialises a size
    of 1 (a one-row batch: the last partial batch of a bucket, or a sample as long as the budget), and a size on
    one side of a fixed one may be guarded (a batch with fewer context rows than the hidden width). So for batches
    of two rows or more and for one-row batches, the batch with the most and the one with the fewest padded tokens
    of epoch 0 (every epoch has the same batch sizes), and the one with the most rows. Packed (data.packing), every
    batch is one row: the packs with the most and the fewest tokens, and with the most and the fewest sequences."""
    lengths = sampler.lengths
    batches = sampler.epoch_batches(0)
    if isinstance(sampler, PackedBatchSampler):  # one row each: one class, its sizes the tokens and the sequences
        picked = []
        for b in (max(batches, key=lambda b: int(lengths[b].sum())), min(batches, key=lambda b: int(lengths[b].sum())),
                  max(batches, key=len), min(batches, key=len)):
            if all(b != p for _, p in picked):
                picked.append(("packed", list(b)))
        return picked

    def tokens(b):
        return len(b) * int(lengths[b].max())

    picked: list[tuple[str, list[int]]] = []
    for name, group in (("rows >= 2", [b for b in batches if len(b) > 1]), ("one row", [b for b in batches
                                                                                       if len(b) == 1])):
        seen = set()
        for b in (max(group, key=tokens), min(group, key=tokens), max(group, key=len)) if group else ():
            shape = (len(b), int(lengths[b].max()))
            if shape not in seen:
                seen.add(shape)
                picked.append((name, list(b)))
    return picked


def training_lengths(cfg: RunConfig, lengths: np.ndarray) -> np.ndarray:
    """The lengths of the samples a run trains on, from those of all of data.path (less [eval] holdout's)."""
    keep = training_ids(cfg, len(lengths))
    return np.asarray(lengths if keep is None else lengths[keep], dtype=np.int64)


def shape_classes(cfg: RunConfig, train_lengths: np.ndarray) -> list[list]:
    """[[shape class, rows, tokens a row], ...] of the batches warm_batches picks from the samples a run trains on
    (packed: [["packed", sequences, tokens], ...]): what a compile cache artifact was warmed for
    (dflash.runs.compile_artifact), computed alike by the trainer and by preflight (from training_lengths)."""
    lengths = np.asarray(train_lengths, dtype=np.int64)
    out = []
    for name, b in warm_batches(batch_sampler(cfg, lengths)):
        tokens = int(lengths[b].sum()) if name == "packed" else int(lengths[b].max())
        out.append([name, len(b), tokens])
    return out


def schedule_change(meta: dict | None, state: dict | None, cfg: RunConfig) -> str | None:
    """How resuming a checkpoint (its meta.json and trainer state, dflash.runs.resume.resume_record) under `cfg`
    changes the lr schedule, or None when it does not.

    The cosine schedule is fixed by the peak lr, the warmup share and the run's total optimizer steps,
    which train.max_steps, train.epochs, train.grad_accum, the drafter ranks, the batching settings and
    the dataset all enter. E.g. "total steps 30 -> 3 (train.max_steps 30 -> 3)". None also when the
    checkpoint does not say enough to tell (then nothing is refused).
    """
    try:
        old = RunConfig.model_validate((meta or {})["config"])
        batches_per_epoch = int((state or {})["sampler"]["batches_per_epoch"])
        old_ranks = int(state.get("n_drafters") or 1)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    new_ranks = len(cfg.topology.trainer_gpus) or 1
    try:
        old_total = total_steps(old, batches_per_epoch, old.train.grad_accum * old_ranks)
        dataset, sampler, new_total = schedule(cfg, new_ranks)
    except DflashError:  # a dataset that cannot be read: the gate's dataset check says why
        return None
    changes = []
    if old_total != new_total:
        changes.append(f"total steps {old_total:,} -> {new_total:,}")
    for section, key in (("train", "lr"), ("train", "warmup_ratio")):
        a, b = getattr(getattr(old, section), key), getattr(getattr(cfg, section), key)
        if a != b:
            changes.append(f"{section}.{key} {a} -> {b}")
    if not changes:
        return None
    causes = [f"{s}.{k} {getattr(getattr(old, s), k)} -> {getattr(getattr(cfg, s), k)}"
              for s, k in (("train", "max_steps"), ("train", "epochs"), ("train", "grad_accum"),
                           ("data", "token_budget"), ("data", "max_batch_size"), ("data", "num_buckets"),
                           ("data", "pack_remainders"), ("data", "packing"))
              if getattr(getattr(old, s), k) != getattr(getattr(cfg, s), k)]
    if old_ranks != new_ranks:
        causes.append(f"drafter ranks {old_ranks} -> {new_ranks}")
    samples = ((meta or {}).get("dataset") or {}).get("samples")
    if isinstance(samples, int) and samples != dataset.num_samples:
        causes.append(f"dataset {samples:,} -> {dataset.num_samples:,} samples")
    elif batches_per_epoch != sampler.batches_per_epoch:
        causes.append(f"batches per epoch {batches_per_epoch:,} -> {sampler.batches_per_epoch:,}")
    return ", ".join(changes) + (f" ({', '.join(causes)})" if causes else "")
