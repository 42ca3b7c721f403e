"""DFlash block drafter for Hugging Face transformers, shipped as `dflash.py` in every drafter folder.

A drafter folder (config.json + model.safetensors + this file) loads with

    from transformers import AutoModel
    drafter = AutoModel.from_pretrained(folder, trust_remote_code=True)   # config.json auto_map -> this class
    hidden = drafter(noise_embedding, target_hidden)                       # [B, block, hidden], before the lm_head

The math is the trainer's (dflash/models/drafter.py), written out with no import of the dflash package:
context = RMSNorm(fc(target hidden states of the chosen layers)); each layer takes Q from the block,
K/V from [context ; block]; qk-norm; RoPE; a block sees the context before its first slot (in
sliding_attention layers only positions > its own position - sliding_window) and its whole block.
The embedding of the block tokens and the lm_head are the target's: this model holds neither.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)  # float32 math at least (bf16 upcast, float64 kept)
        x32 = x.to(dtype)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(dtype) * x32).to(x.dtype)


def rope_cos_sin(pos_BL: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [B, L, 1, D], half-split (rotate_half) convention."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=pos_BL.device, dtype=torch.float32) / head_dim)
    angles_BLd = pos_BL.float()[..., None] * inv_freq
    angles_BLD = torch.cat([angles_BLd, angles_BLd], dim=-1)
    return angles_BLD.cos().to(dtype)[:, :, None], angles_BLD.sin().to(dtype)[:, :, None]


def apply_rope(x_BLHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BLHD.chunk(2, dim=-1)
    return x_BLHD * cos + torch.cat([-x2, x1], dim=-1) * sin


class DFlashAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        H = config.hidden_size
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = D = getattr(config, "head_dim", None) or H // self.n_heads
        self.q_proj = nn.Linear(H, self.n_heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv * D, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv * D, bias=False)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=False)
        self.q_norm = DFlashRMSNorm(D, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(D, config.rms_norm_eps)

    def forward(self, x_BQH, ctx_BSH, rope_q, rope_kv, mask_B1QL):
        B, Q, _ = x_BQH.shape
        L = ctx_BSH.shape[1] + Q
        q = self.q_norm(self.q_proj(x_BQH).view(B, Q, self.n_heads, self.head_dim))
        k = torch.cat([self.k_proj(ctx_BSH), self.k_proj(x_BQH)], dim=1).view(B, L, self.n_kv, self.head_dim)
        v = torch.cat([self.v_proj(ctx_BSH), self.v_proj(x_BQH)], dim=1).view(B, L, self.n_kv, self.head_dim)
        q = apply_rope(q, *rope_q)
        k = apply_rope(self.k_norm(k), *rope_kv)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask_B1QL,
                                             enable_gqa=self.n_heads != self.n_kv)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.n_heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, x_BQH, ctx_BSH, rope_q, rope_kv, mask_B1QL):
        x_BQH = x_BQH + self.self_attn(self.input_layernorm(x_BQH), ctx_BSH, rope_q, rope_kv, mask_B1QL)
        return x_BQH + self.mlp(self.post_attention_layernorm(x_BQH))


def _rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config):
        super().__init__(config)
        dflash = getattr(config, "dflash_config", None) or {}
        self.target_layer_ids = list(dflash["target_layer_ids"])
        self.mask_token_id = dflash.get("mask_token_id")
        self.block_size = config.block_size
        self.layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        self.sliding_window = getattr(config, "sliding_window", None)
        self.theta = _rope_theta(config)
        H = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=getattr(self.config, "initializer_range", 0.02))
        elif isinstance(module, DFlashRMSNorm):
            nn.init.ones_(module.weight)

    def masks(self, pos_q_BQ: torch.Tensor, pos_ctx_BS: torch.Tensor) -> dict[str, torch.Tensor]:
        """{layer type: bool [B, 1, Q, S+Q]}: context before the block's first position (and, sliding, > pos_q - window)."""
        B, Q = pos_q_BQ.shape
        sees_ctx = pos_ctx_BS[:, None, :] < pos_q_BQ[:, :1, None]
        block = torch.ones(B, Q, Q, dtype=torch.bool, device=pos_q_BQ.device)
        out = {"full_attention": torch.cat([sees_ctx.expand(B, Q, -1), block], dim=2)[:, None]}
        if "sliding_attention" in self.layer_types:
            in_window = pos_ctx_BS[:, None, :] > pos_q_BQ[:, :, None] - self.sliding_window
            out["sliding_attention"] = torch.cat([sees_ctx & in_window, block], dim=2)[:, None]
        return out

    def forward(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
        """Drafter hidden states [B, Q, H] of a block, to go through the target's lm_head.

        noise_embedding [B, Q, H]: the block's tokens (slot 0 the last accepted token, the others the
        mask token) embedded with the target's embedding. target_hidden [B, S, n*H]: the chosen target
        layers' hidden states at the S context positions, concatenated. position_ids [B, S + Q]: the
        context's positions then the block's (default 0 .. S+Q-1: the block right after the context).
        """
        B, Q, _ = noise_embedding.shape
        S = target_hidden.shape[1]
        if position_ids is None:
            position_ids = torch.arange(S + Q, device=noise_embedding.device).expand(B, S + Q)
        pos_ctx, pos_q = position_ids[:, :S], position_ids[:, S:]
        dtype = self.fc.weight.dtype
        ctx_BSH = self.hidden_norm(self.fc(target_hidden.to(dtype)))
        x_BQH = noise_embedding.to(dtype)
        D = self.layers[0].self_attn.head_dim
        rope_q = rope_cos_sin(pos_q, D, self.theta, dtype)
        rope_kv = tuple(torch.cat([c, q], dim=1) for c, q in zip(rope_cos_sin(pos_ctx, D, self.theta, dtype), rope_q))
        masks = self.masks(pos_q, pos_ctx)
        for layer, kind in zip(self.layers, self.layer_types):
            x_BQH = layer(x_BQH, ctx_BSH, rope_q, rope_kv, masks[kind])
        return self.norm(x_BQH)
