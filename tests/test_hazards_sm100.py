"""The protocol hazard model (flamia_cute.sm100.hazards) of the sm_100a forward: the kernel's order of
tensor- and shared-memory accesses across its roles, which the CPU tile model cannot see. Pure Python."""

import pytest

from flamia_cute.sm100.hazards import Pipe, Region, Role, check, forward_roles
from flamia_cute.sm100.plan import TMEM_COLS, fwd_tmem_cols_used, fwd_tmem_plan


@pytest.mark.parametrize("kv_stages", [1, 2])
@pytest.mark.parametrize("n_tiles", [1, 2, 3, 4])
def test_forward_order_is_hazard_free(n_tiles, kv_stages):
    assert check(forward_roles(n_tiles, kv_stages)) == []


@pytest.mark.parametrize("kv_stages", [1, 2])
@pytest.mark.parametrize("n_tiles", [2, 3, 4])
def test_original_order_clobbers_the_diagonals_p(n_tiles, kv_stages):
    """S of tile 1 issued before the diagonal's P V lands in stage 0 over the diagonal's P codes."""
    problems = check(forward_roles(n_tiles, kv_stages, order="s_first"))
    assert len(problems) == 1
    assert "S1 writes tmem[0:128) between P0's write and mma: PV0's read of tmem[0:32)" in problems[0]


@pytest.mark.parametrize("n_tiles", [1, 3])
def test_q_conversion_must_wait_for_q_and_be_waited_for(n_tiles):
    """The softmax warps write the diagonal's bf16 Q from Q's TMA'd codes; the bf16 S reads it."""
    softmax = forward_roles(n_tiles)[2]
    assert [op.label for op in softmax.ops[:4]] == ["wait q.full[0]#0", "cvt_Qd", "arrive qd.full[0]", "wait s.full[0]#0"]
    problems = check(forward_roles(n_tiles, order="qd_unwaited"))
    assert problems == ["Sbf0 may read sQd before cvt_Qd writes it"], problems
    problems = check(forward_roles(n_tiles, order="q_unwaited"))
    assert sorted(problems) == ["cvt_Qd may read sQ before load_q writes it",
                                "cvt_Qd may read sfQ before load_q writes it"], problems


def test_one_tile_has_no_second_s():
    # with only the diagonal there is no tile 1: both orders are the same sequence
    a, b = forward_roles(1, order="s_first"), forward_roles(1)
    assert [[op.label for op in r.ops] for r in a] == [[op.label for op in r.ops] for r in b]


def test_forward_roles_follow_the_plan():
    mma = forward_roles(3)[1]
    assert [op.label for op in mma.ops if op.tc and not op.arrive] == [
        "cp_sfQ", "cp_sfK0", "S0", "Sbf0", "cp_sfP0", "cp_sfV0", "PV0", "PVbf0", "cp_sfK1", "S1",
        "cp_sfK2", "S2", "cp_sfP1", "cp_sfV1", "PV1", "cp_sfP2", "cp_sfV2", "PV2"]
    plan = fwd_tmem_plan(128)
    assert plan["S0"] == (0, 128) and plan["S1"] == (128, 256) and plan["O"] == (256, 384)
    assert fwd_tmem_cols_used(128) == 400 <= TMEM_COLS
    with pytest.raises(ValueError, match="order"):
        forward_roles(2, order="nope")


def _ring(consumer_waits=True, slots=2, items=3):
    """A producer writing `items` values through a `slots` ring, a consumer reading each."""
    prod, cons, pipe = Role("load"), Role("mma"), Pipe("x", slots)
    for j in range(items):
        i = pipe.acquire(prod)
        prod.do(f"w{j}", writes=[Region(f"buf[{i}]")])
        pipe.commit(prod, i)
    for j in range(items):
        i = pipe.wait(cons) if consumer_waits else j % slots
        cons.do(f"r{j}", reads=[(Region(f"buf[{i}]"), f"w{j}")])
        if consumer_waits:
            pipe.release(cons, i)
    return [prod, cons]


def test_checker_on_small_protocols():
    assert check(_ring()) == []
    assert any("before w0 writes it" in p for p in check(_ring(consumer_waits=False)))
    # an asynchronous (tcgen05) read is not finished when the thread arrives on a plain barrier
    prod, cons, pipe = Role("load"), Role("mma"), Pipe("x", 1)
    for j in range(2):
        i = pipe.acquire(prod)
        prod.do(f"w{j}", writes=[Region("buf")])
        pipe.commit(prod, i)
    for j in range(2):
        i = pipe.wait(cons)
        cons.do(f"r{j}", reads=[(Region("buf"), f"w{j}")], tc=True)
        pipe.release(cons, i)  # a thread arrive: the tcgen05 read may still run
    assert any("w1 writes buf between w0's write" in p for p in check([prod, cons]))
    # a wait with no arrive
    lone = Role("mma")
    lone.wait("never", 0)
    assert any("never comes" in p for p in check([lone]))
