"""Fused FP8 (e4m3) quantization of packed THD tensors for Hopper (sm_90a).

One pass over x (T, H, D) bf16 writes, bit-exactly as `quant.quantize_thd`:
  set 0: data_td (T,H,D), data_dt (H,D,T_pad), scale (H,T) with block_tokens = B;
  set 1 (optional, `emit_token_copy`): the same three with block_tokens = 1.

Work decomposition. One CTA per (document-local chunk of 128 tokens, head group
of HG heads). A chunk starting at token s is processed in a 144-token window
starting at s0 = s - s % 16: window slot tau <-> token s0 + tau, and slots
outside [s, s + n) are masked. Aligning the window to 16 tokens makes every
16-token group of data_dt a 16-byte aligned segment, so the transposed copy is
written with 16-byte stores even when documents start at arbitrary tokens; only
the (at most two) segments a chunk shares with a neighbouring chunk fall back
to byte stores. Warp w (9 warps) owns window slots [16w, 16w + 16).

Thread mapping. A thread owns "slots" (quad, hl, j): 4 consecutive tokens
4*quad .. 4*quad+3 of its warp's group, head hl of the group, and the 16
consecutive elements 16j .. 16j+15 of the head dim. So it issues 16-byte
loads (2 per token), 16-byte stores of data_td (1 per token), and holds a
4-token x 16-dim block that turns into 16 words of data_dt (4 tokens each)
with byte permutes. The L = D/16 lanes of a token reduce its amax with
shuffles; block amax goes through shared memory (one value per warp).

Shared memory. The transposed tile of a set is [HG*D rows][9 segments][16 B].
Segment g of row r sits at slot (g + r // 16) % 9: the lanes of a warp store
rows 16 apart, and without the rotation they would all hit one bank.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

# The DSL fixes its default arch at import; exporting a kernel compiled for another arch fails
# (4.8.1), so a GPU-less cross-compile must announce its target before cutlass is imported.
if os.environ.get("FLAMIA_ARCH") and not os.environ.get("CUTE_DSL_ARCH"):
    os.environ["CUTE_DSL_ARCH"] = os.environ["FLAMIA_ARCH"]

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Uint8, Uint32, const_expr
from cutlass._mlir.dialects import arith, llvm

from .quant import TOKEN_PAD, QuantizedTHD, round_up
from .schedules.varlen_chunks import build_varlen_chunks, max_chunks

TILE_TOKENS = 128
GROUP_TOKENS = 16  # tokens per warp and per data_dt segment (16 fp8 = 16 bytes)
WINDOW_GROUPS = TILE_TOKENS // GROUP_TOKENS + 1  # 9: one extra group for the s % 16 shift
NUM_WARPS = WINDOW_GROUPS
NUM_THREADS = 32 * NUM_WARPS  # 288
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_BLOCK_TOKENS = (1, 64, 128)

SOURCE_FILES = (Path(__file__).resolve(),)


@dataclass(frozen=True)
class QuantizeConfig:
    head_dim: int
    num_heads: int
    block_tokens: int = 1
    emit_token_copy: bool = False
    emit_transposed: bool = True
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
        if self.emit_token_copy and self.block_tokens == 1:
            bad("emit_token_copy", "the per-token copy duplicates set 0 when block_tokens == 1")
        if self.tile_tokens != TILE_TOKENS:
            bad("tile_tokens", f"only {TILE_TOKENS} is supported (the data_dt pad and block 128), got {self.tile_tokens}")
        if self.threads not in (0, NUM_THREADS):
            bad("threads", f"the 144-token window needs {NUM_THREADS} threads (9 warps), got {self.threads}")
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
        tile = self.heads_per_cta * self.head_dim * WINDOW_GROUPS * GROUP_TOKENS if self.emit_transposed else 0
        return self.num_sets * tile + NUM_WARPS * 2 * self.heads_per_cta * 4 + 64


def _auto_heads_per_cta(head_dim: int, num_heads: int) -> int:
    # 128 head-dim elements per token per CTA fill a warp's 32 lanes (4 tokens x 8 lanes).
    hg = max(1, 128 // head_dim)
    while num_heads % hg:
        hg //= 2
    return hg


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------


def _prmt(a, b, sel: int):
    """PTX byte permute without side effects, so the compiler may schedule it freely."""
    return Uint32(
        llvm.inline_asm(
            Uint32.mlir_type,
            [Uint32(a).ir_value(), Uint32(b).ir_value(), Uint32(sel).ir_value()],
            "prmt.b32 $0, $1, $2, $3;",
            "=r,r,r,r",
            has_side_effects=False,
        )
    )


def _as_f32(bits):
    return Float32(arith.bitcast(Float32.mlir_type, Int32(bits).ir_value()))


def _imax(a, b):
    return Int32(cutlass.max(a, b))


def _select(cond, a, b):
    return type(a)(cutlass.select_(cond, a, b))


def _pow2_scale_bits(amax_bits):
    """(scale bits, 1/scale bits) from |x| amax bits: quant.formats.pow2_scale_from_amax_bits for e4m3.

    1/scale is exact: k <= 120 for finite amax, so 2**-k stays normal.
    """
    biased = (amax_bits >> 23) & 0xFF
    k = biased - 135 + _select((amax_bits & 0x7FFFFF) > 0x600000, Int32(1), Int32(0))
    k = _imax(k, Int32(-126))
    k = Int32(cutlass.min(k, Int32(127)))
    scale = (k + 127) << 23
    inv = (127 - k) << 23
    # amax == 0 falls out as the smallest scale 2**-126: finite, and never the max of a scale fold
    non_finite = biased == 255
    scale = _select(non_finite, Int32(0x7FC00000), scale)
    inv = _select(non_finite, Int32(0x7FC00000), inv)
    return scale, inv


class FusedQuantizeSm90:
    """CuTe DSL kernel: fused token-block FP8 quantization, both orientations, one pass."""

    def __init__(self, config: QuantizeConfig):
        self.cfg = config
        self.D = config.head_dim
        self.H = config.num_heads
        self.HG = config.heads_per_cta
        self.B = config.block_tokens
        self.L = self.D // 16  # lanes per token row
        self.slots = 4 * self.HG * self.L  # (quad, hl, j) slots per warp
        self.spt = max(1, self.slots // 32)  # slots per thread
        self.rows = self.HG * self.D  # rows of the transposed tile
        self.nblk = TILE_TOKENS // self.B if self.B > 1 else 0  # scale blocks per chunk

    @cute.jit
    def __call__(
        self,
        x_ptr: cute.Pointer,
        chunks_ptr: cute.Pointer,
        td0_ptr: cute.Pointer,
        dt0_ptr: cute.Pointer,
        sc0_ptr: cute.Pointer,
        td1_ptr: cute.Pointer,
        dt1_ptr: cute.Pointer,
        sc1_ptr: cute.Pointer,
        num_tokens: Int32,
        padded_tokens: Int32,
        num_chunks: Int32,
        stream: cuda.CUstream,
    ):
        D, H = self.D, self.H
        T = num_tokens
        Tp = cute.assume(padded_tokens, divby=TOKEN_PAD)
        thd = cute.make_layout((T, H, D), stride=(H * D, D, 1))
        hdt = cute.make_layout((H, D, Tp), stride=(D * Tp, Tp, 1))
        ht = cute.make_layout((H, T), stride=(T, 1))
        mX = cute.make_tensor(x_ptr, thd)
        mChunks = cute.make_tensor(chunks_ptr, cute.make_layout((num_chunks, 2), stride=(2, 1)))
        outs = []
        for s_i, (td, dt, sc) in enumerate(((td0_ptr, dt0_ptr, sc0_ptr), (td1_ptr, dt1_ptr, sc1_ptr))):
            if const_expr(s_i < self.cfg.num_sets):
                mDT = cute.make_tensor(dt, hdt) if const_expr(self.cfg.emit_transposed) else None
                outs.append((cute.make_tensor(td, thd), mDT, cute.make_tensor(sc, ht)))
            else:
                outs.append((None, None, None))
        self.kernel(mX, mChunks, outs[0][0], outs[0][1], outs[0][2], outs[1][0], outs[1][1], outs[1][2], T, Tp).launch(
            grid=[num_chunks, H // self.HG, 1],
            block=[NUM_THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mChunks: cute.Tensor,
        mTD0: cute.Tensor,
        mDT0: cute.Tensor,
        mS0: cute.Tensor,
        mTD1: cute.Tensor,
        mDT1: cute.Tensor,
        mS1: cute.Tensor,
        T: Int32,
        Tp: Int32,
    ):
        D, HG, L, B, SPT = self.D, self.HG, self.L, self.B, self.spt
        NSETS = self.cfg.num_sets
        TRANS = self.cfg.emit_transposed
        tidx, _, _ = cute.arch.thread_idx()
        cta, hgrp, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32

        smem = cutlass.memory.SmemAllocator()
        sAmax = smem.allocate_tensor(Int32, cute.make_layout((NUM_WARPS, 2, HG), stride=(2 * HG, HG, 1)), 16)
        tiles = []
        for _s in cutlass.range_constexpr(NSETS):
            if const_expr(TRANS):
                tiles.append(
                    smem.allocate_tensor(
                        Uint32,
                        cute.make_layout((self.rows, WINDOW_GROUPS, 4), stride=(WINDOW_GROUPS * 4, 4, 1)),
                        16,
                    )
                )
            else:
                tiles.append(None)

        start = mChunks[cta, 0]
        n = mChunks[cta, 1]
        if n > 0:
            end = start + n
            s0 = start - (start & 15)
            # lane fields; hl is lane-only because HG*L divides 32
            j = lane % L
            hl = (lane // L) % HG
            head = hgrp * HG + hl
            active = lane < self.slots  # only false when HG*D == 64

            ld_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
            st_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float8E4M3FN, num_bits_per_copy=128)
            w_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=128)

            # ---- load: SPT slots x 4 tokens x 16 bf16; masked tokens read as 0 --------------
            rx = []
            tok = []
            valid = []
            tamax = []
            for i in cutlass.range_constexpr(SPT):
                quad = (lane + 32 * i) // (L * HG)
                for p in cutlass.range_constexpr(4):
                    t = s0 + 16 * warp + 4 * quad + p
                    ok = (t >= start) & (t < end) & active
                    frag = cute.make_rmem_tensor(16, BFloat16)
                    frag.fill(0.0)
                    if ok:
                        cute.copy(ld_atom, cute.local_tile(mX[t, head, None], (16,), (j,)), frag)
                    rx.append(frag)
                    tok.append(t)
                    valid.append(ok)
            # ---- per-token amax on |x| bits (integer max: NaN > inf > finite) ---------------
            for it in cutlass.range_constexpr(SPT * 4):
                words = cute.recast_tensor(rx[it], Uint32)
                m = Uint32(0)
                for k in cutlass.range_constexpr(8):
                    w = words[k] & Uint32(0x7FFF7FFF)
                    m = Uint32(cutlass.max(m, Uint32(cutlass.max(w & Uint32(0xFFFF), w >> 16))))
                a = Int32(m) << 16  # bf16 |x| bits -> fp32 |x| bits
                for off in cutlass.range_constexpr(int(math.log2(L))):
                    a = _imax(a, cute.arch.shuffle_sync_bfly(a, offset=1 << off))
                tamax.append(a)

            # ---- block amax: per warp in registers + shuffles, across warps in smem --------
            if const_expr(B > 1):
                for b in cutlass.range_constexpr(self.nblk):
                    acc = Int32(0)
                    for it in cutlass.range_constexpr(SPT * 4):
                        in_b = ((tok[it] - start) // B) == b  # masked tokens carry amax 0
                        acc = _imax(acc, _select(in_b, tamax[it], Int32(0)))
                    for sh in cutlass.range_constexpr(int(math.log2(32 // (L * HG)))):
                        acc = _imax(acc, cute.arch.shuffle_sync_bfly(acc, offset=(L * HG) << sh))
                    if (lane < L * HG) & (j == 0):
                        sAmax[warp, b, hl] = acc
                cute.arch.sync_threads()

            # ---- scales, quantize, data_td, scale, transposed tile ---------------------------
            blk_bits = []
            if const_expr(B > 1):
                for b in cutlass.range_constexpr(self.nblk):
                    acc = Int32(0)
                    for w2 in cutlass.range_constexpr(NUM_WARPS):
                        acc = _imax(acc, sAmax[w2, b, hl])
                    blk_bits.append(acc)
            # rows 16j .. 16j+15 of head hl share one rotated segment slot
            slot_w = (warp + hl * L + j) % WINDOW_GROUPS
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
                        if const_expr(B == 1 or st == 1):
                            amax = tamax[it]
                        elif const_expr(self.nblk == 1):
                            amax = blk_bits[0]
                        else:
                            amax = _select(tok[it] - start >= B, blk_bits[1], blk_bits[0])
                        sb, ib = _pow2_scale_bits(amax)
                        sbits[st].append(sb)
                        q = cute.make_rmem_tensor(16, Float8E4M3FN)
                        q.store((xf * _as_f32(ib)).to(Float8E4M3FN))
                        if valid[it]:
                            cute.copy(st_atom, q, cute.local_tile(mTD[tok[it], head, None], (16,), (j,)))
                        qw = cute.recast_tensor(q, Uint32)
                        # masked tokens must be 0 in the tile: they become data_dt pad bytes
                        zw = []
                        for m in cutlass.range_constexpr(4):
                            zw.append(_select(valid[it], qw[m], Uint32(0)))
                        qwords[st].append(zw)
                t_j = s0 + 16 * warp + 4 * quad + j
                write_scale = (j < 4) & (t_j >= start) & (t_j < end) & active
                for st in cutlass.range_constexpr(NSETS):
                    mS = mS0 if const_expr(st == 0) else mS1
                    # scale: lane j < 4 of the token's lane group writes token 4*quad + j
                    sel = sbits[st][0]
                    for p in cutlass.range_constexpr(1, 4):
                        sel = _select(j == p, sbits[st][p], sel)
                    if write_scale:
                        mS[head, t_j] = sel
                    if const_expr(TRANS):
                        sT = tiles[st]
                        for m in cutlass.range_constexpr(4):
                            # 4x4 byte transpose: word b of the output holds dim 4m+b of tokens 0..3
                            w0, w1, w2_, w3 = qwords[st][0][m], qwords[st][1][m], qwords[st][2][m], qwords[st][3][m]
                            lo01 = _prmt(w0, w1, 0x5140)
                            lo23 = _prmt(w2_, w3, 0x5140)
                            hi01 = _prmt(w0, w1, 0x7362)
                            hi23 = _prmt(w2_, w3, 0x7362)
                            tw = (
                                _prmt(lo01, lo23, 0x5410),
                                _prmt(lo01, lo23, 0x7632),
                                _prmt(hi01, hi23, 0x5410),
                                _prmt(hi01, hi23, 0x7632),
                            )
                            if active:
                                for b in cutlass.range_constexpr(4):
                                    sT[hl * D + 16 * j + 4 * m + b, slot_w, quad] = tw[b]

            # ---- transposed copy: 16-byte segments, byte stores at chunk edges, pad -------
            if const_expr(TRANS):
                cute.arch.sync_threads()
                is_last = end == T
                seg0 = start >> 4
                for st in cutlass.range_constexpr(NSETS):
                    mDT = mDT0 if const_expr(st == 0) else mDT1
                    sT = tiles[st]
                    for mm in cutlass.range_constexpr(self.rows * WINDOW_GROUPS // NUM_THREADS):
                        e = tidx + NUM_THREADS * mm
                        row = e // WINDOW_GROUPS
                        g = e % WINDOW_GROUPS
                        slot = (g + (row >> 4)) % WINDOW_GROUPS
                        h = hgrp * HG + row // D
                        d = row % D
                        seg_lo = s0 + 16 * g
                        lo = _imax(start, seg_lo)
                        hi = Int32(cutlass.min(end, seg_lo + 16))
                        # the last chunk also owns the pad bytes of the segment holding token T-1
                        # (segments past it are the pad loop's; extending those would overrun Tp)
                        hi = _select(is_last & (hi == T) & (lo < hi), seg_lo + 16, hi)
                        if (lo == seg_lo) & (hi == seg_lo + 16):
                            src = sT[row, slot, None]
                            dst = cute.recast_tensor(cute.local_tile(mDT[h, d, None], (16,), (seg0 + g,)), Uint32)
                            cute.copy(w_atom, src, dst)
                        elif lo < hi:
                            src8 = cute.recast_tensor(sT[row, slot, None], Uint8)
                            dst8 = cute.recast_tensor(mDT[h, d, None], Uint8)
                            for b in cutlass.range_constexpr(16):
                                tb = seg_lo + b
                                if (tb >= lo) & (tb < hi):
                                    dst8[tb] = src8[b]
                    if is_last:
                        # whole pad segments [round_up(T, 16), Tp): at most 7 per row
                        pad_seg0 = (T + 15) >> 4
                        n_pad = (Tp >> 4) - pad_seg0
                        zero = cute.make_rmem_tensor(4, Uint32)
                        zero.fill(0)
                        for mm in cutlass.range_constexpr((self.rows * 7 + NUM_THREADS - 1) // NUM_THREADS):
                            ep = tidx + NUM_THREADS * mm
                            prow = ep // 7
                            pseg = ep % 7
                            if (prow < self.rows) & (pseg < n_pad):
                                pdst = cute.recast_tensor(
                                    cute.local_tile(mDT[hgrp * HG + prow // D, prow % D, None], (16,), (pad_seg0 + pseg,)),
                                    Uint32,
                                )
                                cute.copy(w_atom, zero, pdst)


# ----------------------------------------------------------------------------------------------
# Compile and launch
# ----------------------------------------------------------------------------------------------


def _fake_ptr(dtype, align=16):
    return cute.runtime.make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)


def compile_fused_quantize_sm90(config: QuantizeConfig, arch: str = "sm_90a", extra_options: str = ""):
    """cute.compile the kernel for `arch` from plain values only (no tensors, no GPU needed)."""
    op = FusedQuantizeSm90(config)
    args = (
        _fake_ptr(BFloat16),
        _fake_ptr(Int32, 8),
        _fake_ptr(Float8E4M3FN),
        _fake_ptr(Float8E4M3FN),
        _fake_ptr(Int32, 4),
        _fake_ptr(Float8E4M3FN),
        _fake_ptr(Float8E4M3FN),
        _fake_ptr(Int32, 4),
        Int32(0),
        Int32(0),
        Int32(0),
        cute.runtime.make_fake_stream(),
    )
    options = f"--gpu-arch {arch} {extra_options}".strip()
    return cute.compile(op, *args, options=options)


def kernel_artifacts(config: QuantizeConfig, arch: str = "sm_90a"):
    """PTX, cubin, SASS and register usage of the kernel for `arch` (no GPU needed)."""
    from .compile_cache import compile_artifacts

    return compile_artifacts(compile_fused_quantize_sm90, config, arch)


def get_compiled(config: QuantizeConfig, arch: str | None = None):
    from .compile_cache import compile_cached, target_arch

    arch = arch or target_arch()
    return compile_cached(SOURCE_FILES, config, arch, lambda cfg, a: compile_fused_quantize_sm90(cfg, a))


def _ptr(t: torch.Tensor | None, dtype, align=16):
    if t is None:
        return cute.runtime.make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)
    return cute.runtime.make_ptr(dtype, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def fused_quantize_sm90(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: QuantizeConfig,
    chunks: torch.Tensor | None = None,
    debug_fill: int | None = None,
) -> tuple[QuantizedTHD, QuantizedTHD | None]:
    """Quantize x (T, H, D) bf16 on the current stream; returns (block-scaled set, per-token set or None).

    `chunks` is the table from `build_varlen_chunks(cu_seqlens, T)`; pass it when several operands
    share cu_seqlens so it is built once. `debug_fill` (tests only) fills every output byte with
    that value before the launch, so a byte the kernel fails to write shows up.
    """
    if x.dim() != 3 or x.dtype != torch.bfloat16 or not x.is_cuda:
        raise ValueError("x must be a CUDA bf16 tensor of shape (T, H, D)")
    T, H, D = x.shape
    if (H, D) != (config.num_heads, config.head_dim):
        raise ValueError(f"x has (H, D) = {(H, D)}, config expects {(config.num_heads, config.head_dim)}")
    x = x.contiguous()
    if x.data_ptr() % 16:
        raise ValueError("x must be 16-byte aligned")
    Tp = round_up(max(T, 1), TOKEN_PAD)
    if H * D * Tp >= 2**31:
        raise ValueError("tensor too large for 32-bit indexing")
    dev = x.device
    num_docs = cu_seqlens.numel() - 1

    def alloc():
        td = torch.empty(T, H, D, dtype=torch.float8_e4m3fn, device=dev)
        dt = torch.empty(H, D, Tp, dtype=torch.float8_e4m3fn, device=dev) if config.emit_transposed else None
        sc = torch.empty(H, T, dtype=torch.float32, device=dev)
        return td, dt, sc

    sets = [alloc() for _ in range(config.num_sets)]
    if debug_fill is not None:
        for t in (t for st in sets for t in st if t is not None):
            t.view(torch.uint8).fill_(debug_fill)
    n_chunks = max_chunks(T, num_docs, TILE_TOKENS)
    if T == 0 or n_chunks == 0:
        for _, dt, _ in sets:
            if dt is not None:
                dt.zero_()
    else:
        if chunks is None:
            chunks = build_varlen_chunks(cu_seqlens.to(dev), T, TILE_TOKENS)
        if chunks.shape != (n_chunks, 2) or chunks.dtype != torch.int32:
            raise ValueError(f"chunks must be an int32 ({n_chunks}, 2) table from build_varlen_chunks")
        fn = get_compiled(config)
        s1 = sets[1] if config.num_sets == 2 else (None, None, None)
        stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
        fn(
            _ptr(x, BFloat16),
            _ptr(chunks, Int32, 8),
            _ptr(sets[0][0], Float8E4M3FN),
            _ptr(sets[0][1], Float8E4M3FN),
            _ptr(sets[0][2], Int32, 4),
            _ptr(s1[0], Float8E4M3FN),
            _ptr(s1[1], Float8E4M3FN),
            _ptr(s1[2], Int32, 4),
            Int32(T),
            Int32(Tp),
            Int32(n_chunks),
            stream,
        )
    out0 = QuantizedTHD(sets[0][0], sets[0][1], sets[0][2], config.block_tokens, "e4m3")
    out1 = QuantizedTHD(*sets[1], 1, "e4m3") if config.num_sets == 2 else None
    return out0, out1
