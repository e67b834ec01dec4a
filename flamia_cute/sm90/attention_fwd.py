"""FP8 causal attention forward for Hopper (sm_90a) over packed documents, in the CuTe DSL.

Numerics: the spec is `flamia_cute.emulator.emulate_forward` for recipes fp8_token and
fp8_tokenblock (per-token Q scales; K/V scales per token or per 128-token document-local
block; a per-token K/V copy on the diagonal tile when blocks are used).

Organization (persistent by default: one CTA per SM takes (document, query head, 128-query block)
tiles from a global atomic counter, documents in order, heads, then blocks longest first; warp 0
publishes each tile, with its document's start and length, to the other roles through a shared-memory
ring and loads the next tile's Q (two Q stages), K and V while the consumers finish the current one;
`persistent=False`: one CTA per tile):
- warp 0 of the producer warpgroup issues TMA loads of Q (two 64-row boxes) and of K and V
  tiles (separate K and V pipelines, `kv_stages` deep); the diagonal tile (processed first)
  comes from the per-token copies when `diagonal_copy`;
- warp 1 of the producer warpgroup copies the tile's K and V scales (the 128 fp32 of each), and on
  the diagonal step the tile's 128 Q scales, into shared memory through its own pipeline: the scale
  rows are only 4-byte aligned at a document start, which TMA cannot address. The consumers then
  start a tile with no global loads;
- two consumer warpgroups own query rows 0-63 and 64-127. Per key tile, from the diagonal
  down: S = Q K^T (wgmma e4m3, fp32), online softmax in the log2 domain, P cast to e4m3 with
  the V scale folded in (r = max visible V scale of the row in the tile), P converted
  straight into the A-operand registers (V^T comes in P-fragment key order, quant.PV_ORDER16,
  so no data moves between threads), P V (wgmma e4m3, A from registers, B = V^T tile with
  tokens contiguous) into a fresh fp32 tile accumulator, then O = O * c + O_tile (one FFMA
  per element): the fp8 tensor-core accumulation is promoted once per 128 keys;
- a named-barrier ping-pong orders the two warpgroups' GEMM issue (FA3's warp scheduler
  barrier) so one warpgroup's softmax overlaps the other's MMAs (FwdConfig.pingpong);
- intra-warpgroup overlap (FwdConfig.intra_wg_overlap, FA3): S of tile n+1 and P V of tile n are
  issued back to back, the softmax of tile n+1 runs while the tensor cores do both; the running
  output's rescale for tile n+1 is deferred until tile n's P V has been added (same operations,
  same order, same numbers as the serial schedule);
- epilogue: O in bf16x2 words, transposed across each quad (4 shuffles) so every thread
  writes 16 contiguous bytes per store (st.global.v4: 2 * D/32 stores per thread).

Varlen: TMA tensors span the whole packed batch; the document start is a domain offset of
the token coordinate: cu_seqlens[doc] for Q, K (token-major) and the scales, dt_cu_seqlens[doc]
(16-aligned) for V^T, which the TMA warp sums from cu_seqlens itself (no host-side table).
Keys past the document end (only in the diagonal tile) are masked;
query rows past the end are computed on whatever TMA brought and never stored.
The default builds are causal self-attention (cu_seqlens_q == cu_seqlens_k); FwdConfig.cross_length and
causal=False also take cu_seqlens_k (docs/forward.md, "Cross-length and non-causal builds").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import Float8E4M3FN, Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from .. import mask as _mask
from .. import recipes as _recipes
from .. import softmax as _softmax
from .. import tile_scheduler as _tile_scheduler
from .. import varlen as _varlen
from ..compile_cache import compile_entry, launch_on_device, sm_count
from ..mask import diagonal_key_end, hide_invisible, step_key_scales
from ..quant import transposed_tokens
from ..schedules import varlen_tiles as _varlen_tiles
from ..schedules.varlen_chunks import max_chunks
from ..schedules.varlen_tiles import LPT_MAX_DOCS, TILE_ORDERS, short_pairs_worth
from ..softmax import (
    P_SCALE,
    P_SCALE_LOG2,
    fold_reference,
    offset_up,
    online_max,
    quad_sum,
    row_lse,
    row_max_up,
    scale_log2_f32,
    two_row_max,
)
from ..tile_scheduler import (
    SCHED_STAGES,
    claim_next_tile,
    doc_chunk_cumsum,
    for_each_published_cross_tile,
    for_each_published_tile,
    publish_tile,
    rank_documents_longest_first,
    tile_at,
)
from ..validation import check_kernel_tensors, int32_cu_seqlens
from ..varlen import (
    cross_document_tiles,
    cross_tile_bounds,
    document_bounds,
    document_dt_start,
    document_tiles,
    short_pair_bounds,
)
from .primitives import (
    ARG_BF16,
    ARG_F8,
    ARG_F32,
    ARG_I32,
    SHARED_SOURCE_FILES,
    cvt_bf16x2,
    f32_bits,
    pack_a_fragment_e4m3,
    quad_transpose4,
    select,
    st_global_v4,
    tma_pipeline,
    warp_pipeline,
)

# recipes.py holds FOLD_DROP and FOLD_REF_MIN: a change there must recompile
SOURCE_FILES = (Path(__file__).resolve(), Path(_recipes.__file__).resolve(), Path(_varlen_tiles.__file__).resolve(),
                *(Path(m.__file__).resolve() for m in (_mask, _softmax, _tile_scheduler, _varlen)),
                *SHARED_SOURCE_FILES)

# Query rows and keys per tile. The recipe's key block (128) defines the P scale fold, and equal query
# and key tiles make the diagonal tile exactly one key tile.
TILE = 128
WG_ROWS = 64  # query rows per consumer warpgroup: one m64 wgmma
CONSUMER_WARPGROUPS = TILE // WG_ROWS
# Persistent schedule: the most documents whose chunk table fits in shared memory (4 KB; more
# documents fall back to the one-CTA-per-tile launch), the table scan's barrier (1 and 2 are the
# ping-pong's)
PERSISTENT_MAX_DOCS = 1024
SCAN_BARRIER = 3
if LPT_MAX_DOCS != 128:  # rank_documents_longest_first: one document per producer-warpgroup thread
    raise ImportError(f"schedules.varlen_tiles.LPT_MAX_DOCS must be 128 (got {LPT_MAX_DOCS})")


def per_tile_fallback(cfg):
    """The one-CTA-per-tile build of a persistent config (more documents than its tables hold): the
    persistent-only options at their defaults."""
    return replace(cfg, persistent=False, tile_order="documents", short_pairs=False)


def smem_bytes(cfg) -> int:
    """Shared memory of one CTA (upper bound): Q stages, K and V stages, their scale vectors, the
    persistent tables, barriers and alignment."""
    tables = {"documents": 2, "longest_documents": 4}[cfg.tile_order] + int(cfg.short_pairs)
    table = tables * 4 * (PERSISTENT_MAX_DOCS + 1) + 128 if cfg.persistent else 0
    scales = scale_rows(cfg) * 4 * cfg.kv_stages
    return TILE * cfg.head_dim * cfg.q_stages + 2 * cfg.kv_stages * TILE * cfg.head_dim + scales + table + 2048


def scale_rows(cfg) -> int:
    """Rows of a scale stage: K scales per key, V scales per key, Q scales per row. With short_pairs
    the V scales of a paired diagonal step are [the first document's 64, 64 zeros, the second's 64]:
    each warpgroup reads the 128 from its own offset (key_lo), so the other document's keys have V
    scale 0 and their masked P adds exactly 0 (a NaN scale there would turn the masked 0 into NaN)."""
    return 3 * TILE + (WG_ROWS if cfg.short_pairs else 0)


@dataclass(frozen=True)
class FwdConfig:
    """Compile-time shape of the forward kernel. Everything else (T, heads, documents) is dynamic."""

    head_dim: int
    qhead_per_kvhead: int = 1  # GQA group: query head h reads kv head h // group
    diagonal_copy: bool = False  # fp8_tokenblock: per-token K/V copy on the diagonal tile
    # K and V pipeline depth (shared memory allowing: smem_bytes). 3 is faster on long documents.
    kv_stages: int = 2
    # One CTA per SM taking (document, head, query block) tiles from a global counter, the next tile's
    # Q, K, V loading while the current one finishes (two Q stages). False: one CTA per tile (the
    # hardware schedules them), the build for more than PERSISTENT_MAX_DOCS documents (per_tile_fallback).
    persistent: bool = True
    # Persistent tile order: "documents" (documents, heads, blocks longest first) or "longest_documents"
    # (LPT across documents: by chunk count, most first, ranked in the kernel for up to LPT_MAX_DOCS
    # documents, the given order beyond; then as "documents"), faster on skewed packs.
    tile_order: str = "documents"
    # Persistent: two short documents share one query tile, one per consumer warpgroup (schedules.
    # varlen_tiles.short_pair_partner: documents 2i and 2i + 1 when 2i fills exactly 64 V^T columns
    # and 2i + 1 holds at most 64 tokens). The tile's K is two 64-row boxes, one per document; the
    # V^T box already holds both; the second warpgroup masks the first document's keys. A paired
    # document's rows see exactly the keys and scales of its own tile: O and LSE bit-identical.
    short_pairs: bool = False
    # causal=False: every query sees every key of its document. cross_length (causal): a document's
    # Lq queries are the last Lq positions of its Lk keys (cu_seqlens_q != cu_seqlens_k). Both take
    # cu_seqlens_k and run the query tiles of schedules.varlen_tiles.cross_tile (separate_keys).
    causal: bool = True
    cross_length: bool = False

    def __post_init__(self):
        def bad(name, msg):
            raise ValueError(f"FwdConfig.{name}: {msg} (got {getattr(self, name)!r})")

        if self.head_dim not in (64, 128):
            bad("head_dim", "must be 64 or 128 (256 would need more than 240 registers per thread)")
        if type(self.qhead_per_kvhead) is not int or self.qhead_per_kvhead < 1:
            bad("qhead_per_kvhead", "must be an int >= 1")
        if not isinstance(self.diagonal_copy, bool):
            bad("diagonal_copy", "must be a bool")
        if type(self.kv_stages) is not int or not 2 <= self.kv_stages <= 4:
            bad("kv_stages", "must be 2, 3 or 4")
        if not isinstance(self.persistent, bool):
            bad("persistent", "must be a bool")
        if self.tile_order not in TILE_ORDERS:
            bad("tile_order", f"must be one of {TILE_ORDERS}")
        if not isinstance(self.short_pairs, bool):
            bad("short_pairs", "must be a bool")
        for name in ("causal", "cross_length"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a bool")
        if self.cross_length and not self.causal:
            bad("cross_length", "is for causal=True (the non-causal build takes cu_seqlens_k in any case)")
        if self.short_pairs and self.separate_keys:
            bad("short_pairs", "pairs self-attention documents only (not with cross_length or causal=False)")
        for name in ("tile_order", "short_pairs"):
            if getattr(self, name) != getattr(FwdConfig, name) and not self.persistent:
                bad(name, "needs persistent=True (per_tile_fallback drops it)")

    @property
    def separate_keys(self) -> bool:
        """The build takes cu_seqlens_k (cross_length, or causal=False)."""
        return self.cross_length or not self.causal

    @property
    def intra_wg_overlap(self) -> bool:
        """The intra-warpgroup overlap: on where the sm_90a build has no spills (tests check it).
        Block-scaled recipes (diagonal_copy) have tile-constant K/V scales off the diagonal, and the
        overlapped softmax fits in 240 registers with the P V accumulator in flight. The per-token
        recipe also needs each column's K and V scale there (it spills), so it stays serial."""
        return self.diagonal_copy

    @property
    def pingpong(self) -> bool:
        """The warpgroups' ping-pong: off for the block-scaled D=128 build, where with the overlapped
        schedule the barrier only delays the second warpgroup's issue (faster without it on
        every workload); on elsewhere."""
        return not (self.head_dim == 128 and self.diagonal_copy)

    @property
    def q_stages(self) -> int:
        """Q tiles in flight: persistent, the next tile's Q loads under this one."""
        return 2 if self.persistent else 1


def short_pairs_default(total_tokens: int, num_docs: int) -> bool:
    """FwdConfig.short_pairs for a call, from what the host knows without a sync: on for packs of
    short documents (short_pairs_worth) that the persistent tables hold."""
    return num_docs <= PERSISTENT_MAX_DOCS and short_pairs_worth(total_tokens, num_docs)


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


class FlamiaFwdSm90:
    def __init__(self, config: FwdConfig):
        self.cfg = config
        self.D = config.head_dim
        self.group = config.qhead_per_kvhead
        self.diag_copy = config.diagonal_copy
        self.stages = config.kv_stages
        self.num_threads = 128 * (1 + CONSUMER_WARPGROUPS)
        self.regs_producer = 24
        self.regs_consumer = 240
        self.pingpong = config.pingpong
        self.overlap = config.intra_wg_overlap
        self.persistent = config.persistent
        self.q_stages = config.q_stages
        self.short_pairs = config.short_pairs
        self.causal = config.causal
        self.cross = config.separate_keys  # cu_seqlens_k: the cross_tile geometry
        # the first key tile from the per-token copies: block-scaled and causal (the diagonal safeguard;
        # the non-causal build's first tile is the document's last keys, which every query sees)
        self.diag_first = config.diagonal_copy and config.causal
        # scale stage rows: K and V scales per key, the diagonal step's Q scales per row
        self.scale_rows = scale_rows(config)
        self.q_row0 = self.scale_rows - TILE  # the diagonal step's Q scales (after K's and V's)
        # tile ring words: block, head, document, its start and length (short pairs: the partner's length;
        # separate keys: the five cross_tile bounds)
        self.sched_rows = 8 if self.cross else 6

    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer,
        sq_ptr: cute.Pointer,
        k_ptr: cute.Pointer,
        sk_ptr: cute.Pointer,
        v_ptr: cute.Pointer,
        sv_ptr: cute.Pointer,
        kt_ptr: cute.Pointer,
        skt_ptr: cute.Pointer,
        vt_ptr: cute.Pointer,
        svt_ptr: cute.Pointer,
        cu_ptr: cute.Pointer,
        o_ptr: cute.Pointer,
        lse_ptr: cute.Pointer,
        sched_ptr: cute.Pointer,
        T: Int32,
        T_dt: Int32,
        num_kv_heads: Int32,
        num_docs: Int32,
        grid_x: Int32,
        scale_log2: Float32,
        cu_k_ptr: cute.Pointer,
        T_k: Int32,
        stream: cuda.CUstream,
    ):
        D, tn, wm = self.D, TILE, WG_ROWS
        H = num_kv_heads * self.group
        hd = cute.assume(H * D, divby=D)
        khd = cute.assume(num_kv_heads * D, divby=D)
        tdt = cute.assume(T_dt, divby=128)
        # the key side's tokens: T_k with separate keys (cu_k_ptr), else the queries' (both unused)
        Tk = T_k if cutlass.const_expr(self.cross) else T
        # (token, d, head): d contiguous, so the reduction of S = Q K^T is K-major for both
        mQ = cute.make_tensor(q_ptr, cute.make_layout((T, D, H), stride=(hd, 1, D)))
        mK = cute.make_tensor(k_ptr, cute.make_layout((Tk, D, num_kv_heads), stride=(khd, 1, D)))
        mKt = cute.make_tensor(kt_ptr, cute.make_layout((Tk, D, num_kv_heads), stride=(khd, 1, D)))
        # V^T (d, column, head): tokens contiguous, K-major for O = P V. Document b starts at
        # column dt_cu_seqlens[b] (a multiple of DT_DOC_ALIGN >= 16: a TMA box on the contiguous axis must start
        # 16-byte aligned); columns between documents and past the last one are zero.
        vl = cute.make_layout((D, tdt, num_kv_heads), stride=(tdt, 1, cute.assume(D * tdt, divby=128)))
        mV = cute.make_tensor(v_ptr, vl)
        mVt = cute.make_tensor(vt_ptr, vl)
        mO = cute.make_tensor(o_ptr, cute.make_layout((T, D, H), stride=(hd, 1, D)))
        sl = cute.make_layout((T, H), stride=(1, T))
        skl = cute.make_layout((Tk, num_kv_heads), stride=(1, Tk))
        mSQ = cute.make_tensor(sq_ptr, sl)
        mLSE = cute.make_tensor(lse_ptr, sl)
        mSK = cute.make_tensor(sk_ptr, skl)
        mSV = cute.make_tensor(sv_ptr, skl)
        mSKt = cute.make_tensor(skt_ptr, skl)
        mSVt = cute.make_tensor(svt_ptr, skl)
        mCu = cute.make_tensor(cu_ptr, cute.make_layout(num_docs + 1))
        mSched = cute.make_tensor(sched_ptr, cute.make_layout(1))  # persistent: the tile counter
        mCuK = None  # separate keys: the key documents (mCu: the query documents)
        if cutlass.const_expr(self.cross):
            mCuK = cute.make_tensor(cu_k_ptr, cute.make_layout(num_docs + 1))

        K_MAJOR = OperandMajorMode.K
        qk_mma = sm90_utils.make_trivial_tiled_mma(
            Float8E4M3FN, Float8E4M3FN, K_MAJOR, K_MAJOR, Float32, (1, 1, 1), (wm, tn)
        )
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            Float8E4M3FN, Float8E4M3FN, K_MAJOR, K_MAJOR, Float32, (1, 1, 1), (wm, D),
            warpgroup.OperandSource.RMEM,
        )
        row_major = cutlass.tensor_utils.LayoutEnum.ROW_MAJOR
        # Q: two 64-row "stages" per Q stage, one per consumer warpgroup
        sQ_layout = sm90_utils.make_smem_layout_a(row_major, (wm, tn, D), Float8E4M3FN, 2 * self.q_stages)
        sK_layout = sm90_utils.make_smem_layout_b(row_major, (wm, tn, D), Float8E4M3FN, self.stages)
        sV_layout = sm90_utils.make_smem_layout_b(row_major, (wm, D, tn), Float8E4M3FN, self.stages)

        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tQ = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mQ, cute.slice_(sQ_layout, (None, None, 0)), (wm, D))
        sK1 = cute.slice_(sK_layout, (None, None, 0))
        sV1 = cute.slice_(sm90_utils.make_smem_layout_b(row_major, (wm, D, tn), Float8E4M3FN, 1), (None, None, 0))
        tma_k, tK = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mK, sK1, (tn, D))
        tma_v, tV = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mV, sV1, (D, tn))
        tma_kt, tKt = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mKt, sK1, (tn, D))
        tma_vt, tVt = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mVt, sV1, (D, tn))
        # Unused: a parameter slot of the size and alignment of a TMA atom, so the kernel's later
        # parameters keep their offsets (the SASS compares instruction for instruction with the
        # reference build; dropping it only moves constant-bank offsets)
        tma_pad, tPad = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mO, cute.make_layout((wm, D), stride=(D, 1)), (wm, D))
        # short_pairs: the diagonal K tile as two 64-row boxes (rows are whole 128-byte swizzle rows,
        # so a stage's first 64 rows are laid out as a 64-row tile)
        sKh = cute.slice_(sm90_utils.make_smem_layout_b(row_major, (wm, wm, D), Float8E4M3FN, 1), (None, None, 0))
        tma_kh, tKh = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mKt if self.diag_copy else mK, sKh, (wm, D))
        self.q_bytes = 2 * wm * D
        self.kv_bytes = tn * D

        stages = self.stages
        q_stages = self.q_stages
        persistent = self.persistent
        # the persistent schedule's ring and document tables, last (a few unused words otherwise)
        n_cum = PERSISTENT_MAX_DOCS + 1 if persistent else 4
        n_lpt = n_cum if self.cfg.tile_order == "longest_documents" else 4
        n_pair = n_cum if self.short_pairs else 4

        @cute.struct
        class SharedStorage:
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2 * q_stages]
            k_mbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            v_mbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            s_mbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sScale: cute.struct.Align[cute.struct.MemRange[Float32, self.scale_rows * stages], 16]
            # unused (pad and pad_tables): keep every later buffer at the reference build's offset
            pad: cute.struct.Align[cute.struct.MemRange[Float32, 256], 16]
            sQ: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sV_layout)], 1024]
            t_mbar: cute.struct.MemRange[cutlass.Int64, 2 * SCHED_STAGES]
            sSched: cute.struct.Align[cute.struct.MemRange[Int32, self.sched_rows * SCHED_STAGES], 16]
            sWarp: cute.struct.Align[cute.struct.MemRange[Int32, 8], 16]  # the table scan's warp totals
            sCum: cute.struct.Align[cute.struct.MemRange[Int32, n_cum], 16]
            sDt: cute.struct.Align[cute.struct.MemRange[Int32, n_cum], 16]
            pad_tables: cute.struct.Align[cute.struct.MemRange[Int32, 4], 16]
            sLpt: cute.struct.Align[cute.struct.MemRange[Int32, n_lpt], 16]
            sOrder: cute.struct.Align[cute.struct.MemRange[Int32, n_lpt], 16]
            sPair: cute.struct.Align[cute.struct.MemRange[Int32, n_pair], 16]  # short_pairs: the partner lengths

        self.shared_storage = SharedStorage

        self.kernel(
            qk_mma, pv_mma,
            tma_q, tQ, tma_k, tK, tma_v, tV, tma_kt, tKt, tma_vt, tVt, tma_pad, tPad, tma_kh, tKh,
            mQ, mO, mLSE, mSQ, mSK, mSV, mSKt, mSVt, mCu, mSched,
            sQ_layout, sK_layout, sV_layout, scale_log2, mCuK,
        ).launch(
            # one CTA per (query block, head, document), query block fastest (see kernel()), or
            # grid_x persistent CTAs
            grid=[grid_x, 1, 1] if persistent else [grid_x, H, num_docs],
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        tQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        tK: cute.Tensor,
        tma_v: cute.CopyAtom,
        tV: cute.Tensor,
        tma_kt: cute.CopyAtom,
        tKt: cute.Tensor,
        tma_vt: cute.CopyAtom,
        tVt: cute.Tensor,
        tma_pad: cute.CopyAtom,
        tPad: cute.Tensor,
        tma_kh: cute.CopyAtom,
        tKh: cute.Tensor,
        mQ: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSQ: cute.Tensor,
        mSK: cute.Tensor,
        mSV: cute.Tensor,
        mSKt: cute.Tensor,
        mSVt: cute.Tensor,
        mCu: cute.Tensor,
        mSched: cute.Tensor,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        scale_log2: Float32,
        mCuK: Optional[cute.Tensor],  # noqa: UP045 - the DSL reads the annotation
    ):
        tidx, _, _ = cute.arch.thread_idx()
        # Query block fastest in the launch order, heaviest (longest causal row) first: the CTAs
        # running together share one head's K/V in L2 (heads fastest is slower: 16 heads' K/V in
        # flight at once do not fit in L2).
        bidx, head, doc = cute.arch.block_idx()
        roles = (
            qk_mma, pv_mma, tma_q, tQ, tma_k, tK, tma_v, tV, tma_kt, tKt, tma_vt, tVt, tma_kh, tKh,
            mO, mLSE, mSQ, mSK, mSV, mSKt, mSVt, mCu, mSched, sQ_layout, sK_layout, sV_layout, scale_log2, mCuK,
        )
        if cutlass.const_expr(self.persistent):
            # tiles come from the scheduler (run_cta's producer warp): no tile of its own
            self.run_cta(roles, Int32(0), Int32(0), Int32(0), Int32(0), Int32(0))
        elif cutlass.const_expr(self.cross):
            nblk_x, _, _ = cute.arch.grid_dim()
            block = nblk_x - 1 - bidx
            if block < cross_document_tiles(mCu, mCuK, doc, self.causal):
                m_block, bounds = cross_tile_bounds(mCu, mCuK, doc, block, self.causal)
                self.run_cta(roles, head, doc, Int32(0), Int32(0), m_block, bounds)
        else:
            nblk_x, _, _ = cute.arch.grid_dim()
            m_block = nblk_x - 1 - bidx
            doc_start, doc_len = document_bounds(mCu, doc)
            # Whole CTA leaves before any barrier when the block lies past the document end
            if m_block * TILE < doc_len:
                self.run_cta(roles, head, doc, doc_start, doc_len, m_block)

    @cute.jit
    def run_cta(self, roles, head, doc, doc_start, doc_len, m_block, bounds=None):
        """Shared memory, pipelines and the warp roles of one CTA: the tile (head, doc, m_block), or
        when persistent the scheduler's tiles. bounds (separate keys, one CTA per tile): the tile's
        cross_tile_bounds words (doc_start, doc_len unused)."""
        (qk_mma, pv_mma, tma_q, tQ, tma_k, tK, tma_v, tV, tma_kt, tKt, tma_vt, tVt, tma_kh, tKh,
         mO, mLSE, mSQ, mSK, mSV, mSKt, mSVt, mCu, mSched, sQ_layout, sK_layout, sV_layout, scale_log2, mCuK) = roles
        tidx, _, _ = cute.arch.thread_idx()
        kv_head = head // self.group
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sScale = storage.sScale.get_tensor(cute.make_layout((self.scale_rows, self.stages)))

        pipe_q = tma_pipeline(self.q_stages, self.q_bytes, storage.q_mbar.data_ptr())
        pipe_k = tma_pipeline(self.stages, self.kv_bytes, storage.k_mbar.data_ptr())
        pipe_v = tma_pipeline(self.stages, self.kv_bytes, storage.v_mbar.data_ptr())
        pipe_s = warp_pipeline(self.stages, storage.s_mbar.data_ptr())
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        pipe_t = None
        sSched = None
        sCum = None
        sDt = None
        sPair = None
        lpt_tables = None
        if cutlass.const_expr(self.persistent):
            # tile hand-off from the TMA warp to the scale warp and the consumers (32 + 256 threads)
            pipe_t = warp_pipeline(SCHED_STAGES, storage.t_mbar.data_ptr(), consumers=288)
            sSched = storage.sSched.get_tensor(cute.make_layout((self.sched_rows, SCHED_STAGES)))
            sCum = storage.sCum.get_tensor(cute.make_layout(PERSISTENT_MAX_DOCS + 1))
            sDt = storage.sDt.get_tensor(cute.make_layout(PERSISTENT_MAX_DOCS + 1))
            if cutlass.const_expr(self.short_pairs):
                sPair = storage.sPair.get_tensor(cute.make_layout(PERSISTENT_MAX_DOCS + 1))
            if cutlass.const_expr(self.cfg.tile_order == "longest_documents"):
                # (sOrder, sLpt): the position -> document map and the chunk prefix in that order
                lpt_tables = (storage.sOrder.get_tensor(cute.make_layout(PERSISTENT_MAX_DOCS + 1)),
                              storage.sLpt.get_tensor(cute.make_layout(PERSISTENT_MAX_DOCS + 1)))
            if wg_idx == 0:
                # each document's first chunk (locate_tile) and V^T column, by the producer warpgroup
                sWarp = storage.sWarp.get_tensor(cute.make_layout((4, 2), stride=(2, 1)))
                doc_chunk_cumsum(mCu, cute.size(mCu) - 1, sCum, sDt, sWarp, tidx, 128, SCAN_BARRIER, TILE,
                                 sPair=sPair, mCuK=mCuK, causal=self.causal)
                if cutlass.const_expr(lpt_tables is not None):
                    cute.arch.barrier(barrier_id=SCAN_BARRIER, number_of_threads=128)  # sCum complete
                    rank_documents_longest_first(sCum, cute.size(mCu) - 1, *lpt_tables, sWarp, tidx, 128, SCAN_BARRIER)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.regs_producer)
            if warp_idx == 0:
                tma_args = (tma_q, tQ, tma_k, tK, tma_v, tV, tma_kt, tKt, tma_vt, tVt, sQ, sK, sV, pipe_q, pipe_k,
                            pipe_v, (tma_kh, tKh))
                if cutlass.const_expr(self.persistent):
                    self.produce_tiles(tma_args, mCu, mSched, mO.shape[2], pipe_t, sSched, sCum, sDt, lpt_tables,
                                       sPair, mCuK)
                elif cutlass.const_expr(self.cross):  # K and V from the key document, Q from the tile's rows
                    self.load_tma(*tma_args, self.tma_states(), head, kv_head, bounds[3], mCuK, doc, None, m_block,
                                  q_start=bounds[0])
                else:
                    self.load_tma(*tma_args, self.tma_states(), head, kv_head, doc_start, mCu, doc, None, m_block)
            if warp_idx == 1:
                s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                if cutlass.const_expr(self.persistent and self.cross):
                    def cross_scales_step(s_state, head, m_block, bounds):
                        return self.load_scales(mSK, mSV, mSKt, mSVt, sScale, pipe_s, s_state, head // self.group,
                                                Int32(0), Int32(0), m_block, mSQ, head, bounds=bounds)

                    for_each_published_cross_tile(pipe_t, sSched, s_state, cross_scales_step)
                elif cutlass.const_expr(self.persistent):
                    def scales_step(s_state, head, doc_start, doc_len, m_block, *pair):
                        return self.load_scales(mSK, mSV, mSKt, mSVt, sScale, pipe_s, s_state, head // self.group,
                                                doc_start, doc_len, m_block, mSQ, head, *pair)

                    for_each_published_tile(pipe_t, sSched, s_state, scales_step, self.short_pairs)
                else:
                    self.load_scales(mSK, mSV, mSKt, mSVt, sScale, pipe_s, s_state, kv_head, doc_start, doc_len, m_block,
                                     mSQ, head, bounds=bounds)
        else:
            cute.arch.setmaxregister_increase(self.regs_consumer)
            self.consume(
                qk_mma, pv_mma, sQ, sK, sV, sScale, pipe_q, pipe_k, pipe_v, pipe_s,
                mO, mLSE, scale_log2, head, doc_start, doc_len, m_block, wg_idx - 1, pipe_t, sSched, bounds,
            )

    def tma_states(self):
        """The TMA warp's fresh producer states of the Q, K and V pipelines."""
        return (
            pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages),
            pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages),
            pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages),
        )

    @cute.jit
    def produce_tiles(self, tma_args, mCu, mSched, heads, pipe_t, sSched, sCum, sDt, lpt_tables, sPair=None,
                      mCuK=None):
        """Persistent TMA warp: take tiles (the first by CTA index, then from the global counter
        mSched[0], which the host zeroes per call), publish each with its document's start and length
        to the scale warp and consumers, issue its loads; an end mark (block -1) past the last tile.
        The tile order is locate_tile's (lpt_tables = (sOrder, sLpt): longest_documents, locate_tile
        over the ranked positions). mCuK (separate keys): each tile's cross_tile_bounds are published
        instead, K and V come from the key document and Q from the tile's rows."""
        bidx, _, _ = cute.arch.block_idx()
        num_docs = cute.size(mCu) - 1
        t_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, SCHED_STAGES)
        total = heads * sCum[num_docs]
        states = self.tma_states()
        t = Int32(bidx)  # the CTA's first tile
        if cutlass.const_expr(mCuK is not None):
            while t < total:
                doc, head, block = tile_at(t, sCum, num_docs, heads, lpt_tables)
                m_block, bounds = cross_tile_bounds(mCu, mCuK, doc, block, self.causal)
                t_state = publish_tile(pipe_t, sSched, t_state, m_block, head, doc, bounds)
                states = self.load_tma(*tma_args, states, head, head // self.group, bounds[3], mCuK, doc, sDt[doc],
                                       m_block, q_start=bounds[0])
                t = claim_next_tile(mSched)
            publish_tile(pipe_t, sSched, t_state, Int32(-1), Int32(0), Int32(0), tuple(Int32(0) for _ in range(5)))
            return
        while t < total:
            doc, head, m_block = tile_at(t, sCum, num_docs, heads, lpt_tables)
            doc_start, doc_len = document_bounds(mCu, doc)
            bounds = (doc_start, doc_len)
            pair_len = None
            if cutlass.const_expr(self.short_pairs):
                pair_len = sPair[doc]  # (> 0 only for a document of one block)
                bounds = (*bounds, pair_len)
            t_state = publish_tile(pipe_t, sSched, t_state, m_block, head, doc, bounds)
            states = self.load_tma(*tma_args, states, head, head // self.group, doc_start, mCu, doc, sDt[doc], m_block,
                                   pair_len=pair_len)
            t = claim_next_tile(mSched)
        end_bounds = (Int32(0), Int32(0))
        if cutlass.const_expr(self.short_pairs):
            end_bounds = (*end_bounds, Int32(0))
        publish_tile(pipe_t, sSched, t_state, Int32(-1), Int32(0), Int32(0), end_bounds)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load_tma(
        self, tma_q, tQ, tma_k, tK, tma_v, tV, tma_kt, tKt, tma_vt, tVt,
        sQ, sK, sV, pipe_q, pipe_k, pipe_v, k_half, states, head, kv_head, doc_start, mCu, doc, dt_start, m_block,
        pair_len=None, q_start=None,
    ):
        """Warp 0: TMA loads of query block m_block's Q and its key tiles, diagonal first. dt_start:
        the document's first V^T column, or None to sum it from cu_seqlens here. pair_len
        (short_pairs): > 0 when the next document shares the tile: its Q rows and diagonal K rows are
        the second 64-row boxes (k_half: the 64-row K atom). q_start (separate keys: cross_tile's
        q_base; mCu and doc_start are then the key document's): Q's rows are q_start + 128 m_block ..
        instead of the key document's. Returns the (q, k, v) pipeline states."""
        D, tn, wm = self.D, TILE, WG_ROWS
        q_state, k_state, v_state = states
        n_tiles = m_block + 1
        # document-local tiles: shift the token coordinate by the document start. Q and K are
        # token-major (the token is the outer, strided TMA coordinate: any start is fine); V^T's
        # token axis is the contiguous one, so its tiles start at the document's 16-aligned
        # column dt_start. The diagonal V tile may run past the document into zero pad, the next
        # document's columns, or past T_dt (TMA zero fill): always finite (a non-finite input's codes
        # are 0, its NaN is in its scale: quant.quantize_with_scale), and P = 0 there (masked score
        # and zero V scale), so it adds exactly 0.
        tQs, tQg = document_tiles(tma_q, tQ, head, sQ, (wm, D), doc_start if q_start is None else q_start, 0)

        def k_part(atom, t):
            return document_tiles(atom, t, kv_head, sK, (tn, D), doc_start, 0)

        def v_part(atom, t, dt_start):
            return document_tiles(atom, t, kv_head, sV, (D, tn), dt_start, 1)

        paired = None
        pair_start = None  # the second document's start, 64 rows back (its rows are the block's 64..127)
        if cutlass.const_expr(pair_len is not None):
            paired = pair_len > 0
            pair_start = mCu[doc + 1] - wm
        pipe_q.producer_acquire(q_state)
        for w in cutlass.range_constexpr(2):
            slot = w
            if cutlass.const_expr(self.persistent):
                slot = w + 2 * q_state.index
            if cutlass.const_expr(pair_len is not None and w == 1):
                _, tQgp = document_tiles(tma_q, tQ, head, sQ, (wm, D), pair_start, 0)
                if paired:  # the second document's first 64 rows
                    cute.copy(tma_q, tQgp[None, 1], tQs[None, slot], tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
                else:
                    cute.copy(tma_q, tQg[None, 2 * m_block + w], tQs[None, slot],
                              tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            else:
                cute.copy(tma_q, tQg[None, 2 * m_block + w], tQs[None, slot],
                          tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        q_state.advance()
        # diagonal K tile first: from the per-token copy when the recipe has block scales (mask.py)
        tKs, tKg = k_part(tma_k, tK)
        tma_kd, tKds, tKdg = tma_k, tKs, tKg
        if cutlass.const_expr(self.diag_first):
            tKds, tKdg = k_part(tma_kt, tKt)
            tma_kd = tma_kt
        pipe_k.producer_acquire(k_state)
        if cutlass.const_expr(pair_len is None):
            cute.copy(tma_kd, tKdg[None, m_block], tKds[None, k_state.index], tma_bar_ptr=pipe_k.producer_get_barrier(k_state))
        else:
            if paired:
                self.load_pair_k(k_half, sK, pipe_k, k_state, kv_head, doc_start, pair_start)
            else:
                cute.copy(tma_kd, tKdg[None, m_block], tKds[None, k_state.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(k_state))
        k_state.advance()

        if cutlass.const_expr(dt_start is None):
            # The document's first V^T column, while the Q and K loads fly (persistent: from the table)
            dt_start = document_dt_start(mCu, doc)

        tVs, tVg = v_part(tma_v, tV, dt_start)
        pipe_v.producer_acquire(v_state)
        if cutlass.const_expr(self.diag_first):
            tVts, tVtg = v_part(tma_vt, tVt, dt_start)
            cute.copy(tma_vt, tVtg[None, m_block], tVts[None, v_state.index], tma_bar_ptr=pipe_v.producer_get_barrier(v_state))
        else:
            cute.copy(tma_v, tVg[None, m_block], tVs[None, v_state.index], tma_bar_ptr=pipe_v.producer_get_barrier(v_state))
        v_state.advance()
        for i in cutlass.range(1, n_tiles, unroll=1):
            n = m_block - i
            pipe_k.producer_acquire(k_state)
            cute.copy(tma_k, tKg[None, n], tKs[None, k_state.index], tma_bar_ptr=pipe_k.producer_get_barrier(k_state))
            k_state.advance()
            pipe_v.producer_acquire(v_state)
            cute.copy(tma_v, tVg[None, n], tVs[None, v_state.index], tma_bar_ptr=pipe_v.producer_get_barrier(v_state))
            v_state.advance()
        return q_state, k_state, v_state

    @cute.jit
    def load_pair_k(self, k_half, sK, pipe_k, k_state, kv_head, doc_start, pair_start):
        """A short pair's diagonal K tile: rows 0..63 from the first document, 64..127 from the second
        (pair_start: its start 64 rows back), into K stage k_state as two 64-row boxes."""
        tma_kh, tKh = k_half
        wm, D = WG_ROWS, self.D
        # the stage's two 64-row halves: (64, D, half, stage)
        sKh = cute.flat_divide(sK, (wm, D))
        for w in cutlass.range_constexpr(2):
            start = doc_start if w == 0 else pair_start
            tKs, tKg = document_tiles(tma_kh, tKh, kv_head, sKh[None, None, w, 0, None], (wm, D), start, 0)
            cute.copy(tma_kh, tKg[None, w], tKs[None, k_state.index], tma_bar_ptr=pipe_k.producer_get_barrier(k_state))

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load_scales(self, mSK, mSV, mSKt, mSVt, sScale, pipe_s, s_state, kv_head, doc_start, doc_len, m_block,
                    mSQ, head, pair_len=None, bounds=None):
        """Warp 1: the K and V scales of each key tile of query block m_block into shared memory (0
        past the document end), and the block's per-row Q scales into the diagonal (first) step's
        stage (1 past the end). pair_len (short_pairs): rows and keys 64..127 of a paired tile are the
        second document's. bounds (separate keys): the tile's cross_tile_bounds (doc_start and doc_len
        unused). Returns the pipeline state."""
        # the bounds of the block's second half (rows / keys 64..127): a short pair's second document
        # as if it started 64 tokens before its start, else the tile's own document
        hi_bounds = (doc_start, doc_len)
        if cutlass.const_expr(pair_len is not None):
            hi_bounds = short_pair_bounds(doc_start, doc_len, pair_len)
        if cutlass.const_expr(bounds is not None):
            doc_start, doc_len = bounds[3], bounds[4]  # the key document's (the query side: bounds[:3])
        for i in cutlass.range(m_block + 1, unroll=1):
            n = m_block - i
            pipe_s.producer_acquire(s_state)
            if i == 0:
                if cutlass.const_expr(bounds is not None):
                    self.stage_cross_diagonal(mSK, mSV, mSKt, mSVt, mSQ, sScale, s_state, kv_head, head, bounds,
                                              m_block)
                else:
                    self.stage_diagonal(mSK, mSV, mSKt, mSVt, mSQ, sScale, s_state, kv_head, head, doc_start,
                                        doc_len, hi_bounds, m_block, pair_len)
            else:  # off-diagonal steps: the tile's own document only
                self.stage_key_scales(mSK, mSV, mSKt, mSVt, sScale, s_state, i, n, kv_head, doc_start, doc_len)
            pipe_s.producer_commit(s_state)  # every lane arrives: releases its own stores
            s_state.advance()
        return s_state

    @cute.jit
    def stage_key_scales(self, mSK, mSV, mSKt, mSVt, sScale, s_state, i, n, kv_head, doc_start, doc_len):
        """Step i's (key tile n's) K and V scales into its stage, in two halves of loads each issued
        before its stores (two global round trips per step; a whole step's loads at once spill in the
        producers' 24 registers)."""
        tn = TILE
        lane = cute.arch.lane_idx()
        per_group = tn // 64  # 32-key chunks loaded before their stores
        for g in cutlass.range_constexpr(tn // 32 // per_group):
            loaded = []
            for c in cutlass.range_constexpr(g * per_group, (g + 1) * per_group):
                sk, sv = step_key_scales(mSK, mSV, mSKt, mSVt, self.diag_copy, i, n * tn + lane + 32 * c, kv_head,
                                         doc_start, doc_len)
                loaded.append((c, sk, sv))
            for c, sk, sv in loaded:
                sScale[lane + 32 * c, s_state.index] = sk
                sScale[tn + lane + 32 * c, s_state.index] = sv

    @cute.jit
    def stage_diagonal(self, mSK, mSV, mSKt, mSVt, mSQ, sScale, s_state, kv_head, head, doc_start, doc_len,
                       hi_bounds, m_block, pair_len=None):
        """The diagonal step's Q, K and V scales, each half's from its own document (hi_bounds: the
        second half's, a short pair's second document or the tile's own): one global round trip per
        half, a runtime loop (unrolled, a pair's second document's bases spill in the producers' 24
        registers). The consumers wait for this step first, so its round trips are on every tile's path.
        A paired step's second half goes 64 rows further in the V scales, and 0 where it was
        (scale_rows): [first document, 0, second document]."""
        for h in cutlass.range(2, unroll=1):
            start = select(h == 0, doc_start, hi_bounds[0])
            length = select(h == 0, doc_len, hi_bounds[1])
            loaded = self.diagonal_half_scales(mSK, mSV, mSKt, mSVt, mSQ, kv_head, head, start, length, m_block, h)
            v_shift = None
            if cutlass.const_expr(pair_len is not None):
                v_shift = select((h == 1) & (pair_len > 0), Int32(WG_ROWS), Int32(0))
            self.store_diagonal_scales(sScale, s_state, loaded, v_shift)

    @cute.jit
    def diagonal_half_scales(self, mSK, mSV, mSKt, mSVt, mSQ, kv_head, head, start, length, m_block, h):
        """(key, Q scale, K scale, V scale) of the lane's keys in half h of the diagonal step."""
        tn = TILE
        lane = cute.arch.lane_idx()
        loaded = []
        for cc in cutlass.range_constexpr(2):
            key = lane + 32 * cc + (tn // 2) * h
            row = m_block * tn + key  # (query and key tiles coincide: row and key offsets too)
            sq = Float32(1.0)  # rows past the end: any finite positive scale (never stored)
            if row < length:
                sq = mSQ[start + row, head]
            sk, sv = step_key_scales(mSK, mSV, mSKt, mSVt, self.diag_copy, 0, m_block * tn + key, kv_head, start, length)
            loaded.append((key, sq, sk, sv))
        return loaded

    @cute.jit
    def stage_cross_diagonal(self, mSK, mSV, mSKt, mSVt, mSQ, sScale, s_state, kv_head, head, bounds, m_block):
        """stage_diagonal of a separate-keys tile: the Q scales of rows q_base + 128 m_block + r stored
        when q_lo <= 128 m_block + r < q_hi (else 1), the K and V scales of key tile m_block of the key
        document (per-token copies when diag_first)."""
        tn = TILE
        q_base, q_lo, q_hi, k_start, k_len = bounds
        lane = cute.arch.lane_idx()
        for h in cutlass.range(2, unroll=1):
            loaded = []
            for cc in cutlass.range_constexpr(2):
                key = lane + 32 * cc + (tn // 2) * h
                row = m_block * tn + key  # the tile coordinate of this row and of this key
                sq = Float32(1.0)  # rows outside the document's queries: any finite positive scale (never stored)
                if row >= q_lo:
                    if row < q_hi:
                        sq = mSQ[q_base + row, head]
                sk, sv = step_key_scales(mSK, mSV, mSKt, mSVt, self.diag_first, 0, row, kv_head, k_start, k_len)
                loaded.append((key, sq, sk, sv))
            self.store_diagonal_scales(sScale, s_state, loaded)

    @cute.jit
    def store_diagonal_scales(self, sScale, s_state, loaded, v_shift=None):
        tn = TILE
        for key, sq, sk, sv in loaded:
            sScale[self.q_row0 + key, s_state.index] = sq
            sScale[key, s_state.index] = sk
            if cutlass.const_expr(v_shift is not None):
                # (v_shift 0: both stores hit one word, in program order: sv stays)
                sScale[tn + key, s_state.index] = select(v_shift > 0, Float32(0.0), sv)
                sScale[tn + key + v_shift, s_state.index] = sv
            else:
                sScale[tn + key, s_state.index] = sv

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consume(
        self, qk_mma, pv_mma, sQ, sK, sV, sScale, pipe_q, pipe_k, pipe_v, pipe_s,
        mO, mLSE, scale_log2, head, doc_start, doc_len, m_block, wg, pipe_t, sSched, bounds=None,
    ):
        """The consumer warpgroups: one tile (head, doc, m_block), or when persistent every tile
        the producer warp publishes in sSched until its end mark (the arguments are then unused).
        bounds: a separate-keys tile's cross_tile_bounds (one CTA per tile)."""
        tn, wm = TILE, WG_ROWS
        tidx, _, _ = cute.arch.thread_idx()
        ctid = tidx % 128
        qk_thr = qk_mma.get_slice(ctid)
        pv_thr = pv_mma.get_slice(ctid)
        tSrQ = qk_thr.make_fragment_A(qk_thr.partition_A(sQ))  # (MMA, 1, D/32, 2 * q_stages)
        tSrK = qk_thr.make_fragment_B(qk_thr.partition_B(sK))  # (MMA, 1, D/32, stages)
        tOrV = pv_thr.make_fragment_B(pv_thr.partition_B(sV))  # (MMA, 1, 4, stages)
        acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((wm, tn)))  # ((2,2,16),1,1)
        acc_t = pv_thr.make_fragment_C(pv_thr.partition_shape_C((wm, self.D)))  # this tile's P V
        acc_o = pv_thr.make_fragment_C(pv_thr.partition_shape_C((wm, self.D)))  # running output
        tOrP = pv_thr.make_fragment_A(pv_thr.partition_shape_A((wm, tn)))  # ((4,2,2),1,4) e4m3
        tOrP32 = cute.recast_tensor(tOrP, Uint32)
        tScS = qk_thr.partition_C(cute.make_identity_tensor((wm, tn)))
        frags = (tSrQ, tSrK, tOrV, acc_s, acc_t, acc_o, tOrP, tOrP32, tScS)

        # Rows of this thread: value index a = v0 + 2*v1 + 4*v2 (v1 picks the row g or g+8)
        row_in_blk = cute.make_rmem_tensor(cute.make_layout(2), Int32)
        rs = cute.make_rmem_tensor(cute.make_layout(2), Float32)  # softmax_scale*log2e*sQ[row]
        m_run = cute.make_rmem_tensor(cute.make_layout(2), Float32)  # running max (scaled, log2)
        l_run = cute.make_rmem_tensor(cute.make_layout(2), Float32)  # per-thread partial row sum
        # V-scale fold reference of the last kept tile; negative while the current tile is dropped
        r_run = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        c_pend = cute.make_rmem_tensor(cute.make_layout(2), Float32)  # overlap: deferred O rescale
        rowst = (rs, m_run, l_run, r_run, c_pend)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        states = (q_state, k_state, v_state, s_state)
        pipes = (pipe_q, pipe_k, pipe_v, pipe_s)
        if cutlass.const_expr(not self.persistent):
            self.consume_tile(
                frags, rowst, row_in_blk, qk_mma, pv_mma, sScale, pipes, states, mO, mLSE, scale_log2,
                head, doc_start, doc_len, m_block, wg, bounds=bounds,
            )
        else:
            # the ping-pong turns run on across tiles: started and ended once. Per tile they raced: a
            # warpgroup's last arrive of one tile and its pre-arrive for the next completed a named
            # barrier's generation before the other warpgroup's closing wait (which then hung)
            if cutlass.const_expr(self.pingpong):
                self.pingpong_start(wg)

            def consume_step(states, head, doc_start, doc_len, m_block, *pair):
                # the MMA atoms are not loop-carried here: every GEMM sets its ACCUMULATE field first
                states, _, _ = self.consume_tile(
                    frags, rowst, row_in_blk, qk_mma, pv_mma, sScale, pipes, states, mO, mLSE, scale_log2,
                    head, doc_start, doc_len, m_block, wg, *pair,
                )
                return states

            def consume_cross_step(states, head, m_block, bounds):
                states, _, _ = self.consume_tile(
                    frags, rowst, row_in_blk, qk_mma, pv_mma, sScale, pipes, states, mO, mLSE, scale_log2,
                    head, Int32(0), Int32(0), m_block, wg, bounds=bounds,
                )
                return states

            if cutlass.const_expr(self.cross):
                for_each_published_cross_tile(pipe_t, sSched, states, consume_cross_step)
            else:
                for_each_published_tile(pipe_t, sSched, states, consume_step, self.short_pairs)
            if cutlass.const_expr(self.pingpong):
                self.pingpong_end(wg)

    @cute.jit
    def consume_tile(
        self, frags, rowst, row_in_blk, qk_mma, pv_mma, sScale, pipes, states, mO, mLSE, scale_log2,
        head, doc_start, doc_len, m_block, wg, pair_len=None, bounds=None,
    ):
        """Query block m_block of one (document, head): the key tiles from the diagonal down, then the
        epilogue. Returns the pipeline states and MMA atoms (loop-carried when persistent).
        pair_len (short_pairs) > 0: warpgroup 1's rows are the next document's (short_pair_bounds), and it
        masks the first document's keys 0..63. bounds (separate keys): cross_tile's (q_base, q_lo, q_hi,
        k_start, k_len); doc_start and doc_len are unused: the keys end at k_len (the masks), tile row
        128 m_block + r is query row q_base + that, stored when q_lo <= it < q_hi."""
        pipe_q, pipe_k, pipe_v, pipe_s = pipes
        q_state, k_state, v_state, s_state = states
        n_tiles = m_block + 1  # key tiles 0..m_block; tiles past the diagonal are skipped
        row_lo = None  # separate keys: the first tile coordinate stored
        if cutlass.const_expr(bounds is not None):
            doc_len = bounds[4]  # the masks' key end, until the epilogue
        key_lo = None  # the diagonal tile's first visible key column
        if cutlass.const_expr(pair_len is not None):
            key_lo = Int32(0)
            if wg == 1:
                doc_start, doc_len = short_pair_bounds(doc_start, doc_len, pair_len)
                if pair_len > 0:
                    key_lo = Int32(WG_ROWS)
        self.init_rows(frags, rowst, row_in_blk, scale_log2, m_block, wg)
        acc_o = frags[5]
        acc_o.fill(0.0)

        pipe_q.consumer_wait(q_state)
        q_slot = wg
        if cutlass.const_expr(self.persistent):
            q_slot = wg + 2 * q_state.index

        if cutlass.const_expr(self.pingpong and not self.persistent):
            self.pingpong_start(wg)

        if cutlass.const_expr(self.overlap):
            # Intra-warpgroup overlap (FA3): S of tile n+1 and P V of tile n are issued together,
            # then the softmax of tile n+1 runs while the tensor cores work on both.
            # the diagonal tile: S, softmax, P (its P V is issued with the next tile's S)
            k_state, s_state = self.s_softmax_p(
                True, m_block, frags, rowst, qk_mma, sScale, pipe_k, pipe_s, k_state, s_state, doc_len, wg, q_slot,
                key_lo,
            )
            for i in cutlass.range(1, n_tiles, unroll=1):
                # the MMA atoms carry their ACCUMULATE field as staged state: rebinding them here
                # makes them loop-carried, so the epilogue's GEMM may use them after the loop
                k_state, v_state, s_state, qk_mma, pv_mma = self.overlap_step(
                    m_block - i, frags, rowst, qk_mma, pv_mma, sScale, pipe_k, pipe_v, pipe_s,
                    k_state, v_state, s_state, doc_len, wg, q_slot,
                )
            if cutlass.const_expr(self.persistent):
                pipe_q.consumer_release(q_state)  # every S GEMM of the tile is done: the next Q may land
                q_state.advance()
            v_state = self.overlap_epilogue(frags, rowst, pv_mma, pipe_v, v_state, wg)
        else:
            k_state, v_state, s_state = self.tile_step(
                True, m_block, frags, rowst, qk_mma, pv_mma, sScale, pipe_k, pipe_v, pipe_s,
                k_state, v_state, s_state, doc_len, wg, q_slot, key_lo,
            )
            for i in cutlass.range(1, n_tiles, unroll=1):
                k_state, v_state, s_state = self.tile_step(
                    False, m_block - i, frags, rowst, qk_mma, pv_mma, sScale, pipe_k, pipe_v, pipe_s,
                    k_state, v_state, s_state, doc_len, wg, q_slot,
                )
            if cutlass.const_expr(self.persistent):
                pipe_q.consumer_release(q_state)
                q_state.advance()

        if cutlass.const_expr(self.pingpong and not self.persistent):
            self.pingpong_end(wg)

        # ---- epilogue: O = acc * (r/256) / l (bf16), LSE = ln2 * (m + log2 l)
        if cutlass.const_expr(bounds is not None):
            doc_start, row_lo, doc_len = bounds[0], bounds[1], bounds[2]  # the query side
        for v1 in cutlass.range_constexpr(2):
            f = self.row_final(v1, rowst, row_in_blk, mLSE, head, doc_start, doc_len, row_lo)
            self.store_o_row(v1, f, acc_o, row_in_blk[v1], mO, head, doc_start, doc_len, row_lo)
        return (q_state, k_state, v_state, s_state), qk_mma, pv_mma

    @cute.jit
    def init_rows(self, frags, rowst, row_in_blk, scale_log2, m_block, wg):
        """The row statistics of query block m_block before its first key tile."""
        tScS = frags[8]
        rs, m_run, l_run, r_run, c_pend = rowst
        for v1 in cutlass.range_constexpr(2):
            row_in_blk[v1] = m_block * TILE + wg * WG_ROWS + tScS[2 * v1][0]
            rs[v1] = scale_log2  # times the staged sQ in the diagonal softmax
            m_run[v1] = -Float32.inf
            l_run[v1] = Float32(0.0)
            r_run[v1] = Float32(0.0)  # no kept tile yet (see softmax: the fold reference)

    @cute.jit
    def row_final(self, v1, rowst, row_in_blk, mLSE, head, doc_start, doc_len, row_lo=None):
        """Row v1's LSE = ln2 * (m + log2 l), stored (rows < doc_len, and >= row_lo when given); returns
        O's factor r / 256 / l (0 for an empty row)."""
        rs, m_run, l_run, r_run, c_pend = rowst
        l_tot = quad_sum(l_run[v1])
        f = Float32(0.0)
        lse = -Float32.inf
        if not (l_tot <= Float32(0.0)):  # a NaN sum (a non-finite input's row) gives NaN O and LSE
            f = (abs(r_run[v1]) / Float32(P_SCALE)) / l_tot
            lse = row_lse(m_run[v1], l_tot)
        row = row_in_blk[v1]
        if cutlass.const_expr(row_lo is not None):
            if row >= row_lo:
                if row < doc_len:
                    if cute.arch.lane_idx() % 4 == 0:
                        mLSE[doc_start + row, head] = lse
        else:
            if row < doc_len:
                if cute.arch.lane_idx() % 4 == 0:
                    mLSE[doc_start + row, head] = lse
        return f

    @cute.jit
    def store_o_row(self, v1, f, acc_o, row, mO, head, doc_start, doc_len, row_lo=None):
        """Row v1 of O = acc_o * f in bf16. Lane t of a quad holds columns 8j + 2t, +1 (one bf16x2 word
        per j). Four consecutive j are transposed across the quad so lane t owns the 16 contiguous
        bytes at column 32G + 8t: one st.global.v4 instead of eight 2-byte stores. Every lane
        shuffles; only the store is predicated (the row is quad-uniform)."""
        D = self.D
        quad = cute.arch.lane_idx() % 4
        odd_lane = quad % 2 == 1
        hi_lane = quad >= 2

        def shfl_xor(x, k):
            return Uint32(cute.arch.shuffle_sync_bfly(x, offset=k))

        def sel(c, a, b):
            return Uint32(cutlass.select_(c, a, b))

        o_row_stride = mO.stride[0]  # H * D elements
        row_addr = mO.iterator.toint() + (Int64(doc_start + row) * Int64(o_row_stride) + Int64(head * D + 8 * quad)) * 2
        for G in cutlass.range_constexpr(cute.size(acc_o) // 16):
            w = [
                cvt_bf16x2(acc_o[2 * v1 + 4 * (4 * G + jj)] * f, acc_o[1 + 2 * v1 + 4 * (4 * G + jj)] * f)
                for jj in range(4)
            ]
            ow = quad_transpose4(w, odd_lane, hi_lane, shfl_xor, sel)
            if cutlass.const_expr(row_lo is not None):  # separate keys: rows from row_lo on
                if row >= row_lo:
                    if row < doc_len:
                        st_global_v4(row_addr + 64 * G, ow)
            else:
                if row < doc_len:
                    st_global_v4(row_addr + 64 * G, ow)
    # ------------------------------------------------------------------------------------------
    # Tile phases. Both schedules run the same phases on the same data; only the order of
    # independent work differs, so P, the row statistics and O are the same numbers.
    @cute.jit
    def gemm_qk(self, qk_mma, frags, k_state, q_slot):
        """Issue S = Q K^T for the K tile in stage k_state (async; the caller commits). q_slot: this
        warpgroup's 64 Q rows in sQ (the warpgroup index, plus 2 per Q stage when persistent)."""
        tSrQ, tSrK, tOrV, acc_s, acc_t, acc_o, tOrP, tOrP32, tScS = frags
        for k in cutlass.range_constexpr(self.D // 32):
            qk_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(qk_mma, acc_s, tSrQ[None, None, k, q_slot], tSrK[None, None, k, k_state.index], acc_s)

    @cute.jit
    def gemm_pv(self, pv_mma, frags, v_state):
        """Issue O_tile = P V (P from registers) into the fresh tile accumulator acc_t (async)."""
        tSrQ, tSrK, tOrV, acc_s, acc_t, acc_o, tOrP, tOrP32, tScS = frags
        for k in cutlass.range_constexpr(TILE // 32):
            pv_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(pv_mma, acc_t, tOrP[None, None, k], tOrV[None, None, k, v_state.index], acc_t)

    @cute.jit
    def softmax(self, diag: cutlass.Constexpr, n, frags, rowst, sScale, s_state, doc_len, wg, key_lo=None):
        """Online softmax (log2 domain) of acc_s = S and the P values with the V scale folded in.

        Leaves p * sV * 256 / r (fp32) in acc_s and updates the row statistics. The running
        output's factor c = alpha * r_prev / r goes to c_pend: the caller applies it as
        O = O * c + O_tile in one FFMA per element when this tile's P V has landed. A row whose
        fold reference r (the max V scale of its visible keys) is below
        max(r_prev * FOLD_DROP, FOLD_REF_MIN) is dropped from P V (P = 0 there, the reference stays):
        an all-zero V tile (scale 2^-126) would make 256 / r and r_prev / r overflow.
        diag: the diagonal tile (first), the only one with a mask and the one whose stage holds the
        block's Q scales; key_lo (short_pairs): its columns below key_lo are masked too (the other
        document's keys), and its V scales start key_lo rows later (scale_rows: the other document's
        are 0 there). The caller waits for and releases the scale stage s_state.
        """
        tn, wm = TILE, WG_ROWS
        tSrQ, tSrK, tOrV, acc_s, acc_t, acc_o, tOrP, tOrP32, tScS = frags
        rs, m_run, l_run, r_run, c_pend = rowst
        n_acc_s = cute.size(acc_s)
        lim = diagonal_key_end(doc_len, n * tn)  # diagonal tile: visible keys are col < lim and col <= row
        # Block-scaled off-diagonal tile: it is exactly one 128-key scale block, so the K and V
        # scales are constant over it: sK folds into the row factor and w / r == 1.
        uniform = cutlass.const_expr((not diag) and self.diag_copy)
        if cutlass.const_expr(diag):
            for v1 in cutlass.range_constexpr(2):  # the block's Q scales, staged by the scale warp
                rs[v1] = rs[v1] * sScale[self.q_row0 + wg * wm + tScS[2 * v1][0], s_state.index]
        sk_t = sScale[0, s_state.index]
        w_t = sScale[tn, s_state.index]
        # this warpgroup's V scales: a paired second document reads 64 rows on (scale_rows), where the
        # first document's keys have scale 0
        v_base = tn
        if cutlass.const_expr(diag and key_lo is not None):
            v_base = tn + key_lo
        # Both rows of the thread in one pass over its columns: each column's scales are loaded
        # once and are dead right after (no 32 x 2 scale registers kept between passes; that
        # matters while a P V accumulator is in flight). Max is exact, so its order is free;
        # each row's sum keeps the column order v2, v0.
        row_s = [[], []]  # the values each row's max runs over
        row_w = [[], []]
        for v2 in cutlass.range_constexpr(n_acc_s // 4):
            for v0 in cutlass.range_constexpr(2):
                col = tScS[v0 + 4 * v2][1]
                if cutlass.const_expr(uniform):
                    for v1 in cutlass.range_constexpr(2):
                        row_s[v1].append(acc_s[v0 + 2 * v1 + 4 * v2])
                else:
                    sk = sScale[col, s_state.index]
                    sw = sScale[v_base + col, s_state.index]
                    for v1 in cutlass.range_constexpr(2):
                        a = v0 + 2 * v1 + 4 * v2
                        s = acc_s[a] * sk
                        w = sw
                        if cutlass.const_expr(diag):  # the leakage-safe mask (mask.py): score -inf, V scale 0
                            s, w = hide_invisible((s, w), (-Float32.inf, Float32(0.0)), col, tScS[a][0] + wg * wm,
                                                  lim, key_lo, self.causal)
                        acc_s[a] = s
                        row_s[v1].append(s)
                        row_w[v1].append(w)
        tmax = two_row_max(row_s)
        if cutlass.const_expr(not uniform):
            # w >= 0, so the max over the row's w equals fmax(0, ...) of the serial form
            wmax = two_row_max(row_w)  # 0: no visible key (dropped below)
        rsv = [rs[0], rs[1]]
        m_safe = [Float32(0.0), Float32(0.0)]
        inv = [Float32(0.0), Float32(0.0)]
        alphas = [Float32(0.0), Float32(0.0)]
        for v1 in cutlass.range_constexpr(2):
            tm = tmax[v1]
            r = w_t
            if cutlass.const_expr(uniform):
                rsv[v1] = rs[v1] * sk_t
            else:
                r = wmax[v1]
            # rsv > 0: max(s) * rsv rounded up is at least every s * rsv (P <= 1 at any magnitude)
            m_new, ms, alpha = online_max(m_run[v1], row_max_up(tm, rsv[v1]))
            m_safe[v1] = ms
            # running output: softmax correction times the fold change r_prev / r (exact)
            c, inv_r, r_new = fold_reference(r_run[v1], r, alpha)
            inv[v1] = inv_r
            r_run[v1] = r_new
            c_pend[v1] = c
            alphas[v1] = alpha
            m_run[v1] = m_new
        psum = [Float32(0.0), Float32(0.0)]
        # uniform tiles: P * 256 = exp2(x + 8) saves a multiply per element (P_SCALE = 2^8)
        m_off = [m_safe[0], m_safe[1]]
        if cutlass.const_expr(uniform):
            m_off = [offset_up(m_safe[0], P_SCALE_LOG2), offset_up(m_safe[1], P_SCALE_LOG2)]
        for v2 in cutlass.range_constexpr(n_acc_s // 4):
            for v0 in cutlass.range_constexpr(2):
                col = tScS[v0 + 4 * v2][1]
                sw = w_t
                if cutlass.const_expr(not uniform):
                    sw = sScale[v_base + col, s_state.index]
                for v1 in cutlass.range_constexpr(2):
                    a = v0 + 2 * v1 + 4 * v2
                    p = cute.math.exp2(acc_s[a] * rsv[v1] - m_off[v1], fastmath=True)
                    psum[v1] = psum[v1] + p
                    if cutlass.const_expr(uniform):
                        acc_s[a] = p
                    else:
                        acc_s[a] = (p * sw) * inv[v1]  # p = 0 first: a masked key's sw * inv may overflow
        for v1 in cutlass.range_constexpr(2):
            ps = psum[v1]
            if cutlass.const_expr(uniform):
                ps = ps * Float32(1.0 / P_SCALE)  # exact: a power of two
            l_run[v1] = l_run[v1] * alphas[v1] + ps

    @cute.jit
    def convert_p(self, frags, r_run, uniform: cutlass.Constexpr):
        """P: fp32 accumulator layout (acc_s) -> e4m3 A-operand registers (tOrP); V^T comes in
        P-fragment key order, so this is 32 conversions and nothing else. Uniform tiles leave P
        unscaled (w / r == 1), so a dropped row (r_run < 0, see softmax) has its bytes zeroed here
        (16 ANDs; a branch over the row's fp32 values spilled). Register i holds row i % 2
        (a_fragment_sources)."""
        tSrQ, tSrK, tOrV, acc_s, acc_t, acc_o, tOrP, tOrP32, tScS = frags
        pack_a_fragment_e4m3(acc_s, tOrP32)
        if cutlass.const_expr(uniform):
            # only after an all-zero V tile following normal ones: tested once per warp, so the common
            # path carries none of the selects
            dropped = (f32_bits(r_run[0]) | f32_bits(r_run[1])) >> 31
            if cute.arch.vote_any_sync(dropped != Uint32(0)):
                self._zero_dropped_rows(tOrP32, r_run)

    @cute.jit
    def _zero_dropped_rows(self, tOrP32, r_run):
        keep = [Uint32(~(f32_bits(r_run[v1]) >> 31)) for v1 in range(2)]  # ~0, or 0 if dropped
        for i in cutlass.range_constexpr(cute.size(tOrP32)):
            tOrP32[i] = tOrP32[i] & keep[i % 2]

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def tile_step(
        self, diag: cutlass.Constexpr, n, frags, rowst, qk_mma, pv_mma, sScale, pipe_k, pipe_v, pipe_s,
        k_state, v_state, s_state, doc_len, wg, q_slot, key_lo=None,
    ):
        """One key tile n, serially: S, softmax, P, P V. diag: the diagonal tile (first)."""
        k_state, s_state = self.s_softmax_p(diag, n, frags, rowst, qk_mma, sScale, pipe_k, pipe_s, k_state, s_state,
                                            doc_len, wg, q_slot, key_lo)

        # ---- O_tile = P V in a fresh accumulator, promoted into the fp32 running output
        pipe_v.consumer_wait(v_state)
        warpgroup.fence()
        self.gemm_pv(pv_mma, frags, v_state)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        pipe_v.consumer_release(v_state)
        v_state.advance()
        self.accumulate_o(frags, rowst[4])
        return k_state, v_state, s_state

    @cute.jit
    def pingpong_start(self, wg):
        """Warpgroup 0 issues first: warpgroup 1 pre-arrives on warpgroup 0's barrier."""
        if wg == 1:
            cute.arch.barrier_arrive(barrier_id=1, number_of_threads=256)

    @cute.jit
    def pingpong_end(self, wg):
        """Consume warpgroup 1's last arrive (it arrives once more than warpgroup 0 waits)."""
        if wg == 0:
            cute.arch.barrier(barrier_id=1, number_of_threads=256)

    @cute.jit
    def wait_turn(self, wg):
        """Ping-pong (FA3's warp scheduler barrier): wait until the other warpgroup has issued."""
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=1 + wg, number_of_threads=256)

    @cute.jit
    def pass_turn(self, wg):
        """Ping-pong: let the other warpgroup issue its GEMMs."""
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier_arrive(barrier_id=2 - wg, number_of_threads=256)

    @cute.jit
    def accumulate_o(self, frags, c):
        """O = O * c + O_tile (one FFMA per element): rescale and promotion of the fresh tile sum."""
        tSrQ, tSrK, tOrV, acc_s, acc_t, acc_o, tOrP, tOrP32, tScS = frags
        for j in cutlass.range_constexpr(cute.size(acc_o) // 4):
            for v1 in cutlass.range_constexpr(2):
                for v0 in cutlass.range_constexpr(2):
                    a = v0 + 2 * v1 + 4 * j
                    acc_o[a] = acc_o[a] * c[v1] + acc_t[a]

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def s_softmax_p(
        self, diag: cutlass.Constexpr, n, frags, rowst, qk_mma, sScale, pipe_k, pipe_s, k_state, s_state, doc_len,
        wg, q_slot, key_lo=None,
    ):
        """S = Q K^T for key tile n, its online softmax (log2 domain) and P cast to the A registers
        with the V scale folded in; the factor c for O goes to c_pend (applied when P V lands)."""
        pipe_k.consumer_wait(k_state)
        self.wait_turn(wg)
        warpgroup.fence()
        self.gemm_qk(qk_mma, frags, k_state, q_slot)
        warpgroup.commit_group()
        self.pass_turn(wg)  # the other warpgroup may issue its GEMMs while this one does the softmax
        pipe_s.consumer_wait(s_state)
        warpgroup.wait_group(0)
        pipe_k.consumer_release(k_state)
        k_state.advance()
        self.softmax(diag, n, frags, rowst, sScale, s_state, doc_len, wg, key_lo)
        pipe_s.consumer_release(s_state)
        s_state.advance()
        self.convert_p(frags, rowst[3], (not diag) and self.diag_copy)
        return k_state, s_state

    @cute.jit
    def overlap_step(
        self, n, frags, rowst, qk_mma, pv_mma, sScale, pipe_k, pipe_v, pipe_s,
        k_state, v_state, s_state, doc_len, wg, q_slot,
    ):
        """Overlap schedule, off-diagonal tile n: issue S_n and P_prev V_prev, softmax of S_n
        while P V runs, then O = O * c_prev + O_tile(prev) and P_n."""
        rs, m_run, l_run, r_run, c_pend = rowst
        k_state = self.issue_s_with_pv(qk_mma, pv_mma, frags, pipe_k, pipe_v, pipe_s, k_state, v_state, s_state, wg,
                                       q_slot)
        c_prev = [c_pend[0], c_pend[1]]  # the factor of the tile whose P V is in flight
        # reads and writes acc_s only (and the row statistics): P V reads tOrP, writes acc_t
        self.softmax(False, n, frags, rowst, sScale, s_state, doc_len, wg)
        pipe_s.consumer_release(s_state)
        s_state.advance()
        warpgroup.wait_group(0)
        pipe_v.consumer_release(v_state)
        v_state.advance()
        # the serial schedule's operation for the previous tile: O = O * c_prev + O_tile
        self.accumulate_o(frags, c_prev)
        self.convert_p(frags, r_run, self.diag_copy)
        return k_state, v_state, s_state, qk_mma, pv_mma

    @cute.jit
    def issue_s_with_pv(self, qk_mma, pv_mma, frags, pipe_k, pipe_v, pipe_s, k_state, v_state, s_state, wg, q_slot):
        """Overlap schedule: issue S for the K tile in k_state and P V of the previous tile (its P in
        the A registers) back to back, wait for S alone (groups retire in order; P V may still run)
        and for the tile's scales. Returns the advanced K state."""
        pipe_k.consumer_wait(k_state)
        pipe_v.consumer_wait(v_state)
        self.wait_turn(wg)
        warpgroup.fence()
        self.gemm_qk(qk_mma, frags, k_state, q_slot)
        warpgroup.commit_group()
        self.gemm_pv(pv_mma, frags, v_state)
        warpgroup.commit_group()
        self.pass_turn(wg)
        pipe_s.consumer_wait(s_state)
        warpgroup.wait_group(1)
        pipe_k.consumer_release(k_state)
        k_state.advance()
        return k_state

    @cute.jit
    def overlap_epilogue(self, frags, rowst, pv_mma, pipe_v, v_state, wg):
        """Overlap schedule: P V of the last tile, O = O * c_last + O_tile."""
        pipe_v.consumer_wait(v_state)
        self.wait_turn(wg)
        warpgroup.fence()
        self.gemm_pv(pv_mma, frags, v_state)
        warpgroup.commit_group()
        self.pass_turn(wg)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(v_state)
        v_state.advance()
        self.accumulate_o(frags, rowst[4])
        return v_state


# ----------------------------------------------------------------------------------------------
# Compile and launch
# ----------------------------------------------------------------------------------------------


_F8, _F32, _I32, _BF16 = ARG_F8, ARG_F32, ARG_I32, ARG_BF16
# The runtime entry's parameters (FlamiaFwdSm90.__call__) for compile_cache.compile_launcher
ARG_KINDS = (
    _F8, _F32, _F8, _F32, _F8, _F32, _F8, _F32, _F8, _F32,  # q, sq, k, sk, v, sv, k_tok, sk_tok, v_tok, sv_tok
    _I32, _BF16, _F32, _I32,  # cu_seqlens, out, lse, tile counter (persistent; else any int32 pointer)
    ("i32",), ("i32",), ("i32",), ("i32",), ("i32",), ("f32",),  # T, T_dt, Hk, num_docs, grid_x, scale
    _I32, ("i32",),  # cu_seqlens_k and the key tokens T_k (separate keys; else unused)
    ("stream",),
)


def compile_fwd_sm90(config: FwdConfig, arch: str = "sm_90a", extra_options: str = "", tvm_ffi: bool = False):
    """cute.compile the forward for `arch` from plain values only (no tensors, no GPU needed).

    tvm_ffi: compile for TVM-FFI calls (raw int/float arguments, explicit stream handle).
    """
    return compile_entry(FlamiaFwdSm90(config), ARG_KINDS, arch, extra_options, tvm_ffi)


def get_compiled(config: FwdConfig, arch: str | None = None):
    """The JitExecutor-callable kernel (DSL pointer objects; see flamia_fwd_sm90 for the fast path)."""
    from ..compile_cache import compile_cached, target_arch

    arch = arch or target_arch()
    return compile_cached(SOURCE_FILES, config, arch, lambda cfg, a: compile_fwd_sm90(cfg, a))


def get_launcher(config: FwdConfig, arch: str | None = None, use_tvm_ffi: bool | None = None):
    """launch(*raw) in ARG_KINDS order: TVM-FFI when available (see compile_cache.compile_launcher)."""
    from ..compile_cache import compile_launcher, target_arch

    return compile_launcher(
        SOURCE_FILES, config, arch or target_arch(), lambda cfg, a, t: compile_fwd_sm90(cfg, a, tvm_ffi=t), ARG_KINDS,
        use_tvm_ffi,
    )


def kernel_artifacts(config: FwdConfig, arch: str = "sm_90a", tvm_ffi: bool = False):
    """PTX, cubin, SASS (when nvdisasm exists) and register/stack usage, for tests and inspection."""
    from ..compile_cache import compile_artifacts

    return compile_artifacts(lambda cfg, a, opts: compile_fwd_sm90(cfg, a, opts, tvm_ffi=tvm_ffi), config, arch)



def flamia_fwd_sm90(
    q_td, sq, k_td, sk, v_dt, sv, k_tok_td, sk_tok, v_tok_dt, sv_tok,
    cu_seqlens, max_seqlen: int, softmax_scale: float, config: FwdConfig, poison_outputs: bool = False,
    dt_cu_seqlens=None, cu_seqlens_k=None,
):
    """Causal FP8 attention forward on the current stream; returns (out bf16 (T,H,D), lse fp32 (H,T)).

    q_td (T, H, D), k_td (T, Hk, D) e4m3; v_dt (Hk, D, T_dt) e4m3 tokens contiguous, document b
    from column dt_cu_seqlens[b] (quant.quantize layout: T_dt = transposed_tokens(T, num_docs),
    unused columns 0);
    scales (heads, T) fp32 powers of two. k_tok_td/sk_tok/v_tok_dt/sv_tok: the per-token copies
    used on the diagonal tile when config.diagonal_copy (else ignored: pass None or the same).
    Self-attention only: one cu_seqlens (int32, num_docs + 1) for queries and keys, with
    cu_seqlens[-1] == T (not checked: it would synchronize). max_seqlen >= every document length.
    poison_outputs: fill out/lse with NaN first (tests: every element must be written).
    dt_cu_seqlens: accepted for compatibility and unused: the kernel derives every document's start
    column in v_dt (quant.dt_cu_seqlens(cu_seqlens)) from cu_seqlens itself.
    Host cost: one kernel launch, two allocations, no torch ops on cu_seqlens when it is already
    int32 on the device; the launch goes through TVM-FFI when apache-tvm-ffi is installed.
    config.separate_keys (cross_length, or causal=False): cu_seqlens holds the query documents
    (max_seqlen their longest) and cu_seqlens_k the key documents (as many), K, V and their scales
    have T_k = cu_seqlens_k[-1] tokens and v_dt transposed_tokens(T_k, num_docs) columns.
    """
    T, H, D = q_td.shape
    Hk = k_td.shape[1]
    num_docs = cu_seqlens.numel() - 1
    if config.separate_keys != (cu_seqlens_k is not None):
        raise ValueError("cu_seqlens_k: needed exactly when config.separate_keys (cross_length or causal=False)")
    if cu_seqlens_k is not None and cu_seqlens_k.shape != cu_seqlens.shape:
        raise ValueError(f"cu_seqlens_k must have as many documents as cu_seqlens ({num_docs}), got "
                         f"{cu_seqlens_k.numel() - 1}")
    Tk = k_td.shape[0] if config.separate_keys else T
    if config.persistent and num_docs > PERSISTENT_MAX_DOCS:
        config = per_tile_fallback(config)  # the chunk table would not fit in shared memory
    if D != config.head_dim or H != Hk * config.qhead_per_kvhead:
        raise ValueError(f"shapes (H={H}, Hk={Hk}, D={D}) do not match {config}")
    if not config.diagonal_copy or k_tok_td is None:
        if config.diagonal_copy:
            raise ValueError("config.diagonal_copy needs k_tok_td, sk_tok, v_tok_dt, sv_tok")
        k_tok_td, sk_tok, v_tok_dt, sv_tok = k_td, sk, v_dt, sv
    f8 = torch.float8_e4m3fn
    T_dt = v_dt.shape[2]
    checks = [("q_td", q_td, (T, H, D), f8), ("k_td", k_td, (Tk, Hk, D), f8), ("v_dt", v_dt, (Hk, D, T_dt), f8),
              ("sq", sq, (H, T), torch.float32), ("sk", sk, (Hk, Tk), torch.float32),
              ("sv", sv, (Hk, Tk), torch.float32)]
    if k_tok_td is not k_td:
        checks += [("k_tok_td", k_tok_td, (Tk, Hk, D), f8), ("v_tok_dt", v_tok_dt, (Hk, D, T_dt), f8),
                   ("sk_tok", sk_tok, (Hk, Tk), torch.float32), ("sv_tok", sv_tok, (Hk, Tk), torch.float32)]
    dev = q_td.device
    check_kernel_tensors(checks, dev)
    if T_dt != transposed_tokens(Tk, num_docs):
        raise ValueError(f"v_dt's token dim must be transposed_tokens({'T_k' if config.separate_keys else 'T'}, "
                         f"num_docs) = {transposed_tokens(Tk, num_docs)}, got {T_dt}")
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    if dt_cu_seqlens is not None and dt_cu_seqlens.shape != cu_seqlens.shape:
        raise ValueError(f"dt_cu_seqlens must have num_docs + 1 = {cu_seqlens.numel()} entries, "
                         f"got {tuple(dt_cu_seqlens.shape)}")
    cu = int32_cu_seqlens(cu_seqlens, dev)
    cu_k = int32_cu_seqlens(cu_seqlens_k, dev) if config.separate_keys else cu
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(H, T, dtype=torch.float32, device=dev)
    if poison_outputs:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    max_m_blocks = (int(max_seqlen) + TILE - 1) // TILE
    # causal cross-length tiles are 128-position blocks of the key axis: one more than the queries' own
    extra_tile = int(config.separate_keys and config.causal)
    if T == 0 or num_docs == 0 or max_m_blocks == 0:
        return out, lse
    if Tk == 0:  # no document has a key (no TMA tensor of 0 tokens): every query sees none
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    if H > 65535 or num_docs > 65535:
        raise ValueError(f"grid too large: {H} query heads of q or {num_docs} documents of cu_seqlens "
                         "(at most 65535 each)")
    sched_ptr = cu.data_ptr()  # unused unless persistent
    grid_x = max_m_blocks + extra_tile
    if config.persistent:
        tiles = min(max_chunks(T, num_docs) + extra_tile * num_docs, num_docs * (max_m_blocks + extra_tile))
        grid_x = min(sm_count(dev), H * tiles)
        # the tile counter starts at 0 every call (one per call: no state shared between streams)
        counter = torch.zeros(1, dtype=torch.int32, device=dev)
        sched_ptr = counter.data_ptr()
    launch_on_device(
        get_launcher(config), dev,
        q_td.data_ptr(), sq.data_ptr(), k_td.data_ptr(), sk.data_ptr(), v_dt.data_ptr(), sv.data_ptr(),
        k_tok_td.data_ptr(), sk_tok.data_ptr(), v_tok_dt.data_ptr(), sv_tok.data_ptr(), cu.data_ptr(),
        out.data_ptr(), lse.data_ptr(), sched_ptr, T, T_dt, Hk, num_docs, grid_x, scale_log2_f32(softmax_scale),
        cu_k.data_ptr(), Tk,
    )
    return out, lse
