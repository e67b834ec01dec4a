"""`flamia-cute bench`: ours against every importable baseline, side by side in one process.

Forward, backward and forward+backward (ours including quantization), medians
of CUDA-event timings after warm-up, rotating input sets so L2 does not flatter
anyone, never zeros. Error of O and dQ against an fp32 reference on a causal
prefix of the first document (a prefix is exact: queries < n see only keys < n).
--layer adds the "+rope" columns: RoPE then attention, forward and backward, ours with the RoPE
fused into the quantization, FA4 after a separate RoPE kernel (RopeBaseline); their errors against
RoPE + attention in fp32, and ratios pair "+rope" columns only.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch

from .schedules import causal_flops
from .testing import cu_seqlens_from_lengths, rel_l2

DEFAULT_WORKLOADS = pathlib.Path(__file__).resolve().parent / "workloads.json"  # shipped with the package
MODES = ("fwd", "bwd", "fwdbwd")
L2_BYTES = 50 * 2**20


@dataclasses.dataclass
class Case:
    """One workload at one head config: packed inputs, rotated between timed calls."""

    workload: str
    lengths: list[int]
    heads_q: int
    heads_kv: int
    head_dim: int
    device: str
    sets: list = dataclasses.field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def build(self, seed: int = 0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        per_set = self.total * (2 * self.heads_q + 2 * self.heads_kv) * self.head_dim * 2
        n_sets = max(2, min(8, math.ceil(4 * L2_BYTES / max(per_set, 1))))
        self.cu = cu_seqlens_from_lengths(self.lengths, self.device)
        self.max_len = max(self.lengths)
        for _ in range(n_sets):
            mk = lambda h: torch.randn(self.total, h, self.head_dim, generator=g).to(self.device, torch.bfloat16)
            self.sets.append((mk(self.heads_q), mk(self.heads_kv), mk(self.heads_kv), mk(self.heads_q)))
        return self


class Impl:
    """An attention implementation: forward(q, k, v) -> out, differentiable through autograd."""

    name = "?"

    def available(self, case: Case) -> str | None:
        """None if it can run this case, else why not."""
        return None

    def prepare(self, case: Case):
        pass

    def forward(self, case: Case, q, k, v):
        raise NotImplementedError


# --layer: RoPE (theta 10000, half-split, the whole head dim) on Q and K, then attention; "+rope" columns
LAYER_THETA = 10000.0
LAYER_SUFFIX = "+rope"


class Ours(Impl):
    def __init__(self, recipe: str, backend: str, layer: bool = False):
        self.recipe, self.backend, self.layer = recipe, backend, layer
        self.name = f"flamia_{recipe}" + ("" if backend == "cute" else f"[{backend}]") + (LAYER_SUFFIX if layer else "")
        self.rotary = None

    def prepare(self, case):
        if self.layer:  # the tables a model builds once: the call rotates Q and K in its quantization
            from .rotary import RotaryConfig

            self.rotary = RotaryConfig(theta=LAYER_THETA).tables(case.max_len, case.head_dim, case.device)

    def available(self, case):
        from .interface import pick_backend
        from .plan import SM100_RECIPES, kernel_scaling
        from .recipes import resolve_recipe

        try:
            chosen = pick_backend(self.backend, torch.device(case.device))
        except NotImplementedError as e:
            return str(e)
        if (chosen == "cute" and kernel_scaling(resolve_recipe(self.recipe)) is None
                or chosen == "sm100" and self.recipe not in SM100_RECIPES):
            return f"recipe {self.recipe!r} has no kernel on this GPU"
        return None

    def forward(self, case, q, k, v):
        from .interface import flamia_attn_varlen_func

        return flamia_attn_varlen_func(q, k, v, case.cu, case.cu, case.max_len, case.max_len, case.scale,
                                       recipe=self.recipe, backend=self.backend, rotary=self.rotary)


class FA4(Impl):
    name = "fa4_bf16"

    def __init__(self, layer: bool = False):
        self.layer = layer
        self.rope = None
        if layer:
            self.name = FA4.name + LAYER_SUFFIX

    def available(self, case):
        from .baselines.torch_impls import fa4_available

        return None if fa4_available() else "flash_attn.cute not importable or no GPU"

    def prepare(self, case):
        if self.layer:  # RoPE as an FA4 user runs it: a separate (best available) kernel on Q and K
            from .baselines.torch_impls import RopeBaseline
            from .rotary import RotaryConfig

            rot = RotaryConfig(theta=LAYER_THETA).tables(case.max_len, case.head_dim, case.device)
            self.rope = RopeBaseline(rot.cos, rot.sin, case.cu, case.total)
            print(f"{self.name}: RoPE by {self.rope.kind} on {case.workload}", file=sys.stderr)  # which kernel ran

    def forward(self, case, q, k, v):
        from .baselines.torch_impls import fa4_varlen

        if self.rope is not None:
            q, k = self.rope(q, case.max_len), self.rope(k, case.max_len)
        return fa4_varlen(q, k, v, case.cu, case.max_len, case.scale)


class Flex(Impl):
    name = "flex_docmask"

    def available(self, case):
        from .baselines.torch_impls import flex_available

        return None if flex_available() else "flex_attention needs a GPU here"

    def prepare(self, case):
        from .baselines.torch_impls import FlexDocumentAttention

        self.fn = FlexDocumentAttention(case.cu, case.total, case.heads_q != case.heads_kv)

    def forward(self, case, q, k, v):
        return self.fn(q, k, v, case.scale)


class SDPA(Impl):
    name = "sdpa_per_doc"

    def available(self, case):
        return None if len(case.lengths) <= 64 else "more than 64 documents: one launch each"

    def prepare(self, case):
        self.cu_list = case.cu.tolist()

    def forward(self, case, q, k, v):
        from .baselines.torch_impls import sdpa_per_document

        return sdpa_per_document(q, k, v, self.cu_list, case.scale)


class CudnnFp8(Impl):
    """Not autograd: forward and backward are separate graph calls."""

    name = "cudnn_fp8"

    def available(self, case):
        if not torch.cuda.is_available():
            return "no GPU"
        if len(set(case.lengths)) != 1:
            return "equal-length documents only (its Hopper backward rejects packed layouts)"
        try:
            import cudnn  # noqa: F401
        except Exception:
            return "cudnn-frontend not importable"
        return None

    def prepare(self, case):
        from .baselines.cudnn_fp8 import CudnnFp8Attention

        self.b, self.s = len(case.lengths), case.lengths[0]
        self.att = CudnnFp8Attention(self.b, case.heads_q, case.heads_kv, self.s, case.head_dim, case.scale)

    def _bshd(self, t):
        return t.view(self.b, self.s, *t.shape[1:])

    def run(self, case, q, k, v, do, mode):
        # O (and the gradients) in bf16, as their consumers take them
        out, saved = self.att.forward_bf16(self._bshd(q), self._bshd(k), self._bshd(v))
        if mode == "fwd":
            return out.view(q.shape), None
        dq, dk, dv = self.att.backward(self._bshd(do), *saved)
        return out.view(q.shape), dq.view(q.shape)


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time_calls(fn, n_sets, device, warmup=3, reps=15, queue_lead_cycles=0):
    """Median ms of fn(i) over rotating sets i; CUDA events on GPU, perf_counter on CPU.

    queue_lead_cycles > 0: a GPU sleep of that many cycles is queued before the start event, so
    the host has enqueued the whole call before the GPU reaches it and the events see GPU time
    only (kernel timing for the tuner); 0 times the call as an eager caller with an idle GPU
    sees it, host launch overhead included.
    """
    for i in range(warmup):
        fn(i % n_sets)
    _sync(device)
    times = []
    for r in range(reps):
        i = r % n_sets
        if device.startswith("cuda"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if queue_lead_cycles:
                torch.cuda._sleep(queue_lead_cycles)
            a.record()
            fn(i)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn(i)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _time_sustained(fn, n_sets, device, seconds: float, reps=15, window_ms: float = 20.0):
    """Median ms per call of back-to-back calls, after `seconds` of them: the GPU at the clock it holds
    under sustained load, as a training loop runs it (the H200 at its 700 W cap: ~1.75 GHz for our
    training call, ~1.62 GHz for FA4's; docs/power.md), where single calls after idle run at higher
    clocks. Timed in `reps` windows of about window_ms of calls each (CUDA events around a window;
    no sync inside one, so host time is hidden as far as the GPU work per call covers it)."""
    t0 = time.perf_counter()
    calls = 0
    while calls < 2 or time.perf_counter() - t0 < seconds:
        fn(calls % n_sets)
        calls += 1
        if calls % 8 == 0:
            _sync(device)  # keep the host within a few calls of the GPU
    _sync(device)
    per = max(1, round(window_ms / max((time.perf_counter() - t0) * 1e3 / calls, 1e-3)))
    times = []
    for r in range(reps):
        if device.startswith("cuda"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for j in range(per):
                fn((r * per + j) % n_sets)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / per)
        else:
            t = time.perf_counter()
            for j in range(per):
                fn((r * per + j) % n_sets)
            times.append((time.perf_counter() - t) * 1e3 / per)
    return statistics.median(times)


def _graphed(fn, n_sets, device):
    """replay(i): fn(i) for each input set captured once into a CUDA graph. A replay costs a few µs of
    host time whatever the call launches, so back-to-back replays time the GPU work alone, at the
    clock sustained load holds, also for calls whose host time exceeds their GPU time (ours and
    FA4's training calls on 16x1k). The calls must not synchronize (the capture fails)."""
    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph asks
        for i in range(n_sets):
            fn(i)
    main.wait_stream(side)
    torch.cuda.synchronize(device)
    graphs = []
    for i in range(n_sets):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(i)
        graphs.append(g)
    return lambda i: graphs[i].replay()


def _prefix_reference(case: Case, q, k, v, do, prefix: int, layer: bool = False):
    """fp32 O and dQ of the first `prefix` tokens of the longest document, heads 0..1: a pack whose first
    document is a token or two has a reference dQ of ~0, against which a relative error means nothing.
    layer: of RoPE + attention (the prefix starts its document: positions 0 ..)."""
    from .reference import reference_attention, reference_attention_rotary

    group = case.heads_q // case.heads_kv
    hq = min(2, case.heads_q)
    hk = max(1, hq // group)
    d = max(range(len(case.lengths)), key=lambda i: case.lengths[i])
    start = sum(case.lengths[:d])
    sl = slice(start, start + prefix)
    cu = torch.tensor([0, prefix], dtype=torch.int32, device=q.device)
    if layer:
        from .rotary import RotaryConfig

        rot = RotaryConfig(theta=LAYER_THETA).tables(prefix, case.head_dim, q.device)
        ref = reference_attention_rotary(q[sl, :hq], k[sl, :hk], v[sl, :hk], cu, case.scale, rot, do[sl, :hq],
                                         dtype=torch.float32)
    else:
        ref = reference_attention(q[sl, :hq], k[sl, :hk], v[sl, :hk], cu, cu, case.scale, True, do[sl, :hq],
                                  dtype=torch.float32)
    return ref["out"], ref["dq"], (sl, slice(0, hq))


def _error(x, ref) -> float:
    """Relative L2 error against the reference; the RMS absolute error where the reference is ~0 (its
    RMS under 1e-6), where a relative error would divide by nothing."""
    ref64 = ref.detach().double()
    rms = float(ref64.pow(2).mean().sqrt()) if ref64.numel() else 0.0
    if rms < 1e-6:
        return float((x.detach().double() - ref64).pow(2).mean().sqrt()) if ref64.numel() else 0.0
    return rel_l2(x, ref)


# --gpu-time: a GPU sleep longer than any call's host time is queued before each timed call
GPU_TIME_LEAD_CYCLES = 8_000_000


def bench_case(case: Case, impl: Impl, modes, reps: int, queue_lead_cycles: int = 0,
               sustain_s: float = 0.0, graph: bool = False) -> list[dict]:
    """sustain_s > 0: each mode timed by _time_sustained after that many seconds of its calls; graph:
    of CUDA graph replays of them (_graphed; with sustain_s only)."""
    why = impl.available(case)
    if why:
        return [{"impl": impl.name, "mode": m, "skipped": why} for m in modes]
    impl.prepare(case)
    n = len(case.sets)
    dev = case.device
    rows = []
    prefix = min(max(case.lengths), 2048)
    q0, k0, v0, do0 = case.sets[0]
    ref_o, ref_dq, (sl, hs) = _prefix_reference(case, q0, k0, v0, do0, prefix, getattr(impl, "layer", False))
    if isinstance(impl, CudnnFp8):
        def run(i, mode):
            q, k, v, do = case.sets[i]
            return impl.run(case, q, k, v, do, mode)
        o, dq = run(0, "fwdbwd")
        err_o, err_dq = _error(o[sl, hs], ref_o), _error(dq[sl, hs], ref_dq)
        fwd_ms = _timer(lambda i: run(i, "fwd"), n, dev, reps, queue_lead_cycles, sustain_s, graph)
        fb_ms = _timer(lambda i: run(i, "fwdbwd"), n, dev, reps, queue_lead_cycles, sustain_s, graph)
        times = {"fwd": fwd_ms, "fwdbwd": fb_ms, "bwd": fb_ms - fwd_ms}
        peak = _peak_mb(lambda: run(0, "fwdbwd"), dev)
    else:
        grads = any(m != "fwd" for m in modes)
        leaves = input_leaves(case, grads)
        # the error check on leaves of its own, dropped before timing: an autograd graph kept alive from
        # the default stream breaks a CUDA graph capture of the same leaves' backward (graph mode)
        q, k, v = (t.detach().clone().requires_grad_(grads) for t in leaves[0][:3])
        out = impl.forward(case, q, k, v)
        err_o, err_dq = _error(out[sl, hs], ref_o), float("nan")
        if grads:
            (dq,) = torch.autograd.grad(out, (q,), leaves[0][3])
            err_dq = _error(dq[sl, hs], ref_dq)
        del q, k, v, out
        graphs = [impl.forward(case, *s[:3]) for s in leaves] if "bwd" in modes else []
        calls = timed_calls(case, impl, leaves, graphs)
        times = {m: _timer(calls[m], n, dev, reps, queue_lead_cycles, sustain_s, graph) for m in modes}
        del graphs
        peak = _peak_mb(lambda: calls["fwdbwd" if grads else "fwd"](0), dev)
    flops = causal_flops(case.lengths, case.heads_q, case.head_dim)
    flops_b = causal_flops(case.lengths, case.heads_q, case.head_dim, backward=True)
    per_mode = {"fwd": flops, "bwd": flops_b, "fwdbwd": flops + flops_b}
    for m in modes:
        rows.append({"impl": impl.name, "mode": m, "ms": round(times[m], 4),
                     "tflops": round(per_mode[m] / (times[m] * 1e9), 1), "err_o": err_o, "err_dq": err_dq,
                     "peak_mem_mb": peak})
    return rows


def input_leaves(case: Case, grads: bool) -> list[tuple]:
    """Per input set, (q, k, v, dO) cloned off the case's tensors; q, k, v require grad when `grads`."""
    return [tuple(t.detach().clone().requires_grad_(grads and j < 3) for j, t in enumerate(s)) for s in case.sets]


def timed_calls(case: Case, impl: Impl, leaves, graphs=()) -> dict:
    """The calls the bench times, each over input set i of `leaves` (input_leaves): fwd (under
    no_grad), bwd (the backward of graphs[i], a forward output kept alive), fwdbwd (the training call)."""

    def fwd(i):
        with torch.no_grad():
            impl.forward(case, *leaves[i][:3])

    def bwd(i):
        torch.autograd.grad(graphs[i], leaves[i][:3], leaves[i][3], retain_graph=True)

    def fwdbwd(i):
        o = impl.forward(case, *leaves[i][:3])
        torch.autograd.grad(o, leaves[i][:3], leaves[i][3])

    return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwdbwd}


def _timer(fn, n_sets, device, reps, queue_lead_cycles, sustain_s, graph=False):
    if sustain_s > 0:
        return _time_sustained(_graphed(fn, n_sets, device) if graph else fn, n_sets, device, sustain_s, reps=reps)
    return _time_calls(fn, n_sets, device, reps=reps, queue_lead_cycles=queue_lead_cycles)


def _peak_mb(fn, dev):
    if not dev.startswith("cuda"):
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)


def default_impls(recipe: str, device: str, layer: bool = False) -> list[Impl]:
    """Ours for each recipe of the comma-separated `recipe`, then every baseline; layer: also ours with
    the fused RoPE and FA4 after a RoPE kernel (the "+rope" columns), timed in the same run."""
    backend = "cute" if device.startswith("cuda") else "emulate"
    impls = [Ours(r, backend) for r in recipe.split(",")] + [FA4(), CudnnFp8(), Flex(), SDPA()]
    if layer:
        impls += [Ours(r, backend, layer=True) for r in recipe.split(",")] + [FA4(layer=True)]
    return impls


def _progress(items):
    try:
        from tqdm import tqdm

        return tqdm(items, file=sys.stderr)
    except ImportError:
        total = len(items)
        return (print(f"[{i + 1}/{total}] {it[0]} {getattr(it[1], 'name', '')}", file=sys.stderr) or it
                for i, it in enumerate(items))


def environment() -> dict:
    env = {"timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "torch": torch.__version__}
    env["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    try:
        # FLAMIA_COMMIT first (perf/gpu_session.sh's: the device tool's copy of a checkout keeps an older HEAD
        # under newer files); "-dirty" when the tracked files differ from the commit; source_hash tells builds apart
        env["commit"] = os.environ.get("FLAMIA_COMMIT") or subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True, text=True,
            cwd=pathlib.Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        env["commit"] = "unknown"
    from .compile_cache import dsl_cuda_version, package_source_hash

    env["source_hash"] = package_source_hash()
    try:  # ptxas differs between the DSL's CUDA 12 and 13 libraries, and so does the SASS
        env["dsl_cuda"] = dsl_cuda_version()
    except Exception:
        env["dsl_cuda"] = None
    for mod in ("cutlass", "flash_attn", "cudnn"):
        try:
            m = __import__(mod)
            env[mod] = getattr(m, "__version__", "?")
        except Exception:
            env[mod] = None
    cudnn_baseline = sys.modules.get("flamia_cute.baselines.cudnn_fp8")
    if cudnn_baseline is not None and cudnn_baseline.FUSION["mode"]:  # how its per-call passes ran
        env["cudnn_passes"] = cudnn_baseline.FUSION["mode"]
    return env


def bench_order(workloads: list, impls: list) -> list:
    """(workload, implementation) pairs: workloads in order, the implementations rotated by one more
    for each workload."""
    n = max(1, len(impls))
    return [(w, impl) for i, w in enumerate(workloads) for impl in impls[i % n:] + impls[:i % n]]


def run_bench(workloads: dict, head_cfg: dict, impls, modes=MODES, reps=15, device="cuda",
              gpu_time: bool = False, sustain_s: float = 0.0, graph: bool = False, on_rows=None) -> list[dict]:
    """gpu_time: time GPU work only (the host enqueues each call behind a GPU sleep), as a training
    step whose host runs ahead sees it; default: each call from an idle GPU, host time included;
    sustain_s > 0: back-to-back calls after that many seconds of them (_time_sustained; overrides);
    graph: CUDA graph replays of the calls, with sustain_s (_graphed: GPU time at the sustained clock).
    The implementations' order rotates by workload, so none is always timed first (on the GPU that
    just idled through the workload's setup: a build timed first can run up to 9% faster).
    on_rows(rows): called with the rows so far after each (workload, implementation)."""
    lead = GPU_TIME_LEAD_CYCLES if gpu_time and device.startswith("cuda") else 0
    rows = []
    items = bench_order(list(workloads), list(impls))
    cases = {}
    for w, impl in _progress(items):
        if w not in cases:
            cases[w] = Case(w, workloads[w], head_cfg["heads_q"], head_cfg["heads_kv"], head_cfg["head_dim"],
                            device).build()
        try:
            got = bench_case(cases[w], impl, modes, reps, lead, sustain_s, graph)
        except Exception as e:  # a baseline that breaks is reported, not fatal
            got = [{"impl": impl.name, "mode": m, "skipped": f"error: {type(e).__name__}: {e}"[:300]} for m in modes]
        for r in got:
            rows.append({"workload": w, **r})
        if on_rows is not None:
            on_rows(rows)
    return rows


def summarize(rows, env, csv_path=None, png_path=None):
    import pandas as pd

    df = pd.DataFrame(rows)
    for k, v in env.items():
        df[k] = v
    if csv_path:
        df.to_csv(csv_path, index=False)
    ok = df[df.get("ms").notna()] if "ms" in df else df.iloc[0:0]
    if len(ok):
        table = ok.pivot_table(index=["workload", "mode"], columns="impl", values="ms")
        print(table.round(3).to_string())
        ratios = speedups(table)
        if len(ratios):
            print("\nspeedup of ours over each baseline (baseline ms / ours ms): geomean and minimum over the"
                  " workloads both ran")
            print(ratios.to_string(float_format=lambda x: f"{x:.3f}"))
        errs = ok.groupby("impl")[["err_o", "err_dq"]].max()
        print("\nrelative L2 error vs fp32 (max over workloads):")
        print(errs.to_string(float_format=lambda x: f"{x:.2e}"))
        if png_path:
            _plot(table, png_path)
    if "skipped" in df:
        for (impl, why), _ in df[df["skipped"].notna()].groupby(["impl", "skipped"]):
            print(f"skipped {impl}: {why}")
    return df


def speedups(table):
    """Per (ours, baseline, mode): the geometric mean and the minimum over workloads of baseline ms /
    ours ms (the issues' bars), with the workload count; `table` is summarize's (workload, mode) x impl
    pivot of ms. Ours are the flamia* columns; only workloads that both timed count."""
    import numpy as np
    import pandas as pd

    ours = [c for c in table.columns if c.startswith("flamia")]
    base = [c for c in table.columns if not c.startswith("flamia")]
    out = []
    for o in ours:
        for b in base:
            if o.endswith(LAYER_SUFFIX) != b.endswith(LAYER_SUFFIX):  # layers against layers only
                continue
            for mode, sub in table.groupby(level="mode"):
                r = (sub[b] / sub[o]).dropna()
                if len(r):
                    out.append({"ours": o, "baseline": b, "mode": mode, "geomean": float(np.exp(np.log(r).mean())),
                                "min": float(r.min()), "workloads": len(r)})
    return pd.DataFrame(out).set_index(["ours", "baseline", "mode"]) if out else pd.DataFrame()


def _plot(table, png_path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written", file=sys.stderr)
        return
    ours = [c for c in table.columns if c.startswith("flamia")]
    base = [c for c in table.columns if not c.startswith("flamia")]
    if not ours or not base:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    best = table[base].min(axis=1)
    for c in ours:
        (best / table[c]).plot.bar(ax=ax, alpha=0.8, label=c)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("speedup over the fastest baseline")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


EMULATOR_MAX_TOKENS = 4096  # the largest pack bench runs on the emulator (no GPU)


def main_bench(args) -> int:
    data = json.loads(pathlib.Path(args.workloads).read_text())
    wl = data["workloads"]
    if args.only:
        missing = [w for w in args.only.split(",") if w not in wl]
        if missing:
            print(f"--only: unknown workloads {missing}; known: {sorted(wl)}", file=sys.stderr)
            return 2
        wl = {w: wl[w] for w in args.only.split(",")}
    head_cfg = data.get("head_configs", {}).get(args.heads)
    if head_cfg is None:
        print(f"--heads: unknown head config {args.heads!r}; known: {sorted(data.get('head_configs', {}))}",
              file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not device.startswith("cuda"):
        # the emulator builds each document's (heads, L, L) score matrices: a 16k-token document takes tens of
        # GB, and a pack of 16k tokens minutes per call
        big = sorted(w for w, ls in wl.items() if sum(ls) > EMULATOR_MAX_TOKENS)
        if big:
            print(f"bench: no CUDA device, so the emulator runs; skipping {big} (packs over {EMULATOR_MAX_TOKENS} "
                  "tokens would exhaust memory or time). Emulator times say nothing of the kernels' speed.",
                  file=sys.stderr)
            wl = {w: ls for w, ls in wl.items() if w not in big}
        if not wl:
            print("bench: nothing left to run on the CPU; pass small packs with --workloads (see "
                  "perf/workloads_short.json's format)", file=sys.stderr)
            return 2
    impls = default_impls(args.recipe, device, getattr(args, "layer", False))
    if args.impls:
        impls = [i for i in impls if any(i.name.startswith(p) for p in args.impls.split(","))]
    if args.sustain < 0:
        print(f"--sustain must be >= 0 seconds, got {args.sustain}", file=sys.stderr)
        return 2
    if args.graph and not (args.sustain > 0 and device.startswith("cuda")):
        print(f"--graph needs --sustain > 0 on a CUDA device (got --sustain {args.sustain:g} on {device})",
              file=sys.stderr)
        return 2
    if args.graph and "bwd" in args.modes.split(","):
        # bwd replays a forward graph kept from before the capture (see bench_case): time fwd and fwdbwd
        print("--graph times --modes fwd and fwdbwd only (bwd needs a forward kept from outside the capture)",
              file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_{args.heads}"
    timing = ("wall_cpu" if not device.startswith("cuda")
              else f"sustained_{args.sustain:g}s" + ("_cuda_graph" if args.graph else "") if args.sustain
              else "gpu_time" if args.gpu_time else "call_from_idle_gpu")
    run_meta = {"heads": args.heads, "timing": timing}
    env = environment() | run_meta
    partial = out / f"{stem}.partial.csv"  # the rows so far: a run stopped by a time limit keeps them
    import pandas as pd

    def write_partial(rows):  # through a temporary file: a signal mid-write leaves the last whole file
        tmp = partial.with_suffix(".tmp")
        pd.DataFrame(rows).assign(**env).to_csv(tmp, index=False)
        os.replace(tmp, partial)

    rows = run_bench(wl, head_cfg, impls, tuple(args.modes.split(",")), args.reps, device, args.gpu_time,
                     args.sustain, args.graph, on_rows=write_partial)
    # the environment again: the run's end, and what the run set (the cuDNN baseline's passes)
    summarize(rows, environment() | run_meta, out / f"{stem}.csv", out / f"{stem}.png")
    partial.unlink(missing_ok=True)
    print(f"\nwrote {out / (stem + '.csv')}")
    return 0
