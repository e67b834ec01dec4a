#!/usr/bin/env python3
"""Is FA4's bf16 training call power-capped on the H200 as ours is? (session 24: our bf16-dS backward
runs at the 700 W board limit, SW power cap, ~1.7 GHz). Each implementation's forward+backward call
runs sustained for a few seconds (back-to-back, no graphs: the API calls as training makes them)
while nvidia-smi samples the SM clock, board power and the clock-event reasons; two rounds, A B A B.

    python perf/experiments/train_call_power.py [workload]
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bwd_power import run_for, samples_in, start_sampler  # noqa: E402

from flamia_cute import flamia_attn_varlen_func  # noqa: E402
from flamia_cute.baselines.torch_impls import fa4_varlen  # noqa: E402
from flamia_cute.bench import DEFAULT_WORKLOADS, Case  # noqa: E402

SECONDS = float(os.environ.get("POWER_SECONDS", "4"))


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "1x16k"
    case = Case(name, json.loads(DEFAULT_WORKLOADS.read_text())["workloads"][name], 16, 16, 128, "cuda").build()
    q, k, v, dout = case.sets[0]
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]

    def ours():
        out = flamia_attn_varlen_func(*leaves, case.cu, case.cu, case.max_len, case.max_len, case.scale,
                                      recipe="fp8_tokenblock_dsbf16", backend="cute")
        torch.autograd.grad(out, leaves, dout)

    def fa4():
        out = fa4_varlen(*leaves, case.cu, case.max_len, case.scale)
        torch.autograd.grad(out, leaves, dout)

    impls = {"flamia fwd+bwd": ours, "fa4 fwd+bwd": fa4}
    for fn in impls.values():  # compile and warm
        fn()
    torch.cuda.synchronize()
    smi, log = start_sampler()
    results = []
    for rnd in range(2):
        for label, fn in impls.items():
            results.append((rnd, label, *run_for(fn, SECONDS, sync_every=4)))
    smi.terminate()
    smi.wait()
    for rnd, label, ms, t0, t1 in results:
        print({"round": rnd, "impl": label, "workload": name, "ms": round(ms, 4), **samples_in(log, t0, t1)},
              flush=True)


if __name__ == "__main__":
    main()
