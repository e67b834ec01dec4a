"""GPU experiment: what Hopper's e4m3 wgmma keeps when a chain of instructions accumulates.

The kernels promote every 128-key P V tile into fp32 because the tensor core's running accumulator
is truncated; `testing.fp8_mma_truncated` models that at 14 bits. This measures the hardware through
Triton's e4m3 `tl.dot` (wgmma on sm_90a). Triton chains a dot's k32 instructions through one
accumulator until `max_num_imprecise_acc` products have been summed, then adds that partial sum into
the dot's fp32 accumulator (a separate add); so the builds are:

- "k32": max_num_imprecise_acc = 32: every instruction's result added in fp32 (no chain);
- "chain128": 128-deep dots, each one chain of 4 instructions, added in fp32 (the kernels' per-tile
  promotion);
- "chain512": 512-deep dots, one chain of 16 instructions;
- "default": Triton's default for e4m3 (printed), the loop's accumulator passed to every dot.

1. probe: a row's first instruction builds C = 2^2..2^21 from large products, the next 15
   instructions add 480 small products 2^6..2^-9 (one size per column); the share of the small
   products that survives, against log2(C / product), shows whether the chain truncates C with them.
2. within: one instruction of one product 2^e and 31 products 2^s: the alignment inside an
   instruction (the model's 14 bits).
3. attention: O = P V over 16k keys with e4m3 P in [0, 256] (softmax-like weights times the kernels'
   fixed P scale) and e4m3 V codes of mean 0 and mean 4 (x 16), each build against fp64 of the same
   operands.

Usage (on the H200): python3 perf/fp8_accumulation_gpu.py [--out FILE.json]
Results and their reading: docs/numerics.md.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

BM, BN = 64, 64
BUILDS = {"k32": (512, 32), "chain128": (128, 128), "chain512": (512, 512), "default": (128, -1)}


@triton.jit
def _dot_kernel(a_ptr, bt_ptr, c_ptr, K, BK: tl.constexpr, MAXACC: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr):
    """c[BM, BN] = a[BM, K] @ bt[BN, K]^T in BK-deep dots, each `tl.dot(a, b, acc)`; MAXACC < 0: the
    dot's default max_num_imprecise_acc."""
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :])
        bt = tl.load(bt_ptr + rn[:, None] * K + (k0 + rk)[None, :])
        if MAXACC < 0:
            acc = tl.dot(a, tl.trans(bt), acc)
        else:
            acc = tl.dot(a, tl.trans(bt), acc, max_num_imprecise_acc=MAXACC)
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc)


def fp8_dot(a: torch.Tensor, bt: torch.Tensor, build: str) -> torch.Tensor:
    """a (BM, K) e4m3, bt (BN, K) e4m3 -> (BM, BN) fp32 on the tensor cores, as `build` accumulates."""
    bk, maxacc = BUILDS[build]
    assert a.shape[0] == BM and bt.shape[0] == BN and a.shape[1] == bt.shape[1] and a.shape[1] % bk == 0
    c = torch.empty(BM, BN, dtype=torch.float32, device=a.device)
    _dot_kernel[(1,)](a, bt, c, a.shape[1], BK=bk, MAXACC=maxacc, BM=BM, BN=BN, num_warps=4, num_stages=1)
    return c


def model_dot(a: torch.Tensor, bt: torch.Tensor, build: str, bits: int = 14) -> torch.Tensor:
    """fp8_dot as the tests' error model has it (testing.fp8_mma_truncated: each chain starts from
    zero, its accumulator truncated with every instruction's products; chains added exactly)."""
    from flamia_cute.testing import fp8_mma_truncated

    a, b = a.cpu().float(), bt.cpu().float().T
    maxacc = BUILDS[build][1]
    chain = maxacc if maxacc > 0 else a.shape[1]  # the default chains the whole reduction
    return sum(fp8_mma_truncated(a[:, k : k + chain], b[k : k + chain], bits).double()
               for k in range(0, a.shape[1], chain)).float()


def exact(a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    return a.cpu().double() @ bt.cpu().double().T


def _e4m3(x: torch.Tensor, device) -> torch.Tensor:
    y = x.to(torch.float8_e4m3fn)
    assert torch.equal(y.double(), x), "probe values must be exact in e4m3"
    return y.to(device)


def probe(device) -> list[dict]:
    """C = 2^e from the first instruction (e = 2..21: one product 2^(e-8) x 256, or 2^(e-16) products
    of 256 x 256), then 480 products of 2^s in instructions 2-16 (column n: s = 6 - n // 4)."""
    K = 512
    a = torch.zeros(BM, K, dtype=torch.float64)
    bt = torch.zeros(BN, K, dtype=torch.float64)
    big_log2 = [2 + (r * 19) // (BM - 1) for r in range(BM)]
    for r, e in enumerate(big_log2):
        if e >= 16:
            a[r, : 2 ** (e - 16)] = 256.0
        else:
            a[r, 0] = 2.0 ** (e - 8)
        a[r, 32:] = 1.0
    bt[:, :32] = 256.0
    small_log2 = [6 - n // 4 for n in range(BN)]
    for n, s in enumerate(small_log2):
        bt[n, 32:] = 2.0**s
    a8, b8 = _e4m3(a, device), _e4m3(bt, device)
    ref = exact(a8, b8)
    big = exact(a8[:, :32], b8[:, :32])
    rows = []
    for build in BUILDS:
        kept = (fp8_dot(a8, b8, build).double().cpu() - big) / (ref - big)
        for r in range(BM):
            if r and big_log2[r] == big_log2[r - 1]:
                continue
            for n in range(0, BN, 4):
                rows.append({"build": build, "log2_C": big_log2[r], "log2_product": small_log2[n],
                             "kept_share": float(kept[r, n])})
    return rows


def within(device) -> list[dict]:
    """One instruction (k 0..31): row r one product 2^e (e = 2..16) and 31 products 2^s (column n:
    s = 6 - n // 4); the rest of K zero. What survives of the 31, against log2(2^e / 2^s)."""
    K = 512
    a = torch.zeros(BM, K, dtype=torch.float64)
    bt = torch.zeros(BN, K, dtype=torch.float64)
    big_log2 = [2 + (r * 14) // (BM - 1) for r in range(BM)]
    for r, e in enumerate(big_log2):
        a[r, 0] = 2.0 ** (e - 8)
        a[r, 1:32] = 1.0
    bt[:, 0] = 256.0
    small_log2 = [6 - n // 4 for n in range(BN)]
    for n, s in enumerate(small_log2):
        bt[n, 1:32] = 2.0**s
    a8, b8 = _e4m3(a, device), _e4m3(bt, device)
    ref = exact(a8, b8)
    big = exact(a8[:, :1], b8[:, :1])
    kept = (fp8_dot(a8, b8, "k32").double().cpu() - big) / (ref - big)
    return [{"log2_big": big_log2[r], "log2_product": small_log2[n], "kept_share": float(kept[r, n])}
            for r in range(BM) if not r or big_log2[r] != big_log2[r - 1] for n in range(0, BN, 4)]


def bits_kept(rows: list[dict], build: str | None = None, big: str = "log2_C") -> float | None:
    """The largest log2(big / product) at which >= 99% of the small products survive."""
    ok = [r[big] - r["log2_product"] for r in rows if (build is None or r["build"] == build) and r["kept_share"] >= 0.99]
    return max(ok) if ok else None


def attention_like(device, tokens: int = 16384, v_mean: float = 0.0, seed: int = 0, dot=None) -> dict:
    """dot: fp8_dot (default) or model_dot (the same operands through the error model)."""
    dot = dot or fp8_dot
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(BM, tokens, generator=g, dtype=torch.float64) * 2.0
    p = torch.exp(s - s.amax(1, keepdim=True)) * 256.0
    v = (torch.randn(tokens, BN, generator=g, dtype=torch.float64) + v_mean) * 16.0
    p8 = p.to(torch.float8_e4m3fn).to(device)
    vt8 = v.T.contiguous().to(torch.float8_e4m3fn).to(device)
    ref = exact(p8, vt8)  # the same e4m3 operands in fp64: only the accumulation differs
    out = {"tokens": tokens, "v_mean": v_mean}
    for build in BUILDS:
        err = dot(p8, vt8, build).double().cpu() - ref
        out[build] = {"rel_l2": float(err.norm() / ref.norm()),
                      "sqnr_db": float(10 * torch.log10(ref.pow(2).sum() / err.pow(2).sum().clamp_min(1e-300))),
                      "bias": float(err.mean() / ref.abs().mean())}
    return out


def _triton_fp8_default() -> object:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        return CUDAOptions().max_num_imprecise_acc_default
    except Exception as e:  # pragma: no cover - depends on the Triton version
        return f"unknown ({e!r})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), "triton", triton.__version__,
          "max_num_imprecise_acc_default", _triton_fp8_default())
    rows = probe(device)
    for build in BUILDS:
        print(f"probe {build}: >= 99% of the small products kept up to C / product = 2^{bits_kept(rows, build)}")
        for lc in sorted({r['log2_C'] for r in rows}):
            line = [r for r in rows if r["build"] == build and r["log2_C"] == lc]
            print(f"  C 2^{lc:3d}: " + " ".join(f"{r['kept_share']:.2f}" for r in line)
                  + f"   (products 2^{line[0]['log2_product']} .. 2^{line[-1]['log2_product']})")
    win = within(device)
    print(f"within one instruction: >= 99% kept up to big / product = 2^{bits_kept(win, big='log2_big')}")
    for lb in sorted({r['log2_big'] for r in win}):
        line = [r for r in win if r["log2_big"] == lb]
        print(f"  big 2^{lb:3d}: " + " ".join(f"{r['kept_share']:.2f}" for r in line))
    att = [attention_like(device, v_mean=m) for m in (0.0, 4.0)]
    for a in att:
        print(f"P V over {a['tokens']} keys, V mean {a['v_mean']}: " + "; ".join(
            f"{b} rel_l2 {a[b]['rel_l2']:.2e} SQNR {a[b]['sqnr_db']:.1f} dB bias {a[b]['bias']:+.2e}" for b in BUILDS))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"triton_default": str(_triton_fp8_default()), "probe": rows, "within": win, "attention": att,
                       "bits": {b: bits_kept(rows, b) for b in BUILDS},
                       "bits_within": bits_kept(win, big="log2_big")}, f, indent=1)


if __name__ == "__main__":
    main()
