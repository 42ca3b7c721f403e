"""The public face of preflight: the gate every entry point calls, and what the trainer may ask of a profile.

    from preflight.gate import run_gate
    result = run_gate(cfg, {"env-drift": "vendor image"}, "resume")   # writes <output_dir>/preflight.json,
                                                                       # and snapshot.json once it passed
    for line in result.notes: print(line, file=sys.stderr)
    print(result.verdict); refuse to start unless result.ok

Runs the same checks as ``dflash-preflight`` (no torch import, no CUDA context: NVML only).
Modules under ``dflash/`` import nothing else from ``preflight``: the profile facts the trainer
needs come from the small functions below (`apply_profile_env`, `provenance`, `repo_root`) and from
``preflight.profiles`` (`compile_cache_dir`), so preflight's internals can change freely. Only the command modules
(``dflash/commands/``) import preflight at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dflash.config import RunConfig, config_sha256
from dflash.errors import UsageError
from dflash.runs.rundir import PREFLIGHT_NAME
from preflight.checks.registry import CHECK_IDS, run_checks
from preflight.facts.context import Context
from preflight.facts.gather import gather
from preflight.facts.overhead import Overhead
from preflight.facts.source import git_commit
from preflight.nvml import GpuInfo, NvmlGpuInfo
from preflight.probe import probe_for_run
from preflight.profiles import REPO_ROOT, ProfileError, compile_cache_dir, lock_path, profile_env, triton_cache_dir
from preflight.report import Report, apply_waivers


class WaiverError(UsageError):
    """A --waive that names no check or gives no reason; the message is one line."""


# ---------------------------------------------------------------- what the trainer asks of a profile


def repo_root() -> Path:
    """The checkout (or installed tree) that holds envs/, configs/, dflash/ and preflight/."""
    return REPO_ROOT




def apply_profile_env(name: str, log=print) -> dict[str, str]:
    """Set the variables the profile requires where the shell left them unset; call before torch loads.

    A value the user set differently is left alone, so the env-vars check still reports it; an
    unknown or broken profile sets nothing (the profile check reports it). Returns what was set.
    """
    try:
        required = profile_env(name)
    except ProfileError:
        return {}
    applied = {}
    for key, value in required.items():
        if key not in os.environ:
            os.environ[key] = applied[key] = value
            log(f"profile {name}: set {key}={value}")
    # inductor compiles into the profile's cache, Triton (fla's kernels) into the profile's own dir beside it
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_dir(name)))
    os.environ.setdefault("TRITON_CACHE_DIR", str(triton_cache_dir(name)))
    return applied




def resolve_compile_cache(cfg):
    """cfg with train.compile_cache resolved: the file it names, else the default beside the profile's compile cache
    dir (dflash.runs.compile_artifact.default_path); unchanged when the profile is unknown (the gate says so)."""
    from dflash.runs.compile_artifact import resolve

    try:
        return resolve(cfg, compile_cache_dir(cfg.profile))
    except ProfileError:
        return cfg


def provenance(name: str) -> dict:
    """What a checkpoint records about the code and environment that wrote it.

    ``{"lock_sha256": sha256 of envs/<name>.lock (None if missing), "git_commit": HEAD (None outside git)}``
    """
    try:
        lock_sha = hashlib.sha256(lock_path(name).read_bytes()).hexdigest()
    except OSError:
        lock_sha = None
    return {"lock_sha256": lock_sha, "git_commit": git_commit(REPO_ROOT)}


# ---------------------------------------------------------------- the gate


def validate_waivers(waivers: Mapping[str, str]) -> dict[str, str]:
    """Waivers keyed by check id; an unknown id or an empty reason is a WaiverError (one line)."""
    out = {}
    for check_id, reason in waivers.items():
        if check_id not in CHECK_IDS:
            raise WaiverError(f"--waive {check_id}: unknown check id (known: {', '.join(CHECK_IDS)})")
        if not str(reason).strip():
            raise WaiverError(f"--waive {check_id}: give a non-empty --reason")
        out[check_id] = str(reason)
    return out


def build_report(
    profile_name: str,
    cfg: RunConfig | None,
    waivers: Mapping[str, str] | None = None,
    resume_intent: str | None = None,
    gpu_info: GpuInfo | None = None,
    config_path: str | None = None,
    gpu_override: dict[str, str] | None = None,
    verify_data: bool = False,
    probe: Callable[[Context], Overhead | None] | None = None,
) -> Report:
    """Gather facts, run every check, apply waivers. GPU info defaults to real NVML (not asked when device = cpu).

    gpu_override {cuda index: role} replaces the config's GPU lists (a torchrun rank checks its own GPU).
    verify_data: also hash every shard and the checkpoint a resume loads against their recorded sha256.
    """
    return check_run(profile_name, cfg, waivers, resume_intent, gpu_info, config_path, gpu_override, verify_data,
                     probe)[0]


def check_run(
    profile_name: str,
    cfg: RunConfig | None,
    waivers: Mapping[str, str] | None = None,
    resume_intent: str | None = None,
    gpu_info: GpuInfo | None = None,
    config_path: str | None = None,
    gpu_override: dict[str, str] | None = None,
    verify_data: bool = False,
    probe: Callable[[Context], Overhead | None] | None = None,
) -> tuple[Report, Context]:
    """`build_report`, with the facts it judged (the gate keeps them for the run's snapshot).

    probe: what measures the memory outside torch on the run's GPUs (preflight.probe.probe_for_run, the default with
    the real NVML; none with a recorded one unless given)."""
    if resume_intent not in (None, "resume", "fresh"):
        raise ValueError(f"resume intent must be 'resume', 'fresh' or None, got {resume_intent!r}")
    waivers = validate_waivers(waivers or {})
    t0 = time.perf_counter()
    real_nvml = gpu_info is None and not (cfg is not None and cfg.device == "cpu")
    if real_nvml:
        gpu_info = NvmlGpuInfo()
    ctx = gather(profile_name, cfg, resume_intent, gpu_info, config_path=config_path, verify_data=verify_data)
    ctx.own_gpus = gpu_override
    if probe is None and real_nvml:
        probe = probe_for_run
    if probe is not None:
        ctx.overhead = probe(ctx)  # a fact too: the memory outside torch, measured on each assigned GPU
    checks = apply_waivers(run_checks(ctx), waivers)
    host = dict(ctx.host, preflight_seconds=round(time.perf_counter() - t0, 3))
    return Report.build(profile_name, checks, host), ctx


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
    tmp = out / f".{PREFLIGHT_NAME}.tmp"
    tmp.write_text(json.dumps(report.model_dump(), indent=2) + "\n")
    os.replace(tmp, out / PREFLIGHT_NAME)
    return report


def write_snapshot(cfg: RunConfig, report: Report, facts: Context) -> list[str]:
    """``<output_dir>/snapshot.json`` of a run the gate let start (after `write_report` stamped it): what
    `dflash-diff` compares. Returns a note when it could not be written; a run never stops for its snapshot."""
    from dflash.runs.records import SNAPSHOT_NAME
    from dflash.runs.records import write_snapshot as write
    from preflight.snapshot import stamp, take

    try:
        write(cfg.output_dir, stamp(take(facts, report), report.run or {}))
    except OSError as e:
        return [f"preflight: snapshot not written to {Path(cfg.output_dir) / SNAPSHOT_NAME} ({e.strerror or e})"]
    except Exception as e:  # a fact this version cannot describe must not keep a passing run from starting
        return [f"preflight: snapshot not written ({type(e).__name__}: {' '.join(str(e).split())[:160]})"]
    return []


# Warnings the gate prints as it lets a run start (the others stay in the report): the config check's is about what
# the run learns (a target with random weights: dflash.models.weights).
SAID_WARNINGS = ("config",)


@dataclass
class GateResult:
    """The gate's decision for one run, with the lines an entry point prints."""

    report: Report
    ok: bool
    notes: list[str] = field(default_factory=list)  # one line per SAID_WARNINGS warning, waived or failed check (stderr)
    verdict: str = ""  # the last line: "preflight: ok (...)" or "refusing to start: ..." (stderr when not ok)


def run_gate(
    cfg: RunConfig,
    waivers: Mapping[str, str] | None = None,
    resume_intent: str | None = None,
    gpu_info: GpuInfo | None = None,
    config_path: str | None = None,
    verify_data: bool = False,
) -> GateResult:
    """Run preflight for a run, write its report, and say whether training may start. Raises WaiverError.

    A run dir that cannot take the report (read-only, full) is the run-dir / disk checks' finding; the
    report is then not written and a note says so.
    """
    report, facts = check_run(cfg.profile, cfg, waivers, resume_intent, gpu_info, config_path, verify_data=verify_data)
    notes = []
    try:
        write_report(cfg, report)
    except OSError as e:
        notes.append(f"preflight: report not written to {Path(cfg.output_dir) / PREFLIGHT_NAME} ({e.strerror or e})")
    failed, waived = report.with_status("fail"), report.with_status("waived")
    if not failed and report.run is not None:
        notes += write_snapshot(cfg, report, facts)
    notes += [f"preflight: WARN {c.id}: {c.summary}" for c in report.with_status("warn") if c.id in SAID_WARNINGS]
    notes += [f"preflight: waived {c.id}: {c.summary}" for c in waived]
    notes += [f"preflight: FAIL {c.id}: {c.summary}" + (f"  fix: {c.fix}" if c.fix else "") for c in failed]
    if failed:
        verdict = (f"refusing to start: {len(failed)} preflight check(s) failed (report: "
                   f"{Path(cfg.output_dir) / PREFLIGHT_NAME}); fix them or waive with --waive ID --reason TEXT")
    else:
        verdict = f"preflight: ok ({len(report.checks)} checks, {len(waived)} waived)"
    return GateResult(report, not failed, notes, verdict)
