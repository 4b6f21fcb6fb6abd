"""Shared test setup.

- Tests run on the CPU by default. Tests marked `@pytest.mark.cuda` need an NVIDIA GPU and are skipped
  cleanly without one.
- Triton kernels run on the CPU under the Triton interpreter. `TRITON_INTERPRET` must be set before
  triton is first imported, so it is set here, at collection time, whenever no GPU is present (or when
  the user sets it explicitly). On a GPU machine the same kernel tests run natively on the device.
- `report_diff(a, b)` prints and returns max and mean absolute difference, for fast-vs-slow twin tests.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import torch
    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords and not _HAS_CUDA:
            item.add_marker(skip_cuda)


@pytest.fixture
def kernel_device():
    """Device on which Triton kernels are exercised: the GPU if present, else the CPU (interpreter)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    return "cuda" if _HAS_CUDA else "cpu"


def report_diff(a, b, name=""):
    """Max and mean absolute difference of two tensors (compared in float64), printed for the log."""
    d = (a.double() - b.double()).abs()
    mx, mean = d.max().item(), d.mean().item()
    print(f"{name} max|diff|={mx:.3e} mean|diff|={mean:.3e}")
    return mx, mean
