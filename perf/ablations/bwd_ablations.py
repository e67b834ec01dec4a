#!/usr/bin/env python3
"""Where the bf16-dS backward kernel's tile time goes: time builds with one part of a tile step removed
(outputs are WRONG; timing only, on the GPU), like fwd_ablations.py for the forward. Each ablation
patches Python functions the kernel calls while it is traced, then compiles afresh (common.py: the
in-memory cache cleared, the disk cache off while patched). The kernel runs alone (its inputs
preprocessed once), in the untuned plan's config, 16 heads, d128, the tokenblock recipe.

    python perf/ablations/bwd_ablations.py [workload ...] [--ablations "full,no exp"]
    python perf/ablations/bwd_ablations.py --go            # issue 36: dK/dV only against the full kernel
    python perf/ablations/bwd_ablations.py --compile-only  # each build for sm_90a on the CPU: SASS counts

Ablations (each against the full kernel in the same run; BWD_ABLATIONS or --ablations picks them):
  no exp           P^T's exp2 -> one FMUL (no MUFU.EX2)
  no P pack        P^T's dV fold not packed to e4m3 (the dV GEMM reads stale registers)
  no dS            bf16(dS) -> a constant word but for one value pair per tile step: the dS math (dead
                   then) and its conversion go; dK's A fragment and the shared dS tile get the constant.
                   The one real pair keeps dP^T's product live (unused, ptxas drops its wgmmas)
  no dQ store      the dQ tile's stores to shared memory but one per thread skipped (barriers and
                   reduce-add stay); the one store keeps the dQ product live
  all              the four together: GEMMs, pipelines, barriers, loads of the vectors
  half dK dQ       every other k-step of the two bf16 products (dK, dQ) skipped: the instruction count
                   and B-operand bytes that e4m3 dK and dQ products would have (an e4m3 k32 wgmma
                   takes a bf16 k16's time and reads half its bytes), without any dS quantization
  half dK dQ no K cvt   the same without K's bf16 conversion per phase
  half dK          dK's product alone halved
  no K cvt         K's bf16 conversion skipped alone (dQ's B operand: whatever shared memory held)
  zero K           the conversion stores zeros (its stores kept, its loads and math dead): against
                   "no K cvt", whether that build's saving is the conversion's work or the dQ
                   product's operand data (tensor-core power on the H200's clock)
  dS m3 / dS m0    bf16(dS)'s mantissa truncated to 3 / 0 bits (one AND per pair): the tensor cores'
                   energy per dK and dQ product with fewer toggling bits (the kernel is at the H200's
                   700 W cap, bwd_power.py; outputs slightly wrong, timing and clock only)
  dk dv only       issue 36's split backward, its dK/dV kernel: today's kernel without anything only
                   dQ needs: no dQ product, no dS tile in shared memory (its stores), no dQ tile
                   stores, no TMA reduce-adds (the dQ warp idles), no barriers that only dQ needs
                   (the warpgroups' dS barrier, the dQ hand-off, the phase barrier that orders K's
                   bf16 copy), no K bf16 conversion (dQ's B operand). Go if <= 0.60 of the full kernel.
"""

import os
import sys

if "--compile-only" in sys.argv:  # the DSL fixes its arch at import: before anything imports cutlass
    os.environ["FLAMIA_ARCH"] = os.environ["CUTE_DSL_ARCH"] = "sm_90a"

from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Uint32  # noqa: E402

import flamia_cute.sm90.attention_bwd as bwd  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

K = bwd.FlamiaBwdDsBf16Sm90
REAL = {"exp2": cute.math.exp2, "pack": bwd.pack_a_fragment_e4m3, "cvt": bwd.cvt_bf16x2,
        "k_to_bf16": bwd.e4m3x2_to_bf16x2, "store": K._store_dq_tile, "mmas": K._make_mmas, "gemm": cute.gemm,
        "convert_k": K.convert_k, "share_key_scales": K.share_key_scales, "shared_buffers": K.shared_buffers,
        "reduce_dq": K.reduce_dq, "barrier": cute.arch.barrier, "barrier_arrive": cute.arch.barrier_arrive,
        "fence_proxy": cute.arch.fence_proxy}
# which of _make_mmas' TiledMmas (2: dK, 3: dQ) lose gemm calls: "half" (every other k-step) or "skip"
_MMA_MODE: dict[int, str] = {}
_MMAS: dict[int, list] = {}  # id -> [TiledMma (held, so its id stays unique), mode, gemm calls traced]
# named barriers (id, threads) that only dQ needs: the warpgroups' dS barrier, the phase barrier (K's
# bf16 copy and its key scales), the dQ warp's hand-off
_DQ_BARRIERS = {(1, 256), (2, 256), (bwd.DQ_FULL, 288), (bwd.DQ_EMPTY, 288)}
_DROP_BARRIERS: set = set()
SKIPPED = Counter()  # what the patches dropped while the last build was traced (compile-only prints it)


def _make_mmas_tracked(self):
    mmas = REAL["mmas"](self)
    for i, mode in _MMA_MODE.items():
        _MMAS[id(mmas[i])] = [mmas[i], mode, 0]
    return mmas


def _gemm_tracked(mma, *args, **kwargs):
    entry = _MMAS.get(id(mma))
    if entry is not None:
        entry[2] += 1
        if entry[1] == "skip" or entry[2] % 2 == 0:
            SKIPPED[f"{entry[1]} gemm"] += 1
            return None
    return REAL["gemm"](mma, *args, **kwargs)


_CVT_CALLS = [0]


def _cvt_constant(lo, hi):
    """bf16(dS) as a constant word, but the first pair of each tile step's 16 (tile_step converts a
    thread's 32 dS values in 16 calls): that pair's dS math keeps the dP^T product's result live."""
    _CVT_CALLS[0] += 1
    if _CVT_CALLS[0] % 16 == 1:
        return REAL["cvt"](lo, hi)
    return Uint32(0x3F803F80)


def _store_dq_one(self, sdQ_words, dq_plan, acc_dq, tScQ, softmax_scale):
    """One word of the dQ tile per thread (the real store's first): the dQ product stays live."""
    row0, col0 = tScQ[0]
    sdQ_words[bwd.smem_word_index(dq_plan[0], (row0, col0, 0), 4)] = acc_dq[0] * softmax_scale
    SKIPPED["dQ tile store reduced to one word"] += 1


def _cvt_masked(mask):
    def cvt(lo, hi):
        return REAL["cvt"](lo, hi) & Uint32(mask)
    return cvt


class _NoStores:
    """Stands for the dS tile's word view (bufs[8]) in the dK/dV-only build: tile_step's stores vanish."""

    def __setitem__(self, index, value):
        SKIPPED["dS shared-memory store"] += 1


def _shared_buffers_no_ds(self, layouts, tmas):
    bufs, *rest = REAL["shared_buffers"](self, layouts, tmas)
    bufs = list(bufs)
    bufs[8] = _NoStores()
    return (tuple(bufs), *rest)


def _named(real, label):
    def call(*args, **kwargs):
        bid = kwargs.get("barrier_id", args[0] if args else None)
        threads = kwargs.get("number_of_threads", args[1] if len(args) > 1 else None)
        if (bid, threads) in _DROP_BARRIERS:
            SKIPPED[f"{label} {bid}"] += 1
            return None
        return real(*args, **kwargs)
    return call


def _fence_outside_tile_step(*args, **kwargs):
    """tile_step's two proxy fences order the dS tile's and the dQ tile's shared-memory stores before
    the tensor cores and the TMA read them: dQ's alone (transpose_v's, in another function, stays)."""
    if sys._getframe(1).f_code.co_name == "tile_step":
        SKIPPED["tile_step fence_proxy"] += 1
        return None
    return REAL["fence_proxy"](*args, **kwargs)


def _noop(label):
    def call(*args, **kwargs):
        SKIPPED[label] += 1
    return call


def patch(no_exp=False, no_pack=False, no_ds=False, no_store=False, half_dk_dq=False, no_convert_k=False,
          half_dk=False, zero_k=False, ds_mask=None, dkdv_only=False):
    """Install one ablation's patches (none: the real kernel) and clear the compile caches."""
    cute.math.exp2 = (lambda x, fastmath=True: x * Float32(0.5)) if no_exp else REAL["exp2"]
    bwd.pack_a_fragment_e4m3 = (lambda acc, out32: None) if no_pack else REAL["pack"]
    bwd.cvt_bf16x2 = _cvt_constant if no_ds else _cvt_masked(ds_mask) if ds_mask else REAL["cvt"]
    _CVT_CALLS[0] = 0
    K._store_dq_tile = _noop("dQ tile store") if dkdv_only else _store_dq_one if no_store else REAL["store"]
    _MMA_MODE.clear()
    _MMAS.clear()
    if half_dk_dq or half_dk:
        _MMA_MODE[2] = "half"
    if half_dk_dq:
        _MMA_MODE[3] = "half"
    if dkdv_only:
        _MMA_MODE[3] = "skip"
    K._make_mmas = _make_mmas_tracked if _MMA_MODE else REAL["mmas"]
    cute.gemm = _gemm_tracked if _MMA_MODE else REAL["gemm"]
    # e4m3x2_to_bf16x2's only caller in the backward is convert_k's walk (K in bf16, dQ's B operand)
    bwd.e4m3x2_to_bf16x2 = (lambda x, hi, sc: Uint32(0)) if zero_k else REAL["k_to_bf16"]
    K.convert_k = _noop("convert_k") if (no_convert_k or dkdv_only) else REAL["convert_k"]
    K.share_key_scales = _noop("share_key_scales") if dkdv_only else REAL["share_key_scales"]
    K.shared_buffers = _shared_buffers_no_ds if dkdv_only else REAL["shared_buffers"]
    K.reduce_dq = _noop("reduce_dq") if dkdv_only else REAL["reduce_dq"]
    _DROP_BARRIERS.clear()
    if dkdv_only:
        _DROP_BARRIERS.update(_DQ_BARRIERS)
    cute.arch.barrier = _named(REAL["barrier"], "barrier") if dkdv_only else REAL["barrier"]
    cute.arch.barrier_arrive = _named(REAL["barrier_arrive"], "barrier_arrive") if dkdv_only else REAL["barrier_arrive"]
    cute.arch.fence_proxy = _fence_outside_tile_step if dkdv_only else REAL["fence_proxy"]
    SKIPPED.clear()
    active = any((no_exp, no_pack, no_ds, no_store, half_dk_dq, no_convert_k, half_dk, zero_k, ds_mask, dkdv_only))
    common.set_patched(active)


ABLATIONS = {
    "full": {},
    "no exp": {"no_exp": True},
    "no P pack": {"no_pack": True},
    "no dS": {"no_ds": True},
    "no dQ store": {"no_store": True},
    "all": {"no_exp": True, "no_pack": True, "no_ds": True, "no_store": True},
    "half dK dQ": {"half_dk_dq": True},
    "half dK dQ no K cvt": {"half_dk_dq": True, "no_convert_k": True},
    "half dK": {"half_dk": True},
    "no K cvt": {"no_convert_k": True},
    "zero K": {"zero_k": True},
    "dS m3": {"ds_mask": 0xFFF0FFF0},
    "dS m0": {"ds_mask": 0xFF80FF80},
    "dk dv only": {"dkdv_only": True},
}
GO = ("full", "dk dv only")
GO_MAX_RATIO = 0.60  # issue 36: the dK/dV kernel at most this fraction of today's kernel


def chosen(names: str | None) -> dict:
    """The ablations named in a comma list (None: BWD_ABLATIONS, else all); "full" always first."""
    names = names if names is not None else os.environ.get("BWD_ABLATIONS", "")
    picked = [a for a in names.split(",") if a]
    bad = [a for a in picked if a not in ABLATIONS]
    if bad:
        raise SystemExit(f"unknown ablations {bad}; known: {list(ABLATIONS)}")
    return {k: v for k, v in ABLATIONS.items() if not picked or k in picked or k == "full"}


def build_runs(names):
    """{workload: (the backward kernel alone, its FLOPs, its tile steps)}: every workload's inputs
    first (the real kernels), so that each ablation compiles once."""
    from flamia_cute.schedules import causal_flops

    patch()
    wl = common.workloads()
    runs = {}
    for name in names:
        inp = common.Inputs(name, wl[name])
        runs[name] = (inp.backward_kernel(inp.backward_config()), causal_flops(inp.lengths, common.HEADS,
                                                                                common.HEAD_DIM, backward=True),
                      common.bwd_steps(inp.lengths))
    return runs


def measure(names, ablations: dict) -> list[dict]:
    """One row per (workload, build): ms, the ratio to the full build, TFLOP/s, the SM clock over the
    replays and SM cycles per 64x128 tile step."""
    runs = build_runs(names)
    sampler = common.ClockSampler()
    rows = []
    try:
        for label, flags in ablations.items():
            patch(**flags)
            for name, (run, flops, steps) in runs.items():
                r = common.timed(run, sampler)
                rows.append({"workload": name, "build": label, **r, "tflops": flops / (r["ms"] * 1e9),
                             "cycles_per_step": common.cycles_per_step(r["ms"], r.get("sm_mhz"), steps)})
    finally:
        patch()
        sampler.stop()
    full = {r["workload"]: r["ms"] for r in rows if r["build"] == "full"}
    for r in rows:
        r["ratio"] = r["ms"] / full[r["workload"]] if r["workload"] in full else None
    return rows


COLUMNS = [("workload", "workload"), ("build", "build"), ("ms", "ms"), ("ratio", "vs full"),
           ("tflops", "TFLOP/s"), ("sm_mhz", "SM MHz"), ("cycles_per_step", "SM cycles / 64x128 step")]


def compile_only(ablations: dict, config=None) -> dict:
    return common.compile_builds(bwd, config or bwd.BwdDsBf16Config(common.HEAD_DIM, diagonal_copy=True), ablations,
                                 patch, SKIPPED)


def main():
    ap = common.parser(__doc__, "issue 36's go/no-go: full and 'dk dv only', a table and the verdict")
    ap.add_argument("--ablations", default=None, help="comma list of ablation labels (default: BWD_ABLATIONS, else all)")
    args = ap.parse_args()
    ablations, names = common.selection(args, ABLATIONS, GO, chosen, compile_only)
    if ablations is None:
        return
    rows = measure(names, ablations)
    common.print_table(rows, COLUMNS)
    if args.go:
        for r in rows:
            if r["build"] == "dk dv only":
                verdict = "GO" if r["ratio"] <= GO_MAX_RATIO else "NO-GO"
                print(f"{r['workload']}: dK/dV-only kernel {r['ms']:.3f} ms = {r['ratio']:.3f} of the full backward "
                      f"kernel (go if <= {GO_MAX_RATIO}): {verdict}", flush=True)


if __name__ == "__main__":
    main()
