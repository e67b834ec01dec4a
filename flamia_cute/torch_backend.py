"""flamia_cute as PyTorch's flash-attention implementation "FLAMIA_FP8".

    import torch, flamia_cute.torch_backend  # registers the name; activates nothing
    torch.nn.attention.activate_flash_attention_impl("FLAMIA_FP8")  # or flamia_cute.torch_backend.activate()

An activated implementation replaces the kernels of the aten flash ops (torch/nn/attention/_registry.py), so
`torch.nn.attention.varlen.varlen_attn` (torchtitan's VarlenAttention) and the flash path of
`F.scaled_dot_product_attention` run flamia_attn_varlen_func's numerics: the sm_90a kernels on an H200, the
emulator on the CPU (where SDPA's flash op is `_scaled_dot_product_flash_attention_for_cpu`).

What we cannot run goes to the kernel that was registered before us, with one warning per reason: dropout,
head dims other than 64 and 128, an attention mask (SDPA on CUDA never sends a masked call to the flash path,
so such calls never reach us there), sliding windows, paged or cached K/V, non-bf16/fp16 inputs, SDPA's
top-left `is_causal` with different query and key lengths, and on a GPU every call the sm_90a kernels lack
(plan.why_not_kernels: other recipes and head dims, other GPUs).

The aten backward ops receive the bf16 inputs, not our saved FP8 operands. They quantize Q, K and V again
(custom_ops.saved_from_inputs): the quantizers are deterministic functions of their inputs, so the backward
reads the forward's operands byte for byte and the gradients are bit-identical to flamia_attn_varlen_func's
(for fp16 inputs, wherever |O| >= 2^-17: the backward's bf16 O is the returned fp16 O converted back).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
from torch.library import Library

from .custom_ops import recipe_key, run_backward, run_forward, saved_from_inputs
from .emulator import default_softmax_scale
from .interface import choose_backend
from .plan import KERNEL_HEAD_DIMS, why_not_kernels
from .recipes import DEFAULT_RECIPE, Recipe, resolve_recipe

IMPL_NAME = "FLAMIA_FP8"
# the arguments we read; any other one that is set (paged K/V, caches, ALiBi, seqused_k, descales) is a reason
_READ = {"query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
         "return_debug_mask", "scale", "window_size_left", "window_size_right", "num_splits", "out", "grad_out",
         "logsumexp", "rng_state", "unused", "philox_seed", "philox_offset", "attn_mask"}

_state = {"recipe": DEFAULT_RECIPE}


@dataclass
class FlamiaFlashHandle:
    """What activate_flash_attention_impl keeps: remove() unregisters our kernels, which restores the previous ones."""

    library: Library | None

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
        self.library = None


def activate(recipe: str | Recipe = DEFAULT_RECIPE) -> None:
    """Activate FLAMIA_FP8 with `recipe` (torch.nn.attention.restore_flash_attention_impl() undoes it)."""
    set_recipe(recipe)
    torch.nn.attention.activate_flash_attention_impl(IMPL_NAME)


def set_recipe(recipe: str | Recipe) -> None:
    """The recipe the activated implementation runs (default: the default recipe)."""
    resolve_recipe(recipe)  # a bad name fails here, naming the recipes
    _state["recipe"] = recipe


def register_flamia_fp8() -> FlamiaFlashHandle:
    """register_fn of FLAMIA_FP8: our kernels for the aten flash ops on CUDA and on the CPU."""
    lib = Library("aten", "IMPL")
    with warnings.catch_warnings():  # torch warns on every override of a built-in kernel: that is the point here
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        for op, key, handler in _KERNELS:
            if not hasattr(torch.ops.aten, op.split(".")[0]):  # an op this torch does not have
                continue
            lib.impl(op, _kernel(op, key, handler), key, with_keyset=True)
    if torch.cuda.is_available() and torch.backends.cuda.cudnn_sdp_enabled():
        # SDPA picks its backend before any flash op runs, and on an H200 it picks cuDNN's attention: without
        # this word a user's SDPA calls would silently stay bf16
        _warn_sdpa_backend()
    return FlamiaFlashHandle(lib)


def _warn_sdpa_backend() -> None:
    if "sdpa backend" not in _WARNED:
        _WARNED.add("sdpa backend")
        warnings.warn(f"{IMPL_NAME} serves varlen_attn and SDPA's flash path; on this GPU "
                      "F.scaled_dot_product_attention may choose cuDNN's attention instead (it does on an H200). "
                      "Run SDPA under torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION), or call "
                      "torch.backends.cuda.enable_cudnn_sdp(False), for its calls to reach FLAMIA_FP8", stacklevel=3)


# ----------------------------------------------------------------------------- dispatch


class _FallThrough(Exception):
    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


_WARNED: set[str] = set()


def _warn_once(why: str) -> None:
    if why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(f"{IMPL_NAME}: this call runs the previously registered flash-attention kernel because {why}",
                      stacklevel=4)


def _bind(schema, args, kwargs) -> dict:
    """The call's arguments by name, defaults filled in (the dispatcher omits arguments left at their default)."""
    bound = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        else:
            bound[arg.name] = arg.default_value if arg.has_default_value() else None
    return bound


def _kernel(op: str, key: str, handler):
    name, _, overload = op.partition(".")
    packet = getattr(torch.ops.aten, name)
    schema = getattr(packet, overload or "default")._schema
    try:
        previous = torch.library.get_kernel(f"aten::{op}", key)
    except RuntimeError:  # e.g. no CPU kernel for the varlen flash op
        previous = None

    def kernel(keyset, *args, **kwargs):
        try:
            return handler(_bind(schema, args, kwargs))
        except _FallThrough as ft:
            if previous is None:
                raise NotImplementedError(f"{IMPL_NAME} cannot run this aten::{op} call ({ft.why}) and there is no "
                                          f"other {key} kernel for it") from None
            _warn_once(ft.why)
            return previous.call_boxed(keyset, *args, **kwargs)

    return kernel


def _backend(q, k, cu_q, cu_k, causal: bool, bound: dict) -> tuple[str, str]:
    """(backend, recipe key) that runs this call, or _FallThrough saying why none does. One rule for every op."""
    if bound.get("dropout_p"):
        raise _FallThrough(f"dropout_p={bound['dropout_p']} (FP8 attention has no dropout)")
    if bound.get("return_debug_mask"):
        raise _FallThrough("return_debug_mask=True")
    if bound.get("attn_mask") is not None:
        raise _FallThrough("of an attention mask (FLAMIA_FP8 takes causal or full attention over packed documents)")
    set_args = sorted(n for n, val in bound.items() if n not in _READ and val is not None and val is not False)
    if set_args:
        raise _FallThrough(f"{', '.join(set_args)} is set")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise _FallThrough(f"of {q.dtype} inputs (FP8 attention takes bfloat16 or float16)")
    if q.shape[-1] not in KERNEL_HEAD_DIMS:
        raise _FallThrough(f"head_dim {q.shape[-1]} has no kernel (64 or 128)")
    if k.shape[-1] != q.shape[-1] or bound.get("value") is not None and bound["value"].shape[-1] != q.shape[-1]:
        raise _FallThrough("of key or value head dims other than the query's")
    if q.shape[-2] % k.shape[-2]:
        raise _FallThrough(f"{q.shape[-2]} query heads are not a multiple of {k.shape[-2]} key heads")
    rec = resolve_recipe(_state["recipe"])
    chosen, why = choose_backend("auto", q.device, lambda _kernels: why_not_kernels(rec, causal, q, k, cu_q, cu_k))
    if chosen == "cute" or (chosen == "emulate" and q.device.type == "cpu"):
        return chosen, recipe_key(rec)
    raise _FallThrough(why or f"FLAMIA_FP8 runs the sm_90a kernels, or the emulator on the CPU, not the {chosen} ones")


def _causal(bound: dict) -> bool:
    """is_causal, with the flash ops' windows: (-1 or None, 0) is causal, (-1 or None, -1 or None) is not."""
    left, right = bound.get("window_size_left"), bound.get("window_size_right")
    if left not in (None, -1) or right not in (None, -1, 0):
        raise _FallThrough(f"of a sliding window ({left}, {right})")
    return bool(bound["is_causal"]) or right == 0


@functools.cache
def _uniform_cu(batch: int, length: int, device: torch.device) -> torch.Tensor:
    """cu_seqlens of `batch` sequences of `length` tokens, one tensor per shape: the call's value check copies a
    new GPU cu_seqlens to the host once (validation.check_cu_seqlens_values), so a dense call reuses its tensor."""
    return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)


def _int32(cu: torch.Tensor) -> torch.Tensor:
    return cu if cu.dtype == torch.int32 else cu.to(torch.int32)


def _like(ref: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """value (a view of ref's shape) with the strides of torch.empty_like(ref), which the ops' meta functions give
    and torch.compile assumes: the view itself when its strides are those already (no copy)."""
    want = torch.empty_like(ref, device="meta").stride()
    if value.stride() == want:
        return value
    return torch.empty_like(ref).copy_(value)


def _rng(device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.zeros((), dtype=torch.uint64, device=device)


class _Call:
    """A call in THD form: q (T, H, D), k, v (Tk, Hk, D), int32 cu_seqlens."""

    def __init__(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, bound):
        self.backend, self.recipe = _backend(q, k, cu_q, cu_k, causal, bound)  # before any copy: it may decline
        self.q, self.k, self.v = (t.contiguous() for t in (q, k, v))
        self.cu_q, self.cu_k, self.max_q, self.max_k, self.causal = cu_q, cu_k, int(max_q), int(max_k), causal
        self.scale = float(scale) if scale is not None else default_softmax_scale(q.shape[-1])

    def forward(self):
        out, lse, _ = run_forward(self.q, self.k, self.v, self.cu_q, self.cu_k, self.max_q, self.max_k, self.scale,
                                  self.causal, self.recipe, self.backend, save=False)
        return out, lse

    def backward(self, dout, out, lse):
        saved = saved_from_inputs(self.q, self.k, self.v, out.contiguous(), self.cu_q, self.cu_k, self.max_q,
                                  self.max_k, self.recipe, self.backend, self.causal)
        return run_backward(dout, out.contiguous(), lse.contiguous(), saved, self.cu_q, self.cu_k, self.max_q,
                            self.max_k, self.scale, self.causal, self.recipe, self.backend)


# ----------------------------------------------------------------------------- the flash ops (varlen_attn)


def _flash_call(b: dict, q, k, v, lse=None):
    """The flash op's call in THD form; dense (B, S, H, D) inputs (no cum_seq_q) become B equal documents."""
    causal = _causal(b)
    if b["cum_seq_q"] is not None:
        if b["cum_seq_k"] is None:
            raise _FallThrough("cum_seq_k is None (paged keys and values)")
        cu_q, cu_k = _int32(b["cum_seq_q"]), _int32(b["cum_seq_k"])
        return _Call(q, k, v, cu_q, cu_k, b["max_q"], b["max_k"], b["scale"], causal, b), lse
    B, L, H, D = q.shape
    S = k.shape[1]
    cu_q = _uniform_cu(B, L, q.device)
    cu_k = cu_q if S == L else _uniform_cu(B, S, q.device)
    thd = (t.reshape(B * t.shape[1], t.shape[2], t.shape[3]) for t in (q, k, v))
    if lse is not None:  # (B, H, L) -> (H, B * L)
        lse = lse.transpose(0, 1).reshape(H, B * L)
    return _Call(*thd, cu_q, cu_k, L, S, b["scale"], causal, b), lse


def _flash_forward(b: dict):
    q = b["query"]
    call, _ = _flash_call(b, q, b["key"], b["value"])
    out, lse = call.forward()
    if b["cum_seq_q"] is None:
        B, L, H, _ = q.shape
        out, lse = out.view(q.shape), lse.view(H, B, L).transpose(0, 1).contiguous()
    if b.get("out") is not None:
        out = b["out"].copy_(out)
    else:
        out = _like(q, out)  # the meta function's strides (a copy only for a permuted q)
    return (out, lse, *_rng(q.device), torch.empty(0, dtype=q.dtype, device=q.device))


def _flash_forward_inplace(b: dict):
    return _flash_forward(b)[1]


def _flash_backward(b: dict):
    q, k, v = b["query"], b["key"], b["value"]
    call, lse = _flash_call(b, q, k, v, b["logsumexp"])
    T = call.q.shape[0]
    dout, out = (t.reshape(T, *t.shape[-2:]) for t in (b["grad_out"], b["out"]))
    dq, dk, dv = call.backward(dout, out, lse)
    return _like(q, dq.view(q.shape)), _like(k, dk.view(k.shape)), _like(v, dv.view(v.shape))


# ----------------------------------------------------------------------------- SDPA's flash ops (B, H, S, D)


def _sdpa_call(b: dict):
    q, k, v = b["query"], b["key"], b["value"]
    B, H, L, D = q.shape
    S = k.shape[2]
    causal = bool(b["is_causal"])
    if causal and L != S:
        raise _FallThrough("SDPA's is_causal aligns the mask top-left and FLAMIA_FP8 bottom-right: they differ when "
                           "the query and key lengths differ")
    cu_q = _uniform_cu(B, L, q.device)
    cu_k = cu_q if S == L else _uniform_cu(B, S, q.device)
    thd = (t.transpose(1, 2).reshape(B * t.shape[2], t.shape[1], t.shape[3]) for t in (q, k, v))
    return _Call(*thd, cu_q, cu_k, L, S, b["scale"], causal, b)


def _sdpa_out(b: dict, out, lse):
    """(output, logsumexp (B, H, L)) from THD results."""
    q = b["query"]
    B, H, L, D = q.shape
    return _like(q, out.view(B, L, H, D).transpose(1, 2)), lse.view(H, B, L).transpose(0, 1)


def _sdpa_grads(b: dict, call: _Call):
    """dq, dk, dv (B, H, S, D) as views of THD (B, S, H, D) memory."""
    B, H, L, D = b["query"].shape
    thd = (t.transpose(1, 2).reshape(B * L, H, D) for t in (b["grad_out"], b["out"]))
    lse = b["logsumexp"].transpose(0, 1).reshape(H, B * L)
    grads = call.backward(*thd, lse)
    return tuple(g.view(B, g.shape[0] // B, *g.shape[1:]).transpose(1, 2) for g in grads)


def _sdpa_forward(b: dict):
    out, lse = _sdpa_call(b).forward()
    out, lse = _sdpa_out(b, out, lse)
    q, k = b["query"], b["key"]
    return (out, lse.contiguous(), None, None, q.shape[2], k.shape[2], *_rng(q.device),
            torch.empty(0, dtype=q.dtype, device=q.device))


def _sdpa_backward(b: dict):
    grads = _sdpa_grads(b, _sdpa_call(b))
    return tuple(_like(b[name], g) for name, g in zip(("query", "key", "value"), grads, strict=True))


def _sdpa_cpu_backward(b: dict):
    return _sdpa_grads(b, _sdpa_call(b))  # the CPU op's grads are (B, S, H, D) in memory, as these views


def _sdpa_cpu_forward(b: dict):
    out, lse = _sdpa_call(b).forward()
    out, lse = _sdpa_out(b, out, lse)
    B, H, L = lse.shape
    lse_cpu = torch.empty(B, L, H, dtype=torch.float32, device=lse.device).transpose(1, 2)  # the CPU op's layout
    return out, lse_cpu.copy_(lse)


_KERNELS = [
    ("_flash_attention_forward", "CUDA", _flash_forward),
    ("_flash_attention_backward", "CUDA", _flash_backward),
    ("_flash_attention_forward_no_dropout_inplace", "CUDA", _flash_forward_inplace),
    ("_scaled_dot_product_flash_attention", "CUDA", _sdpa_forward),
    ("_scaled_dot_product_flash_attention_backward", "CUDA", _sdpa_backward),
    ("_flash_attention_forward", "CPU", _flash_forward),
    ("_flash_attention_backward", "CPU", _flash_backward),
    ("_flash_attention_forward_no_dropout_inplace", "CPU", _flash_forward_inplace),
    ("_scaled_dot_product_flash_attention_for_cpu", "CPU", _sdpa_cpu_forward),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", "CPU", _sdpa_cpu_backward),
]

torch.nn.attention.register_flash_attention_impl(IMPL_NAME, register_fn=register_flamia_fp8)
