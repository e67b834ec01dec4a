import pytest


def sm90_gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_collection_modifyitems(config, items):
    if sm90_gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an sm_90 GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
