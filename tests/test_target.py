"""Loading Qwen3.5-family hybrid targets (text-only folder and the vision-language wrapper) and their features."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash.memory import load_target_shape
from dflash.synthetic import hybrid_target_config, random_target, write_target
from dflash.target import load_target, target_embed_and_head, target_features, target_text_config

LAYOUTS = ("text", "wrapper")


@pytest.fixture(scope="module")
def hybrid_folders(tmp_path_factory):
    """{layout: folder} of one tiny random hybrid (8 layers, 2 of them full attention), saved in both layouts."""
    root = tmp_path_factory.mktemp("hybrid")
    fields = {"num_hidden_layers": 8, "vocab_size": 256, "initializer_range": 0.1}
    return {
        "text": write_target(root / "text", hybrid_target_config(**fields)),
        "wrapper": write_target(root / "wrapper", hybrid_target_config(wrapper=True, **fields)),
    }


def test_the_wrapper_folder_holds_the_published_layout(hybrid_folders):
    from safetensors import safe_open

    raw = json.loads((hybrid_folders["wrapper"] / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5" and raw["text_config"]["model_type"] == "qwen3_5_text"
    with safe_open(str(hybrid_folders["wrapper"] / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("model.language_model.layers.0.linear_attn.") for n in names)
    assert any(n.startswith("model.visual.") for n in names)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_target_gives_the_language_model_alone(hybrid_folders, layout):
    model = load_target(hybrid_folders[layout], "float32", "cpu")
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert not any("visual" in name for name, _ in model.named_parameters())
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    # Every parameter is the saved one (the wrapper's model.language_model.X is the model's model.X).
    stored = load_file(str(hybrid_folders[layout] / "model.safetensors"))
    stored = {k.replace("model.language_model.", "model."): v for k, v in stored.items() if "visual" not in k}
    assert stored.keys() == dict(model.named_parameters()).keys()
    assert all(torch.equal(p, stored[name]) for name, p in model.named_parameters())
    embed, head = target_embed_and_head(model)
    assert embed.shape == head.shape == (256, 64)
    assert target_text_config(hybrid_folders[layout]).num_hidden_layers == 8
    assert load_target_shape(str(hybrid_folders[layout])).num_layers == 8


@pytest.mark.parametrize("layout", LAYOUTS)
def test_random_init_from_config_builds_no_vision_tower(hybrid_folders, layout, tmp_path):
    folder = write_target(tmp_path / layout, json.loads((hybrid_folders[layout] / "config.json").read_text()), weights=False)
    model = load_target(folder, "bfloat16", "cpu", random_init=True)
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and model.lm_head.weight.dtype == torch.bfloat16
    assert not any("visual" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hybrid_features_match_hf_hidden_states(hybrid_folders, layout):
    model = load_target(hybrid_folders[layout], "float32", "cpu")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    am = torch.ones(2, 12, dtype=torch.long)
    am[1, 9:] = 0  # right padding, as the batches have
    hs = model(ids, attention_mask=am, output_hidden_states=True).hidden_states
    for layer_ids, want_last in (([1, 3, 4, 7], True), ([0, 2, 5], False)):  # with/without the last (normed) layer
        ctx, last = target_features(model, ids, am, layer_ids, want_last)
        want = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
        diff = (ctx - want).abs().max().item()
        assert diff < 1e-5, f"layers {layer_ids}: max |target_features - hidden_states| = {diff}"
        if want_last:
            assert (last - hs[-1]).abs().max().item() < 1e-5
        else:
            assert last is None


def test_hybrid_random_target_in_memory_matches_its_saved_folder(hybrid_folders):
    model = random_target(hybrid_target_config(num_hidden_layers=8, vocab_size=256, initializer_range=0.1))
    loaded = load_target(hybrid_folders["text"], "float32", "cpu")
    ids = torch.randint(0, 256, (1, 9))
    assert torch.equal(model(ids).logits, loaded(ids).logits)


@pytest.mark.parametrize("config", [
    # the real shapes: 48 Gated DeltaNet + 16 gated full-attention layers
    str(Path(__file__).resolve().parent.parent / "configs/targets/qwen3.6-27b"),
    hybrid_target_config(num_hidden_layers=8, vocab_size=256),
    hybrid_target_config(wrapper=True, num_hidden_layers=8, vocab_size=256),
])
def test_memory_model_counts_hybrid_params_as_transformers_builds_them(config):
    """dflash.memory's TargetShape (torch-free) against the parameters of the model transformers builds (on meta)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.memory import TargetShape

    raw = json.loads((Path(config) / "config.json").read_text()) if isinstance(config, str) else config
    hf = AutoConfig.from_pretrained(config) if isinstance(config, str) else AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    shape = TargetShape.from_config(raw)
    assert shape.linear_layers == 3 * shape.num_layers // 4
    assert shape.params == sum(p.numel() for p in model.parameters())
