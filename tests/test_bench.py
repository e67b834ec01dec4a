"""The benchmark harness's plumbing on the CPU (timings there mean nothing; columns and skips do)."""

import json

import pandas as pd
import pytest
import torch

from flamia_cute.cli import main
from flamia_cute.recipes import DEFAULT_RECIPE


def test_bench_runs_and_writes_csv(tmp_path, capsys):
    wl = {"head_configs": {"tiny": {"heads_q": 2, "heads_kv": 1, "head_dim": 64}},
          "workloads": {"two": [64, 64], "mix": [100, 1, 27]}}
    path = tmp_path / "wl.json"
    path.write_text(json.dumps(wl))
    rc = main(["bench", "--workloads", str(path), "--heads", "tiny", "--reps", "2", "--device", "cpu",
               "--impls", "flamia,sdpa,cudnn", "--out", str(tmp_path)])
    assert rc == 0
    df = pd.read_csv(tmp_path / "bench_tiny.csv")
    timed = df[df["ms"].notna()]
    assert set(timed["impl"]) == {f"flamia_{DEFAULT_RECIPE}[emulate]", "sdpa_per_doc"}
    assert set(timed["mode"]) == {"fwd", "bwd", "fwdbwd"}
    assert (timed["err_o"] < 0.1).all() and (timed["err_dq"] < 0.15).all()
    assert df[df["impl"] == "cudnn_fp8"]["skipped"].notna().all()
    for col in ("gpu", "torch", "commit", "source_hash", "timestamp", "timing"):
        assert col in df.columns
    assert (df["timing"] == "wall_cpu").all()
    assert "speedup of ours over each baseline" in capsys.readouterr().out


def test_bench_gpu_time_flag_is_recorded(tmp_path):
    """--gpu-time is a GPU-only timing mode: accepted on the CPU, where timing stays wall-clock."""
    wl = {"head_configs": {"tiny": {"heads_q": 2, "heads_kv": 2, "head_dim": 64}}, "workloads": {"one": [40]}}
    path = tmp_path / "wl.json"
    path.write_text(json.dumps(wl))
    assert main(["bench", "--workloads", str(path), "--heads", "tiny", "--reps", "1", "--device", "cpu",
                 "--impls", "sdpa", "--modes", "fwd", "--gpu-time", "--out", str(tmp_path)]) == 0
    assert (pd.read_csv(tmp_path / "bench_tiny.csv")["timing"] == "wall_cpu").all()


def test_bench_sustained_times_back_to_back_calls(tmp_path, capsys, monkeypatch):
    """--sustain S: each mode's calls run S seconds, then back-to-back windows are timed (median ms per
    call); a negative S is refused by name."""
    import flamia_cute.bench as bench

    seen = []
    real = bench._time_sustained
    monkeypatch.setattr(bench, "_time_sustained", lambda fn, n, dev, s, reps: seen.append(s) or real(fn, n, dev, s, reps))
    wl = {"head_configs": {"tiny": {"heads_q": 2, "heads_kv": 2, "head_dim": 64}}, "workloads": {"one": [40]}}
    path = tmp_path / "wl.json"
    path.write_text(json.dumps(wl))
    assert main(["bench", "--workloads", str(path), "--heads", "tiny", "--reps", "2", "--device", "cpu",
                 "--impls", "sdpa", "--modes", "fwd,fwdbwd", "--sustain", "0.05", "--out", str(tmp_path)]) == 0
    assert seen == [0.05, 0.05]
    df = pd.read_csv(tmp_path / "bench_tiny.csv")
    assert (df["ms"] > 0).all()
    assert main(["bench", "--workloads", str(path), "--heads", "tiny", "--device", "cpu", "--sustain", "-1"]) == 2
    assert "--sustain" in capsys.readouterr().err
    # CUDA graph replays: a GPU and --sustain only (CPU timing would silently mean something else)
    for extra in ([], ["--sustain", "0.05"]):
        assert main(["bench", "--workloads", str(path), "--heads", "tiny", "--device", "cpu", "--modes", "fwd",
                     "--graph", *extra]) == 2
        assert "--graph" in capsys.readouterr().err
    if torch.cuda.is_available():
        assert main(["bench", "--workloads", str(path), "--heads", "tiny", "--device", "cuda", "--graph", "--sustain",
                     "1", "--modes", "fwd,bwd"]) == 2
        assert "--graph" in capsys.readouterr().err


def test_time_sustained_counts_calls_per_window():
    """ms per call = window time / calls in it: a call that sleeps 2 ms times at ~2 ms."""
    import time as _time

    from flamia_cute.bench import _time_sustained

    got = _time_sustained(lambda i: _time.sleep(0.002), 2, "cpu", 0.02, reps=3, window_ms=10.0)
    assert 1.9 < got < 4.0, got


@pytest.mark.gpu
def test_graphed_calls_replay_the_captured_set():
    """bench._graphed: each input set's call runs once eagerly (warm-up), is captured, and replay(i)
    reruns set i's captured work only."""
    from flamia_cute.bench import _graphed

    bufs = [torch.zeros(4, device="cuda"), torch.zeros(4, device="cuda")]
    replay = _graphed(lambda i: bufs[i].add_(i + 1), 2, "cuda")
    replay(0)
    replay(0)
    replay(1)
    torch.cuda.synchronize()
    assert bufs[0].tolist() == [3.0] * 4 and bufs[1].tolist() == [4.0] * 4


def test_bench_rejects_unknown_names(tmp_path, capsys):
    assert main(["bench", "--heads", "nope", "--device", "cpu"]) == 2
    assert "--heads" in capsys.readouterr().err


def test_speedups_are_geomeans_over_the_workloads_both_timed():
    """The summary the issues' bars are stated in: baseline ms / ours ms, geomean and minimum per
    mode, over the workloads both implementations timed (a skipped baseline's rows do not count)."""
    from flamia_cute.bench import speedups

    table = pd.DataFrame({"workload": ["a", "a", "b", "b", "c"], "mode": ["fwd", "bwd", "fwd", "bwd", "fwd"],
                          "flamia_x": [1.0, 2.0, 4.0, 1.0, 3.0], "fa4_bf16": [2.0, 2.0, 2.0, 4.0, None],
                          "cudnn_fp8": [None, None, 8.0, 3.0, None]}).set_index(["workload", "mode"])
    got = speedups(table)
    fwd = got.loc[("flamia_x", "fa4_bf16", "fwd")]
    assert abs(fwd["geomean"] - 1.0) < 1e-12 and fwd["min"] == 0.5 and fwd["workloads"] == 2  # 2 and 0.5
    bwd = got.loc[("flamia_x", "fa4_bf16", "bwd")]
    assert abs(bwd["geomean"] - 2.0) < 1e-12 and bwd["min"] == 1.0
    assert got.loc[("flamia_x", "cudnn_fp8", "fwd")]["workloads"] == 1
    assert len(speedups(table[["fa4_bf16"]])) == 0  # nothing of ours: no rows


def test_bench_order_rotates_which_implementation_runs_first():
    """No implementation is always timed first on a workload (the first-timed build can run up to 9%
    faster on a GPU that had idled); every pair is timed once."""
    from flamia_cute.bench import bench_order

    order = bench_order(["a", "b", "c", "d"], ["ours", "fa4", "cudnn"])
    assert sorted(order) == sorted((w, i) for w in "abcd" for i in ("ours", "fa4", "cudnn"))
    firsts = [order[3 * k][1] for k in range(4)]
    assert firsts == ["ours", "fa4", "cudnn", "ours"]
    assert [w for w, _ in order] == [w for w in "abcd" for _ in range(3)]


def test_bench_on_the_cpu_skips_what_the_emulator_cannot_hold(tmp_path, capsys):
    """Without a GPU, bench runs the emulator, whose score matrices grow with the square of a document:
    the default workloads (16k-token packs) are refused with the reason, never run out of memory."""
    from flamia_cute.bench import EMULATOR_MAX_TOKENS

    assert main(["bench", "--device", "cpu", "--reps", "1"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "1x16k" in err and "nothing left to run" in err
    wl = {"head_configs": {"tiny": {"heads_q": 2, "heads_kv": 1, "head_dim": 64}},
          "workloads": {"small": [64, 30], "big": [EMULATOR_MAX_TOKENS, 1]}}
    path = tmp_path / "wl.json"
    path.write_text(json.dumps(wl))
    assert main(["bench", "--workloads", str(path), "--heads", "tiny", "--reps", "1", "--device", "cpu",
                 "--impls", "flamia", "--modes", "fwd", "--out", str(tmp_path)]) == 0
    assert "skipping ['big']" in capsys.readouterr().err
    assert set(pd.read_csv(tmp_path / "bench_tiny.csv")["workload"]) == {"small"}


def test_error_check_runs_on_the_longest_document_and_never_divides_by_zero():
    """A pack that starts with a one-token document: its reference dQ is exactly 0 (the token sees only
    itself), so the error check takes the longest document's prefix; an all-zero reference gives the
    absolute error instead of a relative one over nothing."""
    from flamia_cute.bench import Case, _error, _prefix_reference

    case = Case("t", [1, 300, 40], 2, 1, 64, "cpu").build()
    q, k, v, do = case.sets[0]
    ref_o, ref_dq, (sl, hs) = _prefix_reference(case, q, k, v, do, min(max(case.lengths), 2048))
    assert (sl.start, sl.stop) == (1, 301) and ref_dq.abs().max() > 0
    zero = torch.zeros(4, 4)
    assert _error(zero + 1e-3, zero) == pytest.approx(1e-3) and _error(zero, zero) == 0.0
    assert _error(ref_o * 1.01, ref_o) == pytest.approx(0.01, rel=1e-3)


def test_layer_flag_adds_rope_columns_timed_against_rope_columns(tmp_path, capsys):
    """--layer: ours with RoPE fused ("+rope") beside ours plain, in one run; errors against RoPE +
    attention in fp32 (a reference without the rotation would put them near 1); the speedups pair
    "+rope" columns with "+rope" baselines only."""
    from flamia_cute.bench import speedups

    wl = {"head_configs": {"tiny": {"heads_q": 2, "heads_kv": 1, "head_dim": 64}}, "workloads": {"mix": [100, 1, 27]}}
    path = tmp_path / "wl.json"
    path.write_text(json.dumps(wl))
    assert main(["bench", "--workloads", str(path), "--heads", "tiny", "--reps", "1", "--device", "cpu", "--layer",
                 "--impls", "flamia,fa4,sdpa", "--modes", "fwd,fwdbwd", "--out", str(tmp_path)]) == 0
    df = pd.read_csv(tmp_path / "bench_tiny.csv")
    timed = df[df["ms"].notna()]
    ours = f"flamia_{DEFAULT_RECIPE}[emulate]"
    assert set(timed["impl"]) == {ours, ours + "+rope", "sdpa_per_doc"}
    assert (timed["err_o"] < 0.1).all() and (timed[timed["mode"] == "fwdbwd"]["err_dq"] < 0.15).all()
    assert set(df[df["skipped"].notna()]["impl"]) >= {"fa4_bf16", "fa4_bf16+rope"}  # no GPU here
    table = pd.DataFrame({"workload": ["a"], "mode": ["fwdbwd"], "flamia_x": [1.0], "flamia_x+rope": [1.0],
                          "fa4_bf16": [2.0], "fa4_bf16+rope": [3.0]}).set_index(["workload", "mode"])
    pairs = set(speedups(table).index.droplevel("mode"))
    assert pairs == {("flamia_x", "fa4_bf16"), ("flamia_x+rope", "fa4_bf16+rope")}


def test_rope_baseline_is_the_rotation_of_the_fused_call():
    """FA4's RoPE in the layer bench (flash-attn's kernel, else torch.compile of the fp32 formula over
    per-token tables) rotates as rotary= does: the same bf16 values (compiled on the CPU here)."""
    from flamia_cute.baselines.torch_impls import RopeBaseline
    from flamia_cute.rotary import RotaryConfig, apply_rotary
    from flamia_cute.testing import cu_seqlens_from_lengths

    cu = cu_seqlens_from_lengths([100, 0, 37, 5])
    x = torch.randn(142, 2, 64).to(torch.bfloat16)
    for interleaved in (False, True):
        rot = RotaryConfig(interleaved=interleaved).tables(100, 64, "cpu")
        got = RopeBaseline(rot.cos, rot.sin, cu, 142, interleaved)(x, 100)
        want = apply_rotary(x, cu, rot)
        assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()  # an FMA's ulp


def test_environment_takes_the_commit_from_flamia_commit(monkeypatch):
    """The device tool's copy of a checkout keeps a stale .git: FLAMIA_COMMIT, when set, names the commit."""
    from flamia_cute.bench import environment

    monkeypatch.setenv("FLAMIA_COMMIT", "0123abc")
    env = environment()
    assert env["commit"] == "0123abc" and len(env["source_hash"]) == 12
    monkeypatch.delenv("FLAMIA_COMMIT")
    assert environment()["commit"] != "0123abc"


def test_a_run_cut_short_keeps_its_rows(tmp_path, monkeypatch):
    """bench writes the rows so far after each (workload, implementation): a run stopped by a time limit leaves
    them in bench_<heads>.partial.csv, with the run's environment; a finished run removes that file."""
    import flamia_cute.bench as b

    wl = {"head_configs": {"tiny": {"heads_q": 2, "heads_kv": 1, "head_dim": 64}},
          "workloads": {"one": [64, 30], "two": [40]}}
    path = tmp_path / "wl.json"
    path.write_text(json.dumps(wl))
    argv = ["bench", "--workloads", str(path), "--heads", "tiny", "--reps", "1", "--device", "cpu", "--impls",
            "flamia", "--modes", "fwd", "--out", str(tmp_path)]
    real, calls = b.bench_case, []

    def stop_at_the_second(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as the time limit's signal would stop it
        return real(*args, **kw)

    monkeypatch.setattr(b, "bench_case", stop_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    part = pd.read_csv(tmp_path / "bench_tiny.partial.csv")
    assert len(part) == 1 and part["ms"].notna().all() and (part["timing"] == "wall_cpu").all()
    assert not (tmp_path / "bench_tiny.csv").exists()
    monkeypatch.setattr(b, "bench_case", real)
    assert main(argv) == 0
    assert (tmp_path / "bench_tiny.csv").exists() and not (tmp_path / "bench_tiny.partial.csv").exists()
