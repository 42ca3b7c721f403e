"""dflash-lock: write, check and compare the committed, host-free profile locks.

    uv run dflash-lock write                      # re-resolve (exclude-newer) and re-export envs/*.lock
    uv run dflash-lock check [--json]             # CI: locks current, host-free, CUDA-consistent
    uv run dflash-lock diff train-cu128 infer-cu130

uv.lock records index and artifact URLs, so it is generated and git-ignored; the reviewed,
committed lock of each profile is `uv export` of its groups with hashes and no URL.
This module only formats: what is wrong with a lock, and how to rewrite it, is decided in
``preflight.lockfile``.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from dflash.errors import run_cli
from preflight.lockfile import LockToolError, check_all, diff_locks, is_gpu_stack, parse_lock, write_locks
from preflight.profiles import ENVS_DIR, ProfileError, load_profile, profile_names


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def command() -> None:
    """Write, check and compare the committed, host-free profile locks (envs/<profile>.lock)."""


@command.command()
def write() -> None:
    """Re-resolve (uv lock, honoring exclude-newer) and re-export every envs/<profile>.lock."""
    try:
        written = write_locks()
    except (LockToolError, ProfileError) as e:
        raise click.ClickException(str(e)) from None
    for name, lock in written:
        click.echo(f"wrote envs/{name}.lock ({len(lock.all_pins)} pins, torch {lock.version('torch')})")


@command.command()
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--no-export", is_flag=True, help="skip the comparison with a fresh export (no uv needed)")
@click.option("--envs-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=ENVS_DIR,
              show_default="envs/", help="folder of profile manifests and locks")
def check(as_json: bool, no_export: bool, envs_dir: Path) -> int:
    """Fail (exit 1, one line per problem) unless every lock is current, host-free and consistent."""
    problems = check_all(envs_dir, fresh=not no_export)
    if as_json:
        click.echo(json.dumps({"ok": not problems, "profiles": profile_names(envs_dir),
                               "problems": [p.__dict__ for p in problems]}))
    else:
        for p in problems:
            click.echo(f"{p.profile}: {p.kind}: {p.message}")
        if not problems:
            click.echo(f"ok: {', '.join(profile_names(envs_dir))} locks are current, host-free and CUDA-consistent")
    return 1 if problems else 0


@command.command()
@click.argument("a")
@click.argument("b")
def diff(a: str, b: str) -> None:
    """Packages whose versions differ between profiles A and B, torch/CUDA/triton stack first."""
    locks = []
    for name in (a, b):
        try:
            load_profile(name)
        except ProfileError as e:
            raise click.UsageError(str(e)) from None
        path = ENVS_DIR / f"{name}.lock"
        if not path.exists():
            raise click.UsageError(f"envs/{name}.lock missing; run `uv run dflash-lock write`")
        locks.append(parse_lock(path.read_text(encoding="utf-8", errors="replace")))
    rows = diff_locks(*locks)
    width = max([len(r[0]) for r in rows] + [7])
    click.echo(f"{'package':<{width}}  {a:<16}  {b}")
    for pkg, va, vb in rows:
        mark = "*" if is_gpu_stack(pkg) else " "
        click.echo(f"{pkg:<{width}}  {va or '-':<16}  {vb or '-'}  {mark}".rstrip())
    click.echo(f"{len(rows)} packages differ; * = GPU stack (torch, triton, CUDA libraries, kernels)")


def main(argv: list[str] | None = None) -> None:
    """Console entry point: exit 0 ok, 1 a lock problem or a failing uv, 2 usage; errors are one line."""
    run_cli(command, "dflash-lock", argv)


if __name__ == "__main__":
    main()
