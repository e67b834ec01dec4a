"""Fused MXFP8 quantization of Q, K and V for the Blackwell forward, in the CuTe DSL.

One launch writes everything the forward (sm100/attention_fwd.py) reads, bit-exactly as the torch specification
`quant.mx_layout.pack_mx_forward_operands`: the e4m3 codes of Q, K and V, token-major, and their E8M0 scale
chunks (Q per token, K and V per 32x32 document-local tile; V's chunk in the P V orientation). It uses no
tensor core and no Blackwell-only instruction, so it compiles for sm_100a and sm_103a (its targets) and for
sm_90a, where its GPU tests run on the H200 against the specification.

Grid (slots, H + 2 Hk): CTA (s, y) quantizes the 128-token tile in chunk slot s (quant.mx_layout:
document b's tiles from slot sum ceil(len / 128) over b' < b, found by a binary search of the
prefix sums) of Q's head y, K's head y - H or V's head y - H - Hk; slots past the last tile leave
at once. Warp w owns the tile's w-th 32-token block, 4 tokens per step: lane l takes token
4 i + l // 8 and head dims 16 (l % 8) .. + 15, so each step's loads and stores cover whole rows
(two 16-byte loads and one 16-byte store of codes per lane). A token's amax per 32-dim block is
two lanes' (one shuffle); K's and V's 32 x 32 block amax adds the warp's 8 steps and 4 token lanes
(two shuffles). Rows past the document end write nothing but Q's and K's chunk word (1.0); V's
chunk (rows = head dims) takes the 16 block scales of the tile through shared memory.
"""

from __future__ import annotations

import dataclasses
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
from ..quant.mx_layout import MX_BLOCK, MX_TILE, SF_CHUNK_BYTES, SF_UNUSED, MxForwardOperands, sf_slots, sf_tile_starts
from ..sm90.primitives import (
    ARG_BF16,
    ARG_F8,
    ARG_I32,
    SHARED_SOURCE_FILES,
    as_f32,
    cvt_e4m3x4,
    f32_bits,
    ptx,
    st_global_v4,
)
from ..softmax import fmax_chains
from ..tile_scheduler import doc_chunk_cumsum, last_doc_at_or_before
from ..validation import check_kernel_tensors, int32_cu_seqlens

SOURCE_FILES = (Path(__file__).resolve(), Path(_mx_layout.__file__).resolve(),
                *(Path(m.__file__).resolve() for m in (_softmax, _tile_scheduler)), *SHARED_SOURCE_FILES)
E4M3_EMAX = 8
ABS_MASK = 0x7FFF7FFF  # both bf16 halves of a word without their sign bits
UNUSED_WORD = SF_UNUSED * 0x01010101  # four E8M0 bytes of 1.0
LANES_PER_ROW = 8  # lanes per token row (16 head dims each)
STEPS = 32 // (32 // LANES_PER_ROW)  # steps of 4 tokens per warp: its 32-token block
MIN_CTAS_PER_SM = 4  # ptxas register cap 128: 16 warps per SM to hide the loads (168 registers unforced)
MAX_SCAN_DOCS = 1024  # the in-kernel document table: 4 KB of shared memory
SCAN_BARRIER = 1  # the scan's named barrier (the CTA's barrier() is 0)


@dataclass(frozen=True)
class MxQuantizeConfig:
    """Compile-time shape: head dim 128 (one scale chunk = 4 blocks of 32 along D). scan_documents:
    each CTA sums the documents' tiles from cu_seqlens itself (a shared-memory table, at most
    MAX_SCAN_DOCS documents); False: it reads the host's prefix sums (sf_tile_starts)."""

    head_dim: int = 128
    scan_documents: bool = True

    def __post_init__(self):
        if self.head_dim != 128:
            raise ValueError(f"MxQuantizeConfig.head_dim must be 128, got {self.head_dim}")
        if not isinstance(self.scan_documents, bool):
            raise ValueError(f"MxQuantizeConfig.scan_documents must be a bool, got {self.scan_documents!r}")


def smem_bytes(config: MxQuantizeConfig) -> int:
    """The 16 block scales of a V tile exchanged between the warps, and the document table."""
    table = 4 * (MAX_SCAN_DOCS + 1) + 64 if config.scan_documents else 0
    return 64 + table


def st_global_u32(addr, value):
    ptx("st.global.b32 [$0], $1;", "l,r,~{memory}", [Int64(addr), Uint32(value)], result=None, side_effects=True)


@cute.jit
def e8m0_biased(amax):
    """quant.microscaling.e8m0_scale of amax >= 0 as a biased E8M0 exponent: 2^(floor(log2 amax) - 8),
    at least 2^-126 (1); 127 (1.0) for amax 0."""
    b = cutlass.max(((f32_bits(amax) >> 23) & 0xFF) - E4M3_EMAX, Int32(1))
    return cutlass.select_(amax == Float32(0.0), Int32(SF_UNUSED), b)


@cute.jit
def tile_slot(slot, tiles, mCu, num_docs):
    """(document start, length, first document-relative token) of chunk slot `slot` (< tiles[num_docs])."""
    doc = last_doc_at_or_before(slot, lambda i: tiles[i], num_docs, 1)  # the tile's document
    start = mCu[doc]
    return start, mCu[doc + 1] - start, (slot - tiles[doc]) * MX_TILE


@cute.jit
def document_tiles(smem, scan: cutlass.Constexpr, mTiles, mCu, num_docs, tidx):
    """The documents' first tile slots: the host's prefix sums (mTiles), or with scan every CTA's own table
    from cu_seqlens in shared memory (no host table; up to MAX_SCAN_DOCS documents)."""
    tiles = mTiles
    if cutlass.const_expr(scan):
        tiles = smem.allocate_tensor(Int32, cute.make_layout(MAX_SCAN_DOCS + 1), 16)
        sWarp = smem.allocate_tensor(Int32, cute.make_layout((MX_TILE // 32, 2)), 16)
        doc_chunk_cumsum(mCu, num_docs, tiles, None, sWarp, tidx, MX_TILE, SCAN_BARRIER, MX_TILE)
        cute.arch.barrier()
    return tiles


def document_tables(cu_seqlens: torch.Tensor, T: int, dev, config):
    """A launch's document tables: (int32 cu_seqlens, documents, scale-chunk slots, the config (its table
    scan off past MAX_SCAN_DOCS documents), the tile-start pointer the kernel reads)."""
    cu = int32_cu_seqlens(cu_seqlens, dev)
    num_docs = cu.numel() - 1
    if num_docs > MAX_SCAN_DOCS:  # too many for the kernel's table: the host's prefix sums
        config = dataclasses.replace(config, scan_documents=False)
    tiles = cu if config.scan_documents else sf_tile_starts(cu)  # cu: an unused pointer
    return cu, num_docs, sf_slots(T, num_docs), config, tiles


def bf16_rows(ptr, heads, T, words):
    """(word, head, token) view of a bf16 (T, heads, D) tensor as u32 words; a row starts 256-byte
    aligned, so a lane's loads can be 16 bytes wide."""
    return cute.make_tensor(cute.recast_ptr(ptr, dtype=Uint32),
                            cute.make_layout((words, heads, T), stride=(1, words, cute.assume(heads * words,
                                                                                            divby=words))))


@cute.jit
def load_row_words(mX, head, start, pos, length, dc, lw: cutlass.Constexpr, dst):
    """The lane's lw words (16 head dims) of token `pos` into dst; zeros past the document end."""
    for w in cutlass.range_constexpr(lw):
        dst[w] = Uint32(0)
    if pos < length:
        # a static-stride slice keeps the 16-byte alignment
        row = cute.logical_divide(mX[None, head, start + pos], cute.make_layout(lw))
        cute.autovec_copy(row[None, dc], dst)


def bf16_lo(word):
    return as_f32(Int32(word) << 16)


def bf16_hi(word):
    return as_f32(Int32(word) & Int32(-65536))


class MxQuantizeSm100:
    def __init__(self, config: MxQuantizeConfig):
        self.cfg = config
        self.D = config.head_dim
        self.nkb = self.D // MX_BLOCK

    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer, k_ptr: cute.Pointer, v_ptr: cute.Pointer, cu_ptr: cute.Pointer, tiles_ptr: cute.Pointer,
        q8_ptr: cute.Pointer, qsf_ptr: cute.Pointer, k8_ptr: cute.Pointer, ksf_ptr: cute.Pointer,
        v8_ptr: cute.Pointer, vsf_ptr: cute.Pointer,
        T: Int32, slots: Int32, num_heads: Int32, num_kv_heads: Int32, num_docs: Int32,
        stream: cuda.CUstream,
    ):
        words = self.D // 2  # a row of bf16 as u32 words
        mCu = cute.make_tensor(cu_ptr, cute.make_layout(num_docs + 1))
        mTiles = cute.make_tensor(tiles_ptr, cute.make_layout(num_docs + 1))
        self.kernel(
            bf16_rows(q_ptr, num_heads, T, words), bf16_rows(k_ptr, num_kv_heads, T, words),
            bf16_rows(v_ptr, num_kv_heads, T, words), mCu, mTiles,
            q8_ptr, qsf_ptr, k8_ptr, ksf_ptr, v8_ptr, vsf_ptr, slots, num_heads, num_kv_heads, num_docs,
        ).launch(grid=[slots, num_heads + 2 * num_kv_heads, 1], block=[MX_TILE, 1, 1], stream=stream,
                 min_blocks_per_mp=MIN_CTAS_PER_SM, preferred_smem_carveout=100)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mCu: cute.Tensor, mTiles: cute.Tensor,
               q8_ptr: cute.Pointer, qsf_ptr: cute.Pointer, k8_ptr: cute.Pointer, ksf_ptr: cute.Pointer,
               v8_ptr: cute.Pointer, vsf_ptr: cute.Pointer, slots: Int32, num_heads: Int32, num_kv_heads: Int32,
               num_docs: Int32):
        slot, y, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()  # one allocator for the kernel: its tensors do not overlap
        sScale = smem.allocate_tensor(Int32, cute.make_layout((self.nkb, self.nkb)), 16)
        tiles = document_tiles(smem, self.cfg.scan_documents, mTiles, mCu, num_docs, tidx)
        if slot < tiles[num_docs]:
            start, length, tile_col = tile_slot(slot, tiles, mCu, num_docs)
            if y < num_heads:
                self.quantize_tile(False, mQ, y, start, length, tile_col, slot, tidx, q8_ptr.toint(), qsf_ptr.toint(),
                                   num_heads, slots, sScale, True, False)
            else:
                # K and V: one code path (three spill at ptxas's 128 registers), V's chunk under a flag
                is_v = y >= num_heads + num_kv_heads
                x = cute.make_tensor(cute.make_ptr(Uint32, cutlass.select_(is_v, mV.iterator.toint(),
                                                                           mK.iterator.toint()),
                                                   cute.AddressSpace.gmem, assumed_align=16), mK.layout)
                self.quantize_tile(True, x, y - num_heads - cutlass.select_(is_v, num_kv_heads, 0), start, length,
                                   tile_col, slot, tidx, cutlass.select_(is_v, v8_ptr.toint(), k8_ptr.toint()),
                                   cutlass.select_(is_v, vsf_ptr.toint(), ksf_ptr.toint()), num_kv_heads, slots,
                                   sScale, y < num_heads + num_kv_heads, is_v)

    @cute.jit
    def quantize_tile(self, tile_2d: cutlass.Constexpr, mX, head, start, length, tile_col, slot, tidx, codes_addr,
                      sf_addr, heads, slots, sScale, token_rows, dim_rows):
        """Warp w: the tile's 32-token block w, 4 tokens per step: lane l takes token 4 i + l // 8 of the
        block and head dims 16 (l % 8) .. + 15, so every load and store of a step covers whole rows.
        token_rows (Q, K): the token-row chunk; dim_rows (V, with tile_2d): the dim-row chunk, its scales
        exchanged through sScale."""
        D, nkb = self.D, self.nkb
        lane, warp = tidx % 32, tidx // 32
        tq, dc = lane // LANES_PER_ROW, lane % LANES_PER_ROW
        lw = D // LANES_PER_ROW // 2  # bf16 words per lane and token: 8 (two 16-byte loads)
        raw = cute.make_rmem_tensor(cute.make_layout((lw, STEPS)), Uint32)
        amax = []
        for i in cutlass.range_constexpr(STEPS):
            load_row_words(mX, head, start, tile_col + 32 * warp + 4 * i + tq, length, dc, lw, raw[None, i])
            # |x| max of the lane's 16 values on the bf16 bits (ordered as the magnitudes), in fp32,
            # then with the other lane of the 32-dim block
            a = fmax_chains([bf16_lo(raw[w, i] & ABS_MASK) for w in range(lw)]
                            + [bf16_hi(raw[w, i] & ABS_MASK) for w in range(lw)])
            amax.append(cute.arch.fmax(a, cute.arch.shuffle_sync_bfly(a, offset=1)))
        if cutlass.const_expr(tile_2d):
            # K, V: one scale per 32 x 32 block: the warp's 32 tokens (8 steps, lanes 8 and 16 apart)
            m = fmax_chains(amax)
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=8))
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=16))
            amax = [m] * STEPS
        chunk = Int64(sf_addr) + (Int64(head) * Int64(slots) + Int64(slot)) * SF_CHUNK_BYTES
        biased = Int32(0)
        for i in cutlass.range_constexpr(STEPS):
            n = 32 * warp + 4 * i + tq  # the token's row of the tile
            pos = tile_col + n
            valid = pos < length
            biased = e8m0_biased(amax[i])
            inv = as_f32((254 - biased) << 23)
            codes = []
            for w in cutlass.range_constexpr(lw // 2):
                w0, w1 = raw[2 * w, i], raw[2 * w + 1, i]
                codes.append(cvt_e4m3x4(bf16_lo(w0) * inv, bf16_hi(w0) * inv, bf16_lo(w1) * inv, bf16_hi(w1) * inv))
            # the token's four block scales: block k's is at lane 8 tq + 2 k (every lane shuffles)
            sf_word = Int32(0)
            for k in cutlass.range_constexpr(nkb):
                sf_word = sf_word | (Int32(cute.arch.shuffle_sync(biased, lane - dc + 2 * k)) << (8 * k))
            if valid:
                st_global_v4(Int64(codes_addr) + (Int64(start + pos) * Int64(heads) + Int64(head)) * D + 16 * dc,
                             codes)
            if (dc == 0) & token_rows:  # row n's chunk word (quant.mx_layout.sf_byte_offset(n, 0)); past the end: 1.0
                st_global_u32(chunk + 4 * ((n % 32) * 4 + n // 32),
                              cutlass.select_(valid, Uint32(sf_word), Uint32(UNUSED_WORD)))
        if dim_rows:
            # the warp's key block: its scale of dim block k is lane 2 k's (1.0 if the block starts past
            # the document end)
            if (lane % 2 == 0) & (lane < 2 * nkb):
                sScale[warp, lane // 2] = cutlass.select_(tile_col + 32 * warp < length, biased, Int32(SF_UNUSED))
            cute.arch.barrier()
            # V's P V chunk: row d = tidx, block kb = the tile's kb-th 32-key block, its scale of d // 32
            v_word = Int32(0)
            for kb in cutlass.range_constexpr(nkb):
                v_word = v_word | (sScale[kb, tidx // 32] << (8 * kb))
            st_global_u32(chunk + 4 * ((tidx % 32) * 4 + tidx // 32), Uint32(v_word))


ARG_KINDS = (
    ARG_BF16, ARG_BF16, ARG_BF16, ARG_I32, ARG_I32,  # q, k, v, cu_seqlens, tile starts
    ARG_F8, ARG_I32, ARG_F8, ARG_I32, ARG_F8, ARG_I32,  # q8, q_sf, k8, k_sf, v8, v_sf
    ("i32",), ("i32",), ("i32",), ("i32",), ("i32",),  # T, slots, H, Hk, num_docs
    ("stream",),
)


def compile_quantize_mx(config: MxQuantizeConfig, arch: str = "sm_100a", extra_options: str = "",
                        tvm_ffi: bool = False):
    """cute.compile the quantization for `arch` (sm_100a, sm_103a, or sm_90a) from plain values only."""
    return compile_entry(MxQuantizeSm100(config), ARG_KINDS, arch, extra_options, tvm_ffi)


def kernel_artifacts(config: MxQuantizeConfig, arch: str = "sm_100a"):
    from ..compile_cache import compile_artifacts

    return compile_artifacts(compile_quantize_mx, config, arch)


def quantize_mx_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                        config: MxQuantizeConfig | None = None) -> MxForwardOperands:
    """The sm_100a forward's operands of bf16 (T, H, 128) q and (T, Hk, 128) k, v on the current stream
    (one launch; past MAX_SCAN_DOCS documents also the host's prefix sums, on the device: no host sync).
    Bit-exactly pack_mx_forward_operands(q, k, v, cu_seqlens). k_diag and v_diag are k and v."""
    from ..compile_cache import compile_launcher, target_arch

    T, H, D = q.shape
    config = config or MxQuantizeConfig(head_dim=D)
    if D != config.head_dim:
        raise ValueError(f"q: head_dim {D} does not match {config}")
    Hk = k.shape[1] if k.dim() == 3 else 0
    if Hk == 0 or H % Hk:
        raise ValueError(f"k must be (T, Hk, D) with q's heads {H} a multiple of Hk, got {tuple(k.shape)}")
    dev = q.device
    bf = torch.bfloat16
    check_kernel_tensors([("q", q, (T, H, D), bf), ("k", k, (T, Hk, D), bf), ("v", v, (T, Hk, D), bf)], dev)
    cu, num_docs, slots, config, tiles = document_tables(cu_seqlens, T, dev, config)
    f8, u8 = torch.float8_e4m3fn, torch.uint8
    q8 = torch.empty(T, H, D, dtype=f8, device=dev)
    k8 = torch.empty(T, Hk, D, dtype=f8, device=dev)
    v8 = torch.empty(T, Hk, D, dtype=f8, device=dev)
    q_sf = torch.empty(H, slots, SF_CHUNK_BYTES, dtype=u8, device=dev)
    k_sf = torch.empty(Hk, slots, SF_CHUNK_BYTES, dtype=u8, device=dev)
    v_sf = torch.empty(Hk, slots, SF_CHUNK_BYTES, dtype=u8, device=dev)
    if T and num_docs:
        launch = compile_launcher(SOURCE_FILES, config, target_arch(),
                                  lambda c, a, t: compile_quantize_mx(c, a, tvm_ffi=t), ARG_KINDS, None)
        launch_on_device(launch, dev, q.data_ptr(), k.data_ptr(), v.data_ptr(), cu.data_ptr(), tiles.data_ptr(),
                         q8.data_ptr(), q_sf.data_ptr(), k8.data_ptr(), k_sf.data_ptr(), v8.data_ptr(),
                         v_sf.data_ptr(), T, slots, H, Hk, num_docs)
    return MxForwardOperands(q8, q_sf, k8, k_sf, v8, v_sf, k, v)
