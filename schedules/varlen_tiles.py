"""Attention work tiles of packed causal documents: (document chunk, head) with causal cost.

Built on the document-local chunk table (varlen_chunks): a forward tile is one
chunk of queries for one head; a backward tile is one chunk of keys for one
head. Costs are exact causal FLOP counts, computed on the device of cu_seqlens
with no host sync, so a scheduler can order tiles longest-first.
"""

from __future__ import annotations

import torch

from .varlen_chunks import build_varlen_chunks


def chunk_doc_start(cu_seqlens: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
    """Start token of the document of each chunk (padding rows: 0)."""
    cu = cu_seqlens.to(torch.int64)
    start = chunks[:, 0].to(torch.int64)
    doc = torch.searchsorted(cu[1:], start, right=True).clamp(max=cu.numel() - 2)
    return torch.where(chunks[:, 1] > 0, cu[doc], 0)


def causal_pairs(chunks: torch.Tensor, doc_start: torch.Tensor, backward: bool, doc_end: torch.Tensor | None = None):
    """Visible (query, key) pairs of each chunk (int64).

    Forward (queries in the chunk): row at document offset p sees p + 1 keys.
    Backward (keys in the chunk): key at offset p is seen by (len - p) queries.
    """
    off = chunks[:, 0].to(torch.int64) - doc_start
    n = chunks[:, 1].to(torch.int64)
    if not backward:
        # sum_{p=off}^{off+n-1} (p + 1)
        return n * off + n * (n + 1) // 2
    assert doc_end is not None
    length = doc_end - doc_start
    # sum_{p=off}^{off+n-1} (length - p)
    return n * (length - off) - n * (n - 1) // 2


def enumerate_tiles(cu_seqlens: torch.Tensor, total_tokens: int, heads: int, head_dim: int, tile: int = 128,
                    backward: bool = False) -> dict[str, torch.Tensor]:
    """All (chunk, head) tiles with their causal FLOPs; padding chunks have cost 0.

    Returns dict of 1-D tensors of length max_chunks * heads: start, length, head, flops.
    Forward FLOPs are 4*D per visible pair (S and P V); backward 10*D (S, dP, dV, dQ, dK).
    """
    chunks = build_varlen_chunks(cu_seqlens, total_tokens, tile)
    ds = chunk_doc_start(cu_seqlens, chunks)
    cu = cu_seqlens.to(torch.int64)
    doc = torch.searchsorted(cu[1:], chunks[:, 0].to(torch.int64), right=True).clamp(max=cu.numel() - 2)
    de = torch.where(chunks[:, 1] > 0, cu[doc + 1], 0)
    pairs = causal_pairs(chunks, ds, backward, de)
    per_pair = (10 if backward else 4) * head_dim
    nc = chunks.shape[0]
    rep = lambda t: t.repeat_interleave(heads)
    return {
        "start": rep(chunks[:, 0]),
        "length": rep(chunks[:, 1]),
        "head": torch.arange(heads, device=chunks.device, dtype=torch.int32).repeat(nc),
        "flops": rep(pairs * per_pair),
    }


def causal_flops(lengths, heads: int, head_dim: int, backward: bool = False) -> int:
    """Total causal attention FLOPs of a document mix (the FLOP floor's numerator)."""
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return pairs * heads * head_dim * (10 if backward else 4)


# ----------------------------------------------------------------------------------------------
# The persistent forward's tile order (flamia_cute.sm90.attention_fwd, FwdConfig.persistent), in Python
# ----------------------------------------------------------------------------------------------


# Short documents sharing a forward query tile (FwdConfig.short_pairs): each consumer warpgroup's 64
# query rows come from its own document, so two documents of at most this many tokens run as one
# 128-query tile. The diagonal V^T tile is one 128-column TMA box from the first document's column,
# so the first must fill exactly this many data_dt columns (its length rounded up to DT_DOC_ALIGN)
# for the second to start at column SHORT_PAIR_ROWS of the box.
SHORT_PAIR_ROWS = 64


# Pair short documents when the mean document length is at most this: packs whose documents mostly
# fit half a tile. The host knows the mean without a sync (tokens / documents); the pair builds are
# slightly slower where nothing pairs.
SHORT_PAIRS_MEAN_TOKENS = 96


def short_pairs_worth(total_tokens: int, num_docs: int) -> bool:
    """Whether a call's documents are short enough on average (mean length <= SHORT_PAIRS_MEAN_TOKENS)
    to build the short-pair kernels."""
    return num_docs > 0 and total_tokens <= SHORT_PAIRS_MEAN_TOKENS * num_docs


def short_pair_partner(lengths, a: int, dt_align: int = 32) -> int:
    """The length of document a + 1 when it shares document a's forward query tile, else 0:
    a is even (pairs (0, 1), (2, 3), ...: no scan over runs of short documents, so the kernel tests
    a document in O(1)), a's data_dt columns are exactly SHORT_PAIR_ROWS, a + 1 exists and holds at
    most SHORT_PAIR_ROWS tokens (flamia_cute.tile_scheduler.short_pair_len)."""
    if a % 2 or a + 1 >= len(lengths):
        return 0
    cols = -(-lengths[a] // dt_align) * dt_align
    n_b = lengths[a + 1]
    return n_b if cols == SHORT_PAIR_ROWS and n_b <= SHORT_PAIR_ROWS else 0


def chunk_table(lengths, tile: int = 128, short_pairs: bool = False) -> list[int]:
    """cum[d] = chunks of documents before d (len num_docs + 1): tile_scheduler.doc_chunk_cumsum's table;
    short_pairs: a document that shares its predecessor's tile counts 0 chunks."""
    cum = [0]
    for d, n in enumerate(lengths):
        c = (n + tile - 1) // tile
        if short_pairs and d % 2 and short_pair_partner(lengths, d - 1) > 0:
            c = 0
        cum.append(cum[-1] + c)
    return cum


# The most documents the forward ranks longest first (one per producer-warpgroup thread: a rank is
# a pass over all documents); with more, "longest_documents" keeps the given order.
LPT_MAX_DOCS = 128
TILE_ORDERS = ("documents", "longest_documents")


def lpt_document_order(lengths, tile: int = 128, short_pairs: bool = False) -> list[int]:
    """Documents by chunk count (chunk_table's), most first, ties in index order: document d's
    position is the number of documents with more chunks, or as many and a smaller index (the
    kernel's rank). More than LPT_MAX_DOCS documents: the given order."""
    if len(lengths) > LPT_MAX_DOCS:
        return list(range(len(lengths)))
    cum = chunk_table(lengths, tile, short_pairs=short_pairs)
    chunks = [cum[d + 1] - cum[d] for d in range(len(lengths))]
    return sorted(range(len(lengths)), key=lambda d: (-chunks[d], d))


def persistent_order(lengths, heads: int, tile: int = 128, order: str = "documents",
                     short_pairs: bool = False) -> list[tuple[int, int, int]]:
    """(document, head, query block) of every tile in the order the persistent CTAs take them:
    documents in order, then heads, then the document's blocks from the last (the longest causal
    row) to the first. order="longest_documents": the documents by chunk count, most first
    (lpt_document_order), then as "documents". short_pairs: a document sharing its predecessor's tile
    (short_pair_partner) has no tile of its own; its predecessor's tile (d, h, 0) runs both."""
    if order not in TILE_ORDERS:
        raise ValueError(f"order must be one of {TILE_ORDERS}, got {order!r}")
    cum = chunk_table(lengths, tile, short_pairs=short_pairs)
    blocks = [list(reversed(range(cum[d + 1] - cum[d]))) for d in range(len(lengths))]
    docs = lpt_document_order(lengths, tile, short_pairs) if order == "longest_documents" else range(len(lengths))
    return [(d, h, b) for d in docs for h in range(heads) for b in blocks[d]]


def _last_doc_at_or_before(t: int, cum_at, num_docs: int, heads: int) -> int:
    lo, hi = 0, num_docs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if heads * cum_at(mid) <= t:
            lo = mid
        else:
            hi = mid
    return lo


def locate_tile_model(t: int, cum: list[int], heads: int) -> tuple[int, int, int]:
    """Tile t -> (document, head, block) by the binary search of tile_scheduler.locate_tile."""
    d = _last_doc_at_or_before(t, lambda i: cum[i], len(cum) - 1, heads)
    nblk = cum[d + 1] - cum[d]
    local = t - heads * cum[d]
    head = local // nblk
    return d, head, nblk - 1 - (local - head * nblk)


# ----------------------------------------------------------------------------------------------
# Cross-length and non-causal forward tiles (FwdConfig.cross_length, FwdConfig.causal=False)
# ----------------------------------------------------------------------------------------------
# Document b has Lq queries (cu_seqlens_q) and Lk keys (cu_seqlens_k). Causal: query i sits at key
# position p = i + Lk - Lq (the queries are the last Lq positions of the keys). The query tiles are
# 128-position blocks of the KEY axis: tile j holds the queries at positions 128 j .. 128 j + 127,
# so its last key tile is tile j, masked exactly as self-attention's diagonal tile, every earlier
# key tile is wholly visible, and every row of the tile has its own position in key block j: the
# per-token K/V copies serve tile j alone and every other tile reads the block scales (the diagonal
# safeguard unchanged). Rows outside the document's queries (the partial first and last tiles) are
# computed on whatever TMA brings and never stored. Queries at negative positions (Lq > Lk) see no
# key: their tiles (j < 0) run one key tile with every key masked (O = 0, LSE = -inf).
# Non-causal: query tiles of 128 queries from the document's first; every key tile, the last
# (processed first, the emulator's order) masked at the document's end, none per-token.
# These functions are plain integer math over Python or DSL integers (select: a 3-way choice that
# works on both); the kernel calls them while tracing, the CPU tests replay them.


def py_select(cond, a, b):
    return a if cond else b


def floor_tiles(x, select=py_select):
    """floor(x / 128) of any integer x, from shifts of non-negative values only (no signed division
    in the kernel)."""
    return select(x >= 0, x >> 7, -((127 - x) >> 7))


def cross_query_tiles(len_q, len_k, causal: bool, select=py_select):
    """Query tiles of one document. Causal: the 128-position blocks of the key axis that the query
    positions [Lk - Lq, Lk) meet, ceil(Lk / 128) - floor((Lk - Lq) / 128) (0 without queries).
    Non-causal: ceil(Lq / 128)."""
    if not causal:
        return (len_q + 127) >> 7
    n = ((len_k + 127) >> 7) - floor_tiles(len_k - len_q, select)
    return select(len_q > 0, n, 0 * n)


def cross_tile(q_start, q_end, k_start, k_end, block, causal: bool, select=py_select):
    """Query tile `block` (0 .. cross_query_tiles - 1, the last one the longest) of a document whose
    queries are rows q_start .. q_end - 1 and keys k_start .. k_end - 1, as the kernel's
    self-attention code paths take it: (m_block, q_base, q_lo, q_hi, k_len).

    m_block: the key tile processed first (the masked one; key tiles m_block .. 0 run). A tile row r
    (0 .. 127) has the tile coordinate 128 m_block + r: its query row is q_base + that, stored when
    q_lo <= it < q_hi. k_len: the keys the document has for this tile (0: every key masked)."""
    len_q, len_k = q_end - q_start, k_end - k_start
    if causal:
        off = len_k - len_q  # the key position of the document's first query
        j = block + floor_tiles(off, select)  # the 128-position block of this tile's rows
        m_block = select(j > 0, j, 0 * j)
        q_base = q_start - off + 128 * (j - m_block)
        k_len = select(j >= 0, len_k, 0 * len_k)
    else:
        last = ((len_k + 127) >> 7) - 1
        m_block = select(last > 0, last, 0 * last)
        q_base = q_start + 128 * (block - m_block)
        k_len = len_k
    return m_block, q_base, q_start - q_base, q_end - q_base, k_len


def cross_tiles_model(cu_q, cu_k, causal: bool, heads: int = 1):
    """(document, head, block, cross_tile(...)) of every query tile, documents in order, then heads,
    then blocks from the last (the persistent forward's "documents" order)."""
    out = []
    for d in range(len(cu_q) - 1):
        n = cross_query_tiles(cu_q[d + 1] - cu_q[d], cu_k[d + 1] - cu_k[d], causal)
        for h in range(heads):
            for b in reversed(range(n)):
                out.append((d, h, b, cross_tile(cu_q[d], cu_q[d + 1], cu_k[d], cu_k[d + 1], b, causal)))
    return out


def cross_chunk_table(lengths_q, lengths_k, causal: bool) -> list[int]:
    """chunk_table of the cross-length forward: cum[d] = query tiles of documents before d."""
    cum = [0]
    for lq, lk in zip(lengths_q, lengths_k, strict=True):
        cum.append(cum[-1] + cross_query_tiles(lq, lk, causal))
    return cum


# The backward of the same modes (BwdDsBf16Config.cross_length, causal=False): one CTA per (KV head, document,
# 128-key block n of the key document). Causal: 64-query tiles are 64-position blocks of the key axis (tile m:
# positions 64 m .. 64 m + 63), so tiles 2n and 2n + 1 are key block n's diagonal (masked, per-token K/V: every
# row's own block is n) and tiles from 2n + 2 see the whole block (block scales), self-attention's structure;
# tiles before the first query (m < m_lo) are skipped, so a key block wholly before every query has no diagonal
# tile (n_diag = 0). Queries at negative positions see no key and are in no tile. Non-causal: 64-query tiles
# from the document's first query, every tile seen by every key block; the last key block's tiles are masked at
# the document's end (its "diagonal" tiles), the others' not. dO^T's tile m starts at column dot_start + 64 (m -
# m_lo) of the document's dO^T columns (backward_dot_columns).


def backward_cross_item(q_start, q_end, k_start, k_end, n_blk, causal: bool, select=py_select):
    """Key block n_blk of a document with queries q_start .. q_end - 1 and keys k_start .. k_end - 1:
    (live, q_base, q_lo, q_hi, m_lo, d0, n_diag, p0, per). Tile row r of query tile m has the coordinate
    64 m + r: its query row is q_base + that, a query when q_lo <= it < q_hi (else P = 0 there). The masked
    tiles are d0 .. d0 + n_diag - 1, the unmasked ones p0 .. p0 + per - 1 (per <= 0: none); m_lo is the first
    query tile (its dO^T columns start the document's). live: the CTA has work (a query and key block n)."""
    len_q, len_k = q_end - q_start, k_end - k_start
    live = (len_q > 0) & (128 * n_blk < len_k)
    if causal:
        off = len_k - len_q
        q_base = q_start - off
        m_lo = select(off > 0, off >> 6, 0 * off)  # the first tile holding a query
        n_q = (len_k + 63) >> 6  # tiles 0 .. n_q - 1 cover the key positions
        d0 = select(2 * n_blk > m_lo, 2 * n_blk, m_lo)
        d_end = select(2 * n_blk + 2 < n_q, 2 * n_blk + 2, n_q)
        n_diag = select(d_end > d0, d_end - d0, 0 * d0)
        p0 = select(2 * n_blk + 2 > m_lo, 2 * n_blk + 2, m_lo)
        per = n_q - p0
    else:
        q_base = q_start
        m_lo = 0 * q_start
        n_q = (len_q + 63) >> 6
        last = 128 * n_blk + 128 >= len_k  # the block the document's keys end in: masked
        d0 = 0 * q_start
        n_diag = select(last, n_q, 0 * n_q)
        p0 = 0 * q_start
        per = select(last, 0 * n_q, n_q)
    return live, q_base, q_start - q_base, q_end - q_base, m_lo, d0, n_diag, p0, per


def backward_tile_rows(lengths_q, lengths_k, causal: bool):
    """The backward's per-document dO^T column counts of the separate-keys modes: causal, the key positions
    from the first query tile's (64 m_lo) to Lk (0 without queries); non-causal, the queries (quant's
    dt_cu_seqlens layout). backward_dot_columns rounds each up to DT_DOC_ALIGN."""
    out = []
    for lq, lk in zip(lengths_q, lengths_k, strict=True):
        if not causal or lq == 0:
            out.append(lq)
        else:
            off = lk - lq
            out.append(lk - 64 * max(off >> 6, 0) if off > 0 else lk)
    return out
