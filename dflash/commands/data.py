"""dflash-data: make, merge, record and describe training datasets.

    uv run dflash-data stats data/train
    uv run dflash-data stats --config configs/qwen3.6-27b-8gpu.toml    # the batches and steps that run draws
    uv run dflash-data manifest data/train --target models/qwen3-8b
"""

from __future__ import annotations

from pathlib import Path

import click

from dflash.commands.common import CONTEXT
from dflash.commands.data_import import import_command
from dflash.commands.data_regenerate import regenerate_command
from dflash.config import MAX_TOKENS
from dflash.errors import Group, run_cli


@click.group(cls=Group, context_settings=CONTEXT)
def data_command() -> None:
    """Prepare, merge and inspect Arrow training shards."""


data_command.add_command(import_command, "import")
data_command.add_command(regenerate_command)


@data_command.command("stats", epilog="\b\nExamples:\n  dflash-data stats data/train --token-budget 45056\n"
                      "  dflash-data stats --config configs/qwen3.6-27b-8gpu.toml\n"
                      "  dflash-data stats --config RUN.toml --set data.pack_remainders=false --set data.packing=true")
@click.argument("path", required=False, type=click.Path(exists=True, file_okay=False))
@click.option("--config", "config_path", metavar="RUN.toml", help="show the batches this run draws (its data.path, "
              "[data] batching, eval.holdout, grad_accum and drafter ranks) instead of PATH's with the options below")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="override a field of --config, as dflash-train "
              "--set does, e.g. data.packing=true")
@click.option("--token-budget", type=click.IntRange(16, MAX_TOKENS), default=49152, show_default=True)
@click.option("--max-batch-size", type=click.IntRange(1, MAX_TOKENS), default=64, show_default=True)
@click.option("--num-buckets", type=click.IntRange(1, 1024), default=16, show_default=True)
@click.pass_context
def data_stats(ctx, path, config_path, sets, token_budget, max_batch_size, num_buckets) -> None:
    """Samples, tokens, length histogram and the batches the trainer would draw from PATH, or from a run's --config
    (then its own sampler: length buckets, pack_remainders or packing; batches and steps an epoch, the budget filled)."""
    from dflash.config import load_config, parse_overrides
    from dflash.data.buckets import BucketBatchSampler
    from dflash.data.import_stats import stats_lines
    from dflash.data.shards import ShardDataset

    if (path is None) == (config_path is None):
        raise click.UsageError("give a dataset folder PATH or --config RUN.toml, one of them "
                               "(e.g. dflash-data stats data/train)")
    if sets and config_path is None:
        raise click.UsageError("--set overrides a run config field: give --config RUN.toml with it")
    for name in ("token_budget", "max_batch_size", "num_buckets"):
        if config_path is not None and ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT:
            raise click.UsageError(f"--{name.replace('_', '-')} is the run config's data.{name} with --config; "
                                   f"give --set data.{name}=N instead")
    if config_path is None:
        ds = ShardDataset(path)
        sampler = BucketBatchSampler(ds.lengths, token_budget, max_batch_size, num_buckets, 0)
        lines = [*_dataset_lines(path, ds), sampler.summary(), _fill_line(sampler)]
    else:
        ds, lines = _plan_lines(load_config(config_path, parse_overrides(sets)), config_path)
    for line in [*lines, *stats_lines(ds.shards)]:
        click.echo(line)


def _dataset_lines(label, ds) -> list[str]:
    import numpy as np

    lengths = ds.lengths
    lines = [f"{label}: {ds.num_samples} samples, {int(lengths.sum())} tokens, "
             f"length min {lengths.min()} mean {lengths.mean():.0f} max {lengths.max()}"]
    edges = np.unique(np.quantile(lengths, np.linspace(0, 1, 11)).astype(int))
    counts, _ = np.histogram(lengths, bins=edges)
    for lo, hi, n in zip(edges[:-1], edges[1:], counts):
        lines.append(f"  {lo:>7}-{hi:<7} {n:>9}  {'#' * int(40 * n / max(1, counts.max()))}")
    return lines


def _fill_line(sampler) -> str:
    return (f"{sampler.batches_per_epoch:,} batches an epoch, {sampler.fill:.1%} of the {sampler.token_budget:,}-token "
            "budget (real tokens / (batches x token_budget))")


def _plan_lines(cfg, config_path: str):
    """(data.path's dataset, lines): its histogram, then the sampler dflash.data.plan.schedule builds for the run and
    the steps it makes of the batches."""
    from dflash.data.plan import schedule

    ranks = len(cfg.topology.trainer_gpus) or 1
    dataset, sampler, total = schedule(cfg, ranks)
    whole = getattr(dataset, "base", dataset)  # all of data.path, [eval] holdout's samples too
    d, t = cfg.data, cfg.train
    how = ("packs (data.packing)" if d.packing else
           f"length buckets (data.num_buckets {d.num_buckets}{', data.pack_remainders' if d.pack_remainders else ''})")
    held = f", {whole.num_samples - dataset.num_samples:,} held out (eval.holdout)" if dataset is not whole else ""
    per_step = t.grad_accum * ranks
    steps = sampler.batches_per_epoch / per_step
    steps_text = f"{steps:,.0f}" if steps.is_integer() else f"{steps:,.1f}"
    run = "train.max_steps" if t.max_steps else f"train.epochs {t.epochs}"
    return whole, [
        *_dataset_lines(cfg.data.path, whole),
        f"plan of {config_path}: {dataset.num_samples:,} samples train{held}, batched as {how}",
        sampler.summary(),
        _fill_line(sampler),
        f"{steps_text} steps an epoch of {per_step} batches (train.grad_accum {t.grad_accum} x {ranks} drafter "
        f"rank{'s' if ranks > 1 else ''}); the run: {total:,} steps ({run})",
    ]


@data_command.command("prepare")
@click.option("--target", default="smollm2", show_default=True, help="HF model folder, or smollm2 (embedded)")
@click.option("--prompts", default="chitchat", show_default=True, help="chitchat, held-out, or a .txt/.jsonl file")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="output folder")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--limit", type=click.IntRange(min=1), help="first N prompts only")
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True, help="prompts per generate call")
@click.option("--shard-size", type=click.IntRange(min=1), default=64, show_default=True, help="samples per shard")
@click.option("--engine", type=click.Choice(["transformers", "sglang"]), default="transformers", show_default=True)
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda (transformers engine)")
def data_prepare(target, prompts, out, max_new_tokens, limit, batch_size, shard_size, engine, device) -> None:
    """Greedy completions of the target -> Arrow shards (resumable: finished shards are kept)."""
    from dflash.data.prepare import PrepareSettings, prepare

    prepare(PrepareSettings(target, prompts, out, max_new_tokens, limit, batch_size, shard_size, engine, device),
            log=click.echo)


@data_command.command("merge")
@click.argument("inputs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path), help="merged output folder (must not exist)")
@click.option("--overwrite", is_flag=True, help="replace an existing --out (the old one is moved aside, not deleted)")
def data_merge(inputs, out, overwrite) -> None:
    """Copy the shards of several datasets into one new folder; inputs are never written.

    Refuses an input given twice (same folder or same shard content), an --out inside an input,
    and inputs built for different targets.
    """
    from dflash.data.prepare import merge

    merge(list(inputs), out, overwrite, log=click.echo)


@data_command.command("manifest")
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--target", required=True, help="the HF model folder (or smollm2) the data was tokenized for")
def data_manifest(path, target) -> None:
    """Record the target and every shard's size and sha256 in PATH/manifest.json (data written by other tools).

    Refused when a token id does not fit the target's vocabulary.
    """
    from dflash.data.prepare import record_manifest

    record_manifest(path, target, log=click.echo)


def data_main(argv: list[str] | None = None) -> None:
    run_cli(data_command, "dflash-data", argv)
