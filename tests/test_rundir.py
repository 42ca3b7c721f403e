"""The run dir as dflash-train meets it: a read-only or full output dir is the gate's one-line failure, not a traceback.

The read-only and full dirs are real: a read-only bind mount and a filled 512 KiB tmpfs inside a
user namespace (``unshare -rm``), so they hold for root too, whom permission bits do not stop.
Without user namespaces a non-root user gets a chmod 555 folder, and the full-disk case is skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dflash.runs import rundir
from trainkit import tiny_config, train_cmd, write_toml

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


def test_trim_metrics_keeps_rows_it_cannot_read_where_they_were(tmp_path):
    """A resume moves the rows logged after its step aside; odd rows (a step that is text, null, inf, a list, a
    number too long to convert, nesting too deep) and a torn last line stay, byte for byte, instead of crashing it."""
    odd = ['{"step": "abc"}', '{"step": null}', '{"step": 1e999}', "[1]", '{"step": ' + "7" * 5000 + "}",
           "[" * 100_000 + "]" * 100_000, '{"step": 1, "x": "a\u2028b"}']
    lines = ['{"step": 1}', *odd, '{"step": 3}', '{"step": 4}']
    (tmp_path / rundir.METRICS_NAME).write_text("".join(f"{line}\n" for line in lines) + '{"step": 5, "lo')
    said = []
    rundir.trim_metrics(tmp_path, 2, log=said.append)
    assert (tmp_path / rundir.METRICS_NAME).read_text() == "".join(f"{line}\n" for line in lines[:-2]) + '{"step": 5, "lo'
    assert said == [f"--resume: 2 metrics row(s) after step 2 moved to {next(tmp_path.glob('metrics.abandoned-*')).name}"]
