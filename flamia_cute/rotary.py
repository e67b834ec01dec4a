"""Rotations of Q and K inside the quantization: rotary position embedding (RoPE) and the
Walsh-Hadamard transform of the `*_hadamard` recipes.

Both are orthogonal per-token transforms of the head dimension, so they never mix tokens (no leak)
and QK^T sees them only as intended: RoPE makes S depend on relative positions, the Hadamard
transform leaves S unchanged exactly and spreads outlier channels over the whole head dimension
before the e4m3 rounding. The forward applies them in the pass that quantizes Q and K; the backward
applies their inverses where dQ and dK are written (the dQ conversion, the dK epilogue), so the
gradients come back in the caller's frame and no rotated bf16 copy of Q or K is ever stored.

The specification (`transform_qk`, `transform_grad`), which the emulator runs and the sm_90a
quantization reproduces bit for bit:

- positions: a token's index inside its own document (0 at every document start in cu_seqlens);
  queries of a document shorter than its keys (cross-attention) are aligned to the end of the keys,
  as the causal mask is;
- RoPE on the first rotary_dim channels, the rest passed through. Half-split (Llama, GPT-NeoX):
  channel i pairs with i + rotary_dim/2; interleaved (GPT-J): channel 2i with 2i + 1. With
  c = cos[pos, i], s = sin[pos, i] of the pair's frequency i, in fp32 with each product and sum
  rounded once (no fused multiply-add): y1 = x1*c - x2*s, y2 = x2*c + x1*s; then rounded to the
  input's dtype, as a bf16 RoPE pass writes it;
- Hadamard (recipe.hadamard): the unnormalized fast Walsh-Hadamard transform over the whole head
  dimension n (64 or 128), in fp32, butterflies (a, b) -> (a + b, a - b) over the channel bits from
  the lowest, times 2^-hadamard_shift(n, side), rounded to the input's dtype. The normalized
  transform is H/sqrt(n) on both sides; the shifts split 1/n between Q (2^-ceil(log2(n)/2)) and
  K (2^-floor(log2(n)/2)) so that every factor is a power of two, and Q'K'^T = QK^T exactly;
- the backward: dX = R^T dX' with the inverse applied in fp32 to the fp32 gradient before its bf16
  rounding: the Hadamard transform times the same shift first, then RoPE by -theta.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

ROTARY_TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class RotaryConfig:
    """RoPE computed from theta: cos/sin of position * theta^(-2i/rotary_dim), i < rotary_dim/2, in
    float64, stored as fp32 tables (built once per theta, rotary_dim, length and device).
    rotary_dim: the rotated leading channels (None: the whole head dimension); interleaved: GPT-J's
    pairs (2i, 2i+1) instead of Llama's halves (i, i + rotary_dim/2)."""

    theta: float = 10000.0
    interleaved: bool = False
    rotary_dim: int | None = None

    def __post_init__(self):
        if isinstance(self.theta, bool) or not isinstance(self.theta, (int, float)) or not (
                math.isfinite(self.theta) and self.theta > 0):
            raise ValueError(f"RotaryConfig.theta must be a finite positive number, got {self.theta!r}")
        if not isinstance(self.interleaved, bool):
            raise TypeError(f"RotaryConfig.interleaved must be a bool, got {type(self.interleaved).__name__}")
        if self.rotary_dim is not None and (isinstance(self.rotary_dim, bool) or not isinstance(self.rotary_dim, int)
                                            or self.rotary_dim < 2 or self.rotary_dim % 2):
            raise ValueError(f"RotaryConfig.rotary_dim must be a positive even int or None, got {self.rotary_dim!r}")

    def tables(self, rows: int, head_dim: int, device) -> Rotary:
        """The Rotary tables of this config for positions 0 .. rows-1."""
        rd = self.rotary_dim or head_dim
        if rd > head_dim:
            raise ValueError(f"rotary: RotaryConfig.rotary_dim {rd} exceeds the head dim {head_dim}")
        if torch.compiler.is_compiling():  # traced into the graph: no cached tensors in a compiled region
            cos, sin = theta_tables(float(self.theta), rd, rows, device)
        else:  # rows rounded up, so a training run builds them once
            cos, sin = _cached_theta_tables(float(self.theta), rd, max(256, 1 << max(rows - 1, 0).bit_length()),
                                            torch.device(device))
        return Rotary(cos, sin, self.interleaved)


@dataclass(frozen=True, eq=False)
class Rotary:
    """RoPE from tables: cos, sin (positions, rotary_dim // 2), the layout of flash_attn.layers.rotary
    (row p holds position p; a Llama/Hugging Face table cat((freqs, freqs)) of width rotary_dim is
    passed as its first half, cos[:, :rotary_dim // 2]). fp32, bf16 or fp16, on the inputs' device;
    the kernels read fp32 (other dtypes are converted per call, exactly). interleaved: as RotaryConfig."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool = False

    def __post_init__(self):
        for name in ("cos", "sin"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"Rotary.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 2 or t.shape[1] < 1:
                raise ValueError(f"Rotary.{name} must have shape (positions, rotary_dim // 2), got {tuple(t.shape)}")
            if t.dtype not in ROTARY_TABLE_DTYPES:
                raise TypeError(f"Rotary.{name} must be float32, bfloat16 or float16, got {t.dtype}")
        if self.cos.shape != self.sin.shape:
            raise ValueError(f"Rotary.cos and Rotary.sin must have one shape, got {tuple(self.cos.shape)} and "
                             f"{tuple(self.sin.shape)}")
        if self.cos.device != self.sin.device:
            raise ValueError(f"Rotary.cos and Rotary.sin must be on one device, got {self.cos.device} and "
                             f"{self.sin.device}")
        if not isinstance(self.interleaved, bool):
            raise TypeError(f"Rotary.interleaved must be a bool, got {type(self.interleaved).__name__}")

    @property
    def rotary_dim(self) -> int:
        return 2 * self.cos.shape[1]


def theta_tables(theta: float, rotary_dim: int, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos, sin (rows, rotary_dim // 2) of position * theta^(-2i / rotary_dim), computed in float64."""
    i = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device)
    inv_freq = theta ** (-i / rotary_dim)
    angles = torch.arange(rows, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return angles.cos().float().contiguous(), angles.sin().float().contiguous()


@functools.lru_cache(maxsize=16)
def _cached_theta_tables(theta: float, rotary_dim: int, rows: int, device: torch.device):
    return theta_tables(theta, rotary_dim, rows, device)


def resolve_rotary(rotary, head_dim: int, max_seqlen: int, device) -> Rotary | None:
    """The call's Rotary (tables on `device` that cover positions < max_seqlen), or None; errors name
    the argument. Checks shapes only: positions restart per document, so max_seqlen bounds them."""
    if rotary is None:
        return None
    if isinstance(rotary, RotaryConfig):
        rotary = rotary.tables(max(int(max_seqlen), 1), head_dim, device)
    if not isinstance(rotary, Rotary):
        raise TypeError(f"rotary must be None, a flamia_cute.Rotary or a flamia_cute.RotaryConfig, got "
                        f"{type(rotary).__name__}")
    rd = rotary.rotary_dim
    if rd > head_dim:
        raise ValueError(f"rotary: rotary_dim {rd} (2 * cos.shape[1]) exceeds the head dim {head_dim}; the tables "
                         "are (positions, rotary_dim // 2)")
    if rotary.cos.device != torch.device(device) and not (rotary.cos.device.type == torch.device(device).type == "cuda"
                                                         and rotary.cos.device.index == torch.device(device).index):
        raise ValueError(f"rotary: cos and sin must be on the inputs' device {device}, got {rotary.cos.device}")
    if rotary.cos.shape[0] < max_seqlen:
        raise ValueError(f"rotary: cos and sin have {rotary.cos.shape[0]} positions, fewer than max_seqlen "
                         f"{max_seqlen} (positions restart at every document start)")
    return rotary


def kernel_tables(rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin as the kernels read them: fp32, contiguous, 16-byte aligned (exact conversions). Under
    torch.compile the address is unknown while tracing: a misaligned table view is then refused by the
    kernel launch's check, with the argument's name."""
    def fix(t):
        t = t if t.dtype == torch.float32 else t.float()
        t = t if t.is_contiguous() else t.contiguous()
        if torch.compiler.is_compiling():
            return t
        return t if t.data_ptr() % 16 == 0 else t.clone()

    return fix(rotary.cos), fix(rotary.sin)


# ----------------------------------------------------------------------------- the specification


def document_positions(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int) -> torch.Tensor:
    """(total_q,) int64: each query's position inside its document, aligned to the end of the
    document's keys (len_k - len_q + index; the index itself for self-attention). No host sync."""
    cu_q64, cu_k64 = cu_q.to(torch.int64), cu_k.to(torch.int64)
    idx = torch.arange(total_q, device=cu_q.device, dtype=torch.int64)
    doc = torch.searchsorted(cu_q64[1:], idx, right=True)  # right=True skips empty documents
    shift = (cu_k64[1:] - cu_k64[:-1]) - (cu_q64[1:] - cu_q64[:-1])
    return idx - cu_q64[doc] + shift[doc] if total_q else idx


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool,
         inverse: bool = False) -> torch.Tensor:
    """fp32 (T, H, D): x rotated by +theta (inverse: -theta) at each token's position, on the first
    2 * cos.shape[1] channels; each product and sum rounded once in fp32 (float64 x: in float64, the
    tests' reference)."""
    xf = x if x.dtype == torch.float64 else x.float()
    half = cos.shape[1]
    c = cos.to(xf.dtype)[positions][:, None, :]
    s = sin.to(xf.dtype)[positions][:, None, :]
    if interleaved:
        x1, x2 = xf[..., 0 : 2 * half : 2], xf[..., 1 : 2 * half : 2]
    else:
        x1, x2 = xf[..., :half], xf[..., half : 2 * half]
    if inverse:
        y1, y2 = x1 * c + x2 * s, x2 * c - x1 * s
    else:
        y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
    out = xf.clone()
    if interleaved:
        out[..., 0 : 2 * half : 2], out[..., 1 : 2 * half : 2] = y1, y2
    else:
        out[..., :half], out[..., half : 2 * half] = y1, y2
    return out


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """The unnormalized fast Walsh-Hadamard transform of fp32 x over its last dimension (a power of two),
    butterflies (a, b) -> (a + b, a - b) from the lowest channel bit up: the order the kernels use."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"walsh_hadamard: the last dimension must be a power of two, got {n}")
    y = x if x.dtype == torch.float64 else x.float()
    h = 1
    while h < n:
        v = y.reshape(*y.shape[:-1], n // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(y.shape)
        h *= 2
    return y


def hadamard_shift(head_dim: int, side: str) -> int:
    """Q's factor is 2^-ceil(log2(n)/2), K's 2^-floor(log2(n)/2): together 1/n, so (QH)(KH)^T = QK^T."""
    if side not in ("q", "k"):
        raise ValueError(f"side must be 'q' or 'k', got {side!r}")
    bits = head_dim.bit_length() - 1
    return (bits + 1) // 2 if side == "q" else bits // 2


@dataclass(frozen=True, eq=False)
class QKTransform:
    """The rotations of one attention call: RoPE tables (None: no RoPE) and the Hadamard flag."""

    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    interleaved: bool = False
    hadamard: bool = False

    @property
    def active(self) -> bool:
        return self.cos is not None or self.hadamard

    def forward(self, x: torch.Tensor, positions: torch.Tensor, side: str) -> torch.Tensor:
        """The operand the quantization sees, in x's dtype (transform_qk)."""
        y = x
        if self.cos is not None:
            y = rope(y, self.cos, self.sin, positions, self.interleaved).to(x.dtype)
        if self.hadamard:
            y = (walsh_hadamard(y.float()) * 2.0 ** -hadamard_shift(x.shape[-1], side)).to(x.dtype)
        return y

    def backward(self, g: torch.Tensor, positions: torch.Tensor, side: str) -> torch.Tensor:
        """fp32 gradient in the caller's frame from the fp32 gradient of the transformed operand."""
        g = g.float()
        if self.hadamard:
            g = walsh_hadamard(g) * 2.0 ** -hadamard_shift(g.shape[-1], side)
        if self.cos is not None:
            g = rope(g, self.cos, self.sin, positions, self.interleaved, inverse=True)
        return g


def apply_rotary(x: torch.Tensor, cu_seqlens: torch.Tensor, rotary: Rotary | RotaryConfig,
                 max_seqlen: int | None = None) -> torch.Tensor:
    """x (T, H, D) rotated as flamia_attn_varlen_func(rotary=...) rotates Q and K (positions restart at
    every document start), in x's dtype and differentiable: for callers that need the rotated tensor
    itself (a KV cache). Torch ops: one more pass over x, which the fused call does not make."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"x must be a (total_tokens, heads, head_dim) tensor, got {getattr(x, 'shape', type(x))}")
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    rot = resolve_rotary(rotary, x.shape[-1], min(max_seqlen, x.shape[0]), x.device)  # no document is longer
    pos = document_positions(cu_seqlens, cu_seqlens, x.shape[0])
    return rope(x, rot.cos, rot.sin, pos, rot.interleaved).to(x.dtype)
