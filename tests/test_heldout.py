"""[eval] during training, checkpoints/best, --init-from and --report-to on a tiny CPU run (one shared run dir)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.config import ConfigError, config_from_dict
from dflash.data.batching import collate
from dflash.data.buckets import BucketBatchSampler
from dflash.data.plan import schedule
from dflash.data.shards import ShardDataset
from dflash.eval.speculative import Decoder
from dflash.models.drafter import DFlashDrafter
from dflash.models.target import load_target
from dflash.runs import checkpoint as ckpt
from dflash.runs import rundir
from dflash.runs.verify import checkpoint_problem, read_meta, record_files
from dflash.train.heldout import BATCH_INDEX_OFFSET, prompt_of
from dflash.train.loss import block_inputs, read_metrics, sample_anchors, slot_weights, train_step_math
from dflash.train.step import anchor_generator
from dflash.train.trainer import Trainer, run
from trainkit import WAIVE_SOURCE, tiny_config, train_main_here, write_toml

REPO = Path(__file__).resolve().parent.parent
EVAL = {"holdout": 8, "every": 4, "real_prompts": 2, "max_new_tokens": 8, "ddtree_budget": 6}


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """A 12-step tiny run with held-out eval every 4 steps, tensorboard on, keep_last 1."""
    root = tmp_path_factory.mktemp("heldout")
    _, raw = tiny_config(root, max_steps=12, save_every=100, keep_last=1)
    raw["eval"] = dict(EVAL)
    raw["report_to"] = ["tensorboard"]
    cfg = config_from_dict(raw)
    assert run(cfg, None, log=lambda *_: None, progress=False) == 0
    return cfg, raw


def test_heldout_numbers_equal_a_separate_eval_of_the_same_checkpoint(evaluated):
    cfg, _ = evaluated
    out = Path(cfg.output_dir)
    last = [r for r in rows(out) if "heldout_accept_len" in r][-1]
    assert last["step"] == 12 and [r["step"] for r in rows(out) if "heldout_loss" in r] == [4, 8, 12]
    path = rundir.list_checkpoints(out)[-1]
    assert path.name == "step_00000012"
    assert json.loads((path / "meta.json").read_text())["heldout"]["heldout_accept_len"] == last["heldout_accept_len"]

    # dflash-eval's way: the checkpoint's drafter folder and the target, loaded on their own
    drafter = DFlashDrafter.from_pretrained(path / "drafter", dtype=torch.float32).eval()
    target = load_target(cfg.target.path, "float32", "cpu")
    ids = json.loads((out / "heldout.json").read_text())["sample_ids"]
    data = ShardDataset(cfg.data.path)
    lengths = data.lengths[ids]
    batches = BucketBatchSampler(lengths, cfg.data.token_budget, cfg.data.max_batch_size, cfg.data.num_buckets,
                                 cfg.train.seed).epoch_batches(0)
    accept = blocks = loss = weight = 0.0
    for i, b in enumerate(batches):
        batch = collate(data, [ids[j] for j in b], 0)
        gen = anchor_generator(cfg, torch.device("cpu"), BATCH_INDEX_OFFSET + i)
        with torch.no_grad():
            step_loss, m = train_step_math(drafter, target, batch, cfg, gen, "sdpa")
        (m,) = read_metrics([m])
        anchors, valid = sample_anchors(batch["loss_mask"], cfg.train.max_anchors, 4,
                                        anchor_generator(cfg, torch.device("cpu"), BATCH_INDEX_OFFSET + i))
        _, _, label_valid, _ = block_inputs(batch["input_ids"], anchors, 4, drafter.config.mask_token_id,
                                            batch["loss_mask"], valid)
        w = float((slot_weights(4, cfg.train.gamma).repeat(anchors.shape[1])[None] * label_valid).sum())
        accept, blocks, loss, weight = accept + m["accept_len"] * m["blocks"], blocks + m["blocks"], loss + float(step_loss) * w, weight + w
    assert last["heldout_accept_len"] == pytest.approx(accept / blocks, rel=1e-6)
    assert last["heldout_loss"] == pytest.approx(loss / weight, rel=1e-5)
    assert last["heldout_blocks"] == blocks and last["heldout_samples"] == len(ids) == EVAL["holdout"]

    # real speculative decoding of the first held-out prompts, lossless against target-only greedy
    prompts = [prompt_of(*data.get(i)) for i in ids[:2]]
    eos = [target.generation_config.eos_token_id] if target.generation_config.eos_token_id is not None else []
    spec, base = Decoder(target, drafter, eos), Decoder(target, None, eos)
    accepts, lossless = [], True
    for p in prompts:
        tokens, acc = spec.speculative(p, EVAL["max_new_tokens"], 4)
        accepts += acc
        lossless &= tokens == base.greedy(p, EVAL["max_new_tokens"])[0]
    assert last["heldout_real_accept_len"] == pytest.approx(sum(accepts) / len(accepts))
    assert last["heldout_real_lossless"] is True and lossless
    # and DDTree decoding of the same prompts at eval.ddtree_budget nodes, as dflash-eval --ddtree 6 does it
    from dflash.eval.ddtree import ddtree_decode

    tree_accepts = []
    for p in prompts:
        tokens, acc, nodes = ddtree_decode(spec, p, EVAL["max_new_tokens"], 4, 6)
        tree_accepts += acc
        assert tokens == base.greedy(p, EVAL["max_new_tokens"])[0] and set(nodes) == {6}
    assert last["heldout_ddtree_accept_len"] == pytest.approx(sum(tree_accepts) / len(tree_accepts), abs=1e-3)
    assert last["heldout_ddtree_lossless"] is True and last["heldout_ddtree_mode"] == "verified"


def test_heldout_samples_are_never_trained_on(evaluated):
    cfg, _ = evaluated
    held = set(json.loads((Path(cfg.output_dir) / "heldout.json").read_text())["sample_ids"])
    dataset, sampler, _ = schedule(cfg, 1)
    trained = {int(dataset.ids[i]) for e in range(3) for b in sampler.epoch_batches(e) for i in b}
    assert held and not held & trained and held | trained == set(range(64))


def test_best_points_at_the_best_heldout_step_and_survives_keep_last(evaluated):
    cfg, _ = evaluated
    out = Path(cfg.output_dir)
    evals = [r for r in rows(out) if "heldout_accept_len" in r]
    best_row = max(evals, key=lambda r: (r["heldout_accept_len"], -r["step"]))  # the first of equal maxima
    best = rundir.best_checkpoint(out)
    assert best is not None and best.name == rundir.checkpoint_name(best_row["step"])
    assert os.readlink(out / "checkpoints" / "best") == best.name  # relative: the run dir can move
    assert best in rundir.list_checkpoints(out)  # keep_last = 1 kept it beside the last
    # eval.export = best: the exported drafter is best's weights (in bf16, as published drafters are)
    from safetensors.torch import load_file

    exported, kept = load_file(str(out / "drafter" / "model.safetensors")), load_file(str(best / "drafter" / "model.safetensors"))
    assert exported.keys() == kept.keys()
    assert all(torch.equal(exported[k], kept[k].to(torch.bfloat16)) for k in kept)


class _Tiny:
    """Just enough of a drafter for save_checkpoint."""

    def save_pretrained(self, folder):
        Path(folder).mkdir(parents=True)
        (Path(folder) / "model.safetensors").write_bytes(b"x")


def test_keep_last_never_prunes_best(tmp_path):
    cfg, _ = tiny_config(tmp_path)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    out = tmp_path / "run"
    first = ckpt.save_checkpoint(out, 1, _Tiny(), opt, {"step": 1}, cfg, {}, keep_last=1)
    rundir.set_best(out, first)
    for step in (2, 3, 4):
        ckpt.save_checkpoint(out, step, _Tiny(), opt, {"step": step}, cfg, {}, keep_last=1)
    assert [p.name for p in rundir.list_checkpoints(out)] == ["step_00000001", "step_00000004"]
    assert rundir.best_checkpoint(out) == first


def test_best_survives_kill_9_during_its_update(tmp_path):
    """A process replacing the pointer as fast as it can, killed at random instants: best is always one of the two."""
    out = tmp_path / "run"
    for step in (1, 2):
        folder = rundir.checkpoint_path(out, step)
        folder.mkdir(parents=True)
        (folder / "meta.json").write_text("{}")
    code = ("import sys; from dflash.runs import rundir\n"
            "rundir.set_best(sys.argv[1], 'step_00000001'); print('go', flush=True)\n"
            "while True:\n"
            "    for s in ('step_00000002', 'step_00000001'): rundir.set_best(sys.argv[1], s)\n")
    rng = np.random.default_rng(0)
    for _ in range(4):
        proc = subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=REPO, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "go"
        time.sleep(float(rng.uniform(0.01, 0.2)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        best = rundir.best_checkpoint(out)
        assert best is not None and best.name in ("step_00000001", "step_00000002")
    rundir.set_best(out, "step_00000002")  # a stale half-update of the killed process is cleaned up
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")] == []
    assert rundir.best_checkpoint(out).name == "step_00000002"


def test_the_export_never_ships_a_best_that_leads_out_of_the_run_dir(evaluated, tmp_path, capsys):
    """checkpoints/best pointing at another run's checkpoint (which verifies on its own): the final export says so in
    one line and ships this run's last step, not the foreign weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    cfg, raw = evaluated
    run_dir, other = tmp_path / "run", tmp_path / "other"
    shutil.copytree(cfg.output_dir, run_dir, symlinks=True)
    shutil.copytree(cfg.output_dir, other, symlinks=True)
    shutil.rmtree(run_dir / "drafter")  # the export to come
    foreign = rundir.checkpoint_path(other, 12)
    weights = foreign / "drafter" / "model.safetensors"
    save_file({k: v + 1.0 for k, v in load_file(str(weights)).items()}, str(weights), metadata={"format": "pt"})
    meta = read_meta(foreign)
    meta[rundir.FILES_KEY] = record_files(foreign)
    (foreign / rundir.META_NAME).write_text(json.dumps(meta))
    assert checkpoint_problem(foreign, deep=True) is None  # a sound checkpoint, just not this run's
    best = rundir.checkpoints_dir(run_dir) / rundir.BEST_NAME
    best.unlink()
    best.symlink_to(os.path.relpath(foreign, best.parent))
    config = write_toml(raw, tmp_path / "run.toml")
    assert train_main_here(config, "--resume", "latest", "--output-dir", str(run_dir), *WAIVE_SOURCE) == 0
    out = capsys.readouterr().out
    assert (f"export: not using checkpoints/best: {best} points outside {best.parent} (to {os.readlink(best)}); "
            "exporting the last step (12) instead") in out.splitlines(), out
    exported = load_file(str(run_dir / "drafter" / "model.safetensors"))
    own = load_file(str(rundir.checkpoint_path(run_dir, 12) / "drafter" / "model.safetensors"))
    assert exported.keys() == own.keys()
    assert all(torch.equal(exported[k], own[k].to(torch.bfloat16)) for k in own)


def test_report_to_tensorboard_writes_readable_event_files(evaluated):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, _ = evaluated
    acc = EventAccumulator(str(Path(cfg.output_dir) / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "accept_len", "lr", "heldout_accept_len", "heldout_loss", "acc_slot/1"} <= tags
    logged = {r["step"]: r for r in rows(Path(cfg.output_dir))}
    assert [e.step for e in acc.Scalars("loss")] == sorted(s for s, r in logged.items() if "loss" in r)
    assert acc.Scalars("heldout_accept_len")[-1].value == pytest.approx(logged[12]["heldout_accept_len"], rel=1e-6)


def test_missing_tracker_package_is_exit_2_and_one_line(evaluated, tmp_path, capsys, monkeypatch):
    from dflash.commands.train import train_main

    _, raw = evaluated
    config = tmp_path / "run.toml"
    config.write_text("\n".join([f'output_dir = "{tmp_path / "out"}"', 'device = "cpu"', "[target]",
                                 f'path = "{raw["target"]["path"]}"', "[data]", f'path = "{raw["data"]["path"]}"']) + "\n")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        train_main(["--config", str(config), "--report-to", "tensorboard,wandb"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "--report-to wandb: the wandb package is not installed" in err
    assert not (tmp_path / "out").exists()


def test_init_from_loads_the_weights_and_refuses_another_shape(evaluated, tmp_path):
    cfg, raw = evaluated
    folder = Path(cfg.output_dir) / "drafter"
    raw = dict(raw, output_dir=str(tmp_path / "warm"), init_from=str(folder), report_to=[])
    raw.pop("eval")
    trainer = Trainer.colocated(config_from_dict(raw), log=lambda *_: None)
    loaded = DFlashDrafter.from_pretrained(folder, dtype=torch.float32)
    for (name, a), (_, b) in zip(trainer.drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    other = dict(raw, drafter={"num_layers": 1, "block_size": 8})
    from dflash.train.warmstart import InitFromError

    with pytest.raises(InitFromError, match=r"block_size 4 vs the run's 8") as e:
        Trainer.colocated(config_from_dict(other), log=lambda *_: None)
    assert "\n" not in str(e.value)


def test_eval_in_a_split_run_is_one_line(evaluated):
    _, raw = evaluated
    with pytest.raises(ConfigError, match=r"\[eval\] works in co-located runs only"):
        config_from_dict(dict(raw, topology={"target_gpus": ["0"], "drafter_gpus": ["1"]}))
    with pytest.raises(ConfigError, match="not both"):
        config_from_dict(dict(raw, eval={"holdout": 4, "path": "x"}))


def test_best_can_be_chosen_by_ddtree_acceptance(tmp_path):
    """eval.best_by = "ddtree": checkpoints/best is the evaluation with the highest heldout_ddtree_accept_len (what a
    DDTree deployment gets), and the run says so; without ddtree_budget the config is refused in one line."""
    _, raw = tiny_config(tmp_path, max_steps=8, save_every=100, keep_last=1)
    raw["eval"] = {**EVAL, "best_by": "ddtree"}
    cfg = config_from_dict(raw)
    lines = []
    assert run(cfg, None, log=lines.append, progress=False) == 0
    out = Path(cfg.output_dir)
    evals = [r for r in rows(out) if "heldout_ddtree_accept_len" in r]
    assert [r["step"] for r in evals] == [4, 8]
    best_row = max(evals, key=lambda r: (r["heldout_ddtree_accept_len"], -r["step"]))
    assert rundir.best_checkpoint(out).name == rundir.checkpoint_name(best_row["step"])
    assert any("checkpoints/best by heldout_ddtree_accept_len" in line for line in lines)
    with pytest.raises(ValueError, match="eval.best_by = 'ddtree' chooses by DDTree acceptance: set "
                                         "eval.ddtree_budget >= 1"):
        config_from_dict({**raw, "eval": {**EVAL, "ddtree_budget": 0, "best_by": "ddtree"}})
