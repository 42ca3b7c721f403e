"""The work of one rank of a multi-process run: a drafter rank, a target rank, or a co-located data-parallel rank.

Ranks 0..D-1 train the drafter (data-parallel over a drafter-only group; rank 0 logs and checkpoints) in the one
training loop, `dflash.train.trainer.Trainer`, fed by `RemoteTargets` (dflash.train.features); ranks D..D+T-1 hold
the frozen target and serve its features. Every rank walks the same deterministic batch sequence: global batch k
is computed by target k % T and trained by drafter k % D, so no coordinator is needed. A target keeps at most
`queue_depth` sends in flight (backpressure); a drafter prefetches the next step's features while it trains.

Co-located data-parallel runs (topology.colocated_gpus): every rank is a "colocated" rank holding its own target and
a drafter replica (`_colocated_main`), data-parallel over all ranks. Under torchrun every rank goes through the
preflight gate first (rank 0 decides, every rank checks its own GPU, all refuse together); processes started by
`dflash-train` (dflash.train.launch) find the gate's fresh `preflight.json` of this run instead.

A rank whose peer's process is gone (killed, crashed, or a drafter that saved and left while targets still send)
sees its connection close under a send, receive or collective. It is not the cause: it exits EXIT_PEER_GONE with no
traceback (one line under torchrun), and the launcher names the rank that is gone. Any other error is raised as is.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import deque
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.config import RunConfig
from dflash.data.batching import collate, prefetch, to_device
from dflash.errors import DflashError
from dflash.models.target import torch_dtype
from dflash.runs import checkpoint as ckpt
from dflash.runs import rundir
from dflash.runs.lock import release_held_locks
from dflash.runs.verify import read_meta
from dflash.train import compile_cache
from dflash.train.features import RemoteTargets
from dflash.train.launch import EXIT_PEER_GONE
from dflash.train.layout import Rank, ranks_for

TARGET_STOP_GRACE_S = 60.0  # a SIGTERMed target serves this long so drafters can finish their step
# What a send, receive or collective says when the process at the other end is gone: gloo's words (seen on CPU at
# 1 + 2 and 5 + 3), c10d's store socket, and NCCL's socket layer (from its messages; no multi-GPU test runs here).
PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote peer closed the connection",
             "closed by remote peer", "remote process exited")


def peer_gone(e: BaseException) -> bool:
    """Whether a torch.distributed call failed because another rank's process is gone (its sockets closed)."""
    return isinstance(e, RuntimeError) and any(s in str(e).lower() for s in PEER_GONE)


def worker(cfg: RunConfig, resume_from: Path | None, gate=None, provenance: dict | None = None) -> int:
    """One rank of a split run. `gate(rank, local_rank)` (torchrun: the collective preflight gate, called once the
    process group is up) returns the checkpoint to resume from, None, or False when the run must not start; None
    when the launcher already passed the gate. `provenance`: what wrote the run, kept in every checkpoint."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ranks = ranks_for(cfg)
    if world != len(ranks):
        named = (f"{len(ranks)} co-located" if cfg.topology.layout == "colocated-dp" else
                 f"{len(cfg.topology.target_gpus)} target + {len(cfg.topology.drafter_gpus)} drafter")
        raise DflashError(f"WORLD_SIZE={world} but the config names {len(ranks)} GPUs ({named}); "
                          f"start {len(ranks)} processes (torchrun --nproc-per-node {len(ranks)})")
    me = ranks[rank]
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cfg.device == "cuda":
        torch.cuda.set_device(local_rank if torch.cuda.device_count() > 1 else 0)
    dist.init_process_group("nccl" if cfg.device == "cuda" else "gloo",
                            timeout=timedelta(seconds=cfg.topology.timeout_s))
    if gate is not None:
        resume_from = gate(me, local_rank)
        if resume_from is False:
            dist.destroy_process_group()
            return 1
    try:
        if me.role == "colocated":
            torch.manual_seed(cfg.train.seed)
            return _colocated_main(cfg, resume_from, dist.new_group(list(range(world))), provenance)
        drafter_group = dist.new_group(list(range(me.n_drafters)))
        share_group = dist.new_group(list(range(me.n_drafters + 1)))  # drafters + first target
        torch.manual_seed(cfg.train.seed)
        if me.is_drafter:
            return _drafter_main(cfg, me, resume_from, drafter_group, share_group, provenance)
        return _target_main(cfg, me, resume_from, share_group)
    except RuntimeError as e:
        if not peer_gone(e):
            raise
        if gate is not None:  # under torchrun nobody else explains this rank's exit
            print(f"rank {me.rank} ({me.role}): a peer rank is gone ({' '.join(str(e).split())[:200]}); leaving",
                  file=sys.stderr, flush=True)
        sys.stdout.flush()
        release_held_locks()
        os._exit(EXIT_PEER_GONE)  # a collective or send of ours may still be pending: no interpreter teardown


def _start_step(cfg: RunConfig, resume_from: Path | None, dataset, sampler) -> int:
    """Where a target rank starts: the checkpoint's consumed position, as the drafters restore it."""
    if resume_from is None:
        return 0
    from dflash.runs.resume import restore_position

    return restore_position(sampler, dataset, ckpt.load_trainer_state(resume_from), read_meta(resume_from),
                            log=lambda *_: None)


def _target_main(cfg: RunConfig, me: Rank, resume_from: Path | None, share_group) -> int:
    from dflash.data.plan import schedule
    from dflash.train.features import LocalTarget
    from dflash.train.step import pad_token_id
    from dflash.train.trainer import run_device

    # A SIGTERM that reaches every rank at once (a scheduler's cancel) must not strand the drafters
    # mid-step: a target keeps serving for TARGET_STOP_GRACE_S, then leaves (it holds no state).
    signal.signal(signal.SIGTERM, lambda *_: _exit_later(min(TARGET_STOP_GRACE_S, cfg.topology.timeout_s)))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher or torchrun decides when targets stop
    device = run_device(cfg)
    target = LocalTarget(cfg, device, log=lambda *_: None)
    if me.index == 0:
        embed, head = target.frozen_weights()
        dist.broadcast(embed.contiguous(), src=me.n_drafters, group=share_group)
        dist.broadcast(head.contiguous(), src=me.n_drafters, group=share_group)
    dataset, sampler, total = schedule(cfg, me.n_drafters)
    if compile_cache.compiles(cfg):  # the target's layers compile at its first forward (rank 0 of the drafters speaks)
        compile_cache.load(cfg, dataset.lengths, log=lambda *_: None)
    start = _start_step(cfg, resume_from, dataset, sampler)
    per_step = cfg.train.grad_accum * me.n_drafters
    first, end = start * per_step, total * per_step  # global batch indices this run still computes
    wire = torch_dtype(cfg.target.dtype)
    pad = pad_token_id(target.target_config)
    in_flight: deque = deque()
    wait_s = 0.0

    def my_batches():  # read and collated ahead by a thread (`prefetch`)
        for k, (_, _, indices) in enumerate(sampler, start=first):
            if k >= end:
                return
            if k % me.n_targets == me.index:
                batch = collate(dataset, indices, pad, cfg.data.packing)
                yield k, ({key: v.pin_memory() for key, v in batch.items()} if device.type == "cuda" else batch)

    kept = False  # each target rank's first batch: ranks see every n_targets-th batch, so not one index for all
    for k, batch in prefetch(my_batches()):
        t0 = time.perf_counter()
        batch = to_device(batch, device)
        with torch.no_grad():
            context, last = target.features(k, batch)
        if device.type == "cuda":  # this stream only: a device-wide sync would also wait for our queued NCCL sends
            torch.cuda.current_stream(device).synchronize()
        compute_s = time.perf_counter() - t0
        if not kept and device.type == "cuda":  # what fla tuned fills its other token buckets (no file: no run dir)
            from dflash.models.fla_tuning import keep_tuned

            keep_tuned(torch.cuda.get_device_name(device))
            kept = True
        stats = torch.tensor([compute_s, wait_s], dtype=torch.float64)
        tensors = [stats.to(device), context.to(wire).contiguous()]
        if last is not None:
            tensors.append(last.to(wire).contiguous())
        handles = [dist.isend(t, dst=k % me.n_drafters) for t in tensors]
        in_flight.append((handles, tensors))
        t1 = time.perf_counter()
        while len(in_flight) > cfg.topology.queue_depth:
            _complete(in_flight.popleft()[0], device)
        wait_s = time.perf_counter() - t1  # reported with the next batch
    for handles, _ in in_flight:
        _complete(handles, device)
    sys.stdout.flush()
    os._exit(0)  # every batch was received; drafters finish on their own


def _exit_later(seconds: float) -> None:
    timer = threading.Timer(seconds, lambda: os._exit(0))
    timer.daemon = True
    timer.start()


def _complete(handles, device: torch.device) -> None:
    """Block until these sends are delivered (NCCL's wait() only orders the stream, so sync it too)."""
    for h in handles:
        h.wait()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _drafter_main(cfg: RunConfig, me: Rank, resume_from: Path | None, drafter_group, share_group, provenance) -> int:
    from dflash.models.drafter import start_compile_workers
    from dflash.train.trainer import Trainer, run_device

    device = run_device(cfg)
    start_compile_workers(device, cfg.train.compile)
    source = RemoteTargets(cfg, me, share_group, device)
    trainer = Trainer(cfg, source, resume_from, group=drafter_group, log=lambda *a, **k: print(*a, **k, flush=True),
                      provenance=provenance)
    with rundir.io_errors_in_one_line(cfg.output_dir):  # rank 0's saves on a full or failing disk: one line
        code = trainer.run(progress=False)
    dist.barrier(group=drafter_group)
    sys.stdout.flush()
    release_held_locks()  # torchrun's rank 0 holds the run dir's lock; os._exit skips atexit
    os._exit(code)  # targets may still block in sends nobody will receive; the launcher reaps them


def _colocated_main(cfg: RunConfig, resume_from: Path | None, group, provenance) -> int:
    """A co-located data-parallel rank: its own target (LocalTarget) and a drafter replica, DDP over `group`.

    The one loop as a split drafter rank runs it: this rank trains global batches j % world == rank of each step,
    rank 0 logs and checkpoints."""
    from dflash.train.trainer import Trainer

    trainer = Trainer.colocated(cfg, resume_from, log=lambda *a, **k: print(*a, **k, flush=True),
                                provenance=provenance, group=group)
    with rundir.io_errors_in_one_line(cfg.output_dir):  # rank 0's saves on a full or failing disk: one line
        code = trainer.run(progress=False)
    dist.barrier(group=group)
    sys.stdout.flush()
    release_held_locks()
    os._exit(code)
