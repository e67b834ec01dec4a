"""Microscaling formats for FLAMIA's Blackwell path (emulated here).

MXFP8: one E8M0 (power-of-two) scale per 32 elements along the reduction
dimension, e4m3 elements (OCP MX v1.0). NVFP4: one e4m3 scale per 16 e2m1
elements plus a second-level fp32 scale; here the second level is per token,
not per tensor, because a per-tensor amax leaks across positions.

Functions return fake-quantized fp32 values (element * scale), which is what
the block-scaled MMA multiplies. Token axes passed in are document-local (the
emulator works one document at a time), so no block spans two documents.
"""

from __future__ import annotations

import torch

from .formats import E2M1, E4M3, cast_to

E4M3_EMAX = 8  # floor(log2(448))


def pad_to_multiple(x: torch.Tensor, dim: int, block: int) -> tuple[torch.Tensor, int]:
    """Zero-pad `dim` to a multiple of block; returns (padded, original length)."""
    n = x.shape[dim]
    pad = (-n) % block
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)
    return x, n


def e8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    """OCP MX shared scale 2**(floor(log2(amax)) - emax_elem), kept in fp32's normal range.

    An all-zero block gets scale 1 (its elements are 0 either way): 2**-127 is an fp32
    denormal, which GPU math may flush to 0, and 0/0 would turn the block into NaN.
    """
    exp = torch.floor(torch.log2(amax.clamp_min(2.0**-126)))
    scale = torch.exp2((exp - E4M3_EMAX).clamp(-126, 127))
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def mx_quantize(x: torch.Tensor, dim: int, block: int = 32) -> torch.Tensor:
    """MXFP8 (e4m3) fake quantization with blocks of `block` along `dim`."""
    dim = dim % x.dim()
    xp, n = pad_to_multiple(x.float(), dim, block)
    shape = list(xp.shape)
    blocked = xp.reshape(shape[:dim] + [shape[dim] // block, block] + shape[dim + 1 :])
    scale = e8m0_scale(blocked.abs().amax(dim=dim + 1, keepdim=True))
    q = cast_to(blocked / scale, E4M3) * scale  # cast saturates at 448 as the OCP spec allows
    return q.reshape(shape).narrow(dim, 0, n)


def mx_quantize_2d(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Token-block MXFP8 of a (..., L, D) tensor: one E8M0 scale per block x block tile.

    The same scale is a valid 1x32 MX scale along D and along L, so one
    quantized copy serves both orientations (FLAMIA's token-block reuse).
    """
    xp, n_l = pad_to_multiple(x.float(), -2, block)
    xp, n_d = pad_to_multiple(xp, -1, block)
    *lead, L, D = xp.shape
    tiles = xp.reshape(*lead, L // block, block, D // block, block)
    scale = e8m0_scale(tiles.abs().amax(dim=(-3, -1), keepdim=True))
    q = (cast_to(tiles / scale, E4M3) * scale).reshape(*lead, L, D)
    return q[..., :n_l, :n_d]


def nvfp4_quantize(x: torch.Tensor, dim: int = -1, block: int = 16) -> torch.Tensor:
    """NVFP4 fake quantization along `dim`: e2m1 elements, e4m3 block scales, per-row fp32 global scale."""
    dim = dim % x.dim()
    xf = x.float()
    row_amax = xf.abs().amax(dim=dim, keepdim=True)
    glob = torch.where(row_amax > 0, row_amax / (448.0 * 6.0), torch.ones_like(row_amax))
    xp, n = pad_to_multiple(xf / glob, dim, block)
    shape = list(xp.shape)
    blocked = xp.reshape(shape[:dim] + [shape[dim] // block, block] + shape[dim + 1 :])
    bscale = cast_to(blocked.abs().amax(dim=dim + 1, keepdim=True) / 6.0, E4M3)
    safe = torch.where(bscale > 0, bscale, torch.ones_like(bscale))
    q = cast_to(blocked / safe, E2M1) * bscale
    return q.reshape(shape).narrow(dim, 0, n) * glob
