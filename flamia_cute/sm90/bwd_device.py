"""Device helpers of the sm_90a backward kernel (sm90/attention_bwd.py): the per-query vectors,
the key rows' scales and bf16 epilogue, and the deterministic mode's turn counters for the dQ warp's
reduce-adds, with the PTX memory-ordering primitives they use.

Plain functions over DSL values, traced into the kernel that calls them (the kernel lists this file in
its compile-cache sources).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64, Uint32

from ..softmax import lse_log2_up
from .primitives import cvt_bf16x2, ptx, quad_transpose4, st_global_v4


def ld_acquire_gpu_u32(addr):
    """Load with acquire semantics at GPU scope (the semaphore read of deterministic dQ)."""
    return ptx("ld.acquire.gpu.global.u32 $0, [$1];", "=r,l,~{memory}", [Int64(addr)], side_effects=True)


def red_release_gpu_add_u32(addr, x):
    """Atomic add with release semantics at GPU scope (hands the next key block its turn)."""
    ptx("red.release.gpu.global.add.u32 [$0], $1;", "l,r,~{memory}", [Int64(addr), Uint32(x)], result=None,
        side_effects=True)


def fence_acq_rel_gpu():
    ptx("fence.acq_rel.gpu;", "~{memory}", [], result=None, side_effects=True)


def nanosleep(ns: int):
    ptx("nanosleep.u32 $0;", "r,~{memory}", [Uint32(ns)], result=None, side_effects=True)


def fence_proxy_async_global():
    """Orders this thread's generic-proxy accesses of global memory with its async-proxy ones (TMA):
    a TMA reduce-add after an acquire sees what the release published, and a TMA store's completed
    writes are ordered before a later release."""
    ptx("fence.proxy.async.global;", "~{memory}", [], result=None, side_effects=True)


@cute.jit
def store_query_vectors(sVec, col, st, q, doc_start, doc_len, hq, mSQ, mLSE, mDelta, mSdO, scale_log2, q_lo=None):
    """Column `col` of a query tile's vectors in stage st of sVec (query q of the document, head hq):
    0 sq * softmax_scale * log2e, 1 lse * log2e rounded up (softmax.lse_log2_up: P <= 1 at any
    magnitude; +inf past the document end: P = 0 there), 2 D = rowsum(dO * O), 3 the dO scale (0 past
    the end), 4 sq. Returns the dO scale. q_lo (separate keys): rows below it are no query either (the
    tile's rows before the document's first query)."""
    a_ = Float32(0.0)
    b_ = Float32.inf
    d_ = Float32(0.0)
    w_ = Float32(0.0)
    s_ = Float32(0.0)
    valid = q < doc_len
    if cutlass.const_expr(q_lo is not None):
        valid = valid & (q >= q_lo)
    if valid:
        s_ = mSQ[doc_start + q, hq]
        a_ = s_ * scale_log2
        b_ = lse_log2_up(mLSE[doc_start + q, hq])
        d_ = mDelta[doc_start + q, hq]
        w_ = mSdO[doc_start + q, hq]
    sVec[col, 0, st] = a_
    sVec[col, 1, st] = b_
    sVec[col, 2, st] = d_
    sVec[col, 3, st] = w_
    sVec[col, 4, st] = s_
    return w_


@cute.jit
def load_row_scales(rsc, krow, mSK, mSV, kv_head, doc_start, doc_len, key0):
    """rsc = (sk(row 0), sk(row 1), sv(row 0), sv(row 1)) of this thread's key rows krow of the block
    starting at key0 (0 past the document end, and 0 for a NaN scale). A NaN scale marks a K or V block
    holding a non-finite input (its codes are 0): as a factor it would turn the exact zeros of other
    documents' queries in the tile (P = 0, sdo = D = 0) into NaN, which the dQ reduce-add carries into
    their rows. The key's own gradients get the NaN from the forward instead: every query that sees
    the key has a NaN LSE (a non-finite K) or a NaN O, hence D (a non-finite V)."""
    for v1 in cutlass.range_constexpr(2):
        key = key0 + krow[v1]
        sk = Float32(0.0)
        sv = Float32(0.0)
        if key < doc_len:
            sk = mSK[doc_start + key, kv_head]
            sv = mSV[doc_start + key, kv_head]
        rsc[v1] = cute.arch.fmax(sk, Float32(0.0))  # max drops a NaN: 0
        rsc[2 + v1] = cute.arch.fmax(sv, Float32(0.0))


@cute.jit
def store_key_rows_bf16(mdX, pair, krow, key0, doc_start, doc_len, kv_head, D: cutlass.Constexpr,
                        n_acc: cutlass.Constexpr):
    """Epilogue of an m64nD key-row accumulator (dK or dV of one consumer warpgroup): bf16 rows with
    16-byte stores. pair(i0) gives the fp32 values of accumulator indices i0, i0 + 1 (scaled as
    the caller needs); krow[v1]: the thread's key rows in the block starting at key0; rows at or
    past doc_len are not stored. The quad transpose makes each lane's 8 columns contiguous."""
    lane = cute.arch.lane_idx()
    quad = lane % 4
    odd_lane = quad % 2 == 1
    hi_lane = quad >= 2

    def shfl_xor(x, k):
        return Uint32(cute.arch.shuffle_sync_bfly(x, offset=k))

    def sel(c, a, b):
        return Uint32(cutlass.select_(c, a, b))

    row_stride = mdX.stride[0]  # Hk * D elements
    base = mdX.iterator.toint()
    for v1 in cutlass.range_constexpr(2):
        key = key0 + krow[v1]
        row_addr = base + (Int64(doc_start + key) * Int64(row_stride) + Int64(kv_head * D + 8 * quad)) * 2
        for G in cutlass.range_constexpr(n_acc // 16):
            w = []
            for jj in cutlass.range_constexpr(4):
                x0, x1 = pair(2 * v1 + 4 * (4 * G + jj))
                w.append(cvt_bf16x2(x0, x1))
            ow = quad_transpose4(w, odd_lane, hi_lane, shfl_xor, sel)
            if key < doc_len:
                st_global_v4(row_addr + 64 * G, ow)


@cute.jit
def dq_turn_wait_warp(mSem, hq, doc, m, n_blk, tiles_per_block: cutlass.Constexpr):
    """Deterministic dQ, by the dQ warp: lane 0 waits until key blocks 0 .. n_blk-1 have added to query
    tile m of head hq (one counter per (query head, document, query tile); tiles_per_block query tiles per
    key block); returns the counter's address for dq_turn_pass_warp. The grid is the deterministic mode's
    "heads" order, (KV heads, documents, key blocks): BwdDsBf16Config.raster."""
    _, n_docs, n_blocks = cute.arch.grid_dim()
    sem_addr = mSem.iterator.toint() + Int64((hq * n_docs + doc) * (n_blocks * tiles_per_block) + m) * 4
    if cute.arch.lane_idx() == 0:
        while ld_acquire_gpu_u32(sem_addr) != Uint32(n_blk):
            nanosleep(64)
        fence_proxy_async_global()  # the TMA reduce-add that follows comes after the earlier blocks' adds
    cute.arch.sync_warp()
    return sem_addr


@cute.jit
def dq_turn_pass_warp(sem_addr):
    """Deterministic dQ: the warp's TMA reduce-add has completed (cp.async.bulk.wait_group 0); its writes are
    ordered before the release that hands the next key block its turn."""
    cute.arch.sync_warp()
    if cute.arch.lane_idx() == 0:
        fence_proxy_async_global()
        fence_acq_rel_gpu()
        red_release_gpu_add_u32(sem_addr, 1)
