"""The README's main job, timed as a newcomer meets it: `time uv run dflash-train --demo` from a fresh clone.

Each run clones this repository at COMMIT into a new temporary folder, gives it an empty DFLASH_CACHE (so the GGUF
conversion and the data generation are timed too), runs `uv run dflash-train --demo` there and reads from its output
the time each stage began (the demo prints "[n/5] ... (t = N s)"), the wall time and the held-out acceptance
lengths it printed. Runs go one after another, never side by side (the demo is the only load it is measured under).

    uv run python bench/demo_time.py --commit c94b32a --commit HEAD --runs 3 --out bench/results/cpu2_demo_time.json
    uv run python bench/demo_time.py --commit HEAD --runs 1 --busy 1   # beside one busy core (another program)
    uv run python bench/demo_time.py --parse demo.log          # the same figures from the output of a demo run

Prints a table (one row per run: the five stages' seconds, wall, trained / DDTree / untrained acceptance) and,
with --out, writes every figure as JSON with the machine.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, cpu_name, write_json  # noqa: E402

STAGES = ("target", "data", "preflight", "train", "evaluate")
STAGE_RE = re.compile(r"^\[(\d)/5\] .*\(t = (\d+) s\)\s*$")
RESULT_RE = re.compile(r"held-out acceptance length: trained ([\d.]+) \(DDTree, (\d+) nodes: ([\d.]+)\) vs untrained "
                       r"([\d.]+) .*the demo took (\d+) s")


def parse(text: str) -> dict:
    """Stage seconds, the demo's own total and its acceptance lengths from a demo's output ({} where not found)."""
    starts: dict[int, int] = {}
    for line in text.splitlines():
        if m := STAGE_RE.match(line.strip()):
            starts[int(m.group(1))] = int(m.group(2))
    out: dict = {}
    m = RESULT_RE.search(text)
    if m:
        out.update(trained=float(m.group(1)), ddtree_budget=int(m.group(2)), ddtree=float(m.group(3)),
                   untrained=float(m.group(4)), demo_s=int(m.group(5)))
    ends = {**{n - 1: t for n, t in starts.items() if n > 1}, 5: out.get("demo_s")}
    out["stage_s"] = {name: (ends[n] - starts[n]) if n in starts and ends.get(n) is not None else None
                      for n, name in enumerate(STAGES, start=1)}
    out["lossless"] = "FAILED: speculative decoding did not reproduce" not in text and bool(m)
    return out


def run_once(commit: str, keep: Path | None, busy: int = 0) -> dict:
    """One fresh clone at `commit`, an empty cache, `uv run dflash-train --demo` timed from the outside, beside `busy`
    processes that each keep one core busy (a machine that is not the demo's alone)."""
    with tempfile.TemporaryDirectory(prefix="dflash-demo-") as tmp:
        clone, cache = Path(tmp) / "clone", Path(tmp) / "cache"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        subprocess.run(["git", "-C", str(clone), "checkout", "-q", commit], check=True)
        sha = subprocess.run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"], check=True, text=True,
                             capture_output=True).stdout.strip()
        env = {**os.environ, "DFLASH_CACHE": str(cache), "UV_NO_PROGRESS": "1"}
        env.pop("VIRTUAL_ENV", None)
        subprocess.run(["uv", "sync", "-q"], cwd=clone, env=env, check=True)  # the environment, not the demo
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            t0 = time.perf_counter()
            proc = subprocess.run(["uv", "run", "dflash-train", "--demo"], cwd=clone, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            wall = time.perf_counter() - t0
        finally:
            for h in hogs:
                h.kill()
        if keep:
            (keep / f"demo-{sha}-{int(time.time())}.log").write_text(proc.stdout)
    return {"commit": sha, "busy_cores": busy, "exit": proc.returncode, "wall_s": round(wall, 1), **parse(proc.stdout)}


def row(r: dict) -> str:
    stages = " ".join(f"{r['stage_s'][s] if r['stage_s'][s] is not None else '-':>5}" for s in STAGES)
    return (f"{r.get('commit', '-'):>8}{'+busy' * r.get('busy_cores', 0)} {stages} {r.get('wall_s', r.get('demo_s', '-')):>7}  "
            f"{r.get('trained', '-')} / {r.get('ddtree', '-')} / {r.get('untrained', '-')}"
            f"{'' if r.get('lossless') else '  (not lossless or unfinished)'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", action="append", default=[], help="commit to time (repeat for several; runs alternate)")
    ap.add_argument("--runs", type=int, default=3, help="runs per commit")
    ap.add_argument("--busy", type=int, default=0, help="processes each keeping one core busy beside every run")
    ap.add_argument("--parse", nargs="*", default=[], metavar="LOG", help="read demo outputs instead of running")
    ap.add_argument("--keep-logs", type=Path, help="folder to keep each run's output in")
    ap.add_argument("--out", type=Path, help="JSON file for every figure")
    args = ap.parse_args()
    if not args.commit and not args.parse:
        ap.error("give --commit COMMIT (to run) or --parse LOG")
    if args.runs < 1 or args.busy < 0:
        ap.error("--runs must be at least 1 and --busy at least 0")
    missing = [p for p in args.parse if not Path(p).is_file()]
    if missing:
        ap.error(f"--parse {missing[0]}: no such file (give the saved output of a demo run)")
    results = [{"log": str(p), **parse(Path(p).read_text(errors="replace"))} for p in args.parse]
    print(f"{'commit':>8} {' '.join(f'{s[:5]:>5}' for s in STAGES)} {'wall s':>7}  trained / DDTree / untrained")
    for r in results:
        print(row(r), flush=True)
    for _ in range(args.runs if args.commit else 0):
        for commit in args.commit:  # alternating, so a slow hour of the machine falls on every commit alike
            r = run_once(commit, args.keep_logs, args.busy)
            results.append(r)
            print(row(r), flush=True)
    if args.out:
        machine = f"{os.cpu_count()} cores, {cpu_name()}, load average {os.getloadavg()[0]:.2f} at the end"
        write_json(args.out, {"command": " ".join(sys.argv), "machine": machine, "runs": results})
    return 0 if all(r.get("lossless") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
