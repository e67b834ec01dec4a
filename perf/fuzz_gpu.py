"""GPU fuzz: the sm_90a kernels against the emulator on random packs (the public API both sides).

Each pack draws its document lengths from a heavy-tailed (log-uniform) law on 1..16,384 tokens, a
few at exactly 16,384 (a packer's cut), some packs of short documents only (the short-pair
builds), up to MAX_TOKENS per pack, with an empty document now and then; the head configs of
flamia_cute/workloads.json (16/16 and 32/8 at head dim 128, 32/32 at 64) in turn, each both as a
training call (O, LSE, dQ, dK, dV) and under no_grad (O, LSE). Inputs N(0, 1). The emulator runs on
the GPU too, a group of KV heads at a time where a pack's score matrices would not fit (the heads
are independent, so the reference is the same).

Bounds (the kernel-vs-emulator tests' derived tolerances): O relative L2 < 8e-3 over the pack
(tests/test_cute_backend.py), and per document < 1.5e-2 with max |O - O_emu| < 5e-2 of the
document's max |O_emu| (tests/test_attention_fwd_kernel.py, TOLERANCES); LSE within 4e-3 where
finite and -inf at the same rows; dQ, dK, dV relative L2 < 2e-2 over the pack (test_cute_backend)
and < 3e-2 per document of 16 tokens or more (tests/test_attention_bwd_dsbf16_kernel.py: twice
GRAD_REL_L2_TOL); no NaN or Inf anywhere. Each pack's seed is printed when it fails; replay it
with --seed SEED --only INDEX.

    python perf/fuzz_gpu.py --out DIR            # 320 packs, fuzz.csv and fuzz.log in DIR

Expected time on one H200: ~1-2 min for the packs after the kernels are compiled (about 30 builds,
compiled ahead on all cores: ~20-40 s from a cold cache, seconds from a warm one).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import pathlib
import random
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

MAX_DOC = 16384
MAX_TOKENS = 32768
MAX_DOCS = 256
DEFAULT_PACKS = 320
RECIPE = "fp8_tokenblock_dsbf16"

# the derived bounds (see the module docstring for where each comes from)
O_REL_L2 = 8e-3
O_DOC_REL_L2 = 1.5e-2
O_DOC_MAX_ABS = 5e-2
LSE_ABS = 4e-3
GRAD_REL_L2 = 2e-2
GRAD_DOC_REL_L2 = 3e-2
GRAD_DOC_MIN_TOKENS = 16
BOUNDS = {"o_rel": O_REL_L2, "o_doc_rel": O_DOC_REL_L2, "o_doc_max_abs": O_DOC_MAX_ABS, "lse_abs": LSE_ABS,
          **{f"d{x}_rel": GRAD_REL_L2 for x in "qkv"}, **{f"d{x}_doc_rel": GRAD_DOC_REL_L2 for x in "qkv"}}


def head_configs() -> dict[str, tuple[int, int, int]]:
    from flamia_cute.bench import DEFAULT_WORKLOADS

    cfgs = json.loads(pathlib.Path(DEFAULT_WORKLOADS).read_text())["head_configs"]
    return {n: (c["heads_q"], c["heads_kv"], c["head_dim"]) for n, c in cfgs.items()}


def pack_seed(seed: int, index: int) -> int:
    return seed * 1_000_003 + index


def draw_lengths(rng: random.Random, max_tokens: int = MAX_TOKENS, max_doc: int = MAX_DOC,
                 max_docs: int = MAX_DOCS) -> list[int]:
    """Document lengths of one pack: a token target log-uniform on 16..max_tokens, filled with lengths
    log-uniform on 1..max_doc (5% exactly max_doc), or with 10% probability on 1..256 only (packs of
    short documents); the last one cut to the target; 2% empty documents."""
    target = int(math.exp(rng.uniform(math.log(16), math.log(max_tokens))))
    short_only = rng.random() < 0.1
    top = 256 if short_only else max_doc
    lengths, total = [], 0
    while total < target and len(lengths) < max_docs:
        if rng.random() < 0.02:
            lengths.append(0)
            continue
        n = top if (not short_only and rng.random() < 0.05) else int(math.exp(rng.uniform(0.0, math.log(top + 1))))
        n = max(1, min(n, top, target - total))
        lengths.append(n)
        total += n
    if total == 0:
        lengths.append(1)
    return lengths


def pack_spec(seed: int, index: int, configs: dict) -> dict:
    """Pack `index` of run `seed`: head configs in turn, training and no_grad alternating per round."""
    names = sorted(configs)
    rng = random.Random(pack_seed(seed, index))
    return {"index": index, "seed": pack_seed(seed, index), "heads": names[index % len(names)],
            "train": (index // len(names)) % 2 == 0, "lengths": draw_lengths(rng)}


# ----------------------------------------------------------------------------- errors


def _doc_ids(lengths, device):
    import torch

    return torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                   torch.tensor(lengths, device=device))


def doc_errors(got, ref, lengths, min_tokens: int = 1) -> tuple[float, float, float]:
    """(relative L2 over the pack, worst per-document relative L2, worst per-document max abs error over
    the document's max |ref|), for (T, ...) tensors; documents under min_tokens (or empty, or with a
    zero reference) are left out of the per-document figures."""
    import torch

    g, r = got.double().flatten(1), ref.double().flatten(1)
    err2, ref2 = (g - r).pow(2).sum(1), r.pow(2).sum(1)
    whole = float(err2.sum().sqrt() / ref2.sum().sqrt().clamp_min(1e-300))
    n = len(lengths)
    ids = _doc_ids(lengths, got.device)
    e_doc = torch.zeros(n, dtype=torch.float64, device=got.device).index_add_(0, ids, err2)
    r_doc = torch.zeros(n, dtype=torch.float64, device=got.device).index_add_(0, ids, ref2)
    amax_err = torch.zeros(n, dtype=torch.float64, device=got.device).scatter_reduce_(
        0, ids, (g - r).abs().amax(1), "amax")
    amax_ref = torch.zeros(n, dtype=torch.float64, device=got.device).scatter_reduce_(0, ids, r.abs().amax(1), "amax")
    keep = (torch.tensor(lengths, device=got.device) >= min_tokens) & (r_doc > 0)
    if not bool(keep.any()):
        return whole, 0.0, 0.0
    rel = (e_doc[keep] / r_doc[keep]).sqrt().max()
    mabs = (amax_err[keep] / amax_ref[keep]).max()
    return whole, float(rel), float(mabs)


def compare(got: dict, ref: dict, lengths) -> tuple[dict, list[str]]:
    """Error figures of the kernels' results against the emulator's, and the bounds they break."""
    import torch

    row, bad = {}, []
    for name, t in got.items():
        n = int((~torch.isfinite(t.float())).sum())
        if n:
            bad.append(f"{name}: {n} non-finite values")
    row["o_rel"], row["o_doc_rel"], row["o_doc_max_abs"] = doc_errors(got["out"], ref["out"], lengths)
    lse, lse_ref = got["lse"], ref["lse"]
    fin = torch.isfinite(lse_ref)
    if not torch.equal(torch.isinf(lse), torch.isinf(lse_ref)):
        bad.append("lse: -inf at other rows than the emulator's")
    row["lse_abs"] = float((lse[fin] - lse_ref[fin]).abs().max()) if bool(fin.any()) else 0.0
    if "dq" in got:
        for x in "qkv":
            whole, doc, _ = doc_errors(got[f"d{x}"], ref[f"d{x}"], lengths, GRAD_DOC_MIN_TOKENS)
            row[f"d{x}_rel"], row[f"d{x}_doc_rel"] = whole, doc
    for key, bound in BOUNDS.items():
        if key in row and not row[key] < bound:  # NaN fails too
            bad.append(f"{key} {row[key]:.3e} >= {bound:.1e}")
    return row, bad


# ----------------------------------------------------------------------------- the calls


def run_attention(q, k, v, do, cu, mx, scale, train: bool, backend: str) -> dict:
    import torch

    from flamia_cute import flamia_attn_varlen_func

    if not train:
        with torch.no_grad():
            out, lse = flamia_attn_varlen_func(q, k, v, cu, cu, mx, mx, scale, recipe=RECIPE, backend=backend,
                                               return_lse=True)
        return {"out": out, "lse": lse}
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = flamia_attn_varlen_func(*leaves, cu, cu, mx, mx, scale, recipe=RECIPE, backend=backend,
                                       return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, leaves, do)
    return {"out": out.detach(), "lse": lse, "dq": dq, "dk": dk, "dv": dv}


# live (heads, L, L) fp32 score-sized tensors at the emulator's peak (its backward holds ~10)
EMU_SCORE_COPIES = {True: 12, False: 5}


def emulator_heads_per_chunk(heads_q: int, heads_kv: int, max_len: int, train: bool, budget_bytes: float) -> int:
    """Query heads per emulator call: whole KV-head groups (dV's fold reference spans a group) whose
    score matrices fit in budget_bytes; at least one group."""
    group = heads_q // heads_kv
    per_head = EMU_SCORE_COPIES[train] * 4.0 * max_len * max_len
    groups = max(1, min(heads_kv, int(budget_bytes // (per_head * group))))
    return groups * group


def emulator_reference(q, k, v, do, cu, mx, scale, train: bool, budget_bytes: float) -> dict:
    """The emulator's results, computed a chunk of heads at a time (emulator_heads_per_chunk)."""
    import torch

    H, Hk = q.shape[1], k.shape[1]
    group = H // Hk
    step = emulator_heads_per_chunk(H, Hk, mx, train, budget_bytes)
    parts = []
    for h0 in range(0, H, step):
        h1 = min(H, h0 + step)
        kv = slice(h0 // group, h1 // group)
        parts.append(run_attention(q[:, h0:h1], k[:, kv], v[:, kv], do[:, h0:h1] if do is not None else None,
                                   cu, mx, scale, train, "emulate"))
    out = {}
    for name in parts[0]:
        dim = 0 if name == "lse" else 1
        out[name] = torch.cat([p[name] for p in parts], dim) if len(parts) > 1 else parts[0][name]
    return out


def run_pack(spec: dict, configs: dict, budget_bytes: float) -> tuple[dict, list[str]]:
    import torch

    from flamia_cute.testing import cu_seqlens_from_lengths

    H, Hk, D = configs[spec["heads"]]
    lengths = spec["lengths"]
    T, mx = sum(lengths), max(lengths)
    g = torch.Generator(device="cuda").manual_seed(spec["seed"])
    mk = lambda h: torch.randn(T, h, D, device="cuda", generator=g).to(torch.bfloat16)
    q, k, v, do = mk(H), mk(Hk), mk(Hk), mk(H)
    cu = cu_seqlens_from_lengths(lengths, "cuda")
    scale = 1.0 / math.sqrt(D)
    t0 = time.perf_counter()
    got = run_attention(q, k, v, do, cu, mx, scale, spec["train"], "cute")
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    ref = emulator_reference(q, k, v, do, cu, mx, scale, spec["train"], budget_bytes)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    row, bad = compare(got, ref, lengths)
    del got, ref
    if mx >= 4096:  # the emulator's score matrices: hand them back before the next pack's sizes
        torch.cuda.empty_cache()
    row.update(kernel_s=round(t1 - t0, 4), emulator_s=round(t2 - t1, 4))
    return row, bad


# a model of the emulator's GPU time, from its score-matrix work and its per-document Python loop (the
# kernels' time is negligible next to it): --list prints the run's total, to size --packs
EMU_S_PER_SCORE = {True: 1.6e-10, False: 0.6e-10}
EMU_S_PER_DOC = {True: 1.5e-3, False: 0.6e-3}
EMU_S_PER_PACK = 0.03


def estimated_seconds(spec: dict, configs: dict) -> float:
    H = configs[spec["heads"]][0]
    t = spec["train"]
    return (EMU_S_PER_SCORE[t] * H * sum(n * n for n in spec["lengths"]) + EMU_S_PER_DOC[t] * len(spec["lengths"])
            + EMU_S_PER_PACK)


CSV_FIELDS = ("index", "seed", "heads", "mode", "docs", "tokens", "max_len", *BOUNDS, "kernel_s", "emulator_s",
              "ok", "violations")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--packs", type=int, default=DEFAULT_PACKS, help=f"number of packs (default {DEFAULT_PACKS})")
    ap.add_argument("--seed", type=int, default=None, help="run seed (default: fresh, printed)")
    ap.add_argument("--only", default="", help="comma-separated pack indices to run (replay a failure)")
    ap.add_argument("--out", default=os.environ.get("OUT", "perf/results/fuzz"), help="output folder (default $OUT)")
    ap.add_argument("--compile-workers", type=int, default=None, help="processes compiling the kernels ahead")
    ap.add_argument("--list", action="store_true", help="print the packs and the kernels they need (no GPU)")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(3), "little")
    configs = head_configs()
    indices = [int(i) for i in args.only.split(",") if i] or list(range(args.packs))
    specs = [pack_spec(seed, i, configs) for i in indices]
    from kernel_warmup import spec_kernels

    kernels = set().union(*spec_kernels(RECIPE, specs, configs))
    if args.list:
        for s in specs:
            print(s["index"], s["heads"], "train" if s["train"] else "no_grad", len(s["lengths"]), sum(s["lengths"]),
                  max(s["lengths"]))
        est = sum(estimated_seconds(s, configs) for s in specs)
        print(f"seed {seed}: {len(specs)} packs, {len(kernels)} kernels, ~{est:.0f} s of emulator time (a model)")
        return 0
    import torch

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("fuzz_gpu: needs an sm_90 GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the emulator's products in full fp32
    torch.backends.cudnn.allow_tf32 = False
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_fh = open(out_dir / "fuzz.log", "w")

    def log(msg):
        print(msg, flush=True)
        log_fh.write(msg + "\n")
        log_fh.flush()

    log(f"fuzz_gpu: seed {seed}, {len(specs)} packs, recipe {RECIPE}, {torch.cuda.get_device_name()}")
    from kernel_warmup import compile_ahead

    compile_s = compile_ahead(kernels, args.compile_workers, log)
    t_start = time.time()
    failures, worst = [], {}
    with open(out_dir / "fuzz.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for s in specs:
            free, _ = torch.cuda.mem_get_info()
            lens = s["lengths"]
            try:
                row, bad = run_pack(s, configs, 0.6 * free)
            except Exception as e:  # a crash is a failure of this pack, reported with its seed
                row, bad = {}, [f"{type(e).__name__}: {e}"[:400]]
            row.update(index=s["index"], seed=s["seed"], heads=s["heads"], mode="train" if s["train"] else "no_grad",
                       docs=len(lens), tokens=sum(lens), max_len=max(lens), ok=not bad, violations="; ".join(bad))
            writer.writerow({k: (f"{v:.3e}" if isinstance(v, float) and k in BOUNDS else v) for k, v in row.items()})
            fh.flush()
            for key in BOUNDS:
                if key in row and isinstance(row[key], float) and row[key] > worst.get(key, (-1.0, 0))[0]:
                    worst[key] = (row[key], s["index"])
            if bad:
                failures.append(s["index"])
                log(f"FAIL pack {s['index']} (pack seed {s['seed']}; replay: python perf/fuzz_gpu.py --seed {seed} "
                    f"--only {s['index']}): {s['heads']} {row['mode']} lengths {lens}: {'; '.join(bad)}")
            elif (s["index"] + 1) % 40 == 0:
                log(f"  {s['index'] + 1} packs done ({time.time() - t_start:.0f} s)")
    elapsed = time.time() - t_start
    n_train = sum(s["train"] for s in specs)
    by_heads = {h: sum(s["heads"] == h for s in specs) for h in sorted(configs)}
    all_lens = [n for s in specs for n in s["lengths"]]
    log("worst over the packs (bound): " + ", ".join(
        f"{k} {v:.2e} (pack {i}; {BOUNDS[k]:.0e})" for k, (v, i) in worst.items()))
    log(f"fuzz_gpu summary: {len(specs)} packs ({', '.join(f'{n} {h}' for h, n in by_heads.items())}; {n_train} training, "
        f"{len(specs) - n_train} no_grad; {len(all_lens)} documents of 0..{max(all_lens)} tokens), "
        f"{len(failures)} failed{' ' + str(failures) if failures else ''}; seed {seed}; "
        f"{elapsed:.0f} s for the packs, {compile_s:.0f} s compiling ahead")
    log_fh.close()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
