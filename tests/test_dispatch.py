"""flamia_attn_varlen_func's dispatch on a faked GPU (CPU tensors, a faked compute capability): sm_90 takes
the sm_90a kernels; Blackwell takes the emulator with a one-time warning unless FLAMIA_CUTE_SM100=1 opts in
to its MXFP8 forward (the emulator's backward on the operands that forward read); every fallback of a GPU
call warns once per reason; CPU calls and backend='emulate' never warn."""

import warnings

import pytest
import torch

from flamia_cute import NAMED_RECIPES, custom_ops, flamia_attn_varlen_func, interface
from flamia_cute.emulator import emulate_forward, quantize_inputs
from flamia_cute.quant.mx_layout import pack_mx_forward_operands
from flamia_cute.testing import make_inputs

LENGTHS = [70, 1, 0, 45]
FALLBACK = "flamia_attn_varlen_func runs on the torch emulator"


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(interface, "_WARNED", set())
    monkeypatch.delenv(interface.SM100_ENV, raising=False)


def fake_gpu(monkeypatch, capability: int):
    """CPU tensors dispatched as on a CUDA device of `capability` (10 * major + minor) with the CuTe DSL."""
    monkeypatch.setattr(interface, "_capability", lambda device: capability)
    monkeypatch.setattr(interface, "_kernels_available", lambda device: capability == 90)
    monkeypatch.setattr(interface, "_sm100_dsl", lambda: True)


def record_backends(monkeypatch) -> list:
    """The backend of each run_forward; "cute" (the sm_90a kernels) runs the emulator instead (no GPU)."""
    seen, real = [], custom_ops.run_forward

    def run_forward(*args, **kw):
        seen.append(args[10])
        return real(*args[:10], "emulate" if args[10] == "cute" else args[10], **kw)

    monkeypatch.setattr(custom_ops, "run_forward", run_forward)
    return seen


def stub_sm100(monkeypatch, fwd) -> list:
    """The sm_100a host entries on the CPU: the quantization's specification (which the fused kernel
    equals bit-exactly) and `fwd(ops, cu, scale)` for the kernel; returns the kernel's recorded calls."""
    pytest.importorskip("cutlass")
    from flamia_cute.sm100 import attention_fwd, quantize_mx

    calls = []
    monkeypatch.setattr(quantize_mx, "quantize_mx_forward", lambda q, k, v, cu: pack_mx_forward_operands(q, k, v, cu))
    monkeypatch.setattr(attention_fwd, "flamia_fwd_sm100",
                        lambda ops, cu, max_seqlen, scale: calls.append((ops, max_seqlen, scale)) or fwd(ops, cu, scale))
    return calls


def fallback_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith(FALLBACK)]


def call(q, k, v, cu, recipe, backend="auto", causal=True, grad=False, do=None):
    L = int((cu[1:] - cu[:-1]).max())
    qq, kk, vv = (t.detach().clone().requires_grad_(grad) for t in (q, k, v))
    out = flamia_attn_varlen_func(qq, kk, vv, cu, cu, L, L, causal=causal, recipe=recipe, backend=backend)
    if not grad:
        return out, None
    return out, torch.autograd.grad(out, (qq, kk, vv), do)


def test_sm90_takes_the_kernels_silently(monkeypatch):
    fake_gpu(monkeypatch, 90)
    seen = record_backends(monkeypatch)
    q, k, v, _, cu, _ = make_inputs(LENGTHS, 2, 2, 128)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        call(q, k, v, cu, "fp8_tokenblock")
    assert seen == ["cute"] and not fallback_warnings(rec)


def test_sm90_fallbacks_warn_once_per_reason(monkeypatch):
    fake_gpu(monkeypatch, 90)
    seen = record_backends(monkeypatch)
    q, k, v, _, cu, _ = make_inputs(LENGTHS, 2, 2, 256)
    q2, k2, v2, _, _, _ = make_inputs(LENGTHS, 2, 2, 128)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(2):
            call(q, k, v, cu, "fp8_tokenblock")
            call(q2, k2, v2, cu, "mxfp8", causal=False)
            call(q2, k2, v2, cu, "mxfp8", backend="emulate", causal=False)  # asked for: no warning
            call(q2, k2, v2, cu, "fp8_tokenblock", causal=False)  # the forward kernel's non-causal build
    assert seen == ["emulate", "emulate", "emulate", "cute"] * 2
    msgs = fallback_warnings(rec)
    assert len(msgs) == 2, msgs
    assert "head_dim 256 has no sm_90a kernel" in msgs[0] and "slow" in msgs[0]
    assert "recipe 'mxfp8' has no sm_90a kernel" in msgs[1]


def test_cpu_calls_never_warn(monkeypatch):
    seen = record_backends(monkeypatch)
    q, k, v, _, cu, _ = make_inputs(LENGTHS, 2, 2, 256)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        call(q, k, v, cu, "fp8_tokenblock")
        call(q, k, v, cu, "mxfp8", causal=False)
    assert seen == ["emulate"] * 2 and not fallback_warnings(rec)


def test_blackwell_without_opt_in_runs_the_emulator_and_warns_once(monkeypatch):
    fake_gpu(monkeypatch, 100)
    seen = record_backends(monkeypatch)
    calls = stub_sm100(monkeypatch, lambda *a: pytest.fail("the sm_100a kernel ran without the opt-in"))
    q, k, v, _, cu, _ = make_inputs(LENGTHS, 2, 2, 128)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        call(q, k, v, cu, "mxfp8")
        call(q, k, v, cu, "fp8_tokenblock")
    assert seen == ["emulate"] * 2 and not calls
    (msg,) = fallback_warnings(rec)
    assert "never run on hardware" in msg and f"{interface.SM100_ENV}=1" in msg and "slow" in msg
    with pytest.raises(NotImplementedError, match=interface.SM100_ENV):
        call(q, k, v, cu, "mxfp8", backend="cute")
    monkeypatch.setenv(interface.SM100_ENV, "yes")
    with pytest.raises(ValueError, match=interface.SM100_ENV):
        call(q, k, v, cu, "mxfp8")


def test_blackwell_opt_in_runs_the_mxfp8_forward_kernel(monkeypatch):
    """No grad: the kernel's forward alone, its operands never decoded."""
    fake_gpu(monkeypatch, 100)
    monkeypatch.setenv(interface.SM100_ENV, "1")
    q, k, v, do, cu, scale = make_inputs(LENGTHS, 4, 2, 128, seed=2)
    rec = NAMED_RECIPES["mxfp8"]
    calls = stub_sm100(monkeypatch, lambda ops, cu_, sc: emulate_forward(q, k, v, cu_, cu_, sc, True, rec)[:2])
    seen = record_backends(monkeypatch)
    decoded = []
    from flamia_cute.sm100 import backend as sm100

    real = sm100.saved_operands
    monkeypatch.setattr(sm100, "saved_operands", lambda *a: decoded.append(1) or real(*a))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out, _ = call(q, k, v, cu, "mxfp8")
        out_cute, _ = call(q, k, v, cu, "mxfp8", backend="cute")  # 'cute': the device's kernels
    assert seen == ["sm100", "sm100"] and len(calls) == 2 and not decoded and not fallback_warnings(w)
    assert calls[0][1] == max(LENGTHS) and calls[0][2] == scale
    want = emulate_forward(q, k, v, cu, cu, scale, True, rec)[0]
    assert torch.equal(out, want) and torch.equal(out_cute, want)


def test_blackwell_opt_in_with_grad_runs_the_emulator_backward_on_the_kernels_operands(monkeypatch):
    """With grad: the kernel's forward, then the emulator's backward on the operands decoded from the
    bytes the kernel read, which equal the emulator's own quantization bit for bit (so here, with the
    emulator's forward standing in for the kernel's, the gradients equal backend='emulate''s exactly)."""
    fake_gpu(monkeypatch, 100)
    monkeypatch.setenv(interface.SM100_ENV, "1")
    q, k, v, do, cu, scale = make_inputs(LENGTHS, 4, 2, 128, seed=2, kind="outliers")
    rec = NAMED_RECIPES["mxfp8"]
    calls = stub_sm100(monkeypatch, lambda ops, cu_, sc: emulate_forward(q, k, v, cu_, cu_, sc, True, rec)[:2])
    seen = record_backends(monkeypatch)
    out, grads = call(q, k, v, cu, "mxfp8", grad=True, do=do)
    out_e, grads_e = call(q, k, v, cu, "mxfp8", backend="emulate", grad=True, do=do)
    assert seen == ["sm100", "emulate"] and len(calls) == 1
    assert torch.equal(out, out_e)
    for name, a, b in zip("qkv", grads, grads_e, strict=True):
        assert torch.equal(a, b), f"d{name}"
    # the saved operands themselves: every EmuOperand field the backward reads
    from flamia_cute.sm100.backend import saved_operands

    got = saved_operands(pack_mx_forward_operands(q, k, v, cu), q, cu)
    want = quantize_inputs(q, k, v, cu, cu, rec)
    for name, a, b in zip("qkv", got, want, strict=True):
        for field in ("along_d", "along_t", "diag_along_d", "diag_along_t"):
            x, y = getattr(a, field), getattr(b, field)
            assert (x is None and y is None) or torch.equal(x, y), f"{name}.{field}"
        assert a.block_tokens == b.block_tokens and a.scale is None and b.scale is None


@pytest.mark.parametrize("recipe, head_dim, causal, why", [
    ("fp8_tokenblock", 128, True, "recipe 'fp8_tokenblock' has no sm_100a kernel"),
    ("mxfp8", 64, True, "head_dim 64 has no sm_100a kernel"),
    ("mxfp8", 128, False, "causal=False has no sm_100a kernel"),
])
def test_blackwell_opt_in_other_calls_fall_back_saying_why(monkeypatch, recipe, head_dim, causal, why):
    fake_gpu(monkeypatch, 100)
    monkeypatch.setenv(interface.SM100_ENV, "1")
    calls = stub_sm100(monkeypatch, lambda *a: pytest.fail("the sm_100a kernel ran for a call it has no kernel for"))
    seen = record_backends(monkeypatch)
    q, k, v, _, cu, _ = make_inputs(LENGTHS, 2, 2, head_dim)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        call(q, k, v, cu, recipe, causal=causal)
        call(q, k, v, cu, recipe, causal=causal)
    assert seen == ["emulate"] * 2 and not calls
    (msg,) = fallback_warnings(rec)
    assert why in msg
    with pytest.raises(NotImplementedError, match=why):
        call(q, k, v, cu, recipe, backend="cute", causal=causal)


class _Attn(torch.nn.Module):
    def __init__(self, dim, heads, recipe):
        super().__init__()
        self.heads, self.recipe = heads, recipe
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)

    def forward(self, x, cu, max_seqlen):
        T, dim = x.shape
        q, k, v = self.qkv(x).view(T, 3, self.heads, dim // self.heads).unbind(1)
        return flamia_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, recipe=self.recipe)


def _compiled_and_eager(dim, heads, recipe):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Attn(dim, heads, recipe).to(torch.bfloat16)
    cu = torch.tensor([0, 3, 53, 53, 93], dtype=torch.int32)
    x = torch.randn(93, dim, dtype=torch.bfloat16)
    res = []
    for fn in (torch.compile(model, fullgraph=True, backend="aot_eager"), model):
        model.zero_grad()
        y = fn(x, cu, 50)
        y.float().square().sum().backward()
        res.append((y.detach(), model.qkv.weight.grad.clone()))
    torch._dynamo.reset()
    return res


def test_fallback_warning_is_trace_safe(monkeypatch):
    """Under torch.compile(fullgraph=True) the warning is issued while tracing (the compiled call runs
    first here), outside the graph."""
    fake_gpu(monkeypatch, 90)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        (yc, gc), (y, g) = _compiled_and_eager(512, 2, "fp8_tokenblock")  # head_dim 256: the emulator
    assert torch.equal(y, yc) and torch.equal(g, gc)
    (msg,) = fallback_warnings(rec)
    assert "head_dim 256" in msg


def test_blackwell_opt_in_compiles_fullgraph(monkeypatch):
    """The sm100 backend through the custom ops: its fake implementation builds the saved list."""
    pytest.importorskip("cutlass")
    from flamia_cute.sm100.attention_fwd import reference_fwd_sm100

    fake_gpu(monkeypatch, 100)
    monkeypatch.setenv(interface.SM100_ENV, "1")
    calls = stub_sm100(monkeypatch, reference_fwd_sm100)
    (yc, gc), (y, g) = _compiled_and_eager(256, 2, "mxfp8")
    assert len(calls) == 2 and torch.equal(y, yc) and torch.equal(g, gc)


def test_bench_column_says_when_the_gpu_has_no_kernel_for_its_recipe(monkeypatch):
    from types import SimpleNamespace

    from flamia_cute.bench import Ours

    case = SimpleNamespace(device="cuda")
    fake_gpu(monkeypatch, 90)
    assert Ours("fp8_tokenblock", "cute").available(case) is None
    assert "no kernel" in Ours("mxfp8", "cute").available(case)
    fake_gpu(monkeypatch, 100)
    assert interface.SM100_ENV in Ours("mxfp8", "cute").available(case)
    monkeypatch.setenv(interface.SM100_ENV, "1")
    assert Ours("mxfp8", "cute").available(case) is None
    assert "no kernel" in Ours("fp8_tokenblock", "cute").available(case)


def test_sm90_rotations_with_cross_length_or_non_causal_fall_back_saying_why(monkeypatch):
    """RoPE and the Hadamard recipe are the kernels' for causal self-attention only (the backward's inverse
    rotations take self-attention positions): with cu_seqlens_k or causal=False the emulator runs them, and
    a plan asked for directly refuses them by name."""
    from flamia_cute.plan import make_plan
    from flamia_cute.rotary import RotaryConfig
    from flamia_cute.sm90.attention_bwd import BwdDsBf16Config

    fake_gpu(monkeypatch, 90)
    seen = record_backends(monkeypatch)
    q, k, v, _, cu, _ = make_inputs(LENGTHS, 2, 2, 128)
    cu_q = torch.tensor([0, 30, 31, 31, 60], dtype=torch.int32)  # each document's last queries
    L = int((cu[1:] - cu[:-1]).max())
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        flamia_attn_varlen_func(q, k, v, cu, cu, L, L, recipe="fp8_tokenblock_dsbf16", rotary=RotaryConfig())
        flamia_attn_varlen_func(q, k, v, cu, cu, L, L, causal=False, recipe="fp8_tokenblock_dsbf16",
                                rotary=RotaryConfig())
        flamia_attn_varlen_func(q[:60], k, v, cu_q, cu, 30, L, recipe="fp8_tokenblock_hadamard")
        flamia_attn_varlen_func(q[:60], k, v, cu_q, cu, 30, L, recipe="fp8_tokenblock_dsbf16")
    assert seen == ["cute", "emulate", "emulate", "cute"]
    msgs = fallback_warnings(rec)
    assert len(msgs) == 2, msgs
    assert "RoPE with cross-length or non-causal attention has no sm_90a kernel" in msgs[0]
    assert "'fp8_tokenblock_hadamard' (a Hadamard transform) with cross-length" in msgs[1]
    with pytest.raises(ValueError, match="RoPE with cross-length"):
        make_plan("fp8_tokenblock_dsbf16", 128, 4, 2, 300, 435, 4, causal=False, separate=True, rotary=("half", 128))
    with pytest.raises(ValueError, match="BwdDsBf16Config.rotary"):
        BwdDsBf16Config(head_dim=128, cross_length=True, rotary="half", rotary_dim=128)
