"""Non-finite inputs and large magnitudes (docs/numerics.md, "Non-finite inputs and large magnitudes").

A NaN or an infinity anywhere in one document's Q, K, V or dO leaves every other document's O, LSE,
dQ, dK and dV bitwise those of the clean run, and makes non-finite every output of its own document
that depends on it in exact attention (flamia_cute.testing.check_nonfinite_input). Finite bf16 inputs
give finite outputs wherever an fp32 attention (or FA4, on the GPU) does. The emulator on the CPU; the
kernels (backend="cute") on an sm_90 GPU, marker `gpu`.
"""

from __future__ import annotations

import os

import pytest
import torch

from flamia_cute.plan import deterministic_backward
from flamia_cute.quant import quantize_attention_operands, quantize_thd
from flamia_cute.reference import reference_attention
from flamia_cute.testing import (
    NONFINITE,
    POISON_INPUTS,
    attention_fn_for,
    check_nonfinite_input,
    check_nonfinite_isolation_varlen,
    cu_seqlens_from_lengths,
    make_inputs,
    rel_l2,
)

RECIPE = "fp8_tokenblock_dsbf16"
# a 1-token document, documents across and on a 128-token block edge; and a pack of short documents
# (mean <= 96 tokens), which the kernels put two to a tile (schedules.varlen_tiles.short_pair_partner:
# 64 & 17, 40 & 1, 33 & 64, 50 & 9)
MIXED = [37, 1, 300, 129, 1, 64, 200]
SHORT = [64, 17, 40, 1, 33, 64, 50, 9]
# (pack, document, position): mid-document, a block's first token, a 1-token document, a pair's
# second document, a pair's 1-token second document, a pair's first document's last token
CASES = {"mixed-mid": (MIXED, 2, 150), "mixed-edge": (MIXED, 3, 128), "mixed-1tok": (MIXED, 1, 0),
         "pair-second": (SHORT, 1, 16), "pair-1tok": (SHORT, 3, 0), "pair-first": (SHORT, 2, 39)}
HEAD_DIM = 64
# the probe: 10 documents of 1 to 1,000 tokens, the bad value in document 4 (GPU only)
PROBE = [1, 913, 37, 250, 1000, 129, 64, 500, 17, 768]
CASES["probe-doc4"] = (PROBE, 4, 517)


def _cases(gpu=False):
    """Every case with NaN; +-inf on one mixed and one paired case; the issue's probe on the GPU."""
    for name in CASES:
        if name == "probe-doc4" and not gpu:
            continue
        for which in POISON_INPUTS:
            for value in NONFINITE:
                if value == "nan" or name in ("mixed-edge", "pair-second"):
                    yield pytest.param(name, which, value, id=f"{name}-{which}-{value}")


_BASE: dict = {}


def _run_case(backend, heads, name, which, value, dq_tol=0.0, tiles=False, device="cpu", head_dim=HEAD_DIM):
    lengths, doc, pos = CASES[name]
    q, k, v, do, cu, scale = make_inputs(lengths, *heads, head_dim, seed=7, device=device)
    fn = attention_fn_for(RECIPE, scale, backend=backend)
    key = (backend, heads, head_dim, tuple(lengths), device, os.environ.get("FLAMIA_CUTE_DETERMINISTIC"))
    if key not in _BASE:
        _BASE[key] = fn(q, k, v, cu, do)
    return check_nonfinite_input(fn, q, k, v, cu, do, which, doc, pos, NONFINITE[value], head=1, base=_BASE[key],
                                 dq_tol=dq_tol, tiles=tiles)


@pytest.mark.parametrize("name, which, value", list(_cases()))
def test_emulator_isolates_nonfinite_inputs(name, which, value):
    bad = _run_case("emulate", (4, 2), name, which, value)
    assert not bad, "\n".join(bad)


def test_isolation_check_fails_a_leak():
    """The control: a function whose documents share a NaN (one output row of another document
    multiplied by a statistic over the packed batch) fails check_nonfinite_input."""
    lengths, doc, pos = CASES["mixed-mid"]
    q, k, v, do, cu, scale = make_inputs(lengths, 4, 2, HEAD_DIM, seed=7)
    base_fn = attention_fn_for(RECIPE, scale)

    def leaky(q, k, v, cu, dout=None):
        res = base_fn(q, k, v, cu, dout)
        res["dk"] = res["dk"].clone()
        res["dk"][0] *= k.float().sum().to(res["dk"].dtype) * 0 + 1  # NaN when any K is
        return res

    assert check_nonfinite_input(leaky, q, k, v, cu, do, "k", doc, pos, float("nan"))
    assert not check_nonfinite_input(leaky, q, k, v, cu, do, "q", doc, pos, float("nan"))


def test_quantization_puts_a_nonfinite_input_in_its_scale_only():
    """A non-finite input's block: scale NaN, every code 0 (so no product meets a NaN code); the other
    blocks bitwise the clean tensor's. Values at the top of bf16's range dequantize finite."""
    lengths = [5, 300, 1]
    cu = cu_seqlens_from_lengths(lengths)
    x = torch.randn(sum(lengths), 2, 64).bfloat16()
    clean = quantize_thd(x, cu, 128)
    for value in NONFINITE.values():
        y = x.clone()
        y[5 + 130, 1, 9] = value  # document 1, block 1 (its tokens 128..255), head 1
        for block in (1, 128):
            got, ref = quantize_thd(y, cu, block), quantize_thd(x, cu, block)
            bad = torch.zeros(sum(lengths), 2, dtype=torch.bool)
            bad[5 + 128 : 5 + 256, 1] = block == 128
            bad[5 + 130, 1] = True
            assert torch.equal(torch.isnan(got.scale).t(), bad)
            assert not got.data_td[bad].view(torch.uint8).any() and torch.isfinite(got.data_td.float()).all()
            assert torch.equal(got.data_td[~bad].view(torch.uint8), ref.data_td[~bad].view(torch.uint8))
            assert torch.isfinite(got.data_dt.float()).all()
            assert torch.isnan(got.dequantize()[bad]).all()
    qq, (kq, kt), (vq, vt) = quantize_attention_operands(x, x, x, cu, 128)
    assert torch.equal(clean.scale, kq.scale)
    huge = x.clone()
    huge[7, 0] = torch.tensor(3.3895e38).bfloat16()  # bf16's largest finite value
    deq = quantize_thd(huge, cu, 128).dequantize()
    assert torch.isfinite(deq).all() and deq[7, 0].abs().max() == 448 * 2.0**119


def test_dv_fold_reference_leaves_out_nan_scales():
    """The bf16-dS backward's dV fold reference per (KV head, document): the largest finite dO scale (a
    NaN one, a non-finite dO row, poisons its own P folds only), at least FOLD_REF_MIN."""
    pytest.importorskip("cutlass")
    from flamia_cute.recipes import FOLD_REF_MIN
    from flamia_cute.sm90.attention_bwd import dv_fold_reference

    g = torch.Generator().manual_seed(0)
    sdo = torch.exp2(torch.randint(-20, 10, (4, 30), generator=g).float())
    cu = cu_seqlens_from_lengths([10, 1, 19])
    sdo[1, 3] = sdo[2, 10] = sdo[0, 20] = float("nan")
    want = torch.stack([torch.stack([torch.nan_to_num(sdo[2 * h : 2 * h + 2, s:e], nan=0.0).amax() for s, e in
                                     ((0, 10), (10, 11), (11, 30))]) for h in range(2)]).clamp_min(FOLD_REF_MIN)
    assert torch.equal(dv_fold_reference(sdo, cu, 2), want)


def _magnitude_inputs(lengths, heads, scale_qkv, scale_v=None, device="cpu", seed=3, head_dim=HEAD_DIM):
    q, k, v, do, cu, scale = make_inputs(lengths, *heads, head_dim, seed=seed, device=device)

    def big(t, s):
        return (t.float() * s).to(torch.bfloat16)

    v = big(v, scale_v if scale_v is not None else scale_qkv)
    if scale_v is not None:  # each document's first V row at bf16's largest values: its first O row
        top = torch.tensor(3.3895e38, dtype=torch.bfloat16, device=device)
        v[cu[:-1].long().clamp_max(v.shape[0] - 1)] = torch.where(v[cu[:-1].long()] < 0, -top, top)
    return big(q, scale_qkv), big(k, scale_qkv), v, big(do, scale_qkv), cu, scale


# (Q, K, dO scale, V scale): the issue's sweep, and V up to the top of bf16's range under attention
# that picks one key per row (O = that key's V: finite in FA4, which sums exp(s - max) V unnormalized and
# overflows there if the weight spreads over many keys; dQ and dK overflow with dO . V past fp32)
MAGNITUDES = {"1": (1.0, None), "1e3": (1e3, None), "3e4": (3e4, None), "v-max": (1e3, 7e37)}
# The kernels: x3e4 (|S| log2 e ~ 2^32) is past their limit, which FA4 shares (docs/numerics.md, "Large
# magnitudes": both return non-finite O and gradients there); x1e4 is the largest scale both keep finite.
KERNEL_MAGNITUDES = {"1": (1.0, None), "1e3": (1e3, None), "1e4": (1e4, None), "v-max": (1e3, 7e37)}


def _fp32_reference(q, k, v, cu, scale, do):
    ref = reference_attention(q, k, v, cu, cu, scale, dout=do, dtype=torch.float32)
    return {"out": ref["out"], "lse": ref["lse"], "dq": ref["dq"], "dk": ref["dk"], "dv": ref["dv"]}


@pytest.mark.parametrize("mag", list(MAGNITUDES))
def test_emulator_is_finite_where_fp32_attention_is(mag):
    s_qk, s_v = MAGNITUDES[mag]
    q, k, v, do, cu, scale = _magnitude_inputs(MIXED, (4, 2), s_qk, s_v)
    got = attention_fn_for(RECIPE, scale)(q, k, v, cu, do)
    _assert_finite_where(got, _fp32_reference(q, k, v, cu, scale, do), mag)
    _assert_convex(got["out"], v, cu, 4 // 2)


def _assert_convex(out, v, cu, group):
    """Each row of O is a weighted mean of its document's V rows: within their range per channel, up
    to e4m3's rounding and its saturation at 448 * 2^119 (12% below bf16's largest value). The
    accuracy at large |S| is not this test's: there FP8's score error, ~2^-4 |q| |k|, swaps
    near-tied maxima (docs/numerics.md)."""
    c = cu.tolist()
    for s, e in zip(c[:-1], c[1:], strict=True):
        vv = v[s:e].float().repeat_interleave(group, 1)
        lo, hi = vv.amin(0), vv.amax(0)
        slack = 0.15 * vv.abs().amax(0)
        o = out[s:e].float()
        assert ((o >= lo - slack) & (o <= hi + slack)).all(), f"O of document [{s}, {e}) leaves V's range"


def _assert_finite_where(got, ref, what):
    """Every output whose reference is finite (as bf16 where the output is bf16) is finite."""
    for name, r in ref.items():
        r = r.to(got[name].dtype).float() if got[name].dtype == torch.bfloat16 else r.float()
        need = torch.isfinite(r)
        fin = torch.isfinite(got[name].float())
        assert fin[need].all(), f"{what}: {name} has {int((~fin[need]).sum())} non-finite values where the " \
                                f"reference is finite"


# ----------------------------------------------------------------------------- the kernels (GPU)


@pytest.fixture
def default_configs(monkeypatch):
    """The untuned configs: the short pack then runs the paired-tile builds whatever a tuning record says."""
    monkeypatch.setenv("FLAMIA_CUTE_NO_TUNING", "1")
    monkeypatch.delenv("FLAMIA_CUTE_DETERMINISTIC", raising=False)


def _plan(lengths, heads=(4, 2), head_dim=128):
    from flamia_cute.plan import make_plan

    return make_plan(RECIPE, head_dim, *heads, max(lengths), sum(lengths), len(lengths))


def test_the_short_pack_runs_the_paired_builds(default_configs):
    """What the GPU tests cover: the short pack on the paired-tile forward and backward, the mixed one
    on the plain builds (the untuned configs, D 128)."""
    pytest.importorskip("cutlass")
    assert _plan(SHORT).fwd.short_pairs and _plan(SHORT).bwd.short_pairs
    assert not _plan(MIXED).fwd.short_pairs and not _plan(MIXED).bwd.short_pairs


@pytest.mark.gpu
@pytest.mark.parametrize("name, which, value", list(_cases(gpu=True)))
def test_kernels_isolate_nonfinite_inputs(name, which, value, default_configs):
    """The kernel path (fused quantization, forward, backward; the short pack runs the paired-tile
    builds): other documents bitwise (dQ within the fp32 reduce-adds' run-to-run spread), and inside
    the poisoned document also the parts whose tiles never meet the bad value."""
    plan = _plan(CASES[name][0])
    paired = CASES[name][0] is SHORT
    assert plan.fwd.short_pairs == paired and plan.bwd.short_pairs == paired
    bad = _run_case("cute", (4, 2), name, which, value, dq_tol=2e-2, tiles=True, device="cuda", head_dim=128)
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mixed-mid", "mixed-edge", "mixed-1tok"])
@pytest.mark.parametrize("which", POISON_INPUTS)
def test_kernels_isolate_nonfinite_inputs_bitwise_dq(name, which, default_configs, monkeypatch):
    """The deterministic backward (ordered dQ additions): dQ of the other documents bitwise too."""
    monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", "1")
    assert _plan(CASES[name][0]).bwd.deterministic
    bad = _run_case("cute", (4, 2), name, which, "nan", tiles=True, device="cuda", head_dim=128)
    assert not bad, "\n".join(bad)


def _fa4_outputs(q, k, v, cu, scale, do):
    """FA4's outputs on the same inputs (bf16), or None where flash_attn.cute is not installed."""
    from flamia_cute.baselines.torch_impls import fa4_available, fa4_varlen

    if not fa4_available():
        return None
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    max_len = int((cu[1:] - cu[:-1]).max())
    out = fa4_varlen(qq, kk, vv, cu, max_len, scale)
    dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), do)
    return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}


@pytest.mark.gpu
@pytest.mark.parametrize("mag", list(KERNEL_MAGNITUDES))
@pytest.mark.parametrize("lengths", [MIXED, SHORT], ids=["mixed", "short"])
def test_kernels_are_finite_where_fp32_attention_and_fa4_are(mag, lengths, default_configs):
    """The issue's sweep on the kernel path: every output finite where an fp32 attention's is, and
    where FA4's is (when installed); O within 10% of fp32's."""
    s_qk, s_v = KERNEL_MAGNITUDES[mag]
    q, k, v, do, cu, scale = _magnitude_inputs(lengths, (4, 2), s_qk, s_v, device="cuda", head_dim=128)
    got = attention_fn_for(RECIPE, scale, backend="cute")(q, k, v, cu, do)
    ref = _fp32_reference(q, k, v, cu, scale, do)
    _assert_finite_where(got, ref, f"{mag} against fp32")
    fa4 = _fa4_outputs(q, k, v, cu, scale, do)
    if fa4 is not None:
        _assert_finite_where(got, fa4, f"{mag} against FA4")
    if s_qk <= 1e3:  # x1e4 (|S| log2 e ~ 2^28.6): finite, but a row's largest P can underflow e4m3 (numerics.md)
        _assert_convex(got["out"].cpu(), v.cpu(), cu.cpu(), 4 // 2)
    if mag == "1":
        assert rel_l2(got["out"], ref["out"]) < 0.1


# ----------------------------------------------------------------------------- separate key ranges

# cross-length causal: each document's queries are the last Lq of its Lk keys (Lq = 0 for one);
# causal=False: the same ranges with every key visible. (document, query position, key position) to poison:
# a mid-range query and key, a key before the query range, a query on a 128-token block edge.
XLEN_K = [300, 517, 1, 130, 260, 129]
XLEN_Q = [200, 208, 1, 0, 131, 129]
XLEN_CASES = {"mid": (1, 100, 350), "before-range": (0, 5, 20), "block-edge": (4, 128, 128), "one-token": (2, 0, 0)}


def _xlen_problem(device="cpu", head_dim=HEAD_DIM, heads=(4, 2)):
    q_len = [min(a, b) for a, b in zip(XLEN_Q, XLEN_K, strict=True)]
    q, _, _, do, _, scale = make_inputs(q_len, heads[0], heads[1], head_dim, seed=11, device=device)
    _, k, v, _, _, _ = make_inputs(XLEN_K, heads[0], heads[1], head_dim, seed=12, device=device)
    cu_q = cu_seqlens_from_lengths(q_len, device)
    cu_k = cu_seqlens_from_lengths(XLEN_K, device)
    return q, k, v, do, cu_q, cu_k, scale


def _xlen_cases():
    for causal in (True, False):
        for name in XLEN_CASES:
            for which in POISON_INPUTS:
                values = ["nan", "+inf"] if name == "mid" else ["nan"]
                for value in values:
                    yield pytest.param(causal, name, which, value,
                                       id=f"{'cross' if causal else 'noncausal'}-{name}-{which}-{value}")


_XBASE: dict = {}


def _run_xlen(backend, causal, name, which, value, device="cpu", dq_tol=0.0):
    q, k, v, do, cu_q, cu_k, scale = _xlen_problem(device)
    fn = attention_fn_for(RECIPE, scale, causal=causal, backend=backend).varlen
    key = (backend, causal, device)
    if key not in _XBASE:
        _XBASE[key] = fn(q, k, v, cu_q, cu_k, do)
    doc, qpos, kpos = XLEN_CASES[name]
    pos = qpos if which in ("q", "do") else kpos
    return check_nonfinite_isolation_varlen(fn, q, k, v, cu_q, cu_k, do, which, doc, pos, NONFINITE[value], head=1,
                                            base=_XBASE[key], dq_tol=dq_tol)


@pytest.mark.parametrize("causal, name, which, value", list(_xlen_cases()))
def test_emulator_isolates_nonfinite_inputs_with_separate_keys(causal, name, which, value):
    """Cross-length causal and causal=False on the emulator: a non-finite value changes only its own
    document, bitwise, and shows there."""
    assert _run_xlen("emulate", causal, name, which, value) == []


def test_separate_keys_isolation_check_fails_a_leak():
    """The check catches a leak: an attention that adds a tiny share of every document's mean V to
    every output (the shared-scale failure) reports the other documents."""
    q, k, v, do, cu_q, cu_k, scale = _xlen_problem()
    real = attention_fn_for(RECIPE, scale, causal=True).varlen

    def leaky(q, k, v, cu_q, cu_k, dout=None):
        res = real(q, k, v, cu_q, cu_k, dout)
        res["out"] = res["out"] + (v.float().mean() * 1e-3).to(res["out"].dtype)
        return res

    bad = check_nonfinite_isolation_varlen(leaky, q, k, v, cu_q, cu_k, do, "v", 1, 350, float("nan"), head=1)
    assert any("out of another document changed" in b for b in bad), bad


@pytest.mark.parametrize("change", ["nan", "scale"])
def test_separate_keys_isolation_check_fails_a_dq_leak_within_its_tolerance(change):
    """With the 2e-2 dQ bound the GPU test uses for the TMA reduce-adds, the check still reports another
    document's dQ that turns non-finite or moves by more than the bound (here 5%)."""
    q, k, v, do, cu_q, cu_k, scale = _xlen_problem()
    real = attention_fn_for(RECIPE, scale, causal=True).varlen
    poisoned = 1  # the document whose V gets the NaN; document 0's dQ carries the leak
    rows = slice(int(cu_q[0]), int(cu_q[1]))

    def leaky(q, k, v, cu_q, cu_k, dout=None):
        res = real(q, k, v, cu_q, cu_k, dout)
        if not torch.isfinite(q).all() or not torch.isfinite(k).all() or not torch.isfinite(v).all():
            res["dq"] = res["dq"].clone()
            res["dq"][rows] = float("nan") if change == "nan" else res["dq"][rows] * 1.05
        return res

    bad = check_nonfinite_isolation_varlen(leaky, q, k, v, cu_q, cu_k, do, "v", poisoned, 350, float("nan"),
                                           head=1, dq_tol=2e-2)
    assert any("dq of another document changed" in b for b in bad), bad


@pytest.mark.gpu
@pytest.mark.parametrize("causal, name, which, value", list(_xlen_cases()))
def test_kernels_isolate_nonfinite_inputs_with_separate_keys(causal, name, which, value, default_configs):
    """The same on the sm_90a cross-length and non-causal builds (backend="cute"). Their dQ reduce-adds land
    in any order, so other documents' dQ is compared within 2e-2 (the default backward's run-to-run spread, as
    test_kernels_isolate_nonfinite_inputs); bitwise with the deterministic backward (key-block turns)."""
    assert _run_xlen("cute", causal, name, which, value, device="cuda",
                     dq_tol=0.0 if deterministic_backward() else 2e-2) == []


def _xlen_magnitudes(causal, mag, backend, device="cpu"):
    q, k, v, do, cu_q, cu_k, scale = _xlen_problem(device)
    q, k, v, do = ((t.float() * mag).to(torch.bfloat16) for t in (q, k, v, do))
    got = attention_fn_for(RECIPE, scale, causal=causal, backend=backend).varlen(q, k, v, cu_q, cu_k, do)
    ref = reference_attention(q, k, v, cu_q, cu_k, scale, causal=causal, dout=do, dtype=torch.float32)
    _assert_finite_where(got, {n: ref[n] for n in ("out", "lse", "dq", "dk", "dv")}, f"x{mag:g}")


@pytest.mark.parametrize("mag", [1e3, 3e4])
@pytest.mark.parametrize("causal", [True, False], ids=["cross", "noncausal"])
def test_emulator_separate_keys_finite_where_fp32_attention_is(causal, mag):
    _xlen_magnitudes(causal, mag, "emulate")


@pytest.mark.gpu
@pytest.mark.parametrize("mag", [1e3, 1e4])  # x3e4: past the kernels' limit (KERNEL_MAGNITUDES)
@pytest.mark.parametrize("causal", [True, False], ids=["cross", "noncausal"])
def test_kernels_separate_keys_finite_where_fp32_attention_is(causal, mag, default_configs):
    _xlen_magnitudes(causal, mag, "cute", device="cuda")


# ----------------------------------------------------------------------------- one document at 1e35

# One document's Q, K, V or dO times 1e35: finite in bf16 and in fp32 attention. Its neighbours' outputs
# stay bitwise those of the clean run (a product of codes and a scale near the top of fp32's range must not
# meet a zero query factor as inf * 0 in a shared tile), and with V or dO its own outputs are finite wherever
# fp32 attention's are. Q or K at 1e35 puts |S| log2 e near 2^117, past the magnitude limit that FA4 shares
# (docs/numerics.md; FA4's O and gradients are non-finite there too).
HUGE = 1e35
HUGE_CASES = {"mixed-doc2": (MIXED, 2), "pair-second": (SHORT, 1), "pair-first": (SHORT, 2)}


def _check_huge(backend, name, which, device, head_dim=HEAD_DIM, dq_tol=0.0):
    lengths, doc = HUGE_CASES[name]
    q, k, v, do, cu, scale = make_inputs(lengths, 4, 2, head_dim, seed=9, device=device)
    c = cu.tolist()
    s, e = c[doc], c[doc + 1]
    ins = {"q": q, "k": k, "v": v, "do": do}
    big = ins[which].clone()
    big[s:e] = (big[s:e].float() * HUGE).to(big.dtype)
    ins[which] = big
    fn = attention_fn_for(RECIPE, scale, backend=backend)
    base, got = fn(q, k, v, cu, do), fn(ins["q"], ins["k"], ins["v"], cu, ins["do"])
    keep = torch.ones(c[-1], dtype=torch.bool)
    keep[s:e] = False
    rows = keep.nonzero().squeeze(1).to(q.device)
    bad = []
    for out in ("out", "lse", "dq", "dk", "dv"):
        a, b = (got[out][:, rows], base[out][:, rows]) if out == "lse" else (got[out][rows], base[out][rows])
        tol = dq_tol if out == "dq" else 0.0
        same = torch.equal(a, b) if tol == 0 else bool(((a.double() - b.double()).abs()
                                                         <= tol * b.double().abs().clamp_min(1e-6)).all())
        if not same:
            bad.append(f"{out} of the other documents changed ({int((~torch.isfinite(a.float())).sum())} non-finite)")
    if which not in ("q", "k"):
        ref = reference_attention(ins["q"], ins["k"], ins["v"], cu, cu, scale, dout=ins["do"], dtype=torch.float32)
        try:
            _assert_finite_where(got, {n: ref[n] for n in ("out", "lse", "dq", "dk", "dv")}, f"{which} x{HUGE:g}")
        except AssertionError as err:
            bad.append(str(err))
    return bad


@pytest.mark.parametrize("name", list(HUGE_CASES))
@pytest.mark.parametrize("which", POISON_INPUTS)
def test_emulator_one_huge_document(name, which):
    assert _check_huge("emulate", name, which, "cpu") == []


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(HUGE_CASES))
@pytest.mark.parametrize("which", POISON_INPUTS)
def test_kernels_one_huge_document(name, which, default_configs):
    """The kernels (the short pack on the paired-tile builds): the backward forms s * (sq ... * sk) and
    dP * (sdo * sv), so a zero query factor gives 0, not inf * 0 = NaN, in a dQ tile shared with the
    next document or a paired tile. In the reverse order, s * sk and dP * sv reach inf for K and V at 1e35
    (the codes' sums times scales near 2^107, checked in CPU arithmetic on the reference quantizer's
    codes), and inf * 0 = NaN reaches the neighbour's dQ."""
    assert _check_huge("cute", name, which, "cuda", head_dim=128, dq_tol=2e-2) == []
