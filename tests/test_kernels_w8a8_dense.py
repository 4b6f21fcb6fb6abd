"""gpu_kernels/w8a8_dense.py: the FP8 dense GEMM (codes, fused quantization, split-K) against
fp8.linear_reference (CPU under TRITON_INTERPRET=1, GPU natively); compiled for sm_90 on the CPU it
uses FP8 tensor cores; one-line input errors; on the GPU every configuration forced in turn. Also
the helpers the experts' GEMM tests share (assert_close_to_reference, fp8_weight)."""

import pytest
import torch
from conftest import raises_one_line, report_diff, same_bits
from test_kernels_w4a4_dense import deterministic_and_close
from test_kernels_w8a8_quantize import FP8_COMPILE_PREAMBLE, compiled_counts

import fp8

pytest.importorskip("triton")  # the kernels need it; a wrong name below must fail, not skip
from gpu_kernels import gemm_common, w8a8_dense, w8a8_quantize  # noqa: E402

BF16_ULP = 2.0**-7  # a BF16 value's unit in the last place is at most this much of its magnitude
# Hopper's FP8 MMA sums PROMOTE_K products in fewer bits than fp32 before they join the fp32
# accumulator (about 14 bits, as reported for the H800): larger differences than fp32 order alone,
# still far below a BF16 rounding
GPU_TOLERANCE = 3e-4


def assert_close_to_reference(y, reference, name, fp32_pair=None, tolerance=1e-5):
    """The kernel's BF16 output against the reference's, element by element: the two fp32 sums
    differ in accumulation order only (by at most `tolerance` of the largest magnitude, checked on
    the unrounded pair (kernel fp32 output, reference fp32) when given), and rounding each to BF16
    adds at most one ulp (2^-7 of the value). On a GPU the fp32 sums are only as close as Hopper's
    FP8 MMA allows (GPU_TOLERANCE), whatever `tolerance` the interpreter's sums are held to."""
    if y.is_cuda:
        tolerance = max(tolerance, GPU_TOLERANCE)
    reference = reference.float()
    slack = tolerance * reference.abs().max().item()
    max_diff, _ = report_diff(y.float(), reference, name)
    within = (y.float() - reference).abs() <= BF16_ULP * reference.abs() + slack
    assert within.all(), f"{name}: {max_diff:.3e}"
    if fp32_pair is not None:
        fp32_y, fp32_reference = fp32_pair
        fp32_diff = report_diff(fp32_y, fp32_reference, f"{name} fp32")[0]
        assert fp32_diff <= tolerance * fp32_reference.abs().max().item()


def dequantized_product(x_codes, x_scale, w_codes, w_scale):
    """linear_reference before its BF16 rounding."""
    return (x_codes.float() * x_scale) @ (w_codes.float() * w_scale[:, None]).T


# ------------------------------------------------------------------ the dense GEMM
def _dense_case(M, K, N, device, seed):
    torch.manual_seed(seed)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16) * 4
    w_codes, w_scale = fp8.quantize_weight(torch.randn(N, K, device=device) * 0.05)
    return x, w_codes, w_scale


@pytest.mark.parametrize(
    "M,K,N", [(1, 64, 40), (3, 96, 33), (3, 40, 16), (17, 64, 40), (17, 96, 33), (70, 40, 16)]
)
def test_dense_gemm_matches_the_reference_with_and_without_fused_quantization(
    kernel_device, M, K, N
):
    # M = 1, 3, 17: the interpreter's split-K buckets; 70: the next bucket (no split). K = 96 and
    # 40: masked last K steps (the interpreter's BLOCK_K is 64); N = 33: a short last N tile
    x, w_codes, w_scale = _dense_case(M, K, N, kernel_device, M + K + N)
    x_codes, x_scale = fp8.quantize_rowwise(x)
    reference = fp8.linear_reference(x_codes, x_scale, w_codes, w_scale)
    unrounded = dequantized_product(x_codes, x_scale, w_codes, w_scale)
    outputs = {}
    for fused in (False, True):
        y = w8a8_dense.linear(x, w_codes, w_scale, fused=fused)
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        y32 = outputs[fused] = w8a8_dense.linear(
            x, w_codes, w_scale, fused=fused, out_dtype=torch.float32
        )
        assert_close_to_reference(
            y, reference, f"dense M={M} K={K} N={N} fused={fused}", (y32, unrounded)
        )
    # the fused GEMM quantizes x exactly as the quantizer does: the same codes, the same sums
    # (same configuration)
    assert torch.equal(outputs[False], outputs[True])
    codes_path = w8a8_dense.linear_codes(
        *w8a8_quantize.quantize_rows(x), w_codes, w_scale, out_dtype=torch.float32
    )
    assert torch.equal(codes_path, outputs[False])


def test_split_k_counters_are_reset_so_repeated_calls_agree(kernel_device):
    # the interpreter's decode bucket: 2 splits
    x, w_codes, w_scale = _dense_case(3, 256, 72, kernel_device, 3)
    first = w8a8_dense.linear(x, w_codes, w_scale, fused=False, out_dtype=torch.float32)
    assert (w8a8_dense.SPLIT_COUNTERS[x.device] == 0).all()
    again = w8a8_dense.linear(x, w_codes, w_scale, fused=False, out_dtype=torch.float32)
    assert torch.equal(again, first)


# ------------------------------------------------------------------ input checks
def fp8_weight(N=8, K=32, E=None):
    shape = (N, K) if E is None else (E, N, K)
    return fp8.quantize_weight(torch.randn(*shape))


BAD_CALLS = [  # (id, call, what the message names, the problem it states)
    (
        "x dims",
        lambda: w8a8_dense.linear(torch.ones(2, 3, 32), *fp8_weight()),
        "x must be a 2-D",
        "(2, 3, 32)",
    ),
    (
        "K",
        lambda: w8a8_dense.linear(torch.ones(2, 16), *fp8_weight()),
        "w_codes has K=32",
        "activation K=16",
    ),
    (
        "w dtype",
        lambda: w8a8_dense.linear(torch.ones(2, 32), torch.ones(8, 32), fp8_weight()[1]),
        "w_codes must be",
        "torch.float32",
    ),
    (
        "w_scale",
        lambda: w8a8_dense.linear(torch.ones(2, 32), fp8_weight()[0], torch.ones(8, 1)),
        "w_scale must be",
        "of shape (8,)",
    ),
    (
        "x_scale",
        lambda: w8a8_dense.linear_codes(
            *fp8.quantize_rowwise(torch.ones(2, 32))[:1], torch.ones(3, 1), *fp8_weight()
        ),
        "x_scale must be 2",
        "(3, 1)",
    ),
    (
        "out dtype",
        lambda: w8a8_dense.linear(torch.ones(2, 32), *fp8_weight(), out_dtype=torch.int8),
        "out_dtype",
        "torch.int8",
    ),
]


@pytest.mark.parametrize(
    "call, names, problem", [case[1:] for case in BAD_CALLS], ids=[case[0] for case in BAD_CALLS]
)
def test_bad_input_raises_one_line_naming_the_argument_and_the_problem(call, names, problem):
    raises_one_line(call, names, problem)


# ------------------------------------------------------------------ compiled for sm_90 (no GPU)
def test_dense_kernel_compiles_for_sm90_to_fp8_tensor_core_instructions():
    # What the interpreter cannot show: on Hopper the products run on the FP8 wgmma (weight rows on
    # its 64-row side, 16 token rows on its narrow one), and the fused GEMM quantizes x with IEEE
    # division (div.rn, as torch divides) and the hardware's nearest-even E4M3 conversion, which the
    # GEMM on stored codes has no use for
    found = compiled_counts(
        FP8_COMPILE_PREAMBLE
        + r"""
for fused in (False, True):
    c = dict(FUSED=fused, OUT_BF16=True, GPU=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=2,
             BUCKET=16, EVEN_K=True)
    counts("dense", fused, jit(w8a8_dense.dense_kernel),
           ["*bf16" if fused else p8, "*fp32", p8, "*fp32", "*i16", "*fp32", "*i32"] + [i] * 7, c)
"""
    )
    assert set(found) == {("dense", "False"), ("dense", "True")}, found
    assert all(mma > 0 for mma, _, _ in found.values()), found
    _, cvt, div = found["dense", "True"]
    assert cvt > 0 and div > 0, found
    assert found["dense", "False"][1:] == (0, 0), found


# ------------------------------------------------------------------ GPU
@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 16, 64, 256, 1024, 4096])
@pytest.mark.parametrize("N,K", [(4096, 2048), (512, 2048), (2048, 4096), (200, 96)])
def test_dense_gemm_matches_the_reference_on_gpu_shapes(M, N, K):
    x, w_codes, w_scale = _dense_case(M, K, N, "cuda", 0)
    x_codes, x_scale = fp8.quantize_rowwise(x)
    codes, scale = w8a8_quantize.quantize_rows(x)
    assert same_bits(codes, x_codes) and same_bits(scale, x_scale)
    reference = fp8.linear_reference(x_codes, x_scale, w_codes, w_scale)
    unrounded = dequantized_product(x_codes, x_scale, w_codes, w_scale)
    for fused in (False, True):
        y32 = w8a8_dense.linear(x, w_codes, w_scale, fused=fused, out_dtype=torch.float32)
        assert_close_to_reference(
            w8a8_dense.linear(x, w_codes, w_scale, fused=fused),
            reference,
            f"gpu dense M={M} N={N} K={K} fused={fused}",
            (y32, unrounded),
            GPU_TOLERANCE,
        )


@pytest.mark.cuda
def test_every_gpu_config_is_deterministic_and_matches_the_reference():
    # autotuning may pick any configuration: each one is forced and repeated, at each bucket
    torch.manual_seed(0)
    calls = {}
    w_codes, w_scale = fp8.quantize_weight(torch.randn(1024, 512, device="cuda") * 0.05)
    for rows in (2, 64, 256, 2048):
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
        reference = dequantized_product(*fp8.quantize_rowwise(x), w_codes, w_scale)
        for fused in (False, True):
            calls[f"dense M={rows} fused={fused}"] = (
                w8a8_dense.dense_kernel,
                gemm_common.m_bucket(rows, w8a8_dense.DENSE_CONFIGS),
                lambda c: False,
                lambda x=x, fused=fused: w8a8_dense.linear(
                    x, w_codes, w_scale, fused=fused, out_dtype=torch.float32
                ),
                reference,
            )
    failures = deterministic_and_close(calls)
    assert not failures, "\n".join(failures)
