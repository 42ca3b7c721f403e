"""What dflash-estimate decides, apart from how it prints it (``dflash.commands.estimate`` only formats).

The run config is read with its ``--set`` overrides (``dflash.config.parse_overrides``, the one
parser); the CUDA version is the one given, else the config's profile manifest's, else 12.8; the
GPU size is the one given, or the smallest total memory NVML reports over the GPUs the config
names, resolved through CUDA_VISIBLE_DEVICES exactly as the preflight checks resolve them. The
bytes themselves come from ``dflash.memory``. A target folder that needs its own code is refused (exit 2), as
dflash-train refuses it: its sizes would be read as a standard decoder's. Nothing here imports torch.

    from preflight.estimate import run_estimate
    est, cuda_source = run_estimate("configs/qwen3-27b-5t3d.toml", gpu_memory="95GiB")
"""

from __future__ import annotations

import os
import re

from dflash.config import load_config, parse_overrides
from dflash.errors import DflashError
from dflash.memory.fit import Estimate, estimate, role_gpus
from dflash.memory.parts import DEFAULT_CALIBRATION, Calibration, with_measured_overhead
from preflight.facts.run import target_custom_code
from preflight.nvml import GpuInfo, NvmlGpuInfo, NvmlUnavailable, resolve_gpu, visible_gpus
from preflight.profiles import ProfileError, load_profile

DEFAULT_CUDA = "12.8"  # the training profile's CUDA, when the config's profile cannot be read
MAX_GPU_BYTES = 2**46  # 64 TiB: no single GPU comes near (an H200 has 141 GB); larger is a typo
_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


class EstimateError(DflashError):
    """Estimate input that cannot work (a size without unit, two GPU sources, unreadable GPUs)."""

    exit_code = 2


def parse_size(text: str) -> int:
    """'95GiB' / '80GB' / '96000MiB' / '1.5TiB' -> bytes; a bare number is refused (GB or GiB?)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise EstimateError(f"cannot read GPU memory size {text!r}; write a number and a unit, e.g. 95GiB, 80GB or 96000MiB")
    size = float(m.group(1)) * _UNITS[m.group(2).lower()]  # inf for a number of hundreds of digits
    if size > MAX_GPU_BYTES:
        raise EstimateError(f"GPU memory size {text!r} is more than {MAX_GPU_BYTES // 2**40} TiB, far above any GPU; "
                            "give the memory of one GPU, e.g. 95GiB")
    if int(size) <= 0:
        raise EstimateError(f"GPU memory size {text!r} must be positive; e.g. 95GiB")
    return int(size)


_DECIMAL = {"kb": 3, "mb": 6, "gb": 9, "tb": 12}


def size_reading(text: str) -> tuple[str, str | None]:
    """How parse_size read `text`, for the header line ("--gpu-memory 95GB: decimal, 95 x 10^9 bytes"; "" for a
    binary unit), and a warning when the unit is decimal and written in lowercase ("gb": often meant as GiB)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*", text)
    unit = m.group(2) if m else ""
    if unit.lower() not in _DECIMAL:
        return "", None
    exp = _DECIMAL[unit.lower()]
    said = f"--gpu-memory {text.strip()}: decimal {unit.upper()}, {m.group(1)} x 10^{exp} bytes"
    if unit == unit.upper():
        return said, None
    gib = float(m.group(1)) * 10**exp / 2**30
    return said, (f"--gpu-memory {text.strip()} is read as decimal {unit.upper()}: {m.group(1)} x 10^{exp} bytes = "
                  f"{gib:.2f} GiB; if the GPU has {m.group(1)} GiB, write {m.group(1)}{unit[0].upper()}iB")


def profile_cuda(profile: str) -> tuple[str, str]:
    """The CUDA version of the config's profile manifest, else the default, and where it came from."""
    try:
        return load_profile(profile).cuda, f"from envs/{profile}.toml"
    except (ProfileError, OSError) as e:
        return DEFAULT_CUDA, f"default; profile not readable: {e}"


def nvml_gpu_bytes(names: list[str], info: GpuInfo | None = None, cuda_visible_devices: str | None = None) -> int:
    """Smallest total memory over the GPUs the run config names (GPU 0 when it names none).

    Names are indices after CUDA_VISIBLE_DEVICES or UUIDs, as in ``preflight.nvml.resolve_gpu``;
    cuda_visible_devices None reads the variable from the environment.
    """
    if cuda_visible_devices is None:
        cuda_visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        snap = (info or NvmlGpuInfo()).snapshot()
    except NvmlUnavailable as e:
        raise EstimateError(f"cannot read GPU memory through NVML ({e}); pass --gpu-memory SIZE instead") from None
    visible, _note = visible_gpus(snap.gpus, cuda_visible_devices)
    totals = []
    for name in names or ["0"]:
        gpu, why = resolve_gpu(name, visible, snap.gpus)
        if gpu is None:
            raise EstimateError(f"{why}; fix topology or CUDA_VISIBLE_DEVICES, or pass --gpu-memory SIZE")
        totals.append(gpu.memory_total)
    return min(totals)


def run_estimate(
    config_path: str,
    sets: tuple[str, ...] | list[str] = (),
    gpu_memory: str | None = None,
    from_nvml: bool = False,
    cuda: str | None = None,
    gpu_info: GpuInfo | None = None,
    rates: str | None = None,
    rates_from: str | None = None,
    link_gbps: str | None = None,
    overrides: dict | None = None,
    rates_recompute: str | None = None,
    probe: bool = False,
    probe_timeout: float | None = None,
) -> tuple[Estimate, str]:
    """The estimate dflash-estimate prints, and where its CUDA version came from. `rates` ("TARGET,DRAFTER" busy
    tok/s per GPU) or `rates_from` (a split run's dir, its busy rates as its summary printed them) add each layout's
    tokens/s, its communication priced at `link_gbps` (GB/s one way per GPU; default the users' PCIe Gen5 x16).
    `overrides` (dotted, as the GPU-list flags give them) apply after `sets`. `rates_recompute`: the recompute the
    drafter's rate was measured at (default: the --rates-from run's, else off); pace lines at another say so.
    `probe`: measure the memory outside torch on the config's GPUs (preflight.probe) and use it."""
    if gpu_memory and from_nvml:
        raise EstimateError("give --gpu-memory or --from-nvml, not both")
    cfg = load_config(config_path, parse_overrides(sets).merge(overrides or {}))
    refused = target_custom_code(cfg)
    if refused:  # dflash-train refuses this target, and the memory model knows only the architectures it ships
        raise EstimateError(refused)
    cuda_source = "--cuda"
    if cuda is None:
        cuda, cuda_source = profile_cuda(cfg.profile)
    gpu_bytes = parse_size(gpu_memory) if gpu_memory else None
    if from_nvml:
        gpus = sorted({g for role in cfg.topology.roles for g in role_gpus(cfg, role)})
        gpu_bytes = nvml_gpu_bytes(gpus, gpu_info)
    link = parse_link(link_gbps) if link_gbps is not None else None
    busy = parse_rates(rates, rates_from) if rates or rates_from else None
    measured = rates_recompute or (run_recompute(rates_from) if rates_from else None) or "off"
    cal, note = (probed_calibration(cfg, cuda, probe_timeout) if probe else (DEFAULT_CALIBRATION, None))
    est = estimate(cfg, cuda, gpu_bytes, cal, source=config_path, rates=busy, link_gbps=link, rates_recompute=measured)
    est.overhead = note
    if gpu_memory:
        est.gpu_source, warning = size_reading(gpu_memory)
        est.warnings += [warning] if warning else []
    elif from_nvml:
        est.gpu_source = "NVML: the smallest total memory of the run's GPUs"
    return est, cuda_source


def run_recompute(run_dir: str) -> str | None:
    """The recompute a run's drafter resolved to, as its snapshot recorded it (None: no snapshot says)."""
    from dflash.runs.records import SnapshotError, load

    try:
        snap, _, _ = load(run_dir)
    except (SnapshotError, OSError):
        return None
    roles = (snap.get("memory") or {}).get("roles") or {}
    mode = (roles.get("drafter") or roles.get("colocated") or {}).get("recompute")
    return mode if mode in ("off", "mlp", "layer") else None


def probed_calibration(cfg, cuda: str, timeout: float | None = None) -> tuple[Calibration, str]:
    """The calibration with the memory outside torch measured on the GPUs the config names (GPU 0 when it names
    none), the most any of them measured, and the line that says so; the calibrated constants and why, when the
    probe could not measure or measured another CUDA than the estimate's."""
    from dflash.memory.shape import GiB, cuda_major, load_target_shape
    from preflight.facts.environment import torch_build
    from preflight.probe import DEFAULT_TIMEOUT_S, probe_named, run_steps

    names = sorted({g for role in cfg.topology.roles for g in role_gpus(cfg, role)}) or ["0"]
    steps = run_steps(cfg, load_target_shape(cfg.target.path))
    try:
        overhead, gpus = probe_named(names, steps, timeout or DEFAULT_TIMEOUT_S)
    except (NvmlUnavailable, ValueError) as e:
        return DEFAULT_CALIBRATION, f"outside torch: not probed ({e}); the calibrated constant is used"
    got = [overhead.gpus[g.uuid] for g in gpus.values() if overhead.gpus[g.uuid].measured]
    if not got:
        why = "; ".join(g.note or "" for g in overhead.gpus.values())
        return DEFAULT_CALIBRATION, f"outside torch: {why}"
    build = torch_build()
    if build is None or not build.cuda or cuda_major(build.cuda) != cuda_major(cuda):
        return DEFAULT_CALIBRATION, (f"outside torch: measured under torch {build.version if build else 'none'}, not "
                                     f"CUDA {cuda}; the calibrated constant is used")
    top = max(got, key=lambda g: g.outside_torch_bytes)
    nccl = f", NCCL {top.nccl_bytes / GiB:.2f}" if top.nccl_bytes is not None else ""
    return (with_measured_overhead(DEFAULT_CALIBRATION, cuda, top.context_bytes, top.nccl_bytes),
            f"outside torch: measured {top.outside_torch_bytes / GiB:.2f} GiB per GPU (context and kernels "
            f"{top.context_bytes / GiB:.2f}{nccl}; {top.source}, torch {build.version}, GPUs {', '.join(names)}); "
            f"steps {', '.join(steps)}")


MAX_LINK_GBPS = 100_000.0  # 100 TB/s: no link between two GPUs comes near (NVLink 5 is 900 GB/s a way); more is a typo


def parse_link(text: str) -> float:
    """'50' / '63.0' -> GB/s one way per GPU; anything else, zero, or more than MAX_LINK_GBPS is refused."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0 < value <= MAX_LINK_GBPS):
        raise EstimateError(f"--link-gbps {text!r}: give the link's bandwidth between GPUs in GB/s one way per GPU, a "
                            f"number above 0 and at most {MAX_LINK_GBPS:,.0f}, e.g. --link-gbps 50 (PCIe Gen5 x16)")
    return value


def parse_rates(rates: str | None, rates_from: str | None) -> tuple[float, float]:
    """(target, drafter) busy tok/s per GPU from "TARGET,DRAFTER" or from a split run dir's metrics."""
    if rates and rates_from:
        raise EstimateError("give --rates or --rates-from, not both")
    if rates:
        parts = [p.strip().lower().removesuffix("k") for p in rates.split(",")]
        scale = [1000 if p.strip().lower().endswith("k") else 1 for p in rates.split(",")]
        try:
            values = tuple(float(p) * s for p, s in zip(parts, scale))
        except ValueError:
            values = ()
        if len(values) != 2 or not all(v > 0 and v == v and v != float("inf") for v in values):
            raise EstimateError(f"--rates {rates!r}: give two positive busy rates, tok/s per GPU of a target and of a "
                                "drafter, e.g. --rates 12500,41000 or 12.5k,41k")
        return values
    from dflash.memory.pace import after_first_window, busy_rates
    from dflash.runs.metrics import read_metrics
    from dflash.runs.rundir import METRICS_NAME

    busy = busy_rates(after_first_window(read_metrics(rates_from).rows)[0])
    if busy is None:
        raise EstimateError(f"--rates-from {rates_from}: no per-role rates in its {METRICS_NAME} (give the dir of a "
                            "split run that logged past its first window, or --rates TARGET,DRAFTER)")
    return busy[0], busy[1]
