"""The two attention paths agree, and no block can see its anchor's or any later context position."""

from __future__ import annotations

import pytest
import torch

from dflash.models.attention import attend, build_train_mask

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

B, S, BS, HQ, HKV, D = 2, 24, 4, 4, 2, 16


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.tensor([[0, 5, 11, 20], [3, 9, 0, 0]])
    valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
    context_valid = torch.ones(B, S, dtype=torch.bool)
    context_valid[1, 14:] = False  # row 1 is 14 tokens long
    Q = anchors.shape[1] * BS
    q = torch.randn(B, HQ, Q, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, S + Q, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, S + Q, D, generator=g, dtype=torch.float64)
    return anchors, valid, context_valid, q, k, v


def _run(backend, anchors, valid, context_valid, q, k, v):
    q, k, v = (t.float().clone().requires_grad_(True) for t in (q, k, v))
    mask = build_train_mask(anchors, valid, S, BS, "cpu", backend, context_valid_BS=context_valid)
    out = attend(q, k, v, mask)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def test_flex_and_sdpa_agree_on_outputs_and_grads():
    case = _case()
    flex = _run("flex", *case)
    sdpa = _run("sdpa", *case)
    for name, a, b in zip(("out", "dq", "dk", "dv"), flex, sdpa):
        diff = (a - b).abs().max().item()
        assert diff < 1e-5, f"{name}: flex vs sdpa max abs diff {diff:.3e}"


def test_dense_mask_rules():
    anchors, valid, context_valid, *_ = _case()
    m = build_train_mask(anchors, valid, S, BS, "cpu", "sdpa", context_valid_BS=context_valid).mask[:, 0]
    # Row 0, block 2 (anchor 11): context 0..10 visible, 11.. not; its own block only.
    q = 2 * BS
    assert m[0, q, :11].all() and not m[0, q, 11:S].any()
    assert m[0, q, S + 2 * BS : S + 3 * BS].all() and m[0, q, S:].sum() == BS
    # Row 1, invalid block 2: no context at all, only its own block.
    assert not m[1, q, :S].any() and m[1, q, S + 2 * BS : S + 3 * BS].all()
    # Padded context (row 1 beyond 14) is never visible.
    assert not m[1, :, 14:S].any()


@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_block_output_ignores_context_at_or_after_its_anchor(backend):
    anchors, valid, context_valid, q, k, v = _case()
    mask = build_train_mask(anchors, valid, S, BS, "cpu", backend, context_valid_BS=context_valid)
    base = attend(q.float(), k.float(), v.float(), mask)
    row, block, anchor = 0, 1, int(anchors[0, 1])
    rows = slice(block * BS, (block + 1) * BS)
    for pos in range(S):
        k2, v2 = k.float().clone(), v.float().clone()
        k2[row, :, pos] += 3.0
        v2[row, :, pos] += 3.0
        out = attend(q.float(), k2, v2, mask)
        changed = (out[row, :, rows] - base[row, :, rows]).abs().max().item()
        if pos >= anchor:
            assert changed == 0.0, f"block with anchor {anchor} changed by {changed} when context {pos} moved"
        else:
            assert changed > 1e-4, f"block with anchor {anchor} ignored visible context {pos}"


def test_bad_backend_is_a_clear_error():
    anchors, valid, *_ = _case()
    with pytest.raises(ValueError, match="backend"):
        build_train_mask(anchors, valid, S, BS, "cpu", "flash")


def _tile_case(seed: int, seq_len: int, block_size: int, anchors_per_row: int, rows: int = 2):
    """Random anchors (some padding) and context padding over a few 128-wide tiles."""
    g = torch.Generator().manual_seed(seed)
    anchors = torch.sort(torch.randint(1, seq_len - 1, (rows, anchors_per_row), generator=g), dim=1).values
    valid = torch.rand(rows, anchors_per_row, generator=g) > 0.2
    context_valid = torch.ones(rows, seq_len, dtype=torch.bool)
    context_valid[-1, seq_len - 40:] = False  # the last row is 40 tokens shorter
    return anchors, valid, context_valid


TILE_CASES = [(0, 300, 16, 20), (1, 256, 16, 16), (2, 200, 4, 50), (3, 130, 32, 5), (4, 384, 8, 40), (5, 140, 128, 2)]
# Sliding windows that cut across tiles (>= block_size), one not a multiple of anything.
WINDOW_CASES = [(0, 300, 16, 20, 100), (2, 200, 4, 50, 37), (4, 384, 8, 40, 128), (5, 140, 128, 2, 130), (1, 256, 16, 16, 16)]


def _reference_mask(anchors, valid, context_valid, seq_len, block_size, window=None):
    """The rule, element by element: block j (anchor a) slot o sees context p iff the anchor is valid, p is not
    padding, p < a and (sliding) p > a + o - window; it sees every slot of its own block and no other block."""
    rows, n = anchors.shape
    Q = n * block_size
    out = torch.zeros(rows, Q, seq_len + Q, dtype=torch.bool)
    for b in range(rows):
        for q in range(Q):
            j, o = divmod(q, block_size)
            a = int(anchors[b, j]) if valid[b, j] else 0
            for p in range(seq_len):
                out[b, q, p] = bool(context_valid[b, p]) and p < a and (window is None or p > a + o - window)
            out[b, q, seq_len + j * block_size: seq_len + (j + 1) * block_size] = True
    return out


@pytest.mark.parametrize("window", [None, 4, 7, 30])
def test_dense_mask_equals_the_element_by_element_rule(window):
    anchors, valid, context_valid = _tile_case(7, 40, 4, 6)
    dense = build_train_mask(anchors, valid, 40, 4, "cpu", "sdpa", context_valid_BS=context_valid, window=window).mask[:, 0]
    assert torch.equal(dense, _reference_mask(anchors, valid, context_valid, 40, 4, window))


def test_sliding_window_counts_back_from_each_query_position():
    """Anchor 6, block 4, window 4: slot o sits at 6 + o and sees positions > 2 + o before the anchor, and its block."""
    anchors, valid = torch.tensor([[6]]), torch.tensor([[True]])
    m = build_train_mask(anchors, valid, 12, 4, "cpu", "sdpa", window=4).mask[0, 0]
    seen = [m[o].nonzero().flatten().tolist() for o in range(4)]
    assert seen == [[3, 4, 5, 12, 13, 14, 15], [4, 5, 12, 13, 14, 15], [5, 12, 13, 14, 15], [12, 13, 14, 15]]
    # A window reaching past position 0 for every query is the full mask.
    full = build_train_mask(anchors, valid, 12, 4, "cpu", "sdpa").mask
    assert torch.equal(build_train_mask(anchors, valid, 12, 4, "cpu", "sdpa", window=15).mask, full)
    with pytest.raises(ValueError, match="must be >= block_size"):
        build_train_mask(anchors, valid, 12, 4, "cpu", "sdpa", window=3)


def test_layer_masks_follow_the_layer_types():
    from dflash.models.attention import build_layer_masks

    anchors, valid = torch.tensor([[6]]), torch.tensor([[True]])
    masks = build_layer_masks(anchors, valid, 12, 4, "cpu", "sdpa", ["sliding_attention", "full_attention"], 4)
    assert set(masks) == {"sliding_attention", "full_attention"}
    assert masks["sliding_attention"].mask.sum() < masks["full_attention"].mask.sum()
    assert set(build_layer_masks(anchors, valid, 12, 4, "cpu", "sdpa", ["full_attention"], None)) == {"full_attention"}
    with pytest.raises(ValueError, match="need a sliding_window"):
        build_layer_masks(anchors, valid, 12, 4, "cpu", "sdpa", ["sliding_attention"], None)


def _check_tiles(seed, seq_len, block_size, n_anchors, window):
    from dflash.models.attention import FLEX_TILE, _tile_lists

    anchors, valid, context_valid = _tile_case(seed, seq_len, block_size, n_anchors)
    eff = torch.where(valid, anchors, torch.zeros_like(anchors))
    partial, full = _tile_lists(eff, context_valid, seq_len, block_size, window)
    dense = build_train_mask(anchors, valid, seq_len, block_size, "cpu", "sdpa", context_valid_BS=context_valid,
                             window=window).mask[:, 0]
    B, Q, L = dense.shape
    T = FLEX_TILE
    padded = torch.nn.functional.pad(dense, (0, -L % T, 0, -Q % T))
    tiles = padded.view(B, padded.shape[1] // T, T, padded.shape[2] // T, T)
    any_t, all_t = tiles.any(dim=(2, 4)), tiles.all(dim=(2, 4))
    assert not (full & partial).any()
    assert ((partial | full) >= any_t).all(), "a tile with visible pairs is missing"
    assert (all_t >= full).all(), "a tile marked full has masked pairs"
    in_bounds = torch.zeros_like(full)
    in_bounds[:, : Q // T, : L // T] = True
    assert (in_bounds >= full).all(), "a tile past the sequence end is marked full"
    return full


@pytest.mark.parametrize("seed, seq_len, block_size, n_anchors", TILE_CASES)
def test_block_mask_tiles_cover_every_visible_pair_and_full_tiles_are_full(seed, seq_len, block_size, n_anchors):
    """The BlockMask is built from tile minima/maxima, not by evaluating the mask: check it against the dense rule."""
    _check_tiles(seed, seq_len, block_size, n_anchors, None)


@pytest.mark.parametrize("seed, seq_len, block_size, n_anchors, window", WINDOW_CASES)
def test_sliding_block_mask_tiles_cover_every_visible_pair_and_full_tiles_are_full(seed, seq_len, block_size, n_anchors,
                                                                                   window):
    _check_tiles(seed, seq_len, block_size, n_anchors, window)


def test_sliding_tiles_still_use_full_tiles():
    """16 blocks anchored at 400..415, window 300: they all see 123..399, so context tile 1 (128..255) is full."""
    from dflash.models.attention import _tile_lists

    anchors = torch.arange(400, 416)[None]
    partial, full = _tile_lists(anchors, torch.ones(1, 512, dtype=torch.bool), 512, 8, window=300)
    assert full[0, 0, :4].tolist() == [False, True, True, False]  # tile 0 is cut by the window, tile 3 by the anchors
    assert partial[0, 0, :4].tolist() == [True, False, False, True]


@pytest.mark.parametrize("seed, seq_len, block_size, n_anchors, window", [
    (0, 300, 16, 20, None), (2, 200, 4, 50, None), (3, 130, 32, 5, None), (0, 300, 16, 20, 100), (2, 200, 4, 50, 37),
])
def test_flex_over_several_tiles_matches_sdpa(seed, seq_len, block_size, n_anchors, window):
    anchors, valid, context_valid = _tile_case(seed, seq_len, block_size, n_anchors)
    g = torch.Generator().manual_seed(seed)
    Q = n_anchors * block_size
    q = torch.randn(2, HQ, Q, D, generator=g)
    k = torch.randn(2, HKV, seq_len + Q, D, generator=g)
    v = torch.randn(2, HKV, seq_len + Q, D, generator=g)
    out = {}
    for backend in ("flex", "sdpa"):
        mask = build_train_mask(anchors, valid, seq_len, block_size, "cpu", backend, context_valid_BS=context_valid,
                                window=window)
        out[backend] = attend(q, k, v, mask)
    diff = float((out["flex"] - out["sdpa"]).abs().max())
    assert diff < 1e-5, f"flex vs sdpa max abs diff {diff:.3e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled flex attention)")
@pytest.mark.parametrize("window", [None, 100])
def test_compiled_flex_on_cuda_matches_sdpa_over_several_tiles(window):
    """Outputs and gradients of the compiled flex path equal SDPA's for four batch shapes of one run's block size
    (rows, lengths and anchor counts that change, lengths that are and are not multiples of the tile), and no
    shape after the first builds a graph (the anchor count, length and tile counts are no Python ints to guard)."""
    from torch._dynamo.utils import counters

    graphs = []
    for seed, seq_len, block_size, n_anchors in ((0, 300, 16, 20), (2, 200, 16, 50), (1, 384, 16, 8),
                                                 (3, 1000, 16, 61)):
        anchors, valid, context_valid = _tile_case(seed, seq_len, block_size, n_anchors)
        g = torch.Generator().manual_seed(seed)
        Q = n_anchors * block_size
        base = [torch.randn(2, n, h, D, generator=g).cuda().bfloat16()  # the trainer's row layout, viewed per head
                for h, n in ((HQ, Q), (HKV, seq_len + Q), (HKV, seq_len + Q))]
        grad_out = torch.randn(2, HQ, Q, D, generator=g).cuda().bfloat16()
        out, grads = {}, {}
        for backend in ("flex", "sdpa"):
            q, k, v = (t.clone().requires_grad_(True) for t in base)
            q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))
            mask = build_train_mask(anchors, valid, seq_len, block_size, "cuda", backend,
                                    context_valid_BS=context_valid.cuda(), window=window)
            o = attend(q_, k_, v_, mask)
            o.backward(grad_out)
            out[backend], grads[backend] = o.float(), [t.grad.float() for t in (q, k, v)]
        diff = float((out["flex"] - out["sdpa"]).abs().max())
        assert diff < 2e-2, f"compiled flex vs sdpa max abs diff {diff:.3e} (bf16)"
        for name, a, b in zip("qkv", grads["flex"], grads["sdpa"]):
            gdiff = float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))
            print(f"shape {seq_len}/{block_size}/{n_anchors}: d{name} relative max diff {gdiff:.2e}")
            assert gdiff < 3e-2, f"d{name}: compiled flex vs sdpa relative max diff {gdiff:.3e} (bf16)"
        graphs.append(int(counters["stats"]["unique_graphs"]))
    print(f"compiled graphs after each shape: {graphs}")
    assert graphs[-1] == graphs[0], f"flex recompiled for a new shape: graphs after each shape {graphs}"


@pytest.mark.parametrize("seed, seq_len, block_size, n_anchors, window", [
    (0, 300, 16, 20, None), (2, 200, 4, 50, None), (4, 384, 8, 40, 128),
])
def test_right_padded_rows_need_no_context_mask(seed, seq_len, block_size, n_anchors, window):
    """dflash.train.loss passes no context mask: with right padding and valid anchors on real tokens (what collate and
    sample_anchors give), the mask without it is the same, element by element, and flex's output too."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([seq_len, seq_len - 40, seq_len // 3])
    context_valid = torch.arange(seq_len)[None] < lengths[:, None]
    anchors = torch.sort((torch.rand(3, n_anchors, generator=g) * (lengths[:, None] - 1)).long(), dim=1).values
    valid = torch.rand(3, n_anchors, generator=g) > 0.2
    dense = {cv is None: build_train_mask(anchors, valid, seq_len, block_size, "cpu", "sdpa", context_valid_BS=cv,
                                          window=window).mask for cv in (context_valid, None)}
    assert torch.equal(dense[True], dense[False])
    Q = n_anchors * block_size
    q, k, v = (torch.randn(3, h, n, D, generator=g) for h, n in ((HQ, Q), (HKV, seq_len + Q), (HKV, seq_len + Q)))
    flex = attend(q, k, v, build_train_mask(anchors, valid, seq_len, block_size, "cpu", "flex", window=window))
    ref = attend(q, k, v, build_train_mask(anchors, valid, seq_len, block_size, "cpu", "sdpa",
                                           context_valid_BS=context_valid, window=window))
    diff = float((flex - ref).abs().max())
    assert diff < 1e-5, f"flex without the context mask vs sdpa with it: max abs diff {diff:.3e}"
