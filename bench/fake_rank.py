"""Benchmark: one rank of a co-located data-parallel run of N GPUs, measured on one GPU (issue #40).

Run (from the repository root):

    PYTHONPATH=. python3 bench/fake_rank.py --config configs/qwen3.6-27b-8gpu.toml --gpu-memory 95GiB \\
        --set data.path=\\".cache/syn-lognormal-2826\\" --max-steps 64 --out $OUT/h200_fake_rank_mix.json
    uv run python bench/fake_rank.py --tiny --world 8 --max-steps 4 --out fake_rank.json   # CPU smoke run

torch's fake process group (``FakeStore``, backend "fake") makes this process rank 0 of --world ranks (default: the
config's topology.colocated_gpus): FSDP2 keeps 1/N of each drafter layer here and every collective returns at once
without moving data. So the memory is one rank's of the real run and the step time is its compute without
communication; the losses are not a real run's (the gradients are never reduced), and the checkpoint saved is not
one either (nothing is gathered). The real trainer (``dflash.train.trainer.Trainer.colocated``) trains this rank's
batches of each step (global batch j with j % N == 0), held to --gpu-memory with
``torch.cuda.set_per_process_memory_fraction``, which its auto recompute and data_parallel read as the GPU's size.
There is no preflight gate: this measures, it trains nothing anyone keeps.

Writes --out (JSON): the command and environment; what the trainer resolved (data_parallel, recompute and why);
the memory model's peak for that resolution at --gpu-memory (``dflash.memory.parts``, what dflash-estimate prints
for the config) against the NVML peak over the whole run, sampled every 50 ms, and torch's peaks reserved and allocated; every
step's time (metrics.jsonl, logged every step) and their median after step 10; the graphs compiled and recompiles.
Exit 1 when the run failed (an out-of-memory included: the JSON says so), 2 for bad input.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import TINY_TARGET, Nvml, NvmlPeak, environment, parse_sets, write_json  # noqa: E402
from dflash.config import dump_config, load_config  # noqa: E402
from dflash.runs.metrics import read_metrics  # noqa: E402

GiB = 2**30
STEADY_AFTER = 10  # steps whose time is left out of the median (compilation, cold caches)


def tiny_config(root: Path, world: int) -> Path:
    """The tiny CPU preset co-located over `world` ranks under FSDP2: a Qwen3 target of hidden 64 (config only)."""
    from dflash.data.synthetic import write_pattern_dataset, write_target

    target = write_target(root / "tiny-target", TINY_TARGET, weights=False)
    data = write_pattern_dataset(root / "data", samples=512)
    gpus = ", ".join(f'"{i}"' for i in range(world))
    path = root / "tiny.toml"
    path.write_text(f"""output_dir = "{root / 'run'}"
device = "cpu"
[target]
path = "{target}"
dtype = "float32"
random_init = true
[drafter]
num_layers = 2
block_size = 4
[data]
path = "{data}"
token_budget = 512
max_batch_size = 8
[train]
max_anchors = 16
gamma = 4.0
loss_chunk = 64
compile = false
data_parallel = "fsdp2"
[topology]
colocated_gpus = [{gpus}]
""")
    return path


def predicted(cfg, trainer, cap: int | None) -> dict:
    """The memory model's peak for what the trainer resolved (data_parallel, recompute), at this GPU size."""
    from dflash.memory.parts import role_need_bytes, with_parallel, with_recompute

    if trainer.device.type != "cuda":
        return {"predicted_gib": None}
    resolved = with_recompute(with_parallel(cfg, trainer.data_parallel), trainer.recompute)
    need = role_need_bytes(resolved, cfg.topology.trainer_role, torch.version.cuda or "12.8")
    return {"predicted_gib": round(need / GiB, 2), "gpu_memory_gib": round(cap / GiB, 2) if cap else None}


def _local(p: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this rank holds (FSDP2's shard of a DTensor)."""
    return p.to_local() if hasattr(p, "to_local") else p


def step_times(run_dir: Path) -> dict:
    """Every step's seconds (logged every step: its tokens over its tok/s) and the median after STEADY_AFTER."""
    rows = [r for r in read_metrics(run_dir).rows if r.get("tok_per_s")]
    steps = [{"step": r["step"], "tokens": r["tokens"], "tok_per_s": r["tok_per_s"],
              "step_s": round(r["tokens"] / r["tok_per_s"], 3), "compiled_graphs": r.get("compiled_graphs"),
              "recompiles": r.get("recompiles"), "mem_gib": r.get("mem_gib")} for r in rows]
    steady = [s for s in steps if s["step"] > STEADY_AFTER]
    out = {"steps": steps, "steady_steps": len(steady)}
    if steady:
        out.update(median_step_s=round(statistics.median(s["step_s"] for s in steady), 3),
                   median_tok_per_s=round(statistics.median(s["tok_per_s"] for s in steady), 1),
                   mean_tok_per_s=round(sum(s["tokens"] for s in steady) / sum(s["step_s"] for s in steady), 1),
                   graphs_after_step_1=(steps[-1]["compiled_graphs"] or 0) - (steps[0]["compiled_graphs"] or 0))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="the co-located data-parallel run config (topology.colocated_gpus)")
    ap.add_argument("--tiny", action="store_true", help="the tiny CPU preset instead (a smoke run)")
    ap.add_argument("--world", type=int, help="ranks the fake group stands for (default: topology.colocated_gpus)")
    ap.add_argument("--gpu-memory", help="hold this process to this much GPU memory, e.g. 95GiB (default: all)")
    ap.add_argument("--max-steps", type=int, default=64)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a run config override, as dflash-train --set")
    ap.add_argument("--out", required=True, type=Path, help="the JSON to write")
    args = ap.parse_args(argv)
    prog = "fake_rank.py"
    if args.tiny == bool(args.config):
        ap.error("give --config RUN.toml or --tiny")
    if args.tiny:
        root = args.out.resolve().parent / "fake_rank_tiny"
        root.mkdir(parents=True, exist_ok=True)
        args.config = str(tiny_config(root, args.world or 8))
    overrides = parse_sets(args.sets, args.config, prog)
    overrides.update({"train.max_steps": args.max_steps, "train.log_every": 1})
    overrides.setdefault("target.random_init", True)  # one rank's memory and compute: the shapes, not the weights
    cfg = load_config(args.config, overrides)
    world = args.world or len(cfg.topology.colocated_gpus)
    if cfg.topology.layout != "colocated-dp" or world < 2:
        print(f"{prog}: error: {args.config} is not co-located data parallel over 2 or more GPUs; set "
              "topology.colocated_gpus (or --world N)", file=sys.stderr)
        return 2
    cap = None
    if args.gpu_memory:
        from preflight.estimate import EstimateError, parse_size

        try:
            cap = parse_size(args.gpu_memory)
        except EstimateError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            print(f"{prog}: error: {args.config} trains on cuda but torch sees no GPU; use --tiny on CPU", file=sys.stderr)
            return 1
        total = torch.cuda.get_device_properties(0).total_memory
        if cap is not None:
            if cap > total:
                print(f"{prog}: error: --gpu-memory {args.gpu_memory} is more than this GPU's "
                      f"{total / GiB:.1f} GiB", file=sys.stderr)
                return 2
            torch.cuda.set_per_process_memory_fraction(cap / total)

    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dflash.runs import rundir
    from dflash.train.trainer import Trainer

    out = Path(cfg.output_dir)
    if out.exists() and any(out.iterdir()):
        print(f"{prog}: error: output dir {out} is not empty; give a new one (--set output_dir='\"runs/NAME\"')",
              file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / rundir.CONFIG_NAME).write_text(dump_config(cfg))
    os.environ.update(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    doc: dict = {"env": environment(torch, cfg.device), "config": args.config, "world": world,
                 "sets": args.sets, "max_steps": args.max_steps}
    nvml = Nvml(enabled=cfg.device == "cuda")
    t0 = time.perf_counter()
    code = 1
    with NvmlPeak(nvml, interval=0.05) as peak:
        try:
            trainer = Trainer.colocated(cfg, None, group=dist.new_group(list(range(world))),
                                        log=lambda *a, **k: print(*a, **k, flush=True))
            doc.update(data_parallel=trainer.data_parallel, parallel_why=trainer.parallel_why,
                       recompute=trainer.recompute, recompute_why=trainer.recompute_why,
                       drafter_params=sum(p.numel() for p in trainer.drafter.parameters()),
                       local_params=sum(_local(p).numel() for p in trainer.drafter.parameters()),
                       **predicted(cfg, trainer, cap))
            code = trainer.run(progress=False)
        except torch.OutOfMemoryError as e:
            doc["error"] = f"out of memory: {str(e).splitlines()[0]}"
        except Exception as e:  # recorded, and the run's exit says it failed
            doc["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
    doc.update(ok=code == 0 and "error" not in doc, wall_s=round(time.perf_counter() - t0, 1),
               nvml_peak_gib=round(peak.peak / GiB, 2) if peak.peak is not None else None,
               torch_max_reserved_gib=round(torch.cuda.max_memory_reserved() / GiB, 2) if cfg.device == "cuda" else None,
               torch_max_allocated_gib=round(torch.cuda.max_memory_allocated() / GiB, 2) if cfg.device == "cuda"
               else None,
               **(step_times(out) if (out / "metrics.jsonl").exists() else {}))
    if doc.get("predicted_gib") and doc["nvml_peak_gib"]:
        doc["nvml_vs_predicted"] = round(doc["nvml_peak_gib"] / doc["predicted_gib"] - 1, 4)
    write_json(args.out, doc)
    print(f"{prog}: rank 0 of {world}, {doc.get('data_parallel')} recompute {doc.get('recompute')}: "
          f"NVML peak {doc['nvml_peak_gib']} GiB vs predicted {doc.get('predicted_gib')} GiB; median step "
          f"{doc.get('median_step_s')} s ({doc.get('median_tok_per_s')} tok/s) over {doc.get('steady_steps', 0)} steps "
          f"after step {STEADY_AFTER}; graphs after step 1: {doc.get('graphs_after_step_1')}; "
          f"{'ok' if doc['ok'] else 'FAILED: ' + doc.get('error', f'exit {code}')}")
    dist.destroy_process_group()
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
