"""flamia_attn_func: the dense (batch, seqlen, heads, head_dim) entry point, each batch row one document."""

from __future__ import annotations

import pytest
import torch

from flamia_cute import flamia_attn_func, flamia_attn_varlen_func
from flamia_cute.interface import _row_starts
from flamia_cute.testing import cu_seqlens_from_lengths


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _grads(fn, q, k, v, do):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves)
    out.backward(do)
    return out.detach(), lse, *(t.grad for t in leaves)


@pytest.mark.parametrize("causal,sq,sk", [(True, 150, 150), (True, 70, 150), (False, 90, 40)])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_dense_is_the_varlen_call_on_its_rows(causal, sq, sk, heads):
    B, (H, Hk), D = 3, heads, 64
    q, k, v, do = _rand(B, sq, H, D, seed=1), _rand(B, sk, Hk, D, seed=2), _rand(B, sk, Hk, D, seed=3), \
        _rand(B, sq, H, D, seed=4)
    got = _grads(lambda *t: flamia_attn_func(*t, causal=causal, return_lse=True), q, k, v, do)
    cu_q, cu_k = cu_seqlens_from_lengths([sq] * B), cu_seqlens_from_lengths([sk] * B)

    def varlen(q_, k_, v_):
        out, lse = flamia_attn_varlen_func(q_.reshape(B * sq, H, D), k_.reshape(B * sk, Hk, D),
                                           v_.reshape(B * sk, Hk, D), cu_q, cu_k, sq, sk, causal=causal,
                                           return_lse=True)
        return out.view(B, sq, H, D), lse.view(H, B, sq).transpose(0, 1)

    want = _grads(varlen, q, k, v, do)
    assert got[0].shape == (B, sq, H, D) and got[1].shape == (B, H, sq)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_rows_are_separate_documents():
    """Another row's inputs never change a row's output (each row has its own scales); the per-tensor control's
    shared scale does."""
    q, k, v = _rand(2, 128, 2, 64, seed=5), _rand(2, 128, 2, 64, seed=6), _rand(2, 128, 2, 64, seed=7)
    k2 = k.clone()
    k2[1] *= 100
    for recipe, isolated in (("fp8_tokenblock_dsbf16", True), ("fp8_tensor_current", False)):
        a = flamia_attn_func(q, k, v, recipe=recipe)
        b = flamia_attn_func(q, k2, v, recipe=recipe)
        assert torch.equal(a[0], b[0]) == isolated, recipe


def test_row_starts_are_one_tensor_per_shape():
    """A GPU cu_seqlens is checked once per tensor: repeated calls reuse one."""
    like = torch.empty(0)
    a, b = _row_starts(3, 150, like), _row_starts(3, 150, like)
    assert a is b and a.tolist() == [0, 150, 300, 450] and a.dtype == torch.int32


def test_fake_tensor_mode_and_eager_calls_in_either_order():
    """A FakeTensorMode call (memory estimation) neither stores its fake cu_seqlens nor takes the real one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q = _rand(2, 96, 2, 64, seed=16)
    want = flamia_attn_func(q, q, q)
    with FakeTensorMode() as mode:
        out = flamia_attn_func(mode.from_tensor(q), mode.from_tensor(q), mode.from_tensor(q))
        assert out.shape == q.shape
    with FakeTensorMode() as mode:  # a shape no eager call has cached yet
        flamia_attn_func(*(mode.from_tensor(_rand(3, 40, 2, 64, seed=17)) for _ in range(3)))
    assert torch.equal(flamia_attn_func(q, q, q), want)
    flamia_attn_func(*(_rand(3, 40, 2, 64, seed=17) for _ in range(3)))  # real, after the fake call


def test_compile_first_compiles_once_per_shape():
    """A compiled call that finds no cached cu_seqlens builds one in the graph and stores nothing while
    tracing (a store would trip the graph's guards and compile it again)."""
    from flamia_cute import interface

    torch._dynamo.reset()
    interface._ROW_STARTS.clear()
    counts = []

    def backend(gm, _inputs):
        counts.append(1)
        return gm.forward

    fn = torch.compile(flamia_attn_func, backend=backend, fullgraph=True)
    for s in (64, 64, 80, 80):
        q = _rand(2, s, 2, 64, seed=s)
        assert torch.equal(fn(q, q, q), flamia_attn_func(q, q, q) if s else None)
    assert len(counts) <= 3, counts  # 64; 80 (maybe dynamic on the second shape); never a second 64


def test_compiled_matches_eager():
    torch._dynamo.reset()
    q, k, v = (_rand(2, 100, 2, 64, seed=s).requires_grad_() for s in (8, 9, 10))
    outs = []
    for fn in (flamia_attn_func, torch.compile(flamia_attn_func, backend="aot_eager", fullgraph=True)):
        out = fn(q, k, v)
        outs.append((out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_bad_inputs_name_the_argument():
    q = _rand(2, 16, 2, 64, seed=11)
    with pytest.raises(ValueError, match="k must have shape"):
        flamia_attn_func(q, q[0], q)
    with pytest.raises(ValueError, match="same batch size"):
        flamia_attn_func(q, q[:1], q[:1])
    with pytest.raises(ValueError, match="seqlen_q .* must not exceed seqlen_k"):
        flamia_attn_func(q, q[:, :8], q[:, :8])
    with pytest.raises(ValueError, match="k and v must have the same seqlen"):
        flamia_attn_func(q, q, q[:, :8], causal=False)
    with pytest.raises(TypeError, match="v must be a torch.Tensor"):
        flamia_attn_func(q, q, None)
    with pytest.raises(ValueError, match="at least one row and one position"):
        flamia_attn_func(q[:, :0], q[:, :0], q[:, :0])
    with pytest.raises(ValueError, match="at least one row and one position"):
        flamia_attn_func(q[:0], q[:0], q[:0])


@pytest.mark.gpu
def test_gpu_dense_is_the_varlen_call(monkeypatch):
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("needs an sm_90 GPU")
    monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", "1")  # bitwise dQ
    B, S, H, Hk, D = 4, 1000, 8, 2, 128
    q, k, v, do = (_rand(B, S, h, D, seed=s).cuda() for s, h in ((12, H), (13, Hk), (14, Hk), (15, H)))
    got = _grads(lambda *t: flamia_attn_func(*t, backend="cute", return_lse=True), q, k, v, do)
    cu = cu_seqlens_from_lengths([S] * B).cuda()

    def varlen(q_, k_, v_):
        out, lse = flamia_attn_varlen_func(q_.reshape(B * S, H, D), k_.reshape(B * S, Hk, D), v_.reshape(B * S, Hk, D),
                                           cu, cu, S, S, backend="cute", return_lse=True)
        return out.view(B, S, H, D), lse.view(H, B, S).transpose(0, 1)

    for a, b in zip(got, _grads(varlen, q, k, v, do), strict=True):
        assert torch.equal(a, b)
