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


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 3000), min_size=1, max_size=12),
    heads=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2]),
)
def test_lpt_order_is_a_permutation_sorted_by_cost(lengths, heads, group):
    from flamia_cute.schedules import lpt_order

    if heads % group:
        group = 1
    T = sum(lengths)
    tiles = enumerate_tiles(cu_seqlens_from_lengths(lengths), T, heads=heads, head_dim=64)
    order = lpt_order(tiles["flops"], tiles["head"], group)
    assert sorted(order.tolist()) == list(range(tiles["flops"].numel()))  # every tile exactly once
    f = tiles["flops"][order]
    assert bool((f[:-1] >= f[1:]).all())  # longest first
    kv = (tiles["head"][order] // group).tolist()
    fl = f.tolist()
    for i in range(1, len(fl)):  # within equal cost, kv heads come in non-decreasing runs
        if fl[i] == fl[i - 1]:
            assert kv[i] >= kv[i - 1]


def test_lpt_balances_better_than_position_order():
    from flamia_cute.schedules import lpt_order, simulate

    lengths = [216, 2820, 2164, 441, 1026, 895, 1581, 2331, 147, 43, 2709, 850, 2154, 32, 884, 1917, 389,
               4358, 3475, 46, 38, 1169, 3083]  # longtail32k
    tiles = enumerate_tiles(cu_seqlens_from_lengths(lengths), sum(lengths), heads=16, head_dim=128)
    costs = tiles["flops"].tolist()
    natural = list(range(len(costs)))
    lpt = lpt_order(tiles["flops"], tiles["head"]).tolist()
    bound = sum(costs) / 132  # perfect balance on 132 SMs
    dyn = simulate(costs, lpt, 132, "dynamic")
    assert dyn <= simulate(costs, natural, 132, "dynamic")
    assert dyn <= 1.05 * max(bound, max(costs))  # LPT with a counter is within 5% of the bound here


def test_simulate_policies():
    from flamia_cute.schedules import simulate

    assert simulate([4, 3, 3, 2], range(4), 2, "dynamic") == 6  # 4 + 2 | 3 + 3
    assert simulate([4, 3, 3, 2], range(4), 2, "static") == 7  # worker 0 gets tiles 0 and 2


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 1200), min_size=1, max_size=10),
    kv_heads=st.sampled_from([1, 2, 4, 8]),
    window=st.sampled_from([1, 2, 4, 8]),
)
def test_backward_grid_runs_every_key_block_once_windows_longest_first(lengths, kv_heads, window):
    """The backward's "blocks" grid (tile_scheduler.backward_grid, backward_work_item): its non-empty
    CTAs in launch order are documents in order, in each the KV heads in windows of `window`, a
    window's key blocks from the first (the most query tiles) with its heads fastest: every (document,
    KV head, key block) with keys exactly once."""
    from flamia_cute.tile_scheduler import backward_grid, backward_work_item

    if kv_heads % window:
        window = 1
    order = []
    for d, n in enumerate(lengths):
        for w0 in range(0, kv_heads, window):
            order += [(d, w0 + h, b) for b in range((n + 127) // 128) for h in range(window)]
    n_blocks = max((n + 127) // 128 for n in lengths)
    gx, gy, gz = backward_grid("blocks", kv_heads, len(lengths), n_blocks, window)
    launched = []
    for z in range(gz):
        for y in range(gy):
            for x in range(gx):
                head, doc, blk = backward_work_item("blocks", (x, y, z), window)
                if blk * 128 < lengths[doc]:
                    launched.append((doc, head, blk))
    assert order == launched
    assert len(set(order)) == len(order) == kv_heads * sum((n + 127) // 128 for n in lengths)


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.one_of(st.integers(0, 70), st.integers(0, 600)), min_size=1, max_size=40),
    heads=st.sampled_from([1, 3, 16]),
    order=st.sampled_from(["documents", "longest_documents"]),
)
def test_short_pairs_cover_every_query_row_once(lengths, heads, order):
    """The forward's short pairs (FwdConfig.short_pairs): every (document, head, query block) with
    queries runs exactly once, as its own tile or as the second half of its predecessor's block 0;
    only (2i, 2i + 1) pair, only when 2i fills 64 V^T columns (33..64 tokens) and 2i + 1 holds 1..64;
    the tile table (locate_tile's arithmetic over chunk_table) is the order's."""
    from flamia_cute.schedules.varlen_tiles import (
        SHORT_PAIR_ROWS,
        chunk_table,
        locate_tile_model,
        persistent_order,
        short_pair_partner,
    )

    paired = persistent_order(lengths, heads, order=order, short_pairs=True)
    plain = persistent_order(lengths, heads, order=order)
    covered = []
    for d, h, b in paired:
        covered.append((d, h, b))
        n_b = short_pair_partner(lengths, d)
        if n_b:
            assert b == 0 and d % 2 == 0 and 32 < lengths[d] <= SHORT_PAIR_ROWS and 0 < n_b <= SHORT_PAIR_ROWS
            assert n_b == lengths[d + 1]
            covered.append((d + 1, h, 0))
    assert sorted(covered) == sorted(plain) and len(set(covered)) == len(covered)
    n_pairs = sum(short_pair_partner(lengths, a) > 0 for a in range(0, len(lengths), 2))
    assert len(paired) == len(plain) - heads * n_pairs
    if order == "documents":
        cum = chunk_table(lengths, short_pairs=True)
        assert [locate_tile_model(t, cum, heads) for t in range(len(paired))] == paired


def test_short_pairs_rule_examples():
    from flamia_cute.schedules.varlen_tiles import chunk_table, short_pair_partner

    assert [short_pair_partner([64] * 5, a) for a in range(5)] == [64, 0, 64, 0, 0]
    assert short_pair_partner([33, 64], 0) == 64 and short_pair_partner([32, 64], 0) == 0  # 32 V^T columns
    assert short_pair_partner([64, 65], 0) == 0 and short_pair_partner([64, 0], 0) == 0
    assert short_pair_partner([100, 64, 64], 1) == 0  # odd documents lead no pair
    assert chunk_table([64, 64, 64, 64, 300], short_pairs=True) == [0, 1, 1, 2, 2, 5]
