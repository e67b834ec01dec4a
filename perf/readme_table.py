"""The README's performance table from one `flamia-cute bench` run: ours against FA4 and cuDNN FP8 per
workload (forward+backward), the geomeans (against FA4 forward+backward and forward alone, against cuDNN
forward+backward over the workloads it runs), and with --burst the
burst run's geomeans; --clocks adds the median SM clock under load from gpu_session.sh's clocks.csv.

    python perf/readme_table.py DIR/graph/bench_h16_d128.csv --burst DIR/gputime/bench_h16_d128.csv --clocks DIR/clocks.csv

Every number comes from the CSVs given, so the table and its claims are from one run. Rows keep the
workloads' order in flamia_cute/workloads.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import pathlib
import statistics
import sys

OURS, FA4, CUDNN = "flamia_fp8_tokenblock_dsbf16", "fa4_bf16", "cudnn_fp8"
WORKLOADS = pathlib.Path(__file__).resolve().parent.parent / "flamia_cute" / "workloads.json"


def load(path) -> dict:
    """{(workload, impl, mode): ms or None (skipped, with its reason)} and the run's commit and GPU."""
    times, meta, reasons = {}, {}, {}
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            key = (row["workload"], row["impl"], row["mode"])
            times[key] = float(row["ms"]) if row.get("ms") else None
            if row.get("skipped"):
                reasons[key] = row["skipped"]
            meta = {k: row.get(k, "") for k in ("commit", "gpu", "timing", "flash_attn", "cudnn", "torch", "dsl_cuda")}
    return {"times": times, "meta": meta, "reasons": reasons}


def geomean(xs) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def speedups(times: dict, mode: str, ours: str = OURS, baseline: str = FA4) -> dict:
    """{workload: baseline ms / ours ms} where both ran."""
    out = {}
    for (w, impl, m), ms in times.items():
        if impl == ours and m == mode and ms:
            base = times.get((w, baseline, mode))
            if base:
                out[w] = base / ms
    return out


def clock_mhz(path) -> float | None:
    """The median SM clock over the samples under load (> 300 W) of nvidia-smi's CSV (gpu_session.sh)."""
    clocks = []
    for line in pathlib.Path(path).read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:  # with or without nvidia-smi's units ("1830 MHz", "650.2 W")
            if len(parts) >= 3 and float(parts[2].split()[0]) > 300:
                clocks.append(float(parts[1].split()[0]))
        except (ValueError, IndexError):
            continue
    return statistics.median(clocks) if clocks else None


def table(run: dict, order: list[str], ours: str = OURS) -> list[str]:
    t = run["times"]
    lines = ["| workload | ours ms | FA4 ms | speedup over FA4 | cuDNN FP8 ms | speedup over cuDNN |",
             "|---|---|---|---|---|---|"]
    sp, sc = speedups(t, "fwdbwd", ours), speedups(t, "fwdbwd", ours, CUDNN)

    def ms(x):
        return f"{x:.3g}" if x else "n/a"

    for w in order:
        mine, fa4, cud = (t.get((w, impl, "fwdbwd")) for impl in (ours, FA4, CUDNN))
        if mine is None and fa4 is None:
            continue
        lines.append(f"| {w} | {ms(mine)} | {ms(fa4)} | {f'{sp[w]:.2f}x' if w in sp else 'n/a'} | {ms(cud)} | "
                     f"{f'{sc[w]:.2f}x' if w in sc else ''} |")
    g, gf, gc = geomean(sp.values()), geomean(speedups(t, "fwd", ours).values()), geomean(sc.values())
    lines.append(f"| geomean | | | {f'{g:.2f}x (forward alone {gf:.2f}x)' if g and gf else 'n/a'} | | "
                 f"{f'{gc:.2f}x' if gc else ''} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("graph", help="bench CSV of the sustained run (--sustain S --graph)")
    ap.add_argument("--burst", help="bench CSV of the burst run (--gpu-time) of the same session")
    ap.add_argument("--clocks", help="clocks.csv (nvidia-smi samples) of the session")
    args = ap.parse_args(argv)
    order = list(json.loads(WORKLOADS.read_text())["workloads"])
    run = load(args.graph)
    print("\n".join(table(run, order)))
    m = run["meta"]
    print(f"\nsustained run: commit {m.get('commit')}, {m.get('gpu')}, torch {m.get('torch')}, cuDNN frontend "
          f"{m.get('cudnn')}, timing {m.get('timing')}, "
          f"the DSL's CUDA {m.get('dsl_cuda') or '13.4 (the bundle; not recorded)'} libraries")
    if args.burst:
        b = load(args.burst)["times"]
        gb, gbf = geomean(speedups(b, "fwdbwd").values()), geomean(speedups(b, "fwd").values())
        print(f"burst geomean against FA4: forward+backward {gb:.3f}x, forward {gbf:.3f}x" if gb and gbf else
              "burst: no pair of ours and FA4")
    if args.clocks:
        c = clock_mhz(args.clocks)
        print(f"median SM clock under load: {c:.0f} MHz" if c else "clocks: no sample above 300 W")
    return 0


if __name__ == "__main__":
    sys.exit(main())
