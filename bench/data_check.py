"""Benchmark: what preflight's integrity checks cost per billion tokens and per GB.

Run (from the repository root):

    uv run python bench/data_check.py                       # ~1.0 B tokens (~5 GiB of shards), then keeps them
    uv run python bench/data_check.py --tokens 2e8 --clean  # a quick one; delete the shards afterwards

Measures, on synthetic shards (``dflash.data.synthetic.write_random_dataset``: lognormal lengths with
the incident's merged mean of 2,202 tokens, ids below the Qwen3.6 vocabulary of 248,320, the
first quarter of each sample its prompt), written once under --out (git-ignored) and reused:

- ``dataset`` check, default path: ``preflight.facts.dataset.scan_shard`` over every shard, the exact code
  preflight runs through the trainer's own reader ``dflash.data.shards.open_shard`` (list lengths, samples over
  the budget, token id and loss_mask ranges and the learnable positions, vectorised by
  ``dflash.data.identity.value_stats``); cold (page cache dropped with posix_fadvise DONTNEED) and warm; and
  ``value_stats`` alone on the opened tables;
- ``--verify-data``: sha256 of every shard (``dflash.filehash.sha256_files``, one thread per file),
  cold and warm, and one file on one thread (what bounds a checkpoint's largest file, optimizer.pt);
- what those speeds mean for the incident's run (2.41 B tokens; the Qwen3.6-27B-class preset's
  checkpoint size from the memory model).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.data.identity import shard_files, value_stats
from dflash.data.shards import open_shard
from dflash.data.synthetic import write_random_dataset
from dflash.filehash import sha256_file, sha256_files  # noqa: E402
from preflight.facts.dataset import scan_shard  # noqa: E402

VOCAB = 248_320  # Qwen3.6-27B's vocabulary
INCIDENT_TOKENS = 2.41e9  # the merged dataset of the incident
PER_SHARD = 50_000  # samples per shard
PRESET = "configs/qwen3-27b-5t3d.toml"  # its checkpoint size comes from the memory model


def drop_page_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def scan(paths, limit: int):
    """preflight's dataset facts for these shards: (seconds, tokens, merged value stats)."""
    t0 = time.perf_counter()
    shards, first = [], 0
    for p in paths:
        s = scan_shard(p, limit, first)
        assert s.error is None, s.error
        first += s.rows
        shards.append(s)
    dt = time.perf_counter() - t0
    stats = shards[0].values
    for s in shards[1:]:
        stats = stats.merge(s.values)
    return dt, sum(s.tokens for s in shards), stats


def values_only(paths) -> float:
    """value_stats alone over tables already mapped (no length or budget work): seconds."""
    total = 0.0
    for p in paths:
        opened = open_shard(p)
        t0 = time.perf_counter()
        value_stats(opened.column("input_ids"), opened.column("loss_mask"))
        total += time.perf_counter() - t0
        opened.close()
    return total


def hash_all(paths) -> float:
    t0 = time.perf_counter()
    out = sha256_files(paths)
    assert not any(isinstance(v, OSError) for v in out.values())
    return time.perf_counter() - t0


def checkpoint_bytes() -> tuple[int, int] | None:
    """(checkpoint bytes, optimizer.pt bytes) of the 27B-class preset per the memory model, or None."""
    try:
        from dflash.config import load_config
        from dflash.memory.shape import drafter_params, load_target_shape

        cfg = load_config(PRESET)
        n = drafter_params(cfg, load_target_shape(cfg.target.path))
    except Exception as e:  # noqa: BLE001 - a missing preset only drops the projection
        print(f"(no checkpoint projection: {e})")
        return None
    return 12 * n, 8 * n  # fp32 weights + AdamW m and v; optimizer.pt holds m and v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=float, default=1e9, help="tokens to generate (about)")
    ap.add_argument("--mean-length", type=int, default=2202, help="mean sample length (tokens)")
    ap.add_argument("--out", type=Path, default=Path(".cache/bench-data/check"), help="shard folder (git-ignored)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--clean", action="store_true", help="delete --out when done")
    ap.add_argument("--generate-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    samples = max(1, int(args.tokens / args.mean_length))
    if args.generate_only:
        write_random_dataset(args.out, samples, args.mean_length, VOCAB, sigma=0.8, max_length=32768,
                             prompt_share=0.25, seed=0, per_shard=PER_SHARD)
        return
    t0 = time.perf_counter()  # a child process writes the shards, so this one measures reading only
    subprocess.run([sys.executable, __file__, "--generate-only", "--tokens", str(args.tokens), "--mean-length",
                    str(args.mean_length), "--out", str(args.out)], check=True)
    paths = shard_files(args.out)
    size = sum(p.stat().st_size for p in paths)
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, {platform.machine()}, "
          f"{platform.processor() or 'cpu'}; shards ready in {time.perf_counter() - t0:.0f} s")

    figures: dict = {"cpus": os.cpu_count(), "shards": len(paths), "bytes": size}
    for label in ("cold", "warm"):
        if label == "cold":
            drop_page_cache(paths)
        dt, tokens, stats = scan(paths, 32768)
        figures[f"scan_{label}_s"] = dt
        figures[f"scan_{label}_s_per_btok"] = dt / tokens * 1e9
        print(f"[{label}] dataset facts (lengths, id/mask ranges, learnable positions) of {tokens:,} tokens in "
              f"{len(paths)} shards ({size / 2**30:.2f} GiB): {dt:.2f} s = {dt / tokens * 1e9:.2f} s per billion "
              f"tokens; ids {stats.min_id}..{stats.max_id}, loss_mask {stats.mask_min}..{stats.mask_max}, "
              f"{stats.anchors:,} learnable positions")
    figures["tokens"] = tokens
    dt = values_only(paths)
    figures["values_only_s_per_btok"] = dt / tokens * 1e9
    print(f"[warm] value_stats alone: {dt:.2f} s = {dt / tokens * 1e9:.2f} s per billion tokens")

    for label in ("cold", "warm"):
        if label == "cold":
            drop_page_cache(paths)
        dt = hash_all(paths)
        figures[f"sha256_{label}_gb_s"] = size / dt / 1e9
        print(f"[{label}] --verify-data sha256 of {len(paths)} shards, {min(len(paths), os.cpu_count() or 1, 16)} "
              f"threads: {dt:.2f} s = {size / dt / 1e9:.2f} GB/s = {dt / tokens * 1e9:.2f} s per billion tokens")
    biggest = max(paths, key=lambda p: p.stat().st_size)
    t1 = time.perf_counter()
    sha256_file(biggest)
    one = biggest.stat().st_size / (time.perf_counter() - t1) / 1e9
    figures["sha256_one_thread_gb_s"] = one
    print(f"[warm] sha256 of one file on one thread: {one:.2f} GB/s")

    per_btok = figures["scan_warm_s_per_btok"], figures["scan_cold_s_per_btok"]
    print(f"incident's {INCIDENT_TOKENS / 1e9:.2f} B tokens: dataset check ~{per_btok[0] * INCIDENT_TOKENS / 1e9:.1f} s "
          f"warm / {per_btok[1] * INCIDENT_TOKENS / 1e9:.1f} s cold; --verify-data sha256 ~"
          f"{size / tokens * INCIDENT_TOKENS / 1e9 / figures['sha256_warm_gb_s']:.1f} s warm")
    ck = checkpoint_bytes()
    if ck:
        total, opt = ck
        figures.update(checkpoint_bytes=total, optimizer_bytes=opt)
        print(f"{PRESET} checkpoint: {total / 2**30:.1f} GiB ({opt / 2**30:.1f} GiB optimizer.pt): recording or "
              f"verifying its sha256 takes ~{opt / 1e9 / one:.1f} s (its largest file on one thread; the others "
              "in parallel)")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    if args.clean:
        shutil.rmtree(args.out)
        print(f"deleted {args.out}")


if __name__ == "__main__":
    main()
