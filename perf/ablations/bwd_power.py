#!/usr/bin/env python3
"""The bf16-dS backward kernel's builds (bwd_ablations.py's) sustained, with clocks: at the H200's
700 W cap time per tile is energy per tile, so a build that saves instructions but not energy gains
less here than in burst timing (docs/power.md). Each build runs for a few seconds (a CUDA graph
replayed back to back) while nvidia-smi samples the SM clock, board power and the clock-event
reasons, in alternating order (A B A B: thermal drift shows).

    BWD_POWER_BUILDS="full,zero K" python perf/ablations/bwd_power.py 1x16k
"""

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bwd_ablations as ablations  # noqa: E402
import common  # noqa: E402

SECONDS = float(os.environ.get("BWD_POWER_SECONDS", "4"))


def sustained(run, seconds):
    """ms per call over `seconds` of back-to-back graph replays (10 calls per replay), and the
    wall-clock window (time.time()) the sampler's rows are matched against."""
    g = torch.cuda.CUDAGraph()
    run()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(10):
            run()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ms, t0, t1 = run_for(g.replay, seconds)
    return ms / 10, t0, t1


def run_for(fn, seconds, sync_every=8):
    """fn() back to back for `seconds`: (ms per call, and the window (time.time()) to match the
    sampler's rows against: from 0.5 s in, the clock settling, to the end). A sync every sync_every
    calls keeps the host within a few calls of the GPU."""
    t0 = time.time()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    n = 0
    while time.time() - t0 < seconds:
        fn()
        n += 1
        if n % sync_every == 0:
            torch.cuda.synchronize()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n, t0 + 0.5, time.time()


def main():
    names = sys.argv[1:] or ["1x16k"]
    builds = [b for b in os.environ.get("BWD_POWER_BUILDS", "full,zero K").split(",") if b]
    bad = [b for b in builds if b not in ablations.ABLATIONS]
    if bad:
        raise SystemExit(f"BWD_POWER_BUILDS: unknown {bad}; known: {list(ablations.ABLATIONS)}")
    runs = ablations.build_runs(names)
    sampler = common.ClockSampler()
    results = []
    try:
        for rnd in range(2):
            for label in builds:
                ablations.patch(**ablations.ABLATIONS[label])  # compiles again (before the window)
                for name, (run, _, _) in runs.items():
                    ms, t0, t1 = sustained(run, SECONDS)
                    results.append((rnd, label, name, ms, t0, t1))
    finally:
        ablations.patch()
        sampler.stop()
    for rnd, label, name, ms, t0, t1 in results:
        print({"round": rnd, "build": label, "workload": name, "ms": round(ms, 4), **sampler.window(t0, t1)},
              flush=True)


if __name__ == "__main__":
    main()
