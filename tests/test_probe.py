"""The probe of the machine (preflight.probe): the memory outside torch measured per GPU, cached per machine state,
judged by gpu-memory, recorded in the snapshot and shown by dflash-diff. On this CPU machine the real probe
subprocess runs and finds no driver: that path is real; a measured overhead is a fact fed to the pure check."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys

import pytest

from dflash.memory.parts import DEFAULT_CALIBRATION, role_need_bytes, with_measured_overhead
from preflight.checks.gpus import check_gpu_memory
from preflight.facts.environment import TorchBuild
from preflight.facts.overhead import GpuOverhead, MachineState, Overhead, from_probe, state_changes
from preflight.nvml import GpuProcess, snapshot_from_dict
from preflight.probe import (
    machine_state,
    probe_for_run,
    probe_gpus,
    read_cache,
    run_steps,
    write_cache,
)
from preflight_ctx import GiB, MiB, make_ctx, recorded

ONE_PAIR = {"target_gpus": ["0"], "drafter_gpus": ["5"]}  # one target GPU and one drafter GPU of the 8x H200 fake


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))


def measured(ctx, gib: float, nccl_gib: float | None = None) -> Overhead:
    """Every assigned GPU measured at `gib` outside torch before NCCL (and nccl_gib for its communicator)."""
    from preflight.checks.gpus import resolved_gpus

    return Overhead({g.uuid: GpuOverhead(g.uuid, "measured", context_bytes=int(gib * GiB),
                                         nccl_bytes=None if nccl_gib is None else int(nccl_gib * GiB),
                                         state={"torch": "2.10.0+cu128"})
                     for _n, _r, g, _w in resolved_gpus(ctx)})


def state(**change) -> MachineState:
    base = dict(torch="2.10.0+cu128", cuda="12.8", driver="570.133.20", gpu="NVIDIA H200",
                gpu_total_bytes=150_000_000_000, nccl="2.27.5", steps=("context", "matmul", "attention"))
    return MachineState(**{**base, **change})


# ---------------------------------------------------------------- the incident as a preflight failure


def test_the_incident_passes_at_one_overhead_and_fails_at_200_mb_more(tmp_path):
    """The same config on the same free memory: with the overhead the probe measured under the CUDA 12.8 build it
    fits; 0.2 GiB more outside torch (the CUDA 13 build) and gpu-memory fails, naming the measured value, the budget
    and the fix."""
    cfg = {"topology": ONE_PAIR, "train": {"recompute": "off"}}  # the incident's run: no recompute to fall back on
    ctx = make_ctx(tmp_path, config=cfg)
    ctx.overhead = measured(ctx, 0.94, 0.55)
    cal = with_measured_overhead(DEFAULT_CALIBRATION, "12.8", int(0.94 * GiB), int(0.55 * GiB))
    need = role_need_bytes(ctx.config, "drafter", "12.8", cal, shape=ctx.target_shape)
    gpus = recorded()
    gpus["gpus"][5]["memory_free"] = need + 3 * GiB + 100 * MiB  # 100 MiB to spare beyond the kept 3 GiB
    ctx = make_ctx(tmp_path, config=cfg, gpus=gpus)
    ctx.overhead = measured(ctx, 0.94, 0.55)
    ok = check_gpu_memory(ctx)
    assert ok.status == "pass", ok.summary
    assert ok.summary.endswith("[memory model; outside torch measured 1.49 GiB per GPU]"), ok.summary
    row = next(r for r in ok.data["gpus"] if r["name"] == "5")
    assert row["need_bytes"] == need and row["outside_torch_bytes"] == int(0.94 * GiB) + int(0.55 * GiB)
    assert row["outside_torch_constant_bytes"] == int(0.5 * GiB) + int(0.25 * GiB)  # CUDA 12 context + NCCL constants

    ctx.overhead = measured(ctx, 1.14, 0.55)  # +0.2 GiB outside torch, nothing else changed
    bad = check_gpu_memory(ctx)
    assert bad.status == "fail", bad.summary
    assert bad.summary.startswith("drafter GPU 5 (")
    free = gpus["gpus"][5]["memory_free"]
    assert (f"free {free / GiB:.1f} GiB, short 0.1 GiB; budget {(free - 3 * GiB) / GiB:.2f} GiB for the run's peak, of "
            "which outside torch 1.69 GiB measured on this GPU (calibrated constant 0.75)") in bad.summary
    assert "train.recompute = \"mlp\"" in bad.fix and "above the calibrated constant" in bad.fix
    assert "python -m preflight.probe --gpus N" in bad.fix


def test_a_measured_overhead_replaces_the_calibrated_constants_term_for_term():
    cal = with_measured_overhead(DEFAULT_CALIBRATION, "13.0", int(0.94 * GiB))
    assert cal.context_bytes("13.0") == int(0.94 * GiB) and cal.context_bytes("12.8") == int(0.5 * GiB)
    assert cal.nccl_gib == DEFAULT_CALIBRATION.nccl_gib  # no NCCL step: the constant stays
    assert with_measured_overhead(cal, "13.0", 0, int(0.55 * GiB)).nccl_gib == pytest.approx(0.55, abs=1e-9)


def test_the_probes_readings_give_the_context_and_the_nccl_share():
    """The H100 facts: 0.94 GiB for the process after a matmul, 0.28 of it torch's; NCCL +0.55 GiB."""
    out = {"baseline_device_used_bytes": int(0.47 * GiB), "steps": [
        {"step": "context", "process_bytes": int(0.60 * GiB), "torch_reserved_bytes": 0},
        {"step": "matmul", "process_bytes": int(0.94 * GiB), "torch_reserved_bytes": int(0.28 * GiB)},
        {"step": "nccl", "process_bytes": int(1.49 * GiB), "torch_reserved_bytes": int(0.28 * GiB)}]}
    g = from_probe("GPU-1", out, state())
    assert g.context_bytes == int(0.94 * GiB) - int(0.28 * GiB)
    assert g.nccl_bytes == int(1.49 * GiB) - int(0.94 * GiB)
    assert g.outside_torch_bytes == int(1.49 * GiB) - int(0.28 * GiB)
    no_pid = copy.deepcopy(out)  # another PID namespace: the card's growth since the baseline stands in
    for r in no_pid["steps"]:
        r["device_used_bytes"] = r.pop("process_bytes") + int(0.47 * GiB)
        r["process_bytes"] = None
    assert from_probe("GPU-1", no_pid, state()).context_bytes == g.context_bytes
    with pytest.raises(ValueError, match="no reading"):
        from_probe("GPU-1", {"steps": []}, state())


def test_the_run_decides_what_the_probe_loads(tmp_path):
    ctx = make_ctx(tmp_path)  # a split: NCCL between targets and drafters
    assert run_steps(ctx.config, ctx.target_shape) == ("context", "matmul", "attention", "nccl")
    one = make_ctx(tmp_path, config={"topology": {"target_gpus": [], "drafter_gpus": []}})
    assert run_steps(one.config, one.target_shape) == ("context", "matmul", "attention")
    hybrid = dataclasses.replace(one.target_shape, linear_layers=48)
    assert run_steps(one.config, hybrid) == ("context", "matmul", "attention", "fla")


# ---------------------------------------------------------------- the cache


def test_the_cache_key_changes_with_every_part_of_the_machine_state():
    base = state()
    others = [state(torch="2.10.0+cu130", cuda="13.0"), state(driver="580.65.06"), state(gpu="NVIDIA H100"),
              state(gpu_total_bytes=80 * GiB), state(nccl="2.28.3"), state(steps=("context",)),
              state(env=(("CUDA_MODULE_LOADING", "EAGER"),)), state(probe=0)]
    keys = {base.key()} | {s.key() for s in others}
    assert len(keys) == 1 + len(others)
    assert base.key() == state().key() and MachineState.from_dict(base.to_dict()) == base
    assert state_changes(base.to_dict(), others[0].to_dict()) == ["torch 2.10.0+cu128 -> 2.10.0+cu130"]


def test_machine_state_reads_the_build_driver_gpu_nccl_and_variables():
    gpu = snapshot_from_dict(recorded()).gpus[0]
    s = machine_state(gpu, "570.133.20", TorchBuild("2.10.0+cu128", "12.8", "torch/version.py"),
                      {"nvidia-nccl-cu12": ["2.27.5"], "torch": ["2.10.0+cu128"]},
                      {"NCCL_P2P_DISABLE": "1", "HOME": "/x", "CUDA_MODULE_LOADING": "LAZY"}, ("context",))
    assert (s.torch, s.cuda, s.driver, s.gpu, s.nccl) == ("2.10.0+cu128", "12.8", "570.133.20", gpu.name, "2.27.5")
    assert s.env == (("CUDA_MODULE_LOADING", "LAZY"), ("NCCL_P2P_DISABLE", "1"))


def test_a_measured_probe_is_cached_and_used_only_for_its_own_state(tmp_path):
    folder = tmp_path / "probe"
    g = GpuOverhead("GPU-a", "measured", context_bytes=int(0.66 * GiB), state=state().to_dict())
    assert write_cache(state(), {"GPU-a": g}, folder) is None
    assert [p.name for p in folder.iterdir()] == [f"{state().key()}.json"]  # atomic: no temporary left behind
    got, note = read_cache(state(), folder)
    assert note is None and got["GPU-a"].source == "cached" and got["GPU-a"].context_bytes == int(0.66 * GiB)
    assert read_cache(state(torch="2.10.0+cu130"), folder) == ({}, None)  # another state: another file
    # a file under this state's name that records another state (copied from another machine) is never used
    other = json.loads((folder / f"{state().key()}.json").read_text())
    other["state"]["driver"] = "580.65.06"
    (folder / f"{state().key()}.json").write_text(json.dumps(other))
    got, note = read_cache(state(), folder)
    assert got == {} and "is of another machine state; probing again" in note
    (folder / f"{state().key()}.json").write_text("{not json")
    got, note = read_cache(state(), folder)
    assert got == {} and note.startswith(f"probe cache {state().key()}.json ignored (JSONDecodeError")


def test_a_cached_gpu_is_not_probed_again(tmp_path):
    gpu = snapshot_from_dict(recorded()).gpus[0]
    s = state(gpu=gpu.name, gpu_total_bytes=gpu.memory_total)
    write_cache(s, {gpu.uuid: GpuOverhead(gpu.uuid, "measured", context_bytes=int(0.66 * GiB))}, tmp_path)
    # a python that cannot start: any probe would fail, so a measured answer came from the cache
    got = probe_gpus({"0": gpu}, {gpu.uuid: s}, python=str(tmp_path / "no-python"), cache=tmp_path)
    assert got.gpus[gpu.uuid].source == "cached" and got.gpus[gpu.uuid].context_bytes == int(0.66 * GiB)
    fresh = probe_gpus({"0": gpu}, {gpu.uuid: s}, python=str(tmp_path / "no-python"), cache=tmp_path, use_cache=False)
    assert fresh.gpus[gpu.uuid].source == "constant"
    assert fresh.gpus[gpu.uuid].note.startswith("GPU 0 not probed: probe could not start (")


# ---------------------------------------------------------------- faults: one line and the constant


def test_on_a_machine_without_a_driver_the_real_probe_says_so_in_one_line(tmp_path):
    """The real subprocess (python -m preflight.probe_gpu) in this environment: no NVIDIA driver here."""
    gpu = snapshot_from_dict(recorded()).gpus[0]
    got = probe_gpus({"0": gpu}, {gpu.uuid: state()}, cache=tmp_path)
    g = got.gpus[gpu.uuid]
    assert g.source == "constant" and not g.measured
    assert g.note.startswith("GPU 0 not probed: no NVIDIA driver (NVML: ") and "\n" not in g.note
    assert g.note.endswith("; the calibrated constant is used")
    assert list(tmp_path.iterdir()) == []  # nothing measured, nothing cached


def test_a_probe_past_its_timeout_is_killed_and_reaped(tmp_path):
    gpu = snapshot_from_dict(recorded()).gpus[0]
    got = probe_gpus({"0": gpu}, {gpu.uuid: state()}, timeout=0.01, cache=tmp_path)
    assert got.gpus[gpu.uuid].note == "GPU 0 not probed: probe timed out after 0.01 s (killed); the calibrated constant is used"
    with pytest.raises(ProcessLookupError):  # killed and reaped: no probe left behind
        os.kill(got.gpus[gpu.uuid].pid, 0)


def test_a_broken_environment_is_one_line(tmp_path):
    gpu = snapshot_from_dict(recorded()).gpus[0]
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'Traceback: ImportError: libcudart.so.12' >&2\nexit 1\n")
    python.chmod(0o755)
    got = probe_gpus({"0": gpu}, {gpu.uuid: state()}, python=str(python), cache=tmp_path)
    assert got.gpus[gpu.uuid].note == ("GPU 0 not probed: probe exited 1 without a result: Traceback: ImportError: "
                                       "libcudart.so.12; the calibrated constant is used")


def test_a_busy_gpu_is_not_probed_and_gpu_memory_warns_with_the_constant(tmp_path):
    """Faked NVML facts: another process holds drafter GPU 5; GPU 0 is probed for real (no driver here)."""
    gpus = recorded()
    gpus["gpus"][5]["processes"] = [{"pid": 31337, "name": "python -m sglang.launch_server", "used_bytes": 2 * GiB}]
    ctx = make_ctx(tmp_path, config={"topology": ONE_PAIR, "train": {"recompute": "off"}}, gpus=gpus)
    ctx.overhead = probe_for_run(ctx)
    uuid5 = gpus["gpus"][5]["uuid"]
    assert ctx.overhead.gpus[uuid5].note == "GPU 5 not probed: held by pid 31337; the calibrated constant is used"
    r = check_gpu_memory(ctx)
    assert r.status == "warn", r.summary
    assert "GPU 5 not probed: held by pid 31337; the calibrated constant is used" in r.summary
    assert "GPU 0 not probed: no NVIDIA driver" in r.summary
    assert next(g for g in r.data["gpus"] if g["name"] == "5")["need_bytes"] == role_need_bytes(ctx.config, "drafter", "12.8", shape=ctx.target_shape)
    assert "python -m preflight.probe --gpus N" in r.fix


def test_preflight_on_a_recorded_machine_runs_the_real_probe_and_warns(tmp_path, capsys, monkeypatch):
    """dflash-preflight end to end: the recorded 8x H200, the real probe subprocess on its GPUs (no driver here)."""
    from dflash.commands.preflight import main
    from trainkit import tiny_config, write_toml

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    _, raw = tiny_config(tmp_path)
    config = write_toml(dict(raw, device="cuda", topology=ONE_PAIR), tmp_path / "run.toml")
    fixture = tmp_path / "nvml.json"
    fixture.write_text(json.dumps(recorded()))
    with pytest.raises(SystemExit):
        main(["--profile", "train-cu128", "--json", "--nvml-fake", str(fixture), "--probe-fake", "real",
              "--config", str(config)])
    check = next(c for c in json.loads(capsys.readouterr().out)["checks"] if c["id"] == "gpu-memory")
    assert check["status"] == "warn" and "GPU 0 not probed: no NVIDIA driver" in check["summary"]
    assert [g["outside_torch_source"] for g in check["data"]["gpus"]] == ["constant", "constant"]


def test_the_probe_module_runs_on_its_own_and_fails_in_one_line_without_a_driver(tmp_path):
    import subprocess

    from preflight.profiles import REPO_ROOT

    env = dict(os.environ, DFLASH_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "preflight.probe", "--gpus", "0", "--json"], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == "preflight.probe: error: no NVIDIA driver (NVML not found)\n"


def test_a_gpu_process_of_this_preflight_is_not_another_process(tmp_path):
    gpus = recorded()
    gpus["gpus"][0]["processes"] = [{"pid": 4242, "name": "dflash-train", "used_bytes": 1 * GiB}]  # the gate's own pid
    ctx = make_ctx(tmp_path, config={"topology": ONE_PAIR}, gpus=gpus)
    assert ctx.host["pid"] == 4242 and ctx.gpus.snapshot.gpus[0].processes == (GpuProcess(4242, "dflash-train", GiB),)
    got = probe_for_run(ctx)
    assert "held by" not in (got.gpus[gpus["gpus"][0]["uuid"]].note or "")


# ---------------------------------------------------------------- the snapshot and dflash-diff


def test_the_snapshot_records_the_overhead_and_diff_shows_its_change(tmp_path):
    from preflight.diff import compare
    from preflight.snapshot import take

    def snap(torch: str, gib: float) -> dict:
        ctx = make_ctx(tmp_path, config={"topology": ONE_PAIR, "train": {"recompute": "off"}})
        ctx.torch = TorchBuild(torch, torch[-3:-1] + "." + torch[-1], "torch/version.py")
        ctx.overhead = measured(ctx, gib)
        for g in ctx.overhead.gpus.values():
            g.state = state(torch=torch).to_dict()
        return take(ctx)

    a, b = snap("2.10.0+cu128", 1.12), snap("2.10.0+cu130", 1.31)
    uuid5 = recorded()["gpus"][5]["uuid"]
    assert a["memory"]["overhead"][uuid5]["outside_torch_bytes"] == int(1.12 * GiB)
    assert a["memory"]["overhead"][uuid5]["roles"] == ["drafter"] and a["memory"]["overhead"][uuid5]["source"] == "measured"
    d = compare(a, b)
    line = next(x for x in d.differences if x.key == "outside torch")
    assert line.text == "outside torch: 1.12 -> 1.31 GiB per GPU; torch 2.10.0+cu128 -> 2.10.0+cu130"
    assert line.moves == "memory" and line.effect == "memory model: +0.19 GiB per GPU"
    assert d.memory == ["target peak 1.75 GiB -> 1.94 GiB (+0.19 GiB)", "drafter peak 12.31 GiB -> 12.50 GiB (+0.19 GiB)"]
    torch_line = next(x for x in d.differences if x.key == "torch")
    assert torch_line.effect is None  # measured on both machines: the outside-torch line says what the build cost
    assert not [x for x in compare(a, copy.deepcopy(a)).differences if x.key == "outside torch"]


# ---------------------------------------------------------------- on its own, and in dflash-estimate


def test_the_probe_prints_each_gpu_its_readings_and_why_not():
    from preflight.probe import format_overhead

    snap = snapshot_from_dict(recorded())
    g0, g1 = snap.gpus[0], snap.gpus[1]
    out = {"baseline_device_used_bytes": 0, "steps": [
        {"step": "context", "process_bytes": int(0.60 * GiB), "torch_reserved_bytes": 0, "device_used_bytes": int(1.07 * GiB)},
        {"step": "matmul", "process_bytes": int(0.94 * GiB), "torch_reserved_bytes": int(0.28 * GiB),
         "device_used_bytes": int(1.41 * GiB)}]}
    overhead = Overhead({g0.uuid: from_probe(g0.uuid, out, state(), "2026-12-07T01:00:00Z"),
                         g1.uuid: GpuOverhead(g1.uuid, "constant", note="GPU 1 not probed: held by pid 7; the "
                                                                         "calibrated constant is used")})
    assert format_overhead(overhead, {"0": g0, "1": g1}) == [
        f"GPU 0 ({g0.name}, {g0.uuid[:12]}…): outside torch 0.66 GiB (context and kernels 0.66) [measured, "
        "2026-12-07T01:00:00Z]",
        "  after context    process 0.60 GiB, torch reserved 0.00, card used 1.07",
        "  after matmul     process 0.94 GiB, torch reserved 0.28, card used 1.41",
        f"GPU 1 ({g1.name}, {g1.uuid[:12]}…): GPU 1 not probed: held by pid 7; the calibrated constant is used"]


def test_estimate_probe_without_a_driver_says_so_and_keeps_the_constant(capsys):
    from dflash.commands.estimate import main
    from preflight.profiles import REPO_ROOT

    with pytest.raises(SystemExit) as e:
        main(["--config", str(REPO_ROOT / "configs/qwen3-8b-1gpu.toml"), "--gpu-memory", "80GiB", "--probe"])
    out = capsys.readouterr().out.splitlines()
    assert e.value.code == 0
    assert out[3] == "outside torch: not probed (no NVIDIA driver (NVML not found)); the calibrated constant is used"


def test_estimate_probe_uses_the_measured_overhead(monkeypatch):
    """probed_calibration with the probe's answer faked at its one seam below NVML (probe_named)."""
    import preflight.probe as probe
    from preflight.estimate import probed_calibration
    from preflight.facts.environment import torch_build
    from preflight.profiles import REPO_ROOT

    build = torch_build()
    gpu = snapshot_from_dict(recorded()).gpus[0]
    got = GpuOverhead(gpu.uuid, "measured", context_bytes=int(0.66 * GiB))
    monkeypatch.setattr(probe, "probe_named", lambda names, steps, timeout: (Overhead({gpu.uuid: got}), {"0": gpu}))
    from dflash.config import load_config

    cfg = load_config(REPO_ROOT / "configs/qwen3-8b-1gpu.toml")
    cal, line = probed_calibration(cfg, build.cuda)
    assert cal.context_bytes(build.cuda) == int(0.66 * GiB)
    assert line == (f"outside torch: measured 0.66 GiB per GPU (context and kernels 0.66; measured, torch "
                    f"{build.version}, GPUs 0); steps context, matmul, attention")
    other = "13.0" if build.cuda.startswith("12") else "12.8"
    cal, line = probed_calibration(cfg, other)
    assert cal == DEFAULT_CALIBRATION and "not CUDA" in line


@pytest.mark.gpu
@pytest.mark.gpu_alone  # the probe refuses a GPU another process holds: pytest's other workers would
@pytest.mark.skipif(not os.path.exists("/dev/nvidia0"), reason="needs a CUDA GPU (the real probe)")
def test_on_a_gpu_the_probe_measures_and_leaves_nothing_behind(tmp_path):
    from preflight.nvml import NvmlGpuInfo
    from preflight.probe import probe_named

    got, gpus = probe_named(["0"], ("context", "matmul", "attention", "nccl"), use_cache=False)
    g = got.gpus[gpus["0"].uuid]
    assert g.measured, g.note
    assert 0.2 * GiB < g.context_bytes < 4 * GiB and g.nccl_bytes is not None
    after = NvmlGpuInfo().snapshot().gpus[gpus["0"].index]
    assert g.pid and g.pid not in {p.pid for p in after.processes}
    with pytest.raises(ProcessLookupError):
        os.kill(g.pid, 0)


def test_the_probe_process_refuses_an_unknown_step_in_one_json_line(capsys):
    from preflight.probe_gpu import main

    assert main(["--uuid", "GPU-0", "--steps", "context,warp"]) == 1
    out = capsys.readouterr().out
    assert json.loads(out) == {"ok": False, "error": "unknown step(s) warp (known: context, matmul, attention, flex, "
                                                     "fla, nccl)"}
    assert out.count("\n") == 1


@pytest.mark.gpu
@pytest.mark.gpu_alone  # the probe refuses a GPU another process holds: pytest's other workers would
@pytest.mark.skipif(not os.path.exists("/dev/nvidia0"), reason="needs a CUDA GPU (the real probe)")
def test_on_a_gpu_preflight_reports_and_uses_the_measured_overhead(tmp_path):
    from dflash.config import load_config
    from preflight.gate import build_report
    from preflight.profiles import REPO_ROOT

    cfg = load_config(REPO_ROOT / "configs/qwen3-8b-1gpu.toml", {"output_dir": str(tmp_path / "run")})
    check = next(c for c in build_report(cfg.profile, cfg).checks if c.id == "gpu-memory")
    row = check.data["gpus"][0]
    assert row["outside_torch_source"] in ("measured", "cached"), check.summary
    assert "outside torch measured" in check.summary
    from dflash.memory.parts import with_recompute

    mode = check.data["model"].rpartition("-> ")[2] if "->" in check.data["model"] else cfg.train.recompute
    cal = with_measured_overhead(DEFAULT_CALIBRATION, "12.8", row["outside_torch_bytes"])  # one GPU: no NCCL
    assert row["need_bytes"] == role_need_bytes(with_recompute(cfg, mode), "colocated", "12.8", cal)
