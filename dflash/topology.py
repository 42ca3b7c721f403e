"""Target GPUs feed drafter GPUs: one process per GPU over torch.distributed.

    dflash-train --config RUN.toml --target-gpus 0,1,2,3,4 --drafter-gpus 5,6,7
    torchrun --nnodes 2 --nproc-per-node 8 ... -m dflash.topology --config RUN.toml   # multi-node

Ranks 0..D-1 train the drafter (data-parallel over a drafter-only group; rank 0 logs and
checkpoints), ranks D..D+T-1 hold the frozen target. Every rank walks the same deterministic
batch sequence: global batch k is computed by target k % T and trained by drafter k % D at
step k // D, so no coordinator is needed. A target keeps at most `queue_depth` sends in
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

from dflash import checkpoint as ckpt
from dflash.config import RunConfig, config_from_dict, dump_config
from dflash.data import BucketBatchSampler, ShardDataset, collate, prefetch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
POLL_S = 0.2  # launcher's watch interval
KILL_GRACE_S = 10.0  # SIGTERM -> SIGKILL for survivors of a failed run
TARGET_STOP_GRACE_S = 60.0  # a SIGTERMed target serves this long so drafters can finish their step


@dataclass(frozen=True)
class Role:
    rank: int
    world: int
    n_drafters: int
    n_targets: int

    @property
    def is_drafter(self) -> bool:
        return self.rank < self.n_drafters

    @property
    def name(self) -> str:
        return "drafter" if self.is_drafter else "target"

    @property
    def index(self) -> int:
        """Index within its role (drafter d or target t)."""
        return self.rank if self.is_drafter else self.rank - self.n_drafters


def roles_for(cfg: RunConfig) -> list[Role]:
    nd, nt = len(cfg.topology.drafter_gpus), len(cfg.topology.target_gpus)
    return [Role(r, nd + nt, nd, nt) for r in range(nd + nt)]


def gpu_of(cfg: RunConfig, role: Role) -> str:
    gpus = cfg.topology.drafter_gpus if role.is_drafter else cfg.topology.target_gpus
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


def suggest_split(n_gpus: int, target_tok_s_per_gpu: float, drafter_tok_s_per_gpu: float) -> tuple[int, int]:
    """Targets:drafters for n_gpus so both sides process tokens at the same rate."""
    if target_tok_s_per_gpu <= 0 or drafter_tok_s_per_gpu <= 0:
        return n_gpus // 2, n_gpus - n_gpus // 2
    share = drafter_tok_s_per_gpu / (target_tok_s_per_gpu + drafter_tok_s_per_gpu)
    targets = min(n_gpus - 1, max(1, round(n_gpus * share)))
    return targets, n_gpus - targets


# ---------------------------------------------------------------------------------------------
# Launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cfg: RunConfig, resume_from: Path | None, log=print) -> int:
    """Run the split topology: in-process under torchrun, else spawn one process per GPU and watch them."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return worker(cfg, resume_from)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "config.json"
    cfg_path.write_text(dump_config(cfg))
    roles = roles_for(cfg)
    port = _free_port()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [physical_gpu(gpu_of(cfg, r), visible) for r in roles] if cfg.device == "cuda" else [None] * len(roles)
    procs: list[subprocess.Popen] = []
    stop = {"sig": None}
    old_handlers = {s: signal.signal(s, lambda signum, _f: stop.update(sig=signum))
                    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        _spawn(cfg, roles, gpus, port, cfg_path, resume_from, procs)
    except BaseException:
        _terminate(procs)
        raise
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)
    (out / "ranks.json").write_text(json.dumps(
        [{"rank": r.rank, "role": r.name, "gpu": gpu_of(cfg, r), "pid": p.pid} for r, p in zip(roles, procs)]))
    log(f"launched {len(roles)} processes: drafter ranks 0-{roles[0].n_drafters - 1} on GPUs "
        f"{','.join(cfg.topology.drafter_gpus)}, target ranks {roles[0].n_drafters}-{len(roles) - 1} on GPUs "
        f"{','.join(cfg.topology.target_gpus)} ({'nccl' if cfg.device == 'cuda' else 'gloo'})")
    return _watch(cfg, roles, procs, log, pending_signal=stop["sig"])


def _spawn(cfg, roles, gpus, port, cfg_path, resume_from, procs) -> None:
    for role, gpu in zip(roles, gpus):
        env = dict(os.environ, RANK=str(role.rank), WORLD_SIZE=str(role.world), LOCAL_RANK=str(role.rank),
                   LOCAL_WORLD_SIZE=str(role.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        cmd = [sys.executable, "-m", "dflash.topology", "--config-json", str(cfg_path)]
        if resume_from is not None:
            cmd += ["--resume", str(resume_from)]
        # own session: a terminal's Ctrl-C reaches only the launcher, which stops the drafters cleanly
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _watch(cfg: RunConfig, roles: list[Role], procs: list[subprocess.Popen], log, pending_signal=None) -> int:
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
                role, code = failed[0]
                log(f"rank {role.rank} ({role.name}, GPU {gpu_of(cfg, role)}) {_describe_exit(code)}; "
                    f"stopping the other {len(procs) - 1} processes", file=sys.stderr)
                _terminate(procs)
                latest = ckpt.list_checkpoints(cfg.output_dir)
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


class _Run:
    """What every rank shares: config, role, dataset, sampler, schedule."""

    def __init__(self, cfg: RunConfig, role: Role, resume_from: Path | None):
        self.cfg, self.role = cfg, role
        self.cuda = cfg.device == "cuda"
        # worker() picked the GPU (LOCAL_RANK under torchrun, the only visible one under our launcher)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.dataset = ShardDataset(cfg.data.path)
        self.sampler = BucketBatchSampler(self.dataset.lengths, cfg.data.token_budget, cfg.data.max_batch_size,
                                          cfg.data.num_buckets, cfg.train.seed)
        nd = role.n_drafters
        self.total_steps = cfg.train.max_steps or cfg.train.epochs * self.sampler.batches_per_epoch // nd
        self.start_step = 0
        self.resume_state = None
        self.resume_path = resume_from
        if resume_from is not None:
            self.resume_state = ckpt.load_trainer_state(resume_from)
            meta = ckpt.load_meta(resume_from)
            self.start_step = int(self.resume_state["step"])
            if meta.get("dataset", {}).get("fingerprint") == self.dataset.fingerprint:
                self.sampler.load_state_dict(self.resume_state["sampler"])
            else:
                self.sampler.load_state_dict({"epoch": self.resume_state["sampler"]["epoch"], "index": 0})
        self.start_sampler = self.sampler.state_dict()  # position of global batch k = 0
        if self.total_steps < 1:
            raise SystemExit(f"{cfg.data.path}: {self.sampler.batches_per_epoch} batches per epoch x "
                             f"{cfg.train.epochs} epochs make no step of {nd} drafter batches; "
                             "add data, epochs, or set train.max_steps")
        from transformers import AutoConfig

        from dflash.train import target_folder

        self.target_path = target_folder(cfg.target.path)
        self.target_config = AutoConfig.from_pretrained(self.target_path)
        self.wire_dtype = DTYPES[cfg.target.dtype]

    def batch_stream(self):
        """(k, epoch, indices) for global batches k = 0, 1, ... from the start position."""
        for k, (epoch, _, indices) in enumerate(self.sampler):
            yield k, epoch, indices

    def pad_id(self) -> int:
        pad = getattr(self.target_config, "pad_token_id", None)
        return pad if isinstance(pad, int) else 0

    def feature_shapes(self, batch: dict, n_layers: int) -> tuple[tuple, tuple | None]:
        B, S = batch["input_ids"].shape
        H = self.target_config.hidden_size
        last = (B, S, H) if self.cfg.train.kl_weight > 0 else None
        return (B, S, n_layers * H), last


def worker(cfg: RunConfig, resume_from: Path | None) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    roles = roles_for(cfg)
    if world != len(roles):
        raise SystemExit(f"WORLD_SIZE={world} but the config names {len(roles)} GPUs "
                         f"({len(cfg.topology.target_gpus)} target + {len(cfg.topology.drafter_gpus)} drafter)")
    role = roles[rank]
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    if cfg.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) if torch.cuda.device_count() > 1 else 0)
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.topology.timeout_s))
    drafter_group = dist.new_group(list(range(role.n_drafters)))
    share_group = dist.new_group(list(range(role.n_drafters + 1)))  # drafters + first target
    run = _Run(cfg, role, resume_from)
    torch.manual_seed(cfg.train.seed)
    if role.is_drafter:
        return _drafter_main(run, drafter_group, share_group)
    return _target_main(run, share_group)


def _target_main(run: _Run, share_group) -> int:
    from dflash.loss import target_step
    from dflash.config import default_target_layer_ids
    from dflash.target import load_target, target_embed_and_head

    # A SIGTERM that reaches every rank at once (a scheduler's cancel) must not strand the drafters
    # mid-step: a target keeps serving for TARGET_STOP_GRACE_S, then leaves (it holds no state).
    signal.signal(signal.SIGTERM, lambda *_: _exit_later(min(TARGET_STOP_GRACE_S, run.cfg.topology.timeout_s)))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher or torchrun decides when targets stop
    cfg, role = run.cfg, run.role
    target = load_target(run.target_path, DTYPES[cfg.target.dtype], run.device, cfg.target.random_init)
    if role.index == 0:
        embed, head = target_embed_and_head(target)
        dist.broadcast(embed.contiguous(), src=role.n_drafters, group=share_group)
        dist.broadcast(head.contiguous(), src=role.n_drafters, group=share_group)
    layer_ids = cfg.drafter.target_layer_ids or default_target_layer_ids(
        run.target_config.num_hidden_layers, cfg.drafter.num_layers)
    want_last = cfg.train.kl_weight > 0
    total_batches = (run.total_steps - run.start_step) * role.n_drafters
    in_flight: deque = deque()
    wait_s = 0.0
    def my_batches():  # read and collated ahead by a thread (`prefetch`)
        for k, _, indices in run.batch_stream():
            if k >= total_batches:
                return
            if k % role.n_targets == role.index:
                batch = collate(run.dataset, indices, run.pad_id())
                yield k, ({key: v.pin_memory() for key, v in batch.items()} if run.cuda else batch)

    for k, batch in prefetch(my_batches()):
        t0 = time.perf_counter()
        batch = {key: v.to(run.device, non_blocking=True) for key, v in batch.items()}
        with torch.no_grad():
            context, last = target_step(target, batch, layer_ids, want_last)
        if run.cuda:  # this stream only: a device-wide sync would also wait for our queued NCCL sends
            torch.cuda.current_stream(run.device).synchronize()
        compute_s = time.perf_counter() - t0
        dst = k % role.n_drafters
        stats = torch.tensor([compute_s, wait_s, float(batch["lengths"].sum())], dtype=torch.float64)
        tensors = [stats.to(run.device), context.to(run.wire_dtype).contiguous()]
        if want_last:
            tensors.append(last.to(run.wire_dtype).contiguous())
        handles = [dist.isend(t, dst=dst) for t in tensors]
        in_flight.append((handles, tensors))
        t1 = time.perf_counter()
        while len(in_flight) > run.cfg.topology.queue_depth:
            _complete(in_flight.popleft()[0], run)
        wait_s = time.perf_counter() - t1  # reported with the next batch
    for handles, _ in in_flight:
        _complete(handles, run)
    sys.stdout.flush()
    os._exit(0)  # every batch was received; drafters finish on their own


def _exit_later(seconds: float) -> None:
    timer = threading.Timer(seconds, lambda: os._exit(0))
    timer.daemon = True
    timer.start()


def _complete(handles, run: _Run) -> None:
    """Block until these sends are delivered (NCCL's wait() only orders the stream, so sync it too)."""
    for h in handles:
        h.wait()
    if run.cuda:
        torch.cuda.current_stream(run.device).synchronize()


class _Inbox:
    """Posts the receives of one future batch so the transfer overlaps the current step."""

    def __init__(self, run: _Run, n_layers: int):
        self.run, self.n_layers = run, n_layers

    def post(self, k: int, batch: dict):
        role = self.run.role
        ctx_shape, last_shape = self.run.feature_shapes(batch, self.n_layers)
        src = role.n_drafters + k % role.n_targets
        dev = self.run.device
        bufs = [torch.empty(3, dtype=torch.float64, device=dev),
                torch.empty(ctx_shape, dtype=self.run.wire_dtype, device=dev)]
        if last_shape is not None:
            bufs.append(torch.empty(last_shape, dtype=self.run.wire_dtype, device=dev))
        return [dist.irecv(b, src=src) for b in bufs], bufs

    @staticmethod
    def take(posted) -> tuple[list[torch.Tensor], float]:
        """Wait until the batch has arrived; returns the buffers and the seconds spent waiting."""
        handles, bufs = posted
        t0 = time.perf_counter()
        for h in handles:
            h.wait()
        if bufs[0].is_cuda:  # NCCL's wait() only orders streams; sync to see the real arrival time
            torch.cuda.current_stream(bufs[0].device).synchronize()
        return bufs, time.perf_counter() - t0


def _drafter_main(run: _Run, drafter_group, share_group) -> int:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dflash.model import DFlashDrafter, drafter_config_from_target
    from dflash.train import StopFlag, average_metrics, cosine_lr, micro_step, resolve_mask_token_id

    cfg, role = run.cfg, run.role
    nd = role.n_drafters
    dcfg = drafter_config_from_target(run.target_config, cfg.drafter.num_layers, cfg.drafter.block_size,
                                      cfg.drafter.target_layer_ids or None,
                                      resolve_mask_token_id(cfg, run.target_config))
    V, H = run.target_config.vocab_size, run.target_config.hidden_size
    embed = torch.empty(V, H, dtype=DTYPES[cfg.target.dtype], device=run.device)
    head = torch.empty(V, H, dtype=DTYPES[cfg.target.dtype], device=run.device)
    dist.broadcast(embed, src=nd, group=share_group)
    dist.broadcast(head, src=nd, group=share_group)
    drafter = DFlashDrafter(dcfg).to(run.device, torch.float32)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                                  betas=(0.9, 0.95), fused=run.cuda)
    if run.resume_state is not None:
        ckpt.load_checkpoint(run.resume_path, drafter, optimizer, run.device)
    model = DDP(drafter, process_group=drafter_group, device_ids=[run.device.index] if run.cuda else None)
    backend = "flex" if run.cuda else "sdpa"
    n_layers = len(dcfg.target_layer_ids)
    inbox = _Inbox(run, n_layers)
    is_logger = role.index == 0
    out = Path(cfg.output_dir)
    stop = StopFlag()
    stop.install()
    check_replicas = os.environ.get("DFLASH_CHECK_REPLICAS") == "1"
    metrics_file = (out / "metrics.jsonl").open("a") if is_logger else None

    step = run.start_step

    def my_batches():  # read and collated ahead by a thread (`prefetch`)
        stream = run.batch_stream()
        while True:
            group = [next(stream) for _ in range(nd)]
            k, epoch, indices = group[role.index]
            yield k, epoch, collate(run.dataset, indices, run.pad_id())

    mine = prefetch(my_batches())

    def next_mine():
        """The batch this drafter trains at the next step, with its receive posted."""
        k, epoch, batch = next(mine)
        return k, epoch, batch, inbox.post(k, batch)

    acc = {"tokens": 0.0, "d_wait": 0.0, "t_compute": 0.0, "t_wait": 0.0, "t0": time.perf_counter()}
    pending = next_mine() if step < run.total_steps else None
    stopping = False
    while pending is not None:
        k, epoch, batch, posted = pending
        (stats, context, *last), recv_wait = _Inbox.take(posted)
        lr = cfg.train.lr * cosine_lr(step, run.total_steps, cfg.train.warmup_ratio)
        for g in optimizer.param_groups:
            g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        batch_index = run.start_step * nd + k
        loss, m = micro_step(model, embed, head, batch, cfg, run.device, backend, batch_index,
                             context=(context, last[0] if last else None))
        loss.backward()
        grad_norm = None
        if cfg.train.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.train.grad_clip))
        optimizer.step()
        step += 1
        pending = next_mine() if step < run.total_steps else None  # post the next receive early
        acc["tokens"] += float(stats[2])
        acc["d_wait"] += recv_wait
        acc["t_compute"] += float(stats[0])
        acc["t_wait"] += float(stats[1])
        # all drafters agree on stopping (a signal may reach only some of them)
        flag = torch.tensor([1.0 if stop.requested else 0.0], device=run.device)
        dist.all_reduce(flag, group=drafter_group)
        stopping = bool(flag.item() > 0)
        if step % cfg.train.log_every == 0 or step == run.total_steps or stopping:
            rec = _log_record(run, model, drafter, drafter_group, acc, float(loss.detach()), m, lr, grad_norm,
                              step, epoch, check_replicas)
            if is_logger:
                metrics_file.write(json.dumps(rec) + "\n")
                metrics_file.flush()
                print(f"step {step}/{run.total_steps} loss {rec['loss']:.4f} accept {rec['accept_len']:.3f} "
                      f"tok/s {rec['tok_per_s']:.0f} (target {rec['target_tok_s_per_gpu']:.0f}/GPU, drafter "
                      f"{rec['drafter_tok_s_per_gpu']:.0f}/GPU) wait: drafters {rec['drafter_wait_frac']:.0%} "
                      f"targets {rec['target_wait_frac']:.0%}", flush=True)
            acc = {"tokens": 0.0, "d_wait": 0.0, "t_compute": 0.0, "t_wait": 0.0, "t0": time.perf_counter()}
        if is_logger and (step % cfg.train.save_every == 0 or step == run.total_steps or stopping):
            _save(run, drafter, optimizer, step, k)
        if stopping:
            break
    stop.restore()
    if is_logger:
        metrics_file.close()
        if stopping:
            print(f"stopped by {stop.signame or 'a peer signal'} at step {step}; resume with --resume latest",
                  flush=True)
        else:
            drafter.save_pretrained(out / "drafter")
            _print_split(run, out / "metrics.jsonl")
    dist.barrier(group=drafter_group)
    os._exit(0)  # targets may still block in sends nobody will receive; the launcher reaps them


def _log_record(run, model, drafter, drafter_group, acc, loss, m, lr, grad_norm, step, epoch, check_replicas):
    nd, nt = run.role.n_drafters, run.role.n_targets
    dt = time.perf_counter() - acc["t0"]
    vals = torch.tensor([acc["tokens"], acc["d_wait"], acc["t_compute"], acc["t_wait"], loss,
                         m.get("accept_len", 0.0), m.get("acc", 0.0)], dtype=torch.float64, device=run.device)
    dist.all_reduce(vals, group=drafter_group)
    tokens, d_wait, t_compute, t_wait, loss_sum, accept_sum, acc_sum = vals.tolist()
    rec = {
        "step": step, "epoch": epoch, "loss": loss_sum / nd, "accept_len": accept_sum / nd, "acc": acc_sum / nd,
        "lr": lr, "grad_norm": grad_norm, "tok_per_s": tokens / dt,
        "drafter_wait_frac": d_wait / (nd * dt),
        "target_wait_frac": t_wait / max(1e-9, t_wait + t_compute),
        "target_tok_s_per_gpu": tokens / max(1e-9, t_compute),
        "drafter_tok_s_per_gpu": tokens / max(1e-9, nd * dt - d_wait),
        "n_targets": nt, "n_drafters": nd,
        "mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if run.cuda else None,
    }
    if check_replicas:
        flat = torch.cat([p.detach().flatten() for p in drafter.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(nd)]
        dist.all_gather(gathered, flat, group=drafter_group)
        rec["replica_max_diff"] = max(float((g - gathered[0]).abs().max()) for g in gathered)
    return rec


def _save(run: _Run, drafter, optimizer, step: int, k: int) -> None:
    # Position after this step's batches: every rank consumed (step - start) * D batches of the stream.
    consumed = (step - run.start_step) * run.role.n_drafters
    sampler = BucketBatchSampler(run.dataset.lengths, run.cfg.data.token_budget, run.cfg.data.max_batch_size,
                                 run.cfg.data.num_buckets, run.cfg.train.seed)
    sampler.load_state_dict(run.start_sampler)
    bpe = sampler.batches_per_epoch
    flat = sampler.state_dict()["epoch"] * bpe + sampler.state_dict()["index"] + consumed
    state = {"step": step, "sampler": {"epoch": flat // bpe, "index": flat % bpe}, "rng_cpu": torch.get_rng_state(),
             "rng_cuda": None, "n_drafters": run.role.n_drafters}
    meta = {"path": run.cfg.data.path, "samples": run.dataset.num_samples, "fingerprint": run.dataset.fingerprint}
    ckpt.save_checkpoint(run.cfg.output_dir, step, drafter, optimizer, state, run.cfg, meta, run.cfg.train.keep_last)


def _print_split(run: _Run, metrics_path: Path) -> None:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    rows = [r for r in rows if "target_tok_s_per_gpu" in r][-10:]
    if not rows:
        return
    t_rate = sum(r["target_tok_s_per_gpu"] for r in rows) / len(rows)
    d_rate = sum(r["drafter_tok_s_per_gpu"] for r in rows) / len(rows)
    n = run.role.n_drafters + run.role.n_targets
    lines = [f"measured: target {t_rate:.0f} tok/s per GPU, drafter {d_rate:.0f} tok/s per GPU"]
    for total in sorted({n, 8}):
        t, d = suggest_split(total, t_rate, d_rate)
        lines.append(f"suggested split for {total} GPUs: {t} target + {d} drafter")
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m dflash.topology", description=__doc__.splitlines()[0])
    ap.add_argument("--config-json", help="resolved config written by the launcher")
    ap.add_argument("--config", help="run config TOML (under torchrun)")
    ap.add_argument("--resume", help="checkpoint folder to resume from")
    args = ap.parse_args(argv)
    if args.config_json:
        cfg = config_from_dict(json.loads(Path(args.config_json).read_text()), source=args.config_json)
    elif args.config:
        from dflash.config import load_config
        cfg = load_config(args.config)
    else:
        ap.error("give --config RUN.toml")
    return worker(cfg, Path(args.resume) if args.resume else None)


if __name__ == "__main__":
    sys.exit(main())
