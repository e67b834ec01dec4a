"""Host side of the sm_90a backward shared by its kernel, the tuner and the tests: dO's quantization
with D = rowsum(dO * O) (preprocess_bwd), the output buffers, the grid's size checks and the CTA
order (backward_grid, backward_work_item: trace-time and in-kernel index math over plain or DSL
integers).
"""

from __future__ import annotations

import torch


def preprocess_bwd(dout: torch.Tensor, out: torch.Tensor, cu_seqlens: torch.Tensor, dv_ref_group: int = 0):
    """D = rowsum(dO * O) (H, T) fp32 and dO quantized per token in both orientations (QuantizedTHD).

    One launch of the fused quantization kernel: dO bit-exact with quant.quantize_thd, and D from
    the same read of dO (fp32 sums of exact bf16 products; the order differs from torch's by a
    rounding or two). With dv_ref_group g > 0 it also returns the bf16-dS backward's dV fold
    references (H / g, docs) fp32 from the same launch (bitwise dv_fold_reference's; one memset).
    """
    from .quantize import dout_delta_config, quantize_with_rowdot_sm90

    dout = dout if dout.dtype == torch.bfloat16 else dout.to(torch.bfloat16)
    out = out if out.dtype == torch.bfloat16 else out.to(torch.bfloat16)
    T, H, D = dout.shape
    docmax = None
    if dv_ref_group:
        docmax = torch.zeros(H // dv_ref_group, cu_seqlens.numel() - 1, dtype=torch.int32, device=dout.device)
    doq, delta = quantize_with_rowdot_sm90(dout, out, cu_seqlens, dout_delta_config(D, H, dv_ref_group),
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


def backward_grid(raster: str, num_kv_heads, num_docs, max_n_blocks, head_window: int = 1) -> list:
    """Launch grid (x fastest) of a backward kernel's CTA order: "heads" runs the KV head fastest and
    the key block slowest (key block 0, the most query tiles, of every head and document first);
    "blocks" runs the key block fastest (the CTAs of one (document, KV head) together, sharing its Q,
    dO and dQ accumulator in L2). head_window W > 1 ("blocks" only): documents in order, and in each
    the KV heads in windows of W, a window's key blocks in order with its W heads fastest, so each
    window's CTAs start longest first (its block 0 of every head, then block 1, ...) and a long CTA
    cannot be the last one issued (W = 1 is the plain "blocks" order). Trace time: `raster` and
    `head_window` are config values; num_kv_heads % head_window == 0 (the host checks it)."""
    if raster == "blocks":
        if head_window == 1:  # apart from the general form, so the plain order's code stays as it was
            return [max_n_blocks, num_kv_heads, num_docs]
        return [max_n_blocks * head_window, num_kv_heads // head_window, num_docs]
    return [num_kv_heads, num_docs, max_n_blocks]


def backward_work_item(raster: str, block_idx, head_window: int = 1) -> tuple:
    """(KV head, document, key block) of this CTA under backward_grid(raster, ..., head_window)."""
    x, y, z = block_idx
    if raster == "blocks":
        if head_window == 1:  # the plain order without the window's index math (its SASS unchanged)
            return y, z, x
        return y * head_window + x % head_window, z, x // head_window
    return x, y, z
