"""The sm_90a kernels against fp64, on fresh random data (GPU, marker `gpu`).

The default recipe runs forward and backward through the public API (`backend="cute"`: fused
quantization, forward kernel, backward kernel) on inputs drawn from a new
seed each run (printed in every failure message, so a failing draw can be replayed with
FLAMIA_CUTE_TEST_SEED). Floors: the emulator's (tests/test_accuracy.py NORMAL_FLOORS, SQNR in dB
against the fp64 reference) and relative L2 bounds; the kernels match their emulator to
fp32-accumulation noise (test_*_kernel.py), so they must meet the same floors on any draw.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_accuracy import NORMAL_FLOORS

from flamia_cute.reference import reference_attention
from flamia_cute.testing import attention_fn_for, make_inputs, rel_l2, sqnr_db

KERNEL_RECIPES = ("fp8_tokenblock_dsbf16",)
# relative L2 against fp64 on normal inputs (emulator: O 4.4e-2, dQ 6.1-6.7e-2, docs/numerics.md)
REL_L2_MAX = {"out": 5.5e-2, "dq": 8e-2, "dk": 8e-2, "dv": 6e-2}


def _fresh_seed() -> int:
    env = os.environ.get("FLAMIA_CUTE_TEST_SEED")
    return int(env) if env else int.from_bytes(os.urandom(4), "little")


def _on_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("recipe", KERNEL_RECIPES)
@pytest.mark.parametrize("lengths, heads", [([517, 300, 1, 0, 130, 64, 2000], (4, 2)), ([4096], (8, 8)),
                                             ([64] * 12 + [33, 1, 7], (4, 1))])
def test_kernels_against_fp64_on_fresh_data(recipe, lengths, heads):
    seed = _fresh_seed()
    q, k, v, do, cu, scale = make_inputs(lengths, *heads, 128, seed=seed, device="cuda")
    got = attention_fn_for(recipe, scale, backend="cute")(q, k, v, cu, do)
    ref = reference_attention(q, k, v, cu, cu, scale, True, do)
    for name, floor in NORMAL_FLOORS.items():
        s = sqnr_db(got[name], ref[name])
        r = rel_l2(got[name], ref[name])
        where = f"{recipe} {name} (seed {seed}, lengths {lengths}, heads {heads})"
        assert torch.isfinite(got[name].float()).all(), f"{where}: non-finite values"
        assert s >= floor, f"{where}: SQNR {s:.2f} dB < {floor} dB"
        assert r <= REL_L2_MAX[name], f"{where}: relative L2 {r:.3e} > {REL_L2_MAX[name]}"
    # LSE: 55.8 dB on the emulator's table (docs/numerics.md)
    lse_db = sqnr_db(got["lse"], ref["lse"])
    assert lse_db >= 45.0, f"{recipe} lse SQNR {lse_db:.1f} dB (seed {seed})"
