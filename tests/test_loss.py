"""Anchors, labels, weights, the chunked loss against a plain reference, metrics, and a loss that falls."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash.config import config_from_dict
from dflash.models.drafter import DFlashDrafter, drafter_config_from_target
from dflash.train.loss import block_inputs, block_metrics, dflash_loss, read_metrics, sample_anchors, slot_weights, train_step_math


def test_sample_anchors_are_eligible_sorted_and_padded():
    mask = torch.zeros(3, 12, dtype=torch.int8)
    mask[0, 2:12] = 1  # eligible 2..10
    mask[1, 5:8] = 1  # eligible 5, 6
    mask[2, 4] = 1  # lone position: nothing eligible
    g = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(mask, 4, 4, g)
    assert anchors.shape == (3, 4)
    assert valid.tolist() == [[True] * 4, [True, True, False, False], [False] * 4]
    row0 = anchors[0].tolist()
    assert row0 == sorted(set(row0)) and all(2 <= a <= 10 for a in row0)
    assert anchors[1, :2].tolist() == [5, 6] and anchors[2].tolist() == [0] * 4
    again, _ = sample_anchors(mask, 4, 4, torch.Generator().manual_seed(0))
    assert torch.equal(anchors, again)
    many, valid_many = sample_anchors(mask, 100, 4, g)
    assert many.shape[1] == 9 and sorted(many[0].tolist()) == list(range(2, 11)) and valid_many[0].all()


def test_block_inputs_slots_labels_positions():
    ids = torch.arange(100, 110)[None]  # S = 10
    loss_mask = torch.ones(1, 10, dtype=torch.int8)
    loss_mask[0, 8] = 0
    anchors = torch.tensor([[1, 7]])
    valid = torch.tensor([[True, True]])
    block_ids, labels, label_valid, qpos = block_inputs(ids, anchors, 4, 99, loss_mask_BS=loss_mask, valid_BA=valid)
    assert block_ids.tolist() == [[101, 99, 99, 99, 107, 99, 99, 99]]
    assert labels[0, :4].tolist() == [101, 102, 103, 104] and labels[0, 4:6].tolist() == [107, 108]
    assert qpos.tolist() == [[1, 2, 3, 4, 7, 8, 9, 10]]
    # Slot at 8 is masked by loss_mask, slot at 10 is past the end.
    assert label_valid.tolist() == [[True] * 4 + [True, False, True, False]]


def test_slot_weights():
    w = slot_weights(5, 2.0)
    assert w[0] == 0 and w[1] == 1
    assert torch.allclose(w[2:], torch.tensor([math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)]))


def _reference_loss(hidden, head, labels, weight, target_hidden, kl_weight):
    logits = hidden @ head.T
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    total = weight.flatten().sum()
    loss = (weight.flatten() * ce).sum() / total
    if kl_weight > 0:
        t_logp = (target_hidden @ head.T).log_softmax(-1).flatten(0, 1)
        kl = (t_logp.exp() * (t_logp - logits.log_softmax(-1).flatten(0, 1))).sum(-1)
        loss = (1 - kl_weight) * loss + kl_weight * (weight.flatten() * kl).sum() / total
    return loss


@pytest.mark.parametrize("kl_weight", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("chunk", [1, 5, 16, 1000])
def test_chunked_loss_matches_reference(chunk, kl_weight):
    g = torch.Generator().manual_seed(1)
    B, A, bs, H, V = 2, 3, 4, 16, 50
    hidden = torch.randn(B, A * bs, H, generator=g, dtype=torch.float64)
    target_hidden = torch.randn(B, A * bs, H, generator=g, dtype=torch.float64)
    head = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    labels = torch.randint(0, V, (B, A * bs), generator=g)
    weight = slot_weights(bs, 3.0).double().repeat(A)[None].expand(B, -1).clone()
    weight[1, -bs:] = 0  # an invalid block
    h1, h2 = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    loss, metrics = dflash_loss(h1, head, labels, weight, bs, chunk, target_hidden, kl_weight)
    ref = _reference_loss(h2, head, labels, weight, target_hidden, kl_weight)
    loss.backward()
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-9, f"loss {loss.item()} vs reference {ref.item()}"
    diff = (h1.grad - h2.grad).abs().max().item()
    assert diff < 1e-9, f"grad max abs diff {diff:.3e}"
    assert h1.grad[:, ::bs].abs().max() == 0  # slot 0 carries no weight
    assert read_metrics([metrics])[0]["loss"] == pytest.approx(ref.item())


def test_loss_without_grad_and_with_no_weight():
    h = torch.randn(1, 8, 4)
    head = torch.randn(10, 4)
    labels = torch.zeros(1, 8, dtype=torch.long)
    loss, m = dflash_loss(h, head, labels, torch.zeros(1, 8), 4, 16)
    (m,) = read_metrics([m])
    assert loss.item() == 0 and m["blocks"] == 0 and m["accept_len"] == 0.0
    with pytest.raises(ValueError, match="frozen"):
        dflash_loss(h, head.requires_grad_(True), labels, torch.ones(1, 8), 4, 16)


def test_acceptance_length_by_hand():
    # Two blocks of 4 (slots 1..3 scored): block 0 right, right, wrong -> 1 + 2 = 3;
    # block 1 wrong, right, right -> 1 + 0 = 1; mean 2. Slot accuracy: 1/2, 1, 1/2.
    correct = torch.tensor([[False, True, True, False, True, False, True, True]])
    valid = torch.tensor([[False, True, True, True, False, True, True, True]])
    m = block_metrics(correct, valid, 4)
    assert m["accept_len"] == 2.0 and m["blocks"] == 2
    assert m["acc_slot"] == [0.5, 1.0, 0.5] and m["acc"] == pytest.approx(4 / 6)
    # An invalid slot stops the chain: block 0 with slot 2 invalid -> 1 + 1.
    valid[0, 2] = False
    assert block_metrics(correct, valid, 4)["accept_len"] == (2 + 1) / 2


def test_acceptance_length_from_logits():
    V, H = 6, 6
    head = torch.eye(V, H)
    labels = torch.tensor([[0, 1, 2, 3]])
    hidden = torch.nn.functional.one_hot(torch.tensor([[0, 1, 2, 5]]), V).float() * 5  # slot 3 predicts 5, not 3
    weight = slot_weights(4, 2.0)[None]
    _, m = dflash_loss(hidden, head, labels, weight, 4, 2)
    (m,) = read_metrics([m])
    assert m["accept_len"] == 3.0 and m["acc_slot"] == [1.0, 1.0, 0.0]


# With soft labels the floor is the target's own entropy, so the blended loss falls less far.
# The users' recipe (soft labels + cap, through the run config) trains too.
@pytest.mark.parametrize("kl_weight, ratio, weighting", [(0.0, 0.6, "gamma"), (0.5, 0.75, "gamma"), (0.5, 0.75, "cap")])
def test_loss_falls_over_30_steps(tiny_target, kl_weight, ratio, weighting):
    cfg = config_from_dict(
        {"drafter": {"num_layers": 1, "block_size": 4},
         "train": {"max_anchors": 8, "gamma": 4.0, "kl_weight": kl_weight, "loss_chunk": 16, "slot_weights": weighting}}
    )  # fmt: skip
    torch.manual_seed(0)
    dcfg = drafter_config_from_target(tiny_target.config, 1, 4, mask_token_id=255)
    drafter = DFlashDrafter(dcfg)
    start = torch.tensor([[3], [40]])
    input_ids = (start + 3 * torch.arange(24)) % 250  # arithmetic sequences: learnable
    loss_mask = torch.ones(2, 24, dtype=torch.int8)
    loss_mask[:, :6] = 0
    attention_mask = torch.ones(2, 24, dtype=torch.long)
    input_ids[1, 20:], loss_mask[1, 20:], attention_mask[1, 20:] = 0, 0, 0  # right padding
    batch = {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask}
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    losses = []
    for step in range(30):
        gen = torch.Generator().manual_seed(step)
        loss, metrics = train_step_math(drafter, tiny_target, batch, cfg, gen, "sdpa")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    (metrics,) = read_metrics([metrics])
    assert metrics["anchors"] == 16 and len(metrics["acc_slot"]) == 3
    gamma_cfg = cfg.model_copy(deep=True)
    gamma_cfg.train.slot_weights = "gamma"
    _, gamma_metrics = train_step_math(drafter, tiny_target, batch, gamma_cfg, torch.Generator().manual_seed(29), "sdpa")
    gamma_sum = read_metrics([gamma_metrics])[0]["weight_sum"]
    if weighting == "cap":  # every factor is below 1: the same anchors weigh less
        assert 0.1 * gamma_sum < metrics["weight_sum"] < gamma_sum
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < ratio * first, f"loss did not fall clearly: first {first:.3f}, last {last:.3f}"


def test_batch_anchor_cap_bounds_total_and_keeps_rows_sorted():
    from dflash.train.loss import sample_anchors

    mask = torch.ones(6, 40, dtype=torch.int8)
    mask[2, 20:] = 0
    gen = torch.Generator().manual_seed(3)
    anchors, valid = sample_anchors(mask, 16, 4, gen, batch_anchors=30)
    assert int(valid.sum()) == 30
    assert valid.sum(dim=1).tolist() == [5] * 6 and anchors.shape[1] == 5  # even quotas: no padded slots
    for row in range(6):
        got = anchors[row][valid[row]]
        assert torch.equal(got, got.sort().values) and got.unique().numel() == got.numel()
        assert bool(valid[row, : int(valid[row].sum())].all())  # valid anchors first
        assert int(valid[row].sum()) <= 16
    assert bool((anchors[2][valid[2]] < 19).all())
    uncapped, v2 = sample_anchors(mask, 16, 4, torch.Generator().manual_seed(3))
    assert int(v2.sum()) == 16 * 5 + 16


@pytest.mark.parametrize("batch_anchors", [None, 20])
def test_host_counts_from_collate_give_the_same_anchors(tmp_path, batch_anchors):
    """collate counts the eligible positions per row on the host; the anchors drawn with them equal the ones
    drawn after reading the counts back from the tensor (the step no longer waits for the GPU there)."""
    import numpy as np

    from dflash.data.batching import collate
    from dflash.data.shards import ShardDataset, write_shard
    from dflash.train.loss import sample_anchors

    rng = np.random.default_rng(0)
    lengths = [33, 7, 50, 2, 40]
    masks = [(rng.random(n) < 0.7).astype(int).tolist() for n in lengths]
    write_shard(tmp_path / "shard-0.arrow", [list(range(1, n + 1)) for n in lengths], masks)
    batch = collate(ShardDataset(tmp_path), range(len(lengths)), pad_id=0)
    lm = batch["loss_mask"].bool()
    assert batch["eligible_anchors"].tolist() == (lm[:, :-1] & lm[:, 1:]).sum(1).tolist()
    host = sample_anchors(batch["loss_mask"], 8, 4, torch.Generator().manual_seed(5), batch_anchors,
                          batch["eligible_anchors"])
    device = sample_anchors(batch["loss_mask"], 8, 4, torch.Generator().manual_seed(5), batch_anchors)
    assert all(torch.equal(a, b) for a, b in zip(host, device))


def test_anchor_quotas_fill_short_rows_first_and_meet_the_budget():
    from dflash.train.loss import anchor_quotas

    caps = torch.tensor([2, 100, 100, 7])
    assert anchor_quotas(caps, 50).tolist() == [2, 21, 20, 7]
    assert anchor_quotas(caps, 4).tolist() == [1, 1, 1, 1]
    assert anchor_quotas(caps, 209).tolist() == [2, 100, 100, 7]


def test_weight_0_rows_add_exactly_nothing_whatever_they_hold():
    """Rows go through the lm_head by shape: a padding block holding nan (and labels no vocabulary has) changes
    neither the loss nor the gradient of the real rows."""
    g = torch.Generator().manual_seed(4)
    B, A, bs, H, V = 1, 3, 4, 8, 20
    hidden = torch.randn(B, A * bs, H, generator=g, dtype=torch.float64)
    target = torch.randn(B, A * bs, H, generator=g, dtype=torch.float64)
    head = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, A * bs), generator=g)
    weight = slot_weights(bs, 3.0).double().repeat(A)[None].clone()
    weight[0, -bs:] = 0  # the last block is padding
    out = []
    for poison in (False, True):
        h, t, lab = hidden.clone(), target.clone(), labels.clone()
        if poison:
            h[0, -bs:], t[0, -bs:], lab[0, -bs:] = float("nan"), float("nan"), -100
        h.requires_grad_(True)
        loss, _ = dflash_loss(h, head, lab, weight, bs, 5, t, 0.5)
        loss.backward()
        out.append((loss.detach(), h.grad[0, : -bs]))
    assert torch.isfinite(out[1][0]) and torch.equal(out[0][0], out[1][0])
    assert torch.equal(out[0][1], out[1][1])


def _direct_slot_factors(ce, correct, valid, kind, a):
    """train.slot_weights' factors, slot by slot with plain loops over one block's scored slots (lists in, list out)."""
    K = len(ce)
    if kind == "gamma":
        return [1.0] * K
    if kind == "auf":  # 1 while every earlier valid slot is the drafter's top-1; the first wrong slot is kept
        out, alive = [], True
        for k in range(K):
            out.append(1.0 if alive else 0.0)
            if valid[k] and not correct[k]:
                alive = False
        return out
    prefix, p = [], 1.0
    for k in range(K):
        if valid[k]:
            p *= (1 - a) * math.exp(-ce[k]) + a
        prefix.append(p)
    if kind == "cap":
        return prefix
    return [sum(prefix[m] for m in range(k, K) if valid[m]) for k in range(K)]  # dpace


def _weighted_case(seed=5):
    g = torch.Generator().manual_seed(seed)
    B, A, bs, H, V = 2, 3, 5, 16, 12
    head = torch.randn(V, H, generator=g, dtype=torch.float64)
    hidden = torch.randn(B, A * bs, H, generator=g, dtype=torch.float64)
    target_hidden = torch.randn(B, A * bs, H, generator=g, dtype=torch.float64)
    labels = (hidden @ head.T).argmax(-1)  # every slot the drafter's top-1 ...
    labels[0, 3] = (labels[0, 3] + 1) % V  # ... but these: block 0 fails at slot 3, block 2 at slot 1
    labels[0, 11] = (labels[0, 11] + 1) % V
    labels[1, 7] = (labels[1, 7] + 3) % V
    weight = slot_weights(bs, 3.0).double().repeat(A)[None].expand(B, -1).clone()
    weight[1, -bs:] = 0  # a padding block
    weight[1, 2] = 0  # a slot off the loss mask inside a block
    return hidden, target_hidden, head, labels, weight, bs


def _direct_weighted_loss(hidden, target_hidden, head, labels, weight, bs, kind, a, kl_weight):
    """sum w*((1-kl) CE + kl KL) / sum w with w = gamma weight x the direct factors (detached), over slots 1..bs-1."""
    B, Q, _ = hidden.shape
    logits = hidden @ head.T
    logp = logits.log_softmax(-1)
    ce = -logp.gather(-1, labels[..., None])[..., 0]
    kl = (target_hidden @ head.T).log_softmax(-1)
    kl = (kl.exp() * (kl - logp)).sum(-1)
    correct = logits.argmax(-1) == labels
    w = torch.zeros(B, Q, dtype=torch.float64)
    for b in range(B):
        for j in range(Q // bs):
            s = slice(j * bs + 1, (j + 1) * bs)
            valid = (weight[b, s] > 0).tolist()
            f = _direct_slot_factors(ce[b, s].tolist(), correct[b, s].tolist(), valid, kind, a)
            w[b, s] = weight[b, s] * torch.tensor(f, dtype=torch.float64)
    per_token = (1 - kl_weight) * ce + kl_weight * kl
    return (w * per_token).sum() / w.sum(), w


@pytest.mark.parametrize("kind", ["cap", "dpace", "auf"])
@pytest.mark.parametrize("kl_weight, chunk", [(0.0, 3), (0.5, 1000)])
def test_slot_weightings_match_their_direct_formula(kind, kl_weight, chunk):
    """Each train.slot_weights option against its formula written slot by slot: loss, gradient (the weights are
    detached: no gradient flows through them) and the reported weight sum, on a block that fails mid-way, a padding
    block and a slot off the loss mask."""
    hidden, target_hidden, head, labels, weight, bs = _weighted_case()
    h1, h2 = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    loss, m = dflash_loss(h1, head, labels, weight, bs, chunk, target_hidden, kl_weight, slot_weighting=kind,
                          cap_alpha=0.3)
    ref, w_detached = _direct_weighted_loss(hidden, target_hidden, head, labels, weight, bs, kind, 0.3, kl_weight)
    assert abs(loss.item() - ref.item()) < 1e-12, f"{kind}: loss {loss.item()} vs direct {ref.item()}"
    # gradient of the direct loss with its weights held fixed
    logp = (h2 @ head.T).log_softmax(-1)
    ce = -logp.gather(-1, labels[..., None])[..., 0]
    t_logp = (target_hidden @ head.T).log_softmax(-1)
    kl = (t_logp.exp() * (t_logp - logp)).sum(-1)
    ((w_detached * ((1 - kl_weight) * ce + kl_weight * kl)).sum() / w_detached.sum()).backward()
    loss.backward()
    diff = (h1.grad - h2.grad).abs().max().item()
    assert diff < 1e-12, f"{kind}: grad max abs diff {diff:.3e}"
    (m,) = read_metrics([m])
    assert m["weight_sum"] == pytest.approx(w_detached.sum().item(), rel=1e-12)
    if kind == "auf":  # block 0 keeps slots 1..3 (slot 3 is its first failure), drops slot 4
        assert w_detached[0, 1:5].tolist() == pytest.approx([1.0, math.exp(-1 / 3), math.exp(-2 / 3), 0.0], rel=1e-6)
    assert w_detached[:, ::bs].abs().max() == 0 and h1.grad[:, ::bs].abs().max() == 0


def test_gamma_weighting_is_the_default_path_bit_for_bit():
    hidden, target_hidden, head, labels, weight, bs = _weighted_case()
    a, _ = dflash_loss(hidden, head, labels, weight, bs, 4, target_hidden, 0.5)
    b, _ = dflash_loss(hidden, head, labels, weight, bs, 4, target_hidden, 0.5, slot_weighting="gamma", cap_alpha=0.1)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="slot_weights 'cpa': use one of gamma, cap, dpace, auf"):
        dflash_loss(hidden, head, labels, weight, bs, 4, slot_weighting="cpa")


def test_cap_alpha_1_is_gamma_alone():
    hidden, target_hidden, head, labels, weight, bs = _weighted_case()
    a, _ = dflash_loss(hidden, head, labels, weight, bs, 4)
    b, _ = dflash_loss(hidden, head, labels, weight, bs, 4, slot_weighting="cap", cap_alpha=1.0)
    assert abs(a.item() - b.item()) < 1e-12
