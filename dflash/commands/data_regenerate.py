"""`dflash-data regenerate`: the target's own replies for a file of conversations, from OpenAI-compatible servers.

    uv run dflash-data regenerate --input conv.jsonl --server http://127.0.0.1:30000 --out regen.jsonl
    uv run dflash-data regenerate --input conv.jsonl --server http://gpu1:30000 --server http://gpu2:30000 \\
        --out regen.jsonl --concurrency 128 --temperature 0.7 --turns last --thinking off

Exit codes: 0 every conversation done or skipped with a reason (<out stem>.skipped.jsonl), 1 the run stopped early:
every server went down mid-run, or the first conversations all failed (rerun the same command once fixed: finished
ids are skipped), 2 bad input (a FIFO or a device for --input or --out, an input that is no JSONL, JSON array or
Parquet), another run writing the same --out, or a server unreachable at start.
"""

from __future__ import annotations

from pathlib import Path

import click

from dflash.data.regenerate import (
    OutputLock,
    RunStopped,
    Settings,
    check_paths,
    normalize_url,
    probe,
    run,
    skipped_path,
)
from dflash.errors import Command


def _pick_model(model: str | None, urls: list[str]) -> str | None:
    """--model, else the first model the first server lists, else None (the request names no model)."""
    listed = probe(urls)  # every server must answer before anything starts
    if model:
        return model
    if listed:
        return listed[0]
    click.echo(f"regenerate: {urls[0]} lists no model; requests name none and the server uses its own", err=True)
    return None


def _report(summary, out: Path) -> None:
    rate = summary.regenerated / max(summary.seconds, 1e-9)
    tokens = summary.completion_tokens / max(summary.seconds, 1e-9)
    click.echo(f"regenerated {summary.regenerated} conversations in {summary.seconds:.1f} s ({rate:.2f} conv/s, "
               f"{tokens:.0f} completion tok/s) -> {out}; {summary.already_done} already done, "
               f"{summary.skipped} skipped ({skipped_path(out)})")
    if summary.truncated:
        click.echo(f"{summary.truncated} replies stopped at --max-tokens (finish_reason length)")
    served = ", ".join(f"{url} {n}" for url, n in summary.served.items())
    click.echo(f"replies per server: {served or 'none'}; {summary.retries} retries")


@click.command("regenerate", cls=Command, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--input", "input_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="conversations, as import reads them: JSONL, a JSON array or Parquet of ShareGPT `conversations` "
              "or OpenAI `messages` rows")
@click.option("--server", "servers", multiple=True, required=True, metavar="URL",
              help="an OpenAI-compatible server, e.g. http://127.0.0.1:30000 (repeat to spread the requests)")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="output JSONL (OpenAI `messages`); appended to, finished ids skipped; <stem>.skipped.jsonl beside "
              "it")
@click.option("--model", help="the `model` field of each request  [default: the first one the first server lists]")
@click.option("--concurrency", type=click.IntRange(1, 4096), default=64, show_default=True,
              help="conversations in flight at once")
@click.option("--temperature", type=click.FloatRange(0.0, 2.0), default=0.0, show_default=True, help="0 = greedy")
@click.option("--max-tokens", type=click.IntRange(min=1), default=4096, show_default=True,
              help="completion tokens per reply (an answer with more, or bigger than they can make, is refused)")
@click.option("--turns", type=click.Choice(["all", "last"]), default="all", show_default=True,
              help="all: every assistant turn, in order, on the regenerated history; last: only the final one")
@click.option("--thinking", type=click.Choice(["keep", "off"]), default="keep", show_default=True,
              help="off: ask the template for no reasoning (chat_template_kwargs enable_thinking=false)")
@click.option("--seed", type=int, help="sent with every request")
@click.option("--retries", type=click.IntRange(0, 20), default=5, show_default=True,
              help="further attempts per reply, with exponential backoff, on another server when there is one")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1.0), default=600.0, show_default=True,
              help="seconds per request, in total (connection to last byte); a conversation that hits it is sent "
              "once more, then skipped")
@click.option("--no-progress", is_flag=True, help="no progress bar")
def regenerate_command(input_path, servers, out, model, concurrency, temperature, max_tokens, turns, thinking, seed,
                       retries, timeout_s, no_progress) -> None:
    """Replace each conversation's assistant turns with the target's own replies from OpenAI-compatible servers.

    Each finished conversation is appended to --out at once; a rerun skips the ids already there, so a server
    (or this command) stopped mid-run loses nothing. Failures go to <out stem>.skipped.jsonl beside --out with the reason.
    """
    check_paths(input_path, out)  # before any server is asked
    urls = list(dict.fromkeys(normalize_url(u) for u in servers))
    out.parent.mkdir(parents=True, exist_ok=True)
    with OutputLock(out):  # a second run on this --out is refused here, before any server is asked
        settings = Settings(model=_pick_model(model, urls), temperature=temperature, max_tokens=max_tokens,
                            turns=turns, thinking=thinking, seed=seed, retries=retries, timeout_s=timeout_s)
        summary = run(input_path, out, urls, settings, concurrency, progress=False if no_progress else None,
                      locked=True)
    _report(summary, out)
    if summary.stopped:
        raise RunStopped(f"stopped: {summary.stopped}; what is done is kept in {out}: then rerun the same command "
                         "(finished ids are skipped)")
