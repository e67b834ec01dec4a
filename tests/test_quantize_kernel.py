"""Fused FP8 quantization kernel (sm_90a): compile checks on CPU, bit-exactness on an sm_90 GPU.

CPU tests build real sm_90a cubins from fake pointers (no GPU) and inspect PTX/SASS.
GPU tests (marker `gpu`) compare against quant.quantize_thd byte for byte.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flamia_cute.cute_backend import _dsl_importable
from flamia_cute.quant import (
    DT_DOC_ALIGN,
    PV_ORDER16,
    dt_cu_seqlens,
    quantize_attention_operands,
    quantize_thd,
    round_up,
    transposed_tokens,
)
from flamia_cute.schedules.varlen_chunks import build_varlen_chunks, chunk_grid_slots, locate_chunk_model, max_chunks

# only the DSL's absence skips these tests: an error in a project module fails its import
HAVE_DSL = _dsl_importable()
if HAVE_DSL:
    from flamia_cute import compile_cache
    from flamia_cute.sm90.quantize import (
        SOURCE_FILES,
        MultiQuantizeConfig,
        QuantizeConfig,
        compile_fused_quantize_sm90,
        dout_delta_config,
        forward_only,
        fused_quantize_multi_sm90,
        fused_quantize_sm90,
        kernel_artifacts,
        qkv_config,
        quantize_with_rowdot_sm90,
    )

needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl not importable")
REPO = Path(__file__).resolve().parents[1]


def _cu(lengths, device="cpu"):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


# ----------------------------------------------------------------------------------------------
# CPU: chunk table
# ----------------------------------------------------------------------------------------------


def _chunks_reference(lengths, tile=128):
    rows, start = [], 0
    for n in lengths:
        for k in range(0, n, tile):
            rows.append((start + k, min(tile, n - k)))
        start += n
    return rows


@pytest.mark.parametrize(
    "lengths",
    [[16384], [1], [0, 5, 0], [128, 129, 127, 1, 0, 256], [4096] * 4, [3, 1000, 0, 0, 77, 5000, 1]],
)
def test_varlen_chunks_match_python(lengths):
    T = sum(lengths)
    table = build_varlen_chunks(_cu(lengths), T)
    assert table.dtype == torch.int32 and table.shape == (max_chunks(T, len(lengths)), 2)
    ref = _chunks_reference(lengths)
    got = [tuple(r) for r in table.tolist()]
    assert got[: len(ref)] == ref
    assert all(r == (0, 0) for r in got[len(ref) :])


def test_varlen_chunks_upper_bound_is_tight_enough():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.choice([0, 1, 127, 128, 129, rng.randint(0, 3000)]) for _ in range(rng.randint(1, 12))]
        assert len(_chunks_reference(lengths)) <= max_chunks(sum(lengths), len(lengths))


# ----------------------------------------------------------------------------------------------
# CPU: the kernel's table-free chunk location and data_dt coverage (Python model of its index math)
# ----------------------------------------------------------------------------------------------

TILE = 128
SEG = 16  # data_dt segment: 16 fp8 = one 16-byte store


def _cu_list(lengths):
    return [0] + [sum(lengths[: i + 1]) for i in range(len(lengths))]


def _model_dt_writes(lengths, threads):
    """Columns of data_dt that the kernel writes, per CTA of one head group: {column: token or None (zero)}.

    Mirrors sm90/quantize.py: a chunk CTA writes segment g (columns dcol + 16g ..) when 16g <
    round_up(n, DT_DOC_ALIGN), token dcol-relative tau for tau < n and 0 beyond; a spare CTA s of S
    zeroes 128-column tail blocks s, s + S, ... from dt_total, whole segments below T_dt.
    """
    T, nd = sum(lengths), len(lengths)
    cu = _cu_list(lengths)
    Tdt = transposed_tokens(T, nd)
    slots = chunk_grid_slots(T, nd)
    writes = {}

    def put(col, tok):
        assert col not in writes, f"column {col} written twice"
        assert 0 <= col < Tdt
        writes[col] = tok

    for cta in range(slots):
        r = locate_chunk_model(cu, cta, threads, align=DT_DOC_ALIGN)
        if r[0] == "chunk":
            _, start, n, dcol = r
            assert dcol % SEG == 0 and 1 <= n <= TILE
            for g in range(TILE // SEG):
                if SEG * g < round_up(n, DT_DOC_ALIGN):
                    for b in range(SEG):
                        tau = SEG * g + b
                        put(dcol + tau, start + tau if tau < n else None)
        else:
            _, tot_c, tot_p = r
            assert tot_p % SEG == 0 and Tdt % TILE == 0
            S = slots - tot_c
            assert S >= 1
            n_blk = (Tdt - tot_p + TILE - 1) // TILE
            for blk in range(cta - tot_c, n_blk, S):
                for g in range(TILE // SEG):
                    seg = tot_p // SEG + blk * (TILE // SEG) + g
                    if seg < Tdt // SEG:
                        for b in range(SEG):
                            put(seg * SEG + b, None)
    return writes, Tdt


LONGTAIL32K = [216, 2820, 2164, 441, 1026, 895, 1581, 2331, 147, 43, 2709, 850, 2154, 32, 884, 1917, 389, 4358]
LONGTAIL32K += [3475, 46, 38, 1169, 3083]
MODEL_CASES = [
    [16384],
    [1],
    [0, 5, 0],
    [128, 129, 127, 1, 0, 256],
    [4096] * 4,
    [3, 1000, 0, 0, 77, 5000, 1],
    [16, 192, 16],  # one spare CTA zeroes two tail blocks
    [16] * 40,
    [144] * 9,
    [17, 15, 33, 0, 0, 1],
    LONGTAIL32K,
]


@pytest.mark.parametrize("threads", [256, 4, 1])
@pytest.mark.parametrize("lengths", MODEL_CASES)
def test_in_kernel_chunk_location_matches_table(lengths, threads):
    """The block scan (threads own ceil(docs/threads) documents each) finds the table's chunks in order."""
    T, nd = sum(lengths), len(lengths)
    cu = _cu_list(lengths)
    ref = _chunks_reference(lengths)
    dt_start = dt_cu_seqlens(torch.tensor(cu, dtype=torch.int32)).tolist()
    for cta in range(chunk_grid_slots(T, nd)):
        got = locate_chunk_model(cu, cta, threads, align=DT_DOC_ALIGN)
        if cta < len(ref):
            start, n = ref[cta]
            doc = max(b for b in range(nd) if cu[b] <= start and lengths[b] > 0 and start < cu[b + 1])
            assert got == ("chunk", start, n, dt_start[doc] + start - cu[doc])
        else:
            assert got == ("spare", len(ref), dt_start[-1])


@pytest.mark.parametrize("threads", [256, 3])
@pytest.mark.parametrize("lengths", MODEL_CASES)
def test_model_writes_every_dt_column_once(lengths, threads):
    """Every column of data_dt is written exactly once: tokens where quantize_thd puts them, 0 elsewhere."""
    writes, Tdt = _model_dt_writes(lengths, threads)
    assert sorted(writes) == list(range(Tdt)), "some data_dt column is never written"
    cu = _cu_list(lengths)
    dt_start = dt_cu_seqlens(torch.tensor(cu, dtype=torch.int32)).tolist()
    expect = {}
    for b, n in enumerate(lengths):
        assert dt_start[b] % DT_DOC_ALIGN == 0
        for p in range(n):
            expect[dt_start[b] + p] = cu[b] + p
    assert {c: t for c, t in writes.items() if t is not None} == expect


def test_model_writes_random_mixes():
    rng = random.Random(7)
    for _ in range(150):
        nd = rng.randint(1, 40)
        lengths = [rng.choice([0, 1, 15, 16, 17, 112, 128, 144, rng.randint(0, 700)]) for _ in range(nd)]
        writes, Tdt = _model_dt_writes(lengths, rng.choice([256, 5, 2]))
        assert sorted(writes) == list(range(Tdt))


# ----------------------------------------------------------------------------------------------
# CPU: config validation and compilation for sm_90a
# ----------------------------------------------------------------------------------------------


@needs_dsl
@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(head_dim=96, num_heads=4), "head_dim"),
        (dict(head_dim=128, num_heads=0), "num_heads"),
        (dict(head_dim=128, num_heads=4, block_tokens=32), "block_tokens"),
        (dict(head_dim=128, num_heads=4, block_tokens=1, emit_token_copy=True), "emit_token_copy"),
        (dict(head_dim=128, num_heads=4, tile_tokens=64), "tile_tokens"),
        (dict(head_dim=128, num_heads=4, threads=288), "threads"),
        (dict(head_dim=128, num_heads=6, heads_per_cta=4), "heads_per_cta"),
        (dict(head_dim=128, num_heads=6, heads_per_cta=3), "heads_per_cta"),
        (dict(head_dim=256, num_heads=4, heads_per_cta=4), "heads_per_cta"),
        (dict(head_dim=128, num_heads=6, doc_scale_max_group=4), "doc_scale_max_group"),
        (dict(head_dim=128, num_heads=6, doc_scale_max_group=-1), "doc_scale_max_group"),
        (dict(head_dim=128, num_heads=4, block_tokens=128, emit_token_copy=True, doc_scale_max_group=2),
         "doc_scale_max_group"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"QuantizeConfig\.{field}"):
        QuantizeConfig(**kwargs)


@needs_dsl
def test_config_auto_heads_per_cta():
    assert QuantizeConfig(head_dim=64, num_heads=32).heads_per_cta == 2
    assert QuantizeConfig(head_dim=64, num_heads=3).heads_per_cta == 1
    assert QuantizeConfig(head_dim=128, num_heads=16).heads_per_cta == 1
    assert QuantizeConfig(head_dim=128, num_heads=16).threads == 256


def _count(pattern, text):
    return len(re.findall(pattern, text, flags=re.M))


COMPILE_CASES = [(d, b, tok) for d in (64, 128, 256) for (b, tok) in ((1, False), (128, False), (128, True))] + [(128, 64, True)]


@needs_dsl
@pytest.mark.parametrize("head_dim, block, token_copy", COMPILE_CASES)
def test_compiles_for_sm90a(head_dim, block, token_copy):
    cfg = QuantizeConfig(head_dim=head_dim, num_heads=16, block_tokens=block, emit_token_copy=token_copy)
    art = kernel_artifacts(cfg, "sm_90a")
    ptx = art.ptx
    sets = cfg.num_sets
    assert re.search(r"^\.target sm_90a", ptx, flags=re.M)
    # e4m3 conversion through the hardware pack instruction, 2 values per cvt
    assert _count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx) >= sets * 32
    # 16-byte global loads of x and 16-byte stores of data_td / data_dt
    assert _count(r"ld\.global(\.[a-z0-9:_]+)*\.(v4\.(b|u|s)32|b128)", ptx) >= 8
    assert _count(r"st\.global(\.[a-z0-9:_]+)*\.(v4\.(b|u|s)32|b128)", ptx) >= 3 * sets
    # scaling must keep fp32 denormals (torch on CPU does): no flush-to-zero multiply
    assert _count(r"mul\.rn\.f32|mul\.f32", ptx) >= sets * 64
    assert "mul.ftz" not in ptx and "mul.rn.ftz" not in ptx
    # data_dt documents start 16-aligned: no byte stores anywhere (they were the longtail bottleneck)
    assert _count(r"st\.global(\.[a-z0-9:_]+)*\.(u8|b8|s8)\b", ptx) == 0
    assert art.frame_bytes in (0, None), "register spills to local memory"
    if art.registers is not None and head_dim <= 128:
        # CTAs of 256 threads per SM that the 64K-register file holds: 4 at <= 64 registers (head
        # dim 128, the benchmarked case), at least 3 (as the 288-thread kernel) for head dim 64
        need = 4 if head_dim == 128 else 3
        assert 65536 // (cfg.threads * round_up(art.registers, 8)) >= need, f"{art.registers} registers"
    if art.sass is not None:
        assert _count(r"F2FP\.SATFINITE\.E4M3\.F32\.PACK_AB", art.sass) >= sets * 32
        assert _count(r"LDG\.E\.128", art.sass) >= 8
        assert _count(r"STG\.E\.128", art.sass) >= 3 * sets
        assert _count(r"STG\.E\.U8|STG\.E\.S8", art.sass) == 0
        assert _count(r"\b(STL|LDL)", art.sass) == 0
        # the chunk is found in-kernel by a warp scan (shfl.up), not read from a table
        assert _count(r"SHFL\.UP", art.sass) >= 10


@needs_dsl
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_dout_delta_compiles_for_sm90a(head_dim):
    """The backward's preprocess launch: dO quantized and D = rowsum(dO * O) from the same read."""
    cfg = dout_delta_config(head_dim, 2048 // head_dim)
    art = kernel_artifacts(cfg, "sm_90a")
    plain = kernel_artifacts(dataclasses.replace(cfg.parts[0], emit_rowdot=False), "sm_90a")
    # O is read with 16-byte loads too: twice the plain kernel's global loads
    loads = r"ld\.global(\.[a-z0-9:_]+)*\.(v4\.(b|u|s)32|b128)"
    assert _count(loads, art.ptx) == 2 * _count(loads, plain.ptx)
    # the 16 products of a lane in fp32 (fused multiply-add chain or mul + add), no ftz
    assert _count(r"fma\.rn\.f32|mul\.rn\.f32", art.ptx) >= _count(r"fma\.rn\.f32|mul\.rn\.f32", plain.ptx) + 16
    assert "ftz" not in art.ptx
    # a 32-bit store of D per token row, beside the scale store
    assert _count(r"st\.global\.b32", art.ptx) > _count(r"st\.global\.b32", plain.ptx)
    assert cfg.min_ctas_per_sm == (3 if head_dim <= 128 else 0)
    if head_dim == 128:  # the benchmarked case: no spills at 3 CTAs per SM
        assert art.frame_bytes in (0, None), "register spills to local memory"


@needs_dsl
def test_rowdot_config_and_argument_errors():
    part = dataclasses.replace(dout_delta_config(128, 16).parts[0])
    with pytest.raises(ValueError, match="only the first part may have emit_rowdot"):
        MultiQuantizeConfig((QuantizeConfig(head_dim=128, num_heads=16), part))
    x = torch.zeros(8, 16, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="y must be a bf16 tensor like x"):
        quantize_with_rowdot_sm90(x, torch.zeros(8, 16, 64, dtype=torch.bfloat16), cu, part)
    with pytest.raises(ValueError, match="y must be a bf16 tensor like x"):
        quantize_with_rowdot_sm90(x, x.float(), cu, part)
    with pytest.raises(ValueError, match="emit_rowdot=True"):
        quantize_with_rowdot_sm90(x, x, cu, QuantizeConfig(head_dim=128, num_heads=16))


@needs_dsl
def test_doc_scale_max_compiles_and_checks_its_argument():
    """dv_ref from the dO pass: shared-memory max per head, one global atomic max per (CTA, head);
    the launch refuses a missing or misshapen docmax, and a docmax the config does not write."""
    cfg = dout_delta_config(128, 16, 2)
    art = kernel_artifacts(cfg, "sm_90a")
    plain = kernel_artifacts(dout_delta_config(128, 16), "sm_90a")
    assert _count(r"atom\.shared\.max\.s32", art.ptx) == 1 and _count(r"atom\.global\.max\.s32", art.ptx) == 1
    assert "atom." not in plain.ptx
    # 8 bytes of stack (two values around the rowdot, once per CTA, not in a loop) at 80 registers
    assert art.frame_bytes in (0, 8, None)
    with pytest.raises(ValueError, match="only the first part may have emit_rowdot or doc_scale_max_group"):
        MultiQuantizeConfig((QuantizeConfig(head_dim=128, num_heads=16), cfg.parts[0]))
    x = torch.zeros(8, 16, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="docmax is needed exactly"):
        quantize_with_rowdot_sm90(x, x, cu, cfg)
    with pytest.raises(ValueError, match="docmax is needed exactly"):
        quantize_with_rowdot_sm90(x, x, cu, dout_delta_config(128, 16), docmax=torch.zeros(8, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"docmax must be .* \(8, 2\)"):
        quantize_with_rowdot_sm90(x, x, cu, cfg, docmax=torch.zeros(16, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="docmax must be"):
        quantize_with_rowdot_sm90(x, x, cu, cfg, docmax=torch.zeros(8, 2, dtype=torch.float32))


@needs_dsl
def test_compiles_for_transposed_off():
    cfg = QuantizeConfig(head_dim=128, num_heads=8, block_tokens=128, emit_transposed=False)
    ptx = compile_fused_quantize_sm90(cfg, "sm_90a", "--keep-ptx").__ptx__
    assert "bar.sync" in ptx  # block amax and the chunk scan still need CTA barriers
    # per-warp amax, scan totals, chunk info (the scan loop is unrolled); the tile alone would be 16+
    assert _count(r"st\.shared", ptx) < 16
    assert _count(r"st\.shared\.v4", ptx) == 0  # the tile is written in 32-bit words; none here
    assert "prmt.b32" not in ptx  # no byte transposes


# ----------------------------------------------------------------------------------------------
# CPU: the Q/K/V variant (one launch for up to three tensors)
# ----------------------------------------------------------------------------------------------


def _model_cta_decode(head_groups, slots, raster):
    """sm90/quantize.py's flat CTA -> (part, chunk slot, head group), in Python."""
    out = []
    for lin in range(slots * sum(head_groups)):
        pid, local, base = 0, lin, 0
        for p in range(1, len(head_groups)):
            base += slots * head_groups[p - 1]
            if lin >= base:
                pid, local = p, lin - base
        nhg = head_groups[pid]
        if raster == "heads":
            c, h = local // nhg, local % nhg
        else:
            h, c = local // slots, local % slots
        out.append((pid, c, h))
    return out


@pytest.mark.parametrize("raster", ["heads", "chunks"])
@pytest.mark.parametrize("head_groups", [(16,), (16, 16, 16), (32, 8, 8), (16, 4, 4), (3, 1, 1), (1, 2)])
@pytest.mark.parametrize("slots", [1, 2, 130, 280])
def test_qkv_cta_decode_covers_every_work_item_once(head_groups, slots, raster):
    got = _model_cta_decode(head_groups, slots, raster)
    want = {(p, c, h) for p, nhg in enumerate(head_groups) for c in range(slots) for h in range(nhg)}
    assert len(got) == len(want) and set(got) == want
    if raster == "heads" and len(head_groups) == 1:
        # CTAs that run together cover all heads of consecutive chunks
        assert got[: head_groups[0]] == [(0, 0, h) for h in range(head_groups[0])]


@needs_dsl
def test_multi_config_validation_and_qkv_config():
    q = QuantizeConfig(head_dim=128, num_heads=32)
    kv = QuantizeConfig(head_dim=128, num_heads=8, block_tokens=128, emit_token_copy=True)
    with pytest.raises(ValueError, match=r"MultiQuantizeConfig\.parts"):
        MultiQuantizeConfig((q, kv, kv, kv))
    with pytest.raises(ValueError, match=r"MultiQuantizeConfig\.parts"):
        MultiQuantizeConfig(())
    with pytest.raises(ValueError, match=r"MultiQuantizeConfig\.raster"):
        MultiQuantizeConfig((q,), raster="diagonal")
    with pytest.raises(ValueError, match=r"MultiQuantizeConfig\.smem_carveout"):
        MultiQuantizeConfig((q,), smem_carveout=101)
    m = qkv_config(128, 32, 8, 128)
    v = QuantizeConfig(head_dim=128, num_heads=8, block_tokens=128, emit_token_copy=True, dt_pv_order=True)
    assert m.parts == (dataclasses.replace(q, dt_pv_order=True), kv, v) and m.head_groups == (32, 8, 8)
    assert m is qkv_config(128, 32, 8, 128)  # cached: no config is built per attention call
    assert m.grid_ctas(16384, 1) == chunk_grid_slots(16384, 1) * 48
    t = qkv_config(128, 16, 16, 1)
    assert all(p.block_tokens == 1 and not p.emit_token_copy for p in t.parts)
    assert MultiQuantizeConfig(q).parts == (q,)  # a bare QuantizeConfig is one part


@needs_dsl
@pytest.mark.parametrize("block", [1, 128])
@pytest.mark.parametrize("T, docs", [(16384, 1), (32768, 23), (1, 1), (300, 4)])
def test_qkv_output_buffer_layout(T, docs, block):
    """All outputs are views of one allocation: disjoint, 512-byte aligned, inside the buffer."""
    from flamia_cute.sm90.quantize import _layout_outputs

    m = qkv_config(128, 32, 8, block)
    Tdt = transposed_tokens(T, docs)
    plan, nbytes = _layout_outputs(m, T, Tdt)
    spans = []
    for cfg, part in zip(m.parts, plan, strict=True):
        assert len(part) == cfg.num_sets
        for st in part:
            for kind, shape, _stride, off in st:
                n = 1
                for d in shape:
                    n *= d
                size = n * (4 if kind == "f32" else 1)
                assert off % 512 == 0
                spans.append((off, off + size))
            assert st[0][1] == (T, cfg.num_heads, 128) and st[1][1] == (cfg.num_heads, 128, Tdt)
            assert st[2][1] == (cfg.num_heads, T)
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert spans[-1][1] <= nbytes


QKV_COMPILE_CASES = [(128, 16, 16, 1), (128, 16, 16, 128), (128, 32, 8, 128), (64, 32, 32, 128), (64, 32, 32, 1)]


@needs_dsl
@pytest.mark.parametrize("D, hq, hkv, block", QKV_COMPILE_CASES)
def test_qkv_variant_compiles_for_sm90a(D, hq, hkv, block):
    m = qkv_config(D, hq, hkv, block)
    art = kernel_artifacts(m, "sm_90a")
    ptx = art.ptx
    sets = sum(p.num_sets for p in m.parts)
    assert re.search(r"^\.target sm_90a", ptx, flags=re.M)
    assert re.search(rf"^\s*\.minnctapersm {m.min_ctas_per_sm}\b", ptx, flags=re.M)
    assert _count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx) >= sets * 32
    assert _count(r"st\.global(\.[a-z0-9:_]+)*\.(u8|b8|s8)\b", ptx) == 0
    assert "mul.ftz" not in ptx and "mul.rn.ftz" not in ptx
    assert art.frame_bytes in (0, None), "register spills to local memory"
    if art.registers is not None:
        assert 65536 // (256 * round_up(art.registers, 8)) >= m.min_ctas_per_sm, f"{art.registers} registers"
    if art.sass is not None:
        assert _count(r"F2FP\.SATFINITE\.E4M3\.F32\.PACK_AB", art.sass) >= sets * 32
        assert _count(r"LDG\.E\.128", art.sass) >= 8 * 3  # every part loads x with 16-byte loads
        assert _count(r"STG\.E\.128", art.sass) >= 3 * sets
        assert _count(r"STG\.E\.U8|STG\.E\.S8", art.sass) == 0
        assert _count(r"\b(STL|LDL)", art.sass) == 0
        assert _count(r"SHFL\.UP", art.sass) >= 10  # one chunk scan, shared by the three parts
        assert _count(r"SHFL\.UP", art.sass) < 30


@needs_dsl
@pytest.mark.parametrize("D, hq, hkv, block", QKV_COMPILE_CASES)
def test_forward_only_launch_writes_only_what_is_read(D, hq, hkv, block):
    """forward_only(qkv_config) (an inference call, and the bf16-dS recipe's training call): Q and K
    token-major only, V transposed only (P-fragment order kept), the same scales; fewer 16-byte
    stores than the full launch, no spills, the launch settings kept."""
    import flamia_cute.sm90.quantize as qs

    full = qkv_config(D, hq, hkv, block)
    lean = qs.forward_only(full)
    q, k, v = lean.parts
    assert (q.emit_token_major, q.emit_transposed, q.dt_pv_order) == (True, False, False)
    assert (k.emit_token_major, k.emit_transposed) == (True, False) and k.emit_token_copy == (block > 1)
    assert (v.emit_token_major, v.emit_transposed, v.dt_pv_order) == (False, True, True)
    assert lean.raster == full.raster and lean.min_ctas_per_sm == min(full.min_ctas_per_sm, 4)
    art, full_art = kernel_artifacts(lean, "sm_90a"), kernel_artifacts(full, "sm_90a")
    stores = r"st\.global(\.[a-z0-9:_]+)*\.(v4\.(b|u|s)32|b128)"
    assert _count(stores, art.ptx) < _count(stores, full_art.ptx)
    assert art.frame_bytes in (0, None), "register spills to local memory"
    plan, nbytes = qs._layout_outputs(lean, 1000, 1152)
    (qp,), kp, vp = plan
    assert qp[0] is not None and qp[1] is None and all(s_[1] is None for s_ in kp)
    assert all(s_[0] is None and s_[1] is not None for s_ in vp)
    assert nbytes < qs._layout_outputs(full, 1000, 1152)[1]


@needs_dsl
def test_a_part_must_emit_a_layout():
    with pytest.raises(ValueError, match="emit_token_major"):
        QuantizeConfig(head_dim=128, num_heads=4, emit_token_major=False, emit_transposed=False)


@needs_dsl
def test_qkv_shared_memory_fits_the_register_occupancy():
    """The CTAs that the registers allow also fit in shared memory under the max carveout."""
    for block in (1, 128):
        m = qkv_config(128, 16, 16, block)
        assert m.smem_carveout == 100
        per_cta = m.smem_bytes + 1024  # + the 1 KB the driver reserves per CTA
        assert m.min_ctas_per_sm * per_cta <= 228 * 1024



# ----------------------------------------------------------------------------------------------
# CPU: compile cache
# ----------------------------------------------------------------------------------------------


@needs_dsl
def test_cache_key_changes_with_source_config_arch(tmp_path):
    src = tmp_path / "kernel.py"
    src.write_text("A = 1\n")
    cfg = QuantizeConfig(head_dim=128, num_heads=16, block_tokens=128)
    k0 = compile_cache.cache_key([src], cfg, "sm_90a")
    assert k0 == compile_cache.cache_key([src], QuantizeConfig(head_dim=128, num_heads=16, block_tokens=128), "sm_90a")
    assert k0 != compile_cache.cache_key([src], QuantizeConfig(head_dim=128, num_heads=16, block_tokens=64), "sm_90a")
    assert k0 != compile_cache.cache_key([src], cfg, "sm_100a")
    src.write_text("A = 2\n")
    assert k0 != compile_cache.cache_key([src], cfg, "sm_90a")


@needs_dsl
def test_cache_key_names_the_arch_and_the_dsl_build_not_the_machine(tmp_path, monkeypatch):
    # a CPU machine (FLAMIA_ARCH) builds ahead for a GPU one, and an H100 and an H200 share builds;
    # builds of the DSL's CUDA 12 and CUDA 13 compilers, or under other DSL settings, never mix
    import sys

    src = tmp_path / "kernel.py"
    src.write_text("A = 1\n")
    cfg = QuantizeConfig(head_dim=128, num_heads=16, block_tokens=128)
    monkeypatch.setenv("FLAMIA_ARCH", "sm_90a")
    k0 = compile_cache.cache_key([src], cfg, "sm_90a")
    monkeypatch.delenv("FLAMIA_ARCH")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, name=name: name)
        assert compile_cache.cache_key([src], cfg, "sm_90a") == k0
    # the flavour the DSL loaded, not torch's CUDA
    loaded = sys.modules["cutlass._mlir._mlir_libs._cutlass_ir"].__file__
    assert f"_cutlass_ir.cu{compile_cache.dsl_cuda_version().split('.')[0]}." in loaded
    assert compile_cache.dsl_build().startswith("dso=") and "compiler_opt=" in compile_cache.dsl_build()
    for fn, other in (("dsl_cuda_version", "99.0"), ("dsl_build", "dso=0;compiler_opt='-O1'")):
        with monkeypatch.context() as m:
            m.setattr(compile_cache, fn, lambda other=other: other)
            assert compile_cache.cache_key([src], cfg, "sm_90a") != k0
    assert compile_cache.cache_key([src], cfg, "sm_90a", "tvm_ffi") != k0


@needs_dsl
def test_compile_cached_memory_and_disk(tmp_path, monkeypatch):
    arch = compile_cache.dsl_default_arch()
    if arch != "sm_90a":
        pytest.skip(f"the DSL was imported for {arch}; exporting sm_90a objects needs CUTE_DSL_ARCH=sm_90a")
    monkeypatch.setenv("FLAMIA_CUTE_CACHE_DIR", str(tmp_path))
    cfg = QuantizeConfig(head_dim=64, num_heads=2, block_tokens=1)
    calls = []

    def build(c, arch):
        calls.append(arch)
        return compile_fused_quantize_sm90(c, arch)

    compile_cache.clear_memory_cache()
    f1 = compile_cache.compile_cached(SOURCE_FILES, cfg, "sm_90a", build)
    f2 = compile_cache.compile_cached(SOURCE_FILES, cfg, "sm_90a", build)
    assert f1 is f2 and calls == ["sm_90a"]
    assert list(tmp_path.glob("*.o")), f"no exported object: {compile_cache.STATS.export_errors}"
    compile_cache.clear_memory_cache()  # as in a new process: the object on disk must be loaded
    hits = compile_cache.STATS.disk_hits
    f3 = compile_cache.compile_cached(SOURCE_FILES, cfg, "sm_90a", build)
    assert calls == ["sm_90a"] and compile_cache.STATS.disk_hits == hits + 1 and callable(f3)


_SUBPROCESS = """
import json, time
from flamia_cute import compile_cache
from flamia_cute.sm90.quantize import QuantizeConfig, get_compiled
t = time.perf_counter()
get_compiled(QuantizeConfig(head_dim=128, num_heads=4, block_tokens=128, emit_token_copy=True))
s = compile_cache.STATS
print(json.dumps(dict(compiles=s.compiles, disk_hits=s.disk_hits, seconds=time.perf_counter() - t)))
"""


@needs_dsl
def test_second_process_does_not_recompile(tmp_path):
    env = dict(os.environ, FLAMIA_CUTE_CACHE_DIR=str(tmp_path))
    if not torch.cuda.is_available():
        env.update(FLAMIA_ARCH="sm_90a", CUTE_DSL_ARCH="sm_90a")
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _SUBPROCESS], env=env, capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0]["compiles"] == 1 and runs[0]["disk_hits"] == 0
    assert runs[1]["compiles"] == 0 and runs[1]["disk_hits"] == 1


# ----------------------------------------------------------------------------------------------
# GPU: bit-exactness against quant.quantize_thd
# ----------------------------------------------------------------------------------------------


def _sm90_available() -> bool:
    return HAVE_DSL and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


gpu = pytest.mark.gpu
needs_sm90 = pytest.mark.skipif(not _sm90_available(), reason="needs an sm_90 GPU and the CuTe DSL runtime")
POISON = 0x7F  # e4m3 NaN; fp32 scale bits 0x7F7F7F7F; quantize_thd never writes it for finite input


def _workloads():
    for path in (REPO / "flamia_cute" / "workloads.json", Path("/work/shared/workloads.json")):
        if path.exists():
            return json.loads(path.read_text())["workloads"]
    return {"1x16k": [16384], "4x4k": [4096] * 4, "16x1k": [1024] * 16}


def _input(lengths, H, D, seed=0, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    T = sum(lengths)
    # heavy-tailed per-token magnitudes so blocks get different scales
    x = torch.randn(T, H, D, generator=g) * torch.exp(2.0 * torch.randn(T, H, 1, generator=g))
    return x.to(torch.bfloat16).to(device), _cu(lengths, device)


def _assert_same(got, ref, what=""):
    assert got.data_td.shape == ref.data_td.shape
    assert torch.equal(got.data_td.view(torch.uint8).cpu(), ref.data_td.view(torch.uint8).cpu()), f"data_td {what}"
    assert torch.equal(got.scale.view(torch.int32).cpu(), ref.scale.view(torch.int32).cpu()), f"scale {what}"
    if ref.data_dt is not None:
        assert got.data_dt.shape == ref.data_dt.shape
        assert torch.equal(got.data_dt.view(torch.uint8).cpu(), ref.data_dt.view(torch.uint8).cpu()), f"data_dt {what}"


def _run(x, cu, block, token_copy, transposed=True):
    _, H, D = x.shape
    cfg = QuantizeConfig(head_dim=D, num_heads=H, block_tokens=block, emit_token_copy=token_copy, emit_transposed=transposed)
    out = fused_quantize_sm90(x, cu, cfg, debug_fill=POISON)
    torch.cuda.synchronize()
    return out


def _token_columns(cu):
    """Bool mask over data_dt columns: True where a token lives (documents at dt_cu_seqlens)."""
    cu = cu.cpu().to(torch.int64)
    lens = (cu[1:] - cu[:-1]).tolist()
    starts = dt_cu_seqlens(cu.to(torch.int32)).tolist()
    mask = torch.zeros(transposed_tokens(int(cu[-1]), len(lens)), dtype=torch.bool)
    for s0, n in zip(starts[:-1], lens, strict=True):
        mask[s0 : s0 + n] = True
    return mask


def _assert_pad_zero(out, cu, what=""):
    """Every column without a token (document pads, tail up to T_dt) is 0, not the 0x7F poison."""
    dt = out.data_dt.cpu().view(torch.uint8)
    assert dt.shape[-1] == transposed_tokens(int(cu[-1]), cu.numel() - 1)
    pad = ~_token_columns(cu)
    if out.dt_pv_order:  # column 16G + j holds token 16G + PV_ORDER16[j]
        pad = pad.view(-1, 16)[:, list(PV_ORDER16)].reshape(-1)
    assert (dt[..., pad] == 0).all(), f"data_dt pad columns not zero {what}"


def _check(x, cu, block, token_copy, what=""):
    out0, out1 = _run(x, cu, block, token_copy)
    xc, cuc = x.cpu(), cu.cpu()
    _assert_same(out0, quantize_thd(xc, cuc, block), f"block={block} {what}")
    _assert_pad_zero(out0, cuc, what)
    if token_copy:
        _assert_same(out1, quantize_thd(xc, cuc, 1), f"token copy {what}")
        _assert_pad_zero(out1, cuc, what)
    else:
        assert out1 is None
    return out0, out1


RECIPES = [(1, False), (128, True)]  # fp8_token, fp8_tokenblock


@gpu
@needs_sm90
@pytest.mark.parametrize("block, token_copy", RECIPES)
@pytest.mark.parametrize("name", ["1x16k", "mixed16k", "longtail32k", "16x1k", "4x4k"])
def test_workloads_h16_d128(name, block, token_copy):
    lengths = _workloads()[name]
    x, cu = _input(lengths, 16, 128)
    _check(x, cu, block, token_copy, name)


@gpu
@needs_sm90
@pytest.mark.parametrize(
    "H, D, block, token_copy",
    [(32, 64, 1, False), (32, 64, 128, True), (16, 256, 128, True), (8, 128, 64, True), (2, 128, 128, False)],
)
@pytest.mark.parametrize("name", ["mixed16k", "4x4k"])
def test_workloads_other_heads(name, H, D, block, token_copy):
    x, cu = _input(_workloads()[name], H, D, seed=1)
    _check(x, cu, block, token_copy, f"{name} H={H} D={D}")


@gpu
@needs_sm90
@pytest.mark.parametrize("seed", range(6))
def test_random_document_mixes(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, 2, 15, 17, 127, 128, 129, rng.randint(1, 5000)]) for _ in range(rng.randint(1, 24))]
    if sum(lengths) == 0:
        lengths.append(1)
    H, D = rng.choice([(4, 128), (6, 64), (3, 64), (2, 256)])
    block, token_copy = rng.choice([(1, False), (64, True), (128, True), (128, False)])
    x, cu = _input(lengths, H, D, seed=seed)
    _check(x, cu, block, token_copy, f"lengths={lengths}")


@gpu
@needs_sm90
@pytest.mark.parametrize(
    "lengths",
    [
        [16, 192, 16],  # one spare CTA zeroes two tail blocks
        [16] * 40,  # no per-document pad: the tail is 15 * 40 columns + slack
        [1] * 300,  # > 256 documents: threads own 2 documents each in the in-kernel scan
        [3, 0, 0, 17] * 200 + [900],  # 801 documents, empty ones between
    ],
)
def test_many_documents_and_long_tails(lengths):
    x, cu = _input(lengths, 2, 128, seed=11)
    _check(x, cu, 128, True, f"{len(lengths)} docs")
    _check(x, cu, 1, False, f"{len(lengths)} docs")


@gpu
@needs_sm90
def test_cu_seqlens_int64_and_emit_transposed_off():
    lengths = [100, 37, 300]
    x, cu = _input(lengths, 4, 64, seed=12)
    cfg = QuantizeConfig(head_dim=64, num_heads=4, block_tokens=64, emit_token_copy=True)
    out0, out1 = fused_quantize_sm90(x, cu.to(torch.int64), cfg, debug_fill=POISON)
    _assert_same(out0, quantize_thd(x.cpu(), cu.cpu(), 64))
    _assert_same(out1, quantize_thd(x.cpu(), cu.cpu(), 1))
    out0, _ = _run(x, cu, 128, False, transposed=False)
    ref = quantize_thd(x.cpu(), cu.cpu(), 128, transposed=False)
    assert out0.data_dt is None
    _assert_same(out0, ref)


@gpu
@needs_sm90
def test_empty_and_single_token_inputs():
    for lengths in ([1], [0, 1, 0], [0], [3, 0]):
        x, cu = _input(lengths, 2, 128)
        _check(x, cu, 128, True, f"lengths={lengths}")


@gpu
@needs_sm90
def test_all_zero_blocks_get_the_smallest_scale():
    x, cu = _input([300, 5], 2, 128)
    x[:128] = 0
    x[300:, 1] = 0
    out0, out1 = _check(x, cu, 128, True)
    tiny = 2.0**-126
    assert torch.all(out0.scale[:, :128] == tiny) and torch.all(out0.scale[1, 300:] == tiny)
    assert torch.all(out1.scale[:, :128] == tiny)


@gpu
@needs_sm90
def test_document_isolation():
    lengths = [700, 1, 333, 1024]
    x, cu = _input(lengths, 4, 128, seed=3)
    a0, a1 = _run(x, cu, 128, True)
    y = x.clone()
    y[701:1034] *= 100  # document 2 only
    b0, b1 = _run(y, cu, 128, True)
    other = torch.ones(sum(lengths), dtype=torch.bool)
    other[701:1034] = False
    for a, b in ((a0, b0), (a1, b1)):
        assert torch.equal(a.scale[:, other].view(torch.int32), b.scale[:, other].view(torch.int32))
        assert torch.equal(a.data_td[other].view(torch.uint8), b.data_td[other].view(torch.uint8))
        dts = dt_cu_seqlens(cu.cpu()).tolist()
        keep = torch.ones(a.data_dt.shape[-1], dtype=torch.bool)
        keep[dts[2] : dts[3]] = False  # document 2's columns (tokens and pad)
        keep = keep.cuda()
        assert torch.equal(a.data_dt[..., keep].view(torch.uint8), b.data_dt[..., keep].view(torch.uint8))


@gpu
@needs_sm90
@pytest.mark.parametrize("c", [1, 100, 128, 129, 300])
def test_future_perturbation(c):
    lengths = [50, 600]
    start = 50
    x, cu = _input(lengths, 2, 128, seed=4)
    a0, a1 = _run(x, cu, 128, True)
    y = x.clone()
    y[start + c :] = y[start + c :] * 100 + 1
    b0, b1 = _run(y, cu, 128, True)
    past = slice(0, start + c)  # earlier document plus tokens < c of this one
    assert torch.equal(a1.scale[:, past].view(torch.int32), b1.scale[:, past].view(torch.int32))
    assert torch.equal(a1.data_td[past].view(torch.uint8), b1.data_td[past].view(torch.uint8))
    whole_blocks = slice(0, start + (c // 128) * 128)  # block-128 scales of blocks entirely before c
    assert torch.equal(a0.scale[:, whole_blocks].view(torch.int32), b0.scale[:, whole_blocks].view(torch.int32))
    assert torch.equal(a0.data_td[whole_blocks].view(torch.uint8), b0.data_td[whole_blocks].view(torch.uint8))


@gpu
@needs_sm90
def test_nan_poisons_only_its_block():
    """Documented behaviour: a non-finite input gives a NaN scale for its block (all of D, one head) and
    the code 0 there (quant.quantize_with_scale), bit-exact with the reference everywhere."""
    lengths = [200, 100]
    x, cu = _input(lengths, 2, 128, seed=5)
    x[150, 1, 7] = float("nan")  # doc 0, block 1 (tokens 128..199), head 1
    out0, out1 = _run(x, cu, 128, True)
    nan0 = torch.isnan(out0.scale.cpu())
    assert nan0[1, 128:200].all() and nan0.sum() == 72
    nan1 = torch.isnan(out1.scale.cpu())
    assert nan1[1, 150] and nan1.sum() == 1
    ref0, ref1 = quantize_thd(x.cpu(), cu.cpu(), 128), quantize_thd(x.cpu(), cu.cpu(), 1)
    for out, ref in ((out0, ref0), (out1, ref1)):
        assert torch.equal(out.data_td.cpu().view(torch.uint8), ref.data_td.view(torch.uint8))
        assert torch.equal(out.data_dt.cpu().view(torch.uint8), ref.data_dt.view(torch.uint8))
    assert not out0.data_td.cpu()[128:200, 1].view(torch.uint8).any() and not out1.data_td.cpu()[150, 1].view(
        torch.uint8).any()


@gpu
@needs_sm90
@pytest.mark.parametrize("lengths", [[130], [1, 17], [128], [16], [31, 0, 97], [5, 16, 1, 144, 127]])
def test_transposed_pad_is_zero(lengths):
    x, cu = _input(lengths, 2, 64)
    out0, out1 = _check(x, cu, 128, True)  # poisons outputs with 0x7F and checks every pad column
    T, nd = sum(lengths), len(lengths)
    assert out0.data_dt.shape[-1] == transposed_tokens(T, nd) == round_up(T + (DT_DOC_ALIGN - 1) * nd, 128)
    dts = dt_cu_seqlens(cu.cpu()).tolist()
    for out in (out0, out1):
        dt = out.data_dt.cpu().view(torch.uint8)
        assert (dt[..., dts[-1] :] == 0).all()  # the tail
        for b, n in enumerate(lengths):  # each document's pad up to its 16-column boundary
            assert (dt[..., dts[b] + n : dts[b + 1]] == 0).all()


@gpu
@needs_sm90
def test_side_stream_and_legacy_chunks_argument():
    lengths = [1000, 24, 0, 3000]
    x, cu = _input(lengths, 4, 128)
    chunks = build_varlen_chunks(cu, x.shape[0])  # accepted and ignored: the kernel schedules itself
    cfg = QuantizeConfig(head_dim=128, num_heads=4, block_tokens=128, emit_token_copy=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out0, out1 = fused_quantize_sm90(x, cu, cfg, chunks=chunks)
    stream.synchronize()
    _assert_same(out0, quantize_thd(x.cpu(), cu.cpu(), 128))
    _assert_same(out1, quantize_thd(x.cpu(), cu.cpu(), 1))



# ----------------------------------------------------------------------------------------------
# GPU: the Q/K/V launch against three quantize_thd calls
# ----------------------------------------------------------------------------------------------


def _qkv_inputs(lengths, hq, hkv, D, seed):
    q, cu = _input(lengths, hq, D, seed=seed)
    k, _ = _input(lengths, hkv, D, seed=seed + 100)
    v, _ = _input(lengths, hkv, D, seed=seed + 200)
    return q, k, v, cu


def _check_qkv(q, k, v, cu, block, what="", **kw):
    m = qkv_config(q.shape[2], q.shape[1], k.shape[1], block, **kw)
    outs = fused_quantize_multi_sm90((q, k, v), cu, m, debug_fill=POISON)
    torch.cuda.synchronize()
    cuc = cu.cpu()
    (qq, q1), (kq, kt), (vq, vt) = outs
    assert q1 is None
    rq, (rk, rkt), (rv, rvt) = quantize_attention_operands(q.cpu(), k.cpu(), v.cpu(), cuc, block)
    assert vq.dt_pv_order and not kq.dt_pv_order
    _assert_same(qq, rq, f"Q {what}")
    _assert_pad_zero(qq, cuc, f"Q {what}")
    for name, main, diag, ref, ref_diag in (("K", kq, kt, rk, rkt), ("V", vq, vt, rv, rvt)):
        _assert_same(main, ref, f"{name} block={block} {what}")
        _assert_pad_zero(main, cuc, f"{name} {what}")
        if block > 1:
            _assert_same(diag, ref_diag, f"{name} token copy {what}")
            _assert_pad_zero(diag, cuc, f"{name} copy {what}")
        else:
            assert diag is None
    return outs


QKV_HEADS = [(16, 16, 128), (32, 8, 128), (32, 32, 64)]  # workloads.json head_configs
QKV_WORKLOADS = ["1x16k", "mixed16k", "longtail32k", "16x1k", "4x4k"]


def _qkv_cases():
    """Every workload with the default heads and token blocks; the other heads and per-token blocks on
    two workloads, and everything in the full tier."""
    for name in QKV_WORKLOADS:
        for hq, hkv, D in QKV_HEADS:
            for block in (1, 128):
                quick = (hq, hkv, D, block) == (16, 16, 128, 128) or name in ("mixed16k", "16x1k")
                yield pytest.param(name, hq, hkv, D, block, marks=() if quick else pytest.mark.gpu_full)


@gpu
@needs_sm90
@pytest.mark.parametrize("name, hq, hkv, D, block", _qkv_cases())
def test_qkv_launch_matches_three_quantize_thd(name, hq, hkv, D, block):
    lengths = _workloads()[name]
    q, k, v, cu = _qkv_inputs(lengths, hq, hkv, D, seed=21)
    _check_qkv(q, k, v, cu, block, f"{name} {hq}/{hkv}x{D}")


@gpu
@needs_sm90
@pytest.mark.parametrize("seed", range(8))
def test_qkv_random_document_mixes(seed):
    rng = random.Random(100 + seed)
    lengths = [rng.choice([0, 1, 1, 2, 15, 16, 17, 127, 128, 129, rng.randint(1, 3000)]) for _ in range(rng.randint(1, 30))]
    if sum(lengths) == 0:
        lengths.append(1)
    hq, hkv, D = rng.choice([(4, 2, 128), (8, 8, 64), (6, 3, 64), (32, 8, 128), (2, 1, 256)])
    block = rng.choice([1, 64, 128])
    raster = rng.choice(["heads", "chunks"])
    q, k, v, cu = _qkv_inputs(lengths, hq, hkv, D, seed=seed)
    _check_qkv(q, k, v, cu, block, f"lengths={lengths} {hq}/{hkv}x{D} raster={raster}", raster=raster)


@gpu
@needs_sm90
@pytest.mark.parametrize("lengths", [[1], [0, 1, 0], [3, 0], [1] * 300, [16, 192, 16]])
def test_qkv_tiny_and_many_documents(lengths):
    q, k, v, cu = _qkv_inputs(lengths, 4, 2, 128, seed=5)
    _check_qkv(q, k, v, cu, 128, f"{len(lengths)} docs")
    _check_qkv(q, k, v, cu, 1, f"{len(lengths)} docs")


@gpu
@needs_sm90
def test_qkv_empty_input():
    q, k, v, cu = _qkv_inputs([0], 4, 2, 128, seed=5)
    (qq, _), (kq, kt), (vq, vt) = _check_qkv(q, k, v, cu, 128, "empty")
    assert qq.data_td.shape == (0, 4, 128) and kt.data_dt.shape == (2, 128, 128)


@gpu
@needs_sm90
@pytest.mark.parametrize("kw", [dict(raster="chunks"), pytest.param(dict(min_ctas_per_sm=4), marks=pytest.mark.gpu_full),
                                pytest.param(dict(min_ctas_per_sm=0, smem_carveout=-1), marks=pytest.mark.gpu_full)])
def test_qkv_launch_variants_agree(kw):
    q, k, v, cu = _qkv_inputs(_workloads()["mixed16k"], 16, 16, 128, seed=8)
    _check_qkv(q, k, v, cu, 128, str(kw), **kw)
    _check_qkv(q, k, v, cu, 1, str(kw), **kw)


@gpu
@needs_sm90
def test_qkv_without_tvm_ffi(monkeypatch):
    """FLAMIA_CUTE_TVM_FFI=0 launches through the DSL's own marshalling; same bytes."""
    from flamia_cute import compile_cache

    monkeypatch.setenv("FLAMIA_CUTE_TVM_FFI", "0")
    monkeypatch.setattr(compile_cache, "_LAUNCHERS", {})
    q, k, v, cu = _qkv_inputs([700, 1, 333], 8, 4, 128, seed=9)
    _check_qkv(q, k, v, cu, 128, "DSL marshalling")
    keys = list(compile_cache._LAUNCHERS)
    assert keys and all(key[3] is False for key in keys), "the non-TVM-FFI launcher was not used"


@gpu
@needs_sm90
def test_quantize_operands_uses_one_launch_and_matches():
    from flamia_cute.cute_backend import quantize_operands

    q, k, v, cu = _qkv_inputs([1000, 24, 0, 3000], 32, 8, 128, seed=10)
    launches = []
    from flamia_cute.sm90 import quantize as quantize_sm90

    orig = quantize_sm90._launch
    quantize_sm90._launch = lambda *a: (launches.append(a[0]), orig(*a))[1]
    try:
        qq, (kq, kt), (vq, vt) = quantize_operands(q, k, v, cu, 128, 3000)
        q2, (k2, kt2), (v2, vt2) = quantize_operands(q, k, v, cu, 1, 3000)
    finally:
        quantize_sm90._launch = orig
    torch.cuda.synchronize()
    assert len(launches) == 2
    cuc = cu.cpu()
    # the forward's layouts (all that either backward reads): Q, K token-major, V transposed only
    _assert_same(qq, quantize_thd(q.cpu(), cuc, 1, transposed=False))
    _assert_same(kq, quantize_thd(k.cpu(), cuc, 128, transposed=False))
    _assert_same(kt, quantize_thd(k.cpu(), cuc, 1, transposed=False))
    for got, block in ((vq, 128), (vt, 1)):
        want = quantize_thd(v.cpu(), cuc, block, pv_order=True)
        assert got.data_td is None and got.dt_pv_order
        assert torch.equal(got.data_dt.view(torch.uint8).cpu(), want.data_dt.view(torch.uint8))
        assert torch.equal(got.scale.view(torch.int32).cpu(), want.scale.view(torch.int32))
    assert kt2 is None and vt2 is None
    _assert_same(k2, quantize_thd(k.cpu(), cuc, 1, transposed=False))
    assert qq.block_tokens == 1 and kq.block_tokens == 128 and kt.block_tokens == 1


@gpu
@needs_sm90
@needs_dsl
@pytest.mark.parametrize("lengths, H, D", [([16384], 16, 128), ([1, 5000, 17, 300, 128, 129], 16, 128),
                                           ([700, 3, 1025], 32, 64), ([400, 77], 8, 256)])
def test_dout_delta_matches_reference(lengths, H, D):
    """dO bit-exact as quantize_thd (per token, P-fragment order); D within fp32 summation order of fp64."""
    do, cu = _input(lengths, H, D, seed=len(lengths))
    o, _ = _input(lengths, H, D, seed=100 + len(lengths))
    doq, delta = quantize_with_rowdot_sm90(do, o, cu, dout_delta_config(D, H), debug_fill=POISON)
    torch.cuda.synchronize()
    cuc = cu.cpu()
    _assert_same(doq, quantize_thd(do.cpu(), cuc, 1, pv_order=True), "dO")
    _assert_pad_zero(doq, cuc, "dO")
    ref = (do.double() * o.double()).sum(-1).t().cpu()
    got = delta.double().cpu()
    assert delta.shape == (H, sum(lengths)) and torch.isfinite(got).all(), "a D element was not written"
    # fp32 sums of 128 exact products: |error| <= ~D ulp of the sum of |products|
    bound = (do.double().abs() * o.double().abs()).sum(-1).t().cpu() * D * 2.0**-24
    assert ((got - ref).abs() <= bound).all(), float(((got - ref).abs() / bound.clamp_min(1e-30)).max())
    # a leaky control: the same check with the tokens of two documents swapped must fail
    if len(lengths) > 1:
        assert not ((got.roll(1, dims=1) - ref).abs() <= bound).all()


@gpu
@needs_sm90
@needs_dsl
@pytest.mark.parametrize("lengths, H, group", [([700, 1, 333, 0, 17, 4096], 16, 2), ([16384], 16, 1),
                                               ([3, 129, 0, 2000], 8, 4), ([1024] * 16, 16, 1)])
def test_dv_fold_references_from_the_dout_launch(lengths, H, group):
    """preprocess_bwd(dv_ref_group=g): dO and D bitwise the plain launch's, and the (H / g, docs) dV fold
    references bitwise dv_fold_reference's (torch), with empty documents and all-zero dO rows."""
    from flamia_cute.sm90.attention_bwd import dv_fold_reference
    from flamia_cute.sm90.bwd_preprocess import preprocess_bwd

    do, cu = _input(lengths, H, 128, seed=len(lengths) + group)
    o, _ = _input(lengths, H, 128, seed=200 + group)
    # per-token magnitudes spread over octaves, and zero rows (a document's ignored last target)
    T = do.shape[0]
    g = torch.Generator().manual_seed(group)
    do = (do.float() * torch.exp2(torch.randint(-6, 7, (T, H, 1), generator=g)).cuda()).to(torch.bfloat16)
    do[torch.randperm(T, generator=g)[: max(1, T // 20)].cuda()] = 0
    delta, doq, ref = preprocess_bwd(do, o, cu, dv_ref_group=group)
    delta0, doq0 = preprocess_bwd(do, o, cu)
    want = dv_fold_reference(doq0.scale, cu, group)
    torch.cuda.synchronize()
    assert torch.equal(delta, delta0) and torch.equal(doq.scale, doq0.scale)
    assert torch.equal(doq.data_td.view(torch.uint8), doq0.data_td.view(torch.uint8))
    assert ref.shape == (H // group, len(lengths)) and torch.equal(ref, want), (ref, want)
    # the control: a reference over the wrong head grouping differs
    if group > 1:
        assert not torch.equal(ref, dv_fold_reference(doq0.scale, cu, 1)[::group])


@gpu
@needs_sm90
@needs_dsl
@pytest.mark.parametrize("block", [1, 128])
@pytest.mark.parametrize("lengths, hq, hkv", [([700, 1, 333, 0, 17], 8, 4), ([1024] * 4, 16, 16)])
def test_forward_only_launch_matches_reference(lengths, hq, hkv, block):
    """The fields forward_only writes are bit-exact as quantize_attention_operands'; the others are None."""
    q, k, v, cu = _qkv_inputs(lengths, hq, hkv, 128, seed=11)
    (qq, _), (kq, kt), (vq, vt) = fused_quantize_multi_sm90((q, k, v), cu, forward_only(qkv_config(128, hq, hkv, block)),
                                                            debug_fill=POISON)
    torch.cuda.synchronize()
    cuc = cu.cpu()
    rq, (rk, rkt), (rv, rvt) = quantize_attention_operands(q.cpu(), k.cpu(), v.cpu(), cuc, block)

    def same(got, ref, what, td, dt):
        assert torch.equal(got.scale.view(torch.int32).cpu(), ref.scale.view(torch.int32).cpu()), f"scale {what}"
        if td:
            assert torch.equal(got.data_td.view(torch.uint8).cpu(), ref.data_td.view(torch.uint8).cpu()), what
        else:
            assert got.data_td is None, what
        if dt:
            assert torch.equal(got.data_dt.view(torch.uint8).cpu(), ref.data_dt.view(torch.uint8).cpu()), what
            _assert_pad_zero(got, cuc, what)
        else:
            assert got.data_dt is None, what

    same(qq, rq, "Q", True, False)
    same(kq, rk, "K", True, False)
    same(vq, rv, "V", False, True)
    if block > 1:
        same(kt, rkt, "K copy", True, False)
        same(vt, rvt, "V copy", False, True)
    else:
        assert kt is None and vt is None


@gpu
@needs_sm90
@needs_dsl
@pytest.mark.parametrize("block", [1, 128])
def test_nonfinite_and_huge_inputs_quantize_as_the_reference(block):
    """NaN, +inf and -inf in Q, K and V (a 1-token document, a block's last and first token) give their
    block a NaN scale and the code 0 (no product meets a NaN code); values at the top of bf16's range
    saturate at 448 * 2^119 instead of rounding up to 2^128: bit-exact with quantize_attention_operands
    in every layout of the forward's launch."""
    lengths = [1, 300, 129, 40]
    q, k, v, cu = _qkv_inputs(lengths, 8, 4, 128, seed=12)
    for x, (token, value) in zip((q, k, v), ((0, float("nan")), (128, float("inf")), (429, float("-inf"))),
                                 strict=True):
        x[token, 1, 3] = value
    k[200, 2] = 3.3895e38  # bf16's largest finite value
    (qq, _), (kq, kt), (vq, vt) = fused_quantize_multi_sm90((q, k, v), cu, forward_only(qkv_config(128, 8, 4, block)),
                                                            debug_fill=POISON)
    torch.cuda.synchronize()
    rq, (rk, rkt), (rv, rvt) = quantize_attention_operands(q.cpu(), k.cpu(), v.cpu(), cu.cpu(), block)
    pairs = [(qq, rq), (kq, rk), (vq, rv)] + ([(kt, rkt), (vt, rvt)] if block > 1 else [])
    for got, ref in pairs:
        assert torch.equal(got.scale.view(torch.int32).cpu(), ref.scale.view(torch.int32).cpu())
        for f in ("data_td", "data_dt"):
            g, r = getattr(got, f), getattr(ref, f)
            if g is not None:
                assert torch.equal(g.view(torch.uint8).cpu(), r.view(torch.uint8).cpu()), f
                assert torch.isfinite(g.float()).all(), f"a NaN code in {f}"
    assert torch.isnan(qq.scale[1, 0]) and torch.isnan(kq.scale[1, 128]) and torch.isnan(vq.scale[1, 429])
    assert rk.dequantize()[200, 2].abs().max() == 448 * 2.0**119


@gpu
@needs_sm90
@needs_dsl
def test_dv_fold_references_leave_out_nonfinite_do_rows():
    """A non-finite dO row (NaN scale) does not raise its document's dV fold reference: the launch's
    references equal dv_fold_reference's, which takes the max over the finite scales."""
    from flamia_cute.sm90.attention_bwd import dv_fold_reference
    from flamia_cute.sm90.bwd_preprocess import preprocess_bwd

    lengths, H, group = [300, 1, 129], 8, 2
    do, cu = _input(lengths, H, 128, seed=4)
    o, _ = _input(lengths, H, 128, seed=5)
    clean = preprocess_bwd(do, o, cu, dv_ref_group=group)[2]
    do[10, 1, 7] = float("nan")
    do[300, 0, 0] = float("inf")  # the 1-token document's only row
    do[330, 3, 9] = float("-inf")
    _, doq, ref = preprocess_bwd(do, o, cu, dv_ref_group=group)
    torch.cuda.synchronize()
    assert torch.equal(ref, dv_fold_reference(doq.scale, cu, group))
    assert torch.isfinite(ref).all()
    # the 1-token document's first group keeps its other head's scale; no reference grows
    assert ref[0, 1] == doq.scale[1, 300].clamp_min(2.0**-119) and (ref <= clean).all()
    assert torch.equal(ref[1:, 1], clean[1:, 1])
