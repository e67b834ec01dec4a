"""Run the sm90 forward kernel on a small packed batch in one variant; print its error against the emulator.

    python perf/debug_fwd.py [--pingpong 0|1] [--stages N] [--recipe fp8_token|fp8_tokenblock] [--d 128]
Each variant runs in its own process (a device fault ends the CUDA context).
"""

import argparse
import sys

import torch

from flamia_cute.attention_fwd_sm90 import FwdConfig, flamia_fwd_sm90
from flamia_cute.emulator import emulate_forward
from flamia_cute.quant import quantize_attention_operands
from flamia_cute.recipes import Recipe
from flamia_cute.testing import make_inputs, rel_l2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pingpong", type=int, default=1)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--recipe", default="fp8_token")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--lengths", default="1,127,128,129,300")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    q, k, v, _, cu, scale = make_inputs(lengths, 2, 2, a.d, seed=1, device="cuda")
    block = 128 if a.recipe == "fp8_tokenblock" else 1
    qq, (kq, kt), (vq, vt) = quantize_attention_operands(q, k, v, cu, block)
    cfg = FwdConfig(head_dim=a.d, diagonal_copy=block > 1, kv_stages=a.stages, pingpong=bool(a.pingpong))
    out, lse = flamia_fwd_sm90(qq.data_td, qq.scale, kq.data_td, kq.scale, vq.data_dt, vq.scale,
                               kt.data_td if kt else None, kt.scale if kt else None,
                               vt.data_dt if vt else None, vt.scale if vt else None,
                               cu, max(lengths), scale, cfg, poison_outputs=True)
    torch.cuda.synchronize()
    ref_o, ref_lse, _ = emulate_forward(q, k, v, cu, cu, scale, True, Recipe.from_name(a.recipe))
    nan_o = int(torch.isnan(out.float()).sum())
    fin = torch.isfinite(ref_lse)
    print(f"variant {vars(a)}: rel_l2(O)={rel_l2(out.nan_to_num(), ref_o):.3e} "
          f"max|dLSE|={(lse - ref_lse)[fin].abs().max().item():.3e} nan_O={nan_o}")
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        if e > s:
            print(f"  doc {i} len {e - s}: rel_l2(O)={rel_l2(out[s:e].nan_to_num(), ref_o[s:e]):.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
