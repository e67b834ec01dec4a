"""Bad input gets a clear error that names the argument."""

import pytest
import torch

from flamia_cute import Recipe, flamia_attn_varlen_func
from flamia_cute.recipes import OperandQuant
from flamia_cute.testing import cu_seqlens_from_lengths, make_inputs


@pytest.fixture
def ok():
    q, k, v, do, cu, scale = make_inputs([5, 7], heads_q=4, heads_kv=2, head_dim=64)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7)


def call(args, **over):
    a = dict(args) | over
    return flamia_attn_varlen_func(**a)


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(q="x"), TypeError, "q must be a torch.Tensor"),
        (dict(q=torch.zeros(12, 4, 64)), TypeError, "q must be bfloat16"),
        (dict(k=torch.zeros(12, 64, dtype=torch.bfloat16)), ValueError, "k must have shape"),
        (dict(q=torch.zeros(12, 4, 96, dtype=torch.bfloat16)), ValueError, "head_dim 96"),
        (dict(k=torch.zeros(12, 3, 64, dtype=torch.bfloat16), v=torch.zeros(12, 3, 64, dtype=torch.bfloat16)),
         ValueError, "multiple of k/v heads"),
        (dict(v=torch.zeros(12, 1, 64, dtype=torch.bfloat16)), ValueError, "k and v must have the same"),
        (dict(cu_seqlens_q=torch.tensor([0, 5, 12])), TypeError, "cu_seqlens_q must be int32"),
        (dict(cu_seqlens_k=torch.tensor([1, 5, 12], dtype=torch.int32)), ValueError, "cu_seqlens_k must start at 0"),
        (dict(cu_seqlens_q=torch.tensor([0, 13, 12], dtype=torch.int32)), ValueError, "cu_seqlens_q must be non-decreasing"),
        (dict(cu_seqlens_q=torch.tensor([0, 5, 11], dtype=torch.int32)), ValueError, "must end at the token count 12"),
        (dict(cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32)), ValueError, "same number of documents"),
        (dict(max_seqlen_q=3), ValueError, "max_seqlen_q"),
        (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k"),
        (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
        (dict(recipe="fp9"), ValueError, "recipe: unknown name 'fp9'"),
        (dict(recipe=3), TypeError, "recipe must be"),
        (dict(backend="tpu"), ValueError, "backend must be"),
        (dict(backend="cute"), NotImplementedError, "backend='cute'"),
    ],
)
def test_errors_name_the_argument(ok, over, exc, match):
    with pytest.raises(exc, match=match):
        call(ok, **over)


def test_empty_documents_are_allowed():
    q, k, v, do, cu, scale = make_inputs([0, 5, 0, 7, 0], heads_q=2, heads_kv=2, head_dim=64)
    out = flamia_attn_varlen_func(q, k, v, cu, cu, 7, 7)
    assert out.shape == q.shape and torch.isfinite(out.float()).all()


def test_all_documents_empty():
    q = torch.zeros(0, 2, 64, dtype=torch.bfloat16)
    cu = cu_seqlens_from_lengths([0, 0])
    out = flamia_attn_varlen_func(q, q, q, cu, cu, 0, 0)
    assert out.shape == (0, 2, 64)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(fmt="fp6"), "OperandQuant.fmt"),
        (dict(scaling="row"), "OperandQuant.scaling"),
        (dict(scaling="tokenblock", block_tokens=1), "needs block_tokens > 1"),
        (dict(fmt="bf16", scaling="token"), "bf16"),
    ],
)
def test_operand_quant_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OperandQuant(**kwargs)


def test_recipe_validation():
    with pytest.raises(ValueError, match="query-side"):
        Recipe("x", q=OperandQuant("e4m3", "tokenblock", 64))
    with pytest.raises(ValueError, match="p_cast"):
        Recipe("x", p_cast="fp16")
    with pytest.raises(ValueError, match="key_tile"):
        Recipe("x", key_tile=100)
    with pytest.raises(ValueError, match="p_scale"):
        Recipe("x", p_scale=512.0)
    with pytest.raises(ValueError, match="dv_fold"):
        Recipe("x", dv_fold="row")
    with pytest.raises(ValueError, match="dv_fold"):
        Recipe("x", p_cast="bf16", dv_fold="document")
    assert Recipe.from_name("fp8_tokenblock").k.block_tokens == 128


def test_numpy_scalars_are_plain_numbers():
    """max_seqlen as numpy integers and softmax_scale as a numpy float (np.float32 is not a float subclass)
    give what the plain Python numbers give."""
    import numpy as np

    cu = torch.tensor([0, 30], dtype=torch.int32)
    q = torch.randn(30, 2, 64, dtype=torch.bfloat16)
    got = flamia_attn_varlen_func(q, q, q, cu, cu, np.int64(30), np.int32(30), softmax_scale=np.float32(0.125))
    assert torch.equal(got, flamia_attn_varlen_func(q, q, q, cu, cu, 30, 30, softmax_scale=0.125))


@pytest.mark.parametrize("field, value, match", [
    ("p_scale", float("nan"), "Recipe.p_scale"), ("diagonal_safeguard", "no", "Recipe.diagonal_safeguard"),
    ("key_tile", 2.5, "Recipe.key_tile"), ("query_tile", True, "Recipe.query_tile"),
])
def test_custom_recipe_fields_are_checked(field, value, match):
    from flamia_cute.recipes import NAMED_RECIPES

    with pytest.raises(ValueError, match=match):
        NAMED_RECIPES["fp8_tokenblock_dsbf16"].with_(**{field: value})


def test_operand_block_tokens_must_be_an_int():
    with pytest.raises(ValueError, match="OperandQuant.block_tokens"):
        OperandQuant("e4m3", "tokenblock", 1.5)


@pytest.mark.parametrize("cu, world, rank, match", [([0, 0], 2, 0, "no tokens"), ([0, 5], 2, True, "rank"),
                                                    ([0, 5], True, 0, "world_size")])
def test_shard_plan_refusals(cu, world, rank, match):
    from flamia_cute.distributed import shard_packed_batch

    with pytest.raises(ValueError, match=match):
        shard_packed_batch(torch.tensor(cu), world, rank)
