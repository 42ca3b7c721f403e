"""The trainer: one loop for every layout.

    run(cfg, resume_from)          co-located: the target in this process (`LocalTarget`)
    Trainer(cfg, RemoteTargets)    a split drafter rank: features arrive from target ranks (dflash.train.ranks)
    Trainer.colocated(cfg, group=) a co-located data-parallel rank: its own target, DDP over the drafter

Reads as a plain loop: build -> (resume) -> step -> evaluate -> save -> record -> finish. What a step
computes lives in dflash.train.step; what a run records while it trains (metrics.jsonl, outcome.json, trackers,
the step lines, the tok/s window) in dflash.train.recorder; the warm-up of a compiled run (and --warm-cache) in
dflash.train.warmup; where its features come from is the feature source; with a
drafter process group the drafter is data-parallel and rank 0 of that group logs and saves.
Every rank walks the same deterministic batch sequence: a step takes the next
grad_accum x world global batches, and this rank trains those at positions j % world == rank.
With [eval], held-out numbers (dflash.train.heldout) join the metrics rows and the best of them moves
checkpoints/best; with report_to, trackers (dflash.train.trackers) receive every row.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.config import ConfigError, RunConfig, dump_config
from dflash.data.batching import collate, prefetch, to_device
from dflash.data.plan import RunError, schedule
from dflash.models.attention import backend_for, compiled_on
from dflash.models.drafter import DFlashDrafter, compiles_on, drafter_config_for_run, start_compile_workers
from dflash.models.fp8 import fp8_problem
from dflash.models.weights import RANDOM_WEIGHTS_WARNING
from dflash.runs import checkpoint as ckpt
from dflash.runs import rundir
from dflash.runs.records import process_age_s
from dflash.runs.resume import incompatible, incompatible_fix, restore_position
from dflash.runs.verify import checkpoint_problem, meta_or_problem, read_meta
from dflash.train import compile_cache, compiled, parallel
from dflash.train.features import FeatureSource, LocalTarget, local_source, target_folder
from dflash.train.heldout import best_key
from dflash.train.loss import read_metrics
from dflash.train.recorder import Recorder
from dflash.train.step import (
    average_metrics,
    build_optimizer,
    clip_and_step,
    micro_step,
    pad_token_id,
    resolve_mask_token_id,
    set_lr,
)
from dflash.train.warmup import prime

__all__ = ["NonFiniteError", "RunError", "StopFlag", "Trainer", "run", "run_device"]

STOP_NOTE_BYTES = 1 << 30  # a checkpoint this large or larger: the first step says how long a stop will take
DUPLICATE_SIGNAL_S = 2.0  # the same signal again within this many seconds is the same stop
DIVERGED_FIX = ("nothing was saved from it, earlier checkpoints are intact; lower train.lr or check the data, then "
                "dflash-train --resume latest")


class NonFiniteError(RunError):
    """A loss, gradient norm or weight that is inf or nan: the run stops before saving anything from that step."""


@dataclass
class StopFlag:
    """Set by SIGINT/SIGTERM; the loop finishes its step, checkpoints and returns (dflash-train exits 75).

    Once a stop is under way, a second signal must not kill a process that has or is writing its checkpoint (a
    scheduler signals the whole process group, `uv run` forwards the same signal): the handler ignores it, and stays
    installed after the loop returned (``restore``). SIGTERM again never aborts the stop (a scheduler's abort
    is SIGKILL); SIGINT again, later than DUPLICATE_SIGNAL_S, does (a person pressing Ctrl-C twice)."""
    requested: bool = False
    signame: str = ""
    _at: float = 0.0
    at_step: int | None = None  # the step in flight when the signal came (set by the loop)
    _old: dict = field(default_factory=dict)

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        """The handlers the process had, unless a stop came: then this one stays, so that a late duplicate of the
        stop's signal is still the same stop (dflash-train then ignores both signals outright before it exits 75:
        the interpreter's shutdown sets every Python handler back to the default, which would die of a late signal,
        but keeps an ignored signal ignored)."""
        if self.requested:
            return
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def seconds(self) -> float:
        """Seconds since the stop's signal."""
        return time.monotonic() - self._at

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            if name == "SIGINT" == self.signame and time.monotonic() - self._at >= DUPLICATE_SIGNAL_S:
                raise KeyboardInterrupt  # Ctrl-C again, later: leave now
            # torchrun's SIGTERM after a Ctrl-C, one stop delivered twice (a scheduler signals every process and a
            # launcher forwards it), or a scheduler's repeated SIGTERM: the same stop, already under way
            return
        self.requested = True
        self.signame = name
        self._at = time.monotonic()
        again = "press Ctrl-C again to abort" if name == "SIGINT" else "SIGKILL aborts it"
        print(f"\n{self.signame}: finishing this step, then saving a checkpoint ({again})",
              file=sys.stderr, flush=True)


def stop_line(times: dict) -> str:
    """'14.2 s from the signal to the checkpoint: the step in flight 4.1 s, weights 2.0 s, optimizer 6.3 s, ...'."""
    names = {"step_s": "the step in flight", "weights_s": "weights", "optimizer_s": "optimizer state",
             "hash_wait_s": "hashing", "fsync_s": "fsync", "rename_s": "rename"}
    parts = ", ".join(f"{label} {times[k]:.1f} s" for k, label in names.items() if times.get(k) is not None)
    total = times.get("total_s")
    head = f"{total:.1f} s from the signal to the checkpoint" if total is not None else "stop"
    return head + (f" ({parts})" if parts else "") + ("; the save in flight was given up" if times.get("superseded")
                                                      else "")


def run_device(cfg: RunConfig) -> torch.device:
    """The device this process trains on (a split worker has already picked its GPU)."""
    if cfg.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Trainer:
    def __init__(self, cfg: RunConfig, source: FeatureSource, resume_from: Path | None = None, group=None,
                 log=print, provenance: dict | None = None):
        """`provenance`: what wrote this run (the command asks preflight once), kept in every checkpoint's meta."""
        t_setup = time.perf_counter()
        self.cfg, self.source, self.group, self.log = cfg, source, group, log
        self.provenance = dict(provenance or {})
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world = dist.get_world_size(group) if group is not None else 1
        self.is_logger = self.rank == 0
        if not self.is_logger:
            self.log = lambda *_, **__: None  # rank 0 of the drafter group speaks for all
        self.out = Path(cfg.output_dir)
        self.device = run_device(cfg)
        self.attn_backend = backend_for(self.device)
        torch.manual_seed(cfg.train.seed)

        self.dataset, self.sampler, self.total_steps = schedule(cfg, self.world)
        self.batches_per_step = cfg.train.grad_accum * self.world

        tcfg = source.target_config
        dcfg = drafter_config_for_run(cfg, tcfg, resolve_mask_token_id(cfg, tcfg))
        with torch.device(self.device):  # drawn where it trains: the 27B preset's 1.7B parameters took 24 s on two cores
            self.drafter = DFlashDrafter(dcfg)
        self.drafter.to(self.device, torch.float32)
        self.data_parallel, self.parallel_why = self._choose_parallel()
        self.recompute, self.recompute_why = self._choose_recompute()
        self.drafter.set_recompute(self.recompute)
        compiles = cfg.train.compile and (compiled_on(self.device) or compiles_on(self.device))
        self.drafter.set_compile(compiles)
        if compiles:
            compiled.strict()  # a recompile limit ends the run in one line, never an eager fallback
        self.watch = compiled.RecompileWatch()
        problem = fp8_problem(cfg.train.fp8, self.device)  # a GPU without fp8 tensor cores
        if problem:
            raise ConfigError(problem)
        try:
            self.drafter.set_fp8(cfg.train.fp8)
        except ValueError as e:  # drafter sizes the fp8 matmuls cannot take
            raise ConfigError(str(e)) from None
        self.embed_w, self.head_w = source.frozen_weights()
        self.step = 0
        self.resumed_from = None
        self.init_line = None
        self.last_checkpoint: Path | None = None
        # at most one save in flight; in the background with train.async_save (dflash.runs.checkpoint)
        self.writer = ckpt.CheckpointWriter(self.out, background=cfg.train.async_save)
        if cfg.init_from and resume_from is None:
            from dflash.train.warmstart import load_init

            self.init_line = load_init(self.drafter, cfg.init_from)
        resumed = self._resume_weights(resume_from) if resume_from is not None else None  # full state, before sharding
        # the one wrap site: one rank bare, several DDP or FSDP2 (dflash.train.parallel); the optimizer after it
        self.par = parallel.wrap(self.drafter, self.data_parallel, group, self.device)
        self.measure_only = parallel.is_fake(group)  # the fake process group measures memory and compute only
        self.optimizer = build_optimizer(self.drafter, cfg)
        if resumed is not None:
            self._resume(resume_from, *resumed)
        self.heldout = self._heldout()
        self.best_key = best_key(cfg)
        self.best = _best_value(self.out, self.best_key) if self.heldout is not None else None
        # seconds per startup phase, logged and recorded at the first step (colocated() adds the target's load)
        self.startup = {"setup_s": round(time.perf_counter() - t_setup, 1)}

    def _choose_parallel(self) -> tuple[str, str]:
        """How several drafter ranks hold the drafter (train.data_parallel, or for auto what the memory model fits on
        this GPU: ddp where it fits, else fsdp2); "none" for one rank."""
        mode = self.cfg.train.data_parallel
        if self.world == 1:
            return "none", "one drafter rank"
        if mode != "auto":
            return mode, "as configured"
        if self.device.type != "cuda":
            return "ddp", "auto on CPU"
        from dflash.memory.parts import choose_parallel

        usable = self._usable_bytes()
        try:
            mode, _recompute, need = choose_parallel(self.cfg, self.cfg.topology.trainer_role, torch.version.cuda or "12.8",
                                                     usable)
        except ValueError as e:  # a shape the memory model cannot read: the replica DDP always was
            return "ddp", f"auto: memory model unavailable ({e})"
        return mode, (f"auto: predicted peak {need / 2**30:.1f} GiB + {self.cfg.train.memory_headroom_gib:g} kept free "
                      f"of {usable / 2**30:.1f} GiB usable on {self.device}")

    def _usable_bytes(self) -> int:
        """What this process can hold on its GPU (free + its own cache), the smallest over the drafter ranks: every
        rank resolves auto alike (a run half DDP, half FSDP2 would hang in its first collective)."""
        free, total = torch.cuda.mem_get_info(self.device)
        usable = free + torch.cuda.memory_reserved(self.device)
        # a process held to a share of its GPU (torch.cuda.set_per_process_memory_fraction: one GPU shared with a
        # server, or one H200 standing in for a smaller GPU) can hold no more than that share
        usable = min(usable, int(torch.cuda.get_per_process_memory_fraction(self.device) * total))
        if self.group is not None:
            t = torch.tensor([usable], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
            usable = int(t.item())
        return usable

    def _choose_recompute(self) -> tuple[str, str]:
        """train.recompute as configured, or for auto the fastest mode the memory model fits on this GPU."""
        from dflash.memory.parts import choose_recompute, recompute_mode

        mode = self.cfg.train.recompute
        if mode != "auto":
            return mode, "as configured"
        if self.device.type != "cuda":
            return "off", "auto on CPU"
        usable = self._usable_bytes()
        try:
            mode, need = choose_recompute(self._resolved(), self.cfg.topology.trainer_role, torch.version.cuda or "12.8",
                                          usable)
        except ValueError as e:  # a shape the memory model cannot read: keep every activation
            return recompute_mode(self.cfg), f"auto: memory model unavailable ({e})"
        return mode, (f"auto: predicted peak {need / 2**30:.1f} GiB + {self.cfg.train.memory_headroom_gib:g} kept free "
                      f"of {usable / 2**30:.1f} GiB usable on {self.device}")

    def _resolved(self) -> RunConfig:
        """The run config with train.data_parallel as chosen (the memory model counts what this run holds)."""
        if self.data_parallel in ("ddp", "fsdp2"):
            return self.cfg.model_copy(update={"train": self.cfg.train.model_copy(
                update={"data_parallel": self.data_parallel})})
        return self.cfg

    def _heldout(self):
        """The held-out evaluator of a run with [eval] (co-located only: dflash.config refuses it in split runs)."""
        if not self.cfg.eval.enabled:
            return None
        from dflash.data.plan import heldout_dataset
        from dflash.train.heldout import HeldOut

        assert self.group is None and self.source.model is not None, "held-out eval needs the target in this process"
        return HeldOut(self.cfg, heldout_dataset(self.cfg), pad_token_id(self.source.target_config), self.log)

    @classmethod
    def colocated(cls, cfg: RunConfig, resume_from: Path | None = None, log=print, provenance: dict | None = None,
                  group=None) -> Trainer:
        """The target in this process (`LocalTarget`, or `CachedTarget` with train.cache_features); `group`: the
        co-located data-parallel ranks (topology.colocated_gpus), each with its own target, DDP over the drafter."""
        device = run_device(cfg)
        problem = fp8_problem(cfg.train.fp8, device)
        if problem:  # before minutes of loading the target
            raise ConfigError(problem)
        start_compile_workers(device, cfg.train.compile)
        before_s = process_age_s()  # launch to here: imports, preflight, the config
        t0 = time.perf_counter()
        source = local_source(cfg, device, log if group is None or dist.get_rank(group) == 0 else lambda *_, **__: None)
        target_s = time.perf_counter() - t0
        trainer = cls(cfg, source, resume_from, group=group, log=log, provenance=provenance)
        trainer.startup = {"before_s": round(before_s, 1) if before_s is not None else None,
                           "target_s": round(target_s, 1), **trainer.startup}
        return trainer

    def _dataset_meta(self) -> dict:
        return {"path": self.cfg.data.path, "samples": self.dataset.num_samples,
                "fingerprint": self.dataset.fingerprint}

    def _resume_weights(self, path: Path) -> tuple[dict, dict]:
        """A checkpoint's weights into the drafter, before it is wrapped; (trainer state, meta)."""
        refused = incompatible(path, read_meta(path), self.cfg, self.source.target_config.num_hidden_layers)
        if refused:  # preflight's run-dir check fails with the same line (dflash.runs.resume)
            raise rundir.RunDirError(f"{refused}; {incompatible_fix('the run config')}")
        return ckpt.load_weights(path, self.drafter, self.device)

    def _resume(self, path: Path, state: dict, meta: dict) -> None:
        """The rest of a resume once the optimizer exists: its state (onto the shards under fsdp2), the position."""
        ckpt.load_optimizer(path, self.optimizer, self.device,
                             lambda state: self.par.load_optimizer_state(self.optimizer, state))
        self.step = restore_position(self.sampler, self.dataset, state, meta, self.log)
        if state.get("rng_cpu") is not None:
            torch.set_rng_state(state["rng_cpu"])
        if self.device.type == "cuda" and state.get("rng_cuda") is not None:
            torch.cuda.set_rng_state(state["rng_cuda"])
        self.resumed_from = path
        self.log(f"resumed from {path} at step {self.step}")

    def save(self, heldout: dict | None = None, best: bool = False) -> dict:
        """Save checkpoint self.step (written in the background with train.async_save; `best`: then point
        checkpoints/best at it). Returns the timings for the step's metrics row: save_stall_s (the loop was blocked),
        save_wait_s (of which waiting for the previous save) and, written here, save_write_s."""
        t0 = time.perf_counter()
        bad = self.par.nonfinite_params()  # one read of the device (under fsdp2 every rank's shards, all-reduced)
        if bad and not self.measure_only:  # a finite loss and gradient can still give a non-finite update
            raise NonFiniteError(f"step {self.step}: drafter weights are not finite ({', '.join(bad[:3])}); {DIVERGED_FIX}")
        sharded = self.par.mode == "fsdp2"
        if not self.is_logger:  # a sharded drafter: this rank's part of every gather, nothing kept
            self.par.full_state(self.optimizer, lambda _key, _t: None)
            return {}

        state = {"step": self.step, "sampler": self.sampler.state_dict(), "rng_cpu": torch.get_rng_state(),
                 "rng_cuda": torch.cuda.get_rng_state() if self.device.type == "cuda" else None,
                 "n_drafters": self.world}
        extra = dict(self.provenance, **({"heldout": heldout} if heldout else {}))
        then = (lambda path: rundir.set_best(self.out, path)) if best else None
        full = (lambda keep: self.par.full_state(self.optimizer, keep)) if sharded else None
        times = self.writer.save(self.step, self.drafter, self.optimizer, state, self.cfg, self._dataset_meta(),
                                 self.cfg.train.keep_last, extra, then, full)
        self.last_checkpoint = rundir.checkpoint_path(self.out, self.step)
        times["save_stall_s"] = round(time.perf_counter() - t0, 3)
        return times

    def train_step(self, mine: list[tuple[int, dict]]) -> dict:
        """One optimizer step over this rank's batches [(global index, batch)]; plain-float metrics."""
        lr = set_lr(self.optimizer, self.cfg, self.step, self.total_steps)
        # DDP's grads are views of its buckets: zeroed in place (set to None, a no_sync micro-batch would allocate a
        # second fp32 copy beside the buckets); a bare or sharded drafter frees them until backward needs them again.
        self.optimizer.zero_grad(set_to_none=self.par.zero_to_none)
        raws = []
        try:
            for i, (k, batch) in enumerate(mine):
                batch = to_device(batch, self.device)
                features = self.source.features(k, batch)
                last = i == len(mine) - 1
                with self.par.accumulating(last):
                    loss, m = micro_step(self.par.module, self.embed_w, self.head_w, batch, features, self.cfg,
                                         self.device, self.attn_backend, k)
                    (loss / len(mine)).backward()
                raws.append(m)
        except Exception as e:
            if compiled.is_limit_hit(e):  # never on into eager code: one line, nothing saved from this step
                raise compiled.limit_error(self.step + 1, self.watch) from None
            raise
        norm = self.par.grad_norm()
        # The step's one read of its results: every batch's metrics and the norm, once backward is queued and before
        # the update is: a diverged step never updates, and the update's kernels run while the host prepares the
        # next step. (A split run's drafter also waits for each batch's features to arrive.)
        parts = read_metrics([*raws, {"grad_norm": norm}])
        norm_value = parts.pop()["grad_norm"]
        out = average_metrics(parts)
        if (not math.isfinite(out["loss"]) or not math.isfinite(norm_value)) and not self.measure_only:
            raise NonFiniteError(f"step {self.step + 1}: loss {out['loss']}, gradient norm {norm_value}: training "
                                 f"diverged; {DIVERGED_FIX}")
        clip_and_step(self.drafter, self.optimizer, self.cfg, norm)
        self.step += 1
        out.update(lr=lr, grad_norm=norm_value)
        return out

    def step_batches(self):
        """(epoch, position after the step, [(global index, batch)] of this rank) per optimizer step, read and
        collated ahead by a thread.

        The producer walks a copy of the sampler; the loop moves ``self.sampler`` to a step's
        position once the step is trained, so a checkpoint records the consumed position, not the
        read-ahead one.
        """
        pad = pad_token_id(self.source.target_config)
        pin = self.device.type == "cuda"
        reader = copy.copy(self.sampler)
        per_step = self.batches_per_step

        def collated():
            step = self.step
            while True:
                group = [next(iter_reader) for _ in range(per_step)]
                mine = []
                for j, (_, _, indices) in enumerate(group):
                    if j % self.world == self.rank:
                        batch = collate(self.dataset, indices, pad, self.cfg.data.packing)
                        batch["sample_ids"] = torch.tensor(indices)  # the feature cache's keys
                        mine.append((step * per_step + j, {k: v.pin_memory() for k, v in batch.items()}
                                     if pin else batch))
                epoch, index, _ = group[-1]
                yield epoch, {"epoch": epoch, "index": index + 1}, mine
                step += 1

        iter_reader = iter(reader)
        yield from prefetch(collated())

    def print_plan(self) -> None:
        if self.cfg.target.random_init:  # at every start, beside the gate's warning (dflash.models.weights)
            self.log(f"warning: {RANDOM_WEIGHTS_WARNING} (target.random_init = true)")
        self.log(f"dataset {self.cfg.data.path}: {self.dataset.num_samples} samples, "
                 f"{int(self.dataset.lengths.sum())} tokens")
        self.log(self.sampler.summary())
        d = self.drafter.config
        n_params = sum(p.numel() for p in self.drafter.parameters())
        self.log(f"drafter: {d.num_hidden_layers} layers, block {d.block_size}, target layers {d.target_layer_ids}, "
                 f"{n_params / 1e6:.1f}M trainable params; attention {self.attn_backend} on {self.device}; "
                 f"recompute {self.recompute} ({self.recompute_why})"
                 + (f"; fp8 {self.cfg.train.fp8} (e4m3 MLP matmuls)" if self.cfg.train.fp8 != "off" else "")
                 + (f"; {self.world} data-parallel drafter ranks, {self.data_parallel} ({self.parallel_why})"
                    if self.world > 1 else ""))
        self.log(f"features: {self.source.describe()}")
        if self.init_line:
            self.log(self.init_line)
        if self.heldout is not None:
            self.log(self.heldout.describe() + (f"; best so far {self.best:.3f}" if self.best is not None else ""))
        self.log(f"schedule: {self.total_steps} steps of {self.batches_per_step} batches, lr {self.cfg.train.lr} "
                 f"cosine, warmup {self.cfg.train.warmup_ratio}")
        size = self.source.cache_bytes(int(self.dataset.lengths.sum()))
        if size is not None:
            self.log(f"feature cache: grows to {size / 2**30:.2f} GiB on {self.device}")

    # ---- the loop

    def _begin(self) -> None:
        """The logger's start of a run: the plan's lines, the running marker and the held-out sample ids."""
        self.print_plan()
        rundir.write_running(self.out, step=self.step, total_steps=self.total_steps)
        if self.heldout is not None:
            from dflash.train.heldout import write_ids

            write_ids(self.out, self.cfg, self.heldout.dataset)

    def run(self, progress: bool | None = None) -> int:
        """Train to the end (or to a signal): step, evaluate, save, record. Returns the exit code."""
        if self.is_logger:
            self._begin()
        self.graphs, self.recompiles = None, 0  # compiled graphs after the first step; graphs built after it
        self.stop_estimate_s, self.stop_measured = None, False  # a stop's seconds (_announce_stop), once re-measured
        self.recorder = Recorder(self, progress)  # metrics.jsonl, outcome.json, trackers, the bar, the tok/s window
        stop = StopFlag()
        stop.install()
        stream = self.step_batches()
        held, last_save, stopping = None, self.step, False
        try:
            manifest = None
            if self.step < self.total_steps and compile_cache.compiles(self.cfg):  # before anything compiles
                manifest = compile_cache.load(self.cfg, self.dataset.lengths, self.log)
            if self.primes():  # every shape class traced now: no graph is built after the first step
                prime(self, manifest)
            pending = self._next(stream) if self.step < self.total_steps else None
            first_step = self.step + 1
            while pending is not None:
                epoch, position, mine = pending
                m = self.train_step(mine)
                self.sampler.load_state_dict(position)
                if self.step == first_step:
                    self.recorder.first_step(self.startup, compiled_graphs())
                    if self.is_logger:  # the optimizer has its state now: pin the saves' host buffers meanwhile
                        self.writer.reserve(self.drafter, self.optimizer)
                        self._announce_stop(self.recorder.first_step_s)
                self._note_recompiles()
                pending = self._next(stream) if self.step < self.total_steps else None  # post receives early
                self.recorder.count(mine)
                stopping = self._agree(stop.requested)
                if stopping:
                    self._stopping(stop)
                rec, held = self._measure(m, epoch, stopping)
                self.recorder.end_window(every_rank=rec is not None)
                better = held is not None and (self.best is None or held[self.best_key] > self.best)
                if self.step % self.cfg.train.save_every == 0 or stopping or better:
                    last_save, times = self._save_if_logger(held, better)
                    if self.is_logger:
                        rec = dict(rec or {"step": self.step, "epoch": epoch}, **times)
                    if better and self.is_logger:
                        self._set_best(held)
                self.recorder.record(rec)
                if stopping:
                    pending = None
                self.writer.check()  # a background save that failed ends the run here, as a save on this thread would
            self.writer.wait()
            # agreed: a sharded save is a collective, and only the logger can see its own checkpoint folder
            if self._agree(self.step != last_save or (self.is_logger and not rundir.list_checkpoints(self.out))):
                last_save, _ = self._save_if_logger(held if held is not None and held.get("step") == self.step else None)
            self.writer.wait()  # the last checkpoint is renamed before the run reports, exports or exits
            if stopping:
                self.stop_times["total_s"] = round(stop.seconds(), 1) if stop.requested else None
                self.stop_times.update({k: v for k, v in self.writer.phases.items()})
        except BaseException as e:
            # the run's record first (a save in flight can take long and another Ctrl-C can land while it is awaited)
            self.recorder.crashed(e, self.step)
            with contextlib.suppress(BaseException):  # let a save in flight finish (its error is not the one to tell)
                self.writer.wait()
            raise
        finally:
            self.recorder.close()
            stream.close()
            stop.restore()
        return self._finish(stop, stopping)

    def _announce_stop(self, first_step_s: float) -> None:
        """One line at the first step: how long a stop will take (the step in flight, bounded by the first's time,
        which compiles; then the checkpoint's bytes at this disk's measured rate), so that a scheduler's grace is set
        above it (SLURM's KillWait and Kubernetes' grace default to 30 s, `docker stop` to 10 s)."""
        nbytes = ckpt.state_bytes(self.drafter, self.optimizer)
        if nbytes < STOP_NOTE_BYTES:  # a small state writes in well under a second: nothing to plan a grace around
            return
        rate = ckpt.disk_write_rate(self.out)
        if rate is None:
            return
        write_s = nbytes / rate
        self.stop_estimate_s, self.stop_measured = round(write_s, 1), False
        self.log(f"a stop (SIGTERM/SIGINT) finishes the step in flight, then writes {nbytes / 2**30:.2f} GiB at "
                 f"{rate / 1e9:.2f} GB/s (this disk, measured): about {write_s:.0f} s after the step; give the "
                 f"scheduler a kill grace above that plus a step")

    def _stopping(self, stop: StopFlag) -> None:
        """A stop agreed at the end of a step: outcome.json says so before the checkpoint is written (a run killed
        while stopping reads "stopping", never "running"), and a periodic save still being written is given up for
        the stop's own (``CheckpointWriter.supersede``)."""
        self.stop_times = {"step_s": round(stop.seconds(), 1) if stop.requested else None}
        if not self.is_logger:
            return
        if self.recorder.outcome:
            self.recorder.outcome.end("stopping", self.step, f"{stop.signame or 'a peer signal'} during step "
                                      f"{self.step}: saving a checkpoint; if this stays, the process was killed "
                                      "while stopping and the checkpoints before it stand")
        if self.writer.supersede():
            self.stop_times["superseded"] = True
            self.log("a stop: the save still being written is given up for the stop's own checkpoint")

    def primes(self) -> bool:
        """Whether the run traces its shape classes before the first step: a compiled drafter fed by a target in this
        process (a split run's drafter ranks get their features in batch order from the target ranks)."""
        return self.step < self.total_steps and self.drafter.layers[0].compiled and \
            isinstance(self.source, LocalTarget)

    def _note_recompiles(self) -> None:
        """Graphs torch.compile built since the last look, once the first step is done: a new shape class (a warm
        run builds none past its first step). One line each time, with the function and the guard that failed for
        each recompile, counted in the metrics and outcome.json (which keeps the causes too)."""
        graphs = compiled_graphs()
        causes = [f"{fn} ({where}): {guard}" for fn, where, guard in self.watch.new()]
        if self.graphs is not None and graphs > self.graphs:
            self.recompiles += 1
            because = f"; {'; '.join(causes)}" if causes else ""
            self.log(f"recompiled after step {self.step}: {graphs} graphs (was {self.graphs}){because}")
            if self.recorder.outcome:
                self.recorder.outcome.recompiled(self.recompiles, [f"step {self.step}: {c}" for c in causes])
        self.graphs = graphs

    def _next(self, stream):
        item = next(stream)
        for k, batch in item[2]:
            self.source.expect(k, batch)
        return item

    def agreed_batches(self, batches: int | None) -> int | None:
        """The warm batches every drafter rank runs (a sharded drafter's warm-up is collective): the most any rank
        needs, None (all) when one needs all, as a rank whose artifact did not load does."""
        if self.group is None:
            return batches
        t = torch.tensor([-1 if batches is None else batches], device=self.device)
        most = t.clone()
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return None if t.item() < 0 else int(most.item())

    def _agree(self, flag: bool) -> bool:
        """All drafter ranks stop together (a signal may reach only some of them)."""
        if self.group is None:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, group=self.group)
        return bool(t.item() > 0)

    def _save_if_logger(self, heldout: dict | None = None, best: bool = False) -> tuple[int, dict]:
        """Rank 0 of the drafter group saves the checkpoint (replicas are identical; a sharded drafter's ranks all
        take part in gathering it); returns (the step, the save's timings: {} on the other ranks)."""
        times = self.save(heldout, best) if self.is_logger or self.par.mode == "fsdp2" else {}
        return self.step, times

    def _evaluate(self) -> dict:
        """heldout_* metrics of the drafter at this step (dflash.train.heldout), with their wall time."""
        t0 = time.perf_counter()
        self.drafter.set_fp8("off")  # measured as exported and served: bf16, whatever train.fp8 is
        try:
            held = self.heldout.evaluate(self.drafter, self.source, self.device, self.attn_backend)
        finally:
            self.drafter.set_fp8(self.cfg.train.fp8)
        held["heldout_eval_s"] = round(time.perf_counter() - t0, 3)
        held["step"] = self.step
        return held

    def _set_best(self, held: dict) -> None:
        previous = self.best  # checkpoints/best itself moves once the save is written (Trainer.save's `best`)
        self.best = held[self.best_key]
        self.log(f"best: {self.last_checkpoint.name} ({self.best_key} {self.best:.3f}"
                 + (f", was {previous:.3f})" if previous is not None else ")"))

    def _measure(self, m: dict, epoch: int, stopping: bool) -> tuple[dict | None, dict | None]:
        """(the step's row when a metrics row or a held-out evaluation is due, else None; its held-out numbers or
        None), made on every rank the same way."""
        rec = None
        if self.step % self.cfg.train.log_every == 0 or self.step == self.total_steps or stopping:
            rec = self._record(m, epoch)
        held = self._evaluate() if self.heldout is not None and not stopping and \
            self.heldout.due(self.step, self.total_steps) else None
        if held is not None:
            self._note_recompiles()
            rec = dict(rec or {"step": self.step, "epoch": epoch}, **held)
        return rec, held

    def _record(self, m: dict, epoch: int) -> dict:
        """The metrics row of this step: loss and metrics averaged over ranks, tokens and timings summed."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt, tokens = self.recorder.window_so_far()
        counters = dict(self.source.counters(), tokens=float(tokens))
        if self.group is not None and not self.measure_only:  # the fake group's sums are this rank's own figures
            m = _mean_over_ranks(m, self.group, self.device)
            counters = _sum_over_ranks(counters, self.group, self.device)
        rec = dict(m, step=self.step, epoch=epoch, tok_per_s=round(counters["tokens"] / dt, 1),
                   compiled_graphs=compiled_graphs(), recompiles=self.recompiles,
                   mem_gib=round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
                   if self.device.type == "cuda" else None)
        if self.device.type == "cuda":
            rec["nvml_used_gib"] = _nvml_used_gib(self.device, self.cfg.topology.trainer_role)
        rec.update(self.source.rates(counters, dt, self.world))
        if self.group is not None and os.environ.get("DFLASH_CHECK_REPLICAS") == "1":
            diff = self.par.replica_max_diff()  # None under fsdp2: one copy of each shard, nothing to compare
            if diff is not None:
                rec["replica_max_diff"] = diff
        if os.environ.get("DFLASH_RECORD_BATCHES") == "1":  # what tests read: the batches this row's steps trained
            rec["batches"] = _all_batches(self.recorder.batches_so_far(), self.group if not self.measure_only else None)
        return rec

    def _finish(self, stop: StopFlag, stopping: bool) -> int:
        weights = None
        if self.par.mode == "fsdp2" and not stopping and not self.measure_only:  # every rank gathers the export
            weights = self.par.full_weights((lambda _k, t: t.cpu()) if self.is_logger else (lambda _k, _t: None))
        if not self.is_logger:
            return 0
        rundir.clear_running(self.out)
        latest = rundir.list_checkpoints(self.out)
        path = latest[-1] if latest else None
        if stopping:  # the marker tells a scheduler this run is unfinished (dflash-train exits EXIT_STOPPED)
            rundir.write_stopped(self.out, stop.signame or "a peer signal", self.step, path)
            self.recorder.outcome.end("stopped", self.step, f"by {stop.signame or 'a peer signal'}, checkpoint "
                                      f"{path.name if path else None}", getattr(self, "stop_times", None))
            self.log(f"stopped by {stop.signame or 'a peer signal'} at step {self.step}; checkpoint {path}"
                     + (f"; {stop_line(self.stop_times)}" if getattr(self, "stop_times", None) else ""))
            self.log(f"resume with: dflash-train --config <this config> --resume latest  (output_dir {self.out})")
            return 0
        try:
            exported = self._export(weights) if not self.measure_only else "nothing: a fake process group trains nothing"
        except BaseException as e:  # a disk that fills during the export: the run's record says it failed
            self.recorder.crashed(e, self.step)
            raise
        rundir.clear_stopped(self.out)
        self.recorder.outcome.end("finished", self.step)
        self.log(f"done: {self.step} steps; checkpoint {path}; drafter saved to {self.out / rundir.DRAFTER_DIR} ({exported}); "
                 f"{compiled_graphs()} compiled graph(s) in this process")
        summary = self.source.summary(self.recorder.steady_rows)
        if summary:
            self.log(summary)
        return 0

    def _export(self, weights: dict | None = None) -> str:
        """Write <output_dir>/drafter, servable as published drafters are (bf16, the target's tokenizer files and
        ids): checkpoints/best's weights (eval.export = best) or the last step's (`weights`: a sharded drafter's,
        gathered). Whole or not at all (`ckpt.write_export`)."""
        best = self._verified_best() if self.heldout is not None and self.cfg.eval.export == "best" else None
        model, which = self.drafter, f"step {self.step}, the last"
        if best is not None:
            model, which = DFlashDrafter.from_pretrained(best / rundir.DRAFTER_DIR), f"{best.name}, checkpoints/best"
        target, state = target_folder(self.cfg.target.path, self.log), weights if model is self.drafter else None
        ckpt.write_export(self.out, lambda folder: model.save_pretrained(folder, dtype=torch.bfloat16,
                                                                         target_dir=target, state=state))
        return which

    def _verified_best(self) -> Path | None:
        """checkpoints/best when it is a checkpoint of this run dir that verifies (sizes and sha256 against its
        meta.json), else None and one line saying why the last step is exported instead."""
        best, problem = rundir.best_or_problem(self.out)
        if best is not None:
            problem = checkpoint_problem(best, deep=True)
            problem = problem and f"{best}: {problem}"
        if problem:
            self.log(f"export: not using checkpoints/best: {problem}; exporting the last step ({self.step}) instead")
            return None
        return best


def _best_value(out: Path, key: str) -> float | None:
    """The held-out acceptance checkpoints/best was chosen by (a resumed run keeps beating it), or None."""
    best = rundir.best_checkpoint(out)
    if best is None:
        return None
    meta, _ = meta_or_problem(best)
    value = ((meta or {}).get("heldout") or {}).get(key)
    return float(value) if isinstance(value, (int, float)) else None


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (a number that grows with every recompile)."""
    return compiled.graphs()


def _nvml_used_gib(device: torch.device, role: str) -> dict:
    """{"<role>:<GPU uuid>": GiB in use on this process's GPU as NVML counts it (all processes, caching allocator
    included)}; {} when NVML cannot say. dflash-report plots it against the memory model's prediction."""
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = f"GPU-{torch.cuda.get_device_properties(device).uuid}"
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        return {f"{role}:{uuid[:12]}": round(pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30, 3)}
    except Exception:  # NVML missing or a GPU it does not list: the report says there is no NVML data
        return {}


def _all_batches(mine: list[list], group) -> list[list]:
    """[global batch index, sample ids] of the batches every rank of the group trained (this rank's alone without a
    group), by index."""
    everyone: list = [mine]
    if group is not None:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    return sorted((b for batches in everyone for b in batches), key=lambda b: b[0])


def _mean_over_ranks(m: dict, group, device) -> dict:
    """Numbers and lists of numbers averaged over the group's ranks (other values kept as they are)."""
    keys = [k for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    lists = [k for k, v in m.items() if isinstance(v, list)]
    flat = [float(m[k]) for k in keys] + [float(x) for k in lists for x in m[k]]
    t = torch.tensor(flat, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    t /= dist.get_world_size(group)
    vals = t.tolist()
    out = dict(m)
    for k in keys:
        out[k] = vals.pop(0)
    for k in lists:
        n = len(m[k])
        out[k], vals = [round(x, 4) for x in vals[:n]], vals[n:]
    return out


def _sum_over_ranks(counters: dict, group, device) -> dict:
    keys = sorted(counters)
    t = torch.tensor([float(counters[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return dict(zip(keys, t.tolist()))


def run(cfg: RunConfig, resume_from: Path | None, log=print, progress: bool | None = None,
        provenance: dict | None = None, preflight_s: float | None = None) -> int:
    """Co-located training: target and drafter in this process. Returns the exit code. preflight_s: the gate's
    seconds, shown inside the startup line's "imports and preflight"."""
    out = Path(cfg.output_dir)
    with rundir.io_errors_in_one_line(out):  # a disk that fills or fails mid-run: one line, the path and the fix
        out.mkdir(parents=True, exist_ok=True)
        (out / rundir.CONFIG_NAME).write_text(dump_config(cfg))
        trainer = Trainer.colocated(cfg, resume_from, log, provenance)
        if preflight_s is not None:
            trainer.startup["preflight_s"] = round(preflight_s, 1)
        return trainer.run(progress)
