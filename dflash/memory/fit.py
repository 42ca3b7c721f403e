"""The fit search: which settings (token_budget, max_batch_size, max_anchors) fit a GPU of a given size, per role.

    from dflash.memory.fit import estimate
    estimate(load_config("configs/qwen3-27b-5t3d.toml"), "12.8", 95 * 2**30).limits   # largest settings that fit
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Callable, Literal

from pydantic import BaseModel, Field

from dflash.config import MAX_TOKENS, GpuRole, RunConfig
from dflash.memory.parts import (
    DEFAULT_CALIBRATION,
    RECOMPUTE_MODES,
    Calibration,
    Workload,
    choose_parallel,
    choose_recompute,
    drafter_params,
    fits_gpu,
    headroom_bytes,
    parallel_mode,
    parallel_tries,
    recompute_mode,
    recompute_trials,
    role_parts,
    sent_features_bytes,
    with_parallel,
    with_recompute,
    workload,
)
from dflash.memory.shape import GiB, MemoryModelError, TargetShape, load_target_shape

# --------------------------------------------------------------------------- estimate + limits


class Row(BaseModel):
    component: str
    bytes: int


class RoleEstimate(BaseModel):
    role: GpuRole
    gpus: list[str] = Field(description="GPUs of this role (empty: the one co-located device)")
    rows: list[Row]
    total_bytes: int
    gpu_bytes: int | None
    headroom_bytes: int | None = Field(description="gpu_bytes - total_bytes; below keep_bytes: does not fit")
    keep_bytes: int = Field(0, description="what the run keeps free beyond its peak (train.memory_headroom_gib)")
    fits: bool | None
    data_parallel: str = Field("none", description="how this role's drafter ranks hold the drafter: none, ddp or fsdp2")


Setting = Literal["token_budget", "max_batch_size", "max_anchors", "batch_anchors"]
LimitStatus = Literal["fits", "none_fit", "unbounded", "no_effect"]


class Limit(BaseModel):
    role: GpuRole
    setting: Setting
    configured: int | None = Field(description="the config's value (None: unset, batch_anchors uncapped)")
    value: int | None = Field(description="largest value that fits, the others as configured")
    status: LimitStatus
    note: str


class LayoutFit(BaseModel):
    layout: str = Field(description="colocated, colocated-dp (DDP), colocated-fsdp2 or split")
    gpus: int = Field(description="GPUs the layout uses")
    description: str
    need_bytes: dict[str, int] = Field(description="per role of the layout: bytes one GPU needs at its peak")
    recompute: dict[str, str] = Field(description="per role: the recompute mode the need is for")
    fits: bool | None = Field(description="every role fits gpu_bytes (None: no GPU size given)")
    split: tuple[int, int] | None = Field(None, description="a split's (target GPUs, drafter GPUs)")
    data_parallel: str = Field("none", description="how the drafter's ranks hold it: none (one rank), ddp or fsdp2")


class LayoutPace(BaseModel):
    layout: str = Field(description="colocated, colocated-dp, colocated-fsdp2 or split, as in layouts")
    gpus: int
    description: str
    tok_per_s: float = Field(description="tokens/s at the given busy rates, the link's communication counted "
                                         "(overlapped with the drafter's compute: dflash.memory.pace)")
    fits: bool | None
    link_bytes: float = Field(0.0, description="bytes the busiest GPU moves over its link per optimizer step, one "
                                               "direction (a split: a drafter's received features + its all-reduce)")
    link_s: float = Field(0.0, description="link_bytes at the link's bandwidth, seconds")
    recompute: str = Field("off", description="the drafter's recompute mode in this layout (LayoutFit.recompute)")
    drafter_tok_s: float = Field(0.0, description="the drafter busy rate priced at that recompute: the given rate "
                                                  "over dflash.memory.pace.recompute_cost")


class Estimate(BaseModel):
    config: str = Field(description="run config the estimate is for")
    target: str = Field(description="target architecture summary")
    cuda: str
    gpu_bytes: int | None
    workload: Workload
    assumption: str
    roles: list[RoleEstimate]
    limits: list[Limit]
    layouts: list[LayoutFit] = Field(default_factory=list, description="which layouts of this run fit gpu_bytes")
    rates: dict[str, float] | None = Field(None, description="busy tok/s per GPU of each role the pace is for")
    recompute_cost: dict[str, float] = Field(default_factory=dict, description="per recompute mode, a drafter step's "
                                             "time relative to rates_recompute (dflash.memory.pace.recompute_cost)")
    pace: list[LayoutPace] = Field(default_factory=list, description="each layout's tokens/s at those rates")
    link_gbps: float | None = Field(None, description="GB/s one way per GPU the pace prices communication at")
    rates_recompute: str | None = Field(None, description="the recompute the drafter's busy rate was measured at")
    decisions: list[str] = Field(default_factory=list, description="each auto choice (train.data_parallel, "
                                 "train.recompute) with the numbers that made it")
    gpu_source: str = Field("", description="how the GPU size was given (its unit named)")
    warnings: list[str] = Field(default_factory=list, description="what the input may not mean as read")
    calibration: dict
    overhead: str | None = Field(None, description="where the memory outside torch came from: the probe's measurement "
                                 "on this machine (dflash-estimate --probe), or why the calibrated constant stands")


_SETTINGS: dict[Setting, tuple[str, str]] = {
    "token_budget": ("data", "token_budget"),
    "max_batch_size": ("data", "max_batch_size"),
    "max_anchors": ("train", "max_anchors"),
    "batch_anchors": ("train", "batch_anchors"),
}


def with_setting(cfg: RunConfig, setting: Setting, value: int | None) -> RunConfig:
    section, key = _SETTINGS[setting]
    new = cfg.model_copy(deep=True)
    setattr(getattr(new, section), key, value)
    return new


def largest_fitting(fits: Callable[[int], bool], lo: int, cap: int) -> tuple[int | None, bool]:
    """Largest v in [lo, cap] with fits(v), for monotone fits; (None, _) if fits(lo) fails.

    Returns (value, reached_cap). Doubling search, then bisection.
    """
    if not fits(lo):
        return None, False
    good = lo
    while True:
        probe = min(cap, max(good * 2, good + 1))
        if probe == good:
            return good, True
        if not fits(probe):
            bad = probe
            break
        good = probe
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good, False


def _limit(cfg: RunConfig, shape: TargetShape, role: GpuRole, setting: Setting, cuda: str, gpu: int, cal: Calibration,
           auto_recompute: bool = False) -> Limit:
    """The largest value of `setting` that fits `role` on a GPU of `gpu` bytes, the others as configured. With
    auto_recompute (train.recompute = auto) each mode is searched and the note says up to where each one fits."""
    section, key = _SETTINGS[setting]
    configured = getattr(getattr(cfg, section), key)
    if role == "target" and setting != "token_budget":
        return Limit(role=role, setting=setting, configured=configured, value=None, status="no_effect",
                     note="the target forward does not depend on it")
    bs = cfg.drafter.block_size
    if setting == "token_budget":
        lo, cap = max(16, bs), MAX_TOKENS  # the run config refuses more
    elif setting == "max_batch_size":
        lo, cap = 1, max(1, cfg.data.token_budget // bs)
    elif setting == "max_anchors":
        lo, cap = 1, max(1, cfg.data.token_budget - 1)  # a row never has more eligible anchors
    else:
        lo, cap = 1, max(1, workload(with_setting(cfg, setting, None)).valid_anchors)  # more caps nothing

    def search(mode: str | None) -> tuple[int | None, bool]:
        base = cfg if mode is None else with_recompute(cfg, mode)
        return largest_fitting(lambda v: fits_gpu(cfg, sum(p.bytes for p in role_parts(
            with_setting(base, setting, v), shape, role, cuda, cal)), gpu), lo, cap)

    modes = RECOMPUTE_MODES if auto_recompute and role != "target" else (None,)
    found = {mode: search(mode) for mode in modes}
    value, at_cap = max(found.values(), key=lambda f: (f[0] is not None, f[0] or 0, f[1]))
    by_mode = ""
    if len(modes) > 1:  # where auto moves from one mode to the next
        by_mode = "; recompute auto: " + ", ".join(
            f"{m} {'none' if v is None else ('any' if top else f'up to {v:,}')}" for m, (v, top) in found.items())
    if value is None:
        note = f"even {setting} = {lo} does not fit; lower another setting or use more GPU memory"
        return Limit(role=role, setting=setting, configured=configured, value=None, status="none_fit", note=note)
    if at_cap:
        note = {
            "max_batch_size": f"every value fits: a batch holds at most token_budget // block_size = {cap} sequences",
            "max_anchors": f"every value fits: a row of token_budget tokens has at most {cap} eligible anchors",
            "batch_anchors": f"every value fits: the batch has at most {cap} eligible anchors uncapped",
        }.get(setting, "fits at any value tried")
        return Limit(role=role, setting=setting, configured=configured, value=value, status="unbounded",
                     note=note + by_mode)
    if configured is None:  # batch_anchors unset: the batch's whole anchors, more than the largest that fits
        verdict = f"unset (uncapped: {cap} anchors) does NOT fit"
    else:
        verdict = "configured value fits" if configured <= value else "configured value does NOT fit"
    return Limit(role=role, setting=setting, configured=configured, value=value, status="fits", note=verdict + by_mode)


def role_gpus(cfg: RunConfig, role: GpuRole) -> list[str]:
    """The config's GPUs of `role` ([] for the one device of a one-device run, which the config does not name)."""
    topo = cfg.topology
    return [] if topo.layout == "colocated" else [g for g, r in topo.gpu_roles.items() if r == role]


LAYOUT_GPUS = 8  # GPUs assumed for co-located data parallel when the config names none (the users' boxes)


def with_topology(cfg: RunConfig, target: int = 0, drafter: int = 0, colocated: int = 0) -> RunConfig:
    """cfg with a topology of that many GPUs (named 0..n-1): the layout's shape, not real GPU names."""
    names = [str(i) for i in range(target + drafter + colocated)]
    topo = cfg.topology.model_copy(update={"target_gpus": names[:target], "drafter_gpus": names[target:target + drafter],
                                           "colocated_gpus": names[:colocated]})  # a what-if: [eval] etc. not re-judged
    return cfg.model_copy(update={"topology": topo})


def layout_fits(cfg: RunConfig, shape: TargetShape, cuda: str, gpu_bytes: int | None,
                cal: Calibration = DEFAULT_CALIBRATION) -> list[LayoutFit]:
    """Co-located on one GPU, co-located data parallel over N GPUs with DDP and with FSDP2, and a split run, each
    judged on gpu_bytes.

    N and the split are the config's own when it names them, else N = LAYOUT_GPUS and 1 target + 1 drafter. A DDP
    rank's memory does not depend on N (beyond 1 vs several ranks); an FSDP2 rank holds 1/N of the drafter's state."""
    topo = cfg.topology
    n = len(topo.colocated_gpus) or len(topo.target_gpus) + len(topo.drafter_gpus) or LAYOUT_GPUS
    t, d = (len(topo.target_gpus), len(topo.drafter_gpus)) if topo.target_gpus else (1, 1)
    dp = with_topology(cfg, colocated=n)
    cases = [("colocated", 1, "co-located: target + drafter on 1 GPU", with_topology(cfg)),
             ("colocated-dp", n, f"co-located data parallel over {n} GPUs: each target + drafter replica, "
              "DDP gradients", with_parallel(dp, "ddp")),
             ("colocated-fsdp2", n, f"co-located data parallel over {n} GPUs: each target + 1/{n} of the drafter, "
              "FSDP2", with_parallel(dp, "fsdp2")),
             ("split", t + d, f"split: {t} target + {d} drafter GPUs", with_topology(cfg, target=t, drafter=d))]
    out = []
    for layout, gpus, text, case in cases:
        need, modes, fits = _judge(case, cfg.train.recompute, shape, cuda, gpu_bytes, cal)
        out.append(LayoutFit(layout=layout, gpus=gpus, description=text, need_bytes=need, recompute=modes, fits=fits,
                             split=(t, d) if layout == "split" else None, data_parallel=parallel_mode(case)))
    return out


def _judge(case: RunConfig, recompute: str, shape: TargetShape, cuda: str, gpu_bytes: int | None,
           cal: Calibration) -> tuple[dict[str, int], dict[str, str], bool | None]:
    """(bytes per role, recompute mode per role, whether every role fits gpu_bytes) of one layout's config."""
    need, modes = {}, {}
    for role in case.topology.roles:
        mode = recompute
        if role == "target":
            mode = "off" if mode == "auto" else mode
        elif mode == "auto" and gpu_bytes is not None:
            mode, _ = choose_recompute(case, role, cuda, gpu_bytes, cal, shape)
        elif mode == "auto":
            mode = "off"
        need[role] = sum(p.bytes for p in role_parts(with_recompute(case, mode), shape, role, cuda, cal))
        modes[role] = mode
    return need, modes, None if gpu_bytes is None else all(fits_gpu(case, v, gpu_bytes) for v in need.values())


def layout_pace(cfg: RunConfig, shape: TargetShape, cuda: str, gpu_bytes: int | None, layouts: list[LayoutFit],
                target_tok_s: float, drafter_tok_s: float, cal: Calibration = DEFAULT_CALIBRATION,
                link_gbps: float | None = None, rates_recompute: str = "off") -> list[LayoutPace]:
    """The tokens/s of each layout at the given busy rates (``dflash.memory.pace``), each step's communication priced
    at link_gbps (GB/s one way per GPU; default the users' PCIe Gen5 x16, pace.DEFAULT_LINK_GBPS), plus the best split
    of the data-parallel layout's GPU count when the config does not name it (its memory judged as a layout's is).
    The drafter rate was measured at rates_recompute; each layout's drafter runs at the recompute it resolves to,
    priced as the extra forward work of what it recomputes (pace.recompute_cost)."""
    from dflash.memory.pace import (
        DEFAULT_LINK_GBPS,
        colocated_dp_tok_s,
        colocated_tok_s,
        ddp_step_bytes,
        fsdp2_step_bytes,
        link_seconds,
        recompute_cost,
        split_link_tok_s,
        suggest_split,
    )

    link = DEFAULT_LINK_GBPS if link_gbps is None else link_gbps
    tokens, batches = cfg.data.token_budget, cfg.train.grad_accum
    p = drafter_params(cfg, shape)
    feats = sent_features_bytes(cfg, shape)

    def drafter_at(mode: str) -> float:
        return drafter_tok_s / recompute_cost(cfg, shape, mode, rates_recompute)

    def split_pace(t: int, d: int, text: str, fits: bool | None, mode: str) -> LayoutPace:
        ar = ddp_step_bytes(d, p)
        moved = batches * feats + ar
        rate = drafter_at(mode)
        return LayoutPace(layout="split", gpus=t + d, description=text, fits=fits, link_bytes=moved,
                          link_s=link_seconds(moved, link), recompute=mode, drafter_tok_s=rate,
                          tok_per_s=split_link_tok_s(t, d, target_tok_s, rate, tokens, feats, link, batches, ar))

    names = {"colocated": "co-located", "colocated-dp": "co-located data parallel, DDP",
             "colocated-fsdp2": "co-located data parallel, FSDP2"}
    out, splits = [], set()
    for lay in layouts:
        mode = lay.recompute.get("drafter", lay.recompute.get("colocated", "off"))
        rate = drafter_at(mode)
        if lay.layout == "split":
            t, d = lay.split
            splits.add((t, d))
            out.append(split_pace(t, d, f"split {t} target + {d} drafter", lay.fits, mode))
        elif lay.layout == "colocated":
            out.append(LayoutPace(layout=lay.layout, gpus=1, description=names[lay.layout], fits=lay.fits,
                                  tok_per_s=colocated_tok_s(target_tok_s, rate), recompute=mode, drafter_tok_s=rate))
        else:
            moved = (fsdp2_step_bytes(lay.gpus, p, batches) if lay.data_parallel == "fsdp2"
                     else ddp_step_bytes(lay.gpus, p))
            out.append(LayoutPace(layout=lay.layout, gpus=lay.gpus, description=names[lay.layout], fits=lay.fits,
                                  link_bytes=moved, link_s=link_seconds(moved, link), recompute=mode,
                                  drafter_tok_s=rate,
                                  tok_per_s=colocated_dp_tok_s(lay.gpus, target_tok_s, rate, tokens, moved,
                                                               link, batches)))
    n = max(lay.gpus for lay in layouts)
    if n >= 2:
        t, d = suggest_split(n, target_tok_s, drafter_tok_s)
        if (t, d) not in splits:
            _, modes, fits = _judge(with_topology(cfg, target=t, drafter=d), cfg.train.recompute, shape, cuda,
                                    gpu_bytes, cal)
            out.append(split_pace(t, d, f"split {t} target + {d} drafter (the best split of {n} GPUs)", fits,
                                  modes.get("drafter", "off")))
    return out


def _resolve_auto(cfg: RunConfig, shape: TargetShape, cuda: str, gpu_bytes: int | None,
                  cal: Calibration) -> tuple[RunConfig, str]:
    """train.recompute and train.data_parallel = auto as the trainer resolves them on a GPU of gpu_bytes
    (choose_parallel; recompute off and DDP when no size is given)."""
    auto_dp = cfg.train.data_parallel == "auto" and cfg.topology.layout == "colocated-dp"
    if cfg.train.recompute != "auto" and not auto_dp:
        dp = f", data_parallel {parallel_mode(cfg)}" if cfg.topology.layout == "colocated-dp" else ""
        return cfg, f"recompute {cfg.train.recompute}{dp}"
    if gpu_bytes is None:
        note = "recompute auto -> off" if cfg.train.recompute == "auto" else f"recompute {cfg.train.recompute}"
        note += "; data_parallel auto -> ddp" if auto_dp else ""
        return with_recompute(cfg, recompute_of(cfg)), note + " (give a GPU size to let it choose)"
    dp, mode, need = choose_parallel(cfg, cfg.topology.trainer_role, cuda, gpu_bytes, cal, shape)
    note = (f"recompute auto -> {mode}" if cfg.train.recompute == "auto" else f"recompute {mode}")
    if cfg.topology.layout == "colocated-dp":
        note += f", data_parallel auto -> {dp}" if auto_dp else f", data_parallel {dp}"
    why = (f"the fastest mode that fits {gpu_bytes / GiB:.2f} GiB" if fits_gpu(cfg, need, gpu_bytes) else
           f"nothing fits {gpu_bytes / GiB:.2f} GiB: the least memory shown")
    return with_recompute(with_parallel(cfg, dp), mode), f"{note} ({why})"


def _g(n: int) -> str:
    return f"{n / GiB:.2f}"


def auto_decisions(cfg: RunConfig, shape: TargetShape, cuda: str, gpu_bytes: int | None,
                   cal: Calibration = DEFAULT_CALIBRATION) -> list[str]:
    """Each auto choice the trainer makes for the GPU that trains the drafter (train.data_parallel, train.recompute),
    with the numbers that made it: every mode tried, in the order choose_parallel and choose_recompute try them, its
    peak, what is kept free and the GPU (the one fit rule, fits_gpu). [] without a GPU size or an auto choice."""
    auto_rc = cfg.train.recompute == "auto" and cfg.device == "cuda"
    tries = parallel_tries(cfg)
    auto_dp = len(tries) > 1
    if gpu_bytes is None or not (auto_rc or auto_dp):
        return []
    role, keep = cfg.topology.trainer_role, headroom_bytes(cfg)

    def trials(case: RunConfig) -> list[tuple[str, int, bool]]:
        if not auto_rc:
            mode = recompute_mode(case)
            need = sum(p.bytes for p in role_parts(with_recompute(case, mode), shape, role, cuda, cal))
            return [(mode, need, fits_gpu(case, need, gpu_bytes))]
        out = []
        for trial in recompute_trials(case, role, cuda, gpu_bytes, cal, shape):
            out.append(trial)
            if trial[2]:
                break
        return out

    def chain(ts: list[tuple[str, int, bool]]) -> str:
        return " -> ".join(f"{mode} {_g(need)} + {_g(keep)} kept free {'<=' if fits else '>'} {_g(gpu_bytes)}"
                           for mode, need, fits in ts)

    lines, refused = [], []
    for i, dp in enumerate(tries):
        ts = trials(with_parallel(cfg, dp))
        fits = ts[-1][2]
        if not fits and i < len(tries) - 1:
            refused.append(f"{dp} does not fit at {'any recompute' if auto_rc else f'recompute {ts[-1][0]}'} "
                           f"({chain(ts)})")
            continue
        if auto_dp:
            lines.append(f"data_parallel auto -> {dp}: " + ("; ".join(refused) if refused else f"{dp} is tried first"))
        where = f" ({dp})" if auto_dp else ""
        if not fits:
            lines.append(f"recompute{' auto' if auto_rc else ''}{where}: {chain(ts)}: nothing fits {_g(gpu_bytes)} "
                         "GiB; lower data.token_budget, train.batch_anchors or max_batch_size, or use larger GPUs")
        elif auto_rc:
            lines.append(f"recompute auto -> {ts[-1][0]}{where}: {chain(ts)}")
        break
    return lines


def recompute_of(cfg: RunConfig) -> str:
    return "off" if cfg.train.recompute == "auto" else cfg.train.recompute


def estimate(
    cfg: RunConfig,
    cuda: str,
    gpu_bytes: int | None,
    cal: Calibration = DEFAULT_CALIBRATION,
    source: str = "",
    rates: tuple[float, float] | None = None,
    link_gbps: float | None = None,
    rates_recompute: str = "off",
) -> Estimate:
    """Per-role component table, totals, headroom and the largest settings that fit; with `rates` (busy tok/s per GPU
    of a target and a drafter, the drafter's measured at recompute `rates_recompute`) each layout's pace, its
    communication priced at link_gbps (GB/s one way per GPU; default pace.DEFAULT_LINK_GBPS, the users' PCIe Gen5 x16),
    and each auto choice with its numbers (auto_decisions)."""
    from dflash.memory.pace import DEFAULT_LINK_GBPS

    if link_gbps is not None and not (0 < link_gbps < float("inf")):
        raise MemoryModelError(f"link bandwidth must be a positive number of GB/s, got {link_gbps}")
    link = DEFAULT_LINK_GBPS if link_gbps is None else link_gbps
    if gpu_bytes is not None and gpu_bytes <= 0:
        raise MemoryModelError(f"GPU memory must be positive, got {gpu_bytes} bytes")
    if rates_recompute not in ("off", "mlp", "layer"):
        raise MemoryModelError(f"the rates' recompute must be off, mlp or layer (the mode they were measured at), "
                               f"got {rates_recompute!r}")
    cal.context_bytes(cuda)  # unknown CUDA major: fail before any work
    shape = load_target_shape(cfg.target.path)
    original = cfg
    cfg, recompute_note = _resolve_auto(cfg, shape, cuda, gpu_bytes, cal)
    w = workload(cfg)
    role_list = cfg.topology.roles
    out: list[RoleEstimate] = []
    for role in role_list:
        parts = role_parts(cfg, shape, role, cuda, cal)
        total = sum(p.bytes for p in parts)
        headroom = None if gpu_bytes is None else gpu_bytes - total
        out.append(RoleEstimate(
            role=role, gpus=role_gpus(cfg, role), rows=[Row(component=p.component, bytes=p.bytes) for p in parts],
            total_bytes=total, gpu_bytes=gpu_bytes, headroom_bytes=headroom, keep_bytes=headroom_bytes(cfg),
            fits=None if gpu_bytes is None else fits_gpu(cfg, total, gpu_bytes), data_parallel="none" if role == "target" else parallel_mode(cfg),
        ))
    limits = []
    if gpu_bytes is not None:
        auto = original.train.recompute == "auto" and original.device == "cuda"
        for role in role_list:
            for setting in _SETTINGS:
                limits.append(_limit(cfg, shape, role, setting, cuda, gpu_bytes, cal, auto))
    target = (f"{shape.model_type or 'decoder'} {shape.num_layers} layers, hidden {shape.hidden}, "
              f"intermediate {shape.intermediate}, {shape.heads}/{shape.kv_heads} heads x {shape.head_dim}, "
              f"vocab {shape.vocab}{', tied' if shape.tied else ''}; {shape.params / 1e9:.2f} B params in {cfg.target.dtype}")
    assumption = (
        f"worst case: one packed row of {w.tokens} tokens (data.packing: its sequences end to end); {w.valid_anchors} "
        f"anchors over the row (batch_anchors {cfg.train.batch_anchors}, else max_anchors {cfg.train.max_anchors} a "
        f"sequence, at most {w.tokens - 1}) x block {cfg.drafter.block_size} = {w.queries} queries, {w.loss_tokens} "
        f"through the lm_head; {recompute_note}"
    ) if cfg.data.packing else (
        f"worst case: {w.sequences} sequences x {w.seq_len} tokens (padded) <= token_budget {w.tokens} "
        f"(max_batch_size {cfg.data.max_batch_size}, sequences shorter than block {cfg.drafter.block_size} ignored); "
        f"{w.anchors_per_seq} anchors (max_anchors {cfg.train.max_anchors}, at most seq_len - 1"
        f"{f', batch_anchors {cfg.train.batch_anchors} over the batch, rows padded to the largest' if cfg.train.batch_anchors else ''}"
        f") x block {cfg.drafter.block_size} = {w.queries_per_seq} queries per sequence, {w.queries} in the batch, "
        f"{w.loss_tokens} through the lm_head; {recompute_note}"
    )
    layouts = layout_fits(original, shape, cuda, gpu_bytes, cal)
    pace = layout_pace(original, shape, cuda, gpu_bytes, layouts, *rates, cal, link, rates_recompute) if rates else []
    from dflash.memory.pace import RECOMPUTE_MODES, recompute_cost

    costs = {m: recompute_cost(original, shape, m, rates_recompute) for m in RECOMPUTE_MODES} if rates else {}
    return Estimate(config=source, target=target, cuda=cuda, gpu_bytes=gpu_bytes, workload=w, assumption=assumption,
                    roles=out, limits=limits, calibration=asdict(cal), layouts=layouts,
                    rates={"target": rates[0], "drafter": rates[1]} if rates else None, pace=pace,
                    link_gbps=link if rates else None, rates_recompute=rates_recompute if rates else None,
                    recompute_cost=costs, decisions=auto_decisions(original, shape, cuda, gpu_bytes, cal))
