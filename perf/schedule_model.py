"""Host models of the CTA schedules: the persistent forward's tile orders and the backward's CTA queue.

    python perf/schedule_model.py

Cost of a tile = its key tiles (query block b costs b + 1 steps); per-tile overheads, L2 reuse and
the diagonal tile's extra work are ignored. Orders (schedules.varlen_tiles.persistent_order): the
kernel's default (documents in order, heads, blocks longest first) with the counter or static
striding (`tile_claim="stride"`); documents longest first (`tile_order="longest_documents"`);
`tile_order="heavy_first"`
(every (document, head)'s heavier half of blocks before all lighter halves: each group's K/V is
read twice).
"""

import json

from flamia_cute.bench import DEFAULT_WORKLOADS
from flamia_cute.schedules.ordering import simulate
from flamia_cute.schedules.varlen_tiles import backward_persistent_order, persistent_order
from flamia_cute.sm90.attention_bwd import auto_head_window

CTAS = 132
HEADS = 16


def makespans(lengths) -> list[float]:
    """[counter, stride, documents longest first, heavy_first] over the ideal, minus 1."""
    def costs(lens, order="documents"):
        return [b + 1 for _, _, b in persistent_order(lens, HEADS, order=order)]

    given = costs(lengths)
    ideal = sum(given) / CTAS
    runs = [simulate(given, range(len(given)), CTAS), simulate(given, range(len(given)), CTAS, "static"),
            simulate(costs(lengths, "longest_documents"), range(len(given)), CTAS),
            simulate(costs(lengths, "heavy_first"), range(len(given)), CTAS)]
    return [m / ideal - 1 for m in runs]


def backward_makespans(lengths, windows=(1, 2, 4, 8, 16), per_cta: float = 4.0) -> dict:
    """The bf16-dS backward's CTA queue: CTAs in launch order (backward_grid's "blocks"
    order in windows of W KV heads, through backward_work_item), taken by 132 SMs as they free up
    (the hardware's queue: `simulate`'s dynamic policy); cost = the CTA's 64-query tiles + per_cta
    (the measured ~7 µs per CTA is ~4 tiles). Makespan over the ideal, minus 1, per window."""
    out = {}
    for w in windows:
        if HEADS % w:
            continue
        # the grid's CTAs with keys, in launch order (tests/test_schedules.py checks it against the grid)
        costs = [(lengths[doc] + 63) // 64 - 2 * blk + per_cta
                 for doc, _, blk in backward_persistent_order(lengths, HEADS, w)]
        out[w] = simulate(costs, range(len(costs)), CTAS) / (sum(costs) / CTAS) - 1
    return out


def main() -> None:
    workloads = json.loads(DEFAULT_WORKLOADS.read_text())["workloads"]
    print(f"{'workload':12s} {'counter':>8s} {'stride':>8s} {'docs-LPT':>9s} {'heavy_first':>12s}   (makespan over ideal)")
    for name, lengths in workloads.items():
        c, s, d, h = makespans(lengths)
        print(f"{name:12s} {c:+8.1%} {s:+8.1%} {d:+9.1%} {h:+12.1%}")
    print("\nbackward CTA queue, makespan over ideal per head window (* = auto_head_window)")
    for name, lengths in workloads.items():
        auto = auto_head_window(HEADS, max(lengths))
        cells = "  ".join(f"W{w}{'*' if w == auto else ' '} {m:+6.1%}" for w, m in backward_makespans(lengths).items())
        print(f"{name:12s} {cells}")


if __name__ == "__main__":
    main()
