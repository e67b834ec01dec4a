"""The autograd paths of flamia_attn_varlen_func: one forward and one backward over one saved list.

run_forward and run_backward hold the call: the kernels from the call's Plan (backend "cute") or the
emulator. Their saved list is the one saved-operand type of every path: the eager autograd function
(`Attention`), and the torch.library custom ops ``flamia_cute::varlen_fwd`` / ``varlen_bwd`` that
torch.compile(fullgraph=True) traces (the eager path skips their dispatch cost, ~50 µs of host time
per call). Both take the recipe by key (a named recipe's name, or recipe_key() of a custom one) and
the resolved backend ("emulate", "cute" or "sm100"). ``saved`` is a flat list of the tensors the backward needs
-- the quantized operands and their scales, never the bf16 inputs -- whose structure follows from the
static arguments (recipe, backend, dtype) and the input shapes, so the fake implementations can build
it without running anything:

- backend "cute": ``[out_bf16, buffer, k_shape]``: the ONE uint8
  allocation the Q/K/V quantization launch wrote every QuantizedTHD field into (Q, K, V and the
  per-token copies of K, V; the views are rebuilt from `quant.output_buffer_plan`: outputs of a
  custom op must not alias each other, and the views would), and a 0-element (0, Tk, Hk, D) tensor
  that carries K's token count, head count and head dim;
- backend "emulate": ``[out_bf16]`` then the EmuOperand fields (along_d, along_t, scale, diag_along_d,
  diag_along_t, diag_scale) of Q, K, V, as derived from the recipe;
- backend "sm100" (the Blackwell MXFP8 forward, whose backward is the emulator's): the "emulate"
  layout, holding the operands the kernel read (sm100/backend.py).

Absent entries (a field the recipe does not have, one that is the same tensor as another field, the
bf16 copy of out when out is already bf16) are 0-element placeholders: the layout says which.
"""

from __future__ import annotations

import functools
import hashlib

import torch
import torch.utils.flop_counter

from .quant import transposed_tokens
from .recipes import MX_BLOCK, NAMED_RECIPES, OperandQuant, Recipe

LIB = "flamia_cute"
EMU_FIELDS = ("along_d", "along_t", "scale", "diag_along_d", "diag_along_t", "diag_scale")
QUANT_FIELDS = ("data_td", "data_dt", "scale")
OP_BACKENDS = ("emulate", "cute", "sm100")

# Kinds of saved entries: a (T, H, D) fp32 value tensor, an (H, T) fp32 scale, FP8 data in the two
# layouts, the bf16 out, or a 0-element placeholder.
_VALS, _SCALE, _F8_TD, _F8_DT, _OUT, _NONE = "vals", "scale", "f8_td", "f8_dt", "out", None
_QKV_BUFFER, _K_SHAPE = "qkv_buffer", "k_shape"


# custom recipes (not in NAMED_RECIPES), by recipe_key: the ops take a recipe as a string
_CUSTOM_RECIPES: dict[str, Recipe] = {}


def recipe_key(recipe: Recipe) -> str:
    """The string the ops take for `recipe`: its name when it is that named recipe, else a key that
    names its fields (a custom recipe may reuse a named recipe's name with other fields)."""
    if NAMED_RECIPES.get(recipe.name) == recipe:
        return recipe.name
    key = f"{recipe.name}#{hashlib.sha256(repr(recipe).encode()).hexdigest()[:12]}"
    _CUSTOM_RECIPES[key] = recipe
    return key


def _recipe(key: str) -> Recipe:
    rec = NAMED_RECIPES.get(key) or _CUSTOM_RECIPES.get(key)
    if rec is None:
        raise ValueError(f"recipe: unknown name {key!r}; named recipes: {sorted(NAMED_RECIPES)}")
    return rec


def _kernel_scaling(key: str) -> str:
    from .plan import KERNEL_SCALINGS, kernel_scaling

    scaling = kernel_scaling(_recipe(key)) if key in NAMED_RECIPES else None
    if scaling is None:
        raise ValueError(f"backend 'cute': recipe {key!r} has no sm_90a kernel (kernels: {sorted(KERNEL_SCALINGS)})")
    return scaling


def _emu_operand_kinds(op: OperandQuant, key_side: bool, recipe: Recipe) -> tuple:
    """Which EMU_FIELDS of emulator.quantize_operand's result are distinct tensors (None: absent/alias)."""
    if op.scaling in ("none", "tensor"):
        return (_VALS, _NONE, _SCALE, _NONE, _NONE, _NONE)
    if op.scaling in ("token", "tokenblock"):
        diag = key_side and op.block_tokens > 1 and recipe.diagonal_safeguard
        return (_VALS, _NONE, _SCALE, _VALS if diag else _NONE, _NONE, _SCALE if diag else _NONE)
    diag = key_side and recipe.diagonal_safeguard  # MX: the diagonal block runs in bf16
    return (_VALS, _VALS, _NONE, _VALS if diag else _NONE, _NONE, _NONE)


def _emu_block_tokens(op: OperandQuant) -> int:
    if op.scaling in ("token", "tokenblock"):
        return op.block_tokens
    return MX_BLOCK if op.scaling == "mx" else 1


@functools.cache
def saved_layout(recipe_name: str, backend: str, out_is_bf16: bool) -> tuple[tuple[str, str | None], ...]:
    """(operand, kind) of every saved entry; operand is 'out', 'q', 'k', 'v', 'kt' or 'vt'."""
    if backend not in OP_BACKENDS:
        raise ValueError(f"backend must be one of {OP_BACKENDS}, got {backend!r}")
    layout = [("out", _NONE if out_is_bf16 else _OUT)]
    if backend == "cute":
        _kernel_scaling(recipe_name)  # checks that the recipe has kernels
        return (*layout, ("qkv", _QKV_BUFFER), ("k", _K_SHAPE))
    if backend == "sm100":
        from .plan import SM100_RECIPES

        if recipe_name not in SM100_RECIPES:
            raise ValueError(f"backend 'sm100': recipe {recipe_name!r} has no sm_100a kernel (kernels: "
                             f"{list(SM100_RECIPES)})")
    rec = _recipe(recipe_name)
    for name, op, key_side in (("q", rec.q, False), ("k", rec.k, True), ("v", rec.v, True)):
        layout += [(name, k) for k in _emu_operand_kinds(op, key_side, rec)]
    return tuple(layout)


def _placeholder(device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=device)


def _qkv_launch(Hq: int, Hk: int, D: int, recipe: str):
    """The layouts of a kernel recipe's Q/K/V launch (plan.Plan.qkv; tuning changes no layout)."""
    from .sm90.quantize import forward_only, qkv_config

    return forward_only(qkv_config(D, Hq, Hk, 128 if _kernel_scaling(recipe) == "tokenblock" else 1))


def _qkv_plan(T: int, num_docs: int, Hq: int, Hk: int, D: int, recipe: str, Tk: int | None = None):
    """The byte plan of a kernel recipe's Q/K/V launch (_qkv_launch); Tk: K and V's tokens (default T)."""
    from .sm90.quantize import qkv_layout_outputs

    return qkv_layout_outputs(_qkv_launch(Hq, Hk, D, recipe), T, T if Tk is None else Tk, num_docs)


def _fake_entry(kind, shape_thd, num_docs, device, k_shape=None, recipe=None):
    T, H, D = shape_thd
    if kind == _QKV_BUFFER:
        _, nbytes = _qkv_plan(T, num_docs, H, k_shape[1], D, recipe, k_shape[0])
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if kind == _K_SHAPE:
        return torch.empty(0, *k_shape, dtype=torch.uint8, device=device)
    if kind == _VALS:
        return torch.empty(T, H, D, dtype=torch.float32, device=device)
    if kind == _SCALE:
        return torch.empty(H, T, dtype=torch.float32, device=device)
    if kind == _F8_TD:
        return torch.empty(T, H, D, dtype=torch.float8_e4m3fn, device=device)
    if kind == _F8_DT:
        return torch.empty(H, D, transposed_tokens(T, num_docs), dtype=torch.float8_e4m3fn, device=device)
    if kind == _OUT:
        return torch.empty(T, H, D, dtype=torch.bfloat16, device=device)
    return _placeholder(device)


# ----------------------------------------------------------------------------- packing


def _pack_emulated(layout, out_bf16, ctx) -> list[torch.Tensor]:
    ops = {"q": ctx.q, "k": ctx.k, "v": ctx.v}
    dev = out_bf16.device
    saved = [out_bf16 if layout[0][1] == _OUT else _placeholder(dev)]
    for i, (name, kind) in enumerate(layout[1:]):
        field = EMU_FIELDS[i % len(EMU_FIELDS)]
        t = getattr(ops[name], field) if kind is not _NONE else None
        saved.append(t if t is not None else _placeholder(dev))
    return saved


def _unpack_emulated(layout, saved, recipe: Recipe):
    from .emulator import EmuOperand

    ops = {}
    for j, (name, op) in enumerate((("q", recipe.q), ("k", recipe.k), ("v", recipe.v))):
        base = 1 + j * len(EMU_FIELDS)
        f = {}
        for i, field in enumerate(EMU_FIELDS):
            f[field] = saved[base + i] if layout[base + i][1] is not _NONE else None
        along_t = f["along_t"] if f["along_t"] is not None else f["along_d"]
        diag_t = f["diag_along_t"] if f["diag_along_t"] is not None else f["diag_along_d"]
        ops[name] = EmuOperand(f["along_d"], along_t, f["scale"], f["diag_along_d"], diag_t, f["diag_scale"],
                               block_tokens=_emu_block_tokens(op))
    return ops["q"], ops["k"], ops["v"]


def _pack_kernel(layout, out_bf16, quantized) -> list[torch.Tensor]:
    qq, (kq, kt), (vq, vt) = quantized
    dev = out_bf16.device
    storage = qq.data_td.untyped_storage()
    fields = [getattr(t, f) for t in (qq, kq, vq, kt, vt) if t is not None for f in QUANT_FIELDS]
    if any(f is not None and f.untyped_storage().data_ptr() != storage.data_ptr() for f in fields):
        raise RuntimeError("the Q/K/V quantization outputs are expected in one allocation")
    buf = torch.empty(0, dtype=torch.uint8, device=dev).set_(storage)
    k_shape = torch.empty(0, *kq.data_td.shape, dtype=torch.uint8, device=dev)
    return [out_bf16 if layout[0][1] == _OUT else _placeholder(dev), buf, k_shape]


def _unpack_kernel(saved, recipe: str, T: int, num_docs: int, Hq: int):
    """The QuantizedTHD views of the saved buffer: (qq, kq, vq, kt, vt); kt, vt None unless the recipe's
    K/V blocks are > 1 token; layouts its launch does not write are None."""
    from .quant import output_views
    from .sm90.quantize import quantized_outputs, runtime_qkv_layout

    buf, k_shape = saved[1], saved[2]
    Tk, Hk, D = k_shape.shape[1:]
    # memoized (a training step unpacks the same layout on every layer); _qkv_plan serves the fakes
    plan, nbytes = runtime_qkv_layout(_qkv_launch(Hq, Hk, D, recipe), T, Tk, num_docs)
    if buf.numel() < nbytes:
        raise RuntimeError(f"saved Q/K/V buffer has {buf.numel()} bytes, its layout needs {nbytes}")
    # the Q/K/V launch that wrote them says which data_dt are in P-fragment order
    (qq, _), (kq, kt), (vq, vt) = quantized_outputs(_qkv_launch(Hq, Hk, D, recipe), output_views(buf, plan))
    return qq, kq, vq, kt, vt


# ----------------------------------------------------------------------------- the call


def _rotary(rope_cos, rope_sin, rope_interleaved: bool):
    """The call's RoPE tables as a rotary.Rotary (None: no RoPE)."""
    if rope_cos is None:
        return None
    from .rotary import Rotary

    return Rotary(rope_cos, rope_sin, rope_interleaved)


def _kernel_plan(recipe: str, q, k_tokens: int, k_heads: int, max_seqlen_q: int, cu_q, cu_k, causal: bool,
                 rotary=None, deterministic: bool = False):
    """The plan.Plan of a kernel call (q: the queries, or anything of their (T, H, D) shape), causal
    self-attention or with its own key documents (plan.separate_keys); rotary: the call's rotary.Rotary
    (causal self-attention only: make_plan refuses it with separate keys, as plan.why_not_kernels does)."""
    from .plan import make_plan, separate_keys

    sep = separate_keys(causal, q.shape[0], k_tokens, cu_q, cu_k)
    return make_plan(recipe, q.shape[2], q.shape[1], k_heads, max_seqlen_q, q.shape[0], cu_q.numel() - 1,
                     causal=causal, separate=sep, rotary=rotary_key(rotary), deterministic=deterministic)


def _bf16(*xs):
    """fp16 inputs rounded to bf16, on every backend (the kernels quantize bf16), so that the emulator still
    defines the kernels' numerics exactly; results go back in the caller's dtype."""
    return tuple(x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16) for x in xs)


def run_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                causal: bool, recipe: str, backend: str, rope_cos=None, rope_sin=None, rope_interleaved: bool = False,
                save: bool = True):
    """(out in q's dtype, lse (H, T) fp32, the saved list of saved_layout). Checks cu_seqlens' values:
    the public API checks only what it can without reading them (torch.compile traces it).
    rope_cos, rope_sin: the RoPE tables (rotary.resolve_rotary's; None: no RoPE), applied to Q and K
    in their quantization. save=False (no backward will run): nothing is packed and the saved list
    is [] (backend "sm100" also skips decoding its operands)."""
    from .validation import check_cu_seqlens_values

    check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q)
    check_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0], "max_seqlen_k", max_seqlen_k)
    layout = saved_layout(recipe, backend, q.dtype == torch.bfloat16)
    if backend == "cute":
        from . import cute_backend

        rotary = _rotary(rope_cos, rope_sin, rope_interleaved)
        plan = _kernel_plan(recipe, q, k.shape[0], k.shape[1], max_seqlen_q, cu_seqlens_q, cu_seqlens_k, causal, rotary)
        out_k, lse, ops = cute_backend.forward(plan, *_bf16(q, k, v), cu_seqlens_q, max_seqlen_q, softmax_scale, rotary,
                                               cu_seqlens_k)
        out = out_k if out_k.dtype == q.dtype else out_k.to(q.dtype)  # a no-op .to() costs host time too
        return out, lse, _pack_kernel(layout, out_k, ops) if save else []
    if backend == "sm100":
        from .emulator import EmulatorContext
        from .sm100 import backend as sm100

        if not causal:
            raise NotImplementedError("backend 'sm100': causal=False has no sm_100a kernel")
        if rope_cos is not None or _recipe(recipe).hadamard:
            raise NotImplementedError("backend 'sm100': the rotations of Q and K have no sm_100a kernel")
        out_k, lse, ops = sm100.forward(*_bf16(q, k, v), cu_seqlens_q, max_seqlen_q, softmax_scale, save)
        out = out_k if out_k.dtype == q.dtype else out_k.to(q.dtype)
        if not save:
            return out, lse, []
        ectx = EmulatorContext(_recipe(recipe), softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, *ops, out_k, lse)
        return out, lse, _pack_emulated(layout, out_k, ectx)
    from .emulator import emulate_forward

    out_e, lse, ectx = emulate_forward(*_bf16(q, k, v), cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, _recipe(recipe),
                                       rotary=_rotary(rope_cos, rope_sin, rope_interleaved))
    # for bf16 q, out IS out_e, and the layout holds a placeholder instead (outputs must not alias)
    return out_e.to(q.dtype), lse, _pack_emulated(layout, out_e, ectx) if save else []


def saved_from_inputs(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, recipe: str,
                      backend: str, causal: bool = True) -> list[torch.Tensor]:
    """The saved list run_forward(q, k, v, ...) would have returned, from the same inputs and its output: the
    operands are quantized again, which gives the forward's bytes (the quantizers are deterministic functions
    of their inputs). For backward paths that keep the bf16 inputs instead of our saved list (the torch
    backend's aten ops). out: run_forward's output; for fp16 inputs its bf16 copy is out.to(bf16), equal to
    the forward's bf16 O wherever |O| >= 2^-17 or O = 0 (fp16's subnormals hold bf16's 8 bits down to there)."""
    layout = saved_layout(recipe, backend, q.dtype == torch.bfloat16)
    out_bf16 = out.to(torch.bfloat16)
    if backend == "cute":
        from . import cute_backend

        plan = _kernel_plan(recipe, q, k.shape[0], k.shape[1], max_seqlen_q, cu_seqlens_q, cu_seqlens_k, causal)
        return _pack_kernel(layout, out_bf16, cute_backend.quantize(plan, *_bf16(q, k, v), cu_seqlens_q, max_seqlen_q,
                                                                    cu_k=cu_seqlens_k))
    if backend != "emulate":
        raise ValueError(f"saved_from_inputs: backend must be 'cute' or 'emulate', got {backend!r}")
    from types import SimpleNamespace

    from .emulator import qk_transform, quantize_inputs, transform_inputs

    rec = _recipe(recipe)
    q, k, v = _bf16(q, k, v)
    # the forward quantized Q and K after the recipe's rotations (the Hadamard recipe's; this path has no RoPE)
    q, k = transform_inputs(q, k, cu_seqlens_q, cu_seqlens_k, qk_transform(rec, None))
    qo, ko, vo = quantize_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, rec)
    return _pack_emulated(layout, out_bf16, SimpleNamespace(q=qo, k=ko, v=vo))


def run_backward(dout, out, lse, saved, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                 softmax_scale: float, causal: bool, recipe: str, backend: str, rope_cos=None, rope_sin=None,
                 rope_interleaved: bool = False, deterministic: bool = False):
    """dq, dk, dv in out's dtype from the forward's saved list; dq and dk in the caller's frame (the
    inverse rotations applied where they are written). deterministic: the kernels' bit-reproducible dQ
    (plan.make_plan's)."""
    dt = out.dtype
    layout = saved_layout(recipe, backend, dt == torch.bfloat16)
    out_bf16 = saved[0] if layout[0][1] == _OUT else out
    dout = dout.contiguous()
    if backend == "cute":
        from . import cute_backend

        T, H = out.shape[0], out.shape[1]
        qq, kq, vq, kt, vt = _unpack_kernel(saved, recipe, T, cu_seqlens_q.shape[0] - 1, H)
        ops = (qq, (kq, kt), (vq, vt))
        rotary = _rotary(rope_cos, rope_sin, rope_interleaved)
        plan = _kernel_plan(recipe, out, kq.data_td.shape[0], kq.data_td.shape[1], max_seqlen_q, cu_seqlens_q,
                            cu_seqlens_k, causal, rotary, deterministic)
        grads = cute_backend.backward(plan, *_bf16(dout), out_bf16, lse, ops, cu_seqlens_q, max_seqlen_q, softmax_scale,
                                      rotary, cu_seqlens_k, max_seqlen_k)
    else:  # "emulate", and "sm100": the emulator's backward on the operands its kernel forward read
        from .emulator import EmulatorContext, emulate_backward, qk_transform

        rec = _recipe(recipe)
        qo, ko, vo = _unpack_emulated(layout, saved, rec)
        ectx = EmulatorContext(rec, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, qo, ko, vo, out_bf16, lse,
                               qk_transform(rec, _rotary(rope_cos, rope_sin, rope_interleaved)))
        grads = emulate_backward(*_bf16(dout), ectx)
    return tuple(g if g.dtype == dt else g.to(dt) for g in grads)


def _refuse_double_backward():
    """In a backward, grad mode is on only under create_graph=True. Our gradients come from the saved FP8
    operands, not from q, k, v, so a graph of them would give wrong (zero or partial) second derivatives:
    refuse instead."""
    if torch.is_grad_enabled():
        raise RuntimeError("flamia_cute: the attention's backward is not differentiable: create_graph=True "
                           "(a double backward, a gradient of its gradients) is not supported through it")


class Attention(torch.autograd.Function):
    """The eager path: run_forward / run_backward without the custom ops' dispatch."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, recipe, backend, rope_cos=None, rope_sin=None,
                rope_interleaved=False, deterministic=False):
        out, lse, saved = run_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, recipe, backend, rope_cos,
                                      rope_sin, rope_interleaved)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(out, lse, cu_q, cu_k, rope_cos, rope_sin, *saved)
        ctx.static = (max_q, max_k, scale, causal, recipe, backend)
        ctx.rope_interleaved, ctx.deterministic = rope_interleaved, deterministic
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        out, lse, cu_q, cu_k, rope_cos, rope_sin, *saved = ctx.saved_tensors
        _refuse_double_backward()
        grads = run_backward(dout, out, lse, saved, cu_q, cu_k, *ctx.static, rope_cos, rope_sin, ctx.rope_interleaved,
                             ctx.deterministic)
        return (*grads, None, None, None, None, None, None, None, None, None, None, None, None)


# ----------------------------------------------------------------------------- the custom ops


@torch.library.custom_op(f"{LIB}::varlen_fwd", mutates_args=())
def varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    recipe: str,
    backend: str,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    rope_interleaved: bool = False,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """out (T, H, D) in q's dtype, lse (H, T) fp32, and the saved list of `saved_layout`. deterministic is the
    backward's (kept for it by the autograd context)."""
    return run_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                       recipe, backend, rope_cos, rope_sin, rope_interleaved)


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     recipe, backend, rope_cos=None, rope_sin=None, rope_interleaved=False, deterministic=False):
    layout = saved_layout(recipe, backend, q.dtype == torch.bfloat16)
    T, H, D = q.shape
    Tk, Hk, _ = k.shape
    num_docs = cu_seqlens_q.shape[0] - 1
    shapes = {"out": (T, H, D), "q": (T, H, D), "k": (Tk, Hk, D), "v": (Tk, Hk, D), "kt": (Tk, Hk, D),
              "vt": (Tk, Hk, D), "qkv": (T, H, D)}  # qkv: the queries' shape, K's from k_shape
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(H, T, dtype=torch.float32, device=q.device)
    kernel_recipe = recipe if backend == "cute" else None
    saved = [_fake_entry(kind, shapes[name], num_docs, q.device, (Tk, Hk, D), kernel_recipe) for name, kind in layout]
    return out, lse, saved


@torch.library.custom_op(f"{LIB}::varlen_bwd", mutates_args=())
def varlen_bwd(
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    saved: list[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    recipe: str,
    backend: str,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    rope_interleaved: bool = False,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv in out's dtype from the forward's saved operands."""
    return run_backward(dout, out, lse, saved, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                        causal, recipe, backend, rope_cos, rope_sin, rope_interleaved, deterministic)


@varlen_bwd.register_fake
def _varlen_bwd_fake(dout, out, lse, saved, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                     causal, recipe, backend, rope_cos=None, rope_sin=None, rope_interleaved=False,
                     deterministic=False):
    layout = saved_layout(recipe, backend, out.dtype == torch.bfloat16)
    k_idx = next(i for i, (name, kind) in enumerate(layout) if name == "k" and kind is not _NONE)
    # K's values / data_td: (Tk, Hk, D); the cute shape carrier: (0, Tk, Hk, D)
    Tk, Hk, D = saved[k_idx].shape[-3:]
    dq = torch.empty_like(out, memory_format=torch.contiguous_format)
    dk = torch.empty(Tk, Hk, D, dtype=out.dtype, device=out.device)
    dv = torch.empty(Tk, Hk, D, dtype=out.dtype, device=out.device)
    return dq, dk, dv


def _setup_context(ctx, inputs, output):
    out, lse, saved = output
    (_q, _k, _v, cu_q, cu_k, max_q, max_k, scale, causal, recipe, backend, rope_cos, rope_sin, rope_interleaved,
     deterministic) = inputs
    ctx.mark_non_differentiable(lse, *saved)
    # Only what the forward op returned (out, LSE, quantized operands) plus the int32 cu_seqlens (and
    # the RoPE tables, inputs the caller holds anyway).
    ctx.save_for_backward(out, lse, cu_q, cu_k, rope_cos, rope_sin, *saved)
    ctx.static = (max_q, max_k, scale, causal, recipe, backend, rope_interleaved, deterministic)


def _backward(ctx, dout, _dlse, _dsaved):
    out, lse, cu_q, cu_k, rope_cos, rope_sin, *saved = ctx.saved_tensors
    max_q, max_k, scale, causal, recipe, backend, rope_interleaved, deterministic = ctx.static
    if dout is None:
        dout = torch.zeros_like(out)
    _refuse_double_backward()
    dq, dk, dv = varlen_bwd(dout, out, lse, saved, cu_q, cu_k, max_q, max_k, scale, causal, recipe, backend, rope_cos,
                            rope_sin, rope_interleaved, deterministic)
    # one gradient per argument the call passed (the RoPE arguments have defaults a call may leave out)
    return (dq, dk, dv) + (None,) * (len(ctx.needs_input_grad) - 3)


varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


# FlopCounterMode (torch.utils.flop_counter): the ops count as torch counts its flash attention ops, per
# document and without the causal half (its convention), so that numbers compare with FA's through SDPA:
# forward 2 products (4 H D Lq Lk), backward 5 (the recomputed S and four gradient products: 10 H D Lq Lk)


def _query_key_pairs(cu_q, cu_k, tokens_q, max_k):
    """sum over documents of Lq * Lk; where cu_seqlens has no values (fake, functional or meta tensors) the
    bound tokens_q * max_k, as torch's own formulas decide (reading them would make unbacked symbols)."""
    from .validation import has_no_values

    if has_no_values(cu_q) or has_no_values(cu_k):
        return tokens_q * max_k
    lq, lk = (cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
    return sum(a * b for a, b in zip(lq, lk, strict=True))


@torch.utils.flop_counter.register_flop_formula(torch.ops.flamia_cute.varlen_fwd, get_raw=True)
def _varlen_fwd_flops(q, k, v, cu_q, cu_k, max_q, max_k, *args, out_shape=None, **kwargs) -> int:
    return 4 * q.shape[1] * q.shape[2] * _query_key_pairs(cu_q, cu_k, q.shape[0], max_k)


@torch.utils.flop_counter.register_flop_formula(torch.ops.flamia_cute.varlen_bwd, get_raw=True)
def _varlen_bwd_flops(dout, out, lse, saved, cu_q, cu_k, max_q, max_k, *args, out_shape=None, **kwargs) -> int:
    return 10 * dout.shape[1] * dout.shape[2] * _query_key_pairs(cu_q, cu_k, dout.shape[0], max_k)


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
              recipe: str, backend: str, rope_cos=None, rope_sin=None, rope_interleaved: bool = False,
              deterministic: bool = False):
    """(out, lse) through the custom ops; recipe by key (recipe_key), backend in OP_BACKENDS."""
    out, lse, _saved = varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  float(softmax_scale), causal, recipe, backend, rope_cos, rope_sin, rope_interleaved,
                                  deterministic)
    return out, lse


def rotary_key(rotary) -> tuple[str, int] | None:
    """The kernels' view of a call's RoPE: (mode "half" or "interleaved", rotary_dim), or None."""
    if rotary is None:
        return None
    return ("interleaved" if rotary.interleaved else "half", rotary.rotary_dim)
