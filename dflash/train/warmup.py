"""Warm-up: trace every shape class of a run before its first step, so no graph is built after it.

    dflash-train --warm-cache      dflash.train.compile_cache.warm_cache: compile once, write the artifact
    Trainer.run of a compiled run  prime: the same steps in the training process, before step 1

What a shape class is and which batches stand for it: warm_batches. The trainer is passed in (a
dflash.train.trainer.Trainer); this module never imports it (the trainer imports this one).
"""

from __future__ import annotations

import functools
import time

import torch

from dflash.data.batching import collate, to_device
from dflash.data.plan import warm_batches
from dflash.runs.records import process_age_s
from dflash.train import compiled
from dflash.train.features import CachedTarget, LocalTarget
from dflash.train.step import micro_step, pad_token_id

__all__ = ["cache_counts", "needed_batches", "prime", "warm_batches", "warm_steps"]


def prime(trainer, manifest: dict | None = None) -> None:
    """Run warm_steps in the training process (its lines say "compile:"), recording startup.prime_s. `manifest`: the
    compile cache artifact the run loaded: its warm-up's graphs after each batch say how many batches built every
    graph (needed_batches), and only those run."""
    t0 = time.perf_counter()
    cold = manifest.get("cold") if isinstance(manifest, dict) else None
    batches = needed_batches(cold.get("graphs_after") if isinstance(cold, dict) else None)
    warm_steps(trainer, lambda line: trainer.log(line.replace("warm-cache:", "compile:", 1)),
               batches=trainer.agreed_batches(batches))
    trainer.startup["prime_s"] = round(time.perf_counter() - t0, 1)


def needed_batches(graphs_after) -> int | None:
    """How many warm batches built every graph, from a warm-up's graphs after each batch ([7, 7, 7] -> 1,
    [4, 4, 4, 6] -> 4); None (all of them) when there is no such record."""
    if not isinstance(graphs_after, list) or not graphs_after or \
            not all(isinstance(n, int) and not isinstance(n, bool) for n in graphs_after):
        return None
    return graphs_after.index(graphs_after[-1]) + 1


def cache_counts() -> dict[str, int]:
    """Graphs inductor took from its FX graph cache (hits) and compiled from scratch (misses) in this process."""
    from torch._dynamo.utils import counters

    return {"fx_graph_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
            "fx_graph_misses": int(counters["inductor"]["fxgraph_cache_miss"])}


def _cache_text(counts: dict[str, int]) -> str:
    hits, misses = counts["fx_graph_hits"], counts["fx_graph_misses"]
    return f" (inductor: {hits} from its cache, {misses} compiled from scratch)" if hits or misses else ""


def warm_steps(trainer, log=print, losses: list | None = None, *, batches: int | None = None,
               record: dict | None = None) -> list[tuple[int, int]]:
    """Run each of warm_batches through the target and the drafter, forward and backward (and through the held-out
    evaluation's no-gradient math when the run evaluates), gradients dropped, no update: dynamo traces a graph for
    every shape class of the run in this process. Its graphs live in the process (the kernels inductor compiles are
    cached on disk, which makes another process's trace quick), so `--warm-cache` runs this and every compiled run
    runs it again before its first step. Returns the (rows, length) shapes run; `losses` gets each batch's loss.
    `batches`: only the first so many (a run from an artifact whose warm-up built every graph in those); `record`
    gets "graphs_after" (graphs after each batch) and "ages_s" (the process's age after each)."""
    pad = pad_token_id(trainer.source.target_config)
    features = trainer.source.features
    if isinstance(trainer.source, CachedTarget):
        features = functools.partial(LocalTarget.features, trainer.source)  # never into the feature cache
    shapes, classes, after = [], [], []  # after: graphs built so far, batch by batch (which batches add any)
    t0 = time.perf_counter()
    picked = warm_batches(trainer.sampler)
    ages = []
    for k, (name, indices) in enumerate(picked[:batches] if batches else picked):
        batch = collate(trainer.dataset, indices, pad, trainer.cfg.data.packing)
        batch["sample_ids"] = torch.tensor(indices)
        batch = to_device(batch, trainer.device)
        context = features(k, batch)
        loss, _ = micro_step(trainer.drafter, trainer.embed_w, trainer.head_w, batch, context, trainer.cfg,
                             trainer.device, trainer.attn_backend, k)
        if losses is not None:
            losses.append(float(loss.detach()))
        with trainer.par.warm_backward():  # DDP reduces nothing; a sharded drafter's ranks all run the same batches
            loss.backward()
        trainer.optimizer.zero_grad(set_to_none=trainer.par.zero_to_none)
        if trainer.heldout is not None:
            with torch.no_grad():
                micro_step(trainer.drafter, trainer.embed_w, trainer.head_w, batch, context, trainer.cfg,
                           trainer.device, trainer.attn_backend, k)
        shapes.append(tuple(batch["input_ids"].shape))
        after.append(compiled.graphs())
        ages.append(process_age_s())
        classes += [name] if name not in classes else []
    if record is not None:
        record.update(graphs_after=after, ages_s=ages)
    skipped = len(picked) - len(shapes)
    cut = (f"; {skipped} more the artifact's warm-up showed build nothing were not run" if skipped else "")
    log(f"warm-cache: {len(classes)} shape class(es) ({', '.join(classes)}) in {len(shapes)} batches of "
        f"{', '.join(f'{b} x {s}' for b, s in shapes)} tokens through the target and the drafter"
        f"{' (and the held-out math)' if trainer.heldout is not None else ''}; {compiled.graphs()} compiled "
        f"graph(s){_cache_text(cache_counts())} in {time.perf_counter() - t0:.1f} s; graphs after each batch: "
        f"{', '.join(map(str, after))}{cut}")
    return shapes
