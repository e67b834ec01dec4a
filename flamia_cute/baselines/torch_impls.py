"""FA4 (bf16, CuTe DSL), FlexAttention with a document mask, and torch SDPA per document."""

from __future__ import annotations

import torch


def fa4_available() -> bool:
    try:
        from flash_attn.cute import flash_attn_varlen_func  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def fa4_varlen(q, k, v, cu, max_len, scale):
    from flash_attn.cute import flash_attn_varlen_func

    res = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                 max_seqlen_k=max_len, softmax_scale=scale, causal=True)
    return res[0] if isinstance(res, tuple) else res


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


class FlexDocumentAttention:
    """flex_attention over the packed sequence with a causal document mask (compiled once per shape)."""

    def __init__(self, cu: torch.Tensor, total: int, gqa: bool):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        lengths = (cu[1:] - cu[:-1]).long()
        doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)

        def mask_mod(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        self.block_mask = create_block_mask(mask_mod, None, None, total, total, device=cu.device)
        self.fn = torch.compile(flex_attention, dynamic=False)
        self.gqa = gqa

    def __call__(self, q, k, v, scale):
        qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = self.fn(qb, kb, vb, block_mask=self.block_mask, scale=scale, enable_gqa=self.gqa)
        return o.squeeze(0).transpose(0, 1)


def sdpa_per_document(q, k, v, cu_list, scale):
    """torch SDPA with is_causal, one call per document (its fused kernels take no packed layout)."""
    outs = []
    gqa = q.shape[1] != k.shape[1]
    for s, e in zip(cu_list[:-1], cu_list[1:], strict=True):
        if e == s:
            continue
        qb, kb, vb = (t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(outs, 0)


def _rope_formula(x, cos_tok, sin_tok, interleaved: bool):
    """RoPE of x (T, H, D) with per-token tables (T, rotary_dim / 2), in fp32, back in x's dtype."""
    xf = x.float()
    half = cos_tok.shape[1]
    c, s = cos_tok[:, None, :], sin_tok[:, None, :]
    if interleaved:
        x1, x2 = xf[..., 0 : 2 * half : 2], xf[..., 1 : 2 * half : 2]
        rot = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), -1).flatten(-2)
    else:
        x1, x2 = xf[..., :half], xf[..., half : 2 * half]
        rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    return torch.cat((rot, xf[..., 2 * half :]), -1).to(x.dtype)


class RopeBaseline:
    """RoPE as an FA4 user applies it before attention, the best kernel importable: flash-attn's Triton
    rotary (varlen: positions restart at each cu_seqlens start), else torch.compile of the fp32 formula
    over per-token tables gathered once per batch (as train/model.py does). Differentiable."""

    def __init__(self, cos, sin, cu, total: int, interleaved: bool = False):
        self.cos, self.sin, self.cu, self.interleaved = cos, sin, cu, interleaved
        try:
            from flash_attn.layers.rotary import apply_rotary_emb

            self.kind, self._fa = "flash_attn", apply_rotary_emb
        except Exception:
            from ..rotary import document_positions

            pos = document_positions(cu, cu, total)
            self.cos_tok, self.sin_tok = cos[pos].contiguous(), sin[pos].contiguous()
            self.kind, self._fn = "compile", torch.compile(_rope_formula, dynamic=False)

    def __call__(self, x, max_len: int):
        if self.kind == "flash_attn":
            return self._fa(x, self.cos, self.sin, interleaved=self.interleaved, cu_seqlens=self.cu,
                            max_seqlen=max_len)
        return self._fn(x, self.cos_tok, self.sin_tok, self.interleaved)
