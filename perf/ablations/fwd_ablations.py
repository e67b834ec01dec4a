#!/usr/bin/env python3
"""Where the forward kernel's tile time goes: time builds with one part of a tile step removed or added
(outputs are WRONG; timing only, on the GPU). Each ablation patches Python functions the kernel calls
while it is traced, then compiles afresh (common.py: the in-memory cache cleared, the disk cache off
while patched), so the product kernel is untouched. The untuned default config, 16 heads, d128, the
tokenblock recipe.

    python perf/ablations/fwd_ablations.py [workload ...] [--ablations "full,no exp"]
    python perf/ablations/fwd_ablations.py --go            # issue 36: the third product against the backward
    python perf/ablations/fwd_ablations.py --compile-only  # each build for sm_90a on the CPU: SASS counts

Ablations (each against the full kernel in the same run):
  no exp         exp2 -> one FMUL (no MUFU.EX2: the exponentials' pipe time)
  no max         each row's max over its 32 values -> its first value (62 FMNMX fewer per tile)
  no O update    O = O * c + O_tile (64 FFMA per tile: the promotion) -> one FADD of element 0, which keeps
                 P V's result live (with no use of it, ptxas drops the P V wgmmas as dead code)
  skeleton       all three: GEMMs, pipelines, barriers and the rest of the softmax
  third product  one more FP8 GEMM per tile step of S = Q K^T's shape (64 x 128 x D per warpgroup):
                 gemm_qk issues S's wgmmas twice, the second pass accumulating onto the first (S' = 2S:
                 its result feeds the softmax, so nothing is dead code, and no accumulator registers are
                 added). A proxy for issue 36's split dQ kernel, whose step is three GEMMs of this size
                 (S, dP, dQ) with three accumulators, as the forward's S, P V and O. Go if it runs at
                 <= 0.40 of today's full backward kernel on the same workload (--go times both).
"""

import os
import sys

if "--compile-only" in sys.argv:  # the DSL fixes its arch at import: before anything imports cutlass
    os.environ["FLAMIA_ARCH"] = os.environ["CUTE_DSL_ARCH"] = "sm_90a"

from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import cutlass.cute as cute  # noqa: E402
from cutlass import Float32  # noqa: E402
from cutlass.cute.nvgpu import warpgroup  # noqa: E402

import flamia_cute.sm90.attention_fwd as fwd  # noqa: E402
import flamia_cute.softmax as softmax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

F = fwd.FlamiaFwdSm90
REAL = {"exp2": cute.math.exp2, "fmax_chains": softmax.fmax_chains, "acc": F.accumulate_o, "gemm_qk": F.gemm_qk}
SKIPPED = Counter()  # what the patches changed while the last build was traced (compile-only prints it)


def _gemm_qk_twice(self, qk_mma, frags, k_state, q_slot):
    """S = Q K^T (the real gemm_qk), then the same wgmmas again accumulating onto S (in the same
    commit group: the caller commits after gemm_qk returns)."""
    REAL["gemm_qk"](self, qk_mma, frags, k_state, q_slot)
    tSrQ, tSrK, acc_s = frags[0], frags[1], frags[3]
    qk_mma.set(warpgroup.Field.ACCUMULATE, True)
    for k in range(self.D // 32):
        cute.gemm(qk_mma, acc_s, tSrQ[None, None, k, q_slot], tSrK[None, None, k, k_state.index], acc_s)
    SKIPPED["gemm_qk issued twice"] += 1


def _o_one_add(self, frags, c):
    """accumulate_o reduced to O[0] += O_tile[0]: P V's wgmmas write every accumulator register, so one
    live register keeps them (--compile-only: the QGMMA count stays the full build's)."""
    acc_t, acc_o = frags[4], frags[5]
    acc_o[0] = acc_o[0] + acc_t[0]
    SKIPPED["O update as one FADD"] += 1


def patch(no_exp=False, no_max=False, no_o=False, third=False):
    """Install one ablation's patches (none: the real kernel) and clear the compile caches."""
    cute.math.exp2 = (lambda x, fastmath=True: x * Float32(0.5)) if no_exp else REAL["exp2"]
    softmax.fmax_chains = (lambda vals, chains=4, combine=None: vals[0]) if no_max else REAL["fmax_chains"]
    F.accumulate_o = _o_one_add if no_o else REAL["acc"]
    F.gemm_qk = _gemm_qk_twice if third else REAL["gemm_qk"]
    SKIPPED.clear()
    common.set_patched(any((no_exp, no_max, no_o, third)))


ABLATIONS = {
    "full": {},
    "no exp": {"no_exp": True},
    "no max": {"no_max": True},
    "no O update": {"no_o": True},
    "skeleton": {"no_exp": True, "no_max": True, "no_o": True},
    "third product": {"third": True},
}
GO = ("full", "third product")
GO_MAX_RATIO = 0.40  # issue 36: the split dQ kernel (this proxy) at most this fraction of today's backward


def chosen(names: str | None) -> dict:
    picked = [a for a in (names or "").split(",") if a]
    bad = [a for a in picked if a not in ABLATIONS]
    if bad:
        raise SystemExit(f"unknown ablations {bad}; known: {list(ABLATIONS)}")
    return {k: v for k, v in ABLATIONS.items() if not picked or k in picked or k == "full"}


def measure(names, ablations: dict, with_backward: bool) -> list[dict]:
    """One row per (workload, build): ms, the ratio to the full forward, TFLOP/s, the SM clock over the
    replays, SM cycles per 128x128 tile step; with_backward: also the full backward kernel alone
    (bwd_ablations' "full") and each build's ratio to it."""
    from flamia_cute.schedules import causal_flops

    patch()
    wl = common.workloads()
    inputs = {name: common.Inputs(name, wl[name]) for name in names}  # the real kernels, before any patch
    sampler = common.ClockSampler()
    rows, bwd_ms = [], {}
    try:
        if with_backward:
            for name, inp in inputs.items():
                r = common.timed(inp.backward_kernel(inp.backward_config()), sampler)
                bwd_ms[name] = r["ms"]
                rows.append({"workload": name, "build": "backward full", **r,
                             "tflops": causal_flops(inp.lengths, common.HEADS, common.HEAD_DIM, backward=True)
                             / (r["ms"] * 1e9),
                             "cycles_per_step": common.cycles_per_step(r["ms"], r.get("sm_mhz"),
                                                                       common.bwd_steps(inp.lengths))})
        for label, flags in ablations.items():
            patch(**flags)
            for name, inp in inputs.items():
                r = common.timed(lambda inp=inp: inp.forward(inp.fwd_config), sampler)
                rows.append({"workload": name, "build": label, **r,
                             "tflops": causal_flops(inp.lengths, common.HEADS, common.HEAD_DIM) / (r["ms"] * 1e9),
                             "cycles_per_step": common.cycles_per_step(r["ms"], r.get("sm_mhz"),
                                                                       common.fwd_steps(inp.lengths))})
    finally:
        patch()
        sampler.stop()
    full = {r["workload"]: r["ms"] for r in rows if r["build"] == "full"}
    for r in rows:
        if r["build"] != "backward full":
            r["ratio"] = r["ms"] / full[r["workload"]]
            if r["workload"] in bwd_ms:
                r["vs_bwd"] = r["ms"] / bwd_ms[r["workload"]]
    return rows


COLUMNS = [("workload", "workload"), ("build", "build"), ("ms", "ms"), ("ratio", "vs fwd full"),
           ("vs_bwd", "vs bwd full"), ("tflops", "TFLOP/s"), ("sm_mhz", "SM MHz"),
           ("cycles_per_step", "SM cycles / step (fwd 128x128, bwd 64x128)")]


def compile_only(ablations: dict, config=None) -> dict:
    return common.compile_builds(fwd, config or fwd.FwdConfig(common.HEAD_DIM, diagonal_copy=True), ablations, patch,
                                 SKIPPED)


def main():
    ap = common.parser(__doc__, "issue 36's go/no-go: full, 'third product' and the full backward kernel, a table and "
                                "the verdict")
    ap.add_argument("--ablations", default=None, help="comma list of ablation labels (default: all)")
    ap.add_argument("--with-backward", action="store_true", help="also time the full backward kernel (--go implies it)")
    args = ap.parse_args()
    ablations, names = common.selection(args, ABLATIONS, GO, chosen, compile_only)
    if ablations is None:
        return
    rows = measure(names, ablations, with_backward=args.go or args.with_backward)
    common.print_table(rows, COLUMNS)
    if args.go:
        for r in rows:
            if r["build"] == "third product":
                verdict = "GO" if r["vs_bwd"] <= GO_MAX_RATIO else "NO-GO"
                print(f"{r['workload']}: forward + third product {r['ms']:.3f} ms = {r['vs_bwd']:.3f} of the full "
                      f"backward kernel (go if <= {GO_MAX_RATIO}); {r['ratio']:.3f} of the forward: {verdict}", flush=True)


if __name__ == "__main__":
    main()
