"""FLAMIA_FP8 as PyTorch's flash-attention implementation, through the dispatcher on the CPU (the emulator):
varlen_attn and SDPA give flamia_attn_varlen_func's outputs and gradients bit for bit, unsupported calls go to
the previous kernel with one warning per reason, and restore_flash_attention_impl removes us."""

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import current_flash_attention_impl, list_flash_attention_impls, restore_flash_attention_impl
from torch.nn.attention.varlen import AuxRequest, varlen_attn

import flamia_cute.torch_backend as tb
from flamia_cute import flamia_attn_varlen_func
from flamia_cute.testing import cu_seqlens_from_lengths

GQA = "enable_gqa" in inspect.signature(varlen_attn).parameters  # torch >= 2.12; older varlen_attn: equal heads


@pytest.fixture
def active(monkeypatch):
    monkeypatch.setattr(tb, "_WARNED", set())
    tb.activate()
    yield
    restore_flash_attention_impl()


def _rand(*shape, seed, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def _ours(q, k, v, cu_q, cu_k, max_q, max_k, do, causal=True, scale=None):
    q, k, v = _leaves(q, k, v)
    out, lse = flamia_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=causal, return_lse=True)
    out.backward(do)
    return out, lse, q.grad, k.grad, v.grad


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, do, causal=True, scale=None):
    q, k, v = _leaves(q, k, v)
    kw = ({"enable_gqa": True} if GQA else {}) | ({"scale": scale} if scale is not None else {})
    out, lse = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, 0) if causal else (-1, -1),
                           return_aux=AuxRequest(lse=True), **kw)
    out.backward(do)
    return out, lse, q.grad, k.grad, v.grad


def _bitwise(got, want):
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert torch.equal(a, b), f"{name} differs (max {(a.float() - b.float()).abs().max():.3e})"


def test_registered_and_restored():
    assert tb.IMPL_NAME in list_flash_attention_impls()
    tb.activate()
    try:
        assert current_flash_attention_impl() == tb.IMPL_NAME
    finally:
        restore_flash_attention_impl()
    assert current_flash_attention_impl() is None
    with pytest.raises(ValueError, match="unknown name"):
        tb.activate("no_such_recipe")


@pytest.mark.parametrize("cudnn_sdp", [True, False])
def test_activation_on_a_gpu_says_how_sdpa_reaches_us(monkeypatch, cudnn_sdp):
    """On a CUDA machine whose SDPA may choose cuDNN's attention, activation warns once how to route SDPA to the
    flash path (SDPA picks its backend before our kernels see the call); with cuDNN's SDPA off it says nothing."""
    monkeypatch.setattr(tb, "_WARNED", set())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: cudnn_sdp)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tb.activate()
        restore_flash_attention_impl()
        tb.activate()
        restore_flash_attention_impl()
    said = [str(m.message) for m in w if "sdpa_kernel(SDPBackend.FLASH_ATTENTION)" in str(m.message)]
    assert len(said) == (1 if cudnn_sdp else 0), said


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_attn_is_our_call_bit_for_bit(active, causal):
    lengths, hk = [100, 37, 1, 0, 200], 2 if GQA else 4
    cu, T = cu_seqlens_from_lengths(lengths), sum(lengths)
    q, k, v, do = _rand(T, 4, 64, seed=1), _rand(T, hk, 64, seed=2), _rand(T, hk, 64, seed=3), _rand(T, 4, 64, seed=4)
    _bitwise(_varlen(q, k, v, cu, cu, 200, 200, do, causal), _ours(q, k, v, cu, cu, 200, 200, do, causal))


def test_varlen_attn_passes_the_scale(active):
    """A softmax scale other than 1/sqrt(d) reaches our call (and a call ignoring it would differ)."""
    lengths, hk = [100, 37, 200], 2 if GQA else 4
    cu, T = cu_seqlens_from_lengths(lengths), sum(lengths)
    q, k, v, do = _rand(T, 4, 64, seed=5), _rand(T, hk, 64, seed=6), _rand(T, hk, 64, seed=7), _rand(T, 4, 64, seed=8)
    got = _varlen(q, k, v, cu, cu, 200, 200, do, scale=0.3)
    _bitwise(got, _ours(q, k, v, cu, cu, 200, 200, do, scale=0.3))
    assert not torch.equal(got[0], _ours(q, k, v, cu, cu, 200, 200, do)[0])


def test_varlen_attn_cross_length_runs_the_emulator_bit_for_bit(active):
    cu_q, cu_k = cu_seqlens_from_lengths([50, 7, 130]), cu_seqlens_from_lengths([300, 7, 260])
    hk = 2 if GQA else 4
    q, k, v, do = _rand(187, 4, 128, seed=5), _rand(567, hk, 128, seed=6), _rand(567, hk, 128, seed=7), \
        _rand(187, 4, 128, seed=8)
    _bitwise(_varlen(q, k, v, cu_q, cu_k, 130, 300, do), _ours(q, k, v, cu_q, cu_k, 130, 300, do))


def test_fp16_forward_bit_for_bit_and_gradients_from_the_returned_output(active):
    """fp16: the backward's bf16 O is the returned fp16 O converted back (custom_ops.saved_from_inputs)."""
    cu = cu_seqlens_from_lengths([129, 64])
    q, k, v, do = (_rand(193, 4, 64, seed=s, dtype=torch.float16) for s in (9, 10, 11, 12))
    got, want = _varlen(q, k, v, cu, cu, 129, 129, do), _ours(q, k, v, cu, cu, 129, 129, do)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for a, b in zip(got[2:], want[2:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_is_our_call_bit_for_bit(active, causal):
    B, L, S = 3, 160, 160 if causal else 96
    q, do = _rand(B, 4, L, 128, seed=13), _rand(B, 4, L, 128, seed=14)
    k, v = _rand(B, 2, S, 128, seed=15), _rand(B, 2, S, 128, seed=16)
    qs, ks, vs = _leaves(q, k, v)
    out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=True)
    out.backward(do)

    def thd(t):
        return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])

    cu_q, cu_k = cu_seqlens_from_lengths([L] * B), cu_seqlens_from_lengths([S] * B)
    o, _, dq, dk, dv = _ours(thd(q), thd(k), thd(v), cu_q, cu_k, L, S, thd(do), causal)
    for a, b in ((out, o), (qs.grad, dq), (ks.grad, dk), (vs.grad, dv)):
        assert torch.equal(thd(a), b)


def test_unsupported_calls_run_the_previous_kernel_warning_once_per_reason(active):
    x = _rand(2, 2, 48, 96, seed=17)
    mask = torch.ones(48, 48, dtype=torch.bool).tril()
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = [F.scaled_dot_product_attention(x, x, x, is_causal=True) for _ in range(2)]
            x64 = x[..., :64].contiguous()
            got_mask = [F.scaled_dot_product_attention(x64, x64, x64, attn_mask=mask) for _ in range(2)]
            got_fp32 = F.scaled_dot_product_attention(x64.float(), x64.float(), x64.float(), is_causal=True)
        msgs = [str(m.message) for m in w if tb.IMPL_NAME in str(m.message)]
        restore_flash_attention_impl()
        want = F.scaled_dot_product_attention(x, x, x, is_causal=True)
        want_mask = F.scaled_dot_product_attention(x64, x64, x64, attn_mask=mask)
        want_fp32 = F.scaled_dot_product_attention(x64.float(), x64.float(), x64.float(), is_causal=True)
    assert all(torch.equal(g, want) for g in got) and all(torch.equal(g, want_mask) for g in got_mask)
    assert torch.equal(got_fp32, want_fp32)
    assert len(msgs) == 3, msgs
    assert "head_dim 96" in msgs[0] and "attention mask" in msgs[1] and "torch.float32" in msgs[2]


def test_reasons_without_a_previous_kernel_raise_naming_them(active):
    """The varlen flash op has no CPU kernel of torch's own: a call we cannot run says why."""
    cu = cu_seqlens_from_lengths([16])
    x = _rand(16, 2, 64, seed=18)
    with pytest.raises(NotImplementedError, match="dropout_p=0.1"):
        torch.ops.aten._flash_attention_forward(x, x, x, cu, cu, 16, 16, 0.1, True, False)
    with pytest.raises(NotImplementedError, match="sliding window"):
        torch.ops.aten._flash_attention_forward(x, x, x, cu, cu, 16, 16, 0.0, True, False, window_size_left=4,
                                                window_size_right=0)
    with pytest.raises(NotImplementedError, match="cum_seq_k is None"):
        torch.ops.aten._flash_attention_forward(x, x, x, cu, None, 16, 16, 0.0, True, False)
    with pytest.raises(NotImplementedError, match="key or value head dims"):
        torch.ops.aten._flash_attention_forward(x, x, _rand(16, 2, 128, seed=19), cu, cu, 16, 16, 0.0, True, False)


def test_dense_flash_forward_has_the_meta_strides(active):
    """A dense (B, S, H, D) query that is a transposed (B, H, S, D) tensor: the output has empty_like(q)'s
    strides, which the op's meta function gives and torch.compile assumes."""
    q = _rand(2, 4, 32, 64, seed=20).transpose(1, 2)  # (B, S, H, D), not contiguous
    k = v = _rand(2, 2, 32, 64, seed=21).transpose(1, 2)
    out = torch.ops.aten._flash_attention_forward(q, k, v, None, None, 32, 32, 0.0, True, False)[0]
    assert out.stride() == torch.empty_like(q).stride()


@pytest.mark.parametrize("what", ["varlen", "sdpa"])
def test_compiles_fullgraph_and_matches_eager(active, what):
    cu = cu_seqlens_from_lengths([100, 37, 200])
    q, k, v = (_rand(337, 4, 64, seed=s) for s in (19, 20, 21))

    def fn(q, k, v):
        if what == "varlen":
            return varlen_attn(q, k, v, cu, cu, 200, 200, window_size=(-1, 0))
        return F.scaled_dot_product_attention(*(t.view(1, 337, 4, 64).transpose(1, 2) for t in (q, k, v)),
                                              is_causal=True)

    def direct(q, k, v):  # our call: the packed documents, or SDPA's one causal row
        c = cu if what == "varlen" else cu_seqlens_from_lengths([337])
        out = flamia_attn_varlen_func(q, k, v, c, c, 200 if what == "varlen" else 337, 200 if what == "varlen" else 337)
        return out if what == "varlen" else out.view(1, 337, 4, 64).transpose(1, 2)

    results = []
    for f in (fn, torch.compile(fn, backend="aot_eager", fullgraph=True), direct):
        leaves = _leaves(q, k, v)
        out = f(*leaves)
        results.append((out, *torch.autograd.grad(out.float().square().sum(), leaves)))
    for a, b, c in zip(*results, strict=True):  # compiled = eager = our direct call (the op is ours)
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("recipe", ["fp8_tokenblock_dsbf16", "fp8_tokenblock", "mxfp8", "fp8_tensor_current",
                                    "fp8_tokenblock_hadamard"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_saved_from_inputs_is_the_forward_saved_list(recipe, dtype):
    """Quantizing again gives the forward's saved operands byte for byte: the torch backend's backward premise."""
    from flamia_cute.custom_ops import run_forward, saved_from_inputs

    cu = cu_seqlens_from_lengths([300, 1, 129])
    q, k, v = _rand(430, 4, 128, seed=22, dtype=dtype), _rand(430, 2, 128, seed=23, dtype=dtype), \
        _rand(430, 2, 128, seed=24, dtype=dtype)
    out, _, saved = run_forward(q, k, v, cu, cu, 300, 300, 0.088, True, recipe, "emulate")
    again = saved_from_inputs(q, k, v, out, cu, cu, 300, 300, recipe, "emulate")
    assert len(again) == len(saved)
    for i, (a, b) in enumerate(zip(again, saved, strict=True)):
        if i == 0 and dtype == torch.float16:  # the bf16 O from the fp16 output: equal where |O| >= 2^-17
            big = b.float().abs() >= 2**-17
            assert torch.equal(a[big], b[big])
            continue
        assert torch.equal(a, b), f"saved entry {i} differs"
