"""The one definition of a training step: features in, drafter loss, optimizer step, lr schedule.

Every layout runs these same functions: the co-located trainer, split drafter ranks (their
features arrive from target ranks), the feature cache, and the benches. A step is

    lr = peak * cosine_lr(step)        zero_grad
    for each of this rank's batches:   features -> micro_step (anchors, blocks, drafter, loss) -> backward
    clip grad norm                     optimizer.step()

The math of one batch lives in dflash.train.loss; what feeds it features, in dflash.train.features.
"""

from __future__ import annotations

import torch

from dflash.config import RunConfig
from dflash.data.plan import cosine_lr
from dflash.train.loss import drafter_step_math

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
