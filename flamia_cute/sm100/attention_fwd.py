"""MXFP8 causal attention forward for Blackwell (sm_100a, sm_103a) over packed documents, in the CuTe DSL.

Recipe `mxfp8` (flamia_cute.emulator is the spec; `reference_fwd_sm100` below is this kernel's
algorithm on the CPU, tile by tile, and must equal the emulator). Compiled and checked here
without a Blackwell GPU (CI: PTX and SASS); it has not run on a GPU.

Operands (quant.mx_layout.pack_mx_forward_operands): e4m3 codes of Q, K and V, all token-major, and
E8M0 scale chunks of 512 bytes, one per 128-token tile and head, in the block-scaled MMA's scale
layout, so one TMA copy brings a tile's scales next to its codes. V is P V's B operand read
MN-major (head dims contiguous): no transposed copy. Both products run on the block-scaled
tensor core (tcgen05.mma kind::mxf8f6f4.block_scale, one scale per 32 elements along the
reduction): S = Q K^T with Q's per-token and K's 32x32 tile scales, and O += P V with P's
per-row, per-32-key scales (computed here) and V's 32x32 tile scales. The diagonal safeguard:
pairs whose key shares the query's 32-token block (K's and V's shared scales would carry future
keys into them) run in bf16 (tcgen05.mma kind::f16): S from Q's MX values, exact in bf16 (the softmax
warps convert Q's codes in shared memory), times bf16 K; O from bf16 P times bf16 V. Only the
diagonal tile has such pairs.

Organization (one CTA per (128-query block, head, document), blocks longest first; 192 threads):
- warp 5 (load): TMA of Q's codes and scales and the diagonal tile's bf16 K and V once, then K
  and V tiles with their scale chunks through `kv_stages`-deep rings, diagonal first;
- warp 4 (MMA): one thread issues every tcgen05 op. The diagonal's S (both stages), its P V,
  then S of tile 1; after that S of tile i + 1 is issued before P V of tile i, so the softmax of
  one tile runs under the other's matrix products (the order hazards.py checks). Scale chunks move
  shared -> tensor memory by tcgen05.cp just before the MMAs that read them (same-thread tcgen05
  ops execute in order: a chunk is never overwritten under an MMA still reading it);
- warps 0-3 (softmax): thread r owns query row r (tensor-memory lane r). First, row r of Q's MX
  values in bf16 from its codes and scale chunk (shared memory, for the diagonal's bf16 S). Per
  tile: S from tensor memory, mask on the diagonal tile, online softmax in the log2 domain, O in
  tensor memory rescaled by exp2(m_old - m_new) once the previous P V has finished, P's codes
  written back over S (32 columns) and its scales into a shared-memory chunk. Epilogue: O / l in
  bf16, LSE.
Tensor memory (512 columns): S stages at 0 and 128 (P over them), O at 256, scale chunks after
(400 used). Head dim 128 only: one scale chunk covers 4 blocks of 32 along D.

Not built (none can be measured without a Blackwell GPU; docs/blackwell.md): a persistent tile
scheduler, a correction warpgroup that takes the O rescale off the softmax warps' path, two query
tiles per CTA (FA4's ping-pong), the backward. The diagonal tile's bf16 products cover the whole
128 x 128 tile (one tile per query block; 4x the pairs they keep).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
import torch
from cutlass import BFloat16, Float8E4M3FN, Float8E8M0FNU, Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

from .. import mask as _mask
from .. import softmax as _softmax
from .. import varlen as _varlen
from ..compile_cache import compile_entry, launch_on_device
from ..mask import hide_future
from ..quant import mx_layout as _mx_layout
from ..quant.mx_layout import MX_BLOCK, MX_TILE, SF_CHUNK_BYTES, MxForwardOperands, sf_slots
from ..sm90.primitives import (
    ARG_BF16,
    ARG_F8,
    ARG_F32,
    ARG_I32,
    SHARED_SOURCE_FILES,
    as_f32,
    cvt_bf16x2,
    cvt_e4m3x4,
    e4m3x2_to_bf16x2,
    f32_bits,
    smem_word_index,
    st_global_v4,
    st_shared_v4,
    xor_walk,
)
from ..softmax import LN2, LOG2E, fmax_chains, online_max, row_lse
from ..validation import check_kernel_tensors, int32_cu_seqlens
from ..varlen import document_aligned_starts
from . import plan as _plan
from .plan import O_STAGES, P_STAGES, S_STAGES, SF_CHUNKS, TMEM_COLS, fwd_tmem_cols_used, fwd_tmem_plan

SOURCE_FILES = (Path(__file__).resolve(), Path(_mx_layout.__file__).resolve(), Path(_plan.__file__).resolve(),
                *(Path(m.__file__).resolve() for m in (_mask, _softmax, _varlen)), *SHARED_SOURCE_FILES)

E4M3_EMAX = 8  # an E8M0 block scale is 2^(floor(log2 amax) - 8): amax / scale in [256, 512), cast saturates at 448
SOFTMAX_THREADS = 128
MMA_WARP = 4
LOAD_WARP = 5
NUM_THREADS = 192
TMEM_FREE_BARRIER = 2  # named barrier 1 is the tensor-memory allocator's
ARG_SF = ("ptr", Int32, 16)  # scale chunks: 16-byte aligned words for TMA


@dataclass(frozen=True)
class FwdSm100Config:
    """Compile-time shape of the sm_100a MXFP8 forward."""

    head_dim: int = 128
    qhead_per_kvhead: int = 1
    kv_stages: int = 2

    def __post_init__(self):
        if self.head_dim != 128:
            raise ValueError(f"FwdSm100Config.head_dim must be 128 (one scale chunk per tile), got {self.head_dim}")
        if self.qhead_per_kvhead < 1:
            raise ValueError(f"FwdSm100Config.qhead_per_kvhead must be >= 1, got {self.qhead_per_kvhead}")
        if self.kv_stages not in (1, 2):
            raise ValueError(f"FwdSm100Config.kv_stages must be 1 or 2 (shared memory), got {self.kv_stages}")


def smem_bytes(cfg: FwdSm100Config) -> int:
    """Shared memory a CTA asks for: fp8 Q and K/V stages, bf16 diagonal Q (converted in the kernel), K, V,
    scale chunks, barriers."""
    t, d = MX_TILE, cfg.head_dim
    fp8 = t * d * (1 + 2 * cfg.kv_stages)
    bf16 = 3 * 2 * t * d
    sf = SF_CHUNK_BYTES * (1 + 2 * cfg.kv_stages + 2)
    return fp8 + bf16 + sf + 1024


def tmem_columns(cfg: FwdSm100Config) -> int:
    """Tensor-memory columns the kernel uses (plan.py; it allocates TMEM_COLS)."""
    return fwd_tmem_cols_used(cfg.head_dim)


class FlamiaFwdSm100:
    def __init__(self, config: FwdSm100Config):
        self.cfg = config
        self.D = config.head_dim
        self.tile = MX_TILE
        self.group = config.qhead_per_kvhead
        self.stages = config.kv_stages
        self.kb = self.D // MX_BLOCK  # scale blocks along D (S) and along a key tile (P V): 4 each
        # bytes TMA brings per stage: a tile's e4m3 codes and its scale chunk (Q, K and V alike);
        # the diagonal's bf16 tiles twice the codes' bytes each
        self.tile_bytes = self.tile * self.D + SF_CHUNK_BYTES
        self.bf16_tile_bytes = 2 * self.tile * self.D

    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer,
        qsf_ptr: cute.Pointer,
        k_ptr: cute.Pointer,
        ksf_ptr: cute.Pointer,
        v_ptr: cute.Pointer,
        vsf_ptr: cute.Pointer,
        kd_ptr: cute.Pointer,
        vd_ptr: cute.Pointer,
        cu_ptr: cute.Pointer,
        o_ptr: cute.Pointer,
        lse_ptr: cute.Pointer,
        T: Int32,
        slots: Int32,
        num_kv_heads: Int32,
        num_docs: Int32,
        grid_x: Int32,
        scale_log2: Float32,
        stream: cuda.CUstream,
    ):
        D, tn = self.D, self.tile
        H = num_kv_heads * self.group
        hd = cute.assume(H * D, divby=D)
        khd = cute.assume(num_kv_heads * D, divby=D)
        # (token, d, head): d contiguous, K-major for S = Q K^T
        mQ = cute.make_tensor(q_ptr, cute.make_layout((T, D, H), stride=(hd, 1, D)))
        mK = cute.make_tensor(k_ptr, cute.make_layout((T, D, num_kv_heads), stride=(khd, 1, D)))
        mKd = cute.make_tensor(kd_ptr, cute.make_layout((T, D, num_kv_heads), stride=(khd, 1, D)))
        # V (d, token, head), d contiguous: the MN-major B of O = P V, e4m3 codes and the diagonal's bf16
        mV = cute.make_tensor(v_ptr, cute.make_layout((D, T, num_kv_heads), stride=(1, khd, D)))
        mVd = cute.make_tensor(vd_ptr, cute.make_layout((D, T, num_kv_heads), stride=(1, khd, D)))
        # scale chunks (word, slot, head): 128 words = 512 bytes per tile
        cw = SF_CHUNK_BYTES // 4
        mQsf = cute.make_tensor(qsf_ptr, cute.make_layout((cw, slots, H), stride=(1, cw, slots * cw)))
        mKsf = cute.make_tensor(ksf_ptr, cute.make_layout((cw, slots, num_kv_heads), stride=(1, cw, slots * cw)))
        mVsf = cute.make_tensor(vsf_ptr, cute.make_layout((cw, slots, num_kv_heads), stride=(1, cw, slots * cw)))
        mO = cute.make_tensor(o_ptr, cute.make_layout((T, D, H), stride=(hd, 1, D)))
        mLSE = cute.make_tensor(lse_ptr, cute.make_layout((T, H), stride=(1, T)))
        mCu = cute.make_tensor(cu_ptr, cute.make_layout(num_docs + 1))

        K_MAJOR, MN_MAJOR = OperandMajorMode.K, OperandMajorMode.MN
        one_cta = tcgen05.CtaGroup.ONE
        qk_mma = sm100_utils.make_blockscaled_trivial_tiled_mma(
            Float8E4M3FN, Float8E4M3FN, K_MAJOR, K_MAJOR, Float8E8M0FNU, MX_BLOCK, one_cta, (tn, tn))
        # P comes from tensor memory (written over S), always K-major; V MN-major (its scale chunk's
        # layout does not depend on the operand's major mode)
        pv_mma = sm100_utils.make_blockscaled_trivial_tiled_mma(
            Float8E4M3FN, Float8E4M3FN, K_MAJOR, MN_MAJOR, Float8E8M0FNU, MX_BLOCK, one_cta, (tn, D),
            tcgen05.OperandSource.TMEM)
        qk_bf = sm100_utils.make_trivial_tiled_mma(BFloat16, BFloat16, K_MAJOR, K_MAJOR, Float32, one_cta, (tn, tn))
        pv_bf = sm100_utils.make_trivial_tiled_mma(BFloat16, BFloat16, K_MAJOR, MN_MAJOR, Float32, one_cta, (tn, D),
                                                   tcgen05.OperandSource.TMEM)
        qk_tiler = (tn, tn, D)
        pv_tiler = (tn, D, tn)
        st = self.stages
        sQ_l = sm100_utils.make_smem_layout_a(qk_mma, qk_tiler, Float8E4M3FN, 1)
        sK_l = sm100_utils.make_smem_layout_b(qk_mma, qk_tiler, Float8E4M3FN, st)
        sV_l = sm100_utils.make_smem_layout_b(pv_mma, pv_tiler, Float8E4M3FN, st)
        sQd_l = sm100_utils.make_smem_layout_a(qk_bf, qk_tiler, BFloat16, 1)
        sKd_l = sm100_utils.make_smem_layout_b(qk_bf, qk_tiler, BFloat16, 1)
        sVd_l = sm100_utils.make_smem_layout_b(pv_bf, pv_tiler, BFloat16, 1)
        # P's layouts in tensor memory (the A operand of P V), as the MMAs read them
        tP_l = sm100_utils.make_smem_layout_a(pv_mma, pv_tiler, Float8E4M3FN, 1)
        tPd_l = sm100_utils.make_smem_layout_a(pv_bf, pv_tiler, BFloat16, 1)
        sfQ_l = blockscaled_utils.make_smem_layout_sfa(qk_mma, qk_tiler, MX_BLOCK, 1)
        sfK_l = blockscaled_utils.make_smem_layout_sfb(qk_mma, qk_tiler, MX_BLOCK, st)
        sfP_l = blockscaled_utils.make_smem_layout_sfa(pv_mma, pv_tiler, MX_BLOCK, 2)
        sfV_l = blockscaled_utils.make_smem_layout_sfb(pv_mma, pv_tiler, MX_BLOCK, st)

        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(one_cta)

        def slice0(layout):
            return cute.slice_(layout, (None, None, None, 0))

        tma_q, tQ = cute.nvgpu.make_tiled_tma_atom_A(g2s, mQ, slice0(sQ_l), qk_tiler, qk_mma)
        tma_k, tK = cute.nvgpu.make_tiled_tma_atom_B(g2s, mK, slice0(sK_l), qk_tiler, qk_mma)
        tma_v, tV = cute.nvgpu.make_tiled_tma_atom_B(g2s, mV, slice0(sV_l), pv_tiler, pv_mma)
        tma_kd, tKd = cute.nvgpu.make_tiled_tma_atom_B(g2s, mKd, slice0(sKd_l), qk_tiler, qk_bf)
        tma_vd, tVd = cute.nvgpu.make_tiled_tma_atom_B(g2s, mVd, slice0(sVd_l), pv_tiler, pv_bf)
        chunk_l = cute.make_layout(cw)
        tma_sq, tSQ = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mQsf, chunk_l, (cw,))
        tma_sk, tSK = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mKsf, chunk_l, (cw,))
        tma_sv, tSV = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mVsf, chunk_l, (cw,))

        @cute.struct
        class SharedStorage:
            q_mbar: cute.struct.MemRange[Int64, 2]
            qd_mbar: cute.struct.MemRange[Int64, 2]
            d_mbar: cute.struct.MemRange[Int64, 2]
            k_mbar: cute.struct.MemRange[Int64, 2 * st]
            v_mbar: cute.struct.MemRange[Int64, 2 * st]
            s_mbar: cute.struct.MemRange[Int64, 2 * S_STAGES]
            p_mbar: cute.struct.MemRange[Int64, 2 * P_STAGES]
            o_mbar: cute.struct.MemRange[Int64, 2 * O_STAGES]
            tmem_holding: Int32
            sQ: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sQ_l)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sK_l)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sV_l)], 1024]
            sQd: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQd_l)], 1024]
            sKd: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sKd_l)], 1024]
            sVd: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sVd_l)], 1024]
            sfQ: cute.struct.Align[cute.struct.MemRange[Float8E8M0FNU, cute.cosize(cute.filter_zeros(sfQ_l))], 128]
            sfK: cute.struct.Align[cute.struct.MemRange[Float8E8M0FNU, cute.cosize(cute.filter_zeros(sfK_l))], 128]
            sfP: cute.struct.Align[cute.struct.MemRange[Float8E8M0FNU, cute.cosize(cute.filter_zeros(sfP_l))], 128]
            sfV: cute.struct.Align[cute.struct.MemRange[Float8E8M0FNU, cute.cosize(cute.filter_zeros(sfV_l))], 128]

        self.shared_storage = SharedStorage
        self.kernel(
            qk_mma, pv_mma, qk_bf, pv_bf,
            tma_q, tQ, tma_k, tK, tma_v, tV, tma_kd, tKd, tma_vd, tVd,
            tma_sq, tSQ, tma_sk, tSK, tma_sv, tSV,
            mO, mLSE, mCu,
            sQ_l, sK_l, sV_l, sQd_l, sKd_l, sVd_l, tP_l, tPd_l, sfQ_l, sfK_l, sfP_l, sfV_l,
            scale_log2,
        ).launch(grid=[grid_x, H, num_docs], block=[NUM_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, qk_bf: cute.TiledMma, pv_bf: cute.TiledMma,
        tma_q: cute.CopyAtom, tQ: cute.Tensor, tma_k: cute.CopyAtom, tK: cute.Tensor,
        tma_v: cute.CopyAtom, tV: cute.Tensor,
        tma_kd: cute.CopyAtom, tKd: cute.Tensor, tma_vd: cute.CopyAtom, tVd: cute.Tensor,
        tma_sq: cute.CopyAtom, tSQ: cute.Tensor, tma_sk: cute.CopyAtom, tSK: cute.Tensor,
        tma_sv: cute.CopyAtom, tSV: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mCu: cute.Tensor,
        sQ_l: cute.ComposedLayout, sK_l: cute.ComposedLayout, sV_l: cute.ComposedLayout,
        sQd_l: cute.ComposedLayout, sKd_l: cute.ComposedLayout, sVd_l: cute.ComposedLayout,
        tP_l: cute.ComposedLayout, tPd_l: cute.ComposedLayout,
        sfQ_l: cute.Layout, sfK_l: cute.Layout, sfP_l: cute.Layout, sfV_l: cute.Layout,
        scale_log2: Float32,
    ):
        tn = self.tile
        bidx, head, doc = cute.arch.block_idx()
        nblk_x, _, _ = cute.arch.grid_dim()
        m_block = nblk_x - 1 - bidx  # longest causal rows first
        doc_start = mCu[doc]
        doc_len = mCu[doc + 1] - doc_start
        if m_block * tn < doc_len:  # the whole CTA leaves before any barrier otherwise
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            tidx, _, _ = cute.arch.thread_idx()
            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            sQ = storage.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)
            sK = storage.sK.get_tensor(sK_l.outer, swizzle=sK_l.inner)
            sV = storage.sV.get_tensor(sV_l.outer, swizzle=sV_l.inner)
            sQd = storage.sQd.get_tensor(sQd_l.outer, swizzle=sQd_l.inner)
            sKd = storage.sKd.get_tensor(sKd_l.outer, swizzle=sKd_l.inner)
            sVd = storage.sVd.get_tensor(sVd_l.outer, swizzle=sVd_l.inner)
            sfQ = storage.sfQ.get_tensor(sfQ_l)
            sfK = storage.sfK.get_tensor(sfK_l)
            sfP = storage.sfP.get_tensor(sfP_l)
            sfV = storage.sfV.get_tensor(sfV_l)
            pipes = self.make_pipelines(storage)
            tmem = cutlass.memory.TmemAllocator(
                storage.tmem_holding.ptr,
                # the MMA warp allocates, the softmax warps read the address: 160 threads
                barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=1, num_threads=SOFTMAX_THREADS + 32),
                allocator_warp_id=MMA_WARP,
            )
            pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
            pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
            kv_head = head // self.group
            n_tiles = m_block + 1
            acc_layouts = self.acc_layouts(qk_mma, pv_mma)
            if warp == LOAD_WARP:
                self.load(
                    (tma_q, tQ, tma_k, tK, tma_v, tV, tma_kd, tKd, tma_vd, tVd,
                     tma_sq, tSQ, tma_sk, tSK, tma_sv, tSV),
                    (qk_mma, pv_mma, qk_bf, pv_bf),
                    (sQ, sK, sV, sKd, sVd, sfQ, sfK, sfV),
                    pipes, mCu, head, kv_head, doc, doc_start, m_block, n_tiles,
                )
            if warp == MMA_WARP:
                tmem.allocate(TMEM_COLS)
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(Float32)
                self.mma(
                    (qk_mma, pv_mma, qk_bf, pv_bf),
                    (sQ, sK, sV, sQd, sKd, sVd, sfQ, sfK, sfP, sfV, tP_l, tPd_l),
                    pipes, tmem_ptr, n_tiles,
                )
                tmem.relinquish_alloc_permit()
                # the softmax warps read O last: wait for them, then free in the allocating warp
                cute.arch.barrier(barrier_id=TMEM_FREE_BARRIER, number_of_threads=SOFTMAX_THREADS + 32)
                tmem.free(tmem_ptr, TMEM_COLS)
            if warp < MMA_WARP:
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(Float32)
                # Q's bf16 MX values once Q's codes and scales have landed (a wait on the TMA's
                # barrier, which the MMA warp consumes: no arrive of its own)
                cute.arch.mbarrier_wait(storage.q_mbar.data_ptr(), 0)
                q_words = (storage.sQ.get_tensor(cute.make_layout(cute.cosize(sQ_l) // 4), dtype=Uint32),
                           storage.sfQ.get_tensor(cute.make_layout(SF_CHUNK_BYTES // 4), dtype=Int32),
                           storage.sQd.get_tensor(cute.make_layout(cute.cosize(sQd_l) // 2), dtype=Uint32))
                self.convert_q(q_words, self.q_conversion_plan(sQ_l, sQd_l), pipes["qd"][0], tidx)
                self.softmax(
                    acc_layouts, sfP, pipes, tmem_ptr, mO, mLSE, head, doc_start, doc_len, m_block,
                    n_tiles, scale_log2, tidx,
                )
                cute.arch.fence_view_async_tmem_load()
                cute.arch.barrier_arrive(barrier_id=TMEM_FREE_BARRIER, number_of_threads=SOFTMAX_THREADS + 32)

    # ------------------------------------------------------------------------------------------
    def make_pipelines(self, storage):
        """Barriers between the roles. TMA -> MMA: q (Q's codes and scales; the softmax warps wait on it
        too), d (the diagonal's bf16 K and V), k, v. MMA -> softmax: s (S in a tensor-memory stage,
        tcgen05.commit), o (a P V finished). softmax -> MMA: qd (Q's bf16 MX values written), p (P and
        its scale chunk written)."""
        thread = pipeline.Agent.Thread
        one = pipeline.CooperativeGroup(thread, 1)
        softmax = pipeline.CooperativeGroup(thread, SOFTMAX_THREADS)

        def tma(stages, tx, mbar):
            return pipeline.PipelineTmaUmma.create(num_stages=stages, producer_group=one, consumer_group=one,
                                                   tx_count=tx, barrier_storage=mbar.data_ptr(),
                                                   defer_sync=True).make_participants()

        def umma_to_softmax(stages, mbar):
            return pipeline.PipelineUmmaAsync.create(num_stages=stages, producer_group=one, consumer_group=softmax,
                                                     barrier_storage=mbar.data_ptr(),
                                                     defer_sync=True).make_participants()

        q = tma(1, self.tile_bytes, storage.q_mbar)
        d = tma(1, 2 * self.bf16_tile_bytes, storage.d_mbar)  # the diagonal's bf16 K and V
        k = tma(self.stages, self.tile_bytes, storage.k_mbar)
        v = tma(self.stages, self.tile_bytes, storage.v_mbar)
        s = umma_to_softmax(S_STAGES, storage.s_mbar)
        o = umma_to_softmax(O_STAGES, storage.o_mbar)
        def softmax_to_umma(stages, mbar):
            return pipeline.PipelineAsyncUmma.create(num_stages=stages, producer_group=softmax, consumer_group=one,
                                                     barrier_storage=mbar.data_ptr(),
                                                     defer_sync=True).make_participants()

        return dict(q=q, d=d, k=k, v=v, s=s, o=o, p=softmax_to_umma(P_STAGES, storage.p_mbar),
                    qd=softmax_to_umma(1, storage.qd_mbar))

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load(self, atoms, mmas, smem, pipes, mCu, head, kv_head, doc, doc_start, m_block, n_tiles):
        """Warp 5: TMA. Document-local tiles: the token coordinate is shifted by the document start
        (Q, K, V: token-major, any start), scale chunks sit at the document's first slot + tile."""
        (tma_q, tQ, tma_k, tK, tma_v, tV, tma_kd, tKd, tma_vd, tVd,
         tma_sq, tSQ, tma_sk, tSK, tma_sv, tSV) = atoms
        qk_mma, pv_mma, qk_bf, pv_bf = mmas
        sQ, sK, sV, sKd, sVd, sfQ, sfK, sfV = smem
        D, tn = self.D, self.tile
        q_prod, d_prod, k_prod, v_prod = pipes["q"][0], pipes["d"][0], pipes["k"][0], pipes["v"][0]
        # the document's first scale-chunk slot, from one pass over cu_seqlens
        (tile_tokens,) = document_aligned_starts(mCu, doc, (MX_TILE,))
        slot0 = tile_tokens // MX_TILE
        one = cute.make_layout(1)

        def a_part(atom, t, mma, s, h):
            g = cute.local_tile(cute.domain_offset((doc_start, 0), t[None, None, h]), (tn, D), (None, 0))
            g = mma.get_slice(0).partition_A(g)
            return cute.nvgpu.cpasync.tma_partition(atom, 0, one, cute.group_modes(s, 0, 3), cute.group_modes(g, 0, 3))

        def b_part(atom, t, mma, s, offset, tile_mn, tile_k, k_tiles: cutlass.Constexpr):
            g = cute.local_tile(cute.domain_offset(offset, t[None, None, kv_head]), (tile_mn, tile_k),
                                (0, None) if k_tiles else (None, 0))
            g = mma.get_slice(0).partition_B(g)
            return cute.nvgpu.cpasync.tma_partition(atom, 0, one, cute.group_modes(s, 0, 3), cute.group_modes(g, 0, 3))

        def chunk_part(atom, t, s, h):
            # the chunk's 512 bytes as 128 words; shared memory: the stage's scale bytes as words
            sw = cute.make_tensor(cute.recast_ptr(s.iterator, dtype=Int32),
                                  cute.make_layout((SF_CHUNK_BYTES // 4, cute.size(s, mode=[3]))))
            g = t[None, None, h]
            return cute.nvgpu.cpasync.tma_partition(atom, 0, one, cute.group_modes(sw, 0, 1), cute.group_modes(g, 0, 1))

        tQs, tQg = a_part(tma_q, tQ, qk_mma, sQ, head)
        tSQs, tSQg = chunk_part(tma_sq, tSQ, sfQ, head)
        tKs, tKg = b_part(tma_k, tK, qk_mma, sK, (doc_start, 0), tn, D, False)
        tKds, tKdg = b_part(tma_kd, tKd, qk_bf, sKd, (doc_start, 0), tn, D, False)
        tSKs, tSKg = chunk_part(tma_sk, tSK, sfK, kv_head)
        tVs, tVg = b_part(tma_v, tV, pv_mma, sV, (0, doc_start), D, tn, True)
        tVds, tVdg = b_part(tma_vd, tVd, pv_bf, sVd, (0, doc_start), D, tn, True)
        tSVs, tSVg = chunk_part(tma_sv, tSV, sfV, kv_head)

        h = q_prod.acquire_and_advance()
        cute.copy(tma_q, tQg[None, m_block], tQs[None, 0], tma_bar_ptr=h.barrier)
        cute.copy(tma_sq, tSQg[None, slot0 + m_block], tSQs[None, 0], tma_bar_ptr=h.barrier)
        h = d_prod.acquire_and_advance()
        cute.copy(tma_kd, tKdg[None, m_block], tKds[None, 0], tma_bar_ptr=h.barrier)
        cute.copy(tma_vd, tVdg[None, m_block], tVds[None, 0], tma_bar_ptr=h.barrier)
        kv_parts = (tKs, tKg, tSKs, tSKg, tVs, tVg, tSVs, tSVg)
        for i in cutlass.range(n_tiles, unroll=1):
            k_prod, v_prod = self.load_kv(atoms, kv_parts, k_prod, v_prod, m_block - i, slot0)  # diagonal first

    @cute.jit
    def load_kv(self, atoms, kv_parts, k_prod, v_prod, n, slot0):
        """Key tile n: K's codes and scale chunk, then V's; returns the (rebound) pipelines."""
        (_, _, tma_k, _, tma_v, _, _, _, _, _, _, _, tma_sk, _, tma_sv, _) = atoms
        tKs, tKg, tSKs, tSKg, tVs, tVg, tSVs, tSVg = kv_parts
        h = k_prod.acquire_and_advance()
        cute.copy(tma_k, tKg[None, n], tKs[None, h.index], tma_bar_ptr=h.barrier)
        cute.copy(tma_sk, tSKg[None, slot0 + n], tSKs[None, h.index], tma_bar_ptr=h.barrier)
        h = v_prod.acquire_and_advance()
        cute.copy(tma_v, tVg[None, n], tVs[None, h.index], tma_bar_ptr=h.barrier)
        cute.copy(tma_sv, tSVg[None, slot0 + n], tSVs[None, h.index], tma_bar_ptr=h.barrier)
        return k_prod, v_prod

    # ------------------------------------------------------------------------------------------
    def tmem_tensors(self, mmas, tP_l, tPd_l, tmem_ptr):
        """Tensor-memory views: S stages (fp32, 128 columns each), O, P over each stage (e4m3 codes in
        32 columns; the diagonal's bf16 P in the second stage), and where the scale chunks go."""
        qk_mma, pv_mma, qk_bf, pv_bf = mmas
        tn, D = self.tile, self.D
        tS, tO = self.tmem_views(self.acc_layouts(qk_mma, pv_mma), tmem_ptr)
        p_frag = pv_mma.make_fragment_A(cute.make_tensor(tS[0].iterator, tP_l.outer))[None, None, None, 0]
        pd_frag = pv_bf.make_fragment_A(cute.make_tensor(tS[1].iterator, tPd_l.outer))[None, None, None, 0]
        tP = cute.make_tensor(cute.recast_ptr(tmem_ptr, dtype=p_frag.element_type), p_frag.layout)
        tPd = cute.make_tensor(cute.recast_ptr(tmem_ptr + tn, dtype=pd_frag.element_type), pd_frag.layout)
        sf_col = 2 * tn + D
        return tS, tO, tP, tPd, sf_col

    def sf_tmem(self, mma, tiler, sf_layout, tmem_ptr, col, a_side: bool):
        """A scale chunk's tensor-memory tensor at column `col`, and the column after it."""
        make = blockscaled_utils.make_tmem_layout_sfa if a_side else blockscaled_utils.make_tmem_layout_sfb
        layout = make(mma, tiler, MX_BLOCK, cute.slice_(sf_layout, (None, None, None, 0)))
        t = cute.make_tensor(cute.recast_ptr(tmem_ptr + col, dtype=Float8E8M0FNU), layout)
        return t, col + tcgen05.find_tmem_tensor_col_offset(t)

    @staticmethod
    def s2t(sf_smem, sf_tmem):
        """tcgen05.cp of a staged shared-memory scale chunk into tensor memory: (copy, source by stage, dest)."""
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), Float8E8M0FNU)
        dst = cute.filter_zeros(sf_tmem)
        tiled = tcgen05.make_s2t_copy(atom, dst)
        thr = tiled.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(tiled, thr.partition_S(cute.filter_zeros(sf_smem)))
        return tiled, src, thr.partition_D(dst)

    def stage(self, t, index):
        """Tensor-memory tensor t moved to S stage `index` (128 columns apart)."""
        return cute.make_tensor(t.iterator + self.tile * index, t.layout)

    @staticmethod
    def scaled_gemm(mma, acc, a, b, sfa, sfb, accumulate):
        """acc (+)= a b over the tile's four 32-element blocks, each with its scale columns."""
        for kb in range(cute.size(a, mode=[2])):  # plain Python: unrolled while tracing
            mma.set(tcgen05.Field.ACCUMULATE, accumulate if kb == 0 else True)
            mma.set(tcgen05.Field.SFA, sfa[None, None, kb].iterator)
            mma.set(tcgen05.Field.SFB, sfb[None, None, kb].iterator)
            cute.gemm(mma, acc, a[None, None, kb], b[None, None, kb], acc)

    @staticmethod
    def plain_gemm(mma, acc, a, b, accumulate):
        for kb in range(cute.size(a, mode=[2])):
            mma.set(tcgen05.Field.ACCUMULATE, accumulate if kb == 0 else True)
            cute.gemm(mma, acc, a[None, None, kb], b[None, None, kb], acc)

    @cute.jit
    def issue_s(self, qk_mma, cp_k, k_cons, s_prod, tS, rQ, rK, tSFQ, tSFK):
        """Block-scaled S = Q K^T of the next K tile into the next S stage. Returns what it changed: the
        advanced pipelines and the MMA (its fields are set), for the caller to rebind: a dynamic if or
        loop carries only the names assigned in it."""
        cpK, cpKs, cpKt = cp_k
        kh = k_cons.wait_and_advance()
        cute.copy(cpK, cpKs[None, None, None, None, kh.index], cpKt)
        sh = s_prod.acquire_and_advance()
        self.scaled_gemm(qk_mma, self.stage(tS[0], sh.index), rQ[None, None, None, 0], rK[None, None, None, kh.index],
                         tSFQ, tSFK, False)
        sh.commit()
        kh.release()
        return k_cons, s_prod, qk_mma

    @cute.jit
    def mma(self, mmas, smem, pipes, tmem_ptr, n_tiles):
        """Warp 4: the diagonal's S = Q K^T (block-scaled and bf16) and its P V, then per tile S of
        the next tile and O += P V (block-scaled)."""
        qk_mma, pv_mma, qk_bf, pv_bf = mmas
        sQ, sK, sV, sQd, sKd, sVd, sfQ, sfK, sfP, sfV, tP_l, tPd_l = smem
        tn, D = self.tile, self.D
        q_cons, d_cons, k_cons, v_cons = pipes["q"][1], pipes["d"][1], pipes["k"][1], pipes["v"][1]
        s_prod, o_prod, p_cons, qd_cons = pipes["s"][0], pipes["o"][0], pipes["p"][1], pipes["qd"][1]
        tS, tO, tP, tPd, col = self.tmem_tensors(mmas, tP_l, tPd_l, tmem_ptr)
        sf_cols = [col]  # each chunk's first column, then the end
        tSFQ, col = self.sf_tmem(qk_mma, (tn, tn, D), sfQ.layout, tmem_ptr, col, True)
        sf_cols.append(col)
        tSFK, col = self.sf_tmem(qk_mma, (tn, tn, D), sfK.layout, tmem_ptr, col, False)
        sf_cols.append(col)
        tSFP, col = self.sf_tmem(pv_mma, (tn, D, tn), sfP.layout, tmem_ptr, col, True)
        sf_cols.append(col)
        tSFV, col = self.sf_tmem(pv_mma, (tn, D, tn), sfV.layout, tmem_ptr, col, False)
        sf_cols.append(col)
        # the columns are static: the layouts must be plan.py's (the hazard model and budgets use it)
        plan = fwd_tmem_plan(D)
        if cutlass.const_expr(sf_cols != [plan[n][0] for n in SF_CHUNKS] + [plan["SFV"][1]] or col > TMEM_COLS):
            raise ValueError(f"tensor memory: scale chunks at columns {sf_cols}, not plan.py's {plan}")
        cpQ, cpQs, cpQt = self.s2t(sfQ, tSFQ)
        cpK, cpKs, cpKt = self.s2t(sfK, tSFK)
        cpP, cpPs, cpPt = self.s2t(sfP, tSFP)
        cpV, cpVs, cpVt = self.s2t(sfV, tSFV)
        rQ, rK = qk_mma.make_fragment_A(sQ), qk_mma.make_fragment_B(sK)
        rV = pv_mma.make_fragment_B(sV)
        rQd, rKd = qk_bf.make_fragment_A(sQd), qk_bf.make_fragment_B(sKd)
        rVd = pv_bf.make_fragment_B(sVd)
        tSd = cute.make_tensor(tS[0].iterator, qk_bf.make_fragment_C(qk_bf.partition_shape_C((tn, tn))).layout)
        tOd = cute.make_tensor(tO.iterator, pv_bf.make_fragment_C(pv_bf.partition_shape_C((tn, D))).layout)

        q_cons.wait_and_advance()
        cute.copy(cpQ, cpQs[None, None, None, None, 0], cpQt)

        # the diagonal tile: block-scaled S in stage 0, bf16 S in stage 1
        k_cons, s_prod, qk_mma = self.issue_s(qk_mma, (cpK, cpKs, cpKt), k_cons, s_prod, tS, rQ, rK, tSFQ, tSFK)
        d_cons.wait_and_advance()
        qd_cons.wait_and_advance()  # Q's bf16 MX values, converted by the softmax warps
        sh = s_prod.acquire_and_advance()
        self.plain_gemm(qk_bf, self.stage(tSd, sh.index), rQd[None, None, None, 0], rKd[None, None, None, 0], False)
        sh.commit()
        # P V of the diagonal before the next S: the diagonal holds both S stages (its P codes in
        # stage 0, its bf16 P in stage 1), and tile 1's S goes to stage 0 once the softmax releases
        # it; tcgen05 ops run in issue order, so issued first, that S would overwrite the P this P V
        # reads (any order that puts that S in stage 0 must wait for this P V).
        # Later, S of tile i + 1 goes out before P V of tile i (the softmax of i + 1 runs under that
        # P V): its stage held tile i - 1's P, read by the P V issued before it (hazards.py checks it).
        pv_args = ((cpP, cpPs, cpPt, cpV, cpVs, cpVt), tS[0], tP, tO, tOd, tPd, rV, rVd, tSFP, tSFV)
        v_cons, o_prod, p_cons, pv_mma, pv_bf = self.issue_pv(True, pv_mma, pv_bf, v_cons, o_prod, p_cons, pv_args)
        if n_tiles > 1:
            k_cons, s_prod, qk_mma = self.issue_s(qk_mma, (cpK, cpKs, cpKt), k_cons, s_prod, tS, rQ, rK, tSFQ, tSFK)
        for i in cutlass.range(1, n_tiles, unroll=1):
            if i + 1 < n_tiles:
                k_cons, s_prod, qk_mma = self.issue_s(qk_mma, (cpK, cpKs, cpKt), k_cons, s_prod, tS, rQ, rK, tSFQ, tSFK)
            v_cons, o_prod, p_cons, pv_mma, pv_bf = self.issue_pv(False, pv_mma, pv_bf, v_cons, o_prod, p_cons, pv_args)

    @cute.jit
    def issue_pv(self, diag: cutlass.Constexpr, pv_mma, pv_bf, v_cons, o_prod, p_cons, pv_args):
        """O (+)= P V for the tile whose P the softmax warps just wrote (block-scaled; the diagonal
        tile, the first, overwrites O and adds its own blocks' bf16 P V). Returns the advanced
        pipelines and the MMAs (fields set) for the caller to rebind, as issue_s."""
        cps, tS0, tP, tO, tOd, tPd, rV, rVd, tSFP, tSFV = pv_args
        cpP, cpPs, cpPt, cpV, cpVs, cpVt = cps
        vh = v_cons.wait_and_advance()
        oh = o_prod.acquire_and_advance()
        ph = p_cons.wait_and_advance()
        cute.copy(cpP, cpPs[None, None, None, None, ph.index], cpPt)
        cute.copy(cpV, cpVs[None, None, None, None, vh.index], cpVt)
        p_stage = cute.make_tensor(cute.recast_ptr(tS0.iterator + self.tile * ph.index, dtype=tP.element_type),
                                   tP.layout)
        self.scaled_gemm(pv_mma, tO, p_stage, rV[None, None, None, vh.index], tSFP, tSFV, not diag)
        ph.release()
        if cutlass.const_expr(diag):
            ph2 = p_cons.wait_and_advance()  # the diagonal's bf16 P, in S stage 1
            self.plain_gemm(pv_bf, tOd, tPd, rVd[None, None, None, 0], True)
            ph2.release()
        oh.commit()
        vh.release()
        return v_cons, o_prod, p_cons, pv_mma, pv_bf

    # ------------------------------------------------------------------------------------------
    def row_copies(self, t, columns: int, store: bool):
        """tcgen05.ld / st of `columns` fp32 columns of tensor-memory tensor t, thread r <-> row r."""
        op = tcgen05.copy.St32x32bOp if store else tcgen05.copy.Ld32x32bOp
        atom = cute.make_copy_atom(op(tcgen05.copy.Repetition(columns)), Float32)
        view = cute.make_tensor(t.iterator, cute.composition(t.layout, cute.make_layout((self.tile, columns))))
        tiled = tcgen05.make_tmem_copy(atom, view)
        return tiled, view

    def q_conversion_plan(self, sQ_l, sQd_l):
        """Trace time: convert_q's walks over the swizzled tiles (primitives.xor_walk, checked for every
        thread): thread t reads the 32 code words of Q's row t (word j: head dims 4 j .. 4 j + 3) and
        writes the 16 16-byte chunks of bf16 row t (chunk c: head dims 8 c .. 8 c + 7). A row's head dim
        k sits at ((row, k % atom), 0, k // atom, 0) of both layouts (tile_to_mma_shape: the MMA's K atom
        of 32 bytes, then the K tiles; checked)."""
        tn, D = self.tile, self.D

        def coord(layout, elem_bytes):
            atom = 32 // elem_bytes
            if cute.size(layout.outer, mode=[0]) != tn * atom or cute.size(layout.outer) != tn * D:
                raise ValueError(f"convert_q: unexpected shared-memory layout {layout}")
            return lambda t, j: ((t, j % atom), 0, j // atom, 0)

        q_at, qd_at = coord(sQ_l, 1), coord(sQd_l, 2)

        def src(t, j):
            return q_at(t, 4 * j)

        def dst(t, c):
            return qd_at(t, 8 * c)

        return (sQ_l, src, xor_walk(sQ_l, src, 1, tn, D // 4)), (sQd_l, dst, xor_walk(sQd_l, dst, 2, tn, D // 8))

    @cute.jit
    def convert_q(self, words, plan, qd_prod, tidx):
        """Row tidx of the diagonal's bf16 Q into sQd: Q's codes times their E8M0 block scales, exact in
        bf16 (quant.mx_layout), for the MMA warp's bf16 S; then the qd barrier. Q's codes and scale
        chunk have landed (the caller waited on the TMA's barrier)."""
        sQ_w, sfQ_w, sQd_w = words
        (sQ_l, src, (sx, sa)), (sQd_l, dst, (dx, da)) = plan
        h = qd_prod.acquire_and_advance()
        sf = sfQ_w[(tidx % 32) * 4 + tidx // 32]  # the row's four block scales (quant.mx_layout.sf_byte_offset)
        s0 = smem_word_index(sQ_l, src(tidx, 0), 1)
        d0 = smem_word_index(sQd_l, dst(tidx, 0), 2)
        base = sQd_w.iterator.toint()
        for c in cutlass.range_constexpr(self.D // 8):
            sc = as_f32(((sf >> (8 * (8 * c // MX_BLOCK))) & 0xFF) << 23)
            x = [sQ_w[(s0 ^ sx[j]) + sa[j]] for j in (2 * c, 2 * c + 1)]
            st_shared_v4(base + 4 * ((d0 ^ dx[c]) + da[c]),
                         [e4m3x2_to_bf16x2(x[j // 2], j % 2 == 1, sc) for j in range(4)])
        cute.arch.fence_view_async_shared()  # generic-proxy writes, read by tcgen05.mma
        h.commit()

    @cute.jit
    def softmax(self, acc_layouts, sfP, pipes, tmem_ptr, mO, mLSE, head, doc_start, doc_len, m_block, n_tiles,
                scale_log2, tidx):
        """Warps 0-3: thread `tidx` owns query row tidx of the block (tensor-memory lane tidx). The
        diagonal tile first (masked, its own-block pairs from the bf16 S), then the tiles below it."""
        s_cons, o_cons, p_prod = pipes["s"][1], pipes["o"][1], pipes["p"][0]
        tS, tO = self.tmem_views(acc_layouts, tmem_ptr)
        stats = (-Float32.inf, Float32(0.0))
        stats, s_cons, o_cons, p_prod = self.softmax_tile(
            True, stats, tS[0], tO, sfP, s_cons, o_cons, p_prod, scale_log2, tidx)
        for _ in cutlass.range(1, n_tiles, unroll=1):
            stats, s_cons, o_cons, p_prod = self.softmax_tile(
                False, stats, tS[0], tO, sfP, s_cons, o_cons, p_prod, scale_log2, tidx)
        oh = o_cons.wait_and_advance()  # the last P V
        self.store_o(tO, stats, mO, mLSE, head, doc_start, doc_len, m_block, tidx)
        oh.release()

    @cute.jit
    def softmax_tile(self, diag: cutlass.Constexpr, stats, tS0, tO, sfP, s_cons, o_cons, p_prod, scale_log2, tidx):
        """One key tile of row tidx: S -> online softmax -> O rescale -> P (e4m3 codes over S, E8M0
        scales into the stage's shared chunk; on the diagonal the own block's P in bf16 instead)."""
        tn, nkb = self.tile, self.kb
        row = tidx
        own = row // MX_BLOCK  # the row's own 32-key block on the diagonal tile
        m_run, l_run = stats
        ld32, view32 = self.row_copies(tS0, 32, False)
        thr_ld = ld32.get_slice(tidx)
        frag = cute.make_rmem_tensor(thr_ld.partition_D(cute.make_identity_tensor((tn, 32))).shape, Float32)
        x = cute.make_rmem_tensor((tn,), Float32)
        sh = s_cons.wait_and_advance()
        for c in cutlass.range_constexpr(nkb):
            src = cute.make_tensor(tS0.iterator + tn * sh.index + 32 * c, view32.layout)
            cute.copy(ld32, thr_ld.partition_S(src), frag)
            cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld: the registers are not valid before it
            for j in cutlass.range_constexpr(32):
                x[32 * c + j] = frag[j] * scale_log2
        sh_bf = sh
        if cutlass.const_expr(diag):
            # own-block pairs from the bf16 S; keys after the query masked (the only masked keys:
            # off the diagonal every key precedes every query, and a valid row's keys end with it)
            sh_bf = s_cons.wait_and_advance()
            # a warp's 32 rows share their own block (own = the warp index): one 32-column load
            src = cute.make_tensor(tS0.iterator + tn * sh_bf.index + 32 * own, view32.layout)
            cute.copy(ld32, thr_ld.partition_S(src), frag)
            cute.arch.fence_view_async_tmem_load()
            for c in cutlass.range_constexpr(nkb):
                for j in cutlass.range_constexpr(32):
                    key = 32 * c + j
                    v = cutlass.select_(own == c, frag[j] * scale_log2, x[key])
                    x[key] = hide_future(key, row, v, -Float32.inf)  # the causal mask (mask.py)
        m_new, m_safe, alpha = online_max(m_run, fmax_chains([x[j] for j in range(tn)]))  # exact in any order
        for j in cutlass.range_constexpr(tn):
            x[j] = cute.math.exp2(x[j] - m_safe, fastmath=True)
        # four interleaved partial sums (the emulator sums in torch's order: fp32 rounding only)
        part = [x[j] for j in range(4)]
        for j in cutlass.range_constexpr(4, tn):
            part[j % 4] = part[j % 4] + x[j]
        psum = (part[0] + part[1]) + (part[2] + part[3])
        l_run = l_run * alpha + psum
        if cutlass.const_expr(not diag):
            # the previous P V has finished: O *= alpha before this tile's P V adds to it (the
            # diagonal tile is the first: its P V overwrites O)
            oh = o_cons.wait_and_advance()
            self.rescale_o(tO, alpha, tidx)
            oh.release()
        ph = p_prod.acquire_and_advance()
        st8, view8 = self.row_copies(tS0, 8, True)
        thr_st8 = st8.get_slice(tidx)
        codes = cute.make_rmem_tensor(thr_st8.partition_S(cute.make_identity_tensor((tn, 8))).shape, Float32)
        sf = Int32(0)
        for c in cutlass.range_constexpr(nkb):
            amax = fmax_chains([x[MX_BLOCK * c + j] for j in range(MX_BLOCK)])
            # E8M0 of 2^(floor(log2 amax) - 8), at least 2^-126 (biased 1), and 1 / scale, exactly
            biased = cutlass.max(((f32_bits(amax) >> 23) & 0xFF) - E4M3_EMAX, Int32(1))
            inv = as_f32((254 - biased) << 23)
            for w in cutlass.range_constexpr(MX_BLOCK // 4):
                b0 = MX_BLOCK * c + 4 * w
                code = cvt_e4m3x4(x[b0] * inv, x[b0 + 1] * inv, x[b0 + 2] * inv, x[b0 + 3] * inv)
                if cutlass.const_expr(diag):
                    code = cutlass.select_(own == c, Uint32(0), code)  # the own block goes in bf16
                codes[w] = as_f32(code)
            if cutlass.const_expr(diag):
                biased = cutlass.select_(own == c, Int32(127), biased)
            sf = sf | (biased << (8 * c))
            # a 32-key block's codes are 8 columns of P
            dst = cute.make_tensor(tS0.iterator + tn * ph.index + 8 * c, view8.layout)
            cute.copy(st8, codes, thr_st8.partition_D(dst))
        # the row's four scale bytes: one word of the stage's chunk (quant.mx_layout.sf_byte_offset)
        sfP_words = cute.make_tensor(cute.recast_ptr(sfP.iterator, dtype=Int32),
                                     cute.make_layout((SF_CHUNK_BYTES // 4, 2)))
        sfP_words[(row % 32) * 4 + row // 32, ph.index] = sf
        cute.arch.fence_view_async_tmem_store()
        cute.arch.fence_view_async_shared()  # the chunk is read by tcgen05.cp (async proxy)
        ph.commit()
        sh.release()
        if cutlass.const_expr(diag):
            # the own block's P in bf16 (zeros elsewhere) over the second stage: 16 columns per block
            ph2 = p_prod.acquire_and_advance()
            st16, view16 = self.row_copies(tS0, 16, True)
            thr_st16 = st16.get_slice(tidx)
            pairs = cute.make_rmem_tensor(thr_st16.partition_S(cute.make_identity_tensor((tn, 16))).shape, Float32)
            for c in cutlass.range_constexpr(nkb):
                for w in cutlass.range_constexpr(MX_BLOCK // 2):
                    key = MX_BLOCK * c + 2 * w
                    pairs[w] = as_f32(cutlass.select_(own == c, cvt_bf16x2(x[key], x[key + 1]), Uint32(0)))
                dst = cute.make_tensor(tS0.iterator + tn * ph2.index + 16 * c, view16.layout)
                cute.copy(st16, pairs, thr_st16.partition_D(dst))
            cute.arch.fence_view_async_tmem_store()
            ph2.commit()
            sh_bf.release()
        return (m_new, l_run), s_cons, o_cons, p_prod

    def acc_layouts(self, qk_mma, pv_mma):
        """Tensor-memory layouts of S and O, taken before the MMA warp sets fields on the MMAs."""
        tn, D = self.tile, self.D
        return (qk_mma.make_fragment_C(qk_mma.partition_shape_C((tn, tn))).layout,
                pv_mma.make_fragment_C(pv_mma.partition_shape_C((tn, D))).layout)

    def tmem_views(self, acc_layouts, tmem_ptr):
        """The S stages (fp32, 128 columns each) and O in tensor memory."""
        s_layout, o_layout = acc_layouts
        tS = [cute.make_tensor(tmem_ptr + self.tile * i, s_layout) for i in range(S_STAGES)]
        return tS, cute.make_tensor(tmem_ptr + 2 * self.tile, o_layout)

    @cute.jit
    def rescale_o(self, tO, alpha, tidx):
        chunk = 32
        ld, view = self.row_copies(tO, chunk, False)
        st, _ = self.row_copies(tO, chunk, True)
        thr_ld, thr_st = ld.get_slice(tidx), st.get_slice(tidx)
        frag = cute.make_rmem_tensor(thr_ld.partition_D(cute.make_identity_tensor((self.tile, chunk))).shape, Float32)
        for c in cutlass.range_constexpr(self.D // chunk):
            t = cute.make_tensor(tO.iterator + chunk * c, view.layout)
            cute.copy(ld, thr_ld.partition_S(t), frag)
            cute.arch.fence_view_async_tmem_load()
            for j in cutlass.range_constexpr(chunk):
                frag[j] = frag[j] * alpha
            cute.copy(st, frag, thr_st.partition_D(t))
        cute.arch.fence_view_async_tmem_store()

    @cute.jit
    def store_o(self, tO, stats, mO, mLSE, head, doc_start, doc_len, m_block, tidx):
        """O / l in bf16, 16-byte stores of the thread's own row; LSE = ln2 (m + log2 l)."""
        chunk = 32
        D = self.D
        m_run, l_run = stats
        q_local = m_block * self.tile + tidx
        f = Float32(0.0)
        lse = -Float32.inf
        if l_run > Float32(0.0):
            f = Float32(1.0) / l_run
            lse = row_lse(m_run, l_run)
        ld, view = self.row_copies(tO, chunk, False)
        thr_ld = ld.get_slice(tidx)
        frag = cute.make_rmem_tensor(thr_ld.partition_D(cute.make_identity_tensor((self.tile, chunk))).shape, Float32)
        row_addr = mO.iterator.toint() + (Int64(doc_start + q_local) * Int64(mO.stride[0]) + Int64(head * D)) * 2
        for c in cutlass.range_constexpr(D // chunk):
            t = cute.make_tensor(tO.iterator + chunk * c, view.layout)
            cute.copy(ld, thr_ld.partition_S(t), frag)
            cute.arch.fence_view_async_tmem_load()
            for g in cutlass.range_constexpr(chunk // 8):
                w = [cvt_bf16x2(frag[8 * g + 2 * j] * f, frag[8 * g + 2 * j + 1] * f) for j in range(4)]
                if q_local < doc_len:
                    st_global_v4(row_addr + 2 * (chunk * c + 8 * g), w)
        if q_local < doc_len:
            mLSE[doc_start + q_local, head] = lse


# ----------------------------------------------------------------------------------------------
# Compile and launch
# ----------------------------------------------------------------------------------------------

ARG_KINDS = (
    ARG_F8, ARG_SF, ARG_F8, ARG_SF, ARG_F8, ARG_SF,  # q, q_sf, k, k_sf, v, v_sf
    ARG_BF16, ARG_BF16,  # k_diag, v_diag
    ARG_I32, ARG_BF16, ARG_F32,  # cu_seqlens, out, lse
    ("i32",), ("i32",), ("i32",), ("i32",), ("i32",), ("f32",),  # T, slots, Hk, docs, grid_x, scale
    ("stream",),
)


def compile_fwd_sm100(config: FwdSm100Config, arch: str = "sm_100a", extra_options: str = "", tvm_ffi: bool = False):
    """cute.compile the forward for `arch` from plain values only (no tensors, no GPU needed)."""
    return compile_entry(FlamiaFwdSm100(config), ARG_KINDS, arch, extra_options, tvm_ffi)


def kernel_artifacts(config: FwdSm100Config, arch: str = "sm_100a", tvm_ffi: bool = False):
    """PTX, cubin, SASS (when nvdisasm exists) and register/stack usage, for tests and inspection."""
    from ..compile_cache import compile_artifacts

    return compile_artifacts(lambda cfg, a, opts: compile_fwd_sm100(cfg, a, opts, tvm_ffi=tvm_ffi), config, arch)


def get_launcher(config: FwdSm100Config, arch: str | None = None, use_tvm_ffi: bool | None = None):
    from ..compile_cache import compile_launcher, target_arch

    return compile_launcher(SOURCE_FILES, config, arch or target_arch(),
                            lambda cfg, a, t: compile_fwd_sm100(cfg, a, tvm_ffi=t), ARG_KINDS, use_tvm_ffi)


def flamia_fwd_sm100(ops: MxForwardOperands, cu_seqlens, max_seqlen: int, softmax_scale: float,
                     config: FwdSm100Config | None = None, poison_outputs: bool = False):
    """Causal MXFP8 attention forward on a Blackwell GPU (sm_100a, sm_103a); returns (out bf16 (T,H,D), lse (H,T)).

    ops: quant.mx_layout.pack_mx_forward_operands(q, k, v, cu_seqlens) on the device. Self-attention
    only (one cu_seqlens, int32, cu_seqlens[-1] == T, not checked: it would synchronize).
    """
    T, H, D = ops.q.shape
    Hk = ops.k.shape[1]
    num_docs = cu_seqlens.numel() - 1
    config = config or FwdSm100Config(head_dim=D, qhead_per_kvhead=max(H // max(Hk, 1), 1))
    if D != config.head_dim or H != Hk * config.qhead_per_kvhead:
        raise ValueError(f"ops: shapes (H={H}, Hk={Hk}, D={D}) do not match {config}")
    dev = ops.q.device
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] != 10:
        raise RuntimeError(f"flamia_fwd_sm100 needs a Blackwell (sm_100) GPU; ops are on {dev}"
                           + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""))
    f8, u8, bf = torch.float8_e4m3fn, torch.uint8, torch.bfloat16
    slots = sf_slots(T, num_docs)
    check_kernel_tensors([
        ("ops.q", ops.q, (T, H, D), f8), ("ops.k", ops.k, (T, Hk, D), f8), ("ops.v", ops.v, (T, Hk, D), f8),
        ("ops.q_sf", ops.q_sf, (H, slots, SF_CHUNK_BYTES), u8), ("ops.k_sf", ops.k_sf, (Hk, slots, SF_CHUNK_BYTES), u8),
        ("ops.v_sf", ops.v_sf, (Hk, slots, SF_CHUNK_BYTES), u8),
        ("ops.k_diag", ops.k_diag, (T, Hk, D), bf), ("ops.v_diag", ops.v_diag, (T, Hk, D), bf),
    ], dev)
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    cu = int32_cu_seqlens(cu_seqlens, dev)
    out = torch.empty(T, H, D, dtype=bf, device=dev)
    lse = torch.empty(H, T, dtype=torch.float32, device=dev)
    if poison_outputs:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    max_m_blocks = (int(max_seqlen) + MX_TILE - 1) // MX_TILE
    if T == 0 or num_docs == 0 or max_m_blocks == 0:
        return out, lse
    launch_on_device(
        get_launcher(config), dev,
        ops.q.data_ptr(), ops.q_sf.data_ptr(), ops.k.data_ptr(), ops.k_sf.data_ptr(), ops.v.data_ptr(),
        ops.v_sf.data_ptr(), ops.k_diag.data_ptr(), ops.v_diag.data_ptr(), cu.data_ptr(),
        out.data_ptr(), lse.data_ptr(), T, slots, Hk, num_docs, max_m_blocks, float(softmax_scale * LOG2E),
    )
    return out, lse


def mxfp8_forward_sm100(q, k, v, cu_seqlens, max_seqlen: int, softmax_scale: float | None = None,
                        config: FwdSm100Config | None = None):
    """Recipe mxfp8's causal forward on a Blackwell GPU from bf16 (T, H, 128) q and (T, Hk, 128) k, v:
    the fused quantization (quantize_mx.py, GPU-tested on the H200) and this kernel (compiled and
    PTX-checked only: no sm_100 GPU has run it). Returns (out bf16, lse fp32 (H, T))."""
    from ..emulator import default_softmax_scale
    from .quantize_mx import quantize_mx_forward

    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 10:
        raise RuntimeError(f"mxfp8_forward_sm100 needs a Blackwell (sm_100) GPU; q is on {q.device}")
    return flamia_fwd_sm100(quantize_mx_forward(q, k, v, cu_seqlens), cu_seqlens, max_seqlen, scale, config)


# ----------------------------------------------------------------------------------------------
# The kernel's algorithm on the CPU (the reference beside the kernel)
# ----------------------------------------------------------------------------------------------

TILE_MODEL_BUGS = (None, "no_own_block_bf16", "p_scale_from_row_max")
# The tile model against emulate_forward(mxfp8): the same codes and scales; they differ by fp32 rounding
# (exp2 of log2-domain scores against exp, summation order), which flips an e4m3 rounding of P now and
# then. Measured: rel L2 <= 9.3e-5, LSE <= 7.6e-6 (tests/test_attention_fwd_sm100.py's sets, two seeds).
TILE_MODEL_REL_L2 = 3e-4
TILE_MODEL_LSE_ABS = 2e-5


def _e8m0_p_scale(amax: torch.Tensor) -> torch.Tensor:
    """P's block scale as the kernel computes it: biased = max(exponent field of amax - 8, 1)."""
    field = (amax.float().view(torch.int32) >> 23) & 0xFF
    return torch.exp2((torch.clamp_min(field - E4M3_EMAX, 1) - 127).float())


def decode_operands(ops: MxForwardOperands, cu_seqlens) -> SimpleNamespace:
    """What the MMAs read, in fp32 (exact): Q and K as codes times their token-row E8M0 scales, V as codes
    times its dim-row scales, the diagonal's bf16 Q as convert_q makes it (Q's values rounded to bf16,
    which holds them exactly), K and V; with the shapes and the int64 cu_seqlens the tile models walk."""
    from ..quant.mx_layout import decode_dim_rows, decode_token_rows

    T, H, D = ops.q.shape
    Hk = ops.k.shape[1]
    cu = cu_seqlens.to(torch.int64).cpu()
    q, k = decode_token_rows(ops.q, ops.q_sf, cu), decode_token_rows(ops.k, ops.k_sf, cu)
    return SimpleNamespace(T=T, H=H, D=D, Hk=Hk, group=H // Hk, cu=cu, q=q, k=k, v=decode_dim_rows(ops.v, ops.v_sf, cu),
                           qd=q.to(torch.bfloat16).float(), kd=ops.k_diag.float(), vd=ops.v_diag.float())


def reference_fwd_sm100(ops: MxForwardOperands, cu_seqlens, softmax_scale: float, bug: str | None = None):
    """What FlamiaFwdSm100 computes, tile by tile in fp32, from the operands it reads (codes and scale
    chunks decoded as the block-scaled MMA does): (out bf16 (T, H, D), lse fp32 (H, T)). Must equal
    emulate_forward(recipe mxfp8) up to fp32 rounding (tests). bug: a deliberate defect for the
    tests' mutation checks (TILE_MODEL_BUGS)."""
    from ..quant.formats import E4M3, cast_to

    if bug not in TILE_MODEL_BUGS:
        raise ValueError(f"bug must be one of {TILE_MODEL_BUGS}, got {bug!r}")
    m = decode_operands(ops, cu_seqlens)
    T, H, D, group, cu, q, k, v, qd, kd, vd = m.T, m.H, m.D, m.group, m.cu, m.q, m.k, m.v, m.qd, m.kd, m.vd
    out = torch.zeros(T, H, D)
    lse = torch.full((H, T), float("-inf"))
    scale_log2 = softmax_scale * LOG2E
    for b in range(cu.numel() - 1):
        s0, L = int(cu[b]), int(cu[b + 1] - cu[b])
        if L == 0:
            continue
        for h in range(H):
            kh = h // group
            for i in range(-(-L // MX_TILE)):
                rows = torch.arange(MX_TILE * i, min(MX_TILE * i + MX_TILE, L))
                m = torch.full((rows.numel(), 1), float("-inf"))
                l_run = torch.zeros(rows.numel(), 1)
                o = torch.zeros(rows.numel(), D)
                for j in range(i, -1, -1):  # the diagonal first
                    keys = torch.arange(MX_TILE * j, min(MX_TILE * j + MX_TILE, L))
                    s = q[s0 + rows, h] @ k[s0 + keys, kh].T
                    own = None
                    if j == i:
                        own = (rows[:, None] // MX_BLOCK) == (keys[None, :] // MX_BLOCK)
                        if bug == "no_own_block_bf16":
                            own = torch.zeros_like(own)
                        s = torch.where(own, qd[s0 + rows, h] @ kd[s0 + keys, kh].T, s)
                        s = s.masked_fill(keys[None, :] > rows[:, None], float("-inf"))
                    x = s * scale_log2
                    m_new = torch.maximum(m, x.amax(-1, keepdim=True))
                    m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                    alpha = torch.exp2(m - m_safe)
                    p = torch.exp2(x - m_safe)
                    l_run = l_run * alpha + p.sum(-1, keepdim=True)
                    o = o * alpha
                    nk = keys.numel()
                    pad = (-nk) % MX_BLOCK
                    pb = torch.nn.functional.pad(p, (0, pad)).reshape(rows.numel(), -1, MX_BLOCK)
                    if bug == "p_scale_from_row_max":
                        amax = pb.amax((-1, -2), keepdim=True).expand(-1, pb.shape[1], 1)
                    else:
                        amax = pb.amax(-1, keepdim=True)
                    sc = _e8m0_p_scale(amax)
                    pe = (cast_to(pb / sc, E4M3) * sc).reshape(rows.numel(), -1)[:, :nk]
                    if own is not None:
                        o = o + torch.where(own, p.to(torch.bfloat16).float(), 0.0) @ vd[s0 + keys, kh]
                        pe = torch.where(own, 0.0, pe)
                    o = o + pe @ v[s0 + keys, kh]
                    m = m_new
                out[s0 + rows, h] = o / l_run
                lse[h, s0 + rows] = ((m + torch.log2(l_run)) * LN2).squeeze(-1)
    return out.to(torch.bfloat16), lse


def reference_attention_fn(softmax_scale: float, bug: str | None = None):
    """The tile model from bf16 inputs as a flamia_cute.testing AttentionFn (for check_leakage)."""
    from ..quant.mx_layout import pack_mx_forward_operands

    def fn(q, k, v, cu, dout=None):
        out, lse = reference_fwd_sm100(pack_mx_forward_operands(q, k, v, cu), cu, softmax_scale, bug=bug)
        return {"out": out, "lse": lse}

    return fn
