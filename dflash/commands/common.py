"""What the command modules share: click's help options, --waive/--reason pairs, GPU lists.
"""

from __future__ import annotations

import click

CONTEXT = {"help_option_names": ["-h", "--help"]}


def parse_waivers(waive: tuple[str, ...], reason: tuple[str, ...]) -> dict[str, str]:
    """--waive/--reason pairs, checked (known check id, non-empty reason) before anything is touched or loaded."""
    from preflight.gate import validate_waivers

    if len(waive) != len(reason):
        raise click.UsageError("give one --reason for each --waive (e.g. --waive env-drift --reason 'device image')")
    return validate_waivers(dict(zip(waive, reason)))


def _gpu_list(text: str | None) -> list[str] | None:
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise click.UsageError("GPU list is empty; give e.g. --target-gpus 0,1 --drafter-gpus 2")
    return items
