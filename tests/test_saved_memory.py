"""What a training call keeps between forward and backward on the kernels (docs/backward.md, "Memory a
training step keeps"): the Q/K/V launch's byte plan against FA4's saved bf16 Q, K, V. CPU only."""

from __future__ import annotations

import pytest

from flamia_cute.custom_ops import _qkv_plan, saved_layout

MIB = 2**20


def saved_bytes(T: int, num_docs: int, Hq: int, Hk: int, D: int, recipe: str = "fp8_tokenblock_dsbf16") -> dict:
    _, qkv = _qkv_plan(T, num_docs, Hq, Hk, D, recipe)
    out_lse = 2 * T * Hq * D + 4 * Hq * T
    return {"ours": qkv + out_lse, "fa4": 2 * T * Hq * D + 4 * T * Hk * D + out_lse, "qkv": qkv}


def test_kernel_path_saves_one_buffer_and_out():
    # the kernels' saved state: O, the Q/K/V launch's single buffer and K's shape; nothing in bf16 but O
    assert [name for name, _ in saved_layout("fp8_tokenblock_dsbf16", "cute", True)] == ["out", "qkv", "k"]


@pytest.mark.parametrize("num_docs", [1, 16])
def test_saved_bytes_match_the_doc_mha(num_docs):
    T, H, D = 16384, 16, 128
    b = saved_bytes(T, num_docs, H, H, D)
    per_q = b["qkv"] / (T * H * D)
    assert 5.1 < per_q < 5.25  # Q 1 B, K and V^T 2 B, per-token copies 2 B, scales
    assert round(b["ours"] / MIB) in (230, 232) and round(b["fa4"] / MIB) == 257
    assert 0.89 < b["ours"] / b["fa4"] < 0.91


def test_saved_bytes_match_the_doc_gqa():
    b = saved_bytes(16384, 1, 32, 8, 128)
    assert round(b["ours"] / MIB) == 262 and round(b["fa4"] / MIB) == 322


def test_per_token_copies_are_two_bytes_of_each_key_element():
    # the per-tensor control keeps no per-token copies: the default's extra is exactly K's and V's copies
    # (2 B per K/V element) plus its finer scales
    T, H, D = 16384, 16, 128
    default = saved_bytes(T, 1, H, H, D)["qkv"]
    control = saved_bytes(T, 1, H, H, D, "fp8_tensor_current")["qkv"]
    assert 2.0 <= (default - control) / (T * H * D) < 2.1
