"""Drafter shapes and layout, target feature extraction, and exact save/load round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash.models.attention import build_train_mask
from dflash.models.drafter import DFlashDrafter, default_target_layer_ids, drafter_config_from_target
from dflash.models.target import load_target, target_embed_and_head, target_features, torch_dtype
from dflash.train.loss import block_inputs


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_target_layer_ids(40, 4) == [1, 13, 25, 37]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(6, 3) == [1, 2, 3]
    with pytest.raises(ValueError, match="cannot spread 4"):
        default_target_layer_ids(6, 4)


def _drafter(target, layers=2, block_size=4, seed=0):
    torch.manual_seed(seed)
    cfg = drafter_config_from_target(target.config, layers, block_size, mask_token_id=255)
    return DFlashDrafter(cfg)


def _inputs(target, drafter, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, S, bs = 2, 20, drafter.config.block_size
    ids = torch.randint(0, 250, (B, S), generator=g)
    anchors = torch.tensor([[2, 7, 13], [4, 10, 15]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    ctx, _ = target_features(target, ids, None, drafter.config.target_layer_ids, want_last=False)
    block_ids, _, _, qpos = block_inputs(ids, anchors, bs, drafter.config.mask_token_id)
    embed, _ = target_embed_and_head(target)
    noise = torch.nn.functional.embedding(block_ids, embed)
    cpos = torch.arange(S).expand(B, S)
    return ctx, noise, cpos, qpos, anchors, valid


def test_config_from_target(tiny_target):
    cfg = drafter_config_from_target(tiny_target.config, 3, 8, mask_token_id=255)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert cfg.target_layer_ids == [1, 2, 3] and cfg.num_target_layers == 6 and cfg.block_size == 8
    with pytest.raises(ValueError, match="mask_token_id"):
        drafter_config_from_target(tiny_target.config, 3, 8, mask_token_id=256)


def test_target_features_match_hf_hidden_states(tiny_target):
    ids = torch.randint(0, 256, (2, 12))
    am = torch.ones(2, 12, dtype=torch.long)
    am[1, 9:] = 0
    hs = tiny_target(ids, attention_mask=am, output_hidden_states=True).hidden_states
    layer_ids = [0, 2, 5]
    ctx, last = target_features(tiny_target, ids, am, layer_ids, want_last=True)
    want = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
    assert (ctx - want).abs().max() < 1e-5 and (last - hs[-1]).abs().max() < 1e-5


def test_target_features_stop_early_and_skip_lm_head(tiny_target):
    calls = []
    hooks = [
        tiny_target.model.layers[4].register_forward_hook(lambda *a: calls.append("layer4")),
        tiny_target.lm_head.register_forward_hook(lambda *a: calls.append("lm_head")),
    ]
    try:
        ctx, last = target_features(tiny_target, torch.randint(0, 256, (1, 8)), None, [1, 3], want_last=False)
    finally:
        for h in hooks:
            h.remove()
    assert calls == [] and last is None and ctx.shape == (1, 8, 128)


def test_drafter_parameters_follow_public_layout(tiny_target):
    names = set(_drafter(tiny_target, layers=1).state_dict())
    layer = "layers.0."
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        layer + n
        for n in (
            "input_layernorm.weight", "post_attention_layernorm.weight",
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "self_attn.q_norm.weight", "self_attn.k_norm.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        )
    }  # fmt: skip
    assert names == expected


def test_the_drafter_is_built_on_the_device_in_use():
    """Every tensor the drafter's constructor makes follows torch's default device (the trainer builds it on the GPU
    it trains on, instead of drawing 1.7B parameters on the host and copying them): under a meta device context,
    nothing lands on the CPU. The 27B preset's shapes."""
    from dflash.config import load_config
    from dflash.models.drafter import drafter_config_for_run
    from dflash.models.target import load_target_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs/qwen3.6-27b-5t3d.toml")
    with torch.device("meta"):
        drafter = DFlashDrafter(drafter_config_for_run(cfg, load_target_config(cfg.target.path), 248070))
    tensors = [*drafter.parameters(), *drafter.buffers()]
    assert sum(t.numel() for t in tensors) > 1.7e9 and {t.device.type for t in tensors} == {"meta"}


def test_drafter_forward_shape_and_no_leak_from_anchor(tiny_target):
    drafter = _drafter(tiny_target)
    ctx, noise, cpos, qpos, anchors, valid = _inputs(tiny_target, drafter)
    mask = build_train_mask(anchors, valid, ctx.shape[1], 4, "cpu", "sdpa")
    out = drafter(ctx, noise, cpos, qpos, mask)
    assert out.shape == (2, 12, 64)
    # Moving the anchor's own hidden state (or later ones) must not move its block.
    ctx2 = ctx.clone()
    ctx2[0, 7:] += 1.0
    out2 = drafter(ctx2, noise, cpos, qpos, mask)
    assert (out2[0, 4:8] - out[0, 4:8]).abs().max() == 0  # block 1, anchor 7
    assert (out2[0, :4] - out[0, :4]).abs().max() == 0  # block 0 (anchor 2) is also blind to 7..
    assert (out2[0, 8:] - out[0, 8:]).abs().max() > 1e-4  # block 2 (anchor 13) sees 7..12
    assert torch.equal(out2[1], out[1])
    ctx2[0, 6] += 1.0
    assert (drafter(ctx2, noise, cpos, qpos, mask)[0, 4:8] - out[0, 4:8]).abs().max() > 1e-4


def test_save_load_round_trip(tiny_target, tmp_path):
    drafter = _drafter(tiny_target)
    drafter.save_pretrained(tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["block_size"] == 4 and raw["num_target_layers"] == 6
    assert raw["dflash_config"] == {"target_layer_ids": [1, 3], "mask_token_id": 255}
    loaded = DFlashDrafter.from_pretrained(tmp_path / "d")
    assert loaded.config == drafter.config
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    ctx, noise, cpos, qpos, anchors, valid = _inputs(tiny_target, drafter)
    mask = build_train_mask(anchors, valid, ctx.shape[1], 4, "cpu", "sdpa")
    assert torch.equal(drafter(ctx, noise, cpos, qpos, mask), loaded(ctx, noise, cpos, qpos, mask))
    loaded.save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / "config.json").read_text() == (tmp_path / "d" / "config.json").read_text()


def test_from_pretrained_names_the_missing_file(tmp_path):
    with pytest.raises(ValueError, match="model.safetensors is missing"):
        (tmp_path / "config.json").write_text("{}")
        DFlashDrafter.from_pretrained(tmp_path)


def test_load_target_from_folder_and_random(tiny_target, tmp_path):
    tiny_target.save_pretrained(tmp_path / "t")
    loaded = load_target(tmp_path / "t", "float32", "cpu")
    assert not any(p.requires_grad for p in loaded.parameters()) and not loaded.training
    assert torch.equal(loaded.lm_head.weight, tiny_target.lm_head.weight)
    rand = load_target(tmp_path / "t", "bfloat16", "cpu", random_init=True)
    assert rand.lm_head.weight.dtype == torch.bfloat16
    assert not torch.equal(rand.lm_head.weight.float(), loaded.lm_head.weight)
    with pytest.raises(ValueError, match="no config.json"):
        load_target(tmp_path / "nope", "float32", "cpu")


def test_torch_dtype_maps_every_config_dtype_and_names_the_allowed_ones():
    from typing import get_args

    from dflash.config import config_from_dict

    names = get_args(type(config_from_dict({}).target).model_fields["dtype"].annotation)
    assert {n: torch_dtype(n) for n in names} == {"bfloat16": torch.bfloat16, "float16": torch.float16,
                                                  "float32": torch.float32}
    assert torch_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match=r"one of \['bfloat16', 'float16', 'float32'\], got 'fp8'"):
        torch_dtype("fp8")


def _float64_drafter_and_grads():
    """A 2-layer float64 drafter and a function giving (output, parameter gradients) of one forward + backward."""
    from dflash.models.attention import build_train_mask

    torch.manual_seed(0)
    tcfg = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "vocab_size": 50, "num_hidden_layers": 6, "rms_norm_eps": 1e-6}
    drafter = DFlashDrafter(drafter_config_from_target(tcfg, 2, 4, [1, 3], mask_token_id=49)).double()
    B, S, A, bs = 2, 12, 3, 4
    context = torch.randn(B, S, 2 * 32, dtype=torch.float64)
    noise = torch.randn(B, A * bs, 32, dtype=torch.float64)
    anchors = torch.tensor([[2, 5, 9], [1, 4, 7]])
    attn = build_train_mask(anchors, torch.ones_like(anchors, dtype=torch.bool), S, bs, "cpu", "sdpa")
    pos_q = (anchors[:, :, None] + torch.arange(bs)).reshape(B, -1)
    pos_c = torch.arange(S).expand(B, S)

    def grads_of():
        drafter.zero_grad(set_to_none=True)
        out = drafter(context, noise, pos_c, pos_q, attn)
        (out.sin().sum()).backward()
        return out.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()}

    return drafter, grads_of


@pytest.mark.parametrize("mode", ["mlp", "layer"])
def test_recompute_gives_the_same_gradients_as_stored_activations(mode):
    """train.recompute: rebuilding activations in backward changes memory, never the math."""
    drafter, grads_of = _float64_drafter_and_grads()

    def grads(recompute: str):
        drafter.set_recompute(recompute)
        return grads_of()

    ref_out, ref = grads("off")
    out, got = grads(mode)
    assert torch.equal(out, ref_out)
    for name, g in ref.items():
        diff = float((got[name] - g).abs().max())
        assert diff <= 1e-12, f"{name}: max |diff| {diff}"
    with pytest.raises(ValueError, match="recompute must be one of"):
        drafter.set_recompute("sometimes")


@pytest.mark.parametrize("mode", ["off", "mlp", "layer"])
def test_compiled_layers_give_the_eager_gradients(mode, monkeypatch):
    """train.compile: the compiled layer pieces (aot_eager here; inductor on CUDA) change speed, never the math."""
    import dflash.models.drafter as model_mod

    monkeypatch.setattr(model_mod, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(model_mod, "_compiled_fns", {})
    torch._dynamo.reset()
    drafter, grads_of = _float64_drafter_and_grads()
    drafter.set_recompute(mode)

    def grads(compiled: bool):
        drafter.set_compile(compiled)
        return grads_of()

    ref_out, ref = grads(False)
    out, got = grads(True)
    assert len(model_mod._compiled_fns) == 2
    assert float((out - ref_out).abs().max()) <= 1e-12
    for name, g in ref.items():
        diff = float((got[name] - g).abs().max())
        assert diff <= 1e-12, f"{name}: max |diff| {diff}"


# --------------------------------------------------------------------------------------------- own shape, sliding layers

SMALL_TARGET = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 8, "vocab_size": 50, "num_hidden_layers": 6, "rms_norm_eps": 1e-6}


def _shaped_drafter(layer_types, window, seed=0):
    """A drafter whose layers are shaped unlike the target's: 6 heads x 4 (3 kv), MLP 40."""
    torch.manual_seed(seed)
    cfg = drafter_config_from_target(SMALL_TARGET, len(layer_types), 4, [1, 3], mask_token_id=49, num_attention_heads=6,
                                     num_key_value_heads=3, head_dim=4, intermediate_size=40, layer_types=layer_types,
                                     sliding_window=window)
    return DFlashDrafter(cfg).double()


def _shaped_inputs(S=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.tensor([[3, 12, 25], [8, 20, 28]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    context = torch.randn(2, S, 2 * 32, generator=g, dtype=torch.float64)
    noise = torch.randn(2, 12, 32, generator=g, dtype=torch.float64)
    pos_q = (anchors[:, :, None] + torch.arange(4)).reshape(2, -1)
    return context, noise, torch.arange(S).expand(2, S), pos_q, anchors, valid


def _masks(drafter, anchors, valid, S, backend):
    from dflash.models.attention import build_layer_masks

    c = drafter.config
    return build_layer_masks(anchors, valid, S, c.block_size, "cpu", backend, c.layer_types, c.sliding_window)


def test_drafter_shape_independent_of_the_target():
    drafter = _shaped_drafter(["sliding_attention", "full_attention"], 8)
    attn = drafter.layers[0].self_attn
    assert (attn.q_proj.weight.shape, attn.k_proj.weight.shape, attn.o_proj.weight.shape) == ((24, 32), (12, 32), (32, 24))
    assert drafter.layers[0].mlp.gate_proj.weight.shape == (40, 32) and drafter.fc.weight.shape == (32, 64)
    # Unset fields stay the target's.
    same = drafter_config_from_target(SMALL_TARGET, 2, 4, [1, 3], mask_token_id=49, num_attention_heads=None)
    assert (same.num_attention_heads, same.num_key_value_heads, same.head_dim, same.intermediate_size) == (4, 2, 8, 64)
    assert same.layer_types == ["full_attention"] * 2 and same.sliding_window is None
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        drafter_config_from_target(SMALL_TARGET, 2, 4, [1, 3], mask_token_id=49, num_attention_heads=3)
    with pytest.raises(ValueError, match="sliding_window >= block_size"):
        drafter_config_from_target(SMALL_TARGET, 1, 4, [1], mask_token_id=49, layer_types=["sliding_attention"])


def test_sliding_layer_ignores_context_outside_its_window():
    """One sliding layer, window 8: block 1 of row 0 (anchor 12) slot o sees context 5 + o .. 11 only."""
    drafter = _shaped_drafter(["sliding_attention"], 8)
    context, noise, pos_c, pos_q, anchors, valid = _shaped_inputs()
    masks = _masks(drafter, anchors, valid, 30, "sdpa")
    torch.set_grad_enabled(False)
    base = drafter(context, noise, pos_c, pos_q, masks)
    for p in range(12):
        moved = context.clone()
        moved[0, p] += 1.0
        out = drafter(moved, noise, pos_c, pos_q, masks)
        for o in range(4):
            changed = float((out[0, 4 + o] - base[0, 4 + o]).abs().max())
            assert (changed > 0) == (p > 12 + o - 8), f"slot {o}, context {p}: changed by {changed}"
    torch.set_grad_enabled(True)
    with pytest.raises(ValueError, match=r"no attention mask for the drafter's \['sliding_attention'\] layers"):
        drafter(context, noise, pos_c, pos_q, masks["sliding_attention"])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_sliding_drafter_flex_equals_sdpa_and_a_wide_window_equals_full():
    torch.set_grad_enabled(False)
    drafter = _shaped_drafter(["sliding_attention", "full_attention"], 8)
    context, noise, pos_c, pos_q, anchors, valid = _shaped_inputs()
    sdpa = drafter(context, noise, pos_c, pos_q, _masks(drafter, anchors, valid, 30, "sdpa"))
    flex = drafter.float()(context.float(), noise.float(), pos_c, pos_q, _masks(drafter, anchors, valid, 30, "flex"))
    diff = float((flex.double() - sdpa).abs().max())
    assert diff < 1e-4, f"flex vs sdpa with a sliding layer: max abs diff {diff:.3e}"
    drafter.double()
    wide, full = _shaped_drafter(["sliding_attention", "full_attention"], 40), _shaped_drafter(["full_attention"] * 2, None)
    args = (context, noise, pos_c, pos_q)
    assert torch.equal(wide(*args, _masks(wide, anchors, valid, 30, "sdpa")), full(*args, _masks(full, anchors, valid, 30, "sdpa")))
    assert not torch.equal(drafter(*args, _masks(drafter, anchors, valid, 30, "sdpa")), full(*args, _masks(full, anchors, valid, 30, "sdpa")))
    torch.set_grad_enabled(True)


def test_sliding_drafter_save_load_round_trip(tmp_path):
    drafter = _shaped_drafter(["sliding_attention", "sliding_attention", "full_attention"], 8)
    drafter.save_pretrained(tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert (raw["sliding_window"], raw["use_sliding_window"], raw["num_attention_heads"], raw["head_dim"]) == (8, True, 6, 4)
    loaded = DFlashDrafter.from_pretrained(tmp_path / "d")
    assert loaded.config == drafter.config
    context, noise, pos_c, pos_q, anchors, valid = _shaped_inputs()
    masks = _masks(drafter, anchors, valid, 30, "sdpa")
    assert torch.equal(drafter(context, noise, pos_c, pos_q, masks), loaded(context, noise, pos_c, pos_q, masks))


def test_run_config_drafter_fields_shape_the_drafter():
    from dflash.config import config_from_dict
    from dflash.models.drafter import drafter_config_for_run

    cfg = config_from_dict({"drafter": {"num_layers": 3, "block_size": 4, "num_attention_heads": 6, "num_key_value_heads": 3,
                                        "head_dim": 4, "intermediate_size": 40, "sliding_window": 8,
                                        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}})
    dcfg = drafter_config_for_run(cfg, SMALL_TARGET, 49)
    assert (dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim, dcfg.intermediate_size) == (6, 3, 4, 40)
    assert dcfg.layer_types == cfg.drafter.layer_types and dcfg.sliding_window == 8 and dcfg.hidden_size == 32
    plain = drafter_config_for_run(config_from_dict({"drafter": {"num_layers": 2, "block_size": 4}}), SMALL_TARGET, 49)
    assert (plain.num_attention_heads, plain.intermediate_size, plain.layer_types) == (4, 64, ["full_attention"] * 2)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_path_gradients_equal_sdpa_with_tile_padded_rows():
    """The flex path pads query and key rows to whole 128-row tiles and projects the padded output rows before
    cutting them: gradients of every drafter parameter equal the unpadded SDPA path's (2 rows, lengths off the tile)."""
    drafter = _shaped_drafter(["sliding_attention", "full_attention"], 8).double()
    context, noise, pos_c, pos_q, anchors, valid = _shaped_inputs()
    args = (context.double(), noise.double(), pos_c, pos_q)
    grads = {}
    for backend in ("sdpa", "flex"):
        drafter.zero_grad(set_to_none=True)
        out = drafter(*args, _masks(drafter, anchors, valid, 30, backend))
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).square().sum().backward()
        grads[backend] = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    assert args[1].shape[1] % 128 and args[0].shape[1] % 128  # the padding is exercised
    for name, g in grads["sdpa"].items():
        diff = float((grads["flex"][name] - g).abs().max() / g.abs().max().clamp_min(1e-12))
        assert diff < 1e-9, f"{name}: flex vs sdpa gradient relative max diff {diff:.3e}"
