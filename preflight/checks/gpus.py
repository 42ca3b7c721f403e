"""The GPU checks: gpu-visibility (each assigned GPU visible, one role each), gpu-memory (free memory against the
memory model), gpu-processes (no other process on them)."""

from __future__ import annotations

from collections.abc import Callable

from dflash.config import ConfigError, GpuRole
from dflash.errors import DflashError
from dflash.memory.parts import (
    DEFAULT_CALIBRATION,
    Calibration,
    choose_parallel,
    fits_gpu,
    headroom_bytes,
    role_need_bytes,
    role_parts,
    with_measured_overhead,
    with_parallel,
)
from preflight.checks.common import GiB, MiB, config_arg, gib, listing, no_shape, on_cpu, result
from preflight.estimate import DEFAULT_CUDA
from preflight.facts.context import Context
from preflight.facts.overhead import GpuOverhead
from preflight.nvml import NO_DRIVER, Gpu, visible_gpus
from preflight.report import CheckResult


def assigned_gpus(ctx: Context) -> dict[str, GpuRole]:
    """GPU name in the run config -> its role (Context.assigned_gpus)."""
    return ctx.assigned_gpus()


def _gpu_gate(ctx: Context, check_id: str) -> CheckResult | None:
    if on_cpu(ctx):
        return result(check_id, "skip", "device = cpu: no GPU needed")
    if ctx.gpus.snapshot is None:
        return result(check_id, "fail", ctx.gpus.error or NO_DRIVER,
                      "install/load the NVIDIA driver (nvidia-smi must work), or set device = \"cpu\" in the run config")
    return None


def resolved_gpus(ctx: Context) -> list[tuple[str, GpuRole, Gpu | None, str | None]]:
    """(name, role, the GPU it resolves to or None, why not) for each GPU the run is assigned (Context.resolved_gpus)."""
    return ctx.resolved_gpus()


def check_gpu_visibility(ctx: Context) -> CheckResult:
    gate = _gpu_gate(ctx, "gpu-visibility")
    if gate:
        return gate
    snap = ctx.gpus.snapshot
    cvd = ctx.gpus.cuda_visible_devices
    visible, note = visible_gpus(snap.gpus, cvd)
    data = dict(driver=snap.driver_version, cuda_driver=snap.cuda_driver_version, cuda_visible_devices=cvd,
                visible=[{"cuda_index": i, "nvml_index": g.index, "uuid": g.uuid, "name": g.name}
                         for i, g in enumerate(visible)])
    seen = f"{len(visible)} of {len(snap.gpus)} GPUs visible" + (f" (CUDA_VISIBLE_DEVICES={cvd})" if cvd is not None else "")
    cvd_fix = "fix CUDA_VISIBLE_DEVICES (indices or UUIDs from `nvidia-smi -L`), or unset it"
    if ctx.config is None:
        if not visible:
            return result("gpu-visibility", "fail", f"NVML reachable but no GPU visible: {note or seen}", cvd_fix, **data)
        names = sorted({g.name for g in visible})
        summary = f"NVML reachable, {seen}: {', '.join(names)}"
        return result("gpu-visibility", "warn" if note else "pass", summary + (f"; {note}" if note else ""), cvd_fix, **data)
    problems = []
    owners: dict[str, list[tuple[str, str]]] = {}
    rows = resolved_gpus(ctx)
    for name, role, gpu, why in rows:
        if gpu is None:
            problems.append(f"{role} {why}")
            continue
        owners.setdefault(gpu.uuid, []).append((name, role))
    for uuid, names in owners.items():
        if len(names) > 1:
            listed = ", ".join(f"{n} ({r})" for n, r in names)
            problems.append(f"{listed} are the same GPU {uuid}")
    data["assigned"] = [{"name": n, "role": r, "uuid": g.uuid if g else None, "problem": w} for n, r, g, w in rows]
    if note:
        data["note"] = note
    if problems:
        fix = ("set topology.target_gpus / drafter_gpus (or colocated_gpus) to distinct visible GPUs "
               f"(0..{len(visible) - 1} after CUDA_VISIBLE_DEVICES, or UUIDs), or {cvd_fix}")
        return result("gpu-visibility", "fail", f"{listing(problems, 3)}; {seen}", fix, **data)
    return result("gpu-visibility", "pass",
                  f"all {len(rows)} assigned GPUs visible and each has one role; {seen}", **data)


MEMORY_MODEL = "memory model"  # the label gpu-memory's summary and data carry


def _cuda(ctx: Context) -> str:
    return ctx.profile.cuda if ctx.profile else DEFAULT_CUDA


def gpu_calibration(ctx: Context, uuid: str) -> tuple[Calibration, GpuOverhead | None]:
    """The memory model's constants for one GPU: the overhead outside torch the probe measured there (context and
    kernels, and NCCL where it built a communicator) in place of the calibrated constants, when it measured one."""
    ov = ctx.overhead.gpus.get(uuid) if ctx.overhead is not None else None
    if ov is None or not ov.measured:
        return DEFAULT_CALIBRATION, ov
    return with_measured_overhead(DEFAULT_CALIBRATION, _cuda(ctx), ov.context_bytes, ov.nccl_bytes), ov


def constant_outside_torch(ctx: Context, role: GpuRole, cal: Calibration = DEFAULT_CALIBRATION) -> int:
    """What the memory model counts outside torch for one GPU of `role` with cal (the fixed parts)."""
    return sum(p.bytes for p in role_parts(ctx.config, ctx.target_shape, role, _cuda(ctx), cal) if p.kind == "fixed")


def _need(ctx: Context, role: GpuRole, free: int | None = None, role_free: int | None = None,
          cal: Calibration = DEFAULT_CALIBRATION) -> tuple[int, str]:
    """Bytes one GPU of this role needs, from the gathered target shape.

    train.recompute and train.data_parallel = auto are judged as the trainer will resolve them
    (dflash.memory.parts.choose_parallel): the data-parallel mode on the smallest free memory of the role's GPUs
    (role_free; every rank must hold the drafter alike), then the fastest recompute that fits this GPU's `free`.
    """
    if ctx.target_shape is None:
        raise ConfigError(no_shape(ctx))
    cuda = _cuda(ctx)
    cfg = ctx.config
    auto_dp = cfg.train.data_parallel == "auto" and cfg.topology.layout == "colocated-dp"
    if (cfg.train.recompute == "auto" or auto_dp) and free is not None and role != "target":
        dp = choose_parallel(cfg, role, cuda, free if role_free is None else role_free, cal, shape=ctx.target_shape)[0]
        _, mode, need = choose_parallel(with_parallel(cfg, dp), role, cuda, free, cal, shape=ctx.target_shape)
        label = [f"recompute auto -> {mode}"] if cfg.train.recompute == "auto" else []
        label += [f"data_parallel auto -> {dp}"] if auto_dp else []
        return need, f"{MEMORY_MODEL}, {', '.join(label)}"
    return role_need_bytes(cfg, role, cuda, cal, shape=ctx.target_shape), MEMORY_MODEL


def _overhead_label(rows: list[dict]) -> str:
    """'outside torch measured 1.12 GiB per GPU' (or a range), '' when no GPU was probed."""
    got = sorted({r["outside_torch_bytes"] for r in rows if r.get("outside_torch_bytes") is not None})
    if not got:
        return ""
    cached = all(r["outside_torch_source"] == "cached" for r in rows if r.get("outside_torch_bytes") is not None)
    how = "measured (cached)" if cached else "measured"
    value = gib2(got[0]) if gib2(got[0]) == gib2(got[-1]) else f"{gib2(got[0])}-{gib2(got[-1])}"
    return f"outside torch {how} {value} GiB per GPU"


def gib2(n: int) -> str:
    return f"{n / GiB:.2f}"


def check_gpu_memory(ctx: Context, need_fn: Callable[[Context, GpuRole], tuple[int, str]] | None = None) -> CheckResult:
    gate = _gpu_gate(ctx, "gpu-memory")
    if gate:
        return gate
    rows, short, lines, unprobed = [], [], [], []
    model = ""
    resolved = resolved_gpus(ctx)
    role_free: dict[str, int] = {}
    for _name, role, gpu, _why in resolved:
        if gpu is not None:
            role_free[role] = min(role_free.get(role, gpu.memory_free), gpu.memory_free)
    for name, role, gpu, _why in resolved:
        if gpu is None:
            continue
        cal, ov = gpu_calibration(ctx, gpu.uuid)
        try:
            need, model = need_fn(ctx, role) if need_fn else _need(ctx, role, gpu.memory_free, role_free[role], cal)
            constant = constant_outside_torch(ctx, role) if ctx.target_shape is not None else None
        except DflashError as e:
            return result("gpu-memory", "fail", f"memory model failed: {e.one_line()}",
                          f"dflash-estimate --config {config_arg(ctx)}")
        head, keep = gpu.memory_free - need, headroom_bytes(ctx.config)
        measured = constant_outside_torch(ctx, role, cal) if ov is not None and ov.measured else None
        rows.append({"name": name, "uuid": gpu.uuid, "role": role, "need_bytes": need,
                     "free_bytes": gpu.memory_free, "headroom_bytes": head, "keep_bytes": keep,
                     "outside_torch_bytes": measured, "outside_torch_constant_bytes": constant,
                     "outside_torch_source": ov.source if ov is not None else "constant"})
        if ov is not None and not ov.measured:
            unprobed.append(ov.note or f"GPU {name} not probed")
        lines.append(f"{role} GPU {name} need {gib(need)} / free {gib(gpu.memory_free)} ({'+' if head >= 0 else ''}{gib(head)})")
        if not fits_gpu(ctx.config, need, gpu.memory_free):
            text = (f"{role} GPU {name} ({gpu.uuid[:12]}…): need {gib(need)} + {gib(keep)} kept free "
                    f"(train.memory_headroom_gib), free {gib(gpu.memory_free)}, short {gib(need + keep - gpu.memory_free)}")
            if measured is not None:
                text += (f"; budget {gib2(gpu.memory_free - keep)} GiB for the run's peak, of which outside torch "
                         f"{gib2(measured)} GiB measured on this GPU (calibrated constant {gib2(constant)})")
            short.append(text)
    if not rows:
        return result("gpu-memory", "skip", "no assigned GPU is visible (see gpu-visibility)")
    overhead = _overhead_label(rows)
    label = f" [{'; '.join(x for x in (model, overhead) if x)}]" if model or overhead else ""
    data = dict(gpus=rows, model=model, overhead_notes=list(ctx.overhead.notes) if ctx.overhead else [],
                unprobed=unprobed)
    if short:
        grew = any(r["outside_torch_bytes"] is not None and r["outside_torch_constant_bytes"] is not None
                   and r["outside_torch_bytes"] > r["outside_torch_constant_bytes"] for r in rows)
        why = ("; the overhead outside torch is measured on this machine and is above the calibrated constant: a "
               "torch, CUDA, driver or NCCL change raised it (`dflash-diff` names it; `python -m preflight.probe "
               "--gpus N` shows each step)") if grew else ""
        return result("gpu-memory", "fail", f"{listing(short, 3)}{label}",
                      "free the GPUs (see gpu-processes), or lower data.token_budget / train.max_anchors, or set "
                      "train.recompute = \"mlp\" (or train.memory_headroom_gib, at the risk of an OOM the model did "
                      f"not predict) in {config_arg(ctx)} (`dflash-estimate --config {config_arg(ctx)}` shows what "
                      f"fits){why}", **data)
    if unprobed:
        return result("gpu-memory", "warn", "; ".join(lines) + label + f"; {listing(unprobed, 2)}",
                      "the calibrated constant stands in for the memory outside torch on those GPUs; free them (see "
                      "gpu-processes), or run `python -m preflight.probe --gpus N` to see why the probe failed", **data)
    return result("gpu-memory", "pass", "; ".join(lines) + label, **data)


def check_gpu_processes(ctx: Context) -> CheckResult:
    gate = _gpu_gate(ctx, "gpu-processes")
    if gate:
        return gate
    me = ctx.host.get("pid")
    found, pids = [], []
    checked = 0
    for name, _role, gpu, _why in resolved_gpus(ctx):
        if gpu is None:
            continue
        checked += 1
        for proc in gpu.processes:
            if proc.pid == me:
                continue
            mib = f"{proc.used_bytes // MiB:,} MiB" if proc.used_bytes is not None else "? MiB"
            found.append({"gpu": name, "uuid": gpu.uuid, "pid": proc.pid, "name": proc.name,
                          "used_mib": proc.used_bytes // MiB if proc.used_bytes is not None else None})
            pids.append(proc.pid)
            found[-1]["text"] = f"GPU {name}: pid {proc.pid} {proc.name} ({mib})"
    if not checked:
        return result("gpu-processes", "skip", "no assigned GPU is visible (see gpu-visibility)")
    if found:
        hidden = any(f["name"] == "?" for f in found)
        fix = f"stop them (e.g. the inference server): kill {' '.join(str(p) for p in sorted(set(pids)))}"
        if hidden:
            fix += "; pids shown as '?' live in another container: stop them there"
        return result("gpu-processes", "fail",
                      f"{len(found)} other process(es) hold memory on assigned GPUs: {listing([f['text'] for f in found], 4)}",
                      fix, processes=[{k: v for k, v in f.items() if k != 'text'} for f in found])
    return result("gpu-processes", "pass", f"no other process holds memory on the {checked} assigned GPU(s)", processes=[])


def drafter_gpus(ctx: Context) -> list[Gpu]:
    """The GPUs training the drafter (the first visible one for a co-located run), [] without a GPU snapshot."""
    snap = ctx.gpus.snapshot
    if snap is None:
        return []
    if ctx.config is not None:
        found = [gpu for _name, role, gpu, _why in resolved_gpus(ctx) if gpu is not None and role != "target"]
        if found:
            return found
    visible, _ = visible_gpus(snap.gpus, ctx.gpus.cuda_visible_devices)
    return visible[:1]


def drafter_gpu(ctx: Context) -> Gpu | None:
    gpus = drafter_gpus(ctx)
    return gpus[0] if gpus else None


def target_gpus(ctx: Context) -> list[Gpu]:
    """The GPUs running the target (target or co-located role; the first visible one for a one-device run), [] on
    CPU or without a GPU snapshot."""
    snap = ctx.gpus.snapshot
    if snap is None or on_cpu(ctx):
        return []
    found = [gpu for _name, role, gpu, _why in resolved_gpus(ctx) if gpu is not None and role != "drafter"]
    if found:
        return found
    visible, _ = visible_gpus(snap.gpus, ctx.gpus.cuda_visible_devices)
    return visible[:1]


def capability(text: str) -> tuple[int, int] | None:
    """ "9.0" -> (9, 0); None when unknown or unreadable (older recorded snapshots say "0.0")."""
    try:
        major, minor = (int(x) for x in text.split(".")[:2])
    except (ValueError, AttributeError):
        return None
    return None if (major, minor) == (0, 0) else (major, minor)
