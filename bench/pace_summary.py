"""Benchmark summary of one finished run dir: what the users' job sustains once past its first step.

Reads the run's metrics.jsonl, outcome.json and snapshot.json (what dflash-train wrote) and reports:
the steady tok/s (every logged window after the first, which holds the compilation), the per-role busy rates and
waits of a split run and the split they suggest for the run's GPUs and for 8 (``dflash.train.features``' rule, the one
the run printed), each GPU's NVML peak against preflight's estimate for its role, the time from launch to the first
step, the recompiles after it, and each checkpoint save's stall on the step loop (and whether one fell inside the
steady window). Writes JSON with --out and prints one line per figure.

    python3 bench/pace_summary.py runs/qwen3.6-27b-1t1d --min-steps 60 --out $OUT/pace_27b_1t1d.json
    uv run python bench/pace_summary.py runs/tiny          # any run dir, e.g. a CPU run

Exit 1 when the steady window is shorter than --min-steps or holds no save (the measurement the issue asks for was not
made), 2 for a path that is not a run dir.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_json  # noqa: E402
from dflash.config import TopologyConfig  # noqa: E402
from dflash.errors import UsageError  # noqa: E402
from dflash.memory.pace import after_first_window, busy_rates, suggested_splits  # noqa: E402
from dflash.runs import records  # noqa: E402
from dflash.runs.metrics import read_metrics  # noqa: E402


def summarize(run_dir: Path) -> dict:
    snap, outcome, _ = records.load(run_dir)
    metrics = read_metrics(run_dir)
    rows, first_window_end = after_first_window(metrics.rows)
    timed = [r for r in rows if "tok_per_s" in r]
    last_step = max((r["step"] for r in metrics.rows), default=0)
    out: dict = {"run_dir": run_dir.name, "steps": last_step, "first_window_end_step": first_window_end,
                 "steady_steps": last_step - first_window_end, "bad_metrics_rows": metrics.bad}
    if timed:
        rates = [r["tok_per_s"] for r in timed]
        out["steady_tok_per_s"] = {"mean": round(statistics.fmean(rates), 1), "median": round(statistics.median(rates), 1),
                                   "min": round(min(rates), 1), "max": round(max(rates), 1), "windows": len(rates)}
    for key in ("drafter_wait_frac", "target_wait_frac"):
        values = [r[key] for r in timed if key in r]
        if values:
            out[key] = round(statistics.fmean(values), 4)
    busy = busy_rates(timed)
    if busy is not None:
        t_rate, d_rate, n = busy
        # unrounded: the lines below and the run's own summary format the same floats
        out["busy_tok_s_per_gpu"] = {"target": t_rate, "drafter": d_rate, "windows": n}
        try:
            topology = TopologyConfig.model_validate((snap.get("config") or {}).get("topology") or {})
        except ValueError as e:
            raise UsageError(f"{run_dir}: snapshot.json's topology does not validate ({str(e).splitlines()[0]})") from None
        world = len(topology.gpu_roles)
        out["suggested_splits"] = [{"gpus": g, "targets": t, "drafters": d, "expected_tok_per_s": x}
                                   for g, t, d, x in suggested_splits(t_rate, d_rate, (world, 8))]
    saves = [{"step": r["step"], "stall_s": r["save_stall_s"], "wait_s": r.get("save_wait_s"),
              **{k[5:]: r[k] for k in ("save_pin_s", "save_pin_wait_s") if k in r}}
             for r in metrics.rows if "save_stall_s" in r]
    writes = {r["save_step"]: r["save_write_s"] for r in metrics.rows if "save_step" in r and "save_write_s" in r}
    for s in saves:
        s["write_s"] = writes.get(s["step"])
    out["saves"] = saves
    inside = [s for s in saves if first_window_end < s["step"] < last_step]
    out["saves_inside_window"] = len(inside)
    if inside:
        out["max_stall_inside_window_s"] = max(s["stall_s"] - (s["wait_s"] or 0) for s in inside)
    if outcome:
        out.update({k: outcome.get(k) for k in ("first_step_s", "to_first_step_s", "startup", "compiled_graphs",
                                                   "recompiles")})
        out["ended"] = (outcome.get("ended") or {}).get("how")
        out["gpus"] = gpu_memory(snap, outcome)
    return out


def gpu_memory(snap: dict, outcome: dict) -> list[dict]:
    """Each GPU the run used: its roles, NVML peak (outcome.json) and preflight's estimate for its role
    (snapshot.json), and how far the estimate was off."""
    predicted = {role: (v or {}).get("bytes") for role, v in ((snap.get("memory") or {}).get("roles") or {}).items()}
    peaks = (outcome.get("peak") or {}).get("gpus") or {}
    out = []
    for gpu in (snap.get("gpus") or {}).get("devices") or []:
        roles = gpu.get("roles") or []
        if not roles:
            continue
        if {"target", "drafter"} <= set(roles) and predicted.get("colocated"):  # one GPU holding both: its own row
            estimate = predicted["colocated"]
        else:
            estimate = max((predicted.get(r) or 0 for r in roles), default=0) or None
        peak = peaks.get(gpu.get("uuid"))
        row = {"index": gpu.get("index"), "roles": roles, "nvml_peak_gib": gib(peak), "estimate_gib": gib(estimate)}
        if peak and estimate:
            row["estimate_error"] = round(estimate / peak - 1, 4)  # + : the estimate was above the measurement
        out.append(row)
    return out


def gib(n) -> float | None:
    return None if n is None else round(n / 2**30, 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a run dir dflash-train wrote (metrics.jsonl, outcome.json, snapshot.json)")
    p.add_argument("--min-steps", type=int, default=0, help="steps the steady window must hold (exit 1 if fewer)")
    p.add_argument("--out", type=Path, help="write the summary as JSON here")
    args = p.parse_args(argv)
    if args.min_steps < 0:
        p.error(f"--min-steps must be >= 0, got {args.min_steps}")
    try:
        s = summarize(args.run_dir)
    except UsageError as e:
        print(f"pace_summary: {e}", file=sys.stderr)
        return 2
    steady = s.get("steady_tok_per_s") or {}
    print(f"{s['run_dir']}: {s['steps']} steps, steady window {s['steady_steps']} steps after step "
          f"{s['first_window_end_step']}: {steady.get('mean', '-')} tok/s mean ({steady.get('min', '-')}-"
          f"{steady.get('max', '-')} over {steady.get('windows', 0)} windows)")
    startup = s.get("startup") or {}
    print(f"first step {s.get('first_step_s')} s; {startup.get('launch_to_first_step_s')} s from launch (target "
          f"{startup.get('target_s')} s, setup {startup.get('setup_s')} s), {s.get('to_first_step_s')} s from the "
          f"gate; recompiles after it: {s.get('recompiles')}")
    if "busy_tok_s_per_gpu" in s:
        b = s["busy_tok_s_per_gpu"]
        print(f"busy: target {b['target']:.0f}, drafter {b['drafter']:.0f} tok/s per GPU; waits: drafters "
              f"{s.get('drafter_wait_frac', 0):.0%}, targets {s.get('target_wait_frac', 0):.0%}")
        for x in s["suggested_splits"]:
            print(f"suggested split for {x['gpus']} GPUs: {x['targets']} target + {x['drafters']} drafter, "
                  f"expected {x['expected_tok_per_s']:.0f} tok/s")
    for g in s.get("gpus") or []:
        print(f"GPU {g['index']} {'+'.join(g['roles'])}: NVML peak {g['nvml_peak_gib']} GiB, estimate "
              f"{g['estimate_gib']} GiB ({g.get('estimate_error', 0):+.1%})")
    for x in s["saves"]:
        print(f"save at step {x['step']}: stall {x['stall_s']} s (waiting for the previous {x['wait_s']} s), "
              f"write {x['write_s']} s")
    if args.out:
        write_json(args.out, s)
    short = [why for why, bad in ((f"the steady window holds {s['steady_steps']} steps, fewer than --min-steps "
                                   f"{args.min_steps}", s["steady_steps"] < args.min_steps),
                                  ("no checkpoint save fell inside the steady window (set train.save_every below "
                                   "the steps)", args.min_steps > 0 and not s["saves_inside_window"])) if bad]
    for why in short:
        print(f"pace_summary: {why}", file=sys.stderr)
    return 1 if short else 0


if __name__ == "__main__":
    sys.exit(main())
