"""Host side of the sm_90a backward shared by its kernel, the tuner and the tests: dO's quantization
with D = rowsum(dO * O) (preprocess_bwd), the output buffers, the grid's size checks (the CTA
order itself, backward_grid and backward_work_item, is in flamia_cute.tile_scheduler).
"""

from __future__ import annotations

import torch


def preprocess_bwd(dout: torch.Tensor, out: torch.Tensor, cu_seqlens: torch.Tensor, dv_ref_group: int = 0,
                   delta_quantized: bool = False):
    """D = rowsum(dO * O) (H, T) fp32 and dO quantized per token in both orientations (QuantizedTHD).

    One launch of the fused quantization kernel: dO bit-exact with quant.quantize_thd, and D from
    the same read of dO (fp32 sums of exact bf16 products; the order differs from torch's by a
    rounding or two). With dv_ref_group g > 0 it also returns the bf16-dS backward's dV fold
    references (H / g, docs) fp32 from the same launch (bitwise dv_fold_reference's; one memset).
    delta_quantized: D from dO's e4m3 values, sum(codes * O) * scale (recipes.DELTAS "quantized").
    """
    from .quantize import dout_delta_config, quantize_with_rowdot_sm90

    dout = dout if dout.dtype == torch.bfloat16 else dout.to(torch.bfloat16)
    out = out if out.dtype == torch.bfloat16 else out.to(torch.bfloat16)
    T, H, D = dout.shape
    docmax = None
    if dv_ref_group:
        docmax = torch.zeros(H // dv_ref_group, cu_seqlens.numel() - 1, dtype=torch.int32, device=dout.device)
    doq, delta = quantize_with_rowdot_sm90(dout, out, cu_seqlens, dout_delta_config(D, H, dv_ref_group, delta_quantized),
                                           docmax=docmax)
    if not dv_ref_group:
        return delta, doq
    from ..recipes import FOLD_REF_MIN

    # empty documents (never raised) and all-zero dO stay at the fold's floor, as dv_fold_reference
    return delta, doq, docmax.view(torch.float32).clamp_min(FOLD_REF_MIN)


def backward_outputs(T: int, H: int, Hk: int, D: int, device, poison: bool = False, zero_dq: bool = True):
    """The backward kernel's outputs: the fp32 dQ accumulator and dK, dV bf16 (every row written by the
    kernel; NaN first with `poison`, as the tests ask). zero_dq: the accumulator zeroed here (the kernel
    adds into it); False when the caller zeroes it (on a side stream)."""
    dq_acc = (torch.zeros if zero_dq else torch.empty)(T, H, D, dtype=torch.float32, device=device)
    dk = torch.empty(T, Hk, D, dtype=torch.bfloat16, device=device)
    dv = torch.empty(T, Hk, D, dtype=torch.bfloat16, device=device)
    if poison:
        dk.fill_(float("nan"))
        dv.fill_(float("nan"))
    return dq_acc, dk, dv


def backward_grid_blocks(T: int, H: int, D: int, T_dt: int, num_docs: int, max_seqlen: int, key_block: int) -> int:
    """Key blocks per document of the backward grid (heads, documents, key blocks), after checking
    that the launch fits 32-bit indexing and the grid limits (errors name the argument at fault)."""
    max_n_blocks = (int(max_seqlen) + key_block - 1) // key_block
    if T > 0 and num_docs > 0 and max_n_blocks > 0:
        if H * D * T_dt >= 2**31 or T * H * D >= 2**31:
            raise ValueError("tensor too large for 32-bit indexing")
        if max_n_blocks > 65535 or num_docs > 65535:
            raise ValueError(f"grid too large: max_seqlen {max_seqlen} (at most 65535 blocks of {key_block}) or "
                             f"{num_docs} documents (at most 65535)")
    return max_n_blocks
