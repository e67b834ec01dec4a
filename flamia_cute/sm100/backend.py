"""Backend "sm100" of flamia_attn_varlen_func: the sm_100a MXFP8 forward, opt-in (interface.SM100_ENV).

No Blackwell kernel here has run on hardware, and the MXFP8 backward has no kernel. A call with
gradients runs the kernel forward and the emulator's backward on the forward's saved operands:
Q, K and V decoded from the very bytes the kernel read (e4m3 codes times their E8M0 chunk scales,
exact in fp32) and the diagonal's bf16 K and V. Decoding, rather than quantizing again with the
emulator, makes the backward differentiate the forward that ran by construction; the two agree
bit-exactly anyway (tests/test_quantize_mx_kernel.py). Only Q blocked along tokens, which dK = dS^T Q
reduces over and no forward reads, comes from the emulator's quantizer, as on the emulator path.
"""

from __future__ import annotations

import torch


def forward(q, k, v, cu, max_seqlen: int, softmax_scale: float, save: bool = True):
    """(out bf16 (T, H, D), lse fp32 (H, T), the emulator's (q, k, v) EmuOperands, or None without save)."""
    from . import attention_fwd, quantize_mx

    q, k, v = (t.contiguous() for t in (q, k, v))
    ops = quantize_mx.quantize_mx_forward(q, k, v, cu)
    out, lse = attention_fwd.flamia_fwd_sm100(ops, cu, max_seqlen, softmax_scale)
    return out, lse, (saved_operands(ops, q, cu) if save else None)


def saved_operands(ops, q, cu):
    """The emulator's (q, k, v) EmuOperands (recipe mxfp8) of quant.mx_layout.MxForwardOperands `ops`;
    q: the bf16 input (for Q's blocks along tokens only)."""
    from ..emulator import EmuOperand, quantize_operand
    from ..quant.mx_layout import MX_BLOCK, decode_dim_rows, decode_token_rows
    from ..recipes import NAMED_RECIPES

    rec = NAMED_RECIPES["mxfp8"]
    cu64 = cu.to(device=ops.q.device, dtype=torch.int64)
    v_vals = decode_dim_rows(ops.v, ops.v_sf, cu64)
    k_vals = decode_token_rows(ops.k, ops.k_sf, cu64)
    qo = quantize_operand(q, cu64, rec.q, False, rec)
    qo.along_d = decode_token_rows(ops.q, ops.q_sf, cu64)
    # K's and V's 32 x 32 tile scales serve both orientations; distinct tensors, as the emulator's (the
    # custom op's saved outputs must not alias)
    kd, vd = ops.k_diag.float(), ops.v_diag.float()
    ko = EmuOperand(k_vals, k_vals.clone(), None, kd, kd, block_tokens=MX_BLOCK)
    vo = EmuOperand(v_vals.contiguous(), v_vals.clone(), None, vd, vd, block_tokens=MX_BLOCK)
    return qo, ko, vo
