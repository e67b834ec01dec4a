"""The planned sm_100a MXFP8 backward on the CPU, tile by tile (no kernel yet).

One CTA per (KV head, 128-key block) loops over the 64-query tiles at or after the block's diagonal
(sm100/plan.py's BWD_KEY_TILE, BWD_QUERY_TILE; sm100/hazards.py's backward_roles). Per tile and query
head: S^T = K Q^T from the forward's MX operands, P^T = exp(S^T - LSE), dP^T = V dO^T,
dS^T = P^T (dP^T - D); P^T and dS^T cast to MX with blocks of 32 along the product's reduction
(queries for dV += P^T dO and dK += dS^T Q, keys for dQ = dS K); dK and dV accumulate in the CTA,
dQ is added to global fp32 per tile (the planned dQ reduction). Pairs whose key lies in the query's
own 32-token block use bf16 K and V in S^T and dP^T, and bf16 dS and K in dQ (recipe mxfp8's diagonal
safeguard, as flamia_cute.emulator does). Must equal emulate_backward(recipe mxfp8) up to fp32 rounding.
"""

from __future__ import annotations

import math

import torch

from ..quant.formats import E4M3, cast_to
from ..quant.microscaling import E4M3_EMAX, mx_quantize
from ..quant.mx_layout import MX_BLOCK, MxForwardOperands, decode_dim_rows, decode_token_rows, pack_mx_do_operands
from .plan import BWD_KEY_TILE, BWD_QUERY_TILE

LOG2E = math.log2(math.e)
# no_own_block_bf16: the diagonal safeguard dropped (numeric: fails the emulator comparison);
# ds_scale_per_query_tile: dS's scale for dQ shared by the 64 queries of a tile (leaks the future)
BWD_MODEL_BUGS = (None, "no_own_block_bf16", "ds_scale_per_query_tile")


def _e8m0(amax: torch.Tensor) -> torch.Tensor:
    """A block's E8M0 scale from the exponent field of its amax: biased max(field - 8, 1)."""
    field = (amax.float().view(torch.int32) >> 23) & 0xFF
    return torch.exp2((torch.clamp_min(field - E4M3_EMAX, 1) - 127).float())


def _mx_cast(x: torch.Tensor, dim: int, rows_share: bool = False) -> torch.Tensor:
    """MX e4m3 values of a tile with blocks of 32 along `dim` (the tile starts on a block boundary);
    rows_share: one scale per block for all rows of the other dimension (the leaky mutant)."""
    xt = x if dim in (-1, x.dim() - 1) else x.transpose(-1, -2)
    n = xt.shape[-1]
    xb = torch.nn.functional.pad(xt, (0, (-n) % MX_BLOCK)).reshape(*xt.shape[:-1], -1, MX_BLOCK)
    amax = xb.abs().amax(-1, keepdim=True)
    if rows_share:
        amax = amax.amax(-3, keepdim=True).expand_as(amax)
    sc = _e8m0(amax)
    y = (cast_to(xb / sc, E4M3) * sc).reshape(*xt.shape[:-1], -1)[..., :n]
    return y if xt is x else y.transpose(-1, -2)


def reference_bwd_sm100(ops: MxForwardOperands, q, dout, out, lse, cu_seqlens, softmax_scale: float,
                        bug: str | None = None):
    """dq (T, H, D), dk, dv (T, Hk, D) bf16 of the planned backward from the forward's operands `ops`
    (pack_mx_forward_operands), its bf16 `out` and LSE (H, T), bf16 q and dout. dO in both orientations
    and D = rowsum(dO * O) are what the dO quantizer writes (pack_mx_do_operands, sm100/quantize_do_mx.py),
    decoded; Q scaled along the queries is quantized here, per document, as the emulator does.
    bug: BWD_MODEL_BUGS."""
    if bug not in BWD_MODEL_BUGS:
        raise ValueError(f"bug must be one of {BWD_MODEL_BUGS}, got {bug!r}")
    from .attention_fwd import decode_operands

    m = decode_operands(ops, cu_seqlens)
    T, H, D, Hk, group, cu, qm, km, vm, qd, kd, vd = (m.T, m.H, m.D, m.Hk, m.group, m.cu, m.q, m.k, m.v, m.qd,
                                                      m.kd, m.vd)
    dos = pack_mx_do_operands(dout, out, cu)
    do_d_all, do_t_all = decode_token_rows(dos.do, dos.do_sf, cu), decode_dim_rows(dos.do_t, dos.do_t_sf, cu)
    d_row = dos.delta.T  # (T, H): D = rowsum(dO * O)
    lse2 = lse.float() * LOG2E
    scale_log2 = softmax_scale * LOG2E
    dq = torch.zeros(T, H, D)
    dk = torch.zeros(T, Hk, D)
    dv = torch.zeros(T, Hk, D)
    for b in range(cu.numel() - 1):
        s0, L = int(cu[b]), int(cu[b + 1] - cu[b])
        if L == 0:
            continue
        doc = slice(s0, s0 + L)
        q_t = mx_quantize(q[doc].float(), dim=0, block=MX_BLOCK)  # Q scaled along the queries (dK)
        do_d, do_t = do_d_all[doc], do_t_all[doc]  # dO along D (dP^T), along the queries (dV)
        for kh in range(Hk):
            for n in range(-(-L // BWD_KEY_TILE)):  # one CTA
                keys = torch.arange(BWD_KEY_TILE * n, min(BWD_KEY_TILE * (n + 1), L))
                dk_acc = torch.zeros(keys.numel(), D)
                dv_acc = torch.zeros(keys.numel(), D)
                kk, kkd, vv, vvd = km[s0 + keys, kh], kd[s0 + keys, kh], vm[s0 + keys, kh], vd[s0 + keys, kh]
                first = BWD_KEY_TILE * n // BWD_QUERY_TILE
                for i in range(first, -(-L // BWD_QUERY_TILE)):
                    rows = torch.arange(BWD_QUERY_TILE * i, min(BWD_QUERY_TILE * (i + 1), L))
                    visible = keys[:, None] <= rows[None, :]  # (keys, queries)
                    own = (keys[:, None] // MX_BLOCK == rows[None, :] // MX_BLOCK) & visible
                    if bug == "no_own_block_bf16":
                        own = torch.zeros_like(own)
                    for h in range(kh * group, (kh + 1) * group):
                        st = torch.where(own, kkd @ qd[s0 + rows, h].T, kk @ qm[s0 + rows, h].T)
                        lrow = lse2[h, s0 + rows][None, :]
                        pt = torch.where(visible & torch.isfinite(lrow),
                                         torch.exp2(st * scale_log2 - lrow), 0.0)
                        dpt = torch.where(own, vvd @ do_d[rows, h].T, vv @ do_d[rows, h].T)
                        dst = torch.where(visible, pt * (dpt - d_row[s0 + rows, h][None, :]), 0.0)
                        dv_acc += _mx_cast(pt, dim=-1) @ do_t[rows, h]
                        dk_acc += _mx_cast(dst, dim=-1) @ q_t[rows, h]
                        ds = dst.T  # (queries, keys): scaled along the keys for dQ
                        dse = _mx_cast(ds, dim=-1, rows_share=bug == "ds_scale_per_query_tile")
                        dq_tile = (torch.where(own.T, 0.0, dse) @ kk
                                   + torch.where(own.T, ds.to(torch.bfloat16).float(), 0.0) @ kkd)
                        dq[s0 + rows, h] += dq_tile * softmax_scale
                dk[s0 + keys, kh] = dk_acc * softmax_scale
                dv[s0 + keys, kh] = dv_acc
    return dq.to(torch.bfloat16), dk.to(torch.bfloat16), dv.to(torch.bfloat16)


def reference_training_fn(softmax_scale: float, bug: str | None = None):
    """The forward tile model then this backward model from bf16 inputs, as a flamia_cute.testing
    AttentionFn (check_leakage)."""
    from ..quant.mx_layout import pack_mx_forward_operands
    from .attention_fwd import reference_fwd_sm100

    def fn(q, k, v, cu, dout=None):
        ops = pack_mx_forward_operands(q, k, v, cu)
        out, lse = reference_fwd_sm100(ops, cu, softmax_scale)
        res = {"out": out, "lse": lse}
        if dout is not None:
            res["dq"], res["dk"], res["dv"] = reference_bwd_sm100(ops, q, dout, out, lse, cu, softmax_scale, bug)
        return res

    return fn
