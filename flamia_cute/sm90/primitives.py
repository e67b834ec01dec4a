"""Device helpers shared by the sm_90a kernels (quantization, attention forward and backward).

Plain Python functions over DSL values: they are traced into whichever kernel calls them, so a
change here changes every kernel (each kernel lists this file in its compile-cache sources).
"""

from __future__ import annotations

import math
from pathlib import Path

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import arith, llvm

from ..quant import formats as _formats
from ..quant import quantize as _quant_layout
from ..quant.formats import SCALE_EXP_MAX, SCALE_EXP_MIN
from ..schedules import varlen_tiles as _tiles

# What every kernel's compile-cache key hashes besides its own file: these helpers, the quant
# layout module whose constants (DT_DOC_ALIGN, TOKEN_PAD) are baked into the kernels at trace time,
# the scale rule's exponent range (quant.formats), and the tile rules (SHORT_PAIR_ROWS, read by
# flamia_cute.varlen and tile_scheduler).
SHARED_SOURCE_FILES = (Path(__file__).resolve(), Path(_quant_layout.__file__).resolve(), Path(_formats.__file__).resolve(),
                       Path(_tiles.__file__).resolve())


def ptx(text: str, constraints: str, operands, result=Uint32, side_effects: bool = False):
    """One inline PTX statement. result: the DSL type of $0 (None for a statement without one);
    side_effects=False lets the compiler schedule (or drop) it like arithmetic."""
    value = llvm.inline_asm(
        result.mlir_type if result is not None else None,
        [x.ir_value() for x in operands],
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return result(value) if result is not None else None


def prmt(a, b, sel: int):
    return ptx("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [Uint32(a), Uint32(b), Uint32(sel)])


def byte_transpose4x4(w0, w1, w2, w3):
    """4x4 byte transpose of four words (rows): word b of the result holds byte b of w0, w1, w2, w3
    (lowest byte first). 8 prmt."""
    lo01, lo23 = prmt(w0, w1, 0x5140), prmt(w2, w3, 0x5140)
    hi01, hi23 = prmt(w0, w1, 0x7362), prmt(w2, w3, 0x7362)
    return (prmt(lo01, lo23, 0x5410), prmt(lo01, lo23, 0x7632), prmt(hi01, hi23, 0x5410),
            prmt(hi01, hi23, 0x7632))


def cvt_e4m3x4(a, b, c, d):
    """Four fp32 -> four e4m3 (RNE, satfinite) packed in a u32, `a` in the lowest byte."""
    return ptx("{\n.reg .b16 lo, hi;\n"
               "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
               "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
               "mov.b32 $0, {lo, hi};\n}",
               "=r,f,f,f,f", [Float32(a), Float32(b), Float32(c), Float32(d)])


def e4m3x2_to_bf16x2(word, high: bool, scale=None):
    """Two e4m3 bytes of a u32 (bytes 0, 1, or 2, 3 when `high`) -> two bf16 packed in a u32, the
    lower byte in the low half, times `scale` (fp32) when given. Exact: every e4m3 value is an f16
    normal or zero, and a bf16; so is its product with a power-of-two scale in bf16's range."""
    half = "hi" if high else "lo"
    scaled = "" if scale is None else "mul.f32 fa, fa, $2;\nmul.f32 fb, fb, $2;\n"
    return ptx("{\n.reg .b16 lo, hi, a, b;\n.reg .b32 h;\n.reg .f32 fa, fb;\n"
               "mov.b32 {lo, hi}, $1;\n"
               f"cvt.rn.f16x2.e4m3x2 h, {half};\n"
               "mov.b32 {a, b}, h;\n"
               "cvt.f32.f16 fa, a;\ncvt.f32.f16 fb, b;\n"
               f"{scaled}"
               "cvt.rn.bf16x2.f32 $0, fb, fa;\n}", "=r,r" if scale is None else "=r,r,f",
               [Uint32(word)] + ([] if scale is None else [Float32(scale)]))


def swizzle_bits(layout) -> tuple:
    """(B, M, S) of a swizzled shared-memory layout S<B,M,S> o outer (its str form)."""
    text = str(layout.inner)
    if not (text.startswith("S<") and text.endswith(">")):
        raise ValueError(f"not a swizzle: {text}")
    b, m, s = (int(x) for x in text[2:-1].split(","))
    return b, m, s


def _walk_words(layout, coord, elem_bytes: int, threads: int, steps: int):
    """Trace time: the 32-bit words [t][j] of the walk in which thread t visits element coord(t, j),
    each element's offset evaluated once (these walks run 2-4k CuTe evaluations per kernel build)."""
    bits = swizzle_bits(layout)
    return [[swizzled_word(int(cute.crd2idx(coord(t, j), layout.outer)) * elem_bytes, bits) for j in range(steps)]
            for t in range(threads)]


def word_walk(layout, coord, elem_bytes: int, threads: int, steps: int):
    """Trace-time plan of a walk over a swizzled layout: thread t visits element coord(t, j) at step
    j. Returns the word offsets d[j] such that word(t, j) = word(t, 0) + d[j] for EVERY thread
    (checked here on the static layout: the walk's swizzle bits must not change with j), so the
    kernel keeps one base register per walk instead of `steps` hoisted addresses. coord(t, j): a
    tuple of Python ints (the kernel evaluates coord(t, 0) on its thread index)."""
    words = _walk_words(layout, coord, elem_bytes, threads, steps)
    deltas = [w - words[0][0] for w in words[0]]
    for t, row in enumerate(words):
        if [w - row[0] for w in row] != deltas:
            raise ValueError(f"word_walk: the walk of thread {t} is not a shift of thread 0's on {layout}")
    return deltas


def xor_walk(layout, coord, elem_bytes: int, threads: int, steps: int):
    """word_walk for walks whose swizzle bits DO change with j (an accumulator fragment's column
    blocks across a swizzle atom): (xors, adds) with word(t, j) = (word(t, 0) ^ xors[j]) + adds[j]
    for EVERY thread, checked here. The unswizzled step is split at the top of the swizzle's target
    bits: the low part can only flip bits that thread 0's walk leaves clear, the high part adds."""
    b, m, _ = swizzle_bits(layout)
    low = (1 << (m + b)) - 1
    lin0 = [int(cute.crd2idx(coord(0, j), layout.outer)) * elem_bytes for j in range(steps)]
    xors = [((d - lin0[0]) & low) >> 2 for d in lin0]
    adds = [((d - lin0[0]) & ~low) >> 2 for d in lin0]
    for t, row in enumerate(_walk_words(layout, coord, elem_bytes, threads, steps)):
        for j in range(steps):
            if row[j] != (row[0] ^ xors[j]) + adds[j]:
                raise ValueError(f"xor_walk: step {j} of thread {t} is not (word ^ x) + a on {layout}")
    return xors, adds


def swizzled_word(byte, bits: tuple):
    """32-bit word of unswizzled byte offset `byte` under the swizzle S<B,M,S> = bits (swizzle_bits):
    the swizzle acts on BYTE addresses (TMA and wgmma's 32/64/128-byte modes), whatever the element
    size. Plain Python over DSL or Python integers."""
    b, m, s = bits
    return (byte ^ ((byte >> s) & (((1 << b) - 1) << m))) >> 2


def smem_word_index(layout, coord, elem_bytes: int):
    """32-bit word holding element `coord` of a swizzled shared-memory layout (S<B,M,S> o outer).
    Plain Python over DSL integers; the CPU tests evaluate it on Python ints."""
    return swizzled_word(cute.crd2idx(coord, layout.outer) * elem_bytes, swizzle_bits(layout))


def a_fragment_sources(n_acc: int) -> list:
    """Where each e4m3 A-operand register of the next wgmma takes its bytes from an m64nK fp32
    accumulator fragment of n_acc values: [(register, (4 accumulator indices, lowest byte first))].

    The B operand's K dimension comes in P-fragment order (quant.PV_ORDER16), so no data moves
    between threads: A register (32-key chunk c, 16-key half h, row r) holds the keys (2t, 2t+1,
    8+2t, 9+2t) of the half, which thread t holds in accumulator column blocks v = 4c+2h and
    4c+2h+1 (block v: keys 8v+2t, 8v+2t+1; value index v0 + 2*row + 4*v).
    """
    out = []
    for c in range(n_acc // 16):
        for h in range(2):
            vl = 4 * (4 * c + 2 * h)
            vh = vl + 4
            for r in range(2):
                out.append((4 * c + 2 * h + r, (vl + 2 * r, vl + 2 * r + 1, vh + 2 * r, vh + 2 * r + 1)))
    return out


def pack_a_fragment_e4m3(acc, out32):
    """fp32 accumulator values -> e4m3 A-operand registers, in place (see a_fragment_sources)."""
    for reg, (a, b, c, d) in a_fragment_sources(cute.size(acc)):  # plain Python: unrolled while tracing
        out32[reg] = cvt_e4m3x4(acc[a], acc[b], acc[c], acc[d])


def cvt_bf16x2(lo, hi):
    """Two fp32 -> two bf16 (RNE) packed in a u32, `lo` in the low half (the lower address)."""
    return ptx("cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", [Float32(hi), Float32(lo)])


def st_global_v4(addr, w):
    """One 16-byte global store of four u32 words (addr: Int64, 16-byte aligned)."""
    ptx("st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r,~{memory}", [Int64(addr)] + [Uint32(x) for x in w],
        result=None, side_effects=True)


def st_shared_v4(addr, w):
    """One 16-byte shared-memory store of four u32 words (addr: the 32-bit shared address, 16-byte
    aligned): the compiler does not merge word stores whose swizzled address it cannot prove aligned."""
    ptx("st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r,~{memory}", [Int32(addr)] + [Uint32(x) for x in w],
        result=None, side_effects=True)


def quad_transpose4(w, b0, b1, shfl_xor, sel):
    """4x4 word transpose across the 4 lanes of a quad: lane t gets [lane i's w[t] for i in 0..3].

    w: this lane's 4 words; b0, b1: bits 0 and 1 of the lane's index t in its quad; shfl_xor(x, k):
    x from lane t ^ k; sel(c, a, b): a if c else b. Plain Python over the primitives, so the
    CPU tests run the very same code on a lane model. Two butterfly stages (partners t^2, then
    t^1), 4 shuffles and 16 selects.
    """
    # stage 1: keep words j with bit1(j) == bit1(t), trade the other two with lane t^2
    keep = [sel(b1, w[2 + b], w[b]) for b in range(2)]
    recv = [shfl_xor(sel(b1, w[b], w[2 + b]), 2) for b in range(2)]
    # y[s1][b]: word 2*bit1(t) + b of the quad lane with bit1 = s1 and bit0 = bit0(t)
    y = [[sel(b1, recv[b], keep[b]) for b in range(2)], [sel(b1, keep[b], recv[b]) for b in range(2)]]
    # stage 2: keep word b = bit0(t), trade the other with lane t^1
    keep2 = [sel(b0, y[s][1], y[s][0]) for s in range(2)]
    recv2 = [shfl_xor(sel(b0, y[s][0], y[s][1]), 1) for s in range(2)]
    out = []
    for s in range(2):
        out += [sel(b0, recv2[s], keep2[s]), sel(b0, keep2[s], recv2[s])]
    return out


def as_f32(bits):
    return Float32(arith.bitcast(Float32.mlir_type, Int32(bits).ir_value()))


def imax(a, b):
    return Int32(cutlass.max(a, b))


def select(cond, a, b):
    return type(a)(cutlass.select_(cond, a, b))


def select_i32(cond, a, b):
    """select of two integers as Int32 (either may be a Python int): the `select` that the plain
    integer math of schedules.varlen_tiles takes while tracing."""
    return Int32(cutlass.select_(cond, Int32(a), Int32(b)))


def bf16_abs_max_bits(words, lanes: int):
    """|x| max of the bf16 pairs in `words` (u32 each) over a group of `lanes` consecutive lanes
    (a power of two; butterfly), as fp32 bits. Integer max on the |x| bits: NaN > inf > finite."""
    m = Uint32(0)
    for w in words:
        w = w & Uint32(0x7FFF7FFF)
        m = Uint32(cutlass.max(m, Uint32(cutlass.max(w & Uint32(0xFFFF), w >> 16))))
    a = Int32(m) << 16  # bf16 |x| bits -> fp32 |x| bits
    for off in range(int(math.log2(lanes))):  # plain Python: unrolled while tracing
        a = imax(a, cute.arch.shuffle_sync_bfly(a, offset=1 << off))
    return a


NAN_SCALE_BITS = 0x7FC00000  # the scale of a block holding a non-finite value (pow2_scale_bits)


def pow2_scale_bits(amax_bits):
    """(scale bits, 1/scale bits) from |x| amax bits: quant.formats.pow2_scale_from_amax_bits for e4m3
    (k <= 119: 448 * 2**119 is finite; values above saturate there).

    1/scale is exact: 2**-k stays normal.
    """
    biased = (amax_bits >> 23) & 0xFF
    k = biased - 135 + select((amax_bits & 0x7FFFFF) > 0x600000, Int32(1), Int32(0))
    k = imax(k, Int32(SCALE_EXP_MIN))
    k = Int32(cutlass.min(k, Int32(SCALE_EXP_MAX - 8)))
    scale = (k + 127) << 23
    inv = (127 - k) << 23
    # amax == 0 falls out as the smallest scale 2**-126: finite, and never the max of a scale fold
    non_finite = biased == 255
    scale = select(non_finite, Int32(NAN_SCALE_BITS), scale)
    inv = select(non_finite, Int32(NAN_SCALE_BITS), inv)
    return scale, inv


def mul_rp(a, b):
    """a * b rounded toward +inf (one FMUL.RP): a bound that the exact product never exceeds."""
    return ptx("mul.rp.f32 $0, $1, $2;", "=f,f,f", [Float32(a), Float32(b)], result=Float32)


def add_rp(a, b):
    """a + b rounded toward +inf (one FADD.RP)."""
    return ptx("add.rp.f32 $0, $1, $2;", "=f,f,f", [Float32(a), Float32(b)], result=Float32)


def f32_bits(x):
    return Int32(arith.bitcast(Int32.mlir_type, Float32(x).ir_value()))


POW2_RECIPROCAL_BITS = 0x7F000000  # (254 << 23): 2^(e-127) -> 2^(127-e) is this minus the bits


def pow2_reciprocal(x):
    """1/x, exactly, for x a power of two whose reciprocal is normal (2^-126 <= x <= 2^126): the
    exponent field negated by one integer subtract. An IEEE division (x / r in fp32) costs a
    reciprocal, five FFMAs, a check and a branch to a slow path in SASS."""
    return as_f32(Int32(POW2_RECIPROCAL_BITS) - f32_bits(x))


# Pointer kinds of the kernels' runtime entries (compile_cache.compile_launcher's arg_kinds)
ARG_F8 = ("ptr", cutlass.Float8E4M3FN, 16)
ARG_F32 = ("ptr", Float32, 4)
ARG_I32 = ("ptr", Int32, 4)
ARG_BF16 = ("ptr", cutlass.BFloat16, 16)


def tma_pipeline(stages: int, tx_bytes: int, barrier_ptr, consumer_warps: int = 8):
    """Shared-memory ring filled by TMA (one producer thread), drained by `consumer_warps` warps
    (the 8 consumer warps by default; one release per warp)."""
    return pipeline.PipelineTmaAsync.create(
        num_stages=stages, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
        tx_count=tx_bytes, barrier_storage=barrier_ptr, defer_sync=True,
    )


def warp_pipeline(stages: int, barrier_ptr, consumers: int = 256, producers: int = 32):
    """Shared-memory ring filled by the stores of `producers` threads (one warp by default), read
    by `consumers` threads (the two consumer warpgroups by default)."""
    return pipeline.PipelineAsync.create(
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producers),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumers),
        barrier_storage=barrier_ptr, defer_sync=True,
    )


def warp_scan_up(lane, *values):
    """Inclusive prefix sums over a warp's lanes of Int32 values at once (shfl.up, 5 steps)."""
    values = list(values)
    for sh in range(5):  # unrolled as it is traced
        ups = [cute.arch.shuffle_sync_up(v, offset=1 << sh) for v in values]
        values = [v + select(lane >= (1 << sh), up, Int32(0)) for v, up in zip(values, ups, strict=True)]
    return tuple(values)


@cute.jit
def group_scan_up(tid, sWarp: cute.Tensor, threads: cutlass.Constexpr, barrier_id: cutlass.Constexpr,
                  exclusive: cutlass.Constexpr, *values):
    """Prefix sums (inclusive, or exclusive: each thread's own values left out) of Int32 values over
    `threads` threads (whole warps, tid 0..threads-1) meeting at named barrier barrier_id: a warp
    scan, then each warp's total through sWarp (column i for value i) added to the later warps'."""
    lane = tid % 32
    warp = tid // 32
    inc = warp_scan_up(lane, *values)
    if lane == 31:
        for i in cutlass.range_constexpr(len(values)):
            sWarp[warp, i] = inc[i]
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
    runs = [r - v for r, v in zip(inc, values, strict=True)] if cutlass.const_expr(exclusive) else list(inc)
    for w in cutlass.range_constexpr(threads // 32):
        runs = [r + select(warp > w, sWarp[w, i], Int32(0)) for i, r in enumerate(runs)]
    return tuple(runs)
