#!/usr/bin/env python3
"""Context parallelism across GPUs (issue 40, part 1): the all-gather form (flamia_cute.distributed) at world
size W, one process per GPU, against world size 1 and against FA4 bf16 inside the same all-gather wrapper.

Per workload (H=16, D=128 on the GPU):
- parity: O, LSE, dQ, dK, dV of the W-rank call (gathered) against the one-process call on the same inputs
  (relative L2; O, LSE and dQ within 2e-3, dK and dV within 1e-2: dK and dV are sums over ranks in bf16);
- leakage across the rank boundary: flamia_cute.testing.check_leakage run through the whole context-parallel
  pipeline, with the cut one token past the first chunk boundary (the perturbed keys on the next rank, the
  compared queries on this one); bit-identity for O and LSE, gradients within 1e-2 (rank sums);
- time per forward+backward call (CUDA events, the median of --reps, the slowest rank), ours and FA4's, each
  at world size W and 1.

    torchrun --nproc-per-node 2 perf/two_gpu_cp.py [--workloads 1x64k,2x32k] [--out DIR]
    torchrun --nproc-per-node 2 perf/two_gpu_cp.py --cpu        # gloo and the emulator on tiny packs (CI)

The GPU run needs the sm_90a kernels for queries that are a sub-range of their keys (backend="cute"
refuses otherwise, naming why). Exit status 1 if a parity bound or a leakage check fails.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flamia_cute import flamia_attn_varlen_func  # noqa: E402
from flamia_cute.distributed import _all_gather, context_parallel_attn, gather_tokens, shard_packed_batch  # noqa: E402
from flamia_cute.testing import attention_fn_for, check_leakage, make_inputs, rel_l2  # noqa: E402

GPU_WORKLOADS = {"1x64k": [65536], "2x32k": [32768, 32768]}
CPU_WORKLOADS = {"1x384": [384], "2x192": [192, 192], "mixed": [100, 37, 200, 47]}
PARITY = {"out": 2e-3, "lse": 2e-3, "dq": 2e-3, "dk": 1e-2, "dv": 1e-2}
GRAD_TOL = 1e-2


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def ours_cp(shard, recipe, backend, scale):
    """fn(q, k, v, cu, dout) -> the global results of the W-rank call (check_leakage's form)."""
    def fn(q, k, v, cu, dout=None):
        ql, kl, vl = (shard.take(t).detach().requires_grad_(dout is not None) for t in (q, k, v))
        out, lse = context_parallel_attn(ql, kl, vl, shard, softmax_scale=scale, recipe=recipe, backend=backend,
                                         return_lse=True)
        res = {"out": gather_tokens(out.detach(), shard), "lse": gather_tokens(lse.detach().t().contiguous(), shard).t()}
        if dout is not None:
            grads = torch.autograd.grad(out, (ql, kl, vl), shard.take(dout))
            for name, g in zip(("dq", "dk", "dv"), grads, strict=True):
                res[name] = gather_tokens(g, shard)
        return res
    return fn


def fa4_call(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    from flash_attn.cute import flash_attn_varlen_func

    res = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                 max_seqlen_k=max_k, softmax_scale=scale, causal=True)
    return res[0] if isinstance(res, tuple) else res


def fa4_cp_step(shard, scale):
    """FA4 bf16 in the same all-gather wrapper as context_parallel_attn: one K/V all-gather, the key ranges
    by index, FA4's varlen call (its causal mask is aligned to the end of each query range, as ours)."""
    def step(ql, kl, vl, dout_l):
        d = kl.shape[-1]
        kv = _all_gather(torch.cat([kl, vl], dim=-1), dist.group.WORLD).index_select(0, shard.kv_index)
        out = fa4_call(ql, kv[..., :d], kv[..., d:], shard.cu_seqlens_q, shard.cu_seqlens_k, shard.max_seqlen_q,
                       shard.max_seqlen_k, scale)
        out.backward(dout_l)
    return step


def timed_ms(step, reps, device):
    """Median ms of step() over reps calls after two warm-ups; the slowest rank's median."""
    for _ in range(2):
        step()
    times = []
    for _ in range(reps):
        dist.barrier()
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    med = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return med.item()


def run_workload(name, lengths, args, device, backend, heads, head_dim):
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, do, cu, scale = make_inputs(lengths, heads, heads, head_dim, seed=7, device=device)
    cu = cu.to(device)
    shard = shard_packed_batch(cu, world, rank, device=device)
    cp = ours_cp(shard, args.recipe, backend, scale)
    ws1 = attention_fn_for(args.recipe, scale, backend=backend)  # the one-process call
    got, ref = cp(q, k, v, cu, do), ws1(q, k, v, cu, do)
    row = {"workload": name, "world_size": world, "tokens": sum(lengths), "recipe": args.recipe}
    failed = []
    for out_name, bound in PARITY.items():
        err = rel_l2(got[out_name].float(), ref[out_name].float())
        row[f"{out_name}_vs_ws1"] = err
        if not err <= bound:
            failed.append(f"{out_name} differs from world size 1 by {err:.3e} (bound {bound:g})")
    # the cut one token past the first chunk boundary inside the longest document
    doc = max(range(len(lengths)), key=lambda i: lengths[i])
    start, chunk = sum(lengths[:doc]), sum(lengths) // (2 * world)
    boundary = (start // chunk + 1) * chunk
    cut = boundary - start + 1 if boundary - start + 1 < lengths[doc] else None
    row["leak_cut"] = cut
    report = check_leakage(cp, q, k, v, cu, do, doc=doc, cut=cut, grad_tol=GRAD_TOL)
    row["leakage"] = "ok" if report.ok else "LEAKS"
    if not report.ok:
        failed.append(f"leakage: {report}")
    if not args.no_timing:
        ql, kl, vl, dl = (shard.take(t).detach().requires_grad_(t is not do) for t in (q, k, v, do))

        def step_ours():
            out = context_parallel_attn(ql, kl, vl, shard, softmax_scale=scale, recipe=args.recipe, backend=backend)
            out.backward(dl)

        n = max(lengths)
        qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))

        def step_ours_ws1():
            flamia_attn_varlen_func(qf, kf, vf, cu, cu, n, n, scale, True, recipe=args.recipe,
                                    backend=backend).backward(do)

        row["ours_ms"] = timed_ms(step_ours, args.reps, device)
        row["ours_ws1_ms"] = timed_ms(step_ours_ws1, args.reps, device)
        if args.fa4:
            fa4 = fa4_cp_step(shard, scale)
            row["fa4_ms"] = timed_ms(lambda: fa4(ql, kl, vl, dl), args.reps, device)
            row["fa4_ws1_ms"] = timed_ms(
                lambda: fa4_call(qf, kf, vf, cu, cu, n, n, scale).backward(do), args.reps, device)
            row["speedup_vs_fa4"] = row["fa4_ms"] / row["ours_ms"]
    row["ok"] = not failed
    log(json.dumps(row))
    for f in failed:
        log(f"FAIL {name}: {f}")
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=None, help="comma list (GPU: 1x64k,2x32k; --cpu: 1x384,2x192,mixed)")
    ap.add_argument("--cpu", action="store_true", help="gloo and the emulator on tiny packs (H=2, D=64)")
    ap.add_argument("--recipe", default="fp8_tokenblock_dsbf16", help="a leaky control (fp8_tensor_current) must fail")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="where the CSV goes (rank 0)")
    args = ap.parse_args()
    cpu = args.cpu or not torch.cuda.is_available()
    dist.init_process_group("gloo" if cpu else "nccl")
    rank = dist.get_rank()
    if cpu:
        device, backend, heads, head_dim, table = torch.device("cpu"), "emulate", 2, 64, CPU_WORKLOADS
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        backend, heads, head_dim, table = "cute", 16, 128, GPU_WORKLOADS
    from flamia_cute.baselines.torch_impls import fa4_available

    args.fa4 = not cpu and fa4_available()
    names = args.workloads.split(",") if args.workloads else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"--workloads: unknown {unknown}; known here: {list(table)}")
    log(f"world size {dist.get_world_size()}, backend {'gloo' if cpu else 'nccl'}, attention backend {backend}, "
        f"recipe {args.recipe}, FA4 {'yes' if args.fa4 else 'no'}, H={heads}, D={head_dim}")
    rows = [run_workload(n, table[n], args, device, backend, heads, head_dim) for n in names]
    if rank == 0 and args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = Path(args.out) / "two_gpu_cp.csv"
        keys = sorted({k for r in rows for k in r})
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        log(f"wrote {path}")
    ok = all(r["ok"] for r in rows)
    log("ALL OK" if ok else "FAILED")
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
