"""dflash-preflight: prove this machine is in the state a run needs, before the run.

    uv run dflash-preflight --profile train-cu128                       # environment only
    uv run dflash-preflight --profile train-cu128 --config RUN.toml     # + GPUs, run dir, dataset, disk
    uv run dflash-preflight --profile train-cu128 --json --waive env-drift --reason "vendor image"
    uv run dflash-preflight --profile train-cu128 --config RUN.toml --resume --verify-data   # + every sha256
    uv run dflash-preflight --profile train-cu128 --config RUN.toml --set data.token_budget=45056   # as dflash-train

Exit codes: 0 no check failed (warnings allowed), 1 a check failed, 2 usage error.
This process never imports torch and never creates a CUDA context (GPUs are read via NVML).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from dflash.errors import run_cli
from preflight.checks.registry import CHECK_IDS, NEEDS_CONFIG

EXIT_OK, EXIT_FAIL = 0, 1  # a usage error (click.UsageError) exits 2 through run_cli


@click.command(context_settings={"help_option_names": ["-h", "--help"]}, epilog=f"Check ids: {', '.join(CHECK_IDS)}. "
               f"Without --config these are skipped: {', '.join(NEEDS_CONFIG)}.")
@click.option("--profile", "profile_name", required=True, metavar="NAME", help="environment profile (envs/NAME.toml)")
@click.option("--config", "config_path", metavar="RUN.toml",
              help="run config; without it only the environment is checked")
@click.option("--json", "as_json", is_flag=True, help="print exactly one JSON object on stdout")
@click.option("--waive", multiple=True, metavar="CHECK_ID",
              help="accept a failing check (repeatable; each needs --reason)")
@click.option("--reason", multiple=True, metavar="TEXT",
              help="why the matching --waive is acceptable (kept in the report)")
@click.option("--resume", is_flag=True, help="the run will resume from its newest checkpoint")
@click.option("--fresh", is_flag=True, help="the run will start over even if checkpoints exist")
@click.option("--verify-data", is_flag=True, help="also hash every dataset shard, and the checkpoint --resume would "
              "load, against the sha256 recorded when they were written (reads every byte; without it: sizes)")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="override a config field, as dflash-train "
              "--set does, e.g. data.token_budget=45056 (needs --config)")
@click.option("--nvml-fake", metavar="JSON|none", hidden=True, help="replay a recorded NVML snapshot (tests)")
@click.option("--probe-fake", metavar="JSON|real", hidden=True, help="with --nvml-fake: a recorded probe of the memory "
              "outside torch (preflight.facts.overhead.Overhead), or `real` to run the real probe on the recorded GPUs")
def command(profile_name, config_path, as_json, waive, reason, resume, fresh, verify_data, sets, nvml_fake,
            probe_fake) -> int:
    """Check the environment profile NAME (and a run config) before training."""
    from dflash.config import ConfigError, load_config, parse_overrides
    from preflight.gate import build_report, validate_waivers
    from preflight.nvml import FakeGpuInfo
    from preflight.profiles import ENVS_DIR, profile_names
    from preflight.report import render_text, use_colour

    if not (ENVS_DIR / f"{profile_name}.toml").exists():
        known = ", ".join(profile_names()) or "none"
        raise click.UsageError(f"unknown profile {profile_name!r} (known: {known})")
    if len(waive) != len(reason):
        raise click.UsageError(f"{len(waive)} --waive but {len(reason)} --reason: give one --reason per --waive")
    if resume and fresh:
        raise click.UsageError("--resume and --fresh exclude each other; pick one")
    try:
        waivers = validate_waivers(dict(zip(waive, reason)))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if sets and config_path is None:
        raise click.UsageError("--set overrides a run config field: give --config RUN.toml with it")
    cfg = None
    if config_path is not None:
        try:
            cfg = load_config(config_path, parse_overrides(sets))
        except ConfigError as e:
            raise click.UsageError(str(e)) from None
    gpu_info = None
    if nvml_fake:
        try:
            gpu_info = FakeGpuInfo(None) if nvml_fake == "none" else FakeGpuInfo.from_json(nvml_fake)
        except (OSError, ValueError) as e:
            raise click.UsageError(f"--nvml-fake {nvml_fake}: {e}") from None
    probe = None
    if probe_fake == "real":
        from preflight.probe import probe_for_run as probe
    elif probe_fake:
        from preflight.facts.overhead import Overhead

        try:
            recorded = Overhead.from_dict(json.loads(Path(probe_fake).read_text()))
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise click.UsageError(f"--probe-fake {probe_fake}: {e}") from None
        probe = lambda ctx: recorded  # noqa: E731
    intent = "resume" if resume else "fresh" if fresh else None
    report = build_report(profile_name, cfg, waivers, intent, gpu_info, config_path, verify_data=verify_data,
                          probe=probe)
    if as_json:
        click.echo(report.to_json())
    else:
        click.echo(render_text(report, colour=use_colour(sys.stdout)))
    return EXIT_OK if report.ok else EXIT_FAIL


def main(argv: list[str] | None = None) -> None:
    """Console entry point: a usage error is one line on stderr and exit 2, never a traceback."""
    run_cli(command, "dflash-preflight", argv)


if __name__ == "__main__":
    main()
