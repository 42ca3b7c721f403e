"""The fused DFlash loss kernel (Triton): loss, metrics and gradient of a logits chunk in two reads.

`dflash.train.loss` sends a chunk of weighted query tokens through the frozen lm_head as one bf16
[c, V] matmul, then calls `fused_rows` on that buffer. One program per row reads the row twice:
  pass 1: online max and sum of exp (log-sum-exp), the first argmax, and, with soft labels, the
          target row's log-sum-exp and sum p_target * (target - drafter) for the forward KL;
  pass 2: d(w * loss)/d logits = w * (softmax - (1 - kl) * onehot(label) - kl * p_target),
          written in place over the logits, in their dtype (the lm_head backward then runs as
          one more bf16 matmul on the same buffer).
So a chunk costs one bf16 [c, V] buffer (two with soft labels) and ~6 bytes of traffic per logit,
where the unfused path (`dflash.train.loss._chunk_loss`, the CPU reference) keeps an fp32 buffer and
walks it about ten times. Math runs in float32, or float64 for float64 logits (tests).

Runs on CUDA; on CPU only under Triton's interpreter (TRITON_INTERPRET=1, set before this module
is imported), which the tests use to check it against the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096  # vocabulary columns per loop iteration of a row program
NUM_WARPS = 8


@triton.jit
def _dflash_rows_kernel(
    logits_ptr, target_ptr, labels_ptr, weight_ptr, ce_ptr, kl_ptr, argmax_ptr,
    stride_row, stride_target_row, kl_weight, V: tl.constexpr,
    HAS_TARGET: tl.constexpr, WANT_GRAD: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = logits_ptr + row * stride_row
    t_row = target_ptr + row * stride_target_row
    label = tl.load(labels_ptr + row).to(tl.int64)
    neg_inf = float("-inf")
    m = tl.full((), neg_inf, ACC)  # running max of the drafter row
    s = tl.zeros((), ACC)  # running sum of exp(x - m)
    best = tl.full((), neg_inf, ACC)
    best_idx = tl.zeros((), tl.int64)
    mt = tl.full((), neg_inf, ACC)  # the same for the target row
    st = tl.zeros((), ACC)
    cross = tl.zeros((), ACC)  # running sum of exp(t - mt) * (t - x)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK).to(tl.int64)
        ok = cols < V
        x = tl.load(x_row + cols, mask=ok, other=neg_inf).to(ACC)
        block_max = tl.max(x, 0)
        block_idx = tl.min(tl.where(x == block_max, cols, V), 0)  # first maximum in the block
        take = block_max > best
        best_idx = tl.where(take, block_idx, best_idx)
        best = tl.where(take, block_max, best)
        m_new = tl.maximum(m, block_max)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
        if HAS_TARGET:
            t = tl.load(t_row + cols, mask=ok, other=neg_inf).to(ACC)
            mt_new = tl.maximum(mt, tl.max(t, 0))
            scale = tl.exp(mt - mt_new)
            e = tl.exp(t - mt_new)
            st = st * scale + tl.sum(e, 0)
            cross = cross * scale + tl.sum(tl.where(ok, e * (t - x), 0.0), 0)
            mt = mt_new
    lse = m + tl.log(s)
    x_label = tl.load(x_row + label).to(ACC)
    tl.store(ce_ptr + row, lse - x_label)
    tl.store(argmax_ptr + row, best_idx)
    if HAS_TARGET:
        lse_t = mt + tl.log(st)
        # KL(p_t || p_d) = sum p_t * ((t - lse_t) - (x - lse))
        tl.store(kl_ptr + row, cross / st - lse_t + lse)
    if WANT_GRAD:
        w = tl.load(weight_ptr + row).to(ACC)
        hard = 1.0
        if HAS_TARGET:
            hard = 1.0 - kl_weight
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK).to(tl.int64)
            ok = cols < V
            x = tl.load(x_row + cols, mask=ok, other=0.0).to(ACC)
            g = tl.exp(x - lse) - tl.where(cols == label, hard, 0.0)
            if HAS_TARGET:
                t = tl.load(t_row + cols, mask=ok, other=0.0).to(ACC)
                g -= kl_weight * tl.exp(t - lse_t)
            tl.store(x_row + cols, (g * w).to(logits_ptr.dtype.element_ty), mask=ok)


def fused_rows(
    logits_cV: torch.Tensor,
    labels_c: torch.Tensor,
    w_c: torch.Tensor,
    target_logits_cV: torch.Tensor | None,
    kl_weight: float,
    want_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-row (CE, KL or None, argmax) of a logits chunk; with want_grad, logits_cV is overwritten by
    d(sum w * loss)/d logits, where loss = (1 - kl) * CE + kl * KL (kl = kl_weight with a target)."""
    c, V = logits_cV.shape
    assert logits_cV.stride(1) == 1 and labels_c.shape == (c,) and w_c.shape == (c,)
    acc_torch = torch.float64 if logits_cV.dtype == torch.float64 else torch.float32
    ce_c = torch.empty(c, dtype=acc_torch, device=logits_cV.device)
    kl_c = torch.empty_like(ce_c) if target_logits_cV is not None else None
    argmax_c = torch.empty(c, dtype=torch.int64, device=logits_cV.device)
    if c == 0:
        return ce_c, kl_c, argmax_c
    target = target_logits_cV if target_logits_cV is not None else logits_cV
    assert target.shape == (c, V) and target.stride(1) == 1
    _dflash_rows_kernel[(c,)](
        logits_cV, target, labels_c, w_c, ce_c, kl_c if kl_c is not None else ce_c, argmax_c,
        logits_cV.stride(0), target.stride(0), float(kl_weight), V,
        HAS_TARGET=target_logits_cV is not None, WANT_GRAD=want_grad,
        ACC=tl.float64 if acc_torch == torch.float64 else tl.float32, BLOCK=min(BLOCK_V, triton.next_power_of_2(V)),
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return ce_c, kl_c, argmax_c
