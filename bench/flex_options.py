"""Flex attention tile sizes for the DFlash training mask: forward + backward time per kernel_options set.

The training mask (dflash.models.attention) at the bench shapes (Qwen3-8B drafter: 32 query heads, 8 kv heads,
head_dim 128, 3072 context tokens; 512 anchors x block 16 and 1024 x 32), one compiled flex call per
option set, median of 5 forward+backward passes after 2 warm-up passes (which compile).

    PYTHONPATH=. python3 bench/flex_options.py            # one GPU, ~2 min
    FLEX_LAYOUT=rows FLEX_AUTOCAST=1 FLEX_ONLY=default PYTHONPATH=. python3 bench/flex_options.py   # as in the trainer
    FLEX_LAYOUT=trainer FLEX_SHAPES=1024x32,512x16,1024x32 PYTHONPATH=. python3 bench/flex_options.py
        # through dflash.models.attention.attend_padded (tiles, dynamic sizes), one process: the second 1024 x 32 row runs
        # the graph compiled with dynamic sizes, as a trainer does once it has seen a second batch shape
    FLEX_CHUNKS=1,4,8 FLEX_ONLY=default PYTHONPATH=. python3 bench/flex_options.py
        # each row's anchors split into C rows of A / C anchors, the context keys repeated per row (same attention
        # per query; the backward's key tiles, one program each, are then C times as many)
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch.nn.attention.flex_attention import flex_attention

from dflash.models.attention import as_block_mask, build_train_mask

OPTIONS = {
    "default": {},
    "fwd 128x64": {"BLOCK_M": 128, "BLOCK_N": 64},
    "bwd 64/128/128/64 w8 s3": {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64, "num_warps": 8,
                                "num_stages": 3},
    "bwd 32/128/128/32 w4 s3": {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32, "num_warps": 4,
                                "num_stages": 3},
    "bwd 64/64/64/64 w4 s3": {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "num_warps": 4,
                              "num_stages": 3},
    "bwd 64/128/128/64 w8 s2": {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64, "num_warps": 8,
                                "num_stages": 2},
}


LAYOUT = os.environ.get("FLEX_LAYOUT", "heads")  # heads: contiguous [B, heads, L, D]; rows: the trainer's views
AUTOCAST = os.environ.get("FLEX_AUTOCAST") == "1"  # call under bf16 autocast, as the trainer does
ONLY = [x for x in os.environ.get("FLEX_ONLY", "").split(",") if x]
try:
    CHUNKS = [int(x) for x in os.environ.get("FLEX_CHUNKS", "1").split(",")]
except ValueError:
    sys.exit(f"FLEX_CHUNKS={os.environ['FLEX_CHUNKS']!r}: give row counts separated by commas, e.g. 1,2,4,8")


def _to_chunks(t_BhnD: torch.Tensor, chunks: int) -> torch.Tensor:
    """[1, heads, n, D] -> [chunks, heads, n / chunks, D] (a view)."""
    return t_BhnD.unflatten(2, (chunks, -1))[0].transpose(0, 1)


def _chunked(flex, S: int, chunks: int, mask):
    """flex over q/k/v of one row, run as `chunks` rows that each repeat the context keys."""
    def run(q, k, v, **kw):
        kc, vc = (torch.cat([t[:, :, :S].expand(chunks, -1, -1, -1), _to_chunks(t[:, :, S:], chunks)], 2)
                  for t in (k, v))
        out = flex(_to_chunks(q, chunks), kc, vc, **{**kw, "block_mask": mask})
        return out.transpose(0, 1).flatten(1, 2)[None]
    return run


def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [(int(a), int(b)) for a, b in (x.split("x") for x in text.split(","))]
    except ValueError:
        sys.exit(f"FLEX_SHAPES={text!r}: give anchors x block pairs separated by commas, e.g. 512x16,1024x32")
    if any(a < 1 or b < 1 for a, b in shapes):
        sys.exit(f"FLEX_SHAPES={text!r}: anchors and block must be >= 1")
    return shapes


if any(c < 1 for c in CHUNKS):
    sys.exit(f"FLEX_CHUNKS={CHUNKS}: every chunk count must be >= 1")
if LAYOUT == "trainer" and CHUNKS != [1]:
    sys.exit("FLEX_CHUNKS applies to FLEX_LAYOUT=heads or rows (the trainer's call takes its own mask)")
SHAPES = _shapes(os.environ.get("FLEX_SHAPES", "512x16,1024x32"))


def main() -> None:
    torch.manual_seed(0)
    S, H, KV, D = 3072, 32, 8, 128
    results = []
    for (A, bs), C in ((shape, c) for shape in SHAPES for c in CHUNKS):
        if A % C:
            sys.exit(f"FLEX_CHUNKS: {A} anchors do not split into {C} rows; pick chunk counts dividing every anchor count")
        anchors = torch.sort(torch.randperm(S - 1)[:A]).values[None].cuda()
        train_mask = build_train_mask(anchors, torch.ones_like(anchors, dtype=torch.bool), S, bs, "cuda", "flex")
        mask = as_block_mask(train_mask.mask)
        Q, L = A * bs, S + A * bs
        q = torch.randn(1, H, Q, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, KV, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, KV, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(1, H, Q, D, device="cuda", dtype=torch.bfloat16)
        if LAYOUT in ("rows", "trainer"):  # as the trainer passes them: [B, L, heads, D] rows viewed as [B, heads, L, D]
            q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True) for t in (q, k, v))
            g = g.transpose(1, 2).contiguous().transpose(1, 2)
        for name, opts in OPTIONS.items():
            if ONLY and name not in ONLY:
                continue
            if LAYOUT == "trainer":  # the trainer's own call: one compiled function for the whole process
                from dflash.models.attention import attend

                flex = lambda q, k, v, tm=train_mask, **_: attend(q, k, v, tm)  # noqa: E731
            else:
                torch._dynamo.reset()
                flex = torch.compile(flex_attention)
            if C > 1:
                cmask = as_block_mask(build_train_mask(anchors.view(C, A // C), torch.ones(C, A // C, dtype=torch.bool,
                                                                                       device="cuda"), S, bs, "cuda",
                                                       "flex").mask)
                flex = _chunked(flex, S, C, cmask)
            try:
                times = []
                t0 = time.perf_counter()
                for i in range(7):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=AUTOCAST):
                        out = flex(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=opts or None)
                    out.backward(g)
                    end.record()
                    end.synchronize()
                    if i == 1:
                        compile_s = time.perf_counter() - t0
                    if i >= 2:
                        times.append(start.elapsed_time(end))
                row = {"shape": f"{A}x{bs}", "chunks": C, "layout": LAYOUT, "autocast": AUTOCAST, "options": name,
                       "fwd_bwd_ms": sorted(times)[2], "compile_s": round(compile_s, 1)}
            except Exception as e:  # an option set the kernel refuses: recorded, the rest still run
                row = {"shape": f"{A}x{bs}", "options": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            results.append(row)
            print(json.dumps(row), flush=True)
    json.dump(results, sys.stdout if len(sys.argv) < 2 else open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
