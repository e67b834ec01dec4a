"""The integration paths on one H200 against a direct flamia_attn_varlen_func call, 1x16k (H=16, D=128, causal).

    python perf/integration_gpu.py --out DIR     # default: $OUT, else perf/out/integration

1. Bit-identity: out and LSE of every path equal the direct call's; with the deterministic backward
   (FLAMIA_CUTE_DETERMINISTIC=1) dq, dk, dv too. Paths: varlen_attn and SDPA through FLAMIA_FP8, the Hugging
   Face function (flamia_cute.hf), context parallelism at world size 1.
2. Time: forward and forward+backward of each path, eager, rounds rotated over the paths (docs/power.md), the
   median ms per call and its ratio to the direct call (the issue's bar: within 3% for varlen_attn and HF).
3. train --fsdp --compile at world size 1 (torchrun-style env, one rank), 20 steps of the tiny model on 16k tokens.

Writes DIR/integration.csv (path, mode, median ms, ratio, identical), DIR/integration.log and DIR/train/.
"""

from __future__ import annotations

import argparse
import csv
import os
import socket
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

T, H, D = 16384, 16, 128


def paths(q, k, v, cu):
    """name -> fn(q, k, v) returning (out (T, H, D), lse (H, T) or None), all on the same (T, H, D) tensors."""
    import torch.nn.functional as F
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    import flamia_cute.hf as fhf
    from flamia_cute import flamia_attn_varlen_func
    from flamia_cute.distributed import context_parallel_attn, shard_packed_batch

    causal_kw = {"window_size": (-1, 0)} if "window_size" in varlen_attn.__code__.co_varnames else {"is_causal": True}
    hf_fn = fhf.attention_function()
    shard = shard_packed_batch(cu, 1, 0)

    class Module:
        is_causal = True

    def direct(q, k, v):
        return flamia_attn_varlen_func(q, k, v, cu, cu, T, T, return_lse=True)

    def varlen(q, k, v):
        return varlen_attn(q, k, v, cu, cu, T, T, return_aux=AuxRequest(lse=True), **causal_kw)

    def hf(q, k, v):  # the model's layout: (1, H, T, D) views of (T, H, D) memory
        out, _ = hf_fn(Module(), *(t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)), None,
                       cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=T, max_length_k=T)
        return out[0], None

    def sdpa(q, k, v):
        # on an H200 torch picks cuDNN's attention over the flash path (which FLAMIA_FP8 replaces) unless told
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(*(t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)),
                                                 is_causal=True)
        return out.transpose(1, 2)[0], None

    def cp_ws1(q, k, v):
        return context_parallel_attn(q, k, v, shard, return_lse=True)

    return {"direct": direct, "varlen_attn": varlen, "hf": hf, "sdpa": sdpa, "cp_ws1": cp_ws1}


def run_path(fn, q, k, v, do, backward: bool):
    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
    out, lse = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, do) if backward else ()
    return out, lse, grads


def identity(fns, q, k, v, do, log):
    """{path: True when out, LSE and (deterministic) grads equal the direct call's}"""
    os.environ["FLAMIA_CUTE_DETERMINISTIC"] = "1"
    try:
        want = run_path(fns["direct"], q, k, v, do, True)
        same = {}
        for name, fn in fns.items():
            got = run_path(fn, q, k, v, do, True)
            checks = [torch.equal(got[0], want[0]), got[1] is None or torch.equal(got[1], want[1])]
            checks += [torch.equal(a, b) for a, b in zip(got[2], want[2], strict=True)]
            same[name] = all(checks)
            log(f"identity {name}: {'bit-identical' if same[name] else 'DIFFERS ' + str(checks)}")
    finally:
        os.environ.pop("FLAMIA_CUTE_DETERMINISTIC")
    return same


def timing(fns, q, k, v, do, backward: bool, rounds: int, iters: int):
    """{path: [ms per call of each round]}, rounds rotated over the paths."""
    names = list(fns)
    for name in names:  # warm-up: compiles, plans, memos
        for _ in range(3):
            run_path(fns[name], q, k, v, do, backward)
    torch.cuda.synchronize()
    ms = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                run_path(fns[name], q, k, v, do, backward)
            end.record()
            end.synchronize()
            ms[name].append(start.elapsed_time(end) / iters)
    return ms


def train_ws1(out_dir, log):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    cmd = [sys.executable, "-m", "train.run", "--preset", "tiny", "--steps", "20", "--tokens-per-step", "16384",
           "--eval-every", "0", "--eval-batches", "1", "--leak-samples", "0", "--log-every", "5", "--fsdp",
           "--compile", "--out", os.path.join(out_dir, "train"), "--run-name", "fsdp-compile-ws1"]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         capture_output=True, text=True)
    log(f"train --fsdp --compile ws1: rc {res.returncode} in {time.perf_counter() - t0:.0f} s\n{res.stdout}"
        + (res.stderr[-4000:] if res.returncode else ""))
    return res.returncode


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "perf/out/integration")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--skip-train", action="store_true")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    log_fh = open(os.path.join(args.out, "integration.log"), "w")

    def log(msg):
        print(msg, flush=True)
        log_fh.write(msg + "\n")
        log_fh.flush()

    import flamia_cute.torch_backend as tb
    from flamia_cute.testing import cu_seqlens_from_lengths

    tb.activate()
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, 1x16k: T={T} H={H} D={D}, causal, bf16")
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(T, H, D, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
    cu = cu_seqlens_from_lengths([T], "cuda")
    fns = paths(q, k, v, cu)
    same = identity(fns, q, k, v, do, log)
    rows = []
    for backward in (False, True):
        mode = "fwdbwd" if backward else "fwd"
        ms = timing(fns, q, k, v, do, backward, args.rounds, args.iters)
        base = statistics.median(ms["direct"])
        for name, vals in ms.items():
            med = statistics.median(vals)
            rows.append({"path": name, "mode": mode, "median_ms": f"{med:.4f}", "ratio_to_direct": f"{med / base:.4f}",
                         "rounds_ms": " ".join(f"{x:.4f}" for x in vals), "bit_identical": same[name]})
            log(f"{mode:7s} {name:12s} {med:8.4f} ms  x{med / base:.4f} of direct")
    with open(os.path.join(args.out, "integration.csv"), "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    torch.nn.attention.restore_flash_attention_impl()
    rc = 0 if args.skip_train else train_ws1(args.out, log)
    bar = [r for r in rows if r["path"] in ("varlen_attn", "hf")]
    ok = all(same.values()) and all(float(r["ratio_to_direct"]) <= 1.03 for r in bar) and rc == 0
    log(f"verdict: {'PASS' if ok else 'FAIL'} (bit-identical paths, varlen_attn and hf within 3% of direct, train rc 0)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
