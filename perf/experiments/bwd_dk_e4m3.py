#!/usr/bin/env python3
"""The bf16-dS backward kernel with dK's product on e4m3 (BwdDsBf16Config.dk_e4m3) against the
default build, kernel alone (the backward call from saved operands, dO's quantization, D and the dV
reference precomputed), CUDA graphs, rounds in rotated order.

    python perf/experiments/bwd_dk_e4m3.py [workload ...]
"""

import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

import flamia_cute.attention_bwd_dsbf16_sm90 as bwd
from flamia_cute.attention_bwd_sm90 import preprocess_bwd
from flamia_cute.attention_fwd_sm90 import FwdConfig, flamia_fwd_sm90
from flamia_cute.bench import DEFAULT_WORKLOADS, Case
from flamia_cute.codes_sm90 import e4m3_codes_to_bf16
from flamia_cute.cute_backend import quantize_operands

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_fwd_breakdown import graph_ms  # noqa: E402

ROUNDS = 3


def main():
    wl = json.loads(DEFAULT_WORKLOADS.read_text())["workloads"]
    names = sys.argv[1:] or ["1x16k", "4x4k", "16x1k"]
    for name in names:
        case = Case(name, wl[name], 16, 16, 128, "cuda").build()
        q, k, v, dout = case.sets[0]
        qq, (kq, kt), (vq, vt) = quantize_operands(q, k, v, case.cu, 128, case.max_len, ds_bf16=True, q_transposed=True)
        out, lse = flamia_fwd_sm90(qq.data_td, qq.scale, kq.data_td, kq.scale, vq.data_dt, vq.scale, kt.data_td,
                                   kt.scale, vt.data_dt, vt.scale, case.cu, case.max_len, case.scale,
                                   FwdConfig(128, diagonal_copy=True))
        delta, doq, dv_ref = preprocess_bwd(dout, out, case.cu, dv_ref_group=1)
        q_bf16 = e4m3_codes_to_bf16(qq.data_td, qq.scale)
        base = bwd.default_config(qq, kq, kt, max_seqlen=case.max_len)
        builds = {"default": (base, dict(q_bf16=q_bf16)),
                  "dk_e4m3": (dataclasses.replace(base, dk_e4m3=True), dict(q_dt=qq.data_dt))}
        runs = {}
        for label, (cfg, kw) in builds.items():
            def run(cfg=cfg, kw=kw):
                return bwd.flamia_bwd_dsbf16_sm90_from_saved(dout, out, lse, qq, kq, vq, kt, vt, case.cu, case.max_len,
                                                             case.scale, config=cfg, do_quantized=doq, delta=delta,
                                                             dv_ref=dv_ref, **kw)
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
