"""Every check by id, in report order, and ``run_checks``: which ones need a config or a profile, and a crash in
one reported as its failure, not hiding the others."""

from __future__ import annotations

from collections.abc import Callable

from preflight.checks.common import result
from preflight.checks.dataset import check_dataset
from preflight.checks.env_vars import check_env_vars
from preflight.checks.environment import check_cuda_libs, check_env_drift, check_profile, check_torch_build
from preflight.checks.gpus import check_gpu_memory, check_gpu_processes, check_gpu_visibility
from preflight.checks.run import check_config, check_disk, check_run_dir
from preflight.checks.source import check_compile_cache, check_model_source
from preflight.facts.context import Context
from preflight.report import CheckResult

CHECK_IDS = (
    "profile", "torch-build", "env-drift", "cuda-libs", "gpu-visibility", "gpu-memory", "gpu-processes",
    "compile-cache", "model-source", "config", "run-dir", "dataset", "disk", "env-vars",
)


# Checks that judge a run, not the environment: without --config they are skipped (and say so).
NEEDS_CONFIG = ("gpu-memory", "gpu-processes", "compile-cache", "config", "run-dir", "dataset", "disk")


# Checks that judge the profile's environment: skipped when the profile manifest did not load.
NEEDS_PROFILE = ("torch-build", "env-drift", "cuda-libs", "compile-cache", "env-vars")


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
            out.append(result(check_id, "skip", "run-dependent: needs --config RUN.toml"))
        elif check_id in NEEDS_PROFILE and ctx.profile is None:
            out.append(result(check_id, "skip", f"profile {ctx.profile_name} did not load (see profile)"))
        else:
            try:
                out.append(fn(ctx))
            except Exception as e:  # a bug in one check must not hide the others' findings
                out.append(result(check_id, "fail", f"check crashed: {type(e).__name__}: {e}",
                                  "report this as a dflash bug (preflight check crashed)"))
    return out
