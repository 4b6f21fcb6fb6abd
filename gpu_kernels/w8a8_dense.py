"""The FP8 W8A8 dense GEMM for GPUs with FP8 tensor cores (sm_89 / sm_90): y = x @ W.T on the E4M3
codes of x (per token row) and W (per weight row). It equals fp8.linear_reference (dequantize both
operands, multiply in fp32, round to BF16) up to fp32 accumulation order; FUSED, on
fp8.quantize_rowwise's codes of x, which it makes itself.

The scales leave the sum (w8a8_common.py derives it), so the K loop multiplies the codes as stored
and the epilogue scales the fp32 tile once:

    y[m, n] = sx[m] * sw[n] * sum_k xc[m, k] wc[n, k]

The kernel computes y.T = W @ x.T: the weight rows on the MMA's wide side (its M: 64 a warpgroup),
the few token rows of a decode step on its narrow side (16 and up). Decode streams the weight once:
split-K gives the stream enough programs, and the last of a tile's SPLIT_K programs to arrive sums
their partial tiles in a fixed order (deterministic). FUSED: the GEMM takes x itself and quantizes
each tile in registers (a program first reduces its rows' amax over all of K, with
w8a8_quantize.py's steps): no quantizer launch, but every N tile's program redoes the division;
FUSE_MAX_ROWS says up to how many rows the layers take it. Tile sizes are autotuned per bucket of
rows (CUDA-graph timing), as for the W4A4 kernels.

Entry points: linear (x in bf16/fp16/fp32, quantized here or by the quantizer first) and
linear_codes (x already quantized by w8a8_quantize.quantize_rows).
"""

import torch
import triton
import triton.language as tl

from gpu_kernels import INTERPRET
from gpu_kernels.gemm_common import (
    EVEN_K_HEURISTICS,
    as_int16,
    bench_in_graph,
    m_bucket,
    prune_to_bucket,
    store_tile,
)
from gpu_kernels.w8a8_common import (
    INTERPRETER_CONFIGS,
    autotune_configs,
    check_out_dtype,
    check_scale,
    check_weight,
    mainloop,
)
from gpu_kernels.w8a8_quantize import FLOATS, check_rows, quantize_rows, row_scale, rows_amax

# the layers' dense GEMM quantizes x itself up to this many rows (one launch, not two)
FUSE_MAX_ROWS = 16


# ------------------------------------------------------------------ autotuning
# (BLOCK_M token rows, BLOCK_N weight rows, BLOCK_K, warps, stages, SPLIT_K) per M bucket. Decode
# buckets stream the weight: few token rows, long contiguous runs per weight row (BLOCK_K bytes),
# and enough (N tile, K split) programs to keep every SM's loads in flight (k/v_proj's 512 rows are
# 8 tiles of 64: splits of 8); prefill tiles are square-ish for the tensor cores. All compile for
# sm_90 with Triton 3.6 without spilling (ptxas), but for the fused variant of (128, 64, 128)
# (a few registers). Under the interpreter: w8a8_common.INTERPRETER_CONFIGS.
DENSE_CONFIGS = {
    16: [
        (16, 64, 256, 4, 4, 2),
        (16, 64, 256, 4, 3, 4),
        (16, 128, 256, 4, 3, 2),
        (16, 64, 128, 4, 4, 4),
        (16, 64, 128, 4, 3, 8),
    ],
    64: [
        (32, 64, 256, 4, 3, 2),
        (64, 64, 256, 4, 3, 2),
        (64, 128, 128, 4, 4, 1),
        (32, 128, 256, 8, 3, 1),
        (64, 64, 128, 4, 4, 4),
        (64, 64, 128, 4, 3, 8),
    ],
    256: [
        (64, 128, 128, 4, 4, 1),
        (128, 128, 128, 8, 3, 1),
        (64, 64, 256, 4, 3, 2),
        (128, 64, 128, 4, 4, 1),
    ],
    4096: [
        (128, 128, 128, 8, 3, 1),
        (128, 128, 128, 8, 4, 1),
        (64, 128, 128, 4, 4, 1),
        (128, 64, 128, 4, 4, 1),
    ],
}


# ------------------------------------------------------------------ the dense GEMM
# Reference: fp8.linear_reference (FUSED: on fp8.quantize_rowwise's codes of x).
@triton.autotune(
    configs=autotune_configs(DENSE_CONFIGS, has_split_k=True),
    key=["M_BUCKET", "N", "K", "FUSED"],
    prune_configs_by={"early_config_prune": prune_to_bucket},
    do_bench=bench_in_graph,
)
@triton.heuristics(EVEN_K_HEURISTICS)
@triton.jit(do_not_specialize=["M"])
def dense_kernel(
    # pointers: x's codes and row scales, or (FUSED) x itself; the weight's codes and row scales; y;
    # split-K: partial tiles and per-tile arrival counters
    x_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    y_ptr,
    workspace_ptr,
    counter_ptr,
    # sizes (M_BUCKET: the autotuning key)
    M,
    N,
    K,
    M_BUCKET,
    # strides (elements)
    stride_x,
    stride_w,
    stride_y,
    # meta-parameters
    FUSED: tl.constexpr,
    OUT_BF16: tl.constexpr,
    GPU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BUCKET: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    # N tiles vary fastest: programs running together share the activation rows and stream disjoint
    # weight rows
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    n_tiles = tl.cdiv(N, BLOCK_N)
    rows = (pid // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = rows.to(tl.int64)
    cols = ((pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_mask = cols < N
    # the quantizer's first pass, for this program's rows (every split needs the whole row's amax)
    if FUSED:
        AMAX_K: tl.constexpr = 8192 // BLOCK_M
        x_scale = row_scale(rows_amax(x_ptr, rows, row_mask, stride_x, K, BLOCK_M, AMAX_K))
    else:
        x_scale = tl.load(x_scale_ptr + rows, mask=row_mask, other=1.0)
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    acc = mainloop(
        x_ptr,
        rows,
        row_mask,
        stride_x,
        x_scale,
        w_ptr,
        cols,
        col_mask,
        stride_w,
        k_begin,
        k_end,
        K,
        FUSED,
        GPU,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        EVEN_K,
    )
    scale = tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)[:, None] * x_scale[None, :]
    if SPLIT_K == 1:
        store_tile(y_ptr, rows, row_mask, cols, col_mask, stride_y, acc * scale, OUT_BF16)
    else:
        # each split stores its partial tile; the last to arrive (an acq_rel counter per tile) adds
        # the SPLIT_K partials in a fixed order (deterministic), resets the counter and stores y
        tile: tl.constexpr = BLOCK_N * BLOCK_M
        offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        part_ptr = workspace_ptr + pid.to(tl.int64) * (SPLIT_K * tile) + offs
        tl.store(part_ptr + pid_k * tile, acc)
        tl.debug_barrier()  # all partials issued
        arrived = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel")
        tl.debug_barrier()
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for split in range(SPLIT_K):
                total += tl.load(part_ptr + split * tile, cache_modifier=".cg")
            tl.atomic_xchg(counter_ptr + pid, 0)  # ready for the next call
            store_tile(y_ptr, rows, row_mask, cols, col_mask, stride_y, total * scale, OUT_BF16)


# ------------------------------------------------------------------ launches
SPLIT_COUNTERS = {}


def _split_k_buffers(M, N, bucket, device):
    """Scratch for split-K partial tiles (written before read: no init) and the per-tile arrival
    counters (zero, reset to zero by the kernel itself: kept per device). Counters are shared by all
    calls, so split-K launches must not run concurrently on two streams."""
    configs = INTERPRETER_CONFIGS if INTERPRET else DENSE_CONFIGS
    splits = [
        (bm, bn, split)
        for bm, bn, _, _, _, split in configs[m_bucket(bucket, configs)]
        if split > 1
    ]
    if not splits:
        return (
            torch.empty(1, dtype=torch.float32, device=device),
            torch.empty(1, dtype=torch.int32, device=device),
        )
    size = max(
        split * triton.cdiv(M, bm) * bm * triton.cdiv(N, bn) * bn for bm, bn, split in splits
    )
    tiles = max(triton.cdiv(M, bm) * triton.cdiv(N, bn) for bm, bn, _ in splits)
    counters = SPLIT_COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        counters = SPLIT_COUNTERS[device] = torch.zeros(
            max(tiles, 4096), dtype=torch.int32, device=device
        )
    return torch.empty(size, dtype=torch.float32, device=device), counters


def _dense(x, x_scale, w_codes, w_scale, out_dtype, fused):
    M, K = x.shape
    N = w_codes.shape[0]
    y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0:
        return y
    bucket = m_bucket(M, DENSE_CONFIGS)
    workspace, counters = _split_k_buffers(M, N, bucket, x.device)

    def grid(meta):
        return triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"]

    dense_kernel[grid](
        x,
        x_scale,
        w_codes,
        w_scale,
        as_int16(y),
        workspace,
        counters,
        M,
        N,
        K,
        bucket,
        x.stride(0),
        K,
        N,
        FUSED=fused,
        OUT_BF16=out_dtype == torch.bfloat16,
        GPU=not INTERPRET,
    )
    return y


def linear_codes(x_codes, x_scale, w_codes, w_scale, out_dtype=torch.bfloat16):
    """The dense GEMM on a quantized activation: x_codes (M, K) float8_e4m3fn and x_scale (M, 1)
    fp32 (quantize_rows), w_codes (N, K) float8_e4m3fn and w_scale (N,) fp32 (fp8.quantize_weight)
    -> y (M, N) out_dtype."""
    x_codes = check_rows("x_codes", x_codes, (torch.float8_e4m3fn,), "float8_e4m3fn")
    check_scale(x_scale, x_codes.shape[0], x_codes.device)
    check_weight(w_codes, w_scale, x_codes.shape[1], x_codes.device)
    check_out_dtype(out_dtype)
    return _dense(x_codes, x_scale, w_codes, w_scale, out_dtype, False)


def linear(x, w_codes, w_scale, fused=None, out_dtype=torch.bfloat16):
    """The W8A8 layer: x (M, K) bf16/fp16/fp32 quantized per row, times
    (w_codes * w_scale[:, None]).T -> (M, N) out_dtype. fused: the GEMM quantizes x itself, one
    launch (None: up to FUSE_MAX_ROWS rows); else the quantizer runs first. Either way the codes are
    fp8.quantize_rowwise's."""
    x = check_rows("x", x, FLOATS, "bfloat16/float16/float32")
    check_weight(w_codes, w_scale, x.shape[1], x.device)
    check_out_dtype(out_dtype)
    if x.shape[0] <= FUSE_MAX_ROWS if fused is None else fused:
        return _dense(x, w_scale, w_codes, w_scale, out_dtype, True)  # (x_scale: unread)
    return _dense(*quantize_rows(x), w_codes, w_scale, out_dtype, False)
