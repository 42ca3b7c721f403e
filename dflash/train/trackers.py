"""Opt-in experiment trackers: `dflash-train --report-to tensorboard|wandb|trackio` (several allowed).

Each tracker receives every metrics row the trainer writes to metrics.jsonl, under the same names;
a list value (acc_slot) becomes one scalar per slot (acc_slot/1, acc_slot/2, ...), booleans 0/1,
and non-numbers are left out. A tracker's package is imported only when it is asked for; a missing
one stops the run before it starts with one line (exit 2). No tracker makes a network call unless
it is asked for: tensorboard writes event files under <output_dir>/tensorboard; wandb and trackio
log where their own settings say (WANDB_MODE=offline keeps wandb on disk).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dflash.errors import UsageError

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
PROJECT = "dflash"  # wandb / trackio project name


class TrackerMissing(UsageError):
    """--report-to names a tracker whose package is not installed (exit 2)."""


def check_available(names) -> None:
    """Raise TrackerMissing (one line) for the first tracker whose package cannot be imported; imports nothing."""
    for name in names:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise TrackerMissing(f"--report-to {name}: the {PACKAGES[name]} package is not installed in this "
                                 f"environment; install it (uv pip install {PACKAGES[name]}) or drop --report-to {name}")


def scalars(row: dict) -> dict[str, float]:
    """A metrics row as tracker scalars (names as in metrics.jsonl; lists as name/slot)."""
    out: dict[str, float] = {}
    for k, v in row.items():
        if k == "step":
            continue
        if isinstance(v, bool):
            out[k] = float(v)
        elif isinstance(v, (int, float)):
            out[k] = float(v)
        elif isinstance(v, list):
            for i, x in enumerate(v, start=1):  # acc_slot[0] is slot 1 (slot 0 is the given anchor token)
                if isinstance(x, (int, float)) and not isinstance(x, bool):
                    out[f"{k}/{i}"] = float(x)
    return out


class TensorBoard:
    def __init__(self, out: Path, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        from dflash.runs.rundir import TENSORBOARD_DIR

        self.writer = SummaryWriter(log_dir=str(Path(out) / TENSORBOARD_DIR))
        self.writer.add_text("config", "```\n" + _json(config) + "\n```", 0)

    def log(self, row: dict) -> None:
        for k, v in scalars(row).items():
            self.writer.add_scalar(k, v, int(row["step"]))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Wandb:
    def __init__(self, out: Path, config: dict):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=PROJECT, dir=str(out), config=config, name=Path(out).name)

    def log(self, row: dict) -> None:
        self.run.log(scalars(row), step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()


class Trackio:
    def __init__(self, out: Path, config: dict):
        import trackio

        self.trackio = trackio
        trackio.init(project=PROJECT, name=Path(out).name, config=config)

    def log(self, row: dict) -> None:
        self.trackio.log(scalars(row), step=int(row["step"]))

    def close(self) -> None:
        self.trackio.finish()


KINDS = {"tensorboard": TensorBoard, "wandb": Wandb, "trackio": Trackio}


def _json(config: dict) -> str:
    import json

    return json.dumps(config, indent=2, sort_keys=True)


class Trackers:
    """The trackers of a run, opened by the logging rank; log() sends a metrics row to each."""

    def __init__(self, names, out: Path, config: dict, log=print):
        check_available(names)
        self.open = [KINDS[n](out, config) for n in names]
        if self.open:
            log(f"trackers: {', '.join(names)}" + (f" (event files in {Path(out) / 'tensorboard'})"
                                                    if "tensorboard" in names else ""))

    def log(self, row: dict) -> None:
        for t in self.open:
            t.log(row)

    def close(self) -> None:
        for t in self.open:
            t.close()
        self.open = []
