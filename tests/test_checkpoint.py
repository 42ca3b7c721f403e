"""Checkpoints: what a save writes, that nothing is unpickled on load, and what a resume does with damaged ones.

The damaged-checkpoint cases run the real `dflash-train --resume` command and assert its exit
code and its lines (no traceback), as a user would meet them: `--resume latest` skips a damaged
newest checkpoint and says why; `--resume <that folder>` refuses it in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from dflash.runs import checkpoint as ckpt
from dflash.runs import rundir
from dflash.runs.resume import prepare_output_dir, resolve_resume, resume_schedule_change
from dflash.runs.verify import checkpoint_problem, read_meta
from dflash.train.trainer import run
from preflight import gate
from trainkit import tiny_config, train_cmd, write_toml

REPO = Path(__file__).resolve().parent.parent




@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 2-step CPU run with checkpoints at steps 1 and 2: (config, raw config, run dir)."""
    root = tmp_path_factory.mktemp("ckpt")
    cfg, raw = tiny_config(root, max_steps=2, save_every=1, keep_last=2)
    # provenance as dflash-train hands it to the trainer (once, from preflight's gate)
    assert run(cfg, None, log=lambda *_: None, progress=False, provenance=gate.provenance(cfg.profile)) == 0
    return cfg, raw, Path(cfg.output_dir)


def test_a_checkpoint_holds_json_and_tensors_and_no_pickle(finished_run):
    cfg, _, out = finished_run
    latest = rundir.list_checkpoints(out)[-1]
    assert latest == rundir.checkpoint_path(out, 2)
    names = sorted(p.name for p in latest.iterdir())
    assert names == ["drafter", "meta.json", "optimizer.pt", "trainer_state.json", "trainer_state.safetensors"]
    assert checkpoint_problem(latest) is None
    meta = read_meta(latest)
    assert meta["format"] == ckpt.FORMAT and meta["step"] == 2
    assert re.fullmatch(r"[0-9a-f]{64}", meta["lock_sha256"]) and "git_commit" in meta
    state = ckpt.load_trainer_state(latest)
    assert state["step"] == 2 and {"epoch", "index"} <= set(state["sampler"]) and state["rng_cuda"] is None
    assert state["rng_cpu"].dtype == torch.uint8 and state["rng_cpu"].numel() > 0


def test_meta_records_size_and_sha256_of_every_other_file(finished_run):
    _, _, out = finished_run
    latest = rundir.list_checkpoints(out)[-1]
    files = read_meta(latest)[rundir.FILES_KEY]
    on_disk = sorted(p.relative_to(latest).as_posix() for p in latest.rglob("*") if p.is_file())
    assert sorted(files) == [f for f in on_disk if f != rundir.META_NAME]
    assert {"drafter/config.json", "drafter/model.safetensors", "optimizer.pt"} <= set(files)
    for rel, rec in files.items():
        data = (latest / rel).read_bytes()
        assert rec == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    assert checkpoint_problem(latest, deep=True) is None


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
    shutil.copytree(rundir.list_checkpoints(out)[-1], copy)
    marker = tmp_path / "code-ran"
    _make_legacy(copy, marker)
    for load in (ckpt.load_trainer_state, lambda p: ckpt.load_checkpoint(p, None, None, "cpu")):
        with pytest.raises(rundir.CheckpointError, match=r"older dflash version .*start over with --fresh"):
            load(copy)
    assert not marker.exists()


def test_missing_files_are_named_by_the_loader(finished_run, tmp_path):
    _, _, out = finished_run
    copy = tmp_path / "checkpoints" / "step_00000002"
    shutil.copytree(rundir.list_checkpoints(out)[-1], copy)
    (copy / rundir.STATE_TENSORS).unlink()
    with pytest.raises(rundir.CheckpointError, match=r"trainer_state.safetensors is missing .*--fresh"):
        ckpt.load_trainer_state(copy)


def _flip(file: Path, n: int = 64) -> None:
    """Flip n bytes in the middle of a file: same size, other content."""
    data = bytearray(file.read_bytes())
    mid = len(data) // 2
    for i in range(mid, min(mid + n, len(data))):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


def _damage(folder: Path, case: str, marker: Path) -> None:
    if case == "old layout":
        _make_legacy(folder, marker)
    elif case == "missing optimizer.pt":
        (folder / rundir.OPTIMIZER_NAME).unlink()
    elif case == "truncated optimizer.pt":
        data = (folder / rundir.OPTIMIZER_NAME).read_bytes()
        (folder / rundir.OPTIMIZER_NAME).write_bytes(data[: len(data) // 2])
    elif case == "flipped bytes in optimizer.pt":
        _flip(folder / rundir.OPTIMIZER_NAME)
    elif case == "flipped bytes in model.safetensors":
        _flip(folder / rundir.DRAFTER_DIR / rundir.WEIGHTS_NAME)
    elif case == "corrupt trainer_state.json":
        (folder / rundir.STATE_JSON).write_text('{"step": 2, "sampler": ')
    elif case == "corrupt trainer_state.safetensors":
        (folder / rundir.STATE_TENSORS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    else:
        raise AssertionError(case)


PREVIOUS = r"resume the previous one with --resume \S+step_00000001, or start over with --fresh"
# (case, why the checkpoint does not verify: in the one error line, and in the one line that says it was skipped)
DAMAGE = [
    ("old layout", r"written by an older dflash version \(trainer_state.pt, a pickle this version does not load\)"),
    ("missing optimizer.pt", r"optimizer.pt missing \(an incomplete checkpoint\)"),
    ("truncated optimizer.pt", r"optimizer.pt is [\d,]+ bytes, meta.json recorded [\d,]+ \(truncated or rewritten since "
                               r"the save\)"),
    ("flipped bytes in optimizer.pt", r"optimizer.pt content differs from its sha256 in meta.json \(damaged since "
                                      r"the save\)"),
    ("flipped bytes in model.safetensors", r"drafter/model.safetensors content differs from its sha256 in meta.json"),
    ("corrupt trainer_state.json", r"trainer_state.json is \d+ bytes, meta.json recorded [\d,]+"),
    ("corrupt trainer_state.safetensors", r"trainer_state.safetensors is \d+ bytes, meta.json recorded [\d,]+"),
]


def _damaged_copy(finished_run, tmp_path, case):
    _, raw, out = finished_run
    run_dir = tmp_path / "run"
    shutil.copytree(out, run_dir)
    marker = tmp_path / "code-ran"
    _damage(rundir.checkpoint_path(run_dir, 2), case, marker)
    return run_dir, write_toml(raw, tmp_path / "run.toml"), marker


def _train(config: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(train_cmd(config, "--output-dir", str(run_dir), *extra), cwd=REPO, capture_output=True, text=True)


def _tree(run_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))


@pytest.mark.parametrize("case,why", DAMAGE, ids=[c for c, _ in DAMAGE])
def test_resume_of_a_damaged_checkpoint_by_path_is_one_line(finished_run, tmp_path, case, why):
    run_dir, config, marker = _damaged_copy(finished_run, tmp_path, case)
    before = _tree(run_dir)
    proc = _train(config, run_dir, "--resume", str(rundir.checkpoint_path(run_dir, 2)))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dflash-train: error: ")]
    assert len(errors) == 1 and proc.stderr.rstrip().endswith(errors[0]), proc.stderr
    prefix = "" if case == "old layout" else r".*; " + PREVIOUS
    expect = r"step_00000002: " + why + (r"; start over with --fresh" if case == "old layout" else prefix)
    assert re.search(expect, errors[0]), errors[0]
    assert not marker.exists()
    assert _tree(run_dir) == before  # refused before anything moved, trimmed or was written


@pytest.mark.parametrize("case,why", [DAMAGE[2], DAMAGE[3]], ids=[DAMAGE[2][0], DAMAGE[3][0]])
def test_resume_latest_skips_a_damaged_newest_checkpoint_and_says_why(finished_run, tmp_path, case, why):
    """A 64-byte flip keeps the size: only the sha256 recorded at save time catches it."""
    run_dir, config, _ = _damaged_copy(finished_run, tmp_path, case)
    proc = _train(config, run_dir, "--resume", "latest", "--max-steps", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("--resume latest: skipped")]
    assert len(skipped) == 1, proc.stdout
    assert re.fullmatch(r"--resume latest: skipped step_00000002 \(" + why + r"\); resuming step_00000001 \(step 1\)",
                        skipped[0]), skipped[0]
    assert f"resumed from {rundir.checkpoint_path(run_dir, 1)} at step 1" in proc.stdout
    moved = list(run_dir.glob("checkpoints.abandoned-*/step_00000002"))
    assert len(moved) == 1  # the damaged one is kept aside, never deleted
    assert checkpoint_problem(rundir.checkpoint_path(run_dir, 2), deep=True) is None  # saved anew


def test_resume_latest_with_no_checkpoint_that_verifies(finished_run, tmp_path):
    run_dir, _, _ = _damaged_copy(finished_run, tmp_path, "truncated optimizer.pt")
    _flip(rundir.checkpoint_path(run_dir, 1) / rundir.STATE_TENSORS, 8)
    log = []
    with pytest.raises(rundir.CheckpointError) as e:
        resolve_resume(run_dir, "latest", log=log.append)
    assert re.fullmatch(r"--resume latest: no checkpoint in \S+ verifies: step_00000002 \(optimizer.pt is .+\); "
                        r"step_00000001 \(trainer_state.safetensors content differs .+\); start over with --fresh",
                        str(e.value)), str(e.value)
    # without deep, sizes only: the flipped one passes (preflight's quick look), the truncated one does not
    assert resolve_resume(run_dir, "latest", deep=False, log=log.append).name == "step_00000001"
    assert log == ["--resume latest: skipped step_00000002 (optimizer.pt is "
                   f"{(rundir.checkpoint_path(run_dir, 2) / 'optimizer.pt').stat().st_size:,} bytes, meta.json recorded "
                   f"{read_meta(rundir.checkpoint_path(run_dir, 2))['files']['optimizer.pt']['bytes']:,} "
                   "(truncated or rewritten since the save)); resuming step_00000001 (step 1)"]


def test_a_checkpoint_without_recorded_files_is_judged_by_its_loader(finished_run, tmp_path):
    """Checkpoints saved before sizes and hashes were recorded still load, and a corrupt file is still one line."""
    run_dir, _, _ = _damaged_copy(finished_run, tmp_path, "corrupt trainer_state.json")
    folder = rundir.checkpoint_path(run_dir, 2)
    meta = read_meta(folder)
    del meta[rundir.FILES_KEY]
    (folder / rundir.META_NAME).write_text(json.dumps(meta))
    assert checkpoint_problem(folder, deep=True) is None
    with pytest.raises(rundir.CheckpointError, match=r"trainer_state.json is corrupt \(.+\); " + PREVIOUS):
        ckpt.load_trainer_state(folder)


def test_a_resume_that_changes_the_lr_schedule_is_refused_unless_allowed(finished_run, tmp_path):
    from dflash.config import config_from_dict

    _, raw, out = finished_run
    run_dir = tmp_path / "run"
    shutil.copytree(out, run_dir)
    same = config_from_dict(dict(raw, output_dir=str(run_dir)))
    assert resume_schedule_change(rundir.checkpoint_path(run_dir, 2), same) is None
    longer = config_from_dict(dict(raw, output_dir=str(run_dir), train=dict(raw["train"], max_steps=20, lr=0.02)))
    assert resume_schedule_change(rundir.checkpoint_path(run_dir, 2), longer) == \
        "total steps 2 -> 20, train.lr 0.01 -> 0.02 (train.max_steps 2 -> 20)"
    before = _tree(run_dir)
    with pytest.raises(rundir.RunDirError, match=r"^--resume step_00000002 \(step 2\) would change the lr schedule: "
                                                 r"total steps 2 -> 20, .*; pass --allow-schedule-change") as e:
        prepare_output_dir(longer, "latest", False)
    assert e.value.exit_code == 2 and _tree(run_dir) == before
    log = []
    assert prepare_output_dir(longer, "latest", False, log.append, allow_schedule_change=True).name == \
        "step_00000002"
    assert log == ["--allow-schedule-change: resuming step_00000002 (step 2) with a new lr schedule: total steps "
                   "2 -> 20, train.lr 0.01 -> 0.02 (train.max_steps 2 -> 20)"]
    # an epochs-based schedule: the dataset's size changes the total (a merged dataset under an old run)
    train = {k: v for k, v in raw["train"].items() if k != "max_steps"}
    by_epochs = config_from_dict(dict(raw, output_dir=str(run_dir), train=dict(train, epochs=1)))
    folder = rundir.checkpoint_path(run_dir, 2)
    meta = read_meta(folder)
    meta["config"] = by_epochs.model_dump()
    meta["dataset"]["samples"] = 40
    (folder / rundir.META_NAME).write_text(json.dumps(meta))
    state = json.loads((folder / rundir.STATE_JSON).read_text())
    state["sampler"]["batches_per_epoch"] = 6
    (folder / rundir.STATE_JSON).write_text(json.dumps(state))
    assert resume_schedule_change(folder, by_epochs) == "total steps 6 -> 9 (dataset 40 -> 64 samples)"


def test_preflight_and_the_checkpoint_agree_on_the_dataset(finished_run):
    """One owner of the dataset identity: the gate's report and the trainer's meta.json say the same."""
    from preflight.gate import build_report

    cfg, _, out = finished_run
    meta = read_meta(rundir.list_checkpoints(out)[-1])
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
    assert prepare_output_dir(cfg, None, False) is None  # nothing there: nothing to decide
    first, second = _fake_checkpoint(out, 1), _fake_checkpoint(out, 2)
    (rundir.checkpoints_dir(out) / "step_00000003.tmp").mkdir()  # a save in progress is no checkpoint
    assert rundir.list_checkpoints(out) == [first, second]
    with pytest.raises(rundir.RunDirError, match=r"holds checkpoints \(newest step_00000002, step 2\); say "
                                                 r"--resume latest to continue it or --fresh") as e:
        prepare_output_dir(cfg, None, False)
    assert e.value.exit_code == 2
    with pytest.raises(rundir.RunDirError, match="exclude each other"):
        prepare_output_dir(cfg, "latest", True)
    with pytest.raises(rundir.RunDirError, match="not a checkpoint folder"):
        prepare_output_dir(cfg, str(out), False)
    (second / rundir.STATE_TENSORS).unlink()
    with pytest.raises(rundir.CheckpointError, match=f"trainer_state.safetensors missing .* --resume {first}"):
        prepare_output_dir(cfg, str(second), False)
    assert rundir.list_checkpoints(out) == [first, second]  # refused before anything moved
    log = []
    assert prepare_output_dir(cfg, str(first), False, log.append) == first
    assert rundir.list_checkpoints(out) == [first] and "1 newer checkpoint(s) moved to" in log[0]
    assert prepare_output_dir(cfg, None, True, log.append) is None
    assert rundir.list_checkpoints(out) == [] and log[-1].startswith("--fresh: previous checkpoints moved to")


def test_a_symlinked_step_folder_is_never_resumed_counted_or_deleted_through(finished_run, tmp_path):
    """A `step_*` symlink to another run's checkpoint, newer than this run's: `--resume latest` ignores it and says so,
    resumes this run's newest, saves over a link of the same name without touching its target, and keep_last never
    deletes through one (the red team's run took the link, pruned the real checkpoint and died in rmtree)."""
    _, raw, out = finished_run
    run_dir, other = tmp_path / "run", tmp_path / "other"
    shutil.copytree(out, run_dir)
    shutil.copytree(out, other)
    foreign = rundir.checkpoint_path(other, 1)
    for step in (3, 9):
        rundir.checkpoint_path(run_dir, step).symlink_to(foreign, target_is_directory=True)
    proc = _train(write_toml(raw, tmp_path / "run.toml"), run_dir, "--resume", "latest", "--max-steps", "4",
                  "--allow-schedule-change")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (f"--resume latest: ignored step_00000003, step_00000009 in {run_dir / 'checkpoints'}: symlinks, not "
            "checkpoints this run wrote (only real folders there are resumed)") in proc.stdout.splitlines()
    assert f"resumed from {rundir.checkpoint_path(run_dir, 2)} at step 2" in proc.stdout
    assert [c.name for c in rundir.list_checkpoints(run_dir)] == ["step_00000003", "step_00000004"]  # keep_last 2
    assert not rundir.checkpoint_path(run_dir, 3).is_symlink()  # step 3 saved in place of the link
    assert read_meta(rundir.checkpoint_path(run_dir, 3))["step"] == 3
    assert os.readlink(rundir.checkpoint_path(run_dir, 9)) == str(foreign)  # left as it was
    assert [c.name for c in rundir.list_checkpoints(other)] == ["step_00000001", "step_00000002"]
    assert checkpoint_problem(foreign, deep=True) is None  # the other run's checkpoint untouched


def test_a_checkpoint_whose_meta_names_another_step_does_not_verify(finished_run, tmp_path):
    """A real folder `step_00000009` holding a copy of step 1: a resume would start at step 1 under step 9's name,
    and keep_last would then prune the real ones. It does not verify: `latest` skips it (and moves it aside, nothing
    deleted), and by path it is refused in one line naming both steps."""
    _, raw, out = finished_run
    run_dir = tmp_path / "run"
    shutil.copytree(out, run_dir)
    copied = rundir.checkpoint_path(run_dir, 9)
    shutil.copytree(rundir.checkpoint_path(run_dir, 1), copied)
    why = "meta.json says step 1, the folder name says step 9 (copied or renamed)"
    assert checkpoint_problem(copied) == why
    with pytest.raises(rundir.CheckpointError, match=re.escape(f"{copied}: {why}; resume the previous one with "
                                                               f"--resume {rundir.checkpoint_path(run_dir, 2)}")):
        resolve_resume(run_dir, str(copied))
    log = []
    assert resolve_resume(run_dir, "latest", log=log.append) == rundir.checkpoint_path(run_dir, 2)
    assert log == [f"--resume latest: skipped step_00000009 ({why}); resuming step_00000002 (step 2)"]


def test_best_never_leads_out_of_the_run_dir(finished_run, tmp_path):
    _, _, out = finished_run
    run_dir, other = tmp_path / "run", tmp_path / "other"
    shutil.copytree(out, run_dir)
    shutil.copytree(out, other)
    best = rundir.checkpoints_dir(run_dir) / rundir.BEST_NAME
    own = rundir.checkpoint_path(run_dir, 2)
    for target, problem in [(os.path.relpath(rundir.checkpoint_path(other, 1), best.parent), "points outside"),
                            (str(rundir.checkpoint_path(other, 2)), "points outside"),  # same name, other run
                            ("step_00000005", "points outside"),  # a step_* symlink leading elsewhere
                            ("step_00000007", "not a finished checkpoint"),
                            (str(own), None), ("step_00000002", None)]:
        if target == "step_00000005" and not rundir.checkpoint_path(run_dir, 5).is_symlink():
            rundir.checkpoint_path(run_dir, 5).symlink_to(rundir.checkpoint_path(other, 1))
        best.unlink(missing_ok=True)
        best.symlink_to(target)
        path, why = rundir.best_or_problem(run_dir)
        if problem is None:
            assert (path, why) == (own, None), target
        else:
            assert path is None and rundir.best_checkpoint(run_dir) is None and problem in why, (target, why)


@pytest.mark.parametrize("failure", ["config-json", "safetensors"])
def test_an_export_the_disk_refuses_leaves_the_previous_one_and_no_partial_folder(tmp_path, failure):
    """write_export: the weights written, then config.json meets a full disk (an OSError), or safetensors' own error
    wraps ENOSPC: the disk's OSError comes out (naming drafter.tmp when the error names no file), drafter.tmp is gone
    and the previous export is as it was; a complete write replaces it."""
    import errno

    def config(text):
        def write(folder):
            folder.mkdir()
            (folder / "config.json").write_text(text)
        return write

    ckpt.write_export(tmp_path, config("old"))
    tmp = tmp_path / rundir.DRAFTER_TMP

    def full(folder):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(bytes(4096))  # what fitted before the disk filled
        if failure == "config-json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "config.json"))
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    with pytest.raises(OSError) as e:
        ckpt.write_export(tmp_path, full)
    assert e.value.errno == errno.ENOSPC
    assert e.value.filename == str(tmp / "config.json" if failure == "config-json" else tmp)
    assert not tmp.exists() and sorted(p.name for p in (tmp_path / rundir.DRAFTER_DIR).iterdir()) == ["config.json"]
    assert (tmp_path / rundir.DRAFTER_DIR / "config.json").read_text() == "old"
    ckpt.write_export(tmp_path, config("new"))
    assert (tmp_path / rundir.DRAFTER_DIR / "config.json").read_text() == "new" and not tmp.exists()


def test_no_full_unpickling_anywhere():
    sources = [p for top in ("dflash", "preflight", "bench") for p in (REPO / top).rglob("*.py")]
    offenders = [str(p.relative_to(REPO)) for p in sources
                 if re.search(r"weights_only\s*=\s*False|pickle\.loads?\(", p.read_text())]
    assert offenders == []
