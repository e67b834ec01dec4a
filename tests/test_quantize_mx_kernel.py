"""The fused MXFP8 quantization for the Blackwell forward (sm100/quantize_mx.py): compiled for sm_100a and
sm_90a on the CPU; on the H200 (it uses no Blackwell-only instruction) and on a Blackwell GPU bit-exact
against its torch specification, quant.mx_layout.pack_mx_forward_operands."""

from __future__ import annotations

import re

import pytest
import torch

from flamia_cute.cute_backend import _dsl_importable
from flamia_cute.quant.mx_layout import pack_mx_forward_operands, sf_tile_starts
from flamia_cute.testing import make_inputs

# only the DSL's absence skips these tests: an error in a project module fails its import
HAVE_DSL = _dsl_importable()
if HAVE_DSL:
    from flamia_cute.sm100.quantize_mx import MxQuantizeConfig, kernel_artifacts, quantize_mx_forward

needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl not importable")


@needs_dsl
@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("arch", ["sm_100a", "sm_90a"])
def test_compiles_with_e4m3_packs_and_no_local_memory(arch, scan):
    art = kernel_artifacts(MxQuantizeConfig(scan_documents=scan), arch)
    # Q, and K and V (one code path): 128 elements per row, two per cvt; no bf16 copy of Q (the forward
    # converts its codes)
    assert len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", art.ptx)) == 2 * 64
    assert "cvt.rn.f16x2.e4m3x2" not in art.ptx
    assert ".local" not in art.ptx
    if art.frame_bytes is not None:
        assert art.frame_bytes == 0
    if art.sass is not None:
        assert not re.search(r"\b(STL|LDL)\b", art.sass)


@needs_dsl
def test_input_errors():
    with pytest.raises(ValueError, match="MxQuantizeConfig.head_dim"):
        MxQuantizeConfig(head_dim=64)
    with pytest.raises(ValueError, match="MxQuantizeConfig.scan_documents"):
        MxQuantizeConfig(scan_documents=1)
    q, k, v, _, cu, _ = make_inputs([40], 2, 2, 128, seed=0)
    with pytest.raises(ValueError, match="CUDA"):
        quantize_mx_forward(q, k, v, cu)
    with pytest.raises(ValueError, match="multiple of Hk"):
        quantize_mx_forward(q, k[:, :0], v, cu)


MIXES = {
    "mixed": [1, 37, 200, 0, 300, 130],
    "aligned": [128, 256, 512],
    "short": [5, 1, 33, 64, 96, 31, 7] * 3,
    "long": [4000, 93],
    "many": [(i * 7) % 13 + 1 for i in range(1100)],  # more than MAX_SCAN_DOCS: the host's prefix sums
}


@needs_dsl
@pytest.mark.gpu
@pytest.mark.sm90_sm100
@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("kind", ["normal", "outliers"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_kernel_is_bit_exact_with_the_specification(mix, kind, scan):
    """Both ways to the document tables: the kernel's own scan of cu_seqlens (the default up to
    MAX_SCAN_DOCS documents; "many" falls back) and the host's prefix sums."""
    if mix == "many" and scan:
        pytest.skip("more than MAX_SCAN_DOCS documents: the host tables whatever the config")
    q, k, v, _, cu, _ = make_inputs(MIXES[mix], 4, 2, 128, kind=kind, seed=3, device="cuda")
    if mix == "mixed":
        k[38:70] = 0  # document 2's first 32-token block all zero (scale 1.0); tiny values in V
        v[40:45] *= 1e-30
    got = quantize_mx_forward(q, k, v, cu, MxQuantizeConfig(scan_documents=scan))
    want = pack_mx_forward_operands(q, k, v, cu)
    used = int(sf_tile_starts(cu)[-1])  # chunk slots past the last tile are never read
    for name in ("q", "k", "v"):
        a, b = getattr(got, name), getattr(want, name)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    for name in ("q_sf", "k_sf", "v_sf"):
        assert torch.equal(getattr(got, name)[:, :used], getattr(want, name)[:, :used]), name
    assert got.k_diag is k and got.v_diag is v


@needs_dsl
@pytest.mark.gpu
@pytest.mark.sm90_sm100
def test_no_tokens_launches_nothing():
    q, k, v, _, cu, _ = make_inputs([0, 0], 2, 2, 128, device="cuda")
    got, want = quantize_mx_forward(q, k, v, cu), pack_mx_forward_operands(q, k, v, cu)
    for name in ("q", "q_sf", "k", "k_sf", "v", "v_sf"):
        assert getattr(got, name).shape == getattr(want, name).shape, name
