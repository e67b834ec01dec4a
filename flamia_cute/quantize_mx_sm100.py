"""Fused MXFP8 quantization of Q, K and V for the Blackwell forward, in the CuTe DSL.

One launch writes everything `attention_fwd_sm100` reads, bit-exactly as the torch specification
`quant.mx_layout.pack_mx_forward_operands`: the e4m3 codes of Q, K and V^T, their E8M0 scale chunks
(Q per token, K and V per 32x32 document-local tile; V's chunk in the P V orientation) and Q's MX
values in bf16 (the diagonal safeguard's operand). It uses no tensor core and no Blackwell-only
instruction, so it compiles for sm_100a (its product target) and for sm_90a, where its GPU tests run
on the H200 against the specification.

Grid (slots, H + 2 Hk): CTA (s, y) quantizes the 128-token tile in chunk slot s (quant.mx_layout:
document b's tiles from slot sum ceil(len / 128) over b' < b) of Q's head y, K's head y - H or V's
head y - H - Hk; slots past the last tile leave at once. Thread t owns the tile's token row t: 16
loads of 16 bytes, an amax per 32-dim block (for K and V then a warp max: warp w's 32 rows are the
tile's w-th 32-token block, and rows past the document end count as 0), the codes with the
block's 1 / scale (a power of two: exact), one scale word of the chunk. V's codes are transposed
in shared memory and written as 16-byte pieces of V^T's rows from column dt_start + the tile's
first position; the pad columns of a document's last 32-column group get 0. v_dt's columns after the last document
are zeroed by the host (torch.zeros), as the attention kernel's TMA may read them under P = 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32

from .compile_cache import compile_entry, launch_on_device
from .quant import mx_layout as _mx_layout
from .quant import transposed_tokens
from .quant.mx_layout import MX_BLOCK, MX_TILE, SF_CHUNK_BYTES, SF_UNUSED, MxForwardOperands, sf_slots, sf_tile_starts
from .quant.quantize import dt_cu_seqlens
from .sm90_device import (
    ARG_BF16,
    ARG_F8,
    ARG_I32,
    SHARED_SOURCE_FILES,
    as_f32,
    cvt_e4m3x4,
    e4m3x2_to_bf16x2,
    f32_bits,
    fmax_chains,
    ptx,
    st_global_v4,
)
from .validation import check_kernel_tensors

SOURCE_FILES = (Path(__file__).resolve(), Path(_mx_layout.__file__).resolve(), *SHARED_SOURCE_FILES)
E4M3_EMAX = 8
ABS_MASK = 0x7FFF7FFF  # both bf16 halves of a word without their sign bits
UNUSED_WORD = SF_UNUSED * 0x01010101  # four E8M0 bytes of 1.0
TRANSPOSE_ROW_WORDS = 36  # V^T staging rows: 128 bytes + 16 of padding


@dataclass(frozen=True)
class MxQuantizeConfig:
    """Compile-time shape: head dim 128 (one scale chunk = 4 blocks of 32 along D)."""

    head_dim: int = 128

    def __post_init__(self):
        if self.head_dim != 128:
            raise ValueError(f"MxQuantizeConfig.head_dim must be 128, got {self.head_dim}")


def smem_bytes(config: MxQuantizeConfig) -> int:
    """V's 16 block scales exchanged between the warps, and its V^T staging tile."""
    return 64 + 4 * TRANSPOSE_ROW_WORDS * config.head_dim


def st_global_u8(addr, value):
    ptx("st.global.u8 [$0], $1;", "l,r,~{memory}", [Int64(addr), Uint32(value)], result=None, side_effects=True)


def st_global_u32(addr, value):
    ptx("st.global.b32 [$0], $1;", "l,r,~{memory}", [Int64(addr), Uint32(value)], result=None, side_effects=True)


class MxQuantizeSm100:
    def __init__(self, config: MxQuantizeConfig):
        self.cfg = config
        self.D = config.head_dim
        self.nkb = self.D // MX_BLOCK

    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer, k_ptr: cute.Pointer, v_ptr: cute.Pointer,
        cu_ptr: cute.Pointer, tiles_ptr: cute.Pointer, dt_ptr: cute.Pointer,
        q8_ptr: cute.Pointer, qsf_ptr: cute.Pointer, k8_ptr: cute.Pointer, ksf_ptr: cute.Pointer,
        vdt_ptr: cute.Pointer, vsf_ptr: cute.Pointer, qd_ptr: cute.Pointer,
        T: Int32, T_dt: Int32, slots: Int32, num_heads: Int32, num_kv_heads: Int32, num_docs: Int32,
        stream: cuda.CUstream,
    ):
        words = self.D // 2  # a row of bf16 as u32 words
        mCu = cute.make_tensor(cu_ptr, cute.make_layout(num_docs + 1))
        mTiles = cute.make_tensor(tiles_ptr, cute.make_layout(num_docs + 1))
        mDt = cute.make_tensor(dt_ptr, cute.make_layout(num_docs + 1))

        def rows(ptr, heads):  # (word, head, token) views of a bf16 (T, heads, D) tensor
            # a row starts 256-byte aligned: the loads can be 16 bytes wide
            return cute.make_tensor(cute.recast_ptr(ptr, dtype=Uint32),
                                    cute.make_layout((words, heads, T), stride=(1, words, cute.assume(heads * words,
                                                                                                    divby=words))))

        self.kernel(
            rows(q_ptr, num_heads), rows(k_ptr, num_kv_heads), rows(v_ptr, num_kv_heads), mCu, mTiles, mDt,
            q8_ptr, qsf_ptr, k8_ptr, ksf_ptr, vdt_ptr, vsf_ptr, qd_ptr, T_dt, slots, num_heads, num_kv_heads,
            num_docs,
        ).launch(grid=[slots, num_heads + 2 * num_kv_heads, 1], block=[MX_TILE, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mCu: cute.Tensor, mTiles: cute.Tensor,
               mDt: cute.Tensor, q8_ptr: cute.Pointer, qsf_ptr: cute.Pointer, k8_ptr: cute.Pointer,
               ksf_ptr: cute.Pointer, vdt_ptr: cute.Pointer, vsf_ptr: cute.Pointer, qd_ptr: cute.Pointer,
               T_dt: Int32, slots: Int32, num_heads: Int32, num_kv_heads: Int32, num_docs: Int32):
        slot, y, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        if slot < mTiles[num_docs]:
            # the tile's document: the last b with tiles[b] <= slot (empty documents share a start)
            lo = Int32(0)
            hi = num_docs - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if mTiles[mid] <= slot:
                    lo = mid
                else:
                    hi = mid - 1
            doc = lo
            start = mCu[doc]
            length = mCu[doc + 1] - start
            pos = (slot - mTiles[doc]) * MX_TILE + tidx
            if y < num_heads:
                self.quantize_rows(False, mQ, y, start, length, pos, slot, tidx, q8_ptr, qsf_ptr, qd_ptr,
                                   num_heads, slots, None)
            elif y < num_heads + num_kv_heads:
                self.quantize_rows(True, mK, y - num_heads, start, length, pos, slot, tidx, k8_ptr, ksf_ptr, None,
                                   num_kv_heads, slots, None)
            else:
                self.quantize_rows(True, mV, y - num_heads - num_kv_heads, start, length, pos, slot, tidx, vdt_ptr,
                                   vsf_ptr, None, num_kv_heads, slots, (mDt[doc], T_dt))

    @cute.jit
    def quantize_rows(self, tile_2d: cutlass.Constexpr, mX, head, start, length, pos, slot, tidx, codes_ptr, sf_ptr,
                      qd_ptr, heads, slots, v_columns):
        """Thread tidx's token row: codes and its word of the chunk (Q, K), or V's column of V^T and,
        with the warps' block scales shared, head dim tidx's word of V's P V chunk."""
        D, nkb = self.D, self.nkb
        words = D // 2
        valid = pos < length
        raw = cute.make_rmem_tensor(cute.make_layout(words), Uint32)
        for w in cutlass.range_constexpr(words):
            raw[w] = Uint32(0)
        if valid:
            cute.autovec_copy(mX[None, head, start + pos], raw)
        biased = [Int32(0)] * nkb
        inv = [None] * nkb
        for c in cutlass.range_constexpr(nkb):
            # |x| max of the block on the bf16 bits (ordered as the magnitudes), in fp32
            amax = fmax_chains([as_f32(Int32(raw[16 * c + w] & ABS_MASK) << 16) for w in range(16)]
                               + [as_f32(Int32(raw[16 * c + w] & ABS_MASK) & Int32(-65536)) for w in range(16)])
            if cutlass.const_expr(tile_2d):
                for sh in cutlass.range_constexpr(5):  # the warp's 32 rows: one 32-token block
                    amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << sh))
            # quant.microscaling.e8m0_scale: 2^(floor(log2 amax) - 8), at least 2^-126; 1.0 for amax 0
            b = cutlass.max(((f32_bits(amax) >> 23) & 0xFF) - E4M3_EMAX, Int32(1))
            biased[c] = cutlass.select_(amax == Float32(0.0), Int32(SF_UNUSED), b)
            inv[c] = as_f32((254 - biased[c]) << 23)
        codes = cute.make_rmem_tensor(cute.make_layout(D // 4), Uint32)
        for c in cutlass.range_constexpr(nkb):
            for w in cutlass.range_constexpr(MX_BLOCK // 4):
                w0, w1 = raw[16 * c + 2 * w], raw[16 * c + 2 * w + 1]
                xs = [as_f32(Int32(w0) << 16), as_f32(Int32(w0) & Int32(-65536)),
                      as_f32(Int32(w1) << 16), as_f32(Int32(w1) & Int32(-65536))]
                codes[(MX_BLOCK // 4) * c + w] = cvt_e4m3x4(*(x * inv[c] for x in xs))
        sf_word = Int32(0)
        for c in cutlass.range_constexpr(nkb):
            sf_word = sf_word | (biased[c] << (8 * c))
        chunk = Int64(sf_ptr.toint()) + (Int64(head) * Int64(slots) + Int64(slot)) * SF_CHUNK_BYTES
        word_addr = chunk + 4 * ((tidx % 32) * 4 + tidx // 32)  # quant.mx_layout.sf_byte_offset(tidx, 0)
        if cutlass.const_expr(v_columns is None):
            # Q, K: the token's codes; its chunk word (rows past the document: 1.0)
            if valid:
                row = Int64(codes_ptr.toint()) + (Int64(start + pos) * Int64(heads) + Int64(head)) * D
                for g in cutlass.range_constexpr(D // 16):
                    st_global_v4(row + 16 * g, [codes[4 * g + i] for i in range(4)])
            st_global_u32(word_addr, cutlass.select_(valid, Uint32(sf_word), Uint32(UNUSED_WORD)))
            if cutlass.const_expr(qd_ptr is not None):
                if valid:
                    # Q's MX value in bf16 (exact), the diagonal safeguard's S operand
                    row_d = Int64(qd_ptr.toint()) + (Int64(start + pos) * Int64(heads) + Int64(head)) * (2 * D)
                    for g in cutlass.range_constexpr(D // 8):
                        c = g // 4
                        s = as_f32(biased[c] << 23)
                        out = [e4m3x2_to_bf16x2(codes[2 * g + i // 2], i % 2 == 1, s) for i in range(4)]
                        st_global_v4(row_d + 16 * g, out)
        else:
            dt_start, T_dt = v_columns
            # V^T through shared memory: byte (token, d) stored at row d (rows 144 bytes apart, so the
            # 16-byte row reads below spread over the banks), then thread d writes its row's 128 columns
            # as 16-byte stores; tokens past the document end are 0 (the pad of its last 32 columns)
            smem = cutlass.memory.SmemAllocator()  # one allocator: its tensors do not overlap
            sScale = smem.allocate_tensor(Int32, cute.make_layout((nkb, nkb)), 16)
            sT = smem.allocate_tensor(Uint32, cute.make_layout((D // 4, D), stride=(1, TRANSPOSE_ROW_WORDS)), 16)
            sT8 = cute.make_tensor(cute.recast_ptr(sT.iterator, dtype=cutlass.Uint8),
                                   cute.make_layout((MX_TILE, D), stride=(1, 4 * TRANSPOSE_ROW_WORDS)))
            for w in cutlass.range_constexpr(D // 4):
                word = cutlass.select_(valid, codes[w], Uint32(0))
                for i in cutlass.range_constexpr(4):
                    sT8[tidx, 4 * w + i] = cutlass.Uint8((word >> (8 * i)) & 0xFF)
            cute.arch.barrier()
            row = cute.make_rmem_tensor(cute.make_layout(D // 4), Uint32)
            cute.autovec_copy(sT[None, tidx], row)
            tile_col = pos - tidx  # the tile's first token, document-relative
            group_end = ((length + MX_BLOCK - 1) // MX_BLOCK) * MX_BLOCK - tile_col  # the document's last column + pad
            base = Int64(codes_ptr.toint()) + Int64(head) * Int64(D) * Int64(T_dt) + Int64(tidx) * Int64(T_dt) \
                + Int64(dt_start + tile_col)
            for g in cutlass.range_constexpr(MX_TILE // 16):
                if 16 * g < group_end:  # 16 | 32: a group lies wholly inside or outside
                    st_global_v4(base + 16 * g, [row[4 * g + i] for i in range(4)])
            # the P V chunk: row d = tidx, block kb = the tile's kb-th 32-key block: its scale of dim block d // 32
            warp = tidx // 32
            block_used = pos - tidx % 32 < length  # the warp's key block starts inside the document
            if tidx % 32 == 0:
                for c in cutlass.range_constexpr(nkb):
                    sScale[warp, c] = cutlass.select_(block_used, biased[c], Int32(SF_UNUSED))
            cute.arch.barrier()
            v_word = Int32(0)
            for kb in cutlass.range_constexpr(nkb):
                v_word = v_word | (sScale[kb, tidx // 32] << (8 * kb))
            st_global_u32(word_addr, Uint32(v_word))


ARG_KINDS = (
    ARG_BF16, ARG_BF16, ARG_BF16, ARG_I32, ARG_I32, ARG_I32,  # q, k, v, cu_seqlens, tile starts, dt starts
    ARG_F8, ARG_I32, ARG_F8, ARG_I32, ARG_F8, ARG_I32, ARG_BF16,  # q8, q_sf, k8, k_sf, v_dt, v_sf, q_diag
    ("i32",), ("i32",), ("i32",), ("i32",), ("i32",), ("i32",),  # T, T_dt, slots, H, Hk, num_docs
    ("stream",),
)


def compile_quantize_mx(config: MxQuantizeConfig, arch: str = "sm_100a", extra_options: str = "",
                        tvm_ffi: bool = False):
    """cute.compile the quantization for `arch` (sm_100a, or sm_90a) from plain values only."""
    return compile_entry(MxQuantizeSm100(config), ARG_KINDS, arch, extra_options, tvm_ffi)


def kernel_artifacts(config: MxQuantizeConfig, arch: str = "sm_100a"):
    from .compile_cache import compile_artifacts

    return compile_artifacts(compile_quantize_mx, config, arch)


def quantize_mx_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                        config: MxQuantizeConfig | None = None) -> MxForwardOperands:
    """The sm_100a forward's operands of bf16 (T, H, 128) q and (T, Hk, 128) k, v on the current stream
    (one launch, plus the tile and column prefix sums of cu_seqlens on the device: no host sync).
    Bit-exactly pack_mx_forward_operands(q, k, v, cu_seqlens). k_diag and v_diag are k and v."""
    from .compile_cache import compile_launcher, target_arch

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
    cu = cu_seqlens.to(device=dev, dtype=torch.int32).contiguous()
    num_docs = cu.numel() - 1
    T_dt, slots = transposed_tokens(T, num_docs), sf_slots(T, num_docs)
    tiles = sf_tile_starts(cu).to(torch.int32)
    dt = dt_cu_seqlens(cu)
    f8, u8 = torch.float8_e4m3fn, torch.uint8
    q8 = torch.empty(T, H, D, dtype=f8, device=dev)
    k8 = torch.empty(T, Hk, D, dtype=f8, device=dev)
    v_dt = torch.zeros(Hk, D, T_dt, dtype=f8, device=dev)
    q_sf = torch.empty(H, slots, SF_CHUNK_BYTES, dtype=u8, device=dev)
    k_sf = torch.empty(Hk, slots, SF_CHUNK_BYTES, dtype=u8, device=dev)
    v_sf = torch.empty(Hk, slots, SF_CHUNK_BYTES, dtype=u8, device=dev)
    q_diag = torch.empty(T, H, D, dtype=bf, device=dev)
    if T and num_docs:
        launch = compile_launcher(SOURCE_FILES, config, target_arch(),
                                  lambda c, a, t: compile_quantize_mx(c, a, tvm_ffi=t), ARG_KINDS, None)
        launch_on_device(launch, dev, q.data_ptr(), k.data_ptr(), v.data_ptr(), cu.data_ptr(), tiles.data_ptr(),
                         dt.data_ptr(), q8.data_ptr(), q_sf.data_ptr(), k8.data_ptr(), k_sf.data_ptr(),
                         v_dt.data_ptr(), v_sf.data_ptr(), q_diag.data_ptr(), T, T_dt, slots, H, Hk, num_docs)
    return MxForwardOperands(q8, q_sf, k8, k_sf, v_dt, v_sf, q_diag, k, v)
