"""GPU experiment: what Hopper's e4m3 wgmma keeps when it accumulates into an existing accumulator.

Session 14 ruled out the forward without per-tile promotion (O accumulated in the tensor core across
key tiles, FA3's way) on a CPU model (`testing.fp8_mma_truncated`, 14 bits, the accumulator truncated
with the products). This measures the hardware instead, through Triton's e4m3 `tl.dot` (wgmma on
sm_90a), so the model's assumption about the accumulator is checked rather than assumed:

1. probe: one output = C + products, where C (a large value built by earlier products) and the
   products have known exact sums; the share of the small products that survives, per ratio
   |C| / product, gives the bits the chain keeps and whether it truncates or rounds. Two builds:
   "chained" (every k32 wgmma adds into the running accumulator) and "promoted" (each 128-deep
   tile from a zero accumulator, added in fp32 registers: the kernels' way).
2. attention: O = sum over key tiles of P V with e4m3 P in [0, 256] (softmax-like, the kernels' fixed
   P scale) and e4m3 V codes of mean 0 and mean 4, 16k keys, chained against promoted against fp64.

Usage (on the H200): python3 perf/experiments/fp8_accumulation_gpu.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

BM, BN, BK = 64, 64, 128


@triton.jit
def _dot_kernel(a_ptr, bt_ptr, c_ptr, one_ptr, K, PROMOTE: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """c[BM, BN] = a[BM, K] @ bt[BN, K]^T over K in BK tiles; PROMOTE: each tile's product from a zero
    accumulator, added in fp32 (multiplied by a loaded 1.0 so that the compiler cannot fold the add
    back into the dot's accumulator)."""
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    one = tl.load(one_ptr)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :])
        bt = tl.load(bt_ptr + rn[:, None] * K + (k0 + rk)[None, :])
        if PROMOTE:
            acc += tl.dot(a, tl.trans(bt), max_num_imprecise_acc=BK) * one
        else:
            acc = tl.dot(a, tl.trans(bt), acc, max_num_imprecise_acc=BK)
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc)


def fp8_dot(a: torch.Tensor, bt: torch.Tensor, promote: bool) -> torch.Tensor:
    """a (BM, K) e4m3, bt (BN, K) e4m3 -> (BM, BN) fp32 on the tensor cores."""
    assert a.shape[0] == BM and bt.shape[0] == BN and a.shape[1] == bt.shape[1] and a.shape[1] % BK == 0
    c = torch.empty(BM, BN, dtype=torch.float32, device=a.device)
    one = torch.ones(1, dtype=torch.float32, device=a.device)
    _dot_kernel[(1,)](a, bt, c, one, a.shape[1], PROMOTE=promote, BM=BM, BN=BN, BK=BK, num_warps=4)
    return c


def exact(a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    return a.double() @ bt.double().T


def probe(device) -> list[dict]:
    """Row r: C = 2^(2 .. 23) built by products of the first 128-deep tile, then 384 products of 2^e
    (column n: e = 6 - n // 4, so 2^6 down to 2^-9, e4m3's smallest) in three more tiles. What the
    build keeps of the small products, as a share of their exact sum, against log2(C / product)."""
    K = 4 * BK
    a = torch.zeros(BM, K, dtype=torch.float64)
    bt = torch.zeros(BN, K, dtype=torch.float64)
    big_log2 = [2 + (r * 21) // (BM - 1) for r in range(BM)]
    for r, e in enumerate(big_log2):
        if e >= 16:  # 2^(e - 16) products of 2^16 (256 x 256)
            a[r, : 2 ** (e - 16)] = 256.0
        else:  # one product 2^(e - 8) x 256
            a[r, 0] = 2.0 ** (e - 8)
        a[r, BK:] = 1.0
    bt[:, :BK] = 256.0
    small_log2 = [6 - n // 4 for n in range(BN)]
    for n, e in enumerate(small_log2):
        bt[n, BK:] = 2.0**e
    a8 = a.to(torch.float8_e4m3fn)
    b8 = bt.to(torch.float8_e4m3fn)
    assert torch.equal(a8.double(), a) and torch.equal(b8.double(), bt), "probe values must be exact in e4m3"
    ref = exact(a8, b8)
    big = exact(a8[:, :BK], b8[:, :BK])
    rows = []
    for promote in (False, True):
        got = fp8_dot(a8.to(device), b8.to(device), promote).double().cpu()
        kept = (got - big) / (ref - big)
        for r in range(BM):
            if r and big_log2[r] == big_log2[r - 1]:
                continue
            for n in range(0, BN, 4):
                rows.append({"build": "promoted" if promote else "chained", "log2_C": big_log2[r],
                             "log2_product": small_log2[n], "kept_share": float(kept[r, n])})
    return rows


def bits_kept(rows: list[dict], build: str) -> float | None:
    """The largest log2(C / product) at which the chain still keeps >= 99% of the small products."""
    ok = [r["log2_C"] - r["log2_product"] for r in rows if r["build"] == build and r["kept_share"] >= 0.99]
    return max(ok) if ok else None


def attention_like(device, tokens: int = 16384, v_mean: float = 0.0, seed: int = 0) -> dict:
    """O (BM rows) = sum over key tiles of P V: P e4m3 codes of softmax-like weights times 256 (the
    kernels' fixed P scale: values in [0, 256]), V e4m3 codes (per-token scale 1) of N(v_mean, 1) x 16."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(BM, tokens, generator=g, dtype=torch.float64) * 2.0
    p = torch.exp(s - s.amax(1, keepdim=True)) * 256.0
    v = (torch.randn(tokens, BN, generator=g, dtype=torch.float64) + v_mean) * 16.0
    p8 = p.to(torch.float8_e4m3fn)
    vt8 = v.T.contiguous().to(torch.float8_e4m3fn)
    ref = exact(p8, vt8)  # the same e4m3 operands in fp64: only the accumulation differs
    out = {"tokens": tokens, "v_mean": v_mean}
    for promote in (False, True):
        got = fp8_dot(p8.to(device), vt8.to(device), promote).double().cpu()
        err = got - ref
        name = "promoted" if promote else "chained"
        out[f"{name}_rel_l2"] = float(err.norm() / ref.norm())
        out[f"{name}_sqnr_db"] = float(10 * torch.log10(ref.pow(2).sum() / err.pow(2).sum().clamp_min(1e-300)))
        out[f"{name}_bias"] = float(err.mean() / ref.abs().mean())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), "triton", triton.__version__)
    rows = probe(device)
    for build in ("chained", "promoted"):
        print(f"{build}: keeps >= 99% of products up to C / product = 2^{bits_kept(rows, build)}")
        for lc in sorted({r['log2_C'] for r in rows}):
            line = [r for r in rows if r["build"] == build and r["log2_C"] == lc]
            print(f"  C 2^{lc:4.0f}: " + " ".join(f"{r['kept_share']:.3f}@2^{r['log2_product']}" for r in line))
    att = [attention_like(device, v_mean=m) for m in (0.0, 4.0)]
    for a in att:
        print(f"P V over {a['tokens']} keys, V mean {a['v_mean']}: chained rel_l2 {a['chained_rel_l2']:.2e} "
              f"SQNR {a['chained_sqnr_db']:.1f} dB bias {a['chained_bias']:+.2e}; promoted rel_l2 "
              f"{a['promoted_rel_l2']:.2e} SQNR {a['promoted_sqnr_db']:.1f} dB bias {a['promoted_bias']:+.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"probe": rows, "attention": att, "bits_chained": bits_kept(rows, "chained"),
                       "bits_promoted": bits_kept(rows, "promoted")}, f, indent=1)


if __name__ == "__main__":
    main()
