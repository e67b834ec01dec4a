"""CPU/GPU emulator of every recipe, forward and backward: the specification.

The kernels must reproduce the quantized values exactly (operands, P and dS
casts, scale folds) and the products up to fp32 accumulation order. Tile
structure that changes quantized values is part of the spec: key tiles of
`recipe.key_tile` from each document's start, processed from the diagonal
down (as the kernels do) with an online softmax; P cast relative to the
running max; dS row scales per key tile and column scales per query tile.

All scales are powers of two, so "fold a scale into P before the cast and
multiply the accumulator by it after" is exact up to the cast itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flamia_cute.quant import (
    E4M3,
    E5M2,
    cast_to,
    format_by_name,
    mx_quantize,
    mx_quantize_2d,
    nvfp4_quantize,
    pow2_scale,
    quantize_per_tensor,
    quantize_thd,
)
from flamia_cute.quant.microscaling import pad_to_multiple
from flamia_cute.quant.quantize import QuantizedTHD

from .recipes import FOLD_DROP, FOLD_REF_MIN, MX_BLOCK, OperandQuant, Recipe
from .rotary import QKTransform, Rotary, document_positions


@dataclass
class EmuOperand:
    """An operand as the products see it, (T, H, D) fp32 values = code * scale.

    along_d feeds products reducing over the head dim, along_t those reducing
    over tokens (they differ only for MX, whose blocks run along the reduction).
    diag_* is the leak-free version used where the key lies in the query's own
    scale block (diagonal safeguard); None means "same as the main version".
    """

    along_d: torch.Tensor
    along_t: torch.Tensor
    scale: torch.Tensor | None  # (H, T) power-of-two scales of fold recipes
    diag_along_d: torch.Tensor | None = None
    diag_along_t: torch.Tensor | None = None
    diag_scale: torch.Tensor | None = None
    block_tokens: int = 1  # tokens sharing a key-side scale: defines the diagonal block
    quantized: tuple[QuantizedTHD, ...] = ()  # what a kernel stores (fold recipes)

    @property
    def has_diag(self) -> bool:
        return self.diag_along_d is not None


def _doc_ranges(cu: torch.Tensor):
    c = cu.tolist()
    return list(zip(c[:-1], c[1:], strict=True))


def operand_from_quantized(main: QuantizedTHD, diag: QuantizedTHD | None = None,
                           cu_seqlens: torch.Tensor | None = None) -> EmuOperand:
    """The emulator's view of what a fused-quantization kernel produced (block copy + optional diagonal
    copy); cu_seqlens: for operands written transposed only (QuantizedTHD.dequantize)."""
    vals = main.dequantize(cu_seqlens)
    out = EmuOperand(vals, vals, main.scale, block_tokens=main.block_tokens, quantized=(main,))
    if diag is not None:
        dv = diag.dequantize(cu_seqlens)
        out.diag_along_d, out.diag_along_t, out.diag_scale = dv, dv, diag.scale
        out.quantized = (main, diag)
    return out


def quantize_operand(
    x: torch.Tensor, cu: torch.Tensor, op: OperandQuant, key_side: bool, recipe: Recipe, s_path_nvfp4: bool = False
) -> EmuOperand:
    """Quantize one (T, H, D) input as the recipe's fused-quantization kernel would."""
    if op.scaling == "none":
        v = x.float()
        return EmuOperand(v, v, torch.ones(x.shape[1], x.shape[0], device=x.device))
    if op.scaling == "tensor":
        vals, s = quantize_per_tensor(x, format_by_name(op.fmt))
        vals = vals * s
        return EmuOperand(vals, vals, torch.full((x.shape[1], x.shape[0]), float(s), device=x.device))
    if op.scaling in ("token", "tokenblock"):
        fmt = format_by_name(op.fmt)
        main = quantize_thd(x, cu, op.block_tokens, fmt, transposed=False)
        diag = None
        if key_side and op.block_tokens > 1 and recipe.diagonal_safeguard:
            diag = quantize_thd(x, cu, 1, fmt, transposed=False)
        return operand_from_quantized(main, diag)
    # MX family, document-local blocks
    along_d = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    along_t = torch.empty_like(along_d)
    for s, e in _doc_ranges(cu):
        if e == s:
            continue
        xd = x[s:e].float().transpose(0, 1)  # (H, L, D)
        if key_side and not s_path_nvfp4:
            both = mx_quantize_2d(xd, MX_BLOCK)  # one copy serves both orientations
            along_d[s:e], along_t[s:e] = both.transpose(0, 1), both.transpose(0, 1)
            continue
        if op.fmt == "nvfp4":
            along_d[s:e] = nvfp4_quantize(xd, dim=-1).transpose(0, 1)
        else:
            along_d[s:e] = mx_quantize(xd, dim=-1, block=MX_BLOCK).transpose(0, 1)
        if key_side:
            along_t[s:e] = mx_quantize_2d(xd, MX_BLOCK).transpose(0, 1)
        else:
            along_t[s:e] = mx_quantize(xd, dim=-2, block=MX_BLOCK).transpose(0, 1)
    out = EmuOperand(along_d, along_t, None, block_tokens=MX_BLOCK)
    if key_side and recipe.diagonal_safeguard:
        b = x.float()
        out.diag_along_d, out.diag_along_t = b, b  # the diagonal block runs in bf16
    return out


# ----------------------------------------------------------------------------- helpers


def _tile_view(x: torch.Tensor, dim: int, tile: int) -> tuple[torch.Tensor, int]:
    """Pad `dim` to a multiple of tile and split it into (n_tiles, tile)."""
    dim = dim % x.dim()
    x, n = pad_to_multiple(x, dim, tile)
    shape = list(x.shape)
    return x.reshape(shape[:dim] + [shape[dim] // tile, tile] + shape[dim + 1 :]), n


def _tile_reduce_max(x: torch.Tensor, dim: int, tile: int) -> torch.Tensor:
    """Max over tiles of `tile` along dim, broadcast back to x's shape (x >= 0)."""
    dim = dim % x.dim()
    t, n = _tile_view(x, dim, tile)
    m = t.amax(dim=dim + 1, keepdim=True).expand_as(t)
    return m.reshape(*x.shape[:dim], -1, *x.shape[dim + 1 :]).narrow(dim, 0, n)


def _cast_rowtile(x: torch.Tensor, dim: int, tile: int, fmt_name: str) -> torch.Tensor:
    """Quantize x with one power-of-two scale per tile along `dim` (per row otherwise); fake-quant values."""
    fmt = E4M3 if fmt_name.startswith("e4m3") else E5M2
    scale = pow2_scale(_tile_reduce_max(x.abs(), dim, tile), fmt)
    return cast_to(x / scale, fmt) * scale


def _fold_cast(p: torch.Tensor, w: torch.Tensor, visible: torch.Tensor, dim: int, tile: int, p_scale: float,
               ref_min: float = 0.0):
    """Cast P (>= 0, <= 1) to e4m3 with operand scale w folded in.

    The other operand's per-token scale w (along the reduction `dim`) is folded
    into P relative to r = max of w over the visible entries of the tile, so
    P * w / r <= 1 and the fixed p_scale cannot saturate. Returns the effective
    value: cast(P * w / r * p_scale) / p_scale * r / w. ref_min: r is at least this
    (the backward's FOLD_REF_MIN, as its kernel computes p_scale / r; the forward drops such
    tiles instead, see recipes.FOLD_DROP).
    """
    wv = torch.where(visible, w, torch.zeros_like(w))
    r = _tile_reduce_max(wv, dim, tile)
    r = torch.where(r > 0, r, torch.ones_like(r)).clamp_min(ref_min)
    return _fold_cast_to(p, w, r, p_scale)


def _fold_cast_to(p: torch.Tensor, w: torch.Tensor, r: torch.Tensor, p_scale: float) -> torch.Tensor:
    """_fold_cast with the reference r given (r >= w wherever p > 0)."""
    ratio = w / r
    return cast_to(p * ratio * p_scale, E4M3) / p_scale / ratio


def _expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.repeat_interleave(group, dim=0) if group > 1 else x


def _heads_first(x: torch.Tensor, s: int, e: int) -> torch.Tensor:
    return x[s:e].transpose(0, 1)


@dataclass
class _DocGeom:
    qs: int
    qe: int
    ks: int
    ke: int
    visible: torch.Tensor  # (Lq, Lk) bool
    key_pos_of_query: torch.Tensor  # (Lq,) position of each query on the key axis

    def diag_mask(self, block_tokens: int) -> torch.Tensor:
        kb = torch.arange(self.ke - self.ks, device=self.visible.device) // block_tokens
        qb = torch.div(self.key_pos_of_query, block_tokens, rounding_mode="floor")
        return (qb[:, None] == kb[None, :]) & self.visible


def _doc_geometries(cu_q, cu_k, causal: bool):
    for (qs, qe), (ks, ke) in zip(_doc_ranges(cu_q), _doc_ranges(cu_k), strict=True):
        lq, lk = qe - qs, ke - ks
        pos = torch.arange(lq, device=cu_q.device) + (lk - lq)  # bottom-right aligned, as FA
        if causal:
            visible = torch.arange(lk, device=cu_q.device)[None, :] <= pos[:, None]
        else:
            visible = torch.ones(lq, lk, dtype=torch.bool, device=cu_q.device)
        yield _DocGeom(qs, qe, ks, ke, visible, pos)


def _select(op: EmuOperand, geom: _DocGeom, causal: bool, recipe: Recipe):
    """Diagonal mask (Lq, Lk) for this operand, or None if no safeguard version is used."""
    if not (causal and op.has_diag and recipe.diagonal_safeguard):
        return None
    return geom.diag_mask(op.block_tokens)


def _mm_select(a_main, a_diag, mask, b_main, b_diag):
    """sum_j A[i,j] * B_sel(i,j)[j]: main operand off the diagonal, the safeguard one on it."""
    if mask is None:
        return a_main @ b_main
    return torch.where(mask, 0.0, a_main) @ b_main + torch.where(mask, a_diag, 0.0) @ b_diag


# ----------------------------------------------------------------------------- forward


@dataclass
class EmulatorContext:
    """What the forward saves for the backward: quantized operands, O and LSE (no bf16 inputs)."""

    recipe: Recipe
    softmax_scale: float
    causal: bool
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    q: EmuOperand
    k: EmuOperand
    v: EmuOperand
    out: torch.Tensor
    lse: torch.Tensor
    # the rotations of Q and K (rotary.QKTransform) whose inverses the backward applies to dQ, dK
    transform: QKTransform | None = None


def quantize_inputs(q, k, v, cu_q, cu_k, recipe: Recipe):
    nvfp4_s = recipe.q.fmt == "nvfp4"
    return (
        quantize_operand(q, cu_q, recipe.q, False, recipe, nvfp4_s),
        quantize_operand(k, cu_k, recipe.k, True, recipe, nvfp4_s),
        quantize_operand(v, cu_k, recipe.v, True, recipe),
    )


def _scores(qo: EmuOperand, ko: EmuOperand, geom, group, scale, causal, recipe, dtype):
    qd = _heads_first(qo.along_d, geom.qs, geom.qe).to(dtype)
    k_main = _expand_kv(_heads_first(ko.along_d, geom.ks, geom.ke), group).to(dtype)
    s = qd @ k_main.transpose(1, 2)
    mask = _select(ko, geom, causal, recipe)
    if mask is not None:
        k_diag = _expand_kv(_heads_first(ko.diag_along_d, geom.ks, geom.ke), group).to(dtype)
        s = torch.where(mask, qd @ k_diag.transpose(1, 2), s)
    s = s * scale
    return s.masked_fill(~geom.visible, float("-inf"))


def _per_pair_scale(op: EmuOperand, mask, s, e, group):
    """(H, 1 or Lq, Lk) scale of the key operand used for each pair."""
    w = _expand_kv(op.scale[:, s:e], group)[:, None, :]
    if mask is not None:
        w = torch.where(mask, _expand_kv(op.diag_scale[:, s:e], group)[:, None, :], w)
    return w


def transform_inputs(q, k, cu_q, cu_k, transform: QKTransform | None):
    """Q and K as the quantization sees them: through the call's rotations (rotary.QKTransform)."""
    if transform is None or not transform.active:
        return q, k
    return (transform.forward(q, document_positions(cu_q, cu_k, q.shape[0]), "q"),
            transform.forward(k, document_positions(cu_k, cu_k, k.shape[0]), "k"))


def transform_grads(dq, dk, ctx: EmulatorContext):
    """fp32 dQ, dK of the rotated operands back in the caller's frame (rotary.QKTransform.backward)."""
    t = ctx.transform
    if t is None or not t.active:
        return dq, dk
    return (t.backward(dq, document_positions(ctx.cu_q, ctx.cu_k, dq.shape[0]), "q"),
            t.backward(dk, document_positions(ctx.cu_k, ctx.cu_k, dk.shape[0]), "k"))


def qk_transform(recipe: Recipe, rotary: Rotary | None) -> QKTransform | None:
    """The rotations of a call: its RoPE tables and the recipe's Hadamard transform (None: neither)."""
    if rotary is None and not recipe.hadamard:
        return None
    if rotary is None:
        return QKTransform(hadamard=True)
    return QKTransform(rotary.cos, rotary.sin, rotary.interleaved, recipe.hadamard)


def emulate_forward(q, k, v, cu_q, cu_k, softmax_scale, causal, recipe: Recipe, dtype=torch.float32,
                    rotary: Rotary | None = None):
    """Returns (out bf16 (T, H, D), lse fp32 (H, T), EmulatorContext). rotary: RoPE tables
    (rotary.resolve_rotary's), applied to Q and K before their quantization, with the recipe's
    Hadamard transform after it."""
    transform = qk_transform(recipe, rotary)
    q, k = transform_inputs(q, k, cu_q, cu_k, transform)
    qo, ko, vo = quantize_inputs(q, k, v, cu_q, cu_k, recipe)
    T, H, D = q.shape
    group = H // k.shape[1]
    out = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    lse = torch.full((H, T), float("-inf"), dtype=torch.float32, device=q.device)
    tile = recipe.key_tile
    for g in _doc_geometries(cu_q, cu_k, causal):
        lq, lk = g.qe - g.qs, g.ke - g.ks
        if lq == 0 or lk == 0:
            continue
        s = _scores(qo, ko, g, group, softmax_scale, causal, recipe, dtype)
        vmask = _select(vo, g, causal, recipe)
        v_main = _expand_kv(_heads_first(vo.along_t, g.ks, g.ke), group).to(dtype)
        v_diag = _expand_kv(_heads_first(vo.diag_along_t, g.ks, g.ke), group).to(dtype) if vmask is not None else None
        w = _per_pair_scale(vo, vmask, g.ks, g.ke, group) if recipe.p_cast == "e4m3_fold" else None
        m = torch.full((H, lq, 1), float("-inf"), dtype=dtype, device=q.device)
        l_sum = torch.zeros(H, lq, 1, dtype=dtype, device=q.device)
        acc = torch.zeros(H, lq, D, dtype=dtype, device=q.device)
        r_run = torch.zeros(H, lq, 1, dtype=dtype, device=q.device)  # fold reference of the last kept tile
        for t0 in reversed(range(0, lk, tile)):  # from the diagonal down, as the kernels
            cols = slice(t0, min(t0 + tile, lk))
            st = s[:, :, cols]
            m_new = torch.maximum(m, st.amax(-1, keepdim=True))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - m_safe)
            p = torch.exp(st - m_safe)
            p_sum = p.sum(-1, keepdim=True)
            vis = g.visible[None, :, cols]
            pm = vmask[None, :, cols].expand_as(p) if vmask is not None else None
            if recipe.p_cast == "bf16":
                pe = p.to(torch.bfloat16).to(dtype)
            elif recipe.p_cast == "e4m3_fold":
                wt = w[:, :, cols].expand_as(p)
                visp = vis.expand_as(p)
                # a row whose reference falls below max(r_run * FOLD_DROP, FOLD_REF_MIN) adds nothing
                # (recipes.FOLD_DROP: the kernel carries O in units of r, and r_run / r must not overflow)
                r_tile = torch.where(visp, wt, torch.zeros_like(wt)).amax(-1, keepdim=True)
                # (a NaN reference, a non-finite V block, is kept: its NaN reaches the row, as in the kernel)
                keep = ~(r_tile < torch.clamp_min(r_run * FOLD_DROP, FOLD_REF_MIN))
                ref = torch.where(keep, r_tile, torch.ones_like(r_tile))  # dropped rows: any finite r
                pe = torch.where(keep, _fold_cast_to(p, wt, ref.expand_as(p), recipe.p_scale), 0.0)
                r_run = torch.where(keep, r_tile, r_run)
            else:  # mx: 1x32 blocks of keys per row; the tile starts on a block boundary
                pe = mx_quantize(p, dim=-1, block=MX_BLOCK)
                if pm is not None:
                    pe = torch.where(pm, p.to(torch.bfloat16).to(dtype), pe)
            l_sum = l_sum * alpha + p_sum
            acc = acc * alpha + _mm_select(
                pe, pe, pm, v_main[:, cols], v_diag[:, cols] if v_diag is not None else None
            )
            m = m_new
        empty = l_sum == 0
        o = torch.where(empty, 0.0, acc / torch.where(empty, 1.0, l_sum))
        out[g.qs : g.qe] = o.transpose(0, 1).float()
        lse[:, g.qs : g.qe] = torch.where(empty, float("-inf"), m + torch.log(l_sum)).squeeze(-1).float()
    out = out.to(torch.bfloat16)
    ctx = EmulatorContext(recipe, softmax_scale, causal, cu_q, cu_k, qo, ko, vo, out, lse, transform)
    return out, lse, ctx


# ----------------------------------------------------------------------------- backward


def emulate_backward(dout: torch.Tensor, ctx: EmulatorContext, dtype=torch.float32):
    """dq (T, H, D), dk, dv (T, Hk, D) in bf16 from the forward's saved quantized operands."""
    recipe = ctx.recipe
    T, H, D = dout.shape
    Tk, Hk = ctx.k.along_d.shape[:2]
    group = H // Hk
    doo = quantize_operand(dout, ctx.cu_q, recipe.do, False, recipe)
    dq = torch.zeros(T, H, D, dtype=torch.float32, device=dout.device)
    dk = torch.zeros(Tk, Hk, D, dtype=torch.float32, device=dout.device)
    dv = torch.zeros(Tk, Hk, D, dtype=torch.float32, device=dout.device)
    sm = ctx.softmax_scale
    for g in _doc_geometries(ctx.cu_q, ctx.cu_k, ctx.causal):
        lq, lk = g.qe - g.qs, g.ke - g.ks
        if lq == 0 or lk == 0:
            continue
        s = _scores(ctx.q, ctx.k, g, group, sm, ctx.causal, recipe, dtype)
        lse = ctx.lse[:, g.qs : g.qe, None].to(dtype)
        # an empty row (LSE -inf) has P = 0; a NaN LSE (a non-finite input the row saw) gives NaN
        p = torch.where(g.visible & (lse != float("-inf")), torch.exp(s - lse), 0.0)
        vis = g.visible[None].expand_as(p)
        # dP = dO V^T (reduction over D): scales factor out, values exact in fp32
        vmask = _select(ctx.v, g, ctx.causal, recipe)
        do_d = _heads_first(doo.along_d, g.qs, g.qe).to(dtype)
        v_main = _expand_kv(_heads_first(ctx.v.along_d, g.ks, g.ke), group).to(dtype)
        dp = do_d @ v_main.transpose(1, 2)
        if vmask is not None:
            v_diag = _expand_kv(_heads_first(ctx.v.diag_along_d, g.ks, g.ke), group).to(dtype)
            dp = torch.where(vmask, do_d @ v_diag.transpose(1, 2), dp)
        o = _heads_first(ctx.out, g.qs, g.qe).float()
        d_src = doo.along_d if recipe.delta == "quantized" else dout  # recipes.DELTAS
        d_row = (_heads_first(d_src, g.qs, g.qe).float() * o).sum(-1, keepdim=True).to(dtype)
        ds = torch.where(vis, p * (dp - d_row), 0.0)
        # dV = P^T dO (reduction over queries)
        do_t = _heads_first(doo.along_t, g.qs, g.qe).to(dtype)
        if recipe.p_cast == "bf16":
            pe = p.to(torch.bfloat16).to(dtype)
        elif recipe.p_cast == "e4m3_fold":
            w = doo.scale[:, g.qs : g.qe, None].to(dtype).expand_as(p)
            if recipe.dv_fold == "document":  # one reference per (KV head group, document), NaN scales left out
                sdo = torch.nan_to_num(doo.scale[:, g.qs : g.qe].to(dtype), nan=0.0)
                ref = sdo.reshape(-1, group, g.qe - g.qs).amax((1, 2))
                ref = ref.repeat_interleave(group)[:, None, None].clamp_min(FOLD_REF_MIN)
                pe = _fold_cast_to(p, w, ref.expand_as(p), recipe.p_scale)
            else:
                pe = _fold_cast(p, w, vis, -2, recipe.query_tile, recipe.p_scale, FOLD_REF_MIN)
        else:
            pe = mx_quantize(p, dim=-2, block=MX_BLOCK)
        dv_h = pe.transpose(1, 2) @ do_t
        # dQ = dS K (reduction over keys): K's scale folded into dS before its cast
        kmask = _select(ctx.k, g, ctx.causal, recipe)
        k_main = _expand_kv(_heads_first(ctx.k.along_t, g.ks, g.ke), group).to(dtype)
        k_diag = _expand_kv(_heads_first(ctx.k.diag_along_t, g.ks, g.ke), group).to(dtype) if kmask is not None else None
        km = kmask[None].expand_as(ds) if kmask is not None else None
        if recipe.ds_cast == "e4m3_tile":  # one cast for both products
            dse_q = dse_k = _cast_ds_tile(ds, ctx, kmask, g, group, dtype)
        else:
            dse_q = _cast_ds(ds, recipe, ctx.k, kmask, g, group, dim=-1, dtype=dtype)
            dse_k = _cast_ds(ds, recipe, ctx.q, None, g, group, dim=-2, dtype=dtype)
        dq_h = _mm_select(dse_q, dse_q, km, k_main, k_diag) * sm
        # dK = dS^T Q (reduction over queries): Q's scale folded into dS^T
        q_t = _heads_first(ctx.q.along_t, g.qs, g.qe).to(dtype)
        dk_h = dse_k.transpose(1, 2) @ q_t * sm
        dq[g.qs : g.qe] = dq_h.transpose(0, 1).float()
        dk[g.ks : g.ke] = dk_h.reshape(Hk, group, lk, D).sum(1).transpose(0, 1).float()
        dv[g.ks : g.ke] = dv_h.reshape(Hk, group, lk, D).sum(1).transpose(0, 1).float()
    dq, dk = transform_grads(dq, dk, ctx)
    return dq.to(torch.bfloat16), dk.to(torch.bfloat16), dv.to(torch.bfloat16)


def _cast_ds(ds, recipe: Recipe, other: EmuOperand, mask, g: _DocGeom, group: int, dim: int, dtype):
    """Effective dS values for the product reducing along `dim` (-1: keys, for dQ; -2: queries, for dK)."""
    if recipe.ds_cast == "bf16":
        return ds.to(torch.bfloat16).to(dtype)
    if recipe.ds_cast == "mx":
        out = mx_quantize(ds, dim=dim, block=MX_BLOCK)
        if mask is not None:
            out = torch.where(mask[None], ds.to(torch.bfloat16).to(dtype), out)
        return out
    # rowtile: fold the other operand's per-token scale, then one scale per row per tile
    if dim == -1:
        w = _per_pair_scale(other, mask, g.ks, g.ke, group).to(dtype).expand_as(ds)
        tile = recipe.key_tile
    else:
        w = other.scale[:, g.qs : g.qe, None].to(dtype).expand_as(ds)
        tile = recipe.query_tile
    return _cast_rowtile(ds * w, dim, tile, recipe.ds_cast) / w


def _cast_ds_tile(ds, ctx: EmulatorContext, kmask, g: _DocGeom, group: int, dtype):
    """ds_cast e4m3_tile (a leaky control, recipes.DS_CASTS): w = sq * sk (the query's and the pair's
    key scale, the operands' scales that dK and dQ reduce over) folded into dS, one power-of-two scale
    per query_tile x key_tile tile of the document (from its first query and key), the effective
    dS = cast(dS w / s) s / w. A pair whose w underflows to 0 adds 0."""
    recipe = ctx.recipe
    w = ctx.q.scale[:, g.qs : g.qe, None].to(dtype) * _per_pair_scale(ctx.k, kmask, g.ks, g.ke, group).to(dtype)
    c = ds * w
    amax = _tile_reduce_max(_tile_reduce_max(c.abs(), -2, recipe.query_tile), -1, recipe.key_tile)
    s = pow2_scale(amax.float(), E4M3).to(dtype)
    return torch.where(w > 0, cast_to(c / s, E4M3).to(dtype) * s / torch.where(w > 0, w, 1.0), 0.0)


def default_softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
