"""How the drafter is held by several drafter ranks: the one wrap site of the trainer.

    par = wrap(drafter, mode, group, device)   # mode: "none" (one rank) | "ddp" | "fsdp2"
    optimizer = build_optimizer(drafter, cfg)  # after wrap: under fsdp2 its state is sharded too
    with par.accumulating(last):               # one micro-batch: gradients synced on the last one only (ddp)
        loss = micro_step(par.module, ...); loss.backward()
    norm = par.grad_norm()                     # the global norm, a plain device tensor
    weights, opt_state = par.full_state(optimizer, keep)   # a save/export: collective under fsdp2, one tensor at a time

`fully_shard` changes the drafter in place (its class and its parameters, now DTensors), so nothing outside this
module asks `model is drafter`; it asks `par`. Under fsdp2 every full-state operation is a collective: every rank
calls it in the same order, and only the tensors `keep` copies (rank 0's host buffers) survive it. DTensors never
leave this module: the state it hands out is plain tensors, the files a one-GPU run writes.

Under fsdp2 the gradients are reduce-scattered after every micro-batch (the sharded accumulation the memory model
counts), never accumulated unsharded; on CUDA parameters are all-gathered in bf16 and gradients reduced in fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from dflash.train.step import grad_norm as _plain_grad_norm

MODES = ("none", "ddp", "fsdp2")


def is_fake(group) -> bool:
    """A fake process group (torch's `FakeStore`, backend "fake"): one process stands for rank r of N at its true
    memory and compute, its collectives do nothing. Metrics are this rank's own; weights other ranks would hold are
    garbage, so the run measures and trains nothing."""
    return group is not None and dist.get_backend(group) == "fake"


class Single:
    """One drafter rank: the bare drafter, nothing to reduce."""

    mode = "none"
    zero_to_none = True  # grads freed between steps, allocated again by backward

    def __init__(self, drafter: torch.nn.Module, group=None):
        self.drafter, self.module, self.group = drafter, drafter, group

    def accumulating(self, last: bool):
        return contextlib.nullcontext()

    def warm_backward(self):
        """The context of a warm-up backward (gradients dropped after it)."""
        return contextlib.nullcontext()

    def grad_norm(self) -> torch.Tensor:
        return _plain_grad_norm(self.drafter)

    def nonfinite_params(self) -> list[str]:
        """Names of parameters holding an inf or nan (one read of the device)."""
        named = list(self.drafter.named_parameters())
        ok = torch.stack([torch.isfinite(p).all() for _, p in named]).tolist()
        return [name for (name, _), good in zip(named, ok) if not good]

    def full_state(self, optimizer, keep: Callable | None = None) -> tuple[dict, dict]:
        """(weights, optimizer state) as a one-GPU run holds them; `keep(key, tensor)` maps each tensor to what is
        kept (a host copy, say; identity when None). Key: ("weights", name) or the optimizer state's path."""
        keep = keep or (lambda _key, t: t)
        return self.full_weights(keep), _map_tree("optimizer", optimizer.state_dict(), keep)

    def full_weights(self, keep: Callable | None = None) -> dict:
        """The drafter's weights as a one-GPU run holds them (state_dict names), each through `keep`."""
        keep = keep or (lambda _key, t: t)
        return {k: keep(("weights", k), v) for k, v in self.drafter.state_dict().items()}

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)

    def replica_max_diff(self) -> float | None:
        return None


class Ddp(Single):
    """A full replica per rank, DDP averaging the gradients; rank 0's weights are broadcast when it is built."""

    mode = "ddp"
    zero_to_none = False  # grads are views of DDP's buckets: zeroed in place (one fp32 copy of them, not two)

    def __init__(self, drafter: torch.nn.Module, group, device: torch.device):
        super().__init__(drafter, group)
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.module = DDP(drafter, process_group=group, gradient_as_bucket_view=True,
                          device_ids=[device.index] if device.type == "cuda" else None)

    def accumulating(self, last: bool):
        return contextlib.nullcontext() if last else self.module.no_sync()

    def warm_backward(self):
        # the warm-up runs the bare drafter, never DDP's forward: its gradient hooks reduce nothing
        return self.module.no_sync()

    def replica_max_diff(self) -> float:
        flat = torch.cat([p.detach().flatten() for p in self.drafter.parameters()])
        world = dist.get_world_size(self.group)
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat, group=self.group)
        return max(float((g - gathered[0]).abs().max()) for g in gathered)


class Fsdp2(Single):
    """`fully_shard` per drafter layer and once at the root (fc, norms): parameters, gradients and AdamW state are
    1/N per rank; the frozen target (embedding and lm_head included) stays whole on every rank."""

    mode = "fsdp2"
    zero_to_none = True

    def __init__(self, drafter: torch.nn.Module, group, device: torch.device):
        super().__init__(drafter, group)
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        _broadcast_from_first(drafter, group)  # DDP does it when built; fully_shard does not
        mesh = DeviceMesh.from_group(group, device.type)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if device.type == "cuda" else MixedPrecisionPolicy()  # CPU: fp32 throughout, as autocast is off there
        for layer in drafter.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
        fully_shard(drafter, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
        self.module = drafter

    def grad_norm(self) -> torch.Tensor:
        norm = _plain_grad_norm(self.drafter)  # a Replicate DTensor: the shards' norms already reduced
        return norm.full_tensor() if _is_dtensor(norm) else norm

    def nonfinite_params(self) -> list[str]:
        named = list(self.drafter.named_parameters())
        bad = torch.stack([(~torch.isfinite(_local(p))).any() for _, p in named]).float()
        if not is_fake(self.group):
            dist.all_reduce(bad, group=self.group)
        return [name for (name, _), b in zip(named, bad.tolist()) if b > 0]

    def full_state(self, optimizer, keep: Callable | None = None) -> tuple[dict, dict]:
        return self.full_weights(keep), _map_tree("optimizer", optimizer.state_dict(), self._gathering(keep))

    def full_weights(self, keep: Callable | None = None) -> dict:
        gathered = self._gathering(keep)
        return {k: gathered(("weights", k), v) for k, v in self.drafter.state_dict().items()}

    @staticmethod
    def _gathering(keep: Callable | None) -> Callable:
        keep = keep or (lambda _key, t: t)
        return lambda key, t: keep(key, t.full_tensor() if _is_dtensor(t) else t)  # one all-gather at a time

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        """A full optimizer state (a checkpoint of any world size) onto this rank's shards: each moment becomes a
        DTensor placed as its parameter is, from this rank's own copy (no communication)."""
        from torch.distributed.tensor import distribute_tensor

        params = list(self.drafter.parameters())
        sharded = {"param_groups": state["param_groups"], "state": {}}
        for i, per in state["state"].items():
            p = params[int(i)]
            sharded["state"][i] = {
                k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                if isinstance(v, torch.Tensor) and v.shape == p.shape else v
                for k, v in per.items()
            }
        optimizer.load_state_dict(sharded)


def wrap(drafter: torch.nn.Module, mode: str, group, device: torch.device) -> Single:
    """The drafter held as `mode` over `group` (None or mode "none": one rank). Weights are loaded before this."""
    if mode not in MODES:
        raise ValueError(f"data-parallel mode {mode!r} is not one of {MODES}")
    if group is None or dist.get_world_size(group) == 1 or mode == "none":
        return Single(drafter, group)
    return Fsdp2(drafter, group, device) if mode == "fsdp2" else Ddp(drafter, group, device)


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _broadcast_from_first(module: torch.nn.Module, group) -> None:
    """Every rank starts from the first rank's weights (the same seed draws the same ones: this makes it a rule)."""
    if is_fake(group):
        return
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=src, group=group)


def _map_tree(key, value, fn):
    """`value` with fn(key, tensor) in place of each tensor, keyed as dflash.runs.checkpoint.HostCopies keys them."""
    if isinstance(value, torch.Tensor):
        return fn(key, value)
    if isinstance(value, dict):
        return {k: _map_tree((key, k), v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tree((key, i), v, fn) for i, v in enumerate(value))
    return value
