"""flamia_cute::varlen_fwd / varlen_bwd: torch.library custom ops with fake implementations, so
torch.compile(fullgraph=True) traces models that call flamia_attn_varlen_func."""

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from flamia_cute import NAMED_RECIPES, flamia_attn_varlen_func
from flamia_cute.custom_ops import recipe_key, saved_layout, varlen_bwd, varlen_fwd
from flamia_cute.quant import QuantizedTHD, transposed_tokens
from flamia_cute.testing import TinyBlock, attention_fn_for, make_inputs

LENGTHS = [5, 40, 0, 19]


def _args(recipe, backend="emulate", heads=(4, 2), head_dim=64, dtype=torch.bfloat16, device="cpu", grad=True):
    q, k, v, do, cu, scale = make_inputs(LENGTHS, *heads, head_dim, device=device, dtype=dtype, seed=1)
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return (q, k, v, cu, cu.clone(), max(LENGTHS), max(LENGTHS), scale, True, recipe, backend), do


@pytest.mark.parametrize("recipe", ["fp8_tokenblock", "bf16", "mxfp8"])
def test_opcheck_forward(recipe):
    args, _ = _args(recipe)
    torch.library.opcheck(varlen_fwd, args)


@pytest.mark.parametrize("recipe", ["fp8_tokenblock", "bf16", "mxfp8"])
def test_opcheck_backward(recipe):
    args, do = _args(recipe, grad=False)
    out, lse, saved = varlen_fwd(*args)
    q, k, v, cu_q, cu_k, mq, mk, scale, causal, name, backend = args
    torch.library.opcheck(varlen_bwd, (do, out, lse, saved, cu_q, cu_k, mq, mk, scale, causal, name, backend))


@pytest.mark.parametrize("recipe", ["fp8_tokenblock", "fp8_token", "bf16", "mxfp8", "nvfp4_fp8", "fp8_tensor_current"])
def test_saved_tensors_match_the_layout_and_hold_no_inputs(recipe):
    args, _ = _args(recipe, grad=False)
    out, lse, saved = varlen_fwd(*args)
    layout = saved_layout(recipe, "emulate", True)
    assert len(saved) == len(layout)
    for (name, kind), t in zip(layout, saved, strict=True):
        assert (t.numel() == 0) == (kind is None), (name, kind, tuple(t.shape))
        assert t.dtype != torch.bfloat16, "a bf16 tensor is saved"
    with FakeTensorMode() as mode:
        fargs = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        fout, flse, fsaved = varlen_fwd(*fargs)
    for real, fake in zip((out, lse, *saved), (fout, flse, *fsaved), strict=True):
        assert (real.shape, real.dtype) == (fake.shape, fake.dtype)


@pytest.mark.parametrize("recipe", ["fp8_tokenblock", "fp8_token", "fp8_tokenblock_dsbf16"])
def test_kernel_layout_fake(recipe):
    """The kernel backend's saved list (FP8 data in both layouts and scales), from the fake impl alone."""
    args, _ = _args(recipe, backend="cute", grad=False)
    with FakeTensorMode() as mode:
        fargs = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        out, lse, saved = varlen_fwd(*fargs)
        T, H, D = fargs[0].shape
        Tk, Hk, _ = fargs[1].shape
        tdt = transposed_tokens(Tk, len(LENGTHS))
        dq, dk, dv = varlen_bwd(out, out, lse, saved, *fargs[3:])
    assert (out.shape, out.dtype, lse.shape) == ((T, H, D), torch.bfloat16, (H, T))
    # [out placeholder, the one Q/K/V buffer, K's (0, Tk, Hk, D) shape carrier]: no two outputs alias
    assert len(saved) == 3 and saved[0].numel() == 0
    buf, k_shape = saved[1], saved[2]
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and k_shape.shape == (0, Tk, Hk, D)
    sets = 1 if recipe == "fp8_token" else 2
    # the forward's layouts, all that either backward reads: Q and K token-major, V transposed only (the
    # per-token copies too when block > 1); no Q^T, K^T or token-major V
    per = lambda h: T * h * D + h * D * tdt + 4 * h * T  # noqa: E731
    td_only = lambda h: T * h * D + 4 * h * T  # noqa: E731
    dt_only = lambda h: h * D * tdt + 4 * h * T  # noqa: E731
    assert td_only(H) + sets * (td_only(Hk) + dt_only(Hk)) <= buf.shape[0]
    assert buf.shape[0] < td_only(H) + sets * (td_only(Hk) + per(Hk))
    assert (dq.shape, dk.shape, dv.shape) == ((T, H, D), (Tk, Hk, D), (Tk, Hk, D))


@pytest.mark.parametrize("recipe, block", [("fp8_tokenblock", 128), ("fp8_token", 1), ("fp8_tensor_current", 0),
                                           ("fp8_tokenblock_dsbf16", 128)])
def test_kernel_pack_unpack_round_trip(recipe, block):
    """The forward saves the ONE buffer of the Q/K/V launch; the backward rebuilds the same views
    (shapes, strides, byte offsets, P-fragment flags) from it and K's shape carrier."""
    pytest.importorskip("cutlass")
    from flamia_cute.custom_ops import _pack_kernel, _unpack_kernel
    from flamia_cute.sm90.quantize import _alloc_outputs, forward_only, qkv_config

    T, docs, Hq, Hk, D = 300, 3, 4, 2, 128
    tdt = transposed_tokens(T, docs)
    lb = max(block, 1)  # the per-tensor recipe uses the per-token layouts
    cfg = forward_only(qkv_config(D, Hq, Hk, lb))
    (qs,), ks, vs = _alloc_outputs(cfg, T, tdt, "cpu")
    storage = qs[0].untyped_storage()
    torch.manual_seed(0)
    storage.copy_(torch.randint(0, 255, (storage.nbytes(),), dtype=torch.uint8).untyped_storage())

    def thd(views, c, b):
        return QuantizedTHD(*views, b, "e4m3", c.dt_pv_order)

    qc, kc, vc = cfg.parts
    quantized = (thd(qs, qc, 1), (thd(ks[0], kc, lb), thd(ks[1], kc, 1) if block > 1 else None),
                 (thd(vs[0], vc, lb), thd(vs[1], vc, 1) if block > 1 else None))
    layout = saved_layout(recipe, "cute", True)
    saved = _pack_kernel(layout, torch.zeros(T, Hq, D, dtype=torch.bfloat16), quantized)
    assert len(saved) == len(layout) == 3
    # the size the fake implementation promises (torch.compile checks real outputs against it)
    from flamia_cute.custom_ops import _qkv_plan

    assert saved[1].shape == (_qkv_plan(T, docs, Hq, Hk, D, recipe)[1],) and saved[2].shape == (0, T, Hk, D)
    ptrs = [t.untyped_storage().data_ptr() for t in saved if t.numel()]
    assert len(ptrs) == len(set(ptrs)), "saved outputs alias each other"
    got = _unpack_kernel(saved, recipe, T, docs, Hq)
    want = (quantized[0], quantized[1][0], quantized[2][0], quantized[1][1], quantized[2][1])
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
            continue
        assert (g.block_tokens, g.dt_pv_order) == (w.block_tokens, w.dt_pv_order)
        for f in ("data_td", "data_dt", "scale"):
            a, b = getattr(g, f), getattr(w, f)
            if b is None:  # a layout this recipe's launch does not write
                assert a is None, f
                continue
            assert a.shape == b.shape and a.stride() == b.stride() and a.data_ptr() == b.data_ptr()
    assert all(t.data_dt is None for t in (got[0], got[1], got[3]) if t is not None)
    assert all(v.data_td is None and v.data_dt is not None and v.dt_pv_order for v in (got[2], got[4]) if v is not None)
    # a buffer too small for the layout is refused, not read out of bounds
    with pytest.raises(RuntimeError, match="layout needs"):
        _unpack_kernel([saved[0], saved[1][:100], saved[2]], recipe, T, docs, Hq)


@pytest.mark.parametrize("recipe", ["fp8_tokenblock_dsbf16", "fp8_token"])
@pytest.mark.parametrize("Tq, Tk", [(300, 300), (200, 457), (457, 200), (0, 90)])
def test_separate_keys_layout(recipe, Tq, Tk):
    """K and V with their own documents (cross-length, non-causal): Q's outputs for Tq tokens, then K's and V's
    for Tk (their transposed copies over the key documents), in one buffer the fake implementations size from the
    shapes alone; with Tq == Tk the one-launch plan (same offsets), so the layout never depends on cu_seqlens'
    values. The backward unpacks the views from the buffer and the (0, Tk, Hk, D) carrier."""
    pytest.importorskip("cutlass")
    from flamia_cute.custom_ops import _pack_kernel, _qkv_launch, _qkv_plan, _unpack_kernel
    from flamia_cute.quant import output_views
    from flamia_cute.sm90.quantize import _layout_outputs, qkv_layout_outputs, quantized_outputs

    docs, Hq, Hk, D = 3, 4, 2, 64
    cfg = _qkv_launch(Hq, Hk, D, recipe)
    plan, nbytes = qkv_layout_outputs(cfg, Tq, Tk, docs)
    assert (plan, nbytes) == _qkv_plan(Tq, docs, Hq, Hk, D, recipe, Tk)
    if Tq == Tk:
        assert (plan, nbytes) == _layout_outputs(cfg, Tq, transposed_tokens(Tq, docs))
    ends = []
    for part, T in zip(plan, (Tq, Tk, Tk), strict=True):
        for st in part:
            for e in st:
                if e is not None:
                    assert e[1][0] == T or e[1][-1] in (T, transposed_tokens(T, docs)), e
                    ends.append((e[3], e[3] + math.prod(e[1]) * (1 if e[0] == "f8" else 4)))
    ends.sort()
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:], strict=False)) and ends[-1][1] <= nbytes  # no overlap
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    quantized = quantized_outputs(cfg, output_views(buf, plan))
    (qq, _), (kq, kt), (vq, vt) = quantized
    saved = _pack_kernel(saved_layout(recipe, "cute", True), torch.zeros(Tq, Hq, D, dtype=torch.bfloat16),
                         (qq, (kq, kt), (vq, vt)))
    assert saved[2].shape == (0, Tk, Hk, D)
    got = _unpack_kernel(saved, recipe, Tq, docs, Hq)
    for g, w in zip(got, (qq, kq, vq, kt, vt), strict=True):
        assert (g is None) == (w is None)
        for f in ("data_td", "data_dt", "scale") if w is not None else ():
            a, b = getattr(g, f), getattr(w, f)
            assert (a is None and b is None) or (a.shape == b.shape and a.data_ptr() == b.data_ptr())
    args = (torch.zeros(Tq, Hq, D, dtype=torch.bfloat16), torch.zeros(Tk, Hk, D, dtype=torch.bfloat16),
            torch.zeros(Tk, Hk, D, dtype=torch.bfloat16), torch.tensor([0, Tq, Tq, Tq], dtype=torch.int32),
            torch.tensor([0, 0, Tk, Tk], dtype=torch.int32), Tq, Tk, 0.125, False, recipe, "cute")
    with FakeTensorMode() as mode:
        fargs = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        out, lse, fsaved = varlen_fwd(*fargs)
        dq, dk, dv = varlen_bwd(out, out, lse, fsaved, *fargs[3:])
    assert fsaved[1].shape == (nbytes,) and fsaved[2].shape == (0, Tk, Hk, D)
    assert (dq.shape, dk.shape, dv.shape) == ((Tq, Hq, D), (Tk, Hk, D), (Tk, Hk, D))


@pytest.mark.parametrize("recipe", ["fp8_tokenblock", "fp8_token", "bf16", "mxfp8", "nvfp4_fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_custom_op_path_matches_the_autograd_function_bit_for_bit(recipe, dtype):
    """The compiled route (the custom ops) and the eager one (Attention) run the same call."""
    from flamia_cute.custom_ops import attention

    q, k, v, do, cu, scale = make_inputs([3, 130, 0, 17], 4, 2, 64, dtype=dtype, seed=3)
    a = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flamia_attn_varlen_func(*a, cu, cu, 130, 130, recipe=recipe, backend="emulate", return_lse=True)
    out.backward(do)
    b = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention(*b, cu, cu, 130, 130, scale, True, recipe, "emulate")
    ref_out.backward(do)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.grad, y.grad)
    assert not lse.requires_grad


@pytest.mark.parametrize("recipe", ["fp8_tokenblock_dsbf16", "fp8_token", "mxfp8"])
def test_fp16_inputs_are_their_bf16_rounding(recipe):
    """fp16 is rounded to bf16 on every backend (the kernels quantize bf16): on the emulator, too, its results
    are those of the rounded inputs, returned in fp16, so the emulator still defines the kernels' numerics."""
    q, k, v, do, cu, _ = make_inputs([3, 130, 0, 17], 4, 2, 64, dtype=torch.float16, seed=6)
    fn = attention_fn_for(recipe, backend="emulate")
    got = fn(q, k, v, cu, do)
    ref = fn(*(t.bfloat16() for t in (q, k, v)), cu, do.bfloat16())
    for name in ("out", "dq", "dk", "dv"):
        assert got[name].dtype == torch.float16 and torch.equal(got[name], ref[name].half()), name
    assert torch.equal(got["lse"], ref["lse"])


def test_custom_recipes_take_the_same_path_by_key():
    """A custom recipe (here one that reuses a named recipe's name with other fields) runs the same
    path as the named ones, under a key that names its fields: never the named recipe's numerics."""
    rec = NAMED_RECIPES["fp8_token"].with_(ds_cast="bf16")
    assert recipe_key(rec) != "fp8_token" and recipe_key(NAMED_RECIPES["fp8_token"]) == "fp8_token"
    q, k, v, do, cu, _ = make_inputs([7, 9], 2, 2, 64, seed=5)
    grads = []
    for r in (rec, "fp8_token"):
        qq = q.clone().requires_grad_()
        out = flamia_attn_varlen_func(qq, k, v, cu, cu, 9, 9, recipe=r, backend="emulate")
        assert type(out.grad_fn).__name__.startswith("Attention")
        out.backward(do)
        grads.append(qq.grad)
    assert not torch.equal(*grads)  # bf16 dS against e4m3 dS


@pytest.mark.parametrize("interleaved", [False, True])
def test_opcheck_with_rope_tables(interleaved):
    from flamia_cute.rotary import RotaryConfig

    args, do = _args("fp8_tokenblock_hadamard")
    rot = RotaryConfig(interleaved=interleaved).tables(max(LENGTHS), 64, "cpu")
    torch.library.opcheck(varlen_fwd, (*args, rot.cos, rot.sin, interleaved))
    out, lse, saved = varlen_fwd(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args), rot.cos, rot.sin,
                                 interleaved)
    q, k, v, cu_q, cu_k, mq, mk, scale, causal, name, backend = args
    torch.library.opcheck(varlen_bwd, (do, out, lse, saved, cu_q, cu_k, mq, mk, scale, causal, name, backend, rot.cos,
                                       rot.sin, interleaved))


def _compiled_matches_eager(backend, device, attn_backend, recipe="fp8_tokenblock", rotary=None):
    torch.manual_seed(0)
    model = TinyBlock(dim=256, heads=2, recipe=recipe, backend=attn_backend, rotary=rotary).to(device=device,
                                                                                          dtype=torch.bfloat16)
    lengths = [3, 150, 0, 40]
    cu = torch.tensor([0, 3, 153, 153, 193], dtype=torch.int32, device=device)
    x = torch.randn(sum(lengths), 256, device=device, dtype=torch.bfloat16)
    grads = []
    outs = []
    for fn in (model, torch.compile(model, fullgraph=True, backend=backend)):
        model.zero_grad()
        y = fn(x, cu, 150)
        y.float().square().sum().backward()
        outs.append(y.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    return outs, grads


def test_compile_fullgraph_aot_eager_matches_eager():
    torch._dynamo.reset()
    (eager, compiled), (g_eager, g_compiled) = _compiled_matches_eager("aot_eager", "cpu", "emulate")
    assert torch.equal(eager, compiled)
    for a, b in zip(g_eager, g_compiled, strict=True):
        assert torch.equal(a, b)


def test_compile_fullgraph_aot_eager_with_rotary():
    """rotary= traces with torch.compile(fullgraph=True): a RotaryConfig's tables are built in the graph,
    a Rotary's are graph inputs; the result is the eager call's (the tables are the same values)."""
    from flamia_cute.rotary import Rotary, RotaryConfig

    tabs = RotaryConfig(interleaved=True).tables(150, 128, "cpu")
    for rotary in (RotaryConfig(theta=100.0), Rotary(tabs.cos, tabs.sin, interleaved=True)):
        torch._dynamo.reset()
        (eager, compiled), (g_eager, g_compiled) = _compiled_matches_eager("aot_eager", "cpu", "emulate",
                                                                          "fp8_tokenblock_hadamard", rotary)
        assert torch.equal(eager, compiled)
        for a, b in zip(g_eager, g_compiled, strict=True):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8_tokenblock_dsbf16", "fp8_tokenblock_hadamard"])
def test_compile_fullgraph_inductor_cute_with_rotary(recipe):
    from flamia_cute.rotary import RotaryConfig

    torch._dynamo.reset()
    (eager, compiled), (g_eager, g_compiled) = _compiled_matches_eager("inductor", "cuda", "cute", recipe,
                                                                      RotaryConfig())
    torch.testing.assert_close(compiled.float(), eager.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(g_eager, g_compiled, strict=True):
        torch.testing.assert_close(b.float(), a.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8_tokenblock", "fp8_token", "fp8_tokenblock_dsbf16"])
def test_compile_fullgraph_inductor_cute(recipe):
    torch._dynamo.reset()
    (eager, compiled), (g_eager, g_compiled) = _compiled_matches_eager("inductor", "cuda", "cute", recipe)
    # inductor may fuse the bf16 projections differently from eager: compare loosely
    torch.testing.assert_close(compiled.float(), eager.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(g_eager, g_compiled, strict=True):
        torch.testing.assert_close(b.float(), a.float(), rtol=5e-2, atol=5e-2)


def test_flop_counter_counts_the_ops_as_torch_counts_flash_attention():
    """FlopCounterMode sees flamia_cute::varlen_fwd / varlen_bwd (eager calls take the ops under a dispatch mode)
    and counts them as torch counts its flash attention: per document, without the causal half; forward 2
    products, backward 5 (with S recomputed)."""
    from torch.utils.flop_counter import FlopCounterMode

    lengths, H, D = [100, 50, 0, 7], 4, 64
    q, k, v, do, cu, scale = make_inputs(lengths, H, 2, D, seed=2)
    q.requires_grad_()
    with FlopCounterMode(display=False) as counter:
        flamia_attn_varlen_func(q, k, v, cu, cu, 100, 100, scale).backward(do)
    counts = counter.get_flop_counts()["Global"]
    pairs = sum(n * n for n in lengths)
    assert counts[torch.ops.flamia_cute.varlen_fwd] == 4 * H * D * pairs
    assert counts[torch.ops.flamia_cute.varlen_bwd] == 10 * H * D * pairs
    # torch's own count of causal attention over one document (SDPA's math path: two bmm): the same convention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x = torch.randn(1, H, 100, D)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as ref:
        torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
    assert ref.get_total_flops() == 4 * H * D * 100 * 100


def test_flop_counter_bounds_fake_cu_seqlens():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v, _, cu, scale = make_inputs([100, 50], 4, 2, 64, seed=2)
    with FakeTensorMode() as mode, FlopCounterMode(display=False) as counter:
        fq, fk, fv, fcu = (mode.from_tensor(t) for t in (q, k, v, cu))
        flamia_attn_varlen_func(fq, fk, fv, fcu, fcu, 100, 100, scale)
    assert counter.get_total_flops() == 4 * 4 * 64 * 150 * 100  # tokens_q x max_seqlen_k: an upper bound


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_deterministic_argument_reaches_the_backward(compiled, monkeypatch):
    """deterministic=True travels with the call to its backward (the autograd Function's context, or the custom
    ops' under torch.compile), where the kernels' plan takes it."""
    from flamia_cute import custom_ops

    seen, real = [], custom_ops.run_backward

    def spy(*args, **kw):
        seen.append(args[-1])
        return real(*args, **kw)

    monkeypatch.setattr(custom_ops, "run_backward", spy)
    q, k, v, do, cu, scale = make_inputs(LENGTHS, 4, 2, 64, seed=4)
    for flag in (True, False):
        torch._dynamo.reset()
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]

        def call(*t, flag=flag):
            return flamia_attn_varlen_func(*t, cu, cu, max(LENGTHS), max(LENGTHS), scale, deterministic=flag)

        fn = torch.compile(call, backend="aot_eager", fullgraph=True) if compiled else call
        fn(*leaves).backward(do)
    assert seen == [True, False]
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flamia_attn_varlen_func(q, k, v, cu, cu, 40, 40, deterministic=1)


def test_deterministic_argument_picks_the_deterministic_backward(monkeypatch):
    from flamia_cute.custom_ops import _kernel_plan

    monkeypatch.delenv("FLAMIA_CUTE_DETERMINISTIC", raising=False)
    q = torch.empty(300, 16, 128)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    args = ("fp8_tokenblock_dsbf16", q, 300, 16, 200, cu, cu, True)
    assert _kernel_plan(*args, deterministic=True).bwd.deterministic
    assert not _kernel_plan(*args).bwd.deterministic
    monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", "1")  # the global switch wins over deterministic=False
    assert _kernel_plan(*args).bwd.deterministic


@pytest.mark.gpu
def test_gpu_deterministic_argument_gives_bit_reproducible_gradients(monkeypatch):
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("needs an sm_90 GPU")
    from flamia_cute import cute_backend

    monkeypatch.delenv("FLAMIA_CUTE_DETERMINISTIC", raising=False)
    plans, real = [], cute_backend.backward
    monkeypatch.setattr(cute_backend, "backward", lambda plan, *a, **k: plans.append(plan) or real(plan, *a, **k))
    lengths = [3000, 1, 900, 4096]
    q, k, v, do, cu, scale = make_inputs(lengths, 16, 4, 128, seed=5, device="cuda")
    runs = []
    for _ in range(3):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flamia_attn_varlen_func(*leaves, cu, cu, 4096, 4096, scale, backend="cute", deterministic=True)
        runs.append(torch.autograd.grad(out, leaves, do))
    assert len(plans) == 3 and all(p.bwd.deterministic for p in plans)  # the call's flag chose the build
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))


@pytest.mark.parametrize("route", ["autograd_function", "custom_op"])
@pytest.mark.parametrize("do_needs_grad", [False, True])
def test_double_backward_raises(route, do_needs_grad):
    """Our gradients come from the saved FP8 operands, not from q, k, v: a graph of them would give wrong second
    derivatives (zero with a constant dO). create_graph=True through the attention raises on both routes."""
    q, k, v, do, cu, scale = make_inputs([20, 13], 2, 2, 64, "normal", 5)
    L = 20

    def call(q, k, v):
        if route == "custom_op":
            out, _lse, _saved = varlen_fwd(q, k, v, cu, cu, L, L, scale, True, "fp8_tokenblock_dsbf16", "emulate")
            return out
        return flamia_attn_varlen_func(q, k, v, cu, cu, L, L, scale, backend="emulate")

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = call(*leaves)
    grad_out = out * do if do_needs_grad else do  # a dO that depends on q, k, v, or a constant one
    with pytest.raises(RuntimeError, match="not differentiable: create_graph=True"):
        torch.autograd.grad(out, leaves, grad_out, create_graph=True)
    assert all(g is not None for g in torch.autograd.grad(call(*leaves), leaves, do))  # without it: as before


def test_meta_tensors_give_meta_outputs():
    """A model built on the meta device runs the call for shapes: the custom ops' fake implementations, forward
    and backward, without reading cu_seqlens' values."""
    q = torch.empty(30, 4, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    k = torch.empty(30, 2, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    out, lse = flamia_attn_varlen_func(q, k, k, cu, cu, 20, 20, return_lse=True)
    assert out.device.type == "meta" and out.shape == q.shape and lse.shape == (4, 30)
    out.sum().backward()
    assert q.grad.device.type == "meta" and q.grad.shape == q.shape and k.grad.shape == k.shape
