"""FP8 (e4m3) matmuls for the drafter's MLP: `train.fp8 = "mlp"`, through torchao's float8 training.

y = x W^T runs torchao's float8 linear under its `rowwise_with_gw_hp` recipe: x and W cast to e4m3 with one scale
per row along the contracted dimension, the input gradient dy W in e4m3 too, the weight gradient dy^T x in bf16
from the kept high-precision x. dflash calls torchao's autograd function on its own weights rather than swapping
modules, so the MLP's gate and up projections stay one GEMM over their concatenated weights. The project writes
no fp8 quantisation of its own; inside the compiled MLP block inductor fuses torchao's casts into the kernels that
produce their inputs.

Measured on an H100 (bench/fp8_mlp.py, recipe fp8-mlp): the block 1.26x faster than bf16 at the bench shapes,
where dflash's former hand-written e4m3 path gained 1.22x; outputs 6.6% (relative) away from bf16. Row scales need
a GPU with fp8 tensor cores (compute capability 8.9+). Off CUDA torchao emulates the same casts in high precision,
which the CPU tests use.
"""

from __future__ import annotations

import dataclasses

import torch

from dflash.config import FP8_MIN_CAPABILITY
from dflash.models.target_fp8 import TORCHAO_INSTALL

FP8_MODES = ("off", "mlp")  # train.fp8: bf16 everywhere, or e4m3 forward + input-gradient matmuls in each MLP
RECIPE = "rowwise_with_gw_hp"  # torchao's recipe: row scales, the weight gradient in bf16 (bench/fp8_mlp.py chose it)


_TORCHAO: dict[bool, tuple] = {}  # emulate -> (torchao's float8 matmul, its linear config, its per-GEMM config)


def prepare() -> None:
    """Import torchao's float8 training and build its configs for RECIPE (on CUDA and emulated) now, outside any
    compiled region: traced by Dynamo, building them breaks the compiled MLP block into three graphs and its casts
    are no longer fused (measured: 1.02-1.11x instead of 1.28x). DFlashDrafter.set_fp8 calls it."""
    if _TORCHAO:
        return
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    built = {}  # filled whole or not at all
    for emulate in (False, True):
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(RECIPE), emulate=emulate)
        template = Float8Linear(16, 16, bias=False, config=config, device="meta")  # carries the per-GEMM settings
        built[emulate] = (matmul_with_hp_or_float8_args, config, template.linear_mm_config)
    _TORCHAO.update(built)


def fp8_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T through torchao's float8 linear (bf16 in and out, fp32 weights cast; autocast does
    not apply). Emulated off CUDA. Call `prepare` first where this is compiled."""
    if not _TORCHAO:
        prepare()
    matmul, config, mm_config = _TORCHAO[x.device.type != "cuda"]
    with torch.autocast(x.device.type, enabled=False):
        y = matmul.apply(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), w.to(torch.bfloat16).t(), mm_config, config)
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
    from dflash.models.target import _short

    try:
        prepare()  # the torchao pieces the MLP calls, its private float8 matmul included
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        return f"train.fp8 = {mode!r} needs torchao 0.17's float8 training ({_short(e)}); install it: {TORCHAO_INSTALL}"
    return None
