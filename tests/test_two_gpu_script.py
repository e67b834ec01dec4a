"""Issue 40's two-GPU scripts on the CPU (gloo, the emulator, tiny packs): perf/two_gpu_cp.py passes at world
size 2 and fails a leaky control; perf/two_gpu.sh's cp stage writes its CSV and manifest."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _env():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    env.pop("OUT", None)
    return env


def _cp(*args):
    return subprocess.run([*TORCHRUN, str(ROOT / "perf" / "two_gpu_cp.py"), "--cpu", "--no-timing", *args],
                          capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)


def test_context_parallel_run_passes_on_two_ranks():
    res = _cp("--workloads", "2x192,mixed")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "ALL OK" in res.stdout and '"leakage": "ok"' in res.stdout


def test_context_parallel_run_fails_a_leaky_recipe():
    res = _cp("--workloads", "2x192", "--recipe", "fp8_tensor_current")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "LEAKS" in res.stdout and "FAILED" in res.stdout


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_two_gpu_sh_cp_stage(tmp_path):
    res = subprocess.run(["bash", str(ROOT / "perf" / "two_gpu.sh"), str(tmp_path), "cp"], capture_output=True,
                         text=True, timeout=400, env=dict(_env(), PYTHON=sys.executable), cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (tmp_path / "two_gpu_cp.csv").exists()
    manifest = (tmp_path / "MANIFEST.md").read_text()
    assert "two_gpu_cp.py" in manifest and "rc 0" in manifest
