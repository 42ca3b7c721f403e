"""The GPUs as NVML sees them (``preflight.nvml``), with CUDA_VISIBLE_DEVICES; no CUDA context is created."""

from __future__ import annotations

from dataclasses import dataclass

from preflight.nvml import GpuInfo, NvmlSnapshot, NvmlUnavailable


@dataclass
class GpuFacts:
    snapshot: NvmlSnapshot | None = None
    error: str | None = None  # why NVML gave nothing
    cuda_visible_devices: str | None = None
    queried: bool = True  # False when the run is on CPU and NVML was not asked


def gpu_facts(provider: GpuInfo | None, env: dict[str, str]) -> GpuFacts:
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if provider is None:
        return GpuFacts(error="NVML not queried (device = cpu)", cuda_visible_devices=cvd, queried=False)
    try:
        return GpuFacts(snapshot=provider.snapshot(), cuda_visible_devices=cvd)
    except NvmlUnavailable as e:
        return GpuFacts(error=str(e), cuda_visible_devices=cvd)
