"""A direct cudnn-frontend FP8 attention call, as a user writes it, next to the benchmark's cuDNN
baseline (flamia_cute/baselines/cudnn_fp8.py), timed as `flamia-cute bench --gpu-time` times calls
(bench._time_calls behind a queued GPU sleep, medians over rotated input sets of bench.Case).

The direct call, written here without the baseline's code: the sdpa_fp8 graph built once (causal,
BSHD, e4m3 in and out, softmax stats, O's amax as cudnn-frontend's sample declares it), every
execution plan built and the fastest kept (timed), Q, K and V quantized from bf16 per tensor
(power-of-two current scaling) by one torch.compile'd function, O converted to bf16 by another.
Rows, per workload:

- `kernel`: the graph alone on Q, K, V quantized once (its floor; FP8 O);
- `direct`: quantization + graph + O in bf16, the user's best direct call;
- `direct_eager_quant`: the same with the quantization and conversion as plain torch ops;
- `wrapper`: the baseline as the benchmark runs it (bench.CudnnFp8, forward);
- with --bwd, `direct_fwdbwd` and `wrapper_fwdbwd` (dO quantized, gradients in bf16 too).

The check: `wrapper` within 5% of `direct` (printed). With --graph, each is also timed from CUDA-graph
replays after 2 s of calls, and a replay's O is compared with the eager call's (a cuDNN call that a
capture missed leaves O unwritten).

    python perf/cudnn_direct.py --out DIR                 # 1x16k, forward: ~1 min on one H200
    python perf/cudnn_direct.py --only 1x16k,4x4k --bwd --graph
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import pathlib
import sys

import torch

E4M3_MAX = 448.0
F8 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------- the direct call


def quantize_qkv(q, k, v):
    """Per-tensor current scaling: x * s in e4m3 with s = the power of two that maps amax(|x|) under 448."""
    out = []
    for x in (q, k, v):
        s = torch.exp2(torch.floor(torch.log2(E4M3_MAX / x.abs().amax().float().clamp_min(1e-12))))
        out += [(x * s.to(x.dtype)).to(F8), (1.0 / s).reshape(1, 1, 1, 1), s.reshape(1, 1, 1, 1)]
    (q8, dq, _), (k8, dk, _), (v8, dv, sv) = out[0:3], out[3:6], out[6:9]
    return q8, dq, k8, dk, v8, dv, sv  # O's scale is V's: |O| <= max|V|


def quantize_one(x):
    s = torch.exp2(torch.floor(torch.log2(E4M3_MAX / x.abs().amax().float().clamp_min(1e-12))))
    return (x * s.to(x.dtype)).to(F8), (1.0 / s).reshape(1, 1, 1, 1)


def to_bf16(*pairs):
    return tuple((x.float() * d).to(torch.bfloat16) for x, d in zip(pairs[0::2], pairs[1::2], strict=True))


class Direct:
    """cudnn-frontend's sdpa_fp8 (and sdpa_fp8_backward with bwd) for one (b, s, hq, hkv, d)."""

    UID = {n: i for i, n in enumerate(
        ("q", "k", "v", "o", "stats", "dq_s", "dk_s", "dv_s", "ds_s", "ss", "so", "amax_o", "amax_s",
         "b_q", "b_k", "b_v", "b_o", "b_do", "b_stats", "b_dq_s", "b_dk_s", "b_dv_s", "b_o_s", "b_ds_s", "b_dp_s",
         "b_do_s", "b_ss", "b_sdq", "b_sdk", "b_sdv", "b_sdp", "b_dq", "b_dk", "b_dv", "b_aq", "b_ak", "b_av", "b_ap"),
        start=1)}

    def __init__(self, b, s, hq, hkv, d, scale, bwd: bool, fused: bool = True, device="cuda"):
        import cudnn

        self.c, self.shape, self.scale, self.device = cudnn, (b, s, hq, hkv, d), scale, torch.device(device)
        self.handle = cudnn.create_handle()
        try:  # O's amax only, as cudnn-frontend's sample; a cuDNN that wants S's amax declared too gets it
            self.fwd, self.amax_s = self._finish(self._fwd_graph(False)), False
        except Exception:
            self.fwd, self.amax_s = self._finish(self._fwd_graph(True)), True
        self.bwd = self._finish(self._bwd_graph()) if bwd else None
        self.ws = torch.empty(max(self._ws(self.fwd), self._ws(self.bwd) if bwd else 1), dtype=torch.uint8,
                              device=self.device)
        one = lambda x: torch.full((1, 1, 1, 1), x, device=self.device)
        self.ss, self.ds, self.g, self.dg = one(256.0), one(1 / 256.0), one(16.0), one(1 / 16.0)
        self.amax = {n: one(0.0) for n in ("amax_o", "amax_s", "b_aq", "b_ak", "b_av", "b_ap")}
        if fused:
            self.qkv = torch.compile(quantize_qkv, dynamic=False, fullgraph=True)
            self.q1 = torch.compile(quantize_one, dynamic=False, fullgraph=True)
            self.conv = torch.compile(to_bf16, dynamic=False, fullgraph=True)
        else:
            self.qkv, self.q1, self.conv = quantize_qkv, quantize_one, to_bf16
        self.fwd_plan = self.bwd_plan = None

    def _t(self, g, name, dims, strides, dt):
        return g.tensor(uid=self.UID[name], dim=dims, stride=strides, data_type=dt)

    def _bshd(self, g, name, h, dt):
        b, s, _, _, d = self.shape
        return self._t(g, name, (b, h, s, d), (s * h * d, d, h * d, 1), dt)

    def _one(self, g, name):
        return self._t(g, name, (1, 1, 1, 1), (1, 1, 1, 1), self.c.data_type.FLOAT)

    def _graph(self):
        c = self.c
        return c.pygraph(io_data_type=c.data_type.FP8_E4M3, intermediate_data_type=c.data_type.FLOAT,
                         compute_data_type=c.data_type.FLOAT)

    def _fwd_graph(self, amax_s: bool):
        c, (b, s, hq, hkv, d) = self.c, self.shape
        g, f8, f32 = self._graph(), c.data_type.FP8_E4M3, c.data_type.FLOAT
        o, stats, amax_s_t, amax_o = g.sdpa_fp8(
            q=self._bshd(g, "q", hq, f8), k=self._bshd(g, "k", hkv, f8), v=self._bshd(g, "v", hkv, f8),
            descale_q=self._one(g, "dq_s"), descale_k=self._one(g, "dk_s"), descale_v=self._one(g, "dv_s"),
            descale_s=self._one(g, "ds_s"), scale_s=self._one(g, "ss"), scale_o=self._one(g, "so"),
            generate_stats=True, attn_scale=self.scale, use_causal_mask=True)
        o.set_uid(self.UID["o"]).set_output(True).set_dim((b, hq, s, d)).set_stride((s * hq * d, d, hq * d, 1)) \
            .set_data_type(f8)
        stats.set_uid(self.UID["stats"]).set_output(True).set_dim((b, hq, s, 1)).set_stride((s * hq, s, 1, 1)) \
            .set_data_type(f32)
        for t, name in ((amax_o, "amax_o"), (amax_s_t, "amax_s"))[: 1 + amax_s]:
            t.set_uid(self.UID[name]).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
        return g

    def _bwd_graph(self):
        c, (b, s, hq, hkv, d) = self.c, self.shape
        g, f8, f32 = self._graph(), c.data_type.FP8_E4M3, c.data_type.FLOAT
        ones = {n: self._one(g, f"b_{n}") for n in ("dq_s", "dk_s", "dv_s", "o_s", "do_s", "ds_s", "dp_s", "ss",
                                                      "sdq", "sdk", "sdv", "sdp")}
        dq, dk, dv, aq, ak, av, ap = g.sdpa_fp8_backward(
            q=self._bshd(g, "b_q", hq, f8), k=self._bshd(g, "b_k", hkv, f8), v=self._bshd(g, "b_v", hkv, f8),
            o=self._bshd(g, "b_o", hq, f8), dO=self._bshd(g, "b_do", hq, f8),
            stats=self._t(g, "b_stats", (b, hq, s, 1), (s * hq, s, 1, 1), f32),
            descale_q=ones["dq_s"], descale_k=ones["dk_s"], descale_v=ones["dv_s"], descale_o=ones["o_s"],
            descale_dO=ones["do_s"], descale_s=ones["ds_s"], descale_dP=ones["dp_s"], scale_s=ones["ss"],
            scale_dQ=ones["sdq"], scale_dK=ones["sdk"], scale_dV=ones["sdv"], scale_dP=ones["sdp"],
            attn_scale=self.scale, use_causal_mask=True)
        for t, name, h in ((dq, "b_dq", hq), (dk, "b_dk", hkv), (dv, "b_dv", hkv)):
            t.set_uid(self.UID[name]).set_output(True).set_dim((b, h, s, d)).set_stride((s * h * d, d, h * d, 1)) \
                .set_data_type(f8)
        for t, name in ((aq, "b_aq"), (ak, "b_ak"), (av, "b_av"), (ap, "b_ap")):
            t.set_uid(self.UID[name]).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)) \
                .set_data_type(f32)
        return g

    def _finish(self, g):
        c = self.c
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([c.heur_mode.A, c.heur_mode.FALLBACK])
        g.check_support()
        try:  # every plan, for the autotune
            g.build_plans(c.build_plan_policy.ALL)
        except Exception:
            g.build_plans()
        return g

    def _ws(self, g):
        n = g.get_execution_plan_count() if hasattr(g, "get_execution_plan_count") else 0
        sizes = [g.get_workspace_size()]
        for i in range(n):
            try:
                sizes.append(g.get_workspace_size_plan_at_index(i))
            except Exception:
                pass
        return max(1, *sizes)

    def run(self, g, plan, pack):
        self.c.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        if plan is None:
            g.execute(pack, self.ws, handle=self.handle)
        else:
            g.execute_plan_at_index(pack, self.ws, plan, handle=self.handle)

    def autotune(self, q, k, v, do):
        """The fastest plan of each graph (5 timed calls each)."""
        if not hasattr(self.fwd, "execute_plan_at_index"):
            return
        fpack, (o, stats, ops) = self.fwd_pack(q, k, v)
        packs = [(self.fwd, fpack, "fwd_plan")]
        if self.bwd is not None:
            packs.append((self.bwd, self.bwd_pack(do, o, stats, ops)[0], "bwd_plan"))
        for g, pack, attr in packs:
            times = {}
            for i in range(g.get_execution_plan_count()):
                try:
                    self.run(g, i, pack)
                    torch.cuda.synchronize()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    for _ in range(5):
                        self.run(g, i, pack)
                    b.record()
                    b.synchronize()
                    times[i] = a.elapsed_time(b)
                except Exception:
                    continue
            setattr(self, attr, min(times, key=times.get) if times else None)

    def fwd_pack(self, q, k, v, ops=None):
        b, s, hq, hkv, d = self.shape
        ops = ops if ops is not None else self.qkv(q, k, v)
        q8, dq, k8, dk, v8, dv, so = ops
        o = torch.empty(b, s, hq, d, dtype=F8, device=self.device)
        stats = torch.empty(b, hq, s, 1, dtype=torch.float32, device=self.device)
        u = self.UID
        pack = {u["q"]: q8, u["k"]: k8, u["v"]: v8, u["dq_s"]: dq, u["dk_s"]: dk, u["dv_s"]: dv, u["ds_s"]: self.ds,
                u["ss"]: self.ss, u["so"]: so, u["o"]: o, u["stats"]: stats, u["amax_o"]: self.amax["amax_o"]}
        if self.amax_s:
            pack[u["amax_s"]] = self.amax["amax_s"]
        return pack, (o, stats, ops)

    def bwd_pack(self, do, o, stats, ops):
        b, s, hq, hkv, d = self.shape
        q8, dq_s, k8, dk_s, v8, dv_s, _ = ops
        do8, ddo = self.q1(do)
        dq = torch.empty(b, s, hq, d, dtype=F8, device=self.device)
        dk = torch.empty(b, s, hkv, d, dtype=F8, device=self.device)
        dv = torch.empty_like(dk)
        u = self.UID
        pack = {u["b_q"]: q8, u["b_k"]: k8, u["b_v"]: v8, u["b_o"]: o, u["b_do"]: do8, u["b_stats"]: stats,
                u["b_dq_s"]: dq_s, u["b_dk_s"]: dk_s, u["b_dv_s"]: dv_s, u["b_o_s"]: dv_s, u["b_do_s"]: ddo,
                u["b_ds_s"]: self.ds, u["b_dp_s"]: self.dg, u["b_ss"]: self.ss, u["b_sdq"]: self.g,
                u["b_sdk"]: self.g, u["b_sdv"]: self.g, u["b_sdp"]: self.g, u["b_dq"]: dq, u["b_dk"]: dk,
                u["b_dv"]: dv, **{u[n]: self.amax[n] for n in ("b_aq", "b_ak", "b_av", "b_ap")}}
        return pack, (dq, dk, dv)

    def forward(self, q, k, v, ops=None, convert=True):
        pack, (o, stats, ops) = self.fwd_pack(q, k, v, ops)
        self.run(self.fwd, self.fwd_plan, pack)
        return (self.conv(o, ops[5])[0] if convert else o), (o, stats, ops)

    def fwdbwd(self, q, k, v, do):
        out, (o, stats, ops) = self.forward(q, k, v)
        pack, (dq, dk, dv) = self.bwd_pack(do, o, stats, ops)
        self.run(self.bwd, self.bwd_plan, pack)
        return out, self.conv(dq, self.dg, dk, self.dg, dv, self.dg)


# ----------------------------------------------------------------------------- timing


def capture_check(fn) -> str:
    """Replay a CUDA graph of fn(0) and compare its output with an eager call's: 'ok', or what differs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(0)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = fn(0)
    if captured.dtype != F8:  # what the replay does not write stays NaN
        captured.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    want = fn(0)
    torch.cuda.synchronize()
    bits = lambda t: t.view(torch.uint8) if t.dtype == F8 else t
    if torch.equal(bits(captured), bits(want)):
        return "ok"
    diff = (captured.float() - want.float()).abs()
    return f"DIFFERS (max |diff| {float(diff.nan_to_num(float('inf')).max()):.3e})"


def time_workload(w: str, lengths, hc: dict, args) -> list[dict]:
    """The rows of one workload (see the module docstring)."""
    from flamia_cute import bench
    from flamia_cute.baselines.cudnn_fp8 import FUSION

    case = bench.Case(w, lengths, hc["heads_q"], hc["heads_kv"], hc["head_dim"], "cuda").build()
    b, s = len(lengths), lengths[0]
    sets = [tuple(t.view(b, s, *t.shape[1:]) for t in st) for st in case.sets]
    n = len(sets)
    try:
        direct = Direct(b, s, case.heads_q, case.heads_kv, case.head_dim, case.scale, args.bwd)
        direct.autotune(*sets[0])
    except Exception as e:  # reported; the next workload still runs
        print(f"{w}: the direct call does not build here: {type(e).__name__}: {e}"[:500])
        return []
    eager = copy.copy(direct)  # the same graphs and plans, the passes as plain torch ops
    eager.qkv, eager.q1, eager.conv = quantize_qkv, quantize_one, to_bf16
    fixed = [direct.qkv(*st[:3]) for st in sets]
    wrapper = bench.CudnnFp8()
    wrapper.prepare(case)
    calls = {
        "kernel": lambda i: direct.forward(*sets[i][:3], ops=fixed[i], convert=False)[0],
        "direct": lambda i: direct.forward(*sets[i][:3])[0],
        "direct_eager_quant": lambda i: eager.forward(*sets[i][:3])[0],
        "wrapper": lambda i: wrapper.run(case, *case.sets[i], "fwd")[0],
    }
    if args.bwd:
        calls["direct_fwdbwd"] = lambda i: direct.fwdbwd(*sets[i])[1][0]
        calls["wrapper_fwdbwd"] = lambda i: wrapper.run(case, *case.sets[i], "fwdbwd")[1]
    rows = []
    for name, fn in calls.items():
        try:
            fn(0)  # compiles, plans
        except Exception as e:
            print(f"  {w:8s} {name:20s} failed: {type(e).__name__}: {e}"[:500])
            continue
        row = {"workload": w, "variant": name, "ms": bench._time_calls(
            fn, n, "cuda", reps=args.reps, queue_lead_cycles=bench.GPU_TIME_LEAD_CYCLES)}
        if args.graph:
            try:  # a variant that cannot be captured keeps its eager time; the others still run
                row["graph_ms"] = bench._time_sustained(bench._graphed(fn, n, "cuda"), n, "cuda", 2.0, reps=args.reps)
                row["capture"] = capture_check(fn)
            except Exception as e:
                row["capture"] = f"failed: {type(e).__name__}: {e}"[:200]
                torch.cuda.synchronize()
        rows.append(row)
        graph = f"  graph {row['graph_ms']:8.3f} ms" if "graph_ms" in row else ""
        print(f"  {w:8s} {name:20s} {row['ms']:8.3f} ms" + (f"{graph}, capture {row['capture']}" if args.graph else ""))
    by = {r["variant"]: r for r in rows}
    for a, d in (("wrapper", "direct"), ("wrapper_fwdbwd", "direct_fwdbwd")):
        if a in by and d in by:
            by[a]["vs_direct"] = ratio = by[a]["ms"] / by[d]["ms"]
            print(f"  {w}: {a} / {d} = {ratio:.3f} ({'within' if ratio <= 1.05 else 'NOT within'} 5%)")
    print(f"  {w}: plans fwd {direct.fwd_plan} bwd {direct.bwd_plan} of {direct.fwd.get_execution_plan_count()} "
          f"(fwd, S's amax declared: {direct.amax_s}); the wrapper's passes: {FUSION['mode']} {FUSION['why']}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="1x16k", help="workloads of flamia_cute/workloads.json (equal-length only)")
    ap.add_argument("--heads", default="h16_d128")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--bwd", action="store_true", help="also forward+backward")
    ap.add_argument("--graph", action="store_true", help="also CUDA-graph replays (2 s sustained) and a capture check")
    ap.add_argument("--out", default=os.environ.get("OUT", "perf/results/cudnn_direct"), help="output folder")
    args = ap.parse_args(argv)
    from flamia_cute import bench

    if not torch.cuda.is_available():
        print("cudnn_direct: needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        import cudnn
    except Exception as e:
        print(f"cudnn_direct: cudnn-frontend not importable ({type(e).__name__}: {e}); nothing to time", file=sys.stderr)
        return 2
    data = json.loads(pathlib.Path(bench.DEFAULT_WORKLOADS).read_text())
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"cudnn_direct: cudnn-frontend {getattr(cudnn, '__version__', '?')}, cuDNN {cudnn.backend_version()}, "
          f"{torch.cuda.get_device_name()}, heads {args.heads}; GPU time (bench --gpu-time), medians of {args.reps}")
    rows = []
    for w in args.only.split(","):
        lengths = data["workloads"][w]
        if len(set(lengths)) != 1:
            print(f"{w}: skipped (cuDNN's FP8 backward takes equal-length batches only)")
            continue
        rows += time_workload(w, lengths, data["head_configs"][args.heads], args)
        write_csv(out_dir / "cudnn_direct.csv", rows)  # after each workload: a run stopped by a time limit keeps its rows
    if not rows:
        print("cudnn_direct: no variant ran", file=sys.stderr)
        return 1
    print(f"wrote {out_dir / 'cudnn_direct.csv'}")
    return 0


def write_csv(path, rows) -> None:
    fields = ("workload", "variant", "ms", "vs_direct", "graph_ms", "capture")
    with open(path, "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        wr.writeheader()
        wr.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
