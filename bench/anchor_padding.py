"""Share of padded anchor slots: how much drafter work goes to invalid blocks in the [B, A] anchor layout.

A batch's rows share one anchor count A (the largest row's); a row with fewer anchors carries invalid blocks
that still go through the drafter layers. With train.batch_anchors the batch's anchors are split over its rows
as evenly as their eligible positions allow (dflash.train.loss.anchor_quotas), which keeps A tight. This walks the
real sampler and collate over a synthetic lognormal length mix (CPU, seconds):

    uv run python bench/anchor_padding.py                  # 2000 samples, mean 1500 tokens, sigma 0.8
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.data.batching import collate
from dflash.data.buckets import BucketBatchSampler
from dflash.data.shards import ShardDataset
from dflash.data.synthetic import write_random_dataset
from dflash.train.loss import anchor_quotas

SETTINGS = (  # (token_budget, max_batch_size, batch_anchors, max_anchors)
    (16384, 16, 1024, 1024), (49152, 64, 1024, 1024), (16384, 16, None, 512), (49152, 64, None, 1024),
)


def padded_share(dataset, budget: int, rows: int, batch_anchors: int | None, max_anchors: int, batches: int) -> float:
    sampler = BucketBatchSampler(dataset.lengths, budget, rows, 16, 0)
    real = slots = 0
    for _, _, indices in itertools.islice(iter(sampler), batches):
        cap = collate(dataset, indices, 0)["eligible_anchors"].clamp(max=max_anchors)
        if batch_anchors is not None and int(cap.sum()) > batch_anchors:
            cap = anchor_quotas(cap, batch_anchors)
        real += int(cap.sum())
        slots += max(1, int(cap.max())) * len(indices)
    return 1 - real / slots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--length", type=int, default=1500, help="mean tokens per sample")
    ap.add_argument("--sigma", type=float, default=0.8, help="lognormal sigma of the lengths")
    ap.add_argument("--batches", type=int, default=150)
    args = ap.parse_args()
    for name in ("samples", "length", "batches"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.sigma < 0:
        ap.error(f"--sigma must be >= 0, got {args.sigma}")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_dataset(Path(tmp) / "mix", args.samples, args.length, 151936, sigma=args.sigma,
                                    max_length=8192, seed=0)
        dataset = ShardDataset(path)
        for budget, rows, batch_anchors, max_anchors in SETTINGS:
            share = padded_share(dataset, budget, rows, batch_anchors, max_anchors, args.batches)
            print(f"token_budget {budget:6d}  max_batch_size {rows:3d}  batch_anchors {batch_anchors!s:>5}  "
                  f"max_anchors {max_anchors:5d}: {100 * share:4.1f}% of anchor slots padded")


if __name__ == "__main__":
    main()
