"""Co-located data parallel with the drafter sharded by FSDP2 (train.data_parallel = "fsdp2"), on CPU over gloo:
2 and 4 real processes, each a target and 1/N of the drafter, launched by dflash-train. Exact against one process
over the same batches; its checkpoints are the files a one-process run writes, so one process resumes them."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from dflash.runs import rundir
from dflash.runs.verify import verify_checkpoint
from dflash.train.trainer import run
from trainkit import REPO, metrics, tiny_config, train_cmd, write_toml


def fsdp2_raw(raw: dict, ranks: int, output_dir: Path | None = None) -> dict:
    raw = json.loads(json.dumps(raw))
    raw["topology"] = {"colocated_gpus": [str(i) for i in range(ranks)], "timeout_s": 60}
    raw["train"]["data_parallel"] = "fsdp2"
    if output_dir is not None:
        raw["output_dir"] = str(output_dir)
    return raw


@pytest.fixture(scope="module")
def finished_fsdp2(tmp_path_factory):
    """A finished 6-step 2-rank FSDP2 run (saves at 3 and 6): (its run config, raw config, completed process)."""
    root = tmp_path_factory.mktemp("fsdp2")
    cfg, raw = tiny_config(root, max_steps=6, save_every=3)
    config = write_toml(fsdp2_raw(raw, 2), root / "fsdp2.toml")
    out = subprocess.run(train_cmd(config, "--fresh"), cwd=REPO, capture_output=True, text=True, timeout=300)
    return cfg, raw, out


def reference(root: Path, steps: int, grad_accum: int) -> dict[int, float]:
    """step -> loss of one process training the same global batches (grad_accum of them a step)."""
    cfg, _ = tiny_config(root, max_steps=steps, grad_accum=grad_accum)
    assert run(cfg, None, log=lambda *_: None, progress=False) == 0
    return {r["step"]: r["loss"] for r in metrics(Path(cfg.output_dir))}


def test_two_fsdp2_ranks_match_one_process_and_write_one_full_state(tmp_path, finished_fsdp2):
    cfg, _, out = finished_fsdp2
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "2 data-parallel drafter ranks, fsdp2 (as configured)" in out.stdout, out.stdout[-3000:]
    assert "Traceback" not in out.stderr
    ref = reference(tmp_path / "ref", 6, 2)
    got = metrics(Path(cfg.output_dir))
    assert [r["step"] for r in got] == list(range(1, 7))
    for r in got:
        assert r["loss"] == pytest.approx(ref[r["step"]], rel=1e-4), (r["step"], r["loss"], ref[r["step"]])
    checkpoints = rundir.list_checkpoints(cfg.output_dir)
    assert [c.name for c in checkpoints] == ["step_00000003", "step_00000006"]
    for c in checkpoints:
        verify_checkpoint(c)
    # the files of a one-process run: plain tensors of the full shapes, no sharded state
    from safetensors.torch import load_file

    full = load_file(str(checkpoints[-1] / rundir.DRAFTER_DIR / "model.safetensors"))
    exported = load_file(str(Path(cfg.output_dir) / rundir.DRAFTER_DIR / "model.safetensors"))
    assert full.keys() == exported.keys()
    import torch

    from dflash.models.drafter import DFlashDrafter

    one = DFlashDrafter.from_pretrained(checkpoints[-1] / rundir.DRAFTER_DIR)
    assert {k: v.shape for k, v in one.state_dict().items()} == {k: v.shape for k, v in full.items()}
    opt = torch.load(checkpoints[-1] / rundir.OPTIMIZER_NAME, weights_only=True)
    params = list(one.parameters())
    assert all(opt["state"][i]["exp_avg"].shape == p.shape for i, p in enumerate(params))


def test_one_process_resumes_an_fsdp2_checkpoint_with_the_same_losses(tmp_path, finished_fsdp2):
    """Step 3 of the 2-rank FSDP2 run resumed by one process accumulating 2 batches: steps 4-6 repeat its losses
    (a checkpoint is one full state, whatever world size wrote it)."""
    cfg, raw, out = finished_fsdp2
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    full = {r["step"]: r["loss"] for r in metrics(Path(cfg.output_dir))}
    again = tmp_path / "again"
    (again / "checkpoints").mkdir(parents=True)
    shutil.copytree(Path(cfg.output_dir) / "checkpoints" / "step_00000003", again / "checkpoints" / "step_00000003")
    one, _ = tiny_config(tmp_path / "one", max_steps=6, grad_accum=2)
    one = one.model_copy(update={"output_dir": str(again), "data": cfg.data, "target": cfg.target})
    assert run(one, again / "checkpoints" / "step_00000003", log=lambda *_: None, progress=False) == 0
    got = metrics(again)
    assert [r["step"] for r in got] == [4, 5, 6]
    for r in got:
        assert r["loss"] == pytest.approx(full[r["step"]], rel=1e-4), (r["step"], r["loss"], full[r["step"]])


@pytest.mark.slow
def test_four_fsdp2_ranks_match_one_process(tmp_path):
    cfg, raw = tiny_config(tmp_path / "run4", max_steps=3, save_every=3)
    config = write_toml(fsdp2_raw(raw, 4), tmp_path / "fsdp2x4.toml")
    out = subprocess.run(train_cmd(config, "--fresh"), cwd=REPO, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ref = reference(tmp_path / "ref", 3, 4)
    got = metrics(Path(cfg.output_dir))
    assert [r["step"] for r in got] == [1, 2, 3]
    for r in got:
        assert r["loss"] == pytest.approx(ref[r["step"]], rel=1e-4), (r["step"], r["loss"], ref[r["step"]])
