"""gpu_kernels/w4a4_quantize.py: the activation quantizer against rac.quantize_activation_reference (codes) and
the definition of the Hopper GEMMs' fp16 operand, bit for bit (CPU under TRITON_INTERPRET=1, GPU natively);
the partial max; the residual's product rounded on its own when compiled for sm_90 on the CPU."""
import os
import subprocess
import sys

import pytest
import torch
from conftest import same_bits

import nvfp4
import rac

pytest.importorskip("triton")  # the kernels need it; a wrong name below must fail, not skip
from gpu_kernels import w4a4_quantize  # noqa: E402


def operand_oracle(x_q, residual=None):
    """The Hopper GEMMs' fp16 operand, by its definition: (code value * block scale of x, plus the residual's)
    * 2^-6 in float64, rounded once to fp16, as planes (2, M, K/2) of the even and the odd columns."""
    def values(q):
        codes = nvfp4.unpack_codes(q.data.cpu())
        magnitude = torch.tensor(nvfp4.E2M1_VALUES, dtype=torch.float64)[(codes & 7).long()]
        signed = torch.where(codes >= 8, -magnitude, magnitude)
        return (signed.view(*codes.shape[:-1], -1, 16) * q.block_scale.cpu().double()[..., None]).flatten(-2)
    exact = values(x_q) if residual is None else values(x_q) + values(residual)  # (-0.0 stays -0.0)
    return (torch.stack((exact[:, 0::2], exact[:, 1::2])) * 2.0 ** -6).half()


@pytest.mark.parametrize("rows,cols", [(1, 16), (3, 48), (17, 80), (64, 768)])
@pytest.mark.parametrize("compensate", [False, True])
def test_quantizer_matches_its_reference_bit_for_bit(kernel_device, rows, cols, compensate):
    # (64, 768) has 49152 elements: above AMAX_IN_LAUNCH, so its amax comes from the partial-max launch
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
    act = rac.quantize_activation_triton(zeros, torch.ones(2, dtype=torch.bool, device=kernel_device),
                                         codes=True)
    assert act.global_scale.item() == 1.0 and (act.operand == 0).all() and (act.residual.data == 0).all()
    x = torch.randn(3, 32, device=kernel_device)
    x[1, 20] = float("nan")
    act = rac.quantize_activation_triton(x, torch.ones(2, dtype=torch.bool, device=kernel_device))
    x_q, residual = rac.quantize_activation_reference(x.cpu(), torch.ones(2, dtype=torch.bool))
    assert act.global_scale.isnan().item() and x_q.global_scale.isnan().item()
    assert same_bits(act.operand, operand_oracle(x_q, residual))
    assert act.operand[:, 1, 8:].isnan().all()  # the NaN block (columns 16..31) stays NaN


@pytest.mark.parametrize("rows", [3, 16])  # 3 x 4096: narrow chunks; 16 x 4096: wide ones
def test_partial_max_finds_the_largest_value_in_every_chunk_of_a_slice(kernel_device, monkeypatch, rows):
    # two slices, so that each program of the partial-max launch loops over several chunks
    monkeypatch.setattr(w4a4_quantize, "_AMAX_SLICES", 2)
    numel = rows * 4096
    chunk = w4a4_quantize._partial_chunk(numel)
    assert chunk == (4 if rows == 16 else 1) * w4a4_quantize._AMAX_CHUNK
    torch.manual_seed(rows)
    base = torch.rand(numel) * 0.5
    # the first and last element, and the first and last of every chunk
    places = sorted({0, numel - 1} | {c * chunk + e for c in range(numel // chunk) for e in (0, chunk - 1)})
    for place in places:
        x = base.clone()
        x[place] = -3.0 if place % 2 else 3.0
        partials = w4a4_quantize._partial_amax(x.view(rows, 4096).to(kernel_device, torch.bfloat16))
        assert partials.numel() == 2 and partials.max().item() == 3.0, place
    # and the quantizer takes its global scale from them
    x = base.view(rows, 4096).to(kernel_device, torch.bfloat16)
    scale = rac.quantize_activation_triton(x).global_scale
    assert same_bits(scale, nvfp4.compute_global_scale(x.cpu().float()))


# ------------------------------------------------------------------------------ compiled for sm_90
def compiled_output(script):
    """Run a compile-only script in a fresh Python with the interpreter off (Triton compiles for a GPU it
    does not have, with its own ptxas) -> its stdout lines."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                            timeout=300)
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


_COMPILE_FOR_SM90 = COMPILE_PREAMBLE + r"""
kernel = jit(w4a4_quantize._quantize_activation_kernel)
types = ["*bf16", "*i32", "*u8", "*fp32", "*fp32", "*u8", "*u8", "*u8", "*u8", "*fp16"] + [i] * 5
for gpu in (True, False):
    c = dict(AMAX_HERE=True, HAS_RESIDUAL=True, X_BF16=True, WRITE_CODES=True, WRITE_OPERAND=True, BLOCKS=32,
             CHUNK=4096, PARTIALS=1, GPU=gpu)
    signature = dict(zip([n for n in kernel.arg_names if n not in c], types))
    signature.update({n: "constexpr" for n in c})
    ptx = compile(ASTSource(kernel, signature, c), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    print("quantizer", gpu, len(re.findall(r"\bmul\.rn\.f32\b", ptx)))
"""


def test_compiled_quantizer_rounds_the_residuals_product_on_its_own():
    # What the interpreter cannot show: compiled for the GPU, x - DQ(x_q) would become one FMA, skipping
    # the product's fp32 rounding the reference makes (seen on the H200 as residual codes unlike the
    # reference's). The quantizer must hold the never-fused mul.rn.f32 (not in its interpreter build,
    # GPU=False: the count is of the residual's products, not of something else).
    lines = compiled_output(_COMPILE_FOR_SM90)
    counts = {(name, gpu): int(n) for name, gpu, n in (line.split() for line in lines)}
    assert set(counts) == {("quantizer", "True"), ("quantizer", "False")}
    assert counts["quantizer", "True"] > 0 and counts["quantizer", "False"] == 0, counts
