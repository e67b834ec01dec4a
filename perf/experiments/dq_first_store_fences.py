"""Ablation (outputs checked against the zero-filled build, ordering NOT guaranteed): dq_first_store with
its memory fences traced as nothing, against the zero-filled default, kernel alone in rotated rounds.

Session 13 (runs s13b-s13d): dq_first_store passed its GPU tests but was +0.4..+31% slower than the
zero fill it removes, with the claim moved off the dQ buffer's path and then made non-blocking two tiles
ahead. The fences are what every version kept: a proxy fence before each TMA reduce-add (which may wait
for the warp's previous reduce-add to complete in L2/DRAM) and the acquire fence. This says whether
they are the cost. Run: BREAKDOWN_WORKLOADS=1x16k,1x64k python3 perf/experiments/dq_first_store_fences.py
"""

import os
import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))  # perf/: bench_fwd_breakdown
os.environ.setdefault("BREAKDOWN_ONLY", "ds")
os.environ.setdefault("BREAKDOWN_ROUNDS", "3")
os.environ["BREAKDOWN_DS_VARIANTS"] = "default,dQ first store"
os.environ["FLAMIA_CUTE_DISK_CACHE"] = "0"  # the patched build must not reach the cache

import flamia_cute.attention_bwd_dsbf16_sm90 as bwd  # noqa: E402

bwd.fence_proxy_async_global = lambda: None
bwd.fence_acq_rel_gpu = lambda: None

import bench_fwd_breakdown  # noqa: E402

if __name__ == "__main__":
    bench_fwd_breakdown.main()
