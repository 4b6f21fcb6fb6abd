"""The W4A4 GEMMs on Blackwell (sm_100+) FP4 tensor cores: `tl.dot_scaled(..., "e2m1", ...)` reads
the packed codes and E4M3 block scales as they are, no decode. The dense kernel equals
rac.matmul_reference and the grouped one rac.grouped_matmul_reference, up to fp32 accumulation
order:

    y = (DQ(x_q) + DQ(r_q)) @ DQ(W).T = (x_q @ W.T  +  r_q @ W.T) * g_x * g_w

where each product is a dot_scaled over all of K with the block scales, and the global scales come
in the epilogue: g_x one per activation, or one per row (the quantizer's row_scale; at gate/up that
of the gathered row, at down the sorted row's), times g_w. (A W4A16 operand has no codes: the Hopper
kernels take it.) Numerics UNTESTED (no Blackwell GPU here; the interpreter reads E4M3 scales as
E8M0): a CPU test compiles both kernels for sm_100, and rac.py checks them against the Hopper
kernels on first use (`disagreement`, at the end).

One tl.dot_scaled per loop body: with two (x and its residual, or gate and up) Triton 3.6's
automatic warp specialization fails to compile for sm_100. So the residual is a second pass over K
(the weight tiles read again, mostly from L2), and SwiGLU's gate and up rows are one stacked tile,
as in the Hopper kernel. The grouped kernel finds its expert and rows as
gpu_kernels/w4a4_experts.py's does, from the same helpers (gemm_common.py).
"""

import torch
import triton
import triton.language as tl

from gpu_kernels import w4a4_dense, w4a4_experts
from gpu_kernels.expert_layout import expert_shape
from gpu_kernels.gemm_common import (
    as_int16,
    column_splits,
    expert_tile,
    expert_weight_rows,
    grouped_output,
    split_columns,
    split_output,
    store_split,
    store_tile,
    swiglu_tile,
    tile_rows,
)
from gpu_kernels.w4a4_common import EXPERT_ROWS, x_scale_is_per_row
from gpu_kernels.w4a4_quantize import quantize_activation


@triton.jit
def _native_k_loop(
    acc,
    x_ptr,
    xs_ptr,
    rows,
    row_mask,
    stride_x,
    stride_xs,
    w_rows_ptr,
    ws_rows_ptr,
    col_mask,
    w_step,
    ws_step,
    K,
    BLOCK_K: tl.constexpr,
):
    """acc (BLOCK_M, cols) += X[rows] @ W[cols].T over all of K on FP4 tensor cores. W's rows start
    at w_rows_ptr (codes) and ws_rows_ptr (scales); each BLOCK_K step lies w_step bytes and ws_step
    scales further on (BLOCK_K / 2 and / 16 in row-major codes; the chunk stride in ExpertWeights of
    BLOCK_K-element chunks)."""
    byte_idx, block_idx = tl.arange(0, BLOCK_K // 2), tl.arange(0, BLOCK_K // 16)
    for k0 in range(0, K, BLOCK_K):
        step = k0 // BLOCK_K
        byte_ok, block_ok = k0 // 2 + byte_idx < K // 2, k0 // 16 + block_idx < K // 16
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + (k0 // 2 + byte_idx)[None, :],
            mask=row_mask[:, None] & byte_ok[None, :],
            other=0,
        )
        xs = tl.load(
            xs_ptr + rows[:, None] * stride_xs + (k0 // 16 + block_idx)[None, :],
            mask=row_mask[:, None] & block_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_rows_ptr[:, None] + step * w_step + byte_idx[None, :],
            mask=col_mask[:, None] & byte_ok[None, :],
            other=0,
        )
        ws = tl.load(
            ws_rows_ptr[:, None] + step * ws_step + block_idx[None, :],
            mask=col_mask[:, None] & block_ok[None, :],
            other=0.0,
        )
        acc = tl.dot_scaled(x, xs, "e2m1", tl.trans(w), ws, "e2m1", acc)
    return acc


@triton.jit
def dense_native_kernel(
    x_ptr,
    x_scale_ptr,
    r_ptr,
    r_scale_ptr,
    x_global_ptr,
    w_ptr,
    w_scale_ptr,
    w_global_ptr,
    y_ptr,
    M,
    N,
    K,
    N1,
    N2,
    stride_x,
    stride_xs,
    stride_w,
    stride_ws,
    HAS_RESIDUAL: tl.constexpr,
    OUT_BF16: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y = (x + r) @ W.T: packed codes and E4M3 scales go to tl.dot_scaled as they are."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_rows = w_ptr + cols.to(tl.int64) * stride_w
    ws_rows = w_scale_ptr + cols.to(tl.int64) * stride_ws
    acc = _native_k_loop(
        acc,
        x_ptr,
        x_scale_ptr,
        rows,
        row_mask,
        stride_x,
        stride_xs,
        w_rows,
        ws_rows,
        col_mask,
        BLOCK_K // 2,
        BLOCK_K // 16,
        K,
        BLOCK_K,
    )
    if HAS_RESIDUAL:  # the same weights, the residual's codes
        acc = _native_k_loop(
            acc,
            r_ptr,
            r_scale_ptr,
            rows,
            row_mask,
            stride_x,
            stride_xs,
            w_rows,
            ws_rows,
            col_mask,
            BLOCK_K // 2,
            BLOCK_K // 16,
            K,
            BLOCK_K,
        )
    which, col_base, col_stride = split_columns(cols, M, N, N1, N2)
    if ROW_SCALE:  # each row's own x scale
        x_global = tl.load(x_global_ptr + rows, mask=row_mask, other=0.0)[:, None]
    else:
        x_global = tl.load(x_global_ptr)
    scale = x_global * tl.load(w_global_ptr + which, mask=col_mask, other=0.0)[None, :]
    store_split(
        y_ptr, rows, row_mask, col_base, col_stride, col_mask, tl.trans(acc * scale), OUT_BF16
    )


@triton.jit
def grouped_native_kernel(
    x_ptr,
    x_scale_ptr,
    r_ptr,
    r_scale_ptr,
    x_global_ptr,
    row_ids_ptr,
    row_weights_ptr,
    weight_ids_ptr,
    w_ptr,
    w_scale_ptr,
    w_global_ptr,
    counts_ptr,
    y_ptr,
    N,
    K,
    E,
    stride_x,
    stride_xs,
    stride_we,
    stride_wb,
    stride_wr,
    w_step,
    stride_se,
    stride_sb,
    stride_sr,
    s_step,
    stride_y,
    GATHER: tl.constexpr,
    ROW_WEIGHTS: tl.constexpr,
    WEIGHT_IDS: tl.constexpr,
    SWIGLU: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    OUT_BF16: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The grouped kernel on FP4 tensor cores (SWIGLU: the gate and up rows as one stacked tile)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert, row0, end_row = expert_tile(counts_ptr, E, pid_m, BLOCK_M, E_POW2)
    if expert >= E:
        return
    sorted_rows, row_mask, x_rows, weight_rows = tile_rows(
        row_ids_ptr, weight_ids_ptr, row0, end_row, GATHER, WEIGHT_IDS, BLOCK_M
    )
    n_out = N // 2 if SWIGLU else N
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_out
    W_ROWS: tl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
    w_rows, w_mask = expert_weight_rows(pid_n, n_out, BLOCK_N, SWIGLU)
    block, row = w_rows // EXPERT_ROWS, w_rows % EXPERT_ROWS  # ExpertWeights' layout
    w_base = w_ptr + expert.to(tl.int64) * stride_we + block * stride_wb + row * stride_wr
    ws_base = w_scale_ptr + expert.to(tl.int64) * stride_se + block * stride_sb + row * stride_sr
    acc = tl.zeros((BLOCK_M, W_ROWS), dtype=tl.float32)
    acc = _native_k_loop(
        acc,
        x_ptr,
        x_scale_ptr,
        x_rows,
        row_mask,
        stride_x,
        stride_xs,
        w_base,
        ws_base,
        w_mask,
        w_step,
        s_step,
        K,
        BLOCK_K,
    )
    if HAS_RESIDUAL:
        acc = _native_k_loop(
            acc,
            r_ptr,
            r_scale_ptr,
            x_rows,
            row_mask,
            stride_x,
            stride_xs,
            w_base,
            ws_base,
            w_mask,
            w_step,
            s_step,
            K,
            BLOCK_K,
        )
    if ROW_SCALE:  # the x scale of each activation row the tile read (gathered: row_ids)
        x_global = tl.load(x_global_ptr + x_rows, mask=row_mask, other=0.0)
        out = acc * (x_global * tl.load(w_global_ptr + expert))[:, None]
    else:
        out = acc * (tl.load(x_global_ptr) * tl.load(w_global_ptr + expert))
    if SWIGLU:
        out = swiglu_tile(out, BLOCK_N, BLOCK_M, False)  # (BLOCK_M, BLOCK_N)
    if ROW_WEIGHTS:
        router_weight = tl.load(row_weights_ptr + weight_rows, mask=row_mask, other=0.0)
        out = out * router_weight.to(tl.float32)[:, None]
    store_tile(y_ptr, sorted_rows, row_mask, cols, col_mask, stride_y, tl.trans(out), OUT_BF16)


# ------------------------------------------------------------------ launch
def dense_matmul(
    x_data,
    x_block_scale,
    r_data,
    r_block_scale,
    x_global_scale,
    w_data,
    w_block_scale,
    w_global_scale,
    out_dtype,
    splits=None,
):
    """y = (x + r) @ W.T on codes: x's and its residual's packed codes (M, K/2) and E4M3 scales
    (M, K/16) (r_data None: no residual), x's global scale () or (M,) fp32 (per row), the weight's
    codes (N, K/2), scales (N, K/16) and global scales (1 to 3,) -> (M, N) out_dtype, or one (M, n)
    per stacked weight (splits)."""
    M = x_data.shape[0]
    row_scale = x_scale_is_per_row(x_global_scale, M, "dense_matmul")
    N, K = w_data.shape[0], w_data.shape[1] * 2
    y = torch.empty(M * N, dtype=out_dtype, device=x_data.device)
    has_residual = r_data is not None
    r_data, r_block_scale = (r_data, r_block_scale) if has_residual else (x_data, x_block_scale)
    block_m, block_n, block_k = 128, 128, 128
    dense_native_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](
        x_data,
        x_block_scale,
        r_data,
        r_block_scale,
        x_global_scale,
        w_data,
        w_block_scale,
        w_global_scale,
        as_int16(y),
        M,
        N,
        K,
        *column_splits(N, splits),
        x_data.stride(0),
        x_block_scale.stride(0),
        w_data.stride(0),
        w_block_scale.stride(0),
        HAS_RESIDUAL=has_residual,
        OUT_BF16=out_dtype == torch.bfloat16,
        ROW_SCALE=row_scale,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return split_output(y, M, N, splits)


def grouped_matmul(
    x_data,
    x_block_scale,
    r_data,
    r_block_scale,
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
    """gpu_kernels.w4a4_experts.grouped_matmul on codes (x's and its residual's, as dense_matmul
    takes them; x_global_scale one, or one per row of x)."""
    E, N, K, chunk = expert_shape(w_data)
    row_scale = x_scale_is_per_row(x_global_scale, x_data.shape[0], "grouped_matmul")
    n_rows = row_ids.numel() if row_ids is not None else x_data.shape[0]
    y, flags, (row_ids, row_weights, row_weight_ids) = grouped_output(
        n_rows, N, counts, out_dtype, row_ids, row_weights, row_weight_ids, swiglu
    )
    if n_rows == 0:
        return y
    has_residual = r_data is not None
    r_data, r_block_scale = (r_data, r_block_scale) if has_residual else (x_data, x_block_scale)
    rows, n_out = y.shape
    block_m, block_n, block_k = 128, 128, 128
    # a K step is one chunk, or (K one chunk) block_k / 2 bytes further along the row
    steps = [
        t.stride(2) if chunk == block_k else block_k // per
        for t, per in ((w_data, 2), (w_block_scale, 16))
    ]
    # an upper bound on sum_e cdiv(counts[e], block_m): no host sync
    grid = (triton.cdiv(rows, block_m) + min(E, rows), triton.cdiv(n_out, block_n))
    grouped_native_kernel[grid](
        x_data,
        x_block_scale,
        r_data,
        r_block_scale,
        x_global_scale,
        row_ids,
        row_weights,
        row_weight_ids,
        w_data,
        w_block_scale,
        w_global_scale,
        counts,
        as_int16(y),
        N,
        K,
        E,
        x_data.stride(0),
        x_block_scale.stride(0),
        w_data.stride(0),
        w_data.stride(1),
        w_data.stride(3),
        steps[0],
        w_block_scale.stride(0),
        w_block_scale.stride(1),
        w_block_scale.stride(3),
        steps[1],
        y.stride(0),
        HAS_RESIDUAL=has_residual,
        OUT_BF16=out_dtype == torch.bfloat16,
        ROW_SCALE=row_scale,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        **flags,
    )
    return y


def disagreement(device):
    """Run both kernels once on a small check problem beside the Hopper kernels (w4a4_dense,
    w4a4_experts) -> None where they agree (relative error < 1e-3), else one line saying which
    failed and how."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(48, 256, generator=generator).to(device, torch.bfloat16)
    w = torch.randn(3 * 80, 256, generator=generator).to(device, torch.bfloat16)
    mask = torch.arange(16, device=device) % 2 == 0
    x_data, x_scale, r_data, r_scale, operand, x_global = quantize_activation(x, mask, codes=True)
    w_data, w_scale, _, _, _, w_global = quantize_activation(w, codes=True, operand=False)
    w_global = w_global.reshape(1)
    # three experts of 80 rows in their blocked layout: 16-row blocks by 128-element chunks of K
    experts = [t.reshape(3, 5, 16, 2, -1).transpose(2, 3).contiguous() for t in (w_data, w_scale)]
    experts = (*experts, w_global.expand(3).contiguous())
    counts = torch.tensor([20, 0, 28], device=device)
    dense = (w_data[:80], w_scale[:80], w_global, torch.float32)
    checks = (
        (
            "dense",
            lambda: dense_matmul(x_data, x_scale, r_data, r_scale, x_global, *dense),
            lambda: w4a4_dense.dense_matmul(operand, x_global, *dense),
        ),
        (
            "grouped",
            lambda: grouped_matmul(
                x_data, x_scale, r_data, r_scale, x_global, *experts, counts, torch.float32
            ),
            lambda: w4a4_experts.grouped_matmul(operand, x_global, *experts, counts, torch.float32),
        ),
    )
    for name, native, hopper in checks:
        expected = hopper()
        try:
            result = native()
        except Exception as error:
            # a compiler or launch failure: say so, the caller keeps the Hopper kernels
            first_line = str(error).splitlines()[0] if str(error) else ""
            return (
                f"the native FP4 {name} GEMM failed on {device} "
                f"({type(error).__name__}: {first_line})"
            )
        error = ((result - expected).norm() / expected.norm()).item()
        if not error < 1e-3:
            return (
                f"the native FP4 {name} GEMM disagrees with the Hopper kernels on {device} "
                f"(relative error {error:.2e})"
            )
    return None
