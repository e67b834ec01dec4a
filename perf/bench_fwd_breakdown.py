"""Where a call's GPU time goes: the attention kernels alone, the quantization launch, the backward's
preprocess and the API call; and the kernels' build variants side by side.

    python perf/bench_fwd_breakdown.py        # a row per workload; $OUT/fwd_breakdown[_MODE].json when OUT is set

BREAKDOWN_ONLY=fwd: the forward kernel alone per FWD_VARIANTS entry; BREAKDOWN_ONLY=ds: the backward
kernel alone per variant of measure_ds_orders. BREAKDOWN_DS_VARIANTS (a comma list of labels, either mode),
BREAKDOWN_WORKLOADS (names from flamia_cute/workloads.json or perf/workloads_short.json) and
BREAKDOWN_ROUNDS (rounds in rotated order, medians kept) restrict and repeat a run.
Kernel-only times replay a CUDA graph of 10 launches (burst timing: docs/power.md).
"""

import json
import os
import statistics
from pathlib import Path

import torch

from flamia_cute import flamia_attn_varlen_func
from flamia_cute.bench import DEFAULT_WORKLOADS, Case
from flamia_cute.cute_backend import quantize_operands
from flamia_cute.schedules import causal_flops
from flamia_cute.sm90.attention_bwd import (
    BwdDsBf16Config,
    auto_head_window,
    flamia_bwd_dsbf16_sm90_from_saved,
)
from flamia_cute.sm90.attention_fwd import FwdConfig, flamia_fwd_sm90
from flamia_cute.sm90.bwd_preprocess import preprocess_bwd
from flamia_cute.sm90.codes import e4m3_codes_to_bf16


def graph_ms(fn, reps=10, trials=7):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return statistics.median(times)


def events_ms(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def measure(name, lengths):
    """One workload: kernel-only per config, the single quantization launch, and the API call."""
    case = Case(name, lengths, 16, 16, 128, "cuda").build()
    q, k, v, _ = case.sets[0]
    qq, (kq, kt), (vq, vt) = quantize_operands(q, k, v, case.cu, 128, case.max_len)
    flops = causal_flops(case.lengths, 16, 128)
    row = {"workload": name}
    if ONLY_DS:
        return measure_ds_orders(case, qq, kq, kt, vq, vt, row)
    if ONLY_FWD:
        return measure_fwd_variants(case, qq, kq, kt, vq, vt, row, flops)
    for label, cfg in (("fwd kernel", FwdConfig(128, diagonal_copy=True)),
                       ("fwd kernel, 3 kv stages", FwdConfig(128, diagonal_copy=True, kv_stages=3))):
        def fwd(cfg=cfg):
            flamia_fwd_sm90(qq.data_td, qq.scale, kq.data_td, kq.scale, vq.data_dt, vq.scale, kt.data_td,
                            kt.scale, vt.data_dt, vt.scale, case.cu, case.max_len, case.scale, cfg)
        try:
            row[label] = graph_ms(fwd)
        except Exception as e:  # graph capture of a DSL launch may be refused: fall back to events
            row[label] = events_ms(fwd)
            row["note"] = f"events ({type(e).__name__})"

    def quantize():
        quantize_operands(q, k, v, case.cu, 128, case.max_len)

    try:
        row["quantize q,k,v"] = graph_ms(quantize)
    except Exception:
        row["quantize q,k,v"] = events_ms(quantize)
    row["api call"] = events_ms(lambda: flamia_attn_varlen_func(q, k, v, case.cu, case.cu, case.max_len,
                                                                  case.max_len, case.scale))
    row["TFLOP/s fwd kernel"] = flops / (row["fwd kernel"] * 1e9)

    # backward: the kernel alone (dO's quantization, D and the dV fold references precomputed), and that
    # preprocess launch
    dout, out, lse, delta, doq, dv_ref = backward_inputs(case, qq, kq, kt, vq, vt)
    q_bf16 = e4m3_codes_to_bf16(qq.data_td, qq.scale)

    def bwd():
        flamia_bwd_dsbf16_sm90_from_saved(dout, out, lse, qq, kq, vq, kt, vt, case.cu, case.max_len, case.scale,
                                          config=BwdDsBf16Config(128, diagonal_copy=True), do_quantized=doq,
                                          delta=delta, dv_ref=dv_ref, q_bf16=q_bf16)

    for label, fn in (("bwd kernel", bwd), ("bwd preprocess", lambda: preprocess_bwd(dout, out, case.cu))):
        try:
            row[label] = graph_ms(fn)
        except Exception as e:
            row[label] = events_ms(fn)
            row["note_bwd"] = f"events ({type(e).__name__})"
    row["TFLOP/s bwd kernel"] = causal_flops(case.lengths, 16, 128, backward=True) / (row["bwd kernel"] * 1e9)
    return row


ONLY = os.environ.get("BREAKDOWN_ONLY", "")
ONLY_DS = ONLY == "ds"  # the backward kernel's build variants (measure_ds_orders) and Q's bf16 copy
ONLY_FWD = ONLY == "fwd"  # the forward kernel's build variants (FWD_VARIANTS)
# comma lists restricting the variants (either mode) and the workloads
VARIANT_FILTER = [v for v in os.environ.get("BREAKDOWN_DS_VARIANTS", "").split(",") if v]
WORKLOADS = [w for w in os.environ.get("BREAKDOWN_WORKLOADS", "").split(",") if w]
ROUNDS = int(os.environ.get("BREAKDOWN_ROUNDS", "1"))


def backward_inputs(case, qq, kq, kt, vq, vt):
    """What the backward kernels read besides the saved operands: dO, the forward's O and LSE, and the
    preprocess's D, quantized dO and dV fold references (one launch; timed apart by measure)."""
    out, lse = flamia_fwd_sm90(qq.data_td, qq.scale, kq.data_td, kq.scale, vq.data_dt, vq.scale, kt.data_td,
                               kt.scale, vt.data_dt, vt.scale, case.cu, case.max_len, case.scale,
                               FwdConfig(128, diagonal_copy=True))
    dout = case.sets[0][3]
    delta, doq, dv_ref = preprocess_bwd(dout, out, case.cu, dv_ref_group=1)
    return dout, out, lse, delta, doq, dv_ref


# the forward's build choices the tuner and the plan make (FwdConfig's fields)
FWD_VARIANTS = {
    "default": FwdConfig(128, diagonal_copy=True),
    "3 kv stages": FwdConfig(128, diagonal_copy=True, kv_stages=3),
    "per-tile launch": FwdConfig(128, diagonal_copy=True, persistent=False),  # the >1,024-document fallback
    "longest documents": FwdConfig(128, diagonal_copy=True, tile_order="longest_documents"),
    "short pairs": FwdConfig(128, diagonal_copy=True, short_pairs=True),
}


def time_variants(row, prefix, variants, run, names, flops=None):
    """Each (label, config) of `variants` (VARIANT_FILTER restricts them) timed alone into
    row[f"{prefix}, {label}"] (and TFLOP/s when flops is given), and its outputs (run(cfg)'s first
    len(names) tensors) against the first variant's: row[f"rel diff {name}, {label}"]. The tests
    check each build against the emulator; this says how far the timed ones moved.

    BREAKDOWN_ROUNDS=r > 1 times the variants r times, the order rotated each round (so no build is
    always timed first, on the coolest GPU), and keeps the median; the rounds' times go to
    row[f"{prefix}, {label}, rounds"]."""
    chosen = [(label, cfg) for label, cfg in variants if not VARIANT_FILTER or label in VARIANT_FILTER]
    ref = None
    for label, cfg in chosen:
        outs = [t.float() for t in run(cfg)[:len(names)]]
        if ref is None:
            ref = outs
        else:
            for name, o, r in zip(names, outs, ref, strict=True):
                row[f"rel diff {name}, {label}"] = float((o - r).norm() / r.norm())
    times = {label: [] for label, _ in chosen}
    for r in range(ROUNDS):
        k = r % max(1, len(chosen))
        for label, cfg in chosen[k:] + chosen[:k]:
            times[label].append(graph_ms(lambda cfg=cfg: run(cfg)))
    for label, _ in chosen:
        row[f"{prefix}, {label}"] = ms = statistics.median(times[label])
        if ROUNDS > 1:
            row[f"{prefix}, {label}, rounds"] = [round(t, 4) for t in times[label]]
        if flops is not None:
            row[f"TFLOP/s, {label}"] = flops / (ms * 1e9)


def measure_fwd_variants(case, qq, kq, kt, vq, vt, row, flops):
    """The forward kernel alone per build variant (FWD_VARIANTS), O against the default's."""
    def run(cfg):
        return flamia_fwd_sm90(qq.data_td, qq.scale, kq.data_td, kq.scale, vq.data_dt, vq.scale, kt.data_td,
                               kt.scale, vt.data_dt, vt.scale, case.cu, case.max_len, case.scale, cfg)
    time_variants(row, "fwd kernel", FWD_VARIANTS.items(), run, ("O",), flops)
    return row


def measure_ds_orders(case, qq, kq, kt, vq, vt, row):
    dout, out, lse, delta, doq, dv_ref = backward_inputs(case, qq, kq, kt, vq, vt)
    q_bf16 = e4m3_codes_to_bf16(qq.data_td, qq.scale)  # the bf16 Q copy the host wrapper makes
    auto = auto_head_window(kq.data_td.shape[1], case.max_len)
    variants = (("default", BwdDsBf16Config(128, diagonal_copy=True)),
                # the untuned call's config: its head window by document length (auto_head_window)
                ("auto window", BwdDsBf16Config(128, diagonal_copy=True, head_window=auto)),
                *((f"window {w}", BwdDsBf16Config(128, diagonal_copy=True, head_window=w)) for w in (2, 4, 8, 16)),
                ("3 vector stages", BwdDsBf16Config(128, diagonal_copy=True, vec_stages=3)),
                ("auto window short pairs", BwdDsBf16Config(128, diagonal_copy=True, head_window=auto,
                                                            short_pairs=True)),
                ("deterministic", BwdDsBf16Config(128, diagonal_copy=True, deterministic=True)))

    def run(cfg):
        return flamia_bwd_dsbf16_sm90_from_saved(dout, out, lse, qq, kq, vq, kt, vt, case.cu, case.max_len,
                                                 case.scale, config=cfg, do_quantized=doq, delta=delta,
                                                 dv_ref=dv_ref, q_bf16=q_bf16)
    time_variants(row, "dsbf16 bwd kernel", variants, run, ("dq", "dk", "dv"))
    row["Q codes to bf16 (torch)"] = graph_ms(lambda: qq.data_td.to(torch.bfloat16))
    row["Q times sq to bf16 (codes_sm90)"] = graph_ms(lambda: e4m3_codes_to_bf16(qq.data_td, qq.scale))
    want = (qq.data_td.float() * qq.scale.t().unsqueeze(-1)).to(torch.bfloat16)
    assert torch.equal(e4m3_codes_to_bf16(qq.data_td, qq.scale), want)
    return row


def main():
    wl = json.loads(DEFAULT_WORKLOADS.read_text())["workloads"]
    # and the short-document packs, by name in BREAKDOWN_WORKLOADS
    wl.update(json.loads((Path(__file__).with_name("workloads_short.json")).read_text())["workloads"])
    rows = []
    default = ("1x16k", "16x1k", "4x4k", "longtail32k", "1x64k") + (("mixed16k",) if (ONLY_DS or ONLY_FWD) else ())
    for name in WORKLOADS or default:
        row = measure(name, wl[name])
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"fwd_breakdown{'_' + ONLY if ONLY else ''}.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
