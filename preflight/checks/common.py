"""What every check shares: the result constructor, sizes and listings in messages, and the fix commands that
run in the profile's environment."""

from __future__ import annotations

from preflight.envs import run_command, sync_command
from preflight.facts.context import Context
from preflight.report import CheckResult

GiB = 1024**3


MiB = 1024**2


def result(check_id: str, status: str, summary: str, fix: str | None = None, **data) -> CheckResult:
    return CheckResult(id=check_id, status=status, summary=summary, fix=fix if status != "pass" else None, data=data)


def gib(n: int | float) -> str:
    return f"{n / GiB:.1f} GiB"


def listing(items: list[str], limit: int = 4) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


def in_profile(ctx: Context, command: str) -> str:
    """`command` run in the profile's environment, as typed on any clone: `uv run` builds and uses uv's default
    environment (.venv); any other profile's environment is built from its lock first, then run in."""
    name = ctx.profile_name
    if ctx.env_identity is None or ctx.env_identity.default:
        return f"uv run {command}"
    return f"{sync_command(name)} && {run_command(name, command)}"


def preflight_command(ctx: Context) -> str:
    return f"dflash-preflight --profile {ctx.profile_name}" + (f" --config {ctx.config_path}" if ctx.config_path else "")


def wrong_env(ctx: Context) -> bool:
    return ctx.env_identity is not None and not ctx.env_identity.matches


def sync_fix(ctx: Context, reinstall: list[str] | tuple[str, ...] = ()) -> str:
    """Rebuild the profile's environment from its committed lock (works on a fresh clone: no uv.lock needed).
    When this interpreter is not that environment, the fix is to check the profile's own environment instead
    (building it first when it is not uv's default one)."""
    if wrong_env(ctx):
        return in_profile(ctx, preflight_command(ctx))
    return sync_command(ctx.profile_name, reinstall)


def config_arg(ctx: Context) -> str:
    return ctx.config_path or "RUN.toml"


def on_cpu(ctx: Context) -> bool:
    return ctx.config is not None and ctx.config.device == "cpu"


def no_shape(ctx: Context) -> str:
    """Why the target shape is missing: gather's reason, or a Context built without it."""
    return ctx.target_error or f"target shape of {ctx.config.target.path} was not gathered"
