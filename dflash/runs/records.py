"""A run's snapshot and outcome: what it was started with, and how it went. Torch-free.

    <output_dir>/snapshot.json   written by the preflight gate once it passed, before anything heavy loads
    <output_dir>/outcome.json    rewritten atomically by the trainer as the run goes, and at its end
    <output_dir>/previous/<time>-<gate>/   the snapshot and outcome of an earlier run in this dir, moved aside

`dflash-diff A B` compares two of them ("what changed since the last good run?"). This module is
the only one that knows the files' names and layout: the gate writes a snapshot that
``preflight.snapshot.take`` fills from the facts preflight gathered (`write_snapshot`), the
trainer keeps the outcome (`Outcome`), the split launcher names a rank that died
(`record_crash`), and `dflash-diff` reads both back (`load`).

snapshot.json (keys sorted, a few kilobytes)::

    {"format": "dflash-snapshot/1",
     "run": {"gate_id", "time_utc", "config_sha256", "intent": "fresh"|"resume"|null, "resume": {"step", "checkpoint"}|null},
     "environment": {"profile", "lock_sha256", "torch": {"version", "cuda"}, "builds": {...}, "distributions": {name: version},
                     "records": {name: {"version", "record_sha256", "modified", "missing"}}, "env": {VAR: value},
                     "path": [dir, ...], "host": {"hostname", "platform", "python", "executable", "cpus"}},
     "gpus": {"driver", "cuda_driver", "cuda_visible_devices", "error", "devices": [{"index", "cuda_index", "uuid", "name",
              "total_bytes", "free_bytes", "compute_capability", "roles"}]},
     "code": {"mode", "commit", "dirty": {path: {"state", "sha256"}}, "error"},
     "compile_cache": {"path", "exists", "size_bytes", "manifest", "error", "env_override"},
     "config": {the resolved run config},
     "data": {"path", "fingerprint", "samples", "tokens", "shards", "length": {"min", "mean", "p50", "p90", "p99", "max"}},
     "target": {"path", "precision": "bf16"|"fp8", "shape": {TargetShape fields}, "fingerprint"},
     "memory": {"cuda", "expandable_segments", "roles": {role: {"bytes", "recompute"}}, "error"},
     "preflight": {"ok", "failed": [id], "warned": [id], "waived": {id: reason}}}

outcome.json::

    {"format": "dflash-outcome/1", "gate_id", "started_utc", "updated_utc", "start_step", "step",
     "first_step_s", "to_first_step_s", "compiled_graphs": {"first_step", "last"}, "recompiles", "recompile_causes",
     "rows",
     "startup": {"before_s", "preflight_s", "target_s", "setup_s", "first_step_s", "launch_to_first_step_s"}
                (seconds; before_s: launch to the target's build, imports and preflight; preflight_s: the gate's
                share of it; a phase absent if not run),
     "compile": {"frames": [s], "dynamo_s", "aot_s", "inductor_s", "cache_load_s", "kernel_wait_s", "backward_s",
                 "total_s", "fla_autotune_s", "fla_kernels_tuned"} (torch.compile's seconds up to the first step, and
                 fla's autotuning outside it: dflash.train.compiled.compile_phases),
     "steady": {"tok_per_s", "target_tok_s_per_gpu", "drafter_tok_s_per_gpu", "drafter_wait_frac", "target_wait_frac"},
     "peak": {"gpus": {uuid: bytes used (NVML)}, "torch_allocated_bytes", "host_rss_bytes"},
     "last": {"loss", "accept_len"},
     "ended": {"how": "running"|"finished"|"stopping"|"stopped"|"crashed"|"interrupted", "step", "detail", "rank", "role",
               "gpu", "stop": {"total_s", "step_s", "weights_s", "optimizer_s", "hash_wait_s", "fsync_s", ...}}}
"""

from __future__ import annotations

import calendar
import json
import math
import os
import statistics
import time
from collections import deque
from pathlib import Path

from dflash.data.jsonl import JsonLineError, decode_json
from dflash.errors import UsageError

SNAPSHOT_NAME = "snapshot.json"
OUTCOME_NAME = "outcome.json"
PREVIOUS_DIR = "previous"
FORMAT = "dflash-snapshot/1"
OUTCOME_FORMAT = "dflash-outcome/1"
STEADY_ROWS = 50  # steady rates are medians over this many of the latest metrics rows (the first row is excluded)
RATE_KEYS = ("tok_per_s", "target_tok_s_per_gpu", "drafter_tok_s_per_gpu", "drafter_wait_frac", "target_wait_frac")


class SnapshotError(UsageError):
    """A path that holds no readable snapshot of this format; the message is one line naming the fix (exit 2)."""


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------- the snapshot


def write_snapshot(output_dir: str | Path, snapshot: dict) -> Path:
    """Write a new run's snapshot (atomically, keys sorted); the previous run's snapshot and outcome in this dir
    move to previous/<time>-<gate>/ first (never deleted). Raises OSError."""
    assert snapshot.get("format") == FORMAT, "a snapshot is built by preflight.snapshot.take"
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    _move_previous(out)
    path = out / SNAPSHOT_NAME
    _write_json(path, snapshot)
    return path


def _move_previous(out: Path) -> Path | None:
    old = out / SNAPSHOT_NAME
    if not old.exists():
        return None
    try:
        run = decode_json(old.read_bytes()).get("run")
    except (OSError, JsonLineError, AttributeError):
        run = None
    run = run if isinstance(run, dict) else {}  # a damaged snapshot still moves aside, under "unknown"
    stamp = str(run.get("time_utc") or "unknown").replace(":", "").replace("-", "")
    base = out / PREVIOUS_DIR / f"{stamp}-{str(run.get('gate_id') or 'nogate')[:8]}"
    folder, n = base, 1
    while folder.exists():
        folder, n = base.with_name(f"{base.name}.{n}"), n + 1
    folder.mkdir(parents=True)
    for name in (SNAPSHOT_NAME, OUTCOME_NAME):
        if (out / name).exists():
            (out / name).rename(folder / name)
    return folder


def previous_runs(output_dir: str | Path) -> list[Path]:
    """Earlier runs' snapshot folders of a run dir, oldest first (dflash-diff takes any of them as a run)."""
    root = Path(output_dir) / PREVIOUS_DIR
    return sorted(p for p in root.iterdir() if (p / SNAPSHOT_NAME).is_file()) if root.is_dir() else []


def load(path: str | Path) -> tuple[dict, dict | None, list[str]]:
    """(snapshot, outcome or None, notes) of a run dir, a previous/<...> folder, or a snapshot.json file.

    Reads only. Raises SnapshotError (one line) for a path with no readable snapshot of this format, or a snapshot
    or outcome whose fields are not of the kind SNAPSHOT_SCHEMA / OUTCOME_SCHEMA say (naming the file and field).
    What `load` returns holds every key the schemas name (absent ones null, [] or {}).
    """
    p = Path(path)
    if not p.exists():
        raise SnapshotError(f"{path}: no such run dir; give a run dir a dflash-train run wrote (it holds {SNAPSHOT_NAME})")
    file = p if p.is_file() else p / SNAPSHOT_NAME
    if not file.is_file():
        earlier = previous_runs(p) if p.is_dir() else []
        hint = f"; its earlier run: {earlier[-1]}" if earlier else ""
        raise SnapshotError(f"{path}: no {SNAPSHOT_NAME} (not a run dir, or a run started before snapshots were "
                            f"written); give a run dir a dflash-train run wrote{hint}")
    try:
        snap = decode_json(file.read_bytes())
    except (OSError, JsonLineError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())[:120]
        raise SnapshotError(f"{file}: not a readable snapshot ({why}); it is written by the preflight gate of "
                            "dflash-train, give another run dir") from None
    if not isinstance(snap, dict) or snap.get("format") != FORMAT:
        found = snap.get("format") if isinstance(snap, dict) else type(snap).__name__
        raise SnapshotError(f"{file}: not a {FORMAT} snapshot (format {found!r}); give a run dir written by this "
                            "version of dflash-train")
    for key in ("run", "environment", "config"):
        if not isinstance(snap.get(key), dict):
            raise SnapshotError(f"{file}: {FORMAT} snapshot without its {key!r} section (truncated or edited); "
                                "give another run dir")
    snap = checked_snapshot(snap, file)
    outcome, notes = None, []
    ofile = file.with_name(OUTCOME_NAME)
    if ofile.exists():
        try:
            outcome = decode_json(ofile.read_bytes())
        except (OSError, JsonLineError):
            notes.append(f"{ofile}: unreadable, outcome not compared")
        if outcome is not None and (not isinstance(outcome, dict) or outcome.get("format") != OUTCOME_FORMAT):
            notes.append(f"{ofile}: not a {OUTCOME_FORMAT} file, outcome not compared")
            outcome = None
        elif outcome is not None and outcome.get("gate_id") != snap["run"].get("gate_id"):
            notes.append(f"{ofile}: of another run than {file.name} (gate id), outcome not compared")
            outcome = None
    if outcome is not None:
        outcome = checked_outcome(outcome, ofile)
    return snap, outcome, notes


# ---------------------------------------------------------------- what a reader may trust

# The layout above as a schema that `load` checks once, so `dflash-diff` computes only with values of the
# kind it expects. A leaf is a kind: "str", "int" (|n| <= 2^63), "num" (a finite number), "bool", "scalar"
# (any of those), "any" (any JSON value: compared and shown, never computed with), "count" (an int >= 0,
# absent or null reads 0); a trailing "!" makes it required and never null. {key: kind} is an object,
# ("?", {...}) one that may be null, ("list", kind) and ("map", kind) hold values of one kind.
# A key a file lacks (an older version's snapshot) reads as null, [] or {} (an object: all its keys absent);
# a value of another kind is a SnapshotError naming the file and the field. Keys the schema does not name
# are kept as they are (a newer version's additions are shown where the diff walks a whole section).
_SHAPE = {"model_type": "str", "tied": "bool", "qk_norm": "bool", "qkv_bias": "bool", "attn_output_gate": "bool",
          **{k: "int" for k in ("num_layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab",
                                "linear_layers", "linear_key_dim", "linear_value_dim", "linear_value_heads",
                                "linear_value_head_dim", "linear_conv_kernel")}}  # dflash.memory.shape.TargetShape
_DEVICE = {"index": "int", "cuda_index": "int", "uuid": "str!", "name": "str!", "total_bytes": "int!",
           "free_bytes": "int!", "compute_capability": "scalar", "roles": ("list", "str!")}
SNAPSHOT_SCHEMA = {
    "format": "str!",
    "run": {"gate_id": "any", "time_utc": "any", "config_sha256": "any", "intent": "str", "here": "bool",
            "ranks": "int", "resume": ("?", {"step": "int", "checkpoint": "any"})},
    "environment": {"profile": "any", "lock_sha256": "any", "torch": {"version": "str", "cuda": "str"},
                    "builds": ("map", "any"), "distributions": ("map", "scalar"),
                    "records": ("map", {"version": "scalar", "record_sha256": "str", "modified": "count",
                                        "missing": "count", "error": "any"}),
                    "env": ("map", "str"), "path": ("list", "str!"),
                    "host": {"hostname": "scalar", "platform": "scalar", "python": "scalar", "executable": "scalar",
                             "cpus": "scalar"}},
    "gpus": {"driver": "scalar", "cuda_driver": "scalar", "cuda_visible_devices": "any", "error": "any",
             "devices": ("list", _DEVICE)},
    "code": {"mode": "any", "commit": "scalar", "dirty": ("map", {"state": "scalar", "sha256": "str"}), "error": "any"},
    "compile_cache": {"path": "scalar", "exists": "bool", "size_bytes": "int", "manifest": ("?", ("map", "any")),
                      "error": "any", "env_override": "scalar"},
    "config": "config",
    "data": {"path": "any", "fingerprint": "scalar", "samples": "int", "tokens": "int", "shards": "int",
             "errors": "any", "error": "any", "manifest_target": "any",
             "length": ("?", {k: "num" for k in ("min", "mean", "p50", "p90", "p99", "max")})},
    "target": {"path": "any", "precision": "scalar", "shape": ("?", _SHAPE), "fingerprint": "any", "error": "any"},
    "memory": {"cuda": "str", "expandable_segments": "bool", "roles": ("map", {"bytes": "int", "recompute": "any"}),
               "error": "any",
               "overhead": ("map", {"source": "str", "outside_torch_bytes": "int", "context_bytes": "int",
                                    "nccl_bytes": "int", "note": "any", "state": ("?", ("map", "any")),
                                    "roles": ("list", "str!")})},
    "preflight": {"ok": "bool", "failed": ("list", "str!"), "warned": ("list", "str!"), "waived": ("map", "any")},
}
COMPILE_PHASES = ("dynamo_s", "aot_s", "inductor_s", "cache_load_s", "kernel_wait_s", "backward_s", "total_s",
                  "fla_autotune_s", "fla_kernels_tuned")
OUTCOME_SCHEMA = {
    "format": "str!", "gate_id": "any", "started_utc": "any", "updated_utc": "any", "start_step": "int", "step": "int",
    "first_step_s": "num", "to_first_step_s": "num", "compiled_graphs": {"first_step": "int", "last": "int"},
    "recompiles": "int", "recompile_causes": ("list", "str!"), "startup": ("map", "num"),
    "compile": {"frames": ("list", "num"), **{k: "num" for k in COMPILE_PHASES}},
    "rows": "int", "steady": ("map", "num"),
    "peak": {"gpus": ("map", "int"), "torch_allocated_bytes": "int", "host_rss_bytes": "int"},
    "last": {"loss": "num", "accept_len": "num"},
    "ended": {"how": "scalar", "step": "int", "detail": "any", "rank": "int", "role": "scalar", "gpu": "scalar"},
}
RECOMPILE_CAUSES = 50  # outcome.json keeps the causes of the last 50 recompiles
CONFIG_DEPTH = 8  # sections nest this deep at most (the run config has two levels)
_LEAVES = {"str": (str,), "int": (int,), "num": (int, float), "bool": (bool,), "scalar": (str, int, float, bool),
           "count": (int,)}


class _Bad(Exception):
    def __init__(self, where: str, why: str):
        super().__init__(f"{where or 'the file'}: {why}")


def _shown(v) -> str:
    text = json.dumps(v, allow_nan=True) if not isinstance(v, (dict, list)) else type(v).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _checked(value, kind, where: str):
    """`value` read as `kind` (a key the file lacks arrives as None): the normalized value, or _Bad."""
    if isinstance(kind, dict):
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise _Bad(where, f"expected an object, got {_shown(value)}")
        out = dict(value)
        for key, sub in kind.items():
            out[key] = _checked(value.get(key), sub, f"{where}.{key}" if where else key)
        return out
    if isinstance(kind, tuple):
        shape, sub = kind
        if shape == "?":
            return None if value is None else _checked(value, sub, where)
        empty, typ = ({}, dict) if shape == "map" else ([], list)
        if value is None:
            return empty
        if not isinstance(value, typ):
            raise _Bad(where, f"expected {'an object' if typ is dict else 'a list'}, got {_shown(value)}")
        if typ is dict:
            return {str(k): _checked(v, sub, f"{where}.{k}") for k, v in value.items()}
        return [_checked(v, sub, f"{where}[{i}]") for i, v in enumerate(value)]
    if kind == "config":
        if not isinstance(value, dict):
            raise _Bad(where, f"expected the run config (an object), got {_shown(value)}")
        _depth(value, where, 0)
        return value
    if kind == "any":
        return value
    required = kind.endswith("!")
    kind = kind.rstrip("!")
    if value is None:
        if required:
            raise _Bad(where, "missing")
        return 0 if kind == "count" else None
    ok = isinstance(value, _LEAVES[kind]) and (kind in ("bool", "scalar", "str") or not isinstance(value, bool))
    if ok and isinstance(value, float):
        ok = math.isfinite(value)
    if ok and isinstance(value, int) and not isinstance(value, bool):
        ok = -(1 << 63) <= value <= 1 << 63 and (kind != "count" or value >= 0)
    if not ok:
        what = {"str": "a string", "int": "an integer in -2^63..2^63", "num": "a finite number", "bool": "true or false",
                "scalar": "a string, a finite number or a boolean", "count": "an integer >= 0"}[kind]
        raise _Bad(where, f"expected {what}, got {_shown(value)}")
    return value


def _depth(node, where: str, depth: int) -> None:
    if depth > CONFIG_DEPTH:
        raise _Bad(where, f"nested deeper than {CONFIG_DEPTH} levels")
    for key, v in (node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()):
        _depth(v, f"{where}.{key}", depth + 1)


def checked_snapshot(snap: dict, file: str | Path) -> dict:
    """The snapshot read against SNAPSHOT_SCHEMA (absent keys filled); SnapshotError naming the file and field."""
    try:
        return _checked(snap, SNAPSHOT_SCHEMA, "")
    except _Bad as e:
        raise SnapshotError(f"{file}: malformed {FORMAT} snapshot, field {e}; it is written by dflash-train's gate "
                            "(edited or damaged?), give another run dir") from None


def checked_outcome(outcome: dict, file: str | Path) -> dict:
    """The outcome read against OUTCOME_SCHEMA (absent keys filled); SnapshotError naming the file and field."""
    try:
        return _checked(outcome, OUTCOME_SCHEMA, "")
    except _Bad as e:
        raise SnapshotError(f"{file}: malformed {OUTCOME_FORMAT} file, field {e}; it is written by the trainer "
                            "(edited or damaged?), move it aside to compare the snapshots alone") from None


# ---------------------------------------------------------------- the outcome


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), None elsewhere."""
    try:
        stat = Path("/proc/self/stat").read_text()
        started_ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, counted after the command name
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return round(uptime - started_ticks / os.sysconf("SC_CLK_TCK"), 1)
    except (OSError, ValueError, IndexError):
        return None


def _host_rss_bytes() -> int | None:
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB
    except (ImportError, OSError, ValueError):
        return None


class NvmlUsage:
    """Memory used on the run's GPUs (by UUID) through NVML; nothing (and no retry) where NVML is not there."""

    def __init__(self, uuids: list[str]):
        self.handles: dict[str, object] = {}
        if not uuids:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            for uuid in uuids:
                self.handles[uuid] = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception:  # no driver, a UUID this node does not have: the peak is simply not recorded
            self.handles = {}

    def used(self) -> dict[str, int]:
        out = {}
        for uuid, h in self.handles.items():
            try:
                out[uuid] = int(self.nvml.nvmlDeviceGetMemoryInfo(h).used)
            except Exception:
                continue
        return out


class Outcome:
    """outcome.json of the run under way, kept by the rank that logs (rank 0 of the drafters).

    Every update rewrites the file atomically, so a reader (or a killed run) always finds a whole
    JSON object; a run killed without a word stays "running" with its last update time.
    """

    def __init__(self, output_dir: str | Path, start_step: int):
        self.path = Path(output_dir) / OUTCOME_NAME
        run, gpus = {}, []
        try:
            snap = json.loads((Path(output_dir) / SNAPSHOT_NAME).read_text())
            run = snap.get("run") or {}
            gpus = [d["uuid"] for d in (snap.get("gpus") or {}).get("devices") or [] if d.get("roles")]
        except (OSError, ValueError, AttributeError, KeyError, TypeError):
            pass  # a run started without the gate (tests, library use): an outcome without a snapshot
        self.gate_time = _parse_utc(run.get("time_utc"))
        self.nvml = NvmlUsage(gpus)
        self.recent: dict[str, deque] = {k: deque(maxlen=STEADY_ROWS) for k in RATE_KEYS}
        self.data = {"format": OUTCOME_FORMAT, "gate_id": run.get("gate_id"), "started_utc": now_utc(),
                     "updated_utc": now_utc(), "start_step": start_step, "step": start_step, "rows": 0,
                     "first_step_s": None, "to_first_step_s": None, "compiled_graphs": {"first_step": None, "last": None},
                     "recompiles": 0,
                     "steady": {}, "peak": {"gpus": {}, "torch_allocated_bytes": None, "host_rss_bytes": None},
                     "last": {}, "ended": {"how": "running", "step": start_step}}
        self._sample()
        self.write()

    def write(self) -> None:
        self.data["updated_utc"] = now_utc()
        try:
            _write_json(self.path, self.data)
        except OSError:
            pass  # a full disk must not stop training; the checkpoint code reports it

    def _sample(self) -> None:
        peak = self.data["peak"]
        for uuid, used in self.nvml.used().items():
            peak["gpus"][uuid] = max(used, peak["gpus"].get(uuid, 0))
        peak["host_rss_bytes"] = _host_rss_bytes()

    def first_step(self, seconds: float, graphs: int, startup: dict | None = None, compile: dict | None = None) -> None:
        self.data["first_step_s"] = round(seconds, 3)
        if startup:
            self.data["startup"] = startup
        if compile:
            self.data["compile"] = compile
        if self.gate_time is not None:
            self.data["to_first_step_s"] = round(time.time() - self.gate_time, 1)
        self.data["compiled_graphs"]["first_step"] = graphs
        self.write()

    def recompiled(self, count: int, causes: list[str] = ()) -> None:
        """torch.compile built a graph past the first step (the trainer's count so far, and what changed: the last
        RECOMPILE_CAUSES of 'step N: function (file:line): failed guard')."""
        self.data["recompiles"] = count
        self.data["recompile_causes"] = [*self.data.get("recompile_causes", []), *causes][-RECOMPILE_CAUSES:]
        self.write()

    def row(self, rec: dict) -> None:
        """A metrics row (dflash.train.trainer's record): rates, peaks, the last loss and acceptance."""
        d = self.data
        d["rows"] += 1
        d["step"] = d["ended"]["step"] = rec.get("step", d["step"])
        if d["rows"] > 1:
            for k in RATE_KEYS:  # the first row's window holds the first step, compilation included
                if isinstance(rec.get(k), (int, float)):
                    self.recent[k].append(float(rec[k]))
        d["steady"] = {k: round(statistics.median(v), 4) for k, v in self.recent.items() if v}
        if "compiled_graphs" in rec:
            d["compiled_graphs"]["last"] = rec["compiled_graphs"]
        if isinstance(rec.get("mem_gib"), (int, float)):
            b = int(rec["mem_gib"] * 2**30)
            d["peak"]["torch_allocated_bytes"] = max(b, d["peak"]["torch_allocated_bytes"] or 0)
        d["last"] = {k: rec[k] for k in ("loss", "accept_len") if isinstance(rec.get(k), (int, float))}
        self._sample()
        self.write()

    def end(self, how: str, step: int, detail: str | None = None, stop: dict | None = None) -> None:
        """finished | stopping (a signal came; the checkpoint is being written) | stopped (by a signal, after a
        checkpoint; `stop`: where the stop's seconds went) | crashed (an exception here) | interrupted."""
        self.data["ended"] = {"how": how, "step": step, "detail": detail, "rank": 0 if how == "crashed" else None,
                              **({"stop": stop} if stop else {})}
        self._sample()
        self.write()


def record_crash(output_dir: str | Path, rank: int, role: str, gpu: str | None, detail: str) -> None:
    """The split launcher's word on a run that died: which rank, its role and GPU (keeps the rank's own error)."""
    path = Path(output_dir) / OUTCOME_NAME
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict):  # the run died before its trainer started: an outcome that says only that
        try:
            gate_id = (json.loads((Path(output_dir) / SNAPSHOT_NAME).read_text()).get("run") or {}).get("gate_id")
        except (OSError, ValueError, AttributeError):
            return
        data = {"format": OUTCOME_FORMAT, "gate_id": gate_id, "started_utc": None, "step": None, "rows": 0}
    ended = data.get("ended") or {}
    own = ended.get("detail") if ended.get("how") == "crashed" and ended.get("rank") == rank else None
    data["ended"] = {"how": "crashed", "step": data.get("step"), "rank": rank, "role": role, "gpu": gpu,
                     "detail": f"{detail}" + (f": {own}" if own else "")}
    data["updated_utc"] = now_utc()
    try:
        _write_json(path, data)
    except OSError:
        pass


def _parse_utc(text) -> float | None:
    try:
        return float(calendar.timegm(time.strptime(str(text), "%Y-%m-%dT%H:%M:%SZ")))
    except (TypeError, ValueError):
        return None
