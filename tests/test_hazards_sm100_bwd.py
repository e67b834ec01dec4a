"""The protocol hazard model (flamia_cute.sm100.hazards) of the planned sm_100a MXFP8 backward, before
any kernel: its roles in FA4's flash_bwd_sm100 layout, its tensor-memory column plan, and mutants of
its order that the checker must reject. Pure Python."""

import pytest

from flamia_cute.sm100.hazards import BWD_ORDERS, backward_roles, check
from flamia_cute.sm100.plan import BWD_QUERY_TILE, BWD_SF_CHUNKS, SF_TMEM_COLS, TMEM_COLS, bwd_tmem_cols_used, bwd_tmem_plan


@pytest.mark.parametrize("do_stages", [1, 2])
@pytest.mark.parametrize("q_stages", [1, 2])
@pytest.mark.parametrize("n_tiles", [1, 2, 3, 4])
def test_planned_backward_is_hazard_free(n_tiles, q_stages, do_stages):
    assert check(backward_roles(n_tiles, q_stages, do_stages)) == []


@pytest.mark.parametrize("n_tiles", [2, 3, 4])
def test_next_s_before_the_p_stage_is_released_clobbers_p(n_tiles):
    """FA4's 1-CTA lookahead (S^T of tile j+1 right after dP^T of tile j) needs dQ in columns of its
    own; under this plan S^T lands over P^T's codes before dV reads them, and over dQ."""
    problems = check(backward_roles(n_tiles, order="s_lookahead"))
    assert "mma: S1 writes tmem[0:64) between P0's write and mma: dV0's read of tmem[0:16)" in problems
    assert any("between S1's write and compute: ld_S1's read" in p for p in problems)


@pytest.mark.parametrize("n_tiles", [1, 2, 3, 4])
def test_releasing_dq_before_the_reduction_read_it(n_tiles):
    problems = check(backward_roles(n_tiles, order="dq_early_release"))
    assert problems
    if n_tiles == 1:  # only the deallocation is left to clobber it
        assert problems == ["mma: dealloc writes tmem[0:512) between dQ0's write and dq_reduce: "
                            "ld_dQ0's read of tmem[0:128)"]
    else:
        assert ("mma: S1 writes tmem[0:64) between dQ0's write and dq_reduce: ld_dQ0's read of "
                "tmem[0:128)") in problems
        assert ("mma: dP1 writes tmem[64:128) between dQ0's write and dq_reduce: ld_dQ0's read of "
                "tmem[0:128)") in problems


@pytest.mark.parametrize("n_tiles", [2, 3, 4])
def test_s_without_waiting_for_the_dq_release(n_tiles):
    problems = check(backward_roles(n_tiles, order="no_dq_wait"))
    assert len(problems) == 4 * (n_tiles - 1)
    assert all(f"between dQ{j}'s write and dq_reduce: ld_dQ{j}'s read" in p
               for j in range(n_tiles - 1) for p in problems[4 * j:4 * j + 4])


def test_one_tile_mutants_that_need_a_second_tile():
    # with one query tile there is no next S^T: the lookahead and the missing wait change nothing
    for order in ("s_lookahead", "no_dq_wait"):
        assert check(backward_roles(1, order=order)) == []
    with pytest.raises(ValueError, match="order"):
        backward_roles(2, order="nope")
    assert set(BWD_ORDERS) == {"planned", "s_lookahead", "dq_early_release", "no_dq_wait"}


def test_backward_roles_follow_the_plan():
    roles = backward_roles(2)
    assert [r.name for r in roles] == ["load", "mma", "compute", "dq_reduce", "epilogue"]
    mma = roles[1]
    per_tile = ["cp_sfQ{j}", "S{j}", "cp_sfdO{j}", "dP{j}", "cp_sfP{j}", "cp_sfdOt{j}", "dV{j}",
                "cp_sfdSt{j}", "cp_sfQt{j}", "dK{j}", "cp_sfdS{j}", "dQ{j}"]
    assert [op.label for op in mma.ops if op.tc and not op.arrive] == (
        ["cp_sfK", "cp_sfV", "cp_sfKt"] + [x.format(j=j) for j in range(2) for x in per_tile])
    # S^T of tile 1 waits for the reduction's release of dQ 0 (dQ lies over S^T and dP^T)
    labels = [op.label for op in mma.ops]
    assert labels.index("wait dq.empty[0]#0") < labels.index("S1")


def test_backward_column_plan():
    plan = bwd_tmem_plan(128)
    assert BWD_QUERY_TILE == 64
    assert plan["S"] == (0, 64) and plan["dP"] == (64, 128) and plan["dQ"] == (0, 128)
    assert plan["dV"] == (128, 256) and plan["dK"] == (256, 384)
    assert len(BWD_SF_CHUNKS) == 10 and plan["SFKt"] == (420, 424)
    assert bwd_tmem_cols_used(128) == 2 * 64 + 2 * 128 + 10 * SF_TMEM_COLS == 424 <= TMEM_COLS
    # the accumulators never overlap each other except dQ over S^T and dP^T
    names = [n for n in plan if n != "dQ"]
    for n, a in enumerate(names):
        for b in names[n + 1:]:
            assert plan[a][1] <= plan[b][0] or plan[b][1] <= plan[a][0], (a, b)
    # 128x128 tiles: S^T, dP^T, dV, dK fill 512 columns, the scale chunks do not fit
    with pytest.raises(ValueError, match="552 tensor-memory columns"):
        bwd_tmem_plan(128, query_tile=128)
    with pytest.raises(ValueError, match="does not fit"):
        bwd_tmem_plan(128, query_tile=32)
