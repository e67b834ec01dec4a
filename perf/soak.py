"""GPU soak: 2,000 calls of random shapes through the public API; GPU memory must not grow and nothing
may compile beyond the kernels the calls' plans name.

Each call draws a max_seqlen bucket (128, 1,024, 4,096, 16,384 tokens: one document at the bucket's
length, the rest random below it, up to PACK_TOKENS per pack), a head config of
flamia_cute/workloads.json and a training (forward + backward) or no_grad call, on fresh N(0, 1)
inputs. Before the timed calls: every kernel the calls' plans name is compiled ahead
(kernel_warmup.call_kernels / compile_ahead), then a warm-up runs one call per distinct kernel set,
the largest pack of each (bucket, heads, mode), and the first WARMUP_FRACTION of the calls (the
caching allocator settles). Then every call runs, and the checks are:

- torch.cuda.memory_allocated() after each call (its tensors dropped) equals the value after the
  warm-up once it settles (a first reading above it that falls back within 0.1 s is counted as transient
  and reported, with whether it equals the call's dQ + dK + dV bytes): nothing the library keeps grows
  with the calls. Why a reading can be transient: torch.autograd.grad returns once the engine's CUDA
  worker thread marks the graph task complete, but that thread still holds the task, whose result
  holds the gradients, until its loop turns; on a busy CPU the caller can drop them and read first;
- torch.cuda.memory_reserved() reaches a plateau: no growth over the second half of the calls (the
  growth from the warm-up's end to the middle, the caching allocator's, is reported);
- no kernel is built (compiled or loaded from disk) after the warm-up, every kernel built is one a
  call's plan names, and none is built twice (compile_cache.kernel_builds);
- the library's host caches stay bounded (the plan memo, the cu_seqlens checks, the launchers);
- every output is finite.

    python perf/soak.py --out DIR       # ~1 min on one H200 once the kernels are compiled
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

BUCKETS = (128, 1024, 4096, 16384)
PACK_TOKENS = 16384
DEFAULT_CALLS = 2000
WARMUP_FRACTION = 0.25
RECIPE = "fp8_tokenblock_dsbf16"


def head_configs() -> dict[str, tuple[int, int, int]]:
    from flamia_cute.bench import DEFAULT_WORKLOADS

    cfgs = json.loads(pathlib.Path(DEFAULT_WORKLOADS).read_text())["head_configs"]
    return {n: (c["heads_q"], c["heads_kv"], c["head_dim"]) for n, c in cfgs.items()}


def draw_pack(rng: random.Random, bucket: int, pack_tokens: int = PACK_TOKENS) -> list[int]:
    """One document of exactly `bucket` tokens (max_seqlen is the bucket's) and random lengths 1..bucket
    (log-uniform) up to a random total of bucket..pack_tokens tokens, the last one cut; shuffled."""
    target = rng.randint(bucket, max(bucket, pack_tokens))
    lengths, total = [bucket], bucket
    while total < target:
        n = min(int(math.exp(rng.uniform(0.0, math.log(bucket + 1)))), bucket, target - total)
        n = max(1, n)
        lengths.append(n)
        total += n
    rng.shuffle(lengths)
    return lengths


def call_specs(n: int, seed: int, configs: dict) -> list[dict]:
    rng = random.Random(seed)
    names = sorted(configs)
    specs = []
    for i in range(n):
        bucket = rng.choice(BUCKETS)
        specs.append({"index": i, "seed": seed * 1_000_003 + i, "heads": rng.choice(names), "train": rng.random() < 0.5,
                      "bucket": bucket, "lengths": draw_pack(rng, bucket)})
    return specs


def warmup_specs(specs: list[dict], kernel_sets: list[frozenset]) -> list[dict]:
    """One call per distinct kernel set, the largest pack per (bucket, heads, mode), then the first
    WARMUP_FRACTION of the calls."""
    chosen, seen, largest = [], set(), {}
    for s, ks in zip(specs, kernel_sets, strict=True):
        if ks not in seen:
            seen.add(ks)
            chosen.append(s)
        key = (s["bucket"], s["heads"], s["train"])
        if key not in largest or sum(s["lengths"]) > sum(largest[key]["lengths"]):
            largest[key] = s
    return chosen + list(largest.values()) + specs[: int(WARMUP_FRACTION * len(specs))]


def host_caches() -> dict[str, int]:
    """Sizes of the library's host-side caches that grow with new call signatures, and their bounds."""
    from flamia_cute import compile_cache, tuned, validation

    return {"plan_memo": len(tuned._loaded.get("derived", {})), "plan_memo_max": tuned.DERIVED_MEMO_MAX,
            "cu_seqlens_checked": len(validation._CHECKED), "cu_seqlens_checked_max": validation._CHECKED_MAX,
            "launchers": len(compile_cache._LAUNCHERS)}


def settled_growth(first: int, alloc0: int, tries: int = 20, wait_s: float = 0.005) -> int:
    """Allocated memory over alloc0 once it stops falling (up to tries x wait_s): a read right after a call
    returned may still count buffers that another thread is about to free (seen only beside other GPU
    processes, never alone), while a leak stays."""
    import torch

    grown = first
    for _ in range(tries):
        if grown <= 0:
            break
        time.sleep(wait_s)
        grown = torch.cuda.memory_allocated() - alloc0
    return grown


def grad_bytes(spec: dict, configs: dict) -> int:
    """The caching allocator's bytes for a training call's dQ, dK and dV (blocks rounded up to 512 B); 0 for
    a no_grad call. A transient reading of exactly this size is the autograd engine still holding them."""
    if not spec["train"]:
        return 0
    H, Hk, D = configs[spec["heads"]]
    T = sum(spec["lengths"])
    block = lambda n: -(-n // 512) * 512
    return block(T * H * D * 2) + 2 * block(T * Hk * D * 2)


def run_call(spec: dict, configs: dict) -> None:
    import torch

    from flamia_cute import flamia_attn_varlen_func
    from flamia_cute.testing import cu_seqlens_from_lengths

    H, Hk, D = configs[spec["heads"]]
    lengths = spec["lengths"]
    T, mx = sum(lengths), max(lengths)
    g = torch.Generator(device="cuda").manual_seed(spec["seed"])
    mk = lambda h: torch.randn(T, h, D, device="cuda", generator=g, dtype=torch.bfloat16)
    q, k, v = mk(H), mk(Hk), mk(Hk)
    cu = cu_seqlens_from_lengths(lengths, "cuda")
    if spec["train"]:
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out = flamia_attn_varlen_func(*leaves, cu, cu, mx, mx, recipe=RECIPE, backend="cute")
        grads = torch.autograd.grad(out, leaves, mk(H))
        results = (out, *grads)
    else:
        with torch.no_grad():
            results = (flamia_attn_varlen_func(q, k, v, cu, cu, mx, mx, recipe=RECIPE, backend="cute"),)
    if not all(bool(torch.isfinite(r).all()) for r in results):
        raise RuntimeError(f"call {spec['index']} (seed {spec['seed']}): non-finite output")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=DEFAULT_CALLS, help=f"calls after the warm-up (default {DEFAULT_CALLS})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "perf/results/soak"), help="output folder (default $OUT)")
    ap.add_argument("--compile-workers", type=int, default=None)
    ap.add_argument("--list", action="store_true", help="print the call mix and the kernels it needs (no GPU)")
    args = ap.parse_args(argv)
    from kernel_warmup import compile_ahead, spec_kernels

    configs = head_configs()
    specs = call_specs(args.calls, args.seed, configs)
    kernel_sets = spec_kernels(RECIPE, specs, configs)
    expected = set().union(*kernel_sets)
    warm = warmup_specs(specs, kernel_sets)
    if args.list:
        print(f"{len(specs)} calls ({sum(s['train'] for s in specs)} training), buckets {BUCKETS}, "
              f"{len(set(kernel_sets))} distinct kernel sets, {len(expected)} kernels, {len(warm)} warm-up calls")
        return 0
    import torch

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("soak: needs an sm_90 GPU", file=sys.stderr)
        return 2
    from flamia_cute.compile_cache import kernel_builds

    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_fh = open(out_dir / "soak.log", "w")

    def log(msg):
        print(msg, flush=True)
        log_fh.write(msg + "\n")
        log_fh.flush()

    log(f"soak: {len(specs)} calls, seed {args.seed}, recipe {RECIPE}, {torch.cuda.get_device_name()}; "
        f"{len(expected)} kernels named by the calls' plans")
    compile_ahead(expected, args.compile_workers, log)
    t0 = time.time()
    for s in warm:
        run_call(s, configs)
    torch.cuda.synchronize()
    builds_warm = len(kernel_builds())
    alloc0, reserved0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    log(f"warm-up: {len(warm)} calls in {time.time() - t0:.1f} s, {builds_warm} kernel builds; allocated "
        f"{alloc0 / 2**20:.1f} MiB, reserved {reserved0 / 2**20:.1f} MiB")
    failures = []
    max_alloc_growth, reserved_mid, transient = 0, None, []
    t1 = time.time()
    for i, s in enumerate(specs):
        try:
            run_call(s, configs)
        except Exception as e:
            failures.append(f"call {i} (seed {s['seed']}, {s['heads']}, {'train' if s['train'] else 'no_grad'}, "
                            f"lengths {s['lengths']}): {type(e).__name__}: {e}"[:500])
            continue
        first = torch.cuda.memory_allocated() - alloc0
        grown = settled_growth(first, alloc0)
        if first > 0 and grown <= 0:
            gb = grad_bytes(s, configs)
            transient.append((i, first, first == gb))
            log(f"  call {i}: transient {first / 2**20:+.2f} MiB, fell back to {grown / 2**20:+.2f}; the call's "
                f"dQ + dK + dV hold {gb / 2**20:.2f} MiB")
        if grown > max_alloc_growth:
            max_alloc_growth = grown
            log(f"  call {i}: allocated {grown / 2**20:+.2f} MiB over the warm-up's value")
        if i == len(specs) // 2:
            reserved_mid = torch.cuda.memory_reserved()
        if (i + 1) % 500 == 0:
            log(f"  {i + 1} calls ({time.time() - t1:.0f} s): allocated {torch.cuda.memory_allocated() / 2**20:.1f} MiB, "
                f"reserved {torch.cuda.memory_reserved() / 2**20:.1f} MiB")
    torch.cuda.synchronize()
    elapsed = time.time() - t1
    reserved_end = torch.cuda.memory_reserved()
    reserved_mid = reserved_mid if reserved_mid is not None else reserved_end
    builds = kernel_builds()
    after = builds[builds_warm:]
    unexpected = [b for b in builds if (kind_of(b.config), b.config) not in expected]
    keys = [(b.config, b.arch, b.variant) for b in builds]
    twice = len(keys) - len(set(keys))
    caches = host_caches()
    if max_alloc_growth > 0:
        failures.append(f"allocated memory grew by {max_alloc_growth / 2**20:.2f} MiB after the warm-up")
    if reserved_end > reserved_mid:
        failures.append(f"reserved memory still grows: {reserved_mid / 2**20:.1f} MiB at call {len(specs) // 2}, "
                        f"{reserved_end / 2**20:.1f} MiB at the end")
    if after:
        failures.append(f"{len(after)} kernel builds after the warm-up: {[type(b.config).__name__ for b in after]}")
    if unexpected:
        failures.append(f"{len(unexpected)} builds of kernels no call's plan names: {[repr(b.config)[:160] for b in unexpected]}")
    if twice:
        failures.append(f"{twice} kernels built twice")
    if caches["plan_memo"] > caches["plan_memo_max"] or caches["cu_seqlens_checked"] > caches["cu_seqlens_checked_max"]:
        failures.append(f"a host cache outgrew its bound: {caches}")
    for f in failures:
        log(f"FAIL {f}")
    log(f"soak summary: {len(specs)} calls ({sum(s['train'] for s in specs)} training) in {elapsed:.1f} s after a "
        f"{len(warm)}-call warm-up; allocated growth {max_alloc_growth / 2**20:.2f} MiB (transient readings that "
        f"settled: {len(transient)}, up to {max((t[1] for t in transient), default=0) / 2**20:.2f} MiB, "
        f"{sum(t[2] for t in transient)} of them exactly their call's dQ + dK + dV bytes); reserved {reserved0 / 2**20:.1f} "
        f"-> {reserved_mid / 2**20:.1f} (middle) -> {reserved_end / 2**20:.1f} MiB (end); kernel builds {len(builds)} "
        f"({sum(b.source == 'compile' for b in builds)} compiled in-process, {sum(b.source == 'disk' for b in builds)} "
        f"from disk; {len(after)} after the warm-up, {len(unexpected)} unexpected, {twice} repeated) for "
        f"{len(expected)} named; host caches {caches}; {len(failures)} failures")
    log_fh.close()
    return 1 if failures else 0


def kind_of(config) -> str:
    """kernel_warmup's kind of a built config."""
    name = type(config).__name__
    return {"FwdConfig": "fwd", "BwdDsBf16Config": "bwd", "MultiQuantizeConfig": "quant", "QuantizeConfig": "quant",
            "CodesConfig": "codes", "GradRotateConfig": "grad_rotate"}.get(name, name)


if __name__ == "__main__":
    sys.exit(main())
