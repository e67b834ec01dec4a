#!/usr/bin/env python3
"""Where the bf16-dS backward kernel's tile time goes: time builds with one part of a tile step removed
(outputs are WRONG; timing only, on the GPU), like fwd_ablations.py for the forward. Each ablation
patches the traced code before its own compile (disk cache off, memory cache cleared).

    FLAMIA_CUTE_DISK_CACHE=0 python perf/ablations/bwd_ablations.py [workload ...]

Ablations (each against the full kernel in the same run):
  no exp           P^T's exp2 -> one FMUL (no MUFU.EX2)
  no P pack        P^T's dV fold not packed to e4m3 (the dV GEMM reads stale registers)
  no dS            bf16(dS) -> a constant word: the dS math (dead then) and its conversion go;
                   dK's A fragment and the shared dS tile get the constant
  no dQ store      the dQ tile's stores to shared memory skipped (barriers and reduce-add stay)
  all              the four together: GEMMs, pipelines, barriers, loads of the vectors
  half dK dQ       every other k-step of the two bf16 products (dK, dQ) skipped: the instruction count
                   and the B-operand bytes of e4m3 dK and dQ (an e4m3 k32 wgmma takes a bf16 k16's
                   time and reads half its bytes), without the dS quantization that would need
                   (the ceiling of an e4m3-dS build of this kernel)
  half dK dQ no K cvt   the same without K's bf16 conversion per phase (that build loads K^T's e4m3
                   codes by TMA instead): its ceiling less the added dS scale work
  half dK          dK's product alone halved: the ceiling of e4m3 dK with dQ left in bf16
  no K cvt         K's bf16 conversion skipped alone (dQ's B operand: whatever shared memory held)
  dS m3 / dS m0    bf16(dS)'s mantissa truncated to 3 / 0 bits (one AND per pair): the tensor cores'
                   energy per dK and dQ product with fewer toggling bits (the kernel is at the H200's
                   700 W cap, bwd_power.py; outputs slightly wrong, timing and clock only)
  zero K           the conversion stores zeros (its stores kept, its loads and math dead): against
                   "no K cvt", whether that build's saving is the conversion's work or the dQ
                   product's operand data (tensor-core power on the H200's clock)
"""

import json
import sys
from pathlib import Path

import cutlass.cute as cute
import torch
from cutlass import Float32, Uint32

import flamia_cute.sm90.attention_bwd as bwd
from flamia_cute.attention_bwd_sm90 import preprocess_bwd
from flamia_cute.bench import DEFAULT_WORKLOADS, Case
from flamia_cute.compile_cache import clear_memory_cache
from flamia_cute.cute_backend import quantize_operands
from flamia_cute.schedules import causal_flops
from flamia_cute.sm90.attention_fwd import FwdConfig, flamia_fwd_sm90
from flamia_cute.sm90.codes import e4m3_codes_to_bf16

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_fwd_breakdown import graph_ms  # noqa: E402

REAL = {"exp2": cute.math.exp2, "pack": bwd.pack_a_fragment_e4m3, "cvt": bwd.cvt_bf16x2,
        "k_to_bf16": bwd.e4m3x2_to_bf16x2,
        "store": bwd.FlamiaBwdDsBf16Sm90._store_dq_tile, "mmas": bwd.FlamiaBwdDsBf16Sm90._make_mmas,
        "gemm": cute.gemm, "convert_k": bwd.FlamiaBwdDsBf16Sm90.convert_k}
_HALVED = {}  # id(dK or dQ TiledMma) -> its gemm calls traced so far


_HALVE = []  # which of the bf16 products' TiledMmas (2: dK, 3: dQ) are halved


def _make_mmas_halved(self):
    mmas = REAL["mmas"](self)
    _HALVED.update({id(mmas[i]): 0 for i in _HALVE})
    return mmas


def _gemm_halved(mma, *args, **kwargs):
    if id(mma) in _HALVED:
        _HALVED[id(mma)] += 1
        if _HALVED[id(mma)] % 2 == 0:
            return None
    return REAL["gemm"](mma, *args, **kwargs)


def _cvt_masked(mask):
    def cvt(lo, hi):
        return REAL["cvt"](lo, hi) & Uint32(mask)
    return cvt


def patch(no_exp=False, no_pack=False, no_ds=False, no_store=False, half_dk_dq=False, no_convert_k=False,
          half_dk=False, zero_k=False, ds_mask=None):
    cute.math.exp2 = (lambda x, fastmath=True: x * Float32(0.5)) if no_exp else REAL["exp2"]
    bwd.pack_a_fragment_e4m3 = (lambda acc, out32: None) if no_pack else REAL["pack"]
    bwd.cvt_bf16x2 = ((lambda lo, hi: Uint32(0x3F803F80)) if no_ds else _cvt_masked(ds_mask) if ds_mask
                      else REAL["cvt"])
    bwd.FlamiaBwdDsBf16Sm90._store_dq_tile = ((lambda self, *a: None) if no_store else REAL["store"])
    _HALVE[:] = [2, 3] if half_dk_dq else [2] if half_dk else []
    bwd.FlamiaBwdDsBf16Sm90._make_mmas = _make_mmas_halved if _HALVE else REAL["mmas"]
    cute.gemm = _gemm_halved if _HALVE else REAL["gemm"]
    # only convert_k converts with q_bf16_source "tma" (the default these builds use)
    bwd.e4m3x2_to_bf16x2 = (lambda x, hi, sc: Uint32(0)) if zero_k else REAL["k_to_bf16"]
    bwd.FlamiaBwdDsBf16Sm90.convert_k = (lambda self, bufs, sKs: None) if no_convert_k else REAL["convert_k"]
    _HALVED.clear()
    clear_memory_cache()


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
}
# BWD_ABLATIONS=full,half dK dQ: only these builds
_only = [a for a in __import__("os").environ.get("BWD_ABLATIONS", "").split(",") if a]
ABLATIONS = {k: v for k, v in ABLATIONS.items() if not _only or k in _only}


def saved_operands(name):
    """Workload `name` (16 heads, d128) through the quantization and the forward kernel: (case, the
    backward's saved operands as flamia_bwd_dsbf16_sm90_from_saved takes them, and its precomputed
    inputs do_quantized, delta, dv_ref; Q's bf16 copy). The Q/K/V launch writes every layout (Q^T in
    P-fragment order too, for the dk_e4m3 build)."""
    case = Case(name, json.loads(DEFAULT_WORKLOADS.read_text())["workloads"][name], 16, 16, 128, "cuda").build()
    q, k, v, dout = case.sets[0]
    qq, (kq, kt), (vq, vt) = quantize_operands(q, k, v, case.cu, 128, case.max_len)
    out, lse = flamia_fwd_sm90(qq.data_td, qq.scale, kq.data_td, kq.scale, vq.data_dt, vq.scale, kt.data_td,
                               kt.scale, vt.data_dt, vt.scale, case.cu, case.max_len, case.scale,
                               FwdConfig(128, diagonal_copy=True))
    delta, doq, dv_ref = preprocess_bwd(dout, out, case.cu, dv_ref_group=1)
    saved = (dout, out, lse, qq, kq, vq, kt, vt, case.cu, case.max_len, case.scale)
    return case, saved, dict(do_quantized=doq, delta=delta, dv_ref=dv_ref), e4m3_codes_to_bf16(qq.data_td, qq.scale)


def build_runs(names):
    """{workload: (the backward call from saved operands, its FLOPs)}: every workload's inputs first,
    so that each ablation compiles once."""
    runs = {}
    for name in names:
        case, saved, pre, q_bf16 = saved_operands(name)
        cfg = bwd.BwdDsBf16Config(128, diagonal_copy=True)

        def run(saved=saved, pre=pre, q_bf16=q_bf16, cfg=cfg):
            bwd.flamia_bwd_dsbf16_sm90_from_saved(*saved, config=cfg, q_bf16=q_bf16, **pre)
        runs[name] = (run, causal_flops(case.lengths, 16, 128, backward=True))
    return runs


def main():
    names = sys.argv[1:] or ["1x16k", "4x4k", "16x1k"]
    runs = build_runs(names)
    rows = {name: {"workload": name} for name in names}
    for label, flags in ABLATIONS.items():
        patch(**flags)
        for name, (run, flops) in runs.items():
            rows[name][label] = ms = graph_ms(run)
            rows[name][f"TFLOP/s {label}"] = flops / (ms * 1e9)
    patch()
    for row in rows.values():
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
