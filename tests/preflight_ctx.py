"""The machine preflight's check tests judge: every fact a check reads, healthy, for a test to break one."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from dflash.config import config_from_dict
from dflash.data.identity import ValueStats
from dflash.models.weights import weights_in
from dflash.runs import compile_artifact
from preflight.facts.context import Context
from preflight.facts.dataset import Dataset, Shard
from preflight.facts.environment import TorchBuild
from preflight.facts.gpus import GpuFacts
from preflight.facts.paths import PathEntry
from preflight.facts.run import Disk, RunDir, target_shape
from preflight.facts.source import CompileCache, ModelSource
from preflight.nvml import snapshot_from_dict
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


# The shape classes a run's warm-up took (dflash.data.plan.shape_classes), as facts: preflight computes them from the
# dataset's lengths (tests/test_preflight_facts.py); here they are given.
CLASSES = [["rows >= 2", 16, 3072], ["rows >= 2", 2, 24000], ["one row", 1, 41000]]
TARGET = {"model_type": "qwen3", "num_layers": 36, "hidden": 4096, "vocab_size": 151936}


def warm_artifact(tmp_path: Path, cfg) -> CompileCache:
    """The compile cache artifact --warm-cache made on this machine for this run (torch 2.10.0+cu128, triton 3.6.0,
    an H200), 353 MB, its starts measured: cold 120.4 s, warm 45.2 s."""
    run = compile_artifact.run_facts(cfg, TARGET, CLASSES)
    manifest = {"torch": "2.10.0+cu128", "triton": "3.6.0", "gpu_name": "NVIDIA H200", "compute_capability": "9.0",
                **copy.deepcopy(run), "cold": {"seconds": 120.4}, "warm": {"seconds": 45.2}}
    return CompileCache(str(tmp_path / "cache.artifacts" / "run.dfcache"), True, size_bytes=353_000_000,
                        manifest=manifest, run=run)


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
        compile_cache=warm_artifact(tmp_path, cfg),
        run_dir=RunDir(cfg.output_dir, False, True),
        dataset=healthy_dataset(cfg.data.path, shape),
        disk=Disk(cfg.output_dir, free_bytes=500 * GiB),
        target_shape=shape, target_error=shape_error, target_weights=weights_in(cfg.target.path),
        host={"pid": 4242},
    )
    return ctx


def by_id(results, check_id):
    return next(r for r in results if r.id == check_id)
