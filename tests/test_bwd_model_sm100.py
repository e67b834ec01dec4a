"""The planned sm_100a MXFP8 backward's CPU tile model (sm100/backward_model.py) against the emulator's
mxfp8 backward, the leakage definition, and its mutants."""

from __future__ import annotations

import pytest
import torch

from flamia_cute.cute_backend import _dsl_importable
from flamia_cute.emulator import emulate_backward, emulate_forward
from flamia_cute.recipes import Recipe
from flamia_cute.testing import check_leakage, make_inputs, rel_l2

# only the DSL's absence skips these tests: an error in a project module fails its import
HAVE_DSL = _dsl_importable()
if HAVE_DSL:
    from flamia_cute.quant.mx_layout import pack_mx_forward_operands
    from flamia_cute.sm100.attention_fwd import reference_fwd_sm100
    from flamia_cute.sm100.backward_model import reference_bwd_sm100, reference_training_fn

pytestmark = pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl not importable")
MXFP8 = Recipe.from_name("mxfp8")
LENGTHS = [517, 300, 1, 0, 130, 64]
# Forward and backward models against emulate_forward + emulate_backward (each from its own O and LSE),
# LENGTHS, H=4, Hk in (2, 1), seeds 0-3, rel L2. Measured: dQ <= 4.1e-4, dK <= 3.8e-4.
# dV on normal inputs <= 8e-5 off each document's first key; its first key (query 0's P = 1 exactly)
# and, on outlier inputs, keys whose P^T block max lies near 1 flip between 1 and 1 - ulp, which the
# MX cast maps to 1 and to 0.875 (scale 2^-9, e4m3 saturates at 448): dV <= 1.3e-2 there.
BWD_MODEL_REL_L2 = 1.5e-3
BWD_MODEL_DV_REL_L2 = 4e-2


def _grads(kind, Hk, seed, bug=None):
    q, k, v, do, cu, scale = make_inputs(LENGTHS, 4, Hk, 128, kind=kind, seed=seed)
    ops = pack_mx_forward_operands(q, k, v, cu)
    out, lse = reference_fwd_sm100(ops, cu, scale)
    model = reference_bwd_sm100(ops, q, do, out, lse, cu, scale, bug=bug)
    _, _, ctx = emulate_forward(q, k, v, cu, cu, scale, True, MXFP8)
    return model, emulate_backward(do, ctx), cu


@pytest.mark.parametrize("Hk", [2, 1])
@pytest.mark.parametrize("kind", ["normal", "outliers"])
def test_bwd_model_matches_emulator(kind, Hk):
    (dq, dk, dv), (dqe, dke, dve), cu = _grads(kind, Hk, seed=1)
    assert rel_l2(dq.float(), dqe.float()) < BWD_MODEL_REL_L2
    assert rel_l2(dk.float(), dke.float()) < BWD_MODEL_REL_L2
    assert rel_l2(dv.float(), dve.float()) < BWD_MODEL_DV_REL_L2
    if kind == "normal":
        rest = torch.ones(dv.shape[0], dtype=torch.bool)
        rest[cu[:-1].long().clamp_max(dv.shape[0] - 1)] = False  # each document's first key
        assert rel_l2(dv[rest].float(), dve[rest].float()) < BWD_MODEL_REL_L2


def test_bwd_model_mutants_fail():
    (dq, dk, _), (dqe, dke, _), _ = _grads("normal", 2, seed=1, bug="no_own_block_bf16")
    assert rel_l2(dq.float(), dqe.float()) > 10 * BWD_MODEL_REL_L2  # measured 4.8e-2
    assert rel_l2(dk.float(), dke.float()) > 10 * BWD_MODEL_REL_L2  # measured 4.9e-2
    with pytest.raises(ValueError, match="bug must be one of"):
        _grads("normal", 2, seed=1, bug="typo")


@pytest.mark.parametrize("Hk", [2, 1])
def test_bwd_model_does_not_leak_and_the_mutant_does(Hk):
    q, k, v, do, cu, scale = make_inputs(LENGTHS, 4, Hk, 128, seed=2)
    rep = check_leakage(reference_training_fn(scale), q, k, v, cu, do)
    assert rep.ok, str(rep)
    leaky = check_leakage(reference_training_fn(scale, bug="ds_scale_per_query_tile"), q, k, v, cu, do)
    assert not leaky.future_ok and leaky.isolation_ok, str(leaky)
