import os

import pytest
import torch

if not torch.cuda.is_available():
    # GPU-less CI compiles for sm_90a. The DSL fixes its default arch when cutlass is first
    # imported (exporting kernels to the disk cache needs it), so set it before any test module.
    os.environ.setdefault("FLAMIA_ARCH", "sm_90a")
    os.environ.setdefault("CUTE_DSL_ARCH", os.environ["FLAMIA_ARCH"])


def sm90_gpu_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_collection_modifyitems(config, items):
    if sm90_gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an sm_90 GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
