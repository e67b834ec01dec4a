"""The e4m3 -> bf16 code conversion (sm90/codes.py): compile-only checks (CI) and exactness on the GPU."""

import re

import pytest
import torch
from test_attention_bwd_dsbf16_kernel import _needs_sm90

from flamia_cute.cute_backend import _dsl_importable

# only the DSL's absence skips these tests: an error in a project module fails its import
HAVE_DSL = _dsl_importable()
if HAVE_DSL:
    from flamia_cute.sm90.codes import CodesConfig, e4m3_codes_to_bf16, kernel_artifacts

needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl not importable")


@needs_dsl
def test_compiles_to_wide_accesses_and_hardware_conversions():
    art = kernel_artifacts(CodesConfig(), "sm_90a")
    # 16 codes in by one 128-bit load, 32 bf16 out by two 128-bit stores; e4m3x2 -> f16x2 in hardware
    assert len(re.findall(r"ld\.global\.v4\.b32", art.ptx)) == 1
    assert len(re.findall(r"st\.global\.v4\.b32", art.ptx)) == 2
    assert len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", art.ptx)) == 8
    assert art.frame_bytes in (None, 0)
    if art.sass is not None:
        assert re.findall(r"\bLDG\.E\.128\b", art.sass) and len(re.findall(r"\bSTG\.E\.128\b", art.sass)) == 2
        assert not re.search(r"\b(STL|LDL)\b", art.sass)
    assert not re.search(r"mul\.f32\s+f[ab], f[ab],", art.ptx)
    # with row_scale: each of the 16 values times its row's scale (one scalar load per thread)
    scaled = kernel_artifacts(CodesConfig(row_scale=True), "sm_90a")
    assert len(re.findall(r"mul\.f32\s+fa, fa,", scaled.ptx)) == len(re.findall(r"mul\.f32\s+fb, fb,", scaled.ptx)) == 8
    assert len(re.findall(r"ld\.global\.v4\.b32", scaled.ptx)) == 1 and len(re.findall(r"st\.global\.v4", scaled.ptx)) == 2


@needs_dsl
def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="CodesConfig.threads"):
        CodesConfig(threads=100)
    with pytest.raises(ValueError, match="codes must be a float8_e4m3fn"):
        e4m3_codes_to_bf16(torch.zeros(16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="CUDA"):
        e4m3_codes_to_bf16(torch.zeros(16, dtype=torch.float8_e4m3fn))


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("shape", [(16,), (3, 5, 64), (1000, 4, 128), (4096, 16, 128)])
def test_gpu_every_code_converts_exactly(shape):
    """Every e4m3 byte (all 256, NaNs included) and random ones: the same values as torch's conversion,
    bit for bit except NaN payloads (both NaN)."""
    n = torch.Size(shape).numel()
    g = torch.Generator(device="cuda").manual_seed(n)
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
    raw[: min(n, 256)] = torch.arange(min(n, 256), dtype=torch.uint8, device="cuda")
    codes = raw.view(torch.float8_e4m3fn).view(shape)
    got, want = e4m3_codes_to_bf16(codes), codes.to(torch.bfloat16)
    assert got.shape == codes.shape and got.dtype == torch.bfloat16
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    with pytest.raises(ValueError, match="multiple of 16"):
        e4m3_codes_to_bf16(codes.reshape(-1)[: n - 8] if n > 16 else codes.reshape(-1)[:8])


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("T, H, D", [(1, 1, 16), (37, 3, 64), (1000, 4, 128), (4096, 16, 128)])
def test_gpu_row_scaled_values_are_exact(T, H, D):
    """With a (H, T) power-of-two scale: each (token, head) row times its scale, exactly the fp32
    product rounded to bf16 (which it represents exactly), NaN codes aside."""
    g = torch.Generator(device="cuda").manual_seed(T * H + D)
    codes = torch.randint(0, 256, (T, H, D), dtype=torch.uint8, device="cuda", generator=g).view(torch.float8_e4m3fn)
    scale = torch.exp2(torch.randint(-40, 20, (H, T), device="cuda", generator=g).float())
    got = e4m3_codes_to_bf16(codes, scale)
    exact = codes.float() * scale.t().unsqueeze(-1)
    want = exact.to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert torch.equal(want[~nan].float(), exact[~nan])  # exact: no rounding happened
    with pytest.raises(ValueError, match="scale must be"):
        e4m3_codes_to_bf16(codes, scale.t().contiguous() if H != T else scale[:, :-1])
