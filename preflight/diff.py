"""What differs between two runs' snapshots, the ones known to move memory or speed first.

    from preflight.diff import compare
    d = compare(a_snapshot, b_snapshot, a_outcome, b_outcome)
    d.differences      # [Difference(group="config", text="train.max_anchors 1024 -> 768", moves="memory",
                       #             effect="memory model: drafter peak -9.10 GiB"), ...]
    d.exit_code        # 0: nothing that matters differs, 1: something does

Pure functions of two snapshots (``dflash.runs.records`` owns their layout); the memory model
(``dflash.memory``) predicts both configs' peaks per role, and the effect of each single change
that it depends on, with B's value put into A's run. `dflash-diff` (``dflash.commands.diff``) only prints.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

GROUPS = ("environment", "gpus", "code", "compile cache", "config", "data", "run")
# Config fields that move speed though the memory model does not see them (or only sometimes).
SPEED_FIELDS = {"train.compile", "train.recompute", "train.grad_accum", "train.cache_features", "data.num_buckets",
                "data.pack_remainders", "data.packing", "data.token_budget", "data.max_batch_size", "train.max_anchors",
                "train.batch_anchors", "train.loss_chunk", "drafter.num_layers", "drafter.block_size", "target.dtype",
                "target.precision", "topology.target_gpus",
                "topology.drafter_gpus", "topology.colocated_gpus", "topology.queue_depth", "device"}
# Environment variables by what they move.
MEMORY_ENV = ("PYTORCH_CUDA_ALLOC_CONF",)
SPEED_ENV = ("CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "LD_PRELOAD", "OMP_NUM_THREADS", "CUDA_LAUNCH_BLOCKING",
             "CUDA_MODULE_LOADING", "CUDA_DEVICE_MAX_CONNECTIONS")
SPEED_ENV_PREFIXES = ("NCCL_", "TORCH_", "TORCHINDUCTOR_", "TRITON_", "PYTORCH_")
FREE_MEMORY_TOLERANCE = 1 << 30  # free GPU memory at start that differs by less is noise
GiB, MiB = 1 << 30, 1 << 20


@dataclass
class Difference:
    group: str  # one of GROUPS
    key: str  # what differs: a distribution, a variable, a config field, a file
    a: Any
    b: Any
    text: str  # one line: "train.max_anchors 1024 -> 768"
    moves: str | None = None  # "memory", "speed" or "memory, speed": known to move them (listed first)
    effect: str | None = None  # the memory model's predicted effect of this change alone
    counts: bool = True  # False: shown for context only (a path whose content is the same)


@dataclass
class OutcomeRow:
    label: str
    a: Any
    b: Any
    text: str


@dataclass
class RunDiff:
    differences: list[Difference] = field(default_factory=list)
    memory: list[str] = field(default_factory=list)  # the memory model's peak per role, A -> B
    outcome: list[OutcomeRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def counted(self) -> list[Difference]:
        return [d for d in self.differences if d.counts]

    @property
    def exit_code(self) -> int:
        return 1 if self.counted else 0

    def to_dict(self) -> dict:
        return {"differences": [asdict(d) for d in self.differences], "memory": self.memory,
                "outcome": [asdict(o) for o in self.outcome], "notes": self.notes,
                "relevant": sum(1 for d in self.counted if d.moves), "counted": len(self.counted),
                "exit_code": self.exit_code}


# ---------------------------------------------------------------- the memory model on two snapshots


@dataclass
class _Model:
    """What the memory model needs from one snapshot."""

    cfg: Any  # RunConfig
    shape: Any  # TargetShape
    cuda: str
    expandable: bool
    recompute: dict[str, str]
    data_parallel: dict[str, str] = field(default_factory=dict)  # per role, as resolved (older snapshots: none)
    overhead: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # per GPU role: measured (context, NCCL)


def _model(snap: dict) -> _Model | None:
    from dflash.config import config_from_dict
    from dflash.errors import DflashError
    from dflash.memory.shape import TargetShape

    mem, shape = snap.get("memory") or {}, (snap.get("target") or {}).get("shape")
    if not shape or not mem.get("cuda"):
        return None
    try:
        cfg = config_from_dict(snap["config"], source="snapshot config")
        known = {k: v for k, v in shape.items() if v is not None}  # an older snapshot's shape: its fields' defaults
        measured: dict[str, tuple[int, int | None]] = {}
        for o in (mem.get("overhead") or {}).values():
            if o.get("context_bytes") is None:
                continue
            for role in o.get("roles") or []:
                if o["context_bytes"] + (o.get("nccl_bytes") or 0) > sum(x or 0 for x in measured.get(role, (-1, 0))):
                    measured[role] = (int(o["context_bytes"]), o.get("nccl_bytes"))
        return _Model(cfg, TargetShape(**known), str(mem["cuda"]), bool(mem.get("expandable_segments", True)),
                      {r: v.get("recompute") for r, v in (mem.get("roles") or {}).items()},
                      {r: v["data_parallel"] for r, v in (mem.get("roles") or {}).items() if v.get("data_parallel")},
                      measured)
    except (DflashError, TypeError, ValueError):
        return None  # a snapshot of another version's config or shape: no prediction


def _peaks(m: _Model, cfg=None, cuda: str | None = None, expandable: bool | None = None) -> dict[str, int] | None:
    from dflash.errors import DflashError
    from dflash.memory.parts import (
        DEFAULT_CALIBRATION,
        recompute_mode,
        role_parts,
        with_measured_overhead,
        with_parallel,
        with_recompute,
    )

    cfg = cfg or m.cfg
    resolved = cfg.train.recompute == m.cfg.train.recompute  # else a what-if of train.recompute itself
    dp_resolved = cfg.train.data_parallel == m.cfg.train.data_parallel  # ... or of train.data_parallel
    out = {}
    try:
        for role in cfg.topology.roles:
            mode = (m.recompute.get(role) if resolved else None) or recompute_mode(cfg)
            dp = (m.data_parallel.get(role) if dp_resolved else None) or "none"
            cal, measured = DEFAULT_CALIBRATION, m.overhead.get("drafter" if role == "colocated" else role)
            if measured is not None and (cuda is None or cuda == m.cuda):  # what the probe measured on that machine
                cal = with_measured_overhead(cal, m.cuda, *measured)
            parts = role_parts(with_recompute(with_parallel(cfg, dp), mode), m.shape, role, cuda or m.cuda, cal,
                               expandable=m.expandable if expandable is None else expandable)
            out[role] = sum(p.bytes for p in parts)
    except (DflashError, ValueError, TypeError, ArithmeticError):  # a shape no real target has (0 heads, 2^63 layers)
        return None
    return out


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB // 10 else f"{n / MiB:.1f} MiB"


def _signed(n: int) -> str:
    return ("+" if n >= 0 else "-") + _size(abs(n))


def _effect(before: dict | None, after: dict | None, per_gpu: bool = False) -> str | None:
    """'memory model: drafter peak -9.10 GiB, target peak +0.2 GiB' (roles both predict, nonzero changes only)."""
    if not before or not after:
        return None
    deltas = [(r, after[r] - before[r]) for r in before if r in after and after[r] != before[r]]
    if not deltas:
        return None
    if per_gpu and len({d for _, d in deltas}) == 1:
        return f"memory model: {_signed(deltas[0][1])} per GPU"
    return "memory model: " + ", ".join(f"{r} peak {_signed(d)}" for r, d in deltas)


def _with(cfg, dotted: str, value):
    from dflash.config import config_from_dict
    from dflash.errors import DflashError

    try:
        return config_from_dict(cfg.model_dump(mode="json"), {dotted: value}, source="what-if")
    except DflashError:
        return None


# ---------------------------------------------------------------- the groups


def _get(snap: dict, *keys, default=None):
    node = snap
    for k in keys:
        if not isinstance(node, dict):
            return default
        node = node.get(k)
    return default if node is None else node


def _environment(a: dict, b: dict, ma: _Model | None, mb: _Model | None) -> list[Difference]:
    from preflight.lockfile import is_gpu_stack

    out = []
    ta, tb = _get(a, "environment", "torch") or {}, _get(b, "environment", "torch") or {}
    if (ta.get("version"), ta.get("cuda")) != (tb.get("version"), tb.get("cuda")):
        effect = None
        if ma and ta.get("cuda") != tb.get("cuda") and tb.get("cuda") and not (ma.overhead and mb and mb.overhead):
            effect = _effect(_peaks(ma), _peaks(ma, cuda=tb["cuda"]), per_gpu=True)
            effect = effect and effect.replace("memory model: ", "memory model: CUDA context ")
        out.append(Difference("environment", "torch", ta, tb, f"torch {_build(ta)} -> {_build(tb)}", "memory, speed",
                              effect))
    da, db = _get(a, "environment", "distributions", default={}), _get(b, "environment", "distributions", default={})
    for name in sorted(set(da) | set(db)):
        va, vb = da.get(name), db.get(name)
        if va == vb or name == "torch":
            continue
        gpu = is_gpu_stack(name)
        moves = "memory, speed" if gpu else None
        why = " (GPU stack)" if gpu else ""
        text = f"{name}: {va or 'not installed'} -> {vb or 'not installed'}{why}"
        out.append(Difference("environment", name, va, vb, text, moves))
    ra, rb = _get(a, "environment", "records", default={}), _get(b, "environment", "records", default={})
    for name in sorted(set(ra) & set(rb)):
        x, y = ra[name], rb[name]
        gpu = "memory, speed" if is_gpu_stack(name) else None
        if x.get("version") == y.get("version") and x.get("record_sha256") != y.get("record_sha256") \
                and x.get("record_sha256") and y.get("record_sha256"):
            out.append(Difference("environment", f"{name} build", x.get("record_sha256"), y.get("record_sha256"),
                                  f"{name} {x.get('version')}: another build of the same version (RECORD "
                                  f"{x['record_sha256'][:12]} -> {y['record_sha256'][:12]})", gpu))
        edited = (x.get("modified", 0) + x.get("missing", 0), y.get("modified", 0) + y.get("missing", 0))
        if edited[0] != edited[1]:
            out.append(Difference("environment", f"{name} files", edited[0], edited[1],
                                  f"{name}: {edited[0]} -> {edited[1]} installed files differ from its RECORD "
                                  "(edited or deleted in place)", gpu))
    ea, eb = _get(a, "environment", "env", default={}), _get(b, "environment", "env", default={})
    for var in sorted(set(ea) | set(eb)):
        if ea.get(var) == eb.get(var):
            continue
        moves, effect = None, None
        if var in MEMORY_ENV:
            moves = "memory, speed"
            if ma:
                effect = _effect(_peaks(ma), _peaks(ma, expandable=_expandable(eb.get(var))))
        elif var in SPEED_ENV or var.startswith(SPEED_ENV_PREFIXES):
            moves = "speed"
        out.append(Difference("environment", var, ea.get(var), eb.get(var),
                              f"{var} {_shown(ea.get(var))} -> {_shown(eb.get(var))}", moves, effect))
    pa, pb = _get(a, "environment", "path", default=[]), _get(b, "environment", "path", default=[])
    if pa != pb:
        added, removed = [p for p in pb if p not in pa], [p for p in pa if p not in pb]
        parts = [f"+ {p}" for p in added] + [f"- {p}" for p in removed] or ["same entries, another order"]
        out.append(Difference("environment", "PATH", pa, pb, f"PATH: {'; '.join(parts)}"))
    for key, label in (("lock_sha256", "profile lock"), ("profile", "profile")):
        x, y = _get(a, "environment", key), _get(b, "environment", key)
        if x != y:
            out.append(Difference("environment", key, x, y, f"{label} {_short(x)} -> {_short(y)}"))
    ha, hb = _get(a, "environment", "host", default={}), _get(b, "environment", "host", default={})
    for key in ("hostname", "python", "executable", "platform", "cpus"):
        if ha.get(key) != hb.get(key):
            out.append(Difference("environment", f"host.{key}", ha.get(key), hb.get(key),
                                  f"{key} {ha.get(key)} -> {hb.get(key)}", "speed" if key == "cpus" else None))
    return out


def _build(t: dict) -> str:
    return f"{t.get('version') or 'not installed'}" + (f" (CUDA {t['cuda']})" if t.get("cuda") else "")


def _expandable(conf: str | None) -> bool:
    return "expandable_segments:true" in (conf or "").replace(" ", "").lower()


def _shown(v) -> str:
    return "unset" if v is None else repr(v) if v == "" else str(v)


def _short(v) -> str:
    return str(v)[:12] if v else "none"


def _gpus(a: dict, b: dict) -> list[Difference]:
    out = []
    for key, moves in (("driver", "speed"), ("cuda_driver", "speed")):
        x, y = _get(a, "gpus", key), _get(b, "gpus", key)
        if x != y and x and y:
            out.append(Difference("gpus", key, x, y, f"{key.replace('_', ' ')} {x} -> {y}", moves))
    by_role_a, by_role_b = _by_role(_get(a, "gpus", "devices", default=[])), _by_role(_get(b, "gpus", "devices", default=[]))
    for label in sorted(set(by_role_a) | set(by_role_b)):
        x, y = by_role_a.get(label), by_role_b.get(label)
        if x is None or y is None:
            out.append(Difference("gpus", label, x and x["uuid"], y and y["uuid"],
                                  f"{label}: {_gpu(x)} -> {_gpu(y)}", "memory, speed"))
            continue
        if x["name"] != y["name"] or x["total_bytes"] != y["total_bytes"]:
            out.append(Difference("gpus", label, x["name"], y["name"],
                                  f"{label}: {_gpu(x)} -> {_gpu(y)}", "memory, speed"))
        elif abs(x["free_bytes"] - y["free_bytes"]) >= FREE_MEMORY_TOLERANCE:
            out.append(Difference("gpus", f"{label} free", x["free_bytes"], y["free_bytes"],
                                  f"{label}: free at start {_size(x['free_bytes'])} -> {_size(y['free_bytes'])} "
                                  f"({_signed(y['free_bytes'] - x['free_bytes'])}: another process holds memory)", "memory"))
        elif x["uuid"] != y["uuid"]:
            out.append(Difference("gpus", f"{label} uuid", x["uuid"], y["uuid"],
                                  f"{label}: another GPU of the same kind ({x['uuid'][:12]}… -> {y['uuid'][:12]}…)"))
    out += _overhead(a, b)
    na, nb = len(_get(a, "gpus", "devices", default=[])), len(_get(b, "gpus", "devices", default=[]))
    if na != nb and na and nb:
        out.append(Difference("gpus", "count", na, nb, f"GPUs on the machine {na} -> {nb}"))
    return out


OVERHEAD_TOLERANCE = 16 * MiB  # the memory outside torch measured twice on one machine differs by less


def _overhead(a: dict, b: dict) -> list[Difference]:
    """The memory outside torch the probe measured per GPU (snapshot memory.overhead), A -> B, with the machine
    state that changed: 'outside torch: 1.12 -> 1.31 GiB per GPU; torch 2.10.0+cu128 -> 2.10.0+cu130'."""
    from preflight.facts.overhead import state_changes

    oa, ob = _get(a, "memory", "overhead", default={}), _get(b, "memory", "overhead", default={})
    if not oa and not ob:
        return []
    ra, rb = _overhead_by_role(a, oa), _overhead_by_role(b, ob)
    changed = {}
    for label in sorted(set(ra) & set(rb)):
        x, y = ra[label], rb[label]
        vx, vy = x.get("outside_torch_bytes"), y.get("outside_torch_bytes")
        if vx is not None and vy is not None and abs(vy - vx) < OVERHEAD_TOLERANCE:
            continue
        if vx is None and vy is None:
            continue
        changed[label] = (x, y)
    if not changed:
        return []
    shown = {label: (_measured(x), _measured(y)) for label, (x, y) in changed.items()}
    x, y = next(iter(changed.values()))
    cause = state_changes(x.get("state"), y.get("state"))
    tail = f"; {'; '.join(cause)}" if cause else ""
    whole = len(changed) == len(set(ra) & set(rb))
    if whole and len(set(shown.values())) == 1:
        before, after = next(iter(shown.values()))
        if before.endswith(" GiB") and after.endswith(" GiB"):
            before = before.removesuffix(" GiB")
        text = f"outside torch: {before} -> {after} per GPU{tail}"
    else:
        text = "outside torch: " + ", ".join(f"{label} {p} -> {q}" for label, (p, q) in shown.items()) + tail
    vx, vy = x.get("outside_torch_bytes"), y.get("outside_torch_bytes")
    effect = f"memory model: {_signed(vy - vx)} per GPU" if vx is not None and vy is not None else None
    return [Difference("gpus", "outside torch", {k: v[0].get("outside_torch_bytes") for k, v in changed.items()},
                       {k: v[1].get("outside_torch_bytes") for k, v in changed.items()}, text, "memory", effect)]


def _overhead_by_role(snap: dict, overhead: dict) -> dict[str, dict]:
    labels = {d["uuid"]: label for label, d in _by_role(_get(snap, "gpus", "devices", default=[])).items()}
    return {labels[u]: o for u, o in overhead.items() if u in labels}


def _measured(o: dict) -> str:
    v = o.get("outside_torch_bytes")
    return f"{v / GiB:.2f} GiB" if v is not None else "not measured (calibrated constant)"


def _by_role(devices: list[dict]) -> dict[str, dict]:
    """'drafter GPU 2' -> device: a run's GPUs named by role and CUDA index (what the diff pairs up)."""
    return {f"{'+'.join(d['roles'])} GPU {d.get('cuda_index', d.get('index'))}": d for d in devices if d.get("roles")}


def _gpu(d: dict | None) -> str:
    if d is None:
        return "none"
    return f"{d['name']} {_size(d['total_bytes'])}"


def _code(a: dict, b: dict) -> list[Difference]:
    out = []
    ca, cb = a.get("code") or {}, b.get("code") or {}
    if ca.get("commit") != cb.get("commit"):
        out.append(Difference("code", "commit", ca.get("commit"), cb.get("commit"),
                              f"commit {_short(ca.get('commit'))} -> {_short(cb.get('commit'))}"))
    fa, fb = ca.get("dirty") or {}, cb.get("dirty") or {}
    for path in sorted(set(fa) | set(fb)):
        x, y = fa.get(path), fb.get(path)
        if x == y:
            continue
        out.append(Difference("code", path, x, y, f"{path}: {_file_state(x)} -> {_file_state(y)}"))
    return out


def _file_state(f: dict | None) -> str:
    if f is None:
        return "as committed"
    sha = f" (sha256 {f['sha256'][:12]})" if f.get("sha256") else ""
    return f"{f.get('state', 'modified')}{sha}"


def _compile_cache(a: dict, b: dict) -> list[Difference]:
    x, y = a.get("compile_cache") or {}, b.get("compile_cache") or {}
    out = []
    if (x.get("exists"), x.get("manifest")) != (y.get("exists"), y.get("manifest")):
        cold = "" if _cache_state(y).startswith("warm") else ": the first steps compile again (and race across ranks)"
        out.append(Difference("compile cache", "state", _cache_state(x), _cache_state(y),
                              f"{_cache_state(x)} -> {_cache_state(y)}{cold}", "speed"))
    elif x.get("size_bytes") != y.get("size_bytes") and x.get("exists"):
        out.append(Difference("compile cache", "size", x.get("size_bytes"), y.get("size_bytes"),
                              f"size {_size(x.get('size_bytes') or 0)} -> {_size(y.get('size_bytes') or 0)} "
                              "(same manifest)", counts=False))
    if x.get("env_override") != y.get("env_override"):
        out.append(Difference("compile cache", "TORCHINDUCTOR_CACHE_DIR", x.get("env_override"), y.get("env_override"),
                              f"inductor cache redirected {_shown(x.get('env_override'))} -> {_shown(y.get('env_override'))}",
                              "speed"))
    if x.get("path") != y.get("path"):
        out.append(Difference("compile cache", "path", x.get("path"), y.get("path"),
                              f"path {x.get('path')} -> {y.get('path')}", counts=False))
    return out


def _cache_state(c: dict) -> str:
    if not c or not c.get("exists"):
        return "absent"
    n = c.get("size_bytes") or 0
    size = f"{n / 1e6:,.0f} MB" if n >= 1e6 else f"{n / 1e3:,.0f} kB"
    m = c.get("manifest")
    if not m:
        return f"cold ({size}, no manifest)"
    return f"warm ({size}; torch {m.get('torch')}, triton {m.get('triton')}, {m.get('gpu_name')})"


def _flat(node: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, f"{key}."))
        else:
            out[key] = v
    return out


def _defaults() -> dict:
    """Every run config field's default, flattened (a field an older snapshot predates reads as its default)."""
    from dflash.config import RunConfig

    return _flat(RunConfig().model_dump(mode="json"))


def _config(a: dict, b: dict, ma: _Model | None) -> list[Difference]:
    fa, fb = _flat(a.get("config") or {}), _flat(b.get("config") or {})
    if fa and fb:  # a field only one side records, at its default on the other, is no change (target.precision)
        defaults = _defaults()
        fa, fb = ({**{k: defaults[k] for k in set(other) - set(mine) if k in defaults}, **mine}
                  for mine, other in ((fa, fb), (fb, fa)))
    same_data = _get(a, "data", "fingerprint") is not None and _get(a, "data", "fingerprint") == _get(b, "data", "fingerprint")
    same_target = (_get(a, "target", "shape") == _get(b, "target", "shape")
                   and _get(a, "target", "fingerprint") == _get(b, "target", "fingerprint"))
    base = _peaks(ma) if ma else None
    out = []
    for key in sorted(set(fa) | set(fb)):
        x, y = fa.get(key), fb.get(key)
        if x == y or key == "output_dir":
            continue
        effect = None
        if ma and base:
            what_if = _with(ma.cfg, key, y)
            effect = _effect(base, _peaks(ma, what_if)) if what_if is not None else None
        moves = "memory, speed" if effect else "speed" if key in SPEED_FIELDS else None
        counts = key not in ("data.path", "target.path", "train.compile_cache")  # their content: data, compile cache
        note = "" if counts else " (see compile cache)" if key == "train.compile_cache" else \
            " (same content)" if (same_data if key == "data.path" else same_target) else " (see data)"
        out.append(Difference("config", key, x, y, f"{key} {_value(x)} -> {_value(y)}{note}", moves, effect, counts))
    return out


def _value(v) -> str:
    return "none" if v is None else str(v)


def _data(a: dict, b: dict) -> list[Difference]:
    x, y = a.get("data") or {}, b.get("data") or {}
    out = []
    if x.get("error") != y.get("error"):
        out.append(Difference("data", "error", x.get("error"), y.get("error"),
                              f"dataset unreadable: {_value(x.get('error'))} -> {_value(y.get('error'))}"))
    la, lb = x.get("length") or {}, y.get("length") or {}
    parts = []
    if la != lb and la and lb:
        if la.get("mean"):
            change = f" ({(lb['mean'] / la['mean'] - 1):+.0%})" if la.get("mean") and lb.get("mean") is not None else ""
            parts.append(f"sample length mean {_count(la.get('mean'))} -> {_count(lb.get('mean'))} tokens{change}")
        parts += [f"{k} {_count(la.get(k))} -> {_count(lb.get(k))}" for k in ("p50", "p90", "p99", "max")
                  if la.get(k) != lb.get(k)]
    parts += [f"{k} {x.get(k):,} -> {y.get(k):,}" for k in ("samples", "tokens")
              if x.get(k) != y.get(k) and x.get(k) is not None and y.get(k) is not None]
    if not parts and x.get("fingerprint") != y.get("fingerprint"):
        parts.append(f"content {_short(x.get('fingerprint'))} -> {_short(y.get('fingerprint'))} (same size and lengths)")
    if parts:
        keys = ("fingerprint", "samples", "tokens", "length")
        out.append(Difference("data", "dataset", {k: x.get(k) for k in keys}, {k: y.get(k) for k in keys},
                              "dataset " + ", ".join(parts), "memory, speed" if la != lb and la and lb else None))
    if x.get("manifest_target") != y.get("manifest_target"):
        out.append(Difference("data", "manifest target", x.get("manifest_target"), y.get("manifest_target"),
                              "dataset manifest: tokenized for another target" if x.get("manifest_target") and y.get(
                                  "manifest_target") else f"dataset manifest {'added' if y.get('manifest_target') else 'gone'}"))
    ta, tb = a.get("target") or {}, b.get("target") or {}
    if ta.get("shape") != tb.get("shape"):
        out.append(Difference("data", "target shape", ta.get("shape"), tb.get("shape"),
                              f"target shape changed ({_shape(ta.get('shape'))} -> {_shape(tb.get('shape'))})", "memory, speed"))
    elif ta.get("fingerprint") != tb.get("fingerprint"):
        out.append(Difference("data", "target", ta.get("fingerprint"), tb.get("fingerprint"),
                              "target model files changed (same shape)"))
    return out


def _count(v) -> str:
    return "absent" if v is None else f"{v:,.0f}"


def _shape(s: dict | None) -> str:
    if not s:
        return "unknown"
    return f"{s.get('model_type')} {s.get('num_layers')} layers, hidden {s.get('hidden')}, vocab {s.get('vocab')}"


def _run(a: dict, b: dict) -> list[Difference]:
    out = []
    if _get(a, "run", "here") or _get(b, "run", "here"):
        return out
    ia, ib = _intent(a), _intent(b)
    if ia != ib:
        out.append(Difference("run", "intent", _get(a, "run", "intent"), _get(b, "run", "intent"), f"{ia} -> {ib}"))
    pa, pb = a.get("preflight") or {}, b.get("preflight") or {}
    for key in ("failed", "waived", "warned"):
        x, y = sorted(pa.get(key) or []), sorted(pb.get(key) or [])
        if x != y:
            out.append(Difference("run", f"preflight {key}", x, y,
                                  f"preflight {key}: {', '.join(x) or 'none'} -> {', '.join(y) or 'none'}", counts=False))
    return out


def _intent(s: dict) -> str:
    run = s.get("run") or {}
    if run.get("intent") == "resume":
        r = run.get("resume") or {}
        return f"resume from step {r.get('step')} ({r.get('checkpoint')})" if r else "resume"
    return {"fresh": "fresh start", None: "first start (no checkpoints)"}.get(run.get("intent"), str(run.get("intent")))


# ---------------------------------------------------------------- outcome and the memory summary


def _memory(a: dict, b: dict, ma: _Model | None, mb: _Model | None) -> list[str]:
    pa = _peaks(ma) if ma else None
    pb = _peaks(mb) if mb else None
    pa = pa or {r: v["bytes"] for r, v in (_get(a, "memory", "roles", default={})).items() if v.get("bytes")}
    pb = pb or {r: v["bytes"] for r, v in (_get(b, "memory", "roles", default={})).items() if v.get("bytes")}
    lines = []
    for role in [r for r in ("colocated", "target", "drafter") if r in pa or r in pb]:
        x, y = pa.get(role), pb.get(role)
        if x and y:
            lines.append(f"{role} peak {_size(x)} -> {_size(y)} ({_signed(y - x)})" if x != y else f"{role} peak {_size(x)} (same)")
        else:
            lines.append(f"{role} peak {_size(x) if x else 'none'} -> {_size(y) if y else 'none'}")
    return lines


def _ended(o: dict | None) -> str:
    if o is None:
        return "no outcome"
    e = o.get("ended") or {}
    how = e.get("how") or "unknown"
    if how == "running":
        return f"running or killed without a word (last update step {o.get('step')}, {o.get('updated_utc')})"
    if how == "stopping":
        return (f"stopping or killed while stopping at step {e.get('step')} ({o.get('updated_utc')}): its checkpoint "
                "may be missing, the earlier ones stand")
    where = f" at step {e['step']}" if e.get("step") is not None else ""
    who = ""
    if how == "crashed" and e.get("rank") is not None:
        who = f" rank {e['rank']}" + (f" ({e['role']}, GPU {e['gpu']})" if e.get("role") else "")
    detail = f": {e['detail']}" if e.get("detail") else ""
    return f"{how}{who}{where}{detail}"


def _rate(x, y, unit: str = "", pct: bool = True) -> str:
    if x is None and y is None:
        return ""
    fx = "none" if x is None else f"{x:,.0f}{unit}" if unit != "%" else f"{x:.0%}"
    fy = "none" if y is None else f"{y:,.0f}{unit}" if unit != "%" else f"{y:.0%}"
    change = f" ({y / x - 1:+.0%})" if pct and x and y is not None and unit != "%" else ""
    return f"{fx} -> {fy}{change}"


def _outcome(a: dict, b: dict, oa: dict | None, ob: dict | None) -> list[OutcomeRow]:
    if oa is None and ob is None:
        return []
    oa, ob = oa or {}, ob or {}
    rows = [OutcomeRow("ended", _ended(oa or None), _ended(ob or None), f"{_ended(oa or None)} -> {_ended(ob or None)}")]
    sa, sb = oa.get("steady") or {}, ob.get("steady") or {}
    for key, label, unit in (("tok_per_s", "steady tok/s", ""), ("target_tok_s_per_gpu", "target tok/s per GPU", ""),
                             ("drafter_tok_s_per_gpu", "drafter tok/s per GPU", ""),
                             ("drafter_wait_frac", "drafters waiting", "%"), ("target_wait_frac", "targets waiting", "%")):
        if key in sa or key in sb:
            rows.append(OutcomeRow(label, sa.get(key), sb.get(key), _rate(sa.get(key), sb.get(key), unit)))
    for key, label in (("to_first_step_s", "gate to first step"), ("first_step_s", "first step (compilation included)")):
        if oa.get(key) is not None or ob.get(key) is not None:
            rows.append(OutcomeRow(label, oa.get(key), ob.get(key), f"{_secs(oa.get(key))} -> {_secs(ob.get(key))}"))
    ua, ub = oa.get("startup") or {}, ob.get("startup") or {}
    for key, label in (("launch_to_first_step_s", "launch to first step"), ("target_s", "startup: target load"),
                       ("setup_s", "startup: drafter, data, optimizer")):
        if ua.get(key) is not None or ub.get(key) is not None:
            rows.append(OutcomeRow(label, ua.get(key), ub.get(key), f"{_secs(ua.get(key))} -> {_secs(ub.get(key))}"))
    ga, gb = (oa.get("compiled_graphs") or {}), (ob.get("compiled_graphs") or {})
    if ga or gb:
        rows.append(OutcomeRow("compiled graphs", ga, gb, f"{_graphs(ga)} -> {_graphs(gb)}"))
    pka, pkb = oa.get("peak") or {}, ob.get("peak") or {}
    names = _gpu_names(a) | _gpu_names(b)
    for uuid in sorted(set(pka.get("gpus") or {}) | set(pkb.get("gpus") or {}), key=lambda u: names.get(u, u)):
        x, y = (pka.get("gpus") or {}).get(uuid), (pkb.get("gpus") or {}).get(uuid)
        rows.append(OutcomeRow(f"peak used {names.get(uuid, uuid[:12])} (NVML)", x, y, _bytes_change(x, y)))
    for key, label in (("torch_allocated_bytes", "peak allocated by torch"), ("host_rss_bytes", "peak host RSS")):
        if pka.get(key) is not None or pkb.get(key) is not None:
            rows.append(OutcomeRow(label, pka.get(key), pkb.get(key), _bytes_change(pka.get(key), pkb.get(key))))
    la, lb = oa.get("last") or {}, ob.get("last") or {}
    for key, label in (("loss", "last loss"), ("accept_len", "last acceptance length")):
        if key in la or key in lb:
            rows.append(OutcomeRow(label, la.get(key), lb.get(key), f"{_num(la.get(key))} -> {_num(lb.get(key))}"))
    return rows


def _gpu_names(s: dict) -> dict[str, str]:
    return {d["uuid"]: f"{'+'.join(d['roles'])} GPU {d.get('cuda_index')}" for d in _get(s, "gpus", "devices", default=[])
            if d.get("roles")}


def _secs(v) -> str:
    return "none" if v is None else f"{v:.1f} s"


def _graphs(g: dict) -> str:
    first, last = g.get("first_step"), g.get("last")
    if first is None and last is None:
        return "none"
    return f"{first} at the first step, {last} at the end" + (f" ({last - first} recompiles)" if first is not None
                                                               and last is not None and last > first else "")


def _bytes_change(x, y) -> str:
    if x is None or y is None:
        return f"{_size(x) if x is not None else 'none'} -> {_size(y) if y is not None else 'none'}"
    return f"{_size(x)} -> {_size(y)} ({_signed(y - x)})"


def _num(v) -> str:
    return "none" if v is None else f"{v:.4g}"


# ---------------------------------------------------------------- all together


def compare(a: dict, b: dict, outcome_a: dict | None = None, outcome_b: dict | None = None) -> RunDiff:
    """Every difference between snapshots a and b, known memory/speed movers first, then the outcome."""
    ma, mb = _model(a), _model(b)
    found = (_environment(a, b, ma, mb) + _gpus(a, b) + _code(a, b) + _compile_cache(a, b) + _config(a, b, ma)
             + _data(a, b) + _run(a, b))
    found.sort(key=lambda d: (not d.counts, d.moves is None, GROUPS.index(d.group)))
    d = RunDiff(found, _memory(a, b, ma, mb), _outcome(a, b, outcome_a, outcome_b))
    if ma is None or mb is None:
        d.notes.append("memory model: no prediction for " + " and ".join(
            n for n, m in (("A", ma), ("B", mb)) if m is None) + " (target shape or config not readable by this version)")
    return d
