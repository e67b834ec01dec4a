"""Varlen chunk and tile enumeration against a brute-force Python model."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flamia_cute.schedules import build_varlen_chunks, causal_flops, enumerate_tiles, max_chunks
from flamia_cute.testing import cu_seqlens_from_lengths


def brute_force(lengths, tile, heads, d, backward):
    tiles, start = [], 0
    for n in lengths:
        for c0 in range(0, n, tile):
            ln = min(tile, n - c0)
            if backward:
                pairs = sum(n - p for p in range(c0, c0 + ln))
            else:
                pairs = sum(p + 1 for p in range(c0, c0 + ln))
            for h in range(heads):
                tiles.append((start + c0, ln, h, pairs * (10 if backward else 4) * d))
        start += n
    return tiles


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 700), min_size=1, max_size=8),
    tile=st.sampled_from([1, 64, 128]),
    backward=st.booleans(),
)
def test_tiles_match_brute_force(lengths, tile, backward):
    T = sum(lengths)
    cu = cu_seqlens_from_lengths(lengths)
    got = enumerate_tiles(cu, T, heads=2, head_dim=64, tile=tile, backward=backward)
    assert got["start"].numel() == max_chunks(T, len(lengths), tile) * 2
    real = got["length"] > 0
    rows = list(zip(*(got[k][real].tolist() for k in ("start", "length", "head", "flops")), strict=True))
    assert sorted(rows) == sorted(brute_force(lengths, tile, 2, 64, backward))  # every tile exactly once
    assert int(got["flops"].sum()) == causal_flops(lengths, 2, 64, backward)
    assert not got["flops"][~real].any()


def test_chunks_never_span_documents():
    lengths = [5, 0, 300, 1, 129]
    cu = cu_seqlens_from_lengths(lengths)
    chunks = build_varlen_chunks(cu, sum(lengths), 128)
    bounds = cu.tolist()
    for s, n in chunks.tolist():
        if n:
            doc = max(i for i, b in enumerate(bounds[:-1]) if b <= s)
            assert s + n <= bounds[doc + 1]


def test_no_host_sync_needed_for_shapes():
    cu = cu_seqlens_from_lengths([3, 4])
    t = enumerate_tiles(cu, 7, heads=1, head_dim=64)
    assert t["flops"].device == cu.device and t["flops"].dtype == torch.int64
