"""dflash-eval: acceptance length of a drafter against its target, checked lossless.

    uv run dflash-eval --target smollm2 --drafter runs/demo --prompts held-out --limit 16

This half checks every input without torch (drafter folder and files, prompts, target folder,
device), so a mistake is one line in a second; the decoding is ``dflash.eval.speculative``, imported
once the inputs are known good.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from dflash.data.prompts import load_prompts
from dflash.eval.results import EvalError, EvalReport
from dflash.models import smollm2

DEVICE = re.compile(r"cpu|cuda(:\d+)?")






def find_drafter_folder(path: Path) -> Path:
    """A drafter folder, a run dir's final drafter/, or its newest checkpoint's drafter/ (dflash.runs.rundir's
    names and its list of finished checkpoints)."""
    from dflash.runs import rundir

    path = Path(path)
    if (path / "config.json").is_file() and (path / rundir.WEIGHTS_NAME).is_file():
        return path
    if (path / rundir.DRAFTER_DIR / "config.json").is_file():
        return path / rundir.DRAFTER_DIR
    steps = [d / rundir.DRAFTER_DIR for d in rundir.list_checkpoints(path) if (d / rundir.DRAFTER_DIR / "config.json").is_file()]
    if steps:
        return steps[-1]
    raise EvalError(f"--drafter {path}: not a drafter folder (config.json + {rundir.WEIGHTS_NAME}) nor a run dir "
                    f"with {rundir.DRAFTER_DIR}/ or {rundir.CHECKPOINTS_DIR}/{rundir.STEP_PREFIX}*/{rundir.DRAFTER_DIR}")


def check_drafter_files(folder: Path) -> None:
    """config.json is a JSON object and model.safetensors a complete safetensors file (header and size), read
    without torch; a garbage or truncated file is one line naming it."""
    from safetensors import SafetensorError, safe_open

    config = folder / "config.json"
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EvalError(f"--drafter {config}: not a readable JSON file ({e}); use the drafter/ folder a run writes") from None
    if not isinstance(raw, dict):
        raise EvalError(f"--drafter {config}: not a JSON object; use the drafter/ folder a run writes")
    weights = folder / "model.safetensors"
    try:
        with safe_open(str(weights), framework="numpy") as f:
            keys = list(f.keys())
    except (SafetensorError, OSError) as e:
        raise EvalError(f"--drafter {weights}: not a complete safetensors file ({e}); copy or export the drafter "
                        "again") from None
    if not keys:
        raise EvalError(f"--drafter {weights}: holds no tensors; copy or export the drafter again")


def check_target(target: str) -> None:
    """'smollm2' needs its package (converted on first use); anything else must be a folder with config.json."""
    problem = smollm2.target_problem(target)  # TargetNotFound (one line) when the package is missing
    if problem:
        raise EvalError(problem)


def check_device(device: str) -> None:
    if not DEVICE.fullmatch(device):
        raise EvalError(f"--device {device!r}: use cpu or cuda (cuda:N for one GPU)")


MAX_TREE_BUDGET = 4096  # nodes of one DDTree round (one target forward over them all)


def parse_budgets(text: str) -> list[int]:
    """--ddtree 16,32,64,128: node budgets, each 1..MAX_TREE_BUDGET, in the order given."""
    try:
        budgets = [int(part) for part in text.split(",")]
    except ValueError:
        budgets = []
    if not budgets or not all(1 <= b <= MAX_TREE_BUDGET for b in budgets):
        raise EvalError(f"--ddtree {text!r}: give node budgets as integers 1..{MAX_TREE_BUDGET} separated by commas, "
                        "e.g. 16,32,64,128")
    return budgets


def print_tree_reports(r: EvalReport, log=print) -> None:
    for t in r.ddtree:
        speed = (f", {t['tok_s']:.1f} tok/s ({t['speedup']:.2f}x)" if t["mode"] == "verified"
                 else " (computed from the target's greedy path, not verified; no speed)")
        verdict = "lossless" if t["lossless"] else f"NOT LOSSLESS ({len(t['mismatches'])} prompts differ)"
        log(f"  ddtree budget {t['budget']:>4} ({t['mode']}): mean acceptance length {t['mean_accept_len']:.3f} "
            f"(linear {r.mean_accept_len:.3f}) over {t['rounds']} rounds, {t['nodes_per_round']:.1f} nodes per "
            f"round{speed}; {verdict}")
        log("    accept " + " ".join(f"{k}:{n}" for k, n in t["histogram"].items()))
        for line in t["mismatches"][:3]:
            log(f"    {line}")


def print_report(r: EvalReport, log=print) -> None:
    fp8 = f" against the fp8 target ({r.target_fp8_linears} e4m3 linears)" if r.target_precision == "fp8" else ""
    log(f"[{r.name}] {r.prompts} prompts, block {r.block_size}, up to {r.max_new_tokens} new tokens{fp8}: "
        f"mean acceptance length {r.mean_accept_len:.3f} over {r.verify_steps} verify steps")
    top = max(r.histogram.values(), default=1)
    for k in range(1, r.block_size + 1):
        n = r.histogram.get(k, 0)
        log(f"  accept {k:>3}: {n:>6}  {'#' * round(40 * n / top)}")
    if r.linear_mode == "computed":
        log("  acceptance computed from the target's greedy path, not verified (the target's cache cannot roll back: "
            "a hybrid); no speed")
    else:
        log(f"  tokens/s: speculative {r.spec_tok_s:.1f} vs target-only greedy {r.target_tok_s:.1f} "
            f"({r.speedup:.2f}x; batch 1, target KV cache)")
    if r.lossless and r.ties:
        log(f"  lossless: identical to target-only greedy decoding up to ties: {len(r.ties)} of {r.prompts} prompts "
            "differ, every token still the target's greedy choice within one ulp of its top logit")
        for line in r.ties[:3]:
            log(f"    {line}")
    elif r.lossless:
        log(f"  lossless: {r.new_tokens} tokens identical to target-only greedy decoding")
    else:
        log(f"  NOT LOSSLESS: {len(r.mismatches)} of {r.prompts} prompts differ from target-only greedy")
        for line in r.mismatches[:5]:
            log(f"    {line}")
    print_tree_reports(r, log)


def evaluate(target: str, drafter: Path, prompts: str, block_size: int | None, max_new_tokens: int,
             limit: int | None, device: str = "cpu", log=print, ddtree: str | None = None,
             precision: str = "bf16") -> EvalReport:
    """dflash-eval: one drafter (folder or run dir) on the given prompts; the inputs are checked before torch loads.
    ddtree: "16,32,..." node budgets of DDTree decoding beside the linear one; precision: the verifying target's
    matmuls, bf16 (its dtype) or fp8 (target.precision), whose own greedy output is then the lossless reference."""
    check_device(device)
    budgets = parse_budgets(ddtree) if ddtree else None
    folder = find_drafter_folder(drafter)
    check_drafter_files(folder)
    check_target(target)
    texts = load_prompts(prompts, limit)
    from dflash.eval.speculative import evaluate_drafters, load_drafter, load_eval_target

    d = load_drafter(folder, device)  # small: before the target
    model, tokenizer = load_eval_target(target, device, log, precision)
    log(f"eval: drafter {folder} ({d.config.num_hidden_layers} layers, trained block {d.config.block_size}) on "
        f"{len(texts)} prompts from {prompts}")
    return evaluate_drafters(model, tokenizer, {str(folder): d}, texts, block_size, max_new_tokens, log,
                             ddtree=budgets)[str(folder)]
