"""Prototype: a one-token W4A4 GEMV that runs all of K in each program (no split-K handoff).
HOIST: the program's weight bytes and block scales are loaded before x's amax and quantization, so x's chain
runs while they arrive. PRE: x given as the quantizer's fp16 operand planes (the GEMM alone)."""
import torch
import triton
import triton.language as tl

import nvfp4
import rac


@triton.jit
def gemv_kernel(x_ptr, x_words_ptr, mask_ptr, op_ptr, op_plane, xg_ptr, w_ptr, ws_ptr, wg_ptr, y_ptr,
                N, K, N1, N2, stride_w, stride_ws,
                HAS_RESIDUAL: tl.constexpr, X_BF16: tl.constexpr, OUT_BF16: tl.constexpr, GPU: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HOIST: tl.constexpr, PRE: tl.constexpr,
                XBCAST: tl.constexpr, EVEN: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr):
    if not PREFETCH:
        rac._after_previous_kernel(PDL)
    GB: tl.constexpr = BLOCK_K // 16
    cols = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_mask = cols < N
    blocks = tl.arange(0, GB)
    kmask = (blocks < K // 16) | EVEN  # EVEN (K == BLOCK_K): masks constant along K, wide loads
    byte_cols = (blocks[:, None] * 8 + tl.arange(0, 8)[None, :])[None, :, :]
    if HOIST:
        packed = tl.load(w_ptr + cols[:, None, None] * stride_w + byte_cols,
                         mask=col_mask[:, None, None] & kmask[None, :, None], other=0)
        sbyte = tl.load(ws_ptr + cols[:, None] * stride_ws + blocks[None, :],
                        mask=col_mask[:, None] & kmask[None, :], other=0)
    if PREFETCH:
        rac._after_previous_kernel(PDL)
    if PRE:
        x_global = tl.load(xg_ptr)
        if XBCAST:
            xp = op_ptr + byte_cols
            xm = kmask[None, :, None]
        else:
            xp = op_ptr + byte_cols + 0 * cols[:, None, None]
            xm = kmask[None, :, None] & col_mask[:, None, None]
        x_even = tl.load(xp, mask=xm, other=0.0)
        x_odd = tl.load(xp + op_plane, mask=xm, other=0.0)
    else:
        offs = tl.arange(0, BLOCK_K)
        v = tl.abs(tl.load(x_ptr + offs, mask=offs < K, other=0.0).to(tl.float32))
        x_global = rac._scale_from_amax(tl.max(tl.where(v == v, v, float("inf")), axis=0))
        _, _, _, _, _, _, ve, vo = rac._quantize_blocks(x_words_ptr, mask_ptr, blocks.to(tl.int64), kmask, K // 16,
                                                        x_global, HAS_RESIDUAL, X_BF16, GPU)
        x_even = (ve * rac._SHIFT).to(tl.float16)[None, :, :]
        x_odd = (vo * rac._SHIFT).to(tl.float16)[None, :, :]
    if not HOIST:
        packed = tl.load(w_ptr + cols[:, None, None] * stride_w + byte_cols,
                         mask=col_mask[:, None, None] & kmask[None, :, None], other=0)
        sbyte = tl.load(ws_ptr + cols[:, None] * stride_ws + blocks[None, :],
                        mask=col_mask[:, None] & kmask[None, :], other=0)
    scale = rac._e4m3_to_fp16(sbyte, GPU)[:, :, None]
    w_even, w_odd = rac._e2m1_pairs_to_fp16(packed, GPU)
    w_even, w_odd = w_even * scale, w_odd * scale
    prod = w_even.to(tl.float32) * x_even.to(tl.float32) + w_odd.to(tl.float32) * x_odd.to(tl.float32)
    acc = tl.sum(tl.sum(prod, axis=2), axis=1)[:, None]
    rows = tl.arange(0, 1)
    which, col_base, col_stride = rac._split_columns(cols, 1, N, N1, N2)
    out = acc * (rac._EPILOGUE * x_global * tl.load(wg_ptr + which, mask=col_mask, other=0.0)[:, None])
    rac._store_split(y_ptr, rows, rows < 1, col_base, col_stride, col_mask, out, OUT_BF16)


def gemv(x, w_q, rac_mask=None, splits=None, block_n=16, warps=4, hoist=True, act=None, xbcast=False, prefetch=False):
    M, K = x.shape
    assert M == 1
    N = w_q.shape[0]
    y = torch.empty(N, dtype=torch.bfloat16, device=x.device)
    w_data, w_scale = w_q.data, w_q.block_scale.view(torch.uint8)
    x = nvfp4._contiguous_pairs(x)
    mask = rac_mask.view(torch.uint8) if rac_mask is not None else w_data
    pre = act is not None
    op = act.operand if pre else w_data
    interp = rac._INTERPRET
    opts = rac._launch_options(x.device)
    gemv_kernel[(triton.cdiv(N, block_n),)](
        x, nvfp4._pair_view(x), mask, op, op.stride(0) if pre else 0, act.global_scale if pre else w_data,
        w_data, w_scale, w_q.global_scale, rac._as_int16(y), N, K, *rac._column_splits(w_q, splits),
        w_data.stride(0), w_scale.stride(0), HAS_RESIDUAL=rac_mask is not None,
        X_BF16=x.dtype == torch.bfloat16, OUT_BF16=True, GPU=not interp, BLOCK_N=block_n,
        BLOCK_K=triton.next_power_of_2(K), HOIST=hoist, PRE=pre, XBCAST=xbcast, EVEN=K == triton.next_power_of_2(K), PREFETCH=prefetch, num_warps=warps, **opts)
    return rac._split_output(y, 1, N, splits)


@triton.jit
def gemm16_kernel(x_ptr, x_global_ptr, w_ptr, w_scale_ptr, w_global_ptr, y_ptr, M, N, K, x_plane, N1, N2,
                  stride_x, stride_w, stride_ws, OUT_BF16: tl.constexpr, GPU: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr):
    """A few rows, all of K a program, tensor cores; the weight tile of the next K step loaded before the
    current step's MMAs (register double buffering); PREFETCH: the first one before the PDL wait."""
    if not PREFETCH:
        rac._after_previous_kernel(PDL)
    cols = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_mask = cols < N
    w_even, w_odd = rac._weight_tile(w_ptr, w_scale_ptr, cols, col_mask, 0, K, stride_w, stride_ws, BLOCK_N,
                                     BLOCK_K, True, GPU)
    if PREFETCH:
        rac._after_previous_kernel(PDL)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x_even, x_odd = rac._operand_tile(x_ptr, rows, row_mask, k0, K, stride_x, x_plane, BLOCK_K, True)
        n_even, n_odd = w_even, w_odd
        if k0 + BLOCK_K < K:
            n_even, n_odd = rac._weight_tile(w_ptr, w_scale_ptr, cols, col_mask, k0 + BLOCK_K, K, stride_w,
                                             stride_ws, BLOCK_N, BLOCK_K, True, GPU)
        acc = tl.dot(x_even, tl.trans(w_even), acc)
        acc = tl.dot(x_odd, tl.trans(w_odd), acc)
        w_even, w_odd = n_even, n_odd
    acc = tl.trans(acc)
    which, col_base, col_stride = rac._split_columns(cols, M, N, N1, N2)
    scale = rac._EPILOGUE * tl.load(x_global_ptr) * tl.load(w_global_ptr + which, mask=col_mask, other=0.0)[:, None]
    rac._store_split(y_ptr, rows, row_mask, col_base, col_stride, col_mask, acc * scale, OUT_BF16)


def gemm16(act, w_q, splits=None, block_n=32, block_k=256, warps=4, prefetch=True):
    M, K = act.operand.shape[1], w_q.shape[1]
    N = w_q.shape[0]
    y = torch.empty(M * N, dtype=torch.bfloat16, device=w_q.device)
    w_data, w_scale = w_q.data, w_q.block_scale.view(torch.uint8)
    gemm16_kernel[(triton.cdiv(N, block_n),)](
        act.operand, act.global_scale, w_data, w_scale, w_q.global_scale, rac._as_int16(y), M, N, K,
        act.operand.stride(0), *rac._column_splits(w_q, splits), act.operand.stride(1), w_data.stride(0),
        w_scale.stride(0), OUT_BF16=True, GPU=not rac._INTERPRET, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
        PREFETCH=prefetch, num_warps=warps, num_stages=1, **rac._launch_options(w_q.device))
    return rac._split_output(y, M, N, splits)
