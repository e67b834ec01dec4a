"""MXFP8 operands in the layout of the Blackwell (sm_100a) kernels: e4m3 codes plus E8M0 scale chunks.

The block-scaled tcgen05 MMA reads its scale factors (SF) from tensor memory, copied there from
shared memory as 512-byte chunks: one chunk covers 128 rows of the operand's M/N axis and four
32-element blocks of its reduction axis, the byte of (row n, block kb) at
    16 * (n % 32) + 4 * (n // 32) + kb
(cutlass.utils.blockscaled_layout.BlockScaledBasicChunk, K-major; the same whether the operand's
codes are K-major or MN-major). The kernels' tiles are 128 tokens and head_dim = 128 = 4 blocks, so
every tile of every operand is one chunk, loaded by one TMA copy. Chunks are stored per head, one
slot per document-local 128-token tile:
    slot(document b, tile j) = sum over b' < b of ceil(len_b' / 128), plus j,
so no chunk spans two documents and a kernel finds a tile's chunk from cu_seqlens alone (no
host table). `sf_slots(T, num_docs)` bounds the slot count from shapes (no host sync).

Two chunk orientations:
- token rows: rows = the tile's 128 tokens, blocks = 32 head dims (an operand scaled along D);
- dim rows: rows = the 128 head dims, blocks = the tile's four document-local 32-token blocks (an
  operand scaled along the tokens, the B of a product that reduces over them). A block that starts
  past the document's end holds 127.

The forward (recipe `mxfp8`, flamia_cute.emulator), `pack_mx_forward_operands`:
- Q: one scale per (token, 32 head-dim block) along D: token-row chunks, the SFA of S = Q K^T;
- K: one scale per (32-token document-local block, 32-dim block), a 32x32 tile scale that is a
  valid 1x32 scale along D and along tokens: token-row chunks, the SFB of S = Q K^T;
- V: the same 32x32 tile scales in dim-row chunks, the SFB of O = P V. FLAMIA's orientation
  reuse: V's codes are quantized once and stored token-major, (T, Hk, D) like K's; the forward
  reads them as P V's MN-major B operand, so no transposed copy exists. Only the chunks differ
  between K's and V's orientations.
Unused chunk entries (token rows past a document's end) hold 127 (scale 1).

The diagonal safeguard runs pairs within one 32-token block in bf16; its S operand on the query
side is Q's MX value itself, codes times scales, which bf16 holds exactly (e4m3's 3 mantissa bits,
an E8M0 power of two): the forward converts Q's codes in shared memory, no copy is stored.

The planned backward's dO, `pack_mx_do_operands`: codes along D with token-row chunks (dP = dO V^T
reduces over D), codes along the tokens with dim-row chunks (dV = P^T dO reduces over the queries;
token-major like V's, read MN-major), and D = rowsum(dO * O) in a fixed fp32 order (`rowsum_do_o`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import E4M3, cast_to
from .microscaling import e8m0_scale
from .quantize import token_block_ids

MX_TILE = 128  # tokens per tile = rows per scale chunk
MX_BLOCK = 32  # elements per E8M0 scale
SF_CHUNK_BYTES = 512  # 128 rows x 4 blocks
SF_UNUSED = 127  # E8M0 of 1.0
ROWSUM_LANES = 8  # D = rowsum(dO * O): 8 partial sums of 16 head dims each (rowsum_do_o)


def sf_slots(total_tokens: int, num_docs: int) -> int:
    """Chunk slots per head: an upper bound of sum ceil(len_b / 128) from shapes alone."""
    return max(-(-total_tokens // MX_TILE) + num_docs, 1)


def sf_tile_starts(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Each document's first chunk slot: prefix sums of ceil(len / 128) (int32, num_docs + 1), in one
    cumsum on cu_seqlens' device (no host sync)."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
    return torch.nn.functional.pad(torch.cumsum((lens + MX_TILE - 1) // MX_TILE, 0, dtype=torch.int32), (1, 0))


def sf_byte_offset(row: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Byte of (row, block) inside a 512-byte chunk (BlockScaledBasicChunk, K-major)."""
    return 16 * (row % 32) + 4 * (row // 32) + block


@dataclass(frozen=True)
class MxForwardOperands:
    """What the sm_100a forward reads (recipe mxfp8). T tokens, H query heads, Hk KV heads, D = 128."""

    q: torch.Tensor  # (T, H, D) float8_e4m3fn codes
    q_sf: torch.Tensor  # (H, slots, 512) uint8 E8M0 token-row chunks, SFA of S = Q K^T
    k: torch.Tensor  # (T, Hk, D) float8_e4m3fn codes
    k_sf: torch.Tensor  # (Hk, slots, 512) uint8 token-row chunks, SFB of S = Q K^T
    v: torch.Tensor  # (T, Hk, D) float8_e4m3fn codes (token-major: P V's MN-major B)
    v_sf: torch.Tensor  # (Hk, slots, 512) uint8 dim-row chunks, SFB of O = P V
    k_diag: torch.Tensor  # (T, Hk, D) bf16: the diagonal blocks' K
    v_diag: torch.Tensor  # (T, Hk, D) bf16: the diagonal blocks' V


@dataclass(frozen=True)
class MxDoOperands:
    """dO as the planned sm_100a MXFP8 backward reads it. T tokens, H heads, D = 128."""

    do: torch.Tensor  # (T, H, D) float8_e4m3fn codes, blocks of 32 along D (dP = dO V^T)
    do_sf: torch.Tensor  # (H, slots, 512) uint8 token-row chunks
    do_t: torch.Tensor  # (T, H, D) float8_e4m3fn codes, blocks of 32 document-local tokens (dV = P^T dO)
    do_t_sf: torch.Tensor  # (H, slots, 512) uint8 dim-row chunks
    delta: torch.Tensor  # (H, T) fp32 D = rowsum(dO * O) (rowsum_do_o)


def _doc_positions(cu_seqlens: torch.Tensor, T: int):
    """Per token: its document, its position inside it, and its chunk slot (int64)."""
    doc = torch.searchsorted(cu_seqlens.to(torch.int64), torch.arange(T, device=cu_seqlens.device), right=True) - 1
    pos = torch.arange(T, device=cu_seqlens.device) - cu_seqlens.to(torch.int64)[doc]
    return doc, pos, token_block_ids(cu_seqlens, T, MX_TILE)


def _scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes of power-of-two fp32 scales."""
    return (torch.log2(scale).round().to(torch.int64) + 127).to(torch.uint8)


MX_SCALINGS = ("along_d", "tile", "along_tokens")


def _mx_scales(x: torch.Tensor, cu_seqlens: torch.Tensor, scaling: str) -> torch.Tensor:
    """(T, H, D) fp32 scale of every element: along_d one per (token, 32 head dims); tile one per 32x32
    document-local tile; along_tokens one per (32-token document-local block, head dim). Zero rows
    stand in for a block's tokens past the document end, as the emulator's padding. The emulator's
    e8m0_scale, so the values agree exactly."""
    T, H, D = x.shape
    if scaling not in MX_SCALINGS:
        raise ValueError(f"scaling must be one of {MX_SCALINGS}, got {scaling!r}")
    mag = x.float().abs()
    if scaling != "along_tokens":
        mag = mag.reshape(T, H, D // MX_BLOCK, MX_BLOCK).amax(-1, keepdim=True)
    if scaling == "along_d":
        scale = e8m0_scale(mag)
    else:
        block_id = token_block_ids(cu_seqlens, T, MX_BLOCK)
        n_blocks = sf_slots(T, cu_seqlens.numel() - 1) * (MX_TILE // MX_BLOCK)  # a bound from shapes: no host sync
        block_amax = torch.zeros((n_blocks, *mag.shape[1:]), dtype=torch.float32, device=x.device)
        block_amax.scatter_reduce_(0, block_id.view(-1, *([1] * (mag.dim() - 1))).expand_as(mag), mag, "amax")
        scale = e8m0_scale(block_amax)[block_id]
    return scale if scaling == "along_tokens" else scale.expand(T, H, D // MX_BLOCK, MX_BLOCK).reshape(T, H, D)


def _codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 codes of x / scale (RNE, saturating at 448: quant.formats.cast_to, as the emulator)."""
    return cast_to(x.float() / scale, E4M3).to(torch.float8_e4m3fn)


class _Chunks:
    """Writes E8M0 scale chunks of (T, heads, D) per-element scales for the document mix `cu`."""

    def __init__(self, cu: torch.Tensor, T: int, D: int, device):
        self.slots = sf_slots(T, cu.numel() - 1)
        _, pos, self.slot = _doc_positions(cu, T)
        self.row, self.D, self.device = pos % MX_TILE, D, device

    def _write(self, scale, off, pick):
        heads = scale.shape[1]
        sf = torch.full((heads, self.slots, SF_CHUNK_BYTES), SF_UNUSED, dtype=torch.uint8, device=self.device)
        for h in range(heads):
            sf[h].index_put_((self.slot[:, None].expand_as(off), off), _scale_bytes(pick(scale[:, h])))
        return sf

    def token_rows(self, scale):
        """Rows = the tile's tokens, blocks of 32 along D."""
        b = torch.arange(self.D // MX_BLOCK, device=self.device)
        return self._write(scale, sf_byte_offset(self.row[:, None], b[None, :]), lambda s: s[:, b * MX_BLOCK])

    def dim_rows(self, scale):
        """Rows = head dims, blocks = the tile's 32-token blocks (every token of a block writes its byte)."""
        d = torch.arange(self.D, device=self.device)
        return self._write(scale, sf_byte_offset(d[None, :], (self.row // MX_BLOCK)[:, None]), lambda s: s)


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
    cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
    chunks = _Chunks(cu, T, D, q.device)
    sq, sk, sv = _mx_scales(q, cu, "along_d"), _mx_scales(k, cu, "tile"), _mx_scales(v, cu, "tile")
    return MxForwardOperands(_codes(q, sq), chunks.token_rows(sq), _codes(k, sk), chunks.token_rows(sk),
                             _codes(v, sv), chunks.dim_rows(sv), k.to(torch.bfloat16), v.to(torch.bfloat16))


def rowsum_do_o(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """(H, T) fp32 D = rowsum(dO * O) in the dO quantizer's order: each product rounded to fp32 (exact
    unless it underflows), ROWSUM_LANES partial sums of 16 consecutive head dims, each left to right,
    then pairs of partial sums, pairs of those, and so on (the lanes' butterfly)."""
    T, H, D = dout.shape
    prod = (dout.float() * out.float()).reshape(T, H, ROWSUM_LANES, D // ROWSUM_LANES)
    acc = prod[..., 0]
    for j in range(1, prod.shape[-1]):
        acc = acc + prod[..., j]
    while acc.shape[-1] > 1:
        acc = acc[..., 0::2] + acc[..., 1::2]
    return acc[..., 0].transpose(0, 1).contiguous()


def pack_mx_do_operands(dout, out, cu_seqlens) -> MxDoOperands:
    """dO of bf16 (T, H, 128) dout for the planned sm_100a MXFP8 backward, and D of dout and the forward's
    bf16 out (reference; any device): the specification of sm100/quantize_do_mx.py. Its values equal the
    emulator's MX quantization of dO (flamia_cute.emulator.quantize_operand, recipe mxfp8's `do`: along
    D and along the document-local tokens); D equals its rowsum up to the fp32 summation order."""
    T, H, D = dout.shape
    if D != 128:
        raise ValueError(f"dout: the sm_100a scale chunks need head_dim 128, got {D}")
    if out.shape != dout.shape:
        raise ValueError(f"out must have dout's shape {tuple(dout.shape)}, got {tuple(out.shape)}")
    cu = cu_seqlens.to(device=dout.device, dtype=torch.int64)
    chunks = _Chunks(cu, T, D, dout.device)
    sd, st = _mx_scales(dout, cu, "along_d"), _mx_scales(dout, cu, "along_tokens")
    return MxDoOperands(_codes(dout, sd), chunks.token_rows(sd), _codes(dout, st), chunks.dim_rows(st),
                        rowsum_do_o(dout, out))


def unpack_token_rows_sf(sf: torch.Tensor, cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """(T, heads, 4) fp32 scales read back from token-row chunks (Q's, K's, dO's along D)."""
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
    """(T, heads, D) fp32: the scale each (token, head dim) element is multiplied by, from dim-row
    chunks (V's in P V, dO's along the tokens)."""
    cu = cu_seqlens.to(device=sf.device, dtype=torch.int64)
    _, pos, slot = _doc_positions(cu, T)
    d = torch.arange(head_dim, device=sf.device)
    off = sf_byte_offset(d[None, :], ((pos % MX_TILE) // MX_BLOCK)[:, None])  # (T, D)
    b = sf[:, slot[:, None], off]  # (heads, T, D)
    return torch.exp2(b.to(torch.float32) - 127).permute(1, 0, 2)


def decode_dim_rows(codes: torch.Tensor, sf: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(T, heads, D) fp32 values of token-major codes scaled along the tokens (V's, dO's along the
    tokens) as the block-scaled MMA reads them (exact)."""
    return codes.float() * unpack_dim_rows_sf(sf, cu_seqlens, codes.shape[0], codes.shape[2])
