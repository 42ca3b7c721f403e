"""Golden losses: the tiny preset's first 12 steps must not move under a refactor.

A change that alters the math on purpose regenerates the file:
    uv run pytest tests/test_golden.py --update-golden
and says why in its commit message.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash.train.trainer import run
from trainkit import tiny_config

GOLDEN = Path(__file__).parent / "data" / "golden_tiny_loss.json"


def test_tiny_preset_losses_match_golden(tmp_path, request):
    cfg, _ = tiny_config(tmp_path, max_steps=12, save_every=100)
    run(cfg, None, log=lambda *_: None, progress=False)
    rows = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    losses = [round(r["loss"], 6) for r in rows]
    doc = json.loads(GOLDEN.read_text())
    if request.config.getoption("--update-golden"):
        doc["losses"] = losses
        GOLDEN.write_text(json.dumps(doc, indent=2) + "\n")
        pytest.skip("golden file rewritten")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, doc["losses"]))
    assert len(losses) == len(doc["losses"]) and worst <= doc["tolerance_rel"], (
        f"losses moved (max relative difference {worst:.2e}):\n got    {losses}\n golden {doc['losses']}")
