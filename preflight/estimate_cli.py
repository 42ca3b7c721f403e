"""dflash-estimate: what one GPU of each role needs, and the largest settings that fit.

    uv run dflash-estimate --config configs/qwen3-27b-5t3d.toml --gpu-memory 95GiB
    uv run dflash-estimate --config configs/qwen3-8b-1gpu.toml --from-nvml --json
    uv run dflash-estimate --config RUN.toml --gpu-memory 80GB --set data.token_budget=45056

Exit codes: 0 every role fits (or no GPU size given), 1 some role does not fit, 2 bad input.
"""

from __future__ import annotations

import os
import re

import click

from dflash.config import ConfigError, load_config, parse_overrides
from dflash.errors import UsageError, run_cli
from preflight.memory import GiB, Estimate, estimate, role_gpus, roles

DEFAULT_CUDA = "12.8"
_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_size(text: str) -> int:
    """'95GiB' / '80GB' / '96000MiB' / '1.5TiB' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read GPU memory size {text!r}; write a number and a unit, e.g. 95GiB, 80GB or 96000MiB")
    size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size <= 0:
        raise ValueError(f"GPU memory size {text!r} must be positive; e.g. 95GiB")
    return size


def _nvml_handle(pynvml, gpu: str):
    """A handle for a GPU named as the run config names it (index or UUID after CUDA_VISIBLE_DEVICES)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if gpu.isdigit() and visible:
        if int(gpu) >= len(visible):
            raise ValueError(f"GPU {gpu} is not among CUDA_VISIBLE_DEVICES={','.join(visible)}; fix topology or the variable")
        gpu = visible[int(gpu)]
    if gpu.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(gpu))
    return pynvml.nvmlDeviceGetHandleByUUID(gpu)


def nvml_gpu_bytes(gpus: list[str]) -> int:
    """Smallest total memory over ``gpus`` (GPU 0 when empty), read through NVML."""
    try:
        import pynvml
    except ImportError:
        raise ValueError("--from-nvml needs the nvidia-ml-py package (uv sync); or pass --gpu-memory SIZE") from None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError subclasses, or a missing driver library
        raise ValueError(f"cannot read GPU memory through NVML ({e}); pass --gpu-memory SIZE instead") from None
    try:
        return min(pynvml.nvmlDeviceGetMemoryInfo(_nvml_handle(pynvml, g)).total for g in (gpus or ["0"]))
    except pynvml.NVMLError as e:
        raise ValueError(f"NVML cannot read GPUs {gpus or ['0']} ({e}); check topology or pass --gpu-memory SIZE") from None
    finally:
        pynvml.nvmlShutdown()


def profile_cuda(profile: str) -> tuple[str, str]:
    """The CUDA version of the config's profile manifest, else the default (and why)."""
    try:
        from preflight.profiles import ProfileError, load_profile
    except ImportError:
        return DEFAULT_CUDA, "profiles module unavailable"
    try:
        return load_profile(profile).cuda, f"from envs/{profile}.toml"
    except (ProfileError, OSError) as e:
        return DEFAULT_CUDA, f"default; profile not readable: {e}"


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GiB:.2f}"


def format_estimate(est: Estimate, cuda_source: str = "") -> str:
    lines = [
        f"config: {est.config}",
        f"target: {est.target}",
        f"CUDA {est.cuda}{f' ({cuda_source})' if cuda_source else ''}; GPU {_gib(est.gpu_bytes)} GiB",
        est.assumption,
    ]
    width = max(len(r.component) for role in est.roles for r in role.rows) + 2
    for role in est.roles:
        gpus = f" (GPUs {', '.join(role.gpus)})" if role.gpus else " (one GPU: target + drafter)"
        lines += ["", f"{role.role}{gpus}", f"  {'component':<{width}}{'GiB':>9}"]
        lines += [f"  {r.component:<{width}}{_gib(r.bytes):>9}" for r in role.rows]
        lines.append(f"  {'total':<{width}}{_gib(role.total_bytes):>9}")
        lines.append(f"  {'GPU':<{width}}{_gib(role.gpu_bytes):>9}")
        mark = "" if role.fits is not False else "  DOES NOT FIT"
        lines.append(f"  {'headroom':<{width}}{_gib(role.headroom_bytes):>9}{mark}")
    lines.append("")
    if not est.limits:
        lines.append("limits: give --gpu-memory SIZE or --from-nvml to search the largest settings that fit")
        return "\n".join(lines)
    lines.append("largest settings that fit (each alone, the others as configured):")
    lines.append(f"  {'role':<10}{'setting':<16}{'configured':>11}{'largest':>12}  note")
    for lim in est.limits:
        value = {"none_fit": "none", "no_effect": "-"}.get(lim.status, str(lim.value))
        if lim.status == "unbounded":
            value = f">={lim.value}"
        lines.append(f"  {lim.role:<10}{lim.setting:<16}{lim.configured:>11} {value:>11}  {lim.note}")
    return "\n".join(lines)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", required=True, help="run config TOML")
@click.option("--gpu-memory", help="memory of one GPU, e.g. 95GiB, 80GB, 96000MiB")
@click.option("--from-nvml", is_flag=True, help="read the smallest total memory of the configured GPUs via NVML")
@click.option("--cuda", help="CUDA major.minor of the torch build (default: the config's profile, else 12.8)")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="override a config field, e.g. train.max_anchors=512")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of tables")
def command(config_path: str, gpu_memory: str | None, from_nvml: bool, cuda: str | None, sets: tuple[str, ...],
            as_json: bool) -> int:
    """Per-role GPU memory estimate of a DFlash run and the largest settings that fit."""
    try:
        if gpu_memory and from_nvml:
            raise ValueError("give --gpu-memory or --from-nvml, not both")
        cfg = load_config(config_path, parse_overrides(sets))
        cuda_source = "--cuda"
        if cuda is None:
            cuda, cuda_source = profile_cuda(cfg.profile)
        gpu_bytes = parse_size(gpu_memory) if gpu_memory else None
        if from_nvml:
            gpus = sorted({g for role in roles(cfg) for g in role_gpus(cfg, role)})
            gpu_bytes = nvml_gpu_bytes(gpus)
        est = estimate(cfg, cuda, gpu_bytes, source=config_path)
    except (ConfigError, ValueError) as e:
        raise UsageError(str(e)) from None
    click.echo(est.model_dump_json(indent=2) if as_json else format_estimate(est, cuda_source))
    return 1 if any(r.fits is False for r in est.roles) else 0


def main(argv: list[str] | None = None) -> None:
    """Console entry point: bad input is one line on stderr and exit 2, never a traceback."""
    run_cli(command, "dflash-estimate", argv)


if __name__ == "__main__":
    main()
