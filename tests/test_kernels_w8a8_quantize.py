"""gpu_kernels/w8a8_quantize.py: the FP8 row-wise quantizer bit for bit against
fp8.quantize_rowwise (ties, subnormals, -0.0, zero rows, NaN, strided views; CPU under
TRITON_INTERPRET=1, GPU natively); compiled for sm_90 on the CPU, it divides as torch does and
rounds with the hardware's E4M3 conversion; one-line input errors."""

import pytest
import torch
from conftest import raises_one_line, same_bits
from test_kernels_w4a4_quantize import COMPILE_PREAMBLE, compiled_output

import fp8

pytest.importorskip("triton")  # the kernels need it; a wrong name below must fail, not skip
from gpu_kernels import w8a8_quantize  # noqa: E402


# ------------------------------------------------------------------ the quantizer
def _hard_rows(K, device, dtype=torch.bfloat16):
    """Rows that probe the rounding: ties between E4M3 neighbours (scale 1.0: the row's amax is
    448), subnormal ties and -0.0, an all-zero row, a row whose amax is tiny, and random rows of
    several magnitudes."""
    torch.manual_seed(K)
    x = torch.randn(6, K) * torch.tensor([1.0, 1.0, 0.0, 1e-30, 3.0, 100.0])[:, None]
    ties = torch.tensor(
        [448.0, 1.0625, -1.1875, 3.0 * 2**-10, -(2**-10), -0.0, 2**-11, 0.0146484375, 13.0]
    )
    x[0, : ties.numel()] = ties[:K]
    x[1] = torch.arange(K) * (448.0 / K) - 200.0  # a ramp through every binade
    return x.to(device, dtype)


@pytest.mark.parametrize("K", [7, 64, 96, 2100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantizer_equals_the_rowwise_rule_bit_for_bit(kernel_device, K, dtype):
    # K = 2100: more than one K step (the kernel's BLOCK_K is at most 2048) and a masked last one
    x = _hard_rows(K, kernel_device, dtype)
    codes, scale = w8a8_quantize.quantize_rows(x)
    expected_codes, expected_scale = fp8.quantize_rowwise(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    assert same_bits(scale, expected_scale) and scale[2].item() == 1.0
    assert same_bits(codes, expected_codes)


def test_quantizer_reads_strided_views_and_propagates_nan_as_torch(kernel_device):
    x = torch.randn(5, 64, device=kernel_device, dtype=torch.bfloat16)
    # torch: amax NaN, so scale 1.0 (NaN > 0 is false); codes NaN there, +-448 elsewhere
    x[3, 5] = float("nan")
    wide = torch.zeros(5, 80, device=kernel_device, dtype=torch.bfloat16)
    wide[:, 8:72] = x * 1000
    # x itself; rows 80 elements apart; columns 5 apart (a copy)
    for source in (x, wide[:, 8:72], x.t().contiguous().t()):
        codes, scale = w8a8_quantize.quantize_rows(source)
        expected_codes, expected_scale = fp8.quantize_rowwise(source)
        assert same_bits(scale, expected_scale) and same_bits(codes, expected_codes)
    assert w8a8_quantize.quantize_rows(x[:0])[0].shape == (0, 64)


# ------------------------------------------------------------------ input checks
BAD_CALLS = [  # (id, call, what the message names, the problem it states)
    (
        "x dtype",
        lambda: w8a8_quantize.quantize_rows(torch.ones(2, 32, dtype=torch.int32)),
        "x must be a 2-D",
        "torch.int32",
    ),
]


@pytest.mark.parametrize(
    "call, names, problem", [case[1:] for case in BAD_CALLS], ids=[case[0] for case in BAD_CALLS]
)
def test_bad_input_raises_one_line_naming_the_argument_and_the_problem(call, names, problem):
    raises_one_line(call, names, problem)


# ------------------------------------------------------------------ compiled for sm_90 (no GPU)
# The W8A8 kernels' compile-only script: counts(name, variant, kernel, argument types, constexprs)
# prints the FP8 wgmma instructions, the hardware E4M3 conversions and the IEEE divisions of the
# kernel's PTX for sm_90
FP8_COMPILE_PREAMBLE = (
    COMPILE_PREAMBLE
    + r"""
from gpu_kernels import w8a8_dense, w8a8_experts, w8a8_quantize
p8 = "*fp8e4nv"
def counts(name, variant, kernel, types, c, warps=4, stages=3):
    signature = dict(zip([a for a in kernel.arg_names if a not in c], types))
    signature.update({a: "constexpr" for a in c})
    ptx = compile(ASTSource(kernel, signature, c), target=GPUTarget("cuda", 90, 32),
                  options=dict(num_warps=warps, num_stages=stages)).asm["ptx"]
    mma = len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n16k32\.f32\.e4m3\.e4m3", ptx))
    cvt = len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx))
    print(name, variant, mma, cvt, len(re.findall(r"\bdiv\.rn\.f32\b", ptx)))
"""
)


def compiled_counts(script):
    """Run a script built on FP8_COMPILE_PREAMBLE -> {(name, variant): (wgmma, cvt, div) counts}."""
    return {
        (name, variant): tuple(map(int, numbers))
        for name, variant, *numbers in (line.split() for line in compiled_output(script))
    }


def test_quantizer_compiles_for_sm90_to_ieee_division_and_hardware_rounding():
    # What the interpreter cannot show: on Hopper x is quantized with IEEE division (div.rn, as
    # torch divides) and the hardware's nearest-even E4M3 conversion
    found = compiled_counts(
        FP8_COMPILE_PREAMBLE
        + r"""
counts("quantizer", True, jit(w8a8_quantize.quantize_kernel), ["*bf16", p8, "*fp32"] + [i] * 4,
       dict(ROWS=1, BLOCK_K=2048, GPU=True))
"""
    )
    assert set(found) == {("quantizer", "True")}, found
    _, cvt, div = found["quantizer", "True"]
    assert cvt > 0 and div > 0, found
