"""CPU checks of the GPU scripts' logic: perf/sanitize_driver.py, perf/kernel_warmup.py, perf/fuzz_gpu.py,
perf/soak.py (their GPU runs are the lead's), and compile_cache.kernel_builds, which the soak counts with."""

from __future__ import annotations

import math
import pathlib
import random
import re
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "perf"))

import fuzz_gpu  # noqa: E402
import kernel_warmup  # noqa: E402
import sanitize_driver  # noqa: E402
import soak  # noqa: E402

from flamia_cute import compile_cache  # noqa: E402
from flamia_cute.plan import KERNEL_SCALINGS, make_plan  # noqa: E402
from flamia_cute.sm90.quantize import dout_delta_config  # noqa: E402
from flamia_cute.testing import cu_seqlens_from_lengths  # noqa: E402

# ----------------------------------------------------------------------------- compile_cache.kernel_builds


class _Fn:
    def __init__(self, tag):
        self.tag = tag


def test_kernel_builds_records_compiles_and_disk_loads_once(monkeypatch, tmp_path):
    monkeypatch.setattr(compile_cache, "STATS", compile_cache.CacheStats())
    monkeypatch.setenv("FLAMIA_CUTE_CACHE_DIR", str(tmp_path))
    src = tmp_path / "kernel_src.py"
    src.write_text("# a kernel source\n")
    calls = []

    def build(config, arch):
        calls.append(config)
        return _Fn(config)

    # no disk layer: a compile, then memory hits
    monkeypatch.setenv("FLAMIA_CUTE_DISK_CACHE", "0")
    compile_cache.clear_memory_cache()
    compile_cache.compile_cached([src], ("cfg", 1), "sm_90a", build)
    compile_cache.compile_cached([src], ("cfg", 1), "sm_90a", build)
    builds = compile_cache.kernel_builds()
    assert [(b.config, b.source) for b in builds] == [(("cfg", 1), "compile")] and calls == [("cfg", 1)]
    # the disk layer: a compile exports, a fresh in-memory cache loads it back
    monkeypatch.setenv("FLAMIA_CUTE_DISK_CACHE", "1")
    monkeypatch.setattr(compile_cache, "dsl_default_arch", lambda: "sm_90a")

    def export(fn, tmp, key, tvm_ffi):
        p = pathlib.Path(tmp) / "kernel.o"
        p.write_text(str(fn.tag))
        return p

    monkeypatch.setattr(compile_cache, "_export", export)
    monkeypatch.setattr(compile_cache, "_load", lambda obj, key, tvm_ffi=False: _Fn(obj.read_text()))
    compile_cache.clear_memory_cache()
    compile_cache.compile_cached([src], ("cfg", 2), "sm_90a", build)
    compile_cache.clear_memory_cache()
    compile_cache.compile_cached([src], ("cfg", 2), "sm_90a", build)
    compile_cache.compile_cached([src], ("cfg", 2), "sm_90a", build)
    new = compile_cache.kernel_builds(since=1)
    assert [(b.config, b.source, b.arch, b.variant) for b in new] == [
        (("cfg", 2), "compile", "sm_90a", ""), (("cfg", 2), "disk", "sm_90a", "")]
    assert compile_cache.STATS.compiles == 2 and compile_cache.STATS.disk_hits == 1
    compile_cache.clear_memory_cache()


# ----------------------------------------------------------------------------- the kernels of a call


def test_call_kernels_follow_the_recipe_and_the_call():
    train = kernel_warmup.call_kernels("fp8_tokenblock_dsbf16", 128, 4, 2, [300, 5, 0, 130], True)
    assert sorted(k for k, _ in train) == ["bwd", "codes", "fwd", "quant", "quant"]
    plan = make_plan("fp8_tokenblock_dsbf16", 128, 4, 2, 300, 435, 4)
    assert {("fwd", plan.fwd), ("quant", plan.qkv), ("bwd", plan.bwd)} <= train
    # the dO pass as the backward builds it: D from dO's e4m3 values (the recipe's delta)
    assert ("quant", dout_delta_config(128, 4, 2, rowdot_quantized=True)) in train
    no_grad = kernel_warmup.call_kernels("fp8_tokenblock_dsbf16", 128, 4, 2, [300, 5, 0, 130], False)
    assert sorted(k for k, _ in no_grad) == ["fwd", "quant"]
    # the control is quantized by torch; the e4m3-dS recipes' backward is the emulator's
    assert sorted(k for k, _ in kernel_warmup.call_kernels("fp8_tensor_current", 64, 2, 2, [70], True)) == [
        "bwd", "codes", "fwd"]
    assert sorted(k for k, _ in kernel_warmup.call_kernels("fp8_token", 64, 2, 2, [70], True)) == ["fwd", "quant"]
    # past the persistent tables: the per-tile forward
    (fwd,) = [c for k, c in kernel_warmup.call_kernels("fp8_token", 64, 2, 2, [1] * 1030, False) if k == "fwd"]
    assert not fwd.persistent
    # each kind maps back from its config class (soak.kind_of)
    assert all(soak.kind_of(c) == k for k, c in train | no_grad)


# ----------------------------------------------------------------------------- sanitize_driver


def test_sanitize_cases_cover_every_shipping_kernel_on_odd_packs():
    full, small = sanitize_driver.cases("full"), sanitize_driver.cases("small")
    assert set(sanitize_driver.RECIPES) | {"fp8_tokenblock"} == set(KERNEL_SCALINGS)
    assert {sanitize_driver.HEADS[c.heads][2] for c in full} == {64, 128}
    assert any(h > hk for h, hk, _ in sanitize_driver.HEADS.values())  # GQA
    for n in (1, 2, 63, 65, 127, 129, 255, 257):
        assert sanitize_driver.PACKS[f"len{n}"] == (n,) and n in sanitize_driver.PACKS["edges"]
    # tiny shapes (racecheck and synccheck are slow); the per-tile pack only in the full set
    assert all(sum(sanitize_driver.PACKS[c.pack]) < 1100 and sanitize_driver.HEADS[c.heads][0] <= 4 for c in full)
    assert {c.pack for c in small} == set(sanitize_driver.SMALL_PACKS)
    kernels = sanitize_driver.case_kernels(full)
    fwds = [cfg for k, cfg in kernels if k == "fwd"]
    bwds = [cfg for k, cfg in kernels if k == "bwd"]
    assert {k for k, _ in kernels} == set(kernel_warmup.KINDS)
    assert any(f.short_pairs for f in fwds) and any(not f.persistent for f in fwds)
    assert any(f.diagonal_copy for f in fwds) and any(not f.diagonal_copy for f in fwds)
    assert any(b.short_pairs for b in bwds) and any(b.deterministic for b in bwds)
    assert any(c.deterministic for c in small)
    assert {c.rotary for c in full} == {"", *sanitize_driver.ROTARY} == {c.rotary for c in small}
    # RoPE's own builds (the rotating Q/K/V launch, dQ's inverse rotation) are warmed up with the rest
    plain = sanitize_driver.case_kernels([c for c in full if not c.rotary])
    assert sanitize_driver.case_kernels([c for c in full if c.rotary]) - plain
    # cover first: a run cut short has launched every kernel once it is past that prefix
    prefix = sanitize_driver.cover_first_kernels_prefix(full)
    assert sanitize_driver.case_kernels(prefix) == kernels and len(prefix) < len(full) // 2
    assert full[0].pack == "edges"
    # the separate-keys builds: cross-length causal (queries on and off the keys' 64-row grid, documents
    # without queries) and non-causal
    assert {c.keys for c in full} == {"", *sanitize_driver.KEYS} == {c.keys for c in small}
    assert any(b.cross_length for b in bwds) and any(not b.causal for b in bwds)
    assert any(f.cross_length for f in fwds) and any(not f.causal for f in fwds)
    offs, empty = set(), False
    for c in (c for c in small if c.keys == "cross"):
        q_len, k_len = sanitize_driver.query_lengths(c), sanitize_driver.PACKS[c.pack]
        offs |= {k - q for q, k in zip(q_len, k_len, strict=True) if q > 0}
        empty |= 0 in q_len
    assert any(o % 64 for o in offs) and any(o > 0 and o % 64 == 0 for o in offs) and 0 in offs and empty


def test_sanitize_driver_lists_without_a_gpu(capsys):
    assert sanitize_driver.main(["--list", "--set", "small"]) == 0
    assert f"{len(sanitize_driver.cases('small'))} cases" in capsys.readouterr().out


# ----------------------------------------------------------------------------- fuzz_gpu


def test_fuzz_packs_are_heavy_tailed_and_bounded():
    cfgs = fuzz_gpu.head_configs()
    assert set(cfgs) == {"h16_d128", "gqa32x8_d128", "h32_d64"}
    specs = [fuzz_gpu.pack_spec(7, i, cfgs) for i in range(fuzz_gpu.DEFAULT_PACKS)]
    assert fuzz_gpu.DEFAULT_PACKS >= 300
    lens = [n for s in specs for n in s["lengths"]]
    assert all(0 <= n <= fuzz_gpu.MAX_DOC for n in lens) and max(lens) == fuzz_gpu.MAX_DOC
    assert all(1 <= sum(s["lengths"]) <= fuzz_gpu.MAX_TOKENS and len(s["lengths"]) <= fuzz_gpu.MAX_DOCS + 1
               for s in specs)
    # heavy-tailed: every octave of lengths occurs, short documents dominate in count
    octaves = {int(math.log2(n)) for n in lens if n}
    assert octaves == set(range(15))
    assert sum(n <= 64 for n in lens) > sum(n >= 4096 for n in lens) > 0
    assert 0 in lens  # empty documents
    # every head config both as a training and a no_grad call; the draw is a function of (seed, index)
    assert {(s["heads"], s["train"]) for s in specs[:6]} == {(h, t) for h in cfgs for t in (True, False)}
    assert fuzz_gpu.pack_spec(7, 11, cfgs) == specs[11] and fuzz_gpu.pack_spec(8, 11, cfgs) != specs[11]
    # the run's emulator time (model) fits the budget
    assert sum(fuzz_gpu.estimated_seconds(s, cfgs) for s in specs) < 90


def _results(lengths, H=2, Hk=1, D=16, train=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    out = {"out": torch.randn(T, H, D, generator=g).bfloat16(), "lse": torch.randn(H, T, generator=g)}
    if train:
        out |= {"dq": torch.randn(T, H, D, generator=g), "dk": torch.randn(T, Hk, D, generator=g),
                "dv": torch.randn(T, Hk, D, generator=g)}
    return out


def test_fuzz_doc_errors_match_a_per_document_loop():
    lengths = [5, 0, 40, 1, 17]
    a, b = torch.randn(63, 3, 8, dtype=torch.float64), torch.randn(63, 3, 8, dtype=torch.float64)
    whole, worst, worst_abs = fuzz_gpu.doc_errors(a, b, lengths, min_tokens=2)
    cu = cu_seqlens_from_lengths(lengths).tolist()
    docs = [(s, e) for s, e in zip(cu[:-1], cu[1:], strict=True) if e - s >= 2]
    rel = max(float((a[s:e] - b[s:e]).norm() / b[s:e].norm()) for s, e in docs)
    mabs = max(float((a[s:e] - b[s:e]).abs().max() / b[s:e].abs().max()) for s, e in docs)
    assert whole == pytest.approx(float((a - b).norm() / b.norm()), rel=1e-9)
    assert worst == pytest.approx(rel, rel=1e-9) and worst_abs == pytest.approx(mabs, rel=1e-9)


def test_fuzz_checks_pass_equal_results_and_fail_broken_ones():
    lengths = [200, 1, 0, 64, 900]
    ref = _results(lengths)
    row, bad = fuzz_gpu.compare({k: v.clone() for k, v in ref.items()}, ref, lengths)
    assert not bad and row["o_rel"] == 0 and row["dq_doc_rel"] == 0
    # one document's O off by 3% (an index or scale bug confined to it); the pack's error stays small
    got = {k: v.clone() for k, v in ref.items()}
    got["out"][201:265] = (got["out"][201:265].float() * 1.03).bfloat16()
    assert any(b.startswith("o_doc_rel") for b in fuzz_gpu.compare(got, ref, lengths)[1])
    # dK of one document off; a NaN; LSE rows -inf at the wrong place
    got = {k: v.clone() for k, v in ref.items()}
    got["dk"][201:265] *= 1.04
    assert [b.split()[0] for b in fuzz_gpu.compare(got, ref, lengths)[1]] == ["dk_doc_rel"]
    got = {k: v.clone() for k, v in ref.items()}
    got["dv"][3, 0, 0] = float("nan")
    assert any("non-finite" in b for b in fuzz_gpu.compare(got, ref, lengths)[1])
    got = {k: v.clone() for k, v in ref.items()}
    got["lse"][0, 5] = float("-inf")
    assert any(b.startswith("lse_abs") for b in fuzz_gpu.compare(got, ref, lengths)[1])
    ref_inf = {**ref, "lse": ref["lse"].clone()}
    ref_inf["lse"][1, 7] = float("-inf")  # a row the emulator finds empty and the kernel not
    assert [b.split(":")[0] for b in fuzz_gpu.compare(ref, ref_inf, lengths)[1]] == ["lse"]
    # no_grad results carry no gradients
    ref = _results(lengths, train=False)
    assert not fuzz_gpu.compare({k: v.clone() for k, v in ref.items()}, ref, lengths)[1]


def test_fuzz_emulator_chunks_whole_kv_groups():
    assert fuzz_gpu.emulator_heads_per_chunk(32, 8, 16384, True, 80e9) == 4
    assert fuzz_gpu.emulator_heads_per_chunk(16, 16, 16384, True, 80e9) == 6
    assert fuzz_gpu.emulator_heads_per_chunk(32, 8, 1024, True, 80e9) == 32
    assert fuzz_gpu.emulator_heads_per_chunk(32, 8, 16384, True, 1.0) == 4  # at least one group


def test_fuzz_chunked_emulator_equals_the_whole_call():
    """The reference computed a KV-head group at a time is the whole call's, bitwise."""
    lengths = [37, 130, 1]
    H, Hk, D = 4, 2, 64
    g = torch.Generator().manual_seed(3)
    q, do = (torch.randn(sum(lengths), H, D, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(sum(lengths), Hk, D, generator=g).bfloat16() for _ in range(2))
    cu = cu_seqlens_from_lengths(lengths)
    args = (q, k, v, do, cu, 130, 0.125, True)
    whole = fuzz_gpu.run_attention(*args, "emulate")
    chunked = fuzz_gpu.emulator_reference(*args, budget_bytes=1.0)  # one group per call
    for name in whole:
        assert torch.equal(whole[name], chunked[name]), name


# ----------------------------------------------------------------------------- soak


def test_soak_packs_hit_their_bucket_and_warmup_covers_every_kernel_set():
    rng = random.Random(0)
    for bucket in soak.BUCKETS:
        for _ in range(20):
            lens = soak.draw_pack(rng, bucket)
            assert max(lens) == bucket and min(lens) >= 1
            assert bucket <= sum(lens) <= max(bucket, soak.PACK_TOKENS)
    cfgs = soak.head_configs()
    specs = soak.call_specs(300, 1, cfgs)
    sets = []
    for s in specs:
        H, Hk, D = cfgs[s["heads"]]
        sets.append(frozenset(kernel_warmup.call_kernels(soak.RECIPE, D, H, Hk, s["lengths"], s["train"])))
    warm = soak.warmup_specs(specs, sets)
    warm_sets = {sets[s["index"]] for s in warm}
    assert warm_sets == set(sets)
    assert {(s["bucket"], s["heads"], s["train"]) for s in warm} == {(s["bucket"], s["heads"], s["train"]) for s in specs}
    assert {s["bucket"] for s in specs} == set(soak.BUCKETS) and len({s["heads"] for s in specs}) == 3


# ----------------------------------------------------------------------------- perf/gpu_session.sh

SESSION = pathlib.Path(__file__).resolve().parent.parent / "perf" / "gpu_session.sh"


def _session_stages():
    import re

    text = SESSION.read_text()
    header = " ".join(line[2:] for line in text.splitlines()[:6] if line.startswith("# "))
    listed = set(re.search(r"Stages: (.*?)\.", header).group(1).split())
    cases = set()
    for label in re.findall(r"^    ([a-z0-9|-]+)\)", text, flags=re.M):
        cases.update(label.split("|"))
    return text, listed, cases


def test_gpu_session_lists_every_stage_and_parses():
    import subprocess

    text, listed, cases = _session_stages()
    assert listed == cases, (listed ^ cases)
    assert subprocess.run(["bash", "-n", str(SESSION)]).returncode == 0
    # robust's stages exist, and its children never pack $OUT (the parent does, once, after all of them)
    import re

    robust = re.search(r"for s in ([a-z -]+); do\n\s+DEADLINE=", text).group(1).split()
    assert set(robust) <= cases and "robust" not in robust
    assert "NO_PACK=1 " in text and '[ -z "${NO_PACK:-}" ]' in text


def test_robust_warmup_names_the_scripts_kernels(capsys):
    """gpu_session.sh robust compiles the union of sanitize's, fuzz's and soak's kernels once, before they start."""
    assert kernel_warmup.main(["--list"]) == 0
    out = capsys.readouterr().out
    counts = {line.split(":")[0]: int(line.split()[1]) for line in out.splitlines() if "kernels" in line}
    assert counts["all"] >= max(counts["sanitize"], counts["fuzz"], counts["soak"]) > 0
    assert kernel_warmup.script_kernels("soak") == kernel_warmup.script_kernels("soak")  # a deterministic mix
    with pytest.raises(ValueError, match="sanitize, fuzz, soak, bench or train-long"):
        kernel_warmup.script_kernels("tests")


def test_build_ahead_sets_cover_bench_and_train_long():
    """A cache built ahead without a GPU (perf/README.md) holds bench's and train-long's kernels."""
    from flamia_cute.recipes import DEFAULT_RECIPE

    bench = kernel_warmup.script_kernels("bench")
    for lengths in ([16384], [1024] * 16, [65536]):
        for train in (False, True):
            assert kernel_warmup.call_kernels(DEFAULT_RECIPE, 128, 16, 16, lengths, train) <= bench
    train_long = kernel_warmup.script_kernels("train-long")
    assert {kind for kind, _ in train_long} == {"quant", "fwd", "bwd", "codes", "grad_rotate"}  # the fused RoPE's


def test_soak_counts_a_reading_that_falls_back_as_transient_and_a_leak_as_growth(monkeypatch):
    """soak.settled_growth: memory another thread frees just after a call returns is not growth; memory that
    stays is."""
    reads = iter([150, 40, 0])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 1000 + next(reads))
    assert soak.settled_growth(200, 1000, wait_s=0) == 0
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 1200)
    assert soak.settled_growth(200, 1000, wait_s=0) == 200
    assert soak.settled_growth(0, 1000, wait_s=0) == 0


def test_soak_transients_of_the_h100_run_are_the_calls_gradients():
    """The concurrent soak's readings above the warm-up (2026-12-05 H100, before settled_growth) each equal
    that call's dQ + dK + dV bytes: the autograd engine's worker still held the gradients torch.autograd.grad
    had returned, not memory the library keeps."""
    log = pathlib.Path(__file__).resolve().parents[1] / "perf/results/2026-12-05-h100-robust/soak-concurrent/soak.log"
    text = log.read_text()
    calls, seed = map(int, re.match(r"soak: (\d+) calls, seed (\d+),", text).groups())
    seen = [(int(m[1]), float(m[2])) for m in re.finditer(r"call (\d+): allocated \+([\d.]+) MiB", text)]
    assert len(seen) == 5
    cfgs = soak.head_configs()
    specs = soak.call_specs(calls, seed, cfgs)
    for i, mib in seen:
        assert specs[i]["train"] and round(soak.grad_bytes(specs[i], cfgs) / 2**20, 2) == mib, i
    assert soak.grad_bytes(specs[next(j for j, s in enumerate(specs) if not s["train"])], cfgs) == 0
