"""preflight/checks/gpus.py: gpu-visibility, gpu-memory and gpu-processes, fed facts (pass and fail paths)."""

from __future__ import annotations

import pytest

from preflight.checks.gpus import check_gpu_memory, check_gpu_processes, check_gpu_visibility
from preflight.checks.run import check_disk
from preflight.checks.source import check_compile_cache
from preflight.facts.gpus import GpuFacts
from preflight.nvml import NO_DRIVER
from preflight_ctx import GiB, make_ctx, recorded

# ---------------------------------------------------------------- gpu-visibility


def test_gpu_visibility_no_driver_fails_cpu_skips(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.gpus = GpuFacts(error=NO_DRIVER)
    for check in (check_gpu_visibility, check_gpu_memory, check_gpu_processes):
        r = check(ctx)
        assert r.status == "fail" and r.summary == "no NVIDIA driver (NVML not found)"
    ctx = make_ctx(tmp_path, config={"device": "cpu"})
    ctx.gpus = GpuFacts(error="NVML not queried (device = cpu)", queried=False)
    for check in (check_gpu_visibility, check_gpu_memory, check_gpu_processes,
                  check_compile_cache):
        assert check(ctx).status == "skip"


def test_gpu_visibility_hidden_gpu_fails(tmp_path):
    ctx = make_ctx(tmp_path, cvd="0,1,2,3,4,5")  # GPUs 6 and 7 hidden: the config's drafters 6, 7 do not exist
    r = check_gpu_visibility(ctx)
    assert r.status == "fail"
    assert "GPU 6 is not visible (6 visible after CUDA_VISIBLE_DEVICES)" in r.summary


def test_gpu_visibility_maps_uuids_through_cuda_visible_devices(tmp_path):
    d = recorded()
    u = [g["uuid"] for g in d["gpus"]]
    cvd = ",".join(u[::-1])  # reversed order: CUDA index 0 is NVML GPU 7
    topo = {"target_gpus": ["0", "1"], "drafter_gpus": [u[0][:12]]}  # UUID prefix of NVML GPU 0 = CUDA index 7
    ctx = make_ctx(tmp_path, config={"topology": topo}, cvd=cvd)
    r = check_gpu_visibility(ctx)
    assert r.status == "pass", r.summary
    assigned = {a["name"]: a["uuid"] for a in r.data["assigned"]}
    assert assigned == {"0": u[7], "1": u[6], u[0][:12]: u[0]}
    clash = {"target_gpus": ["7"], "drafter_gpus": [u[0]]}  # CUDA 7 *is* NVML GPU 0 under this mapping
    r = check_gpu_visibility(make_ctx(tmp_path, config={"topology": clash}, cvd=cvd))
    assert r.status == "fail" and "are the same GPU" in r.summary


def test_gpu_visibility_uuid_hidden_by_cvd(tmp_path):
    u = [g["uuid"] for g in recorded()["gpus"]]
    ctx = make_ctx(tmp_path, config={"topology": {"target_gpus": ["0"], "drafter_gpus": [u[3]]}}, cvd="0,1")
    r = check_gpu_visibility(ctx)
    assert r.status == "fail" and "exists (NVML index 3) but CUDA_VISIBLE_DEVICES hides it" in r.summary


# ---------------------------------------------------------------- gpu-memory


def test_gpu_memory_memory_model_passes_and_reports_each_gpu(tmp_path):
    r = check_gpu_memory(make_ctx(tmp_path))
    assert r.status == "pass", r.summary
    assert len(r.data["gpus"]) == 8
    assert all(g["headroom_bytes"] == g["free_bytes"] - g["need_bytes"] for g in r.data["gpus"])


def test_a_torchrun_rank_checks_its_own_gpu_in_its_own_role(tmp_path):
    """A torchrun rank hands the gate {its cuda index: its rank's role} (Rank.role, the topology's vocabulary)."""
    ctx = make_ctx(tmp_path, config={"topology": {"colocated_gpus": ["0", "1"]}})
    ctx.own_gpus = {"1": "colocated"}
    r = check_gpu_memory(ctx)
    assert [(g["name"], g["role"]) for g in r.data["gpus"]] == [("1", "colocated")] and r.summary.startswith("colocated GPU 1")
    assert check_gpu_visibility(ctx).data["assigned"][0]["role"] == "colocated"


def test_gpu_memory_fails_when_need_exceeds_free(tmp_path):
    busy = recorded()
    busy["gpus"][5]["memory_free"] = int(4.57 * GiB)  # the incident: 4.57 GiB free on a drafter GPU

    def need(ctx, role):
        return (int(4.74 * GiB) if role == "drafter" else 40 * GiB), "test model"

    r = check_gpu_memory(make_ctx(tmp_path, gpus=busy), need_fn=need)
    assert r.status == "fail"
    assert "drafter GPU 5" in r.summary
    assert "need 4.7 GiB + 3.0 GiB kept free (train.memory_headroom_gib), free 4.6 GiB, short 3.2 GiB" in r.summary
    assert "dflash-estimate" in r.fix


@pytest.mark.parametrize("keep, status", [(3.0, "fail"), (1.0, "pass")])
def test_gpu_memory_keeps_the_configured_headroom_free(tmp_path, keep, status):
    """The users' box: 93.48 GiB predicted on a free 95 GiB card (NVML then read 96.47) fits the card alone, not
    the card less the 3 GiB a run keeps free by default; a smaller train.memory_headroom_gib is the user's call."""
    gpus = recorded()
    gpus["gpus"][5]["memory_free"] = 95 * GiB

    def need(ctx, role):
        return (int(93.48 * GiB) if role == "drafter" else 40 * GiB), "test model"

    ctx = make_ctx(tmp_path, gpus=gpus, config={"train": {"memory_headroom_gib": keep}})
    r = check_gpu_memory(ctx, need_fn=need)
    assert r.status == status, r.summary
    row = next(g for g in r.data["gpus"] if g["name"] == "5")
    assert row["keep_bytes"] == int(keep * GiB) and row["headroom_bytes"] == 95 * GiB - int(93.48 * GiB)
    if status == "fail":
        assert "need 93.5 GiB + 3.0 GiB kept free (train.memory_headroom_gib), free 95.0 GiB, short 1.5 GiB" in r.summary


def test_gpu_memory_colocated_gpu_0_needs_the_colocated_role(tmp_path):
    from dflash.memory.parts import role_need_bytes

    ctx = make_ctx(tmp_path, config={"topology": {"target_gpus": [], "drafter_gpus": []}})
    r = check_gpu_memory(ctx)
    assert [(g["name"], g["role"]) for g in r.data["gpus"]] == [("0", "colocated")]  # co-located: GPU 0, both models
    assert r.summary.startswith("colocated GPU 0 need ")
    # recompute = auto is judged as the trainer resolves it: the fastest mode that fits the free memory
    assert r.data["model"] == "memory model, recompute auto -> off" and "[memory model, recompute auto -> off]" in r.summary
    assert r.data["gpus"][0]["need_bytes"] == role_need_bytes(ctx.config, "colocated", "12.8")


def test_gpu_checks_see_every_colocated_data_parallel_gpu_in_the_colocated_role(tmp_path):
    """topology.colocated_gpus: each GPU holds a target and a drafter replica; gpu-memory asks the memory model for
    the co-located role of this run (DDP's buckets included), gpu-visibility for each GPU once."""
    from dflash.memory.parts import choose_recompute

    gpus = [str(i) for i in range(8)]
    ctx = make_ctx(tmp_path, config={"topology": {"colocated_gpus": gpus}})
    r = check_gpu_memory(ctx)
    assert r.status == "pass", r.summary
    assert [(g["name"], g["role"]) for g in r.data["gpus"]] == [(n, "colocated") for n in gpus]
    free = r.data["gpus"][0]["free_bytes"]
    assert r.data["gpus"][0]["need_bytes"] == choose_recompute(ctx.config, "colocated", "12.8", free)[1]
    one = make_ctx(tmp_path, config={"topology": {"target_gpus": [], "drafter_gpus": []}})
    assert r.data["gpus"][0]["need_bytes"] > check_gpu_memory(one).data["gpus"][0]["need_bytes"]  # + DDP buckets
    vis = check_gpu_visibility(ctx)
    assert vis.status == "pass" and "all 8 assigned GPUs visible and each has one role" in vis.summary, vis.summary
    r = check_gpu_visibility(make_ctx(tmp_path, config={"topology": {"colocated_gpus": ["0", "9"]}}))
    assert r.status == "fail" and "GPU 9 is not visible" in r.summary and "colocated_gpus" in r.fix


def test_gpu_memory_and_disk_judge_the_gathered_shape_without_reading_files(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.config.target.path = str(tmp_path / "gone")  # nothing to read there: the checks must not try
    assert check_gpu_memory(ctx).status == "pass" and check_disk(ctx).status == "pass"
    ctx = make_ctx(tmp_path, config={"target": {"path": str(tmp_path / "no-model")}})
    r = check_gpu_memory(ctx)
    assert r.status == "fail" and "memory model failed" in r.summary and "no-model/config.json: not found" in r.summary
    assert r.fix == "dflash-estimate --config run.toml"


# ---------------------------------------------------------------- gpu-processes


def test_gpu_processes_fails_naming_pid_name_and_mib(tmp_path):
    r = check_gpu_processes(make_ctx(tmp_path, gpus=recorded(idle=False)))
    assert r.status == "fail"
    assert "GPU 6: pid 48219 python3 -m sglang.launch_server (121,240 MiB)" in r.summary
    assert r.fix.startswith("stop them") and "kill 48219 48220" in r.fix
    assert [p["pid"] for p in r.data["processes"]] == [48219, 48220]


def test_gpu_processes_ignores_unassigned_gpus_and_itself(tmp_path):
    topo = {"target_gpus": ["0", "1", "2"], "drafter_gpus": ["3", "4"]}
    r = check_gpu_processes(make_ctx(tmp_path, config={"topology": topo}, gpus=recorded(idle=False)))
    assert r.status == "pass"
    d = recorded()
    d["gpus"][0]["processes"] = [{"pid": 4242, "name": "dflash-train", "used_bytes": 0}]
    assert check_gpu_processes(make_ctx(tmp_path, gpus=d)).status == "pass"


def test_gpu_memory_judges_data_parallel_auto_as_resolved_on_the_users_box(tmp_path):
    """The users' preset co-located over their 8 GPUs of 95 GiB: auto resolves to fsdp2 (DDP needs 98 GiB) and passes;
    data_parallel = ddp is refused, naming the shortfall."""
    import tomllib
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    raw = tomllib.loads((repo / "configs/qwen3.6-27b-5t3d.toml").read_text())
    raw["target"]["path"] = str(repo / raw["target"]["path"])
    raw["data"]["path"] = str(tmp_path / "data")
    raw["topology"] = {"colocated_gpus": [str(i) for i in range(8)]}
    gpus = recorded()
    for g in gpus["gpus"]:
        g["memory_total"], g["memory_free"], g["memory_used"] = 95 * GiB, 95 * GiB, 0
    ctx = make_ctx(tmp_path, config={k: raw[k] for k in ("target", "drafter", "data", "train", "topology")}, gpus=gpus)
    r = check_gpu_memory(ctx)
    assert r.status == "pass", r.summary
    # packed, off (91.39 GiB) fits with the 3 GiB kept free
    assert r.data["model"] == "memory model, recompute auto -> off, data_parallel auto -> fsdp2"
    assert all(90 * GiB < g["need_bytes"] <= 92 * GiB for g in r.data["gpus"])
    for g in gpus["gpus"]:  # 2 GiB less free on each GPU (a server's context, say): off no longer fits, mlp does
        g["memory_free"], g["memory_used"] = 93 * GiB, 2 * GiB
    r = check_gpu_memory(make_ctx(tmp_path, config={k: raw[k] for k in ("target", "drafter", "data", "train",
                                                                         "topology")}, gpus=gpus))
    assert r.status == "pass" and r.data["model"] == "memory model, recompute auto -> mlp, data_parallel auto -> fsdp2"
    assert all(80 * GiB < g["need_bytes"] <= 84 * GiB for g in r.data["gpus"])
    for g in gpus["gpus"]:
        g["memory_free"], g["memory_used"] = 95 * GiB, 0
    raw["train"]["data_parallel"] = "ddp"
    ctx = make_ctx(tmp_path, config={k: raw[k] for k in ("target", "drafter", "data", "train", "topology")}, gpus=gpus)
    r = check_gpu_memory(ctx)
    assert r.status == "fail" and "colocated GPU 0" in r.summary and "recompute auto -> layer" in r.summary, r.summary
