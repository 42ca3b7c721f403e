"""Where fla's kept autotuning choices live and how they are read: no torch, no Triton (preflight reads them).

The choices themselves, harvested and set in fla's autotuners: dflash.models.fla_tuning.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

KEPT = Path(__file__).with_name("fla_tuned")
ENV = "DFLASH_FLA_TUNED"  # FILE: seed from FILE instead of the GPU's kept file; off: seed nothing


def kept_path(gpu_name: str) -> Path:
    """This GPU model's file of kept choices ("NVIDIA H100 80GB HBM3" -> fla_tuned/NVIDIA_H100_80GB_HBM3.json)."""
    return KEPT / f"{re.sub(r'[^0-9A-Za-z]+', '_', gpu_name).strip('_') or 'unknown'}.json"


def chosen_file(gpu_name: str, environ) -> Path | None:
    """The file a run on this GPU model seeds fla's autotuners from: DFLASH_FLA_TUNED's, else the model's kept file;
    None when DFLASH_FLA_TUNED=off."""
    choice = environ.get(ENV, "")
    if choice.lower() == "off":
        return None
    return Path(choice) if choice else kept_path(gpu_name)


def unusable(kept: dict, gpu_name: str, triton: str | None, fla: str | None) -> str | None:
    """Why choices kept on another machine state cannot seed this one (fla's configs differ per GPU model; another
    Triton or fla may build other kernels behind the same names), None when they can."""
    if kept.get("gpu_name") not in (None, gpu_name):
        return f"was tuned on {kept['gpu_name']}, this is {gpu_name}"
    if kept.get("triton") != triton:
        return f"was tuned with Triton {kept.get('triton')}, this is {triton}"
    if kept.get("fla") != fla:
        return f"was tuned with fla {kept.get('fla')}, this is {fla}"
    return None


def read_kept(path: Path) -> tuple[dict | None, str | None]:
    """(the kept choices in `path`, a harvest as JSON, None) or (None, why not)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"unreadable ({type(e).__name__})"
    if not isinstance(data, dict) or not isinstance(data.get("kernels"), dict):
        return None, "not a harvest of fla's choices (no 'kernels')"
    for name, kernel in data["kernels"].items():
        entries = kernel.get("entries") if isinstance(kernel, dict) else None
        if not isinstance(entries, list) or not all(_entry(e) for e in entries):
            return None, f"malformed: {name}'s entries are not [{{'key': [...], 'config': {{'kwargs': ..., ...}}}}]"
    return data, None


def _entry(entry) -> bool:
    """One kept choice as harvest writes it: a key of plain values, a config of kwargs, warps and stages."""
    if not isinstance(entry, dict) or not isinstance(entry.get("key"), list):
        return False
    config = entry.get("config")
    return all(v is None or isinstance(v, (bool, int, float, str)) for v in entry["key"]) and \
        isinstance(config, dict) and isinstance(config.get("kwargs"), dict) and \
        isinstance(config.get("num_warps"), int) and isinstance(config.get("num_stages"), int)
