"""`dflash-train --init-from PATH`: start a fresh run from the weights of an exported DFlash drafter.

PATH is a drafter folder (config.json + model.safetensors): the `drafter/` a run exports, a
checkpoint's `drafter/`, or a public DFlash drafter (same parameter names; a `model.` prefix on
every name is accepted). Its shape must be the run's drafter shape; a mismatch is one line naming
the fields or tensors that differ. A resumed run takes its checkpoint's weights instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash.errors import DflashError

SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_hidden_layers", "block_size", "vocab_size", "target_layer_ids", "mask_token_id")


class InitFromError(DflashError):
    """--init-from a folder that is not a drafter of this run's shape; one line."""

    exit_code = 2


def read_init_config(path: str | Path) -> dict:
    """config.json of an --init-from folder, checked to be a drafter folder (torch-free)."""
    folder = Path(path)
    config, weights = folder / "config.json", folder / "model.safetensors"
    if not config.is_file() or not weights.is_file():
        raise InitFromError(f"--init-from {folder}: not a drafter folder (needs config.json and model.safetensors); "
                            "give the drafter/ folder a run exports, or a public DFlash drafter's folder")
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InitFromError(f"--init-from {config}: not readable JSON ({' '.join(str(e).split())[:120]})") from None
    if not isinstance(raw, dict):
        raise InitFromError(f"--init-from {config}: not a JSON object")
    return raw


def load_init(drafter, path: str | Path) -> str:
    """Copy the folder's weights into `drafter` after checking its shape; returns a line for the log."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from dflash.models.drafter import DFlashConfig

    folder = Path(path)
    raw = read_init_config(folder)
    try:
        theirs = DFlashConfig.from_hf_dict(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise InitFromError(f"--init-from {folder}: config.json is not a DFlash drafter's ({' '.join(str(e).split())[:160]})") from None
    ours = drafter.config
    diff = [f"{f} {getattr(theirs, f)} vs the run's {getattr(ours, f)}" for f in SHAPE_FIELDS
            if getattr(theirs, f) != getattr(ours, f)]
    if diff:
        raise InitFromError(f"--init-from {folder}: drafter shape differs from this run's: {'; '.join(diff)}; "
                            "set [drafter] (and the target) to match it, or start from random weights")
    try:
        state = load_file(str(folder / "model.safetensors"), device="cpu")
    except (OSError, SafetensorError, RuntimeError, ValueError) as e:
        raise InitFromError(f"--init-from {folder}/model.safetensors: unreadable ({' '.join(str(e).split())[:120]})") from None
    if state and all(k.startswith("model.") for k in state):
        state = {k.removeprefix("model."): v for k, v in state.items()}
    own = drafter.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
             if k in state and state[k].shape != v.shape]
    if missing or unexpected or wrong:
        parts = ([f"missing {missing[:3]}"] if missing else []) + ([f"unexpected {unexpected[:3]}"] if unexpected else []) \
            + ([f"shapes {wrong[:3]}"] if wrong else [])
        raise InitFromError(f"--init-from {folder}/model.safetensors: tensors do not fit this drafter ({'; '.join(parts)})")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(state[k].to(v.dtype))
    return f"initialised from {folder} ({len(own)} tensors, {ours.num_hidden_layers} layers, block {ours.block_size})"
