"""The compile cache artifact from torch's side: make it (`dflash-train --warm-cache`) and load it before a run's
first compile. The file, its fields and its checks: dflash.runs.compile_artifact.

    warm_cache(cfg, colocated, check_argv)   warm every shape class, save torch's cache artifacts and Triton's cache
                                             dir into cfg.train.compile_cache, then time a fresh process that loads it
    load(cfg, lengths, log)                  before the first compile: one line, loaded or why not (a cold start)

A run loads the artifact only when torch, Triton, the GPU, the compute capability and the run (target architecture,
drafter, shape classes) all match what it was made for; anything else (no file, truncated, foreign, another setup,
a section that fails its sha256, torch refusing the bytes) is one line and a cold start, never a crash.
"""

from __future__ import annotations

import gc
import io
import json
import logging
import math
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from dflash.config import RunConfig, config_from_dict
from dflash.data.identity import target_fingerprint
from dflash.data.plan import shape_classes
from dflash.models.attention import compiled_on
from dflash.models.drafter import compiles_on
from dflash.runs import compile_artifact as artifact
from dflash.runs.records import process_age_s
from dflash.train.compiled import compile_phases
from dflash.train.warmup import cache_counts, needed_batches, warm_steps

WARM_FIX = "dflash-train --config <this config> --warm-cache"


def machine_facts(cfg: RunConfig) -> dict:
    """torch, Triton, the GPU's name and compute capability ("cpu" and None for a CPU run, GPU or not)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    facts = {"torch": torch.__version__, "triton": triton_version, "gpu_name": "cpu", "compute_capability": None}
    if cfg.device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        facts.update(gpu_name=props.name, compute_capability=f"{props.major}.{props.minor}")
    return facts


def run_facts(cfg: RunConfig, train_lengths) -> dict:
    """This run's side of the match (dflash.runs.compile_artifact.run_facts) for the lengths it trains on."""
    return artifact.run_facts(cfg, target_fingerprint(cfg.target.path), shape_classes(cfg, train_lengths))


def compiles(cfg: RunConfig) -> bool:
    """Whether a run of cfg compiles anything in this process (the drafter's pieces, flex attention, the target)."""
    device = torch.device("cuda" if cfg.device == "cuda" else "cpu")
    return (cfg.train.compile and (compiled_on(device) or compiles_on(device))) or \
        (cfg.target.compile and device.type == "cuda")


# ---- Triton's cache dir (fla's kernels and autotuning results live there, outside torch's artifacts)

def triton_cache_dir() -> Path:
    """The folder Triton caches kernels in: TRITON_CACHE_DIR (dflash-train sets the profile's own, beside its
    inductor cache dir), else Triton's own default."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"]).expanduser()
    try:
        from triton import knobs

        return Path(knobs.cache.dir).expanduser()
    except (ImportError, AttributeError):
        return Path.home() / ".triton" / "cache"


def pack_triton(folder: Path) -> tuple[bytes | None, int]:
    """(an uncompressed tar of every regular file under `folder`, their count); (None, 0) when there is none (a CPU
    run: nothing ran through Triton)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()) if folder.is_dir() else []
    if not files:
        return None, 0
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for p in files:
            tar.add(p, arcname=p.relative_to(folder).as_posix(), recursive=False)
    return buf.getvalue(), len(files)


def unpack_triton(data: bytes, folder: Path) -> int:
    """Write the tar's regular files under `folder`; a file already there is kept (Triton names files by their
    content's hash), a name that would leave the folder is skipped. Returns the files written."""
    root = folder.resolve()
    written = 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for member in tar:
            dest = (root / member.name).resolve()
            if not member.isfile() or not dest.is_relative_to(root) or dest == root or dest.exists():
                continue
            src = tar.extractfile(member)
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
            tmp.write_bytes(src.read())
            os.replace(tmp, dest)
            written += 1
    return written


# ---- loading, before a run's first compile

def load(cfg: RunConfig, train_lengths, log=print) -> dict | None:
    """Load cfg.train.compile_cache into torch's caches (and its Triton files into Triton's cache dir) when it
    matches this machine and run; one line either way. Returns the artifact's manifest when loaded, else None.
    Empty train.compile_cache (a caller without a profile): nothing to look at, no line."""
    if not cfg.train.compile_cache:
        return None
    path = Path(cfg.train.compile_cache)
    header, problem = artifact.read_header(path)
    if header is None:
        why = problem or "no such file"
        log(f"compile cache: {path}: {why}; cold start (make one: {WARM_FIX})")
        return None
    manifest = header["manifest"]
    diffs = artifact.differences(manifest, {**machine_facts(cfg), **run_facts(cfg, train_lengths)})
    if diffs:
        more = f" and {len(diffs) - 3} more" if len(diffs) > 3 else ""
        log(f"compile cache: {path} not loaded: made for another setup ({'; '.join(diffs[:3])}{more}); cold start "
            f"(make one here: {WARM_FIX})")
        return None
    try:
        _, sections = artifact.read_sections(path)
        if "torch" in sections:
            _load_torch(sections["torch"])
        triton_files = unpack_triton(sections["triton"], triton_cache_dir()) if "triton" in sections else None
    except artifact.ArtifactError as e:
        log(f"compile cache: {path} not loaded: {e}; cold start (make one: {WARM_FIX})")
        return None
    except Exception as e:  # torch refusing its own bytes (another build than the manifest says): a cold start
        log(f"compile cache: {path} not loaded: torch refused it ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:160]}); cold start")
        return None
    triton = (f", {triton_files} Triton cache file(s) written" if triton_files is not None else ", no Triton cache")
    log(f"compile cache: loaded {path} ({artifact.size_text(header['size'])}{triton}) for "
        f"{artifact.classes_text(manifest.get('shape_classes'))}; {artifact.start_text(manifest)}")
    return manifest


def _load_torch(data: bytes) -> None:
    """torch.compiler.load_cache_artifacts, which logs a traceback and returns None for bytes it cannot read: that
    is raised here (the caller's one line says it) and torch's traceback kept out of the run's log."""
    quiet = logging.getLogger("torch.compiler._cache")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        info = torch.compiler.load_cache_artifacts(data)
    finally:
        quiet.setLevel(level)
    if info is None:
        raise ValueError("its cache artifacts do not read back (torch.compiler.load_cache_artifacts returned None)")


# ---- making one: dflash-train --warm-cache

def warm_cache(cfg: RunConfig, colocated, check_argv: list[str], log=print) -> int:
    """Compile the target's and the drafter's graphs for every shape class of the run (warm_steps), write the
    artifact to cfg.train.compile_cache (resolved by the command), then start `check_argv` (a fresh process running
    check() with empty caches) on it: the artifact keeps both starts, the fresh process's cache hits and misses
    and whether its losses were this process's. `colocated`: Trainer.colocated (the trainer imports this module)."""
    if not compiles(cfg):
        log("warm-cache: nothing to compile here (train.compile and target.compile are off, or a CPU run: they "
            "compile on CUDA)")
        return 0
    if not cfg.train.compile_cache:
        raise artifact.ArtifactError("--warm-cache: nowhere to write the artifact: set train.compile_cache to a file "
                                     f"(the profile {cfg.profile} did not load to give its default)")
    path = Path(cfg.train.compile_cache)
    trainer = colocated(cfg, None, log)
    losses: list[float] = []
    record: dict = {}
    warm_steps(trainer, log, losses, record=record)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    cold = {"seconds": process_age_s(), **cache_counts(), "losses": losses, "phases": compile_phases(),
            "graphs_after": record["graphs_after"]}
    saved = torch.compiler.save_cache_artifacts()
    sections = {"torch": saved[0]} if saved is not None else {}
    triton, triton_files = pack_triton(triton_cache_dir())
    if triton is not None:
        sections["triton"] = triton
    manifest = {**machine_facts(cfg), **run_facts(cfg, trainer.dataset.lengths), "cold": cold,
                "triton_files": triton_files, "made_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    from dflash.models.fla_kept import kept_path
    from dflash.models.fla_tuning import harvest

    choices = harvest(manifest["gpu_name"]) if trainer.device.type == "cuda" else {"kernels": {}}
    if choices["kernels"]:  # what fla's autotuning chose: kept in dflash/models/fla_tuned/, a cold start skips it
        manifest["fla_choices"] = choices
        log(f"warm-cache: fla chose configs for {len(choices['kernels'])} kernel(s), recorded in the manifest: "
            f"`python -m dflash.train.fla_choices {path}` keeps them for every cold start on this GPU model "
            f"(dflash/models/fla_tuned/{kept_path(manifest['gpu_name']).name})")
    del trainer  # the fresh process needs the GPU's memory
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        held = torch.cuda.memory_reserved() / 2**30
        if held > 1:
            log(f"warm-cache: {held:.1f} GiB still held by this process while the fresh one runs")
    unchecked = path.with_name(f"{path.name}.unchecked")
    artifact.write(unchecked, manifest, sections)
    try:
        warm = _check_in_fresh_process(cfg, unchecked, check_argv, log)
        if warm is not None:
            manifest["warm"] = warm
            manifest["same_losses"] = warm.get("losses") == losses
            manifest["losses_max_rel_diff"] = loss_gap(losses, warm.get("losses"))
        artifact.write(path, manifest, sections)
    finally:
        unchecked.unlink(missing_ok=True)
    size = path.stat().st_size
    log(f"warm-cache: wrote {path} ({artifact.size_text(size)}: torch's cache artifacts"
        f"{f', {triton_files} Triton cache file(s)' if triton is not None else ', no Triton cache'}) for "
        f"{artifact.classes_text(manifest['shape_classes'])}; {artifact.start_text(manifest)}")
    if warm is not None:
        log(f"warm-cache: a fresh process with empty caches took {warm['fx_graph_hits']} graph(s) from it and compiled "
            f"{warm['fx_graph_misses']} from scratch; its losses {losses_text(manifest)}")
    log("warm-cache: carry it to another machine and set train.compile_cache = \"<the copy>\" (or --set "
        "train.compile_cache=<the copy>); dflash-preflight says whether it matches there")
    return 0


def loss_gap(a: list[float], b: list[float] | None) -> float | None:
    """The largest relative difference between two processes' losses batch by batch (None: not comparable)."""
    if not a or not b or len(a) != len(b) or not all(math.isfinite(x) for x in [*a, *b]):
        return None
    return max(abs(x - y) / max(abs(x), abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def losses_text(manifest: dict) -> str:
    """How the fresh process's losses compare with the warming process's: equal, or how far apart (kernels that
    reduce in another order differ in the last bits; far apart is another computation)."""
    if manifest.get("same_losses"):
        return "equal this process's"
    gap = manifest.get("losses_max_rel_diff")
    return (f"differ from this process's by at most {gap:.1e} (relative)" if gap is not None
            else "are not comparable with this process's")


def _check_in_fresh_process(cfg: RunConfig, path: Path, argv: list[str], log) -> dict | None:
    """Run `argv` + [request file] with TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR pointed at empty folders; its
    last stdout line is check()'s JSON. None (and one line) when it fails: the artifact is still written."""
    with tempfile.TemporaryDirectory(prefix="dflash-cache-check-") as tmp:
        request = Path(tmp) / "request.json"
        request.write_text(json.dumps({"config": cfg.model_dump(), "artifact": str(path)}))
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"),
                   TRITON_CACHE_DIR=str(Path(tmp) / "triton"))
        log("warm-cache: timing a fresh process that loads it, with empty caches ...")
        proc = subprocess.run([*argv, str(request)], env=env, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    try:
        if proc.returncode != 0:
            raise ValueError(f"exit {proc.returncode}")
        return json.loads(lines[-1])
    except (ValueError, IndexError):
        tail = (proc.stderr.strip().splitlines() or lines or ["no output"])[-1]
        log(f"warm-cache: the fresh process failed ({proc.returncode}: {tail[:200]}); warm start not measured")
        return None


def check(request: Path, colocated, log=print) -> dict:
    """The fresh process of warm_cache: load the artifact as a run does, warm every shape class, and return the
    seconds since launch, the FX graph cache hits and misses, the losses and torch.compile's seconds by phase."""
    req = json.loads(Path(request).read_text())
    cfg = config_from_dict(req["config"])
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile_cache": req["artifact"]})})
    trainer = colocated(cfg, None, log)
    loaded = load(cfg, trainer.dataset.lengths, log) is not None
    losses: list[float] = []
    record: dict = {}
    warm_steps(trainer, log, losses, record=record)  # every batch: the losses and the cache counts of all of them
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    needed = needed_batches(record["graphs_after"]) or len(record["ages_s"])
    at = record["ages_s"][needed - 1] if record["ages_s"] else None  # where a run from the artifact stops priming
    return {"seconds": at if at is not None else process_age_s(), "seconds_all_batches": process_age_s(),
            "batches_needed": needed, "loaded": loaded, **cache_counts(), "losses": losses,
            "phases": compile_phases()}


def main_check(request: str, colocated) -> int:
    """dflash-train's hidden --check-artifact: check() with its log on stderr, its JSON the last stdout line."""
    out = check(Path(request), colocated, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(out), flush=True)
    return 0
