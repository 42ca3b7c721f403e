"""Packed batches against length buckets on the users' length mix: batches an epoch, the share of the token budget
they fill (real tokens / (batches x token_budget)) and the seconds each sampler takes to build and to list an epoch.
Lengths only (no shards, no torch; CPU, seconds):

    uv run python bench/packing.py                          # 3,000 and 1,000,000 samples
    uv run python bench/packing.py --samples 50000 --sigma 0.8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.data.buckets import BucketBatchSampler
from dflash.data.packing import PackedBatchSampler


def lognormal_mix(n: int, mean: float, sigma: float, budget: int, seed: int) -> np.ndarray:
    """n lengths, lognormal with this mean (tokens) and sigma, clipped to [16, budget]."""
    mu = np.log(mean) - sigma ** 2 / 2
    return np.clip(np.random.default_rng(seed).lognormal(mu, sigma, size=n), 16, budget).astype(np.int64)


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, nargs="+", default=[3000, 1_000_000])
    ap.add_argument("--mean", type=float, default=2826.0, help="mean length (tokens): the users' new completions")
    ap.add_argument("--sigma", type=float, default=0.6)
    ap.add_argument("--token-budget", type=int, default=49152)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--num-buckets", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    budget, rows = args.token_budget, args.max_batch_size
    samplers = {
        "buckets": lambda lengths: BucketBatchSampler(lengths, budget, rows, args.num_buckets, 0),
        "buckets + pack_remainders": lambda lengths: BucketBatchSampler(lengths, budget, rows, args.num_buckets, 0,
                                                                        pack_remainders=True),
        "packing": lambda lengths: PackedBatchSampler(lengths, budget, rows, 0),
    }
    print(f"lognormal mean {args.mean:,.0f} sigma {args.sigma}, clipped to [16, {budget:,}]; token_budget {budget:,}, "
          f"max_batch_size {rows}, num_buckets {args.num_buckets}")
    for n in args.samples:
        lengths = lognormal_mix(n, args.mean, args.sigma, budget, args.seed)
        print(f"{n:,} samples, {int(lengths.sum()):,} tokens (at least {-(-int(lengths.sum()) // budget):,} batches)")
        for name, build in samplers.items():
            sampler, t_build = timed(build, lengths)
            _, t_epoch = timed(sampler.epoch_batches, 0)
            print(f"  {name:<26} {sampler.batches_per_epoch:>9,} batches  fill {sampler.fill:6.1%}  "
                  f"build {t_build:6.3f} s  epoch {t_epoch:6.3f} s")


if __name__ == "__main__":
    main()
