"""The one definition of a training step: features in, drafter loss, optimizer step, lr schedule.

Every layout runs these same functions: the co-located trainer, split drafter ranks (their
features arrive from target ranks), the feature cache, and the benches. A step is

    lr = peak * cosine_lr(step)        zero_grad
    for each of this rank's batches:   features -> micro_step (anchors, blocks, drafter, loss) -> backward
    clip grad norm                     optimizer.step()

The math of one batch lives in dflash.train.loss; what feeds it features lives here (`LocalTarget`,
`CachedTarget`) and in dflash.train.split (`RemoteTargets`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from dflash.config import RunConfig, default_target_layer_ids
from dflash.data.plan import cosine_lr
from dflash.models.target import compile_target, load_target, target_embed_and_head, torch_dtype
from dflash.train.loss import drafter_step_math, target_step

ADAMW_BETAS = (0.9, 0.95)












def build_optimizer(drafter: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """AdamW over the drafter's fp32 master weights, fused (one kernel per dtype group, on CUDA and CPU alike):
    its grad_scale / found_inf inputs are how `clip_and_step` clips and skips without a pass of its own."""
    return torch.optim.AdamW(drafter.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                             betas=ADAMW_BETAS, fused=True)


def set_lr(optimizer: torch.optim.Optimizer, cfg: RunConfig, step: int, total: int) -> float:
    lr = cfg.train.lr * cosine_lr(step, total, cfg.train.warmup_ratio)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def grad_norm(drafter: torch.nn.Module) -> torch.Tensor:
    """The global L2 norm of the drafter's gradients, as a device tensor (nothing waits for the GPU)."""
    return torch.nn.utils.get_total_norm([p.grad for p in drafter.parameters() if p.grad is not None])


def clip_and_step(drafter: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: RunConfig,
                  norm: torch.Tensor | None = None) -> torch.Tensor:
    """Step with the gradient clipped to train.grad_clip (> 0); returns the pre-clip norm (`grad_norm`, or the
    one given) as a device tensor: nothing here waits for the GPU.

    The clip is the fused AdamW's grad_scale (it divides each gradient by max(1, norm / grad_clip) as it reads
    it: no pass over the gradients of its own), and a non-finite norm is its found_inf: that update is skipped
    inside the kernel (weights, moments and step count untouched), so a nan gradient never reaches the weights.
    """
    norm = grad_norm(drafter) if norm is None else norm
    if cfg.train.grad_clip > 0:
        optimizer.grad_scale = ((norm + 1e-6) / cfg.train.grad_clip).clamp_min(1.0).float()
    optimizer.found_inf = (~torch.isfinite(norm)).float()
    optimizer.step()
    return norm


def anchor_generator(cfg: RunConfig, device: torch.device, batch_index: int) -> torch.Generator:
    """Anchors depend only on (seed, global batch index): resumes and split runs draw the same ones."""
    return torch.Generator(device=device).manual_seed(cfg.train.seed * 1_000_003 + batch_index)


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def micro_step(drafter, embed_VH, head_VH, batch: dict, features, cfg: RunConfig, device: torch.device,
               attn_backend: str, batch_index: int):
    """Forward + loss of one batch (graph kept for backward), given the target's (context, last hidden);
    its metrics stay on the device (`dflash.train.loss.read_metrics`)."""
    context_BSF, last_BSH = features
    with autocast(device):
        return drafter_step_math(drafter, embed_VH, head_VH, batch, context_BSF, last_BSH, cfg,
                                 anchor_generator(cfg, device, batch_index), attn_backend)


def average_metrics(parts: list[dict]) -> dict:
    """Mean metrics over a step's batches (lists averaged element-wise)."""
    out: dict = {}
    for key, value in parts[0].items():
        values = [m[key] for m in parts]
        if isinstance(value, list):
            out[key] = [round(sum(col) / len(col), 4) for col in zip(*values)]
        elif isinstance(value, (int, float)):
            out[key] = sum(values) / len(values)
    return out


def feature_layer_ids(cfg: RunConfig, num_target_layers: int) -> list[int]:
    """The target layers the drafter reads: the config's list, else spread evenly (dflash.config)."""
    return list(cfg.drafter.target_layer_ids or default_target_layer_ids(num_target_layers, cfg.drafter.num_layers))


def resolve_mask_token_id(cfg: RunConfig, target_config) -> int:
    if cfg.drafter.mask_token_id is not None:
        return cfg.drafter.mask_token_id
    vocab = target_config.vocab_size
    pad = getattr(target_config, "pad_token_id", None)
    # A token the data never asks the drafter to predict: the pad token if there is one, else the last id.
    return int(pad) if isinstance(pad, int) and 0 <= pad < vocab else vocab - 1


def pad_token_id(target_config) -> int:
    pad = getattr(target_config, "pad_token_id", None)
    return pad if isinstance(pad, int) else 0


def target_folder(path: str, log=print) -> str:
    """The target's HF folder: `smollm2` names the embedded default (converted once, then cached)."""
    if path == "smollm2":
        from dflash.models.smollm2_convert import resolve_target

        return str(resolve_target(path, log=log))
    return path


# ---------------------------------------------------------------------------------------------
# Feature sources: where a drafter step's (context, last hidden) come from


class FeatureSource(Protocol):
    """What the trainer needs from the target side, whatever the layout: every source has every member, so the
    trainer never asks which one it holds (a member with nothing to do returns {}, "" or None)."""

    target_config: object  # the target's HF config (vocab_size, hidden_size, num_hidden_layers, pad_token_id)
    model: torch.nn.Module | None  # the target when it runs in this process (held-out eval decodes with it), else None

    def frozen_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embedding [V, H], lm_head [V, H]) of the target, on the trainer's device."""

    def expect(self, k: int, batch: dict) -> None:
        """Global batch k will be asked for soon (remote targets post its receive now)."""

    def features(self, k: int, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(context [B, S, n*H], last hidden [B, S, H] or None) of global batch k, on the trainer's device."""

    def counters(self) -> dict:
        """Timing counters since the last call (summed over ranks by the trainer), for the metrics."""

    def rates(self, counters: dict, dt: float, world: int) -> dict:
        """Fields a metrics row adds from a log window's summed counters over `dt` seconds ({}: none)."""

    def rates_line(self, rec: dict) -> str:
        """What the progress line adds from those fields of metrics row `rec` ("": nothing)."""

    def describe(self) -> str:
        """One line for the run's plan."""

    def cache_bytes(self, num_tokens: int) -> int | None:
        """Bytes its feature cache grows to over `num_tokens` tokens (None: it caches nothing)."""

    def summary(self, rows: list[dict]) -> str | None:
        """Lines for the end of the run from this process's metrics rows past the first logged window (whose first
        step is mostly compilation); None: nothing to add."""


class LocalTarget:
    """The frozen target in this process: features computed on the spot."""

    def __init__(self, cfg: RunConfig, device: torch.device, log=print):
        self.cfg, self.device = cfg, device
        self.model = load_target(target_folder(cfg.target.path, log), torch_dtype(cfg.target.dtype), device,
                                 cfg.target.random_init)
        if cfg.target.compile and device.type == "cuda":
            compile_target(self.model)
        self.target_config = self.model.config
        self.layer_ids = feature_layer_ids(cfg, self.target_config.num_hidden_layers)
        self.want_last = cfg.train.kl_weight > 0

    def frozen_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return target_embed_and_head(self.model)

    def expect(self, k: int, batch: dict) -> None:
        pass

    def features(self, k: int, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        with autocast(self.device):
            return target_step(self.model, batch, self.layer_ids, self.want_last)

    def counters(self) -> dict:
        return {}

    def rates(self, counters: dict, dt: float, world: int) -> dict:
        return {}

    def rates_line(self, rec: dict) -> str:
        return ""

    def describe(self) -> str:
        return f"target {self.cfg.target.path} ({self.cfg.target.dtype}) on {self.device}, layers {self.layer_ids}"

    def cache_bytes(self, num_tokens: int) -> int | None:
        return None

    def summary(self, rows: list[dict]) -> str | None:
        return None


class CachedTarget(LocalTarget):
    """The local target, whose features of every sample seen so far are kept (train.cache_features).

    Rows are stored unpadded by sample index; a batch whose samples are all cached is rebuilt
    right-padded, as the target would have produced it (padded positions are masked anyway), so
    later epochs run the drafter alone.
    """

    def __init__(self, cfg: RunConfig, device: torch.device, log=print):
        super().__init__(cfg, device, log)
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def features(self, k: int, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids, lengths = batch["sample_ids"].tolist(), batch["lengths"].tolist()
        if any(i not in self.rows for i in ids):
            context_BSF, last_BSH = super().features(k, batch)
            for r, (i, n) in enumerate(zip(ids, lengths)):
                last = last_BSH[r, :n].clone() if last_BSH is not None else None
                self.rows.setdefault(i, (context_BSF[r, :n].clone(), last))
            return context_BSF, last_BSH
        S = batch["input_ids"].shape[1]
        pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, S - t.shape[0]))  # noqa: E731
        context_BSF = torch.stack([pad(self.rows[i][0]) for i in ids])
        last_BSH = torch.stack([pad(self.rows[i][1]) for i in ids]) if self.want_last else None
        return context_BSF, last_BSH

    def cache_bytes(self, num_tokens: int) -> int:
        H = self.target_config.hidden_size
        width = len(self.layer_ids) * H + (H if self.want_last else 0)
        return num_tokens * width * self.frozen_weights()[0].element_size()

    def describe(self) -> str:
        return super().describe() + "; features cached after their first batch (the target runs in epoch 1 only)"


def local_source(cfg: RunConfig, device: torch.device, log=print) -> LocalTarget:
    return (CachedTarget if cfg.train.cache_features else LocalTarget)(cfg, device, log)
