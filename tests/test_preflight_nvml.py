"""NVML behind one interface: the recorded fake, CUDA_VISIBLE_DEVICES mapping, the real pynvml path."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from preflight.nvml import (
    NO_DRIVER,
    FakeGpuInfo,
    NvmlGpuInfo,
    NvmlUnavailable,
    resolve_gpu,
    snapshot_from_dict,
    snapshot_to_dict,
    visible_gpus,
)

DATA = Path(__file__).parent / "data"
FIXTURE = DATA / "nvml_fake_8gpu.json"


@pytest.fixture()
def snap():
    return FakeGpuInfo.from_json(FIXTURE).snapshot()


def test_fake_replays_eight_gpus_with_processes(snap):
    assert snap.driver_version == "570.133.20" and snap.cuda_driver_version == "12.8"
    assert len(snap.gpus) == 8 and len({g.uuid for g in snap.gpus}) == 8
    assert [g.index for g in snap.gpus if g.processes] == [6, 7]
    assert snap.gpus[6].processes[0].name == "python3 -m sglang.launch_server"
    assert snap.gpus[0].compute_capability == "9.0"


def test_fake_without_driver_raises(snap):
    with pytest.raises(NvmlUnavailable, match="no NVIDIA driver"):
        FakeGpuInfo(None).snapshot()


def test_snapshot_round_trips_through_the_recorded_format(snap):
    again = snapshot_from_dict(json.loads(json.dumps(snapshot_to_dict(snap))))
    assert again == snap


def test_recorded_h200_snapshot_loads():
    real = FakeGpuInfo.from_json(DATA / "nvml_h200.json").snapshot()
    assert real.gpus and real.gpus[0].name == "NVIDIA H200" and real.gpus[0].uuid.startswith("GPU-")


def test_visible_gpus_unset_empty_and_order(snap):
    assert visible_gpus(snap.gpus, None)[0] == list(snap.gpus)
    none, note = visible_gpus(snap.gpus, "")
    assert none == [] and "every GPU is hidden" in note
    two, note = visible_gpus(snap.gpus, "5,2")
    assert [g.index for g in two] == [5, 2] and note is None


def test_visible_gpus_by_uuid_and_prefix(snap):
    u = [g.uuid for g in snap.gpus]
    got, note = visible_gpus(snap.gpus, f"{u[3]},{u[1][:10]}, {u[0][4:14]}")
    assert [g.index for g in got] == [3, 1, 0] and note is None


def test_visible_gpus_invalid_entry_hides_the_rest(snap):
    got, note = visible_gpus(snap.gpus, "1,9,2")
    assert [g.index for g in got] == [1]
    assert "'9' names no GPU" in note and "9,2" in note
    got, note = visible_gpus(snap.gpus, "1,1,2")
    assert [g.index for g in got] == [1] and "twice" in note


def test_resolve_gpu_index_uuid_hidden_missing(snap):
    visible, _ = visible_gpus(snap.gpus, "4,5")
    assert resolve_gpu("1", visible, snap.gpus)[0].index == 5  # index after CUDA_VISIBLE_DEVICES
    assert resolve_gpu(snap.gpus[4].uuid, visible, snap.gpus)[0].index == 4
    gpu, why = resolve_gpu(snap.gpus[0].uuid, visible, snap.gpus)
    assert gpu is None and "CUDA_VISIBLE_DEVICES hides it" in why
    gpu, why = resolve_gpu("2", visible, snap.gpus)
    assert gpu is None and "not visible (2 visible" in why
    gpu, why = resolve_gpu("GPU-ffffffff", visible, snap.gpus)
    assert gpu is None and "matches no GPU" in why


class _Proc:
    def __init__(self, pid, used):
        self.pid, self.usedGpuMemory = pid, used


def _fake_pynvml(fail_init: Exception | None = None) -> types.ModuleType:
    """A stand-in for the pynvml module, to drive NvmlGpuInfo's real code path on a machine without a driver."""
    m = types.ModuleType("pynvml")
    mem = types.SimpleNamespace(total=100 * 2**30, free=90 * 2**30, used=10 * 2**30)

    def init():
        if fail_init:
            raise fail_init

    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlSystemGetCudaDriverVersion = lambda: 12080
    m.nvmlSystemGetDriverVersion = lambda: b"570.133.20"
    m.nvmlDeviceGetCount = lambda: 2
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetMemoryInfo = lambda h: mem
    m.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    procs = [_Proc(999_999_991, 2**30), _Proc(999_999_992, 2**64 - 1)]
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: procs if h else []
    m.nvmlDeviceGetGraphicsRunningProcesses = lambda h: [_Proc(999_999_991, 2**30)] if h else []
    m.nvmlDeviceGetUUID = lambda h: f"GPU-0000000{h}-aaaa-bbbb-cccc-dddddddddddd"
    m.nvmlDeviceGetName = lambda h: "NVIDIA H200"
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=b"00000000:18:00.0")

    def no_name(pid):
        raise RuntimeError("not found")

    m.nvmlSystemGetProcessName = no_name
    return m


def test_real_provider_reads_pynvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    snap = NvmlGpuInfo().snapshot()
    assert snap.cuda_driver_version == "12.8" and snap.driver_version == "570.133.20"
    assert [g.uuid[:12] for g in snap.gpus] == ["GPU-00000000", "GPU-00000001"]
    procs = snap.gpus[1].processes
    assert [(p.pid, p.name, p.used_bytes) for p in procs] == [(999_999_991, "?", 2**30), (999_999_992, "?", None)]


def test_real_provider_without_library(monkeypatch):
    class LibraryNotFound(Exception):
        def __str__(self):
            return "NVML Shared Library Not Found"

    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(LibraryNotFound()))
    with pytest.raises(NvmlUnavailable) as e:
        NvmlGpuInfo().snapshot()
    assert str(e.value) == NO_DRIVER


def test_real_nvml_when_present():
    """Runs against the machine's real driver; skipped where there is none (never faked as passing)."""
    try:
        snap = NvmlGpuInfo().snapshot()
    except NvmlUnavailable as e:
        pytest.skip(f"real NVML absent: {e}")
    assert snap.driver_version and snap.cuda_driver_version.count(".") == 1
    for g in snap.gpus:
        assert g.uuid.startswith(("GPU-", "MIG-")) and 0 <= g.memory_free <= g.memory_total


def test_recorded_h200_report_matches_the_schema():
    """The real-NVML run recorded on an H200 (torch swapped to the CUDA 13.0 build) still parses as a Report."""
    from preflight.checks.registry import CHECK_IDS
    from preflight.report import Report

    report = Report.model_validate_json((DATA / "preflight_h200_run.json").read_text())
    recorded_before = ("config",)  # checks added after the recording; a recording is never edited
    assert [c.id for c in report.checks] == [i for i in CHECK_IDS if i not in recorded_before] and report.ok is False
    assert report.by_id("torch-build").summary.startswith("torch 2.11.0+cu130 (CUDA 13.0) installed")
    assert report.by_id("gpu-visibility").status == "pass" and report.host["nvidia_driver"] == "580.159.04"
