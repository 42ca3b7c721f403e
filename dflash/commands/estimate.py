"""dflash-estimate: what one GPU of each role needs, and the largest settings that fit.

    uv run dflash-estimate --config configs/qwen3-27b-5t3d.toml --gpu-memory 95GiB
    uv run dflash-estimate --config configs/qwen3-8b-1gpu.toml --from-nvml --json
    uv run dflash-estimate --config RUN.toml --gpu-memory 80GB --set data.token_budget=45056
    uv run dflash-estimate --config configs/qwen3.6-27b-8gpu.toml --gpu-memory 95GiB --rates 12.55k,46.3k --link-gbps 50
    uv run dflash-estimate --config configs/qwen3.6-27b-5t3d.toml --gpu-memory 95GiB --colocated-gpus 0,1,2,3,4,5,6,7
    uv run dflash-estimate --config RUN.toml --from-nvml --probe      # the memory outside torch measured on its GPUs

Exit codes: 0 every role fits (or no GPU size given), 1 some role does not fit, 2 bad input.
This module only formats and maps to exit codes; ``preflight.estimate`` decides.
"""

from __future__ import annotations

import click

from dflash.commands.common import gpu_options, gpu_overrides
from dflash.errors import DflashError, UsageError, run_cli
from dflash.memory.fit import Estimate
from dflash.memory.shape import GiB
from preflight.estimate import run_estimate


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GiB:.2f}"


def format_estimate(est: Estimate, cuda_source: str = "") -> str:
    """The tables a person reads: per role its components, total and headroom, then the limits."""
    lines = [
        f"config: {est.config}",
        f"target: {est.target}",
        f"CUDA {est.cuda}{f' ({cuda_source})' if cuda_source else ''}; GPU {_gib(est.gpu_bytes)} GiB"
        + (f" ({est.gpu_source})" if est.gpu_source else ""),
        *([est.overhead] if est.overhead else []),
        est.assumption,
    ]
    if est.decisions:
        lines.append(f"decisions on GPUs of {_gib(est.gpu_bytes)} GiB (a mode fits when its peak + what "
                     "train.memory_headroom_gib keeps free is within the GPU; GiB):")
        lines += [f"  {d}" for d in est.decisions]
    width = max(len(r.component) for role in est.roles for r in role.rows) + 2
    for role in est.roles:
        gpus = f" (GPUs {', '.join(role.gpus)})" if role.gpus else " (one GPU: target + drafter)"
        if role.role == "colocated" and role.gpus:
            each = (f"a whole target + 1/{len(role.gpus)} of the drafter, FSDP2" if role.data_parallel == "fsdp2"
                    else "target + drafter replica")
            gpus = f" (GPUs {', '.join(role.gpus)}: each {each})"
        lines += ["", f"{role.role}{gpus}", f"  {'component':<{width}}{'GiB':>9}"]
        lines += [f"  {r.component:<{width}}{_gib(r.bytes):>9}" for r in role.rows]
        lines.append(f"  {'total':<{width}}{_gib(role.total_bytes):>9}")
        lines.append(f"  {'GPU':<{width}}{_gib(role.gpu_bytes):>9}")
        mark = "" if role.fits is not False else f"  DOES NOT FIT (keeps {_gib(role.keep_bytes)} GiB free)"
        lines.append(f"  {'headroom':<{width}}{_gib(role.headroom_bytes):>9}{mark}")
        lines.append(f"  {'kept free (train.memory_headroom_gib)':<{width}}{_gib(role.keep_bytes):>9}")
    lines += ["", *format_layouts(est), *format_pace(est), ""]
    if not est.limits:
        lines.append("limits: give --gpu-memory SIZE or --from-nvml to search the largest settings that fit")
        return "\n".join(lines)
    lines.append("largest settings that fit (each alone, the others as configured):")
    lines.append(f"  {'role':<10}{'setting':<16}{'configured':>11}{'largest':>12}  note")
    for lim in est.limits:
        value = {"none_fit": "none", "no_effect": "-"}.get(lim.status, str(lim.value))
        if lim.status == "unbounded":
            value = f">={lim.value}"
        configured = "unset" if lim.configured is None else str(lim.configured)
        lines.append(f"  {lim.role:<10}{lim.setting:<16}{configured:>11} {value:>11}  {lim.note}")
    return "\n".join(lines)


def format_layouts(est: Estimate) -> list[str]:
    """One line per layout: the GiB each of its GPUs needs and whether it fits the GPU size given."""
    size = f"{_gib(est.gpu_bytes)} GiB" if est.gpu_bytes is not None else "no GPU size given"
    lines = [f"layouts on GPUs of {size} (docs/training.md#layouts):"]
    for lay in est.layouts:
        verdict = {True: "fits", False: "DOES NOT FIT", None: "-"}[lay.fits]
        need = ", ".join(f"{role} {_gib(b)} GiB" + ("" if role == "target" else f" (recompute {lay.recompute[role]})")
                         for role, b in lay.need_bytes.items())
        lines.append(f"  {verdict:<13}{lay.description}: {need}")
    return lines


def _slower(tok_s: float, best: float) -> str:
    return f"{1 - tok_s / best:.1%} slower" if tok_s < best else "the same"


def format_pace(est: Estimate) -> list[str]:
    """Each layout's tokens/s at the busy rates given, its link time per step, and the fastest of those that fit, or a
    tie when others are within the rates' noise (dflash.memory.pace)."""
    from dflash.memory.pace import RATE_NOISE, RECOMPUTE_TIME_PER_FLOP, fastest

    if not est.pace:
        return []
    r = est.rates or {}
    measured = est.rates_recompute or "off"
    lines = ["", f"pace at busy rates of target {r.get('target', 0):,.0f} and drafter {r.get('drafter', 0):,.0f} tok/s "
             f"per GPU, link {est.link_gbps:g} GB/s one way per GPU; communication overlapped with the drafter's "
             "compute, not the target's (dflash.memory.pace):"]
    if est.recompute_cost:
        at = measured
        others = [f"{m} x{c:.3f}" for m, c in est.recompute_cost.items() if m != at]
        lines.append(f"  the drafter rate is taken as measured at recompute {at}; each layout's drafter is priced at the "
                     "recompute it resolves to, as the extra forward work of the parts it recomputes (their matmul FLOPs "
                     f"at {RECOMPUTE_TIME_PER_FLOP:g} of a drafter step's time per FLOP, as measured; against {at}: "
                     f"{', '.join(others)})")
    for p in est.pace:
        verdict = {True: "fits", False: "DOES NOT FIT", None: "-"}[p.fits]
        link = f", link {p.link_bytes / 1e9:.2f} GB, {p.link_s:.2f} s a step" if p.link_bytes else ""
        drafter = f"; drafter {p.drafter_tok_s:,.0f}" if p.recompute != measured else ""
        lines.append(f"  {verdict:<13}{p.description} on {p.gpus} GPU{'s' if p.gpus > 1 else ''}: "
                     f"{p.tok_per_s:,.0f} tok/s (recompute {p.recompute}{drafter}{link})")
    n = max(p.gpus for p in est.pace)
    best, tied = fastest([p for p in est.pace if p.gpus == n and p.fits is not False])
    if best is None:
        lines.append(f"no layout of {n} GPUs fits GPUs of {_gib(est.gpu_bytes)} GiB")
    elif tied:
        lines.append(f"fastest on {n} GPUs{' that fits' if best.fits else ' (no GPU size given)'}: a tie within the "
                     f"rates' {RATE_NOISE:.0%} noise: {best.description}, {best.tok_per_s:,.0f} tok/s; " + "; ".join(
                         f"{p.description}, {p.tok_per_s:,.0f} tok/s ({_slower(p.tok_per_s, best.tok_per_s)})"
                         for p in tied))
    else:
        lines.append(f"fastest on {n} GPUs{' that fits' if best.fits else ' (no GPU size given)'}: {best.description}, "
                     f"{best.tok_per_s:,.0f} tok/s")
    return lines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", required=True, help="run config TOML")
@click.option("--gpu-memory", help="memory of one GPU, e.g. 95GiB, 80GB, 96000MiB")
@click.option("--from-nvml", is_flag=True, help="read the smallest total memory of the configured GPUs via NVML")
@click.option("--cuda", help="CUDA major.minor of the torch build (default: the config's profile, else 12.8)")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="override a config field, e.g. train.max_anchors=512")
@click.option("--rates", metavar="TARGET,DRAFTER", help="busy tok/s per GPU of a target and a drafter (a split run's "
              "summary prints them), e.g. 12.5k,41k: adds each layout's tokens/s and the fastest that fits")
@click.option("--rates-from", metavar="RUN_DIR", help="the busy rates of a split run dir's metrics, as its summary "
              "printed them (instead of --rates)")
@click.option("--rates-recompute", type=click.Choice(["off", "mlp", "layer"]), help="the recompute the drafter's "
              "rate was measured at (default: the --rates-from run's, else off); pace lines at another say so")
@click.option("--link-gbps", metavar="GB/S", help="bandwidth of the link between GPUs, GB/s one way per GPU, that "
              "the pace prices each layout's communication at (default 50: PCIe Gen5 x16 as measured; 63 in theory)")
@click.option("--probe", is_flag=True, help="measure the memory a run's process holds outside torch on the config's "
              "GPUs (a subprocess per GPU, cached per machine state) and use it instead of the calibrated constant")
@gpu_options
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of tables")
def command(config_path: str, gpu_memory: str | None, from_nvml: bool, cuda: str | None, sets: tuple[str, ...],
            rates: str | None, rates_recompute: str | None, rates_from: str | None, link_gbps: str | None,
            probe: bool, target_gpus: str | None, drafter_gpus: str | None, colocated_gpus: str | None,
            as_json: bool) -> int:
    """Per-role GPU memory estimate of a DFlash run, the largest settings that fit and, given busy rates, which
    layout trains fastest."""
    try:
        est, cuda_source = run_estimate(config_path, sets, gpu_memory, from_nvml, cuda, rates=rates,
                                        rates_from=rates_from, link_gbps=link_gbps, probe=probe,
                                        overrides=gpu_overrides(target_gpus, drafter_gpus, colocated_gpus),
                                        rates_recompute=rates_recompute)
    except DflashError as e:
        raise UsageError(e.one_line()) from None
    for warning in est.warnings:
        click.echo(f"dflash-estimate: warning: {warning}", err=True)
    click.echo(est.model_dump_json(indent=2) if as_json else format_estimate(est, cuda_source))
    return 1 if any(r.fits is False for r in est.roles) else 0


def main(argv: list[str] | None = None) -> None:
    """Console entry point: bad input is one line on stderr and exit 2, never a traceback."""
    run_cli(command, "dflash-estimate", argv)


if __name__ == "__main__":
    main()
