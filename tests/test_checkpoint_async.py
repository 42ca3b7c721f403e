"""Checkpoints written in the background (train.async_save): the same bytes as a save on the training thread, the
step loop going on while a save is written, and a kill -9 or SIGTERM mid-write leaving what a synchronous save
leaves (the previous checkpoint, a .tmp the next save of that step removes). A full disk: tests/test_rundir.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from dflash.runs import checkpoint as ckpt
from dflash.runs import rundir
from dflash.runs.verify import checkpoint_problem, read_meta
from dflash.train.trainer import run
from trainkit import WAIVE_SOURCE, metrics, tiny_config, train_cmd, train_main_here, write_toml

REPO = Path(__file__).resolve().parent.parent
SAVE_KEYS = ("save_stall_s", "save_wait_s")


def test_a_snapshot_is_a_copy_training_can_run_on_from():
    """The host copies do not move with the parameters and the optimizer state after the snapshot."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    host = ckpt.HostCopies()
    snap = ckpt.snapshot(1, model, opt, {"step": 1, "sampler": {"index": 2}, "rng_cpu": torch.get_rng_state()}, host)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    avg = opt.state_dict()["state"][0]["exp_avg"].clone()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert all(torch.equal(snap.weights[k], before[k]) for k in before)
    assert not torch.equal(snap.weights["weight"], model.weight.detach())
    assert torch.equal(snap.optimizer_state["state"][0]["exp_avg"], avg)
    assert snap.trainer_state["sampler"] == {"index": 2}


def _adam_after_one_step(device: str = "cpu"):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4, device=device)).sum().backward()
    opt.step()
    return model, opt


def test_a_reservation_covers_exactly_the_tensors_a_snapshot_copies():
    """reserve's keys (weights, then the optimizer state walked as HostCopies.tree walks it) are the keys snapshot
    copies the drafter and optimizer under: a reserved buffer is the one the first save uses."""
    model, opt = _adam_after_one_step()
    host, used = ckpt.HostCopies(), []
    real = host.copy
    host.copy = lambda key, t: used.append(key) or real(key, t)
    ckpt.snapshot(1, model, opt, {"step": 1, "rng_cpu": torch.get_rng_state()}, host)
    reserved = [("weights", k) for k in model.state_dict()] + [key for key, _ in ckpt._tensors("optimizer", opt.state_dict())]
    assert [k for k in used if k[0] != "trainer"] == reserved
    host.reserve(model, opt)  # CPU tensors: nothing to pin, nothing started
    assert host.ready() < 0.01 and host.reserve_s is None


def test_a_save_from_reserved_buffers_writes_the_bytes_of_a_save_from_the_live_state(tmp_path, monkeypatch):
    """Buffers reserved ahead (here unpinned: this machine has no CUDA driver to pin with) hold one tensor each, so the
    checkpoint's files are byte for byte those a save from the live tensors writes (a shared block would have put the
    weights into optimizer.pt too)."""
    from dflash.train.trainer import Trainer

    cfg, _ = tiny_config(tmp_path, max_steps=2)
    trainer = Trainer.colocated(cfg, None, log=lambda *a, **k: None)
    trainer.train_step(next(trainer.step_batches())[2])  # the optimizer has its state
    model, opt = trainer.drafter, trainer.optimizer
    host = ckpt.HostCopies()
    specs = [(("weights", k), v) for k, v in model.state_dict().items()] + ckpt._tensors("optimizer", opt.state_dict())
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **kw: empty(*a, **kw))
    host._pin([(key, t.shape, t.dtype) for key, t in specs])
    monkeypatch.setattr(torch, "empty", empty)
    assert host.reserve_s is not None and len(host._buffers) == len(specs)
    state = {"step": 1, "rng_cpu": torch.get_rng_state()}
    meta = {"path": "data", "samples": 1, "fingerprint": "f"}
    reserved = ckpt.write_checkpoint(tmp_path / "a", ckpt.snapshot(1, model, opt, dict(state), host), cfg, meta, 1)
    assert all(host._buffers[("weights", k)].untyped_storage().nbytes() == v.nbytes for k, v in model.state_dict().items())
    live = ckpt.write_checkpoint(tmp_path / "b", ckpt.snapshot(1, model, opt, dict(state)), cfg, meta, 1)
    fa, fb = _files(reserved), _files(live)
    assert fa.keys() == fb.keys() and [k for k in fa if fa[k] != fb[k] and k != rundir.META_NAME] == []


def test_a_save_superseded_while_its_optimizer_state_is_written_is_given_up_not_failed(tmp_path, monkeypatch):
    """A newer save (or a stop's) cancels the one in flight; when that lands inside torch.save of the optimizer state,
    torch's zip writer ends the file on the way out and raises its own RuntimeError over the cancel. The write says
    SaveCancelled (the run goes on), leaves no checkpoint and no .tmp; a real write error is still raised as it is."""
    import threading

    from dflash.train.trainer import Trainer

    cfg, _ = tiny_config(tmp_path, max_steps=2)
    trainer = Trainer.colocated(cfg, None, log=lambda *a, **k: None)
    trainer.train_step(next(trainer.step_batches())[2])  # the optimizer has its state
    snap = ckpt.snapshot(1, trainer.drafter, trainer.optimizer, {"step": 1, "rng_cpu": torch.get_rng_state()})
    meta = {"path": "data", "samples": 1, "fingerprint": "f"}
    cancel, writes = threading.Event(), []
    write = ckpt._HashingFile.write

    def superseded_on_the_third_write(self, data):
        writes.append(len(memoryview(data).cast("B")))
        if len(writes) == 3:
            cancel.set()
        return write(self, data)

    monkeypatch.setattr(ckpt._HashingFile, "write", superseded_on_the_third_write)
    with pytest.raises(ckpt.SaveCancelled):
        ckpt.write_checkpoint(tmp_path / "a", snap, cfg, meta, 1, cancel=cancel)
    assert len(writes) == 3 and rundir.list_checkpoints(tmp_path / "a") == []
    assert not list(rundir.checkpoints_dir(tmp_path / "a").glob("*.tmp"))

    def disk_error(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt._HashingFile, "write", disk_error)
    with pytest.raises(Exception) as failed:
        ckpt.write_checkpoint(tmp_path / "b", snap, cfg, meta, 1, cancel=threading.Event())
    assert not isinstance(failed.value, ckpt.SaveCancelled)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pinned host memory)")
def test_on_cuda_the_first_snapshot_copies_into_the_reserved_pinned_block():
    model, opt = _adam_after_one_step("cuda")
    host = ckpt.HostCopies()
    host.reserve(model, opt)
    host.ready()
    assert host.reserve_s is not None
    reserved = dict(host._buffers)
    snap = ckpt.snapshot(1, model, opt, {"step": 1}, host)
    assert all(snap.weights[k] is reserved[("weights", k)] and snap.weights[k].is_pinned() for k in snap.weights)
    assert all(torch.equal(snap.weights[k], v.cpu()) for k, v in model.state_dict().items())
    avg = snap.optimizer_state["state"][0]["exp_avg"]
    assert avg is reserved[((("optimizer", "state"), 0), "exp_avg")]
    assert torch.equal(avg, opt.state_dict()["state"][0]["exp_avg"].cpu())


def _files(checkpoint: Path) -> dict[str, bytes]:
    return {p.relative_to(checkpoint).as_posix(): p.read_bytes() for p in sorted(checkpoint.rglob("*")) if p.is_file()}


def test_a_background_save_writes_the_bytes_a_synchronous_one_does(tmp_path):
    """The same tiny run with train.async_save true and false: the same checkpoints, file for file and byte for byte
    (meta.json: the same recorded sizes and sha256, which verify), and every save step's row has its timings."""
    runs = {}
    for background in (True, False):
        cfg, _ = tiny_config(tmp_path / str(background), max_steps=6, save_every=2, keep_last=2,
                             async_save=background)
        assert run(cfg, None, log=lambda *_: None, progress=False) == 0
        runs[background] = Path(cfg.output_dir)
    saved = {b: rundir.list_checkpoints(out) for b, out in runs.items()}
    assert [c.name for c in saved[True]] == [c.name for c in saved[False]] == ["step_00000004", "step_00000006"]
    assert not list(rundir.checkpoints_dir(runs[True]).glob("*.tmp"))
    for a, b in zip(saved[True], saved[False]):
        fa, fb = _files(a), _files(b)
        assert fa.keys() == fb.keys()
        assert [k for k in fa if fa[k] != fb[k]] == [rundir.META_NAME]  # its time and output_dir differ
        assert read_meta(a)[rundir.FILES_KEY] == read_meta(b)[rundir.FILES_KEY]
        assert checkpoint_problem(a, deep=True) is None
    for background, out in runs.items():
        rows = {r["step"]: r for r in metrics(out)}
        assert all(k in rows[s] for s in (2, 4, 6) for k in SAVE_KEYS), rows
        assert all("save_stall_s" not in rows[s] for s in (1, 3, 5))
        if not background:  # written on the training thread: the write is the stall
            assert all(rows[s]["save_write_s"] <= rows[s]["save_stall_s"] for s in (2, 4, 6))
        else:  # a background write's time rides on the first row logged after it finished
            assert {r["save_step"] for r in rows.values() if "save_write_s" in r} >= {2, 4}


def test_the_step_loop_goes_on_while_a_save_is_written(tmp_path, monkeypatch):
    """The step-5 save's hashing is held until the loop has logged step 6: it can only finish because training went
    on while it was written. The run then ends as usual, every checkpoint verifying."""
    cfg, raw = tiny_config(tmp_path, max_steps=10, save_every=5, keep_last=2)
    config = write_toml(raw, tmp_path / "run.toml")
    out = Path(cfg.output_dir)
    real = ckpt.sha256_file
    seen = {}

    def slow_sha256(path):
        if "step_00000005.tmp" in str(path) and "step6" not in seen:
            deadline = time.monotonic() + 120  # a failure's bound only: the loop normally logs step 6 in milliseconds
            while time.monotonic() < deadline and not any(r["step"] >= 6 for r in _rows(out)):
                time.sleep(0.01)
            seen["step6"] = any(r["step"] >= 6 for r in _rows(out))
            seen["meta_before"] = (Path(path).parent / rundir.META_NAME).exists() or \
                (Path(path).parent.parent / rundir.META_NAME).exists()
        return real(path)

    monkeypatch.setattr(ckpt, "sha256_file", slow_sha256)
    assert train_main_here(config, "--fresh", *WAIVE_SOURCE) == 0
    assert seen == {"step6": True, "meta_before": False}
    rows = {r["step"]: r for r in metrics(out)}
    assert all(k in rows[5] for k in SAVE_KEYS) and "save_write_s" not in rows[5]
    written = [r for r in rows.values() if r.get("save_step") == 5]
    assert len(written) == 1 and written[0]["step"] > 5  # logged once the write had finished, after step 5
    assert [c.name for c in rundir.list_checkpoints(out)] == ["step_00000005", "step_00000010"]
    assert all(checkpoint_problem(c, deep=True) is None for c in rundir.list_checkpoints(out))


def _rows(out: Path) -> list[dict]:
    try:
        lines = (out / rundir.METRICS_NAME).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _slow_saves(seconds: float) -> dict:
    return {**os.environ, ckpt.SAVE_DELAY_ENV: str(seconds)}


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and not path.exists():
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.02)
    assert path.exists(), f"{path} never appeared"


def test_kill_9_mid_background_write_resumes_from_the_previous_checkpoint(tmp_path):
    """SIGKILL while step 10 is written in the background (every save sleeps 3 s before meta.json): the folder
    stays a .tmp, --resume latest takes step 5, and the resumed run's own step-10 save replaces the .tmp."""
    cfg, raw = tiny_config(tmp_path, max_steps=15, save_every=5, keep_last=3)
    config = write_toml(raw, tmp_path / "run.toml")
    out = Path(cfg.output_dir)
    proc = subprocess.Popen(train_cmd(config, "--fresh"), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_slow_saves(3))
    tmp = rundir.checkpoints_dir(out) / "step_00000010.tmp"
    _wait_for(tmp / rundir.STATE_JSON, proc)  # every file written; the writer sleeps before meta.json
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert tmp.is_dir() and not (tmp / rundir.META_NAME).exists()
    assert [c.name for c in rundir.list_checkpoints(out)] == ["step_00000005"]
    again = subprocess.run(train_cmd(config, "--resume", "latest"), cwd=REPO, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from {rundir.checkpoint_path(out, 5)} at step 5" in again.stdout
    assert not tmp.exists() and not list(rundir.checkpoints_dir(out).glob("*.tmp"))
    assert [c.name for c in rundir.list_checkpoints(out)] == ["step_00000005", "step_00000010", "step_00000015"]
    assert all(checkpoint_problem(c, deep=True) is None for c in rundir.list_checkpoints(out))


def test_sigterm_mid_background_write_gives_it_up_for_the_stops_own_and_resumes_exactly(tmp_path):
    """SIGTERM while the step-5 save is written in the background: the run finishes its step and gives that write up
    for the stop's own checkpoint (waiting for it would spend the scheduler's grace), exits 75 with no .tmp left and
    says so; the resumed run's losses equal an uninterrupted run's."""
    ref_cfg, _ = tiny_config(tmp_path / "ref", max_steps=20, save_every=5)
    assert run(ref_cfg, None, log=lambda *_: None, progress=False) == 0
    ref = {r["step"]: r for r in metrics(Path(ref_cfg.output_dir))}

    cfg, raw = tiny_config(tmp_path / "stopped", max_steps=20, save_every=5)
    config = write_toml(raw, tmp_path / "run.toml")
    out = Path(cfg.output_dir)
    proc = subprocess.Popen(train_cmd(config, "--fresh"), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_slow_saves(2))
    _wait_for(rundir.checkpoints_dir(out) / "step_00000005.tmp" / rundir.STATE_JSON, proc)
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, text
    assert "the save still being written is given up for the stop's own checkpoint" in text
    saved = rundir.list_checkpoints(out)
    stopped_at = metrics(out)[-1]["step"]
    assert saved == [rundir.checkpoint_path(out, stopped_at)] and 5 < stopped_at < 20
    assert not list(rundir.checkpoints_dir(out).glob("*.tmp"))
    assert all(checkpoint_problem(c, deep=True) is None for c in saved)
    assert any(r.get("save_step") == 5 and r.get("save_superseded") for r in metrics(out))
    marker = json.loads((out / rundir.STOPPED_NAME).read_text())
    assert marker["step"] == stopped_at and marker["checkpoint"] == str(saved[-1])
    ended = json.loads((out / "outcome.json").read_text())["ended"]
    assert ended["how"] == "stopped" and ended["stop"]["superseded"] and ended["stop"]["total_s"] >= 0
    again = subprocess.run(train_cmd(config, "--resume", "latest"), cwd=REPO, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from {saved[-1]} at step {stopped_at}" in again.stdout
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 21))
    for r in rows:
        assert r["loss"] == pytest.approx(ref[r["step"]]["loss"], rel=1e-5, abs=1e-6), r["step"]


def test_sigterm_twice_to_the_process_group_stops_with_75_every_time(tmp_path):
    """A scheduler's cancel signals the whole process group, and a launcher (uv run) forwards the same signal: the
    second SIGTERM can land after the loop returned. It must never turn a clean stop into a kill (exit 143)."""
    cfg, raw = tiny_config(tmp_path, max_steps=5000, save_every=1000)
    config = write_toml(raw, tmp_path / "run.toml")
    out = Path(cfg.output_dir)
    for attempt in range(2):
        proc = subprocess.Popen(train_cmd(config, "--fresh" if attempt == 0 else "--resume", *(["latest"] if attempt
                                                                                               else [])),
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        rows = len(metrics(out)) if (out / "metrics.jsonl").exists() else 0
        deadline = time.time() + 120
        while time.time() < deadline and len(metrics(out) if (out / "metrics.jsonl").exists() else []) <= rows:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        text, _ = proc.communicate(timeout=120)
        assert proc.returncode == 75, text
        assert "stopped by SIGTERM at step" in text and "s from the signal to the checkpoint" in text
        last = rundir.list_checkpoints(out)[-1]
        assert checkpoint_problem(last, deep=True) is None
        ended = json.loads((out / "outcome.json").read_text())["ended"]
        assert ended["how"] == "stopped" and ended["step"] == int(last.name.split("_")[1])


def test_kill_9_while_stopping_keeps_the_previous_checkpoint_and_says_stopping(tmp_path):
    """SIGTERM, then SIGKILL while the stop's checkpoint is written (a scheduler's grace ran out): the run dir keeps
    the checkpoint before it, outcome.json says the run was stopping (never "running"), and --resume latest goes on
    from the earlier checkpoint."""
    cfg, raw = tiny_config(tmp_path, max_steps=200, save_every=5)
    config = write_toml(raw, tmp_path / "run.toml")
    out = Path(cfg.output_dir)
    proc = subprocess.Popen(train_cmd(config, "--fresh"), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_slow_saves(4))
    _wait_for(rundir.checkpoints_dir(out) / "step_00000005" / rundir.META_NAME, proc)
    while proc.poll() is None and metrics(out)[-1]["step"] < 6:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    deadline = time.time() + 60
    while time.time() < deadline and json.loads((out / "outcome.json").read_text())["ended"]["how"] != "stopping":
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.02)
    tmp = next(iter(rundir.checkpoints_dir(out).glob("*.tmp")), None)
    while time.time() < deadline and tmp is None:
        time.sleep(0.02)
        tmp = next(iter(rundir.checkpoints_dir(out).glob("*.tmp")), None)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ended = json.loads((out / "outcome.json").read_text())["ended"]
    assert ended["how"] == "stopping" and "killed while stopping" in ended["detail"]
    saved = rundir.list_checkpoints(out)
    assert saved and saved[-1] != tmp and all(checkpoint_problem(c, deep=True) is None for c in saved)
    again = subprocess.run(train_cmd(config, "--resume", "latest", "--max-steps", str(int(saved[-1].name[5:]) + 1),
                                     "--allow-schedule-change"),
                           cwd=REPO, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from {saved[-1]}" in again.stdout


def test_the_first_step_says_how_long_a_stop_will_take_on_this_disk(tmp_path, monkeypatch):
    """A checkpoint of STOP_NOTE_BYTES or more: the first step measures the disk (a probe file, removed) and says how
    long the stop's write will take, so a scheduler's grace can be set above it."""
    import dflash.train.trainer as trainer

    monkeypatch.setattr(trainer, "STOP_NOTE_BYTES", 0)
    cfg, _ = tiny_config(tmp_path, max_steps=2, save_every=1000)
    lines = []
    assert run(cfg, None, log=lines.append, progress=False) == 0
    said = [x for x in lines if x.startswith("a stop (SIGTERM/SIGINT) finishes the step in flight, then writes ")]
    assert len(said) == 1 and " GB/s (this disk, measured): about " in said[0], lines
    nbytes = ckpt.state_bytes(torch.nn.Linear(2, 2), torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()))
    assert nbytes == 6 * 4  # weights and bias; no optimizer state before a step
    assert not (Path(cfg.output_dir) / ".disk-probe.tmp").exists()
