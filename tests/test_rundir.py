"""The run dir as dflash-train meets it: a read-only or full output dir is the gate's one-line failure, not a traceback.

The read-only and full dirs are real: a read-only bind mount and a filled 512 KiB tmpfs inside a
user namespace (``unshare -rm``), so they hold for root too, whom permission bits do not stop.
Without user namespaces a non-root user gets a chmod 555 folder, and the full-disk case is skipped.
"""

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
from dflash.runs.lock import lock_run_dir
from dflash.runs.metrics import trim_metrics
from dflash.runs.verify import checkpoint_problem
from trainkit import WAIVE_SOURCE, metrics, tiny_config, train_cmd, train_main_here, write_toml

REPO = Path(__file__).resolve().parent.parent


def _userns() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


USERNS = _userns()




def train(config: Path, *extra: str, confine: str | None = None, folder: Path | None = None):
    """dflash-train as a user runs it; confine="ro" mounts `folder` read-only, "full" puts a full tmpfs there."""
    cmd = train_cmd(config, *extra)
    if confine == "ro" and USERNS:
        setup = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0"'
        cmd = ["unshare", "-rm", "sh", "-c", f'{setup} && shift && exec "$@"', str(folder), "--", *cmd]
    elif confine == "full":
        setup = ('mount -t tmpfs -o size=512k tmpfs "$0" && mkdir "$0/run" && '
                 '(dd if=/dev/zero of="$0/fill" bs=4k 2>/dev/null; true)')
        cmd = ["unshare", "-rm", "sh", "-c", f'{setup} && shift && exec "$@"', str(folder), "--", *cmd]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)


def _checks_failed(stderr: str) -> dict[str, str]:
    return {line.split()[2].rstrip(":"): line for line in stderr.splitlines() if line.startswith("preflight: FAIL ")}


@pytest.mark.skipif(not USERNS and os.geteuid() == 0, reason="root ignores chmod and user namespaces are unavailable")
@pytest.mark.parametrize("intent", ["--fresh", "--resume"])
def test_read_only_output_dir_is_the_gates_run_dir_failure(tmp_path, intent):
    cfg, raw = tiny_config(tmp_path)
    out = Path(cfg.output_dir)
    step = rundir.checkpoint_path(out, 3)
    step.mkdir(parents=True)
    (step / rundir.META_NAME).write_text(json.dumps({"step": 3}))  # something a --fresh or --resume would move
    config = write_toml(raw, tmp_path / "run.toml")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    if not USERNS:
        out.chmod(0o555)
    try:
        proc = train(config, intent, *(["latest"] if intent == "--resume" else []), confine="ro", folder=out)
    finally:
        out.chmod(0o755)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    failed = _checks_failed(proc.stderr)
    assert list(failed) == ["run-dir"], proc.stderr
    why = "is on a read-only file system" if USERNS else "is not writable by this user"
    assert failed["run-dir"] == (f"preflight: FAIL run-dir: output dir {out} cannot be written: {out} {why}  fix: set "
                                 "output_dir in " + f"{config} to a writable folder with free space")
    assert proc.stderr.rstrip().splitlines()[-1].startswith("refusing to start: 1 preflight check(s) failed")
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing moved, nothing written


@pytest.mark.skipif(not USERNS, reason="needs a user namespace to mount a small tmpfs")
def test_full_output_dir_is_the_gates_run_dir_and_disk_failure(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    cfg, raw = tiny_config(tmp_path)
    raw["output_dir"] = str(disk / "run")
    config = write_toml(raw, tmp_path / "run.toml")
    proc = train(config, "--fresh", confine="full", folder=disk)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    failed = _checks_failed(proc.stderr)
    assert sorted(failed) == ["disk", "run-dir"], proc.stderr
    assert f"output dir {disk / 'run'} cannot be written: no space left on the file system of {disk / 'run'}" \
        in failed["run-dir"]
    assert "preflight: FAIL disk: 0.0 MiB free at" in failed["disk"]


def test_write_problem_names_what_stops_a_run(tmp_path):
    assert rundir.write_problem(tmp_path / "new" / "run") is None  # created on start under a writable parent
    (tmp_path / "file").write_text("")
    assert rundir.write_problem(tmp_path / "file" / "run") == f"{tmp_path / 'file'} exists and is not a directory"


def test_stop_marker_round_trip(tmp_path):
    assert rundir.read_stopped(tmp_path) is None
    rundir.write_stopped(tmp_path, "SIGTERM", 12, tmp_path / "checkpoints" / "step_00000012")
    marker = rundir.read_stopped(tmp_path)
    assert marker["signal"] == "SIGTERM" and marker["step"] == 12 and marker["exit_code"] == rundir.EXIT_STOPPED == 75
    rundir.clear_stopped(tmp_path)
    assert rundir.read_stopped(tmp_path) is None
    rundir.clear_stopped(tmp_path)  # nothing there: fine


def _wait_for_checkpoint(proc: subprocess.Popen, run_dir: Path) -> None:
    deadline = time.time() + 120
    while time.time() < deadline and not rundir.list_checkpoints(run_dir):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)


def test_a_second_trainer_on_a_busy_run_dir_is_refused_and_moves_nothing(tmp_path):
    """Two dflash-train on one output_dir: the second, with --resume latest or --fresh, is refused in one line (exit 2)
    naming the live one, before its gate moves anything; the first run goes on and ends with all its steps."""
    cfg, raw = tiny_config(tmp_path, max_steps=100000, save_every=5, keep_last=1000)
    config = write_toml(raw, tmp_path / "run.toml")
    run_dir = Path(cfg.output_dir)
    first = subprocess.Popen(train_cmd(config, "--fresh"), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        _wait_for_checkpoint(first, run_dir)
        owner = json.loads((run_dir / rundir.LOCK_NAME).read_text())
        assert owner["pid"] == first.pid
        seconds = [subprocess.Popen(train_cmd(config, *intent), cwd=REPO, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for intent in (["--resume", "latest"], ["--fresh"])]
        for second in seconds:
            out, err = second.communicate(timeout=120)
            assert second.returncode == 2, out + err
            assert err.splitlines() == [f"dflash-train: error: {run_dir} is in use by another trainer (pid {first.pid} "
                                        f"on {owner['host']} since {owner['time']}); wait for it to finish or stop it, "
                                        "or set another output_dir"], err
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        log, _ = first.communicate(timeout=120)
    assert first.returncode == 75, log[-3000:]
    rows = [json.loads(line)["step"] for line in (run_dir / rundir.METRICS_NAME).read_text().splitlines()]
    assert rows == list(range(1, rows[-1] + 1))  # every step once, nothing moved to metrics.abandoned-*
    saved = [rundir.checkpoint_step(c) for c in rundir.list_checkpoints(run_dir)]
    assert saved == sorted({*range(5, rows[-1] + 1, 5), rows[-1]})  # each save still there (keep_last 1000)
    assert all(checkpoint_problem(c, deep=True) is None for c in rundir.list_checkpoints(run_dir))
    assert sorted(p.name for p in run_dir.iterdir() if "abandoned" in p.name or p.name.startswith("replaced")) == []
    assert not (run_dir / rundir.LOCK_NAME).exists()  # released by the first run as it returned


def test_a_lock_left_by_a_killed_trainer_is_taken_over_and_said(tmp_path, capsys):
    cfg, raw = tiny_config(tmp_path, max_steps=2, save_every=1)
    config = write_toml(raw, tmp_path / "run.toml")
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs; the kernel dropped its flock when it died
    (run_dir / rundir.LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": "gpu-box", "time": "yesterday"}))
    assert train_main_here(config, "--fresh", *WAIVE_SOURCE) == 0
    out = capsys.readouterr().out
    assert (f"{run_dir / rundir.LOCK_NAME}: took over the lock of pid {dead.pid} on gpu-box (since yesterday), "
            "which no longer holds it (killed or crashed)") in out.splitlines()
    assert not (run_dir / rundir.LOCK_NAME).exists()


def test_the_lock_is_exclusive_and_released(tmp_path):
    with lock_run_dir(tmp_path / "run"):
        with pytest.raises(rundir.RunDirBusyError, match=f"pid {os.getpid()} on "):
            lock_run_dir(tmp_path / "run")
    with lock_run_dir(tmp_path / "run", log=pytest.fail):  # released cleanly: nothing to take over
        pass


def _limit_file_size(limit: int):
    """For a child: writes past `limit` bytes in one file fail with EFBIG (Python ignores SIGXFSZ) — real I/O."""
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))


def test_a_save_the_disk_refuses_is_one_line_and_the_previous_checkpoint_resumes(tmp_path):
    """The save at step 10 fails for real mid-write (torch.save of optimizer.pt meets a file size limit after the
    drafter's weights were written): one line naming the path and the fix, exit 1, no step_00000010.tmp left
    behind, and step 5 verifies and resumes to the end."""
    cfg, raw = tiny_config(tmp_path, max_steps=5, save_every=5)
    config = write_toml(raw, tmp_path / "run.toml")
    run_dir = Path(cfg.output_dir)
    assert subprocess.run(train_cmd(config, "--fresh"), cwd=REPO, capture_output=True).returncode == 0
    more = ("--resume", "latest", "--max-steps", "10", "--allow-schedule-change")
    # 250 kB: the drafter's weights (166 kB) fit, the optimizer state (342 kB) does not
    proc = subprocess.run(train_cmd(config, *more), cwd=REPO, capture_output=True, text=True,
                          preexec_fn=_limit_file_size(250_000))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "During handling" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"dflash-train: error: {rundir.checkpoints_dir(run_dir) / 'step_00000010.tmp'}: File too large (EFBIG); a file "
        "size limit was reached (ulimit -f, or the file system's maximum): raise it or move output_dir; then the last "
        "checkpoint step_00000005 is intact: resume with --resume latest"), proc.stderr
    assert sorted(p.name for p in rundir.checkpoints_dir(run_dir).iterdir()) == ["step_00000005"]
    assert checkpoint_problem(rundir.checkpoint_path(run_dir, 5), deep=True) is None
    again = subprocess.run(train_cmd(config, *more), cwd=REPO, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from {rundir.checkpoint_path(run_dir, 5)} at step 5" in again.stdout
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 11))


@pytest.mark.parametrize("async_save", [True, False], ids=["background-save", "sync-save"])
def test_a_full_disk_mid_run_is_one_line_even_when_the_clean_up_writes_fail_too(tmp_path, monkeypatch, capsys,
                                                                                  async_save):
    """ENOSPC halfway through the step-10 save (a real partial file, then the error), and the disk stays full: the
    clean-up's running.json write fails as well. One line (no second traceback), the .tmp gone, step 5 resumes.
    Written in the background, the error reaches the training thread at its next step: the same line."""
    import errno

    from dflash.runs import checkpoint as ckpt

    cfg, raw = tiny_config(tmp_path, max_steps=20, save_every=5, keep_last=2, async_save=async_save)
    config = write_toml(raw, tmp_path / "run.toml")
    run_dir = Path(cfg.output_dir)
    real_state, real_running = ckpt.save_trainer_state, rundir.write_running

    def full(path):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def save_state(folder, state):
        if state["step"] < 10:
            return real_state(folder, state)
        with open(Path(folder) / rundir.STATE_TENSORS, "wb") as f:
            f.write(b"\0" * 4096)  # what fitted before the disk filled
        raise full(Path(folder) / rundir.STATE_TENSORS)

    def write_running(output_dir, **extra):
        if extra.get("error"):
            raise full(Path(output_dir) / rundir.RUNNING_NAME)
        return real_running(output_dir, **extra)

    monkeypatch.setattr(ckpt, "save_trainer_state", save_state)
    monkeypatch.setattr(rundir, "write_running", write_running)
    assert train_main_here(config, "--fresh", *WAIVE_SOURCE) == 1
    err = capsys.readouterr().err.strip().splitlines()
    tmp = rundir.checkpoints_dir(run_dir) / "step_00000010.tmp"
    assert err[-1] == (f"dflash-train: error: {tmp / rundir.STATE_TENSORS}: No space left on device (ENOSPC); free "
                       "space on that file system (df -h) or move output_dir to a larger disk; then the last checkpoint "
                       "step_00000005 is intact: resume with --resume latest"), err
    assert not tmp.exists() and [c.name for c in rundir.list_checkpoints(run_dir)] == ["step_00000005"]
    monkeypatch.undo()
    assert train_main_here(config, "--resume", "latest", *WAIVE_SOURCE) == 0
    assert f"resumed from {rundir.checkpoint_path(run_dir, 5)} at step 5" in capsys.readouterr().out
    assert [c.name for c in rundir.list_checkpoints(run_dir)] == ["step_00000015", "step_00000020"]


# dflash-train in a child whose disk fills after the last checkpoint, just before the export (argv: the folder to
# fill, then dflash-train's arguments): everything the export writes meets a really full disk.
FILL_BEFORE_EXPORT = """
import sys
from pathlib import Path

from dflash.commands.train import train_main
from dflash.train.trainer import Trainer

export = Trainer._export


def fill_then_export(self, weights=None):
    with open(Path(sys.argv[1]) / "fill", "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(1 << 16))
        except OSError:
            pass
    return export(self, weights)


Trainer._export = fill_then_export
train_main(sys.argv[2:])
"""


@pytest.mark.skipif(not USERNS, reason="needs a user namespace to mount a small tmpfs")
def test_a_disk_that_fills_during_the_export_is_one_line_and_leaves_no_export(tmp_path, capsys):
    """The run's 5 steps and its checkpoint fit an 8 MiB tmpfs, which is full when the export starts: exit 1 and one
    line (safetensors' error as the disk gave it), no drafter/ nor drafter.tmp/ left, step 5 verifies, and the resume
    the line names writes the export once there is space (the run dir copied out of the namespace)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    cfg, raw = tiny_config(tmp_path, max_steps=5, save_every=5)
    raw["output_dir"] = str(disk / "run")
    config = write_toml(raw, tmp_path / "run.toml")
    setup = 'mount -t tmpfs -o size=8m tmpfs "$0" && "$@"; rc=$?; cp -a "$0/run" "$0.copy"; exit $rc'
    cmd = ["unshare", "-rm", "sh", "-c", setup, str(disk), sys.executable, "-c", FILL_BEFORE_EXPORT, str(disk),
           "--config", str(config), "--no-progress", "--fresh", *WAIVE_SOURCE]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "During handling" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"dflash-train: error: {disk / 'run' / rundir.DRAFTER_TMP}: No space left on device (ENOSPC); "
                      "free space on that file system (df -h) or move output_dir to a larger disk; then the last "
                      "checkpoint step_00000005 is intact: resume with --resume latest"], proc.stderr
    run_dir = tmp_path / "disk.copy"
    assert not (run_dir / rundir.DRAFTER_DIR).exists() and not (run_dir / rundir.DRAFTER_TMP).exists()
    assert [c.name for c in rundir.list_checkpoints(run_dir)] == ["step_00000005"]
    assert checkpoint_problem(rundir.checkpoint_path(run_dir, 5), deep=True) is None
    raw["output_dir"] = str(run_dir)
    assert train_main_here(write_toml(raw, tmp_path / "copy.toml"), "--resume", "latest", *WAIVE_SOURCE) == 0
    assert f"drafter saved to {run_dir / rundir.DRAFTER_DIR}" in capsys.readouterr().out
    assert sorted(p.name for p in (run_dir / rundir.DRAFTER_DIR).iterdir()) == ["config.json", "dflash.py", "model.safetensors"]
    assert not (run_dir / rundir.DRAFTER_TMP).exists()


def test_trim_metrics_keeps_rows_it_cannot_read_where_they_were(tmp_path):
    """A resume moves the rows logged after its step aside; odd rows (a step that is text, null, inf, a list, a
    number too long to convert, nesting too deep) and a torn last line stay, byte for byte, instead of crashing it."""
    odd = ['{"step": "abc"}', '{"step": null}', '{"step": 1e999}', "[1]", '{"step": ' + "7" * 5000 + "}",
           "[" * 100_000 + "]" * 100_000, '{"step": 1, "x": "a\u2028b"}']
    lines = ['{"step": 1}', *odd, '{"step": 3}', '{"step": 4}']
    (tmp_path / rundir.METRICS_NAME).write_text("".join(f"{line}\n" for line in lines) + '{"step": 5, "lo')
    said = []
    trim_metrics(tmp_path, 2, log=said.append)
    assert (tmp_path / rundir.METRICS_NAME).read_text() == "".join(f"{line}\n" for line in lines[:-2]) + '{"step": 5, "lo'
    assert said == [f"--resume: 2 metrics row(s) after step 2 moved to {next(tmp_path.glob('metrics.abandoned-*')).name}"]
