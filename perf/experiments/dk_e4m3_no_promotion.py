"""CPU experiment: dK = dS^T Q on e4m3 without a per-tile promotion (NOTES, session 23, next item 2).

Today's backward runs dK (and dQ) on bf16 wgmma, whose fp32 accumulation holds dK across every query
tile of a CTA. On e4m3 the wgmma chain truncates its accumulator at ~13 bits (session 21, measured on
the H200), so session 6's e4m3-dS kernel promoted dK per 128-query tile (a fresh accumulator, 64 more
registers per thread at d128: the register wall). This measures, for key block 0 of one document (the
longest chain: every query), dK's error against fp64 for:
- bf16: bf16(dS) times Q's e4m3 codes with their per-token scales (exact in bf16), fp32 accumulation;
- e4m3 promoted: dS * sq quantized per (key, 128-query tile) to e4m3, each tile's product truncated
  as the chain does, then added exactly (session 6's numerics);
- e4m3 tile-scale chained: one scale per 128-query tile for all of the block's keys (codes that dQ's
  product could share), the running max over the tiles, the accumulator rescaled when it grows;
- e4m3 chained: dS * sq quantized with ONE power-of-two scale per key for the whole block (from the
  exact max: the best case; x16: a loose bound), every query's product through one truncated chain.
Q gets a channel mean (q_mean) because dK's sum over queries grows with it, as O's did with V's mean.
Only dK's product is varied: P, dP and D are exact (fp64), so the figures isolate the dS cast and the
accumulation.

Usage: python perf/experiments/dk_e4m3_no_promotion.py [tokens ...]   (default 2048 8192)
"""

from __future__ import annotations

import math
import sys

import torch

from flamia_cute.quant.formats import E4M3, cast_to, pow2_scale
from flamia_cute.testing import make_inputs, rel_l2

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from fwd_no_promotion import mma_truncated_from  # noqa: E402

BLOCK = 128  # keys of block 0, and queries per promoted tile


def quantize_tokens(x: torch.Tensor) -> torch.Tensor:
    """Per-token e4m3 with power-of-two scales, dequantized (the recipe's Q)."""
    s = pow2_scale(x.abs().amax(-1, keepdim=True).float(), E4M3)
    return (cast_to(x.float() / s, E4M3) * s).double()


def run(tokens: int, q_mean: float, bits: int = 13, seed: int = 0) -> dict:
    q, k, v, _, _, _ = make_inputs([tokens], heads_q=1, heads_kv=1, head_dim=128, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q, k, v = (t[:, 0].double() for t in (q, k, v))
    q = q + q_mean
    do = torch.randn(tokens, 128, generator=g, dtype=torch.float64)
    scale = 1 / math.sqrt(128)
    s = (q @ k.T) * scale
    s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -math.inf)
    p = torch.softmax(s, -1)
    o = p @ v
    ds = p * (do @ v.T - (do * o).sum(-1, keepdim=True))  # [q, k]
    ds_blk = ds[:, :BLOCK].T  # dS^T of key block 0: [key, query]
    ref = ds_blk @ q * scale

    q_hat = quantize_tokens(q)  # what the kernel multiplies (codes times sq)
    out = {"tokens": tokens, "q_mean": q_mean}
    bf = ds_blk.float().to(torch.bfloat16).double() @ q_hat
    out["bf16"] = rel_l2(bf * scale, ref)

    # the e4m3 path's A operand: dS * sq (Q's per-token scale folded in), B: Q's codes
    sq = pow2_scale(q_hat.abs().amax(-1, keepdim=True).float(), E4M3).double().squeeze(-1)
    codes = q_hat / sq[:, None]
    a = ds_blk * sq[None, :]
    prom = torch.zeros(BLOCK, 128, dtype=torch.float64)
    for t0 in range(0, tokens, BLOCK):
        at = a[:, t0 : t0 + BLOCK]
        sk = pow2_scale(at.abs().amax(-1, keepdim=True).float(), E4M3).double()
        tile = mma_truncated_from(torch.zeros(BLOCK, 128), cast_to((at / sk).float(), E4M3), codes[t0 : t0 + BLOCK], bits)
        prom += tile * sk
    out["e4m3 promoted"] = rel_l2(prom * scale, ref)
    # one scale per tile (all its keys: codes dQ could share), the running max over tiles, the chain's
    # accumulator rescaled (exact powers of two) when it grows
    run_scale = torch.zeros((), dtype=torch.float64)
    acc = torch.zeros(BLOCK, 128, dtype=torch.float64)
    for t0 in range(0, tokens, BLOCK):
        at = a[:, t0 : t0 + BLOCK]
        new = torch.maximum(run_scale, pow2_scale(at.abs().amax().float().reshape(1), E4M3).double()[0])
        if run_scale > 0:
            acc = acc * (run_scale / new)
        run_scale = new
        acc = mma_truncated_from(acc, cast_to((at / run_scale).float(), E4M3), codes[t0 : t0 + BLOCK], bits)
    out["e4m3 tile-scale chained"] = rel_l2(acc * run_scale * scale, ref)
    for name, loose in (("e4m3 chained", 1.0), ("e4m3 chained x16", 16.0)):
        sk = pow2_scale(a.abs().amax(-1, keepdim=True).float() * loose, E4M3).double()
        chained = mma_truncated_from(torch.zeros(BLOCK, 128), cast_to((a / sk).float(), E4M3), codes, bits) * sk
        out[name] = rel_l2(chained * scale, ref)
    return out


if __name__ == "__main__":
    for n in [int(x) for x in sys.argv[1:]] or [2048, 8192]:
        for m in (0.0, 1.0, 4.0):
            r = run(n, m)
            print(" ".join(f"{k}={v:.3e}" if isinstance(v, float) and k != "q_mean" else f"{k}={v}"
                           for k, v in r.items()), flush=True)
