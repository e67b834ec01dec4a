"""Public API: flamia_attn_varlen_func, differentiable, over packed documents."""

from __future__ import annotations

import os
import warnings

import torch

from .cute_backend import _dsl_importable, cute_attention_available
from .emulator import default_softmax_scale
from .plan import SM100_RECIPES, why_not_kernels, why_not_sm100
from .recipes import DEFAULT_RECIPE, Recipe, resolve_recipe
from .rotary import Rotary, RotaryConfig, kernel_tables, resolve_rotary
from .validation import check_attention_inputs

BACKENDS = ("auto", "emulate", "cute")
SM100_ENV = "FLAMIA_CUTE_SM100"  # 1: run the Blackwell kernels, which have never run on hardware


def device_kernels(device: torch.device) -> tuple[str, str | None]:
    """The kernel backend for `device` ("cute": sm_90a; "sm100": the Blackwell MXFP8 forward, whose
    backward is the emulator's) and why it cannot run there (None: it can, call permitting)."""
    if _kernels_available(device):
        return "cute", None
    if _capability(device) // 10 == 10:
        if not _sm100_opted_in():
            return "sm100", (f"the Blackwell (sm_100a) kernels have never run on hardware; {SM100_ENV}=1 opts in "
                             f"to the unverified MXFP8 forward (recipe {SM100_RECIPES[0]!r}, head_dim 128, causal "
                             "self-attention; gradients from the emulator's backward)")
        if not _sm100_dsl():
            return "sm100", "the sm_100a kernels need the CuTe DSL (nvidia-cutlass-dsl)"
        return "sm100", None
    return "cute", f"the sm_90a kernels need an sm_90 GPU and the CuTe DSL (device {device})"


def choose_backend(backend: str, device: torch.device, why_not_call=None) -> tuple[str, str | None]:
    """(the backend that runs, why the kernels do not): 'auto' takes the device's kernels where they
    exist for this call, else the emulator; 'cute' insists on the kernels and says why it cannot.
    why_not_call(kernels): why that kernel backend cannot run this call (why_not_kernels /
    why_not_sm100), asked only where the device has kernels."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "emulate":
        return "emulate", None
    kernels, why = device_kernels(device)
    if why is None and why_not_call is not None:
        why = why_not_call(kernels)
    if backend == "cute" and why:
        raise NotImplementedError(f"backend='cute': {why}; use backend='emulate' or 'auto'")
    return ("emulate", why) if why else (kernels, None)


def pick_backend(backend: str, device: torch.device, why_not_cute: str | None = None) -> str:
    """choose_backend's backend, for a call that the kernels cannot run for `why_not_cute` (None: any)."""
    return choose_backend(backend, device, lambda _kernels: why_not_cute)[0]


@torch.compiler.assume_constant_result
def _kernels_available(device: torch.device) -> bool:
    # a host-side fact: torch.compile evaluates it once while tracing instead of tracing into it
    return cute_attention_available(device)


@torch.compiler.assume_constant_result
def _capability(device: torch.device) -> int:
    """10 * major + minor of a CUDA device's compute capability; 0 for any other device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


@torch.compiler.assume_constant_result
def _sm100_opted_in() -> bool:
    flag = os.environ.get(SM100_ENV, "")
    if flag not in ("", "0", "1"):
        raise ValueError(f"{SM100_ENV} must be 0 or 1, got {flag!r}")
    return flag == "1"


@torch.compiler.assume_constant_result
def _sm100_dsl() -> bool:
    return _dsl_importable()


_WARNED: set[str] = set()


@torch.compiler.assume_constant_result
def _warn_fallback(reason: str) -> bool:
    """Warn once per reason that a GPU call runs on the emulator. A constant for torch.compile, so it
    runs (and warns) while tracing, never inside the graph."""
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"flamia_attn_varlen_func runs on the torch emulator, which builds each document's full "
                      f"score matrices and is slow, because {reason}. backend='cute' raises instead; "
                      "backend='emulate' asks for the emulator without this warning.", stacklevel=3)
    return True


def flamia_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    recipe: str | Recipe = DEFAULT_RECIPE,
    backend: str = "auto",
    return_lse: bool = False,
    rotary: Rotary | RotaryConfig | None = None,
    deterministic: bool = False,
):
    """FP8 attention over packed variable-length documents (THD layout).

    q: (total_q, heads, head_dim); k, v: (total_k, kv_heads, head_dim) with
    heads % kv_heads == 0 (GQA). cu_seqlens_*: int32 prefix sums of document
    lengths. Returns out (total_q, heads, head_dim) in q's dtype, and with
    return_lse also lse (heads, total_q) fp32 (natural log).

    rotary: rotary position embedding of q and k, applied inside their quantization (the rotated
    q and k are never written): Rotary(cos, sin, interleaved) with (positions, rotary_dim // 2)
    tables, or RotaryConfig(theta, interleaved, rotary_dim). Positions restart at 0 at every
    document start in cu_seqlens. The gradients of q and k are those of the unrotated inputs.

    deterministic: a bit-reproducible dQ on the kernels (ordered adds; slower). It is also on for every call
    under torch.use_deterministic_algorithms(True) or FLAMIA_CUTE_DETERMINISTIC=1. The emulator always is.
    """
    # cu_seqlens' values are checked where the call runs (custom_ops.run_forward), once: under
    # torch.compile this function is traced, and reading them here would break the graph.
    check_attention_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)
    # an upper bound past the token count bounds nothing more; RoPE tables and grids are sized by it
    max_seqlen_q, max_seqlen_k = (m if isinstance(m, torch.SymInt) else int(m) for m in (max_seqlen_q, max_seqlen_k))
    max_seqlen_q, max_seqlen_k = min(max_seqlen_q, q.shape[0]), min(max_seqlen_k, k.shape[0])
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    rec = resolve_recipe(recipe)
    scale = float(softmax_scale) if softmax_scale is not None else default_softmax_scale(q.shape[-1])
    rot = resolve_rotary(rotary, q.shape[-1], max(max_seqlen_q, max_seqlen_k), q.device)
    rope = kernel_tables(rot) if rot is not None else (None, None)
    rope_interleaved = rot.interleaved if rot is not None else False

    def why_not_call(kernels):
        if kernels == "sm100":
            return why_not_sm100(rec, causal, q, k, cu_seqlens_q, cu_seqlens_k, rot)
        return why_not_kernels(rec, causal, q, k, cu_seqlens_q, cu_seqlens_k, rot)

    chosen, why_not = choose_backend(backend, q.device, why_not_call)
    if why_not and backend == "auto" and _capability(q.device):  # a GPU call on the emulator; CPU: no warning
        _warn_fallback(why_not)
    from .custom_ops import Attention, attention, recipe_key, run_forward

    fwd_args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, recipe_key(rec),
                chosen, *rope, rope_interleaved)
    args = (*fwd_args, deterministic)
    # the custom ops where something watches the dispatcher: torch.compile, and dispatch modes in eager, such
    # as selective activation checkpointing (a policy can then save flamia_cute::varlen_fwd's outputs instead
    # of recomputing them), FakeTensorMode and FlopCounterMode; else the autograd Function, which skips the
    # custom op's dispatch (host time)
    # meta tensors (a model built on the meta device) take the custom ops too: their fake implementations
    # give the outputs' shapes without reading values
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0 or q.device.type == "meta":
        out, lse = attention(*args)  # traceable, with fake implementations
    elif torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out, lse = Attention.apply(*args)
    else:  # no backward will run: nothing to save (and deterministic, the backward's, has no use)
        out, lse, _ = run_forward(*fwd_args, save=False)
    return (out, lse) if return_lse else out


# cu_seqlens of a dense batch, by (rows, tokens per row, device): one tensor per shape, so the check of its
# values (validation.check_cu_seqlens_values) reads a GPU tensor once, not on every call
_ROW_STARTS: dict[tuple, torch.Tensor] = {}
_ROW_STARTS_MAX = 64


def _row_starts(batch: int, seqlen: int, like: torch.Tensor) -> torch.Tensor:
    from .validation import has_no_values

    key, fake = (batch, seqlen, str(like.device)), has_no_values(like)
    cu = None if fake else _ROW_STARTS.get(key)
    if cu is None:
        cu = torch.arange(batch + 1, dtype=torch.int32, device=like.device) * seqlen
        # kept only when real and made by eager code: a store while torch.compile traces would change what the
        # graph's guards saw (a second compile), and a fake tensor belongs to its mode
        if not fake and not torch.compiler.is_compiling():
            if len(_ROW_STARTS) >= _ROW_STARTS_MAX:
                _ROW_STARTS.pop(next(iter(_ROW_STARTS)))
            _ROW_STARTS[key] = cu
    return cu


def flamia_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = True,
    recipe: str | Recipe = DEFAULT_RECIPE,
    backend: str = "auto",
    return_lse: bool = False,
    rotary: Rotary | RotaryConfig | None = None,
    deterministic: bool = False,
):
    """flamia_attn_varlen_func for a dense batch, FlashAttention's flash_attn_func layout: q (batch, seqlen_q,
    heads, head_dim), k and v (batch, seqlen_k, kv_heads, head_dim); each batch row is one document (its own
    scales, no attention across rows). causal defaults to True (flash_attn_func's to False). With causal and
    seqlen_q < seqlen_k, the queries are the last seqlen_q positions of their row's keys. softmax_scale, recipe,
    backend, rotary and deterministic as flamia_attn_varlen_func's. Returns out (batch, seqlen_q, heads,
    head_dim), and with return_lse also lse (batch, heads, seqlen_q) fp32."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, seqlen, heads, head_dim), got rank {t.dim()}")
    B, Sq, H, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"q, k, v must have the same batch size, got {B}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same seqlen, got {k.shape[1]} and {v.shape[1]}")
    Sk = k.shape[1]
    if B == 0 or Sq == 0 or Sk == 0:
        raise ValueError(f"q, k and v need at least one row and one position, got q {tuple(q.shape)} and k "
                         f"{tuple(k.shape)}")
    if causal and Sq > Sk:
        raise ValueError(f"causal: seqlen_q ({Sq}) must not exceed seqlen_k ({Sk}) (queries are the last positions "
                         "of their row's keys)")
    cu_q = _row_starts(B, Sq, q)
    cu_k = cu_q if Sk == Sq else _row_starts(B, Sk, k)
    res = flamia_attn_varlen_func(q.reshape(B * Sq, H, D), k.reshape(B * Sk, *k.shape[2:]),
                                  v.reshape(B * Sk, *v.shape[2:]), cu_q, cu_k, Sq, Sk, softmax_scale, causal, recipe,
                                  backend, return_lse, rotary, deterministic)
    if not return_lse:
        return res.view(B, Sq, H, D)
    out, lse = res
    return out.view(B, Sq, H, D), lse.view(H, B, Sq).transpose(0, 1).contiguous()
