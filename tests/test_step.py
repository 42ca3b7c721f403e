"""The optimizer step (`dflash.train.step.clip_and_step`) and the drafter step's waits for the GPU."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from dflash.config import config_from_dict
from dflash.train.step import build_optimizer, clip_and_step


def _model_and_cfg(grad_clip: float):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    cfg = config_from_dict({"train": {"grad_clip": grad_clip, "lr": 1e-2, "weight_decay": 0.1}})
    return model, cfg


def _set_grads(model, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * scale


@pytest.mark.parametrize("grad_clip, scale", [(1.0, 10.0), (1.0, 0.01), (0.0, 10.0)])
def test_clip_in_the_fused_step_equals_clip_then_step(grad_clip, scale):
    """Clipping through the fused AdamW's grad_scale gives the weights of clip_grad_norm_ then a plain step,
    over three steps, clipped or not, and returns the pre-clip norm."""
    model, cfg = _model_and_cfg(grad_clip)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    ref.load_state_dict(model.state_dict())
    opt = build_optimizer(model, cfg)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, betas=opt.defaults["betas"])
    for step in range(3):
        _set_grads(model, scale, step)
        _set_grads(ref, scale, step)
        norm = clip_and_step(model, opt, cfg)
        ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), grad_clip)
        ref_opt.step()
        assert float(norm) == pytest.approx(float(ref_norm), rel=1e-6)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_nan_gradient_never_reaches_the_weights():
    model, cfg = _model_and_cfg(1.0)
    opt = build_optimizer(model, cfg)
    _set_grads(model, 1.0, 0)
    clip_and_step(model, opt, cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    _set_grads(model, 1.0, 1)
    next(model.parameters()).grad[0, 0] = float("nan")
    norm = clip_and_step(model, opt, cfg)
    assert not torch.isfinite(norm)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(m, opt.state[p]["exp_avg"]) for m, p in zip(moments, model.parameters()))
    assert all(int(opt.state[p]["step"]) == 1 for p in model.parameters())  # the skipped step is not counted
    _set_grads(model, 1.0, 2)
    clip_and_step(model, opt, cfg)  # the next finite step updates again
    assert not torch.equal(before["0.weight"], model.state_dict()["0.weight"])
    assert all(int(opt.state[p]["step"]) == 2 for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_drafter_step_never_waits_for_the_gpu(tmp_path):
    """Anchors, masks, the compiled drafter forward, the loss, backward and the optimizer step are all queued
    without one wait for the GPU (torch's sync debug mode raises on any): the step's metrics are read once,
    after the update (`read_metrics`)."""
    from dflash.data.batching import to_device
    from dflash.train.loss import read_metrics
    from dflash.train.step import micro_step
    from dflash.train.trainer import Trainer
    from trainkit import tiny_config

    cfg, _ = tiny_config(tmp_path, max_steps=10, compile=True, kl_weight=0.5)
    cfg.__dict__["device"] = "cuda"
    trainer = Trainer.colocated(cfg, None, log=lambda *_: None)
    stream = trainer.step_batches()
    for _ in range(3):  # compiles (and may wait) in the first steps
        trainer.train_step(next(stream)[2])
    (k, batch), *_ = next(stream)[2]
    batch = to_device(batch, trainer.device)
    features = trainer.source.features(k, batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss, m = micro_step(trainer.par.module, trainer.embed_w, trainer.head_w, batch, features, cfg,
                                 trainer.device, trainer.attn_backend, k)
            loss.backward()
            m["grad_norm"] = clip_and_step(trainer.drafter, trainer.optimizer, cfg)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    waits = [f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)]
    assert not waits, f"the step waited for the GPU at {waits}"
    stream.close()
    (m,) = read_metrics([m])
    assert m["blocks"] > 0 and m["anchors"] > 0 and m["grad_norm"] > 0


def test_one_drafter_rank_trains_without_ddp(tmp_path):
    """A drafter group of one rank has nothing to reduce: no DDP wrapper and so no gradient buckets (the memory
    model counts them only for several drafter ranks, `dflash.memory.parts.ddp_drafters`)."""
    import socket

    import torch.distributed as dist

    from dflash.train.features import local_source
    from dflash.train.trainer import Trainer
    from trainkit import tiny_config

    cfg, _ = tiny_config(tmp_path, max_steps=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        trainer = Trainer(cfg, local_source(cfg, torch.device("cpu"), log=lambda *_: None),
                          group=dist.group.WORLD, log=lambda *_: None)
        assert trainer.world == 1 and trainer.par.mode == "none"
        trainer.train_step(next(trainer.step_batches())[2])
    finally:
        dist.destroy_process_group()


def test_a_checkpoint_of_a_non_fused_adamw_resumes_fused(tmp_path):
    """CPU checkpoints written before AdamW was fused everywhere store fused=False in their param groups; loading
    one must leave the optimizer fused (clip_and_step's grad_scale / found_inf need it), and training goes on."""
    from dflash.runs import rundir
    from dflash.train.trainer import run
    from trainkit import tiny_config

    cfg, _ = tiny_config(tmp_path, max_steps=2, save_every=2)
    assert run(cfg, None, log=lambda *_: None, progress=False) == 0
    saved = rundir.list_checkpoints(Path(cfg.output_dir))[-1]
    opt_file = saved / rundir.OPTIMIZER_NAME
    state = torch.load(opt_file, weights_only=True)
    for group in state["param_groups"]:
        group["fused"] = False
    torch.save(state, opt_file)
    cfg.train.__dict__["max_steps"] = 4
    lines = []
    assert run(cfg, saved, log=lines.append, progress=False) == 0
    assert any(line.startswith(f"resumed from {saved}") for line in lines)
    assert rundir.list_checkpoints(Path(cfg.output_dir))[-1].name == "step_00000004"


def _protocol_members(protocol) -> tuple[set[str], set[str]]:
    """(methods, attributes) a Protocol declares."""
    methods = {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}
    return methods, set(protocol.__annotations__)


@pytest.mark.parametrize("name", ["dflash.train.features.LocalTarget", "dflash.train.features.CachedTarget",
                                  "dflash.train.features.RemoteTargets"])
def test_every_feature_source_has_every_member_of_the_protocol(name):
    """The trainer calls every FeatureSource member unconditionally (no hasattr probing), so every source has them
    all: the methods on the class, the attributes assigned in its constructor."""
    import importlib
    import inspect

    from dflash.train.features import FeatureSource

    module, _, cls_name = name.rpartition(".")
    cls = getattr(importlib.import_module(module), cls_name)
    methods, attributes = _protocol_members(FeatureSource)
    assert {"rates", "rates_line", "cache_bytes", "summary"} <= methods
    assert sorted(m for m in methods if getattr(cls, m, None) is None or getattr(cls, m) is getattr(FeatureSource, m)) == []
    assigned = "".join(inspect.getsource(c.__init__) for c in cls.__mro__ if "__init__" in vars(c) and c is not object)
    assert sorted(a for a in attributes if f"self.{a} =" not in assigned) == []
