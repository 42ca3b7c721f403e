"""The code a run executes: compile-cache (warm and built for this setup) and model-source (unmodified)."""

from __future__ import annotations

from dflash.runs.compile_manifest import MANIFEST_NAME, differences
from preflight.checks.common import config_arg, in_profile, listing, on_cpu, result
from preflight.checks.gpus import drafter_gpu
from preflight.facts.context import Context
from preflight.facts.source import MODEL_SOURCE_PACKAGE
from preflight.report import CheckResult

WARM_CACHE_FIX = "dflash-train --config {config} --warm-cache"


def check_compile_cache(ctx: Context) -> CheckResult:
    if on_cpu(ctx):
        return result("compile-cache", "skip", "device = cpu: nothing is compiled")
    cc = ctx.compile_cache
    fix = in_profile(ctx, WARM_CACHE_FIX.format(config=config_arg(ctx)))
    size = f" ({cc.size_bytes / 1e6:,.0f} MB)" if cc.size_bytes else ""
    data = dict(path=cc.path, exists=cc.exists, size_bytes=cc.size_bytes, manifest=cc.manifest)
    if cc.env_override:
        data["env_override"] = cc.env_override
    if not cc.exists:
        return result("compile-cache", "warn", f"cold: {cc.path} does not exist; the first compile runs at launch "
                      "(three drafter threads compiling flex attention at once is a known race)", fix, **data)
    if cc.error or cc.manifest is None:
        why = cc.error or f"no {MANIFEST_NAME} (not written by dflash-train --warm-cache)"
        return result("compile-cache", "warn", f"cold: {cc.path}{size}: {why}", fix, **data)
    now: dict[str, str | None] = {
        "torch": ctx.torch.version if ctx.torch else None,
        "triton": (ctx.distributions.get("triton") or [None])[0],
    }
    gpu = drafter_gpu(ctx)
    if gpu is not None:
        now["gpu_name"] = gpu.name
        now["compute_capability"] = gpu.compute_capability
    if ctx.config is not None:
        now["drafter_hash"] = ctx.config.drafter_hash()
        now["target_hash"] = ctx.config.target_hash()
    diffs = differences(cc.manifest, now)
    data["current"] = now
    not_compared = [k for k in ("gpu_name", "compute_capability", "drafter_hash", "target_hash") if k not in now]
    if diffs:
        return result("compile-cache", "warn", f"stale: {cc.path}{size} was built for another setup ({listing(diffs, 3)})",
                      fix, **data)
    if cc.env_override:
        return result("compile-cache", "warn", f"TORCHINDUCTOR_CACHE_DIR={cc.env_override} points away from the "
                      f"profile's warm cache {cc.path}", "unset TORCHINDUCTOR_CACHE_DIR", **data)
    extra = f"; not compared: {', '.join(not_compared)}" if not_compared else ""
    return result("compile-cache", "pass", f"warm: {cc.path}{size} matches torch {now['torch']}, triton {now['triton']}"
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
        return result("model-source", "warn", f"cannot verify the training source {pkg}: {ms.error}", None, **data)
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
        more = f"; also untracked: {listing(untracked, 2)}" if untracked else ""
        return result("model-source", "fail", f"training source modified against {where}: {files}{stat}{more}", fix, **data)
    if untracked:
        return result("model-source", "warn", f"{len(untracked)} file(s) in {pkg} not in {where} (untracked): "
                      f"{listing(untracked, 3)}; no committed module imports them", fix, **data)
    if not ms.verified:
        return result("model-source", "warn", f"no file of {pkg} could be verified against {where}", None, **data)
    absent = f" ({len(ms.absent)} listed without a hash)" if ms.absent else ""
    return result("model-source", "pass", f"all {len(ms.verified)} source files of {pkg} match {where}{absent}", **data)
