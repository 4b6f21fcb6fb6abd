"""gpu_kernels/w8a8_experts.py: the FP8 experts' grouped GEMM (gather + SwiGLU, router weights
through routing.order, empty experts) against fp8.grouped_linear_reference (CPU under
TRITON_INTERPRET=1, GPU natively); compiled for sm_90 on the CPU it uses FP8 tensor cores; one-line
input errors; on the GPU every configuration forced in turn."""

import pytest
import torch
from conftest import raises_one_line
from test_kernels_w4a4_dense import deterministic_and_close
from test_kernels_w4a4_experts import routing_with_empty_experts
from test_kernels_w8a8_dense import GPU_TOLERANCE, assert_close_to_reference, fp8_weight
from test_kernels_w8a8_quantize import FP8_COMPILE_PREAMBLE, compiled_counts

import fp8
import moe

pytest.importorskip("triton")  # the kernels need it; a wrong name below must fail, not skip
from gpu_kernels import gemm_common, w8a8_experts, w8a8_quantize  # noqa: E402


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
    x_codes, x_scale = w8a8_quantize.quantize_rows(x)
    reference = fp8.grouped_linear_reference(
        x_codes[routing.token_ids],
        x_scale[routing.token_ids],
        routing.counts,
        *gate_up,
        swiglu=True,
    )
    hidden = w8a8_experts.grouped_linear(
        x_codes, x_scale, *gate_up, routing.counts, row_ids=routing.token_ids, swiglu=True
    )
    assert hidden.shape == (tokens * A, I) and hidden.dtype == torch.bfloat16
    assert_close_to_reference(hidden, reference, "grouped gate/up + swiglu")

    h_codes, h_scale = w8a8_quantize.quantize_rows(reference)
    down = fp8.quantize_weight(torch.randn(E, D, I, device=kernel_device) * 0.1)
    expert_weights = torch.rand(tokens, A, device=kernel_device).reshape(-1)  # in assignment order
    y = w8a8_experts.grouped_linear(
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
    gathered = w8a8_experts.grouped_linear(
        h_codes, h_scale, *down, routing.counts, row_weights=expert_weights[routing.order]
    )
    assert torch.equal(y, gathered)


def test_grouped_gemm_with_no_rows_gives_an_empty_output(kernel_device):
    codes, scale = w8a8_quantize.quantize_rows(torch.zeros(0, 32, device=kernel_device))
    w = fp8.quantize_weight(torch.randn(2, 32, 32, device=kernel_device))
    y = w8a8_experts.grouped_linear(
        codes, scale, *w, torch.zeros(2, dtype=torch.int64, device=kernel_device), swiglu=True
    )
    assert y.shape == (0, 16)


# ------------------------------------------------------------------ input checks
BAD_CALLS = [  # (id, call, what the message names, the problem it states)
    (
        "counts",
        lambda: w8a8_experts.grouped_linear(
            *fp8.quantize_rowwise(torch.ones(2, 32)),
            *fp8_weight(E=3),
            torch.ones(2, dtype=torch.int64),
        ),
        "counts must be",
        "shape (3,)",
    ),
    (
        "row weights",
        lambda: w8a8_experts.grouped_linear(
            *fp8.quantize_rowwise(torch.ones(2, 32)),
            *fp8_weight(E=3),
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
def test_grouped_kernel_compiles_for_sm90_to_fp8_tensor_core_instructions():
    # What the interpreter cannot show: on Hopper the products run on the FP8 wgmma (weight rows on
    # its 64-row side, 16 token rows on its narrow one), on stored codes: no division, no E4M3
    # conversion
    found = compiled_counts(
        FP8_COMPILE_PREAMBLE
        + r"""
c = dict(GATHER=True, ROW_WEIGHTS=False, WEIGHT_IDS=False, SWIGLU=True, OUT_BF16=True, GPU=True,
         E_POW2=128, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, BUCKET=4, EVEN_K=True)
counts("grouped", True, jit(w8a8_experts.grouped_kernel),
       [p8, "*fp32", "*i64", "*fp32", "*i64", p8, "*fp32", "*i64", "*i16"] + [i] * 9, c)
"""
    )
    assert set(found) == {("grouped", "True")}, found
    mma, cvt, div = found["grouped", "True"]
    assert mma > 0 and (cvt, div) == (0, 0), found


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
    x_codes, x_scale = w8a8_quantize.quantize_rows(x)
    hidden = w8a8_experts.grouped_linear(
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
    h_codes, h_scale = w8a8_quantize.quantize_rows(reference)
    y = w8a8_experts.grouped_linear(
        h_codes, h_scale, *down, routing.counts, row_weights=weights, row_weight_ids=routing.order
    )
    reference = fp8.grouped_linear_reference(
        h_codes, h_scale, routing.counts, *down, row_weights=weights[routing.order]
    )
    assert_close_to_reference(y, reference, f"gpu grouped down T={tokens}", tolerance=GPU_TOLERANCE)


@pytest.mark.cuda
def test_every_gpu_config_is_deterministic_and_matches_the_reference():
    # autotuning may pick any configuration: each one is forced and repeated, at each bucket
    torch.manual_seed(0)
    calls = {}
    E, D, I, A = 16, 512, 256, 4
    gate_up = fp8.quantize_weight(torch.randn(E, 2 * I, D, device="cuda") * 0.05)
    for tokens in (16, 64, 256, 2048):
        routing = moe.route_tokens(torch.rand(tokens, E, device="cuda").topk(A, dim=-1).indices, E)
        x_codes, x_scale = w8a8_quantize.quantize_rows(
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
            w8a8_experts.grouped_kernel,
            gemm_common.m_bucket(-(-tokens * A // E), w8a8_experts.GROUPED_CONFIGS),
            lambda c: False,
            lambda x_codes=x_codes, x_scale=x_scale, routing=routing: w8a8_experts.grouped_linear(
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
