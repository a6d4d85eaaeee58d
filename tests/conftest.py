import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Without CUDA the Triton kernels run in Triton's CPU interpreter, which Triton picks when the
# kernels are decorated (first import of pagedprefill.backends.triton): set it here, before
# any test module is collected. An explicit value in the environment wins.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none found); runs on the H200 through the device tool")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
