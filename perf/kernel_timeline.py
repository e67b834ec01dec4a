"""GPU kernel timeline of one training call (forward + backward) through the public API.

    python perf/kernel_timeline.py [workload ...]     # default: 16x1k 4x4k 1x16k

torch.profiler (CUDA activity) around one flamia_attn_varlen_func forward and autograd backward
after warm-up; prints every kernel with its GPU time, and the sum, so the small passes around the
attention kernels (quantization, preprocess, dQ zeroing and conversion) can be weighed against them.
"""

import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from flamia_cute import flamia_attn_varlen_func
from flamia_cute.bench import DEFAULT_WORKLOADS, Case

WORKLOADS = json.loads(DEFAULT_WORKLOADS.read_text())["workloads"]


def timeline(name: str) -> None:
    case = Case(name, WORKLOADS[name], 16, 16, 128, "cuda").build()
    q, k, v, dout = (t.clone().requires_grad_(i < 3) for i, t in enumerate(case.sets[0]))

    def step():
        out = flamia_attn_varlen_func(q, k, v, case.cu, case.cu, case.max_len, case.max_len, case.scale,
                                      causal=True, backend="cute")
        torch.autograd.grad(out, (q, k, v), dout)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = 0.0
    print(f"== {name}")
    for e in events:
        us = e.device_time
        total += us
        print(f"  {us:9.1f} us  {e.name[:110]}")
    print(f"  {total:9.1f} us  total GPU time of {len(events)} kernels")


if __name__ == "__main__":
    for wl in sys.argv[1:] or ["16x1k", "4x4k", "1x16k"]:
        timeline(wl)
