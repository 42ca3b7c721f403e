"""The shapes the memory model reads: a target's ``config.json`` (:func:`load_target_shape`, the one reader, and
``dflash.config.resolve_target_dir``, the one target-path rule) and the drafter built on it. Pure Python, no torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

from dflash.config import ConfigError, RunConfig, resolve_target_dir
from dflash.errors import DflashError
from dflash.models import smollm2

GiB = 1024**3
BF16 = 2  # bytes; autocast dtype of the drafter, frozen embedding/lm_head copies
FP32 = 4  # bytes; master weights, grads, AdamW states, loss buffers, norm statistics
INT32 = 4  # bytes; flex attention block-mask indices
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# The embedded default target (target.path = "smollm2"): SmolLM2-135M-Instruct's public
# shapes, since its weights ship as a GGUF inside a package, without a config.json folder
# (reading them needs no conversion, no torch and no package).
SMOLLM2_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


class MemoryModelError(DflashError):
    """A question the memory model cannot answer as asked (CUDA version, GPU role, GPU size)."""


def cuda_major(cuda: str) -> int:
    """12 for "12.8": the CUDA context cost is calibrated per major version."""
    if not re.fullmatch(r"\d+(\.\d+)?", cuda.strip()):
        raise MemoryModelError(f"CUDA version must look like 12.8 or 13.0, got {cuda!r}")
    return int(cuda.strip().split(".")[0])


# --------------------------------------------------------------------------- target shape


@dataclass(frozen=True)
class TargetShape:
    """The target architecture's sizes, read from its HF config.json."""

    model_type: str
    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head's q and k
    qkv_bias: bool  # Qwen2: bias on q, k, v projections
    # Qwen3.5-family hybrids: Gated DeltaNet (linear attention) layers and gated full attention.
    linear_layers: int = 0  # layers whose layer_types entry is linear_attention
    linear_key_dim: int = 0  # linear_num_key_heads x linear_key_head_dim
    linear_value_dim: int = 0  # linear_num_value_heads x linear_value_head_dim
    linear_value_heads: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0  # depthwise causal conv over q, k, v
    attn_output_gate: bool = False  # q_proj also emits a sigmoid gate per head (twice the query width)

    @classmethod
    def from_config(cls, raw: dict, source: str = "config.json") -> TargetShape:
        """Sizes from a parsed config.json; a multimodal config's language model sits under text_config."""
        if isinstance(raw.get("text_config"), dict):
            raw = raw["text_config"]
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            model_type = str(raw.get("model_type", ""))
            layer_types = raw.get("layer_types") or []
            interval = raw.get("full_attention_interval")
            if not layer_types and model_type.startswith("qwen3_5") and interval:
                layer_types = ["full_attention" if (i + 1) % int(interval) == 0 else "linear_attention"
                               for i in range(int(raw["num_hidden_layers"]))]
            linear = sum(t == "linear_attention" for t in layer_types)
            lin = (lambda k: int(raw[k])) if linear else (lambda k: 0)
            shape = cls(
                model_type=model_type,
                num_layers=int(raw["num_hidden_layers"]),
                hidden=hidden,
                intermediate=int(raw["intermediate_size"]),
                heads=heads,
                kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                vocab=int(raw["vocab_size"]),
                tied=bool(raw.get("tie_word_embeddings", False)),
                qk_norm=model_type.startswith("qwen3"),
                qkv_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
                linear_layers=linear,
                linear_key_dim=lin("linear_num_key_heads") * lin("linear_key_head_dim"),
                linear_value_dim=lin("linear_num_value_heads") * lin("linear_value_head_dim"),
                linear_value_heads=lin("linear_num_value_heads"),
                linear_value_head_dim=lin("linear_value_head_dim"),
                linear_conv_kernel=lin("linear_conv_kernel_dim"),
                attn_output_gate=model_type.startswith("qwen3_5"),
            )
        except KeyError as e:
            raise ConfigError(f"{source}: missing key {e.args[0]!r}; use an HF config.json of a decoder-only model") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{source}: bad value ({e}); use an HF config.json of a decoder-only model") from None
        if min(shape.num_layers, shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.vocab) < 1:
            raise ConfigError(f"{source}: sizes must be positive; use an HF config.json of a decoder-only model")
        return shape

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self, qk_norm: bool | None = None, qkv_bias: bool | None = None) -> int:
        """Parameters of one decoder layer (attention + SwiGLU MLP + two RMSNorms)."""
        qk_norm = self.qk_norm if qk_norm is None else qk_norm
        qkv_bias = self.qkv_bias if qkv_bias is None else qkv_bias
        h, q, kv, i = self.hidden, self.q_width, self.kv_width, self.intermediate
        attn = h * q * (2 if self.attn_output_gate else 1) + 2 * h * kv + q * h
        if qkv_bias:
            attn += q + 2 * kv
        if qk_norm:
            attn += 2 * self.head_dim
        return attn + 3 * h * i + 2 * h

    def linear_layer_params(self) -> int:
        """Parameters of one Gated DeltaNet layer (q/k/v, z, a, b projections, conv, decay, gated norm, out) + SwiGLU MLP."""
        h, k, v, nv = self.hidden, self.linear_key_dim, self.linear_value_dim, self.linear_value_heads
        qkv = 2 * k + v
        mixer = h * qkv + h * v + 2 * h * nv + qkv * self.linear_conv_kernel + 2 * nv + self.linear_value_head_dim + v * h
        return mixer + 3 * h * self.intermediate + 2 * h

    def linears(self) -> list[tuple[int, int, int]]:
        """(in features, out features, how many) of every linear in the decoder layers: attention q/k/v/o, a Gated
        DeltaNet's qkv/z/b/a/out projections, the MLP's gate/up/down (embedding and lm_head are not among them)."""
        h, i, n = self.hidden, self.intermediate, self.num_layers
        full, lin = n - self.linear_layers, self.linear_layers
        q_out = self.q_width * (2 if self.attn_output_gate else 1)
        k, v, nv = self.linear_key_dim, self.linear_value_dim, self.linear_value_heads
        rows = [(h, q_out, full), (h, self.kv_width, full), (h, self.kv_width, full), (self.q_width, h, full),
                (h, 2 * k + v, lin), (h, v, lin), (h, nv, lin), (h, nv, lin), (v, h, lin),
                (h, i, n), (h, i, n), (i, h, n)]
        return [r for r in rows if r[2]]

    def fp8_linears(self, min_features: int) -> tuple[int, int, int]:
        """(weights, output channels, largest input width) of the decoder linears target.precision = "fp8" quantises:
        in and out features both >= min_features (dflash.models.target_fp8.fp8_eligible)."""
        chosen = [(a, b, c) for a, b, c in self.linears() if min(a, b) >= min_features]
        return (sum(a * b * c for a, b, c in chosen), sum(b * c for _, b, c in chosen),
                max((a for a, _, _ in chosen), default=0))

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """All target parameters: embedding, layers (full and linear attention), final norm, lm_head unless tied."""
        head = 0 if self.tied else self.embedding_params
        full = self.num_layers - self.linear_layers
        layers = full * self.layer_params() + self.linear_layers * self.linear_layer_params()
        return self.embedding_params + layers + self.hidden + head




def load_target_shape(path: str) -> TargetShape:
    """The one reader of a target's shape: target.path -> its config.json (see resolve_target_dir) -> sizes.

    The embedded default (``smollm2``) answers from its known shapes, so no conversion and no
    torch are needed. Every problem is a ConfigError naming the file and the fix.
    """
    if smollm2.is_embedded(path):
        return TargetShape.from_config(SMOLLM2_CONFIG, f"{smollm2.NAME} (embedded)")
    cfg_file = resolve_target_dir(path) / "config.json"
    try:
        raw = json.loads(cfg_file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}/config.json: not found; set target.path to an HF model folder containing config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}/config.json: not valid JSON ({e.msg} at line {e.lineno}); restore the file from the model's source") from None
    except (UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(f"{path}/config.json: not UTF-8 JSON a model config can be ({e}); restore the file from the model's source") from None
    except OSError as e:
        raise ConfigError(f"{path}/config.json: cannot read ({e.strerror}); check the path and its permissions") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}/config.json: not a JSON object; use an HF config.json")
    return TargetShape.from_config(raw, f"{path}/config.json")


def num_feature_layers(cfg: RunConfig) -> int:
    """Target layers whose hidden states feed the drafter (= drafter layers by default)."""
    return len(cfg.drafter.target_layer_ids) or cfg.drafter.num_layers


def drafter_shape(cfg: RunConfig, shape: TargetShape) -> TargetShape:
    """The drafter layers' sizes: the [drafter] fields where set, else the target's (hidden and vocab always the target's)."""
    d = cfg.drafter
    return replace(shape, model_type="qwen3", qk_norm=True, qkv_bias=False, linear_layers=0, attn_output_gate=False,
                   heads=d.num_attention_heads or shape.heads, kv_heads=d.num_key_value_heads or shape.kv_heads,
                   head_dim=d.head_dim or shape.head_dim, intermediate=d.intermediate_size or shape.intermediate)


def drafter_params(cfg: RunConfig, shape: TargetShape) -> int:
    """Trainable drafter parameters: Qwen3 layers of the drafter's shape, fc, two norms."""
    n_feat = num_feature_layers(cfg)
    layers = cfg.drafter.num_layers * drafter_shape(cfg, shape).layer_params()
    fc = n_feat * shape.hidden * shape.hidden  # n*H -> H, no bias
    return layers + fc + 2 * shape.hidden  # + context norm + final norm


def drafter_state_bytes(cfg: RunConfig, shape: TargetShape) -> int:
    """fp32 weights + AdamW exp_avg and exp_avg_sq: the drafter's training state, and what a checkpoint writes."""
    return 3 * FP32 * drafter_params(cfg, shape)
