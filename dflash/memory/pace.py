"""How fast a layout trains, from per-role busy rates (torch-free: dflash-estimate and the split summary share it).

A busy rate is a role's tokens per second per GPU while it works: a target's tokens over its compute time (its send
waits left out), a drafter's over its time not waiting for features. A split run measures both
(``dflash.train.features.RemoteTargets.rates``); the rules below turn them into the tokens per second of any layout:

    t, d = suggest_split(8, 12_500, 41_000)          # (6, 2): the split of 8 GPUs that trains fastest
    colocated_tok_s(12_500, 41_000)                  # one GPU running both roles in turn: about 9,580 tok/s

The link between GPUs prices what a step must move (each GPU's bytes over its link's one-way bandwidth): a split's
features from target to drafter ranks, DDP's gradient all-reduce, FSDP2's parameter all-gathers and gradient
reduce-scatter. Communication is taken as overlapped with the drafter's compute, never with the target forward: a
batch takes target time + max(drafter time, communication time) on a co-located GPU; a split's target sends while it
computes its next batch (max of the two) and a drafter receives a step ahead (max of its compute and its receives
plus its all-reduce). docs/training.md ("The link between GPUs") says why.

    fsdp2_step_bytes(8, 1_730_000_000)              # 12.1e9 bytes each GPU sends per step (and receives)
    colocated_dp_tok_s(8, 12_550, 46_300, 49_152, 12.1e9, 50)   # ~79,000 tok/s: the 0.24 s hide under the drafter
"""

from __future__ import annotations

SUMMARY_ROWS = 10  # the end-of-run summary averages the busy rates of this many last logged windows
# PCIe Gen5 x16, one direction: 32 GT/s x 16 lanes x 128/130 (encoding) / 8 bits = 63.0 GB/s.
PCIE5_X16_GBPS = 32 * 16 * 128 / 130 / 8
# The default link, per GPU and direction: the users' PCIe Gen5 x16 as measured rather than as specified. GPU-to-GPU
# copies between RTX PRO 6000 Blackwell cards on Gen5 x16 measure ~53-56 GB/s within a NUMA node and ~39-51 GB/s
# across (CUDA p2pBandwidthLatencyTest, public reports of 8-GPU boxes); a ring over 8 GPUs crosses sockets, so 50.
DEFAULT_LINK_GBPS = 50.0
GB = 1e9  # link bandwidths are in GB/s (decimal), as links are specified


# How far apart two paces must be to call one faster: the rates they rest on move about this much within one run (the
# users' Qwen3.6-27B job co-located on one H200, lognormal lengths: 9,554 tok/s median against 9,107 mean over its
# steps, 4.7% apart; docs/results.md), so layouts closer than this are a tie.
RATE_NOISE = 0.05


def fastest(paces: list, noise: float = RATE_NOISE) -> tuple[object | None, list]:
    """(the fastest of `paces` (objects with tok_per_s), the others within `noise` of it: a tie); (None, []) for
    none."""
    if not paces:
        return None, []
    best = max(paces, key=lambda p: p.tok_per_s)
    return best, [p for p in paces if p is not best and p.tok_per_s >= (1 - noise) * best.tok_per_s]


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
    (1 / (1/T + 1/D)). Co-located data parallel over N GPUs is N times this when its communication hides under the
    drafter steps (colocated_dp_tok_s)."""
    if target_tok_s_per_gpu <= 0 or drafter_tok_s_per_gpu <= 0:
        return 0.0
    return 1 / (1 / target_tok_s_per_gpu + 1 / drafter_tok_s_per_gpu)


def ring_all_reduce_bytes(n_ranks: int, nbytes: float) -> float:
    """Bytes each rank sends (and receives) to all-reduce nbytes over a ring of n_ranks: 2 (N - 1) / N x nbytes."""
    return 2 * (n_ranks - 1) / n_ranks * nbytes if n_ranks > 1 else 0.0


def all_gather_bytes(n_ranks: int, nbytes: float) -> float:
    """Bytes each rank receives (and sends) to all-gather a tensor of nbytes whole, 1/N held by each: (N - 1) / N x
    nbytes. A reduce-scatter of nbytes moves the same."""
    return (n_ranks - 1) / n_ranks * nbytes if n_ranks > 1 else 0.0


def ddp_step_bytes(n_ranks: int, params: int) -> float:
    """Per rank and optimizer step, DDP's all-reduce of the fp32 gradients (once per step: the step's other batches
    run under no_sync)."""
    return ring_all_reduce_bytes(n_ranks, 4 * params)


def fsdp2_step_bytes(n_ranks: int, params: int, batches: int = 1) -> float:
    """Per rank and optimizer step, FSDP2 with bf16 parameters and fp32 gradient reduction: every batch all-gathers
    the bf16 parameters twice (forward, and again in backward after reshard_after_forward), the step's last batch
    reduce-scatters the fp32 gradients (gradient sync is off for the others)."""
    return batches * 2 * all_gather_bytes(n_ranks, 2 * params) + all_gather_bytes(n_ranks, 4 * params)


def link_seconds(nbytes: float, link_gbps: float) -> float:
    """Seconds nbytes take over a link of link_gbps GB/s in one direction."""
    return nbytes / (link_gbps * GB)


def colocated_dp_tok_s(n_ranks: int, target_tok_s_per_gpu: float, drafter_tok_s_per_gpu: float, batch_tokens: int,
                       step_bytes: float, link_gbps: float, batches: int = 1) -> float:
    """Tokens/s of co-located data parallel over n_ranks GPUs, each running `batches` batches of batch_tokens per
    optimizer step and moving step_bytes over its link: the target forwards run alone, the drafter steps beside the
    communication (target time + max(drafter time, link time))."""
    if target_tok_s_per_gpu <= 0 or drafter_tok_s_per_gpu <= 0:
        return 0.0
    tokens = batches * batch_tokens
    step_s = tokens / target_tok_s_per_gpu + max(tokens / drafter_tok_s_per_gpu, link_seconds(step_bytes, link_gbps))
    return n_ranks * tokens / step_s


def split_link_tok_s(targets: int, drafters: int, target_tok_s_per_gpu: float, drafter_tok_s_per_gpu: float,
                     batch_tokens: int, feature_bytes: float, link_gbps: float, batches: int = 1,
                     drafter_step_bytes: float = 0.0) -> float:
    """split_tok_s with each side slowed to what its link carries: a target sends feature_bytes per batch while it
    computes the next, a drafter receives them a step ahead while it trains, plus drafter_step_bytes (its DDP
    all-reduce) once per step of `batches` batches."""
    if target_tok_s_per_gpu <= 0 or drafter_tok_s_per_gpu <= 0:
        return 0.0
    t_batch = max(batch_tokens / target_tok_s_per_gpu, link_seconds(feature_bytes, link_gbps))
    d_batch = max(batch_tokens / drafter_tok_s_per_gpu,
                  link_seconds(feature_bytes + drafter_step_bytes / batches, link_gbps))
    return min(targets * batch_tokens / t_batch, drafters * batch_tokens / d_batch)


RECOMPUTE_MODES = ("off", "mlp", "layer")
# What a recomputed forward costs against its matmul FLOPs' share of the step: the 27B preset's drafter step, co-located
# and packed (49,152-token row, 512 anchors x block 32, fp8 target) on one H100 took 597.6 ms at recompute off, 664.4
# at mlp (+11.2%, where the FLOPs say +14.9%) and 684.5 at layer (+14.5%, the FLOPs +19.8%): 0.75 and 0.73 of the FLOP
# price (bench/results/h100_20261207f_recompute_q36.json). A recomputed forward runs with no backward kernels between.
RECOMPUTE_TIME_PER_FLOP = 0.74


def drafter_step_flops(cfg, shape, recompute: str = "off") -> float:
    """Matmul FLOPs of one drafter step on the memory model's worst-case batch (dflash.memory.parts.workload), for
    pricing recompute: each layer's forward is its projections (q and o over the queries, k and v over the context and
    the block), its attention (each query against half its row's context and its block: a packed row's sequences
    taken as token_budget / max_batch_size tokens) and its MLP; backward is twice the forward for the trained layers
    and the fc, once for the frozen lm_head (the gradient of its input only). Recompute adds the forward of what it
    rebuilds in backward: every layer's MLP (mlp) or every layer (layer)."""
    from dflash.memory.parts import workload
    from dflash.memory.shape import drafter_shape

    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute {recompute!r}: give one of {', '.join(RECOMPUTE_MODES)}")
    w, d = workload(cfg), drafter_shape(cfg, shape)
    h, q, kv = d.hidden, d.q_width, d.kv_width
    row = cfg.data.token_budget / max(1, cfg.data.max_batch_size) if cfg.data.packing else w.seq_len
    seen = row / 2 + cfg.drafter.block_size
    proj = 2 * (2 * w.queries * h * q + 2 * w.kv_tokens * h * kv)
    attention = 2 * 2 * w.queries * seen * q  # scores and the weighted sum
    mlp = 2 * 3 * w.queries * h * d.intermediate
    layer = proj + attention + mlp
    fc = 2 * w.tokens * w.feature_layers * h * h
    head = 2 * w.loss_tokens * h * d.vocab
    n = cfg.drafter.num_layers
    extra = {"off": 0.0, "mlp": n * mlp, "layer": n * layer}[recompute]
    return 3 * (n * layer + fc) + 2 * head + extra


def recompute_cost(cfg, shape, recompute: str, measured_at: str = "off") -> float:
    """How much longer a drafter step takes at `recompute` than at `measured_at` (the mode the busy rate was
    measured at): the step's matmul FLOPs (drafter_step_flops), what recompute adds priced at RECOMPUTE_TIME_PER_FLOP
    of its FLOPs (measured). A drafter's busy rate divides by it."""
    off = drafter_step_flops(cfg, shape, "off")

    def time(mode: str) -> float:
        return off + RECOMPUTE_TIME_PER_FLOP * (drafter_step_flops(cfg, shape, mode) - off)

    return time(recompute) / time(measured_at)


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
