"""One runner for every GPU measurement: set up, run, sample NVML, stop before the deadline, resume, summarise.

    PYTHONPATH=. python3 bench/runner.py q36-packed-mix --deadline 560            # a named recipe (--list shows all)
    PYTHONPATH=. python3 bench/runner.py q36-packed-mix --deadline 560            # again: resumes from its checkpoint
    PYTHONPATH=. python3 bench/runner.py train --config RUN.toml --data syn:400,1500,0.8,8192,151936 --steps 40
    uv run python bench/runner.py tiny-cpu --deadline 60 --out .cache/out        # the CPU recipe the suite runs

What one call does, in the foreground and inside --deadline seconds (a device call's limit):
1. Set up: carried wheels (.whl/**/*.whl) installed once into a site folder the children import; on an image that
   is not this project's uv environment, the device waivers (torch-build, env-drift, cuda-libs, model-source) with
   their reason.
2. Each recipe: its synthetic data (bench/make_synthetic.py's writer, kept when already there), `dflash-estimate`
   of its config, then `dflash-train` in its own process group: --fresh the first time, --resume latest when its run
   dir holds a checkpoint and its outcome is not finished. NVML is sampled every 0.25 s for the whole process (what
   the card holds for it: torch, the CUDA context, libraries) and the device. Before the deadline the runner sends
   SIGTERM to the process group, as a scheduler does, waits --grace s for exit 75 and the checkpoint, and records
   how long the stop took; the next call resumes from that checkpoint.
3. Under --out (default $OUT, else .cache/out), one name per recipe: RECIPE.json (the summary: steady rates as
   bench/pace_summary.py computes them, graphs after step 1, saves, the stop, NVML peak against the estimate) and
   RECIPE.tar.gz (the log, metrics.jsonl, outcome.json, snapshot.json, the estimate, the NVML samples).

Exit: 0 when every recipe ran (a stop at the deadline included), 1 when one failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WAIVERS = [("torch-build", "device image ships its own torch build, not the profile's"),
           ("env-drift", "device image is not a uv environment of this project"),
           ("cuda-libs", "device image carries its own CUDA wheels"),
           ("model-source", "device copy of the working tree")]
SAMPLE_S = 0.25  # NVML sampling period
PACKED = ["topology.target_gpus=[]", "topology.drafter_gpus=[]", "data.packing=true", "data.pack_remainders=false"]
SHAPES = ["target.random_init=true"]  # the presets' targets are config.json alone: shapes, no weights


@dataclass
class Recipe:
    """A dflash-train run to measure: its config, overrides, data and length."""
    name: str
    about: str
    config: str
    data: str  # "syn:SAMPLES,LENGTH,SIGMA,MAX_LENGTH,VOCAB" (synthetic, written under .cache/) or a dataset folder
    steps: int
    save_every: int
    sets: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)


Q36, Q8 = "configs/qwen3.6-27b-5t3d.toml", "configs/qwen3-8b-1gpu.toml"
Q36_MIX, Q36_ONE = "syn:1600,2826,0.6,16384,248320", "syn:1200,2826,0,0,248320"
Q8_MIX, Q8_ONE = "syn:2400,1500,0.7,8192,151936", "syn:2400,1500,0,0,151936"
Q8_PACKED = ["data.token_budget=16384", "train.batch_anchors=1024"]
RECIPES = {r.name: r for r in [
    Recipe("q36-packed-mix", "the users' 27B preset co-located and packed on a lognormal mix around 2,826 tokens "
           "(sigma 0.6): the packed rate's claim (one H200)", Q36, Q36_MIX, 115, 50, [*SHAPES, *PACKED]),
    Recipe("q36-packed-one", "the same, every sample 2,826 tokens: the reference beside the mix (one H200)", Q36,
           Q36_ONE, 45, 30, [*SHAPES, *PACKED]),
    Recipe("q36-packed-mix-gamma", "q36-packed-mix with train.slot_weights = gamma (the preset's is cap): the "
           "two slot weightings' step time, same batches", Q36, Q36_MIX, 40, 1000,
           [*SHAPES, *PACKED, 'train.slot_weights="gamma"']),
    Recipe("q8-packed-mix", "the Qwen3-8B preset co-located and packed (budget 16,384) on a lognormal mix around "
           "1,500 tokens (sigma 0.7): the packed ratio on an H100", Q8, Q8_MIX, 120, 60,
           [*SHAPES, *PACKED, *Q8_PACKED]),
    Recipe("q8-packed-one", "the same, every sample 1,500 tokens", Q8, Q8_ONE, 60, 30, [*SHAPES, *PACKED, *Q8_PACKED]),
]}
CPU_RECIPE = "tiny-cpu"  # made on the spot: the tiny CPU preset (its target and data written under the run dir)


def parse_data(spec: str) -> tuple[int, int, float, int, int] | None:
    """(samples, length, sigma, max_length, vocab) of a "syn:..." spec; None for a folder. Raises ValueError."""
    if not spec.startswith("syn:"):
        return None
    parts = spec[4:].split(",")
    if len(parts) != 5:
        raise ValueError(f"--data {spec!r}: write syn:SAMPLES,LENGTH,SIGMA,MAX_LENGTH,VOCAB (MAX_LENGTH 0: none)")
    try:
        samples, length, sigma, cap, vocab = int(parts[0]), int(parts[1]), float(parts[2]), int(parts[3]), int(parts[4])
    except ValueError:
        raise ValueError(f"--data {spec!r}: SAMPLES, LENGTH, MAX_LENGTH and VOCAB are integers, SIGMA a number") from None
    if samples < 1 or length < 2 or sigma < 0 or vocab < 3:
        raise ValueError(f"--data {spec!r}: needs SAMPLES >= 1, LENGTH >= 2, SIGMA >= 0, VOCAB >= 3")
    return samples, length, sigma, cap, vocab


def make_data(spec: str) -> Path:
    """The dataset folder of a spec: a synthetic one is written once under .cache/ (kept when already there)."""
    parsed = parse_data(spec)
    if parsed is None:
        return Path(spec)
    samples, length, sigma, cap, vocab = parsed
    from dflash.data.synthetic import write_random_dataset

    out = REPO / ".cache" / f"syn-{samples}x{length}-s{sigma:g}-c{cap}-v{vocab}"
    return Path(write_random_dataset(out, samples, length, vocab, sigma=sigma, max_length=cap or None))


def tiny_cpu(root: Path) -> Recipe:
    """The CPU recipe: the tests' tiny preset (dflash.data.synthetic's tiny target and pattern data)."""
    from bench.common import TINY_TARGET
    from dflash.data.synthetic import write_pattern_dataset, write_target

    root.mkdir(parents=True, exist_ok=True)
    target = write_target(root / "tiny-target", TINY_TARGET)
    data = write_pattern_dataset(root / "tiny-data")
    config = root / "tiny.toml"
    config.write_text("\n".join([
        'device = "cpu"', f"[target]\npath = {json.dumps(str(target))}\nrandom_init = true\ndtype = \"float32\"",
        "[drafter]\nnum_layers = 1\nblock_size = 4",
        "[data]\ntoken_budget = 512\nmax_batch_size = 8\nnum_buckets = 2",
        "[train]\nmax_anchors = 16\ngamma = 4.0\nlr = 0.01\nwarmup_ratio = 0.1\nloss_chunk = 64\ncompile = false",
    ]) + "\n")
    return Recipe(CPU_RECIPE, "the tiny CPU preset, stopped by the deadline", str(config), str(data), 100_000, 20,
                  ["train.log_every=2"])


# --------------------------------------------------------------------------- set-up


def install_wheels(site: Path) -> str | None:
    """Carried wheels (.whl/ and its sub-folders) installed once into `site`; the folder for PYTHONPATH, or None."""
    wheels = sorted((REPO / ".whl").rglob("*.whl")) if (REPO / ".whl").is_dir() else []
    if not wheels or not is_device_image():  # this project's own environment has what it needs
        return None
    stamp = site / ".installed"
    names = "\n".join(w.name for w in wheels)
    if not (stamp.exists() and stamp.read_text() == names):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
        stamp.write_text(names)
    return str(site)


def is_device_image() -> bool:
    """Whether this Python is not one of this project's uv environments (then preflight needs the device waivers)."""
    prefix = Path(sys.prefix).resolve()
    return not (prefix == (REPO / ".venv").resolve() or (REPO / ".venvs").resolve() in prefix.parents)


def waivers() -> list[str]:
    return [a for check, why in WAIVERS for a in ("--waive", check, "--reason", why)] if is_device_image() else []


# --------------------------------------------------------------------------- NVML


class Sampler:
    """NVML every SAMPLE_S s on a thread: per GPU, the device's used bytes and what process `pid` holds (the whole
    process: torch's allocator, the CUDA context, libraries, NCCL). Nothing without NVML (a CPU machine)."""

    def __init__(self, pid: int):
        self.pid, self.rows, self._stop = pid, [], threading.Event()
        self.t0 = time.monotonic()
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # no NVML here: nothing to sample
            self.nvml, self.handles = None, []
        self.thread = threading.Thread(target=self._run, daemon=True)
        if self.handles:
            self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            t = round(time.monotonic() - self.t0, 2)
            for i, h in enumerate(self.handles):
                with contextlib.suppress(Exception):
                    used = self.nvml.nvmlDeviceGetMemoryInfo(h).used
                    mine = sum(p.usedGpuMemory or 0 for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(h)
                               if p.pid == self.pid)
                    self.rows.append((t, i, used, mine))

    def stop(self) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join()

    def csv(self) -> str:
        return "t_s,gpu,device_used_bytes,process_used_bytes\n" + "".join(f"{t},{i},{u},{m}\n" for t, i, u, m in self.rows)

    def peaks(self) -> dict:
        out = {}
        for _t, i, used, mine in self.rows:
            p = out.setdefault(str(i), {"device_gib": 0.0, "process_gib": 0.0})
            p["device_gib"] = max(p["device_gib"], round(used / 2**30, 2))
            p["process_gib"] = max(p["process_gib"], round(mine / 2**30, 2))
        return out


# --------------------------------------------------------------------------- one recipe


def run_dir(recipe: Recipe) -> Path:
    return REPO / "runs" / recipe.name


def resumable(out: Path) -> bool:
    """A run dir with a checkpoint whose outcome is not "finished": the next call goes on from it."""
    from dflash.runs import rundir

    if not rundir.list_checkpoints(out):
        return False
    with contextlib.suppress(OSError, ValueError):
        return (json.loads((out / "outcome.json").read_text()).get("ended") or {}).get("how") != "finished"
    return True


def train_argv(recipe: Recipe, data: Path, out: Path, fresh: bool) -> list[str]:
    sets = [*recipe.sets, f"output_dir={json.dumps(str(out))}", f"data.path={json.dumps(str(data))}",
            f"train.save_every={recipe.save_every}", "train.keep_last=1"]
    if not any(s.startswith("train.log_every=") for s in sets):
        sets.append("train.log_every=5")
    argv = [sys.executable, "-m", "dflash.commands.train", "--config", recipe.config, "--max-steps", str(recipe.steps),
            "--no-progress", *(a for s in sets for a in ("--set", s)), *waivers()]
    return argv + (["--fresh"] if fresh else ["--resume", "latest"])


def estimate(recipe: Recipe, data: Path, env: dict) -> str:
    sets = [*recipe.sets, f"data.path={json.dumps(str(data))}"]
    argv = [sys.executable, "-m", "dflash.commands.estimate", "--config", recipe.config,
            *(a for s in sets for a in ("--set", s))]
    p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return f"$ {shlex.join(argv[1:])}\n{p.stdout}{p.stderr}"


def measure(recipe: Recipe, until: float, grace: float, out_dir: Path, env: dict) -> dict:
    """Run one recipe up to the monotonic time `until` (SIGTERM to its process group then), summarise, bundle."""
    from bench.pace_summary import summarize

    data = make_data(recipe.data)
    out = run_dir(recipe)
    fresh = not resumable(out)
    env = {**env, **recipe.env}
    est = estimate(recipe, data, env)
    argv = train_argv(recipe, data, out, fresh)
    log = io.StringIO()
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    sampler = Sampler(proc.pid)
    reader = threading.Thread(target=lambda: [log.write(line) for line in proc.stdout], daemon=True)
    reader.start()
    stop = {"signalled": False}
    while proc.poll() is None:
        if time.monotonic() >= until and not stop["signalled"]:
            stop.update(signalled=True, at_s=round(time.monotonic() - t0, 1))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            t_sig = time.monotonic()
        if stop["signalled"] and time.monotonic() - t_sig > grace:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            stop["killed_after_grace"] = True
            break
        time.sleep(0.1)
    rc = proc.wait()
    if stop["signalled"]:
        stop["signal_to_exit_s"] = round(time.monotonic() - t_sig, 1)
    sampler.stop()
    reader.join(timeout=5)
    summary = {"recipe": recipe.name, "about": recipe.about, "command": shlex.join(argv[1:]), "fresh": fresh,
               "rc": rc, "wall_s": round(time.monotonic() - t0, 1), "stop": stop, "nvml_peak": sampler.peaks()}
    try:
        summary["pace"] = summarize(out)
    except Exception as e:  # a run that died before it wrote its records: the log says why
        summary["pace"] = {"error": f"{type(e).__name__}: {e}"}
    with contextlib.suppress(OSError, ValueError):
        ended = json.loads((out / "outcome.json").read_text()).get("ended") or {}
        summary["ended"] = ended
    bundle(out_dir / f"{recipe.name}.tar.gz", out, {"train.log": log.getvalue(), "estimate.txt": est,
                                                    "nvml.csv": sampler.csv()})
    (out_dir / f"{recipe.name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def bundle(path: Path, run: Path, texts: dict[str, str]) -> None:
    """One archive per recipe (a device call brings back at most 8 files): the run's records and the texts."""
    with tarfile.open(path, "w:gz") as tar:
        for name in ("metrics.jsonl", "outcome.json", "snapshot.json", "stopped.json"):
            if (run / name).exists():
                tar.add(run / name, arcname=name)
        for name, text in texts.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))


def line(s: dict) -> str:
    """One line of a recipe's result."""
    pace = s.get("pace") or {}
    steady = pace.get("steady_tok_per_s") or {}
    stop = s.get("stop") or {}
    gpus = pace.get("gpus") or []
    mem = "; ".join(f"GPU {g['index']} NVML {g['nvml_peak_gib']} vs {g['estimate_gib']} GiB predicted"
                    for g in gpus) or "no NVML"
    stopped = (f"; SIGTERM at {stop['at_s']} s -> exit {s['rc']} in {stop.get('signal_to_exit_s')} s"
               if stop.get("signalled") else f"; exit {s['rc']}")
    return (f"{s['recipe']}: {pace.get('steps', 0)} steps ({'fresh' if s['fresh'] else 'resumed'}), steady "
            f"{steady.get('median', '-')} median / {steady.get('mean', '-')} mean tok/s over "
            f"{steady.get('windows', 0)} windows, recompiles after step 1: {pace.get('recompiles')}; {mem}{stopped}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipes", nargs="*", help=f"recipe names (--list), {CPU_RECIPE}, or 'train' with --config/--data")
    p.add_argument("--list", action="store_true", help="print the recipes and exit")
    p.add_argument("--deadline", type=float, default=560, help="seconds this call may take in all (default 560)")
    p.add_argument("--grace", type=float, default=90, help="seconds a stopped run has to exit before SIGKILL")
    p.add_argument("--reserve", type=float, default=None,
                   help="seconds kept for the stop and the summary before the deadline (default: grace + 15)")
    p.add_argument("--out", type=Path, default=None, help="results folder (default $OUT, else .cache/out)")
    p.add_argument("--fresh", action="store_true", help="start every recipe over (its run dir is moved aside)")
    p.add_argument("--config", help="'train': the run config")
    p.add_argument("--data", help="'train': a dataset folder or syn:SAMPLES,LENGTH,SIGMA,MAX_LENGTH,VOCAB")
    p.add_argument("--steps", type=int, default=100, help="'train': steps")
    p.add_argument("--save-every", type=int, default=50, help="'train': train.save_every")
    p.add_argument("--set", action="append", default=[], dest="sets", help="'train': a config override, as dflash-train")
    args = p.parse_args(argv)
    if args.list or not args.recipes:
        for r in RECIPES.values():
            print(f"{r.name:20} {r.steps:4} steps  {r.about}")
        print(f"{CPU_RECIPE:20} {'':10} the tiny CPU preset (the suite's check of this runner)")
        return 0 if args.list else 2
    unknown = [n for n in args.recipes if n not in RECIPES and n not in (CPU_RECIPE, "train")]
    if unknown:
        p.error(f"unknown recipe {unknown[0]!r}; --list shows them")
    if args.deadline <= 0 or args.grace <= 0:
        p.error("--deadline and --grace must be > 0")
    start = time.monotonic()
    recipes = []
    for name in args.recipes:
        if name == "train":
            if not args.config or not args.data:
                p.error("'train' needs --config and --data")
            try:
                parse_data(args.data)
            except ValueError as e:
                p.error(str(e))
            recipes.append(Recipe(Path(args.config).stem, "a run of --config", args.config, args.data, args.steps,
                                  args.save_every, args.sets))
        elif name == CPU_RECIPE:
            recipes.append(tiny_cpu(REPO / ".cache" / "tiny-cpu"))
        else:
            recipes.append(RECIPES[name])
    out_dir = args.out or Path(os.environ.get("OUT") or REPO / ".cache" / "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0")
    site = install_wheels(Path(tempfile.gettempdir()) / "dflash-bench-site")
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO), site, env.get("PYTHONPATH")) if x)
    reserve = args.reserve if args.reserve is not None else args.grace + 15
    failed = 0
    for i, recipe in enumerate(recipes):
        if args.fresh and run_dir(recipe).exists():
            run_dir(recipe).rename(run_dir(recipe).with_name(f"{recipe.name}.old-{int(time.time())}"))
        left = args.deadline - (time.monotonic() - start) - reserve
        share = left / (len(recipes) - i)  # what is left, shared by the recipes still to run
        if share < 30:
            print(f"runner: {recipe.name}: skipped, {left:.0f} s left before the deadline", file=sys.stderr)
            failed += 1
            continue
        s = measure(recipe, time.monotonic() + share, args.grace, out_dir, env)
        print(line(s), flush=True)
        failed += s["rc"] not in (0, 75)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
