"""Host side of the sm_90a backward shared by its kernel, the tuner and the tests: dO's quantization
with D = rowsum(dO * O) (preprocess_bwd), the output buffers, the grid's size checks (the CTA
order itself, backward_grid and backward_work_item, is in flamia_cute.tile_scheduler).
"""

from __future__ import annotations

import torch


def preprocess_bwd(dout: torch.Tensor, out: torch.Tensor, cu_seqlens: torch.Tensor, dv_ref_group: int = 0,
                   delta_quantized: bool = True):
    """D = rowsum(dO * O) (H, T) fp32 and dO quantized per token in both orientations (QuantizedTHD).

    One launch of the fused quantization kernel: dO bit-exact with quant.quantize_thd, and D from
    the same read of dO (fp32 sums of exact bf16 products; the order differs from torch's by a
    rounding or two). With dv_ref_group g > 0 it also returns the bf16-dS backward's dV fold
    references (H / g, docs) fp32 from the same launch (bitwise dv_fold_reference's; one memset).
    delta_quantized: D from dO's e4m3 values, sum(codes * O) * scale (recipes.DELTAS "quantized", the
    default recipe's); False: from the bf16 dO.
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


def backward_outputs(T: int, H: int, Hk: int, D: int, device, poison: bool = False, zero_dq: bool = True,
                     Tk: int | None = None, dq_pad_rows: int = 0):
    """The backward kernel's outputs: the fp32 dQ accumulator and dK, dV bf16 (every row written by the
    kernel; NaN first with `poison`, as the tests ask). zero_dq: the accumulator zeroed here (the kernel
    adds into it); False when the caller zeroes it (on a side stream). Tk: the keys' tokens (default T)."""
    Tk = T if Tk is None else Tk
    # dq_pad_rows: rows allocated before row 0 that the kernel may add zeros into (attention_bwd.dq_pad_rows);
    # the accumulator returned is the view from row 0
    dq_acc = (torch.zeros if zero_dq else torch.empty)(T + dq_pad_rows, H, D, dtype=torch.float32,
                                                       device=device)[dq_pad_rows:]
    dk = torch.empty(Tk, Hk, D, dtype=torch.bfloat16, device=device)
    dv = torch.empty(Tk, Hk, D, dtype=torch.bfloat16, device=device)
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



def separate_keys_dot(do_td: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor):
    """The cross-length causal backward's dO^T (schedules.varlen_tiles.backward_cross_item): each document's
    columns hold its dO^T by KEY position, from its first 64-query tile's (64 m_lo) to Lk, so that query tile
    m starts at column dot_cu[doc] + 64 (m - m_lo), 16-byte aligned for the TMA. From dO's token-major codes
    (T_q, H, D): (dO^T (H, D, cols) e4m3 in P-fragment order, dot_cu (docs + 1) int32, every document's
    first column, a multiple of DT_DOC_ALIGN). cols = round_up(T_q + 94 docs + 1, 128) bounds the columns
    from the shapes alone (a document takes at most Lq + 63 rounded up to 32). torch ops on the device, no
    host sync; queries at negative positions (no key) are in no column."""
    from ..quant import DT_DOC_ALIGN, PV_ORDER16, TOKEN_PAD, round_up

    Tq, H, D = do_td.shape
    num_docs = cu_q.numel() - 1
    cq, ck = cu_q.to(torch.int64), cu_k.to(torch.int64)
    lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    off = lk - lq  # the key position of each document's first query
    m_lo = torch.where(off > 0, off // 64, 0)
    width = torch.where(lq > 0, lk - 64 * m_lo, 0)
    padded = (width + DT_DOC_ALIGN - 1) // DT_DOC_ALIGN * DT_DOC_ALIGN
    dot_cu = torch.zeros(num_docs + 1, dtype=torch.int64, device=do_td.device)
    dot_cu[1:] = torch.cumsum(padded, 0)
    cols = round_up(Tq + 94 * num_docs + 1, TOKEN_PAD)
    tok = torch.arange(Tq, device=do_td.device)
    doc = torch.searchsorted(cq[1:], tok, right=True).clamp(max=max(num_docs - 1, 0))
    pos = tok - cq[doc] + off[doc]
    keep = pos >= 0
    # a query at a negative position writes a zero past every document's columns (the last one)
    col = torch.where(keep, dot_cu[doc] + pos - 64 * m_lo[doc], cols - 1)
    src = torch.where(keep[:, None, None], do_td.view(torch.uint8), 0)
    out = torch.zeros(H, D, cols, dtype=torch.uint8, device=do_td.device)
    out[:, :, col] = src.permute(1, 2, 0)
    perm = torch.tensor(PV_ORDER16, device=out.device)
    out = out.view(H, D, -1, 16)[..., perm].reshape(H, D, cols).contiguous()
    return out.view(torch.float8_e4m3fn), dot_cu.to(torch.int32)
