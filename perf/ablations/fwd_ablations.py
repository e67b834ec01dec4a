#!/usr/bin/env python3
"""Where the forward kernel's tile time goes: time builds with one part of the softmax removed
(outputs are WRONG; timing only, on the GPU). Each ablation patches the traced code before its own
compile (disk cache off, memory cache cleared), so the product kernel is untouched.

    FLAMIA_CUTE_DISK_CACHE=0 python perf/ablations/fwd_ablations.py [workload ...]

Ablations (each against the full kernel in the same run):
  no exp        exp2 -> one FMUL (no MUFU.EX2: the exponentials' pipe time)
  no max        each row's max over its 32 values -> its first value (62 FMNMX fewer per tile)
  no O update   O = O * c + O_tile skipped (64 FFMA per tile: the promotion)
  skeleton      all three: GEMMs, pipelines, barriers and the rest of the softmax
"""

import functools
import json
import sys

import cutlass.cute as cute
import torch
from cutlass import Float32

import flamia_cute.sm90.attention_fwd as fwd
import flamia_cute.softmax as softmax
from flamia_cute.bench import DEFAULT_WORKLOADS, Case
from flamia_cute.compile_cache import clear_memory_cache
from flamia_cute.cute_backend import quantize_operands
from flamia_cute.schedules import causal_flops

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from bench_fwd_breakdown import graph_ms  # noqa: E402

REAL_EXP2 = cute.math.exp2
REAL_FMAX_CHAINS = softmax.fmax_chains
REAL_ACC = fwd.FlamiaFwdSm90.accumulate_o


def patch(no_exp=False, no_max=False, no_o=False):
    cute.math.exp2 = (lambda x, fastmath=True: x * Float32(0.5)) if no_exp else REAL_EXP2
    softmax.fmax_chains = (lambda vals, chains=4, combine=None: vals[0]) if no_max else REAL_FMAX_CHAINS
    fwd.FlamiaFwdSm90.accumulate_o = (lambda self, frags, c: None) if no_o else REAL_ACC
    clear_memory_cache()


ABLATIONS = {
    "full": {},
    "no exp": {"no_exp": True},
    "no max": {"no_max": True},
    "no O update": {"no_o": True},
    "skeleton": {"no_exp": True, "no_max": True, "no_o": True},
}


def main():
    wl = json.loads(DEFAULT_WORKLOADS.read_text())["workloads"]
    names = sys.argv[1:] or ["1x16k", "4x4k", "16x1k"]
    cfg = fwd.FwdConfig(128, diagonal_copy=True)
    rows = []
    for name in names:
        case = Case(name, wl[name], 16, 16, 128, "cuda").build()
        q, k, v, _ = case.sets[0]
        qq, (kq, kt), (vq, vt) = quantize_operands(q, k, v, case.cu, 128, case.max_len)
        flops = causal_flops(case.lengths, 16, 128)
        row = {"workload": name}
        run = functools.partial(fwd.flamia_fwd_sm90, qq.data_td, qq.scale, kq.data_td, kq.scale, vq.data_dt,
                                vq.scale, kt.data_td, kt.scale, vt.data_dt, vt.scale, case.cu, case.max_len,
                                case.scale, cfg)
        for label, flags in ABLATIONS.items():
            patch(**flags)
            row[label] = ms = graph_ms(run)
            row[f"TFLOP/s {label}"] = flops / (ms * 1e9)
        patch()
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
