"""Shared fixtures: a tiny random Qwen3 target built in memory (no download)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_target():
    """A frozen random Qwen3ForCausalLM: 6 layers, hidden 64, 4 heads / 2 kv heads, head_dim 16, vocab 256."""
    from dflash.synthetic import random_target, target_config
    from dflash.target import freeze

    # initializer_range larger than HF's 0.02 so the random lm_head can express confident predictions.
    config = target_config("qwen3", vocab_size=256, num_hidden_layers=6, initializer_range=0.1)
    return freeze(random_target(config, seed=0))


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/data/golden_tiny_loss.json")
