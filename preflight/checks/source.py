"""The code a run executes: compile-cache (warm and built for this setup) and model-source (unmodified)."""

from __future__ import annotations

from dflash.runs.compile_artifact import classes_text, differences, size_text, start_text
from preflight.checks.common import config_arg, in_profile, listing, on_cpu, result
from preflight.checks.gpus import drafter_gpu, target_gpus
from preflight.facts.context import Context
from preflight.facts.source import MODEL_SOURCE_PACKAGE
from preflight.report import CheckResult

WARM_CACHE_FIX = "dflash-train --config {config} --warm-cache"


def fla_note(ctx: Context) -> str:
    """For a cold start of a hybrid target (fla's Gated DeltaNet kernels): whether fla's autotuning choices are kept
    for the target GPU's model and this Triton (dflash.models.fla_tuning), or how to keep them; "" otherwise."""
    from dflash.models.fla_kept import ENV, KEPT, chosen_file, read_kept, unusable

    gpus = target_gpus(ctx)
    gpu = gpus[0] if gpus else None
    if ctx.target_shape is None or not ctx.target_shape.linear_layers or gpu is None:
        return ""
    path = chosen_file(gpu.name, ctx.env)
    kept, _ = read_kept(path) if path is not None and path.is_file() else (None, None)
    triton = (ctx.distributions.get("triton") or [None])[0]
    fla = (ctx.distributions.get("fla-core") or ctx.distributions.get("flash-linear-attention") or [None])[0]
    if kept is not None and unusable(kept, gpu.name, triton, fla) is None:
        where = f"dflash/models/fla_tuned/{path.name}" if path.parent == KEPT else f"{ENV}={path}"
        return f"; fla's autotuning choices are kept for {gpu.name} ({where}): fla tunes only shapes not kept there"
    return ("; fla autotunes its kernels at launch (50 s of the 27B target's first step on an H100; --warm-cache "
            "records its choices, python -m dflash.train.fla_choices ARTIFACT keeps them for this GPU model)")


def check_compile_cache(ctx: Context) -> CheckResult:
    """The run's compile cache artifact against this machine (torch, Triton, the GPU) and this run (the target's
    architecture, the drafter, the shape classes): warm when all match, with the start --warm-cache measured."""
    if on_cpu(ctx):
        return result("compile-cache", "skip", "device = cpu: nothing is compiled")
    cc = ctx.compile_cache
    if cc is None:
        return result("compile-cache", "skip", "compile cache not gathered")
    fix = WARM_CACHE_FIX.format(config=config_arg(ctx))
    if ctx.config.train.compile_cache:  # a file named by --set or the config: make it there
        fix += f" --set train.compile_cache={ctx.config.train.compile_cache}"
    fix = in_profile(ctx, fix)
    size = f" ({size_text(cc.size_bytes)})" if cc.size_bytes is not None else ""
    data = dict(path=cc.path, exists=cc.exists, size_bytes=cc.size_bytes, manifest=cc.manifest)
    if cc.env_override:
        data["env_override"] = cc.env_override
    if not cc.exists:
        others = f" ({cc.others} made for other runs beside it)" if cc.others else ""
        return result("compile-cache", "warn", f"cold: no compile cache artifact {cc.path}{others}; every graph "
                      "compiles at launch (three drafter threads compiling flex attention at once is a known race)"
                      f"{fla_note(ctx)}", fix, **data)
    if cc.error or cc.manifest is None:
        return result("compile-cache", "warn", f"cold: {cc.path}{size}: {cc.error or 'no manifest'}; a run ignores it"
                      f"{fla_note(ctx)}", fix, **data)
    now: dict[str, object] = {"torch": ctx.torch.version if ctx.torch else None,
                              "triton": (ctx.distributions.get("triton") or [None])[0]}
    gpu = drafter_gpu(ctx)
    if gpu is not None:
        now["gpu_name"] = gpu.name
        now["compute_capability"] = gpu.compute_capability
    if cc.run is not None:
        now.update(cc.run)
    diffs = differences(cc.manifest, now)
    data["current"] = now
    if diffs:
        return result("compile-cache", "warn", f"stale: {cc.path}{size} was made for another setup "
                      f"({listing(diffs, 3)}); a run ignores it and starts cold ({start_text(cc.manifest)})"
                      f"{fla_note(ctx)}", fix, **data)
    not_compared = [k for k in ("gpu_name", "compute_capability") if k not in now]
    not_compared += [f"shape classes ({cc.run_error})"] if cc.run is None else []
    extra = f"; not compared: {', '.join(not_compared)}" if not_compared else ""
    classes = f", shape classes {classes_text(cc.manifest.get('shape_classes'))}" if cc.run is not None else ""
    return result("compile-cache", "pass", f"{start_text(cc.manifest)} from {cc.path}{size}: matches torch "
                  f"{now['torch']}, triton {now['triton']}" + (f", {gpu.name} ({gpu.compute_capability})" if gpu else "")
                  + classes + extra, **data)


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
