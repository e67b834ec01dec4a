"""Property tests over document mixes: outputs and gradients finite, GQA and length-1 documents."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flamia_cute.testing import attention_fn_for, make_inputs


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 2000), min_size=1, max_size=4).filter(lambda ls: 0 < sum(ls) <= 2600),
    recipe=st.sampled_from(["fp8_tokenblock", "fp8_token", "mxfp8", "nvfp4_fp8", "fp8_tensor_current"]),
    gqa=st.booleans(),
)
def test_outputs_finite(lengths, recipe, gqa):
    q, k, v, do, cu, scale = make_inputs(lengths, heads_q=2, heads_kv=1 if gqa else 2, head_dim=64, seed=len(lengths))
    res = attention_fn_for(recipe, scale)(q, k, v, cu, do)
    for name in ("out", "dq", "dk", "dv"):
        assert torch.isfinite(res[name].float()).all(), name
    assert torch.isfinite(res["lse"]).all()  # every query sees at least itself


def test_length_one_documents_copy_v():
    q, k, v, do, cu, scale = make_inputs([1, 1, 1], heads_q=2, heads_kv=2, head_dim=64)
    res = attention_fn_for("bf16", scale)(q, k, v, cu, do)
    assert torch.equal(res["out"], v)  # a query that sees only itself returns its own value
    # softmax over one key has zero gradient (up to the summation order of dP and D)
    assert res["dq"].float().abs().max() < 1e-4
