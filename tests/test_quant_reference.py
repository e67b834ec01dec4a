"""The quantization reference: power-of-two scale rule, document-local blocks, edge cases."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flamia_cute.quant import (
    DT_DOC_ALIGN,
    E4M3,
    E5M2,
    TOKEN_PAD,
    dt_cu_seqlens,
    natural_dt,
    pow2_scale,
    quantize_per_tensor,
    quantize_thd,
    quantize_thd_per_tensor,
    token_block_ids,
    transposed_tokens,
)
from flamia_cute.quant.quantize import transpose_tokens
from flamia_cute.testing import cu_seqlens_from_lengths


def test_pow2_scale_is_smallest_power_of_two_that_fits():
    amax = torch.tensor([448.0, 448.0001, 1.0, 1.75, 1.76, 3.0e5, 2.0**-110])
    s = pow2_scale(amax, E4M3)
    assert torch.all(amax / s <= 448.0)
    assert torch.all(amax / (s / 2) > 448.0)  # half the scale would overflow
    assert torch.all(torch.log2(s) == torch.round(torch.log2(s)))


def test_pow2_scale_edge_cases():
    s = pow2_scale(torch.tensor([0.0, float("inf"), float("nan"), 1e-40]), E4M3)
    assert s[0] == 2.0**-126  # all-zero block: finite, nonzero, the smallest scale
    assert math.isnan(s[1]) and math.isnan(s[2])  # non-finite poisons its block only
    assert s[3] == 2.0**-126  # subnormal amax: clamped, finite
    assert pow2_scale(torch.tensor([57344.0]), E5M2)[0] == 1.0


def test_blocks_are_document_local():
    cu = cu_seqlens_from_lengths([3, 0, 5, 1])
    ids = token_block_ids(cu, 9, 4)
    # doc0: [0,1,2] block 0; doc2: [3..6] block 1, [7] block 2; doc3: [8] block 3
    assert ids.tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 3]


def test_transposed_copy_matches_and_pads_with_zero():
    x = torch.randn(136, 3, 64).bfloat16()
    lengths = [100, 0, 1, 35]
    cu = cu_seqlens_from_lengths(lengths)
    qt = quantize_thd(x, cu, 128)
    starts = dt_cu_seqlens(cu).tolist()
    ends = [0]
    for n in lengths:  # every document starts DT_DOC_ALIGN-aligned, right after the previous one's pad
        ends.append(ends[-1] + -(-n // DT_DOC_ALIGN) * DT_DOC_ALIGN)
    assert starts == ends and (DT_DOC_ALIGN != 16 or starts == [0, 112, 112, 128, 176])
    assert qt.data_dt.shape == (3, 64, transposed_tokens(136, 4)) and qt.data_dt.shape[2] % TOKEN_PAD == 0
    dt = qt.data_dt.view(torch.uint8)
    written = torch.zeros(dt.shape[2], dtype=torch.bool)
    for b, n in enumerate(lengths):
        s, c = int(cu[b]), starts[b]
        assert torch.equal(dt[:, :, c : c + n], qt.data_td[s : s + n].permute(1, 2, 0).view(torch.uint8))
        written[c : c + n] = True
    assert not dt[:, :, ~written].any()  # pad columns are zero


def test_zero_block_and_nan_block():
    x = torch.randn(20, 1, 64).bfloat16()
    x[0:8] = 0
    x[12, 0, 5] = float("nan")
    qt = quantize_thd(x, cu_seqlens_from_lengths([8, 12]), 4)
    assert torch.all(qt.scale[0, :8] == 2.0**-126) and not qt.data_td[:8].float().any()
    nan_scale = torch.isnan(qt.scale[0])
    assert nan_scale.tolist() == [False] * 8 + [False] * 4 + [True] * 4 + [False] * 4  # only block [12, 16)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 2000), min_size=1, max_size=5).filter(lambda ls: sum(ls) > 0),
    block=st.sampled_from([1, 64, 128]),
    magnitude=st.sampled_from([1e-30, 1e-3, 1.0, 1e4, 1e30]),
)
def test_roundtrip_within_format_bounds(lengths, block, magnitude):
    T = sum(lengths)
    x = (torch.randn(T, 2, 64) * magnitude).bfloat16()
    qt = quantize_thd(x, cu_seqlens_from_lengths(lengths), block, transposed=False)
    assert torch.isfinite(qt.scale).all() and (qt.scale > 0).all()
    xf = x.float()
    deq = qt.dequantize()
    assert torch.isfinite(deq).all()
    # e4m3 relative rounding error <= 2**-4 for normals; absolute floor = half the smallest subnormal step
    step = qt.scale.t().unsqueeze(-1) * 2.0**-10
    assert torch.all((deq - xf).abs() <= xf.abs() * 2.0**-4 + step)
    assert torch.all(qt.data_td.float().abs() <= 448.0)


@pytest.mark.parametrize("block", [1, 128])
def test_future_tokens_do_not_change_earlier_blocks(block):
    lengths = [300, 257]
    cu = cu_seqlens_from_lengths(lengths)
    x = torch.randn(557, 2, 64).bfloat16()
    y = x.clone()
    cut = 300 + 130
    y[cut:] = torch.randn(557 - cut, 2, 64).bfloat16() * 100
    a, b = quantize_thd(x, cu, block), quantize_thd(y, cu, block)
    safe_end = cut if block == 1 else 300 + 128  # tokens in blocks that end before the cut
    assert torch.equal(a.data_td[:safe_end].view(torch.uint8), b.data_td[:safe_end].view(torch.uint8))
    assert torch.equal(a.scale[:, :safe_end], b.scale[:, :safe_end])


def test_pv_order_permutes_each_16_column_group():
    from flamia_cute.quant import PV_ORDER16, quantize_thd

    x = torch.randn(150, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 7, 7, 150], dtype=torch.int32)
    nat = quantize_thd(x, cu, 1)
    perm = quantize_thd(x, cu, 1, pv_order=True)
    assert perm.dt_pv_order and not nat.dt_pv_order
    assert torch.equal(perm.data_td.view(torch.uint8), nat.data_td.view(torch.uint8))
    a, b = nat.data_dt.view(torch.uint8), perm.data_dt.view(torch.uint8)
    for g in range(a.shape[-1] // 16):
        for j in range(16):
            assert torch.equal(b[..., 16 * g + j], a[..., 16 * g + PV_ORDER16[j]])
    assert sorted(PV_ORDER16) == list(range(16))


@pytest.mark.parametrize("pv_order", [False, True])
def test_transposed_only_operand_dequantizes_like_the_token_major_one(pv_order):
    """A forward_only launch writes V transposed only (data_td None): dequantize reads data_dt back
    through cu_seqlens (documents at their dt_cu_seqlens columns, P-fragment order undone), and says
    which argument it needs when cu_seqlens is missing."""
    import dataclasses

    x = torch.randn(300, 3, 64, dtype=torch.bfloat16) * 4
    cu = cu_seqlens_from_lengths([129, 0, 1, 170])
    full = quantize_thd(x, cu, 128, pv_order=pv_order)
    dt_only = dataclasses.replace(full, data_td=None)
    assert torch.equal(dt_only.dequantize(cu), full.dequantize())
    with pytest.raises(ValueError, match="cu_seqlens"):
        dt_only.dequantize()


def test_per_tensor_in_token_layouts_is_quantize_per_tensor_and_leaks():
    """The leaky control in the per-token kernels' layouts: quantize_per_tensor's values, one scale in
    every (head, token) slot, data_dt the transposed copy; and the scale follows another document."""
    cu = cu_seqlens_from_lengths([40, 1, 77])
    x = torch.randn(118, 3, 64) * torch.logspace(-2, 2, 118).view(-1, 1, 1)
    x = x.to(torch.bfloat16)
    for pv in (False, True):
        qt = quantize_thd_per_tensor(x, cu, pv_order=pv)
        vals, scale = quantize_per_tensor(x)
        assert qt.scale.shape == (3, 118) and torch.equal(qt.scale, torch.full_like(qt.scale, float(scale)))
        assert torch.equal(qt.data_td.float(), vals) and torch.equal(qt.dequantize(), vals * scale)
        want_dt = quantize_thd(x, cu).data_dt  # per-token scales differ, so compare the layout on the values
        assert qt.data_dt.shape == want_dt.shape and qt.dt_pv_order == pv
        assert torch.equal(natural_dt(qt).float(), transpose_tokens(qt.data_td, cu).float())
    assert quantize_thd_per_tensor(x, cu, transposed=False).data_dt is None
    # the control leaks: a larger value in the LAST document changes the FIRST document's bytes
    y = x.clone()
    y[-1] *= 64
    assert not torch.equal(quantize_thd_per_tensor(y, cu).data_td[:40], quantize_thd_per_tensor(x, cu).data_td[:40])
