"""One resume rule (dflash.runs.resume): preflight's run-dir verdict equals what the trainer's resume entry then does,
for every setting the rule names and for the data position, on a real checkpoint of a real tiny CPU run.

Model settings: preflight fails with a line, and the trainer refuses the same line before it loads the weights.
Data: the fingerprint is the truth; the same shards in another folder keep the position, other data restarts the
checkpoint's epoch from its first batch (preflight warns, the trainer logs it and moves the sampler there).
"""

from __future__ import annotations

import shutil

import pytest

from dflash.config import config_from_dict, default_target_layer_ids
from dflash.data.synthetic import write_pattern_dataset
from dflash.memory.shape import load_target_shape
from dflash.runs import rundir
from dflash.runs.checkpoint import load_trainer_state
from dflash.train.trainer import Trainer, run
from preflight.checks.run import check_run_dir
from preflight.facts.context import Context
from preflight.facts.run import run_dir
from trainkit import tiny_config

STEP = 4  # the run's one checkpoint, its last step: mid-epoch, so a kept position and a restarted one differ


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished tiny run (train.max_steps fixes its schedule: data changes do not move it) with checkpoint STEP,
    and spare copies of its target and dataset in other folders."""
    root = tmp_path_factory.mktemp("resume-rule")
    cfg, raw = tiny_config(root, max_steps=STEP, save_every=STEP, keep_last=1)
    assert run(cfg, None, log=lambda *_: None, progress=False) == 0
    assert load_trainer_state(rundir.checkpoint_path(cfg.output_dir, STEP))["sampler"]["index"] > 0
    shutil.copytree(raw["target"]["path"], root / "target-copy")
    shutil.copytree(raw["data"]["path"], root / "data-moved")
    write_pattern_dataset(root / "data-other", samples=80, seed=1)
    return root, raw


def _with(raw: dict, change: dict):
    new = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for dotted, value in change.items():
        section, key = dotted.split(".")
        new.setdefault(section, {})[key] = value
    return config_from_dict(new)


def _preflight(cfg):
    ctx = Context(profile_name="train-cu128", config=cfg, resume_intent="resume",
                  run_dir=run_dir(cfg.output_dir, config=cfg), target_shape=load_target_shape(cfg.target.path))
    return check_run_dir(ctx)


def _trainer(cfg):
    """(the refusal's line or None, the trainer's log lines, its sampler state) of resuming checkpoint STEP."""
    lines: list[str] = []
    try:
        trainer = Trainer.colocated(cfg, rundir.checkpoint_path(cfg.output_dir, STEP), log=lines.append)
    except rundir.RunDirError as e:
        return str(e), lines, None
    return None, lines, trainer.sampler.state_dict()


def _layers(raw) -> int:
    return load_target_shape(raw["target"]["path"]).num_layers


MODEL_CHANGES = {
    "drafter.block_size": lambda root, raw: {"drafter.block_size": 8},
    "drafter.num_layers": lambda root, raw: {"drafter.num_layers": 2, "drafter.target_layer_ids": [1, 2]},
    "target.path": lambda root, raw: {"target.path": str(root / "target-copy")},  # same weights: loads strictly
    "drafter.target_layer_ids": lambda root, raw: {"drafter.target_layer_ids": [_layers(raw) - 1]},
}


@pytest.mark.parametrize("field", sorted(MODEL_CHANGES))
def test_a_changed_model_setting_is_refused_by_both_with_one_line(finished, field):
    root, raw = finished
    cfg = _with(raw, MODEL_CHANGES[field](root, raw))
    verdict = _preflight(cfg)
    refused, _, _ = _trainer(cfg)
    assert verdict.status == "fail" and f"is incompatible with this config: {field} " in verdict.summary
    assert refused is not None and refused.startswith(verdict.summary + "; use --fresh")


def test_the_default_layer_ids_spelled_out_are_no_change_for_either(finished):
    root, raw = finished
    cfg = _with(raw, {"drafter.target_layer_ids": default_target_layer_ids(_layers(raw), 1)})
    verdict = _preflight(cfg)
    refused, _, sampler = _trainer(cfg)
    assert verdict.status == "pass" and refused is None and sampler is not None


def test_the_same_target_folder_spelled_another_way_is_no_change_for_either(finished):
    """target.path through a link to the same folder: both resolve it, neither refuses (a copy elsewhere is refused)."""
    root, raw = finished
    link = root / "target-link"
    if not link.exists():
        link.symlink_to(raw["target"]["path"], target_is_directory=True)
    cfg = _with(raw, {"target.path": str(link)})
    verdict = _preflight(cfg)
    refused, _, sampler = _trainer(cfg)
    assert verdict.status == "pass" and refused is None and sampler is not None


def _saved_sampler(cfg) -> dict:
    return load_trainer_state(rundir.checkpoint_path(cfg.output_dir, STEP))["sampler"]


def test_the_same_shards_in_another_folder_keep_the_position_for_both(finished):
    """data.path alone changed: the old preflight predicted a restart while the trainer kept the position."""
    root, raw = finished
    cfg = _with(raw, {"data.path": str(root / "data-moved")})
    verdict = _preflight(cfg)
    refused, lines, sampler = _trainer(cfg)
    assert verdict.status == "pass" and "the position in the epoch is kept" in verdict.summary
    assert refused is None and sampler["index"] == _saved_sampler(cfg)["index"] > 0
    assert not any("restarts" in line for line in lines)


@pytest.mark.parametrize("change", ["other data", "a holdout"])
def test_other_data_restarts_the_epoch_for_both_and_both_say_why(finished, change):
    """Other shards, or the same ones less a new [eval] holdout (the old preflight said nothing there)."""
    root, raw = finished
    cfg = _with(raw, {"data.path": str(root / "data-other")} if change == "other data" else {"eval.holdout": 4})
    verdict = _preflight(cfg)
    refused, lines, sampler = _trainer(cfg)
    why = verdict.data["data_restart"]
    assert verdict.status == "warn" and f"{why} (the epoch restarts from its first batch)" in verdict.summary
    saved = _saved_sampler(cfg)
    assert refused is None and sampler["index"] == 0 and sampler["epoch"] == saved["epoch"]
    assert f"{why}; epoch {saved['epoch']} restarts from its first batch" in lines


def test_an_unchanged_config_resumes_in_place_for_both(finished):
    root, raw = finished
    cfg = _with(raw, {})
    verdict = _preflight(cfg)
    refused, lines, sampler = _trainer(cfg)
    assert verdict.status == "pass" and verdict.summary.endswith("dataset unchanged")
    assert refused is None and sampler["index"] == _saved_sampler(cfg)["index"]
