"""The processes of a multi-process run (split, or co-located data parallel): one rank per GPU of the config.

Ranks 0..D-1 train the drafter (the GPUs of `TopologyConfig.trainer_gpus`), ranks D..D+T-1 hold the frozen target
(`target_gpus`); each rank's role is its GPU's, as `TopologyConfig.gpu_roles` gives it (the one rule for roles).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.config import GpuRole, RunConfig


@dataclass(frozen=True)
class Rank:
    """One process of a split run: its rank and what it does (drafter ranks first, then target ranks)."""

    rank: int
    world: int
    n_drafters: int  # ranks training the drafter: 0..n_drafters-1
    n_targets: int  # ranks holding only the target: n_drafters..world-1 (0 in co-located data parallel)
    role: GpuRole  # its GPU's role: drafter, target, or colocated (its own target and a drafter replica)
    gpu: str  # its GPU as the config names it (index after CUDA_VISIBLE_DEVICES, or UUID)

    @property
    def is_drafter(self) -> bool:
        return self.role != "target"

    @property
    def index(self) -> int:
        """Index within its role (drafter d or target t)."""
        return self.rank if self.is_drafter else self.rank - self.n_drafters


def ranks_for(cfg: RunConfig) -> list[Rank]:
    roles = cfg.topology.gpu_roles
    nt = sum(role == "target" for role in roles.values())
    return [Rank(r, len(roles), len(roles) - nt, nt, role, gpu) for r, (gpu, role) in enumerate(roles.items())]
