"""`flamia-cute` command line: accuracy, ptx (and bench, tune as they land)."""

from __future__ import annotations

import argparse
import json
import sys


def cmd_accuracy(args) -> int:
    from .accuracy import accuracy_rows, format_table
    from .recipes import NAMED_RECIPES

    recipes = args.recipes.split(",") if args.recipes else list(NAMED_RECIPES)
    unknown = [r for r in recipes if r not in NAMED_RECIPES]
    if unknown:
        print(f"--recipes: unknown {unknown}; named recipes: {sorted(NAMED_RECIPES)}", file=sys.stderr)
        return 2
    rows = accuracy_rows(recipes, device=args.device)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def cmd_bench(args) -> int:
    from .bench import DEFAULT_WORKLOADS, main_bench

    args.workloads = args.workloads or str(DEFAULT_WORKLOADS)
    return main_bench(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flamia-cute", description="FP8 attention kernels for training (CuTe DSL)")
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("accuracy", help="error of every recipe against fp64 (emulator)")
    a.add_argument("--recipes", default="", help="comma-separated recipe names (default: all)")
    a.add_argument("--device", default="cpu")
    a.add_argument("--json", default="", help="also write the rows as JSON here")
    a.set_defaults(func=cmd_accuracy)
    b = sub.add_parser("bench", help="ours against every importable baseline, side by side")
    b.add_argument("--workloads", default=None, help="JSON in the format of perf/workloads.json")
    b.add_argument("--only", default="", help="comma-separated workload names")
    b.add_argument("--heads", default="h16_d128", help="head config name from the workloads file")
    b.add_argument("--recipe", default="fp8_tokenblock")
    b.add_argument("--impls", default="", help="comma-separated name prefixes (flamia, fa4, cudnn, flex, sdpa)")
    b.add_argument("--modes", default="fwd,bwd,fwdbwd")
    b.add_argument("--reps", type=int, default=15)
    b.add_argument("--device", default="")
    b.add_argument("--out", default="perf/out")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
