"""The environment checks: profile (manifest and lock), torch-build, env-drift (against the lock and the RECORD
hashes), cuda-libs (wheels, LD_LIBRARY_PATH, driver, toolkits and the linker cache)."""

from __future__ import annotations

import os

from packaging.markers import default_environment
from packaging.utils import canonicalize_name

from preflight.checks.common import config_arg, in_profile, listing, on_cpu, preflight_command, result, sync_fix, wrong_env
from preflight.envs import run_command, sync_command
from preflight.facts.context import Context
from preflight.facts.environment import PROJECT_DIST
from preflight.lockfile import is_gpu_stack, judge_lock, same_version
from preflight.nvml import NO_DRIVER
from preflight.report import CheckResult


def check_profile(ctx: Context) -> CheckResult:
    name = ctx.profile_name
    if ctx.profile is None:
        return result("profile", "fail", ctx.profile_error or f"profile {name} did not load",
                      f"fix envs/{name}.toml (see envs/train-cu128.toml for the fields)")
    if ctx.lock_text is None:
        return result("profile", "fail", f"{ctx.lock_file} is missing: profile {name} has no lock to verify against",
                      "uv run dflash-lock write", lock=ctx.lock_file)
    problems = [f"{p.kind}: {p.message}" for p in judge_lock(ctx.profile, ctx.lock_text, fresh=None)]
    if problems:
        return result("profile", "fail", f"{ctx.lock_file} does not validate: {listing(problems, 2)}",
                      "uv run dflash-lock write  (then review the diff)", problems=problems)
    if ctx.config is not None and ctx.config.profile != name:
        other = ctx.config.profile
        check = f"dflash-preflight --profile {other} --config {config_arg(ctx)}"
        return result("profile", "fail", f"the run config asks for profile {other}; this check is for {name}",
                      f"{sync_command(other)} && {run_command(other, check)}")
    lock = ctx.lock
    summary = (f"envs/{name}.toml and {ctx.lock_file} validate: {len(lock.pins)} pins, torch {ctx.profile.torch}, "
               f"CUDA {ctx.profile.cuda}")
    data = dict(pins=len(lock.pins), torch=ctx.profile.torch, cuda=ctx.profile.cuda)
    ident = ctx.env_identity
    if ident is not None:
        data.update(environment=ident.prefix, profile_environment=ident.profile_env)
    if wrong_env(ctx):
        return result("profile", "warn", f"{summary}; but this interpreter runs in {ident.prefix}, not in profile {name}'s "
                      f"environment {ident.profile_env}: the environment checks below judge {ident.prefix}",
                      in_profile(ctx, preflight_command(ctx)), **data)
    return result("profile", "pass", summary + (f"; running in its environment {ident.profile_env}" if ident else ""), **data)


def check_torch_build(ctx: Context) -> CheckResult:
    p = ctx.profile
    want = f"profile {p.name} locks {p.torch} (CUDA {p.cuda})"
    fix = sync_fix(ctx)
    if ctx.torch is None:
        return result("torch-build", "fail", f"torch is not installed; {want}", fix, expected=p.torch, expected_cuda=p.cuda)
    t = ctx.torch
    data = dict(installed=t.version, cuda=t.cuda, expected=p.torch, expected_cuda=p.cuda, source=t.source)
    have = f"torch {t.version} ({'CUDA ' + t.cuda if t.cuda else 'CPU-only build'}) installed"
    copies = ctx.distributions.get("torch", [])
    if len(copies) > 1:
        return result("torch-build", "fail", f"torch is installed {len(copies)} times ({', '.join(copies)}); {want}",
                      fix, **data)
    if t.version.split("+")[0] != p.torch or t.cuda != p.cuda:
        return result("torch-build", "fail", f"{have}; {want}", fix, **data)
    return result("torch-build", "pass", f"{have}; {want}", **data)


def check_env_drift(ctx: Context) -> CheckResult:
    lock = ctx.lock
    if lock is None:
        return result("env-drift", "skip", f"no lock to compare against ({ctx.lock_file} missing; see profile)")
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
        elif not any(same_version(pin.version, v) for v in have):
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
    rebuilt, sync_note = _sync_record_findings(ctx, data)
    if not items and not edited and not unverified and not rebuilt:
        return result("env-drift", "pass", f"{len(pins)} locked distributions installed at their locked versions, "
                      f"nothing else installed{record_note}{sync_note}", **data)
    parts = []
    if edited:
        parts.append(f"files edited in place: {listing(edited, 2)}")
    if rebuilt:
        parts.append(f"another build of a locked version (its RECORD differs from the last checked sync's): "
                     f"{listing(rebuilt, 3)}")
    if gpu:
        parts.append(f"{len(gpu)} GPU-stack drift{'s' if len(gpu) > 1 else ''}: {listing(gpu)}")
    if other:
        parts.append(f"{len(other)} other: {listing(other, 3)}")
    if unverified:
        parts.append(f"not verifiable against a RECORD: {listing(unverified, 2)}")
    reinstall = [r["name"] for r in data["record"]["modified"]] if edited else []
    rebuilt_gpu = any(is_gpu_stack(r["name"]) for r in data["sync_record"]["rebuilt"]) if rebuilt else False
    return result("env-drift", "fail" if gpu or edited or rebuilt_gpu else "warn",
                  f"environment differs from {ctx.lock_file}: " + "; ".join(parts) + sync_note, sync_fix(ctx, reinstall),
                  **data)


def _sync_record_findings(ctx: Context, data: dict) -> tuple[list[str], str]:
    """RECORDs against the last checked sync's record (dflash-verified.json): (another build, note for the summary).

    A distribution at the version the sync recorded whose RECORD hashes otherwise was installed from another
    wheel after it (`uv pip install --force-reinstall`, another index): the same version string, other files. Every
    listed distribution is compared, the GPU stack failing and the rest warning; with no record, the note says so."""
    rec = ctx.sync_record
    if rec is None:
        return [], ""
    data["sync_record"] = dict(path=rec.path, present=rec.present, compared=rec.compared, rebuilt=rec.rebuilt,
                               seconds=round(rec.seconds, 3))
    if not rec.present:
        return [], ("; no dflash-verified.json in this environment (not built by this dflash-env version), so builds "
                    "of a locked version are not compared")
    rebuilt = [f"{r['name']} {r['version']}" for r in rec.rebuilt]
    return rebuilt, "" if rebuilt else f"; {rec.compared} RECORDs match the last checked sync's"


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
    if on_cpu(ctx):
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
        return result("cuda-libs", "fail", f"profile {p.name} is CUDA {p.cuda}: {listing(problems + warnings, 3)}",
                      "; ".join(dict.fromkeys(fixes + warn_fixes)), **data)
    if warnings:
        return result("cuda-libs", "warn", f"profile {p.name} is CUDA {p.cuda}: {'; '.join(warnings)}",
                      "; ".join(warn_fixes), **data)
    ld = f"{len(ctx.ld_dirs)} LD_LIBRARY_PATH dirs clean" if ctx.ld_dirs else "LD_LIBRARY_PATH unset"
    return result("cuda-libs", "pass",
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
