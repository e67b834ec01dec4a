"""Ordering of attention tiles for balance: longest-processing-time first, on device.

A persistent kernel walks this order, either with a static stride (CTA c takes tiles
c, c + n, c + 2n, ...) or from an atomic counter (each CTA takes the next tile when it
finishes one). Equal-cost tiles keep query heads of one KV head together, so a group
that shares K/V runs at the same time and finds them in L2.

`simulate` is the host model the tests (and the tuner's reasoning) use to compare the two.
"""

from __future__ import annotations

import heapq

import torch


def lpt_order(flops: torch.Tensor, head: torch.Tensor, group: int = 1) -> torch.Tensor:
    """Indices of tiles, most expensive first; ties keep (kv head, query head, position) order.

    Padding tiles (cost 0) sort last. Runs on the device of `flops` with no host sync.
    """
    n = flops.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=flops.device)
    pos = torch.arange(n, device=flops.device)
    kv = head.to(torch.int64) // group
    # stable sorts from the least to the most significant key
    order = torch.argsort(pos, stable=True)
    order = order[torch.argsort(kv[order], stable=True)]
    order = order[torch.argsort(-flops[order].to(torch.int64), stable=True)]
    return order


def simulate(costs, order, workers: int, policy: str = "dynamic") -> float:
    """Makespan of running tiles in `order` on `workers` persistent CTAs (host model).

    dynamic: each CTA takes the next tile when it becomes free (an atomic counter);
    static: CTA c takes tiles c, c + workers, ... of the order.
    """
    costs = [float(costs[i]) for i in order]
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if policy == "static":
        return max((sum(costs[c::workers]) for c in range(workers)), default=0.0)
    if policy != "dynamic":
        raise ValueError(f"policy must be 'static' or 'dynamic', got {policy!r}")
    free = [0.0] * workers
    for c in costs:
        t = heapq.heappop(free)
        heapq.heappush(free, t + c)
    return max(free, default=0.0)
