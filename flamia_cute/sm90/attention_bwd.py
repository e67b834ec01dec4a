"""FP8 causal attention backward for Hopper (sm_90a), in the CuTe DSL: the default recipe
fp8_tokenblock_dsbf16 (the token-block build) and the leaky control fp8_tensor_current (the per-token
build).

Numerics: `flamia_cute.emulator.emulate_backward` with `Recipe.ds_cast = "bf16"` and
`Recipe.dv_fold = "document"`: S^T, dP^T and dV on e4m3 tensor cores, dK and dQ on bf16 ones.

Nothing is scaled per tile, so every product accumulates in the MMA's own registers (docs/backward.md):
- dV: dO's per-token scale is folded into P^T relative to ONE reference r per (KV head, document)
  (the max dO scale there, `dv_fold_reference`), so the e4m3 MMA accumulates dV across all query
  tiles and heads of the group; dV = acc * r / 256 once, in the epilogue;
- dK += bf16(dS^T) . (sq Q-codes) and dQ = bf16(dS) . (sk K-codes) on bf16 wgmma: the scaled codes
  are exact in bf16 (powers of two), so this is bf16(dS s) . codes as the recipe says (bf16(dS s) =
  bf16(dS) s), with one bf16 conversion of dS for both products. Q in bf16 is a copy made before
  the launch (sm90/codes.py) and loaded by TMA; the consumers convert the key block once per phase;
  all [t, d] (MN-major B operands, so no transposed copies);
- 64-query tiles: S^T and dP^T take 32 registers each, so dV (64) and dK (64) both stay in
  registers next to them: 224 fp32 accumulators per thread at d128.

Organization (one CTA per (128-key block n, KV head, document), GQA query heads looped inside the
CTA, so dK and dV are summed over the group in registers: deterministic):
- producer warp 0 (TMA): K and V^T (e4m3; two 64-key slabs) once per phase (the per-token copies
  for the diagonal tiles when `diagonal_copy`, then the block-scaled ones, which at d128 load under
  the last diagonal tile); V^T is the forward's P V operand, and each consumer warpgroup transposes
  its slab in place into V [key, d], dP^T's A operand (transpose_v), so the quantization writes no
  token-major V; per 64-query tile, Q and dO (e4m3 [t, d]: the B operands of S^T and dP^T,
  pipeline a) and dO^T (e4m3 [d, t], dV's B) with Q in bf16 [t, d] (dK's B; pipeline b);
- producer warp 1: per query tile, sq * softmax_scale * log2e, lse * log2e (+inf past the
  document end, so P = 0 there), D = rowsum(dO * O), the dO scale (0 past the end) and sq;
- producer warp 2: the dQ tiles' TMA reduce-adds (reduce_dq), in key-block turns when deterministic;
- consumer warpgroup w owns keys 64 w .. 64 w + 63 of the block (M everywhere):
  S^T = K Q^T and dP^T = V dO^T (e4m3, fp32), P^T = exp2(S^T sk sq scale log2e - lse log2e)
  (masked on the diagonal tiles), dS^T = P^T (dP^T sv sdo - D);
  dV += e4m3(P^T * sdo * 256 / r) . dO^T (A from registers);
  dK += bf16(dS^T) . Q bf16 (A from registers);
  bf16(dS sk) is also stored to shared memory [q, key] (double-buffered: a warpgroup may write
  the next tile's while the other still reads this one), then after one barrier of the two
  warpgroups dQ_tile = dS . K bf16 for the warpgroup's half of the head dimension;
  softmax_scale * dQ_tile goes into an fp32 dQ accumulator (T, H, D), through a shared-memory
  tile and warp 2's TMA reduce-add;
- epilogue: dK * softmax_scale and dV * r / 256 to bf16 with 16-byte stores.

CTA order (`BwdDsBf16Config.raster`): key block fastest, so the CTAs of one (document, KV head) run
together and share its Q, dO and dQ accumulator in L2; for short documents in windows of
`head_window` KV heads of one document, each window's CTAs longest first, so that the last
document's long key blocks are not the last CTAs issued (auto_head_window picks it by length).
The deterministic mode keeps the heads-fastest order, in which a key block's CTA never waits on a later
one's (its dQ turns need the earlier blocks resident or done).

Tile order inside a CTA: the diagonal tiles (query tiles 2n and 2n + 1, the second only when it
holds queries) of every head first, then every head's off-diagonal tiles. Only diagonal tiles
need masks. `deterministic=True` orders the dQ additions per (query head, document, 64-query
tile) by key block: warp 2 waits for the tile's turn, adds, waits for the add to land, passes the turn.

`cross_length` and `causal=False` (separate_keys) take cu_seqlens_k: cross_item, load_tma_cross and
consume_cross run schedules.varlen_tiles.backward_cross_item's tiles (docs/backward.md).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import BFloat16, Boolean, Float8E4M3FN, Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from .. import mask as _mask
from .. import recipes as _recipes
from .. import softmax as _softmax
from .. import tile_scheduler as _tile_scheduler
from .. import varlen as _varlen
from ..compile_cache import compile_entry, launch_on_device
from ..mask import diagonal_key_end, diagonal_source, hide_invisible, pair_key_end
from ..quant import PV_ORDER16, transposed_tokens
from ..recipes import FOLD_REF_MIN
from ..schedules import varlen_tiles as _varlen_tiles
from ..schedules.varlen_tiles import SHORT_PAIR_ROWS, backward_cross_item
from ..softmax import LOG2E, P_SCALE, dv_fold_factor, recompute_p
from ..tile_scheduler import backward_grid, backward_work_item, short_pair_follower, short_pair_len
from ..validation import check_kernel_tensors, int32_cu_seqlens
from ..varlen import document_bounds, document_dt_start, document_tiles, short_pair_bounds
from .bwd_device import (
    dq_turn_pass_warp,
    dq_turn_wait_warp,
    load_row_scales,
    store_key_rows_bf16,
    store_query_vectors,
)
from .primitives import (
    ARG_BF16,
    ARG_F8,
    ARG_F32,
    ARG_I32,
    SHARED_SOURCE_FILES,
    byte_transpose4x4,
    cvt_bf16x2,
    e4m3x2_to_bf16x2,
    pack_a_fragment_e4m3,
    select,
    select_i32,
    smem_word_index,
    st_shared_v4,
    tma_pipeline,
    warp_pipeline,
    word_walk,
    xor_walk,
)
from .rotate import ARG_F32_16, DeviceOps, check_rotation_fields, has_rotation, inverse_rotate_fragment_row

SOURCE_FILES = (
    Path(__file__).resolve(),
    Path(__file__).resolve().with_name("bwd_device.py"),
    Path(__file__).resolve().with_name("rotate.py"),
    Path(_recipes.__file__).resolve(),
    *(Path(m.__file__).resolve() for m in (_mask, _softmax, _tile_scheduler, _varlen, _varlen_tiles)),
    *SHARED_SOURCE_FILES,
)

SMEM_LIMIT = 232448  # sm_90 dynamic shared memory per CTA (227 KB)
N_VEC = 5  # per-query vectors per tile in shared memory (see load_vectors)
# short_pairs: two more rows of zeros per stage, read as D and dO's scale by a warpgroup whose keys are
# the other document's (cross_vectors): a paired tile's masked P is 0, and 0 * D or 0 * sdo must not
# become NaN where the other document holds a non-finite value
PAIR_ZERO_ROW = N_VEC
KEY_BLOCK = 128
QUERY_TILE = 64
# query-tile stages of both pipelines: a third does not fit beside Q's bf16 copy and the dQ tile at d128
Q_STAGES = 2
HEAD_WINDOWS = (1, 2, 4, 8, 16, 32, 64)  # BwdDsBf16Config.head_window
# auto_head_window: the windows' documents hold at most this many tokens together, so that the Q,
# dO and dQ accumulator rows their CTAs share stay a few MB per head (the plain order's locality)
WINDOW_TOKENS = 16384
# named barriers (1: dS and Q bf16 stored, 2: the phase change)
# cross_length: the dQ accumulator's rows before row 0 (the host allocates them): the first document's first
# dQ tile starts up to QUERY_TILE - 1 rows before its first query, and a TMA reduce-add at a negative row
# stopped the kernel on the H200 (cudaErrorIllegalInstruction)
DQ_PAD_ROWS = QUERY_TILE
DQ_FULL, DQ_EMPTY = 4, 5  # the dQ warp's tile hand-off: consumers (256 threads) and the dQ warp (32)
VT_BARRIER = 6  # + warpgroup: transpose_v's two barriers (128 threads)
# bf16 dS [q, key] for dQ's A operand (queries contiguous), two buffers; stored by hand (ds_word_index)
DS_LAYOUT = "S<3,4,3> o 0 o ((64,1),(8,16),(1,2)):((1,0),(64,512),(0,8192))"


@dataclass(frozen=True)
class BwdDsBf16Config:
    """Compile-time shape of the backward kernel. T, heads and documents are dynamic; the build's
    other choices follow from these fields (the properties below, the kernel's __init__)."""

    head_dim: int
    qhead_per_kvhead: int = 1
    diagonal_copy: bool = False  # token-block K/V: per-token copies (and their bf16 K) on the diagonal tiles
    deterministic: bool = False  # dQ additions in key-block order: bit-reproducible dQ
    vec_stages: int = 2  # stages of the per-query vectors (3: a tuner candidate, won on long documents)
    # the "blocks" order in windows of this many KV heads (backward_grid): a window's CTAs start
    # longest first, so the last document's long key blocks are not issued last (docs/scheduling.md).
    # 1: the plain order; default_config picks it by document length
    head_window: int = 1
    # Two short documents per CTA, one per consumer warpgroup's 64 keys, by the forward's rule
    # (schedules.varlen_tiles.short_pair_partner, so the second starts 64 V^T and dO^T columns after
    # the first). The pair is one item of two diagonal query tiles: tile 0 the first document's
    # queries, tile 1 the second's; each warpgroup takes its document's bounds (the second's shifted
    # 64 back), the first masks tile 1. The second document's CTA exits at once. Gradients
    # bit-identical (a masked P is 0, so the other document's keys and queries add exact zeros).
    short_pairs: bool = False
    # K's rotations (sm90/rotate.py), whose inverses the dK epilogue applies before its bf16 store: RoPE
    # ("none", "half", "interleaved") on the first rotary_dim channels at each key's position in its
    # document (the launch's fp32 cos/sin tables), after the Walsh-Hadamard transform times
    # 2^-hadamard when hadamard > 0. Self-attention builds only (not with separate_keys)
    rotary: str = "none"
    rotary_dim: int = 0
    hadamard: int = 0
    # causal=False, or cross_length (causal; a document's queries are the last positions of its keys): the
    # forward's modes, with cu_seqlens_k (separate_keys): schedules.varlen_tiles.backward_cross_item's tiles
    causal: bool = True
    cross_length: bool = False

    def __post_init__(self):
        def bad(name, msg):
            raise ValueError(f"BwdDsBf16Config.{name}: {msg} (got {getattr(self, name)!r})")

        if self.head_dim not in (64, 128):
            bad("head_dim", "must be 64 or 128")
        if not isinstance(self.qhead_per_kvhead, int) or self.qhead_per_kvhead < 1:
            bad("qhead_per_kvhead", "must be an int >= 1")
        for name in ("diagonal_copy", "deterministic", "short_pairs", "causal", "cross_length"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a bool")
        if self.cross_length and not self.causal:
            bad("cross_length", "is for causal=True (the non-causal build takes cu_seqlens_k in any case)")
        if self.short_pairs and self.separate_keys:
            bad("short_pairs", "pairs self-attention documents only (not with cross_length or causal=False)")
        if self.vec_stages not in (2, 3):
            bad("vec_stages", "must be 2 or 3")
        if type(self.head_window) is not int or self.head_window not in HEAD_WINDOWS:
            bad("head_window", f"must be one of {HEAD_WINDOWS}")
        if self.head_window > 1 and self.deterministic:
            bad("head_window", "windows the 'blocks' CTA order only (not the deterministic mode's)")
        if self.short_pairs and not short_pairs_supported(self):
            bad("short_pairs", "needs deterministic=False and no S^T/dP^T prefetch (d64)")
        check_rotation_fields("BwdDsBf16Config", self.head_dim, self.rotary, self.rotary_dim, self.hadamard)
        if self.separate_keys and has_rotation(self):
            # the dK epilogue's inverse RoPE takes self-attention positions (consume_cross has none)
            bad("rotary", "and hadamard are for self-attention builds (not with cross_length or causal=False)")

    @property
    def separate_keys(self) -> bool:
        """The build takes cu_seqlens_k (cross_length, or causal=False)."""
        return self.cross_length or not self.causal

    @property
    def prefetch_sdp(self) -> bool:
        """d64: the next tile's S^T and dP^T are issued right after this tile's dQ tile's store, so they
        run on the tensor cores under this tile's dQ traffic. At d128, in flight beside dV, dK and the
        dQ tile, they are slower."""
        return self.head_dim == 64

    @property
    def raster(self) -> str:
        """CTA order (backward_grid): "blocks", key block fastest (the CTAs of one (document, KV
        head) run together and share its Q, dO and dQ accumulator in L2: faster on every workload
        than "heads"); "heads", KV head fastest, in the deterministic mode, whose ordered dQ
        additions were GPU-tested in that order."""
        return "heads" if self.deterministic else "blocks"


def dq_pad_rows(cfg: BwdDsBf16Config) -> int:
    """Rows of the fp32 dQ accumulator before row 0 that the host allocates and the kernel's pointer starts at
    (DQ_PAD_ROWS for cross_length builds, else 0)."""
    return DQ_PAD_ROWS if cfg.cross_length else 0


def dq_kernel_ptr(dq_acc, cfg: BwdDsBf16Config) -> int:
    """The dQ accumulator's address the kernel takes: its first allocated row, dq_pad_rows(cfg) rows before
    the view `dq_acc` (bwd_preprocess.backward_outputs) starts."""
    pad = dq_pad_rows(cfg)
    if pad and dq_acc.storage_offset() < pad * dq_acc.stride(0):
        raise ValueError(f"dq_acc: a cross_length build needs {pad} rows allocated before row 0 "
                         "(bwd_preprocess.backward_outputs(dq_pad_rows=...))")
    return dq_acc.data_ptr() - pad * dq_acc.stride(0) * dq_acc.element_size()


def short_pairs_supported(cfg: BwdDsBf16Config) -> bool:
    """Whether a config's build can take short_pairs: not deterministic (the dQ turns count one document
    per CTA) and no S^T/dP^T prefetch (d64)."""
    return not cfg.deterministic and not cfg.prefetch_sdp


def smem_bytes(cfg: BwdDsBf16Config) -> int:
    """Shared memory of one CTA (upper bound: 1 KB alignment per buffer)."""
    D, tq = cfg.head_dim, QUERY_TILE
    kv = 2 * KEY_BLOCK * D + 2 * KEY_BLOCK * D  # K, V e4m3 + K bf16 (converted in the kernel)
    per_stage = 2 * tq * D + tq * D + 2 * tq * D  # Q, dO e4m3 | dO^T e4m3, Q bf16
    ds = 2 * 2 * tq * KEY_BLOCK  # bf16 dS [q, key], two buffers
    vec = vec_rows(cfg) * tq * 4 * cfg.vec_stages + KEY_BLOCK * 4  # + the phase's key scales
    bars = 8 * 2 * (1 + 2 * Q_STAGES + cfg.vec_stages)
    dq = tq * D * 4 + 1024  # the fp32 dQ tile
    return kv + per_stage * Q_STAGES + ds + vec + bars + dq + 9 * 1024


def vec_rows(cfg: BwdDsBf16Config) -> int:
    """Rows of a per-query vector stage: N_VEC, and with short_pairs two rows of zeros (PAIR_ZERO_ROW)."""
    return N_VEC + (2 if cfg.short_pairs else 0)


def _pv_order_key(m, b: int):
    """PV_ORDER16[4 m + b] as arithmetic (m may be a DSL integer): columns 4m .. 4m + 3 of a 16-column
    group hold keys 2m, 2m + 1, 8 + 2m, 9 + 2m."""
    return 2 * m + (b & 1) + 8 * (b >> 1)


assert all(PV_ORDER16[4 * m + b] == _pv_order_key(m, b) for m in range(4) for b in range(4))


def transpose_v_threads(head_dim: int) -> int:
    """Threads of a warpgroup that transpose_v gives a 16 d x 4 key block of a 64-key slab."""
    return (head_dim // 16) * (64 // 4)


def transpose_v_words(sVt_layout, sV_layout, ctid, slab, head_dim: int):
    """transpose_v's 32-bit words for thread ctid (< transpose_v_threads) of the warpgroup of `slab`,
    whose block is V^T rows d = 16a .. 16a + 15 x columns 4q .. 4q + 3 (q = ctid % 16, a = ctid // 16):
    src[4 j + r] holds row 16a + 4j + r; dst[4 b + j] is where V [key, d 16a + 4j .. 16a + 4j + 3]
    goes for the key in column 4q + b, i.e. word b of the 4x4 byte transpose of src[4j .. 4j + 3].
    A warp's lanes cover 16 column quads of 2 row blocks: its word loads hit 16 banks twice and its
    16-byte stores take 8 wavefronts (twice the minimum), where 4 d x 16 key blocks (a warp down one
    column group) loaded from 2 banks 16 times (measurably slower). Plain Python over
    DSL or Python integers (the CPU tests replay it on the layouts and count its bank conflicts)."""
    q, a = ctid % 16, ctid // 16
    src = [smem_word_index(sVt_layout, (16 * a + 4 * j + r, 4 * q, slab), 1) for j in range(4) for r in range(4)]
    # column c of a 16-column group holds key PV_ORDER16[c] of the group (P-fragment order)
    keys = [16 * (q // 4) + _pv_order_key(q % 4, b) for b in range(4)]
    # a key's 16 d are one 16-byte chunk (the swizzle moves whole chunks): its 4 words are a 16-byte
    # aligned base + j (one st_shared_v4 per key)
    base = [(smem_word_index(sV_layout, (keys[b], 16 * a, slab), 1) >> 2) << 2 for b in range(4)]
    dst = [base[b] + j for b in range(4) for j in range(4)]
    return src, dst


def tile_schedule(i, n, group, n_diag, per):
    """Tile i of a CTA (key block n): (query-head index in the group, 64-query tile m, diagonal?).

    Tiles 0 .. group * n_diag - 1: the diagonal tiles m = 2n (+ 1) of each head (n_diag = 1 when
    the document ends in tile 2n); then head j's off-diagonal tiles m = 2n + 2 .. 2n + 1 + per.
    Plain integer math for the CPU tests; the kernel's loops do the same arithmetic on DSL integers
    (_tile_of, and per phase in load_tma and consume).
    """
    if i < group * n_diag:
        return i // n_diag, 2 * n + i % n_diag, True
    j = i - group * n_diag
    return j // per, 2 * n + 2 + j % per, False


def _column_walk(n_s: int):
    """Trace time: the column-outer walk over an S^T accumulator fragment of n_s values: (value index
    of the column's first value, [(value index, key row v1)] of that query column), so that each
    query's per-query vectors are loaded once (value v0 + 2 v1 + 4 w: column block w, row v1)."""
    return [(4 * w + v0, [(v0 + 2 * v1 + 4 * w, v1) for v1 in range(2)]) for w in range(n_s // 4) for v0 in range(2)]


def ds_word_index(q, key, buf):
    """32-bit word of dS (query q even, key, buffer) in DS_LAYOUT: the bf16 pair (q, q + 1).

    Unswizzled element offset: 64 queries contiguous per key, keys (8, 16) at (64, 512), buffers at
    8192. The swizzle S<3,4,3> of a shared-memory layout acts on BYTE addresses (the 128-byte
    swizzle of TMA and wgmma: bits 7-9 into bits 4-6), whatever the element size: so the byte
    offset is swizzled, not the element offset (swizzling bf16 element offsets gave a wrong dQ on
    the GPU, while e4m3 elements are bytes and never showed the difference).
    Plain integer math (Python ints in the CPU test, DSL integers in the kernel, which keeps the
    per-key parts in registers: ds_key_parts once, ds_word per store).
    """
    base, swz = ds_key_parts(key, (q % 8) // 2)
    return ds_word(q // 8, base, swz, buf)


def ds_key_parts(key, quad):
    """(byte base of queries 2 quad .. of `key`, its swizzle bits): 128 (key % 8) + 1024 (key // 8)
    sets byte bits >= 7 only, so the swizzle (bits 7-9 into 4-6) depends on the key alone."""
    base = 4 * quad + 128 * (key % 8) + 1024 * (key // 8)
    return base, (base >> 3) & 0x70


def ds_word(w, base, swz, buf):
    """Word of queries 8 w + 2 quad, + 1 (quad and key in base, swz): bits 4-6 of 16 w take the XOR."""
    return (((16 * w) ^ swz) + base + buf * 16384) >> 2


def dv_fold_reference(sdo: torch.Tensor, cu_seqlens: torch.Tensor, group: int) -> torch.Tensor:
    """(Hk, num_docs) fp32: the dV fold reference r of every (KV head, document), the max dO scale
    over the document's tokens and the group's query heads (the emulator's dv_fold="document"),
    at least FOLD_REF_MIN. On the GPU without a host sync and without atomics (a scatter-max into
    one slot per document serialized on its atomics: 0.7-3 ms): the scales are positive powers of
    two, so (document << 8 | exponent) orders them within a document and puts every document above
    the ones before; a running max along the tokens read at each document's last token is its max.
    A NaN scale (a non-finite dO row) is left out: that row poisons its own P folds, not the
    reference of the whole document."""
    H, T = sdo.shape
    num_docs = cu_seqlens.numel() - 1
    hk = H // group
    ref = torch.full((hk, num_docs), FOLD_REF_MIN, dtype=torch.float32, device=sdo.device)
    if T == 0 or num_docs == 0:
        return ref
    sdo = torch.nan_to_num(sdo.float(), nan=0.0)
    per_kv = sdo.view(hk, group, T).amax(1) if group > 1 else sdo.contiguous()
    ends = cu_seqlens[1:].to(torch.int64)
    doc_of_token = torch.searchsorted(ends, torch.arange(T, device=sdo.device), right=True).to(torch.int32)
    key = (doc_of_token << 8) | ((per_kv.view(torch.int32) >> 23) & 0xFF)
    at_end = torch.cummax(key, dim=1).values.gather(1, (ends - 1).clamp_min(0).expand(hk, num_docs))
    doc_max = ((at_end & 0xFF) << 23).view(torch.float32)
    nonempty = ends > cu_seqlens[:-1].to(torch.int64)
    return torch.where(nonempty, doc_max, ref).clamp_min(FOLD_REF_MIN)


def _advanced(state):
    """A pipeline state, advanced (assigned back where a runtime branch advances it)."""
    state.advance()
    return state


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


class FlamiaBwdDsBf16Sm90:
    def __init__(self, config: BwdDsBf16Config):
        self.cfg = config
        self.D = config.head_dim
        self.group = config.qhead_per_kvhead
        self.diag_copy = config.diagonal_copy
        self.deterministic = config.deterministic
        self.stages = Q_STAGES
        self.sv = config.vec_stages
        self.kb = KEY_BLOCK
        self.tq = QUERY_TILE
        self.wm = 64
        self.num_threads = 384
        self.regs_producer = 24
        self.regs_consumer = 240
        self.prefetch = config.prefetch_sdp
        self.causal = config.causal
        self.cross = config.separate_keys  # cu_seqlens_k: backward_cross_item's tiles
        # the diagonal tiles from the per-token copies: block-scaled and causal (the non-causal build masks
        # its last key block at the document's end, every tile with the block scales)
        self.diag_first = config.diagonal_copy and config.causal
        # S^T and dP^T in separate commit groups, waited for one by one, so that P^T's exp2 runs while
        # dP^T is on the tensor cores (FA4's order). With the prefetch (S^T, dP^T in flight across the
        # loop) ptxas serializes every wgmma of the split build: one group there
        self.sdp_groups = 1 if self.prefetch else 2  # commit groups of one issue_sdp
        # dQ's GEMM issued before dK's, in its own commit group: the warpgroups wait for dQ alone and
        # store the dQ tile while dK computes (FA4's order); needs the dQ warp, not the prefetch
        self.dk_late = not self.prefetch
        # the change from the diagonal tiles' per-token K/V to the block-scaled ones prepared early:
        # the stage released once the last diagonal tile's S^T and dP^T are done, so the block-scaled
        # copies load under the rest of that tile, and their row scales loaded at the CTA's start
        # (4 registers through the diagonal tiles), off the phase change's path. Not beside the
        # prefetch, whose dummy S^T, dP^T after the phase's last tile reads the stage
        self.early_phase = self.diag_first and not self.prefetch
        # the e4m3 -> bf16 conversion walks (_conversion_plans): 4-code words per row, and rows per
        # step of the 256 consumer threads
        self.walk_wpr = self.D // 4
        self.walk_rpw = 256 // self.walk_wpr

    def _make_mmas(self):
        K_MAJOR, MN_MAJOR = OperandMajorMode.K, OperandMajorMode.MN
        e4, bf = Float8E4M3FN, BFloat16
        RMEM = warpgroup.OperandSource.RMEM
        wm, tq, D = self.wm, self.tq, self.D
        # S^T = K Q^T, dP^T = V dO^T: M = 64 keys per warpgroup, N = 64 queries, K = D
        sd_mma = sm90_utils.make_trivial_tiled_mma(e4, e4, K_MAJOR, K_MAJOR, Float32, (1, 1, 1), (wm, tq))
        # dV: M = 64 keys, N = D, K = 64 queries; A = e4m3(P^T) from registers, B = dO^T (K-major)
        dv_mma = sm90_utils.make_trivial_tiled_mma(e4, e4, K_MAJOR, K_MAJOR, Float32, (1, 1, 1), (wm, D), RMEM)
        # dK: M = 64 keys, N = D, K = 64 queries; A = bf16(dS^T) from registers, B = Q bf16 [t, d] (MN-major)
        dk_mma = sm90_utils.make_trivial_tiled_mma(bf, bf, K_MAJOR, MN_MAJOR, Float32, (1, 1, 1), (wm, D), RMEM)
        # dQ: M = 64 queries, N = D (warpgroup w computes columns w D/2 .. (w+1) D/2 - 1), K = 128
        # keys; A = dS [q, key] (queries contiguous), B = K bf16 [t, d] (MN-major)
        dq_mma = sm90_utils.make_trivial_tiled_mma(bf, bf, MN_MAJOR, MN_MAJOR, Float32, (1, 2, 1), (tq, D // 2))
        return sd_mma, dv_mma, dk_mma, dq_mma

    def _smem_layouts(self):
        e4, bf = Float8E4M3FN, BFloat16
        ROW, COL = cutlass.tensor_utils.LayoutEnum.ROW_MAJOR, cutlass.tensor_utils.LayoutEnum.COL_MAJOR
        wm, tq, kb, D, st = self.wm, self.tq, self.kb, self.D, self.stages
        return dict(
            K=sm90_utils.make_smem_layout_a(ROW, (wm, tq, D), e4, 2),  # (64 keys, D, 2 slabs)
            # V^T as the TMA lands it in sV, (D, 64 keys, 2 slabs), keys contiguous (transpose_v)
            Vt=sm90_utils.make_smem_layout_b(ROW, (wm, D, wm), e4, 2),
            Q=sm90_utils.make_smem_layout_b(ROW, (wm, tq, D), e4, st),  # (64 q, D, stages)
            dOt=sm90_utils.make_smem_layout_b(ROW, (wm, D, tq), e4, st),  # (D, 64 q, stages)
            Qb=sm90_utils.make_smem_layout_b(COL, (wm, D, tq), bf, st),  # (D, 64 q, stages), d contiguous
            Kb=sm90_utils.make_smem_layout_b(COL, (tq, D, kb), bf, 1),  # (D, 128 keys, 1)
            dS=sm90_utils.make_smem_layout_a(COL, (tq, D, kb), bf, 2),  # (64 q, 128 keys, 2 buffers)
        )

    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer,  # (T, H, D) e4m3
        qb_ptr: cute.Pointer,  # (T, H, D) bf16: Q's codes times sq
        sq_ptr: cute.Pointer,  # (H, T) f32
        k_ptr: cute.Pointer,  # (T, Hk, D) e4m3
        sk_ptr: cute.Pointer,  # (Hk, T) f32
        v_ptr: cute.Pointer,  # (Hk, D, T_dt) e4m3, P-fragment order (V^T: transpose_v)
        sv_ptr: cute.Pointer,
        ktok_ptr: cute.Pointer,  # per-token copies (diagonal tiles)
        sktok_ptr: cute.Pointer,
        vtok_ptr: cute.Pointer,  # (Hk, D, T_dt) like v_ptr
        svtok_ptr: cute.Pointer,
        do_ptr: cute.Pointer,  # (T, H, D) e4m3
        dot_ptr: cute.Pointer,  # (H, D, T_dt) e4m3, P-fragment order
        sdo_ptr: cute.Pointer,  # (H, T) f32
        lse_ptr: cute.Pointer,  # (H, T) f32
        delta_ptr: cute.Pointer,  # (H, T) f32: rowsum(dO * O)
        dvref_ptr: cute.Pointer,  # (Hk, num_docs) f32: dv_fold_reference
        cu_ptr: cute.Pointer,
        dq_acc_ptr: cute.Pointer,  # (T, H, D) f32, zeroed
        dk_ptr: cute.Pointer,  # (T, Hk, D) bf16
        dv_ptr: cute.Pointer,  # (T, Hk, D) bf16
        sem_ptr: cute.Pointer,  # int32 zeros: (H, docs, 2 max_n_blocks) when deterministic, else unused
        cos_ptr: cute.Pointer,  # (table_rows, rotary_dim / 2) f32 when rotary, else unused
        sin_ptr: cute.Pointer,
        T: Int32,
        T_dt: Int32,
        num_kv_heads: Int32,
        num_docs: Int32,
        max_n_blocks: Int32,
        table_rows: Int32,
        softmax_scale: Float32,
        cu_k_ptr: cute.Pointer,
        dot_cu_ptr: cute.Pointer,
        T_k: Int32,
        T_dt_o: Int32,
        stream: cuda.CUstream,
    ):
        D, wm, tq, kb = self.D, self.wm, self.tq, self.kb
        H = num_kv_heads * self.group
        hd = cute.assume(H * D, divby=D)
        khd = cute.assume(num_kv_heads * D, divby=D)
        tdt = cute.assume(T_dt, divby=128)
        dtl_stride = cute.assume(D * tdt, divby=128)

        def dt_layout(heads):  # transposed [d, t] e4m3 of dO (H heads) and V (Hk)
            return cute.make_layout((D, tdt, heads), stride=(tdt, 1, dtl_stride))

        # separate keys: K, V and their gradients have T_k tokens (V^T T_dt columns), dO^T its own T_dt_o
        # columns (cu_k_ptr, dot_cu_ptr, T_k and T_dt_o are unused otherwise)
        Tk = T_k if cutlass.const_expr(self.cross) else T
        dot_layout = dt_layout(H)
        if cutlass.const_expr(self.cross):
            tdto = cute.assume(T_dt_o, divby=128)
            dot_layout = cute.make_layout((D, tdto, H), stride=(tdto, 1, cute.assume(D * tdto, divby=128)))
        td = cute.make_layout((T, D, H), stride=(hd, 1, D))  # token-major e4m3 [t, d]
        ktd = cute.make_layout((Tk, D, num_kv_heads), stride=(khd, 1, D))
        mQ = cute.make_tensor(q_ptr, td)
        mdO = cute.make_tensor(do_ptr, td)
        mdOt = cute.make_tensor(dot_ptr, dot_layout)
        mK = cute.make_tensor(k_ptr, ktd)
        mKtok = cute.make_tensor(ktok_ptr, ktd)
        mV = cute.make_tensor(v_ptr, dt_layout(num_kv_heads))
        mVtok = cute.make_tensor(vtok_ptr, dt_layout(num_kv_heads))
        sl = cute.make_layout((T, H), stride=(1, T))
        skl = cute.make_layout((Tk, num_kv_heads), stride=(1, Tk))
        mSQ = cute.make_tensor(sq_ptr, sl)
        mSdO = cute.make_tensor(sdo_ptr, sl)
        mLSE = cute.make_tensor(lse_ptr, sl)
        mDelta = cute.make_tensor(delta_ptr, sl)
        mSK = cute.make_tensor(sk_ptr, skl)
        mSV = cute.make_tensor(sv_ptr, skl)
        mSKtok = cute.make_tensor(sktok_ptr, skl)
        mSVtok = cute.make_tensor(svtok_ptr, skl)
        mRef = cute.make_tensor(dvref_ptr, cute.make_layout((num_kv_heads, num_docs), stride=(num_docs, 1)))
        mCu = cute.make_tensor(cu_ptr, cute.make_layout(num_docs + 1))
        # cross_length: dq_acc_ptr is DQ_PAD_ROWS rows before row 0 (dq_pad_rows); the TMA reduce-add sees them
        pad = dq_pad_rows(self.cfg)
        mdQ_pad = cute.make_tensor(dq_acc_ptr, cute.make_layout((T + pad, D, H), stride=(hd, 1, D)))
        mSem = None
        if cutlass.const_expr(self.deterministic):
            mSem = cute.make_tensor(sem_ptr, cute.make_layout(H * num_docs * 2 * max_n_blocks))
        mdK = cute.make_tensor(dk_ptr, ktd)
        mdV = cute.make_tensor(dv_ptr, ktd)
        mCos, mSin = None, None
        if cutlass.const_expr(self.cfg.rotary != "none"):
            half = self.cfg.rotary_dim // 2
            mCos = cute.make_tensor(cos_ptr, cute.make_layout((table_rows, half), stride=(half, 1)))
            mSin = cute.make_tensor(sin_ptr, cute.make_layout((table_rows, half), stride=(half, 1)))
        mCuK = None  # separate keys: the key documents and the documents' first dO^T columns
        mDotCu = None
        if cutlass.const_expr(self.cross):
            mCuK = cute.make_tensor(cu_k_ptr, cute.make_layout(num_docs + 1))
            mDotCu = cute.make_tensor(dot_cu_ptr, cute.make_layout(num_docs + 1))

        mmas = self._make_mmas()
        L = self._smem_layouts()
        assert str(L["dS"]) == DS_LAYOUT, f"unexpected dS smem layout {L['dS']}"
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()

        def atom(gmem, layout, tile):
            return cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, gmem, cute.slice_(layout, (None, None, 0)), tile)

        tma_k, tK = atom(mK, L["K"], (wm, D))
        tma_v, tV = atom(mV, L["Vt"], (D, wm))
        tma_ktok, tKtok = atom(mKtok, L["K"], (wm, D))
        tma_vtok, tVtok = atom(mVtok, L["Vt"], (D, wm))
        tma_q, tQ = atom(mQ, L["Q"], (tq, D))
        tma_do, tdO = atom(mdO, L["Q"], (tq, D))
        tma_dot, tdOt = atom(mdOt, L["dOt"], (D, tq))
        # Q in bf16 [t, d] seen as (d, t): the (D, 64 q) boxes of dK's MN-major B operand
        tma_qb, tQb = atom(cute.make_tensor(qb_ptr, cute.make_layout((D, T, H), stride=(1, hd, D))), L["Qb"], (D, tq))
        # the dQ tile: fp32 rows with an epilogue tile's 128-byte swizzle (8-row x 32-float atoms): a
        # warp's 64-bit stores take 4 wavefronts, row-major they took 8 (its 8 rows in one bank; ideal
        # 2: rows r and r^1 still pair up); the TMA reduce-add reads it as 32-column boxes
        sdQ_layout = sm90_utils.make_smem_layout_epi(Float32, cutlass.tensor_utils.LayoutEnum.ROW_MAJOR, (tq, D), 1)
        tma_dq, tdQ = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyReduceBulkTensorTileS2GOp(), mdQ_pad, cute.slice_(sdQ_layout, (None, None, 0)),
            (tq, D))
        self.kv_bytes = 2 * kb * D
        self.a_bytes = 2 * tq * D
        self.b_bytes = tq * D + 2 * tq * D

        st, sv = self.stages, self.sv

        @cute.struct
        class SharedStorage:
            kv_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            a_mbar: cute.struct.MemRange[cutlass.Int64, 2 * st]
            b_mbar: cute.struct.MemRange[cutlass.Int64, 2 * st]
            v_mbar: cute.struct.MemRange[cutlass.Int64, 2 * sv]
            sVec: cute.struct.Align[cute.struct.MemRange[Float32, vec_rows(self.cfg) * tq * sv], 16]
            sKs: cute.struct.Align[cute.struct.MemRange[Float32, kb], 16]  # the phase's key scales
            sK: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(L["K"])], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(L["K"])], 1024]
            sKb: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(L["Kb"])], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(L["Q"])], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(L["Q"])], 1024]
            sdOt: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(L["dOt"])], 1024]
            sQb: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(L["Qb"])], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(L["dS"])], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024]

        self.shared_storage = SharedStorage
        tmas = (tma_k, tK, tma_v, tV, tma_ktok, tKtok, tma_vtok, tVtok, tma_q, tQ, tma_do, tdO, tma_dot, tdOt, tma_dq,
                tdQ, sdQ_layout, tma_qb, tQb)
        self.kernel(
            mmas, tmas, mSQ, mSdO, mLSE, mDelta, mSK, mSV, mSKtok, mSVtok, mRef, mCu, mdK, mdV, mSem, mCos, mSin,
            L["K"], L["Q"], L["dOt"], L["Qb"], L["Kb"], L["dS"], L["Vt"], softmax_scale, mCuK, mDotCu,
        ).launch(
            grid=backward_grid(self.cfg.raster, num_kv_heads, num_docs, max_n_blocks, self.cfg.head_window),
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    @cute.kernel
    def kernel(
        self,
        mmas: tuple,
        tmas: tuple,
        mSQ: cute.Tensor,
        mSdO: cute.Tensor,
        mLSE: cute.Tensor,
        mDelta: cute.Tensor,
        mSK: cute.Tensor,
        mSV: cute.Tensor,
        mSKtok: cute.Tensor,
        mSVtok: cute.Tensor,
        mRef: cute.Tensor,
        mCu: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mSem: cute.Tensor,
        mCos: cute.Tensor,
        mSin: cute.Tensor,
        sK_layout: cute.ComposedLayout,
        sQ_layout: cute.ComposedLayout,
        sdOt_layout: cute.ComposedLayout,
        sQb_layout: cute.ComposedLayout,
        sKb_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        sVt_layout: cute.ComposedLayout,
        softmax_scale: Float32,
        mCuK: Optional[cute.Tensor],  # noqa: UP045 - the DSL reads the annotation
        mDotCu: Optional[cute.Tensor],  # noqa: UP045
    ):
        """One CTA per (document, KV head, key block) of backward_grid."""
        layouts = (sK_layout, sQ_layout, sdOt_layout, sQb_layout, sKb_layout, sdS_layout, sVt_layout)
        if cutlass.const_expr(self.cross):
            self.cross_item(mmas, tmas, mSQ, mSdO, mLSE, mDelta, mSK, mSV, mSKtok, mSVtok, mRef, mCu, mCuK, mDotCu,
                            mdK, mdV, mSem, layouts, softmax_scale)
            return
        tidx, _, _ = cute.arch.thread_idx()
        kv_head, doc, n_blk = backward_work_item(self.cfg.raster, cute.arch.block_idx(), self.cfg.head_window)
        doc_start, doc_len = document_bounds(mCu, doc)
        # V^T's (and dO^T's) first column, by every warp (only the TMA warp uses it): its loads go out
        # with cu_seqlens[doc]'s, not after the CTA's setup, and 4 rounds of 32 documents at a time,
        # since the first K/V load waits for it
        dt_start = document_dt_start(mCu, doc, 4)
        pairs = self.cfg.short_pairs
        # short_pairs: the bounds of the block's second half (keys 64..127, query tiles >= 1): a pair's
        # second document shifted 64 back, else the document's own; the item's query length (a pair:
        # two 64-query tiles)
        hi_start, hi_len, item_len, pair_len, live = doc_start, doc_len, doc_len, Int32(0), Boolean(True)
        if cutlass.const_expr(pairs):
            num_docs = cute.size(mCu) - 1
            pair_len = short_pair_len(mCu, doc, num_docs)
            hi_start, hi_len = short_pair_bounds(doc_start, doc_len, pair_len)
            item_len = hi_len
            if short_pair_follower(mCu, doc, num_docs):
                live = Boolean(False)  # the predecessor's CTA runs this document
        live_blk = n_blk * self.kb < doc_len
        if cutlass.const_expr(pairs):
            live_blk = live_blk & live

        if live_blk:
            sched = self._item_sched(n_blk, item_len)
            bufs, sVec, sdQ, sdQ_words, dq_plan, pipes = self.shared_buffers(layouts, tmas)
            pipe_kv, pipe_a, pipe_b, pipe_v = pipes
            cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()

            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wg_idx = cute.arch.make_warp_uniform(tidx // 128)
            if wg_idx == 0:
                cute.arch.setmaxregister_decrease(self.regs_producer)
                if warp_idx == 0:
                    self.load_tma(tmas, bufs, pipe_kv, pipe_a, pipe_b, kv_head, doc_start, dt_start, sched,
                                  hi_start=hi_start if cutlass.const_expr(pairs) else None)
                if warp_idx == 1:
                    self.load_vectors(mSQ, mSdO, mLSE, mDelta, sVec, pipe_v, kv_head, doc_start, doc_len, sched,
                                      softmax_scale, hi_start=hi_start if cutlass.const_expr(pairs) else None,
                                      hi_len=hi_len if cutlass.const_expr(pairs) else None)
                if warp_idx == 2:
                    self.reduce_dq(tmas[14], tmas[15], sdQ, kv_head, doc_start, sched, (mSem, doc),
                                   hi_start=hi_start if cutlass.const_expr(pairs) else None)
            else:
                cute.arch.setmaxregister_increase(self.regs_consumer)
                # the warpgroup's keys' document: with a pair, warpgroup 1's is the second (shifted 64 back),
                # and warpgroup 0 masks the second's query tile
                w_start, w_len, w_doc, pair_first, pair_second = doc_start, doc_len, doc, None, None
                # key index 0's position in its document (RoPE): a pair's second document starts at key 64
                pos0 = Int32(0)
                if cutlass.const_expr(pairs):
                    pair_first = Boolean(False)
                    pair_second = Boolean(False)
                    if pair_len > 0:
                        if wg_idx == 2:
                            w_start, w_len, w_doc = hi_start, hi_len, doc + 1
                            pair_second = Boolean(True)
                            pos0 = Int32(-SHORT_PAIR_ROWS)
                        else:
                            pair_first = Boolean(True)
                self.consume(
                    mmas, bufs, sVec, pipe_kv, pipe_a, pipe_b, pipe_v, mSK, mSV, mSKtok, mSVtok,
                    mRef[kv_head, w_doc], (sdQ_words, dq_plan), mdK, mdV, kv_head,
                    w_start, w_len, sched, softmax_scale, wg_idx - 1, pair_first, pair_second, (mCos, mSin, pos0),
                )

    @cute.jit
    def cross_item(self, mmas, tmas, mSQ, mSdO, mLSE, mDelta, mSK, mSV, mSKtok, mSVtok, mRef, mCu, mCuK, mDotCu,
                   mdK, mdV, mSem, layouts, softmax_scale):
        """kernel()'s CTA with separate keys: key block n_blk of the key document, the query tiles of
        schedules.varlen_tiles.backward_cross_item (the warp roles as kernel()'s, without short pairs).
        xq = (q_base, q_lo, q_hi, dO^T's column of tile 0) are the query side's bounds, the key side's
        (k_start, k_len, V^T's first column) as self-attention's document bounds."""
        tidx, _, _ = cute.arch.thread_idx()
        kv_head, doc, n_blk = backward_work_item(self.cfg.raster, cute.arch.block_idx(), self.cfg.head_window)
        k_start, k_len = document_bounds(mCuK, doc)
        dt_start = document_dt_start(mCuK, doc, 4)
        live, q_base, q_lo, q_hi, m_lo, d0, n_diag, p0, per = backward_cross_item(
            mCu[doc], mCu[doc + 1], k_start, k_start + k_len, n_blk, self.causal, select_i32)
        xq = (q_base, q_lo, q_hi, mDotCu[doc] - m_lo * self.tq)
        if live:
            sched = (n_blk, n_diag, per, d0, p0)
            bufs, sVec, sdQ, sdQ_words, dq_plan, pipes = self.shared_buffers(layouts, tmas)
            pipe_kv, pipe_a, pipe_b, pipe_v = pipes
            cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()

            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wg_idx = cute.arch.make_warp_uniform(tidx // 128)
            if wg_idx == 0:
                cute.arch.setmaxregister_decrease(self.regs_producer)
                if warp_idx == 0:
                    self.load_tma_cross(tmas, bufs, pipe_kv, pipe_a, pipe_b, kv_head, k_start, dt_start, xq, sched)
                if warp_idx == 1:
                    self.load_vectors(mSQ, mSdO, mLSE, mDelta, sVec, pipe_v, kv_head, q_base, q_hi, sched,
                                      softmax_scale, q_lo=q_lo)
                if warp_idx == 2:
                    self.reduce_dq(tmas[14], tmas[15], sdQ, kv_head, q_base + dq_pad_rows(self.cfg), sched, (mSem, doc))
            else:
                cute.arch.setmaxregister_increase(self.regs_consumer)
                self.consume_cross(
                    mmas, bufs, sVec, pipe_kv, pipe_a, pipe_b, pipe_v, mSK, mSV, mSKtok, mSVtok,
                    mRef[kv_head, doc], (sdQ_words, dq_plan), mdK, mdV, kv_head,
                    k_start, k_len, sched, softmax_scale, wg_idx - 1,
                )

    @cute.jit
    def shared_buffers(self, layouts, tmas):
        """The CTA's shared memory: (bufs, sVec, sdQ, sdQ_words, dq_plan, (pipe_kv, pipe_a, pipe_b, pipe_v)),
        the barriers initialized (the caller fences and syncs)."""
        sK_layout, sQ_layout, sdOt_layout, sQb_layout, sKb_layout, sdS_layout, sVt_layout = layouts
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        def buf(mem, layout):
            return mem.get_tensor(layout.outer, swizzle=layout.inner)

        bufs = (
            buf(storage.sK, sK_layout), buf(storage.sV, sK_layout), buf(storage.sKb, sKb_layout),
            buf(storage.sQ, sQ_layout), buf(storage.sdO, sQ_layout), buf(storage.sdOt, sdOt_layout),
            buf(storage.sQb, sQb_layout), buf(storage.sdS, sdS_layout),
            storage.sdS.get_tensor(cute.make_layout(cute.cosize(sdS_layout) // 2), dtype=Uint32),  # by hand
            # 32-bit word views for the in-kernel e4m3 -> bf16 conversion of K (convert_k)
            storage.sK.get_tensor(cute.make_layout(cute.cosize(sK_layout) // 4), dtype=Uint32),
            storage.sKb.get_tensor(cute.make_layout(cute.cosize(sKb_layout) // 2), dtype=Uint32),
            self._conversion_plans(sK_layout, sKb_layout),
            (sK_layout, sKb_layout),
            storage.sKs.get_tensor(cute.make_layout(self.kb)),  # the phase's key scales (convert_k)
            buf(storage.sV, sVt_layout),  # the TMA's view of sV: V^T slabs (transpose_v)
            storage.sV.get_tensor(cute.make_layout(cute.cosize(sK_layout) // 4), dtype=Uint32),
            sVt_layout,
        )
        sVec = storage.sVec.get_tensor(cute.make_layout((self.tq, vec_rows(self.cfg), self.sv)))
        sdQ = buf(storage.sdQ, tmas[16])  # the TMA's view
        sdQ_words = storage.sdQ.get_tensor(cute.make_layout(cute.cosize(tmas[16])))  # stored by hand
        dq_plan = self._dq_store_plan(tmas[16])  # trace time, once per build
        pipe_kv = tma_pipeline(1, self.kv_bytes, storage.kv_mbar.data_ptr())
        pipe_a = tma_pipeline(self.stages, self.a_bytes, storage.a_mbar.data_ptr())
        pipe_b = tma_pipeline(self.stages, self.b_bytes, storage.b_mbar.data_ptr())
        pipe_v = warp_pipeline(self.sv, storage.v_mbar.data_ptr())
        return bufs, sVec, sdQ, sdQ_words, dq_plan, (pipe_kv, pipe_a, pipe_b, pipe_v)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _load_kv(self, atoms, bufs, pipe_kv, kv_state, kv_head, doc_start, dt_start, n_blk, hi_start=None):
        """K [key, d] and V^T [d, key] (the 64-key slabs of block n_blk) into sK and sV; hi_start
        (short_pairs): the second slab's K rows from there (a pair's second document, 64 back; its V^T
        columns follow the first's, so V^T needs no second start)."""
        atom_k, t_k, atom_v, t_v = atoms
        D = self.D
        tKs, tKg = document_tiles(atom_k, t_k, kv_head, bufs[0], (self.wm, D), doc_start, 0)
        tKg1 = tKg
        if cutlass.const_expr(hi_start is not None):
            _, tKg1 = document_tiles(atom_k, t_k, kv_head, bufs[0], (self.wm, D), hi_start, 0)
        tVs, tVg = document_tiles(atom_v, t_v, kv_head, bufs[14], (D, self.wm), dt_start, 1)
        pipe_kv.producer_acquire(kv_state)
        bar = pipe_kv.producer_get_barrier(kv_state)
        for w in cutlass.range_constexpr(2):
            cute.copy(atom_k, (tKg if w == 0 else tKg1)[None, 2 * n_blk + w], tKs[None, w], tma_bar_ptr=bar)
            cute.copy(atom_v, tVg[None, 2 * n_blk + w], tVs[None, w], tma_bar_ptr=bar)
        kv_state.advance()
        return kv_state

    @cute.jit
    def _load_q(self, tmas, bufs, pipe_a, pipe_b, a_state, b_state, hq, m, doc_start, dt_start, hi_start=None):
        """Query tile m's Q, dO (pipeline a), dO^T and Q bf16 (pipeline b); hi_start (short_pairs): the
        token start of tiles m >= 1 (a pair's second document, 64 back; else the document's)."""
        tma_q, tQ, tma_do, tdO, tma_dot, tdOt = tmas[8:14]
        D, tq = self.D, self.tq
        if cutlass.const_expr(hi_start is not None):
            doc_start = select(m >= 1, hi_start, doc_start)
        tQs, tQg = document_tiles(tma_q, tQ, hq, bufs[3], (tq, D), doc_start, 0)
        tdOs, tdOg = document_tiles(tma_do, tdO, hq, bufs[4], (tq, D), doc_start, 0)
        tdOts, tdOtg = document_tiles(tma_dot, tdOt, hq, bufs[5], (D, tq), dt_start, 1)
        pipe_a.producer_acquire(a_state)
        bar = pipe_a.producer_get_barrier(a_state)
        cute.copy(tma_q, tQg[None, m], tQs[None, a_state.index], tma_bar_ptr=bar)
        cute.copy(tma_do, tdOg[None, m], tdOs[None, a_state.index], tma_bar_ptr=bar)
        a_state.advance()
        pipe_b.producer_acquire(b_state)
        bar = pipe_b.producer_get_barrier(b_state)
        cute.copy(tma_dot, tdOtg[None, m], tdOts[None, b_state.index], tma_bar_ptr=bar)
        tma_qb, tQb = tmas[17:19]
        tQbs, tQbg = document_tiles(tma_qb, tQb, hq, bufs[6], (D, tq), doc_start, 1)
        cute.copy(tma_qb, tQbg[None, m], tQbs[None, b_state.index], tma_bar_ptr=bar)
        b_state.advance()
        return a_state, b_state

    @cute.jit
    def load_tma(self, tmas, bufs, pipe_kv, pipe_a, pipe_b, kv_head, doc_start, dt_start, sched, hi_start=None):
        """Warp 0: the CTA's K/V and query tiles, both phases (hi_start: short_pairs, _load_kv's)."""
        n_blk, n_diag, per = sched
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        a_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        b_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        # phase 0: the diagonal tiles of every head (per-token K/V when diag_copy: mask.py)
        kv_state = self._load_kv(diagonal_source(self.diag_copy, tmas[0:4], tmas[4:8]), bufs, pipe_kv, kv_state,
                                 kv_head, doc_start, dt_start, n_blk, hi_start)
        for i in cutlass.range(self.group * n_diag, unroll=1):
            a_state, b_state = self._load_q(tmas, bufs, pipe_a, pipe_b, a_state, b_state,
                                            kv_head * self.group + i // n_diag, 2 * n_blk + i % n_diag,
                                            doc_start, dt_start, hi_start)
        # phase 1: the off-diagonal tiles; the block-scaled K/V replace the copies once released
        if per > 0:
            if cutlass.const_expr(self.diag_copy):
                kv_state = self._load_kv(tmas[0:4], bufs, pipe_kv, kv_state, kv_head, doc_start, dt_start, n_blk)
            for j in cutlass.range(self.group * per, unroll=1):
                a_state, b_state = self._load_q(tmas, bufs, pipe_a, pipe_b, a_state, b_state,
                                                kv_head * self.group + j // per, 2 * n_blk + 2 + j % per,
                                                doc_start, dt_start)

    @cute.jit
    def load_tma_cross(self, tmas, bufs, pipe_kv, pipe_a, pipe_b, kv_head, k_start, dt_start, xq, sched):
        """load_tma with separate keys: K and V^T from the key document (k_start, its V^T column dt_start),
        query tile m's Q, dO and Q bf16 at rows q_base + 64 m and dO^T at column xq[3] + 64 m; the phases'
        tiles from backward_cross_item (sched = (n_blk, n_diag, per, d0, p0)). A phase without tiles loads
        no K/V: the block-scaled K/V load once, for phase 1, when phase 0 has none or reads them too."""
        n_blk, n_diag, per, d0, p0 = sched
        q_base, dot_base = xq[0], xq[3]
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        a_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        b_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        if n_diag > 0:
            kv_state = self._load_kv(diagonal_source(self.diag_first, tmas[0:4], tmas[4:8]), bufs, pipe_kv,
                                     kv_state, kv_head, k_start, dt_start, n_blk)
            for i in cutlass.range(self.group * n_diag, unroll=1):
                a_state, b_state = self._load_q(tmas, bufs, pipe_a, pipe_b, a_state, b_state,
                                                kv_head * self.group + i // n_diag, d0 + i % n_diag, q_base, dot_base)
        if per > 0:
            if self._phase1_loads_kv(n_diag):
                kv_state = self._load_kv(tmas[0:4], bufs, pipe_kv, kv_state, kv_head, k_start, dt_start, n_blk)
            for j in cutlass.range(self.group * per, unroll=1):
                a_state, b_state = self._load_q(tmas, bufs, pipe_a, pipe_b, a_state, b_state,
                                                kv_head * self.group + j // per, p0 + j % per, q_base, dot_base)

    @cute.jit
    def _phase1_loads_kv(self, n_diag):
        """Separate keys: phase 1 has its own K/V load (the block-scaled copies after the per-token ones, or
        the only load when phase 0 has no tile)."""
        loads = n_diag == 0
        if cutlass.const_expr(self.diag_first):
            loads = Boolean(True)
        return loads

    @cute.jit
    def _item_sched(self, n_blk, doc_len):
        """(key block, its diagonal 64-query tiles per head, its off-diagonal ones per head: may be
        <= 0) of a CTA's item in a document of doc_len tokens."""
        n_q = (doc_len + self.tq - 1) // self.tq  # 64-query tiles of the document
        return n_blk, cutlass.min(n_q - 2 * n_blk, 2), n_q - 2 * n_blk - 2

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _tile_count(self, n_diag, per):
        """Tiles of a CTA: the group's diagonal tiles, then its off-diagonal ones (tile_schedule)."""
        total = self.group * n_diag
        if per > 0:
            total = total + self.group * per
        return total

    @cute.jit
    def _tile_of(self, i, n_blk, n_diag, per, cross=()):
        """(query-head index in the group, 64-query tile) of tile i: tile_schedule on DSL integers
        (the producer warps' loops; the consumers' loops run the two phases separately). cross
        (separate keys): (d0, p0), the phases' first tiles (backward_cross_item; n_diag may be 0)."""
        if cutlass.const_expr(len(cross) > 0):
            d0, p0 = cross
            hi = Int32(0)
            m = Int32(0)
            if i < self.group * n_diag:
                hi = i // n_diag
                m = d0 + i % n_diag
            else:
                j = i - self.group * n_diag
                hi = j // per
                m = p0 + j % per
            return hi, m
        hi = i // n_diag
        m = 2 * n_blk + i % n_diag
        if i >= self.group * n_diag:
            j = i - self.group * n_diag
            hi = j // per
            m = 2 * n_blk + 2 + j % per
        return hi, m

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def reduce_dq(self, atom, t_dq, sdQ, kv_head, doc_start, sched, turns, hi_start=None):
        """Producer warp 2: per tile, wait until both consumer warpgroups stored the tile's dQ (named
        barrier DQ_FULL), add it to the fp32 accumulator with one TMA reduce-add (FA3's scheme), and hand
        the buffer back once the TMA has read it (DQ_EMPTY). Rows past the document end are 0 (P = 0
        there) and rows past T are clipped by the TMA, so whole 64-row tiles are added.

        turns = (mSem, doc): in the deterministic mode each tile's add waits for its turn (key blocks
        0 .. n_blk-1 of the document have added to it: dq_turn_wait_warp) and passes it on once its
        writes have landed, so dQ sums in key-block order. hi_start (short_pairs): the token start of
        tiles m >= 1 (a pair's second document, 64 back)."""
        n_blk, n_diag, per = sched[:3]
        total = self._tile_count(n_diag, per)
        cute.arch.barrier_arrive(barrier_id=DQ_EMPTY, number_of_threads=288)  # the buffer starts free
        for i in cutlass.range(total, unroll=1):
            hi, m = self._tile_of(i, n_blk, n_diag, per, sched[3:])
            hq = kv_head * self.group + hi
            sem_addr = Int64(0)
            if cutlass.const_expr(self.deterministic):
                # the turn first, while the consumers still compute the tile: the wait is not added after it
                sem_addr = dq_turn_wait_warp(turns[0], hq, turns[1], m, n_blk, 2)  # two tiles per key block
            cute.arch.barrier(barrier_id=DQ_FULL, number_of_threads=288)
            # the whole warp: a TMA copy elects its issuing lane with a full-mask elect.sync, so calling
            # it from one lane deadlocks
            start = doc_start
            if cutlass.const_expr(hi_start is not None):
                start = select(m >= 1, hi_start, doc_start)
            tSs, tSg = document_tiles(atom, t_dq, hq, sdQ, (self.tq, self.D), start, 0)
            cute.copy(atom, tSs[None, 0], tSg[None, m])
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            if i + 1 < total:
                cute.arch.barrier_arrive(barrier_id=DQ_EMPTY, number_of_threads=288)
            if cutlass.const_expr(self.deterministic):
                cute.arch.cp_async_bulk_wait_group(0)  # the adds have landed in global memory
                dq_turn_pass_warp(sem_addr)
        cute.arch.cp_async_bulk_wait_group(0)  # the last adds complete before the CTA retires

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load_vectors(self, mSQ, mSdO, mLSE, mDelta, sVec, pipe_v, kv_head, doc_start, doc_len, sched,
                     softmax_scale, hi_start=None, hi_len=None, q_lo=None):
        """Warp 1: per query tile of the CTA, the five per-query vectors (store_query_vectors; hi_start,
        hi_len: short_pairs, the bounds of tiles m >= 1; q_lo: separate keys, the first query's row from
        doc_start, and doc_len the end's)."""
        n_blk, n_diag, per = sched[:3]
        lane = cute.arch.lane_idx()
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.sv)
        # (in fp32 from the fp32 softmax_scale: softmax.scale_log2_f32, the forward's number)
        scale_log2 = softmax_scale * Float32(LOG2E)
        if cutlass.const_expr(self.cfg.short_pairs):
            # the zero rows (cross_vectors), before any stage's first commit publishes them
            for st in cutlass.range_constexpr(self.sv):
                for r in cutlass.range_constexpr(PAIR_ZERO_ROW, PAIR_ZERO_ROW + 2):
                    for c in cutlass.range_constexpr(self.tq // 32):
                        sVec[lane + 32 * c, r, st] = Float32(0.0)
        total = self._tile_count(n_diag, per)
        for i in cutlass.range(total, unroll=1):
            hi, m = self._tile_of(i, n_blk, n_diag, per, sched[3:])
            hq = kv_head * self.group + hi
            pipe_v.producer_acquire(v_state)
            st = v_state.index
            start, length = doc_start, doc_len
            if cutlass.const_expr(hi_start is not None):
                start = select(m >= 1, hi_start, doc_start)
                length = select(m >= 1, hi_len, doc_len)
            for c in cutlass.range_constexpr(self.tq // 32):
                col = lane + 32 * c
                store_query_vectors(sVec, col, st, m * self.tq + col, start, length, hq, mSQ, mLSE, mDelta, mSdO,
                                    scale_log2, q_lo)
            pipe_v.producer_commit(v_state)
            v_state.advance()

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consumer_fragments(self, mmas, bufs, wg):
        """The consumer warpgroup's MMA fragments and accumulators (tile_step's frags), and its two
        key rows in the 128-key block (krow)."""
        D, wm, tq = self.D, self.wm, self.tq
        sK, sV, sKb, sQ, sdO, sdOt, sQb, sdS = bufs[:8]
        tidx, _, _ = cute.arch.thread_idx()
        ctid = tidx % 128
        sd_mma, dv_mma, dk_mma, dq_mma = mmas
        sd_thr = sd_mma.get_slice(ctid)
        dv_thr = dv_mma.get_slice(ctid)
        dk_thr = dk_mma.get_slice(ctid)
        dq_thr = dq_mma.get_slice(tidx - 128)  # spans both consumer warpgroups
        tSrK = sd_thr.make_fragment_A(sd_thr.partition_A(sK))  # (MMA, 1, D/32, 2 slabs)
        tSrV = sd_thr.make_fragment_A(sd_thr.partition_A(sV))
        tSrQ = sd_thr.make_fragment_B(sd_thr.partition_B(sQ))  # (MMA, 1, D/32, stages)
        tSrdO = sd_thr.make_fragment_B(sd_thr.partition_B(sdO))
        tVrdOt = dv_thr.make_fragment_B(dv_thr.partition_B(sdOt))  # (MMA, 1, 2, stages)
        tKrQb = dk_thr.make_fragment_B(dk_thr.partition_B(sQb))  # (MMA, 1, 4, stages)
        tQrdS = dq_thr.make_fragment_A(dq_thr.partition_A(sdS))  # (MMA, 1, 8, 2 buffers)
        tQrKb = dq_thr.make_fragment_B(dq_thr.partition_B(sKb))  # (MMA, 1, 8, 1): this warpgroup's half
        acc_s = sd_thr.make_fragment_C(sd_thr.partition_shape_C((wm, tq)))
        acc_dp = sd_thr.make_fragment_C(sd_thr.partition_shape_C((wm, tq)))
        acc_dv = dv_thr.make_fragment_C(dv_thr.partition_shape_C((wm, D)))
        acc_dk = dk_thr.make_fragment_C(dk_thr.partition_shape_C((wm, D)))
        acc_dq = dq_thr.make_fragment_C(dq_thr.partition_shape_C((tq, D)))
        tVrP = dv_thr.make_fragment_A(dv_thr.partition_shape_A((wm, tq)))
        tKrdS = dk_thr.make_fragment_A(dk_thr.partition_shape_A((wm, tq)))
        tVrP32 = cute.recast_tensor(tVrP, Uint32)
        tKrdS32 = cute.recast_tensor(tKrdS, Uint32)
        tScS = sd_thr.partition_C(cute.make_identity_tensor((wm, tq)))  # (key in slab, query)
        tScQ = dq_thr.partition_C(cute.make_identity_tensor((tq, D)))  # (query, d)

        krow = cute.make_rmem_tensor(cute.make_layout(2), Int32)  # key index in the 128-key block
        dsk = cute.make_rmem_tensor(cute.make_layout(4), Int32)  # ds_key_parts of the two key rows
        for v1 in cutlass.range_constexpr(2):
            krow[v1] = wg * wm + tScS[2 * v1][0]
            dsk[v1], dsk[2 + v1] = ds_key_parts(krow[v1], cute.arch.lane_idx() % 4)
        frags = (tSrK, tSrV, tSrQ, tSrdO, tVrdOt, tKrQb, tQrdS, tQrKb, acc_s, acc_dp, acc_dv, acc_dk, acc_dq,
                 tVrP, tVrP32, tKrdS, tKrdS32, tScS, tScQ, dsk)
        return frags, krow

    @cute.jit
    def consume(
        self, mmas, bufs, sVec, pipe_kv, pipe_a, pipe_b, pipe_v, mSK, mSV, mSKtok, mSVtok, dv_ref, dq_out, mdK,
        mdV, kv_head, doc_start, doc_len, sched, softmax_scale, wg, pair_first=None, pair_second=None, rope=None,
    ):
        """Consumer warpgroup wg: the CTA's item (key block n_blk of KV head kv_head in the document),
        both phases' tiles, then dK and dV to global memory. pair_first (short_pairs): this warpgroup
        holds a pair's first document, so the second diagonal tile (the second document's queries) is
        masked whole; pair_second: it holds the second, and the first tile is the other document's
        (cross_vectors)."""
        frags, krow = self.consumer_fragments(mmas, bufs, wg)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        a_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        b_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.sv)
        n_blk, n_diag, per = sched
        kb = self.kb
        D = self.D
        sKs = bufs[13]
        acc_dv, acc_dk = frags[10], frags[11]
        acc_dv.fill(0.0)
        acc_dk.fill(0.0)
        # the dV fold: P^T * sdo * (256 / r), one r per (KV head, document) (a power of two)
        r, cf = dv_fold_factor(dv_ref)

        lim = diagonal_key_end(doc_len, n_blk * kb)  # keys >= lim lie past the document end
        # phase 0's row scales: the per-token copies' with diagonal copies, else the only ones (mask.py)
        rsc = cute.make_rmem_tensor(cute.make_layout(4), Float32)  # sk(row 0), sk(row 1), sv(row 0), sv(row 1)
        load_row_scales(rsc, krow, *diagonal_source(self.diag_copy, (mSK, mSV), (mSKtok, mSVtok)), kv_head,
                        doc_start, doc_len, n_blk * kb)
        early = self.early_phase
        rsc_blk = None
        if cutlass.const_expr(early):  # phase 1's, off the phase change's path
            rsc_blk = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            load_row_scales(rsc_blk, krow, mSK, mSV, kv_head, doc_start, doc_len, n_blk * kb)

        # ---- phase 0: diagonal tiles
        self.share_key_scales(sKs, rsc, krow)
        cute.arch.barrier(barrier_id=2, number_of_threads=256)  # every key's scale is in sKs
        pipe_kv.consumer_wait(kv_state)
        self.convert_k(bufs, sKs)
        self.transpose_v(bufs, wg)
        if cutlass.const_expr(self.prefetch):
            self.issue_sdp(frags, pipe_a, a_state, wg)
        for i in cutlass.range(self.group * n_diag, unroll=1):
            # the per-token copies' stage goes back inside the last diagonal tile (early_phase)
            last_diag = i + 1 == self.group * n_diag
            lim_i = pair_key_end(lim, pair_first, i, n_diag)
            a_state, b_state, v_state = self.tile_step(
                True, i, i + 1 < self.group * n_diag, 2 * n_blk + i % n_diag, frags, rsc, krow, cf, sVec, bufs,
                pipe_a, pipe_b, pipe_v, a_state, b_state, v_state, dq_out, lim_i, n_blk, softmax_scale, wg,
                (pipe_kv, kv_state, last_diag) if early else None,
                self.cross_vectors(pair_first, pair_second, i, n_diag),
            )
        if cutlass.const_expr(self.prefetch):
            warpgroup.wait_group(0)  # the dummy S^T, dP^T issued after the phase's last tile
        # ---- phase 1: off-diagonal tiles
        if cutlass.const_expr(self.diag_copy):
            if cutlass.const_expr(not early):
                pipe_kv.consumer_release(kv_state)  # the per-token copies are done
            kv_state.advance()
        if per > 0:
            if cutlass.const_expr(self.diag_copy):
                if cutlass.const_expr(early):
                    for v in cutlass.range_constexpr(4):
                        rsc[v] = rsc_blk[v]
                else:
                    load_row_scales(rsc, krow, mSK, mSV, kv_head, doc_start, doc_len, n_blk * kb)
                # (phase 0's convert_k read sKs before the diagonal tiles' barriers)
                self.share_key_scales(sKs, rsc, krow)
                # the other warpgroup's last diagonal dQ product has read K bf16: overwrite it; and
                # every key's block scale is in sKs
                cute.arch.barrier(barrier_id=2, number_of_threads=256)
                pipe_kv.consumer_wait(kv_state)
                self.convert_k(bufs, sKs)
                self.transpose_v(bufs, wg)
            if cutlass.const_expr(self.prefetch):
                self.issue_sdp(frags, pipe_a, a_state, wg)
            for j in cutlass.range(self.group * per, unroll=1):
                a_state, b_state, v_state = self.tile_step(
                    False, self.group * n_diag + j, j + 1 < self.group * per, 2 * n_blk + 2 + j % per, frags, rsc,
                    krow, cf, sVec, bufs, pipe_a, pipe_b, pipe_v, a_state, b_state, v_state, dq_out, lim, n_blk,
                    softmax_scale, wg,
                )

        if cutlass.const_expr(self.prefetch):
            warpgroup.wait_group(0)  # the dummy after phase 1's last tile
        # ---- epilogue: dV * r / 256 and dK * softmax_scale to bf16
        rfac = r / Float32(P_SCALE)
        store_key_rows_bf16(mdV, lambda i0: (acc_dv[i0] * rfac, acc_dv[i0 + 1] * rfac), krow, n_blk * kb,
                            doc_start, doc_len, kv_head, D, cute.size(acc_dv))
        if cutlass.const_expr(has_rotation(self.cfg)):
            # dK back in the caller's frame: K's inverse rotations on each key row's fp32 values
            # (sm90/rotate.py), the row's 4 quad lanes holding it whole
            mCos, mSin, pos0 = rope
            quad = cute.arch.lane_idx() % 4
            n_acc = cute.size(acc_dk)
            for v1 in cutlass.range_constexpr(2):
                key = n_blk * kb + krow[v1]
                ok = key < doc_len
                pos = select(ok, pos0 + key, Int32(0))
                idx = [2 * v1 + 4 * n8 + e for n8 in range(n_acc // 4) for e in range(2)]
                vals = inverse_rotate_fragment_row(DeviceOps, [acc_dk[i] * softmax_scale for i in idx], quad, D,
                                                   self.cfg, mCos, mSin, pos, ok)
                for i, x in zip(idx, vals, strict=True):
                    acc_dk[i] = x
            store_key_rows_bf16(mdK, lambda i0: (acc_dk[i0], acc_dk[i0 + 1]), krow, n_blk * kb, doc_start, doc_len,
                                kv_head, D, cute.size(acc_dk))
        else:
            store_key_rows_bf16(mdK, lambda i0: (acc_dk[i0] * softmax_scale, acc_dk[i0 + 1] * softmax_scale), krow,
                                n_blk * kb, doc_start, doc_len, kv_head, D, cute.size(acc_dk))

    @cute.jit
    def consume_cross(
        self, mmas, bufs, sVec, pipe_kv, pipe_a, pipe_b, pipe_v, mSK, mSV, mSKtok, mSVtok, dv_ref, dq_out, mdK,
        mdV, kv_head, doc_start, doc_len, sched, softmax_scale, wg,
    ):
        """consume with separate keys: doc_start, doc_len are the key document's (the query side's bounds
        are the loaders' and the dQ warp's: cross_item); sched = (n_blk, n_diag, per, d0, p0). Either phase may have no tile
        (n_diag = 0: a key block wholly before every query; per <= 0): a phase without tiles has no K/V of
        its own (load_tma_cross loads as _phase1_loads_kv says)."""
        frags, krow = self.consumer_fragments(mmas, bufs, wg)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        a_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        b_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.sv)
        n_blk, n_diag, per, d0, p0 = sched
        kb = self.kb
        D = self.D
        sKs = bufs[13]
        acc_dv, acc_dk = frags[10], frags[11]
        acc_dv.fill(0.0)
        acc_dk.fill(0.0)
        r, cf = dv_fold_factor(dv_ref)

        lim = diagonal_key_end(doc_len, n_blk * kb)  # keys >= lim lie past the document end
        rsc = cute.make_rmem_tensor(cute.make_layout(4), Float32)  # sk(row 0), sk(row 1), sv(row 0), sv(row 1)
        load_row_scales(rsc, krow, *diagonal_source(self.diag_first, (mSK, mSV), (mSKtok, mSVtok)), kv_head,
                        doc_start, doc_len, n_blk * kb)
        early = self.early_phase
        rsc_blk = None
        if cutlass.const_expr(early):
            rsc_blk = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            load_row_scales(rsc_blk, krow, mSK, mSV, kv_head, doc_start, doc_len, n_blk * kb)

        # ---- phase 0: the masked tiles (causal: the diagonal, per-token K/V when diag_first)
        if n_diag > 0:
            self.share_key_scales(sKs, rsc, krow)
            cute.arch.barrier(barrier_id=2, number_of_threads=256)
            pipe_kv.consumer_wait(kv_state)
            self.convert_k(bufs, sKs)
            self.transpose_v(bufs, wg)
            if cutlass.const_expr(self.prefetch):
                self.issue_sdp(frags, pipe_a, a_state, wg)
            for i in cutlass.range(self.group * n_diag, unroll=1):
                last_diag = i + 1 == self.group * n_diag
                a_state, b_state, v_state = self.tile_step(
                    True, i, i + 1 < self.group * n_diag, d0 + i % n_diag, frags, rsc, krow, cf, sVec, bufs, pipe_a,
                    pipe_b, pipe_v, a_state, b_state, v_state, dq_out, lim, n_blk, softmax_scale, wg,
                    (pipe_kv, kv_state, last_diag) if early else None,
                )
            if cutlass.const_expr(self.prefetch):
                warpgroup.wait_group(0)
            if cutlass.const_expr(self.diag_first):
                if cutlass.const_expr(not early):
                    pipe_kv.consumer_release(kv_state)
                kv_state = _advanced(kv_state)
        # ---- phase 1: the unmasked tiles, block-scaled K/V
        if per > 0:
            if self._phase1_loads_kv(n_diag):
                if cutlass.const_expr(self.diag_first):
                    if cutlass.const_expr(early):
                        for v in cutlass.range_constexpr(4):
                            rsc[v] = rsc_blk[v]
                    else:
                        load_row_scales(rsc, krow, mSK, mSV, kv_head, doc_start, doc_len, n_blk * kb)
                self.share_key_scales(sKs, rsc, krow)
                cute.arch.barrier(barrier_id=2, number_of_threads=256)
                pipe_kv.consumer_wait(kv_state)
                self.convert_k(bufs, sKs)
                self.transpose_v(bufs, wg)
            if cutlass.const_expr(self.prefetch):
                self.issue_sdp(frags, pipe_a, a_state, wg)
            for j in cutlass.range(self.group * per, unroll=1):
                a_state, b_state, v_state = self.tile_step(
                    False, self.group * n_diag + j, j + 1 < self.group * per, p0 + j % per, frags, rsc, krow, cf,
                    sVec, bufs, pipe_a, pipe_b, pipe_v, a_state, b_state, v_state, dq_out, lim, n_blk, softmax_scale,
                    wg,
                )

        if cutlass.const_expr(self.prefetch):
            warpgroup.wait_group(0)
        rfac = r / Float32(P_SCALE)
        store_key_rows_bf16(mdV, lambda i0: (acc_dv[i0] * rfac, acc_dv[i0 + 1] * rfac), krow, n_blk * kb,
                            doc_start, doc_len, kv_head, D, cute.size(acc_dv))
        store_key_rows_bf16(mdK, lambda i0: (acc_dk[i0] * softmax_scale, acc_dk[i0 + 1] * softmax_scale), krow,
                            n_blk * kb, doc_start, doc_len, kv_head, D, cute.size(acc_dk))

    # ------------------------------------------------------------------------------------------
    def _conversion_plans(self, sK_layout, sKb_layout):
        """Trace time: word offsets of the key block's e4m3 -> bf16 conversion walk (primitives.word_walk).
        Thread t converts the 4 codes (key, d .. d + 3) with d = 4 (t % wpr), keys t // wpr + j rpw
        (wpr: words per row, rpw = 256 / wpr rows per step; two 64-key slabs in sK)."""
        wpr, rpw = self.walk_wpr, self.walk_rpw

        def rc(t, j):
            return t // wpr + j * rpw, 4 * (t % wpr)

        nk = self.kb // rpw
        return dict(
            k_src=word_walk(sK_layout, lambda t, j: (rc(t, j)[0] % self.wm, rc(t, j)[1], rc(t, j)[0] // self.wm),
                            1, 256, nk),
            k_dst=word_walk(sKb_layout, lambda t, j: (rc(t, j)[1], rc(t, j)[0], 0), 2, 256, nk),
        )

    def _dq_store_plan(self, sdQ_layout):
        """Trace time: (layout, xors, adds, swap) of the dQ tile's column pairs in the swizzled shared
        tile (primitives.xor_walk over the dQ MMA's thread-value layout: pair j holds values 2j,
        2j+1); swap: the odd rows' word XOR (_dq_swap_xor)."""
        tv = self._make_mmas()[3].tv_layout_C_tiled

        def coord(t, j):
            idx = cute.crd2idx((t, 2 * j), tv)
            return idx % self.tq, idx // self.tq, 0

        xors, adds = xor_walk(sdQ_layout, coord, 4, 256, self.D // 8)
        swap = self._dq_swap_xor(xors, adds)
        return sdQ_layout, xors, adds, swap

    def _dq_swap_xor(self, xors, adds):
        """Trace time: the word XOR that takes a thread's pair j to pair j ^ 4 (column block i ^ 2: pair
        j holds row half j % 2 of block j // 2), the same for every j (checked)."""
        x = xors[4] ^ xors[0]
        for j in range(len(xors)):
            if xors[j ^ 4] != xors[j] ^ x or adds[j ^ 4] != adds[j]:
                raise ValueError(f"the dQ store swap: pair {j ^ 4} is not pair {j} ^ {x} in the dQ store plan")
        return x

    @cute.jit
    def _walk_start(self):
        """(row, d) of this consumer thread's first word in the conversion walks (_conversion_plans);
        recomputed per call (a few integer operations) rather than held in registers."""
        tidx, _, _ = cute.arch.thread_idx()
        wpr = self.walk_wpr
        return (tidx - 128) // wpr, 4 * ((tidx - 128) % wpr)

    @cute.jit
    def share_key_scales(self, sKs, rsc, krow):
        """The phase's key scales (rsc: this thread's two rows, 0 past the document end) into sKs
        for convert_k, whose rows are other threads' (the 4 threads of a quad write the same value).
        Global loads per converted row instead spilled 24 bytes at d128 (hoisted across phase 0)."""
        for v1 in cutlass.range_constexpr(2):
            sKs[krow[v1]] = rsc[v1]

    @cute.jit
    def convert_k(self, bufs, sKs):
        """K bf16 [d, key] (dQ's B operand) from the e4m3 key block in shared memory (two 64-key A
        slabs), times each key's scale of this phase (sKs, share_key_scales: per-token or block, 0
        past the document end): exact (powers of two), so dQ's A operand is bf16(dS) itself."""
        sK_words, sKb_words, plan = bufs[9], bufs[10], bufs[11]
        sK_layout, sKb_layout = bufs[12]
        key, d = self._walk_start()
        src = smem_word_index(sK_layout, (key % self.wm, d, key // self.wm), 1)
        dst = smem_word_index(sKb_layout, (d, key, 0), 2)
        self._convert_walk(sK_words, sKb_words, src, dst, plan["k_src"], plan["k_dst"],
                           lambda j: sKs[key + j * self.walk_rpw])

    @cute.jit
    def transpose_v(self, bufs, wg):
        """V [key, d] (dP^T's A operand, slab wg) from the V^T slab that the TMA put in the same
        shared memory ([d, key], keys in P-fragment order): the forward's quantization writes V
        transposed only (2 bytes per element less, with the per-token copy). Thread t of the
        warpgroup moves a block of 16 d x 4 keys (transpose_v_words): 16 word reads, 4x4 byte
        transposes, 4 16-byte writes; every read of the slab lands before any write (in place)."""
        sV_words, sVt_layout = bufs[15], bufs[16]
        tidx, _, _ = cute.arch.thread_idx()
        ctid = tidx % 128
        src, dst = transpose_v_words(sVt_layout, bufs[12][0], ctid, wg, self.D)
        works = ctid < transpose_v_threads(self.D)
        x = cute.make_rmem_tensor(cute.make_layout(16), Uint32)
        if works:
            for j in cutlass.range_constexpr(16):
                x[j] = sV_words[src[j]]
        cute.arch.barrier(barrier_id=VT_BARRIER + wg, number_of_threads=128)
        if works:
            t = [byte_transpose4x4(x[4 * j], x[4 * j + 1], x[4 * j + 2], x[4 * j + 3]) for j in range(4)]
            base = sV_words.iterator.toint()
            for b in cutlass.range_constexpr(4):  # key b's 16 d: words j = 0..3 of one 16-byte chunk
                st_shared_v4(base + dst[4 * b] * 4, [t[j][b] for j in range(4)])
        cute.arch.fence_proxy("async.shared", space="cta")  # generic writes, then wgmma reads
        cute.arch.barrier(barrier_id=VT_BARRIER + wg, number_of_threads=128)

    @cute.jit
    def _convert_walk(self, src_words, dst_words, src, dst, src_walk, dst_walk, row_scale):
        """One conversion walk: e4m3 words at src + src_walk[j] -> two bf16x2 words each at
        dst + dst_walk[j] (the plans of _conversion_plans, fixed at trace time), times row_scale(j),
        the scale of the walk's row at step j."""
        for j in cutlass.range_constexpr(len(src_walk)):
            x = src_words[src + src_walk[j]]
            o = dst + dst_walk[j]
            sc = row_scale(j)
            dst_words[o] = e4m3x2_to_bf16x2(x, False, sc)
            dst_words[o + 1] = e4m3x2_to_bf16x2(x, True, sc)

    @cute.jit
    def issue_sdp(self, frags, pipe_a, a_state, wg, has_tile=True):
        """Issue S^T = K Q^T and dP^T = V dO^T of the query tile in stage a_state (one commit group each,
        or one for both: self.sdp_groups).
        has_tile (a runtime flag, or True): False issues on the stage as it is, without waiting for a
        load (a dummy whose result is dropped: see tile_step's prefetch)."""
        D = self.D
        tSrK, tSrV, tSrQ, tSrdO = frags[0:4]
        acc_s, acc_dp = frags[8], frags[9]
        sd_mma = self._make_mmas()[0]  # fresh: ACCUMULATE is state threaded through the IR
        if cutlass.const_expr(has_tile is True):
            pipe_a.consumer_wait(a_state)
        else:
            if has_tile:
                pipe_a.consumer_wait(a_state)
        warpgroup.fence()
        for k in cutlass.range_constexpr(D // 32):
            sd_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(sd_mma, acc_s, tSrK[None, None, k, wg], tSrQ[None, None, k, a_state.index], acc_s)
        if cutlass.const_expr(self.sdp_groups == 2):
            warpgroup.commit_group()
        for k in cutlass.range_constexpr(D // 32):
            sd_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(sd_mma, acc_dp, tSrV[None, None, k, wg], tSrdO[None, None, k, a_state.index], acc_dp)
        warpgroup.commit_group()

    @cute.jit
    def cross_vectors(self, pair_first, pair_second, i, n_diag):
        """The row offset of D and dO's scale in diagonal tile i's per-query vectors: 0, or (short_pairs)
        PAIR_ZERO_ROW - 2 where the tile's queries are the other document's (the first warpgroup's second
        tile, the second warpgroup's first): there they read zeros, so this warpgroup's dS^T and dV fold
        are exact zeros whatever the other document holds (P is masked to 0 there). None: no pairs."""
        off = None
        if cutlass.const_expr(pair_first is not None):
            cross = (pair_first & (i % n_diag == 1)) | (pair_second & (i % n_diag == 0))
            off = select(cross, Int32(PAIR_ZERO_ROW - 2), Int32(0))
        return off

    @cute.jit
    def tile_step(
        self, diag: cutlass.Constexpr, i, has_next, m, frags, rsc, krow, cf, sVec, bufs, pipe_a, pipe_b, pipe_v,
        a_state, b_state, v_state, dq_out, lim, n_blk, softmax_scale, wg, release_kv=None, vec_off=None,
    ):
        """One 64-query tile m (tile number i of the CTA); its dQ goes to the shared tile that warp 2 adds
        (reduce_dq). diag: m in {2n, 2n+1} (separate keys: a masked tile).
        release_kv (pipe_kv, its state, a runtime flag): when the flag is set, the K/V stage is released
        as soon as this tile's S^T and dP^T have read it (the phase's last tile: the next phase's copies
        load under the rest of the tile). vec_off (short_pairs): cross_vectors' offset.

        With prefetch, its S^T and dP^T were issued before (issue_sdp: by the previous tile of the
        phase, or before the phase) and has_next issues the next tile's after this tile's dQ
        store, so that they run on the tensor cores under the rest of the tile.
        """
        tq = self.tq
        (tSrK, tSrV, tSrQ, tSrdO, tVrdOt, tKrQb, tQrdS, tQrKb, acc_s, acc_dp, acc_dv, acc_dk, acc_dq,
         tVrP, tVrP32, tKrdS, tKrdS32, tScS, tScQ, dsk) = frags
        sdS_words = bufs[8]
        n_s = cute.size(acc_s)
        # fresh tiled MMAs per call: ACCUMULATE is state threaded through the IR
        sd_mma, dv_mma, dk_mma, dq_mma = self._make_mmas()

        if cutlass.const_expr(not self.prefetch):
            self.issue_sdp(frags, pipe_a, a_state, wg)
        # ---- P^T = exp2(S^T sk sq scale log2e - lse log2e) into acc_s (masked on the diagonal tiles);
        # column-outer: each query's vectors loaded once. With two commit groups, while dP^T still runs
        ds_buf = i % 2
        pipe_v.consumer_wait(v_state)
        vs = v_state.index
        walk = _column_walk(n_s)
        warpgroup.wait_group(self.sdp_groups - 1)
        qoff = (m - 2 * n_blk) * tq  # diagonal tiles: query index in the key block = qoff + column
        for c, rows in walk:
            col = tScS[c][1]
            ca = sVec[col, 0, vs]
            cb = sVec[col, 1, vs]
            for a, v1 in rows:
                p = recompute_p(acc_s[a], rsc[v1], ca, cb)
                if cutlass.const_expr(diag):  # the leakage-safe mask (mask.py)
                    (p,) = hide_invisible((p,), (Float32(0.0),), krow[v1], qoff + col, lim, None, self.causal)
                acc_s[a] = p
        # ---- once dP^T is done the Q/dO stage can go
        if cutlass.const_expr(self.sdp_groups == 2):
            warpgroup.wait_group(0)
        pipe_a.consumer_release(a_state)
        a_state.advance()
        if cutlass.const_expr(release_kv is not None):
            pipe_kv, kv_state, last = release_kv
            if last:  # S^T and dP^T were the phase's last readers of sK and sV (K bf16 is apart)
                pipe_kv.consumer_release(kv_state)

        # ---- dS^T = P^T (dP^T sv sdo - D) into acc_dp, the dV fold of P^T into acc_s
        vo = 0
        if cutlass.const_expr(vec_off is not None):
            vo = vec_off
        for c, rows in walk:
            col = tScS[c][1]
            cd = sVec[col, 2 + vo, vs]
            cw = sVec[col, 3 + vo, vs]
            cwf = cw * cf  # sdo * 256 / r: powers of two, so (p * sdo) * (256 / r) exactly
            for a, v1 in rows:
                p = acc_s[a]
                # cw * sv first (exact: powers of two): a query column outside the document (cw = 0)
                # stays 0 even where dP * sv alone would overflow (a V scale near the top)
                acc_dp[a] = p * (acc_dp[a] * (cw * rsc[2 + v1]) - cd)
                acc_s[a] = p * cwf  # <= 256: sdo <= r
        pipe_v.consumer_release(v_state)
        v_state.advance()
        pack_a_fragment_e4m3(acc_s, tVrP32)
        # bf16(dS) once per value pair, for both bf16 products: the query and key scales are in their
        # B operands (Q and K in bf16 times sq and sk: exact, powers of two; bf16(dS s) = bf16(dS) s
        # as the recipe says). dK's A operand: a 16-bit A fragment has the accumulator's value order;
        # dQ's, [q, key] in shared memory (queries contiguous): the thread's two adjacent queries
        # 8 w_ + 2 quad, + 1 of key krow[v1] share one word, the same pair as the fragment's
        for w_ in cutlass.range_constexpr(n_s // 4):
            for v1 in cutlass.range_constexpr(2):
                a0 = 4 * w_ + 2 * v1
                pair = cvt_bf16x2(acc_dp[a0], acc_dp[a0 + 1])
                tKrdS32[2 * w_ + v1] = pair
                sdS_words[ds_word(w_, dsk[v1], dsk[2 + v1], ds_buf)] = pair

        # ---- dV += e4m3(P^T fold) . dO^T (accumulates in place)
        pipe_b.consumer_wait(b_state)
        warpgroup.fence()
        dv_mma.set(warpgroup.Field.ACCUMULATE, True)
        for k in cutlass.range_constexpr(tq // 32):
            cute.gemm(dv_mma, acc_dv, tVrP[None, None, k], tVrdOt[None, None, k, b_state.index], acc_dv)
        warpgroup.commit_group()

        # ---- both warpgroups' dS halves are in shared memory: dK += bf16(dS^T) . Q bf16
        # and dQ_tile = bf16(dS) . K bf16 for this warpgroup's half of D
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=1, number_of_threads=256)
        warpgroup.fence()
        dk_mma.set(warpgroup.Field.ACCUMULATE, True)
        qbuf = b_state.index
        dk_late = self.dk_late
        if cutlass.const_expr(dk_late):  # dQ first, in its own group: its store runs while dK computes
            for k in cutlass.range_constexpr(self.kb // 16):
                dq_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
                cute.gemm(dq_mma, acc_dq, tQrdS[None, None, k, ds_buf], tQrKb[None, None, k, 0], acc_dq)
            warpgroup.commit_group()
        for k in cutlass.range_constexpr(tq // 16):
            cute.gemm(dk_mma, acc_dk, tKrdS[None, None, k], tKrQb[None, None, k, qbuf], acc_dk)
        if cutlass.const_expr(not dk_late):
            for k in cutlass.range_constexpr(self.kb // 16):
                dq_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
                cute.gemm(dq_mma, acc_dq, tQrdS[None, None, k, ds_buf], tQrKb[None, None, k, 0], acc_dq)
        warpgroup.commit_group()
        if cutlass.const_expr(dk_late):
            warpgroup.wait_group(1)  # dV and dQ done; dK still running (its B stage is released below)
        else:
            warpgroup.wait_group(0)
        if cutlass.const_expr(not dk_late):
            pipe_b.consumer_release(b_state)
            b_state.advance()

        sdQ_words, dq_plan = dq_out
        # the previous tile's reduce-add has read the buffer; store this tile (softmax_scale applied)
        # column pairs to the swizzled tile (64-bit stores): one base word per thread, each pair an
        # XOR and an add away from it (_dq_store_plan)
        cute.arch.barrier(barrier_id=DQ_EMPTY, number_of_threads=288)
        self._store_dq_tile(sdQ_words, dq_plan, acc_dq, tScQ, softmax_scale)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier_arrive(barrier_id=DQ_FULL, number_of_threads=288)
        if cutlass.const_expr(dk_late):
            warpgroup.wait_group(0)
            pipe_b.consumer_release(b_state)
            b_state.advance()
        if cutlass.const_expr(self.prefetch):
            # the dQ tile's registers are free: issue the next tile's S^T, dP^T. Always: an MMA
            # issued under a runtime `if` and waited in the next iteration spilled 272 bytes at
            # d128; after a phase's last tile it is a dummy on an unloaded stage (the result is
            # dropped, and consume drains it before the phase change)
            self.issue_sdp(frags, pipe_a, a_state, wg, has_next)
        return a_state, b_state, v_state

    @cute.jit
    def _store_dq_tile(self, sdQ_words, dq_plan, acc_dq, tScQ, softmax_scale):
        """softmax_scale * acc_dq into the swizzled shared dQ tile (64-bit stores): one base word per
        thread, each column pair an XOR and an add away from it (_dq_store_plan)."""
        sdQ_layout, xors, adds, swap = dq_plan
        row0, col0 = tScQ[0]
        w0 = smem_word_index(sdQ_layout, (row0, col0, 0), 4)
        # odd rows store column block i ^ 2 at the step even rows store block i, so a half-warp's 4 rows
        # hit 4 distinct 32-byte pairs of the swizzled tile (2 wavefronts per 64-bit store instead of
        # 4) at 2 selects per store
        odd = (row0 % 2) == 1
        w0 = w0 ^ select(odd, Int32(swap), Int32(0))
        for j in cutlass.range_constexpr(len(xors)):
            w = (w0 ^ xors[j]) + adds[j]
            lo, hi = acc_dq[2 * j], acc_dq[2 * j + 1]
            lo = select(odd, acc_dq[2 * (j ^ 4)], lo)  # odd rows: pair j ^ 4, at its own address
            hi = select(odd, acc_dq[2 * (j ^ 4) + 1], hi)
            sdQ_words[w] = lo * softmax_scale
            sdQ_words[w + 1] = hi * softmax_scale


# ----------------------------------------------------------------------------------------------
# Compile and launch
# ----------------------------------------------------------------------------------------------


ARG_KINDS = (
    ARG_F8, ARG_BF16, ARG_F32,  # q, q in bf16 (codes times sq), sq
    ARG_F8, ARG_F32,  # k, sk
    ARG_F8, ARG_F32,  # v, sv
    ARG_F8, ARG_F32, ARG_F8, ARG_F32,  # per-token k, sk, v, sv
    ARG_F8, ARG_F8, ARG_F32,  # do, dot, sdo
    ARG_F32, ARG_F32, ARG_F32,  # lse, delta, dV fold reference
    ARG_I32,  # cu_seqlens
    ("ptr", Float32, 16), ARG_BF16, ARG_BF16, ARG_I32,  # dq accumulator, dk, dv, dQ semaphores
    ARG_F32_16, ARG_F32_16,  # cos, sin (rotary)
    ("i32",), ("i32",), ("i32",), ("i32",), ("i32",), ("i32",),  # T, T_dt, Hk, num_docs, max_n_blocks, table rows
    ("f32",),  # softmax scale
    ARG_I32, ARG_I32, ("i32",), ("i32",),  # cu_seqlens_k, dO^T's document columns, T_k, T_dt_o (separate keys)
    ("stream",),
)


def compile_bwd_dsbf16_sm90(config: BwdDsBf16Config, arch: str = "sm_90a", extra_options: str = "",
                            tvm_ffi: bool = False):
    """cute.compile the backward for `arch` from plain values only (no tensors, no GPU needed)."""
    return compile_entry(FlamiaBwdDsBf16Sm90(config), ARG_KINDS, arch, extra_options, tvm_ffi)


def get_launcher(config: BwdDsBf16Config, arch: str | None = None, use_tvm_ffi: bool | None = None):
    from ..compile_cache import compile_launcher, target_arch

    return compile_launcher(
        SOURCE_FILES, config, arch or target_arch(), lambda cfg, a, t: compile_bwd_dsbf16_sm90(cfg, a, tvm_ffi=t),
        ARG_KINDS, use_tvm_ffi,
    )


def kernel_artifacts(config: BwdDsBf16Config, arch: str = "sm_90a"):
    from ..compile_cache import compile_artifacts

    return compile_artifacts(compile_bwd_dsbf16_sm90, config, arch)


def flamia_bwd_dsbf16_sm90(
    dout, out, lse, q_td, sq, k_td, sk, v_dt, sv, k_tok_td, sk_tok, v_tok_dt, sv_tok,
    cu_seqlens, max_seqlen: int, softmax_scale: float, config: BwdDsBf16Config,
    poison_outputs: bool = False, do_quantized=None, delta=None, dv_ref=None, q_bf16=None,
    overlap_passes: bool | None = None, rope_tables=None, dq_convert=None, delta_quantized: bool = True,
    cu_seqlens_k=None, max_seqlen_k: int | None = None,
):
    """Causal FP8 attention backward of the bf16-dS recipes on the current stream; returns (dq, dk, dv)
    bf16.

    dout, out: (T, H, D) bf16; lse (H, T) fp32 (the forward's). q_td (T, H, D) e4m3 and sq (H, T);
    k_td (T, Hk, D), sk; v_dt (Hk, D, T_dt) in P-fragment order (V^T, the forward's P V operand: the
    kernel transposes it in shared memory), sv: the forward's saved operands (quant.quantize
    layouts, whose scales are powers of two: the kernel multiplies Q's and K's codes by them in
    bf16, exactly only then; no transposed Q or K: the kernel converts K's e4m3 values to bf16 in
    shared memory). *_tok*: the per-token K/V copies of the diagonal tiles when
    config.diagonal_copy (else ignored). do_quantized (QuantizedTHD with data_dt in P-fragment
    order) and delta (H, T) may be passed precomputed; else the preprocess computes them; so may
    dv_ref, the dv_fold_reference (to time the kernel alone); when dO is quantized here, the same
    launch computes dv_ref (no torch launches). q_bf16 (T, H, D): q_td's codes times sq in bf16,
    dK's B operand (made here by sm90/codes.py when not given; exact: the scales are powers of two).
    overlap_passes: Q's bf16 copy and the dQ accumulator's zero fill run on a side stream while the
    dO preprocess runs on the current one (all three are memory-bound and independent; the kernel
    waits for both streams). None: OVERLAP_PASSES.
    rope_tables: (cos, sin) fp32 (rotary.kernel_tables) when config.rotary or dq_convert applies RoPE.
    dq_convert: a rotate.GradRotateConfig: dQ's conversion to bf16 applies Q's inverse rotations (the
    dK epilogue applies K's, config.rotary / config.hadamard). delta_quantized: D from dO's e4m3 values
    (recipes.DELTAS "quantized", the default recipe's; False: the bf16 dO) when the preprocess computes it.
    config.separate_keys (cross_length, or causal=False): cu_seqlens holds the query documents and
    cu_seqlens_k the key documents (as many; max_seqlen_k their longest), K, V, their scales, dK and dV
    have T_k tokens, v_dt transposed_tokens(T_k, num_docs) columns; the causal build reads dO^T by key
    position (bwd_preprocess.separate_keys_dot, made here from dO's codes). Rotations are for
    self-attention builds only (the config refuses them with separate keys, and so does dq_convert).
    """
    from .bwd_preprocess import backward_grid_blocks, backward_outputs, preprocess_bwd, separate_keys_dot

    T, H, D = q_td.shape
    Hk = k_td.shape[1]
    if D != config.head_dim or H != Hk * config.qhead_per_kvhead:
        raise ValueError(f"shapes (H={H}, Hk={Hk}, D={D}) do not match {config}")
    sep = config.separate_keys
    if sep and dq_convert is not None:
        raise ValueError("dq_convert: Q's inverse rotations are for self-attention builds (not config.separate_keys)")
    if sep != (cu_seqlens_k is not None) or (sep and max_seqlen_k is None):
        raise ValueError("cu_seqlens_k and max_seqlen_k: needed exactly when config.separate_keys")
    if sep and cu_seqlens_k.shape != cu_seqlens.shape:
        raise ValueError(f"cu_seqlens_k must have as many documents as cu_seqlens ({cu_seqlens.numel() - 1}), "
                         f"got {cu_seqlens_k.numel() - 1}")
    Tk = k_td.shape[0] if sep else T
    if not config.diagonal_copy or k_tok_td is None:
        if config.diagonal_copy:
            raise ValueError("config.diagonal_copy needs k_tok_td, sk_tok, v_tok_dt, sv_tok")
        k_tok_td, sk_tok, v_tok_dt, sv_tok = k_td, sk, v_dt, sv
    dev = q_td.device
    cu = int32_cu_seqlens(cu_seqlens, dev)
    cu_k = int32_cu_seqlens(cu_seqlens_k, dev) if sep else cu
    num_docs = cu.numel() - 1
    T_dt = transposed_tokens(Tk, num_docs)  # V^T's columns (and dO^T's, but for separate keys)
    f8 = torch.float8_e4m3fn
    main = torch.cuda.current_stream(dev)
    side = side_stream(dev) if (OVERLAP_PASSES if overlap_passes is None else overlap_passes) else None
    if side is not None:
        side.wait_stream(main)  # the forward's operands are ready before the side passes read them
    # allocated here on the current stream (its memory pool), filled on the side stream when overlapped
    dq_acc, dk, dv = backward_outputs(T, H, Hk, D, dev, poison_outputs, zero_dq=side is None, Tk=Tk,
                                      dq_pad_rows=dq_pad_rows(config))
    make_q_bf16 = q_bf16 is None
    if make_q_bf16:
        q_bf16 = torch.empty(T, H, D, dtype=torch.bfloat16, device=dev)
    try:
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if make_q_bf16:
                from .codes import e4m3_codes_to_bf16

                e4m3_codes_to_bf16(q_td, sq, out=q_bf16)
            if side is not None:
                dq_acc.zero_()
        if do_quantized is None or delta is None:
            # the dV fold references come from the same launch when it also quantizes dO
            delta_, doq, ref_ = preprocess_bwd(dout, out, cu, dv_ref_group=config.qhead_per_kvhead,
                                               delta_quantized=delta_quantized)
            delta = delta if delta is not None else delta_
            if do_quantized is None:
                do_quantized = doq
                dv_ref = dv_ref if dv_ref is not None else ref_
    finally:  # joined even when an argument check raises: the side writes finish before the buffers are freed
        if side is not None:
            main.wait_stream(side)
    do_dt, dot_cu = do_quantized.data_dt, cu  # (dot_cu: unused but for separate keys)
    if sep and config.causal:  # by key position (non-causal: the queries' own layout, over cu_seqlens)
        check_kernel_tensors((("do_td", do_quantized.data_td, (T, H, D), f8),), dev)
        do_dt, dot_cu = separate_keys_dot(do_quantized.data_td, cu, cu_k)
    elif sep:
        from ..quant import dt_cu_seqlens

        dot_cu = dt_cu_seqlens(cu)
    T_dt_o = do_dt.shape[2] if sep else T_dt
    if sep and not config.causal and T_dt_o != transposed_tokens(T, num_docs):
        raise ValueError(f"do_quantized.data_dt must have transposed_tokens(T, num_docs) = "
                         f"{transposed_tokens(T, num_docs)} columns, got {T_dt_o}")
    check_kernel_tensors((
        ("q_bf16", q_bf16, (T, H, D), torch.bfloat16),
        ("q_td", q_td, (T, H, D), f8), ("k_td", k_td, (Tk, Hk, D), f8), ("v_dt", v_dt, (Hk, D, T_dt), f8),
        ("k_tok_td", k_tok_td, (Tk, Hk, D), f8), ("v_tok_dt", v_tok_dt, (Hk, D, T_dt), f8),
        ("do_td", do_quantized.data_td, (T, H, D), f8), ("do_dt", do_dt, (H, D, T_dt_o), f8),
        ("sq", sq, (H, T), torch.float32), ("sk", sk, (Hk, Tk), torch.float32), ("sv", sv, (Hk, Tk), torch.float32),
        ("sk_tok", sk_tok, (Hk, Tk), torch.float32), ("sv_tok", sv_tok, (Hk, Tk), torch.float32),
        ("sdo", do_quantized.scale, (H, T), torch.float32), ("lse", lse, (H, T), torch.float32),
        ("delta", delta, (H, T), torch.float32),
    ), dev)
    if not do_quantized.dt_pv_order:
        raise ValueError("do_quantized.data_dt must be in P-fragment order (quantize with pv_order=True)")
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    rows = 1
    if config.rotary != "none" or (dq_convert is not None and dq_convert.rotary != "none"):
        rd = max(config.rotary_dim, dq_convert.rotary_dim if dq_convert is not None else 0)
        if rope_tables is None:
            raise ValueError("rope_tables=(cos, sin) is needed for a config with rotary")
        rows = rope_tables[0].shape[0] if rope_tables[0].dim() == 2 else -1
        check_kernel_tensors((("cos", rope_tables[0], (rows, rd // 2), torch.float32),
                              ("sin", rope_tables[1], (rows, rd // 2), torch.float32)), dev)
        if rows < max_seqlen:
            raise ValueError(f"rope_tables have {rows} positions, fewer than max_seqlen {max_seqlen}")
    # the grid's key blocks; non-causal: at least the query tiles' halves too, as the deterministic dQ's turn
    # counters hold 2 per key block for each (head, document) and every query tile is any key block's
    grid_len = max_seqlen if not sep else (max_seqlen_k if config.causal else max(max_seqlen_k, max_seqlen))
    max_n_blocks = backward_grid_blocks(max(T, Tk), H, D, max(T_dt, T_dt_o), num_docs, grid_len, KEY_BLOCK)
    if Hk % config.head_window:
        raise ValueError(f"config.head_window {config.head_window} does not divide the {Hk} KV heads")
    if sep and Tk == 0:  # no key at all: dK, dV empty, dQ 0
        max_n_blocks = 0
    if T > 0 and num_docs > 0 and max_n_blocks > 0:
        if dv_ref is None:
            dv_ref = dv_fold_reference(do_quantized.scale, cu, config.qhead_per_kvhead)
        ptrs = (q_td, q_bf16, sq, k_td, sk, v_dt, sv, k_tok_td, sk_tok, v_tok_dt, sv_tok,
                do_quantized.data_td, do_dt, do_quantized.scale, lse, delta, dv_ref, cu, dq_acc, dk, dv)
        # deterministic dQ: one turn counter per (query head, document, 64-query tile)
        sem = None
        if config.deterministic:
            sem = torch.zeros(H * num_docs * 2 * max_n_blocks, dtype=torch.int32, device=dev)
        tables = [t.data_ptr() for t in rope_tables] if config.rotary != "none" else [0, 0]
        addrs = [dq_kernel_ptr(t, config) if t is dq_acc else t.data_ptr() for t in ptrs]
        launch_on_device(get_launcher(config), dev, *addrs,
                         sem.data_ptr() if sem is not None else 0, *tables,
                         T, T_dt, Hk, num_docs, max_n_blocks, rows, float(softmax_scale),
                         cu_k.data_ptr(), dot_cu.data_ptr(), Tk, T_dt_o)
    if dq_convert is None:
        dq = dq_acc.to(torch.bfloat16)  # softmax_scale is already applied
    else:  # the same pass, with Q's inverse rotations
        from .rotate import grad_rotate_to_bf16

        cos, sin = rope_tables if dq_convert.rotary != "none" else (None, None)
        dq = grad_rotate_to_bf16(dq_acc, cu, cos, sin, dq_convert)
    if sep:  # the keys of a document without queries have no CTA: their gradients are 0
        lq = (cu[1:] - cu[:-1])[torch.searchsorted(cu_k[1:], torch.arange(Tk, device=dev, dtype=torch.int32),
                                                   right=True).clamp(max=max(num_docs - 1, 0))]
        no_queries = (lq == 0)[:, None, None]  # in place: no second copy of dK and dV
        dk.masked_fill_(no_queries, 0)
        dv.masked_fill_(no_queries, 0)
    return dq, dk, dv


# flamia_bwd_dsbf16_sm90's overlap_passes default: the three memory-bound passes overlapped are
# faster on every workload (docs/backward.md); gradients unchanged
OVERLAP_PASSES = True


@functools.cache
def side_stream(device) -> torch.cuda.Stream:
    """One side stream per device for the passes that overlap the dO preprocess (overlap_passes)."""
    return torch.cuda.Stream(device=device)


def auto_head_window(num_kv_heads: int, max_seqlen: int | None) -> int:
    """BwdDsBf16Config.head_window for a workload: the largest power of two dividing num_kv_heads
    whose window of documents of max_seqlen tokens holds at most WINDOW_TOKENS tokens (1 for 16k
    and longer, 16 for 1k); 1 when max_seqlen is unknown."""
    w = 1
    if max_seqlen:
        while (2 * w in HEAD_WINDOWS and num_kv_heads % (2 * w) == 0
               and 2 * w * int(max_seqlen) <= WINDOW_TOKENS):
            w *= 2
    return w


def default_config(qq, kq, kt, deterministic: bool = False, max_seqlen: int | None = None) -> BwdDsBf16Config:
    """The default BwdDsBf16Config for the forward's saved operands (kt: per-token K copy or None); the
    dQ turns and the CTA order follow `deterministic` (reduce_dq, BwdDsBf16Config.raster), the
    order's head window the longest document (auto_head_window; not in the deterministic mode's order)."""
    hk = kq.data_td.shape[1]
    return BwdDsBf16Config(head_dim=qq.data_td.shape[2], qhead_per_kvhead=qq.data_td.shape[1] // hk,
                           diagonal_copy=kt is not None, deterministic=deterministic,
                           head_window=1 if deterministic else auto_head_window(hk, max_seqlen))


def flamia_bwd_dsbf16_sm90_from_saved(dout, out, lse, qq, kq, vq, kt, vt, cu_seqlens, max_seqlen, softmax_scale,
                                      config: BwdDsBf16Config | None = None, **kw):
    """Convenience entry from the forward's saved QuantizedTHD operands (kt, vt: per-token copies or None;
    V's transposed copies in P-fragment order, as the forward reads them)."""
    block = kt is not None
    for name, x in (("vq", vq), ("vt", vt)):
        if x is not None and (x.data_dt is None or not x.dt_pv_order):
            raise ValueError(f"{name}.data_dt must be V^T in P-fragment order (quantize with pv_order=True)")
    if config is None:
        config = default_config(qq, kq, kt, max_seqlen=max_seqlen)
    return flamia_bwd_dsbf16_sm90(
        dout, out, lse, qq.data_td, qq.scale, kq.data_td, kq.scale, vq.data_dt, vq.scale,
        kt.data_td if block else None, kt.scale if block else None,
        vt.data_dt if block else None, vt.scale if block else None,
        cu_seqlens, max_seqlen, softmax_scale, config, **kw,
    )
