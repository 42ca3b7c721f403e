"""Shared fixtures: a tiny random Qwen3 target built in memory (no download)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_target():
    """A frozen random Qwen3ForCausalLM: 6 layers, hidden 64, 4 heads / 2 kv heads, head_dim 16, vocab 256."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
        # Larger than HF's 0.02 so the random lm_head can express confident predictions, like a trained one.
        initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    model.requires_grad_(False)
    return model


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/data/golden_tiny_loss.json")
