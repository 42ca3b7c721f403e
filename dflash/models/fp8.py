"""FP8 (e4m3) matmuls for the drafter's MLP: `train.fp8 = "mlp"`.

y = x W^T runs as torch._scaled_mm on e4m3 copies of x and W, each scaled along the contracted dimension
(one scale per row of x, per output channel of W); the input gradient dy W likewise (per row of dy, per input
channel of W); the weight gradient dy^T x stays bf16, from the bf16 x kept for it. Inside the compiled MLP
block inductor fuses each quantisation (amax, scale, cast) into the kernel that produces its input.

Measured on an H200 (bench/fp8_mlp.py): the block 1.26x / 1.29x faster at the bench shapes, its output and input
gradient 6.6% / 6.7% (relative) away from bf16. Row scales need a GPU with fp8 tensor cores (compute capability
8.9+); torch's CPU _scaled_mm takes one scale per tensor, which the CPU reference path here uses.
"""

from __future__ import annotations

import torch

from dflash.config import FP8_MIN_CAPABILITY

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
FP8_MODES = ("off", "mlp")  # train.fp8: bf16 everywhere, or e4m3 forward + input-gradient matmuls in each MLP


def quantize(t: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 copy, float32 scales) with t ~= copy * scale: one scale per row [rows, 1], or one [1, 1]."""
    amax = t.abs().amax(-1, keepdim=True) if per_row else t.abs().amax().reshape(1, 1)
    scale = amax.float().clamp_min(1e-12) / E4M3_MAX
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


def fp8_mm(a_MK: torch.Tensor, b_NK: torch.Tensor, per_row: bool | None = None) -> torch.Tensor:
    """a @ b^T in bf16 through e4m3 operands (b contiguous [N, K]); row scales on CUDA, per tensor on CPU
    (per_row: force one or the other; torch's CPU kernel takes per-tensor scales only)."""
    per_row = a_MK.device.type == "cuda" if per_row is None else per_row
    qa, sa = quantize(a_MK, per_row)
    qb, sb = quantize(b_NK, per_row)
    if per_row:
        return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16)
    return torch._scaled_mm(qa, qb.t(), scale_a=sa.reshape(()), scale_b=sb.reshape(()), out_dtype=torch.bfloat16)


class Fp8Linear(torch.autograd.Function):
    """y = x W^T for bf16 x [M, K] and W [N, K]: fp8 forward and input gradient, bf16 weight gradient."""

    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_MK, w_NK)
        return fp8_mm(x_MK, w_NK)

    @staticmethod
    def backward(ctx, dy_MN: torch.Tensor):
        x_MK, w_NK = ctx.saved_tensors
        dx_MK = fp8_mm(dy_MN.contiguous(), w_NK.t().contiguous())
        dw_NK = dy_MN.t() @ x_MK
        return dx_MK, dw_NK


def fp8_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T through Fp8Linear (bf16 in and out, fp32 weights cast; autocast does not apply)."""
    with torch.autocast(x.device.type, enabled=False):
        y = Fp8Linear.apply(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), w.to(torch.bfloat16))
    return y.view(*x.shape[:-1], w.shape[0])


def fp8_problem(mode: str, device: torch.device) -> str | None:
    """Why train.fp8 = mode cannot run on this device (one line naming the fix), or None."""
    if mode == "off":
        return None
    if mode not in FP8_MODES:
        return f"train.fp8 must be one of {FP8_MODES}, got {mode!r}"
    if device.type != "cuda":
        return f"train.fp8 = {mode!r} needs a CUDA GPU with fp8 tensor cores (this run is on {device.type}); set train.fp8 = \"off\""
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_MIN_CAPABILITY:
        return (f"train.fp8 = {mode!r} needs compute capability {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}+ "
                f"(this GPU: {cap[0]}.{cap[1]}); set train.fp8 = \"off\"")
    return None
