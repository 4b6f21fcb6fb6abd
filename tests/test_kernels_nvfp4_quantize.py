"""Tests for gpu_kernels/nvfp4_quantize.py: the Triton quantize, dequantize and fake-quantize
kernels against nvfp4.py's torch reference, bit for bit (on the CPU under TRITON_INTERPRET=1, on a
GPU natively), on every bf16 bit pattern, random data of every dtype and adversarial blocks."""

import pytest
import torch
from conftest import assert_same_quantization, same_bits
from test_nvfp4 import ANCHORED_SCALE, EVERY_BF16

import nvfp4

pytest.importorskip("triton")  # the kernels need it; a wrong name below must fail, not skip
from gpu_kernels import nvfp4_quantize  # noqa: E402


def kernel_quantize(x, global_scale=None):
    """The kernel's codes and block scales as an NVFP4Tensor; the global scale as nvfp4 computes
    it."""
    if global_scale is None:
        global_scale = nvfp4.compute_global_scale(x)
    global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    return nvfp4.NVFP4Tensor(*nvfp4_quantize.quantize(x, global_scale), global_scale)


def kernel_fake_quantize(x, global_scale=None):
    if global_scale is None:
        global_scale = nvfp4.compute_global_scale(x)
    global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    return nvfp4_quantize.fake_quantize(x, global_scale)


def kernel_dequantize(q, dtype):
    return nvfp4_quantize.dequantize(q.data, q.block_scale, q.global_scale, dtype)


def test_kernel_matches_reference_on_every_bf16_pattern(kernel_device):
    everything = torch.cat(list(EVERY_BF16.values()))
    # the anchored scale, and the large values under their own global scale (tiny, subnormal and
    # zero block scales)
    for x, global_scale in [
        (everything, torch.tensor(ANCHORED_SCALE)),
        (EVERY_BF16["large"], None),
    ]:
        ref = nvfp4.quantize_reference(x, global_scale)
        fast = kernel_quantize(
            x.to(kernel_device), None if global_scale is None else global_scale.to(kernel_device)
        )
        assert_same_quantization(ref, fast)
        assert same_bits(
            kernel_dequantize(fast, torch.float32), nvfp4.dequantize_reference(ref, torch.float32)
        )


SHAPES = [(1, 16), (3, 5, 48), (7, 1, 32), (2, 3, 4, 16), (33, 160)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_quantize_matches_reference_on_random_data(kernel_device, shape, dtype):
    torch.manual_seed(hash(shape) % 1000)
    x = (torch.randn(shape) * 3).to(dtype)
    ref = nvfp4.quantize_reference(x)
    fast = kernel_quantize(x.to(kernel_device))
    assert_same_quantization(ref, fast)
    deq_ref = nvfp4.dequantize_reference(ref, dtype)
    assert same_bits(kernel_dequantize(fast, dtype), deq_ref)
    assert same_bits(kernel_fake_quantize(x.to(kernel_device)), deq_ref)


def _adversarial(dtype):
    torch.manual_seed(1)
    x = torch.randn(13, 64)
    x[0] *= 1e-3
    x[1, 5] = 1e4  # one outlier: most blocks become tiny or zero
    x[2, :16] = 0  # zero block
    x[3] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 8)  # grid ties
    x[4] = -x[3]
    x[5] = torch.finfo(torch.float32).tiny * torch.rand(64)  # subnormal-scale values
    x[6, 7] = float("nan")
    x[7, 40] = float("inf")
    x[8, 1] = float("-inf")
    x[9] = 447.9 * 6 * 0.01 * torch.sign(torch.randn(64))  # block scales near the E4M3 maximum
    x[10, :32] = -0.0  # a -0.0 block, and negatives that round to -0
    x[10, 32:48] = torch.tensor([6.0] + [-0.1] * 15)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("global_scale", [None, 0.01, 2.0**-8])
def test_triton_quantize_matches_reference_on_adversarial_data(kernel_device, dtype, global_scale):
    x = _adversarial(dtype)
    if global_scale is None:
        x = x[x.isfinite().all(dim=-1)]  # with a computed scale a single NaN makes everything NaN
    gs = None if global_scale is None else torch.tensor(global_scale)
    ref = nvfp4.quantize_reference(x, gs)
    fast = kernel_quantize(x.to(kernel_device), None if gs is None else gs.to(kernel_device))
    assert_same_quantization(ref, fast)
    assert same_bits(kernel_dequantize(fast, dtype), nvfp4.dequantize_reference(ref, dtype))
    fake = kernel_fake_quantize(x.to(kernel_device), None if gs is None else gs.to(kernel_device))
    assert same_bits(fake, nvfp4.dequantize_reference(ref, dtype))


def test_triton_quantize_of_a_tensor_with_nan_gives_nan_everywhere(kernel_device):
    x = _adversarial(torch.float32).to(kernel_device)
    assert kernel_dequantize(kernel_quantize(x), torch.float32).isnan().all()


def test_per_matrix_global_scales_match_the_reference(kernel_device):
    torch.manual_seed(3)
    w = torch.randn(5, 8, 32) * torch.tensor([0.01, 1.0, 30.0, 0.5, 2.0]).view(5, 1, 1)
    gs = nvfp4.compute_global_scale(w, per_matrix=True)
    stacked = nvfp4.quantize_reference(w, gs)
    fast = kernel_quantize(w.to(kernel_device), gs.to(kernel_device))
    assert_same_quantization(stacked, fast)
    deq = nvfp4.dequantize_reference(stacked, torch.float32)
    assert same_bits(kernel_dequantize(fast, torch.float32), deq)
    assert same_bits(kernel_fake_quantize(w.to(kernel_device), gs.to(kernel_device)), deq)


def test_kernels_refuse_a_last_dim_off_the_block_size_and_a_foreign_scale(kernel_device):
    x = torch.randn(2, 20, device=kernel_device)
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_quantize.quantize(x, torch.tensor(1.0, device=kernel_device))
    with pytest.raises(ValueError, match="float32"):
        nvfp4_quantize.fake_quantize(
            x[:, :16], torch.tensor(1.0, dtype=torch.float64, device=kernel_device)
        )
