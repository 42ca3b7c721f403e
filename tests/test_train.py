"""The co-located trainer end to end on CPU: a real tiny Qwen3 target, real Arrow shards, real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash.data.plan import cosine_lr
from dflash.models.drafter import DFlashDrafter
from dflash.models.target import decoder_of
from dflash.runs import rundir
from dflash.runs.resume import resolve_resume
from dflash.train.trainer import Trainer, run
from trainkit import metrics, tiny_config, train_cmd, train_main_here, write_toml

REPO = Path(__file__).resolve().parent.parent


def test_cosine_schedule_warms_up_then_decays():
    lrs = [cosine_lr(s, 100, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] < 0.01


def test_every_start_of_a_random_weight_target_says_so_first(tmp_path):
    """target.random_init = true on a folder of shapes alone: the trainer's plan opens with the warning, fresh or
    resumed (print_plan is the start of every run)."""
    from dflash.config import config_from_dict
    from dflash.data.synthetic import write_target
    from trainkit import TRAIN_TARGET

    _, raw = tiny_config(tmp_path)
    shapes = write_target(tmp_path / "shapes", TRAIN_TARGET, weights=False)
    raw["target"] = {"path": str(shapes), "dtype": "float32", "random_init": True}
    lines = []
    Trainer.colocated(config_from_dict(raw), log=lines.append).print_plan()
    assert lines[0] == "warning: the target has random weights: the drafter learns nothing useful (target.random_init = true)"
    raw["target"]["random_init"] = False
    raw["target"]["path"] = str(tmp_path / "tiny-target")  # real weights: no warning
    lines.clear()
    Trainer.colocated(config_from_dict(raw), log=lines.append).print_plan()
    assert not any("random weights" in line for line in lines), lines


def test_gpu_list_flags_replace_the_presets_layout(tmp_path, capsys):
    """The README's `dflash-train --config RUN.toml --fresh --colocated-gpus 0,...,7` on the split preset: the flag
    replaces the preset's target/drafter lists, so the config validates and the run goes to the gate (which refuses
    it here: no GPU), never `topology.colocated_gpus excludes target_gpus and drafter_gpus`."""
    import json

    preset = REPO / "configs/qwen3.6-27b-5t3d.toml"
    out = tmp_path / "run"
    code = train_main_here(preset, "--fresh", "--set", f'output_dir="{out}"', "--set", "target.random_init=true",
                           "--colocated-gpus", "0,1,2,3,4,5,6,7")
    err = capsys.readouterr().err
    assert code == 1 and "excludes" not in err and "refusing to start" in err, err
    from dflash.config import config_sha256, load_config
    from preflight.gate import resolve_compile_cache

    judged = json.loads((out / "preflight.json").read_text())["run"]["config_sha256"]
    expected = resolve_compile_cache(load_config(preset, {  # as dflash-train resolves it: its compile cache artifact
        "output_dir": str(out), "target.random_init": True, "topology.target_gpus": [], "topology.drafter_gpus": [],
        "topology.colocated_gpus": [str(i) for i in range(8)]}))
    assert judged == config_sha256(expected)  # the gate judged the flag's layout alone


def test_loss_falls_over_30_steps(tmp_path):
    cfg, _ = tiny_config(tmp_path, max_steps=30)
    assert run(cfg, None, log=lambda *_: None, progress=False) == 0
    m = metrics(Path(cfg.output_dir))
    assert [r["step"] for r in m] == list(range(1, 31))
    first = sum(r["loss"] for r in m[:3]) / 3
    last = sum(r["loss"] for r in m[-3:]) / 3
    assert last < 0.7 * first, f"loss {first:.3f} -> {last:.3f}"
    assert m[-1]["accept_len"] > m[0]["accept_len"]
    assert (Path(cfg.output_dir) / "drafter" / "model.safetensors").exists()


@pytest.mark.parametrize("kl_weight", [0.0, 0.5])
def test_cached_features_train_like_the_target(tmp_path, kl_weight):
    """train.cache_features: later epochs reuse the first epoch's target features; the losses do not change."""
    losses = {}
    for cache in (False, True):
        cfg, _ = tiny_config(tmp_path / str(cache), max_steps=24, cache_features=cache, kl_weight=kl_weight)
        trainer = Trainer.colocated(cfg, log=lambda *_: None)
        assert trainer.total_steps > 2 * trainer.sampler.batches_per_epoch  # epochs 2 and 3 read the cache
        assert run(cfg, None, log=lambda *_: None, progress=False) == 0
        losses[cache] = [r["loss"] for r in metrics(Path(cfg.output_dir))]
    assert losses[True] == pytest.approx(losses[False], rel=1e-4, abs=1e-5)


def test_feature_cache_skips_the_target_once_every_sample_was_seen(tmp_path):
    cfg, _ = tiny_config(tmp_path, cache_features=True)
    trainer = Trainer.colocated(cfg, log=lambda *_: None)
    calls = []
    decoder_of(trainer.source.model).register_forward_pre_hook(lambda *_: calls.append(1))
    stream = trainer.step_batches()
    for _ in range(2 * trainer.sampler.batches_per_epoch):
        _, _, mine = next(stream)
        trainer.train_step(mine)
    stream.close()
    assert len(trainer.source.rows) == trainer.dataset.num_samples
    assert len(calls) == trainer.sampler.batches_per_epoch  # the first epoch only


def test_checkpoint_reloads_into_drafter_and_fresh_process(tmp_path):
    cfg, _ = tiny_config(tmp_path, max_steps=10)
    run(cfg, None, log=lambda *_: None, progress=False, provenance={"lock_sha256": "ab" * 32, "git_commit": None})
    latest = rundir.list_checkpoints(cfg.output_dir)[-1]
    assert latest.name == "step_00000010"
    meta = json.loads((latest / "meta.json").read_text())
    assert meta["step"] == 10 and meta["config"]["drafter"]["block_size"] == 4
    assert meta["dataset"]["samples"] == 64 and meta["lock_sha256"]
    # in this process: the trainer's weights and the saved folder agree exactly
    trainer = Trainer.colocated(cfg, latest, log=lambda *_: None)
    loaded = DFlashDrafter.from_pretrained(latest / "drafter")
    for (name, a), (_, b) in zip(trainer.drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b.to(a.dtype)), name
    assert trainer.step == 10
    # in a fresh process
    code = ("import sys,torch; from dflash.models.drafter import DFlashDrafter; "
            "d=DFlashDrafter.from_pretrained(sys.argv[1]); "
            "print(sum(float(p.double().sum()) for p in d.parameters()))")
    out = subprocess.run([sys.executable, "-c", code, str(latest / "drafter")], capture_output=True, text=True,
                         cwd=REPO, check=True).stdout
    expect = sum(float(p.detach().double().sum()) for p in loaded.parameters())
    assert float(out) == pytest.approx(expect, rel=1e-12)


def test_resume_after_kill_matches_uninterrupted(tmp_path):
    """SIGKILL mid-run, resume from the last checkpoint: the next steps' metrics equal an uninterrupted run."""
    ref_cfg, _ = tiny_config(tmp_path / "ref", max_steps=20, save_every=5)
    run(ref_cfg, None, log=lambda *_: None, progress=False)
    ref = {r["step"]: r for r in metrics(Path(ref_cfg.output_dir))}

    cfg, raw = tiny_config(tmp_path / "killed", max_steps=20, save_every=5)
    config = write_toml(raw, tmp_path / "run.toml")
    proc = subprocess.Popen(train_cmd(config, "--fresh"), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    run_dir = Path(cfg.output_dir)
    deadline = time.time() + 120
    while time.time() < deadline and not any(c.name == "step_00000010" for c in rundir.list_checkpoints(run_dir)):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = rundir.list_checkpoints(run_dir)[-1]
    step = int(saved.name.split("_")[1])
    assert 10 <= step < 20
    out = subprocess.run(train_cmd(config, "--resume", "latest"), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr  # finished: 0, and no stop marker
    assert f"resumed from {saved}" in out.stdout and not (run_dir / "stopped.json").exists()
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 21))  # each step once: the killed run's later rows moved aside
    abandoned = list(run_dir.glob("metrics.abandoned-*.jsonl"))
    assert all(json.loads(line)["step"] > step for f in abandoned for line in f.read_text().splitlines())
    resumed = {r["step"]: r for r in rows if r["step"] > step}
    assert sorted(resumed) == list(range(step + 1, 21))
    for s, r in resumed.items():
        assert r["loss"] == pytest.approx(ref[s]["loss"], rel=1e-5, abs=1e-6), s
        assert r["accept_len"] == pytest.approx(ref[s]["accept_len"], rel=1e-6)


def test_sigterm_finishes_step_checkpoints_and_exits_75(tmp_path):
    """A scheduler tells a stopped run from a finished one: exit 75 (EX_TEMPFAIL) and stopped.json in the run dir."""
    cfg, raw = tiny_config(tmp_path, max_steps=5000, save_every=1000)
    config = write_toml(raw, tmp_path / "run.toml")
    proc = subprocess.Popen(train_cmd(config, "--fresh"), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics_file = Path(cfg.output_dir) / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics_file.exists() and metrics_file.stat().st_size > 0):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 75, out
    assert "stopped by SIGTERM" in out and "--resume latest" in out
    last = rundir.list_checkpoints(cfg.output_dir)[-1]
    assert int(last.name.split("_")[1]) == metrics(Path(cfg.output_dir))[-1]["step"]
    marker = json.loads((Path(cfg.output_dir) / "stopped.json").read_text())
    assert marker["signal"] == "SIGTERM" and marker["checkpoint"] == str(last) and marker["exit_code"] == 75
    assert marker["step"] == int(last.name.split("_")[1])


def test_refuses_without_resume_or_fresh_when_checkpoints_exist(tmp_path):
    cfg, raw = tiny_config(tmp_path, max_steps=2, save_every=1)
    run(cfg, None, log=lambda *_: None, progress=False)
    config = write_toml(raw, tmp_path / "run.toml")
    out = subprocess.run(train_cmd(config), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2
    assert "step_00000002" in out.stderr and "--resume latest" in out.stderr and "--fresh" in out.stderr
    assert [c.name for c in rundir.list_checkpoints(cfg.output_dir)] == ["step_00000001", "step_00000002"]


def test_corrupt_shard_names_the_file(tmp_path):
    cfg, raw = tiny_config(tmp_path, max_steps=2)
    shard = sorted(Path(cfg.data.path).glob("*.arrow"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    config = write_toml(raw, tmp_path / "run.toml")
    out = subprocess.run(train_cmd(config), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 1
    assert shard.name in out.stderr
    assert "Traceback" not in out.stderr


def test_resume_from_an_older_checkpoint_moves_newer_ones_aside(tmp_path):
    cfg, raw = tiny_config(tmp_path, max_steps=6, save_every=2, keep_last=3)
    run(cfg, None, log=lambda *_: None, progress=False)
    (rundir.checkpoints_dir(cfg.output_dir) / "step_00000004.bak").mkdir()  # an odd folder must not break saves
    older = rundir.checkpoints_dir(cfg.output_dir) / "step_00000002"
    raw["train"]["max_steps"] = 3
    config = write_toml(raw, tmp_path / "run.toml")
    refused = subprocess.run(train_cmd(config, "--resume", str(older)), cwd=REPO, capture_output=True, text=True)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip() == ("dflash-train: error: --resume step_00000002 (step 2) would change the lr "
                                      "schedule: total steps 6 -> 3 (train.max_steps 6 -> 3); pass "
                                      "--allow-schedule-change to accept it, or restore the checkpoint's settings")
    assert [c.name for c in rundir.list_checkpoints(cfg.output_dir)] == ["step_00000002", "step_00000004",
                                                                       "step_00000006"]  # nothing moved
    out = subprocess.run(train_cmd(config, "--resume", str(older), "--allow-schedule-change"), cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert ("--allow-schedule-change: resuming step_00000002 (step 2) with a new lr schedule: total steps 6 -> 3 "
            "(train.max_steps 6 -> 3)") in out.stdout
    assert "2 newer checkpoint(s) moved to" in out.stdout
    names = [c.name for c in rundir.list_checkpoints(cfg.output_dir)]
    assert names == ["step_00000002", "step_00000003"]  # the resumed-from one is kept, latest is this run's
    assert resolve_resume(cfg.output_dir, "latest").name == "step_00000003"


def test_dataset_too_small_for_one_step_is_a_clear_error(tmp_path):
    cfg, raw = tiny_config(tmp_path, grad_accum=1000)
    raw["train"].pop("max_steps")
    raw["train"]["epochs"] = 1
    config = write_toml(raw, tmp_path / "run.toml")
    out = subprocess.run(train_cmd(config, "--fresh"), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 1
    assert "make no step of 1000 batches" in out.stderr and "Traceback" not in out.stderr


def test_feature_cache_is_refused_for_split_runs():
    from dflash.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="cache_features works in co-located runs only"):
        config_from_dict({"train": {"cache_features": True}, "topology": {"target_gpus": ["0"], "drafter_gpus": ["1"]}})


def test_list_valued_set_and_bad_set_values_are_one_line(tmp_path):
    """`--set` takes TOML values (lists work) through the one parser; a bad value names the field, no traceback."""
    cfg, raw = tiny_config(tmp_path, max_steps=1)
    config = write_toml(raw, tmp_path / "run.toml")
    ok = subprocess.run(train_cmd(config, "--fresh", "--set", "drafter.target_layer_ids=[0, 2]"), cwd=REPO,
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    saved = json.loads((Path(cfg.output_dir) / "config.json").read_text())
    assert saved["drafter"]["target_layer_ids"] == [0, 2]
    bad = subprocess.run(train_cmd(config, "--fresh", "--set", 'drafter.target_layer_ids=[0, "x"]',
                                   "--set", "train.lr=-1"), cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    line = bad.stderr.strip()
    assert line.startswith("dflash-train: error: ") and "\n" not in line, bad.stderr
    assert "drafter.target_layer_ids.1" in line and "train.lr" in line  # every validation error, on one line
    nokey = subprocess.run(train_cmd(config, "--fresh", "--set", "train.lr"), cwd=REPO, capture_output=True, text=True)
    assert nokey.returncode == 2 and "expected SECTION.KEY=VALUE" in nokey.stderr


def test_metrics_count_compiled_graphs(tmp_path):
    """Every metrics row says how many graphs torch.compile built so far (recompiles show up as growth)."""
    cfg, _ = tiny_config(tmp_path, max_steps=3)
    lines = []
    assert run(cfg, None, log=lines.append, progress=False) == 0
    rows = metrics(Path(cfg.output_dir))
    assert all(isinstance(r["compiled_graphs"], int) for r in rows)
    assert any(line.startswith("first step: ") for line in lines)


def _tight_config(tmp_path, token_budget: int, **train):
    """The tiny preset with another token budget (rows of 24..63 tokens: 100 gives batches of 1 to 4 rows)."""
    from dflash.config import config_from_dict

    _, raw = tiny_config(tmp_path, **train)
    raw["data"]["token_budget"] = token_budget
    return config_from_dict(raw), raw


def _warm_picks(sampler) -> tuple[list[tuple[str, int, int]], list[list[int]]]:
    """([(class, rows, length)] of the batches warm_batches picks, every batch of epoch 0)."""
    from dflash.train.warmup import warm_batches

    batches = sampler.epoch_batches(0)
    picked = warm_batches(sampler)
    assert all(list(b) in batches for _, b in picked)
    return [(c, len(b), int(sampler.lengths[b].max())) for c, b in picked], batches


def test_warm_batches_take_both_ends_of_each_shape_class(tmp_path):
    """For batches of two rows or more and for one-row batches (dynamo specialises size 1), the batch with the most and
    the one with the fewest padded tokens, and the one with the most rows: each class the run's batches fall in."""
    import numpy as np

    from dflash.data.buckets import BucketBatchSampler
    from dflash.data.plan import schedule

    cfg, _ = _tight_config(tmp_path, 100)  # long rows alone, short ones up to 4 together
    sampler = schedule(cfg, 1)[1]
    shapes, batches = _warm_picks(sampler)
    assert {c for c, _, _ in shapes} == {"rows >= 2", "one row"} and all((c == "one row") == (r == 1)
                                                                          for c, r, _ in shapes), shapes
    tokens = {(r, s): r * s for _, r, s in shapes}
    every = [len(b) * int(sampler.lengths[b].max()) for b in batches]
    multi = [len(b) * int(sampler.lengths[b].max()) for b in batches if len(b) > 1]
    assert max(tokens.values()) == max(every) and min(t for (r, _), t in tokens.items() if r > 1) == min(multi)
    assert max(r for _, r, _ in shapes) == max(len(b) for b in batches)
    # 32 rows of 30..33 tokens in two buckets, 8 to a batch: no single-row batch, none taken
    shapes, _ = _warm_picks(BucketBatchSampler(30 + np.arange(32) % 4, 512, 8, 2, seed=0))
    assert {c for c, _, _ in shapes} == {"rows >= 2"} and all(r == 8 for _, r, _ in shapes), shapes


def test_warm_steps_run_the_target_on_every_shape_class(tmp_path, monkeypatch):
    """--warm-cache's steps (CUDA-only around them; the steps run here on CPU): the target computes features for
    each warm batch, a single-row one included, and one line says the classes, the batches and the graphs."""
    from dflash.train.warmup import warm_steps

    cfg, _ = _tight_config(tmp_path, 100)
    trainer = Trainer.colocated(cfg, None, log=lambda *_: None)
    seen, features = [], trainer.source.features
    monkeypatch.setattr(trainer.source, "features", lambda k, b: seen.append(tuple(b["input_ids"].shape)) or features(k, b))
    lines = []
    shapes = warm_steps(trainer, lines.append)
    assert seen == shapes and any(b == 1 for b, _ in shapes) and any(b > 1 for b, _ in shapes)
    assert lines[-1].startswith(f"warm-cache: 2 shape class(es) (rows >= 2, one row) in {len(shapes)} batches of "
                                + ", ".join(f"{b} x {s}" for b, s in shapes) + " tokens"), lines[-1]
    counts = lines[-1].split("; graphs after each batch: ")[1].split(", ")  # which batches built graphs (CPU: none)
    assert len(counts) == len(shapes) and len(set(counts)) == 1, lines[-1]


def test_a_graph_built_after_the_first_step_is_one_line_and_counted(tmp_path, monkeypatch, capsys):
    """CPU compiles nothing: the graph counter grows by one at step 3 and by two at step 5 (as a new bucket shape would
    on CUDA). Each growth is one line, a metrics row field and outcome.json's recompiles."""
    import dflash.train.trainer as train_mod

    cfg, raw = tiny_config(tmp_path, max_steps=6)
    real, calls = train_mod.micro_step, []
    monkeypatch.setattr(train_mod, "micro_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(train_mod, "compiled_graphs", lambda: 4 + (len(calls) >= 3) + 2 * (len(calls) >= 5))
    assert train_main_here(write_toml(raw, tmp_path / "run.toml"), "--fresh", "--waive", "model-source", "--reason",
                           "tests") == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("recompiled")] == [
        "recompiled after step 3: 5 graphs (was 4)", "recompiled after step 5: 7 graphs (was 5)"]
    assert [r["recompiles"] for r in metrics(Path(cfg.output_dir))] == [0, 0, 1, 1, 2, 2]
    outcome = json.loads((Path(cfg.output_dir) / "outcome.json").read_text())
    assert outcome["recompiles"] == 2 and outcome["compiled_graphs"] == {"first_step": 4, "last": 7}


def _poison_loss_from(monkeypatch, first_bad_step: int) -> None:
    """micro_step returns a nan loss (and so nan gradients) from the given optimizer step on (one batch per step)."""
    import dflash.train.trainer as train_mod

    real, calls = train_mod.micro_step, []

    def poisoned(*args, **kwargs):
        loss, m = real(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan"), dict(m, loss=float("nan"))) if len(calls) >= first_bad_step else (loss, m)

    monkeypatch.setattr(train_mod, "micro_step", poisoned)


def test_non_finite_loss_stops_the_run_and_saves_nothing_from_it(tmp_path, monkeypatch, capsys):
    """A nan loss at step 5 (checkpoints every 2): exit 1 with one error line; step 4 stays the newest checkpoint,
    it is not pruned, no drafter/ export is written and no metrics row of the bad step."""
    from dflash.commands.train import train_main

    cfg, raw = tiny_config(tmp_path, max_steps=10, save_every=2, keep_last=2)
    config = write_toml(raw, tmp_path / "run.toml")
    _poison_loss_from(monkeypatch, 5)
    environ = dict(os.environ)  # dflash-train sets the profile's variables in this process: undone below
    try:
        with pytest.raises(SystemExit) as e:
            train_main(["--config", str(config), "--fresh", "--no-progress", "--waive", "model-source", "--reason", "tests"])
    finally:
        os.environ.clear()
        os.environ.update(environ)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("dflash-train: error: step 5: loss nan, gradient norm nan: training diverged; nothing "
                              "was saved from it"), err[-1]
    out = Path(cfg.output_dir)
    assert [c.name for c in rundir.list_checkpoints(out)] == ["step_00000002", "step_00000004"]
    assert not (out / "drafter").exists()
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]
    good = DFlashDrafter.from_pretrained(out / "checkpoints" / "step_00000004" / "drafter")
    assert all(bool(torch.isfinite(p).all()) for p in good.parameters())


def test_non_finite_weights_are_never_saved(tmp_path):
    """weight_decay = inf (now refused by the config; forced here past validation): step 1's loss is finite but
    its update is not, and the save of step 1 refuses to write the non-finite weights."""
    from dflash.train.trainer import NonFiniteError

    cfg, _ = tiny_config(tmp_path, max_steps=3, save_every=1)
    cfg.train.__dict__["weight_decay"] = float("inf")  # bypass validate_assignment: what an older config could hold
    with pytest.raises(NonFiniteError, match=r"step 1: drafter weights are not finite .*earlier checkpoints are intact"):
        run(cfg, None, log=lambda *_: None, progress=False)
    out = Path(cfg.output_dir)
    assert rundir.list_checkpoints(out) == [] and not (out / "drafter").exists()


def test_warm_cache_of_a_cuda_config_without_a_gpu_fails_in_one_line(tmp_path):
    _, raw = tiny_config(tmp_path)
    raw["device"] = "cuda"
    config = write_toml(raw, tmp_path / "run.toml")
    out = subprocess.run(train_cmd(config, "--warm-cache"), cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stdout + out.stderr
    errors = [x for x in out.stderr.splitlines() if x.startswith("dflash-train: error: ")]
    assert len(errors) == 1 and out.stderr.strip().endswith(errors[0]), out.stderr
    line = errors[0]
    assert line.startswith(f"dflash-train: error: --warm-cache: {config} says device = \"cuda\" but torch sees no GPU")


def _flip_middle(file: Path, n: int = 64) -> None:
    data = bytearray(file.read_bytes())
    mid = len(data) // 2
    data[mid:mid + n] = bytes(b ^ 0xFF for b in data[mid:mid + n])
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("case", ["id >= vocab", "all-zero loss_mask", "1-token samples", "64 flipped bytes",
                                  "an import killed half-way"])
def test_data_the_run_cannot_learn_from_stops_at_the_gate(tmp_path, case):
    """Each passed preflight before, then crashed in step 1 or "trained" with exit 0; now the dataset check fails."""
    from dflash.data.identity import shard_records, target_fingerprint, write_manifest
    from dflash.data.shards import write_shard

    cfg, raw = tiny_config(tmp_path, max_steps=2)
    data = Path(cfg.data.path)
    shards = sorted(data.glob("*.arrow"))
    if case == "id >= vocab":
        write_shard(data / "shard-00009.arrow", [[5, 6, 200]], [[0, 1, 1]])  # the tiny target's vocabulary is 128
        expect = "token ids up to 200 (shard-00009.arrow) but the target's vocabulary is 128"
    elif case == "all-zero loss_mask":
        for shard in shards:
            write_shard(shard, [[5, 6, 7]] * 4, [[0, 0, 0]] * 4)
        expect = "nothing to learn: loss_mask is 0 everywhere"
    elif case == "1-token samples":
        for shard in shards:
            write_shard(shard, [[5]] * 4, [[1]] * 4)
        expect = "nothing to learn: no sample has two consecutive loss_mask = 1 tokens"
    elif case == "64 flipped bytes":
        write_manifest(data, {"target": target_fingerprint(cfg.target.path), "shards": shard_records(shards)})
        _flip_middle(shards[1])
        expect = "shard-00001.arrow content differs from its sha256 in manifest.json"
    else:  # what a killed dflash-data import leaves: its resume state, no completion record
        write_manifest(data, {"target": target_fingerprint(cfg.target.path), "shards": shard_records(shards),
                              "settings": {}, "import": {"done": {}}})
        expect = (f"dflash-data import did not finish writing {data} (no completion record in manifest.json: killed "
                  "half-way?)")
    config = write_toml(raw, tmp_path / "run.toml")
    out = subprocess.run(train_cmd(config, "--fresh", "--verify-data"), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    failed = [line for line in out.stderr.splitlines() if line.startswith("preflight: FAIL ")]
    assert len(failed) == 1 and failed[0].startswith("preflight: FAIL dataset: ") and expect in failed[0], out.stderr
    assert not (Path(cfg.output_dir) / "metrics.jsonl").exists()  # no step ran


def test_a_refused_fresh_start_moves_nothing(tmp_path):
    """--fresh moves the old checkpoints aside only once the gate passed: a refused run leaves the run dir as it was."""
    cfg, raw = tiny_config(tmp_path, max_steps=2, save_every=1)
    run(cfg, None, log=lambda *_: None, progress=False)
    out = Path(cfg.output_dir)
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    raw["data"]["max_length"] = 10  # the samples are 24-64 tokens: the dataset check fails
    config = write_toml(raw, tmp_path / "run.toml")
    refused = subprocess.run(train_cmd(config, "--fresh"), cwd=REPO, capture_output=True, text=True)
    assert refused.returncode == 1 and "refusing to start" in refused.stderr, refused.stdout + refused.stderr
    after = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert [p for p in after if p not in before] == ["preflight.json"] or after == before
    assert not list(out.glob("replaced-*")) and len(rundir.list_checkpoints(out)) == 2


def test_compilation_happens_in_the_main_thread_only(tmp_path, monkeypatch):
    """The read-ahead thread only reads and collates: every torch.compile graph is built by the main thread
    (the incident lost a run to an FX race when compilation ran in a reader thread). Recompiles over the
    run's length buckets are counted in metrics.jsonl."""
    import threading

    import dflash.models.drafter as model_mod

    threads = []

    def recording_backend(gm, example_inputs):
        threads.append(threading.current_thread().name)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

    monkeypatch.setattr(model_mod, "COMPILE_BACKEND", recording_backend)
    monkeypatch.setattr(model_mod, "_compiled_fns", {})
    torch._dynamo.reset()  # graphs other tests compiled for the same functions would add recompiles here
    set_compile = model_mod.DFlashDrafter.set_compile
    monkeypatch.setattr(model_mod.DFlashDrafter, "set_compile", lambda self, on: set_compile(self, True))  # CUDA-only
    from dflash.train.trainer import compiled_graphs

    cfg, _ = tiny_config(tmp_path, max_steps=8)
    before = compiled_graphs()  # a process-wide counter
    assert run(cfg, None, log=lambda *_: None, progress=False) == 0
    rows = metrics(Path(cfg.output_dir))
    assert threads and set(threads) == {threading.main_thread().name}, threads
    built = [r["compiled_graphs"] - before for r in rows]
    # two compiled pieces over flattened rows, each one graph for every batch shape of the run
    assert built == [2] * len(rows), built
