"""GPU facts through NVML, behind one small interface so tests can drive it with a recorded fake.

NVML is the driver's management library: querying it creates no CUDA context, so the
checking process costs no GPU memory. ``GpuInfo.snapshot()`` returns everything preflight
judges (driver, CUDA driver version, per-GPU UUID, memory and processes) as plain data;
``NvmlGpuInfo`` reads the real driver, ``FakeGpuInfo`` replays a recorded JSON dict
(``tests/data/nvml_fake_8gpu.json``; ``snapshot_to_dict`` writes that format).

``CUDA_VISIBLE_DEVICES`` is resolved here the way the CUDA runtime does: a comma list of
NVML indices or UUIDs (a unique UUID prefix is enough); an entry that names no GPU hides
it and every entry after it; an empty value hides every GPU. Run configs then name GPUs
by their index *after* that mapping, or by UUID; matching goes by UUID, never by NVML index.

Run on its own to print the snapshot: ``python -m preflight.nvml``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

NO_DRIVER = "no NVIDIA driver (NVML not found)"


class NvmlUnavailable(RuntimeError):
    """NVML could not be loaded or initialised; the message is one line."""


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str  # process name, or "?" when it lives in another PID namespace
    used_bytes: int | None  # None when the driver does not say (some containers)


@dataclass(frozen=True)
class Gpu:
    index: int  # NVML (PCI bus order) index, before CUDA_VISIBLE_DEVICES
    uuid: str  # "GPU-..." as nvidia-smi -L prints it
    name: str  # e.g. "NVIDIA H200"
    memory_total: int  # bytes
    memory_free: int  # bytes
    memory_used: int  # bytes
    compute_capability: str  # "9.0"
    pci_bus_id: str = ""
    processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True)
class NvmlSnapshot:
    driver_version: str  # e.g. "570.133.20"
    cuda_driver_version: str  # highest CUDA the driver supports, "12.8"
    gpus: tuple[Gpu, ...] = field(default_factory=tuple)


class GpuInfo(Protocol):
    """What preflight needs from the GPUs: one snapshot, or NvmlUnavailable."""

    def snapshot(self) -> NvmlSnapshot: ...


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _process_name(pid: int, nvml) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        if argv:
            return " ".join([os.path.basename(argv[0]), *argv[1:3]])[:80]
    except OSError:
        pass
    try:
        return _text(nvml.nvmlSystemGetProcessName(pid))[:80] or "?"
    except Exception:  # another PID namespace: the driver knows the pid, we cannot see it
        return "?"


class NvmlGpuInfo:
    """The real driver, through nvidia-ml-py (pynvml)."""

    def snapshot(self) -> NvmlSnapshot:
        try:
            import pynvml as nvml
        except ImportError:
            raise NvmlUnavailable(f"{NO_DRIVER}: nvidia-ml-py is not installed") from None
        try:
            nvml.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            detail = str(e) or type(e).__name__
            if "not found" in detail.lower():
                raise NvmlUnavailable(NO_DRIVER) from None
            raise NvmlUnavailable(f"NVML failed to initialise: {detail}") from None
        try:
            cuda = nvml.nvmlSystemGetCudaDriverVersion()
            gpus = tuple(self._gpu(nvml, i) for i in range(nvml.nvmlDeviceGetCount()))
            return NvmlSnapshot(
                driver_version=_text(nvml.nvmlSystemGetDriverVersion()),
                cuda_driver_version=f"{cuda // 1000}.{cuda % 1000 // 10}",
                gpus=gpus,
            )
        except Exception as e:
            raise NvmlUnavailable(f"NVML query failed: {e}") from None
        finally:
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass

    @staticmethod
    def _gpu(nvml, index: int) -> Gpu:
        h = nvml.nvmlDeviceGetHandleByIndex(index)
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
        procs: dict[int, GpuProcess] = {}
        for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                listed = getattr(nvml, getter)(h)
            except Exception:
                continue
            for p in listed:
                used = getattr(p, "usedGpuMemory", None)
                used = used if isinstance(used, int) and used < 2**63 else None  # NVML_VALUE_NOT_AVAILABLE
                if p.pid not in procs:
                    procs[p.pid] = GpuProcess(p.pid, _process_name(p.pid, nvml), used)
        try:
            bus = _text(nvml.nvmlDeviceGetPciInfo(h).busId)
        except Exception:
            bus = ""
        return Gpu(
            index=index,
            uuid=_text(nvml.nvmlDeviceGetUUID(h)),
            name=_text(nvml.nvmlDeviceGetName(h)),
            memory_total=int(mem.total),
            memory_free=int(mem.free),
            memory_used=int(mem.used),
            compute_capability=f"{major}.{minor}",
            pci_bus_id=bus,
            processes=tuple(sorted(procs.values(), key=lambda p: p.pid)),
        )


class FakeGpuInfo:
    """A recorded snapshot (the dict ``snapshot_to_dict`` writes); ``None`` = a machine without NVML."""

    def __init__(self, recorded: dict | None):
        self.recorded = recorded

    @classmethod
    def from_json(cls, path: str | Path) -> FakeGpuInfo:
        return cls(json.loads(Path(path).read_text()))

    def snapshot(self) -> NvmlSnapshot:
        if self.recorded is None:
            raise NvmlUnavailable(NO_DRIVER)
        return snapshot_from_dict(self.recorded)


def snapshot_from_dict(d: dict) -> NvmlSnapshot:
    gpus = []
    for i, g in enumerate(d.get("gpus", [])):
        procs = tuple(GpuProcess(int(p["pid"]), str(p.get("name", "?")), p.get("used_bytes"))
                      for p in g.get("processes", []))
        total = int(g["memory_total"])
        free = int(g["memory_free"])
        gpus.append(Gpu(
            index=int(g.get("index", i)),
            uuid=str(g["uuid"]),
            name=str(g.get("name", "NVIDIA GPU")),
            memory_total=total,
            memory_free=free,
            memory_used=int(g.get("memory_used", total - free)),
            compute_capability=str(g.get("compute_capability", "0.0")),
            pci_bus_id=str(g.get("pci_bus_id", "")),
            processes=procs,
        ))
    return NvmlSnapshot(str(d["driver_version"]), str(d["cuda_driver_version"]), tuple(gpus))


def snapshot_to_dict(snap: NvmlSnapshot) -> dict:
    d = asdict(snap)
    d["gpus"] = [dict(g, processes=list(g["processes"])) for g in d["gpus"]]
    return d


def visible_gpus(gpus: tuple[Gpu, ...] | list[Gpu], cuda_visible_devices: str | None) -> tuple[list[Gpu], str | None]:
    """GPUs the CUDA runtime would expose, in CUDA order, and a note on ignored entries (or None)."""
    if cuda_visible_devices is None:
        return list(gpus), None
    out: list[Gpu] = []
    for pos, raw in enumerate(cuda_visible_devices.split(",")):
        entry = raw.strip()
        gpu = _match_physical(entry, gpus)
        if gpu is None:
            rest = cuda_visible_devices.split(",")[pos:]
            if entry == "" and pos == 0 and len(rest) == 1:
                return [], "CUDA_VISIBLE_DEVICES is empty: every GPU is hidden"
            return out, (f"CUDA_VISIBLE_DEVICES entry {entry!r} names no GPU; CUDA ignores it and every entry "
                         f"after it ({','.join(r.strip() for r in rest)})")
        if gpu in out:
            return out, f"CUDA_VISIBLE_DEVICES names {entry!r} twice; CUDA ignores the repeat and every entry after it"
        out.append(gpu)
    return out, None


def _match_physical(entry: str, gpus) -> Gpu | None:
    if entry.isdigit():
        idx = int(entry)
        return next((g for g in gpus if g.index == idx), None)
    return _match_uuid(entry, gpus)


def _match_uuid(entry: str, gpus) -> Gpu | None:
    if not entry:
        return None
    key = entry if entry.upper().startswith("GPU-") else f"GPU-{entry}"
    hits = [g for g in gpus if g.uuid.lower().startswith(key.lower())]
    return hits[0] if len(hits) == 1 else None


def resolve_gpu(name: str, visible: list[Gpu], all_gpus) -> tuple[Gpu | None, str | None]:
    """A run config's GPU name (index after CUDA_VISIBLE_DEVICES, or UUID) -> (GPU, why not)."""
    name = name.strip()
    if name.isdigit():
        i = int(name)
        if i < len(visible):
            return visible[i], None
        return None, f"GPU {name} is not visible ({len(visible)} visible after CUDA_VISIBLE_DEVICES)"
    gpu = _match_uuid(name, visible)
    if gpu is not None:
        return gpu, None
    hidden = _match_uuid(name, all_gpus)
    if hidden is not None:
        return None, f"GPU {name} exists (NVML index {hidden.index}) but CUDA_VISIBLE_DEVICES hides it"
    return None, f"GPU {name} matches no GPU on this machine"


if __name__ == "__main__":
    try:
        print(json.dumps(snapshot_to_dict(NvmlGpuInfo().snapshot()), indent=2))
    except NvmlUnavailable as e:
        raise SystemExit(f"preflight.nvml: {e}") from None
