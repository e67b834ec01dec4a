"""Low-precision number formats and power-of-two scale arithmetic.

Every scale in flamia_cute is a power of two. Multiplying by one is exact in
fp32, so the CPU emulator and the GPU kernels quantize bit-identically, a
scale stays valid under transposition, and folding a scale ratio into P or dS
never adds rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FloatFormat:
    name: str
    torch_dtype: torch.dtype | None
    max_value: float
    # floor(log2(max_value)) and whether max_value's mantissa exceeds 1.75, used by
    # the exact power-of-two scale rule below.
    mantissa_bits: int


E4M3 = FloatFormat("e4m3", torch.float8_e4m3fn, 448.0, 3)
E5M2 = FloatFormat("e5m2", torch.float8_e5m2, 57344.0, 2)
E2M1 = FloatFormat("e2m1", None, 6.0, 1)  # NVFP4 elements (emulated values only)
BF16 = FloatFormat("bf16", torch.bfloat16, float(torch.finfo(torch.bfloat16).max), 7)

FORMATS = {f.name: f for f in (E4M3, E5M2, E2M1, BF16)}

SCALE_EXP_MIN = -126  # smallest scale 2**-126: finite and normal in fp32
SCALE_EXP_MAX = 127  # minus the format's emax: the largest code times the scale stays below 2**128


def format_by_name(name: str) -> FloatFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; expected one of {sorted(FORMATS)}") from None


def abs_bits(x: torch.Tensor) -> torch.Tensor:
    """|x| of fp32 values as int32 bit patterns.

    Integer max over these orders finite < inf < nan, so an amax taken on bits
    propagates NaN identically on CPU and GPU (float max ignores NaN on GPUs).
    """
    return x.float().view(torch.int32) & 0x7FFFFFFF


def pow2_scale_from_amax_bits(amax_bits: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """The smallest power-of-two scale s with amax / s <= fmt.max_value.

    Exact integer rule on the bits of amax (= 1.M * 2**e): fmt.max_value is
    1.75 * 2**8 for e4m3 and 1.75 * 2**15 for e5m2, so k = e - emax when
    1.M <= 1.75, else e - emax + 1, clamped to [2**-126, 2**(127 - emax)]. The
    upper clamp keeps every code's value finite: with 2**(128 - emax) an amax
    above 1.9375 * 2**127 (the top of bf16's range) would round up to 2**128,
    fp32's infinity; clamped, values above 1.75 * 2**127 saturate at that value
    instead. amax == 0 gives the smallest scale 2**-126: finite, and never the
    largest scale of a tile, so an all-zero token (the last token of every
    document has a zero dO row) cannot dominate a scale fold. A non-finite amax
    gives a NaN scale: a non-finite input poisons its block (its codes are 0,
    quant.quantize.quantize_with_scale), and only through that scale.
    """
    if fmt.name not in ("e4m3", "e5m2"):
        raise ValueError(f"pow2 scale rule is defined for e4m3/e5m2, not {fmt.name}")
    emax = 8 if fmt.name == "e4m3" else 15
    bits = amax_bits.to(torch.int32)
    biased = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    k = biased - 127 - emax + (mant > 0x600000).to(torch.int32)
    k = k.clamp(SCALE_EXP_MIN, SCALE_EXP_MAX - emax)
    scale_bits = (k + 127) << 23
    scale = scale_bits.view(torch.float32).clone()
    scale = torch.where(biased == 255, torch.full_like(scale, float("nan")), scale)
    return scale


def pow2_scale(amax: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    return pow2_scale_from_amax_bits(abs_bits(amax), fmt)


def reciprocal_pow2(scale: torch.Tensor) -> torch.Tensor:
    """1/scale for power-of-two scales, exactly (NaN stays NaN)."""
    return torch.reciprocal(scale)


def cast_to(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Round fp32 values to fmt (RNE, saturating as cvt.rn.satfinite) and return them as fp32."""
    if fmt.name == "e2m1":
        return round_e2m1(x)
    # Saturate explicitly: torch's CPU cast saturates, its CUDA cast gives NaN past the max (MX values
    # reach 512 before the OCP clamp). clamp keeps NaN, as cvt.rn.satfinite does.
    return x.float().clamp(-fmt.max_value, fmt.max_value).to(fmt.torch_dtype).float()


_E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the FP4 (e2m1) grid with round-to-nearest-even and saturation at 6."""
    grid = _E2M1_GRID.to(x.device)
    a = x.float().abs().clamp(max=6.0).contiguous()
    idx = torch.searchsorted(grid, a).clamp(1, len(grid) - 1)
    lo, hi = grid[idx - 1], grid[idx]
    d_lo, d_hi = a - lo, hi - a
    # ties go to the even code (codes 0,2,4,6 are even: 0, 1.0, 2.0, 4.0)
    lo_even = ((idx - 1) % 2) == 0
    pick_lo = (d_lo < d_hi) | ((d_lo == d_hi) & lo_even)
    r = torch.where(pick_lo, lo, hi)
    r = torch.where(torch.isnan(x), x.float(), r)
    return torch.copysign(r, x.float())
