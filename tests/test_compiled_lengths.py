"""A length mix under torch.compile: one graph per shape class from warm-up on, and a recompile limit that ends the run
in one line instead of running flex attention eagerly.

The drafter's compiled pieces and flex attention run compiled on the CPU here with dynamo's `aot_eager` backend:
dynamo's guards, dynamic sizes and recompiles are the CUDA run's (inductor only generates the kernels; torch 2.10's
inductor has no CPU flex backward). The GPU side is `pytest -m gpu` (runner recipe gpu-tests) and the runner's
q36-mix and q36-packed-mix recipes (bench/runner.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash.data.synthetic import write_random_dataset, write_target
from trainkit import TRAIN_TARGET, metrics, run_config, train_main_here, write_toml


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """Compile the drafter and flex attention on the CPU (aot_eager), from a clean dynamo state, config restored."""
    import dflash.models.attention as attention
    import dflash.models.drafter as drafter

    monkeypatch.setattr(attention, "FLEX_COMPILE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(attention, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(attention, "_compiled_flex", {})
    monkeypatch.setattr(drafter, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(drafter, "_compiled_fns", {})
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=False):  # the trainer sets it: undone after
        yield
    torch._dynamo.reset()


def _lognormal_run(root: Path, packing: bool = False, **train):
    """The tiny preset on 400 lognormal-length samples (mean 48 tokens, sigma 0.6: 16 to 400 tokens), compiled;
    packing: its batches packed (data.packing)."""
    from dflash.config import config_from_dict

    target = write_target(root / "tiny-target", TRAIN_TARGET)
    data = write_random_dataset(root / "data", samples=400, length=48, vocab=128, sigma=0.6, max_length=400)
    cfg, raw = run_config(root, target, data, compile=True, **train)
    if packing:
        raw["data"]["packing"] = True
        cfg = config_from_dict(raw)
    return cfg, raw


def test_a_length_mix_builds_no_graph_after_the_first_step(tmp_path, compiled_on_cpu, capsys):
    """40 batches of 1 to 8 rows of 16..400 tokens, from a cold start: the run traces its shape classes before its
    first step, and then torch's own graph counter does not move (outcome.json: first step and last equal), no
    recompile is logged or counted, and --warm-cache's batches in another trainer of the process add no graph."""
    _no_graph_after_the_first_step(tmp_path, "cpu")
    assert any(line.startswith("compile: 2 shape class(es) (rows >= 2, one row)")
               for line in capsys.readouterr().out.splitlines())


def test_a_packed_length_mix_builds_no_graph_after_the_first_step(tmp_path, compiled_on_cpu, capsys):
    """The same mix packed (one row a batch, up to 512 tokens of 1 to 8 sequences): one shape class, traced before
    the first step, and no graph after it."""
    _no_graph_after_the_first_step(tmp_path, "cpu", packing=True)
    assert any(line.startswith("compile: 1 shape class(es) (packed)") for line in capsys.readouterr().out.splitlines())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (inductor's Triton kernels)")
@pytest.mark.parametrize("packing", [False, True])
def test_on_cuda_a_length_mix_builds_no_graph_after_the_first_step(tmp_path, packing):
    """The same on CUDA with inductor, whose kernels and autotuning add guards of their own (packed: the target's
    varlen attention and fla's cu_seqlens kernels too)."""
    torch._dynamo.reset()
    _no_graph_after_the_first_step(tmp_path, "cuda", packing=packing)


def _no_graph_after_the_first_step(tmp_path, device: str, packing: bool = False):
    from torch._dynamo.utils import counters

    from dflash.train.trainer import Trainer
    from dflash.train.warmup import warm_steps

    cfg, raw = _lognormal_run(tmp_path, packing, max_steps=40, save_every=1000)
    if device != cfg.device:
        from dflash.config import config_from_dict

        cfg = config_from_dict({**raw, "device": device})
    trainer = Trainer.colocated(cfg, None)
    assert trainer.attn_backend == "flex" and trainer.drafter.layers[0].compiled and trainer.primes()
    Path(cfg.output_dir).mkdir()
    assert trainer.run(progress=False) == 0
    out = Path(cfg.output_dir)
    rows = metrics(out)
    sizes = {len(b) for b in trainer.sampler.epoch_batches(0)}
    assert len(rows) == 40 and min(sizes) == (3 if packing else 1) and max(sizes) == 8, sizes
    outcome = json.loads((out / "outcome.json").read_text())
    graphs = outcome["compiled_graphs"]
    assert graphs["first_step"] >= 3 and graphs["last"] == graphs["first_step"], outcome.get("recompile_causes")
    assert {r["recompiles"] for r in rows} == {0} and "recompile_causes" not in outcome
    before = counters["stats"]["unique_graphs"]
    warm_steps(Trainer.colocated(cfg, None, log=lambda *_: None))
    assert counters["stats"]["unique_graphs"] == before


def test_a_recompile_limit_ends_the_run_in_one_line_with_its_checkpoints_intact(tmp_path, compiled_on_cpu, capsys,
                                                                                   monkeypatch):
    """A shape class nothing traced before the first step (priming off here) and a limit of one graph per function:
    the first one-row batch (step 21 of this plan) would need flex attention's second graph. The run stops there in
    one line naming the function and the guard, exit 1, nothing saved from the step, the checkpoints of steps 10
    and 20 verify, and outcome.json says crashed."""
    from dflash.runs import rundir
    from dflash.runs.verify import checkpoint_problem
    from dflash.train.trainer import Trainer

    monkeypatch.setattr(Trainer, "primes", lambda self: False)

    cfg, raw = _lognormal_run(tmp_path, max_steps=40, save_every=10)
    with torch._dynamo.config.patch(recompile_limit=1):
        code = train_main_here(write_toml(raw, tmp_path / "run.toml"), "--fresh", "--waive", "model-source",
                               "--reason", "tests")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1, err
    line = err[-1]
    assert line.startswith("dflash-train: error: step 21: torch.compile reached its recompile limit (1) for "
                           "_flex_full (attention.py:"), line
    assert "the run stopped instead of running it eagerly" in line and "train.compile = false" in line, line
    out = Path(cfg.output_dir)
    saved = rundir.list_checkpoints(out)
    assert [rundir.checkpoint_step(p) for p in saved] == [10, 20]
    assert all(checkpoint_problem(p, deep=True) is None for p in saved)
    assert len(metrics(out)) == 20
    outcome = json.loads((out / "outcome.json").read_text())
    assert outcome["ended"]["how"] == "crashed" and outcome["ended"]["step"] == 20


def _dp_rank(rank: int, raw: dict, port: int) -> None:
    """One co-located data-parallel rank (gloo), compiled on the CPU as `compiled_on_cpu` sets it up; the worker ends
    the process itself (os._exit with the run's code)."""
    import os

    import dflash.models.attention as attention
    import dflash.models.drafter as drafter

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    attention.FLEX_COMPILE_DEVICES = ("cuda", "cpu")
    attention.COMPILE_BACKEND = drafter.COMPILE_BACKEND = "aot_eager"
    from dflash.config import config_from_dict
    from dflash.train.ranks import worker

    worker(config_from_dict(raw), None)


@pytest.mark.e2e
@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp2"])
def test_co_located_data_parallel_ranks_prime_and_build_no_graph_after_the_first_step(tmp_path, capfd, data_parallel):
    """Two co-located DP ranks over gloo, the drafter DDP-wrapped or FSDP2-sharded: the shape classes are traced
    before the first step (the priming backward reduces nothing), then no rank builds a graph (each would print
    "recompiled after step N"), and the run finishes with both ranks' exit code 0."""
    import torch.multiprocessing as mp

    from trainkit import free_port

    _, raw = _lognormal_run(tmp_path, max_steps=12, save_every=1000)
    raw["topology"] = {"colocated_gpus": ["0", "1"], "timeout_s": 60}
    raw["train"]["data_parallel"] = data_parallel
    Path(raw["output_dir"]).mkdir()
    mp.spawn(_dp_rank, args=(raw, free_port()), nprocs=2, join=True)  # raises unless both ranks exit 0
    out = capfd.readouterr().out
    outcome = json.loads((Path(raw["output_dir"]) / "outcome.json").read_text())
    graphs = outcome["compiled_graphs"]
    assert f"2 data-parallel drafter ranks, {data_parallel} (as configured)" in out, out[-2000:]
    assert "compile: 2 shape class(es) (rows >= 2, one row)" in out and "recompiled after" not in out, out[-2000:]
    assert outcome["ended"]["how"] == "finished" and outcome["step"] == 12
    assert graphs["first_step"] >= 3 and graphs["last"] == graphs["first_step"], outcome.get("recompile_causes")
    assert {r["recompiles"] for r in metrics(Path(raw["output_dir"]))} == {0}
