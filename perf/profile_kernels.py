"""Launch one kernel of interest a few times so `ncu` can profile it (perf/README.md shows the ncu line).

    python perf/profile_kernels.py bwd 16x1k          # the backward kernel alone (dO preprocessed)
    python perf/profile_kernels.py quant longtail32k  # the fused Q/K/V quantization launch
    python perf/profile_kernels.py fwd 1x16k          # the forward kernel alone (operands quantized once)
A workload is a name from flamia_cute/workloads.json or "NxL" (N documents of L tokens, L may end in k).
FWD_CONFIG='{"kv_stages": 3}' and BWD_DSBF16_CONFIG='{"head_window": 4}' override config fields.
"""

import dataclasses
import json
import os
import sys

import torch

from flamia_cute.bench import DEFAULT_WORKLOADS, Case
from flamia_cute.cute_backend import quantize_operands
from flamia_cute.sm90.attention_bwd import default_config, flamia_bwd_dsbf16_sm90_from_saved
from flamia_cute.sm90.attention_fwd import FwdConfig, flamia_fwd_sm90
from flamia_cute.sm90.bwd_preprocess import preprocess_bwd

FWD_OVERRIDES = json.loads(os.environ.get("FWD_CONFIG", "{}"))
BWD_DSBF16_OVERRIDES = json.loads(os.environ.get("BWD_DSBF16_CONFIG", "{}"))  # fields of BwdDsBf16Config


def main():
    what, name = sys.argv[1], sys.argv[2]
    wl = json.loads(DEFAULT_WORKLOADS.read_text())["workloads"]
    if name in wl:
        lengths = wl[name]
    else:  # "NxL": N documents of L tokens, L may end in k
        n, length = name.split("x")
        lengths = [int(length[:-1]) * 1024 if length.endswith("k") else int(length)] * int(n)
    case = Case(name, lengths, 16, 16, 128, "cuda").build()
    q, k, v, dout = case.sets[0]
    qq, (kq, kt), (vq, vt) = quantize_operands(q, k, v, case.cu, 128, case.max_len)
    if what == "quant":
        for _ in range(3):
            quantize_operands(q, k, v, case.cu, 128, case.max_len)
    else:
        fwd_runs = 4 if what == "fwd" else 1
        fwd_cfg = FwdConfig(128, diagonal_copy=True, **FWD_OVERRIDES)
        for _ in range(fwd_runs):
            out, lse = flamia_fwd_sm90(qq.data_td, qq.scale, kq.data_td, kq.scale, vq.data_dt, vq.scale, kt.data_td,
                                       kt.scale, vt.data_dt, vt.scale, case.cu, case.max_len, case.scale, fwd_cfg)
        delta, doq, dv_ref = preprocess_bwd(dout, out, case.cu, dv_ref_group=1)
        ds_cfg = dataclasses.replace(default_config(qq, kq, kt, max_seqlen=case.max_len), **BWD_DSBF16_OVERRIDES)
        for _ in range(3 if what.startswith("bwd") else 0):  # "bwd" (or "bwd_dsbf16", the kernel's registry name)
            flamia_bwd_dsbf16_sm90_from_saved(dout, out, lse, qq, kq, vq, kt, vt, case.cu, case.max_len,
                                              case.scale, ds_cfg, do_quantized=doq, delta=delta, dv_ref=dv_ref)
    torch.cuda.synchronize()
    print("done", what, name)


if __name__ == "__main__":
    main()
