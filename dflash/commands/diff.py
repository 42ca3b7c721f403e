"""dflash-diff: what changed between the run that worked and this one?

    uv run dflash-diff runs/good runs/slow            # two run dirs (each holds snapshot.json, outcome.json)
    uv run dflash-diff --here runs/good               # this machine now against a past run; starts nothing
    uv run dflash-diff --json runs/good runs/slow     # one JSON object on stdout
    uv run dflash-diff runs/x                         # the run before this one in the same dir (a resume, --fresh)
    uv run dflash-diff runs/x/previous/20261129T101500Z-1a2b3c4d runs/x   # any earlier run of the same dir
    python3 -m dflash.commands.diff runs/good runs/slow   # on a machine without uv

Prints the differences grouped (environment, GPUs, code, compile cache, config, data, run), the
ones known to move memory or speed first, each with the memory model's predicted effect where it
has one, then the memory model's peak per role and the outcomes (tok/s, peak memory, how each
run ended). Exit codes: 0 nothing that matters differs, 1 something does, 2 bad input (one line).
Reads only: never imports torch, never writes to either run dir.
"""

from __future__ import annotations

import json
import os

import click

from dflash.errors import run_cli


def _label(where: str, snap: dict, outcome: dict | None) -> str:
    run = snap.get("run") or {}
    if run.get("here"):
        return f"this machine now ({run.get('time_utc')})"
    host = (snap.get("environment") or {}).get("host") or {}
    return f"{where} (started {run.get('time_utc')} on {host.get('hostname')})"


def render(diff, label_a: str, label_b: str) -> list[str]:
    """The text report of a preflight.diff.RunDiff."""
    lines = [f"A: {label_a}", f"B: {label_b}"]
    counted = diff.counted
    movers = [d for d in counted if d.moves]
    others = [d for d in counted if not d.moves]
    context = [d for d in diff.differences if not d.counts]
    if not counted:
        lines.append("no differences" + (f" ({len(context)} shown for context only)" if context else ""))
    else:
        lines.append(f"{len(counted)} difference(s), {len(movers)} known to move memory or speed:")
    width = max([len(d.group) for d in diff.differences] + [0])

    def row(d) -> str:
        return f"  {d.group:<{width}}  {d.text}" + (f"   [{d.effect}]" if d.effect else "")

    lines += [row(d) for d in movers]
    if others:
        lines.append("other differences:" if movers else "differences:")
        lines += [row(d) for d in others]
    if context:
        lines.append("for context (not counted):")
        lines += [row(d) for d in context]
    if diff.memory:
        lines.append("memory model, predicted peak per GPU (A -> B): " + "; ".join(diff.memory))
    if diff.outcome:
        lines.append("outcome (A -> B):")
        w = max(len(o.label) for o in diff.outcome)
        lines += [f"  {o.label:<{w}}  {o.text}" for o in diff.outcome]
    lines += [f"note: {n}" for n in diff.notes]
    return lines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("a", metavar="A")
@click.argument("b", metavar="[B]", required=False)
@click.option("--here", is_flag=True, help="compare run A with this machine now (gathers facts, starts nothing)")
@click.option("--json", "as_json", is_flag=True, help="print exactly one JSON object on stdout")
def command(a, b, here, as_json) -> int:
    """What differs between run dirs A and B (or, with --here, between run A and this machine now).

    With A alone: the run before A's in the same run dir (kept in A/previous/) against A's.
    """
    from dflash.config import ConfigError
    from dflash.runs.records import SnapshotError, load, previous_runs
    from preflight.diff import compare

    if here and b is not None:
        raise click.UsageError(f"give one run dir with --here (got {a} and {b}), or two run dirs without it")
    if not here and b is None:
        earlier = previous_runs(a) if os.path.isdir(a) else []
        if not earlier:
            load(a)  # a folder that is no run dir: that line, not a suggestion that fails the same way
            raise click.UsageError(f"{a} holds no earlier run (previous/); give two run dirs (dflash-diff {a} OTHER_RUN), "
                                   f"or compare with this machine: dflash-diff --here {a}")
        a, b = str(earlier[-1]), a
    snap_a, outcome_a, notes = load(a)
    if here:
        from preflight.snapshot import here as gather_here

        try:
            snap_b = gather_here(snap_a)
        except ConfigError as e:
            raise SnapshotError(f"{a}: its config does not validate in this version ({e.one_line()}); "
                                "compare it with another run dir instead") from None
        outcome_b = None
        label_b = _label("", snap_b, None)
    else:
        snap_b, outcome_b, more = load(b)
        notes += more
        label_b = _label(b, snap_b, outcome_b)
    diff = compare(snap_a, snap_b, outcome_a, outcome_b)
    diff.notes = notes + diff.notes
    label_a = _label(a, snap_a, outcome_a)
    if as_json:
        click.echo(json.dumps({"a": label_a, "b": label_b, **diff.to_dict()}, indent=1, default=str))
    else:
        click.echo("\n".join(render(diff, label_a, label_b)))
    return diff.exit_code


def main(argv: list[str] | None = None) -> None:
    """Console entry point: bad input is one line on stderr and exit 2, never a traceback."""
    run_cli(command, "dflash-diff", argv)


if __name__ == "__main__":
    main()
