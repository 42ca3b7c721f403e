"""dflash-data: make, merge, record and describe training datasets.

    uv run dflash-data stats data/train
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


@data_command.command("stats")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--token-budget", type=click.IntRange(16, MAX_TOKENS), default=49152, show_default=True)
@click.option("--max-batch-size", type=click.IntRange(1, MAX_TOKENS), default=64, show_default=True)
@click.option("--num-buckets", type=click.IntRange(1, 1024), default=16, show_default=True)
def data_stats(path, token_budget, max_batch_size, num_buckets) -> None:
    """Samples, tokens, length histogram and the bucket table the trainer would use."""
    import numpy as np

    from dflash.data.buckets import BucketBatchSampler
    from dflash.data.import_stats import stats_lines
    from dflash.data.shards import ShardDataset

    ds = ShardDataset(path)
    lengths = ds.lengths
    click.echo(f"{path}: {ds.num_samples} samples, {int(lengths.sum())} tokens, "
               f"length min {lengths.min()} mean {lengths.mean():.0f} max {lengths.max()}")
    edges = np.unique(np.quantile(lengths, np.linspace(0, 1, 11)).astype(int))
    counts, _ = np.histogram(lengths, bins=edges)
    for lo, hi, n in zip(edges[:-1], edges[1:], counts):
        click.echo(f"  {lo:>7}-{hi:<7} {n:>9}  {'#' * int(40 * n / max(1, counts.max()))}")
    sampler = BucketBatchSampler(lengths, token_budget, max_batch_size, num_buckets, 0)
    click.echo(sampler.summary())
    for line in stats_lines(ds.shards):
        click.echo(line)


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
