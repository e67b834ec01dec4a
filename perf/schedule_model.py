"""Host model of the persistent forward's tile orders: makespan over 132 CTAs against the ideal.

    python perf/schedule_model.py

Cost of a tile = its key tiles (query block b of a document costs b + 1 steps); per-tile overheads,
L2 reuse and the diagonal tile's extra work are ignored. Orders: the kernel's (documents in order,
heads, blocks longest first) with the counter ("given") or static striding ("stride"); documents
longest first ("docs-LPT"); and every group's heavy half of blocks before all light halves
("heavy-halves-first", which reads each (document, head)'s K/V twice).
"""

import json

from flamia_cute.bench import DEFAULT_WORKLOADS
from flamia_cute.schedules.ordering import simulate

CTAS = 132
HEADS = 16


def blocks(n: int) -> int:
    return (n + 127) // 128


def main() -> None:
    workloads = json.loads(DEFAULT_WORKLOADS.read_text())["workloads"]
    print(f"{'workload':12s} {'given':>8s} {'stride':>8s} {'docs-LPT':>9s} {'heavy-first':>12s}   (makespan over ideal)")
    for name, lengths in workloads.items():
        def costs(doc_order, split=False, lengths=lengths):
            groups = [(d, h) for d in doc_order for h in range(HEADS)]
            seq = [[b + 1 for b in reversed(range(blocks(lengths[d])))] for d, _ in groups]
            if split:
                return ([c for s in seq for c in s[: (len(s) + 1) // 2]]
                        + [c for s in seq for c in s[(len(s) + 1) // 2:]])
            return [c for s in seq for c in s]

        given = costs(range(len(lengths)))
        by_len = sorted(range(len(lengths)), key=lambda d: (-lengths[d], d))
        ideal = sum(given) / CTAS
        row = [simulate(given, range(len(given)), CTAS), simulate(given, range(len(given)), CTAS, "static"),
               simulate(costs(by_len), range(len(given)), CTAS),
               simulate(costs(by_len, split=True), range(len(given)), CTAS)]
        print(f"{name:12s} " + " ".join(f"{m / ideal - 1:+8.1%}" for m in row[:2])
              + f" {row[2] / ideal - 1:+9.1%} {row[3] / ideal - 1:+12.1%}")


if __name__ == "__main__":
    main()
