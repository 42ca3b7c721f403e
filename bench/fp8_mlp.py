"""FP8 in the drafter's MLP block with the quantisation compiled into its neighbours: is it fast enough?

bench/fp8_matmul.py showed the e4m3 matmuls alone at ~1.8x bf16 on an H200 but eager quantisation passes
costing more than they save. Here the whole block the drafter compiles (RMSNorm -> fused gate/up -> SiLU * up
-> down, Qwen3-8B-shaped: hidden 4096, intermediate 12288) runs forward + backward under torch.compile twice:

  bf16  as the trainer runs it (bf16 weights here, no autocast: the matmuls and the fusions are what is timed)
  fp8   as the drafter runs train.fp8 = "mlp" (dflash.models.fp8): both linears through torchao's float8
        matmul (recipe rowwise_with_gw_hp: forward and input gradient in e4m3 with row scales, the weight
        gradient in bf16) on the block's own weights, so gate and up stay one GEMM; inductor is free to fuse
        each cast into the kernel that produced the tensor (the norm, SiLU * up, the SiLU backward)

  torchao-rowwise-gw-hp  the same recipe with the block's linears as modules converted by torchao's
        `convert_to_float8_training` (gate and up as one module here too) (CUDA only)
  torchao-rowwise        torchao's rowwise recipe (the weight gradient in fp8 too) (CUDA only)

Until 2026-12-07 "fp8" was dflash's own hand-written e4m3 path (bench/results/h100_20261207_fp8_mlp.json: 1.22x
against torchao's 1.26x there); it moved onto torchao (issue #55).

at the bench's query rows (512 x 16 = 8,192 and 1024 x 32 = 32,768), median of 10 after 3 warm-up passes, with
the relative error of the output and of the input gradient against bf16. Nothing here trains: a drafter
trained this way must first show its acceptance length before the step may use it.

    PYTHONPATH=. python3 bench/fp8_mlp.py --json $OUT/fp8_mlp.json      # one H100 or H200, ~1 min
    uv run python bench/fp8_mlp.py --device cpu --tiny                   # smoke run: eager, torchao's casts emulated
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import bench_device, median_ms  # noqa: E402
from dflash.models.fp8 import fp8_linear, prepare  # noqa: E402

SHAPES = {"512x16": 8192, "1024x32": 32768}
HIDDEN, INTERMEDIATE = 4096, 12288


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return (w.float() * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def mlp_block(x, norm_w, gate_up_w, down_w, fp8: bool):
    xn = rms_norm(x, norm_w)
    linear = fp8_linear if fp8 else (lambda a, w: a @ w.t())
    gate, up = linear(xn, gate_up_w).chunk(2, dim=-1)
    return linear(torch.nn.functional.silu(gate) * up, down_w)


TORCHAO = {"torchao-rowwise-gw-hp": "rowwise_with_gw_hp", "torchao-rowwise": "rowwise"}


class Block(torch.nn.Module):
    """mlp_block as nn.Linear modules, for torchao's float8 training to convert (its own Float8Linear)."""

    def __init__(self, norm_w, gate_up_w, down_w):
        super().__init__()
        self.norm_w = torch.nn.Parameter(norm_w)
        self.gate_up = torch.nn.Linear(gate_up_w.shape[1], gate_up_w.shape[0], bias=False, dtype=gate_up_w.dtype,
                                       device=gate_up_w.device)
        self.down = torch.nn.Linear(down_w.shape[1], down_w.shape[0], bias=False, dtype=down_w.dtype,
                                    device=down_w.device)
        with torch.no_grad():
            self.gate_up.weight.copy_(gate_up_w)
            self.down.weight.copy_(down_w)

    def forward(self, x):
        gate, up = self.gate_up(rms_norm(x, self.norm_w)).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


def torchao_step(recipe: str, x, weights, dy, compiled: bool):
    """(step, x leaf, gate_up weight) of the block converted by torchao's float8 training under `recipe`."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    block = convert_to_float8_training(Block(*(w.detach().clone() for w in weights)),
                                       config=Float8LinearConfig.from_recipe_name(recipe))
    run = torch.compile(block) if compiled else block
    xl = x.detach().clone().requires_grad_(True)

    def step():
        xl.grad = None
        block.zero_grad(set_to_none=True)
        y = run(xl)
        y.backward(dy)
        return y
    return step, xl, block.gate_up.weight


def measure(rows: int, hidden: int, inter: int, device, compiled: bool, repeat: int) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(rows, hidden, device=device, generator=g).to(bf)
    weights = (torch.ones(hidden, device=device, dtype=bf),
               (torch.randn(2 * inter, hidden, device=device, generator=g) / hidden ** 0.5).to(bf),
               (torch.randn(hidden, inter, device=device, generator=g) / inter ** 0.5).to(bf))
    dy = torch.randn(rows, hidden, device=device, generator=g).to(bf)
    out = {}
    results = {}
    prepare()  # as DFlashDrafter.set_fp8 does: torchao's configs built outside the compiled block
    names = ["bf16", "fp8"] + (list(TORCHAO) if device.type == "cuda" else [])  # torchao's float8: CUDA kernels
    for name in names:
        if name in TORCHAO:
            step, x_leaf, w_leaf = torchao_step(TORCHAO[name], x, weights, dy, compiled)
        else:
            block = torch.compile(mlp_block) if compiled else mlp_block
            leaves = [t.detach().clone().requires_grad_(True) for t in (x, *weights)]
            x_leaf, w_leaf = leaves[0], leaves[2]

            def step(leaves=leaves, block=block, fp8=name == "fp8"):
                for t in leaves:
                    t.grad = None
                y = block(*leaves, fp8=fp8)
                y.backward(dy)
                return y

        t0 = time.perf_counter()
        y = step()
        first_s = time.perf_counter() - t0
        results[name] = (y.detach().float(), x_leaf.grad.float(), w_leaf.grad.float())
        out[f"{name}_ms"] = median_ms(torch, device, step, repeat, warmup=3)
        out[f"{name}_first_call_s"] = round(first_s, 2)
    rel = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-30))  # noqa: E731
    for name in names[1:]:
        tag = "" if name == "fp8" else f"_{name}"
        for i, what in enumerate(("output", "input_grad", "gate_up_weight_grad")):
            out[f"rel_error_{what}{tag}"] = rel(results[name][i], results["bf16"][i])
        out[f"speedup{tag}"] = out["bf16_ms"] / out[f"{name}_ms"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, eager (a CPU smoke run)")
    ap.add_argument("--repeat", type=int, default=10, help="timed passes per variant (median reported)")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        print(f"fp8_mlp: --repeat must be >= 1, got {args.repeat}", file=sys.stderr)
        return 2
    device, error = bench_device(torch, "fp8_mlp", args.device)
    if error:
        print(error[1], file=sys.stderr)
        return error[0]
    shapes, hidden, inter = ({"tiny": 64}, 64, 128) if args.tiny else (SHAPES, HIDDEN, INTERMEDIATE)
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__,
               "scales": "per row" if device.type == "cuda" else "per row, emulated",
               "hidden": hidden, "intermediate": inter, "shapes": {}}
    for shape, rows in shapes.items():
        r = measure(rows, hidden, inter, device, not args.tiny, args.repeat)
        results["shapes"][shape] = r
        print(f"[{shape}] MLP block forward + backward, {rows} rows: bf16 {r['bf16_ms']:.2f} ms, fp8 {r['fp8_ms']:.2f} ms "
              f"({r['speedup']:.2f}x); relative error vs bf16: output {r['rel_error_output']:.4f}, input grad "
              f"{r['rel_error_input_grad']:.4f}, weight grad {r['rel_error_gate_up_weight_grad']:.4f}", flush=True)
        for name in TORCHAO:
            if f"{name}_ms" in r:
                print(f"[{shape}]   {name}: {r[f'{name}_ms']:.2f} ms ({r[f'speedup_{name}']:.2f}x); relative error: "
                      f"output {r[f'rel_error_output_{name}']:.4f}, input grad {r[f'rel_error_input_grad_{name}']:.4f}, "
                      f"weight grad {r[f'rel_error_gate_up_weight_grad_{name}']:.4f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
