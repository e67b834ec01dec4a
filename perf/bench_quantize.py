"""Fused FP8 quantization on sm_90: bit-exactness, bandwidth, and compile/cache time.

    python perf/bench_quantize.py            # prints a table; writes $OUT/bench_quantize.json if OUT is set

Bandwidth counts the bytes the kernel must move: x read once (2 B/elem), each fp8 copy written
once (1 B/elem; data_td and data_dt per set, data_dt counted as T*H*D: its pad columns, T_dt - T
per row, are not useful bytes), the fp32 scales (4 B per head and token per set).

Three times per run: `kernel` launches the compiled kernel into preallocated outputs (the kernel
alone); `e2e` is the whole `fused_quantize_sm90` call (output allocation + one launch; the kernel
finds its chunks from cu_seqlens, so there is no chunk table to build); `host_us` is the host
time per call of back-to-back calls (launch overhead, what a Q/K/V triple pays three times).
Each timed launch is preceded by a GPU sleep so host launch overhead never shows up between
the events; inputs rotate over several buffers larger than L2 in total.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PEAK_GBPS = 4300.0  # H200 HBM3e
REPS = 60
WARMUP = 5
BUFFERS = 4

RECIPES = {
    "token": dict(block_tokens=1, emit_token_copy=False),
    "tokenblock": dict(block_tokens=128, emit_token_copy=True),
}


def load_workloads() -> dict:
    return json.loads((REPO / "flamia_cute" / "workloads.json").read_text())["workloads"]


def cu_from(lengths, device):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def moved_bytes(T, H, D, num_sets, copies: int = 2) -> int:
    """x read (bf16) + per set: `copies` fp8 copies of T*H*D (data_td and data_dt, not T_dt) and the fp32 scales."""
    return T * H * D * 2 + num_sets * (copies * T * H * D + 4 * H * T)


def config_bytes(T, cfg) -> int:
    """moved_bytes of one QuantizeConfig part: the copies it writes (data_td, data_dt or both)."""
    return moved_bytes(T, cfg.num_heads, cfg.head_dim, cfg.num_sets, int(cfg.emit_token_major) + int(cfg.emit_transposed))


def host_us_per_call(fn, arg, calls=200) -> float:
    """Host wall time per call of back-to-back calls (the GPU queue absorbs the kernels)."""
    fn(arg)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn(arg)
    host = (time.perf_counter() - t) / calls
    torch.cuda.synchronize()
    return host * 1e6


def time_ms(fn, inputs) -> list[float]:
    """Per-launch GPU times; a sleep before each start event keeps the queue ahead of the host."""
    times = []
    for r in range(WARMUP + REPS):
        arg = inputs[r % len(inputs)]
        torch.cuda._sleep(2_000_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(arg)
        end.record()
        end.synchronize()
        if r >= WARMUP:
            times.append(start.elapsed_time(end))
    return times


def copy_ceiling(numel_bytes: int) -> float:
    """GB/s of a device-to-device copy of the same input size (read + write)."""
    n = numel_bytes // 2
    src = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(BUFFERS)]
    dst = torch.empty_like(src[0])
    ms = statistics.median(time_ms(lambda s: dst.copy_(s), src))
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def check_exact(out, ref, what):
    """out's layouts (data_td, data_dt where written) and scales bitwise equal to the reference's."""
    ok = torch.equal(out.scale.view(torch.int32), ref.scale.view(torch.int32))
    for name in ("data_td", "data_dt"):
        if getattr(out, name) is not None:
            ok &= torch.equal(getattr(out, name).view(torch.uint8), getattr(ref, name).view(torch.uint8))
    if not ok:
        raise SystemExit(f"NOT bit-exact: {what}")


_COMPILE_PROBE = """
import json, time
t0 = time.perf_counter()
from flamia_cute import compile_cache
from flamia_cute.sm90.quantize import QuantizeConfig, get_compiled
t1 = time.perf_counter()
get_compiled(QuantizeConfig(head_dim=128, num_heads=16, block_tokens=128, emit_token_copy=True))
t2 = time.perf_counter()
s = compile_cache.STATS
print(json.dumps(dict(import_s=t1 - t0, get_kernel_s=t2 - t1, compiles=s.compiles, disk_hits=s.disk_hits,
                      export_errors=s.export_errors)))
"""


def compile_times() -> dict:
    """Cold compile, then a fresh process that must load the kernel from the disk cache."""
    res = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, FLAMIA_CUTE_CACHE_DIR=cache)
        for name in ("first_process", "second_process"):
            out = subprocess.run([sys.executable, "-c", _COMPILE_PROBE], env=env, capture_output=True, text=True)
            if out.returncode != 0:
                res[name] = {"error": out.stderr[-2000:]}
            else:
                res[name] = json.loads(out.stdout.strip().splitlines()[-1])
    return res


def _alloc_sets(cfg, T, Tdt, dev):
    H, D = cfg.num_heads, cfg.head_dim
    return [
        (
            torch.empty(T, H, D, dtype=torch.float8_e4m3fn, device=dev),
            torch.empty(H, D, Tdt, dtype=torch.float8_e4m3fn, device=dev),
            torch.empty(H, T, dtype=torch.float32, device=dev),
        )
        for _ in range(cfg.num_sets)
    ]


def bench_raster(workloads, dev, H, D) -> list:
    """Single tensor, kernel only: CTA order heads-fastest (default) vs chunks-fastest (the old order)."""
    from flamia_cute.quant import transposed_tokens
    from flamia_cute.sm90.quantize import MultiQuantizeConfig, QuantizeConfig, launch_fused_quantize_sm90

    rows = []
    for wname in ("1x16k", "longtail32k"):
        lengths = workloads[wname]
        T, cu = sum(lengths), cu_from(lengths, dev)
        Tdt = transposed_tokens(T, len(lengths))
        xs = [torch.randn(T, H, D, device=dev).to(torch.bfloat16) for _ in range(BUFFERS)]
        for rname, kw in RECIPES.items():
            base = QuantizeConfig(head_dim=D, num_heads=H, **kw)
            sets = _alloc_sets(base, T, Tdt, dev)
            for raster in ("heads", "chunks"):
                for min_ctas in (4, 5):
                    cfg = MultiQuantizeConfig((base,), raster=raster, min_ctas_per_sm=min_ctas)
                    ms = statistics.median(
                        time_ms(lambda x, cu=cu, cfg=cfg, sets=sets: launch_fused_quantize_sm90(x, cu, cfg, sets), xs))
                    gbps = moved_bytes(T, H, D, base.num_sets) / (ms * 1e-3) / 1e9
                    rows.append(dict(workload=wname, recipe=rname, raster=raster, min_ctas_per_sm=min_ctas, median_ms=ms,
                                     gbps=gbps, pct_of_peak=100 * gbps / PEAK_GBPS))
                    print(f"raster {wname:12s} {rname:10s} {raster:6s} min_ctas={min_ctas} {ms * 1e3:8.1f} us "
                          f"{100 * gbps / PEAK_GBPS:5.1f}% of peak")
    return rows


def bench_dout_delta(workloads, dev, H, D) -> list:
    """The backward's preprocess: dO quantized (per token, both orientations) and D = rowsum(dO * O),
    one fused launch against the previous path (D as torch ops, then the dO launch), same run."""
    from flamia_cute.sm90.quantize import dout_config, dout_delta_config, fused_quantize_sm90, quantize_with_rowdot_sm90

    rows = []
    for wname in ("1x16k", "16x1k", "longtail32k"):
        lengths = workloads[wname]
        T = sum(lengths)
        cu = cu_from(lengths, dev)
        pairs = [(torch.randn(T, H, D, device=dev).to(torch.bfloat16), torch.randn(T, H, D, device=dev).to(torch.bfloat16))
                 for _ in range(BUFFERS)]
        cfg, old_cfg = dout_delta_config(D, H), dout_config(D, H)
        doq, delta = quantize_with_rowdot_sm90(*pairs[0], cu, cfg)
        ref = (pairs[0][0].double() * pairs[0][1].double()).sum(-1).t()
        err = float((delta.double() - ref).abs().max() / ref.abs().max())

        def fused(p, cu=cu, cfg=cfg):
            quantize_with_rowdot_sm90(p[0], p[1], cu, cfg)

        def previous(p, cu=cu, old_cfg=old_cfg):
            (p[0].float() * p[1].float()).sum(-1).t().contiguous()
            fused_quantize_sm90(p[0], cu, old_cfg)

        fused_ms = statistics.median(time_ms(fused, pairs))
        prev_ms = statistics.median(time_ms(previous, pairs))
        nbytes = T * H * D * (2 + 2 + 1 + 1) + 4 * H * T * 2  # dO, O read; data_td, data_dt, scale, D written
        row = dict(workload=wname, fused_ms=fused_ms, previous_ms=prev_ms, bytes=nbytes,
                   pct_of_peak=100 * nbytes / (fused_ms * 1e-3) / 1e9 / PEAK_GBPS, delta_max_rel_err=err,
                   host_us_per_call=host_us_per_call(fused, pairs[0]))
        rows.append(row)
        print(f"dout+D {wname:12s} fused {fused_ms * 1e3:8.1f} us ({row['pct_of_peak']:5.1f}% of peak) vs torch D + dO "
              f"launch {prev_ms * 1e3:8.1f} us  host {row['host_us_per_call']:.1f} us/call  D max rel err {err:.1e}")
    return rows


def bench_qkv(workloads, dev) -> list:
    """Q, K, V: one fused launch vs three single launches (every layout: qkv_config), kernel only and host
    us per call; and the launch a call makes (forward_only: the forward's layouts, all either backward
    reads), kernel only."""
    from flamia_cute.cute_backend import quantize_operands
    from flamia_cute.quant import quantize_thd, transposed_tokens
    from flamia_cute.sm90.quantize import (
        _alloc_outputs,
        forward_only,
        fused_quantize_multi_sm90,
        fused_quantize_sm90,
        launch_fused_quantize_multi_sm90,
        launch_fused_quantize_sm90,
        qkv_config,
    )

    rows = []
    for hname, (hq, hkv, D) in (("h16_d128", (16, 16, 128)), ("gqa32x8_d128", (32, 8, 128))):
        for wname in ("16x1k", "1x16k", "longtail32k"):
            lengths = workloads[wname]
            T, cu = sum(lengths), cu_from(lengths, dev)
            Tdt = transposed_tokens(T, len(lengths))
            for rname, block in (("token", 1), ("tokenblock", 128)):
                m = qkv_config(D, hq, hkv, block)
                ins = [
                    [torch.randn(T, h, D, device=dev).to(torch.bfloat16) for h in (hq, hkv, hkv)] for _ in range(BUFFERS)
                ]
                outs = fused_quantize_multi_sm90(ins[0], cu, m, debug_fill=0x7F)
                for x, cfg, (o0, o1) in zip(ins[0], m.parts, outs, strict=True):
                    check_exact(o0, quantize_thd(x, cu, cfg.block_tokens, pv_order=cfg.dt_pv_order), f"qkv {wname} {rname}")
                    if o1 is not None:
                        check_exact(o1, quantize_thd(x, cu, 1, pv_order=cfg.dt_pv_order), f"qkv {wname} {rname} copy")
                sets = [_alloc_sets(cfg, T, Tdt, dev) for cfg in m.parts]
                fused_ms = statistics.median(
                    time_ms(lambda xs, m=m, cu=cu, sets=sets: launch_fused_quantize_multi_sm90(xs, cu, m, sets), ins))

                def three(xs, m=m, cu=cu, sets=sets):
                    for x, cfg, st in zip(xs, m.parts, sets, strict=True):
                        launch_fused_quantize_sm90(x, cu, cfg, st)

                three_ms = statistics.median(time_ms(three, ins))
                fo = forward_only(m)
                for x, cfg, (o0, o1) in zip(ins[0], fo.parts, fused_quantize_multi_sm90(ins[0], cu, fo), strict=True):
                    check_exact(o0, quantize_thd(x, cu, cfg.block_tokens, pv_order=cfg.dt_pv_order), f"fwd-only {wname}")
                    if o1 is not None:
                        check_exact(o1, quantize_thd(x, cu, 1, pv_order=cfg.dt_pv_order), f"fwd-only {wname} copy")
                fo_sets = _alloc_outputs(fo, T, Tdt, dev)
                fo_ms = statistics.median(
                    time_ms(lambda xs, fo=fo, cu=cu, s=fo_sets: launch_fused_quantize_multi_sm90(xs, cu, fo, s), ins))
                fo_bytes = sum(config_bytes(T, cfg) for cfg in fo.parts)
                host_fused = host_us_per_call(lambda xs, m=m, cu=cu: fused_quantize_multi_sm90(xs, cu, m), ins[0])
                host_three = host_us_per_call(
                    lambda xs, m=m, cu=cu: [fused_quantize_sm90(x, cu, cfg) for x, cfg in zip(xs, m.parts, strict=True)], ins[0])
                max_len = max(lengths)
                host_ops = host_us_per_call(
                    lambda xs, cu=cu, block=block, n=max_len: quantize_operands(*xs, cu, block, n), ins[0])
                nbytes = sum(moved_bytes(T, cfg.num_heads, D, cfg.num_sets) for cfg in m.parts)
                row = dict(heads=hname, workload=wname, recipe=rname, bytes=nbytes, fused_ms=fused_ms, three_ms=three_ms,
                           fused_pct_of_peak=100 * nbytes / (fused_ms * 1e-3) / 1e9 / PEAK_GBPS,
                           three_pct_of_peak=100 * nbytes / (three_ms * 1e-3) / 1e9 / PEAK_GBPS,
                           host_us_fused=host_fused, host_us_three=host_three, host_us_quantize_operands=host_ops,
                           forward_only_ms=fo_ms, forward_only_bytes=fo_bytes,
                           forward_only_pct_of_peak=100 * fo_bytes / (fo_ms * 1e-3) / 1e9 / PEAK_GBPS)
                rows.append(row)
                print(f"qkv {hname:12s} {wname:12s} {rname:10s} kernel fused {fused_ms * 1e3:8.1f} us "
                      f"({row['fused_pct_of_peak']:5.1f}%) vs 3 launches {three_ms * 1e3:8.1f} us "
                      f"({row['three_pct_of_peak']:5.1f}%)  host us/call fused {host_fused:6.1f} vs 3x {host_three:6.1f} "
                      f"quantize_operands {host_ops:6.1f}  forward layouts {fo_ms * 1e3:8.1f} us "
                      f"({row['forward_only_pct_of_peak']:5.1f}%)  exact")
    return rows


def main():
    from flamia_cute.quant import quantize_thd, transposed_tokens
    from flamia_cute.sm90.quantize import QuantizeConfig, fused_quantize_sm90, launch_fused_quantize_sm90

    assert torch.cuda.is_available(), "needs a GPU"
    dev = torch.device("cuda")
    H, D = 16, 128
    workloads = load_workloads()
    results = {"device": torch.cuda.get_device_name(), "peak_gbps": PEAK_GBPS, "runs": []}

    results["compile"] = compile_times()
    print("compile:", json.dumps(results["compile"]))

    for wname in ("1x16k", "longtail32k"):
        lengths = workloads[wname]
        T = sum(lengths)
        cu = cu_from(lengths, dev)
        Tdt = transposed_tokens(T, len(lengths))
        xs = [torch.randn(T, H, D, device=dev).to(torch.bfloat16) for _ in range(BUFFERS)]
        ceiling = copy_ceiling(T * H * D * 2)
        for rname, kw in RECIPES.items():
            cfg = QuantizeConfig(head_dim=D, num_heads=H, **kw)
            t0 = time.perf_counter()
            out0, out1 = fused_quantize_sm90(xs[0], cu, cfg, debug_fill=0x7F)
            torch.cuda.synchronize()
            first_call_s = time.perf_counter() - t0
            check_exact(out0, quantize_thd(xs[0], cu, cfg.block_tokens), f"{wname} {rname} set0")
            if out1 is not None:
                check_exact(out1, quantize_thd(xs[0], cu, 1), f"{wname} {rname} token copy")
            sets = [
                (
                    torch.empty(T, H, D, dtype=torch.float8_e4m3fn, device=dev),
                    torch.empty(H, D, Tdt, dtype=torch.float8_e4m3fn, device=dev),
                    torch.empty(H, T, dtype=torch.float32, device=dev),
                )
                for _ in range(cfg.num_sets)
            ]
            kernel_ms = time_ms(lambda x, cu=cu, cfg=cfg, sets=sets: launch_fused_quantize_sm90(x, cu, cfg, sets), xs)
            # end to end: output allocation + the launch (no chunk table: the kernel scans cu_seqlens)
            e2e_ms = time_ms(lambda x, cu=cu, cfg=cfg: fused_quantize_sm90(x, cu, cfg), xs)
            host_us = host_us_per_call(lambda x, cu=cu, cfg=cfg: fused_quantize_sm90(x, cu, cfg), xs[0])
            nbytes = moved_bytes(T, H, D, cfg.num_sets)
            med = statistics.median(kernel_ms)
            gbps = nbytes / (med * 1e-3) / 1e9
            row = dict(
                workload=wname,
                recipe=rname,
                tokens=T,
                docs=len(lengths),
                bytes=nbytes,
                median_ms=med,
                min_ms=min(kernel_ms),
                gbps=gbps,
                pct_of_peak=100 * gbps / PEAK_GBPS,
                pct_of_copy=100 * gbps / ceiling,
                copy_ceiling_gbps=ceiling,
                e2e_median_ms=statistics.median(e2e_ms),
                host_us_per_call=host_us,
                first_call_s=first_call_s,
                bit_exact=True,
            )
            results["runs"].append(row)
            print(
                f"{wname:12s} {rname:10s} T={T:6d} {med * 1e3:8.1f} us  {gbps:7.0f} GB/s  "
                f"{row['pct_of_peak']:5.1f}% of {PEAK_GBPS:.0f}  ({row['pct_of_copy']:5.1f}% of copy "
                f"{ceiling:.0f} GB/s)  e2e {row['e2e_median_ms'] * 1e3:.1f} us  host {host_us:.1f} us/call  exact"
            )

    results["dout_delta"] = bench_dout_delta(workloads, dev, H, D)
    results["raster"] = bench_raster(workloads, dev, H, D)
    results["qkv"] = bench_qkv(workloads, dev)

    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "bench_quantize.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
