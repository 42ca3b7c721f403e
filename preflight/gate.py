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
from collections.abc import Mapping
from pathlib import Path

from dflash.config import RunConfig
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
) -> Report:
    """Gather facts, run every check, apply waivers. GPU info defaults to real NVML (not asked when device = cpu)."""
    if resume_intent not in (None, "resume", "fresh"):
        raise ValueError(f"resume intent must be 'resume', 'fresh' or None, got {resume_intent!r}")
    waivers = validate_waivers(waivers or {})
    if gpu_info is None and not (cfg is not None and cfg.device == "cpu"):
        gpu_info = NvmlGpuInfo()
    t0 = time.perf_counter()
    ctx = gather(profile_name, cfg, resume_intent, gpu_info, config_path=config_path)
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
) -> Report:
    """Run preflight for a run and write ``<output_dir>/preflight.json``; the caller refuses to start unless ``ok``."""
    report = build_report(profile_name, cfg, waivers, resume_intent, gpu_info, config_path)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{REPORT_NAME}.tmp"
    tmp.write_text(json.dumps(report.model_dump(), indent=2) + "\n")
    os.replace(tmp, out / REPORT_NAME)
    return report
