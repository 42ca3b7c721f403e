"""Split runs on CPU over gloo: 1 target + 2 drafter processes, real torch.distributed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.memory.pace import split_tok_s, suggest_split
from dflash.runs import rundir
from dflash.runs.lock import lock_run_dir
from dflash.train.features import RemoteTargets
from dflash.train.launch import cpu_threads_per_rank, physical_gpu
from dflash.train.layout import Rank, ranks_for
from dflash.train.trainer import run
from trainkit import REPO, assert_ranks_gone, cancel_run, metrics, split_raw, start_run, tiny_config, train_cmd, write_toml


def test_roles_by_rank_for_the_incident_split():
    from dflash.config import config_from_dict

    cfg = config_from_dict({"topology": {"target_gpus": ["0", "1", "2", "3", "4"], "drafter_gpus": ["5", "6", "7"]}})
    roles = ranks_for(cfg)
    assert [(r.rank, r.role, r.index, r.gpu) for r in roles] == [
        (0, "drafter", 0, "5"), (1, "drafter", 1, "6"), (2, "drafter", 2, "7"),
        (3, "target", 0, "0"), (4, "target", 1, "1"), (5, "target", 2, "2"), (6, "target", 3, "3"), (7, "target", 4, "4")]
    # batch k: target k % 5 computes it, drafter k % 3 trains it at step k // 3
    pairs = {(3 + k % 5, k % 3) for k in range(15)}
    assert len(pairs) == 15  # every target feeds every drafter over 15 batches: no idle pair


def test_physical_gpu_maps_through_cuda_visible_devices():
    assert physical_gpu("1", "4,5,6") == "5"
    assert physical_gpu("GPU-abc", "4,5") == "GPU-abc"
    assert physical_gpu("3", None) == "3"
    with pytest.raises(ValueError, match="not visible"):
        physical_gpu("3", "0,1")


def test_suggested_split_is_the_argmax_of_the_slower_side():
    """The split that trains the most tokens/s: min(t x target rate, d x drafter rate), every t tried."""
    # the users' Qwen3.6-27B job (busy: target 9.8K, drafter 41K per GPU): 7+1 gives min(68.6K, 41K) = 41K,
    # 6+2 gives min(58.8K, 82K) = 58.8K, 5+3 gives min(49K, 123K) = 49K
    assert suggest_split(8, 9_800, 41_000) == (6, 2)
    assert split_tok_s(6, 2, 9_800, 41_000) == pytest.approx(58_800)
    # target 12.7K, drafter 16.5K: 4+4 gives min(50.8K, 66K) = 50.8K, 5+3 gives min(63.5K, 49.5K) = 49.5K
    assert suggest_split(8, 12_700, 16_500) == (4, 4)
    for n, x, y in ((8, 9_800, 41_000), (8, 12_700, 16_500), (8, 30_000, 6_000), (5, 1_000, 7_000), (2, 1, 1)):
        t, d = suggest_split(n, x, y)
        assert t + d == n and split_tok_s(t, d, x, y) == max(split_tok_s(k, n - k, x, y) for k in range(1, n))
    assert suggest_split(8, 10_000, 6_000) == (3, 5)
    assert suggest_split(8, 30_000, 6_000) == (2, 6)  # 36K; rounding the rate share gave 1+7 (30K)
    assert suggest_split(2, 1, 1) == (1, 1)


def test_summary_prints_busy_rates_and_the_split_they_suggest():
    source = object.__new__(RemoteTargets)  # summary reads only the rank layout
    source.me = Rank(0, 2, 1, 1, "drafter", "1")
    rows = [{"target_tok_s_per_gpu": 9_600, "drafter_tok_s_per_gpu": 40_000},
            {"step": 20, "heldout_loss": 1.0},  # a row without rates is not averaged
            {"target_tok_s_per_gpu": 10_000, "drafter_tok_s_per_gpu": 42_000}]
    assert source.summary(rows).splitlines() == [
        "busy: target 9800 tok/s per GPU, drafter 41000 tok/s per GPU (mean of 2 logged window(s), the first left out)",
        "suggested split for 2 GPUs: 1 target + 1 drafter, expected 9800 tok/s",
        "suggested split for 8 GPUs: 6 target + 2 drafter, expected 58800 tok/s"]
    assert source.summary([]).startswith("no per-role rates past the first logged window")


def test_cpu_ranks_share_the_cores_out():
    assert cpu_threads_per_rank(3, cores=2) == 1  # more ranks than cores: one thread each, never 0
    assert cpu_threads_per_rank(3, cores=16) == 5
    assert cpu_threads_per_rank(1, cores=16) == 16


def test_a_closed_peer_is_told_from_a_real_error():
    """What makes a rank leave quietly (EXIT_PEER_GONE): gloo's words for a peer whose process is gone, in a
    RuntimeError; a timeout, a shape error or another exception type is raised as it is."""
    from dflash.train.ranks import peer_gone

    assert peer_gone(RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by "
                                  "peer [127.0.0.1]:431"))
    assert peer_gone(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:5: "
                                  "Connection reset by peer"))
    assert not peer_gone(RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for "
                                      "recv operation to complete"))
    assert not peer_gone(RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x64 and 32x64)"))
    assert not peer_gone(ValueError("Connection closed by peer"))


def _watched(tmp_path, *ranks: str) -> tuple[int, list[str]]:
    """The launcher's watch (dflash.train.launch._watch) over 1 target + 2 drafters played by real processes, each
    ending as its Python line says: (the launcher's exit code, its lines)."""
    from dflash.config import config_from_dict
    from dflash.train.launch import _watch

    cfg = config_from_dict(split_raw({"output_dir": str(tmp_path / "run")}))
    procs = [subprocess.Popen([sys.executable, "-c", f"import os, signal, sys, time; {line}"]) for line in ranks]
    lines: list[str] = []
    return _watch(cfg, ranks_for(cfg), procs, log=lambda line, **_: lines.append(line)), lines


def test_the_launcher_names_the_rank_that_is_gone_not_the_ranks_that_saw_it_go(tmp_path, monkeypatch):
    """Ranks that left because a peer is gone (exit 3) wait to be explained: by a rank a signal killed after them, by
    a rank's real error, or by the drafters finishing (a stop: drafters saved and left while targets still sent);
    left unexplained, one of them is named."""
    import dflash.train.launch as launch

    monkeypatch.setattr(launch, "PEER_GONE_WAIT_S", 1.0)
    gone, killed = "sys.exit(3)", "time.sleep(0.3); os.kill(os.getpid(), signal.SIGKILL)"
    code, lines = _watched(tmp_path, "time.sleep(0.4); sys.exit(3)", killed, gone)  # ranks 0, 1: drafters; 2: target
    assert (code, lines[0]) == (1, "rank 1 (drafter, GPU 2) was killed by SIGKILL; stopping the other 2 processes")
    code, lines = _watched(tmp_path, "time.sleep(0.4); sys.exit(3)", gone, "time.sleep(0.2); sys.exit(1)")
    assert (code, lines[0]) == (1, "rank 2 (target, GPU 0) exited with code 1; stopping the other 2 processes")
    code, lines = _watched(tmp_path, "time.sleep(0.4)", "time.sleep(0.4)", gone)
    assert (code, lines) == (0, [])
    code, lines = _watched(tmp_path, gone, gone, gone)
    assert code == 1 and lines[0].endswith("exited with code 3 (its connection to another rank closed); stopping the "
                                           "other 2 processes")


@pytest.fixture(scope="module")
def finished_split_run(tmp_path_factory):
    """A finished 6-step split run (1 target + 2 drafters on gloo, a save at steps 3 and 6) launched by dflash-train with the replica
    check on: (run config, its TOML, the launcher's completed process). Read by several tests."""
    root = tmp_path_factory.mktemp("split")
    cfg, raw = tiny_config(root, max_steps=6, save_every=3)  # a save inside the run, one at its end
    config = write_toml(split_raw(raw), root / "split.toml")
    env = dict(os.environ, DFLASH_CHECK_REPLICAS="1")
    out = subprocess.run(train_cmd(config, "--fresh"), cwd=REPO, capture_output=True, text=True, env=env,
                         timeout=300)
    return cfg, config, out


def test_one_target_two_drafters_match_colocated_and_replicas_stay_identical(tmp_path, finished_split_run):
    ref_cfg, _ = tiny_config(tmp_path / "ref", max_steps=6, grad_accum=2)
    run(ref_cfg, None, log=lambda *_: None, progress=False)
    ref = metrics(Path(ref_cfg.output_dir))

    cfg, _, out = finished_split_run
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = metrics(Path(cfg.output_dir))
    assert [r["step"] for r in got] == list(range(1, 7))
    for a, b in zip(got, ref):
        assert a["replica_max_diff"] == 0.0, a
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a["step"], a["loss"], b["loss"])
    assert "suggested split for 8 GPUs" in out.stdout
    # 6 logged windows; the first (its step compiles) is left out of the busy rates
    assert "(mean of 5 logged window(s), the first left out)" in out.stdout
    assert (Path(cfg.output_dir) / "drafter" / "model.safetensors").exists()


def test_the_pace_summary_reads_a_finished_split_run(tmp_path, finished_split_run, capsys):
    """bench/pace_summary.py on a real split run dir: the steady window after the first logged step, the busy rates
    and the split they suggest as the run printed them, the save at the end, and exit 1 when the window is too short
    for --min-steps."""
    import bench.pace_summary as pace

    cfg, config, out = finished_split_run
    assert out.returncode == 0, out.stderr[-2000:]
    run_dir = Path(cfg.output_dir)
    assert pace.main([str(run_dir), "--out", str(tmp_path / "pace.json")]) == 0
    s = json.loads((tmp_path / "pace.json").read_text())
    assert (s["steps"], s["first_window_end_step"], s["steady_steps"]) == (6, 1, 5)
    assert s["steady_tok_per_s"]["windows"] == 5 and s["steady_tok_per_s"]["min"] > 0
    assert s["busy_tok_s_per_gpu"]["windows"] == 5
    printed = [line for line in out.stdout.splitlines() if line.startswith("suggested split for")]
    mine = [f"suggested split for {x['gpus']} GPUs: {x['targets']} target + {x['drafters']} drafter, expected "
            f"{x['expected_tok_per_s']:.0f} tok/s" for x in s["suggested_splits"]]
    assert [x["gpus"] for x in s["suggested_splits"]] == [3, 8] and mine == printed
    assert [x["step"] for x in s["saves"]] == [3, 6] and s["saves_inside_window"] == 1
    assert s["saves"][0]["write_s"] is not None and s["max_stall_inside_window_s"] >= 0  # the last one ends the rows
    assert s["ended"] == "finished" and s["first_step_s"] > 0 and s["startup"]["launch_to_first_step_s"] > 0
    assert pace.main([str(run_dir), "--min-steps", "5"]) == 0
    assert pace.main([str(run_dir), "--min-steps", "6"]) == 1
    assert "the steady window holds 5 steps, fewer than --min-steps 6" in capsys.readouterr().err
    assert pace.main([str(tmp_path / "nowhere")]) == 2
    from dflash.commands.estimate import main as estimate_main  # the same busy rates, every layout's pace

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        estimate_main(["--config", str(config), "--rates-from", str(run_dir)])
    assert e.value.code == 0
    b = s["busy_tok_s_per_gpu"]
    assert f"pace at busy rates of target {b['target']:,.0f} and drafter {b['drafter']:,.0f} tok/s" in capsys.readouterr().out


@pytest.mark.slow
def test_two_drafters_accumulating_two_batches_each_match_colocated(tmp_path):
    """grad_accum 2 on each of 2 drafter ranks: the first batch backpropagates under no_sync into DDP's bucket
    views (zeroed in place, never set to None), the second all-reduces them; the losses equal a co-located run
    of the same 4 batches per step."""
    ref_cfg, _ = tiny_config(tmp_path / "ref", max_steps=4, grad_accum=4)
    run(ref_cfg, None, log=lambda *_: None, progress=False)
    ref = metrics(Path(ref_cfg.output_dir))
    cfg, raw = tiny_config(tmp_path / "split", max_steps=4, grad_accum=2)
    config = write_toml(split_raw(raw), tmp_path / "split.toml")
    out = subprocess.run(train_cmd(config, "--fresh"), cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, DFLASH_CHECK_REPLICAS="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = metrics(Path(cfg.output_dir))
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(got, ref):
        assert a["replica_max_diff"] == 0.0, a
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a["step"], a["loss"], b["loss"])


@pytest.mark.slow
def test_packed_batches_split_over_one_target_and_two_drafters_match_colocated(tmp_path):
    """data.packing over 1 target + 2 drafters: the target ranks send each packed row's features (one row, its
    sequences end to end) and the drafters train them; every step's loss is a co-located packed run's of the same
    batches (grad_accum 2), the replicas identical."""
    from dflash.config import config_from_dict

    ref_cfg, ref_raw = tiny_config(tmp_path / "ref", max_steps=4, grad_accum=2)
    ref_raw["data"]["packing"] = True
    run(config_from_dict(ref_raw), None, log=lambda *_: None, progress=False)
    ref = metrics(Path(ref_cfg.output_dir))
    cfg, raw = tiny_config(tmp_path / "split", max_steps=4)
    raw["data"]["packing"] = True
    config = write_toml(split_raw(raw), tmp_path / "split.toml")
    out = subprocess.run(train_cmd(config, "--fresh"), cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, DFLASH_CHECK_REPLICAS="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "packed" in out.stdout.lower(), out.stdout[-2000:]  # the plan printed is the packed one
    got = metrics(Path(cfg.output_dir))
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(got, ref):
        assert a["replica_max_diff"] == 0.0, a
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a["step"], a["loss"], b["loss"])
        assert a["tokens"] == b["tokens"]


def test_killing_a_rank_ends_the_run_with_a_clear_message(tmp_path):
    proc, run_dir, ranks = start_run(tmp_path, split_raw, save_every=3, rows=4)
    target = next(r for r in ranks if r["role"] == "target")
    t0 = time.time()
    os.kill(target["pid"], signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert time.time() - t0 < 60
    assert proc.returncode == 1, out[-2000:]
    assert f"rank {target['rank']} (target, GPU {target['gpu']}) was killed by SIGKILL" in out
    assert_ranks_gone(ranks)  # nobody left behind
    from dflash.models.drafter import DFlashDrafter

    latest = rundir.list_checkpoints(run_dir)[-1]
    DFlashDrafter.from_pretrained(latest / "drafter")  # still loadable
    ended = json.loads((run_dir / "outcome.json").read_text())["ended"]  # what dflash-diff shows
    assert (ended["how"], ended["rank"], ended["role"], ended["detail"]) == ("crashed", target["rank"], "target",
                                                                             "was killed by SIGKILL"), ended


def test_resuming_a_finished_split_run_exits_cleanly(finished_split_run):
    """The shared finished run, resumed: nothing to do, exit 0, no new rows (so its other readers see the same run)."""
    cfg, config, first = finished_split_run
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    again = subprocess.run(train_cmd(config, "--resume", "latest"), cwd=REPO, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert [r["step"] for r in metrics(Path(cfg.output_dir))] == list(range(1, 7))


def test_sigterm_to_every_process_stops_cleanly_with_a_checkpoint(tmp_path):
    """A scheduler's cancel signals the launcher and every rank at once: drafters finish the step (targets keep
    serving a while), save, and the run exits 75 (stopped, resumable) with nobody left behind."""
    unset = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the session sets it (conftest)
    proc, run_dir, ranks = start_run(tmp_path, split_raw, save_every=1000, rows=3, env=unset)
    second = subprocess.run(train_cmd(run_dir.parent / "run.toml", "--resume", "latest"), cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 2 and f"is in use by another trainer (pid {proc.pid} on" in second.stderr, second.stderr
    threads = cpu_threads_per_rank(len(ranks))
    for r in ranks:  # the launcher shared this machine's cores out among the CPU ranks
        environ = Path(f"/proc/{r['pid']}/environ").read_bytes().decode(errors="replace").split("\0")
        assert f"OMP_NUM_THREADS={threads}" in environ, (r, [v for v in environ if v.startswith("OMP_")])
    t0 = time.time()
    out = cancel_run(proc, ranks)
    assert time.time() - t0 < 60, out[-2000:]
    assert proc.returncode == 75, out[-3000:]
    assert "stopped by SIGTERM" in out and (run_dir / "stopped.json").is_file()
    assert_ranks_gone(ranks)

    last = rundir.list_checkpoints(run_dir)[-1]
    assert int(last.name.split("_")[1]) == metrics(run_dir)[-1]["step"]
    assert json.loads((run_dir / "outcome.json").read_text())["ended"]["how"] == "stopped"


def torchrun_cmd(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "dflash.commands.torchrun", "--config", str(config),
            "--waive", "model-source", "--reason", "tests run on a working tree", *extra]


@pytest.mark.slow
def test_torchrun_ranks_refuse_together_when_preflight_fails(tmp_path):
    """The torchrun path goes through the gate: a failing check on the dataset stops every rank before any step."""
    cfg, raw = tiny_config(tmp_path, max_steps=4)
    raw["data"]["max_length"] = 10  # the samples are 24-64 tokens: the dataset check fails
    config = write_toml(split_raw(raw, targets=("1",), drafters=("0",)), tmp_path / "split.toml")
    out = subprocess.run(torchrun_cmd(config, "--fresh"), cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode != 0
    assert "preflight: FAIL rank 0" in out.stderr and "dataset" in out.stderr, out.stderr[-3000:]
    assert "refusing to start: preflight failed on 2 of 2 ranks" in out.stderr
    assert "[rank0]: Traceback" not in out.stderr and "[rank1]: Traceback" not in out.stderr, out.stderr[-3000:]
    run_dir = Path(cfg.output_dir)
    report = json.loads((run_dir / "preflight.json").read_text())
    assert report["ok"] is False and [r["rank"] for r in report["run"]["ranks"]] == [0, 1]
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
    assert not (run_dir / "snapshot.json").exists()  # a refused run has no snapshot


@pytest.mark.slow
def test_torchrun_refuses_a_run_dir_holding_checkpoints_without_resume_or_fresh(tmp_path):
    """Another run's checkpoints in the output dir: no silent resume, no silent fresh start, nothing moved."""
    cfg, raw = tiny_config(tmp_path, max_steps=2, save_every=1)
    run(cfg, None, log=lambda *_: None, progress=False)  # the "other" run
    before = sorted(p.name for p in (Path(cfg.output_dir) / "checkpoints").iterdir())
    config = write_toml(split_raw(raw, targets=("1",), drafters=("0",)), tmp_path / "split.toml")
    out = subprocess.run(torchrun_cmd(config), cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode != 0
    assert "already holds checkpoints" in out.stderr and "--resume latest" in out.stderr, out.stderr[-3000:]
    assert "[rank0]: Traceback" not in out.stderr and "[rank1]: Traceback" not in out.stderr, out.stderr[-3000:]
    assert sorted(p.name for p in (Path(cfg.output_dir) / "checkpoints").iterdir()) == before
    assert len(metrics(Path(cfg.output_dir))) == 2  # the other run's rows only: no step was taken


@pytest.mark.slow
def test_torchrun_refuses_a_run_dir_another_trainer_holds(tmp_path):
    """Rank 0 takes the run dir's lock before the resume/fresh rule; held elsewhere, every rank refuses, none waits."""
    cfg, raw = tiny_config(tmp_path, max_steps=2, save_every=1)
    run(cfg, None, log=lambda *_: None, progress=False)
    before = sorted(p.name for p in (Path(cfg.output_dir) / "checkpoints").iterdir())
    config = write_toml(split_raw(raw, targets=("1",), drafters=("0",)), tmp_path / "split.toml")
    with lock_run_dir(cfg.output_dir):  # this test process is "the other trainer"
        out = subprocess.run(torchrun_cmd(config, "--fresh"), cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode != 0
    assert (f"dflash.commands.torchrun: error: {cfg.output_dir} is in use by another trainer (pid {os.getpid()} on"
            in out.stderr), out.stderr[-3000:]
    assert "[rank0]: Traceback" not in out.stderr and "[rank1]: Traceback" not in out.stderr, out.stderr[-3000:]
    assert sorted(p.name for p in (Path(cfg.output_dir) / "checkpoints").iterdir()) == before  # --fresh moved nothing
    assert len(metrics(Path(cfg.output_dir))) == 2


@pytest.mark.slow
def test_torchrun_trains_after_the_gate_passes(tmp_path):
    cfg, raw = tiny_config(tmp_path, max_steps=3)
    config = write_toml(split_raw(raw, targets=("1",), drafters=("0",)), tmp_path / "split.toml")
    out = subprocess.run(torchrun_cmd(config, "--fresh"), cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "preflight: ok on all 2 ranks" in out.stdout
    assert [r["step"] for r in metrics(Path(cfg.output_dir))] == [1, 2, 3]
    report = json.loads((Path(cfg.output_dir) / "preflight.json").read_text())
    assert report["ok"] is True
    snap = json.loads((Path(cfg.output_dir) / "snapshot.json").read_text())  # rank 0 wrote it, after every rank passed
    assert snap["run"]["gate_id"] == report["run"]["gate_id"] and snap["run"]["ranks"] == 2
    outcome = json.loads((Path(cfg.output_dir) / "outcome.json").read_text())
    assert outcome["gate_id"] == report["run"]["gate_id"] and outcome["ended"]["how"] == "finished"
    assert not (Path(cfg.output_dir) / rundir.LOCK_NAME).exists()  # rank 0 released it (its os._exit skips atexit)


def test_a_worker_started_by_hand_refuses_without_this_runs_gate(tmp_path):
    """`python -m dflash.commands.torchrun --config-json` is the launcher's internal path: without its gate id it refuses."""
    cfg, raw = tiny_config(tmp_path, max_steps=2)
    from dflash.config import config_from_dict, dump_config

    split_cfg = config_from_dict(split_raw(raw))
    Path(cfg.output_dir).mkdir(parents=True)
    path = tmp_path / "config.json"
    path.write_text(dump_config(split_cfg))
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    env.pop("DFLASH_GATE_ID", None)
    out = subprocess.run([sys.executable, "-m", "dflash.commands.torchrun", "--config-json", str(path)], cwd=REPO,
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0
    assert "no passing preflight report of this run" in out.stderr and "Traceback" not in out.stderr


def test_the_pace_summary_prices_a_co_located_gpu_by_its_own_estimate():
    """A GPU holding target and drafter (preflight's roles ["target", "drafter"]) is set against the memory model's
    co-located row, not against no estimate (it printed 'estimate None' for the users' co-located run)."""
    from bench.pace_summary import gpu_memory

    snap = {"memory": {"roles": {"colocated": {"bytes": 111 * 2**30}, "target": {"bytes": 60 * 2**30}}},
            "gpus": {"devices": [{"index": 0, "uuid": "GPU-a", "roles": ["target", "drafter"]},
                                 {"index": 1, "uuid": "GPU-b", "roles": ["target"]}, {"index": 2, "uuid": "GPU-c"}]}}
    outcome = {"peak": {"gpus": {"GPU-a": 108 * 2**30, "GPU-b": 50 * 2**30}}}
    rows = gpu_memory(snap, outcome)
    assert [(r["index"], r["estimate_gib"], r["nvml_peak_gib"]) for r in rows] == [(0, 111.0, 108.0), (1, 60.0, 50.0)]
    assert rows[0]["estimate_error"] == round(111 / 108 - 1, 4)
