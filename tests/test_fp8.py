"""train.fp8 = "mlp": the e4m3 matmuls against bf16, the recomputed MLP block, and the config and device checks."""

from __future__ import annotations

import pytest
import torch

from dflash.config import ConfigError, config_from_dict
from dflash.models.drafter import DFlashConfig, DFlashDrafter, _norm_mlp, _norm_mlp_keeping_matmuls
from dflash.models.fp8 import fp8_linear, fp8_problem


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def test_fp8_linear_is_close_to_bf16_and_its_weight_gradient_is_bf16s():
    """torchao's casts (emulated on CPU): e4m3 keeps 3 mantissa bits, a few percent off bf16 (a wrong scale or
    transpose is ~100% off); the weight gradient is computed in bf16 from the kept input, so it equals bf16's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 64, generator=g).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(32, 64, generator=g) / 8).to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn(48, 32, generator=g).to(torch.bfloat16)
    y = fp8_linear(x, w)
    y.backward(dy)
    x_ref, w_ref = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    (x_ref @ w_ref.t()).backward(dy)
    assert y.dtype == torch.bfloat16 and y.shape == (48, 32)
    assert 0 < _rel(y, x_ref @ w_ref.t()) < 0.08
    assert 0 < _rel(x.grad, x_ref.grad) < 0.08
    assert torch.equal(w.grad, w_ref.grad)


def test_fp8_linear_takes_fp32_weights_and_any_leading_shape():
    x = torch.randn(2, 5, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    y = fp8_linear(x, w)
    y.float().sum().backward()
    assert y.shape == (2, 5, 8) and y.dtype == torch.bfloat16
    assert x.grad.shape == x.shape and w.grad.dtype == torch.float32 and w.grad.abs().sum() > 0


def _tiny_drafter() -> DFlashDrafter:
    cfg = DFlashConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=256, num_hidden_layers=2, block_size=4,
                       target_layer_ids=[1], mask_token_id=255, num_target_layers=4)
    torch.manual_seed(0)
    return DFlashDrafter(cfg)


def test_recomputed_fp8_mlp_block_gives_the_stored_blocks_gradients():
    """The compiled step keeps only the matmul outputs (now fp8 ones too) and recomputes the rest of the MLP
    block in backward: the gradients must equal those of the block run with everything kept."""
    drafter = _tiny_drafter()
    drafter.set_fp8("mlp")
    layer = drafter.layers[0]
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    grads = []
    for block in (_norm_mlp, _norm_mlp_keeping_matmuls):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        block(layer, xi).float().pow(2).sum().backward()
        grads.append([xi.grad] + [p.grad for p in layer.mlp.parameters()] + [layer.post_attention_layernorm.weight.grad])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_fp8_mlp_stays_close_to_bf16_through_the_drafter():
    drafter = _tiny_drafter()
    ctx = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(2))
    noise = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(3))
    from dflash.models.attention import build_train_mask

    mask = build_train_mask(torch.tensor([[5, 9]]), torch.tensor([[True, True]]), 12, 4, "cpu", "sdpa")
    pos_ctx, pos_q = torch.arange(12)[None], torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    outs = {}
    for mode in ("off", "mlp"):
        drafter.set_fp8(mode)
        drafter.zero_grad(set_to_none=True)
        out = drafter(ctx, noise, pos_ctx, pos_q, mask)
        out.pow(2).mean().backward()
        outs[mode] = (out.detach(), drafter.layers[0].mlp.gate_proj.weight.grad.clone(), drafter.fc.weight.grad.clone())
    assert all(m.fp8 for m in (layer.mlp for layer in drafter.layers))
    for a, b in zip(outs["mlp"], outs["off"]):
        # torchao's recipe emulated at these tiny widths: 0.19-0.22 on the MLP's gradients (an output 0.0003);
        # at the bench's widths 6.6%. A wrong scale or transpose is ~100% off.
        assert 0 < _rel(a, b) < 0.3


def test_fp8_is_refused_off_cuda_with_a_one_line_fix():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"device": "cpu", "train": {"fp8": "mlp"}})
    assert "train.fp8" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="fp8"):
        config_from_dict({"train": {"fp8": "fp4"}})
    assert fp8_problem("off", torch.device("cpu")) is None
    assert "set train.fp8 = \"off\"" in fp8_problem("mlp", torch.device("cpu"))
    with pytest.raises(ValueError, match="fp8 must be one of"):
        _tiny_drafter().set_fp8("all")
    odd = DFlashDrafter(DFlashConfig(hidden_size=72, intermediate_size=100, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=18, rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=256, num_hidden_layers=1,
                                     block_size=4, target_layer_ids=[1], mask_token_id=255, num_target_layers=4))
    with pytest.raises(ValueError, match="divisible by 16"):
        odd.set_fp8("mlp")


def test_a_torchao_without_the_float8_matmul_is_one_line_before_the_run(monkeypatch):
    """On an fp8-capable GPU, a torchao whose float8 training lacks what the MLP calls (a private function that may
    move between releases) is named by the preflight rule, with the install command, not a traceback at setup."""
    from dflash.models import fp8

    def missing():
        raise ImportError("cannot import name 'matmul_with_hp_or_float8_args' from 'torchao.float8.float8_linear'")

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fp8, "prepare", missing)
    problem = fp8_problem("mlp", torch.device("cuda"))
    assert "matmul_with_hp_or_float8_args" in problem and fp8.TORCHAO_INSTALL in problem and "\n" not in problem


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_fp8_mlp_on_cuda_is_as_close_to_bf16_as_eager_fp8():
    """The compiled MLP block (selective recompute, quantisation fused by inductor, row scales) against eager
    bf16: as close as the eager fp8 block is (inductor may quantise the fp32 norm output before its bf16 rounding,
    so the two fp8 paths round a few elements differently). 250 rows: not a multiple of 16."""
    if fp8_problem("mlp", torch.device("cuda")):
        pytest.skip(fp8_problem("mlp", torch.device("cuda")))
    from dflash.models.drafter import _compiled

    drafter = _tiny_drafter().cuda()
    layer = drafter.layers[0]
    x = torch.randn(250, 64, device="cuda")
    results = {}
    for name, mode, block in (("bf16", "off", _norm_mlp), ("fp8", "mlp", _norm_mlp),
                              ("compiled fp8", "mlp", _compiled(_norm_mlp_keeping_matmuls))):
        drafter.set_fp8(mode)
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = block(layer, xi)
        y.float().pow(2).sum().backward()
        results[name] = (y.float(), xi.grad, layer.mlp.gate_proj.weight.grad)
    for ref, eager, compiled in zip(results["bf16"], results["fp8"], results["compiled fp8"]):
        assert 0 < _rel(eager, ref) < 0.1 and _rel(compiled, ref) < 1.5 * _rel(eager, ref) + 0.01, (
            _rel(eager, ref), _rel(compiled, ref))


def test_fp8_needs_compile_and_changes_the_compile_cache_key():
    with pytest.raises(ConfigError, match="train.compile"):
        config_from_dict({"train": {"fp8": "mlp", "compile": False}})
    off, on = config_from_dict({}), config_from_dict({"train": {"fp8": "mlp"}})
    assert off.drafter_hash() != on.drafter_hash()
    assert off.drafter_hash() == config_from_dict({"train": {"fp8": "off"}}).drafter_hash()


def test_the_fp8_mlp_block_traces_as_one_graph():
    """torchao's configs are built by set_fp8, outside the compiled block: built while Dynamo traces, they broke the
    block into 3 graphs and the casts were no longer fused into their neighbours (1.02-1.11x on an H100 instead of
    1.28x). The selective-recompute block the trainer compiles must trace whole."""
    import dflash.models.fp8 as fp8

    fp8._TORCHAO.clear()
    drafter = _tiny_drafter()
    drafter.set_fp8("mlp")
    torch._dynamo.reset()
    x = torch.randn(40, 64, requires_grad=True)
    explained = torch._dynamo.explain(_norm_mlp_keeping_matmuls)(drafter.layers[0], x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [b.reason for b in explained.break_reasons]
