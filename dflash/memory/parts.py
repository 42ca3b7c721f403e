"""Per-role analytic GPU memory model of a DFlash run (pure Python, no torch).

It lives beside the trainer it models: the components below name what ``dflash.models.target``,
``dflash.models.drafter`` and ``dflash.train.loss`` keep alive, so a change there and its memory cost move in one
commit. Importing it never imports torch: preflight and the estimator run it in processes that must stay light.

Given a run config and the target's shape, say how many bytes one GPU of each role needs at its peak, component by
component:

- ``target``: the frozen target's forward over a padded batch of ``token_budget`` tokens, keeping only the selected
  layers' hidden states (and the last hidden state when soft labels are on) to send to the drafter GPUs.
- ``drafter``: a DFlash drafter trained with fp32 master weights, bf16 autocast and AdamW, reading the received
  features; logits and loss are computed ``loss_chunk`` queries at a time.
- ``colocated``: both on one GPU: the target forward runs before the drafter step, so only the larger of the two
  working sets counts; the drafter reuses the target's own embedding and lm_head. Every GPU of a co-located data
  parallel run (``topology.colocated_gpus``) is this role, plus, with DDP, its gradient buckets and NCCL's buffers, as
  a split run's drafter GPUs when there are several; with FSDP2 (``train.data_parallel``) the drafter's fp32 state is
  1/N of it on each of the N ranks, plus the all-gather and reduce-scatter buffers of the layers in flight.

Everything that can only be measured (CUDA context, NCCL buffers, allocator fragmentation, how many activation
tensors the kernels really keep) is a named constant in :class:`Calibration`, fitted to H200 measurements by
``dflash.memory.calibration``.

    from dflash.config import load_config
    from dflash.memory.parts import role_need_bytes
    role_need_bytes(load_config("configs/qwen3-27b-5t3d.toml"), "drafter", "12.8")   # bytes, margin included
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dflash.config import FP8_MIN_FEATURES, ROLES, GpuRole, RunConfig
from dflash.memory.shape import (
    BF16,
    DTYPE_BYTES,
    FP32,
    INT32,
    GiB,
    MemoryModelError,
    TargetShape,
    cuda_major,
    drafter_params,
    drafter_shape,
    load_target_shape,
    num_feature_layers,
)

FLEX_BLOCK = 128  # tokens per flex-attention sparse block (both query and key/value side)

Kind = Literal["static", "activation", "fixed", "margin"]
DataParallel = Literal["none", "ddp", "fsdp2"]  # how the drafter's ranks hold it: one rank, replicas, or shards
FSDP2_LAYERS_IN_FLIGHT = 2  # FSDP2's default prefetch: the current layer's all-gather and the next one's (forward and
                            # backward); in backward also two layers' reduce-scatters (one computed, one reducing)


@dataclass(frozen=True)
class Calibration:
    """What the analytic model cannot derive; defaults are first guesses until fitted.

    Activation counts are "how many tensors of this width the step keeps alive per token".
    """

    # CUDA context + cuBLAS/cuDNN workspaces + the torch runtime, per CUDA major (GiB,
    # outside the caching allocator). CUDA 13 builds measured ~0.2 GiB more in the incident.
    # CUDA 13: fitted to tests/data/memory_calibration.json (H200, torch 2.11.0+cu130); CUDA 12: not yet measured
    cuda_context_gib: dict[int, float] = field(default_factory=lambda: {12: 0.5, 13: 1.3744})
    # NCCL communicator buffers on a GPU that sends or receives features (GiB, split mode only).
    nccl_gib: float = 0.25
    # Allocator fragmentation: reserved-but-unusable share on top of allocated bytes, with the
    # allocator settings the profiles require (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True;
    # measured 0.5-1.9% on H200, kept at 5% as margin) ...
    fragmentation: float = 0.05
    # ... and with torch's default allocator (measured 4-31%: large loss-chunk buffers of
    # changing sizes leave cached segments that later requests cannot use).
    fragmentation_default_allocator: float = 0.10

    # Target forward (no grad), live per token inside the busiest layer, in target dtype:
    target_act_h: float = 2.0  # hidden-width tensors: residual stream + normed input
    target_act_q: float = 3.0  # query-width (heads*head_dim): q, q after norm+RoPE, attention out
    target_act_kv: float = 3.0  # kv-width (kv_heads*head_dim): k, k after norm+RoPE, v
    target_act_i: float = 3.0  # intermediate-width: act(gate), up, act(gate)*up (MLP under no_grad)
    target_activation_scale: float = 1.0256  # fitted to tests/data/memory_calibration.json (8 target points, one hybrid; no padding mask)

    # Drafter on CUDA (train.compile: the layer pieces compiled, dflash/models/drafter.py), saved for backward per
    # query token per layer, in bf16 units (2 bytes); counted with saved-tensor hooks on the compiled layer:
    drafter_act_h: float = 3.0  # layer input, input-norm output, post-attention residual (the MLP block recomputes its norm)
    drafter_act_q: float = 3.0  # q before q_norm, q after RoPE, attention output
    drafter_act_i: float = 2.0  # gate, up (act(gate) * up is recomputed in backward)
    # ... per key/value token (context + block) per layer, in bf16 units:
    drafter_act_kv: float = 3.0  # k before k_norm, k after RoPE, v
    # The same counts for eager layers (train.compile = false): the RMSNorms save fp32 copies.
    eager_act_h: float = 10.0  # input and post-attention RMSNorm: 2 x (4 fp32 units + bf16 output)
    eager_act_q: float = 6.0  # q_norm fp32 pair (4), q after RoPE (1), attention output (1)
    eager_act_i: float = 4.0  # gate, act(gate), up, act(gate)*up
    eager_act_kv: float = 6.0  # k_norm fp32 pair (4), k after RoPE (1), v (1)
    # Gradients of one layer's activations live at once during backward (in layers).
    backward_transient_layers: float = 0.5  # 2026-11-30 refit: with the in-place loss the backward transient sets the peak
    drafter_activation_scale: float = 0.9118  # fitted to tests/data/memory_calibration.json (9 drafter points)

    # Loss chunk on CUDA (dflash/train/loss_kernel.py), per [chunk, vocab] element: the lm_head writes the
    # chunk's logits as one bf16 buffer and the fused kernel overwrites them with their gradient ...
    loss_bf16_buffers: float = 1.0
    # ... with kl_weight > 0 the target's logits are a second bf16 buffer.
    kl_bf16_buffers: float = 1.0

    def context_bytes(self, cuda: str) -> int:
        major = cuda_major(cuda)
        if major not in self.cuda_context_gib:
            known = ", ".join(str(m) for m in sorted(self.cuda_context_gib))
            raise MemoryModelError(f"no CUDA context calibration for CUDA {cuda} (known majors: {known}); use --cuda 12.8 or 13.0")
        return int(self.cuda_context_gib[major] * GiB)


DEFAULT_CALIBRATION = Calibration()


def with_measured_overhead(cal: Calibration, cuda: str, context_bytes: int, nccl_bytes: int | None = None) -> Calibration:
    """cal with the terms outside torch's allocator measured on the machine (preflight's probe): the CUDA context and
    everything the run's libraries load beside it (cuBLAS, attention and fla kernels) as `context_bytes` for this
    CUDA major, and an NCCL communicator's buffers as `nccl_bytes` when the probe built one (else cal's constant)."""
    if context_bytes < 0 or (nccl_bytes is not None and nccl_bytes < 0):
        raise MemoryModelError(f"a measured overhead cannot be negative (context {context_bytes}, NCCL {nccl_bytes} bytes)")
    ctx = dict(cal.cuda_context_gib)
    ctx[cuda_major(cuda)] = context_bytes / GiB
    return replace(cal, cuda_context_gib=ctx, nccl_gib=cal.nccl_gib if nccl_bytes is None else nccl_bytes / GiB)


# --------------------------------------------------------------------------- workload


class Workload(BaseModel):
    """The worst-case batch the model assumes (many short sequences maximise queries)."""

    model_config = ConfigDict(frozen=True)

    tokens: int = Field(description="padded tokens in the batch = token_budget")
    sequences: int = Field(description="rows in the worst-case batch (at most max_batch_size and token_budget // block_size)")
    seq_len: int = Field(description="padded row length = token_budget // sequences")
    anchors_per_seq: int = Field(description="anchor slots per row: the batch's largest per-row count, which all rows are padded to")
    queries_per_seq: int = Field(description="anchors_per_seq * block_size")
    queries: int = Field(description="drafter query tokens in the batch (padding anchors included: they run through the layers)")
    valid_anchors: int = Field(description="anchors that carry a loss: min(batch_anchors, rows x min(max_anchors, seq_len - 1))")
    loss_tokens: int = Field(description="query rows through the lm_head: every anchor slot's slots 1..block_size-1, "
                             "padding anchors included (rows are picked by shape, not by weight)")
    kv_tokens: int = Field(description="drafter key/value tokens in the batch: padded context + queries")
    feature_layers: int = Field(description="target layers whose hidden states are sent")
    loss_chunk: int = Field(description="query tokens per logits/loss chunk = min(loss_chunk, loss_tokens)")


def padded_anchors_per_row(eligible_per_row: int, rows: int, batch_anchors: int | None) -> int:
    """Anchor slots per row once train.batch_anchors caps the batch's anchors.

    dflash.train.loss.sample_anchors splits batch_anchors over the rows as evenly as their eligible
    counts allow (water-filling), so with equal rows every row holds ceil(batch_anchors / rows).
    """
    total = rows * eligible_per_row
    if batch_anchors is None or total <= batch_anchors:
        return eligible_per_row
    return max(1, min(eligible_per_row, math.ceil(batch_anchors / rows)))


def workload(cfg: RunConfig) -> Workload:
    """The batch shape with the most drafter queries that token_budget and max_batch_size allow.

    Rows are padded to the longest (rows x length <= token_budget) and every row's anchors are
    padded to the batch's largest eligible count, capped by max_anchors; a row of length S has
    at most S - 1 eligible anchors. train.batch_anchors caps the anchors with a loss over the
    batch; rows are still padded to the largest kept count. Rows shorter than a block are ignored.
    Packed (data.packing): one row of token_budget tokens whose anchors are the batch's (no padding anchors).
    """
    t, bs, a_max = cfg.data.token_budget, cfg.drafter.block_size, cfg.train.max_anchors
    cap = cfg.train.batch_anchors
    if cfg.data.packing:  # one row of token_budget tokens; its anchors: batch_anchors, else max_anchors a sequence
        anchors = max(1, min(cap or a_max * cfg.data.max_batch_size, t - 1))
        return Workload(tokens=t, sequences=1, seq_len=t, anchors_per_seq=anchors, queries_per_seq=anchors * bs,
                        queries=anchors * bs, valid_anchors=anchors, loss_tokens=anchors * (bs - 1),
                        kv_tokens=t + anchors * bs, feature_layers=num_feature_layers(cfg),
                        loss_chunk=max(1, min(cfg.train.loss_chunk, anchors * (bs - 1))))
    best = (0, 1)
    for rows in range(1, max(1, min(cfg.data.max_batch_size, t // bs)) + 1):
        eligible = max(1, min(a_max, t // rows - 1))
        best = max(best, (rows * padded_anchors_per_row(eligible, rows, cap), rows))
    rows = best[1]
    seq_len = t // rows
    eligible = max(1, min(a_max, seq_len - 1))
    anchors = padded_anchors_per_row(eligible, rows, cap)
    valid = min(rows * eligible, cap) if cap is not None else rows * eligible
    queries = rows * anchors * bs
    loss_tokens = rows * anchors * (bs - 1)
    return Workload(
        tokens=t,
        sequences=rows,
        seq_len=seq_len,
        anchors_per_seq=anchors,
        queries_per_seq=anchors * bs,
        queries=queries,
        valid_anchors=valid,
        loss_tokens=loss_tokens,
        kv_tokens=rows * seq_len + queries,
        feature_layers=num_feature_layers(cfg),
        loss_chunk=max(1, min(cfg.train.loss_chunk, loss_tokens)),
    )


# --------------------------------------------------------------------------- components


@dataclass(frozen=True)
class Part:
    component: str
    bytes: int
    kind: Kind  # static: weights/states; activation: scales with the batch; fixed: outside the allocator
    group: Literal["target", "drafter", ""] = ""  # which fitted activation scale applies
    held: bool = False  # a drafter-step part that stays allocated through a co-located GPU's target forward


def _features_bytes(cfg: RunConfig, shape: TargetShape, w: Workload) -> tuple[int, int]:
    dt = DTYPE_BYTES[cfg.target.dtype]
    feats = w.tokens * w.feature_layers * shape.hidden * dt
    last = w.tokens * shape.hidden * dt if cfg.train.kl_weight > 0 else 0
    return feats, last


def sent_features_bytes(cfg: RunConfig, shape: TargetShape) -> int:
    """Bytes a split's target rank sends a drafter rank per batch (dflash.train.ranks._target_main): its timing stats
    (2 fp64), the selected layers' hidden states and, with soft labels, the last hidden state, in target.dtype, for a
    batch of token_budget tokens."""
    feats, last = _features_bytes(cfg, shape, workload(cfg))
    return 2 * 8 + feats + last


def target_layer_bytes(cfg: RunConfig, shape: TargetShape, w: Workload, cal: Calibration) -> int:
    """Live bytes inside the busiest target layer during the no-grad forward (with target.precision = "fp8" also an
    fp8 linear's e4m3 copy of its input and the input's row scales)."""
    dt = DTYPE_BYTES[cfg.target.dtype]
    attn = cal.target_act_q * shape.q_width + cal.target_act_kv * shape.kv_width
    mlp = cal.target_act_i * shape.intermediate
    per_token = dt * (cal.target_act_h * shape.hidden + max(attn, mlp) + 2 * shape.head_dim)  # + RoPE cos/sin
    per_token += FP32 * shape.heads  # attention logsumexp
    if cfg.target.precision == "fp8":
        per_token += shape.fp8_linears(FP8_MIN_FEATURES)[2] + FP32
    return int(w.tokens * per_token)


def target_weight_parts(cfg: RunConfig, shape: TargetShape) -> list[Part]:
    """The frozen target's weights: every parameter in target.dtype, or with target.precision = "fp8" the large
    decoder linears' weights in e4m3 (1 byte) with a float32 scale per output channel (dflash.models.target_fp8)."""
    dt = DTYPE_BYTES[cfg.target.dtype]
    if cfg.target.precision != "fp8":
        return [Part(f"target weights ({cfg.target.dtype}, {shape.params / 1e9:.2f} B params)", shape.params * dt, "static")]
    q, rows, _ = shape.fp8_linears(FP8_MIN_FEATURES)
    rest = shape.params - q
    return [Part(f"target weights (fp8: {q / 1e9:.2f} B params in e4m3 + row scales, {rest / 1e9:.2f} B in "
                 f"{cfg.target.dtype})", q + FP32 * rows + rest * dt, "static")]


def target_forward_bytes(cfg: RunConfig, shape: TargetShape, w: Workload, cal: Calibration) -> int:
    """The target forward's peak beyond the returned features (dflash.models.target.target_features).

    Without soft labels the forward stops after the deepest selected layer: inside it, the
    other n - 1 captured layer outputs are alive with the layer's working set (no padding mask:
    dflash.train.loss.target_step passes none). At the end the n captured outputs and their
    concatenation (the returned features, counted as their own part) are alive together. With soft labels the forward runs every
    layer with all n captured outputs alive.
    """
    dt = DTYPE_BYTES[cfg.target.dtype]
    one_feature = w.tokens * shape.hidden * dt
    held_in_layer = 0 if cfg.train.kl_weight > 0 else 1  # the deepest layer is still being computed
    in_layer = target_layer_bytes(cfg, shape, w, cal)
    return max(in_layer - held_in_layer * one_feature, w.feature_layers * one_feature)


def _target_parts(cfg: RunConfig, shape: TargetShape, w: Workload, cal: Calibration, split: bool) -> list[Part]:
    feats, last = _features_bytes(cfg, shape, w)
    parts = [
        *target_weight_parts(cfg, shape),
        Part(f"forward working set ({w.tokens} tokens: busiest layer, or the features' concatenation)",
             target_forward_bytes(cfg, shape, w, cal), "activation"),
        Part("batch inputs (ids, positions, loss mask)", w.tokens * 24, "activation"),
        Part(f"selected hidden states ({w.feature_layers} layers x {w.tokens} tokens)", feats, "activation"),
    ]
    if last:
        parts.append(Part("last hidden state (soft labels)", last, "activation"))
    if split:  # a target rank keeps up to topology.queue_depth sends in flight while it computes the next batch
        n = cfg.topology.queue_depth  # (dflash.train.ranks._target_main), beside that batch's own features above
        parts.append(Part(f"send buffers in flight ({n} batch{'es' if n != 1 else ''}, topology.queue_depth)",
                          n * (feats + last), "activation"))
    return parts


def _drafter_static_parts(cfg: RunConfig, shape: TargetShape, share_frozen: bool) -> list[Part]:
    p = drafter_params(cfg, shape)
    if parallel_mode(cfg) == "fsdp2":  # fully_shard: each rank keeps its 1/N of every parameter and its moments
        n, s = drafter_ranks(cfg), sharded_params(cfg, shape)
        parts = [
            Part(f"drafter params (fp32 master, sharded 1/{n}: {s / 1e6:.0f} M of {p / 1e6:.0f} M)", FP32 * s, "static"),
            Part(f"AdamW exp_avg + exp_avg_sq (fp32, sharded 1/{n})", 2 * FP32 * s, "static"),
        ]
    else:
        parts = [
            Part(f"drafter params (fp32 master, {p / 1e6:.0f} M)", FP32 * p, "static"),
            Part("AdamW exp_avg + exp_avg_sq (fp32)", 2 * FP32 * p, "static"),
        ]
    if not share_frozen:
        parts.append(Part("frozen embedding (bf16)", BF16 * shape.embedding_params, "static"))
        if not shape.tied:
            parts.append(Part("frozen lm_head (bf16)", BF16 * shape.embedding_params, "static"))
    return parts


def _step_only_parts(cfg: RunConfig, shape: TargetShape, step_activation_bytes: int) -> list[Part]:
    """bf16 weight copies (forward + backward) vs fp32 grads (end of backward, then the optimizer).

    zero_grad(set_to_none=True) frees the grads before every step, and backward frees the
    activations and the autocast copies as it allocates the grads: the peak is the larger of
    (copies + activations) during the step and the grads after it. With train.grad_accum > 1 the first
    batch's grads live through the later batches' forwards; with several drafter ranks the grads are
    views of DDP's buckets, allocated once and held through every step. FSDP2: see _fsdp2_step_parts.
    """
    p = drafter_params(cfg, shape)
    copies = BF16 * p
    mode = parallel_mode(cfg)
    if mode == "fsdp2":
        return _fsdp2_step_parts(cfg, shape)
    if mode == "ddp":
        return [
            Part("bf16 autocast weight copies (forward to backward)", copies, "static"),
            Part(f"DDP gradient buckets (fp32, held; {drafter_ranks(cfg)} drafter ranks)", FP32 * p, "static",
                 held=True),
        ]
    if cfg.train.grad_accum > 1:  # the first batch's grads are held while the next batches run forward
        return [
            Part("bf16 autocast weight copies (forward to backward)", copies, "static"),
            Part(f"drafter grads (fp32, held across the step's {cfg.train.grad_accum} batches)", FP32 * p, "static"),
        ]
    grads_beyond = max(0, FP32 * p - copies - step_activation_bytes)
    return [
        Part("bf16 autocast weight copies (forward to backward)", copies, "static"),
        Part("drafter grads (fp32) beyond the step's freed activations", grads_beyond, "static"),
    ]


def _fsdp2_step_parts(cfg: RunConfig, shape: TargetShape) -> list[Part]:
    """What a rank of a drafter under FSDP2 (fully_shard per layer and at the root, reshard_after_forward, bf16
    params and fp32 gradient reduction) holds beyond its sharded params and moments.

    No autocast copies (the gathered parameters are bf16 already) and no DDP buckets. Held: the sharded fp32 grads
    (the reduce-scatter's output, until zero_grad of the next step; the trainer reduce-scatters every batch of a step,
    train.grad_accum > 1 included, so they accumulate sharded: dflash.train.parallel). During the step: the
    all-gathered bf16 params of the layers in flight, the root's (fc, norms: the root is not resharded between forward
    and backward); in backward only, the reduce-scatter's unsharded bf16 gradients with their fp32 copy of the layers
    in flight (fsdp2_reduce_scatter_bytes), which _drafter_step_parts weighs against the forward's loss chunk.
    """
    n, s = drafter_ranks(cfg), sharded_params(cfg, shape)
    layer, root = drafter_layer_params(cfg, shape), drafter_root_params(cfg, shape)
    k = min(FSDP2_LAYERS_IN_FLIGHT, cfg.drafter.num_layers)
    parts = [Part(f"drafter grads (fp32, sharded 1/{n}: reduce-scatter output, held to the next step)", FP32 * s,
                  "static", held=True)]
    parts += [
        Part(f"FSDP2 all-gather buffers (bf16 params of {k} layers: the current and the prefetched)", k * BF16 * layer,
             "static"),
        Part(f"FSDP2 root params gathered (bf16: fc and norms, {root / 1e6:.0f} M, forward to backward)", BF16 * root,
             "static"),
    ]
    return parts  # the reduce-scatter buffers live in backward only: _drafter_step_parts sets them beside the loss chunk


def fsdp2_reduce_scatter_bytes(cfg: RunConfig, shape: TargetShape) -> int:
    """FSDP2's reduce-scatter buffers in backward: the unsharded bf16 gradients of the layers in flight and the fp32
    copy each is reduced in (MixedPrecisionPolicy reduce_dtype); 0 unless parallel_mode is fsdp2."""
    if parallel_mode(cfg) != "fsdp2":
        return 0
    k = min(FSDP2_LAYERS_IN_FLIGHT, cfg.drafter.num_layers)
    return k * (BF16 + FP32) * drafter_layer_params(cfg, shape)


def drafter_ranks(cfg: RunConfig) -> int:
    """The ranks that train the drafter: drafter GPUs (split), co-located data-parallel GPUs, else the one device."""
    return max(1, len(cfg.topology.trainer_gpus))


def parallel_mode(cfg: RunConfig) -> DataParallel:
    """How the memory model reads train.data_parallel: "none" for one drafter rank, "fsdp2" as configured in a
    co-located data-parallel run, else "ddp" (auto read as ddp, and a split's drafter ranks always; callers that know
    the GPU use choose_parallel)."""
    if drafter_ranks(cfg) == 1:
        return "none"
    if cfg.train.data_parallel == "fsdp2" and cfg.topology.layout == "colocated-dp":
        return "fsdp2"
    return "ddp"


def ddp_drafters(cfg: RunConfig) -> bool:
    """Several drafter ranks holding a whole replica each: the trainer wraps the drafter in DDP (one rank trains
    without it; a sharded drafter is parallel_mode "fsdp2")."""
    return parallel_mode(cfg) == "ddp"


def drafter_layer_params(cfg: RunConfig, shape: TargetShape) -> int:
    """Parameters of one drafter layer: the unit FSDP2 gathers and reduces at once."""
    return drafter_shape(cfg, shape).layer_params()


def drafter_root_params(cfg: RunConfig, shape: TargetShape) -> int:
    """The drafter's parameters outside its layers (fc, the context and final norms): FSDP2's root unit."""
    return drafter_params(cfg, shape) - cfg.drafter.num_layers * drafter_layer_params(cfg, shape)


def sharded_params(cfg: RunConfig, shape: TargetShape) -> int:
    """Drafter parameters one rank holds under FSDP2: 1/N of the whole, rounded up (fully_shard pads dim 0)."""
    return math.ceil(drafter_params(cfg, shape) / drafter_ranks(cfg))


def with_parallel(cfg: RunConfig, mode: str) -> RunConfig:
    """cfg with train.data_parallel = mode ("none": unchanged, one rank ignores the field)."""
    if mode == "none":
        return cfg
    out = cfg.model_copy(deep=True)
    out.train.data_parallel = mode
    return out


def parallel_tries(cfg: RunConfig) -> list[DataParallel]:
    """The data-parallel modes choose_parallel tries for the drafter's ranks, in order: one for a single rank, a
    split's or a configured mode; ddp then fsdp2 for co-located data parallel with auto on CUDA."""
    mode = parallel_mode(cfg)
    if mode == "none":
        return ["none"]
    if mode == "fsdp2" or cfg.train.data_parallel == "ddp" or cfg.topology.layout != "colocated-dp":
        return [mode]
    return ["ddp"] if cfg.device != "cuda" else ["ddp", "fsdp2"]


def choose_parallel(cfg: RunConfig, role: GpuRole, cuda: str, gpu_bytes: int, cal: Calibration = DEFAULT_CALIBRATION,
                    shape: TargetShape | None = None) -> tuple[DataParallel, str, int]:
    """(data_parallel, recompute, need bytes) one GPU of ``role`` runs with, as the trainer resolves "auto" on a GPU
    of gpu_bytes.

    One drafter rank: "none" (no wrapper). A split's drafter ranks: "ddp". Co-located data parallel with
    train.data_parallel = auto: "ddp" where DDP fits at some recompute mode (train.recompute = auto: the fastest that
    fits, as choose_recompute), else "fsdp2" (with its own fastest recompute); ddp or fsdp2 as configured otherwise.
    Fits: fits_gpu, the run's headroom kept. When nothing fits, the last mode tried is returned with its need (the
    caller refuses it). On a CPU run (device = "cpu") auto is ddp and recompute auto is off, as the trainer reads
    them there.
    """
    shape = shape or load_target_shape(cfg.target.path)
    if role == "target":
        return "none", recompute_mode(cfg), sum(p.bytes for p in role_parts(cfg, shape, role, cuda, cal))
    out: tuple[DataParallel, str, int] = ("none", "off", 0)
    for dp in parallel_tries(cfg):
        case = with_parallel(cfg, dp)
        if cfg.train.recompute == "auto" and cfg.device == "cuda":
            recompute, need = choose_recompute(case, role, cuda, gpu_bytes, cal, shape)
        else:
            recompute = recompute_mode(case)
            need = sum(p.bytes for p in role_parts(with_recompute(case, recompute), shape, role, cuda, cal))
        out = (dp, recompute, need)
        if fits_gpu(cfg, need, gpu_bytes):
            break
    return out


def drafter_layer_bytes(shape: TargetShape, w: Workload, cal: Calibration, recompute: str = "off", compiled: bool = True) -> int:
    """Activations one drafter layer saves for backward over the whole batch.

    recompute "mlp" keeps the MLP's input instead of its post-attention norm and intermediate
    activations; "layer" keeps only the layer's input (the rest is rebuilt during backward).
    """
    if recompute == "layer":
        return int(w.queries * BF16 * shape.hidden)
    act_h, act_q, act_i, act_kv = ((cal.drafter_act_h, cal.drafter_act_q, cal.drafter_act_i, cal.drafter_act_kv) if compiled
                                   else (cal.eager_act_h, cal.eager_act_q, cal.eager_act_i, cal.eager_act_kv))
    if recompute == "mlp" and compiled:
        act_i = 0.0  # the MLP block keeps only its input, which act_h counts already
    elif recompute == "mlp":
        act_h, act_i = act_h / 2 + 1, 0.0  # the input norm's half of act_h, plus the checkpointed input
    per_q = BF16 * (act_h * shape.hidden + act_q * shape.q_width + act_i * shape.intermediate)
    per_q += FP32 * (shape.heads + shape.heads + 2)  # attention logsumexp, q-norm and 2 layer-norm statistics
    per_kv = BF16 * act_kv * shape.kv_width + FP32 * shape.kv_heads  # + k-norm statistics
    return int(w.queries * per_q + w.kv_tokens * per_kv)


def recompute_mode(cfg: RunConfig) -> str:
    """The configured recompute, with auto read as off (callers that know the GPU use choose_recompute)."""
    return "off" if cfg.train.recompute == "auto" else cfg.train.recompute


def headroom_bytes(cfg: RunConfig) -> int:
    """train.memory_headroom_gib in bytes: what a GPU keeps free beyond the predicted peak."""
    return int(cfg.train.memory_headroom_gib * GiB)


def fits_gpu(cfg: RunConfig, need_bytes: int, gpu_bytes: int) -> bool:
    """The one fit rule: the predicted peak and the run's headroom (train.memory_headroom_gib) within gpu_bytes."""
    return need_bytes + headroom_bytes(cfg) <= gpu_bytes


RECOMPUTE_MODES = ("off", "mlp", "layer")  # fastest first, each keeping fewer activations


def recompute_trials(cfg: RunConfig, role: GpuRole, cuda: str, gpu_bytes: int, cal: Calibration = DEFAULT_CALIBRATION,
                     shape: TargetShape | None = None) -> Iterator[tuple[str, int, bool]]:
    """(mode, need bytes, fits) of each recompute mode, fastest first: what train.recompute = auto tries, in order
    (a caller that stops at the first fit computes no more)."""
    shape = shape or load_target_shape(cfg.target.path)
    for mode in RECOMPUTE_MODES:
        need = sum(p.bytes for p in role_parts(with_recompute(cfg, mode), shape, role, cuda, cal))
        yield mode, need, fits_gpu(cfg, need, gpu_bytes)


def choose_recompute(cfg: RunConfig, role: GpuRole, cuda: str, gpu_bytes: int, cal: Calibration = DEFAULT_CALIBRATION,
                     shape: TargetShape | None = None) -> tuple[str, int]:
    """(mode, need bytes) for train.recompute = auto: the fastest mode whose peak fits gpu_bytes with the run's
    headroom (fits_gpu), else "layer"."""
    need = 0
    for mode, need, fits in recompute_trials(cfg, role, cuda, gpu_bytes, cal, shape):
        if fits:
            return mode, need
    return "layer", need


def with_recompute(cfg: RunConfig, mode: str) -> RunConfig:
    out = cfg.model_copy(deep=True)
    out.train.recompute = mode
    return out


def _drafter_step_parts(cfg: RunConfig, shape: TargetShape, w: Workload, cal: Calibration) -> list[Part]:
    rs = fsdp2_reduce_scatter_bytes(cfg, shape)
    shape = drafter_shape(cfg, shape)  # the drafter's layer sizes; hidden and vocab stay the target's
    n = cfg.drafter.num_layers
    mode = recompute_mode(cfg)
    compiled = cfg.train.compile
    layer = drafter_layer_bytes(shape, w, cal, mode, compiled)
    full_layer = drafter_layer_bytes(shape, w, cal, compiled=compiled)  # what backward rebuilds of one recomputed layer
    h, v, d = shape.hidden, shape.vocab, shape.head_dim
    q_blocks = math.ceil(w.queries_per_seq / FLEX_BLOCK)
    kv_blocks = math.ceil((w.seq_len + w.queries_per_seq) / FLEX_BLOCK)
    # kv_indices/full_kv_indices [B,1,Qb,KVb] and q_indices/full_q_indices [B,1,KVb,Qb] + counts
    mask_kinds = len(set(cfg.drafter.layer_types)) or 1  # one BlockMask per layer type (full, sliding)
    mask = mask_kinds * w.sequences * INT32 * (4 * q_blocks * kv_blocks + 2 * q_blocks + 2 * kv_blocks)
    attn_ws = BF16 * (w.queries * shape.q_width + 2 * w.kv_tokens * shape.kv_width) + FP32 * w.queries * shape.heads
    kl = cfg.train.kl_weight > 0
    m = w.loss_tokens
    # _ChunkedLMHeadLoss: the selected hidden states [M, H] and their gradient, computed in the
    # forward pass and kept for backward; with soft labels the target's last hidden state is
    # gathered per query [Q, H] and then selected [M, H].
    loss_inputs = 2 * BF16 * m * h + (BF16 * (w.queries + m) * h if kl else 0)
    # train.slot_weights other than gamma: per-row CE (and KL) kept for the factors, the factors, the weights and
    # the gradient scale, fp32 [M] each (dflash.train.loss.acceptance_weights); the gradient is scaled in place
    weighted = cfg.train.slot_weights != "gamma"
    loss_inputs += FP32 * m * (4 + kl) if weighted else 0
    chunk = int(w.loss_chunk * v * BF16 * (cal.loss_bf16_buffers + (cal.kl_bf16_buffers if kl else 0.0)))
    rope = BF16 * 2 * d * (2 * w.queries + 2 * w.tokens)  # cos+sin for queries, context, and [context; queries]
    backward = int(cal.backward_transient_layers * full_layer) + attn_ws
    if mode != "off":  # the recomputed layer's (or MLP's) activations live while its gradient is formed
        backward += full_layer - drafter_layer_bytes(shape, w, cal, "mlp" if mode == "mlp" else "layer", compiled)
    parts = [
        Part("context projection (fc out, hidden norm fp32 pair + bf16 out)", (2 * FP32 + BF16) * w.tokens * h + FP32 * w.tokens,
             "activation"),
        Part(f"block tokens ({w.queries} queries: ids, labels, weights, embeddings, RoPE)",
             w.queries * (40 + BF16 * h) + rope, "activation"),
        Part(f"layer activations ({n} layers x {layer / GiB:.2f} GiB, recompute {mode})", n * layer, "activation"),
        Part("final norm (fp32 pair + bf16 out)", (2 * FP32 + BF16) * w.queries * h + FP32 * w.queries, "activation"),
        Part(f"flex block mask ({w.sequences} seqs)", mask, "activation"),
        Part(f"loss inputs ({m} lm_head rows: hidden + its gradient{', target hidden' if kl else ''}"
             f"{', slot weight factors' if weighted else ''})", loss_inputs,
             "activation"),
        # The loss chunks live in the forward pass (the loss computes its gradient there), the
        # backward pass's transients after them: the peak holds the larger of the two.
        Part(f"logits + loss chunk ({w.loss_chunk} queries x {v} vocab)", chunk, "activation"),
        Part(f"backward transient ({cal.backward_transient_layers:g} layer + flex workspace) beyond the loss chunk",
             max(0, backward - chunk), "activation"),
    ]
    if rs:  # backward-only, beside the backward transient: it fills the room the loss chunk left first (both scaled)
        k = min(FSDP2_LAYERS_IN_FLIGHT, n)
        room = int(cal.drafter_activation_scale * max(0, chunk - backward))
        parts.append(Part(f"FSDP2 reduce-scatter buffers ({k} layers: bf16 grads + fp32 reduce copy) beyond the loss "
                          "chunk", max(0, rs - room), "static"))
    return parts


def _fixed_parts(cuda: str, cal: Calibration, nccl: bool) -> list[Part]:
    parts = [Part(f"CUDA context + workspaces (CUDA {cuda})", cal.context_bytes(cuda), "fixed")]
    if nccl:  # a GPU that sends or receives features, or all-reduces (DDP) or gathers and reduces (FSDP2) the drafter
        parts.append(Part("NCCL buffers", int(cal.nccl_gib * GiB), "fixed"))
    return parts


def _scaled(parts: list[Part], group: Literal["target", "drafter"], cal: Calibration) -> list[Part]:
    """Tag activation parts with their group and apply that group's fitted scale."""
    scale = cal.target_activation_scale if group == "target" else cal.drafter_activation_scale
    return [replace(p, bytes=int(scale * p.bytes), group=group) if p.kind == "activation" else p for p in parts]


def role_parts(cfg: RunConfig, shape: TargetShape, role: GpuRole, cuda: str, cal: Calibration = DEFAULT_CALIBRATION,
               expandable: bool = True) -> list[Part]:
    """Every component of one GPU of ``role``, then the fragmentation margin and fixed costs.

    expandable: the caching allocator runs with expandable segments, as every profile requires
    (False only to compare with measurements taken under torch's default allocator).
    """
    if role not in ROLES:
        raise MemoryModelError(f"unknown role {role!r}; use target, drafter or colocated")
    split = cfg.topology.layout == "split"
    w = workload(cfg)
    if role == "target":
        parts = _scaled(_target_parts(cfg, shape, w, cal, split), "target", cal)
    elif role == "drafter":
        feats, last = _features_bytes(cfg, shape, w)
        # A drafter rank posts the receives of a step's batches (train.grad_accum of them; RemoteTargets.expect)
        # once the previous step's train_step has returned and freed its features, so they all exist during its
        # first batch, and beside the previous step's grads and update; nothing is received further ahead.
        # Measured: the Qwen3.6-27B recipe drafter allocated 63.1 GiB in a 1 target + 1 drafter run on 2x H200,
        # 63.3 GiB for the same role alone with one batch of features (bench/results/).
        held = cfg.train.grad_accum if split else 1
        parts = _drafter_static_parts(cfg, shape, share_frozen=False)
        parts.append(Part(f"received features in flight ({held} batch{'es' if held != 1 else ''}, train.grad_accum)",
                          held * (feats + last), "activation"))
        step = _scaled(_drafter_step_parts(cfg, shape, w, cal), "drafter", cal)
        parts = _scaled(parts, "drafter", cal)
        parts += _step_only_parts(cfg, shape, sum(p.bytes for p in step)) + step
    else:
        target = _scaled(_target_parts(cfg, shape, w, cal, split=False), "target", cal)
        forward = next(p for p in target if p.component.startswith("forward working set"))
        step = _scaled(_drafter_step_parts(cfg, shape, w, cal), "drafter", cal)
        step_only = _step_only_parts(cfg, shape, sum(p.bytes for p in step))
        # DDP's buckets (FSDP2's grads) are held through the target forward too: only the step's transient parts overlap it
        overlap = step + [p for p in step_only if not p.held]
        extra = max(0, forward.bytes - sum(p.bytes for p in overlap))
        parts = [p for p in target if p is not forward]
        parts += _drafter_static_parts(cfg, shape, share_frozen=True)
        parts += step_only + step
        parts.append(Part("target forward beyond the drafter step (runs before it)", extra, "activation", "target"))
    frag = fragmentation(cal, expandable)
    margin = int(frag * sum(p.bytes for p in parts))
    allocator = "expandable segments" if expandable else "default allocator"
    parts.append(Part(f"fragmentation margin ({frag:.0%} of allocated, {allocator})", margin, "margin"))
    return parts + _fixed_parts(cuda, cal, (split and role != "colocated") or drafter_ranks(cfg) > 1)


def fragmentation(cal: Calibration, expandable: bool) -> float:
    """Share of allocated bytes the caching allocator reserves but cannot reuse, per its settings."""
    return cal.fragmentation if expandable else cal.fragmentation_default_allocator


def role_need_bytes(cfg: RunConfig, role: GpuRole, cuda: str, cal: Calibration = DEFAULT_CALIBRATION,
                    shape: TargetShape | None = None) -> int:
    """Bytes one GPU of ``role`` needs at its peak, fragmentation margin included.

    shape: the target's, when the caller already has it (preflight gathers it once);
    otherwise it is read from target.path.
    """
    if role == "colocated" and role not in cfg.topology.roles:
        raise MemoryModelError("role 'colocated' needs a config without topology lists; use target or drafter")
    if role in ("target", "drafter") and role not in cfg.topology.roles:
        raise MemoryModelError(f"role {role!r} needs topology.target_gpus and drafter_gpus; this config is co-located, use 'colocated'")
    shape = shape or load_target_shape(cfg.target.path)
    return sum(p.bytes for p in role_parts(cfg, shape, role, cuda, cal))
