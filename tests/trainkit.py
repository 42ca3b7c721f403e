"""Helpers for trainer tests: a tiny real target on disk and a small learnable Arrow dataset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dflash.config import config_from_dict
from dflash.data import write_shard

VOCAB = 128


def tiny_target_dir(root: Path, seed: int = 0) -> Path:
    """A real Qwen3ForCausalLM (random weights, 4 layers, hidden 64) saved as an HF folder."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = root / "tiny-target"
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=False, pad_token_id=0, initializer_range=0.15)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


def pattern_dataset(root: Path, samples: int = 64, seed: int = 0, shards: int = 2) -> Path:
    """Sequences over 12 of the vocabulary's tokens with x[i+1] = x[i] + step (mod 12): learnable from context."""
    rng = np.random.default_rng(seed)
    path = root / "data"
    path.mkdir(parents=True, exist_ok=True)
    rows_ids, rows_mask = [], []
    for _ in range(samples):
        n = int(rng.integers(24, 64))
        step = int(rng.choice([1, 2, 3, 5]))
        start = int(rng.integers(0, 12))
        ids = [10 + (start + step * i) % 12 for i in range(n)]
        prompt = n // 3
        rows_ids.append(ids)
        rows_mask.append([0] * prompt + [1] * (n - prompt))
    per = -(-samples // shards)
    for s in range(shards):
        write_shard(path / f"shard-{s:05d}.arrow", rows_ids[s * per:(s + 1) * per], rows_mask[s * per:(s + 1) * per])
    return path


def tiny_config(root: Path, **train):
    target = tiny_target_dir(root)
    data = pattern_dataset(root)
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
