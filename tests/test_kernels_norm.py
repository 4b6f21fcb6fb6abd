"""Tests for gpu_kernels/norm.py: the fused RMSNorm (forward, and the gradient of its autograd
Function) and the fused per-head norm + RoPE against moe.py's plain twins (on the CPU under
TRITON_INTERPRET=1, on a GPU natively)."""

import pytest
import torch
from conftest import raises_one_line

import moe

pytest.importorskip("triton")  # the kernels need it; a wrong name below must fail, not skip
from gpu_kernels import norm as norm_kernels  # noqa: E402


@pytest.mark.parametrize(
    "dtype,weight_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
)
def test_fused_rms_norm_matches_its_twin(kernel_device, dtype, weight_dtype):
    generator = torch.Generator().manual_seed(0)
    for rows, dim in ((1, 16), (37, 96), (8, 128)):  # D below, at and above a power of two
        x = (3 * torch.randn(rows, dim, generator=generator)).to(dtype).to(kernel_device)
        weight = (0.5 + torch.rand(dim, generator=generator)).to(weight_dtype).to(kernel_device)
        y = norm_kernels.rms_norm(x, weight, 1e-6)
        expected = moe.rms_norm_reference(x, weight, 1e-6)
        assert y.dtype == expected.dtype and y.shape == expected.shape
        # the sum of squares in another order: equal up to fp32 rounding of 1/rms, which the casts
        # to BF16 / FP16 almost always absorb (one unit in the last place at most)
        ulp = torch.finfo(expected.dtype).eps
        assert ((y.float() - expected.float()).abs() <= 2 * ulp * expected.float().abs()).all()
        # a missing cast back before * w moves a quarter or more
        if expected.dtype != torch.float32:
            assert (y != expected).float().mean() < 0.01
    x = torch.zeros(2, 32, dtype=dtype, device=kernel_device)
    zeros = norm_kernels.rms_norm(x, weight[:32], 1e-6)
    assert torch.equal(zeros, moe.rms_norm_reference(x, weight[:32], 1e-6))


def test_fused_rms_norm_gradients_are_the_twins(kernel_device):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 48, generator=generator).to(kernel_device).requires_grad_()
    weight = (0.5 + torch.rand(48, generator=generator)).to(kernel_device).requires_grad_()
    grad = torch.randn(5, 48, generator=generator).to(kernel_device)
    norm_kernels.RMSNormFunction.apply(x, weight, 1e-6, moe.rms_norm_reference).backward(grad)
    fused = (x.grad.clone(), weight.grad.clone())
    x.grad = weight.grad = None
    moe.rms_norm_reference(x, weight, 1e-6).backward(grad)
    assert torch.equal(fused[0], x.grad) and torch.equal(fused[1], weight.grad)


def test_fused_norms_refuse_the_dtypes_whose_roundings_they_do_not_make(kernel_device):
    x = torch.randn(2, 1, 4, 16, device=kernel_device)
    cos, sin = moe.rope_cos_sin(
        torch.zeros(2, 1, dtype=torch.long, device=kernel_device), 16, 1e6, torch.bfloat16
    )
    half, weight = x.half(), torch.ones(16, device=kernel_device)
    raises_one_line(
        lambda: norm_kernels.rms_norm(half, weight.half(), 1e-6), "x and weight", "float16"
    )
    raises_one_line(
        lambda: norm_kernels.norm_rope(half, weight.half(), 1e-6, cos.half(), sin.half()),
        "must all be bfloat16",
        "float16",
    )


def test_fused_norm_rope_is_the_norm_then_rope_bit_for_bit(kernel_device):
    dtype = torch.bfloat16
    generator = torch.Generator().manual_seed(2)
    # hd below and at a power of 2
    for B, T, heads, hd in ((1, 1, 4, 16), (2, 3, 5, 96), (3, 2, 2, 128)):
        x = (3 * torch.randn(B, T, heads, hd, generator=generator)).to(dtype).to(kernel_device)
        weight = (0.5 + torch.rand(hd, generator=generator)).to(dtype).to(kernel_device)
        positions = torch.randint(0, 4096, (B, T), generator=generator).to(kernel_device)
        cos, sin = moe.rope_cos_sin(positions, hd, 1e6, dtype)
        y = norm_kernels.norm_rope(x, weight, 1e-6, cos, sin)
        # the same norm kernel, then torch's RoPE: every rounding the same, so every bit
        expected = moe.apply_rope(norm_kernels.rms_norm(x, weight, 1e-6).transpose(1, 2), cos, sin)
        assert y.shape == (B, heads, T, hd) and y.dtype == dtype and y.is_contiguous()
        assert torch.equal(y, expected)
        # against the plain twin (torch's sum of squares): one unit in the last place, rarely
        plain = moe.apply_rope(moe.rms_norm_reference(x, weight, 1e-6).transpose(1, 2), cos, sin)
        assert (y != plain).float().mean() < 0.02
