"""Online softmax of the attention kernels: the row statistics and the P scale fold.

Log2 domain: scores are scaled by softmax_scale * log2(e) (times the per-token Q and K scales), so
P = exp2(x - m) and LSE = ln(2) (m + log2 l). Per key tile a row's max m grows (online_max: the
running output and sum are rescaled by alpha = exp2(m_old - m_new)); the max runs as interleaved
chains (fmax_chains) and across a quad's four lanes (quad_max2).

The P scale fold (recipes FOLD_DROP, FOLD_REF_MIN): P goes to e4m3 times a fixed P_SCALE = 256 and
the V (forward) or dO (backward, dV) scales divided by a power-of-two reference r, so that the
e4m3 MMA accumulates with the scales folded in and the result is multiplied by r / 256 once. The
forward takes r per row and tile (the max visible V scale, fold_reference: the running output is
rescaled by r_prev / r, and a tile whose r is below max(r_prev * FOLD_DROP, FOLD_REF_MIN) is dropped
from P V); the backward one r per (KV head, document) (dv_fold_factor).

Large scores (docs/numerics.md, "Non-finite inputs and large magnitudes"). A row's max is rounded
up (mul_rp) before P = exp2(x - m) takes it, so P <= 1 (P * 256 <= 256 on the block-scaled tiles)
however large |S| is: the exponent x is one fused multiply-add whose exact product would otherwise
exceed a max rounded to nearest by up to half an ulp (2^7 once |S| log2e >= 2^31, an overflow). The
LSE is rounded up too (row_lse), and the backward scales it to log2 rounding up (lse_log2_up), so
its recomputed P stays <= 1 as well. Forward and backward use the same fp32 softmax_scale * log2e
(scale_log2_f32), so their products of S are the same numbers.

Used by the sm_90a forward (FlamiaFwdSm90.softmax, row_final), the sm_90a backward's P
recomputation and dV fold (FlamiaBwdDsBf16Sm90.consume, tile_step, bwd_device.store_query_vectors)
and the sm_100a forward (FlamiaFwdSm100.softmax_tile, store_o).
"""

from __future__ import annotations

import functools
import math
import struct

import cutlass.cute as cute
from cutlass import Float32

from .recipes import FOLD_DROP, FOLD_REF_MIN
from .sm90.primitives import add_rp, mul_rp, pow2_reciprocal, select

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def _f32(x: float) -> float:
    """x rounded to fp32 (nearest even), as a Python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _f32_bracket(x: float) -> tuple[float, float]:
    """The fp32 neighbours (below, above) of x (x not itself an fp32 value)."""
    f = _f32(x)
    bits = struct.unpack("I", struct.pack("f", f))[0]
    other = struct.unpack("f", struct.pack("I", bits + (1 if f < x else -1)))[0]
    return (f, other) if f < x else (other, f)


# fp32 constants on each side of ln 2 and log2 e: a positive value times the upper one, a negative
# one times the lower one, rounded up, is never below the exact product (row_lse, lse_log2_up)
LN2_DN, LN2_UP = _f32_bracket(LN2)
LOG2E_DN, LOG2E_UP = _f32_bracket(LOG2E)


@functools.lru_cache(maxsize=64)  # host time: a training step repeats one scale on every call
def scale_log2_f32(softmax_scale: float) -> float:
    """softmax_scale * log2(e) as both sm_90a kernels compute it: the fp32 product of the fp32
    operands (the backward forms it in the kernel from softmax_scale; the forward takes it from
    here), so that S * sk * sq * scale_log2 is the same number in both."""
    return _f32(_f32(float(softmax_scale)) * _f32(LOG2E))
P_SCALE = 256.0  # the recipe's fixed power-of-two P scale: P * 256 <= 256 < 448
P_SCALE_LOG2 = math.log2(P_SCALE)  # exact: P_SCALE is a power of two
# A row's max as this many interleaved FMNMX chains (fmax_chains): one serial chain, with the row
# statistics after it, held a third of the forward's off-diagonal tile's stall samples.
MAX_CHAINS = 4


def quad_max(x):
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))


def quad_max2(x, y):
    """quad_max of two rows at once: the four shuffles issue back to back, so their latencies overlap
    (the two rows' reductions done one after the other wait twice)."""
    xs, ys = cute.arch.shuffle_sync_bfly(x, offset=1), cute.arch.shuffle_sync_bfly(y, offset=1)
    x, y = cute.arch.fmax(x, xs), cute.arch.fmax(y, ys)
    xs, ys = cute.arch.shuffle_sync_bfly(x, offset=2), cute.arch.shuffle_sync_bfly(y, offset=2)
    return cute.arch.fmax(x, xs), cute.arch.fmax(y, ys)


def fmax_chains(values, chains: int = 4, combine=None):
    """max of a list as `chains` interleaved chains (value i goes to chain i % chains), then a tree
    over the chains. One chain of n dependent FMNMX (~5 cycles each) stalls the softmax; 4 chains per
    row and two rows keep the pipe full with 8 live partial maxima (a full tree would need 16 per row
    next to the accumulators in flight).
    Max is exact: the order changes nothing. combine(a, b) replaces cute.arch.fmax (tests run it on
    plain Python numbers)."""
    combine = combine or cute.arch.fmax
    vals = list(values)
    part = vals[:chains]
    for i, v in enumerate(vals[chains:]):
        part[i % chains] = combine(part[i % chains], v)
    while len(part) > 1:
        nxt = [combine(part[i], part[i + 1]) for i in range(0, len(part) - 1, 2)]
        if len(part) % 2:
            nxt.append(part[-1])
        part = nxt
    return part[0]


def quad_sum(x):
    x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
    return x + cute.arch.shuffle_sync_bfly(x, offset=2)


def two_row_max(rows):
    """The max of each of a thread's two rows' values over the row's quad (fmax_chains per row, then
    one quad_max2 for both)."""
    tmax = [fmax_chains(rows[v1], MAX_CHAINS) for v1 in range(2)]
    return list(quad_max2(tmax[0], tmax[1]))


def row_max_up(s_max, row_scale):
    """A tile's row max in the exponent's units, s_max * row_scale rounded up: never below the exact
    product of any of the row's scores with row_scale, which is what the exponent's fused
    multiply-add subtracts it from (so P <= 1)."""
    return mul_rp(s_max, row_scale)


def offset_up(m, d):
    """m - d rounded up (the block-scaled tiles' exponent offset m - 8: P * 256 <= 256 however large m)."""
    return add_rp(m, -d)


@cute.jit
def online_max(m_run, m_tile):
    """A row's new running max with a tile's max m_tile: (m_new, m_safe, alpha). m_safe is the
    exponent's offset (0 while the row has seen no visible key: exp2(-inf - 0) = 0, no NaN), alpha =
    exp2(m_run - m_safe) the factor of what the row summed so far. A NaN m_tile (a non-finite score
    scale) leaves the max as it was: fmax drops NaN, and the row's P turns NaN instead."""
    m_new = cute.arch.fmax(m_run, m_tile)
    ms = m_new
    if m_new == -Float32.inf:
        ms = Float32(0.0)
    alpha = cute.math.exp2(m_run - ms, fastmath=True)
    return m_new, ms, alpha


@cute.jit
def fold_reference(r_run, r, alpha):
    """The forward's V-scale fold for one row and tile: r (a power of two) is the max V scale of the
    row's visible keys, r_run the last kept tile's reference (negative: the previous tile was
    dropped). Returns (c, inv_r, r_new): the running output's factor alpha * r_prev / r, P's factor
    P_SCALE / r, and the new reference. A tile with r < max(r_prev * FOLD_DROP, FOLD_REF_MIN) is
    dropped (inv_r = 0, so P V += 0; the reference stays, negated): an all-zero V tile (scale 2^-126)
    would make 256 / r and r_prev / r overflow. A NaN r (a non-finite V block on a tile-uniform
    scale) is kept, never dropped: r_run turns NaN and so does the row's O (row_final), where a
    dropped tile would leave O finite and silently without that block."""
    c = alpha
    rr = abs(r_run)
    inv_r = Float32(0.0)  # stays 0 for a dropped row: P V += 0 (uniform tiles: convert_p)
    r_new = -rr  # the sign marks a dropped row and costs no register (|r| is a free modifier)
    if not (r < cute.arch.fmax(rr * Float32(FOLD_DROP), Float32(FOLD_REF_MIN))):
        # r is a power of two in [FOLD_REF_MIN, 2^120]: 1/r exact and normal, no division
        inv_1 = pow2_reciprocal(r)
        inv_r = Float32(P_SCALE) * inv_1
        c = alpha * (rr * inv_1)
        r_new = r
    return c, inv_r, r_new


def row_lse(m, l_sum):
    """LSE = ln2 * (m + log2 l) of a row with a positive sum (log2 domain statistics), rounded up:
    lse_log2_up(LSE) is then at least m + log2 l, the backward's P at most 1 (a NaN sum gives NaN)."""
    u = add_rp(m, cute.math.log2(l_sum, fastmath=False))
    return mul_rp(u, select(u >= Float32(0.0), Float32(LN2_UP), Float32(LN2_DN)))


def lse_log2_up(lse):
    """The backward's lse * log2e, rounded up (never below the forward's m + log2 l: row_lse)."""
    return mul_rp(lse, select(lse >= Float32(0.0), Float32(LOG2E_UP), Float32(LOG2E_DN)))


def recompute_p(s, key_scale, query_scale_log2, lse_log2):
    """The backward's P (or P^T) from the forward's statistics: exp2(s * sk * sq scale log2e - lse
    log2e), s the raw e4m3 product, lse_log2 from lse_log2_up (so P <= 1).

    The two factors are multiplied first (exactly: sk is a power of two), so s * (sq ... sk) rounds
    once, as s * sk * (sq ...) did. A query column outside the document has the factor 0: its value
    is exactly 0 even where s * sk alone would overflow (a K scale near the top of the range), which
    would otherwise be inf * 0 = NaN in a dQ tile row of the next document."""
    return cute.math.exp2(s * (query_scale_log2 * key_scale) - lse_log2, fastmath=True)


def dv_fold_factor(dv_ref):
    """The backward's dV fold: P^T * sdo * (256 / r) with one power-of-two r per (KV head, document)
    (the max dO scale there, at least FOLD_REF_MIN). Returns (r, P_SCALE / r)."""
    r = cute.arch.fmax(dv_ref, Float32(FOLD_REF_MIN))
    return r, Float32(P_SCALE) / r
