"""Benchmark: how long a checkpoint save stalls the step loop, written on the training thread vs in the background.

Run (from the repository root):

    uv run python bench/save_stall.py                          # hidden 1024, 4 drafter layers, 12 steps, save every 3
    uv run python bench/save_stall.py --hidden 512 --steps 6   # a quick one
    PYTHONPATH=. python3 bench/save_stall.py --device cuda --hidden 5120 --layers 5 --out $OUT/h200_save_stall.json

Trains the same CPU run twice with the real trainer (``dflash.train.trainer.run``): a random-weight Qwen3-shaped
target of width --hidden and a drafter of --layers layers on the synthetic pattern data, a checkpoint every
--save-every steps, once with ``train.async_save = false`` and once with ``true``. Per save it records the metrics
row's ``save_stall_s`` (the training thread was blocked) and ``save_wait_s`` (of which waiting for the previous
save), and the write itself (``dflash.runs.checkpoint.write_checkpoint``, timed around each call, on whichever
thread runs it); per run the wall time and the checkpoint size. Writes --out (JSON, the command included).
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import environment, write_json  # noqa: E402
from dflash.config import config_from_dict  # noqa: E402
from dflash.data.synthetic import target_config, write_pattern_dataset, write_target  # noqa: E402
from dflash.runs import checkpoint as ckpt  # noqa: E402
from dflash.runs import rundir  # noqa: E402
from dflash.runs.metrics import read_metrics
from dflash.train.trainer import run  # noqa: E402


def config(root: Path, target: Path, data: Path, args, background: bool):
    return config_from_dict({
        "output_dir": str(root / ("async" if background else "sync")),
        "device": args.device,
        "target": {"path": str(target), "dtype": "float32" if args.device == "cpu" else "bfloat16"},
        "drafter": {"num_layers": args.layers, "block_size": 4},
        "data": {"path": str(data), "token_budget": 512, "max_batch_size": 8, "num_buckets": 2},
        "train": {"max_anchors": 16, "gamma": 4.0, "lr": 1e-3, "warmup_ratio": 0.1, "max_steps": args.steps,
                  "loss_chunk": 64, "log_every": 1, "save_every": args.save_every, "keep_last": 1,
                  "compile": False, "async_save": background},
    })


def one_run(cfg) -> dict:
    writes = []
    real = ckpt.write_checkpoint

    def timed(output_dir, snap, *rest, **kw):
        t0 = time.perf_counter()
        path = real(output_dir, snap, *rest, **kw)
        writes.append({"step": snap.step, "write_s": round(time.perf_counter() - t0, 3)})
        return path

    ckpt.write_checkpoint = timed
    try:
        t0 = time.perf_counter()
        assert run(cfg, None, log=lambda *_: None, progress=False) == 0
        wall = time.perf_counter() - t0
    finally:
        ckpt.write_checkpoint = real
    rows = {r["step"]: r for r in read_metrics(cfg.output_dir).rows}
    written = {w["step"]: w["write_s"] for w in writes}
    saves = [{"step": s, "stall_s": r["save_stall_s"], "wait_s": r["save_wait_s"], "write_s": written.get(s),
              **({"pin_s": r["save_pin_s"]} if "save_pin_s" in r else {}),
              **({"pin_wait_s": r["save_pin_wait_s"]} if "save_pin_wait_s" in r else {})}
             for s, r in sorted(rows.items()) if "save_stall_s" in r]
    last = rundir.list_checkpoints(cfg.output_dir)[-1]
    size = sum(p.stat().st_size for p in last.rglob("*") if p.is_file())
    steps = [r for s, r in rows.items() if "tok_per_s" in r and s > 1]
    return {"async_save": cfg.train.async_save, "wall_s": round(wall, 2), "checkpoint_bytes": size,
            "saves": saves, "max_stall_s": max(s["stall_s"] for s in saves),
            "mean_write_s": round(sum(s["write_s"] for s in saves) / len(saves), 3),
            "mean_tok_per_s": round(sum(r["tok_per_s"] for r in steps) / max(len(steps), 1), 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024, help="target (and drafter) hidden size")
    p.add_argument("--layers", type=int, default=4, help="drafter layers")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu, or cuda (pinned host buffers and one synchronize per save; "
                   "--hidden 5120 --layers 5 is about the users' 27B drafter state)")
    p.add_argument("--background-only", action="store_true", help="skip the run that saves on the training thread")
    p.add_argument("--out", type=Path, default=Path("bench/results/cpu2_save_stall.json"))
    args = p.parse_args(argv)
    for name, low in (("hidden", 64), ("layers", 1), ("steps", 1), ("save_every", 1)):
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.hidden % 64:
        p.error(f"--hidden must be a multiple of 64 (64-wide heads), got {args.hidden}")
    if args.save_every > args.steps:
        p.error(f"--save-every {args.save_every} is more than --steps {args.steps}: the run would save only at its end")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="save-stall-") as tmp:
        root = Path(tmp)
        heads = args.hidden // 64
        target = write_target(root / "target", target_config(
            "qwen3", hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=8,
            num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), head_dim=64, pad_token_id=0))
        data = write_pattern_dataset(root / "data")
        results = []
        for background in (True,) if args.background_only else (False, True):
            cfg = config(root, target, data, args, background)
            results.append(one_run(cfg))
            shutil.rmtree(cfg.output_dir)  # a 27B-class drafter's checkpoints are ~20 GB each: free the disk first
            r = results[-1]
            print(f"async_save={str(background).lower():5} checkpoint {r['checkpoint_bytes'] / 2**20:.0f} MiB: "
                  f"stall per save {[s['stall_s'] for s in r['saves']]} s (of which waiting for the previous save "
                  f"{[s['wait_s'] for s in r['saves']]} s; buffers pinned "
                  f"beforehand in {[s['pin_s'] for s in r['saves'] if 'pin_s' in s]} s), write {[s['write_s'] for s in r['saves']]}"
                  f" s; run {r['wall_s']} s, {r['mean_tok_per_s']} tok/s", flush=True)
    env = environment(torch, args.device)
    env["machine"] = f"{platform.machine()}, {torch.get_num_threads()} torch threads"
    write_json(args.out, {"env": env, "args": {k: str(v) for k, v in vars(args).items()}, "results": results})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
