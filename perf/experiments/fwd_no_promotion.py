"""CPU experiment: the forward's O accumulated in the tensor core across key tiles (no per-tile promotion).

A forward with three consumer warpgroups has at most 162 registers per thread, too few for both the
fresh P V tile accumulator (acc_t) and the fp32 running output (acc_o) at D = 128. Without acc_t, P V
accumulates into O itself, every wgmma truncating O with its products (testing.fp8_mma_truncated's
model, here with an initial accumulator). This measures what that costs against fp64 on one long
document, beside the per-tile promotion the kernels do. Block-scaled recipe, uniform tiles (the
diagonal tile's per-token fold is left out: it is one tile of many).

Usage: python perf/experiments/fwd_no_promotion.py [tokens ...]   (default 2048 8192; each with V's
mean 0 and 4)
"""

from __future__ import annotations

import math
import sys

import torch

from flamia_cute.quant.formats import E4M3, cast_to
from flamia_cute.quant.quantize import quantize_attention_operands
from flamia_cute.reference import reference_attention
from flamia_cute.testing import make_inputs, rel_l2, sqnr_db


def mma_truncated_from(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bits: int, kstep: int = 32):
    """acc + a @ b with the k-chain truncation of testing.fp8_mma_truncated, acc included."""
    acc, a, b = acc.double(), a.double(), b.double()
    for k0 in range(0, a.shape[1], kstep):
        add = torch.cat([acc[:, None, :], a[:, k0 : k0 + kstep, None] * b[None, k0 : k0 + kstep, :]], 1)
        mx = add.abs().amax(1, keepdim=True)
        grid = torch.exp2(torch.floor(torch.log2(torch.where(mx > 0, mx, 1.0))) - (bits - 1))
        acc = (torch.trunc(add / grid) * grid).sum(1)
    return acc


def run(tokens: int, bits: int = 14, seed: int = 0, v_mean: float = 0.0):
    """v_mean: added to V (a channel mean makes O large against each tile's products, so the
    truncation of O inside the wgmma chain shows; zero-mean V cancels in O)."""
    q, k, v, _, cu, scale = make_inputs([tokens], heads_q=1, heads_kv=1, head_dim=128, seed=seed)
    v = (v.float() + v_mean).to(v.dtype)
    qq, (kq, _), (vq, _) = quantize_attention_operands(q, k, v, cu, 128)
    ref = reference_attention(q, k, v, cu, cu, scale)["out"][:, 0].double()
    Q = qq.data_td[:, 0].double() * qq.scale[0][:, None].double()
    K = kq.data_td[:, 0].double() * kq.scale[0][:, None].double()
    vc = vq.data_td[:, 0].double()  # V's e4m3 codes, token-major
    vs = vq.scale[0].double()  # per token: its 128-token block's scale
    outs = {}
    for mode in ("promoted", "accumulated"):
        o = torch.zeros(tokens, 128, dtype=torch.float64)
        for m0 in range(0, tokens, 128):
            rows = slice(m0, min(m0 + 128, tokens))
            s = (Q[rows] @ K[: rows.stop].T) * scale
            s = s.masked_fill(torch.arange(rows.stop)[None, :] > torch.arange(m0, rows.stop)[:, None], -math.inf)
            mrun = torch.full((rows.stop - m0,), -math.inf, dtype=torch.float64)
            lrun = torch.zeros_like(mrun)
            acc = torch.zeros(rows.stop - m0, 128, dtype=torch.float64)
            for n0 in reversed(range(0, rows.stop, 128)):
                cols = slice(n0, min(n0 + 128, rows.stop))
                st = s[:, cols]
                mnew = torch.maximum(mrun, st.amax(1))
                alpha = torch.exp(mrun - mnew)
                p = torch.exp(st - mnew[:, None])
                lrun = lrun * alpha + p.sum(1)
                p8 = cast_to((p * 256).float(), E4M3).double()
                vcode = vc[cols]
                w = vs[cols][0]  # uniform tile: one V scale (its 128-token block)
                if mode == "promoted":  # the kernels: a fresh fp8 accumulation per tile, promoted in fp32
                    acc = acc * alpha[:, None] + mma_truncated_from(torch.zeros_like(acc), p8, vcode, bits) * w
                else:  # FA3's way: P V into O itself (O rescaled in fp32 to this tile's units, exactly)
                    acc = mma_truncated_from(acc * alpha[:, None] / w, p8, vcode, bits) * w
                mrun = mnew
            o[rows] = acc / 256 / lrun[:, None]
        outs[mode] = o
    for mode, o in outs.items():
        print(f"{tokens:6d} tokens, V mean {v_mean:g}, {bits} bits, {mode:11s}: rel_l2 vs fp64 {rel_l2(o, ref):.3e}, "
              f"SQNR {sqnr_db(o, ref):.2f} dB, mean(O)/mean(ref) over |.| {float(o.abs().mean() / ref.abs().mean()):.4f}")


if __name__ == "__main__":
    for n in [int(a) for a in sys.argv[1:]] or [2048, 8192]:
        for mean in (0.0, 4.0):
            run(n, v_mean=mean)
