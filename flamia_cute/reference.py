"""fp64 reference attention over packed documents (forward and backward)."""

from __future__ import annotations

import torch


def reference_attention(q, k, v, cu_q, cu_k, softmax_scale, causal=True, dout=None, dtype=torch.float64):
    """Exact attention per document in `dtype`. Returns dict with out, lse (H, T) and, with dout, dq, dk, dv."""
    T, H, D = q.shape
    group = H // k.shape[1]
    qq = q.detach().to(dtype).requires_grad_(dout is not None)
    kk = k.detach().to(dtype).requires_grad_(dout is not None)
    vv = v.detach().to(dtype).requires_grad_(dout is not None)
    outs, lses = [], []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for (qs, qe), (ks, ke) in zip(zip(cq[:-1], cq[1:], strict=True), zip(ck[:-1], ck[1:], strict=True), strict=True):
        lq, lk = qe - qs, ke - ks
        if lq == 0:
            continue
        qd = qq[qs:qe].transpose(0, 1)
        kd = kk[ks:ke].transpose(0, 1).repeat_interleave(group, 0)
        vd = vv[ks:ke].transpose(0, 1).repeat_interleave(group, 0)
        s = (qd @ kd.transpose(1, 2)) * softmax_scale
        if causal:
            pos = torch.arange(lq, device=q.device) + (lk - lq)
            vis = torch.arange(lk, device=q.device)[None, :] <= pos[:, None]
            s = s.masked_fill(~vis, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        empty = torch.isinf(lse)
        p = torch.where(empty[..., None], 0.0, torch.exp(s - torch.where(empty, 0.0, lse)[..., None]))
        outs.append((p @ vd).transpose(0, 1))
        lses.append(lse)
    out = torch.cat(outs, 0) if outs else qq.new_zeros(0, H, D)
    lse = torch.cat(lses, 1) if lses else qq.new_zeros(H, 0)
    res = {"out": out.detach(), "lse": lse.detach()}
    if dout is not None:
        dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), dout.to(dtype), allow_unused=True)
        res.update(dq=dq, dk=dk, dv=dv)
    return res


def reference_attention_rotary(q, k, v, cu, softmax_scale, rotary, dout=None, dtype=torch.float64):
    """reference_attention of self-attention with RoPE (a rotary.Rotary) applied to q and k in `dtype`
    (positions restart at every document start); dq, dk of the unrotated inputs, by autograd through
    the rotation (not through rotary's inverse, which the code under test uses)."""
    from .rotary import document_positions, rope

    pos = document_positions(cu, cu, q.shape[0])
    q0, k0 = (t.detach().to(dtype).requires_grad_(dout is not None) for t in (q, k))
    with torch.enable_grad():
        qr = rope(q0, rotary.cos, rotary.sin, pos, rotary.interleaved)
        kr = rope(k0, rotary.cos, rotary.sin, pos, rotary.interleaved)
    res = reference_attention(qr.detach(), kr.detach(), v, cu, cu, softmax_scale, True, dout, dtype)
    if dout is not None:
        res["dq"], res["dk"] = torch.autograd.grad((qr, kr), (q0, k0), (res["dq"], res["dk"]))
    return res
