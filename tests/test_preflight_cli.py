"""dflash-preflight as a user runs it: exact exit codes, check ids, JSON schema, waivers, the gate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from dflash.commands.preflight import main
from dflash.config import config_from_dict
from dflash.data.identity import shard_records, target_fingerprint, write_manifest
from dflash.runs.rundir import CHECKPOINT_FILES, META_NAME
from preflight.checks.registry import CHECK_IDS, NEEDS_CONFIG
from preflight.gate import run_gate
from preflight.nvml import FakeGpuInfo
from preflight.report import Report

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "data" / "nvml_fake_8gpu.json"
# Checks whose verdict depends on this checkout and venv, not on what a test sets up.
ENV_DEPENDENT = ("profile", "torch-build", "env-drift", "cuda-libs", "model-source")


@pytest.fixture(autouse=True)
def clean_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # compile cache under a fresh home: cold
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)


def run(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out, err = capsys.readouterr()
    return e.value.code, out, err


def write_run(tmp_path: Path, **over) -> Path:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    ids = pa.array([list(range(n)) for n in (50, 300, 120)], type=pa.list_(pa.int32()))
    mask = pa.array([[1] * n for n in (50, 300, 120)], type=pa.list_(pa.int8()))
    table = pa.table({"input_ids": ids, "loss_mask": mask})
    with pa.OSFile(str(data / "shard-00000.arrow"), "wb") as sink, ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    # what dflash-data writes beside its shards: the target's fingerprint and each shard's size and sha256
    write_manifest(data, {"target": target_fingerprint("smollm2"), "shards": shard_records(data.glob("*.arrow"))})
    lines = [f'output_dir = "{tmp_path / "run"}"', f'device = "{over.pop("device", "cuda")}"',
             "[data]", f'path = "{data}"', f"token_budget = {over.pop('token_budget', 1024)}"]
    if "topology" in over:
        t = over.pop("topology")
        lines += ["[topology]", f"target_gpus = {json.dumps(t[0])}", f"drafter_gpus = {json.dumps(t[1])}"]
    path = tmp_path / "run.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def statuses(out: str) -> dict[str, str]:
    return {c["id"]: c["status"] for c in json.loads(out)["checks"]}


# ---------------------------------------------------------------- usage errors: exit 2, one line


@pytest.mark.parametrize("args, message", [
    (["--profile", "nope"], "unknown profile 'nope' (known: infer-cu130, train-cu128)"),
    (["--profile", "train-cu128", "--config", "missing.toml"], "missing.toml: no such config file"),
    (["--profile", "train-cu128", "--waive", "gpu-memroy", "--reason", "x"], "--waive gpu-memroy: unknown check id"),
    (["--profile", "train-cu128", "--waive", "disk"], "1 --waive but 0 --reason"),
    (["--profile", "train-cu128", "--resume", "--fresh"], "--resume and --fresh exclude each other"),
    (["--profile", "train-cu128", "--set", "data.token_budget=64"], "--set overrides a run config field: give --config"),
    ([], "Missing option '--profile'"),
])
def test_usage_errors_exit_2_with_one_line(capsys, args, message):
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("dflash-preflight: error: ") and message in err
    assert "Traceback" not in err


def test_invalid_config_is_a_usage_error(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[drafter]\nblok_size = 16\n")
    code, _, err = run(capsys, "--profile", "train-cu128", "--config", str(bad))
    assert code == 2 and "drafter.blok_size: unknown key" in err and err.count("\n") == 1


# ---------------------------------------------------------------- JSON and exit codes


def test_json_without_config_has_every_check_and_skips_run_checks(capsys):
    code, out, _ = run(capsys, "--profile", "train-cu128", "--json", "--nvml-fake", str(FIXTURE))
    report = json.loads(out)  # exactly one JSON object
    assert set(report) == {"profile", "ok", "checks", "host"} and report["profile"] == "train-cu128"
    assert [c["id"] for c in report["checks"]] == list(CHECK_IDS)
    for c in report["checks"]:
        assert set(c) == {"id", "status", "summary", "fix", "data"}
        assert c["status"] in ("pass", "warn", "fail", "skip", "waived")
    st = statuses(out)
    assert [i for i in CHECK_IDS if st[i] == "skip"] == list(NEEDS_CONFIG)
    assert st["gpu-visibility"] == "pass" and st["compile-cache"] == "skip"  # an artifact is made per run
    assert report["ok"] == (code == 0) and code == (1 if "fail" in st.values() else 0)


def test_no_driver_fails_gpu_checks_exit_1(capsys, tmp_path):
    code, out, _ = run(capsys, "--profile", "train-cu128", "--json", "--nvml-fake", "none",
                       "--config", str(write_run(tmp_path)))
    assert code == 1
    checks = {c["id"]: c for c in json.loads(out)["checks"]}
    for i in ("gpu-visibility", "gpu-memory", "gpu-processes"):
        assert checks[i]["status"] == "fail" and checks[i]["summary"] == "no NVIDIA driver (NVML not found)"


def test_set_overrides_a_config_field_as_in_every_command(capsys, tmp_path):
    """--set data.token_budget=64: the 300-token sample no longer fits a batch; a bad --set is one line, exit 2."""
    config = str(write_run(tmp_path, device="cpu"))
    args = ("--profile", "train-cu128", "--json", "--nvml-fake", "none", "--config", config)
    code, out, _ = run(capsys, *args, "--set", "data.token_budget=64")
    dataset = next(c for c in json.loads(out)["checks"] if c["id"] == "dataset")
    assert code == 1 and dataset["status"] == "fail" and "> token_budget 64" in dataset["summary"]
    code, _, err = run(capsys, *args, "--set", "data.token_budgt=64")
    assert code == 2 and err.count("\n") == 1 and "data.token_budgt" in err


def test_cpu_run_skips_gpu_checks(capsys, tmp_path):
    code, out, _ = run(capsys, "--profile", "train-cu128", "--json", "--nvml-fake", "none",
                       "--config", str(write_run(tmp_path, device="cpu")))
    st = statuses(out)
    assert {st[i] for i in ("gpu-visibility", "gpu-memory", "gpu-processes", "compile-cache")} == {"skip"}
    assert {st[i] for i in ("run-dir", "dataset", "disk", "env-vars")} == {"pass"}
    cuda_libs = next(c for c in json.loads(out)["checks"] if c["id"] == "cuda-libs")
    assert "NVML" not in cuda_libs["summary"]  # the driver is not asked for on a CPU run


def test_standalone_preflight_passes_env_vars_for_what_dflash_train_sets(capsys, tmp_path, monkeypatch):
    """No false alarm on a correct box: the allocator variable is the trainer's to set; another value fails."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    cfg = str(write_run(tmp_path, device="cpu"))
    code, out, _ = run(capsys, "--profile", "train-cu128", "--json", "--nvml-fake", "none", "--config", cfg)
    env_vars = next(c for c in json.loads(out)["checks"] if c["id"] == "env-vars")
    assert env_vars["status"] in ("pass", "warn")  # warn only for a polluted PATH of this machine
    assert "dflash-train sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in env_vars["summary"]
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync")
    code, out, _ = run(capsys, "--profile", "train-cu128", "--json", "--nvml-fake", "none", "--config", cfg)
    assert statuses(out)["env-vars"] == "fail" and code == 1


def test_a_target_folder_with_its_own_code_fails_the_config_check_exit_1(capsys, tmp_path):
    """dflash-train would refuse to load it (dflash.models.target.refuse_custom_code); preflight says so first."""
    target = tmp_path / "evil"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "model_type": "evil_lm", "auto_map": {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"},
        "num_hidden_layers": 12, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 1000}))
    (target / "modeling_evil.py").write_text("raise SystemExit('the folder ran its code')\n")
    (target / "model.safetensors").write_bytes(b"")  # weights, as a downloaded model has
    config = write_run(tmp_path, device="cpu")
    config.write_text(config.read_text() + f'[target]\npath = "{target}"\n')
    code, out, _ = run(capsys, "--profile", "train-cu128", "--config", str(config), "--nvml-fake", "none")
    line = next(x for x in out.splitlines() if x.split()[1:2] == ["config"])
    assert code == 1 and line.startswith("FAIL   config "), out
    assert f"target {target}: custom code is refused: config.json model_type 'evil_lm' is not an architecture " \
           "transformers " in line and line.endswith("ships (auto_map: modeling_evil.py)"), line
    fix = out.splitlines()[out.splitlines().index(line) + 1]
    assert fix.strip() == (f"fix: set target.path in {config} to a model whose architecture transformers ships (a folder "
                           "without its own code), or upgrade transformers")


def test_busy_gpus_fail_and_waivers_turn_exit_to_0(capsys, tmp_path):
    cfg = write_run(tmp_path, topology=(["0", "1", "2", "3", "4"], ["5", "6", "7"]))
    code, out, _ = run(capsys, "--profile", "train-cu128", "--json", "--nvml-fake", str(FIXTURE), "--config", str(cfg))
    assert code == 1
    report = json.loads(out)
    st = statuses(out)
    assert st["gpu-processes"] == "fail" and st["gpu-visibility"] == "pass" and st["dataset"] == "pass"
    failing = [c["id"] for c in report["checks"] if c["status"] == "fail"]
    assert set(failing) <= {"gpu-processes", *ENV_DEPENDENT}
    waive = [a for i in failing for a in ("--waive", i, "--reason", f"test: {i} accepted")]
    code, out, _ = run(capsys, "--profile", "train-cu128", "--json", "--nvml-fake", str(FIXTURE), "--config", str(cfg),
                       *waive)
    assert code == 0
    report = json.loads(out)
    assert report["ok"] is True
    proc = next(c for c in report["checks"] if c["id"] == "gpu-processes")
    assert proc["status"] == "waived" and "48219" in proc["summary"]  # the finding is kept
    assert proc["data"]["waiver"] == {"reason": "test: gpu-processes accepted", "status": "fail"}


def test_existing_checkpoints_need_resume_or_fresh(capsys, tmp_path):
    cfg = write_run(tmp_path, device="cpu")
    ck = tmp_path / "run" / "checkpoints" / "step_00000690"
    ck.mkdir(parents=True)
    saved = config_from_dict({"output_dir": str(tmp_path / "run"), "device": "cpu"}).model_dump()
    (ck / "meta.json").write_text(json.dumps({"step": 690, "config": saved,
                                              "dataset": {"path": "x", "samples": 902000, "fingerprint": "f"}}))
    for name in set(CHECKPOINT_FILES) - {META_NAME}:  # the files a resume loads (preflight reads only meta.json)
        (ck / name).parent.mkdir(parents=True, exist_ok=True)
        (ck / name).write_bytes(b"")
    base = ("--profile", "train-cu128", "--json", "--config", str(cfg))
    _, out, _ = run(capsys, *base)
    run_dir = next(c for c in json.loads(out)["checks"] if c["id"] == "run-dir")
    assert run_dir["status"] == "fail" and "step_00000690 (step 690)" in run_dir["summary"]
    _, out, _ = run(capsys, *base, "--fresh")
    assert statuses(out)["run-dir"] == "pass"
    _, out, _ = run(capsys, *base, "--resume")
    run_dir = next(c for c in json.loads(out)["checks"] if c["id"] == "run-dir")
    assert run_dir["status"] == "warn" and "902,000 -> 3 samples" in run_dir["summary"]


def _flip(file: Path, at: int, n: int = 64) -> None:
    data = bytearray(file.read_bytes())
    data[at:at + n] = bytes(b ^ 0xFF for b in data[at:at + n])
    file.write_bytes(bytes(data))


def test_verify_data_catches_a_shard_with_flipped_bytes(capsys, tmp_path):
    """The issue's shard with 64 flipped bytes trained to completion with exit 0: --verify-data compares sha256."""
    cfg = write_run(tmp_path, device="cpu")
    shard = tmp_path / "data" / "shard-00000.arrow"
    base = ("--profile", "train-cu128", "--json", "--config", str(cfg))
    _, out, _ = run(capsys, *base, "--verify-data")
    dataset = next(c for c in json.loads(out)["checks"] if c["id"] == "dataset")
    assert dataset["status"] == "pass" and dataset["data"]["verified_by"] == "sizes and sha256", dataset
    _flip(shard, shard.stat().st_size // 2)
    code, out, _ = run(capsys, *base, "--verify-data")
    dataset = next(c for c in json.loads(out)["checks"] if c["id"] == "dataset")
    assert code == 1 and dataset["status"] == "fail"
    assert "shard-00000.arrow content differs from its sha256 in manifest.json" in dataset["summary"]


def test_a_same_size_rewrite_is_seen_only_by_verify_data(capsys, tmp_path):
    cfg = write_run(tmp_path, device="cpu")
    shard = tmp_path / "data" / "shard-00000.arrow"
    size = shard.stat().st_size
    ids = pa.array([[7] * n for n in (50, 300, 120)], type=pa.list_(pa.int32()))  # valid ids, other content
    mask = pa.array([[1] * n for n in (50, 300, 120)], type=pa.list_(pa.int8()))
    table = pa.table({"input_ids": ids, "loss_mask": mask})
    with pa.OSFile(str(shard), "wb") as sink, ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    assert shard.stat().st_size == size
    base = ("--profile", "train-cu128", "--json", "--config", str(cfg))
    _, out, _ = run(capsys, *base)
    assert statuses(out)["dataset"] == "pass"  # sizes only
    code, out, _ = run(capsys, *base, "--verify-data")
    assert code == 1 and statuses(out)["dataset"] == "fail"


def test_human_output_lines_fixes_verdict_and_no_colour_off_tty(capsys, tmp_path):
    code, out, _ = run(capsys, "--profile", "train-cu128", "--nvml-fake", "none")
    lines = out.splitlines()
    assert "\x1b[" not in out
    assert lines[0].startswith("PASS   profile") or lines[0].startswith("FAIL   profile")
    gpu = next(i for i, line in enumerate(lines) if " gpu-visibility " in line)
    assert lines[gpu].startswith("FAIL") and "no NVIDIA driver (NVML not found)" in lines[gpu]
    assert lines[gpu + 1].strip().startswith("fix: ")
    assert lines[-1].startswith("preflight train-cu128: FAILED") and "gpu-visibility" in lines[-1] and code == 1


# ---------------------------------------------------------------- gate


def test_gate_writes_report_and_validates_waivers(tmp_path):
    cfg = config_from_dict({"output_dir": str(tmp_path / "run"), "device": "cpu",
                            "data": {"path": str(tmp_path / "nodata")}})
    report = run_gate(cfg, {"dataset": "data arrives later"}).report
    saved = Report.model_validate_json((tmp_path / "run" / "preflight.json").read_text())
    assert saved == report
    ds = report.by_id("dataset")
    assert ds.status == "waived" and ds.data["waiver"]["status"] == "fail" and "does not exist" in ds.summary
    with pytest.raises(ValueError, match="unknown check id"):
        run_gate(cfg, {"dataset-x": "typo"})


def test_gate_fails_on_busy_gpus(tmp_path):
    cfg = config_from_dict({"output_dir": str(tmp_path / "run"), "data": {"path": str(tmp_path / "nodata")},
                            "topology": {"target_gpus": ["6"], "drafter_gpus": ["7"]}})
    report = run_gate(cfg, {}, "fresh", gpu_info=FakeGpuInfo.from_json(FIXTURE)).report
    assert not report.ok and report.by_id("gpu-processes").status == "fail"


# ---------------------------------------------------------------- the real process


def test_real_process_json_exit_code_and_never_imports_torch(tmp_path):
    """Runs the real command in a fresh interpreter: one JSON object, exact exit code, torch never imported."""
    code = ("import sys, runpy\n"
            "sys.argv = ['dflash-preflight', '--profile', 'train-cu128', '--json', '--nvml-fake', 'none']\n"
            "try:\n    runpy.run_module('dflash.commands.preflight', run_name='__main__')\n"
            "except SystemExit as e:\n    rc = e.code\n"
            "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'NO_TORCH', file=sys.stderr)\n"
            "sys.exit(rc)\n")
    env = dict(os.environ, HOME=str(tmp_path), PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert p.stderr.strip().splitlines()[-1] == "NO_TORCH"
    report = json.loads(p.stdout)
    assert [c["id"] for c in report["checks"]] == list(CHECK_IDS)
    assert p.returncode == 1 and report["ok"] is False  # no driver: gpu-visibility fails


def test_real_process_usage_error(tmp_path):
    p = subprocess.run([sys.executable, "-m", "dflash.commands.preflight", "--profile", "nope"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == "dflash-preflight: error: unknown profile 'nope' (known: infer-cu130, train-cu128)\n"


# ---------------------------------------------------------------- random weights only on purpose


GPU_PRESETS = sorted(p.name for p in (REPO / "configs").glob("*.toml") if p.name != "demo-cpu.toml")


def test_no_preset_builds_its_target_with_random_weights():
    """Users start from the presets: none sets target.random_init (a measurement says so on its own command line)."""
    import tomllib

    assert len(GPU_PRESETS) >= 5
    for name in GPU_PRESETS:
        raw = tomllib.loads((REPO / "configs" / name).read_text())
        assert "random_init" not in raw.get("target", {}), name


def test_a_preset_as_shipped_fails_preflight_in_one_line_naming_target_path_and_the_measurement_flag(capsys, tmp_path):
    preset = f"configs/{GPU_PRESETS[0]}"
    code, out, _ = run(capsys, "--profile", "train-cu128", "--json", "--nvml-fake", "none", "--config", preset,
                       "--set", f'output_dir="{tmp_path / "run"}"')
    config = next(c for c in json.loads(out)["checks"] if c["id"] == "config")
    assert code == 1 and config["status"] == "fail", config
    assert config["summary"].startswith("target.path configs/targets/") and config["summary"].endswith(
        " holds no weights (model.safetensors or pytorch_model.bin), only the model's shapes")
    assert config["fix"] == (f"set target.path in {preset} to the folder of your model's weights; for memory and speed "
                             "measurements on these shapes alone, add --set target.random_init=true")
    code, out, _ = run(capsys, "--profile", "train-cu128", "--json", "--nvml-fake", "none", "--config", preset,
                       "--set", f'output_dir="{tmp_path / "run"}"', "--set", "target.random_init=true")
    assert statuses(out)["config"] == "warn"


def test_the_gate_prints_the_random_weights_warning_as_it_lets_the_run_start(tmp_path):
    cfg = config_from_dict({"output_dir": str(tmp_path / "run"), "device": "cpu", "data": {"path": str(tmp_path / "no")},
                            "target": {"path": "configs/targets/qwen3-0.6b", "random_init": True}})
    gate = run_gate(cfg, {"dataset": "data arrives later"}, "fresh")
    warned = [n for n in gate.notes if n.startswith("preflight: WARN ")]
    assert len(warned) == 1 and warned[0].startswith(
        "preflight: WARN config: the target has random weights: the drafter learns nothing useful (target.random_init "
        "= true; configs/targets/qwen3-0.6b holds no weights); configs/targets/qwen3-0.6b: 28 layers"), gate.notes
    off = run_gate(cfg.model_copy(update={"target": cfg.target.model_copy(update={"random_init": False})}),
                   {"dataset": "data arrives later"}, "fresh")
    assert not any("random weights" in n for n in off.notes)
    assert any(n.startswith("preflight: FAIL config: target.path configs/targets/qwen3-0.6b holds no weights") for n in off.notes)
