"""The GPU path of flamia_attn_varlen_func on sm_90a: fused quantization + the FP8 forward kernel.

The autograd context keeps the FP8 operands and scales the forward used (never
the bf16 inputs); the sm_90a backward kernel (recipes with bf16 dS: bf16_ds_backward)
recomputes from exactly those, so forward and backward stay consistent. The other
recipes, and FLAMIA_CUTE_BWD=emulate, run the emulator's backward from the same
saved operands instead.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from .quant import quantize_thd_per_tensor
from .recipes import NAMED_RECIPES, Recipe

# Recipes the sm_90a kernels implement, with the token-block size of K and V. PER_TENSOR: the
# per-token kernels fed one scale per tensor (quantized by torch: the cuDNN-like leaky control, run
# at kernel speed so that training can compare it).
PER_TENSOR = 0
KERNEL_RECIPES = {"fp8_token": 1, "fp8_tokenblock": 128, "fp8_tensor_current": PER_TENSOR, "fp8_tokenblock_dsbf16": 128}


def bf16_ds_backward(recipe_name: str) -> bool:
    """Whether the recipe's backward runs the sm_90a backward kernel (attention_bwd_dsbf16_sm90: dS cast
    to bf16, dV folded per document); the others (e4m3 dS) run the emulator's backward from the
    forward's saved operands."""
    rec = NAMED_RECIPES[recipe_name]
    return rec.ds_cast == "bf16" and rec.dv_fold == "document"


def layout_block(block: int) -> int:
    """The token-block size of the quantized layouts a KERNEL_RECIPES entry uses (PER_TENSOR: per token)."""
    return max(block, 1)


@functools.cache
def _dsl_importable() -> bool:
    try:
        import cutlass  # noqa: F401
    except Exception:
        return False
    return True


def cute_attention_available(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) == (9, 0) and _dsl_importable()


def kernel_block_tokens(recipe: Recipe) -> int | None:
    """K/V token-block size if the sm_90a kernels implement this recipe, else None."""
    for name, block in KERNEL_RECIPES.items():
        if recipe == NAMED_RECIPES[name]:
            return block
    return None


def unsupported_reason(recipe: Recipe, causal: bool, q, k, cu_q, cu_k) -> str | None:
    if kernel_block_tokens(recipe) is None:
        return f"recipe {recipe.name!r} has no sm_90a kernel (kernels: {sorted(KERNEL_RECIPES)})"
    if not causal:
        return "causal=False has no sm_90a kernel"
    if q.shape[0] != k.shape[0] or not (cu_q is cu_k or torch.equal(cu_q, cu_k)):
        return "the sm_90a kernel is self-attention only (cu_seqlens_q == cu_seqlens_k)"
    if q.shape[-1] not in (64, 128):
        return f"head_dim {q.shape[-1]} has no sm_90a forward kernel (64, 128)"
    return None


def launch_layouts(cfg, forward_only: bool = False, ds_bf16: bool = False):
    """A Q/K/V launch config reduced to the layouts that will be read: the forward's only
    (forward_only), which are also all that the bf16-dS backward reads (ds_bf16), or all (the other
    recipes' emulated backward). Layouts only: the tuned launch settings stay."""
    from .sm90.quantize import forward_only as forward_only_config

    return forward_only_config(cfg) if forward_only or ds_bf16 else cfg


def _memoized(key: tuple, build):
    """build() once per key (plus the tuning switch) while the tuned records stay loaded
    (tuning.derived_memo): every attention call asks for the same configs, and building and tuning
    them cost ~150 µs of host time per training call on the H200's host (session 25)."""
    from .tuning import derived_memo

    key = (*key, os.environ.get("FLAMIA_CUTE_NO_TUNING"))
    memo = derived_memo()
    got = memo.get(key)
    if got is None:
        got = memo[key] = build()
    return got


def quantize_launch_config(head_dim: int, heads_q: int, heads_kv: int, block: int, max_seqlen: int,
                           total_tokens: int, num_docs: int, forward_only: bool = False, ds_bf16: bool = False):
    """The Q/K/V launch's MultiQuantizeConfig: tuned for the workload (not PER_TENSOR, which torch
    quantizes), reduced to the layouts that will be read (launch_layouts); memoized."""
    from .sm90.quantize import qkv_config
    from .tuning import tuned_quantize_config

    def build():
        cfg = qkv_config(head_dim, heads_q, heads_kv, layout_block(block))
        if block != PER_TENSOR:
            cfg = tuned_quantize_config(cfg, max_seqlen, total_tokens, num_docs)
        return launch_layouts(cfg, forward_only, ds_bf16)

    return _memoized(("qkv", head_dim, heads_q, heads_kv, block, int(max_seqlen), total_tokens, num_docs,
                      forward_only, ds_bf16), build)


def quantize_operands(q, k, v, cu, block: int, max_seqlen: int, forward_only: bool = False, ds_bf16: bool = False):
    """Q, K, V in ONE fused launch: Q per token; K, V per block plus the per-token diagonal copies.

    forward_only: only the orientations the forward reads (quantize_sm90.forward_only); ds_bf16: the
    same, all that the bf16-dS backward reads too (launch_layouts). What is not
    written is None in the result."""
    from .sm90.quantize import fused_quantize_multi_sm90

    cfg = quantize_launch_config(q.shape[2], q.shape[1], k.shape[1], block, max_seqlen, q.shape[0], cu.numel() - 1,
                                 forward_only, ds_bf16)
    if block == PER_TENSOR:
        return _quantize_operands_per_tensor(q, k, v, cu, cfg)
    (qq, _), (kq, kt), (vq, vt) = fused_quantize_multi_sm90((q, k, v), cu, cfg)
    return qq, (kq, kt), (vq, vt)


def _quantize_operands_per_tensor(q, k, v, cu, cfg):
    """PER_TENSOR: quant.quantize_thd_per_tensor of Q, K, V written into the views of ONE allocation laid
    out as the fused launch `cfg` (per token) lays it out, so the kernels and the custom op's saved buffer
    treat it as theirs. torch ops, not a fused kernel: this recipe is the control, not the product."""
    from .quant import transposed_tokens
    from .sm90.quantize import _alloc_outputs, quantized_outputs

    sets = _alloc_outputs(cfg, q.shape[0], transposed_tokens(q.shape[0], cu.numel() - 1), q.device)
    for x, part, ps in zip((q, k, v), cfg.parts, sets, strict=True):
        ref = quantize_thd_per_tensor(x, cu, transposed=part.emit_transposed, pv_order=part.dt_pv_order)
        for dst, src in zip(ps[0], (ref.data_td, ref.data_dt, ref.scale), strict=True):
            if dst is not None:
                dst.copy_(src)
    (qq, _), (kq, kt), (vq, vt) = quantized_outputs(cfg, sets)
    return qq, (kq, kt), (vq, vt)


def forward_config(head_dim: int, heads_q: int, heads_kv: int, max_seqlen: int, total_tokens: int, num_docs: int,
                   block: int):
    """The forward kernel's FwdConfig for a call (tuned for its workload class); memoized."""
    from .sm90.attention_fwd import FwdConfig, short_pairs_default
    from .tuning import tuned_fwd_config

    def build():
        cfg = FwdConfig(head_dim=head_dim, qhead_per_kvhead=heads_q // heads_kv, diagonal_copy=block > 1,
                        short_pairs=short_pairs_default(total_tokens, num_docs))
        return tuned_fwd_config(cfg, max_seqlen, total_tokens, num_docs)

    return _memoized(("fwd", head_dim, heads_q, heads_kv, int(max_seqlen), total_tokens, num_docs, block), build)


def forward_kernels(q, k, v, cu, max_seqlen, softmax_scale, block, forward_only: bool = False,
                    ds_bf16: bool = False):
    """Quantize + forward kernel. Returns (out bf16, lse (H, T) fp32, saved quantized operands);
    forward_only: a call that needs no backward (the saved operands lack the backward's layouts);
    ds_bf16: the backward to come is the bf16-dS kernel (no Q^T, K^T: launch_layouts)."""
    from .sm90.attention_fwd import flamia_fwd_sm90

    cfg = forward_config(q.shape[2], q.shape[1], k.shape[1], max_seqlen, q.shape[0], cu.numel() - 1, block)
    qq, (kq, kt), (vq, vt) = quantize_operands(q, k, v, cu, block, max_seqlen, forward_only, ds_bf16)
    out, lse = flamia_fwd_sm90(
        qq.data_td, qq.scale, kq.data_td, kq.scale, vq.data_dt, vq.scale,
        kt.data_td if kt else None, kt.scale if kt else None, vt.data_dt if vt else None, vt.scale if vt else None,
        cu, max_seqlen, softmax_scale, cfg,
    )
    return out, lse, (qq, (kq, kt), (vq, vt))


def _env_flag(name: str, default: bool) -> bool:
    """A 0/1 environment switch; unset (or empty) gives `default`, anything else is an error."""
    flag = os.environ.get(name, "")
    if flag not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {flag!r}")
    return default if flag == "" else flag == "1"


def forward_only_quantization() -> bool:
    """Calls without a backward quantize only the forward's operand layouts (default), unless
    FLAMIA_CUTE_FWD_ONLY_QUANT=0."""
    return _env_flag("FLAMIA_CUTE_FWD_ONLY_QUANT", True)


def deterministic_backward() -> bool:
    """Bit-reproducible dQ: torch.use_deterministic_algorithms(True), or FLAMIA_CUTE_DETERMINISTIC=1."""
    return _env_flag("FLAMIA_CUTE_DETERMINISTIC", False) or torch.are_deterministic_algorithms_enabled()


def backward_config(qq, kq, kt, cu, max_seqlen):
    """The backward kernel's config for the saved operands, tuned for this workload class when
    `flamia-cute tune` measured it, deterministic when asked (deterministic_backward). Memoized by the
    operands' shapes."""
    key = ("bwd", tuple(qq.data_td.shape), tuple(kq.data_td.shape), kt is not None, cu.numel() - 1, int(max_seqlen),
           deterministic_backward())
    return _memoized(key, lambda: _backward_config(qq, kq, kt, cu, max_seqlen))


def _backward_config(qq, kq, kt, cu, max_seqlen):
    from .schedules.varlen_tiles import short_pairs_worth
    from .sm90.attention_bwd import default_config, short_pairs_supported
    from .tuning import tuned_bwd_dsbf16_config

    if deterministic_backward():  # the ordered atomics path, untuned
        return default_config(qq, kq, kt, deterministic=True)
    total, num_docs = qq.data_td.shape[0], cu.numel() - 1
    default = default_config(qq, kq, kt, max_seqlen=max_seqlen)
    # two short documents per CTA for packs of short documents (a tuned record may say otherwise)
    if short_pairs_worth(total, num_docs) and short_pairs_supported(default):
        default = dataclasses.replace(default, short_pairs=True)
    return tuned_bwd_dsbf16_config(default, max_seqlen, total, num_docs)


def backward_kernels(dout, out, lse, qq, kq, vq, kt, vt, cu, max_seqlen, softmax_scale, block: int = 1):
    """The sm_90a backward kernel (bf16 dS) from the forward's saved operands (see backward_config);
    block: the recipe's KERNEL_RECIPES entry (PER_TENSOR quantizes dO with one scale, and D by torch)."""
    from .sm90.attention_bwd import flamia_bwd_dsbf16_sm90_from_saved
    from .sm90.quantize import dout_config

    cfg = backward_config(qq, kq, kt, cu, max_seqlen)
    kw = {}
    if block == PER_TENSOR:
        pv_order = dout_config(dout.shape[2], dout.shape[1]).dt_pv_order
        kw["do_quantized"] = quantize_thd_per_tensor(dout.to(torch.bfloat16), cu, pv_order=pv_order)
        kw["delta"] = (dout.float() * out.float()).sum(-1).t().contiguous()  # D = rowsum(dO * O), as the emulator
    return flamia_bwd_dsbf16_sm90_from_saved(dout, out, lse, qq, kq, vq, kt, vt, cu, max_seqlen, softmax_scale,
                                             config=cfg, **kw)


def backward_backend() -> str:
    """The sm_90a backward kernel (default, for the recipes that have one: bf16_ds_backward), or with
    FLAMIA_CUTE_BWD=emulate the emulator on the GPU from the forward's saved FP8 operands."""
    choice = os.environ.get("FLAMIA_CUTE_BWD", "cute")
    if choice not in ("emulate", "cute"):
        raise ValueError(f"FLAMIA_CUTE_BWD must be 'emulate' or 'cute', got {choice!r}")
    return choice


class CuteAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, cu, max_seqlen, softmax_scale, recipe, block):
        out, lse, saved = forward_kernels(q, k, v, cu, max_seqlen, softmax_scale, block,
                                          ds_bf16=bf16_ds_backward(recipe.name))
        fctx.saved = saved
        fctx.meta = (cu, softmax_scale, recipe, q.dtype, max_seqlen)
        fctx.save_for_backward(out, lse)
        fctx.mark_non_differentiable(lse)
        return (out if out.dtype == q.dtype else out.to(q.dtype)), lse

    @staticmethod
    def backward(fctx, dout, _dlse):
        from .emulator import EmulatorContext, emulate_backward, operand_from_quantized

        out, lse = fctx.saved_tensors
        cu, scale, recipe, dt, max_seqlen = fctx.meta
        qq, (kq, kt), (vq, vt) = fctx.saved
        if backward_backend() == "cute" and bf16_ds_backward(recipe.name):
            grads = backward_kernels(dout.contiguous(), out, lse, qq, kq, vq, kt, vt, cu, max_seqlen, scale,
                                     kernel_block_tokens(recipe))
            # the kernels' grads are bf16: .to() only for fp16 inputs (a no-op .to costs host time too)
            return (*(g if g.dtype == dt else g.to(dt) for g in grads), None, None, None, None, None)
        ectx = EmulatorContext(recipe, scale, True, cu, cu, operand_from_quantized(qq),
                               operand_from_quantized(kq, kt), operand_from_quantized(vq, vt, cu), out, lse)
        dq, dk, dv = emulate_backward(dout.contiguous(), ectx)
        return dq.to(dt), dk.to(dt), dv.to(dt), None, None, None, None, None
