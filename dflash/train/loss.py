"""Anchors, block inputs, slot weights, and the chunked DFlash loss with its metrics.

A step samples anchors among positions a with loss_mask[a] and loss_mask[a+1]; block j holds
the real token at anchor_j in slot 0 and the mask token elsewhere; slot k predicts
input_ids[anchor_j + k] with weight exp(-(k-1)/gamma) (slot 0: weight 0). train.slot_weights other
than "gamma" multiply that weight by a detached, acceptance-aware factor read from the drafter's
own per-slot CE and top-1 (`acceptance_weights`: CAP, D-PACE, Spec-AUF).

The loss never materialises [tokens, vocab] at once: `_ChunkedLMHeadLoss` walks the weighted
tokens chunk by chunk through the frozen lm_head and, when a gradient is needed, computes the
gradient w.r.t. the drafter hidden states in the same pass (the lm_head is frozen, so that is
the only gradient). Backward then only scales the stored gradient: no logits are kept or
recomputed, and peak memory is a few [chunk, vocab] float32 buffers.

`train_step_math` chains a whole step's math: target features -> anchors -> block inputs ->
embed -> mask -> drafter -> loss. Sequences are right-padded: context positions are 0..S-1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash.models.attention import Backend, build_layer_masks
from dflash.models.drafter import DFlashDrafter
from dflash.models.target import target_embed_and_head, target_features


def sample_anchors(
    loss_mask_BS: torch.Tensor,
    max_anchors: int,
    block_size: int,
    generator: torch.Generator | None = None,
    batch_anchors: int | None = None,
    eligible_B: torch.Tensor | None = None,
    starts_BS: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to max_anchors sorted anchors per row [B, A] and their validity [B, A] (padding anchors are 0, invalid).

    Eligible: a with loss_mask[a] and loss_mask[a+1] (so a + 1 is inside the sequence). Labels
    of a block that run past the sequence end are masked by `block_inputs`, so block_size does
    not restrict the anchors; it is checked for sanity only. With batch_anchors, the batch's
    total is split over rows as evenly as their eligible counts allow (`anchor_quotas`).
    eligible_B: those counts per row on the host (the collated batch's `eligible_anchors`); without
    them they are read back from the device, which waits for all the GPU's queued work.
    starts_BS: a packed row's sequence starts (True at each one's first position): a is eligible only when a + 1 is
    in a's sequence.
    """
    if max_anchors < 1:
        raise ValueError(f"max_anchors must be >= 1, got {max_anchors}")
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    mask_BS = loss_mask_BS.bool()
    B, S = mask_BS.shape
    device = mask_BS.device
    if S < 2:
        zeros = torch.zeros(B, 1, dtype=torch.long, device=device)
        return zeros, zeros.bool()
    eligible_BS = mask_BS[:, :-1] & mask_BS[:, 1:]
    if starts_BS is not None:
        eligible_BS = eligible_BS & ~starts_BS[:, 1:].bool()
    count_B = eligible_B.cpu() if eligible_B is not None else eligible_BS.sum(dim=1).cpu()
    cap_B = count_B.clamp(max=max_anchors)
    if batch_anchors is not None and int(cap_B.sum()) > batch_anchors:
        cap_B = anchor_quotas(cap_B, batch_anchors)
    A = max(1, int(cap_B.max()))
    gen_device = generator.device if generator is not None else device
    keys_BS = torch.rand(eligible_BS.shape, generator=generator, device=gen_device).to(device)
    keys_BS = keys_BS.masked_fill(~eligible_BS, 2.0)  # ineligible positions sort last
    picked_BA = keys_BS.topk(A, dim=1, largest=False).indices
    valid_BA = torch.arange(A)[None, :] < cap_B[:, None]
    valid_BA = valid_BA.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else valid_BA.to(device)
    picked_BA = torch.where(valid_BA, picked_BA, S).sort(dim=1).values  # the sorted valid ones come first
    return torch.where(valid_BA, picked_BA, 0), valid_BA


def anchor_quotas(cap_B: torch.Tensor, budget: int) -> torch.Tensor:
    """Split `budget` anchors over rows as evenly as their caps allow (water-filling).

    Even quotas keep the padded [B, A] anchor layout tight: A is about budget / B, not the
    largest of B random counts, so few padded queries go through the drafter.
    """
    caps = cap_B.tolist()
    lo, hi = 0, max(caps)
    while lo < hi:  # smallest level q with sum(min(cap, q)) >= budget
        mid = (lo + hi) // 2
        if sum(min(c, mid) for c in caps) >= budget:
            hi = mid
        else:
            lo = mid + 1
    quota = [min(c, lo - 1) for c in caps] if lo > 0 else [0] * len(caps)
    left = budget - sum(quota)
    for b, c in enumerate(caps):  # rows that can take one more, in order, until the budget is met
        if left == 0:
            break
        if c >= lo and quota[b] < c:
            quota[b] += 1
            left -= 1
    return torch.tensor(quota, dtype=cap_B.dtype, device=cap_B.device)


def block_inputs(
    input_ids_BS: torch.Tensor,
    anchors_BA: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    loss_mask_BS: torch.Tensor | None = None,
    valid_BA: torch.Tensor | None = None,
    end_BA: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block token ids, labels, label validity, positions in the row), each [B, A*block_size].

    Slot k of block j: label input_ids[anchor_j + k], valid inside the sequence (before end_BA, the end of the
    anchor's sequence in a packed row, if given), where the loss mask is 1 (if given) and the anchor is valid (if
    given); position anchor_j + k.
    """
    B, S = input_ids_BS.shape
    A = anchors_BA.shape[1]
    pos_BAk = anchors_BA[:, :, None] + torch.arange(block_size, device=anchors_BA.device)
    safe_BQ = pos_BAk.clamp(max=S - 1).reshape(B, A * block_size)
    labels_BQ = input_ids_BS.gather(1, safe_BQ)
    valid_BAk = pos_BAk < S if end_BA is None else pos_BAk < end_BA[:, :, None]
    if loss_mask_BS is not None:
        valid_BAk &= loss_mask_BS.bool().gather(1, safe_BQ).view(B, A, block_size)
    if valid_BA is not None:
        valid_BAk &= valid_BA.bool()[:, :, None]
    block_ids_BAk = torch.full_like(labels_BQ, mask_token_id).view(B, A, block_size)
    block_ids_BAk[:, :, 0] = labels_BQ.view(B, A, block_size)[:, :, 0]
    flat = lambda t: t.reshape(B, A * block_size)  # noqa: E731
    return flat(block_ids_BAk), labels_BQ, flat(valid_BAk), flat(pos_BAk)


def slot_weights(block_size: int, gamma: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """[block_size] float32: 0 for slot 0 (the given anchor token), exp(-(k-1)/gamma) for k >= 1 (made on `device`:
    no host-to-device copy, which would wait for the GPU's queued work)."""
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma) * (k > 0)  # no `w[0] = 0.0`: a host scalar copied in waits for the GPU


SLOT_WEIGHTINGS = ("gamma", "cap", "dpace", "auf")  # train.slot_weights; all but gamma: `acceptance_weights`


@torch.no_grad()
def acceptance_weights(ce_NK: torch.Tensor, correct_NK: torch.Tensor, valid_NK: torch.Tensor, kind: str,
                       a: float) -> torch.Tensor:
    """Detached per-slot factors [N, K] for N blocks' scored slots 1..K, from the drafter's own CE and top-1.

    q_j = exp(-CE_j), the drafter's probability of slot j's label; f_j = (1 - a) q_j + a.
    - "cap" (cumulative acceptance / confidence weighting; SpecForge's loss type
      dpace-cumulative-confidence-only): slot k weighs P_k = prod_{j<=k} f_j.
    - "dpace" (D-PACE, arXiv 2605.18810): slot k weighs sum_{m>=k} P_m, the suffix sum of those products.
    - "auf" (Spec-AUF, accept-until-fail, arXiv 2607.01893): slot k weighs 1 while every slot before it is
      the drafter's top-1, else 0; the first wrong slot is kept (inclusive: "the support through the first
      predicted failure"), every later one dropped.
    A slot that is not valid (past the sequence, off the loss mask, a padding anchor) is a no-op in the chain
    (f = 1, counted right) and adds nothing to a suffix sum; its own weight is 0 anyway (weights multiply
    the validity). The caller multiplies these factors into the gamma decay.
    """
    if kind == "auf":
        ok_NK = (correct_NK | ~valid_NK).to(ce_NK.dtype)
        return torch.cat([torch.ones_like(ok_NK[:, :1]), ok_NK[:, :-1].cumprod(dim=-1)], dim=-1)
    f_NK = torch.where(valid_NK, (1.0 - a) * torch.exp(-ce_NK) + a, 1.0)
    prefix_NK = f_NK.cumprod(dim=-1)
    if kind == "cap":
        return prefix_NK
    if kind == "dpace":
        return (prefix_NK * valid_NK).flip(-1).cumsum(dim=-1).flip(-1)
    raise ValueError(f"slot_weights {kind!r}: use one of {', '.join(SLOT_WEIGHTINGS)}")


class _ChunkedLMHeadLoss(torch.autograd.Function):
    """Sum over tokens of w * [(1-kl) * CE + kl * KL(target || drafter)], divided by `norm`.

    Returns (loss, ce_sum, kl_sum, correct_M, norm); only loss carries a gradient, to hidden_MH.
    weighting (kind, a, slots per block): w = weight_M x `acceptance_weights`, known only once every row's CE
    is; each row's gradient is formed with weight_M alone and scaled by the factor / norm after the pass
    (the gradient is linear in a detached weight), so it stays one pass; norm = sum w, computed here.
    """

    @staticmethod
    def forward(ctx, hidden_MH, head_VH, labels_M, weight_M, target_MH, kl_weight, chunk, norm, fused,
                weighting=None):
        want_grad = ctx.needs_input_grad[0]
        chunk_loss = _chunk_loss_fused if fused else _chunk_loss
        grad_MH = torch.empty_like(hidden_MH) if want_grad else None
        ce_sum = hidden_MH.new_zeros((), dtype=_math_dtype(head_VH))
        kl_sum = torch.zeros_like(ce_sum)
        correct_M = torch.zeros_like(labels_M, dtype=torch.bool)
        # with a weighting: per-row CE (and KL) kept for the factors ([M] floats, no [M, V])
        ce_M = torch.zeros_like(weight_M) if weighting else None
        kl_M = torch.zeros_like(weight_M) if weighting and target_MH is not None else None
        with torch.autocast(hidden_MH.device.type, enabled=False):
            for start in range(0, hidden_MH.shape[0], chunk):
                sl = slice(start, start + chunk)
                t_cH = target_MH[sl] if target_MH is not None else None
                w_c = weight_M[sl] if weighting else weight_M[sl] / norm
                ce_c, kl_c, correct_M[sl], grad_cH = chunk_loss(
                    hidden_MH[sl], head_VH, labels_M[sl], w_c, t_cH, kl_weight, want_grad
                )
                if weighting:
                    ce_M[sl] = ce_c
                    if kl_M is not None and kl_c is not None:
                        kl_M[sl] = kl_c
                else:
                    ce_sum += (weight_M[sl] * ce_c).sum()
                    if kl_c is not None:
                        kl_sum += (weight_M[sl] * kl_c).sum()
                if want_grad:
                    grad_MH[sl] = grad_cH
        if weighting:
            kind, a, slots = weighting
            factor_M = acceptance_weights(ce_M.view(-1, slots), correct_M.view(-1, slots),
                                          (weight_M > 0).view(-1, slots), kind, a).flatten()
            w_M = weight_M * factor_M
            norm = w_M.sum().clamp_min(1e-6)
            ce_sum = (w_M * ce_M).sum()
            if kl_M is not None:
                kl_sum = (w_M * kl_M).sum()
            if want_grad:
                grad_MH.mul_((factor_M / norm)[:, None])  # in place: no second [M, H] buffer
        else:
            norm = norm.clone()
        ctx.save_for_backward(grad_MH)
        ctx.mark_non_differentiable(ce_sum, kl_sum, correct_M, norm)
        loss = ((1.0 - kl_weight) * ce_sum + kl_weight * kl_sum) / norm
        return loss, ce_sum, kl_sum, correct_M, norm

    @staticmethod
    def backward(ctx, g_loss, _g_ce, _g_kl, _g_correct, _g_norm):
        (grad_MH,) = ctx.saved_tensors
        return grad_MH * g_loss.to(grad_MH.dtype), None, None, None, None, None, None, None, None, None


def _math_dtype(head_VH: torch.Tensor) -> torch.dtype:
    # Softmax math in float32 at least (bf16 logits are upcast), float64 stays float64.
    return torch.promote_types(head_VH.dtype, torch.float32)


ROWS_PER_MATMUL = 1024  # rows of a chunk sent through the lm_head at once: bounds the bf16 temporaries


def _logits_into(h_cH: torch.Tensor, head_VH: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """h @ head.T as one [c, V] buffer of `dtype`, filled ROWS_PER_MATMUL rows at a time.

    The matmul runs in the head's dtype (bf16 on GPU); only a [rows, V] slice of it exists at a
    time, so the chunk costs one math-dtype buffer instead of a bf16 and an fp32 copy of it.
    """
    out_cV = torch.empty(h_cH.shape[0], head_VH.shape[0], dtype=dtype, device=h_cH.device)
    h_cH = h_cH.to(head_VH.dtype)
    for r in range(0, h_cH.shape[0], ROWS_PER_MATMUL):
        out_cV[r:r + ROWS_PER_MATMUL] = h_cH[r:r + ROWS_PER_MATMUL] @ head_VH.T
    return out_cV


def _log_softmax_(x_cV: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim, in place (no second [c, V] buffer)."""
    x_cV.sub_(x_cV.amax(dim=-1, keepdim=True))
    lse_c1 = torch.empty_like(x_cV[:, :1])
    for r in range(0, x_cV.shape[0], ROWS_PER_MATMUL):  # exp of a row slice at a time
        lse_c1[r:r + ROWS_PER_MATMUL] = x_cV[r:r + ROWS_PER_MATMUL].exp().sum(dim=-1, keepdim=True).log_()
    return x_cV.sub_(lse_c1)


def _chunk_loss(h_cH, head_VH, labels_c, w_c, t_cH, kl_weight, want_grad):
    """Per-token CE and KL of one chunk, argmax correctness, and d(sum w*loss)/dh if wanted.

    Memory: one [c, V] math-dtype buffer (two with soft labels) plus [ROWS_PER_MATMUL, V]
    temporaries; log-softmax, softmax and the gradient are formed in place in that buffer.
    """
    dtype = _math_dtype(head_VH)
    logp_cV = _logits_into(h_cH, head_VH, dtype)
    correct_c = logp_cV.argmax(dim=-1) == labels_c
    _log_softmax_(logp_cV)
    ce_c = -logp_cV.gather(1, labels_c[:, None]).squeeze(1)
    kl_c = target_p_cV = None
    if t_cH is not None and kl_weight > 0:
        target_logp_cV = _log_softmax_(_logits_into(t_cH, head_VH, dtype))
        kl_c = torch.empty_like(ce_c)
        for r in range(0, kl_c.shape[0], ROWS_PER_MATMUL):
            tl = target_logp_cV[r:r + ROWS_PER_MATMUL]
            kl_c[r:r + ROWS_PER_MATMUL] = (tl.exp() * (tl - logp_cV[r:r + ROWS_PER_MATMUL])).sum(dim=-1)
        target_p_cV = target_logp_cV.exp_()
    if not want_grad:
        return ce_c, kl_c, correct_c, None
    # d loss / d logits = p - (1-kl) * onehot(label) - kl * p_target, times the token weight.
    grad_cV = logp_cV.exp_()
    rows = torch.arange(labels_c.shape[0], device=labels_c.device)
    grad_cV[rows, labels_c] -= (1.0 - kl_weight) if target_p_cV is not None else 1.0
    if target_p_cV is not None:
        grad_cV.sub_(target_p_cV, alpha=kl_weight)
        del target_p_cV
    grad_cV.mul_(w_c[:, None].to(dtype))
    grad_cH = torch.empty(h_cH.shape, dtype=head_VH.dtype, device=h_cH.device)
    for r in range(0, grad_cV.shape[0], ROWS_PER_MATMUL):
        grad_cH[r:r + ROWS_PER_MATMUL] = grad_cV[r:r + ROWS_PER_MATMUL].to(head_VH.dtype) @ head_VH
    return ce_c, kl_c, correct_c, grad_cH.to(h_cH.dtype)


def _chunk_loss_fused(h_cH, head_VH, labels_c, w_c, t_cH, kl_weight, want_grad):
    """`_chunk_loss` through the Triton kernel (dflash.train.loss_kernel): the logits stay in the head's dtype
    (bf16 on GPU, as the matmul produces them), the gradient is written over them in place."""
    from dflash.train.loss_kernel import fused_rows

    logits_cV = h_cH.to(head_VH.dtype) @ head_VH.T
    use_kl = t_cH is not None and kl_weight > 0
    target_cV = t_cH.to(head_VH.dtype) @ head_VH.T if use_kl else None
    ce_c, kl_c, argmax_c = fused_rows(logits_cV, labels_c, w_c.to(_math_dtype(head_VH)), target_cV, kl_weight, want_grad)
    del target_cV
    grad_cH = (logits_cV @ head_VH).to(h_cH.dtype) if want_grad else None
    return ce_c, kl_c, argmax_c == labels_c, grad_cH


def fused_loss_available(device: torch.device) -> bool:
    """The Triton loss kernel runs on CUDA (or anywhere under TRITON_INTERPRET=1, for tests)."""
    import os

    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _check_loss_inputs(hidden_BQH, head_VH, labels_BQ, weight_BQ, block_size, chunk, target_hidden_BQH, kl_weight):
    B, Q, H = hidden_BQH.shape
    if Q % block_size:
        raise ValueError(f"query length {Q} is not a multiple of block_size {block_size}")
    if labels_BQ.shape != (B, Q) or weight_BQ.shape != (B, Q):
        raise ValueError(
            f"labels {tuple(labels_BQ.shape)} and weight {tuple(weight_BQ.shape)} must be [B, Q] = [{B}, {Q}]"
        )
    if head_VH.shape[1] != H:
        raise ValueError(f"lm_head weight {tuple(head_VH.shape)} does not match hidden size {H}")
    if head_VH.requires_grad:
        raise ValueError(
            "the lm_head weight must be frozen (requires_grad=False): the chunked loss gives it no gradient"
        )
    if chunk < 1:
        raise ValueError(f"loss chunk must be >= 1, got {chunk}")
    if not 0.0 <= kl_weight <= 1.0:
        raise ValueError(f"kl_weight must be in [0, 1], got {kl_weight}")
    if kl_weight > 0 and target_hidden_BQH is None:
        raise ValueError("kl_weight > 0 needs target_hidden_BQH (the target's last hidden state per slot)")
    if target_hidden_BQH is not None and target_hidden_BQH.shape != hidden_BQH.shape:
        raise ValueError(f"target_hidden {tuple(target_hidden_BQH.shape)} must match hidden {tuple(hidden_BQH.shape)}")


def dflash_loss(
    hidden_BQH: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels_BQ: torch.Tensor,
    weight_BQ: torch.Tensor,
    block_size: int,
    chunk: int,
    target_hidden_BQH: torch.Tensor | None = None,
    kl_weight: float = 0.0,
    fused: bool | None = None,
    slot_weighting: str = "gamma",
    cap_alpha: float = 0.5,
) -> tuple[torch.Tensor, dict]:
    """Weighted CE (blended with forward KL when kl_weight > 0) over the weighted tokens, and its metrics as
    device tensors (read them with `read_metrics`).

    loss = [(1 - kl_weight) * sum w*CE + kl_weight * sum w*KL] / sum w. Slots 1..bs-1 of every block go
    through the lm_head, `chunk` rows at a time; slot 0 (the given anchor) never counts, whatever its weight.
    Nothing here waits for the GPU: the rows are chosen by shape, not by reading which weights are > 0 (a
    weight-0 row costs its matmul and adds exactly 0). fused: the Triton kernel (None = on CUDA).
    slot_weighting other than "gamma": w = weight_BQ x `acceptance_weights` (detached; cap_alpha is its a).
    """
    _check_loss_inputs(
        hidden_BQH, lm_head_weight, labels_BQ, weight_BQ, block_size, chunk, target_hidden_BQH, kl_weight
    )
    if slot_weighting not in SLOT_WEIGHTINGS:
        raise ValueError(f"slot_weights {slot_weighting!r}: use one of {', '.join(SLOT_WEIGHTINGS)}")
    weighting = None if slot_weighting == "gamma" else (slot_weighting, float(cap_alpha), block_size - 1)
    B, Q, H = hidden_BQH.shape
    A = Q // block_size

    def scored(t_BQ_):  # slots 1..bs-1 of every block as rows [B * A * (bs - 1), ...]
        return t_BQ_.unflatten(1, (A, block_size))[:, :, 1:].flatten(0, 2)

    weight_M = scored(weight_BQ.to(_math_dtype(lm_head_weight)))
    norm = weight_M.sum().clamp_min(1e-6)
    use_kl = kl_weight > 0
    if fused is None:
        fused = fused_loss_available(hidden_BQH.device)
    # A weight-0 row (padding anchor, past the sequence or the loss mask) may hold any label and, in principle, any
    # value: zeroed, it adds exactly 0 (a nan there would otherwise survive 0 * nan).
    keep_M1 = (weight_M > 0)[:, None]
    target_MH = torch.where(keep_M1, scored(target_hidden_BQH), 0) if use_kl else None
    labels_M = torch.where(weight_M > 0, scored(labels_BQ), 0)
    loss, ce_sum, kl_sum, correct_M, norm = _ChunkedLMHeadLoss.apply(
        torch.where(keep_M1, scored(hidden_BQH), 0), lm_head_weight, labels_M, weight_M, target_MH, float(kl_weight),
        chunk, norm, fused, weighting,
    )
    correct_BQ = torch.zeros(B, A, block_size, dtype=torch.bool, device=hidden_BQH.device)
    correct_BQ[:, :, 1:] = correct_M.view(B, A, block_size - 1)
    metrics = block_metric_tensors(correct_BQ.view(B, Q), weight_BQ > 0, block_size)
    metrics.update(loss=loss.detach(), ce=ce_sum / norm, kl=kl_sum / norm, weight_sum=norm)
    return loss, metrics


@torch.no_grad()
def block_metric_tensors(correct_BQ: torch.Tensor, valid_BQ: torch.Tensor, block_size: int) -> dict:
    """Per-slot accuracy (slots 1..bs-1) and the simulated acceptance length 1 + sum_k prod_{i<=k} correct_i,
    as device tensors (counts; `read_metrics` turns them into the plain numbers).

    A slot that is not valid counts as wrong (the chain stops); the acceptance length averages
    over blocks whose slot 1 is valid.
    """
    B, Q = correct_BQ.shape
    ok_BAk = (correct_BQ & valid_BQ).view(B, Q // block_size, block_size)[:, :, 1:]
    valid_BAk = valid_BQ.view(B, Q // block_size, block_size)[:, :, 1:]
    blocks_BA = valid_BAk[:, :, 0]
    accepted_BA = 1 + ok_BAk.long().cumprod(dim=-1).sum(dim=-1)
    return {
        "acc_slot": ok_BAk.sum(dim=(0, 1)) / valid_BAk.sum(dim=(0, 1)).clamp_min(1),
        "blocks": blocks_BA.sum(),
        "accepted": (accepted_BA * blocks_BA).sum(),
        "tokens": valid_BAk.sum(),
        "ok": ok_BAk.sum(),
    }


def read_metrics(raws: list[dict]) -> list[dict]:
    """Every tensor of every dict in `raws`, read from the device at once (one wait for the GPU), as plain
    numbers: 0-dim tensors become floats, the others lists; the counts of `block_metric_tensors` become
    acc, accept_len and the int blocks/tokens/anchors. Plain numbers pass through."""
    flat = [t.detach().reshape(-1).double() for raw in raws for t in raw.values() if isinstance(t, torch.Tensor)]
    values = iter(torch.cat([t.to(flat[0].device) for t in flat]).tolist() if flat else [])
    out = []
    for raw in raws:
        m = {}
        for key, t in raw.items():
            if isinstance(t, torch.Tensor):
                got = [next(values) for _ in range(t.numel())]
                m[key] = got if t.dim() else got[0]
            else:
                m[key] = t
        if "blocks" in m:
            blocks, tokens, ok, accepted = int(m["blocks"]), int(m["tokens"]), m.pop("ok"), m.pop("accepted")
            m.update(acc=ok / max(tokens, 1), accept_len=accepted / blocks if blocks else 0.0, blocks=blocks,
                     tokens=tokens)
        if "anchors" in m:
            m["anchors"] = int(m["anchors"])
        out.append(m)
    return out


def block_metrics(correct_BQ: torch.Tensor, valid_BQ: torch.Tensor, block_size: int) -> dict:
    """`block_metric_tensors`, read: acc, acc_slot, accept_len, blocks, tokens as plain numbers."""
    return read_metrics([block_metric_tensors(correct_BQ, valid_BQ, block_size)])[0]


def _batch_field(batch, name: str, required: bool = True):
    value = batch.get(name) if isinstance(batch, dict) else getattr(batch, name, None)
    if value is None and required:
        raise ValueError(f"batch has no {name!r}")
    return value


def target_hidden_for_slots(last_BSH: torch.Tensor, query_pos_BQ: torch.Tensor) -> torch.Tensor:
    """The target's last hidden state that predicts each slot's label: position (anchor + k) - 1."""
    S, H = last_BSH.shape[1], last_BSH.shape[2]
    src_BQ = (query_pos_BQ - 1).clamp(0, S - 1)
    return last_BSH.gather(1, src_BQ[:, :, None].expand(-1, -1, H))


def train_step_math(
    drafter: DFlashDrafter,
    target: torch.nn.Module,
    batch,
    cfg,
    generator: torch.Generator | None,
    attn_backend: Backend,
) -> tuple[torch.Tensor, dict]:
    """Loss (with a graph to the drafter) and metrics for one batch {input_ids, loss_mask} [B, S] of right-padded rows
    (dflash.data.batching.collate: loss_mask 0 on padding); an attention_mask in the batch is not read (see target_step)."""
    context_BSF, last_BSH = target_step(target, batch, drafter.config.target_layer_ids, cfg.train.kl_weight > 0)
    embed_VH, head_VH = target_embed_and_head(target)
    return drafter_step_math(drafter, embed_VH, head_VH, batch, context_BSF, last_BSH, cfg, generator, attn_backend)


def target_step(target: torch.nn.Module, batch, layer_ids: list[int], want_last: bool):
    """The target role's work for one batch: (context features [B, S, n*H], last hidden [B, S, H] | None).

    The batch's attention mask is not passed: rows are right-padded (dflash.data.batching.collate) and the target is
    causal (its attention, and a hybrid's convolution and recurrence), so a real position never sees the padding
    after it. Without a mask HF builds no [B, 1, S, S] padding mask (4.5 GiB at 49,152 tokens in 2 rows), does
    not read the GPU to check it, and runs the causal kernels. Features at padded positions are then computed
    over padding; no anchor, context key or label reads them (dflash.models.attention, block_inputs)."""
    input_ids_BS = _batch_field(batch, "input_ids")
    packed = (batch["position_ids"], batch["cu_seqlens"]) if "cu_seqlens" in batch else None
    return target_features(target, input_ids_BS, None, layer_ids, want_last, packed)


def batch_anchors(batch, tcfg, block_size: int, generator: torch.Generator | None):
    """(anchors, valid, start, end) [B, A] of a batch: `sample_anchors` under train.max_anchors / batch_anchors; start
    and end (None unless packed) bound each anchor's sequence. A packed row's anchors are its batch's: batch_anchors,
    else max_anchors for each of its sequences, drawn over the whole row."""
    loss_mask_BS = _batch_field(batch, "loss_mask")
    eligible_B = _batch_field(batch, "eligible_anchors", required=False)  # host counts: no read-back from the GPU
    if "cu_seqlens" not in batch:
        anchors_BA, valid_BA = sample_anchors(loss_mask_BS, tcfg.max_anchors, block_size, generator, tcfg.batch_anchors,
                                              eligible_B)
        return anchors_BA, valid_BA, None, None
    cu = batch["cu_seqlens"]
    cap = tcfg.batch_anchors or tcfg.max_anchors * (cu.shape[0] - 1)
    anchors_BA, valid_BA = sample_anchors(loss_mask_BS, cap, block_size, generator, None, eligible_B,
                                          batch["position_ids"] == 0)
    return (anchors_BA, valid_BA, *sequence_bounds(cu, anchors_BA))


def sequence_bounds(cu_seqlens: torch.Tensor, anchors_BA: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) [B, A] of the sequence each anchor of a packed row lies in (cu_seqlens: the starts, then T)."""
    cu = cu_seqlens.long()
    seq_BA = torch.searchsorted(cu[1:-1], anchors_BA, right=True)
    return cu[seq_BA], cu[seq_BA + 1]


def drafter_step_math(
    drafter: DFlashDrafter,
    embed_VH: torch.Tensor,
    head_VH: torch.Tensor,
    batch,
    context_BSF: torch.Tensor,
    last_BSH: torch.Tensor | None,
    cfg,
    generator: torch.Generator | None,
    attn_backend: Backend,
) -> tuple[torch.Tensor, dict]:
    """The drafter role's math for one batch, given the target's features (co-located or received)."""
    dcfg, tcfg = getattr(drafter, "module", drafter).config, cfg.train  # plain or DDP-wrapped
    input_ids_BS = _batch_field(batch, "input_ids")
    loss_mask_BS = _batch_field(batch, "loss_mask")
    B, S = input_ids_BS.shape
    device = input_ids_BS.device
    bs = dcfg.block_size
    want_last = tcfg.kl_weight > 0
    if want_last and last_BSH is None:
        raise ValueError("kl_weight > 0 needs the target's last hidden state")

    packed = "cu_seqlens" in batch  # one row of sequences end to end (dflash.data.batching.collate_packed)
    anchors_BA, valid_BA, start_BA, end_BA = batch_anchors(batch, tcfg, bs, generator)
    block_ids_BQ, labels_BQ, label_valid_BQ, query_pos_BQ = block_inputs(
        input_ids_BS, anchors_BA, bs, dcfg.mask_token_id, loss_mask_BS=loss_mask_BS, valid_BA=valid_BA, end_BA=end_BA
    )
    noise_BQH = F.embedding(block_ids_BQ, embed_VH)
    # No context mask: rows are right-padded and a valid anchor is a real token (loss_mask), so every context
    # position before it is real too; an invalid anchor sees no context. The kernels then read no padding mask.
    # Packed, each block sees context from its sequence's start on, at the positions that sequence has alone.
    attn = build_layer_masks(anchors_BA, valid_BA, S, bs, device, attn_backend, dcfg.layer_types, dcfg.sliding_window,
                             context_start_BA=start_BA)
    if packed:
        context_pos_BS = batch["position_ids"].expand(B, S)
        rope_pos_BQ = query_pos_BQ - start_BA.repeat_interleave(bs, dim=1)
    else:
        context_pos_BS, rope_pos_BQ = torch.arange(S, device=device).expand(B, S), query_pos_BQ
    hidden_BQH = drafter(context_BSF, noise_BQH, context_pos_BS, rope_pos_BQ, attn)

    A = anchors_BA.shape[1]
    weight_BQ = slot_weights(bs, tcfg.gamma, device).repeat(A)[None, :] * label_valid_BQ
    target_hidden_BQH = target_hidden_for_slots(last_BSH, query_pos_BQ) if want_last else None
    loss, metrics = dflash_loss(
        hidden_BQH, head_VH, labels_BQ, weight_BQ, bs, tcfg.loss_chunk, target_hidden_BQH, tcfg.kl_weight,
        slot_weighting=tcfg.slot_weights, cap_alpha=tcfg.cap_alpha,
    )
    metrics["anchors"] = valid_BA.sum()
    return loss, metrics
