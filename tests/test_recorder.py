"""The training loop's bookkeeping (dflash.train.recorder) on a stand-in trainer: no model, no steps."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dflash.runs import rundir
from dflash.train.recorder import Recorder


@pytest.fixture
def recorder(tmp_path):
    """A logging rank's recorder of a 4-step run, its lines in .lines; one background save finishes before step 2."""
    finished = [[], [{"save_write_s": 0.5}]]
    lines = []
    trainer = SimpleNamespace(cfg=SimpleNamespace(report_to=[], model_dump=dict), out=tmp_path, step=0, total_steps=4,
                              log=lines.append, is_logger=True, source=SimpleNamespace(rates_line=lambda rec: ""),
                              writer=SimpleNamespace(written=lambda: finished.pop(0) if finished else []),
                              stop_estimate_s=None, stop_measured=False, device=torch.device("cpu"))
    rec = Recorder(trainer, progress=False)
    rec.lines = lines
    yield rec
    rec.close()


def _row(step: int) -> dict:
    return {"loss": 1.0 / step, "accept_len": 1.5, "tok_per_s": 100.0, "lr": 1e-4, "step": step, "epoch": 0}


def test_the_window_restarts_only_where_every_rank_made_a_row(recorder, tmp_path):
    """A save's row on the logger alone keeps the tok/s window going; a row of every rank restarts it. Every row
    reaches metrics.jsonl, outcome.json and a step line, with the save that finished since the last row; the
    first window's rows (compilation included) stay out of the steady rows. The batches trained follow the window."""
    t0 = recorder.window["t0"]
    recorder.count([(0, {"lengths": np.array([3, 5]), "sample_ids": np.array([7, 2])})])
    recorder.end_window(every_rank=False)
    recorder.record({"step": 1, "epoch": 0, "save_stall_s": 0.1})
    assert recorder.window == {"t0": t0, "tokens": 8, "batches": [[0, [7, 2]]]}
    for step in (2, 3):
        recorder.count([(step - 1, {"lengths": np.array([4]), "sample_ids": np.array([step])})])
        assert recorder.batches_so_far() == ([[0, [7, 2]], [1, [2]]] if step == 2 else [[2, [3]]])
        recorder.end_window(every_rank=True)
        recorder.record(_row(step))
        assert recorder.window["tokens"] == 0 and recorder.window["t0"] > t0 and recorder.batches_so_far() == []
    recorder.close()
    rows = [json.loads(line) for line in (tmp_path / rundir.METRICS_NAME).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[1]["save_write_s"] == 0.5 and "save_write_s" not in rows[2]
    assert [r["step"] for r in recorder.steady_rows] == [3]
    assert recorder.lines == ["step 1/4", "step 2/4 loss 0.5000 accept 1.500 tok/s 100 lr 1.00e-04",
                              "step 3/4 loss 0.3333 accept 1.500 tok/s 100 lr 1.00e-04"]
    outcome = json.loads((tmp_path / "outcome.json").read_text())
    assert outcome["rows"] == 3 and outcome["step"] == 3 and outcome["last"] == {"loss": 1 / 3, "accept_len": 1.5}


def test_the_first_step_and_a_crash_are_recorded(recorder, tmp_path):
    """The first step's seconds and graphs in two lines and outcome.json, its startup phases completed; an
    interrupt leaving the loop ends outcome.json as interrupted and leaves its error in the running marker."""
    startup = {"setup_s": 1.0}
    recorder.first_step(startup, graphs=3)
    assert recorder.lines[0].startswith("first step: ") and recorder.lines[0].endswith(
        " s (compilation included); 3 compiled graph(s)")
    assert recorder.lines[1].startswith("startup: ") and set(startup) == {"setup_s", "first_step_s",
                                                                         "launch_to_first_step_s"}
    recorder.crashed(KeyboardInterrupt("by a test"), step=1)
    outcome = json.loads((tmp_path / "outcome.json").read_text())
    assert outcome["compiled_graphs"]["first_step"] == 3 and outcome["startup"]["setup_s"] == 1.0
    assert outcome["ended"]["how"] == "interrupted" and outcome["ended"]["detail"] == "KeyboardInterrupt: by a test"
    assert rundir.read_running(tmp_path)["error"] == "by a test"


def test_the_first_step_says_where_compilation_went(recorder, tmp_path):
    """Once torch.compile has built a graph in this process, the first step's report adds torch's compile seconds by
    phase (the cold start's table): one line and outcome.json's startup.compile, whose phases add up to its total."""
    import torch

    from dflash.runs.records import COMPILE_PHASES, checked_outcome
    from dflash.train.compiled import compile_phases

    torch._dynamo.reset()
    torch.compile(lambda x: (x * 2).sum(), backend="eager")(torch.ones(3))
    phases = compile_phases()
    assert phases["frames"] and phases["total_s"] >= 0 and phases["inductor_s"] == phases["cache_load_s"] == 0
    startup = {"setup_s": 1.0}
    recorder.first_step(startup, graphs=1)
    assert recorder.lines[2].startswith("compile: ") and " frame(s)): dynamo " in recorder.lines[2], recorder.lines
    outcome = json.loads((tmp_path / "outcome.json").read_text())
    assert set(outcome["compile"]) == {"frames", *COMPILE_PHASES} and "compile" not in outcome["startup"]
    assert checked_outcome(outcome, "outcome.json")["compile"] == outcome["compile"]  # as dflash-diff reads it


def test_the_first_whole_save_corrects_the_stop_estimate(recorder):
    """The first step's stop estimate comes from a small probe file; the first save's measured write replaces it in
    one line when 20% or more off, once."""
    recorder.trainer.stop_estimate_s = 6.0
    recorder.trainer.writer.written = lambda: [{"save_step": 60, "save_write_s": 12.859}]
    recorder.record(_row(1))
    recorder.record(_row(2))
    said = [line for line in recorder.lines if line.startswith("a stop: ")]
    assert said == ["a stop: the save at step 60 took 12.9 s to write (the first step estimated 6 s): a stop takes "
                    "about 13 s after the step in flight; set the scheduler's kill grace above that plus a step"]
