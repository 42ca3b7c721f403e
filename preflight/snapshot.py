"""A run's snapshot, filled from the facts preflight gathered: everything that can move speed or memory.

    from preflight.snapshot import take, here
    snap = take(ctx, report)            # the gate: facts of this launch (dflash.runs.records.write_snapshot stores it)
    now = here(snap)                    # dflash-diff --here: this machine now, for the run that snapshot started

No I/O of its own beyond what `preflight.facts.gather` already did (`here` gathers again), no torch,
no CUDA context. The file's layout is `dflash.runs.records`'s; this module only fills it.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict

from dflash.runs.records import FORMAT, now_utc
from preflight.facts.context import Context

# Environment variables that change what a run loads, how it allocates or how it talks to its peers.
ENV_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH",
             "OMP_NUM_THREADS", "CUDA_LAUNCH_BLOCKING", "CUDA_MODULE_LOADING", "CUDA_DEVICE_MAX_CONNECTIONS")
ENV_PREFIXES = ("NCCL_", "TORCH_", "TORCHINDUCTOR_", "TRITON_", "PYTORCH_")
# Builds of the GPU stack by distribution name prefix, for a reader of the snapshot (the diff compares distributions).
BUILDS = {"cudnn": "nvidia-cudnn-cu", "nccl": "nvidia-nccl-cu", "cublas": "nvidia-cublas-cu", "cuda_runtime": "nvidia-cuda-runtime-cu"}
PERCENTILES = (50, 90, 99)


def take(ctx: Context, report=None) -> dict:
    """The snapshot of a run about to start (``ctx`` gathered with its config; ``report``: the gate's verdicts).

    The gate adds the run's identity (`stamp`) before writing it.
    """
    assert ctx.config is not None, "a snapshot is of a run: gather with its config"
    snap = {
        "format": FORMAT,
        "run": {"intent": ctx.resume_intent, "resume": _resume(ctx)},
        "environment": _environment(ctx),
        "gpus": _gpus(ctx),
        "code": _code(ctx),
        "compile_cache": _compile_cache(ctx),
        "config": ctx.config.model_dump(mode="json"),
        "data": _data(ctx),
        "target": _target(ctx),
        "memory": _memory(ctx),
    }
    if report is not None:
        snap["preflight"] = {"ok": report.ok, "failed": [c.id for c in report.with_status("fail")],
                             "warned": [c.id for c in report.with_status("warn")],
                             "waived": {c.id: c.data.get("waiver", {}).get("reason") for c in report.with_status("waived")}}
    return snap


def stamp(snap: dict, run: dict) -> dict:
    """The gate's identity of the run (gate_id, config_sha256, time_utc) into the snapshot's run section."""
    snap["run"].update({k: run.get(k) for k in ("gate_id", "config_sha256", "time_utc")})
    if run.get("ranks") is not None:
        snap["run"]["ranks"] = len(run["ranks"])
    return snap


def here(snap: dict, gpu_info=None) -> dict:
    """This machine now, for the run `snap` started: the same config and profile, gathered again, nothing started.

    The profile's environment variables count as set where the shell leaves them unset, as `dflash-train`
    sets them before torch loads. Reads only (the run dir, the dataset, the environment). Raises ConfigError.
    """
    from dflash.config import config_from_dict
    from preflight.facts.gather import gather
    from preflight.nvml import NvmlGpuInfo
    from preflight.profiles import ProfileError, compile_cache_dir, profile_env, triton_cache_dir

    cfg = config_from_dict(snap["config"], source="the snapshot's config")
    environ = dict(os.environ)
    try:
        for key, value in profile_env(cfg.profile).items():
            environ.setdefault(key, value)
        environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_dir(cfg.profile)))
        environ.setdefault("TRITON_CACHE_DIR", str(triton_cache_dir(cfg.profile)))
    except ProfileError:
        pass  # an unknown profile now: the environment section shows what is there
    real = gpu_info is None and cfg.device != "cpu"
    if real:
        gpu_info = NvmlGpuInfo()
    ctx = gather(cfg.profile, cfg, None, gpu_info, environ=environ)
    if real:  # the memory outside torch on this machine now (cached per machine state: a probe only after a change)
        from preflight.probe import probe_for_run

        ctx.overhead = probe_for_run(ctx)
    out = take(ctx)
    out["run"] = {"here": True, "time_utc": now_utc()}
    return out


# ---------------------------------------------------------------- sections


def _resume(ctx: Context) -> dict | None:
    if ctx.resume_intent != "resume" or ctx.run_dir is None or ctx.run_dir.newest is None:
        return None
    newest = ctx.run_dir.newest
    return {"step": newest.step, "checkpoint": os.path.basename(newest.path)}


def _environment(ctx: Context) -> dict:
    dists = {name: ", ".join(versions) for name, versions in sorted(ctx.distributions.items())}
    records = {}
    for r in (ctx.records.checks if ctx.records else []):
        records[r.name] = {"version": r.version, "record_sha256": r.record_sha256, "modified": len(r.modified),
                           "missing": len(r.missing), "error": r.error}
    builds = {"torch": ctx.torch.version if ctx.torch else None, "cuda": ctx.torch.cuda if ctx.torch else None,
              "triton": dists.get("triton")}
    for label, prefix in BUILDS.items():
        builds[label] = next((v for n, v in dists.items() if n.startswith(prefix)), None)
    env = {k: v for k, v in ctx.env.items() if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}
    host = ctx.host or {}
    return {
        "profile": ctx.profile_name,
        "lock_sha256": hashlib.sha256(ctx.lock_text.encode()).hexdigest() if ctx.lock_text is not None else None,
        "torch": {"version": ctx.torch.version, "cuda": ctx.torch.cuda} if ctx.torch else None,
        "builds": builds,
        "distributions": dists,
        "records": records,
        "env": dict(sorted(env.items())),
        "path": [e.path for e in ctx.path_entries],
        "host": {k: host.get(k) for k in ("hostname", "platform", "python", "executable", "cpus")},
    }


def _gpus(ctx: Context) -> dict:
    from preflight.checks.gpus import assigned_gpus
    from preflight.nvml import resolve_gpu, visible_gpus

    g = ctx.gpus
    out = {"cuda_visible_devices": g.cuda_visible_devices, "error": g.error, "driver": None, "cuda_driver": None,
           "devices": []}
    if g.snapshot is None:
        return out
    out["driver"], out["cuda_driver"] = g.snapshot.driver_version, g.snapshot.cuda_driver_version
    visible, _ = visible_gpus(g.snapshot.gpus, g.cuda_visible_devices)
    roles: dict[str, list[str]] = {}
    own, ctx.own_gpus = ctx.own_gpus, None  # a torchrun rank 0 checked its own GPU; the snapshot lists every role
    try:
        assigned = assigned_gpus(ctx) if ctx.config.device == "cuda" else {}
    finally:
        ctx.own_gpus = own
    for name, role in assigned.items():
        gpu, _ = resolve_gpu(name, visible, g.snapshot.gpus)
        if gpu is not None:  # recorded as before: a co-located GPU lists both roles (preflight diff pairs GPUs by them)
            roles.setdefault(gpu.uuid, []).extend(["target", "drafter"] if role == "colocated" else [role])
    cuda_index = {gpu.uuid: i for i, gpu in enumerate(visible)}
    for gpu in g.snapshot.gpus:
        out["devices"].append({"index": gpu.index, "cuda_index": cuda_index.get(gpu.uuid), "uuid": gpu.uuid,
                               "name": gpu.name, "total_bytes": gpu.memory_total, "free_bytes": gpu.memory_free,
                               "compute_capability": gpu.compute_capability, "roles": sorted(roles.get(gpu.uuid, []))})
    return out


def _code(ctx: Context) -> dict:
    ms = ctx.model_source
    return {"mode": ms.mode, "commit": ms.commit, "error": ms.error,
            "dirty": {path: {"state": ms.states.get(path, "modified"), "sha256": ms.sha256.get(path)}
                      for path in ms.modified}}


def _compile_cache(ctx: Context) -> dict | None:
    cc = ctx.compile_cache
    if cc is None:
        return None
    return {"path": cc.path, "exists": cc.exists, "size_bytes": cc.size_bytes, "manifest": cc.manifest,
            "error": cc.error, "env_override": cc.env_override}


def _data(ctx: Context) -> dict:
    ds = ctx.dataset
    out: dict = {"path": ctx.config.data.path}
    if ds is None:
        return out
    if ds.error:
        return dict(out, error=ds.error)
    lengths = [s.lengths for s in ds.shards if s.lengths is not None and len(s.lengths)]
    out.update(fingerprint=ds.fingerprint, samples=ds.samples, tokens=sum(s.tokens for s in ds.shards),
               shards=len(ds.shards), errors=sorted({s.error for s in ds.shards if s.error}))
    if lengths:
        import numpy as np

        all_ = np.concatenate(lengths)
        out["length"] = {"min": int(all_.min()), "mean": round(float(all_.mean()), 1), "max": int(all_.max()),
                         **{f"p{q}": int(np.percentile(all_, q)) for q in PERCENTILES}}
    if ds.manifest is not None:
        out["manifest_target"] = ds.manifest.get("target")
    return out


def _target(ctx: Context) -> dict:
    out = {"path": ctx.config.target.path, "precision": ctx.config.target.precision,
           "shape": asdict(ctx.target_shape) if ctx.target_shape else None, "error": ctx.target_error}
    if ctx.dataset is not None:
        out["fingerprint"] = ctx.dataset.target
    return out


def _memory(ctx: Context) -> dict:
    """The memory model's peak per role of this run, with the CUDA of the installed torch build (the one the run
    loads), the memory outside torch the probe measured on the role's GPUs (`overhead`, per GPU UUID) and
    recompute = auto resolved as the trainer will, on the free memory of the role's GPU."""
    from dflash.errors import DflashError
    from dflash.memory.parts import (
        DEFAULT_CALIBRATION,
        choose_parallel,
        parallel_mode,
        recompute_mode,
        role_need_bytes,
        with_measured_overhead,
        with_parallel,
        with_recompute,
    )
    from preflight.estimate import DEFAULT_CUDA

    cfg = ctx.config
    cuda = (ctx.torch.cuda if ctx.torch and ctx.torch.cuda else None) or (ctx.profile.cuda if ctx.profile else DEFAULT_CUDA)
    expandable = "expandable_segments:true" in ctx.env.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    out: dict = {"cuda": cuda, "expandable_segments": expandable, "roles": {}}
    free, measured = {}, {}
    for d in _gpus(ctx)["devices"]:
        ov = ctx.overhead.gpus.get(d["uuid"]) if ctx.overhead is not None else None
        if ov is not None:
            out.setdefault("overhead", {})[d["uuid"]] = {
                "source": ov.source, "outside_torch_bytes": ov.outside_torch_bytes, "context_bytes": ov.context_bytes,
                "nccl_bytes": ov.nccl_bytes, "note": ov.note, "state": ov.state, "roles": d["roles"]}
        for role in d["roles"]:
            free[role] = min(free.get(role, d["free_bytes"]), d["free_bytes"])
            if ov is not None and ov.measured and ov.outside_torch_bytes >= measured.get(role, (-1,))[0]:
                measured[role] = (ov.outside_torch_bytes, ov)
    if ctx.target_shape is None:
        out["error"] = ctx.target_error
        return out
    try:
        for role in cfg.topology.roles:
            mode, dp = recompute_mode(cfg), parallel_mode(cfg)
            key = "drafter" if role == "colocated" else role
            gpu_free = free.get(key)
            cal = DEFAULT_CALIBRATION  # the role's GPU that measured the most outside torch, if any did
            if key in measured:
                ov = measured[key][1]
                cal = with_measured_overhead(cal, cuda, ov.context_bytes, ov.nccl_bytes)
            if role != "target" and cfg.device == "cuda" and gpu_free is not None:
                dp, mode, _ = choose_parallel(cfg, role, cuda, gpu_free, cal, shape=ctx.target_shape)
            need = role_need_bytes(with_recompute(with_parallel(cfg, dp), mode), role, cuda, cal, shape=ctx.target_shape)
            out["roles"][role] = {"bytes": need, "recompute": mode, "data_parallel": dp}
    except DflashError as e:
        out["error"] = e.one_line()
    return out
