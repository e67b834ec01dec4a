"""The sm_90a kernels a call launches, from its plan (host only), and their compiles ahead of time in
parallel processes, into the disk cache (FLAMIA_CUTE_CACHE_DIR): the GPU scripts (fuzz_gpu.py,
soak.py) compile their kernels on all cores first instead of one at a time inside the timed loop.

call_kernels() names each kernel by (kind, frozen config) the way the launch code builds it: a
difference from what the kernels' host code builds shows as a build that soak.py reports unexpected.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

KINDS = ("quant", "fwd", "bwd", "codes", "grad_rotate")


def call_kernels(recipe: str, head_dim: int, heads_q: int, heads_kv: int, lengths, train: bool,
                 keys: str = "", rotary: tuple[str, int] | None = None, deterministic: bool = False) -> set[tuple]:
    """{(kind, config)} of the sm_90a kernels one call launches (kind in KINDS): the Q/K/V launch (not
    for the per-tensor control, which torch quantizes), the forward (its per-tile build past
    PERSISTENT_MAX_DOCS documents) and, for a training call of a recipe with a backward kernel, the dO
    + D launch (not for the control, whose dO torch quantizes), Q's codes conversion, the backward and,
    with rotations (rotary: custom_ops.rotary_key's (mode, width); a Hadamard recipe), dQ's conversion
    with Q's inverse rotations. deterministic: the call's deterministic argument."""
    from flamia_cute.plan import make_plan
    from flamia_cute.recipes import NAMED_RECIPES
    from flamia_cute.sm90.attention_fwd import PERSISTENT_MAX_DOCS, per_tile_fallback
    from flamia_cute.sm90.codes import CodesConfig
    from flamia_cute.sm90.quantize import dout_delta_config

    lengths = list(lengths)  # the queries' documents
    # keys: "" (causal self-attention), "cross" (causal, own key documents) or "noncausal"
    plan = make_plan(recipe, head_dim, heads_q, heads_kv, max(lengths), sum(lengths), len(lengths),
                     causal=keys != "noncausal", separate=bool(keys), rotary=rotary, deterministic=deterministic)
    fwd = plan.fwd
    if fwd.persistent and len(lengths) > PERSISTENT_MAX_DOCS:
        fwd = per_tile_fallback(fwd)
    out = {("fwd", fwd)}
    if plan.scaling != "tensor":
        out.add(("quant", plan.qkv))
    if train and plan.bwd is not None:
        out |= {("codes", CodesConfig(row_scale=True)), ("bwd", plan.bwd)}
        if plan.scaling != "tensor":
            quantized_delta = NAMED_RECIPES[recipe].delta == "quantized"
            out.add(("quant", dout_delta_config(head_dim, heads_q, heads_q // heads_kv, quantized_delta)))
        if plan.dq_convert is not None:
            out.add(("grad_rotate", plan.dq_convert))
    return out


def build(kind: str, config) -> None:
    """Compile (or load) one kernel through the launcher its launch code uses (same cache key)."""
    from flamia_cute.compile_cache import compile_launcher, target_arch

    if kind == "fwd":
        from flamia_cute.sm90.attention_fwd import get_launcher
    elif kind == "bwd":
        from flamia_cute.sm90.attention_bwd import get_launcher
    elif kind == "quant":
        from flamia_cute.sm90 import quantize as m

        def get_launcher(c):
            return compile_launcher(m.SOURCE_FILES, c, target_arch(),
                                    lambda c_, a, t: m.compile_fused_quantize_sm90(c_, a, tvm_ffi=t), m.ARG_KINDS)
    elif kind == "codes":
        from flamia_cute.sm90 import codes as m

        def get_launcher(c):
            return compile_launcher(m.SOURCE_FILES, c, target_arch(),
                                    lambda c_, a, t: m.compile_codes_sm90(c_, a, tvm_ffi=t), m.ARG_KINDS, None)
    elif kind == "grad_rotate":
        from flamia_cute.sm90 import rotate as m

        def get_launcher(c):  # as rotate.grad_rotate_to_bf16 builds it
            return compile_launcher(m.SOURCE_FILES, c, target_arch(),
                                    lambda c_, a, t: m.compile_grad_rotate_sm90(c_, a, tvm_ffi=t), m.ARG_KINDS, None)
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    get_launcher(config)


def _build_one(item) -> tuple[str, float, str | None]:
    kind, config = item
    t0 = time.time()
    try:
        build(kind, config)
        return kind, time.time() - t0, None
    except Exception as e:  # reported; the run compiles it in-process instead
        return kind, time.time() - t0, f"{type(e).__name__}: {e}"[:300]


def compile_ahead(kernels, workers: int | None = None, log=print) -> float:
    """Compile `kernels` ({(kind, config)}) into the disk cache in `workers` spawned processes (default:
    the CPU count, at most 16); returns the seconds it took. Without the disk cache (FLAMIA_CUTE_DISK_CACHE=0)
    the processes' compiles would be lost: then nothing is done here."""
    from flamia_cute.compile_cache import disk_cache_enabled

    kernels = sorted(kernels, key=lambda kc: (KINDS.index(kc[0]), repr(kc[1])))
    if not kernels or not disk_cache_enabled():
        return 0.0
    workers = max(1, min(workers or min(os.cpu_count() or 1, 16), len(kernels)))
    t0 = time.time()
    import multiprocessing

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for kind, _secs, err in pool.map(_build_one, kernels):
            if err:
                log(f"compile_ahead: {kind} failed in a worker ({err}); it compiles in-process when first called")
    took = time.time() - t0
    log(f"compile_ahead: {len(kernels)} kernels in {took:.1f} s on {workers} processes")
    return took


def spec_kernels(recipe: str, specs, configs: dict) -> list[frozenset]:
    """call_kernels of each call spec of fuzz_gpu / soak ({"heads", "lengths", "train"}), in order."""
    out = []
    for sp in specs:
        H, Hk, D = configs[sp["heads"]]
        out.append(frozenset(call_kernels(recipe, D, H, Hk, sp["lengths"], sp["train"])))
    return out


def script_kernels(name: str) -> set:
    """The kernels a GPU script compiles ahead: sanitize (sanitize_driver's full set), fuzz (fuzz_gpu's packs
    at seed 0: a run's own seed may add a few, which it compiles itself), soak (its default call mix); and
    those of bench and train-long, for a disk cache built ahead on a machine without a GPU (perf/README.md)."""
    if name == "sanitize":
        import sanitize_driver

        return sanitize_driver.case_kernels(sanitize_driver.cases("full"))
    if name == "fuzz":
        import fuzz_gpu as m

        specs = [m.pack_spec(0, i, m.head_configs()) for i in range(m.DEFAULT_PACKS)]
    elif name == "soak":
        import soak as m

        specs = m.call_specs(m.DEFAULT_CALLS, 0, m.head_configs())
    elif name == "bench":  # `flamia-cute bench`'s defaults: every workload, h16_d128, forward and training calls
        import json

        from flamia_cute.bench import DEFAULT_WORKLOADS
        from flamia_cute.recipes import DEFAULT_RECIPE

        data = json.loads(DEFAULT_WORKLOADS.read_text())
        h = data["head_configs"]["h16_d128"]
        return {k for lengths in data["workloads"].values() for train in (False, True)
                for k in call_kernels(DEFAULT_RECIPE, h["head_dim"], h["heads_q"], h["heads_kv"], lengths, train)}
    elif name == "train-long":  # train_long.sh: llama_125m (6 heads of 128), four 16k documents, fused RoPE
        return call_kernels("fp8_tokenblock_dsbf16", 128, 6, 6, [16384] * 4, True, rotary=("half", 128))
    else:
        raise ValueError(f"script must be sanitize, fuzz, soak, bench or train-long, got {name!r}")
    return set().union(*spec_kernels(m.RECIPE, specs, m.head_configs()))


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="sanitize,fuzz,soak", help="comma-separated: sanitize, fuzz, soak, bench, train-long")
    ap.add_argument("--list", action="store_true", help="count the kernels only (no compiles)")
    args = ap.parse_args(argv)
    kernels = set()
    for name in args.sets.split(","):
        ks = script_kernels(name)
        print(f"{name}: {len(ks)} kernels")
        kernels |= ks
    print(f"all: {len(kernels)} kernels")
    if not args.list:
        compile_ahead(kernels)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
