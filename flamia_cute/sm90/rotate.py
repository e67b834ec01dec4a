"""Rotations of Q and K on Hopper (sm_90a), in the CuTe DSL: the device side of flamia_cute/rotary.py.

Device helpers act on one token row held as 16-channel slices by D/16 consecutive lanes (lane j holds
channels 16j .. 16j + 15), the layout of the fused quantization (sm90/quantize.py) and of the dQ
conversion below:
- RoPE, half-split: lane j < R = rotary_dim/32 pairs with lane j + R (one shuffle per word of the
  slice); interleaved: pairs inside the slice. cos/sin rows are read from the fp32 tables (16 or 8
  values per lane, 16-byte loads). Each product and the sum are rounded once (mul.rn, add.rn: ptxas
  may not fuse them into an FMA), as rotary.rope computes them;
- the Walsh-Hadamard transform: 4 butterfly stages inside the slice, then log2(D/16) stages across
  lanes (shuffle xor 1, 2, 4), from the lowest channel bit up, as rotary.walsh_hadamard.
The forward (the quantization) applies RoPE, rounds to bf16, then the Hadamard transform, rounds to
bf16: the bf16 rows its quantization reads are bitwise rotary.QKTransform.forward's. Every lane must
call them (shuffles): they are never under a lane-dependent branch.

The dQ conversion (`GradRotateConfig`): the backward's fp32 dQ accumulator (T, H, D) to bf16 with the
inverse transforms (Hadamard, then RoPE by -theta) applied in fp32 in the same pass, instead of a
plain cast. A token's position is its index in its document, found by a binary search of cu_seqlens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Uint32

from ..compile_cache import compile_entry, launch_on_device
from ..validation import check_kernel_tensors, int32_cu_seqlens
from .primitives import ARG_BF16, ARG_I32, SHARED_SOURCE_FILES, as_f32, cvt_bf16x2, ptx, select

SOURCE_FILES = (Path(__file__).resolve(), *SHARED_SOURCE_FILES)
SLICE = 16  # channels per lane
ROTARY_MODES = ("none", "half", "interleaved")
ARG_F32_16 = ("ptr", Float32, 16)  # the cos/sin tables: 16-byte rows


def check_rotation_fields(where: str, head_dim: int, rotary: str, rotary_dim: int, hadamard: int) -> None:
    """The rotation fields of a kernel config (QuantizeConfig, BwdDsBf16Config, GradRotateConfig)."""
    def bad(field, msg):
        raise ValueError(f"{where}.{field}: {msg}")

    if rotary not in ROTARY_MODES:
        bad("rotary", f"must be one of {ROTARY_MODES}, got {rotary!r}")
    if rotary == "none":
        if rotary_dim:
            bad("rotary_dim", f"must be 0 without rotary, got {rotary_dim}")
    else:
        align = 32 if rotary == "half" else 16  # half-split pairs whole lanes' slices
        if not isinstance(rotary_dim, int) or rotary_dim < align or rotary_dim % align or rotary_dim > head_dim:
            bad("rotary_dim", f"must be a multiple of {align} in [{align}, head_dim={head_dim}] for rotary "
                              f"{rotary!r}, got {rotary_dim!r}")
    if not isinstance(hadamard, int) or hadamard < 0:
        bad("hadamard", f"must be 0 (none) or the transform's power-of-two shift > 0, got {hadamard!r}")
    if hadamard and head_dim not in (64, 128):
        bad("hadamard", f"the Walsh-Hadamard transform runs over head dims 64 and 128, got {head_dim}")


def has_rotation(cfg) -> bool:
    return cfg.rotary != "none" or cfg.hadamard > 0


# ----------------------------------------------------------------------------------------------
# Device helpers. Plain Python over an `ops` namespace (DeviceOps here; the CPU tests run the very
# same code on a 32-lane torch model): values are whatever ops works on.
# ----------------------------------------------------------------------------------------------


def mul_add_rn(x, c, y, s):
    """x*c + y*s in fp32, each product and the sum rounded once (no FMA): rotary.rope's arithmetic."""
    return ptx("{\n.reg .f32 a, b;\nmul.rn.f32 a, $1, $2;\nmul.rn.f32 b, $3, $4;\nadd.rn.f32 $0, a, b;\n}",
               "=f,f,f,f,f", [Float32(x), Float32(c), Float32(y), Float32(s)], result=Float32)


@cute.jit
def load_table_slice(mT: cute.Tensor, pos, first, n: cutlass.Constexpr, ok):
    """n fp32 values of table row `pos` from column `first` (a multiple of n), 16-byte loads; zeros
    where not ok (no load)."""
    frag = cute.make_rmem_tensor(n, Float32)
    frag.fill(0.0)
    if ok:
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=min(128, 32 * n))
        cute.copy(atom, cute.local_tile(mT[pos, None], (n,), (first // n,)), frag)
    return frag


class DeviceOps:
    """The primitives the rotation helpers use, on the GPU."""

    sel = staticmethod(select)
    mul_add = staticmethod(mul_add_rn)
    load = staticmethod(load_table_slice)

    @staticmethod
    def shfl(v, src):
        return type(v)(cute.arch.shuffle_sync(v, offset=src))

    @staticmethod
    def shfl_xor(v, k: int):
        return type(v)(cute.arch.shuffle_sync_bfly(v, offset=k))

    @staticmethod
    def unpack(w):
        """A packed bf16 pair -> (low, high) fp32, exactly."""
        return as_f32(Int32(Uint32(w) << 16)), as_f32(Int32(Uint32(w) & Uint32(0xFFFF0000)))

    @staticmethod
    def pack(lo, hi):
        return cvt_bf16x2(lo, hi)

    @staticmethod
    def i32(x: int):
        return Int32(x)

    @staticmethod
    def f32(x: float):
        return Float32(x)


def unpack_words(ops, words):
    """Packed bf16 words -> fp32 values, the low half of each word first."""
    out = []
    for w in words:
        out += list(ops.unpack(w))
    return out


def pack_values(ops, vals):
    return [ops.pack(vals[2 * m], vals[2 * m + 1]) for m in range(len(vals) // 2)]


def rope_half_words(ops, words, j, lane, mCos, mSin, pos, ok, rotary_dim: int):
    """Half-split RoPE of one token's bf16 slice (8 packed words), result rounded to bf16. Lane j < R
    (R = rotary_dim/32) and its partner j + R split the slice's 16 frequencies: the lower lane
    computes both outputs of frequencies 0..7, the upper lane those of 8..15, so each reads 8 cos
    and 8 sin values; 4 words go each way before (the other half's inputs) and after (its outputs)."""
    R = rotary_dim // 32
    lower = j < R
    in_rot = j < 2 * R
    src = ops.sel(lower, lane + R, lane - R)
    first = SLICE * ops.sel(lower, j, j - R) + ops.sel(lower, ops.i32(0), ops.i32(SLICE // 2))
    c = ops.load(mCos, pos, first, SLICE // 2, ok & in_rot)
    s = ops.load(mSin, pos, first, SLICE // 2, ok & in_rot)
    send = [ops.sel(lower, words[4 + m], words[m]) for m in range(4)]
    recv = [ops.shfl(w, src) for w in send]
    own = [ops.sel(lower, words[m], words[4 + m]) for m in range(4)]
    a = unpack_words(ops, [ops.sel(lower, own[m], recv[m]) for m in range(4)])  # x1 of the 8 frequencies
    b = unpack_words(ops, [ops.sel(lower, recv[m], own[m]) for m in range(4)])  # x2
    y1 = pack_values(ops, [ops.mul_add(a[e], c[e], b[e], -s[e]) for e in range(SLICE // 2)])
    y2 = pack_values(ops, [ops.mul_add(b[e], c[e], a[e], s[e]) for e in range(SLICE // 2)])
    back = [ops.shfl(ops.sel(lower, y2[m], y1[m]), src) for m in range(4)]
    out = [ops.sel(lower, y1[m], back[m]) for m in range(4)] + [ops.sel(lower, back[m], y2[m]) for m in range(4)]
    return [ops.sel(in_rot, out[m], words[m]) for m in range(8)]


def rope_interleaved_words(ops, words, j, mCos, mSin, pos, ok, rotary_dim: int):
    """Interleaved RoPE of one token's bf16 slice: word m holds the pair (2m, 2m + 1) of frequency
    8j + m; result rounded to bf16."""
    in_rot = j < rotary_dim // SLICE
    c = ops.load(mCos, pos, SLICE // 2 * j, SLICE // 2, ok & in_rot)
    s = ops.load(mSin, pos, SLICE // 2 * j, SLICE // 2, ok & in_rot)
    out = []
    for m in range(SLICE // 2):
        x1, x2 = ops.unpack(words[m])
        y = ops.pack(ops.mul_add(x1, c[m], x2, -s[m]), ops.mul_add(x2, c[m], x1, s[m]))
        out.append(ops.sel(in_rot, y, words[m]))
    return out


def rope_values(ops, vals, j, lane, mCos, mSin, pos, ok, rotary: str, rotary_dim: int, inverse: bool):
    """RoPE (inverse: by -theta) of this lane's 16 fp32 channels, fp32 out (the gradient's).
    Channels >= rotary_dim pass through."""
    if rotary == "half":  # the lane pair splits the frequencies, as rope_half_words (8 values each way, twice)
        R = rotary_dim // 32
        h = SLICE // 2
        lower = j < R
        in_rot = j < 2 * R
        src = ops.sel(lower, lane + R, lane - R)
        first = SLICE * ops.sel(lower, j, j - R) + ops.sel(lower, ops.i32(0), ops.i32(h))
        c = ops.load(mCos, pos, first, h, ok & in_rot)
        s = ops.load(mSin, pos, first, h, ok & in_rot)
        recv = [ops.shfl(ops.sel(lower, vals[h + e], vals[e]), src) for e in range(h)]
        a = [ops.sel(lower, vals[e], recv[e]) for e in range(h)]  # x1 of this lane's 8 frequencies
        b = [ops.sel(lower, recv[e], vals[h + e]) for e in range(h)]  # x2
        sg = [-s[e] if not inverse else s[e] for e in range(h)]  # y1 = x1 c - x2 s (by -theta: + x2 s)
        y1 = [ops.mul_add(a[e], c[e], b[e], sg[e]) for e in range(h)]
        y2 = [ops.mul_add(b[e], c[e], a[e], -sg[e]) for e in range(h)]
        back = [ops.shfl(ops.sel(lower, y2[e], y1[e]), src) for e in range(h)]
        out = [ops.sel(lower, y1[e], back[e]) for e in range(h)] + [ops.sel(lower, back[e], y2[e]) for e in range(h)]
        return [ops.sel(in_rot, out[e], vals[e]) for e in range(SLICE)]
    in_rot = j < rotary_dim // SLICE
    c = ops.load(mCos, pos, SLICE // 2 * j, SLICE // 2, ok & in_rot)
    s = ops.load(mSin, pos, SLICE // 2 * j, SLICE // 2, ok & in_rot)
    out = []
    for m in range(SLICE // 2):
        x1, x2 = vals[2 * m], vals[2 * m + 1]
        sm = -s[m] if not inverse else s[m]
        out.append(ops.sel(in_rot, ops.mul_add(x1, c[m], x2, sm), x1))
        out.append(ops.sel(in_rot, ops.mul_add(x2, c[m], x1, -sm), x2))
    return out


def hadamard_values(ops, vals, j, lanes: int, shift: int):
    """The Walsh-Hadamard transform of a row of lanes x 16 channels (this lane's slice: vals), times
    2^-shift: butterflies (a, b) -> (a + b, a - b) over channel bits 0..3 inside the slice, then over
    the lane bits (shuffle xor), as rotary.walsh_hadamard; a collective."""
    v = list(vals)
    h = 1
    while h < SLICE:
        for base in range(0, SLICE, 2 * h):
            for i in range(base, base + h):
                a, b = v[i], v[i + h]
                v[i], v[i + h] = a + b, a - b
        h *= 2
    for sh in range(int(math.log2(lanes))):
        hi = ((j >> sh) & 1) == 1
        for e in range(SLICE):
            p = ops.shfl_xor(v[e], 1 << sh)
            v[e] = ops.sel(hi, p - v[e], v[e] + p)  # the lane with the bit clear holds a: a + b, a - b
    f = ops.f32(2.0**-shift)
    return [x * f for x in v]


def forward_rotate_words(ops, words, j, lane, lanes: int, cfg, mCos, mSin, pos, ok):
    """The quantization's rotations of one token's slice (8 packed bf16 words; returns the new ones):
    RoPE then bf16, the Hadamard transform then bf16 (rotary.QKTransform.forward). A collective.
    cfg: rotary, rotary_dim, hadamard (QuantizeConfig's fields)."""
    out = list(words)
    if cfg.rotary == "half":
        out = rope_half_words(ops, out, j, lane, mCos, mSin, pos, ok, cfg.rotary_dim)
    elif cfg.rotary == "interleaved":
        out = rope_interleaved_words(ops, out, j, mCos, mSin, pos, ok, cfg.rotary_dim)
    if cfg.hadamard:
        out = pack_values(ops, hadamard_values(ops, unpack_words(ops, out), j, lanes, cfg.hadamard))
    return out


def inverse_rotate_values(ops, vals, j, lane, lanes: int, cfg, mCos, mSin, pos, ok):
    """The gradient's inverse rotations of one token's 16 fp32 values: the Hadamard transform (times
    the same shift), then RoPE by -theta (rotary.QKTransform.backward). A collective."""
    v = list(vals)
    if cfg.hadamard:
        v = hadamard_values(ops, v, j, lanes, cfg.hadamard)
    if cfg.rotary != "none":
        v = rope_values(ops, v, j, lane, mCos, mSin, pos, ok, cfg.rotary, cfg.rotary_dim, inverse=True)
    return v


def inverse_rotate_fragment_row(ops, vals, quad, head_dim: int, cfg, mCos, mSin, pos, ok):
    """The gradient's inverse rotations of one row of a wgmma m64nD fp32 accumulator fragment (the dK
    epilogue): vals[2 n8 + e] is column 8 n8 + 2 quad + e (quad = lane % 4), so the row's 4 quad lanes
    hold it whole. The Hadamard transform runs over the column bits from the lowest (bit 0: e; bits 1, 2:
    the quad lanes, shuffle xor 1, 2; the rest: n8), times 2^-hadamard; then RoPE by -theta at row
    position pos: half-split pairs n8 with n8 + rotary_dim/16 in the same thread, interleaved pairs e = 0, 1.
    A collective over the quad."""
    v = list(vals)
    n8s = head_dim // 8
    if cfg.hadamard:
        for e0 in range(0, len(v), 2):  # bit 0
            a, b = v[e0], v[e0 + 1]
            v[e0], v[e0 + 1] = a + b, a - b
        for sh in range(2):  # bits 1, 2
            hi = ((quad >> sh) & 1) == 1
            for i in range(len(v)):
                p = ops.shfl_xor(v[i], 1 << sh)
                v[i] = ops.sel(hi, p - v[i], v[i] + p)
        h = 1
        while h < n8s:  # bits 3 ..
            for base in range(0, n8s, 2 * h):
                for n8 in range(base, base + h):
                    for e in range(2):
                        a, b = v[2 * n8 + e], v[2 * (n8 + h) + e]
                        v[2 * n8 + e], v[2 * (n8 + h) + e] = a + b, a - b
            h *= 2
        f = ops.f32(2.0**-cfg.hadamard)
        v = [x * f for x in v]
    if cfg.rotary == "half":
        half8 = cfg.rotary_dim // 16  # n8 offset of the upper half
        for n8 in range(half8):
            c = ops.load(mCos, pos, 8 * n8 + 2 * quad, 2, ok)
            s = ops.load(mSin, pos, 8 * n8 + 2 * quad, 2, ok)
            for e in range(2):
                x1, x2 = v[2 * n8 + e], v[2 * (n8 + half8) + e]
                v[2 * n8 + e] = ops.mul_add(x1, c[e], x2, s[e])
                v[2 * (n8 + half8) + e] = ops.mul_add(x2, c[e], x1, -s[e])
    elif cfg.rotary == "interleaved":
        for n8 in range(cfg.rotary_dim // 8):
            c = ops.load(mCos, pos, 4 * n8 + quad, 1, ok)
            s = ops.load(mSin, pos, 4 * n8 + quad, 1, ok)
            x1, x2 = v[2 * n8], v[2 * n8 + 1]
            v[2 * n8] = ops.mul_add(x1, c[0], x2, s[0])
            v[2 * n8 + 1] = ops.mul_add(x2, c[0], x1, -s[0])
    return v


@cute.jit
def token_position(mCu: cute.Tensor, t, num_docs, steps):
    """Index of token t inside its document: t - cu[d] for the last d with cu[d] <= t (binary search in
    `steps` = bit_length(num_docs) halvings; empty documents are skipped)."""
    lo = Int32(0)
    hi = num_docs
    for _ in cutlass.range(steps, unroll=1):
        mid = (lo + hi) >> 1
        go = mCu[mid] <= t
        live = hi - lo > 1
        lo, hi = select(live, select(go, mid, lo), lo), select(live, select(go, hi, mid), hi)
    return t - mCu[lo]


# ----------------------------------------------------------------------------------------------
# The dQ conversion: fp32 accumulator -> inverse rotations -> bf16
# ----------------------------------------------------------------------------------------------

TOKENS_PER_LANE = 4
NUM_THREADS = 256


@dataclass(frozen=True)
class GradRotateConfig:
    """The rotations whose inverses the dQ conversion applies (a Q part's fields of QuantizeConfig):
    RoPE mode and width, and the Hadamard shift (0: none)."""

    head_dim: int
    rotary: str = "none"
    rotary_dim: int = 0
    hadamard: int = 0

    def __post_init__(self):
        if self.head_dim not in (64, 128):
            raise ValueError(f"GradRotateConfig.head_dim: must be 64 or 128, got {self.head_dim}")
        check_rotation_fields("GradRotateConfig", self.head_dim, self.rotary, self.rotary_dim, self.hadamard)
        if not has_rotation(self):
            raise ValueError("GradRotateConfig: no rotation to apply (rotary 'none', hadamard 0): a plain cast")

    @property
    def lanes(self) -> int:
        return self.head_dim // SLICE

    @property
    def tokens_per_cta(self) -> int:
        return NUM_THREADS // self.lanes * TOKENS_PER_LANE


def smem_bytes(config: GradRotateConfig) -> int:
    """No shared memory: registers only."""
    return 0


class GradRotateSm90:
    def __init__(self, config: GradRotateConfig):
        self.cfg = config

    @cute.jit
    def __call__(self, g_ptr: cute.Pointer, out_ptr: cute.Pointer, cu_ptr: cute.Pointer, cos_ptr: cute.Pointer,
                 sin_ptr: cute.Pointer, T: Int32, H: Int32, num_docs: Int32, steps: Int32, table_rows: Int32,
                 stream: cuda.CUstream):
        D = self.cfg.head_dim
        hd = cute.assume(H * D, divby=D)
        mG = cute.make_tensor(g_ptr, cute.make_layout((T, H, D), stride=(hd, D, 1)))
        mOut = cute.make_tensor(out_ptr, cute.make_layout((T, H, D), stride=(hd, D, 1)))
        mCu = cute.make_tensor(cu_ptr, cute.make_layout(num_docs + 1))
        half = max(self.cfg.rotary_dim // 2, 1)
        mCos = cute.make_tensor(cos_ptr, cute.make_layout((table_rows, half), stride=(half, 1)))
        mSin = cute.make_tensor(sin_ptr, cute.make_layout((table_rows, half), stride=(half, 1)))
        tpc = self.cfg.tokens_per_cta
        self.kernel(mG, mOut, mCu, mCos, mSin, T, num_docs, steps).launch(
            grid=[(T + tpc - 1) // tpc, H, 1], block=[NUM_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mG: cute.Tensor, mOut: cute.Tensor, mCu: cute.Tensor, mCos: cute.Tensor, mSin: cute.Tensor,
               T: Int32, num_docs: Int32, steps: Int32):
        cfg = self.cfg
        L = cfg.lanes
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, _ = cute.arch.block_idx()
        lane = tidx % 32
        j = lane % L
        row = tidx // L  # this lane group's first token, TOKENS_PER_LANE rows apart
        ld_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        st_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        groups = NUM_THREADS // L
        for p in cutlass.range_constexpr(TOKENS_PER_LANE):
            t = bx * cfg.tokens_per_cta + p * groups + row
            ok = t < T
            frag = cute.make_rmem_tensor(SLICE, Float32)
            frag.fill(0.0)
            pos = Int32(0)
            if ok:
                cute.copy(ld_atom, cute.local_tile(mG[t, head, None], (SLICE,), (j,)), frag)
                pos = token_position(mCu, t, num_docs, steps)
            vals = inverse_rotate_values(DeviceOps, [frag[e] for e in range(SLICE)], j, lane, L, cfg, mCos, mSin,
                                         pos, ok)
            res = cute.make_rmem_tensor(SLICE, BFloat16)
            words = cute.recast_tensor(res, Uint32)
            packed = pack_values(DeviceOps, vals)
            for m in cutlass.range_constexpr(SLICE // 2):
                words[m] = packed[m]
            if ok:
                cute.copy(st_atom, res, cute.local_tile(mOut[t, head, None], (SLICE,), (j,)))


ARG_KINDS = (("ptr", Float32, 16), ARG_BF16, ARG_I32, ARG_F32_16, ARG_F32_16) + (("i32",),) * 5 + (("stream",),)


def compile_grad_rotate_sm90(config: GradRotateConfig, arch: str = "sm_90a", extra_options: str = "",
                             tvm_ffi: bool = False):
    """cute.compile the dQ conversion for `arch` from plain values only (no tensors, no GPU needed)."""
    return compile_entry(GradRotateSm90(config), ARG_KINDS, arch, extra_options, tvm_ffi)


def kernel_artifacts(config: GradRotateConfig, arch: str = "sm_90a"):
    from ..compile_cache import compile_artifacts

    return compile_artifacts(compile_grad_rotate_sm90, config, arch)


def grad_rotate_to_bf16(g: torch.Tensor, cu_seqlens: torch.Tensor, cos: torch.Tensor | None,
                        sin: torch.Tensor | None, config: GradRotateConfig, out: torch.Tensor | None = None):
    """bf16 (T, H, D) of the fp32 gradient g of a rotated operand, in the caller's frame: one launch on
    the current stream. cos, sin: the fp32 tables (rotary.kernel_tables; None without RoPE)."""
    from ..compile_cache import compile_launcher, target_arch

    T, H, D = g.shape
    dev = g.device
    if D != config.head_dim:
        raise ValueError(f"g has head dim {D}, config {config.head_dim}")
    if out is None:
        out = torch.empty(T, H, D, dtype=torch.bfloat16, device=dev)
    checks = [("g", g, (T, H, D), torch.float32), ("out", out, (T, H, D), torch.bfloat16)]
    rows = 1
    if config.rotary != "none":
        if cos is None or sin is None:
            raise ValueError("cos and sin are needed for a config with rotary")
        rows = cos.shape[0]
        checks += [("cos", cos, (rows, config.rotary_dim // 2), torch.float32),
                   ("sin", sin, (rows, config.rotary_dim // 2), torch.float32)]
    check_kernel_tensors(checks, dev)
    cu = int32_cu_seqlens(cu_seqlens, dev)
    num_docs = cu.numel() - 1
    if T == 0:
        return out
    if T * H * D >= 2**31:
        raise ValueError("tensor too large for 32-bit indexing")
    launch = compile_launcher(SOURCE_FILES, config, target_arch(),
                              lambda c, a, t: compile_grad_rotate_sm90(c, a, tvm_ffi=t), ARG_KINDS, None)
    launch_on_device(launch, dev, g.data_ptr(), out.data_ptr(), cu.data_ptr(),
                     cos.data_ptr() if cos is not None else 0, sin.data_ptr() if sin is not None else 0,
                     T, H, num_docs, max(num_docs, 1).bit_length(), rows)
    return out
