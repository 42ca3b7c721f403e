"""train.slot_weights compared on the demo recipe (CPU): the same data, batches, seed and steps per weighting, then
held-out linear and DDTree acceptance of each trained drafter on the same prompts (docs/results.md).

    uv run python bench/slot_weights_demo.py                         # gamma cap dpace auf, budgets 4,16,64
    uv run python bench/slot_weights_demo.py --kinds gamma,cap --epochs 6 --out runs/slot-weights

Each weighting trains through the demo's own pipeline (dflash.commands.demo.run_pipeline: data cached once,
preflight, train, its trained-vs-untrained check); the comparison then loads the target once and evaluates every
trained drafter on --prompts held-out chitchat prompts (linear, and DDTree at each budget, all checked lossless).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default="gamma,cap,dpace,auf")
    p.add_argument("--budgets", default="4,16,64")
    p.add_argument("--epochs", type=int, default=None, help="train.epochs (default: the demo preset's)")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts of the comparison")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", default="runs/slot-weights")
    args = p.parse_args()

    import torch

    from dflash.commands import demo
    from dflash.data.prompts import load_prompts
    from dflash.eval.speculative import evaluate_drafters, load_eval_target
    from dflash.models.drafter import DFlashDrafter
    from dflash.models.smollm2_convert import resolve_target

    kinds = args.kinds.split(",")
    budgets = [int(b) for b in args.budgets.split(",")]
    times = {}
    for kind in kinds:
        overrides = {"train.slot_weights": kind, "output_dir": f"{args.out}/{kind}"}
        if args.epochs:
            overrides["train.epochs"] = args.epochs
        t0 = time.perf_counter()
        code = demo.run_pipeline("smollm2", "chitchat", demo.PROMPTS, demo.MAX_NEW_TOKENS, demo.HELD_OUT_SPEC,
                                 demo.EVAL_PROMPTS, demo.EVAL_MAX_NEW_TOKENS, overrides)
        times[kind] = round(time.perf_counter() - t0, 1)
        if code:
            raise SystemExit(f"{kind}: the demo pipeline exited {code}")

    model, tok = load_eval_target(str(resolve_target("smollm2")), "cpu")
    drafters = {k: DFlashDrafter.from_pretrained(Path(args.out) / k / "drafter", dtype=torch.float32).eval()
                for k in kinds}
    reports = evaluate_drafters(model, tok, drafters, load_prompts(demo.HELD_OUT_SPEC, args.prompts), None,
                                args.max_new_tokens, ddtree=budgets, progress=False)
    heldout = {}
    for k in kinds:
        rows = [json.loads(line) for line in (Path(args.out) / k / "metrics.jsonl").read_text().splitlines()]
        last = [r for r in rows if "heldout_accept_len" in r][-1]
        heldout[k] = {"heldout_accept_len": round(last["heldout_accept_len"], 3),
                      "heldout_ce": round(last["heldout_ce"], 4), "step": last["step"]}
    print(f"\n{args.prompts} held-out chitchat prompts x {args.max_new_tokens} tokens, SmolLM2-135M target, "
          f"block {reports[kinds[0]].block_size}")
    head = "| slot_weights | teacher-forced tau | linear tau | " + " | ".join(f"DDTree {b}" for b in budgets)
    print(head + " | lossless | pipeline s |")
    print("|" + "---|" * (5 + len(budgets)))
    for k in kinds:
        r = reports[k]
        trees = " | ".join(f"{t['mean_accept_len']:.3f}" for t in r.ddtree)
        lossless = r.lossless and all(t["lossless"] for t in r.ddtree)
        print(f"| {k} | {heldout[k]['heldout_accept_len']:.3f} | {r.mean_accept_len:.3f} | {trees} | "
              f"{'yes' if lossless else 'NO'} | {times[k]:.0f} |")
    (Path(args.out) / "comparison.json").write_text(json.dumps(
        {k: {"heldout": heldout[k], "report": json.loads(reports[k].to_json()), "pipeline_s": times[k]}
         for k in kinds}, indent=2))


if __name__ == "__main__":
    main()
