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

from dflash.config import FP8_MIN_CAPABILITY, ConfigError, default_target_layer_ids
from dflash.errors import DflashError
from dflash.memory.parts import choose_recompute, role_need_bytes
from dflash.memory.shape import drafter_shape, drafter_state_bytes
from dflash.runs.compile_manifest import MANIFEST_NAME, differences
from dflash.runs.rundir import describe_leftovers
from preflight.envs import run_command, sync_command
from preflight.estimate import DEFAULT_CUDA
from preflight.facts import MODEL_SOURCE_PACKAGE, PROJECT_DIST, Context
from preflight.lockfile import is_gpu_stack, judge_lock
from preflight.nvml import NO_DRIVER, Gpu, resolve_gpu, visible_gpus
from preflight.report import CheckResult

CHECK_IDS = (
    "profile", "torch-build", "env-drift", "cuda-libs", "gpu-visibility", "gpu-memory", "gpu-processes",
    "compile-cache", "model-source", "config", "run-dir", "dataset", "disk", "env-vars",
)
# Checks that judge a run, not the environment: without --config they are skipped (and say so).
NEEDS_CONFIG = ("gpu-memory", "gpu-processes", "config", "run-dir", "dataset", "disk")
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


def _in_profile(ctx: Context, command: str) -> str:
    """`command` run in the profile's environment, as typed on any clone: `uv run` builds and uses uv's default
    environment (.venv); any other profile's environment is built from its lock first, then run in."""
    name = ctx.profile_name
    if ctx.env_identity is None or ctx.env_identity.default:
        return f"uv run {command}"
    return f"{sync_command(name)} && {run_command(name, command)}"


def _preflight_command(ctx: Context) -> str:
    return f"dflash-preflight --profile {ctx.profile_name}" + (f" --config {ctx.config_path}" if ctx.config_path else "")


def _wrong_env(ctx: Context) -> bool:
    return ctx.env_identity is not None and not ctx.env_identity.matches


def sync_fix(ctx: Context, reinstall: list[str] | tuple[str, ...] = ()) -> str:
    """Rebuild the profile's environment from its committed lock (works on a fresh clone: no uv.lock needed).
    When this interpreter is not that environment, the fix is to check the profile's own environment instead
    (building it first when it is not uv's default one)."""
    if _wrong_env(ctx):
        return _in_profile(ctx, _preflight_command(ctx))
    return sync_command(ctx.profile_name, reinstall)


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
        other = ctx.config.profile
        check = f"dflash-preflight --profile {other} --config {_config_arg(ctx)}"
        return _r("profile", "fail", f"the run config asks for profile {other}; this check is for {name}",
                  f"{sync_command(other)} && {run_command(other, check)}")
    lock = ctx.lock
    summary = (f"envs/{name}.toml and {ctx.lock_file} validate: {len(lock.pins)} pins, torch {ctx.profile.torch}, "
               f"CUDA {ctx.profile.cuda}")
    data = dict(pins=len(lock.pins), torch=ctx.profile.torch, cuda=ctx.profile.cuda)
    ident = ctx.env_identity
    if ident is not None:
        data.update(environment=ident.prefix, profile_environment=ident.profile_env)
    if _wrong_env(ctx):
        return _r("profile", "warn", f"{summary}; but this interpreter runs in {ident.prefix}, not in profile {name}'s "
                  f"environment {ident.profile_env}: the environment checks below judge {ident.prefix}",
                  _in_profile(ctx, _preflight_command(ctx)), **data)
    return _r("profile", "pass", summary + (f"; running in its environment {ident.profile_env}" if ident else ""), **data)


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
    edited, unverified, record_note = _record_findings(ctx, data)
    if not items and not edited and not unverified:
        return _r("env-drift", "pass", f"{len(pins)} locked distributions installed at their locked versions, "
                  f"nothing else installed{record_note}", **data)
    parts = []
    if edited:
        parts.append(f"files edited in place: {_listing(edited, 2)}")
    if gpu:
        parts.append(f"{len(gpu)} GPU-stack drift{'s' if len(gpu) > 1 else ''}: {_listing(gpu)}")
    if other:
        parts.append(f"{len(other)} other: {_listing(other, 3)}")
    if unverified:
        parts.append(f"not verifiable against a RECORD: {_listing(unverified, 2)}")
    reinstall = [r["name"] for r in data["record"]["modified"]] if edited else []
    return _r("env-drift", "fail" if gpu or edited else "warn",
              f"environment differs from {ctx.lock_file}: " + "; ".join(parts), sync_fix(ctx, reinstall), **data)


def _record_findings(ctx: Context, data: dict) -> tuple[list[str], list[str], str]:
    """RECORD verification of the GPU stack and the target's code: (edited, unverifiable, note for a pass).

    A file that differs from the hash its distribution's RECORD lists was edited after install (a line appended
    to transformers' Qwen3 modeling file passes a version comparison): always a failure."""
    rec = ctx.records
    if rec is None:
        return [], [], ""
    edited, unverified = [], []
    modified, missing_record = [], []
    for c in rec.checks:
        bad = c.modified + c.missing
        if bad:
            what = ", ".join([*(f"{f} differs" for f in c.modified[:2]), *(f"{f} missing" for f in c.missing[:2])][:2])
            more = f" (+{len(bad) - 2} more)" if len(bad) > 2 else ""
            edited.append(f"{c.name} {c.version}: {what}{more}")
            modified.append({"name": c.name, "version": c.version, "modified": c.modified[:20],
                             "missing": c.missing[:20], "count": len(bad)})
        elif c.error and c.error != "not installed":
            unverified.append(f"{c.name} ({c.error})")
            missing_record.append({"name": c.name, "why": c.error})
    hashed, sized = sum(c.hashed for c in rec.checks), sum(c.sized for c in rec.checks)
    data["record"] = dict(distributions=len(rec.checks), hashed=hashed, sized=sized, seconds=round(rec.seconds, 3),
                          modified=modified, unverified=missing_record)
    note = (f"; {len(rec.checks)} GPU-stack and target distributions match their RECORD ({hashed:,} files hashed, "
            f"{sized} native libraries by size, {rec.seconds:.1f} s)")
    return edited, unverified, note


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
    warnings, warn_fixes = _foreign_cuda_toolkits(ctx, data)
    if problems:
        return _r("cuda-libs", "fail", f"profile {p.name} is CUDA {p.cuda}: {_listing(problems + warnings, 3)}",
                  "; ".join(dict.fromkeys(fixes + warn_fixes)), **data)
    if warnings:
        return _r("cuda-libs", "warn", f"profile {p.name} is CUDA {p.cuda}: {'; '.join(warnings)}",
                  "; ".join(warn_fixes), **data)
    ld = f"{len(ctx.ld_dirs)} LD_LIBRARY_PATH dirs clean" if ctx.ld_dirs else "LD_LIBRARY_PATH unset"
    return _r("cuda-libs", "pass",
              f"{len(wheels)} CUDA wheels are CUDA {major}; {ld}" + (f"; {driver_note}" if driver_note else ""), **data)


def _cuda_major(version: str) -> int | None:
    head = version.split(".")[0]
    return int(head) if head.isdigit() else None


def _foreign_cuda_toolkits(ctx: Context, data: dict) -> tuple[list[str], list[str]]:
    """Warnings (and fixes) for CUDA of another major outside the wheels: an nvcc on PATH, libraries in the linker
    cache. torch loads its own CUDA libraries by RPATH, so neither breaks torch itself; each can break what is
    built or loaded at run time, and each finding says what."""
    major = ctx.profile.cuda_major
    warnings, fixes = [], []
    toolkits = [e for e in ctx.path_entries if e.cuda_toolkit]
    data["path_cuda_toolkits"] = [{"path": e.path, "cuda": e.cuda_toolkit} for e in toolkits]
    for i, e in enumerate(toolkits):
        tk = _cuda_major(e.cuda_toolkit)
        if tk is None or tk == major:
            continue
        which = "the nvcc that runs" if i == 0 else "an nvcc later on PATH"
        warnings.append(f"PATH dir {e.path} holds {which}, CUDA {e.cuda_toolkit}: CUDA code compiled at run time "
                        f"(torch.utils.cpp_extension, flashinfer/DeepGEMM JIT, anything calling nvcc or ptxas by name) "
                        f"would target CUDA {tk}, not this profile's {ctx.profile.cuda}")
        fixes.append(f"put a CUDA {ctx.profile.cuda} toolkit's bin before {e.path} on PATH and export CUDA_HOME to it, "
                     f"or drop {e.path} from PATH")
    cache = ctx.ld_cache or []
    foreign = [(d, sorted(lib for lib, m in d.libs.items() if m is not None and m != major)) for d in cache]
    foreign = [(d, libs) for d, libs in foreign if libs]
    data["ld_cache_foreign"] = [{"dir": d.path, "libs": libs} for d, libs in foreign]
    for d, libs in foreign:
        majors = sorted({d.libs[lib] for lib in libs})
        warnings.append(f"the linker cache (ldconfig -p) lists {', '.join(libs)} (CUDA {'/'.join(map(str, majors))}) "
                        f"in {d.path}: a library loaded by name without an RPATH (ctypes, a JIT-built extension, "
                        f"NCCL plugins) can load it instead of the CUDA {major} wheels torch uses")
        fixes.append(f"remove {d.path} from /etc/ld.so.conf.d/ and run `sudo ldconfig` (only code that loads CUDA "
                     "libraries by name is affected)")
    return warnings, fixes


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


def _need(ctx: Context, roles: list[str], free: int | None = None) -> tuple[int, str]:
    """Bytes one GPU with these roles needs (both roles: the co-located GPU), from the gathered target shape.

    train.recompute = auto is judged as the trainer will resolve it: the fastest mode that fits `free`.
    """
    if ctx.target_shape is None:
        raise ConfigError(_no_shape(ctx))
    cuda = ctx.profile.cuda if ctx.profile else DEFAULT_CUDA
    role = "colocated" if len(roles) == 2 else roles[0]
    if ctx.config.train.recompute == "auto" and free is not None and role != "target":
        mode, need = choose_recompute(ctx.config, role, cuda, free, shape=ctx.target_shape)
        return need, f"{MEMORY_MODEL}, recompute auto -> {mode}"
    return role_need_bytes(ctx.config, role, cuda, shape=ctx.target_shape), MEMORY_MODEL


def check_gpu_memory(ctx: Context, need_fn: Callable[[Context, list[str]], tuple[int, str]] | None = None) -> CheckResult:
    gate = _gpu_gate(ctx, "gpu-memory")
    if gate:
        return gate
    rows, short, lines = [], [], []
    model = ""
    for name, roles, gpu, _why in _resolved(ctx):
        if gpu is None:
            continue
        try:
            need, model = need_fn(ctx, roles) if need_fn else _need(ctx, roles, gpu.memory_free)
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


def _drafter_gpus(ctx: Context) -> list[Gpu]:
    """The GPUs training the drafter (the first visible one for a co-located run), [] without a GPU snapshot."""
    snap = ctx.gpus.snapshot
    if snap is None:
        return []
    if ctx.config is not None:
        found = [gpu for _name, roles, gpu, _why in _resolved(ctx) if gpu is not None and "drafter" in roles]
        if found:
            return found
    visible, _ = visible_gpus(snap.gpus, ctx.gpus.cuda_visible_devices)
    return visible[:1]


def _drafter_gpu(ctx: Context) -> Gpu | None:
    gpus = _drafter_gpus(ctx)
    return gpus[0] if gpus else None


def _capability(text: str) -> tuple[int, int] | None:
    """ "9.0" -> (9, 0); None when unknown or unreadable (older recorded snapshots say "0.0")."""
    try:
        major, minor = (int(x) for x in text.split(".")[:2])
    except (ValueError, AttributeError):
        return None
    return None if (major, minor) == (0, 0) else (major, minor)


def check_compile_cache(ctx: Context) -> CheckResult:
    if _on_cpu(ctx):
        return _r("compile-cache", "skip", "device = cpu: nothing is compiled")
    cc = ctx.compile_cache
    fix = _in_profile(ctx, WARM_CACHE_FIX.format(config=_config_arg(ctx)))
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
    gpu = _drafter_gpu(ctx)
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
    """Every source file of the package a training run executes (dflash/*.py) against git HEAD, or outside a
    checkout against the installed distribution's RECORD hashes. An edit fails; an untracked file warns (no
    committed module imports it, so it changes nothing until a modified one does)."""
    ms = ctx.model_source
    data = dict(mode=ms.mode, commit=ms.commit, files=len(ms.files), modified=ms.states,
                verified=len(ms.verified), absent=ms.absent, diff_stat=ms.diff_stat)
    pkg = f"{MODEL_SOURCE_PACKAGE}/"
    if ms.error:
        return _r("model-source", "warn", f"cannot verify the training source {pkg}: {ms.error}", None, **data)
    where = f"git HEAD {ms.commit[:12]}" if ms.mode == "git" and ms.commit else (ms.commit or "?")
    changed = [m for m in ms.modified if ms.states.get(m) != "untracked"]
    untracked = [m for m in ms.modified if ms.states.get(m) == "untracked"]
    if ms.mode != "git":
        fix = f"uv pip install --reinstall --no-deps {ms.commit}  (from the wheel or sdist it came from)"
    else:
        fix = (f"git stash push --include-untracked -- {' '.join(ms.modified)}  (review first: git status -- "
               f"{' '.join(ms.modified)}; or commit them)")
    if changed:
        files = ", ".join(f"{m} ({ms.states.get(m, 'modified')})" for m in changed)
        last = [line.strip() for line in ms.diff_stat.splitlines() if "changed" in line]
        stat = f"; git diff --stat: {last[-1]}" if last else ""
        more = f"; also untracked: {_listing(untracked, 2)}" if untracked else ""
        return _r("model-source", "fail", f"training source modified against {where}: {files}{stat}{more}", fix, **data)
    if untracked:
        return _r("model-source", "warn", f"{len(untracked)} file(s) in {pkg} not in {where} (untracked): "
                  f"{_listing(untracked, 3)}; no committed module imports them", fix, **data)
    if not ms.verified:
        return _r("model-source", "warn", f"no file of {pkg} could be verified against {where}", None, **data)
    absent = f" ({len(ms.absent)} listed without a hash)" if ms.absent else ""
    return _r("model-source", "pass", f"all {len(ms.verified)} source files of {pkg} match {where}{absent}", **data)


# ---------------------------------------------------------------- run


def check_config(ctx: Context) -> CheckResult:
    """What the config schema cannot judge alone: the target must load, and the values that index into it fit it."""
    cfg, where = ctx.config, _config_arg(ctx)
    shape = ctx.target_shape
    if shape is None:
        return _r("config", "fail", f"target.path {cfg.target.path!r} cannot be read: {_no_shape(ctx)}",
                  f"set target.path in {where} to a Hugging Face model folder with config.json, or 'smollm2'",
                  target=cfg.target.path)
    layers, vocab = shape.num_layers, shape.vocab
    data = dict(target=cfg.target.path, num_layers=layers, vocab=vocab)
    problems, fixes = [], []
    ids = list(cfg.drafter.target_layer_ids)
    if ids:
        outside = [i for i in ids if i >= layers]
        if outside:
            problems.append(f"drafter.target_layer_ids {outside} outside 0..{layers - 1} of the {layers}-layer target")
            fixes.append(f"set drafter.target_layer_ids in {where} to ids in 0..{layers - 1}, or [] to spread them evenly")
    else:
        try:
            ids = default_target_layer_ids(layers, cfg.drafter.num_layers)
        except ValueError as e:
            problems.append(f"drafter.target_layer_ids [] ({e})")
            fixes.append(f"lower drafter.num_layers in {where}, or set drafter.target_layer_ids")
    mask = cfg.drafter.mask_token_id
    if mask is not None and mask >= vocab:
        problems.append(f"drafter.mask_token_id {mask} outside 0..{vocab - 1} (the target's vocab_size is {vocab})")
        fixes.append(f"set drafter.mask_token_id in {where} below {vocab}, or remove it to take the pad token")
    heads, kv = drafter_shape(cfg, shape).heads, drafter_shape(cfg, shape).kv_heads
    if heads % kv:
        problems.append(f"drafter heads {heads} not a multiple of its kv heads {kv} (unset fields take the target's)")
        fixes.append(f"set drafter.num_attention_heads and drafter.num_key_value_heads in {where} (heads a multiple of kv)")
    if cfg.train.fp8 != "off":
        _fp8_problems(ctx, drafter_shape(cfg, shape), where, problems, fixes)
    data.update(target_layer_ids=ids, mask_token_id=mask)
    if problems:
        return _r("config", "fail", "; ".join(problems), "; ".join(fixes), problems=problems, **data)
    return _r("config", "pass", f"target {cfg.target.path}: {layers} layers, vocab {vocab:,}; the drafter reads layers "
              f"{ids}, mask token {'from the target' if mask is None else mask}", **data)


def _fp8_problems(ctx: Context, d, where: str, problems: list[str], fixes: list[str]) -> None:
    """train.fp8 needs fp8 tensor cores on the drafter's GPU and MLP sizes the fp8 matmuls take (dflash.models.fp8)."""
    fp8 = ctx.config.train.fp8
    if d.hidden % 16 or d.intermediate % 16:
        problems.append(f"train.fp8 = {fp8!r} needs the drafter's hidden and intermediate sizes divisible by 16, "
                        f"got {d.hidden} and {d.intermediate}")
        fixes.append(f"set train.fp8 = \"off\" in {where}")
    old = [g for g in _drafter_gpus(ctx) if (_capability(g.compute_capability) or FP8_MIN_CAPABILITY) < FP8_MIN_CAPABILITY]
    for gpu in old[:1]:
        problems.append(f"train.fp8 = {fp8!r} needs compute capability {'.'.join(map(str, FP8_MIN_CAPABILITY))}+, the "
                        f"drafter's GPU {gpu.name} has {gpu.compute_capability}")
        fixes.append(f"set train.fp8 = \"off\" in {where}, or train on an Ada/Hopper-class GPU")


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
    # --resume latest takes the newest checkpoint that verifies (dflash.runs.rundir.resolve_resume)
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
    if rd.schedule_change:  # the trainer's own rule (dflash.data.plan.schedule_change), so both say the same
        data["schedule_change"] = rd.schedule_change
        notes.append(f"the lr schedule changes ({rd.schedule_change}): dflash-train refuses this resume without "
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
    from dflash.data.identity import compare_targets

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
                      "rewrite those shards with loss_mask 0 (context) or 1 (to learn); dflash.data.shards.write_shard "
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
    if dk.leftovers:
        data["reclaimable_bytes"] = sum(n for _, n, _ in dk.leftovers)
    if dk.free_bytes < need:
        spare = describe_leftovers(dk.leftovers, dk.output_dir or cfg.output_dir)
        return _r("disk", "fail", summary, f"free {_size(need - dk.free_bytes)} at {dk.path}"
                  + (f" ({spare}, yours to delete)" if spare else "")
                  + ", lower train.keep_last, or move output_dir to a larger disk", **data)
    return _r("disk", "pass", summary, **data)


# Variables newer torch reads before the one a profile sets: a value there decides, so it must agree.
READ_FIRST = {"PYTORCH_CUDA_ALLOC_CONF": "PYTORCH_ALLOC_CONF"}
# Commands named first when a foreign environment provides them: what a run starts by name.
KEY_COMMANDS = ("python", "python3", "pip", "pip3", "torchrun", "ninja", "nvcc", "ptxas", "gcc", "g++", "cc", "c++",
                "ld", "uv", "sglang", "hf", "huggingface-cli")


def _commands(names: list[str], limit: int = 4) -> str:
    key = [n for n in KEY_COMMANDS if n in names]
    ordered = key + [n for n in names if n not in key]
    return _listing(ordered, limit)


def check_env_vars(ctx: Context) -> CheckResult:
    """The profile's variables (dflash-train sets the unset ones itself, so unset passes; a different value, here
    or in a variable torch reads first, fails) and PATH (other Python environments anywhere on it warn)."""
    p = ctx.profile
    wrong, will_set, overridden = [], [], []
    for key, want in sorted(p.env.items()):
        have = ctx.env.get(key)
        first = READ_FIRST.get(key)
        if first is not None and ctx.env.get(first) not in (None, want):
            overridden.append((first, ctx.env[first], key, want))
        if have is None:
            will_set.append((key, want))
        elif have != want:
            wrong.append((key, want, have))
    foreign, missing_dirs, self_at = _path_findings(ctx)
    data = dict(required=dict(p.env), wrong=[{"name": k, "expected": w, "actual": h} for k, w, h in wrong],
                will_set=[{"name": k, "value": w} for k, w in will_set],
                overridden=[{"name": f, "actual": v, "overrides": k, "expected": w} for f, v, k, w in overridden],
                path_missing=missing_dirs, path_other_envs=foreign, self_on_path=self_at is not None)
    if wrong or overridden:
        said = [f"{k}={h!r} (need {w!r}; dflash-train keeps a value you set)" for k, w, h in wrong]
        said += [f"{f}={v!r} overrides {k} (torch reads {f} first; need {w!r} or unset)" for f, v, k, w in overridden]
        fix = " ".join([*(f"export {k}={w};" for k, w, _ in wrong), *(f"unset {f};" for f, *_ in overridden)])
        return _r("env-vars", "fail", f"profile {p.name}: {', '.join(said)}", fix.rstrip(";"), **data)
    notes = []
    if foreign:
        listed = [f"{e['path']} ({'ahead of' if e['ahead'] else 'after'} this environment; "
                  + (f"runs {_commands(e['commands'])}" if e["commands"] else "all its commands are found earlier")
                  + ")" for e in foreign]
        notes.append("PATH holds bin dirs of other Python environments; a command started by name that no earlier "
                     f"entry has runs from them: {_listing(listed, 3)}")
    if missing_dirs:
        notes.append(f"PATH entries that do not exist: {_listing(missing_dirs, 3)}")
    set_note = ", ".join(f"{k}={w}" for k, w in will_set)
    if notes:
        drop = {e["path"] for e in foreign}
        keep = [e.path for e in ctx.path_entries if e.exists and e.path not in drop]
        fix = f"export PATH={os.pathsep.join(keep)}  (`dflash-env run` runs a command with them off PATH)"
        if will_set:
            notes.append(f"dflash-train sets {set_note} (unset here)")
        return _r("env-vars", "warn", "; ".join(notes), fix, **data)
    parts = [] if p.env else ["no variables required"]
    if len(p.env) > len(will_set):
        parts.append(f"{len(p.env) - len(will_set)} required variable(s) set")
    if will_set:
        parts.append(f"{', '.join(k for k, _ in will_set)} unset here: dflash-train sets {set_note} before torch loads")
    return _r("env-vars", "pass", f"{'; '.join(parts)}; PATH clean ({len(ctx.path_entries)} entries)", **data)


def _path_findings(ctx: Context) -> tuple[list[dict], list[str], int | None]:
    """(other Python environments on PATH with what runs from each, missing PATH dirs, this env's position)."""
    self_at = next((i for i, e in enumerate(ctx.path_entries) if e.is_self), None)
    foreign = [{"path": e.path, "env": e.python_env, "ahead": self_at is None or i < self_at,
                "commands": e.commands[:50], "count": len(e.commands)}
               for i, e in enumerate(ctx.path_entries) if e.python_env and not e.is_self]
    for f in foreign:  # what a run starts by name first, the rest after
        key = [n for n in KEY_COMMANDS if n in f["commands"]]
        f["commands"] = key + [n for n in f["commands"] if n not in key]
    missing = [e.path for e in ctx.path_entries if not e.exists]
    return foreign, missing, self_at


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
    "config": check_config,
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
