"""Host models of the shipping CTA schedules: the persistent forward's tile orders and the backward's CTA queue.

    python perf/schedule_model.py

Forward: the persistent CTAs take tiles from a global counter (`simulate`'s dynamic policy) in the
kernel's order (schedules.varlen_tiles.persistent_order): "documents" (documents in order, heads,
blocks longest first: the default) or "longest_documents" (FwdConfig.tile_order, a tuner
candidate), with short documents paired into one tile where the plan pairs them
(attention_fwd.short_pairs_default). A tile of query block b costs b + 1 steps.

Backward: one CTA per (document, KV head, key block), launched in backward_grid's order ("blocks",
in windows of W KV heads: BwdDsBf16Config.head_window) and taken by the SMs as they free up (the
hardware's queue: `simulate`'s dynamic policy). The order is backward_work_item replayed over the
grid, so it is the kernel's own. A CTA costs its 64-query tiles plus a fixed overhead.

Per-tile overheads, L2 reuse and the diagonal tile's extra work are ignored. Makespan over the
ideal (total cost / SMs), minus 1.
"""

import json

from flamia_cute.bench import DEFAULT_WORKLOADS
from flamia_cute.schedules.ordering import simulate
from flamia_cute.schedules.varlen_tiles import persistent_order
from flamia_cute.sm90.attention_bwd import HEAD_WINDOWS, auto_head_window
from flamia_cute.sm90.attention_fwd import short_pairs_default
from flamia_cute.tile_scheduler import backward_grid, backward_work_item

CTAS = 132
HEADS = 16


def forward_makespans(lengths) -> dict:
    """{order: makespan over the ideal - 1} of the persistent forward's counter-claimed tiles."""
    pairs = short_pairs_default(sum(lengths), len(lengths))
    out = {}
    for order in ("documents", "longest_documents"):
        costs = [b + 1 for _, _, b in persistent_order(lengths, HEADS, order=order, short_pairs=pairs)]
        out[order] = simulate(costs, range(len(costs)), CTAS) / (sum(costs) / CTAS) - 1
    return out


def backward_order(lengths, heads_kv: int, head_window: int) -> list[tuple[int, int, int]]:
    """(KV head, document, key block) of every backward CTA that has keys, in launch order (x fastest):
    backward_work_item over backward_grid("blocks", ...)."""
    max_blocks = (max(lengths) + 127) // 128
    gx, gy, gz = backward_grid("blocks", heads_kv, len(lengths), max_blocks, head_window)
    items = []
    for z in range(gz):
        for y in range(gy):
            for x in range(gx):
                kv, doc, blk = backward_work_item("blocks", (x, y, z), head_window)
                if blk * 128 < lengths[doc]:
                    items.append((kv, doc, blk))
    return items


def backward_makespans(lengths, per_cta: float = 4.0) -> dict:
    """{head window: makespan over the ideal - 1} of the backward's CTA queue; cost = the CTA's 64-query
    tiles + per_cta (the measured ~7 µs per CTA is ~4 tiles)."""
    out = {}
    for w in HEAD_WINDOWS:
        if HEADS % w or w > 16:
            continue
        costs = [(lengths[doc] + 63) // 64 - 2 * blk + per_cta for _, doc, blk in backward_order(lengths, HEADS, w)]
        out[w] = simulate(costs, range(len(costs)), CTAS) / (sum(costs) / CTAS) - 1
    return out


def main() -> None:
    workloads = json.loads(DEFAULT_WORKLOADS.read_text())["workloads"]
    print(f"persistent forward, {CTAS} CTAs, {HEADS} heads: makespan over ideal")
    print(f"{'workload':12s} {'documents':>10s} {'longest_documents':>18s}")
    for name, lengths in workloads.items():
        m = forward_makespans(lengths)
        print(f"{name:12s} {m['documents']:+10.1%} {m['longest_documents']:+18.1%}")
    print("\nbackward CTA queue, makespan over ideal per head window (* = auto_head_window, the untuned plan's)")
    for name, lengths in workloads.items():
        auto = auto_head_window(HEADS, max(lengths))
        cells = "  ".join(f"W{w}{'*' if w == auto else ' '} {m:+6.1%}" for w, m in backward_makespans(lengths).items())
        print(f"{name:12s} {cells}")


if __name__ == "__main__":
    main()
