"""FP8 causal attention backward for Hopper (sm_90a) over packed documents, in the CuTe DSL.

Numerics: the spec is `flamia_cute.emulator.emulate_backward` (with `_fold_cast`, `_cast_ds`)
for recipes fp8_token and fp8_tokenblock, from the forward's saved e4m3 operands, O and LSE.

Organization (one CTA per (128-key block n, kv head, document); GQA query heads of the kv head
are looped inside the CTA, so dK and dV are summed over the group in the CTA: deterministic):
- warp 0 of the producer warpgroup issues TMA loads: the key side once (K [t,d] and V [t,d] as
  two 64-row A slabs, K^T [d,t] for dQ), first from the per-token copies for the diagonal tiles
  when `diagonal_copy`, then (after the consumers release them) from the block-scaled copies;
  per query tile, Q and dO [t,d] (B operands of S^T and dP^T: pipeline a) and Q^T and dO^T
  [d,t] (B operands of dK and dV: pipeline b);
- warp 1 of the producer warpgroup writes the per-query vectors of each query tile to shared
  memory: sq*softmax_scale*log2e, lse*log2e (+inf past the document end, so P = 0 there),
  D = rowsum(dO*O), the dO scale (0 past the end), the Q scale, and the suffix max of the dO
  scale (the dV fold's r: max over visible queries of the tile);
- two consumer warpgroups own keys 0-63 / 64-127 of the block (keys are M everywhere):
  S^T = K Q^T and dP^T = V dO^T (wgmma e4m3, fp32), P^T = exp2(S^T*sk*sq*scale*log2e -
  lse*log2e) (masked on the diagonal tile), dS^T = P^T (dP^T*sv*sdo - D);
  dV += r/256 * (e4m3(P^T * sdo * 256/r) . dO^T-codes) with A = P from registers;
  dK += s_k * (e4m3(dS^T * sq / s_k) . Q^T-codes) with s_k the per-key pow2 scale of the
  128-query tile (quad shuffles); dQ: per-query pow2 scale over the 128 keys of the block
  (warp shuffles + shared-memory atomic max across the 8 consumer warps), e4m3(dS * sk / s_q)
  written to shared memory as dS [q, k] (keys contiguous: the K-major A operand), then
  dQ_tile = dS . K^T-codes (wgmma, A from shared memory, B = K^T tile) and red.global.add.f32
  of s_q * softmax_scale * dQ_tile into an fp32 dQ accumulator (T, H, D);
- every tile product goes into a fresh fp32 accumulator that is added into the running sums:
  the fp8 tensor-core accumulation is promoted once per 128 queries (dK, dV) or keys (dQ);
- dV stays in fp32 registers; dK (registers would not fit next to S^T, dP^T and dV) is kept
  in shared memory in the thread's own fragment order (conflict-free, no synchronization);
- epilogue: dK * softmax_scale and dV to bf16 with 16-byte stores (forward's quad transpose).

Tile order inside a CTA: the diagonal tile (m = n) of every query head of the group first,
then every head's off-diagonal tiles m = n+1 .. last. Only the diagonal tile needs masks
(key > query, key past the document end); queries past the document end get P = 0 from
lse = +inf and dO scale 0, and are never stored.

dQ is accumulated with fp32 atomics: not bit-reproducible run to run (the order of the
additions from the key blocks varies); dK and dV are deterministic. `deterministic=True` orders
the dQ additions: a semaphore per (query head, document, query block) counts the key blocks
that have added their tile, and key block n adds only when it reads n (FA3's scheme). The
grid launches key block n - 1 of every head and document before key block n, so the CTA it
waits for is resident or done: no deadlock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import Float8E4M3FN, Float32, Int32, Int64, Uint8, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from . import recipes as _recipes
from .bwd_common_sm90 import backward_grid, backward_grid_blocks, backward_outputs, backward_work_item, preprocess_bwd
from .bwd_device_sm90 import (
    add_dq_tile,
    dq_turn_pass,
    dq_turn_wait,
    load_row_scales,
    store_key_rows_bf16,
    store_query_vectors,
)
from .compile_cache import compile_entry, launch_on_device
from .quant import transposed_tokens
from .recipes import FOLD_REF_MIN
from .sm90_device import (
    ARG_BF16,
    ARG_F8,
    ARG_F32,
    ARG_I32,
    SHARED_SOURCE_FILES,
    as_f32,
    cvt_e4m3x4,
    document_dt_start,
    f32_bits,
    pack_a_fragment_e4m3,
    pow2_scale_bits,
    ptx,
    quad_max,
    tma_pipeline,
    warp_pipeline,
)
from .validation import check_kernel_tensors, int32_cu_seqlens

# recipes.py holds FOLD_REF_MIN: a change there must recompile
SOURCE_FILES = (Path(__file__).resolve(), Path(_recipes.__file__).resolve(),
                Path(__file__).resolve().with_name("bwd_device_sm90.py"), *SHARED_SOURCE_FILES)

LOG2E = math.log2(math.e)
P_SCALE = 256.0  # the recipe's fixed power-of-two P scale
SMEM_LIMIT = 232448  # sm_90 dynamic shared memory per CTA (227 KB)
N_VEC = 6  # per-query vectors per tile in shared memory (see load_vectors)
DQ_AMAX_BATCH = 16  # dQ scale reductions in flight at once per thread (registers: one value each)
DS_LAYOUT = "S<3,4,3> o 0 o ((8,8),(128,1),(1,2)):((128,1024),(1,0),(0,8192))"


@dataclass(frozen=True)
class BwdConfig:
    """Compile-time shape of the backward kernel. T, heads and documents are dynamic."""

    head_dim: int
    qhead_per_kvhead: int = 1
    diagonal_copy: bool = False  # fp8_tokenblock: per-token K/V copies on the diagonal tile
    q_stages: int = 0  # Q/dO tile stages (0: the most that fits: 2 for d64, 1 for d128)
    qt_stages: int = 0  # Q^T/dO^T tile stages (0: as q_stages)
    vec_stages: int = 2
    deterministic: bool = False  # dQ additions in key-block order: bit-reproducible dQ
    # CTA order (backward_grid). "heads" is the GPU-measured default of this kernel; "blocks" made the
    # bf16-dS kernel 1-24% faster (run s7e) and is built and tested here but NOT GPU-RUN YET (session 7)
    raster: str = "heads"

    def __post_init__(self):
        def bad(name, msg):
            raise ValueError(f"BwdConfig.{name}: {msg} (got {getattr(self, name)!r})")

        if self.head_dim not in (64, 128):
            bad("head_dim", "must be 64 or 128")
        if self.qhead_per_kvhead < 1:
            bad("qhead_per_kvhead", "must be >= 1")
        if not isinstance(self.diagonal_copy, bool):
            bad("diagonal_copy", "must be a bool")
        if not isinstance(self.deterministic, bool):
            bad("deterministic", "must be a bool")
        for name in ("q_stages", "qt_stages"):
            if getattr(self, name) not in (0, 1, 2):
                bad(name, "must be 0 (auto), 1 or 2")
        if self.vec_stages not in (1, 2, 3):
            bad("vec_stages", "must be 1, 2 or 3")
        if self.raster not in ("heads", "blocks"):
            bad("raster", "must be 'heads' or 'blocks'")
        if smem_bytes(self) > SMEM_LIMIT:
            bad("q_stages", f"shared memory {smem_bytes(self)} bytes exceeds {SMEM_LIMIT}")

    @property
    def stages_a(self) -> int:
        return self.q_stages or (2 if self.head_dim == 64 else 1)

    @property
    def stages_b(self) -> int:
        return self.qt_stages or self.stages_a


def smem_bytes(cfg: BwdConfig) -> int:
    """Shared memory of one CTA (upper bound: 1 KB alignment per tile buffer)."""
    D = cfg.head_dim
    tile = 128 * D
    data = 3 * tile + 2 * tile * cfg.stages_a + 2 * tile * cfg.stages_b + 128 * 128  # K V Kt, Q dO, Qt dOt, dS
    dk = 128 * D * 4
    vec = N_VEC * 128 * 4 * cfg.vec_stages + 3 * 128 * 4
    bars = 8 * 2 * (1 + cfg.stages_a + cfg.stages_b + cfg.vec_stages)
    return data + dk + vec + bars + 8 * 1024


# ----------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------


def _red_add_f32(addr, x):
    """Fire-and-forget fp32 atomic add to global memory (red.global.add.f32)."""
    ptx("red.global.add.f32 [$0], $1;", "l,f,~{memory}", [Int64(addr), Float32(x)], result=None, side_effects=True)


def _byte(w, i: int):
    return Uint8((Uint32(w) >> (8 * i)) & 0xFF)


def ds_byte_base(qlo, key):
    """Byte offset of dS (query q with q % 64 < 8, i.e. q = qlo, key) in the swizzled A tile."""
    return qlo * 128 + (key ^ (qlo << 4))


def ds_byte_offset(w: int) -> int:
    """Extra offset of query column q = 8 w + qlo (qlo < 8): slab w // 8, row block w % 8 (swizzle-free)."""
    return (w // 8) * 8192 + (w % 8) * 1024


def tile_schedule(i, n, group, per):
    """Tile i of a CTA (key block n): (query-head index in the group, query block m, diagonal?).

    Tiles 0..group-1: the diagonal tile m = n of each head; then head j's off-diagonal tiles
    m = n+1 .. n+per (per = query blocks after the diagonal). Plain integer math: the CPU model
    runs the same function.
    """
    if i < group:
        return i, n, True
    j = i - group
    return j // per, n + 1 + j % per, False


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


class FlamiaBwdSm90:
    def __init__(self, config: BwdConfig):
        self.cfg = config
        self.D = config.head_dim
        self.group = config.qhead_per_kvhead
        self.diag_copy = config.diagonal_copy
        self.deterministic = config.deterministic
        self.sa = config.stages_a
        self.sb = config.stages_b
        self.sv = config.vec_stages
        self.tile = 128
        self.wm = 64
        self.num_threads = 384
        self.regs_producer = 24
        self.regs_consumer = 240
        # overlap the dK cast with the dV MMA and the dQ cast with the dK MMA (registers: d64 only)
        self.overlap = config.head_dim == 64

    def _make_mmas(self):
        K_MAJOR = OperandMajorMode.K
        e4 = Float8E4M3FN
        wm, tl, D = self.wm, self.tile, self.D
        # S^T = K Q^T, dP^T = V dO^T: M = 64 keys per warpgroup, N = 128 queries, K = D
        sd_mma = sm90_utils.make_trivial_tiled_mma(e4, e4, K_MAJOR, K_MAJOR, Float32, (1, 1, 1), (wm, tl))
        # dV, dK: M = 64 keys, N = D, K = 128 queries, A (P^T, dS^T) from registers
        kv_mma = sm90_utils.make_trivial_tiled_mma(
            e4, e4, K_MAJOR, K_MAJOR, Float32, (1, 1, 1), (wm, D), warpgroup.OperandSource.RMEM
        )
        # dQ: M = 64 queries, N = D, K = 128 keys, A (dS) from shared memory
        q_mma = sm90_utils.make_trivial_tiled_mma(e4, e4, K_MAJOR, K_MAJOR, Float32, (1, 1, 1), (wm, D))
        return sd_mma, kv_mma, q_mma

    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer,  # (T, H, D) e4m3
        qt_ptr: cute.Pointer,  # (H, D, T_dt) e4m3
        sq_ptr: cute.Pointer,  # (H, T) f32
        k_ptr: cute.Pointer,  # (T, Hk, D)
        kt_ptr: cute.Pointer,  # (Hk, D, T_dt)
        sk_ptr: cute.Pointer,
        v_ptr: cute.Pointer,  # (T, Hk, D)
        sv_ptr: cute.Pointer,
        ktok_ptr: cute.Pointer,  # per-token copies (diagonal tile)
        kttok_ptr: cute.Pointer,
        sktok_ptr: cute.Pointer,
        vtok_ptr: cute.Pointer,
        svtok_ptr: cute.Pointer,
        do_ptr: cute.Pointer,  # (T, H, D) e4m3
        dot_ptr: cute.Pointer,  # (H, D, T_dt) e4m3
        sdo_ptr: cute.Pointer,  # (H, T) f32
        lse_ptr: cute.Pointer,  # (H, T) f32
        delta_ptr: cute.Pointer,  # (H, T) f32: rowsum(dO * O)
        cu_ptr: cute.Pointer,
        dq_acc_ptr: cute.Pointer,  # (T, H, D) f32, zeroed
        dk_ptr: cute.Pointer,  # (T, Hk, D) bf16
        dv_ptr: cute.Pointer,  # (T, Hk, D) bf16
        sem_ptr: cute.Pointer,  # (H, docs, max_n_blocks) int32 zeros when deterministic (else unused)
        T: Int32,
        T_dt: Int32,
        num_kv_heads: Int32,
        num_docs: Int32,
        max_n_blocks: Int32,
        softmax_scale: Float32,
        stream: cuda.CUstream,
    ):
        D, wm, tl = self.D, self.wm, self.tile
        H = num_kv_heads * self.group
        hd = cute.assume(H * D, divby=D)
        khd = cute.assume(num_kv_heads * D, divby=D)
        tdt = cute.assume(T_dt, divby=128)
        dtl_stride = cute.assume(D * tdt, divby=128)
        mQ = cute.make_tensor(q_ptr, cute.make_layout((T, D, H), stride=(hd, 1, D)))
        mdO = cute.make_tensor(do_ptr, cute.make_layout((T, D, H), stride=(hd, 1, D)))
        mQt = cute.make_tensor(qt_ptr, cute.make_layout((D, tdt, H), stride=(tdt, 1, dtl_stride)))
        mdOt = cute.make_tensor(dot_ptr, cute.make_layout((D, tdt, H), stride=(tdt, 1, dtl_stride)))
        kl = cute.make_layout((T, D, num_kv_heads), stride=(khd, 1, D))
        ktl = cute.make_layout((D, tdt, num_kv_heads), stride=(tdt, 1, dtl_stride))
        mK = cute.make_tensor(k_ptr, kl)
        mV = cute.make_tensor(v_ptr, kl)
        mKt = cute.make_tensor(kt_ptr, ktl)
        mKtok = cute.make_tensor(ktok_ptr, kl)
        mVtok = cute.make_tensor(vtok_ptr, kl)
        mKttok = cute.make_tensor(kttok_ptr, ktl)
        sl = cute.make_layout((T, H), stride=(1, T))
        skl = cute.make_layout((T, num_kv_heads), stride=(1, T))
        mSQ = cute.make_tensor(sq_ptr, sl)
        mSdO = cute.make_tensor(sdo_ptr, sl)
        mLSE = cute.make_tensor(lse_ptr, sl)
        mDelta = cute.make_tensor(delta_ptr, sl)
        mSK = cute.make_tensor(sk_ptr, skl)
        mSV = cute.make_tensor(sv_ptr, skl)
        mSKtok = cute.make_tensor(sktok_ptr, skl)
        mSVtok = cute.make_tensor(svtok_ptr, skl)
        mCu = cute.make_tensor(cu_ptr, cute.make_layout(num_docs + 1))
        mdQ = cute.make_tensor(dq_acc_ptr, cute.make_layout((T, D, H), stride=(hd, 1, D)))
        mSem = None
        if cutlass.const_expr(self.deterministic):
            mSem = cute.make_tensor(sem_ptr, cute.make_layout(H * num_docs * max_n_blocks))
        mdK = cute.make_tensor(dk_ptr, kl)
        mdV = cute.make_tensor(dv_ptr, kl)

        e4 = Float8E4M3FN
        sd_mma, kv_mma, q_mma = self._make_mmas()
        row_major = cutlass.tensor_utils.LayoutEnum.ROW_MAJOR
        sK_layout = sm90_utils.make_smem_layout_a(row_major, (wm, tl, D), e4, 2)  # two 64-key slabs
        sQ_layout = sm90_utils.make_smem_layout_b(row_major, (wm, tl, D), e4, self.sa)
        sQt_layout = sm90_utils.make_smem_layout_b(row_major, (wm, D, tl), e4, self.sb)
        sKt_layout = sm90_utils.make_smem_layout_b(row_major, (wm, D, tl), e4, 1)
        sdS_layout = sm90_utils.make_smem_layout_a(row_major, (wm, D, tl), e4, 2)  # two 64-query slabs

        # the dS byte stores address the A tile by hand (ds_byte_base / ds_byte_offset)
        assert str(sdS_layout) == DS_LAYOUT, f"unexpected dS smem layout {sdS_layout}"
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        sK1 = cute.slice_(sK_layout, (None, None, 0))
        sQ1 = cute.slice_(sQ_layout, (None, None, 0))
        sQt1 = cute.slice_(sQt_layout, (None, None, 0))
        sKt1 = cute.slice_(sKt_layout, (None, None, 0))
        tma_k, tK = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mK, sK1, (wm, D))
        tma_v, tV = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mV, sK1, (wm, D))
        tma_kt, tKt = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mKt, sKt1, (D, tl))
        tma_ktok, tKtok = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mKtok, sK1, (wm, D))
        tma_vtok, tVtok = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mVtok, sK1, (wm, D))
        tma_kttok, tKttok = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mKttok, sKt1, (D, tl))
        tma_q, tQ = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mQ, sQ1, (tl, D))
        tma_do, tdO = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mdO, sQ1, (tl, D))
        tma_qt, tQt = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mQt, sQt1, (D, tl))
        tma_dot, tdOt = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mdOt, sQt1, (D, tl))
        self.kv_bytes = 3 * tl * D
        self.a_bytes = 2 * tl * D
        self.b_bytes = 2 * tl * D

        sa, sb, sv = self.sa, self.sb, self.sv
        n_dk = 128 * D  # fp32 dK accumulator: 256 threads x D/2 fragment values

        @cute.struct
        class SharedStorage:
            kv_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            a_mbar: cute.struct.MemRange[cutlass.Int64, 2 * sa]
            b_mbar: cute.struct.MemRange[cutlass.Int64, 2 * sb]
            v_mbar: cute.struct.MemRange[cutlass.Int64, 2 * sv]
            sVec: cute.struct.Align[cute.struct.MemRange[Float32, N_VEC * 128 * sv], 16]
            sAmax: cute.struct.Align[cute.struct.MemRange[Int32, 3 * 128], 16]
            sdK: cute.struct.Align[cute.struct.MemRange[Float32, n_dk], 16]
            sK: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sK_layout)], 1024]
            sKt: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sKt_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sQ_layout)], 1024]
            sQt: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sQt_layout)], 1024]
            sdOt: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sQt_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sdS_layout)], 1024]

        self.shared_storage = SharedStorage

        tmas = (tma_k, tK, tma_v, tV, tma_kt, tKt, tma_ktok, tKtok, tma_vtok, tVtok, tma_kttok, tKttok,
                tma_q, tQ, tma_do, tdO, tma_qt, tQt, tma_dot, tdOt)
        self.kernel(
            sd_mma, kv_mma, q_mma, tmas,
            mSQ, mSdO, mLSE, mDelta, mSK, mSV, mSKtok, mSVtok, mCu, mdQ, mdK, mdV, mSem,
            sK_layout, sQ_layout, sQt_layout, sKt_layout, sdS_layout, softmax_scale,
        ).launch(
            grid=backward_grid(self.cfg.raster, num_kv_heads, num_docs, max_n_blocks),
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    @cute.kernel
    def kernel(
        self,
        sd_mma: cute.TiledMma,
        kv_mma: cute.TiledMma,
        q_mma: cute.TiledMma,
        tmas: tuple,
        mSQ: cute.Tensor,
        mSdO: cute.Tensor,
        mLSE: cute.Tensor,
        mDelta: cute.Tensor,
        mSK: cute.Tensor,
        mSV: cute.Tensor,
        mSKtok: cute.Tensor,
        mSVtok: cute.Tensor,
        mCu: cute.Tensor,
        mdQ: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mSem: cute.Tensor,
        sK_layout: cute.ComposedLayout,
        sQ_layout: cute.ComposedLayout,
        sQt_layout: cute.ComposedLayout,
        sKt_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        softmax_scale: Float32,
    ):
        tl = self.tile
        tidx, _, _ = cute.arch.thread_idx()
        kv_head, doc, n_blk = backward_work_item(self.cfg.raster, cute.arch.block_idx())
        doc_start = mCu[doc]
        doc_len = mCu[doc + 1] - doc_start

        if n_blk * tl < doc_len:
            n_q = (doc_len + tl - 1) // tl
            per = n_q - n_blk - 1  # off-diagonal query blocks per head
            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            bufs = (
                storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
                storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
                storage.sKt.get_tensor(sKt_layout.outer, swizzle=sKt_layout.inner),
                storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
                storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
                storage.sQt.get_tensor(sQt_layout.outer, swizzle=sQt_layout.inner),
                storage.sdOt.get_tensor(sQt_layout.outer, swizzle=sQt_layout.inner),
                storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner),
            )
            # dS bytes, addressed by hand: sdS_layout is Swizzle<3,4,3> o ((8,8),(128,1),(1,2)):
            # ((128,1024),(1,0),(0,8192)), i.e. byte (q, key) of query slab q // 64 at
            # 8192 (q // 64) + 128 (q % 64) + (key ^ ((q % 8) << 4)) (checked by the CPU tests)
            sdS8 = storage.sdS.get_tensor(cute.make_layout(2 * 64 * 128), dtype=Uint8)
            sVec = storage.sVec.get_tensor(cute.make_layout((128, N_VEC, self.sv)))
            sAmax = storage.sAmax.get_tensor(cute.make_layout((128, 3)))
            sdK = storage.sdK.get_tensor(cute.make_layout((256, self.D // 2)))

            pipe_kv = tma_pipeline(1, self.kv_bytes, storage.kv_mbar.data_ptr())
            pipe_a = tma_pipeline(self.sa, self.a_bytes, storage.a_mbar.data_ptr())
            pipe_b = tma_pipeline(self.sb, self.b_bytes, storage.b_mbar.data_ptr())
            pipe_v = warp_pipeline(self.sv, storage.v_mbar.data_ptr())
            cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()

            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wg_idx = cute.arch.make_warp_uniform(tidx // 128)
            if wg_idx == 0:
                cute.arch.setmaxregister_decrease(self.regs_producer)
                if warp_idx == 0:
                    dt_start = document_dt_start(mCu, doc)  # the host builds no dt_cu_seqlens table
                    self.load_tma(tmas, bufs, pipe_kv, pipe_a, pipe_b, kv_head, doc_start, dt_start, n_blk, per)
                if warp_idx == 1:
                    self.load_vectors(mSQ, mSdO, mLSE, mDelta, sVec, pipe_v, kv_head, doc_start, doc_len,
                                      n_blk, per, softmax_scale)
            else:
                cute.arch.setmaxregister_increase(self.regs_consumer)
                self.consume(
                    sd_mma, kv_mma, q_mma, bufs, sdS8, sVec, sAmax, sdK, pipe_kv, pipe_a, pipe_b, pipe_v,
                    mSK, mSV, mSKtok, mSVtok, (mdQ, mSem, doc, n_blk), mdK, mdV, kv_head, doc_start, doc_len, n_blk, per,
                    softmax_scale, wg_idx - 1,
                )

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _td_part(self, atom, t, head, rows: cutlass.Constexpr, s, doc_start):
        """Token-major [t, d] tiles: the document start is a domain offset of the (strided) token axis."""
        g = cute.local_tile(cute.domain_offset((doc_start, 0), t[None, None, head]), (rows, self.D), (None, 0))
        return cute.nvgpu.cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
        )

    @cute.jit
    def _dt_part(self, atom, t, head, s, dt_start):
        """[d, t] tiles, tokens contiguous: the document starts at its 16-aligned column dt_start."""
        g = cute.local_tile(cute.domain_offset((0, dt_start), t[None, None, head]), (self.D, self.tile), (0, None))
        return cute.nvgpu.cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
        )

    @cute.jit
    def _load_kv(self, atoms, bufs, pipe_kv, kv_state, kv_head, doc_start, dt_start, n_blk):
        atom_k, t_k, atom_v, t_v, atom_kt, t_kt = atoms
        sK, sV, sKt = bufs[0], bufs[1], bufs[2]
        tKs, tKg = self._td_part(atom_k, t_k, kv_head, self.wm, sK, doc_start)
        tVs, tVg = self._td_part(atom_v, t_v, kv_head, self.wm, sV, doc_start)
        tKts, tKtg = self._dt_part(atom_kt, t_kt, kv_head, sKt, dt_start)
        pipe_kv.producer_acquire(kv_state)
        bar = pipe_kv.producer_get_barrier(kv_state)
        for w in cutlass.range_constexpr(2):
            cute.copy(atom_k, tKg[None, 2 * n_blk + w], tKs[None, w], tma_bar_ptr=bar)
            cute.copy(atom_v, tVg[None, 2 * n_blk + w], tVs[None, w], tma_bar_ptr=bar)
        cute.copy(atom_kt, tKtg[None, n_blk], tKts[None, 0], tma_bar_ptr=bar)
        kv_state.advance()
        return kv_state

    @cute.jit
    def _load_q(self, tmas, bufs, pipe_a, pipe_b, a_state, b_state, hq, m, doc_start, dt_start):
        tma_q, tQ, tma_do, tdO, tma_qt, tQt, tma_dot, tdOt = tmas[12:]
        sQ, sdO, sQt, sdOt = bufs[3], bufs[4], bufs[5], bufs[6]
        tQs, tQg = self._td_part(tma_q, tQ, hq, self.tile, sQ, doc_start)
        tdOs, tdOg = self._td_part(tma_do, tdO, hq, self.tile, sdO, doc_start)
        tQts, tQtg = self._dt_part(tma_qt, tQt, hq, sQt, dt_start)
        tdOts, tdOtg = self._dt_part(tma_dot, tdOt, hq, sdOt, dt_start)
        pipe_a.producer_acquire(a_state)
        bar = pipe_a.producer_get_barrier(a_state)
        cute.copy(tma_q, tQg[None, m], tQs[None, a_state.index], tma_bar_ptr=bar)
        cute.copy(tma_do, tdOg[None, m], tdOs[None, a_state.index], tma_bar_ptr=bar)
        a_state.advance()
        pipe_b.producer_acquire(b_state)
        bar = pipe_b.producer_get_barrier(b_state)
        cute.copy(tma_qt, tQtg[None, m], tQts[None, b_state.index], tma_bar_ptr=bar)
        cute.copy(tma_dot, tdOtg[None, m], tdOts[None, b_state.index], tma_bar_ptr=bar)
        b_state.advance()
        return a_state, b_state

    @cute.jit
    def load_tma(self, tmas, bufs, pipe_kv, pipe_a, pipe_b, kv_head, doc_start, dt_start, n_blk, per):
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        a_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.sa)
        b_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.sb)
        # phase 0: the diagonal tile of every head of the group (per-token K/V when diag_copy)
        if cutlass.const_expr(self.diag_copy):
            kv_state = self._load_kv(tmas[6:12], bufs, pipe_kv, kv_state, kv_head, doc_start, dt_start, n_blk)
        else:
            kv_state = self._load_kv(tmas[0:6], bufs, pipe_kv, kv_state, kv_head, doc_start, dt_start, n_blk)
        for i in cutlass.range(self.group, unroll=1):
            a_state, b_state = self._load_q(
                tmas, bufs, pipe_a, pipe_b, a_state, b_state, kv_head * self.group + i, n_blk, doc_start, dt_start
            )
        # phase 1: the off-diagonal tiles; the block-scaled K/V replace the copies once released
        if per > 0:
            if cutlass.const_expr(self.diag_copy):
                kv_state = self._load_kv(tmas[0:6], bufs, pipe_kv, kv_state, kv_head, doc_start, dt_start, n_blk)
            for j in cutlass.range(self.group * per, unroll=1):
                a_state, b_state = self._load_q(
                    tmas, bufs, pipe_a, pipe_b, a_state, b_state, kv_head * self.group + j // per,
                    n_blk + 1 + j % per, doc_start, dt_start,
                )

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load_vectors(self, mSQ, mSdO, mLSE, mDelta, sVec, pipe_v, kv_head, doc_start, doc_len, n_blk, per,
                     softmax_scale):
        """Warp 1: per query tile, the six per-query vectors (see the module docstring)."""
        lane = cute.arch.lane_idx()
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.sv)
        scale_log2 = softmax_scale * Float32(LOG2E)
        total = self.group * (per + 1)
        for i in cutlass.range(total, unroll=1):
            hi = i
            m = n_blk
            if i >= self.group:
                j = i - self.group
                hi = j // per
                m = n_blk + 1 + j % per
            hq = kv_head * self.group + hi
            pipe_v.producer_acquire(v_state)
            st = v_state.index
            wv = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            for c in cutlass.range_constexpr(4):
                col = lane + 32 * c
                wv[c] = store_query_vectors(sVec, col, st, m * self.tile + col, doc_start, doc_len, hq, mSQ, mLSE,
                                            mDelta, mSdO, scale_log2)
            # suffix max of the dO scale over the tile's columns (col' >= col): the dV fold's r
            for c in cutlass.range_constexpr(4):
                for k in cutlass.range_constexpr(5):
                    wv[c] = cute.arch.fmax(wv[c], cute.arch.shuffle_sync_down(wv[c], 1 << k))
            tot = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            for c in cutlass.range_constexpr(4):
                tot[c] = cute.arch.shuffle_sync(wv[c], 0)
            for c in cutlass.range_constexpr(4):
                r = wv[c]
                for c2 in cutlass.range_constexpr(c + 1, 4):
                    r = cute.arch.fmax(r, tot[c2])
                sVec[lane + 32 * c, 5, st] = r
            pipe_v.producer_commit(v_state)
            v_state.advance()

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consume(
        self, sd_mma, kv_mma, q_mma, bufs, sdS8, sVec, sAmax, sdK, pipe_kv, pipe_a, pipe_b, pipe_v,
        mSK, mSV, mSKtok, mSVtok, dq_out, mdK, mdV, kv_head, doc_start, doc_len, n_blk, per, softmax_scale, wg,
    ):
        D, wm, tl = self.D, self.wm, self.tile
        sK, sV, sKt, sQ, sdO, sQt, sdOt, sdS = bufs
        tidx, _, _ = cute.arch.thread_idx()
        ctid = tidx % 128
        lane = cute.arch.lane_idx()
        quad = lane % 4
        sd_thr = sd_mma.get_slice(ctid)
        kv_thr = kv_mma.get_slice(ctid)
        q_thr = q_mma.get_slice(ctid)
        tSrK = sd_thr.make_fragment_A(sd_thr.partition_A(sK))  # (MMA, 1, D/32, 2 slabs)
        tSrV = sd_thr.make_fragment_A(sd_thr.partition_A(sV))
        tSrQ = sd_thr.make_fragment_B(sd_thr.partition_B(sQ))  # (MMA, 1, D/32, stages_a)
        tSrdO = sd_thr.make_fragment_B(sd_thr.partition_B(sdO))
        tKVrQt = kv_thr.make_fragment_B(kv_thr.partition_B(sQt))  # (MMA, 1, 4, stages_b)
        tKVrdOt = kv_thr.make_fragment_B(kv_thr.partition_B(sdOt))
        tQrdS = q_thr.make_fragment_A(q_thr.partition_A(sdS))  # (MMA, 1, 4, 2 slabs)
        tQrKt = q_thr.make_fragment_B(q_thr.partition_B(sKt))  # (MMA, 1, 4, 1)
        acc_s = sd_thr.make_fragment_C(sd_thr.partition_shape_C((wm, tl)))
        acc_dp = sd_thr.make_fragment_C(sd_thr.partition_shape_C((wm, tl)))
        acc_t = kv_thr.make_fragment_C(kv_thr.partition_shape_C((wm, D)))  # per-tile product
        acc_dv = kv_thr.make_fragment_C(kv_thr.partition_shape_C((wm, D)))  # running dV
        tOrP = kv_thr.make_fragment_A(kv_thr.partition_shape_A((wm, tl)))
        tOrS = kv_thr.make_fragment_A(kv_thr.partition_shape_A((wm, tl)))
        tOrP32 = cute.recast_tensor(tOrP, Uint32)
        tOrS32 = cute.recast_tensor(tOrS, Uint32)
        tScS = sd_thr.partition_C(cute.make_identity_tensor((wm, tl)))  # (key in slab, query)
        tScQ = q_thr.partition_C(cute.make_identity_tensor((wm, D)))  # (query in slab, d)
        n_acc = cute.size(acc_t)

        # rows (keys) of this thread: value index a = v0 + 2*v1 + 4*v2, v1 picks row g or g+8
        krow = cute.make_rmem_tensor(cute.make_layout(2), Int32)  # key index in the 128-key tile
        for v1 in cutlass.range_constexpr(2):
            krow[v1] = wg * wm + tScS[2 * v1][0]
        # dS byte address of (query column 2 quad + v0 (+ 8 w), key krow[v1]) for w = 0: index v0 + 2 v1
        dsb = cute.make_rmem_tensor(cute.make_layout(4), Int32)
        for b in cutlass.range_constexpr(4):
            qlo = 2 * quad + b % 2
            dsb[b] = ds_byte_base(qlo, krow[b // 2])
        acc_dv.fill(0.0)
        for a in cutlass.range_constexpr(n_acc):
            sdK[tidx - 128, a] = Float32(0.0)
        if ctid < 128:
            for b in cutlass.range_constexpr(3):
                if wg == 0:
                    sAmax[ctid, b] = Int32(0)
        cute.arch.barrier(barrier_id=1, number_of_threads=256)

        frags = (tSrK, tSrV, tSrQ, tSrdO, tKVrQt, tKVrdOt, tQrdS, tQrKt, acc_s, acc_dp, acc_t, acc_dv,
                 tOrP, tOrS, tOrP32, tOrS32, tScS, tScQ, dsb)
        mmas = (sd_mma, kv_mma, q_mma)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        a_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.sa)
        b_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.sb)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.sv)
        rsc = cute.make_rmem_tensor(cute.make_layout(4), Float32)  # sk(row 0), sk(row 1), sv(row 0), sv(row 1)
        lim = doc_len - n_blk * tl  # rows (keys) >= lim lie past the document end

        # ---- phase 0: diagonal tiles
        load_row_scales(rsc, krow, mSKtok if self.diag_copy else mSK, mSVtok if self.diag_copy else mSV, kv_head,
                        doc_start, doc_len, n_blk * tl)
        pipe_kv.consumer_wait(kv_state)
        for i in cutlass.range(self.group, unroll=1):
            a_state, b_state, v_state = self.tile_step(
                True, i, kv_head * self.group + i, n_blk, mmas, frags, rsc, krow, sVec, sAmax, sdK, sdS8,
                pipe_a, pipe_b, pipe_v, a_state, b_state, v_state, dq_out, doc_start, doc_len, lim,
                softmax_scale, wg, quad, lane, tidx,
            )
        # ---- phase 1: off-diagonal tiles
        if cutlass.const_expr(self.diag_copy):
            # the per-token copies are done: let the producer bring the block-scaled K/V (if any
            # off-diagonal tile follows; otherwise the release is never waited on)
            pipe_kv.consumer_release(kv_state)
            kv_state.advance()
        if per > 0:
            if cutlass.const_expr(self.diag_copy):
                load_row_scales(rsc, krow, mSK, mSV, kv_head, doc_start, doc_len, n_blk * tl)
                pipe_kv.consumer_wait(kv_state)
            for j in cutlass.range(self.group * per, unroll=1):
                a_state, b_state, v_state = self.tile_step(
                    False, self.group + j, kv_head * self.group + j // per, n_blk + 1 + j % per, mmas, frags, rsc, krow,
                    sVec, sAmax, sdK, sdS8, pipe_a, pipe_b, pipe_v, a_state, b_state, v_state, dq_out, doc_start,
                    doc_len, lim, softmax_scale, wg, quad, lane, tidx,
                )

        # ---- epilogue: dV (registers) and dK * softmax_scale (shared memory) to bf16
        store_key_rows_bf16(mdV, lambda i0: (acc_dv[i0], acc_dv[i0 + 1]), krow, n_blk * tl, doc_start, doc_len,
                            kv_head, D, n_acc)
        store_key_rows_bf16(
            mdK, lambda i0: (sdK[tidx - 128, i0] * softmax_scale, sdK[tidx - 128, i0 + 1] * softmax_scale), krow,
            n_blk * tl, doc_start, doc_len, kv_head, D, n_acc,
        )

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def tile_step(
        self, diag: cutlass.Constexpr, i, hq, m, mmas, frags, rsc, krow, sVec, sAmax, sdK, sdS8,
        pipe_a, pipe_b, pipe_v, a_state, b_state, v_state, dq_out, doc_start, doc_len, lim,
        softmax_scale, wg, quad, lane, tidx,
    ):
        """One query tile m of query head hq (tile number i of the CTA). diag: m == n_blk."""
        D, wm, tl = self.D, self.wm, self.tile
        (tSrK, tSrV, tSrQ, tSrdO, tKVrQt, tKVrdOt, tQrdS, tQrKt, acc_s, acc_dp, acc_t, acc_dv,
         tOrP, tOrS, tOrP32, tOrS32, tScS, tScQ, dsb) = frags
        sd_mma_k = self.D // 32
        n_s = cute.size(acc_s)
        n_acc = cute.size(acc_t)
        # fresh tiled MMAs per call: ACCUMULATE is state threaded through the IR, and a value set
        # inside one staged loop must not be used by the next loop
        sd_mma, kv_mma, q_mma = self._make_mmas()

        # ---- S^T = K Q^T and dP^T = V dO^T
        pipe_a.consumer_wait(a_state)
        warpgroup.fence()
        for k in cutlass.range_constexpr(sd_mma_k):
            sd_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(sd_mma, acc_s, tSrK[None, None, k, wg], tSrQ[None, None, k, a_state.index], acc_s)
        for k in cutlass.range_constexpr(sd_mma_k):
            sd_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(sd_mma, acc_dp, tSrV[None, None, k, wg], tSrdO[None, None, k, a_state.index], acc_dp)
        warpgroup.commit_group()
        pipe_v.consumer_wait(v_state)
        vs = v_state.index
        warpgroup.wait_group(0)
        pipe_a.consumer_release(a_state)
        a_state.advance()

        # ---- P^T, dS^T (in place of dP^T) and the dV operand e4m3(P^T * sdo * 256 / r).
        # Column-outer loops: each query column's vectors are loaded once and die after use.
        rfac = cute.make_rmem_tensor(cute.make_layout(2), Float32)  # r / 256 per row
        cf = cute.make_rmem_tensor(cute.make_layout(2), Float32)  # 256 / r per row
        for v1 in cutlass.range_constexpr(2):
            r = sVec[0, 5, vs]
            if cutlass.const_expr(diag):
                r = sVec[krow[v1], 5, vs]  # visible queries of key krow: columns >= krow
            if r == Float32(0.0):
                r = Float32(1.0)
            r = cute.arch.fmax(r, Float32(FOLD_REF_MIN))  # all-zero dO rows: 256 / 2^-126 is inf
            cf[v1] = Float32(P_SCALE) / r  # exact: r is a power of two
            rfac[v1] = r / Float32(P_SCALE)
        pv = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        for w_ in cutlass.range_constexpr(n_s // 4):
            for v0 in cutlass.range_constexpr(2):
                col = tScS[4 * w_ + v0][1]
                ca = sVec[col, 0, vs]
                cb = sVec[col, 1, vs]
                cd = sVec[col, 2, vs]
                cw = sVec[col, 3, vs]
                for v1 in cutlass.range_constexpr(2):
                    a = v0 + 2 * v1 + 4 * w_
                    p = cute.math.exp2(acc_s[a] * rsc[v1] * ca - cb, fastmath=True)
                    if cutlass.const_expr(diag):
                        if col < krow[v1]:
                            p = Float32(0.0)
                        if krow[v1] >= lim:
                            p = Float32(0.0)
                    acc_dp[a] = p * (acc_dp[a] * rsc[2 + v1] * cw - cd)
                    # S^T is dead: it holds the dV operand until packed. (p * cw) first: a masked
                    # query's cw * cf may overflow (its scale above r), p = 0 times it must stay 0
                    acc_s[a] = (p * cw) * cf[v1]
        # dO^T comes in P-fragment query order: the A registers are packed in place
        pack_a_fragment_e4m3(acc_s, tOrP32)

        # ---- dV_tile = P8 dO^T-codes (A from registers)
        pipe_b.consumer_wait(b_state)
        warpgroup.fence()
        for k in cutlass.range_constexpr(tl // 32):
            kv_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(kv_mma, acc_t, tOrP[None, None, k], tKVrdOt[None, None, k, b_state.index], acc_t)
        warpgroup.commit_group()
        if cutlass.const_expr(not self.overlap):
            warpgroup.wait_group(0)
            for a in cutlass.range_constexpr(n_acc):
                acc_dv[a] = acc_dv[a] + acc_t[a] * rfac[(a // 2) % 2]

        # ---- dK operand: e4m3(dS^T * sq / s_k), s_k per key over the 128 queries. acc_s (its P is
        # packed) keeps dS^T * sq between the amax and the scaling: one multiply and one sq load
        # per element instead of two, the same products in the same order
        amax = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        amax.fill(0.0)
        for w_ in cutlass.range_constexpr(n_s // 4):
            for v0 in cutlass.range_constexpr(2):
                cq = sVec[tScS[4 * w_ + v0][1], 4, vs]
                for v1 in cutlass.range_constexpr(2):
                    a = v0 + 2 * v1 + 4 * w_
                    acc_s[a] = acc_dp[a] * cq
                    amax[v1] = cute.arch.fmax(amax[v1], abs(acc_s[a]))
        skk = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        inv = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        for v1 in cutlass.range_constexpr(2):
            sbits, ibits = pow2_scale_bits(f32_bits(quad_max(amax[v1])))
            skk[v1] = as_f32(sbits)
            inv[v1] = as_f32(ibits)
        for a in cutlass.range_constexpr(n_s):
            acc_s[a] = acc_s[a] * inv[(a // 2) % 2]
        # Q^T comes in P-fragment query order as well
        pack_a_fragment_e4m3(acc_s, tOrS32)

        if cutlass.const_expr(self.overlap):
            warpgroup.wait_group(0)
            for a in cutlass.range_constexpr(n_acc):
                acc_dv[a] = acc_dv[a] + acc_t[a] * rfac[(a // 2) % 2]

        # ---- dK_tile = dS8 Q^T-codes
        warpgroup.fence()
        for k in cutlass.range_constexpr(tl // 32):
            kv_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(kv_mma, acc_t, tOrS[None, None, k], tKVrQt[None, None, k, b_state.index], acc_t)
        warpgroup.commit_group()
        if cutlass.const_expr(not self.overlap):
            warpgroup.wait_group(0)
            pipe_b.consumer_release(b_state)
            b_state.advance()
            for a in cutlass.range_constexpr(n_acc):
                sdK[tidx - 128, a] = sdK[tidx - 128, a] + acc_t[a] * skk[(a // 2) % 2]

        # ---- dQ operand: per-query amax of |dS * sk| over the 128 keys (8 consumer warps)
        # Reductions of DQ_AMAX_BATCH columns at a time, one shuffle round for all of them before
        # the next: the shared-memory atomic orders the code around it, and one column at a time
        # made 32 serial chains of 3 dependent shuffles + an atomic per tile (measured with ncu:
        # the largest stall class of the kernel). Same maxima, any order.
        # acc_dp (dead after this) is scaled by sk in place: the dS bytes below reuse the products
        buf = i % 3
        for a in cutlass.range_constexpr(n_s):
            acc_dp[a] = acc_dp[a] * rsc[(a // 2) % 2]
        cols = [(w_, v0) for w_ in range(n_s // 4) for v0 in range(2)]
        for g0 in cutlass.range_constexpr(0, len(cols), DQ_AMAX_BATCH):
            group = cols[g0 : g0 + DQ_AMAX_BATCH]
            xs = [cute.arch.fmax(abs(acc_dp[v0 + 4 * w_]), abs(acc_dp[v0 + 2 + 4 * w_])) for w_, v0 in group]
            for off in cutlass.range_constexpr(3):
                sh = [cute.arch.shuffle_sync_bfly(x, offset=4 << off) for x in xs]
                xs = [cute.arch.fmax(x, y) for x, y in zip(xs, sh, strict=True)]
            if lane < 4:
                for (w_, v0), x in zip(group, xs, strict=True):
                    cute.arch.atomic_max(sAmax.iterator + (tScS[v0 + 4 * w_][1] + 128 * buf), f32_bits(x))
        cute.arch.barrier(barrier_id=1, number_of_threads=256)
        # buffer (i + 2) % 3 was last read in tile i - 1 (before this barrier): clear it for tile i + 2
        if wg == 0:
            sAmax[tidx - 128, (i + 2) % 3] = Int32(0)
        # The scales of DQ_AMAX_BATCH columns are read and decoded before any of their dS bytes is
        # stored: a shared-memory load may not pass an earlier store, so column by column each
        # load waited for the previous column's stores (a serial chain of 16 per tile).
        for g0 in cutlass.range_constexpr(0, n_s // 4, DQ_AMAX_BATCH // 2):
            ws = list(range(g0, min(g0 + DQ_AMAX_BATCH // 2, n_s // 4)))
            iqs = [as_f32(pow2_scale_bits(sAmax[tScS[4 * w_ + v0][1], buf])[1]) for w_ in ws for v0 in range(2)]
            for k_, w_ in enumerate(ws):
                for v0 in cutlass.range_constexpr(2):
                    for v1 in cutlass.range_constexpr(2):
                        pv[v0 + 2 * v1] = acc_dp[v0 + 2 * v1 + 4 * w_] * iqs[2 * k_ + v0]
                pk = cvt_e4m3x4(pv[0], pv[1], pv[2], pv[3])
                for b in cutlass.range_constexpr(4):
                    # query column 8 w_ + 2 quad + b % 2: its q % 8 part lives in dsb (see consume)
                    sdS8[dsb[b] + ds_byte_offset(w_)] = _byte(pk, b)
        pipe_v.consumer_release(v_state)
        v_state.advance()
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=2, number_of_threads=256)

        if cutlass.const_expr(self.overlap):
            # ---- dK += s_k * dK_tile (shared memory, this thread's fragment)
            warpgroup.wait_group(0)
            pipe_b.consumer_release(b_state)
            b_state.advance()
            for a in cutlass.range_constexpr(n_acc):
                sdK[tidx - 128, a] = sdK[tidx - 128, a] + acc_t[a] * skk[(a // 2) % 2]

        # ---- dQ_tile = dS K^T-codes for queries 64 wg .. 64 wg + 63; atomics of s_q * scale * dQ_tile
        warpgroup.fence()
        for k in cutlass.range_constexpr(tl // 32):
            q_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(q_mma, acc_t, tQrdS[None, None, k, wg], tQrKt[None, None, k, 0], acc_t)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        mdQ, mSem, doc, n_blk = dq_out
        sem_addr = Int64(0)
        if cutlass.const_expr(self.deterministic):
            sem_addr = dq_turn_wait(mSem, hq, doc, m, n_blk, tidx, 1)

        def dq_row_scale(qr):  # s_q of the row (its dS scale) * softmax_scale
            sbits, _ = pow2_scale_bits(sAmax[qr, buf])
            return as_f32(sbits) * softmax_scale

        add_dq_tile(mdQ, acc_t, tScQ, m * tl + wg * wm, 0, doc_start, doc_len, hq, D, lambda qr: dq_row_scale(wg * wm + qr))
        if cutlass.const_expr(self.deterministic):
            dq_turn_pass(sem_addr, tidx)
        return a_state, b_state, v_state


# ----------------------------------------------------------------------------------------------
# Compile and launch
# ----------------------------------------------------------------------------------------------


_F8, _F32, _I32, _BF16 = ARG_F8, ARG_F32, ARG_I32, ARG_BF16
# The runtime entry's parameters (FlamiaBwdSm90.__call__) for compile_cache.compile_launcher
ARG_KINDS = (
    _F8, _F8, _F32,  # q, qt, sq
    _F8, _F8, _F32,  # k, kt, sk
    _F8, _F32,  # v, sv
    _F8, _F8, _F32, _F8, _F32,  # per-token k, kt, sk, v, sv
    _F8, _F8, _F32,  # do, dot, sdo
    _F32, _F32,  # lse, delta
    _I32,  # cu_seqlens
    ("ptr", Float32, 16), _BF16, _BF16, _I32,  # dq accumulator, dk, dv, dQ semaphores (deterministic)
    ("i32",), ("i32",), ("i32",), ("i32",), ("i32",), ("f32",),  # T, T_dt, Hk, num_docs, max_n_blocks, scale
    ("stream",),
)


def compile_bwd_sm90(config: BwdConfig, arch: str = "sm_90a", extra_options: str = "", tvm_ffi: bool = False):
    """cute.compile the backward for `arch` from plain values only (no tensors, no GPU needed).

    tvm_ffi: compile for TVM-FFI calls (raw int/float arguments, explicit stream handle).
    """
    return compile_entry(FlamiaBwdSm90(config), ARG_KINDS, arch, extra_options, tvm_ffi)


def get_launcher(config: BwdConfig, arch: str | None = None, use_tvm_ffi: bool | None = None):
    """launch(*raw) in ARG_KINDS order: TVM-FFI when available (see compile_cache.compile_launcher)."""
    from .compile_cache import compile_launcher, target_arch

    return compile_launcher(
        SOURCE_FILES, config, arch or target_arch(), lambda cfg, a, t: compile_bwd_sm90(cfg, a, tvm_ffi=t),
        ARG_KINDS, use_tvm_ffi,
    )


def kernel_artifacts(config: BwdConfig, arch: str = "sm_90a"):
    from .compile_cache import compile_artifacts

    return compile_artifacts(compile_bwd_sm90, config, arch)


def flamia_bwd_sm90(
    dout, out, lse, q_td, q_dt, sq, k_td, k_dt, sk, v_td, sv,
    k_tok_td, k_tok_dt, sk_tok, v_tok_td, sv_tok,
    cu_seqlens, max_seqlen: int, softmax_scale: float, config: BwdConfig,
    poison_outputs: bool = False, dt_cu_seqlens=None, do_quantized=None, delta=None,
):
    """Causal FP8 attention backward on the current stream; returns (dq, dk, dv) bf16.

    dout, out: (T, H, D) bf16; lse (H, T) fp32 (the forward's). q_td (T, H, D) / q_dt
    (H, D, T_dt) e4m3 and sq (H, T); k_td, k_dt, sk; v_td (T, Hk, D), sv: the forward's saved
    operands (quant.quantize layouts). *_tok*: the per-token K/V copies used on the diagonal tile
    when config.diagonal_copy (else ignored). do_quantized (QuantizedTHD with data_dt) and delta
    (H, T) may be passed precomputed; else preprocess_bwd computes them. Self-attention only.
    dt_cu_seqlens: accepted for compatibility and unused: the kernel derives every document's first
    data_dt column from cu_seqlens (as the forward does).
    """
    del dt_cu_seqlens
    T, H, D = q_td.shape
    Hk = k_td.shape[1]
    if D != config.head_dim or H != Hk * config.qhead_per_kvhead:
        raise ValueError(f"shapes (H={H}, Hk={Hk}, D={D}) do not match {config}")
    if not config.diagonal_copy or k_tok_td is None:
        if config.diagonal_copy:
            raise ValueError("config.diagonal_copy needs k_tok_td, k_tok_dt, sk_tok, v_tok_td, sv_tok")
        k_tok_td, k_tok_dt, sk_tok, v_tok_td, sv_tok = k_td, k_dt, sk, v_td, sv
    dev = q_td.device
    cu = int32_cu_seqlens(cu_seqlens, dev)
    num_docs = cu.numel() - 1
    T_dt = transposed_tokens(T, num_docs)
    if do_quantized is None or delta is None:
        delta_, doq = preprocess_bwd(dout, out, cu)
        delta = delta if delta is not None else delta_
        do_quantized = do_quantized if do_quantized is not None else doq
    f8 = torch.float8_e4m3fn
    check_kernel_tensors((
        ("q_td", q_td, (T, H, D), f8), ("q_dt", q_dt, (H, D, T_dt), f8),
        ("k_td", k_td, (T, Hk, D), f8), ("k_dt", k_dt, (Hk, D, T_dt), f8), ("v_td", v_td, (T, Hk, D), f8),
        ("k_tok_td", k_tok_td, (T, Hk, D), f8), ("k_tok_dt", k_tok_dt, (Hk, D, T_dt), f8),
        ("v_tok_td", v_tok_td, (T, Hk, D), f8),
        ("do_td", do_quantized.data_td, (T, H, D), f8), ("do_dt", do_quantized.data_dt, (H, D, T_dt), f8),
        ("sq", sq, (H, T), torch.float32), ("sk", sk, (Hk, T), torch.float32), ("sv", sv, (Hk, T), torch.float32),
        ("sk_tok", sk_tok, (Hk, T), torch.float32), ("sv_tok", sv_tok, (Hk, T), torch.float32),
        ("sdo", do_quantized.scale, (H, T), torch.float32), ("lse", lse, (H, T), torch.float32),
        ("delta", delta, (H, T), torch.float32),
    ), dev)
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    dq_acc, dk, dv = backward_outputs(T, H, Hk, D, dev, poison_outputs)
    max_n_blocks = backward_grid_blocks(T, H, D, T_dt, num_docs, max_seqlen, 128)
    if T > 0 and num_docs > 0 and max_n_blocks > 0:
        ptrs = (q_td, q_dt, sq, k_td, k_dt, sk, v_td, sv, k_tok_td, k_tok_dt, sk_tok, v_tok_td, sv_tok,
                do_quantized.data_td, do_quantized.data_dt, do_quantized.scale, lse, delta, cu, dq_acc, dk, dv)
        # deterministic dQ: one turn counter per (query head, document, query block)
        sem = torch.zeros(H * num_docs * max_n_blocks, dtype=torch.int32, device=dev) if config.deterministic else None
        launch_on_device(get_launcher(config), dev, *(t.data_ptr() for t in ptrs),
                         sem.data_ptr() if sem is not None else 0,
                         T, T_dt, Hk, num_docs, max_n_blocks, float(softmax_scale))
    # dQ: fp32 accumulator -> bf16 (a small pass; softmax_scale and the dS scales are already applied)
    dq = dq_acc.to(torch.bfloat16)
    return dq, dk, dv


def default_config(qq, kq, kt) -> BwdConfig:
    """The default BwdConfig for the forward's saved operands (kt: per-token K copy or None)."""
    return BwdConfig(head_dim=qq.data_td.shape[2], qhead_per_kvhead=qq.data_td.shape[1] // kq.data_td.shape[1],
                     diagonal_copy=kt is not None)


def flamia_bwd_sm90_from_saved(dout, out, lse, qq, kq, vq, kt, vt, cu_seqlens, max_seqlen, softmax_scale,
                               config: BwdConfig | None = None, **kw):
    """Convenience entry from the forward's saved QuantizedTHD operands (kt, vt: per-token copies or None)."""
    block = kt is not None
    if config is None:
        config = default_config(qq, kq, kt)
    return flamia_bwd_sm90(
        dout, out, lse, qq.data_td, qq.data_dt, qq.scale, kq.data_td, kq.data_dt, kq.scale, vq.data_td, vq.scale,
        kt.data_td if block else None, kt.data_dt if block else None, kt.scale if block else None,
        vt.data_td if block else None, vt.scale if block else None,
        cu_seqlens, max_seqlen, softmax_scale, config, **kw,
    )
