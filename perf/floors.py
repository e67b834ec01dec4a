"""FLOP and byte floors of every workload (the floors the docs/ notes cite): `python perf/floors.py`."""

import json
import pathlib

from flamia_cute.schedules import causal_flops

FP8_TFLOPS = 1380.0  # dense FP8 GEMM measured on the H200 (design note)
BF16_TFLOPS = 750.0
COPY_TBPS = 4.3


def floors(lengths, hq=16, hkv=16, d=128):
    T = sum(lengths)
    f_fwd = causal_flops(lengths, hq, d)
    f_bwd = causal_flops(lengths, hq, d, backward=True)
    q_el, kv_el = T * hq * d, T * hkv * d
    # fused quantization: read bf16, write e4m3 in two orientations (+ per-token diagonal copies of K, V
    # for fp8_tokenblock, both orientations)
    quant_token = (q_el + 2 * kv_el) * (2 + 2)
    quant_tokenblock = quant_token + 2 * kv_el * 2
    # what the default recipe's training launch moves (sm90/quantize.forward_only):
    # reads Q, K, V in bf16, writes Q and K token-major (K with its per-token copy) and V^T with its copy
    quant_default = (q_el + 2 * kv_el) * 2 + q_el + 2 * kv_el * 2
    # the passes around the bf16-dS backward: dO quantized both ways with D (reads dO, O; writes 2
    # bytes), Q's bf16 codes (reads 1, writes 2), the fp32 dQ accumulator's zero fill (4) and its
    # conversion to bf16 (reads 4, writes 2)
    bwd_passes = q_el * ((4 + 2) + (1 + 2) + 4 + (4 + 2))
    fwd_bytes = q_el + 2 * kv_el + q_el * 2  # fp8 Q, K, V in; bf16 O out
    return {
        "T": T,
        "fwd_TFLOP": f_fwd / 1e12,
        "fwd_ms_fp8": f_fwd / FP8_TFLOPS / 1e9,
        "fwd_ms_bf16": f_fwd / BF16_TFLOPS / 1e9,
        "fwd_mem_ms": fwd_bytes / COPY_TBPS / 1e9,
        "bwd_ms_fp8": f_bwd / FP8_TFLOPS / 1e9,
        # five products of equal size: all bf16 (FA4), or S, dP, dV in FP8 and dK, dQ in bf16 (fp8_tokenblock_dsbf16)
        "bwd_ms_bf16": f_bwd / BF16_TFLOPS / 1e9,
        "bwd_ms_dsbf16": (0.6 * f_bwd / FP8_TFLOPS + 0.4 * f_bwd / BF16_TFLOPS) / 1e9,
        "quant_ms_token": quant_token / COPY_TBPS / 1e9,
        "quant_ms_tokenblock": quant_tokenblock / COPY_TBPS / 1e9,
        "quant_ms_default": quant_default / COPY_TBPS / 1e9,
        "bwd_passes_ms": bwd_passes / COPY_TBPS / 1e9,
    }


if __name__ == "__main__":
    wl = json.loads((pathlib.Path(__file__).parent.parent / "flamia_cute" / "workloads.json").read_text())["workloads"]
    print("| workload | tokens | fwd TFLOP | fwd floor fp8 ms | fwd floor bf16 ms | fwd bytes ms | bwd floor fp8 ms "
          "| bwd floor bf16-dS ms | bwd floor bf16 ms | quant floor token ms | quant floor tokenblock ms "
          "| quant floor default training ms | bwd passes floor ms |")
    print("|---" * 13 + "|")
    for name, lengths in wl.items():
        f = floors(lengths)
        print(f"| {name} | {f['T']} | {f['fwd_TFLOP']:.3f} | {f['fwd_ms_fp8']:.3f} | {f['fwd_ms_bf16']:.3f} | "
              f"{f['fwd_mem_ms']:.3f} | {f['bwd_ms_fp8']:.3f} | {f['bwd_ms_dsbf16']:.3f} | {f['bwd_ms_bf16']:.3f} | "
              f"{f['quant_ms_token']:.3f} | "
              f"{f['quant_ms_tokenblock']:.3f} | {f['quant_ms_default']:.3f} | {f['bwd_passes_ms']:.3f} |")
