"""The demo's pipeline (data -> preflight -> train -> evaluate) end to end on a tiny random target.

The real demo (`dflash-train --demo`, SmolLM2 on chitchat) takes minutes; these tests run the
same stages with a tiny target in seconds, and check the demo preset itself validates.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dflash.commands import demo
from dflash.config import load_config
from dflash.data.synthetic import word_text
from dflash.runs import rundir
from dflash.runs.lock import lock_run_dir
from preflight.gate import GateResult
from preflight.report import Report
from trainkit import chat_target


def test_demo_preset_validates():
    cfg = load_config(demo.CONFIG)
    assert cfg.device == "cpu" and cfg.target.path == "smollm2" and cfg.target.dtype == "float32"
    assert max(cfg.drafter.target_layer_ids) <= 30 - 3  # SmolLM2 has 30 layers


@pytest.mark.parametrize("user, busy, policy", [(None, 1.0, "PASSIVE"), (None, 0.1, None), ("ACTIVE", 1.0, "ACTIVE")])
def test_the_demo_lets_torch_threads_sleep_on_a_busy_machine_unless_the_user_chose(user, busy, policy):
    """Before torch loads OpenMP: beside a busy core the demo sets OMP_WAIT_POLICY=PASSIVE and says so; alone it leaves
    OpenMP's default; a policy the user set stays."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | ({"OMP_WAIT_POLICY": user} if user else {})
    code = ("import os, sys; from dflash.commands.demo import yielding_threads; "
            f"yielding_threads(busy={busy}); assert 'torch' not in sys.modules; "
            "print(os.environ.get('OMP_WAIT_POLICY'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    lines = out.strip().splitlines()
    assert lines[-1] == str(policy)
    assert (len(lines) == 2 and "keep 1.0 of" in lines[0]) == (policy == "PASSIVE" and user is None), lines


def test_busy_cores_reads_the_machine():
    busy = demo.busy_cores(0.2)
    assert busy is not None and 0.0 <= busy <= os.cpu_count() + 1e-9


def test_the_demo_says_when_torch_was_loaded_before_it_could_choose(monkeypatch):
    import torch  # noqa: F401  (loaded, as in this test process)

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    lines = []
    demo.yielding_threads(lines.append, busy=2.0)
    assert "OMP_WAIT_POLICY" not in os.environ
    assert len(lines) == 1 and "torch was loaded before the demo could choose how its threads wait" in lines[0]


def test_pipeline_on_a_tiny_target(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    passed = GateResult(Report.build("train-cu128", []), True, [], "preflight: ok (stubbed)")
    monkeypatch.setattr("preflight.gate.run_gate", lambda cfg, waivers, intent: passed)  # preflight has its own tests
    target = chat_target(tmp_path, "llama")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(word_text(3 + i % 5, start=i) for i in range(12)) + "\n")
    overrides = {
        "output_dir": str(tmp_path / "run"),
        "drafter.target_layer_ids": [1, 2],
        "drafter.mask_token_id": 5,
        "data.token_budget": 256,
        "train.max_anchors": 8,
        "train.epochs": 2,
    }
    code = demo.run_pipeline(str(target), str(prompts), 12, 8, str(prompts), 3, 8, overrides)
    out = capsys.readouterr().out
    assert code == 0, out
    for stage in range(1, demo.STAGES + 1):
        assert f"[{stage}/{demo.STAGES}]" in out
    assert "held-out acceptance length: trained" in out
    evaluate = out.split(f"[5/{demo.STAGES}]")[1]  # stage 5 says what it measured prompt by prompt, never silent
    for desc in ("target-only greedy", "speculative (untrained)", "speculative (trained)"):
        assert f"  {desc}: prompt 3/3: " in evaluate, evaluate
    reports = json.loads((tmp_path / "run" / "demo-eval.json").read_text())
    assert [r["name"] for r in reports] == ["untrained", "trained"]
    assert all(r["lossless"] for r in reports)
    assert reports[0]["ddtree"] == [] and [t["budget"] for t in reports[1]["ddtree"]] == [demo.DDTREE_BUDGET]
    assert reports[1]["ddtree"][0]["lossless"] and f"(DDTree, {demo.DDTREE_BUDGET} nodes: " in out
    assert (tmp_path / "run" / "drafter" / "model.safetensors").is_file()
    assert (tmp_path / "cache" / "demo").is_dir()  # data cached for the next run

    assert not (tmp_path / "run" / rundir.LOCK_NAME).exists()  # released at the end

    # While another process holds the run dir, a demo is refused in one line and moves nothing there.
    before = sorted(p.relative_to(tmp_path / "run") for p in (tmp_path / "run").rglob("*"))
    held = lock_run_dir(tmp_path / "run")
    with pytest.raises(rundir.RunDirBusyError, match="is in use by another trainer"):
        demo.run_pipeline(str(target), str(prompts), 12, 8, str(prompts), 3, 8, overrides)
    held.release()
    assert sorted(p.relative_to(tmp_path / "run") for p in (tmp_path / "run").rglob("*")) == before

    # A second run reuses the prepared data and moves the previous run aside.
    assert demo.run_pipeline(str(target), str(prompts), 12, 8, str(prompts), 3, 8, overrides) == 0
    out = capsys.readouterr().out
    assert "already prepared" in out and "--fresh: previous checkpoints, metrics.jsonl, drafter, heldout.json, report moved to" in out


@pytest.mark.slow
def test_smollm2_converts_and_answers():
    """The embedded target: GGUF -> HF folder (cached), and it knows its capitals."""
    from dflash.data.prompts import chat_prompt_ids
    from dflash.eval.speculative import Decoder, load_eval_target

    model, tok = load_eval_target("smollm2", "cpu")
    ids = chat_prompt_ids(tok, "What is the capital of France?")
    tokens, _ = Decoder(model, None, [tok.eos_token_id]).greedy(ids, 12)
    assert "Paris" in tok.decode(tokens)
