"""bf16-dS FP8 attention backward kernel (recipe fp8_tokenblock_dsbf16, sm_90a).

CPU: config checks, the tile schedule, the shared-memory address models, the host-side operands
(the dV fold reference against the emulator's definition), real sm_90a cubins of every build (e4m3
wgmma for S^T, dP^T and dV, bf16 wgmma for dK and dQ, no spills). GPU (marker `gpu`): the kernel
against `emulate_backward` of the same recipe from the same quantized operands (and a broken
reference that must fail the same check): token-block and per-token builds, d64 and d128, GQA,
zero dO rows, unaligned documents, deterministic dQ (bitwise), short pairs, head windows, three
vector stages, the overlapped passes, and leakage through the API.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst

from flamia_cute.cute_backend import _dsl_importable
from flamia_cute.emulator import EmulatorContext, emulate_backward, emulate_forward, operand_from_quantized
from flamia_cute.kernels import lane_divergent_collectives
from flamia_cute.quant import quantize_attention_operands
from flamia_cute.recipes import FOLD_REF_MIN, OperandQuant, Recipe
from flamia_cute.testing import check_leakage, make_inputs, rel_l2

# only the DSL's absence skips these tests: an error in a project module fails its import
HAVE_DSL = _dsl_importable()
if HAVE_DSL:
    from flamia_cute.sm90.attention_bwd import (
        DS_LAYOUT,
        BwdDsBf16Config,
        ds_word_index,
        dv_fold_reference,
        flamia_bwd_dsbf16_sm90_from_saved,
        kernel_artifacts,
        smem_bytes,
        tile_schedule,
    )

needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl not importable")

# the default recipe (token-block K/V) and its per-token twin: the kernel's diagonal_copy=False build,
# which the API runs for the per-tensor control fp8_tensor_current (per-tensor scales in per-token layouts)
_DEFAULT = Recipe.from_name("fp8_tokenblock_dsbf16")
_TOKEN = OperandQuant("e4m3", "token", 1)
RECIPES = {"fp8_tokenblock_dsbf16": _DEFAULT, "token_dsbf16": _DEFAULT.with_(name="token_dsbf16", k=_TOKEN, v=_TOKEN)}

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
@pytest.mark.parametrize("field, value", [("head_dim", 96), ("qhead_per_kvhead", 0), ("vec_stages", 1),
                                          ("vec_stages", 4), ("diagonal_copy", 1), ("deterministic", "yes"),
                                          ("short_pairs", 1), ("head_window", 3)])
def test_config_rejects(field, value):
    with pytest.raises(ValueError, match=f"BwdDsBf16Config.{field}"):
        BwdDsBf16Config(**{"head_dim": 128, field: value})
    # the windows are the blocks order's; short pairs need the dQ warp and no S^T/dP^T prefetch (d64)
    with pytest.raises(ValueError, match="BwdDsBf16Config.head_window"):
        BwdDsBf16Config(head_dim=128, head_window=2, deterministic=True)
    for bad in (dict(deterministic=True), dict(head_dim=64)):
        with pytest.raises(ValueError, match="BwdDsBf16Config.short_pairs"):
            BwdDsBf16Config(**{"head_dim": 128, "short_pairs": True, **bad})


@needs_dsl
def test_dq_path_follows_determinism(monkeypatch):
    """dQ by the dQ warp's TMA reduce-adds in both modes, in key-block turns when deterministic (no short
    pairs there); the S^T/dP^T prefetch at d64 only; the API's config follows
    torch.use_deterministic_algorithms / FLAMIA_CUTE_DETERMINISTIC."""
    from flamia_cute.plan import make_plan
    from flamia_cute.sm90.attention_bwd import short_pairs_supported

    assert short_pairs_supported(BwdDsBf16Config(head_dim=128))
    assert not short_pairs_supported(BwdDsBf16Config(head_dim=128, deterministic=True))
    assert BwdDsBf16Config(head_dim=64).prefetch_sdp is True and BwdDsBf16Config(head_dim=128).prefetch_sdp is False
    T, H, Hk, D = 256, 4, 2, 128
    for env, det in (("0", False), ("1", True)):
        monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", env)
        cfg = make_plan("fp8_tokenblock_dsbf16", D, H, Hk, T, T, 1).bwd
        assert (cfg.deterministic, cfg.qhead_per_kvhead) == (det, 2), cfg


@needs_dsl
def test_cta_order_is_blocks_unless_deterministic(monkeypatch):
    """The key-block-fastest CTA order by default, the heads order in the deterministic mode (its
    ordered dQ additions were GPU-tested there); the API follows."""
    from flamia_cute.plan import make_plan

    assert BwdDsBf16Config(head_dim=128).raster == "blocks"
    assert BwdDsBf16Config(head_dim=128, deterministic=True).raster == "heads"
    T, H, Hk, D = 4096, 4, 2, 128
    monkeypatch.setenv("FLAMIA_CUTE_NO_TUNING", "1")
    # (raster, head window): the window by document length (2 KV heads here), none when deterministic
    for env, length, want in (("0", 1024, ("blocks", 2)), ("0", 4096, ("blocks", 2)), ("1", 1024, ("heads", 1))):
        monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", env)
        cfg = make_plan("fp8_tokenblock_dsbf16", D, H, Hk, length, T, T // length).bwd
        assert (cfg.raster, cfg.head_window) == want, (env, length)
    monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", "0")
    assert make_plan("fp8_tokenblock_dsbf16", D, H, Hk, 16384, T, 1).bwd.head_window == 1  # long documents
    # keep the plain order


def test_backward_outputs_and_grid_checks():
    """The backward allocates and checks through these: a zeroed fp32 dQ accumulator, dK/dV
    poisoned on request; the grid's key blocks, and errors past 32-bit indexing or the grid limits."""
    from flamia_cute.sm90.bwd_preprocess import backward_grid_blocks, backward_outputs

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
    """head_window: the blocks order only (test_config_rejects), a power of two dividing the KV heads
    (the host checks that); auto_head_window keeps 16k-token documents in the plain order and windows
    short ones."""
    from flamia_cute.sm90.attention_bwd import auto_head_window
    from flamia_cute.tile_scheduler import backward_grid, backward_work_item

    assert [auto_head_window(16, n) for n in (16384, 65536, 8192, 4096, 1024, 512, None)] == [1, 1, 2, 4, 16, 16, 1]
    assert auto_head_window(8, 1024) == 8 and auto_head_window(6, 1024) == 2 and auto_head_window(1, 64) == 1
    # the grid mapping visits every (KV head, document, key block) once, in windows of W heads
    for w in (1, 2, 4):
        gx, gy, gz = backward_grid("blocks", 8, 3, 5, w)
        seen = [backward_work_item("blocks", (x, y, z), w) for z in range(gz) for y in range(gy) for x in range(gx)]
        assert sorted(seen) == sorted((h, d, b) for h in range(8) for d in range(3) for b in range(5))
        assert [s[2] for s in seen[:2 * w]] == [0] * w + [1] * w  # a window's heads fastest, blocks in order


@needs_dsl
def test_config_smem_fits():
    """Every config fits the 227 KB of shared memory, the deterministic mode's with the same dQ tile."""
    from flamia_cute.sm90.attention_bwd import SMEM_LIMIT

    for d in (64, 128):
        for vec in (2, 3):
            for det in (False, True):
                assert smem_bytes(BwdDsBf16Config(head_dim=d, vec_stages=vec, deterministic=det)) <= SMEM_LIMIT
        plain, det = (smem_bytes(BwdDsBf16Config(head_dim=d, deterministic=x)) for x in (False, True))
        assert plain == det


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
    """The in-kernel e4m3 -> bf16 conversion of K (per phase): over the 256 consumer threads and
    their steps, every e4m3 word of the key block is read once and every bf16 word pair written
    once, element (key, d) of the e4m3 block landing at (d, key) of the bf16 one (the same
    byte-swizzled addressing as ds_word_index, evaluated by smem_word_index)."""
    import cutlass
    import cutlass.cute as cute

    from flamia_cute.sm90.attention_bwd import FlamiaBwdDsBf16Sm90
    from flamia_cute.sm90.primitives import smem_word_index

    kern = FlamiaBwdDsBf16Sm90(BwdDsBf16Config(head_dim=head_dim))
    wpr = head_dim // 4
    found = {}

    @cute.jit
    def walk():
        lay = kern._smem_layouts()
        plan = kern._conversion_plans(lay["K"], lay["Kb"])
        for name, src, dst, rows in (("k", lay["K"], lay["Kb"], 128),):
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

    from flamia_cute.quant import PV_ORDER16
    from flamia_cute.sm90.attention_bwd import FlamiaBwdDsBf16Sm90, transpose_v_threads, transpose_v_words
    from flamia_cute.sm90.primitives import smem_word_index

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
    512 bytes). A mapping whose loads took 16 was measurably slower on the H200."""
    import cutlass
    import cutlass.cute as cute

    from flamia_cute.sm90.attention_bwd import FlamiaBwdDsBf16Sm90, transpose_v_threads, transpose_v_words

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
    """The dQ tile's hand-computed stores (dq_tma_reduce), plain and with the kernel's swap (odd rows
    store pair j ^ 4 at step j): for each of the 256 consumer threads, (base ^ xor) + add lands each
    value pair of the dQ MMA's fragment at its (query, d) element of the swizzled shared tile that the
    TMA reduce-add reads (as smem_word_index evaluates it), pairs 8-byte aligned, every word written
    once. On a bank model, a half-warp's 64-bit store takes 2 wavefronts plain and 1 with the swap."""
    from collections import Counter

    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils

    from flamia_cute.sm90.attention_bwd import FlamiaBwdDsBf16Sm90
    from flamia_cute.sm90.primitives import smem_word_index

    kern = FlamiaBwdDsBf16Sm90(BwdDsBf16Config(head_dim=head_dim))
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
    """The check in primitives.xor_walk can fail: a walk whose step carries into the swizzle's
    target bits differently per thread is refused."""
    pytest.importorskip("cutlass")
    import cutlass.cute as cute

    from flamia_cute.sm90.primitives import xor_walk

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


@pytest.fixture(scope="module")
def artifacts():
    cache = {}

    def get(d, dc, g=1, det=False, pairs=False):
        key = (d, dc, g, det, pairs)
        if key not in cache:
            cfg = BwdDsBf16Config(head_dim=d, diagonal_copy=dc, qhead_per_kvhead=g, deterministic=det,
                                  short_pairs=pairs)
            cache[key] = kernel_artifacts(cfg, "sm_90a")
        return cache[key]

    return get


_WGMMA = r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+\.f32\.\w+\.\w+)"


@needs_dsl
@pytest.mark.parametrize("head_dim, diagonal_copy", [(64, False), (128, False), (128, True)])
def test_compiles_with_fp8_and_bf16_wgmma(artifacts, head_dim, diagonal_copy):
    art = artifacts(head_dim, diagonal_copy)
    ops = Counter(re.findall(_WGMMA, art.ptx))
    # two copies of the tile step (diagonal, off-diagonal); per copy: S^T and dP^T (D/32 k-steps
    # each, N = 64 queries), dV (2 k-steps of 32 queries), dK (4 of 16), dQ (8 of 16 keys, N = D/2);
    # with the S^T/dP^T prefetch (d64) they are issued in four places: before each phase and in each
    # tile step for the next tile
    sdp_copies = 4 if head_dim == 64 else 2
    want = Counter()
    want["m64n64k32.f32.e4m3.e4m3"] += sdp_copies * 2 * head_dim // 32
    want[f"m64n{head_dim}k32.f32.e4m3.e4m3"] += 2 * 2
    want[f"m64n{head_dim}k16.f32.bf16.bf16"] += 2 * 4
    want[f"m64n{head_dim // 2}k16.f32.bf16.bf16"] += 2 * 8
    assert ops == want
    # TMA loads: K and V^T (two 64-key slabs each) per phase, and in each phase's tile loop Q, dO, dO^T
    # and Q's bf16 codes (D / 64 boxes of 64 codes, the 128-byte swizzle's width)
    loads = len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared", art.ptx))
    assert loads == (2 if diagonal_copy else 1) * 4 + 2 * (3 + head_dim // 64)
    # d128: S^T and dP^T waited for apart (exp2 under dP^T) and dQ's group alone (its tile stored while
    # dK computes): two wait_group 1 per tile step; d64 (the prefetch) none
    late = len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+1;", art.ptx))
    assert late == (4 if head_dim == 128 else 0)
    assert "cvt.rn.satfinite.e4m3x2.f32" in art.ptx and "cvt.rn.bf16x2.f32" in art.ptx
    # K's codes converted to bf16 in the kernel, each times its row's scale: the scales live in the
    # bf16 B operands, dS is converted unscaled
    conversions = len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", art.ptx))
    assert conversions > 0
    assert conversions == len(re.findall(r"mul\.f32\s+fa, fa,", art.ptx)) == len(re.findall(r"mul\.f32\s+fb, fb,", art.ptx))
    # dQ: one TMA reduce-add per tile by the dQ warp, no atomics, in boxes of 32 floats (the 128-byte
    # swizzle of the shared dQ tile)
    assert len(re.findall(r"cp\.reduce\.async\.bulk\.tensor", art.ptx)) == head_dim // 32
    assert "red.global" not in art.ptx
    assert re.search(r"bar\.arrive\s+4, 288", art.ptx) and re.search(r"bar\.sync\s+5, 288", art.ptx)
    # the dQ warp issues the TMA reduce as a whole warp (a one-lane call of the copy hung on the H200)
    assert lane_divergent_collectives(art.ptx) == []
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
        # dQ accumulator per warpgroup at d128)
        assert len(re.findall(r"\bWARPGROUP\.ARRIVE\b", art.sass)) <= 8


@needs_dsl
@pytest.mark.parametrize("head_dim, group", [(64, 1), (128, 2)])
def test_deterministic_build_orders_the_dq_warps_adds(artifacts, head_dim, group):
    """deterministic=True: the same build as the default (products, the dQ warp's TMA reduce-adds, no
    atomics) plus the dQ warp's key-block turns: an acquire spin before each reduce-add, a wait for the add
    to land, the proxy fences and the release that passes the turn; no spills."""
    det, plain = artifacts(head_dim, True, group, True), artifacts(head_dim, True, group)
    n_reduce = len(re.findall(r"cp\.reduce\.async\.bulk\.tensor", plain.ptx))
    assert n_reduce > 0 and len(re.findall(r"cp\.reduce\.async\.bulk\.tensor", det.ptx)) == n_reduce
    assert "red.global.add" not in det.ptx
    for m in (r"ld\.acquire\.gpu\.global\.u32", r"red\.release\.gpu\.global\.add\.u32", r"fence\.acq_rel\.gpu",
              r"fence\.proxy\.async\.global"):
        assert re.search(m, det.ptx), m
        assert not re.search(m, plain.ptx), m
    # the turn passes only after the add has landed: a full wait_group 0 (not .read) in the dQ warp's loop
    assert len(re.findall(r"cp\.async\.bulk\.wait_group\s+0;", det.ptx)) > len(
        re.findall(r"cp\.async\.bulk\.wait_group\s+0;", plain.ptx))
    ops = lambda ptx: Counter(re.findall(_WGMMA, ptx))  # noqa: E731
    assert ops(det.ptx) == ops(plain.ptx)
    assert lane_divergent_collectives(det.ptx) == []
    assert det.frame_bytes in (None, 0)
    if det.sass is not None:
        assert not re.search(r"\b(STL|LDL)\b", det.sass)


@needs_dsl
def test_phase_change_keeps_both_prologues(artifacts):
    """The token-block build's phase change (the per-token K/V released inside the last diagonal tile,
    the block scales loaded at the CTA's start) moves where the stage is released and the scales are
    loaded, nothing else: each phase has its barrier, K conversion and V transpose, twice the per-token
    build's one. (A slip that nested phase 1's prologue under a branch compiled without spills and
    gave wrong gradients on the GPU: this is the CPU check that sees it.)"""
    tb, tok = artifacts(128, True), artifacts(128, False)
    count = lambda pat, ptx: len(re.findall(pat, ptx))  # noqa: E731
    assert count(r"bar\.sync\s+2,", tb.ptx) == 2 and count(r"bar\.sync\s+2,", tok.ptx) == 1
    for pat in (r"st\.shared\.v4", r"cvt\.rn\.f16x2\.e4m3x2"):  # transpose_v, convert_k
        assert count(pat, tb.ptx) == 2 * count(pat, tok.ptx) > 0, pat


@needs_dsl
@pytest.mark.parametrize("diagonal_copy", [True, False])
def test_short_pairs_build_compiles(artifacts, diagonal_copy):
    """short_pairs: the default build's MMAs, no spills; the second K slab and the query tiles past the
    first from the pair's second document (runtime-selected starts: no extra TMA instructions)."""
    art, plain = artifacts(128, diagonal_copy, pairs=True), artifacts(128, diagonal_copy)
    ops = lambda ptx: Counter(re.findall(_WGMMA, ptx))  # noqa: E731
    assert ops(art.ptx) == ops(plain.ptx)
    loads = r"cp\.async\.bulk\.tensor\.\dd\.shared"
    assert len(re.findall(loads, art.ptx)) == len(re.findall(loads, plain.ptx))
    assert lane_divergent_collectives(art.ptx) == []
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
@pytest.mark.parametrize("D, H, Hk", [(128, 2, 2), (64, 4, 2), (128, 4, 1)])
def test_gpu_deterministic_matches_emulator(D, H, Hk):
    """The deterministic build (the dQ warp's adds in key-block turns, the heads CTA order) on a longer mix:
    the emulator's gradients."""
    _check_config(D, H, Hk, 6, deterministic=True)


def _check_config(D, H, Hk, seed, **fields):
    """The kernel with BwdDsBf16Config(**fields) against the emulator, on LENGTHS and a 3000-token
    document (diagonal copies, GQA H / Hk)."""
    st = _setup(LENGTHS + [3000], H, Hk, D, RECIPES["fp8_tokenblock_dsbf16"], seed=seed, device="cuda")
    res = _run(st, config=BwdDsBf16Config(head_dim=D, qhead_per_kvhead=H // Hk, diagonal_copy=True, **fields))
    torch.cuda.synchronize()
    err = _grad_errors(res, st["emu"], st["cu"].cpu())
    assert not _violations(err), err


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
@pytest.mark.parametrize("D, H, Hk", [(128, 4, 2), (128, 2, 2), (128, 4, 1)])
def test_gpu_short_pairs_match_unpaired(recipe, D, H, Hk):
    """Two short documents per CTA (short_pairs): the emulator's gradients, every element written
    (NaN-poisoned), dK and dV bitwise the unpaired build's, dQ within reassociation. A pair whose
    first warpgroup saw the second's queries (or a second document read from the wrong rows) moves
    whole rows and fails."""
    st = _setup(SHORT_MIX, H, Hk, D, RECIPES[recipe], seed=14, device="cuda")
    base = dict(head_dim=D, qhead_per_kvhead=H // Hk, diagonal_copy=st["kt"] is not None)
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
    from flamia_cute.schedules import varlen_tiles
    from flamia_cute.sm90 import attention_fwd as attention_fwd_sm90

    # both kernels paired whatever the pack's mean length (the plan reads these at build time)
    monkeypatch.setattr(varlen_tiles, "short_pairs_worth", lambda *a: True)
    monkeypatch.setattr(attention_fwd_sm90, "short_pairs_default", lambda *a: True)
    monkeypatch.setenv("FLAMIA_CUTE_NO_TUNING", "1")
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
@pytest.mark.parametrize("D, H, Hk", [(128, 4, 2), (64, 2, 2)])
def test_gpu_three_vector_stages_match_default(D, H, Hk):
    """vec_stages=3 (a tuner candidate) changes only how far the vector warp runs ahead: the default's
    dK and dV bitwise, its dQ within reassociation, the emulator's gradients. A stage read before it
    was written, or overwritten before it was read, moves whole query columns and fails."""
    st = _setup(LENGTHS + [3000], H, Hk, D, RECIPES["fp8_tokenblock_dsbf16"], seed=14, device="cuda")
    fields = dict(head_dim=D, qhead_per_kvhead=H // Hk, diagonal_copy=True)
    _assert_same_gradients(st, _run(st, config=BwdDsBf16Config(**fields, vec_stages=3)),
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
    from flamia_cute.sm90.attention_bwd import side_stream

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
    from flamia_cute.sm90.attention_bwd import side_stream

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
@pytest.mark.parametrize("recipe, D, deterministic", [("fp8_tokenblock_dsbf16", 128, False),
                                                      ("fp8_tokenblock_dsbf16", 64, False),
                                                      ("fp8_tokenblock_dsbf16", 128, True)],
                         ids=["default", "d64", "deterministic"])
def test_gpu_leakage(recipe, D, deterministic, monkeypatch):
    """Quantize + forward kernel + this backward, through the API: nothing after a cut (or in another
    document) reaches dQ, dK, dV before it, within the fp32 reduce-adds' run-to-run spread; the
    token-block build at d128 and d64 and the deterministic build (the per-token build's API recipe is
    the leaky per-tensor control: its kernel is checked against the emulator instead)."""
    monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", "1" if deterministic else "0")
    q, k, v, do, cu, scale = make_inputs([300, 700, 129, 1], heads_q=4, heads_kv=2, head_dim=D, seed=7)

    for kw in ({}, {"doc": 1, "cut": 201}, {"doc": 1, "cut": 64}):
        rep = check_leakage(_api_attention_fn(scale, recipe), q, k, v, cu, dout=do, grad_tol=2e-2, **kw)
        assert rep.ok, str(rep)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("head_dim, group", [(128, 1), (128, 2), (64, 2)])
def test_gpu_deterministic_dq_is_bit_reproducible(head_dim, group):
    """Three runs of the deterministic build give the same bits (d64: the S^T/dP^T prefetch's build)."""
    st = _setup([1000, 129, 7], 2 * group, 2, head_dim, RECIPES["fp8_tokenblock_dsbf16"], seed=4, device="cuda")
    cfg = BwdDsBf16Config(head_dim=head_dim, qhead_per_kvhead=group, diagonal_copy=True, deterministic=True)
    runs = []
    for _ in range(3):
        runs.append(_run(st, config=cfg))
        torch.cuda.synchronize()
    for r in runs[1:]:
        for a, b in zip(runs[0], r, strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    err = _grad_errors(runs[0], st["emu"], st["cu"].cpu())
    assert not _violations(err), err
