"""preflight/checks/environment.py: profile, torch-build, env-drift and cuda-libs, fed facts (pass and fail paths)."""

from __future__ import annotations

import re

import pytest

from preflight.checks.environment import check_cuda_libs, check_env_drift, check_profile, check_torch_build
from preflight.checks.registry import NEEDS_PROFILE, run_checks
from preflight.facts.environment import EnvIdentity, RecordCheck, Records, SyncRecord, TorchBuild
from preflight.facts.gpus import GpuFacts
from preflight.facts.paths import LibDir, PathEntry
from preflight.facts.source import CompileCache, ModelSource
from preflight.nvml import NO_DRIVER
from preflight.profiles import load_profile
from preflight_ctx import LOCK, by_id, make_ctx, recorded

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


@pytest.mark.parametrize(("name", "version"), [("fla-core", "0.5.1"), ("causal-conv1d", "1.7.0"), ("torchao", "0.16.0")])
def test_env_drift_of_a_linear_attention_kernel_package_fails(tmp_path, name, version):
    """fla-core and causal-conv1d run a hybrid target's Gated DeltaNet on CUDA, torchao an fp8 target's linears:
    their drift is GPU-stack drift."""
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
