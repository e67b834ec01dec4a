"""FP8 causal attention forward for Hopper (sm_90a) over packed documents, in the CuTe DSL.

Numerics: the spec is `flamia_cute.emulator.emulate_forward` for recipes fp8_token and
fp8_tokenblock (per-token Q scales; K/V scales per token or per 128-token document-local
block; a per-token K/V copy on the diagonal tile when blocks are used).

Organization (persistent by default: one CTA per SM takes (document, query head, 128-query block)
tiles from a global atomic counter, documents in order, heads, then blocks longest first; warp 0
publishes each tile to the other roles through a shared-memory ring and loads the next tile's Q
(two Q stages), K and V while the consumers finish the current one; `persistent=False`: one CTA
per tile):
- warp 0 of the producer warpgroup issues TMA loads of Q (two 64-row boxes) and of K and V
  tiles (separate K and V pipelines, `kv_stages` deep); the diagonal tile (processed first)
  comes from the per-token copies when `diagonal_copy`;
- warp 1 of the producer warpgroup copies the tile's K and V scales (the 128 fp32 of each)
  into shared memory through its own pipeline: the scale rows are only 4-byte aligned at a
  document start, which TMA cannot address;
- two consumer warpgroups own query rows 0-63 and 64-127. Per key tile, from the diagonal
  down: S = Q K^T (wgmma e4m3, fp32), online softmax in the log2 domain, P cast to e4m3 with
  the V scale folded in (r = max visible V scale of the row in the tile), P converted
  straight into the A-operand registers (V^T comes in P-fragment key order, quant.PV_ORDER16,
  so no data moves between threads), P V (wgmma e4m3, A from registers, B = V^T tile with
  tokens contiguous) into a fresh fp32 tile accumulator, then O = O * c + O_tile (one FFMA
  per element): the fp8 tensor-core accumulation is promoted once per 128 keys;
- a named-barrier ping-pong orders the two warpgroups' GEMM issue (FA3's warp scheduler
  barrier) so one warpgroup's softmax overlaps the other's MMAs;
- intra-warpgroup overlap (config.intra_wg_overlap, FA3): S of tile n+1 and P V of tile n are
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
Self-attention only (cu_seqlens_q == cu_seqlens_k): the runtime entry takes one cu_seqlens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import Float8E4M3FN, Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from . import recipes as _recipes
from .compile_cache import compile_entry, launch_on_device, sm_count
from .quant import transposed_tokens
from .recipes import FOLD_DROP, FOLD_REF_MIN
from .schedules import varlen_tiles as _varlen_tiles
from .schedules.varlen_chunks import max_chunks
from .schedules.varlen_tiles import LPT_MAX_DOCS, TILE_ORDERS, short_pairs_worth
from .sm90_device import (
    ARG_BF16,
    ARG_F8,
    ARG_F32,
    ARG_I32,
    SHARED_SOURCE_FILES,
    as_f32,
    bf16_abs_max_bits,
    claim_next_tile,
    cvt_bf16x2,
    cvt_e4m3x4,
    doc_chunk_cumsum,
    document_dt_start,
    exp2_poly,
    f32_bits,
    finish_tile_claim,
    fmax_chains,
    issue_tile_claim,
    locate_tile,
    pack_a_fragment_e4m3,
    pow2_reciprocal,
    pow2_scale_bits,
    publish_tile,
    quad_max2,
    quad_sum,
    quad_transpose4,
    rank_documents_longest_first,
    read_tile,
    select,
    short_pair_bounds,
    smem_word_index,
    st_global_v2,
    st_global_v4,
    tma_pipeline,
    warp_pipeline,
)
from .validation import check_kernel_tensors, int32_cu_seqlens

# recipes.py holds FOLD_DROP and FOLD_REF_MIN: a change there must recompile
SOURCE_FILES = (Path(__file__).resolve(), Path(_recipes.__file__).resolve(), Path(_varlen_tiles.__file__).resolve(),
                *SHARED_SOURCE_FILES)

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
P_SCALE = 256.0  # the recipe's fixed power-of-two P scale: P * 256 <= 256 < 448
P_SCALE_LOG2 = math.log2(P_SCALE)  # exact: P_SCALE is a power of two
# Persistent schedule: tile hand-off ring depth, the most documents whose chunk table fits in shared
# memory (4 KB; more documents fall back to the one-CTA-per-tile launch), the table scan's barrier
# (1 and 2 are the ping-pong's)
SCHED_STAGES = 2
PERSISTENT_MAX_DOCS = 1024
SCAN_BARRIER = 3
# row_sum_mma: 8 rows below each V^T stage (row 0 of them 1.0, rows 1-7 zero; never written by TMA),
# so P V (N = D + 8) also sums P in its column D
ONES_ROWS = 8
E4M3_ONE_X4 = 0x38383838  # four e4m3 1.0 bytes
if LPT_MAX_DOCS != 128:  # rank_documents_longest_first: one document per producer-warpgroup thread
    raise ImportError(f"schedules.varlen_tiles.LPT_MAX_DOCS must be 128 (got {LPT_MAX_DOCS})")


def per_tile_fallback(cfg):
    """The one-CTA-per-tile build of a persistent config (more documents than its tables hold): the
    persistent-only options off, the Q stages back to their per-tile default."""
    return replace(cfg, persistent=False, overlap_tiles=False, claim_ahead=False, q_stages=None, short_pairs=False)


def smem_bytes(cfg) -> int:
    """Shared memory of one CTA (upper bound): Q tile, K and V stages, their scale vectors, the
    pin_softmax stores, barriers and alignment."""
    tile = cfg.tile_m * cfg.head_dim * cfg.q_stages
    tables = {"documents": 2, "heavy_first": 3, "longest_documents": 4}[cfg.tile_order] + int(cfg.short_pairs)
    table = tables * 4 * (PERSISTENT_MAX_DOCS + 1) + 128 if cfg.persistent else 0
    scales = (2 * cfg.tile_n + (cfg.tile_m if cfg.stage_tile_inputs else 0)) * 4 * cfg.kv_stages
    ones = cfg.kv_stages * cfg.tile_n * ONES_ROWS if cfg.row_sum_mma else 0
    # fuse_q_quant: the bf16 Q tiles and the Q stages' row scales
    bf16_stages = 2 if cfg.persistent else 1
    fused_q = (bf16_stages * cfg.tile_m * cfg.head_dim * 2 + cfg.tile_m * 4 * cfg.q_stages) if cfg.fuse_q_quant else 0
    return tile + 2 * cfg.kv_stages * cfg.tile_n * cfg.head_dim + scales + table + ones + fused_q + 2048


def overlap_default(head_dim: int, diagonal_copy: bool) -> bool:
    """intra_wg_overlap's default: on where the sm_90a build has no spills (tests check it).

    Block-scaled recipes (diagonal_copy) have tile-constant K/V scales off the diagonal, and the
    overlapped softmax fits in 240 registers with the P V accumulator in flight (64+64+64+16
    fp32/e4m3 registers at D=128). The per-token recipe also needs each column's K and V scale
    there: 147 spill instructions at D=128, 0-13 at D=64 (depending on pingpong), so it stays serial.
    """
    return bool(diagonal_copy)


def pingpong_default(head_dim: int, diagonal_copy: bool) -> bool:
    """pingpong's default. Off for the block-scaled D=128 build: measured on the H200 in three runs of
    session 9 (s9a-s9c, same run against on), 1.6-2.9% faster on 1x16k, 1x64k, 4x4k, mixed16k and
    longtail32k, even on 16x1k: with the overlapped schedule the barrier only delays the second
    warpgroup's issue. Elsewhere on (not re-measured since session 2)."""
    return not (head_dim == 128 and diagonal_copy)


@dataclass(frozen=True)
class FwdConfig:
    """Compile-time shape of the forward kernel. Everything else (T, heads, documents) is dynamic."""

    head_dim: int
    qhead_per_kvhead: int = 1  # GQA group: query head h reads kv head h // group
    diagonal_copy: bool = False  # fp8_tokenblock: per-token K/V copy on the diagonal tile
    tile_m: int = 128
    tile_n: int = 128
    kv_stages: int = 2
    num_consumer_warpgroups: int = 2
    # Order the two consumer warpgroups' GEMM issue (FA3 style). None: pingpong_default.
    pingpong: bool | None = None
    # Issue S of tile n+1 with P V of tile n, softmax while both run (FA3). None: the default, on
    # where it compiles without register spills (overlap_default), else off.
    intra_wg_overlap: bool | None = None
    # Overlap schedule: store the row sums to shared memory before the P V wait, so ptxas keeps the
    # softmax's exp2 ahead of that wait instead of sinking it past (it cannot see the wgmma
    # latency). Measured on the H200 (perf/RESULTS.md): 2-5% SLOWER on every workload, so off by
    # default; `flamia-cute tune` still searches it.
    pin_softmax: bool = False
    # Uniform (block-scaled) tiles zero a dropped row's P bytes (the zero-V rule, recipes.FOLD_DROP).
    # True: the selects only under a warp-uniform branch taken when a row of the warp is dropped
    # (vote.any), bitwise the same P; False: 16 selects on every tile (the off-diagonal loop grew
    # 543 -> 575 SASS instructions with the rule, the 1x16k kernel 1.37 -> 1.47 ms). Measured on the
    # H200 (run s7a, same run): True is 0.8% faster on 1x16k, 1.2% on 4x4k, 0.3-0.8% on 1x64k and
    # longtail32k, +0.3% on 16x1k (noise): less than the predicted half of the 7%.
    drop_branch: bool = True
    # Each row's max over its 32 values as this many interleaved FMNMX chains (sm90_device.fmax_chains).
    # 1 is the serial chain of sessions 1-8: ncu s9a put a third of the off-diagonal tile's stall
    # samples on that chain and the row statistics after it.
    max_chains: int = 4
    # Block-scaled off-diagonal tiles: exp2 of one in this many column groups (4 of a thread's 64
    # values per group of 16) by a degree-3 polynomial on the FMA pipe (sm90_device.exp2_poly)
    # instead of MUFU.EX2; 0: all on MUFU. ncu s9b: the two consumer warps of a scheduler shared its
    # MUFU through a third of the tile time. P differs from MUFU's by <= 8.3e-5 relative there (the
    # backward recomputes P with MUFU: the two passes' P then differ by that much on those columns).
    # Measured (s9c, s9e, s9g): 1 in 8 -0.6% geomean (+1.4% on 1x64k), 1 in 4 and more slower.
    exp2_poly_every: int = 0
    # One CTA per SM taking (document, head, query block) tiles from a global counter (schedules'
    # order: documents, heads, blocks longest first), the next tile's Q, K, V loading while the
    # current one finishes; two Q stages. False: one CTA per tile (the hardware schedules them).
    # More than PERSISTENT_MAX_DOCS documents fall back to one CTA per tile. Measured (run s10a,
    # kernel alone, O bit-identical): -10% on 1x16k, -5% on 1x64k, -14..-19% on the short-document
    # workloads (16x1k 0.178 -> 0.145 ms).
    persistent: bool = True
    # How persistent CTAs take tiles: "counter" (the next tile from a global atomic counter when a CTA
    # is free: dynamic, the default) or "stride" (CTA c takes tiles c, c + grid, ...: no atomics, no
    # counter to zero, but the order's per-document cost pattern then lands unevenly on the CTAs).
    tile_claim: str = "counter"
    # Persistent, overlapped schedule: the next tile's diagonal S is issued with this tile's last P V
    # and its softmax runs while that P V computes; this tile's O is stored after (the intra-warpgroup
    # overlap carried across tile boundaries, so a tile's start no longer waits for the previous
    # tile's last P V, and vice versa). Same operations on the same data: O and LSE unchanged.
    overlap_tiles: bool = False
    # Persistent tile order: "documents" (documents, heads, blocks longest first), "heavy_first"
    # (the same over every (document, head)'s heavier half of blocks first, then the lighter halves:
    # the last tiles claimed are short; each group's K/V is read twice; perf/schedule_model.py) or
    # "longest_documents" (LPT across documents: by chunk count, most first, ranked in the kernel for
    # up to LPT_MAX_DOCS documents, the given order beyond; then as "documents").
    tile_order: str = "documents"
    # A tile's inputs staged by the producers: the TMA warp publishes the document's start and length
    # with the tile, and the scale warp loads the tile's per-row Q scales into the diagonal step's
    # scale stage (its K/V scale loads in two halves, not four dependent round trips), so the
    # consumers start a tile with no global loads. False (sessions 1-10): they load cu_seqlens and
    # then sQ (two dependent global loads) at every tile's start, which ncu (s11c) found waiting
    # after the first S GEMM on one-step tiles. Measured (s11e, kernel alone, medians of three
    # rotated rounds, O bit-identical): 16x1k -8.4%, 1x64k -7.7%, longtail32k -4.3%, 4x4k -0.8%,
    # mixed16k 0%, 1x16k +1% (within its round-to-round spread).
    stage_tile_inputs: bool = True
    # With the counter claim: the TMA warp issues its next claim before the current tile's loads and
    # reads it after them (the atomic's round trip under the loads' barrier waits), so each CTA holds
    # one tile claimed ahead. Built for session 12's profile (s11h: 54 stall samples on the claim's
    # result on one-step tiles); not yet run on the GPU.
    claim_ahead: bool = False
    # Q tiles in flight: None picks 2 when persistent (the next tile's Q loads under this one), 1 per
    # tile. 3 (persistent, +16 KB at d128) lets tile t+2's Q load before tile t's finishes: built for
    # session 12 (s11h: one-step tiles waited on Q's barrier at their start); not yet run on the GPU.
    q_stages: int | None = None
    # Block-scaled off-diagonal tiles: the softmax row sum on the tensor core (the recipe's
    # row_sum="cast_p"). P V runs with N = D + 8 over 8 constant rows below each V^T stage (row D is
    # 1.0, the others zero), so its column D sums the cast P that P V weighs and the 64 FADDs per
    # thread and tile leave the issue slots. The diagonal tile (P carries the per-token V scale fold
    # there) and dropped rows keep the fp32 sum. Measured on the H200 (kernel alone, rotated rounds):
    # 1..6% SLOWER on every workload (s14e; a separate m64n8 wgmma against a ones tile, s14b-s14c,
    # 2..8%): 8% fewer instructions, but the longer P V sits on the latency-bound chain. Opt-in.
    row_sum_mma: bool = False
    # Q quantized in the kernel: the TMA warp loads Q's bf16 tile and producer warps 2-3 (idle
    # otherwise) write its e4m3 codes into the Q stage with the per-token scales of
    # quant.quantize_thd (bit-exact with the Q/K/V launch), plus the codes and scales to global
    # memory for the backward. The Q/K/V launch then quantizes K and V only: it stops reading Q
    # (2 bytes) and writing its codes (1 byte) per element, ~27% of its bytes. Needs the staged
    # tile inputs and one tile at a time (no overlap_tiles). Inputs: flamia_fwd_sm90(q_bf16=...).
    fuse_q_quant: bool = False
    # Persistent: two short documents share one query tile, one per consumer warpgroup (schedules.
    # varlen_tiles.short_pair_partner: documents 2i and 2i + 1 when 2i fills exactly 64 V^T columns
    # and 2i + 1 holds at most 64 tokens). The tile's K is two 64-row boxes, one per document; the
    # V^T box already holds both; the second warpgroup masks the first document's keys. A paired
    # document's rows see exactly the keys and scales of its own tile: O and LSE bit-identical.
    short_pairs: bool = False
    # Staged tile inputs without fuse_q_quant: the global round trips in which the scale warp stages
    # the diagonal step's Q, K and V scales, the first step of every tile and the one the consumers
    # wait for. 3 (sessions 11-22): Q's rows, then the K/V scales in two halves; 2: one trip per
    # 64-row half, Q and K/V together (the pair build's way, which must take it: its halves come
    # from two documents); 1: every load of the step at once (spill-free). Measured (s23b, s23c,
    # kernel alone, rotated rounds, O bit-identical): 2 against 3: 16x1k -4.0%, 128x128 -5.9%,
    # longtail32k and mixed16k -1.2%, 4x4k -2.8% / +1.6%, 1x16k and 1x64k within +-0.3%; 1 is slower
    # than 3 (+2..+6%, not explained: not profiled). None: 2 where allowed, else 3.
    diagonal_scale_trips: int | None = None

    def __post_init__(self):
        def bad(name, msg):
            raise ValueError(f"FwdConfig.{name}: {msg} (got {getattr(self, name)!r})")

        if self.head_dim not in (64, 128):
            bad("head_dim", "must be 64 or 128 (256 would need more than 240 registers per thread)")
        if self.qhead_per_kvhead < 1:
            bad("qhead_per_kvhead", "must be >= 1")
        if not isinstance(self.exp2_poly_every, int) or not 0 <= self.exp2_poly_every <= 16:
            bad("exp2_poly_every", "must be an int in 0..16 (0: every exp2 on MUFU)")
        if self.max_chains not in (1, 2, 4, 8):
            bad("max_chains", "must be 1, 2, 4 or 8")
        if self.tile_n != 128:
            bad("tile_n", "must be 128: the recipe's key tile defines the P scale fold")
        if self.tile_m != 128:
            bad("tile_m", "must be 128 (= tile_n: the diagonal tile is then exactly one key tile)")
        if self.num_consumer_warpgroups != 2:
            bad("num_consumer_warpgroups", "must be 2 (64 query rows each)")
        if not 2 <= self.kv_stages <= 4:
            bad("kv_stages", "must be 2, 3 or 4")
        if not isinstance(self.diagonal_copy, bool):
            bad("diagonal_copy", "must be a bool")
        if self.pingpong is None:
            object.__setattr__(self, "pingpong", pingpong_default(self.head_dim, self.diagonal_copy))
        if not isinstance(self.pingpong, bool):
            bad("pingpong", "must be a bool or None")
        if self.intra_wg_overlap is None:
            object.__setattr__(self, "intra_wg_overlap", overlap_default(self.head_dim, self.diagonal_copy))
        if not isinstance(self.intra_wg_overlap, bool):
            bad("intra_wg_overlap", "must be a bool or None")
        if not isinstance(self.pin_softmax, bool):
            bad("pin_softmax", "must be a bool")
        if not isinstance(self.drop_branch, bool):
            bad("drop_branch", "must be a bool")
        if not isinstance(self.persistent, bool):
            bad("persistent", "must be a bool")
        if self.tile_claim not in ("counter", "stride"):
            bad("tile_claim", "must be 'counter' or 'stride'")
        if self.tile_order not in TILE_ORDERS:
            bad("tile_order", f"must be one of {TILE_ORDERS}")
        if not isinstance(self.overlap_tiles, bool):
            bad("overlap_tiles", "must be a bool")
        if not isinstance(self.stage_tile_inputs, bool):
            bad("stage_tile_inputs", "must be a bool")
        if not isinstance(self.claim_ahead, bool):
            bad("claim_ahead", "must be a bool")
        if self.claim_ahead and not (self.persistent and self.tile_claim == "counter"):
            bad("claim_ahead", "needs persistent=True and tile_claim='counter'")
        if self.q_stages is None:
            object.__setattr__(self, "q_stages", 2 if self.persistent else 1)
        if self.q_stages not in ((2, 3) if self.persistent else (1,)):
            bad("q_stages", "must be 2 or 3 when persistent, 1 with one CTA per tile (or None)")
        if self.overlap_tiles and not (self.persistent and self.intra_wg_overlap):
            bad("overlap_tiles", "needs persistent=True and the intra-warpgroup overlap")
        if not isinstance(self.row_sum_mma, bool):
            bad("row_sum_mma", "must be a bool")
        if not isinstance(self.fuse_q_quant, bool):
            bad("fuse_q_quant", "must be a bool")
        if self.fuse_q_quant and not fuse_q_quant_supported(self):
            bad("fuse_q_quant", "needs stage_tile_inputs=True, overlap_tiles=False, claim_ahead=False (it claims "
                "each tile's successor before the tile's K/V loads itself) and short_pairs=False")
        if not isinstance(self.short_pairs, bool):
            bad("short_pairs", "must be a bool")
        if self.short_pairs and not (self.persistent and self.stage_tile_inputs and not self.overlap_tiles
                                     and not self.fuse_q_quant):
            bad("short_pairs", "needs persistent=True, stage_tile_inputs=True, overlap_tiles=False and "
                "fuse_q_quant=False (the pair's bounds travel with the published tile)")
        if self.diagonal_scale_trips is None:
            trips = 2 if self.stage_tile_inputs and not self.fuse_q_quant else 3
            object.__setattr__(self, "diagonal_scale_trips", trips)
        if type(self.diagonal_scale_trips) is not int or self.diagonal_scale_trips not in (1, 2, 3):
            bad("diagonal_scale_trips", "must be 1, 2 or 3")
        if self.diagonal_scale_trips != 3 and not (self.stage_tile_inputs and not self.fuse_q_quant):
            bad("diagonal_scale_trips", "below 3 needs stage_tile_inputs=True and fuse_q_quant=False (the scale "
                "warp stages Q's scales only then)")
        if self.short_pairs and self.diagonal_scale_trips != 2:
            bad("diagonal_scale_trips", "must be 2 (or None) with short_pairs: a pair's halves come from two "
                "documents, one round trip each (at once, their addresses spill in the producers' 24 registers)")
        if self.row_sum_mma and not (self.diagonal_copy and self.drop_branch and not self.overlap_tiles):
            bad("row_sum_mma", "needs diagonal_copy=True (uniform off-diagonal tiles), drop_branch=True and "
                "overlap_tiles=False")


def short_pairs_default(total_tokens: int, num_docs: int) -> bool:
    """FwdConfig.short_pairs for a call, from what the host knows without a sync: on for packs of
    short documents (short_pairs_worth) that the persistent tables hold. (Up to session 22 it also
    took the pair build up to a mean of 1,024 tokens for its two-trip diagonal step, which every
    build has now: the unpaired one is then the faster where nothing pairs, 16x1k -1.7%, s23c.)"""
    return num_docs <= PERSISTENT_MAX_DOCS and short_pairs_worth(total_tokens, num_docs)


def fuse_q_quant_supported(cfg) -> bool:
    """Whether a forward config's schedule can take fuse_q_quant (its tile inputs staged, one tile at a
    time, no claim ahead: produce_tiles_q_ahead claims each tile's successor itself; no short pairs:
    that producer publishes no pair lengths)."""
    return cfg.stage_tile_inputs and not cfg.overlap_tiles and not cfg.claim_ahead and not cfg.short_pairs


def with_fused_q_quant(cfg):
    """cfg with fuse_q_quant on (fuse_q_quant_supported(cfg) must hold): producer warps 2-3 then stage
    Q's scales, so the scale warp's diagonal round trips go back to their automatic choice (3)."""
    return replace(cfg, fuse_q_quant=True, diagonal_scale_trips=None)


def q_quant_steps(head_dim: int) -> int:
    """fuse_q_quant: the steps in which a warp of warps 2-3 covers its 64 Q rows (D / 8 lanes a row)."""
    return 64 // (32 // (head_dim // 8))


def q_quant_lane(head_dim: int, warp, step, lane):
    """fuse_q_quant's map for warp `warp` (0, 1) of warps 2-3 at `step`: (row within the warp's 64 =
    the row in its Q slot, row of the 128-row tile, 8-value segment of the row). Plain Python over
    DSL or Python integers (the CPU test replays it on the Q stage layout)."""
    lanes_per_row = head_dim // 8
    r_wg = (32 // lanes_per_row) * step + lane // lanes_per_row
    return r_wg, 64 * warp + r_wg, lane % lanes_per_row


def q_stage_layout(head_dim: int, q_stages: int):
    """The e4m3 Q stages (2 per stage: one 64-row slot per consumer warpgroup), as wgmma reads them."""
    row_major = cutlass.tensor_utils.LayoutEnum.ROW_MAJOR
    return sm90_utils.make_smem_layout_a(row_major, (64, 128, head_dim), Float8E4M3FN, 2 * q_stages)


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


class FlamiaFwdSm90:
    def __init__(self, config: FwdConfig):
        self.cfg = config
        self.D = config.head_dim
        # P V's N and V^T's rows per stage: row_sum_mma adds the ones rows below V^T (column D sums P)
        self.d_pv = self.D + (ONES_ROWS if config.row_sum_mma else 0)
        self.group = config.qhead_per_kvhead
        self.diag_copy = config.diagonal_copy
        self.stages = config.kv_stages
        self.tile_n = config.tile_n
        self.wg_m = 64  # rows per consumer warpgroup (one m64 wgmma)
        self.num_threads = 128 * (1 + config.num_consumer_warpgroups)
        self.regs_producer = 24
        self.regs_consumer = 240
        self.pingpong = config.pingpong
        self.overlap = config.intra_wg_overlap
        self.pin = config.pin_softmax
        self.persistent = config.persistent
        self.q_stages = config.q_stages
        # scale stage rows: K and V scales per key (and, staged, Q's per row); tile ring words: block,
        # head, document (and, staged, its start and length)
        self.scale_rows = 2 * config.tile_n + (config.tile_m if config.stage_tile_inputs else 0)
        self.sched_rows = 6 if config.stage_tile_inputs else 4
        self.fuse_q = config.fuse_q_quant
        self.short_pairs = config.short_pairs
        # the TMA warp's Q ring: the e4m3 Q stages, or with fuse_q_quant one bf16 tile (warps 2-3
        # quantize it into an e4m3 stage; persistent: two, so the next tile's Q loads while this
        # tile's is being quantized: produce_tiles_q_ahead)
        self.tma_q_stages = (2 if self.persistent else 1) if self.fuse_q else config.q_stages

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
        qb_ptr: cute.Pointer,
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
        stream: cuda.CUstream,
    ):
        D, tn, wm = self.D, self.tile_n, self.wg_m
        H = num_kv_heads * self.group
        hd = cute.assume(H * D, divby=D)
        khd = cute.assume(num_kv_heads * D, divby=D)
        tdt = cute.assume(T_dt, divby=128)
        # (token, d, head): d contiguous, so the reduction of S = Q K^T is K-major for both
        mQ = cute.make_tensor(q_ptr, cute.make_layout((T, D, H), stride=(hd, 1, D)))
        # fuse_q_quant: Q in bf16 (the input; mQ and mSQ are then the kernel's outputs)
        mQb = cute.make_tensor(qb_ptr, cute.make_layout((T, D, H), stride=(hd, 1, D)))
        mK = cute.make_tensor(k_ptr, cute.make_layout((T, D, num_kv_heads), stride=(khd, 1, D)))
        mKt = cute.make_tensor(kt_ptr, cute.make_layout((T, D, num_kv_heads), stride=(khd, 1, D)))
        # V^T (d, column, head): tokens contiguous, K-major for O = P V. Document b starts at
        # column dt_cu_seqlens[b] (a multiple of DT_DOC_ALIGN >= 16: a TMA box on the contiguous axis must start
        # 16-byte aligned); columns between documents and past the last one are zero.
        vl = cute.make_layout((D, tdt, num_kv_heads), stride=(tdt, 1, cute.assume(D * tdt, divby=128)))
        mV = cute.make_tensor(v_ptr, vl)
        mVt = cute.make_tensor(vt_ptr, vl)
        mO = cute.make_tensor(o_ptr, cute.make_layout((T, D, H), stride=(hd, 1, D)))
        sl = cute.make_layout((T, H), stride=(1, T))
        skl = cute.make_layout((T, num_kv_heads), stride=(1, T))
        mSQ = cute.make_tensor(sq_ptr, sl)
        mLSE = cute.make_tensor(lse_ptr, sl)
        mSK = cute.make_tensor(sk_ptr, skl)
        mSV = cute.make_tensor(sv_ptr, skl)
        mSKt = cute.make_tensor(skt_ptr, skl)
        mSVt = cute.make_tensor(svt_ptr, skl)
        mCu = cute.make_tensor(cu_ptr, cute.make_layout(num_docs + 1))
        mSched = cute.make_tensor(sched_ptr, cute.make_layout(1))  # persistent: the tile counter

        K_MAJOR = OperandMajorMode.K
        qk_mma = sm90_utils.make_trivial_tiled_mma(
            Float8E4M3FN, Float8E4M3FN, K_MAJOR, K_MAJOR, Float32, (1, 1, 1), (wm, tn)
        )
        # row_sum_mma: N = D + 8, the ones rows below V^T (the row sum shares the A operand's one read)
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            Float8E4M3FN, Float8E4M3FN, K_MAJOR, K_MAJOR, Float32, (1, 1, 1), (wm, self.d_pv),
            warpgroup.OperandSource.RMEM,
        )
        row_major = cutlass.tensor_utils.LayoutEnum.ROW_MAJOR
        # Q: two 64-row "stages", one per consumer warpgroup
        sQ_layout = q_stage_layout(D, self.q_stages)
        sK_layout = sm90_utils.make_smem_layout_b(row_major, (wm, tn, D), Float8E4M3FN, self.stages)
        sV_layout = sm90_utils.make_smem_layout_b(row_major, (wm, self.d_pv, tn), Float8E4M3FN, self.stages)

        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tQ = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mQ, cute.slice_(sQ_layout, (None, None, 0)), (wm, D))
        sK1 = cute.slice_(sK_layout, (None, None, 0))
        # TMA fills the first D rows of a stage (the same 128-byte swizzle atoms: rows are 128 bytes apart)
        sV1 = cute.slice_(sm90_utils.make_smem_layout_b(row_major, (wm, D, tn), Float8E4M3FN, 1), (None, None, 0))
        tma_k, tK = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mK, sK1, (tn, D))
        tma_v, tV = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mV, sV1, (D, tn))
        tma_kt, tKt = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mKt, sK1, (tn, D))
        tma_vt, tVt = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mVt, sV1, (D, tn))
        # short_pairs: the diagonal K tile as two 64-row boxes (rows are whole 128-byte swizzle rows,
        # so a stage's first 64 rows are laid out as a 64-row tile)
        sKh = cute.slice_(sm90_utils.make_smem_layout_b(row_major, (wm, wm, D), Float8E4M3FN, 1), (None, None, 0))
        tma_kh, tKh = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mKt if self.diag_copy else mK, sKh, (wm, D))
        # bf16 Q for fuse_q_quant: two 64-row boxes, rows dense (no swizzle: only warps 2-3 read it,
        # a warp two whole rows at a time)
        sQb_layout = cute.make_layout((wm, D, 2 * self.tma_q_stages), stride=(D, 1, wm * D))
        tma_qb, tQb = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mQb, cute.slice_(sQb_layout, (None, None, 0)),
                                                             (wm, D))
        self.q_bytes = 2 * wm * D * (2 if self.fuse_q else 1)
        self.kv_bytes = tn * D

        stages = self.stages
        q_stages = self.q_stages
        persistent = self.persistent
        # the persistent schedule's ring and document tables, last (a few unused words otherwise)
        n_cum = PERSISTENT_MAX_DOCS + 1 if persistent else 4
        n_heavy = n_cum if self.cfg.tile_order == "heavy_first" else 4
        n_lpt = n_cum if self.cfg.tile_order == "longest_documents" else 4
        n_pair = n_cum if self.short_pairs else 4
        n_warp = 12 if self.cfg.tile_order == "heavy_first" else 8  # the scan's warp totals
        n_qb = 2 * wm * D * self.tma_q_stages if self.fuse_q else 8
        n_qs = 2 * wm * q_stages if self.fuse_q else 4

        @cute.struct
        class SharedStorage:
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2 * q_stages]
            k_mbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            v_mbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            s_mbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sScale: cute.struct.Align[cute.struct.MemRange[Float32, self.scale_rows * stages], 16]
            sPin: cute.struct.Align[cute.struct.MemRange[Float32, 256], 16]  # pin_softmax's stores
            sQ: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sV_layout)], 1024]
            t_mbar: cute.struct.MemRange[cutlass.Int64, 2 * SCHED_STAGES]
            sSched: cute.struct.Align[cute.struct.MemRange[Int32, self.sched_rows * SCHED_STAGES], 16]
            sWarp: cute.struct.Align[cute.struct.MemRange[Int32, n_warp], 16]
            sCum: cute.struct.Align[cute.struct.MemRange[Int32, n_cum], 16]
            sDt: cute.struct.Align[cute.struct.MemRange[Int32, n_cum], 16]
            sHeavy: cute.struct.Align[cute.struct.MemRange[Int32, n_heavy], 16]
            sLpt: cute.struct.Align[cute.struct.MemRange[Int32, n_lpt], 16]
            sOrder: cute.struct.Align[cute.struct.MemRange[Int32, n_lpt], 16]
            sPair: cute.struct.Align[cute.struct.MemRange[Int32, n_pair], 16]  # short_pairs: the partner lengths
            qb_mbar: cute.struct.MemRange[cutlass.Int64, 4]
            sQS: cute.struct.Align[cute.struct.MemRange[Float32, n_qs], 16]  # fused Q: each stage's row scales
            sQb: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, n_qb], 128]

        self.shared_storage = SharedStorage

        self.kernel(
            qk_mma, pv_mma,
            tma_q, tQ, tma_k, tK, tma_v, tV, tma_kt, tKt, tma_vt, tVt, tma_qb, tQb, tma_kh, tKh,
            mQ, mO, mLSE, mSQ, mSK, mSV, mSKt, mSVt, mCu, mSched,
            sQ_layout, sK_layout, sV_layout, sQb_layout, scale_log2,
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
        tma_qb: cute.CopyAtom,
        tQb: cute.Tensor,
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
        sQb_layout: cute.Layout,
        scale_log2: Float32,
    ):
        tn = self.tile_n
        tidx, _, _ = cute.arch.thread_idx()
        # Query block fastest in the launch order, heaviest (longest causal row) first: the CTAs
        # running together share one head's K/V in L2. Heads fastest (longest-first across the
        # grid) was measured 20-31% slower on the H200 (1x64k 24.2 -> 31.7 ms): 16 heads' K/V
        # in flight at once no longer fit in L2 (perf/NOTES.md, session 3).
        bidx, head, doc = cute.arch.block_idx()
        roles = (
            qk_mma, pv_mma, tma_q, tQ, tma_k, tK, tma_v, tV, tma_kt, tKt, tma_vt, tVt, tma_qb, tQb, tma_kh, tKh,
            mQ, mO, mLSE, mSQ, mSK, mSV, mSKt, mSVt, mCu, mSched, sQ_layout, sK_layout, sV_layout, sQb_layout,
            scale_log2,
        )
        if cutlass.const_expr(self.persistent):
            # tiles come from the scheduler (run_cta's producer warp): no tile of its own
            self.run_cta(roles, Int32(0), Int32(0), Int32(0), Int32(0), Int32(0))
        else:
            nblk_x, _, _ = cute.arch.grid_dim()
            m_block = nblk_x - 1 - bidx
            doc_start = mCu[doc]
            doc_len = mCu[doc + 1] - doc_start
            # Whole CTA leaves before any barrier when the block lies past the document end
            if m_block * tn < doc_len:
                self.run_cta(roles, head, doc, doc_start, doc_len, m_block)

    @cute.jit
    def run_cta(self, roles, head, doc, doc_start, doc_len, m_block):
        """Shared memory, pipelines and the warp roles of one CTA: the tile (head, doc, m_block), or
        when persistent the scheduler's tiles."""
        (qk_mma, pv_mma, tma_q, tQ, tma_k, tK, tma_v, tV, tma_kt, tKt, tma_vt, tVt, tma_qb, tQb, tma_kh, tKh,
         mQ, mO, mLSE, mSQ, mSK, mSV, mSKt, mSVt, mCu, mSched, sQ_layout, sK_layout, sV_layout, sQb_layout,
         scale_log2) = roles
        tn = self.tile_n
        tidx, _, _ = cute.arch.thread_idx()
        kv_head = head // self.group
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sScale = storage.sScale.get_tensor(cute.make_layout((self.scale_rows, self.stages)))
        sPin = storage.sPin.get_tensor(cute.make_layout(256))
        sQS = storage.sQS.get_tensor(cute.make_layout(2 * self.wg_m * self.q_stages))  # fuse_q_quant
        sV_tma = sV  # what TMA fills: all of each stage, or with row_sum_mma its first D rows
        if cutlass.const_expr(self.cfg.row_sum_mma):
            D, d_pv = self.D, self.d_pv
            # (d, key, stage) -> sV's own coordinate: the stage's first D rows
            rows = cute.make_layout((D, tn, self.stages), stride=(1, d_pv, d_pv * tn))
            sV_tma = storage.sV.get_tensor(cute.composition(sV_layout.outer, rows), swizzle=sV_layout.inner)
            # The ones rows of every stage: row D 1.0, rows D+1..D+7 zero (bytes D*128.. of the stage; the
            # swizzle moves 16-byte chunks within a row only). Written before the CTA's barrier below; the
            # fence makes the generic-proxy stores visible to wgmma's reads.
            if tidx < ONES_ROWS * tn // 4:
                words = cute.make_tensor(cute.recast_ptr(storage.sV.data_ptr(), dtype=Uint32),
                                         cute.make_layout(d_pv * tn * self.stages // 4))
                for st in cutlass.range_constexpr(self.stages):
                    words[(st * d_pv + D) * tn // 4 + tidx] = Uint32(
                        cutlass.select_(tidx < tn // 4, Uint32(E4M3_ONE_X4), Uint32(0)))
            cute.arch.fence_proxy("async.shared", space="cta")

        pipe_qb = None
        if cutlass.const_expr(self.fuse_q):
            # TMA -> bf16 tile -> warps 2-3 -> e4m3 Q stages (their stores, then the consumers' wgmma)
            pipe_qb = tma_pipeline(self.tma_q_stages, self.q_bytes, storage.qb_mbar.data_ptr(), consumer_warps=2)
            pipe_q = warp_pipeline(self.q_stages, storage.q_mbar.data_ptr(), producers=64)
        else:
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
        sHeavy = None
        sPair = None
        lpt_tables = None
        if cutlass.const_expr(self.persistent):
            # tile hand-off from the TMA warp to the scale warp and the consumers (32 + 256 threads)
            # (fuse_q_quant: and warps 2-3)
            pipe_t = warp_pipeline(SCHED_STAGES, storage.t_mbar.data_ptr(), consumers=288 + (64 if self.fuse_q else 0))
            sSched = storage.sSched.get_tensor(cute.make_layout((self.sched_rows, SCHED_STAGES)))
            sCum = storage.sCum.get_tensor(cute.make_layout(PERSISTENT_MAX_DOCS + 1))
            sDt = storage.sDt.get_tensor(cute.make_layout(PERSISTENT_MAX_DOCS + 1))
            if cutlass.const_expr(self.cfg.tile_order == "heavy_first"):
                sHeavy = storage.sHeavy.get_tensor(cute.make_layout(PERSISTENT_MAX_DOCS + 1))
            if cutlass.const_expr(self.short_pairs):
                sPair = storage.sPair.get_tensor(cute.make_layout(PERSISTENT_MAX_DOCS + 1))
            if cutlass.const_expr(self.cfg.tile_order == "longest_documents"):
                # (sOrder, sLpt): the position -> document map and the chunk prefix in that order
                lpt_tables = (storage.sOrder.get_tensor(cute.make_layout(PERSISTENT_MAX_DOCS + 1)),
                              storage.sLpt.get_tensor(cute.make_layout(PERSISTENT_MAX_DOCS + 1)))
            if wg_idx == 0:
                # each document's first chunk (locate_tile) and V^T column, by the producer warpgroup
                if cutlass.const_expr(sHeavy is None):
                    sWarp = storage.sWarp.get_tensor(cute.make_layout((4, 2), stride=(2, 1)))
                else:
                    sWarp = storage.sWarp.get_tensor(cute.make_layout((4, 3), stride=(3, 1)))
                doc_chunk_cumsum(mCu, cute.size(mCu) - 1, sCum, sDt, sWarp, tidx, 128, SCAN_BARRIER, tn, sHeavy,
                                 sPair)
                if cutlass.const_expr(lpt_tables is not None):
                    cute.arch.barrier(barrier_id=SCAN_BARRIER, number_of_threads=128)  # sCum complete
                    rank_documents_longest_first(sCum, cute.size(mCu) - 1, *lpt_tables, sWarp, tidx, 128, SCAN_BARRIER)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.regs_producer)
            if warp_idx == 0:
                tma_args = (tma_q, tQ, tma_k, tK, tma_v, tV, tma_kt, tKt, tma_vt, tVt, sQ, sK, sV_tma, pipe_q, pipe_k,
                            pipe_v, (tma_kh, tKh))
                if cutlass.const_expr(self.fuse_q):  # Q comes in bf16
                    tma_args = (tma_qb, tQb, tma_k, tK, tma_v, tV, tma_kt, tKt, tma_vt, tVt,
                                storage.sQb.get_tensor(sQb_layout), sK, sV_tma, pipe_qb, pipe_k, pipe_v, (tma_kh, tKh))
                if cutlass.const_expr(self.persistent and self.fuse_q):
                    self.produce_tiles_q_ahead(tma_args, mCu, mSched, mO.shape[2], pipe_t, sSched, sCum, sDt, sHeavy,
                                               lpt_tables)
                elif cutlass.const_expr(self.persistent):
                    self.produce_tiles(tma_args, mCu, mSched, mO.shape[2], pipe_t, sSched, sCum, sDt, sHeavy,
                                       lpt_tables, sPair)
                else:
                    self.load_tma(*tma_args, self.tma_states(), head, kv_head, doc_start, mCu, doc, None, m_block)
            if warp_idx == 1:
                s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                if cutlass.const_expr(self.persistent):
                    def scales_step(s_state, head, doc_start, doc_len, m_block, *pair):
                        return self.load_scales(mSK, mSV, mSKt, mSVt, sScale, pipe_s, s_state, head // self.group,
                                                doc_start, doc_len, m_block, mSQ, head, *pair)

                    self.for_each_published_tile(pipe_t, sSched, mCu, s_state, scales_step)
                else:
                    self.load_scales(mSK, mSV, mSKt, mSVt, sScale, pipe_s, s_state, kv_head, doc_start, doc_len, m_block,
                                     mSQ, head)
            if cutlass.const_expr(self.fuse_q):
                if warp_idx >= 2:
                    self.quantize_q_tiles(storage, sQ_layout, sQS, pipe_qb, pipe_q, pipe_t, sSched, mCu, mQ, mSQ,
                                          mO.shape[2], head, doc_start, doc_len, m_block)
        else:
            cute.arch.setmaxregister_increase(self.regs_consumer)
            self.consume(
                qk_mma, pv_mma, sQ, sK, sV, sScale, sPin, sQS, pipe_q, pipe_k, pipe_v, pipe_s,
                mO, mLSE, mSQ, mCu, scale_log2, head, doc_start, doc_len, m_block, wg_idx - 1, pipe_t, sSched,
            )

    def tma_states(self):
        """The TMA warp's fresh producer states of the Q, K and V pipelines."""
        return (
            pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.tma_q_stages),
            pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages),
            pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages),
        )

    @cute.jit
    def produce_tiles(self, tma_args, mCu, mSched, heads, pipe_t, sSched, sCum, sDt, sHeavy, lpt_tables, sPair=None):
        """Persistent TMA warp: take tiles (the first by CTA index, then from the global counter
        mSched[0], which the host zeroes per call, or every grid-th with tile_claim="stride"),
        publish each to the scale warp and consumers, issue its loads; an end mark (block -1) past
        the last tile. The tile order is locate_tile's (sHeavy: heavy_first; lpt_tables = (sOrder,
        sLpt): longest_documents, locate_tile over the ranked positions)."""
        num_docs, total, states, t_state, t = self.producer_start(mCu, heads, sCum)
        claim_ahead = self.cfg.claim_ahead
        if cutlass.const_expr(claim_ahead):
            got = issue_tile_claim(mSched)  # the CTA's second tile, claimed before its first loads
        while t < total:
            doc, head, m_block = self.tile_at(t, sCum, num_docs, heads, sHeavy, lpt_tables)
            doc_start = mCu[doc]
            bounds = (doc_start, mCu[doc + 1] - doc_start) if cutlass.const_expr(self.cfg.stage_tile_inputs) else None
            pair_len = None
            if cutlass.const_expr(self.short_pairs):
                pair_len = sPair[doc]  # (> 0 only for a document of one block)
                bounds = (*bounds, pair_len)
            t_state = publish_tile(pipe_t, sSched, t_state, m_block, head, doc, bounds)
            states = self.load_tma(*tma_args, states, head, head // self.group, doc_start, mCu, doc, sDt[doc], m_block,
                                   pair_len=pair_len)
            if cutlass.const_expr(self.cfg.tile_claim == "stride"):
                t = t + cute.arch.grid_dim()[0]
            elif cutlass.const_expr(claim_ahead):
                t = finish_tile_claim(got)  # issued a tile ago: back by now
                got = issue_tile_claim(mSched)
            else:
                t = claim_next_tile(mSched)
        end_bounds = (Int32(0), Int32(0)) if cutlass.const_expr(self.cfg.stage_tile_inputs) else None
        if cutlass.const_expr(self.short_pairs):
            end_bounds = (*end_bounds, Int32(0))
        publish_tile(pipe_t, sSched, t_state, Int32(-1), Int32(0), Int32(0), end_bounds)

    @cute.jit
    def producer_start(self, mCu, heads, sCum):
        """The persistent TMA warp's start: (documents, tiles in all, fresh Q/K/V ring states, tile
        ring state, its first tile = the CTA index)."""
        bidx, _, _ = cute.arch.block_idx()
        num_docs = cute.size(mCu) - 1
        t_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, SCHED_STAGES)
        return num_docs, heads * sCum[num_docs], self.tma_states(), t_state, Int32(bidx)

    @cute.jit
    def tile_at(self, t, sCum, num_docs, heads, sHeavy, lpt_tables):
        """Tile t of the order (locate_tile; lpt_tables: over the ranked positions): (doc, head, block)."""
        if cutlass.const_expr(lpt_tables is None):
            doc, head, m_block = locate_tile(t, sCum, num_docs, heads, sHeavy)
        else:
            position, head, m_block = locate_tile(t, lpt_tables[1], num_docs, heads)
            doc = lpt_tables[0][position]
        return doc, head, m_block

    @cute.jit
    def produce_tiles_q_ahead(self, tma_args, mCu, mSched, heads, pipe_t, sSched, sCum, sDt, sHeavy, lpt_tables):
        """produce_tiles for fuse_q_quant: each tile's successor is claimed, published and its bf16 Q
        loaded BEFORE the tile's K/V loads, so warps 2-3 quantize it while the tile runs. In
        produce_tiles' order (the next Q loaded after this tile's last K/V load, ~2 steps before its
        end) the quantization sat on the path: +6..7 µs per tile on every workload (s16a)."""
        num_docs, total, states, t_state, t = self.producer_start(mCu, heads, sCum)
        doc, head, m_block = self.tile_at(t, sCum, num_docs, heads, sHeavy, lpt_tables)
        doc_start = Int32(0)
        if t < total:
            doc_start = mCu[doc]
            t_state = publish_tile(pipe_t, sSched, t_state, m_block, head, doc, (doc_start, mCu[doc + 1] - doc_start))
            states = self.load_tma(*tma_args, states, head, head // self.group, doc_start, mCu, doc, sDt[doc], m_block,
                                   part="q")
        while t < total:
            if cutlass.const_expr(self.cfg.tile_claim == "stride"):
                t_next = t + cute.arch.grid_dim()[0]
            else:
                t_next = claim_next_tile(mSched)
            n_doc, n_head, n_block = self.tile_at(t_next, sCum, num_docs, heads, sHeavy, lpt_tables)
            n_start = Int32(0)
            if t_next < total:
                n_start = mCu[n_doc]
                t_state = publish_tile(pipe_t, sSched, t_state, n_block, n_head, n_doc,
                                       (n_start, mCu[n_doc + 1] - n_start))
                states = self.load_tma(*tma_args, states, n_head, n_head // self.group, n_start, mCu, n_doc,
                                       sDt[n_doc], n_block, part="q")
            states = self.load_tma(*tma_args, states, head, head // self.group, doc_start, mCu, doc, sDt[doc], m_block,
                                   part="kv")
            t = t_next
            doc = n_doc
            head = n_head
            m_block = n_block
            doc_start = n_start
        publish_tile(pipe_t, sSched, t_state, Int32(-1), Int32(0), Int32(0), (Int32(0), Int32(0)))

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load_tma(
        self, tma_q, tQ, tma_k, tK, tma_v, tV, tma_kt, tKt, tma_vt, tVt,
        sQ, sK, sV, pipe_q, pipe_k, pipe_v, k_half, states, head, kv_head, doc_start, mCu, doc, dt_start, m_block,
        part: cutlass.Constexpr = "all", pair_len=None,
    ):
        """Warp 0: TMA loads of query block m_block's Q and its key tiles, diagonal first. dt_start:
        the document's first V^T column, or None to sum it from cu_seqlens here. part: "all", or
        only "q" or "kv" (produce_tiles_q_ahead). pair_len (short_pairs): > 0 when the next document
        shares the tile: its Q rows and diagonal K rows are the second 64-row boxes (k_half: the
        64-row K atom). Returns the (q, k, v) pipeline states."""
        D, tn, wm = self.D, self.tile_n, self.wg_m
        q_state, k_state, v_state = states
        n_tiles = m_block + 1
        one = cute.make_layout(1)
        # document-local tiles: shift the token coordinate by the document start. Q and K are
        # token-major (the token is the outer, strided TMA coordinate: any start is fine); V^T's
        # token axis is the contiguous one, so its tiles start at the document's 16-aligned
        # column dt_start. The diagonal V tile may run past the document into zero pad, the next
        # document's columns, or past T_dt (TMA zero fill): always finite, and P = 0 there
        # (masked score and zero V scale), so it adds exactly 0.
        gQ = cute.local_tile(cute.domain_offset((doc_start, 0), tQ[None, None, head]), (wm, D), (None, 0))
        tQs, tQg = cute.nvgpu.cpasync.tma_partition(tma_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))

        def k_part(atom, t):
            g = cute.local_tile(cute.domain_offset((doc_start, 0), t[None, None, kv_head]), (tn, D), (None, 0))
            return cute.nvgpu.cpasync.tma_partition(atom, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(g, 0, 2))

        def v_part(atom, t, dt_start):
            g = cute.local_tile(cute.domain_offset((0, dt_start), t[None, None, kv_head]), (D, tn), (0, None))
            return cute.nvgpu.cpasync.tma_partition(atom, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(g, 0, 2))

        paired = None
        pair_start = None  # the second document's start, 64 rows back (its rows are the block's 64..127)
        if cutlass.const_expr(pair_len is not None):
            paired = pair_len > 0
            pair_start = mCu[doc + 1] - wm
        if cutlass.const_expr(part != "kv"):
            pipe_q.producer_acquire(q_state)
            for w in cutlass.range_constexpr(2):
                slot = w
                if cutlass.const_expr(self.persistent):
                    slot = w + 2 * q_state.index
                if cutlass.const_expr(pair_len is not None and w == 1):
                    gQp = cute.local_tile(cute.domain_offset((pair_start, 0), tQ[None, None, head]), (wm, D), (None, 0))
                    _, tQgp = cute.nvgpu.cpasync.tma_partition(tma_q, 0, one, cute.group_modes(sQ, 0, 2),
                                                               cute.group_modes(gQp, 0, 2))
                    if paired:  # the second document's first 64 rows
                        cute.copy(tma_q, tQgp[None, 1], tQs[None, slot], tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
                    else:
                        cute.copy(tma_q, tQg[None, 2 * m_block + w], tQs[None, slot],
                                  tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
                else:
                    cute.copy(tma_q, tQg[None, 2 * m_block + w], tQs[None, slot],
                              tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            q_state.advance()
        if cutlass.const_expr(part == "q"):
            return q_state, k_state, v_state
        # diagonal K tile first: from the per-token copy when the recipe has block scales
        tKs, tKg = k_part(tma_k, tK)
        tma_kd, tKds, tKdg = tma_k, tKs, tKg
        if cutlass.const_expr(self.diag_copy):
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
        if cutlass.const_expr(self.diag_copy):
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
        wm, D = self.wg_m, self.D
        one = cute.make_layout(1)
        # the stage's two 64-row halves: (64, D, half, stage)
        sKh = cute.flat_divide(sK, (wm, D))
        for w in cutlass.range_constexpr(2):
            start = doc_start if w == 0 else pair_start
            g = cute.local_tile(cute.domain_offset((start, 0), tKh[None, None, kv_head]), (wm, D), (None, 0))
            s_half = sKh[None, None, w, 0, None]
            tKs, tKg = cute.nvgpu.cpasync.tma_partition(tma_kh, 0, one, cute.group_modes(s_half, 0, 2),
                                                        cute.group_modes(g, 0, 2))
            cute.copy(tma_kh, tKg[None, w], tKs[None, k_state.index], tma_bar_ptr=pipe_k.producer_get_barrier(k_state))

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load_scales(self, mSK, mSV, mSKt, mSVt, sScale, pipe_s, s_state, kv_head, doc_start, doc_len, m_block,
                    mSQ, head, pair_len=None):
        """Warp 1: the K and V scales of each key tile of query block m_block into shared memory (0
        past the document end). With stage_tile_inputs also the block's per-row Q scales into the
        diagonal (first) step's stage (1 past the end), and a step's K/V loads in two halves, each
        issued before its stores (two global round trips per step; a whole step's loads at once spill
        in the producers' 24 registers); without (sessions 1-10), one 32-key chunk at a time.
        pair_len (short_pairs): rows and keys 64..127 of a paired tile are the second document's.
        Returns the pipeline state."""
        tn, tm = self.tile_n, self.cfg.tile_m
        staged = self.cfg.stage_tile_inputs
        lane = cute.arch.lane_idx()
        # the bounds of the block's second half (rows / keys 64..127): a short pair's second document
        # as if it started 64 tokens before its start, else the tile's own document
        hi_bounds = (doc_start, doc_len)
        if cutlass.const_expr(pair_len is not None):
            hi_bounds = short_pair_bounds(doc_start, doc_len, pair_len)
        for i in cutlass.range(m_block + 1, unroll=1):
            n = m_block - i
            pipe_s.producer_acquire(s_state)
            # (fewer than 3 trips: the scale warp stages Q's scales, and a pair build takes 2; FwdConfig checks)
            if cutlass.const_expr(self.cfg.diagonal_scale_trips < 3):
                if i == 0:
                    self.stage_diagonal(mSK, mSV, mSKt, mSVt, mSQ, sScale, s_state, kv_head, head, doc_start,
                                        doc_len, hi_bounds, m_block)
                else:  # off-diagonal steps: the tile's own document only
                    self.stage_key_scales(mSK, mSV, mSKt, mSVt, sScale, s_state, i, n, kv_head, doc_start, doc_len)
            else:
                if cutlass.const_expr(staged and not self.fuse_q):  # fused: warps 2-3 stage Q's scales
                    if i == 0:
                        for c in cutlass.range_constexpr(tm // 32):
                            row = m_block * tn + lane + 32 * c
                            sq = Float32(1.0)  # rows past the end: any finite positive scale (never stored)
                            if row < doc_len:
                                sq = mSQ[doc_start + row, head]
                            sScale[2 * tn + lane + 32 * c, s_state.index] = sq
                self.stage_key_scales(mSK, mSV, mSKt, mSVt, sScale, s_state, i, n, kv_head, doc_start, doc_len)
            pipe_s.producer_commit(s_state)  # every lane arrives: releases its own stores
            s_state.advance()
        return s_state

    @cute.jit
    def stage_key_scales(self, mSK, mSV, mSKt, mSVt, sScale, s_state, i, n, kv_head, doc_start, doc_len):
        """Step i's (key tile n's) K and V scales into its stage: staged, in two halves of loads each
        issued before its stores; else one 32-key chunk at a time."""
        tn = self.tile_n
        lane = cute.arch.lane_idx()
        per_group = tn // 64 if self.cfg.stage_tile_inputs else 1  # 32-key chunks loaded before their stores
        for g in cutlass.range_constexpr(tn // 32 // per_group):
            loaded = []
            for c in cutlass.range_constexpr(g * per_group, (g + 1) * per_group):
                sk, sv = self.key_scales(mSK, mSV, mSKt, mSVt, i, n * tn + lane + 32 * c, kv_head, doc_start, doc_len)
                loaded.append((c, sk, sv))
            for c, sk, sv in loaded:
                sScale[lane + 32 * c, s_state.index] = sk
                sScale[tn + lane + 32 * c, s_state.index] = sv

    @cute.jit
    def stage_diagonal(self, mSK, mSV, mSKt, mSVt, mSQ, sScale, s_state, kv_head, head, doc_start, doc_len,
                       hi_bounds, m_block):
        """The diagonal step's Q, K and V scales, each half's from its own document (hi_bounds: the
        second half's, a short pair's second document or the tile's own), in diagonal_scale_trips
        global round trips: 2, a runtime loop over the halves (unrolled, a pair's second document's
        bases spill in the producers' 24 registers); 1, both halves' loads before any store."""
        if cutlass.const_expr(self.cfg.diagonal_scale_trips == 1):
            loaded = self.diagonal_half_scales(mSK, mSV, mSKt, mSVt, mSQ, kv_head, head, doc_start, doc_len, m_block, 0)
            loaded += self.diagonal_half_scales(mSK, mSV, mSKt, mSVt, mSQ, kv_head, head, doc_start, doc_len, m_block,
                                                1)
            self.store_diagonal_scales(sScale, s_state, loaded)
        else:
            for h in cutlass.range(2, unroll=1):
                start = select(h == 0, doc_start, hi_bounds[0])
                length = select(h == 0, doc_len, hi_bounds[1])
                loaded = self.diagonal_half_scales(mSK, mSV, mSKt, mSVt, mSQ, kv_head, head, start, length, m_block, h)
                self.store_diagonal_scales(sScale, s_state, loaded)

    @cute.jit
    def diagonal_half_scales(self, mSK, mSV, mSKt, mSVt, mSQ, kv_head, head, start, length, m_block, h):
        """(key, Q scale, K scale, V scale) of the lane's keys in half h of the diagonal step."""
        tn = self.tile_n
        lane = cute.arch.lane_idx()
        loaded = []
        for cc in cutlass.range_constexpr(2):
            key = lane + 32 * cc + (tn // 2) * h
            row = m_block * tn + key  # (tile_m == tile_n: row and key offsets coincide)
            sq = Float32(1.0)  # rows past the end: any finite positive scale (never stored)
            if row < length:
                sq = mSQ[start + row, head]
            sk, sv = self.key_scales(mSK, mSV, mSKt, mSVt, 0, m_block * tn + key, kv_head, start, length)
            loaded.append((key, sq, sk, sv))
        return loaded

    @cute.jit
    def store_diagonal_scales(self, sScale, s_state, loaded):
        tn = self.tile_n
        for key, sq, sk, sv in loaded:
            sScale[2 * tn + key, s_state.index] = sq
            sScale[key, s_state.index] = sk
            sScale[tn + key, s_state.index] = sv

    @cute.jit
    def key_scales(self, mSK, mSV, mSKt, mSVt, i, key, kv_head, doc_start, doc_len):
        """(K scale, V scale) of one key of step i (0: the diagonal tile, whose block-scaled recipes
        read the per-token copies' scales); 0 past the document end."""
        sk = Float32(0.0)
        sv = Float32(0.0)
        if key < doc_len:
            if cutlass.const_expr(self.diag_copy):
                if i == 0:
                    sk = mSKt[doc_start + key, kv_head]
                    sv = mSVt[doc_start + key, kv_head]
                else:
                    sk = mSK[doc_start + key, kv_head]
                    sv = mSV[doc_start + key, kv_head]
            else:
                sk = mSK[doc_start + key, kv_head]
                sv = mSV[doc_start + key, kv_head]
        return sk, sv

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def quantize_q_tiles(self, storage, sQ_layout, sQS, pipe_qb, pipe_q, pipe_t, sSched, mCu, mQ, mSQ, heads,
                         head, doc_start, doc_len, m_block):
        """Warps 2-3 with fuse_q_quant: every tile's Q (persistent: as published, until the end mark;
        else the CTA's tile) from the bf16 tile to an e4m3 Q stage (quantize_q_tile)."""
        qb_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.tma_q_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        if cutlass.const_expr(self.persistent):
            def quantize_step(rings, head, doc_start, doc_len, m_block):
                return self.quantize_q_tile(storage, sQ_layout, sQS, pipe_qb, pipe_q, *rings, mQ, mSQ, heads, head,
                                            doc_start, doc_len, m_block)

            self.for_each_published_tile(pipe_t, sSched, mCu, (qb_state, q_state), quantize_step)
        else:
            self.quantize_q_tile(storage, sQ_layout, sQS, pipe_qb, pipe_q, qb_state, q_state, mQ, mSQ, heads, head,
                                 doc_start, doc_len, m_block)

    @cute.jit
    def quantize_q_tile(self, storage, sQ_layout, sQS, pipe_qb, pipe_q, qb_state, q_state, mQ, mSQ, heads, head,
                        doc_start, doc_len, m_block):
        """One tile's 128 Q rows, quantized as the Q/K/V launch does (per-token power-of-two scale
        from the row's |x| max, RNE to e4m3: bit-exact), into the e4m3 stage q_state (the layout the
        consumers' wgmma reads) and its row scales into sQS; rows inside the document also to
        global memory (the backward's operands). Warp w takes rows 64 w .., D / 8 lanes per row,
        8 values (16 bytes of bf16) per lane: its loads are whole rows, its stores whole 8-byte
        halves of the swizzle's 16-byte chunks. Returns the (bf16, e4m3) ring states."""
        D, wm, tm = self.D, self.wg_m, self.cfg.tile_m
        lanes_per_row = D // 8
        tidx, _, _ = cute.arch.thread_idx()
        warp = tidx // 32 - 2
        lane = cute.arch.lane_idx()
        qb_words = cute.make_tensor(cute.recast_ptr(storage.sQb.data_ptr(), dtype=Uint32),
                                    cute.make_layout(wm * D * self.tma_q_stages))
        q_words = cute.make_tensor(cute.recast_ptr(storage.sQ.data_ptr(), dtype=Uint32),
                                   cute.make_layout(cute.cosize(sQ_layout) // 4))
        row_elems = heads * D
        pipe_qb.consumer_wait(qb_state)
        pipe_q.producer_acquire(q_state)
        # two rows in flight per lane when persistent (the per-tile build spills 8 bytes at 2 in its
        # 24 registers; its Q is on the path at the CTA's start either way)
        for it in cutlass.range(q_quant_steps(D), unroll=2 if self.persistent else 1):
            r_wg, r, seg = q_quant_lane(D, warp, it, lane)
            x = [qb_words[(tm * qb_state.index + r) * (D // 2) + 4 * seg + j] for j in range(4)]
            sb, ib = pow2_scale_bits(bf16_abs_max_bits(x, lanes_per_row))
            inv = as_f32(ib)
            f = []
            for j in cutlass.range_constexpr(4):
                f += [as_f32(Int32(x[j] << 16)) * inv, as_f32(Int32(x[j] & Uint32(0xFFFF0000))) * inv]
            y = (cvt_e4m3x4(f[0], f[1], f[2], f[3]), cvt_e4m3x4(f[4], f[5], f[6], f[7]))
            dst = smem_word_index(sQ_layout, (r_wg, 8 * seg, 2 * q_state.index + warp), 1)
            q_words[dst] = y[0]
            q_words[dst + 1] = y[1]
            if seg == 0:
                sQS[tm * q_state.index + r] = as_f32(sb)
            row = m_block * tm + r
            if row < doc_len:
                tok = doc_start + row
                st_global_v2(mQ.iterator.toint() + Int64(tok) * Int64(row_elems) + Int64(head * D + 8 * seg), y)
                if seg == 0:
                    mSQ[tok, head] = as_f32(sb)
        cute.arch.fence_proxy("async.shared", space="cta")  # generic stores, then the consumers' wgmma
        pipe_q.producer_commit(q_state)
        pipe_qb.consumer_release(qb_state)
        q_state.advance()
        qb_state.advance()
        return qb_state, q_state

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consume(
        self, qk_mma, pv_mma, sQ, sK, sV, sScale, sPin, sQS, pipe_q, pipe_k, pipe_v, pipe_s,
        mO, mLSE, mSQ, mCu, scale_log2, head, doc_start, doc_len, m_block, wg, pipe_t, sSched,
    ):
        """The consumer warpgroups: one tile (head, doc, m_block), or when persistent every tile
        the producer warp publishes in sSched until its end mark (the arguments are then unused)."""
        tn, wm = self.tile_n, self.wg_m
        tidx, _, _ = cute.arch.thread_idx()
        ctid = tidx % 128
        qk_thr = qk_mma.get_slice(ctid)
        pv_thr = pv_mma.get_slice(ctid)
        tSrQ = qk_thr.make_fragment_A(qk_thr.partition_A(sQ))  # (MMA, 1, D/32, 2 * q_stages)
        tSrK = qk_thr.make_fragment_B(qk_thr.partition_B(sK))  # (MMA, 1, D/32, stages)
        tOrV = pv_thr.make_fragment_B(pv_thr.partition_B(sV))  # (MMA, 1, 4, stages)
        acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((wm, tn)))  # ((2,2,16),1,1)
        acc_t = pv_thr.make_fragment_C(pv_thr.partition_shape_C((wm, self.d_pv)))  # this tile's P V (and row sum)
        if cutlass.const_expr(self.cfg.row_sum_mma):
            # running output: acc_t's first D/2 values per thread (the same linear index; FFMAs only)
            acc_o = cute.make_rmem_tensor(cute.make_layout(self.D // 2), Float32)
        else:
            acc_o = pv_thr.make_fragment_C(pv_thr.partition_shape_C((wm, self.D)))  # running output
        tOrP = pv_thr.make_fragment_A(pv_thr.partition_shape_A((wm, tn)))  # ((4,2,2),1,4) e4m3
        tOrP32 = cute.recast_tensor(tOrP, Uint32)
        tScS = qk_thr.partition_C(cute.make_identity_tensor((wm, tn)))
        # row_sum_mma: acc_t's value index of row 0's column D (lane 0 of a quad; the others hold the
        # zero columns D+2.., D+4.., D+6..), row 1's is 2 further
        lsum = 4 * (self.D // 8) if self.cfg.row_sum_mma else None
        frags = (tSrQ, tSrK, tOrV, acc_s, acc_t, acc_o, tOrP, tOrP32, tScS, lsum)

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
                frags, rowst, row_in_blk, qk_mma, pv_mma, sScale, sPin, sQS, pipes, states, mO, mLSE, mSQ, scale_log2,
                head, doc_start, doc_len, m_block, wg,
            )
        else:
            # the ping-pong turns run on across tiles: started and ended once. Per tile they raced: a
            # warpgroup's last arrive of one tile and its pre-arrive for the next completed a named
            # barrier's generation before the other warpgroup's closing wait (which then hung)
            if cutlass.const_expr(self.pingpong):
                self.pingpong_start(wg)
            if cutlass.const_expr(self.cfg.overlap_tiles):
                self.consume_overlapped_tiles(frags, rowst, row_in_blk, qk_mma, pv_mma, sScale, sPin, pipes, states,
                                              mO, mLSE, mSQ, mCu, scale_log2, wg, pipe_t, sSched)
            else:
                def consume_step(states, head, doc_start, doc_len, m_block, *pair):
                    # the MMA atoms are not loop-carried here: every GEMM sets its ACCUMULATE field first
                    states, _, _ = self.consume_tile(
                        frags, rowst, row_in_blk, qk_mma, pv_mma, sScale, sPin, sQS, pipes, states, mO, mLSE, mSQ,
                        scale_log2, head, doc_start, doc_len, m_block, wg, *pair,
                    )
                    return states

                self.for_each_published_tile(pipe_t, sSched, mCu, states, consume_step)
            if cutlass.const_expr(self.pingpong):
                self.pingpong_end(wg)

    @cute.jit
    def consume_tile(
        self, frags, rowst, row_in_blk, qk_mma, pv_mma, sScale, sPin, sQS, pipes, states, mO, mLSE, mSQ, scale_log2,
        head, doc_start, doc_len, m_block, wg, pair_len=None,
    ):
        """Query block m_block of one (document, head): the key tiles from the diagonal down, then the
        epilogue. Returns the pipeline states and MMA atoms (loop-carried when persistent).
        pair_len (short_pairs) > 0: warpgroup 1's rows are the next document's (short_pair_bounds), and it
        masks the first document's keys 0..63."""
        tSrQ, tSrK, tOrV, acc_s, acc_t, acc_o, tOrP, tOrP32, tScS, lsum = frags
        rs, m_run, l_run, r_run, c_pend = rowst
        pipe_q, pipe_k, pipe_v, pipe_s = pipes
        q_state, k_state, v_state, s_state = states
        n_tiles = m_block + 1  # key tiles 0..m_block; tiles past the diagonal are skipped
        key_lo = None  # the diagonal tile's first visible key column
        if cutlass.const_expr(pair_len is not None):
            key_lo = Int32(0)
            if wg == 1:
                doc_start, doc_len = short_pair_bounds(doc_start, doc_len, pair_len)
                if pair_len > 0:
                    key_lo = Int32(self.wg_m)
        self.init_rows(frags, rowst, row_in_blk, mSQ, scale_log2, head, doc_start, doc_len, m_block, wg)
        acc_o.fill(0.0)

        pipe_q.consumer_wait(q_state)
        q_slot = wg
        if cutlass.const_expr(self.persistent):
            q_slot = wg + 2 * q_state.index
        if cutlass.const_expr(self.fuse_q):
            for v1 in cutlass.range_constexpr(2):  # the row scales warps 2-3 staged with the codes
                rs[v1] = rs[v1] * sQS[q_slot * self.wg_m + frags[8][2 * v1][0]]

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
            row_sum_mma = self.cfg.row_sum_mma
            for i in cutlass.range(1, n_tiles, unroll=1):
                # the MMA atoms carry their ACCUMULATE field as staged state: rebinding them here
                # makes them loop-carried, so the epilogue's GEMM may use them after the loop
                l_gate = None
                if cutlass.const_expr(row_sum_mma):
                    # i == 1: the diagonal's P V (its sum is in l already); else the row sum's unit 1/256
                    l_gate = Float32(cutlass.select_(i == 1, Float32(0.0), Float32(1.0 / P_SCALE)))
                k_state, v_state, s_state, qk_mma, pv_mma = self.overlap_step(
                    m_block - i, frags, rowst, qk_mma, pv_mma, sScale, sPin, pipe_k, pipe_v, pipe_s,
                    k_state, v_state, s_state, doc_len, wg, q_slot, l_gate=l_gate,
                )
            if cutlass.const_expr(self.persistent):
                pipe_q.consumer_release(q_state)  # every S GEMM of the tile is done: the next Q may land
                q_state.advance()
            l_gate = None
            if cutlass.const_expr(row_sum_mma):
                l_gate = Float32(cutlass.select_(n_tiles > 1, Float32(1.0 / P_SCALE), Float32(0.0)))
            v_state = self.overlap_epilogue(frags, rowst, pv_mma, pipe_v, v_state, wg, l_gate)
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
        for v1 in cutlass.range_constexpr(2):
            f = self.row_final(v1, rowst, row_in_blk, mLSE, head, doc_start, doc_len)
            self.store_o_row(v1, f, acc_o, row_in_blk[v1], mO, head, doc_start, doc_len)
        return (q_state, k_state, v_state, s_state), qk_mma, pv_mma

    @cute.jit
    def consume_overlapped_tiles(
        self, frags, rowst, row_in_blk, qk_mma, pv_mma, sScale, sPin, pipes, states, mO, mLSE, mSQ, mCu, scale_log2,
        wg, pipe_t, sSched,
    ):
        """Persistent consumers with overlap_tiles: the tiles as one stream of key-tile steps. Between
        query blocks, overlap_step(next_diag=True) issues the next block's diagonal S with this block's last P V;
        this block's O is stored once that P V has been added. The first block starts with the
        serial diagonal step (every GEMM and its atom update stay inside this one `if`: a staged
        atom update may not escape the region it was made in)."""
        acc_o = frags[5]
        rs, m_run, l_run, r_run, c_pend = rowst
        pipe_q, pipe_k, pipe_v, pipe_s = pipes
        q_state, k_state, v_state, s_state = states
        t_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, SCHED_STAGES)
        m_block, head, doc, doc_start, doc_len, t_state = self.read_tile_bounds(pipe_t, sSched, t_state)
        if m_block >= 0:
            doc_start, doc_len = self.tile_bounds(mCu, doc, doc_start, doc_len)
            self.init_rows(frags, rowst, row_in_blk, mSQ, scale_log2, head, doc_start, doc_len, m_block, wg)
            acc_o.fill(0.0)
            pipe_q.consumer_wait(q_state)
            k_state, s_state = self.s_softmax_p(
                True, m_block, frags, rowst, qk_mma, sScale, pipe_k, pipe_s, k_state, s_state, doc_len, wg,
                wg + 2 * q_state.index,
            )
            while m_block >= 0:
                q_slot = wg + 2 * q_state.index
                for i in cutlass.range(1, m_block + 1, unroll=1):
                    k_state, v_state, s_state, qk_mma, pv_mma = self.overlap_step(
                        m_block - i, frags, rowst, qk_mma, pv_mma, sScale, sPin, pipe_k, pipe_v, pipe_s,
                        k_state, v_state, s_state, doc_len, wg, q_slot,
                    )
                pipe_q.consumer_release(q_state)  # every S GEMM of this block is done
                q_state.advance()
                # this block's row results (final once its last softmax ran); the pending P V's factor
                f0 = self.row_final(0, rowst, row_in_blk, mLSE, head, doc_start, doc_len)
                f1 = self.row_final(1, rowst, row_in_blk, mLSE, head, doc_start, doc_len)
                rows = (row_in_blk[0], row_in_blk[1])
                c_prev = (c_pend[0], c_pend[1])
                n_block, n_head, n_doc, n_start, n_len, t_state = self.read_tile_bounds(pipe_t, sSched, t_state)
                if n_block >= 0:
                    n_start, n_len = self.tile_bounds(mCu, n_doc, n_start, n_len)
                    self.init_rows(frags, rowst, row_in_blk, mSQ, scale_log2, n_head, n_start, n_len, n_block, wg)
                    pipe_q.consumer_wait(q_state)
                    # the atoms rebound in both branches: their staged updates leave the `if` as its results
                    k_state, v_state, s_state, qk_mma, pv_mma = self.overlap_step(
                        n_block, frags, rowst, qk_mma, pv_mma, sScale, sPin, pipe_k, pipe_v, pipe_s, k_state,
                        v_state, s_state, n_len, wg, wg + 2 * q_state.index, next_diag=True, c_prev=c_prev,
                    )
                else:
                    v_state = self.overlap_epilogue(frags, rowst, pv_mma, pipe_v, v_state, wg)
                    pv_mma = pv_mma  # rebound here too (overlap_epilogue updated it inside this branch)
                # this block's last P V is in O
                self.store_o_row(0, f0, acc_o, rows[0], mO, head, doc_start, doc_len)
                self.store_o_row(1, f1, acc_o, rows[1], mO, head, doc_start, doc_len)
                if n_block >= 0:
                    acc_o.fill(0.0)
                    self.convert_p(frags, r_run, False)  # the next block's diagonal P
                m_block = n_block
                head = n_head
                doc_start = n_start
                doc_len = n_len

    @cute.jit
    def read_tile_bounds(self, pipe_t, sSched, t_state):
        """read_tile with the document's start and length as published (stage_tile_inputs), or 0, 0
        (tile_bounds then loads them)."""
        start = Int32(0)
        length = Int32(0)
        if cutlass.const_expr(self.cfg.stage_tile_inputs):
            m_block, head, doc, start, length, t_state = read_tile(pipe_t, sSched, t_state, True)
        else:
            m_block, head, doc, t_state = read_tile(pipe_t, sSched, t_state)
        return m_block, head, doc, start, length, t_state

    @cute.jit
    def tile_bounds(self, mCu, doc, start, length):
        """A read tile's document start and length: read_tile_bounds' when published
        (stage_tile_inputs), else from cu_seqlens (call it for a real tile only)."""
        if cutlass.const_expr(not self.cfg.stage_tile_inputs):
            start = mCu[doc]
            length = mCu[doc + 1] - start
        return start, length

    @cute.jit
    def for_each_published_tile(self, pipe_t, sSched, mCu, state, step):
        """A persistent role's loop over the tiles the TMA warp publishes, until its end mark: state =
        step(state, head, doc_start, doc_len, m_block) per tile, with short_pairs also the pair length
        (step runs while tracing: inlined). Returns the last state."""
        t_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, SCHED_STAGES)
        if cutlass.const_expr(self.short_pairs):
            m_block, head, doc, start, length, pair_len, t_state = read_tile(pipe_t, sSched, t_state, 3)
            while m_block >= 0:
                state = step(state, head, start, length, m_block, pair_len)
                m_block, head, doc, start, length, pair_len, t_state = read_tile(pipe_t, sSched, t_state, 3)
        else:
            m_block, head, doc, start, length, t_state = self.read_tile_bounds(pipe_t, sSched, t_state)
            while m_block >= 0:
                doc_start, doc_len = self.tile_bounds(mCu, doc, start, length)
                state = step(state, head, doc_start, doc_len, m_block)
                m_block, head, doc, start, length, t_state = self.read_tile_bounds(pipe_t, sSched, t_state)
        return state

    @cute.jit
    def init_rows(self, frags, rowst, row_in_blk, mSQ, scale_log2, head, doc_start, doc_len, m_block, wg):
        """The row statistics of query block m_block before its first key tile."""
        tn, wm = self.tile_n, self.wg_m
        tScS = frags[8]
        rs, m_run, l_run, r_run, c_pend = rowst
        for v1 in cutlass.range_constexpr(2):
            row = m_block * tn + wg * wm + tScS[2 * v1][0]
            row_in_blk[v1] = row
            if cutlass.const_expr(self.cfg.stage_tile_inputs):
                rs[v1] = scale_log2  # times the staged sQ in the diagonal softmax
            else:
                sq = Float32(1.0)  # rows past the end: any finite positive scale (never stored)
                if row < doc_len:
                    sq = mSQ[doc_start + row, head]
                rs[v1] = sq * scale_log2
            m_run[v1] = -Float32.inf
            l_run[v1] = Float32(0.0)
            r_run[v1] = Float32(0.0)  # no kept tile yet (see softmax: the fold reference)

    @cute.jit
    def row_final(self, v1, rowst, row_in_blk, mLSE, head, doc_start, doc_len):
        """Row v1's LSE = ln2 * (m + log2 l), stored; returns O's factor r / 256 / l (0 for an empty row)."""
        rs, m_run, l_run, r_run, c_pend = rowst
        l_tot = quad_sum(l_run[v1])
        f = Float32(0.0)
        lse = -Float32.inf
        if l_tot > Float32(0.0):
            f = (abs(r_run[v1]) / Float32(P_SCALE)) / l_tot
            lse = (m_run[v1] + cute.math.log2(l_tot, fastmath=False)) * Float32(LN2)
        row = row_in_blk[v1]
        if row < doc_len:
            if cute.arch.lane_idx() % 4 == 0:
                mLSE[doc_start + row, head] = lse
        return f

    @cute.jit
    def store_o_row(self, v1, f, acc_o, row, mO, head, doc_start, doc_len):
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
            if row < doc_len:
                st_global_v4(row_addr + 64 * G, ow)
    # ------------------------------------------------------------------------------------------
    # Tile phases. Both schedules run the same phases on the same data; only the order of
    # independent work differs, so P, the row statistics and O are the same numbers.
    @cute.jit
    def gemm_qk(self, qk_mma, frags, k_state, q_slot):
        """Issue S = Q K^T for the K tile in stage k_state (async; the caller commits). q_slot: this
        warpgroup's 64 Q rows in sQ (the warpgroup index, plus 2 per Q stage when persistent)."""
        tSrQ, tSrK, tOrV, acc_s, acc_t, acc_o, tOrP, tOrP32, tScS, lsum = frags
        for k in cutlass.range_constexpr(self.D // 32):
            qk_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(qk_mma, acc_s, tSrQ[None, None, k, q_slot], tSrK[None, None, k, k_state.index], acc_s)

    @cute.jit
    def gemm_pv(self, pv_mma, frags, v_state):
        """Issue O_tile = P V (P from registers) into the fresh tile accumulator acc_t (async); with
        row_sum_mma its column D is the row sum of P (the ones rows below V^T)."""
        tSrQ, tSrK, tOrV, acc_s, acc_t, acc_o, tOrP, tOrP32, tScS, lsum = frags
        for k in cutlass.range_constexpr(self.tile_n // 32):
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
        diag: the diagonal tile (first), the only one with a mask; key_lo (short_pairs): its columns
        below key_lo are masked too (the other document's keys). The caller waits for and
        releases the scale stage s_state. Returns the rows' alpha (exp2(m_prev - m)).
        row_sum_mma, uniform tiles: l is only rescaled here; the tile's sum lands with its P V.
        """
        tn, wm = self.tile_n, self.wg_m
        tSrQ, tSrK, tOrV, acc_s, acc_t, acc_o, tOrP, tOrP32, tScS, lsum = frags
        rs, m_run, l_run, r_run, c_pend = rowst
        n_acc_s = cute.size(acc_s)
        lim = doc_len - n * tn  # diagonal tile: visible keys are col < lim and col <= row
        # Block-scaled off-diagonal tile: it is exactly one 128-key scale block, so the K and V
        # scales are constant over it: sK folds into the row factor and w / r == 1.
        uniform = cutlass.const_expr((not diag) and self.diag_copy)
        if cutlass.const_expr(diag and self.cfg.stage_tile_inputs and not self.fuse_q):
            for v1 in cutlass.range_constexpr(2):  # the block's Q scales, staged by the scale warp
                rs[v1] = rs[v1] * sScale[2 * tn + wg * wm + tScS[2 * v1][0], s_state.index]
        sk_t = sScale[0, s_state.index]
        w_t = sScale[tn, s_state.index]
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
                    sw = sScale[tn + col, s_state.index]
                    for v1 in cutlass.range_constexpr(2):
                        a = v0 + 2 * v1 + 4 * v2
                        s = acc_s[a] * sk
                        w = sw
                        if cutlass.const_expr(diag):
                            if col > tScS[a][0] + wg * wm:
                                s = -Float32.inf
                                w = Float32(0.0)
                            if col >= lim:
                                s = -Float32.inf
                                w = Float32(0.0)
                            if cutlass.const_expr(key_lo is not None):
                                if col < key_lo:
                                    s = -Float32.inf
                                    w = Float32(0.0)
                        acc_s[a] = s
                        row_s[v1].append(s)
                        row_w[v1].append(w)
        chains = self.cfg.max_chains
        tmax = [fmax_chains(row_s[v1], chains) for v1 in range(2)]
        tmax = list(quad_max2(tmax[0], tmax[1]))
        if cutlass.const_expr(not uniform):
            # w >= 0, so the max over the row's w equals fmax(0, ...) of the serial form
            wmax = [fmax_chains(row_w[v1], chains) for v1 in range(2)]
            wmax = list(quad_max2(wmax[0], wmax[1]))  # 0: no visible key (dropped below)
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
            # rsv > 0, so max(s) * rsv == max(s * rsv) exactly
            m_new = cute.arch.fmax(m_run[v1], tm * rsv[v1])
            ms = m_new
            if m_new == -Float32.inf:
                ms = Float32(0.0)
            alpha = cute.math.exp2(m_run[v1] - ms, fastmath=True)
            m_safe[v1] = ms
            # running output: softmax correction times the fold change r_prev / r (exact)
            c = alpha
            rr = abs(r_run[v1])
            inv_r = Float32(0.0)  # stays 0 for a dropped row: P V += 0 (uniform tiles: convert_p)
            r_new = -rr  # the sign marks a dropped row and costs no register (|r| is a free modifier)
            if r >= cute.arch.fmax(rr * Float32(FOLD_DROP), Float32(FOLD_REF_MIN)):
                # r is a power of two in [FOLD_REF_MIN, 2^120]: 1/r exact and normal, no division
                inv_1 = pow2_reciprocal(r)
                inv_r = Float32(P_SCALE) * inv_1
                c = alpha * (rr * inv_1)
                r_new = r
            inv[v1] = inv_r
            r_run[v1] = r_new
            c_pend[v1] = c
            alphas[v1] = alpha
            m_run[v1] = m_new
        psum = [Float32(0.0), Float32(0.0)]
        # row_sum_mma: a uniform tile's sum comes from P V's column D (accumulate_o adds it)
        sum_on_mma = uniform and lsum is not None
        poly_every = self.cfg.exp2_poly_every
        # uniform tiles: P * 256 = exp2(x + 8) saves a multiply per element (P_SCALE = 2^8)
        m_off = [m_safe[0], m_safe[1]]
        if cutlass.const_expr(uniform):
            m_off = [m_safe[0] - Float32(P_SCALE_LOG2), m_safe[1] - Float32(P_SCALE_LOG2)]
        for v2 in cutlass.range_constexpr(n_acc_s // 4):
            for v0 in cutlass.range_constexpr(2):
                col = tScS[v0 + 4 * v2][1]
                sw = w_t
                if cutlass.const_expr(not uniform):
                    sw = sScale[tn + col, s_state.index]
                # a fixed subset of the columns takes exp2 off the MUFU pipe (exp2_poly_every)
                on_fma = uniform and poly_every > 0 and v2 % poly_every == poly_every - 1
                for v1 in cutlass.range_constexpr(2):
                    a = v0 + 2 * v1 + 4 * v2
                    x = acc_s[a] * rsv[v1] - m_off[v1]
                    if cutlass.const_expr(on_fma):
                        p = exp2_poly(x)
                    else:
                        p = cute.math.exp2(x, fastmath=True)
                    if cutlass.const_expr(not sum_on_mma):
                        psum[v1] = psum[v1] + p
                    if cutlass.const_expr(uniform):
                        acc_s[a] = p
                    else:
                        acc_s[a] = (p * sw) * inv[v1]  # p = 0 first: a masked key's sw * inv may overflow
        for v1 in cutlass.range_constexpr(2):
            if cutlass.const_expr(sum_on_mma):
                l_run[v1] = l_run[v1] * alphas[v1]
            else:
                ps = psum[v1]
                if cutlass.const_expr(uniform):
                    ps = ps * Float32(1.0 / P_SCALE)  # exact: a power of two
                l_run[v1] = l_run[v1] * alphas[v1] + ps
        return alphas

    @cute.jit
    def convert_p(self, frags, r_run, uniform: cutlass.Constexpr, l_run=None):
        """P: fp32 accumulator layout (acc_s) -> e4m3 A-operand registers (tOrP); V^T comes in
        P-fragment key order, so this is 32 conversions and nothing else. Uniform tiles leave P
        unscaled (w / r == 1), so a dropped row (r_run < 0, see softmax) has its bytes zeroed here:
        16 ANDs and no branch (a branch over the row's fp32 values spilled). Register i holds
        row i % 2 (a_fragment_sources). l_run (row_sum_mma): a dropped row's zeroed P would leave its
        keys out of P V's row sum, so their fp32 sum goes into l here."""
        tSrQ, tSrK, tOrV, acc_s, acc_t, acc_o, tOrP, tOrP32, tScS, lsum = frags
        pack_a_fragment_e4m3(acc_s, tOrP32)
        if cutlass.const_expr(uniform):
            if cutlass.const_expr(self.cfg.drop_branch):
                # a dropped row needs an all-zero V tile after normal ones: test it once per warp
                dropped = (f32_bits(r_run[0]) | f32_bits(r_run[1])) >> 31
                if cute.arch.vote_any_sync(dropped != Uint32(0)):
                    self._zero_dropped_rows(tOrP32, r_run)
                    if cutlass.const_expr(l_run is not None and frags[9] is not None):
                        self._sum_dropped_rows(acc_s, r_run, l_run)
            else:
                self._zero_dropped_rows(tOrP32, r_run)

    @cute.jit
    def _sum_dropped_rows(self, acc_s, r_run, l_run):
        """l += the fp32 P of a dropped row (uniform tile: acc_s holds P * 256), per-thread partial."""
        for v1 in cutlass.range_constexpr(2):
            if f32_bits(r_run[v1]) >> 31 != Uint32(0):
                ps = Float32(0.0)
                for v2 in cutlass.range_constexpr(cute.size(acc_s) // 4):
                    for v0 in cutlass.range_constexpr(2):
                        ps = ps + acc_s[v0 + 2 * v1 + 4 * v2]
                l_run[v1] = l_run[v1] + ps * Float32(1.0 / P_SCALE)

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
        # the diagonal tile's sum is the softmax's fp32 one (its P carries the V scale fold)
        self.accumulate_o(frags, rowst[4], None if diag else rowst[2])
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
    def accumulate_o(self, frags, c, l_run=None, l_fac=None):
        """O = O * c + O_tile (one FFMA per element): rescale and promotion of the fresh tile sum.
        row_sum_mma (l_run given): l += the tile's row sum (P V's column D, of P * 256) times l_fac (1/256 times
        the alpha of a softmax that ran since its P, or 0 for the diagonal tile's, whose fp32 sum is in
        l already; None: 1/256).
        Lane 0 of a quad holds the sum (column D), the others zero columns: l stays a quad-partial sum."""
        tSrQ, tSrK, tOrV, acc_s, acc_t, acc_o, tOrP, tOrP32, tScS, lsum = frags
        for j in cutlass.range_constexpr(cute.size(acc_o) // 4):
            for v1 in cutlass.range_constexpr(2):
                for v0 in cutlass.range_constexpr(2):
                    a = v0 + 2 * v1 + 4 * j
                    acc_o[a] = acc_o[a] * c[v1] + acc_t[a]
        if cutlass.const_expr(lsum is not None and l_run is not None):
            for v1 in cutlass.range_constexpr(2):
                if cutlass.const_expr(l_fac is None):
                    l_run[v1] = l_run[v1] + acc_t[lsum + 2 * v1] * Float32(1.0 / P_SCALE)
                else:
                    l_run[v1] = l_run[v1] + acc_t[lsum + 2 * v1] * l_fac[v1]

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
        self.convert_p(frags, rowst[3], (not diag) and self.diag_copy, rowst[2])
        return k_state, s_state

    @cute.jit
    def overlap_step(
        self, n, frags, rowst, qk_mma, pv_mma, sScale, sPin, pipe_k, pipe_v, pipe_s,
        k_state, v_state, s_state, doc_len, wg, q_slot, next_diag: cutlass.Constexpr = False, c_prev=None,
        l_gate=None,
    ):
        """Overlap schedule, off-diagonal tile n: issue S_n and P_prev V_prev, softmax of S_n
        while P V runs, then O = O * c_prev + O_tile(prev) and P_n.

        next_diag (overlap_tiles, between query blocks): n is the next block's diagonal tile (masked
        softmax; its fresh row statistics already in rowst, doc_len its document's), c_prev this
        block's pending factor; P stays in acc_s until the caller has stored this block's O.
        l_gate (row_sum_mma): 0 when the P V in flight is the diagonal tile's, else 1/256."""
        tSrQ, tSrK, tOrV, acc_s, acc_t, acc_o, tOrP, tOrP32, tScS, lsum = frags
        rs, m_run, l_run, r_run, c_pend = rowst
        k_state = self.issue_s_with_pv(qk_mma, pv_mma, frags, pipe_k, pipe_v, pipe_s, k_state, v_state, s_state, wg,
                                       q_slot)
        if cutlass.const_expr(not next_diag):
            c_prev = [c_pend[0], c_pend[1]]  # the factor of the tile whose P V is in flight
        # reads and writes acc_s only (and the row statistics): P V reads tOrP, writes acc_t
        alphas = self.softmax(next_diag, n, frags, rowst, sScale, s_state, doc_len, wg)
        if cutlass.const_expr(self.pin and not next_diag):
            # the row sums depend on every exp2 of the tile: storing them here keeps the exp2 work
            # ahead of the wait below (ptxas does not move shared-memory stores across it)
            sPin[cute.arch.thread_idx()[0] % 256] = rowst[2][0] + rowst[2][1]
        pipe_s.consumer_release(s_state)
        s_state.advance()
        warpgroup.wait_group(0)
        pipe_v.consumer_release(v_state)
        v_state.advance()
        # the serial schedule's operation for the previous tile: O = O * c_prev + O_tile; its row sum
        # (row_sum_mma) is in units of the previous max, so it takes this softmax's alpha too
        if cutlass.const_expr(l_gate is None):
            self.accumulate_o(frags, c_prev)
        else:
            self.accumulate_o(frags, c_prev, rowst[2], [alphas[0] * l_gate, alphas[1] * l_gate])
        if cutlass.const_expr(not next_diag):
            self.convert_p(frags, r_run, self.diag_copy, rowst[2])
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
    def overlap_epilogue(self, frags, rowst, pv_mma, pipe_v, v_state, wg, l_gate=None):
        """Overlap schedule: P V of the last tile, O = O * c_last + O_tile. l_gate (row_sum_mma): 0
        when that tile is the diagonal one, else 1/256."""
        tSrQ, tSrK, tOrV, acc_s, acc_t, acc_o, tOrP, tOrP32, tScS, lsum = frags
        pipe_v.consumer_wait(v_state)
        self.wait_turn(wg)
        warpgroup.fence()
        self.gemm_pv(pv_mma, frags, v_state)
        warpgroup.commit_group()
        self.pass_turn(wg)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(v_state)
        v_state.advance()
        if cutlass.const_expr(l_gate is None):
            self.accumulate_o(frags, rowst[4])
        else:
            self.accumulate_o(frags, rowst[4], rowst[2], [l_gate, l_gate])
        return v_state


# ----------------------------------------------------------------------------------------------
# Compile and launch
# ----------------------------------------------------------------------------------------------


_F8, _F32, _I32, _BF16 = ARG_F8, ARG_F32, ARG_I32, ARG_BF16
# The runtime entry's parameters (FlamiaFwdSm90.__call__) for compile_cache.compile_launcher
ARG_KINDS = (
    _F8, _F32, _F8, _F32, _F8, _F32, _F8, _F32, _F8, _F32,  # q, sq, k, sk, v, sv, k_tok, sk_tok, v_tok, sv_tok
    _BF16,  # q in bf16 (fuse_q_quant; else any bf16 pointer)
    _I32, _BF16, _F32, _I32,  # cu_seqlens, out, lse, tile counter (persistent; else any int32 pointer)
    ("i32",), ("i32",), ("i32",), ("i32",), ("i32",), ("f32",),  # T, T_dt, Hk, num_docs, grid_x, scale
    ("stream",),
)


def compile_fwd_sm90(config: FwdConfig, arch: str = "sm_90a", extra_options: str = "", tvm_ffi: bool = False):
    """cute.compile the forward for `arch` from plain values only (no tensors, no GPU needed).

    tvm_ffi: compile for TVM-FFI calls (raw int/float arguments, explicit stream handle).
    """
    return compile_entry(FlamiaFwdSm90(config), ARG_KINDS, arch, extra_options, tvm_ffi)


def get_compiled(config: FwdConfig, arch: str | None = None):
    """The JitExecutor-callable kernel (DSL pointer objects; see flamia_fwd_sm90 for the fast path)."""
    from .compile_cache import compile_cached, target_arch

    arch = arch or target_arch()
    return compile_cached(SOURCE_FILES, config, arch, lambda cfg, a: compile_fwd_sm90(cfg, a))


def get_launcher(config: FwdConfig, arch: str | None = None, use_tvm_ffi: bool | None = None):
    """launch(*raw) in ARG_KINDS order: TVM-FFI when available (see compile_cache.compile_launcher)."""
    from .compile_cache import compile_launcher, target_arch

    return compile_launcher(
        SOURCE_FILES, config, arch or target_arch(), lambda cfg, a, t: compile_fwd_sm90(cfg, a, tvm_ffi=t), ARG_KINDS,
        use_tvm_ffi,
    )


def kernel_artifacts(config: FwdConfig, arch: str = "sm_90a", tvm_ffi: bool = False):
    """PTX, cubin, SASS (when nvdisasm exists) and register/stack usage, for tests and inspection."""
    from .compile_cache import compile_artifacts

    return compile_artifacts(lambda cfg, a, opts: compile_fwd_sm90(cfg, a, opts, tvm_ffi=tvm_ffi), config, arch)


def flamia_fwd_sm90(
    q_td, sq, k_td, sk, v_dt, sv, k_tok_td, sk_tok, v_tok_dt, sv_tok,
    cu_seqlens, max_seqlen: int, softmax_scale: float, config: FwdConfig, poison_outputs: bool = False,
    dt_cu_seqlens=None, q_bf16=None,
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
    q_bf16 (T, H, D) bf16, exactly when config.fuse_q_quant: the kernel quantizes it per token
    (bit-exact with quant.quantize_thd) and writes the codes to q_td and the scales to sq, which
    are then outputs (e.g. torch.empty).
    Host cost: one kernel launch, two allocations, no torch ops on cu_seqlens when it is already
    int32 on the device; the launch goes through TVM-FFI when apache-tvm-ffi is installed.
    """
    T, H, D = q_td.shape
    Hk = k_td.shape[1]
    num_docs = cu_seqlens.numel() - 1
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
    checks = [("q_td", q_td, (T, H, D), f8), ("k_td", k_td, (T, Hk, D), f8), ("v_dt", v_dt, (Hk, D, T_dt), f8),
              ("sq", sq, (H, T), torch.float32), ("sk", sk, (Hk, T), torch.float32), ("sv", sv, (Hk, T), torch.float32)]
    if k_tok_td is not k_td:
        checks += [("k_tok_td", k_tok_td, (T, Hk, D), f8), ("v_tok_dt", v_tok_dt, (Hk, D, T_dt), f8),
                   ("sk_tok", sk_tok, (Hk, T), torch.float32), ("sv_tok", sv_tok, (Hk, T), torch.float32)]
    if config.fuse_q_quant != (q_bf16 is not None):
        raise ValueError("q_bf16 must be given exactly when config.fuse_q_quant is set "
                         f"(fuse_q_quant={config.fuse_q_quant}, q_bf16 {'given' if q_bf16 is not None else 'None'})")
    if q_bf16 is not None:
        checks.append(("q_bf16", q_bf16, (T, H, D), torch.bfloat16))
    dev = q_td.device
    check_kernel_tensors(checks, dev)
    if T_dt != transposed_tokens(T, num_docs):
        raise ValueError(f"v_dt's token dim must be transposed_tokens(T, num_docs) = "
                         f"{transposed_tokens(T, num_docs)}, got {T_dt}")
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    if dt_cu_seqlens is not None and dt_cu_seqlens.shape != cu_seqlens.shape:
        raise ValueError(f"dt_cu_seqlens must have num_docs + 1 = {cu_seqlens.numel()} entries, "
                         f"got {tuple(dt_cu_seqlens.shape)}")
    cu = int32_cu_seqlens(cu_seqlens, dev)
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(H, T, dtype=torch.float32, device=dev)
    if poison_outputs:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    max_m_blocks = (int(max_seqlen) + config.tile_m - 1) // config.tile_m
    if T == 0 or num_docs == 0 or max_m_blocks == 0:
        return out, lse
    if H > 65535 or num_docs > 65535:
        raise ValueError(f"grid too large: {H} query heads of q or {num_docs} documents of cu_seqlens "
                         "(at most 65535 each)")
    sched_ptr = cu.data_ptr()  # unused unless the tiles are claimed from a counter
    grid_x = max_m_blocks
    if config.persistent:
        grid_x = min(sm_count(dev), H * min(max_chunks(T, num_docs), num_docs * max_m_blocks))
        if config.tile_claim == "counter":
            # the tile counter starts at 0 every call (one per call: no state shared between streams)
            counter = torch.zeros(1, dtype=torch.int32, device=dev)
            sched_ptr = counter.data_ptr()
    launch_on_device(
        get_launcher(config), dev,
        q_td.data_ptr(), sq.data_ptr(), k_td.data_ptr(), sk.data_ptr(), v_dt.data_ptr(), sv.data_ptr(),
        k_tok_td.data_ptr(), sk_tok.data_ptr(), v_tok_dt.data_ptr(), sv_tok.data_ptr(),
        (q_bf16 if q_bf16 is not None else out).data_ptr(), cu.data_ptr(),
        out.data_ptr(), lse.data_ptr(), sched_ptr, T, T_dt, Hk, num_docs, grid_x, float(softmax_scale * LOG2E),
    )
    return out, lse
