"""Activation checkpointing, as LLM training uses it: torch.utils.checkpoint (non-reentrant and reentrant),
selective activation checkpointing with a policy that saves the attention op's outputs (torchtitan's),
and a checkpointed block under torch.compile. The forward recomputed in the backward must rebuild the
same FP8 operands (the quantizers are deterministic functions of their inputs), so every gradient equals
the uncheckpointed run's: bitwise on the emulator, and on the kernels with the deterministic backward."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from flamia_cute import flamia_attn_varlen_func
from flamia_cute.rotary import RotaryConfig
from flamia_cute.testing import TinyBlock

LENGTHS = [3, 150, 0, 40, 1]


def _grads(device, wrap, backend="emulate", recipe="fp8_tokenblock_dsbf16", rotary=None, compile_backend=None):
    torch.manual_seed(0)
    block = TinyBlock(128, 2, recipe, backend, rotary, mlp=True).to(device=device, dtype=torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=device)
    x = torch.randn(sum(LENGTHS), 128, device=device, dtype=torch.bfloat16, requires_grad=True)

    def step(x):
        return wrap(block, x, cu, max(LENGTHS)) if wrap is not None else block(x, cu, max(LENGTHS))

    fn = torch.compile(step, fullgraph=True, backend=compile_backend) if compile_backend else step
    y = fn(x)
    y.float().square().sum().backward()
    return [y.detach(), x.grad, *(p.grad for p in block.parameters())]


def _non_reentrant(block, *args):
    return checkpoint(block, *args, use_reentrant=False)


def _reentrant(block, *args):
    return checkpoint(block, *args, use_reentrant=True)


def _save_attention_policy(ctx, op, *args, **kwargs):
    # torchtitan's selective checkpointing: keep the attention op's outputs, recompute the rest
    if op in (torch.ops.flamia_cute.varlen_fwd.default,):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective(block, *args):
    return checkpoint(block, *args, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, _save_attention_policy))


def _assert_all_equal(ref, got):
    assert len(ref) == len(got)
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert torch.equal(a, b), f"tensor {i} differs: max |diff| {(a.float() - b.float()).abs().max().item()}"


def _forward_runs(monkeypatch, device, wrap, **kw) -> int:
    """How many times the attention forward ran in one training step of the block under wrap."""
    from flamia_cute import custom_ops

    runs, real = [], custom_ops.run_forward

    def counted(*a, **k):
        runs.append(1)
        return real(*a, **k)

    monkeypatch.setattr(custom_ops, "run_forward", counted)
    _grads(device, wrap, **kw)
    return len(runs)


@pytest.mark.parametrize("compile_backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_selective_checkpointing_saves_the_attention_instead_of_recomputing_it(monkeypatch, compile_backend):
    """A policy that saves flamia_cute::varlen_fwd runs the attention forward once, in eager (the call takes
    the custom op when a dispatch mode is active) and compiled; plain checkpointing runs it twice."""
    torch._dynamo.reset()
    assert _forward_runs(monkeypatch, "cpu", None, compile_backend=compile_backend) == 1
    torch._dynamo.reset()
    assert _forward_runs(monkeypatch, "cpu", _non_reentrant, compile_backend=compile_backend) == 2
    torch._dynamo.reset()
    assert _forward_runs(monkeypatch, "cpu", _selective, compile_backend=compile_backend) == 1


@pytest.mark.parametrize("kernels", [False, True], ids=["emulator", "kernel_dispatch"])
def test_fake_tensor_mode_takes_the_custom_op(kernels, monkeypatch):
    """Under FakeTensorMode outside torch.compile (memory estimation, meta init) the call runs the fake
    implementation instead of computing on fake tensors; with the kernels' dispatch (as on an sm_90 host) and
    two cu_seqlens objects (Hugging Face's), deciding the plan reads no value."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flamia_cute import interface
    from flamia_cute.testing import make_inputs

    if kernels:
        monkeypatch.setattr(interface, "_kernels_available", lambda device: True)
    q, k, v, _, cu, scale = make_inputs(LENGTHS, 2, 2, 64, seed=0)
    cu_k = cu.clone()
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fq, fk, fv, fcu, fcu_k = (mode.from_tensor(t) for t in (q, k, v, cu, cu_k))
        out = flamia_attn_varlen_func(fq.requires_grad_(), fk, fv, fcu, fcu_k, max(LENGTHS), max(LENGTHS), scale,
                                      backend="auto")
        assert out.shape == q.shape and out.dtype == q.dtype


@pytest.mark.parametrize("wrap", [_non_reentrant, _reentrant, _selective], ids=["non_reentrant", "reentrant",
                                                                                 "selective"])
@pytest.mark.parametrize("rotary", [None, RotaryConfig()], ids=["plain", "rope"])
def test_checkpointed_block_has_the_same_gradients(wrap, rotary):
    _assert_all_equal(_grads("cpu", None, rotary=rotary), _grads("cpu", wrap, rotary=rotary))


def test_checkpointed_block_under_compile_has_the_same_gradients():
    torch._dynamo.reset()
    ref = _grads("cpu", None)
    _assert_all_equal(ref, _grads("cpu", _non_reentrant, compile_backend="aot_eager"))
    torch._dynamo.reset()
    _assert_all_equal(ref, _grads("cpu", _selective, compile_backend="aot_eager"))


def test_the_comparison_sees_a_recompute_that_differs():
    """The control: a recomputed forward that saves tensors of the same shapes but other values (the Hadamard
    recipe's on recompute) gives other gradients, and the bitwise comparison above reports them."""
    calls = []

    def flip(block, *args):
        def run(*a):
            calls.append(1)
            block.recipe = "fp8_tokenblock_dsbf16" if len(calls) == 1 else "fp8_tokenblock_hadamard"
            return block(*a)
        return checkpoint(run, *args, use_reentrant=False)

    ref = _grads("cpu", None)
    with pytest.raises(AssertionError, match="differs"):
        _assert_all_equal(ref, _grads("cpu", flip))
    assert len(calls) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("wrap", [_non_reentrant, _selective], ids=["non_reentrant", "selective"])
def test_gpu_checkpointed_block_has_the_same_gradients(wrap, monkeypatch):
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("needs an sm_90 GPU")
    monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", "1")  # bitwise dQ
    _assert_all_equal(_grads("cuda", None, backend="cute"), _grads("cuda", wrap, backend="cute"))
