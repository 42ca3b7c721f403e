"""The probe of the machine: what a run's process holds on each GPU outside torch's allocator, measured, cached.

    python -m preflight.probe --gpus 0,1 --steps context,matmul,attention,nccl --json   # measure, print
    from preflight.probe import probe_for_run
    ctx.overhead = probe_for_run(ctx)          # preflight's gate: the run's GPUs, the run's steps, cached

On each GPU a short-lived subprocess of this interpreter (``python -m preflight.probe_gpu``, the run's own
environment; CUDA_VISIBLE_DEVICES set to that GPU) creates the CUDA context and loads what the run loads, then reads
NVML for itself and torch's reserved bytes (``preflight.facts.overhead``). This process never imports torch and
never creates a CUDA context. The subprocesses run side by side, each within the timeout, in their own process group,
killed and reaped when they overrun: no probe is left on a GPU.

A result is cached per machine state (torch build, CUDA, driver, GPU model and size, NCCL, the steps loaded, the
CUDA/NCCL variables; ``MachineState``) under ``$DFLASH_CACHE/probe/`` (default ~/.cache/dflash), written atomically,
so the probe runs once per change. A cache file of another state is never used; an unreadable one is ignored with a
note. A GPU another process holds is not probed; a probe that cannot run (no driver, a broken environment, a
timeout) is one line: in both cases the memory model keeps its calibrated constant and the gpu-memory check warns.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dflash.memory.shape import GiB
from dflash.models.smollm2 import cache_root
from preflight.facts.overhead import GpuOverhead, MachineState, Overhead, from_probe
from preflight.nvml import Gpu, NvmlGpuInfo, NvmlSnapshot, NvmlUnavailable, resolve_gpu, visible_gpus

DEFAULT_TIMEOUT_S = 120.0  # per probe: a context, a few kernels and an NCCL communicator take seconds; fla autotunes
BASE_STEPS = ("context", "matmul", "attention")  # what every GPU run loads (preflight.probe_gpu.STEPS)
ENV_KEYS = ("CUDA_MODULE_LOADING",)  # besides NCCL_*: variables that change what loading costs
CACHE_FOLDER = "probe"
KILL_WAIT_S = 10.0  # how long a killed probe may take to go (a process stuck in the driver is not waited for)


def run_steps(cfg, shape) -> tuple[str, ...]:
    """What a run of this config loads on each GPU: fla's kernels for a hybrid target, an NCCL communicator where
    the layout has a process group (a split, or several drafter ranks)."""
    from dflash.memory.parts import drafter_ranks

    steps = list(BASE_STEPS)
    if shape is not None and getattr(shape, "linear_layers", 0):
        steps.append("fla")
    if cfg.topology.layout == "split" or drafter_ranks(cfg) > 1:
        steps.append("nccl")
    return tuple(steps)


def machine_state(gpu: Gpu, driver: str, torch_build, distributions: dict[str, list[str]], env: dict[str, str],
                  steps: tuple[str, ...]) -> MachineState:
    """The state a probe of `gpu` is valid for (torch_build: preflight.facts.environment.TorchBuild or None)."""
    nccl = next((", ".join(v) for n, v in sorted(distributions.items()) if n.startswith("nvidia-nccl")), None)
    kept = sorted((k, v) for k, v in env.items() if k in ENV_KEYS or k.startswith("NCCL_"))
    return MachineState(torch=torch_build.version if torch_build else None, cuda=torch_build.cuda if torch_build else None,
                        driver=driver, gpu=gpu.name, gpu_total_bytes=gpu.memory_total, nccl=nccl, steps=tuple(steps),
                        env=tuple(kept))


# ---------------------------------------------------------------- the cache


def cache_dir() -> Path:
    return cache_root() / CACHE_FOLDER


def read_cache(state: MachineState, folder: Path | None = None) -> tuple[dict[str, GpuOverhead], str | None]:
    """(the GPUs cached for exactly this state, a note when the file was there but not usable)."""
    path = (folder or cache_dir()) / f"{state.key()}.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError) as e:
        return {}, f"probe cache {path.name} ignored ({type(e).__name__}: not readable JSON); probing again"
    try:
        if MachineState.from_dict(raw["state"]) != state:
            return {}, f"probe cache {path.name} is of another machine state; probing again"
        gpus = {u: GpuOverhead.from_dict(dict(g, uuid=u, source="cached")) for u, g in raw["gpus"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return {}, f"probe cache {path.name} ignored ({type(e).__name__}: not a probe record); probing again"
    return {u: g for u, g in gpus.items() if g.measured}, None


def write_cache(state: MachineState, gpus: dict[str, GpuOverhead], folder: Path | None = None) -> str | None:
    """Merge measured GPUs into this state's cache file, atomically; a note when it could not be written."""
    folder = folder or cache_dir()
    path = folder / f"{state.key()}.json"
    have, _ = read_cache(state, folder)
    have.update({u: g for u, g in gpus.items() if g.measured})
    record = {"state": state.to_dict(), "gpus": {u: dict(g.to_dict(), source="measured") for u, g in have.items()}}
    tmp = folder / f".{path.name}.{os.getpid()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        return f"probe cache not written to {folder} ({e.strerror or e})"
    return None


# ---------------------------------------------------------------- the subprocesses


@dataclass
class _Child:
    uuid: str
    proc: subprocess.Popen | None
    error: str | None = None


def _start(uuid: str, steps: tuple[str, ...], env: dict[str, str], python: str) -> _Child:
    argv = [python, "-m", "preflight.probe_gpu", "--uuid", uuid, "--steps", ",".join(steps)]
    child_env = dict(env, CUDA_VISIBLE_DEVICES=uuid, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), *filter(None, [env.get("PYTHONPATH")])]))
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=child_env, start_new_session=True, text=True)
    except OSError as e:
        return _Child(uuid, None, f"probe could not start ({e.strerror or e})")
    return _Child(uuid, proc)


def _kill(proc: subprocess.Popen) -> None:
    """Kill the probe and anything it started (its own process group), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.communicate(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:  # stuck in the driver: preflight goes on, never hangs on it
        pass


def _finish(child: _Child, deadline: float, timeout: float) -> dict:
    """The child's JSON, or {"ok": False, "error": one line}."""
    if child.proc is None:
        return {"ok": False, "error": child.error}
    try:
        out, err = child.proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill(child.proc)
        return {"ok": False, "error": f"probe timed out after {timeout:g} s (killed)", "pid": child.proc.pid}
    lines = [ln for ln in (out or "").splitlines() if ln.strip()]
    try:
        result = json.loads(lines[-1])
        if not isinstance(result, dict) or "ok" not in result:
            raise ValueError("not a probe result")
    except (IndexError, ValueError):
        last = next((ln.strip() for ln in reversed((err or "").splitlines()) if ln.strip()), "no output")
        return {"ok": False, "error": f"probe exited {child.proc.returncode} without a result: {last[:200]}",
                "pid": child.proc.pid}
    result.setdefault("pid", child.proc.pid)
    return result


def probe_gpus(gpus: dict[str, Gpu], states: dict[str, MachineState], timeout: float = DEFAULT_TIMEOUT_S,
               use_cache: bool = True, env: dict[str, str] | None = None, python: str | None = None,
               cache: Path | None = None, busy_pids: dict[str, list[int]] | None = None) -> Overhead:
    """Probe each GPU (name -> Gpu; states: uuid -> its MachineState), cached results first; a GPU with other
    processes (busy_pids: uuid -> pids) is not probed. Every GPU gets an entry: measured, cached or constant."""
    env = dict(os.environ if env is None else env)
    python = python or sys.executable
    result = Overhead()
    todo: dict[str, Gpu] = {}
    for name, gpu in gpus.items():
        pids = (busy_pids or {}).get(gpu.uuid)
        if pids:
            result.gpus[gpu.uuid] = GpuOverhead(gpu.uuid, "constant", note=(
                f"GPU {name} not probed: held by pid {', '.join(map(str, pids))}; the calibrated constant is used"))
            continue
        if use_cache:
            cached, note = read_cache(states[gpu.uuid], cache)
            if note and note not in result.notes:
                result.notes.append(note)
            if gpu.uuid in cached:
                result.gpus[gpu.uuid] = cached[gpu.uuid]
                continue
        todo[name] = gpu
    if not todo:
        return result
    start = time.monotonic()
    children = {name: _start(gpu.uuid, states[gpu.uuid].steps, env, python) for name, gpu in todo.items()}
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    fresh: dict[MachineState, dict[str, GpuOverhead]] = {}
    try:
        outs = {name: _finish(child, start + timeout, timeout) for name, child in children.items()}
    finally:  # interrupted (Ctrl-C, a signal): no probe outlives the preflight that started it
        for child in children.values():
            if child.proc is not None and child.proc.poll() is None:
                _kill(child.proc)
    for name, out in outs.items():
        gpu, state = todo[name], states[todo[name].uuid]
        if out.get("ok"):
            try:
                result.gpus[gpu.uuid] = from_probe(gpu.uuid, out, state, stamp)
                fresh.setdefault(state, {})[gpu.uuid] = result.gpus[gpu.uuid]
                continue
            except ValueError as e:
                out = {"ok": False, "error": str(e)}
        result.gpus[gpu.uuid] = GpuOverhead(gpu.uuid, "constant", pid=out.get("pid"), note=(
            f"GPU {name} not probed: {out.get('error')}; the calibrated constant is used"))
    if use_cache:
        for state, measured in fresh.items():
            note = write_cache(state, measured, cache)
            if note and note not in result.notes:
                result.notes.append(note)
    return result


def probe_for_run(ctx, timeout: float = DEFAULT_TIMEOUT_S, use_cache: bool = True) -> Overhead | None:
    """The gate's probe (a preflight.facts.context.Context gathered with a run config on CUDA): each assigned GPU
    NVML sees, with the steps the run loads; None when there is nothing to probe (no config, CPU, no NVML)."""
    snap = ctx.gpus.snapshot
    if ctx.config is None or ctx.config.device != "cuda" or snap is None:
        return None
    steps = run_steps(ctx.config, ctx.target_shape)
    me = ctx.host.get("pid", os.getpid())
    gpus, busy = {}, {}
    for name, _role, gpu, _why in ctx.resolved_gpus():
        if gpu is not None and gpu.uuid not in {g.uuid for g in gpus.values()}:
            gpus[name] = gpu
            busy[gpu.uuid] = [p.pid for p in gpu.processes if p.pid != me]
    states = {g.uuid: machine_state(g, snap.driver_version, ctx.torch, ctx.distributions, ctx.env, steps)
              for g in gpus.values()}
    return probe_gpus(gpus, states, timeout, use_cache, env=ctx.env, busy_pids=busy)


# ---------------------------------------------------------------- on its own


def probe_named(names: list[str], steps: tuple[str, ...], timeout: float = DEFAULT_TIMEOUT_S, use_cache: bool = True,
                snapshot: NvmlSnapshot | None = None, env: dict[str, str] | None = None) -> tuple[Overhead, dict[str, Gpu]]:
    """Probe the GPUs named as a run config names them (indices after CUDA_VISIBLE_DEVICES, or UUIDs), this
    interpreter's torch build and distributions keying the cache. Raises NvmlUnavailable, ValueError (a bad name)."""
    from preflight.facts.environment import torch_build
    from preflight.pyenv import installed_distributions

    env = dict(os.environ if env is None else env)
    snap = snapshot or NvmlGpuInfo().snapshot()
    visible, _ = visible_gpus(snap.gpus, env.get("CUDA_VISIBLE_DEVICES"))
    gpus = {}
    for name in names:
        gpu, why = resolve_gpu(name, visible, snap.gpus)
        if gpu is None:
            raise ValueError(why)
        gpus[name] = gpu
    build, dists = torch_build(), installed_distributions()
    states = {g.uuid: machine_state(g, snap.driver_version, build, dists, env, steps) for g in gpus.values()}
    busy = {g.uuid: [p.pid for p in g.processes if p.pid != os.getpid()] for g in gpus.values()}
    return probe_gpus(gpus, states, timeout, use_cache, env=env, busy_pids=busy), gpus


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def format_overhead(overhead: Overhead, gpus: dict[str, Gpu]) -> list[str]:
    """One line per GPU, then its readings and the notes: what `python -m preflight.probe` prints."""
    lines = []
    for name, gpu in gpus.items():
        g = overhead.gpus.get(gpu.uuid)
        if g is None:
            continue
        if not g.measured:
            lines.append(f"GPU {name} ({gpu.name}, {gpu.uuid[:12]}…): {g.note}")
            continue
        nccl = f", NCCL {_gib(g.nccl_bytes)}" if g.nccl_bytes is not None else ""
        lines.append(f"GPU {name} ({gpu.name}, {gpu.uuid[:12]}…): outside torch {_gib(g.outside_torch_bytes)} GiB "
                     f"(context and kernels {_gib(g.context_bytes)}{nccl}) [{g.source}"
                     f"{', ' + g.time_utc if g.time_utc else ''}]")
        for r in g.steps:
            lines.append(f"  after {r.get('step'):<10} process {_gib(r.get('process_bytes'))} GiB, torch reserved "
                         f"{_gib(r.get('torch_reserved_bytes'))}, card used {_gib(r.get('device_used_bytes'))}")
        if g.note:
            lines.append(f"  note: {g.note}")
    return lines + [f"note: {n}" for n in overhead.notes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m preflight.probe", description="Measure, on each GPU named, the "
                                     "memory a run's process holds outside torch's allocator (cached per machine state).")
    parser.add_argument("--gpus", default="0", help="comma list of GPUs: indices after CUDA_VISIBLE_DEVICES, or UUIDs")
    parser.add_argument("--steps", default=",".join(BASE_STEPS), help="what to load: context, matmul, attention, "
                        "flex, fla, nccl (preflight.probe_gpu)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per probe")
    parser.add_argument("--no-cache", action="store_true", help="measure again, ignoring (and not writing) the cache")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    steps = tuple(s.strip() for s in args.steps.split(",") if s.strip())
    try:
        overhead, gpus = probe_named([n.strip() for n in args.gpus.split(",") if n.strip()], steps, args.timeout,
                                     not args.no_cache)
    except (NvmlUnavailable, ValueError) as e:
        print(f"preflight.probe: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(dict(overhead.to_dict(), names={n: g.uuid for n, g in gpus.items()}), indent=2))
    else:
        print("\n".join(format_overhead(overhead, gpus)))
    return 0 if all(g.measured for g in overhead.gpus.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
