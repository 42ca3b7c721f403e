"""Co-located data parallel on CPU over gloo: 2 processes, each with its own target and a drafter replica, real
torch.distributed (topology.colocated_gpus; launched by dflash-train, or under torchrun)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.runs import rundir
from dflash.runs.verify import verify_checkpoint
from dflash.train.launch import _watch
from dflash.train.layout import ranks_for
from dflash.train.trainer import run
from trainkit import (
    REPO,
    WAIVE_SOURCE,
    assert_ranks_gone,
    cancel_run,
    metrics,
    start_run,
    start_train,
    tiny_config,
    train_cmd,
    write_toml,
)


def dp_raw(raw: dict, gpus=("0", "1")) -> dict:
    raw = json.loads(json.dumps(raw))
    raw["topology"] = {"colocated_gpus": list(gpus), "timeout_s": 30}
    return raw


def test_every_rank_is_a_colocated_rank_training_every_nth_batch():
    from dflash.config import config_from_dict

    cfg = config_from_dict({"topology": {"colocated_gpus": ["0", "1", "2"]}})
    assert [(r.rank, r.role, r.index, r.is_drafter) for r in ranks_for(cfg)] == [
        (0, "colocated", 0, True), (1, "colocated", 1, True), (2, "colocated", 2, True)]


@pytest.fixture(scope="module")
def finished_dp_run(tmp_path_factory):
    """A finished 6-step co-located data-parallel run (2 ranks on gloo) launched by dflash-train with the replica
    check on: (run config, its TOML, the launcher's completed process, its raw config)."""
    root = tmp_path_factory.mktemp("dp")
    cfg, raw = tiny_config(root, max_steps=6, save_every=3)
    config = write_toml(dp_raw(raw), root / "dp.toml")
    out = subprocess.run(train_cmd(config, "--fresh"), cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, DFLASH_CHECK_REPLICAS="1"))
    return cfg, config, out, raw


def test_two_colocated_ranks_match_one_process_accumulating_two_batches(tmp_path, finished_dp_run):
    """Rank r trains global batches j % 2 == r of each step and DDP averages the gradients: the losses equal a
    single-process co-located run with grad_accum = 2 over the same batches, replicas stay identical."""
    ref_cfg, _ = tiny_config(tmp_path / "ref", max_steps=6, grad_accum=2)
    run(ref_cfg, None, log=lambda *_: None, progress=False)
    ref = metrics(Path(ref_cfg.output_dir))

    cfg, _, out, _ = finished_dp_run
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "launched 2 processes: co-located ranks 0-1 (each a target + drafter replica) on GPUs 0,1 (gloo)" \
        in out.stdout, out.stdout[-3000:]
    assert "2 data-parallel drafter ranks" in out.stdout
    got = metrics(Path(cfg.output_dir))
    assert [r["step"] for r in got] == list(range(1, 7))  # rank 0 alone writes, every step once
    for a, b in zip(got, ref):
        assert a["replica_max_diff"] == 0.0, a
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a["step"], a["loss"], b["loss"])
    assert [r["role"] for r in json.loads((Path(cfg.output_dir) / "ranks.json").read_text())] == ["colocated"] * 2
    checkpoints = rundir.list_checkpoints(cfg.output_dir)
    assert [c.name for c in checkpoints] == ["step_00000003", "step_00000006"]
    for c in checkpoints:
        verify_checkpoint(c)  # sizes and sha256 of every file
    state = json.loads((checkpoints[-1] / "trainer_state.json").read_text())
    assert state["n_drafters"] == 2  # the schedule rule counts the data-parallel ranks
    assert (Path(cfg.output_dir) / "drafter" / "model.safetensors").exists()


def test_resuming_a_finished_colocated_dp_run_exits_cleanly(finished_dp_run):
    cfg, config, first, _ = finished_dp_run
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    again = subprocess.run(train_cmd(config, "--resume", "latest"), cwd=REPO, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert [r["step"] for r in metrics(Path(cfg.output_dir))] == list(range(1, 7))


def test_resuming_mid_run_continues_the_same_losses(tmp_path, finished_dp_run):
    """Resume from step 3 of the finished run (its later checkpoint moved away): steps 4-6 repeat its losses."""
    cfg, _, first, raw = finished_dp_run
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    full = {r["step"]: r["loss"] for r in metrics(Path(cfg.output_dir))}
    (tmp_path / "again" / "checkpoints").mkdir(parents=True)
    shutil.copytree(Path(cfg.output_dir) / "checkpoints" / "step_00000003",
                    tmp_path / "again" / "checkpoints" / "step_00000003")
    config = write_toml(dp_raw(dict(raw, output_dir=str(tmp_path / "again"))), tmp_path / "again.toml")
    out = subprocess.run(train_cmd(config, "--resume", "latest"), cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = metrics(tmp_path / "again")
    assert [r["step"] for r in got] == [4, 5, 6]
    for r in got:
        assert r["loss"] == pytest.approx(full[r["step"]], rel=1e-4), (r["step"], r["loss"], full[r["step"]])


class Exited:
    """A rank's process as the launcher sees it once it has exited with `code` (negative: killed by that signal)."""

    def __init__(self, code: int):
        self.returncode = code

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout=None) -> int:
        return self.returncode


def test_the_launcher_names_the_killed_rank_not_the_peer_its_death_failed(tmp_path):
    """kill -9 of rank 1 fails rank 0's next all-reduce over gloo (connection reset: exit 1 within a second); when
    the launcher's next look finds both gone, the killed rank is the one it names, in its line and outcome.json."""
    from dflash.config import config_from_dict

    cfg = config_from_dict({"output_dir": str(tmp_path), "topology": {"colocated_gpus": ["0", "1"]}})
    (tmp_path / "outcome.json").write_text(json.dumps({"ended": {"how": "crashed", "rank": 0, "detail": "gloo"}}))
    lines = []
    code = _watch(cfg, ranks_for(cfg), [Exited(1), Exited(-signal.SIGKILL)], log=lambda line, **_: lines.append(line))
    assert code == 1
    assert lines == ["rank 1 (colocated, GPU 1) was killed by SIGKILL; stopping the other 1 processes"]
    ended = json.loads((tmp_path / "outcome.json").read_text())["ended"]
    assert (ended["rank"], ended["role"], ended["gpu"], ended["detail"]) == (1, "colocated", "1",
                                                                             "was killed by SIGKILL"), ended


def test_killing_a_rank_ends_the_run_with_a_clear_message(tmp_path):
    """kill -9 of rank 1 (not the one that saves) mid-run: the launcher names it, stops rank 0, exits 1; the last
    checkpoint loads and a resume from it carries on from its step."""
    proc, run_dir, ranks = start_run(tmp_path, dp_raw, save_every=3, rows=4)
    dead = ranks[1]
    t0 = time.time()
    os.kill(dead["pid"], signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert time.time() - t0 < 60
    assert proc.returncode == 1, out[-2000:]
    assert f"rank 1 (colocated, GPU {dead['gpu']}) was killed by SIGKILL; stopping the other 1 processes" in out, \
        out[-2000:]
    assert_ranks_gone(ranks)
    from dflash.models.drafter import DFlashDrafter

    latest = rundir.list_checkpoints(run_dir)[-1]
    verify_checkpoint(latest)  # sizes and sha256 of every file
    DFlashDrafter.from_pretrained(latest / "drafter")  # still loadable
    ended = json.loads((run_dir / "outcome.json").read_text())["ended"]
    assert (ended["how"], ended["rank"], ended["role"], ended["gpu"]) == ("crashed", 1, "colocated", dead["gpu"]), ended
    assert ended["detail"].startswith("was killed by SIGKILL"), ended

    step = rundir.checkpoint_step(latest)
    proc, ranks = start_train(run_dir.parent / "run.toml", run_dir, step + 1, "--resume", "latest")
    out = cancel_run(proc, ranks)
    assert proc.returncode == 75, out[-3000:]
    assert f"resumed from {latest} at step {step}" in out, out[-3000:]
    steps = [r["step"] for r in metrics(run_dir)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > step, steps  # the killed run's later rows moved aside


def test_sigterm_to_every_process_stops_cleanly_with_a_checkpoint(tmp_path):
    """A scheduler's cancel signals the launcher and both ranks at once: they agree on the step to stop at, rank 0
    saves it, the run exits 75 (stopped, resumable); `--resume latest` goes on from exactly that step."""
    proc, run_dir, ranks = start_run(tmp_path, dp_raw, save_every=1000, rows=3)
    out = cancel_run(proc, ranks)
    assert proc.returncode == 75, out[-3000:]
    assert "stopped by SIGTERM" in out and (run_dir / "stopped.json").is_file(), out[-3000:]
    assert_ranks_gone(ranks)
    stopped = metrics(run_dir)[-1]["step"]
    last = rundir.list_checkpoints(run_dir)[-1]
    assert rundir.checkpoint_step(last) == stopped
    verify_checkpoint(last)
    ended = json.loads((run_dir / "outcome.json").read_text())["ended"]
    assert (ended["how"], ended["step"]) == ("stopped", stopped), ended

    proc, ranks = start_train(run_dir.parent / "run.toml", run_dir, stopped + 2, "--resume", "latest")
    out = cancel_run(proc, ranks)
    assert proc.returncode == 75, out[-3000:]
    assert f"resumed from {last} at step {stopped}" in out, out[-3000:]
    assert_ranks_gone(ranks)
    steps = [r["step"] for r in metrics(run_dir)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= stopped + 2, steps  # no gap, no repeat


@pytest.mark.slow
def test_torchrun_runs_a_colocated_dp_config_after_the_gate(tmp_path):
    cfg, raw = tiny_config(tmp_path, max_steps=3)
    config = write_toml(dp_raw(raw), tmp_path / "dp.toml")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "dflash.commands.torchrun", "--config", str(config), *WAIVE_SOURCE, "--fresh"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "preflight: ok on all 2 ranks" in out.stdout
    assert [r["step"] for r in metrics(Path(cfg.output_dir))] == [1, 2, 3]
    report = json.loads((Path(cfg.output_dir) / "preflight.json").read_text())
    assert report["ok"] is True and [r["role"] for r in report["run"]["ranks"]] == ["colocated"] * 2
