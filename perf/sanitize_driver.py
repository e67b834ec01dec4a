"""Every shipping sm_90a kernel on tiny odd packs, once each: what perf/sanitize.sh runs under
compute-sanitizer (memcheck, racecheck, synccheck).

A training call through the public API (backend "cute") launches each kernel of its recipe: the
fused Q/K/V quantization (torch's per-tensor quantization for the fp8_tensor_current control), the
forward, the dO quantization with D = rowsum(dO * O) (the backward preprocess), the e4m3-to-bf16
conversion of Q's codes (the backward's dK operand), the backward kernel and the dQ accumulator's
conversion (torch). fp8_token's backward is the emulator's (torch, thousands of small launches on the
many-documents pack), so its cases run the forward only. The packs are the document lengths at
the tile edges (1, 2, 63, 65, 127, 129, 255, 257), each alone (so a short document ends the
allocation, where an overrun shows) and all together, a mixed pack that builds the short-pair
kernels, and a pack of more documents than the persistent forward's tables hold (its per-tile
build). The separate-keys builds run on the small packs: cross-length causal (queries off and on the
64-row grid of their keys, documents without queries) and non-causal. Shapes stay tiny (H <= 4,
under 1,100 tokens): racecheck and synccheck are slow.

    python perf/sanitize_driver.py --set full       # every case (memcheck; with --compile-ahead, the warm-up)
    python perf/sanitize_driver.py --set small      # the all-lengths and mixed packs (racecheck, synccheck)
    python perf/sanitize_driver.py --control oob    # one planted out-of-bounds write: memcheck must fail
    python perf/sanitize_driver.py --list           # the cases, without a GPU
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

EDGE_LENGTHS = (1, 2, 63, 65, 127, 129, 255, 257)
# short documents (mean under SHORT_PAIRS_MEAN_TOKENS: the short-pair builds), an empty one, odd ends
MIXED = (64, 1, 0, 33, 2, 64, 63, 65, 17, 5, 40, 129, 2, 31)
MANY_DOCS = 1030  # one-token documents: past attention_fwd.PERSISTENT_MAX_DOCS, the per-tile forward

PACKS = {**{f"len{n}": (n,) for n in EDGE_LENGTHS}, "edges": EDGE_LENGTHS, "mixed": MIXED,
         "many": (1,) * MANY_DOCS}
SMALL_PACKS = ("edges", "mixed")
HEADS = {"h2_d128": (2, 2, 128), "gqa2x1_d128": (2, 1, 128), "gqa4x1_d64": (4, 1, 64)}
SMALL_HEADS = ("gqa2x1_d128", "gqa4x1_d64")  # d128 and d64, both GQA
# every recipe with a kernel (plan.KERNEL_SCALINGS) except fp8_tokenblock, which shares the default's
# forward build and the emulator's backward with fp8_token
RECIPES = ("fp8_tokenblock_dsbf16", "fp8_token", "fp8_tensor_current", "fp8_tokenblock_hadamard")
ROTARY = ("half", "interleaved")  # RoPE inside the quantization (rotary=), on the default recipe
# separate key documents on the default recipe: "cross", causal with each document's queries its last
# positions (the keys' lengths minus these offsets, cycled: on and off the 64-row grid, none left);
# "noncausal", every key visible
KEYS = ("cross", "noncausal")
CROSS_OFFSETS = (1, 0, 63, 64, 65, 129, 300)


@dataclass(frozen=True)
class Case:
    recipe: str
    heads: str
    pack: str
    deterministic: bool = False
    rotary: str = ""  # "", or one of ROTARY
    keys: str = ""  # "", or one of KEYS

    def label(self) -> str:
        return (f"{self.recipe} {self.heads} {self.pack}" + (" deterministic" if self.deterministic else "")
                + (f" rope-{self.rotary}" if self.rotary else "") + (f" {self.keys}" if self.keys else ""))


def query_lengths(case: Case) -> tuple:
    """The case's query documents: the pack's lengths, or for "cross" each minus its offset (at least 0)."""
    lengths = PACKS[case.pack]
    if case.keys != "cross":
        return lengths
    return tuple(max(0, n - CROSS_OFFSETS[i % len(CROSS_OFFSETS)]) for i, n in enumerate(lengths))


def cases(which: str) -> list[Case]:
    """full: every recipe x head config x pack, plus the deterministic backward, RoPE and the separate-keys
    builds on the default recipe; small (racecheck, synccheck): the same on SMALL_PACKS and SMALL_HEADS.
    Ordered cover first (cover_first): a run cut short by its time limit has still launched every kernel."""
    packs, heads = (list(PACKS), list(HEADS)) if which == "full" else (list(SMALL_PACKS), list(SMALL_HEADS))
    out = [Case(r, h, p) for r in RECIPES for h in heads for p in packs]
    out += [Case(RECIPES[0], h, p, deterministic=True) for h in heads for p in packs if p in SMALL_PACKS]
    out += [Case(RECIPES[0], h, p, rotary=r) for r in ROTARY for h in heads for p in packs if p in SMALL_PACKS]
    out += [Case(RECIPES[0], h, p, keys=kk) for kk in KEYS for h in heads for p in packs if p in SMALL_PACKS]
    return cover_first(out)


# packs by what an overrun at a document's end can show: all edge lengths together first
PACK_RANK = {p: i for i, p in enumerate(("edges", "mixed", "many", *(f"len{n}" for n in EDGE_LENGTHS)))}


def cover_first(todo: list[Case]) -> list[Case]:
    """todo reordered: greedily, the case launching most kernels no earlier case launched (ties: PACK_RANK,
    then todo's order) until every kernel is launched; then the rest in todo's order. Host-only."""
    kernels = [_one_case_kernels(c) for c in todo]
    left, covered, head = list(range(len(todo))), set(), []
    every = set().union(*kernels) if kernels else set()
    while covered != every:
        i = max(left, key=lambda j: (len(kernels[j] - covered), -PACK_RANK[todo[j].pack], -j))
        head.append(i)
        covered |= kernels[i]
        left.remove(i)
    return [todo[i] for i in head] + [todo[i] for i in left]


def run_case(case: Case, seed: int = 0) -> None:
    import torch

    from flamia_cute import RotaryConfig, flamia_attn_varlen_func
    from flamia_cute.plan import has_backward_kernel
    from flamia_cute.recipes import resolve_recipe
    from flamia_cute.testing import make_inputs

    lengths = PACKS[case.pack]
    H, Hk, D = HEADS[case.heads]
    q, k, v, do, cu, scale = make_inputs(lengths, H, Hk, D, seed=seed, device="cuda")
    cu_q, mx_q = cu, max(lengths)
    if case.keys == "cross":  # the queries: their own documents, the last positions of the keys'
        q_len = query_lengths(case)
        q, _, _, do, cu_q, _ = make_inputs(q_len, H, Hk, D, seed=seed + 1, device="cuda")
        mx_q = max(q_len)
    mx = max(lengths)
    train = has_backward_kernel(resolve_recipe(case.recipe))
    leaves = [t.clone().requires_grad_(train) for t in (q, k, v)]
    rotary = RotaryConfig(theta=10000.0, interleaved=case.rotary == "interleaved") if case.rotary else None
    out = flamia_attn_varlen_func(*leaves, cu_q, cu, mx_q, mx, scale, causal=case.keys != "noncausal",
                                  recipe=case.recipe, backend="cute", rotary=rotary, deterministic=case.deterministic)
    grads = torch.autograd.grad(out, leaves, do) if train else ()
    torch.cuda.synchronize()
    for name, t in zip(("out", "dq", "dk", "dv"), (out, *grads), strict=False):
        if not torch.isfinite(t.float()).all():
            raise RuntimeError(f"{case.label()}: {name} has non-finite values")


def case_kernels(todo: list[Case]) -> set:
    """The kernels the cases launch (kernel_warmup.call_kernels)."""
    return set().union(*(_one_case_kernels(c) for c in todo))


@functools.cache  # cover_first, its prefix and the warm-up ask for the same cases
def _one_case_kernels(c: Case) -> frozenset:
    from kernel_warmup import call_kernels

    H, Hk, D = HEADS[c.heads]
    return frozenset(call_kernels(c.recipe, D, H, Hk, query_lengths(c), True, keys=c.keys,
                                  rotary=(c.rotary, D) if c.rotary else None, deterministic=c.deterministic))


def cover_first_kernels_prefix(todo: list[Case]) -> list[Case]:
    """The shortest prefix of todo (cover_first's order) that launches every kernel the whole list does."""
    every, seen = case_kernels(todo), set()
    for i, c in enumerate(todo):
        seen |= _one_case_kernels(c)
        if seen == every:
            return todo[: i + 1]
    return todo


def planted_oob() -> None:
    """The e4m3-to-bf16 codes kernel launched straight from its launcher for 64 16-element chunks into
    an output of one: out-of-bounds global writes that memcheck must report (a sanitizer run that
    reports nothing here checks nothing). Run it with PyTorch's caching allocator off, so that the
    output is an allocation of its own."""
    import torch

    from flamia_cute.compile_cache import compile_launcher, launch_on_device, target_arch
    from flamia_cute.sm90 import codes

    chunks = 64
    short = torch.empty(codes.CHUNK, dtype=torch.bfloat16, device="cuda")
    src = torch.zeros(chunks * codes.CHUNK, dtype=torch.float8_e4m3fn, device="cuda")
    launch = compile_launcher(codes.SOURCE_FILES, codes.CodesConfig(row_scale=False), target_arch(),
                              lambda c, a, t: codes.compile_codes_sm90(c, a, tvm_ffi=t), codes.ARG_KINDS, None)
    launch_on_device(launch, src.device, src.data_ptr(), 0, short.data_ptr(), chunks, 1, 1, 1)
    torch.cuda.synchronize()
    print("planted out-of-bounds write launched (memcheck must report it)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", choices=("full", "small"), default="full", help="which cases (see cases())")
    ap.add_argument("--control", choices=("oob",), help="run the planted error instead of the cases")
    ap.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    ap.add_argument("--compile-ahead", action="store_true",
                    help="first compile the cases' kernels into the disk cache on all cores (the warm-up run)")
    args = ap.parse_args(argv)
    todo = cases(args.set)
    if args.list:
        for c in todo:
            print(c.label())
        print(f"{len(todo)} cases")
        return 0
    import torch

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("sanitize_driver: needs an sm_90 GPU", file=sys.stderr)
        return 2
    if args.control == "oob":
        planted_oob()
        return 0
    if args.compile_ahead:
        from kernel_warmup import compile_ahead

        compile_ahead(case_kernels(todo))
    t0 = time.time()
    n_cover = len(cover_first_kernels_prefix(todo))
    print(f"sanitize_driver: {len(todo)} cases; the first {n_cover} launch every kernel of the set", flush=True)
    for i, c in enumerate(todo):
        t = time.time()
        run_case(c)
        print(f"[{i + 1}/{len(todo)}] {c.label()}: ran ({time.time() - t:.1f} s)", flush=True)
    print(f"sanitize_driver: {len(todo)} cases ran in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
