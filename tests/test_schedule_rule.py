"""One schedule rule (dflash.data.plan.schedule_change): preflight's run-dir warning and the trainer's refusal of a
resume agree on every setting a user may change between two launches, on a real checkpoint of a real run."""

from __future__ import annotations

import numpy as np
import pytest

from dflash.config import config_from_dict
from dflash.data.identity import shard_files
from dflash.data.shards import write_shard
from dflash.runs import rundir
from dflash.runs.resume import prepare_output_dir
from dflash.train.trainer import run
from preflight.checks.run import check_run_dir
from preflight.facts.context import Context
from preflight.facts.run import run_dir
from trainkit import tiny_config

# (the change, does it move the cosine schedule?) with the run's steps fixed by the data (train.max_steps unset)
CHANGES_BY_EPOCHS = [
    ({}, False),
    ({"train.epochs": 3}, True),
    ({"train.lr": 3e-3}, True),
    ({"train.warmup_ratio": 0.3}, True),
    ({"train.grad_accum": 2}, True),
    ({"data.max_batch_size": 2}, True),
    ({"data.packing": True}, True),  # 8 packs of 8 samples an epoch against 9 bucketed batches
    ({"train.weight_decay": 0.1}, False),
    ({"train.log_every": 5}, False),
]
# the same with train.max_steps set: the batching no longer moves the schedule (the old preflight warned here)
CHANGES_BY_STEPS = [
    ({"data.num_buckets": 3}, False),
    ({"data.token_budget": 256}, False),
    ({"data.max_batch_size": 2}, False),
    ({"data.packing": True}, False),
    ({"train.epochs": 5}, False),
    ({"train.max_steps": 9}, True),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two finished tiny runs with a checkpoint each: one whose steps come from epochs, one from train.max_steps."""
    out = {}
    for name, train in (("epochs", {"max_steps": None, "epochs": 2}), ("steps", {"max_steps": 6})):
        root = tmp_path_factory.mktemp(name)
        cfg, raw = tiny_config(root, save_every=100, **train)
        assert run(cfg, None, log=lambda *_: None, progress=False) == 0
        out[name] = raw
    return out


def _with(raw: dict, change: dict):
    new = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for dotted, value in change.items():
        section, key = dotted.split(".")
        new[section][key] = value
    return config_from_dict(new)


def _verdicts(cfg) -> tuple[bool, bool]:
    """(preflight warns that the schedule changes, the trainer refuses the resume)."""
    ctx = Context(profile_name="train-cu128", config=cfg, resume_intent="resume",
                  run_dir=run_dir(cfg.output_dir, config=cfg))
    result = check_run_dir(ctx)
    warns = "the lr schedule changes" in result.summary
    try:
        prepare_output_dir(cfg, "latest", False, log=lambda *_: None, apply=False)
        refuses = False
    except rundir.RunDirError as e:
        assert "would change the lr schedule" in str(e)
        refuses = True
    return warns, refuses


@pytest.mark.parametrize(("change", "moves"), CHANGES_BY_EPOCHS, ids=lambda v: str(v))
def test_preflight_and_trainer_agree_when_epochs_set_the_steps(runs, change, moves):
    assert _verdicts(_with(runs["epochs"], change)) == (moves, moves)


@pytest.mark.parametrize(("change", "moves"), CHANGES_BY_STEPS, ids=lambda v: str(v))
def test_preflight_and_trainer_agree_when_max_steps_is_set(runs, change, moves):
    assert _verdicts(_with(runs["steps"], change)) == (moves, moves)


def test_a_grown_dataset_is_a_schedule_change_for_both(runs, tmp_path):
    """More samples under epochs-based steps: the old preflight said nothing while the trainer refused."""
    raw = runs["epochs"]
    data = tmp_path / "grown"
    data.mkdir()
    for shard in shard_files(raw["data"]["path"]):
        (data / shard.name).symlink_to(shard)
    rng = np.random.default_rng(0)
    ids = [list(rng.integers(1, 60, size=40)) for _ in range(32)]
    write_shard(data / "zz-extra.arrow", ids, [[0] * 10 + [1] * 30 for _ in ids])
    warns, refuses = _verdicts(_with(raw, {"data.path": str(data)}))
    assert warns and refuses
