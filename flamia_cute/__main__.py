"""Demo: `python -m flamia_cute`.

On a CPU it runs the emulator on a small packed batch, prints the error of
every recipe against fp64 and the leakage checks (the leaky control must
fail). On an sm_90 GPU with the CuTe DSL it also runs the GPU kernels.
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
    if on_gpu:
        from .gpu_demo import run_gpu_kernels

        failures += run_gpu_kernels()
    print(f"\ndone in {time.time() - t0:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
