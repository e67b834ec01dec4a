"""Tile scheduling of the attention kernels: which CTA runs which (document, head, block), as device
code. Scheduling only: no attention math here.

- The persistent sm_90a forward: per-document chunk tables in shared memory (doc_chunk_cumsum, and
  rank_documents_longest_first for the "longest_documents" order), tile t -> (document, head, query
  block) (locate_tile, tile_at; schedules.varlen_tiles' locate_tile_model is its CPU twin), the
  global tile counter (claim_next_tile) and the shared-memory ring through which the TMA warp hands
  each tile to the other roles (publish_tile / read_tile, for_each_published_tile).
- Short pairs (forward and backward): two short documents in one 128-row tile (short_pair_len, the
  partner lookup; short_pair_follower, the second document whose own tile or CTA has nothing to do).
- The sm_90a backward's grid: backward_grid (host, trace time) and backward_work_item (in the kernel),
  its CTA -> (KV head, document, key block) map.
- The sm_100a MX quantizations reuse doc_chunk_cumsum and last_doc_at_or_before for their tile slots.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Boolean, Int32

from .quant import quantize as _quant_layout
from .schedules.varlen_tiles import SHORT_PAIR_ROWS, cross_query_tiles
from .sm90.primitives import group_scan_up, select, select_i32

# The persistent forward's tile hand-off ring depth: the next tile is published while this one runs
SCHED_STAGES = 2


@cute.jit
def doc_chunk_cumsum(mCu: cute.Tensor, num_docs, sCum: cute.Tensor, sDt: cute.Tensor, sWarp: cute.Tensor, tid,
                     threads: cutlass.Constexpr, barrier_id: cutlass.Constexpr, tile: cutlass.Constexpr, sPair=None,
                     mCuK=None, causal: cutlass.Constexpr = True):
    """Per-document tables in shared memory, for d in 0..num_docs: sCum[d] = sum over documents
    b < d of ceil(len_b / tile) (chunks), sDt[d] = document d's first data_dt column (the same sum
    of lengths rounded up to DT_DOC_ALIGN: quant.dt_cu_seqlens; sDt None: chunks only).

    Run by `threads` threads (tid in 0..threads-1, whole warps) that meet at named barrier
    `barrier_id`; the caller syncs before anyone reads the tables. Thread t owns documents
    [t*k, t*k + k): a serial sum, a warp scan (shfl.up), the warp totals through sWarp (a row of
    2 per warp).
    sPair (the forward's short pairs): sPair[d] = short_pair_len(d) (the length of document d + 1 when
    it shares d's query tile, else 0), and such a document d + 1 counts 0 chunks.
    mCuK (the cross-length and non-causal forward): mCu holds the query documents and mCuK the key
    documents; chunks are schedules.varlen_tiles.cross_query_tiles, columns the key documents'.
    """
    short_pairs = sPair is not None
    k = (num_docs + threads - 1) // threads
    d0 = tid * k
    my_c = Int32(0)
    my_p = Int32(0)
    for i in cutlass.range(k, unroll=1):
        b = d0 + i
        if b < num_docs:
            c, p = _doc_chunks_and_columns(mCu, b, tile, num_docs, short_pairs, mCuK, causal)
            my_c = my_c + c
            my_p = my_p + p
    run_c, run_p = group_scan_up(tid, sWarp, threads, barrier_id, True, my_c, my_p)
    if tid == 0:
        sCum[0] = Int32(0)
        if cutlass.const_expr(sDt is not None):
            sDt[0] = Int32(0)
    for i in cutlass.range(k, unroll=1):
        b = d0 + i
        if b < num_docs:
            c, p = _doc_chunks_and_columns(mCu, b, tile, num_docs, short_pairs, mCuK, causal)
            run_c = run_c + c
            run_p = run_p + p
            sCum[b + 1] = run_c
            if cutlass.const_expr(sDt is not None):
                sDt[b + 1] = run_p
            if cutlass.const_expr(short_pairs):
                sPair[b] = short_pair_len(mCu, b, num_docs)


@cute.jit
def _doc_chunks_and_columns(mCu: cute.Tensor, b, tile: cutlass.Constexpr, num_docs=None,
                            short_pairs: cutlass.Constexpr = False, mCuK=None, causal: cutlass.Constexpr = True):
    """Document b's chunks of `tile` tokens and its data_dt columns (length rounded up to DT_DOC_ALIGN);
    short_pairs: 0 chunks when b shares its predecessor's tile; mCuK: the cross-length forward's query
    tiles (cross_query_tiles) and the key document's columns."""
    align = _quant_layout.DT_DOC_ALIGN
    n = mCu[b + 1] - mCu[b]
    if cutlass.const_expr(mCuK is not None):
        n_k = mCuK[b + 1] - mCuK[b]
        c = cross_query_tiles(n, n_k, causal, select_i32)
        n = n_k
    else:
        c = (n + (tile - 1)) // tile
    if cutlass.const_expr(short_pairs):
        if short_pair_follower(mCu, b, num_docs):
            c = Int32(0)
    return c, (n + (align - 1)) & -align


@cute.jit
def short_pair_len(mCu: cute.Tensor, a, num_docs):
    """The length of document a + 1 when it shares document a's query tile (schedules.varlen_tiles.
    short_pair_partner: a even, a's data_dt columns exactly SHORT_PAIR_ROWS, a + 1 holding 1 to
    SHORT_PAIR_ROWS tokens), else 0."""
    align = _quant_layout.DT_DOC_ALIGN
    rows = SHORT_PAIR_ROWS
    got = Int32(0)
    if a % 2 == 0:
        if a + 1 < num_docs:
            n_a = mCu[a + 1] - mCu[a]
            n_b = mCu[a + 2] - mCu[a + 1]
            if ((n_a + (align - 1)) & -align) == rows:
                if n_b <= rows:
                    got = n_b
    return got


@cute.jit
def short_pair_follower(mCu: cute.Tensor, b, num_docs):
    """Whether document b is a short pair's second (short_pair_len of b - 1 > 0): its predecessor's
    query tile (forward) or CTA (backward) runs it, so b's own has nothing to do."""
    follows = Boolean(False)
    if b % 2 == 1:
        if short_pair_len(mCu, b - 1, num_docs) > 0:
            follows = Boolean(True)
    return follows


@cute.jit
def rank_documents_longest_first(sCum: cute.Tensor, num_docs, sOrder: cute.Tensor, sLpt: cute.Tensor,
                                 sWarp: cute.Tensor, tid, threads: cutlass.Constexpr, barrier_id: cutlass.Constexpr):
    """LPT across documents from doc_chunk_cumsum's sCum (the caller syncs the threads between):
    sOrder[p] = the document at position p of the order by chunk count, most first, ties by index
    (schedules' lpt_document_order), sLpt[p] = the chunks of positions < p, for p in 0..num_docs.
    With more than `threads` documents, the given order (sOrder[p] = p, sLpt = sCum).

    Thread t ranks document t: the documents with more chunks, or as many and a smaller index, a
    pass over sCum (broadcast reads); then a scan over positions as doc_chunk_cumsum's (sWarp: a
    row per warp, column 0)."""
    if num_docs > threads:
        for i in cutlass.range((num_docs + threads) // threads, unroll=1):
            p = tid + i * threads
            if p <= num_docs:
                sLpt[p] = sCum[p]
                if p < num_docs:
                    sOrder[p] = p
    else:
        if tid < num_docs:
            c = sCum[tid + 1] - sCum[tid]
            rank = Int32(0)
            for j in cutlass.range(num_docs, unroll=1):
                cj = sCum[j + 1] - sCum[j]
                ahead = select(cj > c, Int32(1), select(cj == c, select(j < tid, Int32(1), Int32(0)), Int32(0)))
                rank = rank + ahead
            sOrder[rank] = tid
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
        c = Int32(0)
        if tid < num_docs:
            d = sOrder[tid]
            c = sCum[d + 1] - sCum[d]
        (run,) = group_scan_up(tid, sWarp, threads, barrier_id, False, c)
        if tid == 0:
            sLpt[0] = Int32(0)
        if tid < num_docs:
            sLpt[tid + 1] = run


@cute.jit
def last_doc_at_or_before(t, cum_at, num_docs, heads):
    """The last document d with heads * cum_at(d) <= t (binary search; empty documents, whose ranges
    are empty, are passed over)."""
    lo = Int32(0)
    hi = Int32(num_docs)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if heads * cum_at(mid) <= t:
            lo = mid
        else:
            hi = mid
    return lo


@cute.jit
def locate_tile(t, sCum: cute.Tensor, num_docs, heads):
    """Tile t of the persistent order -> (document, head, block): documents in order, the heads of a
    document next (a GQA group's query heads together, so its K/V stay in L2), then the document's
    query blocks from the last (longest causal row) to the first. sCum: doc_chunk_cumsum's table."""
    doc = last_doc_at_or_before(t, lambda i: sCum[i], num_docs, heads)
    nblk = sCum[doc + 1] - sCum[doc]
    local = t - heads * sCum[doc]
    head = local // nblk
    block = nblk - 1 - (local - head * nblk)
    return doc, head, block


@cute.jit
def publish_tile(pipe_t, sSched, t_state, m_block, head, doc, bounds=None):
    """Persistent kernels' TMA warp: hand the next tile (m_block -1: no more) to the other roles,
    with bounds = (document start, length) when given (rows 3 and 4: the readers then load nothing
    from cu_seqlens). Every lane stores the same words and arrives (its own stores are then released)."""
    pipe_t.producer_acquire(t_state)
    sSched[0, t_state.index] = m_block
    sSched[1, t_state.index] = head
    sSched[2, t_state.index] = doc
    if cutlass.const_expr(bounds is not None):
        for i, word in enumerate(bounds):  # start, length (and a short pair's second length)
            sSched[3 + i, t_state.index] = word
    pipe_t.producer_commit(t_state)
    t_state.advance()
    return t_state


@cute.jit
def read_tile(pipe_t, sSched, t_state, bounds: cutlass.Constexpr = False):
    """The other roles' side of publish_tile: (block, head, doc, next state), or with bounds
    (block, head, doc, document start, length, next state); bounds=3: also the third bounds word
    (block, head, doc, start, length, pair length, next state)."""
    pipe_t.consumer_wait(t_state)
    m_block = sSched[0, t_state.index]
    head = sSched[1, t_state.index]
    doc = sSched[2, t_state.index]
    n_bounds = 0 if not bounds else (2 if bounds is True else bounds)
    extra = tuple(sSched[3 + i, t_state.index] for i in range(n_bounds))
    pipe_t.consumer_release(t_state)
    t_state.advance()
    return (m_block, head, doc, *extra, t_state)


@cute.jit
def claim_next_tile(mCounter: cute.Tensor):
    """Persistent kernels' TMA warp (all 32 lanes): the next tile index, grid size + the counter's
    old value (lane 0 adds 1 to mCounter[0], which the host zeroes per launch; the first tile of a
    CTA is its block index)."""
    return finish_tile_claim(issue_tile_claim(mCounter))


@cute.jit
def issue_tile_claim(mCounter: cute.Tensor):
    """claim_next_tile's first half: lane 0's atomic, its old value not yet read (the round trip
    runs under whatever the warp does before finish_tile_claim)."""
    got = Int32(0)
    if cute.arch.lane_idx() == 0:
        got = cute.arch.atomic_add(mCounter.iterator, Int32(1))
    return got


@cute.jit
def finish_tile_claim(got):
    """claim_next_tile's second half: the claimed tile index in every lane."""
    grid, _, _ = cute.arch.grid_dim()
    return grid + cute.arch.shuffle_sync(got, 0)


@cute.jit
def tile_at(t, sCum, num_docs, heads, lpt_tables):
    """Tile t of the persistent forward's order (locate_tile; lpt_tables = (sOrder, sLpt): the
    "longest_documents" order, locate_tile over the ranked positions): (doc, head, block)."""
    if cutlass.const_expr(lpt_tables is None):
        doc, head, m_block = locate_tile(t, sCum, num_docs, heads)
    else:
        position, head, m_block = locate_tile(t, lpt_tables[1], num_docs, heads)
        doc = lpt_tables[0][position]
    return doc, head, m_block


@cute.jit
def for_each_published_tile(pipe_t, sSched, state, step, short_pairs: cutlass.Constexpr):
    """A persistent role's loop over the tiles the TMA warp publishes, until its end mark: state =
    step(state, head, doc_start, doc_len, m_block) per tile, with short_pairs also the pair length
    (step runs while tracing: inlined). Returns the last state."""
    t_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, SCHED_STAGES)
    if cutlass.const_expr(short_pairs):
        m_block, head, doc, start, length, pair_len, t_state = read_tile(pipe_t, sSched, t_state, 3)
        while m_block >= 0:
            state = step(state, head, start, length, m_block, pair_len)
            m_block, head, doc, start, length, pair_len, t_state = read_tile(pipe_t, sSched, t_state, 3)
    else:
        m_block, head, doc, start, length, t_state = read_tile(pipe_t, sSched, t_state, True)
        while m_block >= 0:
            state = step(state, head, start, length, m_block)
            m_block, head, doc, start, length, t_state = read_tile(pipe_t, sSched, t_state, True)
    return state


@cute.jit
def for_each_published_cross_tile(pipe_t, sSched, state, step):
    """for_each_published_tile of the separate-keys forward, whose ring carries the five
    cross_tile_bounds words: state = step(state, head, m_block, bounds) per tile."""
    t_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, SCHED_STAGES)
    m_block, head, doc, q_base, q_lo, q_hi, k_start, k_len, t_state = read_tile(pipe_t, sSched, t_state, 5)
    while m_block >= 0:
        state = step(state, head, m_block, (q_base, q_lo, q_hi, k_start, k_len))
        m_block, head, doc, q_base, q_lo, q_hi, k_start, k_len, t_state = read_tile(pipe_t, sSched, t_state, 5)
    return state


def backward_grid(raster: str, num_kv_heads, num_docs, max_n_blocks, head_window: int = 1) -> list:
    """Launch grid (x fastest) of a backward kernel's CTA order: "heads" runs the KV head fastest and
    the key block slowest (key block 0, the most query tiles, of every head and document first);
    "blocks" runs the key block fastest (the CTAs of one (document, KV head) together, sharing its Q,
    dO and dQ accumulator in L2). head_window W > 1 ("blocks" only): documents in order, and in each
    the KV heads in windows of W, a window's key blocks in order with its W heads fastest, so each
    window's CTAs start longest first (its block 0 of every head, then block 1, ...) and a long CTA
    cannot be the last one issued (W = 1 is the plain "blocks" order). Trace time: `raster` and
    `head_window` are config values; num_kv_heads % head_window == 0 (the host checks it)."""
    if raster == "blocks":
        if head_window == 1:  # apart from the general form: the plain order keeps its simpler index math
            return [max_n_blocks, num_kv_heads, num_docs]
        return [max_n_blocks * head_window, num_kv_heads // head_window, num_docs]
    return [num_kv_heads, num_docs, max_n_blocks]


def backward_work_item(raster: str, block_idx, head_window: int = 1) -> tuple:
    """(KV head, document, key block) of this CTA under backward_grid(raster, ..., head_window): plain
    integer math over Python or DSL integers (the CPU tests replay it)."""
    x, y, z = block_idx
    if raster == "blocks":
        if head_window == 1:  # the plain order without the window's index math
            return y, z, x
        return y * head_window + x % head_window, z, x // head_window
    return x, y, z
