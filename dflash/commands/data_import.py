"""`dflash-data import`: conversation files -> Arrow shards with exact assistant loss masks (the mask lines
`dflash-data stats` prints are dflash.data.import_stats').

    uv run dflash-data import chats.jsonl --target models/qwen3-8b --out data/chats
    uv run dflash-data import sharegpt.json tools.parquet --target smollm2 --out data/mine --last-turn-only
    uv run dflash-data stats data/chats      # + masked fraction, assistant tokens and turns per row

Exit codes: 0 imported (malformed rows go to OUT/skipped.jsonl and do not fail the import), 1 a tokenizing
worker died twice with the same rows in flight (one death is survived), 2 bad input (a file that is no
JSON/JSONL/Parquet, a target without a chat template, an --out imported with other settings). Rerun the same
command to resume an interrupted import.
"""

from __future__ import annotations

from pathlib import Path

import click

from dflash.data.conversations import FORMATS, THINKING
from dflash.errors import Command

CONTEXT = {"help_option_names": ["-h", "--help"]}


@click.command(cls=Command, context_settings=CONTEXT)
@click.argument("sources", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--target", default="smollm2", show_default=True, help="HF model folder, or smollm2 (embedded); "
              "its chat template renders the conversations")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="output folder")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="auto", show_default=True,
              help="row format; auto detects it per file")
@click.option("--thinking", type=click.Choice(THINKING), default="keep", show_default=True,
              help="reasoning_content for templates that render it (Qwen3 family): keep it where the template "
              "does, or drop all of it (enable_thinking=False)")
@click.option("--last-turn-only", is_flag=True, help="mask only the last assistant turn of each row")
@click.option("--max-length", type=click.IntRange(min=2), help="tokens per row, at most")
@click.option("--overlong", type=click.Choice(("truncate", "drop")), default="truncate", show_default=True,
              help="what a row longer than --max-length gets")
@click.option("--shard-size", type=click.IntRange(min=1), default=10_000, show_default=True,
              help="source rows per shard (the unit of resume)")
@click.option("--workers", type=click.IntRange(min=0), default=0, show_default=True,
              help="tokenizing processes (0: one per core)")
@click.option("--no-progress", is_flag=True, help="a log line per shard instead of a progress bar")
def import_command(sources, target, out, fmt, thinking, last_turn_only, max_length, overlong, shard_size, workers,
                   no_progress) -> None:
    """Import ShareGPT / OpenAI-messages conversations (JSONL, JSON, Parquet) as training shards.

    Each row is rendered with the target's chat template; the loss mask covers every assistant reply and
    its end-of-turn token (never role headers, system, user or tool text). Resumable: rerun to continue.
    """
    from dflash.data.conversation_import import ImportSettings, import_conversations

    settings = ImportSettings(list(sources), target, out, fmt, thinking, last_turn_only, max_length, overlong,
                              shard_size, workers)
    import_conversations(settings, log=click.echo, progress=False if no_progress else None)
