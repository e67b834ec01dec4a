"""Fused FP8 (e4m3) quantization of packed THD tensors for Hopper (sm_90a).

One pass over x (T, H, D) bf16 writes, bit-exactly as `quant.quantize_thd`:
  set 0: data_td (T,H,D), data_dt (H,D,T_dt), scale (H,T) with block_tokens = B;
  set 1 (optional, `emit_token_copy`): the same three with block_tokens = 1.
data_dt has T_dt = quant.transposed_tokens(T, docs) columns; document b starts at column
quant.dt_cu_seqlens(cu)[b] (a multiple of DT_DOC_ALIGN), and columns without a token are 0.

Q, K and V in one launch (MultiQuantizeConfig). Up to three tensors sharing T and cu_seqlens
(each with its own heads, head dim, block size and token-copy flag; GQA K/V may have fewer
heads) are quantized by one grid: the flat CTA index selects the part (consecutive ranges,
Q then K then V), then (chunk, head group) inside it. The chunk scan below runs once per CTA,
before the part's specialized code. Host side: every output of every part is a view of ONE
uint8 allocation (quant.output_buffer_plan), and the launch passes raw values through TVM-FFI
(no DSL pointer objects per launch; the DSL's marshalling without apache-tvm-ffi).

A non-finite input makes its block's scale NaN (the integer amax orders NaN > inf > finite) and
every code of the block 0, bit-exactly as quant.quantize_with_scale: no product meets a NaN code.

CTA order ("raster", default "heads"): inside a part CTA = chunk * head_groups + head_group,
so CTAs resident together cover every head of a window of consecutive chunks: x rows and
data_td rows are read/written whole, and each data_dt row gets a run of consecutive segments.
Launch bounds: `min_ctas_per_sm` (ptxas register cap; 4 x 256 threads = 64 registers) and the
preferred shared memory carveout (100%) so that the CTAs the registers allow also fit in
shared memory (block 128 + token copy: 4 x (32.2 KB + 1 KB reserved) > the 132 KB carveout).

Work decomposition. One CTA per (document-local chunk of 128 tokens, head group of HG
heads); warp w (8 warps) owns chunk tokens [16w, 16w + 16). A chunk starts at a document
start plus a multiple of 128, so in data_dt it starts at a multiple of 16 columns: every
16-token group is one aligned 16-byte segment, written with one 16-byte store, tokens past
the chunk as 0 (that is how the last chunk of a document writes the document's pad columns).

Scheduling without a table. The grid has chunk_grid_slots(T, docs) = T // 128 + docs + 1
CTAs per head group, an upper bound from shapes alone. Each CTA scans cu_seqlens itself:
thread t sums ceil(len/128) and round_up(len, 16) over its ceil(docs/256) documents, a
block-wide exclusive scan (warp shfl.up, then the 8 warp totals through shared memory)
gives every thread its documents' first chunk and first data_dt column, and the thread
owning chunk `blockIdx.x` publishes (start token, length, data_dt column). CTAs past the
last chunk are spare: they zero the tail columns [dt_total, T_dt) in 128-column blocks.
(`schedules.varlen_chunks.locate_chunk_model` is this index math in Python.)

Thread mapping. A thread owns "slots" (quad, hl, j): 4 consecutive tokens
4*quad .. 4*quad+3 of its warp's group, head hl of the group, and the 16
consecutive elements 16j .. 16j+15 of the head dim. So it issues 16-byte
loads (2 per token), 16-byte stores of data_td (1 per token), and holds a
4-token x 16-dim block that turns into 16 words of data_dt (4 tokens each)
with byte permutes. The L = D/16 lanes of a token reduce its amax with
shuffles; block amax goes through shared memory (one value per warp: 16 | B,
so a warp's tokens lie in one scale block).

Shared memory. The transposed tile of a set is [HG*D rows][8 segments][16 B].
Segment g of row r sits at slot (g + r // 16) % 8: the lanes of a warp store
rows 16 apart, and without the rotation they would all hit one bank.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Uint32, const_expr

from ..quant import DT_DOC_ALIGN, TOKEN_PAD, QuantizedTHD, output_buffer_plan, output_views, transposed_tokens
from ..schedules.varlen_chunks import chunk_grid_slots
from ..validation import int32_cu_seqlens
from .primitives import (
    ARG_BF16,
    ARG_F8,
    ARG_F32,
    ARG_I32,
    NAN_SCALE_BITS,
    SHARED_SOURCE_FILES,
    as_f32,
    bf16_abs_max_bits,
    byte_transpose4x4,
    imax,
    pow2_scale_bits,
    prmt,
    select,
    warp_scan_up,
)
from .rotate import ARG_F32_16, DeviceOps, check_rotation_fields, forward_rotate_words, has_rotation

TILE_TOKENS = 128
GROUP_TOKENS = 16  # tokens per warp and per data_dt segment (16 fp8 = 16 bytes)
TILE_GROUPS = TILE_TOKENS // GROUP_TOKENS  # 8 segments of 16 tokens per chunk
NUM_WARPS = TILE_GROUPS
NUM_THREADS = 32 * NUM_WARPS  # 256
# a document's first data_dt column starts a 16-byte segment, and its pad ends inside its last chunk
assert DT_DOC_ALIGN % GROUP_TOKENS == 0 and TILE_TOKENS % DT_DOC_ALIGN == 0, DT_DOC_ALIGN
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_BLOCK_TOKENS = (1, 64, 128)
MAX_PARTS = 3  # Q, K, V in one launch

SOURCE_FILES = (Path(__file__).resolve(), Path(__file__).resolve().with_name("rotate.py"), *SHARED_SOURCE_FILES)


@dataclass(frozen=True)
class QuantizeConfig:
    head_dim: int
    num_heads: int
    block_tokens: int = 1
    emit_token_copy: bool = False
    emit_transposed: bool = True
    emit_token_major: bool = True  # data_td; a forward-only V needs data_dt alone
    dt_pv_order: bool = False  # data_dt in the forward's P-fragment key order (quant.PV_ORDER16): V
    # also read y (same shape as x) and write rowdot (H, T) fp32 = sum_d x * y: the backward's
    # D = rowsum(dO * O) in the pass that quantizes dO (first part of a launch only)
    emit_rowdot: bool = False
    # g > 0: also raise docmax (H / g, docs) int32 to the max scale bits of each document over its tokens
    # and the g heads of a group (atomic max; the caller zeroes it; scales are positive powers of two,
    # so their bits order as the values): the bf16-dS backward's dV fold reference from dO's pass
    doc_scale_max_group: int = 0
    # rowdot over x's e4m3 values (codes times scale) instead of x: recipes.DELTAS "quantized"
    rowdot_quantized: bool = False
    # Q and K rotations (sm90/rotate.py, rotary.py) applied to x before its scales and codes: RoPE
    # ("none", "half", "interleaved") on the first rotary_dim channels at each token's position in
    # its document, from the launch's fp32 cos/sin tables; then, with hadamard > 0, the Walsh-Hadamard
    # transform over the head dimension times 2^-hadamard
    rotary: str = "none"
    rotary_dim: int = 0
    hadamard: int = 0
    tile_tokens: int = TILE_TOKENS
    heads_per_cta: int = 0  # 0: choose automatically
    threads: int = 0  # 0: the only supported value, NUM_THREADS

    def __post_init__(self):
        def bad(field, msg):
            raise ValueError(f"QuantizeConfig.{field}: {msg}")

        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            bad("head_dim", f"must be one of {SUPPORTED_HEAD_DIMS}, got {self.head_dim}")
        if not isinstance(self.num_heads, int) or self.num_heads < 1:
            bad("num_heads", f"must be a positive int, got {self.num_heads!r}")
        if self.block_tokens not in SUPPORTED_BLOCK_TOKENS:
            bad("block_tokens", f"must be one of {SUPPORTED_BLOCK_TOKENS}, got {self.block_tokens}")
        if self.dt_pv_order and not self.emit_transposed:
            bad("dt_pv_order", "orders data_dt columns, so it needs emit_transposed=True")
        if not (self.emit_token_major or self.emit_transposed):
            bad("emit_token_major", "and emit_transposed are both False: the launch would write no data")
        if self.emit_token_copy and self.block_tokens == 1:
            bad("emit_token_copy", "the per-token copy duplicates set 0 when block_tokens == 1")
        if not isinstance(self.doc_scale_max_group, int) or self.doc_scale_max_group < 0 or (
                self.doc_scale_max_group and self.num_heads % self.doc_scale_max_group):
            bad("doc_scale_max_group", f"must be 0 or a divisor of num_heads={self.num_heads}, "
                                       f"got {self.doc_scale_max_group!r}")
        if self.doc_scale_max_group and self.emit_token_copy:
            bad("doc_scale_max_group", "reads set 0's per-token scales: not with emit_token_copy")
        if self.rowdot_quantized and not self.emit_rowdot:
            bad("rowdot_quantized", "applies to the rowdot: needs emit_rowdot=True")
        check_rotation_fields("QuantizeConfig", self.head_dim, self.rotary, self.rotary_dim, self.hadamard)
        if has_rotation(self) and self.emit_rowdot:
            bad("rotary", "the rotations are Q's and K's, the rowdot dO's: not in one part")
        if self.tile_tokens != TILE_TOKENS:
            bad("tile_tokens", f"only {TILE_TOKENS} is supported (the data_dt pad and block 128), got {self.tile_tokens}")
        if self.threads not in (0, NUM_THREADS):
            bad("threads", f"the 128-token chunk needs {NUM_THREADS} threads (8 warps), got {self.threads}")
        object.__setattr__(self, "threads", NUM_THREADS)
        hg = self.heads_per_cta or _auto_heads_per_cta(self.head_dim, self.num_heads)
        if hg & (hg - 1):
            bad("heads_per_cta", f"must be a power of two, got {hg}")
        if self.num_heads % hg != 0:
            bad("heads_per_cta", f"{hg} does not divide num_heads={self.num_heads}")
        # L = D/16 lanes per token row; HG*L <= 32 keeps a thread's head fixed across its slots.
        if hg * self.head_dim > 512:
            bad("heads_per_cta", f"heads_per_cta * head_dim must be <= 512, got {hg} * {self.head_dim}")
        object.__setattr__(self, "heads_per_cta", hg)

    @property
    def num_sets(self) -> int:
        return 2 if self.emit_token_copy else 1

    @property
    def smem_bytes(self) -> int:
        tile = self.heads_per_cta * self.head_dim * TILE_GROUPS * GROUP_TOKENS if self.emit_transposed else 0
        doc_max = 16 * (1 + self.heads_per_cta // 4) if self.doc_scale_max_group else 0
        return self.num_sets * tile + NUM_WARPS * self.heads_per_cta * 4 + NUM_WARPS * 2 * 4 + 16 + 64 + doc_max


def smem_bytes(config) -> int:
    """Shared memory per CTA of a QuantizeConfig or MultiQuantizeConfig launch (each kernel module
    has this function: `flamia-cute ptx` reports it)."""
    return config.smem_bytes


def _auto_heads_per_cta(head_dim: int, num_heads: int) -> int:
    # 128 head-dim elements per token per CTA fill a warp's 32 lanes (4 tokens x 8 lanes).
    hg = max(1, 128 // head_dim)
    while num_heads % hg:
        hg //= 2
    return hg


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------


def _store_zero_words(dst):
    """Zeros over a 16-byte global segment as four 32-bit stores (of RZ: no registers held)."""
    dst_w = cute.recast_tensor(dst, Uint32)
    for m in range(4):  # plain Python: unrolled while tracing
        dst_w[m] = Uint32(0)


@dataclass(frozen=True)
class MultiQuantizeConfig:
    """Up to three tensors (Q, K, V) that share T and cu_seqlens, quantized by one launch.

    Each part has its own QuantizeConfig (head count, head dim, block size, token copy). The flat
    grid holds chunk_grid_slots(T, docs) * (num_heads / heads_per_cta) CTAs per part, parts in
    order; inside a part the CTAs are ordered by `raster`:
      "heads":  CTA = chunk * head_groups + head_group: the CTAs running at one time cover all heads
                of a window of consecutive chunks, so x rows (T, H, D) are read and data_td rows
                written whole (4 KB / 2 KB per token for 16 x 128) and every data_dt row gets a run
                of consecutive 128-column segments;
      "chunks": CTA = head_group * slots + chunk (the single-tensor kernel's original order).
    `min_ctas_per_sm` > 0 sets the launch bound (ptxas caps registers so that many 256-thread
    CTAs fit an SM); `smem_carveout` (percent, -1 = driver default) is the preferred shared
    memory carveout, so that the CTAs the registers allow also fit in shared memory.
    """

    parts: tuple
    raster: str = "heads"
    min_ctas_per_sm: int | None = None  # None: 4 when every head dim <= 128 (64 registers), else no bound
    smem_carveout: int = 100

    def __post_init__(self):
        parts = self.parts
        if isinstance(parts, QuantizeConfig):
            parts = (parts,)
        parts = tuple(parts)
        if not 1 <= len(parts) <= MAX_PARTS or not all(isinstance(p, QuantizeConfig) for p in parts):
            raise ValueError(f"MultiQuantizeConfig.parts: 1..{MAX_PARTS} QuantizeConfig, got {self.parts!r}")
        if any(p.emit_rowdot or p.doc_scale_max_group for p in parts[1:]):
            raise ValueError("MultiQuantizeConfig.parts: only the first part may have emit_rowdot or "
                             "doc_scale_max_group")
        object.__setattr__(self, "parts", parts)
        dims = {p.rotary_dim for p in parts if p.rotary != "none"}
        if len(dims) > 1:
            raise ValueError(f"MultiQuantizeConfig.parts: the rotary parts read one cos/sin table, so one rotary_dim, "
                             f"got {sorted(dims)}")
        if self.raster not in ("heads", "chunks"):
            raise ValueError(f"MultiQuantizeConfig.raster: 'heads' or 'chunks', got {self.raster!r}")
        if self.min_ctas_per_sm is None:
            # 4 CTAs x 256 threads = 64 registers: no spills for head dim <= 128; 256 needs more;
            # the rowdot's second input spills at 64 registers (3 CTAs: 80 registers)
            bound = 3 if parts[0].emit_rowdot else 4
            object.__setattr__(self, "min_ctas_per_sm", bound if all(p.head_dim <= 128 for p in parts) else 0)
        if self.min_ctas_per_sm not in range(0, 9):
            raise ValueError(f"MultiQuantizeConfig.min_ctas_per_sm: 0..8, got {self.min_ctas_per_sm}")
        if not (self.smem_carveout == -1 or 0 <= self.smem_carveout <= 100):
            raise ValueError(f"MultiQuantizeConfig.smem_carveout: -1 or 0..100, got {self.smem_carveout}")

    @property
    def head_groups(self) -> tuple:
        return tuple(p.num_heads // p.heads_per_cta for p in self.parts)

    @property
    def smem_bytes(self) -> int:
        tile = max(p.num_sets * p.heads_per_cta * p.head_dim * TILE_GROUPS * GROUP_TOKENS if p.emit_transposed else 0
                   for p in self.parts)
        hg = max(p.heads_per_cta for p in self.parts)
        return tile + NUM_WARPS * hg * 4 + NUM_WARPS * 2 * 4 + 16 + 64

    def grid_ctas(self, total_tokens: int, num_docs: int) -> int:
        return chunk_grid_slots(total_tokens, num_docs, TILE_TOKENS) * sum(self.head_groups)


def as_multi(config) -> MultiQuantizeConfig:
    return config if isinstance(config, MultiQuantizeConfig) else MultiQuantizeConfig((config,))


class _Part:
    """Trace-time constants of one part."""

    def __init__(self, cfg: QuantizeConfig):
        self.cfg = cfg
        self.D = cfg.head_dim
        self.H = cfg.num_heads
        self.HG = cfg.heads_per_cta
        self.NHG = cfg.num_heads // cfg.heads_per_cta
        self.B = cfg.block_tokens
        self.L = self.D // 16  # lanes per token row
        self.slots = 4 * self.HG * self.L  # (quad, hl, j) slots per warp
        self.spt = max(1, self.slots // 32)  # slots per thread
        self.rows = self.HG * self.D  # rows of the transposed tile
        self.NSETS = cfg.num_sets
        self.TRANS = cfg.emit_transposed
        self.TOKEN_MAJOR = cfg.emit_token_major


class FusedQuantizeSm90:
    """CuTe DSL kernel: fused token-block FP8 quantization, both orientations, one pass, 1..3 tensors."""

    def __init__(self, config):
        self.mcfg = as_multi(config)
        self.parts = [_Part(c) for c in self.mcfg.parts]
        self.cfg = self.mcfg.parts[0]  # single-tensor compatibility
        self.doc_max_group = self.cfg.doc_scale_max_group  # first part only (MultiQuantizeConfig)
        self.HGMAX = max(p.HG for p in self.parts)
        self.rotary_dim = max(p.cfg.rotary_dim for p in self.parts)  # one cos/sin table per launch
        self.TILE_WORDS = max(
            (p.NSETS * p.rows * TILE_GROUPS * 4 if p.TRANS else 0) for p in self.parts
        )

    @cute.jit
    def __call__(
        self,
        cu_ptr: cute.Pointer,
        x0: cute.Pointer, td00: cute.Pointer, dt00: cute.Pointer, sc00: cute.Pointer,
        td01: cute.Pointer, dt01: cute.Pointer, sc01: cute.Pointer,
        x1: cute.Pointer, td10: cute.Pointer, dt10: cute.Pointer, sc10: cute.Pointer,
        td11: cute.Pointer, dt11: cute.Pointer, sc11: cute.Pointer,
        x2: cute.Pointer, td20: cute.Pointer, dt20: cute.Pointer, sc20: cute.Pointer,
        td21: cute.Pointer, dt21: cute.Pointer, sc21: cute.Pointer,
        y0: cute.Pointer, rowdot0: cute.Pointer, docmax0: cute.Pointer,
        cos_ptr: cute.Pointer, sin_ptr: cute.Pointer,
        num_tokens: Int32,
        dt_tokens: Int32,
        num_docs: Int32,
        grid_slots: Int32,
        table_rows: Int32,
        stream: cuda.CUstream,
    ):
        T = num_tokens
        Tdt = cute.assume(dt_tokens, divby=TOKEN_PAD)
        mCu = cute.make_tensor(cu_ptr, cute.make_layout((num_docs + 1,)))
        ptrs = (
            (x0, td00, dt00, sc00, td01, dt01, sc01),
            (x1, td10, dt10, sc10, td11, dt11, sc11),
            (x2, td20, dt20, sc20, td21, dt21, sc21),
        )
        tensors = []
        for p_i in cutlass.range_constexpr(MAX_PARTS):
            if const_expr(p_i < len(self.parts)):
                P = self.parts[p_i]
                D, H = P.D, P.H
                thd = cute.make_layout((T, H, D), stride=(H * D, D, 1))
                hdt = cute.make_layout((H, D, Tdt), stride=(D * Tdt, Tdt, 1))
                ht = cute.make_layout((H, T), stride=(T, 1))
                x, td0, dt0, sc0, td1, dt1, sc1 = ptrs[p_i]
                mDT0 = cute.make_tensor(dt0, hdt) if const_expr(P.TRANS) else None
                outs = [cute.make_tensor(x, thd), cute.make_tensor(td0, thd), mDT0, cute.make_tensor(sc0, ht)]
                if const_expr(P.NSETS == 2):
                    mDT1 = cute.make_tensor(dt1, hdt) if const_expr(P.TRANS) else None
                    outs += [cute.make_tensor(td1, thd), mDT1, cute.make_tensor(sc1, ht)]
                else:
                    outs += [None, None, None]
                tensors.append(outs)
            else:
                tensors.append([None] * 7)
        mY0 = None
        mRowdot0 = None
        if const_expr(self.parts[0].cfg.emit_rowdot):
            P0 = self.parts[0]
            mY0 = cute.make_tensor(y0, cute.make_layout((T, P0.H, P0.D), stride=(P0.H * P0.D, P0.D, 1)))
            mRowdot0 = cute.make_tensor(rowdot0, cute.make_layout((P0.H, T), stride=(T, 1)))
        mDocMax0 = None
        if const_expr(self.doc_max_group > 0):
            mDocMax0 = cute.make_tensor(docmax0, cute.make_layout((self.parts[0].H // self.doc_max_group, num_docs),
                                                                  stride=(num_docs, 1)))
        mCos, mSin = None, None
        if const_expr(self.rotary_dim > 0):
            half = self.rotary_dim // 2
            mCos = cute.make_tensor(cos_ptr, cute.make_layout((table_rows, half), stride=(half, 1)))
            mSin = cute.make_tensor(sin_ptr, cute.make_layout((table_rows, half), stride=(half, 1)))
        total = grid_slots * sum(self.mcfg.head_groups)
        launch_kw = {}
        if const_expr(self.mcfg.min_ctas_per_sm > 0):
            launch_kw["min_blocks_per_mp"] = self.mcfg.min_ctas_per_sm
        if const_expr(self.mcfg.smem_carveout >= 0):
            launch_kw["preferred_smem_carveout"] = self.mcfg.smem_carveout
        self.kernel(mCu, *tensors[0], *tensors[1], *tensors[2], mY0, mRowdot0, mDocMax0, mCos, mSin, Tdt, num_docs,
                    grid_slots).launch(
            grid=[total, 1, 1],
            block=[NUM_THREADS, 1, 1],
            stream=stream,
            **launch_kw,
        )

    @cute.kernel
    def kernel(
        self,
        mCu: cute.Tensor,
        mX0: cute.Tensor, mTD00: cute.Tensor, mDT00: cute.Tensor, mS00: cute.Tensor,
        mTD01: cute.Tensor, mDT01: cute.Tensor, mS01: cute.Tensor,
        mX1: cute.Tensor, mTD10: cute.Tensor, mDT10: cute.Tensor, mS10: cute.Tensor,
        mTD11: cute.Tensor, mDT11: cute.Tensor, mS11: cute.Tensor,
        mX2: cute.Tensor, mTD20: cute.Tensor, mDT20: cute.Tensor, mS20: cute.Tensor,
        mTD21: cute.Tensor, mDT21: cute.Tensor, mS21: cute.Tensor,
        mY0: cute.Tensor, mRowdot0: cute.Tensor, mDocMax0: cute.Tensor,
        mCos: cute.Tensor, mSin: cute.Tensor,
        Tdt: Int32,
        num_docs: Int32,
        grid_slots: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        lin, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        NP = len(self.parts)

        smem = cutlass.memory.SmemAllocator()
        sAmaxFlat = smem.allocate_tensor(Int32, cute.make_layout((NUM_WARPS * self.HGMAX,)), 16)
        sScan = smem.allocate_tensor(Int32, cute.make_layout((NUM_WARPS, 2), stride=(2, 1)), 16)
        sInfo = smem.allocate_tensor(Int32, cute.make_layout((8,)), 16)
        sDocMax = None
        if const_expr(self.doc_max_group > 0):
            sDocMax = smem.allocate_tensor(Int32, cute.make_layout((self.parts[0].HG,)), 16)
        sTileFlat = None
        if const_expr(self.TILE_WORDS > 0):
            sTileFlat = smem.allocate_tensor(Uint32, cute.make_layout((self.TILE_WORDS,)), 128)

        # ---- which part, chunk and head group: parts own consecutive CTA ranges --------------
        pid = Int32(0)
        local = lin
        base = Int32(0)
        for p_i in cutlass.range_constexpr(1, NP):
            base = base + grid_slots * self.parts[p_i - 1].NHG
            in_p = lin >= base
            pid = select(in_p, Int32(p_i), pid)
            local = select(in_p, lin - base, local)
        cta = Int32(0)
        hgrp = Int32(0)
        for p_i in cutlass.range_constexpr(NP):
            nhg = self.parts[p_i].NHG
            if const_expr(self.mcfg.raster == "heads"):
                c_p = local // nhg
                h_p = local - c_p * nhg
            else:
                h_p = local // grid_slots
                c_p = local - h_p * grid_slots
            if const_expr(NP == 1):
                cta = c_p
                hgrp = h_p
            else:
                cta = select(pid == p_i, c_p, cta)
                hgrp = select(pid == p_i, h_p, hgrp)

        # ---- which chunk is this CTA's: block-wide scan over documents (no table) ---------
        # Thread t owns documents [t*k, t*k + k); a chunk is `cta`-th in (document, position)
        # order, and a document's first data_dt column is the sum of the earlier documents'
        # lengths rounded up to DT_DOC_ALIGN (quant.dt_cu_seqlens).
        nd = num_docs
        k = (nd + NUM_THREADS - 1) // NUM_THREADS
        d0 = tidx * k
        my_c = Int32(0)
        my_p = Int32(0)
        for i in cutlass.range(k):
            b = d0 + i
            if b < nd:
                ln = mCu[b + 1] - mCu[b]
                my_c = my_c + ((ln + TILE_TOKENS - 1) >> 7)
                my_p = my_p + ((ln + DT_DOC_ALIGN - 1) & -DT_DOC_ALIGN)
        inc_c, inc_p = warp_scan_up(lane, my_c, my_p)
        if lane == 31:
            sScan[warp, 0] = inc_c
            sScan[warp, 1] = inc_p
        cute.arch.sync_threads()
        ex_c = inc_c - my_c
        ex_p = inc_p - my_p
        tot_c = Int32(0)
        tot_p = Int32(0)
        for w2 in cutlass.range_constexpr(NUM_WARPS):
            vc = sScan[w2, 0]
            vp = sScan[w2, 1]
            ex_c = ex_c + select(warp > w2, vc, Int32(0))
            ex_p = ex_p + select(warp > w2, vp, Int32(0))
            tot_c = tot_c + vc
            tot_p = tot_p + vp
        if (cta >= ex_c) & (cta < ex_c + my_c):
            c_acc = ex_c
            p_acc = ex_p
            for i in cutlass.range(k):
                b = d0 + i
                if b < nd:
                    s_b = mCu[b]
                    ln = mCu[b + 1] - s_b
                    nch = (ln + TILE_TOKENS - 1) >> 7
                    if (cta >= c_acc) & (cta < c_acc + nch):
                        loc = (cta - c_acc) * TILE_TOKENS
                        sInfo[0] = s_b + loc
                        sInfo[1] = Int32(cutlass.min(ln - loc, Int32(TILE_TOKENS)))
                        sInfo[2] = p_acc + loc
                        if const_expr(self.doc_max_group > 0):
                            sInfo[3] = b  # the document, for its max-scale atomic
                        if const_expr(self.rotary_dim > 0):
                            sInfo[4] = loc  # the chunk's first token's position in its document (RoPE)
                    c_acc = c_acc + nch
                    p_acc = p_acc + ((ln + DT_DOC_ALIGN - 1) & -DT_DOC_ALIGN)
        if const_expr(self.doc_max_group > 0):
            if tidx < self.parts[0].HG:
                sDocMax[tidx] = Int32(0)
        cute.arch.sync_threads()

        args = (
            (mX0, mTD00, mDT00, mS00, mTD01, mDT01, mS01),
            (mX1, mTD10, mDT10, mS10, mTD11, mDT11, mS11),
            (mX2, mTD20, mDT20, mS20, mTD21, mDT21, mS21),
        )
        for p_i in cutlass.range_constexpr(NP):
            # each part's code is specialized for its config; a CTA runs one of them
            P = self.parts[p_i]
            mX, mTD0, mDT0, mS0, mTD1, mDT1, mS1 = args[p_i]
            if pid == p_i:
                D, HG, L, B, SPT = P.D, P.HG, P.L, P.B, P.spt
                doc_max = p_i == 0 and self.doc_max_group > 0  # this part raises the documents' max scales
                NSETS = P.NSETS
                TRANS = P.TRANS
                sAmax = cute.make_tensor(sAmaxFlat.iterator, cute.make_layout((NUM_WARPS, HG), stride=(HG, 1)))
                tiles = []
                for s_ in cutlass.range_constexpr(NSETS):
                    if const_expr(TRANS):
                        tiles.append(
                            cute.make_tensor(
                                sTileFlat.iterator + s_ * P.rows * TILE_GROUPS * 4,
                                cute.make_layout((P.rows, TILE_GROUPS, 4), stride=(TILE_GROUPS * 4, 4, 1)),
                            )
                        )
                    else:
                        tiles.append(None)
                if cta < tot_c:
                    start = sInfo[0]
                    n = sInfo[1]
                    dcol = sInfo[2]  # data_dt column of token `start`: a multiple of DT_DOC_ALIGN
                    # lane fields; hl is lane-only because HG*L divides 32
                    j = lane % L
                    hl = (lane // L) % HG
                    head = hgrp * HG + hl
                    active = lane < P.slots  # only false when HG*D == 64

                    ld_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
                    st_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float8E4M3FN, num_bits_per_copy=128)
                    w_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=128)

                    # ---- load: SPT slots x 4 tokens x 16 bf16; tokens past the chunk read as 0 -----
                    rx = []
                    tau = []
                    valid = []
                    tamax = []
                    for i in cutlass.range_constexpr(SPT):
                        quad = (lane + 32 * i) // (L * HG)
                        for p in cutlass.range_constexpr(4):
                            ta = 16 * warp + 4 * quad + p  # token of the chunk
                            ok = (ta < n) & active
                            frag = cute.make_rmem_tensor(16, BFloat16)
                            frag.fill(0.0)
                            if ok:
                                cute.copy(ld_atom, cute.local_tile(mX[start + ta, head, None], (16,), (j,)), frag)
                            rx.append(frag)
                            tau.append(ta)
                            valid.append(ok)
                    # ---- rotations (RoPE, Hadamard) of each token's slice, before its scale and codes;
                    # collectives, so every lane runs them (loads of absent tokens' table rows are skipped)
                    if const_expr(has_rotation(P.cfg)):
                        pos0 = sInfo[4] if const_expr(P.cfg.rotary != "none") else Int32(0)
                        for it in cutlass.range_constexpr(SPT * 4):
                            words = cute.recast_tensor(rx[it], Uint32)
                            rot = forward_rotate_words(DeviceOps, [words[kk] for kk in range(8)], j, lane, L, P.cfg,
                                                       mCos, mSin, pos0 + tau[it], valid[it])
                            for kk in cutlass.range_constexpr(8):
                                words[kk] = rot[kk]
                    # ---- rowdot (D = rowsum(dO * O)): bf16 products are exact in fp32; each lane sums
                    # its 16 dims in order, then the token's L lanes add pairwise (butterfly)
                    if const_expr(P.cfg.emit_rowdot and not P.cfg.rowdot_quantized):
                        for it in cutlass.range_constexpr(SPT * 4):
                            yfrag = cute.make_rmem_tensor(16, BFloat16)
                            yfrag.fill(0.0)
                            if valid[it]:
                                cute.copy(ld_atom, cute.local_tile(mY0[start + tau[it], head, None], (16,), (j,)), yfrag)
                            prod = cute.make_rmem_tensor(16, Float32)
                            prod.store(rx[it].load().to(Float32) * yfrag.load().to(Float32))
                            dot = prod[0]
                            for e in cutlass.range_constexpr(1, 16):
                                dot = dot + prod[e]
                            for off in cutlass.range_constexpr(int(math.log2(L))):
                                dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=1 << off)
                            if valid[it] & (j == 0):
                                mRowdot0[head, start + tau[it]] = dot
                    # ---- per-token amax on |x| bits (integer max: NaN > inf > finite) ---------------
                    for it in cutlass.range_constexpr(SPT * 4):
                        words = cute.recast_tensor(rx[it], Uint32)
                        tamax.append(bf16_abs_max_bits([words[kk] for kk in range(8)], L))

                    # ---- block amax: a warp's 16 tokens lie in one block (16 | B); warps meet in smem
                    blk_amax = Int32(0)
                    if const_expr(B > 1):
                        acc = tamax[0]
                        for it in cutlass.range_constexpr(1, SPT * 4):
                            acc = imax(acc, tamax[it])  # masked tokens carry amax 0
                        for sh in cutlass.range_constexpr(int(math.log2(32 // (L * HG)))):
                            acc = imax(acc, cute.arch.shuffle_sync_bfly(acc, offset=(L * HG) << sh))
                        if (lane < L * HG) & (j == 0):
                            sAmax[warp, hl] = acc
                        cute.arch.sync_threads()
                        WPB = B // GROUP_TOKENS  # warps per scale block
                        w_first = (warp // WPB) * WPB
                        for q in cutlass.range_constexpr(WPB):
                            blk_amax = imax(blk_amax, sAmax[w_first + q, hl])

                    # ---- scales, quantize, data_td, scale, transposed tile ---------------------------
                    # rows 16j .. 16j+15 of head hl share one rotated segment slot
                    slot_w = (warp + hl * L + j) % TILE_GROUPS
                    lane_max = Int32(0)
                    for i in cutlass.range_constexpr(SPT):
                        quad = (lane + 32 * i) // (L * HG)
                        # both sets are quantized per token while its fp32 values are live, so the
                        # registers hold packed bf16 inputs and fp8 words, never two sets of fp32
                        qwords = [[], []]
                        sbits = [[], []]
                        for p in cutlass.range_constexpr(4):
                            it = i * 4 + p
                            xf = rx[it].load().to(Float32)
                            for st in cutlass.range_constexpr(NSETS):
                                mTD = mTD0 if const_expr(st == 0) else mTD1
                                amax = tamax[it] if const_expr(B == 1 or st == 1) else blk_amax
                                sb, ib = pow2_scale_bits(amax)
                                sbits[st].append(sb)
                                q = cute.make_rmem_tensor(16, Float8E4M3FN)
                                q.store((xf * as_f32(ib)).to(Float8E4M3FN))
                                if const_expr(P.cfg.rowdot_quantized and st == 0):
                                    # D over the e4m3 values: sum(code * y) * scale (exact products, and
                                    # a power-of-two scale factors out of the sum)
                                    yfrag = cute.make_rmem_tensor(16, BFloat16)
                                    yfrag.fill(0.0)
                                    if valid[it]:
                                        cute.copy(ld_atom, cute.local_tile(mY0[start + tau[it], head, None], (16,),
                                                                           (j,)), yfrag)
                                    prod = cute.make_rmem_tensor(16, Float32)
                                    prod.store(q.load().to(Float32) * yfrag.load().to(Float32))
                                    dot = prod[0]
                                    for e in cutlass.range_constexpr(1, 16):
                                        dot = dot + prod[e]
                                    for off in cutlass.range_constexpr(int(math.log2(L))):
                                        dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=1 << off)
                                    if valid[it] & (j == 0):
                                        mRowdot0[head, start + tau[it]] = dot * as_f32(sb)
                                # codes 0 where the scale is NaN (quant.quantize_with_scale: no product meets a
                                # NaN code), and for tokens past the chunk in the tile (data_dt pad bytes). The
                                # zeros go out as word stores of RZ on that rare branch (a zero source tensor
                                # would hold registers); which branch comes first is what the 64- and 80-register
                                # budgets fit without spills (the dO launch's rowdot holds more)
                                poisoned = sb == Int32(NAN_SCALE_BITS)
                                if const_expr(P.TOKEN_MAJOR):
                                    if valid[it]:
                                        dst = cute.local_tile(mTD[start + tau[it], head, None], (16,), (j,))
                                        if const_expr(P.cfg.emit_rowdot):
                                            cute.copy(st_atom, q, dst)
                                            if poisoned:
                                                _store_zero_words(dst)
                                        else:
                                            if poisoned:
                                                _store_zero_words(dst)
                                            else:
                                                cute.copy(st_atom, q, dst)
                                qw = cute.recast_tensor(q, Uint32)
                                zw = []
                                for m in cutlass.range_constexpr(4):
                                    zw.append(select(valid[it] & ~poisoned, qw[m], Uint32(0)))
                                qwords[st].append(zw)
                        ta_j = 16 * warp + 4 * quad + j
                        write_scale = (j < 4) & (ta_j < n) & active
                        for st in cutlass.range_constexpr(NSETS):
                            mS = mS0 if const_expr(st == 0) else mS1
                            # scale: lane j < 4 of the token's lane group writes token 4*quad + j
                            sel = sbits[st][0]
                            for p in cutlass.range_constexpr(1, 4):
                                sel = select(j == p, sbits[st][p], sel)
                            if write_scale:
                                mS[head, start + ta_j] = sel
                            if const_expr(doc_max and st == 0):
                                # the chunk's max per head: lanes first, then shared memory
                                # (a NaN scale left out, attention_bwd.dv_fold_reference: finite scales' bits
                                # are below NAN_SCALE_BITS, so the mask is ~0 for them and 0 for NaN)
                                finite_sel = sel & ((sel - Int32(NAN_SCALE_BITS)) >> 31)
                                lane_max = imax(lane_max, select(write_scale, finite_sel, Int32(0)))
                            if const_expr(TRANS):
                                sT = tiles[st]
                                for m in cutlass.range_constexpr(4):
                                    # word b of the output holds dim 4m+b of tokens 0..3
                                    tw = byte_transpose4x4(*(qwords[st][t][m] for t in range(4)))
                                    if active:
                                        for b in cutlass.range_constexpr(4):
                                            sT[hl * D + 16 * j + 4 * m + b, slot_w, quad] = tw[b]

                    # ---- transposed copy: whole 16-byte segments only --------------------------------
                    # Segment g holds chunk tokens 16g .. 16g+15 at columns dcol + 16g ..; it is written
                    # when it lies before round_up(n, DT_DOC_ALIGN), tokens past the chunk as 0, so the
                    # last chunk of a document also writes the document's pad columns.
                    if const_expr(doc_max):
                        if lane_max > 0:
                            cute.arch.atomic_max(sDocMax.iterator + hl, lane_max)
                    if const_expr(TRANS or doc_max):
                        cute.arch.sync_threads()
                    # ---- the document's max scale per head group: one global atomic per head ------
                    # (before the transposed copy: its registers are free here, not after it)
                    if const_expr(doc_max):
                        if tidx < HG:
                            v = sDocMax[tidx]
                            if v > 0:
                                kvh = (hgrp * HG + tidx) // self.doc_max_group
                                cute.arch.atomic_max(mDocMax0.iterator + (kvh * num_docs + sInfo[3]), v)
                    if const_expr(TRANS):
                        seg0 = dcol >> 4
                        n_written = n  # 16g < n == 16g < round_up(n, 16): no rounding needed at 16
                        if const_expr(DT_DOC_ALIGN != GROUP_TOKENS):
                            n_written = (n + (DT_DOC_ALIGN - 1)) & -DT_DOC_ALIGN
                        for st in cutlass.range_constexpr(NSETS):
                            mDT = mDT0 if const_expr(st == 0) else mDT1
                            sT = tiles[st]
                            for mm in cutlass.range_constexpr(P.rows * TILE_GROUPS // NUM_THREADS):
                                e = tidx + NUM_THREADS * mm
                                row = e // TILE_GROUPS
                                g = e % TILE_GROUPS
                                slot = (g + (row >> 4)) % TILE_GROUPS
                                if GROUP_TOKENS * g < n_written:
                                    src = sT[row, slot, None]
                                    dst = cute.recast_tensor(
                                        cute.local_tile(mDT[hgrp * HG + row // D, row % D, None], (16,), (seg0 + g,)), Uint32
                                    )
                                    if const_expr(P.cfg.dt_pv_order):
                                        # word t of the segment holds tokens PV_ORDER16[4t .. 4t+3]:
                                        # the low/high byte pairs of token words 0 and 2, then 1 and 3
                                        pw = cute.make_rmem_tensor(cute.make_layout(4), Uint32)
                                        for t in cutlass.range_constexpr(4):
                                            pw[t] = prmt(src[t // 2], src[2 + t // 2], 0x7632 if t % 2 else 0x5410)
                                        cute.copy(w_atom, pw, dst)
                                    else:
                                        cute.copy(w_atom, src, dst)
                else:
                    # ---- spare CTA: zero the tail columns [dt_total, T_dt) of this head group -------
                    # dt_total (tot_p) is a multiple of DT_DOC_ALIGN and T_dt of 128: whole 16-byte segments.
                    # Spare CTA s of S zeroes 128-column blocks s, s + S, ...
                    if const_expr(TRANS):
                        w_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=128)
                        zero = cute.make_rmem_tensor(4, Uint32)
                        zero.fill(0)
                        tail_seg0 = tot_p >> 4
                        end_seg = Tdt >> 4
                        n_blk = (Tdt - tot_p + TILE_TOKENS - 1) >> 7
                        for blk in cutlass.range(cta - tot_c, n_blk, grid_slots - tot_c):
                            for mm in cutlass.range_constexpr(P.rows * TILE_GROUPS // NUM_THREADS):
                                e = tidx + NUM_THREADS * mm
                                row = e // TILE_GROUPS
                                seg = tail_seg0 + blk * TILE_GROUPS + e % TILE_GROUPS
                                if seg < end_seg:
                                    dst = cute.recast_tensor(
                                        cute.local_tile(mDT0[hgrp * HG + row // D, row % D, None], (16,), (seg,)), Uint32
                                    )
                                    cute.copy(w_atom, zero, dst)
                                    if const_expr(NSETS == 2):
                                        dst1 = cute.recast_tensor(
                                            cute.local_tile(mDT1[hgrp * HG + row // D, row % D, None], (16,), (seg,)), Uint32
                                        )
                                        cute.copy(w_atom, zero, dst1)


# ----------------------------------------------------------------------------------------------
# Compile and launch
# ----------------------------------------------------------------------------------------------

# The runtime entry's parameters (FusedQuantizeSm90.__call__) for compile_cache.compile_launcher:
# cu_seqlens; per part x, then (data_td, data_dt, scale) of set 0 and set 1; rowdot's y and output;
# the documents' max scale bits (doc_scale_max_group); the cos and sin tables (rotary); T, T_dt, documents,
# grid slots, the tables' rows; the stream
_PART_ARGS = (ARG_BF16, ARG_F8, ARG_F8, ARG_I32, ARG_F8, ARG_F8, ARG_I32)
ARG_KINDS = (ARG_I32, *_PART_ARGS * MAX_PARTS, ARG_BF16, ARG_F32, ARG_I32, ARG_F32_16, ARG_F32_16) + \
    (("i32",),) * 5 + (("stream",),)


def compile_fused_quantize_sm90(config, arch: str = "sm_90a", extra_options: str = "", tvm_ffi: bool = False):
    """cute.compile the kernel for `arch` from plain values only (no tensors, no GPU needed).

    `config` is a QuantizeConfig (one tensor) or a MultiQuantizeConfig (up to three tensors).
    tvm_ffi: compile for TVM-FFI calls (raw int arguments, explicit stream handle).
    """
    from ..compile_cache import compile_entry

    return compile_entry(FusedQuantizeSm90(config), ARG_KINDS, arch, extra_options, tvm_ffi)


def kernel_artifacts(config, arch: str = "sm_90a"):
    """PTX, cubin, SASS and register usage of the kernel for `arch` (no GPU needed)."""
    from ..compile_cache import compile_artifacts

    return compile_artifacts(compile_fused_quantize_sm90, config, arch)


def get_compiled(config, arch: str | None = None):
    from ..compile_cache import compile_cached, target_arch

    arch = arch or target_arch()
    return compile_cached(SOURCE_FILES, as_multi(config), arch, lambda cfg, a: compile_fused_quantize_sm90(cfg, a))


def _launch(mcfg: MultiQuantizeConfig, ptr_values, int_values, stream_handle: int) -> None:
    """One launch with raw values: TVM-FFI when available (FA4's path), else the DSL's marshalling
    (compile_cache.compile_launcher, as the attention kernels)."""
    from ..compile_cache import compile_launcher, target_arch

    launch = compile_launcher(SOURCE_FILES, mcfg, target_arch(),
                              lambda c, a, t: compile_fused_quantize_sm90(c, a, tvm_ffi=t), ARG_KINDS)
    launch(*ptr_values, *int_values, stream_handle)


def _check_input(x: torch.Tensor, cfg: QuantizeConfig, T: int):
    if x.dim() != 3 or x.dtype != torch.bfloat16 or not x.is_cuda:
        raise ValueError("x must be a CUDA bf16 tensor of shape (T, H, D)")
    if x.shape[0] != T:
        raise ValueError(f"all tensors of one launch need the same token count, got {x.shape[0]} and {T}")
    if (x.shape[1], x.shape[2]) != (cfg.num_heads, cfg.head_dim):
        raise ValueError(f"x has (H, D) = {tuple(x.shape[1:])}, config expects {(cfg.num_heads, cfg.head_dim)}")


def _layout_outputs(mcfg: MultiQuantizeConfig, T: int, Tdt: int):
    """quant.output_buffer_plan of the launch's parts: [part][set] entries and the byte size."""
    return output_buffer_plan(T, Tdt, _part_specs(mcfg.parts))


def _part_specs(parts):
    return [(c.num_heads, c.head_dim, c.num_sets, c.emit_transposed, c.emit_token_major) for c in parts]


def qkv_layout_outputs(mcfg: MultiQuantizeConfig, Tq: int, Tk: int, num_docs: int):
    """The byte plan of a Q/K/V launch whose Q has Tq tokens and K, V Tk (separate key documents): Q's
    outputs, then K's and V's at the offset where Q's end. Tq == Tk: _layout_outputs' (the same offsets
    whenever T > 0), so one plan serves the one-launch and the two-launch quantization."""
    if Tq == Tk:
        return _layout_outputs(mcfg, Tq, transposed_tokens(Tq, num_docs))
    q_plan, q_bytes = output_buffer_plan(Tq, transposed_tokens(Tq, num_docs), _part_specs(mcfg.parts[:1]))
    kv_plan, kv_bytes = output_buffer_plan(Tk, transposed_tokens(Tk, num_docs), _part_specs(mcfg.parts[1:]))
    shifted = [[[None if e is None else (*e[:3], e[3] + q_bytes) for e in st] for st in part] for part in kv_plan]
    return q_plan + shifted, q_bytes + kv_bytes


# the runtime allocation's plan, memoized: a training step repeats (config, T) on every layer and
# call, and rebuilding it cost ~9 us of host time per launch (the fake implementations of the
# custom ops call _layout_outputs itself: their sizes may be symbolic)
_runtime_layout = functools.lru_cache(maxsize=64)(_layout_outputs)
runtime_qkv_layout = functools.lru_cache(maxsize=64)(qkv_layout_outputs)


def _alloc_outputs(mcfg, T, Tdt, device, debug_fill=None):
    """Every output of every part as views of ONE uint8 allocation."""
    plan, nbytes = _runtime_layout(mcfg, int(T), int(Tdt))
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if debug_fill is not None:
        buf.fill_(debug_fill)
    return output_views(buf, plan)


def fused_quantize_multi_sm90(
    xs,
    cu_seqlens: torch.Tensor,
    config,
    debug_fill: int | None = None,
    rowdot=None,
    docmax=None,
    rope_tables=None,
) -> list:
    """Quantize up to three (T, H_i, D_i) bf16 tensors sharing cu_seqlens in ONE kernel launch.

    config: MultiQuantizeConfig, or a sequence of QuantizeConfig (one per tensor). Returns one
    (block-scaled set, per-token set or None) pair per tensor, as fused_quantize_sm90 does. All
    outputs are views of one allocation. `debug_fill` (tests) fills every output byte first.
    rowdot: (y, out) when the first part has emit_rowdot (see quantize_with_rowdot_sm90).
    docmax: (H / g, docs) int32, zeroed, when the first part has doc_scale_max_group g.
    rope_tables: (cos, sin) fp32 (positions, rotary_dim // 2) (rotary.kernel_tables) when a part has rotary;
    the caller guarantees positions >= the longest document (rotary.resolve_rotary).
    """
    mcfg = config if isinstance(config, MultiQuantizeConfig) else MultiQuantizeConfig(tuple(config))
    xs = list(xs)
    if len(xs) != len(mcfg.parts):
        raise ValueError(f"{len(xs)} tensors for {len(mcfg.parts)} configs")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a 1-D tensor of num_docs + 1 prefix sums")
    _check_docmax(mcfg, docmax, cu_seqlens)
    T = xs[0].shape[0] if xs[0].dim() == 3 else -1
    for x, cfg in zip(xs, mcfg.parts, strict=True):
        _check_input(x, cfg, T)
    xs = [x if x.is_contiguous() else x.contiguous() for x in xs]
    for x in xs:
        if x.data_ptr() % 16:
            raise ValueError("x must be 16-byte aligned")
    dev = xs[0].device
    num_docs = cu_seqlens.numel() - 1
    Tdt = transposed_tokens(T, num_docs)
    for cfg in mcfg.parts:
        if cfg.num_heads * cfg.head_dim * max(Tdt, T) >= 2**31:
            raise ValueError("tensor too large for 32-bit indexing")
    cu = int32_cu_seqlens(cu_seqlens, dev)
    sets = _alloc_outputs(mcfg, T, Tdt, dev, debug_fill)
    launch_fused_quantize_multi_sm90(xs, cu, mcfg, sets, rowdot, docmax, rope_tables)
    return quantized_outputs(mcfg, sets)


def fused_quantize_qkv_separate_sm90(q, k, v, cu_seqlens_q, cu_seqlens_k, config: MultiQuantizeConfig) -> list:
    """A Q/K/V launch (qkv_config) for K and V with their own documents: Q over cu_seqlens_q, K and V over
    cu_seqlens_k (as many documents), as two launches of the fused kernel (it takes one cu_seqlens) with the
    config's settings, into views of ONE allocation (qkv_layout_outputs). Returns quantized_outputs."""
    mcfg = config
    if len(mcfg.parts) != 3 or cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError("a Q/K/V config of three parts and cu_seqlens_q, cu_seqlens_k of as many documents")
    for x, cfg, T in ((q, mcfg.parts[0], q.shape[0]), (k, mcfg.parts[1], k.shape[0]), (v, mcfg.parts[2], k.shape[0])):
        _check_input(x, cfg, T)
    # strided inputs (context parallelism's K and V are halves of one gathered tensor) are copied, as the
    # self-attention launch does
    q, k, v = (x if x.is_contiguous() else x.contiguous() for x in (q, k, v))
    if any(x.data_ptr() % 16 for x in (q, k, v)):
        raise ValueError("q, k, v must be 16-byte aligned")
    num_docs = cu_seqlens_q.numel() - 1
    dev = q.device
    plan, nbytes = runtime_qkv_layout(mcfg, int(q.shape[0]), int(k.shape[0]), num_docs)
    sets = output_views(torch.empty(nbytes, dtype=torch.uint8, device=dev), plan)
    cu_q, cu_k = int32_cu_seqlens(cu_seqlens_q, dev), int32_cu_seqlens(cu_seqlens_k, dev)
    launch_fused_quantize_multi_sm90([q], cu_q, dataclasses.replace(mcfg, parts=mcfg.parts[:1]), sets[:1])
    launch_fused_quantize_multi_sm90([k, v], cu_k, dataclasses.replace(mcfg, parts=mcfg.parts[1:]), sets[1:])
    return quantized_outputs(mcfg, sets)


def quantized_outputs(mcfg: MultiQuantizeConfig, sets) -> list:
    """The QuantizedTHD of a launch's output views (`_alloc_outputs` / `quant.output_views`): one
    (block-scaled set, per-token set or None) pair per part, flagged as the launch writes them."""
    outs = []
    for cfg, ps in zip(mcfg.parts, sets, strict=True):
        out0 = QuantizedTHD(*ps[0], cfg.block_tokens, "e4m3", cfg.dt_pv_order)
        out1 = QuantizedTHD(*ps[1], 1, "e4m3", cfg.dt_pv_order) if cfg.num_sets == 2 else None
        outs.append((out0, out1))
    return outs


def _check_docmax(mcfg: MultiQuantizeConfig, docmax, cu_seqlens: torch.Tensor) -> None:
    g = mcfg.parts[0].doc_scale_max_group
    if bool(g) != (docmax is not None):
        raise ValueError("docmax is needed exactly when the first part has doc_scale_max_group")
    if docmax is not None and (docmax.dtype != torch.int32 or not docmax.is_contiguous()
                               or tuple(docmax.shape) != (mcfg.parts[0].num_heads // g, cu_seqlens.numel() - 1)):
        raise ValueError(f"docmax must be a contiguous int32 tensor of shape (num_heads / {g}, num_docs) = "
                         f"({mcfg.parts[0].num_heads // g}, {cu_seqlens.numel() - 1}), got "
                         f"{tuple(docmax.shape)} {docmax.dtype}")


def _check_rope_tables(mcfg: MultiQuantizeConfig, rope_tables, device) -> int:
    """The rows of the launch's cos/sin tables (1 without rotary): fp32 (rows, rotary_dim // 2)."""
    rd = max(p.rotary_dim for p in mcfg.parts)
    if bool(rd) != (rope_tables is not None):
        raise ValueError("rope_tables=(cos, sin) is needed exactly when a part has rotary")
    if not rd:
        return 1
    from ..validation import check_kernel_tensors

    cos, sin = rope_tables
    rows = cos.shape[0] if isinstance(cos, torch.Tensor) and cos.dim() == 2 else -1
    check_kernel_tensors((("cos", cos, (rows, rd // 2), torch.float32), ("sin", sin, (rows, rd // 2), torch.float32)),
                         device)
    return rows


def launch_fused_quantize_multi_sm90(xs, cu_seqlens: torch.Tensor, config, sets, rowdot=None, docmax=None,
                                    rope_tables=None) -> None:
    """Launch into preallocated outputs: sets[i] = [(data_td, data_dt or None, scale)] per set of tensor i.

    xs contiguous, cu_seqlens int32 on their device, data_dt of shape (H, D, transposed_tokens(T, docs)).
    rowdot: (y, out) when the first part has emit_rowdot: y contiguous like xs[0], out (H, T) fp32.
    rope_tables: (cos, sin) as fused_quantize_multi_sm90's.
    One kernel for all tensors, no host sync (benchmarks time this to see the kernel alone).
    """
    mcfg = as_multi(config) if not isinstance(config, (list, tuple)) else MultiQuantizeConfig(tuple(config))
    if mcfg.parts[0].emit_rowdot != (rowdot is not None):
        raise ValueError("rowdot=(y, out) is needed exactly when the first part has emit_rowdot")
    _check_docmax(mcfg, docmax, cu_seqlens)
    rows = _check_rope_tables(mcfg, rope_tables, xs[0].device)
    T = xs[0].shape[0]
    num_docs = cu_seqlens.numel() - 1
    if T == 0 or num_docs == 0:
        for ps in sets:
            for _, dt, _ in ps:
                if dt is not None:
                    dt.zero_()
        return
    Tdt = transposed_tokens(T, num_docs)
    ptrs = [cu_seqlens.data_ptr()]
    for p_i in range(MAX_PARTS):
        if p_i < len(mcfg.parts):
            ps = sets[p_i]
            s0 = ps[0]
            s1 = ps[1] if len(ps) > 1 else (None, None, None)
            ptrs.append(xs[p_i].data_ptr())
            ptrs += [t.data_ptr() if t is not None else 0 for t in (*s0, *s1)]
        else:
            ptrs += [0] * 7
    ptrs += [rowdot[0].data_ptr(), rowdot[1].data_ptr()] if rowdot is not None else [0, 0]
    ptrs.append(docmax.data_ptr() if docmax is not None else 0)
    ptrs += [t.data_ptr() for t in rope_tables] if rope_tables is not None else [0, 0]
    stream = torch.cuda.current_stream(xs[0].device).cuda_stream
    _launch(mcfg, ptrs, (T, Tdt, num_docs, chunk_grid_slots(T, num_docs, TILE_TOKENS), rows), stream)


def fused_quantize_sm90(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: QuantizeConfig,
    chunks: torch.Tensor | None = None,
    debug_fill: int | None = None,
) -> tuple[QuantizedTHD, QuantizedTHD | None]:
    """Quantize x (T, H, D) bf16 on the current stream; returns (block-scaled set, per-token set or None).

    One kernel launch and no host sync: every CTA locates its chunk from cu_seqlens itself, so no
    chunk table is built. `chunks` is accepted for compatibility and ignored. `debug_fill` (tests
    only) fills every output byte with that value before the launch, so a byte the kernel fails
    to write shows up.
    """
    del chunks  # the kernel schedules itself from cu_seqlens
    if x.dim() != 3 or x.dtype != torch.bfloat16 or not x.is_cuda:
        raise ValueError("x must be a CUDA bf16 tensor of shape (T, H, D)")
    return fused_quantize_multi_sm90([x], cu_seqlens, as_multi(config), debug_fill)[0]


def quantize_with_rowdot_sm90(x: torch.Tensor, y: torch.Tensor, cu_seqlens: torch.Tensor, config,
                              debug_fill: int | None = None, docmax: torch.Tensor | None = None,
                              ) -> tuple[QuantizedTHD, torch.Tensor]:
    """x quantized as fused_quantize_sm90 does and rowdot (H, T) fp32 = sum over the head dim of x * y,
    in the same launch: the backward's dO and D = rowsum(dO * O). config: a QuantizeConfig or a
    one-part MultiQuantizeConfig with emit_rowdot and one set (no emit_token_copy). docmax: zeroed
    int32 (H / g, docs) raised to each document's max scale bits when the config has
    doc_scale_max_group g."""
    mcfg = as_multi(config)
    part = mcfg.parts[0]
    if len(mcfg.parts) != 1 or not part.emit_rowdot or part.num_sets != 1:
        raise ValueError("config must be one part with emit_rowdot=True and one set (no emit_token_copy)")
    if y.shape != x.shape or y.dtype != torch.bfloat16 or y.device != x.device:
        raise ValueError(f"y must be a bf16 tensor like x {tuple(x.shape)} on {x.device}, got "
                         f"{tuple(y.shape)} {y.dtype} on {y.device}")
    x = x if x.is_contiguous() else x.contiguous()
    y = y if y.is_contiguous() else y.contiguous()
    if y.data_ptr() % 16:
        raise ValueError("y must be 16-byte aligned")
    T, H, _ = x.shape
    rowdot = torch.empty(H, T, dtype=torch.float32, device=x.device)
    if debug_fill is not None:
        rowdot.view(torch.uint8).fill_(debug_fill)
    (out, _), = fused_quantize_multi_sm90([x], cu_seqlens, mcfg, debug_fill, rowdot=(y, rowdot), docmax=docmax)
    return out, rowdot


def launch_fused_quantize_sm90(x: torch.Tensor, cu_seqlens: torch.Tensor, config, sets) -> None:
    """Launch into preallocated outputs: `sets` is [(data_td, data_dt or None, scale)] per set.

    x must be contiguous, cu_seqlens int32 on x's device, data_dt of shape (H, D, transposed_tokens(T, docs)).
    One kernel, no host sync (benchmarks time this to see the kernel alone).
    """
    launch_fused_quantize_multi_sm90([x], cu_seqlens, as_multi(config), [sets])


def qkv_config(head_dim: int, q_heads: int, kv_heads: int, block_tokens: int, heads_per_cta: int = 0,
               **kw) -> MultiQuantizeConfig:
    """The Q/K/V launch of an attention call: Q per token; K and V per block (+ per-token copy if block > 1).

    heads_per_cta applies to Q, K and V (0: each part's automatic choice); kw go to MultiQuantizeConfig.
    """
    return _qkv_config(head_dim, q_heads, kv_heads, block_tokens, heads_per_cta, tuple(sorted(kw.items())))


@functools.cache
def forward_only(qkv: MultiQuantizeConfig) -> MultiQuantizeConfig:
    """A Q/K/V launch (qkv_config, tuned or not) reduced to what the forward and the bf16-dS backward
    (sm90/attention_bwd.py) read: Q and K (and K's per-token copy) token-major only, V (and its
    copy) transposed in P-fragment order only. That backward takes Q's codes as bf16 from a copy
    (sm90/codes.py, loaded by TMA), converts K's [t, d] codes to bf16 in shared memory and transposes
    V^T there (dP^T's A operand), and the emulator's backward dequantizes the same layouts, so a
    training call writes
    what an inference call writes: token-block K and V 2 of their 4 bytes per element, Q 1 of 2.
    The launch settings stay but the bound: at 5 CTAs per SM (48 registers) such a body spills 32
    bytes (per-token K, V), at 4 it does not."""
    q, k, v = qkv.parts
    q = dataclasses.replace(q, emit_transposed=False, dt_pv_order=False)
    k = dataclasses.replace(k, emit_transposed=False)
    v = dataclasses.replace(v, emit_token_major=False)
    bound = min(qkv.min_ctas_per_sm, 4) if qkv.min_ctas_per_sm else 0
    return dataclasses.replace(qkv, parts=(q, k, v), min_ctas_per_sm=bound)


# launch bound of a Q/K/V launch with the Hadamard transform or interleaved RoPE (sm_90a builds of the
# training call's launch, d64 and d128): they spill 100-250 bytes at 64 registers (4 CTAs per SM), 0-56 at
# 80 (3). Half-split RoPE, whose lane pairs split the slice's frequencies, fits 64 (0-8 bytes)
HADAMARD_MIN_CTAS = 3


@functools.cache
def with_rotations(qkv: MultiQuantizeConfig, rotary: str = "none", rotary_dim: int = 0,
                   hadamard: bool = False) -> MultiQuantizeConfig:
    """A Q/K/V launch (qkv_config, tuned or reduced) with the call's rotations of Q and K: RoPE
    (rotary.py; mode "half" or "interleaved" on the first rotary_dim channels) and the Walsh-Hadamard
    transform with Q's and K's power-of-two shifts (rotary.hadamard_shift). V is never rotated."""
    from ..rotary import hadamard_shift

    q, k, v = qkv.parts
    d = q.head_dim
    q = dataclasses.replace(q, rotary=rotary, rotary_dim=rotary_dim, hadamard=hadamard_shift(d, "q") if hadamard else 0)
    k = dataclasses.replace(k, rotary=rotary, rotary_dim=rotary_dim, hadamard=hadamard_shift(d, "k") if hadamard else 0)
    bound = qkv.min_ctas_per_sm
    if (hadamard or rotary == "interleaved") and bound:
        bound = min(bound, HADAMARD_MIN_CTAS)
    return dataclasses.replace(qkv, parts=(q, k, v), min_ctas_per_sm=bound)


@functools.cache
def dout_config(head_dim: int, num_heads: int) -> QuantizeConfig:
    """dO of the backward: per token, both orientations (dP = dO.V^T reads [t,d], dV = P^T.dO reads [d,t],
    the latter with P^T from registers, hence P-fragment order)."""
    return QuantizeConfig(head_dim=head_dim, num_heads=num_heads, block_tokens=1, dt_pv_order=True)


@functools.cache
def dout_delta_config(head_dim: int, num_heads: int, doc_scale_max_group: int = 0,
                      rowdot_quantized: bool = False) -> MultiQuantizeConfig:
    """The backward's preprocess in one launch: dO quantized as dout_config, and D = rowsum(dO * O);
    with doc_scale_max_group g, also the max dO scale per (document, group of g heads): the bf16-dS
    backward's dV fold references (attention_bwd.dv_fold_reference), no torch launches.
    rowdot_quantized: D from dO's e4m3 values (recipes.DELTAS "quantized")."""
    return MultiQuantizeConfig((dataclasses.replace(dout_config(head_dim, num_heads), emit_rowdot=True,
                                                    doc_scale_max_group=doc_scale_max_group,
                                                    rowdot_quantized=rowdot_quantized),))


@functools.cache
def _qkv_config(head_dim, q_heads, kv_heads, block_tokens, heads_per_cta, kw):
    # Q^T and V^T are B operands of wgmmas with A from registers: P-fragment order (quant.PV_ORDER16)
    q = QuantizeConfig(head_dim=head_dim, num_heads=q_heads, block_tokens=1, heads_per_cta=heads_per_cta,
                       dt_pv_order=True)
    k = QuantizeConfig(head_dim=head_dim, num_heads=kv_heads, block_tokens=block_tokens,
                       emit_token_copy=block_tokens > 1, heads_per_cta=heads_per_cta)
    v = dataclasses.replace(k, dt_pv_order=True)
    kw = dict(kw)
    # block 1 bodies fit 48 registers without spills (5 CTAs/SM); block 128 spills there, so 4
    if block_tokens == 1 and head_dim <= 128:
        kw.setdefault("min_ctas_per_sm", 5)
    return MultiQuantizeConfig((q, k, v), **kw)
