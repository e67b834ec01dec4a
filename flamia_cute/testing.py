"""Shared test helpers: input sets, error metrics, and the leakage checks.

check_leakage implements the design note's definition exactly:
1. future perturbation: positions >= c of one document replaced by fresh
   values of 100x magnitude; O and LSE before c bit-identical, dQ before c
   unchanged;
2. document isolation: one whole document replaced; O, LSE, dQ, dK, dV of
   every other document unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# ----------------------------------------------------------------------------- inputs


def cu_seqlens_from_lengths(lengths, device="cpu") -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=torch.int32, device=device)


def make_inputs(lengths, heads_q=2, heads_kv=2, head_dim=128, kind="normal", seed=0, device="cpu",
                dtype=torch.bfloat16):
    """Q, K, V, dO (bf16) and cu_seqlens for one of the issue's input sets.

    normal: all N(0, 1); softmax scale 1/sqrt(d).
    outliers: plus 4 head-dim channels x20 in Q and K, a per-channel bias
    5*N(0,1) added to every K row, 1% of tokens x30 in V and dO; scale 1/(8 sqrt(d)).
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    T = int(sum(lengths))

    def rnd(h):
        return torch.randn(T, h, head_dim, generator=g)

    q, k, v, do = rnd(heads_q), rnd(heads_kv), rnd(heads_kv), rnd(heads_q)
    scale = 1.0 / math.sqrt(head_dim)
    if kind == "outliers":
        ch = torch.randperm(head_dim, generator=g)[:4]
        q[:, :, ch] *= 20
        k[:, :, ch] *= 20
        k += 5 * torch.randn(1, heads_kv, head_dim, generator=g)
        for t in (v, do):
            rows = torch.rand(T, generator=g) < 0.01
            t[rows] *= 30
        scale = 1.0 / (8 * math.sqrt(head_dim))
    elif kind != "normal":
        raise ValueError(f"kind must be 'normal' or 'outliers', got {kind!r}")
    cu = cu_seqlens_from_lengths(lengths, device)
    conv = lambda t: t.to(device=device, dtype=dtype)
    return conv(q), conv(k), conv(v), conv(do), cu, scale


def fp8_mma_truncated(a: torch.Tensor, b: torch.Tensor, bits: int, kstep: int = 32) -> torch.Tensor:
    """a @ b as Hopper's FP8 wgmma k-chain keeps it: an error model for the kernels' test bounds.

    Per k32 instruction the accumulator and the 32 exact products are aligned to the largest
    exponent among them and truncated (toward zero) to `bits` significant bits, then summed
    (~14 bits per the DeepSeek-V3 report, sec. 3.3.2).
    """
    a, b = a.double(), b.double()
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64)
    for k0 in range(0, a.shape[1], kstep):
        add = torch.cat([acc[:, None, :], a[:, k0 : k0 + kstep, None] * b[None, k0 : k0 + kstep, :]], 1)
        mx = add.abs().amax(1, keepdim=True)
        grid = torch.exp2(torch.floor(torch.log2(torch.where(mx > 0, mx, 1.0))) - (bits - 1))
        acc = (torch.trunc(add / grid) * grid).sum(1)
    return acc.float()


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref, x = ref.detach().double(), x.detach()
    err = (x.double() - ref).pow(2).sum()
    if err == 0:
        return math.inf
    return float(10 * torch.log10(ref.pow(2).sum() / err))


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref, x = ref.detach().double(), x.detach()
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-300))


# ----------------------------------------------------------------------------- leakage

# fn(q, k, v, cu_seqlens, dout) -> dict with out, lse (H, T) and optionally dq, dk, dv
AttentionFn = Callable[..., dict]


@dataclass
class LeakageReport:
    future_ok: bool = True
    isolation_ok: bool = True
    details: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.future_ok and self.isolation_ok

    def __str__(self) -> str:
        head = f"future perturbation {'ok' if self.future_ok else 'LEAKS'}, " \
               f"document isolation {'ok' if self.isolation_ok else 'LEAKS'}"
        return head + "".join(f"\n  {d}" for d in self.details)


def _same(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    if tol == 0:
        return torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b)
    return bool(((a.double() - b.double()).abs() <= tol * b.double().abs().clamp_min(1e-6)).all())


def _perturb(x: torch.Tensor, rows: slice, gen: torch.Generator) -> torch.Tensor:
    y = x.clone()
    n = rows.stop - rows.start
    fresh = torch.randn(n, *x.shape[1:], generator=gen) * 100
    y[rows] = fresh.to(device=x.device, dtype=x.dtype)
    return y


def check_leakage(fn: AttentionFn, q, k, v, cu_seqlens, dout=None, doc: int | None = None, cut: int | None = None,
                  grad_tol: float = 0.0, seed: int = 1234) -> LeakageReport:
    """Run both leakage tests on fn; bit-identity for O and LSE, dQ/dK/dV within grad_tol (0: bit-identical).

    doc: the document perturbed (default: the longest); cut: position inside
    it (default: a third of the way in, off any 16-token boundary so that
    token blocks straddle it).
    """
    cu = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    if doc is None:
        doc = max(range(len(lengths)), key=lambda i: lengths[i])
    s, e = cu[doc], cu[doc + 1]
    if e - s < 2:
        raise ValueError(f"check_leakage: document {doc} needs >= 2 tokens, has {e - s}")
    if cut is None:
        cut = max(1, (e - s) // 3) | 1  # odd: straddles token blocks
    c = s + cut
    if not (s < c < e):
        raise ValueError(f"check_leakage: cut {cut} must lie strictly inside document {doc} (length {e - s})")
    gen = torch.Generator().manual_seed(seed)
    base = fn(q, k, v, cu_seqlens, dout)
    rep = LeakageReport()

    def compare(name, a, b, rows, tol, flag):
        if a is None or b is None:
            return True
        if name == "lse":
            a, b = a[:, rows], b[:, rows]
        else:
            a, b = a[rows], b[rows]
        if _same(a, b, tol):
            return True
        diff = (a.double() - b.double()).abs().max().item()
        rep.details.append(f"{flag}: {name} changed (max abs diff {diff:.3e})")
        return False

    # 1. future perturbation within doc
    pert = [_perturb(t, slice(c, e), gen) if t is not None else None for t in (q, k, v, dout)]
    res = fn(*pert[:3], cu_seqlens, pert[3])
    before = slice(s, c)
    for name in ("out", "lse"):
        rep.future_ok &= compare(name, res[name], base[name], before, 0.0, f"future (doc {doc}, cut {cut})")
    rep.future_ok &= compare("dq", res.get("dq"), base.get("dq"), before, grad_tol, f"future (doc {doc}, cut {cut})")
    # 2. isolation: replace the whole document
    pert = [_perturb(t, slice(s, e), gen) if t is not None else None for t in (q, k, v, dout)]
    res = fn(*pert[:3], cu_seqlens, pert[3])
    others = torch.ones(cu[-1], dtype=torch.bool)
    others[s:e] = False
    idx = others.nonzero().squeeze(1)
    for name in ("out", "lse", "dq", "dk", "dv"):
        tol = 0.0 if name in ("out", "lse") else grad_tol
        rep.isolation_ok &= compare(name, res.get(name), base.get(name), idx, tol, f"isolation (doc {doc})")
    return rep


def attention_fn_for(recipe, softmax_scale=None, causal=True, backend="emulate", rotary=None) -> AttentionFn:
    """Adapter: flamia_attn_varlen_func as an AttentionFn (forward, and backward when dout is given);
    rotary: its rotary argument (a RotaryConfig, or a Rotary with tables for every length used)."""
    from .interface import flamia_attn_varlen_func

    def fn(q, k, v, cu, dout=None):
        lens = (cu[1:] - cu[:-1]).max().item() if cu.numel() > 1 else 0
        qq, kk, vv = (t.detach().clone().requires_grad_(dout is not None) for t in (q, k, v))
        out, lse = flamia_attn_varlen_func(qq, kk, vv, cu, cu, int(lens), int(lens), softmax_scale, causal,
                                           recipe=recipe, backend=backend, return_lse=True, rotary=rotary)
        res = {"out": out.detach(), "lse": lse.detach()}
        if dout is not None:
            dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), dout)
            res.update(dq=dq, dk=dk, dv=dv)
        return res

    return fn
