"""Host-side profile of one flamia_attn_varlen_func call (where the launch overhead goes).

    python perf/profile_api.py [workload] [fwd|bwd]     # bwd: one autograd backward of a kept graph
"""

import cProfile
import io
import json
import pstats
import sys
import time

import torch

from flamia_cute import flamia_attn_varlen_func
from flamia_cute.bench import DEFAULT_WORKLOADS, Case


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "16x1k"
    lengths = json.loads(DEFAULT_WORKLOADS.read_text())["workloads"][name]
    case = Case(name, lengths, 16, 16, 128, "cuda").build()
    q, k, v, do = case.sets[0]
    mode = sys.argv[2] if len(sys.argv) > 2 else "fwd"
    if mode == "bwd":
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = flamia_attn_varlen_func(*leaves, case.cu, case.cu, case.max_len, case.max_len, case.scale)

        def call():
            return torch.autograd.grad(out, leaves, do, retain_graph=True)
    else:
        def call():
            return flamia_attn_varlen_func(q, k, v, case.cu, case.cu, case.max_len, case.max_len, case.scale)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        call()
    host = (time.perf_counter() - t0) / 20
    torch.cuda.synchronize()
    print(f"{mode}: host time per call (no sync): {host * 1e3:.3f} ms")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        call()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue()[:6000])


if __name__ == "__main__":
    main()
