"""A drafter folder serves as published DFlash drafters do: public config.json keys, dflash.py for AutoModel, tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash.data.synthetic import WORD_TOKENIZER_IDS, hybrid_target_config, write_target
from dflash.models.attention import build_layer_masks
from dflash.models.drafter import DFlashDrafter, drafter_config_from_target

REPO = Path(__file__).resolve().parent.parent

# The keys of the published Qwen3.6-27B DFlash drafter's config.json (SpecForge configs/qwen3.6-27b-dflash.json).
PUBLIC_KEYS = {
    "architectures", "attention_bias", "attention_dropout", "auto_map", "block_size", "bos_token_id", "dflash_config",
    "dtype", "eos_token_id", "head_dim", "hidden_act", "hidden_size", "initializer_range", "intermediate_size",
    "layer_types", "max_position_embeddings", "max_window_layers", "model_type", "num_attention_heads",
    "num_hidden_layers", "num_key_value_heads", "num_target_layers", "pad_token_id", "rms_norm_eps", "sliding_window",
    "tie_word_embeddings", "transformers_version", "use_cache", "use_sliding_window", "vocab_size", "rope_theta",
    "rope_scaling",
}  # fmt: skip

FRESH_PROCESS = """
import sys, torch
from transformers import AutoModel
folder, inputs, out = sys.argv[1:]
model = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
assert type(model).__name__ == "DFlashDraftModel", type(model)
x = torch.load(inputs)
with torch.no_grad():
    torch.save(model(x["noise"], x["context"], x["position_ids"]), out)
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny hybrid target folder (config + word tokenizer) and a sliding, own-shaped drafter exported against it."""
    root = tmp_path_factory.mktemp("export")
    target = write_target(root / "target", hybrid_target_config(num_hidden_layers=8, **WORD_TOKENIZER_IDS), weights=False,
                          tokenizer=True)
    tcfg = json.loads((target / "config.json").read_text())
    torch.manual_seed(0)
    dcfg = drafter_config_from_target(tcfg, 3, 4, [1, 4, 6], mask_token_id=5, num_attention_heads=8, num_key_value_heads=2,
                                      head_dim=8, intermediate_size=96, sliding_window=6,
                                      layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    drafter = DFlashDrafter(dcfg)
    return drafter.save_pretrained(root / "drafter", dtype=torch.bfloat16, target_dir=target), target


def test_export_writes_the_public_config_keys_tokenizer_and_ids(exported):
    folder, target = exported
    raw = json.loads((folder / "config.json").read_text())
    assert set(raw) == PUBLIC_KEYS, f"extra {sorted(set(raw) - PUBLIC_KEYS)}, missing {sorted(PUBLIC_KEYS - set(raw))}"
    assert raw["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"} and (folder / "dflash.py").is_file()
    assert raw["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert (raw["sliding_window"], raw["use_sliding_window"], raw["dtype"]) == (6, True, "bfloat16")
    assert (raw["eos_token_id"], raw["pad_token_id"], raw["bos_token_id"]) == (1, 0, None)
    assert raw["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": [1, 4, 6]}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).read_bytes() == (target / name).read_bytes()
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    # Our own loader reads it back with the ids kept.
    again = DFlashDrafter.from_pretrained(folder)
    assert again.config.extra["eos_token_id"] == 1 and again.config.layer_types == raw["layer_types"]


def test_automodel_in_a_fresh_process_gives_the_trainers_outputs(exported, tmp_path):
    folder, _ = exported
    drafter = DFlashDrafter.from_pretrained(folder, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    B, S, bs, H = 2, 13, 4, 64  # S > window: the sliding layers cut the context
    context = torch.randn(B, S, 3 * H, generator=g)
    noise = torch.randn(B, bs, H, generator=g)
    position_ids = torch.arange(S + bs).expand(B, -1)
    anchors, valid = torch.full((B, 1), S), torch.ones(B, 1, dtype=torch.bool)
    masks = build_layer_masks(anchors, valid, S, bs, "cpu", "sdpa", drafter.config.layer_types, drafter.config.sliding_window)
    with torch.no_grad():
        want = drafter(context, noise, position_ids[:, :S], position_ids[:, S:], masks)
    torch.save({"noise": noise, "context": context, "position_ids": position_ids}, tmp_path / "inputs.pt")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(folder), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = torch.load(tmp_path / "out.pt")
    assert got.shape == want.shape == (B, bs, H)
    diff = float((got - want).abs().max())
    assert torch.equal(got, want), f"AutoModel vs trainer drafter: max abs diff {diff:.3e}"
