"""Accuracy of every recipe against fp64 on the issue's two input sets (SQNR floors)."""

import pytest
import torch

from flamia_cute.reference import reference_attention
from flamia_cute.testing import attention_fn_for, make_inputs, sqnr_db

DOC_MIXES = {
    "one_doc": [1024],
    "mixed": [517, 300, 1, 0, 130, 64],
    "short": [64] * 6 + [33, 1, 7],
}
OPERANDS = ("out", "dq", "dk", "dv")
NORMAL_FLOORS = {"out": 26.0, "dq": 23.0, "dk": 23.0, "dv": 23.0}

_cache = {}


def measure(recipe, kind, mix, heads_kv=2):
    key = (recipe, kind, mix, heads_kv)
    if key not in _cache:
        q, k, v, do, cu, scale = make_inputs(DOC_MIXES[mix], heads_q=4, heads_kv=heads_kv, kind=kind, seed=7)
        ref = reference_attention(q, k, v, cu, cu, scale, True, do)
        got = attention_fn_for(recipe, scale)(q, k, v, cu, do)
        _cache[key] = {n: sqnr_db(got[n], ref[n]) for n in OPERANDS} | {
            "lse_max_abs": float((got["lse"] - ref["lse"]).abs().max())
        }
    return _cache[key]


@pytest.mark.parametrize("mix", list(DOC_MIXES))
@pytest.mark.parametrize("recipe", ["fp8_tokenblock", "fp8_token", "fp8_tokenblock_dsbf16", "fp8_tokenblock_hadamard"])
def test_normal_floors(recipe, mix):
    got = measure(recipe, "normal", mix)
    for name, floor in NORMAL_FLOORS.items():
        assert got[name] >= floor, f"{recipe} {mix}: {name} SQNR {got[name]:.1f} dB < {floor} dB"


@pytest.mark.parametrize("mix", ["mixed"])
def test_gqa_normal_floors(mix):
    got = measure("fp8_tokenblock", "normal", mix, heads_kv=1)
    for name, floor in NORMAL_FLOORS.items():
        assert got[name] >= floor, f"GQA {mix}: {name} SQNR {got[name]:.1f} dB < {floor} dB"


def test_bf16_recipe_is_near_exact():
    got = measure("bf16", "normal", "mixed")
    assert min(got[n] for n in OPERANDS) >= 40.0, got


@pytest.mark.xfail(
    strict=True,
    reason="Unmet floor, investigated: with power-of-two scales e4m3 is a floating-point format, so a per-tensor "
    "scale costs precision only through underflow; on 'outliers' the error of O comes from per-element e4m3 "
    "rounding of the x20 channels of Q and K (identical under per-token and per-tensor scales). See docs/numerics.md.",
)
@pytest.mark.parametrize("recipe", ["fp8_tokenblock", "fp8_token"])
def test_outlier_floors_beat_per_tensor_by_5db(recipe):
    ours = measure(recipe, "outliers", "mixed")
    control = measure("fp8_tensor_current", "outliers", "mixed")
    for name in OPERANDS:
        assert ours[name] >= control[name] + 5.0, f"{recipe}: {name} {ours[name]:.1f} vs control {control[name]:.1f}"


def test_hadamard_recipe_beats_per_tensor_by_5db_on_outliers():
    """The floor the token-scaled recipes miss (above): the Walsh-Hadamard transform of Q and K spreads
    the x20 channels before the e4m3 rounding (docs/rotations.md)."""
    ours = measure("fp8_tokenblock_hadamard", "outliers", "mixed")
    control = measure("fp8_tensor_current", "outliers", "mixed")
    for name in OPERANDS:
        assert ours[name] >= control[name] + 5.0, f"{name} {ours[name]:.1f} vs control {control[name]:.1f}"


def test_outlier_recipes_not_worse_than_per_tensor():
    control = measure("fp8_tensor_current", "outliers", "mixed")
    for recipe in ("fp8_tokenblock", "fp8_token"):
        ours = measure(recipe, "outliers", "mixed")
        for name in OPERANDS:
            assert ours[name] >= control[name] - 0.5, (recipe, name, ours[name], control[name])


@pytest.mark.parametrize("recipe", ["fp8_tokenblock", "fp8_token", "fp8_tokenblock_dsbf16"])
def test_zero_rows_do_not_dominate_scale_folds(recipe):
    """The last token of every document has an all-zero dO row in training; it must not wreck dV."""
    q, k, v, do, cu, scale = make_inputs(DOC_MIXES["mixed"], heads_q=4, heads_kv=2, seed=11)
    ends = (cu[1:] - 1)[cu[1:] > cu[:-1]].long()
    do = do * 1e-4  # training-sized gradients: far below a zero row's old scale of 1
    do[ends] = 0
    ref = reference_attention(q, k, v, cu, cu, scale, True, do)
    got = attention_fn_for(recipe, scale)(q, k, v, cu, do)
    for name in OPERANDS:
        assert sqnr_db(got[name], ref[name]) >= NORMAL_FLOORS[name], name


@pytest.mark.parametrize("mix", ["one_doc", "mixed"])
def test_planned_backward_recipe_is_not_less_accurate(mix):
    """fp8_tokenblock_dsbf16 (dV folded per document, dS in bf16: the default) against fp8_tokenblock
    (e4m3 dS): dQ and dK better, dV and O within 0.2 dB."""
    new, old = measure("fp8_tokenblock_dsbf16", "normal", mix), measure("fp8_tokenblock", "normal", mix)
    assert new["dq"] > old["dq"] + 0.3 and new["dk"] > old["dk"] + 0.3, (new, old)
    assert new["dv"] >= old["dv"] - 0.2 and new["out"] >= old["out"] - 0.2, (new, old)


def test_dv_fold_document_uses_one_reference_per_document():
    """dv_fold "document": the fold reference of every key's dV is the largest dO scale of its
    document and KV group, so a large dO on the first query changes how later keys' P is cast (and
    with dv_fold "tile" it does not reach keys past the first query tile); other documents never."""
    from flamia_cute import NAMED_RECIPES

    q, k, v, do, cu, scale = make_inputs([600, 300], heads_q=2, heads_kv=1, seed=5)
    big = do.clone()
    big[0] = big[0] * 2.0**12
    doc_fn = attention_fn_for("fp8_tokenblock_dsbf16", scale)
    tile_fn = attention_fn_for(NAMED_RECIPES["fp8_tokenblock_dsbf16"].with_(name="tile", dv_fold="tile"), scale)
    d0, d1 = doc_fn(q, k, v, cu, do)["dv"], doc_fn(q, k, v, cu, big)["dv"]
    t0, t1 = tile_fn(q, k, v, cu, do)["dv"], tile_fn(q, k, v, cu, big)["dv"]
    assert not torch.equal(d0[300:600], d1[300:600])  # keys 300-599 never see query 0: only the reference
    assert torch.equal(t0[300:600], t1[300:600])
    assert torch.equal(d0[600:], d1[600:]) and torch.equal(t0[600:], t1[600:])  # the other document


@pytest.mark.parametrize("kind", ["normal", "outliers"])
def test_default_delta_is_consistent_with_dp(kind):
    """A query that sees one key has P = 1 and exact dQ = 0 (and that key's dK = 0 from it). dS = P (dP - D)
    is 0 only when D = rowsum(dO * O) uses the dO that dP reads: the default takes D from dO's e4m3 values.
    With D from the bf16 dO (delta="input") these rows get dO's rounding error times K (or Q)."""
    from flamia_cute.recipes import NAMED_RECIPES

    rec = NAMED_RECIPES["fp8_tokenblock_dsbf16"]
    lengths = [1, 40, 1, 1, 97, 1, 25]
    q, k, v, do, cu, scale = make_inputs(lengths, 4, 2, 128, kind, 11)
    firsts = cu[:-1].long()  # each document's first query sees only its first key
    singles = torch.tensor([s for s, n in zip(cu[:-1].tolist(), lengths, strict=True) if n == 1])  # a 1-token document's key
    def rms(x):
        return float(x.double().pow(2).mean().sqrt())

    typical = {}
    for r in (rec, rec.with_(delta="input")):
        got = attention_fn_for(r, scale)(q, k, v, cu, do)
        typical[r.delta] = (rms(got["dq"][firsts]) / rms(got["dq"]), rms(got["dk"][singles]) / rms(got["dk"]))
    assert max(typical["quantized"]) < 1e-6, typical
    assert min(typical["input"]) > 1e-3, typical  # the control: D from the bf16 dO leaves them non-zero
    ref = reference_attention(q, k, v, cu, cu, scale, True, do)
    assert float(ref["dq"][firsts].abs().max()) < 1e-12
