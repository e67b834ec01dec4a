"""The error model behind the kernels' GPU tolerances against the H200's e4m3 wgmma (GPU, marker `gpu`).

`testing.fp8_mma_truncated` (14 significant bits, the running accumulator truncated with each k32
instruction's products) sets the bounds of test_attention_*_kernel.py and rules out O accumulated in the
tensor core (docs/numerics.md). perf/fp8_accumulation_gpu.py measures the hardware through
Triton's e4m3 dot (every figure within a few percent of the model); these tests
keep that check: a chain that stopped truncating its accumulator, or a model that drifted from the
hardware, fails them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

# the hardware accumulator measured against its model: minutes of GPU time, the full tier
pytestmark = [pytest.mark.gpu, pytest.mark.gpu_full]


@pytest.fixture(scope="module")
def experiment():
    pytest.importorskip("triton")
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("needs an sm_90 GPU (wgmma)")
    path = Path(__file__).resolve().parents[1] / "perf" / "fp8_accumulation_gpu.py"
    spec = importlib.util.spec_from_file_location("fp8_accumulation_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_chain_keeps_14_bits_of_its_accumulator(experiment):
    """A product 2^-14 of the running accumulator is lost however many instructions back the
    accumulator was built; with an fp32 add after every instruction it survives (fp32's 24 bits)."""
    rows = experiment.probe(torch.device("cuda"))
    for build in ("chain128", "chain512", "default"):
        assert experiment.bits_kept(rows, build) == 13, build
    assert experiment.bits_kept(rows, "k32") >= 23
    assert experiment.bits_kept(experiment.within(torch.device("cuda")), big="log2_big") == 13


@pytest.mark.parametrize("v_mean", [0.0, 4.0])
def test_the_model_predicts_the_hardware_error(experiment, v_mean):
    """P V over 4k keys: each build's relative L2 error against fp64 of the same e4m3 operands is the
    model's within 20% (at 16k keys within 2%); with V's mean at 4 (O > 0) both are biased low
    (truncation toward zero)."""
    hw = experiment.attention_like(torch.device("cuda"), tokens=4096, v_mean=v_mean)
    model = experiment.attention_like(torch.device("cpu"), tokens=4096, v_mean=v_mean, dot=experiment.model_dot)
    for build in ("chain128", "chain512", "default"):
        got, want = hw[build]["rel_l2"], model[build]["rel_l2"]
        assert 0.8 * want <= got <= 1.2 * want, (build, got, want)
        if v_mean > 0:
            assert hw[build]["bias"] < 0 and model[build]["bias"] < 0, build
    assert hw["default"]["rel_l2"] > 3 * hw["chain128"]["rel_l2"]  # the whole-row chain is the costly one
