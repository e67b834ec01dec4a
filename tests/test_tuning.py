"""Tuning: space enumeration and pruning, cache keys, staleness, write-through (CPU)."""

import dataclasses
import json
import warnings

import pytest
import torch

from flamia_cute import tuned, tuning
from flamia_cute.cli import main
from flamia_cute.cute_backend import _dsl_importable
from flamia_cute.tuned import TuningCache, TuningKey, workload_class

KEY = TuningKey("NVIDIA H200", 132, "13.0", "4.8.1", "0.1.0")


def test_workload_classes():
    assert workload_class(16384, 16384, 1) == "long-uniform"
    assert workload_class(1024, 16384, 16) == "mid-uniform"
    assert workload_class(4358, 32768, 23) == "mid-skewed"
    assert workload_class(64, 16384, 256) == "short-uniform"


def test_cache_write_through_and_reload(tmp_path):
    path = tmp_path / "t.json"
    c = TuningCache(KEY, path)
    c.put("fwd", "long-uniform", "d128_g1_tokenblock", {"config": {"kv_stages": 3}, "ms": 1.0, "default_ms": 1.2})
    again = TuningCache(KEY, path)
    assert again.get("fwd", "long-uniform", "d128_g1_tokenblock")["config"] == {"kv_stages": 3}
    assert again.get("fwd", "short-uniform", "d128_g1_tokenblock") is None


@pytest.mark.parametrize("field", ["gpu", "sm_count", "driver", "dsl", "package"])
def test_stale_file_is_ignored_with_a_warning(tmp_path, field):
    path = tmp_path / "t.json"
    TuningCache(KEY, path).put("fwd", "c", "s", {"config": {}, "ms": 1.0, "default_ms": 1.0})
    other = dataclasses.replace(KEY, **{field: 1 if field == "sm_count" else "other"})
    with pytest.warns(UserWarning, match="stale tuning file"):
        c = TuningCache(other, path)
    assert c.get("fwd", "c", "s") is None


def test_same_key_loads_silently(tmp_path):
    path = tmp_path / "t.json"
    TuningCache(KEY, path).put("fwd", "c", "s", {"config": {}, "ms": 1.0, "default_ms": 1.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TuningCache(KEY, path)
    assert json.loads(path.read_text())["key"]["gpu"] == "NVIDIA H200"


def test_dry_run_enumerates_the_space(capsys):
    assert main(["tune", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "keep   kv_stages=2 tile_order=documents short_pairs=False  (default)" in out
    assert "keep   kv_stages=4 tile_order=documents short_pairs=False" in out
    assert "workload 1x16k: class long-uniform" in out


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("diagonal_copy", [False, True])
def test_fwd_space_holds_the_default_and_each_winning_variant_once(head_dim, diagonal_copy):
    """The default first, then one change each: 3 and 4 K/V stages, LPT across documents, short pairs
    toggled; all persistent (the per-tile build is only the many-documents fallback), all within
    shared memory."""
    from flamia_cute.sm90.attention_fwd import FwdConfig, smem_bytes
    from flamia_cute.tuning import SMEM_LIMIT_SM90, fwd_space

    keep, pruned = fwd_space(head_dim, 1, diagonal_copy)
    base = FwdConfig(head_dim=head_dim, diagonal_copy=diagonal_copy)
    assert keep[0] == (base, "default") and not pruned
    assert [c for c, _ in keep[1:]] == [dataclasses.replace(base, kv_stages=3), dataclasses.replace(base, kv_stages=4),
                                        dataclasses.replace(base, tile_order="longest_documents"),
                                        dataclasses.replace(base, short_pairs=True)]
    assert all(c.persistent and smem_bytes(c) <= SMEM_LIMIT_SM90 for c, _ in keep)


def test_tune_rejects_unknown_recipe(capsys):
    assert main(["tune", "--dry-run", "--recipe", "mxfp8"]) == 2


def test_dry_run_lists_the_quant_space_and_skips_an_emulated_backward(capsys):
    # fp8_tokenblock's backward (e4m3 dS) is the emulator's: no backward kernel to tune
    assert main(["tune", "--dry-run", "--recipe", "fp8_tokenblock"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "quant search space (" in out and "shape d128_q16_kv16_tokenblock" in out
    assert "raster=chunks min_ctas_per_sm=0 heads_per_cta=[4, 4, 4]" in out
    assert "bwd" not in out and "has no backward kernel" in captured.err
    assert main(["tune", "--dry-run", "--recipe", "fp8_tokenblock", "--kernels", "bwd"]) == 2


def test_tune_rejects_unknown_kernels(capsys):
    assert main(["tune", "--dry-run", "--kernels", "fwd,attn"]) == 2
    assert "unknown ['attn']" in capsys.readouterr().err
    assert main(["tune", "--dry-run", "--kernels", ""]) == 2


def test_quantize_space_starts_with_the_default_and_prunes_with_reasons():
    from flamia_cute.sm90.quantize import qkv_config

    keep, pruned = tuning.quantize_space(128, 16, 16, 128)
    assert keep[0] == (qkv_config(128, 16, 16, 128), "default")
    assert len(set(c for c, _ in keep)) == len(keep)
    assert all(c.smem_bytes * max(1, c.min_ctas_per_sm) <= tuning.SMEM_PER_SM_SM90 for c, _ in keep)
    assert {c.raster for c, _ in keep} == {"heads", "chunks"}
    assert {c.parts[0].heads_per_cta for c, _ in keep} == {1, 2, 4}
    assert pruned and all("smem" in why for _, why in pruned)
    # GQA with 2 kv heads: 4 heads per CTA do not divide them (QuantizeConfig's own message)
    _, pruned = tuning.quantize_space(128, 8, 2, 128)
    assert any("does not divide num_heads=2" in why for _, why in pruned)
    assert tuning.quantize_space(128, 16, 16, 1)[0][0][0] == qkv_config(128, 16, 16, 1)


def _defaults():
    from flamia_cute.sm90.attention_bwd import BwdDsBf16Config
    from flamia_cute.sm90.attention_fwd import FwdConfig
    from flamia_cute.sm90.quantize import qkv_config

    return {"fwd": FwdConfig(head_dim=128, diagonal_copy=True),
            "bwd_dsbf16": BwdDsBf16Config(head_dim=128, diagonal_copy=True), "quant": qkv_config(128, 16, 16, 128)}


TUNED = {"fwd": {"kv_stages": 3, "tile_order": "longest_documents", "short_pairs": True},
         "bwd_dsbf16": {"vec_stages": 3, "head_window": 1, "short_pairs": True},
         "quant": {"raster": "chunks", "min_ctas_per_sm": 0, "heads_per_cta": [2, 2, 2]}}


@pytest.mark.parametrize("kernel", ["fwd", "bwd_dsbf16", "quant"])
def test_lookup_returns_the_tuned_config_for_its_class_only(tmp_path, monkeypatch, kernel):
    lookup = {"fwd": tuned.tuned_fwd_config, "bwd_dsbf16": tuned.tuned_bwd_dsbf16_config,
              "quant": tuned.tuned_quantize_config}[kernel]
    default = _defaults()[kernel]
    cache = TuningCache(KEY, tmp_path / "t.json")
    shape = "d128_q16_kv16_tokenblock" if kernel == "quant" else "d128_g1_tokenblock"
    assert tuned.kernel_shape(kernel, default) == shape
    cache.put(kernel, "mid-uniform", shape, {"config": TUNED[kernel], "ms": 1.0, "default_ms": 1.2})
    monkeypatch.setattr(tuned, "_loaded", {"cache": TuningCache(KEY, cache.path)})  # reloaded from disk
    got = lookup(default, 1024, 4096, 4)
    assert got != default and type(got) is type(default)
    assert tuned.config_fields(kernel, got) == TUNED[kernel]
    assert lookup(default, 1024, 4096, 4) is got  # memoized: no config built per call
    assert lookup(default, 16384, 16384, 1) is default  # long-uniform: nothing tuned
    # entries of another kernel are not used (the forward and the backward share shape names)
    other = {"fwd": "bwd_dsbf16", "bwd_dsbf16": "fwd", "quant": "fwd"}[kernel]
    other_default = _defaults()[other]
    assert tuned._tuned_config(other, other_default, 1024, 4096, 4) is other_default
    monkeypatch.setenv("FLAMIA_CUTE_NO_TUNING", "1")
    assert lookup(default, 1024, 4096, 4) is default


def test_fwd_record_with_a_removed_field_is_ignored(tmp_path, monkeypatch):
    """A forward record naming a field the config no longer has (a removed variant's) is not used:
    the lookup warns and keeps the default."""
    cache = TuningCache(KEY, tmp_path / "t.json")
    cache.put("fwd", "mid-uniform", "d128_g1_tokenblock", {"config": {"kv_stages": 3, "pin_softmax": False},
                                                           "ms": 1.0, "default_ms": 1.0})
    monkeypatch.setattr(tuned, "_loaded", {"cache": cache})
    default = _defaults()["fwd"]
    with pytest.warns(UserWarning, match="ignoring tuned fwd config"):
        assert tuned.tuned_fwd_config(default, 1024, 4096, 4) is default


def test_lookup_ignores_an_unusable_entry(tmp_path, monkeypatch):
    cache = TuningCache(KEY, tmp_path / "t.json")
    cache.put("bwd_dsbf16", "mid-uniform", "d128_g1_tokenblock", {"config": {"vec_stages": 4}, "ms": 1.0,
                                                                  "default_ms": 1.0})  # not a valid config
    monkeypatch.setattr(tuned, "_loaded", {"cache": cache})
    default = _defaults()["bwd_dsbf16"]
    with pytest.warns(UserWarning, match="ignoring tuned bwd_dsbf16 config"):
        assert tuned.tuned_bwd_dsbf16_config(default, 1024, 4096, 4) is default


@pytest.mark.parametrize("kernel", ["fwd", "bwd_dsbf16", "quant"])
def test_every_kept_config_round_trips_through_the_cache_fields(kernel):
    keep, _ = tuning.search_space(kernel, 128, 16, 16, 128)
    default = keep[0][0]
    for cfg, _ in keep:
        fields = json.loads(json.dumps(tuned.config_fields(kernel, cfg)))
        assert tuned.config_from_fields(kernel, default, fields) == cfg


def _statuses(out: str) -> list:
    """The status column of the tune summary table, row by row."""
    table = out.split("\nkernel ")[1].split("\n\ntuning file")[0].splitlines()[1:]
    return [row.split()[3] for row in table]


def test_tune_loop_keeps_the_best_skips_failures_and_reuses_the_cache(tmp_path, monkeypatch, capsys):
    """The tune command's bookkeeping on the CPU: timings faked, no kernel runs."""

    from flamia_cute import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(TuningKey, "current", classmethod(lambda cls: KEY))
    monkeypatch.setenv("FLAMIA_CUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(bench.Case, "build", lambda self, seed=0: self)
    keeps = {k: [c for c, _ in tuning.search_space(k, 128, 16, 16, 128)[0]] for k in ("fwd", "quant")}

    blocks = []  # the K/V block of each _kernel_calls

    def fake_calls(case, block, kernels):
        blocks.append(block)

        def make(kernel):
            def call(cfg, i):  # "time" = 1 + position; the last config is the fastest, the second fails
                pos = keeps[kernel].index(cfg)
                if pos == 1:
                    raise RuntimeError("does not compile")
                return 0.5 if pos == len(keeps[kernel]) - 1 else 1.0 + pos
            return call
        return {k: (make(k), 1) for k in kernels}

    monkeypatch.setattr(tuning, "_kernel_calls", fake_calls)
    monkeypatch.setattr(bench, "_time_calls", lambda fn, n_sets, device, reps, **kw: fn(0))
    # fp8_tokenblock: its backward is the emulator's, so fwd and quant only (the bf16-dS backward's
    # tune: test_tune_loop_records_the_automatic_window)
    argv = ["tune", "--only", "16x1k,4x4k", "--reps", "1", "--recipe", "fp8_tokenblock"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    entries = json.loads(next((tmp_path / "tuning").glob("*.json")).read_text())["entries"]
    assert sorted(entries) == ["fwd", "quant"]
    for k, shape in (("fwd", "d128_g1_tokenblock"), ("quant", "d128_q16_kv16_tokenblock")):
        rec = entries[k][f"{shape}/mid-uniform"]
        assert rec["config"] == tuned.config_fields(k, keeps[k][-1]) and rec["ms"] == 0.5
        assert rec["default_ms"] == 1.0 and rec["workload"] == "16x1k"
        assert list(rec["failed"]) == [tuning.config_label(k, keeps[k][1])]
        assert len(rec["all"]) == len(keeps[k]) - 1
        assert f"{k:6s} 16x1k" in out and f"{k:6s} 4x4k " in out  # 4x4k: same class, cached
    assert _statuses(out) == ["tuned"] * 2 + ["cached"] * 2 and "2.00x" in out
    assert main(argv + ["--kernels", "fwd"]) == 0
    assert _statuses(capsys.readouterr().out) == ["cached", "cached"]
    assert main(argv + ["--kernels", "fwd", "--force"]) == 0
    assert _statuses(capsys.readouterr().out) == ["tuned", "cached"]
    assert blocks and set(blocks) == {128}
    assert main(["tune", "--only", "16x1k", "--reps", "1", "--kernels", "quant", "--force", "--recipe", "fp8_token"]) == 0
    assert blocks[-1] == 1  # the per-token recipe's launch
    assert main(["tune", "--print"]) == 0
    out = capsys.readouterr().out
    for line in ("fwd d128_g1_tokenblock/mid-uniform:", "quant d128_q16_kv16_tokenblock/mid-uniform: {'raster'"):
        assert line in out


_FRESH = """
import json, torch
from flamia_cute import compile_cache, flamia_attn_varlen_func
from flamia_cute.plan import make_plan
from flamia_cute.sm90.quantize import qkv_config
from flamia_cute.testing import make_inputs
from flamia_cute.tuned import record_fields, tuned_quantize_config
q, k, v, do, cu, scale = make_inputs([1024] * 4, 16, 16, 128, device="cuda")
plan = make_plan("fp8_tokenblock_dsbf16", 128, 16, 16, 1024, 4096, 4)  # the plan the call below runs
cfgs = {"fwd": record_fields("fwd", plan.fwd, 16, 1024), "bwd_dsbf16": record_fields("bwd_dsbf16", plan.bwd, 16, 1024),
        "quant": record_fields("quant", tuned_quantize_config(qkv_config(128, 16, 16, 128), 1024, 4096, 4), 16, 1024)}
q.requires_grad_()
flamia_attn_varlen_func(q, k, v, cu, cu, 1024, 1024).backward(do)
torch.cuda.synchronize()
print(json.dumps({"configs": cfgs, "compiles": compile_cache.STATS.compiles, "disk_hits": compile_cache.STATS.disk_hits}))
"""


@pytest.mark.gpu
@pytest.mark.gpu_full  # a real tune: two minutes
def test_short_real_tune_then_fresh_process_uses_it(tmp_path):
    import os
    import subprocess
    import sys

    wl = {"head_configs": {"h16_d128": {"heads_q": 16, "heads_kv": 16, "head_dim": 128}},
          "workloads": {"4x1k": [1024] * 4}}
    path = tmp_path / "wl.json"
    path.write_text(json.dumps(wl))
    env = dict(os.environ, FLAMIA_CUTE_CACHE_DIR=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-m", "flamia_cute.cli", "tune", "--workloads", str(path), "--reps", "5",
                          "--kernels", "fwd,quant,bwd"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    tuned = json.loads(next((tmp_path / "cache" / "tuning").glob("*.json")).read_text())
    recs = {"fwd": tuned["entries"]["fwd"]["d128_g1_tokenblock/mid-uniform"],
            "bwd_dsbf16": tuned["entries"]["bwd_dsbf16"]["d128_g1_tokenblock/mid-uniform"],
            "quant": tuned["entries"]["quant"]["d128_q16_kv16_tokenblock/mid-uniform"]}
    assert all(r["workload"] == "4x1k" and r["default_ms"] is not None for r in recs.values()), recs
    fresh = subprocess.run([sys.executable, "-c", _FRESH], env=env, capture_output=True, text=True, timeout=600)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    got = json.loads(fresh.stdout.strip().splitlines()[-1])
    assert got["configs"] == {name: r["config"] for name, r in recs.items()}
    assert got["compiles"] == 0 and got["disk_hits"] >= 1, got  # no recompiling, no retiming


def test_bf16_ds_recipe_tunes_its_own_backward(capsys):
    """fp8_tokenblock_dsbf16 (the default) runs the bf16-dS backward kernel: `--kernels bwd` searches
    that kernel's space (BwdDsBf16Config)."""
    for argv in (["tune", "--dry-run"], ["tune", "--dry-run", "--recipe", "fp8_tokenblock_dsbf16"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "fwd search space (" in out and "quant search space (" in out
        assert "bwd_dsbf16 search space (" in out and "qt_stages" not in out
    assert main(["tune", "--dry-run", "--kernels", "bwd"]) == 0
    out = capsys.readouterr().out
    assert "bwd_dsbf16 search space (" in out and "fwd search space" not in out


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bwd_dsbf16_space(head_dim):
    """The default first, then three vector stages, every head window dividing the KV heads, and short
    pairs toggled where the build takes them (d128); each once, each round-trips through its cache
    fields."""
    pytest.importorskip("cutlass")
    from flamia_cute.sm90.attention_bwd import SMEM_LIMIT, BwdDsBf16Config, smem_bytes

    keep, pruned = tuning.bwd_dsbf16_space(head_dim, 2, True, num_kv_heads=8)
    default = BwdDsBf16Config(head_dim=head_dim, qhead_per_kvhead=2, diagonal_copy=True)
    want = [default, dataclasses.replace(default, vec_stages=3)]
    want += [dataclasses.replace(default, head_window=w) for w in (2, 4, 8)]
    want += [dataclasses.replace(default, short_pairs=True)] if head_dim == 128 else []
    assert [c for c, _ in keep] == want and keep[0][1] == "default" and not pruned
    assert all(smem_bytes(c) <= SMEM_LIMIT for c, _ in keep)
    for c, _ in keep:
        assert tuned.config_from_fields("bwd_dsbf16", default, tuned.config_fields("bwd_dsbf16", c)) == c
    assert [c.head_window for c, _ in tuning.bwd_dsbf16_space(head_dim, 2, True, num_kv_heads=6)[0]] == \
        [1, 1, 2] + ([1] if head_dim == 128 else [])


def test_api_backward_config_follows_the_tuned_bwd_dsbf16_entry(tmp_path, monkeypatch):
    """The default recipe's backward reads its tuned entry; the deterministic mode ignores it."""
    pytest.importorskip("cutlass")
    from flamia_cute.plan import make_plan

    cache = TuningCache(KEY, tmp_path / "t.json")
    cache.put("bwd_dsbf16", "mid-uniform", "d128_g1_tokenblock", {"config": TUNED["bwd_dsbf16"], "ms": 1.0,
                                                                  "default_ms": 1.2})
    monkeypatch.setattr(tuned, "_loaded", {"cache": cache})
    monkeypatch.delenv("FLAMIA_CUTE_NO_TUNING", raising=False)
    args = ("fp8_tokenblock_dsbf16", 128, 16, 16, 1024, 4096, 4)  # four 1k documents
    monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", "0")
    cfg = make_plan(*args).bwd
    assert tuned.config_fields("bwd_dsbf16", cfg) == TUNED["bwd_dsbf16"]
    monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", "1")
    cfg = make_plan(*args).bwd
    assert cfg.deterministic and cfg.vec_stages == 2 and not cfg.short_pairs


def test_bwd_dsbf16_records_of_removed_fields_are_ignored(tmp_path, monkeypatch):
    """A bf16-dS record written with fields the config no longer has (q_stages, raster, persistent, ...)
    is not applied: the lookup warns and runs the default."""
    pytest.importorskip("cutlass")
    old = {"q_stages": 2, "vec_stages": 3, "dq_tma_reduce": True, "prefetch_sdp": False, "exp_under_dp": True,
           "raster": "blocks", "q_bf16_source": "tma", "dk_under_dq_store": True, "head_window": 1,
           "phase_prefetch": True, "persistent": False, "early_block_scales": True, "short_pairs": False}
    cache = TuningCache(KEY, tmp_path / "t.json")
    cache.put("bwd_dsbf16", "mid-uniform", "d128_g1_tokenblock", {"config": old, "ms": 1.0, "default_ms": 1.0})
    monkeypatch.setattr(tuned, "_loaded", {"cache": cache})
    monkeypatch.delenv("FLAMIA_CUTE_NO_TUNING", raising=False)
    default = _defaults()["bwd_dsbf16"]
    with pytest.warns(UserWarning, match="ignoring tuned bwd_dsbf16 config"):
        assert tuned.tuned_bwd_dsbf16_config(default, 1024, 4096, 4) is default


def test_workload_space_starts_from_the_untuned_default():
    """The bf16-dS backward's space for one workload starts from the config an untuned call runs (its
    head window by document length), keeps the plain order as a variant, and holds no config twice."""
    keep, _ = tuning.search_space("bwd_dsbf16", 128, 16, 16, 128)
    short = tuning.workload_space("bwd_dsbf16", keep, 16, 1024)
    assert short[0][0].head_window == 16 and short[0][1] == "default"
    assert keep[0][0] in [c for c, _ in short[1:]] and len({c for c, _ in short}) == len(short) == len(keep)
    assert tuning.workload_space("bwd_dsbf16", keep, 16, 16384)[0][0] == keep[0][0]
    assert tuning.workload_space("fwd", keep, 16, 1024) is keep


def test_bwd_dsbf16_auto_window_stays_per_call(tmp_path, monkeypatch):
    """A bf16-dS record whose head window is the one its tuned workload's length picks stores it as
    "auto", and each call of the class then gets its own length's window (16x1k: 16, 4x4k: 4; one
    class, mid-uniform: a stored 16 slowed 4x4k's backward); any other window is kept."""
    pytest.importorskip("cutlass")
    from flamia_cute.sm90.attention_bwd import BwdDsBf16Config

    keep, _ = tuning.search_space("bwd_dsbf16", 128, 16, 16, 128)
    space = tuning.workload_space("bwd_dsbf16", keep, 16, 1024)
    auto_cfg = space[0][0]
    assert auto_cfg.head_window == 16
    rec = tuned.record_fields("bwd_dsbf16", auto_cfg, 16, 1024)
    assert rec["head_window"] == tuned.AUTO_WINDOW
    plain = next(c for c, _ in space if c.head_window == 1)
    assert tuned.record_fields("bwd_dsbf16", plain, 16, 1024)["head_window"] == 1
    assert tuned.record_fields("fwd", _defaults()["fwd"], 16, 1024) == tuned.config_fields("fwd", _defaults()["fwd"])
    rec = dict(rec, vec_stages=3)  # a tuned field besides the window: the record is applied, not ignored
    cache = TuningCache(KEY, tmp_path / "t.json")
    cache.put("bwd_dsbf16", "mid-uniform", "d128_g1_tokenblock", {"config": rec, "ms": 1.0, "default_ms": 1.0})
    monkeypatch.setattr(tuned, "_loaded", {"cache": TuningCache(KEY, cache.path)})
    monkeypatch.delenv("FLAMIA_CUTE_NO_TUNING", raising=False)
    for max_seqlen, docs, window in ((1024, 16, 16), (4096, 4, 4)):
        default = BwdDsBf16Config(head_dim=128, diagonal_copy=True, head_window=window)
        assert tuned.workload_class(max_seqlen, 16384, docs) == "mid-uniform"
        got = tuned.tuned_bwd_dsbf16_config(default, max_seqlen, 16384, docs)
        assert (got.head_window, got.vec_stages) == (window, 3)
    fixed = dict(rec, head_window=2)
    assert tuned.config_from_fields("bwd_dsbf16", auto_cfg, fixed).head_window == 2


def test_tune_loop_records_the_automatic_window(tmp_path, monkeypatch, capsys):
    """The tune command (timings faked) stores the bf16-dS backward's winning automatic window as "auto"."""
    pytest.importorskip("cutlass")

    from flamia_cute import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(TuningKey, "current", classmethod(lambda cls: KEY))
    monkeypatch.setenv("FLAMIA_CUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(bench.Case, "build", lambda self, seed=0: self)
    # the untuned default (the automatic window) is the fastest
    monkeypatch.setattr(tuning, "_kernel_calls", lambda case, block, kernels: {
        k: ((lambda cfg, i: 1.0 if cfg.head_window == 16 else 2.0), 1) for k in kernels})
    monkeypatch.setattr(bench, "_time_calls", lambda fn, n_sets, device, reps, **kw: fn(0))
    assert main(["tune", "--only", "16x1k", "--reps", "1", "--kernels", "bwd"]) == 0
    entries = json.loads(next((tmp_path / "tuning").glob("*.json")).read_text())["entries"]
    assert entries["bwd_dsbf16"]["d128_g1_tokenblock/mid-uniform"]["config"]["head_window"] == tuned.AUTO_WINDOW
    assert "head_window=auto" in capsys.readouterr().out


@pytest.mark.skipif(not _dsl_importable(), reason="needs the CuTe DSL")
def test_tuning_key_names_the_dsl_compilers_cuda_version(monkeypatch):
    """Records tuned under the DSL's CUDA 13 compiler are not read under its CUDA 12 one (other SASS)."""
    import types

    from flamia_cute import compile_cache

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(name="NVIDIA H200", multi_processor_count=132))
    key = TuningKey.current()
    assert key.dsl == f"{compile_cache.dsl_version()}+cuda{compile_cache.dsl_cuda_version()}"
    monkeypatch.setattr(compile_cache, "dsl_cuda_version", lambda: "99.0")
    assert TuningKey.current() != key
