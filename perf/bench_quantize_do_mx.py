"""The planned Blackwell backward's dO quantizer (sm100/quantize_do_mx.py), timed on the H200 where it runs.

    python perf/bench_quantize_do_mx.py [OUT_DIR]   # prints a table; writes bench_quantize_do_mx.{json,csv}
                                                    # to OUT_DIR, else to $OUT if set

GPU time of one `quantize_do_mx` call (one launch: dO in both MX orientations with their scale chunks and
D = rowsum(dO * O)), CUDA events, medians over inputs rotated through more than L2, each launch after a
GPU sleep (the host's launch never shows between the events). Its byte floor: dO and O read once (2 B per
element each), the codes of both orientations written once (1 B each), the scale chunks (512 B per
128-token tile, head and orientation) and D (4 B per token and head), at 4.3 TB/s (perf/floors.py's copy
rate); beside it a device-to-device copy of the same bytes (read + write), the rate this GPU reaches.
The kernel reads dO a second time, from L2 (not counted: it is not a DRAM byte when it hits). Each
workload's first call is checked bit-exact against the torch specification, pack_mx_do_operands.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import torch

from flamia_cute.quant.mx_layout import SF_CHUNK_BYTES, pack_mx_do_operands, sf_tile_starts
from flamia_cute.sm100.quantize_do_mx import quantize_do_mx
from flamia_cute.testing import cu_seqlens_from_lengths

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quantize_mx import gpu_ms  # noqa: E402  (one timing rule for both quantizers)

COPY_GBPS = 4300.0  # perf/floors.py COPY_TBPS
BUFFERS = 4
WORKLOADS = {"1x16k": [16384], "16x1k": [1024] * 16}
HEADS, D = 16, 128




def bit_exact(got, want, used: int) -> bool:
    same = [torch.equal(getattr(got, n).view(torch.uint8), getattr(want, n).view(torch.uint8)) for n in ("do", "do_t")]
    same += [torch.equal(getattr(got, n)[:, :used], getattr(want, n)[:, :used]) for n in ("do_sf", "do_t_sf")]
    return all(same) and torch.equal(got.delta.view(torch.int32), want.delta.view(torch.int32))


def main(out_dir: str | None):
    rows = []
    for name, lengths in WORKLOADS.items():
        T = sum(lengths)
        cu = cu_seqlens_from_lengths(lengths, "cuda")
        g = torch.Generator(device="cuda").manual_seed(0)
        bufs = [tuple(torch.randn(T, HEADS, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2)) + (cu,)
                for _ in range(BUFFERS)]
        used = int(sf_tile_starts(cu)[-1])
        exact = bit_exact(quantize_do_mx(*bufs[0]), pack_mx_do_operands(*bufs[0]), used)
        floor_bytes = T * HEADS * D * (2 * 2 + 2 * 1) + 2 * HEADS * used * SF_CHUNK_BYTES + 4 * T * HEADS
        src = torch.empty(floor_bytes // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_ms = gpu_ms(torch.Tensor.copy_, [(dst, src)])
        k_ms = gpu_ms(quantize_do_mx, bufs)
        t_ms = gpu_ms(pack_mx_do_operands, bufs[:1])
        floor_us = floor_bytes / (COPY_GBPS * 1e3)
        rows.append(dict(workload=name, tokens=T, heads=HEADS, bytes=floor_bytes, call_us=round(1e3 * k_ms, 1),
                         floor_us=round(floor_us, 1), pct_of_floor=round(100 * floor_us / (1e3 * k_ms), 1),
                         copy_us=round(1e3 * copy_ms, 1), pct_of_copy=round(100 * copy_ms / k_ms, 1),
                         gbps=round(floor_bytes / k_ms / 1e6), torch_spec_us=round(1e3 * t_ms, 1), bit_exact=exact))
    print(f"{torch.cuda.get_device_name()}: dO quantizer (both MX orientations + D), {HEADS} heads x d{D}")
    print(f"{'workload':9s} {'tokens':>6s} {'call us':>8s} {'floor us':>8s} {'% floor':>7s} {'copy us':>7s} "
          f"{'% copy':>6s} {'GB/s':>5s} {'torch spec us':>13s} exact")
    for r in rows:
        print(f"{r['workload']:9s} {r['tokens']:6d} {r['call_us']:8.1f} {r['floor_us']:8.1f} {r['pct_of_floor']:7.1f} "
              f"{r['copy_us']:7.1f} {r['pct_of_copy']:6.1f} {r['gbps']:5d} {r['torch_spec_us']:13.1f} {r['bit_exact']}")
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_quantize_do_mx.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows},
                                                                  indent=1))
        with open(out / "bench_quantize_do_mx.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT")))
