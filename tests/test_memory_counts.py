"""The memory model's per-row activation counts (dflash.memory.parts.Calibration.drafter_act_*) against what the
drafter's compiled pieces really save for backward: saved-tensor hooks around the compiled projection and MLP block
(inductor on CPU, under bf16 autocast as the trainer runs them). A change to what a piece keeps (a checkpoint
policy, a fused op, a cast) fails here and names the count to change in the model."""

from __future__ import annotations

import pytest
import torch

from dflash.memory.parts import DEFAULT_CALIBRATION as CAL
from dflash.models import drafter as D

pytestmark = pytest.mark.slow

# Widths chosen apart from each other and from the row counts, so a saved tensor's shape says what it is.
H, HEADS, KV, HEAD_DIM, INTER = 320, 4, 2, 48, 1000
N, M = 256, 640  # block rows, context rows
ATTENTION_KEEPS = {"q": 2, "kv": 2}  # attention's own (flex on CUDA): q after RoPE and its output; k and v per key


def _config() -> D.DFlashConfig:
    return D.DFlashConfig(hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS, num_key_value_heads=KV,
                          head_dim=HEAD_DIM, rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=1000, num_hidden_layers=1,
                          block_size=4, target_layer_ids=[1], mask_token_id=3, num_target_layers=4)


def _saved_units(fn, *args) -> dict[tuple[int, str], float]:
    """{(rows, width name): bf16 units a row} of the distinct tensors `fn` saves for backward, rows N or M only
    (weights, their bf16 copies and per-row scalars such as a norm's rstd are other terms of the model)."""
    names = {H: "H", HEADS * HEAD_DIM: "q", KV * HEAD_DIM: "kv", INTER: "I", 2 * INTER: "I"}
    seen, units = set(), {}

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        width = t[0].numel() if t.dim() else 0
        if key not in seen and t.dim() and t.shape[0] in (N, M) and width in names:
            seen.add(key)
            slot = (t.shape[0], names[width])
            units[slot] = units.get(slot, 0.0) + width * t.element_size() / 2 / (INTER if names[width] == "I" else width)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        fn(*args)
    return units


@pytest.fixture(scope="module")
def layer():
    torch._dynamo.reset()
    torch.manual_seed(0)
    return D.DrafterLayer(_config()).float()


def _bf16_rows(rows: int, width: int) -> torch.Tensor:
    return (torch.randn(rows, width) * 0.5).to(torch.bfloat16).requires_grad_()


def test_the_compiled_mlp_block_saves_what_the_model_counts(layer):
    units = _saved_units(D._compiled(D._norm_mlp_keeping_matmuls), layer, _bf16_rows(N, H))
    # its input (the post-attention residual: one of the model's drafter_act_h) and the fused gate/up output
    assert units == {(N, "H"): 1.0, (N, "I"): CAL.drafter_act_i}, units


def test_the_compiled_projection_saves_what_the_model_counts(layer):
    rope = [torch.randn(rows, 1, HEAD_DIM).to(torch.bfloat16) for rows in (N, N, M, M)]
    units = _saved_units(D._compiled(D._project), layer, _bf16_rows(N, H), _bf16_rows(M, H), *rope)
    # the layer's input and its normed copy, q and k before their norms; the context rows' k before its norm (the
    # context itself is the model's "context projection" term)
    assert units.pop((M, "H"), None) == 1.0
    assert units == {(N, "H"): 2.0, (N, "q"): CAL.drafter_act_q - ATTENTION_KEEPS["q"],
                     (N, "kv"): CAL.drafter_act_kv - ATTENTION_KEEPS["kv"],
                     (M, "kv"): CAL.drafter_act_kv - ATTENTION_KEEPS["kv"]}, units
    assert CAL.drafter_act_h == 2.0 + 1.0  # with the MLP block's input above: the model's three hidden-width rows
