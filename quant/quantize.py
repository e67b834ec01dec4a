"""Reference quantization of packed THD tensors: the bit-exact specification
that the fused-quantization kernels must reproduce.

Layouts (T tokens, H heads, D head dim):
- data_td: (T, H, D) float8, token-major (K-major for products reducing over D);
- data_dt: (H, D, T_dt) float8, head-dim-major with tokens contiguous (K-major
  for products reducing over tokens). Every document starts at a multiple of
  DT_DOC_ALIGN tokens (dt_cu_seqlens), because TMA needs 16-byte aligned
  coordinates on the contiguous axis; T_dt = transposed_tokens(T, num_docs), an
  upper bound known from shapes alone (no host sync). Columns that hold no token
  are 0;
- scale:   (H, T) fp32, every token holding the scale of its block, so a kernel
  reads the scales of a tile as one contiguous vector.

V's data_dt is written in "P-fragment order" (pv_order=True): inside every aligned
16-column group, column j holds token PV_ORDER16[j] of the group. The forward's
P V product reduces over keys, so any key order works if P and V^T agree; this
one puts the keys a thread holds in its S accumulator (keys 2t, 2t+1, 8+2t, 9+2t)
exactly where the FP8 wgmma A fragment wants them (4t .. 4t+3), and P needs no
shuffles between threads.

Scale blocks are document-local: block k of document b covers tokens
[start_b + k*B, min(start_b + (k+1)*B, end_b)). No block spans two documents.
One set of scales serves both orientations (the scale is shared across D).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import E4M3, FloatFormat, abs_bits, cast_to, pow2_scale_from_amax_bits

# Tokens of the transposed copy are padded to this multiple: TMA needs 16-byte
# aligned strides, and kernels load whole 128-token tiles.
TOKEN_PAD = 128
# Each document's first column in data_dt is a multiple of this. 16 is the minimum (a TMA
# box on the contiguous axis must start 16-byte aligned: unaligned starts fault on the
# H200); 32 keeps every document's rows on whole 32-byte sectors, so no sector is written
# in two halves by two CTAs (on the H200 longtail32k's token-block quantization reaches 81% of
# 4.3 TB/s, 63% with 16; 128-aligned workloads are the same).
DT_DOC_ALIGN = 32
# Column j of each 16-column group holds token PV_ORDER16[j] of the group (pv_order=True).
PV_ORDER16 = tuple(k for t in range(4) for k in (2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t))


def transposed_tokens(total_tokens: int, num_docs: int) -> int:
    """Columns of data_dt: room for every document rounded up to DT_DOC_ALIGN, then to TOKEN_PAD."""
    return round_up(max(total_tokens + (DT_DOC_ALIGN - 1) * num_docs, 1), TOKEN_PAD)


def dt_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Start column of every document in data_dt (int32 prefix sums of lengths rounded up to DT_DOC_ALIGN)."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    padded = (lens + DT_DOC_ALIGN - 1) // DT_DOC_ALIGN * DT_DOC_ALIGN
    out = torch.zeros(cu_seqlens.numel(), dtype=torch.int64, device=cu_seqlens.device)
    out[1:] = torch.cumsum(padded, 0)
    return out.to(torch.int32)


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass(frozen=True)
class QuantizedTHD:
    """FP8 data of one operand in both orientations plus its one set of scales."""

    data_td: torch.Tensor | None  # (T, H, D) float8; None if not requested (a forward-only V)
    data_dt: torch.Tensor | None  # (H, D, T_dt) float8, documents at dt_cu_seqlens; None if not requested
    scale: torch.Tensor  # (H, T) fp32, power of two
    block_tokens: int
    fmt_name: str
    dt_pv_order: bool = False  # data_dt columns in P-fragment order (PV_ORDER16)

    def dequantize(self, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 (T, H, D) values that the quantized operand stands for. An operand written transposed
        only (data_td None, e.g. V of a forward_only launch) is read from data_dt: needs cu_seqlens."""
        data = self.data_td
        if data is None:
            if cu_seqlens is None:
                raise ValueError("cu_seqlens: needed to dequantize an operand that has only data_dt")
            data = untranspose_tokens(natural_dt(self), cu_seqlens, self.scale.shape[1])
        return data.float() * self.scale.t().unsqueeze(-1)


def token_block_ids(cu_seqlens: torch.Tensor, total_tokens: int, block_tokens: int) -> torch.Tensor:
    """Global id of the document-local scale block of every token, shape (T,)."""
    cu = cu_seqlens.to(torch.int64)
    tok = torch.arange(total_tokens, device=cu.device)
    doc = torch.searchsorted(cu[1:], tok, right=True)
    pos_in_doc = tok - cu[doc]
    blocks_per_doc = (cu[1:] - cu[:-1] + block_tokens - 1) // block_tokens
    first_block = torch.cumsum(blocks_per_doc, 0) - blocks_per_doc
    return first_block[doc] + pos_in_doc // block_tokens


def block_amax_bits(x: torch.Tensor, cu_seqlens: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """Per-(head, token) amax bit pattern over the token's scale block, (H, T) int32."""
    T, H, _ = x.shape
    tok_bits = abs_bits(x).amax(dim=-1)  # (T, H) per-token amax over D
    if block_tokens == 1:
        return tok_bits.t().contiguous()
    ids = token_block_ids(cu_seqlens, T, block_tokens)
    nblocks = int(ids.max().item()) + 1 if T > 0 else 0
    blk = torch.zeros(nblocks, H, dtype=torch.int32, device=x.device)
    blk = blk.scatter_reduce(0, ids.unsqueeze(1).expand(T, H), tok_bits, reduce="amax", include_self=True)
    return blk[ids].t().contiguous()


def quantize_with_scale(x: torch.Tensor, scale_ht: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """x (T, H, D) / scale (H, T), rounded to fmt; returned as the fmt dtype.

    A block whose scale is NaN (a non-finite input) gets the code 0 throughout: the products
    never meet a NaN code, so a masked zero cannot turn into NaN where a tile spans another
    document, and the bad value still reaches its own document through the scale. Codes saturate
    at the format's max (cvt.rn.satfinite; torch's CUDA cast would give NaN): only values above
    1.75 * 2^127, whose scale is clamped (quant.formats), get there."""
    scale_t = scale_ht.t().unsqueeze(-1)
    inv = torch.reciprocal(scale_t)  # exact: scales are powers of two
    y = (x.float() * inv).masked_fill(torch.isnan(scale_t), 0.0)
    return y.clamp(-fmt.max_value, fmt.max_value).to(fmt.torch_dtype)


def quantize_thd(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_tokens: int = 1,
    fmt: FloatFormat = E4M3,
    transposed: bool = True,
    pv_order: bool = False,
) -> QuantizedTHD:
    """Quantize a packed (T, H, D) tensor with document-local token-block scales.

    block_tokens = 1 is per-token scaling. This is the specification of the
    fused-quantization kernels, bit for bit. pv_order: data_dt in P-fragment order (V).
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    scale = pow2_scale_from_amax_bits(block_amax_bits(x, cu_seqlens, block_tokens), fmt)
    data_td = quantize_with_scale(x, scale, fmt)
    data_dt = transpose_tokens(data_td, cu_seqlens, pv_order) if transposed else None
    return QuantizedTHD(data_td, data_dt, scale, block_tokens, fmt.name, pv_order and transposed)


def quantize_attention_operands(q, k, v, cu_seqlens, block_tokens: int):
    """The spec of an attention call's fused Q/K/V quantization (flamia_cute.sm90.quantize.qkv_config).

    Q per token; K and V per block_tokens, plus per-token copies (for the diagonal tiles) when
    block_tokens > 1. The data_dt of Q and V are in P-fragment order: V^T is the B operand of
    the forward's P V, Q^T that of the backward's dK = dS^T Q, both with A from registers.
    Returns qq, (kq, kt), (vq, vt), with kt = vt = None for block_tokens == 1.
    """
    qq = quantize_thd(q, cu_seqlens, 1, pv_order=True)
    kq = quantize_thd(k, cu_seqlens, block_tokens)
    vq = quantize_thd(v, cu_seqlens, block_tokens, pv_order=True)
    kt = vt = None
    if block_tokens > 1:
        kt, vt = quantize_thd(k, cu_seqlens, 1), quantize_thd(v, cu_seqlens, 1, pv_order=True)
    return qq, (kq, kt), (vq, vt)


def transpose_tokens(data_td: torch.Tensor, cu_seqlens: torch.Tensor, pv_order: bool = False) -> torch.Tensor:
    """(T, H, D) -> (H, D, T_dt): tokens contiguous, each document starting at its dt_cu_seqlens column;
    pv_order: every 16-column group permuted by PV_ORDER16."""
    T, H, D = data_td.shape
    num_docs = cu_seqlens.numel() - 1
    out = torch.zeros(H, D, transposed_tokens(T, num_docs), dtype=data_td.dtype, device=data_td.device)
    out[:, :, _dt_columns(cu_seqlens, T, data_td.device)] = data_td.permute(1, 2, 0)
    if pv_order:
        perm = torch.tensor(PV_ORDER16, device=out.device)
        out = out.view(H, D, -1, 16)[..., perm].reshape(H, D, -1).contiguous()
    return out


def _dt_columns(cu_seqlens: torch.Tensor, total_tokens: int, device) -> torch.Tensor:
    """The data_dt column of every token (natural order): its document's dt_cu_seqlens start + offset."""
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    tok = torch.arange(total_tokens, device=device)
    doc = torch.searchsorted(cu[1:], tok, right=True)
    return dt_cu_seqlens(cu).to(torch.int64)[doc] + tok - cu[doc]


def untranspose_tokens(data_dt: torch.Tensor, cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """(H, D, T_dt) in natural column order -> (T, H, D): transpose_tokens undone."""
    return data_dt[:, :, _dt_columns(cu_seqlens, total_tokens, data_dt.device)].permute(2, 0, 1).contiguous()


def natural_dt(qt: QuantizedTHD) -> torch.Tensor:
    """qt.data_dt with its columns in natural token order (undoes pv_order)."""
    dt = qt.data_dt
    if not qt.dt_pv_order:
        return dt
    inv = torch.argsort(torch.tensor(PV_ORDER16, device=dt.device))
    return dt.view(*dt.shape[:2], -1, 16)[..., inv].reshape(dt.shape)


def tensor_scale(x: torch.Tensor, fmt: FloatFormat = E4M3) -> torch.Tensor:
    """The pow2 scale of ONE amax over the whole tensor (every document, head and token), 0-dim, on x's
    device (no host sync)."""
    return pow2_scale_from_amax_bits(abs_bits(x).amax().reshape(1), fmt)[0]


def quantize_per_tensor(x: torch.Tensor, fmt: FloatFormat = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """One amax over the whole tensor (the cuDNN-like, leaky control). Returns (values fp32, scale)."""
    scale = tensor_scale(x, fmt)
    return cast_to(x.float() / scale, fmt), scale


def quantize_thd_per_tensor(
    x: torch.Tensor, cu_seqlens: torch.Tensor, fmt: FloatFormat = E4M3, transposed: bool = True,
    pv_order: bool = False,
) -> QuantizedTHD:
    """quantize_per_tensor's values in the per-token layouts (every token holding the one scale), so
    the per-token kernels run the per-tensor recipe unchanged. Leaky by design: the scale spans
    documents and future tokens."""
    T, H, _ = x.shape
    scale = tensor_scale(x, fmt).expand(H, T).contiguous()
    data_td = quantize_with_scale(x, scale, fmt)
    data_dt = transpose_tokens(data_td, cu_seqlens, pv_order) if transposed else None
    return QuantizedTHD(data_td, data_dt, scale, 1, fmt.name, pv_order and transposed)
