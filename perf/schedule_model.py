"""Host model of the persistent forward's tile orders: makespan over 132 CTAs against the ideal.

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
from flamia_cute.schedules.varlen_tiles import persistent_order

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


def main() -> None:
    workloads = json.loads(DEFAULT_WORKLOADS.read_text())["workloads"]
    print(f"{'workload':12s} {'counter':>8s} {'stride':>8s} {'docs-LPT':>9s} {'heavy_first':>12s}   (makespan over ideal)")
    for name, lengths in workloads.items():
        c, s, d, h = makespans(lengths)
        print(f"{name:12s} {c:+8.1%} {s:+8.1%} {d:+9.1%} {h:+12.1%}")


if __name__ == "__main__":
    main()
