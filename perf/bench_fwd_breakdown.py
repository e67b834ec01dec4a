"""Where the forward's time goes on the GPU: API call vs quantization vs the attention kernel alone.

    python perf/bench_fwd_breakdown.py            # prints a table; $OUT/fwd_breakdown.json when OUT is set
Kernel-only times replay a CUDA graph of 10 launches, so host launch overhead is excluded.
"""

import json
import os
import statistics
from pathlib import Path

import torch

from flamia_cute import flamia_attn_varlen_func
from flamia_cute.attention_bwd_dsbf16_sm90 import (
    BwdDsBf16Config,
    auto_head_window,
    dv_fold_reference,
    flamia_bwd_dsbf16_sm90_from_saved,
)
from flamia_cute.attention_bwd_sm90 import BwdConfig, flamia_bwd_sm90_from_saved, preprocess_bwd
from flamia_cute.attention_fwd_sm90 import FwdConfig, flamia_fwd_sm90
from flamia_cute.bench import DEFAULT_WORKLOADS, Case
from flamia_cute.codes_sm90 import e4m3_codes_to_bf16
from flamia_cute.cute_backend import quantize_operands
from flamia_cute.schedules import causal_flops


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
    for label, cfg in (("kernel s2 pp", FwdConfig(128, diagonal_copy=True)),
                       ("kernel s3 pp", FwdConfig(128, diagonal_copy=True, kv_stages=3)),
                       ("kernel s2 nopp", FwdConfig(128, diagonal_copy=True, pingpong=False)),
                       ("kernel s2 pp nopin", FwdConfig(128, diagonal_copy=True, pin_softmax=False)),
                       # the zero-V rule's selects behind a warp vote (session 6: the rule cost ~7%?)
                       ("kernel s2 pp selects always", FwdConfig(128, diagonal_copy=True, drop_branch=False))):
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
    row["TFLOP/s kernel"] = flops / (row["kernel s2 pp"] * 1e9)

    # backward: the kernel alone (dO quantization and D precomputed), and that preprocess
    dout, out, lse, delta, doq, dv_ref = backward_inputs(case, qq, kq, kt, vq, vt)

    def bwd():
        flamia_bwd_sm90_from_saved(dout, out, lse, qq, kq, vq, kt, vt, case.cu, case.max_len, case.scale,
                                   do_quantized=doq, delta=delta)

    # the bf16-dS backward (recipe fp8_tokenblock_dsbf16): its kernel alone (and its variants), and the
    # torch launches of its dV fold references
    ds_cfg = BwdDsBf16Config(128, diagonal_copy=True)

    def ds_prep():
        return dv_fold_reference(doq.scale, case.cu, 1)

    def ds_bwd(cfg=ds_cfg):
        flamia_bwd_dsbf16_sm90_from_saved(dout, out, lse, qq, kq, vq, kt, vt, case.cu, case.max_len, case.scale,
                                          config=cfg, do_quantized=doq, delta=delta, dv_ref=dv_ref)

    def ds_bwd_atomics():  # dQ by the consumers' atomics (the default until session 6; the deterministic path)
        ds_bwd(BwdDsBf16Config(128, diagonal_copy=True, dq_tma_reduce=False))

    def ds_bwd_one_wait():  # S^T and dP^T waited for together (before session 7)
        ds_bwd(BwdDsBf16Config(128, diagonal_copy=True, exp_under_dp=False))

    def bwd_blocks():  # the e4m3-dS kernel in the key-block-fastest CTA order (not its default yet)
        flamia_bwd_sm90_from_saved(dout, out, lse, qq, kq, vq, kt, vt, case.cu, case.max_len, case.scale,
                                   config=BwdConfig(128, diagonal_copy=True, raster="blocks"), do_quantized=doq,
                                   delta=delta)

    for label, fn in (("bwd kernel", bwd), ("bwd kernel, blocks order", bwd_blocks),
                      ("bwd preprocess", lambda: preprocess_bwd(dout, out, case.cu)),
                      ("dsbf16 bwd kernel", ds_bwd), ("dsbf16 bwd kernel, dQ atomics", ds_bwd_atomics),
                      ("dsbf16 bwd kernel, one S/dP wait", ds_bwd_one_wait),
                      ("dsbf16 dV fold references", ds_prep)):
        try:
            row[label] = graph_ms(fn)
        except Exception as e:
            row[label] = events_ms(fn)
            row["note_bwd"] = f"events ({type(e).__name__})"
    bwd_flops = causal_flops(case.lengths, 16, 128, backward=True)
    row["TFLOP/s bwd kernel"] = bwd_flops / (row["bwd kernel"] * 1e9)
    row["TFLOP/s dsbf16 bwd kernel"] = bwd_flops / (row["dsbf16 bwd kernel"] * 1e9)
    return row


# BREAKDOWN_ONLY=ds: only the bf16-dS backward kernel's build variants (the default, dK's GEMM waited
# for with dQ's, Q in bf16 converted in the kernel, the S^T/dP^T prefetch) and the bf16 Q copy (torch codes only, codes_sm90)
ONLY = os.environ.get("BREAKDOWN_ONLY", "")
ONLY_DS = ONLY == "ds"
# BREAKDOWN_ONLY=fwd: only the forward kernel's build variants (FWD_VARIANTS below)
ONLY_FWD = ONLY == "fwd"
# comma lists restricting the variants (of either mode; the variable's name is older than the fwd
# mode) and the workloads (short device runs)
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


FWD_VARIANTS = {
    "default": FwdConfig(128, diagonal_copy=True),
    "pingpong": FwdConfig(128, diagonal_copy=True, pingpong=True),
    "exp2 poly 1/4": FwdConfig(128, diagonal_copy=True, exp2_poly_every=4),
    "exp2 poly 1/8": FwdConfig(128, diagonal_copy=True, exp2_poly_every=8),
    "pinned softmax": FwdConfig(128, diagonal_copy=True, pin_softmax=True),
    "3 kv stages": FwdConfig(128, diagonal_copy=True, kv_stages=3),
    "per-tile launch": FwdConfig(128, diagonal_copy=True, persistent=False),  # sessions 1-9's default
    # persistent CTAs taking tiles c, c + grid, ... instead of from the atomic counter (issue 7: measure both)
    "stride": FwdConfig(128, diagonal_copy=True, tile_claim="stride"),
    # the next tile's diagonal S with this tile's last P V (the overlap carried across tiles)
    "overlap tiles": FwdConfig(128, diagonal_copy=True, overlap_tiles=True),
    # every (document, head)'s heavier half of blocks first (modelled -3..-4% on 16x1k, 4x4k; measured
    # +3..+12%, -5% on 1x64k: run s11a)
    "heavy first": FwdConfig(128, diagonal_copy=True, tile_order="heavy_first"),
    # LPT across documents (perf/schedule_model.py: -4% on longtail32k; the others keep their order;
    # run s11f timed it on the staged build as "staged longest documents")
    "longest documents": FwdConfig(128, diagonal_copy=True, tile_order="longest_documents"),
    # the tile's inputs loaded by the consumers at its start (sessions 1-10; staged by the producers,
    # the default since e52734c: runs s11d-s11f timed that as "staged inputs")
    "unstaged inputs": FwdConfig(128, diagonal_copy=True, stage_tile_inputs=False),
    # the next tile claimed before this tile's loads (s11h: the claim's round trip on the TMA warp)
    "claim ahead": FwdConfig(128, diagonal_copy=True, claim_ahead=True),
    "3 q stages": FwdConfig(128, diagonal_copy=True, q_stages=3),  # tile t+2's Q in flight (s11h)
    # the castsum recipe's build: l from P V's column D over ones rows below V^T (the 64 row-sum FADDs
    # per thread off the issue slots); with exp2 poly 1/8 on top (issue slots freed for the FMA pipe's exp2)
    "row sum mma": FwdConfig(128, diagonal_copy=True, row_sum_mma=True),
    "row sum mma + poly 1/8": FwdConfig(128, diagonal_copy=True, row_sum_mma=True, exp2_poly_every=8),
    # two short documents per query tile (session 22)
    "short pairs": FwdConfig(128, diagonal_copy=True, short_pairs=True),
    "short pairs longest": FwdConfig(128, diagonal_copy=True, short_pairs=True, tile_order="longest_documents"),
    # the diagonal step's scales in 3 or 1 global round trips instead of the default's 2 (session 23)
    "scale trips 3": FwdConfig(128, diagonal_copy=True, diagonal_scale_trips=3),
    "scale trips 1": FwdConfig(128, diagonal_copy=True, diagonal_scale_trips=1),
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
    q_bf16 = e4m3_codes_to_bf16(qq.data_td, qq.scale)  # what the host wrapper makes for q_bf16_source="tma"
    auto = auto_head_window(kq.data_td.shape[1], case.max_len)
    variants = (("default", BwdDsBf16Config(128, diagonal_copy=True)),
                ("dK with dQ", BwdDsBf16Config(128, diagonal_copy=True, dk_under_dq_store=False)),
                ("Q bf16 converted", BwdDsBf16Config(128, diagonal_copy=True, q_bf16_source="convert")),
                # the S^T/dP^T prefetch at d128: no spills since s8d's scale folding (1-4% slower, s7c)
                ("prefetch", BwdDsBf16Config(128, diagonal_copy=True, prefetch_sdp=True, dk_under_dq_store=False)),
                ("preload 8 vectors", BwdDsBf16Config(128, diagonal_copy=True, preload_vectors=8)),
                # dQ by the consumers' red.global.add.v2 from registers: no shared-memory tile
                # (the dQ stores were 22% of the 1x16k kernel in run s9g's ablation)
                ("dQ atomics", BwdDsBf16Config(128, diagonal_copy=True, dq_tma_reduce=False)),
                # each phase's V^T transposed while its first S^T runs (s13a: -1.2..+1.2%)
                ("transpose V under S^T", BwdDsBf16Config(128, diagonal_copy=True, transpose_v_under_s=True)),
                # no zero fill of the dQ accumulator: the first CTA at a tile stores it (the timed call
                # includes the default's fill, and this one's claim words' zeroing; s13b-s13d: slower)
                ("dQ first store", BwdDsBf16Config(128, diagonal_copy=True, dq_first_store=True)),
                # the phase change as before session 18: the per-token K/V released after the last
                # diagonal tile, the block scales loaded then
                ("late phase change", BwdDsBf16Config(128, diagonal_copy=True, phase_prefetch=False,
                                                       early_block_scales=False)),
                # and phase 1's block scales loaded at the CTA's start (built in session 18, not yet run)
                ("early block scales", BwdDsBf16Config(128, diagonal_copy=True, early_block_scales=True)),
                # one dS tile (-16 KB; built in session 18, not yet run)
                ("one dS buffer", BwdDsBf16Config(128, diagonal_copy=True, ds_buffers=1)),
                # one Q/dO stage (-40 KB of shared memory: the room a second K/V stage would need)
                ("1 query stage", BwdDsBf16Config(128, diagonal_copy=True, q_stages=1)),
                # the blocks order in windows of w heads (session 18: the CTA queue's tail)
                *((f"window {w}", BwdDsBf16Config(128, diagonal_copy=True, head_window=w)) for w in (2, 4, 8, 16)),
                # the untuned call's config (its window by document length), and the persistent build on
                # the same order (session 19): items from the counter, or every grid-th item
                ("auto window", BwdDsBf16Config(128, diagonal_copy=True, head_window=auto)),
                ("auto window early scales", BwdDsBf16Config(128, diagonal_copy=True, head_window=auto,
                                                             early_block_scales=True)),
                ("persistent", BwdDsBf16Config(128, diagonal_copy=True, head_window=auto, persistent=True)),
                ("persistent stride", BwdDsBf16Config(128, diagonal_copy=True, head_window=auto, persistent=True,
                                                      item_claim="stride")),
                ("persistent window 1", BwdDsBf16Config(128, diagonal_copy=True, persistent=True)),
                ("persistent end release", BwdDsBf16Config(128, diagonal_copy=True, head_window=auto, persistent=True,
                                                           release_in_last_tile=False)),
                ("auto window late scales", BwdDsBf16Config(128, diagonal_copy=True, head_window=auto,
                                                            early_block_scales=False)),
                # phase 0's row scales loaded at the kernel's entry (session 19's stamps: 1.1 us after 0.8 of setup)
                ("auto window scales at entry", BwdDsBf16Config(128, diagonal_copy=True, head_window=auto,
                                                                scales_at_entry=True)),
                # two short documents per CTA (session 22)
                ("auto window short pairs", BwdDsBf16Config(128, diagonal_copy=True, head_window=auto,
                                                            short_pairs=True)))

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
    # and the short-document packs (issue 7), by name in BREAKDOWN_WORKLOADS
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
