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
