"""Fused FP8 quantization kernel (sm_90a): compile checks on CPU, bit-exactness on an sm_90 GPU.

CPU tests build real sm_90a cubins from fake pointers (no GPU) and inspect PTX/SASS.
GPU tests (marker `gpu`) compare against quant.quantize_thd byte for byte.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from flamia_cute.quant import TOKEN_PAD, quantize_thd, round_up
from flamia_cute.schedules.varlen_chunks import build_varlen_chunks, max_chunks

if not torch.cuda.is_available():
    # GPU-less CI compiles for sm_90a; the DSL fixes its default arch at import (exports need it)
    os.environ.setdefault("FLAMIA_ARCH", "sm_90a")
    os.environ.setdefault("CUTE_DSL_ARCH", os.environ["FLAMIA_ARCH"])

try:
    import cutlass  # noqa: F401

    from flamia_cute import compile_cache
    from flamia_cute.quantize_sm90 import (
        SOURCE_FILES,
        QuantizeConfig,
        compile_fused_quantize_sm90,
        fused_quantize_sm90,
        kernel_artifacts,
    )

    HAVE_DSL = True
except Exception:  # pragma: no cover - CI without the DSL
    HAVE_DSL = False

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
        (dict(head_dim=128, num_heads=4, threads=256), "threads"),
        (dict(head_dim=128, num_heads=6, heads_per_cta=4), "heads_per_cta"),
        (dict(head_dim=128, num_heads=6, heads_per_cta=3), "heads_per_cta"),
        (dict(head_dim=256, num_heads=4, heads_per_cta=4), "heads_per_cta"),
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
    assert QuantizeConfig(head_dim=128, num_heads=16).threads == 288


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
    assert art.frame_bytes in (0, None), "register spills to local memory"
    if art.registers is not None and head_dim <= 128:
        assert art.registers * cfg.threads <= 65536 // 3, f"{art.registers} registers: < 3 CTAs per SM"
    if art.sass is not None:
        assert _count(r"F2FP\.SATFINITE\.E4M3\.F32\.PACK_AB", art.sass) >= sets * 32
        assert _count(r"LDG\.E\.128", art.sass) >= 8
        assert _count(r"STG\.E\.128", art.sass) >= 3 * sets


@needs_dsl
def test_compiles_for_transposed_off():
    cfg = QuantizeConfig(head_dim=128, num_heads=8, block_tokens=128, emit_transposed=False)
    ptx = compile_fused_quantize_sm90(cfg, "sm_90a", "--keep-ptx").__ptx__
    assert "bar.sync" in ptx  # block amax still needs the CTA barrier
    assert _count(r"st\.shared\.b32", ptx) == 1  # only the per-warp amax; no transposed tile
    assert "prmt.b32" not in ptx  # no byte transposes


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
from flamia_cute.quantize_sm90 import QuantizeConfig, get_compiled
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
    for path in (REPO / "perf" / "workloads.json", Path("/work/shared/workloads.json")):
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


def _check(x, cu, block, token_copy, what=""):
    out0, out1 = _run(x, cu, block, token_copy)
    xc, cuc = x.cpu(), cu.cpu()
    _assert_same(out0, quantize_thd(xc, cuc, block), f"block={block} {what}")
    if token_copy:
        _assert_same(out1, quantize_thd(xc, cuc, 1), f"token copy {what}")
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
        tok = torch.arange(a.data_dt.shape[-1])
        keep = torch.cat([other, torch.ones(len(tok) - len(other), dtype=torch.bool)]).cuda()
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
    """Documented behaviour: a non-finite input gives a NaN scale for its block (all of D, one head)."""
    lengths = [200, 100]
    x, cu = _input(lengths, 2, 128, seed=5)
    x[150, 1, 7] = float("nan")  # doc 0, block 1 (tokens 128..199), head 1
    out0, out1 = _run(x, cu, 128, True)
    nan0 = torch.isnan(out0.scale.cpu())
    assert nan0[1, 128:200].all() and nan0.sum() == 72
    nan1 = torch.isnan(out1.scale.cpu())
    assert nan1[1, 150] and nan1.sum() == 1
    ref0, ref1 = quantize_thd(x.cpu(), cu.cpu(), 128), quantize_thd(x.cpu(), cu.cpu(), 1)
    ok0 = ~nan0.t()  # (T, H): bit-exact everywhere outside the poisoned block
    assert torch.equal(out0.data_td.cpu()[ok0].view(torch.uint8), ref0.data_td[ok0].view(torch.uint8))
    ok1 = ~nan1.t()
    assert torch.equal(out1.data_td.cpu()[ok1].view(torch.uint8), ref1.data_td[ok1].view(torch.uint8))
    assert ((out0.data_td.cpu()[128:200, 1].view(torch.uint8) & 0x7F) == 0x7F).all()


@gpu
@needs_sm90
@pytest.mark.parametrize("lengths", [[130], [1, 17], [128], [16], [31, 0, 97]])
def test_transposed_pad_is_zero(lengths):
    x, cu = _input(lengths, 2, 64)
    out0, out1 = _check(x, cu, 128, True)
    T = sum(lengths)
    assert out0.data_dt.shape[-1] == round_up(max(T, 1), TOKEN_PAD)
    for out in (out0, out1):
        assert (out.data_dt[..., T:].view(torch.uint8) == 0).all()


@gpu
@needs_sm90
def test_shared_chunk_table_and_stream():
    lengths = [1000, 24, 0, 3000]
    x, cu = _input(lengths, 4, 128)
    chunks = build_varlen_chunks(cu, x.shape[0])
    cfg = QuantizeConfig(head_dim=128, num_heads=4, block_tokens=128, emit_token_copy=True)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out0, out1 = fused_quantize_sm90(x, cu, cfg, chunks=chunks)
    stream.synchronize()
    _assert_same(out0, quantize_thd(x.cpu(), cu.cpu(), 128))
    _assert_same(out1, quantize_thd(x.cpu(), cu.cpu(), 1))
