"""The env-vars check: the profile's variables and PATH (other Python environments on it)."""

from __future__ import annotations

import os

from preflight.checks.common import listing, result
from preflight.facts.context import Context
from preflight.report import CheckResult

# Variables newer torch reads before the one a profile sets: a value there decides, so it must agree.
READ_FIRST = {"PYTORCH_CUDA_ALLOC_CONF": "PYTORCH_ALLOC_CONF"}


# Commands named first when a foreign environment provides them: what a run starts by name.
KEY_COMMANDS = ("python", "python3", "pip", "pip3", "torchrun", "ninja", "nvcc", "ptxas", "gcc", "g++", "cc", "c++",
                "ld", "uv", "sglang", "hf", "huggingface-cli")


def _commands(names: list[str], limit: int = 4) -> str:
    key = [n for n in KEY_COMMANDS if n in names]
    ordered = key + [n for n in names if n not in key]
    return listing(ordered, limit)


def check_env_vars(ctx: Context) -> CheckResult:
    """The profile's variables (dflash-train sets the unset ones itself, so unset passes; a different value, here
    or in a variable torch reads first, fails) and PATH (other Python environments anywhere on it warn)."""
    p = ctx.profile
    wrong, will_set, overridden = [], [], []
    for key, want in sorted(p.env.items()):
        have = ctx.env.get(key)
        first = READ_FIRST.get(key)
        if first is not None and ctx.env.get(first) not in (None, want):
            overridden.append((first, ctx.env[first], key, want))
        if have is None:
            will_set.append((key, want))
        elif have != want:
            wrong.append((key, want, have))
    foreign, missing_dirs, self_at = _path_findings(ctx)
    data = dict(required=dict(p.env), wrong=[{"name": k, "expected": w, "actual": h} for k, w, h in wrong],
                will_set=[{"name": k, "value": w} for k, w in will_set],
                overridden=[{"name": f, "actual": v, "overrides": k, "expected": w} for f, v, k, w in overridden],
                path_missing=missing_dirs, path_other_envs=foreign, self_on_path=self_at is not None)
    if wrong or overridden:
        said = [f"{k}={h!r} (need {w!r}; dflash-train keeps a value you set)" for k, w, h in wrong]
        said += [f"{f}={v!r} overrides {k} (torch reads {f} first; need {w!r} or unset)" for f, v, k, w in overridden]
        fix = " ".join([*(f"export {k}={w};" for k, w, _ in wrong), *(f"unset {f};" for f, *_ in overridden)])
        return result("env-vars", "fail", f"profile {p.name}: {', '.join(said)}", fix.rstrip(";"), **data)
    notes = []
    if foreign:
        listed = [f"{e['path']} ({'ahead of' if e['ahead'] else 'after'} this environment; "
                  + (f"runs {_commands(e['commands'])}" if e["commands"] else "all its commands are found earlier")
                  + ")" for e in foreign]
        notes.append("PATH holds bin dirs of other Python environments; a command started by name that no earlier "
                     f"entry has runs from them: {listing(listed, 3)}")
    if missing_dirs:
        notes.append(f"PATH entries that do not exist: {listing(missing_dirs, 3)}")
    set_note = ", ".join(f"{k}={w}" for k, w in will_set)
    if notes:
        drop = {e["path"] for e in foreign}
        keep = [e.path for e in ctx.path_entries if e.exists and e.path not in drop]
        fix = f"export PATH={os.pathsep.join(keep)}  (`dflash-env run` runs a command with them off PATH)"
        if will_set:
            notes.append(f"dflash-train sets {set_note} (unset here)")
        return result("env-vars", "warn", "; ".join(notes), fix, **data)
    parts = [] if p.env else ["no variables required"]
    if len(p.env) > len(will_set):
        parts.append(f"{len(p.env) - len(will_set)} required variable(s) set")
    if will_set:
        parts.append(f"{', '.join(k for k, _ in will_set)} unset here: dflash-train sets {set_note} before torch loads")
    return result("env-vars", "pass", f"{'; '.join(parts)}; PATH clean ({len(ctx.path_entries)} entries)", **data)


def _path_findings(ctx: Context) -> tuple[list[dict], list[str], int | None]:
    """(other Python environments on PATH with what runs from each, missing PATH dirs, this env's position)."""
    self_at = next((i for i, e in enumerate(ctx.path_entries) if e.is_self), None)
    foreign = [{"path": e.path, "env": e.python_env, "ahead": self_at is None or i < self_at,
                "commands": e.commands[:50], "count": len(e.commands)}
               for i, e in enumerate(ctx.path_entries) if e.python_env and not e.is_self]
    for f in foreign:  # what a run starts by name first, the rest after
        key = [n for n in KEY_COMMANDS if n in f["commands"]]
        f["commands"] = key + [n for n in f["commands"] if n not in key]
    missing = [e.path for e in ctx.path_entries if not e.exists]
    return foreign, missing, self_at
