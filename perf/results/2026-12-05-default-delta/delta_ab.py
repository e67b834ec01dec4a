"""The default recipe's D = rowsum(dO * O) from the bf16 dO (delta="input", before) against D from dO's e4m3
values (delta="quantized", the default now), on the emulator against fp64: SQNR of dQ, dK, dV over 2 input
kinds x 4 packs x 3 seeds. Run from the repository root: python perf/results/2026-12-05-default-delta/delta_ab.py"""

import dataclasses
import statistics

from flamia_cute.recipes import NAMED_RECIPES
from flamia_cute.reference import reference_attention
from flamia_cute.testing import attention_fn_for, make_inputs, sqnr_db

after = NAMED_RECIPES["fp8_tokenblock_dsbf16"]
before = dataclasses.replace(after, delta="input")
PACKS = [(517, 300, 1, 0, 130, 64), (1000,), (64,) * 12, (1, 2, 3, 200, 700)]
res = {}
for kind in ("normal", "outliers"):
    for pi, lengths in enumerate(PACKS):
        for seed in range(3):
            q, k, v, do, cu, scale = make_inputs(list(lengths), 4, 2, 128, kind, seed)
            ref = reference_attention(q, k, v, cu, cu, scale, True, do)
            for rec in (before, after):
                got = attention_fn_for(rec, scale)(q, k, v, cu, do)
                for op in ("dq", "dk", "dv"):
                    res.setdefault((kind, rec.delta, op), []).append(sqnr_db(got[op], ref[op]))
            gain = {op: round(res[(kind, "quantized", op)][-1] - res[(kind, "input", op)][-1], 2) for op in ("dq", "dk", "dv")}
            print(kind, "pack", pi, "seed", seed, "dB gained:", gain, flush=True)
for kind in ("normal", "outliers"):
    for op in ("dq", "dk", "dv"):
        a, b = res[(kind, "input", op)], res[(kind, "quantized", op)]
        d = [y - x for x, y in zip(a, b, strict=True)]
        print(f"{kind:8s} {op}: input {statistics.median(a):6.2f} dB  quantized {statistics.median(b):6.2f} dB  "
              f"diff median {statistics.median(d):+.2f} min {min(d):+.2f} max {max(d):+.2f}")
