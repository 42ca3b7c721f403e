"""The memory a run's process holds on a GPU outside torch's allocator, as the probe measured it (a fact).

``preflight.probe`` runs ``preflight.probe_gpu`` in a subprocess on each assigned GPU and fills an ``Overhead``;
the gpu-memory check reads it, the snapshot records it. Pure data and arithmetic: no subprocess, no torch.

Outside torch, per reading = the process's NVML used bytes - torch's reserved bytes (what vLLM budgets at start-up
as device used - free - torch reserved). When NVML does not list the probe's pid (another PID namespace), the card's
used bytes less what it read before the probe touched it stand in for the process's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Literal

PROBE_VERSION = 1  # bump when what a step loads changes: every cached probe is then measured again
Source = Literal["measured", "cached", "constant"]


@dataclass(frozen=True)
class MachineState:
    """What the overhead outside torch depends on: a probe cached for one state is never used for another."""

    torch: str | None  # the installed build, "2.10.0+cu128"
    cuda: str | None  # the CUDA it targets
    driver: str  # NVIDIA driver
    gpu: str  # GPU model name
    gpu_total_bytes: int
    nccl: str | None  # the nvidia-nccl distribution's version (None: not installed)
    steps: tuple[str, ...]  # what the probe loads (preflight.probe_gpu.STEPS)
    env: tuple[tuple[str, str], ...] = ()  # CUDA_MODULE_LOADING and NCCL_* as the run sets them
    probe: int = PROBE_VERSION

    def to_dict(self) -> dict:
        d = asdict(self)
        d["steps"], d["env"] = list(self.steps), {k: v for k, v in self.env}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> MachineState:
        return cls(torch=d.get("torch"), cuda=d.get("cuda"), driver=str(d["driver"]), gpu=str(d["gpu"]),
                   gpu_total_bytes=int(d["gpu_total_bytes"]), nccl=d.get("nccl"), steps=tuple(d["steps"]),
                   env=tuple(sorted((str(k), str(v)) for k, v in (d.get("env") or {}).items())),
                   probe=int(d.get("probe", 0)))

    def key(self) -> str:
        """The cache file's name: a digest of every field."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:20]


def state_changes(a: dict | None, b: dict | None) -> list[str]:
    """'torch 2.10.0+cu128 -> 2.10.0+cu130', one per field of two recorded machine states that differs."""
    if not a or not b:
        return []
    out = []
    for k in ("torch", "driver", "nccl", "gpu", "env", "steps"):
        x, y = a.get(k), b.get(k)
        if x != y:
            shown = {"steps": lambda v: ",".join(v or []) or "none",
                     "env": lambda v: " ".join(f"{n}={w}" for n, w in sorted((v or {}).items())) or "none"}
            fmt = shown.get(k, lambda v: "none" if v is None else str(v))
            out.append(f"{'probe steps' if k == 'steps' else k} {fmt(x)} -> {fmt(y)}")
    return out


@dataclass
class GpuOverhead:
    """One GPU's overhead outside torch: measured now, read from the cache, or the calibrated constant (with why)."""

    uuid: str
    source: Source
    context_bytes: int | None = None  # outside torch with everything but NCCL loaded (the model's CUDA context term)
    nccl_bytes: int | None = None  # what the NCCL communicator added (None: no NCCL step)
    torch_reserved_bytes: int | None = None  # torch's reserved bytes at the last reading
    process_bytes: int | None = None  # NVML used bytes of the probe's process at the last reading
    steps: list[dict] = field(default_factory=list)  # the probe's readings, one per step
    state: dict | None = None  # the MachineState it was measured in
    note: str | None = None  # why the constant is used (busy GPU, probe failed), or a cache note
    time_utc: str | None = None  # when it was measured
    pid: int | None = None  # the probe's process (gone when the probe returned)

    @property
    def measured(self) -> bool:
        return self.context_bytes is not None

    @property
    def outside_torch_bytes(self) -> int | None:
        """The whole term outside torch the run's process pays on this GPU: context + kernels + NCCL."""
        return None if self.context_bytes is None else self.context_bytes + (self.nccl_bytes or 0)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["outside_torch_bytes"] = self.outside_torch_bytes
        return d

    @classmethod
    def from_dict(cls, d: dict) -> GpuOverhead:
        keys = ("uuid", "source", "context_bytes", "nccl_bytes", "torch_reserved_bytes", "process_bytes", "steps",
                "state", "note", "time_utc", "pid")
        return cls(**{k: d[k] for k in keys if k in d})


@dataclass
class Overhead:
    """The probe's facts for a run: per GPU UUID, and one line per thing worth saying (cache, busy, failures)."""

    gpus: dict[str, GpuOverhead] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"gpus": {u: g.to_dict() for u, g in self.gpus.items()}, "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, d: dict) -> Overhead:
        return cls({u: GpuOverhead.from_dict(dict(g, uuid=g.get("uuid", u))) for u, g in (d.get("gpus") or {}).items()},
                   [str(n) for n in d.get("notes") or []])


def outside_torch(reading: dict, baseline: int | None) -> int | None:
    """One reading's bytes outside torch: the process's NVML bytes (else the card's growth since the baseline) less
    torch's reserved bytes; None when neither can be read."""
    used = reading.get("process_bytes")
    if used is None and baseline is not None and reading.get("device_used_bytes") is not None:
        used = reading["device_used_bytes"] - baseline
    if used is None or reading.get("torch_reserved_bytes") is None:
        return None
    return max(0, int(used) - int(reading["torch_reserved_bytes"]))


def from_probe(uuid: str, out: dict, state: MachineState, time_utc: str | None = None) -> GpuOverhead:
    """A GpuOverhead from the probe subprocess's JSON (its readings in step order); raises ValueError when the JSON
    carries no usable reading."""
    steps = list(out.get("steps") or [])
    base = out.get("baseline_device_used_bytes")
    before_nccl = [r for r in steps if r.get("step") != "nccl"]
    nccl = [r for r in steps if r.get("step") == "nccl"]
    if not before_nccl:
        raise ValueError("the probe returned no reading")
    context = outside_torch(before_nccl[-1], base)
    if context is None:
        raise ValueError("NVML listed neither the probe's process nor the card's used memory")
    nccl_bytes = None
    if nccl:
        with_nccl = outside_torch(nccl[-1], base)
        nccl_bytes = None if with_nccl is None else max(0, with_nccl - context)
    last = steps[-1]
    return GpuOverhead(uuid=uuid, source="measured", context_bytes=context, nccl_bytes=nccl_bytes,
                       torch_reserved_bytes=last.get("torch_reserved_bytes"), process_bytes=last.get("process_bytes"),
                       steps=steps, state=state.to_dict(), time_utc=time_utc, pid=out.get("pid"),
                       note="; ".join(f"{k}: {v}" for k, v in (out.get("skipped") or {}).items()) or None)
