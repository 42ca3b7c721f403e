"""fla's autotuning, measured and kept: a cold start of a hybrid target skips it where this GPU's choices are kept.

fla (the Gated DeltaNet kernels of Qwen3.5-family targets) autotunes each of its Triton kernels at the first call in a
process: every config compiled and timed, tens of configs a kernel. Triton keeps the choice in its cache dir, which
the compile cache artifact carries (dflash.train.compile_cache); on a machine with empty caches it tunes again. The
choice depends on the GPU model, the Triton and fla versions and the kernel's key (the model's head counts and widths, the
dtypes), so dflash keeps each GPU's choices for the shapes it measured in dflash/models/fla_tuned/<GPU>.json and sets
them in fla's autotuners before the target's first forward: a kernel called with another key tunes as before.

    harvest()          what fla's autotuners chose in this process, with the seconds each spent tuning
    seed(kept)         set kept choices in fla's autotuners (those not tuned yet); returns how many were set
    use_kept(log)      seed this GPU's kept file (or DFLASH_FLA_TUNED's); one line, or none where nothing is kept
    tuning_seconds()   the seconds fla's autotuners spent tuning in this process

DFLASH_FLA_TUNED=FILE seeds from FILE instead: a harvest (JSON), or a compile cache artifact whose manifest recorded
one (`dflash-train --warm-cache` records it); DFLASH_FLA_TUNED=off seeds nothing.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

KEPT = Path(__file__).with_name("fla_tuned")
ENV = "DFLASH_FLA_TUNED"


def kept_path(gpu_name: str) -> Path:
    """This GPU model's file of kept choices ("NVIDIA H100 80GB HBM3" -> fla_tuned/NVIDIA_H100_80GB_HBM3.json)."""
    return KEPT / f"{re.sub(r'[^0-9A-Za-z]+', '_', gpu_name).strip('_') or 'unknown'}.json"


def autotuners() -> dict:
    """{"module.kernel": Triton Autotuner} of every fla kernel loaded in this process (none when fla is not)."""
    try:
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction
    except ImportError:
        return {}
    found: dict = {}
    for name, module in list(sys.modules.items()):
        if not (name == "fla" or name.startswith("fla.")) or module is None:
            continue
        for value in list(vars(module).values()):
            obj, depth = value, 0
            while obj is not None and not isinstance(obj, JITFunction) and depth < 4:  # heuristics wrap autotuners
                if isinstance(obj, Autotuner):
                    fn = _jit(obj)
                    if fn is not None:
                        found[f"{fn.fn.__module__}.{fn.fn.__name__}"] = obj
                obj, depth = getattr(obj, "fn", None), depth + 1
    return found


def _jit(autotuner):
    from triton.runtime.jit import JITFunction

    fn = autotuner.fn
    for _ in range(4):
        if isinstance(fn, JITFunction):
            return fn
        fn = getattr(fn, "fn", None)
    return None


def _config_dict(config) -> dict | None:
    if getattr(config, "pre_hook", None) is not None:
        return None  # a hook is code: it does not travel in JSON
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}


def _plain(key) -> bool:
    return all(v is None or isinstance(v, (bool, int, float, str)) for v in key)


def fla_version() -> str | None:
    """The installed fla's version (fla-core, else flash-linear-attention), None when neither is."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("fla-core", "flash-linear-attention"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def harvest() -> dict:
    """{"triton": version, "fla": version, "kernels": {name: {"tuned_s": seconds tuning in this process or None
    (taken from a cache), "entries": [{"key": [...], "config": {...}}]}}} for every fla kernel that chose a config."""
    import triton

    kernels = {}
    for name, tuner in sorted(autotuners().items()):
        entries = [{"key": list(key), "config": c} for key, config in tuner.cache.items()
                   if _plain(key) and (c := _config_dict(config)) is not None]
        if entries:
            seconds = getattr(tuner, "bench_time", None)
            kernels[name] = {"tuned_s": round(seconds, 2) if seconds is not None else None, "entries": entries}
    return {"triton": triton.__version__, "fla": fla_version(), "kernels": kernels}


def tuning_seconds() -> tuple[float, int]:
    """(seconds fla's autotuners spent tuning in this process, kernels tuned): 0.0, 0 when none did."""
    times = [t for tuner in autotuners().values() if (t := getattr(tuner, "bench_time", None)) is not None]
    return sum(times), len(times)


def seed(kept: dict) -> int:
    """Set each kept choice in its loaded autotuner where that key has none yet; returns the choices set. A kept
    kernel this process has not loaded, or a key of another shape, changes nothing."""
    import triton

    tuners = autotuners()
    placed = 0
    for name, kernel in kept.get("kernels", {}).items():
        tuner = tuners.get(name)
        if tuner is None:
            continue
        for entry in kernel.get("entries", []):
            key, c = tuple(entry["key"]), entry["config"]
            if key in tuner.cache:
                continue
            tuner.cache[key] = triton.Config(c["kwargs"], num_warps=c["num_warps"], num_stages=c["num_stages"],
                                             num_ctas=c.get("num_ctas", 1), maxnreg=c.get("maxnreg"))
            placed += 1
    return placed


def read_kept(path: Path) -> tuple[dict | None, str | None]:
    """(the kept choices in `path`, None) or (None, why not). `path`: a harvest (JSON), or a compile cache artifact
    whose manifest recorded one (`dflash-train --warm-cache` on a GPU; its choices hold for another data mix too)."""
    from dflash.runs.compile_artifact import MAGIC, read_header

    try:
        with open(path, "rb") as f:
            is_artifact = f.read(len(MAGIC)) == MAGIC
        if is_artifact:
            header, problem = read_header(path)
            if header is None:
                return None, problem or "no such file"
            data = header["manifest"].get("fla_choices")
            if data is None:
                return None, "a compile cache artifact that recorded no fla choices (made on a CPU, or by an older dflash)"
        else:
            data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"unreadable ({type(e).__name__})"
    if not isinstance(data, dict) or not isinstance(data.get("kernels"), dict):
        return None, "not a harvest of fla's choices (no 'kernels')"
    return data, None


def use_kept(gpu_name: str, log=print) -> int:
    """Before the target's first forward on a GPU: seed fla's autotuners from DFLASH_FLA_TUNED's file, else this GPU's
    kept file, when its Triton and fla versions are these; one line when something is kept here, none otherwise."""
    import triton

    choice = os.environ.get(ENV, "")
    if choice.lower() == "off" or not autotuners():
        return 0
    path = Path(choice) if choice else kept_path(gpu_name)
    if not path.is_file():
        if choice:
            log(f"fla: {ENV}={choice}: no such file; its kernels autotune")
        return 0
    kept, problem = read_kept(path)
    if kept is None:
        log(f"fla: {path}: {problem}; its kernels autotune")
        return 0
    if kept.get("triton") != triton.__version__:
        log(f"fla: {path} was tuned with Triton {kept.get('triton')}, this is {triton.__version__}; its kernels "
            "autotune")
        return 0
    if kept.get("fla") != fla_version():  # another fla may have other kernels behind the same names
        log(f"fla: {path} was tuned with fla {kept.get('fla')}, this is {fla_version()}; its kernels autotune")
        return 0
    placed = seed(kept)
    log(f"fla: {placed} kept kernel choice(s) for {gpu_name} set from {path.name} (the rest autotune)")
    return placed


def main(argv: list[str] | None = None) -> int:
    """python -m dflash.models.fla_tuning ARTIFACT [OUT]: keep the fla choices a compile cache artifact recorded, in
    OUT (default: dflash/models/fla_tuned/<its GPU>.json, where every cold start on that GPU model reads them)."""
    import argparse

    from dflash.runs.compile_artifact import read_header

    p = argparse.ArgumentParser(prog="python -m dflash.models.fla_tuning", description="Keep the fla choices a compile cache artifact recorded, for "
                                "every cold start on its GPU model (dflash/models/fla_tuned/<GPU>.json) or in OUT.")
    p.add_argument("artifact", type=Path, help="a compile cache artifact (dflash-train --warm-cache on a GPU)")
    p.add_argument("out", type=Path, nargs="?", help="where to write the choices (default: the kept file of its GPU)")
    args = p.parse_args(argv)
    kept, problem = read_kept(args.artifact)
    header, _ = read_header(args.artifact)
    if kept is None or header is None:
        print(f"fla_tuning: {args.artifact}: {problem or 'not a compile cache artifact'}; make one on the GPU with "
              "dflash-train --warm-cache", file=sys.stderr)
        return 2
    out = args.out or kept_path(header["manifest"]["gpu_name"])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps({"gpu_name": header["manifest"]["gpu_name"], **kept}, indent=1) + "\n")
    os.replace(tmp, out)
    print(f"fla_tuning: {len(kept['kernels'])} kernel(s)' choices for {header['manifest']['gpu_name']} (Triton "
          f"{kept.get('triton')}) written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
