"""The Blackwell (sm_100a) MXFP8 forward: its operand layout, its algorithm (the CPU tile model beside
the kernel) against the emulator, fp64 and the leakage definition, and the compiled code.

No Blackwell GPU is available: the kernel itself is checked by compiling it for sm_100a (PTX and
SASS); its numerics are the tile model's, which must equal the emulator of recipe mxfp8. The GPU test
runs only on an sm_100 device.
"""

from __future__ import annotations

import re

import pytest
import torch

from flamia_cute.cute_backend import _dsl_importable
from flamia_cute.emulator import emulate_forward, quantize_inputs
from flamia_cute.quant.mx_layout import (
    SF_UNUSED,
    decode_dim_rows,
    decode_token_rows,
    pack_mx_forward_operands,
    sf_byte_offset,
    sf_slots,
    sf_tile_starts,
    unpack_dim_rows_sf,
    unpack_token_rows_sf,
)
from flamia_cute.recipes import Recipe
from flamia_cute.reference import reference_attention
from flamia_cute.testing import check_leakage, make_inputs, rel_l2, sqnr_db

# only the DSL's absence skips these tests: an error in a project module fails its import
HAVE_DSL = _dsl_importable()
if HAVE_DSL:
    import cutlass

    from flamia_cute.sm100.attention_fwd import (
        TILE_MODEL_LSE_ABS,
        TILE_MODEL_REL_L2,
        FwdSm100Config,
        flamia_fwd_sm100,
        kernel_artifacts,
        mxfp8_forward_sm100,
        reference_attention_fn,
        reference_fwd_sm100,
        smem_bytes,
    )

needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl not importable")
MXFP8 = Recipe.from_name("mxfp8")
# The kernel against the tile model (sm_100 GPU only): the tensor core's fp32 accumulation order and
# the hardware exp2 differ from torch; as the Hopper kernels' bound against their emulator.
GPU_REL_L2 = 2e-3
GPU_LSE_ABS = 4e-3

LENGTH_SETS = [[1, 37, 200, 300, 130], [128, 256], [5, 1, 33, 64, 96, 31]]


# ----------------------------------------------------------------------------------------------
# The operand layout
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["normal", "outliers", "tiny"])
@pytest.mark.parametrize("lengths", LENGTH_SETS)
def test_packed_operands_are_the_emulators_quantization(lengths, kind):
    """Codes x decoded scale chunks equal the emulator's MX values of Q, K and V exactly: V's token-major
    codes with its dim-row chunks (P V's MN-major B); and bf16 holds Q's MX values exactly, so the
    kernel's conversion of Q's codes for the diagonal loses nothing (tiny: values down to bf16's
    subnormals, scales down to 2^-126)."""
    q, k, v, _, cu, _ = make_inputs(lengths, 4, 2, 128, kind="outliers" if kind == "outliers" else "normal", seed=1)
    if kind == "tiny":
        q, k, v = (x * 2.0**-120 for x in (q, k, v))
    T = q.shape[0]
    ops = pack_mx_forward_operands(q, k, v, cu)
    qo, ko, vo = quantize_inputs(q, k, v, cu, cu, MXFP8)
    sq, sk = unpack_token_rows_sf(ops.q_sf, cu, T), unpack_token_rows_sf(ops.k_sf, cu, T)
    assert torch.equal((ops.q.float().reshape(T, 4, 4, 32) * sq[..., None]).reshape(T, 4, 128), qo.along_d)
    assert torch.equal((ops.k.float().reshape(T, 2, 4, 32) * sk[..., None]).reshape(T, 2, 128), ko.along_d)
    assert ops.v.shape == v.shape and torch.equal(ops.v.float() * unpack_dim_rows_sf(ops.v_sf, cu, T), vo.along_t)
    assert torch.equal(decode_dim_rows(ops.v, ops.v_sf, cu), vo.along_t)
    q_vals = decode_token_rows(ops.q, ops.q_sf, cu)
    assert torch.equal(q_vals.to(torch.bfloat16).float(), q_vals)
    if kind == "tiny":
        assert (sq == 2.0**-126).any() and (q_vals.abs() < 2.0**-126).any() and (q_vals != 0).any()
    assert torch.equal(ops.k_diag, k) and torch.equal(ops.v_diag, v)


def test_scale_chunk_layout():
    """Chunk slots: ceil(len / 128) per document, in order; the byte of (row, block) is the
    BlockScaledBasicChunk's (16 (r % 32) + 4 (r // 32) + b, every byte of a chunk once); unused rows 1.0."""
    lengths = [1, 129, 0, 300]
    cu = torch.tensor([0, 1, 130, 130, 430], dtype=torch.int32)
    assert sf_tile_starts(cu).tolist() == [0, 1, 3, 3, 6] and sf_tile_starts(cu).dtype == torch.int32
    assert sf_slots(430, 4) >= 6
    r, b = torch.meshgrid(torch.arange(128), torch.arange(4), indexing="ij")
    assert sorted(sf_byte_offset(r, b).flatten().tolist()) == list(range(512))
    q, k, v, _, _, _ = make_inputs(lengths, 1, 1, 128, seed=2)
    ops = pack_mx_forward_operands(q, k, v, cu)
    # document 0 holds one token: rows 1..127 of its chunk are unused
    unused = sf_byte_offset(torch.arange(1, 128)[:, None], torch.arange(4)[None, :]).flatten()
    assert (ops.q_sf[0, 0, unused] == SF_UNUSED).all() and (ops.q_sf[0, 0, sf_byte_offset(0, 0)] != 0)
    # V: a document's key blocks past its end are unused (document 0: blocks 1-3 of its tile)
    v_unused = sf_byte_offset(torch.arange(128)[:, None], torch.arange(1, 4)[None, :]).flatten()
    assert (ops.v_sf[0, 0, v_unused] == SF_UNUSED).all()


@needs_dsl
def test_chunk_byte_offset_is_the_mma_scale_layout():
    """sf_byte_offset (what the packer writes and the softmax warps use for P's scales) is the DSL's
    BlockScaledBasicChunk, the layout tcgen05.cp copies into tensor memory, at every (row, block)."""
    import cutlass.cute as cute
    from cutlass.utils.blockscaled_layout import BlockScaledBasicChunk

    got = []

    @cute.jit
    def probe():
        layout = BlockScaledBasicChunk(32).layout
        for r in cutlass.range_constexpr(128):
            for b in cutlass.range_constexpr(4):
                got.append((r, b, cute.crd2idx(((r % 32, r // 32), (0, b)), layout)))  # static: traced once

    cute.compile(probe)
    assert len(got) == 512
    assert all(int(sf_byte_offset(torch.tensor(r), torch.tensor(b))) == i for r, b, i in got)


def test_pack_rejects_bad_shapes():
    q, k, v, _, cu, _ = make_inputs([64], 2, 2, 64, seed=0)
    with pytest.raises(ValueError, match="head_dim 128"):
        pack_mx_forward_operands(q, k, v, cu)
    q, k, v, _, cu, _ = make_inputs([64], 3, 2, 128, seed=0)
    with pytest.raises(ValueError, match="multiple of Hk"):
        pack_mx_forward_operands(q, k, v, cu)


# ----------------------------------------------------------------------------------------------
# The kernel's algorithm: the tile model
# ----------------------------------------------------------------------------------------------


@needs_dsl
@pytest.mark.parametrize("lengths, H, Hk", [(LENGTH_SETS[0], 4, 2), (LENGTH_SETS[1], 2, 2), (LENGTH_SETS[2], 4, 1)])
@pytest.mark.parametrize("kind", ["normal", "outliers"])
def test_tile_model_matches_emulator_and_fp64(lengths, H, Hk, kind):
    q, k, v, _, cu, scale = make_inputs(lengths, H, Hk, 128, kind=kind, seed=4)
    ops = pack_mx_forward_operands(q, k, v, cu)
    out, lse = reference_fwd_sm100(ops, cu, scale)
    oe, lsee, _ = emulate_forward(q, k, v, cu, cu, scale, True, MXFP8)
    assert rel_l2(out.float(), oe.float()) < TILE_MODEL_REL_L2
    assert (lse - lsee).abs().max().item() < TILE_MODEL_LSE_ABS
    ref = reference_attention(q, k, v, cu, cu, scale)
    # as accurate as the recipe's emulator against fp64 (within 0.05 dB), and on normal inputs above the
    # foundation issue's floor for O (tests/test_accuracy.py NORMAL_FLOORS; outliers have none)
    model_db, emu_db = sqnr_db(out.double(), ref["out"]), sqnr_db(oe.double(), ref["out"])
    assert abs(model_db - emu_db) < 0.05, (model_db, emu_db)
    if kind == "normal":
        assert model_db >= 26.0, model_db


@needs_dsl
def test_tile_model_mutants_fail():
    """The comparison can fail: P's block scale taken from the row max (one scale per row, as a
    per-row cast would) moves the output off the emulator."""
    q, k, v, _, cu, scale = make_inputs(LENGTH_SETS[0], 4, 2, 128, seed=4)
    ops = pack_mx_forward_operands(q, k, v, cu)
    oe, _, _ = emulate_forward(q, k, v, cu, cu, scale, True, MXFP8)
    bad, _ = reference_fwd_sm100(ops, cu, scale, bug="p_scale_from_row_max")  # measured 7.8e-3
    assert rel_l2(bad.float(), oe.float()) > 10 * TILE_MODEL_REL_L2
    with pytest.raises(ValueError, match="bug must be one of"):
        reference_fwd_sm100(ops, cu, scale, bug="typo")


@needs_dsl
def test_tile_model_does_not_leak_and_the_control_does():
    """The design note's leakage definition on the kernel's algorithm (future perturbation: O and LSE
    before the cut bit-identical; document isolation). The control runs the own 32-token block through
    the MX path: K's and V's block scales then carry the perturbed future keys into earlier queries."""
    q, k, v, _, cu, scale = make_inputs([70, 200, 45], 2, 1, 128, seed=6)
    rep = check_leakage(reference_attention_fn(scale), q, k, v, cu)
    assert rep.ok, str(rep)
    leaky = check_leakage(reference_attention_fn(scale, bug="no_own_block_bf16"), q, k, v, cu)
    assert not leaky.future_ok, str(leaky)


# ----------------------------------------------------------------------------------------------
# The kernel: compiled for sm_100a
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sm100_artifacts():
    cache = {}

    def get(**kw):
        key = tuple(sorted(kw.items()))
        if key not in cache:
            cache[key] = kernel_artifacts(FwdSm100Config(**kw), "sm_100a")
        return cache[key]

    return get


@needs_dsl
@pytest.mark.parametrize("group", [1, 4])
def test_compiles_with_block_scaled_tcgen05(sm100_artifacts, group):
    """Both products on the block-scaled tensor core, 4 k-steps per site (S: the diagonal, the second
    tile's before the loop and the loop's; P V: the diagonal's and the loop's), the diagonal's bf16
    products (8 k-steps each), scale chunks by tcgen05.cp, TMA loads (Q and V e4m3 only, no bf16 Q),
    the diagonal's bf16 Q converted from Q's codes in shared memory, P and O through tensor memory,
    no local memory."""
    art = sm100_artifacts(qhead_per_kvhead=group)
    ptx = art.ptx
    assert art.arch == "sm_100a"
    assert len(re.findall(r"tcgen05\.mma\.cta_group::1\.kind::mxf8f6f4\.block_scale\.block32", ptx)) == 20
    assert len(re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f16", ptx)) == 16
    # P V reads P from tensor memory: A is a [tmem] operand in 4 block-scaled and 8 bf16 MMAs
    assert len(re.findall(r"kind::mxf8f6f4\.block_scale\.block32\S* \[%r\d+\], \[%r\d+\],", ptx)) == 8
    assert len(re.findall(r"kind::f16\S* \[%r\d+\], \[%r\d+\],", ptx)) == 8
    assert len(re.findall(r"tcgen05\.cp\.cta_group::1\.32x128b\.warpx4", ptx)) >= 4
    assert "tcgen05.alloc" in ptx and "tcgen05.dealloc" in ptx
    # TMA: Q, K, V and their chunks, one box each; bf16 K and V of the diagonal, two 128-byte boxes each
    assert len(re.findall(r"cp\.async\.bulk\.tensor", ptx)) == 6 + 2 * 2
    # Q's bf16 MX values: a row's 128 codes, two per cvt, scaled; 16-byte stores into the swizzled tile
    assert len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx)) == 64
    assert len(re.findall(r"st\.shared\.v4\.b32", ptx)) == 16
    assert len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)) > 0
    assert ".local" not in ptx
    if art.frame_bytes is not None:
        assert art.frame_bytes == 0, art.frame_bytes
    if art.registers is not None:
        assert art.registers <= 255
    if art.sass is not None:
        assert len(re.findall(r"\bUTCQMMA\b", art.sass)) == 20
        assert len(re.findall(r"\bUTCHMMA\b", art.sass)) == 16
        assert not re.search(r"\b(STL|LDL)\b", art.sass)
        assert re.search(r"\bUTMALDG\b", art.sass) and re.search(r"\bLDTM\b", art.sass)
    assert smem_bytes(FwdSm100Config(qhead_per_kvhead=group)) <= 227 * 1024


@needs_dsl
def test_config_and_launch_errors():
    with pytest.raises(ValueError, match="FwdSm100Config.head_dim"):
        FwdSm100Config(head_dim=64)
    with pytest.raises(ValueError, match="FwdSm100Config.kv_stages"):
        FwdSm100Config(kv_stages=3)
    q, k, v, _, cu, scale = make_inputs([40], 2, 2, 128, seed=0)
    ops = pack_mx_forward_operands(q, k, v, cu)
    with pytest.raises(RuntimeError, match="Blackwell"):
        flamia_fwd_sm100(ops, cu, 40, scale)
    with pytest.raises(RuntimeError, match="Blackwell"):
        mxfp8_forward_sm100(q, k, v, cu, 40, scale)


@needs_dsl
@pytest.mark.gpu
@pytest.mark.sm100
@pytest.mark.parametrize("lengths", LENGTH_SETS)
def test_kernel_matches_tile_model_on_blackwell(lengths):  # pragma: no cover - no sm_100 GPU here
    q, k, v, _, cu, scale = make_inputs(lengths, 4, 2, 128, seed=7, device="cuda")
    ops = pack_mx_forward_operands(q, k, v, cu)
    out, lse = flamia_fwd_sm100(ops, cu, max(lengths), scale, poison_outputs=True)
    # the same through the fused quantization (bit-exactly these operands: test_quantize_mx_kernel)
    out2, lse2 = mxfp8_forward_sm100(q, k, v, cu, max(lengths), scale)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    ref_out, ref_lse = reference_fwd_sm100(
        pack_mx_forward_operands(q.cpu(), k.cpu(), v.cpu(), cu.cpu()), cu.cpu(), scale)
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel_l2(out.float().cpu(), ref_out.float()) < GPU_REL_L2
    assert (lse.cpu() - ref_lse).abs().max().item() < GPU_LSE_ABS
