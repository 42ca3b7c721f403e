"""The training loop's bookkeeping: what a run leaves for its reader while it trains.

On the rank that logs (rank 0 of the drafters): metrics.jsonl (one row per logged step), outcome.json
(dflash.runs.records.Outcome, for dflash-diff), the trackers of report_to (dflash.train.trackers), the step lines
or the progress bar, the first step's report and the running marker's error when the run dies. On every rank:
the tok/s window (tokens and seconds since the last row every rank made). The steady rows (past the first window,
which compiles) feed the source's summary at the end.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

from dflash.runs import rundir
from dflash.runs.records import Outcome, process_age_s
from dflash.train.trackers import Trackers

__all__ = ["Recorder", "startup_line"]

STEADY_ROWS = 100  # metrics rows kept for the source's summary at the end of the run


def startup_line(startup: dict) -> str:
    """'startup: 52.1 s from launch: imports and preflight 6.1 s (the gate 4.0 s), target 18.0 s, drafter, data and
    optimizer 2.3 s, first step 24.7 s'."""
    names = {"before_s": "imports and preflight", "target_s": "target", "setup_s": "drafter, data and optimizer",
             "first_step_s": "first step"}
    parts = [f"{label} {startup[k]:.1f} s" for k, label in names.items() if startup.get(k) is not None]
    if startup.get("preflight_s") is not None and startup.get("before_s") is not None:
        parts[0] += f" (the gate {startup['preflight_s']:.1f} s)"
    parts = ", ".join(parts)
    launch = startup.get("launch_to_first_step_s")
    return f"startup: {f'{launch:.1f} s from launch: ' if launch is not None else ''}{parts}"


class Recorder:
    """Opened by Trainer.run before its first step, closed in its `finally`."""

    def __init__(self, trainer, progress: bool | None):
        """`trainer`: the Trainer whose run this records; its cfg, out, step, total_steps, log, is_logger, source
        (the step line's rates) and writer (the background saves' timings) are read."""
        self.trainer, self.log, self.is_logger = trainer, trainer.log, trainer.is_logger
        cfg, out = trainer.cfg, trainer.out
        self.trackers = Trackers(cfg.report_to if self.is_logger else [], out, cfg.model_dump(), self.log)
        self.bar = self._bar(progress)
        self.metrics_file = (out / rundir.METRICS_NAME).open("a") if self.is_logger else None
        self.outcome = Outcome(out, trainer.step) if self.is_logger else None  # outcome.json, for dflash-diff
        self.steady_rows = []  # this process's metrics rows past the first window (which compiles): the summary's
        self.first_window = True
        self._restart: float | None = None
        self.new_window()

    def new_window(self, t0: float | None = None) -> None:
        """Start the tok/s window now (or at `t0`)."""
        self.window = {"t0": time.perf_counter() if t0 is None else t0, "tokens": 0, "batches": []}

    def window_so_far(self) -> tuple[float, int]:
        """(seconds, this rank's tokens) of the tok/s window up to now."""
        return time.perf_counter() - self.window["t0"], self.window["tokens"]

    def batches_so_far(self) -> list[list]:
        """[global batch index, its sample ids] of each batch this rank trained in the window up to now."""
        return list(self.window["batches"])

    def count(self, mine: list[tuple[int, dict]]) -> None:
        """The tokens and batches of this rank's part of the step just trained."""
        self.window["tokens"] += sum(int(b["lengths"].sum()) for _, b in mine)
        self.window["batches"] += [[k, [int(i) for i in b["sample_ids"].tolist()]] for k, b in mine]

    def first_step(self, startup: dict, graphs: int) -> None:
        """The first step's report: its seconds since the window opened (compilation included), the startup line
        and outcome.json's first_step; `startup` gains first_step_s and launch_to_first_step_s."""
        self.first_step_s = time.perf_counter() - self.window["t0"]
        self.log(f"first step: {self.first_step_s:.1f} s (compilation included); {graphs} compiled graph(s)")
        startup.update(first_step_s=round(self.first_step_s, 1), launch_to_first_step_s=process_age_s())
        self.log(startup_line(startup))
        from dflash.train.compiled import compile_phases, phases_line

        if phases := compile_phases():  # torch.compile's seconds by phase, for the cold start's table
            self.log(phases_line(phases))
        if self.trainer.device.type == "cuda":  # what fla tuned: its other token buckets filled, its choices kept
            import torch

            from dflash.models.fla_tuning import keep_tuned

            note = keep_tuned(torch.cuda.get_device_name(self.trainer.device),
                              self.trainer.out / rundir.FLA_CHOICES_NAME if self.is_logger else None)
            if note:
                self.log(note)
        if self.outcome:
            self.outcome.first_step(self.first_step_s, graphs, {k: v for k, v in startup.items() if v is not None},
                                    phases)

    def end_window(self, every_rank: bool) -> None:
        """The step's rows are made: the tok/s window ends here when `every_rank` made a row the same way (the
        metrics row and held-out eval run on all ranks); a save's timings make a row on the logger alone and must
        not restart only its window. What comes next (a save's stall) counts in the next window, as the steps do."""
        self._restart = time.perf_counter() if every_rank else None

    def _stop_measured(self, done: dict) -> None:
        """After the first save that wrote the whole state, the stop's time as that write measured it, where the
        first step's estimate (a small probe file, which the page cache absorbs) was set and is 20% off or more."""
        guess = self.trainer.stop_estimate_s
        write_s = done.get("save_write_s")
        if guess is None or write_s is None or self.trainer.stop_measured:
            return
        self.trainer.stop_measured = True
        if abs(write_s - guess) >= 0.2 * max(guess, 1.0):
            self.log(f"a stop: the save at step {done.get('save_step')} took {write_s:.1f} s to write (the first step "
                     f"estimated {guess:.0f} s): a stop takes about {write_s:.0f} s after the step in flight; set the "
                     "scheduler's kill grace above that plus a step")

    def record(self, rec: dict | None) -> None:
        """The step's row, if any, with the background saves finished since the last row, to metrics.jsonl,
        outcome.json, the step line and the trackers; then the window restarts (end_window) and the bar moves."""
        if rec is not None:
            for done in self.trainer.writer.written():  # a background write that finished since the last row
                rec.update(done)
                self._stop_measured(done)
            if self.is_logger:
                self.metrics_file.write(json.dumps(rec) + "\n")
                self.metrics_file.flush()
                self.outcome.row(rec)
                self._print(rec)
                self.trackers.log(rec)
                if not self.first_window:
                    self.steady_rows = [*self.steady_rows[-(STEADY_ROWS - 1):], rec]
        if self._restart is not None:
            self.new_window(self._restart)
            self.first_window = False
        if self.bar:
            self.bar.update(1)

    def crashed(self, e: BaseException, step: int) -> None:
        """The run's record of an exception leaving the loop (outcome.json, the running marker's error). A full or
        failing disk fails these writes too: the error being raised is the one to tell, not theirs."""
        with contextlib.suppress(OSError):
            if self.outcome:
                how = "interrupted" if isinstance(e, KeyboardInterrupt) else "crashed"
                self.outcome.end(how, step, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
        with contextlib.suppress(OSError):
            if self.is_logger:  # dflash-report tells a failed run from a killed one by this
                rundir.write_running(self.trainer.out, step=step, total_steps=self.trainer.total_steps,
                                     error=" ".join(str(e).split())[:300] or type(e).__name__)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.trackers.close()
        if self.bar:
            self.bar.close()
        if self.metrics_file:
            with contextlib.suppress(OSError):
                self.metrics_file.close()

    def _print(self, rec: dict) -> None:
        t = self.trainer
        line = f"step {rec['step']}/{t.total_steps}"
        if "loss" in rec:
            line += (f" loss {rec['loss']:.4f} accept {rec.get('accept_len', 0):.3f} tok/s {rec['tok_per_s']:.0f} "
                     f"lr {rec['lr']:.2e}")
        if "heldout_loss" in rec:
            line += f" | held-out loss {rec['heldout_loss']:.4f} accept {rec['heldout_accept_len']:.3f}"
            if "heldout_real_accept_len" in rec:
                line += (f" real {rec['heldout_real_accept_len']:.3f}"
                         + ("" if rec["heldout_real_lossless"] else " NOT LOSSLESS"))
            if "heldout_ddtree_accept_len" in rec:
                line += f" ddtree@{rec['heldout_ddtree_budget']} {rec['heldout_ddtree_accept_len']:.3f}"
        rates = t.source.rates_line(rec) if "tok_per_s" in rec else ""
        if rates:
            line += " " + rates
        if self.bar:
            self.bar.set_postfix_str(line.split(" ", 2)[2])
        else:
            self.log(line)

    def _bar(self, progress: bool | None):
        if not self.is_logger:
            return None
        if progress is None:
            progress = sys.stderr.isatty()
        if not progress:
            return None
        from tqdm import tqdm

        t = self.trainer
        return tqdm(total=t.total_steps, initial=t.step, unit="step", dynamic_ncols=True)
