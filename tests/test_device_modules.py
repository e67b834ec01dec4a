"""The shared device modules (mask, softmax, tile_scheduler, varlen) are traced into the kernels that
import them, so each such kernel's compile-cache key (SOURCE_FILES) must hash them."""

import importlib
from pathlib import Path

import pytest

SHARED = ("mask", "softmax", "tile_scheduler", "varlen")


@pytest.mark.parametrize("module", ["flamia_cute.sm90.attention_fwd", "flamia_cute.sm90.attention_bwd",
                                    "flamia_cute.sm100.attention_fwd", "flamia_cute.sm100.quantize_mx",
                                    "flamia_cute.sm100.quantize_do_mx"])
def test_source_files_cover_the_shared_device_modules(module):
    pytest.importorskip("cutlass")
    mod = importlib.import_module(module)
    text = Path(mod.__file__).read_text()
    used = {name for name in SHARED if f"from ..{name} import" in text}
    assert used, f"{module} imports none of {SHARED}"
    files = {Path(p).resolve() for p in mod.SOURCE_FILES}
    for name in used:
        shared = importlib.import_module(f"flamia_cute.{name}")
        assert Path(shared.__file__).resolve() in files, f"{module}.SOURCE_FILES lacks flamia_cute/{name}.py"
