"""DFlash training attention: who may see whom, and the two kernels that enforce it.

Key/value layout per row: [context (S positions) ; block 0 ; block 1 ; ... ; block A-1],
queries: [block 0 ; ... ; block A-1], each block `block_size` slots. A query in block j sees
context positions strictly before anchor_j (the anchor's own hidden state would leak the
answer) that are not padding, and every slot of its own block (non-causal). Invalid
(padding) anchors see only their own block: harmless, and they carry zero loss weight.

A packed batch (sequences end to end in one row) gives each anchor its sequence's start: its block then sees only
context from that start on, so no query sees another sequence (context_start_BA, a lower bound as the window's is).

Sliding-window layers (window w, HF's `sliding_window`): a query at slot o of the block anchored
at a sits at position a + o and sees context p only if p > a + o - w (it and the w - 1 positions
before it, as HF and flash-attention windows count), so slot 0 sees up to w - 1 context positions
and slot o up to w - 1 - o; its own block stays whole (w >= block_size). This is the window a
served drafter applies when the block is verified at positions a .. a + bs - 1.

Two backends with identical semantics:
  flex: a BlockMask without a per-head dimension, for flex_attention (CUDA, compiled), held as tensors (FlexMask).
  sdpa: a dense boolean [B, 1, Q, S+Q] mask for F.scaled_dot_product_attention (CPU, tests).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

Backend = Literal["flex", "sdpa"]
BACKENDS = ("flex", "sdpa")


@dataclass
class TrainMask:
    """What `attend` needs: the backend and its mask (BlockMask or dense bool)."""

    backend: Backend
    mask: FlexMask | torch.Tensor
    q_len: int
    kv_len: int


def _effective_anchors(anchors_BA: torch.Tensor, valid_BA: torch.Tensor) -> torch.Tensor:
    # An invalid anchor acts as anchor 0: its block sees no context at all.
    return torch.where(valid_BA, anchors_BA, torch.zeros_like(anchors_BA))


def _check_inputs(anchors_BA, valid_BA, seq_len, block_size, backend, context_valid_BS, context_start_BA=None):
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if anchors_BA.shape != valid_BA.shape or anchors_BA.dim() != 2:
        raise ValueError(f"anchors {tuple(anchors_BA.shape)} and valid {tuple(valid_BA.shape)} must both be [B, A]")
    if context_start_BA is not None and context_start_BA.shape != anchors_BA.shape:
        raise ValueError(f"context_start {tuple(context_start_BA.shape)} must be [B, A] like the anchors "
                         f"{tuple(anchors_BA.shape)}")
    if context_valid_BS is not None and context_valid_BS.shape != (anchors_BA.shape[0], seq_len):
        raise ValueError(
            f"context_valid must be [B, S] = [{anchors_BA.shape[0]}, {seq_len}], got {tuple(context_valid_BS.shape)}"
        )


def build_train_mask(
    anchors_BA: torch.Tensor,
    valid_BA: torch.Tensor,
    seq_len: int,
    block_size: int,
    device: torch.device | str,
    backend: Backend,
    context_valid_BS: torch.Tensor | None = None,
    window: int | None = None,
    context_start_BA: torch.Tensor | None = None,
) -> TrainMask:
    """The DFlash training mask for queries [A*block_size] over keys [seq_len + A*block_size]; window: sliding layers';
    context_start_BA: the first context position each anchor's block may see (a packed row's sequence starts)."""
    _check_inputs(anchors_BA, valid_BA, seq_len, block_size, backend, context_valid_BS, context_start_BA)
    if window is not None and window < block_size:
        raise ValueError(f"sliding window ({window}) must be >= block_size ({block_size}): a query sees its whole block")
    device = torch.device(device)
    anchor_BA = _effective_anchors(anchors_BA.to(device), valid_BA.to(device).bool())
    start_BA = None if context_start_BA is None else context_start_BA.to(device).long()
    padded_context = context_valid_BS is not None  # None: every context position is a token (no mask term for it)
    if context_valid_BS is None:
        context_valid_BS = torch.ones(anchor_BA.shape[0], seq_len, dtype=torch.bool, device=device)
    context_valid_BS = context_valid_BS.to(device).bool()
    q_len = anchor_BA.shape[1] * block_size
    kv_len = seq_len + q_len
    if window is not None and seq_len + block_size - 1 <= window:
        window = None  # no query reaches back past position 0: the sliding mask is the full one
    if backend == "sdpa":
        mask = _dense_mask(anchor_BA, context_valid_BS, seq_len, block_size, window, start_BA)
    else:
        mask = _block_mask(anchor_BA, context_valid_BS, seq_len, block_size, device, window, padded_context, start_BA)
    return TrainMask(backend, mask, q_len, kv_len)


LAYER_TYPES = ("full_attention", "sliding_attention")


def build_layer_masks(
    anchors_BA: torch.Tensor,
    valid_BA: torch.Tensor,
    seq_len: int,
    block_size: int,
    device: torch.device | str,
    backend: Backend,
    layer_types: list[str],
    sliding_window: int | None,
    context_valid_BS: torch.Tensor | None = None,
    context_start_BA: torch.Tensor | None = None,
) -> dict[str, TrainMask]:
    """{layer type: its TrainMask} for the types in layer_types (what DFlashDrafter.forward takes)."""
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer types {unknown} unknown; each layer is one of {LAYER_TYPES}")
    masks = {}
    for kind in LAYER_TYPES:
        if kind in layer_types:
            window = sliding_window if kind == "sliding_attention" else None
            if kind == "sliding_attention" and window is None:
                raise ValueError("sliding_attention layers need a sliding_window; set drafter.sliding_window")
            masks[kind] = build_train_mask(anchors_BA, valid_BA, seq_len, block_size, device, backend,
                                           context_valid_BS=context_valid_BS, window=window,
                                           context_start_BA=context_start_BA)
    return masks


def _context_lower_bound(anchor_BQ: torch.Tensor, block_size: int, window: int | None,
                         start_BQ: torch.Tensor | None = None) -> torch.Tensor | None:
    """First context position each query may see: in a sliding layer anchor + slot - window + 1, in a packed row its
    sequence's start, the later of the two when both; None when neither bounds it."""
    lo_BQ = start_BQ
    if window is not None:
        slot_Q = torch.arange(anchor_BQ.shape[1], device=anchor_BQ.device) % block_size
        lo_BQ = anchor_BQ + slot_Q - (window - 1) if lo_BQ is None else torch.maximum(lo_BQ, anchor_BQ + slot_Q - (window - 1))
    return lo_BQ


def _dense_mask(anchor_BA, context_valid_BS, seq_len, block_size, window=None, start_BA=None) -> torch.Tensor:
    B, A = anchor_BA.shape
    device = anchor_BA.device
    pos_S = torch.arange(seq_len, device=device)
    anchor_BQ = anchor_BA.repeat_interleave(block_size, dim=1)
    sees_context_BQS = (pos_S[None, None, :] < anchor_BQ[:, :, None]) & context_valid_BS[:, None, :]
    start_BQ = None if start_BA is None else start_BA.repeat_interleave(block_size, dim=1)
    lo_BQ = _context_lower_bound(anchor_BQ, block_size, window, start_BQ)
    if lo_BQ is not None:
        sees_context_BQS &= pos_S[None, None, :] >= lo_BQ[:, :, None]
    block_Q = torch.arange(A * block_size, device=device) // block_size
    own_block_QQ = block_Q[:, None] == block_Q[None, :]
    sees_block_BQQ = own_block_QQ.expand(B, -1, -1)
    return torch.cat([sees_context_BQS, sees_block_BQQ], dim=2)[:, None]


FLEX_TILE = 128  # flex attention's default BLOCK_SIZE: the mask is described per 128 x 128 tile


@dataclass
class FlexMask:
    """The flex backend's mask as tensors only: the BlockMask is assembled inside the compiled function.

    Every size that varies from batch to batch (rows, anchors, context length, tile counts) reaches the compiled
    code as a tensor size or a tensor value, never as a Python int: torch.compile guards Python ints by value (a
    mask_mod closing over the anchor count or the sequence length recompiled at every new value, and the
    BlockMask's int `seq_lengths` pinned the tile counts), so one graph serves every batch of a run. The ints
    left (block_size, window) are fixed for a run."""

    tiles: tuple  # kv_num [B,1,Qt], kv_idx [B,1,Qt,Kt], full kv pair, then the q-side pairs (backward): int32
    anchor_BA: torch.Tensor  # effective anchors, zero-padded to cover every padded query's block
    seq_len: torch.Tensor  # 0-dim int64: the context length S (keys >= S are block slots)
    context_valid_BK: torch.Tensor | None  # [B, padded kv] real-context keys, or None (every key before S is real)
    block_size: int
    window: int | None
    lengths: tuple[int, int]  # padded (q, kv) lengths: whole tiles
    start_BA: torch.Tensor | None = None  # a packed row: each anchor's sequence start (padded like anchor_BA)


def _padded_len(n: int) -> int:
    """n rounded up to whole tiles, and to 2 tiles at least: torch.compile specialises a size of 1, so a batch with
    one query or key tile would be a graph of its own (a few padded rows that no real query sees cost less)."""
    return max(2, -(-n // FLEX_TILE)) * FLEX_TILE


def _block_mask(anchor_BA, context_valid_BS, seq_len, block_size, device, window=None,
                padded_context=True, start_BA=None) -> FlexMask:
    """The flex mask built from tile-level facts with plain tensor ops (no compiled mask creation).

    padded_context=False (no context_valid given: every position is a token) drops the per-key context read
    from the mask_mod the kernels evaluate on every partial tile.

    create_block_mask(..., _compile=True) compiled the mask_mod for every new shape and its first call
    did not finish within 183 s at the 512 x 16 bench shape on an H200 (bench/results/h200_compile_probe.log);
    here the tile lists come from per-tile minima and maxima (`_tile_lists`), and the mask_mod is only
    evaluated inside the flex kernel, on the partial tiles.
    """
    B, A = anchor_BA.shape
    q_len, kv_len = A * block_size, seq_len + A * block_size
    padded = (_padded_len(q_len), _padded_len(kv_len))
    partial, full = _tile_lists(anchor_BA, context_valid_BS, seq_len, block_size, window, start_BA)
    q_side = (*_as_indices(partial.transpose(1, 2)), *_as_indices(full.transpose(1, 2)))
    tiles = (*_as_indices(partial), *_as_indices(full), *q_side)
    # A padded query (rows past q_len, up to the last tile's end) reads the anchor of block q // block_size:
    # zeros past the real anchors (an invalid anchor's view: no context), so no index needs a clamp.
    anchor_BA = F.pad(anchor_BA, (0, padded[0] // block_size + 1 - A))
    start_BA = None if start_BA is None else F.pad(start_BA, (0, padded[0] // block_size + 1 - A))
    valid_BK = F.pad(context_valid_BS, (0, padded[1] - seq_len)) if padded_context else None
    seq_len_t = torch.tensor(seq_len, dtype=torch.long).to(device, non_blocking=True)
    return FlexMask(tiles, anchor_BA, seq_len_t, valid_BK, block_size, window, padded, start_BA)


def _mask_mod(anchor_BA, seq_len, context_valid_BK, block_size: int, window: int | None, start_BA=None):
    """The DFlash mask_mod over tensors (see FlexMask): a query sees context before its anchor (and, sliding,
    inside its window; packed, from its sequence's start) and its own block's slots."""

    def dflash_mask_mod(b, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        anchor = anchor_BA[b, q_block]
        is_ctx = kv_idx < seq_len
        sees_ctx = is_ctx & (kv_idx < anchor)
        if context_valid_BK is not None:
            sees_ctx = sees_ctx & context_valid_BK[b, kv_idx]
        if window is not None:
            sees_ctx = sees_ctx & (kv_idx > anchor + q_idx % block_size - window)
        if start_BA is not None:
            sees_ctx = sees_ctx & (kv_idx >= start_BA[b, q_block])
        sees_own = (~is_ctx) & ((kv_idx - seq_len) // block_size == q_block)
        return sees_ctx | sees_own

    return dflash_mask_mod


def as_block_mask(m: FlexMask, q_len=None, kv_len=None) -> BlockMask:
    """The BlockMask m describes (inside a compiled function, q_len/kv_len are the inputs' symbolic lengths)."""
    q_len, kv_len = (m.lengths[0] if q_len is None else q_len), (m.lengths[1] if kv_len is None else kv_len)
    return BlockMask(seq_lengths=(q_len, kv_len), kv_num_blocks=m.tiles[0], kv_indices=m.tiles[1],
                     full_kv_num_blocks=m.tiles[2], full_kv_indices=m.tiles[3], q_num_blocks=m.tiles[4],
                     q_indices=m.tiles[5], full_q_num_blocks=m.tiles[6], full_q_indices=m.tiles[7],
                     BLOCK_SIZE=(FLEX_TILE, FLEX_TILE),
                     mask_mod=_mask_mod(m.anchor_BA, m.seq_len, m.context_valid_BK, m.block_size, m.window,
                                        m.start_BA))


def _tile_lists(anchor_BA, context_valid_BS, seq_len, block_size, window=None,
                start_BA=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) [B, Qt, Kt] booleans over 128 x 128 tiles: a tile with any visible pair is listed,
    as full only when every pair in it is visible (full tiles skip the mask_mod in the kernel).

    Context tiles: query q sees position p iff p < anchor(q) and p is not padding. Block tiles: a query
    sees its own block only, never a whole tile unless block_size covers it. Tiles that straddle the
    context end, or hold padded queries, are never full. With a window, query q also needs p >= lo(q)
    (see _context_lower_bound; so with a packed row's sequence starts): a context tile is listed when its valid span meets [min lo, max anchor)
    of the query tile (a superset of the tiles with a visible pair), full only when every p >= max lo.
    """
    T = FLEX_TILE
    B, A = anchor_BA.shape
    device = anchor_BA.device
    q_len, kv_len = A * block_size, seq_len + A * block_size
    Qt, Kt = _padded_len(q_len) // T, _padded_len(kv_len) // T
    anchor_BQ = anchor_BA.repeat_interleave(block_size, dim=1)
    padded_BQ = F.pad(anchor_BQ, (0, Qt * T - q_len))  # padded queries: anchor 0 (see nothing)
    amax_Bq = padded_BQ.view(B, Qt, T).amax(-1)
    amin_Bq = padded_BQ.view(B, Qt, T).amin(-1)  # a tile with padded queries has amin 0: never full
    start_BQ = None if start_BA is None else F.pad(start_BA.repeat_interleave(block_size, dim=1), (0, Qt * T - q_len))
    lo_BQ = _context_lower_bound(padded_BQ, block_size, window, start_BQ)
    partial = torch.zeros(B, Qt, Kt, dtype=torch.bool, device=device)
    full = torch.zeros_like(partial)
    # Context tiles lying wholly before seq_len.
    Kc = seq_len // T
    if Kc:
        pos = torch.arange(Kc * T, device=device)
        valid_BKc = context_valid_BS[:, :Kc * T].view(B, Kc, T)
        big = torch.iinfo(torch.long).max
        min_valid = torch.where(valid_BKc, pos.view(Kc, T), big).amin(-1)  # [B, Kc]
        all_valid = valid_BKc.all(-1)
        max_pos = pos.view(Kc, T)[:, -1]  # [Kc]
        any_ctx = min_valid[:, None, :] < amax_Bq[:, :, None]
        full_ctx = all_valid[:, None, :] & (max_pos[None, None, :] < amin_Bq[:, :, None])
        if lo_BQ is not None:
            max_valid = torch.where(valid_BKc, pos.view(Kc, T), -1).amax(-1)  # [B, Kc]
            lo_min_Bq, lo_max_Bq = lo_BQ.view(B, Qt, T).amin(-1), lo_BQ.view(B, Qt, T).amax(-1)
            min_pos = pos.view(Kc, T)[:, 0]  # [Kc]
            any_ctx &= max_valid[:, None, :] >= lo_min_Bq[:, :, None]
            full_ctx &= min_pos[None, None, :] >= lo_max_Bq[:, :, None]
        partial[:, :, :Kc] = any_ctx & ~full_ctx
        full[:, :, :Kc] = full_ctx
    if seq_len % T:  # the tile holding the context end and the first block slots: evaluated per element
        partial[:, :, Kc].fill_(True)  # not `= True`: a host scalar copied in waits for the GPU
    # Block tiles: kv slot j = kv - seq_len belongs to block j // block_size; query q to q // block_size.
    first = -(-seq_len // T)
    if first < Kt:
        kt = torch.arange(first, Kt, device=device)
        k_lo = (kt * T - seq_len) // block_size
        k_hi = (torch.clamp((kt + 1) * T, max=kv_len) - 1 - seq_len) // block_size
        qt = torch.arange(Qt, device=device)
        q_lo = qt * T // block_size
        q_hi = (torch.clamp((qt + 1) * T, max=q_len) - 1) // block_size
        overlap = (k_lo[None, :] <= q_hi[:, None]) & (q_lo[:, None] <= k_hi[None, :])
        partial[:, :, first:] = overlap[None]
    return partial, full


def _as_indices(tiles_BQK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Qt, Kt] booleans -> (counts [B, 1, Qt], listed tile indices first, ascending [B, 1, Qt, Kt]) as int32."""
    num = tiles_BQK.sum(-1, dtype=torch.int32)
    order = torch.argsort((~tiles_BQK).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[:, None].contiguous(), order[:, None].contiguous()  # one stride pattern (a transposed input's differ)


_compiled_flex: dict = {}
_compile_lock = threading.Lock()
FLEX_COMPILE_DEVICES = ("cuda",)  # where flex attention runs compiled; tests add "cpu"
COMPILE_BACKEND = "inductor"  # tests on the CPU use "aot_eager": torch 2.10's inductor has no CPU flex backward


def _flex(q_BhnTD, k_BknTD, v_BknTD, tiles, anchor_BA, seq_len, context_valid_BK, block_size, window,
          enable_gqa, start_BA=None):
    q, k, v = (t.flatten(2, 3) for t in (q_BhnTD, k_BknTD, v_BknTD))
    m = FlexMask(tiles, anchor_BA, seq_len, context_valid_BK, block_size, window, (0, 0), start_BA)
    return flex_attention(q, k, v, block_mask=as_block_mask(m, q.shape[2], k.shape[2]), enable_gqa=enable_gqa)


# Rows are handed in as (tiles, FLEX_TILE): compiled, the lengths n * 128 are multiples of the tile by
# construction even when n is a dynamic size, so the kernels skip every bounds check (inductor's IS_DIVISIBLE).
# With a plain dynamic length it cannot know that, and once a run had seen a second batch shape the backward
# kernel ran ~1.6x slower (H200, 1024 x 32 bench shape). One function per mask kind: torch.compile keeps its
# graphs per function, so the full and the sliding mask never evict each other's graphs or share a recompile limit.
def _flex_full(q_BhnTD, k_BknTD, v_BknTD, tiles, anchor_BA, seq_len, context_valid_BK, block_size, enable_gqa,
               start_BA=None):
    return _flex(q_BhnTD, k_BknTD, v_BknTD, tiles, anchor_BA, seq_len, context_valid_BK, block_size, None,
                 enable_gqa, start_BA)


def _flex_sliding(q_BhnTD, k_BknTD, v_BknTD, tiles, anchor_BA, seq_len, context_valid_BK, block_size, window,
                  enable_gqa, start_BA=None):
    return _flex(q_BhnTD, k_BknTD, v_BknTD, tiles, anchor_BA, seq_len, context_valid_BK, block_size, window,
                 enable_gqa, start_BA)


def compiled_on(device: torch.device) -> bool:
    """Whether training on `device` compiles flex attention and the drafter's layers (CUDA; tests add the CPU)."""
    return device.type in FLEX_COMPILE_DEVICES


def backend_for(device: torch.device) -> Backend:
    """The attention backend the trainer uses on `device`: compiled flex where it compiles, else SDPA's dense mask."""
    return "flex" if compiled_on(device) else "sdpa"


def _flex_for(device: torch.device, sliding: bool):
    """The flex function for a mask kind: compiled once per process on FLEX_COMPILE_DEVICES (fullgraph: a graph
    break would run flex eagerly), eager (unfused, materialising the scores) elsewhere."""
    fn = _flex_sliding if sliding else _flex_full
    if not compiled_on(device):
        return fn
    with _compile_lock:
        if fn not in _compiled_flex:
            _compiled_flex[fn] = torch.compile(fn, fullgraph=True, backend=COMPILE_BACKEND)
    return _compiled_flex[fn]


def _tiles(t_BhLD: torch.Tensor, padded_len: int) -> torch.Tensor:
    """[B, heads, L, D] zero-padded to padded_len rows and viewed as [B, heads, padded_len / 128, 128, D].

    Padded in the trainer's row layout ([B, L, heads, D] memory, as the projections write it), always, even by 0
    rows: every input is then a view of a fresh [B, padded_len, heads, D] tensor whatever its length (a view of the
    projection's output when no row was missing had other base strides, and torch.compile rebuilt the graph each
    time a batch switched between the two). flex's output, laid out like the query, is again rows, which o_proj
    reads as a view instead of a copy."""
    rows_BLhD = F.pad(t_BhLD.transpose(1, 2).contiguous(), (0, 0, 0, 0, 0, padded_len - t_BhLD.shape[2]))
    return rows_BLhD.transpose(1, 2).unflatten(2, (-1, FLEX_TILE))


def _dynamic_sizes(m: FlexMask, tiles: tuple) -> None:
    """Mark every size that varies with the batch dynamic from the first call: compiled once, not once per shape.
    (Sizes 0 and 1 stay specialised, dynamo's rule: a one-row batch or one query tile is its own graph.)"""
    for t in tiles:
        torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(t, 2)
    for t in m.tiles:  # [B, 1, tiles(, tiles)]
        for dim in [0, *range(2, t.dim())]:
            torch._dynamo.maybe_mark_dynamic(t, dim)
    for t in (m.anchor_BA, m.context_valid_BK, m.start_BA):
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(t, 1)


def attend(q_BHQD: torch.Tensor, k_BKLD: torch.Tensor, v_BKLD: torch.Tensor, mask: TrainMask) -> torch.Tensor:
    """Masked attention, q [B, Hq, Q, D] over k/v [B, Hkv, S+Q, D] (GQA when Hkv < Hq) -> [B, Hq, Q, D]."""
    return attend_padded(q_BHQD, k_BKLD, v_BKLD, mask)[:, :, : mask.q_len]


def attend_padded(q_BHQD: torch.Tensor, k_BKLD: torch.Tensor, v_BKLD: torch.Tensor, mask: TrainMask) -> torch.Tensor:
    """`attend` before its last query rows are cut: [B, Hq, Q', D] with Q' >= Q (flex: Q rounded up to whole tiles,
    laid out like the query; the rows past Q are padding). A caller that projects the output per row can project
    all Q' rows and cut after, reading flex's output as a view instead of copying its first Q rows."""
    assert q_BHQD.shape[2] == mask.q_len and k_BKLD.shape[2] == mask.kv_len, (
        q_BHQD.shape,
        k_BKLD.shape,
        mask.q_len,
        mask.kv_len,
    )
    gqa = q_BHQD.shape[1] != k_BKLD.shape[1]
    if mask.backend == "sdpa":
        return F.scaled_dot_product_attention(q_BHQD, k_BKLD, v_BKLD, attn_mask=mask.mask, enable_gqa=gqa)
    # The mask covers whole tiles (padded lengths): padded key rows are seen by no real query (the mask_mod's
    # own-block rule); padded query rows are cut by the caller (`attend`, or after o_proj), so their gradients
    # are zero.
    m = mask.mask
    q_len, kv_len = m.lengths
    tiles = (_tiles(q_BHQD, q_len), _tiles(k_BKLD, kv_len), _tiles(v_BKLD, kv_len))
    fn = _flex_for(q_BHQD.device, m.window is not None)
    if fn not in (_flex_full, _flex_sliding):  # compiled: one graph for every batch shape
        _dynamic_sizes(m, tiles)
    window = () if m.window is None else (m.window,)
    return fn(*tiles, m.tiles, m.anchor_BA, m.seq_len, m.context_valid_BK, m.block_size, *window, gqa, m.start_BA)
