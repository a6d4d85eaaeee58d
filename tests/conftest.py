import importlib.util
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Without CUDA the Triton kernels run in Triton's CPU interpreter, which Triton picks when the
# kernels are decorated (first import of pagedprefill.backends.triton): set it here, before
# any test module is collected. An explicit value in the environment wins.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the modules that import the Triton backend itself: not collected where Triton is not installed (a
# CPU-only torch brings none; `pip install -e ".[triton]"` adds it); the rest skips its Triton cases
HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_MODULES = ["test_backend_hopper.py", "test_backend_triton.py", "test_dispatch.py", "test_sass_counts.py"]
collect_ignore = [] if HAS_TRITON else TRITON_MODULES


def pytest_report_header(config):
    if not HAS_TRITON:
        return f"triton is not installed: {', '.join(TRITON_MODULES)} not collected"
    return None


def _wants_triton(item) -> bool:
    """A case run on the Triton backend (a "triton" parameter) or marked ``needs_triton``."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return "needs_triton" in item.keywords or any(v == "triton" for v in params.values())


def pytest_collection_modifyitems(config, items):
    no_triton = pytest.mark.skip(reason='triton is not installed (pip install -e ".[triton]")')
    for item in items:
        if not HAS_TRITON and _wants_triton(item):
            item.add_marker(no_triton)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none found); runs on the H200 through the device tool")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
