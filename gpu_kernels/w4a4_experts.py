"""The experts' grouped W4A4 GEMM in Triton: one launch over (expert, row tile, N tile) for all
experts. It equals rac.grouped_matmul_reference up to fp32 accumulation order (and the fp16 rounding
of x + r the quantizer's operand makes).

    rows sorted by expert (counts (E,) rows each; moe.route_tokens sorts them once)
    y[r] = (x[row_ids[r]] @ W[e].T) * router_weight[r]        for the rows r of expert e
         = (X[row_ids[r]] @ W_tile[e].T) * 2^12 * g_x * g_w[e] * router_weight[r]
                                                              (w4a4_common.py's tiles)

g_x is the operand's one global scale, or with per-row scales (the quantizer's row_scale) that of
the row the product reads: the gathered activation row row_ids[r] at gate/up, the sorted row r at
down (whose operand rows are the sorted rows). The operand may also be a W4A16 one (x / g_x * 2^-6,
the quantizer's quantize=False).

A program finds its (expert, row tile) from the per-expert counts on the device (a prefix sum: no
host sync), so experts without tokens cost nothing and the grid is an upper bound whose surplus
programs exit (gemm_common.py's grouped scheduling, shared with the FP8 and the Blackwell kernels).
The gate/up GEMM gathers token rows (row_ids) and applies SwiGLU in its epilogue: a tile's weight
rows are its gate rows stacked on the matching up rows, so that one product holds both halves. The
down GEMM scales each row by its router weight, read through routing.order (no gather launch). The
weights are in the experts' blocked layout (expert_layout.ExpertWeights: 16-row blocks by
CHUNK-element K chunks, each one contiguous run), so that a program streams a few contiguous
regions. The weight tile is decoded in registers by w4a4_common.py's main loop, as in the dense
kernel (w4a4_dense.py).

On sm_89 / sm_90 the Gluon kernel (w4a4_experts_gluon.py) runs instead at decode; this one runs for
prefill (rac.grouped_matmul_triton says from how many tokens), under the interpreter, for K not a
multiple of 64, and where Triton has no Gluon.
"""

import torch
import triton
import triton.language as tl

from gpu_kernels import INTERPRET
from gpu_kernels.expert_layout import expert_shape
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
from gpu_kernels.w4a4_common import EPILOGUE, autotune_configs, mainloop, x_scale_is_per_row


# Not (128, 128, 64, 8 warps, 3 stages): under Triton 3.6 on the H200 the grouped kernel compiled
# with it gave non-deterministic results with NaN rows; tests/test_kernels_w4a4_experts.py runs
# every configuration of both kernels repeatedly on the GPU. (On sm_89 / sm_90 the experts take the
# Gluon kernel at decode; this table serves prefill, the shapes Gluon does not take, and other
# GPUs.)
GROUPED_CONFIGS = {
    16: [
        (16, 64, 256, 4, 3, 1, True),
        (16, 128, 128, 4, 3, 1, True),
        (16, 32, 256, 4, 3, 1, True),
        (16, 64, 128, 4, 4, 1, True),
        (16, 128, 256, 4, 3, 1, True),
        (16, 32, 256, 4, 3, 1),
        (16, 64, 256, 4, 2, 1, True, 128),
    ],
    64: [
        (32, 64, 128, 4, 3, 1),
        (64, 64, 128, 4, 3, 1),
        (32, 64, 128, 4, 3, 1, True),
        (32, 128, 128, 4, 3, 1, True),
    ],
    256: [(64, 128, 64, 4, 3, 1), (64, 64, 128, 4, 3, 1)],
    4096: [(64, 128, 64, 4, 3, 1), (64, 64, 128, 4, 3, 1)],
}


def grouped_prune(configs, named_args, **kwargs):
    """prune_to_bucket; and where K spans several chunks of ExpertWeights' layout, BLOCK_K at most
    one chunk (a power of two no larger than the 128-element chunk divides it): a K step then lies
    in one chunk."""
    chunk, kept = kwargs["CHUNK"], prune_to_bucket(configs, named_args)
    if chunk == named_args["K"]:
        return kept
    return [
        triton.Config(
            {**c.kwargs, "BLOCK_K": min(c.kwargs["BLOCK_K"], chunk)},
            num_warps=c.num_warps,
            num_stages=c.num_stages,
            maxnreg=c.maxnreg,
        )
        for c in kept
    ]


# Reference: rac.grouped_matmul_reference. (ROW_SCALE is not in the autotuning key: see
# dense_kernel.)
@triton.autotune(
    configs=autotune_configs(GROUPED_CONFIGS),
    key=["M_BUCKET", "N", "K"],
    prune_configs_by={"early_config_prune": grouped_prune},
    do_bench=bench_in_graph,
)
@triton.heuristics(EVEN_K_HEURISTICS)
@triton.jit
def grouped_kernel(
    # pointers (weight_ids: where each sorted row's router weight is, routing.order; x_global: one
    # scale, or one per operand row with ROW_SCALE)
    x_ptr,
    x_global_ptr,
    row_ids_ptr,
    row_weights_ptr,
    weight_ids_ptr,
    w_ptr,
    w_scale_ptr,
    w_global_ptr,
    counts_ptr,
    y_ptr,
    # sizes: N is the weight's rows (2I for SwiGLU, whose output has N/2 columns)
    N,
    K,
    E,
    M_BUCKET,
    x_plane,
    # strides: activation rows; weight (expert, row block, chunk) in bytes, scales in blocks; y rows
    stride_x,
    stride_we,
    stride_wb,
    stride_wc,
    stride_se,
    stride_sb,
    stride_sc,
    stride_y,
    # meta-parameters (CHUNK: ExpertWeights' chunk)
    GATHER: tl.constexpr,
    ROW_WEIGHTS: tl.constexpr,
    WEIGHT_IDS: tl.constexpr,
    SWIGLU: tl.constexpr,
    OUT_BF16: tl.constexpr,
    GPU: tl.constexpr,
    E_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BUCKET: tl.constexpr,
    EVEN_K: tl.constexpr,
    X_FIRST: tl.constexpr,
    ROW_SCALE: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert, row0, end_row = expert_tile(counts_ptr, E, pid_m, BLOCK_M, E_POW2)
    if expert >= E:  # the grid is an upper bound on the tile count: surplus programs exit
        return
    sorted_rows, row_mask, x_rows, weight_rows = tile_rows(
        row_ids_ptr, weight_ids_ptr, row0, end_row, GATHER, WEIGHT_IDS, BLOCK_M
    )
    n_out = N // 2 if SWIGLU else N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    ws_base = w_scale_ptr + expert.to(tl.int64) * stride_se
    if ROW_SCALE:
        # the x scale of each activation row the tile reads, in the one-scale product's order
        x_global = tl.load(x_global_ptr + x_rows, mask=row_mask, other=0.0)[None, :]
        scale = EPILOGUE * x_global * tl.load(w_global_ptr + expert)  # (1, BLOCK_M)
    else:
        scale = EPILOGUE * tl.load(x_global_ptr) * tl.load(w_global_ptr + expert)
    W_ROWS: tl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    w_rows, w_mask = expert_weight_rows(pid_n, n_out, BLOCK_N, SWIGLU)
    acc = mainloop(
        x_ptr,
        row0,
        end_row,
        stride_x,
        x_plane,
        w_base,
        ws_base,
        w_rows,
        w_mask,
        stride_wb,
        stride_sb,
        0,
        K,
        0,
        K,
        False,
        GPU,
        BLOCK_M,
        W_ROWS,
        BLOCK_K,
        EVEN_K,
        x_rows,
        X_FIRST,
        CHUNK,
        stride_wc,
        stride_sc,
    )
    grouped_store(
        acc,
        scale,
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
def grouped_matmul(
    operand,
    x_global_scale,
    w_data,
    w_block_scale,
    w_global_scale,
    counts,
    out_dtype,
    row_ids=None,
    row_weights=None,
    row_weight_ids=None,
    swiglu=False,
):
    """The experts' GEMM on the quantizer's operand (2, rows, K/2) fp16 and x_global_scale () fp32,
    or one per operand row (rows,): rows (operand's, or operand's row_ids[r]) grouped by expert per
    counts (E,) int64; the weights' codes and E4M3 scales in the experts' layout, global scales (E,)
    fp32. swiglu: the weight rows are [gate; up] and the output is silu(gate) * up. Output row r is
    scaled by row_weights[r], or row_weights[row_weight_ids[r]]. -> y (rows, N or N/2) out_dtype."""
    E, N, K, chunk = expert_shape(w_data)
    row_scale = x_scale_is_per_row(x_global_scale, operand.shape[1], "grouped_matmul")
    n_rows = row_ids.numel() if row_ids is not None else operand.shape[1]
    y, flags, (row_ids, row_weights, row_weight_ids) = grouped_output(
        n_rows, N, counts, out_dtype, row_ids, row_weights, row_weight_ids, swiglu
    )
    if n_rows == 0:
        return y
    w_scale = w_block_scale.view(torch.uint8)
    n_out = y.shape[1]

    def grid(meta):  # an upper bound on sum_e cdiv(counts[e], BLOCK_M): no host sync
        row_tiles = triton.cdiv(n_rows, meta["BLOCK_M"]) + min(E, n_rows)
        return row_tiles, triton.cdiv(n_out, meta["BLOCK_N"])

    grouped_kernel[grid](
        operand,
        x_global_scale,
        row_ids,
        row_weights,
        row_weight_ids,
        w_data,
        w_scale,
        w_global_scale,
        counts,
        as_int16(y),
        N,
        K,
        E,
        m_bucket(triton.cdiv(n_rows, E), GROUPED_CONFIGS),
        operand.stride(0),
        operand.stride(1),
        *w_data.stride()[:3],
        *w_scale.stride()[:3],
        y.stride(0),
        GPU=not INTERPRET,
        CHUNK=chunk,
        OUT_BF16=out_dtype == torch.bfloat16,
        ROW_SCALE=row_scale,
        **flags,
    )
    return y
