"""Tuning: space enumeration and pruning, cache keys, staleness, write-through (CPU)."""

import dataclasses
import json
import warnings

import pytest

from flamia_cute.cli import main
from flamia_cute.tuning import TuningCache, TuningKey, workload_class

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
    assert "stages=2 pingpong=True" in out and "stages=4 pingpong=False" in out
    assert "workload 1x16k: class long-uniform" in out


def test_tune_rejects_unknown_recipe(capsys):
    assert main(["tune", "--dry-run", "--recipe", "mxfp8"]) == 2


_FRESH = """
import json, torch
from flamia_cute import compile_cache, flamia_attn_varlen_func
from flamia_cute.testing import make_inputs
from flamia_cute.tuning import tuned_fwd_config
from flamia_cute.attention_fwd_sm90 import FwdConfig
q, k, v, _, cu, scale = make_inputs([1024] * 4, 16, 16, 128, device="cuda")
cfg = tuned_fwd_config(FwdConfig(head_dim=128, diagonal_copy=True), 1024, 4096, 4)
flamia_attn_varlen_func(q, k, v, cu, cu, 1024, 1024)
torch.cuda.synchronize()
print(json.dumps({"stages": cfg.kv_stages, "pingpong": cfg.pingpong, "compiles": compile_cache.STATS.compiles,
                  "disk_hits": compile_cache.STATS.disk_hits}))
"""


@pytest.mark.gpu
def test_short_real_tune_then_fresh_process_uses_it(tmp_path):
    import os
    import subprocess
    import sys

    wl = {"head_configs": {"h16_d128": {"heads_q": 16, "heads_kv": 16, "head_dim": 128}},
          "workloads": {"4x1k": [1024] * 4}}
    path = tmp_path / "wl.json"
    path.write_text(json.dumps(wl))
    env = dict(os.environ, FLAMIA_CUTE_CACHE_DIR=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-m", "flamia_cute.cli", "tune", "--workloads", str(path), "--reps", "5"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    tuned = json.loads(next((tmp_path / "cache" / "tuning").glob("*.json")).read_text())
    rec = tuned["entries"]["fwd"]["d128_g1_tokenblock/mid-uniform"]
    fresh = subprocess.run([sys.executable, "-c", _FRESH], env=env, capture_output=True, text=True, timeout=600)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    got = json.loads(fresh.stdout.strip().splitlines()[-1])
    assert (got["stages"], got["pingpong"]) == (rec["config"]["kv_stages"], rec["config"]["pingpong"])
    assert got["compiles"] == 0 and got["disk_hits"] >= 1, got  # no recompiling, no retiming
