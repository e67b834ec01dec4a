"""The cross-length causal and non-causal kernels on one H200 (H=16, D=128): time, against self-attention.

    python perf/cross_length_gpu.py --out DIR     # default: $OUT, else perf/out/cross_length

Workloads (one 16k-token document unless said):
- self_1x16k: causal self-attention, the default builds (the reference);
- cp2_rank0, cp2_rank1: the two ranks' calls of context parallelism at world size 2 (flamia_cute.distributed:
  chunks of 4k, rank 0 the queries [0, 4k) and [12k, 16k), rank 1 [4k, 8k) and [8k, 12k), each with the keys
  from the document's start): their sum against self_1x16k is the shard's overhead;
- decode_16x128: 16 documents of 4k keys with their last 128 positions as queries (a cache's prefill tail);
- noncausal_4x4k: four 4k documents, every key visible.

Modes fwd and fwdbwd (eager, the API with backend="cute", rounds rotated over the workloads); the median ms per
call and TFLOP/s over the visible pairs (4 D FLOP per pair forward, 10 D forward+backward). Writes DIR/cross.csv
and DIR/cross.log.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

H, D = 16, 128


def workloads():
    """name -> (query lengths, key lengths, causal)."""
    k4 = 4096
    return {
        "self_1x16k": ([16384], [16384], True),
        "cp2_rank0": ([k4, k4], [k4, 4 * k4], True),
        "cp2_rank1": ([k4, k4], [2 * k4, 3 * k4], True),
        "decode_16x128": ([128] * 16, [k4] * 16, True),
        "noncausal_4x4k": ([k4] * 4, [k4] * 4, False),
    }


def visible_pairs(lq, lk, causal):
    if not causal:
        return sum(a * b for a, b in zip(lq, lk, strict=True))
    total = 0
    for a, b in zip(lq, lk, strict=True):
        off = b - a
        total += sum(max(0, min(i + off + 1, b)) for i in range(a))
    return total


def make_call(lq, lk, causal, seed):
    from flamia_cute import flamia_attn_varlen_func
    from flamia_cute.testing import cu_seqlens_from_lengths

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), H, D, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(sum(lk), H, D, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    cu_q, cu_k = cu_seqlens_from_lengths(lq, "cuda"), cu_seqlens_from_lengths(lk, "cuda")
    if lq == lk:
        cu_k = cu_q  # self-attention: one tensor, as a training loop passes it

    def run(backward):
        leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
        out = flamia_attn_varlen_func(*leaves, cu_q, cu_k, max(lq), max(lk), causal=causal, backend="cute")
        if backward:
            torch.autograd.grad(out, leaves, do)

    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "perf/out/cross_length")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    log_fh = open(os.path.join(args.out, "cross.log"), "w")

    def log(msg):
        print(msg, flush=True)
        log_fh.write(msg + "\n")
        log_fh.flush()

    log(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
    wl = workloads()
    calls = {name: make_call(lq, lk, causal, i) for i, (name, (lq, lk, causal)) in enumerate(wl.items())}
    rows = []
    for mode, backward in (("fwd", False), ("fwdbwd", True)):
        for run in calls.values():  # warm-up: compiles, plans
            for _ in range(3):
                run(backward)
        torch.cuda.synchronize()
        ms = {n: [] for n in calls}
        names = list(calls)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.iters):
                    calls[name](backward)
                end.record()
                end.synchronize()
                ms[name].append(start.elapsed_time(end) / args.iters)
        for name, (lq, lk, causal) in wl.items():
            med = statistics.median(ms[name])
            tflops = visible_pairs(lq, lk, causal) * H * D * (10 if backward else 4) / med / 1e9
            rows.append({"workload": name, "mode": mode, "median_ms": f"{med:.4f}", "tflops": f"{tflops:.1f}"})
            log(f"{mode:7s} {name:15s} {med:8.3f} ms  {tflops:7.1f} TFLOP/s")
        cp = statistics.median(ms["cp2_rank0"]) + statistics.median(ms["cp2_rank1"])
        log(f"{mode}: the two cp2 ranks' calls sum to {cp / statistics.median(ms['self_1x16k']):.3f}x self_1x16k")
    with open(os.path.join(args.out, "cross.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    log_fh.close()


if __name__ == "__main__":
    main()
