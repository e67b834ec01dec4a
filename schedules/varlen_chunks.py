"""Document-local token chunks of a packed (THD) sequence.

A chunk is up to `tile` consecutive tokens of one document, starting at the
document start plus a multiple of `tile`, so a chunk never spans two documents
and every document-local scale block of size dividing `tile` lies inside one
chunk. Kernels launch one CTA per chunk (times head groups).

The table is built with torch ops on the device of cu_seqlens and never reads
values back to the host: its length is the upper bound max_chunks(T, docs) =
T // tile + docs, known from shapes alone, and unused rows have length 0 (their
CTAs exit at once). One table serves every operand that shares cu_seqlens.
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
