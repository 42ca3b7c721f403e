"""The fused Triton loss kernel (dflash.train.loss_kernel) against the unfused CPU reference (dflash.train.loss._chunk_loss).

The kernel runs on CUDA; here it runs under Triton's interpreter, which must be switched on before
triton compiles anything, so the checks run in a child process with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _case(dtype, kl_weight, chunk, block_v, kind="gamma"):
    import dflash.train.loss_kernel as kernel
    from dflash.train.loss import dflash_loss, read_metrics, slot_weights

    kernel.BLOCK_V = block_v  # several loop iterations per row, the last one partial
    g = torch.Generator().manual_seed(3)
    B, A, bs, H, V = 2, 3, 4, 16, 50
    hidden = torch.randn(B, A * bs, H, generator=g, dtype=torch.float64).to(dtype)
    target_hidden = torch.randn(B, A * bs, H, generator=g, dtype=torch.float64).to(dtype)
    head = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    labels = torch.randint(0, V, (B, A * bs), generator=g)
    labels[0, 1] = int((hidden[0, 1].double() @ head.double().T).argmax())  # one slot right, so accuracy is not 0
    weight = slot_weights(bs, 3.0).double().repeat(A)[None].expand(B, -1).clone()
    weight[1, -bs:] = 0  # an invalid block (padding): never reaches the kernel
    out = []
    for fused in (True, False):
        h = hidden.clone().requires_grad_(True)
        loss, metrics = dflash_loss(h, head, labels, weight, bs, chunk, target_hidden, kl_weight, fused=fused,
                                    slot_weighting=kind)
        loss.backward()
        out.append((loss.detach().double(), h.grad.double(), read_metrics([metrics])[0]))
    (loss_f, grad_f, m_f), (loss_r, grad_r, m_r) = out
    tol = 1e-10 if dtype == torch.float64 else 2e-2
    assert abs(loss_f - loss_r) <= tol * max(1.0, abs(loss_r)), f"{dtype} kl {kl_weight}: loss {loss_f} vs {loss_r}"
    diff = (grad_f - grad_r).abs().max().item()
    scale = grad_r.abs().max().item()
    assert diff <= tol * max(scale, 1e-12), f"{dtype} kl {kl_weight} chunk {chunk}: grad max diff {diff:.3e} (max {scale:.3e})"
    assert grad_f[:, ::bs].abs().max() == 0
    for key in ("acc", "acc_slot", "accept_len", "blocks", "tokens"):
        assert m_f[key] == m_r[key], f"{key}: fused {m_f[key]} vs reference {m_r[key]}"
    assert m_f["acc"] > 0
    for key in ("ce", "kl", "weight_sum"):
        assert abs(m_f[key] - m_r[key]) <= tol * max(1.0, abs(m_r[key])), (key, m_f[key], m_r[key])
    with torch.no_grad():  # the no-gradient path (evaluation)
        loss_ng, _ = dflash_loss(hidden, head, labels, weight, bs, chunk, target_hidden, kl_weight, fused=True,
                                 slot_weighting=kind)
    assert abs(loss_ng.double() - loss_r) <= tol * max(1.0, abs(loss_r))


def _interpreter_checks():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    n = 0
    for kl_weight in (0.0, 0.5, 1.0):
        for chunk in (1, 5, 1000):
            _case(torch.float64, kl_weight, chunk, block_v=16)
            n += 1
        _case(torch.float32, kl_weight, 7, block_v=64)  # one iteration holding the whole row
        _case(torch.bfloat16, kl_weight, 7, block_v=16)
        n += 2
    for kind in ("cap", "dpace", "auf"):  # train.slot_weights: the kernel's per-row CE and argmax feed the factors
        _case(torch.float64, 0.5, 5, block_v=16, kind=kind)
        _case(torch.float32, 0.0, 7, block_v=64, kind=kind)
        n += 2
    print(f"fused == reference in {n} cases")


@pytest.mark.slow
def test_fused_loss_kernel_equals_reference_under_triton_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    code = "import sys; sys.path.insert(0, 'tests'); import test_loss_kernel as t; t._interpreter_checks()"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "fused == reference in 21 cases" in r.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton kernel)")
@pytest.mark.parametrize("kl_weight, kind", [(0.0, "gamma"), (0.5, "gamma"), (0.5, "cap"), (0.0, "dpace"), (0.0, "auf")])
def test_fused_loss_on_cuda_matches_reference_at_a_real_vocabulary(kl_weight, kind):
    """bf16 on the GPU, Qwen3's vocabulary (151936 = 37 loop iterations of 4096 + a partial one)."""
    from dflash.train.loss import dflash_loss, read_metrics, slot_weights

    g = torch.Generator().manual_seed(0)
    B, A, bs, H, V = 2, 16, 16, 512, 151936
    hidden = torch.randn(B, A * bs, H, generator=g).cuda().bfloat16()
    target_hidden = torch.randn(B, A * bs, H, generator=g).cuda().bfloat16()
    head = (torch.randn(V, H, generator=g) * 0.05).cuda().bfloat16()
    labels = torch.randint(0, V, (B, A * bs), generator=g).cuda()
    weight = slot_weights(bs, 7.0).repeat(A)[None].expand(B, -1).clone().cuda()
    out = {}
    for fused in (True, False):
        h = hidden.clone().requires_grad_(True)
        loss, m = dflash_loss(h, head, labels, weight, bs, 100, target_hidden, kl_weight, fused=fused,
                              slot_weighting=kind)
        loss.backward()
        out[fused] = (float(loss), h.grad.float(), read_metrics([m])[0])
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-4)
    diff = float((out[True][1] - out[False][1]).abs().max())
    assert diff <= 2e-2 * float(out[False][1].abs().max()), f"grad max diff {diff:.3e}"
    assert out[True][2]["acc_slot"] == out[False][2]["acc_slot"]
