"""Is a dQ difference run to run (the default dQ adds land in any order) or a leak? Runs the API
backward twice on the same inputs, default and deterministic, and prints the bitwise comparison.

    python perf/check_dq_repro.py
"""

import os

import torch

from flamia_cute.testing import attention_fn_for, make_inputs

q, k, v, do, cu, scale = make_inputs([1000, 1, 517, 4096, 33], 4, 2, 128, device="cuda", seed=5)
for det in ("0", "1"):
    os.environ["FLAMIA_CUTE_DETERMINISTIC"] = det
    for recipe in ("fp8_tokenblock", "fp8_tokenblock_dsbf16"):
        fn = attention_fn_for(recipe, scale, backend="cute")
        a, b = fn(q, k, v, cu, do), fn(q, k, v, cu, do)
        diff = {n: int((a[n].view(torch.int16) != b[n].view(torch.int16)).sum()) for n in ("dq", "dk", "dv")}
        print(f"deterministic={det} {recipe:22s} elements differing between two runs: {diff}", flush=True)
