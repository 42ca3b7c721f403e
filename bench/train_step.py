"""Benchmark: the real co-located trainer step (dflash.train.trainer.Trainer.train_step) on one device.

Writes a synthetic Arrow dataset of exactly the configured shape (every sample token_budget /
max_batch_size tokens long, loss_mask 0 on the first 10%, 1 after), builds the real Trainer
(random-init target from config.json, drafter, fused AdamW), runs warmup steps (compilation),
then times N steps with CUDA events. The target forward is timed alone on the same batches
(dflash.train.loss.target_step); the drafter step is the rest. Reports input tokens/s, ms/step,
torch max allocated/reserved and NVML used memory (device, and this process when the driver says).

Run (from the repository root; no install needed besides the packages):

    PYTHONPATH=. python3 bench/train_step.py                                   # configs/qwen3-8b-1gpu.toml
    PYTHONPATH=. python3 bench/train_step.py --set train.max_anchors=1024 --set drafter.block_size=32
    PYTHONPATH=. python3 bench/train_step.py --sweep --json out/train_step.json  # vs SpecForge (docs/design.md)
    PYTHONPATH=. python3 bench/train_step.py --device cpu --tiny --sweep         # CPU smoke run, seconds

--sweep times two shape sets in one invocation (batch 1 x 3072 tokens, 512 anchors x block 16
and 1024 anchors x block 32) and prints them next to SpecForge's published H200 figures.
A configuration that fails (e.g. out of memory) is recorded with its error; the rest still run.
The JSON is rewritten after every configuration, so a killed run keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    TINY_TARGET,
    Nvml,
    NvmlPeak,
    environment,
    gib,
    gpu_uuid,
    is_oom,
    parse_sets,
    write_json,
)
from dflash.data.synthetic import write_random_dataset, write_target

DEFAULT_CONFIG = "configs/qwen3-8b-1gpu.toml"

# SpecForge (HF target backend) on one H200, Qwen3-8B-shaped target, batch 1 x 3072, 5-layer
# drafter: docs/design.md, "The speed to beat".
SPECFORGE = {
    "512x16": {"step_ms": 306.0, "target_ms": 104.0, "drafter_ms": 65.0 + 104.0 + 33.0, "peak_alloc_gib": 46.9,
               "tok_s": 10.0e3},
    "1024x32": {"step_ms": 805.0, "target_ms": None, "drafter_ms": 701.0, "peak_alloc_gib": 92.6, "tok_s": 3.8e3},
}
SWEEP = {
    "512x16": {"data.token_budget": 3072, "data.max_batch_size": 1, "train.max_anchors": 512,
               "drafter.block_size": 16, "train.gamma": 7.0},
    "1024x32": {"data.token_budget": 3072, "data.max_batch_size": 1, "train.max_anchors": 1024,
                "drafter.block_size": 32, "train.gamma": 10.0},
}
TINY = {"data.token_budget": 256, "data.max_batch_size": 2, "train.max_anchors": 16, "drafter.block_size": 4,
        "drafter.num_layers": 1, "train.loss_chunk": 64, "target.dtype": "float32", "train.gamma": 4.0}
TINY_SWEEP = {
    "512x16": {"data.token_budget": 256, "data.max_batch_size": 1, "train.max_anchors": 16, "drafter.block_size": 4},
    "1024x32": {"data.token_budget": 256, "data.max_batch_size": 1, "train.max_anchors": 32, "drafter.block_size": 8},
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="run config TOML (default %(default)s)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="dotted override, e.g. train.max_anchors=1024 (repeatable)")
    ap.add_argument("--data", default=None,
                    help="folder for the synthetic datasets (default .cache/bench-data/train-step)")
    ap.add_argument("--samples", type=int, default=64, help="samples in each synthetic dataset")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--sweep", action="store_true", help="time 512 anchors x block 16 and 1024 x 32 (batch 1 x 3072)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true",
                    help="a 6-layer hidden-64 Qwen3 target and tiny shapes (CPU smoke run)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing, profile 2 steps (torch.profiler) and print the N ops with most GPU time")
    ap.add_argument("--compile-times", action="store_true",
                    help="after the first step, print where torch.compile spent its time (dynamo's per-phase table)")
    args = ap.parse_args(argv)
    args.overrides = parse_sets(args.set, args.config, "train_step")
    return args


def configurations(args, scratch: Path) -> list[tuple[str, dict]]:
    user = args.overrides
    base = {"device": args.device, "train.max_steps": 10**9, "train.log_every": 10**6}
    if args.tiny:
        base.update(TINY)
        base["target.path"] = str(write_target(scratch / "tiny-qwen3", TINY_TARGET, weights=False))
    if not args.sweep:
        return [("config", {**base, **user})]
    shapes = TINY_SWEEP if args.tiny else SWEEP
    return [(name, {**base, **shape, **user}) for name, shape in shapes.items()]


def _sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class Timer:
    """Milliseconds of a region: CUDA events on a GPU, the wall clock on CPU."""

    def __init__(self, torch, device):
        self.torch, self.device = torch, device

    def __enter__(self):
        if self.device.type == "cuda":
            self.start = self.torch.cuda.Event(enable_timing=True)
            self.end = self.torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.end.record()
            self.end.synchronize()
            self.ms = self.start.elapsed_time(self.end)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3
        return False


def measure(name: str, overrides: dict, args, data_root: Path, out_root: Path) -> dict:
    import torch

    from dflash.config import load_config
    from dflash.train.trainer import Trainer

    overrides = {"target.random_init": True, **overrides}  # shapes only: a step's time and memory do not need weights
    cfg = load_config(args.config, overrides)
    length = cfg.data.token_budget // cfg.data.max_batch_size
    vocab = _vocab(cfg.target.path)
    data = write_random_dataset(data_root / f"{args.samples}x{length}", args.samples, length, vocab)
    cfg = load_config(args.config, {**overrides, "data.path": str(data), "output_dir": str(out_root / name)})
    device = torch.device(cfg.device)
    nvml = Nvml(gpu_uuid(torch) if device.type == "cuda" else None, enabled=device.type == "cuda")
    t0 = time.perf_counter()
    trainer = Trainer.colocated(cfg, None, log=lambda *_: None)
    build_s = time.perf_counter() - t0
    stream = trainer.step_batches()

    def next_step_batches() -> list[tuple[int, dict]]:
        return next(stream)[2]

    t0 = time.perf_counter()
    first_step_s = None
    for _ in range(args.warmup):
        trainer.train_step(next_step_batches())
        if first_step_s is None:
            _sync(torch, device)
            first_step_s = time.perf_counter() - t0
            print(f"[{name}] first step {first_step_s:.1f} s (compilation included)", flush=True)
            if args.compile_times:
                from torch._dynamo.utils import compile_times

                print(compile_times(repr="str", aggregate=True), flush=True)
    _sync(torch, device)
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step_ms, tokens, timed, metrics = [], [], [], {}
    with NvmlPeak(nvml) as nv_peak:
        for _ in range(args.steps):
            group = next_step_batches()
            with Timer(torch, device) as t:
                metrics = trainer.train_step(group)
            step_ms.append(t.ms)
            tokens.append(sum(int(b["lengths"].sum()) for _, b in group))
            timed.append(group)
    mem = {"max_allocated_bytes": None, "max_reserved_bytes": None}
    if device.type == "cuda":
        mem = {"max_allocated_bytes": int(torch.cuda.max_memory_allocated()),
               "max_reserved_bytes": int(torch.cuda.max_memory_reserved())}
    nvml_process = nvml.process_used()
    profile = None
    if args.profile and device.type == "cuda":
        profile = print_profile(torch, trainer, next_step_batches, args.profile, name)
    stream.close()
    # The target role's work alone on the same batches (the feature source the trainer calls).
    target_ms = []
    with torch.no_grad():
        for group in timed:
            on_dev = [(k, {key: v.to(device, non_blocking=True) for key, v in b.items()}) for k, b in group]
            with Timer(torch, device) as t:
                for k, batch in on_dev:
                    trainer.source.features(k, batch)
            target_ms.append(t.ms)
    del trainer, timed
    step = _median(step_ms)
    target = _median(target_ms)
    tok = sum(tokens) / len(tokens)
    d = trainer_shape(cfg)
    return {
        "name": name, "ok": True, "overrides": overrides, "shape": d,
        "build_s": round(build_s, 2), "first_step_s": round(first_step_s or 0.0, 2), "warmup_s": round(warmup_s, 2),
        "step_ms": round(step, 2), "step_ms_all": [round(x, 2) for x in step_ms],
        "target_forward_ms": round(target, 2), "drafter_step_ms": round(step - target, 2),
        "input_tokens_per_step": tok, "tokens_per_s": round(tok / (step / 1e3), 1),
        **mem, "nvml_device_used_peak_bytes": nv_peak.peak, "nvml_process_used_bytes": nvml_process,
        "last_metrics": {k: metrics.get(k) for k in ("loss", "accept_len", "anchors", "tokens")},
        "profile_ms_per_step": profile,
        "config": cfg.model_dump(),
    }


KERNEL_KINDS = (  # (kind, substrings of a kernel name), first match wins
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "cublas")),
    ("flex bwd", ("flex_attention_backward",)),
    ("flex fwd", ("flex_attention",)),
    ("loss kernel", ("_dflash_rows",)),
    ("adamw", ("multi_tensor_apply", "fused_adamw")),
    ("sdpa (target)", ("cudnn", "fmha", "flash_fwd", "flash_bwd")),
    ("inductor fused", ("triton_",)),
    ("copy/cat", ("copy", "CatArray", "cat_")),
    ("reduce", ("reduce_kernel",)),
    ("elementwise", ("elementwise",)),
)


def kernel_kind(name: str) -> str:
    return next((kind for kind, keys in KERNEL_KINDS if any(k in name for k in keys)), "other")


def kernel_summary(prof, steps: int) -> dict:
    """{kind: ms per step} of the GPU kernels in a profile, plus "busy" (the union of kernel intervals) and
    "span" (first kernel start to last kernel end): span - busy is time the GPU waited for the host.
    "gaps": the largest idle stretches summed by the kernels around them; "other": the unclassified kernels."""
    kernels = []
    # GPU kernels, memcpy, memset; not the annotations that span kernels on the GPU timeline ("## ... ##" compiled
    # graphs, "Optimizer.step#AdamW.step"), which counted the optimizer's time twice, once as "other"
    annotation = ("## ", "Optimizer.")
    for e in prof.profiler.kineto_results.events():
        if e.device_type().name == "CUDA" and e.duration_ns() > 0 and not e.name().startswith(annotation):
            kernels.append((e.start_ns(), e.start_ns() + e.duration_ns(), e.name()))
    kinds: dict = {}
    other: dict = {}
    for start, end, name in kernels:
        kind = kernel_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + (end - start) / 1e6 / steps
        if kind == "other":
            other[name[:80]] = other.get(name[:80], 0.0) + (end - start) / 1e6 / steps
    busy, last, last_name, gaps = 0, None, "", {}
    for start, end, name in sorted(kernels):
        if last is not None and start - last > 20_000:  # idle for more than 20 us
            key = f"{kernel_kind(last_name)} -> {name[:60]}"
            gaps[key] = gaps.get(key, 0.0) + (start - last) / 1e6 / steps
        if last is None or start > last:
            busy += end - start
            last, last_name = end, name
        elif end > last:
            busy += end - last
            last, last_name = end, name
    span = (max(e for _, e, _ in kernels) - min(s for s, _, _ in kernels)) if kernels else 0
    top = lambda d: dict(sorted(d.items(), key=lambda kv: -kv[1])[:8])  # noqa: E731
    return {**kinds, "busy": busy / 1e6 / steps, "span": span / 1e6 / steps, "gaps": top(gaps), "other kernels": top(other)}


def gemm_shapes(prof, steps: int) -> list[dict]:
    """aten::mm / addmm / bmm grouped by input shapes: GPU ms per step, calls per step, achieved TFLOP/s."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key not in ("aten::mm", "aten::addmm", "aten::bmm") or not e.device_time_total:
            continue
        shapes = [s for s in e.input_shapes if s]
        a, b = (shapes[1], shapes[2]) if e.key == "aten::addmm" else (shapes[0], shapes[1])  # addmm(bias, a, b)
        flop = 2 * a[-2] * a[-1] * b[-1] * (a[0] if len(a) == 3 else 1)
        ms = e.device_time_total / 1e3 / steps
        calls = e.count // steps
        rows.append({"ms": ms, "calls": calls, "tflops": flop * calls / (ms / 1e3) / 1e12, "shapes": shapes})
    return sorted(rows, key=lambda r: -r["ms"])


def print_profile(torch, trainer, next_step_batches, top: int, name: str) -> dict:
    """Where the step's GPU time goes: kernels by kind for the whole step, for the target's forward alone on the
    same batches, and their difference (the drafter's part); then the top ops by self GPU time (per step)."""
    from torch.profiler import ProfilerActivity, profile

    groups = [next_step_batches() for _ in range(2)]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for group in groups:
            trainer.train_step(group)
        torch.cuda.synchronize()
    device = torch.device(trainer.cfg.device)
    on_dev = [[(k, {key: v.to(device) for key, v in b.items()}) for k, b in group] for group in groups]
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as target_prof:
        for group in on_dev:
            for k, batch in group:
                trainer.source.features(k, batch)
        torch.cuda.synchronize()
    step, target = kernel_summary(prof, 2), kernel_summary(target_prof, 2)
    listed = ("gaps", "other kernels")
    kinds = sorted((set(step) | set(target)) - set(listed), key=lambda k: (k in ("busy", "span"), -step.get(k, 0.0)))
    print(f"[{name}] GPU kernels by kind, ms per step: whole step / target forward alone / difference (drafter)")
    for kind in kinds:
        a, b = step.get(kind, 0.0), target.get(kind, 0.0)
        print(f"[{name}]   {kind:16s} {a:8.2f} {b:8.2f} {a - b:8.2f}")
    print(f"[{name}]   {'host waits':16s} {step['span'] - step['busy']:8.2f}   (span - busy: the GPU idle inside the step)")
    for what in listed:
        print(f"[{name}] {what} of the step, ms per step:")
        for key, ms in step[what].items():
            print(f"[{name}]   {ms:8.2f}  {key}")
    print(f"[{name}] matmuls by shape (whole step, per step): ms, calls, TFLOP/s")
    for row in gemm_shapes(prof, 2)[:top]:
        print(f"[{name}]   {row['ms']:8.2f}  x{row['calls']:<4} {row['tflops']:6.0f}  {row['shapes']}")
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events)
    print(f"[{name}] top {top} ops by self GPU time (ms/step)")
    for e in events[:top]:
        print(f"[{name}]   {e.self_device_time_total / 2e3:8.2f}  {100 * e.self_device_time_total / total:5.1f}%  "
              f"x{e.count // 2:<5} {e.key[:110]}")
    return {"step": step, "target": target}


def trainer_shape(cfg) -> dict:
    return {"token_budget": cfg.data.token_budget, "max_batch_size": cfg.data.max_batch_size,
            "max_anchors": cfg.train.max_anchors, "block_size": cfg.drafter.block_size,
            "drafter_layers": cfg.drafter.num_layers, "target": cfg.target.path}


def _vocab(target_path: str) -> int:
    import json

    return int(json.loads((Path(target_path) / "config.json").read_text())["vocab_size"])


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def print_table(results: list[dict], sweep: bool) -> None:
    print()
    print(f"{'config':<10} {'ms/step':>9} {'target ms':>10} {'drafter ms':>11} {'tok/s':>9} "
          f"{'alloc GiB':>10} {'reserved':>9} {'NVML GiB':>9}")
    for r in results:
        if not r["ok"]:
            print(f"{r['name']:<10} FAILED{' (out of memory)' if r.get('oom') else ''}: {r['error']}")
            continue
        print(f"{r['name']:<10} {r['step_ms']:>9.1f} {r['target_forward_ms']:>10.1f} {r['drafter_step_ms']:>11.1f} "
              f"{r['tokens_per_s']:>9.0f} {gib(r['max_allocated_bytes']):>10} {gib(r['max_reserved_bytes']):>9} "
              f"{gib(r['nvml_device_used_peak_bytes']):>9}")
    if not sweep:
        return
    print("\nvs SpecForge on one H200 (docs/design.md): speedup = theirs / ours")
    print(f"{'shape':<10} {'step ms ours/SF':>18} {'x':>6} {'drafter ms ours/SF':>20} {'x':>6} {'tok/s ours/SF':>16} "
          f"{'peak alloc GiB ours/SF':>24}")
    for r in results:
        sf = SPECFORGE.get(r["name"])
        if sf is None or not r["ok"]:
            continue
        alloc = r["max_allocated_bytes"]
        print(f"{r['name']:<10} {r['step_ms']:>9.0f}/{sf['step_ms']:<8.0f} {sf['step_ms'] / r['step_ms']:>6.2f} "
              f"{r['drafter_step_ms']:>10.0f}/{sf['drafter_ms']:<9.0f} "
              f"{sf['drafter_ms'] / max(r['drafter_step_ms'], 1e-9):>6.2f} "
              f"{r['tokens_per_s']:>8.0f}/{sf['tok_s']:<7.0f} "
              f"{(gib(alloc) if alloc is not None else '-'):>12}/{sf['peak_alloc_gib']:<11}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device visible; use --device cpu --tiny for a smoke run", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    data_root = Path(args.data) if args.data else Path(".cache/bench-data/train-step")
    results: list[dict] = []
    env = environment(torch, args.device)
    for name, overrides in configurations(args, scratch):
        print(f"[{name}] {overrides}", flush=True)
        try:
            r = measure(name, overrides, args, data_root, scratch / "runs")
        except Exception as e:  # recorded, the next configuration still runs
            r = {"name": name, "ok": False, "overrides": overrides, "oom": is_oom(e),
                 "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400],
                 "traceback": traceback.format_exc()[-4000:]}
            print(r["traceback"], file=sys.stderr)
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        results.append(r)
        if r["ok"]:
            print(f"[{name}] {r['step_ms']:.1f} ms/step, {r['tokens_per_s']:.0f} tok/s, "
                  f"target {r['target_forward_ms']:.1f} ms, "
                  f"peak alloc {gib(r['max_allocated_bytes'])} GiB", flush=True)
        if args.json:
            write_json(Path(args.json), {"env": env, "specforge_h200": SPECFORGE, "results": results})
    print_table(results, args.sweep)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
