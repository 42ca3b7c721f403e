"""The analytic memory model (dflash/memory.py) and dflash-estimate, on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dflash.commands.estimate import main
from dflash.config import ConfigError, config_from_dict, default_target_layer_ids, load_config
from dflash.memory.calibration import fit_calibration, prediction_errors
from dflash.memory.fit import estimate, with_setting
from dflash.memory.parts import Calibration, choose_recompute, role_need_bytes, role_parts, with_recompute, workload
from dflash.memory.shape import GiB, TargetShape, drafter_params, drafter_state_bytes, load_target_shape
from preflight.estimate import EstimateError, nvml_gpu_bytes, parse_size, run_estimate
from preflight.nvml import FakeGpuInfo

REPO = Path(__file__).resolve().parent.parent
CFG_27B = REPO / "configs/qwen3-27b-5t3d.toml"
CFG_8B = REPO / "configs/qwen3-8b-1gpu.toml"

TINY_TARGET = {
    "model_type": "qwen3", "num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
    "tie_word_embeddings": False,
}


def part(parts, prefix: str) -> int:
    return next(p.bytes for p in parts if p.component.startswith(prefix))


# Hand-computed cases use round constants (unit activation scales, CUDA contexts 0.5 / 0.7 GiB),
# so the formulas stay checkable by hand whatever the fitted defaults are.
HAND = Calibration(cuda_context_gib={12: 0.5, 13: 0.7}, target_activation_scale=1.0, drafter_activation_scale=1.0)


@pytest.fixture
def tiny(tmp_path):
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_TARGET))
    return config_from_dict({
        "target": {"path": str(folder), "dtype": "bfloat16", "random_init": True},
        "drafter": {"num_layers": 1, "block_size": 4},
        "data": {"token_budget": 64, "max_batch_size": 2},
        "train": {"max_anchors": 4, "loss_chunk": 16, "kl_weight": 0.0},
        "topology": {"target_gpus": ["0"], "drafter_gpus": ["1"]},
    })


# ---------------------------------------------------------------- hand-computed cases


def test_qwen3_8b_weight_bytes_are_exact_param_count_times_two():
    shape = load_target_shape("configs/targets/qwen3-8b")
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128
    params = 36 * per_layer + 2 * 151936 * 4096 + 4096  # untied embedding + lm_head, final norm
    assert params == shape.params == 8_190_735_360
    cfg = load_config(CFG_8B)
    assert part(role_parts(cfg, shape, "colocated", "12.8"), "target weights") == 2 * params


def test_fp8_target_weights_are_e4m3_plus_row_scales_of_the_large_linears():
    """target.precision = "fp8": Qwen3-8B's 36 x 7 decoder linears (every one has in and out >= 1,024) in one byte a
    weight plus a float32 scale per output channel, embedding, lm_head and norms in bf16; the 27B-class hybrid's
    weights drop by about 21 GiB and its two 48-wide Gated DeltaNet projections (b, a) per layer stay in bf16."""
    shape = load_target_shape("configs/targets/qwen3-8b")
    linear = 36 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288)
    rows = 36 * (4096 + 2 * 1024 + 4096 + 2 * 12288 + 4096)
    assert shape.fp8_linears(1024) == (linear, rows, 12288)
    cfg = load_config(CFG_8B)
    fp8 = config_from_dict(cfg.model_dump(mode="json"), {"target.precision": "fp8"})
    assert part(role_parts(fp8, shape, "colocated", "12.8"), "target weights") == (
        linear + 4 * rows + 2 * (shape.params - linear))
    q36 = load_target_shape("configs/targets/qwen3.6-27b")
    b_a = 2 * q36.linear_layers * q36.hidden * q36.linear_value_heads
    assert sum(a * b * c for a, b, c in q36.linears()) - q36.fp8_linears(1024)[0] == b_a
    cfg = load_config(REPO / "configs/qwen3.6-27b-8gpu.toml")
    before = part(role_parts(cfg, q36, "colocated", "12.8"), "target weights")
    fp8 = config_from_dict(cfg.model_dump(mode="json"), {"target.precision": "fp8"})
    after = part(role_parts(fp8, q36, "colocated", "12.8"), "target weights")
    assert 20 * GiB < before - after < 22 * GiB, (before - after) / GiB


def test_qwen3_06b_ties_embeddings():
    shape = load_target_shape("configs/targets/qwen3-0.6b")
    per_layer = 2 * 1024 * 2048 + 2 * 1024 * 1024 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128
    assert shape.tied
    assert shape.params == 28 * per_layer + 151936 * 1024 + 1024 == 596_049_920


def test_drafter_states_are_fp32_adamw_over_exact_params():
    cfg = load_config(CFG_8B)
    shape = load_target_shape(cfg.target.path)
    p = 5 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096 + 256) + 5 * 4096 * 4096 + 2 * 4096
    assert drafter_params(cfg, shape) == p
    parts = role_parts(cfg, shape, "colocated", "12.8")
    assert part(parts, "AdamW") == 8 * p
    assert part(parts, "bf16 autocast") == 2 * p
    # set_to_none grads appear while backward frees the activations: here they never add to the peak
    assert part(parts, "drafter grads") == 0
    assert part(parts, "drafter params") == 4 * p


def test_the_qwen36_drafter_is_sized_by_its_own_fields_not_the_target():
    """The public Qwen3.6-27B recipe: 5 layers of 32 x 128 heads (8 kv), MLP 17408, on hidden 5120 (~1.73 B params)."""
    cfg = load_config(REPO / "configs/qwen3.6-27b-5t3d.toml")
    shape = load_target_shape(cfg.target.path)
    assert (shape.heads, shape.head_dim, shape.hidden) == (24, 256, 5120)
    h = 5120
    layer = 2 * h * 32 * 128 + 2 * h * 8 * 128 + 3 * h * 17408 + 2 * h + 2 * 128
    assert drafter_params(cfg, shape) == 5 * layer + 5 * h * h + 2 * h == 1_730_213_120
    # One flex BlockMask per layer type: the sliding layers' mask doubles the (small) mask part.
    full = config_from_dict({**cfg.model_dump(), "drafter": {**cfg.drafter.model_dump(), "layer_types": [],
                                                              "sliding_window": None}})
    masks = [part(role_parts(c, shape, "drafter", "12.8"), "flex block mask") for c in (cfg, full)]
    assert masks[1] > 0 and abs(masks[0] - 2 * masks[1]) <= 1  # parts are scaled by a fitted float, then rounded


def test_several_drafter_ranks_hold_ddp_gradient_buckets_one_does_not(tiny):
    """One drafter rank trains without DDP (grads fit in the freed activations); several hold DDP's fp32 gradient
    buckets for the whole run (the grads are views of them). On 2x H200, a single drafter rank wrapped in DDP
    (before) allocated 69.6 GiB where the same role alone allocates 63.3-64.4 (the public Qwen3.6-27B recipe)."""
    shape = load_target_shape(tiny.target.path)
    three = config_from_dict({**tiny.model_dump(), "topology": {"target_gpus": ["0"], "drafter_gpus": ["1", "2", "3"]}})
    one_parts, three_parts = (role_parts(c, shape, "drafter", "12.8", HAND) for c in (tiny, three))
    p = drafter_params(tiny, shape)
    assert part(three_parts, "DDP gradient buckets") == 4 * p
    assert not any(x.component.startswith("DDP") for x in one_parts)
    assert not any(x.component.startswith("drafter grads") for x in three_parts)
    total = lambda parts: sum(x.bytes for x in parts)  # noqa: E731
    assert total(three_parts) > total(one_parts)


def test_a_split_drafter_holds_the_received_features_of_its_steps_batches(tiny):
    """Receives are posted for a step's train.grad_accum batches once the previous step is done: that many exist."""
    shape = load_target_shape(tiny.target.path)
    three = config_from_dict({**tiny.model_dump(), "train": {**tiny.train.model_dump(), "grad_accum": 3}})
    one_b, three_b = (part(role_parts(c, shape, "drafter", "12.8", HAND), "received features") for c in (tiny, three))
    assert one_b == 64 * 1 * 64 * 2 and three_b == 3 * one_b


def test_each_batch_in_flight_adds_one_batch_of_features(tiny):
    """A target rank holds topology.queue_depth sends in flight beside the batch it computes; a drafter rank the
    receives of its step's grad_accum batches. One more in flight: exactly one batch's features more (bf16, 64 tokens
    x 1 layer x hidden 64), as a named part; the target's total grows by it plus its fragmentation margin."""
    shape = load_target_shape(tiny.target.path)
    one = 64 * 1 * 64 * 2

    def with_field(section: str, key: str, value: int):
        raw = tiny.model_dump()
        raw[section][key] = value
        return config_from_dict(raw)

    for depth in (1, 2, 3):
        parts = role_parts(with_field("topology", "queue_depth", depth), shape, "target", "12.8", HAND)
        assert part(parts, f"send buffers in flight ({depth} batch") == depth * one
        assert part(parts, "selected hidden states") == one  # the batch being computed, beside them
        grown = (role_need_bytes(with_field("topology", "queue_depth", depth + 1), "target", "12.8", HAND)
                 - role_need_bytes(with_field("topology", "queue_depth", depth), "target", "12.8", HAND))
        assert abs(grown - 1.05 * one) <= 1, grown
    for accum in (1, 2, 3):
        parts = role_parts(with_field("train", "grad_accum", accum), shape, "drafter", "12.8", HAND)
        assert part(parts, f"received features in flight ({accum} batch") == accum * one


def test_default_target_layers():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(28, 1) == [14]
    assert default_target_layer_ids(64, 5)[0] == 1 and default_target_layer_ids(64, 5)[-1] == 61


def test_workload_worst_case_is_many_short_sequences():
    cfg = load_config(CFG_27B, {"data.packing": False})  # padded batches: the preset packs (one row, no padding)
    cfg.train.batch_anchors = None  # uncapped here; the cap has its own test
    w = workload(cfg)
    # rows of S padded tokens hold at most S - 1 anchors: 48 x 1023 beats 64 x 767 and 47 x 1024
    assert (w.sequences, w.seq_len, w.anchors_per_seq) == (48, 1024, 1023)
    assert w.queries == 48 * 1023 * 32 > 64 * 767 * 32 and w.kv_tokens == 48 * 1024 + w.queries
    long_rows = workload(with_setting(cfg, "max_anchors", 256))
    assert (long_rows.sequences, long_rows.anchors_per_seq, long_rows.queries) == (64, 256, 64 * 256 * 32)
    # sequences shorter than a block are ignored: at most token_budget // block_size of them
    small = with_setting(with_setting(cfg, "token_budget", 256), "max_anchors", 4)
    assert (workload(small).sequences, workload(small).queries) == (256 // 32, 8 * 4 * 32)
    # one long row beats many short ones when anchors are plentiful: 1 x 255 > 8 x 31
    assert workload(with_setting(cfg, "token_budget", 256)).queries == 255 * 32


def test_a_packed_workload_is_one_row_of_the_budget_with_the_batch_s_anchors():
    cfg = load_config(CFG_27B)
    cfg.data.packing, cfg.data.pack_remainders = True, False
    w = workload(cfg)  # batch_anchors 1024: the row's anchors, none of them padding
    assert (w.sequences, w.seq_len, w.anchors_per_seq, w.valid_anchors) == (1, 49152, 1024, 1024)
    assert (w.queries, w.loss_tokens, w.kv_tokens) == (1024 * 32, 1024 * 31, 49152 + 1024 * 32)
    cfg.train.batch_anchors = None  # max_anchors for each of up to max_batch_size sequences, at most one per token
    assert workload(cfg).valid_anchors == 49151
    assert workload(with_setting(cfg, "max_anchors", 16)).valid_anchors == 16 * 64


def test_tiny_totals_by_hand(tiny):
    ctx, nccl = int(0.5 * GiB), int(0.25 * GiB)
    # T=64 tokens, B=min(2, 64//4)=2 sequences of 32, Q=2*4*4=32 queries, KV=64+32=96, 1 feature layer
    layer_p = (64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 16) + 3 * 64 * 128 + 2 * 64
    target_p = 4 * layer_p + 2 * 1000 * 64 + 64
    weights = 2 * target_p
    # busiest layer - the deepest layer's own output (target_step passes no padding mask)
    forward = 64 * (2 * (2 * 64 + max(3 * 64 + 3 * 32, 3 * 128) + 2 * 16) + 4 * 4) - 64 * 64 * 2
    inputs = 64 * 24
    feats = 64 * 1 * 64 * 2
    alloc = weights + forward + inputs + feats + 2 * feats  # + send buffers of topology.queue_depth (2) batches in flight
    assert role_need_bytes(tiny, "target", "12.8", cal=HAND) == alloc + int(0.05 * alloc) + ctx + nccl

    p = layer_p + 64 * 64 + 2 * 64
    static = 12 * p + 2 * (2 * 1000 * 64)  # fp32 params + AdamW; bf16 embedding + lm_head
    received = feats  # split: the step's grad_accum (1) batches; nothing received ahead
    context = (8 + 2) * 64 * 64 + 4 * 64  # hidden norm saves fp32 input + normalised, bf16 out
    tokens = 32 * (40 + 2 * 64) + 2 * 2 * 16 * (2 * 32 + 2 * 64)  # ids/labels/weights, embeddings, RoPE cos+sin
    # compiled layers (train.compile): 3 hidden, 3 q-width, 2 intermediate, 3 kv-width bf16 tensors saved
    layer = 32 * (2 * (3 * 64 + 3 * 64 + 2 * 128) + 4 * (4 + 4 + 2)) + 96 * (2 * 3 * 32 + 4 * 2)
    final = (8 + 2) * 32 * 64 + 4 * 32
    attn_ws = 2 * (32 * 64 + 2 * 96 * 32) + 4 * 32 * 4
    mask = 2 * 4 * (4 * 1 * 1 + 2 + 2)
    m = 8 * 3  # 8 valid anchors x 3 weighted slots
    chunk = 16 * 1000 * 2  # one bf16 [chunk, vocab] logits buffer (the fused kernel writes the gradient over it)
    loss = 2 * 2 * m * 64 + chunk  # + the selected hidden states and their gradient
    # backward transient (half a layer's activation gradients + flex workspace) after the chunks
    beyond = max(0, int(0.5 * layer) + attn_ws - chunk)
    step = context + tokens + layer + final + mask + loss + beyond
    copies, grads = 2 * p, max(0, 4 * p - 2 * p - step)
    alloc = static + received + copies + grads + step
    assert role_need_bytes(tiny, "drafter", "12.8", cal=HAND) == alloc + int(0.05 * alloc) + ctx + nccl


def test_soft_labels_add_last_hidden_state_and_kl_buffers(tiny):
    kl = tiny.model_copy(deep=True)
    kl.train.kl_weight = 0.5
    extra_target = role_need_bytes(kl, "target", "12.8", cal=HAND) - role_need_bytes(tiny, "target", "12.8", cal=HAND)
    extra_drafter = (role_need_bytes(kl, "drafter", "12.8", cal=HAND)
                     - role_need_bytes(tiny, "drafter", "12.8", cal=HAND))
    last = 64 * 64 * 2
    # kept + send buffers (topology.queue_depth = 2); the forward now runs every layer with the deepest feature alive
    assert extra_target == pytest.approx(1.05 * 4 * last, abs=2)
    # received (1 batch), target hidden per query and per weighted query, and the target's bf16 [chunk, vocab]
    # logits: the peak holds the larger of the loss chunk and the backward transient (47616 bytes here, see above)
    chunk, chunk_kl, backward = 16 * 1000 * 2, 2 * 16 * 1000 * 2, 30720 + 16896
    assert extra_drafter == pytest.approx(1.05 * (last + 2 * (32 + 24) * 64 + max(chunk_kl, backward) - max(chunk, backward)),
                                          abs=2)


def test_acceptance_slot_weights_add_their_fp32_row_vectors(tiny):
    """train.slot_weights cap/dpace/auf keep per-row CE, factors, weights and a scale ([M] fp32 each; a fifth, the
    per-row KL, with soft labels): 4 x 4 bytes per lm_head row, in the loss inputs part."""
    rows = workload(tiny).loss_tokens
    for kl in (0.0, 0.5):
        base = tiny.model_copy(deep=True)
        base.train.kl_weight = kl
        cap = base.model_copy(deep=True)
        cap.train.slot_weights = "cap"
        extra = role_need_bytes(cap, "drafter", "12.8", cal=HAND) - role_need_bytes(base, "drafter", "12.8", cal=HAND)
        assert extra == pytest.approx(1.05 * 4 * rows * (5 if kl else 4), abs=2)


def test_cuda13_costs_its_calibrated_context_more(tiny):
    diff = role_need_bytes(tiny, "drafter", "13.0", cal=HAND) - role_need_bytes(tiny, "drafter", "12.8", cal=HAND)
    assert diff == int(0.7 * GiB) - int(0.5 * GiB)
    with pytest.raises(ValueError, match="CUDA 11.8"):
        role_need_bytes(tiny, "drafter", "11.8", cal=HAND)


def test_role_must_match_topology(tiny):
    with pytest.raises(ValueError, match="colocated"):
        role_need_bytes(tiny, "colocated", "12.8")
    with pytest.raises(ValueError, match="co-located"):
        role_need_bytes(load_config(CFG_8B), "drafter", "12.8")


def test_missing_target_config_is_a_config_error(tmp_path):
    cfg = config_from_dict({"target": {"path": str(tmp_path / "absent")}})
    with pytest.raises(ConfigError, match="config.json: not found"):
        role_need_bytes(cfg, "colocated", "12.8")


def test_colocated_shares_frozen_weights_and_overlaps_working_sets():
    cfg = load_config(CFG_8B)
    shape = load_target_shape(cfg.target.path)
    names = [p.component for p in role_parts(cfg, shape, "colocated", "12.8")]
    assert not any(n.startswith("frozen") for n in names)
    assert not any(n.startswith("NCCL") for n in names)


# ---------------------------------------------------------------- monotonicity


@pytest.mark.parametrize("setting, values", [
    ("max_anchors", [64, 256, 512, 1024]),
    ("token_budget", [1024, 3072, 8192, 49152]),
    ("max_batch_size", [1, 2, 8, 64]),
])
def test_more_work_needs_more_bytes(setting, values):
    cfg = with_setting(load_config(CFG_8B), "max_batch_size", 4)
    needs = [role_need_bytes(with_setting(cfg, setting, v), "colocated", "12.8") for v in values]
    assert needs == sorted(needs) and needs[0] < needs[-1]


def test_target_role_ignores_anchors():
    # padded batches: max_anchors bounds each row's anchors
    cfg = load_config(CFG_27B, {"data.packing": False})
    a = role_need_bytes(with_setting(cfg, "max_anchors", 16), "target", "12.8")
    assert a == role_need_bytes(cfg, "target", "12.8")
    fewer_anchors = with_setting(cfg, "max_anchors", 16)
    assert role_need_bytes(fewer_anchors, "drafter", "12.8") < role_need_bytes(cfg, "drafter", "12.8")
    # the preset as shipped packs: its row's anchors are batch_anchors
    packed = load_config(CFG_27B)
    assert packed.data.packing
    fewer_anchors = with_setting(packed, "batch_anchors", 512)
    assert role_need_bytes(fewer_anchors, "target", "12.8") == role_need_bytes(packed, "target", "12.8")
    assert role_need_bytes(fewer_anchors, "drafter", "12.8") < role_need_bytes(packed, "drafter", "12.8")


# ---------------------------------------------------------------- limits


@pytest.mark.parametrize("path, gpu", [(CFG_8B, 50 * GiB), (CFG_27B, 95 * GiB)])
def test_reported_limits_fit_and_one_more_does_not(path, gpu):
    cfg = with_recompute(load_config(path), "off")  # limits are searched with the recompute mode fixed
    est = estimate(cfg, "12.8", gpu)
    checked = 0
    for lim in est.limits:
        if lim.status != "fits":
            continue
        at = role_need_bytes(with_setting(cfg, lim.setting, lim.value), lim.role, "12.8")
        above = role_need_bytes(with_setting(cfg, lim.setting, lim.value + 1), lim.role, "12.8")
        keep = int(cfg.train.memory_headroom_gib * GiB)  # a fit leaves the run's headroom free
        assert keep == 3 * GiB and at + keep <= gpu < above + keep, lim
        checked += 1
    assert checked >= 2


def test_limits_say_when_even_the_minimum_does_not_fit():
    est = estimate(with_recompute(load_config(CFG_27B), "off"), "12.8", 80 * GiB)
    lim = {(x.role, x.setting): x for x in est.limits}
    assert lim["drafter", "max_batch_size"].status == "none_fit"
    assert "even max_batch_size = 1 does not fit" in lim["drafter", "max_batch_size"].note
    assert lim["drafter", "token_budget"].status == "fits" and lim["drafter", "token_budget"].value < 49152
    assert lim["target", "max_anchors"].status == "no_effect"
    assert lim["target", "token_budget"].status == "fits"


def test_batch_size_limit_is_capped_by_token_budget():
    est = estimate(with_setting(load_config(CFG_8B), "max_anchors", 16), "12.8", 139 * GiB)
    lim = next(x for x in est.limits if x.setting == "max_batch_size")
    assert lim.status == "unbounded" and lim.value == 3072 // 16
    anchors = next(x for x in estimate(load_config(CFG_8B), "12.8", 139 * GiB).limits if x.setting == "max_anchors")
    assert anchors.status == "unbounded" and anchors.value == 3071  # a 3072-token row has 3071 eligible anchors


def test_estimate_rows_sum_to_total():
    est = estimate(load_config(CFG_27B), "12.8", 95 * GiB)
    assert [r.role for r in est.roles] == ["target", "drafter"]
    for r in est.roles:
        assert sum(row.bytes for row in r.rows) == r.total_bytes
        assert r.headroom_bytes == 95 * GiB - r.total_bytes


# ---------------------------------------------------------------- calibration fit


def test_fit_calibration_recovers_known_constants(tiny):
    truth = replace(Calibration(), cuda_context_gib={12: 0.62, 13: 0.7},
                    target_activation_scale=1.3, drafter_activation_scale=0.8)
    ms = []
    for anchors, budget in [(4, 64), (8, 128), (16, 256), (32, 512)]:
        cfg = with_setting(with_setting(tiny, "max_anchors", anchors), "token_budget", budget)
        shape = TargetShape.from_config(TINY_TARGET)
        for role in ("target", "drafter"):
            used = sum(p.bytes for p in role_parts(cfg, shape, role, "12.8", truth))
            ms.append({"config": cfg.model_dump(), "target_config": TINY_TARGET, "role": role,
                       "cuda": "12.8", "nvml_used_bytes": used, "alloc_conf": "expandable_segments:True"})
    fitted = fit_calibration(ms)
    assert fitted.cuda_context_gib[12] == pytest.approx(0.62, rel=1e-3)
    assert fitted.drafter_activation_scale == pytest.approx(0.8, rel=1e-3)
    assert fitted.target_activation_scale == pytest.approx(1.3, rel=1e-2)
    assert max(abs(e) for e in prediction_errors(ms, fitted)) < 1e-3


# ---------------------------------------------------------------- CLI


@pytest.mark.parametrize("text, expected", [
    ("95GiB", 95 * 2**30), ("80GB", 80 * 10**9), ("96000MiB", 96000 * 2**20), ("1.5 TiB", int(1.5 * 2**40)),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["95", "GiB", "-1GiB", "95 parsecs", "0GiB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_cli_27b_prints_both_roles_and_limits():
    exe = Path(sys.executable).parent / "dflash-estimate"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "dflash.commands.estimate"]
    res = subprocess.run([*cmd, "--config", "configs/qwen3-27b-5t3d.toml", "--gpu-memory", "80GiB",
                          "--set", "train.recompute=off"], cwd=REPO, capture_output=True, text=True, timeout=60)
    out = res.stdout
    assert res.returncode == 1, res.stderr  # the drafter does not fit without activation recompute
    assert "target (GPUs 0, 1, 2, 3, 4)" in out and "drafter (GPUs 5, 6, 7)" in out
    assert "DOES NOT FIT" in out
    assert "one packed row of 49152 tokens (data.packing" in out and "1024 anchors over the row (batch_anchors 1024" in out
    assert "largest settings that fit" in out and "max_anchors" in out
    assert "CUDA 12.8 (from envs/train-cu128.toml)" in out
    assert "send buffers in flight (2 batches, topology.queue_depth)" in out  # what is in flight, by name
    assert "received features in flight (1 batch, train.grad_accum)" in out


def estimate_cli(capsys, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the dflash-estimate entry point."""
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_cli_json_is_one_object_with_the_same_content(capsys):
    code, out, err = estimate_cli(capsys, "--config", str(CFG_8B), "--gpu-memory", "139GiB", "--json", "--cuda", "13.0")
    assert code == 0, err
    obj = json.loads(out)
    assert [r["role"] for r in obj["roles"]] == ["colocated"]
    assert obj["cuda"] == "13.0" and obj["gpu_bytes"] == 139 * GiB
    assert {x["setting"] for x in obj["limits"]} == {"token_budget", "max_batch_size", "max_anchors", "batch_anchors"}
    assert obj["workload"]["queries"] == 512 * 16


def test_cli_without_gpu_size_prints_totals_only(capsys):
    code, out, _ = estimate_cli(capsys, "--config", str(CFG_8B))
    assert code == 0
    assert "give --gpu-memory SIZE or --from-nvml" in out


@pytest.mark.parametrize("args, needle", [
    (["--config", "absent.toml"], "no such config file"),
    (["--config", str(CFG_8B), "--set", "target.path=nowhere/model"], "config.json: not found"),
    (["--config", str(CFG_8B), "--set", "target.dtype=int4"], "target.dtype"),
    (["--config", str(CFG_8B), "--set", "data.token_budget=-4096"], "data.token_budget"),
    (["--config", str(CFG_8B), "--gpu-memory", "95"], "unit"),
    (["--config", str(CFG_8B), "--gpu-memory", "95GiB", "--from-nvml"], "not both"),
    (["--config", str(CFG_8B), "--cuda", "11.8"], "CUDA 11.8"),
])
def test_cli_bad_input_is_one_line_and_exit_2(capsys, args, needle):
    code, out, err = estimate_cli(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("dflash-estimate: error: ") and needle in err
    assert "Traceback" not in err


def test_cli_refuses_a_target_that_needs_its_own_code_exit_2(capsys, tmp_path):
    """dflash-train refuses such a folder, and its sizes would be read as a standard decoder's: one line, exit 2."""
    target = tmp_path / "evil"
    target.mkdir()
    raw = json.loads((REPO / "configs/targets/qwen3-8b/config.json").read_text())
    (target / "config.json").write_text(json.dumps({**raw, "model_type": "evil_lm",
                                                    "auto_map": {"AutoModel": "modeling_evil.EvilModel"}}))
    code, out, err = estimate_cli(capsys, "--config", str(CFG_8B), "--set", f"target.path={target}")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"dflash-estimate: error: target {target}: custom code is refused: config.json model_type "
                          "'evil_lm' is not an architecture transformers ") and "(auto_map: modeling_evil.py)" in err


def test_cli_unreadable_toml_exit_2(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[data\ntoken_budget = ")
    code, _, err = estimate_cli(capsys, "--config", str(bad))
    assert code == 2 and "not valid TOML" in err


def test_batch_anchors_caps_loss_tokens_and_pads_rows_to_the_largest_kept_count():
    cfg = load_config(CFG_27B, {"data.packing": False})  # batch_anchors 1024, block 32; padded rows, not the packing
    w = workload(cfg)
    assert w.valid_anchors == 1024
    # 63 rows keep ~16 each; every row is padded to the largest kept count (3 sd above the mean)
    assert 1024 / w.sequences < w.anchors_per_seq < 2 * 1024 / w.sequences
    assert w.queries == w.sequences * w.anchors_per_seq * 32
    assert w.loss_tokens == w.sequences * w.anchors_per_seq * 31 > 1024 * 31  # padding anchors' rows go through too
    cfg.train.batch_anchors = None
    assert workload(cfg).queries > 10 * w.queries


# ---------------------------------------------------------------- one target-shape reader, torch-free


def test_memory_model_and_calibration_import_no_torch():
    code = ("import sys; import dflash.memory, dflash.memory.calibration, dflash.models.smollm2, dflash.commands.estimate; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_target_shape_reader_resolves_smollm2_and_paths_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # committed relative paths still resolve against the repository
    assert load_target_shape("configs/targets/qwen3-8b").params == 8_190_735_360
    small = load_target_shape("smollm2")  # the embedded default: known shapes, no package, no conversion
    assert (small.num_layers, small.hidden, small.vocab, small.tied) == (30, 576, 49152, True)
    with pytest.raises(ConfigError, match="nowhere/config.json: not found"):
        load_target_shape("nowhere")


def test_target_shape_of_a_multimodal_config_is_its_text_config():
    nested = {"model_type": "qwen3_5", "text_config": dict(TINY_TARGET), "vision_config": {"hidden_size": 8}}
    assert TargetShape.from_config(nested) == TargetShape.from_config(TINY_TARGET)


def test_drafter_state_is_fp32_weights_and_adamw():
    cfg = load_config(CFG_8B)
    shape = load_target_shape(cfg.target.path)
    assert drafter_state_bytes(cfg, shape) == 12 * drafter_params(cfg, shape)


# ---------------------------------------------------------------- estimate library


def test_nvml_gpu_bytes_resolves_names_as_preflight_does():
    recorded = json.loads((REPO / "tests/data/nvml_fake_8gpu.json").read_text())
    recorded["gpus"][6]["memory_total"] = 80 * GiB
    fake = FakeGpuInfo(recorded)
    assert nvml_gpu_bytes([], fake, cuda_visible_devices=None) == recorded["gpus"][0]["memory_total"]
    assert nvml_gpu_bytes(["0", "1"], fake, cuda_visible_devices="5,6") == 80 * GiB  # "1" is NVML GPU 6
    assert nvml_gpu_bytes([recorded["gpus"][6]["uuid"]], fake, cuda_visible_devices=None) == 80 * GiB
    with pytest.raises(EstimateError, match="GPU 2 is not visible"):
        nvml_gpu_bytes(["2"], fake, cuda_visible_devices="5,6")
    with pytest.raises(EstimateError, match="pass --gpu-memory SIZE"):
        nvml_gpu_bytes(["0"], FakeGpuInfo(None), cuda_visible_devices=None)


def test_run_estimate_takes_list_valued_overrides():
    est, source = run_estimate(str(CFG_8B), ['topology.target_gpus=["0"]', 'topology.drafter_gpus=["1"]'],
                               gpu_memory="139GiB", cuda="12.8")
    assert [r.role for r in est.roles] == ["target", "drafter"] and source == "--cuda"
    assert est.roles[1].gpus == ["1"]


def test_recompute_auto_picks_the_fastest_mode_that_fits():
    """auto trades speed for memory only as needed: the incident's drafter GPU (95 GiB) now fits with every activation kept."""
    cfg = load_config(REPO / "configs/qwen3.6-27b-5t3d.toml")
    need = {m: role_need_bytes(with_recompute(cfg, m), "drafter", "12.8") for m in ("off", "mlp", "layer")}
    assert need["off"] > need["mlp"] > need["layer"]
    assert choose_recompute(cfg, "drafter", "12.8", 139 * GiB)[0] == "off"
    assert choose_recompute(cfg, "drafter", "12.8", 95 * GiB)[0] == "off"  # compiled layers + fused loss: ~85 GiB
    assert choose_recompute(cfg, "drafter", "12.8", (need["off"] + need["mlp"]) // 2) == ("mlp", need["mlp"])
    assert choose_recompute(cfg, "drafter", "12.8", (need["layer"] + need["mlp"]) // 2)[0] == "layer"
    est = estimate(cfg, "12.8", 95 * GiB)
    assert "recompute auto -> off" in est.assumption and all(r.fits for r in est.roles)


def test_a_colocated_data_parallel_gpu_is_the_colocated_role_plus_ddp_buckets_and_nccl(tiny):
    """Each GPU of topology.colocated_gpus holds what one co-located GPU holds, plus DDP's fp32 gradient buckets
    (held through the target forward as well) and NCCL's buffers: exactly as a split run's several drafter GPUs."""
    shape = load_target_shape(tiny.target.path)
    one = config_from_dict({**tiny.model_dump(), "topology": {}})
    dp = config_from_dict({**tiny.model_dump(), "topology": {"colocated_gpus": ["0", "1"]}})
    one_parts, dp_parts = (role_parts(c, shape, "colocated", "12.8", HAND) for c in (one, dp))
    p = drafter_params(tiny, shape)
    assert part(dp_parts, "DDP gradient buckets") == 4 * p and part(dp_parts, "NCCL buffers") == GiB // 4
    assert not any(x.component.startswith(("DDP", "NCCL")) for x in one_parts)
    assert role_need_bytes(dp, "colocated", "12.8", HAND, shape) > role_need_bytes(one, "colocated", "12.8", HAND, shape)


def test_estimate_lists_each_layout_on_the_users_preset_as_its_own_model_numbers_say():
    """Qwen3.6-27B (configs/qwen3.6-27b-5t3d.toml): co-located data parallel over its 8 GPUs fits a 139 GiB H200 and
    not a 95 GiB RTX PRO 6000, even with whole-layer recompute; its per-GPU need is the co-located one plus DDP's
    buckets and NCCL; the split fits both."""
    cfg = load_config(REPO / "configs/qwen3.6-27b-5t3d.toml")
    shape = load_target_shape(cfg.target.path)
    for gib, dp_fits in ((139, True), (95, False)):
        layouts = {x.layout: x for x in estimate(cfg, "12.8", gib * GiB).layouts}
        assert [(x.layout, x.gpus) for x in layouts.values()] == [("colocated", 1), ("colocated-dp", 8),
                                                                   ("colocated-fsdp2", 8), ("split", 8)]
        dp = layouts["colocated-dp"]
        assert dp.fits is dp_fits and dp.fits == (dp.need_bytes["colocated"] <= gib * GiB)
        assert dp.recompute["colocated"] == ("off" if gib == 139 else "layer")
        p = drafter_params(cfg, shape)
        one = layouts["colocated"]
        assert one.recompute == dp.recompute
        extra = dp.need_bytes["colocated"] - one.need_bytes["colocated"]
        assert 4 * p + GiB // 4 <= extra <= 1.06 * (4 * p) + GiB // 4 + 1  # buckets (+ margin on them) and NCCL
        assert layouts["split"].fits is True and layouts["split"].description == "split: 5 target + 3 drafter GPUs"
    assert estimate(cfg, "12.8", None).layouts[1].fits is None


def test_cli_prints_which_layouts_fit(capsys):
    code, out, err = estimate_cli(capsys, "--config", str(REPO / "configs/qwen3.6-27b-5t3d.toml"), "--gpu-memory", "95GiB")
    assert code == 0, err  # the config's own split fits
    assert "layouts on GPUs of 95.00 GiB" in out
    assert "DOES NOT FIT co-located data parallel over 8 GPUs" in out
    assert "  fits         split: 5 target + 3 drafter GPUs: target" in out


def test_gpu_list_flags_replace_the_configs_layout(capsys):
    """--colocated-gpus on a split preset clears its target/drafter lists, --target-gpus/--drafter-gpus on a co-located
    one clear its colocated_gpus: the layout printed is the flags' alone (as in dflash-train)."""
    split = str(REPO / "configs/qwen3.6-27b-5t3d.toml")
    code, out, err = estimate_cli(capsys, "--config", split, "--gpu-memory", "95GiB", "--colocated-gpus", "0,1,2,3,4,5,6,7")
    assert code == 0 and err == "", err
    assert "\ncolocated (GPUs 0, 1, 2, 3, 4, 5, 6, 7: each a whole target + 1/8 of the drafter, FSDP2)\n" in out
    assert "\ntarget (GPUs" not in out and "\ndrafter (GPUs" not in out
    code, out, err = estimate_cli(capsys, "--config", str(REPO / "configs/qwen3.6-27b-8gpu.toml"), "--gpu-memory", "95GiB",
                                  "--target-gpus", "0,1,2,3,4,5", "--drafter-gpus", "6,7", "--set", "train.data_parallel=auto")
    assert code == 0, err
    assert "\ntarget (GPUs 0, 1, 2, 3, 4, 5)\n" in out and "\ndrafter (GPUs 6, 7)\n" in out and "\ncolocated" not in out
    code, out, err = estimate_cli(capsys, "--config", split, "--target-gpus", "0", "--drafter-gpus", "1,2")
    assert code == 0 and "\ntarget (GPUs 0)\n" in out and "\ndrafter (GPUs 1, 2)\n" in out, err
    code, _, err = estimate_cli(capsys, "--config", split, "--target-gpus", "0", "--colocated-gpus", "1,2")
    assert code == 2 and err == ("dflash-estimate: error: --colocated-gpus gives every GPU both roles, "
                                 "--target-gpus/--drafter-gpus split them: give one layout\n")


def test_pace_of_each_layout_from_busy_rates():
    """dflash.memory.pace: one GPU running both roles adds their times; the users' 27B job measured co-located on
    one H200 at 8.1K tok/s, the rule at the split run's busy rates (target 9.8K, drafter 41K) says 7.9K."""
    from dflash.memory.pace import colocated_tok_s

    assert colocated_tok_s(9_800, 41_000) == pytest.approx(7_909, abs=1)
    assert colocated_tok_s(0, 41_000) == 0.0
    cfg = load_config(REPO / "configs/qwen3.6-27b-5t3d.toml")
    pace = estimate(cfg, "12.8", 139 * GiB, rates=(9_800, 41_000)).pace
    assert [(p.layout, p.gpus, p.description, round(p.tok_per_s), p.fits) for p in pace] == [
        ("colocated", 1, "co-located", 7_909, True), ("colocated-dp", 8, "co-located data parallel, DDP", 63_276, True),
        ("colocated-fsdp2", 8, "co-located data parallel, FSDP2", 63_276, True),
        ("split", 8, "split 5 target + 3 drafter", 49_000, True),
        ("split", 8, "split 6 target + 2 drafter (the best split of 8 GPUs)", 58_800, True)]
    # No topology named (a 1 + 1 split of the config): the best split of the data-parallel count is still priced, and
    # judged for memory as its own layout (80 GB: co-located does not fit, 6 + 2 does).
    one_one = cfg.model_copy(update={"topology": cfg.topology.model_copy(update={"target_gpus": [], "drafter_gpus": []})})
    pace = {p.description: p for p in estimate(one_one, "12.8", 80 * GiB, rates=(12_500, 41_000)).pace}
    assert pace["co-located data parallel, DDP"].fits is False and pace["split 1 target + 1 drafter"].gpus == 2
    best = pace["split 6 target + 2 drafter (the best split of 8 GPUs)"]
    assert (best.gpus, round(best.tok_per_s), best.fits) == (8, 75_000, True)


def test_cli_says_which_layout_is_fastest_at_given_rates_and_refuses_bad_rates(capsys, tmp_path):
    config = str(REPO / "configs/qwen3.6-27b-5t3d.toml")
    code, out, err = estimate_cli(capsys, "--config", config, "--gpu-memory", "139GiB", "--rates", "9.8k,41k")
    assert code == 0, err
    # DDP and FSDP2 hide their communication alike: within the rates' noise, a tie
    assert ("fastest on 8 GPUs that fits: a tie within the rates' 5% noise: co-located data parallel, DDP, 63,276 tok/s; "
            "co-located data parallel, FSDP2, 63,276 tok/s (the same)\n") in out
    code, out, err = estimate_cli(capsys, "--config", config, "--gpu-memory", "95GiB", "--rates", "9800, 41000")
    # DDP is too big for 95 GiB: not chosen; FSDP2 fits and its communication hides under the drafter's steps
    # (at 95 GiB DDP needs layer recompute, priced as the extra forward work it does; FSDP2 packed runs at off)
    assert ("DOES NOT FIT co-located data parallel, DDP on 8 GPUs: 61,449 tok/s (recompute layer; drafter 35,525, link "
            "12.11 GB, 0.24 s a step)") in out
    assert "fastest on 8 GPUs that fits: co-located data parallel, FSDP2, 63,276 tok/s" in out
    for bad in ("abc", "1,2,3", "0,41000", "nan,5", "12.5k"):
        code, out, err = estimate_cli(capsys, "--config", config, "--rates", bad)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "--rates" in err, (bad, err)
    code, out, err = estimate_cli(capsys, "--config", config, "--rates-from", str(tmp_path))
    assert code == 2 and "no per-role rates in its metrics.jsonl" in err, err
    code, out, err = estimate_cli(capsys, "--config", config, "--rates", "1,2", "--rates-from", str(tmp_path))
    assert code == 2 and "not both" in err, err


# --------------------------------------------------------------------------- FSDP2 and the link between GPUs

USERS = REPO / "configs/qwen3.6-27b-5t3d.toml"  # the incident's run; its box: 8 GPUs of 95 GiB on PCIe Gen5


def users_dp(n: int = 8, data_parallel: str = "auto"):
    """The users' preset as co-located data parallel over n GPUs."""
    from dflash.memory.fit import with_topology
    from dflash.memory.parts import with_parallel

    cfg = with_topology(load_config(USERS), colocated=n)
    return with_parallel(cfg, data_parallel) if data_parallel != "auto" else cfg


def test_the_users_preset_co_located_over_8_gpus_of_95_gib_fits_with_fsdp2_not_ddp_and_auto_picks_fsdp2():
    from dflash.memory.parts import choose_parallel, with_parallel

    shape = load_target_shape(load_config(USERS).target.path)
    ddp, fsdp2 = users_dp(8, "ddp"), users_dp(8, "fsdp2")
    assert choose_recompute(ddp, "colocated", "12.8", 95 * GiB, shape=shape)[1] > 95 * GiB  # even with layer recompute
    mode, need = choose_recompute(fsdp2, "colocated", "12.8", 95 * GiB, shape=shape)
    # packed (the preset's data.packing), off predicts 91.39 GiB: it fits the card less the 3 GiB kept free
    assert mode == "off" and need == need_at(fsdp2, "off") and need + 3 * GiB <= 95 * GiB
    assert 90 * GiB < need_at(fsdp2, "off") <= 95 * GiB
    assert choose_parallel(users_dp(8), "colocated", "12.8", 95 * GiB, shape=shape) == ("fsdp2", "off", need)
    # on 93 GiB off fits the card, not the card less the 3 GiB kept free, so mlp
    mode, need93 = choose_recompute(fsdp2, "colocated", "12.8", 93 * GiB, shape=shape)
    assert mode == "mlp" and need93 + 3 * GiB <= 93 * GiB < need_at(fsdp2, "off") + 3 * GiB <= 95 * GiB
    assert choose_parallel(users_dp(8), "colocated", "12.8", 93 * GiB, shape=shape) == ("fsdp2", "mlp", need93)
    # where DDP fits (an H200's 139 GiB), auto keeps it, with the recompute rule as choose_recompute has it
    assert choose_parallel(users_dp(8), "colocated", "12.8", 139 * GiB, shape=shape) == (
        "ddp", *choose_recompute(ddp, "colocated", "12.8", 139 * GiB, shape=shape))
    # explicit settings are kept; when nothing fits the need returned is above the GPU (the caller refuses)
    assert choose_parallel(ddp, "colocated", "12.8", 95 * GiB, shape=shape)[:2] == ("ddp", "layer")
    dp, _, need = choose_parallel(users_dp(8), "colocated", "12.8", 70 * GiB, shape=shape)
    assert dp == "fsdp2" and need > 70 * GiB
    # a CPU run: auto is ddp, as the trainer reads it there
    cpu = with_parallel(users_dp(8), "auto").model_copy(update={"device": "cpu"})
    assert choose_parallel(cpu, "colocated", "12.8", 95 * GiB, shape=shape)[:2] == ("ddp", "off")
    layouts = {x.layout: x for x in estimate(load_config(USERS), "12.8", 95 * GiB).layouts}
    assert (layouts["colocated-dp"].fits, layouts["colocated-fsdp2"].fits) == (False, True)
    assert layouts["colocated-fsdp2"].need_bytes["colocated"] == need_at(fsdp2, "off")


def need_at(cfg, mode: str) -> int:
    return role_need_bytes(with_recompute(cfg, mode), "colocated", "12.8")


def test_fsdp2_shards_the_drafters_fp32_state_n_fold_and_drops_ddps_buckets_and_autocast_copies():
    """DDP: fp32 params + AdamW moments + buckets = 25.8 GiB on every GPU; FSDP2 over 8: params, grads and moments
    1/8 each, 3.2 GiB; the bf16 layers in flight and the root replace the autocast copies."""
    from dflash.memory.parts import drafter_layer_params, drafter_root_params

    shape = load_target_shape(load_config(USERS).target.path)
    p = drafter_params(users_dp(), shape)
    state = ("drafter params", "AdamW", "DDP gradient buckets", "drafter grads")
    ddp = role_parts(users_dp(8, "ddp"), shape, "colocated", "12.8")
    fsdp2 = role_parts(users_dp(8, "fsdp2"), shape, "colocated", "12.8")
    assert sum(x.bytes for x in ddp if x.component.startswith(state)) / GiB == pytest.approx(25.8, abs=0.05)
    sharded = sum(x.bytes for x in fsdp2 if x.component.startswith(state))
    assert sharded == 16 * -(-p // 8) and sharded / GiB == pytest.approx(3.22, abs=0.01)
    names = [x.component for x in fsdp2]
    assert not any(n.startswith(("DDP", "bf16 autocast")) for n in names)
    layer, root = drafter_layer_params(users_dp(), shape), drafter_root_params(users_dp(), shape)
    assert 5 * layer + root == p and root == 5 * 5120 * 5120 + 2 * 5120  # fc + two norms
    assert part(fsdp2, "FSDP2 all-gather buffers (bf16 params of 2 layers") == 2 * 2 * layer
    assert part(fsdp2, "FSDP2 root params gathered") == 2 * root
    # the reduce-scatter buffers (2 layers x (bf16 + fp32)) are backward-only: what the loss chunk left is theirs first
    assert 0 <= part(fsdp2, "FSDP2 reduce-scatter buffers") <= 2 * 6 * layer
    assert part(fsdp2, "NCCL buffers") == GiB // 4


def test_fsdp2_memory_depends_on_the_rank_count_and_a_one_rank_run_is_unchanged(tiny):
    from dflash.memory.parts import choose_parallel, parallel_mode, with_parallel

    shape = load_target_shape(tiny.target.path)
    needs = [role_need_bytes(users_dp(n, "fsdp2"), "colocated", "12.8") for n in (2, 4, 8)]
    assert needs[0] > needs[1] > needs[2]
    ddp = [role_need_bytes(users_dp(n, "ddp"), "colocated", "12.8") for n in (2, 8)]
    assert ddp[0] == ddp[1]  # a whole replica on every rank
    one = config_from_dict({**tiny.model_dump(), "topology": {}})
    assert parallel_mode(with_parallel(one, "fsdp2")) == "none"
    assert role_parts(with_parallel(one, "fsdp2"), shape, "colocated", "12.8", HAND) == role_parts(one, shape, "colocated", "12.8", HAND)
    assert choose_parallel(one, "colocated", "12.8", 139 * GiB, shape=shape)[0] == "none"
    # a split's drafter ranks always use ddp, whatever the field says (dflash.config refuses fsdp2 there)
    split = load_config(USERS)
    assert parallel_mode(with_parallel(split, "fsdp2")) == "ddp"
    assert choose_parallel(split, "drafter", "12.8", 95 * GiB)[:2] == ("ddp", "off")


def test_fsdp2_with_grad_accum_accumulates_sharded_grads():
    """The trainer reduce-scatters every batch of a step (dflash.train.parallel): with grad_accum > 1 a rank holds the
    same sharded fp32 grads as with one batch, never the unsharded ones."""
    from dflash.memory.fit import with_topology
    from dflash.memory.parts import with_parallel

    shape = load_target_shape(load_config(USERS).target.path)
    one, two = (with_parallel(with_topology(load_config(USERS, {"train.grad_accum": k}), colocated=8), "fsdp2")
                for k in (1, 2))
    grads = [p for p in role_parts(two, shape, "colocated", "12.8") if "grads" in p.component]
    assert [p.component for p in grads] == [p.component for p in role_parts(one, shape, "colocated", "12.8") if "grads" in p.component]
    assert all("unsharded" not in p.component for p in grads)


def test_link_pricing_exact_numbers():
    from dflash.memory import pace

    assert pace.PCIE5_X16_GBPS == pytest.approx(63.015, abs=1e-3) and pace.DEFAULT_LINK_GBPS == 50.0
    assert pace.ring_all_reduce_bytes(8, 800) == 1400 and pace.ring_all_reduce_bytes(1, 800) == 0
    assert pace.all_gather_bytes(4, 400) == 300
    assert pace.ddp_step_bytes(2, 10) == 40  # 2 x 1/2 x 4 bytes x 10 params
    assert pace.fsdp2_step_bytes(2, 10) == 2 * 10 + 20  # two bf16 all-gathers, one fp32 reduce-scatter
    assert pace.fsdp2_step_bytes(2, 10, batches=3) == 3 * 2 * 10 + 20  # all-gathers every batch, one reduction
    assert pace.link_seconds(5e9, 50) == 0.1
    # co-located: target 1 s, drafter 1 s a batch of 1000 tokens on each of 2 GPUs
    assert pace.colocated_dp_tok_s(2, 1000, 1000, 1000, 0.5e9, 1) == 1000  # 0.5 s of link hides under the drafter
    assert pace.colocated_dp_tok_s(2, 1000, 1000, 1000, 2e9, 1) == pytest.approx(2000 / 3)  # 1 s + 2 s
    # split: each side's per-batch time is the longer of its compute and its link time
    assert pace.split_link_tok_s(1, 1, 1000, 2000, 1000, 0.1e9, 1) == 1000  # links idle most of the time
    assert pace.split_link_tok_s(1, 1, 1000, 2000, 1000, 2e9, 1) == 500  # 2 s to send what takes 1 s to compute
    assert pace.split_link_tok_s(1, 2, 4000, 1000, 1000, 0.5e9, 1, drafter_step_bytes=1e9) == 2000 / 1.5
    # the users' preset: FSDP2 over 8 GPUs moves 12.11 GB a step, 0.24 s at 50 GB/s, under its 1.06 s drafter step
    cfg = load_config(USERS)
    shape = load_target_shape(cfg.target.path)
    p = drafter_params(cfg, shape)
    assert pace.fsdp2_step_bytes(8, p) == pace.ddp_step_bytes(8, p) == 7 * p  # 2 x 7/8 x 2p + 7/8 x 4p
    assert pace.colocated_dp_tok_s(8, 12_550, 46_300, 49_152, 7 * p, 50) == pytest.approx(
        8 * pace.colocated_tok_s(12_550, 46_300))


def test_split_sends_the_selected_hidden_states_and_the_last_one_per_batch():
    from dflash.memory.parts import sent_features_bytes

    cfg = load_config(USERS)
    shape = load_target_shape(cfg.target.path)
    assert sent_features_bytes(cfg, shape) == 16 + 49_152 * (5 + 1) * 5120 * 2  # stats, 5 layers + last, bf16
    no_kl = load_config(USERS, {"train.kl_weight": 0.0})
    assert sent_features_bytes(no_kl, shape) == 16 + 49_152 * 5 * 5120 * 2


def test_pace_on_a_slow_link_prices_each_layouts_communication():
    """At 5 GB/s FSDP2's 12.1 GB a step (2.4 s) outlasts the 1.06 s drafter step; a 6 + 2 split moves less."""
    est = estimate(load_config(USERS), "12.8", 95 * GiB, rates=(12_550, 46_300), link_gbps=5)
    pace = {p.layout + p.description: p for p in est.pace}
    fsdp2 = pace["colocated-fsdp2co-located data parallel, FSDP2"]
    assert fsdp2.link_bytes == pytest.approx(12.11e9, rel=1e-3) and fsdp2.link_s == pytest.approx(2.42, abs=0.01)
    assert fsdp2.tok_per_s == pytest.approx(8 * 49_152 / (49_152 / 12_550 + fsdp2.link_s))
    assert est.link_gbps == 5
    with pytest.raises(Exception, match="link bandwidth must be a positive"):
        estimate(load_config(USERS), "12.8", 95 * GiB, rates=(12_550, 46_300), link_gbps=0)


def test_cli_link_gbps_prints_the_fsdp2_rows_and_refuses_bad_values(capsys):
    config = str(USERS)
    code, out, err = estimate_cli(capsys, "--config", config, "--gpu-memory", "95GiB", "--rates", "12.55k,46.3k",
                                  "--link-gbps", "64")
    assert code == 0, err
    assert "link 64 GB/s one way per GPU; communication overlapped with the drafter's compute" in out
    assert ("  fits         co-located data parallel over 8 GPUs: each target + 1/8 of the drafter, FSDP2: "
            "colocated 91.39 GiB (recompute off)") in out
    assert ("  fits         co-located data parallel, FSDP2 on 8 GPUs: 78,989 tok/s (recompute off, link 12.11 GB, "
            "0.19 s a step)") in out
    assert "DDP's gradient all-reduce not counted" not in out
    for bad in ("0", "abc", "-5", "nan", "inf", ""):
        code, out, err = estimate_cli(capsys, "--config", config, "--link-gbps", bad)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "--link-gbps" in err, (bad, err)


def test_pace_prices_each_layouts_recompute_as_extra_forward_work(capsys):
    """Rates are measured at one recompute; a layout that must recompute more runs its drafter slower by the forward
    work it repeats (pace.recompute_cost), one that recomputes what the rates' run did is priced as measured."""
    from dflash.memory.pace import colocated_dp_tok_s, drafter_step_flops, recompute_cost

    cfg = load_config(USERS)
    shape = load_target_shape(cfg.target.path)
    off, mlp, layer = (drafter_step_flops(cfg, shape, m) for m in ("off", "mlp", "layer"))
    assert off < mlp < layer and recompute_cost(cfg, shape, "off") == 1.0
    assert recompute_cost(cfg, shape, "mlp", "layer") == pytest.approx(1 / recompute_cost(cfg, shape, "layer", "mlp"))
    wide = load_config(USERS, {"drafter.intermediate_size": 4 * 17408})  # a wider MLP costs more to recompute
    assert recompute_cost(wide, shape, "mlp") > recompute_cost(cfg, shape, "mlp")
    at_off = {p.description: p for p in estimate(cfg, "12.8", 93 * GiB, rates=(12_550, 46_300)).pace}
    fsdp2 = at_off["co-located data parallel, FSDP2"]  # packed: off fits 95 GiB with 3 kept free, 93 needs mlp
    assert fsdp2.recompute == "mlp" and fsdp2.drafter_tok_s == pytest.approx(46_300 / recompute_cost(cfg, shape, "mlp"))
    split = at_off["split 5 target + 3 drafter"]
    assert (split.recompute, split.drafter_tok_s) == ("off", 46_300)
    est = estimate(cfg, "12.8", 93 * GiB, rates=(12_550, 46_300), rates_recompute="mlp")  # measured with mlp on
    at_mlp = {p.description: p for p in est.pace}
    assert at_mlp["co-located data parallel, FSDP2"].tok_per_s == pytest.approx(colocated_dp_tok_s(
        8, 12_550, 46_300, 49_152, fsdp2.link_bytes, 50))
    assert at_mlp["split 5 target + 3 drafter"].drafter_tok_s > 46_300  # off does less than the rates' run did
    assert est.recompute_cost["mlp"] == 1.0 and est.recompute_cost["off"] < 1.0
    with pytest.raises(Exception, match="the rates' recompute must be off, mlp or layer"):
        estimate(cfg, "12.8", 95 * GiB, rates=(1, 2), rates_recompute="auto")
    code, out, err = estimate_cli(capsys, "--config", str(USERS), "--gpu-memory", "95GiB", "--rates", "12.55k,46.3k")
    assert code == 0, err
    assert ("  the drafter rate is taken as measured at recompute off; each layout's drafter is priced at the recompute "
            "it resolves to, as the extra forward work of the parts it recomputes (their matmul FLOPs at 0.74 of a "
            "drafter step's time per FLOP, as measured; against off: mlp x1.122, layer x1.154)") in out
    code, out, err = estimate_cli(capsys, "--config", str(USERS), "--rates", "1,2", "--rates-recompute", "auto")
    assert code == 2 and "--rates-recompute" in err


def test_rates_from_a_run_are_priced_at_the_recompute_its_snapshot_recorded(tmp_path):
    from dflash.runs.records import FORMAT, write_snapshot
    from preflight.estimate import run_recompute

    snap = {"format": FORMAT, "run": {}, "environment": {}, "config": {},
            "memory": {"cuda": "12.8", "roles": {"drafter": {"bytes": 1, "recompute": "mlp"}}}}
    write_snapshot(tmp_path / "run", snap)
    assert run_recompute(str(tmp_path / "run")) == "mlp"
    assert run_recompute(str(tmp_path / "none")) is None


def test_the_users_box_keeps_free_what_nvml_showed_the_model_misses():
    """The users' preset on 95 GiB cards, padded as the incident ran it (data.pack_remainders): 92.60 GiB predicted
    with recompute off left 2.40 GiB, and NVML read 2.99 GiB above the prediction on one H200 held to 95 GiB. Keeping
    train.memory_headroom_gib (3 GiB) free, auto chooses mlp recompute; with none kept it chooses off, as before.
    The preset as shipped packs (data.packing): 91.39 GiB with off, which keeps the 3 GiB free on 95 GiB."""
    path = REPO / "configs/qwen3.6-27b-8gpu.toml"
    padded = {"data.packing": False, "data.pack_remainders": True}
    kept = estimate(load_config(path, padded), "12.8", 95 * GiB)
    (role,) = kept.roles
    assert "recompute auto -> mlp" in kept.assumption, kept.assumption
    assert role.keep_bytes == 3 * GiB and role.headroom_bytes >= 3 * GiB and role.fits
    bare = estimate(load_config(path, {**padded, "train.memory_headroom_gib": 0.0}), "12.8", 95 * GiB)
    assert "recompute auto -> off" in bare.assumption and 0 <= bare.roles[0].headroom_bytes < 3 * GiB
    packed = estimate(load_config(path), "12.8", 95 * GiB)
    (role,) = packed.roles
    assert "one packed row" in packed.assumption and "recompute auto -> off" in packed.assumption, packed.assumption
    assert role.keep_bytes == 3 * GiB and 3 * GiB <= role.headroom_bytes < 4 * GiB and role.fits
    out = subprocess.run([sys.executable, "-m", "dflash.commands.estimate", "--config", str(path), "--gpu-memory",
                          "95GiB"], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert any(line.split() == ["kept", "free", "(train.memory_headroom_gib)", "3.00"] for line in out.splitlines())


# --------------------------------------------------------------------------- the estimate shows its decisions

USERS_BOX = REPO / "configs/qwen3.6-27b-8gpu.toml"  # co-located FSDP2 over the users' 8 GPUs of 95 GiB


def test_each_auto_choice_is_printed_with_the_numbers_that_made_it(capsys):
    code, out, _ = estimate_cli(capsys, "--config", str(USERS_BOX), "--gpu-memory", "95GiB")
    assert code == 0
    assert "\n  recompute auto -> off: off 91.39 + 3.00 kept free <= 95.00\n" in out, out
    code, out, _ = estimate_cli(capsys, "--config", str(USERS_BOX), "--gpu-memory", "93GiB")  # off fits, less 3 kept not
    assert code == 0
    assert ("\n  recompute auto -> mlp: off 91.39 + 3.00 kept free > 93.00 -> mlp 82.35 + 3.00 kept free <= 93.00\n"
            in out), out
    for gpu, recompute in (("95", "  recompute auto -> off (fsdp2): off 91.39 + 3.00 kept free <= 95.00"),
                           ("93", "  recompute auto -> mlp (fsdp2): off 91.39 + 3.00 kept free > 93.00 -> mlp 82.35 + "
                                  "3.00 kept free <= 93.00")):
        code, out, _ = estimate_cli(capsys, "--config", str(USERS), "--gpu-memory", f"{gpu}GiB",
                                    "--colocated-gpus", "0,1,2,3,4,5,6,7")  # data_parallel auto: DDP tried first
        decided = out.split(f"decisions on GPUs of {gpu}.00 GiB")[1].splitlines()[1:3]
        assert decided[0].startswith("  data_parallel auto -> fsdp2: ddp does not fit at any recompute (off ")
        assert decided[0].endswith(f" -> layer 97.91 + 3.00 kept free > {gpu}.00)"), decided
        assert decided[1] == recompute, decided


def test_batch_anchors_is_in_the_limits_table_and_moves_recompute(capsys):
    """The setting that binds on the users' box (packed): 1024 fits at off, 1536 at mlp, 2048 only at layer, 4096 not
    at all."""
    code, out, _ = estimate_cli(capsys, "--config", str(USERS_BOX), "--gpu-memory", "95GiB")
    row = next(line for line in out.splitlines() if line.startswith("  colocated batch_anchors"))
    assert row.split()[2:5] == ["1024", "2685", "configured"], row
    assert row.endswith("recompute auto: off up to 1,051, mlp up to 1,628, layer up to 2,685"), row
    assert "\n  recompute auto -> off: off 91.39 + 3.00 kept free <= 95.00\n" in out
    code, out, _ = estimate_cli(capsys, "--config", str(USERS_BOX), "--gpu-memory", "95GiB",
                                "--set", "train.batch_anchors=1536")
    assert code == 0 and ("\n  recompute auto -> mlp: off 102.73 + 3.00 kept free > 95.00 -> mlp 90.52 + 3.00 kept "
                          "free <= 95.00\n") in out
    code, out, _ = estimate_cli(capsys, "--config", str(USERS_BOX), "--gpu-memory", "95GiB",
                                "--set", "train.batch_anchors=2048")
    assert code == 0 and "\n  recompute auto -> layer: off 114.96 + 3.00 kept free > 95.00 -> mlp 98.69" in out
    code, out, _ = estimate_cli(capsys, "--config", str(USERS_BOX), "--gpu-memory", "95GiB",
                                "--set", "train.batch_anchors=4096")
    assert code == 1 and "the fastest mode that fits" not in out
    assert "recompute auto -> layer, data_parallel fsdp2 (nothing fits 95.00 GiB: the least memory shown)" in out
    assert " -> layer 106.22 + 3.00 kept free > 95.00: nothing fits 95.00 GiB; lower data.token_budget" in out
    code, out, _ = estimate_cli(capsys, "--config", str(CFG_8B), "--gpu-memory", "139GiB")  # batch_anchors unset
    row = next(line for line in out.splitlines() if line.startswith("  colocated batch_anchors"))
    assert row.split()[2] == "unset" and "every value fits" in row, row


def test_nothing_fits_is_said_as_such(capsys):
    code, out, _ = estimate_cli(capsys, "--config", str(USERS), "--gpu-memory", "10GiB")
    assert code == 1 and "fits 10.00 GiB" not in out.replace("nothing fits 10.00 GiB", "")
    assert "recompute auto -> layer (nothing fits 10.00 GiB: the least memory shown)" in out
    assert "\n  recompute auto: off 71.96 + 3.00 kept free > 10.00 -> mlp 61.79" in out


@pytest.mark.parametrize("size, header, warning", [
    ("95GiB", "GPU 95.00 GiB\n", ""),
    ("95GB", "GPU 88.48 GiB (--gpu-memory 95GB: decimal GB, 95 x 10^9 bytes)\n", ""),
    ("95gb", "GPU 88.48 GiB (--gpu-memory 95gb: decimal GB, 95 x 10^9 bytes)\n",
     "dflash-estimate: warning: --gpu-memory 95gb is read as decimal GB: 95 x 10^9 bytes = 88.48 GiB; if the GPU has "
     "95 GiB, write 95GiB\n"),
])
def test_a_decimal_gpu_size_is_named_and_a_lowercase_one_warned(capsys, size, header, warning):
    code, out, err = estimate_cli(capsys, "--config", str(USERS_BOX), "--gpu-memory", size)
    assert f"(from envs/train-cu128.toml); {header}" in out and err == warning


def test_pace_says_which_figures_rest_on_rates_of_another_recompute_and_calls_close_layouts_a_tie(capsys):
    code, out, _ = estimate_cli(capsys, "--config", str(USERS_BOX), "--gpu-memory", "95GiB", "--rates", "12.55k,46.3k")
    assert "the drafter rate is taken as measured at recompute off; each layout's drafter is priced" in out
    # packed, FSDP2 resolves recompute off: the rate's own mode, as measured; the single GPU recomputes layers
    assert ("  fits         co-located data parallel, FSDP2 on 8 GPUs: 78,989 tok/s (recompute off, link 12.11 GB, "
            "0.24 s a step)\n") in out
    assert "  fits         co-located on 1 GPU: 9,559 tok/s (recompute layer; drafter 40,117)\n" in out
    assert ("split 6 target + 2 drafter (the best split of 8 GPUs) on 8 GPUs: 75,300 tok/s (recompute off, link 9.94 GB, "
            "0.20 s a step)\n") in out
    assert ("fastest on 8 GPUs that fits: a tie within the rates' 5% noise: co-located data parallel, FSDP2, 78,989 "
            "tok/s; split 6 target + 2 drafter (the best split of 8 GPUs), 75,300 tok/s (4.7% slower)\n") in out
    code, out, _ = estimate_cli(capsys, "--config", str(USERS_BOX), "--gpu-memory", "95GiB", "--rates", "12.55k,46.3k",
                                "--rates-recompute", "layer")
    assert "measured at recompute layer; each layout's drafter is priced" in out and "off x0.866" in out
    assert "  fits         co-located on 1 GPU: 9,874 tok/s (recompute layer)\n" in out
    # a layout that recomputes less than the rate was measured at runs faster than the rate: priced so, and no tie
    assert ("FSDP2 on 8 GPUs: 81,305 tok/s (recompute off; drafter 53,436, link 12.11 GB, 0.24 s a step)\n") in out
    assert "fastest on 8 GPUs that fits: co-located data parallel, FSDP2, 81,305 tok/s\n" in out
    code, out, _ = estimate_cli(capsys, "--config", str(USERS_BOX), "--gpu-memory", "93GiB", "--rates", "12.55k,46.3k",
                                "--rates-recompute", "mlp")  # FSDP2 at mlp on 93 GiB: the rate's own mode
    assert "FSDP2 on 8 GPUs: 78,989 tok/s (recompute mlp, link 12.11 GB, 0.24 s a step)\n" in out
    assert "co-located on 1 GPU: 9,813 tok/s (recompute layer; drafter 44,995)\n" in out


def test_rates_from_a_run_dir_are_taken_at_the_recompute_its_gate_resolved(tmp_path):
    """--rates-from RUN: the drafter's recompute comes from the run's snapshot (memory roles), so the pace knows which
    layouts rest on a rate of another mode; a dir without a snapshot says nothing (off is then assumed)."""
    from preflight.estimate import run_recompute

    (tmp_path / "snapshot.json").write_text(json.dumps({
        "format": "dflash-snapshot/1", "run": {}, "environment": {}, "config": {},
        "memory": {"roles": {"target": {"bytes": 1, "recompute": "off"}, "drafter": {"bytes": 1, "recompute": "mlp"}}}}))
    assert run_recompute(str(tmp_path)) == "mlp"
    assert run_recompute(str(tmp_path / "nosuch")) is None
