"""Q quantized in the forward kernel (FwdConfig.fuse_q_quant) against the Q/K/V launch + kernel.

    python perf/bench_fuse_q.py      # table; $OUT/bench_fuse_q.json if OUT is set

Times `cute_backend.forward_kernels` (the whole forward of a call: quantization launch + kernel)
with FLAMIA_CUTE_FUSE_Q=0 and =1, for an inference call (forward_only) and a training call
(ds_bf16: what the default recipe's autograd forward runs), 16 heads x d128, fp8_tokenblock_dsbf16.
GPU time by CUDA events after a 1 ms sleep kernel, medians over rotated input sets (more than
L2), the two builds alternating per repetition. Also checks that both give the same O, LSE and
saved Q codes and scales bit for bit.
"""

from __future__ import annotations

import json
import os
import statistics

import torch

from flamia_cute.cute_backend import forward_kernels
from flamia_cute.testing import make_inputs

WORKLOADS = json.load(open(os.path.join(os.path.dirname(__file__), "..", "flamia_cute", "workloads.json")))["workloads"]
HEADS, D, BLOCK, REPS, BUFFERS = 16, 128, 128, 20, 3


def call(fuse: bool, bufs, cu, max_seqlen, scale, forward_only: bool):
    os.environ["FLAMIA_CUTE_FUSE_Q"] = "1" if fuse else "0"
    q, k, v = bufs
    return forward_kernels(q, k, v, cu, max_seqlen, scale, BLOCK, forward_only=forward_only, ds_bf16=not forward_only)


def timed(fuse, sets, cu, max_seqlen, scale, forward_only, i):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    call(fuse, sets[i % len(sets)], cu, max_seqlen, scale, forward_only)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main():
    rows = []
    for name, lengths in WORKLOADS.items():
        made = [make_inputs(lengths, heads_q=HEADS, heads_kv=HEADS, head_dim=D, seed=i, device="cuda")
                for i in range(BUFFERS)]
        sets = [m[:3] for m in made]
        cu, scale = made[0][4], made[0][5]
        for forward_only in (True, False):
            a = call(False, sets[0], cu, max(lengths), scale, forward_only)
            b = call(True, sets[0], cu, max(lengths), scale, forward_only)
            torch.cuda.synchronize()
            same = (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                    and torch.equal(a[2][0].data_td.view(torch.uint8), b[2][0].data_td.view(torch.uint8))
                    and torch.equal(a[2][0].scale, b[2][0].scale))
            times = {False: [], True: []}
            for i in range(REPS + 2):
                for fuse in ((False, True) if i % 2 == 0 else (True, False)):
                    t = timed(fuse, sets, cu, max(lengths), scale, forward_only, i)
                    if i >= 2:
                        times[fuse].append(t)
            off, on = statistics.median(times[False]), statistics.median(times[True])
            row = {"workload": name, "call": "inference" if forward_only else "training", "unfused_ms": round(off, 4),
                   "fused_ms": round(on, 4), "change_pct": round(100 * (on / off - 1), 2), "bit_identical": same}
            print(row, flush=True)
            rows.append(row)
    os.environ.pop("FLAMIA_CUTE_FUSE_Q", None)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_fuse_q.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
