"""The FP8 W8A8 experts' grouped GEMM for GPUs with FP8 tensor cores (sm_89 / sm_90): rows grouped
by expert times each expert's weight, on the E4M3 codes of both (row-wise scales, as the dense
GEMM's). It equals fp8.grouped_linear_reference (dequantize, multiply in fp32, SwiGLU and router
weights in fp32, round to BF16) up to fp32 accumulation order.

The scales leave the sum (w8a8_common.py derives it): the K loop, shared with the dense GEMM,
multiplies the codes as stored, and the epilogue scales the fp32 tile by sw[e, n] * sx[m].

One launch over (expert, row tile, N tile) with gpu_kernels/gemm_common.py's grouped scheduling
(as gpu_kernels/w4a4_experts.py's): a program finds its expert from the per-expert counts on the
device (no host sync), the gate/up GEMM gathers token rows and applies SwiGLU in its epilogue, the
down GEMM scales each row by its router weight. Its activation is w8a8_quantize.quantize_rows'
codes (no fused quantization here). Tile sizes are autotuned per bucket of rows an expert
(CUDA-graph timing), as for the W4A4 kernels; no split-K.
"""

import torch
import triton
import triton.language as tl

from gpu_kernels import INTERPRET
from gpu_kernels.gemm_common import (
    EVEN_K_HEURISTICS,
    as_int16,
    bench_in_graph,
    expert_tile,
    expert_weight_rows,
    grouped_output,
    grouped_store,
    m_bucket,
    prune_to_bucket,
    tile_rows,
)
from gpu_kernels.w8a8_common import (
    autotune_configs,
    check_out_dtype,
    check_scale,
    check_weight,
    described,
    mainloop,
)
from gpu_kernels.w8a8_quantize import check, check_rows


# ------------------------------------------------------------------ autotuning
# The experts: buckets of rows an expert (the mean); BLOCK_N counts output columns, so that the
# gate/up GEMM's SwiGLU tile stacks 2 * BLOCK_N weight rows. BLOCK_N >= 64: the down GEMM's weight
# tile fills the wgmma's 64 rows (with fewer, Triton 3.6 falls back to fp16 mma.sync on sm_90). No
# split-K: the experts give the stream programs enough. Tiles of 128 x 128 spill at 8 warps
# (ptxas, sm_90): not in the table.
GROUPED_CONFIGS = {
    4: [(16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 8, 3), (16, 64, 128, 4, 3)],
    16: [(16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (32, 64, 128, 4, 4), (16, 128, 128, 8, 3)],
    64: [(32, 64, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 128, 8, 3)],
    4096: [(64, 128, 128, 8, 3), (128, 64, 128, 8, 3), (64, 64, 128, 4, 4)],
}


# ------------------------------------------------------------------ the experts' grouped GEMM
# Reference: fp8.grouped_linear_reference.
@triton.autotune(
    configs=autotune_configs(GROUPED_CONFIGS, has_split_k=False),
    key=["M_BUCKET", "N", "K"],
    prune_configs_by={"early_config_prune": prune_to_bucket},
    do_bench=bench_in_graph,
)
@triton.heuristics(EVEN_K_HEURISTICS)
@triton.jit
def grouped_kernel(
    # pointers: x's codes and row scales; the sorted rows' x rows (row_ids), router weights and
    # where each sorted row's weight is (weight_ids, routing.order); the experts' codes and row
    # scales; rows per expert; y
    x_ptr,
    x_scale_ptr,
    row_ids_ptr,
    row_weights_ptr,
    weight_ids_ptr,
    w_ptr,
    w_scale_ptr,
    counts_ptr,
    y_ptr,
    # sizes: N is the weight's rows (2I for SwiGLU, whose output has N/2 columns)
    N,
    K,
    E,
    M_BUCKET,
    # strides (elements): x rows; weight (expert, row); scales (expert); y rows
    stride_x,
    stride_we,
    stride_w,
    stride_se,
    stride_y,
    # meta-parameters
    GATHER: tl.constexpr,
    ROW_WEIGHTS: tl.constexpr,
    WEIGHT_IDS: tl.constexpr,
    SWIGLU: tl.constexpr,
    OUT_BF16: tl.constexpr,
    GPU: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BUCKET: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert, row0, end_row = expert_tile(counts_ptr, E, pid_m, BLOCK_M, E_POW2)
    if expert >= E:  # the grid is an upper bound on the tile count: surplus programs exit
        return
    sorted_rows, row_mask, x_rows, weight_rows = tile_rows(
        row_ids_ptr, weight_ids_ptr, row0, end_row, GATHER, WEIGHT_IDS, BLOCK_M
    )
    x_rows = x_rows.to(tl.int64)
    n_out = N // 2 if SWIGLU else N
    W_ROWS: tl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    w_rows, w_mask = expert_weight_rows(pid_n, n_out, BLOCK_N, SWIGLU)
    expert = expert.to(tl.int64)
    x_scale = tl.load(x_scale_ptr + x_rows, mask=row_mask, other=1.0)
    acc = mainloop(
        x_ptr,
        x_rows,
        row_mask,
        stride_x,
        x_scale,
        w_ptr + expert * stride_we,
        w_rows,
        w_mask,
        stride_w,
        0,
        K,
        K,
        False,
        GPU,
        BLOCK_M,
        W_ROWS,
        BLOCK_K,
        EVEN_K,
    )
    w_scale = tl.load(w_scale_ptr + expert * stride_se + w_rows, mask=w_mask, other=0.0)
    grouped_store(
        acc,
        w_scale[:, None] * x_scale[None, :],
        y_ptr,
        row_weights_ptr,
        weight_rows,
        sorted_rows,
        row_mask,
        pid_n,
        n_out,
        stride_y,
        ROW_WEIGHTS,
        SWIGLU,
        OUT_BF16,
        BLOCK_M,
        BLOCK_N,
    )


# ------------------------------------------------------------------ launch
def grouped_linear(
    x_codes,
    x_scale,
    w_codes,
    w_scale,
    counts,
    row_ids=None,
    row_weights=None,
    row_weight_ids=None,
    swiglu=False,
    out_dtype=torch.bfloat16,
):
    """The experts' GEMM, one launch, no host sync: rows (x_codes' own, or x_codes[row_ids]) grouped
    by expert, counts (E,) int64 rows each, times expert e's weight w_codes[e] (E, N, K)
    float8_e4m3fn with row scales w_scale (E, N) fp32; x_scale (rows of x_codes, 1) fp32. swiglu:
    the weight rows are [gate; up] and the output is silu(gate) * up. Output row r is scaled by
    row_weights[r], or row_weights[row_weight_ids[r]]. -> y (rows, N or N/2) out_dtype. Reference:
    fp8.grouped_linear_reference."""
    x_codes = check_rows("x_codes", x_codes, (torch.float8_e4m3fn,), "float8_e4m3fn")
    device = x_codes.device
    check_scale(x_scale, x_codes.shape[0], device)
    check_weight(w_codes, w_scale, x_codes.shape[1], device, experts=True)
    check_out_dtype(out_dtype)
    E, N, K = w_codes.shape
    check(
        isinstance(counts, torch.Tensor)
        and counts.shape == (E,)
        and counts.device == device
        and not counts.is_floating_point(),
        f"w8a8: counts must be an integer tensor of shape ({E},) on {device}, got "
        f"{described(counts)}",
    )
    check(not swiglu or N % 2 == 0, f"w8a8: swiglu needs an even number of weight rows, got N={N}")
    n_rows = row_ids.numel() if row_ids is not None else x_codes.shape[0]
    if row_weight_ids is not None:
        check(
            row_weights is not None and row_weight_ids.shape == (n_rows,),
            f"w8a8: row_weight_ids must index row_weights with one id per row ({n_rows},)",
        )
    elif row_weights is not None:
        check(
            row_weights.shape == (n_rows,),
            f"w8a8: row_weights must hold one weight per row ({n_rows},), "
            f"got {tuple(row_weights.shape)}",
        )
    y, flags, (row_ids, row_weights, row_weight_ids) = grouped_output(
        n_rows, N, counts, out_dtype, row_ids, row_weights, row_weight_ids, swiglu
    )
    if n_rows == 0:
        return y
    n_out = y.shape[1]

    def grid(meta):  # an upper bound on sum_e cdiv(counts[e], BLOCK_M): no host sync
        row_tiles = triton.cdiv(n_rows, meta["BLOCK_M"]) + min(E, n_rows)
        return row_tiles, triton.cdiv(n_out, meta["BLOCK_N"])

    grouped_kernel[grid](
        x_codes,
        x_scale,
        row_ids,
        row_weights,
        row_weight_ids,
        w_codes,
        w_scale,
        counts,
        as_int16(y),
        N,
        K,
        E,
        m_bucket(triton.cdiv(n_rows, E), GROUPED_CONFIGS),
        x_codes.stride(0),
        N * K,
        K,
        N,
        y.stride(0),
        OUT_BF16=out_dtype == torch.bfloat16,
        GPU=not INTERPRET,
        **flags,
    )
    return y
