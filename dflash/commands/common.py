"""What the command modules share: click's help options, --waive/--reason pairs, the GPU-list flags.
"""

from __future__ import annotations

import click

from dflash.config import Overrides

CONTEXT = {"help_option_names": ["-h", "--help"]}


def parse_waivers(waive: tuple[str, ...], reason: tuple[str, ...]) -> dict[str, str]:
    """--waive/--reason pairs, checked (known check id, non-empty reason) before anything is touched or loaded."""
    from preflight.gate import validate_waivers

    if len(waive) != len(reason):
        raise click.UsageError("give one --reason for each --waive (e.g. --waive env-drift --reason 'device image')")
    return validate_waivers(dict(zip(waive, reason)))


def _gpu_list(flag: str, text: str | None) -> list[str] | None:
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise click.UsageError(f"{flag} {text!r}: the GPU list is empty; give GPUs, e.g. --target-gpus 0,1 "
                               "--drafter-gpus 2 or --colocated-gpus 0,1,2,3")
    return items


def gpu_overrides(target_gpus: str | None, drafter_gpus: str | None, colocated_gpus: str | None) -> Overrides:
    """--target-gpus / --drafter-gpus / --colocated-gpus as config overrides that replace the preset's layout: a split
    list given clears topology.colocated_gpus, --colocated-gpus clears both split lists (a list not given keeps the
    config's, beside the other split list). The one reading every command with these flags uses."""
    split = {"target_gpus": _gpu_list("--target-gpus", target_gpus),
             "drafter_gpus": _gpu_list("--drafter-gpus", drafter_gpus)}
    colocated = _gpu_list("--colocated-gpus", colocated_gpus)
    given = {k: v for k, v in split.items() if v is not None}
    if colocated is not None and given:
        raise click.UsageError("--colocated-gpus gives every GPU both roles, --target-gpus/--drafter-gpus split them: "
                               "give one layout")
    out = Overrides()
    if colocated is not None:
        how = f"--colocated-gpus {colocated_gpus}"
        for key, value in (("colocated_gpus", colocated), ("target_gpus", []), ("drafter_gpus", [])):
            out.put(f"topology.{key}", value, how)
    elif given:
        how = ", ".join(f"--{k.replace('_', '-')} {text}" for k, text in (("target_gpus", target_gpus),
                                                                           ("drafter_gpus", drafter_gpus)) if k in given)
        out.put("topology.colocated_gpus", [], how)
        for key, value in given.items():
            out.put(f"topology.{key}", value, how)
    return out


def gpu_options(command):
    """The three GPU-list options of a command that reads a run config (dflash-train, dflash-estimate)."""
    for option in reversed([
        click.option("--target-gpus", help="comma list of GPUs for the frozen target, e.g. 0,1,2,3,4 (replaces the "
                     "config's layout)"),
        click.option("--drafter-gpus", help="comma list of GPUs training the drafter, e.g. 5,6,7 (replaces the "
                     "config's layout)"),
        click.option("--colocated-gpus", help="comma list of GPUs each running a target + drafter replica (co-located "
                     "data parallel), e.g. 0,1,2,3,4,5,6,7 (replaces the config's layout)"),
    ]):
        command = option(command)
    return command
