"""Preflight checks as pure functions: feed facts, assert verdicts (pass and fail path of every check)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from dflash.config import config_from_dict
from dflash.data.identity import ValueStats
from preflight.checks.dataset import check_dataset
from preflight.checks.env_vars import check_env_vars
from preflight.checks.environment import check_cuda_libs, check_env_drift, check_profile, check_torch_build
from preflight.checks.gpus import check_gpu_memory, check_gpu_processes, check_gpu_visibility
from preflight.checks.registry import CHECK_IDS, CHECKS, NEEDS_CONFIG, NEEDS_PROFILE, run_checks
from preflight.checks.run import _size, check_config, check_disk, check_run_dir
from preflight.checks.source import check_compile_cache, check_model_source
from preflight.facts.context import Context
from preflight.facts.dataset import Dataset, Shard
from preflight.facts.environment import EnvIdentity, RecordCheck, Records, SyncRecord, TorchBuild
from preflight.facts.gpus import GpuFacts
from preflight.facts.paths import LibDir, PathEntry
from preflight.facts.run import Checkpoint, Disk, RunDir, target_shape
from preflight.facts.run import disk as disk_facts
from preflight.facts.source import CompileCache, ModelSource
from preflight.nvml import NO_DRIVER, snapshot_from_dict
from preflight.profiles import load_profile

FIXTURE = Path(__file__).parent / "data" / "nvml_fake_8gpu.json"
GiB = 1024**3
MiB = 1024**2
PINS = ["click==8.5.1", "nvidia-cuda-runtime-cu12==12.8.90", "nvidia-nccl-cu12==2.27.5", "torch==2.10.0",
        "triton==3.6.0"]
LOCK = "".join(f"{pin} \\\n    --hash=sha256:{i:02x}\n" for i, pin in enumerate(PINS))
INSTALLED = {"click": ["8.5.1"], "nvidia-cuda-runtime-cu12": ["12.8.90"], "nvidia-nccl-cu12": ["2.27.5"],
             "torch": ["2.10.0+cu128"], "triton": ["3.6.0"], "dflash": ["0.1.0"]}
SPLIT = {"target_gpus": ["0", "1", "2", "3", "4"], "drafter_gpus": ["5", "6", "7"]}


def recorded(idle: bool = True) -> dict:
    d = json.loads(FIXTURE.read_text())
    if idle:
        for g in d["gpus"]:
            g["processes"] = []
            g["memory_free"] = g["memory_total"] - 560 * MiB
    return d


def healthy_dataset(path: str, shape) -> Dataset:
    """Two shards written by dflash-data for this target: the manifest records them and the target's fingerprint."""
    target = None if shape is None else {"vocab_size": shape.vocab, "model_type": shape.model_type,
                                         "num_layers": shape.num_layers, "hidden": shape.hidden,
                                         "tokenizer_sha256": "ab" * 32}
    shards = [Shard("a.arrow", rows=600, tokens=900_000, max_len=3000, max_row=7, size_bytes=5_400_000,
                    values=ValueStats(3, 49_000, 0, 1, 700_000), sha256="11" * 32),
              Shard("b.arrow", rows=400, tokens=500_000, max_len=4000, max_row=12, first_row=600, size_bytes=3_000_000,
                    values=ValueStats(0, 48_000, 0, 1, 400_000), sha256="22" * 32)]
    manifest = {"target": target, "shards": {s.name: {"bytes": s.size_bytes, "sha256": s.sha256, "samples": s.rows}
                                                   for s in shards}}
    return Dataset(path, 4096, shards=shards, manifest=manifest, target=target)


def make_ctx(tmp_path: Path, config: dict | None = None, gpus: dict | None = None, cvd: str | None = None) -> Context:
    """A machine on which every check passes: 8 idle H200s, the locked stack, a warm cache, clean source."""
    profile = load_profile("train-cu128")
    raw = {"output_dir": str(tmp_path / "run"), "data": {"path": str(tmp_path / "data"), "token_budget": 4096},
           "topology": SPLIT}
    raw.update(config or {})
    cfg = config_from_dict(raw)
    venv = tmp_path / "venv"
    snap = snapshot_from_dict(gpus if gpus is not None else recorded())
    shape, shape_error = target_shape(cfg)  # the one fact gather reads from target.path
    ctx = Context(
        profile_name="train-cu128", profile=profile, lock_file="envs/train-cu128.lock", lock_text=LOCK, config=cfg,
        config_path="run.toml", distributions=copy.deepcopy(INSTALLED),
        torch=TorchBuild("2.10.0+cu128", "12.8", "torch/version.py"),
        env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
        path_entries=[PathEntry(str(venv / "bin"), True, str(venv), True), PathEntry(str(tmp_path / "sys"), True)],
        gpus=GpuFacts(snapshot=snap, cuda_visible_devices=cvd),
        model_source=ModelSource("git", commit="0123456789abcdef", verified=["dflash/model.py", "dflash/loss.py"]),
        compile_cache=CompileCache(str(tmp_path / "cache"), True, size_bytes=353_000_000, manifest={
            "torch": "2.10.0+cu128", "triton": "3.6.0", "gpu_name": "NVIDIA H200", "compute_capability": "9.0",
            "drafter_hash": cfg.drafter_hash(), "target_hash": cfg.target_hash()}),
        run_dir=RunDir(cfg.output_dir, False, True),
        dataset=healthy_dataset(cfg.data.path, shape),
        disk=Disk(cfg.output_dir, free_bytes=500 * GiB),
        target_shape=shape, target_error=shape_error,
        host={"pid": 4242},
    )
    return ctx


def by_id(results, check_id):
    return next(r for r in results if r.id == check_id)


def test_healthy_machine_passes_every_check(tmp_path):
    results = run_checks(make_ctx(tmp_path))
    assert [r.id for r in results] == list(CHECK_IDS)
    assert {r.id: r.status for r in results} == {i: "pass" for i in CHECK_IDS}
    assert all(r.fix is None for r in results)


def test_without_config_run_checks_skip_and_say_so(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.config = None
    results = run_checks(ctx)
    skipped = [r.id for r in results if r.status == "skip"]
    assert skipped == list(NEEDS_CONFIG) == ["gpu-memory", "gpu-processes", "config", "run-dir", "dataset", "disk"]
    assert all("--config" in by_id(results, i).summary for i in NEEDS_CONFIG)
    assert by_id(results, "gpu-visibility").status == "pass"  # still proves NVML is reachable


# ---------------------------------------------------------------- profile


def test_profile_fails_without_lock(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.lock_text = None
    r = check_profile(ctx)
    assert r.status == "fail" and "envs/train-cu128.lock is missing" in r.summary
    assert r.fix == "uv run dflash-lock write"


def test_profile_fails_on_invalid_lock_and_wrong_profile(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.lock_text = LOCK.replace("torch==2.10.0", "torch==2.11.0")
    r = check_profile(ctx)
    assert r.status == "fail" and "torch==2.11.0" in r.summary
    ctx = make_ctx(tmp_path, config={"profile": "infer-cu130"})
    r = check_profile(ctx)
    assert r.status == "fail" and "asks for profile infer-cu130" in r.summary
    assert r.fix == ("uv run --isolated --no-default-groups dflash-env sync --profile infer-cu130 && uv run --isolated "
                     "--no-default-groups dflash-env run --profile infer-cu130 -- dflash-preflight --profile infer-cu130 "
                     "--config run.toml")


def test_profile_warns_when_this_interpreter_is_not_the_profiles_environment(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.env_identity = EnvIdentity(str(tmp_path / "venv"), str(tmp_path / "venv"), default=True)
    r = check_profile(ctx)
    assert r.status == "pass" and r.summary.endswith(f"; running in its environment {tmp_path / 'venv'}")
    # dflash-preflight --profile infer-cu130 run in the training env: every environment check would judge the wrong env
    ctx = make_ctx(tmp_path, config={"profile": "infer-cu130"})
    ctx.profile_name, ctx.profile = "infer-cu130", load_profile("infer-cu130")
    ctx.lock_text = "torch==2.14.1 --hash=sha256:00\nnvidia-cuda-runtime==13.0.96 --hash=sha256:01\n"
    ctx.env_identity = EnvIdentity(str(tmp_path / ".venv"), str(tmp_path / ".venvs/infer-cu130"), default=False)
    r = check_profile(ctx)
    assert r.status == "warn" and f"this interpreter runs in {tmp_path / '.venv'}, not in profile infer-cu130's" in r.summary
    run_there = ("uv run --isolated --no-default-groups dflash-env sync --profile infer-cu130 && uv run --isolated "
                 "--no-default-groups dflash-env run --profile infer-cu130 -- dflash-preflight --profile infer-cu130 "
                 "--config run.toml")
    assert r.fix == run_there
    assert check_torch_build(ctx).fix == run_there  # not "sync": the profile's own env may be fine
    # the training profile outside .venv (a conda shell): `uv run` builds and uses .venv
    ctx = make_ctx(tmp_path)
    ctx.env_identity = EnvIdentity("/opt/conda", str(tmp_path / ".venv"), default=True)
    assert check_profile(ctx).fix == "uv run dflash-preflight --profile train-cu128 --config run.toml"


def test_every_fix_line_works_on_a_fresh_clone(tmp_path):
    """No uv.lock in a clone (git-ignored) and no dflash-* command on PATH: every fix goes through `uv run` or
    dflash-env's launcher, never `uv sync --frozen`."""
    ctx = make_ctx(tmp_path, config={"profile": "infer-cu130"})
    ctx.torch = TorchBuild("2.11.0+cu130", "13.0", "torch/version.py")
    ctx.distributions["sglang"] = ["0.5.23"]
    ctx.distributions["nvidia-cuda-runtime"] = ["13.0.96"]
    ctx.compile_cache = CompileCache(str(tmp_path / "cache"), False)
    ctx.model_source = ModelSource("record", commit="dflash==0.1.0", modified=["dflash/loss.py"])
    fixes = [r.fix for r in run_checks(ctx) if r.fix]
    ctx.env_identity = EnvIdentity("/opt/conda", str(tmp_path / ".venvs/infer-cu130"), default=False)
    fixes += [r.fix for r in run_checks(ctx) if r.fix]
    assert len(fixes) >= 8
    for fix in fixes:
        assert "uv sync" not in fix and "--frozen" not in fix, fix
        for m in re.finditer(r"(?<![\w/.-])dflash-[a-z]+(?![\w.-])", fix):
            before = fix[:m.start()]
            assert before.endswith(("uv run ", "uv run --isolated --no-default-groups ", " -- ")), fix


def test_profile_that_did_not_load_fails_and_dependent_checks_skip(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.profile, ctx.profile_error = None, "train-cu128.toml: cuda: cuda must be major.minor like 12.8, got '12'"
    results = run_checks(ctx)
    assert by_id(results, "profile").status == "fail"
    assert {by_id(results, i).status for i in NEEDS_PROFILE} == {"skip"}


# ---------------------------------------------------------------- torch-build


def test_torch_build_cuda13_swap_fails_naming_both(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.torch = TorchBuild("2.11.0+cu130", "13.0", "torch/version.py")
    r = check_torch_build(ctx)
    assert r.status == "fail"
    assert r.summary == "torch 2.11.0+cu130 (CUDA 13.0) installed; profile train-cu128 locks 2.10.0 (CUDA 12.8)"
    assert r.fix == "uv run --isolated --no-default-groups dflash-env sync --profile train-cu128"


def test_torch_build_same_version_other_cuda_and_missing_fail(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.torch = TorchBuild("2.10.0+cu126", "12.6", "torch/version.py")
    assert check_torch_build(ctx).status == "fail"
    ctx.torch = None
    r = check_torch_build(ctx)
    assert r.status == "fail" and "torch is not installed" in r.summary


# ---------------------------------------------------------------- env-drift


def test_env_drift_gpu_stack_fails_other_warns(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.distributions["sglang"] = ["0.5.23"]
    ctx.distributions["triton"] = ["3.5.1"]
    r = check_env_drift(ctx)
    assert r.status == "fail"
    assert "sglang 0.5.23 not in lock" in r.summary and "triton 3.5.1 installed (lock 3.6.0)" in r.summary
    assert r.fix == "uv run --isolated --no-default-groups dflash-env sync --profile train-cu128"
    ctx = make_ctx(tmp_path)
    ctx.distributions["rich"] = ["15.0.0"]
    del ctx.distributions["click"]
    r = check_env_drift(ctx)
    assert r.status == "warn"
    assert r.data["missing"] == [{"name": "click", "locked": "8.5.1"}]
    assert r.data["not_in_lock"] == [{"name": "rich", "installed": "15.0.0"}]


@pytest.mark.parametrize(("name", "version"), [("fla-core", "0.5.1"), ("causal-conv1d", "1.7.0")])
def test_env_drift_of_a_linear_attention_kernel_package_fails(tmp_path, name, version):
    """fla-core and causal-conv1d run a hybrid target's Gated DeltaNet on CUDA: their drift is GPU-stack drift."""
    ctx = make_ctx(tmp_path)
    ctx.distributions[name] = [version]
    r = check_env_drift(ctx)
    assert r.status == "fail" and r.data["gpu_stack"] == [f"{name} {version} not in lock"], r.summary


def test_env_drift_project_is_never_drift_and_local_label_matches(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.distributions["dflash"] = ["9.9.9"]
    r = check_env_drift(ctx)
    assert r.status == "pass", r.summary  # torch 2.10.0+cu128 satisfies the lock's torch==2.10.0
    ctx.distributions["click"] = ["8.5.1", "8.1.0"]  # two dist-infos: a pip install over uv's
    assert check_env_drift(ctx).status == "warn"


def _records(*checks_: RecordCheck, seconds: float = 0.8) -> Records:
    return Records(list(checks_), seconds)


def test_env_drift_passes_with_records_and_says_what_was_verified(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.records = _records(RecordCheck("torch", "2.10.0", hashed=11_700, sized=70),
                           RecordCheck("transformers", "5.19.0", hashed=2700))
    r = check_env_drift(ctx)
    assert r.status == "pass"
    assert r.summary.endswith("; 2 GPU-stack and target distributions match their RECORD (14,400 files hashed, "
                              "70 native libraries by size, 0.8 s)")
    assert r.data["record"] == {"distributions": 2, "hashed": 14_400, "sized": 70, "seconds": 0.8, "modified": [],
                                "unverified": []}


def test_env_drift_fails_on_a_file_edited_inside_site_packages(tmp_path):
    """Same versions everywhere, but a line appended to transformers' Qwen3 modeling file: the version check alone
    passes it; the RECORD hash does not."""
    ctx = make_ctx(tmp_path)
    qwen3 = "transformers/models/qwen3/modeling_qwen3.py"
    ctx.records = _records(RecordCheck("torch", "2.10.0", hashed=11_700),
                           RecordCheck("transformers", "5.19.0", hashed=2700, modified=[qwen3]),
                           RecordCheck("nvidia-nccl-cu12", "2.27.5", sized=3, missing=["nvidia/nccl/lib/libnccl.so.2"]))
    r = check_env_drift(ctx)
    assert r.status == "fail"
    assert r.summary == ("environment differs from envs/train-cu128.lock: files edited in place: transformers 5.19.0: "
                         f"{qwen3} differs, nvidia-nccl-cu12 2.27.5: nvidia/nccl/lib/libnccl.so.2 missing")
    assert r.fix == ("uv run --isolated --no-default-groups dflash-env sync --profile train-cu128 "
                     "--reinstall transformers --reinstall nvidia-nccl-cu12")
    assert [m["name"] for m in r.data["record"]["modified"]] == ["transformers", "nvidia-nccl-cu12"]


def test_env_drift_warns_on_a_distribution_without_a_record(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.records = _records(RecordCheck("torch", "2.10.0", error="no RECORD: installed by a tool that keeps none"))
    r = check_env_drift(ctx)
    assert r.status == "warn" and "not verifiable against a RECORD: torch (no RECORD" in r.summary
    assert r.data["record"]["unverified"] == [{"name": "torch", "why": "no RECORD: installed by a tool that keeps none"}]


def test_env_drift_compares_builds_with_the_last_checked_sync_and_says_when_it_cannot(tmp_path):
    """Another build of a locked version (its RECORD differs from the one dflash-env sync recorded): the GPU stack
    fails, the rest warns, the fix is the sync that re-copies them; an environment without a record says so."""
    ctx = make_ctx(tmp_path)
    ctx.sync_record = SyncRecord("ENV/dflash-verified.json", present=True, compared=70, seconds=0.01)
    r = check_env_drift(ctx)
    assert r.status == "pass" and r.summary.endswith("; 70 RECORDs match the last checked sync's"), r.summary
    assert r.data["sync_record"] == {"path": "ENV/dflash-verified.json", "present": True, "compared": 70, "rebuilt": [],
                                     "seconds": 0.01}
    ctx.sync_record.rebuilt = [{"name": "click", "version": "8.5.1"}]
    r = check_env_drift(ctx)
    assert r.status == "warn" and r.summary == ("environment differs from envs/train-cu128.lock: another build of a locked "
                                                "version (its RECORD differs from the last checked sync's): click 8.5.1")
    assert r.fix == "uv run --isolated --no-default-groups dflash-env sync --profile train-cu128"
    ctx.sync_record.rebuilt.append({"name": "torch", "version": "2.10.0+cu128"})
    r = check_env_drift(ctx)
    assert r.status == "fail" and r.summary.endswith("click 8.5.1, torch 2.10.0+cu128"), r.summary
    ctx.sync_record = SyncRecord("ENV/dflash-verified.json", present=False)
    r = check_env_drift(ctx)
    assert r.status == "pass" and r.summary.endswith("; no dflash-verified.json in this environment (not built by this "
                                                     "dflash-env version), so builds of a locked version are not compared")
    ctx.distributions["rich"] = ["15.0.0"]
    assert check_env_drift(ctx).summary.endswith("so builds of a locked version are not compared")


# ---------------------------------------------------------------- cuda-libs


def test_cuda_libs_foreign_wheel_and_ld_path_fail(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.distributions["nvidia-cuda-runtime"] = ["13.0.96"]
    ctx.distributions["nvidia-nccl-cu13"] = ["2.28.3"]
    good, bad = str(tmp_path / "cu12" / "lib"), str(tmp_path / "cuda-13.0" / "lib64")
    ctx.ld_dirs = [LibDir(good, True, {"libcudart.so.12": 12}),
                   LibDir(bad, True, {"libcudart.so.13": 13, "libnccl.so.2": 13})]
    r = check_cuda_libs(ctx)
    assert r.status == "fail"
    assert "nvidia-cuda-runtime 13.0.96 is a CUDA 13 wheel" in r.summary
    assert r.data["foreign_ld_dirs"] == [bad]
    assert f"export LD_LIBRARY_PATH={good}" in r.fix


def test_cuda_libs_warns_on_a_toolkit_of_another_major_on_path_and_in_the_linker_cache(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.path_entries.append(PathEntry("/usr/local/cuda-12.8/bin", True, cuda_toolkit="12.8.93"))
    ctx.ld_cache = [LibDir("/usr/lib/x86_64-linux-gnu", True, {"libnccl.so.2": None})]
    assert check_cuda_libs(ctx).status == "pass"  # same major; a NCCL of unknown CUDA is not judged
    ctx.path_entries.insert(1, PathEntry("/usr/local/bin", True, cuda_toolkit="13.0"))
    ctx.ld_cache.append(LibDir("/usr/local/cuda-13.0/lib", True, {"libcudart.so.13": 13, "libcudart.so": 13}))
    r = check_cuda_libs(ctx)
    assert r.status == "warn"
    assert ("PATH dir /usr/local/bin holds the nvcc that runs, CUDA 13.0: CUDA code compiled at run time "
            "(torch.utils.cpp_extension") in r.summary and "would target CUDA 13, not this profile's 12.8" in r.summary
    assert ("the linker cache (ldconfig -p) lists libcudart.so, libcudart.so.13 (CUDA 13) in /usr/local/cuda-13.0/lib: "
            "a library loaded by name without an RPATH") in r.summary
    assert "put a CUDA 12.8 toolkit's bin before /usr/local/bin on PATH" in r.fix
    assert "remove /usr/local/cuda-13.0/lib from /etc/ld.so.conf.d/ and run `sudo ldconfig`" in r.fix
    assert r.data["ld_cache_foreign"] == [{"dir": "/usr/local/cuda-13.0/lib", "libs": ["libcudart.so", "libcudart.so.13"]}]
    assert [t["cuda"] for t in r.data["path_cuda_toolkits"]] == ["13.0", "12.8.93"]
    ctx.distributions["nvidia-cuda-runtime"] = ["13.0.96"]  # with a failure, the warnings are listed after it
    r = check_cuda_libs(ctx)
    assert r.status == "fail" and r.summary.index("13.0.96 is a CUDA 13 wheel") < r.summary.index("PATH dir /usr/local/bin")


def test_cuda_libs_old_driver_and_no_driver_fail_cpu_skips_driver(tmp_path):
    old = recorded()
    old["cuda_driver_version"], old["driver_version"] = "12.4", "550.54.15"
    r = check_cuda_libs(make_ctx(tmp_path, gpus=old))
    assert r.status == "fail" and "supports CUDA 12.4 < profile's 12.8" in r.summary
    ctx = make_ctx(tmp_path)
    ctx.gpus = GpuFacts(error=NO_DRIVER)
    r = check_cuda_libs(ctx)
    assert r.status == "fail" and NO_DRIVER in r.summary
    ctx = make_ctx(tmp_path, config={"device": "cpu"})
    ctx.gpus = GpuFacts(error="NVML not queried (device = cpu)", queried=False)
    assert check_cuda_libs(ctx).status == "pass"


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
    assert "drafter GPU 5" in r.summary and "need 4.7 GiB, free 4.6 GiB, short 0.2 GiB" in r.summary
    assert "dflash-estimate" in r.fix


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


# ---------------------------------------------------------------- compile-cache


def test_compile_cache_cold_warns_with_warm_command(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.compile_cache = CompileCache(str(tmp_path / "cache"), False)
    r = check_compile_cache(ctx)
    assert r.status == "warn" and r.summary.startswith("cold:")
    assert r.fix == "uv run dflash-train --config run.toml --warm-cache"


def test_compile_cache_mismatch_warns_naming_field(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.compile_cache.manifest["torch"] = "2.11.0+cu130"
    r = check_compile_cache(ctx)
    assert r.status == "warn" and "torch 2.11.0+cu130 -> 2.10.0+cu128" in r.summary
    ctx = make_ctx(tmp_path)
    ctx.config = ctx.config.model_copy(update={"drafter": ctx.config.drafter.model_copy(update={"block_size": 16})})
    r = check_compile_cache(ctx)  # the manifest was written for block_size 32
    assert r.status == "warn" and "drafter_hash" in r.summary
    for change in ({"target": {"compile": False}}, {"data": {"max_batch_size": 1}}, {"data": {"path": "other"}}):
        ctx = make_ctx(tmp_path)
        section, fields = next(iter(change.items()))
        ctx.config = ctx.config.model_copy(update={section: getattr(ctx.config, section).model_copy(update=fields)})
        r = check_compile_cache(ctx)
        assert r.status == "warn" and "target_hash" in r.summary and "drafter_hash" not in r.summary, r.summary
    ctx = make_ctx(tmp_path)
    del ctx.compile_cache.manifest["target_hash"]  # a cache warmed before the manifest named the target's graphs
    r = check_compile_cache(ctx)
    assert r.status == "warn" and "target_hash None ->" in r.summary


# ---------------------------------------------------------------- model-source


def test_model_source_modified_fails_naming_file_and_stat(tmp_path):
    ctx = make_ctx(tmp_path)
    stat = " dflash/model.py | 4 +++-\n 1 file changed, 3 insertions(+), 1 deletion(-)"
    ctx.model_source = ModelSource("git", commit="0123456789abcdef", modified=["dflash/model.py"],
                                   states={"dflash/model.py": "modified"}, diff_stat=stat,
                                   verified=["dflash/loss.py"])
    r = check_model_source(ctx)
    assert r.status == "fail"
    assert "dflash/model.py (modified)" in r.summary and "1 file changed" in r.summary
    assert "0123456789ab" in r.summary and r.data["commit"] == "0123456789abcdef"
    assert r.fix.startswith("git stash push --include-untracked -- dflash/model.py")


def test_model_source_record_mode(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.model_source = ModelSource("record", commit="dflash==0.1.0", modified=["dflash/loss.py"],
                                   states={"dflash/loss.py": "differs from RECORD"}, verified=["dflash/model.py"])
    r = check_model_source(ctx)
    assert r.status == "fail" and "dflash==0.1.0" in r.summary
    assert r.fix.startswith("uv pip install --reinstall --no-deps dflash==0.1.0")
    ctx.model_source = ModelSource("record", commit="dflash==0.1.0", verified=["dflash/model.py"])
    assert check_model_source(ctx).status == "pass"


def test_model_source_covers_the_whole_package_and_untracked_files_warn(tmp_path):
    ctx = make_ctx(tmp_path)
    every = ["dflash/attention.py", "dflash/data.py", "dflash/model.py", "dflash/step.py", "dflash/train.py"]
    ctx.model_source = ModelSource("git", commit="0123456789abcdef", files=every, verified=every)
    r = check_model_source(ctx)
    assert (r.status, r.summary) == ("pass", "all 5 source files of dflash/ match git HEAD 0123456789ab")
    # a hack in the data loader changes a run as much as one in the model
    ctx.model_source = ModelSource("git", commit="0123456789abcdef", files=[*every, "dflash/scratch.py"],
                                   modified=["dflash/data.py", "dflash/scratch.py"],
                                   states={"dflash/data.py": "modified", "dflash/scratch.py": "untracked"},
                                   verified=[f for f in every if f != "dflash/data.py"])
    r = check_model_source(ctx)
    assert r.status == "fail" and r.summary.startswith("training source modified against git HEAD 0123456789ab: "
                                                       "dflash/data.py (modified)")
    assert r.summary.endswith("; also untracked: dflash/scratch.py")
    # an untracked file alone is imported by no committed module: a warning, with the same fix
    ctx.model_source = ModelSource("git", commit="0123456789abcdef", files=[*every, "dflash/scratch.py"],
                                   modified=["dflash/scratch.py"], states={"dflash/scratch.py": "untracked"},
                                   verified=every)
    r = check_model_source(ctx)
    assert r.status == "warn" and "1 file(s) in dflash/ not in git HEAD 0123456789ab (untracked): dflash/scratch.py" in r.summary
    assert r.fix.startswith("git stash push --include-untracked -- dflash/scratch.py")


# ---------------------------------------------------------------- run-dir


def _with_checkpoint(ctx, step=690, config_over=None, samples=1000, fingerprint=None):
    saved = ctx.config.model_dump()
    for dotted, v in (config_over or {}).items():
        sec, key = dotted.split(".")
        saved[sec][key] = v
    meta = {"step": step, "config": saved,
            "dataset": {"path": ctx.config.data.path, "samples": samples,
                        "fingerprint": fingerprint or ctx.dataset.fingerprint}}
    older = dict(meta, step=500)
    ctx.run_dir.checkpoints = [Checkpoint(500, "ckpt/step_00000500", older),
                               Checkpoint(step, f"ckpt/step_{step:08d}", meta)]
    return ctx


def test_run_dir_with_checkpoints_needs_intent(tmp_path):
    ctx = _with_checkpoint(make_ctx(tmp_path))
    r = check_run_dir(ctx)
    assert r.status == "fail"
    assert "newest step_00000690 (step 690)" in r.summary
    assert "--resume" in r.fix and "--fresh" in r.fix
    ctx.resume_intent = "fresh"
    assert check_run_dir(ctx).status == "pass"
    ctx.resume_intent = "resume"
    r = check_run_dir(ctx)
    assert r.status == "pass" and "step 690" in r.summary


def test_run_dir_resume_refuses_a_checkpoint_the_trainer_would_refuse(tmp_path):
    from dflash.runs.verify import LEGACY_REASON

    ctx = _with_checkpoint(make_ctx(tmp_path))
    ctx.run_dir.checkpoints = ctx.run_dir.checkpoints[1:]
    ctx.run_dir.newest.error = LEGACY_REASON  # what preflight.facts.run.run_dir records for an old pickled trainer_state.pt
    ctx.resume_intent = "resume"
    r = check_run_dir(ctx)
    assert r.status == "fail" and "step_00000690 cannot be resumed: written by an older dflash version" in r.summary
    assert "--fresh" in r.fix
    ctx.resume_intent = "fresh"
    assert check_run_dir(ctx).status == "pass"


def test_run_dir_resume_skips_damaged_newer_checkpoints_as_the_trainer_does(tmp_path):
    """`--resume latest` takes the newest checkpoint that verifies; preflight says which one and what it skips."""
    ctx = _with_checkpoint(make_ctx(tmp_path))
    ctx.resume_intent = "resume"
    truncated = "optimizer.pt is 4,096 bytes, meta.json recorded 8,192 (truncated or rewritten since the save)"
    ctx.run_dir.newest.error = truncated
    r = check_run_dir(ctx)
    assert r.status == "warn"
    assert r.summary == f"--resume from step_00000500 (step 500); --resume latest skips step_00000690: {truncated}"
    assert r.data["resume"]["step"] == 500 and r.data["skipped"] == [{"step": 690, "problem": truncated}]
    ctx.run_dir.checkpoints[0].error = "trainer_state.json content differs from its sha256 in meta.json (damaged since " \
                                       "the save)"
    ctx.run_dir.deep = True
    r = check_run_dir(ctx)
    assert r.status == "fail" and r.summary.startswith("--resume: none of the 2 checkpoints verifies (sizes and "
                                                       "sha256): step_00000500: trainer_state.json content differs")
    assert "--fresh" in r.fix


def test_run_dir_resume_that_changes_the_lr_schedule_warns(tmp_path):
    """The incident's `--max-steps` on resume: lr fell 18x in 5 steps while preflight said "config compatible".
    The change itself is the trainer's rule, gathered as a fact (test_schedule_rule.py checks they agree)."""
    ctx = _with_checkpoint(make_ctx(tmp_path))
    ctx.resume_intent = "resume"
    ctx.run_dir.schedule_change = "total steps 20,000 -> 1,200 (train.max_steps 20000 -> None)"
    r = check_run_dir(ctx)
    assert r.status == "warn" and "compatible" not in r.summary
    assert "the lr schedule changes (total steps 20,000 -> 1,200 (train.max_steps 20000 -> None)): dflash-train " \
           "refuses this resume without --allow-schedule-change" in r.summary
    assert "--allow-schedule-change" in r.fix and r.data["schedule_change"].startswith("total steps 20,000")


def test_run_dir_resume_incompatible_fails(tmp_path):
    ctx = _with_checkpoint(make_ctx(tmp_path), config_over={"drafter.block_size": 16, "target.path": "other-27b"})
    ctx.resume_intent = "resume"
    r = check_run_dir(ctx)
    assert r.status == "fail"
    assert "drafter.block_size 16 -> 32" in r.summary and "target.path 'other-27b' -> 'smollm2'" in r.summary


def test_run_dir_resume_reports_changed_dataset(tmp_path):
    """The data position is the trainer's rule, gathered as a fact (test_resume_rule.py checks they agree)."""
    ctx = _with_checkpoint(make_ctx(tmp_path), samples=902_000, fingerprint="0" * 16)
    ctx.resume_intent = "resume"
    ctx.run_dir.data_restart = "dataset changed since the checkpoint: 902,000 -> 1,000 samples"
    ctx.run_dir.data_known = True
    r = check_run_dir(ctx)
    assert r.status == "warn" and "902,000 -> 1,000 samples (the epoch restarts from its first batch)" in r.summary
    assert r.data["dataset"]["old_samples"] == 902_000 and r.data["dataset"]["new_samples"] == 1000


def test_run_dir_unwritable_and_resume_without_checkpoint_fail(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.resume_intent = "resume"
    r = check_run_dir(ctx)
    assert r.status == "fail" and "no finished checkpoint" in r.summary
    ctx.run_dir = RunDir(ctx.config.output_dir, True, False, "run is not writable by this user")
    r = check_run_dir(ctx)
    assert r.status == "fail" and r.summary.endswith("cannot be written: run is not writable by this user")


# ---------------------------------------------------------------- dataset


def test_dataset_sample_over_budget_fails_naming_shard_row_length(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.dataset.shards[1] = Shard("b.arrow", rows=400, tokens=600_000, max_len=52_000, max_row=12, first_row=600,
                                  over=[(12, 52_000), (30, 5_000)], over_count=2)
    r = check_dataset(ctx)
    assert r.status == "fail"
    assert "b.arrow row 12 (sample 612) with 52,000 tokens > token_budget 4,096" in r.summary
    assert "2 sample(s) can never fit a batch" in r.summary
    assert r.data["over_limit"][0] == {"shard": "b.arrow", "row": 12, "index": 612, "length": 52_000}


def test_dataset_corrupt_shard_and_missing_folder_fail(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.dataset.shards.append(Shard("c.arrow", error="not a readable Arrow IPC file: Not an Arrow file"))
    r = check_dataset(ctx)
    assert r.status == "fail" and "c.arrow: not a readable Arrow IPC file" in r.summary
    ctx.dataset = Dataset(ctx.config.data.path, 4096, error="data does not exist")
    assert check_dataset(ctx).status == "fail"


def test_dataset_pass_reports_counts(tmp_path):
    r = check_dataset(make_ctx(tmp_path))
    assert r.status == "pass" and "1,000 samples" in r.summary and r.data["longest"]["index"] == 612
    assert ("shard sizes match manifest.json; built for this target (vocab 49,152, same tokenizer files); ids "
            "0..49,000 < vocab 49,152; "
            "loss_mask 0/1 with 1,100,000 learnable positions") in r.summary
    assert r.data["values"] == {"min_id": 0, "max_id": 49_000, "vocab": 49_152, "mask_min": 0, "mask_max": 1,
                                "learnable_positions": 1_100_000}


def test_dataset_token_ids_outside_the_vocabulary_fail(tmp_path):
    """ids >= vocab crash the embedding in step 1 (a device-side assert on CUDA); negative ids too."""
    ctx = make_ctx(tmp_path)
    ctx.dataset.shards[1].values = ValueStats(0, 151_000, 0, 1, 400_000)
    ctx.dataset.manifest = None  # nothing recorded: the range check alone catches it
    r = check_dataset(ctx)
    assert r.status == "fail"
    assert ("token ids up to 151,000 (b.arrow) but the target's vocabulary is 49,152 (ids must be < 49,152; 1 "
            "shard(s): b.arrow)") in r.summary
    assert "dflash-data prepare --target smollm2" in r.fix and r.data["values"]["max_id"] == 151_000
    ctx.dataset.shards[1].values = ValueStats(-7, 100, 0, 1, 400_000)
    r = check_dataset(ctx)
    assert r.status == "fail" and "negative token ids (down to -7) in b.arrow" in r.summary


def test_dataset_built_for_another_target_fails(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.dataset.manifest["target"] = dict(ctx.dataset.target, vocab_size=151_936, tokenizer_sha256="cd" * 32)
    r = check_dataset(ctx)
    assert r.status == "fail"
    assert ("built for another target than smollm2: vocab_size 151936 -> 49152, tokenizer files differ (sha256 "
            "cdcdcdcdcdcd -> abababababab)") in r.summary
    assert "rebuild the data for this target" in r.fix
    ctx.dataset.manifest["target"] = dict(ctx.dataset.target, num_layers=12)  # same tokenizer, other model: warn
    r = check_dataset(ctx)
    assert r.status == "warn" and "completions of another model with the same tokenizer (num_layers 12 -> 30)" \
        in r.summary


def test_dataset_loss_mask_values_and_nothing_to_learn_fail(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.dataset.shards[0].values = ValueStats(3, 49_000, 0, 2, 700_000)
    r = check_dataset(ctx)
    assert r.status == "fail" and "loss_mask values outside 0/1 (from 0 to 2) in a.arrow" in r.summary
    for s in ctx.dataset.shards:
        s.values = ValueStats(3, 49_000, 0, 0, 0)
    r = check_dataset(ctx)
    assert r.status == "fail" and "nothing to learn: loss_mask is 0 everywhere" in r.summary
    for s in ctx.dataset.shards:
        s.values = ValueStats(3, 49_000, 1, 1, 0)  # 1-token samples: a block needs two learnable tokens
    r = check_dataset(ctx)
    assert r.status == "fail" and "nothing to learn: no sample has two consecutive loss_mask = 1 tokens" in r.summary
    assert "keep samples of 2 or more tokens" in r.fix


def test_dataset_shards_that_differ_from_the_manifest_fail(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.dataset.shards[0].size_bytes -= 64
    r = check_dataset(ctx)
    assert r.status == "fail" and "a.arrow is 5,399,936 bytes, manifest.json recorded 5,400,000" in r.summary
    ctx.dataset.shards[0].size_bytes += 64
    ctx.dataset.shards[1].sha256 = "ff" * 32  # 64 flipped bytes: same size, other content
    assert check_dataset(ctx).status == "pass"  # sizes only: the quick look cannot see it
    ctx.dataset.deep = True
    r = check_dataset(ctx)
    assert r.status == "fail" and "b.arrow content differs from its sha256 in manifest.json" in r.summary
    assert r.data["verified_by"] == "sizes and sha256"
    ctx.dataset.shards.append(Shard("c.arrow", rows=1, tokens=5, max_len=5, values=ValueStats(1, 5, 1, 1, 4)))
    r = check_dataset(ctx)
    assert "c.arrow not in manifest.json" in r.summary


def test_dataset_without_manifest_warns_with_the_command_that_records_one(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.dataset.manifest = None
    r = check_dataset(ctx)
    assert r.status == "warn" and "no manifest.json: the target the data was built for and the shard hashes are " \
        "unknown" in r.summary
    assert r.fix == f"dflash-data manifest {ctx.dataset.path} --target smollm2"
    ctx.dataset.manifest_error = "manifest.json unreadable (Expecting value: line 1 column 1 (char 0))"
    assert check_dataset(ctx).status == "fail"


# ---------------------------------------------------------------- disk


def test_disk_fails_when_checkpoints_do_not_fit(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.disk = Disk(ctx.config.output_dir, free_bytes=10 * MiB)
    r = check_disk(ctx)
    assert r.status == "fail" and r.data["checkpoints_to_write"] == 4  # keep_last 3 + the one being written
    ctx.run_dir.checkpoints = [Checkpoint(690, "ckpt/step_00000690", size_bytes=2 * GiB)]
    ctx.disk = Disk(ctx.config.output_dir, free_bytes=7 * GiB)
    r = check_disk(ctx)
    assert r.status == "fail" and r.data["need_bytes"] == 8 * GiB and "size of step_00000690" in r.summary
    ctx.resume_intent = "resume"  # the kept one already counts
    assert check_disk(ctx).status == "pass"


def test_disk_fix_names_what_the_run_dir_could_free(tmp_path):
    """A full disk's fix names the unfinished saves and moved-aside folders of the run dir, with their sizes."""
    from dflash.runs import rundir

    out = Path(make_ctx(tmp_path).config.output_dir)
    tmp = rundir.checkpoints_dir(out) / "step_00000010.tmp"  # a save a crash or a full disk cut short
    tmp.mkdir(parents=True)
    (tmp / "optimizer.pt").write_bytes(b"\0" * 3 * MiB)
    (out / "replaced-20260101-000000" / "checkpoints").mkdir(parents=True)
    (out / "replaced-20260101-000000" / "checkpoints" / "w").write_bytes(b"\0" * 5 * MiB)
    (out / "metrics.abandoned-20260101-000000.jsonl").write_bytes(b"\0" * MiB)
    (out / "replaced-20260102-000000").symlink_to(tmp_path)  # a link is never counted (nor followed)
    found = disk_facts(str(out))
    assert found.leftovers == [("replaced-20260101-000000", 5 * MiB, "moved aside by --fresh"),
                               ("checkpoints/step_00000010.tmp", 3 * MiB, "an unfinished save"),
                               ("metrics.abandoned-20260101-000000.jsonl", MiB, "metrics rows moved aside by a resume")]
    ctx = make_ctx(tmp_path)
    ctx.disk = Disk(found.path, free_bytes=10 * MiB, output_dir=str(out), leftovers=found.leftovers)
    r = check_disk(ctx)
    assert r.status == "fail" and r.data["reclaimable_bytes"] == 9 * MiB
    short = _size(r.data["need_bytes"] - 10 * MiB)
    assert r.fix == (f"free {short} at {found.path} (9.0 MiB reclaimable in {out}: replaced-20260101-000000 5.0 MiB "
                     "(moved aside by --fresh), checkpoints/step_00000010.tmp 3.0 MiB (an unfinished save), "
                     "metrics.abandoned-20260101-000000.jsonl 1.0 MiB (metrics rows moved aside by a resume), yours to "
                     "delete), lower train.keep_last, or move output_dir to a larger disk")


# ---------------------------------------------------------------- env-vars


def test_env_vars_a_variable_the_trainer_sets_passes_and_says_so(tmp_path):
    """Standalone preflight on a correct box: PYTORCH_CUDA_ALLOC_CONF is unset because dflash-train sets it."""
    ctx = make_ctx(tmp_path)
    ctx.env = {}
    r = check_env_vars(ctx)
    assert r.status == "pass" and r.summary.startswith(
        "PYTORCH_CUDA_ALLOC_CONF unset here: dflash-train sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
        "before torch loads; PATH clean")
    assert r.data["will_set"] == [{"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:True"}]


def test_env_vars_a_conflicting_value_fails(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    r = check_env_vars(ctx)
    assert r.status == "fail" and "PYTORCH_CUDA_ALLOC_CONF='expandable_segments:False' (need 'expandable_segments:True'" in r.summary
    assert r.fix == "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


@pytest.mark.parametrize("cuda_conf", [None, "expandable_segments:True"])
def test_env_vars_pytorch_alloc_conf_is_read_first_and_must_agree(tmp_path, cuda_conf):
    ctx = make_ctx(tmp_path)
    ctx.env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}
    if cuda_conf:
        ctx.env["PYTORCH_CUDA_ALLOC_CONF"] = cuda_conf
    r = check_env_vars(ctx)
    assert r.status == "fail"
    assert "PYTORCH_ALLOC_CONF='max_split_size_mb:128' overrides PYTORCH_CUDA_ALLOC_CONF (torch reads PYTORCH_ALLOC_CONF first" in r.summary
    assert r.fix == "unset PYTORCH_ALLOC_CONF"
    ctx.env["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"  # the same setting under the newer name
    assert check_env_vars(ctx).status == "pass"


def test_env_vars_other_python_envs_anywhere_on_path_warn_naming_what_runs_from_them(tmp_path):
    """`uv run` puts its env first, so an sglang env later on PATH used to pass: it still runs every command the
    earlier entries lack (ninja, nvcc, a second torchrun...)."""
    ctx = make_ctx(tmp_path)
    after = str(tmp_path / "sglang-env" / "bin")
    ahead = str(tmp_path / "conda" / "bin")
    gone = str(tmp_path / "gone" / "bin")
    ctx.path_entries.append(PathEntry(after, True, str(tmp_path / "sglang-env"), commands=["sglang", "ninja", "torchrun"]))
    ctx.path_entries.insert(0, PathEntry(ahead, True, str(tmp_path / "conda"), commands=["conda", "python", "pip"]))
    ctx.path_entries.append(PathEntry(gone, False))
    r = check_env_vars(ctx)
    assert r.status == "warn"
    assert f"{after} (after this environment; runs torchrun, ninja, sglang)" in r.summary
    assert f"{ahead} (ahead of this environment; runs python, pip, conda)" in r.summary and gone in r.summary
    assert [(e["path"], e["ahead"]) for e in r.data["path_other_envs"]] == [(ahead, True), (after, False)]
    assert after not in r.fix and ahead not in r.fix and r.fix.startswith("export PATH=")
    ctx.path_entries = [e for e in ctx.path_entries if e.path != ahead and e.exists]
    ctx.path_entries[-1].commands = []
    r = check_env_vars(ctx)
    assert r.status == "warn" and f"{after} (after this environment; all its commands are found earlier)" in r.summary


def test_crashing_check_becomes_a_failure_not_a_traceback(tmp_path, monkeypatch):
    def boom(ctx):
        raise KeyError("x")

    monkeypatch.setitem(CHECKS, "disk", boom)
    r = by_id(run_checks(make_ctx(tmp_path)), "disk")
    assert r.status == "fail" and "check crashed: KeyError" in r.summary


@pytest.mark.parametrize("check_id", CHECK_IDS)
def test_every_check_result_validates_as_report_schema(tmp_path, check_id):
    r = CHECKS[check_id](make_ctx(tmp_path))
    assert r.id == check_id
    json.dumps(r.model_dump())  # data is JSON-serialisable


def test_run_dir_resolved_layer_ids_are_compatible(tmp_path):
    from dflash.config import default_target_layer_ids

    resolved = default_target_layer_ids(30, 5)  # SmolLM2: 30 layers, 5 drafter layers
    ctx = _with_checkpoint(make_ctx(tmp_path), config_over={"drafter.target_layer_ids": resolved})
    ctx.resume_intent = "resume"
    assert check_run_dir(ctx).status == "pass"  # [] in the config resolves to the saved list
    ctx = _with_checkpoint(make_ctx(tmp_path), config_over={"drafter.target_layer_ids": [1, 2, 3, 4, 5]})
    ctx.resume_intent = "resume"
    r = check_run_dir(ctx)
    assert r.status == "fail" and "drafter.target_layer_ids [1, 2, 3, 4, 5] -> []" in r.summary


def test_disk_unknown_target_warns_and_estimates_from_the_memory_model(tmp_path):
    ctx = make_ctx(tmp_path, config={"target": {"path": str(tmp_path / "no-model")}})
    r = check_disk(ctx)
    assert r.status == "warn" and "checkpoint size unknown" in r.summary
    r = check_disk(make_ctx(tmp_path))
    assert r.status == "pass" and 0 < r.data["checkpoint_bytes"] < GiB


def test_config_passes_with_the_resolved_layers_and_mask_source(tmp_path):
    r = check_config(make_ctx(tmp_path))  # SmolLM2: 30 layers, vocab 49152, 5 drafter layers
    assert r.status == "pass", r.summary
    assert r.data["target_layer_ids"] == [1, 8, 14, 21, 27] and "mask token from the target" in r.summary


@pytest.mark.parametrize("drafter, field, allowed", [
    ({"target_layer_ids": [1, 30, 99]}, "drafter.target_layer_ids [30, 99]", "outside 0..29 of the 30-layer target"),
    ({"mask_token_id": 49152}, "drafter.mask_token_id 49152", "outside 0..49151"),
    ({"num_layers": 40}, "drafter.target_layer_ids []", "cannot spread 40 distinct layers over [1, 27]"),
    ({"num_attention_heads": 8}, "drafter heads 8", "not a multiple of its kv heads 3"),
])
def test_config_fails_on_values_that_do_not_fit_the_target_naming_field_range_and_fix(tmp_path, drafter, field, allowed):
    r = check_config(make_ctx(tmp_path, config={"drafter": drafter}))
    assert r.status == "fail" and field in r.summary and allowed in r.summary, r.summary
    assert "run.toml" in r.fix


@pytest.mark.parametrize("setup, says", [
    (lambda d: None, "config.json: not found"),
    (lambda d: (d.mkdir(), (d / "config.json").write_text("{not json")), "not valid JSON"),
    (lambda d: (d.mkdir(), (d / "config.json").write_text('{"hidden_size": 64}')), "missing key"),
    (lambda d: (d.mkdir(), (d / "config.json").write_text('{"num_hidden_layers": 0, "hidden_size": 64, '
                '"intermediate_size": 64, "num_attention_heads": 4, "vocab_size": 10}')), "sizes must be positive"),
])
def test_config_fails_when_the_target_cannot_be_read(tmp_path, setup, says):
    target = tmp_path / "target"
    setup(target)
    ctx = make_ctx(tmp_path, config={"target": {"path": str(target)}})
    r = check_config(ctx)
    assert r.status == "fail" and "target.path" in r.summary and says in r.summary, r.summary
    assert r.fix.startswith("set target.path in run.toml")


def test_config_fails_when_loading_the_target_would_be_refused_for_its_own_code(tmp_path):
    """The fact gather records (dflash.models.custom_code) fails the check: folder, field and fix in one line each."""
    ctx = make_ctx(tmp_path)
    ctx.target_custom_code = ("target /m: custom code is refused: config.json model_type 'evil_lm' is not an architecture "
                              "transformers 5.19.0 ships (auto_map: modeling_evil.py); use a model whose architecture "
                              "transformers ships (a folder without its own code), or upgrade transformers")
    r = check_config(ctx)
    assert r.status == "fail" and r.summary == ("target /m: custom code is refused: config.json model_type 'evil_lm' is "
                                                "not an architecture transformers 5.19.0 ships (auto_map: modeling_evil.py)")
    assert r.fix.startswith("set target.path in run.toml to a model whose architecture transformers ships")
    assert r.data["custom_code"] == ctx.target_custom_code


def test_config_checks_fp8_against_the_drafters_gpu_and_sizes(tmp_path):
    """train.fp8 = "mlp" passes on H200s with SmolLM2's sizes (576 / 1536); an A100-class GPU (8.0) or an MLP size
    not divisible by 16 fails before launch, naming the value and the fix."""
    assert check_config(make_ctx(tmp_path, config={"train": {"fp8": "mlp"}})).status == "pass"
    old = recorded()
    for g in old["gpus"]:
        g["compute_capability"] = "8.0"
    r = check_config(make_ctx(tmp_path, config={"train": {"fp8": "mlp"}}, gpus=old))
    assert r.status == "fail" and "compute capability 8.9+" in r.summary and "has 8.0" in r.summary, r.summary
    assert 'set train.fp8 = "off" in run.toml' in r.fix
    r = check_config(make_ctx(tmp_path, config={"train": {"fp8": "mlp"}, "drafter": {"intermediate_size": 1000}}))
    assert r.status == "fail" and "divisible by 16, got 576 and 1000" in r.summary, r.summary
    mixed = recorded()
    mixed["gpus"][int(SPLIT["drafter_gpus"][-1])]["compute_capability"] = "8.0"  # one drafter GPU of several
    r = check_config(make_ctx(tmp_path, config={"train": {"fp8": "mlp"}}, gpus=mixed))
    assert r.status == "fail" and "has 8.0" in r.summary, r.summary
    unknown = recorded()
    for g in unknown["gpus"]:
        g["compute_capability"] = "0.0"  # older recorded snapshots: not judged
    assert check_config(make_ctx(tmp_path, config={"train": {"fp8": "mlp"}}, gpus=unknown)).status == "pass"
