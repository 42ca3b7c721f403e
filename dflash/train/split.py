"""Split runs: target GPUs feed drafter GPUs, one process per GPU over torch.distributed.

    dflash-train --config RUN.toml --target-gpus 0,1,2,3,4 --drafter-gpus 5,6,7
    torchrun --nproc-per-node 8 -m dflash.commands.torchrun --config RUN.toml --fresh   # torchrun (also multi-node)
    dflash-train --config RUN.toml --colocated-gpus 0,1,2,3,4,5,6,7    # co-located data parallel, the same launcher

Co-located data-parallel runs (topology.colocated_gpus) use the same launcher and gate: every rank is a
"colocated" rank holding its own target and a drafter replica (`_colocated_main`), data-parallel over all ranks.

This module is the launcher, the rank roles, the target ranks' serve loop and the transport
(`RemoteTargets`, the drafter ranks' feature source). Drafter ranks run the one training loop,
`dflash.train.trainer.Trainer`. Under torchrun every rank goes through the preflight gate first (rank 0
decides, every rank checks its own GPU, all refuse together); processes started by
`dflash-train` find the gate's fresh `preflight.json` of this run instead.

Ranks 0..D-1 train the drafter (data-parallel over a drafter-only group; rank 0 logs and
checkpoints), ranks D..D+T-1 hold the frozen target. Every rank walks the same deterministic
batch sequence: global batch k is computed by target k % T and trained by drafter k % D, so no
coordinator is needed. A target keeps at most `queue_depth` sends in
flight (backpressure); a drafter prefetches the next step's features while it trains.
The launcher watches every process: if one dies, the others are stopped and the dead rank,
its GPU and its role are named.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.config import RunConfig, dump_config
from dflash.data.batching import collate, prefetch, to_device
from dflash.errors import DflashError
from dflash.memory.pace import busy_rates, suggested_splits
from dflash.models.target import torch_dtype
from dflash.runs import checkpoint as ckpt
from dflash.runs import rundir

GATE_ENV = "DFLASH_GATE_ID"  # set by the launcher: the gate_id of the preflight.json its workers must find
POLL_S = 0.2  # launcher's watch interval
KILL_GRACE_S = 10.0  # SIGTERM -> SIGKILL for survivors of a failed run
TARGET_STOP_GRACE_S = 60.0  # a SIGTERMed target serves this long so drafters can finish their step


@dataclass(frozen=True)
class Rank:
    """One process of a split run: its rank and what it does (drafter ranks first, then target ranks)."""

    rank: int
    world: int
    n_drafters: int
    n_targets: int

    @property
    def is_drafter(self) -> bool:
        return self.rank < self.n_drafters

    @property
    def name(self) -> str:
        if self.n_targets == 0:  # co-located data parallel: every rank runs its own target and a drafter replica
            return "colocated"
        return "drafter" if self.is_drafter else "target"

    @property
    def index(self) -> int:
        """Index within its role (drafter d or target t)."""
        return self.rank if self.is_drafter else self.rank - self.n_drafters


def ranks_for(cfg: RunConfig) -> list[Rank]:
    nd, nt = len(cfg.topology.trainer_gpus), len(cfg.topology.target_gpus)
    return [Rank(r, nd + nt, nd, nt) for r in range(nd + nt)]


def gpu_of(cfg: RunConfig, role: Rank) -> str:
    gpus = cfg.topology.trainer_gpus if role.is_drafter else cfg.topology.target_gpus
    return gpus[role.index]


def physical_gpu(entry: str, visible: str | None) -> str:
    """A config GPU entry (index after CUDA_VISIBLE_DEVICES, or UUID) -> what to put in the child's CUDA_VISIBLE_DEVICES."""
    if not entry.isdigit() or not visible:
        return entry
    listed = [v.strip() for v in visible.split(",") if v.strip()]
    i = int(entry)
    if i >= len(listed):
        raise ValueError(f"GPU {entry} is not visible: CUDA_VISIBLE_DEVICES={visible} lists {len(listed)} GPUs")
    return listed[i]


# ---------------------------------------------------------------------------------------------
# Launcher


def cpu_threads_per_rank(n_ranks: int, cores: int | None = None) -> int:
    """Threads for each of n_ranks CPU ranks on one machine: its cores shared out, at least one each.

    Without it every rank starts one thread per core and the ranks fight over them (torchrun gives 1).
    """
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1, cores // n_ranks)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cfg: RunConfig, resume_from: Path | None, gate_id: str, log=print, lock=None) -> int:
    """Spawn one process per GPU and watch them (dflash-train, after its gate passed with `gate_id`).

    `lock`: the run dir's lock this launcher holds (dflash.runs.rundir.lock_run_dir); every rank inherits it, so the
    run dir stays locked while any of them lives, even if the launcher is killed."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / rundir.CONFIG_NAME
    cfg_path.write_text(dump_config(cfg))
    roles = ranks_for(cfg)
    port = _free_port()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [physical_gpu(gpu_of(cfg, r), visible) for r in roles] if cfg.device == "cuda" else [None] * len(roles)
    procs: list[subprocess.Popen] = []
    stop = {"sig": None}
    old_handlers = {s: signal.signal(s, lambda signum, _f: stop.update(sig=signum))
                    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    # Until _watch takes over, a signal is only recorded and any failure (ranks.json on a full disk) stops the
    # ranks: a launcher leaving here must never leave ranks running unwatched (they share its run-dir lock).
    try:
        _spawn(cfg, roles, gpus, port, cfg_path, resume_from, procs, gate_id, lock)
        (out / rundir.RANKS_NAME).write_text(json.dumps(
            [{"rank": r.rank, "role": r.name, "gpu": gpu_of(cfg, r), "pid": p.pid} for r, p in zip(roles, procs)]))
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        if cfg.topology.layout == "colocated-dp":
            log(f"launched {len(roles)} processes: co-located ranks 0-{len(roles) - 1} (each a target + drafter "
                f"replica) on GPUs {','.join(cfg.topology.colocated_gpus)} ({backend})")
        else:
            log(f"launched {len(roles)} processes: drafter ranks 0-{roles[0].n_drafters - 1} on GPUs "
                f"{','.join(cfg.topology.drafter_gpus)}, target ranks {roles[0].n_drafters}-{len(roles) - 1} on GPUs "
                f"{','.join(cfg.topology.target_gpus)} ({backend})")
    except BaseException:
        _terminate(procs)
        for s, h in old_handlers.items():
            signal.signal(s, h)
        raise
    try:
        return _watch(cfg, roles, procs, log, pending_signal=stop["sig"])
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)


def _spawn(cfg, roles, gpus, port, cfg_path, resume_from, procs, gate_id, lock) -> None:
    for role, gpu in zip(roles, gpus):
        env = dict(os.environ, RANK=str(role.rank), WORLD_SIZE=str(role.world), LOCAL_RANK=str(role.rank),
                   LOCAL_WORLD_SIZE=str(role.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env[GATE_ENV] = gate_id
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        elif "OMP_NUM_THREADS" not in os.environ:  # CPU ranks share this machine's cores; a user's setting wins
            env["OMP_NUM_THREADS"] = str(cpu_threads_per_rank(len(roles)))
        cmd = [sys.executable, "-m", "dflash.commands.torchrun", "--config-json", str(cfg_path)]
        if resume_from is not None:
            cmd += ["--resume", str(resume_from)]
        # own session: a terminal's Ctrl-C reaches only the launcher, which stops the drafters cleanly
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True,
                                      pass_fds=(lock.fileno(),) if lock is not None else ()))


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _watch(cfg: RunConfig, roles: list[Rank], procs: list[subprocess.Popen], log, pending_signal=None) -> int:
    def forward(signum, _frame):
        for role, p in zip(roles, procs):
            if role.is_drafter and p.poll() is None:
                p.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    if pending_signal is not None:  # arrived while spawning
        forward(pending_signal, None)
    try:
        while True:
            drafters_done = all(p.poll() == 0 for r, p in zip(roles, procs) if r.is_drafter)
            failed = [(r, p.returncode) for r, p in zip(roles, procs) if p.poll() not in (None, 0)]
            if failed and not (drafters_done and all(not r.is_drafter for r, _ in failed)):
                # A killed rank's gloo peers fail within a second (connection reset, exit 1): found together in
                # one look, the rank a signal ended (the launcher sent none yet) is the cause, not the lowest rank.
                role, code = min(failed, key=lambda f: f[1] >= 0)
                log(f"rank {role.rank} ({role.name}, GPU {gpu_of(cfg, role)}) {_describe_exit(code)}; "
                    f"stopping the other {len(procs) - 1} processes", file=sys.stderr)
                _terminate(procs)
                from dflash.runs.records import record_crash

                record_crash(cfg.output_dir, role.rank, role.name, gpu_of(cfg, role), _describe_exit(code))
                latest = rundir.list_checkpoints(cfg.output_dir)
                if latest:
                    log(f"last checkpoint: {latest[-1]} (resume with --resume latest)", file=sys.stderr)
                return 1
            if drafters_done:
                for p in procs:  # targets may still hold prefetched batches nobody needs, and no state
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                return 0
            time.sleep(POLL_S)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _terminate(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + KILL_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ---------------------------------------------------------------------------------------------
# Workers


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
    if me.name == "colocated":
        torch.manual_seed(cfg.train.seed)
        return _colocated_main(cfg, resume_from, dist.new_group(list(range(world))), provenance)
    drafter_group = dist.new_group(list(range(me.n_drafters)))
    share_group = dist.new_group(list(range(me.n_drafters + 1)))  # drafters + first target
    torch.manual_seed(cfg.train.seed)
    if me.is_drafter:
        return _drafter_main(cfg, me, resume_from, drafter_group, share_group, provenance)
    return _target_main(cfg, me, resume_from, share_group)






def _start_step(cfg: RunConfig, resume_from: Path | None, dataset, sampler) -> int:
    """Where a target rank starts: the checkpoint's consumed position, as the drafters restore it."""
    if resume_from is None:
        return 0
    from dflash.data.plan import restore_position

    return restore_position(sampler, dataset, ckpt.load_trainer_state(resume_from), ckpt.load_meta(resume_from),
                            log=lambda *_: None)


def _target_main(cfg: RunConfig, me: Rank, resume_from: Path | None, share_group) -> int:
    from dflash.data.plan import schedule
    from dflash.train.step import LocalTarget, pad_token_id
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
                batch = collate(dataset, indices, pad)
                yield k, ({key: v.pin_memory() for key, v in batch.items()} if device.type == "cuda" else batch)

    for k, batch in prefetch(my_batches()):
        t0 = time.perf_counter()
        batch = to_device(batch, device)
        with torch.no_grad():
            context, last = target.features(k, batch)
        if device.type == "cuda":  # this stream only: a device-wide sync would also wait for our queued NCCL sends
            torch.cuda.current_stream(device).synchronize()
        compute_s = time.perf_counter() - t0
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


class RemoteTargets:
    """A drafter rank's feature source: target ranks compute the features and send them here.

    `expect` posts the receives of a batch as soon as the trainer knows it (a step ahead), so the
    transfer overlaps the current step; `features` waits for its arrival.
    """

    def __init__(self, cfg: RunConfig, me: Rank, share_group, device: torch.device):
        from dflash.models.target import target_text_config
        from dflash.train.step import feature_layer_ids, target_folder

        self.cfg, self.me, self.device = cfg, me, device
        self.target_config = target_text_config(target_folder(cfg.target.path))
        self.model = None  # the target runs on the target ranks
        self.n_layers = len(feature_layer_ids(cfg, self.target_config.num_hidden_layers))
        self.want_last = cfg.train.kl_weight > 0
        self.wire = torch_dtype(cfg.target.dtype)
        V, H = self.target_config.vocab_size, self.target_config.hidden_size
        self.embed = torch.empty(V, H, dtype=self.wire, device=device)
        self.head = torch.empty(V, H, dtype=self.wire, device=device)
        dist.broadcast(self.embed, src=me.n_drafters, group=share_group)
        dist.broadcast(self.head, src=me.n_drafters, group=share_group)
        self.posted: dict[int, tuple] = {}
        self._counters = dict.fromkeys(("recv_wait_s", "target_compute_s", "target_wait_s"), 0.0)

    def frozen_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embed, self.head

    def expect(self, k: int, batch: dict) -> None:
        B, S = batch["input_ids"].shape
        H = self.target_config.hidden_size
        src = self.me.n_drafters + k % self.me.n_targets
        bufs = [torch.empty(2, dtype=torch.float64, device=self.device),
                torch.empty(B, S, self.n_layers * H, dtype=self.wire, device=self.device)]
        if self.want_last:
            bufs.append(torch.empty(B, S, H, dtype=self.wire, device=self.device))
        self.posted[k] = ([dist.irecv(b, src=src) for b in bufs], bufs)

    def features(self, k: int, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        handles, bufs = self.posted.pop(k)
        t0 = time.perf_counter()
        for h in handles:
            h.wait()
        if self.device.type == "cuda":  # NCCL's wait() only orders streams; sync to see the real arrival time
            torch.cuda.current_stream(self.device).synchronize()
        self._counters["recv_wait_s"] += time.perf_counter() - t0
        compute_s, wait_s = bufs[0].tolist()
        self._counters["target_compute_s"] += compute_s
        self._counters["target_wait_s"] += wait_s
        return bufs[1], (bufs[2] if self.want_last else None)

    def counters(self) -> dict:
        out, self._counters = self._counters, dict.fromkeys(self._counters, 0.0)
        return out

    def rates(self, c: dict, dt: float, world: int) -> dict:
        """Per-role rates and wait fractions of a log window (counters summed over drafter ranks)."""
        tokens = c["tokens"]
        return {
            "drafter_wait_frac": c["recv_wait_s"] / (world * dt),
            "target_wait_frac": c["target_wait_s"] / max(1e-9, c["target_wait_s"] + c["target_compute_s"]),
            "target_tok_s_per_gpu": tokens / max(1e-9, c["target_compute_s"]),
            "drafter_tok_s_per_gpu": tokens / max(1e-9, world * dt - c["recv_wait_s"]),
            "n_targets": self.me.n_targets, "n_drafters": self.me.n_drafters,
        }

    def rates_line(self, rec: dict) -> str:
        return (f"(target {rec['target_tok_s_per_gpu']:.0f}/GPU, drafter {rec['drafter_tok_s_per_gpu']:.0f}/GPU) "
                f"wait: drafters {rec['drafter_wait_frac']:.0%} targets {rec['target_wait_frac']:.0%}")

    def describe(self) -> str:
        return (f"{self.me.n_targets} target rank(s) over torch.distributed, {self.n_layers} layers"
                + (" + last hidden" if self.want_last else "") + f" sent as {self.cfg.target.dtype}")

    def cache_bytes(self, num_tokens: int) -> int | None:
        return None

    def summary(self, rows: list[dict]) -> str | None:
        """Busy per-role rates of the run's steady rows and the split they suggest for this run's GPU count and 8.

        The rates are busy rates (RemoteTargets.rates): a target's tokens over its compute time (send waits left
        out), a drafter's over its time not waiting for features. `rows` leaves out the first logged window, whose
        first step is mostly compilation."""
        busy = busy_rates(rows)
        if busy is None:
            return ("no per-role rates past the first logged window (it holds the compilation); log more often "
                    "(train.log_every) for a suggested split")
        t_rate, d_rate, n_rows = busy
        lines = [f"busy: target {t_rate:.0f} tok/s per GPU, drafter {d_rate:.0f} tok/s per GPU "
                 f"(mean of {n_rows} logged window(s), the first left out)"]
        for n, t, d, tok_s in suggested_splits(t_rate, d_rate, (self.me.world, 8)):
            lines.append(f"suggested split for {n} GPUs: {t} target + {d} drafter, expected {tok_s:.0f} tok/s")
        return "\n".join(lines)


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
    rundir.release_held_locks()  # torchrun's rank 0 holds the run dir's lock; os._exit skips atexit
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
    rundir.release_held_locks()
    os._exit(code)
