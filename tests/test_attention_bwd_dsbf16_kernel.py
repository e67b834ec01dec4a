"""bf16-dS FP8 attention backward kernel (recipe fp8_tokenblock_dsbf16, sm_90a).

CPU: config checks, the tile schedule, the host-side operands (the dV fold reference against the
emulator's definition, exact bf16 dequantization), real sm_90a cubins (e4m3 wgmma for S^T, dP^T
and dV, bf16 wgmma for dK and dQ, no spills). GPU (marker `gpu`): the kernel against
`emulate_backward` of the same recipe from the same quantized operands (and a broken reference
that must fail the same check), zero dO rows, GQA, unaligned documents, leakage, deterministic dQ.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst

from flamia_cute.emulator import EmulatorContext, emulate_backward, emulate_forward, operand_from_quantized
from flamia_cute.kernels import lane_divergent_collectives
from flamia_cute.quant import quantize_attention_operands
from flamia_cute.recipes import FOLD_REF_MIN, Recipe
from flamia_cute.testing import check_leakage, make_inputs, rel_l2

try:
    import cutlass  # noqa: F401

    from flamia_cute.attention_bwd_dsbf16_sm90 import (
        DS_LAYOUT,
        BwdDsBf16Config,
        ds_word_index,
        dv_fold_reference,
        flamia_bwd_dsbf16_sm90_from_saved,
        kernel_artifacts,
        smem_bytes,
        tile_schedule,
    )

    HAVE_DSL = True
except Exception:  # pragma: no cover
    HAVE_DSL = False

needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl not importable")

# the named recipes: token-block K/V and the per-token twin (the kernel's diagonal_copy=False build)
RECIPES = {name: Recipe.from_name(name) for name in ("fp8_tokenblock_dsbf16", "fp8_token_dsbf16")}

# GPU tolerances (relative L2 of dQ, dK, dV against emulate_backward on the same quantized operands;
# each document's worst at twice these). The kernel reproduces the emulator's quantized values up to
# fp32 order; the differences come from Hopper's fp8 wgmma accumulation (~14 significant bits per k32
# chain) in S^T and dP^T, which flips e4m3 roundings of P (the dV operand). Index, mask or scale bugs
# give errors of order 1e-1..1.
GRAD_REL_L2_TOL = {"dq": 1.5e-2, "dk": 1.5e-2, "dv": 1.5e-2}


def _needs_sm90():
    return pytest.mark.skipif(
        not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)), reason="needs an sm_90 GPU"
    )


def _setup(lengths, H, Hk, D, recipe, seed, device="cpu", zero_do_rows=False):
    """recipe: a name or a Recipe (its K block size picks the layouts). zero_do_rows: dO is 0 on the
    last token of every document and on a whole 128-query tile of the longest, as in training where
    a token's target is ignored (dO scale 2^-126)."""
    q, k, v, do, cu, scale = make_inputs(lengths, heads_q=H, heads_kv=Hk, head_dim=D, seed=seed, device=device)
    if zero_do_rows:
        c = cu.tolist()
        for e in c[1:]:
            if e > 0:
                do[e - 1] = 0
        longest = max(range(len(lengths)), key=lambda i: lengths[i])
        do[c[longest] + 128 : min(c[longest] + 256, c[longest + 1])] = 0
    rec = recipe if isinstance(recipe, Recipe) else Recipe.from_name(recipe)
    block = rec.k.block_tokens
    cu = cu.to(device)
    qq, (kq, kt), (vq, vt) = quantize_attention_operands(q, k, v, cu, block)
    # the emulator's forward recomputes the same quantization; its O and LSE are what the kernel saves
    out, lse, _ = emulate_forward(q, k, v, cu, cu, scale, True, rec)
    ectx = EmulatorContext(rec, scale, True, cu, cu, operand_from_quantized(qq), operand_from_quantized(kq, kt),
                           operand_from_quantized(vq, vt), out, lse)
    edq, edk, edv = emulate_backward(do, ectx)
    return dict(q=q, k=k, v=v, do=do, cu=cu, scale=scale, qq=qq, kq=kq, vq=vq, kt=kt, vt=vt, out=out, lse=lse,
                emu=(edq, edk, edv), block=block)


def _grad_errors(res, emu, cu):
    out = {}
    for name, a, e in zip(("dq", "dk", "dv"), res, emu, strict=True):
        a, e = a.float().cpu(), e.float().cpu()
        out[name] = rel_l2(a, e)
        out[name + "_nan"] = int(torch.isnan(a).sum())
        worst = 0.0
        for s, t in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            if t - s >= 16 and e[s:t].norm() > 0:
                worst = max(worst, rel_l2(a[s:t], e[s:t]))
        out[name + "_doc"] = worst
    return out


def _violations(err, scale=1.0):
    bad = []
    for name, tol in GRAD_REL_L2_TOL.items():
        if err[name + "_nan"]:
            bad.append(f"{name}: {err[name + '_nan']} NaN")
        if not err[name] < tol * scale:
            bad.append(f"{name} rel_l2 {err[name]:.3e} >= {tol * scale:.1e}")
        if not err[name + "_doc"] < 2 * tol * scale:
            bad.append(f"{name} worst document rel_l2 {err[name + '_doc']:.3e} >= {2 * tol * scale:.1e}")
    return bad


# ----------------------------------------------------------------------------------------------
# CPU
# ----------------------------------------------------------------------------------------------


@needs_dsl
@pytest.mark.parametrize("field, value", [("head_dim", 96), ("qhead_per_kvhead", 0), ("q_stages", 4),
                                          ("vec_stages", 0), ("diagonal_copy", 1), ("deterministic", "yes"),
                                          ("prefetch_sdp", 1), ("dq_tma_reduce", 1), ("exp_under_dp", 1),
                                          ("raster", "rows"), ("dq_store_swap", 1), ("q_bf16_source", "gmem"),
                                          ("dk_under_dq_store", 1), ("preload_vectors", 17),
                                          ("transpose_v_under_s", 1), ("dq_first_store", 1), ("early_block_scales", 1),
                                          ("head_window", 3), ("cta_timeline", 1), ("ds_buffers", 3),
                                          ("persistent", 1), ("item_claim", "queue"), ("release_in_last_tile", 1),
                                          ("scales_at_entry", 1)])
def test_config_rejects(field, value):
    with pytest.raises(ValueError, match=f"BwdDsBf16Config.{field}"):
        BwdDsBf16Config(**{"head_dim": 128, field: value})
    with pytest.raises(ValueError, match="BwdDsBf16Config.dq_tma_reduce"):
        BwdDsBf16Config(head_dim=128, deterministic=True, dq_tma_reduce=True)
    with pytest.raises(ValueError, match="BwdDsBf16Config.exp_under_dp"):  # ptxas would serialize the wgmmas
        BwdDsBf16Config(head_dim=128, prefetch_sdp=True, exp_under_dp=True)
    assert BwdDsBf16Config(head_dim=128).dk_under_dq_store and not BwdDsBf16Config(head_dim=64).dk_under_dq_store
    assert not BwdDsBf16Config(head_dim=128, deterministic=True).dk_under_dq_store
    with pytest.raises(ValueError, match="BwdDsBf16Config.transpose_v_under_s"):  # S^T alone in a group
        BwdDsBf16Config(head_dim=128, prefetch_sdp=True, transpose_v_under_s=True)
    with pytest.raises(ValueError, match="BwdDsBf16Config.dq_first_store"):  # the claims order TMA ops only
        BwdDsBf16Config(head_dim=128, dq_tma_reduce=False, dq_first_store=True)
    for bad in (dict(dq_tma_reduce=False), dict(head_dim=64), dict(deterministic=True)):  # d64: the prefetch
        with pytest.raises(ValueError, match="BwdDsBf16Config.dk_under_dq_store"):
            BwdDsBf16Config(**{"head_dim": 128, "dk_under_dq_store": True, **bad})


@needs_dsl
def test_dq_path_follows_determinism(monkeypatch):
    """dQ by TMA reduce-add unless deterministic (then ordered atomics); the API's config follows
    torch.use_deterministic_algorithms / FLAMIA_CUTE_DETERMINISTIC."""
    from flamia_cute.cute_backend import backward_config
    from flamia_cute.quant import QuantizedTHD

    assert BwdDsBf16Config(head_dim=128).dq_tma_reduce is True
    assert BwdDsBf16Config(head_dim=128, deterministic=True).dq_tma_reduce is False
    # the zero-filled accumulator by default (dq_first_store measured slower, s13b-s13d)
    assert not BwdDsBf16Config(head_dim=128).dq_first_store
    assert BwdDsBf16Config(head_dim=64, dq_first_store=True).dq_tma_reduce
    assert BwdDsBf16Config(head_dim=64, dq_tma_reduce=False).dq_tma_reduce is False
    # the prefetch's automatic choice is resolved in the config too (the kernel builds what it says)
    assert BwdDsBf16Config(head_dim=64).prefetch_sdp is True and BwdDsBf16Config(head_dim=128).prefetch_sdp is False
    # S^T and dP^T waited apart wherever the prefetch is off
    assert [BwdDsBf16Config(head_dim=d, prefetch_sdp=p).exp_under_dp for d in (64, 128) for p in (None, False, True)] \
        == [False, True, False, True, True, False]
    T, H, Hk, D = 256, 4, 2, 128
    qq = QuantizedTHD(torch.zeros(T, H, D, dtype=torch.float8_e4m3fn), None, torch.ones(H, T), 128, "e4m3")
    kq = QuantizedTHD(torch.zeros(T, Hk, D, dtype=torch.float8_e4m3fn), None, torch.ones(Hk, T), 128, "e4m3")
    cu = torch.tensor([0, T], dtype=torch.int32)
    for env, tma in (("0", True), ("1", False)):
        monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", env)
        cfg = backward_config(qq, kq, kq, cu, T)
        assert (cfg.dq_tma_reduce, cfg.deterministic, cfg.qhead_per_kvhead) == (tma, not tma, 2), cfg


@needs_dsl
def test_cta_order_is_blocks_unless_deterministic(monkeypatch):
    """The key-block-fastest CTA order by default (faster on every workload, run s7e), the heads order
    in the deterministic mode (its ordered dQ additions were GPU-tested there); the API follows."""
    from flamia_cute.cute_backend import backward_config
    from flamia_cute.quant import QuantizedTHD

    assert BwdDsBf16Config(head_dim=128).raster == "blocks"
    assert BwdDsBf16Config(head_dim=128, deterministic=True).raster == "heads"
    assert BwdDsBf16Config(head_dim=64, raster="heads").raster == "heads"
    T, H, Hk, D = 4096, 4, 2, 128
    qq = QuantizedTHD(torch.zeros(T, H, D, dtype=torch.float8_e4m3fn), None, torch.ones(H, T), 1, "e4m3")
    kq = QuantizedTHD(torch.zeros(T, Hk, D, dtype=torch.float8_e4m3fn), None, torch.ones(Hk, T), 128, "e4m3")
    monkeypatch.setenv("FLAMIA_CUTE_NO_TUNING", "1")
    # (raster, head window): the window by document length (2 KV heads here), none when deterministic
    for env, length, want in (("0", 1024, ("blocks", 2)), ("0", 4096, ("blocks", 2)), ("1", 1024, ("heads", 1))):
        monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", env)
        cu = torch.tensor(list(range(0, T + 1, length)), dtype=torch.int32)
        cfg = backward_config(qq, kq, kq, cu, length)
        assert (cfg.raster, cfg.head_window) == want, (env, length)
    monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", "0")
    assert backward_config(qq, kq, kq, torch.tensor([0, T], dtype=torch.int32),
                           16384).head_window == 1  # long documents keep the plain order


def test_backward_outputs_and_grid_checks():
    """The backward allocates and checks through these: a zeroed fp32 dQ accumulator, dK/dV
    poisoned on request; the grid's key blocks, and errors past 32-bit indexing or the grid limits."""
    from flamia_cute.bwd_common_sm90 import backward_grid_blocks, backward_outputs

    dq, dk, dv = backward_outputs(10, 4, 2, 64, torch.device("cpu"), poison=True)
    assert dq.dtype == torch.float32 and dq.shape == (10, 4, 64) and bool((dq == 0).all())
    assert dk.shape == dv.shape == (10, 2, 64) and dk.dtype == torch.bfloat16 and bool(dv.isnan().all())
    assert backward_grid_blocks(1000, 4, 64, 1024, 3, 300, 128) == 3
    assert backward_grid_blocks(1000, 4, 64, 1024, 3, 300, 64) == 5
    assert backward_grid_blocks(0, 4, 64, 0, 0, 0, 128) == 0
    with pytest.raises(ValueError, match="grid too large: max_seqlen"):
        backward_grid_blocks(1000, 4, 64, 1024, 3, 128 * 70000, 128)
    with pytest.raises(ValueError, match="32-bit indexing"):
        backward_grid_blocks(2**22, 16, 128, 2**22, 1, 2**22, 128)


@needs_dsl
def test_head_window_config_and_auto_choice():
    """head_window: the blocks order only, a power of two dividing the KV heads (the host checks that);
    auto_head_window keeps 16k-token documents in the plain order and windows short ones."""
    from flamia_cute.attention_bwd_dsbf16_sm90 import auto_head_window
    from flamia_cute.bwd_common_sm90 import backward_grid, backward_work_item

    with pytest.raises(ValueError, match="head_window"):
        BwdDsBf16Config(head_dim=128, head_window=3)
    with pytest.raises(ValueError, match="head_window"):
        BwdDsBf16Config(head_dim=128, head_window=2, raster="heads")
    with pytest.raises(ValueError, match="cta_timeline"):
        BwdDsBf16Config(head_dim=128, cta_timeline=True, deterministic=True)
    # the early phase change resolves on where it is built: not beside d64's S^T/dP^T prefetch
    with pytest.raises(ValueError, match="phase_prefetch"):
        BwdDsBf16Config(head_dim=64, phase_prefetch=True)
    assert BwdDsBf16Config(head_dim=128, diagonal_copy=True).phase_prefetch
    assert not BwdDsBf16Config(head_dim=64, diagonal_copy=True).phase_prefetch
    assert [auto_head_window(16, n) for n in (16384, 65536, 8192, 4096, 1024, 512, None)] == [1, 1, 2, 4, 16, 16, 1]
    assert auto_head_window(8, 1024) == 8 and auto_head_window(6, 1024) == 2 and auto_head_window(1, 64) == 1
    # the grid mapping visits every (KV head, document, key block) once, in windows of W heads
    for w in (1, 2, 4):
        gx, gy, gz = backward_grid("blocks", 8, 3, 5, w)
        seen = [backward_work_item("blocks", (x, y, z), w) for z in range(gz) for y in range(gy) for x in range(gx)]
        assert sorted(seen) == sorted((h, d, b) for h in range(8) for d in range(3) for b in range(5))
        assert [s[2] for s in seen[:2 * w]] == [0] * w + [1] * w  # a window's heads fastest, blocks in order


@needs_dsl
def test_config_smem_fits(monkeypatch):
    import flamia_cute.attention_bwd_dsbf16_sm90 as mod

    for d in (64, 128):
        for st in (1, 2, 3):
            assert smem_bytes(BwdDsBf16Config(head_dim=d, q_stages=st)) <= 232448
    # the dQ tile does not fit next to three query stages at d128: the default falls back to atomics,
    # and Q's codes are converted in the kernel (the bf16 copy's stages would not fit either)
    assert not BwdDsBf16Config(head_dim=128, q_stages=3).dq_tma_reduce
    assert BwdDsBf16Config(head_dim=128, q_stages=3).q_bf16_source == "convert"
    assert BwdDsBf16Config(head_dim=128).q_bf16_source == "tma"
    with pytest.raises(ValueError, match="shared memory"):
        BwdDsBf16Config(head_dim=128, q_stages=3, q_bf16_source="tma")
    assert BwdDsBf16Config(head_dim=64, q_stages=3).dq_tma_reduce
    with pytest.raises(ValueError, match="shared memory"):
        BwdDsBf16Config(head_dim=128, q_stages=3, dq_tma_reduce=True)
    monkeypatch.setattr(mod, "SMEM_LIMIT", smem_bytes(BwdDsBf16Config(head_dim=128, dq_tma_reduce=False)) - 1)
    with pytest.raises(ValueError, match="shared memory"):
        BwdDsBf16Config(head_dim=128)


@needs_dsl
def test_tile_schedule_covers_each_tile_once():
    """Key block n of a document with n_q 64-query tiles: every (head, tile m >= 2n) exactly once,
    the diagonal tiles (m = 2n, 2n + 1 when present) of every head first."""
    for n_q in range(1, 12):
        for n in range((n_q + 1) // 2):
            n_diag = min(n_q - 2 * n, 2)
            per = max(n_q - 2 * n - 2, 0)
            for group in (1, 2, 4):
                tiles = [tile_schedule(i, n, group, n_diag, per) for i in range(group * (n_diag + per))]
                assert sorted((h, m) for h, m, _ in tiles) == [(h, m) for h in range(group) for m in range(2 * n, n_q)]
                assert all(d == (m < 2 * n + 2) for _, m, d in tiles)
                assert all(d for _, _, d in tiles[: group * n_diag])


@needs_dsl
def test_ds_words_follow_the_byte_swizzle():
    """The hand-written dS words: the unswizzled offsets of DS_LAYOUT (evaluated by CuTe) in bytes,
    under the hardware's 128-byte swizzle (byte address bits 7-9 XORed into bits 4-6, as TMA and
    wgmma apply it for any element size); every bf16 pair of adjacent queries in one word, every
    word used once."""
    import cutlass
    import cutlass.cute as cute

    got = {}

    @cute.jit
    def offsets():
        outer = cute.make_layout(((64, 1), (8, 16), (1, 2)), stride=((1, 0), (64, 512), (0, 8192)))
        assert DS_LAYOUT.endswith(str(outer)) and DS_LAYOUT.startswith("S<3,4,3> o 0 o ")
        for q in cutlass.range_constexpr(0, 64, 6):  # static coordinates: evaluated while tracing
            for key in cutlass.range_constexpr(0, 128, 5):
                for b in cutlass.range_constexpr(2):
                    got[(q, key, b)] = int(cute.crd2idx((q, key, b), outer))

    offsets()
    assert len(got) == 11 * 26 * 2
    for (q, key, b), off in got.items():
        byte = 2 * off
        assert ds_word_index(q, key, b) == (byte ^ (((byte >> 7) & 7) << 4)) // 4, (q, key, b)
    words = [ds_word_index(q, key, b) for q in range(0, 64, 2) for key in range(128) for b in range(2)]
    assert sorted(words) == list(range(64 * 128))


@needs_dsl
@pytest.mark.parametrize("head_dim", [64, 128])
def test_conversion_walks_cover_each_word_once(head_dim):
    """The in-kernel e4m3 -> bf16 conversions of Q (per tile) and K (per phase): over the 256
    consumer threads and their steps, every e4m3 word of the tile is read once and every bf16 word
    pair written once, element (row, d) of the e4m3 tile landing at (d, row) of the bf16 one (the
    same byte-swizzled addressing as ds_word_index, evaluated by smem_word_index)."""
    import cutlass
    import cutlass.cute as cute

    from flamia_cute.attention_bwd_dsbf16_sm90 import FlamiaBwdDsBf16Sm90
    from flamia_cute.sm90_device import smem_word_index

    kern = FlamiaBwdDsBf16Sm90(BwdDsBf16Config(head_dim=head_dim))
    wpr = head_dim // 4
    found = {}

    @cute.jit
    def walk():
        lay = kern._smem_layouts()
        plan = kern._conversion_plans(lay["Q"], lay["K"], lay["Qb"], lay["Kb"])
        for name, src, dst, rows in (("q", lay["Q"], lay["Qb"], 64), ("k", lay["K"], lay["Kb"], 128)):
            reads, writes = [], []
            for t in cutlass.range_constexpr(256):  # static: evaluated while tracing
                row0, d = t // wpr, 4 * (t % wpr)
                s0 = smem_word_index(src, (row0 % 64, d, row0 // 64) if name == "k" else (row0, d, 0), 1)
                d0 = smem_word_index(dst, (d, row0, 0), 2)
                for j in cutlass.range_constexpr(len(plan[name + "_src"])):
                    row = row0 + j * (256 // wpr)
                    want_s = smem_word_index(src, (row % 64, d, row // 64) if name == "k" else (row, d, 0), 1)
                    assert int(s0) + plan[name + "_src"][j] == int(want_s)
                    assert int(d0) + plan[name + "_dst"][j] == int(smem_word_index(dst, (d, row, 0), 2))
                    reads.append(int(want_s))
                    writes.append(int(d0) + plan[name + "_dst"][j])
            found[name] = (reads, writes, rows)

    walk()
    for name, (reads, writes, rows) in found.items():
        assert sorted(reads) == list(range(rows * head_dim // 4)), name
        both = sorted(writes + [w + 1 for w in writes])
        assert both == list(range(rows * head_dim // 2)), name


@needs_dsl
@pytest.mark.parametrize("head_dim", [64, 128])
def test_transpose_v_puts_every_key_row_in_place(head_dim):
    """transpose_v (the backward builds V [key, d] from the V^T slabs the TMA loads): replaying its
    words (transpose_v_words) on a model of shared memory, with the V^T columns in P-fragment order as
    the quantization writes them, leaves element (key, d) of each slab where dP^T's A operand reads
    it; each thread's reads precede every write (the kernel's barrier)."""
    import cutlass
    import cutlass.cute as cute

    from flamia_cute.attention_bwd_dsbf16_sm90 import FlamiaBwdDsBf16Sm90, transpose_v_threads, transpose_v_words
    from flamia_cute.quant import PV_ORDER16
    from flamia_cute.sm90_device import smem_word_index

    kern = FlamiaBwdDsBf16Sm90(BwdDsBf16Config(head_dim=head_dim))
    smem = {}
    result = {}

    def byte_at(layout, row, col, slab):  # the element's contiguous dimension is the column
        return 4 * int(smem_word_index(layout, (row, col - col % 4, slab), 1)) + col % 4

    @cute.jit
    def replay():
        lay = kern._smem_layouts()
        for slab in cutlass.range_constexpr(2):
            for d in cutlass.range_constexpr(head_dim):
                for col in cutlass.range_constexpr(64):
                    key = 16 * (col // 16) + PV_ORDER16[col % 16]
                    smem[byte_at(lay["Vt"], d, col, slab)] = (slab, key, d)
        for slab in cutlass.range_constexpr(2):
            moves = [transpose_v_words(lay["Vt"], lay["K"], t, slab, head_dim)
                     for t in range(transpose_v_threads(head_dim))]
            x = [[[smem[4 * int(w) + b] for b in range(4)] for w in src] for src, _ in moves]  # all reads first
            for (_, dst), xt in zip(moves, x, strict=True):
                for j in cutlass.range_constexpr(4):
                    for b in cutlass.range_constexpr(4):  # word b of the transpose: byte b of rows 0..3
                        for r in cutlass.range_constexpr(4):
                            smem[4 * int(dst[4 * b + j]) + r] = xt[4 * j + r][b]
        for slab in cutlass.range_constexpr(2):
            for key in cutlass.range_constexpr(64):
                for d in cutlass.range_constexpr(head_dim):
                    result[(slab, key, d)] = smem[byte_at(lay["K"], key, d, slab)]

    replay()
    wrong = [k for k, v in result.items() if v != k]
    assert not wrong, wrong[:5]


def _wavefronts(words, width: int) -> int:
    """Shared-memory wavefronts of one warp instruction whose 32 lanes access these 32-bit word
    addresses, `width` bytes each (4: per bank, the distinct words; 16: per 8-lane phase, the
    distinct 16-byte chunks per group of 4 banks)."""
    groups = [words] if width == 4 else [words[8 * p:8 * p + 8] for p in range(4)]
    unit = width // 4
    total = 0
    for lanes in groups:
        banks = {}
        for w in lanes:
            banks.setdefault((w // unit) % (32 // unit), set()).add(w // unit)
        total += max(len(v) for v in banks.values())
    return total


@needs_dsl
@pytest.mark.parametrize("head_dim", [64, 128])
def test_transpose_v_is_nearly_free_of_bank_conflicts(head_dim):
    """transpose_v's shared-memory traffic per warp (from transpose_v_words' addresses): each word
    load 2 wavefronts (a warp reads 2 rows per bank), each 16-byte store 8 (twice the minimum for
    512 bytes). The first mapping's loads took 16 (+2.3 us per CTA on the H200, run s12b). A mapping
    with 4 per store (run s12f) spilled 8 bytes in the q_bf16_source="convert" build: not kept."""
    import cutlass
    import cutlass.cute as cute

    from flamia_cute.attention_bwd_dsbf16_sm90 import FlamiaBwdDsBf16Sm90, transpose_v_threads, transpose_v_words

    kern = FlamiaBwdDsBf16Sm90(BwdDsBf16Config(head_dim=head_dim))
    found = []

    @cute.jit
    def addresses():
        lay = kern._smem_layouts()
        for slab in cutlass.range_constexpr(2):
            for warp in cutlass.range_constexpr(transpose_v_threads(head_dim) // 32):
                words = [transpose_v_words(lay["Vt"], lay["K"], 32 * warp + lane, slab, head_dim) for lane in range(32)]
                loads = [_wavefronts([int(words[lane][0][j]) for lane in range(32)], 4) for j in range(16)]
                stores = [_wavefronts([int(words[lane][1][4 * b]) for lane in range(32)], 16) for b in range(4)]
                found.append((loads, stores))

    addresses()
    assert len(found) == 2 * transpose_v_threads(head_dim) // 32
    for loads, stores in found:
        assert max(loads) <= 2 and max(stores) <= 8, (loads, stores)


@needs_dsl
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dq_store_plan_writes_the_swizzled_tile_once(head_dim):
    """The dQ tile's hand-computed stores (dq_tma_reduce), plain and with dq_store_swap (odd rows store
    pair j ^ 4 at step j): for each of the 256 consumer threads, (base ^ xor) + add lands each value
    pair of the dQ MMA's fragment at its (query, d) element of the swizzled shared tile that the TMA
    reduce-add reads (as smem_word_index evaluates it), pairs 8-byte aligned, every word written
    once. On a bank model, a half-warp's 64-bit store takes 2 wavefronts plain (ncu measured 4 per
    warp, run s7d) and 1 with the swap."""
    from collections import Counter

    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils

    from flamia_cute.attention_bwd_dsbf16_sm90 import FlamiaBwdDsBf16Sm90
    from flamia_cute.sm90_device import smem_word_index

    kern = FlamiaBwdDsBf16Sm90(BwdDsBf16Config(head_dim=head_dim, dq_store_swap=True))
    threads, pairs = 256, head_dim // 8
    words = {}

    @cute.jit
    def model():
        sdq = sm90_utils.make_smem_layout_epi(cutlass.Float32, cutlass.tensor_utils.LayoutEnum.ROW_MAJOR,
                                              (64, head_dim), 1)
        _, xors, adds, x = kern._dq_store_plan(sdq)
        assert len(xors) == pairs
        tv = kern._make_mmas()[3].tv_layout_C_tiled

        def word(t, v):  # value v of thread t's fragment
            i = int(cute.crd2idx((t, v), tv))
            return int(smem_word_index(sdq, (i % 64, i // 64, 0), 4))

        for t in cutlass.range_constexpr(threads):  # static: evaluated while tracing
            i0 = int(cute.crd2idx((t, 0), tv))
            w0 = word(t, 0)
            odd = (i0 % 64) % 2 == 1
            for swap in cutlass.range_constexpr(2):
                base = w0 ^ x if swap and odd else w0
                for j in cutlass.range_constexpr(len(xors)):
                    jj = j ^ 4 if swap and odd else j
                    w = (base ^ xors[j]) + adds[j]
                    assert w == word(t, 2 * jj) and w % 2 == 0, (swap, t, j)
                    assert word(t, 2 * jj + 1) == w + 1, (swap, t, j)
                    words[(swap, t, j)] = w

    model()
    steps = pairs
    for swap, per_half in ((0, 2), (1, 1)):
        placed = sorted(w + k for t in range(threads) for j in range(steps) for k in (0, 1)
                        for w in [words[(swap, t, j)]])
        assert placed == list(range(64 * head_dim)), swap
        for warp in range(threads // 32):
            for half in range(2):
                lanes = range(32 * warp + 16 * half, 32 * warp + 16 * half + 16)
                for j in range(steps):
                    banks = Counter(b for t in lanes for b in (words[(swap, t, j)] % 32, (words[(swap, t, j)] + 1) % 32))
                    assert max(banks.values()) == per_half, (swap, warp, half, j, banks)


def test_xor_walk_rejects_a_walk_that_is_not_an_xor_and_add():
    """The check in sm90_device.xor_walk can fail: a walk whose step carries into the swizzle's
    target bits differently per thread is refused."""
    pytest.importorskip("cutlass")
    import cutlass.cute as cute

    from flamia_cute.sm90_device import xor_walk

    err = {}

    @cute.jit
    def walk():
        lay = cute.make_composed_layout(cute.make_swizzle(3, 4, 3), 0, cute.make_layout((64, 32), stride=(32, 1)))
        try:  # thread t starts at float column t % 8 (any 4-byte offset): a 16-byte step carries per thread
            xor_walk(lay, lambda t, j: (t // 8, t % 8 + 4 * j, ), 4, 64, 4)
        except ValueError as e:
            err["msg"] = str(e)
        found = xor_walk(lay, lambda t, j: (t, 8 * j), 4, 64, 4)  # 32-byte steps from column 0: fine
        err["ok"] = found

    walk()
    assert "not (word ^ x) + a" in err["msg"]
    assert err["ok"] == ([0, 8, 16, 24], [0, 0, 0, 0])


@needs_dsl
@given(lengths=hst.lists(hst.one_of(hst.integers(0, 70), hst.integers(0, 700)), min_size=1, max_size=40))
@settings(max_examples=60, deadline=None)
def test_dq_claim_slots_are_distinct(lengths):
    """Property (dq_first_store): every document's 64-query tiles get distinct claim words, all below
    dq_claim_slots; and the rows a first CTA initializes (a whole tile, or its document's rows of a
    tile past the end) cover every row of every document exactly once."""
    from flamia_cute.attention_bwd_dsbf16_sm90 import QUERY_TILE, dq_claim_slot, dq_claim_slots

    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    T = cu[-1]
    slots, rows = [], []
    for doc, (s, e) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        for m in range((e - s + QUERY_TILE - 1) // QUERY_TILE):
            slots.append(dq_claim_slot(s, doc, m))
            rows.extend(range(s + m * QUERY_TILE, min(s + (m + 1) * QUERY_TILE, e)))
    assert len(set(slots)) == len(slots) and all(0 <= x < dq_claim_slots(T, len(lengths)) for x in slots)
    assert rows == list(range(T))


@given(lengths=hst.lists(hst.one_of(hst.integers(0, 3), hst.integers(0, 300)), min_size=1, max_size=8),
       group=hst.sampled_from([1, 2, 4]), seed=hst.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_dv_fold_reference_on_random_document_mixes(lengths, group, seed):
    """Property: the running-max construction equals the per-(KV head, document) max of a brute-force
    loop, for any mix (empty documents, length 1, one token of tail) and any group size."""
    g = torch.Generator().manual_seed(seed)
    H, T = 2 * group, sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    sdo = torch.exp2(torch.randint(-126, 10, (H, T), generator=g).float())
    # the max on a document's first or last token now and then (the ends of the running max)
    for s_, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        if e > s_:
            sdo[torch.randint(0, H, (1,), generator=g), (s_, e - 1)[int(torch.randint(0, 2, (1,), generator=g))]] = 2.0**12
    got = dv_fold_reference(sdo, cu, group)
    for d, (s_, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        for h in range(H // group):
            want = sdo[h * group : (h + 1) * group, s_:e].max().item() if e > s_ else FOLD_REF_MIN
            assert got[h, d].item() == max(want, FOLD_REF_MIN), (lengths, group, h, d)


def test_dv_fold_reference_is_the_emulators():
    """One reference per (KV head, document): the max dO scale over the document and the group's
    query heads (emulate_backward, dv_fold="document"), never below FOLD_REF_MIN; empty documents
    keep FOLD_REF_MIN."""
    torch.manual_seed(0)
    lengths, H, group = [5, 0, 130, 1, 64], 4, 2
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    T = int(cu[-1])
    sdo = torch.exp2(torch.randint(-20, 0, (H, T)).float())
    sdo[:, 5:10] = 2.0**-126  # all-zero dO rows
    got = dv_fold_reference(sdo, cu, group)
    assert got.shape == (H // group, len(lengths))
    for d, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        for h in range(H // group):
            want = sdo[h * group : (h + 1) * group, s:e].max().item() if e > s else FOLD_REF_MIN
            assert got[h, d].item() == max(want, FOLD_REF_MIN), (h, d)


# config fields of the kernel's build variants that the compile tests cover besides the default
VARIANTS = {"": {}, "q-convert": dict(q_bf16_source="convert"), "dk-with-dq": dict(dk_under_dq_store=False),
            "transpose-under-s": dict(transpose_v_under_s=True), "first-store": dict(dq_first_store=True),
            "late-phase": dict(phase_prefetch=False, early_block_scales=False), "early-scales": dict(early_block_scales=True),
            "one-ds-buffer": dict(ds_buffers=1), "persistent": dict(persistent=True),
            "persistent-stride": dict(persistent=True, item_claim="stride", head_window=2),
            "scales-at-entry": dict(scales_at_entry=True), "short-pairs": dict(short_pairs=True),
            "short-pairs-d64": dict(short_pairs=True, prefetch_sdp=False), "dk-e4m3": dict(dk_e4m3=True),
            "dk-e4m3-pairs": dict(dk_e4m3=True, short_pairs=True)}


@pytest.fixture(scope="module")
def artifacts():
    cache = {}

    def get(d, dc, g=1, det=False, variant=""):
        key = (d, dc, g, det, variant)
        if key not in cache:
            cfg = BwdDsBf16Config(head_dim=d, diagonal_copy=dc, qhead_per_kvhead=g, deterministic=det,
                                  **VARIANTS[variant])
            cache[key] = kernel_artifacts(cfg, "sm_90a")
        return cache[key]

    return get


@needs_dsl
@pytest.mark.parametrize("head_dim, diagonal_copy, variant", [(64, False, ""), (128, False, ""), (128, True, ""),
                                                                (128, True, "q-convert"), (64, False, "q-convert"),
                                                                (128, True, "dk-with-dq"),
                                                                (128, True, "transpose-under-s"),
                                                                (128, False, "transpose-under-s"),
                                                                (128, True, "one-ds-buffer"), (128, True, "scales-at-entry"),
                                                                (64, False, "scales-at-entry")])
def test_compiles_with_fp8_and_bf16_wgmma(artifacts, head_dim, diagonal_copy, variant):
    art = artifacts(head_dim, diagonal_copy, variant=variant)
    ops = Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+\.f32\.\w+\.\w+)", art.ptx))
    # two copies of the tile step (diagonal, off-diagonal); per copy: S^T and dP^T (D/32 k-steps
    # each, N = 64 queries), dV (2 k-steps of 32 queries), dK (4 of 16), dQ (8 of 16 keys, N = D/2);
    # with the S^T/dP^T prefetch (default at d64) they are issued in four places: before each phase
    # and in each tile step for the next tile
    sdp_copies = 4 if head_dim == 64 else 2
    want = Counter()
    want["m64n64k32.f32.e4m3.e4m3"] += sdp_copies * 2 * head_dim // 32
    want[f"m64n{head_dim}k32.f32.e4m3.e4m3"] += 2 * 2
    want[f"m64n{head_dim}k16.f32.bf16.bf16"] += 2 * 4
    want[f"m64n{head_dim // 2}k16.f32.bf16.bf16"] += 2 * 8
    assert ops == want
    assert "cp.async.bulk.tensor" in art.ptx
    # Q's bf16 codes: by TMA (the default: one more tensor load per tile in each phase's loop, in
    # boxes of 64 codes, the 128-byte swizzle's width) or converted in the kernel
    # d128 by default: dQ's group waited for alone (wait_group 1) in both tile steps, its tile stored
    # while dK computes; dk_under_dq_store=False waits for both
    if head_dim == 128 and variant == "":
        late = lambda ptx: len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx))  # noqa: E731
        assert late(art.ptx) == late(artifacts(head_dim, diagonal_copy, variant="dk-with-dq").ptx) + 2
    if variant == "q-convert":
        loads = lambda ptx: len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared", ptx))  # noqa: E731
        assert loads(art.ptx) + 2 * head_dim // 64 == loads(artifacts(head_dim, diagonal_copy).ptx)
    assert "cvt.rn.satfinite.e4m3x2.f32" in art.ptx and "cvt.rn.bf16x2.f32" in art.ptx
    assert "cvt.rn.f16x2.e4m3x2" in art.ptx, "K's (and Q's) codes converted to bf16 in the kernel"
    # every in-kernel e4m3 -> bf16 conversion multiplies by its row's scale: the scales live in the
    # bf16 B operands, dS is converted unscaled (session 8)
    conversions = len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", art.ptx))
    assert conversions == len(re.findall(r"mul\.f32\s+fa, fa,", art.ptx)) == len(re.findall(r"mul\.f32\s+fb, fb,", art.ptx))
    # dQ: one TMA reduce-add per tile by the dQ warp, no atomics (dq_tma_reduce's default), in boxes
    # of 32 floats (the 128-byte swizzle of the shared dQ tile)
    assert len(re.findall(r"cp\.reduce\.async\.bulk\.tensor", art.ptx)) == head_dim // 32
    assert "red.global" not in art.ptx
    assert "setmaxnreg.inc" in art.ptx and "setmaxnreg.dec" in art.ptx
    assert not re.search(r"\b(ld|st)\.local\b", art.ptx)
    assert art.frame_bytes in (None, 0)
    if art.sass is not None:
        assert len(re.findall(r"\bQGMMA\b", art.sass)) == sum(n for k, n in want.items() if "e4m3" in k)
        assert len(re.findall(r"\bHGMMA\b", art.sass)) == sum(n for k, n in want.items() if "bf16" in k)
        assert "UTMALDG" in art.sass
        assert not re.search(r"\b(STL|LDL)\b", art.sass), "register spills in SASS"
        # ptxas did not serialize the wgmmas (it does when it cannot track the accumulators in flight:
        # 36-60 arrives, one per wgmma, e.g. split S^T/dP^T waits beside the prefetch, or a whole-D
        # dQ accumulator per warpgroup at d128, session 8)
        assert len(re.findall(r"\bWARPGROUP\.ARRIVE\b", art.sass)) <= 8


@needs_dsl
@pytest.mark.parametrize("head_dim, prefetch", [(64, None), (128, None), (128, True)])
def test_dq_tma_reduce_variant(head_dim, prefetch):
    """dq_tma_reduce: one TMA reduce-add per tile (issued by the dQ warp) replaces the consumers'
    atomics; the products are the same (the prefetch issues S^T/dP^T in more places); no spills,
    also with the S^T/dP^T prefetch at d128 (its issue is unconditional), shared memory within the
    limit."""
    # the prefetch at d128 in the heads CTA order: in the blocks order it spills 8 bytes (not tuned)
    raster = "heads" if prefetch and head_dim == 128 else None
    cfg = BwdDsBf16Config(head_dim=head_dim, diagonal_copy=True, dq_tma_reduce=True, prefetch_sdp=prefetch,
                          raster=raster)
    art = kernel_artifacts(cfg, "sm_90a")
    assert smem_bytes(cfg) <= 232448
    assert len(re.findall(r"cp\.reduce\.async\.bulk\.tensor", art.ptx)) == head_dim // 32
    assert not re.search(r"red\.global", art.ptx)
    assert re.search(r"bar\.arrive\s+4, 288", art.ptx) and re.search(r"bar\.sync\s+5, 288", art.ptx)
    # the dQ warp issues the TMA reduce as a whole warp (a one-lane call of the copy hung on the H200)
    assert lane_divergent_collectives(art.ptx) == []
    assert art.frame_bytes in (None, 0)
    plain = kernel_artifacts(BwdDsBf16Config(head_dim=head_dim, diagonal_copy=True, prefetch_sdp=prefetch,
                                             dq_tma_reduce=False, raster=raster), "sm_90a")
    assert "red.global.add.v2.f32" in plain.ptx
    ops = lambda ptx: Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+)", ptx))  # noqa: E731
    assert set(ops(art.ptx)) == set(ops(plain.ptx))
    for op, n in ops(plain.ptx).items():
        assert ops(art.ptx)[op] == n or op.startswith("m64n64k32.f32.e4m3"), op
    if art.sass is not None:
        assert not re.search(r"\b(STL|LDL)\b", art.sass)


@needs_dsl
def test_deterministic_variant_orders_dq(artifacts):
    det, plain = artifacts(128, True, 2, True), artifacts(128, True, 2)
    for m in (r"ld\.acquire\.gpu\.global\.u32", r"red\.release\.gpu\.global\.add\.u32", r"fence\.acq_rel\.gpu"):
        assert len(re.findall(m, det.ptx)) >= 2, m
        assert not re.search(m, plain.ptx), m


@needs_dsl
def test_one_ds_buffer_saves_its_tile(artifacts):
    """ds_buffers=1 (opt-in): 16 KB less shared memory, the same MMAs and no spills; only with the
    TMA dQ path, whose DQ_EMPTY barrier orders the tile's reuse (the atomics path has none)."""
    from flamia_cute.attention_bwd_dsbf16_sm90 import KEY_BLOCK, QUERY_TILE, smem_bytes

    one = BwdDsBf16Config(head_dim=128, diagonal_copy=True, ds_buffers=1)
    two = BwdDsBf16Config(head_dim=128, diagonal_copy=True)
    assert smem_bytes(two) - smem_bytes(one) == 2 * QUERY_TILE * KEY_BLOCK  # one bf16 [64 q, 128 keys] tile
    with pytest.raises(ValueError, match="ds_buffers"):
        BwdDsBf16Config(head_dim=128, ds_buffers=1, dq_tma_reduce=False)
    art, ref = artifacts(128, True, variant="one-ds-buffer"), artifacts(128, True)
    wgmma = r"wgmma\.mma_async\.sync\.aligned\.\S+"
    assert Counter(re.findall(wgmma, art.ptx)) == Counter(re.findall(wgmma, ref.ptx))
    assert "STL" not in art.sass and art.frame_bytes in (None, 0)


@needs_dsl
@pytest.mark.parametrize("fields", [dict(deterministic=True), dict(dq_tma_reduce=False), dict(prefetch_sdp=True),
                                    dict(phase_prefetch=False), dict(dq_first_store=True), dict(cta_timeline=True)])
def test_persistent_config_rejects(fields):
    """The persistent build carries the TMA dQ path's and the early phase change's protocols across
    items; the modes it does not carry are refused by name."""
    with pytest.raises(ValueError, match="BwdDsBf16Config.persistent"):
        BwdDsBf16Config(head_dim=128, diagonal_copy=True, persistent=True, **fields)


@needs_dsl
@pytest.mark.parametrize("variant", ["persistent", "persistent-stride"])
def test_persistent_build_keeps_the_grid_builds_tile(artifacts, variant):
    """persistent=True (opt-in): the grid build's MMAs, phase changes and dQ reduce-adds inside an item
    loop; items from the counter (one relaxed atomic by the TMA warp) or by stride (no atomic); the
    ring's collectives by whole warps; shared memory within the limit. ptxas keeps 8 bytes of the
    loop's per-item state in local memory at d128 (stored once per item, outside the tile loop)."""
    from flamia_cute.attention_bwd_dsbf16_sm90 import SMEM_LIMIT

    art, grid = artifacts(128, True, variant=variant), artifacts(128, True)
    wgmma = r"wgmma\.mma_async\.sync\.aligned\.\S+"
    assert Counter(re.findall(wgmma, art.ptx)) == Counter(re.findall(wgmma, grid.ptx))
    for pat in (r"bar\.sync\s+2,", r"cp\.reduce\.async\.bulk\.tensor", r"cvt\.rn\.bf16x2"):
        assert len(re.findall(pat, art.ptx)) == len(re.findall(pat, grid.ptx)), pat
    atomics = len(re.findall(r"atom\.\S*add", art.ptx))
    assert atomics == (1 if variant == "persistent" else 0)
    assert lane_divergent_collectives(art.ptx) == []
    assert smem_bytes(BwdDsBf16Config(head_dim=128, diagonal_copy=True, **VARIANTS[variant])) <= SMEM_LIMIT
    assert art.frame_bytes in (None, 0, 8, 16)
    if art.sass is not None:
        assert len(re.findall(r"\bWARPGROUP\.ARRIVE\b", art.sass)) <= 8
        assert len(re.findall(r"\bLDL\b", art.sass)) <= 8  # refills per item, not per tile
    # d64 (without its S^T/dP^T prefetch, which the persistent build refuses) and the per-token build: no spills
    for kw in (dict(head_dim=64, diagonal_copy=True, prefetch_sdp=False), dict(head_dim=128, diagonal_copy=False)):
        other = kernel_artifacts(BwdDsBf16Config(persistent=True, **kw), "sm_90a")
        assert other.frame_bytes in (None, 0), kw
        if other.sass is not None:
            assert not re.search(r"\b(STL|LDL)\b", other.sass), kw


@needs_dsl
@pytest.mark.parametrize("variant", ["", "early-scales"])
def test_phase_change_builds_keep_both_prologues(artifacts, variant):
    """The phase-change schedules (phase_prefetch, the default; early_block_scales) move where the
    stage is released and the scales are loaded, nothing else: each phase still has its barrier,
    K/V wait, K conversion and V transpose, as in the late build. (A slip that nested phase 1's
    prologue under the late build's branch compiled without spills and gave wrong gradients on the
    GPU, run s18b: this is the CPU check that sees it.)"""
    art, late = artifacts(128, True, variant=variant), artifacts(128, True, variant="late-phase")
    for pat in (r"bar\.sync\s+2,", r"mbarrier\.try_wait", r"st\.shared\.v4", r"cvt\.rn\.bf16x2"):
        assert len(re.findall(pat, art.ptx)) == len(re.findall(pat, late.ptx)), pat
    assert len(re.findall(r"bar\.sync\s+2,", art.ptx)) == 2  # phase 0 and phase 1
    assert "STL" not in art.sass and art.frame_bytes in (None, 0)


@needs_dsl
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dq_first_store_variant(artifacts, head_dim):
    """dq_first_store (opt-in): the dQ warp claims each tile with one atomic (relaxed, a tile
    ahead), then either stores it with a plain TMA store (in boxes of 32 floats, as the reduce-add)
    and raises the tile's flag once the store has landed (proxy fence, release), or zeroes its
    document's rows and raises the flag, or reduce-adds after an acquire (a fence when the claim saw
    the flag, else a wait for it) and a proxy fence; as a whole warp (no collective under a lane branch), no spills.
    The zero-filled build has none of it and the same MMAs."""
    dc = head_dim == 128
    art, plain = artifacts(head_dim, dc, variant="first-store"), artifacts(head_dim, dc)
    count = lambda pat, ptx: len(re.findall(pat, ptx))  # noqa: E731
    store = r"cp\.async\.bulk\.tensor\.\dd\.global\.shared"
    assert count(store, art.ptx) == head_dim // 32 and count(store, plain.ptx) == 0
    assert count(r"cp\.reduce\.async\.bulk\.tensor", art.ptx) == count(r"cp\.reduce\.async\.bulk\.tensor", plain.ptx)
    assert count(r"atom\.relaxed\.gpu\.global\.add\.u32", art.ptx) == 3  # tiles 0 and 1, then two tiles ahead
    assert count(r"fence\.proxy\.async\.global", art.ptx) == 2
    assert count(r"ld\.acquire\.gpu\.global\.u32", art.ptx) >= 1  # the spin (its test may be rotated)
    assert count(r"red\.release\.gpu\.global\.add\.u32", art.ptx) >= 1
    assert count(r"st\.global\.v4\.b32", art.ptx) == count(r"st\.global\.v4\.b32", plain.ptx) + 1  # the zeroing
    for pat in (r"atom\.relaxed", r"fence\.proxy\.async\.global", store):
        assert not re.search(pat, plain.ptx), pat
    assert lane_divergent_collectives(art.ptx) == []
    ops = lambda ptx: Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+)", ptx))  # noqa: E731
    assert ops(art.ptx) == ops(plain.ptx)
    assert art.frame_bytes in (None, 0)
    if art.sass is not None:
        assert not re.search(r"\b(STL|LDL)\b", art.sass)
        assert count(r"\bUTMASTG\b", art.sass) == head_dim // 32


@needs_dsl
@pytest.mark.parametrize("fields", [dict(persistent=True), dict(deterministic=True), dict(prefetch_sdp=True),
                                    dict(dq_first_store=True), dict(scales_at_entry=True)])
def test_short_pairs_config_rejects(fields):
    """short_pairs is the grid build's, on the TMA dQ path (the pair's second query tile is reduced at
    the second document's rows by the dQ warp)."""
    with pytest.raises(ValueError, match="BwdDsBf16Config"):
        BwdDsBf16Config(head_dim=128, diagonal_copy=True, short_pairs=True, **fields)


@needs_dsl
@pytest.mark.parametrize("head_dim, diagonal_copy, variant", [(128, True, "short-pairs"), (128, False, "short-pairs"),
                                                                (64, True, "short-pairs-d64")])
def test_short_pairs_variant_compiles(artifacts, head_dim, diagonal_copy, variant):
    """short_pairs: the default build's MMAs, no spills; the second K slab and the query tiles past the
    first from the pair's second document (runtime-selected starts: no extra TMA instructions)."""
    art = artifacts(head_dim, diagonal_copy, variant=variant)
    plain = artifacts(head_dim, diagonal_copy, variant="" if head_dim == 128 else "short-pairs-d64")
    ops = lambda ptx: Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+)", ptx))  # noqa: E731
    assert ops(art.ptx) == ops(plain.ptx)
    assert art.frame_bytes in (None, 0)
    if art.sass is not None:
        assert not re.search(r"\b(STL|LDL)\b", art.sass)


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------

LENGTHS = [1, 127, 128, 129, 1000, 0, 33, 64, 65]
# every short-pair case (test_attention_fwd_kernel.SHORT_MIX: the same rule pairs the backward's CTAs)
SHORT_MIX = [64, 64, 40, 1, 50, 0, 33, 64, 20, 64, 64, 17, 63, 65, 45, 30, 700, 64, 64, 2, 5, 64, 129, 48, 64, 31,
             64, 64, 36]


def _run(st, poison=True, **kw):
    cu = st["cu"]
    lens = (cu[1:] - cu[:-1]).tolist()
    return flamia_bwd_dsbf16_sm90_from_saved(st["do"], st["out"], st["lse"], st["qq"], st["kq"], st["vq"], st["kt"],
                                             st["vt"], cu, max(lens), st["scale"], poison_outputs=poison, **kw)


def _check(lengths, recipe, D, H, Hk, seed, zero_do_rows=False):
    st = _setup(lengths, H, Hk, D, RECIPES[recipe], seed, device="cuda", zero_do_rows=zero_do_rows)
    res = _run(st)
    torch.cuda.synchronize()
    err = _grad_errors(res, st["emu"], st["cu"].cpu())
    assert not _violations(err), err
    return st, res


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("D, H, Hk", [(128, 2, 2), (64, 4, 2), (128, 4, 1)])
def test_gpu_matches_emulator(recipe, D, H, Hk):
    st, res = _check(LENGTHS, recipe, D, H, Hk, seed=1)
    # the same check fails against the e4m3-dS recipe's gradients (it can tell the recipes apart)
    # and against a reference whose dV fold is per tile
    from flamia_cute.emulator import EmulatorContext, emulate_backward, operand_from_quantized

    other = RECIPES[recipe].with_(ds_cast="e4m3_rowtile", dv_fold="tile")
    ectx = EmulatorContext(other, st["scale"], True, st["cu"], st["cu"], operand_from_quantized(st["qq"]),
                           operand_from_quantized(st["kq"], st["kt"]), operand_from_quantized(st["vq"], st["vt"]),
                           st["out"], st["lse"])
    assert _violations(_grad_errors(res, emulate_backward(st["do"], ectx), st["cu"].cpu()))


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_gpu_zero_dout_rows(recipe):
    _check(LENGTHS, recipe, 128, 2, 2, seed=5, zero_do_rows=True)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("lengths", [[8, 300], [3, 5, 7, 200, 129], [300, 300], [2000]])
def test_gpu_unaligned_document_starts(lengths):
    _check(lengths, "fp8_tokenblock_dsbf16", 128, 2, 2, seed=4)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("D, H, Hk, prefetch, tma, split", [(128, 2, 2, None, False, None), (64, 4, 2, None, False, None),
                                                          (128, 4, 1, None, True, None), (128, 2, 2, True, True, None),
                                                          (128, 4, 1, True, True, None), (128, 4, 1, None, True, False),
                                                          (64, 2, 2, False, True, None)])
def test_gpu_dq_paths_match_emulator(D, H, Hk, prefetch, tma, split):
    """Both dQ paths on a longer mix: the TMA reduce-add (the default since session 6), with and
    without the unconditional S^T/dP^T prefetch, and the consumers' atomics (the deterministic
    mode's path, here unordered); S^T and dP^T waited for apart (exp_under_dp, the default without
    the prefetch: d128, and d64 with the prefetch off) or together."""
    _check_config(D, H, Hk, 6, dq_tma_reduce=tma, prefetch_sdp=prefetch, exp_under_dp=split)


def _check_config(D, H, Hk, seed, **fields):
    """The kernel with BwdDsBf16Config(**fields) against the emulator, on LENGTHS and a 3000-token
    document (diagonal copies, GQA H / Hk)."""
    st = _setup(LENGTHS + [3000], H, Hk, D, RECIPES["fp8_tokenblock_dsbf16"], seed=seed, device="cuda")
    res = _run(st, config=BwdDsBf16Config(head_dim=D, qhead_per_kvhead=H // Hk, diagonal_copy=True, **fields))
    torch.cuda.synchronize()
    err = _grad_errors(res, st["emu"], st["cu"].cpu())
    assert not _violations(err), err


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("raster", ["heads", "blocks"])
def test_gpu_cta_orders_match_emulator(raster):
    """Both CTA orders (BwdDsBf16Config.raster) on a mix with a long document, GQA 2: the same
    gradients as the emulator (the order changes which CTA runs when, nothing else)."""
    _check_config(128, 4, 2, 7, raster=raster)


def _assert_same_gradients(st, res, ref, emulator: bool = True):
    """A build that changes only when or where the CTAs work: dK and dV bitwise `ref`'s (each is one
    CTA's register sum), dQ within fp32 reassociation (its reduce-adds land in another order), and
    (emulator) the emulator's gradients."""
    torch.cuda.synchronize()
    assert torch.equal(res[1], ref[1]) and torch.equal(res[2], ref[2])
    assert float((res[0].float() - ref[0].float()).norm() / ref[0].float().norm()) < 1e-3
    if emulator:
        err = _grad_errors(res, st["emu"], st["cu"].cpu())
        assert not _violations(err), err


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("D, H, Hk", [(128, 4, 2), (128, 2, 2), (64, 4, 1)])
def test_gpu_short_pairs_match_unpaired(recipe, D, H, Hk):
    """Two short documents per CTA (short_pairs): the emulator's gradients, every element written
    (NaN-poisoned), dK and dV bitwise the unpaired build's, dQ within reassociation. A pair whose
    first warpgroup saw the second's queries (or a second document read from the wrong rows) moves
    whole rows and fails."""
    st = _setup(SHORT_MIX, H, Hk, D, RECIPES[recipe], seed=14, device="cuda")
    base = dict(head_dim=D, qhead_per_kvhead=H // Hk, diagonal_copy=st["kt"] is not None, prefetch_sdp=False)
    plain = _run(st, config=BwdDsBf16Config(**base))
    res = _run(st, config=BwdDsBf16Config(**base, short_pairs=True))
    _assert_same_gradients(st, res, plain)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("doc, cut", [(2, 21), (7, 33), (14, 20), (25, 11)])
def test_gpu_short_pairs_leakage(doc, cut, monkeypatch):
    """Leakage through a shared CTA (forward and backward both paired, through the API): the first or
    the second document of a pair perturbed; nothing outside it, nor before the cut, moves."""
    import dataclasses

    from flamia_cute import attention_fwd_sm90, cute_backend

    chosen = cute_backend.backward_config
    monkeypatch.setattr(cute_backend, "backward_config",
                        lambda *a, **kw: dataclasses.replace(chosen(*a, **kw), short_pairs=True))
    monkeypatch.setattr(attention_fwd_sm90, "short_pairs_default", lambda *a: True)
    q, k, v, do, cu, scale = make_inputs(SHORT_MIX, heads_q=4, heads_kv=2, head_dim=128, seed=17)

    rep = check_leakage(_api_attention_fn(scale), q, k, v, cu, dout=do, grad_tol=2e-2, doc=doc, cut=cut)
    assert rep.ok, str(rep)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("H, Hk, window", [(4, 2, 2), (8, 8, 8), (16, 16, 16)])
def test_gpu_head_windows_match_plain_order(H, Hk, window):
    """The blocks order in windows of KV heads (BwdDsBf16Config.head_window) runs every CTA once with
    the same work: the emulator's gradients, dK and dV bitwise those of the plain order (each is one
    CTA's register sum), dQ within fp32 reassociation (its reduce-adds land in another order). A
    mapping that skipped or repeated a CTA moves dK/dV of whole key blocks and fails."""
    st = _setup(LENGTHS + [3000], H, Hk, 128, RECIPES["fp8_tokenblock_dsbf16"], seed=12, device="cuda")
    plain = _run(st, config=BwdDsBf16Config(head_dim=128, qhead_per_kvhead=H // Hk, diagonal_copy=True))
    res = _run(st, config=BwdDsBf16Config(head_dim=128, qhead_per_kvhead=H // Hk, diagonal_copy=True,
                                          head_window=window))
    _assert_same_gradients(st, res, plain)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("variant", ["", "early-scales"])
@pytest.mark.parametrize("D, H, Hk", [(128, 4, 2), (64, 2, 2)])
def test_gpu_late_phase_change_matches_default(D, H, Hk, variant):
    """phase_prefetch=False (the schedule before session 18: the per-token K/V released after the last
    diagonal tile, the block scales loaded then) gives the default's dK and dV bitwise (and those of
    early_block_scales), its dQ within fp32 reassociation, and the emulator's gradients. A K/V stage
    released before its last reader would change the diagonal tiles' dK/dV (the TMA overwriting sK,
    sV under S^T or dP^T)."""
    st = _setup(LENGTHS + [3000], H, Hk, D, RECIPES["fp8_tokenblock_dsbf16"], seed=14, device="cuda")
    fields = dict(head_dim=D, qhead_per_kvhead=H // Hk, diagonal_copy=True)
    res = _run(st, config=BwdDsBf16Config(**fields, **VARIANTS[variant]))
    late = _run(st, config=BwdDsBf16Config(**fields, phase_prefetch=False))
    _assert_same_gradients(st, res, late)
    err = _grad_errors(late, st["emu"], st["cu"].cpu())
    assert not _violations(err), err


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("D, H, Hk, dc", [(128, 4, 2, True), (64, 2, 2, True), (128, 2, 2, False)])
def test_gpu_scales_at_entry_matches_default(D, H, Hk, dc):
    """scales_at_entry (session 19, opt-in): phase 0's row scales loaded before the shared-memory setup
    give the default's dK and dV bitwise (the same values, read earlier) and its dQ within
    reassociation, and the emulator's gradients; with and without the diagonal copies. Scales of the
    wrong rows, or loaded where the document ends, move whole key rows and fail."""
    recipe = RECIPES["fp8_tokenblock_dsbf16" if dc else "fp8_token_dsbf16"]
    st = _setup(LENGTHS + [3000], H, Hk, D, recipe, seed=20, device="cuda")
    fields = dict(head_dim=D, qhead_per_kvhead=H // Hk, diagonal_copy=dc)
    _assert_same_gradients(st, _run(st, config=BwdDsBf16Config(**fields, scales_at_entry=True)),
                           _run(st, config=BwdDsBf16Config(**fields)))


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("D, H, Hk", [(128, 4, 2), (64, 2, 2)])
def test_gpu_overlapped_passes_match_sequential(D, H, Hk):
    """overlap_passes: Q's bf16 copy and the dQ zero fill on the side stream give the sequential call's
    gradients. The side stream is held ~0.1 s by a sleep queued first, and the cached blocks that the
    call's Q copy and accumulator will reuse hold NaN, so a kernel that did not wait for the side
    stream would read them unwritten: NaN gradients, which fail."""
    from flamia_cute.attention_bwd_dsbf16_sm90 import side_stream

    st = _setup(LENGTHS + [3000], H, Hk, D, RECIPES["fp8_tokenblock_dsbf16"], seed=21, device="cuda")
    ref = _run(st, overlap_passes=False)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # then every cached block holds NaN: the call's allocations reuse them
    shape = st["qq"].data_td.shape
    nan = [torch.full(shape, float("nan"), dtype=dt, device="cuda") for dt in [torch.float32] * 4 + [torch.bfloat16] * 8]
    del nan
    torch.cuda.synchronize()
    with torch.cuda.stream(side_stream(st["qq"].data_td.device)):
        torch.cuda._sleep(200_000_000)
    _assert_same_gradients(st, _run(st, overlap_passes=True), ref)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
def test_gpu_overlapped_passes_joined_when_an_argument_is_refused():
    """An argument refused after the side stream has its passes (O of the wrong shape, refused by the dO
    preprocess): the error names it, and the current stream still waits for the side stream (a sleep
    queued there first keeps an event recorded after the call pending), so the Q copy and the dQ
    accumulator are not freed under the side stream's writes. Without the join the event completes at once."""
    from flamia_cute.attention_bwd_dsbf16_sm90 import side_stream

    st = _setup(LENGTHS, 2, 2, 128, RECIPES["fp8_tokenblock_dsbf16"], seed=22, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side_stream(st["qq"].data_td.device)):
        torch.cuda._sleep(200_000_000)
    bad = dict(st, out=st["out"][:-1])
    with pytest.raises(ValueError, match="y must be"):
        _run(bad, overlap_passes=True)
    done = torch.cuda.Event()
    done.record()
    assert not done.query()
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("D, H, Hk", [(128, 4, 2), (64, 2, 2)])
def test_gpu_one_ds_buffer_matches_default(D, H, Hk):
    """ds_buffers=1 (opt-in, session 18: not yet run): one dS tile reused across tiles gives the
    default's dK and dV bitwise and its dQ within reassociation. Reuse before both warpgroups' dQ
    products had read the tile would change dQ and dK."""
    st = _setup(LENGTHS + [3000], H, Hk, D, RECIPES["fp8_tokenblock_dsbf16"], seed=16, device="cuda")
    fields = dict(head_dim=D, qhead_per_kvhead=H // Hk, diagonal_copy=True)
    _assert_same_gradients(st, _run(st, config=BwdDsBf16Config(**fields, ds_buffers=1)),
                           _run(st, config=BwdDsBf16Config(**fields)))


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("D, H, Hk, claim, window", [(128, 4, 2, "counter", 1), (128, 4, 2, "stride", 2),
                                                     (128, 8, 8, "counter", 8), (64, 2, 2, "counter", 1)])
def test_gpu_persistent_matches_grid_build(D, H, Hk, claim, window):
    """persistent=True: every item once, with the grid build's work: the emulator's gradients, dK and dV
    bitwise the grid build's (one item's register sum each), dQ within reassociation. An item skipped,
    repeated or given another item's K/V (the stage released too early, the next item's copies landing
    under this one's S^T) moves dK/dV of whole key blocks and fails."""
    st = _setup(LENGTHS + [3000], H, Hk, D, RECIPES["fp8_tokenblock_dsbf16"], seed=17, device="cuda")
    fields = dict(head_dim=D, qhead_per_kvhead=H // Hk, diagonal_copy=True, head_window=window,
                  prefetch_sdp=False if D == 64 else None)
    grid = _run(st, config=BwdDsBf16Config(**fields))
    _assert_same_gradients(st, _run(st, config=BwdDsBf16Config(**fields, persistent=True, item_claim=claim)), grid)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("claim", ["counter", "stride"])
def test_gpu_persistent_many_items_per_cta(claim):
    """Hundreds of short documents and one long one, 8 KV heads: ~20 items per CTA, so the ring, the
    K/V stage's early release, the DQ_EMPTY arrive owed across items and the dS buffers' parity all
    turn over many times; the per-token build (diagonal_copy=False: one K/V stage per item) as well."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 400, (300,), generator=g).tolist() + [2500]
    for dc in (True, False):
        recipe = RECIPES["fp8_tokenblock_dsbf16" if dc else "fp8_token_dsbf16"]
        st = _setup(lengths, 8, 8, 128, recipe, seed=18, device="cuda")
        grid = _run(st, config=BwdDsBf16Config(head_dim=128, diagonal_copy=dc))
        res = _run(st, config=BwdDsBf16Config(head_dim=128, diagonal_copy=dc, persistent=True, item_claim=claim))
        _assert_same_gradients(st, res, grid)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
def test_gpu_persistent_beyond_the_document_table():
    """More documents than the persistent tables hold: the grid build runs instead, same gradients."""
    from flamia_cute.attention_bwd_dsbf16_sm90 import PERSISTENT_MAX_DOCS

    lengths = [3, 70, 1] * (PERSISTENT_MAX_DOCS // 3 + 2)
    st = _setup(lengths, 2, 2, 128, RECIPES["fp8_tokenblock_dsbf16"], seed=19, device="cuda")
    grid = _run(st, config=BwdDsBf16Config(head_dim=128, diagonal_copy=True))
    _assert_same_gradients(st, _run(st, config=BwdDsBf16Config(head_dim=128, diagonal_copy=True, persistent=True)),
                           grid)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
def test_gpu_cta_timeline_records_every_cta():
    """cta_timeline (measurement): one record per CTA of the grid, in launch order; the CTAs with work
    hold their query-tile count (tile_schedule's), an end after the start, an SM id below the SM
    count, the consumer stamps in order between them (phase 1's only with off-diagonal tiles); the
    gradients stay the plain build's (dK, dV bitwise)."""
    from flamia_cute.attention_bwd_dsbf16_sm90 import TIMELINE_FIELDS, TIMELINE_WORDS, cta_timeline_words

    H = Hk = 4
    lengths = [1, 127, 300, 0, 700]
    st = _setup(lengths, H, Hk, 128, RECIPES["fp8_tokenblock_dsbf16"], seed=13, device="cuda")
    n_blocks = (max(lengths) + 127) // 128
    buf = torch.full((cta_timeline_words(Hk, len(lengths), n_blocks),), -1, dtype=torch.int32, device="cuda")
    plain = _run(st, config=BwdDsBf16Config(head_dim=128, diagonal_copy=True, head_window=2))
    res = _run(st, config=BwdDsBf16Config(head_dim=128, diagonal_copy=True, head_window=2, cta_timeline=True),
               timeline=buf)
    _assert_same_gradients(st, res, plain, emulator=False)
    rec = buf.view(-1, TIMELINE_WORDS).cpu().to(torch.int64) & 0xFFFFFFFF
    f = {name: i for i, name in enumerate(TIMELINE_FIELDS)}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # grid order with windows of 2: document, window, key block, head in the window (tiles per head alike)
    want = [(n + 63) // 64 - 2 * b if b * 128 < n else 0
            for n in lengths for _window in range(Hk // 2) for b in range(n_blocks) for _head in range(2)]
    assert rec.shape[0] == len(want)
    for i, tiles in enumerate(want):
        start, end, sm, got = rec[i, :4].tolist()
        assert sm < sms, (i, rec[i])
        if tiles:
            assert got == tiles and end != 0 and ((end - start) & 0xFFFFFFFF) < 10**9, (i, rec[i], tiles)
            steps = ["consumer_start", "scales0", "kv0", "ready0", "diagonal_done"]
            steps += ["ready1"] if tiles > 2 else []  # off-diagonal tiles: a phase change
            steps += ["tiles_done", "end"]
            since = [(int(rec[i, f[name]]) - start) & 0xFFFFFFFF for name in steps]
            assert since == sorted(since) and since[-1] < 10**9, (i, rec[i])
            assert (rec[i, f["ready1"]] == 0) == (tiles <= 2), (i, rec[i])
        else:
            assert end == 0 and got == 0, (i, rec[i])


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("D, H, Hk", [(128, 4, 2), (64, 2, 2)])
def test_gpu_dq_store_without_swap_matches_emulator(D, H, Hk):
    """dq_store_swap=False (the default before run s8a): the plain dQ stores give the emulator's
    gradients too."""
    _check_config(D, H, Hk, 8, dq_store_swap=False)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("D, H, Hk, raster", [(128, 4, 2, None), (64, 2, 2, None), (128, 2, 2, "heads")])
def test_gpu_q_bf16_converted_matches_emulator(D, H, Hk, raster):
    """q_bf16_source="convert" (the default before session 8): dK's B operand converted from the e4m3
    Q tile in the kernel instead of loaded as a bf16 copy of the codes: the emulator's gradients."""
    _check_config(D, H, Hk, 9, q_bf16_source="convert", raster=raster)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("D, H, Hk, raster", [(128, 4, 2, None), (128, 2, 2, "heads")])
def test_gpu_dk_with_dq_matches_emulator(D, H, Hk, raster):
    """dk_under_dq_store=False (the d128 default before run s8d): dK and dQ in one group, waited for
    together, then the dQ store: the emulator's gradients."""
    _check_config(D, H, Hk, 11, dk_under_dq_store=False, raster=raster)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("D, H, Hk", [(128, 4, 2), (64, 2, 2)])
def test_gpu_preload_vectors_matches_emulator(D, H, Hk):
    """preload_vectors: the first 8 columns' vectors loaded before the wait for S^T: the emulator's
    gradients."""
    _check_config(D, H, Hk, 12, preload_vectors=8)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("D, H, Hk", [(128, 4, 2), (128, 2, 2)])
def test_gpu_transpose_v_under_s_matches_emulator(D, H, Hk):
    """transpose_v_under_s: each phase's V transposed while its first S^T is on the tensor cores: the
    emulator's gradients (diagonal copies: both phases transpose)."""
    _check_config(D, H, Hk, 14, transpose_v_under_s=True)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
def test_gpu_transpose_v_under_s_per_token_matches_emulator():
    """transpose_v_under_s without diagonal copies (per-token K/V: phase 1 keeps phase 0's V)."""
    st = _setup(LENGTHS + [3000], 4, 2, 128, RECIPES["fp8_token_dsbf16"], seed=15, device="cuda")
    res = _run(st, config=BwdDsBf16Config(head_dim=128, qhead_per_kvhead=2, transpose_v_under_s=True))
    torch.cuda.synchronize()
    err = _grad_errors(res, st["emu"], st["cu"].cpu())
    assert not _violations(err), err


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("D, H, Hk", [(128, 4, 2), (64, 4, 4)])
def test_gpu_dq_first_store_on_tiny_documents(D, H, Hk):
    """dq_first_store (opt-in) where several documents share a 64-row tile of the accumulator
    (1 to 70 tokens each) beside a 3000-token document (whose tiles many CTAs add to at once). The
    accumulator starts as NaN (poison), so a row left uninitialized, a plain store over another
    document's rows or a reduce-add before a tile's first store would show: the gradients are the
    emulator's, dQ equals the zero-filled build's to fp32 rounding (the adds land in another order),
    dK and dV bitwise (the dQ path does not touch them)."""
    g = torch.Generator().manual_seed(21)
    lengths = torch.randint(1, 71, (40,), generator=g).tolist() + [3000] + torch.randint(1, 71, (20,), generator=g).tolist()
    st = _setup(lengths, H, Hk, D, RECIPES["fp8_tokenblock_dsbf16"], seed=21, device="cuda")
    base = dict(head_dim=D, qhead_per_kvhead=H // Hk, diagonal_copy=True)
    res = _run(st, config=BwdDsBf16Config(**base, dq_first_store=True))
    zero = _run(st, config=BwdDsBf16Config(**base))
    torch.cuda.synchronize()
    err = _grad_errors(res, st["emu"], st["cu"].cpu())
    assert not _violations(err), err
    assert rel_l2(res[0].float(), zero[0].float()) < 1e-3
    assert torch.equal(res[1], zero[1]) and torch.equal(res[2], zero[2])


def _api_attention_fn(scale, recipe="fp8_tokenblock_dsbf16"):
    """check_leakage's AttentionFn over the API on the GPU (the cute backend)."""
    from flamia_cute import flamia_attn_varlen_func

    def fn(q_, k_, v_, cu_, dout=None):
        leaves = [t.cuda().requires_grad_(dout is not None) for t in (q_, k_, v_)]
        cu_ = cu_.cuda()
        maxlen = int((cu_[1:] - cu_[:-1]).max())
        out, lse = flamia_attn_varlen_func(*leaves, cu_, cu_, maxlen, maxlen, scale,
                                           recipe=recipe, backend="cute", return_lse=True)
        res = {"out": out.detach().cpu(), "lse": lse.detach().cpu()}
        if dout is not None:
            dq, dk, dv = torch.autograd.grad(out, leaves, dout.cuda())
            res.update(dq=dq.cpu(), dk=dk.cpu(), dv=dv.cpu())
        return res

    return fn


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("fields", [{}, {"q_bf16_source": "convert"}, {"persistent": True}],
                         ids=["default", "q-convert", "persistent"])
def test_gpu_leakage(fields, monkeypatch):
    """Quantize + forward kernel + this backward: nothing after a cut (or in another document)
    reaches dQ, dK, dV before it, within the fp32 atomics' run-to-run spread (the default build,
    and with Q's bf16 codes converted in the kernel, through the same API call)."""
    import dataclasses

    from flamia_cute import cute_backend

    if fields:
        chosen = cute_backend.backward_config
        monkeypatch.setattr(cute_backend, "backward_config",
                            lambda *a, **kw: dataclasses.replace(chosen(*a, **kw), **fields))

    q, k, v, do, cu, scale = make_inputs([300, 700, 129, 1], heads_q=4, heads_kv=2, head_dim=128, seed=7)

    for kw in ({}, {"doc": 1, "cut": 201}, {"doc": 1, "cut": 64}):
        rep = check_leakage(_api_attention_fn(scale), q, k, v, cu, dout=do, grad_tol=2e-2, **kw)
        assert rep.ok, str(rep)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("group", [1, 2])
def test_gpu_deterministic_dq_is_bit_reproducible(group):
    st = _setup([1000, 129, 7], 2 * group, 2, 128, RECIPES["fp8_tokenblock_dsbf16"], seed=4, device="cuda")
    cfg = BwdDsBf16Config(head_dim=128, qhead_per_kvhead=group, diagonal_copy=True, deterministic=True)
    runs = []
    for _ in range(3):
        runs.append(_run(st, config=cfg))
        torch.cuda.synchronize()
    for r in runs[1:]:
        for a, b in zip(runs[0], r, strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    err = _grad_errors(runs[0], st["emu"], st["cu"].cpu())
    assert not _violations(err), err


# ----------------------------------------------------------------------------------------------
# dK's product on e4m3 (BwdDsBf16Config.dk_e4m3, recipe fp8_tokenblock_dke4m3)
# ----------------------------------------------------------------------------------------------


def test_dk_e4m3_config_rejects():
    for bad in (dict(persistent=True), dict(q_bf16_source="convert")):
        with pytest.raises(ValueError, match="BwdDsBf16Config.(dk_e4m3|q_bf16_source)"):
            BwdDsBf16Config(head_dim=128, dk_e4m3=True, **bad)
    assert BwdDsBf16Config(head_dim=128, dk_e4m3=True).q_bf16_source == "tma"
    # Q^T's 8 KB per query stage (two) instead of Q bf16's 16 KB
    q_stages, bf16_q, e4m3_qt = 2, 64 * 128 * 2, 64 * 128
    assert smem_bytes(BwdDsBf16Config(128, dk_e4m3=True)) == smem_bytes(BwdDsBf16Config(128)) - q_stages * (bf16_q - e4m3_qt)


def test_dk_e4m3_emulator_changes_dk_alone():
    """The recipe's emulator: dQ and dV exactly the bf16-dS recipe's, dK different (its dS cast) and
    within 15% of its error against fp64 (rel L2 6.1e-2 -> 6.7e-2 here: dQ's level, 6.2e-2)."""
    from flamia_cute.reference import reference_attention

    st = _setup([300, 129, 1000], 4, 2, 64, "fp8_tokenblock_dke4m3", seed=2)
    base = _setup([300, 129, 1000], 4, 2, 64, "fp8_tokenblock_dsbf16", seed=2)
    assert torch.equal(st["emu"][0], base["emu"][0]) and torch.equal(st["emu"][2], base["emu"][2])
    assert not torch.equal(st["emu"][1], base["emu"][1])
    ref = reference_attention(st["q"], st["k"], st["v"], st["cu"], st["cu"], st["scale"], True, st["do"])
    err, base_err = (rel_l2(x["emu"][1].float(), ref["dk"].float()) for x in (st, base))
    assert err < 1.15 * base_err, (err, base_err)


@needs_dsl
@pytest.mark.parametrize("head_dim, diagonal_copy, variant", [(128, True, "dk-e4m3"), (64, False, "dk-e4m3"),
                                                                (128, True, "dk-e4m3-pairs")])
def test_dk_e4m3_compiles_with_e4m3_dk_product(artifacts, head_dim, diagonal_copy, variant):
    """dK's product on e4m3 (2 k-steps of 32 queries per tile step, N = D) and no bf16 one; dQ's
    bf16 product unchanged; Q^T by TMA in place of Q's bf16 copy (one box of 64 e4m3 columns where
    Q bf16 took D / 64); no spills."""
    art, base = artifacts(head_dim, diagonal_copy, variant=variant), artifacts(head_dim, diagonal_copy)
    wg = lambda ptx: Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+\.f32\.\w+\.\w+)", ptx))  # noqa: E731
    ops, want = wg(art.ptx), wg(base.ptx)
    del want[f"m64n{head_dim}k16.f32.bf16.bf16"]
    want[f"m64n{head_dim}k32.f32.e4m3.e4m3"] += 2 * 2
    assert ops == want
    loads = lambda ptx: len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared", ptx))  # noqa: E731
    assert loads(base.ptx) - loads(art.ptx) == 2 * (head_dim // 64 - 1)
    # the rows' scales: two quad shuffles per row pair (quad_max2), no barrier beyond the default's
    assert len(re.findall(r"bar\.sync|barrier\.sync", art.ptx)) == len(re.findall(r"bar\.sync|barrier\.sync", base.ptx))
    assert not re.search(r"\b(ld|st)\.local\b", art.ptx)
    if art.sass is not None:
        assert not re.search(r"\b(STL|LDL)\b", art.sass), "register spills in SASS"
        assert len(re.findall(r"\bWARPGROUP\.ARRIVE\b", art.sass)) <= 8


def _check_dk_e4m3(lengths, D, H, Hk, seed, zero_do_rows=False, **fields):
    """The dk_e4m3 build against its recipe's emulator; dV bitwise and dQ (fp32 reassociation) the
    default build's; the same check against the bf16-dS recipe's emulator fails on dK alone."""
    st = _setup(lengths, H, Hk, D, "fp8_tokenblock_dke4m3", seed, device="cuda", zero_do_rows=zero_do_rows)
    cfg = BwdDsBf16Config(head_dim=D, qhead_per_kvhead=H // Hk, diagonal_copy=True, **fields)
    res = _run(st, config=dataclasses.replace(cfg, dk_e4m3=True))
    ref = _run(st, config=cfg)
    torch.cuda.synchronize()
    err = _grad_errors(res, st["emu"], st["cu"].cpu())
    assert not _violations(err), err
    assert torch.equal(res[2], ref[2])
    assert float((res[0].float() - ref[0].float()).norm() / ref[0].float().norm()) < 1e-3
    other = _grad_errors(res, _setup(lengths, H, Hk, D, "fp8_tokenblock_dsbf16", seed, device="cuda",
                                     zero_do_rows=zero_do_rows)["emu"], st["cu"].cpu())
    assert [v for v in _violations(other) if not v.startswith("dk")] == [] and _violations(other), other
    return err


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("D, H, Hk", [(128, 2, 2), (64, 4, 2), (128, 4, 1)])
def test_gpu_dk_e4m3_matches_emulator(D, H, Hk):
    _check_dk_e4m3(LENGTHS + [3000], D, H, Hk, seed=3)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
def test_gpu_dk_e4m3_zero_dout_rows_and_short_pairs():
    """Rows whose dS is 0 on a whole tile (zero dO rows: the scale rule's amax 0), and the short-pair
    schedule (two documents' keys in one CTA)."""
    _check_dk_e4m3(LENGTHS, 128, 2, 2, seed=5, zero_do_rows=True)
    _check_dk_e4m3(SHORT_MIX, 128, 4, 2, seed=6, short_pairs=True)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
def test_gpu_dk_e4m3_leakage():
    """The recipe through the API (Q^T from the quantization launch, the custom op's saved buffer):
    nothing after a cut, or in another document, reaches the gradients before it."""
    q, k, v, do, cu, scale = make_inputs([300, 700, 129, 1], heads_q=4, heads_kv=2, head_dim=128, seed=8)
    for kw in ({}, {"doc": 1, "cut": 201}, {"doc": 1, "cut": 64}):
        rep = check_leakage(_api_attention_fn(scale, "fp8_tokenblock_dke4m3"), q, k, v, cu, dout=do,
                            grad_tol=2e-2, **kw)
        assert rep.ok, str(rep)
