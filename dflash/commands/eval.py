"""dflash-eval: lossless speculative decoding with a trained drafter against target-only greedy decoding.

    uv run dflash-eval --target smollm2 --drafter runs/demo --prompts held-out --limit 16
    uv run dflash-eval --drafter runs/demo --ddtree 16,32,64,128   # DDTree acceptance per node budget beside it
    uv run dflash-eval --drafter runs/demo --target-precision fp8   # verified by the target with fp8 linears
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from dflash.commands.common import CONTEXT
from dflash.errors import Command, run_cli


@click.command(cls=Command, context_settings=CONTEXT)
@click.option("--target", default="smollm2", show_default=True, help="HF model folder, or smollm2 (embedded)")
@click.option("--drafter", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="run dir (output_dir) or drafter folder (config.json + model.safetensors)")
@click.option("--prompts", default="held-out", show_default=True, help="held-out, chitchat, or a .txt/.jsonl file")
@click.option("--block-size", type=click.IntRange(2, 128), help="tokens per drafted block (default: the drafter's)")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--limit", type=click.IntRange(min=1), default=16, show_default=True, help="first N prompts")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda (cuda:N)")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="also write the report here")
@click.option("--ddtree", metavar="BUDGETS", help="also DDTree decoding (arXiv 2604.12989) at these node budgets, "
              "e.g. 16,32,64,128: acceptance per budget beside the linear one")
@click.option("--target-precision", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True,
              help="the verifying target's matmuls, as target.precision: bf16 (its dtype) or fp8 (decoder linears in "
              "e4m3; emulated on CPU); the output must equal that target's own greedy decoding")
def eval_command(target, drafter, prompts, block_size, max_new_tokens, limit, device, json_out, ddtree,
                 target_precision) -> None:
    """Acceptance length of a drafter against its target (greedy speculative decoding, checked lossless)."""
    from dflash.eval.evaluate import evaluate, print_report

    if json_out and not json_out.absolute().parent.is_dir():
        raise click.UsageError(f"--json {json_out}: the folder {json_out.absolute().parent} does not exist")
    report = evaluate(target, drafter, prompts, block_size, max_new_tokens, limit, device, log=click.echo,
                      ddtree=ddtree, precision=target_precision)
    print_report(report, log=click.echo)
    if json_out:
        json_out.write_text(report.to_json())
    if not report.lossless or not all(t["lossless"] for t in report.ddtree):
        sys.exit(1)


def eval_main(argv: list[str] | None = None) -> None:
    run_cli(eval_command, "dflash-eval", argv)
