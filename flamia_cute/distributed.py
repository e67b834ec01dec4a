"""Context parallelism for packed documents: the all-gather form, on torch.distributed.

A packed batch of T tokens is cut into 2W equal chunks over the W ranks of a context-parallel group; rank r
holds chunks r and 2W-1-r (head/tail pairs, so that every rank gets the same share of causal work). Each rank
gathers K and V from the group (one functional all-gather, so torch.compile traces it; its backward is the
reduce-scatter of dK and dV) and computes its own queries against their documents' keys:

- every piece of a document on a rank is one "segment": queries [a, b) of the document and keys [start, b)
  (causal, aligned to the end of the query range) or the whole document (causal=False);
- K and V are quantized over those key ranges from the document's first token, exactly the blocks of a world
  size 1 call: the block scales stay document-local, the diagonal safeguard sits at each query's own position,
  and a rank whose chunk starts mid-document sees the same quantized keys as world size 1 does. O, LSE and dQ
  equal the world-size-1 call up to the order of the fp32 sums in Q K^T (bit for bit in most runs on the
  emulator); dK and dV are each rank's partial sums, returned in the inputs' dtype and added over the ranks
  (the reduce-scatter), ~3e-3 relative to world size 1 in bf16;
- world size 1 is the plain call (cu_seqlens_k is cu_seqlens_q): the kernels run it. Larger worlds need
  queries that are a sub-range of their keys: the sm_90a kernels' cross-length builds run them (O and LSE
  bit-identical to the whole document's call); the CPU runs the emulator.

    shard = shard_packed_batch(cu_seqlens, world_size, rank)  # host-side plan, once per batch
    q, k, v = (shard.take(t) for t in (q_global, k_global, v_global))  # or build them from shard.take(tokens)
    out = context_parallel_attn(q, k, v, shard, group)          # (T / W, H, D), this rank's tokens
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .interface import flamia_attn_varlen_func
from .recipes import DEFAULT_RECIPE, Recipe


@dataclass(frozen=True)
class ContextParallelShard:
    """One rank's part of a packed batch: its tokens and the varlen call that computes their attention.

    token_index: (T / W,) global positions of this rank's tokens, in local order (shard.take uses it).
    cu_seqlens_q / cu_seqlens_k: int32 over this rank's segments, their queries and their key ranges.
    kv_index: rows of the rank-major all-gathered K/V that form the key ranges; None at world size 1.
    """

    world_size: int
    rank: int
    causal: bool
    load_balance: bool
    token_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    kv_index: torch.Tensor | None

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global (T, ...) tensor."""
        return x.index_select(0, self.token_index.to(x.device))


def chunk_ranges(total: int, world_size: int, rank: int, load_balance: bool = True) -> list[tuple[int, int]]:
    """The global token ranges rank `rank` holds, in local order, adjacent ones merged."""
    if world_size == 1:
        return [(0, total)]
    if load_balance:
        if total % (2 * world_size):
            raise ValueError(f"cu_seqlens: the batch's {total} tokens must split into 2 x world_size = "
                             f"{2 * world_size} equal chunks (load_balance=True); pad the batch")
        size = total // (2 * world_size)
        ranges = [(rank * size, (rank + 1) * size), ((2 * world_size - 1 - rank) * size, (2 * world_size - rank) * size)]
    else:
        if total % world_size:
            raise ValueError(f"cu_seqlens: the batch's {total} tokens must split into world_size = {world_size} "
                             "equal chunks; pad the batch")
        size = total // world_size
        ranges = [(rank * size, (rank + 1) * size)]
    merged = [ranges[0]]
    for a, b in ranges[1:]:
        if a == merged[-1][1]:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


def shard_packed_batch(cu_seqlens, world_size: int, rank: int, causal: bool = True, load_balance: bool = True,
                       device=None) -> ContextParallelShard:
    """The plan of rank `rank` for a packed batch with global `cu_seqlens` (a tensor or a list; read on the host).
    device: where the plan's tensors go (default: cu_seqlens' device, the CPU for a list)."""
    if not (isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1):
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not (isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < world_size):
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    if device is None:
        device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else torch.device("cpu")
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else [int(c) for c in cu_seqlens]
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu[:-1], cu[1:], strict=True)):
        raise ValueError("cu_seqlens must start at 0 and be non-decreasing, with at least 2 entries")
    total = cu[-1]
    if total == 0:
        raise ValueError("cu_seqlens: the batch holds no tokens, so there is nothing to shard")
    docs = [(a, b) for a, b in zip(cu[:-1], cu[1:], strict=True) if b > a]

    def local(r):
        return chunk_ranges(total, world_size, r, load_balance)

    mine = local(rank)
    token_index = torch.cat([torch.arange(a, b) for a, b in mine])
    segments = []  # (query start, query end, key start, key end), global positions
    for a0, b0 in mine:
        for ds, de in docs:
            qa, qb = max(a0, ds), min(b0, de)
            if qa < qb:
                segments.append((qa, qb, ds, qb if causal else de))
    whole_docs = all(qa == ks and qb == ke for qa, qb, ks, ke in segments)

    def cu_of(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)

    cu_q = cu_of([qb - qa for qa, qb, _, _ in segments])
    max_q = max(qb - qa for qa, qb, _, _ in segments)
    if world_size == 1 and whole_docs:  # the plain self-attention call: the kernels run it
        return ContextParallelShard(1, 0, causal, load_balance, token_index.to(device), cu_q, cu_q, max_q, max_q, None)
    # row of each global token in the rank-major all-gather of the local shards
    gathered = torch.cat([torch.cat([torch.arange(a, b) for a, b in local(r)]) for r in range(world_size)])
    row = torch.empty(total, dtype=torch.int64)
    row[gathered] = torch.arange(total)
    kv_index = torch.cat([row[ks:ke] for _, _, ks, ke in segments])
    return ContextParallelShard(world_size, rank, causal, load_balance, token_index.to(device), cu_q,
                                cu_of([ke - ks for _, _, ks, ke in segments]), max_q,
                                max(ke - ks for _, _, ks, ke in segments), kv_index.to(device))


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Rank-major all-gather along dim 0 with autograd (backward: reduce-scatter of the gradient)."""
    import torch.distributed._functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return gather(x, 0, group)


def context_parallel_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: ContextParallelShard, group=None,
                          softmax_scale: float | None = None, recipe: str | Recipe = DEFAULT_RECIPE,
                          backend: str = "auto", return_lse: bool = False):
    """Attention of this rank's tokens (q, k, v: (T / W, heads, D), shard.take of the global tensors) over the
    context-parallel `group` (default: the world). Returns out (T / W, H, D) and with return_lse lse (H, T / W)."""
    if shard.world_size > 1:
        group = group if group is not None else dist.group.WORLD
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if (size, rank) != (shard.world_size, shard.rank):
            raise ValueError(f"shard is rank {shard.rank} of {shard.world_size}, but group is rank {rank} of {size}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[0] != shard.token_index.numel():
            raise ValueError(f"{name} must hold this rank's {shard.token_index.numel()} tokens, got {t.shape[0]}")
    if shard.kv_index is not None:
        d = k.shape[-1]
        kv = _all_gather(torch.cat([k, v], dim=-1), group)  # one collective for K and V
        kv = kv.index_select(0, shard.kv_index.to(kv.device))
        k, v = kv[..., :d], kv[..., d:]
    return flamia_attn_varlen_func(q, k, v, shard.cu_seqlens_q, shard.cu_seqlens_k, shard.max_seqlen_q,
                                   shard.max_seqlen_k, softmax_scale, shard.causal, recipe=recipe, backend=backend,
                                   return_lse=return_lse)


def gather_tokens(x: torch.Tensor, shard: ContextParallelShard, group=None) -> torch.Tensor:
    """The global (T, ...) tensor from every rank's rows: shard.take's inverse, over the group, with autograd."""
    if shard.world_size == 1:
        return x
    rows = _all_gather(x, group if group is not None else dist.group.WORLD)
    total = rows.shape[0]
    gathered = torch.cat([torch.arange(a, b) for r in range(shard.world_size)
                          for a, b in chunk_ranges(total, shard.world_size, r, shard.load_balance)])
    index = torch.empty(total, dtype=torch.int64)
    index[gathered] = torch.arange(total)
    return rows.index_select(0, index.to(x.device))
