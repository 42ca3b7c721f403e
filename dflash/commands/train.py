"""dflash-train: the gate, then the run (one process, or the launcher of split and co-located data-parallel runs) or
the demo.

    uv run dflash-train --config configs/demo-cpu.toml --fresh
    uv run dflash-train --config configs/demo-cpu.toml --resume latest
    uv run dflash-train --config configs/qwen3-8b-1gpu.toml --warm-cache

Exit codes: 0 the run finished, 1 it failed (or the gate refused it), 2 bad input, 75 a signal stopped it after a
checkpoint (resume with --resume latest; dflash.runs.rundir.EXIT_STOPPED).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import click

from dflash.commands.common import CONTEXT, gpu_options, gpu_overrides, parse_waivers
from dflash.config import RunConfig, load_config, parse_overrides
from dflash.errors import Command, DflashError, run_cli


class NoGpuError(DflashError):
    """A CUDA run config on a machine where torch sees no GPU; the message is one line."""


def _gate(cfg: RunConfig, waivers: dict[str, str], intent: str | None, verify_data: bool = False,
          config_path: Path | None = None):
    """The in-process preflight gate; prints its lines. Its result (`.ok`: training may start)."""
    from preflight.gate import run_gate

    result = run_gate(cfg, waivers, intent, config_path=str(config_path) if config_path else None,
                      verify_data=verify_data)
    for line in result.notes:
        click.echo(line, err=True)
    click.echo(result.verdict, err=not result.ok)
    return result


@click.command(cls=Command, context_settings=CONTEXT)
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              help="run config TOML (see configs/)")
@click.option("--demo", is_flag=True, help="the embedded end-to-end demo on CPU (SmolLM2-135M target)")
@click.option("--resume", help="continue from `latest` or a checkpoint folder")
@click.option("--fresh", is_flag=True, help="start over; existing checkpoints are moved aside, not deleted")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="override a config field, e.g. train.lr=1e-4")
@click.option("--max-steps", type=click.IntRange(min=1), help="stop after N optimizer steps")
@click.option("--output-dir", help="override output_dir")
@gpu_options
@click.option("--waive", multiple=True, metavar="CHECK_ID", help="waive a failing preflight check (needs --reason)")
@click.option("--reason", multiple=True, help="why the matching --waive is acceptable (kept in the report)")
@click.option("--warm-cache", is_flag=True, help="compile every shape class of the run, write the compile cache "
              "artifact (train.compile_cache) and time a fresh process that loads it, then exit")
@click.option("--check-artifact", type=click.Path(dir_okay=False, path_type=Path), hidden=True,
              help="internal: the fresh process --warm-cache times")
@click.option("--no-progress", is_flag=True, help="plain log lines instead of a progress bar")
@click.option("--allow-schedule-change", is_flag=True, help="resume even though the lr schedule changes "
              "(other max_steps, epochs, dataset size, lr, ...); the change is printed")
@click.option("--verify-data", is_flag=True, help="the gate also hashes every shard and the checkpoint to resume "
              "against their recorded sha256 (reads every byte)")
@click.option("--init-from", type=click.Path(path_type=Path), help="start from the weights of an exported DFlash "
              "drafter folder (ours or the public layout); its shape must match the run's drafter")
@click.option("--report-to", multiple=True, metavar="TRACKER", help="also send every metrics row to tensorboard, "
              "wandb or trackio (repeat or comma-separate; each is imported only when asked)")
def train_command(config_path, demo, resume, fresh, sets, max_steps, output_dir, target_gpus, drafter_gpus,
               colocated_gpus, waive, reason, warm_cache, check_artifact, no_progress, allow_schedule_change, verify_data,
               init_from, report_to) -> None:
    """Train a DFlash drafter against a frozen target; refuses to start unless preflight passes.

    Exit codes: 0 finished, 1 failed or refused by the gate, 2 bad input, 75 stopped by a signal after a checkpoint.
    """
    if check_artifact is not None:
        from dflash.train.compile_cache import main_check
        from dflash.train.trainer import Trainer

        sys.exit(main_check(str(check_artifact), Trainer.colocated))
    if demo:
        from dflash.commands.demo import run_demo

        sys.exit(run_demo())
    if config_path is None:
        raise click.UsageError("give --config RUN.toml (see configs/), or --demo")
    if resume is not None and not resume.strip():
        raise click.UsageError("--resume needs `latest` or a checkpoint folder")
    overrides = parse_overrides(sets)
    if max_steps:
        overrides.put("train.max_steps", max_steps, f"--max-steps {max_steps}")
    if output_dir is not None:
        overrides.put("output_dir", output_dir, f"--output-dir {output_dir!r}")
    overrides.merge(gpu_overrides(target_gpus, drafter_gpus, colocated_gpus))
    if init_from is not None:
        if resume:
            raise click.UsageError("--init-from starts a fresh run from a drafter's weights; --resume continues a "
                                   "checkpoint's: give one of them")
        from dflash.train.warmstart import read_init_config

        read_init_config(init_from)  # a folder that is no drafter is one line, before anything loads
        overrides.put("init_from", str(init_from), f"--init-from {init_from}")
    if report_to:
        overrides.put("report_to", _trackers(report_to), f"--report-to {','.join(report_to)}")
    cfg = load_config(config_path, overrides)
    if cfg.report_to:
        from dflash.train.trackers import check_available

        check_available(cfg.report_to)  # a missing package: one line, exit 2, before the gate
    waivers = parse_waivers(waive, reason)  # before the run dir is touched (--fresh moves checkpoints aside)

    from preflight.gate import apply_profile_env, resolve_compile_cache

    apply_profile_env(cfg.profile, log=click.echo)
    cfg = resolve_compile_cache(cfg)  # train.compile_cache: the carried file, or the profile's default for this run
    if warm_cache:
        import torch

        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise NoGpuError(f"--warm-cache: {config_path} says device = \"cuda\" but torch sees no GPU (torch "
                             f"{torch.__version__}, CUDA {torch.version.cuda or 'none'}); run it on the training "
                             "machine, where the cache is used")
        from dflash.train.compile_cache import warm_cache as do_warm
        from dflash.train.trainer import Trainer

        check = [sys.executable, "-m", "dflash.commands.train", "--check-artifact"]
        sys.exit(do_warm(cfg, Trainer.colocated, check, log=click.echo))
    from dflash.runs import rundir
    from dflash.runs.lock import lock_run_dir
    from dflash.runs.resume import make_room, prepare_output_dir

    intent = "resume" if resume else "fresh" if fresh else None
    # A run dir that cannot be written is left as it is and reported by the gate (run-dir / disk), one line each.
    unusable = rundir.write_problem(cfg.output_dir)
    resume_from = None
    lock = None
    try:
        if unusable is None:
            try:
                # one trainer per run dir: taken before the resume/fresh rule looks at it, held until this returns
                lock = lock_run_dir(cfg.output_dir, log=click.echo)
                resume_from = prepare_output_dir(cfg, resume, fresh, log=click.echo,
                                                 allow_schedule_change=allow_schedule_change, apply=False)
            except OSError as e:  # the disk filled or the dir turned read-only between the look and the write
                unusable = f"{e.filename or cfg.output_dir}: {e.strerror or e}"
        gate = _gate(cfg, waivers, intent, verify_data, config_path)
        if not gate.ok:
            sys.exit(1)  # refused: nothing in the run dir was moved (--fresh moves old checkpoints only after this)
        if unusable:  # the gate's run-dir check was waived
            raise rundir.RunDirError(f"output dir {cfg.output_dir}: {unusable}; set output_dir to a writable folder "
                                     "with free space")
        make_room(cfg, resume_from, fresh, log=click.echo)
        rundir.clear_stopped(cfg.output_dir)
        if cfg.topology.layout != "colocated":  # split or co-located data parallel: one process per GPU
            from dflash.commands import torchrun as rank_entry
            from dflash.train.launch import launch

            with rundir.io_errors_in_one_line(cfg.output_dir):
                code = launch(cfg, resume_from, gate.report.run["gate_id"], rank_entry.__name__, lock=lock)
        else:
            from dflash.train.trainer import run
            from preflight.gate import provenance

            code = run(cfg, resume_from, progress=False if no_progress else None, provenance=provenance(cfg.profile),
                       preflight_s=gate.report.host.get("preflight_seconds"))
        if code == 0 and rundir.read_stopped(cfg.output_dir):
            code = rundir.EXIT_STOPPED  # stopped by a signal after a checkpoint: unfinished, resumable
            for sig in (signal.SIGINT, signal.SIGTERM):  # a late duplicate of the stop's signal must not turn 75
                signal.signal(sig, signal.SIG_IGN)       # into a kill while the interpreter shuts down
    finally:
        if lock is not None:
            lock.release()
    sys.exit(code)


def _trackers(values: tuple[str, ...]) -> list[str]:
    from dflash.config import TRACKERS

    names = [v.strip() for value in values for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in TRACKERS]
    if bad or not names:
        raise click.UsageError(f"--report-to {','.join(bad) or repr(values[0] if values else '')}: unknown tracker; "
                               f"give {', '.join(TRACKERS)} (several allowed)")
    return list(dict.fromkeys(names))


def train_main(argv: list[str] | None = None) -> None:
    """dflash-train: user errors are one line (`dflash-train: error: ...`), never a traceback."""
    run_cli(train_command, "dflash-train", argv)


if __name__ == "__main__":
    train_main()
