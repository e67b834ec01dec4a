"""The sm_90a kernels of one call, run from its Plan: the Q/K/V quantization, the forward, the backward.

The backward recomputes S and P from exactly the FP8 operands and scales the forward saved (never
the bf16 inputs), so forward and backward stay consistent. A plan without a backward config (the
e4m3-dS recipes) runs the emulator's backward from the same saved operands.
"""

from __future__ import annotations

import functools

import torch

from .plan import Plan, why_not_rotations
from .recipes import NAMED_RECIPES


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


def quantize_operands(q, k, v, cu, block: int, max_seqlen: int, config=None, rope_tables=None):
    """Q, K, V in ONE fused launch: Q per token; K, V per `block` tokens (1 or 128) plus, for blocks,
    the per-token diagonal copies; the forward's layouts. config: the launch (a Plan's qkv, which says
    how Q and K are rotated), else plan.qkv_launch's for this workload. rope_tables: (cos, sin) fp32
    (rotary.kernel_tables) when the launch applies RoPE."""
    from .plan import qkv_launch
    from .sm90.quantize import fused_quantize_multi_sm90

    if config is None:
        config = qkv_launch(q.shape[2], q.shape[1], k.shape[1], block, max_seqlen, q.shape[0], cu.numel() - 1)
    (qq, _), (kq, kt), (vq, vt) = fused_quantize_multi_sm90((q, k, v), cu, config, rope_tables=rope_tables)
    return qq, (kq, kt), (vq, vt)


def _tables(rotary):
    return (rotary.cos, rotary.sin) if rotary is not None else None


def quantize_per_tensor(q, k, v, cu, config, cu_k=None):
    """The control's one scale per tensor (quant.quantize_thd_per_tensor), written into the views of ONE
    allocation laid out as the per-token launch `config` lays it out, so the kernels and the saved
    buffer treat it as theirs. torch ops, not a fused kernel: this recipe is the control, not the product.
    cu_k: K and V's own documents (separate keys; sm90.quantize.qkv_layout_outputs)."""
    from .quant import output_views, quantize_thd_per_tensor
    from .sm90.quantize import quantized_outputs, runtime_qkv_layout

    cu_k = cu if cu_k is None else cu_k
    plan, nbytes = runtime_qkv_layout(config, q.shape[0], k.shape[0], cu.numel() - 1)
    sets = output_views(torch.empty(nbytes, dtype=torch.uint8, device=q.device), plan)
    for x, c, part, ps in zip((q, k, v), (cu, cu_k, cu_k), config.parts, sets, strict=True):
        ref = quantize_thd_per_tensor(x, c, transposed=part.emit_transposed, pv_order=part.dt_pv_order)
        for dst, src in zip(ps[0], (ref.data_td, ref.data_dt, ref.scale), strict=True):
            if dst is not None:
                dst.copy_(src)
    (qq, _), (kq, kt), (vq, vt) = quantized_outputs(config, sets)
    return qq, (kq, kt), (vq, vt)


def quantize(plan: Plan, q, k, v, cu, max_seqlen: int, rotary=None, cu_k=None):
    """The plan's Q/K/V operands, as the forward reads them and the backward saves them. A deterministic function
    of the inputs (power-of-two scales from the amax's bits): quantizing again gives the same bytes, which is how
    the torch backend's backward gets the forward's operands (torch_backend.py). rotary: the call's
    rotary.Rotary (fp32 tables) when the plan's launch applies RoPE. cu_k: the key documents of a
    separate-keys plan (K and V quantized over them: blocks from each key document's start); such a
    plan has no rotations (plan.why_not_rotations)."""
    if plan.separate_keys and rotary is not None:
        raise ValueError(why_not_rotations(NAMED_RECIPES[plan.recipe], rotary, True))
    if plan.scaling == "tensor":  # the control: rotated by torch (the specification), then quantized
        from .emulator import qk_transform, transform_inputs

        cu_k = cu_k if plan.separate_keys else None
        q, k = transform_inputs(q, k, cu, cu if cu_k is None else cu_k, qk_transform(NAMED_RECIPES[plan.recipe], rotary))
        return quantize_per_tensor(q, k, v, cu, plan.qkv, cu_k)
    if plan.separate_keys:
        from .sm90.quantize import fused_quantize_qkv_separate_sm90

        (qq, _), (kq, kt), (vq, vt) = fused_quantize_qkv_separate_sm90(q, k, v, cu, cu_k, plan.qkv)
        return qq, (kq, kt), (vq, vt)
    return quantize_operands(q, k, v, cu, plan.block, max_seqlen, plan.qkv, _tables(rotary))


def forward(plan: Plan, q, k, v, cu, max_seqlen: int, softmax_scale: float, rotary=None, cu_k=None):
    """Quantize + forward kernel: (out bf16, lse (H, T) fp32, the quantized operands). cu_k: the key
    documents of a separate-keys plan (cross-length causal or non-causal)."""
    from .sm90.attention_fwd import flamia_fwd_sm90

    if plan.separate_keys and cu_k is None:
        raise ValueError("cu_k: a separate-keys plan needs the key documents")
    ops = quantize(plan, q, k, v, cu, max_seqlen, rotary, cu_k)
    qq, (kq, kt), (vq, vt) = ops
    out, lse = flamia_fwd_sm90(
        qq.data_td, qq.scale, kq.data_td, kq.scale, vq.data_dt, vq.scale,
        kt.data_td if kt else None, kt.scale if kt else None, vt.data_dt if vt else None, vt.scale if vt else None,
        cu, max_seqlen, softmax_scale, plan.fwd, cu_seqlens_k=cu_k if plan.separate_keys else None,
    )
    return out, lse, ops


def backward(plan: Plan, dout, out, lse, ops, cu, max_seqlen: int, softmax_scale: float, rotary=None, cu_k=None,
             max_seqlen_k: int | None = None):
    """dq, dk, dv (bf16) from the forward's saved operands: the backward kernel, or the emulator's
    backward where the plan has none (the e4m3-dS recipes); dq, dk in the caller's frame (rotary: the
    forward's). cu_k, max_seqlen_k: the key documents of a separate-keys plan."""
    qq, (kq, kt), (vq, vt) = ops
    rec = NAMED_RECIPES[plan.recipe]
    if plan.bwd is None:
        from .emulator import EmulatorContext, emulate_backward, operand_from_quantized, qk_transform

        cu_k = cu_k if plan.separate_keys else cu
        ectx = EmulatorContext(rec, softmax_scale, plan.fwd.causal, cu, cu_k, operand_from_quantized(qq),
                               operand_from_quantized(kq, kt), operand_from_quantized(vq, vt, cu_k), out, lse,
                               qk_transform(rec, rotary))
        return emulate_backward(dout, ectx)
    from .sm90.attention_bwd import flamia_bwd_dsbf16_sm90_from_saved

    kw = dict(rope_tables=_tables(rotary), dq_convert=plan.dq_convert, delta_quantized=rec.delta == "quantized")
    if plan.scaling == "tensor":  # the control's dO: one scale per tensor too, and D by torch
        from .quant import quantize_thd_per_tensor
        from .sm90.quantize import dout_config

        pv_order = dout_config(dout.shape[2], dout.shape[1]).dt_pv_order
        kw["do_quantized"] = quantize_thd_per_tensor(dout.to(torch.bfloat16), cu, pv_order=pv_order)
        kw["delta"] = (dout.float() * out.float()).sum(-1).t().contiguous()  # D = rowsum(dO * O), as the emulator
    if plan.separate_keys:
        kw.update(cu_seqlens_k=cu_k, max_seqlen_k=max_seqlen_k)
    return flamia_bwd_dsbf16_sm90_from_saved(dout, out, lse, qq, kq, vq, kt, vt, cu, max_seqlen, softmax_scale,
                                             config=plan.bwd, **kw)
