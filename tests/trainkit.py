"""The one helper module of the tests: the tiny training preset and chat target (over dflash.data.synthetic), and
the ways a test runs the trainer: in this process (`run`), or as the real command in a child process (`train_cmd`,
`train_main_here`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from dflash.config import config_from_dict
from dflash.data.synthetic import WORD_TOKENIZER_IDS, target_config, write_pattern_dataset, write_target

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


REPO = Path(__file__).resolve().parent.parent
WAIVE_SOURCE = ("--waive", "model-source", "--reason", "tests run on a working tree")


def metrics(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train_cmd(config: Path, *extra: str) -> list[str]:
    """argv of the real dflash-train in a child process (model-source waived: tests run on a working tree)."""
    return [sys.executable, "-m", "dflash.commands.train", "--config", str(config), "--no-progress", *WAIVE_SOURCE,
            *extra]


def train_main_here(config: Path, *args: str) -> int:
    """dflash-train in this process (torch imported once); the profile variables it sets are undone after."""
    from dflash.commands.train import train_main

    environ = dict(os.environ)
    try:
        with pytest.raises(SystemExit) as e:
            train_main(["--config", str(config), "--no-progress", *args])
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return e.value.code
