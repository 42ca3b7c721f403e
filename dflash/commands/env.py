"""dflash-env: one environment per profile, built from its committed lock; run commands in it.

    uv run --isolated --no-default-groups dflash-env sync --profile infer-cu130   # works on a fresh clone
    dflash-env sync --profile train-cu128 --reinstall transformers                # repair an edited package
    dflash-env run --profile infer-cu130 -- dflash-data prepare --engine sglang ...
    dflash-env path --profile infer-cu130

Exit codes: 0 done, 1 a sync that failed or an environment not built yet, 2 usage, 127 a command not found;
`run` exits with its command's code (it replaces this process). ``preflight.envs`` decides; this only formats.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import click

from dflash.errors import run_cli
from preflight.envs import CommandNotFound, ProfileEnv, locate, require_built, run_environ, sync
from preflight.profiles import ENVS_DIR, profile_names

PROFILE = click.option("--profile", "profile_name", required=True, metavar="NAME", help="environment profile (envs/NAME.toml)")


def _locate(envs_dir: Path, name: str) -> ProfileEnv:
    if not (envs_dir / f"{name}.toml").is_file():
        raise click.UsageError(f"unknown profile {name!r} (known: {', '.join(profile_names(envs_dir)) or 'none'})")
    return locate(name, envs_dir)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--envs-dir", type=click.Path(file_okay=False, path_type=Path), default=ENVS_DIR, show_default="envs/",
              help="folder of profile manifests and locks; environments go beside it")
@click.pass_context
def command(ctx: click.Context, envs_dir: Path) -> None:
    """One environment per profile (.venv for uv's default groups, .venvs/NAME for the others), built from
    envs/NAME.lock alone; nothing done for one profile touches another's environment."""
    ctx.obj = envs_dir


@command.command(name="sync")
@PROFILE
@click.option("--python", metavar="VERSION|PATH", help="interpreter for a new environment (default: uv's choice for the project)")
@click.option("--reinstall", multiple=True, metavar="PACKAGE", help="reinstall this locked package even if its version matches "
              "(an edited file in it; repeatable)")
@click.pass_obj
def sync_cmd(envs_dir: Path, profile_name: str, python: str | None, reinstall: tuple[str, ...]) -> None:
    """Create or update the profile's environment: exactly its lock (hash-checked) plus this project, editable."""
    _locate(envs_dir, profile_name)
    result = sync(profile_name, envs_dir, python=python, reinstall=reinstall, log=lambda m: click.echo(m, err=True))
    env = result.env
    verb = "created" if result.created else "updated"
    again = f", reinstalled {', '.join(result.reinstalled)}" if result.reinstalled else ""
    again += f", re-copied {', '.join(result.recopied)} (not as installed)" if result.recopied else ""
    dists = f"{result.pins} distribution{'s' if result.pins != 1 else ''}"
    click.echo(f"{verb} {env.path} (profile {profile_name}, Python {result.python or '?'}): {dists} "
               f"from {envs_dir.name}/{env.lock.name}, each from a wheel hash-checked against it (now, or at an install "
               f"whose files and RECORD are unchanged), nothing else but the project{again} ({result.seconds:.1f} s)")


@command.command(name="run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@PROFILE
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- COMMAND [ARGS]...")
@click.pass_obj
def run_cmd(envs_dir: Path, profile_name: str, cmd: tuple[str, ...]) -> None:
    """Run COMMAND in the profile's environment (its bin first on PATH, other Python environments off PATH)."""
    env = require_built(_locate(envs_dir, profile_name))
    environ, dropped = run_environ(env, os.environ)
    launcher = os.path.realpath(Path(sys.prefix) / "bin")  # this command's own environment: no news to the user
    dropped = [d for d in dropped if os.path.realpath(d) != launcher]
    if dropped:
        click.echo(f"dflash-env: left out of PATH (other Python environments): {', '.join(dropped)}", err=True)
    exe = shutil.which(cmd[0], path=environ["PATH"])
    if exe is None:
        raise CommandNotFound(f"{cmd[0]}: not found on profile {profile_name}'s PATH (its bin dir: {env.bin})")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(exe, list(cmd), environ)


@command.command(name="path")
@PROFILE
@click.pass_obj
def path_cmd(envs_dir: Path, profile_name: str) -> None:
    """Print the profile's environment folder (exit 1 when it is not built yet)."""
    click.echo(require_built(_locate(envs_dir, profile_name)).path)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors are one line (`dflash-env: error: ...`), never a traceback."""
    run_cli(command, "dflash-env", argv)


if __name__ == "__main__":
    main()
