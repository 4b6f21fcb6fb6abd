"""gpu_kernels/w8a8.py: the FP8 quantizer bit for bit against fp8.quantize_rowwise, the dense GEMM
(codes, fused quantization, split-K) against fp8.linear_reference, the experts' grouped GEMM
(gather + SwiGLU, router weights through routing.order, empty experts) against
fp8.grouped_linear_reference (CPU under TRITON_INTERPRET=1, GPU natively); the kernels compiled for
sm_90 on the CPU use FP8 tensor cores; one-line input errors; on the GPU every configuration forced
in turn."""

import pytest
import torch
from conftest import raises_one_line, report_diff, same_bits
from test_kernels_w4a4_dense import deterministic_and_close
from test_kernels_w4a4_experts import routing_with_empty_experts
from test_kernels_w4a4_quantize import COMPILE_PREAMBLE, compiled_output

import fp8
import moe

pytest.importorskip("triton")  # the kernels need it; a wrong name below must fail, not skip
from gpu_kernels import gemm_common, w8a8  # noqa: E402

BF16_ULP = 2.0**-7  # a BF16 value's unit in the last place is at most this much of its magnitude
# Hopper's FP8 MMA sums PROMOTE_K products in fewer bits than fp32 before they join the fp32
# accumulator (about 14 bits, as reported for the H800): larger differences than fp32 order alone,
# still far below a BF16 rounding
GPU_TOLERANCE = 3e-4


def assert_close_to_reference(y, reference, name, fp32_pair=None, tolerance=1e-5):
    """The kernel's BF16 output against the reference's, element by element: the two fp32 sums
    differ in accumulation order only (by at most `tolerance` of the largest magnitude, checked on
    the unrounded pair (kernel fp32 output, reference fp32) when given), and rounding each to BF16
    adds at most one ulp (2^-7 of the value)."""
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
    codes, scale = w8a8.quantize_rows(x)
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
        codes, scale = w8a8.quantize_rows(source)
        expected_codes, expected_scale = fp8.quantize_rowwise(source)
        assert same_bits(scale, expected_scale) and same_bits(codes, expected_codes)
    assert w8a8.quantize_rows(x[:0])[0].shape == (0, 64)


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
        y = w8a8.linear(x, w_codes, w_scale, fused=fused)
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        y32 = outputs[fused] = w8a8.linear(
            x, w_codes, w_scale, fused=fused, out_dtype=torch.float32
        )
        assert_close_to_reference(
            y, reference, f"dense M={M} K={K} N={N} fused={fused}", (y32, unrounded)
        )
    # the fused GEMM quantizes x exactly as the quantizer does: the same codes, the same sums
    # (same configuration)
    assert torch.equal(outputs[False], outputs[True])
    codes_path = w8a8.linear_codes(
        *w8a8.quantize_rows(x), w_codes, w_scale, out_dtype=torch.float32
    )
    assert torch.equal(codes_path, outputs[False])


def test_split_k_counters_are_reset_so_repeated_calls_agree(kernel_device):
    # the interpreter's decode bucket: 2 splits
    x, w_codes, w_scale = _dense_case(3, 256, 72, kernel_device, 3)
    first = w8a8.linear(x, w_codes, w_scale, fused=False, out_dtype=torch.float32)
    assert (w8a8.SPLIT_COUNTERS[x.device] == 0).all()
    again = w8a8.linear(x, w_codes, w_scale, fused=False, out_dtype=torch.float32)
    assert torch.equal(again, first)


# ------------------------------------------------------------------ the experts' grouped GEMM
@pytest.mark.parametrize("tokens, D", [(3, 80), (21, 64)])
def test_grouped_gemm_matches_the_per_expert_reference(kernel_device, tokens, D):
    # 21 tokens x 2 on 4 used experts: some experts get more rows than one 16-row tile. D = 80: the
    # down GEMM's output is 3 of the interpreter's 32-column tiles, the last one short, and the
    # gate/up K steps are masked
    E, I, A = 7, 32, 2
    expert_ids, routing = routing_with_empty_experts(E, tokens, A, kernel_device, seed=tokens)
    assert (routing.counts[[0, 2, E - 1]] == 0).all()
    torch.manual_seed(tokens)
    x = torch.randn(tokens, D, device=kernel_device, dtype=torch.bfloat16)
    gate_up = fp8.quantize_weight(torch.randn(E, 2 * I, D, device=kernel_device) * 0.1)
    x_codes, x_scale = w8a8.quantize_rows(x)
    reference = fp8.grouped_linear_reference(
        x_codes[routing.token_ids],
        x_scale[routing.token_ids],
        routing.counts,
        *gate_up,
        swiglu=True,
    )
    hidden = w8a8.grouped_linear(
        x_codes, x_scale, *gate_up, routing.counts, row_ids=routing.token_ids, swiglu=True
    )
    assert hidden.shape == (tokens * A, I) and hidden.dtype == torch.bfloat16
    assert_close_to_reference(hidden, reference, "grouped gate/up + swiglu")

    h_codes, h_scale = w8a8.quantize_rows(reference)
    down = fp8.quantize_weight(torch.randn(E, D, I, device=kernel_device) * 0.1)
    expert_weights = torch.rand(tokens, A, device=kernel_device).reshape(-1)  # in assignment order
    y = w8a8.grouped_linear(
        h_codes,
        h_scale,
        *down,
        routing.counts,
        row_weights=expert_weights,
        row_weight_ids=routing.order,
    )
    reference = fp8.grouped_linear_reference(
        h_codes, h_scale, routing.counts, *down, row_weights=expert_weights[routing.order]
    )
    assert_close_to_reference(y, reference, "grouped down * router weight")
    # the router weights read through routing.order equal the same weights gathered by hand
    gathered = w8a8.grouped_linear(
        h_codes, h_scale, *down, routing.counts, row_weights=expert_weights[routing.order]
    )
    assert torch.equal(y, gathered)


def test_grouped_gemm_with_no_rows_gives_an_empty_output(kernel_device):
    codes, scale = w8a8.quantize_rows(torch.zeros(0, 32, device=kernel_device))
    w = fp8.quantize_weight(torch.randn(2, 32, 32, device=kernel_device))
    y = w8a8.grouped_linear(
        codes, scale, *w, torch.zeros(2, dtype=torch.int64, device=kernel_device), swiglu=True
    )
    assert y.shape == (0, 16)


# ------------------------------------------------------------------ input checks
def _weight(N=8, K=32, E=None):
    shape = (N, K) if E is None else (E, N, K)
    return fp8.quantize_weight(torch.randn(*shape))


BAD_CALLS = [  # (id, call, what the message names, the problem it states)
    (
        "x dtype",
        lambda: w8a8.quantize_rows(torch.ones(2, 32, dtype=torch.int32)),
        "x must be a 2-D",
        "torch.int32",
    ),
    (
        "x dims",
        lambda: w8a8.linear(torch.ones(2, 3, 32), *_weight()),
        "x must be a 2-D",
        "(2, 3, 32)",
    ),
    (
        "K",
        lambda: w8a8.linear(torch.ones(2, 16), *_weight()),
        "w_codes has K=32",
        "activation K=16",
    ),
    (
        "w dtype",
        lambda: w8a8.linear(torch.ones(2, 32), torch.ones(8, 32), _weight()[1]),
        "w_codes must be",
        "torch.float32",
    ),
    (
        "w_scale",
        lambda: w8a8.linear(torch.ones(2, 32), _weight()[0], torch.ones(8, 1)),
        "w_scale must be",
        "of shape (8,)",
    ),
    (
        "x_scale",
        lambda: w8a8.linear_codes(
            *fp8.quantize_rowwise(torch.ones(2, 32))[:1], torch.ones(3, 1), *_weight()
        ),
        "x_scale must be 2",
        "(3, 1)",
    ),
    (
        "out dtype",
        lambda: w8a8.linear(torch.ones(2, 32), *_weight(), out_dtype=torch.int8),
        "out_dtype",
        "torch.int8",
    ),
    (
        "counts",
        lambda: w8a8.grouped_linear(
            *fp8.quantize_rowwise(torch.ones(2, 32)),
            *_weight(E=3),
            torch.ones(2, dtype=torch.int64),
        ),
        "counts must be",
        "shape (3,)",
    ),
    (
        "row weights",
        lambda: w8a8.grouped_linear(
            *fp8.quantize_rowwise(torch.ones(2, 32)),
            *_weight(E=3),
            torch.tensor([2, 0, 0]),
            row_weights=torch.ones(3),
        ),
        "row_weights must hold one weight per row (2,)",
        "got (3,)",
    ),
]


@pytest.mark.parametrize(
    "call, names, problem", [case[1:] for case in BAD_CALLS], ids=[case[0] for case in BAD_CALLS]
)
def test_bad_input_raises_one_line_naming_the_argument_and_the_problem(call, names, problem):
    raises_one_line(call, names, problem)


# ------------------------------------------------------------------ compiled for sm_90 (no GPU)
_COMPILE_FOR_SM90 = (
    COMPILE_PREAMBLE
    + r"""
from gpu_kernels import w8a8
p8 = "*fp8e4nv"
def counts(name, variant, kernel, types, c, warps=4, stages=3):
    signature = dict(zip([a for a in kernel.arg_names if a not in c], types))
    signature.update({a: "constexpr" for a in c})
    ptx = compile(ASTSource(kernel, signature, c), target=GPUTarget("cuda", 90, 32),
                  options=dict(num_warps=warps, num_stages=stages)).asm["ptx"]
    mma = len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n16k32\.f32\.e4m3\.e4m3", ptx))
    cvt = len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx))
    print(name, variant, mma, cvt, len(re.findall(r"\bdiv\.rn\.f32\b", ptx)))
counts("quantizer", True, jit(w8a8.quantize_kernel), ["*bf16", p8, "*fp32"] + [i] * 4,
       dict(ROWS=1, BLOCK_K=2048, GPU=True))
for fused in (False, True):
    c = dict(FUSED=fused, OUT_BF16=True, GPU=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=2,
             BUCKET=16, EVEN_K=True)
    counts("dense", fused, jit(w8a8.dense_kernel),
           ["*bf16" if fused else p8, "*fp32", p8, "*fp32", "*i16", "*fp32", "*i32"] + [i] * 7, c)
c = dict(GATHER=True, ROW_WEIGHTS=False, WEIGHT_IDS=False, SWIGLU=True, OUT_BF16=True, GPU=True,
         E_POW2=128, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, BUCKET=4, EVEN_K=True)
counts("grouped", True, jit(w8a8.grouped_kernel),
       [p8, "*fp32", "*i64", "*fp32", "*i64", p8, "*fp32", "*i64", "*i16"] + [i] * 9, c)
"""
)


def test_kernels_compile_for_sm90_to_fp8_tensor_core_instructions():
    # What the interpreter cannot show: on Hopper the products run on the FP8 wgmma (weight rows on
    # its 64-row side, 16 token rows on its narrow one), and x is quantized with IEEE division
    # (div.rn, as torch divides) and the hardware's nearest-even E4M3 conversion: by the quantizer,
    # and by the fused GEMM, which the GEMM on stored codes has no use for
    found = {
        (name, variant): tuple(map(int, numbers))
        for name, variant, *numbers in (line.split() for line in compiled_output(_COMPILE_FOR_SM90))
    }
    assert set(found) == {
        ("quantizer", "True"),
        ("dense", "False"),
        ("dense", "True"),
        ("grouped", "True"),
    }, found
    assert all(mma > 0 for (name, _), (mma, _, _) in found.items() if name != "quantizer"), found
    assert all(
        cvt > 0 and div > 0
        for key, (_, cvt, div) in found.items()
        if key in (("quantizer", "True"), ("dense", "True"))
    ), found
    assert found["dense", "False"][1:] == (0, 0) and found["grouped", "True"][1:] == (0, 0), found


# ------------------------------------------------------------------ GPU
@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 16, 64, 256, 1024, 4096])
@pytest.mark.parametrize("N,K", [(4096, 2048), (512, 2048), (2048, 4096), (200, 96)])
def test_dense_gemm_matches_the_reference_on_gpu_shapes(M, N, K):
    x, w_codes, w_scale = _dense_case(M, K, N, "cuda", 0)
    x_codes, x_scale = fp8.quantize_rowwise(x)
    codes, scale = w8a8.quantize_rows(x)
    assert same_bits(codes, x_codes) and same_bits(scale, x_scale)
    reference = fp8.linear_reference(x_codes, x_scale, w_codes, w_scale)
    unrounded = dequantized_product(x_codes, x_scale, w_codes, w_scale)
    for fused in (False, True):
        y32 = w8a8.linear(x, w_codes, w_scale, fused=fused, out_dtype=torch.float32)
        assert_close_to_reference(
            w8a8.linear(x, w_codes, w_scale, fused=fused),
            reference,
            f"gpu dense M={M} N={N} K={K} fused={fused}",
            (y32, unrounded),
            GPU_TOLERANCE,
        )


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [64, 256, 4096])
def test_grouped_gemm_matches_the_reference_on_gpu_shapes(tokens):
    E, D, I, A = 128, 2048, 768, 8
    torch.manual_seed(tokens)
    expert_ids = torch.rand(tokens, E, device="cuda").topk(A, dim=-1).indices
    routing = moe.route_tokens(expert_ids, E)
    x = torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16)
    gate_up = fp8.quantize_weight(torch.randn(E, 2 * I, D, device="cuda") * 0.02)
    down = fp8.quantize_weight(torch.randn(E, D, I, device="cuda") * 0.02)
    x_codes, x_scale = w8a8.quantize_rows(x)
    hidden = w8a8.grouped_linear(
        x_codes, x_scale, *gate_up, routing.counts, row_ids=routing.token_ids, swiglu=True
    )
    reference = fp8.grouped_linear_reference(
        x_codes[routing.token_ids],
        x_scale[routing.token_ids],
        routing.counts,
        *gate_up,
        swiglu=True,
    )
    assert_close_to_reference(
        hidden, reference, f"gpu grouped gate/up T={tokens}", tolerance=GPU_TOLERANCE
    )
    weights = torch.rand(tokens * A, device="cuda")
    h_codes, h_scale = w8a8.quantize_rows(reference)
    y = w8a8.grouped_linear(
        h_codes, h_scale, *down, routing.counts, row_weights=weights, row_weight_ids=routing.order
    )
    reference = fp8.grouped_linear_reference(
        h_codes, h_scale, routing.counts, *down, row_weights=weights[routing.order]
    )
    assert_close_to_reference(y, reference, f"gpu grouped down T={tokens}", tolerance=GPU_TOLERANCE)


@pytest.mark.cuda
def test_every_gpu_config_is_deterministic_and_matches_the_reference():
    # autotuning may pick any configuration: each one is forced and repeated, at each bucket of both
    # kernels
    torch.manual_seed(0)
    calls = {}
    w_codes, w_scale = fp8.quantize_weight(torch.randn(1024, 512, device="cuda") * 0.05)
    for rows in (2, 64, 256, 2048):
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
        reference = dequantized_product(*fp8.quantize_rowwise(x), w_codes, w_scale)
        for fused in (False, True):
            calls[f"dense M={rows} fused={fused}"] = (
                w8a8.dense_kernel,
                gemm_common.m_bucket(rows, w8a8.DENSE_CONFIGS),
                lambda c: False,
                lambda x=x, fused=fused: w8a8.linear(
                    x, w_codes, w_scale, fused=fused, out_dtype=torch.float32
                ),
                reference,
            )
    E, D, I, A = 16, 512, 256, 4
    gate_up = fp8.quantize_weight(torch.randn(E, 2 * I, D, device="cuda") * 0.05)
    for tokens in (16, 64, 256, 2048):
        routing = moe.route_tokens(torch.rand(tokens, E, device="cuda").topk(A, dim=-1).indices, E)
        x_codes, x_scale = w8a8.quantize_rows(
            torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16)
        )
        reference = fp8.grouped_linear_reference(
            x_codes[routing.token_ids],
            x_scale[routing.token_ids],
            routing.counts,
            *gate_up,
            swiglu=True,
            out_dtype=torch.float32,
        )
        calls[f"grouped tokens={tokens}"] = (
            w8a8.grouped_kernel,
            gemm_common.m_bucket(-(-tokens * A // E), w8a8.GROUPED_CONFIGS),
            lambda c: False,
            lambda x_codes=x_codes, x_scale=x_scale, routing=routing: w8a8.grouped_linear(
                x_codes,
                x_scale,
                *gate_up,
                routing.counts,
                row_ids=routing.token_ids,
                swiglu=True,
                out_dtype=torch.float32,
            ),
            reference,
        )
    failures = deterministic_and_close(calls)
    assert not failures, "\n".join(failures)
