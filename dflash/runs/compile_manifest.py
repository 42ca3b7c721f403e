"""The compile-cache manifest: what a warm inductor cache was compiled for.

`dflash-train --warm-cache` compiles the kernels for a run's shapes into the profile's cache
dir and writes ``<cache dir>/dflash-manifest.json``; preflight's `compile-cache` check reads it
back and compares it with the machine and run it is about to start. This module is the only
place that knows the file's name and fields (torch-free: preflight imports it).

    write_manifest(cache_dir, {"torch": "2.10.0+cu128", "triton": "3.6.0", "gpu_name": "NVIDIA H200",
                               "compute_capability": "9.0", "drafter_hash": cfg.drafter_hash(),
                               "target_hash": cfg.target_hash()})
    manifest, problem = dflash.data.identity.read_manifest(cache_dir, MANIFEST_NAME)  # the one manifest reader
    differences(manifest, now)            # ["torch 2.10.0+cu128 -> 2.11.0+cu130", ...]
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

MANIFEST_NAME = "dflash-manifest.json"
# What the compiled kernels depend on; a change in any of them makes the cache cold again.
FIELDS = (
    "torch",  # torch version with local label, e.g. 2.10.0+cu128
    "triton",  # triton version
    "gpu_name",  # the GPU's name as CUDA/NVML report it
    "compute_capability",  # major.minor, e.g. 9.0
    "drafter_hash",  # RunConfig.drafter_hash(): the drafter shapes the kernels were compiled for
    "target_hash",  # RunConfig.target_hash(): the target's compiled layers and the batch shapes warmed
)


def manifest_path(cache_dir: str | Path) -> Path:
    return Path(cache_dir) / MANIFEST_NAME


def write_manifest(cache_dir: str | Path, facts: Mapping[str, object]) -> Path:
    """Write the manifest for a freshly compiled cache (atomically); ``facts`` holds every field of FIELDS."""
    missing = [k for k in FIELDS if k not in facts]
    assert not missing, f"compile manifest needs {missing}"
    path = manifest_path(cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({k: facts[k] for k in FIELDS}, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def differences(manifest: Mapping[str, object], now: Mapping[str, object]) -> list[str]:
    """``"field old -> new"`` for every field of ``now`` the manifest records differently (compared as text)."""
    return [f"{k} {manifest.get(k)!s} -> {v!s}" for k, v in now.items() if str(manifest.get(k)) != str(v)]
