"""gpu_kernels/w4a4_quantize.py: the activation quantizer against rac.quantize_activation_reference
(codes) and the definition of the Hopper GEMMs' fp16 operand, bit for bit (CPU under
TRITON_INTERPRET=1, GPU natively), with one global scale or one per row (against
nvfp4.quantize_activation(..., "row")); the W4A16 operand and its power-of-two scale against their
definition; the partial max; the residual's product rounded on its own when compiled for sm_90 on
the CPU."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import raises_one_line, same_bits
from test_kernels_nvfp4_quantize import _adversarial

import nvfp4
import rac

pytest.importorskip("triton")  # the kernels need it; a wrong name below must fail, not skip
from gpu_kernels import w4a4_quantize  # noqa: E402


def operand_oracle(x_q, residual=None):
    """The Hopper GEMMs' fp16 operand, by its definition: (code value * block scale of x, plus the
    residual's) * 2^-6 in float64, rounded once to fp16, as planes (2, M, K/2) of the even and the
    odd columns."""

    def values(q):
        codes = nvfp4.unpack_codes(q.data.cpu())
        magnitude = torch.tensor(nvfp4.E2M1_VALUES, dtype=torch.float64)[(codes & 7).long()]
        signed = torch.where(codes >= 8, -magnitude, magnitude)
        return (
            signed.view(*codes.shape[:-1], -1, 16) * q.block_scale.cpu().double()[..., None]
        ).flatten(-2)

    exact = values(x_q) if residual is None else values(x_q) + values(residual)  # (-0.0 stays -0.0)
    return (torch.stack((exact[:, 0::2], exact[:, 1::2])) * 2.0**-6).half()


@pytest.mark.parametrize("rows,cols", [(1, 16), (3, 48), (17, 80), (64, 768)])
@pytest.mark.parametrize("compensate", [False, True])
def test_quantizer_matches_its_reference_bit_for_bit(kernel_device, rows, cols, compensate):
    # (64, 768) has 49152 elements: above AMAX_IN_LAUNCH, so its amax comes from the partial-max
    # launch
    torch.manual_seed(rows * cols)
    x = (torch.randn(rows, cols) * torch.exp(torch.randn(cols))).to(kernel_device, torch.bfloat16)
    x[0, :5] = -1e-30  # negative values that round to zero
    mask = (torch.arange(cols // 16, device=kernel_device) % 2 == 0) if compensate else None
    act = rac.quantize_activation_triton(x, mask, codes=True, operand=True)
    x_q, residual = rac.quantize_activation_reference(x.cpu(), None if mask is None else mask.cpu())
    assert same_bits(act.global_scale, x_q.global_scale)
    assert same_bits(act.x_q.data, x_q.data) and same_bits(act.x_q.block_scale, x_q.block_scale)
    if compensate:
        assert same_bits(act.residual.data, residual.data)
        assert same_bits(act.residual.block_scale, residual.block_scale)
        # unselected blocks carry no residual; selected ones do (the test input has no exact blocks)
        scales = residual.block_scale.float()
        assert (scales[:, ~mask.cpu()] == 0).all() and (scales[:, mask.cpu()] > 0).any()
    else:
        assert act.residual is None
    assert same_bits(act.operand, operand_oracle(x_q, residual))


def test_quantizer_zeros_and_nan(kernel_device):
    zeros = torch.zeros(2, 32, device=kernel_device, dtype=torch.bfloat16)
    act = rac.quantize_activation_triton(
        zeros, torch.ones(2, dtype=torch.bool, device=kernel_device), codes=True
    )
    assert (
        act.global_scale.item() == 1.0
        and (act.operand == 0).all()
        and (act.residual.data == 0).all()
    )
    x = torch.randn(3, 32, device=kernel_device)
    x[1, 20] = float("nan")
    act = rac.quantize_activation_triton(x, torch.ones(2, dtype=torch.bool, device=kernel_device))
    x_q, residual = rac.quantize_activation_reference(x.cpu(), torch.ones(2, dtype=torch.bool))
    assert act.global_scale.isnan().item() and x_q.global_scale.isnan().item()
    assert same_bits(act.operand, operand_oracle(x_q, residual))
    assert act.operand[:, 1, 8:].isnan().all()  # the NaN block (columns 16..31) stays NaN


@pytest.mark.parametrize("rows", [3, 16])  # 3 x 4096: narrow chunks; 16 x 4096: wide ones
def test_partial_max_finds_the_largest_value_in_every_chunk_of_a_slice(
    kernel_device, monkeypatch, rows
):
    # two slices, so that each program of the partial-max launch loops over several chunks
    monkeypatch.setattr(w4a4_quantize, "AMAX_SLICES", 2)
    numel = rows * 4096
    chunk = w4a4_quantize.partial_chunk(numel)
    assert chunk == (4 if rows == 16 else 1) * w4a4_quantize.AMAX_CHUNK
    torch.manual_seed(rows)
    base = torch.rand(numel) * 0.5
    # the first and last element, and the first and last of every chunk
    places = sorted(
        {0, numel - 1} | {c * chunk + e for c in range(numel // chunk) for e in (0, chunk - 1)}
    )
    for place in places:
        x = base.clone()
        x[place] = -3.0 if place % 2 else 3.0
        partials = w4a4_quantize.partial_amax(x.view(rows, 4096).to(kernel_device, torch.bfloat16))
        assert partials.numel() == 2 and partials.max().item() == 3.0, place
    # and the quantizer takes its global scale from them
    x = base.view(rows, 4096).to(kernel_device, torch.bfloat16)
    scale = rac.quantize_activation_triton(x).global_scale
    assert same_bits(scale, nvfp4.compute_global_scale(x.cpu().float()))


# ------------------------------------------------------------------------------ one scale per row
def rows_of_many_magnitudes(rows, cols, seed, dtype=torch.bfloat16):
    """Rows 10^-6 .. 10^6 apart in magnitude (each its own global scale), heavy-tailed columns, an
    all-zero row."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator) * torch.exp(
        torch.randn(cols, generator=generator)
    )
    x = x * torch.logspace(-6, 6, rows)[torch.randperm(rows, generator=generator)][:, None]
    if rows > 2:
        x[rows // 2] = 0.0
    return x.to(dtype)


def assert_row_quantization(got, x_q, rows):
    """A kernel's codes (NVFP4Tensor) equal the reference's bit for bit on `rows` (bool (M,))."""
    # (the reference's scale of a one-row activation is a scalar: nvfp4 resolves one scale so)
    assert same_bits(got.global_scale[rows], x_q.global_scale.reshape(-1)[rows])
    assert same_bits(got.data[rows], x_q.data[rows])
    assert same_bits(got.block_scale[rows], x_q.block_scale[rows])


@pytest.mark.parametrize("rows,cols", [(1, 16), (3, 48), (17, 80), (64, 768), (5, 4096)])
@pytest.mark.parametrize("compensate", [False, True])
def test_row_scale_quantizer_matches_the_row_reference_bit_for_bit(
    kernel_device, rows, cols, compensate
):
    # a program a row: G = 5 blocks pads its tile to 8, K = 4096 takes 256 blocks and 8 warps; rows
    # of very different magnitudes and an all-zero row, each quantized with its own scale as if
    # alone
    x = rows_of_many_magnitudes(rows, cols, rows * cols).to(kernel_device)
    mask = (torch.arange(cols // 16, device=kernel_device) % 2 == 0) if compensate else None
    act = rac.quantize_activation_triton(x, mask, codes=True, operand=True, act_scale="row")
    x_q, residual = nvfp4.quantize_activation(x.cpu(), None if mask is None else mask.cpu(), "row")
    assert act.global_scale.shape == (rows,)
    everywhere = torch.ones(rows, dtype=torch.bool)
    assert_row_quantization(act.x_q, x_q, everywhere)
    if compensate:
        assert_row_quantization(act.residual, residual, everywhere)
    assert same_bits(act.operand, operand_oracle(x_q, residual))
    if rows > 2:
        assert act.global_scale[rows // 2].item() == 1.0 and (act.operand[:, rows // 2] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_scale_quantizer_on_adversarial_rows(kernel_device, dtype):
    # grid ties, subnormal-scale values, -0.0, block scales near the E4M3 maximum, one outlier: bit
    # for bit on every finite row. A row holding NaN or Inf has a NaN scale (so every value of it
    # dequantizes to NaN, as with a per-tensor scale, whose kernel codes stand apart from the
    # reference's in the same way), and leaves the other rows alone
    x = _adversarial(dtype).to(kernel_device)
    finite = x.cpu().isfinite().all(dim=-1)
    mask = torch.arange(4, device=kernel_device) % 2 == 1
    act = rac.quantize_activation_triton(x, mask, codes=True, operand=True, act_scale="row")
    x_q, residual = nvfp4.quantize_activation(x.cpu(), mask.cpu(), "row")
    assert_row_quantization(act.x_q, x_q, finite)
    assert_row_quantization(act.residual, residual, finite)
    assert same_bits(act.operand[:, finite], operand_oracle(x_q, residual)[:, finite])
    assert act.global_scale[~finite].isnan().all() and x_q.global_scale[~finite].isnan().all()
    assert same_bits(act.x_q.data, x_q.data)  # a NaN row's codes too: magnitude 0, x's signs
    kernel_codes = nvfp4.NVFP4Tensor(
        act.x_q.data.cpu(), act.x_q.block_scale.cpu(), act.global_scale.cpu()
    )
    assert nvfp4.dequantize_reference(kernel_codes, torch.float32)[~finite].isnan().all()


def power_of_two_scale(x, dim=None):
    """The W4A16 operand's scale by its definition: the smallest power of two >= amax(|x|) / 2688
    (over x, or each row with dim=-1), at least 2^-126; 1.0 where x is all zero, NaN where it holds
    NaN or Inf."""
    x = x.float()
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim)
    bad = ~x.isfinite().all() if dim is None else ~x.isfinite().all(dim=dim)
    quotient = amax / torch.full_like(amax, 2688.0)
    mantissa, exponent = torch.frexp(quotient)  # quotient = mantissa * 2^exponent, [0.5, 1)
    scale = torch.ldexp(torch.ones_like(quotient), exponent - (mantissa == 0.5).int())
    scale = torch.maximum(scale, torch.full_like(scale, 2.0**-126))
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return torch.where(bad, torch.full_like(scale, float("nan")), scale)


@pytest.mark.parametrize("row_scale, amax_in_launch", [(False, True), (False, False), (True, True)])
def test_w4a16_operand_is_x_over_a_power_of_two_exactly(
    kernel_device, monkeypatch, row_scale, amax_in_launch
):
    # bf16 x: x * 2^-6 / g is exact in fp16 (the oracle rounds the float64 quotient once); g the
    # smallest power of two >= amax / 2688, exactly amax / 2688 where that is a power of two (row 1:
    # amax 336 = 2688 / 8), the next one up just above it (row 2), 2^-126 for a row of
    # fp32-subnormal-scale amax (row 3: bf16 keeps it)
    if not amax_in_launch:
        # the tensor's amax from the partial-max launch
        monkeypatch.setattr(w4a4_quantize, "AMAX_IN_LAUNCH", 0)
    x = rows_of_many_magnitudes(9, 96, 9).float()
    x[1:3] = x[1:3].clamp(-300, 300)
    x[1, 5], x[2, 7] = -336.0, 338.0
    x[3] = torch.randn(96) * 2.0**-125
    # below fp16's range relative to the row: +-0
    x[4, :4] = torch.tensor([1e-30, -1e-30, 0.0, -0.0])
    x = x.to(kernel_device, torch.bfloat16)
    _, _, _, _, operand, scale = w4a4_quantize.quantize_activation(
        x, row_scale=row_scale, quantize=False
    )
    expected = power_of_two_scale(x.cpu(), dim=-1 if row_scale else None)
    assert same_bits(scale, expected)
    if row_scale:
        assert (
            scale[1].item() == 2.0**-3
            and scale[2].item() == 2.0**-2
            and scale[3].item() == 2.0**-126
        )
    g = expected[:, None] if row_scale else expected
    exact = (x.cpu().double() * 2.0**-6 / g.double()).half()
    assert same_bits(operand, torch.stack((exact[:, 0::2], exact[:, 1::2])))


def test_w4a16_scale_of_zero_and_non_finite_inputs(kernel_device):
    x = torch.zeros(4, 32, device=kernel_device, dtype=torch.bfloat16)
    x[1, 3], x[2, 30] = float("nan"), float("-inf")
    _, _, _, _, operand, scale = w4a4_quantize.quantize_activation(
        x, row_scale=True, quantize=False
    )
    assert scale.tolist()[0] == 1.0 and scale.tolist()[3] == 1.0 and scale[1:3].isnan().all()
    assert (operand[:, [0, 3]] == 0).all() and operand[:, 1:3].isnan().all()
    _, _, _, _, operand, scale = w4a4_quantize.quantize_activation(x, quantize=False)
    assert scale.isnan() and operand.isnan().all()


@pytest.mark.parametrize("codes, with_mask", [(True, False), (False, True)])
def test_w4a16_operand_takes_no_codes_or_rac_mask(kernel_device, codes, with_mask):
    x = torch.randn(2, 32, device=kernel_device)
    mask = torch.ones(2, dtype=torch.bool, device=kernel_device) if with_mask else None
    raises_one_line(
        lambda: w4a4_quantize.quantize_activation(x, mask, codes=codes, quantize=False),
        "codes or rac_mask",
        "quantize=False",
    )


# ------------------------------------------------------------------------------ compiled for sm_90
def compiled_output(script):
    """Run a compile-only script in a fresh Python with the interpreter off (Triton compiles for a
    GPU it does not have, with its own ptxas) -> its stdout lines."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()


COMPILE_PREAMBLE = r"""
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from gpu_kernels import w4a4_blackwell, w4a4_dense, w4a4_experts, w4a4_quantize
def jit(kernel):
    while not isinstance(kernel, triton.runtime.jit.JITFunction):  # through autotune and heuristics
        kernel = kernel.fn
    return kernel
i = "i32"
"""


_COMPILE_FOR_SM90 = (
    COMPILE_PREAMBLE
    + r"""
kernel = jit(w4a4_quantize.quantize_activation_kernel)
types = ["*bf16", "*i32", "*u8", "*fp32", "*fp32", "*u8", "*u8", "*u8", "*u8", "*fp16"] + [i] * 5
for gpu in (True, False):
    for row_scale in (False, True):
        for quantize in (True, False):  # W4A4, and the W4A16 operand (no codes, no residual)
            c = dict(AMAX_HERE=True, HAS_RESIDUAL=quantize, X_BF16=True, WRITE_CODES=quantize,
                     WRITE_OPERAND=True, BLOCKS=32, CHUNK=4096, PARTIALS=1, GPU=gpu,
                     ROW_SCALE=row_scale, QUANTIZE=quantize)
            signature = dict(zip([n for n in kernel.arg_names if n not in c], types))
            signature.update({n: "constexpr" for n in c})
            compiled = compile(ASTSource(kernel, signature, c), target=GPUTarget("cuda", 90, 32))
            ptx = compiled.asm["ptx"]
            name = "quantizer" + "_row" * row_scale + "_w4a16" * (not quantize)
            print(name, gpu, len(re.findall(r"\bmul\.rn\.f32\b", ptx)))
"""
)


def test_compiled_quantizer_rounds_the_residuals_product_on_its_own():
    # What the interpreter cannot show: compiled for the GPU, x - DQ(x_q) would become one FMA,
    # skipping the product's fp32 rounding the reference makes (seen on the H200 as residual codes
    # unlike the reference's). The quantizer must hold the never-fused mul.rn.f32 (not in its
    # interpreter build, GPU=False: the count is of the residual's products, not of something else),
    # with one global scale or one per row. The W4A16 operand (no residual) compiles too, and holds
    # none.
    lines = compiled_output(_COMPILE_FOR_SM90)
    counts = {(name, gpu): int(n) for name, gpu, n in (line.split() for line in lines)}
    names = [
        prefix + suffix for prefix in ("quantizer", "quantizer_row") for suffix in ("", "_w4a16")
    ]
    assert set(counts) == {(name, gpu) for name in names for gpu in ("True", "False")}
    for name in names:
        if name.endswith("w4a16"):
            assert counts[name, "True"] == 0, counts
        else:
            assert counts[name, "True"] > 0, counts
        assert counts[name, "False"] == 0, counts
