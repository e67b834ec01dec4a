"""The sm_100a forward's static resource plan, without the DSL: pipeline depths and tensor-memory
columns. The kernel (attention_fwd.py) builds from it and checks its layouts against it while
tracing; the hazard model (hazards.py) and the budget tests read it."""

from __future__ import annotations

from ..quant.mx_layout import MX_TILE

TMEM_COLS = 512  # allocated (a power of two); the plan below uses fewer
S_STAGES = 2  # S (then P over it) in tensor memory: the diagonal tile uses both
P_STAGES = 2  # softmax -> MMA: P written over S stage `index`, its scales in shared chunk `index`
O_STAGES = 1
SF_TMEM_COLS = 4  # one 512-byte scale chunk in tensor memory (tcgen05.cp 4x32x128b: 4 columns)
SF_CHUNKS = ("SFQ", "SFK", "SFP", "SFV")


def fwd_tmem_plan(head_dim: int = 128) -> dict[str, tuple[int, int]]:
    """Columns [lo, hi) of each tensor-memory buffer: S stages, O, then the scale chunks."""
    t = MX_TILE
    plan = {f"S{i}": (t * i, t * (i + 1)) for i in range(S_STAGES)}
    col = S_STAGES * t
    plan["O"] = (col, col + head_dim)
    col += head_dim
    for name in SF_CHUNKS:
        plan[name] = (col, col + SF_TMEM_COLS)
        col += SF_TMEM_COLS
    return plan


def fwd_tmem_cols_used(head_dim: int = 128) -> int:
    return max(hi for _, hi in fwd_tmem_plan(head_dim).values())


# The backward (planned; no kernel yet), FA4's flash_bwd_sm100 layout: one CTA per (KV head, 128-key
# block), looping over query tiles. Tensor-memory columns follow an accumulator's N, and in the
# transposed backward S^T = K Q^T and dP^T = V dO^T have the query tile as N. At 128x128 tiles S^T,
# dP^T, dV and dK take 4 x 128 = 512 columns and leave none for dQ or the MX scale chunks, so the plan
# takes 64-query tiles: S^T and dP^T 64 columns each, dQ (64 x head_dim) over both once P^T and dS^T
# are consumed (FA4's 2-CTA plan also puts dQ over S), then dV, dK, and ten 4-column scale chunks:
# 64 + 64 + 128 + 128 + 40 = 424 of 512 at head_dim 128.
BWD_KEY_TILE = 128
BWD_QUERY_TILE = 64
# one chunk per block-scaled operand: t = scaled along the queries (or, for Kt, along the keys)
BWD_SF_CHUNKS = ("SFK", "SFQ", "SFV", "SFdO", "SFP", "SFdOt", "SFdSt", "SFQt", "SFdS", "SFKt")


def bwd_tmem_plan(head_dim: int = 128, query_tile: int = BWD_QUERY_TILE) -> dict[str, tuple[int, int]]:
    """Columns [lo, hi) of the backward's tensor-memory buffers. P^T's e4m3 codes go over S^T's first
    query_tile // 4 columns, dS^T's over dP^T's; dQ overlaps S^T and dP^T."""
    if 2 * query_tile < head_dim:
        raise ValueError(f"dQ ({head_dim} columns) does not fit over S^T and dP^T ({2 * query_tile})")
    plan = {"S": (0, query_tile), "dP": (query_tile, 2 * query_tile), "dQ": (0, head_dim)}
    col = 2 * query_tile
    for name in ("dV", "dK"):
        plan[name] = (col, col + head_dim)
        col += head_dim
    for name in BWD_SF_CHUNKS:
        plan[name] = (col, col + SF_TMEM_COLS)
        col += SF_TMEM_COLS
    if col > TMEM_COLS:
        raise ValueError(f"backward plan needs {col} tensor-memory columns, {TMEM_COLS} allocated")
    return plan


def bwd_tmem_cols_used(head_dim: int = 128, query_tile: int = BWD_QUERY_TILE) -> int:
    return max(hi for _, hi in bwd_tmem_plan(head_dim, query_tile).values())
