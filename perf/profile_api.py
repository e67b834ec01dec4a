"""Host-side profile of one flamia_attn_varlen_func call (where the launch overhead goes).

    python perf/profile_api.py [workload] [fwd|bwd] [stages]   # bwd: one autograd backward of a kept graph

After the cProfile table, `stages` times the library's own steps (host time, no sync, inclusive
of what they call): every function in STAGES is wrapped by a perf_counter_ns timer, so the gap
between the API call and its GPU time can be attributed step by step.
"""

import cProfile
import io
import json
import pstats
import sys
import time

import torch

from flamia_cute import flamia_attn_varlen_func
from flamia_cute.bench import DEFAULT_WORKLOADS, Case

STAGES = {  # module -> functions whose host time is reported (inclusive)
    "flamia_cute.interface": ["check_attention_inputs", "pick_backend"],
    "flamia_cute.cute_backend": ["forward_kernels", "quantize_operands", "backward_kernels", "backward_config",
                                 "backward_backend", "deterministic_backward", "forward_only_quantization"],
    "flamia_cute.quantize_sm90": ["fused_quantize_multi_sm90", "_alloc_outputs", "launch_fused_quantize_multi_sm90",
                                  "_launch", "quantize_with_rowdot_sm90"],
    "flamia_cute.attention_fwd_sm90": ["flamia_fwd_sm90", "get_launcher", "launch_on_device"],
    "flamia_cute.attention_bwd_sm90": ["flamia_bwd_sm90", "flamia_bwd_sm90_from_saved", "preprocess_bwd",
                                       "get_launcher", "launch_on_device"],
    "flamia_cute.tuning": ["_tuned_config"],
    "flamia_cute.compile_cache": ["compile_launcher", "target_arch", "launch_on_device", "current_raw_stream"],
}


def stage_times(call, n=50):
    """Mean host microseconds per call of each STAGES function (inclusive), over n calls."""
    import importlib

    totals, counts, saved = {}, {}, []
    for mod_name, names in STAGES.items():
        mod = importlib.import_module(mod_name)
        for name in names:
            fn = getattr(mod, name, None)
            if fn is None:
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
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    try:
        sync()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            call()
        whole = (time.perf_counter_ns() - t0) / n / 1e3
        sync()
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
    print(f"stages (host us per API call, inclusive; whole call {whole:.1f} us with the timers on):")
    for key in sorted(totals, key=lambda k: -totals[k]):
        print(f"  {key:55s} {totals[key] / n / 1e3:8.1f} us  ({counts[key] / n:.0f} calls)")


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "16x1k"
    lengths = json.loads(DEFAULT_WORKLOADS.read_text())["workloads"][name]
    case = Case(name, lengths, 16, 16, 128, "cuda").build()
    q, k, v, do = case.sets[0]
    mode = sys.argv[2] if len(sys.argv) > 2 else "fwd"
    if mode == "bwd":
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = flamia_attn_varlen_func(*leaves, case.cu, case.cu, case.max_len, case.max_len, case.scale)

        def call():
            return torch.autograd.grad(out, leaves, do, retain_graph=True)
    else:
        def call():
            return flamia_attn_varlen_func(q, k, v, case.cu, case.cu, case.max_len, case.max_len, case.scale)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        call()
    host = (time.perf_counter() - t0) / 20
    torch.cuda.synchronize()
    print(f"{mode}: host time per call (no sync): {host * 1e3:.3f} ms")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        call()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue()[:6000])
    if "stages" in sys.argv[3:]:
        stage_times(call)


if __name__ == "__main__":
    main()
