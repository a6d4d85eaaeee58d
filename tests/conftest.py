import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none found); runs on the H200 through the device tool")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
