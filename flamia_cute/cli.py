"""`flamia-cute` command line: accuracy, bench, ptx, tune."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from .recipes import DEFAULT_RECIPE


def cmd_accuracy(args) -> int:
    from .accuracy import accuracy_rows, format_table
    from .recipes import NAMED_RECIPES

    recipes = args.recipes.split(",") if args.recipes else list(NAMED_RECIPES)
    unknown = [r for r in recipes if r not in NAMED_RECIPES]
    if unknown:
        print(f"--recipes: unknown {unknown}; named recipes: {sorted(NAMED_RECIPES)}", file=sys.stderr)
        return 2
    rotary = None
    if args.rotary:
        from .rotary import RotaryConfig

        rotary = RotaryConfig(theta=args.rotary, interleaved=args.rotary_interleaved)
    rows = accuracy_rows(recipes, device=args.device, backend=args.backend, rotary=rotary)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def cmd_bench(args) -> int:
    from .bench import DEFAULT_WORKLOADS, main_bench

    args.workloads = args.workloads or str(DEFAULT_WORKLOADS)
    return main_bench(args)


def _set_value(val: str):
    """A --set value: True/False, a JSON literal (numbers, quoted strings, lists), else the bare string
    (the config's own checks then name the field if it is wrong)."""
    if val in ("True", "False"):
        return val == "True"
    try:
        return json.loads(val)
    except json.JSONDecodeError:
        return val


def cmd_ptx(args) -> int:
    from .kernels import KERNELS, set_target_arch, summarize

    if args.list:
        for k in KERNELS.values():
            print(f"{k.name:10s} arches {', '.join(k.arches):10s} configs: {', '.join(k.configs)}")
        return 0
    # --all: every kernel built for the arch (the Blackwell ones for sm_100a / sm_103a, the Hopper ones for sm_90a)
    names = [n for n, k in KERNELS.items() if args.arch in k.arches] if args.all else [args.kernel]
    if names == [None]:
        print("ptx: name a KERNEL, or use --all / --list", file=sys.stderr)
        return 2
    for n in names:
        if n not in KERNELS:
            print(f"ptx: unknown kernel {n!r}; kernels: {sorted(KERNELS)}", file=sys.stderr)
            return 2
        if args.arch not in KERNELS[n].arches:
            print(f"ptx: kernel {n!r} exists for {KERNELS[n].arches}, not {args.arch}", file=sys.stderr)
            return 2
    overrides = {}
    for kv in args.set:
        key, eq, val = kv.partition("=")
        if not eq or not key:
            print(f"ptx: --set {kv!r}: expected FIELD=VALUE", file=sys.stderr)
            return 2
        overrides[key] = _set_value(val)
    set_target_arch(args.arch)
    out_dir = pathlib.Path(args.out) if args.out else None
    for n in names:
        entry = KERNELS[n]
        cfg_names = list(entry.configs) if args.all else [args.config or next(iter(entry.configs))]
        for cname in cfg_names:
            try:
                cfg = entry.config(cname, overrides)
            except ValueError as e:
                print(f"ptx: {e}", file=sys.stderr)
                return 2
            art = entry.artifacts(cfg, args.arch)
            print(f"== {n} [{cname}] {args.arch}: {cfg}")
            for key, val in summarize(art, entry.smem_bytes(cfg), entry.tmem_columns(cfg)).items():
                print(f"   {key:28s} {val}")
            if out_dir:
                out_dir.mkdir(parents=True, exist_ok=True)
                stem = out_dir / f"{n}_{cname}_{args.arch}"
                stem.with_suffix(".ptx").write_text(art.ptx)
                if art.cubin:
                    stem.with_suffix(".cubin").write_bytes(art.cubin)
                if art.sass:
                    stem.with_suffix(".sass").write_text(art.sass)
    return 0


def cmd_tune(args) -> int:
    from .tuning import run_tune

    return run_tune(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flamia-cute", description="FP8 attention kernels for training (CuTe DSL)")
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("accuracy", help="error of every recipe against fp64 (emulator)")
    a.add_argument("--recipes", default="", help="comma-separated recipe names (default: all)")
    a.add_argument("--device", default="cpu")
    a.add_argument("--backend", default="emulate", choices=("emulate", "cute", "auto"),
                   help="the call's backend: 'cute' measures the sm_90a kernels (--device cuda)")
    a.add_argument("--rotary", type=float, default=0.0, metavar="THETA",
                   help="apply RoPE with this theta to Q and K, in the call and the fp64 reference")
    a.add_argument("--rotary-interleaved", action="store_true", help="with --rotary: GPT-J's interleaved pairs")
    a.add_argument("--json", default="", help="also write the rows as JSON here")
    a.set_defaults(func=cmd_accuracy)
    b = sub.add_parser("bench", help="ours against every importable baseline, side by side")
    b.add_argument("--workloads", default=None, help="JSON in the format of flamia_cute/workloads.json (default: that file)")
    b.add_argument("--only", default="", help="comma-separated workload names")
    b.add_argument("--heads", default="h16_d128", help="head config name from the workloads file")
    b.add_argument("--recipe", default=DEFAULT_RECIPE, help="comma-separated: one flamia_<recipe> column each")
    b.add_argument("--impls", default="", help="comma-separated name prefixes (flamia, fa4, cudnn, flex, sdpa)")
    b.add_argument("--modes", default="fwd,bwd,fwdbwd")
    b.add_argument("--layer", action="store_true",
                   help="also time RoPE + attention ('+rope' columns): ours with the RoPE fused into the "
                        "quantization against FA4 after the best importable RoPE kernel (flash-attn's "
                        "rotary, else torch.compile)")
    b.add_argument("--reps", type=int, default=15)
    b.add_argument("--gpu-time", action="store_true",
                   help="time GPU work only (each call queued behind a GPU sleep, as when the host runs ahead); "
                        "default: each call from an idle GPU, host launch time included")
    b.add_argument("--sustain", type=float, default=0.0, metavar="SECONDS",
                   help="time back-to-back calls after SECONDS of them: the clock a training loop holds "
                        "(on the H200, its power cap); overrides --gpu-time")
    b.add_argument("--graph", action="store_true",
                   help="with --sustain: time CUDA graph replays of each call, so host launch time drops out "
                        "(GPU time at the sustained clock)")
    b.add_argument("--device", default="")
    b.add_argument("--out", default="perf/out")
    b.set_defaults(func=cmd_bench)
    x = sub.add_parser("ptx", help="compile a kernel for an arch (no GPU needed) and summarize its PTX/SASS")
    x.add_argument("kernel", nargs="?", help="kernel name (see --list)")
    x.add_argument("--arch", default="sm_90a")
    x.add_argument("--config", default="", help="named config (see --list); default: the first")
    x.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a config field")
    x.add_argument("--out", default="", help="write PTX, cubin and SASS here")
    x.add_argument("--list", action="store_true", help="list kernels and configs")
    x.add_argument("--all", action="store_true", help="every kernel and config")
    x.set_defaults(func=cmd_ptx)
    t = sub.add_parser("tune", help="autotune the kernels for this GPU; winners cached per GPU")
    t.add_argument("--workloads", default=None)
    t.add_argument("--only", default="")
    t.add_argument("--heads", default="h16_d128")
    t.add_argument("--recipe", default=DEFAULT_RECIPE)
    t.add_argument("--reps", type=int, default=20)
    t.add_argument("--kernels", default="fwd,bwd,quant", help="comma-separated kernels to tune (fwd, bwd, quant)")
    t.add_argument("--dry-run", action="store_true", help="enumerate and prune the space; no GPU needed")
    t.add_argument("--print", action="store_true", help="show the current tuned choices")
    t.add_argument("--force", action="store_true", help="retune workload classes already tuned")
    t.set_defaults(func=cmd_tune)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
