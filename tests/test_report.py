"""dflash-report on a finished run, a running one and one killed mid-run (a real process, SIGKILL)."""

from __future__ import annotations

import html
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.commands.report import report_main
from dflash.config import config_from_dict
from dflash.runs.html_report import PLOTS
from dflash.train.trainer import run
from trainkit import tiny_config, write_toml

REPO = Path(__file__).resolve().parent.parent


def report(capsys, *argv: str) -> tuple[Path, str]:
    with pytest.raises(SystemExit) as e:
        report_main(list(argv))
    out = capsys.readouterr()
    assert e.value.code == 0, out.err
    page = Path(out.out.strip().removeprefix("report: "))
    return page, page.read_text()


def assert_complete(page: Path, text: str) -> None:
    """Every listed plot is in the page, embedded (nothing fetched: it opens offline), and beside it as a PNG."""
    for stem, title in PLOTS:
        assert f"id='{stem}'" in text and html.escape(title) in text
        assert (page.parent / f"{stem}.png").stat().st_size > 1000
    assert len(re.findall(r"src='data:image/png;base64,", text)) == len(PLOTS)
    assert "http://" not in text and "https://" not in text


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("finished")
    _, raw = tiny_config(root, max_steps=6, save_every=100)
    raw["eval"] = {"holdout": 8, "every": 3, "real_prompts": 1, "max_new_tokens": 4, "ddtree_budget": 4}
    cfg = config_from_dict(raw)
    assert run(cfg, None, log=lambda *_: None, progress=False) == 0
    return Path(cfg.output_dir)


def test_report_of_a_finished_run(finished, capsys):
    page, text = report(capsys, str(finished))
    assert page == finished / "report" / "report.html"
    assert_complete(page, text)
    assert "finished at step 6" in text and "8 samples of" in text
    assert "no GPU memory data: a CPU run" not in text  # said inside the PNG, not as a failure
    assert "co-located on cpu" in text
    assert "last heldout_ddtree_accept_len" in text and "LOSSLESS CHECK" not in text


def test_report_of_a_running_then_killed_run_and_two_runs_overlaid(finished, tmp_path, capsys):
    cfg, raw = tiny_config(tmp_path, max_steps=5000, save_every=5)
    config = write_toml(raw, tmp_path / "run.toml")
    cmd = [sys.executable, "-m", "dflash.commands.train", "--config", str(config), "--no-progress", "--fresh",
           "--waive", "model-source", "--reason", "tests run on a working tree"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_dir = Path(cfg.output_dir)
    metrics = run_dir / "metrics.jsonl"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None
            time.sleep(0.05)
        page, text = report(capsys, str(run_dir))
        assert_complete(page, text)
        assert f"running (pid {proc.pid})" in text
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with metrics.open("a") as f:
        f.write('{"step": 99, "loss": 1.')  # a line torn by the kill
    page, text = report(capsys, str(run_dir))
    assert_complete(page, text)
    assert "killed or crashed at step" in text and "1 torn line(s) skipped" in text

    page, text = report(capsys, str(finished), str(run_dir), "--out", str(tmp_path / "compare"))
    assert page == tmp_path / "compare" / "report.html"
    assert_complete(page, text)
    assert "finished at step 6" in text and "killed or crashed" in text


def test_report_of_a_non_run_dir_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        report_main([str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "not a run dir" in err


@pytest.mark.parametrize("topology, says", [
    ({}, "co-located on cuda"),
    ({"target_gpus": ["0", "1"], "drafter_gpus": ["2"]}, "split: target GPUs 0,1, drafter GPUs 2"),
    ({"colocated_gpus": ["0", "1"]}, "co-located data parallel: GPUs 0,1, each target + drafter replica"),
    ({"target_gpus": ["0"], "colocated_gpus": ["1"]}, "unknown (the run's topology does not validate)"),
])
def test_the_layout_line_asks_the_topology_rule(topology, says):
    from dflash.runs.html_report import layout_line

    assert layout_line({"device": "cuda", "topology": topology}) == says
