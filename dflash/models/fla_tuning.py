"""fla's autotuning, measured and kept: a cold start of a hybrid target skips it where this GPU's choices are kept.

fla (the Gated DeltaNet kernels of Qwen3.5-family targets) autotunes each of its Triton kernels at the first call in a
process: every config compiled and timed, tens of configs a kernel. Triton keeps the choice in its cache dir, which
the compile cache artifact carries (dflash.train.compile_cache); on a machine with empty caches it tunes again. The
choice depends on the GPU model, the Triton and fla versions and the kernel's key (the model's head counts and widths, the
dtypes; l2norm's also the batch's rows in blocks of 65,536), so dflash keeps each GPU's choices for the shapes it
measured in dflash/models/fla_tuned/<GPU>.json and sets them in fla's autotuners before the target's first forward;
a token bucket (l2norm's NB) not kept takes the nearest kept one's choice. A kernel called with another key (other
head counts, widths or dtypes) tunes as before.

    harvest()          what fla's autotuners chose in this process, with the seconds each spent tuning
    seed(kept)         set kept choices in fla's autotuners (those not tuned yet); returns how many were set
    keep_tuned(gpu, path)      after a run's first step: what fla tuned fills its other token buckets and is written
                               to `path` (RUN/fla_choices.json)
    use_kept(log)      seed this GPU's kept file (or DFLASH_FLA_TUNED's); one line, or none where nothing is kept
    first_configs_only()   a process that only loads the kernels (the memory probe) compiles one config each
    tuning_seconds()   the seconds fla's autotuners spent tuning in this process

DFLASH_FLA_TUNED=FILE seeds from FILE instead (a harvest as JSON: `python -m dflash.train.fla_choices ARTIFACT FILE`
writes the one a compile cache artifact recorded); DFLASH_FLA_TUNED=off seeds nothing.
"""

from __future__ import annotations

import json
import os
import sys

from dflash.models.fla_kept import ENV, chosen_file, read_kept, unusable


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


def harvest(gpu_name: str | None = None) -> dict:
    """{"gpu_name": gpu_name, "triton": version, "fla": version, "kernels": {name: {"tuned_s": seconds tuning in this
    process or None (taken from a cache), "entries": [{"key": [...], "config": {...}}]}}} for every fla kernel that
    chose a config."""
    import triton

    kernels = {}
    for name, tuner in sorted(autotuners().items()):
        filled = FILLED.get(name, set())
        entries = [{"key": list(key), "config": c} for key, config in tuner.cache.items()
                   if key not in filled and _plain(key) and (c := _config_dict(config)) is not None]
        if entries:
            seconds = getattr(tuner, "bench_time", None)
            kernels[name] = {"tuned_s": round(seconds, 2) if seconds is not None else None, "entries": entries}
    return {"gpu_name": gpu_name, "triton": triton.__version__, "fla": fla_version(), "kernels": kernels}


def tuning_seconds() -> tuple[float, int]:
    """(seconds fla's autotuners spent tuning in this process, kernels tuned): 0.0, 0 when none did."""
    times = [t for tuner in autotuners().values() if (t := getattr(tuner, "bench_time", None)) is not None]
    return sum(times), len(times)


def seed(kept: dict) -> int:
    """Set each kept choice in its loaded autotuner where that key has none yet and the kernel offers that config
    on this GPU (a config it does not list is never launched untried); returns the choices set. A kept kernel this
    process has not loaded, or a key of another shape, changes nothing."""
    placed = 0
    for name, tuner in autotuners().items():
        kernel = kept.get("kernels", {}).get(name)
        if kernel is None:
            continue
        offered = [(c, config) for config in tuner.configs if (c := _config_dict(config)) is not None]
        chosen = {}
        for entry in kernel["entries"]:
            config = next((config for c, config in offered if c == _normal(entry["config"])), None)
            if config is not None:
                chosen[tuple(entry["key"])] = config
        for key, config in {**buckets_filled(tuner.keys, chosen), **chosen}.items():
            if key not in tuner.cache:
                tuner.cache[key] = config
                placed += 1
                if key not in chosen:
                    FILLED.setdefault(name, set()).add(key)
    return placed


FILLED: dict[str, set] = {}  # {kernel: keys} set from a nearby bucket's choice, not tuned: harvest leaves them out


def keep_tuned(gpu_name: str, path=None) -> str | None:
    """After a run's first step, where fla tuned there: its fresh choices fill the other token buckets (a later
    pack of another length tunes nothing) and, given `path` (the run dir's fla_choices.json), are written there as a
    harvest a later cold start can seed from. The line to log, or None where fla tuned nothing. Never raises: a run
    never stops for it."""
    try:
        return _keep_tuned(gpu_name, path)
    except Exception as e:
        return f"fla: its tuned choices were not kept ({type(e).__name__}: {' '.join(str(e).split())[:160]})"


def _keep_tuned(gpu_name: str, path) -> str | None:
    seconds, tuned = tuning_seconds()
    if not tuned:
        return None
    choices = harvest(gpu_name)
    seed(choices)
    if path is None:
        return None
    if not choices["kernels"]:  # every tuned config has a pre-hook (code) or a key that is not plain data
        return f"fla: tuned {tuned} kernel(s) in {seconds:.1f} s; none of their choices can be written to a file"
    from pathlib import Path

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(choices, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        return f"fla: tuned {tuned} kernel(s) in {seconds:.1f} s; their choices not written to {path} ({e.strerror or e})"
    return (f"fla: tuned {tuned} kernel(s) in {seconds:.1f} s; choices in {path}: `python -m dflash.train.fla_choices "
            f"{path}` keeps them for every cold start on this GPU model")


BUCKETS = ("NB",)  # key names fla fills with a batch's rows in blocks (l2norm: cdiv(tokens x heads, 65,536); its
# layernorm and fused norm-gate: cdiv(rows, 2,048))


def buckets_filled(names, chosen: dict) -> dict:
    """For a kernel whose key holds a token bucket (fla's NB), a choice for every bucket from 1 to twice the largest
    kept one: the nearest kept bucket's with the same other leaves. Packs of every length then find a choice, where
    an exact key alone left any pack in another 65,536-row block to tune mid-run (about 10 s on an H100)."""
    at = next((i for i, name in enumerate(names) if name in BUCKETS), None)
    if at is None:
        return {}
    groups: dict = {}
    for key, config in chosen.items():
        if len(key) > at and type(key[at]) is int and key[at] > 0:
            groups.setdefault(key[:at] + key[at + 1:], {})[key[at]] = config
    filled = {}
    for rest, by_bucket in groups.items():
        for bucket in range(1, 2 * max(by_bucket) + 1):
            near = min(by_bucket, key=lambda kept: (abs(kept - bucket), kept))
            filled[rest[:at] + (bucket,) + rest[at:]] = by_bucket[near]
    return filled


def _normal(c: dict) -> dict:
    """A kept config as _config_dict writes it (num_ctas and maxnreg may be left out)."""
    return {"kwargs": c["kwargs"], "num_warps": c["num_warps"], "num_stages": c["num_stages"],
            "num_ctas": c.get("num_ctas", 1), "maxnreg": c.get("maxnreg")}


def first_configs_only() -> int:
    """In a process that only loads fla's kernels (the memory probe), never tunes them: every loaded fla autotuner
    keeps its first config, so each kernel compiles once instead of once per config. Returns the autotuners cut.
    Never in a training process: the choice there is the tuned one."""
    cut = 0
    for tuner in autotuners().values():
        if len(tuner.configs) > 1:
            tuner.configs = tuner.configs[:1]
            cut += 1
    return cut


def use_kept(gpu_name: str, log=print) -> int:
    """Before the target's first forward on a GPU: seed fla's autotuners from DFLASH_FLA_TUNED's file, else this GPU's
    kept file, when it was tuned on this GPU model with this Triton and fla; one line when something is kept here,
    none otherwise."""
    import triton

    path = chosen_file(gpu_name, os.environ)
    if path is None or not autotuners():
        return 0
    if not path.is_file():
        if os.environ.get(ENV):
            log(f"fla: {ENV}={os.environ[ENV]}: not a file; its kernels autotune (name a harvest, or off)")
        return 0
    kept, problem = read_kept(path)
    if kept is None:
        log(f"fla: {path}: {problem}; its kernels autotune")
        return 0
    why = unusable(kept, gpu_name, triton.__version__, fla_version())
    if why:
        log(f"fla: {path} {why}; its kernels autotune")
        return 0
    before = sum(map(len, FILLED.values()))
    placed = seed(kept)
    filled = sum(map(len, FILLED.values())) - before
    more = f", {filled} other token bucket(s) from the nearest kept" if filled else ""
    log(f"fla: {placed - filled} kept kernel choice(s) for {gpu_name} set from {path.name}{more} (the rest autotune)")
    return placed
