"""dO for the planned Blackwell MXFP8 backward (sm100/quantize_do_mx.py): its torch specification
(quant.mx_layout.pack_mx_do_operands) against the emulator's MX quantization of dO and D = rowsum(dO * O),
its document isolation (MX blocks along the tokens restart at each document start) with a leaky control,
the kernel compiled for sm_90a, sm_100a and sm_103a on the CPU, and (H200 or Blackwell) bit-exact against
the specification on packed documents."""

from __future__ import annotations

import re

import pytest
import torch

from flamia_cute.cute_backend import _dsl_importable
from flamia_cute.emulator import quantize_operand
from flamia_cute.quant import mx_quantize
from flamia_cute.quant.mx_layout import (
    MX_BLOCK,
    SF_UNUSED,
    decode_dim_rows,
    decode_token_rows,
    pack_mx_do_operands,
    rowsum_do_o,
    sf_byte_offset,
    sf_tile_starts,
)
from flamia_cute.recipes import NAMED_RECIPES
from flamia_cute.testing import make_inputs

# only the DSL's absence skips these tests: an error in a project module fails its import
HAVE_DSL = _dsl_importable()
if HAVE_DSL:
    from flamia_cute.sm100.quantize_do_mx import MxDoQuantizeConfig, kernel_artifacts, quantize_do_mx

needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl not importable")
MXFP8 = NAMED_RECIPES["mxfp8"]
# odd lengths, document starts that are not multiples of 32 (1, 38, 238, ...), an empty document
LENGTHS = [1, 37, 200, 0, 300, 130, 33]


def _inputs(lengths, heads=3, kind="normal", seed=1, device="cpu"):
    """dO, a stand-in for the forward's O (any bf16 tensor of its shape), cu_seqlens."""
    _, _, _, dout, cu, _ = make_inputs(lengths, heads, 1, 128, kind="outliers" if kind == "outliers" else "normal",
                                       seed=seed, device=device)
    out, _, _, _, _, _ = make_inputs(lengths, heads, 1, 128, seed=seed + 1, device=device)
    if kind == "tiny":  # scales down to 2^-126, values down to bf16's subnormals
        dout = dout * 2.0**-120
    return dout, out, cu


# ----------------------------------------------------------------------------------------------
# The specification
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["normal", "outliers", "tiny"])
@pytest.mark.parametrize("lengths", [LENGTHS, [128, 256], [5, 1, 33, 64, 96, 31, 7]])
def test_specification_is_the_emulators_quantization_of_do(lengths, kind):
    """Codes times decoded chunks equal the emulator's MX dO along D and along the tokens bit for bit;
    D is rowsum(dO * O) up to fp32 summation order (against fp64)."""
    dout, out, cu = _inputs(lengths, kind=kind)
    ops = pack_mx_do_operands(dout, out, cu)
    emu = quantize_operand(dout, cu, MXFP8.do, False, MXFP8)
    assert torch.equal(decode_token_rows(ops.do, ops.do_sf, cu), emu.along_d)
    assert torch.equal(decode_dim_rows(ops.do_t, ops.do_t_sf, cu), emu.along_t)
    if kind == "tiny":
        sd = (ops.do_sf[:, :int(sf_tile_starts(cu)[-1])].long() - 127).float()
        assert sd.min() == -126 and (emu.along_t.abs() < 2.0**-126).any() and (emu.along_t != 0).any()
    prod = dout.double() * out.double()
    ref = prod.sum(-1).T
    bound = 32 * 2.0**-24 * prod.abs().sum(-1).T  # the order's rounding: at most 18 adds deep
    assert ops.delta.dtype == torch.float32 and ops.delta.shape == ref.shape
    assert ((ops.delta.double() - ref).abs() <= bound).all()


def test_rowsum_order_is_the_kernels():
    """rowsum_do_o: 8 partial sums of 16 consecutive head dims, each left to right, then pairs; written
    out here element by element in fp32 (a different order gives different bits on these rows)."""
    dout, out, _ = _inputs([9], heads=2, kind="outliers", seed=5)
    got = rowsum_do_o(dout, out)
    for t in range(dout.shape[0]):
        for h in range(2):
            p = [torch.tensor(float(a), dtype=torch.float32) * torch.tensor(float(b), dtype=torch.float32)
                 for a, b in zip(dout[t, h].float(), out[t, h].float(), strict=True)]
            part = []
            for lane in range(8):
                acc = p[16 * lane]
                for j in range(1, 16):
                    acc = acc + p[16 * lane + j]
                part.append(acc)
            while len(part) > 1:
                part = [part[i] + part[i + 1] for i in range(0, len(part), 2)]
            assert torch.equal(got[h, t], part[0]), (t, h)
    prod = dout.float() * out.float()
    left_to_right = prod[..., 0]
    for j in range(1, 128):
        left_to_right = left_to_right + prod[..., j]
    assert not torch.equal(got, left_to_right.T)  # the order matters on these inputs


def test_chunks_mark_what_lies_past_a_document():
    """Token rows past a document's end and 32-token blocks that start past it hold 1.0 (127)."""
    dout, out, cu = _inputs([1, 129, 0, 40], heads=1)
    ops = pack_mx_do_operands(dout, out, cu)
    rows = torch.arange(128)[:, None]
    # document 0 (one token): rows 1..127 of its token-row chunk unused, blocks 1..3 of its dim-row chunk
    assert (ops.do_sf[0, 0, sf_byte_offset(rows[1:], torch.arange(4)[None, :]).flatten()] == SF_UNUSED).all()
    assert (ops.do_t_sf[0, 0, sf_byte_offset(rows, torch.arange(1, 4)[None, :]).flatten()] == SF_UNUSED).all()
    assert (ops.do_t_sf[0, 0, sf_byte_offset(rows, torch.zeros_like(rows)).flatten()] != SF_UNUSED).any()
    # document 3 (40 tokens, slot 3): blocks 0 and 1 used, 2 and 3 not
    assert (ops.do_t_sf[0, 3, sf_byte_offset(rows, torch.tensor([[2, 3]])).flatten()] == SF_UNUSED).all()
    assert (ops.do_t_sf[0, 3, sf_byte_offset(rows, torch.ones_like(rows)).flatten()] != SF_UNUSED).any()


def _global_blocks_along_tokens(dout, out, cu):
    """The leaky control: dO along the tokens in blocks of 32 counted from token 0, not from each
    document start (as the specification's values, (T, H, D))."""
    return mx_quantize(dout.float(), dim=0, block=MX_BLOCK)


def _spec_values(dout, out, cu):
    ops = pack_mx_do_operands(dout, out, cu)
    return torch.cat([decode_token_rows(ops.do, ops.do_sf, cu), decode_dim_rows(ops.do_t, ops.do_t_sf, cu),
                      ops.delta.T[..., None]], -1)


def _isolation_violations(fn, lengths):
    """Tokens outside document b whose values change when only document b's dO changes, for every b."""
    dout, out, cu = _inputs(lengths, heads=2, seed=3)
    base = fn(dout, out, cu)
    bad = 0
    for b in range(len(lengths)):
        s, e = int(cu[b]), int(cu[b + 1])
        if e == s:
            continue
        d2 = dout.clone()
        d2[s:e] = d2[s:e] * 64  # scales along the tokens change in every block of the document
        changed = (fn(d2, out, cu) != base).flatten(1).any(-1)
        changed[s:e] = False
        bad += int(changed.sum())
    return bad


def test_blocks_along_the_tokens_restart_at_each_document():
    """Document isolation: changing one document's dO changes nothing of any other document, in both
    orientations and D. The control, 32-token blocks counted from token 0 as a quantizer that ignores
    cu_seqlens would, leaks across every document start that is not a multiple of 32, and differs
    from the emulator there."""
    assert _isolation_violations(_spec_values, LENGTHS) == 0
    assert _isolation_violations(_global_blocks_along_tokens, LENGTHS) > 0
    dout, out, cu = _inputs(LENGTHS)
    emu = quantize_operand(dout, cu, MXFP8.do, False, MXFP8)
    assert not torch.equal(_global_blocks_along_tokens(dout, out, cu), emu.along_t)


def test_specification_rejects_bad_shapes():
    dout, out, cu = _inputs([40])
    with pytest.raises(ValueError, match="head_dim 128"):
        pack_mx_do_operands(dout[..., :64], out[..., :64], cu)
    with pytest.raises(ValueError, match="out must have dout's shape"):
        pack_mx_do_operands(dout, out[:, :1], cu)


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------


@needs_dsl
@pytest.mark.parametrize("arch, scan", [("sm_90a", True), ("sm_90a", False), ("sm_100a", True), ("sm_103a", False)])
def test_compiles_without_local_memory_and_with_rowsum_order(arch, scan):
    """Both orientations' e4m3 packs (128 values per row, two per cvt, each), D's 16 products per lane
    rounded before each add (mul.rn / add.rn, no fused multiply-add: rowsum_do_o's bits), wide accesses,
    no local memory under the 128-register cap."""
    art = kernel_artifacts(MxDoQuantizeConfig(scan_documents=scan), arch)
    assert f".target {arch}" in art.ptx
    assert len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", art.ptx)) == 2 * 64
    assert len(re.findall(r"mul\.rn\.f32", art.ptx)) == 8 * 16
    assert len(re.findall(r"add\.rn\.f32", art.ptx)) == 8 * (15 + 3)
    assert not re.search(r"\bfma\.", art.ptx) and ".local" not in art.ptx
    if art.frame_bytes is not None:
        assert art.frame_bytes == 0
    if art.registers is not None:
        assert art.registers <= 128
    if art.sass is not None:
        assert not re.search(r"\b(STL|LDL)\b", art.sass) and not re.search(r"\bFFMA\b", art.sass)
        # per lane: 8 steps of dO and O (two 16-byte loads each), dO again; the codes of both orientations
        assert len(re.findall(r"\bLDG\.E\.128\b", art.sass)) == 8 * 4 + 8 * 2
        assert len(re.findall(r"\bSTG\.E\.128\b", art.sass)) == 2 * 8


@needs_dsl
def test_input_errors():
    with pytest.raises(ValueError, match="MxDoQuantizeConfig.head_dim"):
        MxDoQuantizeConfig(head_dim=64)
    with pytest.raises(ValueError, match="MxDoQuantizeConfig.scan_documents"):
        MxDoQuantizeConfig(scan_documents=1)
    dout, out, cu = _inputs([40])
    with pytest.raises(ValueError, match="CUDA"):
        quantize_do_mx(dout, out, cu)
    with pytest.raises(ValueError, match=r"dout must be \(T, H, D\)"):
        quantize_do_mx(dout[0], out, cu)


MIXES = {
    "mixed": LENGTHS,
    "aligned": [128, 256, 512],
    "short": [5, 1, 33, 64, 96, 31, 7] * 3,
    "long": [4000, 93],
    "many": [(i * 7) % 13 + 1 for i in range(1100)],  # more than MAX_SCAN_DOCS: the host's prefix sums
}


@needs_dsl
@pytest.mark.gpu
@pytest.mark.sm90_sm100
@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("kind", ["normal", "outliers", "tiny"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_kernel_is_bit_exact_with_the_specification(mix, kind, scan):
    """Every byte the backward would read and every bit of D, on packed documents (odd lengths, starts
    off the 32-token grid, empty documents), against the specification on the CPU and on the GPU."""
    if mix == "many" and scan:
        pytest.skip("more than MAX_SCAN_DOCS documents: the host table whatever the config")
    dout, out, cu = _inputs(MIXES[mix], heads=4, kind=kind, seed=3, device="cuda")
    if mix == "mixed":
        dout[38:70] = 0  # an all-zero block along D and along the tokens (scale 1.0)
        dout[40:45, :, :64] *= 1e-30
    got = quantize_do_mx(dout, out, cu, MxDoQuantizeConfig(scan_documents=scan))
    used = int(sf_tile_starts(cu)[-1])  # chunk slots past the last tile are never read
    for want in (pack_mx_do_operands(dout, out, cu), pack_mx_do_operands(dout.cpu(), out.cpu(), cu.cpu())):
        for name in ("do", "do_t"):
            assert torch.equal(getattr(got, name).view(torch.uint8).cpu(), getattr(want, name).view(torch.uint8).cpu()), name
        for name in ("do_sf", "do_t_sf"):
            assert torch.equal(getattr(got, name)[:, :used].cpu(), getattr(want, name)[:, :used].cpu()), name
        assert torch.equal(got.delta.cpu().view(torch.int32), want.delta.cpu().view(torch.int32)), "delta"


@needs_dsl
@pytest.mark.gpu
@pytest.mark.sm90_sm100
def test_no_tokens_launches_nothing():
    dout, out, cu = _inputs([0, 0], device="cuda")
    got, want = quantize_do_mx(dout, out, cu), pack_mx_do_operands(dout, out, cu)
    for name in ("do", "do_sf", "do_t", "do_t_sf", "delta"):
        assert getattr(got, name).shape == getattr(want, name).shape, name
