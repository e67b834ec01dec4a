"""The rotations of Q and K on the H200: what they add to the passes that carry them.

    python perf/bench_rotations.py [OUT]     # table on stdout; OUT/bench_rotations.csv (OUT or $OUT)

Per workload (16x1k, 1x16k; 16 heads, d128), GPU time of (a) the training call's Q/K/V quantization
launch (the plan's layouts) plain, with half-split RoPE, interleaved RoPE, the Hadamard transform and
RoPE + Hadamard, each at 4, 3 and 2 CTAs per SM (the launch bound: which spills least and runs
fastest decides sm90/quantize.HADAMARD_MIN_CTAS) and, with RoPE, 2 heads per CTA (lanes of two heads
share the cos/sin rows they read), and (b) the dQ conversion: torch's fp32 -> bf16
cast against the rotating conversion kernel. Kernels alone, each launch behind a GPU sleep (no host
time), medians of rotated input sets; bit-exactness of each rotated launch is tests/test_rotary.py's.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = ("16x1k", "1x16k")
H, D = 16, 128
REPS, SETS = 40, 4
ROTATIONS = {"plain": ("none", 0, False), "rope": ("half", 128, False), "rope_interleaved": ("interleaved", 128, False),
             "hadamard": ("none", 0, True), "rope_hadamard": ("half", 128, True)}


def _time(fn, n_sets=SETS):
    for i in range(3):
        fn(i % n_sets)
    torch.cuda.synchronize()
    times = []
    for r in range(REPS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)
        a.record()
        fn(r % n_sets)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> int:
    from flamia_cute.plan import qkv_launch
    from flamia_cute.quant import transposed_tokens
    from flamia_cute.rotary import RotaryConfig, kernel_tables
    from flamia_cute.sm90.quantize import _alloc_outputs, launch_fused_quantize_multi_sm90, with_rotations
    from flamia_cute.sm90.rotate import GradRotateConfig, grad_rotate_to_bf16
    from flamia_cute.testing import cu_seqlens_from_lengths

    out = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "perf/out"))
    out.mkdir(parents=True, exist_ok=True)
    wl = json.loads((REPO / "flamia_cute" / "workloads.json").read_text())["workloads"]
    rows = []
    for name in WORKLOADS:
        lengths = wl[name]
        T, docs = sum(lengths), len(lengths)
        cu = cu_seqlens_from_lengths(lengths, "cuda")
        sets = [[torch.randn(T, H, D, device="cuda").to(torch.bfloat16) for _ in range(3)] for _ in range(SETS)]
        rot = RotaryConfig().tables(max(lengths), D, "cuda")
        tables = kernel_tables(rot)
        base = qkv_launch(D, H, H, 128, max(lengths), T, docs)
        for label, (mode, rd, had) in ROTATIONS.items():
            cfg = with_rotations(base, mode, rd, had) if label != "plain" else base
            # heads_per_cta 2: a warp's lanes of two heads read the same table rows (one request)
            variants = [(b, 0) for b in (4, 3, 2)] + ([(cfg.min_ctas_per_sm, 2)] if mode != "none" else [])
            for bound, hg in variants:
                c = dataclasses.replace(cfg, min_ctas_per_sm=bound)
                if hg:
                    c = dataclasses.replace(c, parts=tuple(dataclasses.replace(p, heads_per_cta=hg) for p in c.parts))
                outs = [_alloc_outputs(c, T, transposed_tokens(T, docs), "cuda") for _ in range(SETS)]
                tabs = tables if mode != "none" else None
                us = _time(lambda i, x=sets, cu=cu, c=c, o=outs, t=tabs: launch_fused_quantize_multi_sm90(
                    x[i], cu, c, o[i], rope_tables=t))
                rows.append({"workload": name, "pass": "qkv quantization", "variant": label, "min_ctas_per_sm": bound,
                             "heads_per_cta": c.parts[0].heads_per_cta,
                             "default_bound": bound == cfg.min_ctas_per_sm and not hg, "us": round(us, 2)})
                print(rows[-1], flush=True)
        gs = [torch.randn(T, H, D, device="cuda") for _ in range(SETS)]
        rows.append({"workload": name, "pass": "dq conversion", "variant": "plain cast", "min_ctas_per_sm": "",
                     "heads_per_cta": "", "default_bound": True, "us": round(_time(lambda i, g=gs: g[i].to(torch.bfloat16)), 2)})
        for label, (mode, rd, had) in list(ROTATIONS.items())[1:]:
            gcfg = GradRotateConfig(D, mode, rd, 4 if had else 0)
            tabs = tables if mode != "none" else (None, None)
            us = _time(lambda i, g=gs, cu=cu, t=tabs, c=gcfg: grad_rotate_to_bf16(g[i], cu, *t, c))
            rows.append({"workload": name, "pass": "dq conversion", "variant": label, "min_ctas_per_sm": "",
                         "heads_per_cta": "", "default_bound": True, "us": round(us, 2)})
            print(rows[-1], flush=True)
    with open(out / "bench_rotations.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out / 'bench_rotations.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
