"""Launch to first step of the tiny compiled preset, cold vs from the compile cache artifact, each in a fresh process
with empty inductor and Triton caches (docs/training.md, "The compile cache artifact").

DFLASH_CPU_COMPILE=1 compiles the drafter's pieces with inductor on the CPU (C++ kernels); on a GPU the same script
runs the preset on CUDA with --device cuda (the target's layers, the drafter and flex attention compiled).

    uv run python bench/compile_artifact.py --runs 2                       # CPU
    PYTHONPATH=. python3 bench/runner.py artifact-tiny --deadline 570                      # one GPU, through the runner

First `dflash-train --warm-cache` (empty caches) writes the artifact; then, per run, one training run (2 steps) with
train.compile_cache naming a file that does not exist (cold) and one with the artifact (warm), both with empty
caches. Prints each run's launch-to-first-step seconds from outcome.json (`startup.launch_to_first_step_s`) and
the FX graph cache hits and misses from its "compile:" line; --out writes them as JSON with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, write_json  # noqa: E402
from dflash.data.synthetic import target_config, write_pattern_dataset, write_target  # noqa: E402


def tiny_preset(root: Path, device: str) -> Path:
    """The tests' tiny preset (tests/trainkit.py: a 4-layer random Qwen3 target, a 1-layer drafter, 64 pattern
    samples), compiled, as root/run.toml."""
    target = write_target(root / "tiny-target", target_config("qwen3", pad_token_id=0, initializer_range=0.15))
    data = write_pattern_dataset(root / "data")
    raw = {"output_dir": str(root / "run"), "device": device,
           "target": {"path": str(target), "dtype": "float32"},
           "drafter": {"num_layers": 1, "block_size": 4},
           "data": {"path": str(data), "token_budget": 512, "max_batch_size": 8, "num_buckets": 2},
           "train": {"max_anchors": 16, "gamma": 4.0, "lr": 1e-2, "warmup_ratio": 0.1, "max_steps": 2,
                     "loss_chunk": 64, "log_every": 1, "save_every": 10, "keep_last": 2, "compile": True}}
    lines = [f"{k} = {json.dumps(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    for key, value in raw.items():
        if isinstance(value, dict):
            lines += [f"[{key}]", *(f"{k} = {json.dumps(v)}" for k, v in value.items())]
    (root / "run.toml").write_text("\n".join(lines) + "\n")
    return root / "run.toml"


EXTRA: list[str] = ["--waive", "model-source", "--reason", "bench on a working tree"]  # the gate's waivers


def fresh(root: Path, config: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """dflash-train in a new process with empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR; (its result, wall s)."""
    caches = Path(tempfile.mkdtemp(prefix="caches-", dir=root))
    env = dict(os.environ, DFLASH_CPU_COMPILE="1", TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
               TRITON_CACHE_DIR=str(caches / "triton"),
               PYTHONPATH=os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x))  # carried wheels
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dflash.commands.train", "--config", str(config), "--no-progress",
                           *EXTRA, *args],
                          cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"dflash-train {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return proc, wall


def one_run(root: Path, config: Path, artifact: Path) -> dict:
    proc, wall = fresh(root, config, "--fresh", "--set", f"train.compile_cache={json.dumps(str(artifact))}")
    outcome = json.loads((root / "run" / "outcome.json").read_text())
    hits = re.search(r"\(inductor: (\d+) from its cache, (\d+) compiled from scratch\)", proc.stdout)
    loaded = next((line for line in proc.stdout.splitlines() if line.startswith("compile cache:")), None)
    return {"launch_to_first_step_s": outcome["startup"]["launch_to_first_step_s"], "startup": outcome["startup"],
            "fx_graph_hits": int(hits[1]) if hits else None, "fx_graph_misses": int(hits[2]) if hits else None,
            "wall_s": round(wall, 1), "compile_cache_line": loaded and loaded.replace(f"{root}{os.sep}", "")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2, help="cold + warm pairs after the one --warm-cache")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    p.add_argument("train_args", nargs="*", help="after --: dflash-train arguments for every run (the device's "
                   "--waive/--reason pairs; they replace the model-source waiver)")
    args = p.parse_args()
    if args.train_args:
        EXTRA[:] = args.train_args
    with tempfile.TemporaryDirectory(prefix="dflash-artifact-bench-") as tmp:
        root = Path(tmp)
        config = tiny_preset(root, args.device)
        artifact = root / "tiny.dfcache"
        proc, wall = fresh(root, config, "--warm-cache", "--set", f"train.compile_cache={json.dumps(str(artifact))}")
        print("\n".join(line.replace(f"{root}{os.sep}", "") for line in proc.stdout.splitlines()
                        if line.startswith("warm-cache:")), flush=True)
        from dflash.runs.compile_artifact import read_header

        header = read_header(artifact)[0]
        manifest = header["manifest"]
        rows = []
        for k in range(args.runs):
            for kind, path in (("cold", root / "none.dfcache"), ("warm", artifact)):
                row = {"run": k + 1, "kind": kind, **one_run(root, config, path)}
                rows.append(row)
                print(f"run {row['run']} {kind}: launch to first step {row['launch_to_first_step_s']} s (wall "
                      f"{row['wall_s']} s); inductor graphs {row['fx_graph_hits']} from the cache, "
                      f"{row['fx_graph_misses']} from scratch", flush=True)
    if args.out:
        write_json(args.out, {"device": args.device, "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                              "warm_cache": {"wall_s": round(wall, 1), "cold": manifest.get("cold"),
                                             "warm": manifest.get("warm"), "size_bytes": header["size"]},
                              "runs": rows})


if __name__ == "__main__":
    main()
