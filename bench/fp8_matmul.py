"""FP8 vs bf16 for the drafter layer's matmuls: would e4m3 with row-wise scales make the step fast enough?

#12's speed target (133 / 451 ms at 512 x 16 / 1024 x 32 on an H200) is out of reach in bf16: the drafter's
matmuls alone run at 700-800 TFLOP/s (bench/README.md). This measures, for every linear of one drafter layer at
the bench shapes (Qwen3-8B-shaped drafter, hidden 4096: fused q/k/v 4096 -> 6144, o 4096 -> 4096, fused gate/up
4096 -> 24576, down 12288 -> 4096) and each of its three matmuls (forward, input gradient, weight gradient):

  bf16      x @ W.T, g @ W, g.T @ x in bfloat16 (what the step runs now)
  fp8       the same through torch._scaled_mm on float8_e4m3fn operands with one scale per row of each operand
            along its non-contracted dimension, bf16 out, the quantisation passes (amax, scale, cast) included;
            the transposed copies of W, dy and x the gradients need are timed apart and added
  error     |fp8 - bf16| / |bf16| over the whole output (Frobenius), with random inputs of unit scale

and sums them over 5 layers. Nothing here trains: whether the drafter's acceptance length survives FP8 needs a
training run (`dflash-train` on the GPU) before the step may use it.

    PYTHONPATH=. python3 bench/fp8_matmul.py                   # one H200, ~1 min
    PYTHONPATH=. python3 bench/fp8_matmul.py --per-tensor      # one scale per tensor (cuBLAS's fastest fp8 path)
    PYTHONPATH=. python3 bench/fp8_matmul.py --device cpu --tiny   # smoke run (per-tensor scales: all the CPU has)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import bench_device, median_ms  # noqa: E402

# (name, in features, out features) of one drafter layer's linears (fused as the model runs them)
LINEARS = (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 24576), ("down", 12288, 4096))
TINY_LINEARS = (("qkv", 64, 96), ("o", 64, 64), ("gate_up", 64, 256), ("down", 128, 64))
SHAPES = {"512x16": 512 * 16, "1024x32": 1024 * 32}
TINY_SHAPES = {"tiny": 64}
LAYERS = 5
E4M3_MAX = 448.0


def quantize_rows(torch, t, per_row: bool):
    """(float8_e4m3fn copy of t, float32 scales) with t ~= q * scale: one scale per row, or one for the tensor."""
    amax = t.abs().amax(dim=1, keepdim=True) if per_row else t.abs().amax().reshape(1, 1)
    scale = (amax.float() / E4M3_MAX).clamp_min(1e-12)
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


def scaled_mm(torch, a, b_t, per_row: bool):
    """a [M, K] @ b_t.T, b_t [N, K] (both bf16), through fp8 operands scaled per row of a and per row of b_t."""
    return mm_only(torch, *quantize_rows(torch, a, per_row), *quantize_rows(torch, b_t, per_row), per_row)


def mm_only(torch, qa, sa, qb, sb, per_row: bool):
    """The fp8 matmul alone, on operands quantize_rows already made."""
    scale_b = sb.reshape(1, -1) if per_row else sb.reshape(())
    return torch._scaled_mm(qa, qb.t(), scale_a=sa if per_row else sa.reshape(()), scale_b=scale_b,
                            out_dtype=torch.bfloat16)


def timed(torch, device, fn, repeat: int) -> float:
    """Median ms of fn() over `repeat` runs after one warm-up."""
    return median_ms(torch, device, fn, repeat)


def measure(torch, device, rows: int, k: int, n: int, per_row: bool, repeat: int) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, k, device=device, generator=g).to(torch.bfloat16)  # layer input [M, K]
    w = torch.randn(n, k, device=device, generator=g).to(torch.bfloat16) / k ** 0.5  # weight [N, K]
    dy = torch.randn(rows, n, device=device, generator=g).to(torch.bfloat16)  # output gradient [M, N]
    w_t, dy_t, x_t = w.t().contiguous(), dy.t().contiguous(), x.t().contiguous()
    # (bf16 op, fp8 op) for y = x W^T, dx = dy W, dW = dy^T x; each fp8 op quantises its operands itself
    ops = {
        "forward": (lambda: x @ w.t(), lambda: scaled_mm(torch, x, w, per_row)),
        "input grad": (lambda: dy @ w, lambda: scaled_mm(torch, dy, w_t, per_row)),
        "weight grad": (lambda: dy.t() @ x, lambda: scaled_mm(torch, dy_t, x_t, per_row)),
    }
    operands = {"forward": (x, w), "input grad": (dy, w_t), "weight grad": (dy_t, x_t)}
    out = {}
    for name, (bf16_op, fp8_op) in ops.items():
        ref, got = bf16_op().float(), fp8_op().float()
        flop = 2 * rows * k * n
        bf16_ms = timed(torch, device, bf16_op, repeat)
        fp8_ms = timed(torch, device, fp8_op, repeat)
        quantized = [t for op in operands[name] for t in quantize_rows(torch, op, per_row)]
        mm_ms = timed(torch, device, lambda q=quantized: mm_only(torch, *q, per_row), repeat)
        out[name] = {"bf16_ms": bf16_ms, "fp8_ms": fp8_ms, "fp8_mm_only_ms": mm_ms, "bf16_tflops": flop / bf16_ms / 1e9,
                     "fp8_tflops": flop / fp8_ms / 1e9, "fp8_mm_only_tflops": flop / mm_ms / 1e9,
                     "rel_error": float((got - ref).norm() / ref.norm().clamp_min(1e-30))}
    # The fp8 operands must be scaled along their non-contracted dimension, so the input and weight gradients
    # need transposed copies of W, dy and x (made outside the timed ops above): timed here, added to fp8's total.
    out["transposes_ms"] = timed(torch, device, lambda: (w.t().contiguous(), dy.t().contiguous(),
                                                         x.t().contiguous()), repeat)
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    ap.add_argument("--repeat", type=int, default=10, help="timed runs per matmul (median reported)")
    ap.add_argument("--per-tensor", action="store_true", help="one scale per tensor (what the CPU has) on a GPU too")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    device, error = bench_device(torch, "fp8_matmul", args.device)
    if error:
        print(error[1], file=sys.stderr)
        return error[0]
    per_row = device.type == "cuda" and not args.per_tensor  # torch's CPU _scaled_mm takes one scale per tensor only
    linears, shapes = (TINY_LINEARS, TINY_SHAPES) if args.tiny else (LINEARS, SHAPES)
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "scales": "per row" if per_row else "per tensor", "layers": LAYERS,
               "shapes": {}}
    for shape, rows in shapes.items():
        per_linear = {name: measure(torch, device, rows, k, n, per_row, args.repeat) for name, k, n in linears}
        bf16 = LAYERS * sum(op["bf16_ms"] for r in per_linear.values() for key, op in r.items() if key != "transposes_ms")
        mm = LAYERS * sum(op["fp8_mm_only_ms"] for r in per_linear.values() for key, op in r.items() if key != "transposes_ms")
        fp8 = LAYERS * sum(op["fp8_ms"] for r in per_linear.values() for key, op in r.items() if key != "transposes_ms")
        fp8 += LAYERS * sum(r["transposes_ms"] for r in per_linear.values())
        worst = max(op["rel_error"] for r in per_linear.values() for key, op in r.items() if key != "transposes_ms")
        results["shapes"][shape] = {"rows": rows, "linears": per_linear, "layers_bf16_ms": bf16,
                                    "layers_fp8_ms": fp8, "layers_fp8_mm_only_ms": mm, "worst_rel_error": worst}
        print(f"[{shape}] {rows} rows, {LAYERS} layers: bf16 {bf16:.1f} ms, fp8 {fp8:.1f} ms "
              f"(quantisation and transposes included; the matmuls alone {mm:.1f} ms), worst relative error {worst:.4f}")
        for name, r in per_linear.items():
            for op in ("forward", "input grad", "weight grad"):
                m = r[op]
                print(f"[{shape}]   {name:8s} {op:12s} bf16 {m['bf16_ms']:7.3f} ms {m['bf16_tflops']:6.0f} TFLOP/s"
                      f"   fp8 {m['fp8_ms']:7.3f} ms {m['fp8_tflops']:6.0f} TFLOP/s (matmul alone {m['fp8_mm_only_tflops']:5.0f})"
                      f"   error {m['rel_error']:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
