"""FP8 attention backward kernel (sm_90a): compile checks on CPU, emulator agreement on an sm_90 GPU.

CPU: real sm_90a cubins from fake pointers (QGMMA for all four products, TMA, fp32 atomics for
dQ); a pure-torch model of the kernel's per-CTA math (same tile schedule, TMA tile origins, zero
fill, vectors of the scale warp, masks, P fold with the suffix-max r, per-key and per-query pow2
dS scales, dS byte addresses in the swizzled tile) checked against `emulate_backward`.
GPU (marker `gpu`): the kernel against `emulate_backward` from the same quantized operands,
poisoned outputs, GQA, unaligned document starts, and the leakage checks on dQ.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from flamia_cute.emulator import EmulatorContext, emulate_backward, emulate_forward, operand_from_quantized
from flamia_cute.quant import (
    E4M3,
    cast_to,
    dt_cu_seqlens,
    natural_dt,
    pow2_scale,
    quantize_attention_operands,
    quantize_thd,
)
from flamia_cute.recipes import FOLD_REF_MIN, Recipe
from flamia_cute.testing import check_leakage, fp8_mma_truncated, make_inputs, rel_l2

try:
    import cutlass  # noqa: F401

    from flamia_cute.attention_bwd_sm90 import (
        DS_LAYOUT,
        BwdConfig,
        ds_byte_base,
        ds_byte_offset,
        flamia_bwd_sm90_from_saved,
        kernel_artifacts,
        smem_bytes,
        tile_schedule,
    )

    HAVE_DSL = True
except Exception:  # pragma: no cover
    HAVE_DSL = False

needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl not importable")

RECIPES = {"fp8_token": 1, "fp8_tokenblock": 128}

# GPU tolerances (relative L2 of dQ, dK, dV against emulate_backward on the same quantized
# operands). The kernel reproduces the emulator's quantized values exactly up to fp32 order; the
# differences come from Hopper's fp8 wgmma accumulation (~14 significant bits per k32 chain,
# promoted to fp32 once per 128-wide tile, see test_attention_fwd_kernel) in S^T and dP^T, which
# then flips e4m3 roundings of P (dV operand) and dS (dK, dQ operands): each flip is a one-ulp
# (6-12 %) change of one element. test_error_model_within_tolerances runs the CPU model with a
# pessimistic 13-bit accumulation: it reproduces the order of magnitude (recorded there) and the
# bounds below leave >= 2x margin over it. Index, mask or scale bugs give errors of order 1e-1..1
# (test_error_checks_catch_bugs).
# CPU model, D=64, lengths [1,127,128,129,300,0,33], 13-bit accumulation: rel_l2 dQ 4.1e-3,
# dK 4.5e-3, dV 4.9e-3; worst document 5.8e-3 / 6.1e-3 / 6.4e-3 (both recipes). Exact-arithmetic
# model: 1.3e-5 / 3.1e-5 / 1.7e-5.
GRAD_REL_L2_TOL = {"dq": 1.5e-2, "dk": 1.5e-2, "dv": 1.5e-2}


# ----------------------------------------------------------------------------------------------
# CPU: config, layout facts
# ----------------------------------------------------------------------------------------------


@needs_dsl
@pytest.mark.parametrize("field, value", [("head_dim", 96), ("qhead_per_kvhead", 0), ("q_stages", 3), ("vec_stages", 0),
                                          ("raster", "rows")])
def test_config_rejects(field, value):
    with pytest.raises(ValueError, match=f"BwdConfig.{field}"):
        BwdConfig(**{"head_dim": 128, field: value})


@needs_dsl
def test_config_smem_fits():
    assert smem_bytes(BwdConfig(head_dim=128)) <= 232448
    assert smem_bytes(BwdConfig(head_dim=64)) <= 232448
    with pytest.raises(ValueError, match="shared memory"):
        BwdConfig(head_dim=128, q_stages=2, qt_stages=2)


@needs_dsl
def test_backward_outputs_and_grid_checks():
    """Both backward entries allocate and check through these: a zeroed fp32 dQ accumulator, dK/dV
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
def test_ds_byte_addresses_match_swizzled_layout():
    """The hand-written dS addresses equal Swizzle<3,4,3> o ((8,8),(128,1),(1,2)):((128,1024),(1,0),(0,8192))."""
    assert DS_LAYOUT.startswith("S<3,4,3>")
    seen = set()
    for q in range(128):
        for key in range(128):
            lin = (q // 64) * 8192 + (q % 64) * 128 + key
            swz = lin ^ (((lin >> 7) & 7) << 4)
            w, qlo = q // 8, q % 8
            assert ds_byte_base(qlo, key) + ds_byte_offset(w) == swz
            seen.add(swz)
    assert len(seen) == 128 * 128


@needs_dsl
def test_tile_schedule_covers_each_tile_once():
    for n_q in range(1, 6):
        for n in range(n_q):
            for group in (1, 2, 4):
                per = n_q - n - 1
                tiles = [tile_schedule(i, n, group, per) for i in range(group * (per + 1))]
                assert sorted((h, m) for h, m, _ in tiles) == [(h, m) for h in range(group) for m in range(n, n_q)]
                assert all(d == (m == n) for _, m, d in tiles)
                assert all(d for _, _, d in tiles[:group])


# ----------------------------------------------------------------------------------------------
# CPU: sm_90a compile, PTX and SASS evidence
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def artifacts():
    cache = {}

    def get(d, dc, g=1):
        if (d, dc, g) not in cache:
            cache[(d, dc, g)] = kernel_artifacts(BwdConfig(head_dim=d, diagonal_copy=dc, qhead_per_kvhead=g), "sm_90a")
        return cache[(d, dc, g)]

    return get


@needs_dsl
@pytest.mark.parametrize("head_dim, diagonal_copy", [(64, False), (64, True), (128, False), (128, True)])
def test_compiles_with_fp8_wgmma(artifacts, head_dim, diagonal_copy):
    art = artifacts(head_dim, diagonal_copy)
    ptx = art.ptx
    sd = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3", ptx)
    kvq = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{head_dim}k32\.f32\.e4m3\.e4m3", ptx)
    # two copies of the tile step (diagonal, off-diagonal): S^T and dP^T (D/32 k-steps each),
    # dV, dK and dQ (4 k-steps each)
    n_expected = 2 * (2 * head_dim // 32 + 12)
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == n_expected
    if head_dim == 128:
        assert len(sd) == n_expected
    else:
        assert len(sd) == 2 * 2 * head_dim // 32 and len(kvq) == 2 * 12
    assert "cp.async.bulk.tensor" in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "red.global.add.v2.f32" in ptx, "dQ accumulates with fp32 vector atomics"
    assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx
    assert not re.search(r"\b(ld|st)\.local\b", ptx)
    if art.registers is not None:
        assert art.registers * 384 <= 65536
    if art.sass is not None:
        assert len(re.findall(r"\bQGMMA\b", art.sass)) == n_expected
        assert "UTMALDG" in art.sass
        assert re.search(r"\bRED\.E\.ADD\.F32", art.sass) or re.search(r"\bRED\S*F32", art.sass)
        if head_dim == 64:
            assert not re.search(r"\b(STL|LDL)\b", art.sass), "register spills in SASS"
            assert art.frame_bytes in (None, 0)


@needs_dsl
@pytest.mark.parametrize("head_dim, group", [(128, 1), (64, 2)])
def test_deterministic_variant_orders_dq_with_acquire_release(artifacts, head_dim, group):
    """deterministic=True: each dQ tile waits (ld.acquire) for its key block's turn, fences, and
    passes the turn on (red.release); the default build has none of it (its SASS is unchanged)."""
    det = kernel_artifacts(BwdConfig(head_dim=head_dim, diagonal_copy=True, qhead_per_kvhead=group,
                                     deterministic=True), "sm_90a")
    plain = artifacts(head_dim, True, group)
    marks = (r"ld\.acquire\.gpu\.global\.u32", r"red\.release\.gpu\.global\.add\.u32", r"fence\.acq_rel\.gpu",
             r"nanosleep", r"bar\.sync\s+3, 256")
    for m in marks:
        # both tile-step copies (diagonal, off-diagonal) carry the protocol
        assert len(re.findall(m, det.ptx)) >= 2, m
        assert not re.search(m, plain.ptx), m
    # the same products and atomics otherwise
    count = lambda p, t: len(re.findall(p, t))  # noqa: E731
    for p in (r"wgmma\.mma_async", r"red\.global\.add\.v2\.f32", r"cvt\.rn\.satfinite\.e4m3x2\.f32"):
        assert count(p, det.ptx) == count(p, plain.ptx), p
    if det.registers is not None:
        assert det.registers * 384 <= 65536
    with pytest.raises(ValueError, match="BwdConfig.deterministic"):
        BwdConfig(head_dim=128, deterministic=1)


def test_deterministic_backward_switch(monkeypatch):
    """torch.use_deterministic_algorithms(True) or FLAMIA_CUTE_DETERMINISTIC=1 selects the ordered dQ."""
    from flamia_cute.cute_backend import deterministic_backward

    monkeypatch.delenv("FLAMIA_CUTE_DETERMINISTIC", raising=False)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        assert not deterministic_backward()
        torch.use_deterministic_algorithms(True)
        assert deterministic_backward()
        torch.use_deterministic_algorithms(False)
        monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", "1")
        assert deterministic_backward()
        monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", "yes")
        with pytest.raises(ValueError, match="FLAMIA_CUTE_DETERMINISTIC"):
            deterministic_backward()
    finally:
        torch.use_deterministic_algorithms(was)


_D128_PER_TOKEN_SPILLS = pytest.mark.xfail(
    reason="d128 per-token build (fp8_token): S^T, dP^T and dV (64 + 64 + 64 fp32) plus operands exceed 240 "
           "registers; 40 bytes of stack and 10 spill instructions per thread remain (was ~200 bytes); the "
           "token-block build (the default recipe) has none since dS is scaled by sk in place; next: split the "
           "query tile in N=64 halves",
    strict=True)


@needs_dsl
@pytest.mark.parametrize("diagonal_copy", [pytest.param(False, marks=_D128_PER_TOKEN_SPILLS), True])
def test_d128_no_spills(artifacts, diagonal_copy):
    art = artifacts(128, diagonal_copy)
    assert art.frame_bytes in (None, 0)
    if art.sass is not None:
        assert not re.search(r"\b(STL|LDL)\b", art.sass)


@needs_dsl
@pytest.mark.parametrize("head_dim, group", [(128, 1), (64, 2)])
def test_blocks_cta_order_builds_without_spills(head_dim, group):
    """BwdConfig.raster="blocks" (the bf16-dS kernel's default order): no spills; the CTA index is read
    in the other order (the key block from ctaid.x), everything else the same."""
    heads = kernel_artifacts(BwdConfig(head_dim=head_dim, diagonal_copy=True, qhead_per_kvhead=group), "sm_90a")
    blocks = kernel_artifacts(BwdConfig(head_dim=head_dim, diagonal_copy=True, qhead_per_kvhead=group,
                                        raster="blocks"), "sm_90a")
    assert blocks.frame_bytes in (None, 0) and blocks.ptx != heads.ptx
    if blocks.sass is not None:
        assert not re.search(r"\b(STL|LDL)\b", blocks.sass)
    wgmma = lambda ptx: sorted(re.findall(r"wgmma\.mma_async\S*", ptx))  # noqa: E731
    assert wgmma(blocks.ptx) == wgmma(heads.ptx)


# ----------------------------------------------------------------------------------------------
# CPU: a model of the kernel's per-CTA math against the emulator
# ----------------------------------------------------------------------------------------------


def _rows(codes, start, n, T):
    """n token rows from `start` (TMA box): zero fill past T."""
    out = torch.zeros(n, codes.shape[-1])
    idx = torch.arange(start, start + n)
    ok = idx < T
    out[ok] = codes[idx[ok]].float()
    return out


def _cols(codes_dt, start, n):
    """(D, n) columns of a [d, t] copy from `start`: zero fill past T_dt."""
    x = codes_dt[:, start : start + n].float()
    return torch.nn.functional.pad(x, (0, n - x.shape[1]))


def _kernel_model(qq, kq, vq, kt, vt, doq, out, lse, dout, cu, scale, group, diag_copy, acc_bits=None, bug=None):
    """What every CTA (key block n, kv head, doc) computes, in the kernel's formulas and order.

    bug: inject a plausible bug: "mask_off_by_one", "sv_is_sk" (the dP row factor from the K
    scales), "dq_scale_dropped" (dQ without its per-query dS scale), "no_fold_ref_min" (the dV
    fold's 256 / r with r = 2^-126 from all-zero dO rows: inf, as the kernel had it).
    """
    T, H, D = qq.data_td.shape
    Hk = kq.data_td.shape[1]
    dq = torch.zeros(T, H, D)
    dk = torch.full((T, Hk, D), float("nan"))
    dv = torch.full((T, Hk, D), float("nan"))
    delta = (dout.float() * out.float()).sum(-1).t()
    c = cu.tolist()
    dtc = dt_cu_seqlens(cu).tolist()
    # Q^T and dO^T come in P-fragment order, matched by the kernel's packing of P^T and dS^T: the
    # products are the natural-order ones
    qdt, dodt = natural_dt(qq), natural_dt(doq)
    mm = (lambda x, y: x @ y) if acc_bits is None else (lambda x, y: fp8_mma_truncated(x, y, acc_bits))
    log2e = math.log2(math.e)
    ar = torch.arange(128)
    for doc in range(len(c) - 1):
        ds0, L, dts = c[doc], c[doc + 1] - c[doc], dtc[doc]
        n_q = (L + 127) // 128
        for kh in range(Hk):
            for n in range(n_q):
                per = n_q - n - 1
                lim = L - 128 * n
                kvalid = (128 * n + ar) < L
                keys = (ds0 + 128 * n + ar).clamp(max=T - 1)
                dV = torch.zeros(128, D)
                dK = torch.zeros(128, D)
                for i in range(group * (per + 1)):
                    hi, m, diag = tile_schedule(i, n, group, per)
                    h = kh * group + hi
                    use_tok = diag and diag_copy
                    ko, vo = (kt, vt) if use_tok else (kq, vq)
                    Kc = _rows(ko.data_td[:, kh], ds0 + 128 * n, 128, T)
                    Vc = _rows(vo.data_td[:, kh], ds0 + 128 * n, 128, T)
                    Ktc = _cols(ko.data_dt[kh], dts + 128 * n, 128)  # (D, 128 keys)
                    sk = torch.where(kvalid, ko.scale[kh, keys], 0.0)
                    sv = torch.where(kvalid, (ko if bug == "sv_is_sk" else vo).scale[kh, keys], 0.0)
                    qvalid = (128 * m + ar) < L
                    qs = (ds0 + 128 * m + ar).clamp(max=T - 1)
                    Qc = _rows(qq.data_td[:, h], ds0 + 128 * m, 128, T)
                    dOc = _rows(doq.data_td[:, h], ds0 + 128 * m, 128, T)
                    Qtc = _cols(qdt[h], dts + 128 * m, 128)
                    dOtc = _cols(dodt[h], dts + 128 * m, 128)
                    # the scale warp's vectors
                    A = torch.where(qvalid, qq.scale[h, qs] * (scale * log2e), 0.0)
                    B = torch.where(qvalid, lse[h, qs] * log2e, math.inf)
                    Dr = torch.where(qvalid, delta[h, qs], 0.0)
                    W = torch.where(qvalid, doq.scale[h, qs], 0.0)
                    Qs = torch.where(qvalid, qq.scale[h, qs], 0.0)
                    R = torch.flip(torch.cummax(torch.flip(W, [0]), 0).values, [0])  # suffix max
                    S = mm(Kc, Qc.t())
                    dP = mm(Vc, dOc.t())
                    p = torch.exp2(S * sk[:, None] * A[None, :] - B[None, :])
                    if diag:
                        shift = 1 if bug == "mask_off_by_one" else 0
                        mask = (ar[None, :] + shift < ar[:, None]) | (ar[:, None] >= lim)
                        p = p.masked_fill(mask, 0.0)
                    dS = p * (dP * sv[:, None] * W[None, :] - Dr[None, :])
                    r = R[ar] if diag else R[0].expand(128)
                    r = torch.where(r == 0, 1.0, r)
                    if bug != "no_fold_ref_min":
                        r = r.clamp_min(FOLD_REF_MIN)
                    fold = W[None, :] * (256.0 / r)[:, None]
                    if diag:  # a masked query's fold may overflow (its scale above r): zeroed
                        fold = fold.masked_fill(ar[None, :] < ar[:, None], 0.0)
                    P8 = cast_to(p * fold, E4M3)
                    dV += mm(P8, dOtc.t()) * (r / 256.0)[:, None]
                    amax_k = (dS * Qs[None, :]).abs().amax(1)
                    s_k = pow2_scale(amax_k, E4M3)
                    dK += mm(cast_to(dS * Qs[None, :] / s_k[:, None], E4M3), Qtc.t()) * s_k[:, None]
                    amax_q = (dS * sk[:, None]).abs().amax(0)
                    s_q = pow2_scale(amax_q, E4M3)
                    dS8 = cast_to(dS * sk[:, None] / s_q[None, :], E4M3)  # (keys, queries)
                    if bug == "dq_scale_dropped":
                        s_q = torch.ones_like(s_q)
                    dq_t = mm(dS8.t(), Ktc.t()) * (s_q * scale)[:, None]
                    rows = ds0 + 128 * m + ar
                    dq[rows[qvalid], h] += dq_t[qvalid]
                rows = ds0 + 128 * n + ar
                dv[rows[kvalid], kh] = dV[kvalid]
                dk[rows[kvalid], kh] = (dK * scale)[kvalid]
    return dq.to(torch.bfloat16), dk.to(torch.bfloat16), dv.to(torch.bfloat16)


def _setup(lengths, H, Hk, D, recipe, seed, device="cpu", zero_do_rows=False):
    """recipe: a name or a Recipe (its K block size picks the layouts). zero_do_rows: dO is 0 on the
    last token of every document and on a whole 128-query tile of the
    longest, as in training where a token's target is ignored (dO scale 2^-126)."""
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


def _model(st, acc_bits=None, bug=None):
    doq = quantize_thd(st["do"], st["cu"], 1, pv_order=True)  # as the backward's preprocess
    kt = st["kt"] or st["kq"]
    vt = st["vt"] or st["vq"]
    group = st["q"].shape[1] // st["k"].shape[1]
    return _kernel_model(st["qq"], st["kq"], st["vq"], kt, vt, doq, st["out"], st["lse"], st["do"], st["cu"],
                         st["scale"], group, st["block"] > 1, acc_bits=acc_bits, bug=bug)


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


MODEL_CASES = [([1, 127, 128, 129, 300, 0, 33], 2, 1, 64), ([257, 5, 130], 4, 2, 64), ([8, 300, 4, 131, 1, 16], 2, 2, 64)]


@needs_dsl
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("lengths, H, Hk, D", MODEL_CASES)
def test_kernel_model_matches_emulator(recipe, lengths, H, Hk, D):
    st = _setup(lengths, H, Hk, D, recipe, seed=3)
    res = _model(st)
    err = _grad_errors(res, st["emu"], st["cu"])
    # fp32 order and exp2-vs-exp only (measured 1e-5..7e-5): at most a handful of e4m3 flips
    for name in ("dq", "dk", "dv"):
        assert err[name + "_nan"] == 0, (name, err)
        assert err[name] < 3e-4 and err[name + "_doc"] < 6e-4, (name, err)


@needs_dsl
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_kernel_model_with_zero_dout_rows(recipe):
    """All-zero dO rows (ignored targets in training) give the dO scale 2^-126: the dV fold must stay
    finite (the kernel's 256 / r overflowed to inf and training's first backward was NaN); without
    FOLD_REF_MIN the model shows the failure."""
    st = _setup([300, 1, 129, 40], 2, 2, 64, recipe, seed=5, zero_do_rows=True)
    err = _grad_errors(_model(st), st["emu"], st["cu"])
    for name in ("dq", "dk", "dv"):
        assert err[name + "_nan"] == 0 and torch.isfinite(st["emu"][("dq", "dk", "dv").index(name)]).all(), err
        assert err[name] < 3e-4 and err[name + "_doc"] < 6e-4, (name, err)
    assert _violations(_grad_errors(_model(st, bug="no_fold_ref_min"), st["emu"], st["cu"]))


@needs_dsl
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_error_model_within_tolerances(recipe):
    """Pessimistic 13-bit tensor-core accumulation: within half the GPU bounds."""
    st = _setup([1, 127, 128, 129, 300, 0, 33], 2, 2, 64, recipe, seed=1)
    err = _grad_errors(_model(st, acc_bits=13), st["emu"], st["cu"])
    assert not _violations(err, 0.5), err


@needs_dsl
@pytest.mark.parametrize("bug", ["mask_off_by_one", "sv_is_sk", "dq_scale_dropped"])
def test_error_checks_catch_bugs(bug):
    st = _setup([1, 127, 128, 129, 300, 0, 33], 2, 2, 64, "fp8_token", seed=1)
    err = _grad_errors(_model(st, bug=bug), st["emu"], st["cu"])
    assert _violations(err), f"{bug} passes the checks: {err}"


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------

LENGTHS = [1, 127, 128, 129, 1000, 0, 33]


def _needs_sm90():
    return pytest.mark.skipif(
        not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)), reason="needs an sm_90 GPU"
    )


def _run_kernel(st, poison=False, **kw):
    cu = st["cu"]
    lens = (cu[1:] - cu[:-1]).tolist()
    return flamia_bwd_sm90_from_saved(
        st["do"], st["out"], st["lse"], st["qq"], st["kq"], st["vq"], st["kt"], st["vt"], cu,
        max(lens) if lens else 0, st["scale"], poison_outputs=poison, **kw,
    )


def _check_gpu(lengths, recipe, D, H, Hk, seed):
    st = _setup(lengths, H, Hk, D, recipe, seed, device="cuda")
    res = _run_kernel(st, poison=True)
    torch.cuda.synchronize()
    err = _grad_errors(res, st["emu"], st["cu"].cpu())
    assert not _violations(err), err


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("D, H, Hk", [(128, 2, 2), (64, 4, 2), (128, 4, 1)])
def test_gpu_matches_emulator(recipe, D, H, Hk):
    _check_gpu(LENGTHS, recipe, D, H, Hk, seed=1)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("D, H, Hk", [(128, 4, 2), (64, 2, 2)])
def test_gpu_blocks_cta_order_matches_emulator(D, H, Hk):
    """The key-block-fastest CTA order (BwdConfig.raster, not the default of this kernel yet): the
    same gradients as the emulator on a mix with a long document."""
    st = _setup(LENGTHS + [3000], H, Hk, D, "fp8_tokenblock", 7, device="cuda")
    cfg = BwdConfig(head_dim=D, qhead_per_kvhead=H // Hk, diagonal_copy=True, raster="blocks")
    res = _run_kernel(st, poison=True, config=cfg)
    torch.cuda.synchronize()
    err = _grad_errors(res, st["emu"], st["cu"].cpu())
    assert not _violations(err), err


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_gpu_zero_dout_rows(recipe):
    """Training's dO: zero rows where targets are ignored (see test_kernel_model_with_zero_dout_rows)."""
    st = _setup(LENGTHS, 2, 2, 128, recipe, seed=5, device="cuda", zero_do_rows=True)
    res = _run_kernel(st, poison=True)
    torch.cuda.synchronize()
    err = _grad_errors(res, st["emu"], st["cu"].cpu())
    assert not _violations(err), err


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("lengths", [[8, 300], [3, 5, 7, 200, 129], [300, 300]])
def test_gpu_unaligned_document_starts(recipe, lengths):
    _check_gpu(lengths, recipe, 128, 2, 2, seed=4)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_gpu_leakage(recipe):
    """Quantize + forward kernel + this backward; dQ before the cut within the atomics' run-to-run spread."""
    from flamia_cute.attention_fwd_sm90 import FwdConfig, flamia_fwd_sm90

    block = RECIPES[recipe]
    q, k, v, do, cu, scale = make_inputs([300, 700, 129, 1], heads_q=4, heads_kv=2, head_dim=128, seed=7)

    def fn(q_, k_, v_, cu_, dout=None):
        q_, k_, v_, cu_ = q_.cuda(), k_.cuda(), v_.cuda(), cu_.cuda()
        qq, (kq, kt), (vq, vt) = quantize_attention_operands(q_, k_, v_, cu_, block)
        maxlen = int((cu_[1:] - cu_[:-1]).max())
        cfg = FwdConfig(head_dim=128, qhead_per_kvhead=2, diagonal_copy=block > 1)
        out, lse = flamia_fwd_sm90(
            qq.data_td, qq.scale, kq.data_td, kq.scale, vq.data_dt, vq.scale,
            kt.data_td if kt else None, kt.scale if kt else None, vt.data_dt if vt else None,
            vt.scale if vt else None, cu_, maxlen, scale, cfg, dt_cu_seqlens=dt_cu_seqlens(cu_),
        )
        res = {"out": out.cpu(), "lse": lse.cpu()}
        if dout is not None:
            dq, dk, dv = flamia_bwd_sm90_from_saved(dout.cuda(), out, lse, qq, kq, vq, kt, vt, cu_, maxlen, scale)
            res.update(dq=dq.cpu(), dk=dk.cpu(), dv=dv.cpu())
        return res

    # dQ uses fp32 atomics: allow the run-to-run spread (bf16 output: a couple of ulps); dK and dV
    # are deterministic but share the tolerance of check_leakage's grad comparison
    rep = check_leakage(fn, q, k, v, cu, dout=do, grad_tol=2e-2)
    assert rep.ok, str(rep)
    rep = check_leakage(fn, q, k, v, cu, dout=do, doc=1, cut=201, grad_tol=2e-2)
    assert rep.ok, str(rep)


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
def test_gpu_dk_dv_deterministic():
    st = _setup([700, 129], 4, 2, 128, "fp8_tokenblock", seed=2, device="cuda")
    a = _run_kernel(st)
    b = _run_kernel(st)
    assert torch.equal(a[1].view(torch.int16), b[1].view(torch.int16))
    assert torch.equal(a[2].view(torch.int16), b[2].view(torch.int16))


@pytest.mark.gpu
@needs_dsl
@_needs_sm90()
@pytest.mark.parametrize("group", [1, 2])
def test_gpu_deterministic_dq_is_bit_reproducible(group):
    """deterministic=True: dQ, dK, dV bitwise equal across runs (many key blocks add to each query
    block: 1000 tokens = 8 blocks, plus a short document), and still within the emulator bounds."""
    st = _setup([1000, 129, 7], 2 * group, 2, 128, "fp8_tokenblock", seed=4, device="cuda")
    cu = st["cu"]
    cfg = BwdConfig(head_dim=128, qhead_per_kvhead=group, diagonal_copy=True, deterministic=True)
    runs = []
    for _ in range(3):
        runs.append(flamia_bwd_sm90_from_saved(st["do"], st["out"], st["lse"], st["qq"], st["kq"], st["vq"],
                                               st["kt"], st["vt"], cu, 1000, st["scale"], config=cfg,
                                               poison_outputs=True))
        torch.cuda.synchronize()
    for r in runs[1:]:
        for a, b in zip(runs[0], r, strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    err = _grad_errors(runs[0], st["emu"], cu.cpu())
    assert not _violations(err), err
