"""How fast a layout trains, from per-role busy rates (torch-free: dflash-estimate and the split summary share it).

A busy rate is a role's tokens per second per GPU while it works: a target's tokens over its compute time (its send
waits left out), a drafter's over its time not waiting for features. A split run measures both
(``dflash.train.features.RemoteTargets.rates``); the rules below turn them into the tokens per second of any layout:

    t, d = suggest_split(8, 12_500, 41_000)          # (6, 2): the split of 8 GPUs that trains fastest
    colocated_tok_s(12_500, 41_000)                  # one GPU running both roles in turn: about 9,580 tok/s
"""

from __future__ import annotations

SUMMARY_ROWS = 10  # the end-of-run summary averages the busy rates of this many last logged windows


def suggest_split(n_gpus: int, target_tok_s_per_gpu: float, drafter_tok_s_per_gpu: float) -> tuple[int, int]:
    """(targets, drafters) for n_gpus that train the most tokens per second: the t in 1..n-1 maximising
    split_tok_s(t, n - t, ...) (the fewest target GPUs on a tie). Give busy rates: a target's excluding its send
    waits, a drafter's excluding its receive waits, else the side that waits looks slower than it is."""
    if n_gpus < 2:
        raise ValueError(f"a split needs 2 GPUs or more, got {n_gpus}")
    if target_tok_s_per_gpu <= 0 or drafter_tok_s_per_gpu <= 0:
        return n_gpus // 2, n_gpus - n_gpus // 2
    targets = max(range(1, n_gpus), key=lambda t: (split_tok_s(t, n_gpus - t, target_tok_s_per_gpu,
                                                               drafter_tok_s_per_gpu), -t))
    return targets, n_gpus - targets


def split_tok_s(targets: int, drafters: int, target_tok_s_per_gpu: float, drafter_tok_s_per_gpu: float) -> float:
    """Tokens/s a split trains at when each side runs at its busy rate: the slower side sets the pace."""
    return min(targets * target_tok_s_per_gpu, drafters * drafter_tok_s_per_gpu)


def colocated_tok_s(target_tok_s_per_gpu: float, drafter_tok_s_per_gpu: float) -> float:
    """Tokens/s of one GPU running the target forward and the drafter step of each batch in turn: the two times add
    (1 / (1/T + 1/D)). Co-located data parallel over N GPUs is N times this, less DDP's gradient all-reduce."""
    if target_tok_s_per_gpu <= 0 or drafter_tok_s_per_gpu <= 0:
        return 0.0
    return 1 / (1 / target_tok_s_per_gpu + 1 / drafter_tok_s_per_gpu)


def after_first_window(rows: list[dict]) -> tuple[list[dict], int]:
    """(the metrics rows after a run's first logged window, the last step of that window): the window holds the first
    step, mostly compilation, so rates are read past it (as the run's own summary reads them)."""
    timed = [r for r in rows if "tok_per_s" in r]
    if not timed:
        return [], 0
    first = timed[0]["step"]
    return [r for r in rows if r["step"] > first], first


def busy_rates(rows: list[dict]) -> tuple[float, float, int] | None:
    """(target, drafter busy tok/s per GPU, windows averaged): the mean over the last SUMMARY_ROWS metrics rows that
    carry per-role rates (a split run's rows past its first logged window); None if none does."""
    rows = [r for r in rows if "target_tok_s_per_gpu" in r][-SUMMARY_ROWS:]
    if not rows:
        return None
    return (sum(r["target_tok_s_per_gpu"] for r in rows) / len(rows),
            sum(r["drafter_tok_s_per_gpu"] for r in rows) / len(rows), len(rows))


def suggested_splits(t_rate: float, d_rate: float, gpu_counts) -> list[tuple[int, int, int, float]]:
    """(GPUs, targets, drafters, expected tok/s) of the best split for each GPU count (2 or more), smallest first."""
    out = []
    for n in sorted({n for n in gpu_counts if n >= 2}):
        t, d = suggest_split(n, t_rate, d_rate)
        out.append((n, t, d, split_tok_s(t, d, t_rate, d_rate)))
    return out
