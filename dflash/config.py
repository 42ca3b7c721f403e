"""The one run config, read by preflight, the memory estimator and the trainer alike.

A run config is a TOML file (see ``configs/``). Unknown keys are rejected, every field
says what it means and its unit, and validation errors name the field and its range.
This module imports no torch: preflight reads it in a process that must stay light.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import math
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dflash.errors import DflashError


def default_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """n target layers spread evenly over [1, L-3]; n == 1 takes the middle layer L // 2."""
    if n < 1:
        raise ValueError(f"need at least one target layer, got n={n}")
    if n == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    if last - first + 1 < n:
        raise ValueError(
            f"cannot spread {n} distinct layers over [1, {last}] of a {num_target_layers}-layer target; "
            f"use fewer drafter layers or give target_layer_ids explicitly"
        )
    step = (last - first) / (n - 1)
    return [math.floor(first + i * step + 0.5) for i in range(n)]


# Upper bounds of values that can never work (each is far above any real run, far below an overflow).
MAX_TOKENS = 2**24  # padded tokens in one batch: 16M x even a 1024-wide hidden state in bf16 is 32 GiB per layer
MAX_TOKEN_ID = 2**31 - 1  # token ids are int32 in the shards and int64 in torch; no vocabulary comes near
MAX_SEED = 2**32 - 1  # numpy's default_rng and torch.manual_seed both take it; anchors add the batch index


FP8_MIN_CAPABILITY = (8, 9)  # train.fp8, target.precision = "fp8": GPUs with fp8 tensor cores (Ada 8.9, Hopper 9.0 and later)
FP8_MIN_FEATURES = 1024  # target.precision = "fp8" quantises a linear only when its in and out features are both at least
                         # this: smaller ones gain nothing from e4m3 matmuls and stay in target.dtype


class _Strict(BaseModel):
    # allow_inf_nan=False: an inf or nan float (weight_decay = inf) trains NaN weights; refuse it here
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def _no_nul(value: str) -> str:
    if "\0" in value:
        raise ValueError("contains a NUL character; give a plain path")
    return value


class TargetConfig(_Strict):
    path: str = Field(
        "smollm2", min_length=1,
        description="HF model folder (config.json + weights), or 'smollm2' for the embedded default",
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="dtype the frozen target runs in"
    )
    random_init: bool = Field(
        False, description="build the target from config.json with random weights: memory and speed measurements only "
        "(the drafter learns nothing useful; the gate and every start warn); refused when target.path holds weights"
    )
    compile: bool = Field(
        True, description="torch.compile each target decoder layer on CUDA (one graph per layer type, any batch shape; "
        "the linear-attention kernels stay opaque)"
    )
    precision: Literal["bf16", "fp8"] = Field(
        "bf16", description="bf16: the target's matmuls in target.dtype; fp8: each decoder linear with in and out "
        f"features >= {FP8_MIN_FEATURES} runs e4m3 matmuls, weights quantised per output channel as they load, "
        "activations per row at each call (torchao's float8 on CUDA compute capability 8.9+, the same arithmetic "
        "emulated in float32 on CPU); attention, the Gated DeltaNet recurrence, norms, embedding and lm_head stay "
        "in target.dtype"
    )

    _path = field_validator("path")(_no_nul)


class DrafterConfig(_Strict):
    num_layers: int = Field(5, ge=1, le=64, description="drafter decoder layers")
    block_size: int = Field(32, ge=2, le=128, description="tokens drafted per block (slot 0 = anchor token)")
    target_layer_ids: list[Annotated[int, Field(ge=0, le=1023)]] = Field(
        default_factory=list, max_length=64,
        description="target layers (0-based, < the target's layer count; preflight `config` checks it) whose hidden "
        "states feed the drafter; empty = spread evenly over [1, L-3]",
    )
    mask_token_id: int | None = Field(
        None, ge=0, le=MAX_TOKEN_ID, description="token id filling the non-anchor slots (< the target's vocab; "
        "preflight `config` checks it); None = resolved from the tokenizer"
    )
    # The drafter's own layer shape (its hidden size is the target's: it reads the target's embedding and lm_head).
    num_attention_heads: int | None = Field(None, ge=1, le=1024, description="query heads per drafter layer; "
                                            "None = the target's")
    num_key_value_heads: int | None = Field(None, ge=1, le=1024, description="key/value heads per drafter layer "
                                            "(divides the query heads); None = the target's")
    head_dim: int | None = Field(None, ge=2, le=1024, multiple_of=2, description="width of one attention head "
                                 "(even: RoPE rotates pairs); None = the target's")
    intermediate_size: int | None = Field(None, ge=1, le=2**20, description="SwiGLU MLP width of a drafter layer; "
                                          "None = the target's")
    layer_types: list[Literal["full_attention", "sliding_attention"]] = Field(
        default_factory=list, max_length=64, description="attention of each drafter layer, num_layers entries; "
        "empty = all full_attention",
    )
    sliding_window: int | None = Field(
        None, ge=2, le=MAX_TOKENS, description="positions a sliding_attention query sees back from its own position, "
        "itself included (tokens; HF's sliding_window): context p is seen iff anchor + slot - window < p < anchor; "
        "needed with sliding layers, at least block_size",
    )

    @model_validator(mode="after")
    def _shape(self) -> DrafterConfig:
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and kv is not None and heads % kv:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for num_layers = {self.num_layers}; "
                             "give one per layer, or [] for all full_attention")
        sliding = "sliding_attention" in self.layer_types
        if sliding and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set; set it (e.g. 2048)")
        if not sliding and self.sliding_window is not None:
            raise ValueError(f"sliding_window = {self.sliding_window} but no layer is sliding_attention; "
                             "add sliding_attention to layer_types or drop sliding_window")
        if sliding and self.sliding_window < self.block_size:
            raise ValueError(f"sliding_window ({self.sliding_window}) must be >= block_size ({self.block_size}): "
                             "a block's queries see their whole block")
        return self


class DataConfig(_Strict):
    path: str = Field("data/train", min_length=1, description="folder of Arrow shards with input_ids and loss_mask")
    token_budget: int = Field(49152, ge=16, le=MAX_TOKENS, description="max padded tokens per batch, rows x longest row "
                              "(with data.packing: the sum of its lengths) (tokens; "
                              f"at most {MAX_TOKENS}: more activations than any GPU holds)")
    max_batch_size: int = Field(64, ge=1, le=MAX_TOKENS, description="max sequences per batch (at most "
                                f"{MAX_TOKENS}: a batch never holds more sequences than tokens)")
    num_buckets: int = Field(16, ge=1, le=1024, description="length buckets for batching")
    pack_remainders: bool = Field(False, description="pack the batches left part-full at each (bucket, batch size) "
                                  "group's end into as few batches as the budget allows, the same ones every epoch "
                                  "(a lognormal mix around 2,826 tokens: 142 -> 97 batches an epoch, 64% -> 94% of the budget used); "
                                  "bucketed batches only: refused with data.packing")
    packing: bool = Field(False, description="each batch a pack: samples laid end to end in one row, their lengths "
                          "summing to at most token_budget, at most max_batch_size of them; packed once (best fit, "
                          "longest first), the same batches every epoch in a new order; num_buckets plays no part "
                          "(a lognormal mix of 3,000 samples around 2,826 tokens: 169 batches an epoch, 99.7% of the "
                          "budget used, against 178 and 94.7% bucketed with pack_remainders)")
    max_length: int | None = Field(
        None, ge=2, le=MAX_TOKENS, description="samples longer than this (tokens) fail the dataset check; "
        "None = token_budget"
    )

    _path = field_validator("path")(_no_nul)

    @model_validator(mode="after")
    def _packing_has_no_remainders(self) -> DataConfig:
        if self.packing and self.pack_remainders:
            raise ValueError("data.pack_remainders packs the bucketed batches' remainders, and with data.packing = true "
                             "there are no buckets (every batch is a pack); set data.pack_remainders = false")
        return self


class TrainConfig(_Strict):
    max_anchors: int = Field(1024, ge=1, le=MAX_TOKENS, description="anchors sampled per sequence per step "
                             "(at most one per token)")
    batch_anchors: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="cap on anchors summed over a batch (None = max_anchors per sequence, uncapped); "
        "bounds the drafter's query tokens per step to batch_anchors x block_size",
    )
    gamma: float = Field(10.0, ge=1e-6, description="slot weight decay: slot k weighs exp(-(k-1)/gamma) (at least "
                         "1e-6, which already weights slot 1 alone; near 1e-38 gamma is 0 in float32 and the loss nan)")
    slot_weights: Literal["gamma", "cap", "dpace", "auf"] = Field(
        "gamma", description="per-slot loss weight: gamma (the exp decay alone); cap, dpace, auf multiply the decay by a "
        "detached factor from the drafter's own predictions: cap prod_{j<=k} ((1-a) q_j + a), dpace its suffix sum "
        "(arXiv 2605.18810), auf 1 up to the first wrong top-1 inclusive (arXiv 2607.01893); docs/training.md",
    )
    cap_alpha: float = Field(0.5, ge=0.0, le=1.0, description="a of slot_weights cap and dpace: each slot's factor is "
                             "(1-a) x the drafter's probability of its label + a (1 = gamma alone)")
    kl_weight: float = Field(0.0, ge=0.0, le=1.0, description="share of the soft-label KL in the loss (0 = pure CE)")
    lr: float = Field(6e-4, gt=0, le=1.0, description="peak learning rate")
    warmup_ratio: float = Field(0.04, ge=0.0, lt=1.0, description="share of steps with linear warmup")
    weight_decay: float = Field(0.01, ge=0.0, le=1.0, description="AdamW weight decay (at most 1: each step scales "
                                "weights by 1 - lr x weight_decay, and lr <= 1)")
    grad_clip: float = Field(1.0, ge=0.0, description="max grad norm (0 = off)")
    epochs: int = Field(6, ge=1, description="passes over the dataset")
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps (None = epochs)")
    grad_accum: int = Field(
        1, ge=1, le=1024, description="batches each drafter rank trains per optimizer step (a step takes "
        "grad_accum x drafter ranks batches)"
    )
    loss_chunk: int = Field(8192, ge=16, le=MAX_TOKENS, description="query tokens per logits/loss chunk (one fp32 [chunk, vocab] buffer; "
                            "two with kl_weight > 0)")
    memory_headroom_gib: float = Field(
        3.0, ge=0.0, le=64.0, description="GiB of each GPU left free beyond the memory model's predicted peak: "
        "recompute and data_parallel = auto choose only what fits with it, and preflight's gpu-memory check and "
        "dflash-estimate judge fits with it (NVML, which counts the whole card, read 2.99 GiB above the prediction "
        "for one rank of the users' FSDP2 preset: 96.47 vs 93.48 GiB)",
    )
    recompute: Literal["auto", "off", "mlp", "layer"] = Field(
        "auto", description="activation recompute per drafter layer: off (fastest), mlp (recompute each layer's MLP in "
        "backward), layer (whole layers); auto = the fastest the memory model fits on the GPU (off on CPU)",
    )
    fp8: Literal["off", "mlp"] = Field(
        "off", description="mlp: each drafter MLP's forward and input-gradient matmuls in fp8 (torchao's float8 training, e4m3, row "
        "scales; CUDA compute capability 8.9+; the MLP 1.26x faster on an H100, its outputs ~6.6% from bf16: bench/fp8_mlp.py)",
    )
    data_parallel: Literal["auto", "ddp", "fsdp2"] = Field(
        "auto", description="how several drafter ranks hold the drafter: ddp (a full replica and its fp32 state on "
        "every rank), fsdp2 (fully_shard per drafter layer: parameters, gradients and AdamW state split over the "
        "ranks, the frozen target whole on each); auto = ddp where the memory model fits it, else fsdp2 "
        "(ddp on CPU); one drafter rank uses neither",
    )
    cache_features: bool = Field(
        False, description="keep each sample's target features in memory after its first batch, so later epochs "
        "skip the target (co-located runs on small data: ~tokens x layers x hidden x 4 bytes)",
    )
    log_every: int = Field(10, ge=1, description="steps between metric lines")
    save_every: int = Field(500, ge=1, description="steps between checkpoints")
    keep_last: int = Field(3, ge=1, description="checkpoints kept")
    async_save: bool = Field(True, description="write checkpoints on a background thread while training goes on: a save "
                             "stalls the step loop only to copy the state to host memory (seconds of writing and "
                             "hashing, ~31 s for 20 GB, happen beside the steps); false writes them on the training thread")
    compile: bool = Field(True, description="torch.compile each drafter layer's norms, RoPE and SwiGLU on CUDA (one graph "
                          "for all layers); flex attention is compiled on CUDA either way")
    compile_cache: str = Field("", description="compile cache artifact file (dflash-train --warm-cache writes it; a "
                               "compiled run loads it before its first compile when torch, Triton, the GPU and the "
                               "shape classes match); empty: <the profile's compile cache dir>.artifacts/<target "
                               "hash>-<drafter hash>.dfcache; set it to a file carried from another machine")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seed for init, shuffling and anchors (numpy and torch "
                      f"take 0..{MAX_SEED})")


Layout = Literal["colocated", "colocated-dp", "split"]
# What one GPU does in a run (not a process rank): the target forward, the drafter step, or both.
GpuRole = Literal["target", "drafter", "colocated"]
ROLES: tuple[GpuRole, ...] = ("target", "drafter", "colocated")  # the order roles are listed in (estimates, reports)
ONE_DEVICE_GPU = "0"  # the GPU of a one-device run (index after CUDA_VISIBLE_DEVICES): the process's default device


class TopologyConfig(_Strict):
    """Where the target and the drafter run: one device (every list empty), co-located data parallel
    (`colocated_gpus`), or split (`target_gpus` + `drafter_gpus`). docs/training.md, "Layouts"."""

    target_gpus: list[str] = Field(
        default_factory=list, description="GPUs (indices or UUIDs, after CUDA_VISIBLE_DEVICES) running the target"
    )
    drafter_gpus: list[str] = Field(
        default_factory=list, description="GPUs training the drafter; both empty = co-located on one device"
    )
    colocated_gpus: list[str] = Field(
        default_factory=list, description="GPUs (indices or UUIDs, after CUDA_VISIBLE_DEVICES; at least 2) each "
        "running its own target and a drafter replica, the drafter's gradients all-reduced (co-located data "
        "parallel, one process per GPU); excludes target_gpus/drafter_gpus; empty = not this layout",
    )
    queue_depth: int = Field(2, ge=1, le=64, description="batches a target rank may have in flight per send queue")
    timeout_s: int = Field(300, ge=10, le=7 * 86400, description="seconds a rank waits on a peer before the run is "
                           "failed (at most a week: a peer silent that long is gone)")

    @property
    def layout(self) -> Layout:
        """colocated (one process), colocated-dp (colocated_gpus) or split (target_gpus + drafter_gpus)."""
        if self.colocated_gpus:
            return "colocated-dp"
        return "split" if self.target_gpus else "colocated"

    @property
    def trainer_gpus(self) -> list[str]:
        """The GPUs that train a drafter replica: drafter_gpus (split) or colocated_gpus ([] for one device)."""
        return self.colocated_gpus or self.drafter_gpus

    @property
    def gpu_roles(self) -> dict[str, GpuRole]:
        """Each GPU of the run -> its role, in rank order (the GPUs that train the drafter first, then the targets).

        The one rule for roles: the memory model, preflight, the launcher and the trainer all ask it. A split run's
        GPUs are `drafter` or `target`; a co-located GPU (one device, or each of colocated_gpus) holds a target and
        a drafter replica: `colocated`. The one-device run's GPU is ONE_DEVICE_GPU."""
        if self.layout == "split":
            return {**dict.fromkeys(self.drafter_gpus, "drafter"), **dict.fromkeys(self.target_gpus, "target")}
        return dict.fromkeys(self.colocated_gpus or [ONE_DEVICE_GPU], "colocated")

    @property
    def roles(self) -> list[GpuRole]:
        """The roles this run's GPUs have, each once, in ROLES order: [target, drafter] (split) or [colocated]."""
        present = set(self.gpu_roles.values())
        return [r for r in ROLES if r in present]

    @property
    def trainer_role(self) -> GpuRole:
        """The role of a GPU that trains the drafter (drafter or colocated): rank 0's, in every layout."""
        return next(iter(self.gpu_roles.values()))

    @model_validator(mode="after")
    def _disjoint(self) -> TopologyConfig:
        if self.colocated_gpus:
            if self.target_gpus or self.drafter_gpus:
                raise ValueError("topology.colocated_gpus excludes target_gpus and drafter_gpus (co-located data "
                                 "parallel gives every GPU both roles); give colocated_gpus or the two split lists")
            if len(self.colocated_gpus) < 2:
                raise ValueError(f"topology.colocated_gpus lists {len(self.colocated_gpus)} GPU; co-located data "
                                 "parallel needs at least 2 (one GPU is the plain co-located run: leave it empty)")
            twice = sorted({g for g in self.colocated_gpus if self.colocated_gpus.count(g) > 1})
            if twice:
                raise ValueError(f"topology.colocated_gpus lists GPUs {twice} more than once; give each GPU once")
        both = set(self.target_gpus) & set(self.drafter_gpus)
        if both:
            raise ValueError(f"GPUs {sorted(both)} are in both target_gpus and drafter_gpus; give each GPU one role")
        if bool(self.target_gpus) != bool(self.drafter_gpus):
            raise ValueError("give both target_gpus and drafter_gpus, or neither (co-located)")
        return self


class EvalConfig(_Strict):
    """Held-out evaluation during training (dflash.train.heldout): off unless `path` or `holdout` names the data."""

    path: str = Field("", description="held-out Arrow dataset folder (input_ids + loss_mask shards, never trained on); "
                      "empty = none")
    holdout: int = Field(0, ge=0, le=MAX_TOKENS, description="samples taken out of data.path by sample id (a seeded "
                         "choice, recorded in heldout.json) and never trained on; 0 = none; excludes `path`")
    every: int = Field(0, ge=0, description="steps between held-out evaluations (0 = only at the end; the end is "
                       "always evaluated)")
    real_prompts: int = Field(0, ge=0, le=4096, description="held-out samples whose prompt (tokens before the first "
                              "loss_mask=1) is also decoded speculatively against the target, checked lossless "
                              "(the dflash-eval loop, batch 1); 0 = teacher-forced numbers only")
    max_new_tokens: int = Field(32, ge=1, le=MAX_TOKENS, description="tokens generated per real-decoding prompt")
    ddtree_budget: int = Field(0, ge=0, le=4096, description="also DDTree decoding of the real_prompts at this many "
                               "tree nodes (arXiv 2604.12989; dflash.eval.ddtree), checked lossless: "
                               "heldout_ddtree_accept_len; 0 = off; needs real_prompts")
    best_by: Literal["linear", "ddtree"] = Field(
        "linear", description="what checkpoints/best maximises: the held-out mean acceptance length of linear "
        "drafting (heldout_accept_len), or of DDTree decoding at ddtree_budget nodes (heldout_ddtree_accept_len, "
        "what a DDTree deployment gets); ddtree needs ddtree_budget",
    )
    export: Literal["best", "last"] = Field(
        "best", description="which weights the finished run exports to <output_dir>/drafter: the best held-out "
        "checkpoint (checkpoints/best), or the last step; without held-out evaluation always the last",
    )

    _path = field_validator("path")(_no_nul)

    @property
    def enabled(self) -> bool:
        return bool(self.path) or self.holdout > 0

    @model_validator(mode="after")
    def _one_source(self) -> EvalConfig:
        if self.path and self.holdout:
            raise ValueError("give eval.path (a held-out dataset) or eval.holdout (samples taken out of data.path), "
                             "not both")
        if self.ddtree_budget and not self.real_prompts:
            raise ValueError("eval.ddtree_budget decodes the eval.real_prompts: set real_prompts >= 1 too")
        if self.best_by == "ddtree" and not self.ddtree_budget:
            raise ValueError("eval.best_by = 'ddtree' chooses by DDTree acceptance: set eval.ddtree_budget >= 1 "
                             "(and real_prompts) too")
        return self


TRACKERS = ("tensorboard", "wandb", "trackio")


class RunConfig(_Strict):
    output_dir: str = Field("runs/default", min_length=1, description="run dir: checkpoints, metrics, preflight report")
    device: Literal["cuda", "cpu"] = Field("cuda", description="cuda, or cpu (GPU checks are skipped)")
    profile: str = Field("train-cu128", description="environment profile the run needs (envs/<profile>.toml)")
    target: TargetConfig = Field(default_factory=TargetConfig)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    init_from: str = Field("", description="exported DFlash drafter folder (config.json + model.safetensors, ours or "
                           "the public layout) whose weights start a fresh run; its shape must equal this run's "
                           "drafter; empty = random init (dflash-train --init-from)")
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = Field(
        default_factory=list, max_length=3, description="trackers that also receive every metrics row, under the "
        "metrics.jsonl names (dflash-train --report-to); each is imported only when listed",
    )

    _output_dir = field_validator("output_dir")(_no_nul)
    _init_from = field_validator("init_from")(_no_nul)

    @model_validator(mode="after")
    def _cache_is_colocated(self) -> RunConfig:
        if self.train.cache_features and self.topology.target_gpus:
            raise ValueError("train.cache_features works in co-located runs only (target ranks stream features); "
                             "drop it or the topology lists")
        if self.train.cache_features and self.topology.colocated_gpus:
            raise ValueError("train.cache_features works on one device only (in topology.colocated_gpus every rank "
                             "would cache every sample it meets, N copies); drop it or topology.colocated_gpus")
        return self

    @model_validator(mode="after")
    def _fsdp2_is_colocated_dp(self) -> RunConfig:
        if self.train.data_parallel == "fsdp2" and self.topology.target_gpus:
            raise ValueError("train.data_parallel = \"fsdp2\" shards the drafter over co-located data-parallel ranks "
                             "(topology.colocated_gpus); a split run's drafter ranks use ddp: set "
                             "train.data_parallel = \"auto\" or \"ddp\"")
        return self

    @model_validator(mode="after")
    def _fp8_needs_cuda(self) -> RunConfig:
        if self.train.fp8 != "off" and self.device != "cuda":
            raise ValueError(f"train.fp8 = \"{self.train.fp8}\" needs device = \"cuda\" (fp8 tensor cores); "
                             "set train.fp8 = \"off\" for a CPU run")
        if self.train.fp8 != "off" and not self.train.compile:
            raise ValueError(f"train.fp8 = \"{self.train.fp8}\" needs train.compile = true (uncompiled, its quantisation "
                             "passes cost more than the fp8 matmuls save: bench/fp8_mlp.py); set one of them")
        return self

    @model_validator(mode="after")
    def _fp8_target_compiles(self) -> RunConfig:
        if self.target.precision == "fp8" and self.device == "cuda" and not self.target.compile:
            raise ValueError("target.precision = \"fp8\" needs target.compile = true on CUDA (uncompiled, quantising "
                             "every activation costs more than the fp8 matmuls save); set target.compile = true or "
                             "target.precision = \"bf16\"")
        return self

    @model_validator(mode="after")
    def _eval_is_colocated(self) -> RunConfig:
        if self.eval.enabled and self.topology.colocated_gpus:
            raise ValueError("[eval] works in one-device co-located runs only for now (topology.colocated_gpus runs "
                             "one process per GPU); drop [eval] or topology.colocated_gpus, and evaluate checkpoints "
                             "with dflash-eval")
        if self.eval.enabled and self.topology.target_gpus:
            raise ValueError("[eval] works in co-located runs only for now (split runs' target ranks do not serve "
                             "held-out batches yet); drop [eval] or the topology lists, and evaluate checkpoints with "
                             "dflash-eval")
        return self

    def drafter_hash(self) -> str:
        """Hash of what decides the compiled kernels' shapes (for the compile-cache manifest)."""
        key = {"drafter": self.drafter.model_dump(), "target": self.target.path, "dtype": self.target.dtype}
        if self.train.fp8 != "off":  # other MLP graphs (absent when off: older manifests keep their hash)
            key["fp8"] = self.train.fp8
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


    def target_hash(self) -> str:
        """Hash of what decides the target's compiled graphs and the batch shapes a run compiles for (the
        compile-cache manifest): target path, dtype and precision, target.compile, the dataset (its lengths place the bucket
        edges) and the batching knobs (warm-cache runs one batch of each shape class they make)."""
        key = {"target": self.target.path, "dtype": self.target.dtype, "compile": self.target.compile,
               "batches": [self.data.path, self.data.token_budget, self.data.max_batch_size, self.data.num_buckets,
                           *([True] if self.data.pack_remainders else []),
                           *(["packing"] if self.data.packing else [])]}  # unset: the hash of earlier configs
        if self.target.precision != "bf16":  # fp8 linears are other graphs (absent for bf16: older manifests keep theirs)
            key["precision"] = self.target.precision
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


class ConfigError(DflashError):
    """A run config that cannot be read or does not validate; the message is one line."""

    exit_code = 2  # bad input


class Overrides(dict):
    """Dotted overrides of a run config ({"train.lr": 1e-4}), each with how the user gave it ("--set train.lr=1e-4",
    "--colocated-gpus 0,1"): a value that does not validate is blamed on that, never on the config file."""

    def __init__(self, values: dict | None = None, given: dict[str, str] | None = None):
        super().__init__(values or {})
        self.given = dict(given or {})

    def put(self, key: str, value, given: str) -> None:
        self[key] = value
        self.given[key] = given

    def merge(self, other: dict) -> Overrides:
        """`other`'s overrides on top of these, with how they were given (a plain dict's: unnamed)."""
        self.update(other)
        self.given.update(getattr(other, "given", {}))
        return self


def _blame(loc: tuple, source: str, given: dict[str, str], file_raw: dict) -> str:
    """Who gave the value at `loc`: the override that set it or a value above it; the overrides inside it when the
    file does not have it; else the file, with the overrides inside it when they changed part of it (a section's
    rule, the whole config's)."""
    where = ".".join(str(p) for p in loc)
    for key, how in given.items():
        if where == key or where.startswith(key + "."):
            return how
    inside = list(dict.fromkeys(how for key, how in given.items() if not where or key.startswith(where + ".")))
    if not inside:
        return source
    node = file_raw
    for part in loc:
        node = node.get(part) if isinstance(node, dict) else None
    return ", ".join(inside) if loc and node is None else f"{source} with {', '.join(inside)}"


def _section_model(loc: tuple) -> type[BaseModel] | None:
    """The config model (RunConfig or one of its sections) that holds the field at `loc`, else None."""
    model: type[BaseModel] = RunConfig
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    return model


def did_you_mean(loc: tuple) -> str:
    """' (did you mean data.token_budget?)' for an unknown key at `loc`: the same name in another section, else the
    closest name in its own; '' when nothing is close."""
    import difflib

    key, model = loc[-1], _section_model(loc)
    if model is None or not isinstance(key, str):
        return ""
    sections = {name: f.annotation for name, f in RunConfig.model_fields.items()
                if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)}
    elsewhere = [f"{name}.{key}" for name, sec in sections.items() if key in sec.model_fields and sec is not model]
    if elsewhere:
        return f"; did you mean {elsewhere[0]}?"
    close = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.6)
    prefix = ".".join(str(p) for p in loc[:-1])
    return f"; did you mean {prefix + '.' if prefix else ''}{close[0]}?" if close else ""


def _gpu_names(raw: dict, loc: tuple, how: str) -> str:
    """The fix for GPU names given as numbers: the list as it should be written, quoted, in the form it was given."""
    names = raw.get(loc[0], {}).get(loc[1]) if isinstance(raw.get(loc[0]), dict) else None
    names = [str(n) for n in names] if isinstance(names, list) else ["0", "1"]
    if how.startswith("--set "):
        return f"quote each GPU name: --set '{loc[0]}.{loc[1]}={json.dumps(names, separators=(',', ':'))}'"
    return f"quote each GPU name: {loc[1]} = {json.dumps(names)}"


def _format_validation(err: ValidationError, source: str, raw: dict | None = None,
                       overrides: dict | None = None, file_raw: dict | None = None) -> str:
    """Every validation error on one line: `source: field: problem; field: problem`, each blamed on where its value
    came from (the file, or the --set or flag that gave it), an unknown key with the closest known one, GPU names
    given as numbers with the list quoted."""
    given = {key: getattr(overrides, "given", {}).get(key, f"the override {key}") for key in overrides or {}}
    groups: dict[str, list[str]] = {}
    quoted = set()
    for e in err.errors():
        loc = e["loc"]
        where = ".".join(str(p) for p in loc) or "(top level)"
        how = _blame(loc, source, given, file_raw if file_raw is not None else raw or {})
        msg = e["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's ValueError
        if e["type"] == "extra_forbidden":
            msg = f"unknown key{did_you_mean(loc)} (check spelling; see configs/ for the allowed keys)"
        elif (e["type"] == "list_type" and len(loc) == 2 and loc[0] == "topology" and str(loc[1]).endswith("_gpus")
              and isinstance(e["input"], (str, int))):
            names = [n.strip() for n in str(e["input"]).split(",") if n.strip()] or ["0", "1"]
            msg = f"give a list of GPU names, got {e['input']!r}; {_gpu_names({loc[0]: {loc[1]: names}}, loc, how)}"
        elif (e["type"] == "string_type" and len(loc) == 3 and loc[0] == "topology" and str(loc[1]).endswith("_gpus")):
            if loc[:2] in quoted:
                continue
            quoted.add(loc[:2])
            where, msg = f"{loc[0]}.{loc[1]}", f"GPU names are strings, got {e['input']!r}; {_gpu_names(raw or {}, loc, how)}"
        groups.setdefault(how, []).append(f"{where}: {msg}")
    return "; ".join(f"{how}: " + "; ".join(parts) for how, parts in groups.items())


_DATE_TIME = (datetime.date, datetime.time, datetime.datetime)


def parse_overrides(pairs: tuple[str, ...] | list[str]) -> Overrides:
    """`--set` pairs -> dotted overrides, the one parser every command uses.

    Values are TOML values, so lists and numbers work (`topology.target_gpus=["0","1"]`,
    `train.lr=1e-4`); a value that is not valid TOML, or is a TOML date or time, is taken as
    a bare string (`target.path=/models/qwen3`). A table (`train={lr=1}`) is refused: it would
    replace the whole section, every other field falling back to its default.
    """
    out = Overrides()
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {pair!r}: expected SECTION.KEY=VALUE, e.g. --set train.lr=1e-4")
        if not all(part.strip() for part in key.split(".")):
            raise ConfigError(f"--set {pair!r}: empty name in {key!r}; write SECTION.KEY=VALUE, e.g. --set train.lr=1e-4")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except (tomllib.TOMLDecodeError, RecursionError):
            value = raw
        if isinstance(value, _DATE_TIME):
            value = raw.strip()
        if isinstance(value, dict):
            first, example = next(iter(value.items()), ("KEY", "VALUE"))
            raise ConfigError(f"--set {pair!r}: a table would replace all of {key}, every other field falling back to "
                              f"its default; set one field per --set, e.g. --set {key}.{first}={json.dumps(example, default=str)}")
        out.put(".".join(part.strip() for part in key.split(".")), value, f"--set {pair.strip()}")
    return out


def load_config(path: str | Path, overrides: dict | None = None) -> RunConfig:
    """Read a TOML run config, apply dotted overrides ({'train.lr': 1e-4}), validate."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.object[e.start:e.start + 1].hex()} at offset {e.start}); "
                          "save the config as UTF-8 TOML") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: values nested too deeply to be a run config; see configs/ for the layout") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except ValueError as e:  # a path with a NUL byte
        raise ConfigError(f"{path!r}: cannot read: {e}") from None
    return config_from_dict(raw, overrides, source=str(path))


def config_from_dict(raw: dict, overrides: dict | None = None, source: str = "config") -> RunConfig:
    """Apply dotted overrides to a parsed config (a copy), validate; every problem is one ConfigError line."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a table of sections, got {type(raw).__name__}; see configs/")
    file_raw, raw = raw, copy.deepcopy(raw)  # TOML dates and times stay as they are: validation names their field
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for depth, p in enumerate(parents):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                where = ".".join(parents[: depth + 1])
                how = getattr(overrides, "given", {}).get(dotted, source)
                raise ConfigError(f"{how}: cannot set {dotted}: {where} is a value ({node!r}), not a section; "
                                  f"set {where}=VALUE")
        node[leaf] = value
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, source, raw, overrides, file_raw)) from None
    except RecursionError:
        raise ConfigError(f"{source}: values nested too deeply to be a run config; see configs/ for the layout") from None


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as TOML-compatible JSON (written beside every run and checkpoint)."""
    return json.dumps(cfg.model_dump(), indent=2, sort_keys=True)


def config_sha256(cfg: RunConfig) -> str:
    """Identity of a resolved config: the gate stamps it into preflight.json, workers compare it."""
    return hashlib.sha256(dump_config(cfg).encode()).hexdigest()


REPO_ROOT = Path(__file__).resolve().parents[1]  # relative target paths fall back to it


def resolve_target_dir(path: str) -> Path:
    """target.path as given (absolute, or found from the working directory), else relative to the repository root.

    The fallback lets the committed configs (``configs/targets/...``) work from any directory. The one target-path
    rule: the memory model, preflight and the trainer's loader all resolve target.path here.
    """
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    return REPO_ROOT / p
