"""dO for the planned Blackwell MXFP8 backward, in the CuTe DSL: both MX orientations and D = rowsum(dO * O).

One launch writes, bit-exactly as the torch specification `quant.mx_layout.pack_mx_do_operands`:
- dO's e4m3 codes with blocks of 32 along D and their token-row chunks (dP = dO V^T reduces over D);
- dO's e4m3 codes with blocks of 32 document-local tokens per head dim, token-major (dV = P^T dO reduces
  over the queries and reads them MN-major), and their dim-row chunks;
- D = rowsum(dO * O) in fp32, (H, T), in quant.mx_layout.rowsum_do_o's order.
Like the forward's fused quantization (quantize_mx.py) it uses no tensor core, so it builds for sm_100a,
sm_103a and sm_90a, and runs and is timed on the H200.

Grid (slots, H): CTA (s, h) takes the 128-token tile in chunk slot s (quant.mx_layout: document b's tiles
from slot sum ceil(len / 128) over b' < b) of head h; slots past the last tile leave at once. The tiles,
and so the 32-token blocks along the tokens, restart at every document start: no block mixes two
documents. Warp w owns the tile's w-th 32-token block, 4 tokens per step: lane l takes token 4 i + l // 8
and head dims 16 (l % 8) .. + 15 (quantize_mx.py's walk). Per step: a token's block amax along D is two
lanes' (one shuffle); its D is the lane's 16 products summed in order, then three butterfly shuffles over
the token's 8 lanes. After the 8 steps: a head dim's amax over the warp's 32 tokens is the lane's 8 steps
and the 4 token lanes (two shuffles per dim). Rows past the document end load as zeros (they add nothing
to an amax, as the emulator's padding), write no codes and no D, and leave token-row chunk words of 1.0;
a 32-token block that starts past the end gets 1.0 in the dim-row chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32

from .. import softmax as _softmax
from .. import tile_scheduler as _tile_scheduler
from ..compile_cache import compile_entry, launch_on_device
from ..quant import mx_layout as _mx_layout
from ..quant.mx_layout import (
    MX_BLOCK,
    MX_TILE,
    ROWSUM_LANES,
    SF_CHUNK_BYTES,
    MxDoOperands,
)
from ..sm90.primitives import ARG_BF16, ARG_F8, ARG_F32, ARG_I32, SHARED_SOURCE_FILES, as_f32, cvt_e4m3x4, ptx, st_global_v4
from ..softmax import fmax_chains
from ..validation import check_kernel_tensors
from . import quantize_mx as _quantize_mx
from .quantize_mx import (
    ABS_MASK,
    LANES_PER_ROW,
    MAX_SCAN_DOCS,
    STEPS,
    UNUSED_WORD,
    bf16_hi,
    bf16_lo,
    bf16_rows,
    document_tables,
    document_tiles,
    e8m0_biased,
    load_row_words,
    st_global_u32,
    tile_slot,
)

SOURCE_FILES = (Path(__file__).resolve(), Path(_quantize_mx.__file__).resolve(), Path(_mx_layout.__file__).resolve(),
                *(Path(m.__file__).resolve() for m in (_softmax, _tile_scheduler)), *SHARED_SOURCE_FILES)
MIN_CTAS_PER_SM = 4  # ptxas register cap 128: 16 warps per SM to hide the loads
# a quarter of the unified L1 / shared memory as shared (the CTAs need 19 KB): the rest caches the
# second read of dO
assert LANES_PER_ROW == ROWSUM_LANES  # D's partial sums are the lanes'


@dataclass(frozen=True)
class MxDoQuantizeConfig:
    """Compile-time shape: head dim 128 (one scale chunk = 4 blocks of 32). scan_documents: each CTA sums
    the documents' tiles from cu_seqlens itself (a shared-memory table, at most MAX_SCAN_DOCS documents);
    False: it reads the host's prefix sums (sf_tile_starts)."""

    head_dim: int = 128
    scan_documents: bool = True

    def __post_init__(self):
        if self.head_dim != 128:
            raise ValueError(f"MxDoQuantizeConfig.head_dim must be 128, got {self.head_dim}")
        if not isinstance(self.scan_documents, bool):
            raise ValueError(f"MxDoQuantizeConfig.scan_documents must be a bool, got {self.scan_documents!r}")


def smem_bytes(config: MxDoQuantizeConfig) -> int:
    """The tile's 4 x 128 scales along the tokens, exchanged between the warps, and the document table."""
    table = 4 * (MAX_SCAN_DOCS + 1) + 64 if config.scan_documents else 0
    return MX_TILE * config.head_dim // 32 + table


def mul_add_rn(acc, a, b):
    """acc + a * b with the product rounded to fp32 first (no fused multiply-add: rowsum_do_o's order)."""
    return ptx("{\n.reg .f32 p;\nmul.rn.f32 p, $2, $3;\nadd.rn.f32 $0, $1, p;\n}", "=f,f,f,f",
               [Float32(acc), Float32(a), Float32(b)], result=Float32)


def mul_rn(a, b):
    return ptx("mul.rn.f32 $0, $1, $2;", "=f,f,f", [Float32(a), Float32(b)], result=Float32)


def add_rn(a, b):
    return ptx("add.rn.f32 $0, $1, $2;", "=f,f,f", [Float32(a), Float32(b)], result=Float32)


class MxDoQuantizeSm100:
    def __init__(self, config: MxDoQuantizeConfig):
        self.cfg = config
        self.D = config.head_dim
        self.nkb = self.D // MX_BLOCK

    @cute.jit
    def __call__(
        self,
        do_ptr: cute.Pointer, o_ptr: cute.Pointer, cu_ptr: cute.Pointer, tiles_ptr: cute.Pointer,
        do8_ptr: cute.Pointer, dosf_ptr: cute.Pointer, dot8_ptr: cute.Pointer, dotsf_ptr: cute.Pointer,
        delta_ptr: cute.Pointer,
        T: Int32, slots: Int32, num_heads: Int32, num_docs: Int32,
        stream: cuda.CUstream,
    ):
        words = self.D // 2  # a row of bf16 as u32 words
        mCu = cute.make_tensor(cu_ptr, cute.make_layout(num_docs + 1))
        mTiles = cute.make_tensor(tiles_ptr, cute.make_layout(num_docs + 1))
        self.kernel(
            bf16_rows(do_ptr, num_heads, T, words), bf16_rows(o_ptr, num_heads, T, words), mCu, mTiles,
            do8_ptr, dosf_ptr, dot8_ptr, dotsf_ptr, delta_ptr, T, slots, num_heads, num_docs,
        ).launch(grid=[slots, num_heads, 1], block=[MX_TILE, 1, 1], stream=stream,
                 min_blocks_per_mp=MIN_CTAS_PER_SM, preferred_smem_carveout=25)

    @cute.kernel
    def kernel(self, mdO: cute.Tensor, mO: cute.Tensor, mCu: cute.Tensor, mTiles: cute.Tensor,
               do8_ptr: cute.Pointer, dosf_ptr: cute.Pointer, dot8_ptr: cute.Pointer, dotsf_ptr: cute.Pointer,
               delta_ptr: cute.Pointer, T: Int32, slots: Int32, num_heads: Int32, num_docs: Int32):
        slot, head, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()  # one allocator for the kernel: its tensors do not overlap
        # the scales along the tokens, byte (block kb, head dim d) at 128 kb + d
        sScale = smem.allocate_tensor(Uint32, cute.make_layout(MX_TILE * self.D // 128), 16)
        tiles = document_tiles(smem, self.cfg.scan_documents, mTiles, mCu, num_docs, tidx)
        if slot < tiles[num_docs]:
            start, length, tile_col = tile_slot(slot, tiles, mCu, num_docs)
            chunk = (Int64(head) * Int64(slots) + Int64(slot)) * SF_CHUNK_BYTES
            self.quantize_tile(mdO, mO, head, start, length, tile_col, tidx, sScale,
                               (do8_ptr.toint(), Int64(dosf_ptr.toint()) + chunk, dot8_ptr.toint(),
                                Int64(dotsf_ptr.toint()) + chunk, Int64(delta_ptr.toint()) + Int64(head) * Int64(T) * 4),
                               num_heads)

    @cute.jit
    def quantize_tile(self, mdO, mO, head, start, length, tile_col, tidx, sScale, outs, heads):
        D, nkb = self.D, self.nkb
        do8, do_chunk, dot8, dot_chunk, delta_row = outs
        lane, warp = tidx % 32, tidx // 32
        tq, dc = lane // LANES_PER_ROW, lane % LANES_PER_ROW
        lw = D // LANES_PER_ROW // 2  # bf16 words per lane and token: 8 (two 16-byte loads)
        raw = cute.make_rmem_tensor(cute.make_layout(lw), Uint32)
        o = cute.make_rmem_tensor(cute.make_layout(lw), Uint32)
        col_max = [Float32(0.0)] * (2 * lw)  # |dO| max over the lane's tokens, per head dim of the lane
        for i in cutlass.range_constexpr(STEPS):
            n = 32 * warp + 4 * i + tq  # the token's row of the tile
            pos = tile_col + n
            valid = pos < length
            load_row_words(mdO, head, start, pos, length, dc, lw, raw)
            load_row_words(mO, head, start, pos, length, dc, lw, o)
            # D: the lane's 16 products in head-dim order, then the token's 8 lanes pairwise
            x = [f(raw[w]) for w in range(lw) for f in (bf16_lo, bf16_hi)]
            y = [f(o[w]) for w in range(lw) for f in (bf16_lo, bf16_hi)]
            acc = mul_rn(x[0], y[0])
            for e in cutlass.range_constexpr(1, 2 * lw):
                acc = mul_add_rn(acc, x[e], y[e])
            for sh in cutlass.range_constexpr(3):
                acc = add_rn(acc, cute.arch.shuffle_sync_bfly(acc, offset=1 << sh))
            if valid & (dc == 0):
                st_global_f32(delta_row + 4 * Int64(start + pos), acc)
            # along D: the token's amax per 32 dims, from the lane's 16 and its partner's
            mag = [f(raw[w] & ABS_MASK) for w in range(lw) for f in (bf16_lo, bf16_hi)]
            a = fmax_chains(mag)
            a = cute.arch.fmax(a, cute.arch.shuffle_sync_bfly(a, offset=1))
            biased = e8m0_biased(a)
            inv = as_f32((254 - biased) << 23)
            codes = [cvt_e4m3x4(*[x[4 * c + j] * inv for j in range(4)]) for c in range(lw // 2)]
            # the token's four block scales: block k's is at lane 8 tq + 2 k (every lane shuffles)
            sf_word = Int32(0)
            for k in cutlass.range_constexpr(nkb):
                sf_word = sf_word | (Int32(cute.arch.shuffle_sync(biased, lane - dc + 2 * k)) << (8 * k))
            if valid:
                st_global_v4(Int64(do8) + (Int64(start + pos) * Int64(heads) + Int64(head)) * D + 16 * dc, codes)
            if dc == 0:  # row n's chunk word (quant.mx_layout.sf_byte_offset(n, 0)); past the end: 1.0
                st_global_u32(do_chunk + 4 * ((n % 32) * 4 + n // 32),
                              cutlass.select_(valid, Uint32(sf_word), Uint32(UNUSED_WORD)))
            col_max = [cute.arch.fmax(col_max[e], mag[e]) for e in range(2 * lw)]
        # along the tokens: a head dim's amax over the warp's 32 tokens (its 4 token lanes)
        inv_t = []
        packed = [Uint32(0)] * (lw // 2)  # the lane's 16 scale bytes
        for e in cutlass.range_constexpr(2 * lw):
            m = cute.arch.fmax(col_max[e], cute.arch.shuffle_sync_bfly(col_max[e], offset=8))
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=16))
            b = e8m0_biased(m)
            inv_t.append(as_f32((254 - b) << 23))
            packed[e // 4] = packed[e // 4] | (Uint32(b) << (8 * (e % 4)))
        # dO again (its tile is in L2: holding it in registers through the first pass spills)
        for i in cutlass.range_constexpr(STEPS):
            pos = tile_col + 32 * warp + 4 * i + tq
            load_row_words(mdO, head, start, pos, length, dc, lw, raw)
            x = [f(raw[w]) for w in range(lw) for f in (bf16_lo, bf16_hi)]
            codes = [cvt_e4m3x4(*[x[4 * c + j] * inv_t[4 * c + j] for j in range(4)]) for c in range(lw // 2)]
            if pos < length:
                st_global_v4(Int64(dot8) + (Int64(start + pos) * Int64(heads) + Int64(head)) * D + 16 * dc, codes)
        # the dim-row chunk: row d = tidx, block kb = the tile's kb-th 32-token block (1.0 if it starts past
        # the document end)
        if tq == 0:
            live = tile_col + 32 * warp < length
            for j in cutlass.range_constexpr(lw // 2):
                sScale[warp * (D // 4) + 4 * dc + j] = cutlass.select_(live, packed[j], Uint32(UNUSED_WORD))
        cute.arch.barrier()
        sBytes = cute.make_tensor(cute.recast_ptr(sScale.iterator, dtype=cutlass.Uint8),
                                  cute.make_layout(MX_TILE * D // 32))
        word = Uint32(0)
        for kb in cutlass.range_constexpr(nkb):
            word = word | (Uint32(sBytes[kb * D + tidx]) << (8 * kb))
        st_global_u32(dot_chunk + 4 * ((tidx % 32) * 4 + tidx // 32), word)


def st_global_f32(addr, value):
    ptx("st.global.f32 [$0], $1;", "l,f,~{memory}", [Int64(addr), Float32(value)], result=None, side_effects=True)


ARG_KINDS = (
    ARG_BF16, ARG_BF16, ARG_I32, ARG_I32,  # dout, out, cu_seqlens, tile starts
    ARG_F8, ARG_I32, ARG_F8, ARG_I32, ARG_F32,  # do, do_sf, do_t, do_t_sf, delta
    ("i32",), ("i32",), ("i32",), ("i32",),  # T, slots, H, num_docs
    ("stream",),
)


def compile_quantize_do_mx(config: MxDoQuantizeConfig, arch: str = "sm_100a", extra_options: str = "",
                           tvm_ffi: bool = False):
    """cute.compile the dO quantization for `arch` (sm_100a, sm_103a, or sm_90a) from plain values only."""
    return compile_entry(MxDoQuantizeSm100(config), ARG_KINDS, arch, extra_options, tvm_ffi)


def kernel_artifacts(config: MxDoQuantizeConfig, arch: str = "sm_100a"):
    from ..compile_cache import compile_artifacts

    return compile_artifacts(compile_quantize_do_mx, config, arch)


def quantize_do_mx(dout: torch.Tensor, out: torch.Tensor, cu_seqlens: torch.Tensor,
                   config: MxDoQuantizeConfig | None = None) -> MxDoOperands:
    """The planned sm_100a MXFP8 backward's dO operands and D of bf16 (T, H, 128) dout and the forward's
    bf16 out, on the current stream (one launch; past MAX_SCAN_DOCS documents also the host's prefix
    sums, on the device: no host sync). Bit-exactly pack_mx_do_operands(dout, out, cu_seqlens)."""
    from ..compile_cache import compile_launcher, target_arch

    if dout.dim() != 3:
        raise ValueError(f"dout must be (T, H, D), got shape {tuple(dout.shape)}")
    T, H, D = dout.shape
    config = config or MxDoQuantizeConfig(head_dim=D)
    if D != config.head_dim:
        raise ValueError(f"dout: head_dim {D} does not match {config}")
    dev = dout.device
    bf = torch.bfloat16
    check_kernel_tensors([("dout", dout, (T, H, D), bf), ("out", out, (T, H, D), bf)], dev)
    cu, num_docs, slots, config, tiles = document_tables(cu_seqlens, T, dev, config)
    f8, u8 = torch.float8_e4m3fn, torch.uint8
    do8 = torch.empty(T, H, D, dtype=f8, device=dev)
    dot8 = torch.empty(T, H, D, dtype=f8, device=dev)
    do_sf = torch.empty(H, slots, SF_CHUNK_BYTES, dtype=u8, device=dev)
    dot_sf = torch.empty(H, slots, SF_CHUNK_BYTES, dtype=u8, device=dev)
    delta = torch.empty(H, T, dtype=torch.float32, device=dev)
    if T and num_docs:
        launch = compile_launcher(SOURCE_FILES, config, target_arch(),
                                  lambda c, a, t: compile_quantize_do_mx(c, a, tvm_ffi=t), ARG_KINDS, None)
        launch_on_device(launch, dev, dout.data_ptr(), out.data_ptr(), cu.data_ptr(), tiles.data_ptr(),
                         do8.data_ptr(), do_sf.data_ptr(), dot8.data_ptr(), dot_sf.data_ptr(), delta.data_ptr(),
                         T, slots, H, num_docs)
    return MxDoOperands(do8, do_sf, dot8, dot_sf, delta)
