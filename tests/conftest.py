"""Shared test setup and helpers.

- Tests run on the CPU by default. Tests marked `@pytest.mark.cuda` need an NVIDIA GPU and are
  skipped cleanly without one; tests marked `@pytest.mark.slow` are the long end-to-end checks, run
  by default (`-m "not slow"` leaves them out while iterating).
- Triton kernels run on the CPU under the Triton interpreter. `TRITON_INTERPRET` must be set before
  triton is first imported, so it is set here, at collection time, whenever no GPU is present (or
  when the user sets it explicitly). On a GPU machine the same kernel tests run natively on the
  device.
- torch computes on one thread: the shapes are tiny, so one thread is the fastest and the least
  disturbed by other processes on a shared CPU. A test that changes the thread count gets it back.
- Helpers: `report_diff` (max and mean difference, for fast-vs-slow twin tests), `bits` and
  `same_bits` (bitwise comparison), `assert_same_quantization` (two NVFP4 tensors hold the same
  bits), and `tiny_model` (the tiny preset with seeded weights).
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # a dependency on Linux only: elsewhere the kernel tests skip and the torch twins still run
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

import moe  # noqa: E402  (after sys.path and TRITON_INTERPRET are set)

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords and not _HAS_CUDA:
            item.add_marker(skip_cuda)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def kernel_device():
    """Device on which Triton kernels are exercised: the GPU if present, else the CPU
    (interpreter)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    return "cuda" if _HAS_CUDA else "cpu"


# ------------------------------------------------------------------------------------------ helpers
def relative_error(y, reference):
    """||y - reference|| / ||reference|| in float64."""
    return ((y.double() - reference.double()).norm() / reference.double().norm()).item()


def report_diff(a, b, name=""):
    """Max and mean absolute difference of two tensors (compared in float64), printed for the
    log."""
    d = (a.double() - b.double()).abs()
    mx, mean = d.max().item(), d.mean().item()
    print(f"{name} max|diff|={mx:.3e} mean|diff|={mean:.3e}")
    return mx, mean


_SAME_WIDTH_INT = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
}


def bits(t):
    """t's bit patterns on the CPU: a float tensor viewed as integers of its width, others as they
    are."""
    t = t.detach().cpu()
    return t.view(_SAME_WIDTH_INT[t.dtype]) if t.dtype in _SAME_WIDTH_INT else t


def same_bits(a, b):
    """Bitwise equality of two tensors of one dtype and shape (so -0.0 differs from +0.0). NaNs must
    sit in the same places; their payload and sign bits are not compared."""
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        nan = a.float().isnan()
        if not torch.equal(nan, b.float().isnan()):
            return False
        a, b = a[~nan], b[~nan]
    return torch.equal(bits(a), bits(b))


def assert_same_quantization(a, b):
    """Two NVFP4Tensors hold the same bits: packed codes, block-scale bytes (NaN included), global
    scales."""
    assert torch.equal(bits(a.data), bits(b.data)), "packed codes differ"
    assert torch.equal(bits(a.block_scale), bits(b.block_scale)), "block scales differ"
    assert same_bits(a.global_scale, b.global_scale), "global scales differ"


def tiny_model(seed=0, std=None, dtype=torch.float32, device="cpu", **config):
    """The tiny preset (max_seq_len 64 unless given) with seeded weights: N(0, std) for every matrix
    when std is given (wider than the default makes routing and attention depend on the weights),
    else the model's own init (Hugging Face's N(0, 0.02)). Other keywords override config fields."""
    torch.manual_seed(seed)
    model = moe.MoETransformer(moe.MoEConfig.from_preset("tiny", **{"max_seq_len": 64, **config}))
    if std is not None:
        model.init_weights(std=std)
    return model.to(device=device, dtype=dtype)


def raises_one_line(call, names, problem, error=ValueError):
    """call() raises `error` whose message is one line holding `names` (the argument or field it is
    about) and `problem` (what is wrong with it): the shape of every bad-input test's check."""
    with pytest.raises(error) as raised:
        call()
    message = str(raised.value)
    assert names in message and problem in message and "\n" not in message, message
    return message
