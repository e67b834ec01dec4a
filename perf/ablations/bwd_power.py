#!/usr/bin/env python3
"""The bf16-dS backward kernel's builds (bwd_ablations.py's) sustained, with clocks: at the H200's
700 W cap time per tile is energy per tile, so a build that saves instructions but not energy gains
less here than in burst timing (docs/power.md). Each build runs for a few seconds (a CUDA graph
replayed back to back) while nvidia-smi samples the SM clock, board power and the clock-event
reasons, in alternating order (A B A B: thermal drift shows).

    FLAMIA_CUTE_DISK_CACHE=0 BWD_POWER_BUILDS="full,zero K" python perf/ablations/bwd_power.py 1x16k
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bwd_ablations as ablations  # noqa: E402

FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"
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


def start_sampler():
    """nvidia-smi sampling FIELDS every 50 ms into a temporary csv: (the process, the file), one second
    after its start (samples_in reads the file)."""
    log = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=log, stderr=subprocess.STDOUT)
    time.sleep(1.0)
    return smi, log


def main():
    names = sys.argv[1:] or ["1x16k"]
    builds = [b for b in os.environ.get("BWD_POWER_BUILDS", "full,zero K").split(",") if b]
    runs = ablations.build_runs(names)
    smi, log = start_sampler()
    results = []
    for rnd in range(2):
        for label in builds:
            ablations.patch(**ablations.ABLATIONS[label])  # compiles again (~15 s, before the window)
            for name, (run, _) in runs.items():
                ms, t0, t1 = sustained(run, SECONDS)
                results.append((rnd, label, name, ms, t0, t1))
    ablations.patch()
    smi.terminate()
    smi.wait()
    for rnd, label, name, ms, t0, t1 in results:
        print({"round": rnd, "build": label, "workload": name, "ms": round(ms, 4), **samples_in(log, t0, t1)},
              flush=True)


def samples_in(log, t0, t1) -> dict:
    """The nvidia-smi rows (FIELDS, csv in `log`) sampled between t0 and t1 (time.time()): their count,
    median and min SM clock, median power, max temperature and the clock-event reasons seen."""
    log.seek(0)
    rows = []
    for line in log.read().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            ts = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            ts += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
            rows.append((ts, float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
        except (ValueError, IndexError):
            pass
    win = [r for r in rows if t0 <= r[0] <= t1]
    if not win:
        return {"samples": 0}
    return {"samples": len(win), "sm_mhz_median": statistics.median(r[1] for r in win),
            "sm_mhz_min": min(r[1] for r in win), "power_w_median": round(statistics.median(r[2] for r in win), 1),
            "temp_c_max": max(r[3] for r in win), "clock_event_reasons": sorted({r[4] for r in win})}


if __name__ == "__main__":
    main()
