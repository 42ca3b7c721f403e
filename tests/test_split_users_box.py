"""Split runs at the users' shape on CPU: 5 target + 3 drafter processes over gloo (the split of the 8-GPU preset),
and 6 + 2 accumulating batches, with the tiny models; how a run of eight ranks ends when one dies or all are stopped.

Eight processes on two cores take ~30 s to start, so one 5 + 3 run, killed and resumed until it finishes, is read by
every 5 + 3 test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from dflash.runs import rundir
from dflash.runs.verify import checkpoint_problem
from dflash.train.trainer import run
from trainkit import REPO, cancel_run, metrics, split_raw, start_train, tiny_config, train_cmd, write_toml

pytestmark = pytest.mark.slow  # every test here runs eight processes (or reads a run that did)

STEPS = 14  # of the 5 + 3 run: 3 batches a step, 9 an epoch; its three faults land by step ~10
RECORD = {"DFLASH_CHECK_REPLICAS": "1", "DFLASH_RECORD_BATCHES": "1"}  # rows carry replica_max_diff and batches


def split(raw: dict, targets: int, drafters: int) -> dict:
    return split_raw(raw, targets=[str(g) for g in range(targets)],
                     drafters=[str(g) for g in range(targets, targets + drafters)])


def colocated(root: Path, **train) -> list[dict]:
    """The metrics rows of the tiny preset trained in this process on one device, batches recorded."""
    cfg, _ = tiny_config(root, **train)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_RECORD_BATCHES", "1")
        run(cfg, None, log=lambda *_: None, progress=False)
    return metrics(Path(cfg.output_dir))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The 5 + 3 run's batches on one device: a co-located run accumulating 3 batches a step."""
    return colocated(tmp_path_factory.mktemp("ref"), max_steps=STEPS, grad_accum=3)


@pytest.fixture(scope="module")
def faulted_run(tmp_path_factory):
    """One 5 + 3 run of STEPS steps (a save every 2) through three faults, each resumed with --resume latest: kill -9
    of target rank 5 once 3 rows are logged, kill -9 of drafter rank 2 two rows after its resume, SIGTERM to every
    process two rows after the next; a fourth launch finishes it. (run dir, {fault: what it left}, the last launch's
    completed process.)"""
    root = tmp_path_factory.mktemp("users-box")
    cfg, raw = tiny_config(root, max_steps=STEPS, save_every=2)
    config = write_toml(split(raw, 5, 3), root / "run.toml")
    run_dir, env = Path(cfg.output_dir), dict(os.environ, **RECORD)
    faults, start = {}, 0
    for fault, args in (("target", ("--fresh",)), ("drafter", ("--resume", "latest")), ("sigterm", ("--resume", "latest"))):
        proc, ranks = start_train(config, run_dir, start + (3 if fault == "target" else 2), *args, env=env)
        victim = {"target": 5, "drafter": 2}.get(fault)
        t0 = time.time()
        if victim is None:
            out = cancel_run(proc, ranks)
        else:
            os.kill(ranks[victim]["pid"], signal.SIGKILL)
            out = proc.communicate(timeout=90)[0]
        checkpoint = rundir.list_checkpoints(run_dir)[-1]
        faults[fault] = {"code": proc.returncode, "out": out, "s": time.time() - t0, "victim": victim and ranks[victim],
                         "alive": [r for r in ranks if alive(r["pid"])], "rows": metrics(run_dir),
                         "checkpoint": checkpoint, "problem": checkpoint_problem(checkpoint, deep=True),  # sizes, sha256
                         "ended": json.loads((run_dir / "outcome.json").read_text())["ended"]}
        start = int(checkpoint.name.split("_")[1])
    last = subprocess.run(train_cmd(config, "--resume", "latest"), cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=300)
    return run_dir, faults, last


def test_five_targets_three_drafters_match_colocated_and_replicas_stay_identical(faulted_run, reference):
    """Through two kills, a stop and three resumes, every step's loss is the co-located run's (3 batches a step) and
    the three drafter replicas stay identical."""
    run_dir, _, last = faulted_run
    assert last.returncode == 0, last.stdout[-3000:] + last.stderr[-3000:]
    got = metrics(run_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(got, reference):
        assert a["replica_max_diff"] == 0.0, a
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a["step"], a["loss"], b["loss"])
    assert got[-1]["n_targets"] == 5 and got[-1]["n_drafters"] == 3


def test_every_batch_of_an_epoch_is_trained_once_at_five_plus_three(faulted_run, reference):
    """What the drafter ranks trained (each row's batches: global index and sample ids, gathered from the three
    ranks) is the co-located run's, batch for batch; each epoch trains every sample once."""
    run_dir, _, _ = faulted_run
    rows = metrics(run_dir)
    assert [r["batches"] for r in rows] == [r["batches"] for r in reference]
    assert [k for r in rows for k, _ in r["batches"]] == list(range(3 * STEPS))
    by_epoch: dict[int, list[int]] = {}
    for r in rows:
        by_epoch.setdefault(r["epoch"], []).extend(i for _, ids in r["batches"] for i in ids)
    *full, partial = by_epoch.values()
    assert len(full) == 4 and all(sorted(ids) == list(range(64)) for ids in full), by_epoch
    assert max(Counter(partial).values()) == 1  # the unfinished epoch: no sample twice


@pytest.mark.parametrize("fault", ["target", "drafter", "sigterm"])
def test_a_fault_at_five_plus_three_ends_in_one_line_and_resumes(faulted_run, fault):
    """kill -9 of a target rank, of a drafter rank, SIGTERM to every process: each run ends in seconds with the exit
    of its kind (1, 1, 75), one line naming the dead rank (or the stop) and no traceback from any rank (the ranks that
    saw a peer go leave quietly); no rank is left, its last checkpoint verifies, and the launch resuming it gives the
    same losses for the steps it trained again."""
    run_dir, faults, last = faulted_run
    f = faults[fault]
    out = f["out"]
    assert "Traceback" not in out and "Error" not in out, out[-4000:]
    assert f["s"] < 60 and f["alive"] == [], (f["s"], f["alive"])
    named = [line for line in out.splitlines() if " was killed by " in line or " exited with code " in line]
    if fault == "sigterm":
        assert f["code"] == 75 and named == [], out[-3000:]
        stopped = [line for line in out.splitlines() if line.startswith("stopped by SIGTERM")]
        head = f"stopped by SIGTERM at step {f['rows'][-1]['step']}; checkpoint {f['checkpoint']}; "
        assert len(stopped) == 1 and stopped[0].startswith(head), out[-3000:]
        assert " s from the signal to the checkpoint (the step in flight " in stopped[0], stopped[0]
        assert f["ended"]["how"] == "stopped"
    else:
        v = f["victim"]
        assert f["code"] == 1, out[-3000:]
        assert named == [f"rank {v['rank']} ({fault}, GPU {v['gpu']}) was killed by SIGKILL; stopping the other 7 "
                         "processes"], out[-3000:]
        assert (f["ended"]["how"], f["ended"]["rank"], f["ended"]["role"], f["ended"]["detail"]) == (
            "crashed", v["rank"], fault, "was killed by SIGKILL"), f["ended"]
        assert "SIGTERM: finishing this step" not in out  # the survivors left on their own, no stop was begun
    assert f["problem"] is None, f["problem"]  # its last checkpoint, as the fault left it (later saves rotate it out)
    assert f["rows"][-1]["step"] >= int(f["checkpoint"].name.split("_")[1])
    final = {r["step"]: r["loss"] for r in metrics(run_dir)}
    assert last.returncode == 0, last.stderr[-3000:]
    for r in f["rows"]:  # past the checkpoint: trained again by the resumed launch
        assert final[r["step"]] == pytest.approx(r["loss"], rel=1e-6), (r["step"], r["loss"], final[r["step"]])


def test_six_targets_two_drafters_accumulating_match_colocated(tmp_path):
    """The uneven split (6 targets feed 2 drafters: target t only ever feeds drafter t % 2) with grad_accum 2 on each
    drafter: every step's loss is a co-located run's accumulating 4 batches, the replicas stay identical and the 9
    steps train 4 epochs of 9 batches, each sample once an epoch."""
    steps = 9
    ref = colocated(tmp_path / "ref", max_steps=steps, grad_accum=4)
    cfg, raw = tiny_config(tmp_path / "split", max_steps=steps, grad_accum=2)
    config = write_toml(split(raw, 6, 2), tmp_path / "split.toml")
    out = subprocess.run(train_cmd(config, "--fresh"), cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, **RECORD))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stdout + out.stderr
    got = metrics(Path(cfg.output_dir))
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    for a, b in zip(got, ref):
        assert a["replica_max_diff"] == 0.0, a
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a["step"], a["loss"], b["loss"])
    assert [r["batches"] for r in got] == [r["batches"] for r in ref]
    batches = [ids for r in got for _, ids in r["batches"]]
    assert len(batches) == 36
    for e in range(4):
        assert sorted(i for ids in batches[9 * e:9 * e + 9] for i in ids) == list(range(64)), e
