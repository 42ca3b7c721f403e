"""A run's metrics.jsonl, torch-free: which rows a reader can trust, and what a resume moves aside.

One JSON object per logged step; lines end at "\\n" only. A torn last line (a kill mid-write) or a malformed row is
counted, never raised.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from dflash.data.jsonl import JsonLineError, decode_json, text_lines
from dflash.runs.rundir import METRICS_ABANDONED_STEM, METRICS_NAME, aside_path

MAX_STEP = 1 << 53  # a step beyond this is not one a run logged (floats stop counting exactly)
GPU_MAP_KEYS = ("nvml_used_gib",)  # {GPU name: GiB}
LIST_KEYS = ("acc_slot", "heldout_acc_slot")  # per-slot numbers


@dataclass
class Metrics:
    """The rows of a metrics.jsonl that a reader can trust, and what was left out of it."""

    rows: list[dict] = field(default_factory=list)
    torn: int = 0  # a last line cut by a kill (no line end, not JSON)
    bad: int = 0  # rows skipped: not JSON, not an object, no integer step, a malformed known key
    first_bad: str | None = None  # "line L, reason"

    def note(self, path: str | Path) -> str | None:
        """'skipped N bad metrics rows in FILE (first: line L, reason)', or None when every row was good."""
        if not self.bad:
            return None
        return f"skipped {self.bad} bad metrics row(s) in {path} (first: {self.first_bad})"


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def metrics_row_problem(row: object) -> str | None:
    """Why a decoded metrics row cannot be used (one short reason), or None. Values of other keys may be anything;
    readers take the finite numbers among them."""
    if not isinstance(row, dict):
        return f"a {type(row).__name__}, not a JSON object"
    step = row.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        return f"step {_shown(step)} is not an integer in 0..2^53"
    for key in GPU_MAP_KEYS:
        v = row.get(key)
        if v is not None and not (isinstance(v, dict) and all(_number(x) for x in v.values())):
            return f"{key} {_shown(v)} is not {{GPU: GiB}} with finite numbers"
    for key in LIST_KEYS:
        v = row.get(key)
        if v is not None and not (isinstance(v, list) and all(_number(x) for x in v)):
            return f"{key} {_shown(v)} is not a list of finite numbers"
    return None


def _shown(v) -> str:
    text = json.dumps(v) if not isinstance(v, float) else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def read_metrics(output_dir: str | Path) -> Metrics:
    """Every good row of a run's metrics.jsonl (lines end at "\\n" only); the rest counted, never raised."""
    out = Metrics()
    path = Path(output_dir) / METRICS_NAME
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return out
    lines = list(text_lines(text))
    for lineno, line in lines:
        if not line.strip():
            continue
        try:
            row = decode_json(line)
        except JsonLineError as e:
            if lineno == len(lines) and not text.endswith("\n"):
                out.torn += 1  # a line cut by a kill
                continue
            row, why = None, f"not JSON ({e})"
        else:
            why = metrics_row_problem(row)
        if why is None:
            out.rows.append(row)
            continue
        out.bad += 1
        out.first_bad = out.first_bad or f"line {lineno}, {why}"
    return out


def trim_metrics(out: Path, step: int, log=print) -> None:
    """Rows logged after the resumed step (the interrupted run's) move to metrics.abandoned-*.jsonl,
    so metrics.jsonl holds each step once after the resume."""
    path = Path(out) / METRICS_NAME
    if not path.is_file():
        return
    keep, later = [], []
    pieces = path.read_bytes().decode("utf-8", errors="replace").split("\n")  # lines end at "\\n" only
    for line in [p + "\n" for p in pieces[:-1]] + [pieces[-1]] * bool(pieces[-1]):
        try:
            row = decode_json(line)
        except JsonLineError:
            row = None  # a torn last line of a killed run, a bad row: keep it where it was logged
        row_step = row["step"] if metrics_row_problem(row) is None else 0
        (later if row_step > step else keep).append(line)
    if not later:
        return
    aside = Path(out) / f"{aside_path(Path(out), METRICS_ABANDONED_STEM).name}.jsonl"
    aside.write_text("".join(later))
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(keep))
    tmp.replace(path)
    log(f"--resume: {len(later)} metrics row(s) after step {step} moved to {aside.name}")
