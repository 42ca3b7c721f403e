"""The DFlash drafter: a few Qwen3-style layers that draft a whole block at once.

Queries are the block tokens (slot 0 = the real anchor token, the rest the mask token),
embedded with the frozen target's embedding. Keys and values are the same projections
applied to [context ; block], where context = RMSNorm(fc(selected target hidden states)).
The output goes through the frozen target's lm_head (see dflash/train/loss.py); neither the
embedding nor the lm_head is a drafter parameter.

Saved as a Hugging Face-style folder (config.json + model.safetensors + dflash.py) with the
parameter names and config.json keys of the published DFlash drafters, so DFlash-aware serving
stacks load it, and `transformers.AutoModel.from_pretrained(folder, trust_remote_code=True)`
builds this same model from dflash.py (dflash/models/hf_drafter.py, the math of this file).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash.config import default_target_layer_ids  # noqa: F401 (also used by importers of dflash.models.drafter)
from dflash.models.attention import LAYER_TYPES, TrainMask, attend_padded
from dflash.models.fp8 import FP8_MODES, fp8_linear, prepare

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"
MODELING_FILE = "dflash.py"  # config.json auto_map points AutoModel at dflash.DFlashDraftModel in it
MODELING_SOURCE = Path(__file__).with_name("hf_drafter.py")
# Tokenizer files copied from the target into an exported drafter folder, when the target has them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass
class DFlashConfig:
    """The drafter model's own config (saved as its config.json); not the run config's [drafter] section."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    num_hidden_layers: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_target_layers: int
    max_position_embeddings: int = 32768
    layer_types: list[str] | None = None  # per layer: full_attention | sliding_attention; None = all full
    sliding_window: int | None = None  # sliding layers: a query at position i sees keys > i - sliding_window
    extra: dict = field(default_factory=dict)  # unknown config.json fields, kept on save

    def __post_init__(self):
        self.layer_types = list(self.layer_types or ["full_attention"] * self.num_hidden_layers)
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise ValueError(f"layer_types {self.layer_types} must give one of {LAYER_TYPES} for each of the "
                             f"{self.num_hidden_layers} layers")
        sliding = "sliding_attention" in self.layer_types
        if sliding and not (self.sliding_window and self.sliding_window >= self.block_size):
            raise ValueError(f"sliding_attention layers need sliding_window >= block_size ({self.block_size}), "
                             f"got {self.sliding_window}")
        if not sliding:
            self.sliding_window = None
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (slot 0 is the anchor), got {self.block_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad or not self.target_layer_ids:
            last = self.num_target_layers - 1
            raise ValueError(f"target_layer_ids {self.target_layer_ids} must be non-empty and within [0, {last}]")

    def to_hf_dict(self, dtype: torch.dtype) -> dict:
        n = self.num_hidden_layers
        out = dict(self.extra)
        out.update(
            architectures=[ARCHITECTURE],
            auto_map={"AutoModel": f"{MODELING_FILE.removesuffix('.py')}.{ARCHITECTURE}"},
            model_type="qwen3",
            block_size=self.block_size,
            dflash_config={"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id},
            num_target_layers=self.num_target_layers,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=n,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=None,
            max_position_embeddings=self.max_position_embeddings,
            hidden_act="silu",
            attention_bias=False,
            attention_dropout=0.0,
            layer_types=list(self.layer_types),
            use_sliding_window=self.sliding_window is not None,
            sliding_window=self.sliding_window,
            max_window_layers=n,
            tie_word_embeddings=False,
            use_cache=True,
            initializer_range=0.02,
            dtype=str(dtype).removeprefix("torch."),
            transformers_version=_transformers_version(),
        )
        for name in SPECIAL_IDS:  # the target's ids when the drafter was exported with it (kept in extra)
            out.setdefault(name, None)
        return out

    @classmethod
    def from_hf_dict(cls, raw: dict) -> DFlashConfig:
        raw = dict(raw)
        dflash = raw.get("dflash_config") or {}

        def pick(name, default=None):
            value = dflash.get(name, raw.get(name, default))
            if value is None:
                raise ValueError(f"drafter config.json has no {name!r} (top level or in dflash_config)")
            return value

        layer_types = raw.get("layer_types") or None
        sliding_window = raw.get("sliding_window") if "sliding_attention" in (layer_types or []) else None
        rope = raw.get("rope_parameters") or {}
        known = set(cls.__dataclass_fields__) | {"dflash_config", "rope_parameters"}
        return cls(
            hidden_size=pick("hidden_size"),
            intermediate_size=pick("intermediate_size"),
            num_attention_heads=pick("num_attention_heads"),
            num_key_value_heads=pick("num_key_value_heads", raw.get("num_attention_heads")),
            head_dim=pick("head_dim", raw["hidden_size"] // raw["num_attention_heads"]),
            rms_norm_eps=pick("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            vocab_size=pick("vocab_size"),
            num_hidden_layers=pick("num_hidden_layers"),
            block_size=pick("block_size"),
            target_layer_ids=list(pick("target_layer_ids")),
            mask_token_id=pick("mask_token_id"),
            num_target_layers=pick("num_target_layers"),
            max_position_embeddings=pick("max_position_embeddings", 32768),
            layer_types=layer_types,
            sliding_window=sliding_window,
            extra={k: v for k, v in raw.items() if k not in known and k not in _WRITTEN_KEYS
                   and not (k in SPECIAL_IDS and v is None)},
        )


# Fields to_hf_dict always writes itself; never carried over as "extra".
_WRITTEN_KEYS = {
    "architectures", "auto_map", "rope_scaling", "model_type", "hidden_act", "attention_bias", "attention_dropout", "is_causal",
    "layer_types", "use_sliding_window", "sliding_window", "max_window_layers", "tie_word_embeddings",
    "use_cache", "initializer_range", "dtype", "torch_dtype", "transformers_version",
}  # fmt: skip


def _transformers_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def target_special_ids(target_dir: str | Path) -> dict:
    """bos/eos/pad ids of a target folder: its config.json (top level, then text_config), then generation_config.json;
    a missing pad id takes the eos id, as published drafters do."""
    ids = dict.fromkeys(SPECIAL_IDS)
    for name, sub in ((CONFIG_FILE, None), (CONFIG_FILE, "text_config"), ("generation_config.json", None)):
        f = Path(target_dir) / name
        raw = json.loads(f.read_text()) if f.is_file() else {}
        raw = (raw.get(sub) or {}) if sub else raw
        for key in SPECIAL_IDS:
            value = raw.get(key)
            if ids[key] is None and value is not None:
                ids[key] = value[0] if isinstance(value, list) and value else value
    if ids["pad_token_id"] is None:
        ids["pad_token_id"] = ids["eos_token_id"]
    return ids


def _target_value(cfg, name, default=None):
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def drafter_config_from_target(
    target_hf_config,
    num_layers: int,
    block_size: int,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    **shape,
) -> DFlashConfig:
    """A drafter config sized like the target (an HF config object or its config.json dict).

    `shape` overrides the drafter's own sizes (num_attention_heads, num_key_value_heads, head_dim,
    intermediate_size, layer_types, sliding_window); a None value keeps the target's. The hidden
    size is always the target's: the drafter reads the target's embedding and lm_head.
    """
    unknown = sorted(set(shape) - set(DRAFTER_SHAPE_FIELDS))
    if unknown:
        raise ValueError(f"unknown drafter shape fields {unknown}; use {DRAFTER_SHAPE_FIELDS}")
    shape = {k: v for k, v in shape.items() if v is not None and v != []}
    if mask_token_id is None:
        raise ValueError("mask_token_id is required (the token id filling the non-anchor slots)")
    get = lambda name, default=None: _target_value(target_hf_config, name, default)  # noqa: E731
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    num_target_layers = get("num_hidden_layers")
    rope = get("rope_parameters") or {}
    target_shape = {
        "intermediate_size": get("intermediate_size"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("num_key_value_heads") or heads,
        "head_dim": get("head_dim") or hidden // heads,
    }
    return DFlashConfig(
        hidden_size=hidden,
        **{**target_shape, **shape},
        rms_norm_eps=get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", get("rope_theta", 10000.0))),
        vocab_size=get("vocab_size"),
        num_hidden_layers=num_layers,
        block_size=block_size,
        target_layer_ids=list(target_layer_ids or default_target_layer_ids(num_target_layers, num_layers)),
        mask_token_id=mask_token_id,
        num_target_layers=num_target_layers,
        max_position_embeddings=get("max_position_embeddings", 32768),
    )


# The [drafter] run-config fields that shape the drafter model itself (None / [] = like the target).
DRAFTER_SHAPE_FIELDS = (
    "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "layer_types", "sliding_window",
)  # fmt: skip


def drafter_config_for_run(run_cfg, target_hf_config, mask_token_id: int) -> DFlashConfig:
    """The drafter a run config asks for: its [drafter] section over the target's (text) HF config."""
    d = run_cfg.drafter
    return drafter_config_from_target(target_hf_config, d.num_layers, d.block_size, d.target_layer_ids or None,
                                      mask_token_id, **{name: getattr(d, name) for name in DRAFTER_SHAPE_FIELDS})


class RMSNorm(nn.Module):
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
    """cos, sin [B, L, 1, D] for the half-split (rotate_half) RoPE convention of Qwen3."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=pos_BL.device, dtype=torch.float32) / head_dim)
    angles_BLd = pos_BL.float()[..., None] * inv_freq
    angles_BLD = torch.cat([angles_BLd, angles_BLd], dim=-1)
    return angles_BLD.cos().to(dtype)[:, :, None], angles_BLD.sin().to(dtype)[:, :, None]


def apply_rope(x_BLHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BLHD.chunk(2, dim=-1)
    return x_BLHD * cos + torch.cat([-x2, x1], dim=-1) * sin


class DrafterAttention(nn.Module):
    """Q from the block; K/V from [context ; block] through the same k/v projections."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(H, self.n_heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv * D, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv * D, bias=False)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def forward(self, x_BQH, ctx_BSH, rope_q, rope_ctx, attn: TrainMask):
        B, Q, _ = x_BQH.shape
        rows = self.project(x_BQH.flatten(0, 1), ctx_BSH.flatten(0, 1), *_rows(rope_q), *_rows(rope_ctx))
        return self.output(attend_padded(*self.heads(rows, B), attn))[:, :Q]

    def project(self, x_NH, ctx_MH, cos_q, sin_q, cos_c, sin_c):
        """Row-wise part of attention over flattened rows (N block tokens, M context tokens): projected,
        q/k-normed, rotated q [N, h, D], k and v [M, kv, D] (context) and [N, kv, D] (block)."""
        h, kv, D = self.n_heads, self.n_kv, self.head_dim
        # One matmul for q, k, v of the block rows and one for k, v of the context (fewer, wider GEMMs; the
        # parameters stay the three published projections).
        w_qkv = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        q_Nq, k_Nk, v_Nk = F.linear(x_NH, w_qkv).split([h * D, kv * D, kv * D], dim=-1)
        k_Mk, v_Mk = F.linear(ctx_MH, w_qkv[h * D:]).split([kv * D, kv * D], dim=-1)
        q_NhD = apply_rope(self.q_norm(q_Nq.unflatten(-1, (h, D))), cos_q, sin_q)
        k_MkD = apply_rope(self.k_norm(k_Mk.unflatten(-1, (kv, D))), cos_c, sin_c)
        k_NkD = apply_rope(self.k_norm(k_Nk.unflatten(-1, (kv, D))), cos_q, sin_q)
        return q_NhD, k_MkD, k_NkD, v_Mk.unflatten(-1, (kv, D)), v_Nk.unflatten(-1, (kv, D))

    @staticmethod
    def heads(rows, B: int):
        """(q [B, h, Q, D], k and v [B, kv, S+Q, D]) from `project`'s rows: keys and values are [context ; block]."""
        q_NhD, k_MkD, k_NkD, v_MkD, v_NkD = rows

        def per_row(t):
            return t.unflatten(0, (B, -1))

        k_BLkD = torch.cat([per_row(k_MkD), per_row(k_NkD)], dim=1)
        v_BLkD = torch.cat([per_row(v_MkD), per_row(v_NkD)], dim=1)
        return per_row(q_NhD).transpose(1, 2), k_BLkD.transpose(1, 2), v_BLkD.transpose(1, 2)

    def output(self, out_BhQD):
        """o_proj over every row of the attention output (a view when it is laid out by rows, as flex's is)."""
        B, _, Q, _ = out_BhQD.shape
        return self.o_proj(out_BhQD.transpose(1, 2).reshape(B, Q, self.n_heads * self.head_dim))


def _rows(rope):
    """RoPE (cos, sin) [B, L, 1, D] as [B*L, 1, D], matching flattened rows."""
    return tuple(t.flatten(0, 1) for t in rope)


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    fp8 = False  # train.fp8 = "mlp": both matmuls through dflash.models.fp8 (DFlashDrafter.set_fp8)

    def forward(self, x):
        gate_up_w = torch.cat([self.gate_proj.weight, self.up_proj.weight])  # one GEMM for both
        if self.fp8:
            gate, up = fp8_linear(x, gate_up_w).chunk(2, dim=-1)
            return fp8_linear(F.silu(gate) * up, self.down_proj.weight)
        gate, up = F.linear(x, gate_up_w).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg)

    compiled = False  # run the attention inputs and the MLP block through torch.compile (DFlashDrafter.set_compile)

    def forward(self, x_BQH, ctx_BSH, rope_q, rope_ctx, attn, recompute_mlp: bool = False):
        B, Q, H = x_BQH.shape
        project, norm_mlp = _project, _norm_mlp
        if self.compiled:  # (recompute mlp checkpoints the whole block below; otherwise only its matmuls are kept)
            project, norm_mlp = _compiled(_project), _compiled(_norm_mlp if recompute_mlp else _norm_mlp_keeping_matmuls)
        # The compiled pieces see flattened rows: one dynamic size per tensor, whatever the batch's shape.
        inputs = (x_BQH.flatten(0, 1), ctx_BSH.flatten(0, 1), *_rows(rope_q), *_rows(rope_ctx))
        rows = project(self, *_dynamic_rows(self.compiled, inputs))
        # o_proj runs on flex's tile-padded rows (a view of its output, not a copy of the first Q), then cut.
        x_BQH = x_BQH + self.self_attn.output(attend_padded(*self.self_attn.heads(rows, B), attn))[:, :Q]
        (x_NH,) = _dynamic_rows(self.compiled, (x_BQH.flatten(0, 1),))
        if recompute_mlp:  # keep only the MLP's input; its [Q, intermediate] activations are recomputed in backward
            return x_BQH + checkpoint(norm_mlp, self, x_NH, use_reentrant=False).view(B, Q, H)
        return x_BQH + norm_mlp(self, x_NH).view(B, Q, H)


# The two pieces of a layer that torch.compile fuses (RMSNorms, RoPE, SiLU * up, dtype casts around the
# matmuls); flex attention is compiled on its own (dflash.models.attention). Module-level functions taking the
# layer as an argument: dynamo treats its parameters as inputs, so one graph serves every layer.
def _project(layer: DrafterLayer, x_NH, ctx_MH, cos_q, sin_q, cos_c, sin_c):
    return layer.self_attn.project(layer.input_layernorm(x_NH), ctx_MH, cos_q, sin_q, cos_c, sin_c)


def _norm_mlp(layer: DrafterLayer, x_NH):
    return layer.mlp(layer.post_attention_layernorm(x_NH))


def _dynamic_rows(compiled: bool, tensors: tuple) -> tuple:
    """Row counts vary with every batch: compile for any (one graph per piece from the first step)."""
    if compiled:
        for t in tensors:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    return tensors


def _norm_mlp_keeping_matmuls(layer: DrafterLayer, x_NH):
    """_norm_mlp saving only the matmul outputs (gate, up) for backward: the norm and act(gate) * up, cheap
    elementwise work, are recomputed there instead of keeping a hidden- and an intermediate-width tensor."""
    return checkpoint(_norm_mlp, layer, x_NH, use_reentrant=False, context_fn=_keep_matmul_outputs)


class _SafeCheckpointNote(logging.Filter):
    """torch warns at every compile that a selective checkpoint must not hold in-place ops: the MLP block has none."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_SafeCheckpointNote())


def _keep_matmul_outputs():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_save_matmuls)


def _save_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
               torch.ops.aten._scaled_mm.default)
    return CheckpointPolicy.MUST_SAVE if op in matmuls else CheckpointPolicy.PREFER_RECOMPUTE


COMPILE_BACKEND = "inductor"  # tests swap in a recording backend
# "1": compile the drafter's pieces on CPU too (inductor's C++ kernels; attention stays SDPA there). For the compile
# cache artifact's CPU round trip (tests/test_compile_artifact.py) and its CPU measurement; slow to compile.
CPU_COMPILE_ENV = "DFLASH_CPU_COMPILE"
_compiled_fns: dict = {}
_compiled_lock = threading.Lock()


def _compiled(fn):
    """fn under torch.compile, built once per process (compilation itself happens at the first call)."""
    with _compiled_lock:
        if fn not in _compiled_fns:
            _compiled_fns[fn] = torch.compile(fn, backend=COMPILE_BACKEND)
        return _compiled_fns[fn]


def compiles_on(device: torch.device) -> bool:
    """Whether train.compile compiles the drafter's pieces on `device`: CUDA, or the CPU with DFLASH_CPU_COMPILE=1."""
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get(CPU_COMPILE_ENV) == "1")


def start_compile_workers(device: torch.device, compile_on: bool) -> None:
    """Start torch.compile's kernel-compiler worker processes now, while the target loads.

    Inductor starts them at its first compilation and the first step then waits seconds for them;
    started here, that overlaps the target's loading. It only spawns processes: graphs are still
    traced and compiled at the first step, in the main thread. A torch without the hook skips it.
    """
    if not (compile_on and device.type == "cuda"):
        return
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:
        return
    maybe_warm_pool()


RECOMPUTE_MODES = ("off", "mlp", "layer")  # activation recompute per drafter layer: none, the MLP, the whole layer


def _to_param_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # Under autocast the matmuls pick their dtype; otherwise inputs must match the weights.
    return x if torch.is_autocast_enabled(x.device.type) else x.to(weight.dtype)


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.recompute = "off"  # a training setting (train.recompute), not part of the saved model
        self.apply(self._init_weights)

    def set_compile(self, on: bool) -> None:
        """Compile each layer's attention inputs and MLP block (one graph for all layers; CUDA training)."""
        for layer in self.layers:
            layer.compiled = on

    def set_fp8(self, mode: str) -> None:
        """off: bf16 matmuls; mlp: each MLP's forward and input-gradient matmuls in e4m3 (dflash.models.fp8)."""
        if mode not in FP8_MODES:
            raise ValueError(f"fp8 must be one of {FP8_MODES}, got {mode!r}")
        sizes = (self.config.hidden_size, self.config.intermediate_size)
        if mode != "off" and any(n % 16 for n in sizes):
            raise ValueError(f"train.fp8 needs the drafter's hidden and intermediate sizes divisible by 16 (fp8 "
                             f"matmuls), got {sizes}; set train.fp8 = \"off\"")
        if mode != "off":
            prepare()  # torchao's configs built here, not inside the compiled MLP block
        for layer in self.layers:
            layer.mlp.fp8 = mode == "mlp"

    def set_recompute(self, mode: str) -> None:
        """off: keep every activation; mlp: recompute each layer's MLP in backward; layer: each whole layer."""
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {mode!r}")
        self.recompute = mode

    @staticmethod
    def _init_weights(module: nn.Module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)

    def forward(
        self,
        context_BSF: torch.Tensor,
        noise_emb_BQH: torch.Tensor,
        context_pos_BS: torch.Tensor,
        query_pos_BQ: torch.Tensor,
        attn: TrainMask | dict[str, TrainMask],
    ) -> torch.Tensor:
        """Drafter hidden states [B, Q, H] for the block tokens (before the target's lm_head).

        attn: one TrainMask for a drafter of full-attention layers, or {layer type: TrainMask}
        (dflash.models.attention.build_layer_masks) holding every type in config.layer_types.
        """
        masks = attn if isinstance(attn, dict) else {"full_attention": attn}
        missing = sorted(set(self.config.layer_types) - set(masks))
        if missing:
            raise ValueError(f"no attention mask for the drafter's {missing} layers; build them with "
                             "dflash.models.attention.build_layer_masks(..., layer_types, sliding_window)")
        F_expected = self.fc.in_features
        if context_BSF.shape[-1] != F_expected:
            raise ValueError(
                f"context has {context_BSF.shape[-1]} features, the drafter expects {F_expected} "
                f"({len(self.config.target_layer_ids)} target layers x hidden {self.config.hidden_size})"
            )
        ctx_BSH = self.hidden_norm(self.fc(_to_param_dtype(context_BSF, self.fc.weight)))
        x_BQH = _to_param_dtype(noise_emb_BQH, self.fc.weight)
        cfg = self.config
        device_type = x_BQH.device.type
        rope_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x_BQH.dtype
        rope_q = rope_cos_sin(query_pos_BQ, cfg.head_dim, cfg.rope_theta, rope_dtype)
        rope_ctx = rope_cos_sin(context_pos_BS, cfg.head_dim, cfg.rope_theta, rope_dtype)
        mode = self.recompute if torch.is_grad_enabled() else "off"
        for layer, kind in zip(self.layers, cfg.layer_types):
            attn = masks[kind]
            if mode == "layer":
                x_BQH = checkpoint(layer, x_BQH, ctx_BSH, rope_q, rope_ctx, attn, use_reentrant=False)
            else:
                x_BQH = layer(x_BQH, ctx_BSH, rope_q, rope_ctx, attn, recompute_mlp=mode == "mlp")
        return self.norm(x_BQH)

    def save_pretrained(self, out_dir: str | Path, dtype: torch.dtype | None = None,
                        target_dir: str | Path | None = None, state: dict | None = None) -> Path:
        """Write config.json + model.safetensors + dflash.py; dtype None keeps the parameters' dtype.

        state: the weights to write instead of the parameters' current values (a checkpoint's host snapshot,
        written on another thread while training goes on).

        target_dir (the target's HF folder) makes the folder servable on its own: its tokenizer files
        are copied in and its bos/eos/pad ids written into config.json.
        """
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        dtype = dtype or self.fc.weight.dtype
        state = self.state_dict() if state is None else state
        tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in state.items()}
        save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
        config = self.config
        if target_dir is not None:
            config = replace(config, extra={**config.extra, **target_special_ids(target_dir)})
            for name in TOKENIZER_FILES:
                if (Path(target_dir) / name).is_file():
                    shutil.copyfile(Path(target_dir) / name, out_dir / name)
        (out_dir / CONFIG_FILE).write_text(json.dumps(config.to_hf_dict(dtype), indent=2, sort_keys=True) + "\n")
        shutil.copyfile(MODELING_SOURCE, out_dir / MODELING_FILE)
        return out_dir

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
    ) -> DFlashDrafter:
        """Load a drafter folder; dtype None keeps the stored dtype."""
        path = Path(path)
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if not (path / name).is_file():
                raise ValueError(f"{path} is not a drafter folder: {name} is missing")
        raw = json.loads((path / CONFIG_FILE).read_text())
        if raw.get("architectures") not in (None, [ARCHITECTURE]):
            raise ValueError(f"{path / CONFIG_FILE}: architectures {raw['architectures']}, expected [{ARCHITECTURE!r}]")
        state = load_file(str(path / WEIGHTS_FILE), device=str(device))
        with torch.device(device):
            model = cls(DFlashConfig.from_hf_dict(raw))
        stored = next(iter(state.values())).dtype
        model.to(dtype or stored)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"{path / WEIGHTS_FILE}: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )
        return model
