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
