"""Public API: flamia_attn_varlen_func, differentiable, over packed documents."""

from __future__ import annotations

import torch

from .cute_backend import CuteAttention, cute_attention_available, kernel_block_tokens, unsupported_reason
from .emulator import EmulatorContext, default_softmax_scale, emulate_backward, emulate_forward
from .recipes import DEFAULT_RECIPE, NAMED_RECIPES, Recipe, resolve_recipe
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


class _EmulatedAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, cu_q, cu_k, softmax_scale, causal, recipe):
        out, lse, ectx = emulate_forward(q, k, v, cu_q, cu_k, softmax_scale, causal, recipe)
        fctx.emu = ectx  # FP8 operands, scales, O and LSE: never the bf16 inputs
        fctx.in_dtype = q.dtype
        fctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(fctx, dout, _dlse):
        ectx: EmulatorContext = fctx.emu
        dq, dk, dv = emulate_backward(dout.contiguous(), ectx)
        dt = fctx.in_dtype
        return dq.to(dt), dk.to(dt), dv.to(dt), None, None, None, None, None


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
    # Under torch.compile the values of cu_seqlens are not read on the host (that would break the
    # graph); the custom op checks them when it runs.
    compiling = torch.compiler.is_compiling()
    check_attention_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                           check_values=not compiling)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    rec = resolve_recipe(recipe)
    scale = float(softmax_scale) if softmax_scale is not None else default_softmax_scale(q.shape[-1])
    why_not = None
    if backend != "emulate" and _kernels_available(q.device):
        why_not = unsupported_reason(rec, causal, q, k, cu_seqlens_q, cu_seqlens_k)
    chosen = pick_backend(backend, q.device, why_not)
    if NAMED_RECIPES.get(rec.name) == rec and (chosen == "emulate" or compiling):
        # named recipes: the torch.library custom ops (traceable by torch.compile, fake implementations).
        # Eager kernel calls keep CuteAttention, the path verified on the H200; the custom op's kernel
        # path (used under torch.compile on a GPU) has not run on a GPU yet.
        from .custom_ops import attention

        out, lse = attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                             rec.name, chosen)
    elif chosen == "cute" and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        # no backward will run: quantize only what the forward reads (about half the bytes written)
        from .cute_backend import forward_kernels, forward_only_quantization

        out, lse, _ = forward_kernels(q, k, v, cu_seqlens_q, max_seqlen_q, scale, kernel_block_tokens(rec),
                                      forward_only=forward_only_quantization(), row_sum=rec.row_sum)
        out = out if out.dtype == q.dtype else out.to(q.dtype)
    elif chosen == "cute":
        out, lse = CuteAttention.apply(q, k, v, cu_seqlens_q, max_seqlen_q, scale, rec, kernel_block_tokens(rec))
    else:
        out, lse = _EmulatedAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, rec)
    return (out, lse) if return_lse else out
