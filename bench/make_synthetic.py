"""Write a synthetic Arrow dataset of random token ids (dflash.data.synthetic.write_random_dataset) for GPU runs.

    PYTHONPATH=. python3 bench/make_synthetic.py --out .cache/syn-3072 --samples 256 --length 3072 --vocab 151936
    PYTHONPATH=. python3 bench/make_synthetic.py --out .cache/syn-mix --samples 10000 --length 2826 --sigma 0.8

Every sample is --length tokens, or with --sigma a lognormal length mix of mean --length (capped
at --max-length). Loss mask: 0 on the first --prompt-share of each sample (the "prompt"), 1 after.
Random ids are fine for speed and memory measurements: the work per step depends on shapes, not
on token values. A folder already holding the same dataset is kept as is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.data.synthetic import write_random_dataset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder to write shards into (created)")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--length", type=int, default=3072, help="tokens per sample (the mean with --sigma)")
    ap.add_argument("--sigma", type=float, default=0.0, help="lognormal sigma of the lengths (0: all --length)")
    ap.add_argument("--max-length", type=int, default=None, help="length cap with --sigma (default: none)")
    ap.add_argument("--prompt-share", type=float, default=0.1, help="share of each sample with loss_mask 0")
    ap.add_argument("--vocab", type=int, default=151936, help="token ids are drawn in [1, vocab - 1)")
    ap.add_argument("--per-shard", type=int, default=4096, help="samples per shard")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = write_random_dataset(args.out, args.samples, args.length, args.vocab, sigma=args.sigma,
                               max_length=args.max_length, prompt_share=args.prompt_share, seed=args.seed,
                               per_shard=args.per_shard)
    print(f"wrote {args.samples} samples of {args.length} tokens{' (mean)' if args.sigma else ''} to {out}")


if __name__ == "__main__":
    main()
