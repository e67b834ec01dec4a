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


def sm100_gpu_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


def pytest_collection_modifyitems(config, items):
    """gpu tests run on an sm_90 GPU; those also marked sm100 run on a Blackwell GPU instead, those marked
    sm90_sm100 on either."""
    have = {False: sm90_gpu_available(), True: sm100_gpu_available()}
    for item in items:
        if item.get_closest_marker("gpu"):
            if item.get_closest_marker("sm90_sm100"):
                if not (have[False] or have[True]):
                    item.add_marker(pytest.mark.skip(reason="needs an sm_90 or an sm_100 GPU"))
                continue
            blackwell = item.get_closest_marker("sm100") is not None
            if not have[blackwell]:
                item.add_marker(pytest.mark.skip(reason=f"needs an {'sm_100' if blackwell else 'sm_90'} GPU"))


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    """Each test derives its plans anew: plan.make_plan memoizes them per signature (tuned.derived_memo),
    and tests that monkeypatch a config function (short_pairs_default, short_pairs_worth) must neither
    miss their patch nor leave its plans to the next test."""
    from flamia_cute import tuned

    tuned._loaded.pop("derived", None)
    yield
    tuned._loaded.pop("derived", None)
