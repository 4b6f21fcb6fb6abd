"""gpu_kernels/rounding.py: BF16 rounding by integer arithmetic against torch's own fp32 -> bf16
cast (nearest, ties to even) on values around every rounding case: exact ties to an even and to an
odd neighbour, one unit either side of a tie, a carry into the exponent, subnormals, the largest
finite values (which round to infinity), signed zeros, infinities and NaN (on the CPU under
TRITON_INTERPRET=1, on a GPU natively)."""

import pytest
import torch
from conftest import bits, same_bits

pytest.importorskip("triton")  # the kernels need it; a wrong name below must fail, not skip
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from gpu_kernels.rounding import round_to, to_bf16_bits  # noqa: E402


@triton.jit
def _rounding_kernel(x_ptr, rounded_ptr, bits_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(rounded_ptr + offs, round_to(x, tl.bfloat16), mask=mask)
    tl.store(bits_ptr + offs, to_bf16_bits(x), mask=mask)


def _cases():
    """fp32 values as bit patterns: random bf16 patterns of every exponent, each with the low 16
    bits that decide its rounding, and the special values."""
    generator = torch.Generator().manual_seed(0)
    high = torch.randint(0, 1 << 16, (512,), generator=generator, dtype=torch.int64)
    high = high[(high & 0x7F80) != 0x7F80]  # leave Inf and NaN to the list below
    # below a tie, a tie, above it, and the extremes
    low = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    patterns = (high[:, None] << 16 | low[None, :]).flatten()
    special = [
        0x00000000,  # +0
        0x80000000,  # -0
        0x00000001,  # the smallest subnormal
        0x00008000,  # a tie among subnormals
        0x007FFFFF,  # the largest subnormal: carries into the smallest normal
        0x3F808000,  # 1 + 2^-8: a tie that rounds down to the even 1.0
        0x3F818000,  # 1 + 3 * 2^-8: a tie that rounds up to the even neighbour
        0x7F7FFFFF,  # the largest finite fp32: rounds to Inf
        0xFF7FFFFF,  # and its negative: -Inf
        0x7F800000,  # Inf
        0xFF800000,  # -Inf
        0x7FC00000,  # NaN
        0x7F800001,  # a signalling NaN
        0xFFC00000,  # a negative NaN
    ]
    patterns = torch.cat([patterns, torch.tensor(special, dtype=torch.int64)])
    return patterns.to(torch.int32).view(torch.float32)


def test_bf16_rounding_by_integer_arithmetic_is_torchs_cast(kernel_device):
    x = _cases()
    n = x.numel()
    rounded = torch.empty(n, dtype=torch.float32, device=kernel_device)
    bf16_bits = torch.empty(n, dtype=torch.int32, device=kernel_device)
    _rounding_kernel[(triton.cdiv(n, 256),)](x.to(kernel_device), rounded, bf16_bits, n, BLOCK=256)
    expected = x.to(torch.bfloat16)
    # round_to: the bf16 value kept in fp32, NaN a NaN
    assert same_bits(rounded.cpu(), expected.float())
    # to_bf16_bits: the 16-bit pattern; every NaN becomes the canonical 0x7FC0
    expected_bits = bits(expected).to(torch.int32) & 0xFFFF
    expected_bits[x.isnan()] = 0x7FC0
    assert torch.equal(bf16_bits.cpu(), expected_bits)
