"""Document-local token chunks of a packed (THD) sequence.

A chunk is up to `tile` consecutive tokens of one document, starting at the
document start plus a multiple of `tile`, so a chunk never spans two documents
and every document-local scale block of size dividing `tile` lies inside one
chunk. Kernels launch one CTA per chunk (times head groups).

The table is built with torch ops on the device of cu_seqlens and never reads
values back to the host: its length is the upper bound max_chunks(T, docs) =
T // tile + docs, known from shapes alone, and unused rows have length 0 (their
CTAs exit at once). One table serves every operand that shares cu_seqlens.

Kernels may also skip the table: `chunk_grid_slots` and `locate_chunk_model` describe
(in Python) how the quantization kernel finds its chunk from cu_seqlens in-kernel.
"""

from __future__ import annotations

import torch


def max_chunks(total_tokens: int, num_docs: int, tile: int = 128) -> int:
    """Upper bound of sum_b ceil(len_b / tile): each document wastes < one chunk."""
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    return total_tokens // tile + num_docs


def build_varlen_chunks(cu_seqlens: torch.Tensor, total_tokens: int, tile: int = 128) -> torch.Tensor:
    """(max_chunks, 2) int32 table of (start token, length); padding rows are (0, 0).

    Chunks are ordered by document, then by position in the document.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a 1-D tensor of num_docs + 1 prefix sums")
    num_docs = cu_seqlens.numel() - 1
    n = max_chunks(total_tokens, num_docs, tile)
    dev = cu_seqlens.device
    if num_docs == 0 or n == 0:
        return torch.zeros(n, 2, dtype=torch.int32, device=dev)
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    per_doc = (lens + tile - 1) // tile
    cum = torch.cumsum(per_doc, 0)  # inclusive: chunks of docs 0..b
    cid = torch.arange(n, device=dev, dtype=torch.int64)
    doc = torch.searchsorted(cum, cid, right=True)  # the doc whose chunk range holds cid
    valid = doc < num_docs
    doc = doc.clamp(max=num_docs - 1)
    local = cid - (cum[doc] - per_doc[doc])
    start = cu[doc] + local * tile
    length = (cu[doc + 1] - start).clamp(0, tile)
    table = torch.stack([torch.where(valid, start, 0), torch.where(valid, length, 0)], dim=1)
    return table.to(torch.int32).contiguous()


# ----------------------------------------------------------------------------------------------
# In-kernel chunk location (no table): the index math of flamia_cute.sm90.quantize, in Python
# ----------------------------------------------------------------------------------------------


def chunk_grid_slots(total_tokens: int, num_docs: int, tile: int = 128) -> int:
    """CTAs per head group of a table-free varlen launch: max_chunks + 1.

    Slots [0, n_chunks) are the chunks in table order; the rest (always >= 1) are spare and
    zero the tail columns [dt_total, T_dt) of the transposed copy.
    """
    return max_chunks(total_tokens, num_docs, tile) + 1


def locate_chunk_model(cu_seqlens: list[int], cta: int, threads: int = 256, tile: int = 128, align: int = 16):
    """What CTA `cta` of the quantization kernel computes from cu_seqlens alone (pure Python model).

    The kernel's threads each own ceil(docs / threads) consecutive documents, sum their chunk
    counts ceil(len / tile) and aligned lengths round_up(len, align), take a block-wide exclusive
    scan of both, and the thread whose chunk range holds `cta` publishes the chunk. Returns
    ("chunk", start_token, length, dt_column) or ("spare", n_chunks, dt_total).
    """
    nd = len(cu_seqlens) - 1
    k = (nd + threads - 1) // threads
    sums = []
    for t in range(threads):
        c = p = 0
        for b in range(t * k, min((t + 1) * k, nd)):
            n = cu_seqlens[b + 1] - cu_seqlens[b]
            c += (n + tile - 1) // tile
            p += (n + align - 1) // align * align
        sums.append((c, p))
    tot_c = sum(c for c, _ in sums)
    tot_p = sum(p for _, p in sums)
    if cta >= tot_c:
        return ("spare", tot_c, tot_p)
    ex_c = ex_p = 0
    for t in range(threads):
        c, p = sums[t]
        if ex_c <= cta < ex_c + c:
            for b in range(t * k, min((t + 1) * k, nd)):
                n = cu_seqlens[b + 1] - cu_seqlens[b]
                nch = (n + tile - 1) // tile
                if ex_c <= cta < ex_c + nch:
                    loc = cta - ex_c
                    return ("chunk", cu_seqlens[b] + tile * loc, min(tile, n - tile * loc), ex_p + tile * loc)
                ex_c += nch
                ex_p += (n + align - 1) // align * align
        ex_c += c
        ex_p += p
    raise AssertionError("unreachable")
