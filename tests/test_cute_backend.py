"""Routing of flamia_attn_varlen_func to the sm_90a kernels, and the kernel path end to end on the GPU."""

import pytest
import torch

from flamia_cute import NAMED_RECIPES, flamia_attn_varlen_func
from flamia_cute.interface import pick_backend
from flamia_cute.plan import has_backward_kernel, kernel_scaling, why_not_kernels
from flamia_cute.testing import attention_fn_for, check_leakage, make_inputs, rel_l2


def test_kernel_recipes_and_reasons():
    assert kernel_scaling(NAMED_RECIPES["fp8_tokenblock"]) == "tokenblock"
    assert kernel_scaling(NAMED_RECIPES["fp8_token"]) == "token"
    assert kernel_scaling(NAMED_RECIPES["fp8_tokenblock_dsbf16"]) == "tokenblock"
    assert kernel_scaling(NAMED_RECIPES["fp8_tensor_current"]) == "tensor"
    assert kernel_scaling(NAMED_RECIPES["mxfp8"]) is None
    # a custom recipe under a kernel recipe's name is not that recipe
    assert kernel_scaling(NAMED_RECIPES["fp8_token"].with_(p_scale=128.0)) is None
    assert has_backward_kernel(NAMED_RECIPES["fp8_tokenblock_dsbf16"]) and has_backward_kernel(
        NAMED_RECIPES["fp8_tensor_current"])
    assert not has_backward_kernel(NAMED_RECIPES["fp8_tokenblock"])
    q, k, v, _, cu, _ = make_inputs([5, 7], 2, 2, 128)
    assert why_not_kernels(NAMED_RECIPES["fp8_tokenblock"], True, q, k, cu, cu) is None
    assert why_not_kernels(NAMED_RECIPES["fp8_tensor_current"], True, q, k, cu, cu) is None
    assert "mxfp8" in why_not_kernels(NAMED_RECIPES["mxfp8"], True, q, k, cu, cu)
    # non-causal and cross-length calls run the forward kernel's separate-keys builds
    other = torch.tensor([0, 6, 12], dtype=torch.int32)
    assert why_not_kernels(NAMED_RECIPES["fp8_token"], False, q, k, cu, cu) is None
    assert why_not_kernels(NAMED_RECIPES["fp8_token"], True, q, k, cu, other) is None
    assert "head_dim" in why_not_kernels(NAMED_RECIPES["fp8_token"], False, *make_inputs([5, 7], 2, 2, 256)[:2], cu, cu)


def test_auto_falls_back_to_the_emulator_without_a_gpu():
    assert pick_backend("auto", torch.device("cpu")) == "emulate"
    with pytest.raises(NotImplementedError, match="sm_90"):
        pick_backend("cute", torch.device("cpu"))
    assert pick_backend("auto", torch.device("cpu"), "some reason") == "emulate"


def test_plans_are_built_once_per_signature_and_switch(monkeypatch):
    """A call's Plan is memoized (tuned.derived_memo): a repeat call builds nothing, a switch that
    changes its configs (FLAMIA_CUTE_NO_TUNING, the deterministic mode) builds anew, and the memo
    stays bounded."""
    pytest.importorskip("cutlass")
    import flamia_cute.sm90.attention_fwd as fwd
    from flamia_cute import tuned
    from flamia_cute.plan import make_plan

    builds = []
    real = fwd.short_pairs_default
    monkeypatch.setattr(fwd, "short_pairs_default", lambda *a: builds.append(a) or real(*a))
    monkeypatch.delenv("FLAMIA_CUTE_NO_TUNING", raising=False)
    monkeypatch.delenv("FLAMIA_CUTE_DETERMINISTIC", raising=False)
    # (recipe, head_dim, heads_q, heads_kv, max_seqlen, tokens, docs)
    args = ("fp8_tokenblock_dsbf16", 128, 4, 2, 1000, 5000, 7)
    plain = make_plan(*args)
    assert make_plan(*args) is plain and len(builds) == 1
    assert plain.block == 128 and plain.bwd is not None and not plain.bwd.deterministic
    assert not plain.qkv.parts[0].emit_transposed and not plain.qkv.parts[2].emit_token_major
    monkeypatch.setenv("FLAMIA_CUTE_NO_TUNING", "1")
    make_plan(*args)
    assert len(builds) == 2
    monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", "1")
    assert make_plan(*args).bwd.deterministic and len(builds) == 3
    assert make_plan("fp8_tokenblock", *args[1:]).bwd is None  # e4m3 dS: the emulator's backward
    assert make_plan("fp8_tensor_current", *args[1:]).block == 1
    monkeypatch.setattr(tuned, "DERIVED_MEMO_MAX", 3)
    for docs in range(1, 6):
        make_plan("fp8_tokenblock_dsbf16", 128, 4, 2, 1000, 5000, docs)
        assert len(tuned.derived_memo()) <= 3


LENGTHS = [1000, 1, 0, 517, 4096, 33, 129]


def test_per_tensor_operands_fill_one_fused_layout():
    """fp8_tensor_current on the kernels: quant.quantize_thd_per_tensor of Q, K, V written into ONE
    allocation laid out as the per-token Q/K/V launch of its plan (the custom op saves it whole)."""
    pytest.importorskip("cutlass")
    from flamia_cute.cute_backend import quantize_per_tensor
    from flamia_cute.plan import make_plan
    from flamia_cute.quant import quantize_thd_per_tensor

    q, k, v, _, cu, _ = make_inputs([70, 1, 0, 200], 4, 2, 64, seed=3)
    plan = make_plan("fp8_tensor_current", 64, 4, 2, 200, q.shape[0], 4)
    qq, (kq, kt), (vq, vt) = quantize_per_tensor(q, k, v, cu, plan.qkv)
    assert kt is None and vt is None
    storage = qq.scale.untyped_storage().data_ptr()
    parts = plan.qkv.parts
    for got, x, part in zip((qq, kq, vq), (q, k, v), parts, strict=True):
        want = quantize_thd_per_tensor(x, cu, transposed=part.emit_transposed, pv_order=part.dt_pv_order)
        assert got.block_tokens == 1 and got.dt_pv_order == want.dt_pv_order
        assert torch.equal(got.scale, want.scale)
        for f in ("data_td", "data_dt", "scale"):
            t = getattr(got, f)
            if t is None:
                continue
            assert t.untyped_storage().data_ptr() == storage, f
            w = getattr(want, f)
            assert torch.equal(t.view(torch.uint8), w.view(torch.uint8)), f
    layouts = [(t.data_td is None, t.data_dt is None) for t in (qq, kq, vq)]
    assert layouts == [(False, True), (False, True), (True, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8_tokenblock_dsbf16", "fp8_tensor_current"])
def test_fp16_inputs_run_the_kernels_on_their_bf16_rounding(recipe, monkeypatch):
    """fp16 Q, K, V and dO on the kernels (no fallback warning): the results of their bf16 rounding, in fp16."""
    import flamia_cute.interface as iface

    monkeypatch.setattr(iface, "_WARNED", set())
    q, k, v, do, cu, scale = make_inputs(LENGTHS, 4, 2, 128, device="cuda", seed=8, dtype=torch.float16)
    got = attention_fn_for(recipe, scale, backend="auto")(q, k, v, cu, do)
    assert not iface._WARNED, iface._WARNED  # no fallback to the emulator
    ref = attention_fn_for(recipe, scale, backend="cute")(*(t.bfloat16() for t in (q, k, v)), cu, do.bfloat16())
    for name in ("out", "dk", "dv"):
        assert got[name].dtype == torch.float16 and torch.equal(got[name], ref[name].half()), name
    assert rel_l2(got["dq"], ref["dq"]) < 1e-5  # dQ's fp32 reduce-adds land in any order


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8_tokenblock", "fp8_token", "fp8_tensor_current", "fp8_tokenblock_dsbf16"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
def test_kernel_path_matches_emulator(recipe, heads):
    q, k, v, do, cu, scale = make_inputs(LENGTHS, *heads, 128, device="cuda", seed=2)
    got = attention_fn_for(recipe, scale, backend="cute")(q, k, v, cu, do)
    ref = attention_fn_for(recipe, scale, backend="emulate")(q, k, v, cu, do)
    # forward: fp32-accumulation-order noise and Hopper's reduced-precision FP8 accumulation (see the
    # forward kernel's tests for the derivation); backward: the emulator from the kernel's own operands
    assert rel_l2(got["out"], ref["out"]) < 8e-3
    for name in ("dq", "dk", "dv"):
        assert rel_l2(got[name], ref[name]) < 2e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8_tokenblock_dsbf16"])
def test_training_call_replays_from_a_cuda_graph(recipe, monkeypatch):
    """The training call (forward + backward) never synchronizes, so a CUDA graph captures it (as
    `bench --graph` and graph-captured training steps do): a replay on new values copied into the
    captured inputs gives bitwise the eager call's O and (deterministic) gradients on those values."""
    monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", "1")
    q, k, v, do, cu, scale = make_inputs(LENGTHS, 4, 2, 128, device="cuda", seed=5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mx = max(LENGTHS)

    def step():
        out = flamia_attn_varlen_func(*leaves, cu, cu, mx, mx, scale, recipe=recipe)
        return (out, *torch.autograd.grad(out, leaves, do))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream (compiles, checks cu_seqlens once)
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    q2, k2, v2, do2, _, _ = make_inputs(LENGTHS, 4, 2, 128, device="cuda", seed=6)
    with torch.no_grad():
        for leaf, new in zip(leaves, (q2, k2, v2), strict=True):
            leaf.copy_(new)
        do.copy_(do2)
    graph.replay()
    want = step()
    for name, got, ref in zip(("out", "dq", "dk", "dv"), captured, want, strict=True):
        assert torch.equal(got, ref), name


@pytest.mark.gpu
def test_auto_routes_to_the_kernels_on_sm90(monkeypatch):
    import flamia_cute.cute_backend as cb

    calls = []
    real = cb.forward
    monkeypatch.setattr(cb, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, _, cu, scale = make_inputs([300, 44], 2, 2, 128, device="cuda")
    flamia_attn_varlen_func(q, k, v, cu, cu, 300, 300)
    assert calls, "backend='auto' did not use the sm_90a kernels"


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8_tokenblock", "fp8_token", "fp8_tokenblock_dsbf16"])
def test_kernel_path_is_leak_free(recipe):
    q, k, v, do, cu, scale = make_inputs(LENGTHS, 2, 2, 128, device="cuda", seed=4)
    # O and LSE bit-identical; gradients within the run-to-run spread of the backward's fp32 dQ atomics
    for cut in (None, 128, 129, 1001):
        rep = check_leakage(attention_fn_for(recipe, scale, backend="cute"), q, k, v, cu, do, doc=4, cut=cut,
                            grad_tol=2e-2)
        assert rep.ok, str(rep)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cute", "emulate"])
def test_leaky_control_fails_on_the_gpu_path(backend):
    """The same check run on the leaky recipe on the kernels (per-tensor scales) and on the emulator
    on the GPU must fail."""
    q, k, v, do, cu, scale = make_inputs(LENGTHS, 2, 2, 128, device="cuda", seed=4)
    rep = check_leakage(attention_fn_for("fp8_tensor_current", scale, backend=backend), q, k, v, cu, do, doc=4)
    assert not rep.ok


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4_fp8", "fp8_tensor_current", "bf16"])
def test_emulated_recipes_are_finite_on_the_gpu(recipe):
    """GPU math may flush fp32 denormals: the emulator must not produce NaN there (it once did for MX)."""
    q, k, v, do, cu, scale = make_inputs([300, 1, 130], 2, 2, 128, device="cuda", seed=6)
    res = attention_fn_for(recipe, scale, backend="emulate")(q, k, v, cu, do)
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert torch.isfinite(res[name].float()).all(), name


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8_tokenblock", "fp8_token", "fp8_tensor_current"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_forward_without_grad_matches_the_training_call(recipe, heads):
    """No backward to come (no_grad or no input requiring grad): the same plan and kernels, nothing
    saved; out and lse bitwise those of the training call."""
    q, k, v, _, cu, scale = make_inputs(LENGTHS, *heads, 128, device="cuda", seed=7)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    train_out, train_lse = flamia_attn_varlen_func(*leaves, cu, cu, max(LENGTHS), max(LENGTHS), scale, recipe=recipe,
                                                   return_lse=True)
    with torch.no_grad():
        out, lse = flamia_attn_varlen_func(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), scale, recipe=recipe,
                                           return_lse=True)
    assert out.grad_fn is None
    assert torch.equal(out.view(torch.int16), train_out.detach().view(torch.int16))
    assert torch.equal(lse, train_lse.detach())


def test_deterministic_backward_switch(monkeypatch):
    """torch.use_deterministic_algorithms(True) or FLAMIA_CUTE_DETERMINISTIC=1 selects the ordered dQ."""
    from flamia_cute.plan import deterministic_backward

    monkeypatch.delenv("FLAMIA_CUTE_DETERMINISTIC", raising=False)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        assert not deterministic_backward()
        torch.use_deterministic_algorithms(True)
        assert deterministic_backward()
        torch.use_deterministic_algorithms(False)
        monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", "1")
        assert deterministic_backward()
        monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", "yes")
        with pytest.raises(ValueError, match="FLAMIA_CUTE_DETERMINISTIC"):
            deterministic_backward()
    finally:
        torch.use_deterministic_algorithms(was)
