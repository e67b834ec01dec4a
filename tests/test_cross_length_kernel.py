"""The sm_90a forward in the cross-length causal and non-causal modes (FwdConfig.cross_length, causal=False).

CPU: the tile geometry (schedules.varlen_tiles.cross_tile, which the kernel calls while tracing) covers every
query once, puts each causal row's own key block on the tile's first (masked, per-token) key tile and only
wholly visible, wholly earlier key blocks after it; a model of the kernel's tile loop on that geometry equals
the emulator and passes the leakage checks, and a geometry with query tiles from the query range's start
(the per-token copies on the last key tile only) fails both; the builds compile for sm_90a without spills.
GPU (marker `gpu`): the kernel against the emulator at offsets Lk - Lq of 0, 1, 63, 64, 127, 128, 129, 999
and Lq > Lk, GQA and d64, the cross build on self-attention inputs bit-identical to the default build, and
the leakage checks on the kernel.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re

import pytest
import torch

from flamia_cute.cute_backend import _dsl_importable
from flamia_cute.emulator import emulate_forward
from flamia_cute.quant import E4M3, cast_to, dt_cu_seqlens, natural_dt, quantize_thd, transposed_tokens
from flamia_cute.recipes import FOLD_DROP, FOLD_REF_MIN, Recipe
from flamia_cute.schedules.varlen_tiles import (
    cross_chunk_table,
    cross_query_tiles,
    cross_tile,
    cross_tiles_model,
    floor_tiles,
)
from flamia_cute.testing import check_leakage_varlen, cu_seqlens_from_lengths, rel_l2

# only the DSL's absence skips these tests: an error in a project module fails its import
HAVE_DSL = _dsl_importable()
if HAVE_DSL:
    from flamia_cute.sm90.attention_fwd import FwdConfig, flamia_fwd_sm90, kernel_artifacts

needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl not importable")

RECIPES = {"fp8_token": 1, "fp8_tokenblock": 128}
# (Lq, Lk) per document; the first has offset 1, so its first tile's Q rows start before token 0 (TMA's zero
# fill of negative coordinates). Offsets Lk - Lq: 1, 0, 63, 64, 127, 128, 129, 129 (at a 128 boundary of Lq),
# -130 and -5 (queries before every key: O = 0, LSE = -inf), no queries, 999 (one query at the end).
CAUSAL_DOCS = [(200, 201), (130, 130), (300, 363), (64, 128), (50, 177), (257, 385), (129, 258), (256, 385),
               (200, 70), (5, 0), (0, 40), (1, 1000)]
NON_CAUSAL_DOCS = [(50, 300), (200, 17), (0, 40), (7, 0), (129, 129), (300, 1), (128, 256)]


def _cu(docs, side):
    return cu_seqlens_from_lengths([d[side] for d in docs])


def _inputs(docs, H, Hk, D, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(d[0] for d in docs), sum(d[1] for d in docs)
    q = torch.randn(tq, H, D, generator=g).bfloat16()
    k, v = (torch.randn(tk, Hk, D, generator=g).bfloat16() for _ in range(2))
    cu_q, cu_k = _cu(docs, 0), _cu(docs, 1)
    return (*(t.to(device) for t in (q, k, v, cu_q, cu_k)), 1.0 / math.sqrt(D))


def _quantized(q, k, v, cu_q, cu_k, block):
    """The operands the plan's two quantization launches write: Q per token over cu_q, K and V per block
    (and per-token copies) over cu_k."""
    qq = quantize_thd(q, cu_q, 1, transposed=False)
    kq, vq = quantize_thd(k, cu_k, block, transposed=False), quantize_thd(v, cu_k, block, pv_order=True)
    if block == 1:
        return qq, kq, vq, kq, vq
    return qq, kq, vq, quantize_thd(k, cu_k, 1, transposed=False), quantize_thd(v, cu_k, 1, pv_order=True)


# ----------------------------------------------------------------------------------------------
# CPU: the tile geometry
# ----------------------------------------------------------------------------------------------


def test_floor_tiles_is_floor_division():
    for x in range(-1000, 1000):
        assert floor_tiles(x) == x // 128


LENGTH_PAIRS = [(lq, lk) for lq in (0, 1, 5, 64, 127, 128, 129, 300) for lk in (0, 1, 63, 128, 129, 200, 300, 1000)]


@pytest.mark.parametrize("causal", [True, False])
def test_cross_tiles_cover_every_query_once(causal):
    """Every query row of every document in exactly one tile row, stored there; causal: the row's tile
    coordinate 128 m_block + r is its key position p = i + Lk - Lq (so the kernel's diagonal mask, key
    column > r, is key > p), the tile's first key tile is the one holding p (the per-token copies serve
    exactly the row's own block) and every later-processed key tile lies wholly before p's block (block
    scales there never carry a key after p); rows at p < 0 run with no key (k_len 0). Non-causal: the first
    key tile is the document's last, masked at Lk."""
    for lq, lk in LENGTH_PAIRS:
        n = cross_query_tiles(lq, lk, causal)
        seen = []
        for b in range(n):
            m, q_base, q_lo, q_hi, k_len = cross_tile(1000, 1000 + lq, 5000, 5000 + lk, b, causal)
            assert m >= 0 and (lq == 0 or q_lo < q_hi)
            for r in range(128):
                c = 128 * m + r
                if not q_lo <= c < q_hi:
                    continue
                i = q_base + c - 1000
                assert 0 <= i < lq
                seen.append(i)
                if causal:
                    p = i + lk - lq
                    if p < 0:
                        assert k_len == 0
                    else:
                        assert k_len == lk and c == p and p // 128 == m
                else:
                    assert k_len == lk and m == max((lk + 127) // 128 - 1, 0)
        assert sorted(seen) == list(range(lq)), (lq, lk)
        # at most one tile more than the queries' own (the partial first and last tiles)
        assert n <= (lq + 127) // 128 + int(causal and lq > 0)


def test_cross_tiles_equal_self_attention_tiles_at_offset_zero():
    """cu_seqlens_q == cu_seqlens_k: the geometry is self-attention's (block b: key tile b, rows from the
    document start), so the cross build on self-attention inputs is the default build's computation."""
    for length in (1, 127, 128, 129, 300, 1000):
        assert cross_query_tiles(length, length, True) == (length + 127) // 128
        for b in range(cross_query_tiles(length, length, True)):
            assert cross_tile(7, 7 + length, 7, 7 + length, b, True) == (b, 7, 0, length, length)


def test_cross_chunk_table_orders_tiles_by_document():
    docs = CAUSAL_DOCS
    cu_q, cu_k = _cu(docs, 0).tolist(), _cu(docs, 1).tolist()
    for causal in (True, False):
        cum = cross_chunk_table([d[0] for d in docs], [d[1] for d in docs], causal)
        tiles = cross_tiles_model(cu_q, cu_k, causal, heads=2)
        assert len(tiles) == 2 * cum[-1]
        assert [t[0] for t in tiles] == sorted(t[0] for t in tiles)


# ----------------------------------------------------------------------------------------------
# CPU: a model of the kernel's tile loop on the cross geometry
# ----------------------------------------------------------------------------------------------


def _query_aligned_tile(q_start, q_end, k_start, k_end, block, causal):
    """A wrong geometry (the control): query tiles of 128 queries from the query range's start, first key tile
    the one holding the tile's last query (so with an offset that is not a multiple of 128 the tile's first rows
    have their own block on the SECOND key tile, which then reads block scales)."""
    lq, lk = q_end - q_start, k_end - k_start
    last = min(128 * block + 127, lq - 1) + lk - lq
    m = max(last // 128, 0)
    q_base = q_start + 128 * block - 128 * m
    return m, q_base, q_start - q_base, q_end - q_base, lk


def cross_kernel_model(qq, kq, vq, kt, vt, cu_q, cu_k, scale, group, diag_copy, causal, geometry=cross_tile):
    """What the kernel computes per (document, head, query tile), row-vectorized, in its formulas: the tile
    of `geometry` (cross_tile), Q rows q_base + 128 m + r (zero fill outside [0, T)), Q scales of stored rows
    (1 elsewhere), key tiles m .. 0 of the key document (K rows k_start + 128 n, V^T columns from the key
    document's dt_cu_seqlens start, TMA zero fill past the ends), the first from the per-token copies when
    causal and block-scaled, K/V scales 0 at keys >= k_len, the first tile's mask (col > r when causal, col >=
    k_len - 128 n), the log2-domain online softmax with the V-scale fold and its drop rule, O = acc r / 256 / l.
    The control geometry (_query_aligned_tile) masks every tile by position (so only its scale choice is wrong)."""
    T, H, D = qq.data_td.shape
    Tk = kq.data_td.shape[0]
    out = torch.full((T, H, D), float("nan"))
    lse = torch.full((H, T), float("nan"))
    qc, kc, ktc = qq.data_td.float(), kq.data_td.float(), kt.data_td.float()
    vc, vtc = natural_dt(vq).float(), natural_dt(vt).float()
    T_dt = vc.shape[2]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    dtc = dt_cu_seqlens(cu_k).tolist()
    rows, col = torch.arange(128), torch.arange(128)
    control = geometry is not cross_tile
    for doc in range(len(cq) - 1):
        lq, lk = cq[doc + 1] - cq[doc], ck[doc + 1] - ck[doc]
        n_tiles = cross_query_tiles(lq, lk, causal) if not control else (lq + 127) // 128
        for block in range(n_tiles):
            m, q_base, q_lo, q_hi, k_len = geometry(cq[doc], cq[doc + 1], ck[doc], ck[doc + 1], block, causal)
            c = 128 * m + rows
            qrow = q_base + c
            valid = (c >= q_lo) & (c < q_hi)
            pos = qrow - cq[doc] + lk - lq  # the rows' key positions (the control's masks)
            for h in range(H):
                kh = h // group
                Q = torch.zeros(128, D)
                inb = (qrow >= 0) & (qrow < T)
                Q[inb] = qc[qrow[inb], h]
                sq = torch.where(valid, qq.scale[h, qrow.clamp(0, T - 1)], torch.ones(128))
                rs = sq * (scale * math.log2(math.e))
                M, L, R = torch.full((128,), -math.inf), torch.zeros(128), torch.zeros(128)
                acc = torch.zeros(128, D)
                for i in range(m + 1):
                    n = m - i
                    use_tok = i == 0 and diag_copy and causal
                    keys = ck[doc] + n * 128 + col
                    K = torch.zeros(128, D)
                    kin = keys < Tk
                    K[kin] = (ktc if use_tok else kc)[keys[kin], kh]
                    v0 = dtc[doc] + n * 128
                    assert v0 % 16 == 0, "the V^T box must start 16-byte aligned"
                    V = (vtc if use_tok else vc)[kh][:, v0 : v0 + 128]
                    V = torch.nn.functional.pad(V, (0, 128 - V.shape[1])).t()
                    assert v0 <= T_dt and torch.isfinite(V).all()
                    kvis = (n * 128 + col) < k_len
                    sk = torch.where(kvis, (kt if use_tok else kq).scale[kh, keys.clamp(max=Tk - 1)], 0.0)
                    sv = torch.where(kvis, (vt if use_tok else vq).scale[kh, keys.clamp(max=Tk - 1)], 0.0)
                    S = (Q @ K.t()) * sk[None, :]
                    W = sv[None, :].expand(128, 128).clone()
                    mask = None
                    if control:
                        mask = (n * 128 + col)[None, :] > pos[:, None]
                    elif i == 0:
                        mask = (col[None, :] > rows[:, None]) if causal else torch.zeros(128, 128, dtype=torch.bool)
                    if mask is not None:
                        mask = mask | (col[None, :] >= k_len - n * 128)
                        S, W = S.masked_fill(mask, -math.inf), W.masked_fill(mask, 0.0)
                    m_new = torch.maximum(M, S.amax(1) * rs)
                    m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
                    alpha = torch.exp2(M - m_safe)
                    r = W.amax(1)
                    keep = r >= torch.clamp_min(R.abs() * FOLD_DROP, FOLD_REF_MIN)
                    r = torch.where(keep, r, R.abs())
                    inv = torch.where(keep, 256.0 / r, 0.0)
                    P = torch.exp2(S * rs[:, None] - m_safe[:, None])
                    P8 = cast_to((P * sv[None, :]) * inv[:, None], E4M3)
                    L = L * alpha + P.sum(1)
                    acc = acc * (alpha * torch.where(keep, R.abs() / r, 1.0))[:, None] + P8 @ V
                    M, R = m_new, r
                f = torch.where(L > 0, (R / 256.0) / L, 0.0)
                ls = torch.where(L > 0, (M + torch.log2(L)) * math.log(2), -math.inf)
                out[qrow[valid], h] = (acc * f[:, None])[valid]
                lse[h, qrow[valid]] = ls[valid]
    return out.to(torch.bfloat16), lse


def _model_fn(recipe, causal, scale, group, geometry=cross_tile):
    block = RECIPES[recipe]

    def fn(q, k, v, cu_q, cu_k, dout=None):
        o, lse = cross_kernel_model(*_quantized(q, k, v, cu_q, cu_k, block), cu_q, cu_k, scale, group, block > 1,
                                    causal, geometry)
        return {"out": o, "lse": lse}

    return fn


def _agree(o, lse, eo, else_):
    assert not torch.isnan(o.float()).any() and not torch.isnan(lse).any(), "a row was never written"
    assert rel_l2(o.float(), eo.float()) < 1e-4
    assert torch.equal(torch.isinf(lse), torch.isinf(else_))
    fin = torch.isfinite(else_)
    assert (lse[fin] - else_[fin]).abs().max() < 1e-5


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("causal, H, Hk, D", [(True, 2, 1, 64), (True, 4, 2, 128), (False, 2, 1, 64)])
def test_cross_model_matches_emulator(recipe, causal, H, Hk, D):
    docs = CAUSAL_DOCS if causal else NON_CAUSAL_DOCS
    q, k, v, cu_q, cu_k, scale = _inputs(docs, H, Hk, D, seed=3)
    out = _model_fn(recipe, causal, scale, H // Hk)(q, k, v, cu_q, cu_k)
    eo, else_, _ = emulate_forward(q, k, v, cu_q, cu_k, scale, causal, Recipe.from_name(recipe))
    _agree(out["out"], out["lse"], eo, else_)
    # queries that see no key (before every key, or of a key-less document): O = 0, LSE = -inf
    starts = _cu(docs, 0).tolist()
    empty = [starts[d] + i for d, (lq, lk) in enumerate(docs) for i in range(lq) if (i + lk - lq < 0 if causal else lk == 0)]
    assert len(empty) >= 5
    assert not out["out"][empty].float().any() and torch.isinf(out["lse"][:, empty]).all()


@pytest.mark.parametrize("doc, cut", [(0, 100), (2, 64), (4, 128), (5, 129), (7, 300)])
def test_cross_model_passes_the_leakage_checks(doc, cut):
    """The future test in key positions (cuts inside and at the edge of a 128-key block, several offsets) and
    document isolation, on the model of the kernel's tiles (token-block scales: the diagonal safeguard)."""
    q, k, v, cu_q, cu_k, scale = _inputs(CAUSAL_DOCS, 2, 1, 64, seed=4)
    rep = check_leakage_varlen(_model_fn("fp8_tokenblock", True, scale, 2), q, k, v, cu_q, cu_k, doc=doc, cut=cut)
    assert rep.ok, str(rep)


def test_query_aligned_tiles_leak_and_differ():
    """Control: query tiles from the query range's start (the per-token copies on each tile's last key tile only)
    give rows whose own key block is an earlier tile block scales that span later keys: the future test fails
    and the values leave the emulator's. The same checks pass on cross_tile's geometry (tests above)."""
    q, k, v, cu_q, cu_k, scale = _inputs(CAUSAL_DOCS, 2, 1, 64, seed=4)
    bad = _model_fn("fp8_tokenblock", True, scale, 2, geometry=_query_aligned_tile)
    rep = check_leakage_varlen(bad, q, k, v, cu_q, cu_k, doc=2, cut=101)  # offset 63: rows 0-64 own block 0
    assert not rep.future_ok, str(rep)
    # a large key at position 120 of document 2: the queries at positions 63-119 must not feel its block scale
    k = k.clone()
    k[int(cu_k[2]) + 120] *= 2**14  # its block scale puts the others in e4m3 subnormals
    rows = slice(int(cu_q[2]), int(cu_q[2]) + 120 - 63)
    eo, _, _ = emulate_forward(q, k, v, cu_q, cu_k, scale, True, Recipe.from_name("fp8_tokenblock"))
    good = _model_fn("fp8_tokenblock", True, scale, 2)(q, k, v, cu_q, cu_k)["out"]
    assert rel_l2(good[rows].float(), eo[rows].float()) < 1e-4
    assert rel_l2(bad(q, k, v, cu_q, cu_k)["out"][rows].float(), eo[rows].float()) > 1e-2


# ----------------------------------------------------------------------------------------------
# CPU: sm_90a builds
# ----------------------------------------------------------------------------------------------

MODES = {"cross_causal": dict(cross_length=True), "non_causal": dict(causal=False)}


@needs_dsl
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("head_dim, diagonal_copy, extra", [(128, True, {}), (64, True, {}), (128, False, {}),
                                                            (128, True, {"persistent": False})])
def test_cross_builds_compile_without_spills(mode, head_dim, diagonal_copy, extra):
    """fp8 wgmma for S and P V (the two copies of the tile step), TMA loads, 16-byte O stores, no local
    memory; the cross-length build reads the per-token copies on its first tile, the non-causal build not."""
    art = kernel_artifacts(FwdConfig(head_dim=head_dim, diagonal_copy=diagonal_copy, **MODES[mode], **extra))
    n_mma = 2 * (head_dim // 32 + 4)
    assert len(re.findall(r"wgmma\.mma_async[^\n]*e4m3\.e4m3", art.ptx)) == n_mma
    assert not re.search(r"\b(ld|st)\.local\b", art.ptx)
    assert art.frame_bytes in (None, 0)
    if art.sass is not None:
        assert not re.search(r"\b(STL|LDL)\b", art.sass), "register spills in SASS"
        assert len(re.findall(r"\bQGMMA\b", art.sass)) == n_mma
        assert len(re.findall(r"\bSTG\.E\.128\b", art.sass)) == 2 * head_dim // 32


@needs_dsl
@pytest.mark.parametrize("field, value, match", [
    ("cross_length", 1, "must be a bool"), ("causal", 0, "must be a bool"),
])
def test_config_rejects(field, value, match):
    with pytest.raises(ValueError, match=match):
        FwdConfig(head_dim=128, **{field: value})


@needs_dsl
def test_config_rejects_combinations():
    with pytest.raises(ValueError, match="cross_length"):
        FwdConfig(head_dim=128, causal=False, cross_length=True)
    for mode in MODES.values():
        with pytest.raises(ValueError, match="short_pairs"):
            FwdConfig(head_dim=128, short_pairs=True, **mode)
        assert FwdConfig(head_dim=128, **mode).separate_keys
    assert not FwdConfig(head_dim=128).separate_keys


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------

VARIANTS = {"default": {}, "per_tile": {"persistent": False}, "longest_documents": {"tile_order": "longest_documents"},
            "stages3": {"kv_stages": 3}}


def run_cross_kernel(q, k, v, cu_q, cu_k, scale, recipe, causal, variant="default", poison=True):
    block = RECIPES[recipe]
    qq, kq, vq, kt, vt = _quantized(q, k, v, cu_q, cu_k, block)
    assert vq.data_dt.shape[2] == transposed_tokens(k.shape[0], cu_k.numel() - 1)
    cfg = FwdConfig(head_dim=q.shape[2], qhead_per_kvhead=q.shape[1] // k.shape[1], diagonal_copy=block > 1,
                    causal=causal, cross_length=causal, **VARIANTS[variant])
    lens = (cu_q[1:] - cu_q[:-1]).tolist()
    tok = block > 1
    return flamia_fwd_sm90(
        qq.data_td, qq.scale, kq.data_td, kq.scale, vq.data_dt, vq.scale,
        kt.data_td if tok else None, kt.scale if tok else None, vt.data_dt if tok else None, vt.scale if tok else None,
        cu_q, max(lens), scale, cfg, poison_outputs=poison, cu_seqlens_k=cu_k)


def _gpu_check(docs, recipe, causal, H, Hk, D, seed, variant="default"):
    from test_attention_fwd_kernel import _errors, _violations

    q, k, v, cu_q, cu_k, scale = _inputs(docs, H, Hk, D, seed, device="cuda")
    out, lse = run_cross_kernel(q, k, v, cu_q, cu_k, scale, recipe, causal, variant)
    torch.cuda.synchronize()
    eo, else_, _ = emulate_forward(q, k, v, cu_q, cu_k, scale, causal, Recipe.from_name(recipe))
    res = _errors(out, lse, eo, else_, cu_q.cpu())
    assert not _violations(res), res
    # no visible key: exactly O = 0, LSE = -inf (the emulator's)
    none = torch.isinf(else_.cpu()).all(0)
    assert not out.cpu()[none].float().any() and torch.isinf(lse.cpu()[:, none]).all()


# the default build in make test-gpu; the other builds the runtime can pick (tuner, many documents) in the full tier
_VARIANT_PARAMS = ["default", *(pytest.param(v, marks=pytest.mark.gpu_full) for v in VARIANTS if v != "default")]


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("variant", _VARIANT_PARAMS)
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("causal, H, Hk, D", [(True, 4, 2, 128), (True, 2, 1, 64), (False, 4, 2, 128),
                                              (False, 2, 1, 64)])
def test_gpu_cross_matches_emulator(recipe, causal, H, Hk, D, variant):
    _gpu_check(CAUSAL_DOCS if causal else NON_CAUSAL_DOCS, recipe, causal, H, Hk, D, seed=11, variant=variant)


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_cross_per_tile_build(causal):
    """The one-CTA-per-tile builds (any pack of more than PERSISTENT_MAX_DOCS documents, normal for context
    parallelism): their own grid and block order, in the default tier once per mode."""
    _gpu_check(CAUSAL_DOCS if causal else NON_CAUSAL_DOCS, "fp8_tokenblock", causal, 4, 2, 128, seed=12,
               variant="per_tile")


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_gpu_cross_build_on_self_attention_is_the_default_build(recipe):
    """cu_seqlens_k == cu_seqlens_q: the cross-length build's tiles are self-attention's, so O and LSE equal the
    default build's bit for bit."""
    from test_attention_fwd_kernel import _run_kernel

    lengths = [1, 127, 128, 129, 1000, 0, 300]
    docs = [(n, n) for n in lengths]
    q, k, v, cu_q, cu_k, scale = _inputs(docs, 4, 2, 128, seed=12, device="cuda")
    got = run_cross_kernel(q, k, v, cu_q, cu_k, scale, recipe, True)
    ref = _run_kernel(q, k, v, cu_q, scale, recipe)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("recipe", ["fp8_tokenblock", pytest.param("fp8_token", marks=pytest.mark.gpu_full)])
@pytest.mark.parametrize("doc, cut", [(0, 100), (2, 64), (4, 128), (5, 129), (7, 300)])
def test_gpu_cross_leakage(recipe, doc, cut):
    q, k, v, cu_q, cu_k, scale = _inputs(CAUSAL_DOCS, 4, 2, 128, seed=13)

    def fn(q_, k_, v_, cq, ck, dout=None):
        out, lse = run_cross_kernel(q_.cuda(), k_.cuda(), v_.cuda(), cq.cuda(), ck.cuda(), scale, recipe, True,
                                    poison=False)
        return {"out": out.cpu(), "lse": lse.cpu()}

    rep = check_leakage_varlen(fn, q, k, v, cu_q, cu_k, doc=doc, cut=cut)
    assert rep.ok, str(rep)


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_gpu_non_causal_isolation(recipe):
    q, k, v, cu_q, cu_k, scale = _inputs(NON_CAUSAL_DOCS, 4, 2, 128, seed=14)

    def fn(q_, k_, v_, cq, ck, dout=None):
        out, lse = run_cross_kernel(q_.cuda(), k_.cuda(), v_.cuda(), cq.cuda(), ck.cuda(), scale, recipe, False,
                                    poison=False)
        return {"out": out.cpu(), "lse": lse.cpu()}

    for doc in (0, 1, 4):
        rep = check_leakage_varlen(fn, q, k, v, cu_q, cu_k, doc=doc, causal=False)
        assert rep.ok, str(rep)


@pytest.mark.gpu
@needs_dsl
def test_gpu_separate_quantization_is_the_reference():
    """The plan's two launches (Q over cu_seqlens_q, K and V over cu_seqlens_k) write the reference quantizer's
    bytes into one allocation."""
    from flamia_cute.plan import make_plan
    from flamia_cute.sm90.quantize import fused_quantize_qkv_separate_sm90

    q, k, v, cu_q, cu_k, _ = _inputs(CAUSAL_DOCS, 4, 2, 128, seed=16, device="cuda")
    plan = make_plan("fp8_tokenblock_dsbf16", 128, 4, 2, 300, q.shape[0], len(CAUSAL_DOCS), True, True)
    assert plan.separate_keys and plan.bwd.cross_length and plan.fwd.cross_length
    (qq, _), (kq, kt), (vq, vt) = fused_quantize_qkv_separate_sm90(q, k, v, cu_q, cu_k, plan.qkv)
    ref = _quantized(q, k, v, cu_q, cu_k, 128)
    assert len({t.data_td.untyped_storage().data_ptr() for t in (qq, kq, kt)}) == 1
    for got, want, fields in ((qq, ref[0], ("data_td", "scale")), (kq, ref[1], ("data_td", "scale")),
                              (vq, ref[2], ("data_dt", "scale")), (kt, ref[3], ("data_td", "scale")),
                              (vt, ref[4], ("data_dt", "scale"))):
        for f in fields:
            assert torch.equal(getattr(got, f).view(torch.uint8), getattr(want, f).view(torch.uint8)), f


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("recipe", ["fp8_tokenblock_dsbf16", "fp8_tokenblock", "fp8_token", "fp8_tensor_current"])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_api_runs_the_kernels_in_both_modes(recipe, causal):
    """flamia_attn_varlen_func(backend="cute"): the forward kernel within the forward's bounds of the emulator,
    the gradients (the backward kernel for the bf16-dS recipe and the per-tensor control, the emulator's backward
    on the kernel's saved operands for the e4m3-dS ones) within test_cute_backend's bounds."""
    from flamia_cute.testing import attention_fn_for

    docs = CAUSAL_DOCS if causal else NON_CAUSAL_DOCS
    q, k, v, cu_q, cu_k, scale = _inputs(docs, 4, 2, 128, seed=15, device="cuda")
    do = torch.randn_like(q)
    got = attention_fn_for(recipe, scale, causal=causal, backend="cute").varlen(q, k, v, cu_q, cu_k, do)
    ref = attention_fn_for(recipe, scale, causal=causal, backend="emulate").varlen(q, k, v, cu_q, cu_k, do)
    assert rel_l2(got["out"], ref["out"]) < 8e-3
    assert torch.equal(torch.isinf(got["lse"]), torch.isinf(ref["lse"]))
    for name in ("dq", "dk", "dv"):
        assert rel_l2(got[name], ref[name]) < 2e-2, name


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("recipe", ["fp8_tokenblock_dsbf16", "fp8_token"])
def test_gpu_query_range_equals_the_whole_document(recipe):
    """Context parallelism's shard on the kernels: a document's query range [a, b) with its keys [start, b) gives
    the whole-document self-attention call's O and LSE on those rows bit for bit (the same 128-position tiles,
    the same K/V blocks from the document's start, the per-token copies on each row's own block)."""
    from flamia_cute import flamia_attn_varlen_func

    lengths = [300, 517, 1, 130, 260]
    ranges = [(100, 300), (203, 411), (0, 1), (0, 130), (129, 257)]
    g = torch.Generator().manual_seed(17)
    T = sum(lengths)
    q, k, v = (torch.randn(T, h, 128, generator=g).bfloat16().cuda() for h in (4, 2, 2))
    cu = cu_seqlens_from_lengths(lengths).cuda()
    starts = cu.tolist()[:-1]
    qr = torch.tensor([s + i for s, (a, b) in zip(starts, ranges, strict=True) for i in range(a, b)], device="cuda")
    kr = torch.tensor([s + i for s, (a, b) in zip(starts, ranges, strict=True) for i in range(b)], device="cuda")
    cu_q = cu_seqlens_from_lengths([b - a for a, b in ranges]).cuda()
    cu_k = cu_seqlens_from_lengths([b for _, b in ranges]).cuda()
    whole, lse_w = flamia_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), recipe=recipe, backend="cute",
                                           return_lse=True)
    part, lse_p = flamia_attn_varlen_func(q[qr], k[kr], v[kr], cu_q, cu_k, 208, 411, recipe=recipe, backend="cute",
                                          return_lse=True)
    assert torch.equal(part, whole[qr]) and torch.equal(lse_p, lse_w[:, qr])


# ----------------------------------------------------------------------------------------------
# CPU: the backward (BwdDsBf16Config.cross_length, causal=False): geometry and a model of its tile loop
# ----------------------------------------------------------------------------------------------


def _bwd_items(docs, causal, geometry=None):
    from flamia_cute.schedules.varlen_tiles import backward_cross_item

    geometry = geometry or backward_cross_item
    cq, ck = _cu(docs, 0).tolist(), _cu(docs, 1).tolist()
    for d in range(len(docs)):
        for n in range((ck[d + 1] - ck[d] + 127) // 128):
            yield d, n, geometry(cq[d], cq[d + 1], ck[d], ck[d + 1], n, causal)


@pytest.mark.parametrize("causal", [True, False])
def test_backward_tiles_cover_every_visible_pair_once(causal):
    """Every (query, key) pair a query sees is in exactly one (key block, query tile) of its document, masked
    tiles exactly where some pair of the tile is not seen, and (causal) the masked tiles are the rows' own key
    block (per-token K/V) while the unmasked ones lie wholly after the block; no tile holds only rows outside the
    queries; a key block with keys and queries has work."""
    pairs = [(lq, lk) for lq in (1, 5, 64, 127, 128, 129, 300) for lk in (0, 1, 63, 64, 127, 128, 129, 200, 300, 640)]
    docs = pairs
    cq = _cu(docs, 0).tolist()
    for d, n, (live, q_base, q_lo, q_hi, m_lo, d0, n_diag, p0, per) in _bwd_items(docs, causal):
        lq, lk = docs[d]
        assert live == (lq > 0 and 128 * n < lk)
        if not live:
            continue
        assert n_diag > 0 or per > 0
        tiles = [(m, True) for m in range(d0, d0 + n_diag)] + [(m, False) for m in range(p0, p0 + max(per, 0))]
        # m_lo, the tile of the first query (dO^T's first columns), is before every tile of the block
        assert m_lo == max(q_lo, 0) // 64 and min(m for m, _ in tiles) >= m_lo
        seen = set()
        for m, masked in tiles:
            rows = [c for c in range(64 * m, 64 * m + 64) if q_lo <= c < q_hi]
            assert rows, (docs[d], n, m)
            for c in rows:
                i = q_base + c - cq[d]
                p = i + lk - lq
                if causal:
                    assert c == p
                vis = [key for key in range(128 * n, min(128 * n + 128, lk)) if not causal or key <= p]
                if not masked:  # every key of the block seen: no mask, block scales (causal: wholly before p)
                    assert len(vis) == 128 and (not causal or p // 128 > n)
                elif causal:
                    assert p // 128 == n  # the row's own block: per-token K/V there
                seen |= {(i, key) for key in vis}
        want = {(i, key) for i in range(lq) for key in range(128 * n, min(128 * n + 128, lk))
                if not causal or key <= i + lk - lq}
        assert seen == want, (docs[d], n)


def cross_backward_model(st, causal, geometry=None, bug=None):
    """What the backward kernel computes, per (document, KV head, key block) of `geometry`
    (backward_cross_item) and query tile, in its formulas: Q, dO rows q_base + 64 m + r (only the stored rows'
    vectors: LSE +inf and dO scale 0 elsewhere), K rows and V of the key document (per-token on the masked tiles
    when causal and block-scaled), P^T = exp2(S^T sk sq scale log2e - lse log2e) masked on the masked tiles
    (key after the row's key position, or past the end), dS^T = P^T (dP^T sv sdo - D), dV += e4m3(P^T sdo 256 / r)
    dO^T with dO^T read from the layout the host builds (separate_keys_dot; the queries' own for non-causal),
    dK += bf16(dS^T) (Q codes sq), dQ += bf16(dS) (K codes sk) softmax_scale. The unmasked tiles assert that
    they need no mask. bug (the controls): "block_on_diagonal" (the masked tiles read the block scales),
    "dot_unshifted" (dO^T's tile m at the document's column 64 m, without the first tile's shift)."""
    from flamia_cute.quant import QuantizedTHD
    from flamia_cute.schedules.varlen_tiles import backward_cross_item
    from flamia_cute.sm90.bwd_preprocess import separate_keys_dot

    geometry = geometry or backward_cross_item
    qq, kq, vq, kt, vt = st["ops"]
    cu_q, cu_k, scale, group = st["cu_q"], st["cu_k"], st["scale"], st["group"]
    diag_first = st["block"] > 1 and causal and bug != "block_on_diagonal"
    T, H, D = qq.data_td.shape
    Tk, Hk = kq.data_td.shape[:2]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    doq = st["doq"]
    if causal:
        dot, dot_cu = separate_keys_dot(doq.data_td, cu_q, cu_k)
        dot = natural_dt(QuantizedTHD(None, dot, doq.scale, 1, "e4m3", True)).float()
    else:
        dot, dot_cu = natural_dt(doq).float(), dt_cu_seqlens(cu_q)
    dot_cu = dot_cu.tolist()
    vals = lambda x: x.data_td.float()  # noqa: E731
    v_codes = {id(o): natural_dt(o).float() for o in (vq, vt)}
    dvt = dt_cu_seqlens(cu_k).tolist()
    lse, delta, sdo = st["lse"], st["delta"], doq.scale
    dq = torch.zeros(T, H, D)
    dk = torch.zeros(Tk, Hk, D)
    dv = torch.zeros(Tk, Hk, D)
    log2e = math.log2(math.e)
    keys_l = torch.arange(128)
    for doc, n, (live, q_base, q_lo, q_hi, m_lo, d0, n_diag, p0, per) in _bwd_items(st["docs"], causal, geometry):
        if not live:
            continue
        lq, lk = cq[doc + 1] - cq[doc], ck[doc + 1] - ck[doc]
        kpos = 128 * n + keys_l
        kvalid = kpos < lk
        krows = (ck[doc] + kpos).clamp(max=Tk - 1)
        lim = lk - 128 * n
        for kh in range(Hk):
            r = max(sdo[kh * group:(kh + 1) * group, cq[doc]:cq[doc + 1]].max().item(), FOLD_REF_MIN)
            acc_dv, acc_dk = torch.zeros(128, D), torch.zeros(128, D)
            for phase, first, count in ((0, d0, n_diag), (1, p0, per)):
                if count <= 0:
                    continue
                ko, vo = (kt, vt) if phase == 0 and diag_first else (kq, vq)
                K = torch.where(kvalid[:, None], vals(ko)[krows, kh], 0.0)
                sk = torch.where(kvalid, ko.scale[kh, krows], 0.0)
                sv = torch.where(kvalid, vo.scale[kh, krows], 0.0)
                vcols = (dvt[doc] + kpos).clamp(max=v_codes[id(vo)].shape[2] - 1)
                V = torch.where(kvalid[:, None], v_codes[id(vo)][kh][:, vcols].t(), 0.0)
                for t in range(group * count):
                    hq, m = kh * group + t // count, first + t % count
                    c = 64 * m + torch.arange(64)
                    qrow = q_base + c
                    valid = (c >= q_lo) & (c < q_hi)
                    qr = qrow.clamp(0, T - 1)
                    pos = qrow - cq[doc] + lk - lq if causal else None
                    Q = torch.where(valid[:, None], vals(qq)[qr, hq], 0.0)
                    dO = torch.where(valid[:, None], vals(doq)[qr, hq], 0.0)
                    a = torch.where(valid, qq.scale[hq, qr] * scale * log2e, 0.0)
                    b = torch.where(valid, lse[hq, qr] * log2e, math.inf)
                    dd = torch.where(valid, delta[hq, qr], 0.0)
                    w = torch.where(valid, sdo[hq, qr], 0.0)
                    s_ = torch.where(valid, qq.scale[hq, qr], 0.0)
                    shift = 0 if bug == "dot_unshifted" else 64 * m_lo
                    ocols = (dot_cu[doc] - shift + c).clamp(0, dot.shape[2] - 1)
                    dOt = dot[hq][:, ocols]  # (D, 64) as the TMA box
                    P = torch.exp2((K @ Q.t()) * sk[:, None] * a[None, :] - b[None, :])
                    if phase == 0:
                        hide = keys_l[:, None] >= lim
                        if causal:
                            hide = hide | (kpos[:, None] > pos[None, :])
                        P = torch.where(hide, 0.0, P)
                    else:  # no mask: every stored row sees every key of the block
                        if causal:
                            assert ((kpos[:, None] <= pos[None, :]) | ~valid[None, :]).all()
                        assert kvalid.all()
                    dP = V @ dO.t()
                    dS = P * (dP * sv[:, None] * w[None, :] - dd[None, :])
                    P8 = cast_to(P * (w * (256.0 / r))[None, :], E4M3)
                    acc_dv += P8 @ dOt.t()
                    dSb = dS.bfloat16().float()
                    acc_dk += dSb @ (Q * s_[:, None])
                    dq_t = (dSb.t() @ (K * sk[:, None])) * scale
                    dq[qrow[valid], hq] += dq_t[valid]
            dv[ck[doc] + kpos[kvalid], kh] = (acc_dv * (r / 256.0))[kvalid]
            dk[ck[doc] + kpos[kvalid], kh] = (acc_dk * scale)[kvalid]
    return dq.bfloat16(), dk.bfloat16(), dv.bfloat16()


def _bwd_state(docs, recipe, causal, H, Hk, D, seed, tensors=None):
    from flamia_cute.emulator import emulate_backward

    q, k, v, cu_q, cu_k, scale = _inputs(docs, H, Hk, D, seed)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    if tensors is not None:
        q, k, v, do = tensors
    rec = Recipe.from_name(recipe)
    out, lse, ctx = emulate_forward(q, k, v, cu_q, cu_k, scale, causal, rec)
    block = RECIPES.get(recipe, 128)
    ops = _quantized(q, k, v, cu_q, cu_k, block)
    doq = quantize_thd(do, cu_q, 1, pv_order=True)
    # D from the dO that dP reads where the recipe says so (recipes.DELTAS), as the dO pass computes it
    d_src = doq.data_td.float() * doq.scale.t()[:, :, None] if rec.delta == "quantized" else do.float()
    delta = (d_src * out.float()).sum(-1).t().contiguous()
    return dict(docs=docs, ops=ops, cu_q=cu_q, cu_k=cu_k, scale=scale, group=H // Hk, block=block, doq=doq,
                out=out, lse=lse, delta=delta, emu=emulate_backward(do, ctx), inputs=(q, k, v, do))


@pytest.mark.parametrize("causal, H, Hk, D", [(True, 2, 1, 64), (False, 2, 1, 64), (True, 4, 2, 64)])
def test_cross_backward_model_matches_emulator(causal, H, Hk, D):
    docs = CAUSAL_DOCS if causal else NON_CAUSAL_DOCS
    st = _bwd_state(docs, "fp8_tokenblock_dsbf16", causal, H, Hk, D, seed=21)
    got = cross_backward_model(st, causal)
    for name, g, e in zip(("dq", "dk", "dv"), got, st["emu"], strict=True):
        assert torch.isfinite(g.float()).all(), name
        assert rel_l2(g.float(), e.float()) < 5e-4, (name, rel_l2(g.float(), e.float()))


def _bwd_model_fn(causal, bug=None, docs=CAUSAL_DOCS):
    def fn(q, k, v, cu_q, cu_k, dout=None):
        st = _bwd_state(docs, "fp8_tokenblock_dsbf16", causal, q.shape[1], k.shape[1], q.shape[2], 0,
                        tensors=(q, k, v, dout))
        dq, dk, dv = cross_backward_model(st, causal, bug=bug)
        return {"out": st["out"], "lse": st["lse"], "dq": dq, "dk": dk, "dv": dv}

    return fn


# doc 5's queries start at key 128: cut 131 compares three queries on key block 1's diagonal tile (cut 129
# compares one, whose dQ change under the control can vanish in bf16 rounding)
@pytest.mark.parametrize("doc, cut", [(2, 101), (5, 131)])
def test_cross_backward_model_passes_the_leakage_checks(doc, cut):
    """The future test (dQ before the cut bitwise) and document isolation (every other document's dQ, dK, dV)
    on the backward model; reading the block scales on the masked tiles fails the future test."""
    st = _bwd_state(CAUSAL_DOCS, "fp8_tokenblock_dsbf16", True, 2, 1, 64, seed=22)
    q, k, v, do = st["inputs"]
    rep = check_leakage_varlen(_bwd_model_fn(True), q, k, v, st["cu_q"], st["cu_k"], do, doc=doc, cut=cut)
    assert rep.ok, str(rep)
    bad = check_leakage_varlen(_bwd_model_fn(True, "block_on_diagonal"), q, k, v, st["cu_q"], st["cu_k"], do,
                               doc=doc, cut=cut)
    assert not bad.future_ok, str(bad)


def _turn_violations(docs, causal, geometry=None):
    adds = {}
    for d, n, (live, _, _, _, _, d0, n_diag, p0, per) in _bwd_items(docs, causal, geometry):
        if live:
            for m in [*range(d0, d0 + n_diag), *range(p0, p0 + max(per, 0))]:
                adds.setdefault((d, m), []).append(n)
    bad = []
    for (d, m), blocks in adds.items():
        lq, lk = docs[d]
        grid_len = lk if causal else max(lk, lq)
        if blocks != list(range(len(blocks))) or m >= 2 * -(-grid_len // 128):
            bad.append((docs[d], m, blocks))
    return bad, len(adds)


@pytest.mark.parametrize("causal", [True, False])
def test_deterministic_dq_turns_cannot_wait_forever(causal):
    """The deterministic dQ's turns (reduce_dq, dq_turn_wait_warp): key block n adds to query tile m when the
    tile's counter reaches n, so the key blocks that add to a tile must be exactly 0 .. k of its document
    (a block that skipped a tile would leave every later one waiting: a hang on the GPU, not an error), and
    m must lie within the counters' 2 per grid key block (the grid's blocks cover max(Lk, Lq) when
    non-causal). A schedule whose block 1 skips its last tile fails the check."""
    from flamia_cute.schedules.varlen_tiles import backward_cross_item

    rng = random.Random(7)
    docs = [(lq, lk) for lq in (1, 5, 63, 64, 65, 127, 128, 129, 300) for lk in (1, 63, 64, 65, 128, 129, 300, 640)]
    docs += [(rng.randint(1, 900), rng.randint(1, 900)) for _ in range(300)]
    docs = [(lq, lk) for lq, lk in docs if lq <= lk or not causal]
    bad, n_tiles = _turn_violations(docs, causal)
    assert n_tiles > 0 and bad == []

    def skips(q0, q1, k0, k1, n, causal, *a):
        item = backward_cross_item(q0, q1, k0, k1, n, causal, *a)
        if n == 1 and item[8] > 0:  # block 1 drops its last off-diagonal tile
            item = (*item[:8], item[8] - 1)
        return item

    assert _turn_violations(docs, causal, skips)[0]


def test_cross_length_dq_tiles_start_within_the_pad_rows():
    """Every dQ tile a causal cross-length CTA adds starts at a row in [-DQ_PAD_ROWS, T) (the accumulator's pad
    and its rows; the TMA drops a tile's rows past T - 1); without the pad some start below row 0 (the tiles that stopped the
    kernel: a first document, or one after documents with few queries, whose queries start off the 64-row grid
    of its keys)."""
    from flamia_cute.sm90.attention_bwd import DQ_PAD_ROWS

    rng = random.Random(5)
    packs = [[(999, 1000)], [(63, 64), (128, 128)], [(5, 100), (10, 300)], [(0, 40), (1, 1000)], CAUSAL_DOCS]
    packs += [[(lq, lq + rng.choice([0, 1, 31, 63, 64, 65, 127, 999])) for lq in
               (rng.choice([0, 1, 5, 63, 64, 200, 700]) for _ in range(rng.randint(1, 6)))] for _ in range(200)]
    lowest = 0
    for docs in packs:
        T = sum(d[0] for d in docs)
        for _, _, (live, q_base, _, _, _, d0, n_diag, p0, per) in _bwd_items(docs, True):
            if not live:
                continue
            tiles = [*range(d0, d0 + n_diag), *range(p0, p0 + max(per, 0))]
            for m in tiles:
                row = q_base + 64 * m
                lowest = min(lowest, row)
                assert row >= -DQ_PAD_ROWS, (docs, row)
                assert row < T, (docs, row)
    assert lowest < 0  # the pad is needed


def test_cross_length_dq_accumulator_has_pad_rows_before_row_0():
    """The cross-length build's dQ accumulator: DQ_PAD_ROWS rows allocated before row 0 (the first document's
    first dQ tile starts up to 63 rows before its first query), the view from row 0 returned."""
    from flamia_cute.sm90.attention_bwd import DQ_PAD_ROWS, QUERY_TILE, BwdDsBf16Config, dq_kernel_ptr, dq_pad_rows
    from flamia_cute.sm90.bwd_preprocess import backward_outputs

    assert DQ_PAD_ROWS >= QUERY_TILE - 1
    assert dq_pad_rows(BwdDsBf16Config(head_dim=128, cross_length=True)) == DQ_PAD_ROWS
    assert dq_pad_rows(BwdDsBf16Config(head_dim=128, causal=False)) == 0  # tiles from the first query
    assert dq_pad_rows(BwdDsBf16Config(head_dim=128)) == 0
    dq, _, _ = backward_outputs(10, 4, 2, 64, "cpu", dq_pad_rows=DQ_PAD_ROWS)
    assert dq.shape == (10, 4, 64) and dq.is_contiguous() and not dq.any()
    assert dq.storage_offset() == DQ_PAD_ROWS * 4 * 64 and dq.untyped_storage().nbytes() == (10 + DQ_PAD_ROWS) * 4 * 64 * 4
    # the kernel's address: the first allocated row for cross_length, the view's own otherwise
    cross, plain = BwdDsBf16Config(head_dim=64, cross_length=True), BwdDsBf16Config(head_dim=64)
    assert dq_kernel_ptr(dq, cross) == dq.untyped_storage().data_ptr()
    unpadded, _, _ = backward_outputs(10, 4, 2, 64, "cpu")
    assert dq_kernel_ptr(unpadded, plain) == unpadded.data_ptr()
    with pytest.raises(ValueError, match="dq_acc: a cross_length build needs 64 rows"):
        dq_kernel_ptr(unpadded, cross)


def test_cross_backward_model_control_leaves_the_emulator():
    """dO^T read without the first query tile's column shift (a document whose queries start past key 64)."""
    st = _bwd_state(CAUSAL_DOCS, "fp8_tokenblock_dsbf16", True, 2, 1, 64, seed=23)
    _, _, dv = cross_backward_model(st, True, bug="dot_unshifted")
    assert rel_l2(dv.float(), st["emu"][2].float()) > 1e-2


_BWD_BUILDS = [(128, True, {}), (64, True, {}), (128, False, {}), (128, True, {"deterministic": True}),
               (64, True, {"deterministic": True}), (128, False, {"deterministic": True})]


@needs_dsl
@pytest.mark.parametrize("mode, head_dim, diagonal_copy, extra", [
    (mode, *build) for mode in MODES for build in _BWD_BUILDS])
def test_cross_backward_builds_compile_without_spills(mode, head_dim, diagonal_copy, extra):
    """The self-attention build's products (two copies of the tile step; the d64 prefetch's S^T/dP^T issues),
    both phases' K/V loads (phase 1's under a runtime condition: a
    block without diagonal tiles, or the per-token copies before), no spills, no serialized wgmmas, no warp
    collective under a lane-dependent branch."""
    from collections import Counter

    from flamia_cute.kernels import lane_divergent_collectives
    from flamia_cute.sm90.attention_bwd import BwdDsBf16Config
    from flamia_cute.sm90.attention_bwd import kernel_artifacts as bwd_artifacts

    cfg = BwdDsBf16Config(head_dim=head_dim, diagonal_copy=diagonal_copy, **extra)
    art = bwd_artifacts(dataclasses.replace(cfg, **MODES[mode]))
    ops = lambda a: Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+\.f32\.\w+\.\w+)", a.ptx))  # noqa: E731
    assert ops(art) == ops(bwd_artifacts(cfg))  # the self-attention build's products
    loads = len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared", art.ptx))
    assert loads == 2 * 4 + 2 * (3 + head_dim // 64)
    assert lane_divergent_collectives(art.ptx) == []
    assert not re.search(r"\b(ld|st)\.local\b", art.ptx) and art.frame_bytes in (None, 0)
    if art.sass is not None:
        assert not re.search(r"\b(STL|LDL)\b", art.sass), "register spills in SASS"
        assert len(re.findall(r"\bWARPGROUP\.ARRIVE\b", art.sass)) <= 8


def _gpu_bwd_run(docs, recipe, causal, H, Hk, D, seed, deterministic=False, q_k_v_do=None):
    """The backward kernel on the forward's saved operands (the reference quantizer's, as the plan's two
    launches write them) and the emulator's O and LSE: ((dq, dk, dv), the emulator's, cu_q)."""
    from flamia_cute.emulator import EmulatorContext, emulate_backward, operand_from_quantized
    from flamia_cute.sm90.attention_bwd import BwdDsBf16Config, flamia_bwd_dsbf16_sm90_from_saved

    q, k, v, cu_q, cu_k, scale = _inputs(docs, H, Hk, D, seed, device="cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1)).bfloat16().cuda()
    if q_k_v_do is not None:
        q, k, v, do = (t.cuda() for t in q_k_v_do)
    rec = Recipe.from_name(recipe)
    out, lse, _ = emulate_forward(q, k, v, cu_q, cu_k, scale, causal, rec)
    qq, kq, vq, kt, vt = _quantized(q, k, v, cu_q, cu_k, 128)
    ectx = EmulatorContext(rec, scale, causal, cu_q, cu_k, operand_from_quantized(qq),
                           operand_from_quantized(kq, kt), operand_from_quantized(vq, vt, cu_k), out, lse)
    emu = emulate_backward(do, ectx)
    cfg = BwdDsBf16Config(head_dim=D, qhead_per_kvhead=H // Hk, diagonal_copy=True, causal=causal,
                          cross_length=causal, deterministic=deterministic)
    lq, lk = (cu_q[1:] - cu_q[:-1]).max().item(), (cu_k[1:] - cu_k[:-1]).max().item()
    got = flamia_bwd_dsbf16_sm90_from_saved(do, out, lse, qq, kq, vq, kt, vt, cu_q, lq, scale, config=cfg,
                                            poison_outputs=True, cu_seqlens_k=cu_k, max_seqlen_k=lk)
    torch.cuda.synchronize()
    return got, emu, cu_q, cu_k


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal, H, Hk, D", [(True, 4, 2, 128), (True, 2, 1, 64), (False, 4, 2, 128),
                                              (False, 2, 1, 64)])
def test_gpu_cross_backward_matches_emulator(causal, H, Hk, D, deterministic):
    """The backward kernel's separate-keys builds against emulate_backward on the same operands (the backward
    kernel tests' tolerances; dK and dV per key document, dQ per query document); every dK, dV row written
    (NaN-poisoned) and 0 for the keys of a document without queries."""
    _gpu_backward_check(CAUSAL_DOCS if causal else NON_CAUSAL_DOCS, causal, H, Hk, D, deterministic)


# the first document's queries start 64 and 999 keys into it: its dO^T columns and Q, dO, dQ rows start
# before the tensors' first row (the default packs reach only one row before it)
FAR_FIRST_DOCS = [(64, 128), (1, 1000), (300, 363), (0, 40), (129, 258)]


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("docs", [FAR_FIRST_DOCS, FAR_FIRST_DOCS[1:], [(999, 1000), (128, 128)], [(63, 64)]],
                         ids=["offset64", "offset999", "first-offset1", "one-tile-offset1"])
def test_gpu_cross_backward_far_first_document(docs, deterministic):
    """The first document's queries start 64 or 999 keys in, or 1 (its first dQ tile then starts before row 0,
    in the accumulator's pad rows: a TMA reduce-add at a negative row stopped the kernel)."""
    _gpu_backward_check(docs, True, 4, 2, 128, deterministic)


def _gpu_backward_check(docs, causal, H, Hk, D, deterministic):
    from test_attention_bwd_dsbf16_kernel import _grad_errors, _violations

    got, emu, cu_q, cu_k = _gpu_bwd_run(docs, "fp8_tokenblock_dsbf16", causal, H, Hk, D, 31, deterministic)
    dq_err = _grad_errors((got[0], got[0], got[0]), (emu[0], emu[0], emu[0]), cu_q.cpu())
    kv_err = _grad_errors(got, emu, cu_k.cpu())
    err = {**{k: v for k, v in kv_err.items() if not k.startswith("dq")},
           **{k: v for k, v in dq_err.items() if k.startswith("dq")}}
    assert not _violations(err), err
    for g in got[1:]:
        assert not torch.isnan(g.float()).any()


@pytest.mark.gpu
@needs_dsl
def test_gpu_cross_backward_on_self_attention_is_the_default_build():
    """cu_seqlens_k == cu_seqlens_q: the cross-length build's tiles and dO^T columns are self-attention's, so the
    deterministic builds give the same dQ, dK, dV bit for bit."""
    from flamia_cute.sm90.attention_bwd import BwdDsBf16Config, flamia_bwd_dsbf16_sm90_from_saved

    docs = [(n, n) for n in (1, 127, 128, 129, 1000, 0, 300)]
    q, k, v, cu, _, scale = _inputs(docs, 4, 2, 128, 32, device="cuda")
    do = torch.randn_like(q)
    rec = Recipe.from_name("fp8_tokenblock_dsbf16")
    out, lse, _ = emulate_forward(q, k, v, cu, cu, scale, True, rec)
    qq, kq, vq, kt, vt = _quantized(q, k, v, cu, cu, 128)
    base = BwdDsBf16Config(head_dim=128, qhead_per_kvhead=2, diagonal_copy=True, deterministic=True)
    args = (do, out, lse, qq, kq, vq, kt, vt, cu, 1000, scale)
    ref = flamia_bwd_dsbf16_sm90_from_saved(*args, config=base)
    got = flamia_bwd_dsbf16_sm90_from_saved(*args, config=dataclasses.replace(base, cross_length=True),
                                            cu_seqlens_k=cu.clone(), max_seqlen_k=1000)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("causal, doc, cut", [(True, 2, 101), (True, 5, 129), (True, 0, 100), (False, 1, None)])
@pytest.mark.parametrize("deterministic", [True, False])
def test_gpu_cross_api_leakage_with_gradients(causal, doc, cut, deterministic, monkeypatch):
    """Quantization, forward and backward kernels through the API: the future test on O, LSE and dQ before the
    cut, document isolation on every output and gradient. The plan's own builds: with the deterministic dQ
    (key-block turns) the gradients bitwise; with the unordered TMA reduce-adds within 2e-2."""
    from flamia_cute.testing import attention_fn_for

    monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", "1" if deterministic else "0")
    docs = CAUSAL_DOCS if causal else NON_CAUSAL_DOCS
    q, k, v, cu_q, cu_k, scale = _inputs(docs, 4, 2, 128, 33)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(34)).bfloat16()
    api = attention_fn_for("fp8_tokenblock_dsbf16", scale, causal=causal, backend="cute").varlen

    def fn(q_, k_, v_, cq, ck, dout=None):
        res = api(q_.cuda(), k_.cuda(), v_.cuda(), cq.cuda(), ck.cuda(), dout.cuda() if dout is not None else None)
        return {name: t.cpu() for name, t in res.items()}

    rep = check_leakage_varlen(fn, q, k, v, cu_q, cu_k, do, doc=doc, cut=cut, causal=causal,
                               grad_tol=0.0 if deterministic else 2e-2)
    assert rep.ok, str(rep)


@needs_dsl
def test_plans_of_the_separate_keys_modes():
    """Cross-length and non-causal calls plan both kernels' separate-keys builds (self-attention's tuned
    schedule, no short pairs); causal self-attention keeps the default builds."""
    from flamia_cute.plan import make_plan

    args = ("fp8_tokenblock_dsbf16", 128, 4, 2, 64, 6400, 100)  # short documents: self-attention pairs them
    self_plan = make_plan(*args)
    assert not self_plan.separate_keys and self_plan.fwd.short_pairs
    for causal, cross in ((True, True), (False, False), (False, True)):
        plan = make_plan(*args, causal, cross)
        assert plan.separate_keys and plan.fwd.causal == plan.bwd.causal == causal
        assert plan.fwd.cross_length == plan.bwd.cross_length == causal
        assert not plan.fwd.short_pairs and not plan.bwd.short_pairs
        assert plan.qkv == self_plan.qkv  # the same launch settings, split in two over the two documents' sets
    assert make_plan("fp8_tokenblock", *args[1:], True, True).bwd is None  # e4m3 dS: the emulator's backward


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_separate_keys_with_an_empty_side(causal):
    """The host's early returns: no document with keys (O = 0, LSE = -inf, dQ = 0), and no query in any
    document while there are keys (dK = dV = 0, every row written), through the API on the kernels."""
    from flamia_cute.testing import attention_fn_for

    for docs in ([(5, 0), (3, 0)], [(0, 40), (0, 17)]):
        q, k, v, cu_q, cu_k, scale = _inputs(docs, 4, 2, 128, seed=16, device="cuda")
        do = torch.randn_like(q)
        got = attention_fn_for("fp8_tokenblock_dsbf16", scale, causal=causal, backend="cute").varlen(
            q, k, v, cu_q, cu_k, do)
        assert got["out"].shape == q.shape and not got["out"].float().any()
        assert torch.isinf(got["lse"]).all() and (got["lse"] < 0).all()
        assert not got["dq"].float().any()
        for name in ("dk", "dv"):
            assert got[name].shape == k.shape and not got[name].float().any(), name


@pytest.mark.gpu
@needs_dsl
def test_gpu_strided_keys_as_context_parallelism_passes_them():
    """K and V as the two halves of one gathered tensor (flamia_cute.distributed's all-gather): the same
    results as contiguous inputs, bit for bit (dQ up to its fp32 reduce-adds' order)."""
    from flamia_cute import flamia_attn_varlen_func

    q, k, v, cu_q, cu_k, scale = _inputs(CAUSAL_DOCS, 4, 2, 128, seed=18, device="cuda")
    do = torch.randn_like(q)
    lq, lk = int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max())

    def run(q, k, v, leaves):
        out, lse = flamia_attn_varlen_func(q, k, v, cu_q, cu_k, lq, lk, scale, True, backend="cute", return_lse=True)
        return out, lse, torch.autograd.grad(out, leaves, do)

    kv = torch.cat([k, v], dim=-1).requires_grad_()
    qs = q.clone().requires_grad_()
    assert not kv[..., :128].is_contiguous()
    out_s, lse_s, (dq_s, dkv) = run(qs, kv[..., :128], kv[..., 128:], (qs, kv))
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    out_d, lse_d, (dq_d, dk_d, dv_d) = run(qd, kd, vd, (qd, kd, vd))
    assert torch.equal(out_s, out_d) and torch.equal(lse_s, lse_d)
    assert torch.equal(dkv[..., :128], dk_d) and torch.equal(dkv[..., 128:], dv_d)
    assert rel_l2(dq_s, dq_d) < 1e-6
