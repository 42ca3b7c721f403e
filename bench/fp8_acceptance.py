"""Does an FP8 target cost acceptance? Drafters trained on bf16 or fp8 target features, each verified by the bf16 and by
the fp8 target (issue #55, "Acceptance"), on the CPU demo recipe.

    uv run python bench/fp8_acceptance.py --out bench/results/cpu2_fp8_acceptance.json   # 3 seeds, ~35 min on 2 cores
    uv run python bench/fp8_acceptance.py --quick                                         # 1 seed, 4 steps, 2 prompts

The demo's data (the target's greedy completions of chitchat prompts) is prepared once, by the bf16 target, and every
run trains on it: configs/demo-cpu.toml with train.seed = SEED and target.precision = bf16 or fp8 (the features the
drafter learns from). Each drafter is then evaluated as dflash-eval --target-precision bf16|fp8 does it, on the demo's
held-out prompts: linear speculative decoding and DDTree at the demo's budget, each checked lossless against the
greedy output of the target that verifies.

"bf16" is target.precision's name for the target's own dtype: float32 in this CPU recipe. On CPU the fp8 linears are
dflash.models.target_fp8's emulation of torchao's per-row e4m3 arithmetic. SmolLM2-135M's linears (hidden 576) are all
below the production size filter (dflash.config.FP8_MIN_FEATURES), which would quantise none of them, so this script
lowers the filter in its own process (--fp8-min-features, default 1: every decoder linear) and prints how many run in
fp8. Prints the 2 x 2 table (mean and sample standard deviation over seeds) and, with --out, writes every run's figures.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, write_json  # noqa: E402

PRECISIONS = ("bf16", "fp8")
QUICK = {"prompts": 16, "max_new_tokens": 16, "heldout": 4, "eval_prompts": 2, "eval_max_new_tokens": 8,
         "overrides": {"train.max_steps": 4, "eval.every": 0, "eval.real_prompts": 1}}


def prepare_data(n_prompts: int, max_new_tokens: int, n_heldout: int, log=print) -> tuple[Path, Path, Path]:
    """(target folder, training data, held-out data): the demo's, prepared by the bf16 target (cached, resumable)."""
    from dflash.commands import demo
    from dflash.data.prepare import PrepareSettings, prepare
    from dflash.models.smollm2 import cache_root
    from dflash.models.smollm2_convert import resolve_target

    target = resolve_target("smollm2", log=log)
    folders = []
    for prompts, n in (("chitchat", n_prompts), (demo.HELD_OUT_SPEC, n_heldout)):
        folder = cache_root() / "demo" / f"{target.name}-{prompts}-{n}x{max_new_tokens}"
        prepare(PrepareSettings("smollm2", prompts, folder, max_new_tokens, n, batch_size=32, shard_size=32,
                                device="cpu"), log=log)
        folders.append(folder)
    return target, folders[0], folders[1]


def train(target: Path, data: Path, heldout: Path, run_dir: Path, seed: int, features: str, overrides: dict,
          log=print) -> dict:
    """One demo drafter trained on `features` ("bf16" or "fp8" target features) into run_dir; an earlier run's
    drafter there is reused (an interrupted bench goes on where it stopped)."""
    from dflash.commands import demo
    from dflash.config import load_config
    from dflash.runs import rundir
    from dflash.train.trainer import run
    from preflight.gate import provenance

    drafter = run_dir / rundir.DRAFTER_DIR
    if drafter.is_dir():
        log(f"fp8-acceptance: {drafter} exists: reused")
        return {"drafter": drafter, "train_s": None}
    cfg = load_config(demo.CONFIG, {"target.path": str(target), "data.path": str(data), "eval.path": str(heldout),
                                    "output_dir": str(run_dir), "train.seed": seed, "target.precision": features,
                                    **overrides})
    t0 = time.perf_counter()
    code = run(cfg, None, log=log, progress=False, provenance=provenance(cfg.profile))
    if code or not drafter.is_dir():
        raise SystemExit(f"fp8-acceptance: training {run_dir} stopped (exit {code}); nothing to evaluate")
    return {"drafter": drafter, "train_s": round(time.perf_counter() - t0, 1)}


def verify(target: Path, precision: str, drafters: dict[str, Path], n_prompts: int, max_new_tokens: int, budget: int,
           log=print) -> dict:
    """dflash-eval --target-precision `precision` of every drafter (name -> folder) on the demo's held-out prompts,
    the target loaded once: name -> EvalReport."""
    import torch

    from dflash.commands import demo
    from dflash.data.prompts import load_prompts
    from dflash.eval.speculative import evaluate_drafters, load_drafter, load_eval_target

    model, tokenizer = load_eval_target(str(target), "cpu", log, precision)
    loaded = {name: load_drafter(folder, "cpu") for name, folder in drafters.items()}
    prompts = load_prompts(demo.HELD_OUT_SPEC, n_prompts)
    noise = shape_noise(model, tokenizer, prompts[0], max_new_tokens)
    log(f"fp8-acceptance: the {precision} target's logits, one forward over a prompt and its greedy tokens vs decoding "
        f"them one at a time: up to {noise['max_abs_logit_diff']:.2e} apart, {noise['argmax_differs']} of "
        f"{noise['positions']} greedy tokens differ")
    torch.manual_seed(0)
    reports = evaluate_drafters(model, tokenizer, loaded, prompts, None, max_new_tokens, log, progress=False,
                                ddtree=[budget])
    return reports, noise


def shape_noise(model, tokenizer, prompt: str, max_new_tokens: int) -> dict:
    """How far the target's logits at the same positions move with the shape of the forward that computes them: one
    forward over prompt + greedy tokens against greedy decoding's own (one token a step, KV cache). Speculative
    decoding's verify pass is a third shape; the lossless check holds only where this stays within a tie."""
    import torch
    from transformers import DynamicCache

    from dflash.data.prompts import chat_prompt_ids

    ids = chat_prompt_ids(tokenizer, prompt)
    with torch.no_grad():
        cache, steps, tokens = DynamicCache(config=model.config), [], []
        logits = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1]
        for _ in range(max_new_tokens):
            steps.append(logits.float())
            tokens.append(int(logits.argmax()))
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True).logits[0, -1]
        full = model(input_ids=torch.tensor([ids + tokens]), use_cache=False).logits[0, len(ids) - 1: -1].float()
    step = torch.stack(steps)
    return {"max_abs_logit_diff": float((full - step).abs().max()), "positions": len(tokens),
            "argmax_differs": int((full.argmax(-1) != step.argmax(-1)).sum())}


def cell(values: list[float]) -> dict:
    """Mean, sample standard deviation (0 for one seed), min and max of one table cell's per-seed values."""
    return {"mean": round(statistics.fmean(values), 3),
            "sd": round(statistics.stdev(values), 3) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def summarise(runs: list[dict]) -> dict:
    """The 2 x 2 table from per-run rows: "<features>/<verifier>" -> linear and ddtree cells and whether every run of
    it was lossless (linear and DDTree)."""
    table = {}
    for features in PRECISIONS:
        for verifier in PRECISIONS:
            rows = [r for r in runs if r["features"] == features and r["verified_by"] == verifier]
            if rows:
                table[f"{features}/{verifier}"] = {
                    "linear": cell([r["linear_tau"] for r in rows]), "ddtree": cell([r["ddtree_tau"] for r in rows]),
                    "lossless": all(r["lossless"] and r["ddtree_lossless"] for r in rows)}
    return table


def table_lines(table: dict, budget: int) -> list[str]:
    """The table as printed (and pasted into bench/README.md and docs/training.md)."""
    lines = [f"| trained on \\ verified by | bf16 target: linear | bf16 target: DDTree {budget} | fp8 target: linear | "
             f"fp8 target: DDTree {budget} |", "|---|---|---|---|---|"]
    for features in PRECISIONS:
        cells = []
        for verifier in PRECISIONS:
            c = table.get(f"{features}/{verifier}")
            for kind in ("linear", "ddtree"):
                cells.append("-" if c is None else f"{c[kind]['mean']:.3f} ± {c[kind]['sd']:.3f}")
        lines.append(f"| {features} features | " + " | ".join(cells) + " |")
    flags = {k: v["lossless"] for k, v in table.items()}
    lines.append(f"lossless (every run, linear and DDTree): {'yes' if all(flags.values()) else flags}")
    return lines


def document(argv, seeds, shape, budget, min_features, fp8_count, noise, runs, wall_s) -> dict:
    """What --out holds: the command, the recipe, each run's figures and the table."""
    return {"command": "uv run python bench/fp8_acceptance.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{platform.machine()}, Python {platform.python_version()}",
            "recipe": {"config": "configs/demo-cpu.toml", **shape, "ddtree_budget": budget, "seeds": seeds,
                       "fp8_min_features": min_features, "fp8_linears": fp8_count.get("fp8", 0)},
            "shape_noise": noise, "runs": runs, "table": summarise(runs), "wall_s": round(wall_s, 1)}


def main(argv: list[str] | None = None) -> int:
    from dflash.commands import demo

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", default="0,1,2", help="train.seed of each pair of runs, comma-separated (default 0,1,2)")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "fp8-acceptance",
                   help="run dirs, one per seed and features (a finished one is reused); default runs/fp8-acceptance")
    p.add_argument("--fp8-min-features", type=int, default=1,
                   help="this process's fp8 size filter (default 1: every decoder linear; production: "
                   "dflash.config.FP8_MIN_FEATURES)")
    p.add_argument("--eval-prompts", type=int, default=demo.EVAL_PROMPTS, help="held-out prompts (default: the demo's)")
    p.add_argument("--quick", action="store_true", help="1 seed, 4 training steps on 16 short samples, 2 prompts")
    p.add_argument("--out", type=Path, help="write the per-run figures and the table here (JSON)")
    args = p.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",")][:1 if args.quick else None]
    except ValueError:
        p.error(f"--seeds {args.seeds!r}: give whole numbers separated by commas, e.g. 0,1,2")
    if args.out and not args.out.absolute().parent.is_dir():
        p.error(f"--out {args.out}: the folder {args.out.absolute().parent} does not exist; create it or write elsewhere")
    shape = QUICK if args.quick else {"prompts": demo.PROMPTS, "max_new_tokens": demo.MAX_NEW_TOKENS,
                                      "heldout": demo.HELDOUT_SAMPLES, "eval_prompts": args.eval_prompts,
                                      "eval_max_new_tokens": demo.EVAL_MAX_NEW_TOKENS, "overrides": {}}
    budget = demo.DDTREE_BUDGET

    demo.yielding_threads()  # beside other programs, torch's threads sleep while they wait: before torch loads
    from dflash.models import target_fp8
    from preflight.gate import apply_profile_env

    apply_profile_env("train-cu128", log=print)  # the demo config's profile, as dflash-train sets it
    target_fp8.MIN_FEATURES = args.fp8_min_features  # read at each load: this process only
    t0 = time.perf_counter()
    target, data, heldout = prepare_data(shape["prompts"], shape["max_new_tokens"], shape["heldout"])
    trained = {}
    for seed in seeds:
        for features in PRECISIONS:
            name = f"{features}-seed{seed}"
            print(f"\nfp8-acceptance: train {name} ({time.perf_counter() - t0:.0f} s)", flush=True)
            trained[name] = {"seed": seed, "features": features,
                             **train(target, data, heldout, args.work / name, seed, features, shape["overrides"])}
    runs, fp8_count, noise = [], {}, {}
    for seed, verifier in ((s, v) for s in seeds for v in PRECISIONS):  # a seed's 2 x 2 first: --out has it soonest
        print(f"\nfp8-acceptance: verify the seed {seed} drafters by the {verifier} target "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        drafters = {n: t["drafter"] for n, t in trained.items() if t["seed"] == seed}
        reports, noise[verifier] = verify(target, verifier, drafters, shape["eval_prompts"],
                                          shape["eval_max_new_tokens"], budget)
        for name, r in reports.items():
            (tree,) = r.ddtree
            fp8_count[verifier] = r.target_fp8_linears
            runs.append({"name": name, "seed": trained[name]["seed"], "features": trained[name]["features"],
                         "verified_by": verifier, "train_s": trained[name]["train_s"], "linear_tau": r.mean_accept_len,
                         "ddtree_tau": tree["mean_accept_len"], "lossless": r.lossless,
                         "ddtree_lossless": tree["lossless"], "verify_steps": r.verify_steps, "ddtree_rounds":
                         tree["rounds"], "new_tokens": r.new_tokens, "ties": len(r.ties) + len(tree["ties"]),
                         "mismatches": r.mismatches + tree["mismatches"]})
        if args.out:  # after each seed and target: an interrupted run keeps what it measured
            write_json(args.out, document(argv, seeds, shape, budget, args.fp8_min_features, fp8_count, noise, runs,
                                          time.perf_counter() - t0))
    table = summarise(runs)
    print(f"\nfp8 target: {fp8_count.get('fp8', 0)} decoder linears in e4m3 (filter lowered to "
          f"{args.fp8_min_features}); {len(seeds)} seeds; {len(runs)} evaluations in {time.perf_counter() - t0:.0f} s")
    for line in table_lines(table, budget):
        print(line)
    if args.out:
        write_json(args.out, document(argv, seeds, shape, budget, args.fp8_min_features, fp8_count, noise, runs,
                                      time.perf_counter() - t0))
    lossless = all(r["lossless"] and r["ddtree_lossless"] for r in runs)
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
