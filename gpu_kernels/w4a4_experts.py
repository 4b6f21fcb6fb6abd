"""The experts' grouped W4A4 GEMM in Triton: one launch over (expert, row tile, N tile) for all experts. It
equals rac.grouped_matmul_reference up to fp32 accumulation order (and the fp16 rounding of x + r the
quantizer's operand makes).

    rows sorted by expert (counts (E,) rows each; moe.route_tokens sorts them once)
    y[r] = (x[row_ids[r]] @ W[e].T) * router_weight[r]        for the rows r of expert e
         = (X[row_ids[r]] @ W_tile[e].T) * 2^12 * g_x * g_w[e] * router_weight[r]     (w4a4_dense.py's tiles)

g_x is the operand's one global scale, or with per-row scales (the quantizer's row_scale) that of the row the
product reads: the gathered activation row row_ids[r] at gate/up, the sorted row r at down (whose operand rows
are the sorted rows). The operand may also be a W4A16 one (x / g_x * 2^-6, the quantizer's quantize=False).

A program finds its (expert, row tile) from the per-expert counts on the device (a prefix sum: no host
sync), so experts without tokens cost nothing and the grid is an upper bound whose surplus programs exit.
The gate/up GEMM gathers token rows (row_ids) and applies SwiGLU in its epilogue: a tile's weight rows are
its gate rows stacked on the matching up rows, so that one product holds both halves. The down GEMM scales
each row by its router weight, read through routing.order (no gather launch). The weights are in the
experts' blocked layout (expert_layout.ExpertWeights: 16-row blocks by CHUNK-element K chunks, each one contiguous
run), so that a program streams a few contiguous regions. The weight tile is decoded in registers as in
gpu_kernels/w4a4_dense.py, whose building blocks this file uses.

On sm_89 / sm_90 the Gluon kernel (w4a4_experts_gluon.py) runs instead at decode; this one runs for prefill
(rac.grouped_matmul_triton says from how many tokens), under the interpreter, for K not a multiple of 64, and
where Triton has no Gluon.
"""

import torch
import triton
import triton.language as tl

from gpu_kernels.w4a4_dense import (
    _EPILOGUE,
    _HEURISTICS,
    INTERPRET,
    _bench_in_graph,
    _configs,
    _m_bucket,
    _mainloop,
    _prune,
    _store_tile,
    as_int16,
    x_scale_is_per_row,
)


# Not (128, 128, 64, 8 warps, 3 stages): under Triton 3.6 on the H200 the grouped kernel compiled
# with it gave non-deterministic results with NaN rows; tests/test_kernels_w4a4_experts.py runs every configuration
# of both kernels repeatedly on the GPU. (On sm_89 / sm_90 the experts take the Gluon kernel at decode;
# this table serves prefill, the shapes Gluon does not take, and other GPUs.)
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


@triton.jit
def _expert_tile(counts_ptr, E, pid_m, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """Which (expert, row tile) is program pid_m's? Expert e owns cdiv(counts[e], BLOCK_M) tiles,
    laid end to end; a prefix sum over the E counts answers it on the device. -> (expert, first
    sorted row of the tile, end row of the expert); expert >= E: beyond the last tile, no work.
    Tiles and rows share one int64 prefix sum (tiles in the high 32 bits, rows below: no carry as
    long as there are fewer than 2^32 rows), so the program takes one cumulative sum and two
    reductions, each a round of barriers, where it took two and five."""
    experts = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + experts, mask=experts < E, other=0).to(tl.int64)  # (E_POW2,)
    packed = (((counts + BLOCK_M - 1) // BLOCK_M) << 32) + counts
    ends = tl.cumsum(packed, axis=0)  # (tile end << 32) + row end
    expert = tl.sum(((ends >> 32) <= pid_m).to(tl.int32), axis=0)
    start = tl.sum(tl.where(experts == expert, ends - packed, 0), axis=0)
    first_tile = start >> 32
    first_row = (start - (first_tile << 32)).to(tl.int32)
    rows = tl.load(counts_ptr + expert, mask=expert < E, other=0).to(tl.int32)
    return expert, first_row + (pid_m - first_tile.to(tl.int32)) * BLOCK_M, first_row + rows


@triton.jit
def _tile_rows(
    row_ids_ptr,
    weight_ids_ptr,
    row0,
    end_row,
    GATHER: tl.constexpr,
    WEIGHT_IDS: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """A row tile -> (its sorted rows, their mask, the activation rows they read (GATHER: row_ids), where
    their router weights are (WEIGHT_IDS: weight_ids, routing.order))."""
    sorted_rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = sorted_rows < end_row
    x_rows = tl.load(row_ids_ptr + sorted_rows, mask=row_mask, other=0) if GATHER else sorted_rows
    weight_rows = (
        tl.load(weight_ids_ptr + sorted_rows, mask=row_mask, other=0) if WEIGHT_IDS else sorted_rows
    )
    return sorted_rows, row_mask, x_rows, weight_rows


@triton.jit
def _expert_weight_rows(pid_n, n_out, BLOCK_N: tl.constexpr, SWIGLU: tl.constexpr):
    """The weight rows of N tile pid_n -> (rows, mask): BLOCK_N rows, or SWIGLU's stacked tile of
    2 BLOCK_N, the gate rows (of [0, I)) then the up rows I + the same, so that one product holds
    both halves of the SwiGLU."""
    W_ROWS: tl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    stacked = tl.arange(0, W_ROWS)
    cols = pid_n * BLOCK_N + stacked % BLOCK_N
    return (cols + (stacked // BLOCK_N) * n_out).to(tl.int64), cols < n_out


@triton.jit
def _swiglu(acc, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, WEIGHT_ROWS_FIRST: tl.constexpr):
    """silu(gate) * up of a stacked tile's product: (2 BLOCK_N, BLOCK_M) if WEIGHT_ROWS_FIRST (the
    Hopper kernel's) else (BLOCK_M, 2 BLOCK_N); the result keeps the order."""
    if WEIGHT_ROWS_FIRST:
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
    else:
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _grouped_store(
    acc,
    scale,
    y_ptr,
    row_weights_ptr,
    weight_rows,
    sorted_rows,
    row_mask,
    tile,
    n_out,
    stride_y,
    ROW_WEIGHTS: tl.constexpr,
    SWIGLU: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The epilogue of N tile `tile` on its (W_ROWS, BLOCK_M) product: scales, SwiGLU, router weights."""
    out = acc * scale  # (W_ROWS, BLOCK_M)
    if SWIGLU:
        out = _swiglu(out, BLOCK_N, BLOCK_M, True)  # (BLOCK_N, BLOCK_M)
    if ROW_WEIGHTS:
        router_weight = tl.load(row_weights_ptr + weight_rows, mask=row_mask, other=0.0).to(
            tl.float32
        )
        out = out * router_weight[None, :]
    cols = (tile * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    _store_tile(y_ptr, sorted_rows, row_mask, cols, cols < n_out, stride_y, out, OUT_BF16)


def _grouped_prune(configs, named_args, **kwargs):
    """_prune; and where K spans several chunks of ExpertWeights' layout, BLOCK_K at most one chunk (a
    power of two no larger than the 128-element chunk divides it): a K step then lies in one chunk."""
    chunk, kept = kwargs["CHUNK"], _prune(configs, named_args)
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


# Reference: rac.grouped_matmul_reference. (ROW_SCALE is not in the autotuning key: see _dense_kernel.)
@triton.autotune(
    configs=_configs(GROUPED_CONFIGS),
    key=["M_BUCKET", "N", "K"],
    prune_configs_by={"early_config_prune": _grouped_prune},
    do_bench=_bench_in_graph,
)
@triton.heuristics(_HEURISTICS)
@triton.jit
def _grouped_kernel(
    # pointers (weight_ids: where each sorted row's router weight is, routing.order; x_global: one scale,
    # or one per operand row with ROW_SCALE)
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
    expert, row0, end_row = _expert_tile(counts_ptr, E, pid_m, BLOCK_M, E_POW2)
    if expert >= E:  # the grid is an upper bound on the tile count: surplus programs exit
        return
    sorted_rows, row_mask, x_rows, weight_rows = _tile_rows(
        row_ids_ptr, weight_ids_ptr, row0, end_row, GATHER, WEIGHT_IDS, BLOCK_M
    )
    n_out = N // 2 if SWIGLU else N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    ws_base = w_scale_ptr + expert.to(tl.int64) * stride_se
    if (
        ROW_SCALE
    ):  # the x scale of each activation row the tile reads, in the one-scale product's order
        x_global = tl.load(x_global_ptr + x_rows, mask=row_mask, other=0.0)[None, :]
        scale = _EPILOGUE * x_global * tl.load(w_global_ptr + expert)  # (1, BLOCK_M)
    else:
        scale = _EPILOGUE * tl.load(x_global_ptr) * tl.load(w_global_ptr + expert)
    W_ROWS: tl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    w_rows, w_mask = _expert_weight_rows(pid_n, n_out, BLOCK_N, SWIGLU)
    acc = _mainloop(
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
    _grouped_store(
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
def expert_shape(w_data):
    """Codes in the experts' layout (E, N/16, K/chunk, 16, chunk/2) -> (E, N, K, chunk)."""
    E, blocks, chunks, rows, half = w_data.shape
    return E, blocks * rows, chunks * half * 2, half * 2


def grouped_output(n_rows, N, counts, out_dtype, row_ids, row_weights, row_weight_ids, swiglu):
    """What every grouped launch prepares: y (n_rows, N or N/2), the kernel's flags, and the three optional
    row tensors (counts stands in for an absent one: a pointer the kernel never reads)."""
    y = torch.empty((n_rows, N // 2 if swiglu else N), dtype=out_dtype, device=counts.device)
    flags = dict(
        GATHER=row_ids is not None,
        ROW_WEIGHTS=row_weights is not None,
        WEIGHT_IDS=row_weight_ids is not None,
        SWIGLU=swiglu,
        E_POW2=max(2, triton.next_power_of_2(counts.numel())),
    )
    return (
        y,
        flags,
        [t if t is not None else counts for t in (row_ids, row_weights, row_weight_ids)],
    )


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
    """The experts' GEMM on the quantizer's operand (2, rows, K/2) fp16 and x_global_scale () fp32, or one per
    operand row (rows,): rows (operand's, or operand's row_ids[r]) grouped by expert per counts (E,) int64; the
    weights' codes and E4M3 scales in the experts' layout, global scales (E,) fp32. swiglu: the weight rows are
    [gate; up] and the output is silu(gate) * up. Output row r is scaled by row_weights[r], or
    row_weights[row_weight_ids[r]]. -> y (rows, N or N/2) out_dtype."""
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
        return triton.cdiv(n_rows, meta["BLOCK_M"]) + min(E, n_rows), triton.cdiv(
            n_out, meta["BLOCK_N"]
        )

    _grouped_kernel[grid](
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
        _m_bucket(triton.cdiv(n_rows, E), GROUPED_CONFIGS),
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
