#!/usr/bin/env python3
"""The bf16-dS backward kernel with dK's product on e4m3 (BwdDsBf16Config.dk_e4m3) against the
default build, kernel alone (the backward call from saved operands, dO's quantization, D and the dV
reference precomputed), CUDA graphs, rounds in rotated order.

    python perf/experiments/bwd_dk_e4m3.py [workload ...]
"""

import dataclasses
import statistics
import sys
from pathlib import Path

import torch

import flamia_cute.attention_bwd_dsbf16_sm90 as bwd

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_fwd_breakdown import graph_ms  # noqa: E402
from bwd_ablations import saved_operands  # noqa: E402

ROUNDS = 3


def main():
    names = sys.argv[1:] or ["1x16k", "4x4k", "16x1k"]
    for name in names:
        case, saved, pre, q_bf16 = saved_operands(name)
        qq, kq, kt = saved[3], saved[4], saved[6]
        base = bwd.default_config(qq, kq, kt, max_seqlen=case.max_len)
        builds = {"default": (base, dict(q_bf16=q_bf16)),
                  "dk_e4m3": (dataclasses.replace(base, dk_e4m3=True), dict(q_dt=qq.data_dt))}
        runs = {}
        for label, (cfg, kw) in builds.items():
            def run(cfg=cfg, kw=kw):
                return bwd.flamia_bwd_dsbf16_sm90_from_saved(*saved, config=cfg, **pre, **kw)
            runs[label] = run
        grads = {label: run() for label, run in runs.items()}
        torch.cuda.synchronize()
        times = {label: [] for label in runs}
        labels = list(runs)
        for r in range(ROUNDS):
            for label in labels[r % 2:] + labels[: r % 2]:
                times[label].append(graph_ms(runs[label]))
        med = {label: statistics.median(t) for label, t in times.items()}
        g0, g1 = grads["default"], grads["dk_e4m3"]
        dk_diff = float((g1[1].float() - g0[1].float()).norm() / g0[1].float().norm())
        print({"workload": name, **{f"{k} ms": round(v, 4) for k, v in med.items()},
               "dk_e4m3 vs default": f"{100 * (med['dk_e4m3'] / med['default'] - 1):+.1f}%",
               "rounds": {k: [round(x, 4) for x in v] for k, v in times.items()},
               "dV equal": bool(torch.equal(g0[2], g1[2])), "dK rel diff": round(dk_diff, 4)}, flush=True)


if __name__ == "__main__":
    main()
