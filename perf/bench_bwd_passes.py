"""The bf16-dS backward's passes around its kernel: overlapped on two streams, and the dO launch's settings.

    python perf/bench_bwd_passes.py        # writes $OUT/bwd_passes.json if OUT is set

Per workload (PASSES_WORKLOADS, default 16x1k,4x4k,mixed16k,1x16k; 16 heads, d128):
- the whole backward call (dO preprocess, Q's bf16 copy, dQ zero fill, kernel, dQ conversion) with
  `overlap_passes` off and on, in rotated rounds (CUDA-graph replays, medians), and the gradients'
  difference between the two (dK, dV must be bitwise equal; dQ within the reduce-add order);
- each pass alone, and the three passes with and without the side stream;
- the dO launch (dout_delta_config) under other launch settings (heads per CTA, the launch bound,
  the raster), each checked bitwise against the default's outputs.
The passes are memory-bound; their times and byte floors are in docs/backward.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fwd_breakdown import backward_inputs, graph_ms  # noqa: E402

from flamia_cute.bench import DEFAULT_WORKLOADS, Case  # noqa: E402
from flamia_cute.cute_backend import quantize_operands  # noqa: E402
from flamia_cute.sm90.attention_bwd import flamia_bwd_dsbf16_sm90_from_saved, side_stream  # noqa: E402
from flamia_cute.sm90.bwd_preprocess import preprocess_bwd  # noqa: E402
from flamia_cute.sm90.codes import e4m3_codes_to_bf16  # noqa: E402
from flamia_cute.sm90.quantize import dout_delta_config, quantize_with_rowdot_sm90  # noqa: E402

ROUNDS = int(os.environ.get("PASSES_ROUNDS", "3"))
WORKLOADS = os.environ.get("PASSES_WORKLOADS", "16x1k,4x4k,mixed16k,1x16k").split(",")


def rounds(fns: dict) -> dict:
    """Median graph-replay time of each callable over ROUNDS rotated rounds, and the rounds."""
    labels = list(fns)
    times = {k: [] for k in labels}
    for r in range(ROUNDS):
        k = r % len(labels)
        for label in labels[k:] + labels[:k]:
            times[label].append(graph_ms(fns[label]))
    return {label: (statistics.median(t), [round(x, 4) for x in t]) for label, t in times.items()}


def dout_variants(H: int, D: int) -> dict:
    base = dout_delta_config(D, H, 1)
    part = base.parts[0]
    out = {"default": base}
    for hg in (1, 2, 4, 8):
        if hg != part.heads_per_cta and hg * D <= 512:
            out[f"heads per CTA {hg}"] = dataclasses.replace(base, parts=(dataclasses.replace(part, heads_per_cta=hg),))
    for bound in (0, 2, 4):
        if bound != base.min_ctas_per_sm:
            out[f"launch bound {bound}"] = dataclasses.replace(base, min_ctas_per_sm=bound)
    out["raster chunks"] = dataclasses.replace(base, raster="chunks")
    return out


def measure(name: str, lengths) -> dict:
    case = Case(name, lengths, 16, 16, 128, "cuda").build()
    q, k, v, _ = case.sets[0]
    qq, (kq, kt), (vq, vt) = quantize_operands(q, k, v, case.cu, 128, case.max_len)
    dout, out, lse, _, _, _ = backward_inputs(case, qq, kq, kt, vq, vt)
    T, H, D = q.shape
    row = {"workload": name}

    def call(overlap):
        return flamia_bwd_dsbf16_sm90_from_saved(dout, out, lse, qq, kq, vq, kt, vt, case.cu, case.max_len,
                                                 case.scale, overlap_passes=overlap)

    ref, alt = call(False), call(True)
    torch.cuda.synchronize()
    for n, a, b in zip(("dq", "dk", "dv"), ref, alt, strict=True):
        row[f"rel diff {n}, overlapped"] = float((a.float() - b.float()).norm() / b.float().norm())

    def passes(overlap):  # as flamia_bwd_dsbf16_sm90 runs them: buffers from this stream, filled on the side one
        main = torch.cuda.current_stream()
        side = side_stream(q.device) if overlap else None
        if side is not None:
            side.wait_stream(main)
        q_bf16 = torch.empty(T, H, D, dtype=torch.bfloat16, device=q.device)
        dq_acc = torch.empty(T, H, D, dtype=torch.float32, device=q.device)
        with torch.cuda.stream(side) if side is not None else torch.cuda.stream(main):
            e4m3_codes_to_bf16(qq.data_td, qq.scale, out=q_bf16)
            dq_acc.zero_()
        preprocess_bwd(dout, out, case.cu, dv_ref_group=1)
        if side is not None:
            main.wait_stream(side)

    timed = rounds({
        "bwd call": lambda: call(False), "bwd call, overlapped": lambda: call(True),
        "passes": lambda: passes(False), "passes, overlapped": lambda: passes(True),
        "Q bf16 copy": lambda: e4m3_codes_to_bf16(qq.data_td, qq.scale),
        "dQ zero fill": lambda: torch.zeros(T, H, D, dtype=torch.float32, device=q.device),
    })

    variants = dout_variants(H, D)
    outs = {}
    for label, cfg in variants.items():
        docmax = torch.zeros(H, case.cu.numel() - 1, dtype=torch.int32, device=q.device)
        doq, delta = quantize_with_rowdot_sm90(dout, out, case.cu, cfg, docmax=docmax)
        outs[label] = (doq.data_td.view(torch.uint8), doq.data_dt.view(torch.uint8), doq.scale, delta, docmax)
    for label, o in outs.items():
        row[f"dO {label} bitwise"] = all(torch.equal(a, b) for a, b in zip(o, outs["default"], strict=True))

    def dout_pass(cfg):
        docmax = torch.zeros(H, case.cu.numel() - 1, dtype=torch.int32, device=q.device)
        quantize_with_rowdot_sm90(dout, out, case.cu, cfg, docmax=docmax)

    timed.update(rounds({f"dO pass, {label}": (lambda cfg=cfg: dout_pass(cfg)) for label, cfg in variants.items()}))
    for label, (ms, rs) in timed.items():
        row[label] = round(ms * 1e3, 1)  # us
        row[f"{label}, rounds"] = rs
    return row


def main():
    workloads = json.loads(DEFAULT_WORKLOADS.read_text())["workloads"]
    rows = []
    for name in WORKLOADS:
        row = measure(name, workloads[name])
        print({k: v for k, v in row.items() if not k.endswith("rounds")}, flush=True)
        rows.append(row)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bwd_passes.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
