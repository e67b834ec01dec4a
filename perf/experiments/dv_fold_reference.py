#!/usr/bin/env python3
"""dV fold reference: per 128-query tile (current) vs per document (fixed per key row: would let
dV accumulate in the MMA). Emulator, realistic dO magnitudes (log-normal per token, zero rows)."""

import torch

import flamia_cute.emulator as emu
from flamia_cute.emulator import emulate_backward, emulate_forward
from flamia_cute.recipes import Recipe
from flamia_cute.reference import reference_attention
from flamia_cute.testing import make_inputs, rel_l2

orig = emu._fold_cast
def per_doc(p, w, visible, dim, tile, p_scale, ref_min=0.0):
    if dim % p.dim() == p.dim() - 2:
        tile = 1 << 20
    return orig(p, w, visible, dim, tile, p_scale, ref_min)

rec = Recipe.from_name("fp8_tokenblock")
for sigma in (0.0, 1.0, 2.0, 3.0):
    res = {}
    for mode in ("tile", "doc"):
        errs = []
        for seed in range(3):
            q, k, v, do, cu, scale = make_inputs([1000, 700, 300], 2, 2, 64, seed=seed)
            g = torch.Generator().manual_seed(100 + seed)
            mag = torch.exp2(sigma * torch.randn(do.shape[0], 1, 1, generator=g))
            zero = torch.rand(do.shape[0], 1, 1, generator=g) < 0.05
            do = (do.float() * mag * (~zero)).to(do.dtype)
            emu._fold_cast = per_doc if mode == "doc" else orig
            out, lse, ctx = emulate_forward(q, k, v, cu, cu, scale, True, rec)
            dq, dk, dv = emulate_backward(do, ctx)
            ref = reference_attention(q, k, v, cu, cu, scale, dout=do)
            errs.append(rel_l2(dv.float(), ref["dv"].float()))
        emu._fold_cast = orig
        res[mode] = sum(errs) / len(errs)
    print(f"sigma {sigma}: dV rel L2 vs fp64: per tile {res['tile']:.4f}, per doc {res['doc']:.4f}")
