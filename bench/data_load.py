"""Benchmark: open a ~1.1M-sample Arrow dataset, build the bucket sampler, read random samples.

Run (from the repository root):

    uv run python bench/data_load.py                       # 1.1M samples, mean ~2,826 tokens (~15 GB)
    uv run python bench/data_load.py --samples 100000 --out .cache/bench-small
    uv run python bench/data_load.py --mean-length 300      # same sample count, ~1.6 GB on disk
    uv run python bench/data_load.py --clean                # delete the generated data afterwards

The synthetic shards (dflash.data.synthetic.write_random_dataset) are written once under --out
(default .cache/bench-data/load, git-ignored) and reused by later runs with the same
--samples/--mean-length/--max-length. Before the "cold" pass every shard is
dropped from the page cache (posix_fadvise DONTNEED), so it measures reads from disk; the "warm"
pass repeats it with the cache filled. Lengths are lognormal (sigma 0.8) capped at --max-length,
like the incident's merged dataset (1,095,082 samples, mean 2,826 tokens); the first quarter of
each sample is its prompt (loss_mask 0).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.data.buckets import BucketBatchSampler
from dflash.data.shards import ShardDataset
from dflash.data.synthetic import write_random_dataset

SAMPLES_PER_SHARD = 50_000
VOCAB = 151_936  # Qwen3 vocabulary size: token ids are drawn below it


def generate(out: Path, samples: int, mean_length: int, max_length: int, seed: int) -> None:
    """Write the synthetic shards (dflash.data.synthetic keeps a folder already holding the same set)."""
    t0 = time.perf_counter()
    write_random_dataset(out, samples, mean_length, VOCAB, sigma=0.8, max_length=max_length, prompt_share=0.25,
                         seed=seed, per_shard=SAMPLES_PER_SHARD)
    size = sum(p.stat().st_size for p in out.glob("*.arrow"))
    print(f"{samples:,} samples, {size / 2**30:.1f} GiB of shards ready in {time.perf_counter() - t0:.0f} s")


def drop_page_cache(out: Path) -> None:
    for p in out.glob("*.arrow"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def measure(out: Path, args: argparse.Namespace, label: str) -> ShardDataset:
    ds, t_open = timed(lambda: ShardDataset(out))
    lengths, t_len = timed(lambda: ds.lengths)
    sampler, t_sampler = timed(
        lambda: BucketBatchSampler(lengths, args.token_budget, args.max_batch_size, args.num_buckets, seed=0)
    )
    batches, t_epoch = timed(lambda: sampler.epoch_batches(0))
    padded = sum(int(lengths[b].max()) * len(b) for b in batches)
    picks = np.random.default_rng(1).integers(0, len(ds), size=args.reads)
    read_tokens, t_read = timed(lambda: sum(ds.get(int(i))[0].size for i in picks))
    print(
        f"[{label}] open {len(ds.shards)} shards + lengths of {len(ds):,} samples: {t_open:.3f} s "
        f"(lengths attribute {t_len * 1e6:.0f} us) | sampler: {t_sampler:.3f} s | "
        f"epoch_batches: {t_epoch:.3f} s ({len(batches):,} batches, real/padded tokens "
        f"{ds.num_tokens / padded:.1%}) | "
        f"{args.reads:,} random get(): {t_read:.3f} s ({t_read / args.reads * 1e3:.2f} ms each, "
        f"{read_tokens / t_read / 1e6:.1f} M tok/s)"
    )
    return ds, sampler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1_100_000, help="samples to generate")
    ap.add_argument("--mean-length", type=int, default=2826, help="mean sample length (tokens)")
    ap.add_argument("--max-length", type=int, default=32768, help="length cap (tokens)")
    ap.add_argument("--out", type=Path, default=Path(".cache/bench-data/load"), help="shard folder (git-ignored)")
    ap.add_argument("--token-budget", type=int, default=49152)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--num-buckets", type=int, default=16)
    ap.add_argument("--reads", type=int, default=1000, help="random samples read")
    ap.add_argument("--clean", action="store_true", help="delete --out when done")
    ap.add_argument("--generate-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.generate_only:
        generate(args.out, args.samples, args.mean_length, args.max_length, seed=0)
        return
    # generate in a child process so this one's peak RSS measures loading only
    cmd = [sys.executable, __file__, "--generate-only", "--samples", str(args.samples),
           "--mean-length", str(args.mean_length), "--max-length", str(args.max_length), "--out", str(args.out)]
    subprocess.run(cmd, check=True)

    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, {platform.machine()}")
    drop_page_cache(args.out)
    measure(args.out, args, "cold")
    ds, sampler = measure(args.out, args, "warm")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    size = sum(p.stat().st_size for p in ds.shards)
    print(f"{ds.num_tokens:,} tokens, {size / 2**30:.1f} GiB of shards; peak RSS of this process {rss:.0f} MiB")
    print(sampler.summary())
    if args.clean:
        shutil.rmtree(args.out)
        print(f"deleted {args.out}")


if __name__ == "__main__":
    main()
