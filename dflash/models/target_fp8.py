"""The frozen target in FP8: `target.precision = "fp8"`.

Each decoder linear whose in and out features are both at least MIN_FEATURES runs y = x W^T as an e4m3 matmul:
W quantised once, per output channel, as the weights load; x quantised per row at every call; the product
rescaled by both scales. Attention, the Gated DeltaNet recurrence, norms, the embedding, lm_head and every linear
below the size filter stay in target.dtype, so the hidden states the drafter reads are the target's own outputs.

On CUDA (compute capability 8.9+) torchao's float8 inference does it (`Float8DynamicActivationFloat8WeightConfig`,
per-row granularity, torch._scaled_mm). Elsewhere `EmulatedFp8Linear` runs the same arithmetic in float32:
`quantize_rows` is torchao's scale rule (amax / 448 computed in the input's dtype, then float32) and rounding (divide
in float32, clamp to +-448, cast to e4m3). tests/test_target_fp8.py checks it against torchao's functions, and on
a GPU against torchao's kernel.

The load never holds the target.dtype model and its FP8 copy on the GPU at once: the model loads on the CPU and
each linear moves to the GPU and is quantised there in turn (torchao's `quantize_(..., device=)`), the rest of each
layer following it. Random weights (target.random_init) are built one decoder layer at a time on the GPU and each
layer quantised before the next exists (dflash.models.target.build_random).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash.config import FP8_MIN_CAPABILITY, FP8_MIN_FEATURES

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
MIN_FEATURES = FP8_MIN_FEATURES  # read at each call: the tiny CPU tests lower it to reach their small linears
TORCHAO_INSTALL = "uv run dflash-env sync --profile train-cu128 (torchao 0.17.0 is in its lock)"


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 copy [..., K], float32 scales [..., 1]) with t ~= copy * scale, one scale per row (torchao's rule: the
    row's amax / 448 in t's dtype, then float32). A row of zeros gets scale 1 (torchao's torch path divides 0 by 0)."""
    scale = (t.abs().amax(-1, keepdim=True) / E4M3_MAX).float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def emulated_fp8_linear(x: torch.Tensor, qweight_NK: torch.Tensor, scale_N1: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) as an fp8 GPU matmul computes it: x quantised per row to e4m3, both operands
    dequantised and multiplied in float32, the result in x's dtype."""
    qx, sx = quantize_rows(x)
    y = (qx.float() * sx) @ (qweight_NK.float() * scale_N1).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class EmulatedFp8Linear(nn.Module):
    """A frozen nn.Linear held as e4m3 weights + float32 per-output-channel scales, run by `emulated_fp8_linear`."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        qweight, scale = quantize_rows(linear.weight.detach())
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return emulated_fp8_linear(x, self.qweight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-row (emulated)"


def fp8_eligible(module: nn.Module) -> bool:
    """A linear worth an fp8 matmul: in and out features both >= MIN_FEATURES (smaller ones lose to the quantisation)."""
    return isinstance(module, nn.Linear) and min(module.in_features, module.out_features) >= MIN_FEATURES


def fp8_problem(device: torch.device) -> str | None:
    """Why target.precision = "fp8" cannot run on `device` (one line naming the fix), or None. CPU: emulated."""
    if device.type != "cuda":
        return None
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_MIN_CAPABILITY:
        return (f"target.precision = \"fp8\" needs compute capability {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}+ "
                f"(fp8 tensor cores; this GPU: {cap[0]}.{cap[1]}); set target.precision = \"bf16\"")
    try:
        import torchao.quantization  # noqa: F401
    except ImportError as e:
        return f"target.precision = \"fp8\" needs torchao ({e}); install it: {TORCHAO_INSTALL}"
    return None


def torchao_config():
    """torchao's float8 inference config the CUDA path uses: per-row scales, inductor settings left as they are
    (its default turns on coordinate-descent tuning for the whole process, lengthening every compile)."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

    return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)


def quantize_linears(root: nn.Module, device: torch.device, within: nn.Module | None = None) -> int:
    """Quantise the eligible linears of `root` that sit inside `within` (all of `root` by default) onto `device`, one
    at a time (torchao's on CUDA, `EmulatedFp8Linear` elsewhere); returns how many."""
    inside = {id(m) for m in (root if within is None else within).modules()}
    chosen = [name for name, m in root.named_modules() if id(m) in inside and fp8_eligible(m)]
    if device.type == "cuda":
        from torchao.quantization import quantize_

        names = set(chosen)
        quantize_(root, torchao_config(), filter_fn=lambda m, fqn: fqn in names, device=device)
    else:
        for name in chosen:
            parent, _, leaf = name.rpartition(".")
            owner = root.get_submodule(parent)
            setattr(owner, leaf, EmulatedFp8Linear(getattr(owner, leaf)).to(device))
    return len(chosen)


def quantize_target(model: nn.Module, layers: nn.Module, device: torch.device) -> int:
    """Quantise the eligible linears of `layers` (the decoder layers of `model`, which sits on the CPU) onto `device`,
    one at a time, and move the rest of `model` there; returns how many linears run in fp8."""
    count = quantize_linears(model, device, layers)
    model.to(device)
    return count


def fp8_linears(model: nn.Module) -> int:
    """How many linears of `model` run in fp8 (emulated, or torchao's)."""
    def is_fp8(m: nn.Module) -> bool:
        return isinstance(m, EmulatedFp8Linear) or (
            isinstance(m, nn.Linear) and getattr(m.weight, "qdata", None) is not None and m.weight.qdata.dtype == E4M3)

    return sum(is_fp8(m) for m in model.modules())
