"""Write a synthetic Arrow dataset of fixed-length samples (random token ids) for GPU runs.

    PYTHONPATH=. python3 bench/make_synthetic.py --out .cache/syn-3072 --samples 256 --length 3072 --vocab 151936

Loss mask: 0 on the first 10% of each sample (the "prompt"), 1 after. Random ids are fine for
speed and memory measurements: the work per step depends on shapes, not on token values.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from dflash.data import write_shard_arrays


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder to write shards into (created)")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--length", type=int, default=3072, help="tokens per sample")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--per-shard", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    prompt = max(1, args.length // 10)
    for s, start in enumerate(range(0, args.samples, args.per_shard)):
        n = min(args.per_shard, args.samples - start)
        ids = rng.integers(0, args.vocab, size=n * args.length, dtype=np.int64)
        mask = np.tile(np.r_[np.zeros(prompt, np.int64), np.ones(args.length - prompt, np.int64)], n)
        offsets = np.arange(n + 1, dtype=np.int64) * args.length
        write_shard_arrays(out / f"shard-{s:05d}.arrow", offsets, ids, mask)
    print(f"wrote {args.samples} samples x {args.length} tokens to {out}")


if __name__ == "__main__":
    main()
