"""Warm-up: trace every shape class of a run before its first step, so no graph is built after it.

    dflash-train --warm-cache      warm_cache: compile once, write the compile cache's manifest for preflight
    Trainer.run of a compiled run  prime: the same steps in the training process, before step 1

What a shape class is and which batches stand for it: warm_batches. The trainer is passed in (a
dflash.train.trainer.Trainer); this module never imports it (the trainer imports this one).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

from dflash.config import RunConfig
from dflash.data.batching import collate, to_device
from dflash.data.packing import PackedBatchSampler
from dflash.train import compiled
from dflash.train.features import CachedTarget, LocalTarget
from dflash.train.step import micro_step, pad_token_id

__all__ = ["prime", "warm_batches", "warm_cache", "warm_steps"]


def prime(trainer) -> None:
    """Run warm_steps in the training process (its lines say "compile:"), recording startup.prime_s."""
    t0 = time.perf_counter()
    warm_steps(trainer, lambda line: trainer.log(line.replace("warm-cache:", "compile:", 1)))
    trainer.startup["prime_s"] = round(time.perf_counter() - t0, 1)


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


def warm_steps(trainer, log=print) -> list[tuple[int, int]]:
    """Run each of warm_batches through the target and the drafter, forward and backward (and through the held-out
    evaluation's no-gradient math when the run evaluates), gradients dropped, no update: dynamo traces a graph for
    every shape class of the run in this process. Its graphs live in the process (the kernels inductor compiles are
    cached on disk, which makes another process's trace quick), so `--warm-cache` runs this and every compiled run
    runs it again before its first step. Returns the (rows, length) shapes run."""
    pad = pad_token_id(trainer.source.target_config)
    features = trainer.source.features
    if isinstance(trainer.source, CachedTarget):
        features = functools.partial(LocalTarget.features, trainer.source)  # never into the feature cache
    shapes, classes = [], []
    t0 = time.perf_counter()
    for k, (name, indices) in enumerate(warm_batches(trainer.sampler)):
        batch = collate(trainer.dataset, indices, pad, trainer.cfg.data.packing)
        batch["sample_ids"] = torch.tensor(indices)
        batch = to_device(batch, trainer.device)
        context = features(k, batch)
        loss, _ = micro_step(trainer.drafter, trainer.embed_w, trainer.head_w, batch, context, trainer.cfg,
                             trainer.device, trainer.attn_backend, k)
        with trainer.par.warm_backward():  # DDP reduces nothing; a sharded drafter's ranks all run the same batches
            loss.backward()
        trainer.optimizer.zero_grad(set_to_none=trainer.par.zero_to_none)
        if trainer.heldout is not None:
            with torch.no_grad():
                micro_step(trainer.drafter, trainer.embed_w, trainer.head_w, batch, context, trainer.cfg,
                           trainer.device, trainer.attn_backend, k)
        shapes.append(tuple(batch["input_ids"].shape))
        classes += [name] if name not in classes else []
    log(f"warm-cache: {len(classes)} shape class(es) ({', '.join(classes)}) in {len(shapes)} batches of "
        f"{', '.join(f'{b} x {s}' for b, s in shapes)} tokens through the target and the drafter"
        f"{' (and the held-out math)' if trainer.heldout is not None else ''}; {compiled.graphs()} compiled "
        f"graph(s) in {time.perf_counter() - t0:.1f} s")
    return shapes


def warm_cache(cfg: RunConfig, cache: Path, colocated, log=print) -> int:
    """Compile the target's and the drafter's graphs for every shape class of the run once (warm_steps), then write
    the cache manifest preflight reads in `cache` (the profile's compile-cache dir, which dflash-train --warm-cache
    asks preflight for). `colocated`: Trainer.colocated, handed in by the command (the trainer imports this module)."""
    from dflash.runs.compile_manifest import write_manifest

    if cfg.device != "cuda" or not torch.cuda.is_available():
        log("warm-cache: nothing to compile on CPU (the target's layers and flex attention are compiled on CUDA only)")
        return 0
    trainer = colocated(cfg, None, log)
    t0 = time.perf_counter()
    warm_steps(trainer, log)
    torch.cuda.synchronize()
    import triton

    props = torch.cuda.get_device_properties(0)
    write_manifest(cache, {"torch": torch.__version__, "triton": triton.__version__, "gpu_name": props.name,
                           "compute_capability": f"{props.major}.{props.minor}", "drafter_hash": cfg.drafter_hash(),
                           "target_hash": cfg.target_hash()})
    log(f"warm-cache: compiled in {time.perf_counter() - t0:.1f} s; manifest written to {cache}")
    return 0
