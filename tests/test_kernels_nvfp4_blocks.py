"""gpu_kernels/nvfp4_blocks.py: the decoders against the formats' tables: every E2M1 code against
the hand-written value table, every E4M3 byte against torch's float8_e4m3fn (on the CPU under
TRITON_INTERPRET=1, on a GPU natively). The encoder (quantize_pairs, load_pairs) is held to
nvfp4.quantize_reference bit for bit, on every bf16 pattern, by the tests of the two quantizers that
use it (test_kernels_nvfp4_quantize.py, test_kernels_w4a4_quantize.py)."""

import pytest
import torch
from conftest import same_bits

pytest.importorskip("triton")  # the kernels need it; a wrong name below must fail, not skip
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from gpu_kernels.nvfp4_blocks import e2m1_value, e4m3_value  # noqa: E402


@triton.jit
def _decode_kernel(codes_ptr, e2m1_ptr, e4m3_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    codes = tl.load(codes_ptr + offs)
    tl.store(e2m1_ptr + offs, e2m1_value(codes & 15))
    tl.store(e4m3_ptr + offs, e4m3_value(codes))


def test_decoders_give_every_e2m1_code_and_e4m3_byte_its_value(kernel_device):
    codes = torch.arange(256, dtype=torch.int32, device=kernel_device)
    e2m1 = torch.empty(256, dtype=torch.float32, device=kernel_device)
    e4m3 = torch.empty(256, dtype=torch.float32, device=kernel_device)
    _decode_kernel[(1,)](codes, e2m1, e4m3, BLOCK=256)
    # E2M1: bit 3 the sign, then 0, 0.5, 1, 1.5, 2, 3, 4, 6
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    table = torch.tensor(magnitudes + [-m for m in magnitudes])
    assert same_bits(e2m1.cpu(), table.repeat(16))  # -0.0 for code 8
    # E4M3: subnormals, normals up to 448 and the two NaN bytes 0x7F and 0xFF, as torch reads them
    expected = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    assert same_bits(e4m3.cpu(), expected.float())
