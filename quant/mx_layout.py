"""MXFP8 operands in the layout of the Blackwell (sm_100a) forward: e4m3 codes plus E8M0 scale chunks.

The block-scaled tcgen05 MMA reads its scale factors (SF) from tensor memory, copied there from
shared memory as 512-byte chunks: one chunk covers 128 rows of the operand's M/N axis and four
32-element blocks of its reduction axis, the byte of (row n, block kb) at
    16 * (n % 32) + 4 * (n // 32) + kb
(cutlass.utils.blockscaled_layout.BlockScaledBasicChunk, K-major). The forward's tiles are 128
tokens and head_dim = 128 = 4 blocks, so every tile of every operand is one chunk, loaded by one
TMA copy. Chunks are stored per head, one slot per document-local 128-token tile:
    slot(document b, tile j) = sum over b' < b of ceil(len_b' / 128), plus j,
so no chunk spans two documents and a kernel finds a tile's chunk from cu_seqlens alone (no
host table). `sf_slots(T, num_docs)` bounds the slot count from shapes (no host sync).

Orientations (the recipe `mxfp8`, flamia_cute.emulator):
- Q: one scale per (token, 32 head-dim block) along D: the SFA of S = Q K^T (rows = queries);
- K: one scale per (32-token document-local block, 32-dim block), a 32x32 tile scale that is a
  valid 1x32 scale along D and along tokens: the SFB of S = Q K^T (rows = keys, blocks along D);
- V: the same 32x32 tile scales, arranged as the SFB of O = P V (rows = head dims, blocks along
  keys). FLAMIA's orientation reuse: V's codes are quantized once; only the 512-byte chunks
  differ between orientations.
V's codes are stored transposed, (Hk, D, T_dt) with document b from column dt_cu_seqlens[b] (the
Hopper V^T layout of quant.quantize, keys in natural order). Unused chunk entries (rows past a
document's end) hold 127 (scale 1) and their codes are 0 or another document's (finite, times
P = 0).

The diagonal safeguard runs pairs within one 32-token block in bf16; its S operand on the
query side is Q's MX value itself, which bf16 holds exactly (e4m3's 3 mantissa bits, an E8M0
power of two): `q_diag`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import E4M3, cast_to
from .microscaling import e8m0_scale
from .quantize import DT_DOC_ALIGN, dt_cu_seqlens, token_block_ids, transposed_tokens

MX_TILE = 128  # tokens per tile = rows per scale chunk
MX_BLOCK = 32  # elements per E8M0 scale
SF_CHUNK_BYTES = 512  # 128 rows x 4 blocks
SF_UNUSED = 127  # E8M0 of 1.0


def sf_slots(total_tokens: int, num_docs: int) -> int:
    """Chunk slots per head: an upper bound of sum ceil(len_b / 128) from shapes alone."""
    return max(-(-total_tokens // MX_TILE) + num_docs, 1)


def sf_tile_starts(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Each document's first chunk slot: prefix sums of ceil(len / 128) (int64, num_docs + 1)."""
    return document_starts(cu_seqlens)[0].to(torch.int64)


def document_starts(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(2, num_docs + 1) int32: each document's first chunk slot and its first V^T column
    (quant.dt_cu_seqlens), in one cumsum on the device (no host sync)."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
    per_doc = torch.stack([(lens + MX_TILE - 1) // MX_TILE, (lens + DT_DOC_ALIGN - 1) // DT_DOC_ALIGN * DT_DOC_ALIGN])
    return torch.nn.functional.pad(torch.cumsum(per_doc, 1, dtype=torch.int32), (1, 0))


def sf_byte_offset(row: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Byte of (row, block) inside a 512-byte chunk (BlockScaledBasicChunk, K-major)."""
    return 16 * (row % 32) + 4 * (row // 32) + block


@dataclass(frozen=True)
class MxForwardOperands:
    """What the sm_100a forward reads (recipe mxfp8). T tokens, H query heads, Hk KV heads, D = 128."""

    q: torch.Tensor  # (T, H, D) float8_e4m3fn codes
    q_sf: torch.Tensor  # (H, slots, 512) uint8 E8M0 chunks, SFA of S = Q K^T
    k: torch.Tensor  # (T, Hk, D) float8_e4m3fn codes
    k_sf: torch.Tensor  # (Hk, slots, 512) uint8, SFB of S = Q K^T
    v_dt: torch.Tensor  # (Hk, D, T_dt) float8_e4m3fn codes, documents at dt_cu_seqlens
    v_sf: torch.Tensor  # (Hk, slots, 512) uint8, SFB of O = P V
    q_diag: torch.Tensor  # (T, H, D) bf16: Q's MX values (exact in bf16), the diagonal blocks' S operand
    k_diag: torch.Tensor  # (T, Hk, D) bf16: the diagonal blocks' K
    v_diag: torch.Tensor  # (T, Hk, D) bf16: the diagonal blocks' V


def _doc_positions(cu_seqlens: torch.Tensor, T: int):
    """Per token: its document, its position inside it, and its chunk slot (int64)."""
    doc = torch.searchsorted(cu_seqlens.to(torch.int64), torch.arange(T, device=cu_seqlens.device), right=True) - 1
    pos = torch.arange(T, device=cu_seqlens.device) - cu_seqlens.to(torch.int64)[doc]
    return doc, pos, token_block_ids(cu_seqlens, T, MX_TILE)


def _scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes of power-of-two fp32 scales."""
    return (torch.log2(scale).round().to(torch.int64) + 127).to(torch.uint8)


def _mx_scales(x: torch.Tensor, cu_seqlens: torch.Tensor, tile_2d: bool) -> torch.Tensor:
    """(T, H, D / 32) fp32 scales: per token along D, or (tile_2d) per 32x32 document-local tile,
    each token holding its block's. Same e8m0_scale as the emulator, so the values agree exactly."""
    T, H, D = x.shape
    amax = x.float().abs().reshape(T, H, D // MX_BLOCK, MX_BLOCK).amax(-1)
    if not tile_2d:
        return e8m0_scale(amax)
    block_id = token_block_ids(cu_seqlens, T, MX_BLOCK)
    n_blocks = sf_slots(T, cu_seqlens.numel() - 1) * (MX_TILE // MX_BLOCK)  # a bound from shapes: no host sync
    tile_amax = torch.zeros(n_blocks, H, D // MX_BLOCK, dtype=torch.float32, device=x.device)
    tile_amax.scatter_reduce_(0, block_id[:, None, None].expand_as(amax), amax, "amax")
    return e8m0_scale(tile_amax)[block_id]


def pack_mx_forward_operands(q, k, v, cu_seqlens) -> MxForwardOperands:
    """Quantize bf16 (T, H, D) q and (T, Hk, D) k, v for the sm_100a forward (reference; any device).

    The specification of what a fused Blackwell quantization kernel writes; the codes and scales
    equal the emulator's (flamia_cute.emulator.quantize_operand for recipe mxfp8).
    """
    T, H, D = q.shape
    if D != 128:
        raise ValueError(f"q: the sm_100a forward's scale chunks need head_dim 128, got {D}")
    if k.shape != v.shape or k.shape[0] != T or k.shape[2] != D or H % k.shape[1]:
        raise ValueError(f"k, v must be (T={T}, Hk, {D}) with H={H} a multiple of Hk; got k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    Hk = k.shape[1]
    cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
    num_docs = cu.numel() - 1
    slots = sf_slots(T, num_docs)
    doc, pos, slot = _doc_positions(cu, T)
    row = pos % MX_TILE

    def codes(x, scale):
        xs = x.float().reshape(T, x.shape[1], D // MX_BLOCK, MX_BLOCK) / scale[..., None]
        return cast_to(xs, E4M3).reshape(x.shape).to(torch.float8_e4m3fn)

    def token_rows_chunks(scale, heads):
        # rows = tokens of the tile, blocks along D
        sf = torch.full((heads, slots, SF_CHUNK_BYTES), SF_UNUSED, dtype=torch.uint8, device=q.device)
        b = torch.arange(D // MX_BLOCK, device=q.device)
        off = sf_byte_offset(row[:, None], b[None, :])  # (T, 4)
        for h in range(heads):
            sf[h].index_put_((slot[:, None].expand_as(off), off), _scale_bytes(scale[:, h]))
        return sf

    sq = _mx_scales(q, cu, tile_2d=False)
    sk = _mx_scales(k, cu, tile_2d=True)
    sv = _mx_scales(v, cu, tile_2d=True)
    q8, k8, v8 = codes(q, sq), codes(k, sk), codes(v, sv)
    q_sf, k_sf = token_rows_chunks(sq, H), token_rows_chunks(sk, Hk)
    # V: rows = head dims, blocks = the tile's four 32-key blocks (every token of a block writes its block's byte)
    v_sf = torch.full((Hk, slots, SF_CHUNK_BYTES), SF_UNUSED, dtype=torch.uint8, device=q.device)
    d = torch.arange(D, device=q.device)
    off = sf_byte_offset(d[None, :], (row // MX_BLOCK)[:, None])  # (T, D)
    for h in range(Hk):
        v_sf[h].index_put_((slot[:, None].expand_as(off), off), _scale_bytes(sv[:, h, d // MX_BLOCK]))
    T_dt = transposed_tokens(T, num_docs)
    col = dt_cu_seqlens(cu).to(torch.int64)[doc] + pos
    v_dt = torch.zeros(Hk, D, T_dt, dtype=torch.uint8, device=q.device)
    v_dt[:, :, col] = v8.view(torch.uint8).permute(1, 2, 0)
    q_diag = (q8.float().reshape(T, H, D // MX_BLOCK, MX_BLOCK) * sq[..., None]).reshape(T, H, D)
    return MxForwardOperands(q8, q_sf, k8, k_sf, v_dt.view(torch.float8_e4m3fn), v_sf,
                             q_diag.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16))


def unpack_token_rows_sf(sf: torch.Tensor, cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """(T, heads, 4) fp32 scales read back from token-row chunks (Q's, K's): for tests."""
    cu = cu_seqlens.to(device=sf.device, dtype=torch.int64)
    _, pos, slot = _doc_positions(cu, T)
    off = sf_byte_offset((pos % MX_TILE)[:, None], torch.arange(4, device=sf.device)[None, :])
    b = sf[:, slot[:, None], off]  # (heads, T, 4)
    return torch.exp2(b.to(torch.float32) - 127).permute(1, 0, 2)


def decode_token_rows(codes: torch.Tensor, sf: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(T, heads, D) fp32 values of token-row MX codes (Q's, K's) as the block-scaled MMA reads them:
    each 32 head dims times its E8M0 scale (exact)."""
    T, heads, D = codes.shape
    scale = unpack_token_rows_sf(sf, cu_seqlens, T)[..., None]
    return (codes.float().reshape(T, heads, D // MX_BLOCK, MX_BLOCK) * scale).reshape(T, heads, D)


def unpack_dim_rows_sf(sf: torch.Tensor, cu_seqlens: torch.Tensor, T: int, head_dim: int = 128) -> torch.Tensor:
    """(T, heads, D) fp32: the scale each (key, head dim) element of V is multiplied by in P V: for tests."""
    cu = cu_seqlens.to(device=sf.device, dtype=torch.int64)
    _, pos, slot = _doc_positions(cu, T)
    d = torch.arange(head_dim, device=sf.device)
    off = sf_byte_offset(d[None, :], ((pos % MX_TILE) // MX_BLOCK)[:, None])  # (T, D)
    b = sf[:, slot[:, None], off]  # (heads, T, D)
    return torch.exp2(b.to(torch.float32) - 127).permute(1, 0, 2)
