"""`flamia-cute ptx` for every kernel and config on sm_90a, and the Blackwell ones on sm_100a and sm_103a,
without a GPU (what CI runs)."""

import re
import subprocess
import sys

import pytest

from flamia_cute.kernels import ATTENTION_CONFIGS, BLACKWELL_ARCHES, KERNELS, lane_divergent_collectives


def _ptx_all(out, arch):
    res = subprocess.run([sys.executable, "-m", "flamia_cute.cli", "ptx", "--all", "--arch", arch, "--out", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    blocks = {}
    for block in res.stdout.split("== ")[1:]:
        head, *lines = block.splitlines()
        name, cfg = re.match(r"(\w+) \[(\w+)\]", head).groups()
        vals = {}
        for line in lines:
            key, _, val = line.strip().rpartition(" ")
            vals[key.strip()] = val
        blocks[(name, cfg)] = vals
    return blocks, out


@pytest.fixture(scope="module")
def ptx_all(tmp_path_factory):
    return _ptx_all(tmp_path_factory.mktemp("ptx"), "sm_90a")


def test_every_kernel_and_config_compiled(ptx_all):
    blocks, out = ptx_all
    expected = {(k.name, c) for k in KERNELS.values() for c in k.configs if "sm_90a" in k.arches}
    assert set(blocks) == expected
    for name, cfg in expected:
        assert (out / f"{name}_{cfg}_sm_90a.ptx").stat().st_size > 0


# Blackwell per-CTA budgets, the same on sm_100 (B200) and sm_103 (B300): the DSL's SMEM_CAPACITY_MAP and
# TMEM_MAX_ALLOC_COLUMNS_MAP (test_blackwell_limits_are_the_dsls).
MAX_REGISTERS = 255
BLACKWELL_SMEM_BYTES = 232_448  # 227 KiB: the most one CTA may opt in to (228 KiB per SM, 1 KiB reserved)
BLACKWELL_TMEM_COLUMNS = 512


def _cubin_sm(path) -> int:
    """The SM a cubin is built for: bits 8-15 of the ELF header's e_flags (offset 48 in a 64-bit ELF)."""
    return (int.from_bytes(path.read_bytes()[48:52], "little") >> 8) & 0xFF


def test_blackwell_limits_are_the_dsls():
    pytest.importorskip("cutlass")
    from cutlass.cute.arch.tmem import get_max_tmem_alloc_cols
    from cutlass.cutlass_dsl.cutlass import SMEM_CAPACITY_MAP

    for sm in ("sm_100", "sm_103"):
        assert SMEM_CAPACITY_MAP[sm] == BLACKWELL_SMEM_BYTES == 227 * 1024
        assert get_max_tmem_alloc_cols(sm) == BLACKWELL_TMEM_COLUMNS


@pytest.mark.parametrize("arch", BLACKWELL_ARCHES)
def test_blackwell_kernels_within_budgets(tmp_path, arch):
    """`ptx --all --arch sm_100a / sm_103a`: every Blackwell kernel built for the arch (PTX target, cubin
    SM) within the per-CTA budgets: registers, no spills (no local memory, no stack), shared memory,
    tensor-memory columns; the forward's S and P V on block-scaled tcgen05.mma (20 per build: S at three
    sites and P V at two, 4 k-steps each), UTCQMMA in the SASS."""
    blocks, out = _ptx_all(tmp_path, arch)
    expected = {(k.name, c) for k in KERNELS.values() for c in k.configs if arch in k.arches}
    assert set(blocks) == expected and {n for n, _ in expected} == {"fwd_mx", "quantize_mx", "quantize_do_mx"}
    for (name, cfg), v in blocks.items():
        stem = out / f"{name}_{cfg}_{arch}"
        assert f".target {arch}" in stem.with_suffix(".ptx").read_text(), cfg
        assert _cubin_sm(stem.with_suffix(".cubin")) == int(arch[3:6]), cfg
        assert int(v["registers"]) <= MAX_REGISTERS, (name, cfg)
        assert int(v["ptx .local"]) == 0 and int(v["stack_frame_bytes"]) == 0, (name, cfg)
        assert int(v["shared_memory_bytes"]) <= BLACKWELL_SMEM_BYTES, (name, cfg)
        assert "sass STL/LDL (local memory)" in v, "no SASS: nvdisasm not found (the DSL ships one)"
        assert int(v["sass STL/LDL (local memory)"]) == 0, (name, cfg)
        if name != "fwd_mx":
            continue
        assert int(v["tensor_memory_columns"]) == 400 <= BLACKWELL_TMEM_COLUMNS, cfg
        assert int(v["ptx tcgen05.mma block_scale"]) == 20 and int(v["ptx wgmma e4m3"]) == 0, cfg
        assert int(v["sass UTCQMMA (fp8 tcgen05)"]) == 20 and int(v["sass UTCHMMA (16-bit tcgen05)"]) == 16, cfg


def test_summary_reports_shared_memory_within_the_sm90_limit(ptx_all):
    blocks, _ = ptx_all
    for key, v in blocks.items():
        low = 0 if key[0] in ("codes", "grad_rotate") else 1  # the code and dQ conversions run in registers
        assert low <= int(v["shared_memory_bytes"]) <= 227 * 1024, key


def test_forward_uses_fp8_wgmma_and_tma_without_spills(ptx_all):
    blocks, _ = ptx_all
    for (name, cfg), v in blocks.items():
        if name != "fwd":
            continue
        assert int(v["ptx wgmma e4m3"]) > 0 and int(v["ptx cp.async.bulk.tensor"]) > 0, cfg
        assert int(v["ptx .local"]) == 0 and int(v["stack_frame_bytes"]) == 0, cfg
        if "sass QGMMA (fp8 wgmma)" in v:
            assert int(v["sass QGMMA (fp8 wgmma)"]) > 0 and int(v["sass STL/LDL (local memory)"]) == 0, cfg
            assert int(v["sass HGMMA (16-bit wgmma)"]) == 0, cfg


def test_quantize_packs_e4m3_with_wide_accesses(ptx_all):
    blocks, _ = ptx_all
    for (name, cfg), v in blocks.items():
        if name != "quantize":
            continue
        assert int(v["ptx cvt e4m3x2"]) > 0, cfg
        if "sass STG.128" in v:
            assert int(v["sass STG.128"]) > 0 and int(v["sass LDG.128"]) > 0, cfg
            assert int(v["sass STL/LDL (local memory)"]) == 0, cfg


def test_ptx_rejects_unknown_names():
    res = subprocess.run([sys.executable, "-m", "flamia_cute.cli", "ptx", "nope"], capture_output=True, text=True)
    assert res.returncode == 2 and "unknown kernel" in res.stderr
    res = subprocess.run([sys.executable, "-m", "flamia_cute.cli", "ptx", "fwd", "--arch", "sm_100a"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "sm_100a" in res.stderr


def test_ptx_set_values():
    """--set takes bare strings as well as JSON, and names what is wrong."""
    from flamia_cute.cli import _set_value

    assert _set_value("longest_documents") == "longest_documents"
    assert _set_value('"documents"') == "documents"
    assert _set_value("3") == 3 and _set_value("False") is False and _set_value("true") is True
    ptx = [sys.executable, "-m", "flamia_cute.cli", "ptx", "fwd"]
    res = subprocess.run(ptx + ["--set", "kv_stages"], capture_output=True, text=True)
    assert res.returncode == 2 and "FIELD=VALUE" in res.stderr
    res = subprocess.run(ptx + ["--set", "tile_order=bogus"], capture_output=True, text=True)
    assert res.returncode == 2 and "FwdConfig.tile_order" in res.stderr


def test_bf16_ds_backward_mixes_fp8_and_bf16_wgmma_without_spills(ptx_all):
    """The bf16-dS backward: S^T, dP^T, dV on e4m3 wgmma (QGMMA), dK, dQ on bf16 wgmma (HGMMA), no
    local memory in any named config."""
    blocks, _ = ptx_all
    seen = 0
    for (name, cfg), v in blocks.items():
        if name != "bwd_dsbf16":
            continue
        seen += 1
        assert int(v["ptx wgmma e4m3"]) >= 3 and int(v["ptx wgmma bf16"]) >= 2, cfg
        assert int(v["ptx .local"]) == 0 and int(v["stack_frame_bytes"]) == 0, cfg
        if "sass QGMMA (fp8 wgmma)" in v:
            assert int(v["sass QGMMA (fp8 wgmma)"]) >= 3 and int(v["sass HGMMA (16-bit wgmma)"]) >= 2, cfg
            assert int(v["sass STL/LDL (local memory)"]) == 0, cfg
    assert seen == len(ATTENTION_CONFIGS) + 1  # and the dK epilogue with rotations


def test_no_kernel_runs_a_warp_collective_on_some_lanes_only(ptx_all):
    blocks, _ = ptx_all
    for key, v in blocks.items():
        assert int(v["ptx collectives under a lane branch"]) == 0, key


# A TMA copy called from lane 0 alone (the deadlock of the first dq_tma_reduce build) and the same
# copy issued by the whole warp, which elects its lane itself.
_ONE_LANE_COPY = """
	mov.u32 	%r44, %laneid;
	setp.ne.b32 	%p192, %r44, 0;
	bar.sync 	4, 288;
	@%p192 bra 	$L__BB0_95;
	elect.sync 	%r2327|%p193, -1;
	cp.async.bulk.commit_group;
$L__BB0_95:
	bar.arrive 5, 288;
"""
_WARP_COPY = """
	mov.u32 	%r44, %laneid;
	add.s32 	%r45, %r44, 1;
	bar.sync 	4, 288;
	elect.sync 	%r2327|%p193, -1;
	@%p193 bra 	$L__BB0_95;
	cp.async.bulk.commit_group;
$L__BB0_95:
	setp.ne.b32 	%p197, %r45, 1;
	@%p197 bra 	$L__BB0_96;
	st.global.u32 	[%rd1], %r45;
	bra.uni 	$L__BB0_97;
$L__BB0_96:
	bar.arrive 5, 288;
$L__BB0_97:
"""


def test_lane_divergence_lint_flags_a_one_lane_collective():
    assert len(lane_divergent_collectives(_ONE_LANE_COPY)) == 1
    # derived through arithmetic: still lane-varying
    derived = _ONE_LANE_COPY.replace("setp.ne.b32 \t%p192, %r44, 0;", "and.b32 \t%r46, %r44, 3;\n\tsetp.ne.b32 \t%p192, %r46, 0;")
    assert derived != _ONE_LANE_COPY
    assert len(lane_divergent_collectives(derived)) == 1
    # a branch on the elected predicate, and a lane branch whose fall-through path ends before the barrier
    assert lane_divergent_collectives(_WARP_COPY) == []


def test_softmax_bounds_hold_at_any_magnitude(ptx_all):
    """P <= 1 however large the scores (docs/numerics.md, "Large magnitudes"): the forward rounds each
    row's max and its LSE up (mul.rp / add.rp: directed rounding, which the compiler neither drops nor
    folds into a round-to-nearest FFMA); the backward rounds lse * log2e up."""
    blocks, out = ptx_all
    for name, cfg in blocks:
        ptx = (out / f"{name}_{cfg}_sm_90a.ptx").read_text()
        if name == "fwd":
            assert ptx.count("mul.rp.f32") >= 4 and ptx.count("add.rp.f32") >= 2, cfg
        if name == "bwd_dsbf16":
            assert ptx.count("mul.rp.f32") >= 1, cfg


def test_module_with_arguments_is_the_cli():
    """`python -m flamia_cute --help` prints the CLI's help (the demo runs only without arguments)."""
    res = subprocess.run([sys.executable, "-m", "flamia_cute", "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage: flamia-cute") and "demo on" not in res.stdout
