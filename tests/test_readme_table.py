"""perf/readme_table.py on a saved run (perf/results/2026-12-04-lean-kernels): the table and geomeans its
MANIFEST.md reports, recomputed from the CSVs alone."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "perf"))

import readme_table  # noqa: E402

RUN = ROOT / "perf" / "results" / "2026-12-04-lean-kernels"


def test_table_reproduces_the_saved_run(capsys):
    assert readme_table.main([str(RUN / "bench_graph.csv"), "--burst", str(RUN / "bench_burst.csv"),
                              "--clocks", str(RUN / "clocks_graph.csv")]) == 0
    out = capsys.readouterr().out
    assert "| 1x16k | 5.76 | 6.39 | 1.11x | 2.13 | 0.37x |" in out
    assert "| mixed16k | 2.29 | 2.34 | 1.03x | n/a |  |" in out  # cuDNN's FP8 backward: equal lengths only
    assert "1.02x (forward alone 1.06x)" in out  # the MANIFEST's 1.020x and 1.058x
    assert "forward+backward 0.989x" in out and "1830 MHz" in out


def test_speedup_is_fa4_over_ours():
    times = {("w", readme_table.OURS, "fwdbwd"): 2.0, ("w", readme_table.FA4, "fwdbwd"): 1.0}
    assert readme_table.speedups(times, "fwdbwd") == {"w": 0.5}
    assert readme_table.geomean([0.5, 2.0]) == 1.0


def test_speedup_over_cudnn_is_cudnn_over_ours():
    times = {("w", readme_table.OURS, "fwdbwd"): 2.0, ("w", readme_table.CUDNN, "fwdbwd"): 3.0}
    assert readme_table.speedups(times, "fwdbwd", baseline=readme_table.CUDNN) == {"w": 1.5}


def test_readme_h200_table_is_the_saved_h200_run(capsys):
    """Every row of the README's H200 table (ours, FA4, speedup, cuDNN, speedup) is what readme_table.py
    computes from perf/results/2026-12-05-h200-bench: the claims come from that one run."""
    run = ROOT / "perf" / "results" / "2026-12-05-h200-bench"
    assert readme_table.main([str(run / "graph" / "bench_h16_d128.csv"), "--burst",
                              str(run / "gputime" / "bench_h16_d128.csv"), "--clocks", str(run / "clocks.csv")]) == 0
    out = capsys.readouterr().out
    computed = [line for line in out.splitlines() if line.startswith("|")]
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Performance"):]
    table = section[section.index("| workload"):].split("\n\n")[0]
    assert table.splitlines() == computed
    assert len(computed) == 9  # header, rule, six workloads, geomean
    assert "commit faa1e8b, NVIDIA H200" in out
    assert "forward+backward 0.987x, forward 0.999x" in out and "0.99x for\n  forward+backward and 1.00x" in section
    assert "1740 MHz" in out and "1,740 MHz" in section
