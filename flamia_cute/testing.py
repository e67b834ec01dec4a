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
    """Run both leakage tests on fn (self-attention: fn(q, k, v, cu_seqlens, dout)); bit-identity for O and
    LSE, dQ/dK/dV within grad_tol (0: bit-identical).

    doc: the document perturbed (default: the longest); cut: position inside
    it (default: a third of the way in, off any 16-token boundary so that
    token blocks straddle it).
    """
    return check_leakage_varlen(lambda q_, k_, v_, cq, _ck, do: fn(q_, k_, v_, cq, do), q, k, v, cu_seqlens,
                                cu_seqlens, dout, doc, cut, grad_tol, seed)


def check_leakage_varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, dout=None, doc: int | None = None,
                         cut: int | None = None, grad_tol: float = 0.0, seed: int = 1234,
                         causal: bool = True) -> LeakageReport:
    """check_leakage for queries that are a sub-range of their document's keys: fn(q, k, v, cu_q, cu_k, dout).

    Document i's queries are the last Lq_i positions of its Lk_i keys (causal aligned to the end of the
    query range). cut is a key position inside the document (default: a third of the way in, odd): the
    future test perturbs the keys from the cut on and the queries at those positions, and compares the
    queries before it. causal=False: every key of a document is visible to all its queries, so only
    the isolation test applies.
    """
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    len_k = [b - a for a, b in zip(ck[:-1], ck[1:], strict=True)]
    len_q = [b - a for a, b in zip(cq[:-1], cq[1:], strict=True)]
    if doc is None:
        doc = max(range(len(len_k)), key=lambda i: len_k[i])
    ks, ke, qs, qe = ck[doc], ck[doc + 1], cq[doc], cq[doc + 1]
    if ke - ks < 2:
        raise ValueError(f"check_leakage: document {doc} needs >= 2 keys, has {ke - ks}")
    if cut is None:
        cut = max(1, (ke - ks) // 3) | 1  # odd: straddles token blocks
    if not (0 < cut < ke - ks):
        raise ValueError(f"check_leakage: cut {cut} must lie strictly inside document {doc} (length {ke - ks})")
    offset = len_k[doc] - len_q[doc]  # key position of the document's first query
    gen = torch.Generator().manual_seed(seed)
    base = fn(q, k, v, cu_seqlens_q, cu_seqlens_k, dout)
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

    def perturbed(q_rows, k_rows):
        return [_perturb(t, rows, gen) if t is not None else None
                for t, rows in ((q, q_rows), (k, k_rows), (v, k_rows), (dout, q_rows))]

    # 1. future perturbation within doc (keys from the cut on, and the queries there)
    if causal:
        q_cut = qs + min(max(cut - offset, 0), qe - qs)  # first query at a key position >= cut
        if q_cut == qs:  # a future test that compares no query passes whatever fn does
            raise ValueError(f"check_leakage: cut {cut} is at or before document {doc}'s first query (key position "
                             f"{offset}): no query lies before it")
        pert = perturbed(slice(q_cut, qe), slice(ks + cut, ke))
        res = fn(*pert[:3], cu_seqlens_q, cu_seqlens_k, pert[3])
        before, flag = slice(qs, q_cut), f"future (doc {doc}, cut {cut})"
        for name in ("out", "lse"):
            rep.future_ok &= compare(name, res[name], base[name], before, 0.0, flag)
        rep.future_ok &= compare("dq", res.get("dq"), base.get("dq"), before, grad_tol, flag)
    # 2. isolation: replace the whole document
    pert = perturbed(slice(qs, qe), slice(ks, ke))
    res = fn(*pert[:3], cu_seqlens_q, cu_seqlens_k, pert[3])

    def others(cu, s, e):
        keep = torch.ones(cu[-1], dtype=torch.bool)
        keep[s:e] = False
        return keep.nonzero().squeeze(1)

    q_idx, k_idx = others(cq, qs, qe), others(ck, ks, ke)
    for name, idx in (("out", q_idx), ("lse", q_idx), ("dq", q_idx), ("dk", k_idx), ("dv", k_idx)):
        tol = 0.0 if name in ("out", "lse") else grad_tol
        rep.isolation_ok &= compare(name, res.get(name), base.get(name), idx, tol, f"isolation (doc {doc})")
    return rep


def attention_fn_for(recipe, softmax_scale=None, causal=True, backend="emulate", rotary=None) -> AttentionFn:
    """Adapter: flamia_attn_varlen_func as an AttentionFn (forward, and backward when dout is given).
    fn(q, k, v, cu, dout) is self-attention; fn.varlen(q, k, v, cu_q, cu_k, dout) takes both cu_seqlens
    (check_leakage_varlen's form). rotary: its rotary argument (a RotaryConfig, or a Rotary with tables for
    every length used)."""
    from .interface import flamia_attn_varlen_func

    def varlen(q, k, v, cu_q, cu_k, dout=None):
        def longest(cu):
            return int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0

        qq, kk, vv = (t.detach().clone().requires_grad_(dout is not None) for t in (q, k, v))
        out, lse = flamia_attn_varlen_func(qq, kk, vv, cu_q, cu_k, longest(cu_q), longest(cu_k), softmax_scale, causal,
                                           recipe=recipe, backend=backend, return_lse=True, rotary=rotary)
        res = {"out": out.detach(), "lse": lse.detach()}
        if dout is not None:
            dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), dout)
            res.update(dq=dq, dk=dk, dv=dv)
        return res

    def fn(q, k, v, cu, dout=None):
        return varlen(q, k, v, cu, cu, dout)

    fn.varlen = varlen
    return fn


# ----------------------------------------------------------------------------- non-finite inputs

NONFINITE = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
POISON_INPUTS = ("q", "k", "v", "do")


def poison(x: torch.Tensor, token: int, head: int, value: float, channel: int = 5) -> torch.Tensor:
    """A copy of x (T, heads, D) with one element replaced by value."""
    y = x.clone()
    y[token, head, channel] = value
    return y


def check_nonfinite_input(fn: AttentionFn, q, k, v, cu_seqlens, dout, which: str, doc: int, pos: int,
                          value: float, head: int = 0, base: dict | None = None, dq_tol: float = 0.0,
                          tiles: bool = False) -> list[str]:
    """One non-finite value at position pos of document doc (head `head` of input `which`: q, k, v or
    do); returns what is wrong (empty: nothing). base: fn's result on the clean inputs.

    1. every other document's O, LSE, dQ, dK and dV equal the clean run's, bitwise (dQ within
       dq_tol, relative, when its fp32 reduce-adds land in any order);
    2. inside the poisoned document, every output that depends on the bad value in exact attention
       is non-finite, each element of its row: a row of O, LSE and dQ that sees it, the dK and dV of
       the keys such a row sees (the dV of a bad V's keys excepted: dV never reads V);
    3. what exact attention computes without the bad value equals the clean run bitwise: LSE for a
       bad V or dO, O for a bad dO, dV for a bad V (every document); O and LSE of the other query
       rows for a bad Q, of the rows before it for a bad K; dQ of the other rows for a bad Q or dO;
    4. tiles=True (the kernels, whose products read whole 128-token tiles): also O and LSE of the
       rows before the bad position's 128-token block for a bad V, dQ of the rows before that block
       for a bad K or V, and dK, dV of the keys after it for a bad Q or dO.
    """
    if which not in POISON_INPUTS:
        raise ValueError(f"which must be one of {POISON_INPUTS}, got {which!r}")
    cu = cu_seqlens.tolist()
    s, e = cu[doc], cu[doc + 1]
    if not 0 <= pos < e - s:
        raise ValueError(f"pos {pos} lies outside document {doc} (length {e - s})")
    t = s + pos
    group = q.shape[1] // k.shape[1]
    ins = {"q": q, "k": k, "v": v, "do": dout}
    ins[which] = poison(ins[which], t, head, value)
    if base is None:
        base = fn(q, k, v, cu_seqlens, dout)
    res = fn(ins["q"], ins["k"], ins["v"], cu_seqlens, ins["do"])
    bad: list[str] = []
    T = cu[-1]

    def rows_of(name, sel):  # sel: token index tensor or slice; lse is (H, T)
        return (lambda x: x[:, sel]) if name == "lse" else (lambda x: x[sel])

    def equal(name, sel, heads=None, tol=0.0, what=""):
        a, b = res[name], base[name]
        if heads is not None:
            a, b = (a[heads] if name == "lse" else a[:, heads]), (b[heads] if name == "lse" else b[:, heads])
        a, b = rows_of(name, sel)(a), rows_of(name, sel)(b)
        if a.numel() == 0:
            return
        ok = _same(a, b, tol) if tol == 0 else bool(torch.isfinite(a.float()).all()) and _same(a, b, tol)
        if not ok:
            nf = int((~torch.isfinite(a.float())).sum())
            bad.append(f"{which}={value} at doc {doc} pos {pos}: {name} {what} changed ({nf} non-finite)")

    def nonfinite(name, sel, heads, what):
        x = res[name]
        x = x[heads] if name == "lse" else x[:, heads]
        x = rows_of(name, sel)(x).float()
        if x.numel() and bool(torch.isfinite(x).any()):
            bad.append(f"{which}={value} at doc {doc} pos {pos}: {name} {what} has "
                       f"{int(torch.isfinite(x).sum())} finite elements where the bad value reaches")

    # 1. the other documents
    others = torch.ones(T, dtype=torch.bool)
    others[s:e] = False
    idx = others.nonzero().squeeze(1)
    for name in ("out", "lse", "dq", "dk", "dv"):
        equal(name, idx, tol=dq_tol if name == "dq" else 0.0, what="of another document")
    # 2. and 3. inside the poisoned document
    hk = head // group if which in ("q", "do") else head
    qheads = [head] if which in ("q", "do") else list(range(hk * group, (hk + 1) * group))
    here, upto, after = slice(t, t + 1), slice(s, t + 1), slice(t, e)
    block = s + (pos // 128) * 128  # first token of the bad position's 128-token block
    block_end = min(e, block + 128)
    other_rows = torch.cat([torch.arange(s, t), torch.arange(t + 1, e)])
    if which == "q":
        for name in ("out", "lse", "dq"):
            nonfinite(name, here, qheads, "at the bad query")
            equal(name, other_rows, qheads, dq_tol if name == "dq" else 0.0, "of the other queries")
        for name in ("dk", "dv"):
            nonfinite(name, upto, [hk], "of the keys the bad query sees")
    elif which == "k" or which == "v":
        for name in ("out", "dq") + (("lse",) if which == "k" else ()):
            nonfinite(name, after, qheads, "of the queries that see the bad key")
        for name in ("dk",) + (("dv",) if which == "k" else ()):
            nonfinite(name, slice(s, e), [hk], "of the keys that share a query with the bad key")
        if which == "k":
            for name in ("out", "lse"):
                equal(name, slice(s, t), qheads, what="of the queries before the bad key")
        else:
            equal("lse", slice(0, T), what="(V does not enter it)")
            equal("dv", slice(0, T), what="(V does not enter it)")
        if tiles:
            equal("dq", slice(s, block), qheads, dq_tol, "of the queries before the bad key's block")
            if which == "v":
                for name in ("out", "lse"):
                    equal(name, slice(s, block), qheads, what="of the queries before the bad key's block")
    else:  # do
        nonfinite("dq", here, qheads, "at the bad dO row")
        for name in ("dk", "dv"):
            nonfinite(name, upto, [hk], "of the keys the bad dO row sees")
        for name in ("out", "lse"):
            equal(name, slice(0, T), what="(the forward does not read dO)")
        equal("dq", other_rows, qheads, dq_tol, "of the other queries")
    if tiles and which in ("q", "do"):
        for name in ("dk", "dv"):
            equal(name, slice(block_end, e), [hk], what="of the keys after the bad query's block")
    return bad


def check_nonfinite_isolation_varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, dout, which: str, doc: int,
                                     pos: int, value: float, head: int = 0, base: dict | None = None,
                                     dq_tol: float = 0.0) -> list[str]:
    """check_nonfinite_input's isolation part for separate query and key ranges (cross-length causal,
    causal=False): fn(q, k, v, cu_q, cu_k, dout) as attention_fn_for(...).varlen. One non-finite value
    at position pos of document doc (a query row for q and do, a key row for k and v). Every other
    document's O, LSE, dQ (query rows) and dK, dV (key rows) equal the clean run's bitwise (dQ within
    dq_tol); the poisoned document shows it somewhere (a non-finite O, dQ, dK or dV element), never
    silently finite. Returns what is wrong (empty: nothing)."""
    if which not in POISON_INPUTS:
        raise ValueError(f"which must be one of {POISON_INPUTS}, got {which!r}")
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    cu = cq if which in ("q", "do") else ck
    if not 0 <= pos < cu[doc + 1] - cu[doc]:
        raise ValueError(f"pos {pos} lies outside document {doc} (length {cu[doc + 1] - cu[doc]})")
    ins = {"q": q, "k": k, "v": v, "do": dout}
    ins[which] = poison(ins[which], cu[doc] + pos, head, value)
    if base is None:
        base = fn(q, k, v, cu_seqlens_q, cu_seqlens_k, dout)
    res = fn(ins["q"], ins["k"], ins["v"], cu_seqlens_q, cu_seqlens_k, ins["do"])
    bad: list[str] = []

    def outside(c):
        keep = torch.ones(c[-1], dtype=torch.bool)
        keep[c[doc]:c[doc + 1]] = False
        return keep.nonzero().squeeze(1)

    rows = {"out": outside(cq), "lse": outside(cq), "dq": outside(cq), "dk": outside(ck), "dv": outside(ck)}
    for name, idx in rows.items():
        a, b = res[name], base[name]
        a, b = (a[:, idx], b[:, idx]) if name == "lse" else (a[idx], b[idx])
        tol = dq_tol if name == "dq" else 0.0
        if a.numel() and not (_same(a, b, tol) and (tol == 0 or bool(torch.isfinite(a.float()).all()))):
            nf = int((~torch.isfinite(a.float())).sum())
            bad.append(f"{which}={value} at doc {doc} pos {pos}: {name} of another document changed ({nf} non-finite)")
    inside = {"out": slice(cq[doc], cq[doc + 1]), "dq": slice(cq[doc], cq[doc + 1]),
              "dk": slice(ck[doc], ck[doc + 1]), "dv": slice(ck[doc], ck[doc + 1])}
    if all(bool(torch.isfinite(res[name][sel].float()).all()) for name, sel in inside.items()):
        bad.append(f"{which}={value} at doc {doc} pos {pos}: every output of the poisoned document is finite")
    return bad


class TinyBlock(torch.nn.Module):
    """A model's attention block for the tests: qkv projection, flamia_attn_varlen_func, output projection;
    with mlp=True also a residual and a one-layer MLP (what an activation checkpoint wraps)."""

    def __init__(self, dim=64, heads=2, recipe="fp8_tokenblock", backend="emulate", rotary=None, mlp=False):
        super().__init__()
        self.heads, self.recipe, self.backend, self.rotary = heads, recipe, backend, rotary
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.mlp = torch.nn.Linear(dim, dim, bias=False) if mlp else None

    def forward(self, x, cu, max_seqlen):
        from .interface import flamia_attn_varlen_func

        T, dim = x.shape
        q, k, v = self.qkv(x).view(T, 3, self.heads, dim // self.heads).unbind(1)
        o = self.proj(flamia_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, recipe=self.recipe,
                                              backend=self.backend, rotary=self.rotary).reshape(T, dim))
        if self.mlp is None:
            return o
        h = x + o
        return h + torch.relu(self.mlp(h))
