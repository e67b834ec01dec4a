"""Varlen tensor views of the packed documents, shared by the sm_90a kernels (and the sm_100a forward).

Packed THD tensors span every document: token-major operands (Q, K, dO, O, the gradients) are
(T, D, heads) with the document's tokens at rows cu_seqlens[doc] ..; per-token scales and LSE are
(T, heads). The transposed copies (V^T, dO^T: [d, column], tokens contiguous, P-fragment key order)
give document doc the columns from dt_cu_seqlens[doc], its start rounded up to DT_DOC_ALIGN
(quant.quantize): a TMA box on the contiguous axis must start 16-byte aligned, so the kernels sum
those starts from cu_seqlens themselves (document_dt_start) instead of reading a host table.

A kernel's TMA tiles of one document are the packed tensor with the token coordinate shifted by the
document start (document_tiles); rows or keys past the document end are masked (mask.py) or not
stored, never clipped here.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .quant import quantize as _quant_layout
from .schedules.varlen_tiles import SHORT_PAIR_ROWS, cross_query_tiles, cross_tile
from .sm90.primitives import select_i32


@cute.jit
def document_bounds(mCu: cute.Tensor, doc):
    """(first token, length) of document doc from cu_seqlens."""
    doc_start = mCu[doc]
    return doc_start, mCu[doc + 1] - doc_start


@cute.jit
def cross_tile_bounds(mCu: cute.Tensor, mCuK: cute.Tensor, doc, block, causal: cutlass.Constexpr):
    """Query tile `block` of document doc in the cross-length (causal) or non-causal forward
    (schedules.varlen_tiles.cross_tile, whose CPU twin the tests replay): (m_block, (q_base, q_lo, q_hi,
    k_start, k_len)), the bounds words the persistent ring carries."""
    q_start, q_end = mCu[doc], mCu[doc + 1]
    k_start, k_end = mCuK[doc], mCuK[doc + 1]
    m_block, q_base, q_lo, q_hi, k_len = cross_tile(q_start, q_end, k_start, k_end, block, causal, select_i32)
    return m_block, (q_base, q_lo, q_hi, k_start, k_len)


@cute.jit
def cross_document_tiles(mCu: cute.Tensor, mCuK: cute.Tensor, doc, causal: cutlass.Constexpr):
    """Query tiles of document doc in the cross-length or non-causal forward (cross_query_tiles)."""
    return cross_query_tiles(mCu[doc + 1] - mCu[doc], mCuK[doc + 1] - mCuK[doc], causal, select_i32)


def document_tiles(atom, t, head, s, tile, offset, token_mode: int):
    """TMA partition (smem, gmem) of head `head`'s tiles of one document along the token mode (0 for
    token-major [t, d], 1 for the transposed [d, t]): the packed tensor t shifted by the document's
    first token (row) or column `offset`, tiled by `tile`; gmem tile i is the document's i-th."""
    if token_mode == 0:
        g = cute.local_tile(cute.domain_offset((offset, 0), t[None, None, head]), tile, (None, 0))
    else:
        g = cute.local_tile(cute.domain_offset((0, offset), t[None, None, head]), tile, (0, None))
    return cute.nvgpu.cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                                            cute.group_modes(g, 0, 2))


@cute.jit
def document_dt_start(mCu: cute.Tensor, doc, unroll: cutlass.Constexpr = 1):
    """Document `doc`'s first data_dt column (= quant.dt_cu_seqlens(cu)[doc], so the host builds no
    table), computed by one warp (document_aligned_starts with DT_DOC_ALIGN)."""
    return document_aligned_starts(mCu, doc, (_quant_layout.DT_DOC_ALIGN,), unroll)[0]


@cute.jit
def document_aligned_starts(mCu: cute.Tensor, doc, aligns: cutlass.Constexpr, unroll: cutlass.Constexpr = 1):
    """For each power of two a in `aligns`: the sum of the earlier documents' lengths rounded up to a
    (DT_DOC_ALIGN: document `doc`'s first data_dt column; 128: 128 x its first MX scale chunk slot,
    quant.mx_layout.sf_tile_starts), all from one pass over cu_seqlens by one warp: lane l adds
    documents l, l + 32, ... (L2-resident loads), a butterfly sum gives every lane the totals.
    unroll: 32-document rounds whose loads go out together (one round trip per round at 1)."""
    lane = cute.arch.lane_idx()
    sums = tuple(Int32(0) for _ in aligns)
    for it in cutlass.range((doc + 31) // 32, unroll=unroll):
        b = lane + 32 * it
        if b < doc:
            n = mCu[b + 1] - mCu[b]
            sums = tuple(acc + ((n + (a - 1)) & -a) for acc, a in zip(sums, aligns, strict=True))
    for sh in cutlass.range_constexpr(5):
        sums = tuple(acc + cute.arch.shuffle_sync_bfly(acc, offset=16 >> sh) for acc in sums)
    return sums


@cute.jit
def short_pair_bounds(doc_start, doc_len, pair_len):
    """(start, length) of a 128-row block's second 64 rows or keys: with pair_len > 0 (a short pair,
    short_pair_len) the second document, which starts where the first ends, shifted SHORT_PAIR_ROWS
    back so that row or key 64 + j is its token j; else the block's own document's."""
    start = doc_start
    length = doc_len
    if pair_len > 0:
        start = doc_start + doc_len - SHORT_PAIR_ROWS
        length = SHORT_PAIR_ROWS + pair_len
    return start, length
