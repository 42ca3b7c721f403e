"""Preflight checks as pure functions: feed facts, assert verdicts; what holds for every check (the registry).

Each check's own tests live beside it: test_preflight_checks_<module>.py for preflight/checks/<module>.py, on
the machine tests/preflight_ctx.py builds.
"""

from __future__ import annotations

import json

import pytest

from preflight.checks.registry import CHECK_IDS, CHECKS, NEEDS_CONFIG, run_checks
from preflight_ctx import by_id, make_ctx


def test_healthy_machine_passes_every_check(tmp_path):
    results = run_checks(make_ctx(tmp_path))
    assert [r.id for r in results] == list(CHECK_IDS)
    assert {r.id: r.status for r in results} == {i: "pass" for i in CHECK_IDS}
    assert all(r.fix is None for r in results)


def test_without_config_run_checks_skip_and_say_so(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.config = None
    results = run_checks(ctx)
    skipped = [r.id for r in results if r.status == "skip"]
    assert skipped == list(NEEDS_CONFIG) == ["gpu-memory", "gpu-processes", "compile-cache", "config", "run-dir",
                                            "dataset", "disk"]
    assert all("--config" in by_id(results, i).summary for i in NEEDS_CONFIG)
    assert by_id(results, "gpu-visibility").status == "pass"  # still proves NVML is reachable


def test_crashing_check_becomes_a_failure_not_a_traceback(tmp_path, monkeypatch):
    def boom(ctx):
        raise KeyError("x")

    monkeypatch.setitem(CHECKS, "disk", boom)
    r = by_id(run_checks(make_ctx(tmp_path)), "disk")
    assert r.status == "fail" and "check crashed: KeyError" in r.summary


@pytest.mark.parametrize("check_id", CHECK_IDS)
def test_every_check_result_validates_as_report_schema(tmp_path, check_id):
    r = CHECKS[check_id](make_ctx(tmp_path))
    assert r.id == check_id
    json.dumps(r.model_dump())  # data is JSON-serialisable
