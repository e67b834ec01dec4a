#!/usr/bin/env python3
"""dV accumulated across a whole document in one FP8 wgmma accumulator versus promoted to fp32
every 128 queries (the kernel today): error of each against the exact product of the same e4m3
operands, with testing.fp8_mma_truncated's model of Hopper's accumulation (14 and 13 bits)."""

import torch

from flamia_cute.quant import E4M3, cast_to
from flamia_cute.testing import fp8_mma_truncated, rel_l2


def operands(lq: int, keys: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    # P^T (keys x queries): softmax-like magnitudes folded to <= 256, then e4m3
    logits = torch.randn(keys, lq, generator=g) * 2
    p = torch.softmax(logits, dim=0) * 256  # each query's probabilities over these keys
    p8 = cast_to(p, E4M3)
    do8 = cast_to(torch.randn(lq, d, generator=g) * 100, E4M3)  # dO codes (|x| <= 448)
    return p8, do8


for bits in (14, 13):
    for lq in (128, 1024, 4096):
        p8, do8 = operands(lq, 64, 64, seed=lq)
        exact = (p8.double() @ do8.double()).float()
        direct = fp8_mma_truncated(p8, do8, bits)
        promoted = sum(fp8_mma_truncated(p8[:, q0 : q0 + 128], do8[q0 : q0 + 128], bits) for q0 in range(0, lq, 128))
        print(f"{bits} bits, {lq:5d} queries: direct {rel_l2(direct, exact):.2e}  promoted per 128 "
              f"{rel_l2(promoted, exact):.2e}")
