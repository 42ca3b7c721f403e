"""Test fixtures over dflash.synthetic: the tiny training preset and the tiny chat target."""

from __future__ import annotations

import json
from pathlib import Path

from dflash.config import config_from_dict
from dflash.synthetic import WORD_TOKENIZER_IDS, target_config, write_pattern_dataset, write_target

# The tiny training target: vocabulary 128, pad id 0, weights drawn wider than HF's 0.02 default.
TRAIN_TARGET = target_config("qwen3", pad_token_id=0, initializer_range=0.15)


def tiny_config(root: Path, **train):
    """(run config, raw dict) of the tiny CPU preset under root; `train` overrides [train] fields."""
    target = write_target(root / "tiny-target", TRAIN_TARGET)
    data = write_pattern_dataset(root / "data")
    raw = {
        "output_dir": str(root / "run"),
        "device": "cpu",
        "target": {"path": str(target), "dtype": "float32"},
        "drafter": {"num_layers": 1, "block_size": 4},
        "data": {"path": str(data), "token_budget": 512, "max_batch_size": 8, "num_buckets": 2},
        "train": {"max_anchors": 16, "gamma": 4.0, "lr": 1e-2, "warmup_ratio": 0.1, "max_steps": 30,
                  "loss_chunk": 64, "log_every": 1, "save_every": 10, "keep_last": 2, "compile": False,
                  **train},
    }
    return config_from_dict(raw), raw


def chat_target(root: Path, arch: str = "llama", context: int = 256) -> Path:
    """A random-weight Llama or Qwen3 (4 layers, hidden 64) with the word-level tokenizer, under root.

    The lm_head is scaled by 8 so greedy decoding wanders instead of repeating one token forever.
    """
    config = target_config(arch, max_position_embeddings=context, **WORD_TOKENIZER_IDS)
    return write_target(Path(root) / f"tiny-{arch}-{context}", config, tokenizer=True, head_scale=8.0)


def write_toml(raw: dict, path: Path) -> Path:
    """A run config dict (one level of sections) as a TOML file, for the tests that run the real commands."""
    lines = [f"{k} = {json.dumps(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    for key, value in raw.items():
        if isinstance(value, dict):
            lines += [f"[{key}]", *(f"{k} = {json.dumps(v)}" for k, v in value.items())]
    path.write_text("\n".join(lines) + "\n")
    return path
