"""The preflight report: typed check results, waivers, the JSON object and the human table.

JSON (``Report.to_json``) is exactly::

    {"profile": str, "ok": bool,
     "checks": [{"id": str, "status": "pass"|"warn"|"fail"|"skip"|"waived",
                 "summary": str, "fix": str|null, "data": {...}}],
     "host": {...}}

``ok`` is true when no check has status ``fail``. A waived check keeps its summary and fix;
``data.waiver`` holds ``{"reason": str, "status": <the status it would have had>}``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Status = Literal["pass", "warn", "fail", "skip", "waived"]


class CheckResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="stable check id, e.g. torch-build")
    status: Status
    summary: str = Field(description="one-sentence finding with measured and expected values")
    fix: str | None = Field(None, description="the command (or action) that fixes it; null when passing")
    data: dict[str, Any] = Field(default_factory=dict, description="measured values, machine-readable")


class Report(BaseModel):
    model_config = ConfigDict(extra="forbid")

    profile: str
    ok: bool
    checks: list[CheckResult]
    host: dict[str, Any] = Field(default_factory=dict)
    run: dict[str, Any] | None = Field(
        None, description="written by the gate before a run: gate_id, config_sha256, time, per-rank verdicts")

    @classmethod
    def build(cls, profile: str, checks: list[CheckResult], host: dict | None = None) -> Report:
        return cls(profile=profile, ok=not any(c.status == "fail" for c in checks), checks=checks, host=host or {})

    def by_id(self, check_id: str) -> CheckResult:
        return next(c for c in self.checks if c.id == check_id)

    def with_status(self, status: Status) -> list[CheckResult]:
        return [c for c in self.checks if c.status == status]

    def to_json(self, indent: int | None = None) -> str:
        return self.model_dump_json(indent=indent, exclude={"run"} if self.run is None else None)


def apply_waivers(checks: list[CheckResult], waivers: Mapping[str, str]) -> list[CheckResult]:
    """Turn waived fail/warn results into ``waived``, keeping their finding; record the reason on every waived id."""
    out = []
    for c in checks:
        reason = waivers.get(c.id)
        if reason is None:
            out.append(c)
            continue
        data = dict(c.data, waiver={"reason": reason, "status": c.status})
        status = "waived" if c.status in ("fail", "warn") else c.status
        out.append(c.model_copy(update={"status": status, "data": data}))
    return out


_LABEL = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "skip": "SKIP", "waived": "WAIVED"}
_COLOUR = {"pass": "green", "warn": "yellow", "fail": "red", "skip": "bright_black", "waived": "magenta"}


def use_colour(stream) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set."""
    return bool(getattr(stream, "isatty", lambda: False)()) and "NO_COLOR" not in os.environ


def render_text(report: Report, colour: bool = False) -> str:
    """One line per check (status, id, finding), the fix under anything not passing, then the verdict."""
    import click

    def paint(text: str, status: str, bold: bool = False) -> str:
        return click.style(text, fg=_COLOUR[status], bold=bold) if colour else text

    width = max([len(c.id) for c in report.checks] + [8])
    lines = []
    for c in report.checks:
        label = paint(f"{_LABEL[c.status]:<6}", c.status, bold=True)
        lines.append(f"{label} {c.id:<{width}}  {c.summary}")
        waiver = c.data.get("waiver")
        if waiver:
            lines.append(f"{'':6} {'':<{width}}  waived ({waiver['status']}): {waiver['reason']}")
        if c.fix and c.status != "pass":
            lines.append(f"{'':6} {'':<{width}}  fix: {c.fix}")
    lines.append(verdict(report, colour))
    return "\n".join(lines)


def verdict(report: Report, colour: bool = False) -> str:
    import click

    failed = [c.id for c in report.with_status("fail")]
    counts = {s: len(report.with_status(s)) for s in ("warn", "waived", "skip")}
    words = {"warn": ("warning", "warnings"), "waived": ("waived", "waived"), "skip": ("skipped", "skipped")}
    extra = ", ".join(f"{n} {words[s][n != 1]}" for s, n in counts.items() if n)
    extra = f" ({extra})" if extra else ""
    if failed:
        text = f"preflight {report.profile}: FAILED: {len(failed)} check(s) failed: {', '.join(failed)}{extra}"
        return click.style(text, fg="red", bold=True) if colour else text
    text = f"preflight {report.profile}: OK{extra}"
    return click.style(text, fg="green", bold=True) if colour else text
