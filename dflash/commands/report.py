"""dflash-report: HTML + PNGs of a run (two run dirs: overlaid curves).

    uv run dflash-report runs/demo
"""

from __future__ import annotations

from pathlib import Path

import click

from dflash.commands.common import CONTEXT
from dflash.errors import Command, run_cli


@click.command(cls=Command, context_settings=CONTEXT)
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="folder for report.html and the PNGs (default: <first run dir>/report)")
def report_command(run_dirs, out) -> None:
    """One self-contained HTML page (plots embedded) and PNGs of a run dir; two run dirs overlay their curves.

    Works on a finished, a running and a crashed run.
    """
    from dflash.runs.html_report import write_report

    page = write_report(list(run_dirs), out, log=click.echo)
    click.echo(f"report: {page}")


def report_main(argv: list[str] | None = None) -> None:
    run_cli(report_command, "dflash-report", argv)
