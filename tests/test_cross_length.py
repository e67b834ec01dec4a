"""Queries that are a sub-range of their document's keys (cu_seqlens_q != cu_seqlens_k, causal aligned to the
end of each query range) and causal=False, forward and backward, on the emulator: against fp64, against
self-attention on the whole document, and the leakage checks in both modes with failing controls."""

import pytest
import torch

from flamia_cute import flamia_attn_varlen_func
from flamia_cute.reference import reference_attention
from flamia_cute.testing import (
    attention_fn_for,
    check_leakage_varlen,
    cu_seqlens_from_lengths,
    make_inputs,
    sqnr_db,
)

DOCS = [300, 517, 1, 0, 130, 260]
# each document's query range [a, b): its keys are the document's first b tokens (the prefix up to the range's end)
RANGES = [(100, 300), (203, 411), (0, 1), (0, 0), (0, 130), (129, 257)]
FLOORS = {"out": 26.0, "dq": 23.0, "dk": 23.0, "dv": 23.0}
# mxfp8's dQ and dK sit at 23.0-24.1 dB on these head-dim-64 inputs in self-attention too
MX_GRAD_FLOOR = 22.0


def floor_of(recipe, name):
    return MX_GRAD_FLOOR if recipe == "mxfp8" and name != "out" else FLOORS[name]


def sub_range_problem(seed=5, heads=(4, 2), head_dim=64):
    """Self-attention inputs over DOCS and the cross-length call's rows: (full inputs, q rows, k rows, cu_q, cu_k)."""
    q, k, v, do, cu, scale = make_inputs(DOCS, heads_q=heads[0], heads_kv=heads[1], head_dim=head_dim, seed=seed)
    starts = cu.tolist()
    q_rows, k_rows = [], []
    for s, (a, b) in zip(starts, RANGES, strict=False):
        q_rows += range(s + a, s + b)
        k_rows += range(s, s + b)
    cu_q = cu_seqlens_from_lengths([b - a for a, b in RANGES])
    cu_k = cu_seqlens_from_lengths([b for _, b in RANGES])
    return (q, k, v, do, cu, scale), torch.tensor(q_rows), torch.tensor(k_rows), cu_q, cu_k


@pytest.fixture(scope="module")
def problem():
    return sub_range_problem()


def _run(recipe, q, k, v, cu_q, cu_k, scale, do, causal=True):
    return attention_fn_for(recipe, scale, causal=causal).varlen(q, k, v, cu_q, cu_k, do)


@pytest.mark.parametrize("recipe", ["fp8_tokenblock_dsbf16", "fp8_tokenblock", "mxfp8"])
def test_cross_length_causal_against_fp64(recipe, problem):
    (q, k, v, do, _, scale), qr, kr, cu_q, cu_k = problem
    args = (q[qr], k[kr], v[kr], cu_q, cu_k, scale)
    got = _run(recipe, *args, do[qr])
    ref = reference_attention(*args, causal=True, dout=do[qr])
    for name in FLOORS:
        db = sqnr_db(got[name], ref[name])
        assert db >= floor_of(recipe, name), f"{recipe}: {name} {db:.1f} dB"
    finite = torch.isfinite(ref["lse"])
    assert torch.equal(finite, torch.isfinite(got["lse"]))
    assert sqnr_db(got["lse"][finite], ref["lse"][finite]) >= 45.0


def test_sub_range_equals_self_attention_on_the_whole_document(problem):
    """The default recipe's numbers do not depend on where a query range starts: K and V blocks are counted from
    the document's first key (not from the query range), the diagonal safeguard sits at each query's own key
    position, and dS has no shared scale. So a sub-range with its key prefix gives self-attention's O, LSE and
    dQ on those rows, and with dO zero on the other queries its dK and dV: what context parallelism relies on."""
    (q, k, v, do, cu, scale), qr, kr, cu_q, cu_k = problem
    recipe = "fp8_tokenblock_dsbf16"
    do_sub = torch.zeros_like(do)
    do_sub[qr] = do[qr]
    whole = _run(recipe, q, k, v, cu, cu, scale, do_sub)
    part = _run(recipe, q[qr], k[kr], v[kr], cu_q, cu_k, scale, do[qr])
    assert torch.equal(part["out"], whole["out"][qr]) and torch.equal(part["lse"], whole["lse"][:, qr])
    assert torch.equal(part["dq"], whole["dq"][qr]) and torch.equal(part["dv"], whole["dv"][kr])
    # dK sums fewer queries' terms in fp32 (the zero dO rows add exact zeros, in other matmul blocks): equal up
    # to the sum's rounding, which can move the bf16 result by one unit
    torch.testing.assert_close(part["dk"].float(), whole["dk"][kr].float(), rtol=2**-7, atol=2e-7)
    assert (part["dk"] != whole["dk"][kr]).sum() <= part["dk"].numel() // 10000


def test_key_blocks_counted_from_the_query_range_would_differ(problem, monkeypatch):
    """Control of the test above: K/V blocks that restart at each query range (a rank's chunk start) change O."""
    import flamia_cute.emulator as emu

    (q, k, v, do, cu, scale), qr, kr, cu_q, cu_k = problem
    recipe = "fp8_tokenblock_dsbf16"
    k = k.clone()
    k[int(cu[1]) + RANGES[1][0] - 1] *= 256  # a large key just before doc 1's range, in the block the range starts in
    whole = _run(recipe, q, k, v, cu, cu, scale, None)
    assert torch.equal(_run(recipe, q[qr], k[kr], v[kr], cu_q, cu_k, scale, None)["lse"], whole["lse"][:, qr])
    quantize = emu.quantize_operand

    def blocks_from_range(x, cu_, op, key_side, recipe_, s_path_nvfp4=False):
        if key_side:  # K and V: blocks restart at each query range's start too (the leaky way to shard a document)
            starts = cu_.tolist()
            cuts = sorted({*starts, *(s + a for s, (a, b) in zip(starts, RANGES, strict=False) if 0 < a < b)})
            cu_ = torch.tensor(cuts, dtype=torch.int32)
        return quantize(x, cu_, op, key_side, recipe_, s_path_nvfp4)

    monkeypatch.setattr(emu, "quantize_operand", blocks_from_range)
    part = _run(recipe, q[qr], k[kr], v[kr], cu_q, cu_k, scale, None)
    assert not (torch.equal(part["out"], whole["out"][qr]) and torch.equal(part["lse"], whole["lse"][:, qr]))


@pytest.mark.parametrize("recipe", ["fp8_tokenblock_dsbf16", "fp8_tokenblock", "mxfp8"])
def test_non_causal_against_fp64(recipe):
    # cross-attention shapes: every document has its own query and key lengths, some empty
    lq, lk = [50, 200, 0, 7, 129], [300, 17, 40, 0, 129]
    g = torch.Generator().manual_seed(11)
    q = torch.randn(sum(lq), 4, 64, generator=g).bfloat16()
    k, v = (torch.randn(sum(lk), 2, 64, generator=g).bfloat16() for _ in range(2))
    do = torch.randn(sum(lq), 4, 64, generator=g).bfloat16()
    cu_q, cu_k = cu_seqlens_from_lengths(lq), cu_seqlens_from_lengths(lk)
    got = _run(recipe, q, k, v, cu_q, cu_k, 0.125, do, causal=False)
    ref = reference_attention(q, k, v, cu_q, cu_k, 0.125, causal=False, dout=do)
    for name in FLOORS:
        db = sqnr_db(got[name], ref[name])
        assert db >= floor_of(recipe, name), f"{recipe}: {name} {db:.1f} dB"
    empty = slice(250, 257)  # the 7 queries of the key-less document: O = 0, LSE = -inf, dQ = 0
    assert not got["out"][empty].any() and torch.isinf(got["lse"][:, empty]).all() and not got["dq"][empty].any()


# (doc, cut) in key positions, each past its document's first query (RANGES: doc 0's queries start at key 100,
# doc 1's at 203, doc 5's at 129): cuts mid-block (301, 200) and one past a block edge (129). The unsafe controls
# fail the future test at each, so each case can see a leak
LEAK_CASES = [(1, 301), (0, 129), (5, 200), (0, 200)]


@pytest.mark.parametrize("recipe", ["fp8_tokenblock_dsbf16", "fp8_tokenblock", "mxfp8"])
@pytest.mark.parametrize("doc,cut", LEAK_CASES)
def test_cross_length_leakage(recipe, doc, cut, problem):
    (q, k, v, do, _, scale), qr, kr, cu_q, cu_k = problem
    fn = attention_fn_for(recipe, scale).varlen
    rep = check_leakage_varlen(fn, q[qr], k[kr], v[kr], cu_q, cu_k, do[qr], doc=doc, cut=cut)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("recipe", ["fp8_tokenblock_unsafe", "mxfp8_unsafe"])
@pytest.mark.parametrize("doc,cut", LEAK_CASES)
def test_cross_length_unsafe_controls_fail_the_future_test(recipe, doc, cut, problem):
    (q, k, v, do, _, scale), qr, kr, cu_q, cu_k = problem
    rep = check_leakage_varlen(attention_fn_for(recipe, scale).varlen, q[qr], k[kr], v[kr], cu_q, cu_k, do[qr],
                               doc=doc, cut=cut)
    assert not rep.future_ok, str(rep)


def test_a_cut_before_the_first_query_is_refused(problem):
    """Doc 1's queries start at key 203: a cut before it would compare no query, and pass any fn."""
    (q, k, v, do, _, scale), qr, kr, cu_q, cu_k = problem
    with pytest.raises(ValueError, match="no query lies before it"):
        check_leakage_varlen(attention_fn_for("fp8_tokenblock_unsafe", scale).varlen, q[qr], k[kr], v[kr], cu_q,
                             cu_k, do[qr], doc=1, cut=137)


@pytest.mark.parametrize("causal", [True, False])
def test_per_tensor_control_fails_isolation(causal, problem):
    (q, k, v, do, _, scale), qr, kr, cu_q, cu_k = problem
    fn = attention_fn_for("fp8_tensor_current", scale, causal=causal).varlen
    rep = check_leakage_varlen(fn, q[qr], k[kr], v[kr], cu_q, cu_k, do[qr], doc=1, cut=301, causal=causal)
    assert not rep.isolation_ok, str(rep)


@pytest.mark.parametrize("recipe", ["fp8_tokenblock_dsbf16", "fp8_tokenblock", "mxfp8"])
def test_non_causal_isolation(recipe, problem):
    (q, k, v, do, _, scale), qr, kr, cu_q, cu_k = problem
    fn = attention_fn_for(recipe, scale, causal=False).varlen
    for doc in (1, 5):
        rep = check_leakage_varlen(fn, q[qr], k[kr], v[kr], cu_q, cu_k, do[qr], doc=doc, causal=False)
        assert rep.ok, str(rep)


def test_cpu_runs_the_new_modes_silently_and_the_kernels_take_them(problem):
    import warnings

    from flamia_cute.plan import why_not_kernels
    from flamia_cute.recipes import NAMED_RECIPES

    (q, k, v, _, _, scale), qr, kr, cu_q, cu_k = problem
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flamia_attn_varlen_func(q[qr], k[kr], v[kr], cu_q, cu_k, 208, 411)
        flamia_attn_varlen_func(q, k, v, cu_q.new_tensor([0, q.shape[0]]), cu_q.new_tensor([0, k.shape[0]]),
                                q.shape[0], k.shape[0], causal=False)
    rec = NAMED_RECIPES["fp8_tokenblock_dsbf16"]
    # the sm_90a forward runs both modes (FwdConfig.cross_length, causal=False); mxfp8 names its recipe
    assert why_not_kernels(rec, True, q[qr], k[kr], cu_q, cu_k) is None
    assert why_not_kernels(rec, False, q, k, cu_k, cu_k) is None
    assert why_not_kernels(rec, True, q, k, cu_k, cu_k.clone()) is None
    assert "mxfp8" in why_not_kernels(NAMED_RECIPES["mxfp8"], True, q[qr], k[kr], cu_q, cu_k)
