"""``Context``: every fact the checks judge, in one dataclass. Every field has a default, so tests state only
what matters and assert verdicts."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from dflash.config import RunConfig
from dflash.memory.shape import TargetShape
from preflight.facts.dataset import Dataset
from preflight.facts.environment import EnvIdentity, Records, SyncRecord, TorchBuild
from preflight.facts.gpus import GpuFacts
from preflight.facts.overhead import Overhead
from preflight.facts.paths import LibDir, PathEntry
from preflight.facts.run import Disk, RunDir
from preflight.facts.source import CompileCache, ModelSource
from preflight.lockfile import LockFile, parse_lock
from preflight.nvml import Gpu, resolve_gpu, visible_gpus
from preflight.profiles import Profile


@dataclass
class Context:
    """Everything the checks judge. Every field has a default so tests can state only what matters."""

    profile_name: str
    profile: Profile | None = None
    profile_error: str | None = None
    lock_file: str = ""
    lock_text: str | None = None  # None: the lock file is missing
    config: RunConfig | None = None
    config_path: str | None = None
    resume_intent: str | None = None  # "resume" | "fresh" | None
    distributions: dict[str, list[str]] = field(default_factory=dict)  # canonical name -> installed versions
    torch: TorchBuild | None = None
    env: dict[str, str] = field(default_factory=dict)
    path_entries: list[PathEntry] = field(default_factory=list)
    ld_dirs: list[LibDir] = field(default_factory=list)
    env_identity: EnvIdentity | None = None  # None: not gathered (tests), nothing judged about it
    records: Records | None = None  # RECORD verification of the GPU stack and target code; None: not gathered
    sync_record: SyncRecord | None = None  # RECORDs against the last checked sync's record; None: not gathered
    ld_cache: list[LibDir] | None = None  # CUDA libraries in `ldconfig -p`, by folder; None: not asked or no ldconfig
    gpus: GpuFacts = field(default_factory=lambda: GpuFacts(error="NVML not queried"))
    model_source: ModelSource = field(default_factory=lambda: ModelSource(mode="none"))
    compile_cache: CompileCache | None = None
    target_shape: TargetShape | None = None  # the target's sizes (dflash.memory.shape.load_target_shape), when readable
    target_error: str | None = None  # why they are not: the file, the problem and the fix
    target_custom_code: str | None = None  # why loading the target would be refused: it needs its own code
    target_weights: list[str] | None = None  # weight files in target.path (dflash.models.weights); None: not gathered
    run_dir: RunDir | None = None
    dataset: Dataset | None = None
    disk: Disk | None = None
    host: dict = field(default_factory=dict)
    own_gpus: dict[str, str] | None = None  # a torchrun rank checks only its GPU: {cuda index: role}
    overhead: Overhead | None = None  # the probe's memory outside torch per GPU (preflight.probe); None: not probed

    def assigned_gpus(self) -> dict[str, str]:
        """GPU name in the run config -> its role (dflash.config.TopologyConfig.gpu_roles); a torchrun rank its own."""
        if self.own_gpus is not None:
            return self.own_gpus
        return self.config.topology.gpu_roles

    def resolved_gpus(self) -> list[tuple[str, str, Gpu | None, str | None]]:
        """(name, role, the GPU it resolves to or None, why not) for each assigned GPU, through CUDA_VISIBLE_DEVICES
        as the CUDA runtime maps it (preflight.nvml); needs the NVML snapshot."""
        snap = self.gpus.snapshot
        visible, _ = visible_gpus(snap.gpus, self.gpus.cuda_visible_devices)
        rows = []
        for name, role in self.assigned_gpus().items():
            gpu, why = resolve_gpu(name, visible, snap.gpus)
            rows.append((name, role, gpu, why))
        return rows

    @cached_property
    def lock(self) -> LockFile | None:
        return parse_lock(self.lock_text) if self.lock_text is not None else None
