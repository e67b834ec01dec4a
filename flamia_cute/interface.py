"""Public API: flamia_attn_varlen_func, differentiable, over packed documents."""

from __future__ import annotations

import torch

from .cute_backend import cute_attention_available
from .emulator import default_softmax_scale
from .plan import why_not_kernels
from .recipes import DEFAULT_RECIPE, Recipe, resolve_recipe
from .validation import check_attention_inputs

BACKENDS = ("auto", "emulate", "cute")


def pick_backend(backend: str, device: torch.device, why_not_cute: str | None = None) -> str:
    """'auto' takes the kernels where they exist for this call; 'cute' insists and says why it cannot."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not _kernels_available(device):
        why_not_cute = f"the sm_90a kernels need an sm_90 GPU and the CuTe DSL (device {device})"
    if backend == "auto":
        return "emulate" if why_not_cute else "cute"
    if backend == "cute" and why_not_cute:
        raise NotImplementedError(f"backend='cute': {why_not_cute}; use backend='emulate' or 'auto'")
    return backend


@torch.compiler.assume_constant_result
def _kernels_available(device: torch.device) -> bool:
    # a host-side fact: torch.compile evaluates it once while tracing instead of tracing into it
    return cute_attention_available(device)


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
):
    """FP8 attention over packed variable-length documents (THD layout).

    q: (total_q, heads, head_dim); k, v: (total_k, kv_heads, head_dim) with
    heads % kv_heads == 0 (GQA). cu_seqlens_*: int32 prefix sums of document
    lengths. Returns out (total_q, heads, head_dim) in q's dtype, and with
    return_lse also lse (heads, total_q) fp32 (natural log).
    """
    # cu_seqlens' values are checked where the call runs (custom_ops.run_forward), once: under
    # torch.compile this function is traced, and reading them here would break the graph.
    check_attention_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    rec = resolve_recipe(recipe)
    scale = float(softmax_scale) if softmax_scale is not None else default_softmax_scale(q.shape[-1])
    why_not = None
    if backend != "emulate" and _kernels_available(q.device):
        why_not = why_not_kernels(rec, causal, q, k, cu_seqlens_q, cu_seqlens_k)
    chosen = pick_backend(backend, q.device, why_not)
    from .custom_ops import Attention, attention, recipe_key, run_forward

    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, recipe_key(rec), chosen)
    if torch.compiler.is_compiling():
        out, lse = attention(*args)  # the custom ops: traceable, with fake implementations
    elif torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out, lse = Attention.apply(*args)
    else:  # no backward will run: nothing to save
        out, lse, _ = run_forward(*args)
    return (out, lse) if return_lse else out
