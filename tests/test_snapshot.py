"""snapshot.json / outcome.json in every run dir, and `dflash-diff`: the incident replayed with real tiny CPU runs.

Run A is the run that worked. Run B resumes A's checkpoint the way the incident's relaunch did, with
the incident's changes: another torch build, an inference package in the training environment, the
compile cache deleted, the drafter's source edited, longer samples and max_anchors 1024 -> 768.
Every run is a real `dflash-train` through the real gate and trainer. What a CPU machine cannot
produce is injected as facts, the way preflight's tests feed facts: the torch build string, the
code checkout (a throwaway git repository holding the drafter's source, so the test edits no file
of this tree) and the extra package (a .dist-info folder on sys.path, what an installer leaves).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

import preflight.facts.gather as gathering
from dflash.config import load_config
from dflash.data.synthetic import write_random_dataset
from dflash.runs import compile_artifact
from dflash.runs import records as snapshot
from preflight import gate
from preflight.facts.environment import TorchBuild
from trainkit import tiny_config, write_toml
from trainkit import train_main_here as train

REPO = Path(__file__).resolve().parent.parent
WAIVE = ["--waive", "model-source", "--reason", "tests run on a working tree"]


def diff(*argv: str, capsys) -> tuple[int, list[str], str]:
    from dflash.commands.diff import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return e.value.code, out.splitlines(), err


def source_checkout(root: Path) -> Path:
    """A git checkout holding the drafter's source as committed (what the model-source facts look at)."""
    (root / "dflash" / "models").mkdir(parents=True)
    shutil.copy(REPO / "dflash" / "models" / "drafter.py", root / "dflash" / "models" / "drafter.py")
    git = ["git", "-C", str(root), "-c", "user.email=t@example.com", "-c", "user.name=t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "drafter source"]):
        subprocess.run(git + args, check=True, capture_output=True)
    return root


def warm_cache(cache: Path, config: Path) -> None:
    """The compile cache artifact `dflash-train --warm-cache` leaves for a run config (same bytes every time)."""
    path = compile_artifact.artifact_path(load_config(config), cache)
    compile_artifact.write(path, {"torch": "2.10.0+cu128", "triton": "3.6.0", "gpu_name": "NVIDIA H200",
                                  "compute_capability": "9.0"}, {"torch": b"\x01" * 300_000})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run dirs A (fresh), C (A again, elsewhere) and B (the incident's relaunch), made once for the module."""
    root = tmp_path_factory.mktemp("incident")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(root / "home"))  # the profile's compile cache lives under it
        src = source_checkout(root / "src")
        real_source = gathering.model_source
        mp.setattr(gathering, "model_source", lambda root=None: real_source(src))
        cache = gate.compile_cache_dir("train-cu128")
        _, raw = tiny_config(root, max_steps=4, save_every=2, max_anchors=1024)
        raw["data"].update(token_budget=4096, max_batch_size=2)  # long rows are possible: 1024 anchors fit one
        configs = {}
        for name in ("A", "C"):
            configs[name] = write_toml(dict(raw, output_dir=str(root / name)), root / f"{name}.toml")
            warm_cache(cache, configs[name])
            assert train(configs[name], "--fresh", *WAIVE) == 0

        (root / "B" / "checkpoints").mkdir(parents=True)  # B continues A's run from its step 2
        shutil.copytree(root / "A" / "checkpoints" / "step_00000002", root / "B" / "checkpoints" / "step_00000002")
        longer = write_random_dataset(root / "data-long", samples=64, length=120, vocab=128, sigma=0.3, max_length=400,
                                      seed=1)
        b = dict(raw, output_dir=str(root / "B"), data=dict(raw["data"], path=str(longer)),
                 train=dict(raw["train"], max_anchors=768))
        configs["B"] = write_toml(b, root / "B.toml")
        with pytest.MonkeyPatch.context() as incident:
            shutil.rmtree(compile_artifact.artifact_path(load_config(configs["A"]), cache).parent)  # "cleaned up"
            model_py = src / "dflash" / "models" / "drafter.py"
            model_py.write_text(model_py.read_text() + "\nDEBUG_HACK = True  # left in by hand\n")
            site = root / "site"
            (site / "sglang-0.5.23.dist-info").mkdir(parents=True)
            (site / "sglang-0.5.23.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23\n")
            incident.syspath_prepend(str(site))
            incident.setattr(gathering, "torch_build", lambda: TorchBuild("2.11.0+cu130", "13.0", "test seam"))
            code = train(configs["B"], "--resume", "latest", *WAIVE, "--waive", "torch-build", "--reason", "incident",
                         "--waive", "env-drift", "--reason", "incident")
            assert code == 0
        subprocess.run(["git", "-C", str(src), "checkout", "-q", "--", "."], check=True)  # the hack, restored from git
        warm_cache(cache, configs["A"])
        yield {"root": root, **{k: root / k for k in ("A", "B", "C")}, "configs": configs}


def test_every_run_dir_holds_a_small_sorted_snapshot_and_its_outcome(runs):
    snap_text = (runs["A"] / snapshot.SNAPSHOT_NAME).read_text()
    snap = json.loads(snap_text)
    assert snap_text == json.dumps(snap, indent=1, sort_keys=True) + "\n"  # deterministic key order
    assert len(snap_text) < 32_000, len(snap_text)  # kilobytes
    assert snap["format"] == snapshot.FORMAT and snap["run"]["intent"] == "fresh" and snap["run"]["gate_id"]
    assert snap["config"]["train"]["max_anchors"] == 1024 and snap["data"]["samples"] == 64
    assert set(snap["data"]["length"]) == {"min", "mean", "p50", "p90", "p99", "max"}
    assert snap["compile_cache"]["manifest"]["torch"] == "2.10.0+cu128" and snap["code"]["dirty"] == {}
    assert snap["memory"]["roles"]["colocated"]["bytes"] > 0 and snap["target"]["shape"]["vocab"] == 128
    assert "PYTORCH_CUDA_ALLOC_CONF" in snap["environment"]["env"]  # as dflash-train set it before torch loads
    outcome = json.loads((runs["A"] / snapshot.OUTCOME_NAME).read_text())
    assert outcome["gate_id"] == snap["run"]["gate_id"]
    assert outcome["ended"] == {"how": "finished", "step": 4, "detail": None, "rank": None}
    assert outcome["steady"]["tok_per_s"] > 0 and outcome["first_step_s"] > 0 and outcome["rows"] == 4
    assert outcome["peak"]["host_rss_bytes"] > 0 and outcome["last"]["loss"] > 0
    startup = outcome["startup"]  # seconds per phase from this process's start to its first step
    assert set(startup) == {"before_s", "preflight_s", "target_s", "setup_s", "first_step_s",
                            "launch_to_first_step_s"}, startup
    assert 0 < startup["preflight_s"] <= startup["before_s"]  # the gate's share of launch to the target's build
    assert startup["launch_to_first_step_s"] >= (startup["before_s"] + startup["target_s"] + startup["setup_s"]
                                                 + startup["first_step_s"] - 0.3)
    b = json.loads((runs["B"] / snapshot.SNAPSHOT_NAME).read_text())
    assert b["run"]["intent"] == "resume" and b["run"]["resume"] == {"step": 2, "checkpoint": "step_00000002"}
    assert b["code"]["dirty"]["dflash/models/drafter.py"]["state"] == "modified"


def test_the_incident_diff_lists_every_change_movers_first(runs, capsys):
    code, lines, err = diff(runs["A"], runs["B"], capsys=capsys)
    text = "\n".join(lines)
    assert code == 1 and err == "", text
    expected = [  # (a piece of the line, its group), in the order they must appear
        ("torch 2.10.0", "environment"),
        ("sglang: not installed -> 0.5.23 (GPU stack)", "environment"),
        ("warm (300 kB; torch 2.10.0+cu128", "compile cache"),
        ("train.max_anchors 1024 -> 768", "config"),
        ("dataset sample length mean", "data"),
        ("dflash/models/drafter.py: as committed -> modified (sha256 ", "code"),
        ("fresh start -> resume from step 2 (step_00000002)", "run"),
    ]
    found = []
    for piece, group in expected:
        hits = [i for i, line in enumerate(lines) if piece in line]
        assert hits, f"{piece!r} missing:\n{text}"
        assert lines[hits[0]].split()[0] == group.split()[0], lines[hits[0]]
        found.append(hits[0])
    assert found == sorted(found), text
    torch_line = lines[found[0]]
    assert "-> 2.11.0+cu130 (CUDA 13.0)" in torch_line and "[memory model: CUDA context +" in torch_line
    anchors = lines[found[3]]
    assert "[memory model: colocated peak -" in anchors, anchors
    assert "-> absent: the first steps compile again" in lines[found[2]]
    assert lines[2].startswith("7 difference(s), 5 known to move memory or speed:"), lines[2]
    assert any(line.startswith("memory model, predicted peak per GPU (A -> B): colocated peak ") for line in lines)
    outcome = lines[lines.index("outcome (A -> B):") + 1:]
    assert outcome[0].split() == ["ended", "finished", "at", "step", "4", "->", "finished", "at", "step", "4"]
    assert any(o.split()[:2] == ["steady", "tok/s"] and "%)" in o for o in outcome), outcome
    assert any(o.split()[:3] == ["peak", "host", "RSS"] and " -> " in o for o in outcome), outcome


def test_identical_runs_have_no_differences(runs, capsys):
    code, lines, _ = diff(runs["A"], runs["C"], capsys=capsys)
    assert code == 0, "\n".join(lines)
    assert lines[2] == "no differences", "\n".join(lines)
    assert "outcome (A -> B):" in lines  # the outcomes are shown, timing noise is not a difference


def test_json_has_the_same_findings(runs, capsys):
    code, lines, _ = diff("--json", runs["A"], runs["B"], capsys=capsys)
    data = json.loads("\n".join(lines))
    assert code == 1 and data["exit_code"] == 1 and data["counted"] == 7 and data["relevant"] == 5
    keys = [d["key"] for d in data["differences"] if d["counts"]]
    assert keys[:2] == ["torch", "sglang"] and "train.max_anchors" in keys and "dflash/models/drafter.py" in keys
    assert next(d for d in data["differences"] if d["key"] == "torch")["b"] == {"version": "2.11.0+cu130", "cuda": "13.0"}


def test_here_on_the_same_machine_then_one_extra_package(runs, capsys, tmp_path, monkeypatch):
    before = {p: p.stat().st_mtime_ns for p in runs["A"].rglob("*")}
    code, lines, _ = diff("--here", runs["A"], capsys=capsys)
    assert code == 0, "\n".join(lines)
    assert lines[1].startswith("B: this machine now") and lines[2].startswith("no differences"), "\n".join(lines)
    site = tmp_path / "site"
    uv = shutil.which("uv")
    installed = uv and subprocess.run([uv, "pip", "install", "--quiet", "--no-deps", "--target", str(site), "tabulate==0.9.0"],
                                      capture_output=True, timeout=120).returncode == 0
    if not installed:  # no uv or no registry here: what the installer would have left
        (site / "tabulate-0.9.0.dist-info").mkdir(parents=True)
        (site / "tabulate-0.9.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: tabulate\nVersion: 0.9.0\n")
    monkeypatch.syspath_prepend(str(site))
    code, lines, _ = diff("--here", runs["A"], capsys=capsys)
    assert code == 1, "\n".join(lines)
    assert lines[2:] [:3] == ["1 difference(s), 0 known to move memory or speed:", "differences:",
                              "  environment  tabulate: not installed -> 0.9.0"], "\n".join(lines)
    assert {p: p.stat().st_mtime_ns for p in runs["A"].rglob("*")} == before  # --here reads only


def test_allocator_recompute_and_gpu_changes_carry_their_effect(runs):
    """Pure diff of A's real snapshot against an edited copy: fields a CPU machine cannot change for real."""
    import copy

    from preflight.diff import compare

    a = json.loads((runs["A"] / snapshot.SNAPSHOT_NAME).read_text())
    gpu = {"index": 5, "cuda_index": 0, "uuid": "GPU-5a", "name": "NVIDIA H200", "total_bytes": 150_000_000_000,
           "free_bytes": 149_000_000_000, "compute_capability": "9.0", "roles": ["drafter", "target"]}
    a["gpus"]["devices"] = [gpu]
    b = copy.deepcopy(a)
    b["environment"]["env"]["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:512"  # expandable segments off
    b["config"]["data"]["token_budget"] = 2048
    b["gpus"]["devices"][0]["free_bytes"] = 120_000_000_000  # a forgotten server holds 27 GiB
    d = compare(a, b)
    lines = {x.key: x for x in d.differences}
    assert lines["PYTORCH_CUDA_ALLOC_CONF"].effect.startswith("memory model: colocated peak +")
    assert lines["data.token_budget"].effect.startswith("memory model: colocated peak -")
    assert "free at start 138.77 GiB -> 111.76 GiB (-27.01 GiB: another process holds memory)" in \
        lines["drafter+target GPU 0 free"].text
    assert [x.key for x in d.counted] == ["PYTORCH_CUDA_ALLOC_CONF", "drafter+target GPU 0 free", "data.token_budget"]
    assert d.exit_code == 1 and compare(a, copy.deepcopy(a)).exit_code == 0


def test_the_target_precision_is_recorded_and_its_change_carries_its_memory_effect(runs):
    """The snapshot records target.precision (bf16 here); dflash-diff names a change to fp8 with what the memory model
    says it saves, and a snapshot written before the field reads as bf16, no change."""
    import copy
    from dataclasses import asdict

    from dflash.memory.shape import load_target_shape
    from preflight.diff import compare

    a = json.loads((runs["A"] / snapshot.SNAPSHOT_NAME).read_text())
    assert a["target"]["precision"] == a["config"]["target"]["precision"] == "bf16"
    a["target"]["shape"] = asdict(load_target_shape("configs/targets/qwen3-8b"))  # linears large enough for fp8
    b = copy.deepcopy(a)
    b["config"]["target"]["precision"] = "fp8"
    lines = {x.key: x for x in compare(a, b).differences}
    assert lines["target.precision"].text == "target.precision bf16 -> fp8"
    assert lines["target.precision"].moves == "memory, speed"
    assert lines["target.precision"].effect.startswith("memory model: colocated peak -"), lines["target.precision"].effect
    older = copy.deepcopy(a)
    del older["config"]["target"]["precision"], older["target"]["precision"]
    assert "target.precision" not in {x.key for x in compare(older, a).differences}
    assert [x.text for x in compare(older, b).differences if x.key == "target.precision"] == [
        "target.precision bf16 -> fp8"]


def test_a_split_runs_snapshot_lists_its_gpus_by_role_with_their_predicted_peaks(tmp_path):
    """The GPU side of a snapshot from the recorded 8x H200 NVML fake (preflight's own fixture)."""
    from dflash.config import config_from_dict
    from preflight.facts.gather import gather
    from preflight.nvml import FakeGpuInfo
    from preflight.snapshot import take

    _, raw = tiny_config(tmp_path)
    cfg = config_from_dict(dict(raw, device="cuda", topology={"target_gpus": ["0", "1"], "drafter_gpus": ["2"]}))
    snap = take(gather("train-cu128", cfg, "fresh", FakeGpuInfo.from_json(REPO / "tests/data/nvml_fake_8gpu.json")))
    devices = snap["gpus"]["devices"]
    assert len(devices) == 8 and snap["gpus"]["driver"] == "570.133.20"
    assert [d["roles"] for d in devices[:4]] == [["target"], ["target"], ["drafter"], []]
    assert devices[2]["name"] == "NVIDIA H200" and devices[2]["free_bytes"] > 100 * 2**30
    assert set(snap["memory"]["roles"]) == {"target", "drafter"} and snap["memory"]["roles"]["drafter"]["recompute"] == "off"


def test_a_second_run_in_the_same_dir_keeps_the_first_snapshot(tmp_path, capsys):
    out = tmp_path / "run"
    first = {"format": snapshot.FORMAT, "run": {"gate_id": "a" * 32, "time_utc": "2026-11-29T10:15:00Z"},
             "environment": {}, "config": {}}
    snapshot.write_snapshot(out, first)
    (out / snapshot.OUTCOME_NAME).write_text(json.dumps({"format": snapshot.OUTCOME_FORMAT, "gate_id": "a" * 32}))
    snapshot.write_snapshot(out, dict(first, run={"gate_id": "b" * 32, "time_utc": "2026-11-30T08:00:00Z"}))
    [kept] = snapshot.previous_runs(out)
    assert kept.name == "20261129T101500Z-aaaaaaaa" and (kept / snapshot.OUTCOME_NAME).exists()
    assert not (out / snapshot.OUTCOME_NAME).exists()
    snap, outcome, notes = snapshot.load(kept)
    assert snap["run"]["gate_id"] == "a" * 32 and outcome["gate_id"] == "a" * 32 and notes == []
    from dflash.commands.diff import main

    with pytest.raises(SystemExit) as e:  # the run dir alone: its previous run against it
        main([str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert e.value.code == 0 and lines[0].startswith(f"A: {kept} (started 2026-11-29T10:15:00Z") and lines[2] == "no differences"


def test_a_dead_split_rank_is_named_in_the_outcome(tmp_path):
    out = tmp_path / "run"
    snapshot.write_snapshot(out, {"format": snapshot.FORMAT, "run": {"gate_id": "g"}, "environment": {}, "config": {}})
    snapshot.record_crash(out, 5, "target", "4", "was killed by SIGKILL")  # before any trainer started
    ended = json.loads((out / snapshot.OUTCOME_NAME).read_text())["ended"]
    assert ended == {"how": "crashed", "step": None, "rank": 5, "role": "target", "gpu": "4", "detail": "was killed by SIGKILL"}
    _, outcome, _ = snapshot.load(out)
    from preflight.diff import _ended

    assert _ended(outcome) == "crashed rank 5 (target, GPU 4): was killed by SIGKILL"


def test_a_run_started_without_the_gate_has_an_outcome_but_no_snapshot(tmp_path):
    from dflash.train.trainer import run

    cfg, _ = tiny_config(tmp_path, max_steps=2)
    assert run(cfg, None, log=lambda *_: None, progress=False) == 0
    out = Path(cfg.output_dir)
    assert not (out / snapshot.SNAPSHOT_NAME).exists()
    assert json.loads((out / snapshot.OUTCOME_NAME).read_text())["ended"]["how"] == "finished"
    with pytest.raises(snapshot.SnapshotError, match="no snapshot.json"):
        snapshot.load(out)


def test_diff_is_a_console_script():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["dflash-diff"] == "dflash.commands.diff:main"


def test_the_outcome_keeps_each_run_gpus_peak_from_nvml(tmp_path, monkeypatch):
    """NVML by UUID for the GPUs the snapshot gave a role (a fake pynvml: the one GPU-only path of the outcome)."""
    import types

    used = {"GPU-a": iter([10, 50, 30, 20]), "GPU-b": iter([5, 6, 7, 8])}
    fake = types.SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetHandleByUUID=lambda uuid: uuid,
                                 nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=next(used[h])))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    out = tmp_path / "run"
    devices = [{"uuid": "GPU-a", "roles": ["drafter"]}, {"uuid": "GPU-b", "roles": ["target"]}, {"uuid": "GPU-c", "roles": []}]
    snapshot.write_snapshot(out, {"format": snapshot.FORMAT, "run": {"gate_id": "g", "time_utc": snapshot.now_utc()},
                                  "environment": {}, "config": {}, "gpus": {"devices": devices}})
    o = snapshot.Outcome(out, 0)
    o.first_step(1.5, 3)
    for step in (1, 2):
        o.row({"step": step, "loss": 2.0, "accept_len": 1.5, "tok_per_s": 100.0 * step, "compiled_graphs": 3 + step,
               "mem_gib": 1.0})
    o.end("finished", 2)
    data = json.loads((out / snapshot.OUTCOME_NAME).read_text())
    assert data["peak"]["gpus"] == {"GPU-a": 50, "GPU-b": 8} and data["peak"]["torch_allocated_bytes"] == 2**30
    assert data["steady"] == {"tok_per_s": 200.0} and data["compiled_graphs"] == {"first_step": 3, "last": 5}
    assert data["ended"]["how"] == "finished" and data["to_first_step_s"] is not None


@pytest.mark.parametrize("old", [b'{"run": [1]}', b"[1, 2]", b"[" * 100_000, b'{"run": {"time_utc": 5, "gate_id": []}}'])
def test_a_damaged_snapshot_in_the_run_dir_still_moves_aside(tmp_path, old):
    """The gate's write of a new run's snapshot moves whatever was there aside, whatever it holds."""
    out = tmp_path / "run"
    out.mkdir()
    (out / snapshot.SNAPSHOT_NAME).write_bytes(old)
    snapshot.write_snapshot(out, {"format": snapshot.FORMAT, "run": {"gate_id": "b" * 32}, "environment": {}, "config": {}})
    [kept] = list((out / snapshot.PREVIOUS_DIR).iterdir())
    assert (kept / snapshot.SNAPSHOT_NAME).read_bytes() == old


def test_process_age_counts_from_this_process_start():
    from dflash.runs.records import process_age_s
    from dflash.train.recorder import startup_line

    age = process_age_s()
    assert age is not None and 0 < age < 24 * 3600  # this test process started before the suite, on Linux
    time.sleep(0.3)
    assert process_age_s() >= age + 0.2
    assert startup_line({"target_s": 18.04, "setup_s": 2.3, "first_step_s": 24.7, "launch_to_first_step_s": 52.1}) \
        == "startup: 52.1 s from launch: target 18.0 s, drafter, data and optimizer 2.3 s, first step 24.7 s"
    assert startup_line({"before_s": 6.1, "target_s": 18.0, "first_step_s": 24.7, "launch_to_first_step_s": 52.1}) \
        == "startup: 52.1 s from launch: imports and preflight 6.1 s, target 18.0 s, first step 24.7 s"
    assert startup_line({"before_s": 6.1, "preflight_s": 4.04, "target_s": 18.0, "first_step_s": 24.7}) \
        == "startup: imports and preflight 6.1 s (the gate 4.0 s), target 18.0 s, first step 24.7 s"
    assert startup_line({"setup_s": 1.0, "first_step_s": 2.0, "launch_to_first_step_s": None}) \
        == "startup: drafter, data and optimizer 1.0 s, first step 2.0 s"  # a split drafter rank, no /proc
