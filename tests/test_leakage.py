"""Leakage tests on the emulator (the definition of the design note), with failing controls."""

import pytest
import torch

from flamia_cute.testing import LeakageReport, attention_fn_for, check_leakage, make_inputs

LENGTHS = [300, 517, 1, 0, 130]
LEAK_FREE = ["bf16", "fp8_token", "fp8_token_ds_bf16", "fp8_token_ds_e5m2", "fp8_tokenblock", "fp8_tokenblock_dsbf16",
             "fp8_tokenblock_hadamard", "mxfp8", "nvfp4_fp8"]
CONTROLS = ["fp8_tensor_current", "fp8_tokenblock_unsafe", "mxfp8_unsafe", "fp8_tokenblock_dstile_unsafe"]


def test_every_named_recipe_is_tested_here():
    """A new named recipe is either leak-free (and tested below) or a control that fails a test below."""
    from flamia_cute.recipes import NAMED_RECIPES

    assert set(LEAK_FREE) | set(CONTROLS) == set(NAMED_RECIPES)
    assert not set(LEAK_FREE) & set(CONTROLS)


@pytest.fixture(scope="module")
def inputs():
    q, k, v, do, cu, scale = make_inputs(LENGTHS, heads_q=2, heads_kv=1, head_dim=64, seed=3)
    return q, k, v, do, cu, scale


@pytest.mark.parametrize("recipe", LEAK_FREE)
@pytest.mark.parametrize("cut", [None, 128, 129, 255])  # mid-block, on a block edge, just after, block end
def test_leak_free_recipes(recipe, cut, inputs):
    q, k, v, do, cu, scale = inputs
    rep = check_leakage(attention_fn_for(recipe, scale), q, k, v, cu, do, doc=1, cut=cut)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("recipe", ["fp8_tensor_current"])
def test_per_tensor_control_fails_both(recipe, inputs):
    q, k, v, do, cu, scale = inputs
    rep = check_leakage(attention_fn_for(recipe, scale), q, k, v, cu, do)
    assert not rep.future_ok and not rep.isolation_ok, str(rep)


def test_every_control_has_a_failing_test():
    tested = {"fp8_tensor_current", "fp8_tokenblock_dstile_unsafe", *UNSAFE_BLOCK}
    assert tested == set(CONTROLS)


UNSAFE_BLOCK = ["fp8_tokenblock_unsafe", "mxfp8_unsafe"]


@pytest.mark.parametrize("recipe", UNSAFE_BLOCK)
def test_unsafe_block_recipes_fail_future_test(recipe, inputs):
    q, k, v, do, cu, scale = inputs
    rep = check_leakage(attention_fn_for(recipe, scale), q, k, v, cu, do, doc=1, cut=173)
    assert not rep.future_ok, str(rep)


def test_shared_ds_tile_scale_control_leaks_through_dq(inputs):
    """One dS scale per 64-query x 128-key tile for dQ's codes (e4m3_tile): a query's dQ then depends
    on later queries' dS in its tile, so the future test fails on dQ alone (O and LSE are the forward's),
    while the per-row scales of fp8_tokenblock (e4m3_rowtile) pass (test_leak_free_recipes)."""
    q, k, v, do, cu, scale = inputs
    rep = check_leakage(attention_fn_for("fp8_tokenblock_dstile_unsafe", scale), q, k, v, cu, do, doc=1, cut=129)
    assert not rep.future_ok and rep.isolation_ok, str(rep)
    assert rep.details and all(": dq changed" in d for d in rep.details), rep.details


def test_cross_document_amax_control_fails_isolation(inputs):
    """A leaky function whose scale spans documents must fail document isolation."""
    q, k, v, do, cu, scale = inputs
    base = attention_fn_for("fp8_token", scale)

    def leaky(q, k, v, cu, dout=None):
        res = base(q, k, v, cu, dout)
        # output scaled by a statistic over the whole packed batch: the classic cross-document leak
        g = 1.0 + 1e-2 * torch.log1p(k.float().abs().mean())
        res["out"] = (res["out"].float() * g).to(res["out"].dtype)
        return res

    rep = check_leakage(leaky, q, k, v, cu, do)
    assert not rep.isolation_ok, str(rep)


def test_report_prints_verdict():
    rep = LeakageReport(future_ok=False, details=["x"])
    assert "LEAKS" in str(rep) and not rep.ok
