"""Where fla's kept autotuning choices live and how they are read: no torch, no Triton (preflight reads them).

The choices themselves, harvested and set in fla's autotuners: dflash.models.fla_tuning.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

KEPT = Path(__file__).with_name("fla_tuned")


def kept_path(gpu_name: str) -> Path:
    """This GPU model's file of kept choices ("NVIDIA H100 80GB HBM3" -> fla_tuned/NVIDIA_H100_80GB_HBM3.json)."""
    return KEPT / f"{re.sub(r'[^0-9A-Za-z]+', '_', gpu_name).strip('_') or 'unknown'}.json"


def read_kept(path: Path) -> tuple[dict | None, str | None]:
    """(the kept choices in `path`, a harvest as JSON, None) or (None, why not)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"unreadable ({type(e).__name__})"
    if not isinstance(data, dict) or not isinstance(data.get("kernels"), dict):
        return None, "not a harvest of fla's choices (no 'kernels')"
    return data, None
