"""The Blackwell forward's fused MXFP8 quantization (quantize_mx_sm100), timed on the H200 where it runs.

    python perf/bench_quantize_mx.py        # prints a table; writes $OUT/bench_quantize_mx.json if OUT is set

GPU time of one `quantize_mx_forward` call (one launch; `prep` times its torch part alone: the
document table past MAX_SCAN_DOCS documents, else nothing) and of its torch specification on the
GPU, CUDA events, medians over rotated inputs (more than L2 in total). Bytes: q, k, v read once (2 B per
element); the codes of Q, K, V (1 B) and the scale chunks written once.
"""

from __future__ import annotations

import json
import os
import statistics

import torch

from flamia_cute.quant.mx_layout import SF_CHUNK_BYTES, pack_mx_forward_operands, sf_slots, sf_tile_starts
from flamia_cute.sm100.quantize_mx import MAX_SCAN_DOCS, quantize_mx_forward
from flamia_cute.testing import cu_seqlens_from_lengths

PEAK_GBPS = 4300.0
REPS, BUFFERS = 30, 4
WORKLOADS = {"1x16k": [16384], "16x1k": [1024] * 16, "longtail32k": [8192, 4096] + [512] * 40}
HEADS, D = 16, 128


def gpu_ms(fn, args_list):
    times = []
    for i in range(REPS + 3):
        a = args_list[i % len(args_list)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # the host's launches never show between the events
        start.record()
        fn(*a)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    rows = []
    for name, lengths in WORKLOADS.items():
        T = sum(lengths)
        cu = cu_seqlens_from_lengths(lengths, "cuda")
        g = torch.Generator(device="cuda").manual_seed(0)
        bufs = [tuple(torch.randn(T, HEADS, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3)) + (cu,)
                for _ in range(BUFFERS)]
        got = quantize_mx_forward(*bufs[0])
        want = pack_mx_forward_operands(*bufs[0])
        exact = all(torch.equal(getattr(got, n).view(torch.uint8), getattr(want, n).view(torch.uint8))
                    for n in ("q", "k", "v"))
        slots = sf_slots(T, len(lengths))
        useful = T * HEADS * D * (3 * 2 + 3) + 3 * HEADS * slots * SF_CHUNK_BYTES
        k_ms = gpu_ms(quantize_mx_forward, bufs)
        t_ms = gpu_ms(pack_mx_forward_operands, bufs[:1])
        n_docs = len(lengths)

        def prep(q, k, v, cu, n_docs=n_docs):  # the call's torch side: the host table past MAX_SCAN_DOCS
            if n_docs > MAX_SCAN_DOCS:
                sf_tile_starts(cu)

        p_ms = gpu_ms(prep, bufs)
        rows.append(dict(workload=name, tokens=T, call_us=round(1e3 * k_ms, 1), prep_us=round(1e3 * p_ms, 1),
                         torch_spec_us=round(1e3 * t_ms, 1),
                         gbps=round(useful / k_ms / 1e6), pct_peak=round(100 * useful / k_ms / 1e6 / PEAK_GBPS, 1),
                         bit_exact=exact))
    print(f"{'workload':12s} {'tokens':>7s} {'call us':>8s} {'of it prep':>10s} {'torch spec us':>13s} {'GB/s':>6s} "
          f"{'% peak':>7s} exact")
    for r in rows:
        print(f"{r['workload']:12s} {r['tokens']:7d} {r['call_us']:8.1f} {r['prep_us']:10.1f} {r['torch_spec_us']:13.1f} "
              f"{r['gbps']:6.0f} {r['pct_peak']:7.1f} {r['bit_exact']}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_quantize_mx.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
