"""Demo: `python -m flamia_cute` (with arguments, the CLI: `python -m flamia_cute --help`).

On a CPU it runs the emulator on a small packed batch, prints the error of
every recipe against fp64 and the leakage checks (the leaky control must
fail), and the Blackwell forward's algorithm (its CPU tile model, the kernel
being compile-only here) against the emulator. On an sm_90 GPU with the CuTe
DSL it also runs the GPU kernels, and the Blackwell path's fused MXFP8
quantization against its specification.
"""

from __future__ import annotations

import sys
import time

import torch

from .accuracy import accuracy_rows, format_table
from .recipes import DEFAULT_RECIPE
from .testing import attention_fn_for, check_leakage, make_inputs


def main() -> int:
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    name = torch.cuda.get_device_name() if on_gpu else "CPU (emulator)"
    print(f"flamia_cute demo on {name}")
    t0 = time.time()
    recipes = [DEFAULT_RECIPE, "fp8_tokenblock", "fp8_token", "mxfp8", "nvfp4_fp8", "fp8_tensor_current", "bf16"]
    rows = accuracy_rows(recipes, lengths=(517, 300, 1, 0, 130, 64), device=device)
    print("\nerror against fp64 (SQNR, higher is better), packed documents [517, 300, 1, 0, 130, 64], "
          "4 query heads / 2 kv heads, head dim 128:")
    print(format_table(rows))
    print("\nleakage checks (future perturbation, document isolation):")
    q, k, v, do, cu, scale = make_inputs([300, 517, 1, 130], 2, 1, 128, device=device, seed=3)
    failures = 0
    for recipe, must_pass in ((DEFAULT_RECIPE, True), ("fp8_tokenblock", True), ("fp8_token", True),
                              ("fp8_tensor_current", False), ("fp8_tokenblock_unsafe", False)):
        rep = check_leakage(attention_fn_for(recipe, scale), q, k, v, cu, do, doc=1, cut=173)
        verdict = "as expected" if rep.ok == must_pass else "UNEXPECTED"
        failures += rep.ok != must_pass
        print(f"  {recipe:24s} {str(rep).splitlines()[0]}  ({'leak-free' if must_pass else 'control'}: {verdict})")
    failures += blackwell_demo(on_gpu)
    if on_gpu:
        from .gpu_demo import run_gpu_kernels

        failures += run_gpu_kernels()
    print(f"\ndone in {time.time() - t0:.1f} s")
    return 1 if failures else 0


def blackwell_demo(on_gpu: bool) -> int:
    """The sm_100a MXFP8 forward's tile model against the emulator, its leakage (and the no-safeguard
    control's); on an sm_90 GPU the fused MX quantization against its torch specification."""
    try:
        from .sm100.attention_fwd import (
            TILE_MODEL_LSE_ABS,
            TILE_MODEL_REL_L2,
            reference_attention_fn,
            reference_fwd_sm100,
        )
    except Exception as e:  # no CuTe DSL
        print(f"\nBlackwell forward: skipped ({type(e).__name__}: the CuTe DSL is needed)")
        return 0
    from .emulator import emulate_forward
    from .quant.mx_layout import pack_mx_forward_operands
    from .recipes import Recipe
    from .testing import rel_l2

    q, k, v, _, cu, scale = make_inputs([300, 517, 1, 130], 4, 2, 128, seed=5)
    out, lse = reference_fwd_sm100(pack_mx_forward_operands(q, k, v, cu), cu, scale)
    ref_out, ref_lse, _ = emulate_forward(q, k, v, cu, cu, scale, True, Recipe.from_name("mxfp8"))
    err, lse_err = rel_l2(out.float(), ref_out.float()), float((lse - ref_lse).abs().max())
    failures = int(not (err < TILE_MODEL_REL_L2 and lse_err < TILE_MODEL_LSE_ABS))
    print("\nBlackwell (sm_100a) MXFP8 forward, compile-only here: its algorithm as a CPU tile model")
    print(f"  tile model vs emulator (mxfp8): O rel L2 {err:.1e}, LSE max abs {lse_err:.1e}"
          f"  ({'as expected' if not failures else 'UNEXPECTED'})")

    for bug, must_pass in ((None, True), ("no_own_block_bf16", False)):
        rep = check_leakage(reference_attention_fn(scale, bug), q, k, v, cu, doc=1, cut=173)
        failures += rep.ok != must_pass
        label = "tile model" if bug is None else "without the safeguard"
        print(f"  {label:22s} {str(rep).splitlines()[0]}  ({'leak-free' if must_pass else 'control'}: "
              f"{'as expected' if rep.ok == must_pass else 'UNEXPECTED'})")
    if on_gpu and torch.cuda.get_device_capability() == (9, 0):
        from .sm100.quantize_mx import quantize_mx_forward

        qg, kg, vg, cug = (t.cuda() for t in (q, k, v, cu))
        got, want = quantize_mx_forward(qg, kg, vg, cug), pack_mx_forward_operands(qg, kg, vg, cug)
        exact = all(torch.equal(getattr(got, n).view(torch.uint8), getattr(want, n).view(torch.uint8))
                    for n in ("q", "k", "v"))
        failures += not exact
        print(f"  fused MX quantization kernel on this GPU vs its specification: "
              f"{'bit-exact' if exact else 'DIFFERS'}")
    return failures


if __name__ == "__main__":
    if sys.argv[1:]:  # `python -m flamia_cute bench ...` or `--help`: the CLI, as `flamia-cute`
        from .cli import main as cli_main

        sys.exit(cli_main(sys.argv[1:]))
    sys.exit(main())
