"""Accuracy table of recipes against fp64 (the emulator's baseline; docs/numerics.md)."""

from __future__ import annotations

from .reference import reference_attention, reference_attention_rotary
from .testing import attention_fn_for, make_inputs, rel_l2, sqnr_db

OPERANDS = ("out", "lse", "dq", "dk", "dv")


def accuracy_rows(recipes, kinds=("normal", "outliers"), lengths=(517, 300, 1, 0, 130, 64), heads_q=4, heads_kv=2,
                  head_dim=128, seed=7, device="cpu", backend="emulate", rotary=None):
    """One row per (input set, recipe): SQNR (dB) and relative L2 of O, LSE, dQ, dK, dV against fp64.
    backend: flamia_attn_varlen_func's ("cute": the kernels, on an sm_90 GPU); rotary: a RotaryConfig
    applied to Q and K in the call and in the reference."""
    rows = []
    for kind in kinds:
        q, k, v, do, cu, scale = make_inputs(list(lengths), heads_q, heads_kv, head_dim, kind, seed, device)
        if rotary is None:
            ref = reference_attention(q, k, v, cu, cu, scale, True, do)
        else:
            rot = rotary.tables(max(lengths), head_dim, device)
            ref = reference_attention_rotary(q, k, v, cu, scale, rot, do)
        for name in recipes:
            got = attention_fn_for(name, scale, backend=backend, rotary=rotary)(q, k, v, cu, do)
            row = {"inputs": kind, "recipe": name}
            for op in OPERANDS:
                row[f"{op}_sqnr_db"] = round(sqnr_db(got[op], ref[op]), 2)
                row[f"{op}_rel_l2"] = float(f"{rel_l2(got[op], ref[op]):.3e}")
            rows.append(row)
    return rows


def format_table(rows) -> str:
    head = f"| inputs | recipe | {' | '.join(f'{op} dB' for op in OPERANDS)} | O rel L2 | dQ rel L2 |"
    sep = "|" + "---|" * (len(OPERANDS) + 4)
    lines = [head, sep]
    for r in rows:
        vals = " | ".join(f"{r[f'{op}_sqnr_db']:.1f}" for op in OPERANDS)
        lines.append(f"| {r['inputs']} | {r['recipe']} | {vals} | {r['out_rel_l2']:.2e} | {r['dq_rel_l2']:.2e} |")
    return "\n".join(lines)
