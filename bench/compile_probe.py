"""Where a drafter process's cold start goes: the first calls of each compiled piece, timed one by one.

The trainer's first step pays ~230 s on an H200 (bench/README.md); this times, in a fresh process
with an empty inductor cache, the pieces that compile, at the 512 anchors x block 16 bench shape:
  1. the training BlockMask (`create_block_mask(..., _compile=True)`), first and second call;
  2. compiled flex attention forward, first and second call;
  3. its backward, first and second call.
Each line is printed as soon as it is measured, so a run cut by a time limit still says where it was.

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python3 bench/compile_probe.py
    PYTHONPATH=. python3 bench/compile_probe.py --device cpu --tiny     # smoke run (eager, seconds)
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke run)")
    args = ap.parse_args()
    t_import = time.perf_counter()
    import torch

    from dflash.models.attention import attend, build_train_mask

    print(f"import torch + dflash.models.attention: {time.perf_counter() - t_import:.1f} s", flush=True)
    device = torch.device(args.device)
    S, A, bs, H, KV, D = (64, 8, 4, 4, 2, 16) if args.tiny else (3072, 512, 16, 32, 8, 128)
    backend = "flex" if device.type == "cuda" else "sdpa"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    anchors = torch.sort(torch.randperm(S - 1, generator=g)[:A]).values[None].to(device)
    valid = torch.ones_like(anchors, dtype=torch.bool)

    def timed(label: str, fn):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(f"{label}: {time.perf_counter() - t0:.2f} s", flush=True)
        return out

    mask = timed("block mask, first call", lambda: build_train_mask(anchors, valid, S, bs, device, backend))
    timed("block mask, second call", lambda: build_train_mask(anchors, valid, S, bs, device, backend))
    Q, L = A * bs, S + A * bs
    q = torch.randn(1, H, Q, D, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, KV, L, D, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, KV, L, D, device=device, dtype=dtype, requires_grad=True)
    out = timed("attention forward, first call", lambda: attend(q, k, v, mask))
    timed("attention backward, first call", lambda: out.sum().backward())
    out = timed("attention forward, second call", lambda: attend(q, k, v, mask))
    timed("attention backward, second call", lambda: out.sum().backward())


if __name__ == "__main__":
    main()
