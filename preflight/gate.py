"""The in-process preflight gate dflash-train runs before anything heavy.

    from preflight.gate import run_preflight
    report = run_preflight(cfg, cfg.profile, {"env-drift": "vendor image"}, "resume")
    if not report.ok: refuse to start

Runs the same checks as ``dflash-preflight`` (no torch import, no CUDA context: NVML only)
and writes the report to ``<output_dir>/preflight.json``.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from dflash.config import RunConfig, config_sha256
from preflight.checks import CHECK_IDS, run_checks
from preflight.facts import gather
from preflight.nvml import GpuInfo, NvmlGpuInfo
from preflight.report import Report, apply_waivers

REPORT_NAME = "preflight.json"


def validate_waivers(waivers: Mapping[str, str]) -> dict[str, str]:
    """Waivers keyed by check id; an unknown id or an empty reason is a ValueError (one line)."""
    out = {}
    for check_id, reason in waivers.items():
        if check_id not in CHECK_IDS:
            raise ValueError(f"--waive {check_id}: unknown check id (known: {', '.join(CHECK_IDS)})")
        if not str(reason).strip():
            raise ValueError(f"--waive {check_id}: give a non-empty --reason")
        out[check_id] = str(reason)
    return out


def build_report(
    profile_name: str,
    cfg: RunConfig | None,
    waivers: Mapping[str, str] | None = None,
    resume_intent: str | None = None,
    gpu_info: GpuInfo | None = None,
    config_path: str | None = None,
    gpu_override: dict[str, list[str]] | None = None,
) -> Report:
    """Gather facts, run every check, apply waivers. GPU info defaults to real NVML (not asked when device = cpu).

    gpu_override {cuda index: [role]} replaces the config's GPU lists (a torchrun rank checks its own GPU).
    """
    if resume_intent not in (None, "resume", "fresh"):
        raise ValueError(f"resume intent must be 'resume', 'fresh' or None, got {resume_intent!r}")
    waivers = validate_waivers(waivers or {})
    if gpu_info is None and not (cfg is not None and cfg.device == "cpu"):
        gpu_info = NvmlGpuInfo()
    t0 = time.perf_counter()
    ctx = gather(profile_name, cfg, resume_intent, gpu_info, config_path=config_path)
    ctx.own_gpus = gpu_override
    checks = apply_waivers(run_checks(ctx), waivers)
    host = dict(ctx.host, preflight_seconds=round(time.perf_counter() - t0, 3))
    return Report.build(profile_name, checks, host)


def run_preflight(
    cfg: RunConfig,
    profile_name: str,
    waivers: Mapping[str, str] | None = None,
    resume_intent: str | None = None,
    gpu_info: GpuInfo | None = None,
    config_path: str | None = None,
    gpu_override: dict[str, list[str]] | None = None,
    write: bool = True,
) -> Report:
    """Run preflight for a run and (write=True) write ``<output_dir>/preflight.json``; the caller refuses to start
    unless ``ok``. The written report carries a fresh gate_id and the config's hash: split workers check both."""
    report = build_report(profile_name, cfg, waivers, resume_intent, gpu_info, config_path, gpu_override)
    if write:
        write_report(cfg, report)
    return report


def write_report(cfg: RunConfig, report: Report, ranks: list[dict] | None = None, ok: bool | None = None) -> Report:
    """Stamp the report with this run's identity (and the per-rank verdicts of a torchrun gate), write it atomically."""
    run = {"gate_id": uuid.uuid4().hex, "config_sha256": config_sha256(cfg),
           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if ranks is not None:
        run["ranks"] = ranks
    report.run = run
    if ok is not None:
        report.ok = ok
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{REPORT_NAME}.tmp"
    tmp.write_text(json.dumps(report.model_dump(), indent=2) + "\n")
    os.replace(tmp, out / REPORT_NAME)
    return report


def apply_profile_env(profile_name: str, log=print) -> None:
    """Set the variables the profile requires where the shell left them unset (before torch allocates or compiles).

    A value the user set differently is left alone, so the env-vars check still reports it.
    """
    from preflight.profiles import ProfileError, load_profile

    try:
        profile = load_profile(profile_name)
    except ProfileError:
        return  # the profile check reports it
    for key, value in profile.env.items():
        if key not in os.environ:
            os.environ[key] = value
            log(f"profile {profile_name}: set {key}={value}")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(profile.compile_cache_path))
