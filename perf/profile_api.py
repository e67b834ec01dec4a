"""Host time of the training call (where the launch overhead goes), ours against FA4.

    python perf/profile_api.py [workloads,...] [profile] [stages] [nomemo]

For each workload and implementation (the bench's own Case, Impl and call closures): host ms per
call with the GPU held busy by a queued sleep (so no call waits on the GPU unless it synchronizes),
and the synchronizing CUDA calls one call makes (torch.cuda.set_sync_debug_mode). A host time above
the call's GPU time is what back-to-back timing (`bench --sustain`) and an eager training loop see.
`profile`: a cProfile of our training call on the first workload; `stages`: every function in STAGES
wrapped by a perf_counter_ns timer (host µs per call, inclusive), to attribute the host time;
`nomemo`: the plan memo bypassed (tuned.derived_memo returns a fresh dict: every call builds its Plan,
make_plan, again: the memo's A/B).
"""

import cProfile
import importlib
import io
import json
import pstats
import sys
import time
import warnings

import torch

from flamia_cute.bench import DEFAULT_WORKLOADS, FA4, Case, Ours, input_leaves, timed_calls

# module -> functions whose host time is reported (inclusive). Each is replaced on its module, so it is
# timed where callers look it up there at call time (module globals, or imports inside a function);
# a name imported at module level elsewhere is listed under the module that calls it.
STAGES = {
    "flamia_cute.interface": ["check_attention_inputs", "choose_backend"],
    "flamia_cute.custom_ops": ["run_forward", "run_backward", "_pack_kernel", "_unpack_kernel"],
    "flamia_cute.validation": ["check_cu_seqlens_values"],
    "flamia_cute.plan": ["make_plan"],
    "flamia_cute.cute_backend": ["forward", "backward", "quantize_operands"],
    "flamia_cute.sm90.quantize": ["fused_quantize_multi_sm90", "_alloc_outputs", "launch_fused_quantize_multi_sm90",
                                  "_launch", "quantize_with_rowdot_sm90", "quantized_outputs"],
    "flamia_cute.sm90.attention_fwd": ["flamia_fwd_sm90", "get_launcher", "check_kernel_tensors", "launch_on_device",
                                       "sm_count"],
    "flamia_cute.sm90.bwd_preprocess": ["preprocess_bwd", "backward_outputs", "backward_grid_blocks"],
    "flamia_cute.sm90.codes": ["e4m3_codes_to_bf16"],
    "flamia_cute.sm90.attention_bwd": ["flamia_bwd_dsbf16_sm90_from_saved", "flamia_bwd_dsbf16_sm90",
                                       "get_launcher", "side_stream", "check_kernel_tensors",
                                       "launch_on_device", "dv_fold_reference"],
    "flamia_cute.tuned": ["_tuned_config", "derived_memo"],
    "flamia_cute.compile_cache": ["compile_launcher"],
}
BUSY_CYCLES = 400_000_000  # ~0.2 s of GPU sleep: longer than any timed batch of host calls



def host_ms(call, n_sets, n=20):
    """Median host ms per call over n calls enqueued behind a GPU sleep (none waits on the GPU)."""
    for i in range(3):
        call(i % n_sets)
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        call(i % n_sets)
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2]


def sync_sites(call):
    """Where one call synchronizes with the GPU: (file:line, message) of each sync-debug warning."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            call(0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return [f"{w.filename}:{w.lineno} {str(w.message)[:80]}" for w in got if "synchroniz" in str(w.message)]


def stage_times(call, n=50):
    """Mean host µs per call of each STAGES function (inclusive), over n calls."""
    totals, counts, saved = {}, {}, []
    for mod_name, names in STAGES.items():
        mod = importlib.import_module(mod_name)
        for name in names:
            fn = getattr(mod, name, None)
            if fn is None:
                print(f"  (no {mod_name}.{name})")
                continue
            key = f"{mod_name.rsplit('.', 1)[-1]}.{name}"

            def wrapped(*a, _fn=fn, _key=key, **kw):
                t0 = time.perf_counter_ns()
                try:
                    return _fn(*a, **kw)
                finally:
                    totals[_key] = totals.get(_key, 0) + time.perf_counter_ns() - t0
                    counts[_key] = counts.get(_key, 0) + 1

            saved.append((mod, name, fn))
            setattr(mod, name, wrapped)
    try:
        torch.cuda.synchronize()
        torch.cuda._sleep(BUSY_CYCLES)
        t0 = time.perf_counter_ns()
        for i in range(n):
            call(i % 2)
        whole = (time.perf_counter_ns() - t0) / n / 1e3
        torch.cuda.synchronize()
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
    print(f"stages (host µs per call, inclusive; whole call {whole:.1f} µs with the timers on):")
    for key in sorted(totals, key=lambda k: -totals[k]):
        print(f"  {key:55s} {totals[key] / n / 1e3:8.1f} µs  ({counts[key] / n:.1f} calls)")


def main():
    names = (sys.argv[1] if len(sys.argv) > 1 else "16x1k").split(",")
    extra = sys.argv[2:]
    if "nomemo" in extra:
        import flamia_cute.tuned as tuned

        tuned.derived_memo = lambda: {}
    workloads = json.loads(DEFAULT_WORKLOADS.read_text())["workloads"]
    impls = [Ours("fp8_tokenblock_dsbf16", "cute"), FA4()]
    print(f"{'workload':12s} {'impl':30s} {'mode':7s} {'host ms':>8s}  syncs")
    first = None
    for name in names:
        case = Case(name, workloads[name], 16, 16, 128, "cuda").build()
        for impl in impls:
            impl.prepare(case)
            calls = timed_calls(case, impl, input_leaves(case, grads=True))
            for mode in ("fwd", "fwdbwd"):
                call = calls[mode]
                ms = host_ms(call, len(case.sets))
                sites = sync_sites(call)
                print(f"{name:12s} {impl.name:30s} {mode:7s} {ms:8.3f}  {len(sites)} {'; '.join(sites)[:300]}")
                if first is None and isinstance(impl, Ours) and mode == "fwdbwd":
                    first = (case, call)
        sys.stdout.flush()
    case, call = first
    if "profile" in extra:
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        torch.cuda._sleep(BUSY_CYCLES)
        prof.enable()
        for i in range(20):
            call(i % len(case.sets))
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(35)
        print(s.getvalue()[:9000])
    if "stages" in extra:
        stage_times(lambda i: call(i % len(case.sets)))


if __name__ == "__main__":
    main()
