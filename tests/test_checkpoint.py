"""Checkpoints: what a save writes, that nothing is unpickled on load, and one-line errors for damaged ones.

The damaged-checkpoint cases run the real `dflash-train --resume latest` command and assert its
exit code and its one error line (no traceback), as a user would meet them.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash import checkpoint as ckpt
from dflash import rundir
from dflash.train import run
from trainkit import tiny_config

REPO = Path(__file__).resolve().parent.parent


def write_toml(raw: dict, path: Path) -> Path:
    lines = [f"{k} = {json.dumps(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    for key, value in raw.items():
        if isinstance(value, dict):
            lines += [f"[{key}]", *(f"{k} = {json.dumps(v)}" for k, v in value.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 2-step CPU run with checkpoints at steps 1 and 2: (config, raw config, run dir)."""
    root = tmp_path_factory.mktemp("ckpt")
    cfg, raw = tiny_config(root, max_steps=2, save_every=1, keep_last=2)
    assert run(cfg, None, log=lambda *_: None, progress=False) == 0
    return cfg, raw, Path(cfg.output_dir)


def test_a_checkpoint_holds_json_and_tensors_and_no_pickle(finished_run):
    cfg, _, out = finished_run
    latest = ckpt.list_checkpoints(out)[-1]
    assert latest == rundir.checkpoint_path(out, 2)
    names = sorted(p.name for p in latest.iterdir())
    assert names == ["drafter", "meta.json", "optimizer.pt", "trainer_state.json", "trainer_state.safetensors"]
    assert rundir.checkpoint_problem(latest) is None
    meta = rundir.read_meta(latest)
    assert meta["format"] == ckpt.FORMAT and meta["step"] == 2
    assert re.fullmatch(r"[0-9a-f]{64}", meta["lock_sha256"]) and "git_commit" in meta
    state = ckpt.load_trainer_state(latest)
    assert state["step"] == 2 and {"epoch", "index"} <= set(state["sampler"]) and state["rng_cuda"] is None
    assert state["rng_cpu"].dtype == torch.uint8 and state["rng_cpu"].numel() > 0


def test_trainer_state_round_trips(tmp_path):
    rng = torch.get_rng_state()
    ckpt.save_trainer_state(tmp_path, {"step": 7, "sampler": {"epoch": 1, "index": 3}, "n_drafters": 2,
                                       "rng_cpu": rng, "rng_cuda": None})
    state = ckpt.load_trainer_state(tmp_path)
    assert torch.equal(state.pop("rng_cpu"), rng)
    assert state == {"step": 7, "sampler": {"epoch": 1, "index": 3}, "n_drafters": 2, "rng_cuda": None}
    with pytest.raises(TypeError, match="tensors plus JSON"):
        ckpt.save_trainer_state(tmp_path, {"sampler": {"nested": torch.zeros(1)}})


class _RunsCode:
    """Unpickling this creates a marker file: stands in for a crafted checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _make_legacy(folder: Path, marker: Path) -> None:
    (folder / rundir.STATE_JSON).unlink()
    (folder / rundir.STATE_TENSORS).unlink()
    (folder / rundir.LEGACY_STATE).write_bytes(pickle.dumps(_RunsCode(marker)))


def test_an_old_pickled_state_is_refused_and_never_unpickled(finished_run, tmp_path):
    _, _, out = finished_run
    copy = tmp_path / "step_00000002"
    shutil.copytree(ckpt.list_checkpoints(out)[-1], copy)
    marker = tmp_path / "code-ran"
    _make_legacy(copy, marker)
    for load in (ckpt.load_trainer_state, lambda p: ckpt.load_checkpoint(p, None, None, "cpu")):
        with pytest.raises(ckpt.CheckpointError, match=r"older dflash version .*start over with --fresh"):
            load(copy)
    assert not marker.exists()


def test_missing_files_are_named_by_the_loader(finished_run, tmp_path):
    _, _, out = finished_run
    copy = tmp_path / "checkpoints" / "step_00000002"
    shutil.copytree(ckpt.list_checkpoints(out)[-1], copy)
    (copy / rundir.STATE_TENSORS).unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"trainer_state.safetensors is missing .*--fresh"):
        ckpt.load_trainer_state(copy)


def _damage(folder: Path, case: str, marker: Path) -> None:
    if case == "old layout":
        _make_legacy(folder, marker)
    elif case == "missing optimizer.pt":
        (folder / rundir.OPTIMIZER_NAME).unlink()
    elif case == "corrupt optimizer.pt":
        data = (folder / rundir.OPTIMIZER_NAME).read_bytes()
        (folder / rundir.OPTIMIZER_NAME).write_bytes(data[: len(data) // 2])
    elif case == "corrupt trainer_state.json":
        (folder / rundir.STATE_JSON).write_text('{"step": 2, "sampler": ')
    elif case == "corrupt trainer_state.safetensors":
        (folder / rundir.STATE_TENSORS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    else:
        raise AssertionError(case)


# (case, what the one error line must say)
DAMAGE = [
    ("old layout", r"step_00000002: written by an older dflash version \(trainer_state.pt.*\); "
                   r"start over with --fresh"),
    ("missing optimizer.pt", r"step_00000002: optimizer.pt missing \(an incomplete checkpoint\); resume the previous "
                             r"one with --resume \S+step_00000001, or start over with --fresh"),
    ("corrupt optimizer.pt", r"step_00000002/optimizer.pt is corrupt \(.+\); resume the previous one with "
                             r"--resume \S+step_00000001, or start over with --fresh"),
    ("corrupt trainer_state.json", r"step_00000002/trainer_state.json is corrupt \(.+\); resume the previous one"),
    ("corrupt trainer_state.safetensors", r"step_00000002/trainer_state.safetensors is corrupt \(.+\); resume the "
                                          r"previous one"),
]


@pytest.mark.parametrize("case,expect", DAMAGE, ids=[c for c, _ in DAMAGE])
def test_resume_from_a_damaged_checkpoint_is_one_line(finished_run, tmp_path, case, expect):
    _, raw, out = finished_run
    run_dir = tmp_path / "run"
    shutil.copytree(out, run_dir)
    marker = tmp_path / "code-ran"
    _damage(rundir.checkpoint_path(run_dir, 2), case, marker)
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    config = write_toml(raw, tmp_path / "run.toml")
    cmd = [sys.executable, "-m", "dflash.cli", "--config", str(config), "--output-dir", str(run_dir), "--no-progress",
           "--waive", "model-source", "--reason", "tests run on a working tree", "--resume", "latest"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dflash-train: error: ")]
    assert len(errors) == 1 and proc.stderr.rstrip().endswith(errors[0]), proc.stderr
    assert re.search(expect, errors[0]), errors[0]
    assert not marker.exists()
    after = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    assert [p for p in after if p not in before] in ([], ["preflight.json"])  # nothing moved or trimmed


def test_preflight_and_the_checkpoint_agree_on_the_dataset(finished_run):
    """One owner of the dataset identity: the gate's report and the trainer's meta.json say the same."""
    from preflight.gate import build_report

    cfg, _, out = finished_run
    meta = rundir.read_meta(ckpt.list_checkpoints(out)[-1])
    report = build_report(cfg.profile, cfg, resume_intent="resume")
    assert report.by_id("dataset").data["fingerprint"] == meta["dataset"]["fingerprint"]
    run_dir = report.by_id("run-dir")
    assert run_dir.status == "pass" and "dataset unchanged" in run_dir.summary, run_dir.summary


def _fake_checkpoint(out: Path, step: int) -> Path:
    """A checkpoint folder with every file a resume loads (empty: the run-dir rules look at names only)."""
    folder = rundir.checkpoint_path(out, step)
    for name in rundir.CHECKPOINT_FILES:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps({"step": step}) if name == rundir.META_NAME else "")
    return folder


def test_the_resume_fresh_rule(tmp_path):
    from dflash.config import config_from_dict

    out = tmp_path / "run"
    cfg = config_from_dict({"output_dir": str(out)})
    assert rundir.prepare_output_dir(cfg, None, False) is None  # nothing there: nothing to decide
    first, second = _fake_checkpoint(out, 1), _fake_checkpoint(out, 2)
    (rundir.checkpoints_dir(out) / "step_00000003.tmp").mkdir()  # a save in progress is no checkpoint
    assert rundir.list_checkpoints(out) == [first, second]
    with pytest.raises(rundir.RunDirError, match=r"holds checkpoints \(newest step_00000002, step 2\); say "
                                                 r"--resume latest to continue it or --fresh") as e:
        rundir.prepare_output_dir(cfg, None, False)
    assert e.value.exit_code == 2
    with pytest.raises(rundir.RunDirError, match="exclude each other"):
        rundir.prepare_output_dir(cfg, "latest", True)
    with pytest.raises(rundir.RunDirError, match="not a checkpoint folder"):
        rundir.prepare_output_dir(cfg, str(out), False)
    (second / rundir.STATE_TENSORS).unlink()
    with pytest.raises(rundir.CheckpointError, match=f"trainer_state.safetensors missing .* --resume {first}"):
        rundir.prepare_output_dir(cfg, "latest", False)
    assert rundir.list_checkpoints(out) == [first, second]  # refused before anything moved
    log = []
    assert rundir.prepare_output_dir(cfg, str(first), False, log.append) == first
    assert rundir.list_checkpoints(out) == [first] and "1 newer checkpoint(s) moved to" in log[0]
    assert rundir.prepare_output_dir(cfg, None, True, log.append) is None
    assert rundir.list_checkpoints(out) == [] and log[-1].startswith("--fresh: previous checkpoints moved to")


def test_no_full_unpickling_anywhere():
    sources = [p for top in ("dflash", "preflight", "bench") for p in (REPO / top).rglob("*.py")]
    offenders = [str(p.relative_to(REPO)) for p in sources
                 if re.search(r"weights_only\s*=\s*False|pickle\.loads?\(", p.read_text())]
    assert offenders == []
