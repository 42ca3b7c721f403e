"""Measure each role's GPU memory peak for the memory model (dflash/memory/parts.py) to be fitted against.

Every (configuration, role) runs in a fresh subprocess, so peaks never mix:
- target role: the frozen target (random init on the GPU from config.json) and three
  ``dflash.train.loss.target_step`` calls over a padded batch filling token_budget (the memory
  model's worst target batch: 2 rows, the second one padded, when max_batch_size >= 2);
- drafter role: DFlashDrafter + frozen bf16 embedding / lm_head tensors + fused AdamW, and
  three real steps (``dflash.train.loss.drafter_step_math`` under bf16 autocast, backward, grad
  clipping, optimizer step) on random target features of the memory model's worst batch shape.
Recorded per measurement: torch max_memory_allocated / max_memory_reserved, the GPU's NVML used
memory at its peak (sampled in a thread during the steps and after each; nothing subtracted)
and before the worker started, with the run config, the target's config.json, torch/CUDA
versions and the GPU name, in the format ``dflash.memory.calibration.Measurement`` reads.

Run (from the repository root; no install needed besides the packages):

    PYTHONPATH=. python3 bench/memory_calibration.py --out out/          # ~5 min on one H200
    PYTHONPATH=. python3 bench/memory_calibration.py --out out/ --only 8b-48k-a1024-b32-d1
    PYTHONPATH=. python3 bench/memory_calibration.py --device cpu --tiny --out .cache/cal   # smoke run
    PYTHONPATH=. python3 bench/memory_calibration.py --fit tests/data/memory_calibration.json
    PYTHONPATH=. python3 bench/memory_calibration.py --residuals tests/data/memory_calibration.json

--budget-s stops launching workers once the next one would not finish in time (recorded as
skipped); --timeout-s bounds each worker. The JSON is rewritten after every measurement.
--fit reads a measurement file, prints each prediction error with the committed Calibration,
then the fitted constants (paste them into dflash/memory/parts.py's Calibration defaults).
--residuals splits each prediction's error into its three layers: the model's tensors (scaled) against torch's
allocated peak, its fragmentation margin against reserved less allocated, and its terms outside torch (CUDA context,
NCCL) against NVML less reserved (the card's own baseline included).
--breakdown (CUDA) records torch's allocation history in each worker and adds "peak_breakdown" to each
measurement: the tensors alive at torch's allocated peak, summed by where they were allocated (the innermost
dflash/bench frame, else the innermost Python frame: compiled graphs, autograd), largest first, so a residual
against the model can be traced to the term that misses it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import TINY_TARGET, Nvml, NvmlPeak, environment, gib, gpu_uuid, is_oom, write_json  # noqa: E402
from dflash.data.synthetic import write_target  # noqa: E402

STEPS = 3

T06, T8, T27 = "configs/targets/qwen3-0.6b", "configs/targets/qwen3-8b", "configs/targets/qwen3-27b"
T36 = "configs/targets/qwen3.6-27b"  # the incident's target (Qwen3.6-27B text shapes; the drafter role reads only them)
# The incident's drafter role: 49152-token batches of up to 64 rows, 1024 anchors per batch, block 32, 5 layers, KL 0.5
INCIDENT = dict(batch_anchors=1024, kl_weight=0.5, gamma=10.0)


# The public Qwen3.6-27B drafter recipe's shapes, as configs/qwen3.6-27b-5t3d.toml sets them.
RECIPE = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=17408,
              layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=2048,
              target_layer_ids=[1, 16, 31, 46, 61], mask_token_id=248070)


def _cfg(target, budget, batch, anchors, block, layers, drafter=None, **train) -> dict:
    return {
        "target": {"path": target, "dtype": "bfloat16", "random_init": True},
        "drafter": {"num_layers": layers, "block_size": block, **(drafter or {})},
        "data": {"token_budget": budget, "max_batch_size": batch},
        "train": {"max_anchors": anchors, **train},
    }


# name -> run config (co-located topology: one role per process, no send buffers, no NCCL).
CONFIGS = {
    "8b-16k-a512-b16-d5": _cfg(T8, 16384, 2, 512, 16, 5),
    "8b-48k-a1024-b32-d1": _cfg(T8, 49152, 1, 1024, 32, 1),
    "0.6b-48k-a1024-b16-d5-cap4096": _cfg(T06, 49152, 64, 1024, 16, 5, batch_anchors=4096),
    "8b-32k-a256-b32-d3-kl": _cfg(T8, 32768, 4, 256, 32, 3, kl_weight=0.5),
    "0.6b-8k-a256-b16-d1": _cfg(T06, 8192, 1, 256, 16, 1),
    "0.6b-16k-a512-b32-d3": _cfg(T06, 16384, 8, 512, 32, 3),
    "27b-16k-d5": _cfg(T27, 16384, 1, 512, 32, 5),
    "q36-27b-49k-a1024-b32-d5-kl-layer": _cfg(T36, 49152, 64, 1024, 32, 5, recompute="layer", **INCIDENT),
    "q36-27b-49k-a1024-b32-d5-kl-mlp": _cfg(T36, 49152, 64, 1024, 32, 5, recompute="mlp", **INCIDENT),
    "q36-27b-49k-a1024-b32-d5-kl-off": _cfg(T36, 49152, 64, 1024, 32, 5, recompute="off", **INCIDENT),
    "q36-recipe-49k-a1024-b32-d5-kl-off": _cfg(T36, 49152, 64, 1024, 32, 5, drafter=RECIPE, recompute="off", **INCIDENT),
    # the same with 17 rows of ~2,900 tokens, the batches of the 1 target + 1 drafter run (runner recipe q36-1t1d)
    "q36-recipe-49k-r17-a1024-b32-d5-kl-off": _cfg(T36, 49152, 17, 1024, 32, 5, drafter=RECIPE, recompute="off",
                                                    **INCIDENT),
}
# Priority order: every target role first (no compilation, ~15 s each), then the drafter roles
# (each compiles flex attention), the most different shapes first.
# The hybrid target (Qwen3.6-27B, 48 Gated DeltaNet layers) is measured once, with fla-core's kernels when installed.
PLAN = [(n, "target") for n in CONFIGS if not n.startswith("q36")] + [("q36-27b-49k-a1024-b32-d5-kl-off", "target")] + [
    (n, "drafter") for n in ("q36-27b-49k-a1024-b32-d5-kl-layer", "q36-27b-49k-a1024-b32-d5-kl-mlp",
                             "q36-27b-49k-a1024-b32-d5-kl-off", "q36-recipe-49k-a1024-b32-d5-kl-off",
                             "8b-48k-a1024-b32-d1", "0.6b-48k-a1024-b16-d5-cap4096", "8b-32k-a256-b32-d3-kl",
                             "8b-16k-a512-b16-d5", "0.6b-8k-a256-b16-d1", "0.6b-16k-a512-b32-d3")
]
TINY_PLAN = [("tiny-a", "target"), ("tiny-a", "drafter"), ("tiny-b-kl", "target"), ("tiny-b-kl", "drafter")]


def tiny_configs(target: str) -> dict:
    return {
        "tiny-a": _cfg(target, 256, 1, 16, 4, 1) | {"device": "cpu"},
        "tiny-b-kl": _cfg(target, 256, 4, 8, 8, 2, kl_weight=0.5, loss_chunk=32, batch_anchors=12) | {"device": "cpu"},
    }


# --------------------------------------------------------------------------- worker (one role)


def worker(spec: dict) -> dict:
    from dflash.config import config_from_dict
    from preflight.gate import apply_profile_env

    raw = spec["config"]
    # The allocator settings the trainer runs with (the profile's env, e.g. expandable segments):
    # fragmentation, hence the NVML peak, depends on them.
    apply_profile_env(config_from_dict(raw, {"device": spec["device"]}, source=spec["name"]).profile)
    import torch

    device = torch.device(spec["device"])
    if device.type == "cpu":
        raw = json.loads(json.dumps(raw))
        raw.setdefault("target", {})["dtype"] = "float32"  # CPU: no fast bf16 matmuls
    cfg = config_from_dict(raw, {"device": device.type}, source=spec["name"])
    nvml = Nvml(enabled=device.type == "cuda")
    start_used = nvml.used()
    if device.type == "cuda":
        torch.cuda.init()
        nvml = Nvml(gpu_uuid(torch), enabled=True)
    t0 = time.perf_counter()
    steps = []
    traced = spec.get("breakdown") and device.type == "cuda"
    if traced:  # host-side bookkeeping only: the GPU peaks are the same with it on
        torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, context="alloc", stacks="python")
    with NvmlPeak(nvml) as peak:
        run = _target_role if spec["role"] == "target" else _drafter_role
        shape = run(cfg, device, steps, nvml, torch)
    breakdown = None
    if traced:
        breakdown = peak_breakdown(torch.cuda.memory._snapshot(), int(torch.cuda.max_memory_allocated()))
        torch.cuda.memory._record_memory_history(enabled=None)
    result = {
        "nvml_used_bytes": max([peak.peak or 0] + [s["nvml_used_bytes"] or 0 for s in steps]) or None,
        "max_allocated_bytes": int(torch.cuda.max_memory_allocated()) if device.type == "cuda" else None,
        "max_reserved_bytes": int(torch.cuda.max_memory_reserved()) if device.type == "cuda" else None,
        "nvml_process_used_bytes": nvml.process_used(),
        "nvml_worker_start_bytes": start_used,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "batch": shape,
        "steps": steps,
        "worker_s": round(time.perf_counter() - t0, 2),
    }
    if breakdown is not None:
        result["peak_breakdown"] = breakdown
    return result


HISTORY_ENTRIES = 2_000_000  # allocation events kept; a step of the 27B drafter makes some thousands
OURS = ("/dflash/", "/bench/")


def _where(frames: list[dict]) -> str:
    """Where an allocation was made: the innermost frame of this project's code, then the innermost Python frame
    when that is elsewhere (a compiled graph's generated code, torch's autograd), or only the latter."""
    def tail(f: dict) -> str:
        return "/".join(f.get("filename", "?").replace(os.sep, "/").split("/")[-2:]) + f":{f.get('line')} {f.get('name')}"

    ours = ""
    for f in frames:
        name = f.get("filename", "").replace(os.sep, "/")
        root = next((r for r in OURS if r in name), None)
        if root:
            ours = f"{root.strip('/')}/{name.split(root, 1)[1]}:{f.get('line')} {f.get('name')}"
            break
    if not frames:
        return "(no Python frame: autograd's engine or a C++ caller)"
    inner = frames[0]
    if ours and any(r in inner.get("filename", "").replace(os.sep, "/") for r in OURS):
        return ours
    return f"{ours} > {tail(inner)}" if ours else tail(inner)


def peak_breakdown(snapshot: dict, max_allocated: int | None = None, top: int = 30) -> dict:
    """The allocations alive at the traced peak of one device's allocation history, summed by where they were made.

    snapshot: torch.cuda.memory._snapshot() taken with _record_memory_history on ("device_traces": per device a list
    of events with action, addr, size, frames). Two passes: the first finds the peak of the running total of
    'alloc' minus 'free_completed', the second replays up to it. Allocations made before the history started (none,
    when it starts before the model is built) are not in it: "untraced_bytes" is torch's max_allocated less the
    traced peak. "truncated" says the history hit its entry limit, so early allocations may be missing.
    """
    traces = snapshot.get("device_traces") or []
    trace = max(traces, key=len) if traces else []
    total = peak = peak_at = 0
    sizes: dict[int, int] = {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            sizes[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, peak_at = total, i
        elif e["action"] == "free_completed":
            total -= sizes.pop(e["addr"], 0)
    live: dict[int, dict] = {}
    for e in trace[:peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    groups: dict[str, list[int]] = {}
    for e in live.values():
        g = groups.setdefault(_where(e.get("frames") or []), [0, 0])
        g[0] += e["size"]
        g[1] += 1
    rows = sorted(({"where": k, "bytes": b, "count": c} for k, (b, c) in groups.items()), key=lambda r: -r["bytes"])
    shown = rows[:top]
    rest = rows[top:]
    if rest:
        shown.append({"where": f"({len(rest)} other places)", "bytes": sum(r["bytes"] for r in rest),
                      "count": sum(r["count"] for r in rest)})
    return {"traced_peak_bytes": peak, "untraced_bytes": None if max_allocated is None else max_allocated - peak,
            "events": len(trace), "truncated": len(trace) >= HISTORY_ENTRIES, "live": shown}


def _record(steps: list, nvml: Nvml, torch, device, t0: float, **extra) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    steps.append({
        "s": round(time.perf_counter() - t0, 3),
        "max_allocated_bytes": int(torch.cuda.max_memory_allocated()) if device.type == "cuda" else None,
        "max_reserved_bytes": int(torch.cuda.max_memory_reserved()) if device.type == "cuda" else None,
        "nvml_used_bytes": nvml.used(),
        **extra,
    })


def _target_role(cfg, device, steps, nvml, torch) -> dict:
    from dflash.train.features import LocalTarget

    t0 = time.perf_counter()
    cfg.target.random_init = True  # real shapes, random weights
    target = LocalTarget(cfg, device, log=lambda *_: None)
    tconf = target.target_config
    _record(steps, nvml, torch, device, t0, phase="weights")
    # Two rows of token_budget // 2, the second padded (what the memory model plans for when max_batch_size
    # >= 2; target_step passes no padding mask since 2026-11-30 session 7); one row when max_batch_size is 1.
    rows = min(2, cfg.data.max_batch_size)
    seq = cfg.data.token_budget // rows
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(1, tconf.vocab_size - 1, (rows, seq), generator=g)
    attention = torch.ones(rows, seq, dtype=torch.long)
    if rows > 1:
        attention[-1, seq - max(1, seq // 8):] = 0
        ids[-1, seq - max(1, seq // 8):] = 0
    batch = {"input_ids": ids.to(device), "attention_mask": attention.to(device)}
    for i in range(STEPS):
        with torch.no_grad():
            context, last = target.features(i, batch)
        _record(steps, nvml, torch, device, t0, phase=f"step {i}", features=list(context.shape))
        del context, last
    return {"rows": rows, "seq_len": seq, "padded": rows > 1, "layer_ids": target.layer_ids}


def _drafter_role(cfg, device, steps, nvml, torch) -> dict:
    """The trainer's own step (dflash.train.step) on random features of the memory model's worst batch shape."""
    from dflash.memory.parts import recompute_mode, workload
    from dflash.models.drafter import DFlashDrafter, drafter_config_for_run
    from dflash.models.target import target_text_config, torch_dtype
    from dflash.train.step import build_optimizer, clip_and_step, micro_step, resolve_mask_token_id, set_lr

    t0 = time.perf_counter()
    tconf = target_text_config(cfg.target.path)
    dcfg = drafter_config_for_run(cfg, tconf, resolve_mask_token_id(cfg, tconf))
    drafter = DFlashDrafter(dcfg).to(device, torch.float32)
    drafter.set_recompute(recompute_mode(cfg))
    drafter.set_compile(cfg.train.compile and device.type == "cuda")  # as the trainer does
    dtype = torch_dtype(cfg.target.dtype)
    V, H = tconf.vocab_size, tconf.hidden_size
    embed = (torch.randn(V, H, device=device, dtype=dtype) * 0.02).requires_grad_(False)
    tied = bool(getattr(tconf, "tie_word_embeddings", False))
    head = embed if tied else (torch.randn(V, H, device=device, dtype=dtype) * 0.02).requires_grad_(False)
    optimizer = build_optimizer(drafter, cfg)
    w = workload(cfg)
    rows, seq = w.sequences, w.seq_len
    g = torch.Generator(device="cpu").manual_seed(0)
    batch = {
        "input_ids": torch.randint(1, V - 1, (rows, seq), generator=g).to(device),
        "loss_mask": torch.ones(rows, seq, dtype=torch.int8, device=device),
        "attention_mask": torch.ones(rows, seq, dtype=torch.long, device=device),
    }
    n_feat = len(dcfg.target_layer_ids)
    context = (torch.randn(rows, seq, n_feat * H, device=device, dtype=dtype) * 0.5)
    last = torch.randn(rows, seq, H, device=device, dtype=dtype) if cfg.train.kl_weight > 0 else None
    backend = "flex" if device.type == "cuda" else "sdpa"
    _record(steps, nvml, torch, device, t0, phase="setup")
    for i in range(STEPS):
        set_lr(optimizer, cfg, i, STEPS)
        optimizer.zero_grad(set_to_none=True)
        loss, metrics = micro_step(drafter, embed, head, batch, (context, last), cfg, device, backend, i)
        loss.backward()
        clip_and_step(drafter, optimizer, cfg)
        _record(steps, nvml, torch, device, t0, phase=f"step {i}", loss=float(loss.detach()),
                anchors=int(metrics["anchors"]))
        del loss
    return {"rows": rows, "seq_len": seq, "workload": w.model_dump(), "layer_ids": dcfg.target_layer_ids}


def worker_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    try:
        out = {"ok": True, **worker(spec)}
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        out = {"ok": False, "oom": is_oom(e), "error": f"{type(e).__name__}: {first}"[:400],
               "traceback": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(out), flush=True)
    return 0


# --------------------------------------------------------------------------- driver


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder for memory_calibration.json")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny Qwen3 target and shapes (CPU smoke run; memory numbers null)")
    ap.add_argument("--only", action="append", default=[], help="run only this configuration name (repeatable)")
    ap.add_argument("--roles", default="target,drafter", help="comma list of roles to measure")
    ap.add_argument("--budget-s", type=float, default=330.0, help="stop launching workers past this wall time")
    ap.add_argument("--timeout-s", type=float, default=180.0, help="wall limit of one worker")
    ap.add_argument("--merge", metavar="JSON", help="keep this file's measurements of (configuration, role) pairs "
                    "not measured now (each measurement keeps the command that produced it)")
    ap.add_argument("--breakdown", action="store_true", help="CUDA: record the allocation history and add each "
                    "measurement's tensors alive at the peak by where they were allocated (peak_breakdown)")
    ap.add_argument("--residuals", metavar="JSON", help="no measuring: each prediction's error split into tensors, "
                    "allocator margin and what is outside torch, for this file")
    ap.add_argument("--fit", metavar="JSON", help="no measuring: fit and print the calibration for this file")
    ap.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def run_worker(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(REPO), env=env)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-2000:]
        return {"ok": False, "oom": False, "error": f"worker timed out after {timeout:.0f} s",
                "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail,
                "wall_s": round(time.perf_counter() - t0, 1)}
    wall = round(time.perf_counter() - t0, 1)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return {**json.loads(line[len("RESULT "):]), "wall_s": wall}
    text = proc.stderr[-2000:]
    return {"ok": False, "oom": is_oom(text), "error": f"worker exited {proc.returncode} without a result",
            "stderr_tail": text, "wall_s": wall}


def merged_measurements(path: str, plan: list[tuple[str, str]]) -> list[dict]:
    """An earlier file's successful measurements that this run does not repeat, each with its command."""
    old = json.loads(Path(path).read_text())
    now = set(plan)
    kept = [{**m, "command": m.get("command", old.get("command"))} for m in old["measurements"]
            if m.get("ok") and (m["name"], m["role"]) not in now]
    print(f"--merge {path}: keeping {len(kept)} earlier measurements", flush=True)
    return kept


def settled_used(nvml: Nvml, idle: int | None, slack: int = 512 << 20, wait_s: float = 20.0) -> int | None:
    """NVML used memory once the last worker's memory is back with the driver (at most wait_s)."""
    deadline = time.perf_counter() + wait_s
    used = nvml.used()
    while used is not None and idle is not None and used > idle + slack and time.perf_counter() < deadline:
        time.sleep(0.25)
        used = nvml.used()
    return used


def measure_all(args) -> int:
    import torch  # versions only: this process never touches the GPU

    if args.device == "cuda" and args.tiny:
        print("--tiny is for --device cpu", file=sys.stderr)
        return 2
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="dflash-cal-"))
    out_path = out_dir / "memory_calibration.json"
    if args.tiny:
        configs = tiny_configs(str(write_target(out_dir / "targets" / "tiny-qwen3", TINY_TARGET, weights=False)))
        plan = TINY_PLAN
    else:
        configs, plan = CONFIGS, PLAN
    roles = set(args.roles.split(","))
    unknown = [n for n in args.only if n not in configs]
    if unknown:
        print(f"--only {unknown}: no such configuration; known: {', '.join(configs)}", file=sys.stderr)
        return 2
    if args.only:  # the named configurations in the given roles, planned or not
        plan = [(n, r) for n in args.only for r in ("target", "drafter") if r in roles]
    plan = [(n, r) for n, r in plan if r in roles]
    env = environment(torch, args.device)
    nvml = Nvml(enabled=args.device == "cuda")
    env["gpu_nvml_total_bytes"] = nvml.total()
    idle_used = nvml.used()  # before any worker: what the next worker's start should come back to
    doc = {"command": env["command"], "env": env, "steps_per_measurement": STEPS, "measurements": []}
    kept = merged_measurements(args.merge, plan) if args.merge else []
    t_start = time.perf_counter()
    guess = {"target": 30.0, "drafter": 60.0}  # seconds per worker until one has been timed
    taken: dict[str, list[float]] = {"target": [], "drafter": []}
    for name, role in plan:
        cfg = configs[name]
        target_config = json.loads((REPO / cfg["target"]["path"] / "config.json").read_text())  # absolute paths stay
        entry = {"name": name, "role": role, "command": env["command"], "config": None, "target_config": target_config,
                 "cuda": torch.version.cuda or "none", "gpu": env["gpu"], "torch": torch.__version__}
        elapsed = time.perf_counter() - t_start
        left = args.budget_s - elapsed
        expect = max(taken[role]) if taken[role] else guess[role]
        if left < expect:
            entry.update(ok=False, skipped=True,
                         error=f"skipped: {left:.0f} s of --budget-s left, a {role} worker takes ~{expect:.0f} s")
            print(f"[{name} / {role}] {entry['error']}", flush=True)
            doc["measurements"].append(entry)
            write_json(out_path, {**doc, "measurements": kept + doc["measurements"]})
            continue
        from dflash.config import config_from_dict

        entry["config"] = config_from_dict(cfg, {"device": args.device}, source=name).model_dump()
        entry["nvml_baseline_bytes"] = settled_used(nvml, idle_used)
        print(f"[{name} / {role}] running ({elapsed:.0f} s elapsed)", flush=True)
        spec = {"name": name, "role": role, "device": args.device, "config": cfg, "breakdown": args.breakdown}
        result = run_worker(spec, min(args.timeout_s, max(10.0, left)))
        entry.update(result)
        if result.get("ok"):
            taken[role].append(result["wall_s"])
            print(f"[{name} / {role}] {result['wall_s']} s: NVML used {gib(result['nvml_used_bytes'])} GiB, "
                  f"reserved {gib(result['max_reserved_bytes'])}, allocated {gib(result['max_allocated_bytes'])}",
                  flush=True)
            for row in (result.get("peak_breakdown") or {}).get("live", [])[:12]:
                print(f"    {gib(row['bytes']):>7} GiB {row['count']:>5}x  {row['where']}", flush=True)
        else:
            print(f"[{name} / {role}] FAILED{' (out of memory)' if result.get('oom') else ''}: {result['error']}\n"
                  f"{result.get('traceback') or result.get('stderr_tail') or ''}", flush=True)
        doc["measurements"].append(entry)
        write_json(out_path, {**doc, "measurements": kept + doc["measurements"]})
    doc["measurements"] = kept + doc["measurements"]
    write_json(out_path, doc)
    print(f"\nwrote {out_path} ({time.perf_counter() - t_start:.0f} s)")
    print_table(doc["measurements"])
    return 0 if all(m.get("ok") or m.get("skipped") for m in doc["measurements"]) else 1


def print_table(measurements: list[dict]) -> None:
    from dflash.memory.calibration import current_measurements, fit_calibration, prediction_errors
    from dflash.memory.parts import DEFAULT_CALIBRATION

    usable, superseded = current_measurements([m for m in measurements if m.get("ok") and m.get("nvml_used_bytes")])
    errs = prediction_errors(usable, DEFAULT_CALIBRATION) if usable else []
    err_of = {id(m): e for m, e in zip(usable, errs)}
    print(f"\n{'configuration':<32} {'role':<8} {'alloc GiB':>9} {'reserved':>9} {'NVML GiB':>9} {'baseline':>9} "
          f"{'model err':>9} {'wall s':>7}")
    for m in measurements:
        if not m.get("ok"):
            print(f"{m['name']:<32} {m['role']:<8} {'skipped' if m.get('skipped') else 'FAILED'}: {m.get('error', '')}")
            continue
        e = err_of.get(id(m))
        print(f"{m['name']:<32} {m['role']:<8} "
              f"{gib(m.get('max_allocated_bytes')):>9} {gib(m.get('max_reserved_bytes')):>9} "
              f"{gib(m.get('nvml_used_bytes')):>9} {gib(m.get('nvml_baseline_bytes')):>9} "
              f"{'-' if e is None else f'{e:+.1%}':>9} {m.get('wall_s', 0):>7}")
    if superseded:
        errs_old = prediction_errors(superseded, DEFAULT_CALIBRATION)
        print("superseded (default allocator; re-measured with expandable segments, not fitted): " +
              ", ".join(f"{m['name']}/{m['role']} {e:+.1%}" for m, e in zip(superseded, errs_old)))
    if len(usable) >= 3:
        try:
            fitted = fit_calibration(usable)
        except ValueError as e:
            print(f"\nno fit: {e}")
            return
        after = prediction_errors(usable, fitted)
        print(f"\nfitted: cuda_context_gib={ {k: round(v, 4) for k, v in fitted.cuda_context_gib.items()} } "
              f"target_activation_scale={fitted.target_activation_scale:.4f} "
              f"drafter_activation_scale={fitted.drafter_activation_scale:.4f}")
        print("errors with the fitted constants: "
              + ", ".join(f"{m['name']}/{m['role']} {e:+.1%}" for m, e in zip(usable, after)))
        print(f"max |error|: committed {max(abs(x) for x in errs):.1%}, fitted {max(abs(x) for x in after):.1%}")


def residuals(measurements: list[dict]) -> list[dict]:
    """Per usable measurement, where the model's error sits (GiB): tensors (every part but the margin and the fixed
    ones, scaled as the model scales them) against torch's max allocated; the fragmentation margin against max
    reserved less max allocated; the fixed parts (CUDA context, NCCL) against NVML used less max reserved."""
    from dflash.memory.calibration import Measurement, current_measurements
    from dflash.memory.parts import DEFAULT_CALIBRATION, recompute_mode, role_parts

    usable, _ = current_measurements([m for m in measurements if m.get("ok") and m.get("nvml_used_bytes")
                                      and m.get("max_allocated_bytes") and m.get("max_reserved_bytes")])
    rows = []
    for raw in usable:
        m = Measurement.model_validate(raw)
        cfg, shape = m.model_inputs()
        parts = role_parts(cfg, shape, m.role, m.cuda, DEFAULT_CALIBRATION, m.expandable)
        by = {kind: sum(p.bytes for p in parts if p.kind == kind) for kind in ("margin", "fixed")}
        tensors = sum(p.bytes for p in parts) - by["margin"] - by["fixed"]
        alloc, res, nvml = raw["max_allocated_bytes"], raw["max_reserved_bytes"], raw["nvml_used_bytes"]
        g = 1 << 30
        rows.append({"name": raw["name"], "role": raw["role"], "gpu": raw.get("gpu", ""),
                     "recompute": recompute_mode(cfg) if raw["role"] != "target" else "-", "tensors": tensors / g, "allocated": alloc / g,
                     "margin": by["margin"] / g, "slack": (res - alloc) / g, "fixed": by["fixed"] / g,
                     "outside": (nvml - res) / g, "predicted": sum(p.bytes for p in parts) / g, "nvml": nvml / g})
    return rows


def print_residuals(rows: list[dict]) -> None:
    print(f"{'configuration':<40} {'role':<8} {'rc':<5} {'tensors/alloc':>15} {'margin/slack':>13} "
          f"{'fixed/outside':>14} {'total/NVML':>15} {'error':>6}")
    for r in rows:
        print(f"{r['name'][:40]:<40} {r['role']:<8} {r['recompute'][:5]:<5} "
              f"{r['tensors']:>6.2f}/{r['allocated']:<6.2f}{r['tensors'] - r['allocated']:+5.2f} "
              f"{r['margin']:>5.2f}/{r['slack']:<5.2f}{r['margin'] - r['slack']:+5.2f} "
              f"{r['fixed']:>5.2f}/{r['outside']:<5.2f}{r['fixed'] - r['outside']:+5.2f} "
              f"{r['predicted']:>6.2f}/{r['nvml']:<6.2f}{r['predicted'] - r['nvml']:+5.2f} "
              f"{(r['predicted'] / r['nvml'] - 1):>+6.1%}")
    print("(GiB: model / measured, then model less measured; tensors vs torch's max allocated, margin vs reserved "
          "less allocated, fixed vs NVML less reserved)")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if args.residuals:
        try:
            doc = json.loads(Path(args.residuals).read_text())
        except (OSError, ValueError) as e:
            print(f"--residuals {args.residuals}: cannot read it ({e}); give a memory_calibration.json", file=sys.stderr)
            return 2
        try:
            rows = residuals(doc.get("measurements", []) if isinstance(doc, dict) else [])
        except (ValueError, KeyError, TypeError) as e:  # a measurement without its config or target_config
            print(f"--residuals {args.residuals}: a measurement cannot be read ({type(e).__name__}: "
                  f"{' '.join(str(e).split())[:160]}); give a memory_calibration.json", file=sys.stderr)
            return 2
        if not rows:
            print(f"--residuals {args.residuals}: no measurement with NVML, torch's allocated and reserved peaks; give "
                  "a memory_calibration.json that bench/memory_calibration.py wrote on a GPU", file=sys.stderr)
            return 2
        print_residuals(rows)
        return 0
    if args.fit:
        doc = json.loads(Path(args.fit).read_text())
        print_table(doc["measurements"])
        return 0
    return measure_all(args)


if __name__ == "__main__":
    sys.exit(main())
