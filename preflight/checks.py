"""Preflight checks: pure functions ``check_<id>(ctx) -> CheckResult`` over gathered facts.

Each check exists because a real drafter run lost hours to exactly that failure (see
DESIGN.md). A check never does I/O: ``preflight.facts.gather`` collected everything first.
Findings name the measured value, the expected value, and the command that fixes it.
gpu-memory and disk ask the one memory model (``dflash.memory``), a pure function of the run
config and the target shape that ``gather`` read.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from packaging.markers import default_environment
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from dflash.compile_manifest import MANIFEST_NAME, differences
from dflash.config import ConfigError, default_target_layer_ids
from dflash.errors import DflashError
from dflash.memory import drafter_state_bytes, role_need_bytes
from preflight.estimate import DEFAULT_CUDA
from preflight.facts import MODEL_SOURCE_FILES, PROJECT_DIST, Context
from preflight.lockfile import is_gpu_stack, judge_lock
from preflight.nvml import NO_DRIVER, Gpu, resolve_gpu, visible_gpus
from preflight.report import CheckResult

CHECK_IDS = (
    "profile", "torch-build", "env-drift", "cuda-libs", "gpu-visibility", "gpu-memory", "gpu-processes",
    "compile-cache", "model-source", "run-dir", "dataset", "disk", "env-vars",
)
# Checks that judge a run, not the environment: without --config they are skipped (and say so).
NEEDS_CONFIG = ("gpu-memory", "gpu-processes", "run-dir", "dataset", "disk")
# Checks that judge the profile's environment: skipped when the profile manifest did not load.
NEEDS_PROFILE = ("torch-build", "env-drift", "cuda-libs", "compile-cache", "env-vars")
GiB = 1024**3
MiB = 1024**2
WARM_CACHE_FIX = "dflash-train --config {config} --warm-cache"


def _r(check_id: str, status: str, summary: str, fix: str | None = None, **data) -> CheckResult:
    return CheckResult(id=check_id, status=status, summary=summary, fix=fix if status != "pass" else None, data=data)


def _gib(n: int | float) -> str:
    return f"{n / GiB:.1f} GiB"


def _listing(items: list[str], limit: int = 4) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


def sync_fix(ctx: Context) -> str:
    groups = ctx.profile.groups if ctx.profile else [ctx.profile_name]
    return "uv sync --frozen --no-default-groups " + " ".join(f"--group {g}" for g in groups)


def _config_arg(ctx: Context) -> str:
    return ctx.config_path or "RUN.toml"


def _on_cpu(ctx: Context) -> bool:
    return ctx.config is not None and ctx.config.device == "cpu"


# ---------------------------------------------------------------- environment


def check_profile(ctx: Context) -> CheckResult:
    name = ctx.profile_name
    if ctx.profile is None:
        return _r("profile", "fail", ctx.profile_error or f"profile {name} did not load",
                  f"fix envs/{name}.toml (see envs/train-cu128.toml for the fields)")
    if ctx.lock_text is None:
        return _r("profile", "fail", f"{ctx.lock_file} is missing: profile {name} has no lock to verify against",
                  "uv run dflash-lock write", lock=ctx.lock_file)
    problems = [f"{p.kind}: {p.message}" for p in judge_lock(ctx.profile, ctx.lock_text, fresh=None)]
    if problems:
        return _r("profile", "fail", f"{ctx.lock_file} does not validate: {_listing(problems, 2)}",
                  "uv run dflash-lock write  (then review the diff)", problems=problems)
    if ctx.config is not None and ctx.config.profile != name:
        return _r("profile", "fail", f"the run config asks for profile {ctx.config.profile}; this check is for {name}",
                  f"dflash-preflight --profile {ctx.config.profile} --config {_config_arg(ctx)}")
    lock = ctx.lock
    return _r("profile", "pass",
              f"envs/{name}.toml and {ctx.lock_file} validate: {len(lock.pins)} pins, torch {ctx.profile.torch}, "
              f"CUDA {ctx.profile.cuda}", pins=len(lock.pins), torch=ctx.profile.torch, cuda=ctx.profile.cuda)


def check_torch_build(ctx: Context) -> CheckResult:
    p = ctx.profile
    want = f"profile {p.name} locks {p.torch} (CUDA {p.cuda})"
    fix = sync_fix(ctx)
    if ctx.torch is None:
        return _r("torch-build", "fail", f"torch is not installed; {want}", fix, expected=p.torch, expected_cuda=p.cuda)
    t = ctx.torch
    data = dict(installed=t.version, cuda=t.cuda, expected=p.torch, expected_cuda=p.cuda, source=t.source)
    have = f"torch {t.version} ({'CUDA ' + t.cuda if t.cuda else 'CPU-only build'}) installed"
    copies = ctx.distributions.get("torch", [])
    if len(copies) > 1:
        return _r("torch-build", "fail", f"torch is installed {len(copies)} times ({', '.join(copies)}); {want}",
                  fix, **data)
    if t.version.split("+")[0] != p.torch or t.cuda != p.cuda:
        return _r("torch-build", "fail", f"{have}; {want}", fix, **data)
    return _r("torch-build", "pass", f"{have}; {want}", **data)


def _same_version(locked: str, installed: str) -> bool:
    try:
        lv, iv = Version(locked), Version(installed)
    except InvalidVersion:
        return locked == installed
    if lv.local is None:  # `torch==2.10.0` accepts 2.10.0+cu128, as pip does
        return lv.public == iv.public
    return lv == iv


def check_env_drift(ctx: Context) -> CheckResult:
    lock = ctx.lock
    if lock is None:
        return _r("env-drift", "skip", f"no lock to compare against ({ctx.lock_file} missing; see profile)")
    here = default_environment()
    pins = {n: p for n, p in lock.pins.items() if getattr(p, "applies", lambda env: True)(here)}
    installed = {n: v for n, v in ctx.distributions.items() if n != canonicalize_name(PROJECT_DIST)}
    missing, changed, extra, twice = [], [], [], []
    for name, pin in sorted(pins.items()):
        if name == canonicalize_name(PROJECT_DIST):
            continue
        have = installed.get(name)
        if not have:
            missing.append({"name": name, "locked": pin.version})
        elif not any(_same_version(pin.version, v) for v in have):
            changed.append({"name": name, "installed": have[0], "locked": pin.version})
    for name, versions in sorted(installed.items()):
        if name not in pins:
            extra.append({"name": name, "installed": versions[0]})
        if len(versions) > 1:
            twice.append({"name": name, "installed": versions})
    items = ([(m["name"], f"{m['name']} {m['locked']} missing") for m in missing]
             + [(c["name"], f"{c['name']} {c['installed']} installed (lock {c['locked']})") for c in changed]
             + [(e["name"], f"{e['name']} {e['installed']} not in lock") for e in extra]
             + [(t["name"], f"{t['name']} installed twice ({', '.join(t['installed'])})") for t in twice])
    gpu = [text for name, text in items if is_gpu_stack(name)]
    other = [text for name, text in items if not is_gpu_stack(name)]
    data = dict(missing=missing, changed=changed, not_in_lock=extra, duplicates=twice, gpu_stack=gpu,
                checked=len(pins))
    if not items:
        return _r("env-drift", "pass", f"{len(pins)} locked distributions installed at their locked versions, "
                  f"nothing else installed", **data)
    parts = []
    if gpu:
        parts.append(f"{len(gpu)} GPU-stack drift{'s' if len(gpu) > 1 else ''}: {_listing(gpu)}")
    if other:
        parts.append(f"{len(other)} other: {_listing(other, 3)}")
    return _r("env-drift", "fail" if gpu else "warn", f"environment differs from {ctx.lock_file}: " + "; ".join(parts),
              sync_fix(ctx), **data)


def _version_tuple(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def check_cuda_libs(ctx: Context) -> CheckResult:
    from preflight.lockfile import wheel_cuda_major

    p = ctx.profile
    major = p.cuda_major
    allowed = {canonicalize_name(a) for a in getattr(p, "foreign_cuda_allowed", [])}
    problems, fixes = [], []
    wheels = {}
    for name, versions in sorted(ctx.distributions.items()):
        for v in versions:
            wm = wheel_cuda_major(name, v)
            if wm is None:
                continue
            wheels[name] = wm
            if wm != major and name not in allowed:
                problems.append(f"{name} {v} is a CUDA {wm} wheel")
    if problems:
        fixes.append(sync_fix(ctx))
    foreign_dirs = []
    for d in ctx.ld_dirs:
        bad = sorted(f"{lib} (CUDA {m})" for lib, m in d.libs.items() if m is not None and m != major)
        if bad:
            foreign_dirs.append(d.path)
            problems.append(f"LD_LIBRARY_PATH dir {d.path} holds {', '.join(bad)}")
    if foreign_dirs:
        keep = [d.path for d in ctx.ld_dirs if d.path not in foreign_dirs]
        fixes.append(f"export LD_LIBRARY_PATH={os.pathsep.join(keep)}" if keep else "unset LD_LIBRARY_PATH")
    snap = ctx.gpus.snapshot
    driver = {}
    if _on_cpu(ctx):
        driver_note = "driver not checked (device = cpu)"
    elif snap is None:
        driver_note = ""
        problems.append(ctx.gpus.error or NO_DRIVER)
        fixes.append(f"install NVIDIA driver >= {p.driver_min} (nvidia-smi must work), or set device = \"cpu\" in the run config")
    else:
        driver = dict(driver=snap.driver_version, cuda_driver=snap.cuda_driver_version)
        driver_note = f"driver {snap.driver_version} supports CUDA {snap.cuda_driver_version}"
        if _version_tuple(snap.cuda_driver_version) < _version_tuple(p.cuda):
            problems.append(f"driver {snap.driver_version} supports CUDA {snap.cuda_driver_version} < profile's {p.cuda}")
            fixes.append(f"upgrade the NVIDIA driver to >= {p.driver_min} (CUDA {p.cuda})")
        elif _version_tuple(snap.driver_version) < _version_tuple(p.driver_min):
            problems.append(f"driver {snap.driver_version} is older than the profile's minimum {p.driver_min}")
            fixes.append(f"upgrade the NVIDIA driver to >= {p.driver_min} (CUDA {p.cuda})")
    data = dict(cuda_major=major, wheels=wheels, ld_library_path=[d.path for d in ctx.ld_dirs],
                foreign_ld_dirs=foreign_dirs, **driver)
    if problems:
        return _r("cuda-libs", "fail", f"profile {p.name} is CUDA {p.cuda}: {_listing(problems, 3)}",
                  "; ".join(dict.fromkeys(fixes)), **data)
    ld = f"{len(ctx.ld_dirs)} LD_LIBRARY_PATH dirs clean" if ctx.ld_dirs else "LD_LIBRARY_PATH unset"
    return _r("cuda-libs", "pass",
              f"{len(wheels)} CUDA wheels are CUDA {major}; {ld}" + (f"; {driver_note}" if driver_note else ""), **data)


# ---------------------------------------------------------------- GPUs


def assigned_gpus(ctx: Context) -> dict[str, list[str]]:
    """GPU name in the run config -> its roles. Co-located runs use GPU "0" for both; a torchrun rank its own."""
    if ctx.own_gpus is not None:
        return ctx.own_gpus
    topo = ctx.config.topology
    if not topo.target_gpus and not topo.drafter_gpus:
        return {"0": ["target", "drafter"]}
    out: dict[str, list[str]] = {}
    for role, names in (("target", topo.target_gpus), ("drafter", topo.drafter_gpus)):
        for n in names:
            out.setdefault(n, []).append(role)
    return out


def _gpu_gate(ctx: Context, check_id: str) -> CheckResult | None:
    if _on_cpu(ctx):
        return _r(check_id, "skip", "device = cpu: no GPU needed")
    if ctx.gpus.snapshot is None:
        return _r(check_id, "fail", ctx.gpus.error or NO_DRIVER,
                  "install/load the NVIDIA driver (nvidia-smi must work), or set device = \"cpu\" in the run config")
    return None


def _resolved(ctx: Context) -> list[tuple[str, list[str], Gpu | None, str | None]]:
    snap = ctx.gpus.snapshot
    visible, _ = visible_gpus(snap.gpus, ctx.gpus.cuda_visible_devices)
    rows = []
    for name, roles in assigned_gpus(ctx).items():
        gpu, why = resolve_gpu(name, visible, snap.gpus)
        rows.append((name, roles, gpu, why))
    return rows


def _gpu_label(name: str, gpu: Gpu) -> str:
    return f"GPU {name}" + (f" ({gpu.uuid[:12]}…)" if not name.upper().startswith("GPU-") else "")


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
            return _r("gpu-visibility", "fail", f"NVML reachable but no GPU visible: {note or seen}", cvd_fix, **data)
        names = sorted({g.name for g in visible})
        summary = f"NVML reachable, {seen}: {', '.join(names)}"
        return _r("gpu-visibility", "warn" if note else "pass", summary + (f"; {note}" if note else ""), cvd_fix, **data)
    problems = []
    owners: dict[str, list[tuple[str, str]]] = {}
    rows = _resolved(ctx)
    for name, roles, gpu, why in rows:
        if gpu is None:
            problems.append(f"{'/'.join(roles)} {why}")
            continue
        for role in roles:
            owners.setdefault(gpu.uuid, []).append((name, role))
    for uuid, names in owners.items():
        roles = {r for _, r in names}
        if len(names) > 1 and not (len(names) == 2 and roles == {"target", "drafter"} and names[0][0] == names[1][0]):
            listed = ", ".join(f"{n} ({r})" for n, r in names)
            problems.append(f"{listed} are the same GPU {uuid}")
    data["assigned"] = [{"name": n, "roles": r, "uuid": g.uuid if g else None, "problem": w} for n, r, g, w in rows]
    if note:
        data["note"] = note
    if problems:
        fix = ("set topology.target_gpus / drafter_gpus to distinct visible GPUs "
               f"(0..{len(visible) - 1} after CUDA_VISIBLE_DEVICES, or UUIDs), or {cvd_fix}")
        return _r("gpu-visibility", "fail", f"{_listing(problems, 3)}; {seen}", fix, **data)
    return _r("gpu-visibility", "pass",
              f"all {len(rows)} assigned GPUs visible and each has one role; {seen}", **data)


MEMORY_MODEL = "memory model"  # the label gpu-memory's summary and data carry


def _no_shape(ctx: Context) -> str:
    """Why the target shape is missing: gather's reason, or a Context built without it."""
    return ctx.target_error or f"target shape of {ctx.config.target.path} was not gathered"


def _need(ctx: Context, roles: list[str]) -> tuple[int, str]:
    """Bytes one GPU with these roles needs (both roles: the co-located GPU), from the gathered target shape."""
    if ctx.target_shape is None:
        raise ConfigError(_no_shape(ctx))
    cuda = ctx.profile.cuda if ctx.profile else DEFAULT_CUDA
    role = "colocated" if len(roles) == 2 else roles[0]
    return role_need_bytes(ctx.config, role, cuda, shape=ctx.target_shape), MEMORY_MODEL


def check_gpu_memory(ctx: Context, need_fn: Callable[[Context, list[str]], tuple[int, str]] | None = None) -> CheckResult:
    gate = _gpu_gate(ctx, "gpu-memory")
    if gate:
        return gate
    need_fn = need_fn or _need
    rows, short, lines = [], [], []
    model = ""
    for name, roles, gpu, _why in _resolved(ctx):
        if gpu is None:
            continue
        try:
            need, model = need_fn(ctx, roles)
        except DflashError as e:
            return _r("gpu-memory", "fail", f"memory model failed: {e.one_line()}",
                      f"dflash-estimate --config {_config_arg(ctx)}")
        head = gpu.memory_free - need
        role = "+".join(roles)
        rows.append({"name": name, "uuid": gpu.uuid, "roles": roles, "need_bytes": need,
                     "free_bytes": gpu.memory_free, "headroom_bytes": head})
        lines.append(f"{role} GPU {name} need {_gib(need)} / free {_gib(gpu.memory_free)} ({'+' if head >= 0 else ''}{_gib(head)})")
        if head < 0:
            short.append(f"{role} GPU {name} ({gpu.uuid[:12]}…): need {_gib(need)}, free {_gib(gpu.memory_free)}, "
                         f"short {_gib(-head)}")
    if not rows:
        return _r("gpu-memory", "skip", "no assigned GPU is visible (see gpu-visibility)")
    label = f" [{model}]" if model else ""
    data = dict(gpus=rows, model=model)
    if short:
        return _r("gpu-memory", "fail", f"{_listing(short, 3)}{label}",
                  "free the GPUs (see gpu-processes), or lower data.token_budget / train.max_anchors in "
                  f"{_config_arg(ctx)} (`dflash-estimate --config {_config_arg(ctx)}` shows what fits)", **data)
    return _r("gpu-memory", "pass", "; ".join(lines) + label, **data)


def check_gpu_processes(ctx: Context) -> CheckResult:
    gate = _gpu_gate(ctx, "gpu-processes")
    if gate:
        return gate
    me = ctx.host.get("pid")
    found, pids = [], []
    checked = 0
    for name, _roles, gpu, _why in _resolved(ctx):
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
        return _r("gpu-processes", "skip", "no assigned GPU is visible (see gpu-visibility)")
    if found:
        hidden = any(f["name"] == "?" for f in found)
        fix = f"stop them (e.g. the inference server): kill {' '.join(str(p) for p in sorted(set(pids)))}"
        if hidden:
            fix += "; pids shown as '?' live in another container: stop them there"
        return _r("gpu-processes", "fail",
                  f"{len(found)} other process(es) hold memory on assigned GPUs: {_listing([f['text'] for f in found], 4)}",
                  fix, processes=[{k: v for k, v in f.items() if k != 'text'} for f in found])
    return _r("gpu-processes", "pass", f"no other process holds memory on the {checked} assigned GPU(s)", processes=[])


# ---------------------------------------------------------------- compile cache, model source


def _cache_gpu(ctx: Context) -> Gpu | None:
    snap = ctx.gpus.snapshot
    if snap is None:
        return None
    if ctx.config is not None:
        rows = _resolved(ctx)
        for _name, roles, gpu, _why in rows:
            if gpu is not None and "drafter" in roles:
                return gpu
    visible, _ = visible_gpus(snap.gpus, ctx.gpus.cuda_visible_devices)
    return visible[0] if visible else None


def check_compile_cache(ctx: Context) -> CheckResult:
    if _on_cpu(ctx):
        return _r("compile-cache", "skip", "device = cpu: nothing is compiled")
    cc = ctx.compile_cache
    fix = WARM_CACHE_FIX.format(config=_config_arg(ctx))
    size = f" ({cc.size_bytes / 1e6:,.0f} MB)" if cc.size_bytes else ""
    data = dict(path=cc.path, exists=cc.exists, size_bytes=cc.size_bytes, manifest=cc.manifest)
    if cc.env_override:
        data["env_override"] = cc.env_override
    if not cc.exists:
        return _r("compile-cache", "warn", f"cold: {cc.path} does not exist; the first compile runs at launch "
                  "(three drafter threads compiling flex attention at once is a known race)", fix, **data)
    if cc.error or cc.manifest is None:
        why = cc.error or f"no {MANIFEST_NAME} (not written by dflash-train --warm-cache)"
        return _r("compile-cache", "warn", f"cold: {cc.path}{size}: {why}", fix, **data)
    now: dict[str, str | None] = {
        "torch": ctx.torch.version if ctx.torch else None,
        "triton": (ctx.distributions.get("triton") or [None])[0],
    }
    gpu = _cache_gpu(ctx)
    if gpu is not None:
        now["gpu_name"] = gpu.name
        now["compute_capability"] = gpu.compute_capability
    if ctx.config is not None:
        now["drafter_hash"] = ctx.config.drafter_hash()
    diffs = differences(cc.manifest, now)
    data["current"] = now
    not_compared = [k for k in ("gpu_name", "compute_capability", "drafter_hash") if k not in now]
    if diffs:
        return _r("compile-cache", "warn", f"stale: {cc.path}{size} was built for another setup ({_listing(diffs, 3)})",
                  fix, **data)
    if cc.env_override:
        return _r("compile-cache", "warn", f"TORCHINDUCTOR_CACHE_DIR={cc.env_override} points away from the "
                  f"profile's warm cache {cc.path}", "unset TORCHINDUCTOR_CACHE_DIR", **data)
    extra = f"; not compared: {', '.join(not_compared)}" if not_compared else ""
    return _r("compile-cache", "pass", f"warm: {cc.path}{size} matches torch {now['torch']}, triton {now['triton']}"
              + (f", {gpu.name} ({gpu.compute_capability})" if gpu else "") + extra, **data)


def check_model_source(ctx: Context) -> CheckResult:
    ms = ctx.model_source
    data = dict(mode=ms.mode, commit=ms.commit, files=list(MODEL_SOURCE_FILES), modified=ms.states,
                verified=ms.verified, absent=ms.absent, diff_stat=ms.diff_stat)
    if ms.error:
        return _r("model-source", "warn", f"cannot verify the drafter source: {ms.error}", None, **data)
    where = f"git HEAD {ms.commit[:12]}" if ms.mode == "git" and ms.commit else (ms.commit or "?")
    if ms.modified:
        files = ", ".join(f"{m} ({ms.states.get(m, 'modified')})" for m in ms.modified)
        last = [line.strip() for line in ms.diff_stat.splitlines() if "changed" in line]
        stat = f"; git diff --stat: {last[-1]}" if last else ""
        if ms.mode == "git":
            fix = f"git stash push --include-untracked -- {' '.join(ms.modified)}  (review first: git diff -- {' '.join(ms.modified)})"
        else:
            fix = f"uv sync --frozen --reinstall-package {PROJECT_DIST}"
        return _r("model-source", "fail", f"drafter source modified against {where}: {files}{stat}",
                  fix, **data)
    if not ms.verified:
        return _r("model-source", "warn", f"none of {', '.join(MODEL_SOURCE_FILES)} could be verified against {where}",
                  None, **data)
    absent = f" ({', '.join(ms.absent)} not present)" if ms.absent else ""
    return _r("model-source", "pass", f"{len(ms.verified)} drafter source files match {where}{absent}", **data)


# ---------------------------------------------------------------- run


def _default_layer_ids(ctx: Context, n: int) -> list[int] | None:
    """The target layers an empty drafter.target_layer_ids resolves to, or None when unknown."""
    if ctx.config is None or ctx.target_shape is None:
        return None
    return default_target_layer_ids(ctx.target_shape.num_layers, n)


def _incompatible(ctx: Context, saved: dict) -> list[str]:
    cfg = ctx.config
    now = cfg.model_dump()
    out = []
    for section, key in (("drafter", "block_size"), ("drafter", "num_layers"), ("target", "path")):
        old = (saved.get(section) or {}).get(key)
        if old != now[section][key]:
            out.append(f"{section}.{key} {old!r} -> {now[section][key]!r}")
    old_ids = (saved.get("drafter") or {}).get("target_layer_ids")
    new_ids = cfg.drafter.target_layer_ids
    if old_ids != new_ids:
        n = cfg.drafter.num_layers
        resolved_old = old_ids or _default_layer_ids(ctx, n)
        resolved_new = new_ids or _default_layer_ids(ctx, n)
        if resolved_old is not None and resolved_new is not None and resolved_old != resolved_new:
            out.append(f"drafter.target_layer_ids {old_ids!r} -> {new_ids!r}")
    return out


# What fixes the cosine lr schedule of a run: changed on a resume, the schedule changes (dflash.rundir.schedule_change).
SCHEDULE_FIELDS = (("train", "max_steps"), ("train", "epochs"), ("train", "grad_accum"), ("train", "lr"),
                   ("train", "warmup_ratio"), ("data", "token_budget"), ("data", "max_batch_size"),
                   ("data", "num_buckets"))


def _schedule_changes(ctx: Context, saved: dict) -> list[str]:
    now = ctx.config.model_dump()
    out = []
    for section, key in SCHEDULE_FIELDS:
        old = (saved.get(section) or {}).get(key)
        if old != now[section][key]:
            out.append(f"{section}.{key} {old!r} -> {now[section][key]!r}")
    return out


def check_run_dir(ctx: Context) -> CheckResult:
    rd = ctx.run_dir
    intent = ctx.resume_intent
    how = "sizes and sha256" if rd.deep else "sizes"
    data = dict(path=rd.path, exists=rd.exists, writable=rd.writable, intent=intent,
                checkpoints=[c.step for c in rd.checkpoints], verified_by=how)
    if not rd.writable:
        return _r("run-dir", "fail", f"output dir {rd.path} cannot be written: {rd.problem}",
                  f"set output_dir in {_config_arg(ctx)} to a writable folder with free space", **data)
    newest = rd.newest
    if newest is None:
        if intent == "resume":
            return _r("run-dir", "fail", f"--resume given but {rd.path} holds no finished checkpoint",
                      "drop --resume (a fresh run starts at step 0)", **data)
        return _r("run-dir", "pass", f"{rd.path} is writable and holds no checkpoint: a fresh run", **data)
    name = os.path.basename(newest.path)
    data["newest"] = {"step": newest.step, "path": newest.path}
    if intent is None:
        return _r("run-dir", "fail",
                  f"{rd.path} holds {len(rd.checkpoints)} checkpoint(s), newest {name} (step {newest.step}); "
                  "say whether to resume it or start over", "add --resume to continue it, or --fresh to start over "
                  "(--fresh moves the old checkpoints aside)", **data)
    if intent == "fresh":
        return _r("run-dir", "pass", f"--fresh: {len(rd.checkpoints)} existing checkpoint(s) (newest {name}, "
                  f"step {newest.step}) will be moved aside, not resumed", **data)
    # --resume latest takes the newest checkpoint that verifies (dflash.rundir.resolve_resume)
    usable = [c for c in rd.checkpoints if c.meta is not None and not c.error]
    chosen = usable[-1] if usable else None
    skipped = [c for c in rd.checkpoints if chosen is None or c.step > chosen.step]
    data["skipped"] = [{"step": c.step, "problem": c.error or "meta.json unreadable"} for c in skipped]
    said = "; ".join(f"{os.path.basename(c.path)}: {c.error or 'meta.json unreadable'}" for c in skipped)
    if chosen is None:
        only = skipped[0]
        what = f"newest checkpoint {name} cannot be resumed: {only.error or 'meta.json unreadable'}" \
            if len(skipped) == 1 else f"none of the {len(skipped)} checkpoints verifies ({how}): {said}"
        return _r("run-dir", "fail", f"--resume: {what}", "use --fresh, or give --resume an earlier checkpoint "
                  "folder (moved aside ones are under checkpoints.abandoned-*)", **data)
    cname = os.path.basename(chosen.path)
    data["resume"] = {"step": chosen.step, "path": chosen.path}
    bad = _incompatible(ctx, chosen.meta.get("config") or {})
    if bad:
        return _r("run-dir", "fail", f"--resume: {cname} (step {chosen.step}) is incompatible with this config: "
                  f"{', '.join(bad)}", f"use --fresh, or restore those settings in {_config_arg(ctx)}", **data)
    notes, fixes = [], []
    if skipped:
        notes.append(f"--resume latest skips {said}")
        fixes.append("move the damaged checkpoint(s) aside, or pass --fresh")
    schedule = _schedule_changes(ctx, chosen.meta.get("config") or {})
    if schedule:
        data["schedule_changes"] = schedule
        notes.append(f"the lr schedule changes ({', '.join(schedule)}): dflash-train refuses this resume without "
                     "--allow-schedule-change")
        fixes.append(f"restore those settings in {_config_arg(ctx)}, or pass --allow-schedule-change")
    old = chosen.meta.get("dataset") or {}
    ds = ctx.dataset
    changes = []
    if ds is not None and ds.error is None and not any(s.error for s in ds.shards):
        data["dataset"] = {"old_samples": old.get("samples"), "new_samples": ds.samples,
                           "old_path": old.get("path"), "new_path": ds.path}
        if old.get("samples") != ds.samples:
            was = f"{old['samples']:,}" if isinstance(old.get("samples"), int) else "?"
            changes.append(f"{was} -> {ds.samples:,} samples")
        elif old.get("fingerprint") and old.get("fingerprint") != ds.fingerprint:
            changes.append(f"same {ds.samples:,} samples but other shards (fingerprint {old['fingerprint']} -> {ds.fingerprint})")
        if old.get("path") and old.get("path") != ds.path:
            changes.append(f"path {old['path']} -> {ds.path}")
    if changes:
        notes.append(f"dataset changed since: {'; '.join(changes)} (the epoch restarts from its first batch)")
        fixes.append("use --fresh if the new data should start a new run")
    if notes:
        return _r("run-dir", "warn", f"--resume from {cname} (step {chosen.step}); " + "; ".join(notes),
                  "; ".join(fixes), **data)
    return _r("run-dir", "pass", f"--resume from {cname} (step {chosen.step}, {how} verified): config and lr "
              "schedule unchanged, dataset unchanged", **data)


def check_dataset(ctx: Context) -> CheckResult:
    ds = ctx.dataset
    cfg = ctx.config
    data = dict(path=ds.path, limit=ds.limit, shards=len(ds.shards))
    if ds.error:
        return _r("dataset", "fail", f"data.path {ds.error}",
                  f"set data.path in {_config_arg(ctx)} to a folder of *.arrow shards (dflash-data writes them)", **data)
    broken = [s for s in ds.shards if s.error]
    if broken:
        return _r("dataset", "fail", f"{len(broken)} shard(s) unreadable: " +
                  _listing([f"{s.name}: {s.error}" for s in broken], 2),
                  f"regenerate or remove {', '.join(s.name for s in broken[:4])} in {ds.path}",
                  broken=[s.name for s in broken], **data)
    samples = ds.samples
    tokens = sum(s.tokens for s in ds.shards)
    longest = max(ds.shards, key=lambda s: s.max_len)
    data.update(samples=samples, tokens=tokens, longest={"shard": longest.name, "row": longest.max_row,
                                                         "index": longest.first_row + longest.max_row,
                                                         "length": longest.max_len},
                fingerprint=ds.fingerprint)
    if samples == 0:
        return _r("dataset", "fail", f"{ds.path} holds no samples", "write shards with dflash-data", **data)
    mism = [s for s in ds.shards if s.mask_mismatch]
    if mism:
        s = mism[0]
        row, a, b = s.mask_mismatch
        return _r("dataset", "fail", f"{s.name} row {row}: input_ids has {a} tokens but loss_mask {b}",
                  f"regenerate {s.name}", **data)
    over = [s for s in ds.shards if s.over_count]
    limit_name = "token_budget" if cfg.data.max_length is None or cfg.data.token_budget <= cfg.data.max_length \
        else "data.max_length"
    if over:
        count = sum(s.over_count for s in over)
        worst = max(((s, row, n) for s in over for row, n in s.over), key=lambda t: t[2])
        s, row, n = worst
        data["over_limit"] = [{"shard": s.name, "row": r, "index": s.first_row + r, "length": n}
                              for s in over for r, n in s.over]
        return _r("dataset", "fail",
                  f"{count:,} sample(s) can never fit a batch: longest is {s.name} row {row} (sample {s.first_row + row:,}) "
                  f"with {n:,} tokens > {limit_name} {ds.limit:,}",
                  f"raise data.token_budget to >= {n} in {_config_arg(ctx)}, or drop samples longer than "
                  f"{ds.limit} tokens from the shards", **data)
    fails, warns, said = _dataset_contents(ctx, data)
    if fails:
        return _r("dataset", "fail", "; ".join(text for text, _ in fails),
                  "; ".join(dict.fromkeys(fix for _, fix in fails)), **data)
    fits = f"longest {longest.max_len:,} tokens ({longest.name} row {longest.max_row}) fits {limit_name} {ds.limit:,}"
    head = f"{len(ds.shards)} shard(s), {samples:,} samples, {tokens:,} tokens; {said}; {fits}"
    if warns:
        return _r("dataset", "warn", f"{head}; " + "; ".join(text for text, _ in warns),
                  "; ".join(dict.fromkeys(fix for _, fix in warns if fix)) or None, **data)
    return _r("dataset", "pass", head, **data)


def _dataset_contents(ctx: Context, data: dict) -> tuple[list[tuple[str, str]], list[tuple[str, str | None]], str]:
    """(failures, warnings, what was verified) about what the shards hold: the manifest's shard records and
    target fingerprint, token ids against the run's vocabulary, loss_mask values, something to learn."""
    from dflash.data import compare_targets  # the dataset identity's owner (numpy + pyarrow: only with a dataset)

    ds, cfg = ctx.dataset, ctx.config
    fails: list[tuple[str, str]] = []
    warns: list[tuple[str, str | None]] = []
    rebuild = (f"rebuild the data for this target (dflash-data prepare --target {cfg.target.path} ...), or set "
               f"target.path in {_config_arg(ctx)} to the target it was built for")
    stamp = f"dflash-data manifest {ds.path} --target {cfg.target.path}"
    said = []
    target_ok = False  # the manifest says the data was built for this very target

    # the manifest: which shards were written, their sizes and (deep) sha256, and the target they were built for
    manifest = ds.manifest
    data["manifest"] = "unreadable" if ds.manifest_error else "absent" if manifest is None else "present"
    if ds.manifest_error:
        fails.append((f"{ds.manifest_error} in {ds.path}", f"restore {os.path.join(ds.path, 'manifest.json')}, or "
                      f"rewrite it with {stamp}"))
    elif manifest is None:
        warns.append(("no manifest.json: the target the data was built for and the shard hashes are unknown (ids "
                      "checked against the run's vocabulary only)", stamp))
    if manifest is not None:
        records = manifest.get("shards") if isinstance(manifest.get("shards"), dict) else {}
        recorded = {n: r for n, r in records.items() if isinstance(r, dict) and "bytes" in r}
        on_disk = {s.name: s for s in ds.shards}
        problems = []
        if recorded:
            problems += [f"{n} not in manifest.json" for n in on_disk if n not in recorded]
            problems += [f"{n} in manifest.json but missing" for n in recorded if n not in on_disk]
            problems += [f"{n} is {s.size_bytes:,} bytes, manifest.json recorded {recorded[n]['bytes']:,}"
                         for n, s in on_disk.items() if n in recorded and s.size_bytes != recorded[n]["bytes"]]
            if ds.deep:
                unhashed = [n for n in on_disk if n in recorded and not recorded[n].get("sha256")]
                problems += [f"{n} content differs from its sha256 in manifest.json" for n, s in on_disk.items()
                             if n in recorded and recorded[n].get("sha256") and s.sha256 != recorded[n]["sha256"]]
                if unhashed:
                    warns.append((f"no sha256 recorded for {_listing(unhashed, 3)}", stamp))
            said.append(f"shard {'sizes and sha256' if ds.deep else 'sizes'} match manifest.json")
        else:
            warns.append(("manifest.json records no shard sizes or hashes (written by an older version)", stamp))
        if problems:
            data["manifest_problems"] = problems
            fails.append((f"shards differ from what was written: {_listing(problems, 3)}",
                          "regenerate or restore those shards (move a damaged one aside and rerun dflash-data prepare: "
                          f"it redoes missing shards), or if the change was intended: {stamp}"))
        recorded_target = manifest.get("target")
        data["target"] = {"recorded": recorded_target, "run": ds.target}
        if not isinstance(recorded_target, dict):
            warns.append(("manifest.json does not say which target the data was built for", stamp))
        elif ds.target is None:
            warns.append((f"target fingerprint not compared: {ds.target_error}", f"check target.path in "
                          f"{_config_arg(ctx)}"))
        else:
            bad, notes = compare_targets(recorded_target, ds.target)
            if bad:
                fails.append((f"built for another target than {cfg.target.path}: {', '.join(bad)}", rebuild))
            else:
                target_ok = True
                same_tok = recorded_target.get("tokenizer_sha256") and ds.target.get("tokenizer_sha256")
                said.append(f"built for this target (vocab {ds.target['vocab_size']:,}"
                            + (", same tokenizer files)" if same_tok else "; tokenizer files not compared: none on "
                               f"{'the target' if recorded_target.get('tokenizer_sha256') else 'record'})"))
            warns += [(n, None) for n in notes]

    # the values the trainer indexes with
    vocab = ctx.target_shape.vocab if ctx.target_shape else None
    read = [s for s in ds.shards if s.values is not None and s.values.max_id is not None]
    ids_lo = min((s.values.min_id for s in read), default=None)
    ids_hi = max((s.values.max_id for s in read), default=None)
    anchors = sum(s.values.anchors for s in ds.shards if s.values is not None)
    mask_lo = min((s.values.mask_min for s in read), default=None)
    mask_hi = max((s.values.mask_max for s in read), default=None)
    data["values"] = {"min_id": ids_lo, "max_id": ids_hi, "vocab": vocab, "mask_min": mask_lo, "mask_max": mask_hi,
                      "learnable_positions": anchors}
    if vocab is None:
        warns.append((f"token ids not checked against the vocabulary: {_no_shape(ctx)}",
                      f"check target.path in {_config_arg(ctx)}"))
    over = [s for s in read if vocab is not None and s.values.max_id >= vocab]
    negative = [s for s in read if s.values.min_id < 0]
    damaged = (f"regenerate or restore {_listing(list(dict.fromkeys(s.name for s in over + negative)))} (damaged: "
               f"dflash-preflight --verify-data compares each shard with its recorded sha256)")
    if over:
        worst = max(over, key=lambda s: s.values.max_id)
        fails.append((f"token ids up to {worst.values.max_id:,} ({worst.name}) but the target's vocabulary is "
                      f"{vocab:,} (ids must be < {vocab:,}; {len(over)} shard(s): {_listing([s.name for s in over], 3)})",
                      damaged if target_ok else rebuild))
    if negative:
        fails.append((f"negative token ids (down to {min(s.values.min_id for s in negative):,}) in "
                      f"{_listing([s.name for s in negative], 3)}", damaged))
    odd_mask = [s for s in read if s.values.mask_min < 0 or s.values.mask_max > 1]
    if odd_mask:
        fails.append((f"loss_mask values outside 0/1 (from {mask_lo} to {mask_hi}) in "
                      f"{_listing([s.name for s in odd_mask], 3)}",
                      "rewrite those shards with loss_mask 0 (context) or 1 (to learn); dflash.data.write_shard "
                      "refuses other values"))
    if anchors == 0 and not odd_mask:
        why = "loss_mask is 0 everywhere" if mask_hi == 0 else \
            "no sample has two consecutive loss_mask = 1 tokens (e.g. only 1-token samples)"
        fails.append((f"nothing to learn: {why}; a block starts at a position whose token and next token both "
                      "have loss_mask 1",
                      "mark the tokens to learn with loss_mask 1 (dflash-data prepare marks each completion) and keep "
                      "samples of 2 or more tokens"))
    if vocab is not None and ids_hi is not None and not over and not negative:
        said.append(f"ids {ids_lo:,}..{ids_hi:,} < vocab {vocab:,}")
    if not odd_mask and anchors:
        said.append(f"loss_mask 0/1 with {anchors:,} learnable positions")
    data["verified_by"] = "sizes and sha256" if ds.deep else "sizes"
    return fails, warns, "; ".join(said)


def checkpoint_bytes(ctx: Context) -> tuple[int | None, str]:
    """Bytes of one checkpoint: the newest one on disk, else the drafter's training state from the memory model."""
    newest = ctx.run_dir.newest if ctx.run_dir else None
    if newest is not None and newest.size_bytes:
        return newest.size_bytes, f"size of {os.path.basename(newest.path)}"
    if ctx.target_shape is None:
        return None, _no_shape(ctx)
    return drafter_state_bytes(ctx.config, ctx.target_shape), "estimate: drafter params x 12 B (fp32 weights, AdamW m and v)"


def _size(n: int | float) -> str:
    """GiB, or MiB below one GiB (a tiny run's checkpoints and a full disk both read as 0.0 GiB otherwise)."""
    return _gib(n) if n >= GiB else f"{n / MiB:.1f} MiB"


def check_disk(ctx: Context) -> CheckResult:
    dk = ctx.disk
    cfg = ctx.config
    if dk.error or dk.free_bytes is None:
        return _r("disk", "fail", f"cannot measure free space at {dk.path}: {dk.error}",
                  f"set output_dir in {_config_arg(ctx)} to an existing, readable filesystem", path=dk.path)
    one, how = checkpoint_bytes(ctx)
    data = dict(path=dk.path, free_bytes=dk.free_bytes, checkpoint_bytes=one, basis=how, keep_last=cfg.train.keep_last)
    if one is None:
        return _r("disk", "warn", f"{_size(dk.free_bytes)} free at {dk.path}; checkpoint size unknown ({how})",
                  f"check target.path in {_config_arg(ctx)}", **data)
    existing = len(ctx.run_dir.checkpoints) if ctx.run_dir and ctx.resume_intent == "resume" else 0
    count = max(1, cfg.train.keep_last + 1 - existing)  # keep_last kept + one being written
    need = count * one
    data.update(need_bytes=need, checkpoints_to_write=count)
    summary = (f"{_size(dk.free_bytes)} free at {dk.path}; {count} more checkpoint(s) of {_size(one)} "
               f"({how}) need {_size(need)}")
    if dk.free_bytes < need:
        return _r("disk", "fail", summary, f"free {_size(need - dk.free_bytes)} at {dk.path}, lower train.keep_last, "
                  f"or move output_dir to a larger disk", **data)
    return _r("disk", "pass", summary, **data)


def check_env_vars(ctx: Context) -> CheckResult:
    p = ctx.profile
    wrong = []
    for key, want in sorted(p.env.items()):
        have = ctx.env.get(key)
        if have != want:
            wrong.append((key, want, have))
    fail_fix = " ".join(f"{k}={w}" for k, w, _ in wrong)
    missing_dirs = [e.path for e in ctx.path_entries if not e.exists]
    shadow = []
    for e in ctx.path_entries:
        if e.is_self:
            break
        if e.python_env:
            shadow.append(e.path)
    data = dict(required=dict(p.env), wrong=[{"name": k, "expected": w, "actual": h} for k, w, h in wrong],
                path_missing=missing_dirs, path_other_envs=shadow,
                self_on_path=any(e.is_self for e in ctx.path_entries))
    if wrong:
        said = ", ".join(f"{k}={h!r} (need {w!r})" if h is not None else f"{k} unset (need {w!r})" for k, w, h in wrong)
        return _r("env-vars", "fail", f"profile {p.name} requires {said}", f"export {fail_fix}", **data)
    notes = []
    if shadow:
        where = "ahead of this one" if data["self_on_path"] else "and not this one's"
        notes.append(f"PATH has bin dirs of other Python environments {where}: {_listing(shadow, 3)}")
    if missing_dirs:
        notes.append(f"PATH entries that do not exist: {_listing(missing_dirs, 3)}")
    if notes:
        keep = [e.path for e in ctx.path_entries if e.exists and e.path not in shadow]
        return _r("env-vars", "warn", "; ".join(notes), f"export PATH={os.pathsep.join(keep)}", **data)
    req = f"{len(p.env)} required variable(s) set" if p.env else "no variables required"
    return _r("env-vars", "pass", f"{req}; PATH clean ({len(ctx.path_entries)} entries)", **data)


CHECKS: dict[str, Callable[[Context], CheckResult]] = {
    "profile": check_profile,
    "torch-build": check_torch_build,
    "env-drift": check_env_drift,
    "cuda-libs": check_cuda_libs,
    "gpu-visibility": check_gpu_visibility,
    "gpu-memory": check_gpu_memory,
    "gpu-processes": check_gpu_processes,
    "compile-cache": check_compile_cache,
    "model-source": check_model_source,
    "run-dir": check_run_dir,
    "dataset": check_dataset,
    "disk": check_disk,
    "env-vars": check_env_vars,
}
assert tuple(CHECKS) == CHECK_IDS


def run_checks(ctx: Context) -> list[CheckResult]:
    """Every check in CHECK_IDS order; run-dependent ones skip without a config, profile-dependent without a profile."""
    out = []
    for check_id, fn in CHECKS.items():
        if check_id in NEEDS_CONFIG and ctx.config is None:
            out.append(_r(check_id, "skip", "run-dependent: needs --config RUN.toml"))
        elif check_id in NEEDS_PROFILE and ctx.profile is None:
            out.append(_r(check_id, "skip", f"profile {ctx.profile_name} did not load (see profile)"))
        else:
            try:
                out.append(fn(ctx))
            except Exception as e:  # a bug in one check must not hide the others' findings
                out.append(_r(check_id, "fail", f"check crashed: {type(e).__name__}: {e}",
                              "report this as a dflash bug (preflight check crashed)"))
    return out
