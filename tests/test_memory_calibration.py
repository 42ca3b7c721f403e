"""The memory model against measured H200 peaks (tests/data/memory_calibration.json).

The file comes from `bench/memory_calibration.py` on a GPU (command, versions and GPU inside);
the committed Calibration defaults in dflash/memory.py were fitted to it. Nothing is fitted
here beyond checking that the committed constants are still that fit. A measurement taken under
torch's default allocator is left out where the same configuration was re-measured with the
allocator settings the trainer runs with (expandable segments): `current_measurements`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash.memory.calibration import current_measurements, fit_calibration, prediction_errors
from dflash.memory.parts import DEFAULT_CALIBRATION

DATA = Path(__file__).resolve().parent / "data" / "memory_calibration.json"


def _measurements() -> list[dict]:
    if not DATA.is_file():
        pytest.skip(
            f"{DATA.name} not committed yet: run bench/memory_calibration.py on an H200 and copy its output there"
        )
    doc = json.loads(DATA.read_text())
    ms, _superseded = current_measurements([m for m in doc["measurements"] if m.get("ok") and m.get("nvml_used_bytes")])
    if not ms:
        pytest.skip(f"{DATA.name} holds no successful GPU measurement")
    return ms


def test_file_says_how_it_was_made():
    doc = json.loads(DATA.read_text()) if DATA.is_file() else pytest.skip(f"{DATA.name} not committed yet")
    assert "memory_calibration.py" in doc["command"]
    assert doc["env"]["torch"] and doc["env"]["cuda"] and doc["env"]["gpu"]


def test_every_nvml_peak_is_predicted_within_10_percent():
    ms = _measurements()
    errs = prediction_errors(ms, DEFAULT_CALIBRATION)
    table = "\n".join(f"{m['name']:<32} {m['role']:<8} measured {m['nvml_used_bytes'] / 2**30:7.2f} GiB  error {e:+.1%}"
                      for m, e in zip(ms, errs))
    assert max(abs(e) for e in errs) <= 0.10, f"prediction errors beyond ±10%:\n{table}"


def test_committed_constants_are_the_fit_of_the_file():
    ms = _measurements()
    fitted = fit_calibration(ms)
    for major, gib in fitted.cuda_context_gib.items():
        assert DEFAULT_CALIBRATION.cuda_context_gib[major] == pytest.approx(gib, abs=0.02), major
    assert DEFAULT_CALIBRATION.target_activation_scale == pytest.approx(fitted.target_activation_scale, rel=0.02)
    assert DEFAULT_CALIBRATION.drafter_activation_scale == pytest.approx(fitted.drafter_activation_scale, rel=0.02)


def test_the_superseded_measurements_are_only_default_allocator_repeats():
    doc = json.loads(DATA.read_text()) if DATA.is_file() else pytest.skip(f"{DATA.name} not committed yet")
    used, superseded = current_measurements([m for m in doc["measurements"] if m.get("ok")])
    assert len(used) + len(superseded) == len([m for m in doc["measurements"] if m.get("ok")])
    for m in superseded:
        assert not m.get("alloc_conf")
        assert any(u["name"] == m["name"] and u["role"] == m["role"] and u.get("alloc_conf") for u in used)

