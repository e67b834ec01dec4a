"""`flamia-cute tune`: the search spaces, their pruning and the timing that writes the per-GPU records
(tuned.py reads them at run time)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .tuned import TuningCache, TuningKey, config_fields, kernel_shape, record_fields, workload_class

SMEM_LIMIT_SM90 = 227 * 1024  # per CTA
TUNE_QUEUE_LEAD_CYCLES = 4_000_000  # ~2 ms of GPU sleep: longer than any call's host time
SMEM_PER_SM_SM90 = 228 * 1024


# ----------------------------------------------------------------------------- search space


def fwd_space(head_dim: int, group: int, diagonal_copy: bool):
    """The forward configs that can win on some workload class, with the reason each pruned one was
    dropped: the default, deeper K/V pipelines (3 stages won on long and mid-uniform packs), LPT
    across documents (won on mid-skewed packs) and short pairs toggled (on by default only for packs
    of short documents). The schedule (ping-pong, intra-warpgroup overlap) follows from the shape;
    the one-CTA-per-tile build is only the fallback for more documents than the persistent tables
    hold (per_tile_fallback), slower wherever the persistent one runs."""
    from .sm90.attention_fwd import FwdConfig, smem_bytes

    base = FwdConfig(head_dim=head_dim, qhead_per_kvhead=group, diagonal_copy=diagonal_copy)
    keep, pruned = [(base, "default")], []
    for stages in (3, 4):
        cfg = dataclasses.replace(base, kv_stages=stages)
        smem = smem_bytes(cfg)
        (keep if smem <= SMEM_LIMIT_SM90 else pruned).append((cfg, f"smem {smem} B"))
    keep.append((dataclasses.replace(base, tile_order="longest_documents"), "documents longest first"))
    keep.append((dataclasses.replace(base, short_pairs=not base.short_pairs), "short pairs toggled"))
    return keep, pruned


def quantize_space(head_dim: int, heads_q: int, heads_kv: int, block_tokens: int):
    """Every Q/K/V quantization launch (qkv_config), with the reason each pruned one was dropped."""
    from .sm90.quantize import qkv_config

    default = qkv_config(head_dim, heads_q, heads_kv, block_tokens)
    keep, pruned = [(default, "default")], []
    for raster in ("heads", "chunks"):
        for min_ctas in (0, 3, 4, 5):
            for hg in (1, 2, 4):
                fields = {"raster": raster, "min_ctas_per_sm": min_ctas, "heads_per_cta": hg}
                try:
                    cfg = qkv_config(head_dim, heads_q, heads_kv, block_tokens, **fields)
                except ValueError as e:
                    pruned.append((fields, str(e)))
                    continue
                if cfg == default:
                    continue
                # the launch bound asks for min_ctas resident CTAs: their shared memory must fit one SM too
                smem = cfg.smem_bytes * max(1, min_ctas)
                (keep if smem <= SMEM_PER_SM_SM90 else pruned).append((cfg, f"smem {smem} B per SM"))
    return keep, pruned


def bwd_dsbf16_space(head_dim: int, group: int, diagonal_copy: bool, num_kv_heads: int = 1):
    """The backward's candidates (BwdDsBf16Config): the default, with three vector stages, in each head
    window of the blocks order that divides num_kv_heads, and with short_pairs toggled where its build
    takes pairs. The tuned fields that win a workload class (docs/scheduling.md, "The tuner"):
    three vector stages (long documents) and the head windows (short ones); short pairs
    are the default for packs of short documents only. Nothing is pruned."""
    from .sm90.attention_bwd import HEAD_WINDOWS, BwdDsBf16Config, short_pairs_supported

    default = BwdDsBf16Config(head_dim=head_dim, qhead_per_kvhead=group, diagonal_copy=diagonal_copy)
    keep = [(default, "default"), (dataclasses.replace(default, vec_stages=3), "three vector stages")]
    for w in HEAD_WINDOWS[1:]:  # the blocks order in windows of w KV heads
        if w <= num_kv_heads and num_kv_heads % w == 0:
            keep.append((dataclasses.replace(default, head_window=w), f"head window {w}"))
    if short_pairs_supported(default):  # two short documents per CTA
        keep.append((dataclasses.replace(default, short_pairs=not default.short_pairs), "short pairs toggled"))
    return keep, []


# `flamia-cute tune --kernels` names; "bwd" means the backward kernel ("bwd_dsbf16"), which recipes with
# bf16 dS run (plan.has_backward_kernel; the others' backward is the emulator's: nothing to tune)
TUNED_KERNELS = ("fwd", "bwd", "quant")


def search_space(kernel: str, head_dim: int, heads_q: int, heads_kv: int, block_tokens: int):
    """(kept, pruned) of one kernel for an attention shape; kept[0] is the kernel's default config."""
    if kernel == "quant":
        return quantize_space(head_dim, heads_q, heads_kv, block_tokens)
    if kernel == "fwd":
        return fwd_space(head_dim, heads_q // heads_kv, block_tokens > 1)
    if kernel == "bwd_dsbf16":
        return bwd_dsbf16_space(head_dim, heads_q // heads_kv, block_tokens > 1, heads_kv)
    raise ValueError(f"no search space for kernel {kernel!r}")


def workload_space(kernel: str, keep: list, heads_kv: int, max_seqlen: int) -> list:
    """A kernel's kept configs for one workload: the bf16-dS backward's default takes the head window
    that an untuned call picks for this document length (auto_head_window), so that "default ms" is
    what runs without tuning; the plain order stays in the space as a variant."""
    if kernel != "bwd_dsbf16":
        return keep
    from .sm90.attention_bwd import auto_head_window

    window = auto_head_window(heads_kv, max_seqlen)
    default = dataclasses.replace(keep[0][0], head_window=window)
    return [(default, "default")] + [(c, "variant" if why == "default" else why) for c, why in keep if c != default]


# A bf16-dS record's head_window when the window that the tuned workload's length picks
# (auto_head_window) won: the lookup then picks it again by each call's length. A class holds
# documents of 1k to 4k tokens (mid-uniform: 16x1k and 4x4k), whose automatic windows differ (16, 4);
# a number tuned on 16x1k slows 4x4k's backward (docs/scheduling.md).
def config_label(kernel: str, cfg) -> str:
    fields = cfg if isinstance(cfg, dict) else config_fields(kernel, cfg)
    return " ".join(f"{k}={v}" for k, v in fields.items())


# ----------------------------------------------------------------------------- cache


# ----------------------------------------------------------------------------- the tune command


def _kernel_calls(case, block: int, kernels) -> dict:
    """kernel -> (call(cfg, i) launching only that kernel on input set i, number of input sets). The
    Q/K/V launch writes the layouts a call's plan writes (quantize.forward_only): the one timed, and
    the one compiled here that a later call reuses from the disk cache."""
    import torch

    from .cute_backend import quantize_operands
    from .sm90.attention_fwd import FwdConfig, flamia_fwd_sm90

    calls = {}
    if "quant" in kernels:
        from .quant import transposed_tokens
        from .sm90.quantize import _alloc_outputs, forward_only, launch_fused_quantize_multi_sm90, qkv_config

        # one output buffer serves every config: raster, launch bounds and heads_per_cta keep the layout
        base = forward_only(qkv_config(case.head_dim, case.heads_q, case.heads_kv, block))
        outs = _alloc_outputs(base, case.total, transposed_tokens(case.total, len(case.lengths)), case.cu.device)

        def quant(cfg, i):
            launch_fused_quantize_multi_sm90(case.sets[i][:3], case.cu, forward_only(cfg), outs)

        calls["quant"] = (quant, len(case.sets))
    if not {"fwd", "bwd_dsbf16"} & set(kernels):
        return calls
    ops = [quantize_operands(q, k, v, case.cu, block, case.max_len) for q, k, v, _ in case.sets]

    def fwd(cfg, i):
        qq, (kq, kt), (vq, vt) = ops[i]
        return flamia_fwd_sm90(qq.data_td, qq.scale, kq.data_td, kq.scale, vq.data_dt, vq.scale,
                               kt.data_td if kt else None, kt.scale if kt else None,
                               vt.data_dt if vt else None, vt.scale if vt else None,
                               case.cu, case.max_len, case.scale, cfg)

    calls["fwd"] = (fwd, len(ops))
    if "bwd_dsbf16" in kernels:
        from .sm90.attention_bwd import flamia_bwd_dsbf16_sm90_from_saved
        from .sm90.bwd_preprocess import preprocess_bwd

        out, lse = fwd(FwdConfig(head_dim=case.head_dim, qhead_per_kvhead=case.heads_q // case.heads_kv,
                                 diagonal_copy=block > 1), 0)
        dout = torch.randn(out.shape, device=out.device).to(torch.bfloat16)
        group = case.heads_q // case.heads_kv
        # precomputed: only the kernel is timed
        delta, doq, dv_ref = preprocess_bwd(dout, out, case.cu, dv_ref_group=group)
        qq, (kq, kt), (vq, vt) = ops[0]

        def bwd_dsbf16(cfg, _i):
            flamia_bwd_dsbf16_sm90_from_saved(dout, out, lse, qq, kq, vq, kt, vt, case.cu, case.max_len,
                                              case.scale, config=cfg, do_quantized=doq, delta=delta,
                                              dv_ref=dv_ref)

        calls["bwd_dsbf16"] = (bwd_dsbf16, 1)
    return calls


def _tune_one(kernel, keep, call, n_sets, reps, heads_kv: int, max_seqlen: int) -> dict:
    """Time every kept config; the cache record ("config" None when every config failed; record_fields
    of the fastest for this workload's KV heads and longest document)."""
    import sys

    from .bench import _time_calls

    times, failed = {}, {}
    for cfg, _ in keep:
        try:
            # GPU time only: host launch overhead is the same for every config and would swamp
            # the short kernels (quantization runs 0.1-0.4 ms against ~0.25 ms of host time)
            times[cfg] = _time_calls(lambda i, cfg=cfg: call(cfg, i), n_sets, "cuda", reps=reps,
                                     queue_lead_cycles=TUNE_QUEUE_LEAD_CYCLES)
        except Exception as e:  # a config that does not compile or launch is skipped, not fatal
            label = config_label(kernel, cfg)
            failed[label] = f"{type(e).__name__}: {e}"[:300]
            print(f"tune: {kernel} {label} failed: {failed[label]}", file=sys.stderr)
    best = min(times, key=times.get) if times else None
    return {"config": record_fields(kernel, best, heads_kv, max_seqlen) if times else None, "ms": times.get(best),
            "default_ms": times.get(keep[0][0]),
            "all": {config_label(kernel, c): round(t, 4) for c, t in times.items()}, "failed": failed}


def _ms(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def run_tune(args) -> int:
    import sys

    import torch

    from .bench import DEFAULT_WORKLOADS, _progress
    from .plan import KERNEL_SCALINGS, has_backward_kernel
    from .recipes import NAMED_RECIPES

    data = json.loads(Path(args.workloads or DEFAULT_WORKLOADS).read_text())
    head = data["head_configs"].get(args.heads)
    if head is None:
        print(f"tune --heads: unknown {args.heads!r}; known {sorted(data['head_configs'])}", file=sys.stderr)
        return 2
    if args.recipe not in KERNEL_SCALINGS:
        print(f"tune --recipe: kernels exist for {sorted(KERNEL_SCALINGS)}, not {args.recipe!r}", file=sys.stderr)
        return 2
    kernels = list(dict.fromkeys(k for k in args.kernels.split(",") if k))
    unknown = [k for k in kernels if k not in TUNED_KERNELS]
    if unknown or not kernels:
        print(f"tune --kernels: unknown {unknown or args.kernels!r}; tunable: {','.join(TUNED_KERNELS)}", file=sys.stderr)
        return 2
    if has_backward_kernel(NAMED_RECIPES[args.recipe]):  # the backward kernel this recipe runs, and its lookup
        kernels = ["bwd_dsbf16" if k == "bwd" else k for k in kernels]
    elif "bwd" in kernels:
        print(f"tune: recipe {args.recipe!r} has no backward kernel (its backward is the emulator's): bwd skipped",
              file=sys.stderr)
        kernels = [k for k in kernels if k != "bwd"]
        if not kernels:
            return 2
    wl = data["workloads"]
    if args.only:
        wl = {w: wl[w] for w in args.only.split(",") if w in wl} or wl
    block = 128 if KERNEL_SCALINGS[args.recipe] == "tokenblock" else 1  # "tensor" runs the per-token kernels
    spaces = {k: search_space(k, head["head_dim"], head["heads_q"], head["heads_kv"], block) for k in kernels}
    shapes = {k: kernel_shape(k, keep[0][0]) for k, (keep, _) in spaces.items()}
    classes = {w: workload_class(max(ls), sum(ls), len(ls)) for w, ls in wl.items()}
    if args.dry_run:
        for k, (keep, pruned) in spaces.items():
            print(f"{k} search space ({len(keep)} kept, {len(pruned)} pruned), shape {shapes[k]}:")
            for cfg, why in keep:
                print(f"  keep   {config_label(k, cfg)}  ({why})")
            for cfg, why in pruned:
                print(f"  pruned {config_label(k, cfg)}: {why}")
        for w, c in classes.items():
            print(f"  workload {w}: class {c}")
        return 0
    if not torch.cuda.is_available():
        print("tune: needs a GPU (use --dry-run to see the space)", file=sys.stderr)
        return 2
    cache = TuningCache(TuningKey.current())
    if args.print:
        for k, recs in cache.entries.items():
            for sk, rec in recs.items():
                print(f"{k} {sk}: {rec['config']}  tuned {_ms(rec['ms'])} ms vs default {_ms(rec['default_ms'])} ms")
        return 0
    from .bench import Case

    rows = []  # (kernel, workload, class, status, record)
    tuned_now = set()  # (kernel, class): --force retunes a class once per run, not once per workload
    for w, lengths in _progress(list(wl.items())):
        wclass = classes[w]
        todo = []
        for k in kernels:
            rec = cache.get(k, wclass, shapes[k])
            if rec and (not args.force or (k, wclass) in tuned_now):
                rows.append((k, w, wclass, "cached", rec))
            else:
                todo.append(k)
        if not todo:
            continue
        case = Case(w, lengths, head["heads_q"], head["heads_kv"], head["head_dim"], "cuda").build()
        calls = _kernel_calls(case, block, todo)
        for k in todo:
            rec = _tune_one(k, workload_space(k, spaces[k][0], head["heads_kv"], max(lengths)), *calls[k], args.reps,
                            head["heads_kv"], max(lengths))
            rec["workload"] = w
            tuned_now.add((k, wclass))
            if rec["config"] is None:
                rows.append((k, w, wclass, "failed", rec))
                continue
            cache.put(k, wclass, shapes[k], rec)
            rows.append((k, w, wclass, "tuned", rec))
    print(f"\n{'kernel':6s} {'workload':14s} {'class':14s} {'status':7s} {'default ms':>10s} {'tuned ms':>9s} "
          f"{'speedup':>7s}  config")
    for k, w, c, st, rec in rows:
        speedup = f"{rec['default_ms'] / rec['ms']:.2f}x" if rec["default_ms"] and rec["ms"] else "-"
        print(f"{k:6s} {w:14s} {c:14s} {st:7s} {_ms(rec['default_ms']):>10s} {_ms(rec['ms']):>9s} {speedup:>7s}  "
              f"{config_label(k, rec['config']) if rec['config'] else 'every config failed'}")
    print(f"\ntuning file: {cache.path}")
    return 0
