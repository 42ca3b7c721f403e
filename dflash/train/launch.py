"""The launcher of multi-process runs: one process per GPU of the config, watched until the drafters finish.

    dflash-train --config RUN.toml --target-gpus 0,1,2,3,4 --drafter-gpus 5,6,7
    dflash-train --config RUN.toml --colocated-gpus 0,1,2,3,4,5,6,7    # co-located data parallel, the same launcher
    torchrun --nproc-per-node 8 -m dflash.commands.torchrun --config RUN.toml --fresh   # torchrun (also multi-node)

`dflash-train` spawns every rank (the module it names, `dflash.commands.torchrun`, whose work is dflash.train.ranks.worker) after its gate
passed; the ranks find the gate's fresh `preflight.json` of this run. The launcher watches every process: if one
dies, the others are stopped and the dead rank, its GPU and its role are named.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from dflash.config import RunConfig, dump_config
from dflash.runs import rundir
from dflash.train.layout import Rank, ranks_for

GATE_ENV = "DFLASH_GATE_ID"  # set by the launcher: the gate_id of the preflight.json its workers must find
POLL_S = 0.2  # launcher's watch interval
KILL_GRACE_S = 10.0  # SIGTERM -> SIGKILL for survivors of a failed run
EXIT_PEER_GONE = 3  # a rank's exit when another rank's process is gone (dflash.train.ranks): that one is the cause
PEER_GONE_WAIT_S = 5.0  # how long a gone rank's peers get to leave on their own (EXIT_PEER_GONE), and to be explained


def physical_gpu(entry: str, visible: str | None) -> str:
    """A config GPU entry (index after CUDA_VISIBLE_DEVICES, or UUID) -> what to put in the child's CUDA_VISIBLE_DEVICES."""
    if not entry.isdigit() or not visible:
        return entry
    listed = [v.strip() for v in visible.split(",") if v.strip()]
    i = int(entry)
    if i >= len(listed):
        raise ValueError(f"GPU {entry} is not visible: CUDA_VISIBLE_DEVICES={visible} lists {len(listed)} GPUs")
    return listed[i]


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


def launch(cfg: RunConfig, resume_from: Path | None, gate_id: str, entry: str, log=print, lock=None) -> int:
    """Spawn one process per GPU and watch them (dflash-train, after its gate passed with `gate_id`).

    `entry`: the module every rank runs with `python -m` (the torchrun command, which the command layer names: the
    library never names a command).

    `lock`: the run dir's lock this launcher holds (dflash.runs.lock.lock_run_dir); every rank inherits it, so the
    run dir stays locked while any of them lives, even if the launcher is killed."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / rundir.CONFIG_NAME
    cfg_path.write_text(dump_config(cfg))
    roles = ranks_for(cfg)
    port = _free_port()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [physical_gpu(r.gpu, visible) for r in roles] if cfg.device == "cuda" else [None] * len(roles)
    procs: list[subprocess.Popen] = []
    stop = {"sig": None}
    old_handlers = {s: signal.signal(s, lambda signum, _f: stop.update(sig=signum))
                    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    # Until _watch takes over, a signal is only recorded and any failure (ranks.json on a full disk) stops the
    # ranks: a launcher leaving here must never leave ranks running unwatched (they share its run-dir lock).
    try:
        _spawn(cfg, roles, gpus, port, cfg_path, resume_from, procs, gate_id, lock, entry)
        (out / rundir.RANKS_NAME).write_text(json.dumps(
            [{"rank": r.rank, "role": r.role, "gpu": r.gpu, "pid": p.pid} for r, p in zip(roles, procs)]))
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


def _spawn(cfg, roles, gpus, port, cfg_path, resume_from, procs, gate_id, lock, entry) -> None:
    for role, gpu in zip(roles, gpus):
        env = dict(os.environ, RANK=str(role.rank), WORLD_SIZE=str(role.world), LOCAL_RANK=str(role.rank),
                   LOCAL_WORLD_SIZE=str(role.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env[GATE_ENV] = gate_id
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        elif "OMP_NUM_THREADS" not in os.environ:  # CPU ranks share this machine's cores; a user's setting wins
            env["OMP_NUM_THREADS"] = str(cpu_threads_per_rank(len(roles)))
        cmd = [sys.executable, "-m", entry, "--config-json", str(cfg_path)]
        if resume_from is not None:
            cmd += ["--resume", str(resume_from)]
        # own session: a terminal's Ctrl-C reaches only the launcher, which stops the drafters cleanly
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True,
                                      pass_fds=(lock.fileno(),) if lock is not None else ()))


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    if code == EXIT_PEER_GONE:
        return f"exited with code {code} (its connection to another rank closed)"
    return f"exited with code {code}"


def _watch(cfg: RunConfig, roles: list[Rank], procs: list[subprocess.Popen], log, pending_signal=None) -> int:
    def forward(signum, _frame):
        for role, p in zip(roles, procs):
            if role.is_drafter and p.poll() is None:
                p.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    if pending_signal is not None:  # arrived while spawning
        forward(pending_signal, None)
    peer_gone_at = None
    try:
        while True:
            drafters_done = all(p.poll() == 0 for r, p in zip(roles, procs) if r.is_drafter)
            failed = [(r, p.returncode) for r, p in zip(roles, procs) if p.poll() not in (None, 0)]
            if failed and not (drafters_done and all(not r.is_drafter for r, _ in failed)):
                # A gone rank's peers leave within a second (EXIT_PEER_GONE): the rank that is gone is the cause.
                # Ranks that only saw a peer leave wait a while for it (drafters that saved and exited are one).
                if all(c == EXIT_PEER_GONE for _, c in failed):
                    peer_gone_at = peer_gone_at or time.monotonic()
                    if time.monotonic() - peer_gone_at < PEER_GONE_WAIT_S:
                        time.sleep(POLL_S)
                        continue
                # found together in one look: a signal's death (the launcher sent none yet), then an error's
                role, code = min(failed, key=lambda f: (f[1] >= 0, f[1] == EXIT_PEER_GONE))
                log(f"rank {role.rank} ({role.role}, GPU {role.gpu}) {_describe_exit(code)}; "
                    f"stopping the other {len(procs) - 1} processes", file=sys.stderr)
                _terminate(procs, settle_s=PEER_GONE_WAIT_S)  # a signal now would start a drafter's stop-and-save
                from dflash.runs.records import record_crash

                record_crash(cfg.output_dir, role.rank, role.role, role.gpu, _describe_exit(code))
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


def _terminate(procs: list[subprocess.Popen], settle_s: float = 0.0) -> None:
    """Stop every process still running: SIGTERM once they had `settle_s` to leave on their own, SIGKILL
    KILL_GRACE_S later."""
    deadline = time.time() + settle_s
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(POLL_S)
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
